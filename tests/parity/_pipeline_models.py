"""Model builders for ``compressor report --model-fn`` in the pipeline test (importable by module path)."""

from __future__ import annotations

import torch
from torch import nn

C, N_CLASSES = 64, 10


class Res(nn.Module):
    """conv1 and conv3 meet at an add: one coupled channel group."""

    def __init__(self, c: int = C):
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.conv3 = nn.Conv2d(c, c, 3, padding=1)
        self.conv4 = nn.Conv2d(c, c, 3, padding=1)
        self.fc = nn.Linear(c, N_CLASSES)

    def forward(self, x):
        a = torch.relu(self.conv1(x))
        b = self.conv3(torch.relu(self.conv2(a)))
        c = torch.relu(self.conv4(torch.relu(a + b)))
        return self.fc(c.mean((2, 3)))


def torch_small() -> Res:
    """The architecture after pruning half of every conv's filters and speedup."""
    return Res(C // 2)

"""README snippets marked ``<!-- doctest: torch -->`` (see tests/test_docs.py)."""

import pytest
import torch

from tests.test_docs import params, run_block


@pytest.mark.parametrize(("line", "code"), params("torch"))
def test_readme_torch_block(line, code, tmp_path, monkeypatch):
    torch.manual_seed(0)
    run_block(line, code, tmp_path, monkeypatch)

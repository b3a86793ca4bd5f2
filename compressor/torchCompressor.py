"""The seed-004 prototype API on PyTorch (``from compressor import torchCompressor``): the names of
:mod:`compressor.compat.prototype_torch`, where it is written and documented. Imports torch, never tensorflow."""

from .compat.prototype_torch import *  # noqa: F403
from .compat.prototype_torch import __all__  # noqa: F401

"""The seed-004 prototype API on TensorFlow / Keras 3 (``from compressor import tfCompressor``): the names of
:mod:`compressor.compat.prototype_tf`, where it is written and documented. Imports tensorflow, never torch."""

from .compat.prototype_tf import *  # noqa: F403
from .compat.prototype_tf import __all__  # noqa: F401

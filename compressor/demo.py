"""Old path of :mod:`compressor.app.demo` (the demo driver and its harnesses), kept so
``from compressor.demo import get_harness`` keeps working: importing it gives that module itself."""

import sys

from .app import demo as _app_demo

sys.modules[__name__] = _app_demo

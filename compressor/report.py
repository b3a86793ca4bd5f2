"""Old path of :mod:`compressor.app.report` (the report of exported model files), kept so
``from compressor.report import ...`` keeps working: importing it gives that module itself."""

import sys

from .app import report as _app_report

sys.modules[__name__] = _app_report

"""Old path of :mod:`compressor.app.cli` (the command line), kept so ``python -m compressor.cli`` and
``from compressor.cli import main`` keep working: importing it gives that module itself."""

import sys

from .app import cli as _app_cli

if __name__ == "__main__":
    raise SystemExit(_app_cli.main())
sys.modules[__name__] = _app_cli

"""``python -m benchmarks``: run the whole suite (see :mod:`benchmarks.run`)."""

from benchmarks.run import main

raise SystemExit(main())

"""``python -m benchmarks``: run every benchmark (see :mod:`benchmarks.run`)."""

from benchmarks.run import main

raise SystemExit(main())

"""``python -m lossscale``: the ``lossscale`` command line (see :mod:`lossscale.demo._cli`)."""

import sys

from lossscale.demo._cli import main

if __name__ == "__main__":
    sys.exit(main())

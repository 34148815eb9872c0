"""``python -m dtshard.demo``: see :mod:`dtshard.demo`."""

import sys

from dtshard.demo.cli import main

if __name__ == "__main__":
    sys.exit(main())

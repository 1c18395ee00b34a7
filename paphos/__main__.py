"""`python -m paphos ...`: the same entry point as the `paphos` console script."""

import sys

from paphos.cli import main

# Guarded: the engine core's process (multiprocessing spawn) imports this module again.
if __name__ == "__main__":
    sys.exit(main())

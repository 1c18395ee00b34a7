"""`python -m paphos ...`: the same entry point as the `paphos` console script."""

import sys

from paphos.cli import main

sys.exit(main())

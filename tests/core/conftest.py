"""Make `paphos` and the helpers next to these tests importable when pytest runs from a checkout
without an installed package (harmless once pyproject sets pytest's `pythonpath`)."""

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _path in (_HERE.parents[1], _HERE):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

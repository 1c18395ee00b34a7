"""The engine core must import without torch (design.md §3: unit-tested on CPU in milliseconds)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "paphos" / "core"


def test_core_does_not_import_torch():
    modules = sorted(p.stem for p in CORE.glob("*.py") if p.stem != "__init__")
    assert {"scheduler", "kv_cache_manager", "block_pool"} <= set(modules)
    code = (
        "import importlib, sys\n"
        "import paphos.core\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module('paphos.core.' + m)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, env={"PYTHONPATH": str(REPO)})

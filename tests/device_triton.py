"""The H200 image's triton (3.6), installed by `make install` beside the venv's own: the sm_90
compile tests run once with each, since a kernel may lower under one and not the other; and the
compile itself, which those tests' child processes run (`compile_sm90`)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def compile_sm90(fn: object, args: dict[str, str], constexprs: dict[str, object], warps: int,
                 ints: dict[str, int] | None = None, stages: int = 3, ttgir: bool = False,
                 sass: bool = False) -> str:  # fmt: skip
    """PTX of the kernel for sm_90 with ptxas' resource usage appended (cuobjdump of the cubin),
    and its TTGIR after that with `ttgir` (the layouts Triton chose), its SASS with `sass`;
    pointers 16-byte aligned and integer arguments specialised as a launch does (`ints`: their
    values, a multiple of 16 is marked divisible)."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**args, **{name: "constexpr" for name in constexprs}}
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(signature)
        if args.get(name, "").startswith("*") or (ints or {}).get(name, 1) % 16 == 0
    }
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "-res-usage", cubin.name], capture_output=True, text=True).stdout
        if sass:
            usage += subprocess.run([str(cuobjdump), "-sass", cubin.name], capture_output=True, text=True).stdout
    return kernel.asm["ptx"] + usage + (kernel.asm["ttgir"] if ttgir else "")


def check_compiles_in_child(module: str, cases: Mapping[str, tuple], triton_path: Path | None) -> None:
    """Runs `python -m module` (whose main is `run_compiles(cases)`) without the interpreter and
    with the chosen triton: every case must print `<name>:ok`."""
    done = subprocess.run(
        [sys.executable, "-m", module], env=compile_env(triton_path), cwd=ROOT, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    compiled = done.stdout.split()
    assert len(compiled) == len(cases) and all(line.endswith(":ok") for line in compiled), done.stdout


_cases: Mapping[str, tuple[Callable[..., None], ...]] = {}


def _run_case(name: str) -> None:
    fn, *args = _cases[name]
    fn(*args)


def run_compiles(cases: Mapping[str, tuple[Callable[..., None], ...]]) -> None:
    """The child side of `check_compiles_in_child`: each case's compile, then `<name>:ok` in the
    cases' order; a failing case raises here, with its traceback. The compiles run in a process
    pool, one worker per core: each is single-threaded, and these tests were CI's longest part.
    Forked, so the workers see the cases (kernels need no pickling) and the triton imported."""
    global _cases
    sys.path.insert(0, str(ROOT))
    _cases = cases
    fork = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=fork) as pool:
        futures = {name: pool.submit(_run_case, name) for name in cases}
        for name, future in futures.items():
            future.result()
            print(f"{name}:ok", flush=True)

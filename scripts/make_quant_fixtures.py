"""Make the quantized-checkpoint fixtures in `tests/quant/data/checkpoints/` with the real tools:
GPTQModel, llm-compressor (compressed-tensors) and AutoAWQ, each in its own venv outside the repo
(their transformers/numpy pins exclude each other, and none belongs in the project venv). CI never
runs this; it reads what this wrote, as with `make_llamacpp_golden.py` and `tests/golden/`.

Regenerate everything (venvs take 2-3 min each to create; the fixtures about 3 min in all on a
2-core CPU):

    .venv/bin/python scripts/make_quant_fixtures.py --setup-venvs     # once: /tmp/qvenv-*
    .venv/bin/python scripts/make_quant_fixtures.py                   # every fixture
    .venv/bin/python scripts/make_quant_fixtures.py gptq-4b-g128-sym ct-fp8-static   # some

`--setup-venvs` runs, for each venv in `VENVS` (torch first and pinned, else pip pulls the
multi-GB CUDA build):

    python3.11 -m venv /tmp/qvenv-gptqmodel
    /tmp/qvenv-gptqmodel/bin/pip install torch==2.13.0
    /tmp/qvenv-gptqmodel/bin/pip install torch==2.13.0 gptqmodel==7.6.0
    ... likewise qvenv-llmc (llmcompressor==0.14.0.1), qvenv-llmc013 (llmcompressor==0.13.0, for
    actorder "group", which 0.14 removed) and qvenv-awq (autoawq==0.2.9 transformers==4.51.3)

The driver (project venv: torch + transformers) builds the fp32 tiny Llama once in `--work`
(`quant_fixtures.common.build_source`), then runs each tool module in its venv, which quantizes,
saves into `tests/quant/data/checkpoints/<fixture>/` and writes the tool's reference outputs to
`tests/quant/data/references/<fixture>.safetensors` (see `quant_fixtures.common`). Tools run with `--work` as their working directory: GPTQModel
and llm-compressor drop log folders there. Larger checkpoints (SmolLM2-135M) come from the same
recipes with another source directory; none are committed.

Fixtures the tools cannot make, and what was made instead:
- group 128 with compressed-tensors: llm-compressor cannot quantize K=320 (down_proj) in groups of
  128 even with bypass_divisibility_checks=True, so the asymmetric RTN fixture uses group 64
  (`ct-w4a16-asym-g64`); GPTQModel writes the short last group (`gptq-4b-g128-sym`).
- compressed-tensors writes `naive-quantized` only when told to (`ct-naive-w8a8`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = REPO_ROOT / "scripts"
OUT_ROOT = REPO_ROOT / "tests" / "quant" / "data" / "checkpoints"
TORCH_PIN = "torch==2.13.0"  # the CPU wheel available here; any other version pulls the CUDA build

# venv name -> (pip requirements, tool module, fixtures made in that venv)
VENVS: dict[str, tuple[list[str], str, list[str]]] = {
    "qvenv-gptqmodel": (
        ["gptqmodel==7.6.0"],
        "quant_fixtures.gptqmodel_fixtures",
        ["gptq-4b-g128-sym", "gptq-4b-g32-asym-actorder", "gptq-4b-g64-asym-v2", "gptq-8b-perchannel-sym",
         "gptq-4b-g128-sym-lmhead", "gptq-3b-g32-asym", "gptq-2b-g64-sym", "awq-gemm-4b-g64"],
    ),
    "qvenv-llmc": (
        ["llmcompressor==0.14.0.1"],
        "quant_fixtures.llmc_fixtures",
        ["ct-w4a16-sym-g64", "ct-w4a16-asym-g64", "ct-w8a16-channel", "ct-awq-asym-g64", "ct-fp8-dynamic",
         "ct-fp8-static", "ct-fp8-block", "ct-naive-w8a8", "ct-fp8-dynamic-kv"],
    ),
    "qvenv-llmc013": (["llmcompressor==0.13.0"], "quant_fixtures.llmc_fixtures", ["ct-w4a16-gptq-actorder-group"]),
    "qvenv-awq": (["autoawq==0.2.9", "transformers==4.51.3"], "quant_fixtures.autoawq_fixtures",
                  ["awq-gemm-4b-g64-autoawq"]),
}


def setup_venvs(root: Path, names: list[str]) -> None:
    for name in names:
        venv = root / name
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "-q"]
        subprocess.run([*pip, TORCH_PIN], check=True)
        subprocess.run([*pip, TORCH_PIN, *VENVS[name][0]], check=True)
        print(f"{venv}: {time.monotonic() - start:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", nargs="*", help="fixture names (default: all)")
    ap.add_argument("--venv-root", type=Path, default=Path("/tmp"), help="where the qvenv-* venvs live")
    ap.add_argument("--setup-venvs", action="store_true", help="create the venvs of the chosen fixtures, then stop")
    ap.add_argument("--work", type=Path, default=Path("/tmp/paphos-quant-fixtures"),
                    help="the source model and the tools' working directory")
    ap.add_argument("--out-root", type=Path, default=OUT_ROOT)
    args = ap.parse_args()

    known = {f: venv for venv, (_, _, fixtures) in VENVS.items() for f in fixtures}
    unknown = sorted(set(args.fixtures) - set(known))
    if unknown:
        raise SystemExit(f"unknown fixtures {unknown}; known: {sorted(known)}")
    wanted = args.fixtures or list(known)
    venvs = [v for v in VENVS if any(known[f] == v for f in wanted)]
    if args.setup_venvs:
        setup_venvs(args.venv_root, venvs)
        return

    sys.path.insert(0, str(SCRIPTS))
    from quant_fixtures.common import build_source

    source = args.work / "source"
    if not (source / "model.safetensors").exists():
        source.mkdir(parents=True, exist_ok=True)
        build_source(source)
    args.out_root.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS))
    for venv in venvs:
        python = args.venv_root / venv / "bin" / "python"
        names = [f for f in wanted if known[f] == venv]
        cmd = [str(python), "-m", VENVS[venv][1], "--source", str(source), "--out-root", str(args.out_root), *names]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=args.work, env=env)

    sizes = {f: sum(p.stat().st_size for p in (args.out_root / f).iterdir()) for f in wanted}
    for f, size in sizes.items():
        print(f"{f:32s} {size / 1e6:6.2f} MB")
    total = sum(p.stat().st_size for p in args.out_root.rglob("*") if p.is_file())
    print(f"{args.out_root}: {total / 1e6:.2f} MB in all")


if __name__ == "__main__":
    main()

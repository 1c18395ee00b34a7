"""EXL2 fixtures made by exllamav2 0.3.2 itself, on the H200 (its converter and kernels need CUDA):
what proves paphos/quant/exl2.py against the tool rather than against tests/quant/test_exl2.py's
own encoder.

Run on the H200 with exllamav2 0.3.2 (about 4.5 minutes: 160 s to build its extension, then about
50 s per fixture); the committed fixtures are that run's.

Per fixture: the common fp32 tiny Llama (`common.build_source`) is converted by
`python -m exllamav2.conversion.convert_exl2` at the fixture's bits per weight, calibrated on the
common calibration set (`common.calibration_texts()` in a parquet; the WordLevel tokenizer maps it
back to exactly `common.calibration_ids()`, which is checked after conversion). Then the converted
checkpoint is loaded with `ExLlamaV2` and gives:
- the tool's weights: `get_weight_tensor_dq()` of every quantized linear (its CUDA reconstruction,
  fp16). exllamav2 loads an MLP with its intermediate rows permuted: `down_proj` without its
  permutation (`unmap=True`) and the output columns of `gate_proj` / `up_proj` remapped to match,
  so what it returns for those three is the true weight permuted by argsort(down_proj.q_invperm);
  that permutation, read from the checkpoint, is undone here, and `common.finish_fixture`'s
  check against the source weights (relative error <= 0.3) would catch a wrong undoing;
- the tool's logits: its fp16 forward one token at a time through an `ExLlamaV2Cache`, which is
  causal whatever the attention backend (0.3.2's cache-less prompt forward is not without
  flash-attn, quant-toolchain.md §5.4);
and `common.finish_fixture` adds the fp32 HF model on the tool's weights: its logits and greedy
tokens, the references paphos must meet (tests/quant/test_checkpoint_parity.py).

Against paphos/quant/exl2.py: the tool's weights are fp16(code * scale), which paphos reproduces
bit for bit, so paphos's fp32 logits meet `dequant_logits` within 1e-4.

The converter runs the same attention on its calibration data, so without flash-attn it optimizes
on non-causal activations: the files are valid EXL2, only their quality is not what a causal
calibration would give, which does not matter to a parity fixture.

Fixtures: `exl2-4.0bpw-h6` (-b 4.0 -hb 6; the doc's tiny model at 4.0 bpw mixed 2/3/4/5/8-bit
groups) and `exl2-6.0bpw-h8` (5/6/8-bit groups, an 8-bit head). No 2.5 bpw one: its mostly 2-bit
tensors would fail the weight sanity bound on random weights (even at 4.0 bpw the converter gives
the first layer 2- and 3-bit groups: relative error 0.40, hence this tool's bound of 0.6).

Wheels to carry (not in the device image; pandas, pyarrow, ninja, safetensors, tokenizers, rich,
pygments, regex and pillow are): exllamav2==0.3.2 (pure Python, JIT-builds its extension on first
import: about 150 s), fastparquet==2026.9.0, cramjam==2.14.0. Here, in the repo root:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl exllamav2==0.3.2 fastparquet==2026.9.0 cramjam==2.14.0

On the device (`run`, carry [".whl"], timeout 600; one call: build + both fixtures should take
about 5 minutes; if not, pass fixture names to split it over calls while the machine stays warm,
the built extension stays in /tmp/torch_ext):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:scripts TORCH_EXTENSIONS_DIR=/tmp/torch_ext MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 \
    && python3 -c "import exllamav2, exllamav2.ext" \
    && python3 -c "from pathlib import Path; from quant_fixtures.common import build_source; build_source(Path('/tmp/exl2-src'))" \
    && python3 -m quant_fixtures.exllamav2_fixtures --source /tmp/exl2-src --out-root /tmp/fx/checkpoints \
    && tar czf $OUT/exl2.tgz -C /tmp/fx checkpoints references

(one archive: the device returns at most 8 files, and the references are written beside the
checkpoints' folder). Back here, its `checkpoints/<fixture>/` goes to tests/quant/data/checkpoints/
and `references/<fixture>.safetensors` to tests/quant/data/references/.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import torch
from safetensors.torch import load_file

from quant_fixtures.common import (
    N_PROMPTS,
    VOCAB,
    ToolReference,
    calibration_ids,
    calibration_texts,
    read_checkpoint,
    run_tool,
)

# fp16 kernels (exllamav2 accumulates partly in half precision) against the fp32 reference, with
# logits up to ~15 (lm_head x20)
LOGITS_TOL = 0.25
# Converter work directories (job state, measurement, calibration ids), kept out of the fixtures.
WORK = Path(tempfile.gettempdir()) / "paphos-exl2-work"
MLP_PARTS = ("gate_proj", "up_proj")


def _calibration_parquet(path: Path) -> None:
    """One row of text per calibration sample: the converter joins a row's columns with spaces and
    concatenates the rows' tokens, 32 rows x 64 tokens."""
    import pandas

    pandas.DataFrame({"text": calibration_texts()}).to_parquet(path, engine="fastparquet")


def _convert(source: Path, out: Path, bits: float, head_bits: int) -> dict:
    work = WORK / out.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _calibration_parquet(work / "calibration.parquet")
    rows, length = calibration_ids().shape
    args = ["-i", str(source), "-o", str(work / "job"), "-cf", str(out), "-b", str(bits), "-hb", str(head_bits),
            "-c", str(work / "calibration.parquet"), "-r", str(rows), "-mr", str(rows), "-l", str(length),
            "-ml", str(length)]  # fmt: skip
    subprocess.run([sys.executable, "-m", "exllamav2.conversion.convert_exl2", *args], check=True, cwd=work)
    used = load_file(str(work / "job" / "cal_data.safetensors"))["input_ids"]
    if not torch.equal(used, calibration_ids()):
        raise AssertionError(f"{out.name}: the converter tokenized the calibration set differently: {used[:, :8]}")
    options = dict(zip(args[0::2], args[1::2], strict=True))
    options |= {"-i": "source", "-o": "work", "-cf": out.name, "-c": "calibration.parquet"}  # no machine paths
    return {"convert_exl2": options,
            "calibration": "common.calibration_texts() as a one-column parquet: exactly common.calibration_ids()"}


def _load(ckpt: Path):  # noqa: ANN202
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config(str(ckpt))
    config.arch_compat_overrides()
    config.max_batch_size = N_PROMPTS
    model = ExLlamaV2(config)
    model.load()
    return model


def _tool_weights(model, ckpt: Path) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """HF name -> float32 [out, in] of every quantized linear, MLP permutation undone."""
    from exllamav2.linear import ExLlamaV2Linear

    stored = read_checkpoint(ckpt)
    weights = {}
    for key, module in model.modules_dict.items():
        if isinstance(module, ExLlamaV2Linear):
            with torch.inference_mode():
                w = module.get_weight_tensor_dq().float().cpu().t()  # [out + padding, in]
            weights[f"{key}.weight"] = w[: module.out_features - module.padding].contiguous()
    quantized = {f"{n.removesuffix('.q_weight')}.weight" for n in stored if n.endswith(".q_weight")}
    if set(weights) != quantized:
        raise AssertionError(f"{ckpt.name}: exllamav2's linears {sorted(weights)} are not the file's {sorted(quantized)}")
    for down in [n for n in weights if n.endswith(".mlp.down_proj.weight")]:
        mlp = down.removesuffix(".down_proj.weight")
        invperm = stored[f"{mlp}.down_proj.q_invperm"].long()
        weights[down] = weights[down][:, invperm].contiguous()  # its input columns are in stored order
        for part in MLP_PARTS:  # their output rows were remapped to that order
            weights[f"{mlp}.{part}.weight"] = weights[f"{mlp}.{part}.weight"][invperm].contiguous()
    return weights


def _tool_forward(model) -> Callable[[torch.Tensor], torch.Tensor]:  # noqa: ANN001
    from exllamav2 import ExLlamaV2Cache

    def forward(ids: torch.Tensor) -> torch.Tensor:
        cache = ExLlamaV2Cache(model, batch_size=ids.shape[0], max_seq_len=ids.shape[1])
        steps = []
        with torch.inference_mode():
            for t in range(ids.shape[1]):
                steps.append(model.forward(ids[:, t : t + 1], cache).float().cpu()[..., :VOCAB])
        return torch.cat(steps, dim=1)

    return forward


def _bit_widths(ckpt: Path) -> list[int]:
    stored = read_checkpoint(ckpt)
    return sorted({int(b) for n, t in stored.items() if n.endswith(".q_groups") for b in t[0::2].tolist()})


def _fixture(bits: float, head_bits: int) -> Callable[[Path, Path], ToolReference]:
    def make(source: Path, out: Path) -> ToolReference:
        recipe = _convert(source, out, bits, head_bits)
        model = _load(out)
        return ToolReference(
            tool=f"exllamav2 {version('exllamav2')}",
            recipe=recipe,
            dequant=_tool_weights(model, out),
            tool_forward=_tool_forward(model),
            tool_logits_note="exllamav2 fp16 forward, one token at a time through an ExLlamaV2Cache (causal)",
            logits_tol=LOGITS_TOL,
            # the converter gives this random model's first layer mostly 2- and 3-bit groups at
            # 4.0 bpw (relative error 0.40 measured there)
            max_rel_weight_error=0.6,
            notes=[
                "Tool weights: get_weight_tensor_dq() (fp16 reconstruction), the MLP intermediate permutation "
                "exllamav2 applies at load undone with argsort(down_proj.q_invperm).",
                f"Bit widths in the file: {_bit_widths(out)}.",
            ],
        )

    return make


FIXTURES = {"exl2-4.0bpw-h6": _fixture(4.0, 6), "exl2-6.0bpw-h8": _fixture(6.0, 8)}

if __name__ == "__main__":
    run_tool(FIXTURES)

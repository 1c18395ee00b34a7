"""GPTQ (v1/v2, act-order, per-channel, quantized lm_head) and AWQ-GEMM fixtures made by GPTQModel
7.6.0 on CPU; runs in the GPTQModel venv (see scripts/make_quant_fixtures.py).

Quantizes the fp32 source with the 32 calibration rows, saves with `GPTQModel.save`, then reloads
the saved checkpoint with GPTQModel's torch backends: their forward in float16 gives `tool_logits`,
and each quantized module's own dequantization, run with its scales widened to float32 so that
`scale * (q - zero)` is exact, gives the reference weights.
"""

from __future__ import annotations

import os
from pathlib import Path

# GPTQModel sizes its CPU worker pool as (cores+1)//2 and then refuses that pool on 2 cores.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import torch  # noqa: E402

from quant_fixtures.common import ToolReference, calibration_ids, run_tool  # noqa: E402

TOOL_DTYPE = torch.float16  # GPTQModel's torch kernels take fp16/bf16 only; fp16 keeps the fp16 scales exact
# float16 forward vs the float32 reference, with logits up to ~10 (lm_head x20)
LOGITS_TOL = 0.1


def _calibration() -> list[dict[str, list[int]]]:
    return [{"input_ids": row.tolist(), "attention_mask": [1] * len(row)} for row in calibration_ids()]


def _tool() -> str:
    import gptqmodel

    return f"gptqmodel {gptqmodel.__version__}"


def _quantize(source: Path, out: Path, config_args: dict, dtype: torch.dtype = torch.float32, **quantize_args) -> dict:
    from gptqmodel import GPTQModel, QuantizeConfig

    # fp32 where the tool allows it: bf16 matmuls are very slow on CPUs without bf16 instructions.
    args = dict(config_args, offload_to_disk=False)
    model = GPTQModel.load(str(source), QuantizeConfig(**args), device="cpu", dtype=dtype)
    quantize_args = dict(batch_size=1, **quantize_args)
    model.quantize(_calibration(), **quantize_args)
    model.save(str(out))
    def plain(d: dict) -> dict:
        return {k: getattr(v, "value", v) for k, v in d.items()}

    return {"QuantizeConfig": plain(args), "quantize": plain(quantize_args),
            "load": {"device": "cpu", "dtype": str(dtype).removeprefix("torch.")},
            "calibration": "common.calibration_ids(): 32 rows x 64 token ids, attention_mask all ones"}


def _loaded(out: Path, backend: str):
    from gptqmodel import BACKEND, GPTQModel

    return GPTQModel.load(str(out), backend=BACKEND[backend], device="cpu", dtype=TOOL_DTYPE)


def _forward(model):
    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model.model(input_ids=ids, use_cache=False).logits.float()

    return forward


def _gptq_dequant(model) -> dict[str, torch.Tensor]:
    """Every GPTQ module's generic `dequantize_weight` (GPTQModel converts v1 zeros to v2 on load),
    with float32 scales; returned transposed to [out, in] (g_idx puts act-order rows in place)."""
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear

    weights = {}
    for name, module in model.model.named_modules():
        if isinstance(module, PackableQuantLinear):
            scales = module.scales
            module.scales = scales.float()
            with torch.no_grad():
                w = PackableQuantLinear.dequantize_weight(module)
            module.scales = scales
            weights[f"{name}.weight"] = w.t().float().contiguous()
    return weights


def _awq_dequant(model) -> dict[str, torch.Tensor]:
    """GPTQModel's `dequantize_gemm` (the AutoAWQ GEMM unpacking) of every AWQ module, float32 scales."""
    from gptqmodel.nn_modules.qlinear import AWQuantLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    weights = {}
    for name, module in model.model.named_modules():
        if isinstance(module, AWQuantLinear):
            w = dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.bits, module.group_size)
            weights[f"{name}.weight"] = w.t().float().contiguous()
    return weights


def gptq(config_args: dict, notes: list[str] | None = None, **checks: float):
    """A GPTQ fixture's maker; `checks` override ToolReference's sanity bounds (2-bit codes)."""

    def make(source: Path, out: Path) -> ToolReference:
        recipe = _quantize(source, out, config_args)
        model = _loaded(out, "GPTQ_TORCH")
        return ToolReference(
            tool=_tool(), recipe=recipe, dequant=_gptq_dequant(model), tool_forward=_forward(model),
            tool_logits_note="GPTQModel.load(backend=BACKEND.GPTQ_TORCH, dtype=float16) forward",
            logits_tol=LOGITS_TOL, notes=notes or [], **checks,
        )

    return make


def awq_gemm(source: Path, out: Path) -> ToolReference:
    from gptqmodel import BACKEND
    from gptqmodel.quantization import FORMAT, METHOD

    # The default AWQ GEMM packing kernel is CUDA-only; the torch one writes the same layout but
    # refuses float32 modules.
    recipe = _quantize(source, out, dict(bits=4, group_size=64, sym=False, method=METHOD.AWQ, format=FORMAT.GEMM),
                       dtype=torch.float16, backend=BACKEND.AWQ_TORCH)
    model = _loaded(out, "AWQ_TORCH")
    return ToolReference(
        tool=_tool(), recipe=recipe, dequant=_awq_dequant(model), tool_forward=_forward(model),
        tool_logits_note="GPTQModel.load(backend=BACKEND.AWQ_TORCH, dtype=float16) forward",
        logits_tol=LOGITS_TOL, smoothed=True,
        notes=["AWQ smoothing is folded into the checkpoint's RMSNorm weights (and v_proj->o_proj, up->down)."],
    )


def _fixtures() -> dict:
    from gptqmodel.quantization import FORMAT

    return {
        "gptq-4b-g128-sym": gptq(dict(bits=4, group_size=128, desc_act=False, sym=True, format=FORMAT.GPTQ)),
        "gptq-4b-g32-asym-actorder": gptq(
            dict(bits=4, group_size=32, desc_act=True, sym=False, format=FORMAT.GPTQ),
            ["desc_act: g_idx maps each input row to its group and is not monotonic."],
        ),
        "gptq-4b-g64-asym-v2": gptq(dict(bits=4, group_size=64, desc_act=False, sym=False, format=FORMAT.GPTQ_V2)),
        # group-aware reordering needs groups; GPTQModel refuses it with group_size -1.
        "gptq-8b-perchannel-sym": gptq(
            dict(bits=8, group_size=-1, desc_act=False, sym=True, format=FORMAT.GPTQ, act_group_aware=False)
        ),
        "gptq-4b-g128-sym-lmhead": gptq(
            dict(bits=4, group_size=128, desc_act=False, sym=True, format=FORMAT.GPTQ, lm_head=True),
            ["GPTQModel quantizes lm_head with its own per-module override, written to "
             "quantization_config.dynamic: {'lm_head': {'bits': 8, 'group_size': 32, 'sym': True, ...}}."],
        ),
        # 3-bit codes and zeros run over int32 boundaries (32 in every 3 words); both widths run
        # on the 4-bit kernels after load
        "gptq-3b-g32-asym": gptq(dict(bits=3, group_size=32, desc_act=False, sym=False, format=FORMAT.GPTQ)),
        "gptq-2b-g64-sym": gptq(
            dict(bits=2, group_size=64, desc_act=False, sym=True, format=FORMAT.GPTQ),
            ["2-bit codes: four levels per group; the tiny model's weights land up to ~0.75 of their range "
             "from the source's, so the fixture tests the numerics, not the quality."],
            max_rel_weight_error=0.8,
        ),
        "awq-gemm-4b-g64": awq_gemm,
    }


if __name__ == "__main__":
    run_tool(_fixtures())

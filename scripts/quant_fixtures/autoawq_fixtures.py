"""AWQ GEMM fixture made by AutoAWQ 0.2.9 itself (the producer of most AWQ checkpoints in the wild,
whose quantization_config has only AutoAWQ's own keys); runs in the AutoAWQ venv (transformers
4.51.3, see scripts/make_quant_fixtures.py).

References: AutoAWQ's `dequantize_gemm` of every `WQLinear_GEMM` with float32 scales (exact), and
AutoAWQ's own quantized forward in float16 on its pure-torch path (`dequantize_gemm` + matmul),
which it takes when neither its CUDA extension nor Triton is usable. Both use the quantized model
still in memory (checked equal to the saved tensors): `from_quantized` refuses a CPU without IPEX.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quant_fixtures.common import ToolReference, calibration_ids, calibration_texts, read_checkpoint, run_tool

QUANT_CONFIG = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
LOGITS_TOL = 0.1  # float16 forward vs the float32 reference


def awq_gemm(source: Path, out: Path) -> ToolReference:
    import awq
    import awq.modules.linear.gemm as gemm
    from awq import AutoAWQForCausalLM
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoAWQForCausalLM.from_pretrained(str(source), torch_dtype=torch.float16, use_cache=False)
    # Texts of exactly max_calib_seq_len tokens: longer ones are silently dropped.
    calib = dict(calib_data=calibration_texts(), max_calib_samples=len(calibration_ids()),
                 max_calib_seq_len=calibration_ids().shape[1])
    model.quantize(tokenizer, quant_config=dict(QUANT_CONFIG), **calib)
    model.save_quantized(str(out))

    # from_quantized demands intel_extension_for_pytorch on a CPU, so the references use the
    # quantized model still in memory, after checking it holds exactly what was saved.
    saved = read_checkpoint(out)
    dequant = {}
    for name, module in model.model.named_modules():
        if isinstance(module, WQLinear_GEMM):
            for t in ("qweight", "qzeros", "scales"):
                if not torch.equal(getattr(module, t), saved[f"{name}.{t}"]):
                    raise AssertionError(f"{name}.{t}: in-memory model differs from the saved checkpoint")
            w = dequantize_gemm(module.qweight, module.qzeros, module.scales.float(), module.w_bit,
                                module.group_size)
            dequant[f"{name}.weight"] = w.t().float().contiguous()
    # Triton imports on a CPU-only machine but cannot run; without it AutoAWQ uses dequantize_gemm.
    gemm.TRITON_AVAILABLE = False
    loaded = model.model.eval()

    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return loaded(input_ids=ids, use_cache=False).logits.float()

    return ToolReference(
        tool=f"autoawq {awq.__version__}",
        recipe={"from_pretrained": {"torch_dtype": "float16"}, "quant_config": QUANT_CONFIG,
                "quantize": {k: v for k, v in calib.items() if k != "calib_data"}
                | {"calib_data": "common.calibration_texts(): the 32 calibration rows as 'w17 w4 ...' text"}},
        dequant=dequant, tool_forward=forward,
        tool_logits_note="AutoAWQ's quantized model (in memory after quantize + save_quantized, float16) forward, "
        "WQLinear_GEMM on its torch path (dequantize_gemm + fp16 matmul); from_quantized needs IPEX on CPU",
        logits_tol=LOGITS_TOL, smoothed=True,
        notes=["AWQ smoothing is folded into the checkpoint's RMSNorm weights (and v_proj->o_proj, up->down)."],
    )


if __name__ == "__main__":
    run_tool({"awq-gemm-4b-g64-autoawq": awq_gemm})

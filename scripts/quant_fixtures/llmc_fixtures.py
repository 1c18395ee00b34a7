"""compressed-tensors fixtures (pack-quantized W4A16/W8A16, AWQ, FP8 dynamic/static, FP8 dynamic with
an FP8 KV cache's scales, naive W8A8)
made by llm-compressor 0.14.0.1 with compressed-tensors 0.19 on CPU, and the GPTQ act-order one by
llm-compressor 0.13.0 (compressed-tensors 0.18); runs in those venvs (see
scripts/make_quant_fixtures.py).

The source is quantized in bfloat16, the dtype real compressed-tensors checkpoints carry (their
scales and non-quantized tensors are bf16). References come from transformers' own compressed-tensors
integration, the way users load these files:
- dequantized weights: `from_pretrained(dtype=float32, quantization_config=CompressedTensorsConfig(
  run_compressed=False))`, which runs the compressors' decompression with the scales widened to
  float32, so `scale * (q - zero)` is exact;
- `tool_logits`: a plain `from_pretrained` (compressed modules, checkpoint dtype bfloat16) forward;
- where activations are quantized too (FP8, W8A8), that forward in float32 is the reference model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from quant_fixtures.common import ToolReference, calibration_ids, run_tool

QUANT_DTYPE = torch.bfloat16
# bfloat16 forward vs the float32 reference, with logits up to ~10 (lm_head x20)
LOGITS_TOL = 0.25
# Where activations are quantized as well, bf16 rounding moves some activations across an 8-bit
# rounding boundary, a step of up to 1/16 (FP8) of their magnitude.
LOGITS_TOL_ACT = 2.0


def _tool() -> str:
    import compressed_tensors
    import llmcompressor

    return f"llmcompressor {llmcompressor.__version__} (compressed-tensors {compressed_tensors.__version__})"


def _dataset():
    from datasets import Dataset

    ids = calibration_ids()
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def _group_scheme(bits: int, group_size: int, symmetric: bool, **weights) -> dict:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group",
                            group_size=group_size, **weights)
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=args)}


def _quantize(source: Path, out: Path, recipe: list, calibrate: bool, **save_args) -> dict:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=QUANT_DTYPE)
    data = dict(dataset=_dataset(), num_calibration_samples=len(calibration_ids()),
                max_seq_length=calibration_ids().shape[1], shuffle_calibration_samples=False) if calibrate else {}
    oneshot(model=model, recipe=recipe, **data)
    model.save_pretrained(out, save_compressed=True, **save_args)
    return {
        "recipe.yaml": (out / "recipe.yaml").read_text(),
        "model_dtype": str(QUANT_DTYPE).removeprefix("torch."),
        "oneshot": {k: v for k, v in data.items() if k != "dataset"} | (
            {"dataset": "common.calibration_ids(): 32 rows x 64 token ids"} if calibrate else {}
        ),
        "save_pretrained": {"save_compressed": True, **save_args},
    }


def _load(out: Path, dtype: torch.dtype, dequantize: bool = False):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    # run_compressed=False: the spelling both transformers 5.14 and 5.17 (which calls it
    # dequantize=True and warns) accept.
    kwargs = {"quantization_config": CompressedTensorsConfig(run_compressed=False)} if dequantize else {}
    return AutoModelForCausalLM.from_pretrained(out, dtype=dtype, **kwargs).eval()


def _forward(model):
    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits.float()

    return forward


def _per_element(t: torch.Tensor, shape: torch.Size, g_idx: torch.Tensor | None,
                 block: list[int] | None = None) -> torch.Tensor:  # fmt: skip
    """A per-tensor/channel/group/block parameter ([], [1], [out, 1], [out, G], [ceil(out /
    rows), ceil(in / cols)] for `block` [rows, cols]) spread to [out, in]; with act-order `g_idx`
    names each input column's group."""
    t = t.float().reshape(t.shape[0] if t.dim() else 1, -1)
    if block is not None:
        return t.repeat_interleave(block[0], dim=0)[: shape[0]].repeat_interleave(block[1], dim=1)[:, : shape[1]]
    if g_idx is not None:
        return t[:, g_idx.long()].expand(shape)
    group = -(-shape[1] // t.shape[1])
    return t.repeat_interleave(group, dim=1)[:, : shape[1]].expand(shape)


def _dequantized(out: Path) -> dict[str, torch.Tensor]:
    """The decompressed weight of every quantized Linear, each checked to lie exactly on the
    quantization grid its own scale (and zero point) define, i.e. no rounding crept in."""
    model = _load(out, torch.float32, dequantize=True)
    weights = {}
    for name, module in model.named_modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is None or scheme.weights is None:
            continue
        w = module.weight.detach().float()
        g_idx = getattr(module, "weight_g_idx", None)
        block = scheme.weights.block_structure if scheme.weights.strategy == "block" else None
        q = w / _per_element(module.weight_scale, w.shape, g_idx, block)
        if scheme.weights.type == "float":
            off_grid = (q - q.to(torch.float8_e4m3fn).float()).abs().max()
        else:
            if hasattr(module, "weight_zero_point"):
                q = q + _per_element(module.weight_zero_point, w.shape, g_idx)
            off_grid = (q - q.round()).abs().max()
        if off_grid > 1e-4:
            raise AssertionError(f"{name}: decompressed weight is off the quantization grid by {off_grid}")
        weights[f"{name}.weight"] = w.contiguous()
    return weights


def ct(recipe_fn, calibrate: bool = False, activations: bool = False, notes: list[str] | None = None,
       smoothed: bool = False, **save_args):
    def make(source: Path, out: Path) -> ToolReference:
        recipe = _quantize(source, out, recipe_fn(), calibrate, **save_args)
        return ToolReference(
            tool=_tool(), recipe=recipe, dequant=_dequantized(out),
            tool_forward=_forward(_load(out, QUANT_DTYPE)),
            tool_logits_note="transformers from_pretrained (compressed-tensors integration, checkpoint dtype "
            "bfloat16) forward" + (", activations fake-quantized" if activations else ""),
            logits_tol=LOGITS_TOL_ACT if activations else LOGITS_TOL,
            reference_forward=_forward(_load(out, torch.float32)) if activations else None,
            smoothed=smoothed, notes=notes or [],
        )

    return make


def _rtn(bits: int, group_size: int, symmetric: bool):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(config_groups=_group_scheme(bits, group_size, symmetric), ignore=["lm_head"])]


def _channel(bits: int):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="channel")
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=args)}
    return [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def _preset(scheme: str):
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])]


def _fp8_block_64():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[64, 64])
    acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", group_size=64, dynamic=True)
    groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)}
    return [QuantizationModifier(config_groups=groups, ignore=["lm_head"])]


def _fp8_dynamic_kv():
    """FP8_DYNAMIC weights with an FP8 KV cache: static per-tensor k/v scales calibrated per layer
    (the "-FP8-KV" recipes), written as model.layers.N.self_attn.k_scale / v_scale."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    kv = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"], kv_cache_scheme=kv)]


def _gptq_group_actorder():
    from llmcompressor.modifiers.quantization import GPTQModifier

    return [GPTQModifier(config_groups=_group_scheme(4, 64, True, actorder="group"), ignore=["lm_head"])]


def _awq():
    import llmcompressor.pipelines.cache as cache
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    # 0.14.0.1 pins its smoothing cache unconditionally, which raises without an accelerator.
    if not torch.accelerator.is_available():
        cache.IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    return [AWQModifier(), QuantizationModifier(config_groups=_group_scheme(4, 64, False), ignore=["lm_head"])]


def _fixtures() -> dict:
    return {
        "ct-w4a16-sym-g64": ct(lambda: _rtn(4, 64, True)),
        # Group 128 with K=320 cannot be made: the divisibility check can be bypassed
        # (bypass_divisibility_checks=True) but the weight observer then fails to reshape 320
        # columns into groups of 128. Group 64 instead.
        "ct-w4a16-asym-g64": ct(lambda: _rtn(4, 64, False)),
        # The W8A16 preset is group 128, not per channel.
        "ct-w8a16-channel": ct(lambda: _channel(8)),
        # actorder "group" writes weight_g_idx; compressed-tensors 0.19 removed it, so this one
        # comes from llmcompressor 0.13.0 (compressed-tensors 0.18.0, where it is deprecated).
        "ct-w4a16-gptq-actorder-group": ct(_gptq_group_actorder, calibrate=True, notes=[
            "made with llmcompressor 0.13.0 / compressed-tensors 0.18.0: 0.14 / 0.19 refuse actorder 'group'; "
            "weight_g_idx maps each input column to its group."]),
        "ct-awq-asym-g64": ct(_awq, calibrate=True, smoothed=True, notes=[
            "AWQ smoothing is folded into the checkpoint's RMSNorm weights (and v_proj->o_proj, up->down)."]),
        "ct-fp8-dynamic": ct(lambda: _preset("FP8_DYNAMIC"), activations=True),
        "ct-fp8-static": ct(lambda: _preset("FP8"), calibrate=True, activations=True),
        # The tool's forward fake-quantizes K (after RoPE) and V through each layer's scales, so
        # its fp32 forward is the reference of a model run with an fp8 KV cache.
        "ct-fp8-dynamic-kv": ct(_fp8_dynamic_kv, calibrate=True, activations=True, notes=[
            "kv_cache_scheme fp8 per tensor, static: the tool's forward (and so dequant_logits, greedy and "
            "tool_logits) rounds K and V through the layer's k_scale / v_scale, as an fp8 KV cache does."]),
        # FP8_BLOCK's layout (weight blocks, activations dynamic per token and group) in blocks of
        # 64: the preset's 128 x 128 quantizes, but the tool's forward cannot take groups of 128
        # over K=320 (down_proj).
        "ct-fp8-block": ct(_fp8_block_64, activations=True, notes=[
            "FP8_BLOCK's scheme with 64 x 64 weight blocks and activation groups of 64 (the preset's 128 "
            "does not divide down_proj's K=320, which the tool's forward requires)."]),
        # compressed-tensors 0.19 infers int-quantized for int8 weights with int8 activations and
        # pack-quantized for int weights alone; it writes naive-quantized only when asked to.
        # naive- and int-quantized are the same compressor: int8 `weight` + `weight_scale`.
        "ct-naive-w8a8": ct(lambda: _preset("W8A8"), activations=True, quantization_format="naive-quantized",
                            notes=["format forced with save_pretrained(quantization_format='naive-quantized'); "
                                   "without it the same tensors are written as int-quantized."]),
    }


if __name__ == "__main__":
    run_tool(_fixtures())

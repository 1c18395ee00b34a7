"""GGUF weights kept quantized: `GGUFLinearMethod`, its kernels and its loading path.

Each kernel is checked against F.linear with the weight dequantized by our (bit-exact) torch
dequantizers; whole tiny models loaded through the quantized path give the same float32 logits as
the dequantize-at-load path, bit for bit."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.layers.linear import QKVLinear
from paphos.layers.weights import ShapeMismatchError
from paphos.loader import GGUFCheckpoint
from paphos.loader.gguf_reader import GGUFTensor
from paphos.loader.source import raw_tensor_names
from paphos.models.registry import resolve_model_class
from paphos.native import cpu as native_cpu
from paphos.quant.gguf import GGUFLinearMethod, GGUFQuantConfig
from paphos.quant.gguf.dequant import dequantize
from paphos.quant.gguf.kernels import (
    DequantizedAtLoadKernel,
    DequantPerCallKernel,
    Int4PackCPUKernel,
    Int8GroupCPUKernel,
    select_kernel,
)
from paphos.quant.kernels import int4pack_cpu
from tests.models.paged import BLOCK, NUM_BLOCKS, run_schedule
from tests.quant.gguf_blocks import random_blocks, weight_scale, write_tiny_llama

HIDDEN, HEAD_DIM, HEADS, KV_HEADS = 256, 32, 4, 2


def _tensor(name: str, type_name: str, rows: int, cols: int, seed: int) -> GGUFTensor:
    raw = random_blocks(type_name, rows, cols, np.random.default_rng(seed), weight_scale(type_name))
    return GGUFTensor(name, GGMLQuantizationType[type_name], (rows, cols), raw, raw.nbytes)


def _qkv_layer(types: tuple[str, str, str], dtype: torch.dtype) -> tuple[QKVLinear, torch.Tensor]:
    """A q/k/v layer over GGUF shards of `types`, loaded; and its float32 reference weight."""
    rows = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    tensors = [
        (f"p.{s}_proj.weight", _tensor(f"p.{s}_proj.weight", t, n, HIDDEN, seed))
        for seed, (s, t, n) in enumerate(zip("qkv", types, rows, strict=True))
    ]
    method = GGUFLinearMethod(tensors)
    layer = QKVLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, params_dtype=dtype, quant_method=method)
    assert layer.weight.dtype == torch.uint8 and layer.weight.numel() == sum(t.n_bytes for _, t in tensors)
    reference = []
    for shard, (_, t) in zip("qkv", tensors, strict=True):
        raw = torch.from_numpy(t.data)
        layer.weight.weight_loader(layer.weight, raw, shard)
        reference.append(dequantize(raw, t.tensor_type.name))
    return layer, torch.cat(reference)


def _x(dtype: torch.dtype, rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(9)).to(dtype)


def test_int4pack_kernel_for_q4_shards_in_bf16() -> None:
    layer, w = _qkv_layer(("Q4_K", "Q4_0", "Q4_1"), torch.bfloat16)
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method.kernel, Int4PackCPUKernel)
    assert layer.weight.numel() == 0  # raw blocks freed after packing
    packed = layer.gguf_int4.numel() + layer.gguf_scale_zero.numel() * 2
    assert packed == w.shape[0] * (HIDDEN // 2 + HIDDEN // 32 * 4)  # Q4_1's size
    # 1 and 7 rows: int4pack; many: the native kernel where the CPU has one, else unpack + GEMM.
    for rows, native in ((1, True), (7, True), (int4pack_cpu.DENSE_MIN_TOKENS, True), (int4pack_cpu.DENSE_MIN_TOKENS, False)):
        x = _x(torch.bfloat16, rows)
        with contextlib.nullcontext() if native else native_cpu.disabled():
            y = layer(x)
        ref = F.linear(x.float(), w)
        assert y.dtype == torch.bfloat16
        # bf16 activations, scales rounded fp16 -> bf16, bf16 output.
        assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_int8_group_kernel_for_q8_q5_q6_shards_in_bf16() -> None:
    layer, w = _qkv_layer(("Q5_0", "Q8_0", "Q6_K"), torch.bfloat16)
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method.kernel, Int8GroupCPUKernel)
    assert layer.weight.numel() == 0  # raw blocks freed
    # A byte per value, a float32 scale per 16 (Q6_K's group, shared by the merged layer).
    assert layer.gguf_codes.numel() + layer.gguf_scales.numel() * 4 == w.numel() + w.numel() // 16 * 4
    x = _x(torch.bfloat16)
    # several rows: the native kernel where the CPU has one (its own float32 summation order), else
    # the weight dequantized by row chunks and F.linear
    ref = F.linear(x.float(), w.to(torch.bfloat16).float())
    assert (layer(x).float() - ref).abs().max() <= 2**-8 * ref.abs().max()  # the bf16 output rounding

    # One row inside a compiled step: one fp32 reduction over the exact weights.
    row = _x(torch.bfloat16, 1)
    compiled = torch.compile(layer.forward, dynamic=False)(row)
    ref = F.linear(row.float(), w)
    assert compiled.dtype == torch.bfloat16
    assert (compiled.float() - ref).abs().max() <= 2**-8 * ref.abs().max()  # the bf16 output rounding


def test_other_types_dequantized_at_load_exactly() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        layer, w = _qkv_layer(("Q5_1", "Q8_0", "IQ4_NL"), dtype)
        layer.quant_method.process_weights_after_loading(layer)
        assert isinstance(layer.quant_method.kernel, DequantizedAtLoadKernel)
        x = _x(dtype)
        assert torch.equal(layer(x), F.linear(x, w.to(dtype)))
    layer, w = _qkv_layer(("Q5_0", "Q8_0", "Q6_K"), torch.float32)  # float32: always the exact path
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method.kernel, DequantizedAtLoadKernel)
    # float32 activations take the exact path for Q4 types too.
    layer, w = _qkv_layer(("Q4_K", "Q4_0", "Q4_1"), torch.float32)
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method.kernel, DequantizedAtLoadKernel)
    assert torch.equal(layer(_x(torch.float32)), F.linear(_x(torch.float32), w))


def test_dequant_per_call_kernel_keeps_raw_blocks() -> None:
    layer, w = _qkv_layer(("IQ4_XS", "Q4_1", "Q3_K"), torch.float32)
    method: GGUFLinearMethod = layer.quant_method  # type: ignore[assignment]
    raw_bytes = layer.weight.numel()
    method.kernel = DequantPerCallKernel()
    method.kernel.prepare(layer, method.shards, torch.float32)
    x = _x(torch.float32)
    assert torch.equal(layer(x), F.linear(x, w)) and layer.weight.numel() == raw_bytes


def test_kernel_choice_is_first_that_accepts() -> None:
    shards = _qkv_layer(("Q4_K", "Q4_0", "Q4_1"), torch.bfloat16)[0].quant_method.shards
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert isinstance(select_kernel(shards, cpu, torch.bfloat16), Int4PackCPUKernel)
    assert isinstance(select_kernel(shards, cpu, torch.float32), DequantizedAtLoadKernel)
    # On a GPU the Triton kernels read the blocks themselves.
    assert select_kernel(shards, gpu, torch.bfloat16).name == "triton-gguf"


def test_shard_loader_checks_shapes() -> None:
    layer, _ = _qkv_layer(("Q4_0", "Q4_0", "Q4_0"), torch.float32)
    with pytest.raises(ShapeMismatchError):
        layer.weight.weight_loader(layer.weight, torch.zeros(HEADS * HEAD_DIM, 16, dtype=torch.uint8), "q")


# ---- whole models -----------------------------------------------------------------------------

LAYERS = [
    {"attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q4_K",
     "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "Q4_K"},
    {"attn_q": "Q5_0", "attn_k": "Q8_0", "attn_v": "Q6_K", "attn_output": "IQ4_XS",
     "ffn_gate": "Q5_K", "ffn_up": "Q3_K", "ffn_down": "Q2_K"},
]  # fmt: skip


def _logits(
    ckpt: GGUFCheckpoint, dtype: torch.dtype, quantized: bool
) -> tuple[torch.Tensor, torch.nn.Module]:
    config = ckpt.hf_config
    quant = GGUFQuantConfig.from_checkpoint(ckpt) if quantized else None
    model = resolve_model_class(config)(config, dtype, TorchReferenceBackend(), quant).eval()
    model.load_weights(ckpt.iter_weights(show_progress=False, raw_names=raw_tensor_names(model)))
    caches = [
        torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK), dtype=dtype)
        for _ in range(model.num_layers)
    ]
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    return run_schedule(model, caches, [ids], [[9], [1], [1], [1]])[0], model


def test_tiny_llama_quantized_path_equals_dequantized_path(tmp_path: Path) -> None:
    ckpt = GGUFCheckpoint(write_tiny_llama(tmp_path / "tiny.gguf", LAYERS))
    want, _ = _logits(ckpt, torch.float32, quantized=False)
    got, model = _logits(ckpt, torch.float32, quantized=True)
    # Q/K rows of llama files are un-permuted as raw blocks, then dequantized: same weights.
    assert torch.equal(got, want)
    methods = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    # qkv, o, gate_up, down per layer, and the embedding (whose method the tied head runs through)
    assert len(methods) == 2 * 4 + 1 and methods[0] is model.model.embed_tokens
    assert model.lm_head.weight is model.model.embed_tokens.weight

    got_bf16, model = _logits(ckpt, torch.bfloat16, quantized=True)
    assert (got_bf16 - want).abs().max() <= 0.03 * want.abs().max()
    kernels = [
        type(m.quant_method.kernel) for m in model.model.layers[0].modules() if hasattr(m, "gguf_int4")
    ]
    assert kernels == [Int4PackCPUKernel] * 4  # layer 0 is all Q4: packed, not dequantized

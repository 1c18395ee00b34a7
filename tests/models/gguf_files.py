"""Tiny random HF models written as GGUF files the way llama.cpp's converter writes them, and run
back through our GGUF path, for the per-architecture GGUF tests (test_gemma3_gguf.py,
test_qwen3_gguf.py, test_gguf_tied_head.py).

The writer replaces `hf`'s quantized weights by their quantized-then-dequantized values, so HF and
our model hold the same numbers and their logits can be compared at fp32 tolerances.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as np_dequantize
from gguf.quants import quantize as np_quantize

import tests.models.paged as paged
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.loader import GGUFCheckpoint
from paphos.loader.source import raw_tensor_names
from paphos.models.registry import resolve_model_class
from paphos.quant.gguf import GGUFQuantConfig

# HF layer modules -> llama.cpp's tensor names in Llama-shaped models (the q/k norms: Qwen3, Gemma 3).
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
# HF tensors outside the layers -> GGUF names (without ".weight").
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd", "model.norm.weight": "output_norm", "lm_head.weight": "output",
}  # fmt: skip


def write_like_llamacpp(
    hf: torch.nn.Module,
    cfg: Any,
    path: Path,
    arch: str,
    types: dict[str, str],
    *,
    layer_names: dict[str, str] = LAYER_NAMES,
    norm_offset: float = 0.0,
    **metadata: Any,
) -> None:
    """`hf` as a GGUF file of architecture `arch`: the hyperparameters every architecture has,
    then `metadata` (GGUFWriter `add_<key>` calls: rope_freq_base, sliding_window, ...); layer
    modules renamed by `layer_names` (HF module -> GGUF name, e.g. "self_attn.q_norm" ->
    "attn_q_norm"); `norm_offset` added to every norm weight (Gemma's stored 1 + w); the tensors
    named in `types` (GGUF name -> type) quantized, Q4_K as Q8_0 blocks (gguf has no numpy Q4_K
    quantizer). A tied head is not written, an untied one is `output.weight`."""
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    for key, value in metadata.items():
        getattr(w, f"add_{key}")(value)
    with torch.no_grad():
        for name, p in hf.state_dict().items():
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            array = p.numpy().astype(np.float32)
            if name in _GLOBAL_NAMES:
                kind = _GLOBAL_NAMES[name]
                gguf_name = f"{kind}.weight"
            else:
                layer, module = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
                kind = layer_names[module]
                gguf_name = f"blk.{layer}.{kind}.weight"
            if "norm" in kind:
                w.add_tensor(gguf_name, array + norm_offset)
            elif kind in types:
                qtype = GGMLQuantizationType[types[kind]]
                if qtype == GGMLQuantizationType.Q4_K:
                    qtype = GGMLQuantizationType.Q8_0
                raw = np_quantize(array, qtype)
                p.copy_(torch.from_numpy(np_dequantize(raw, qtype)))
                w.add_tensor(gguf_name, raw, raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def load_ours(ckpt: GGUFCheckpoint, dtype: torch.dtype) -> torch.nn.Module:
    """Our model of the checkpoint, its GGUF linear weights kept in their blocks."""
    config = ckpt.hf_config
    model = resolve_model_class(config)(
        config, dtype, TorchReferenceBackend(), GGUFQuantConfig.from_checkpoint(ckpt)
    )
    model.load_weights(ckpt.iter_weights(show_progress=False, raw_names=raw_tensor_names(model)))
    return model.eval()


def run_chunks(model: torch.nn.Module, ids: torch.Tensor, chunks: list[int], block: int = 16) -> torch.Tensor:
    """The logits of every position of `ids`, computed in steps of `chunks` tokens over a paged
    cache of `block`-token blocks."""
    blocks = -(-len(ids) // block) + 1
    caches = [
        torch.zeros(model.kv_cache_shape_per_layer(blocks + 1, block), dtype=model.dtype)
        for _ in range(model.num_layers)
    ]
    old = paged.BLOCK, paged.NUM_BLOCKS
    paged.BLOCK, paged.NUM_BLOCKS = block, blocks + 1
    try:
        return paged.run_schedule(model, caches, [ids], [[n] for n in chunks])[0]
    finally:
        paged.BLOCK, paged.NUM_BLOCKS = old

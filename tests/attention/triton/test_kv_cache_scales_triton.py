"""Per-layer FP8 KV-cache scales through the Triton backend (its kernels under the interpreter on
CPU tensors, see conftest.py), as a checkpoint's k_scale / v_scale reach it (paphos/quant/kv_cache.py):

- `forward(..., kv_scales=(k, v))` stores and reads exactly as a backend built with those scales
  (both backends, mixed batches and the CUDA-graph decode entry), and None keeps the backend's own;
- a bf16 tiny Llama whose layers carry distinct scales, run with an fp8 cache on the Triton
  backend, gives the logits of the plain torch emulation (tests/models/fp8_kv.py: K after RoPE
  and V rounded to e4m3 through their layer's scale, attention in fp32 on a float32 cache)
  within 2% (relative L2 over all logits; measured 1.05%, max 0.16 on logits up to ~10: the
  kernels multiply an fp8 cache in fp16, the torch reference's fp8 path equals the emulation
  bit for bit), while the emulation with scales 1.0 or with the layers' scales exchanged lies
  more than 3% away (measured 5.0% and 4.4%); with a bf16 cache the scales change no bit of
  the logits.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.attention.triton_backend import TritonAttentionBackend
from tests.attention.triton.test_triton_attention import MIXED, make_case
from tests.models.fp8_kv import FP8, emulated, layer_scales, ours, run

TOL = 0.02  # relative L2 distance of the logits


@pytest.mark.parametrize("backend_cls", [TritonAttentionBackend, TorchReferenceBackend])
@pytest.mark.parametrize("decode_only", [False, True])
def test_per_call_scales_equal_a_backend_built_with_them(backend_cls: type, decode_only: bool) -> None:
    k_scale, v_scale = 0.05, 0.3
    seqs = [(1, 9), (1, 17), (1, 4)] if decode_only else MIXED
    case = make_case(seqs, 2, 2, cache_dtype=FP8, k_scale=k_scale, v_scale=v_scale, seed=21)
    if decode_only:
        case.md.decode_only = True
    built, per_call, default = case.cache.clone(), case.cache.clone(), case.cache.clone()
    a = backend_cls(k_scale=k_scale, v_scale=v_scale).forward(case.q, case.k, case.v, built, case.md, case.scale)
    b = backend_cls().forward(case.q, case.k, case.v, per_call, case.md, case.scale, kv_scales=(k_scale, v_scale))
    assert torch.equal(a, b) and torch.equal(built.view(torch.uint8), per_call.view(torch.uint8))
    c = backend_cls(k_scale=k_scale, v_scale=v_scale).forward(case.q, case.k, case.v, default, case.md, case.scale,
                                                              kv_scales=None)  # fmt: skip
    assert torch.equal(a, c)
    ones = backend_cls().forward(case.q, case.k, case.v, case.cache.clone(), case.md, case.scale)
    assert (ones.float() - a.float()).abs().max() > 0.1  # the scales matter in this case


def _tiny() -> tuple[LlamaConfig, HFLlama]:
    """A bf16-friendly tiny Llama with Triton-sized heads (head_dim 64, GQA 2)."""
    config = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(1)
    hf = HFLlama(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)
    return config, hf


# Prompts in chunks, a mixed step, then decode-only steps (the CUDA-graph entry).
STEPS = [[6, 4], [5, 7], [1, 2], [1, 1], [1, 1]]


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_a_model_with_per_layer_scales_on_the_triton_backend() -> None:
    config, hf = _tiny()
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(3, 96, (sum(s[i] for s in STEPS),), generator=gen) for i in range(2)]
    scales = layer_scales(config, hf, seqs, STEPS)
    assert scales[0] != scales[1]
    expected = emulated(config, hf, scales, seqs, STEPS, torch.bfloat16)
    got = run(ours(config, hf, torch.bfloat16, scales, TritonAttentionBackend()), FP8, seqs, STEPS)
    assert _distance(got, expected) <= TOL
    for other in ([(1.0, 1.0)] * 2, scales[::-1]):
        assert _distance(emulated(config, hf, other, seqs, STEPS, torch.bfloat16), expected) > 1.5 * TOL
    plain = run(ours(config, hf, torch.bfloat16, None, TritonAttentionBackend()), torch.bfloat16, seqs, STEPS)
    with_scales = run(ours(config, hf, torch.bfloat16, scales, TritonAttentionBackend()), torch.bfloat16, seqs, STEPS)
    assert torch.equal(with_scales, plain)

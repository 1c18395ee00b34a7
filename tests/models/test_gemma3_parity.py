"""Our Gemma 3 against HF `transformers` on tiny random models (fp32, CPU): the model alone over
paged, chunked batches, and the whole engine (loader, scheduler with chunked prefill, runner).

The config exercises every Gemma-specific path: sliding layers (window 6, prompts of 20+
tokens) with their own RoPE base next to global layers with linear RoPE scaling, a
query_pre_attn_scalar that differs from head_dim, final logit soft-capping, q/k
norms and the four (1 + w) norms with non-trivial weights, tied embeddings.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM as HFGemma3
from transformers import Gemma3TextConfig

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.engine.llm_engine import LLMEngine
from paphos.llm import build_engine_config
from paphos.models.gemma3 import layer_types
from paphos.models.registry import resolve_model_class
from paphos.sampling_params import SamplingParams
from tests.engine.conftest import _write_tokenizer
from tests.engine.test_hf_parity import LogitRecorder, hf_greedy, run_engine
from tests.models.paged import (
    BLOCK,
    NUM_BLOCKS,
    assert_schedule_matches_hf,
    hf_logits,
    run_schedule,
    scramble_weights,
)

TOL = 1e-4
WINDOW = 6


def make_hf(seed: int = 0, **overrides) -> tuple[Gemma3TextConfig, HFGemma3]:
    kwargs = dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=WINDOW, query_pre_attn_scalar=24, rms_norm_eps=1e-6,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
        },
        final_logit_softcapping=15.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip
    kwargs.update(overrides)
    cfg = Gemma3TextConfig(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = HFGemma3(cfg).eval()
    scramble_weights(hf, norm_center=0.0)  # zero-centred: the scale is 1 + w
    return cfg, hf


def test_layer_pattern() -> None:
    cfg, _ = make_hf()
    assert layer_types(cfg) == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]

    class Legacy:  # transformers 4.x configs without layer_types
        num_hidden_layers = 12
        sliding_window_pattern = 6

    assert [i for i, t in enumerate(layer_types(Legacy)) if t == "full_attention"] == [5, 11]


def test_prompt_chunks_then_decode_match_hf() -> None:
    cfg, hf = make_hf()
    model = resolve_model_class(cfg)(cfg, torch.float32, TorchReferenceBackend()).eval()
    model.load_weights(hf.state_dict().items())
    assert model.sliding_windows == [WINDOW] * 5 + [None, WINDOW]
    caches = [torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK)) for _ in range(model.num_layers)]
    # Prompts longer than the window, chunked (a: 9 + 7 + 4, b: 5 + 9), then decoded together.
    steps = [[9, 5], [7, 9], [4, 0], [1, 0], [1, 0], [1, 0]]
    assert_schedule_matches_hf(model, caches, hf, cfg.vocab_size, [23, 14], steps, seed=2, tol=TOL)


def test_engine_with_chunked_prefill_matches_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, hf = make_hf(seed=1, final_logit_softcapping=None)
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(3.0)  # sharper logits: greedy choices are not near-ties
    path = tmp_path / "gemma3"
    hf.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    engine = LLMEngine(build_engine_config(
        str(path), dtype="float32", max_model_len=128, max_num_batched_tokens=8, block_size=4,
    ))  # fmt: skip
    recorder = LogitRecorder(engine, monkeypatch)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (21, 13, 4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    generated = run_engine(engine, prompts, params, "g")
    assert recorder.steps_with_mixed_rows > 0
    worst = 0.0
    for req_id, position, logits in recorder.rows:
        i = int(req_id.split("#")[0][1:])
        ref = hf_logits(hf, torch.tensor(prompts[i] + generated[f"g{i}"]))
        worst = max(worst, (logits - ref[position]).abs().max().item())
    assert worst <= TOL, f"max |logit difference| {worst:.2e}"
    for i, prompt in enumerate(prompts):
        assert generated[f"g{i}"] == hf_greedy(hf, prompt, 8), f"prompt {i} diverged from HF"


def test_bfloat16_close_to_hf() -> None:
    cfg, hf = make_hf()
    ids = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(4))
    ref = hf_logits(hf, ids)
    model = resolve_model_class(cfg)(cfg, torch.bfloat16, TorchReferenceBackend()).eval()
    model.load_weights(hf.state_dict().items())
    caches = [
        torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK), dtype=torch.bfloat16)
        for _ in range(model.num_layers)
    ]
    ours = run_schedule(model, caches, [ids], [[12], [1], [1], [1], [1]])[0]
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()

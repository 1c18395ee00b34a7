"""A Gemma 3 GGUF whose head is tied to a quantized embedding: the embedding stays in its blocks,
the head runs through the same blocks, and the logits (with the final soft-cap) match HF
`transformers` holding the dequantized weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tests.models.test_gemma3_gguf as gemma_gguf
from paphos.loader import GGUFCheckpoint
from paphos.quant.gguf import GGUFLinearMethod
from tests.models.gguf_files import load_ours, run_chunks
from tests.models.paged import hf_logits
from tests.models.test_gemma3_parity import make_hf

SOFT_CAP = 3.0


@pytest.mark.parametrize("embed_type", ["Q8_0", "Q4_0"])
def test_gemma3_tied_quantized_head_with_soft_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, embed_type: str
) -> None:
    monkeypatch.setitem(gemma_gguf._TYPES, "token_embd", embed_type)  # the embedding quantized too
    cfg, hf = make_hf(
        query_pre_attn_scalar=16, final_logit_softcapping=SOFT_CAP,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        hidden_size=256, intermediate_size=512,
    )  # fmt: skip
    path = tmp_path / "gemma3.gguf"
    gemma_gguf._write_like_llamacpp(hf, cfg, path)  # also puts the dequantized embedding into hf
    ckpt = GGUFCheckpoint(path)
    assert ckpt.hf_config.tie_word_embeddings
    ckpt.hf_config.final_logit_softcapping = SOFT_CAP  # llama.cpp's converter writes none for Gemma 3
    table = hf.model.embed_tokens.weight.detach()
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(6))
    ref = hf_logits(hf, ids)
    assert ref.abs().max() > 0.9 * SOFT_CAP  # the cap bites

    model = load_ours(ckpt, torch.float32)
    embed = model.model.embed_tokens
    assert isinstance(embed.quant_method, GGUFLinearMethod) and embed.weight.dtype == torch.uint8
    assert model.lm_head.weight is embed.weight
    assert torch.equal(embed(ids), F.embedding(ids, table))
    got = run_chunks(model, ids, [9, 8, 1, 1, 1], block=4)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)

    model = load_ours(ckpt, torch.bfloat16)  # Q4_0: int4pack head, lookups from raw blocks
    assert torch.equal(model.model.embed_tokens(ids), F.embedding(ids, table.to(torch.bfloat16)))
    got = run_chunks(model, ids, [9, 8, 1, 1, 1], block=4)
    assert got.dtype == torch.float32 and got.abs().max() <= SOFT_CAP
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9

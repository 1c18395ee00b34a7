"""GGUF output head and token embedding kept in their blocks (paphos/quant/gguf/linear.py,
paphos/layers/embedding.py).

- Embedding rows equal the table dequantized at load bit for bit (fp32, and after the same cast to
  bf16), untied (raw blocks, rows dequantized per lookup) and tied (the head's kernel layout: one
  copy of the blocks), on the CPU kernels and on the Triton kernels under the interpreter.
- Head logits (fp32) within 1e-2 relative of dequantize-then-matmul in fp32, odd vocabularies too.
- A tiny tied GGUF model gives the same greedy tokens as with the float embedding/head of before.
- A Q4_K/Q6_K model (untied Q6_K head, Q4_K embedding) on the Triton layout holds weights within
  5% of the file's tensor bytes (parameters + buffers) and its logits match the fp32 reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.layers.embedding import LMHead, VocabEmbedding
from paphos.loader import GGUFCheckpoint
from paphos.loader.gguf_reader import GGUFTensor
from paphos.loader.source import raw_tensor_names
from paphos.models.registry import resolve_model_class
from paphos.quant.gguf import GGUFLinearMethod, GGUFQuantConfig, planes
from paphos.quant.gguf import kernels as gk
from paphos.quant.gguf.dequant import dequantize
from tests.models.paged import BLOCK, NUM_BLOCKS, run_schedule
from tests.quant.gguf_blocks import random_blocks, weight_scale

HIDDEN = 256


def _tensor(name: str, type_name: str, rows: int, cols: int = HIDDEN, seed: int = 0) -> GGUFTensor:
    raw = random_blocks(type_name, rows, cols, np.random.default_rng(seed), weight_scale(type_name))
    return GGUFTensor(name, GGMLQuantizationType[type_name], (rows, cols), raw, raw.nbytes)


def _embedding(
    type_name: str, vocab: int, dtype: torch.dtype, tied: bool
) -> tuple[VocabEmbedding, LMHead | None, torch.Tensor]:
    """A loaded GGUF embedding (and the head tied to it), and its fp32 table as `gguf` computes it."""
    t = _tensor("model.embed_tokens.weight", type_name, vocab)
    emb = VocabEmbedding(vocab, HIDDEN, dtype, GGUFLinearMethod([(t.name, t)], embedding=True))
    head = LMHead(vocab, HIDDEN, dtype, tie_to=emb) if tied else None
    assert emb.weight.dtype == torch.uint8 and emb.weight.numel() == t.n_bytes
    raw = torch.from_numpy(t.data)
    emb.weight.weight_loader(emb.weight, raw)
    emb.process_weights_after_loading()
    if head is not None:
        head.process_weights_after_loading()
    return emb, head, dequantize(raw, type_name)


def _bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _ids(vocab: int, n: int = 40) -> torch.Tensor:
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(4))
    ids[:3] = torch.tensor([0, vocab - 1, 0])  # both ends, and a repeat
    return ids


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


# ---- CPU kernels ----------------------------------------------------------------------------


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q6_K", "Q4_0", "IQ4_XS"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untied_embedding_keeps_blocks_and_rows_are_exact(type_name: str, dtype: torch.dtype) -> None:
    vocab = 100
    emb, _, table = _embedding(type_name, vocab, dtype, tied=False)
    assert isinstance(emb.quant_method.kernel, gk.DequantPerCallKernel)  # raw blocks, never dequantized whole
    assert _bytes(emb) == emb.weight.numel() == vocab * emb.quant_method.shards[0].row_bytes
    ids = _ids(vocab)
    assert torch.equal(emb(ids), F.embedding(ids, table.to(dtype)))
    assert torch.equal(emb(ids.view(5, 8)), F.embedding(ids.view(5, 8), table.to(dtype)))  # any shape


@pytest.mark.parametrize(
    ("type_name", "dtype", "kernel"),
    [
        ("Q8_0", torch.bfloat16, gk.Int8GroupCPUKernel),  # the default model's case: int8 codes
        ("Q8_0", torch.float32, gk.DequantizedAtLoadKernel),
        ("Q4_K", torch.bfloat16, gk.Int4PackCPUKernel),  # packed head, raw blocks kept for lookups
        ("Q4_0", torch.float32, gk.DequantizedAtLoadKernel),
    ],
)
def test_tied_head_shares_the_embedding(type_name: str, dtype: torch.dtype, kernel: type) -> None:
    vocab = 112  # int4pack wants multiples of 16 rows
    emb, head, table = _embedding(type_name, vocab, dtype, tied=True)
    assert head is not None and head.weight is emb.weight and head.quant_method is None
    method = emb.quant_method
    assert isinstance(method.kernel, kernel)
    assert method.rows_from_raw == (kernel is gk.Int4PackCPUKernel)  # int4pack scales are bf16
    ids = _ids(vocab)
    assert torch.equal(emb(ids), F.embedding(ids, table.to(dtype)))
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits = head(x)
    ref = x.float() @ table.t()
    assert logits.dtype == torch.float32 and logits.shape == (7, vocab)
    assert _rel(logits, ref) < 1e-2
    if kernel is not gk.Int4PackCPUKernel:  # exactly a float head: one table for both
        assert torch.equal(logits, F.linear(x, table.to(dtype)).float())
    if kernel is gk.DequantizedAtLoadKernel:
        assert _bytes(emb) == vocab * HIDDEN * dtype.itemsize
    if kernel is gk.Int8GroupCPUKernel:  # a byte per value and a float32 scale per 32
        assert _bytes(emb) == vocab * HIDDEN + vocab * HIDDEN // 32 * 4


@pytest.mark.parametrize(("type_name", "vocab"), [("Q6_K", 100), ("Q4_K", 96), ("Q4_0", 37)])
def test_untied_gguf_head_logits(type_name: str, vocab: int) -> None:
    t = _tensor("lm_head.weight", type_name, vocab, seed=2)
    method = GGUFQuantConfig({t.name: t}).get_linear_method("lm_head")
    assert isinstance(method, GGUFLinearMethod) and method.raw_tensor_names == ("lm_head.weight",)
    head = LMHead(vocab, HIDDEN, torch.bfloat16, quant_method=method)
    raw = torch.from_numpy(t.data)
    head.weight.weight_loader(head.weight, raw)
    head.process_weights_after_loading()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    logits = head(x)
    assert logits.dtype == torch.float32 and logits.shape == (3, vocab)
    assert _rel(logits, x.float() @ dequantize(raw, type_name).t()) < 1e-2


def test_quant_config_methods() -> None:
    emb = _tensor("model.embed_tokens.weight", "Q8_0", 32)
    out = _tensor("lm_head.weight", "Q6_K", 32)
    tied = GGUFQuantConfig({emb.name: emb})
    assert tied.get_linear_method("lm_head") is None  # runs through the embedding's method
    assert tied.get_embedding_method("model.embed_tokens").embedding  # type: ignore[union-attr]
    untied = GGUFQuantConfig({emb.name: emb, out.name: out})
    assert untied.get_linear_method("lm_head").layout[0][1] == "Q6_K"  # type: ignore[union-attr]
    f32 = _tensor("model.embed_tokens.weight", "F32", 32)
    assert GGUFQuantConfig({f32.name: f32}).get_embedding_method("model.embed_tokens") is None


# ---- whole models ---------------------------------------------------------------------------


class _FloatEmbeddingConfig(GGUFQuantConfig):
    """The path before: embedding dequantized at load to a float table, float (tied) head."""

    def get_embedding_method(self, prefix: str) -> None:
        return None


def _model(ckpt: GGUFCheckpoint, dtype: torch.dtype, quant: GGUFQuantConfig) -> torch.nn.Module:
    config = ckpt.hf_config
    model = resolve_model_class(config)(config, dtype, TorchReferenceBackend(), quant).eval()
    model.load_weights(ckpt.iter_weights(show_progress=False, raw_names=raw_tensor_names(model)))
    return model


def _greedy(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    ids = prompt.clone()
    for _ in range(steps):
        caches = [
            torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK), dtype=model.dtype)
            for _ in range(model.num_layers)
        ]
        logits = run_schedule(model, caches, [ids], [[len(ids)]])[0]
        ids = torch.cat([ids, logits[-1:].argmax(-1)])
    return ids[len(prompt) :].tolist()


@pytest.mark.parametrize("embed_type", ["Q8_0", "Q4_K"])
def test_tied_gguf_model_same_greedy_tokens_as_float_embedding(tmp_path: Path, embed_type: str) -> None:
    # Q4_K with bf16: an int4pack head (bf16 scales) with lookups from the raw blocks; Q8_0: the
    # default model's case, one bf16 table as before.
    ckpt = GGUFCheckpoint(_write_llama(tmp_path / "tied.gguf", embed_type, None, vocab=96))
    assert ckpt.hf_config.tie_word_embeddings
    prompt = torch.tensor([3, 17, 5, 9, 90, 1])
    for dtype in (torch.float32, torch.bfloat16):
        new = _model(ckpt, dtype, GGUFQuantConfig.from_checkpoint(ckpt))
        old = _model(ckpt, dtype, _FloatEmbeddingConfig.from_checkpoint(ckpt))
        assert new.model.embed_tokens.quant_method is not None and old.model.embed_tokens.quant_method is None
        assert _greedy(new, prompt, 9) == _greedy(old, prompt, 9), (embed_type, dtype)  # context 16
        if dtype == torch.float32:  # exact reference: the same logits bit for bit
            caches = [
                torch.zeros(new.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK)) for _ in range(new.num_layers)
            ]
            got = run_schedule(new, caches, [prompt], [[6]])[0]
            caches = [
                torch.zeros(old.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK)) for _ in range(old.num_layers)
            ]
            assert torch.equal(got, run_schedule(old, caches, [prompt], [[6]])[0])


def _write_llama(path: Path, embed_type: str, head_type: str | None, vocab: int = 100) -> Path:
    """One Llama layer in a Q4_K_M-like mix (Q4_K, Q6_K for v and down) with the given embedding
    type and untied head type (None: tied, no output.weight)."""
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    heads, kv_heads, inter = 4, 2, 512
    for key, value in (("block_count", 1), ("context_length", 16), ("embedding_length", HIDDEN),
                       ("feed_forward_length", inter), ("head_count", heads), ("head_count_kv", kv_heads)):  # fmt: skip
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_uint32("llama.vocab_size", vocab)

    def add(name: str, type_name: str, rows: int, cols: int) -> None:
        # Larger embedding/head values: sharper logits, so greedy choices are not near-ties.
        scale = weight_scale(type_name) * (20 if name.startswith(("token_embd", "output.")) else 1)
        raw = random_blocks(type_name, rows, cols, rng, scale)
        w.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[type_name])

    kv = HIDDEN // heads * kv_heads
    add("token_embd.weight", embed_type, vocab, HIDDEN)
    for norm in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        w.add_tensor(norm, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for name, t, rows, cols in (("attn_q", "Q4_K", HIDDEN, HIDDEN), ("attn_k", "Q4_K", kv, HIDDEN),
                                ("attn_v", "Q6_K", kv, HIDDEN), ("attn_output", "Q4_K", HIDDEN, HIDDEN),
                                ("ffn_gate", "Q4_K", inter, HIDDEN), ("ffn_up", "Q4_K", inter, HIDDEN),
                                ("ffn_down", "Q6_K", HIDDEN, inter)):  # fmt: skip
        add(f"blk.0.{name}.weight", t, rows, cols)
    if head_type is not None:
        add("output.weight", head_type, vocab, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- Triton kernels under the interpreter ----------------------------------------------------


@pytest.fixture(scope="module")
def tg() -> Iterator[object]:
    pytest.importorskip("triton")
    from tests.quant.test_gguf_triton import GGUF_KERNEL_MODULES
    from tests.triton_interpreted import interpreted

    with interpreted(GGUF_KERNEL_MODULES, "_fused_kernel") as module:
        yield module


@pytest.fixture
def triton_on_cpu(tg, monkeypatch: pytest.MonkeyPatch) -> object:  # noqa: ANN001
    """Kernel choice as on a GPU: the Triton kernel accepts CPU tensors (run interpreted)."""

    def can_implement(cls, shards, device, dtype) -> bool:  # noqa: ANN001
        return dtype in (torch.bfloat16, torch.float16) and all(s.type_name in planes.FORMATS for s in shards)

    monkeypatch.setattr(gk.TritonGGUFKernel, "can_implement", classmethod(can_implement))
    return tg


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                       "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"])  # fmt: skip
def test_triton_gather_rows_exact(tg, type_name: str) -> None:  # noqa: ANN001
    vocab = 37
    raw = torch.from_numpy(
        random_blocks(type_name, vocab, HIDDEN, np.random.default_rng(3), weight_scale(type_name))
    )
    seg = tg.Segment(type_name, 0, vocab, HIDDEN, planes.repack(raw, type_name))
    table = dequantize(raw, type_name)
    ids = _ids(vocab, 21)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((len(ids), HIDDEN), float("nan"), dtype=dtype)
        tg.gather_rows(seg, ids, out)
        assert torch.equal(out, table[ids].to(dtype)), dtype


def test_triton_tied_and_untied_embedding(triton_on_cpu) -> None:  # noqa: ANN001
    vocab = 37
    emb, head, table = _embedding("Q4_K", vocab, torch.bfloat16, tied=True)
    kernel = emb.quant_method.kernel
    assert kernel.name == "triton-gguf" and kernel.fallback is None and kernel.matmul
    assert emb.weight.numel() == 0 and not emb.quant_method.rows_from_raw  # one copy: the planes
    assert _bytes(emb) <= 1.05 * vocab * emb.quant_method.shards[0].row_bytes
    ids = _ids(vocab, 9)
    assert torch.equal(emb(ids), F.embedding(ids, table.to(torch.bfloat16)))
    for m in (1, 4):
        x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        logits = head(x)
        assert logits.dtype == torch.float32 and logits.shape == (m, vocab)
        assert _rel(logits, x.float() @ table.t()) < 1e-2

    emb, _, table = _embedding("Q6_K", vocab, torch.bfloat16, tied=False)
    assert emb.quant_method.kernel.name == "triton-gguf" and not emb.quant_method.kernel.matmul
    assert torch.equal(emb(ids), F.embedding(ids, table.to(torch.bfloat16)))


def test_q4_k_m_model_weight_memory_near_file_bytes(tmp_path: Path, triton_on_cpu) -> None:  # noqa: ANN001
    ckpt = GGUFCheckpoint(_write_llama(tmp_path / "q4km.gguf", "Q4_K", "Q6_K"))
    assert not ckpt.hf_config.tie_word_embeddings
    file_bytes = sum(t.n_bytes for t in ckpt.tensors)
    model = _model(ckpt, torch.bfloat16, GGUFQuantConfig.from_checkpoint(ckpt))
    kernels = {
        name: m.quant_method.kernel.name
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)
    }
    assert set(kernels.values()) == {"triton-gguf"} and {"model.embed_tokens", "lm_head"} <= set(kernels)
    assert not any(hasattr(m, "gguf_dequantized") for m in model.modules())
    total = _bytes(model)
    assert file_bytes <= total <= 1.05 * file_bytes, (total, file_bytes)

    ref = _model(ckpt, torch.float32, GGUFQuantConfig.from_checkpoint(ckpt))  # exact fp32 reference
    ids = torch.tensor([5, 99, 0, 42, 7])
    out = []
    for m in (model, ref):
        caches = [torch.zeros(m.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK), dtype=m.dtype)]
        out.append(run_schedule(m, caches, [ids], [[4], [1]])[0])
    assert out[0].dtype == torch.float32 and _rel(out[0], out[1]) < 3e-2
    assert torch.equal(out[0].argmax(-1), out[1].argmax(-1))


def test_inexact_rows_fall_back_to_raw_blocks(triton_on_cpu, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    # A kernel whose lookups disagree with the reference (e.g. FMA contraction on some GPU) is
    # caught by the load-time probe: the embedding then reads its raw blocks.
    monkeypatch.setattr(triton_on_cpu, "gather_rows", lambda seg, ids, dst, block_n=16: dst.zero_())
    emb, _, table = _embedding("Q4_K", 37, torch.bfloat16, tied=False)
    assert isinstance(emb.quant_method.kernel, gk.DequantPerCallKernel)
    assert [n for n, _ in emb.named_buffers()] == [] and _bytes(emb) == emb.weight.numel()
    ids = _ids(37, 9)
    assert torch.equal(emb(ids), F.embedding(ids, table.to(torch.bfloat16)))
    emb, head, table = _embedding("Q4_K", 37, torch.bfloat16, tied=True)  # tied: raw kept beside
    assert emb.quant_method.kernel.name == "triton-gguf" and emb.quant_method.rows_from_raw
    assert torch.equal(emb(ids), F.embedding(ids, table.to(torch.bfloat16)))

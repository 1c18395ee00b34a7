"""GGUF loader: config, names, dequantized values and the Q/K un-permutation, proven against
transformers' own GGUF conversion of the real SmolLM2 file, plus tiny synthetic files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from paphos.loader import GGUFCheckpoint, LoaderError, gguf_to_hf_name, unpermute_qk


@pytest.fixture(scope="module")
def transformers_reference(smol_path: Path, smol_checkpoint: GGUFCheckpoint) -> dict:
    """transformers' GGUF loading: the function `from_pretrained(gguf_file=...)` runs for llama
    files (called directly, since `from_pretrained` also wants `accelerate` for GGUF)."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = LlamaForCausalLM(smol_checkpoint.hf_config)
    return load_gguf_checkpoint(str(smol_path), return_tensors=True, model_to_load=model)


def test_config_matches_transformers(smol_checkpoint: GGUFCheckpoint, transformers_reference: dict) -> None:
    ours = smol_checkpoint.hf_config
    ref = transformers_reference["config"]
    assert type(ours).__name__ == "LlamaConfig" and ours.architectures == ["LlamaForCausalLM"]
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "vocab_size",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
    ):  # fmt: skip
        assert getattr(ours, key) == ref[key], key
    assert ours.head_dim == 64
    assert ours.rope_parameters["rope_theta"] == ref["rope_theta"] == 100000.0
    assert (ours.num_hidden_layers, ours.num_attention_heads, ours.num_key_value_heads) == (30, 9, 3)
    assert ours.tie_word_embeddings  # SmolLM2 has no output.weight


def test_weights_match_transformers(smol_checkpoint: GGUFCheckpoint, transformers_reference: dict) -> None:
    ref = transformers_reference["tensors"]
    ours = dict(smol_checkpoint.iter_weights(show_progress=False))
    # Tied: neither side has a separate lm_head in the file; the model ties it to the embedding.
    ref.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(ref)
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        # (a plain max-abs check: assert_close costs seconds on 135M values)
        assert (tensor - ref[name].float()).abs().max().item() <= 1e-6, name
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows: each head's [2, d/2] halves -> [d/2, 2]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape", [(24, 5), (24,)])
def test_unpermute_inverts_llamacpp_permutation(shape: tuple[int, ...]) -> None:
    hf = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for n_head in (1, 2, 3, 6):
        permuted = torch.from_numpy(_llamacpp_permute(hf, n_head).copy())
        assert not torch.equal(permuted, torch.from_numpy(hf))
        assert torch.equal(unpermute_qk(permuted, n_head), torch.from_numpy(hf))


def test_name_mapping() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert gguf_to_hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.2.attn_k_norm.weight", "qwen3") == "model.layers.2.self_attn.k_norm.weight"
    assert gguf_to_hf_name("blk.2.attn_q_norm.weight", "gemma3") == "model.layers.2.self_attn.q_norm.weight"
    assert gguf_to_hf_name("blk.0.mystery.weight") is None


def test_smollm2_metadata(smol_checkpoint: GGUFCheckpoint, smol_tokenizer) -> None:
    # <|im_end|> (the file's eos) first, then <|endoftext|>, which llama.cpp also stops on.
    assert smol_checkpoint.eos_token_ids(smol_tokenizer) == (2, 0)
    assert smol_checkpoint.generation_defaults() == {}
    assert smol_checkpoint.quant_summary().startswith("Q4_1 x210")


# ---- tiny synthetic files ---------------------------------------------------------------------


def _write_gguf(
    path: Path, arch: str, tensors: dict[str, np.ndarray], *, heads=4, kv_heads=2, **extra
) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{arch}.vocab_size", 8)
    w.add_eos_token_id(7)
    for key, value in extra.items():
        getattr(w, f"add_{key}")(value)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_tensors(rng: np.random.Generator, *, bias: bool, tied: bool) -> dict[str, np.ndarray]:
    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    t = {
        "token_embd.weight": r(8, 16), "output_norm.weight": r(16),
        "blk.0.attn_norm.weight": r(16), "blk.0.ffn_norm.weight": r(16),
        "blk.0.attn_q.weight": r(16, 16), "blk.0.attn_k.weight": r(8, 16), "blk.0.attn_v.weight": r(8, 16),
        "blk.0.attn_output.weight": r(16, 16), "blk.0.ffn_gate.weight": r(32, 16),
        "blk.0.ffn_up.weight": r(32, 16), "blk.0.ffn_down.weight": r(16, 32),
    }  # fmt: skip
    if bias:
        t.update({"blk.0.attn_q.bias": r(16), "blk.0.attn_k.bias": r(8), "blk.0.attn_v.bias": r(8)})
    if not tied:
        t["output.weight"] = r(8, 16)
    return t


def test_synthetic_llama_unpermutes_q_and_k(tmp_path: Path) -> None:
    hf = _tiny_tensors(np.random.default_rng(1), bias=False, tied=False)
    stored = dict(hf)
    stored["blk.0.attn_q.weight"] = _llamacpp_permute(hf["blk.0.attn_q.weight"], 4)
    stored["blk.0.attn_k.weight"] = _llamacpp_permute(hf["blk.0.attn_k.weight"], 2)
    ckpt = GGUFCheckpoint(_write_gguf(tmp_path / "tiny.gguf", "llama", stored, sampling_temp=0.7))
    assert ckpt.hf_config.model_type == "llama" and not ckpt.hf_config.tie_word_embeddings
    assert ckpt.hf_config.head_dim == 4 and ckpt.hf_config.vocab_size == 8
    assert ckpt.generation_defaults() == pytest.approx({"temperature": 0.7})
    ours = dict(ckpt.iter_weights(show_progress=False))
    assert set(ours) == {gguf_to_hf_name(n) for n in hf}
    for name, array in hf.items():
        assert torch.equal(ours[gguf_to_hf_name(name)], torch.from_numpy(array)), name


def test_synthetic_qwen2_keeps_layout_and_biases(tmp_path: Path) -> None:
    hf = _tiny_tensors(np.random.default_rng(2), bias=True, tied=True)
    ckpt = GGUFCheckpoint(_write_gguf(tmp_path / "qwen.gguf", "qwen2", hf))
    config = ckpt.hf_config
    assert config.model_type == "qwen2" and config.architectures == ["Qwen2ForCausalLM"]
    assert config.tie_word_embeddings and config.eos_token_id == 7
    ours = dict(ckpt.iter_weights(show_progress=False))
    assert "lm_head.weight" not in ours
    for name, array in hf.items():  # llama.cpp does not permute Qwen2: taken as stored
        assert torch.equal(ours[gguf_to_hf_name(name)], torch.from_numpy(array)), name


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    tensors = _tiny_tensors(np.random.default_rng(3), bias=False, tied=True)
    tensors["blk.0.mystery.weight"] = np.zeros(4, np.float32)
    path = _write_gguf(tmp_path / "odd.gguf", "llama", tensors)
    with pytest.raises(LoaderError, match=r"odd\.gguf.*blk\.0\.mystery\.weight"):
        list(GGUFCheckpoint(path).iter_weights(show_progress=False))


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = _write_gguf(
        tmp_path / "falcon.gguf", "falcon", {"token_embd.weight": np.zeros((8, 16), np.float32)}
    )
    with pytest.raises(LoaderError, match=r"falcon\.gguf.*'falcon' is not supported"):
        GGUFCheckpoint(path)


def test_corrupt_and_missing_files(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(LoaderError, match=r"bad\.gguf: not a readable GGUF file"):
        GGUFCheckpoint(bad)
    with pytest.raises(LoaderError, match=r"nope\.gguf: GGUF file not found"):
        GGUFCheckpoint(tmp_path / "nope.gguf")


# ---- our header reader against gguf.GGUFReader ------------------------------------------------


def test_reader_matches_gguf_reader(tmp_path: Path) -> None:
    import gguf

    from paphos.loader.gguf_reader import read_gguf

    rng = np.random.default_rng(4)
    w = gguf.GGUFWriter(str(tmp_path / "r.gguf"), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 5e5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("tokenizer.chat_template", "{{ messages }} ✓")
    w.add_array("llama.small", [1, 2, 3])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(1000)])  # long: only the length
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(1000)])
    w.add_custom_alignment(64)
    q8 = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor(
        "q8",
        gguf.quants.quantize(q8, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("f16", rng.standard_normal((3, 5)).astype(np.float16))
    w.add_tensor("f32", rng.standard_normal(7).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = read_gguf(tmp_path / "r.gguf")
    ref = gguf.GGUFReader(tmp_path / "r.gguf")
    assert ours.metadata["llama.block_count"] == 3
    assert ours.metadata["llama.rope.freq_base"] == pytest.approx(5e5)
    assert ours.metadata["tokenizer.ggml.add_bos_token"] is True
    assert ours.metadata["tokenizer.chat_template"] == "{{ messages }} ✓"
    assert ours.metadata["llama.small"] == [1, 2, 3]
    assert ours.metadata["tokenizer.ggml.tokens"] == 1000 and ours.metadata["tokenizer.ggml.scores"] == 1000
    assert set(ours.metadata) == set(ref.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.n_bytes == b.n_bytes
        assert a.shape == tuple(int(d) for d in reversed(b.shape))
        got = gguf.quants.dequantize(a.data, a.tensor_type).reshape(a.shape)
        want = gguf.quants.dequantize(b.data, b.tensor_type).reshape(a.shape)
        assert np.array_equal(got, want), a.name


def test_truncated_gguf_is_named(tmp_path: Path) -> None:
    hf = _tiny_tensors(np.random.default_rng(5), bias=False, tied=True)
    path = _write_gguf(tmp_path / "cut.gguf", "llama", hf)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(LoaderError, match=r"cut\.gguf: not a readable GGUF file.*past the end"):
        GGUFCheckpoint(path)

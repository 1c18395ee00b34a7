"""LoRA on quantized bases (GGUF, GPTQ) against PEFT applied to the dequantized base (issue #19).

The reference for each base is an HF `LlamaForCausalLM` in float32 whose projections are the base's
dequantized weights and whose norms, embedding and head are the checkpoint's:
- GPTQ (`gptq-4b-g32-asym-actorder`, act-order, and `gptq-4b-g128-sym`, both made by GPTQModel):
  the weights our loader dequantizes, which tests/quant/test_checkpoint_parity.py proves bit-exact
  with the tool's own dequantizer;
- GGUF (a tiny random llama GGUF written here, Q4_0 / Q4_K / Q8_0 / Q6_K projections mixed over
  its two layers, tied Q8_0 embedding): `gguf`'s numpy dequantizers read through `gguf.GGUFReader`,
  mapped to HF names here, with llama.cpp's Q/K row permutation undone (`unpermute_qk`).
PEFT adapters (random B, see peft_fixtures.py) are made on that reference; PEFT's merged model is
what Paphos, running the quantized base with the adapter beside it, must reproduce.

Tolerance, fp32 runs: 1e-4 on logits, the quantized-checkpoint tests' own tolerance (LOGIT_TOL).
The reference multiplies by exactly the weights Paphos multiplies by, so what remains is fp32
summation order (paged, chunked attention; the adapter as x Aᵀ Bᵀ beside the base matmul against
PEFT's W + s·BA): measured at most 1.5e-5, while the adapters move logits by 0.7 to 24 (checked to
be >= 0.1) and the smallest greedy margin met is 5e-4. Before any adapter is trusted, the base
rows of the same batch must match the reference within 1e-4, so that a difference is the
adapter's.

bf16 on the CPU (GPTQ act-order): 4-bit layers stay packed for torch's int4 matmul (no dense copy
exists) and carry the adapter; the adapter's effect (LoRA logits minus base logits, same prompts)
must equal the reference's (merged minus base, fp32) within 0.5: each bf16 run is within 0.25 of
its fp32 reference (the bound of test_bf16_on_the_cpu_keeps_4_bit_layers_packed; measured 0.11 -
0.21 here, logits up to ~20 where one bf16 ulp is 0.125) and the effect is the difference of two
runs (measured 0.19). The effect itself is over 10x that bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from paphos import LLM
from paphos.loader import unpermute_qk
from paphos.sampling_params import SamplingParams
from tests.engine.conftest import _write_tokenizer
from tests.engine.test_hf_parity import LogitRecorder, hf_greedy, hf_logits
from tests.lora.peft_fixtures import Adapter, TinyLlama, as_tiny_llama, make_adapter
from tests.quant.gguf_blocks import MIXED_TYPE_LAYERS
from tests.quant.gguf_blocks import write_tiny_llama as write_tiny_gguf
from tests.quant.test_checkpoint_parity import LINEARS, LOGIT_TOL, build, checkpoint, dense_weight

GPTQ = ("gptq-4b-g32-asym-actorder", "gptq-4b-g128-sym")
SUBSET = ("k_proj", "o_proj", "up_proj")  # partial bands of the merged q|k|v and gate|up
RANK = 8
NUM_PROMPTS, NEW_TOKENS = 8, 16
BF16_EFFECT_TOL = 0.5


@dataclass
class QuantBase:
    path: Path  # what Paphos loads
    tokenizer: str | None  # --tokenizer, for the GGUF file that carries none
    vocab: int
    reference: TinyLlama  # HF fp32 model on the dequantized weights
    adapters: dict[str, Adapter]


def _hf_llama(config: dict, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied head has no tensor of its own.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


def _gptq_reference(name: str) -> torch.nn.Module:
    path = checkpoint(name)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    stored = load_file(str(path / "model.safetensors"))
    state = {
        k: v.float() for k, v in stored.items() if k.endswith("norm.weight") or "embed" in k or "lm_head" in k
    }
    ours = build(path)
    for i, layer in enumerate(ours.model.layers):
        for theirs, (module_name, shard) in LINEARS.items():
            module = layer.get_submodule(module_name)
            start = sum(module.output_sizes[:shard])
            weight = dense_weight(module)[start : start + module.output_sizes[shard]]
            state[f"model.layers.{i}.{theirs}.weight"] = weight.detach().float().clone()
    return _hf_llama(config, state)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip


def _gguf_reference(path: Path) -> torch.nn.Module:
    """gguf's own numpy dequantizers, HF names, Q/K rows in HF order; tied embedding."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    field = lambda key: reader.fields[f"llama.{key}"].contents()  # noqa: E731
    heads, kv_heads = field("attention.head_count"), field("attention.head_count_kv")
    state = {}
    for t in reader.tensors:
        weight = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if t.name == "token_embd.weight":
            state["model.embed_tokens.weight"] = weight
        elif t.name == "output_norm.weight":
            state["model.norm.weight"] = weight
        else:
            _, layer, kind, _ = t.name.split(".")
            hf = f"model.layers.{layer}.{_GGUF_NAMES[kind]}.weight"
            if kind in ("attn_q", "attn_k"):
                weight = unpermute_qk(weight, heads if kind == "attn_q" else kv_heads)
            state[hf] = weight
    hidden = field("embedding_length")
    config = dict(
        vocab_size=field("vocab_size"), hidden_size=hidden, intermediate_size=field("feed_forward_length"),
        num_hidden_layers=field("block_count"), num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, max_position_embeddings=field("context_length"),
        rms_norm_eps=field("attention.layer_norm_rms_epsilon"), rope_theta=field("rope.freq_base"),
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return _hf_llama(config, state)


def _with_adapters(path: Path, tokenizer: str | None, model: torch.nn.Module, folder: Path) -> QuantBase:
    reference = as_tiny_llama(path, model)
    adapters = {
        "all": make_adapter(reference, folder / "all", rank=RANK, alpha=16, seed=11),
        "subset": make_adapter(
            reference, folder / "subset", rank=RANK, alpha=8, target_modules=SUBSET, seed=12
        ),
    }
    return QuantBase(path, tokenizer, model.config.vocab_size, reference, adapters)


@pytest.fixture(scope="module", params=["gguf", *GPTQ])
def base(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> QuantBase:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gguf":
        path = write_tiny_gguf(folder / "tiny.gguf", MIXED_TYPE_LAYERS, seed=3)
        _write_tokenizer(folder / "tokenizer")  # vocabulary 96 covers the model's 32 ids
        return _with_adapters(path, str(folder / "tokenizer"), _gguf_reference(path), folder)
    return _with_adapters(checkpoint(request.param), None, _gptq_reference(request.param), folder)


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (n,), generator=gen).tolist()
        for n in (3, 6, 9, 13, 17, 22, 28, 35)[:NUM_PROMPTS]
    ]


def _llm(base: QuantBase, dtype: str, **settings: object) -> LLM:
    extra = {"tokenizer": base.tokenizer} if base.tokenizer else {}
    return LLM(
        str(base.path), dtype=dtype, max_model_len=128, block_size=4, num_gpu_blocks_override=160,
        enable_lora=True, max_loras=2, max_lora_rank=RANK, **extra, **settings,
        lora_modules={name: str(a.path) for name, a in base.adapters.items()},
    )  # fmt: skip


def test_adapters_on_the_quantized_base_match_peft_on_the_dequantized_base(
    base: QuantBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One batch of 8 prompts, each alone, with the all-modules adapter and with the subset one,
    prefill chunked beside decode rows: every scheduled row's logits are the reference's (base
    rows: the unmerged reference; adapter rows: PEFT's merged model) within 1e-4, and the greedy
    continuations are HF `generate`'s token for token."""
    llm = _llm(base, "float32", max_num_batched_tokens=32)
    recorder = LogitRecorder(llm.engine, monkeypatch)
    prompts = _prompts(base.vocab, seed=1)
    names = [None, "all", "subset"]
    requests = [(prompt, name) for prompt in prompts for name in names]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([p for p, _ in requests], params, lora=[n for _, n in requests])
    assert recorder.steps_with_mixed_rows > 0, "prefill chunks and decode rows never shared a step"

    models = {None: base.reference.model} | {name: a.merged for name, a in base.adapters.items()}
    by_id = {}
    for (prompt, name), out in zip(requests, outputs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        by_id[out.request_id] = (name, hf_logits(models[name], prompt + tokens))
    worst: dict[str | None, float] = dict.fromkeys(names, 0.0)
    for req_id, position, logits in recorder.rows:
        name, reference = by_id[req_id.split("#")[0]]
        worst[name] = max(worst[name], (logits - reference[position]).abs().max().item())
    assert worst[None] <= LOGIT_TOL, f"the reference is not the base: max |dlogit| {worst[None]:.2e}"
    for name in names[1:]:
        assert worst[name] <= LOGIT_TOL, (
            f"adapter {name!r}: max |dlogit| {worst[name]:.2e} from PEFT's merged model"
        )
    for (prompt, name), out in zip(requests, outputs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(models[name], prompt, NEW_TOKENS), (prompt, name)
    # The adapters matter: far beyond the tolerance, and they change the continuations.
    for name in names[1:]:
        effect = max(
            (hf_logits(models[name], p) - hf_logits(base.reference.model, p)).abs().max().item()
            for p in prompts
        )
        assert effect >= 1000 * LOGIT_TOL, f"adapter {name!r} barely changes the logits ({effect:.2e})"
    continuations = [tuple(out.outputs[0].token_ids) for out in outputs]
    distinct = sum(len(set(continuations[3 * i : 3 * i + 3])) == 3 for i in range(NUM_PROMPTS))
    assert distinct >= NUM_PROMPTS // 2, f"base and both adapters differ on only {distinct} prompts"


def test_bf16_adapter_runs_beside_packed_4_bit_gptq_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bf16 engine on the CPU keeps every act-order 4-bit layer packed, and each prompt's logits
    with an adapter differ from its base logits as PEFT's merged model differs from the base."""
    name = GPTQ[0]
    base = _with_adapters(checkpoint(name), None, _gptq_reference(name), tmp_path)
    llm = _llm(base, "bfloat16")
    model = llm.engine.runner.model
    packed = [m for m in model.modules() if getattr(getattr(m, "quant_method", None), "int4pack_group", None)]
    assert len(packed) == 8, "every decoder linear of the two layers runs packed"
    assert not any(hasattr(m, "dense_weight") for m in packed), "a packed layer also holds a dequantized copy"
    assert all(getattr(m, "lora", None) is not None for m in packed), (
        "LoRA is not attached to the packed layers"
    )
    recorder = LogitRecorder(llm.engine, monkeypatch)
    prompts = _prompts(base.vocab, seed=2)
    names = [None, "all", "subset"]
    requests = [(prompt, n) for prompt in prompts for n in names]
    params = SamplingParams(temperature=0, max_tokens=1)
    outputs = llm.generate([p for p, _ in requests], params, lora=[n for _, n in requests])
    rows: dict[str, dict[int, torch.Tensor]] = {}
    for req_id, position, logits in recorder.rows:
        rows.setdefault(req_id.split("#")[0], {})[position] = logits.float()
    ids = {(tuple(p), n): out.request_id for (p, n), out in zip(requests, outputs, strict=True)}
    models = {None: base.reference.model} | {n: a.merged for n, a in base.adapters.items()}
    for adapter in names[1:]:
        worst = effect_size = 0.0
        for prompt in prompts:
            ours_base, ours = rows[ids[(tuple(prompt), None)]], rows[ids[(tuple(prompt), adapter)]]
            got = torch.stack([ours[i] - ours_base[i] for i in range(len(prompt))])
            want = hf_logits(models[adapter], prompt) - hf_logits(base.reference.model, prompt)
            worst = max(worst, (got - want).abs().max().item())
            effect_size = max(effect_size, want.abs().max().item())
        assert worst <= BF16_EFFECT_TOL, f"{adapter}: the adapter's effect is off by {worst:.3f} in bf16"
        assert effect_size >= 10 * BF16_EFFECT_TOL, f"{adapter}: an effect of {effect_size:.2f} proves little"

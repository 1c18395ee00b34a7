"""FP8 KV-cache scales a quantized checkpoint carries (paphos/quant/kv_cache.py): llm-compressor's
`kv_cache_scheme` (per-layer `self_attn.k_scale` / `v_scale`, older `k_proj.output_scale` /
`v_proj.output_scale`) and AutoFP8's `kv_cache_scheme: "static"` in the `fp8` format.

- the configs take FP8 per tensor, static and symmetric beside integer weights, FP8 weights or
  none (a KV-only recipe), and refuse any other scheme naming the field and value;
- the ct-fp8-dynamic-kv fixture (llm-compressor 0.14.0.1): the scales we load are the ones the
  tool wrote, bit for bit, under either name and on every tensor-parallel rank; with an fp8
  cache our fp32 logits are the tool's own fp32 forward's (which rounds K and V through them)
  within 1e-4 (test_checkpoint_parity.py); with a float cache they change nothing: the logits
  equal, bit for bit, those of the same file without them;
- tiny random Llama, Qwen3 and Gemma 3 models (fp32, torch reference backend), every layer its
  own scales: an fp8 cache gives the logits of a plain torch emulation (tests/models/fp8_kv.py:
  K after RoPE and V rounded to e4m3 through their layer's scale) within 1e-5, while the same
  emulation with the scales 1.0, or with the layers' scales exchanged, lies more than 100 times
  that away; a float32 or bfloat16 cache gives bit for bit the logits of the model without them;
- the engine (CPU: its caches are float, fp8 caches need the Triton backend) logs that the
  checkpoint's scales are ignored and generates exactly what the file without them does.
The Triton backend's model-level test is tests/attention/triton/test_kv_cache_scales_triton.py.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, Qwen3Config
from transformers import LlamaForCausalLM as HFLlama
from transformers import Qwen3ForCausalLM as HFQwen3

from paphos import LLM, SamplingParams
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.layers import parallel
from paphos.layers.parallel import TPGroup
from paphos.loader import load_model_source
from paphos.models.errors import WeightLoadError
from paphos.models.registry import resolve_model_class
from paphos.quant import kv_cache as quant_kv
from paphos.quant.compressed_tensors import CompressedTensorsIntConfig, KVCacheOnlyConfig, from_quant_config
from paphos.quant.errors import QuantConfigError
from paphos.quant.fp8 import Fp8Config
from paphos.quant.registry import select_quant_config
from tests.engine.conftest import _build
from tests.models.fp8_kv import FP8, emulated, layer_scales, ours, run, scale_tensors
from tests.models.test_gemma3_parity import make_hf as make_gemma3
from tests.quant.test_checkpoint_parity import assert_logits_match, build, checkpoint, logits, reference

FIXTURE = "ct-fp8-dynamic-kv"
KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
TOL = 1e-5  # fp8 cache vs the emulation, fp32 logits (measured: 0 to 1e-6)


def _qc(name: str) -> dict[str, Any]:
    return json.loads((checkpoint(name) / "config.json").read_text())["quantization_config"]


def _file_scales(path: Path) -> dict[str, torch.Tensor]:
    return {n: t for n, t in load_file(path / "model.safetensors").items() if n.endswith(("_scale", ".output_scale"))
            and ".self_attn." in n and not n.endswith(("weight_scale", "input_scale"))}  # fmt: skip


def _rewrite(src: Path, dst: Path, tensors: Any = None, qc: Any = None) -> Path:
    """A copy of checkpoint `src` whose tensors are `tensors(dict) -> dict` and whose
    quantization_config is `qc(dict) -> dict | None` (None: removed)."""
    shutil.copytree(src, dst)
    if tensors is not None:
        save_file(tensors(load_file(src / "model.safetensors")), dst / "model.safetensors")
    if qc is not None:
        config = json.loads((src / "config.json").read_text())
        new = qc(copy.deepcopy(config["quantization_config"]))
        if new is None:
            del config["quantization_config"]
        else:
            config["quantization_config"] = new
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _without_scales(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t for n, t in tensors.items() if not n.endswith((".k_scale", ".v_scale"))}


# ------------------------------------------------------------------------------------------ configs


def test_the_tools_config_is_accepted_with_every_weight_format() -> None:
    kv = _qc(FIXTURE)["kv_cache_scheme"]  # as llm-compressor wrote it (observer, scale_dtype, ... too)
    fp8 = from_quant_config(_qc(FIXTURE), tied_embeddings=False)
    assert isinstance(fp8, Fp8Config) and fp8.kv_cache_scales and fp8.kv_cache_scheme
    for name in ("ct-w4a16-sym-g64", "ct-naive-w8a8"):  # pack-quantized, naive-quantized
        config = from_quant_config(_qc(name) | {"kv_cache_scheme": kv}, tied_embeddings=False)
        assert isinstance(config, CompressedTensorsIntConfig) and config.kv_cache_scales
        plain = from_quant_config(_qc(name), tied_embeddings=False)
        assert not plain.kv_cache_scales and plain.kv_cache_scheme is None
    only = from_quant_config({"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense",
                              "quantization_status": "compressed", "kv_cache_scheme": kv}, tied_embeddings=False)  # fmt: skip
    assert isinstance(only, KVCacheOnlyConfig) and only.kv_cache_scales
    assert only.get_linear_method("model.layers.0.self_attn.qkv_proj") is None  # float weights
    assert not Fp8Config.from_compressed_tensors(_qc("ct-fp8-dynamic")).kv_cache_scales


def test_the_fp8_format_takes_autofp8s_static_scheme() -> None:
    autofp8 = Fp8Config.from_hf_quant_config(
        {"quant_method": "fp8", "activation_scheme": "static", "kv_cache_scheme": "static", "ignored_layers": []}
    )
    assert autofp8.kv_cache_scales and autofp8.kv_cache_scheme == "static, per tensor"
    # Without the field, k_scale / v_scale tensors still load (as vLLM takes them) if present.
    plain = Fp8Config.from_hf_quant_config({"quant_method": "fp8", "activation_scheme": "dynamic"})
    assert plain.kv_cache_scales and plain.kv_cache_scheme is None
    mapping = Fp8Config.from_hf_quant_config({"quant_method": "fp8", "kv_cache_scheme": KV})
    assert mapping.kv_cache_scheme is not None
    assert not Fp8Config.runtime().kv_cache_scales  # -q fp8: a float checkpoint has none


BAD = [
    ({"dynamic": True}, r"kv_cache_scheme\.dynamic = True"),
    ({"dynamic": "local"}, r"kv_cache_scheme\.dynamic = 'local'"),
    ({"num_bits": 4}, r"kv_cache_scheme\.num_bits = 4"),
    ({"type": "int"}, r"kv_cache_scheme\.type = 'int'"),
    ({"strategy": "channel"}, r"kv_cache_scheme\.strategy = 'channel'"),
    ({"strategy": "attn_head"}, r"kv_cache_scheme\.strategy = 'attn_head'"),
    ({"strategy": "token", "dynamic": True}, r"kv_cache_scheme\.strategy = 'token'"),
    ({"symmetric": False}, r"kv_cache_scheme\.symmetric = False"),
]
BASES = {
    "int": lambda kv: from_quant_config(_qc("ct-w4a16-sym-g64") | {"kv_cache_scheme": kv}, tied_embeddings=False),
    "float": lambda kv: from_quant_config(_qc(FIXTURE) | {"kv_cache_scheme": kv}, tied_embeddings=False),
    "float direct": lambda kv: Fp8Config.from_compressed_tensors(_qc(FIXTURE) | {"kv_cache_scheme": kv}),
    "kv only": lambda kv: from_quant_config({"quant_method": "compressed-tensors", "config_groups": {},
                                             "format": "dense", "kv_cache_scheme": kv}, tied_embeddings=False),
    "fp8": lambda kv: Fp8Config.from_hf_quant_config({"quant_method": "fp8", "kv_cache_scheme": kv}),
}  # fmt: skip


@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize(("change", "message"), BAD)
def test_other_schemes_are_refused_naming_the_field(base: str, change: dict, message: str) -> None:
    with pytest.raises(QuantConfigError, match=message + " is not supported: FP8 KV-cache scales must be"):
        BASES[base](KV | change)


def test_a_scheme_that_is_no_mapping_is_refused() -> None:
    with pytest.raises(QuantConfigError, match=r"quantization_config\.kv_cache_scheme = 'dynamic' is not supported"):
        Fp8Config.from_hf_quant_config({"quant_method": "fp8", "kv_cache_scheme": "dynamic"})
    with pytest.raises(QuantConfigError, match=r"quantization_config\.kv_cache_scheme = 'static' is not supported"):
        from_quant_config(_qc(FIXTURE) | {"kv_cache_scheme": "static"}, tied_embeddings=False)  # not AutoFP8's


def test_start_up_names_the_file_and_field(tmp_path: Path) -> None:
    bad = _rewrite(checkpoint(FIXTURE), tmp_path / "bad", qc=lambda qc: qc | {"kv_cache_scheme": KV | {"num_bits": 4}})
    with pytest.raises(QuantConfigError, match=r"bad/config.json: quantization_config\.kv_cache_scheme\.num_bits = 4"):
        select_quant_config(load_model_source(str(bad)), None)


# ------------------------------------------------------------------------------------------ the tool's checkpoint


def test_the_scales_we_load_are_the_tools() -> None:
    path = checkpoint(FIXTURE)
    model = build(path)
    written = _file_scales(path)
    assert len(written) == 4 and all(t.numel() == 1 for t in written.values())
    for i, layer in enumerate(model.model.layers):
        k, v = written[f"model.layers.{i}.self_attn.k_scale"], written[f"model.layers.{i}.self_attn.v_scale"]
        assert layer.self_attn.kv_scales == (float(k), float(v))  # exact: bf16 values in float32
        assert layer.self_attn.k_scale.item() == float(k) and layer.self_attn.v_scale.item() == float(v)
    assert model.model.layers[0].self_attn.kv_scales != model.model.layers[1].self_attn.kv_scales


def test_older_compressed_tensors_names_load_the_same(tmp_path: Path) -> None:
    def rename(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n.replace(".self_attn.k_scale", ".self_attn.k_proj.output_scale")
                 .replace(".self_attn.v_scale", ".self_attn.v_proj.output_scale"): t for n, t in tensors.items()}  # fmt: skip

    old = _rewrite(checkpoint(FIXTURE), tmp_path / "old", tensors=rename)
    assert any(n.endswith("k_proj.output_scale") for n in load_file(old / "model.safetensors"))
    new_model, old_model = build(checkpoint(FIXTURE)), build(old)
    for a, b in zip(new_model.model.layers, old_model.model.layers, strict=True):
        assert a.self_attn.kv_scales == b.self_attn.kv_scales
    ids = reference(FIXTURE)[0]["input_ids"]
    assert torch.equal(logits(new_model, ids, [5, 11], FP8), logits(old_model, ids, [5, 11], FP8))


@pytest.mark.parametrize("rank", [0, 1])
def test_every_tensor_parallel_rank_loads_the_scales_whole(rank: int) -> None:
    source = load_model_source(str(checkpoint(FIXTURE)))
    with parallel.building(TPGroup(rank, 2)):
        model = resolve_model_class(source.hf_config)(
            source.hf_config, torch.float32, TorchReferenceBackend(), select_quant_config(source, None)
        )
    source.load_into(model, show_progress=False)
    assert model.model.layers[0].self_attn.num_kv_heads == 1  # the rank's half of the heads
    whole = build(checkpoint(FIXTURE))
    for mine, all_ in zip(model.model.layers, whole.model.layers, strict=True):
        assert mine.self_attn.kv_scales == all_.self_attn.kv_scales


def test_a_float_cache_ignores_the_scales_exactly(tmp_path: Path) -> None:
    stripped = _rewrite(checkpoint(FIXTURE), tmp_path / "stripped", tensors=_without_scales,
                        qc=lambda qc: {k: v for k, v in qc.items() if k != "kv_cache_scheme"})  # fmt: skip
    ref, _ = reference(FIXTURE)
    ids = ref["input_ids"]
    with_scales, without = build(checkpoint(FIXTURE)), build(stripped)
    assert all(layer.self_attn.kv_scales is None for layer in without.model.layers)
    plain = logits(with_scales, ids, [5, 11])
    assert torch.equal(plain, logits(without, ids, [5, 11]))
    # The tool's reference rounds K/V: only the fp8 cache reaches it (test_checkpoint_parity).
    assert (plain - ref["dequant_logits"]).abs().max() > 0.1
    assert_logits_match(FIXTURE, logits(with_scales, ids, [5, 11], FP8), ref["dequant_logits"])


def test_a_layer_without_scales_keeps_one(tmp_path: Path) -> None:
    partial = _rewrite(checkpoint(FIXTURE), tmp_path / "partial",
                       tensors=lambda t: {n: x for n, x in t.items() if not n.startswith("model.layers.1.self_attn.")
                                          or not n.endswith("_scale") or "proj" in n})  # fmt: skip
    model = build(partial)
    assert model.model.layers[0].self_attn.kv_scales is not None
    assert model.model.layers[1].self_attn.kv_scales is None  # the backend's own 1.0
    line, warning = quant_kv.startup_line(model, select_quant_config(load_model_source(str(partial)), None), FP8)
    assert not warning and "(1 of 2 layers" in line and "used, the KV cache is float8_e4m3fn; the other 1 use 1.0" in line
    none = _rewrite(checkpoint(FIXTURE), tmp_path / "none", tensors=_without_scales)
    line, warning = quant_kv.startup_line(build(none), select_quant_config(load_model_source(str(none)), None), FP8)
    assert warning and "declares FP8 KV-cache scales" in line and "an fp8 KV cache would use 1.0" in line


@pytest.mark.parametrize(("value", "message"), [
    (torch.tensor([0.0]), "a KV-cache scale must be positive and finite, got 0.0"),
    (torch.tensor([float("nan")]), "must be positive and finite, got nan"),
    (torch.tensor([0.1, 0.2]), r"has shape \[2\], expected \[1\]"),
])  # fmt: skip
def test_a_bad_scale_names_the_tensor(tmp_path: Path, value: torch.Tensor, message: str) -> None:
    bad = _rewrite(checkpoint(FIXTURE), tmp_path / "bad",
                   tensors=lambda t: t | {"model.layers.1.self_attn.v_scale": value})  # fmt: skip
    with pytest.raises(WeightLoadError, match=r"'model.layers.1.self_attn.v_scale'.*" + message):
        build(bad)


def test_the_start_up_line_says_used_or_ignored() -> None:
    model = build(checkpoint(FIXTURE))
    config = select_quant_config(load_model_source(str(checkpoint(FIXTURE))), None)
    used, warning = quant_kv.startup_line(model, config, FP8)
    assert not warning and used.startswith("KV-cache scales from the checkpoint (2 of 2 layers, k_scale 0.001884..")
    assert used.endswith("used, the KV cache is float8_e4m3fn")
    ignored, _ = quant_kv.startup_line(model, config, torch.bfloat16)
    assert ignored.endswith("ignored, the KV cache is bfloat16 (they apply to --kv-cache-dtype fp8)")
    assert quant_kv.startup_line(build(checkpoint("ct-fp8-dynamic")), None, FP8) is None


# ------------------------------------------------------------------------------------------ random models


def _hf(arch: str) -> tuple[Any, torch.nn.Module]:
    """A tiny HF model (fp32) and its config: Llama (GQA 4/2), Qwen3 (q/k norms, head_dim 32),
    Gemma 3 (q/k norms, sliding windows of 6, soft-capped logits, 7 layers)."""
    if arch == "gemma3":
        return make_gemma3()
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    if arch == "qwen3":
        config = Qwen3Config(architectures=["Qwen3ForCausalLM"], head_dim=32, **common)
        cls = HFQwen3
    else:
        config = LlamaConfig(architectures=["LlamaForCausalLM"], **common)
        cls = HFLlama
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(20.0)  # sharp logits: differences show
    return config, hf


# Two sequences: prompts in chunks (9 + 7 + 2, 5 + 9), a mixed step, then decode rows together.
STEPS = [[9, 5], [7, 9], [2, 1], [1, 1], [1, 1]]


def _seqs(vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (sum(s[i] for s in STEPS),), generator=gen) for i in range(2)]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_an_fp8_cache_applies_each_layers_scales(arch: str) -> None:
    config, hf = _hf(arch)
    seqs = _seqs(config.vocab_size)
    scales = layer_scales(config, hf, seqs, STEPS)
    model = ours(config, hf, torch.float32, scales)
    assert [layer.self_attn.kv_scales for layer in model.model.layers] == scales
    got = run(model, FP8, seqs, STEPS)
    expected = emulated(config, hf, scales, seqs, STEPS)
    assert (got - expected).abs().max() <= TOL
    # Sensitive to the scales and to which layer they belong to:
    ones = emulated(config, hf, [(1.0, 1.0)] * len(scales), seqs, STEPS)
    swapped = emulated(config, hf, scales[::-1], seqs, STEPS)
    assert (ones - expected).abs().max() > 100 * TOL and (got - ones).abs().max() > 100 * TOL
    assert (swapped - expected).abs().max() > 100 * TOL


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_cache_is_bit_identical_without_the_scales(arch: str, dtype: torch.dtype) -> None:
    config, hf = _hf(arch)
    seqs = _seqs(config.vocab_size)
    scales = [(0.01 * (i + 1), 0.02 / (i + 1)) for i in range(config.num_hidden_layers)]
    with_scales = run(ours(config, hf, dtype, scales), dtype, seqs, STEPS)
    assert torch.equal(with_scales, run(ours(config, hf, dtype, None), dtype, seqs, STEPS))


def test_the_engine_logs_and_ignores_scales_with_a_float_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    plain, _ = _build(tmp_path, "llama")
    kv_only = {"quant_method": "compressed-tensors", "config_groups": {}, "format": "dense", "ignore": [],
               "quantization_status": "compressed", "kv_cache_scheme": KV}  # fmt: skip
    scales = dict(scale_tensors([(0.25, 0.375), (0.125, 0.5)]))
    path = _rewrite(plain, tmp_path / "kv", tensors=lambda t: t | scales, qc=None)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": kv_only}))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 14, 3, 77], [8, 8, 21]]
    with caplog.at_level(logging.INFO, logger="paphos"):
        ours = LLM(str(path), dtype="float32", max_model_len=64, block_size=4).generate(prompts, params)
    lines = [r.getMessage() for r in caplog.records if "KV-cache scales" in r.getMessage()]
    assert lines == ["KV-cache scales from the checkpoint (2 of 2 layers, k_scale 0.125..0.25, v_scale 0.375..0.5): "
                     "ignored, the KV cache is float32 (they apply to --kv-cache-dtype fp8)"]  # fmt: skip
    theirs = LLM(str(plain), dtype="float32", max_model_len=64, block_size=4).generate(prompts, params)
    for a, b in zip(ours, theirs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert [x.top_logprobs for x in a.outputs[0].logprobs] == [x.top_logprobs for x in b.outputs[0].logprobs]

"""EXL2 (exllamav2) checkpoints: the decoder, the linear method, the format's config.

The reference here is an EXL2 encoder written in this file from the layout rule of
quant-toolchain.md §5.3, with the scale rounded to fp16 as exllamav2's converter and kernels round
it (paphos/quant/exl2.py's docstring; numpy's float16 here): it packs codes into per-column bit
streams by bit planes, a formulation independent of the decoder's shifts, and the decoder must
return exactly the values the encoder encoded, for every bit width 2..8 (3/5/6/7-bit codes
straddle words), groups of 32/64/128 rows in descending bit order, random permutations, a short
last group and padded output columns. A tiny Llama (and a Qwen2, whose q/k/v have biases) written
as an EXL2 checkpoint by that encoder loads through the registry and `paphos.LLM` and gives the
logits (within 1e-4, float32) and greedy tokens of the HF model whose weights are the encoded values.

This proves the decoder against its own encoder. What proves it against exllamav2 itself is the
tool-made fixtures of scripts/quant_fixtures/exllamav2_fixtures.py (the real converter on the H200,
the tool's own reconstruction and causal logits), in tests/quant/test_checkpoint_parity.py: there
the decoder equals exllamav2's reconstruction bit for bit, 2- to 8-bit groups.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from paphos import LLM
from paphos.attention.torch_ref import TorchReferenceBackend
from paphos.layers.linear import Linear, MergedColumnLinear, QKVLinear
from paphos.layers.weights import ShapeMismatchError
from paphos.loader import load_model_source
from paphos.models.errors import WeightLoadError
from paphos.models.registry import resolve_model_class
from paphos.quant.errors import QuantConfigError
from paphos.quant.exl2 import CHECKPOINT_TENSORS, EXL2Config, EXL2FormatError, dequantize
from paphos.quant.registry import select_quant_config
from paphos.sampling_params import SamplingParams
from tests.engine.conftest import _build
from tests.models.paged import BLOCK, NUM_BLOCKS, hf_logits, run_schedule

LOGIT_TOL = 1e-4
QC = {"quant_method": "exl2", "version": "0.3.2", "bits": 4.0, "head_bits": 6,
      "calibration": {"rows": 32, "length": 64, "dataset": "test"}}  # fmt: skip


# ---------------------------------------------------------------- the encoder


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [rows, N] -> unsigned 32-bit words [ceil(rows * bits / 32), N] (int64): per column,
    code v of each run of 32 rows fills stream bits v * bits .. v * bits + bits - 1, and word w of
    the run holds stream bits 32w .. 32w + 31, least significant first."""
    rows, n = codes.shape
    runs = -(-rows // 32)
    padded = torch.zeros(runs * 32, n, dtype=torch.int64)
    padded[:rows] = codes
    planes = (padded[:, :, None] >> torch.arange(bits)) & 1  # [run row, N, bit]
    stream = planes.view(runs, 32, n, bits).permute(0, 1, 3, 2).reshape(runs, 32 * bits, n)
    words = (stream.view(runs, bits, 32, n) << torch.arange(32)[:, None]).sum(2)
    return words.reshape(runs * bits, n)[: -(-rows * bits // 32)]


def as_int32(unsigned: torch.Tensor) -> torch.Tensor:
    return torch.where(unsigned >= 1 << 31, unsigned - (1 << 32), unsigned).to(torch.int32)


@dataclass
class Encoded:
    tensors: dict[str, torch.Tensor]  # the checkpoint's five tensors
    weight: torch.Tensor  # float32 [N (padded), K]: what they mean, by the rule


def encode(codes: list[torch.Tensor], bits: list[int], qs: torch.Tensor, smax: torch.Tensor, invperm: torch.Tensor) -> Encoded:
    """One linear from its groups' codes ([rows, N] each, in stored row order), scale codes qs
    [G, N] (0..15), fp16 maxima [G] and the input permutation."""
    words = [pack_stream(c, b) for c, b in zip(codes, bits, strict=True)]
    starts = torch.tensor([0, *[w.shape[0] for w in words]]).cumsum(0)[:-1]
    n = qs.shape[1]
    nibbles = F.pad(qs, (0, -n % 8)).view(len(bits), -1, 8) << (4 * torch.arange(8))
    tensors = {
        "q_weight": as_int32(torch.cat(words)),
        "q_scale": as_int32(nibbles.sum(-1)),
        "q_scale_max": smax.to(torch.float16),
        "q_groups": torch.stack([torch.tensor(bits), starts], dim=1).flatten().to(torch.int16),
        "q_invperm": invperm.to(torch.int32),
    }
    # exllamav2's scale in numpy's float16 (its converter: fp16(fp16(max) * fp16(1/256)), then times
    # fp16((qs + 1)**2)); float64 holds its product with a code exactly, which its reconstruction
    # rounds to fp16
    smax16 = smax.numpy().astype(np.float16) * np.float16(1 / 256)
    scale = torch.from_numpy(((qs.numpy() + 1) ** 2).astype(np.float16) * smax16[:, None]).double()
    stored = torch.cat([(c - (1 << (b - 1))).double() * scale[g] for g, (c, b) in enumerate(zip(codes, bits, strict=True))])
    return Encoded(tensors, stored[invperm.long()].t().half().float().contiguous())


def random_layout(k: int, gen: torch.Generator, widths: tuple[int, ...]) -> list[tuple[int, int]]:
    """(bits, rows) per group as the converter lays them out: 32/64/128 rows (the last group
    takes what is left), bit widths in descending order."""
    sizes, row = [], 0
    while row < k:
        sizes.append(min((32, 64, 128)[int(torch.randint(3, (1,), generator=gen))], k - row))
        row += sizes[-1]
    bits = sorted((widths[int(torch.randint(len(widths), (1,), generator=gen))] for _ in sizes), reverse=True)
    return list(zip(bits, sizes, strict=True))


def random_encoded(n: int, k: int, gen: torch.Generator, widths: tuple[int, ...]) -> Encoded:
    layout = random_layout(k, gen, widths)
    codes = [torch.randint(1 << b, (rows, n), generator=gen) for b, rows in layout]
    qs = torch.randint(16, (len(layout), n), generator=gen)
    # log-uniform maxima from 1e-4 to 1: about half of them make max / 256 an fp16 subnormal
    smax = (10 ** (torch.rand(len(layout), generator=gen) * 4 - 4)).half().float()
    return encode(codes, [b for b, _ in layout], qs, smax, torch.randperm(k, generator=gen))


def quantize(w: torch.Tensor, gen: torch.Generator, widths: tuple[int, ...]) -> Encoded:
    """A float weight [N, K] rounded into an EXL2 layout (random groups and permutation), output
    columns padded to a multiple of 32 as the converter does."""
    n, k = w.shape
    layout = random_layout(k, gen, widths)
    perm = torch.randperm(k, generator=gen)
    stored = F.pad(w.double(), (0, 0, 0, -n % 32)).t()[perm]  # stored row j = input row perm[j]
    codes, qs, smax, row = [], [], [], 0
    for bits, rows in layout:
        block, half = stored[row : row + rows], 1 << (bits - 1)
        target = block.abs().amax(0) / half
        top = target.max().half().double()
        q = ((target / top * 256).sqrt().round() - 1).clamp(0, 15)
        scale = (q + 1) ** 2 * top / 256
        codes.append((block / scale).round().clamp(-half, half - 1).long() + half)
        qs.append(q.long())
        smax.append(top)
        row += rows
    return encode(codes, [b for b, _ in layout], torch.stack(qs), torch.stack(smax).float(), torch.argsort(perm))


# ---------------------------------------------------------------- the decoder


def test_hand_packed_words() -> None:
    """Numbers worked out by hand: a 3-bit code straddling words 0 and 1, another at the top of
    word 2; scale code 2 and maximum 2.0 give (2 + 1)**2 * 2 / 256; input row k is stored row 31 - k."""
    q_weight = as_int32(torch.tensor([[0xC0000000], [0x00000001], [0xA0000000]]))
    stored_codes = torch.zeros(32)
    stored_codes[10] = 7  # stream bits 30..32: bits 30, 31 of word 0 and bit 0 of word 1
    stored_codes[31] = 5  # stream bits 93..95: word 2 bits 29 (1), 30 (0), 31 (1)
    w = dequantize(q_weight, torch.tensor([[2]], dtype=torch.int32), torch.tensor([2.0], dtype=torch.float16),
                   torch.tensor([3, 0], dtype=torch.int16), torch.arange(31, -1, -1, dtype=torch.int32))  # fmt: skip
    assert torch.equal(w, ((stored_codes - 4) * 9 * 2 / 256).flip(0)[None])
    four_bit = as_int32(torch.tensor([[0x76543210], [0xFEDCBA98]] * 2))  # codes 0..15 twice, in order
    w = dequantize(four_bit, torch.tensor([[15]], dtype=torch.int32), torch.tensor([1.0], dtype=torch.float16),
                   torch.tensor([4, 0], dtype=torch.int16), torch.arange(32, dtype=torch.int32))  # fmt: skip
    assert torch.equal(w[0], (torch.arange(32) % 16 - 8).float())


def test_scale_takes_exllamav2s_fp16_roundings() -> None:
    """max = 2**-10 + 2**-20 (an fp16 value): max / 256 = 2**-18 + 2**-28 rounds to 2**-18 in fp16
    (subnormal spacing 2**-24), so scale code 15 gives 2**-10 where exact arithmetic gives
    2**-10 + 2**-20; scale code 2 gives 9 * 2**-18, exact in fp16 (576 * 2**-24)."""
    q_weight = as_int32(torch.tensor([[0x9] * 2] + [[0] * 2] * 3))  # 4-bit: row 0 holds code 9, the rest 0
    q_scale = torch.tensor([[15 | 2 << 4]], dtype=torch.int32)  # column 0: qs 15, column 1: qs 2
    smax = torch.tensor([2**-10 + 2**-20], dtype=torch.float16)
    w = dequantize(q_weight, q_scale, smax, torch.tensor([4, 0], dtype=torch.int16), torch.arange(32, dtype=torch.int32))
    assert w[0, 0].item() == 2**-10 and w[1, 0].item() == 9 * 2**-18
    assert w[0, 1].item() == -8 * 2**-10 and w[1, 1].item() == -8 * 9 * 2**-18


@pytest.mark.parametrize("bits", range(2, 9))
def test_every_bit_width_decodes_exactly(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    enc = random_encoded(64, 352, gen, (bits,))
    assert torch.equal(dequantize(**enc.tensors), enc.weight)


@pytest.mark.parametrize(("k", "seed"), [(576, 0), (576, 1), (320, 2), (200, 3)])
def test_mixed_groups_decode_exactly(k: int, seed: int) -> None:
    """Descending widths 8/6/5/4/3/2 in groups of 32/64/128 rows; K = 200 ends in a group whose
    rows are not a multiple of 32."""
    gen = torch.Generator().manual_seed(seed)
    enc = random_encoded(96, k, gen, (8, 6, 5, 4, 3, 2))
    assert len(set(enc.tensors["q_groups"][0::2].tolist())) > 2
    assert torch.equal(dequantize(**enc.tensors), enc.weight)


def test_group_offsets_above_32767_read_as_unsigned() -> None:
    """q_groups is int16 on disk but exllamav2 reads it as uint16: 8-bit groups of a K = 131104
    input put the last group's first q_weight row at 32768."""
    k = 32 * 4097
    codes = [torch.full((k - 32, 1), 200), torch.full((32, 1), 3)]
    enc = encode(codes, [8, 2], torch.full((2, 1), 15), torch.tensor([1.0, 1.0]), torch.arange(k))
    assert enc.tensors["q_groups"][3] < 0
    assert torch.equal(dequantize(**enc.tensors), enc.weight)


def _corrupt(name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    enc = random_encoded(32, 256, torch.Generator().manual_seed(9), (6, 4, 3))
    tensors = dict(enc.tensors)
    tensors[name] = change(tensors[name].clone())
    return tensors


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("q_groups", lambda t: t[:-1], r"shape \[\d+\]: expected pairs"),
        ("q_groups", lambda t: t.index_fill(0, torch.tensor([0]), 9), "group 0 has 9 bits"),
        ("q_groups", lambda t: t.index_fill(0, torch.tensor([1]), 1), "group 0 starts at q_weight row 1"),
        ("q_weight", lambda t: t[:-1], r"group \d+ \(\d bits, q_weight rows \d+\.\.\d+\) does not fit 256 input rows"),
        ("q_invperm", lambda t: t.index_fill(0, torch.tensor([0]), 1), r"is not a permutation of 0\.\.255"),
        ("q_scale", lambda t: t[:, :2], r"shape \[\d+, 2\], expected \[\d+, 4\]"),
        ("q_scale_max", lambda t: t[:-1], r"shape \[\d+\], expected"),
    ],
)  # fmt: skip
def test_inconsistent_tensors_name_the_tensor(
    name: str, change: Callable[[torch.Tensor], torch.Tensor], message: str
) -> None:
    tensors = _corrupt(name, change)
    fault = "q_groups" if name == "q_weight" else name  # the groups claim rows q_weight lacks
    with pytest.raises(EXL2FormatError, match=message) as e:
        dequantize(**tensors)
    assert e.value.tensor == fault


# ---------------------------------------------------------------- the linear method


def _load_shards(layer: torch.nn.Module, shards: dict[object, Encoded]) -> None:
    for shard, enc in shards.items():
        for name, tensor in enc.tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor) if shard is None else param.weight_loader(param, tensor, shard)


def test_merged_shards_keep_their_own_groups_and_permutations() -> None:
    """q, k and v quantized apart, with different bit widths, group counts and permutations."""
    gen = torch.Generator().manual_seed(4)
    config = EXL2Config.from_quant_config(QC)
    layer = QKVLinear(64, 16, 4, 2, quant_method=config.get_linear_method("model.layers.0.self_attn.qkv_proj"))
    shards = {"q": random_encoded(64, 64, gen, (8, 5)), "k": random_encoded(32, 64, gen, (3,)),
              "v": random_encoded(32, 64, gen, (6, 4, 2))}  # fmt: skip
    _load_shards(layer, shards)
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.dense_weight, torch.cat([shards[s].weight for s in "qkv"]))
    assert not any(hasattr(layer, name) for name in CHECKPOINT_TENSORS)
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ layer.dense_weight.t(), rtol=0, atol=1e-5)
    assert config.summary() == [
        "EXL2: 1 layers dequantized at load (no EXL2 kernel on cpu) (e.g. model.layers.0.self_attn.qkv_proj)"
    ]


def test_padded_output_columns_are_cropped() -> None:
    """The converter pads N = 40 to 64 columns; the layer keeps its 40 rows."""
    enc = quantize(torch.randn(40, 64, generator=torch.Generator().manual_seed(5)), torch.Generator().manual_seed(6), (4,))
    assert enc.tensors["q_weight"].shape[1] == 64
    layer = Linear(64, 40, quant_method=EXL2Config.from_quant_config(QC).get_linear_method("model.layers.0.mlp.down_proj"))
    _load_shards(layer, {None: enc})
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.dense_weight, enc.weight[:40])


def test_loader_names_the_checkpoint_tensor() -> None:
    method = EXL2Config.from_quant_config(QC).get_linear_method("model.layers.3.mlp.gate_up_proj")
    layer = MergedColumnLinear(64, [32, 32], quant_method=method)
    enc = random_encoded(32, 64, torch.Generator().manual_seed(7), (4,))
    with pytest.raises(EXL2FormatError, match=r"model\.layers\.3\.mlp\.up_proj\.q_weight: dtype torch\.int16"):
        layer.q_weight.weight_loader(layer.q_weight, enc.tensors["q_weight"].to(torch.int16), 1)
    with pytest.raises(ShapeMismatchError, match=r"expected shape \[64\], got \[63\]"):
        layer.q_invperm.weight_loader(layer.q_invperm, enc.tensors["q_invperm"][:63], 0)
    with pytest.raises(ShapeMismatchError):  # 48 columns: neither N = 32 nor N padded
        layer.q_weight.weight_loader(layer.q_weight, F.pad(enc.tensors["q_weight"], (0, 16)), 0)
    _load_shards(layer, {0: enc})
    bad = dict(enc.tensors, q_invperm=torch.zeros(64, dtype=torch.int32))
    _load_shards(layer, {1: Encoded(bad, enc.weight)})
    with pytest.raises(EXL2FormatError, match=r"model\.layers\.3\.mlp\.up_proj\.q_invperm: is not a permutation"):
        layer.quant_method.process_weights_after_loading(layer)


# ---------------------------------------------------------------- whole models against HF

# Bit widths per quantized module, in turn: q, k and v (gate and up) of one layer differ.
WIDTHS = ((8, 4, 2), (3,), (6, 5, 4), (5, 3, 2), (4,), (8, 6), (6, 3, 2))
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODEL = dict(hidden_size=128, intermediate_size=192)


def write_exl2(path: Path, hf: torch.nn.Module, seed: int, tie: bool = False) -> None:
    """Rewrite the HF checkpoint at `path` as the converter would: every linear and lm_head as
    EXL2 tensors, everything else fp16; set `hf`'s weights to exactly what the file holds."""
    gen = torch.Generator().manual_seed(seed)
    quantized = [n for n, _ in hf.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS] + ["lm_head"]
    tensors = {}
    with torch.no_grad():
        for i, name in enumerate(quantized):
            linear = hf.get_submodule(name)
            enc = quantize(linear.weight.float(), gen, WIDTHS[i % len(WIDTHS)])
            tensors |= {f"{name}.{t}": v for t, v in enc.tensors.items()}
            linear.weight.copy_(enc.weight[: linear.weight.shape[0]])
        for name, param in hf.named_parameters():
            if name.rsplit(".", 1)[0] in quantized and name.endswith(".weight"):
                continue
            param.copy_(param.half().float())
            tensors[name] = param.detach().half()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config |= {"quantization_config": QC, "tie_word_embeddings": tie}
    (path / "config.json").write_text(json.dumps(config))


def build(path: Path) -> tuple[torch.nn.Module, Any]:
    source = load_model_source(str(path))
    quant_config = select_quant_config(source, None)
    model = resolve_model_class(source.hf_config)(source.hf_config, torch.float32, TorchReferenceBackend(), quant_config)
    source.load_into(model, show_progress=False)
    return model.eval(), quant_config


def hf_greedy(hf: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    seq = torch.tensor(prompt)
    for _ in range(steps):
        seq = torch.cat([seq, hf_logits(hf, seq)[-1].argmax()[None]])
    return seq[len(prompt) :].tolist()


def check_against_hf(path: Path, hf: torch.nn.Module) -> None:
    model, quant_config = build(path)
    assert quant_config.summary() == [
        "EXL2: 9 layers dequantized at load (no EXL2 kernel on cpu) (e.g. model.layers.0.self_attn.qkv_proj)"
    ]
    ids = torch.randint(3, 96, (12,), generator=torch.Generator().manual_seed(3))
    caches = [torch.zeros(model.kv_cache_shape_per_layer(NUM_BLOCKS, BLOCK)) for _ in range(model.num_layers)]
    ours = run_schedule(model, caches, [ids], [[5], [4], [1], [1], [1]])[0]  # chunked prefill, then decode
    torch.testing.assert_close(ours, hf_logits(hf, ids), rtol=0, atol=LOGIT_TOL)
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=4)
    prompts = [ids[:7].tolist(), ids[3:].tolist()]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_matches_hf_on_the_encoded_weights(tmp_path: Path, arch: str) -> None:
    """Every linear and the head quantized (Qwen2: q/k/v biases in fp16 beside them)."""
    path, hf = _build(tmp_path, arch, **MODEL)
    hf.config._attn_implementation = "eager"
    write_exl2(path, hf, seed=11)
    check_against_hf(path, hf)


def test_tied_model_runs_the_checkpoints_quantized_head(tmp_path: Path) -> None:
    """exllamav2 writes a quantized lm_head for a model with tied embeddings and runs it."""
    path, hf = _build(tmp_path, "llama", **MODEL)
    hf.config._attn_implementation = "eager"
    write_exl2(path, hf, seed=12, tie=True)
    check_against_hf(path, hf)


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    path, hf = _build(tmp_path, "llama", **MODEL)
    write_exl2(path, hf, seed=13)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_proj.q_invperm"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"lacks 1 tensor\(s\) .*model\.layers\.1\.self_attn\.v_proj\.q_invperm"):
        build(path)


# ---------------------------------------------------------------- config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = _build(tmp_path_factory.mktemp("exl2"), "llama")
    return path


def _source(model_dir: Path, qc: dict) -> Any:
    config = json.loads((model_dir / "config.json").read_text()) | {"quantization_config": qc}
    (model_dir / "config.json").write_text(json.dumps(config))
    return load_model_source(str(model_dir))


def test_the_registry_picks_exl2(model_dir: Path) -> None:
    source = _source(model_dir, QC)
    for flag in (None, "exl2"):
        config = select_quant_config(source, flag)
        assert isinstance(config, EXL2Config) and config.unties_lm_head and config.head_bits == 6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_bits": 16}, r"config\.json: quantization_config\.head_bits = 16 is not supported: a quantized lm_head of 2, 3, 4, 5, 6, 8 bits"),
        ({"head_bits": 7}, r"quantization_config\.head_bits = 7"),
        ({"bits": "4.0"}, r"quantization_config\.bits = '4\.0' is not supported"),
    ],
)  # fmt: skip
def test_unsupported_config_names_the_field(model_dir: Path, change: dict, message: str) -> None:
    with pytest.raises(QuantConfigError, match=message):
        select_quant_config(_source(model_dir, QC | change), None)

"""What every quantized-checkpoint fixture shares, whichever tool made it: the tiny source model,
the calibration and prompt ids, and the reference file, the tool-side answers the engine's parity
tests compare against (tests/quant/data/references/<fixture>.safetensors, beside the checkpoint
directory tests/quant/data/checkpoints/<fixture>/, which stays loadable as it is).

Runs inside each tool's venv (transformers 4.51 to 5.x), so it uses only torch, safetensors and the
transformers Llama classes. A tool module quantizes, then hands `finish_fixture` a `ToolReference`:
the tool's own dequantized weight of every quantized linear and, where one runs on CPU, the tool's
own quantized forward. `finish_fixture` builds the fp32 dense reference model from the checkpoint's
own non-quantized tensors plus those weights, checks that both agree, and writes the file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save

VOCAB = 96
# The tiny Llama of every fixture. intermediate_size 320 gives down_proj K=320: at group size 128
# its last group is 64 rows long, the short-group case real models (SmolLM2's K=576) have.
LLAMA_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=320,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
SOURCE_SEED, CALIB_SEED, PROMPT_SEED = 0, 1, 2
LM_HEAD_GAIN = 20.0  # random init leaves logits nearly flat; greedy choices must not be near-ties
N_CALIB, CALIB_LEN = 32, 64
N_PROMPTS, PROMPT_LEN, N_GREEDY = 8, 16, 32
LAYER0_LINEARS = tuple(
    f"model.layers.0.{m}.weight"
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# A quantized KV cache's per-layer scales (llm-compressor's kv_cache_scheme).
KV_CACHE_SCALES = (".self_attn.k_scale", ".self_attn.v_scale")
# GPTQModel's per-module quantization log, written beside the checkpoint but not part of it.
DROPPED_FILES = ("quant_log.csv",)
# A broken quantizer (wrong layer, wrong packing) lands far above this; 4-bit g128 RTN is ~0.1.
MAX_REL_WEIGHT_ERROR = 0.3


def _random_ids(seed: int, rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (rows, cols), generator=gen, dtype=torch.int64)


def calibration_ids() -> torch.Tensor:
    """[32, 64] int64 token ids in 3..95: every tool's calibration set."""
    return _random_ids(CALIB_SEED, N_CALIB, CALIB_LEN)


def calibration_texts() -> list[str]:
    """The same calibration set as text ("w17 w4 ..."), for tools that tokenize themselves; the
    WordLevel tokenizer maps it back to exactly `calibration_ids()` (no BOS is added)."""
    return [" ".join(f"w{int(t)}" for t in row) for row in calibration_ids()]


def prompt_ids() -> torch.Tensor:
    """[8, 16] int64 token ids in 3..95: the prompts of every reference file."""
    return _random_ids(PROMPT_SEED, N_PROMPTS, PROMPT_LEN)


def write_tokenizer(path: Path) -> None:
    """The WordLevel tokenizer of tests/engine/conftest.py, readable by transformers 4.51 and 5.x."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(path)
    # transformers 5 writes "TokenizersBackend", a class transformers 4.51 (AutoAWQ's venv) lacks.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def build_source(path: Path) -> None:
    """The fp32 tiny Llama every fixture quantizes, with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(architectures=["LlamaForCausalLM"], **LLAMA_CONFIG)
    torch.manual_seed(SOURCE_SEED)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_GAIN)
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    # transformers 5 keeps rope_theta only inside rope_parameters; readers that look for the
    # top-level key would silently fall back to their own default. One dtype key, the name both
    # transformers 4 and 5 read: llm-compressor re-saves this file patching only the first of
    # "torch_dtype"/"dtype" it finds, which would leave the other one stale.
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = LLAMA_CONFIG["rope_theta"]
    cfg.pop("dtype", None)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def source_digest(source: Path) -> str:
    """sha256 over the source tensors (names, dtypes, bytes): which source a fixture came from."""
    digest = hashlib.sha256()
    tensors = load_file(source / "model.safetensors")
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def read_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def dense_model(ckpt: Path, dequant: dict[str, torch.Tensor]) -> torch.nn.Module:
    """fp32 HF Llama from the checkpoint's config (quantization_config dropped): quantized linears
    take the tool's dequantized weights, everything else comes from the checkpoint itself (AWQ folds
    its smoothing into the norms, so the source model's norms would be wrong)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    config = LlamaConfig.from_dict(cfg)
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config).float().eval()
    stored = read_checkpoint(ckpt)
    state: dict[str, torch.Tensor] = {}
    for name in model.state_dict():
        source = dequant.get(name, stored.get(name))
        if source is None:
            raise KeyError(f"{ckpt.name}: no tensor for {name} in the checkpoint or the tool's dequantization")
        state[name] = source.float()
    model.load_state_dict(state, strict=True)
    quantized = {n.removesuffix(".weight") for n in dequant}
    # KV-cache scales: this model has no KV-cache quantization (a fixture with them takes the
    # tool's own forward, which applies them, as its reference_forward).
    unused = [n for n in stored if n not in state and n.rsplit(".", 1)[0] not in quantized
              and not n.endswith(KV_CACHE_SCALES)]  # fmt: skip
    if unused:
        raise ValueError(f"{ckpt.name}: checkpoint tensors not used by the reference model: {unused}")
    return model


def hf_forward(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits.float()

    return forward


def greedy(forward: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """32 argmax tokens per row (EOS not special), recomputing the whole prefix each step, and the
    top-1 margin (logit gap to the runner-up) of each choice: random models have near-ties, so a
    test compares a continuation only as far as its margins exceed its own logit error."""
    seq = ids
    margins = []
    for _ in range(N_GREEDY):
        last = forward(seq)[:, -1]
        top2 = last.topk(2, dim=-1).values
        margins.append(top2[:, 0] - top2[:, 1])
        seq = torch.cat([seq, last.argmax(dim=-1, keepdim=True)], dim=1)
    return seq[:, ids.shape[1]:].contiguous(), torch.stack(margins, dim=1).float()


@dataclass
class ToolReference:
    """What a tool module learned from the tool after quantizing one fixture."""

    tool: str  # e.g. "gptqmodel 7.6.0"
    recipe: dict  # the exact arguments/recipe passed to the tool
    dequant: dict[str, torch.Tensor]  # HF weight name -> tool-dequantized [out, in] fp32, every quantized linear
    tool_forward: Callable[[torch.Tensor], torch.Tensor] | None  # the tool's own quantized forward
    tool_logits_note: str  # its dtype and backend, or why there is none
    logits_tol: float  # allowed max |dequant_logits - tool_logits|
    # Set where the tool's forward quantizes activations (FP8): then dequant_logits and greedy come
    # from the tool's forward run in fp32 instead of the dense dequantized model.
    reference_forward: Callable[[torch.Tensor], torch.Tensor] | None = None
    smoothed: bool = False  # AWQ: weights carry the smoothing scales, so are not near the source's
    # The sanity bound on the dequantized weights' distance to the source (a wrong permutation or
    # packing lands near sqrt(2) on random weights).
    max_rel_weight_error: float = MAX_REL_WEIGHT_ERROR
    notes: list[str] = field(default_factory=list)


def _max_rel_weight_error(dequant: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> float:
    return max(float((w - source[n].float()).norm() / source[n].float().norm()) for n, w in dequant.items())


def finish_fixture(name: str, ckpt: Path, source: Path, ref: ToolReference) -> dict:
    """Tidy the tool's output directory (its log out, the common tokenizer in) and write its
    reference file; returns the figures the sanity checks measured (raising if one fails)."""
    for f in DROPPED_FILES:
        (ckpt / f).unlink(missing_ok=True)
    for f in TOKENIZER_FILES:  # one tokenizer for all fixtures, whatever each tool saved
        if (source / f).exists():
            shutil.copy2(source / f, ckpt / f)

    import transformers

    ids = prompt_ids()
    dense = hf_forward(dense_model(ckpt, ref.dequant))
    forward = ref.reference_forward or dense
    dequant_logits = forward(ids)
    greedy_ids, greedy_margin = greedy(forward, ids)

    source_tensors = load_file(source / "model.safetensors")
    source_logits = hf_forward(dense_model(source, {}))(ids)
    checks = {
        "top1_agreement_vs_source": float((dequant_logits.argmax(-1) == source_logits.argmax(-1)).float().mean()),
        "max_abs_dequant_vs_source_logits": float((dequant_logits - source_logits).abs().max()),
        "min_greedy_top1_margin": float(greedy_margin.min()),
    }
    if not ref.smoothed:
        checks["max_rel_weight_error_vs_source"] = _max_rel_weight_error(ref.dequant, source_tensors)
        if checks["max_rel_weight_error_vs_source"] > ref.max_rel_weight_error:
            raise AssertionError(f"{name}: dequantized weights far from the source: {checks}")
    if ref.reference_forward is not None:
        checks["max_abs_tool_fp32_vs_weight_only_logits"] = float((dequant_logits - dense(ids)).abs().max())

    tensors = {"input_ids": ids, "dequant_logits": dequant_logits, "greedy": greedy_ids,
               "greedy_margin": greedy_margin}
    if ref.tool_forward is not None:
        tool_logits = ref.tool_forward(ids).float()
        diff = float((dequant_logits - tool_logits).abs().max())
        checks["max_abs_dequant_vs_tool_logits"] = diff
        checks["mean_abs_dequant_vs_tool_logits"] = float((dequant_logits - tool_logits).abs().mean())
        checks["top1_agreement_dequant_vs_tool"] = float(
            (dequant_logits.argmax(-1) == tool_logits.argmax(-1)).float().mean()
        )
        if not diff <= ref.logits_tol:
            raise AssertionError(f"{name}: tool and dequantized logits differ by {diff} > {ref.logits_tol}")
        tensors["tool_logits"] = tool_logits
    for w in LAYER0_LINEARS:
        tensors[f"dequant.{w}"] = ref.dequant[w].float().contiguous()

    metadata = {
        "fixture": name,
        "tool": ref.tool,
        "recipe": json.dumps(ref.recipe, sort_keys=True),
        "dequant_logits": (
            "the tool's own forward in float32 (it quantizes activations, so dense weights alone are not the model)"
            if ref.reference_forward is not None
            else "float32 transformers Llama: checkpoint's non-quantized tensors + the tool's dequantized weights"
        ),
        "tool_logits": ref.tool_logits_note,
        "greedy": f"{N_GREEDY} argmax tokens from the dequant_logits model, EOS ignored; greedy_margin: "
        "each choice's logit gap to the runner-up",
        "dequant_weights": "float32 [out, in], the tool's own dequantization, natural input order",
        "checks": json.dumps(checks, sort_keys=True),
        "notes": " ".join(ref.notes),
        "source_sha256": source_digest(source),
        "generated_by": "scripts/make_quant_fixtures.py",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }
    references = ckpt.parent.parent / "references"
    references.mkdir(exist_ok=True)
    _save_reproducibly(tensors, references / f"{name}.safetensors", metadata)
    return checks


def _save_reproducibly(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors writes its metadata in hash order, so a regenerated file would differ byte for
    byte from the committed one; rewrite the header with sorted metadata (same length, the format
    allows space padding)."""
    blob = save(tensors, metadata=metadata)
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > n:
        raise ValueError("safetensors header grew when re-serialized")
    path.write_bytes(blob[:8] + text.ljust(n) + blob[8 + n :])


def run_tool(fixtures: dict[str, Callable[[Path, Path], ToolReference]]) -> None:
    """Command line of a tool module: `python -m quant_fixtures.<tool> --source DIR --out-root DIR
    [NAME ...]`. Each fixture is written to a fresh directory; one JSON summary line per fixture."""
    import argparse
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--source", type=Path, required=True, help="the fp32 tiny model (build_source)")
    ap.add_argument("--out-root", type=Path, required=True, help="one subdirectory per fixture goes here")
    ap.add_argument("names", nargs="*", help="fixtures to make (default: all of this tool's)")
    args = ap.parse_args()
    for name in args.names or list(fixtures):
        out = args.out_root / name
        shutil.rmtree(out, ignore_errors=True)
        start = time.monotonic()
        ref = fixtures[name](args.source, out)
        quantize_s = time.monotonic() - start
        checks = finish_fixture(name, out, args.source, ref)
        size = sum(f.stat().st_size for f in out.iterdir())
        summary = {"fixture": name, "seconds": round(time.monotonic() - start, 1),
                   "quantize_and_load_seconds": round(quantize_s, 1), "bytes": size, **checks}
        print("FIXTURE " + json.dumps(summary), flush=True)

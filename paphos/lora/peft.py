"""PEFT LoRA adapters on disk -> validated, scale-folded A/B matrices.

Data flow:

    --lora-modules / POST /v1/load_lora_adapter (API process)
      -> registry.py -> validate_adapter: resolve the path (a directory, or a Hugging Face repo id
         fetched into the HF cache), check adapter_config.json and every tensor's name and shape
         against the model's LoRAModelSpec; nothing is loaded; the local directory goes into the
         LoRARequest
    engine core, first request naming the adapter
      -> host_cache.py -> load_adapter: the same checks, then the tensors, with PEFT's scale folded
         into B -> LoRAAdapter.weights, keyed (layer, PEFT module name) -> layers.py

The format is PEFT's (`save_pretrained`): adapter_config.json next to adapter_model.safetensors
(or adapter_model.bin), tensors named `base_model.model.<module path>.lora_A.weight`. What PEFT
would compute is the contract: the scale (alpha / r, or alpha / sqrt(r) with rsLoRA), per-module
ranks and alphas from rank_pattern / alpha_pattern matched as PEFT 0.21 matches them, and which
modules the config selects. Anything that would make the served model differ from PEFT's
merged one (DoRA, biases, embeddings, replaced modules, other LoRA variants) is refused with a
LoRAError naming the file and the field or tensor at fault.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from paphos.config import LORA_RANKS
from paphos.lora.errors import LoRAError, LoRANotFoundError
from paphos.lora.spec import LORA_TARGETS, SUPPORTED_MODULES, LoRAModelSpec

if TYPE_CHECKING:
    from paphos.layers.parallel import Slice
    from paphos.loader.hub import RepoRef

_T = TypeVar("_T")
# Builds the LoRAError of one adapter_config.json field: (field, why) -> error.
_Refuse = Callable[[str, str], LoRAError]

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"

# The block of a decoder layer that holds each module, as the HF module path names it.
_BLOCK: Mapping[str, str] = {
    **{m: "self_attn" for m in (*LORA_TARGETS["qkv_proj"], *LORA_TARGETS["o_proj"])},
    **{m: "mlp" for m in (*LORA_TARGETS["gate_up_proj"], *LORA_TARGETS["down_proj"])},
}
# A LoRA matrix of a decoder layer's projection. `key` is the module's path in the base model, the
# name PEFT matches rank_pattern / alpha_pattern / target_modules against. The prefix admits the
# text model's paths only (`model.`, Gemma 3's `model.language_model.` or the older
# `language_model.model.`), so a vision tower's `...encoder.layers.N.self_attn...` is refused.
# `.default` (the adapter name) is stripped by save_pretrained, but some exporters keep it.
_LORA_TENSOR = re.compile(
    r"(?:base_model\.model\.)?"
    r"(?P<key>(?:model\.|language_model\.)*layers\.(?P<layer>\d+)\.(?P<block>\w+)\.(?P<module>\w+))"
    r"\.lora_(?P<part>[AB])(?:\.default)?\.weight"
)
# Tensors of features planned for later: named apart so the error says "not supported yet".
_NOT_YET = re.compile(r"lora_embedding_|embed_tokens|lm_head")
_NOT_YET_MODULES = ("embed_tokens", "lm_head")
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}  # safetensors' names
# PEFT's LoRA variants (its `is_lora_variant` config fields): each computes something other than
# x @ A.T @ B.T * scale or saves state of its own (VeLoRA). MiCA (init_lora_weights "mica") only
# trains differently, so it is plain LoRA here.
_VARIANTS = (
    "use_dora", "alora_invocation_tokens", "use_qalora", "velora_config", "monteclora_config",
    "use_bdlora", "arrow_config", "kasa_config",
)  # fmt: skip
# init_lora_weights values that change the base weights too (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ):
# such an adapter is only right on top of the base model PEFT modified, unless it was converted
# when saved (save_pretrained(path_initial_model_for_weight_conversion=...) writes True instead).
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "lora_ga", "loftq")
# PEFT's shorthand for every linear layer but the output embedding: our seven projections.
_ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdapterConfig:
    """adapter_config.json, as far as it decides what the adapter computes."""

    rank: int
    alpha: float
    use_rslora: bool
    # Module names or paths, each matched at the end of a module's path (PEFT's list form);
    # empty when `target_regex` is given instead.
    target_modules: tuple[str, ...]
    base_model_name_or_path: str | None
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    layers_to_transform: tuple[int, ...] | None
    # target_modules given as one string: a regex that must match a module's whole path.
    target_regex: str | None = None


@dataclass
class LoRAAdapter:
    path: str
    rank: int  # the largest rank of any module in it
    # (layer index, PEFT module name e.g. "q_proj") -> (A [r, in], B [out, r] with the PEFT scale
    # already multiplied in), CPU tensors in the load dtype, contiguous.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)

    def rank_part(self, slices: Mapping[str, tuple[Slice, Slice]]) -> LoRAAdapter:
        """What a tensor-parallel rank holds: per PEFT module, (B's output rows, A's input
        columns) of `slices`, as the base layer splits its weight. A column-parallel projection
        keeps A whole and its rows of B; a row-parallel one its columns of A and B whole, so
        B (A_r x_r) summed by the layer's all-reduce is B A x: no collective of its own."""
        weights = {}
        for (layer, module), (a, b) in self.weights.items():
            rows, cols = slices[module]
            weights[(layer, module)] = (cols.narrow(a, 1).contiguous(), rows.narrow(b, 0).contiguous())
        return LoRAAdapter(self.path, self.rank, weights)


def resolve_adapter_path(path: str) -> str:
    """The local directory of the adapter at `path`: `path` itself when it exists (as an absolute
    path, for the engine core process), else the Hugging Face repo `org/name` fetched into (or
    found in) the HF cache, adapter files only. HF_HUB_OFFLINE=1 looks in the cache alone."""
    local = Path(path).expanduser()
    if local.exists():
        folder = local.resolve()
    else:
        from paphos.loader.hub import parse_repo_ref

        ref = parse_repo_ref(path)
        if ref is None or ref.tag is not None or ref.filename is not None:
            raise LoRANotFoundError(
                f"no LoRA adapter at {path!r}: no such directory, and not a Hugging Face repo id"
            )
        folder = _download(path, ref)
    if not folder.is_dir():
        raise LoRANotFoundError(
            f"no LoRA adapter at {path!r}: not a directory (pass the directory holding {CONFIG_FILE})"
        )
    if not (folder / CONFIG_FILE).is_file():
        raise LoRANotFoundError(f"no LoRA adapter at {path!r}: {folder} has no {CONFIG_FILE}")
    _weights_file(folder)
    return str(folder)


def read_adapter_config(path: str) -> AdapterConfig:
    """Parses and checks `<path>/adapter_config.json`; `path` is a local directory."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise LoRANotFoundError(f"no LoRA adapter at {path!r}: no {CONFIG_FILE} there")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoRAError(f"{file}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise LoRAError(f"{file}: not a JSON object")

    def refuse(field: str, why: str) -> LoRAError:
        return LoRAError(f"{file}: {field} = {json.dumps(raw.get(field))}: {why}")

    if raw.get("peft_type") != "LORA":
        raise refuse("peft_type", "only LoRA adapters (peft_type LORA) are supported")
    for variant in _VARIANTS:
        if raw.get(variant):
            raise refuse(variant, "this LoRA variant is not supported; only plain LoRA (and rsLoRA) is")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise refuse(
            "init_lora_weights",
            "the adapter is only valid on the base weights PEFT modified for it; save it "
            "with save_pretrained(path_initial_model_for_weight_conversion=...) to get a plain LoRA adapter",
        )
    if raw.get("bias", "none") != "none":
        raise refuse("bias", 'trained biases are not supported; only bias "none" is')
    if raw.get("lora_bias"):
        raise refuse("lora_bias", "a bias on lora_B is not supported")
    if raw.get("modules_to_save"):
        raise refuse("modules_to_save", "fully trained modules next to the LoRA weights are not supported")
    if raw.get("trainable_token_indices"):
        raise refuse("trainable_token_indices", "trained token embeddings are not supported yet")
    if raw.get("layer_replication"):
        raise refuse("layer_replication", "a model with replicated layers is not supported")
    if raw.get("target_parameters"):
        raise refuse("target_parameters", "LoRA on parameters (rather than modules) is not supported")

    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)  # PEFT's defaults
    if not _is_positive_int(rank):
        raise refuse("r", "must be a positive integer")
    if not _is_number(alpha):
        raise refuse("lora_alpha", "must be a number")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise refuse("use_rslora", "must be true or false")
    base = raw.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        raise refuse("base_model_name_or_path", "must be a string")
    rank_pattern = _patterns(raw, "rank_pattern", _is_positive_int, refuse)
    alpha_pattern = _patterns(raw, "alpha_pattern", _is_number, refuse)
    targets, regex = _targets(raw, refuse)

    layers = raw.get("layers_to_transform")
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if layers is not None and (
        not isinstance(layers, list)
        or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers)
    ):
        raise refuse("layers_to_transform", "must be a layer index or a list of them")
    return AdapterConfig(
        rank=rank, alpha=float(alpha), use_rslora=use_rslora, target_modules=targets, base_model_name_or_path=base,
        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
        # PEFT treats an empty list as "every layer".
        layers_to_transform=tuple(layers) if layers else None, target_regex=regex,
    )  # fmt: skip


def validate_adapter(path: str, spec: LoRAModelSpec, max_rank: int) -> str:
    """Every check load_adapter makes (config, each tensor's name and shape, ranks), without loading
    the tensors; the resolved local directory."""
    folder = resolve_adapter_path(path)
    _plan(Path(folder), spec, max_rank)
    return folder


def load_adapter(path: str, spec: LoRAModelSpec, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    folder = resolve_adapter_path(path)
    file, modules = _plan(Path(folder), spec, max_rank)
    tensors = _read_tensors(file, [name for m in modules.values() for name in (m.a, m.b)])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for where, m in modules.items():
        # copy=True: a .bin file's tensors are views of its memory map, which must not outlive this.
        a = tensors[m.a].to(dtype=dtype, copy=True).contiguous()
        # The scale goes into B in float32, so a half-precision B is rounded once, not twice.
        b = (tensors[m.b].to(torch.float32) * m.scale).to(dtype).contiguous()
        weights[where] = (a, b)
    return LoRAAdapter(path=folder, rank=max(m.rank for m in modules.values()), weights=weights)


@dataclass(frozen=True)
class _Module:
    a: str  # tensor names
    b: str
    rank: int
    scale: float


def _plan(folder: Path, spec: LoRAModelSpec, max_rank: int) -> tuple[Path, dict[tuple[int, str], _Module]]:
    """Checks the adapter against the model from its config and the tensors' names and shapes
    alone; the weights file and, per (layer, module), which tensors to load and the scale."""
    config = read_adapter_config(str(folder))
    file = _weights_file(folder)
    # (layer, module) -> part ("A" / "B") -> (tensor name, shape, module path)
    found: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...], str]]] = {}
    for name, (shape, floating) in sorted(_tensor_infos(file).items()):
        match = _LORA_TENSOR.fullmatch(name)
        if match is None:
            what = "not a LoRA matrix of a decoder layer's projection"
            if _NOT_YET.search(name):
                what = "not supported yet"
            raise LoRAError(
                f"{file}: tensor {name}: {what} (Paphos applies LoRA to {', '.join(SUPPORTED_MODULES)})"
            )
        layer, module, key = int(match["layer"]), match["module"], match["key"]
        if _BLOCK.get(module) != match["block"] or module not in spec.shapes:
            raise LoRAError(
                f"{file}: tensor {name}: LoRA on {match['block']}.{module} is not supported (Paphos applies "
                f"LoRA to {', '.join(SUPPORTED_MODULES)})"
            )
        if layer >= spec.num_layers:
            raise LoRAError(
                f"{file}: tensor {name}: layer {layer}, but the model has {spec.num_layers} layers"
            )
        if not floating:
            raise LoRAError(f"{file}: tensor {name}: not a floating-point tensor")
        if not _selects(config, key, layer):
            raise LoRAError(
                f"{file}: tensor {name}: {folder / CONFIG_FILE} does not select {key} (target_modules / "
                "layers_to_transform), so PEFT would not apply it either"
            )
        parts = found.setdefault((layer, module), {})
        if match["part"] in parts:
            raise LoRAError(
                f"{file}: tensor {name}: lora_{match['part']} of {key} is there twice ({parts[match['part']][0]})"
            )
        parts[match["part"]] = (name, shape, key)
    if not found:
        raise LoRAError(f"{file}: holds no LoRA weights")

    modules: dict[tuple[int, str], _Module] = {}
    for (layer, module), parts in sorted(found.items()):
        for part, other in (("A", "B"), ("B", "A")):
            if other not in parts:
                raise LoRAError(f"{file}: tensor {parts[part][0]} has no lora_{other} partner")
        (a, a_shape, key), (b, b_shape, _) = parts["A"], parts["B"]
        in_features, out_features = spec.shapes[module]
        if len(a_shape) != 2 or a_shape[1] != in_features:
            raise LoRAError(
                f"{file}: tensor {a} has shape {list(a_shape)}; {module} of this model needs [r, {in_features}]"
            )
        rank = a_shape[0]
        if b_shape != (out_features, rank):
            raise LoRAError(
                f"{file}: tensor {b} has shape {list(b_shape)}; {module} of this model with rank {rank} (from "
                f"lora_A) needs [{out_features}, {rank}]"
            )
        configured = _pattern_value(config.rank_pattern, key, config.rank)
        if rank != configured:
            raise LoRAError(
                f"{file}: tensor {a} has rank {rank}, but {folder / CONFIG_FILE} gives {key} rank {configured} "
                "(r / rank_pattern)"
            )
        if rank > max_rank:
            fits = [r for r in LORA_RANKS if r >= rank]
            fix = f"the largest is {LORA_RANKS[-1]}"
            if fits:
                fix = f"start the server with --max-lora-rank {fits[0]}"
            raise LoRAError(f"{file}: {key} has rank {rank}, over --max-lora-rank {max_rank}; {fix}")
        alpha = _pattern_value(config.alpha_pattern, key, config.alpha)
        scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
        modules[(layer, module)] = _Module(a=a, b=b, rank=rank, scale=scale)
    return file, modules


def _selects(config: AdapterConfig, key: str, layer: int) -> bool:
    """Whether PEFT would put LoRA on the module at path `key` (its check_target_module_exists):
    a regex must match the whole path; a list entry must be the path or its dotted tail, and then
    layers_to_transform (if given) must hold the layer."""
    if config.target_regex is not None:
        return re.fullmatch(config.target_regex, key) is not None
    if key in config.target_modules:
        return True  # an exact path is taken as is, whatever layers_to_transform says
    if not any(key.endswith(f".{target}") for target in config.target_modules):
        return False
    # PEFT reads the layer index from the path's first numbered component, which is ours.
    return config.layers_to_transform is None or layer in config.layers_to_transform


def _pattern_value(patterns: Mapping[str, _T], key: str, default: _T) -> _T:
    """rank_pattern / alpha_pattern as PEFT 0.21 reads them: the first pattern, in the file's order,
    that matches the end of the module path at a dot boundary (or the whole path)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _targets(raw: dict[str, Any], refuse: _Refuse) -> tuple[tuple[str, ...], str | None]:
    """target_modules as (list entries, regex): checked to name only modules Paphos supports."""
    targets = raw.get("target_modules")
    if targets is None:
        # PEFT would fill in its per-architecture default when the adapter was made; a saved config
        # always names them, so a missing list is a hand-written config we cannot interpret.
        raise refuse("target_modules", "not set; name the modules the adapter applies to")
    if isinstance(targets, str):
        if targets.lower() == _ALL_LINEAR:
            return SUPPORTED_MODULES, None
        try:
            re.compile(targets)
        except re.error as e:
            raise refuse("target_modules", f"not a valid regular expression ({e})") from None
        return (), targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise refuse("target_modules", "must be a list of module names or a regular expression")
    for target in targets:
        name = target.rsplit(".", 1)[-1]
        if name in _NOT_YET_MODULES:
            raise refuse("target_modules", f"LoRA on {name} is not supported yet")
        if name not in SUPPORTED_MODULES:
            raise refuse(
                "target_modules",
                f"LoRA on {target} is not supported (only on {', '.join(SUPPORTED_MODULES)})",
            )
    return tuple(targets), None


def _patterns(
    raw: dict[str, Any], field: str, valid: Callable[[Any], bool], refuse: _Refuse
) -> Mapping[str, Any]:
    """rank_pattern / alpha_pattern: module-path regex -> value, each pattern compiled as PEFT uses it."""
    value = raw.get(field) or {}
    if not isinstance(value, dict):
        raise refuse(field, "must be an object mapping module names or patterns to values")
    for pattern, item in value.items():
        try:
            re.compile(rf"(.*\.)?({pattern})$")
        except re.error as e:
            raise refuse(field, f"{pattern!r} is not a valid regular expression ({e})") from None
        if not valid(item):
            raise refuse(field, f"the value of {pattern!r} is invalid")
    return MappingProxyType(dict(value))


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _weights_file(folder: Path) -> Path:
    for name in (SAFETENSORS_FILE, BIN_FILE):
        if (folder / name).is_file():
            return folder / name
    raise LoRANotFoundError(
        f"no LoRA adapter at {str(folder)!r}: neither {SAFETENSORS_FILE} nor {BIN_FILE} there"
    )


def _tensor_infos(file: Path) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Tensor name -> (shape, is floating point), read without loading the data (safetensors: the
    header; .bin: a memory map)."""
    try:
        if file.name == BIN_FILE:
            return {name: (tuple(t.shape), t.is_floating_point()) for name, t in _load_bin(file).items()}
        from safetensors import safe_open

        infos: dict[str, tuple[tuple[int, ...], bool]] = {}
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                infos[name] = (tuple(tensor.get_shape()), tensor.get_dtype() in _FLOAT_DTYPES)
        return infos
    except LoRAError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the reader's complaint, name the file
        raise LoRAError(f"{file}: cannot read the tensors ({type(e).__name__}: {e})") from None


def _read_tensors(file: Path, names: list[str]) -> dict[str, torch.Tensor]:
    try:
        if file.name == BIN_FILE:
            state = _load_bin(file)
            return {name: state[name] for name in names}
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {name: f.get_tensor(name) for name in names}
    except LoRAError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. the file changed since it was validated
        raise LoRAError(f"{file}: cannot read the tensors ({type(e).__name__}: {e})") from None


def _load_bin(file: Path) -> dict[str, torch.Tensor]:
    # weights_only: a pickle from the internet must not run code; mmap: shapes without reading it all.
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise LoRAError(f"{file}: not a state dict of tensors")
    return state


def _download(text: str, ref: RepoRef) -> Path:
    """The snapshot directory of an adapter repo: adapter_config.json and one weights file,
    safetensors preferred, through loader/hub.py (cache location, offline mode, Hub errors)."""
    from paphos.loader.hub import HubError, _Repo

    repo = _Repo(text, ref, None, None, "revision")
    try:
        files = repo.list_files()
        weights = next((f for f in (SAFETENSORS_FILE, BIN_FILE) if f in files), None)
        if CONFIG_FILE not in files or weights is None:
            raise LoRANotFoundError(
                f"{ref.repo_id} is not a PEFT LoRA adapter: the repo needs {CONFIG_FILE} and {SAFETENSORS_FILE} "
                f"(or {BIN_FILE})"
            )
        return repo.download([CONFIG_FILE, weights])
    except HubError as e:
        raise LoRANotFoundError(f"no LoRA adapter at {text!r}: {e}") from None

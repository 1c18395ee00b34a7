"""paphos/lora/peft.py against PEFT itself: every adapter PEFT makes loads to A, B with
B @ A == PEFT's merged weight - the base weight, and every adapter Paphos cannot serve as PEFT
would is refused with a message naming the file and the field or tensor at fault."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from paphos.lora.errors import LoRAError, LoRANotFoundError
from paphos.lora.peft import (
    BIN_FILE,
    CONFIG_FILE,
    SAFETENSORS_FILE,
    load_adapter,
    read_adapter_config,
    resolve_adapter_path,
    validate_adapter,
)
from tests.lora.peft_fixtures import Adapter, TinyLlama, make_adapter

MAX_RANK = 16
PREFIX = "base_model.model.model.layers"


def _block(module: str) -> str:
    return "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"


def _assert_parity(tiny_llama: TinyLlama, adapter: Adapter, expected_modules: set[tuple[int, str]]) -> None:
    loaded = load_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK, torch.float32)
    assert set(loaded.weights) == expected_modules
    base, merged = tiny_llama.model.state_dict(), adapter.merged.state_dict()
    for layer in range(tiny_llama.spec.num_layers):
        for module in tiny_llama.spec.shapes:
            name = f"model.layers.{layer}.{_block(module)}.{module}.weight"
            delta = merged[name] - base[name]
            if (layer, module) not in loaded.weights:
                assert torch.equal(delta, torch.zeros_like(delta)), name
                continue
            a, b = loaded.weights[(layer, module)]
            in_features, out_features = tiny_llama.spec.shapes[module]
            assert a.shape[1] == in_features and b.shape[0] == out_features and a.shape[0] == b.shape[1]
            assert a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
            assert delta.abs().max() > 1e-3, name  # B is random, so the adapter really changes the weight
            torch.testing.assert_close(b @ a, delta, atol=1e-6, rtol=0)
    assert loaded.rank == max(a.shape[0] for a, _ in loaded.weights.values())
    assert loaded.num_bytes() == sum(4 * (a.numel() + b.numel()) for a, b in loaded.weights.values())


def _every(layers: range | list[int], modules: tuple[str, ...]) -> set[tuple[int, str]]:
    return {(layer, module) for layer in layers for module in modules}


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(
    ("options", "layers", "modules"),
    [
        pytest.param({}, range(2), ALL, id="plain"),
        pytest.param({"use_rslora": True, "rank": 16, "alpha": 8}, range(2), ALL, id="rslora"),
        pytest.param(
            {"rank_pattern": {"q_proj": 4, "^model.layers.1.mlp.down_proj": 2, "layers.0.self_attn.v_proj": 16},
             # PEFT matches a pattern at the end of the path, on a dot boundary: the first two match nothing.
             "alpha_pattern": {"proj": 100, "layers.0": 7, "k_proj": 3.5, r"model\.layers\.1\..*_proj": 64}},
            range(2), ALL, id="patterns",
        ),
        pytest.param({"rank_pattern": {"q_proj": 4}, "alpha_pattern": {"v_proj": 5}, "use_rslora": True},
                     range(2), ALL, id="rslora-patterns"),
        pytest.param({"layers_to_transform": [1]}, [1], ALL, id="layers_to_transform"),
        pytest.param({"safetensors": False}, range(2), ALL, id="bin"),
        pytest.param({"target_modules": ("q_proj", "v_proj")}, range(2), ("q_proj", "v_proj"), id="subset"),
        pytest.param({"target_modules": ("self_attn.o_proj", "down_proj"), "rank": 4}, range(2),
                     ("o_proj", "down_proj"), id="dotted-targets"),
        pytest.param({"target_modules": r".*\.0\.self_attn\.(k|v)_proj"}, [0], ("k_proj", "v_proj"), id="regex"),
    ],
)  # fmt: skip
def test_parity_with_peft_merge(
    tiny_llama: TinyLlama, tmp_path: Path, options: dict, layers, modules
) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "adapter", **options)
    assert (adapter.path / (SAFETENSORS_FILE if options.get("safetensors", True) else BIN_FILE)).is_file()
    _assert_parity(tiny_llama, adapter, _every(layers, modules))


def test_scale_follows_peft(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    """The per-module scale, checked directly rather than through the merge."""
    adapter = make_adapter(
        tiny_llama, tmp_path / "a", rank=8, alpha=16, rank_pattern={"q_proj": 4}, alpha_pattern={"q_proj": 2}
    )
    raw = load_file(adapter.path / SAFETENSORS_FILE)
    loaded = load_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK, torch.float32)
    for module, scale in (("q_proj", 2 / 4), ("k_proj", 16 / 8)):
        b = raw[f"{PREFIX}.1.self_attn.{module}.lora_B.weight"]
        torch.testing.assert_close(loaded.weights[(1, module)][1], b * scale, atol=0, rtol=0)
    assert loaded.rank == 8


def test_half_precision_load(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a", alpha=24)
    raw = load_file(adapter.path / SAFETENSORS_FILE)
    loaded = load_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK, torch.bfloat16)
    a, b = loaded.weights[(0, "up_proj")]
    assert a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(a, raw[f"{PREFIX}.0.mlp.up_proj.lora_A.weight"].to(torch.bfloat16))
    assert torch.equal(b, (raw[f"{PREFIX}.0.mlp.up_proj.lora_B.weight"] * 3.0).to(torch.bfloat16))
    assert loaded.num_bytes() == sum(2 * (a.numel() + b.numel()) for a, b in loaded.weights.values())


def _rewrite(folder: Path, rename) -> None:
    """Rewrites the safetensors file with each tensor under rename(name) (None drops it)."""
    tensors = load_file(folder / SAFETENSORS_FILE)
    renamed = {rename(name): t for name, t in tensors.items()}
    save_file({name: t for name, t in renamed.items() if name is not None}, folder / SAFETENSORS_FILE)


@pytest.mark.parametrize(
    "rename",
    [
        pytest.param(lambda n: n.replace(".weight", ".default.weight"), id="default-adapter-name"),
        pytest.param(lambda n: n.replace("model.model.", "model.model.language_model."), id="gemma3-multimodal"),
        pytest.param(lambda n: n.replace("base_model.model.model.", "base_model.model.language_model.model."),
                     id="gemma3-multimodal-old"),
    ],
)  # fmt: skip
def test_tensor_name_variants(tiny_llama: TinyLlama, tmp_path: Path, rename) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    _rewrite(adapter.path, rename)
    _assert_parity(tiny_llama, adapter, _every(range(2), ALL))


def test_validate_returns_absolute_directory(tiny_llama: TinyLlama, tmp_path: Path, monkeypatch) -> None:
    make_adapter(tiny_llama, tmp_path / "a")
    monkeypatch.chdir(tmp_path)
    assert validate_adapter("a", tiny_llama.spec, MAX_RANK) == str(tmp_path / "a")
    config = read_adapter_config(str(tmp_path / "a"))
    assert (config.rank, config.alpha, config.use_rslora) == (8, 16.0, False)
    assert config.layers_to_transform is None and config.target_regex is None
    assert sorted(config.target_modules) == sorted(ALL)


def test_validate_reads_no_tensor_data(tiny_llama: TinyLlama, tmp_path: Path, monkeypatch) -> None:
    """Registration (API process) checks shapes from the safetensors header alone."""
    import safetensors

    adapter = make_adapter(tiny_llama, tmp_path / "a")

    class NoData:
        def __init__(self, handle) -> None:
            self.handle = handle

        def __enter__(self):
            self.file = self.handle.__enter__()
            return self

        def __exit__(self, *exc) -> None:
            self.handle.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return self.file.get_slice(name)

    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: NoData(real(*a, **k)))
    validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)
    with pytest.raises(LoRAError, match="no attribute .get_tensor."):
        load_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK, torch.float32)


# --- Not found -------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(LoRANotFoundError, match="no such directory"):
        resolve_adapter_path(str(tmp_path / "nowhere"))


def test_directory_without_adapter(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRANotFoundError, match=f"{re.escape(str(tmp_path / 'empty'))}.*adapter_config.json"):
        validate_adapter(str(tmp_path / "empty"), tiny_llama.spec, MAX_RANK)
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    (adapter.path / SAFETENSORS_FILE).unlink()
    with pytest.raises(LoRANotFoundError, match="neither adapter_model.safetensors nor adapter_model.bin"):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


def test_file_not_directory(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    with pytest.raises(LoRANotFoundError, match="not a directory"):
        validate_adapter(str(adapter.path / SAFETENSORS_FILE), tiny_llama.spec, MAX_RANK)


def _offline_cache(monkeypatch, tmp_path: Path) -> Path:
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_repo_id_not_in_cache_offline(tmp_path: Path, monkeypatch) -> None:
    _offline_cache(monkeypatch, tmp_path)
    with pytest.raises(LoRANotFoundError, match="some-org/no-adapter.*HF_HUB_OFFLINE"):
        resolve_adapter_path("some-org/no-adapter")


def test_repo_id_from_cache_offline(tiny_llama: TinyLlama, tmp_path: Path, monkeypatch) -> None:
    """A repo id resolves to its cached snapshot; the .bin next to the safetensors is not needed."""
    cache = _offline_cache(monkeypatch, tmp_path)
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--some-org--my-adapter"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(adapter.path, repo / "snapshots" / commit)
    local = validate_adapter("some-org/my-adapter", tiny_llama.spec, MAX_RANK)
    assert local == str(repo / "snapshots" / commit)
    loaded = load_adapter("some-org/my-adapter", tiny_llama.spec, MAX_RANK, torch.float32)
    assert loaded.path == local and len(loaded.weights) == 14


def test_repo_id_without_adapter_files(tmp_path: Path, monkeypatch) -> None:
    cache = _offline_cache(monkeypatch, tmp_path)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--some-org--a-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    with pytest.raises(LoRANotFoundError, match="some-org/a-model is not a PEFT LoRA adapter"):
        resolve_adapter_path("some-org/a-model")


# --- Refused configs -------------------------------------------------------------------------------


def _edit_config(folder: Path, **changes) -> None:
    file = folder / CONFIG_FILE
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"peft_type": "IA3"}, r"peft_type = \"IA3\": only LoRA adapters"),
        ({"use_dora": True}, "use_dora = true: this LoRA variant is not supported"),
        ({"alora_invocation_tokens": [5, 6]}, "alora_invocation_tokens = .*variant is not supported"),
        ({"init_lora_weights": "pissa_niter_4"}, "init_lora_weights = .*path_initial_model_for_weight_conversion"),
        ({"bias": "all"}, "bias = \"all\": trained biases are not supported"),
        ({"lora_bias": True}, "lora_bias = true"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save = .*not supported"),
        ({"trainable_token_indices": [3, 4]}, "trainable_token_indices = .*not supported yet"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules = .*LoRA on embed_tokens is not supported yet"),
        ({"target_modules": ["lm_head"]}, "target_modules = .*LoRA on lm_head is not supported yet"),
        ({"target_modules": ["q_proj", "fc1"]}, "target_modules = .*LoRA on fc1 is not supported"),
        ({"target_modules": None}, "target_modules = null: not set"),
        ({"target_modules": "(q_proj"}, "target_modules = .*not a valid regular expression"),
        ({"r": 0}, "r = 0: must be a positive integer"),
        ({"lora_alpha": "16"}, "lora_alpha = \"16\": must be a number"),
        ({"rank_pattern": {"q_proj": 2.5}}, "rank_pattern = .*the value of 'q_proj' is invalid"),
        ({"alpha_pattern": {"[": 2}}, "alpha_pattern = .*'\\[' is not a valid regular expression"),
        ({"layers_to_transform": ["1"]}, "layers_to_transform = .*must be a layer index"),
    ],
)  # fmt: skip
def test_refused_config(tiny_llama: TinyLlama, tmp_path: Path, changes: dict, message: str) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    _edit_config(adapter.path, **changes)
    with pytest.raises(LoRAError, match=f"{re.escape(str(adapter.path / CONFIG_FILE))}: {message}") as raised:
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)
    assert not isinstance(raised.value, LoRANotFoundError)


def test_unreadable_config(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    (adapter.path / CONFIG_FILE).write_text("{not json")
    with pytest.raises(
        LoRAError, match=f"{re.escape(str(adapter.path / CONFIG_FILE))}: not a readable JSON file"
    ):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


def test_rank_over_max(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a", rank=8, rank_pattern={"layers.1.mlp.up_proj": 24})
    with pytest.raises(LoRAError, match="model.layers.1.mlp.up_proj has rank 24, over --max-lora-rank 16; "
                       "start the server with --max-lora-rank 32"):  # fmt: skip
        validate_adapter(str(adapter.path), tiny_llama.spec, 16)
    assert load_adapter(str(adapter.path), tiny_llama.spec, 32, torch.float32).rank == 24


def test_rank_disagrees_with_config(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a", rank=8)
    _edit_config(adapter.path, rank_pattern={"o_proj": 4})
    with pytest.raises(LoRAError, match=r"o_proj.lora_A.weight has rank 8, but .* gives model.layers.0.self_attn.o_proj "
                       r"rank 4 \(r / rank_pattern\)"):  # fmt: skip
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"target_modules": ["q_proj"]}, "down_proj.lora_A.weight: .* does not select model.layers.0.mlp.down_proj"),
        ({"layers_to_transform": [1]}, "layers.0.mlp.down_proj.lora_A.weight: .* does not select"),
        ({"target_modules": r".*\.1\..*"}, "layers.0.mlp.down_proj.lora_A.weight: .* does not select"),
    ],
)  # fmt: skip
def test_tensor_not_selected_by_config(
    tiny_llama: TinyLlama, tmp_path: Path, changes: dict, message: str
) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    _edit_config(adapter.path, **changes)
    with pytest.raises(LoRAError, match=message):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


# --- Refused tensors -------------------------------------------------------------------------------


def _add_tensors(folder: Path, extra: dict[str, torch.Tensor]) -> None:
    tensors = load_file(folder / SAFETENSORS_FILE)
    save_file(tensors | extra, folder / SAFETENSORS_FILE)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 96)},
         "lora_embedding_A: not supported yet"),
        ({"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}, "lm_head.lora_A.weight: not supported yet"),
        ({f"{PREFIX}.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)},
         "q_proj.lora_B.bias: not a LoRA matrix of a decoder layer's projection"),
        ({"base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64)},
         "vision_tower.*: not a LoRA matrix"),
        ({f"{PREFIX}.0.self_attn.rotary.lora_A.weight": torch.zeros(8, 64)},
         "rotary.lora_A.weight: LoRA on self_attn.rotary is not supported"),
        ({f"{PREFIX}.0.mlp.q_proj.lora_A.weight": torch.zeros(8, 64)}, "LoRA on mlp.q_proj is not supported"),
        ({f"{PREFIX}.2.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
          f"{PREFIX}.2.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8)}, "layer 2, but the model has 2 layers"),
        ({f"{PREFIX}.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(8, 64)},
         "lora_A of model.layers.0.self_attn.q_proj is there twice"),
    ],
)  # fmt: skip
def test_refused_tensor(tiny_llama: TinyLlama, tmp_path: Path, extra: dict, message: str) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    _add_tensors(adapter.path, extra)
    with pytest.raises(
        LoRAError, match=f"{re.escape(str(adapter.path / SAFETENSORS_FILE))}: tensor .*{message}"
    ):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        (f"{PREFIX}.1.self_attn.k_proj.lora_A.weight", (8, 32), r"k_proj.lora_A.weight has shape \[8, 32\]; "
         r"k_proj of this model needs \[r, 64\]"),
        (f"{PREFIX}.1.self_attn.k_proj.lora_B.weight", (64, 8), r"k_proj.lora_B.weight has shape \[64, 8\]; "
         r"k_proj of this model with rank 8 \(from lora_A\) needs \[32, 8\]"),
        (f"{PREFIX}.0.mlp.down_proj.lora_B.weight", (64, 4), r"down_proj.lora_B.weight has shape \[64, 4\]"),
        (f"{PREFIX}.0.mlp.gate_proj.lora_A.weight", (8, 64, 1), r"gate_proj.lora_A.weight has shape \[8, 64, 1\]"),
    ],
)  # fmt: skip
def test_wrong_shape(tiny_llama: TinyLlama, tmp_path: Path, name: str, shape: tuple, message: str) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    _add_tensors(adapter.path, {name: torch.zeros(shape)})
    with pytest.raises(LoRAError, match=message):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


def test_missing_partner(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    _rewrite(adapter.path, lambda n: None if n == f"{PREFIX}.1.mlp.up_proj.lora_B.weight" else n)
    with pytest.raises(LoRAError, match=f"tensor {PREFIX}.1.mlp.up_proj.lora_A.weight has no lora_B partner"):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


def test_integer_tensor(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    name = f"{PREFIX}.1.mlp.up_proj.lora_B.weight"
    _add_tensors(adapter.path, {name: torch.zeros(128, 8, dtype=torch.int8)})
    with pytest.raises(LoRAError, match=f"tensor {name}: not a floating-point tensor"):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


def test_no_lora_tensors(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    _rewrite(adapter.path, lambda n: None)
    with pytest.raises(LoRAError, match="holds no LoRA weights"):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)


def test_corrupt_weights(tiny_llama: TinyLlama, tmp_path: Path) -> None:
    adapter = make_adapter(tiny_llama, tmp_path / "a")
    (adapter.path / SAFETENSORS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(
        LoRAError, match=f"{re.escape(str(adapter.path / SAFETENSORS_FILE))}: cannot read the tensors"
    ):
        validate_adapter(str(adapter.path), tiny_llama.spec, MAX_RANK)

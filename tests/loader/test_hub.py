"""Models by Hugging Face repo id (paphos/loader/hub.py), against a fake hub: a directory laid out
as huggingface_hub's cache (`models--org--name/{refs,snapshots,blobs}`) with HF_HUB_OFFLINE=1, and
for the online path a stubbed file listing and `snapshot_download`. Sockets are blocked
throughout: nothing here may reach the network."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import pytest

from paphos import cli
from paphos.config import ConfigError, ModelConfig
from paphos.loader import GGUFCheckpoint, load_model_source
from paphos.loader.hub import HubError, RepoRef, parse_repo_ref, resolve_model, resolve_tokenizer
from tests.quant.gguf_blocks import write_tiny_llama

VOCAB = 40


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a test of the hub resolution tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hugging Face cache, offline (cache only), with no token."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert huggingface_hub.constants.HF_HUB_OFFLINE
    return cache


def add_repo(cache: Path, repo_id: str, files: dict[str, Path | bytes], *, ref: str = "main") -> str:
    """Lay `files` (repo path -> a file to link to, or the bytes) out as huggingface_hub does:
    blobs/<hash> holds each file, snapshots/<commit>/<path> links to it, refs/<ref> names the
    commit. Returns the commit."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(f"{repo_id}@{ref}:{sorted(files)}".encode()).hexdigest()
    for name, content in files.items():
        blob = root / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, Path):
            blob.symlink_to(content.resolve())  # no copy of a 100 MB model
        else:
            blob.write_bytes(content)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return commit


def dir_files(path: Path) -> dict[str, Path | bytes]:
    return {p.relative_to(path).as_posix(): p for p in path.rglob("*") if p.is_file()}


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)


@pytest.fixture
def tiny_model_dir(tmp_path: Path, tiny_llama_config):
    """Factory: a directory with a tiny random llama (config, safetensors, tokenizer)."""

    def build(name: str, **overrides: object) -> Path:
        import torch
        from transformers import AutoModelForCausalLM

        config = tiny_llama_config(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, **overrides)
        torch.manual_seed(0)
        path = tmp_path / "src" / name
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        write_tokenizer(path)
        return path

    return build


# --- what counts as a repo reference ---


@pytest.mark.parametrize(
    ("text", "ref"),
    [
        ("org/name", RepoRef("org/name")),
        ("Org-1/name.v2_x", RepoRef("Org-1/name.v2_x")),
        ("org/name:Q4_K_M", RepoRef("org/name", tag="Q4_K_M")),
        ("org/name/model-Q4_0.gguf", RepoRef("org/name", filename="model-Q4_0.gguf")),
        ("org/name/Q8_0/m-00001-of-00002.gguf", RepoRef("org/name", filename="Q8_0/m-00001-of-00002.gguf")),
        ("m.gguf", None),
        ("pos", None),
        ("./org/name", None),
        ("../org/name", None),
        ("/models/fake", None),
        ("~/org/name", None),
        ("org/name/config.json", None),  # a path inside a repo must be a .gguf file
        ("org/name/../x.gguf", None),
        ("org--x/name", None),
        ("-org/name", None),
        ("C:/models/x", None),
        ("org/name:", None),
    ],
)
def test_parse_repo_ref(text: str, ref: RepoRef | None) -> None:
    assert parse_repo_ref(text) == ref


# --- offline, from the cache ---


def test_repo_id_resolves_to_the_cached_snapshot_and_loads(hub: Path, tiny_model_dir) -> None:
    from paphos import LLM, SamplingParams

    commit = add_repo(hub, "org/tiny", dir_files(tiny_model_dir("tiny")))
    config = ModelConfig(model="org/tiny")
    assert Path(config.model) == hub / "models--org--tiny" / "snapshots" / commit
    assert config.served_names == ("org/tiny",)  # clients see the id, not the cache path
    source = load_model_source(config.model)
    assert source.load_format == "safetensors" and source.hf_config.vocab_size == VOCAB

    llm = LLM("org/tiny", dtype="float32", max_model_len=64, block_size=4, enforce_eager=True)
    out = llm.generate(["w5 w6"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_revision_picks_another_snapshot(hub: Path, tiny_model_dir) -> None:
    main = add_repo(hub, "org/tiny", dir_files(tiny_model_dir("a", max_position_embeddings=128)))
    v2 = add_repo(hub, "org/tiny", dir_files(tiny_model_dir("b", max_position_embeddings=96)), ref="v2")
    assert Path(ModelConfig(model="org/tiny").model).name == main
    tagged = ModelConfig(model="org/tiny", revision="v2")
    assert Path(tagged.model).name == v2
    assert load_model_source(tagged.model).max_model_len == 96
    by_commit = ModelConfig(model="org/tiny", revision=main)  # a commit id needs no ref
    assert Path(by_commit.model).name == main
    engine, _ = cli.build_configs(cli.parse_args(["run", "org/tiny", "--revision", "v2"]))
    assert Path(engine.model.model).name == v2 and engine.model.served_names == ("org/tiny",)


def test_quant_tag_picks_the_gguf_file(hub: Path, tmp_path: Path, smol_path: Path) -> None:
    other = write_tiny_llama(tmp_path / "other.gguf", [{}])
    add_repo(hub, "org/smol-GGUF", {
        "SmolLM2-135M-Instruct-Q4_1.gguf": smol_path,
        "SmolLM2-135M-Instruct-Q4_1_L.gguf": other,  # Q4_1 must not pick this one
        "SmolLM2-135M-Instruct-Q8_0.gguf": other,
        "mmproj-Q4_1.gguf": other,  # a vision projector is never the model
        "README.md": b"# smol",
    })
    engine, _ = cli.build_configs(cli.parse_args(["run", "org/smol-GGUF:q4_1"]))  # tags ignore case
    path = Path(engine.model.model)
    assert path.name == "SmolLM2-135M-Instruct-Q4_1.gguf" and path.resolve() == smol_path.resolve()
    assert engine.model.served_names == ("org/smol-GGUF:q4_1",)
    source = load_model_source(path)
    assert source.load_format == "gguf" and source.tokenizer is not None

    explicit = ModelConfig(model="org/smol-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf")
    assert Path(explicit.model).name == "SmolLM2-135M-Instruct-Q8_0.gguf"
    with pytest.raises(HubError, match=r"several GGUF models.*org/smol-GGUF:TAG"):
        ModelConfig(model="org/smol-GGUF")
    with pytest.raises(HubError, match=r"no GGUF file tagged Q5_K_M.*SmolLM2-135M-Instruct-Q8_0.gguf"):
        ModelConfig(model="org/smol-GGUF:Q5_K_M")


def test_quant_tag_picks_every_file_of_a_split_model(hub: Path, tmp_path: Path) -> None:
    (tmp_path / "split").mkdir()
    write_tiny_llama(tmp_path / "split" / "tiny-Q4_K", [{"attn_q": "Q4_K"}, {}], split_max_tensors=7)
    files = {f"Q4_K/{p.name}": p for p in (tmp_path / "split").iterdir()}
    assert len(files) > 1
    add_repo(hub, "org/split-GGUF", {**files, "tiny-Q8_0.gguf": write_tiny_llama(tmp_path / "q8.gguf", [{}])})
    path = Path(ModelConfig(model="org/split-GGUF:Q4_K", load_format="dummy").model)
    assert path.name == "tiny-Q4_K-00001-of-00003.gguf"
    assert GGUFCheckpoint(path).hf_config.num_hidden_layers == 2  # its siblings are read too


def test_not_cached_offline_is_a_clear_startup_error(hub: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ModelConfig(model="org/missing")
    assert isinstance(info.value, HubError)
    assert cli.main(["run", "org/missing", "--revision", "v9"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for part in ("org/missing", "--revision v9", "HF_HUB_OFFLINE=1", "hf download org/missing --revision v9",
                 str(hub)):
        assert part in err, err


def test_local_directory_that_looks_like_a_repo_id_wins(
    hub: Path, tmp_path: Path, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_repo(hub, "org/tiny", dir_files(tiny_model_dir("cached")))
    (tmp_path / "work" / "org").mkdir(parents=True)
    tiny_model_dir("local").rename(tmp_path / "work" / "org" / "tiny")
    monkeypatch.chdir(tmp_path / "work")
    config = ModelConfig(model="org/tiny")
    assert config.model == "org/tiny" and config.served_names == ("org/tiny",)
    assert load_model_source(config.model).path == Path("org/tiny")


def test_tokenizer_by_repo_id(hub: Path, tmp_path: Path, tiny_model_dir) -> None:
    add_repo(hub, "org/tiny", dir_files(tiny_model_dir("tiny")))
    tok_dir = tmp_path / "tok"
    write_tokenizer(tok_dir)
    main = add_repo(hub, "org/tok", dir_files(tok_dir))
    v1 = add_repo(hub, "org/tok", dir_files(tok_dir), ref="v1")
    engine, _ = cli.build_configs(cli.parse_args(["run", "org/tiny", "--tokenizer", "org/tok"]))
    assert Path(engine.model.tokenizer) == hub / "models--org--tok" / "snapshots" / main
    source = load_model_source(engine.model.model, tokenizer=engine.model.tokenizer)
    assert source.tokenizer is not None and source.tokenizer.encode("w7", add_special_tokens=False) == [7]
    engine, _ = cli.build_configs(cli.parse_args(
        ["run", "org/tiny", "--tokenizer", "org/tok", "--tokenizer-revision", "v1"]))
    assert Path(engine.model.tokenizer).name == v1


def test_download_dir_is_the_cache(hub: Path, tmp_path: Path, tiny_model_dir) -> None:
    elsewhere = tmp_path / "models"
    commit = add_repo(elsewhere, "org/tiny", dir_files(tiny_model_dir("tiny")))
    with pytest.raises(HubError):
        ModelConfig(model="org/tiny")  # not in $HF_HUB_CACHE
    engine, _ = cli.build_configs(cli.parse_args(["run", "org/tiny", "--download-dir", str(elsewhere)]))
    assert Path(engine.model.model) == elsewhere / "models--org--tiny" / "snapshots" / commit


# --- online: the listing and the download stubbed, to see what is fetched ---

REPO_FILES = [
    ".gitattributes", "README.md", "config.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    "consolidated.safetensors", "pytorch_model.bin", "original/model.safetensors",
    "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-BF16.gguf", "mmproj-F16.gguf",
    "Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf",
]


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[set[str]]:
    """Online mode with a stub Hub serving REPO_FILES; returns the file sets each download asked for."""
    import fnmatch

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # not the user's own login
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo_id, revision=None: REPO_FILES)
    downloads: list[set[str]] = []
    snapshot = tmp_path / "snapshot"

    def snapshot_download(repo_id: str, *, allow_patterns: list[str], local_files_only: bool, **kwargs: object) -> str:
        assert not local_files_only
        wanted = {f for f in REPO_FILES if any(fnmatch.fnmatchcase(f, p) for p in allow_patterns)}
        downloads.append(wanted)
        for name in wanted:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
            (snapshot / name).write_text(json.dumps(index) if name.endswith("index.json") else "x")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return downloads


def test_online_downloads_only_what_is_loaded(online: list[set[str]], tmp_path: Path) -> None:
    meta = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "chat_template.jinja"}
    assert resolve_model("org/m") == str(tmp_path / "snapshot")
    assert online[-1] == meta | {"model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                 "model-00002-of-00002.safetensors"}
    assert resolve_model("org/m:q4_k_m").endswith("/m-Q4_K_M.gguf")
    assert online[-1] == {"m-Q4_K_M.gguf"}
    assert resolve_model("org/m:Q8_0").endswith("/Q8_0/m-Q8_0-00001-of-00002.gguf")
    assert online[-1] == {"Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf"}
    assert resolve_model("org/m/m-BF16.gguf").endswith("/m-BF16.gguf") and online[-1] == {"m-BF16.gguf"}
    with pytest.raises(HubError, match="no GGUF file tagged F16"):  # not BF16, not the mmproj
        resolve_model("org/m:F16")
    with pytest.raises(HubError, match="no GGUF file tagged Q4_K;"):  # neither Q4_K_M nor Q4_K_S
        resolve_model("org/m:Q4_K")
    resolve_model("org/m", load_format="dummy")
    assert online[-1] == meta
    resolve_tokenizer("org/m")
    assert online[-1] == meta - {"generation_config.json"}


def _http_error(cls: type[Exception], status: int) -> Exception:
    response = SimpleNamespace(headers={}, request=None, status_code=status)
    return cls("stub", response=response)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (_http_error(huggingface_hub.errors.GatedRepoError, 403), r"org/m \(--revision main\) is a gated model.*HF_TOKEN.*no token is set"),
        (_http_error(huggingface_hub.errors.RepositoryNotFoundError, 401), r"'org/m' is not a local path.*private.*HF_TOKEN"),
        (_http_error(huggingface_hub.errors.RevisionNotFoundError, 404), r"--revision main: no such branch"),
    ],
)
def test_hub_refusals_are_clear_errors(
    online: list[set[str]], monkeypatch: pytest.MonkeyPatch, error: Exception, expected: str
) -> None:
    def refuse(self: object, repo_id: str, revision: str | None = None) -> list[str]:
        raise error

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", refuse)
    with pytest.raises(HubError, match=expected):
        ModelConfig(model="org/m")


def test_unreachable_hub_falls_back_to_the_cache(
    hub: Path, tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    def unreachable(self: object, repo_id: str, revision: str | None = None) -> list[str]:
        raise ConnectionError("no route to huggingface.co")

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", unreachable)
    commit = add_repo(hub, "org/tiny", dir_files(tiny_model_dir("tiny")))
    assert Path(ModelConfig(model="org/tiny").model).name == commit
    with pytest.raises(HubError, match=r"org/other \(--revision main\) is not in the cache.*no route"):
        ModelConfig(model="org/other")

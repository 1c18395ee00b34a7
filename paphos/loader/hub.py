"""Hugging Face repo ids -> local paths: the one place Paphos talks to the Hugging Face Hub.

Data flow (start-up, in the process that parses the flags):

    --model / --tokenizer (or LLM(...) kwargs) -> ModelConfig.__post_init__
      -> resolve_model / resolve_tokenizer -> a local directory or .gguf path, written back into
         the config -> the engine core process and `load_model_source` see local paths only

so every download happens before the engine core is spawned, and a missing or forbidden repo is a
start-up error (`HubError`, a `ConfigError`: exit status 2 from the CLI), never a traceback.

Syntax (docs/models.md):

    org/name                   safetensors: config, tokenizer and weight files; a repo holding
                               only GGUF files of one model: that model
    org/name:Q4_K_M            the GGUF file (or the files of one split model) tagged Q4_K_M
    org/name/dir/file.gguf     exactly that GGUF file (a split model's first file pulls the rest)

A local path that exists always wins. Otherwise the repo's file list is read (from the Hub, or
from the cached snapshot when HF_HUB_OFFLINE=1 or the Hub cannot be reached), the files to load
are picked from it, and `snapshot_download` fetches exactly those into the Hugging Face cache
(`--download-dir` instead), with huggingface_hub's own progress bars. `--revision` /
`--tokenizer-revision` and HF_TOKEN go to huggingface_hub as they are.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from paphos.config import ConfigError
from paphos.loader.base import LoaderError

logger = logging.getLogger(__name__)

# One part of a repo id, by the Hub's rules: word characters, `.` and `-`, not at either end.
_PART = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_REPO_REF = re.compile(
    rf"(?P<repo>{_PART}/{_PART})(?::(?P<tag>[\w.+-]+)|/(?P<file>(?:{_PART}/)*[\w.+-]+\.gguf))?"
)
_SPLIT = re.compile(r"(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf")
INDEX_FILE = "model.safetensors.index.json"
# Top-level files the tokenizer and the config loaders read (transformers' AutoTokenizer also
# reads config.json to pick the tokenizer class).
_TOKENIZER_FILES = (
    "config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab*", "merges.txt",
    "*.tiktoken", "chat_template*",
)  # fmt: skip
_MODEL_FILES = (*_TOKENIZER_FILES, "generation_config.json")
_TRUE = {"1", "on", "yes", "true"}


class HubError(ConfigError, LoaderError):
    """A repo id cannot be resolved to local files; the message names the id, the revision and
    what to do. A ConfigError, so the CLI reports it as a start-up error (exit status 2)."""


@dataclass(frozen=True)
class RepoRef:
    """A parsed `org/name[:TAG]` or `org/name/path/file.gguf`."""

    repo_id: str
    tag: str | None = None  # GGUF quant tag, e.g. Q4_K_M
    filename: str | None = None  # a GGUF file inside the repo


def parse_repo_ref(text: str) -> RepoRef | None:
    """`text` as a repo reference, or None when it cannot be one (then it is only a path)."""
    match = _REPO_REF.fullmatch(text)
    if match is None or "--" in match["repo"] or ".." in match["repo"]:
        return None
    if match["file"] is not None and ".." in match["file"].split("/"):
        return None
    return RepoRef(match["repo"], match["tag"], match["file"])


def resolve_model(
    model: str, *, revision: str | None = None, download_dir: str | None = None, load_format: str = "auto"
) -> str:
    """The local path to load for `model`: `model` itself unless it is a repo reference that is not
    a local path; then the downloaded (or cached) snapshot directory or GGUF file."""
    ref = _hub_ref(model)
    if ref is None:
        return model
    repo = _Repo(model, ref, revision, download_dir, "--revision")
    files = repo.list_files()
    has_config = "config.json" in files
    weights = _safetensors_weights(files)
    wants_gguf = ref.tag is not None or ref.filename is not None or load_format == "gguf" or (
        not weights and bool(_gguf_models(files)) and not (load_format == "dummy" and has_config)
    )
    if wants_gguf:
        parts = _pick_gguf(repo, files)
        return str(repo.download(parts) / parts[0])
    if not has_config:
        raise HubError(f"{repo.label}: no config.json in the repo, so it is not a model Paphos can load")
    meta = _matching(files, _MODEL_FILES)
    if load_format == "dummy":
        return str(repo.download(meta))  # dummy weights need the config alone
    if not weights:
        raise HubError(
            f"{repo.label}: no *.safetensors or .gguf weights in the repo (PyTorch .bin checkpoints "
            "are not loaded)"
        )
    if weights == [INDEX_FILE]:
        # A sharded checkpoint: its index names the shards to fetch (and the loader reads only those).
        folder = repo.download([*meta, INDEX_FILE])
        try:
            weight_map = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))["weight_map"]
            weights = [INDEX_FILE, *sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise HubError(f"{repo.label}: {INDEX_FILE} is not a valid safetensors index ({e})") from e
    return str(repo.download([*meta, *weights]))


def resolve_tokenizer(tokenizer: str, *, revision: str | None = None, download_dir: str | None = None) -> str:
    """`--tokenizer` as a local path: a repo's tokenizer files, or a GGUF file (`org/name:TAG`)."""
    ref = _hub_ref(tokenizer)
    if ref is None:
        return tokenizer
    repo = _Repo(tokenizer, ref, revision, download_dir, "--tokenizer-revision")
    files = repo.list_files()
    if ref.tag is not None or ref.filename is not None:
        parts = _pick_gguf(repo, files)
        return str(repo.download(parts) / parts[0])
    wanted = _matching(files, _TOKENIZER_FILES)
    if not any(name.startswith("tokenizer") or name.startswith("vocab") for name in wanted):
        raise HubError(f"{repo.label}: no tokenizer files (tokenizer.json, tokenizer.model, ...) in the repo")
    return str(repo.download(wanted))


def _hub_ref(text: str) -> RepoRef | None:
    if Path(text).expanduser().exists():
        return None  # a local path wins, even one that looks like org/name
    return parse_repo_ref(text)


def _matching(files: list[str], patterns: tuple[str, ...]) -> list[str]:
    """Top-level files matching one of `patterns` (subfolders hold other variants of the model)."""
    return [f for f in files if "/" not in f and any(fnmatch.fnmatchcase(f, p) for p in patterns)]


def _safetensors_weights(files: list[str]) -> list[str]:
    """The index alone for a sharded checkpoint (its shards are known once it is read), else the
    top-level *.safetensors files, as `safetensors_files` would load them."""
    if INDEX_FILE in files:
        return [INDEX_FILE]
    found = _matching(files, ("*.safetensors",))
    # Mistral-style repos carry consolidated.safetensors next to the HF files: the same weights twice.
    return [f for f in found if not f.startswith("consolidated")] or found


def _gguf_models(files: list[str]) -> dict[str, list[str]]:
    """The repo's GGUF models: the file the loader opens -> every file of the model. Vision
    projectors (mmproj*) are not language models and never picked."""
    models: dict[str, list[str]] = {}
    for name in sorted(files):
        if not name.endswith(".gguf") or PurePosixPath(name).name.lower().startswith("mmproj"):
            continue
        split = _SPLIT.fullmatch(name)
        first = f"{split['stem']}-00001-of-{split['count']}.gguf" if split else name
        models.setdefault(first, []).append(name)
    for first, parts in models.items():
        parts.sort(key=lambda p: p != first)  # the file to load first
    return models


def _pick_gguf(repo: _Repo, files: list[str]) -> list[str]:
    """The files of the one GGUF model the reference names; the first is the one to load."""
    ref = repo.ref
    models = _gguf_models(files)
    if ref.filename is not None:
        for parts in models.values():
            if ref.filename in parts:
                return parts
        if ref.filename in files:
            return [ref.filename]
        raise HubError(f"{repo.label}: no file {ref.filename} in the repo{_gguf_choices(models)}")
    if not models:
        raise HubError(f"{repo.label}: no .gguf files in the repo")
    if ref.tag is None:
        hits = list(models)
    else:
        # The tag as a word of the name, case-insensitive: a plain substring would let Q4_K pick
        # model-Q4_K_M.gguf too, and F16 pick model-BF16.gguf.
        word = re.compile(rf"(?<![A-Za-z0-9]){re.escape(ref.tag)}(?![A-Za-z0-9_])", re.IGNORECASE)
        hits = [f for f in models if word.search(f)]
    if len(hits) != 1:
        what = "no GGUF file" if not hits else "several GGUF models"
        tagged = f" tagged {ref.tag}" if ref.tag else ""
        raise HubError(
            f"{repo.label}: {what}{tagged}; name one as {ref.repo_id}:TAG or {ref.repo_id}/FILE.gguf"
            f"{_gguf_choices({h: models[h] for h in hits} if hits else models)}"
        )
    parts = models[hits[0]]
    split = _SPLIT.fullmatch(parts[0])
    if split and len(parts) != int(split["count"]):
        raise HubError(f"{repo.label}: split model {parts[0]} has {len(parts)} of {split['count']} files")
    return parts


def _gguf_choices(models: dict[str, list[str]]) -> str:
    names = sorted(models)
    if not names:
        return ""
    more = f", ... ({len(names) - 20} more)" if len(names) > 20 else ""
    return f" (GGUF models: {', '.join(names[:20])}{more})"


def _is_true(value: str | None) -> bool:
    return (value or "").strip().lower() in _TRUE


class _Repo:
    """One repo at one revision: its file list and downloads, with huggingface_hub's errors turned
    into HubErrors that say what to do."""

    def __init__(
        self, text: str, ref: RepoRef, revision: str | None, download_dir: str | None, revision_flag: str
    ) -> None:
        from huggingface_hub import constants

        self.text = text
        self.ref = ref
        self.revision = revision
        self.revision_flag = revision_flag
        # Read here, not from huggingface_hub's constants alone: those are fixed when it is first
        # imported (transformers imports it early), and the environment at start-up should count.
        if download_dir:
            self.cache_dir = str(Path(download_dir).expanduser())
        elif os.environ.get("HF_HUB_CACHE"):
            self.cache_dir = os.environ["HF_HUB_CACHE"]
        elif os.environ.get("HF_HOME"):
            self.cache_dir = os.path.join(os.environ["HF_HOME"], "hub")
        else:
            self.cache_dir = constants.HF_HUB_CACHE
        self.offline = bool(constants.HF_HUB_OFFLINE) or any(
            _is_true(os.environ.get(name)) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
        )
        self.cache_only = self.offline
        self.unreachable: Exception | None = None  # why the Hub could not be asked, if online
        self.label = f"{ref.repo_id} ({revision_flag} {revision or 'main'})"

    def list_files(self) -> list[str]:
        """Every file of the repo: from the Hub, or what the cached snapshot holds."""
        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        if not self.offline:
            try:
                return HfApi().list_repo_files(self.ref.repo_id, revision=self.revision)
            except HfHubHTTPError as e:
                status = getattr(getattr(e, "response", None), "status_code", None)
                if not (isinstance(status, int) and status >= 500):
                    raise self._error(e) from None
                reason: Exception = e
            except Exception as e:  # noqa: BLE001 - no connection: the cache may still hold the repo
                reason = e
            logger.warning("Cannot reach the Hugging Face Hub (%s); looking in the cache", reason)
            self.cache_only, self.unreachable = True, reason
        folder = self._cached_snapshot()
        return sorted(
            p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()
        )

    def _cached_snapshot(self) -> Path:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(
                self.ref.repo_id, revision=self.revision, cache_dir=self.cache_dir,
                local_files_only=True, allow_patterns=["config.json"],
            ))
        except LocalEntryNotFoundError as e:
            # A snapshot holding only some of the repo's files (we download only what we load)
            # still lists what it has.
            partial = getattr(e, "snapshot_path", None)
            if partial is not None:
                return Path(partial)
            raise self._not_cached() from None

    def download(self, files: list[str]) -> Path:
        """Fetch `files` (or find them in the cache); the snapshot directory holding them."""
        from huggingface_hub import snapshot_download

        where = "the cache" if self.cache_only else "the Hub (or the cache)"
        logger.info("Fetching %s from %s: %s", self.label, where, ", ".join(files))
        try:
            folder = Path(snapshot_download(
                self.ref.repo_id, revision=self.revision, cache_dir=self.cache_dir,
                local_files_only=self.cache_only, allow_patterns=[glob.escape(f) for f in files],
            ))
        except Exception as e:  # noqa: BLE001 - every failure becomes one message naming the repo
            raise self._error(e) from None
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise self._not_cached(f"the cached snapshot lacks {', '.join(missing[:5])}")
        return folder

    def _not_cached(self, detail: str = "not in the cache") -> HubError:
        revision = f" --revision {self.revision}" if self.revision else ""
        why = (
            "HF_HUB_OFFLINE=1 forbids downloading" if self.offline
            else f"the Hub cannot be reached ({type(self.unreachable).__name__}: {self.unreachable})"
        )
        return HubError(
            f"{self.text!r} is not a local path, and {self.label} is {detail} ({self.cache_dir}); "
            f"{why}. Download it first (`hf download {self.ref.repo_id}{revision}` with network access"
            f"{', or run once without HF_HUB_OFFLINE' if self.offline else ''}), point --download-dir at "
            "the cache that holds it, or pass a local path"
        )

    def _error(self, e: Exception) -> HubError:
        from huggingface_hub import get_token
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        note = "the current token has no access" if get_token() else "no token is set"
        if isinstance(e, GatedRepoError):
            return HubError(
                f"{self.label} is a gated model: accept its conditions on https://huggingface.co/"
                f"{self.ref.repo_id} and set HF_TOKEN to a token of that account ({note})"
            )
        if isinstance(e, RevisionNotFoundError):
            return HubError(
                f"{self.revision_flag} {self.revision or 'main'}: no such branch, tag or commit in {self.ref.repo_id}"
            )
        if isinstance(e, RepositoryNotFoundError):
            return HubError(
                f"{self.text!r} is not a local path, and {self.ref.repo_id} is not a model on the Hugging "
                f"Face Hub or is private: check the name, or set HF_TOKEN to a token that can read it "
                f"({note})"
            )
        if isinstance(e, LocalEntryNotFoundError):
            return self._not_cached()
        if isinstance(e, HfHubHTTPError) and getattr(e.response, "status_code", None) in (401, 403):
            return HubError(f"{self.label}: the Hub refused access; set HF_TOKEN to a token that can read it ({note})")
        return HubError(f"{self.label}: cannot fetch from the Hugging Face Hub: {type(e).__name__}: {e}")

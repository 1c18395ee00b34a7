"""Tokenizer: text <-> token ids and chat templates, for the HTTP layer only.

Data flow: the loader (`paphos.loader`) builds one `Tokenizer` per model, from an HF model
directory (`tokenizer.json` & co.) or from the metadata of a GGUF file. The server uses it to render
chat templates and tokenize prompts into the `EngineRequest`; the detokenizer uses `decode` /
`convert_ids_to_tokens`. The engine itself only ever sees token ids.

The heavy lifting is done by an HF fast tokenizer (`self.hf`); GGUF vocabularies are converted by
transformers' own GGUF integration, never by hand. This class adds the rules the engine relies on:

- BOS handling. For a GGUF model we follow llama.cpp: BOS is added exactly when the file says so
  (`tokenizer.ggml.add_bos_token`; when the key is absent, llama.cpp's default: yes for
  sentencepiece vocabularies, no for BPE). For an HF directory, the tokenizer's own post-processor
  decides. Either way a prompt that already starts with the BOS string (as many rendered chat
  templates do) never gets a second BOS.
- Chat templates: an explicit template (argument, or the Paphos-level `--chat-template` override,
  a file path or a literal Jinja string) wins over the one shipped with the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# llama.cpp pre-tokenizer types that split every digit on its own before the GPT-2 regex
# (llama-vocab.cpp groups STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA this way).
# transformers' GGUF converter keeps the plain GPT-2 split for them, which can merge digit runs that
# llama.cpp (and the original HF tokenizer.json) keep apart.
_DIGIT_SPLIT_PRE_TYPES = frozenset(
    {"starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva"}
)


def resolve_chat_template(value: str) -> str:
    """A `--chat-template` value: the contents of a file, or the value itself if it is a template.

    Raises ValueError when the value looks like a path (no Jinja markers) but no such file exists,
    so a typo in a file name is not silently used as a one-line template.
    """
    path = Path(os.path.expanduser(value))
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as e:  # a very long literal template can make the path check itself fail
        if "{" not in value:
            raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from e
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither an existing file nor a Jinja template string")


class Tokenizer:
    """An HF fast tokenizer plus Paphos' BOS and chat-template rules (see module docstring)."""

    def __init__(
        self,
        hf: Any,
        *,
        add_bos: bool | None = None,
        add_eos: bool = False,
        chat_template: str | None = None,
        name: str = "",
    ) -> None:
        """`hf`: a transformers fast tokenizer. `add_bos`: None lets `hf` decide (HF directories);
        True/False makes this class add BOS itself (GGUF, llama.cpp semantics), likewise `add_eos`.
        `chat_template`: an already resolved override (template text), or None."""
        self.hf = hf
        self.name = name or str(getattr(hf, "name_or_path", ""))
        self._manual_specials = add_bos is not None
        self.add_bos = bool(add_bos) if add_bos is not None else self._hf_adds_bos()
        self.add_eos = add_eos
        self._chat_template_override = chat_template
        # Cached: these are read per request by the server and per step by stop checks.
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        self.pad_token_id: int | None = hf.pad_token_id
        self.bos_token: str | None = hf.bos_token
        self.eos_token: str | None = hf.eos_token
        self.all_special_ids: list[int] = list(hf.all_special_ids)
        self.vocab_size: int = len(hf)

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str], *, chat_template: str | None = None, **kwargs: Any
    ) -> Tokenizer:
        """From an HF model (or tokenizer) directory. `chat_template`: a file path or template."""
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(str(path), **kwargs)
        if not getattr(hf, "is_fast", False):
            raise ValueError(f"{path}: only fast tokenizers (tokenizer.json) are supported")
        tok = cls(hf, name=str(path))
        tok.set_chat_template(chat_template)
        return tok

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str],
        *,
        chat_template: str | None = None,
        gguf_metadata: Mapping[str, Any] | None = None,
    ) -> Tokenizer:
        """From the tokenizer stored in a GGUF file, converted by transformers' GGUF integration.

        `gguf_metadata`: the file's key/values when the caller has already read them (the GGUF
        loader does); used for `tokenizer.ggml.pre`, so digits split the way llama.cpp splits them.
        """
        # PreTrainedTokenizerFast rather than AutoTokenizer: it runs the same GGUF conversion, but
        # AutoTokenizer first re-parses the whole file (every vocabulary string) just to choose a
        # class, which costs seconds; the GGUF path always yields this fast-tokenizer class anyway.
        from transformers import PreTrainedTokenizerFast

        path = Path(path)
        hf = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        # transformers maps tokenizer.ggml.add_bos_token into the init kwargs, and already applies
        # llama.cpp's default (True) to sentencepiece ("llama") vocabularies without the key.
        add_bos = bool(hf.init_kwargs.get("add_bos_token", False))
        add_eos = bool(hf.init_kwargs.get("add_eos_token", False))
        pre = (gguf_metadata or {}).get("tokenizer.ggml.pre")
        if pre in _DIGIT_SPLIT_PRE_TYPES:
            _split_digits(hf)
        tok = cls(hf, add_bos=add_bos, add_eos=add_eos, name=str(path))
        tok.set_chat_template(chat_template)
        return tok

    # ---- ids <-> text -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. `<|im_start|>`) become their
        ids, as in llama.cpp's server. BOS is added per the model's setting, never twice."""
        bos = self.bos_token_id
        if self._manual_specials:
            ids = self.hf.encode(text, add_special_tokens=False)
            if add_special_tokens:
                if self.add_bos and bos is not None and not (ids and ids[0] == bos):
                    ids.insert(0, bos)
                if self.add_eos and self.eos_token_id is not None:
                    ids.append(self.eos_token_id)
            return ids
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens)
        if (
            add_special_tokens
            and bos is not None
            and len(ids) >= 2
            and ids[0] == bos
            and ids[1] == bos
            and self.bos_token
            and text.startswith(self.bos_token)
        ):
            del ids[0]  # the post-processor added BOS in front of the text's own BOS
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.hf.convert_ids_to_tokens(list(ids))

    def get_vocab(self) -> dict[str, int]:
        return self.hf.get_vocab()

    # ---- chat templates -----------------------------------------------------------------------

    def set_chat_template(self, value: str | None) -> None:
        """Override the model's chat template (`--chat-template`: a file path or a Jinja string);
        None keeps the current one. Raises ValueError for a path that does not exist."""
        if value is not None:
            self._chat_template_override = resolve_chat_template(value)

    @property
    def chat_template(self) -> str | None:
        """The template `apply_chat_template` uses when given none: the override, else the model's."""
        if self._chat_template_override is not None:
            return self._chat_template_override
        template = getattr(self.hf, "chat_template", None)
        if isinstance(template, dict):  # several named templates: "default" is the chat one
            template = template.get("default")
        return template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` to prompt text (tokenize it with `encode`). `chat_template`: a template
        string or file path overriding everything else. `continue_final_message` leaves the last
        (assistant) message open and therefore implies no generation prompt. Extra kwargs (tools,
        documents, template variables) are passed to the template."""
        template = _maybe_resolve(chat_template) or self.chat_template
        if template is None:
            raise ValueError(
                f"The model {self.name or '(unnamed)'} has no chat template; pass one with "
                "--chat-template FILE_OR_TEMPLATE (or use the completions API instead of chat)."
            )
        if continue_final_message:
            add_generation_prompt = False  # transformers rejects the combination
        return self.hf.apply_chat_template(
            list(messages),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )

    def _hf_adds_bos(self) -> bool:
        bos = self.hf.bos_token_id
        return bos is not None and self.hf.encode("a", add_special_tokens=True)[:1] == [bos]

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, add_bos={self.add_bos})"


def _maybe_resolve(value: str | None) -> str | None:
    return resolve_chat_template(value) if value is not None else None


def _split_digits(hf: Any) -> None:
    """Split digits individually before byte-level BPE, as llama.cpp does for these vocabularies."""
    from tokenizers import pre_tokenizers

    if not isinstance(hf.backend_tokenizer.pre_tokenizer, pre_tokenizers.ByteLevel):
        return  # a newer transformers already built a specific split: leave it alone
    hf.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )

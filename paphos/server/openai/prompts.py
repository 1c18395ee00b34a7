"""Prompt preparation for every route: text, token ids or chat messages -> checked token ids.

The last step before the engine is called. Tokenization happens here (in a worker thread for
long texts, so one huge prompt does not stall other requests), as do the checks that need the
model: token ids inside the vocabulary and prompt + completion within `max_model_len` (§2.3).
"""

from __future__ import annotations

import asyncio
from typing import Any

from paphos.server.errors import APIError, bad_request
from paphos.server.openai.protocol import ChatMessage
from paphos.server.state import EngineClient, ServerState

# Above this many characters tokenization runs in a thread (HF tokenizers need ~1 s per MB).
_THREAD_CHARS = 20_000
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "audio_url", "input_audio", "audio", "video_url"})


def context_overflow(max_model_len: int, prompt_len: int, max_tokens: int, param: str, at_least: bool = False) -> APIError:
    qualifier = "at least " if at_least else ""
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{qualifier}{prompt_len + max_tokens} tokens ({qualifier}{prompt_len} in the prompt, {max_tokens} for the "
        "completion). Please reduce the length of the prompt or completion.",
        param,
    )


def check_context(engine: EngineClient, prompt_len: int, max_tokens: int, param: str) -> None:
    if prompt_len + max_tokens > engine.max_model_len:
        raise context_overflow(engine.max_model_len, prompt_len, max_tokens, param)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"token id {token_id} is outside the vocabulary (size {vocab_size})", param)


async def encode_text(
    state: ServerState, text: str, add_special_tokens: bool, *, max_tokens: int, param: str, precheck: bool = True
) -> list[int]:
    """Tokenizes `text`; refuses at once a text that cannot fit, without tokenizing it."""
    engine = state.engine
    if precheck:
        # No token covers more than max_token_chars characters, so this is a lower bound on the
        # token count; a 10 MB prompt is answered in microseconds instead of seconds. Only texts
        # that cannot fit by themselves take this path; the rest get the exact count below.
        lower_bound = -(-len(text) // state.max_token_chars)
        if lower_bound >= engine.max_model_len:
            raise context_overflow(engine.max_model_len, lower_bound, max_tokens, param, at_least=True)
    tokenizer = engine.tokenizer
    if len(text) > _THREAD_CHARS:
        ids = await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=add_special_tokens)
    else:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    ids = list(ids)
    bos = getattr(tokenizer, "bos_token_id", None)
    # BOS is added to text prompts but never doubled when the text already starts with it (§3.1).
    if add_special_tokens and bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
        ids = ids[1:]
    return ids


def truncate_prompt(ids: list[int], keep_last: int | None) -> list[int]:
    if keep_last is None:
        return ids
    if keep_last < 1:
        raise bad_request(f"truncate_prompt_tokens must be >= 1, got {keep_last}", "truncate_prompt_tokens")
    return ids[-keep_last:]


def message_text(content: str | list[dict[str, Any]] | None) -> str:
    """OpenAI content (string or parts) -> plain text; media parts are refused (text-only models)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind in _MEDIA_PARTS:
            raise bad_request(f"This model does not accept `{kind}` content parts (text only).", "messages")
        else:
            raise bad_request(f"Unsupported content part type {kind!r}.", "messages")
    return "\n".join(texts)


def messages_for_template(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    result = []
    for message in messages:
        data = message.model_dump(exclude_none=True)
        data["content"] = message_text(message.content)
        result.append(data)
    return result


# Arguments we set ourselves; chat_template_kwargs cannot override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"add_generation_prompt", "continue_final_message", "chat_template", "tokenize", "conversation", "messages"})


def render_chat(
    engine: EngineClient,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> str:
    if not messages:
        raise bad_request("messages must contain at least one message", "messages")
    if add_generation_prompt and continue_final_message:
        raise bad_request(
            "add_generation_prompt and continue_final_message cannot both be true", "continue_final_message"
        )
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KWARGS}
    if tools:
        kwargs["tools"] = tools
    if documents:
        kwargs["documents"] = documents
    if chat_template is not None and "{{" not in chat_template and "{%" not in chat_template:
        # A request's template is always literal Jinja: never let a client name a server file.
        raise bad_request("chat_template must be a Jinja template string", "chat_template")
    try:
        return engine.tokenizer.apply_chat_template(
            messages_for_template(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **kwargs,
        )
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - template errors are the request's fault (bad template/messages)
        raise bad_request(f"Could not apply the chat template: {type(exc).__name__}: {exc}", "messages") from exc

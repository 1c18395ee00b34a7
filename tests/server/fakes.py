"""A deterministic fake engine and helpers for in-process HTTP tests of the server layer."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from paphos.config import LoRAConfig, ModelConfig, ServerConfig
from paphos.core.protocol import LoRARequest, TokenLogprobs
from paphos.lora.errors import LoRAError, LoRANotFoundError
from paphos.lora.registry import LoRARegistry
from paphos.lora.spec import LoRAModelSpec
from paphos.outputs import CompletionOutput, RequestOutput
from paphos.sampling_params import ParamError, SamplingParams
from paphos.server.app import build_app

SPECIAL = {0: "<pad>", 1: "<s>", 2: "</s>"}
SERVED_NAMES = ("fake-model", "alias")
# What a fake adapter must fit (the fake validator below ignores it; the registry needs one).
LORA_SPEC = LoRAModelSpec(num_layers=2, shapes={"q_proj": (64, 64), "v_proj": (64, 64)})


class FakeHF:
    all_special_ids = [0, 1, 2]

    def get_vocab(self) -> dict[str, int]:
        vocab = {chr(i): i for i in range(3, 128)}
        vocab.update({v: k for k, v in SPECIAL.items()})
        return vocab


class FakeTokenizer:
    bos_token_id = 1
    eos_token_id = 2
    vocab_size = 128
    hf = FakeHF()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        i = 0
        while i < len(text):
            for tid, tok in SPECIAL.items():
                if text.startswith(tok, i):
                    ids.append(tid)
                    i += len(tok)
                    break
            else:
                code = ord(text[i])
                ids.append(code if 3 <= code < 128 else ord("?"))
                i += 1
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            ("" if skip_special_tokens else SPECIAL[i]) if i in SPECIAL else chr(i) for i in ids
        )

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [SPECIAL.get(i, chr(i)) for i in ids]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        continue_final_message: bool = False, chat_template: str | None = None, **kwargs: Any,
    ) -> str:
        if chat_template and "BROKEN" in chat_template:
            raise ValueError("template syntax error")
        prefix = chat_template or ""
        extra = "".join(f"[{k}={v}]" for k, v in sorted(kwargs.items()) if k != "tools")
        text = prefix + extra + "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if continue_final_message:
            text = text[:-1]
        if add_generation_prompt:
            text += "<assistant>"
        return text


def _token(step: int, index: int) -> int:
    return ord("a") + (step + index) % 26


def _logprobs(token: int, step: int, k: int) -> TokenLogprobs:
    # Even steps: the sampled token is rank 2, so a top-1 list does not contain it.
    alts = [token + 1, token] if step % 2 == 0 else [token, token + 1]
    alts += [ord("A") + j for j in range(max(0, k - 2))]
    top_ids = alts[:k]
    top_lps = [-0.5 - 0.25 * j for j in range(len(top_ids))]
    if len(top_lps) >= 3:
        top_lps[-1] = float("-inf")
    rank = 2 if step % 2 == 0 else 1
    return TokenLogprobs(token, -0.75 if rank == 2 else -0.5, rank, top_ids, top_lps)


def fake_validate_adapter(path: str, spec: LoRAModelSpec, max_rank: int) -> str:
    """Stands in for `paphos.lora.peft.validate_adapter`: paths containing MISSING are not found,
    RANK64 is over the rank limit, BADCONFIG is unreadable; anything else is valid, resolved to
    `/resolved/<path>` (a local directory, as a downloaded Hugging Face repo would be)."""
    if "MISSING" in path:
        raise LoRANotFoundError(f"no adapter at {path!r}: neither a directory nor a Hugging Face repo")
    if "RANK64" in path:
        raise LoRAError(f"{path}: rank 64 is over --max-lora-rank {max_rank}")
    if "BADCONFIG" in path:
        raise LoRAError(f"{path}/adapter_config.json: not valid JSON")
    return f"/resolved/{path.strip('/')}"


class FakeEngine:
    def __init__(self, max_model_len: int = 256, ready_on_start: bool = True, enable_lora: bool = False) -> None:
        self.is_ready = False
        self.errored = False
        self.error: BaseException | None = None
        self.tokenizer = FakeTokenizer()
        self.vocab_size = 128
        self.max_model_len = max_model_len
        self.model_config = ModelConfig(model="/models/fake", max_logprobs=20)
        self.hold = not ready_on_start
        self.fail_start: BaseException | None = None
        self.calls: list[tuple[str, list[int], SamplingParams]] = []
        # The adapter each request id ran with (None: the base model).
        self.loras: dict[str, LoRARequest | None] = {}
        # A real registry; its adapter validation is `paphos.lora.peft.validate_adapter`, which
        # tests replace with fake_validate_adapter.
        self.lora_registry = LoRARegistry(
            LoRAConfig(enable_lora=enable_lora), LORA_SPEC if enable_lora else None, SERVED_NAMES
        )
        self.aborted: list[str] = []
        self.completed: list[str] = []
        self.observers: list[Any] = []
        self.shut_down = False

    async def start(self) -> None:
        while self.hold:
            await asyncio.sleep(0.005)
        if self.fail_start is not None:
            self.errored, self.error = True, self.fail_start
            raise self.fail_start
        self.is_ready = True

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, lora: LoRARequest | None = None
    ):
        self.calls.append((request_id, list(prompt_token_ids), dataclasses.replace(params)))
        self.loras[request_id] = lora
        text = self.tokenizer.decode(prompt_token_ids)
        if "KVFULL" in text:
            raise ParamError("prompt", "the request needs more KV blocks than the cache holds")
        done = False
        try:
            for step in range(params.max_tokens):
                if "RAISE" in text and step == 2:
                    raise RuntimeError("boom")
                if "ERRFIELD" in text and step == 1:
                    yield RequestOutput(request_id, prompt_token_ids, [], True, error="sampler exploded")
                    done = True
                    return
                await asyncio.sleep(0.02 if "SLOW" in text else 0)
                finish = "length" if step == params.max_tokens - 1 else None
                outs = []
                for i in range(params.n):
                    token = _token(step, i)
                    lps = [_logprobs(token, step, params.logprobs)] if params.logprobs is not None else None
                    outs.append(CompletionOutput(i, chr(token), [token], lps, -0.5 * (step + 1), step + 1, finish))
                prompt_lps = None
                if step == 0 and params.prompt_logprobs is not None:
                    k = params.prompt_logprobs
                    prompt_lps = [None] + [
                        TokenLogprobs(t, -1.0, 3, [ord("x"), ord("y"), ord("z")][:k], [-0.1, -0.2, -0.3][:k])
                        for t in prompt_token_ids[1:]
                    ]
                yield RequestOutput(request_id, prompt_token_ids, outs, finish is not None, prompt_lps)
            done = True
        finally:
            (self.completed if done else self.aborted).append(request_id)

    async def add_lora(
        self, name: str, path: str, base_model_name: str | None = None, replace: bool = False
    ) -> LoRARequest:
        # As the real engine: validation reads files, so it runs in a thread.
        return await asyncio.to_thread(self.lora_registry.register, name, path, base_model_name, replace)

    async def remove_lora(self, name: str) -> None:
        self.lora_registry.unregister(name)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict[str, Any]:
        return {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_used_blocks": 0}

    def cache_config_info(self) -> dict[str, str]:
        return {"block_size": "16"}

    def lora_info(self) -> dict[str, str] | None:
        if not self.lora_registry.enabled:
            return None
        names = ",".join(sorted(a.request.name for a in self.lora_registry.adapters()))
        return {"running_lora_adapters": names, "waiting_lora_adapters": "", "max_lora": "1"}

    def add_request_observer(self, observer: Any) -> None:
        self.observers.append(observer)

    async def shutdown(self) -> None:
        self.shut_down = True


def make_app(engine: FakeEngine, **server: Any):
    config = ServerConfig(**{"max_n": 8, "disable_log_requests": True, **server})
    return build_app(engine, config, list(SERVED_NAMES))


def assert_error_shape(response, status: int, type_: str | None = None, param: Any = ...) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error"
    assert body["code"] == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    for key in ("message", "type", "param", "code"):
        assert body["error"][key] == body[key]
    assert isinstance(body["message"], str) and body["message"]
    if type_ is not None:
        assert body["type"] == type_
    if param is not ...:
        assert body["param"] == param
    return body


def sse_events(text: str) -> list[str]:
    """Splits an SSE body into event payloads, checking the exact framing on the way."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")
    assert events[-1] == ""
    payloads = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        assert "\n" not in event
        payloads.append(event[len("data: "):])
    return payloads

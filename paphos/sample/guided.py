"""Guided decoding (structured outputs) through xgrammar.

Data flow: at admission the API process (paphos/engine/sampling_prep.py) compiles the request's
constraint here (`GrammarBackend.compile`, cached by xgrammar per grammar text; a bad grammar is
a 400 before the engine sees it) and sends it serialized in the request's `SamplingInputs`, so
compilation never runs in the engine core's step loop; the model runner loads it against its own
tokenizer info and keeps one `GrammarMatcher` per sequence (`GuidedState`), fills the
allowed-token bitmask of the guided rows before each sampling step (the sampler applies it first
in the pre-chain) and feeds every sampled token back.

Constraints: guided_json / response_format json_schema (JSON Schema), response_format json_object
(any JSON object), guided_regex, guided_choice (an alternation of literal strings) and
guided_grammar (GBNF, as llama.cpp / KoboldCpp `grammar`, recognised by `::=`; otherwise Lark).
A phrase-ban rollback rolls the matcher back by the tokens removed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import xgrammar as xgr

from paphos.sampling_params import ParamError, SamplingParams


def choice_grammar(choices: list[str]) -> str:
    """GBNF accepting exactly one of the strings (JSON string escaping is valid GBNF escaping)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The vocabulary scan grammars are compiled and loaded against (~1 s for a 128k vocabulary);
    the API process and the engine core each build it once, from the same tokenizer."""
    return xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


class GrammarBackend:
    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)

    def compile(self, params: SamplingParams) -> str | None:
        """The request's constraint compiled and serialized for the engine core, or None."""
        spec = params.guided
        if spec is None:
            return None
        return self._compile(*spec).serialize_json()

    def _compile(self, name: str, value: Any) -> xgr.CompiledGrammar:
        try:
            if name == "guided_json":
                return self.compiler.compile_json_schema(json.dumps(value) if not isinstance(value, str) else value)
            if name == "response_format":
                if value["type"] == "json_object":
                    return self.compiler.compile_builtin_json_grammar()
                schema = (value.get("json_schema") or {}).get("schema")
                if schema is None:
                    raise ParamError("response_format", "response_format json_schema needs json_schema.schema")
                return self.compiler.compile_json_schema(json.dumps(schema))
            if name == "guided_regex":
                return self.compiler.compile_regex(value)
            if name == "guided_choice":
                return self.compiler.compile_grammar(choice_grammar(value))
            if "::=" in value:
                return self.compiler.compile_grammar(value)
            return self.compiler.compile_lark(value)
        except ParamError:
            raise
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types for bad input
            raise ParamError(name, f"invalid {name}: {exc}") from None


class GuidedState:
    """The runner's grammar matchers, one per sequence; they outlive preemption (the matcher has
    already accepted the kept output) and are dropped when the sequence finishes."""

    def __init__(self, info: Callable[[], xgr.TokenizerInfo]) -> None:
        self._make_info = info
        self._info: xgr.TokenizerInfo | None = None
        self._matchers: dict[str, tuple[xgr.GrammarMatcher, list[int]]] = {}
        # Requests whose matcher raised since the last `take_failures`: request id -> the error.
        # Their mask rows stay all-allowed; the scheduler finishes them, the batch goes on.
        self._failures: dict[str, str] = {}

    def take_failures(self) -> dict[str, str]:
        failures, self._failures = self._failures, {}
        return failures

    def _fail(self, req_id: str, exc: Exception) -> None:
        self._failures[req_id] = f"guided decoding: {type(exc).__name__}: {exc}"
        self._matchers.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def bitmask(
        self, rows: list[tuple[int, str, str | None, int]], vocab_size: int
    ) -> tuple[list[int], torch.Tensor] | None:
        """rows: (batch row, request id, serialized grammar or None, output tokens so far) of the
        rows sampling now. Returns (guided rows, int32 bitmask) for the sampler's pre-chain, or None."""
        guided = [r for r in rows if r[2] is not None]
        if not guided:
            return None
        mask = xgr.allocate_token_bitmask(len(guided), vocab_size)
        for i, (_, req_id, grammar, num_output) in enumerate(guided):
            if req_id in self._failures:
                continue
            try:
                matcher, accepted = self._matchers.get(req_id) or self._new(req_id, grammar)
                if len(accepted) > num_output:  # the sequence was rolled back (phrase ban)
                    matcher.rollback(len(accepted) - num_output)
                    del accepted[num_output:]
                matcher.fill_next_token_bitmask(mask, i)
            except Exception as exc:  # noqa: BLE001 - confined to this request
                self._fail(req_id, exc)
        return [r[0] for r in guided], mask

    def _new(self, req_id: str, grammar: str) -> tuple[xgr.GrammarMatcher, list[int]]:
        if self._info is None:
            self._info = self._make_info()
        entry = (xgr.GrammarMatcher(xgr.CompiledGrammar.deserialize_json(grammar, self._info)), [])
        self._matchers[req_id] = entry
        return entry

    def accept(self, req_id: str, token_id: int) -> None:
        entry = self._matchers.get(req_id)
        if entry is not None and not entry[0].is_terminated():
            try:
                entry[0].accept_token(token_id)
            except Exception as exc:  # noqa: BLE001 - confined to this request
                self._fail(req_id, exc)
                return
            entry[1].append(token_id)

"""Guided decoding (structured outputs) through xgrammar.

Data flow: at admission the engine (paphos/engine/sampling_prep.py) compiles the request's
constraint here (`GrammarBackend.compile`, cached by xgrammar per grammar text) and stores the
compiled grammar on the request's SamplingParams; the model runner keeps one `GrammarMatcher` per
sequence (`GuidedState`), fills the allowed-token bitmask of the guided rows before each sampling
step (the sampler applies it first in the pre-chain) and feeds every sampled token back.

Constraints: guided_json / response_format json_schema (JSON Schema), response_format json_object
(any JSON object), guided_regex, guided_choice (an alternation of literal strings) and
guided_grammar (GBNF, as llama.cpp / KoboldCpp `grammar`, recognised by `::=`; otherwise Lark).
A phrase-ban rollback rolls the matcher back by the tokens removed.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr

from paphos.sampling_params import ParamError, SamplingParams


def choice_grammar(choices: list[str]) -> str:
    """GBNF accepting exactly one of the strings (JSON string escaping is valid GBNF escaping)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarBackend:
    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)

    def compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        spec = params.guided
        if spec is None:
            return None
        name, value = spec
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

    def __init__(self) -> None:
        self._matchers: dict[str, tuple[xgr.GrammarMatcher, list[int]]] = {}

    def drop(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)

    def bitmask(
        self, rows: list[tuple[int, str, SamplingParams, int]], vocab_size: int
    ) -> tuple[list[int], torch.Tensor] | None:
        """rows: (batch row, request id, params, output tokens so far) of the rows sampling now.
        Returns (guided rows, int32 bitmask) for the sampler's pre-chain, or None."""
        guided = [r for r in rows if r[2].compiled_grammar is not None]
        if not guided:
            return None
        mask = xgr.allocate_token_bitmask(len(guided), vocab_size)
        for i, (_, req_id, params, num_output) in enumerate(guided):
            matcher, accepted = self._matchers.get(req_id) or self._new(req_id, params)
            if len(accepted) > num_output:  # the sequence was rolled back (phrase ban)
                matcher.rollback(len(accepted) - num_output)
                del accepted[num_output:]
            matcher.fill_next_token_bitmask(mask, i)
        return [r[0] for r in guided], mask

    def _new(self, req_id: str, params: SamplingParams) -> tuple[xgr.GrammarMatcher, list[int]]:
        entry = (xgr.GrammarMatcher(params.compiled_grammar), [])
        self._matchers[req_id] = entry
        return entry

    def accept(self, req_id: str, token_id: int) -> None:
        entry = self._matchers.get(req_id)
        if entry is not None and not entry[0].is_terminated():
            entry[0].accept_token(token_id)
            entry[1].append(token_id)

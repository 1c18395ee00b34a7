"""OutputProcessor: EngineCoreOutputs (token ids) -> RequestOutputs (text deltas) for the API layer.

Runs on the API side of the engine core (design.md §2), on each step's `EngineCoreOutputs`. It
merges the sequences of one client request (n / best_of fan out into several engine requests),
detokenizes incrementally, finds stop strings and banned phrases, and returns the follow-ups for
the core: `FinishRequests` for sequences a stop string finished (their blocks are freed at the
core's next step) and `RollbackRequest`s for banned phrases. The core may have run further steps
by the time a rollback reaches it: the sequence's outputs are dropped from the rollback request
until the core acknowledges it (`EngineCoreOutputs.rolled_back`). A phrase-ban sequence the core
finishes itself (EOS, stop token, length) is held there until this side has checked its last
tokens: a banned phrase in them rolls it back like any other, a clean end is confirmed with a
`FinishRequests`, so a phrase completed by the last token is regenerated, not cut off.
With best_of > n nothing is streamed: the n sequences with the best cumulative logprob are
returned once all have finished. It also keeps the token counters behind the Prometheus
`prompt_tokens_total` / `generation_tokens_total` (plain integer adds, read on scrape).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paphos.core.protocol import (
    CoreInput,
    EngineCoreOutputs,
    EngineOutput,
    FinishRequests,
    RollbackRequest,
    TokenLogprobs,
)
from paphos.engine.detokenizer import IncrementalDetokenizer
from paphos.engine.phrase_ban import MAX_ROLLBACKS, RETRY_LIMIT_REASON, PhraseBan
from paphos.engine.stop import find_stop_string, held_back_length
from paphos.outputs import CompletionOutput, RequestOutput
from paphos.sampling_params import SamplingParams
from paphos.tokenizer import Tokenizer


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


@dataclass
class _Sequence:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    final_sent: bool = False
    # Set when the request bans phrases: token offsets, hold-back and rollback (phrase_ban.py).
    phrase_ban: PhraseBan | None = None
    # A rollback was asked for and the core has not acknowledged it yet.
    rollback_pending: bool = False

    @property
    def has_news(self) -> bool:
        return not self.final_sent and (
            self.finish_reason is not None or self.num_sent_tokens < self._committed_tokens()
        )

    def _committed_tokens(self) -> int:
        if self.phrase_ban is None or self.finish_reason is not None:
            return len(self.token_ids)
        return self.phrase_ban.committed(self.text, len(self.token_ids), self.num_sent_chars)[1]

    def delta(self, params: SamplingParams, index: int) -> CompletionOutput:
        committed = len(self.text)
        committed_tokens = len(self.token_ids)
        if self.finish_reason is None and params.stop:
            committed -= held_back_length(self.text, params.stop)
        if self.finish_reason is None and self.phrase_ban is not None:
            chars, committed_tokens = self.phrase_ban.committed(self.text, len(self.token_ids), self.num_sent_chars)
            committed = min(committed, chars)
        out = CompletionOutput(
            index=index,
            text=self.text[self.num_sent_chars : committed],
            token_ids=self.token_ids[self.num_sent_tokens : committed_tokens],
            logprobs=self.logprobs[self.num_sent_tokens : committed_tokens] if params.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
            num_generated_tokens=len(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.num_sent_chars = max(self.num_sent_chars, committed)
        self.num_sent_tokens = max(self.num_sent_tokens, committed_tokens)
        self.final_sent = self.finish_reason is not None
        return out


@dataclass
class _ClientRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_counted: bool = False
    first_scheduled_time: float | None = None

    @property
    def streams(self) -> bool:
        return self.params.best_of == self.params.n

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, _ClientRequest] = {}
        self._sequence_of: dict[str, tuple[_ClientRequest, _Sequence]] = {}
        self._followups: list[CoreInput] = []
        # Metrics: prompt tokens of requests whose prefill finished (once per client request),
        # and tokens generated by every sequence.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[str]:
        """Registers a client request; returns the engine request id of each of its sequences."""
        backend = self._tokenizer.hf.backend_tokenizer
        sequences = [
            _Sequence(i, IncrementalDetokenizer(backend, prompt_token_ids, params.skip_special_tokens))
            for i in range(params.best_of or params.n)
        ]
        if params.banned_strings:
            for seq in sequences:
                seq.phrase_ban = PhraseBan(params.banned_strings, params.banned_strings_case_sensitive)
        request = _ClientRequest(request_id, prompt_token_ids, params, sequences)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        self._requests[request_id] = request
        child_ids = [child_request_id(request_id, s.index) for s in sequences]
        for child_id, seq in zip(child_ids, sequences, strict=True):
            self._sequence_of[child_id] = (request, seq)
        return child_ids

    def child_ids(self, request_id: str) -> list[str]:
        request = self._requests.get(request_id)
        if request is None:
            return []
        return [child_request_id(request_id, s.index) for s in request.sequences]

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def abort_request(self, request_id: str) -> None:
        for child_id in self.child_ids(request_id):
            self._sequence_of.pop(child_id, None)
        self._requests.pop(request_id, None)

    def process(self, outputs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[CoreInput]]:
        """Returns the client-facing outputs and the follow-ups for the engine core."""
        for child_id in outputs.rolled_back:
            entry = self._sequence_of.get(child_id)
            if entry is not None:
                entry[1].rollback_pending = False
        for child_id, when in outputs.first_scheduled.items():
            entry = self._sequence_of.get(child_id)
            if entry is not None and entry[0].first_scheduled_time is None:
                entry[0].first_scheduled_time = when
        touched: dict[str, _ClientRequest] = {}
        stopped: list[str] = []
        for child_id, message in outputs.errors.items():
            entry = self._sequence_of.get(child_id)
            if entry is not None:
                entry[0].error = message
                stopped += self._abort_siblings(entry[0], child_id)
        for engine_output in outputs:
            entry = self._sequence_of.get(engine_output.req_id)
            if entry is None:
                continue
            request, sequence = entry
            touched[request.request_id] = request
            try:
                if self._apply(request, sequence, engine_output):
                    stopped.append(engine_output.req_id)
            except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the loop
                request.error = f"{type(exc).__name__}: {exc}"
                stopped += self._abort_siblings(request)
        followups, self._followups = self._followups, []
        if stopped:
            followups.append(FinishRequests(stopped, stopped=True))
        return self._collect(touched), followups

    def _abort_siblings(self, request: _ClientRequest, done_id: str | None = None) -> list[str]:
        """A failed request ends whole: its unfinished sequences are marked aborted; returns the
        ids of those the core still runs (not `done_id`, which the core already finished)."""
        running = []
        for child_id, seq in zip(self.child_ids(request.request_id), request.sequences, strict=True):
            if seq.finish_reason is None:
                seq.finish_reason = "abort"
                if child_id != done_id:
                    running.append(child_id)
        return running

    def _apply(self, request: _ClientRequest, sequence: _Sequence, eo: EngineOutput) -> bool:
        """Returns True when the core must be told the sequence is finished: a stop string ended
        it, or the core holds it (`held`) and its last tokens are clean."""
        held = eo.finished and sequence.phrase_ban is not None and eo.finish_reason != "abort"
        if sequence.rollback_pending:
            # Produced before the core rolled the sequence back: stale. A held finish is undone by
            # that rollback; an abort ends the sequence with the phrase cut off.
            if eo.finished and not held and sequence.finish_reason is None:
                sequence.finish_reason, sequence.stop_reason = eo.finish_reason, eo.stop_reason
            return False
        if eo.new_prompt_logprobs and request.prompt_logprobs is not None:
            request.prompt_logprobs.extend(eo.new_prompt_logprobs)
        if eo.num_cached_tokens is not None:
            request.num_cached_tokens = max(request.num_cached_tokens, eo.num_cached_tokens)
        stopped_by_string = False
        if eo.new_token_ids and sequence.finish_reason is None:
            if not request.prompt_counted:
                request.prompt_counted = True
                self.num_prompt_tokens += len(request.prompt_token_ids)
            self.num_generation_tokens += len(eo.new_token_ids)
            if sequence.phrase_ban is not None:
                # Per token, for the token offsets a rollback needs.
                pieces = [sequence.detokenizer.add_tokens([t]) for t in eo.new_token_ids]
                sequence.phrase_ban.record(len(sequence.text), pieces, eo.new_sampled_logprobs)
                new_text = "".join(pieces)
            else:
                new_text = sequence.detokenizer.add_tokens(eo.new_token_ids)
            sequence.token_ids.extend(eo.new_token_ids)
            sequence.cumulative_logprob += sum(eo.new_sampled_logprobs)
            if eo.new_logprobs:
                sequence.logprobs.extend(eo.new_logprobs)
            sequence.text += new_text
            params = request.params
            if sequence.phrase_ban is not None:
                start = sequence.phrase_ban.find(sequence.text, sequence.num_sent_chars)
                if start is not None:
                    return self._ban_phrase(request, sequence, eo, start, held)
            if params.stop and len(sequence.token_ids) >= params.min_tokens:
                match = find_stop_string(
                    sequence.text, len(new_text), params.stop, params.include_stop_str_in_output
                )
                if match is not None:
                    sequence.text = sequence.text[: match.truncate_to]
                    sequence.finish_reason, sequence.stop_reason = "stop", match.stop_string
                    stopped_by_string = not eo.finished
        if eo.finished and sequence.finish_reason is None:
            sequence.finish_reason, sequence.stop_reason = eo.finish_reason, eo.stop_reason
        return stopped_by_string or held

    def _ban_phrase(
        self, request: _ClientRequest, sequence: _Sequence, eo: EngineOutput, start: int, held: bool
    ) -> bool:
        """A banned phrase begins at output token `start`: cut the sequence back to before that
        token and, unless the engine aborted it, ask for a rollback that bans that token at that
        position. Returns True when this finished the sequence (retry limit)."""
        assert sequence.phrase_ban is not None
        banned_token = sequence.token_ids[start]
        sequence.text = sequence.text[: sequence.phrase_ban.token_starts[start]]
        sequence.cumulative_logprob -= sequence.phrase_ban.truncate(start)
        del sequence.token_ids[start:]
        del sequence.logprobs[start:]
        sequence.detokenizer = IncrementalDetokenizer(
            self._tokenizer.hf.backend_tokenizer, request.prompt_token_ids + sequence.token_ids,
            request.params.skip_special_tokens,
        )
        if eo.finished and not held:  # aborted by the engine: the phrase is simply cut off
            sequence.finish_reason, sequence.stop_reason = eo.finish_reason, eo.stop_reason
            return False
        sequence.phrase_ban.num_rollbacks += 1
        if sequence.phrase_ban.num_rollbacks > MAX_ROLLBACKS:
            sequence.finish_reason, sequence.stop_reason = "stop", RETRY_LIMIT_REASON
            return True
        sequence.rollback_pending = True
        self._followups.append(RollbackRequest(eo.req_id, start, banned_token))
        return False

    def _collect(self, touched: dict[str, _ClientRequest]) -> list[RequestOutput]:
        outputs = []
        for request in touched.values():
            finished = request.finished
            if request.streams:
                choices = [s.delta(request.params, s.index) for s in request.sequences if s.has_news]
            elif finished:
                best = sorted(request.sequences, key=lambda s: s.cumulative_logprob, reverse=True)
                choices = [s.delta(request.params, i) for i, s in enumerate(best[: request.params.n])]
            else:
                choices = []
            prompt_logprobs = None
            if (
                request.prompt_logprobs is not None
                and not request.prompt_logprobs_sent
                and len(request.prompt_logprobs) == len(request.prompt_token_ids)
            ):
                prompt_logprobs = request.prompt_logprobs
                request.prompt_logprobs_sent = True
            if not choices and prompt_logprobs is None and not finished:
                continue
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    outputs=choices,
                    finished=finished,
                    prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=request.num_cached_tokens,
                    error=request.error,
                    first_scheduled_time=request.first_scheduled_time,
                )
            )
            if finished:
                self.abort_request(request.request_id)
        return outputs

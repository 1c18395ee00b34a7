"""OutputProcessor: EngineOutputs (token ids) -> RequestOutputs (text deltas) for the API layer.

Sits after `Scheduler.update_from_output` in the step. It merges the sequences of one client request
(n / best_of fan out into several engine requests), detokenizes incrementally, finds stop strings
and reports which sequences they finished so the scheduler frees their blocks in the same step.
With best_of > n nothing is streamed: the n sequences with the best cumulative logprob are
returned once all have finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paphos.core.scheduler_output import TokenLogprobs
from paphos.engine.detokenizer import IncrementalDetokenizer
from paphos.engine.stop import find_stop_string, held_back_length
from paphos.outputs import CompletionOutput, EngineOutput, RequestOutput
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

    @property
    def has_news(self) -> bool:
        return not self.final_sent and (
            self.finish_reason is not None or self.num_sent_tokens < len(self.token_ids)
        )

    def delta(self, params: SamplingParams, index: int) -> CompletionOutput:
        committed = len(self.text)
        if self.finish_reason is None and params.stop:
            committed -= held_back_length(self.text, params.stop)
        out = CompletionOutput(
            index=index,
            text=self.text[self.num_sent_chars : committed],
            token_ids=self.token_ids[self.num_sent_tokens :],
            logprobs=self.logprobs[self.num_sent_tokens :] if params.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
            num_generated_tokens=len(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        self.num_sent_chars = max(self.num_sent_chars, committed)
        self.num_sent_tokens = len(self.token_ids)
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

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[str]:
        """Registers a client request; returns the engine request id of each of its sequences."""
        backend = self._tokenizer.hf.backend_tokenizer
        sequences = [
            _Sequence(i, IncrementalDetokenizer(backend, prompt_token_ids, params.skip_special_tokens))
            for i in range(params.best_of or params.n)
        ]
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

    def process(self, engine_outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the client-facing outputs and the engine requests stop strings finished."""
        touched: dict[str, _ClientRequest] = {}
        stopped: list[str] = []
        for engine_output in engine_outputs:
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
                for child_id, seq in zip(self.child_ids(request.request_id), request.sequences, strict=True):
                    if seq.finish_reason is None:
                        seq.finish_reason = "abort"
                        stopped.append(child_id)
        return self._collect(touched), stopped

    def _apply(self, request: _ClientRequest, sequence: _Sequence, eo: EngineOutput) -> bool:
        if eo.new_prompt_logprobs and request.prompt_logprobs is not None:
            request.prompt_logprobs.extend(eo.new_prompt_logprobs)
        request.num_cached_tokens = max(request.num_cached_tokens, eo.num_cached_tokens)
        stopped_by_string = False
        if eo.new_token_ids and sequence.finish_reason is None:
            new_text = sequence.detokenizer.add_tokens(eo.new_token_ids)
            sequence.token_ids.extend(eo.new_token_ids)
            sequence.cumulative_logprob += sum(eo.new_sampled_logprobs)
            if eo.new_logprobs:
                sequence.logprobs.extend(eo.new_logprobs)
            sequence.text += new_text
            params = request.params
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
        return stopped_by_string

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
                )
            )
            if finished:
                self.abort_request(request.request_id)
        return outputs

"""Kobold generations by genkey: what check, abort, last_logprobs and perf read (contract §5.3).

Sits beside the generate routes: each Kobold generation registers a `KoboldJob` holding its text
so far, its engine outputs handle (closing it aborts the engine request, which frees its KV blocks
in the next step) and its timings. Jobs stay readable for 30 s after they end. A request sent
without `genkey` is "anonymous": a bodiless abort or check from the same address finds it, as
SillyTavern and Kobold Lite send them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from paphos.core.protocol import TokenLogprobs
from paphos.outputs import CompletionOutput
from paphos.server.errors import bad_request
from paphos.server.openai.streaming import MergedOutputs

KEEP_FINISHED_S = 30.0
# KoboldCpp's perf `stop_reason` codes.
_STOP_CODES = {"length": 0, "eos": 1, "stop": 2}


@dataclass
class KoboldJob:
    genkey: str
    client: str
    anonymous: bool
    prompt_tokens: int
    merged: MergedOutputs | None = None
    text: list[str] = field(default_factory=list)
    # Choice 0's tokens and logprobs, for last_logprobs.
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    completion_tokens: int = 0
    # Set by the route once the generation is done, when the request asked for logprobs.
    logprobs_json: dict[str, Any] | None = None

    def record(self, index: int, delta: CompletionOutput) -> None:
        """Feeds one engine delta (only choice 0 is tracked: that is what clients read)."""
        if index != 0:
            return
        if self.first_token is None and delta.token_ids:
            self.first_token = time.monotonic()
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.completion_tokens = delta.num_generated_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    @property
    def running(self) -> bool:
        return self.finished is None

    async def abort(self) -> bool:
        """Stops the generation; its response (or stream) then ends with finish_reason `abort`."""
        if not self.running or self.merged is None:
            return False
        await self.merged.aclose()
        return True


@dataclass
class Perf:
    """The last finished generation's numbers, for /api/extra/perf."""

    total_gens: int = 0
    last_process: float = 0.0
    last_eval: float = 0.0
    last_token_count: int = 0
    last_input_count: int = 0
    stop_reason: int = -1


class KoboldJobs:
    def __init__(self) -> None:
        self._jobs: dict[str, KoboldJob] = {}
        self.perf = Perf()
        self.started = time.monotonic()

    def _purge(self) -> None:
        cutoff = time.monotonic() - KEEP_FINISHED_S
        for key in [k for k, j in self._jobs.items() if j.finished is not None and j.finished < cutoff]:
            del self._jobs[key]

    def start(self, genkey: str | None, client: str, prompt_tokens: int) -> KoboldJob:
        self._purge()
        if genkey is not None and genkey in self._jobs and self._jobs[genkey].running:
            raise bad_request(f"genkey {genkey!r} is already generating", "genkey")
        key = genkey if genkey is not None else f"kai-{uuid.uuid4().hex}"
        job = KoboldJob(key, client, genkey is None, prompt_tokens)
        self._jobs[key] = job
        return job

    def finish(self, job: KoboldJob) -> None:
        if job.finished is not None:
            return
        job.finished = time.monotonic()
        if job.finish_reason is None:
            job.finish_reason = "abort"
        first = job.first_token if job.first_token is not None else job.finished
        reason = "eos" if job.finish_reason == "stop" and job.stop_reason is None else job.finish_reason
        self.perf = Perf(
            total_gens=self.perf.total_gens + 1, last_process=first - job.started, last_eval=job.finished - first,
            last_token_count=job.completion_tokens, last_input_count=job.prompt_tokens,
            stop_reason=_STOP_CODES.get(reason, -1),
        )

    def find(self, genkey: str | None, client: str) -> KoboldJob | None:
        """The job of `genkey`; without one (or an unknown one), the caller's latest anonymous job."""
        self._purge()
        if genkey is not None and genkey in self._jobs:
            return self._jobs[genkey]
        mine = [j for j in self._jobs.values() if j.anonymous and j.client == client]
        return max(mine, key=lambda j: j.started, default=None)

    def latest(self, client: str) -> KoboldJob | None:
        """The caller's latest generation, genkey or not."""
        self._purge()
        return max((j for j in self._jobs.values() if j.client == client), key=lambda j: j.started, default=None)

    def running_anonymous(self, client: str) -> list[KoboldJob]:
        return [j for j in self._jobs.values() if j.running and j.anonymous and j.client == client]

    def get(self, genkey: str) -> KoboldJob | None:
        return self._jobs.get(genkey)

    @property
    def num_running(self) -> int:
        return sum(1 for j in self._jobs.values() if j.running)


def client_of(request: Request) -> str:
    return request.client.host if request.client is not None else ""


def get_jobs(request: Request) -> KoboldJobs:
    return request.app.state.kobold_jobs

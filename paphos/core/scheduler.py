"""Scheduler: decides, every step, how many tokens of which request the model computes.

Data flow (design.md §2): the engine adds `Request`s; `schedule()` returns a `SchedulerOutput`
for the model runner; the runner returns a `ModelRunnerOutput`; `update_from_output()` appends the
sampled tokens, checks stops, frees finished requests' blocks and returns the step's
`EngineCoreOutputs` for the output processor. Request state changes only here.

There is no prefill or decode phase: each request has `num_computed_tokens` and `num_tokens`, and
each step hands out token counts under `max_num_batched_tokens` and `max_num_seqs` so that
computed catches up with total. Running requests go first, in admission order (decode rows and
prefill chunks share the step); then waiting requests are admitted first come, first served.
When blocks run out, the newest running request is preempted by recompute: it gives back its
blocks, keeps its output, and re-enters the waiting queue at the front.

Calling contract for the engine loop (single-threaded, no reentrancy):
    out = scheduler.schedule()
    runner_out = runner.execute(out)        # also when out.is_empty: it drops finished ids
    engine_outputs = scheduler.update_from_output(out, runner_out)
`finish_requests` (abort, stop strings) may be called between steps.

Requests that can never run (prompt longer than max_model_len, or needing more KV blocks than
the whole pool has) are finished as FINISHED_ABORTED on `add_request` and reported by the next
`update_from_output` (an EngineOutput with finish_reason "abort"); the reason is logged. A
request may also stop with "length" when it would outgrow the whole pool (only possible when the
pool holds fewer tokens than max_model_len; a warning is logged at start).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from paphos.config import CacheConfig, SchedulerConfig
from paphos.core.adapter_gate import AdapterGate
from paphos.core.block_pool import KVCacheBlock
from paphos.core.kv_cache_manager import KVCacheManager
from paphos.core.protocol import EngineCoreOutputs, SchedulerStats, TokenLogprobs
from paphos.core.request_queue import RequestQueue
from paphos.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from paphos.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
        max_loras: int | None = None,
    ) -> None:
        """`max_loras`: distinct adapters the running requests may use at once (the runner's
        device slots); None when LoRA is off."""
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache_manager = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        pool_tokens = self.kv_cache_manager.max_tokens_in_pool
        if pool_tokens < self.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: one sequence alone "
                "cannot reach max_model_len and stops with 'length' at %d tokens",
                pool_tokens,
                self.max_model_len,
                pool_tokens,
            )
        # A running request stops at this many tokens: beyond it, it could not be scheduled even
        # with the whole pool to itself (and preempting itself forever would be a livelock).
        self.max_seq_len = min(self.max_model_len, pool_tokens)

        self.max_loras = max_loras
        # The running adapter drained so a request waiting for a slot gets one (adapter_gate.py).
        self._draining_lora: int | None = None
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting = RequestQueue()
        self.running: list[Request] = []  # admission order: the last is preempted first
        # Finished since the last schedule(): the runner drops their state.
        self._finished_req_ids: set[str] = set()
        # Requests the scheduler finished on its own (rejected at add_request), still to report.
        self._rejected: list[str] = []
        # First-admission times not reported yet (request id -> time.monotonic()).
        self._first_scheduled: dict[str, float] = {}
        # Prompt positions whose logprobs were already reported (1..n); a request recomputed
        # after preemption scores its prompt again, and those duplicates are dropped.
        self._prompt_logprobs_sent: dict[str, int] = {}
        self.num_preemptions_total = 0
        # Running requests rolled back since the runner last saw them (phrase bans): the next time
        # they are scheduled the runner gets them whole again (see `rollback_request`).
        self._resend: set[str] = set()
        # Phrase-ban requests this scheduler finished itself (EOS, stop token, length): their last
        # tokens may complete a banned phrase the API side has not seen yet, so they are kept,
        # without blocks, until it confirms the finish (`finish_requests`) or rolls them back
        # (`rollback_request` makes them wait again). Not counted as unfinished.
        self._held: dict[str, Request] = {}
        # Held since the last schedule(): the runner drops their inputs, keeps their sampling state.
        self._newly_held: set[str] = set()

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        reason = None
        if request.num_tokens > self.max_model_len:
            reason = f"prompt has {request.num_tokens} tokens, max_model_len is {self.max_model_len}"
        elif request.num_tokens > self.kv_cache_manager.max_tokens_in_pool:
            reason = (
                f"prompt has {request.num_tokens} tokens, the whole KV cache holds "
                f"{self.kv_cache_manager.max_tokens_in_pool}"
            )
        if reason is not None:
            logger.warning("request %s rejected: %s", request.request_id, reason)
            request.status = RequestStatus.FINISHED_ABORTED
            self._rejected.append(request.request_id)
            return
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def reject(self, req_id: str) -> None:
        """Report a request that could not be added as aborted, in the next outputs."""
        self._rejected.append(req_id)

    def finish_requests(self, req_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string found by the detokenizer) and free
        their blocks now. Unknown or already finished ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        ids = {req_ids} if isinstance(req_ids, str) else set(req_ids)
        for req_id in ids & self._held.keys():
            del self._held[req_id]
            self._forget(req_id)
        to_finish = [self.requests[i] for i in ids if i in self.requests]
        if not to_finish:
            return
        for req in to_finish:
            self._finish(req, status)
        self.running = [r for r in self.running if not r.is_finished]
        self.waiting.remove(r.request_id for r in to_finish)

    def rollback_request(self, req_id: str, num_output_tokens: int, banned_token_id: int) -> bool:
        """Phrase-ban rollback (contract §4.4.12): drop the output from `num_output_tokens` on and
        ban `banned_token_id` at that output position only.

        The runner learns of it through the ordinary diffs: the next time the request is scheduled
        its id is in `preempted_req_ids` (the runner forgets its cached state) and its whole state
        is in `scheduled_new_reqs` (prompt, kept output, kept blocks, num_computed_tokens), exactly
        as for a request resumed after preemption, so no runner-side special case exists. KV blocks
        from the one holding the last kept token on are given back (kv_cache_manager.truncate) and
        that partial block is recomputed. The per-position bans travel in
        `Request.position_bans`; bans past the new end are dropped, earlier ones are kept
        for a later rollback to that position. A held request (finished here, see `_held`) waits
        again at the front of the queue. Unknown or finished ids are ignored (returns False).
        """
        req = self.requests.get(req_id) or self._held.get(req_id)
        if req is None or not 0 <= num_output_tokens < req.num_output_tokens:
            return False
        if self._held.pop(req_id, None) is not None:
            req.status = RequestStatus.PREEMPTED
            req.stop_reason = None
            req.num_computed_tokens = 0
            self.requests[req_id] = req
            self.waiting.prepend(req)
        del req.output_token_ids[num_output_tokens:]
        del req.all_token_ids[req.num_prompt_tokens + num_output_tokens :]
        bans = req.position_bans
        for position in [p for p in bans if p > num_output_tokens]:
            del bans[position]
        bans.setdefault(num_output_tokens, []).append(banned_token_id)
        block_size = self.cache_config.block_size
        if req.status == RequestStatus.RUNNING:
            computed = min(req.num_computed_tokens, req.num_tokens - 1) // block_size * block_size
            self.kv_cache_manager.truncate(req, computed)
            req.num_computed_tokens = computed
            self._resend.add(req_id)
        else:  # preempted and waiting: it holds no blocks and is recomputed on admission
            del req.block_hashes[req.num_tokens // block_size :]
        return True

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            sampling_inputs=req.sampling_inputs,
            block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens,
            position_bans={k: list(v) for k, v in req.position_bans.items()},
            lora_id=req.lora_id,
        )

    def _allocate_next_block_early(self, req: Request, num_new: int) -> list[KVCacheBlock]:
        """A decoding request whose next token starts a new block gets that block one step early,
        while the pool has blocks to spare: the runner can then launch the next decode step
        before this one is read back (worker/lookahead.py) without waiting for this allocation.
        Never preempts anything for it."""
        kv = self.kv_cache_manager
        after_step = req.num_computed_tokens + num_new
        if not self.scheduler_config.decode_lookahead or after_step < req.num_tokens or after_step % self.cache_config.block_size or kv.num_free_blocks <= len(self.running):
            return []
        return kv.allocate_slots(req, num_new + 1) or []

    def _finish(self, req: Request, status: RequestStatus, hold: bool = False) -> None:
        self._resend.discard(req.request_id)
        req.status = status
        self.kv_cache_manager.free(req)
        del self.requests[req.request_id]
        if hold:
            self._held[req.request_id] = req
            self._newly_held.add(req.request_id)
        else:
            self._forget(req.request_id)

    def _forget(self, req_id: str) -> None:
        self._prompt_logprobs_sent.pop(req_id, None)
        self._finished_req_ids.add(req_id)

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: blocks back to the pool, output kept, front of the queue."""
        self.kv_cache_manager.free(req)
        self._resend.discard(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.prepend(req)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached_reqs: list[CachedRequestData] = []
        new_reqs: list[NewRequestData] = []
        preempted: list[Request] = []
        resent: set[str] = set()

        # 1. Running requests, oldest first. Preemption takes the newest, which is always at or
        # after the current index, so nothing already scheduled this step is ever preempted.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = req.num_tokens - req.num_computed_tokens
            if num_new <= 0 or (not self.enable_chunked_prefill and num_new > budget):
                i += 1
                continue
            num_new = min(num_new, budget)
            new_blocks = kv.allocate_slots(req, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                new_blocks = kv.allocate_slots(req, num_new)
            if new_blocks is None:
                break  # the request preempted itself: everything after it is gone too
            new_blocks += self._allocate_next_block_early(req, num_new)
            if req.request_id in self._resend:
                self._resend.discard(req.request_id)
                resent.add(req.request_id)
                new_reqs.append(self._new_request_data(req))
            else:
                cached_reqs.append(
                    CachedRequestData(req.request_id, [b.block_id for b in new_blocks], req.num_computed_tokens)
                )
            num_scheduled[req.request_id] = num_new
            budget -= num_new
            i += 1

        # 2. Waiting requests, FCFS (a blocked head blocks the rest: no starvation of long
        # prompts). Skipped after a preemption: blocks are short, and the runner must never see
        # the same id preempted and new in one step. A request whose adapter has no device slot
        # is passed over and keeps its place (adapter_gate.py).
        gate = AdapterGate(self.max_loras, self.running, self._draining_lora) if self.max_loras else None
        passed_over: list[Request] = []
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            if gate is not None and not gate.admits(req):
                passed_over.append(self.waiting.pop())
                continue
            hits, num_hit_tokens = kv.get_computed_blocks(req)
            num_new = req.num_tokens - num_hit_tokens
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if kv.allocate_slots(req, num_new, hits) is None:
                break
            self.waiting.pop()
            kv.record_prefix_cache_query(req, num_hit_tokens)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit_tokens
            req.num_cached_tokens = num_hit_tokens
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
                self._first_scheduled[req.request_id] = req.first_scheduled_time
            self.running.append(req)
            if gate is not None:
                gate.admitted(req)
            new_reqs.append(self._new_request_data(req))
            num_scheduled[req.request_id] = num_new
            budget -= num_new
        for req in reversed(passed_over):
            self.waiting.prepend(req)
        if gate is not None:
            self._draining_lora = gate.next_draining(self.waiting)

        if resent:
            # The flat batch lays out cached requests first, then new ones (rolled back included).
            ids = [c.req_id for c in cached_reqs] + [n.req_id for n in new_reqs]
            num_scheduled = {req_id: num_scheduled[req_id] for req_id in ids}
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self._finished_req_ids,
            # Rolled-back requests are "preempted and new" in one step: the runner drops and rebuilds.
            preempted_req_ids={r.request_id for r in preempted} | resent | self._newly_held,
        )
        self._finished_req_ids = set()
        self._newly_held = set()
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput | None
    ) -> EngineCoreOutputs:
        """Apply one executed step. `model_runner_output` may be None for an empty step."""
        outputs = EngineCoreOutputs(first_scheduled=self._first_scheduled)
        self._first_scheduled = {}
        for req_id in self._rejected:
            outputs.add(req_id, [], [], RequestStatus.FINISHED_ABORTED.finish_reason)
        self._rejected = []
        mro = model_runner_output or ModelRunnerOutput([], [], [])
        row = {req_id: j for j, req_id in enumerate(mro.req_ids)}
        any_finished = False
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished (aborted) after this step was scheduled
            start = req.num_computed_tokens
            req.num_computed_tokens += num_tokens
            j = row.get(req_id)
            if req_id in mro.failed:
                logger.error("request %s failed while sampling: %s", req_id, mro.failed[req_id])
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                any_finished = True
                outputs.add(req_id, [], [], RequestStatus.FINISHED_ABORTED.finish_reason)
                outputs.errors[req_id] = f"sampling failed: {mro.failed[req_id]}"
                continue
            sampled = mro.sampled_token_ids[j] if j is not None else []
            first_tokens = req.num_output_tokens == 0
            new_tokens: list[int] = []
            status: RequestStatus | None = None
            for token in sampled:
                req.append_output_token_ids([token])
                new_tokens.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break  # tokens after a stop (speculative decoding, later) are dropped
            prompt_lps = self._new_prompt_logprobs(req, start, mro.prompt_logprobs.get(req_id))
            if status is not None:
                self._finish(req, status, hold=bool(req.sampling_params.banned_strings))
                any_finished = True
            if not (new_tokens or status is not None or prompt_lps):
                continue
            n = len(new_tokens)
            outputs.add(
                req_id, new_tokens, mro.sampled_logprobs[j][:n] if j is not None else [],
                status.finish_reason if status is not None else None, req.stop_reason,
            )
            logprobs = mro.logprobs.get(req_id)
            if logprobs is not None:
                outputs.logprobs[req_id] = logprobs[:n]
            if prompt_lps:
                outputs.prompt_logprobs[req_id] = prompt_lps
            if first_tokens and new_tokens:
                outputs.num_cached_tokens[req_id] = req.num_cached_tokens
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        outputs.stats = self.stats()
        return outputs

    def stats(self) -> SchedulerStats:
        stats = SchedulerStats(
            num_running=self.num_running, num_waiting=self.num_waiting, kv_usage=self.kv_usage,
            num_used_blocks=self.num_used_blocks, num_preemptions=self.num_preemptions_total,
            prefix_cache_queries=self.prefix_cache_queries, prefix_cache_hits=self.prefix_cache_hits,
        )
        if self.max_loras:
            stats.running_loras = sorted({r.lora.name for r in self.running if r.lora is not None})
            stats.waiting_loras = sorted({r.lora.name for r in self.waiting if r.lora is not None})
        return stats

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        """Stop checks for one appended token: EOS, then stop token ids, then length."""
        sp = req.sampling_params
        # The sampler masks EOS and stop ids while output < min_tokens, so the first token that
        # may stop is number min_tokens + 1; this check is the backstop for the same rule.
        if req.num_output_tokens > sp.min_tokens:
            if token in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in req.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _new_prompt_logprobs(
        self, req: Request, start: int, entries: list[TokenLogprobs] | None
    ) -> list[TokenLogprobs] | None:
        """Entries of a chunk that computed tokens start.. cover prompt positions start+1..; keep
        only positions not reported before (a recompute after preemption repeats them)."""
        if not entries:
            return None
        sent = self._prompt_logprobs_sent.get(req.request_id, 0)
        skip = max(0, sent - start)
        self._prompt_logprobs_sent[req.request_id] = max(sent, start + len(entries))
        return entries[skip:] or None

    # ---- state for the engine and metrics ------------------------------------------------------

    def is_held(self, req_id: str) -> bool:
        """Finished here but kept until the API side confirms it (phrase bans, see `_held`)."""
        return req_id in self._held

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a rejection is still to be reported."""
        return bool(self.requests) or bool(self._rejected)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.kv_cache_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        return self.kv_cache_manager.block_pool.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.kv_cache_manager.block_pool.prefix_cache_hits

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    @property
    def num_used_blocks(self) -> int:
        pool = self.kv_cache_manager.block_pool
        return pool.num_blocks - 1 - pool.num_free_blocks

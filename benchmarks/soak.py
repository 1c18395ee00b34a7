"""Soak a Paphos server: many mixed clients for a long time, then check that nothing leaked.

Not a test and not a benchmark of speed: it looks for what only shows after thousands of requests
of every shape (5xx, hangs, wrong finishes, KV blocks never given back, memory that keeps growing).

What it does:
- Starts `paphos run` itself (default model, a free port, `--disable-log-requests`, every other
  flag at its default; `--server-arg` adds flags), or targets `--base-url` (127.0.0.1 only).
- Runs `--clients` workers (default 64) for `--duration` seconds (default 600). Each worker sends
  one request after another, each a random mix of: route (OpenAI completions and chat, streamed or
  not; Kobold `/api/v1/generate` and `/api/extra/generate/stream`), prompt (8-200 token ids or
  words; a quarter share a 48-token prefix so the prefix cache is used), output length
  (`max_tokens` 4-64) and samplers (temperature / greedy, top-p/k/a, min-p, typical, TFS, top-nsigma,
  eta / epsilon, smoothing, dynamic temperature, repetition / frequency / presence penalties, DRY,
  XTC, mirostat, no-repeat-ngram, skew, logit_bias, token bans, bad words, banned phrases (also as
  `aphrodite_xargs`), stop strings, seed, logprobs, n=2, structured output: JSON schema, choice,
  regex, GBNF).
- Misbehaves on purpose: closes streams after k chunks, aborts Kobold generations by genkey
  (`/api/extra/abort`), and lets non-streaming requests hit a short client timeout.
- Checks every request that was not cut short by the client: HTTP 200; a stream ends with
  `[DONE]` (OpenAI) or a final event with `finish_reason` (Kobold), and no chunk follows a choice's
  finish; every choice finishes with `stop` or `length` (`abort` only after our own abort);
  `length` means exactly `max_tokens` tokens, `stop` at most `max_tokens` (per choice where the
  server says it: logprobs entries, Kobold `completion_tokens`, usage with n=1; the usage total
  otherwise); no stop string or banned phrase in the text; structured output parses and matches.
  Anything else is an error, kept with its status, a body excerpt and the request to replay it.
- Every `--sample-interval` seconds (10): VmRSS of every process of the server's tree (the API
  process and its engine-core child, from /proc/PID/status) and the /metrics gauges (running,
  waiting, `aphrodite:kv_cache_usage_perc`, `paphos:kv_cache_used_blocks`, generation tokens).
- At the end: drains in-flight requests (`--drain`), waits for the server to go idle, checks zero
  KV blocks held, sends one request to prove the server still answers, and reports RSS growth from
  the first sample after `--warmup` to the last sample under load (flat = below `--rss-flat-pct`).

KV usage: `aphrodite:kv_cache_usage_perc` is `BlockPool.usage` = 1 - free / usable blocks, where the
free queue holds every block with no request referencing it, prefix-cached ones included (they are
evictable: `get_new_blocks` takes them from the queue's head and drops their hash). So an idle
server reads exactly 0 even with a warm prefix cache, and `paphos:kv_cache_used_blocks` (usable -
free) is 0; anything above 0 once no request runs or waits is a leaked reference.

    timeout 900 .venv/bin/python benchmarks/soak.py --clients 64 --duration 600 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import WORDS, json_safe  # noqa: E402

KINDS = ("cmpl-stream", "cmpl", "chat-stream", "chat", "kobold", "kobold-stream")
KIND_WEIGHTS = (30, 10, 25, 10, 10, 15)
STREAMING = frozenset({"cmpl-stream", "chat-stream", "kobold-stream"})
# Behaviour weights per kind: normal, disconnect (streams), abort (Kobold), timeout (non-streaming).
BEHAVIOURS: dict[str, dict[str, int]] = {
    "cmpl-stream": {"normal": 85, "disconnect": 15},
    "cmpl": {"normal": 85, "timeout": 15},
    "chat-stream": {"normal": 85, "disconnect": 15},
    "chat": {"normal": 85, "timeout": 15},
    "kobold": {"normal": 70, "abort": 15, "timeout": 15},
    "kobold-stream": {"normal": 70, "abort": 15, "disconnect": 15},
}
OUTCOMES = ("ok", "disconnected", "aborted", "client_timeout", "cut_at_end", "error")
STOP_CHOICES = (".", "\n", " and", "!", "?", ",", " the", "\n\n")
BANNED_CHOICES = ("the", " and", "ing", "you", ", ", " is", "The")
SAMPLER_NAMES = ("dry", "penalties", "no_repeat_ngram", "temperature", "top_nsigma", "top_p_top_k", "top_a",
                 "min_p", "tfs", "eta_cutoff", "epsilon_cutoff", "typical_p", "quadratic", "xtc")
JSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "maybe"]
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
GBNF = 'root ::= "yes" | "no"'
ERROR_DETAILS_KEPT = 60


# ---- the plan of one request ---------------------------------------------------------------------


@dataclass
class Plan:
    kind: str
    behaviour: str
    path: str
    payload: dict[str, Any]
    max_tokens: int
    n: int
    stops: list[str] = field(default_factory=list)
    banned: list[str] = field(default_factory=list)
    banned_case_sensitive: bool = False
    guided: str | None = None  # "json", "choice", "regex", "gbnf"
    logprobs: bool = False
    include_usage: bool = False
    disconnect_after: int = 0  # text chunks read before the client closes the stream
    abort_after: int = 0  # Kobold stream: text events read before the abort
    abort_delay_s: float = 0.0  # Kobold generate: seconds after sending before the abort
    timeout_s: float = 0.0  # behaviour "timeout": the short client timeout
    genkey: str | None = None


@dataclass
class Result:
    kind: str
    behaviour: str
    outcome: str = "error"
    started_s: float = 0.0
    e2e_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finishes: list[str] = field(default_factory=list)
    status: int | None = None
    problems: list[str] = field(default_factory=list)
    body_excerpt: str = ""
    abort_success: bool | None = None
    features: list[str] = field(default_factory=list)
    chunks: int = 0  # streamed events read (any kind), for telling a slow request from a stuck one
    last_chunk_at: float | None = None


def features_of(plan: Plan) -> list[str]:
    """What a request exercised, for the per-feature counts of the report."""
    p = plan.payload
    out = [f"guided:{plan.guided}"] if plan.guided else []
    out += [name for name, on in (
        ("n=2", plan.n > 1), ("logprobs", plan.logprobs), ("stop", bool(plan.stops)),
        ("banned_strings", bool(plan.banned)), ("greedy", p.get("temperature") == 0.0),
        ("dry", "dry_multiplier" in p), ("xtc", "xtc_probability" in p),
        ("mirostat", "mirostat_mode" in p or "mirostat" in p), ("sampler_priority", "sampler_priority" in p),
        ("ignore_eos", "ignore_eos" in p or "bypass_eos" in p),
    ) if on]
    return out


def _pick(rng: random.Random, weights: dict[str, int]) -> str:
    return str(rng.choices(list(weights), weights=list(weights.values()))[0])


class Planner:
    """Random but reproducible requests (one `random.Random` per worker)."""

    def __init__(self, model: str, id_range: tuple[int, int], seed: int) -> None:
        self.model = model
        self.lo, self.hi = id_range
        shared = random.Random(seed)
        self.shared_ids = [shared.randrange(self.lo, self.hi) for _ in range(48)]
        self.shared_words = " ".join(shared.choice(WORDS) for _ in range(48))

    def ids(self, rng: random.Random) -> list[int]:
        length = rng.randint(8, 200)
        if rng.random() < 0.25 and length > 48:
            return self.shared_ids + [rng.randrange(self.lo, self.hi) for _ in range(length - 48)]
        return [rng.randrange(self.lo, self.hi) for _ in range(length)]

    def words(self, rng: random.Random, low: int = 8, high: int = 200) -> str:
        length = rng.randint(low, high)
        if rng.random() < 0.25 and length > 48:
            return self.shared_words + " " + " ".join(rng.choice(WORDS) for _ in range(length - 48))
        return " ".join(rng.choice(WORDS) for _ in range(length))

    def samplers(self, rng: random.Random, plan: Plan) -> dict[str, Any]:
        """Sampler fields under their OpenAI / contract names."""
        f: dict[str, Any] = {}
        # Greedy only with n = 1: the server refuses n > 1 under greedy sampling (a 400, as Aphrodite).
        f["temperature"] = 0.0 if plan.n == 1 and rng.random() < 0.2 else round(rng.uniform(0.3, 1.4), 2)
        if rng.random() < 0.4:
            f["top_p"] = round(rng.uniform(0.7, 0.99), 2)
        if rng.random() < 0.3:
            f["top_k"] = rng.choice([5, 20, 40, 100])
        if rng.random() < 0.4:
            f["min_p"] = round(rng.uniform(0.01, 0.15), 3)
        if rng.random() < 0.1:
            f["top_a"] = round(rng.uniform(0.05, 0.3), 2)
        if rng.random() < 0.1:
            f["typical_p"] = round(rng.uniform(0.8, 0.99), 2)
        if rng.random() < 0.1:
            f["tfs"] = round(rng.uniform(0.8, 0.99), 2)
        if rng.random() < 0.1:
            f["nsigma"] = round(rng.uniform(1.0, 3.0), 2)
        if rng.random() < 0.05:
            f["eta_cutoff"] = round(rng.uniform(1.0, 5.0), 2)
        if rng.random() < 0.05:
            f["epsilon_cutoff"] = round(rng.uniform(1.0, 5.0), 2)
        if rng.random() < 0.1:
            f["smoothing_factor"] = round(rng.uniform(0.1, 0.5), 2)
            f["smoothing_curve"] = round(rng.uniform(1.0, 2.0), 2)
        if rng.random() < 0.1:
            f["dynatemp_min"], f["dynatemp_max"] = 0.5, 1.5
            f["dynatemp_exponent"] = round(rng.uniform(0.8, 1.5), 2)
        if rng.random() < 0.4:
            f["repetition_penalty"] = round(rng.uniform(1.0, 1.3), 2)
            f["repetition_penalty_range"] = rng.choice([0, 64, 256])
            if rng.random() < 0.3:
                f["rep_pen_slope"] = round(rng.uniform(0.2, 1.0), 2)
        if rng.random() < 0.3:
            f["frequency_penalty"] = round(rng.uniform(-0.5, 1.0), 2)
        if rng.random() < 0.3:
            f["presence_penalty"] = round(rng.uniform(-0.5, 1.0), 2)
        if rng.random() < 0.1:
            f["no_repeat_ngram_size"] = rng.choice([2, 3, 4])
        if rng.random() < 0.25:
            f["dry_multiplier"] = round(rng.uniform(0.5, 1.0), 2)
            f["dry_base"] = 1.75
            f["dry_allowed_length"] = rng.choice([1, 2, 3])
            f["dry_range"] = rng.choice([0, 128, 512])
            breakers = ["\n", ":", "\"", "*"]
            f["dry_sequence_breakers"] = json.dumps(breakers) if rng.random() < 0.3 else breakers
        if rng.random() < 0.2:
            f["xtc_threshold"] = 0.1
            f["xtc_probability"] = round(rng.uniform(0.2, 0.8), 2)
        if rng.random() < 0.1:
            f["mirostat_mode"] = rng.choice([1, 2])
            f["mirostat_tau"] = round(rng.uniform(3.0, 6.0), 2)
            f["mirostat_eta"] = 0.1
        if rng.random() < 0.05:
            f["skew"] = round(rng.uniform(-0.5, 0.5), 2)
        if rng.random() < 0.3:
            f["seed"] = rng.randrange(0, 2**31)
        if rng.random() < 0.1:
            f["logit_bias"] = {str(rng.randrange(self.lo, self.hi)): rng.choice([-100.0, 2.0]) for _ in range(3)}
        if rng.random() < 0.1:
            f["custom_token_bans"] = [rng.randrange(self.lo, self.hi) for _ in range(4)]
        if rng.random() < 0.05:
            f["bad_words"] = ["the", "and"]
        if rng.random() < 0.05:
            f["sampler_priority"] = rng.sample(SAMPLER_NAMES, rng.randint(1, 5))
        elif rng.random() < 0.1:
            f["temperature_last"] = True
        if plan.guided is None:
            if rng.random() < 0.2:
                f["ignore_eos"] = True
            if rng.random() < 0.3:
                plan.stops = rng.sample(STOP_CHOICES, rng.randint(1, 2))
                f["stop"] = plan.stops
            if rng.random() < 0.15:
                plan.banned = rng.sample(BANNED_CHOICES, rng.randint(1, 2))
                plan.banned_case_sensitive = rng.random() < 0.3
                f["banned_strings"] = plan.banned
                if plan.banned_case_sensitive:
                    f["banned_strings_case_sensitive"] = True
        return f

    def make(self, rng: random.Random) -> Plan:
        kind = str(rng.choices(KINDS, weights=KIND_WEIGHTS)[0])
        behaviour = _pick(rng, BEHAVIOURS[kind])
        plan = Plan(kind, behaviour, "", {}, rng.randint(4, 64), 1)
        if behaviour == "disconnect":
            plan.disconnect_after = rng.randint(1, 6)
        elif behaviour == "abort":
            plan.abort_after = rng.randint(1, 6)
            plan.abort_delay_s = round(rng.uniform(0.3, 6.0), 2)
        elif behaviour == "timeout":
            plan.timeout_s = round(rng.uniform(0.5, 8.0), 2)
        if kind.startswith("kobold"):
            self._kobold(rng, plan)
        else:
            self._openai(rng, plan)
        return plan

    def _openai(self, rng: random.Random, plan: Plan) -> None:
        chat = plan.kind.startswith("chat")
        stream = plan.kind.endswith("stream")
        if rng.random() < 0.1:
            plan.guided = rng.choice(["json", "choice", "regex"])
            plan.max_tokens = 64
        if rng.random() < 0.1:
            plan.n = 2
        payload: dict[str, Any] = {"model": self.model, "max_tokens": plan.max_tokens, "n": plan.n}
        payload.update(self.samplers(rng, plan))
        if plan.banned and not chat and rng.random() < 0.3:
            # The Aphrodite 0.6 spelling of the phrase bans.
            xargs: dict[str, Any] = {"banned_strings": payload.pop("banned_strings")}
            if payload.pop("banned_strings_case_sensitive", None):
                xargs["banned_strings_case_sensitive"] = True
            payload["aphrodite_xargs"] = xargs
        if chat:
            plan.path = "/v1/chat/completions"
            messages = []
            if rng.random() < 0.3:
                messages.append({"role": "system", "content": self.shared_words})
            if rng.random() < 0.15:
                messages += [{"role": "user", "content": self.words(rng, 4, 40)},
                             {"role": "assistant", "content": self.words(rng, 4, 40)}]
            messages.append({"role": "user", "content": self.words(rng, 8, 150)})
            payload["messages"] = messages
            if rng.random() < 0.3:
                payload["max_completion_tokens"] = payload.pop("max_tokens")
            if rng.random() < 0.2:
                plan.logprobs = True
                payload["logprobs"] = True
                payload["top_logprobs"] = rng.randint(0, 5)
        else:
            plan.path = "/v1/completions"
            payload["prompt"] = self.ids(rng) if rng.random() < 0.8 else self.words(rng)
            if rng.random() < 0.2:
                plan.logprobs = True
                payload["logprobs"] = rng.randint(0, 5)
        if plan.guided == "json":
            if chat and rng.random() < 0.5:
                payload["response_format"] = {"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": JSON_SCHEMA}}
            else:
                payload["guided_json"] = JSON_SCHEMA
        elif plan.guided == "choice":
            payload["guided_choice"] = CHOICES
        elif plan.guided == "regex":
            payload["guided_regex"] = REGEX
        if stream:
            payload["stream"] = True
            plan.include_usage = rng.random() < 0.8
            if plan.include_usage:
                payload["stream_options"] = {"include_usage": True,
                                             "continuous_usage_stats": rng.random() < 0.2}
        plan.payload = payload

    def _kobold(self, rng: random.Random, plan: Plan) -> None:
        stream = plan.kind == "kobold-stream"
        plan.path = "/api/extra/generate/stream" if stream else "/api/v1/generate"
        if rng.random() < 0.05:
            plan.guided = "gbnf"
            plan.max_tokens = 16
        if not stream and rng.random() < 0.1:
            plan.n = 2
        f = self.samplers(rng, plan)
        # Kobold spellings for some fields (the server renames them to the OpenAI ones).
        renames = {"repetition_penalty": "rep_pen", "repetition_penalty_range": "rep_pen_range",
                   "typical_p": "typical", "seed": "sampler_seed", "mirostat_mode": "mirostat",
                   "stop": "stop_sequence", "banned_strings": "banned_tokens", "ignore_eos": "bypass_eos",
                   "epsilon_cutoff": "eps_cutoff", "dry_range": "dry_penalty_last_n"}
        for name, kobold_name in renames.items():
            if name in f and rng.random() < 0.6:
                f[kobold_name] = f.pop(name)
        payload: dict[str, Any] = {"prompt": self.words(rng), "max_length": plan.max_tokens, **f}
        if rng.random() < 0.2:
            payload["memory"] = self.shared_words + "\n"
        if rng.random() < 0.3:
            payload["max_context_length"] = 2048
        if plan.n > 1:
            payload["n"] = plan.n
        if plan.guided == "gbnf":
            payload["grammar"] = GBNF
        if rng.random() < 0.15:
            plan.logprobs = True
            payload["logprobs"] = True
        if plan.behaviour == "abort" or rng.random() < 0.3:
            plan.genkey = f"soak-{uuid.uuid4().hex[:16]}"
            payload["genkey"] = plan.genkey
        plan.payload = payload


# ---- running and checking one request ------------------------------------------------------------


class Client:
    def __init__(self, session: aiohttp.ClientSession, base_url: str, request_timeout_s: float,
                 t0: float) -> None:
        self.session = session
        self.base = base_url
        self.request_timeout_s = request_timeout_s
        self.t0 = t0

    async def run(self, plan: Plan) -> Result:
        res = Result(plan.kind, plan.behaviour, started_s=time.monotonic() - self.t0, features=features_of(plan))
        start = time.perf_counter()
        total = plan.timeout_s if plan.behaviour == "timeout" else self.request_timeout_s
        sent = asyncio.Event()
        abort_task: asyncio.Task[bool] | None = None
        if plan.kind == "kobold" and plan.behaviour == "abort" and plan.genkey:
            abort_task = asyncio.create_task(self._abort_later(plan.genkey, plan.abort_delay_s, sent))
        try:
            async with self.session.post(self.base + plan.path, json=plan.payload,
                                         timeout=aiohttp.ClientTimeout(total=total)) as resp:
                res.status = resp.status
                if resp.status != 200:
                    res.body_excerpt = (await resp.read()).decode(errors="replace")[:400]
                    res.problems.append(f"HTTP {resp.status}")
                    return res
                if plan.kind in ("cmpl-stream", "chat-stream"):
                    await self._openai_stream(plan, resp, res, start)
                elif plan.kind == "kobold-stream":
                    await self._kobold_stream(plan, resp, res, start)
                elif plan.kind == "kobold":
                    await self._kobold_generate(plan, resp, res, abort_task, sent)
                else:
                    await self._openai_json(plan, resp, res)
        except TimeoutError:
            if plan.behaviour == "timeout":
                res.outcome = "client_timeout"
                res.problems.clear()
            else:
                since = "no chunk" if res.last_chunk_at is None else \
                    f"last chunk {time.perf_counter() - res.last_chunk_at:.0f} s before"
                res.problems.append(f"client timeout after {total:.0f} s (hang?): {res.chunks} chunks read, {since}")
        except (aiohttp.ClientError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError,
                ValueError) as exc:
            res.problems.append(f"{type(exc).__name__}: {str(exc)[:300]}")
        finally:
            res.e2e_s = time.perf_counter() - start
            if abort_task is not None and not abort_task.done():
                if sent.is_set():
                    await self._settle_abort(abort_task, res)
                abort_task.cancel()
                await asyncio.gather(abort_task, return_exceptions=True)
        if res.outcome not in ("disconnected", "aborted", "client_timeout") and not res.problems:
            res.outcome = "ok"
        if res.problems:
            res.outcome = "error"
        return res

    async def _abort_later(self, genkey: str, delay_s: float, sent: asyncio.Event) -> bool:
        await asyncio.sleep(delay_s)
        sent.set()
        return await self.abort(genkey)

    async def _settle_abort(self, task: asyncio.Task[bool], res: Result) -> None:
        """Waits (30 s at most) for an abort call in flight and records its answer."""
        if not task.done():
            await asyncio.wait({task}, timeout=30)
        if not task.done() or task.cancelled():
            res.problems.append("abort call did not return within 30 s")
        elif task.exception() is not None:
            res.problems.append(f"abort call failed: {task.exception()}")
        else:
            res.abort_success = task.result()

    async def abort(self, genkey: str) -> bool:
        async with self.session.post(self.base + "/api/extra/abort", json={"genkey": genkey},
                                     timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise ValueError(f"abort answered HTTP {resp.status}: {(await resp.text())[:200]}")
            return bool((await resp.json()).get("success"))

    # -- OpenAI --------------------------------------------------------------------------------------

    async def _openai_stream(self, plan: Plan, resp: aiohttp.ClientResponse, res: Result, start: float) -> None:
        chat = plan.kind == "chat-stream"
        texts: dict[int, list[str]] = defaultdict(list)
        lp_counts: dict[int, int] = defaultdict(int)
        finishes: dict[int, tuple[str, Any]] = {}
        usage: dict[str, Any] | None = None
        done = False
        text_chunks = 0
        last = start
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            res.chunks += 1
            res.last_chunk_at = time.perf_counter()
            if done:
                res.problems.append(f"data after [DONE]: {data[:120]!r}")
                break
            if data == b"[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            if "choices" not in chunk:
                res.problems.append(f"error event in stream: {data[:300].decode(errors='replace')}")
                continue
            if chunk.get("usage") and not chunk["choices"]:
                usage = chunk["usage"]
            got_text = False
            for choice in chunk["choices"]:
                index = int(choice["index"])
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if index in finishes:
                    res.problems.append(f"chunk for choice {index} after its finish_reason")
                if piece:
                    texts[index].append(piece)
                    got_text = True
                lp = choice.get("logprobs")
                if lp:
                    lp_counts[index] += len(lp.get("content") or []) if chat else len(lp.get("tokens") or [])
                if choice.get("finish_reason") is not None:
                    finishes[index] = (choice["finish_reason"], choice.get("stop_reason"))
            if got_text:
                now = time.perf_counter()
                if text_chunks == 0:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                last = now
                text_chunks += 1
                if plan.behaviour == "disconnect" and text_chunks >= plan.disconnect_after and len(finishes) < plan.n:
                    resp.close()
                    res.outcome = "disconnected"
                    res.output_tokens = text_chunks
                    return
        if not done:
            res.problems.append("stream ended without [DONE]")
        if plan.include_usage and usage is None:
            res.problems.append("include_usage set but no usage chunk")
        per_choice = dict(lp_counts) if plan.logprobs else {}
        if usage is not None and plan.n == 1 and not per_choice:
            per_choice = {0: int(usage["completion_tokens"])}
        total = int(usage["completion_tokens"]) if usage is not None else None
        self._check_choices(plan, res, {i: "".join(t) for i, t in texts.items()}, finishes, per_choice, total)
        res.output_tokens = total if total is not None else sum(per_choice.values()) or text_chunks

    async def _openai_json(self, plan: Plan, resp: aiohttp.ClientResponse, res: Result) -> None:
        body = await resp.json()
        chat = plan.kind == "chat"
        texts: dict[int, str] = {}
        finishes: dict[int, tuple[str, Any]] = {}
        per_choice: dict[int, int] = {}
        for choice in body["choices"]:
            index = int(choice["index"])
            texts[index] = (choice["message"]["content"] or "") if chat else choice["text"]
            finishes[index] = (choice["finish_reason"], choice.get("stop_reason"))
            lp = choice.get("logprobs")
            if plan.logprobs:
                if not lp:
                    res.problems.append(f"choice {index}: logprobs asked for, none returned")
                else:
                    per_choice[index] = len(lp.get("content") or []) if chat else len(lp.get("tokens") or [])
        total = int(body["usage"]["completion_tokens"])
        if plan.n == 1 and not per_choice:
            per_choice = {0: total}
        self._check_choices(plan, res, texts, finishes, per_choice, total)
        res.output_tokens = total

    # -- Kobold --------------------------------------------------------------------------------------

    async def _kobold_stream(self, plan: Plan, resp: aiohttp.ClientResponse, res: Result, start: float) -> None:
        text: list[str] = []
        final: dict[str, Any] | None = None
        events = 0
        last = start
        abort_task: asyncio.Task[bool] | None = None
        try:
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:].strip())
                res.chunks += 1
                res.last_chunk_at = time.perf_counter()
                if final is not None:
                    res.problems.append(f"event after the final one: {line[:120]!r}")
                    break
                if "finish_reason" in event:
                    final = event
                    if event.get("token"):
                        text.append(event["token"])
                    continue
                if not event.get("token"):
                    continue
                text.append(event["token"])
                now = time.perf_counter()
                if events == 0:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                last = now
                events += 1
                if plan.behaviour == "disconnect" and events >= plan.disconnect_after:
                    resp.close()
                    res.outcome = "disconnected"
                    res.output_tokens = events
                    return
                if plan.behaviour == "abort" and events == plan.abort_after and plan.genkey:
                    abort_task = asyncio.create_task(self.abort(plan.genkey))
        finally:
            if abort_task is not None:
                await self._settle_abort(abort_task, res)
                abort_task.cancel()
        res.output_tokens = events
        if final is None:
            res.problems.append("stream ended without a final event carrying finish_reason")
            return
        reason = str(final["finish_reason"])
        res.finishes = [reason]
        if final.get("error") or reason == "error":
            res.problems.append(f"generation error: {json.dumps(final)[:300]}")
            return
        if reason == "abort":
            self._check_abort(plan, res)
            return
        self._check_choices(plan, res, {0: "".join(text)}, {0: (reason, None)}, {}, None)

    async def _kobold_generate(self, plan: Plan, resp: aiohttp.ClientResponse, res: Result,
                               abort_task: asyncio.Task[bool] | None, sent: asyncio.Event) -> None:
        body = await resp.json()
        if abort_task is not None and (sent.is_set() or abort_task.done()):
            await self._settle_abort(abort_task, res)
        results = body["results"]
        if len(results) != plan.n:
            res.problems.append(f"{len(results)} results for n={plan.n}")
        texts, finishes, per_choice = {}, {}, {}
        aborted = 0
        for i, r in enumerate(results):
            texts[i] = r["text"]
            finishes[i] = (r["finish_reason"], None)
            per_choice[i] = int(r["completion_tokens"])
            aborted += r["finish_reason"] == "abort"
        res.output_tokens = sum(per_choice.values())
        if aborted:
            res.finishes = [f for f, _ in finishes.values()]
            for i, count in per_choice.items():
                if count > plan.max_tokens:
                    res.problems.append(f"result {i}: {count} tokens > max_length {plan.max_tokens}")
            self._check_abort(plan, res)
            return
        self._check_choices(plan, res, texts, finishes, per_choice, None)

    def _check_abort(self, plan: Plan, res: Result) -> None:
        """finish_reason `abort`: right only after our own abort that the server said it did."""
        if plan.behaviour != "abort":
            res.problems.append("finish_reason abort without an abort or a disconnect")
        elif res.abort_success is False:
            res.problems.append("finish_reason abort, but /api/extra/abort answered success: false")
        elif res.abort_success is None:
            res.problems.append("finish_reason abort before the abort call returned")
        else:
            res.outcome = "aborted"

    # -- the checks shared by every route ----------------------------------------------------------

    def _check_choices(self, plan: Plan, res: Result, texts: dict[int, str], finishes: dict[int, tuple[str, Any]],
                       per_choice: dict[int, int], total: int | None) -> None:
        res.finishes = [str(finishes[i][0]) for i in sorted(finishes)]
        if sorted(finishes) != list(range(plan.n)):
            res.problems.append(f"finish_reason for choices {sorted(finishes)}, expected {list(range(plan.n))}")
        all_length = True
        for index, (reason, stop_reason) in finishes.items():
            text = texts.get(index, "")
            if reason not in ("stop", "length"):
                res.problems.append(f"choice {index}: finish_reason {reason!r}")
                continue
            all_length = all_length and reason == "length"
            count = per_choice.get(index)
            if count is not None:
                if reason == "length" and count != plan.max_tokens:
                    res.problems.append(f"choice {index}: finish length after {count} tokens, max_tokens "
                                        f"{plan.max_tokens}{_BAN_NOTE if plan.banned else ''}")
                if not 1 <= count <= plan.max_tokens:
                    note = _BAN_NOTE if plan.banned and count < 1 else ""
                    res.problems.append(f"choice {index}: {count} tokens, max_tokens {plan.max_tokens}{note}")
            for stop in plan.stops:
                if stop in text:
                    res.problems.append(f"choice {index}: stop string {stop!r} in the output {text[:120]!r}")
            if isinstance(stop_reason, str) and plan.stops and stop_reason not in plan.stops and \
                    stop_reason != "banned_strings_retry_limit":
                res.problems.append(f"choice {index}: stop_reason {stop_reason!r} is not one of {plan.stops}")
            hay = text if plan.banned_case_sensitive else text.lower()
            for phrase in plan.banned:
                if (phrase if plan.banned_case_sensitive else phrase.lower()) in hay:
                    res.problems.append(f"choice {index}: banned phrase {phrase!r} in the output {text[:120]!r}"
                                        f" (stop_reason {stop_reason!r})")
            if reason == "stop" and plan.guided is not None:
                problem = _guided_problem(plan.guided, text)
                if problem:
                    res.problems.append(f"choice {index}: {problem}")
        if total is not None:
            if len(per_choice) == plan.n and sum(per_choice.values()) != total:
                res.problems.append(f"usage completion_tokens {total} != per-choice counts {per_choice}")
            if total > plan.n * plan.max_tokens:
                res.problems.append(f"usage completion_tokens {total} > n x max_tokens {plan.n * plan.max_tokens}")
            covered = len(per_choice) == plan.n
            if all_length and not covered and len(finishes) == plan.n and total != plan.n * plan.max_tokens:
                res.problems.append(f"all choices finished with length but usage says {total} tokens for n x "
                                    f"max_tokens {plan.n * plan.max_tokens}{_BAN_NOTE if plan.banned else ''}")


# A banned phrase found after the engine core had already finished the sequence (max_tokens, or EOS
# sampled in the step the core ran before the rollback reached it): the output processor cuts the
# phrase off and keeps the core's finish (output_processor._ban_phrase / _apply), so the output is
# shorter than a `length` finish says, or ends `stop` with nothing.
_BAN_NOTE = " [banned phrase cut off at the end]"


def _guided_problem(guided: str, text: str) -> str | None:
    if guided == "json":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            return f"guided JSON does not parse ({exc}): {text[:200]!r}"
        if not isinstance(obj, dict) or set(obj) != {"name", "age", "ok"}:
            return f"guided JSON does not match the schema: {text[:200]!r}"
        if not isinstance(obj["name"], str) or len(obj["name"]) > 16 or isinstance(obj["age"], bool) \
                or not isinstance(obj["age"], int) or not 0 <= obj["age"] <= 150 or not isinstance(obj["ok"], bool):
            return f"guided JSON does not match the schema: {text[:200]!r}"
    elif guided == "choice" and text not in CHOICES:
        return f"guided choice gave {text!r}"
    elif guided == "regex" and not re.fullmatch(REGEX, text):
        return f"guided regex gave {text!r}"
    elif guided == "gbnf" and text not in ("yes", "no"):
        return f"GBNF grammar gave {text!r}"
    return None


# ---- the server: start, process tree, RSS, /metrics ------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # Field 4 (ppid) comes after the command name, which is in parentheses and may hold spaces.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(int(entry))
    return kids


def process_tree(root: int) -> dict[int, str]:
    """pid -> label for the server's processes: `api` (root), `engine_core`, other helpers."""
    labels: dict[int, str] = {}
    todo = [(root, "api")]
    while todo:
        pid, label = todo.pop()
        labels[pid] = label
        for kid in _children(pid):
            try:
                cmd = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            name = "resource_tracker" if "resource_tracker" in cmd else (
                "engine_core" if label == "api" else f"{label}-child")
            todo.append((kid, name))
    return labels


def vm_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def listening_pid(port: int) -> int | None:
    """The process holding the listening socket of 127.0.0.1:port (for --base-url without --server-pid)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    return int(entry)
        except OSError:
            continue
    return None


_SUCCESS = re.compile(r'finished_reason="([^"]+)"')


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled-by-kind series of /metrics (one model): name -> value; request_success by reason."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        try:
            number = float(value)
        except ValueError:
            continue
        if name == "aphrodite:request_success_total":
            match = _SUCCESS.search(head)
            if match:
                out[f"{name}/{match.group(1)}"] = number
            continue
        if "_bucket" in name:
            continue
        out.setdefault(name, number)
    return out


GAUGES = {
    "running": "aphrodite:num_requests_running",
    "waiting": "aphrodite:num_requests_waiting",
    "kv_usage": "aphrodite:kv_cache_usage_perc",
    "kv_used_blocks": "paphos:kv_cache_used_blocks",
    "kv_total_blocks": "paphos:kv_cache_total_blocks",
    "generation_tokens": "aphrodite:generation_tokens_total",
    "prompt_tokens": "aphrodite:prompt_tokens_total",
    "preemptions": "aphrodite:num_preemptions_total",
    "prefix_hits": "aphrodite:prefix_cache_hits_total",
    "prefix_queries": "aphrodite:prefix_cache_queries_total",
    "engine_errored": "paphos:engine_errored",
}


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as resp:
        resp.raise_for_status()
        raw = parse_metrics(await resp.text())
    out = {key: raw[name] for key, name in GAUGES.items() if name in raw}
    out.update({k.split("/", 1)[1] + "_finished": v for k, v in raw.items() if k.startswith("aphrodite:request_success")})
    return out


class Sampler:
    """Every interval: RSS of the server's processes, /metrics gauges, load average."""

    def __init__(self, session: aiohttp.ClientSession, base: str, root_pid: int | None, t0: float) -> None:
        self.session = session
        self.base = base
        self.root_pid = root_pid
        self.t0 = t0
        self.samples: list[dict[str, Any]] = []
        self.labels: dict[int, str] = {}

    async def sample(self, phase: str) -> dict[str, Any]:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - self.t0, 1), "phase": phase}
        if self.root_pid is not None:
            self.labels.update(process_tree(self.root_pid))
            rss = {}
            for pid, label in sorted(self.labels.items()):
                mb = vm_rss_mb(pid)
                if mb is not None:
                    rss[f"{label}:{pid}"] = round(mb, 1)
            row["rss_mb"] = rss
        try:
            row["metrics"] = await scrape(self.session, self.base)
        except (aiohttp.ClientError, TimeoutError) as exc:
            row["metrics_error"] = f"{type(exc).__name__}: {exc}"
        try:
            row["loadavg"] = float(Path("/proc/loadavg").read_text().split()[0])
        except OSError:
            pass
        self.samples.append(row)
        return row


class Server:
    """`paphos run` in its own process group, log in a temp dir."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = args.port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkdtemp(prefix="paphos-soak-")) / "server.log"
        self.cmd = [sys.executable, "-m", "paphos", "run", *([args.model] if args.model else []),
                    "--port", str(self.port), "--disable-log-requests", *args.server_arg]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        print(f"starting: {' '.join(self.cmd)}  (log: {self.log_path})", flush=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def wait_ready(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"paphos run exited with {self.proc.returncode}; see {self.log_path}")
            try:
                async with session.get(self.base + "/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(1.0)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def log_problems(self, limit: int = 40) -> list[str]:
        """Server log lines that name an error (tracebacks, ERROR, exceptions)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        keep = [ln for ln in lines if re.search(r"Traceback|ERROR|Exception|Error:|CRITICAL", ln)]
        return keep[:limit]


# ---- the run ---------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1e3, 1)


def rss_summary(samples: list[dict[str, Any]], warmup_s: float, flat_pct: float) -> dict[str, Any]:
    """Per process: first sample after warm-up vs last sample under load, max, slope, idle end."""
    load = [s for s in samples if s["phase"] == "load" and "rss_mb" in s]
    after = [s for s in load if s["t_s"] >= warmup_s] or load[-1:]
    idle = [s for s in samples if s["phase"] == "idle" and "rss_mb" in s]
    procs = sorted({p for s in samples for p in s.get("rss_mb", {})})
    out: dict[str, Any] = {}
    for proc in procs:
        series = [(s["t_s"], s["rss_mb"][proc]) for s in after if proc in s["rss_mb"]]
        every = [s["rss_mb"][proc] for s in samples if proc in s.get("rss_mb", {})]
        if not series:
            continue
        start, end = series[0][1], series[-1][1]
        slope = None
        if len(series) >= 3:
            mt = sum(t for t, _ in series) / len(series)
            mv = sum(v for _, v in series) / len(series)
            den = sum((t - mt) ** 2 for t, _ in series)
            slope = 60.0 * sum((t - mt) * (v - mv) for t, v in series) / den if den else None
        growth = 100.0 * (end - start) / start if start else 0.0
        out[proc] = {
            "start_mb": start, "start_t_s": series[0][0], "end_mb": end, "end_t_s": series[-1][0],
            "max_mb": max(every), "growth_mb": round(end - start, 1), "growth_pct": round(growth, 2),
            "slope_mb_per_min": None if slope is None else round(slope, 2),
            "idle_end_mb": idle[-1]["rss_mb"].get(proc) if idle else None,
            "flat": growth < flat_pct,
            "series_mb": [v for _, v in series],
        }
    return out


async def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    server: Server | None = None
    if args.base_url:
        base = args.base_url.rstrip("/")
        host = urlparse(base).hostname
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise SystemExit(f"--base-url must be a loopback address (127.0.0.1), got {host!r}")
    else:
        server = Server(args)
        base = server.base
    warmup_s = args.warmup if args.warmup is not None else min(60.0, args.duration / 4)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    report: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "base_url": base}
    results: list[Result] = []
    error_examples: list[dict[str, Any]] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            if server is not None:
                server.start()
                t_load = time.monotonic()
                await server.wait_ready(session, args.startup_timeout)
                report["startup_s"] = round(time.monotonic() - t_load, 1)
                root_pid: int | None = server.proc.pid if server.proc else None
                report["server_cmd"] = server.cmd
                report["server_log"] = str(server.log_path)
            else:
                port = urlparse(base).port or 80
                root_pid = args.server_pid or listening_pid(port)
            async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                resp.raise_for_status()
                model = str((await resp.json())["data"][0]["id"])
            report["model"] = model
            report["server_pid"] = root_pid
            planner = Planner(model, tuple(args.id_range), args.seed)  # type: ignore[arg-type]
            t0 = time.monotonic()
            deadline = t0 + args.duration
            client = Client(session, base, args.request_timeout, t0)
            sampler = Sampler(session, base, root_pid, t0)
            await sampler.sample("load")
            print(f"soak: {args.clients} clients for {args.duration:.0f} s against {base} ({model})", flush=True)

            def record(plan: Plan, res: Result) -> None:
                results.append(res)
                if res.outcome == "error" and len(error_examples) < ERROR_DETAILS_KEPT:
                    error_examples.append({
                        "kind": res.kind, "behaviour": res.behaviour, "t_s": round(res.started_s, 1),
                        "status": res.status, "problems": res.problems, "body_excerpt": res.body_excerpt,
                        "finishes": res.finishes, "path": plan.path, "payload": plan.payload,
                    })

            async def worker(wid: int) -> None:
                rng = random.Random(args.seed * 1_000_003 + wid)
                while time.monotonic() < deadline:
                    plan = planner.make(rng)
                    task = asyncio.ensure_future(client.run(plan))
                    try:
                        res = await asyncio.shield(task)
                    except asyncio.CancelledError:
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                        record(plan, Result(plan.kind, plan.behaviour, "cut_at_end",
                                            started_s=time.monotonic() - t0))
                        raise
                    record(plan, res)

            async def sample_forever() -> None:
                while True:
                    await asyncio.sleep(args.sample_interval)
                    row = await sampler.sample("load" if time.monotonic() < deadline else "drain")
                    m = row.get("metrics", {})
                    rss = " ".join(f"{k.split(':')[0]}={v:.0f}MB" for k, v in row.get("rss_mb", {}).items())
                    outcomes = Counter(r.outcome for r in results)
                    print(f"[{row['t_s']:6.0f}s] running={m.get('running', math.nan):.0f} waiting={m.get('waiting', math.nan):.0f} "
                          f"kv={100 * m.get('kv_usage', 0):.1f}% {rss} load={row.get('loadavg', 0):.1f} "
                          f"done={len(results)} {dict(outcomes)}", flush=True)

            sampling = asyncio.create_task(sample_forever())
            workers = [asyncio.create_task(worker(i)) for i in range(args.clients)]
            await asyncio.sleep(max(0.0, deadline - time.monotonic()))
            # Drain: no new requests; in-flight ones get `--drain` seconds, then the client cancels them.
            _, pending = await asyncio.wait(workers, timeout=args.drain)
            for task in pending:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            t_end = time.monotonic() - t0
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)

            # Idle: wait until nothing runs or waits, then read the KV gauges.
            idle_deadline = time.monotonic() + args.idle_timeout
            final: dict[str, Any] = {}
            while True:
                row = await sampler.sample("idle")
                final = row.get("metrics", {})
                idle = final.get("running") == 0 and final.get("waiting") == 0
                if idle and final.get("kv_used_blocks", 1) == 0:
                    break
                if time.monotonic() > idle_deadline:
                    break
                await asyncio.sleep(1.0)
            # One request after the soak: the server still serves correctly.
            after_plan = Plan("cmpl-stream", "normal", "/v1/completions",
                              {"model": model, "prompt": planner.shared_ids[:16], "max_tokens": 8, "temperature": 0,
                               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}},
                              max_tokens=8, n=1, include_usage=True)
            after = await client.run(after_plan)
            await asyncio.sleep(1.0)
            idle_row = await sampler.sample("idle")
            report["after_request"] = {"outcome": after.outcome, "problems": after.problems,
                                       "tokens": after.output_tokens}
            report["kv_end"] = {
                "kv_cache_usage_perc": final.get("kv_usage"), "kv_used_blocks": final.get("kv_used_blocks"),
                "kv_total_blocks": final.get("kv_total_blocks"), "running": final.get("running"),
                "waiting": final.get("waiting"), "engine_errored": final.get("engine_errored"),
                "after_probe_kv_used_blocks": idle_row.get("metrics", {}).get("kv_used_blocks"),
                "idle_wait_s": round(idle_row["t_s"] - t_end, 1),
            }
            report["kv_leak"] = not (final.get("running") == 0 and final.get("waiting") == 0
                                     and final.get("kv_used_blocks") == 0 and final.get("kv_usage") == 0)
            report["load_end_s"] = round(t_end, 1)
            report["samples"] = sampler.samples
        finally:
            if server is not None:
                report["server_exit_code"] = server.stop()
                report["server_log_problems"] = server.log_problems()
    report["results"] = summarize(results, args.duration, report)
    report["errors"] = error_examples
    report["rss"] = rss_summary(report.get("samples", []), warmup_s, args.rss_flat_pct)
    report["warmup_s"] = warmup_s
    return report


def summarize(results: list[Result], duration_s: float, report: dict[str, Any]) -> dict[str, Any]:
    by_kind: dict[str, dict[str, int]] = {k: dict.fromkeys(OUTCOMES, 0) for k in KINDS}
    for r in results:
        by_kind[r.kind][r.outcome] += 1
    by_behaviour: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        by_behaviour[r.behaviour][r.outcome] += 1
    signatures: Counter[str] = Counter()
    for r in results:
        if r.outcome == "error":
            signatures[f"{r.kind}: {re.sub(r'[0-9]+', 'N', r.problems[0] if r.problems else '?')[:140]}"] += 1
    by_feature: dict[str, Counter[str]] = defaultdict(Counter)
    for r in results:
        for feature in r.features:
            by_feature[feature][r.outcome] += 1
    ok = [r for r in results if r.outcome == "ok"]
    latency: dict[str, Any] = {}
    for kind in KINDS:
        rows = [r for r in ok if r.kind == kind]
        ttft = [r.ttft_s for r in rows if r.ttft_s is not None]
        itl = [x for r in rows for x in r.itl_s]
        e2e = [r.e2e_s for r in rows]
        latency[kind] = {
            "ttft_p50_ms": _ms(percentile(ttft, 0.5)), "ttft_p99_ms": _ms(percentile(ttft, 0.99)),
            "itl_p50_ms": _ms(percentile(itl, 0.5)), "itl_p99_ms": _ms(percentile(itl, 0.99)),
            "e2e_p50_ms": _ms(percentile(e2e, 0.5)), "e2e_p99_ms": _ms(percentile(e2e, 0.99)),
        }
    all_ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    all_itl = [x for r in ok for x in r.itl_s]
    samples = report.get("samples", [])
    gen = [(s["t_s"], s["metrics"]["generation_tokens"]) for s in samples
           if s["phase"] != "idle" and "generation_tokens" in s.get("metrics", {})]
    server_tok_s = (gen[-1][1] - gen[0][1]) / (gen[-1][0] - gen[0][0]) if len(gen) >= 2 and gen[-1][0] > gen[0][0] else None
    finishes = Counter(f for r in results for f in r.finishes)
    ok_tokens = sum(r.output_tokens for r in ok)
    return {
        "total": len(results),
        "by_kind": by_kind,
        "by_behaviour": {k: dict(v) for k, v in by_behaviour.items()},
        "by_feature": {k: dict(v) for k, v in sorted(by_feature.items())},
        "outcomes": dict(Counter(r.outcome for r in results)),
        "errors": sum(1 for r in results if r.outcome == "error"),
        "error_signatures": dict(signatures.most_common()),
        "finish_reasons": dict(finishes),
        "abort_success": dict(Counter(str(r.abort_success) for r in results if r.behaviour == "abort")),
        "ok_output_tokens": ok_tokens,
        "ok_output_tok_s": round(ok_tokens / duration_s, 1) if duration_s > 0 else None,
        "server_generation_tok_s": None if server_tok_s is None else round(server_tok_s, 1),
        "ttft_p50_ms": _ms(percentile(all_ttft, 0.5)), "ttft_p99_ms": _ms(percentile(all_ttft, 0.99)),
        "itl_p50_ms": _ms(percentile(all_itl, 0.5)), "itl_p99_ms": _ms(percentile(all_itl, 0.99)),
        "latency_by_kind": latency,
        "requests": [
            {"kind": r.kind, "behaviour": r.behaviour, "outcome": r.outcome, "t_s": round(r.started_s, 1),
             "e2e_ms": round(r.e2e_s * 1e3, 1), "ttft_ms": _ms(r.ttft_s), "tokens": r.output_tokens,
             "finishes": r.finishes, "status": r.status, "features": r.features}
            for r in results
        ],
    }


def format_report(report: dict[str, Any]) -> str:
    res = report["results"]
    lines = ["", f"==== Soak: {report['config']['clients']} clients, {report['config']['duration']:.0f} s, "
             f"{report.get('model', '?')} ===="]
    header = f"{'kind':<15}" + "".join(f"{o:>15}" for o in (*OUTCOMES, "total"))
    lines += ["requests by kind and outcome:", header]
    totals = dict.fromkeys(OUTCOMES, 0)
    for kind, row in res["by_kind"].items():
        for o in OUTCOMES:
            totals[o] += row[o]
        lines.append(f"{kind:<15}" + "".join(f"{row[o]:>15}" for o in OUTCOMES) + f"{sum(row.values()):>15}")
    lines.append(f"{'all':<15}" + "".join(f"{totals[o]:>15}" for o in OUTCOMES) + f"{sum(totals.values()):>15}")
    lines.append(f"by behaviour: {res['by_behaviour']}")
    lines.append("by feature: " + "; ".join(f"{k} {v}" for k, v in res["by_feature"].items()))
    lines.append(f"finish reasons: {res['finish_reasons']}   Kobold abort success: {res['abort_success']}")
    lines.append(f"errors: {res['errors']}")
    for sig, count in list(res["error_signatures"].items())[:15]:
        lines.append(f"  {count:5d} x {sig}")
    lines.append(f"output tok/s: {res['ok_output_tok_s']} (ok requests, client count), "
                 f"{res['server_generation_tok_s']} (server generation_tokens, all requests)")
    lines.append(f"TTFT p50/p99 {res['ttft_p50_ms']} / {res['ttft_p99_ms']} ms, "
                 f"ITL p50/p99 {res['itl_p50_ms']} / {res['itl_p99_ms']} ms (ok streamed requests)")
    lines.append(f"{'kind':<15}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>10}{'ITL p99':>10}{'E2E p50':>10}{'E2E p99':>10}  (ms)")
    for kind, lat in res["latency_by_kind"].items():
        cells = [lat[k] for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")]
        lines.append(f"{kind:<15}" + "".join(f"{'-' if c is None else f'{c:.0f}':>10}" for c in cells))
    rss = report.get("rss", {})
    if rss:
        lines.append(f"RSS (MB; start = first sample after {report['warmup_s']:.0f} s warm-up, end = last under load):")
        lines.append(f"{'process':<26}{'start':>9}{'end':>9}{'max':>9}{'growth':>10}{'MB/min':>9}{'idle end':>10}  flat")
        for proc, s in rss.items():
            lines.append(f"{proc:<26}{s['start_mb']:>9.1f}{s['end_mb']:>9.1f}{s['max_mb']:>9.1f}"
                         f"{s['growth_pct']:>9.1f}%{'-' if s['slope_mb_per_min'] is None else s['slope_mb_per_min']:>9}"
                         f"{'-' if s['idle_end_mb'] is None else s['idle_end_mb']:>10}  {'yes' if s['flat'] else 'NO'}")
            lines.append(f"  series: {' '.join(f'{v:.0f}' for v in s['series_mb'])}")
    else:
        lines.append("RSS: not sampled (no server pid)")
    kv = report.get("kv_end", {})
    lines.append(f"KV at end: usage {kv.get('kv_cache_usage_perc')}, used blocks {kv.get('kv_used_blocks')} of "
                 f"{kv.get('kv_total_blocks')}, running {kv.get('running')}, waiting {kv.get('waiting')} "
                 f"(idle after {kv.get('idle_wait_s')} s); leak: {'YES' if report.get('kv_leak') else 'no'}")
    lines.append(f"request after the soak: {report.get('after_request')}")
    if report.get("server_log_problems"):
        lines.append(f"server log lines naming errors: {len(report['server_log_problems'])}, first:")
        lines += [f"  {ln[:200]}" for ln in report["server_log_problems"][:8]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default=None, help="a running server on 127.0.0.1 (default: start paphos run)")
    ap.add_argument("--server-pid", type=int, default=None, help="with --base-url: the pid whose tree to sample")
    ap.add_argument("--model", default=None, help="model for paphos run (default: the bundled default model)")
    ap.add_argument("--port", type=int, default=None, help="port for paphos run (default: a free one)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for paphos run (repeatable)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=None, help="seconds before the RSS baseline (default min(60, duration/4))")
    ap.add_argument("--drain", type=float, default=180.0, help="seconds in-flight requests get after the duration")
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="seconds to wait for the server to go idle")
    ap.add_argument("--request-timeout", type=float, default=480.0, help="client timeout of every normal request")
    ap.add_argument("--sample-interval", type=float, default=10.0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--rss-flat-pct", type=float, default=5.0, help="RSS growth below this is flat")
    ap.add_argument("--id-range", type=int, nargs=2, default=(1000, 40000), metavar=("LO", "HI"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(run_soak(args))
    print(format_report(report))
    if args.out:
        Path(args.out).write_text(json.dumps(json_safe(report), indent=1))
        print(f"wrote {args.out}")
    rss_flat = all(s["flat"] for s in report["rss"].values())
    healthy = report.get("after_request", {}).get("outcome") == "ok"
    return 0 if report["results"]["errors"] == 0 and not report.get("kv_leak") and rss_flat and healthy else 1


if __name__ == "__main__":
    sys.exit(main())

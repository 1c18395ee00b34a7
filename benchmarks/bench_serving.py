"""Serving benchmark for any OpenAI-compatible `/v1/completions` streaming endpoint.

Metrics follow `vllm bench serve`:
- TTFT: request sent -> first streamed chunk carrying text.
- ITL: gaps between successive text chunks of one request.
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with more than one output token.
- E2E: request sent -> last chunk.
- output tok/s = all output tokens / benchmark duration; req/s = completed requests / duration.
Each is reported as mean / median / p99 (ms).

Load shape: `--max-concurrency C` caps requests in flight; `--request-rate R` sends requests as a
Poisson process of rate R per second (default `inf`: all at once, so with `--max-concurrency` the
server always has exactly C requests). Prompts are unique per request (no prefix-cache hits):
`--prompt-mode ids` sends random token ids as the `prompt` int-list form (exactly `--input-len`
tokens; ids drawn from `--id-range`, away from special tokens), `--prompt-mode words` sends random
English words (about one token each, numbered per request) for servers without int-list prompts.
Output length is fixed with `max_tokens` and `ignore_eos: true` (`--ban-eos-ids` also bans EOS by
`logit_bias` for servers without `ignore_eos`). Output tokens are counted from the stream's usage
chunk (`stream_options.include_usage`) when the server sends one, else from text chunks.

The client is aiohttp, as `vllm bench serve`'s: at 64 streams httpx's streaming costs most of a core
per 10k events, and a client that lags inflates every latency it measures.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:2242 \\
        --num-prompts 64 --input-len 64 --output-len 64 --max-concurrency 16 --out result.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town road arm"
).split()


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:2242"
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 64
    input_len: int = 64
    output_len: int = 64
    max_concurrency: int | None = None
    request_rate: float = math.inf
    prompt_mode: str = "ids"
    id_range: tuple[int, int] = (1000, 40000)
    ban_eos_ids: list[int] = field(default_factory=list)
    include_usage: bool = True
    ignore_eos: bool = True
    warmup: int = 1
    seed: int = 0
    timeout_s: float = 600.0


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens_from_usage: bool = False
    error: str = ""


def make_prompts(cfg: BenchConfig, count: int, offset: int = 0) -> list[str | list[int]]:
    """Unique prompts of `cfg.input_len` tokens (ids mode) or words (words mode)."""
    rng = random.Random(cfg.seed * 1_000_003 + offset)
    lo, hi = cfg.id_range
    prompts: list[str | list[int]] = []
    for i in range(count):
        if cfg.prompt_mode == "ids":
            # The leading ids spell the request number, so prompts differ from the first token on.
            k = offset + i
            head = [lo + k % (hi - lo), lo + (k // (hi - lo)) % (hi - lo)]
            ids = head + [rng.randrange(lo, hi) for _ in range(max(0, cfg.input_len - len(head)))]
            prompts.append(ids[: cfg.input_len])
        else:
            words = [str(offset + i)] + [rng.choice(WORDS) for _ in range(max(0, cfg.input_len - 1))]
            prompts.append(" ".join(words))
    return prompts


async def resolve_model(client: aiohttp.ClientSession, cfg: BenchConfig) -> str:
    if cfg.model:
        return cfg.model
    async with client.get(f"{cfg.base_url}/v1/models") as resp:
        resp.raise_for_status()
        return str((await resp.json())["data"][0]["id"])


async def send_request(
    client: aiohttp.ClientSession, cfg: BenchConfig, model: str, prompt: str | list[int], max_tokens: int
) -> RequestResult:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.include_usage:
        payload["stream_options"] = {"include_usage": True}
    if cfg.ban_eos_ids:
        payload["logit_bias"] = {str(t): -100.0 for t in cfg.ban_eos_ids}
    prompt_len = len(prompt) if isinstance(prompt, list) else cfg.input_len
    res = RequestResult(ok=False, prompt_len=prompt_len)
    text_chunks = 0
    usage_tokens: int | None = None
    start = time.perf_counter()
    last = start
    try:
        async with client.post(f"{cfg.base_url}{cfg.endpoint}", json=payload) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")
                res.error = f"HTTP {resp.status}: {body[:300]}"
                return res
            async for raw in resp.content:
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                choices = chunk.get("choices") or []
                if not any(c.get("text") for c in choices):
                    continue
                now = time.perf_counter()
                if text_chunks == 0:
                    res.ttft_s = now - start
                else:
                    res.itl_s.append(now - last)
                last = now
                text_chunks += 1
        res.e2e_s = time.perf_counter() - start
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.tokens_from_usage = usage_tokens is not None
    res.output_tokens = usage_tokens if usage_tokens is not None else text_chunks
    res.ok = text_chunks > 0
    if not res.ok:
        res.error = "no text chunk received"
    return res


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]
    return {
        "mean": statistics.fmean(values) * 1e3,
        "median": statistics.median(values) * 1e3,
        "p99": p99 * 1e3,
    }


def json_safe(obj: Any) -> Any:
    """Non-finite floats become null (or "inf" for an unlimited request rate): strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj == math.inf else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def summarize(results: list[RequestResult], duration_s: float, cfg: BenchConfig) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # Requests that ended before max_tokens (EOS not ignored, or the server cut them off).
        "short_outputs": sum(1 for r in done if r.output_tokens < cfg.output_len),
        "output_tokens_from_usage": all(r.tokens_from_usage for r in done) if done else False,
        "request_throughput": len(done) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": _stats_ms([r.ttft_s for r in done]),
        "tpot_ms": _stats_ms(tpots),
        "itl_ms": _stats_ms([x for r in done for x in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in done]),
    }


async def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=aiohttp.ClientTimeout(total=cfg.timeout_s),
        headers=headers,
    ) as client:
        model = await resolve_model(client, cfg)
        if cfg.warmup:
            for p in make_prompts(cfg, cfg.warmup, offset=10_000_000):
                await send_request(client, cfg, model, p, min(cfg.output_len, 8))
        prompts = make_prompts(cfg, cfg.num_prompts)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        rng = random.Random(cfg.seed + 7)

        async def one(p: str | list[int]) -> RequestResult:
            if sem is None:
                return await send_request(client, cfg, model, p, cfg.output_len)
            async with sem:
                return await send_request(client, cfg, model, p, cfg.output_len)

        start = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(one(p)))
            if math.isfinite(cfg.request_rate) and cfg.request_rate > 0:
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration, cfg)
    summary["model"] = model
    return summary


def format_table(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Benchmark duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f"{summary[key][stat]:.2f}"))
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"{f' {title} ':=^{width + 12}}"]
    lines += [f"{name:<{width}}{value:>12}" for name, value in rows]
    lines.append("=" * (width + 12))
    if summary["errors"]:
        lines.append("errors: " + "; ".join(summary["errors"]))
    if summary["short_outputs"]:
        lines.append(f"warning: {summary['short_outputs']} requests produced fewer tokens than --output-len")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:2242")
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None, help="model name (default: first id of /v1/models)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson rate, req/s (default inf)")
    ap.add_argument("--prompt-mode", choices=("ids", "words"), default="ids")
    ap.add_argument("--id-range", type=int, nargs=2, default=(1000, 40000), metavar=("LO", "HI"))
    ap.add_argument("--ban-eos-ids", type=int, nargs="*", default=[], help="also ban these ids by logit_bias")
    ap.add_argument("--no-include-usage", action="store_true", help="do not send stream_options")
    ap.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up requests before measuring")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None, help="write the summary as JSON here")
    return ap


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url.rstrip("/"),
        endpoint=args.endpoint,
        model=args.model,
        api_key=args.api_key,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        prompt_mode=args.prompt_mode,
        id_range=tuple(args.id_range),
        ban_eos_ids=list(args.ban_eos_ids),
        include_usage=not args.no_include_usage,
        ignore_eos=not args.no_ignore_eos,
        warmup=args.warmup,
        seed=args.seed,
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    summary = asyncio.run(run_benchmark(cfg))
    print(format_table(summary))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(json_safe(summary), f, indent=2)
        print(f"wrote {args.out}")
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Comparison code shared by the llama.cpp parity tests (`tests/test_llamacpp_parity.py` for
SmolLM2-135M Q4_1, `tests/models/test_gemma3_llamacpp_parity.py` for Gemma-3-270M Q4_K_M).

Each model has two golden files written by `scripts/make_llamacpp_golden.py` with
llama-cpp-python (so the tests need no compiler):

- `<model>_llamacpp_f32.json`: llama.cpp on the GGUF dequantized to F32 (F32 KV cache): the same
  weights as Paphos' float32 path and llama.cpp's graph. The bars of issue 7: greedy continuations
  identical on >= 90% of prompts, teacher-forced top-1 agreement >= 98%, mean |delta logprob| of
  the actual next token <= 0.05 (each test may hold itself to a tighter mean).
- `<model>_llamacpp.json`: llama.cpp on the quantized file as users run it. Its CPU kernels round
  activations to 8 bits before every quantized matmul and keep K/V in F16, so it differs from *any*
  float32 computation on the same weights, its own F32 run included. Against it Paphos must be no
  farther than llama.cpp's own F32 run is, plus a small slack; the bounds are derived from the two
  golden files, so they follow a regeneration.

Prompts are fed as the golden token ids (one batch), so tokenizer differences cannot confound the
model comparison; greedy continuations are compared up to the first end-of-generation token.
Every comparison prints per-prompt diagnostics (run pytest with `-s` to see them on success).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"

# Against llama.cpp's F32 run (issue 7).
GREEDY_MATCH_MIN = 0.90
TOP1_AGREEMENT_MIN = 0.98
MEAN_ABS_LOGPROB_DELTA_MAX = 0.05
# Against llama.cpp's quantized run: slack over the distance between llama.cpp's own F32 and
# quantized runs.
QUANT_TOP1_SLACK = 0.01
QUANT_DELTA_FACTOR = 1.15
QUANT_DELTA_SLACK = 0.005
QUANT_GREEDY_SLACK = 2  # prompts


def load_golden(path: Path) -> dict[str, Any]:
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/make_llamacpp_golden.py with llama-cpp-python")
    return json.loads(path.read_text(encoding="utf-8"))


def load_golden_pair(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(quantized, F32) golden files `tests/golden/<name>.json` and `<name>_f32.json`."""
    quant, f32 = load_golden(GOLDEN_DIR / f"{name}.json"), load_golden(GOLDEN_DIR / f"{name}_f32.json")
    assert f32["model_sha256"] == quant["model_sha256"], "the two golden files come from different models"
    assert [p["token_ids"] for p in f32["prompts"]] == [p["token_ids"] for p in quant["prompts"]]
    return quant, f32


def parity_engine_kwargs() -> dict[str, Any]:
    """LLM(...) settings of the parity runs: float32 (the F32 reference's arithmetic), and a KV
    cache sized for the golden prompts rather than the 4 GiB CPU default (zeroing that costs
    seconds on a small machine)."""
    return {"dtype": "float32", "max_model_len": 2048, "cpu_kv_cache_gb": 0.5}


@dataclass
class PromptResult:
    name: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    prompt_logprobs: list[Any]


def run_golden_prompts(llm: Any, golden: dict[str, Any]) -> list[PromptResult]:
    """Every golden prompt, fed as token ids in one `generate` call: greedy continuation of the
    golden's length (stopping at EOS as llama.cpp would) and the prompt's logprobs."""
    from paphos import SamplingParams

    params = SamplingParams(
        temperature=0, max_tokens=golden["greedy"]["max_tokens"], ignore_eos=False, prompt_logprobs=1
    )
    prompts = golden["prompts"]
    outs = llm.generate([p["token_ids"] for p in prompts], params)
    assert len(outs) == len(prompts)
    return [
        PromptResult(
            name=p["name"],
            prompt_ids=list(out.prompt_token_ids),
            output_ids=list(out.outputs[0].token_ids),
            output_text=out.outputs[0].text,
            prompt_logprobs=list(out.prompt_logprobs or []),
        )
        for p, out in zip(prompts, outs, strict=True)
    ]


# ---- comparisons (pure functions over golden entries and our results) -----------------------------


def until_eog(ids: list[int], eog: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eog:
            return ids[:i]
    return ids


def compare_greedy(
    got_by_prompt: list[list[int]], ref: dict[str, Any], texts: list[str] | None = None
) -> tuple[int, str]:
    """How many continuations equal the reference's (up to the first EOG), and a report."""
    eog = set(ref["eog_token_ids"])
    matched, lines = 0, []
    for i, (got_ids, p) in enumerate(zip(got_by_prompt, ref["prompts"], strict=True)):
        want, got = until_eog(p["greedy_ids"], eog), until_eog(got_ids, eog)
        if got == want:
            matched += 1
            lines.append(f"  ok   {p['name']:16s} {len(want)} tokens")
            continue
        k = next(
            (j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        margins = p["greedy_top1_margin"]
        margin = f"{margins[k]:.4f}" if k < len(margins) else "n/a"
        line = (
            f"  DIFF {p['name']:16s} diverges at step {k} (reference top-1 margin there {margin})\n"
            f"       reference {want}\n       paphos    {got}\n       reference {p['greedy_text']!r}"
        )
        if texts is not None:
            line += f"\n       paphos    {texts[i]!r}"
        lines.append(line)
    return matched, "\n".join(lines)


@dataclass
class ScoreStats:
    agree: int
    total: int
    mean_abs_delta: float
    report: str

    @property
    def agreement(self) -> float:
        return self.agree / self.total


def compare_scores(top1: list[list[int]], target_lp: list[list[float]], ref: dict[str, Any]) -> ScoreStats:
    """Teacher-forced comparison: per prompt, our top-1 id and our logprob of the actual next token
    at every position 0..n-2, against the reference's argmax ids and target logprobs."""
    agree = total = 0
    deltas_all: list[float] = []
    lines = []
    for ids, lps, p in zip(top1, target_lp, ref["prompts"], strict=True):
        n = p["num_tokens"] - 1
        deltas = [abs(a - b) for a, b in zip(lps, p["target_logprobs"], strict=True)]
        diffs = [
            f"pos {j + 1}: reference {p['argmax_ids'][j]} (margin {p['top1_margin'][j]:.4f}) paphos {ids[j]}"
            for j in range(n)
            if ids[j] != p["argmax_ids"][j]
        ]
        agree += n - len(diffs)
        total += n
        deltas_all += deltas
        lines.append(
            f"  {p['name']:16s} top-1 {n - len(diffs)}/{n}  mean|d| {sum(deltas) / max(1, n):.4f}"
            f"  max|d| {max(deltas, default=0.0):.4f}" + "".join(f"\n      {d}" for d in diffs[:8])
        )
    mean = sum(deltas_all) / len(deltas_all)
    head = f"top-1 agreement {agree}/{total} = {agree / total:.4f}; mean |delta logprob| {mean:.4f}"
    return ScoreStats(agree, total, mean, head + "\n" + "\n".join(lines))


def our_scores(
    results: list[PromptResult], golden: dict[str, Any]
) -> tuple[list[list[int]], list[list[float]]]:
    top1, target = [], []
    for res, p in zip(results, golden["prompts"], strict=True):
        n = p["num_tokens"]
        plp = res.prompt_logprobs
        assert len(plp) == n, f"{res.name}: {len(plp)} prompt_logprobs entries for {n} prompt tokens"
        assert plp[0] is None, f"{res.name}: prompt_logprobs[0] must be None"
        for j in range(1, n):
            assert plp[j].token_id == p["token_ids"][j], f"{res.name}[{j}]: entry is for the wrong token"
        top1.append([plp[j].top_token_ids[0] for j in range(1, n)])
        target.append([plp[j].logprob for j in range(1, n)])
    return top1, target


def ref_as_ours(ref: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
    return [p["argmax_ids"][:-1] for p in ref["prompts"]], [p["target_logprobs"] for p in ref["prompts"]]


# ---- the checks each model's test runs -------------------------------------------------------------


def check_tokenization(
    tokenizer: Any,
    golden: dict[str, Any],
    add_special: bool,
    key: str,
    known_differences: frozenset[str] = frozenset(),
) -> None:
    """`tokenizer.encode(text, add_special_tokens=add_special)` equals llama.cpp's ids under the
    flags `key` names, for every golden string. One rule of Paphos' differs on purpose: for a model
    that adds BOS, a text that starts with the BOS string gets one BOS, where llama.cpp's tokenize
    adds a second (and warns).
    `known_differences`: texts that must still differ (a fixed one fails, so the list is kept
    exact)."""
    bos = golden["bos_token_id"]
    adds_bos = add_special and golden["gguf_add_bos_token"]
    mismatches, differing = [], set()
    for case in golden["tokenization"]:
        want = list(case[key])
        if adds_bos and want[:2] == [bos, bos]:
            want = want[1:]
        got = list(tokenizer.encode(case["text"], add_special_tokens=add_special))
        if got != want:
            differing.add(case["text"])
            if case["text"] not in known_differences:
                mismatches.append(f"  {case['text']!r}\n    llama.cpp {want}\n    paphos    {got}")
    assert len(golden["tokenization"]) >= 30
    assert not mismatches, (
        f"add_special_tokens={add_special}: {len(mismatches)}/{len(golden['tokenization'])} strings tokenize "
        f"differently from llama.cpp {golden['tokenization_flags'][key]}:\n" + "\n".join(mismatches)
    )
    fixed = known_differences - differing
    assert not fixed, (
        f"now tokenized as llama.cpp does, drop them from the known differences: {sorted(fixed)}"
    )


def check_prompt_ids(results: list[PromptResult], golden: dict[str, Any]) -> None:
    for res, p in zip(results, golden["prompts"], strict=True):
        assert res.prompt_ids == p["token_ids"], f"{res.name}: the engine changed the prompt token ids"


def check_greedy_f32(results: list[PromptResult], golden_f32: dict[str, Any]) -> None:
    matched, report = compare_greedy(
        [r.output_ids for r in results], golden_f32, [r.output_text for r in results]
    )
    n = len(results)
    print(f"greedy vs llama.cpp F32: {matched}/{n} identical\n{report}")
    assert matched / n >= GREEDY_MATCH_MIN, f"only {matched}/{n} greedy continuations match:\n{report}"


def check_scores_f32(
    results: list[PromptResult],
    golden_f32: dict[str, Any],
    mean_delta_max: float = MEAN_ABS_LOGPROB_DELTA_MAX,
) -> None:
    stats = compare_scores(*our_scores(results, golden_f32), golden_f32)
    print("vs llama.cpp F32: " + stats.report)
    assert stats.agreement >= TOP1_AGREEMENT_MIN, stats.report
    assert stats.mean_abs_delta <= mean_delta_max, stats.report


def check_greedy_quant(
    results: list[PromptResult], golden: dict[str, Any], golden_f32: dict[str, Any]
) -> None:
    base, _ = compare_greedy([p["greedy_ids"] for p in golden_f32["prompts"]], golden)
    matched, report = compare_greedy(
        [r.output_ids for r in results], golden, [r.output_text for r in results]
    )
    need = max(0, base - QUANT_GREEDY_SLACK)
    print(
        f"greedy vs llama.cpp {golden['model_file']}: paphos {matched}, llama.cpp's own F32 run {base} "
        f"of {len(results)}\n{report}"
    )
    assert matched >= need, (
        f"{matched} greedy continuations match llama.cpp's quantized run, need >= {need}:\n{report}"
    )


def check_scores_quant(
    results: list[PromptResult], golden: dict[str, Any], golden_f32: dict[str, Any]
) -> None:
    base = compare_scores(*ref_as_ours(golden_f32), golden)
    stats = compare_scores(*our_scores(results, golden), golden)
    top1_min = base.agreement - QUANT_TOP1_SLACK
    delta_max = base.mean_abs_delta * QUANT_DELTA_FACTOR + QUANT_DELTA_SLACK
    report = (
        f"llama.cpp F32 vs quantized: top-1 {base.agreement:.4f}, mean |d| {base.mean_abs_delta:.4f} "
        f"-> need top-1 >= {top1_min:.4f}, mean |d| <= {delta_max:.4f}\npaphos vs quantized: {stats.report}"
    )
    print(report)
    assert stats.agreement >= top1_min, report
    assert stats.mean_abs_delta <= delta_max, report

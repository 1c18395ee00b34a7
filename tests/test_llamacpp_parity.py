"""Paphos against llama.cpp on the bundled default GGUF (SmolLM2-135M-Instruct Q4_1).

The reference numbers are golden files written by `scripts/make_llamacpp_golden.py` with
llama-cpp-python (so this test needs no compiler):

- `golden/smollm2_llamacpp_f32.json`: llama.cpp on the GGUF dequantized to F32 (F32 KV cache).
  Same weights as Paphos' float32 path, llama.cpp's graph. The parity bar: greedy continuations
  identical on >= 90% of prompts, teacher-forced top-1 agreement >= 98%, mean |delta logprob| of
  the actual next token <= 0.01 (measured: 21/21, 100%, < 1e-4).
- `golden/smollm2_llamacpp.json`: llama.cpp on the Q4_1 file as users run it. Its CPU kernels round
  activations to 8 bits (Q8_1) before every Q4_1 matmul and keep K/V in F16, so it differs from
  *any* float32 computation on the same weights, its own F32 run included (about 96% top-1
  agreement, 0.06 mean |delta logprob|, a third of greedy continuations identical). Against it
  Paphos must be no farther than llama.cpp's own F32 run is, plus a small slack; the bounds are
  derived from the two golden files, so they follow a regeneration.
- Tokenization (from the Q4_1 file): `encode(text, add_special_tokens=True)` equals llama.cpp's
  `tokenize(add_bos=True, special=True)`; `add_special_tokens=False` equals `tokenize(add_bos=False,
  special=True)`. Special-token text such as `<|im_start|>` is parsed as the special token in both
  Paphos modes (as HF tokenizers do and chat templates require); llama.cpp's `special=False` would
  split it into plain text, so the file's `nobos_plain` ids are recorded for reference only.

Prompts are fed as the golden token ids, so tokenizer differences cannot confound the model
comparison; greedy continuations are compared up to the first end-of-generation token. Every
comparison prints per-prompt diagnostics (run with `-s` to see them on success).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GOLDEN_DIR = Path(__file__).parent / "golden"
QUANT_GOLDEN = GOLDEN_DIR / "smollm2_llamacpp.json"
F32_GOLDEN = GOLDEN_DIR / "smollm2_llamacpp_f32.json"

# Against llama.cpp's F32 run.
GREEDY_MATCH_MIN = 0.90
TOP1_AGREEMENT_MIN = 0.98
MEAN_ABS_LOGPROB_DELTA_MAX = 0.01
# Against llama.cpp's Q4_1 run: slack over the distance between llama.cpp's own F32 and Q4_1 runs.
QUANT_TOP1_SLACK = 0.01
QUANT_DELTA_FACTOR = 1.15
QUANT_DELTA_SLACK = 0.005
QUANT_GREEDY_SLACK = 2  # prompts


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/make_llamacpp_golden.py with llama-cpp-python")
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    return _load(QUANT_GOLDEN)


@pytest.fixture(scope="module")
def golden_f32(golden: dict[str, Any]) -> dict[str, Any]:
    ref = _load(F32_GOLDEN)
    assert ref["model_sha256"] == golden["model_sha256"], "the two golden files come from different models"
    assert [p["token_ids"] for p in ref["prompts"]] == [p["token_ids"] for p in golden["prompts"]]
    return ref


@pytest.fixture(scope="module")
def llm(golden: dict[str, Any]) -> Any:
    from paphos import LLM, default_model

    path = Path(default_model.default_model_path())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == golden["model_sha256"], (
        f"bundled default model {path} (sha256 {digest}) is not the model the golden files were made "
        f"from ({golden['model_file']}, sha256 {golden['model_sha256']}): regenerate them"
    )
    return LLM(model=None, dtype="float32", max_model_len=2048)


@dataclass
class PromptResult:
    name: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_text: str
    prompt_logprobs: list[Any]


@pytest.fixture(scope="module")
def results(llm: Any, golden: dict[str, Any]) -> list[PromptResult]:
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


def _until_eog(ids: list[int], eog: set[int]) -> list[int]:
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
        want, got = _until_eog(p["greedy_ids"], eog), _until_eog(got_ids, eog)
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


def _our_scores(
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


def _ref_as_ours(ref: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
    return [p["argmax_ids"][:-1] for p in ref["prompts"]], [p["target_logprobs"] for p in ref["prompts"]]


# ---- tests -----------------------------------------------------------------------------------------


def _check_tokenization(llm: Any, golden: dict[str, Any], add_special: bool, key: str) -> None:
    mismatches = []
    for case in golden["tokenization"]:
        got = list(llm.tokenizer.encode(case["text"], add_special_tokens=add_special))
        if got != case[key]:
            mismatches.append(f"  {case['text']!r}\n    llama.cpp {case[key]}\n    paphos    {got}")
    assert len(golden["tokenization"]) >= 30
    assert not mismatches, (
        f"add_special_tokens={add_special}: {len(mismatches)}/{len(golden['tokenization'])} strings tokenize "
        f"differently from llama.cpp {golden['tokenization_flags'][key]}:\n" + "\n".join(mismatches)
    )


def test_tokenization_with_special_tokens(llm: Any, golden: dict[str, Any]) -> None:
    _check_tokenization(llm, golden, True, "add_bos_special")


def test_tokenization_without_special_tokens(llm: Any, golden: dict[str, Any]) -> None:
    _check_tokenization(llm, golden, False, "nobos_special")


def test_prompt_token_ids_pass_through(results: list[PromptResult], golden: dict[str, Any]) -> None:
    for res, p in zip(results, golden["prompts"], strict=True):
        assert res.prompt_ids == p["token_ids"], f"{res.name}: the engine changed the prompt token ids"


def test_greedy_matches_llamacpp_f32(results: list[PromptResult], golden_f32: dict[str, Any]) -> None:
    matched, report = compare_greedy(
        [r.output_ids for r in results], golden_f32, [r.output_text for r in results]
    )
    n = len(results)
    print(f"greedy vs llama.cpp F32: {matched}/{n} identical\n{report}")
    assert matched / n >= GREEDY_MATCH_MIN, f"only {matched}/{n} greedy continuations match:\n{report}"


def test_teacher_forced_matches_llamacpp_f32(results: list[PromptResult], golden_f32: dict[str, Any]) -> None:
    stats = compare_scores(*_our_scores(results, golden_f32), golden_f32)
    print("vs llama.cpp F32: " + stats.report)
    assert stats.agreement >= TOP1_AGREEMENT_MIN, stats.report
    assert stats.mean_abs_delta <= MEAN_ABS_LOGPROB_DELTA_MAX, stats.report


def test_greedy_close_to_llamacpp_q4(
    results: list[PromptResult], golden: dict[str, Any], golden_f32: dict[str, Any]
) -> None:
    base, _ = compare_greedy([p["greedy_ids"] for p in golden_f32["prompts"]], golden)
    matched, report = compare_greedy(
        [r.output_ids for r in results], golden, [r.output_text for r in results]
    )
    need = max(0, base - QUANT_GREEDY_SLACK)
    print(
        f"greedy vs llama.cpp Q4_1: paphos {matched}, llama.cpp's own F32 run {base} of {len(results)}\n{report}"
    )
    assert matched >= need, f"{matched} greedy continuations match llama.cpp Q4_1, need >= {need}:\n{report}"


def test_teacher_forced_close_to_llamacpp_q4(
    results: list[PromptResult], golden: dict[str, Any], golden_f32: dict[str, Any]
) -> None:
    base = compare_scores(*_ref_as_ours(golden_f32), golden)
    stats = compare_scores(*_our_scores(results, golden), golden)
    top1_min = base.agreement - QUANT_TOP1_SLACK
    delta_max = base.mean_abs_delta * QUANT_DELTA_FACTOR + QUANT_DELTA_SLACK
    report = (
        f"llama.cpp F32 vs Q4_1: top-1 {base.agreement:.4f}, mean |d| {base.mean_abs_delta:.4f} "
        f"-> need top-1 >= {top1_min:.4f}, mean |d| <= {delta_max:.4f}\npaphos vs Q4_1: {stats.report}"
    )
    print(report)
    assert stats.agreement >= top1_min, report
    assert stats.mean_abs_delta <= delta_max, report

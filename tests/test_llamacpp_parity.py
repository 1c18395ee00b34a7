"""Paphos against llama.cpp on the bundled default GGUF (SmolLM2-135M-Instruct Q4_1).

The reference numbers live in `tests/golden/smollm2_llamacpp.json`, written by
`scripts/make_llamacpp_golden.py` with llama-cpp-python (so this test needs no compiler). It checks,
through the offline API (`paphos.LLM`, float32):

- tokenization: `encode(text, add_special_tokens=True)` equals llama.cpp's
  `tokenize(add_bos=True, special=True)` and `add_special_tokens=False` equals
  `tokenize(add_bos=False, special=True)`, for every string. (Special-token text such as
  `<|im_start|>` is parsed as the special token in both Paphos modes, as HF tokenizers and chat
  templates require; llama.cpp's `special=False` would split it into plain text instead, so the
  golden file's `nobos_plain` ids are recorded for reference only.)
- greedy continuations (prompts fed as the golden token ids, so tokenizer differences cannot
  confound the comparison) identical on >= 90% of prompts, compared up to the first
  end-of-generation token;
- teacher-forced prompt scoring: top-1 agreement >= 98% over all positions and mean |delta logprob|
  of the actual next token <= 0.05.

llama.cpp multiplies Q4_1 weights with activations quantized to 8 bits, Paphos in float32, so
exact equality of logprobs is not expected; near-ties (small top-1 margins, recorded in the golden
file) explain most disagreements, and the diagnostics print them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GOLDEN_PATH = Path(__file__).parent / "golden" / "smollm2_llamacpp.json"

GREEDY_MATCH_MIN = 0.90
TOP1_AGREEMENT_MIN = 0.98
MEAN_ABS_LOGPROB_DELTA_MAX = 0.05


@pytest.fixture(scope="module")
def golden() -> dict[str, Any]:
    if not GOLDEN_PATH.exists():
        pytest.fail(f"{GOLDEN_PATH} is missing: run scripts/make_llamacpp_golden.py with llama-cpp-python")
    return json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def llm(golden: dict[str, Any]) -> Any:
    from paphos import LLM, default_model

    path = Path(default_model.default_model_path())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == golden["model_sha256"], (
        f"bundled default model {path} (sha256 {digest}) is not the model the golden file was made "
        f"from ({golden['model_file']}, sha256 {golden['model_sha256']}): regenerate the golden file"
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


def _until_eog(ids: list[int], eog: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eog:
            return ids[:i]
    return ids


def _check_tokenization(llm: Any, golden: dict[str, Any], add_special: bool, key: str) -> None:
    mismatches = []
    for case in golden["tokenization"]:
        got = list(llm.tokenizer.encode(case["text"], add_special_tokens=add_special))
        want = case[key]
        if got != want:
            mismatches.append(f"  {case['text']!r}\n    llama.cpp {want}\n    paphos    {got}")
    total = len(golden["tokenization"])
    assert not mismatches, (
        f"add_special_tokens={add_special}: {len(mismatches)}/{total} strings tokenize differently "
        f"from llama.cpp ({golden['tokenization_flags'][key]}):\n" + "\n".join(mismatches)
    )


def test_tokenization_with_special_tokens(llm: Any, golden: dict[str, Any]) -> None:
    _check_tokenization(llm, golden, True, "add_bos_special")


def test_tokenization_without_special_tokens(llm: Any, golden: dict[str, Any]) -> None:
    _check_tokenization(llm, golden, False, "nobos_special")


def test_prompt_token_ids_pass_through(results: list[PromptResult], golden: dict[str, Any]) -> None:
    for res, p in zip(results, golden["prompts"], strict=True):
        assert res.prompt_ids == p["token_ids"], f"{res.name}: the engine changed the prompt token ids"


def test_greedy_continuations_match(results: list[PromptResult], golden: dict[str, Any]) -> None:
    eog = set(golden["eog_token_ids"])
    matched, lines = 0, []
    for res, p in zip(results, golden["prompts"], strict=True):
        want = _until_eog(p["greedy_ids"], eog)
        got = _until_eog(res.output_ids, eog)
        if got == want:
            matched += 1
            lines.append(f"  ok   {res.name:16s} {len(want)} tokens")
            continue
        k = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want))
        )
        margin = p["greedy_top1_margin"][k] if k < len(p["greedy_top1_margin"]) else float("nan")
        lines.append(
            f"  DIFF {res.name:16s} diverges at step {k} (llama.cpp top-1 margin there {margin:.4f})\n"
            f"       llama.cpp {want}\n       paphos    {got}\n"
            f"       llama.cpp {p['greedy_text']!r}\n       paphos    {res.output_text!r}"
        )
    frac = matched / len(results)
    report = "\n".join(lines)
    print(f"greedy continuations identical: {matched}/{len(results)}\n{report}")
    assert frac >= GREEDY_MATCH_MIN, f"only {matched}/{len(results)} greedy continuations match:\n{report}"


def test_teacher_forced_logprobs_match(results: list[PromptResult], golden: dict[str, Any]) -> None:
    agree = total = 0
    abs_deltas: list[float] = []
    lines = []
    for res, p in zip(results, golden["prompts"], strict=True):
        n = p["num_tokens"]
        plp = res.prompt_logprobs
        assert len(plp) == n, f"{res.name}: {len(plp)} prompt_logprobs entries for {n} prompt tokens"
        assert plp[0] is None, f"{res.name}: prompt_logprobs[0] must be None"
        p_agree, p_deltas, diffs = 0, [], []
        for j in range(1, n):
            entry = plp[j]
            assert entry.token_id == p["token_ids"][j], f"{res.name}[{j}]: entry is for the wrong token"
            delta = abs(entry.logprob - p["target_logprobs"][j - 1])
            p_deltas.append(delta)
            if entry.top_token_ids[0] == p["argmax_ids"][j - 1]:
                p_agree += 1
            else:
                diffs.append(
                    f"pos {j}: llama.cpp {p['argmax_ids'][j - 1]} (margin {p['top1_margin'][j - 1]:.4f}) "
                    f"paphos {entry.top_token_ids[0]}"
                )
        agree += p_agree
        total += n - 1
        abs_deltas += p_deltas
        mean_d = sum(p_deltas) / max(1, len(p_deltas))
        lines.append(
            f"  {res.name:16s} top-1 {p_agree}/{n - 1}  mean|d| {mean_d:.4f}  max|d| {max(p_deltas, default=0):.4f}"
            + "".join(f"\n      {d}" for d in diffs[:8])
        )
    agreement = agree / total
    mean_delta = sum(abs_deltas) / len(abs_deltas)
    report = (
        f"top-1 agreement {agree}/{total} = {agreement:.4f}; mean |delta logprob| {mean_delta:.4f}\n"
        + "\n".join(lines)
    )
    print(report)
    assert agreement >= TOP1_AGREEMENT_MIN, report
    assert mean_delta <= MEAN_ABS_LOGPROB_DELTA_MAX, report

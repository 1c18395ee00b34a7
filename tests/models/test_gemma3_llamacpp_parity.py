"""Paphos against llama.cpp on Gemma-3-270M Q4_K_M (design.md §12; issue 7's parity bars).

The references are `tests/golden/gemma3_270m_llamacpp_f32.json` (llama.cpp on the GGUF
dequantized to F32, F32 KV cache) and `tests/golden/gemma3_270m_llamacpp.json` (llama.cpp on the
Q4_K_M file as users run it: 8-bit activations in its quantized matmuls, F16 K/V), written by
`scripts/make_llamacpp_golden.py --preset gemma3 [--f32-reference]`. The comparison code and the
quantized run's relative bounds are shared with SmolLM2's test (`tests/llamacpp_parity.py`).

The prompts (plain, chat in Gemma 3's template, code, non-English, two of more than 512 tokens,
so the local layers' sliding window is exercised) run as token ids in one float32 batch.
Tokenization: `encode` equals llama.cpp's `tokenize(add_bos=True/False, special=True)` on 54
strings, with two documented exceptions:
- a text starting with the BOS string `<bos>` gets one BOS in Paphos (its tokenizer rule), two in
  llama.cpp's raw tokenize (which warns about it; its chat path strips the template's BOS);
- a literal U+2581 (SentencePiece's space marker) typed in the text: llama.cpp keeps it apart from
  spaces (Gemma's whitespace-run tokens are matched on the raw text, before escaping), transformers'
  converted tokenizer normalises spaces to U+2581 first and so merges both alike.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from tests import llamacpp_parity as parity

MEAN_ABS_LOGPROB_DELTA_MAX = 0.01  # the issue's bar is 0.05; measured about 7e-4
KNOWN_TOKENIZATION_DIFFERENCES = frozenset({"\u2581 lower one eighth block (SentencePiece's space)"})


@pytest.fixture(scope="module")
def goldens() -> tuple[dict[str, Any], dict[str, Any]]:
    return parity.load_golden_pair("gemma3_270m_llamacpp")


@pytest.fixture(scope="module")
def golden(goldens: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    return goldens[0]


@pytest.fixture(scope="module")
def golden_f32(goldens: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    return goldens[1]


@pytest.fixture(scope="module")
def llm(gemma3_270m_path: Path, golden: dict[str, Any]) -> Any:
    from paphos import LLM

    digest = hashlib.sha256(gemma3_270m_path.read_bytes()).hexdigest()
    assert digest == golden["model_sha256"], (
        f"{gemma3_270m_path} is not the file the golden files were made from"
    )
    return LLM(model=str(gemma3_270m_path), **parity.parity_engine_kwargs())


@pytest.fixture(scope="module")
def results(llm: Any, golden: dict[str, Any]) -> list[parity.PromptResult]:
    return parity.run_golden_prompts(llm, golden)


def test_golden_covers_the_issue(golden: dict[str, Any]) -> None:
    kinds = {p["kind"] for p in golden["prompts"]}
    assert {"plain", "chat", "code", "non_english", "long"} <= kinds
    assert max(p["num_tokens"] for p in golden["prompts"]) > 512  # past the sliding window
    assert golden["gguf_add_bos_token"] and all(
        p["token_ids"][0] == golden["bos_token_id"] for p in golden["prompts"]
    )


def test_tokenization_with_special_tokens(llm: Any, golden: dict[str, Any]) -> None:
    parity.check_tokenization(llm.tokenizer, golden, True, "add_bos_special", KNOWN_TOKENIZATION_DIFFERENCES)


def test_tokenization_without_special_tokens(llm: Any, golden: dict[str, Any]) -> None:
    parity.check_tokenization(llm.tokenizer, golden, False, "nobos_special", KNOWN_TOKENIZATION_DIFFERENCES)


def test_prompt_token_ids_pass_through(results: list[parity.PromptResult], golden: dict[str, Any]) -> None:
    parity.check_prompt_ids(results, golden)


def test_greedy_matches_llamacpp_f32(results: list[parity.PromptResult], golden_f32: dict[str, Any]) -> None:
    parity.check_greedy_f32(results, golden_f32)


def test_teacher_forced_matches_llamacpp_f32(
    results: list[parity.PromptResult], golden_f32: dict[str, Any]
) -> None:
    parity.check_scores_f32(results, golden_f32, MEAN_ABS_LOGPROB_DELTA_MAX)


def test_greedy_close_to_llamacpp_q4_k_m(
    results: list[parity.PromptResult], golden: dict[str, Any], golden_f32: dict[str, Any]
) -> None:
    parity.check_greedy_quant(results, golden, golden_f32)


def test_teacher_forced_close_to_llamacpp_q4_k_m(
    results: list[parity.PromptResult], golden: dict[str, Any], golden_f32: dict[str, Any]
) -> None:
    parity.check_scores_quant(results, golden, golden_f32)

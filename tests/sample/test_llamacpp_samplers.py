"""Cross-check against llama.cpp's samplers on the same fixed logits (contract §4.4): same
surviving token sets for top-k, top-p, min-p, typical, top-nσ, XTC and mirostat v1/v2, the same
logits after temperature and DRY, and the same mirostat mu update for llama.cpp's selected token.

The reference is the committed golden file `golden/llamacpp_samplers.json`, written by
`scripts/make_llamacpp_sampler_golden.py` with llama-cpp-python (not a dependency: the test only
reads the JSON). A missing golden file is an error, not a skip.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from paphos.sample.ops.dry import apply_dry
from paphos.sample.ops.min_p import apply_min_p
from paphos.sample.ops.mirostat import apply_mirostat, update_mu
from paphos.sample.ops.temperature import apply_temperature
from paphos.sample.ops.top_k_top_p import apply_top_k_top_p
from paphos.sample.ops.top_nsigma import apply_top_nsigma
from paphos.sample.ops.typical_p import apply_typical_p
from paphos.sample.ops.xtc import apply_xtc

GOLDEN = Path(__file__).parent / "golden" / "llamacpp_samplers.json"
REFERENCE = json.loads(GOLDEN.read_text())
CASES: list[dict] = REFERENCE["cases"]


def one(value: float) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32)


def ours(case: dict, history: list[int]) -> torch.Tensor:
    x = torch.tensor([case["logits"]], dtype=torch.float32)
    p, name, vocab = case["params"], case["sampler"], len(case["logits"])
    if name == "top_k":
        return apply_top_k_top_p(x, torch.tensor([p["k"]]), None)
    if name == "top_p":
        return apply_top_k_top_p(x, None, one(p["p"]))
    if name == "min_p":
        return apply_min_p(x, one(p["p"]))
    if name == "typical":
        return apply_typical_p(x, one(p["p"]))
    if name == "temperature":
        return apply_temperature(x, one(p["t"]))
    if name == "top_n_sigma":
        return apply_top_nsigma(x, one(p["n"]))
    if name == "xtc":
        return apply_xtc(x, one(p["threshold"]), one(1.0), one(0.0))
    if name == "dry":
        return apply_dry(
            x, torch.tensor([history]), torch.tensor([[-1]]), one(p["multiplier"]), one(p["base"]),
            one(p["allowed_length"]), torch.tensor([max(p["penalty_last_n"], 0)]), torch.tensor([50]),
            torch.tensor([0]), torch.tensor([0]), max_k=len(history),
        )
    mode = torch.tensor([1 if name == "mirostat" else 2])
    return apply_mirostat(x, mode, one(case["mu_before"]), vocab)


def test_golden_covers_every_sampler() -> None:
    names = {case["sampler"] for case in CASES}
    assert names == {"top_k", "top_p", "min_p", "typical", "temperature", "top_n_sigma", "xtc", "dry",
                     "mirostat", "mirostat_v2"}


@pytest.mark.parametrize("index", range(len(CASES)))
def test_matches_llamacpp(index: int) -> None:
    case = CASES[index]
    out = ours(case, REFERENCE["history"])[0]
    survivors = sorted(torch.nonzero(torch.isfinite(out)).flatten().tolist())
    assert survivors == case["survivors"], case["sampler"]
    if case["sampler"] in ("temperature", "dry"):
        expected = torch.tensor([v if v is not None else -math.inf for v in case["out_logits"]])
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    if case["sampler"].startswith("mirostat"):
        mode = torch.tensor([1 if case["sampler"] == "mirostat" else 2])
        mu = update_mu(out.unsqueeze(0), torch.tensor([case["selected"]]), mode, one(case["mu_before"]),
                       one(case["params"]["tau"]), one(case["params"]["eta"]))
        assert float(mu[0]) == pytest.approx(case["mu_after"], abs=1e-3)

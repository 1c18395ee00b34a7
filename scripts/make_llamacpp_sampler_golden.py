"""Write llama.cpp's sampler results on fixed logits: the reference of
`tests/sample/test_llamacpp_samplers.py` (contract §4.4 cross-check).

Run with a Python that has `llama-cpp-python` (not the project venv, it needs nothing of Paphos):

    /path/to/venv-with-llama-cpp/bin/python scripts/make_llamacpp_sampler_golden.py \
        [--model ~/.cache/paphos/models/SmolLM2-135M-Instruct.Q4_1.gguf] [--out PATH]

For each case it builds a `llama_token_data_array` over VOCAB tokens from seeded random logits,
applies one llama.cpp sampler (the low-level `llama_sampler_init_*` API) and records the ids that
survive (those left in the array with a finite logit), the resulting logits, and for mirostat the
selected token, its renormalised probability and mu before/after. DRY is fed the case's history
with `llama_sampler_accept` and needs a vocabulary, taken from the GGUF (`vocab_only`); no
sequence breakers are used, so its single-token semantics match the contract's. Its windows are
explicit (`penalty_last_n` > 0): llama.cpp's -1 ("context size") has no context size to refer to in
the vocab-only API of llama-cpp-python >= 0.3.x and then penalises nothing.
The samplers whose semantics match the contract: top-k, top-p, min-p, typical, temperature, DRY,
XTC (probability 1, so its coin never decides), mirostat v1/v2, top-nσ.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
from pathlib import Path

import llama_cpp
import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tests" / "sample" / "golden" / "llamacpp_samplers.json"
DEFAULT_MODEL = Path.home() / ".cache" / "paphos" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
VOCAB = 64
SEEDS = range(4)
# The last token 4 was followed by 10, 11, 12 and 13 after matches of length 4, 3, 2 and 1; a window
# of 19 cuts the longest match to 2.
HISTORY = [1, 2, 3, 4, 10, 9, 2, 3, 4, 11, 8, 3, 4, 12, 7, 4, 13, 1, 2, 3, 4]

# (sampler name, params) -> built by `make_sampler`; each runs on every seed's logits.
CASES = [
    ("top_k", {"k": 5}), ("top_k", {"k": 1}), ("top_p", {"p": 0.8}), ("top_p", {"p": 0.3}),
    ("min_p", {"p": 0.1}), ("min_p", {"p": 0.4}), ("typical", {"p": 0.7}), ("typical", {"p": 0.3}),
    ("temperature", {"t": 0.7}), ("temperature", {"t": 1.8}), ("top_n_sigma", {"n": 1.0}),
    ("top_n_sigma", {"n": 2.0}), ("xtc", {"threshold": 0.05}), ("xtc", {"threshold": 0.1}),
    ("dry", {"multiplier": 0.8, "base": 1.75, "allowed_length": 2, "penalty_last_n": 32}),
    ("dry", {"multiplier": 1.5, "base": 2.0, "allowed_length": 1, "penalty_last_n": 12}),
    ("dry", {"multiplier": 1.0, "base": 1.5, "allowed_length": 2, "penalty_last_n": 19}),
    ("mirostat", {"tau": 5.0, "eta": 0.1, "m": 100}), ("mirostat", {"tau": 3.0, "eta": 0.3, "m": 100}),
    ("mirostat_v2", {"tau": 5.0, "eta": 0.1}), ("mirostat_v2", {"tau": 2.0, "eta": 0.3}),
]


def make_sampler(name: str, params: dict, vocab) -> ctypes.c_void_p:
    if name == "top_k":
        return llama_cpp.llama_sampler_init_top_k(params["k"])
    if name == "top_p":
        return llama_cpp.llama_sampler_init_top_p(params["p"], 1)
    if name == "min_p":
        return llama_cpp.llama_sampler_init_min_p(params["p"], 1)
    if name == "typical":
        return llama_cpp.llama_sampler_init_typical(params["p"], 1)
    if name == "temperature":
        return llama_cpp.llama_sampler_init_temp(params["t"])
    if name == "top_n_sigma":
        return llama_cpp.llama_sampler_init_top_n_sigma(params["n"])
    if name == "xtc":
        return llama_cpp.llama_sampler_init_xtc(1.0, params["threshold"], 1, 1234)
    if name == "dry":
        args = (params["multiplier"], params["base"], params["allowed_length"], params["penalty_last_n"], None, 0)
        # llama.cpp dropped the `n_ctx_train` argument (b4xxx); older bindings still take it
        if len(llama_cpp.llama_sampler_init_dry.argtypes) == 8:  # noqa: PLR2004
            args = (4096, *args)
        return llama_cpp.llama_sampler_init_dry(vocab, *args)
    if name == "mirostat":
        return llama_cpp.llama_sampler_init_mirostat(VOCAB, 1234, params["tau"], params["eta"], params["m"])
    if name == "mirostat_v2":
        return llama_cpp.llama_sampler_init_mirostat_v2(1234, params["tau"], params["eta"])
    raise ValueError(name)


def run_case(name: str, params: dict, logits: np.ndarray, vocab) -> dict:
    data = (llama_cpp.llama_token_data * VOCAB)()
    for i, value in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(value), 0.0
    array = llama_cpp.llama_token_data_array(
        ctypes.cast(data, ctypes.POINTER(llama_cpp.llama_token_data)), VOCAB, -1, False
    )
    sampler = make_sampler(name, params, vocab)
    if name == "dry":
        for token in HISTORY:
            llama_cpp.llama_sampler_accept(sampler, token)
    llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
    out_logits = [-math.inf] * VOCAB
    for i in range(array.size):
        entry = array.data[i]
        out_logits[entry.id] = entry.logit
    record = {
        "sampler": name, "params": params, "logits": [float(v) for v in logits],
        "survivors": sorted(i for i, v in enumerate(out_logits) if v != -math.inf),
        "out_logits": [v if v != -math.inf else None for v in out_logits],
    }
    if name.startswith("mirostat"):
        selected = array.data[array.selected]
        mu_before = 2 * params["tau"]
        surprise = -math.log2(selected.p)
        record |= {"selected": selected.id, "p_selected": selected.p, "mu_before": mu_before,
                   "mu_after": mu_before - params["eta"] * (surprise - params["tau"])}
    llama_cpp.llama_sampler_free(sampler)
    return record


def load_vocab(model: Path):
    llm = llama_cpp.Llama(str(model), vocab_only=True, verbose=False)
    model_ptr = llm._model.model  # noqa: SLF001 - the raw llama_model pointer
    return llm, llama_cpp.llama_model_get_vocab(model_ptr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="GGUF whose vocabulary DRY needs")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    keep_alive, vocab = load_vocab(args.model)
    records = []
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        logits = (rng.standard_normal(VOCAB) * 2.5).astype(np.float32)
        records += [run_case(name, params, logits, vocab) for name, params in CASES]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "generator": f"llama-cpp-python {llama_cpp.__version__}", "vocab": VOCAB, "history": HISTORY,
        "cases": records,
    }, indent=1))
    del keep_alive
    print(f"wrote {len(records)} cases to {args.out}")


if __name__ == "__main__":
    main()

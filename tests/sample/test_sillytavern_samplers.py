"""Every sampler field SillyTavern sends for its `aphrodite` text-completion type (contract §6.1),
with non-neutral values, against the real server on the bundled default model: HTTP 200, and the
fields take effect (banned strings absent, token bans honoured, seeded output reproducible, the
mirostat and KoboldCpp-order forms accepted, chat honours the samplers too)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.spawn import NAME

PROMPT = "User: Tell me a story about a dragon.\nAssistant:"
EVERY_FIELD = {
    "model": NAME, "prompt": PROMPT, "max_tokens": 10, "max_new_tokens": 10, "logprobs": 10, "n": 2,
    "stream": False, "temperature": 0.8, "temperature_last": True, "top_p": 0.95, "typical_p": 0.98, "typical": 0.98,
    "min_p": 0.02, "top_k": 60, "top_a": 0.05, "tfs": 0.98, "skew": 0.1, "smoothing_factor": 0.2,
    "smoothing_curve": 1.5, "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1,
    "min_tokens": 2, "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 256,
    "dry_sequence_breakers": json.dumps(["\n", ":", "\"", "*"]), "stop": ["\nUser:"], "stopping_strings": ["\nUser:"],
    "truncation_length": 2048, "max_tokens_second": 0, "add_bos_token": True, "ban_eos_token": True,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "ignore_eos": False, "early_stopping": False,
    "include_stop_str_in_output": False, "eta_cutoff": 3, "epsilon_cutoff": 3, "mirostat_mode": 0,
    "mirostat_tau": 5, "mirostat_eta": 0.1, "xtc_threshold": 0.1, "xtc_probability": 0.5, "custom_token_bans": [],
    "banned_strings": ["Once upon"], "logit_bias": {"28": -3}, "seed": 1234, "sampler_seed": 1234,
    "guided_grammar": "", "guided_json": {}, "dynatemp_min": 0.6, "dynatemp_max": 1.0, "dynatemp_exponent": 1.0,
    "dynamic_temperature": True, "dynatemp_low": 0.6, "dynatemp_high": 1.0, "dynatemp_range": 0.2, "nsigma": 2.5,
    "top_n_sigma": 2.5, "no_repeat_ngram_size": 4, "sampler_priority": ["dry", "temperature", "min_p"],
    "include_reasoning": True, "min_keep": 0, "adaptive_target": 0, "adaptive_decay": 0, "api_type": "aphrodite",
    "api_server": "http://127.0.0.1:2242",
}


@pytest.fixture(scope="module")
def base(spawned_server: str) -> str:
    return spawned_server


def complete(base: str, **overrides) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={**EVERY_FIELD, **overrides}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_field_is_accepted_and_takes_effect(base: str) -> None:
    plain = complete(base, banned_strings=[], seed=7, prompt="User: Say 'Once upon a time'.\nAssistant: Once")
    first = complete(base)
    again = complete(base)
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]  # seeded, XTC included
    for choice in first["choices"]:
        assert "once upon" not in choice["text"].lower()
        assert len(choice["logprobs"]["tokens"]) >= 2  # min_tokens with ban_eos_token
    assert plain["choices"][0]["text"]
    # Token bans, as a comma string: the greedy first token disappears.
    greedy = complete(base, temperature=0, n=1, sampler_priority=[], banned_strings=[], logit_bias={})
    token = greedy["choices"][0]["logprobs"]["tokens"][0]
    ids = httpx.post(f"{base}/v1/tokenize", json={"model": NAME, "prompt": token, "add_special_tokens": False}).json()
    banned = complete(base, temperature=0, n=1, sampler_priority=[], banned_strings=[], logit_bias={},
                      custom_token_bans=",".join(str(i) for i in ids["tokens"]))
    assert banned["choices"][0]["logprobs"]["tokens"][0] != token


def test_mirostat_kobold_order_and_chat(base: str) -> None:
    for overrides in ({"mirostat_mode": 2, "mirostat_tau": 4.0}, {"mirostat_mode": 1},
                      {"sampler_priority": [], "sampler_order": [6, 0, 1, 3, 4, 2, 5]}):
        a, b = complete(base, **overrides), complete(base, **overrides)
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    body = {k: v for k, v in EVERY_FIELD.items() if k not in ("prompt", "logprobs")}
    r = httpx.post(f"{base}/v1/chat/completions", json={
        **body, "messages": [{"role": "user", "content": "Reply with a JSON object."}], "guided_json": None,
        "response_format": {"type": "json_object"}, "banned_strings": [], "max_tokens": 12,
    }, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("{")


def test_validation_errors_name_the_field(base: str) -> None:
    for overrides, param in (({"sampler_priority": ["bogus"]}, "sampler_priority"),
                             ({"dry_sequence_breakers": "[1"}, "dry_sequence_breakers"),
                             ({"guided_regex": "(", "guided_grammar": ""}, "guided_regex")):
        r = httpx.post(f"{base}/v1/completions", json={**EVERY_FIELD, **overrides}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param

"""Replays what SillyTavern sends for its `aphrodite`, `koboldcpp` and Kobold-classic API types
(contract §6) against the real server, and checks what SillyTavern reads back.

Payloads follow the contract's field lists, with the sampler values a SillyTavern preset sends
(repetition penalty, DRY, XTC, KoboldCpp sampler order), so every field goes through the samplers.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.spawn import NAME
from tests.server.test_spawned_kobold import kobold_events, wait_idle, wait_running

ERROR_KEYS = {"message", "error", "detail"}

# Fields every text-completion type sends (§6.1).
COMMON = {
    "max_tokens": 6, "max_new_tokens": 6, "temperature": 0.7, "temperature_last": False, "top_p": 0.95, "top_k": 40,
    "typical_p": 1, "typical": 1, "min_p": 0.05, "top_a": 0, "tfs": 1, "skew": 0, "smoothing_factor": 0,
    "smoothing_curve": 1, "repetition_penalty": 1.1, "frequency_penalty": 0, "presence_penalty": 0, "min_tokens": 0,
    "dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 0,
    "dry_sequence_breakers": json.dumps(["\n", ":", "\"", "*"]), "stop": ["\nUser:"], "stopping_strings": ["\nUser:"],
    "truncation_length": 2048, "max_tokens_second": 0, "add_bos_token": True, "ban_eos_token": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "ignore_eos": False, "early_stopping": False,
    "include_stop_str_in_output": False, "eta_cutoff": 0, "epsilon_cutoff": 0, "mirostat_mode": 0,
    "mirostat_tau": 5, "mirostat_eta": 0.1, "xtc_threshold": 0.1, "xtc_probability": 0.5, "banned_strings": [],
    "seed": 1234, "sampler_seed": 1234, "guided_grammar": "", "guided_json": {}, "nsigma": 0, "top_n_sigma": 0,
    "no_repeat_ngram_size": 0, "sampler_priority": [], "include_reasoning": True, "min_keep": 0,
    "adaptive_target": 0, "adaptive_decay": 0, "api_server": "http://127.0.0.1:2242",
}
APHRODITE = {**COMMON, "model": NAME, "api_type": "aphrodite", "custom_token_bans": [], "logprobs": 10, "n": 1}
# koboldcpp type: no model, KoboldCpp spellings and sampler ids, bans as a comma string, seed -1.
KOBOLDCPP = {
    **COMMON, "seed": -1, "sampler_order": [6, 0, 1, 3, 4, 2, 5], "grammar": "", "grammar_retain_state": False,
    "trim_stop": True, "rep_pen": 1.1, "rep_pen_range": 1024, "repetition_penalty_range": 1024, "rep_pen_slope": 1,
    "custom_token_bans": "", "mirostat": 0, "repeat_penalty": 1.1, "tfs_z": 1, "repeat_last_n": 0, "n_probs": 10, "n_predict": 6,
    "num_predict": 6, "num_ctx": 2048, "guidance_scale": 1, "negative_prompt": "", "grammar_string": "",
    "logit_bias": {},
}
PROMPT = "User: Tell me a story.\nAssistant:"


@pytest.fixture(scope="module")
def base(spawned_server: str) -> str:
    # SillyTavern strips a trailing /v1 and swaps localhost for 127.0.0.1; spawned_server is that form.
    return spawned_server


def _headers(key: str = "sk-saved") -> dict[str, str]:
    # With a saved key the aphrodite type sends both header styles (auth is off on this server).
    return {"Content-Type": "application/json", "X-API-KEY": key, "Authorization": f"Bearer {key}"}


def _stream_chunks(base: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=_headers(), timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.read().decode().split("\n") if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    for chunk in chunks:
        assert not ERROR_KEYS & set(chunk), chunk  # SillyTavern would end the stream as an error
    return chunks


def test_aphrodite_type(base):
    models = httpx.get(f"{base}/v1/models", headers=_headers())
    assert models.status_code == 200 and isinstance(models.json()["data"], list)
    assert models.json()["data"][0]["id"] == NAME

    r = httpx.post(f"{base}/v1/completions", json={**APHRODITE, "prompt": PROMPT, "n": 2}, headers=_headers(),
                   timeout=120)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and all(isinstance(c["text"], str) for c in choices)  # swipes
    logprobs = choices[0]["logprobs"]
    # text_offset counts from 0 within the completion; top_logprobs are {token: logprob} objects.
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert all(o <= len(choices[0]["text"]) for o in logprobs["text_offset"])
    assert all(isinstance(t, dict) and t and all(isinstance(v, float) for v in t.values())
               for t in logprobs["top_logprobs"])

    chunks = _stream_chunks(base, {**APHRODITE, "prompt": PROMPT, "n": 2, "stream": True})
    swipes: dict[int, str] = {}
    for chunk in chunks:
        assert len(chunk["choices"]) == 1  # exactly one choice per chunk
        choice = chunk["choices"][0]
        swipes[choice["index"]] = swipes.get(choice["index"], "") + choice["text"]
        tops = (choice["logprobs"] or {}).get("top_logprobs") or []
        assert all(isinstance(t, dict) for t in tops)
    assert set(swipes) == {0, 1}

    tokens = httpx.post(f"{base}/v1/tokenize", json={"model": NAME, "prompt": PROMPT}, headers=_headers()).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0


def test_koboldcpp_type(base):
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == NAME
    r = httpx.post(f"{base}/v1/completions", json={**KOBOLDCPP, "prompt": PROMPT}, timeout=120)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["choices"][0]["text"], str) and r.json()["model"] == NAME
    chunks = _stream_chunks(base, {**KOBOLDCPP, "prompt": PROMPT, "stream": True})
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    count = httpx.post(f"{base}/api/extra/tokencount", json={"prompt": PROMPT}).json()
    assert isinstance(count["value"], int) and len(count["ids"]) == count["value"]
    # Abort on disconnect: a bodiless POST, answered 200 even with nothing to abort.
    r = httpx.post(f"{base}/api/extra/abort")
    assert r.status_code == 200 and r.json() == {"success": False}


def test_kobold_classic(base):
    api = f"{base}/api"
    assert httpx.get(f"{api}/v1/info/version").json()["result"] == "1.2.4"
    assert httpx.get(f"{api}/extra/version").json()["result"] == "KoboldCpp"
    model = httpx.get(f"{api}/v1/model").json()["result"]
    assert model != "ReadOnly" and model.endswith(NAME)

    preset = {
        "prompt": PROMPT, "use_story": False, "use_memory": False, "use_authors_note": False, "use_world_info": False,
        "max_context_length": 1024, "max_length": 6, "rep_pen": 1.1, "rep_pen_range": 1024, "rep_pen_slope": 1,
        "temperature": 0.7, "tfs": 1, "top_a": 0, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "typical": 1,
        "sampler_order": [6, 0, 1, 3, 4, 2, 5], "singleline": False, "use_default_badwordsids": False, "mirostat": 0, "mirostat_eta": 0.1,
        "mirostat_tau": 5, "grammar": "", "sampler_seed": 7, "stop_sequence": ["\nUser:"],
    }
    r = httpx.post(f"{api}/v1/generate", json=preset, timeout=120)
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["results"][0]["text"], str)
    gui = {k: preset[k] for k in ("prompt", "use_story", "use_memory", "use_authors_note", "use_world_info",
                                  "max_context_length", "max_length")}
    assert httpx.post(f"{api}/v1/generate", json=gui, timeout=120).json()["results"][0]["finish_reason"]
    with httpx.stream("POST", f"{api}/extra/generate/stream", json=preset, timeout=120) as stream:
        events = kobold_events(stream.read().decode())
    assert events[-1]["finish_reason"] in ("stop", "length")
    same_seed = httpx.post(f"{api}/v1/generate", json=preset, timeout=120).json()["results"][0]["text"]
    assert "".join(e["token"] for e in events) == same_seed  # sampler_seed makes the stream reproducible
    bad = httpx.post(f"{api}/v1/generate", json={**gui, "max_length": 2000}, timeout=120)
    assert bad.status_code == 400 and bad.json()["detail"]["msg"]  # shown by SillyTavern
    assert httpx.post(f"{api}/extra/tokencount", json={"prompt": "hello"}).json()["value"] > 0

    # Abort: a bodiless POST stops this client's running generation.
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "r", httpx.post(f"{api}/v1/generate", json={**gui, "max_length": 800, "bypass_eos": True}, timeout=120)))
    with httpx.Client(base_url=base) as http:
        wait_idle(http)
        worker.start()
        wait_running(http)
        deadline = time.monotonic() + 30
        while not http.post("/api/extra/generate/check").json()["results"][0]["text"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    assert httpx.post(f"{api}/extra/abort").json() == {"success": True}
    worker.join(60)
    assert result["r"].json()["results"][0]["finish_reason"] == "abort"

"""Kobold API against the fake engine: field translation, truncation, errors with `detail`, genkey
check/abort, stream framing. (Exact shapes against the real model: test_spawned_kobold.py.)"""

from __future__ import annotations

import json
import threading
import time

import pytest

from paphos.server.kobold.protocol import KOBOLD_TO_OPENAI
from tests.server.fakes import assert_error_shape


def _params(engine):
    return engine.calls[-1][2]


def _kobold_error(response, status: int, param=...) -> dict:
    body = assert_error_shape(response, status, param=param)
    assert body["detail"] == {"msg": body["message"], "type": body["type"]}
    return body


def test_generate_shape_and_defaults(client, engine):
    r = client.post("/api/v1/generate", json={"prompt": "hi"})
    assert r.status_code == 200
    assert r.json() == {"results": [{"text": "abcdefghijklmnopqrstuvwxyz" * 7 + "abcdefghijklmnopqr",
                                     "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 200}]}
    params = _params(engine)
    # Kobold defaults: max_length 200, temperature 1, trim_stop (stop string not in the output).
    assert params.max_tokens == 200 and params.temperature == 1.0 and not params.include_stop_str_in_output
    assert engine.calls[-1][1] == [1, ord("h"), ord("i")]  # BOS + prompt


def test_field_translation_reaches_sampling_params(client, engine):
    body = {
        "prompt": "hi", "max_length": 3, "temperature": 0.5, "top_k": 5, "top_p": 0.9, "min_p": 0.1,
        "sampler_seed": 7, "stop_sequence": ["\n\n", "User:"], "trim_stop": False, "bypass_eos": True,
        "render_special": True, "n": 2,
        # Neutral values of the extended samplers pass whatever this server implements.
        "rep_pen": 1.0, "rep_pen_range": 0, "rep_pen_slope": 1, "typical": 1, "tfs": 1, "top_a": 0,
        "eps_cutoff": 0, "eta_cutoff": 0, "mirostat": 0, "dry_multiplier": 0, "dry_penalty_last_n": 0,
        "xtc_probability": 0, "nsigma": 0, "smoothing_factor": 0, "presence_penalty": 0, "dynatemp_range": 0,
        "banned_tokens": [], "custom_token_bans": "", "logit_bias": {}, "grammar": "", "sampler_order": [],
        "use_story": False, "singleline": False, "quiet": True,
    }
    r = client.post("/api/v1/generate", json=body)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["text"] for x in results] == ["abc", "bcd"]
    p = _params(engine)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed, p.n) == (0.5, 5, 0.9, 0.1, 7, 2)
    assert p.stop == ["\n\n", "User:"] and p.include_stop_str_in_output and p.ignore_eos
    assert not p.skip_special_tokens and p.max_tokens == 3
    # Kobold temperature 0 is greedy (Aphrodite 0.2x sampled at T = 1).
    assert client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 1, "temperature": 0}).status_code == 200
    assert _params(engine).temperature == 0.0


def test_translation_table_targets_are_openai_fields():
    from paphos.server.openai.protocol import CompletionRequest

    fields = set(CompletionRequest.model_fields)
    assert {target for target, _ in KOBOLD_TO_OPENAI.values()} <= fields
    assert KOBOLD_TO_OPENAI["rep_pen"][0] == "repetition_penalty"
    assert KOBOLD_TO_OPENAI["stop_sequence"][0] == "stop"


def test_openai_name_wins_over_kobold_name(client, engine):
    client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 1, "seed": 3, "sampler_seed": 9})
    assert _params(engine).seed == 3
    client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 1, "sampler_seed": -1})
    assert _params(engine).seed is None  # -1 = random


def test_non_neutral_unknown_sampler_goes_through_shared_validation(client, engine):
    """A Kobold sampler lands under its OpenAI name, so a 400 names that field like /v1 does."""
    r = client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 1, "top_p": 0})
    _kobold_error(r, 400, param="top_p")
    openai = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "top_p": 0})
    assert openai.json()["message"] == r.json()["message"]


def test_context_truncation_keeps_memory(client, engine):
    body = {"prompt": "0123456789", "memory": "MEM", "max_context_length": 10, "max_length": 3}
    assert client.post("/api/v1/generate", json=body).status_code == 200
    # 10 - 3 = 7 input tokens: BOS + "MEM" kept, the oldest prompt characters dropped.
    assert engine.calls[-1][1] == [1, *map(ord, "MEM"), *map(ord, "789")]
    r = client.post("/api/v1/generate", json={"prompt": "abc", "max_context_length": 10_000, "max_length": 4})
    assert r.status_code == 200 and r.json()["results"][0]["prompt_tokens"] == 4
    r = client.post("/api/v1/generate", json={"prompt": "x" * 300})  # longer than the 256 context: cut
    assert r.status_code == 200 and r.json()["results"][0]["prompt_tokens"] == 256 - 200


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "max_length": 20, "max_context_length": 10}, "max_length"),
    ({"prompt": "hi", "max_length": 0}, "max_length"),
    ({"max_length": 4}, "prompt"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "images": ["aGk="]}, "images"),
    ({"prompt": "hi", "lora": "x"}, "lora"),
    ({"prompt": "hi", "trim_stop": "maybe"}, "trim_stop"),
    ({"prompt": "hi", "memory": "M" * 300, "max_length": 10}, "memory"),
])
def test_generate_errors_have_detail(client, body, param):
    r = client.post("/api/v1/generate", json=body)
    body = _kobold_error(r, 400, param=param)
    if param == "max_length" and "max_context_length" in json.dumps(body):
        assert body["message"] == "max_length must not be larger than max_context_length"


def test_kobold_404_has_detail(client):
    _kobold_error(client.get("/api/v1/nothing"), 404)


def test_latest_mirrors_v1(client):
    for path in ("/model", "/info/version", "/config/max_length", "/config/max_context_length",
                 "/config/soft_prompts_list", "/config/soft_prompt"):
        assert client.get(f"/api/latest{path}").json() == client.get(f"/api/v1{path}").json()
    r = client.post("/api/latest/generate", json={"prompt": "hi", "max_length": 2})
    assert r.json()["results"][0]["text"] == "ab"


def _events(text: str) -> list[dict]:
    blocks = text.split("\n\n")
    assert blocks[-1] == "", text[-100:]
    events = []
    for block in blocks[:-1]:
        event, data = block.split("\n")
        assert event == "event: message" and data.startswith("data: ")
        events.append(json.loads(data[len("data: "):]))
    return events


def test_stream_framing(client, engine):
    r = client.post("/api/extra/generate/stream", json={"prompt": "hi", "max_length": 3, "n": 3})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["cache-control"] == "no-cache"
    assert "[DONE]" not in r.text
    assert _events(r.text) == [{"token": "a"}, {"token": "b"}, {"token": "c"},
                               {"token": "", "finish_reason": "length"}]
    assert _params(engine).n == 1  # n is ignored when streaming


def test_stream_error_mid_stream(client):
    r = client.post("/api/extra/generate/stream", json={"prompt": "RAISE", "max_length": 5})
    assert r.status_code == 200
    events = _events(r.text)
    assert events[:2] == [{"token": "a"}, {"token": "b"}]
    assert events[-1]["finish_reason"] == "error" and events[-1]["token"] == ""
    assert "boom" in events[-1]["error"]["message"]


def test_stream_error_before_first_byte_is_json(client):
    _kobold_error(client.post("/api/extra/generate/stream", json={"prompt": "KVFULL", "max_length": 5}), 400)


def _generate_in_thread(client, body):
    result = {}

    def run():
        result["response"] = client.post("/api/v1/generate", json=body)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def _wait_for_text(client, body=None, params=None):
    deadline = time.monotonic() + 5
    while True:
        text = client.post("/api/extra/generate/check", json=body or {}, params=params).json()["results"][0]["text"]
        if text:
            return text
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_check_and_abort_by_genkey(client, engine):
    thread, result = _generate_in_thread(client, {"prompt": "SLOW", "max_length": 200, "genkey": "KCPP1"})
    so_far = _wait_for_text(client, {"genkey": "KCPP1"})
    assert "abcdefghijklmnopqrstuvwxyz".startswith(so_far)
    # GET with the genkey in the query works too.
    assert client.get("/api/extra/generate/check", params={"genkey": "KCPP1"}).json()["results"][0]["text"]
    assert client.post("/api/extra/abort", json={"genkey": "nope"}).json() == {"success": False}
    assert client.post("/api/extra/abort", json={"genkey": "KCPP1"}).json() == {"success": True}
    thread.join(5)
    out = result["response"].json()["results"][0]
    assert out["finish_reason"] == "abort" and out["completion_tokens"] < 200
    assert out["text"] == client.post("/api/extra/generate/check", json={"genkey": "KCPP1"}).json()["results"][0]["text"]
    assert any(rid.startswith("kobold-") for rid in engine.aborted)
    assert client.post("/api/extra/abort", json={"genkey": "KCPP1"}).json() == {"success": False}  # already over


def test_bodiless_abort_stops_the_callers_anonymous_generation(client):
    thread, result = _generate_in_thread(client, {"prompt": "SLOW", "max_length": 200})
    _wait_for_text(client)  # no genkey: the caller's latest genkey-less generation
    r = client.post("/api/extra/abort", content=b"")
    assert r.status_code == 200 and r.json() == {"success": True}
    thread.join(5)
    assert result["response"].json()["results"][0]["finish_reason"] == "abort"
    assert client.post("/api/extra/abort").json() == {"success": False}


def test_abort_ends_stream_with_abort_event(client):
    events = []

    def run():
        with client.stream("POST", "/api/extra/generate/stream", json={"prompt": "SLOW", "max_length": 200,
                                                                       "genkey": "S1"}) as r:
            events.extend(_events(r.read().decode()))

    thread = threading.Thread(target=run)
    thread.start()
    _wait_for_text(client, {"genkey": "S1"})
    assert client.post("/api/extra/abort", json={"genkey": "S1"}).json() == {"success": True}
    thread.join(5)
    assert events[-1] == {"token": "", "finish_reason": "abort"} and len(events) < 200


def test_duplicate_running_genkey_is_refused(client):
    thread, _ = _generate_in_thread(client, {"prompt": "SLOW", "max_length": 50, "genkey": "DUP"})
    _wait_for_text(client, {"genkey": "DUP"})
    _kobold_error(client.post("/api/v1/generate", json={"prompt": "hi", "genkey": "DUP"}), 400, param="genkey")
    client.post("/api/extra/abort", json={"genkey": "DUP"})
    thread.join(5)


def test_check_unknown_genkey_is_empty(client):
    assert client.post("/api/extra/generate/check", json={"genkey": "unknown"}).json() == {"results": [{"text": ""}]}


def test_token_routes(client):
    assert client.post("/api/extra/tokencount", json={"prompt": "hi"}).json() == {"value": 2, "ids": [104, 105]}
    assert client.post("/api/extra/tokenize", json={"prompt": "hi"}).json()["ids"] == [104, 105]
    assert client.post("/api/extra/detokenize", json={"ids": [104, 105]}).json() == {"result": "hi", "success": True}
    for bad in ({}, {"prompt": 5}):
        body = _kobold_error(client.post("/api/extra/tokencount", json=bad), 400, param="prompt")
        assert body["value"] == -1
    assert _kobold_error(client.post("/api/extra/tokencount", content=b"{nope"), 400)["value"] == -1
    _kobold_error(client.post("/api/extra/detokenize", json={"ids": [1000]}), 400, param="ids")


def test_logprobs_and_last_logprobs(client):
    r = client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 2, "logprobs": 2, "genkey": "LP"})
    content = r.json()["results"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["a", "b"]
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert client.post("/api/extra/last_logprobs", json={"genkey": "LP"}).json() == {"logprobs": {"content": content}}
    assert client.post("/api/extra/last_logprobs").json() == {"logprobs": {"content": content}}  # caller's latest
    client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 1})
    assert client.post("/api/extra/last_logprobs").json() == {"logprobs": {"content": []}}


def test_perf_after_generation(client):
    client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 4})
    perf = client.get("/api/extra/perf").json()
    assert {"last_process", "last_eval", "last_token_count", "total_gens", "queue", "idle"} <= set(perf)
    assert perf["total_gens"] == 1 and perf["last_token_count"] == 4 and perf["last_input_count"] == 3
    assert perf["stop_reason"] == 0 and perf["idle"] == 1


def test_kobold_503_while_loading():
    from starlette.testclient import TestClient

    from tests.server.fakes import FakeEngine, make_app

    engine = FakeEngine(ready_on_start=False)
    with TestClient(make_app(engine)) as c:
        _kobold_error(c.post("/api/v1/generate", json={"prompt": "hi"}), 503)
        _kobold_error(c.get("/api/v1/config/max_context_length"), 503)
        assert c.get("/api/extra/version").status_code == 200
        engine.hold = False


def test_default_badwordsids(client, engine):
    from paphos.server.kobold.generate import _default_bad_words

    state = client.app.state.paphos
    assert _default_bad_words(state) == [2, ord("["), ord("]")]  # EOS and the bracket tokens
    r = client.post("/api/v1/generate", json={"prompt": "hi", "max_length": 1, "use_default_badwordsids": True})
    if r.status_code == 200:  # the bans reach the sampler under their OpenAI name
        assert set(_params(engine).custom_token_bans) >= {2, ord("["), ord("]")}
    else:  # a server without id bans says so instead of ignoring them (§4.5)
        assert _kobold_error(r, 400, param="custom_token_bans")["message"].startswith("Sampler")

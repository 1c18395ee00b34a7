"""Bad input -> 4xx in the §2.3 superset shape, and the next request is still served."""

from __future__ import annotations

import time

import pytest

from tests.server.fakes import assert_error_shape

GOOD = {"prompt": "hi", "max_tokens": 2}

BAD_COMPLETIONS = [
    # (body, status, param)
    ({"max_tokens": 2}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1.5]}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": "abc"}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "hi", "model": "nope"}, 404, "model"),
    ({"prompt": "hi", "n": 9}, 400, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 1}, 400, "best_of"),
    ({"prompt": "hi", "best_of": 9}, 400, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ({"prompt": [[1, 500]]}, 400, "prompt"),
    ({"prompt": [-1, 5]}, 400, "prompt"),
    ({"prompt": "hi", "suffix": "tail"}, 400, "suffix"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "hi", "stream": True, "n": 2, "best_of": 3}, 400, "best_of"),
    ({"prompt": "hi", "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "hi", "stop_token_ids": [999]}, 400, "stop_token_ids"),
    ({"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias"),
    ({"prompt": "hi", "temperature": 0, "n": 2}, 400, "n"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"prompt": "hi", "rep_pen": -1.3}, 400, "repetition_penalty"),
    ({"prompt": "hi", "mirostat": 3}, 400, "mirostat_mode"),
    ({"prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"prompt": "hi", "sampler_priority": ["temperature", "bogus"]}, 400, "sampler_priority"),
    ({"prompt": "hi", "sampler_priority": ["min_p", 2]}, 400, "sampler_priority"),
    ({"prompt": "hi", "dry_multiplier": 1, "dry_base": 0.5}, 400, "dry_base"),
    ({"prompt": "hi", "dry_sequence_breakers": "not json"}, 400, "dry_sequence_breakers"),
    ({"prompt": "hi", "guided_regex": "a+", "guided_choice": ["x"]}, 400, "guided_choice"),
    ({"prompt": "hi", "xtc_probability": 2}, 400, "xtc_probability"),
    ({"prompt": "x" * 300}, 400, "prompt"),
    ({"prompt": "hi KVFULL"}, 400, "prompt"),
    # Beam search is not implemented: refused, not silently sampled.
    ({"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ({"prompt": "hi", "use_beam_search": "true"}, 400, "use_beam_search"),
    ({"prompt": "hi", "length_penalty": 0.5}, 400, "length_penalty"),
    ({"prompt": "hi", "early_stopping": True}, 400, "early_stopping"),
    ({"prompt": "hi", "early_stopping": "never"}, 400, "early_stopping"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(client, body, status, param):
    assert_error_shape(client.post("/v1/completions", json=body), status, param=param)
    assert client.post("/v1/completions", json=GOOD).status_code == 200


BAD_CHAT = [
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400, "continue_final_message"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ BROKEN }}"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "/etc/passwd"}, 400, "chat_template"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 100}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "use_beam_search": True}, 400, "use_beam_search"),
    # OpenAI's content rule: only an assistant message with tool_calls may omit content.
    ({"messages": [{"role": "user"}]}, 400, "messages.0"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages.0"),
    ({"messages": [{"role": "system"}, {"role": "user", "content": "hi"}]}, 400, "messages.0"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}, 400, "messages.1"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}]}, 400, "messages.1"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1"}]}, 400, "messages.1"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT)
def test_bad_chat_requests(client, body, status, param):
    assert_error_shape(client.post("/v1/chat/completions", json=body), status, param=param)
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=good).status_code == 200


def test_unknown_model_message(client):
    body = assert_error_shape(client.post("/v1/completions", json={**GOOD, "model": "gpt-4"}), 404, "NotFoundError")
    assert body["message"] == "The model `gpt-4` does not exist."


def test_context_overflow_message(client):
    body = assert_error_shape(client.post("/v1/completions", json={"prompt": "x" * 99, "max_tokens": 200}), 400)
    assert body["message"] == (
        "This model's maximum context length is 256 tokens. However, you requested 300 tokens "
        "(100 in the prompt, 200 for the completion). Please reduce the length of the prompt or completion."
    )


def test_malformed_json_and_non_object(client):
    for raw in (b"{bad", b"", b"[1, 2]", b"\xff\xfe"):
        assert_error_shape(client.post("/v1/completions", content=raw), 400, "BadRequestError")
    assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_json_without_content_type_is_accepted(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": 1}',
                    headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200


def test_unknown_route_and_method(client):
    body = assert_error_shape(client.get("/v1/nothing"), 404, "NotFoundError", param=None)
    assert "/v1/nothing" in body["message"]
    assert_error_shape(client.get("/v1/completions"), 405)


def test_ten_megabyte_prompt_is_refused_quickly(client):
    start = time.perf_counter()
    response = client.post("/v1/completions", json={"prompt": "a" * 10_000_000})
    assert time.perf_counter() - start < 5
    body = assert_error_shape(response, 400, param="prompt")
    assert "maximum context length is 256 tokens" in body["message"]
    assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_oversized_body_413(client):
    response = client.post("/v1/completions", content=b"x" * (33 * 1024 * 1024),
                           headers={"content-type": "application/json"})
    assert_error_shape(response, 413)
    assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_numeric_strings_accepted(client, engine):
    body = {"prompt": "hi", "max_tokens": "3", "temperature": "0.5", "top_k": "4.0", "n": "2", "seed": "7"}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    params = engine.calls[-1][2]
    assert (params.max_tokens, params.temperature, params.top_k, params.n, params.seed) == (3, 0.5, 4, 2, 7)


@pytest.mark.parametrize(("raw", "param"), [
    # Found by the fuzzing of test_fuzz.py / its probes; each was a 500 before.
    (b'{"prompt": "hi", "temperature": NaN}', None),  # Python's json takes NaN and Infinity
    (b'{"prompt": "hi", "logit_bias": {"5": Infinity}}', None),
    (b'{"prompt": "hi", "logit_bias": {"5": 1e400}}', None),  # overflows to inf
    (b"[" * 100_000 + b"]" * 100_000, None),  # RecursionError in the decoder
    (b'{"prompt": "hi", "seed": 100000000000000000000000000000}', "seed"),  # int64 sampler seeds
    (b'{"prompt": "hi", "n": 2, "seed": 9223372036854775807}', "seed"),  # seed + 1 for the 2nd sequence
    (b'{"prompt": "hi", "aphrodite_xargs": {"banned_strings": 5}}', "aphrodite_xargs.banned_strings"),
    (b'{"prompt": "hi", "aphrodite_xargs": {"banned_strings": [1, {}]}}', "aphrodite_xargs.banned_strings"),
    (b'{"prompt": "hi", "structured_outputs": {"json": 5}}', "structured_outputs.json"),
    (b'{"prompt": "hi", "structured_outputs": {"choice": "x"}}', "structured_outputs.choice"),
    (b'{"prompt": "hi", "temperature": 1e308, "dynatemp_range": 1e308}', None),
])
def test_former_server_errors_are_400(client, raw, param):
    assert_error_shape(client.post("/v1/completions", content=raw), 400, param=param)
    assert_error_shape(client.post("/api/v1/generate", content=raw), 400)


def test_lone_surrogates_are_replaced(client, engine):
    # A JavaScript string cut inside an emoji: "\ud83d" alone cannot be encoded to UTF-8 (a 500 when
    # echoed back in an error or tokenized); it reads as U+FFFD, a valid pair as the emoji.
    r = client.post("/v1/completions", content=b'{"prompt": "a\\ud83d", "model": "x\\udc00", "max_tokens": 1}')
    assert assert_error_shape(r, 404, param="model")["message"] == "The model `x\ufffd` does not exist."
    r = client.post("/tokenize", content=b'{"prompt": "a\\ud83d b \\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["tokens"] == [1, ord("a"), ord("?"), ord(" "), ord("b"), ord(" "), ord("?")]
    assert client.post("/v1/completions", content=b'{"prompt": "\\udfff", "max_tokens": 1}').status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hi", "seed": 2**63 - 1, "max_tokens": 1}).status_code == 200


def test_message_content_rules(client):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}, {"role": "assistant", "content": ""}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = assert_error_shape(client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]}), 400)
    assert "content is required for a 'user' message" in body["message"]
    # /tokenize's chat form follows the same rule.
    assert_error_shape(client.post("/tokenize", json={"messages": [{"role": "user"}]}), 400, param="messages.0")


def test_unknown_and_neutral_fields_ignored(client, engine):
    # A SillyTavern-like settings object: unknown keys and neutral extended samplers.
    body = {
        **GOOD, "max_new_tokens": 99, "api_type": "aphrodite", "stopping_strings": ["x"], "typical_p": 1,
        "typical": 1, "top_a": 0, "tfs": 1, "rep_pen": 1, "repetition_penalty_range": 1024, "frequency_penalty": 0,
        "presence_penalty": 0, "dry_multiplier": 0, "dry_sequence_breakers": "[\"\\n\", \":\"]", "xtc_probability": 0,
        "xtc_threshold": 0.1, "mirostat_mode": 0, "temperature_last": False, "custom_token_bans": "",
        "banned_strings": [], "sampler_priority": [], "guided_json": {}, "guided_grammar": "", "stop": "",
        "logit_bias": {}, "smoothing_factor": 0, "nsigma": 0, "skew": 0, "ban_eos_token": False,
        "early_stopping": False, "use_beam_search": False, "length_penalty": 1, "user": None, "seed": -1, "top_k": -1, "response_format": {"type": "text"},
    }
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    params = engine.calls[-1][2]
    assert params.seed is None and params.stop == [] and params.logit_bias is None


def test_field_mapping(client, engine):
    body = {**GOOD, "stop": "END", "logit_bias": {"5": 200}, "top_k": 0, "temp": 0.7, "sampler_seed": 3,
            "min_p": 0.1, "top_p": 0.9, "stop_token_ids": [7], "ignore_eos": True, "include_stop_str_in_output": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    p = engine.calls[-1][2]
    assert p.stop == ["END"] and p.logit_bias == {5: 100.0} and p.top_k == 0
    assert (p.temperature, p.seed, p.min_p, p.top_p) == (0.7, 3, 0.1, 0.9)
    assert p.stop_token_ids == [7] and p.ignore_eos and p.include_stop_str_in_output
    # Canonical name beats the alias.
    assert client.post("/v1/completions", json={**GOOD, "temperature": 0.2, "temp": 0.9}).status_code == 200
    assert engine.calls[-1][2].temperature == 0.2


def test_bos_never_doubled(client, engine):
    assert client.post("/v1/completions", json={"prompt": "<s>hi", "max_tokens": 1}).status_code == 200
    assert engine.calls[-1][1] == [1, ord("h"), ord("i")]
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "add_special_tokens": False}).status_code == 200
    assert engine.calls[-1][1] == [ord("h"), ord("i")]


def test_truncate_prompt_tokens(client, engine):
    r = client.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 1, "truncate_prompt_tokens": 2})
    assert r.status_code == 200
    assert engine.calls[-1][1] == [ord("e"), ord("f")]


def test_engine_error_non_streaming(client):
    assert_error_shape(client.post("/v1/completions", json={"prompt": "RAISE", "max_tokens": 5}), 500, "InternalServerError")
    body = assert_error_shape(client.post("/v1/completions", json={"prompt": "ERRFIELD", "max_tokens": 5}), 500)
    assert "sampler exploded" in body["message"]
    assert client.post("/v1/completions", json=GOOD).status_code == 200

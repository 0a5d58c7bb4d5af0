"""Bad input gets an OpenAI-style 4xx and the server keeps serving: the next good request still succeeds."""

from __future__ import annotations

import json

import httpx
import pytest

from stage4_fast.harness import ServerProcess

LONG_IDS = [100 + i % 1000 for i in range(5000)]  # longer than tiny-qwen3's 4096-token context


def _good_request_works(server: ServerProcess) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions",
                   json={"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]

# (name, path, body (dict or raw bytes), status, code)
CASES = [
    ("malformed json", CHAT, b'{"messages": [', 400, "invalid_json"),
    ("body not an object", CHAT, b"[1, 2]", 400, "invalid_value"),
    ("missing messages", CHAT, {"max_tokens": 3}, 400, "missing_required_parameter"),
    ("empty messages", CHAT, {"messages": []}, 400, "invalid_value"),
    ("messages not a list", CHAT, {"messages": "hi"}, 400, "invalid_value"),
    ("unknown role", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_value"),
    ("content not text", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_value"),
    ("missing prompt", COMPLETIONS, {"max_tokens": 3}, 400, "missing_required_parameter"),
    ("empty prompt", COMPLETIONS, {"prompt": ""}, 400, "invalid_value"),
    ("empty token list", COMPLETIONS, {"prompt": []}, 400, "invalid_value"),
    ("prompt not text", COMPLETIONS, {"prompt": 5}, 400, "invalid_value"),
    ("a prompt of text beside one of ids", COMPLETIONS, {"prompt": ["a", [1, 2]]}, 400, "invalid_value"),
    ("too many choices", COMPLETIONS, {"prompt": ["a", "b"], "n": 65}, 400, "invalid_value"),
    ("max_tokens zero", COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "invalid_value"),
    ("max_tokens negative", CHAT, {"messages": MSG, "max_tokens": -5}, 400, "invalid_value"),
    ("max_tokens a string", COMPLETIONS, {"prompt": "a", "max_tokens": "10"}, 400, "invalid_value"),
    ("max_tokens beyond context", CHAT, {"messages": MSG, "max_tokens": 10**6}, 400, "context_length_exceeded"),
    ("prompt beyond context", COMPLETIONS, {"prompt": LONG_IDS, "max_tokens": 4}, 400, "invalid_request"),
    ("prompt beyond context, streamed", COMPLETIONS, {"prompt": LONG_IDS, "stream": True}, 400, "invalid_request"),
    ("chat beyond context", CHAT, {"messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "invalid_request"),
    ("token id beyond vocabulary", COMPLETIONS, {"prompt": [1, 2, 10**7]}, 400, "invalid_request"),
    ("negative token id", COMPLETIONS, {"prompt": [1, -3]}, 400, "invalid_request"),
    ("temperature negative", COMPLETIONS, {"prompt": "a", "temperature": -0.1}, 400, "invalid_value"),
    ("temperature a string", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "invalid_value"),
    ("top_p zero", COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "invalid_value"),
    ("top_p above one", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "invalid_value"),
    ("stream not a bool", CHAT, {"messages": MSG, "stream": "yes"}, 400, "invalid_value"),
    # fields the server does not implement are refused by name, never ignored (a client asking for JSON got prose)
    ("tools with auto but no parser", CHAT,
     {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "invalid_value"),
    ("reasoning_effort", CHAT, {"messages": MSG, "reasoning_effort": "low"}, 400, "unsupported_parameter"),
    ("unknown field", COMPLETIONS, {"prompt": "a", "max_token": 3}, 400, "unknown_parameter"),
    ("unknown field in a message", CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400,
     "unknown_parameter"),
    ("unknown field of /generate", "/generate", {"prompt": "a", "max_tokens": 2, "temperature": 0.5}, 400,
     "unknown_parameter"),
    ("n zero", CHAT, {"messages": MSG, "n": 0}, 400, "invalid_value"),
    ("logprobs above 20", COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "invalid_value"),
    ("chat logprobs an int", CHAT, {"messages": MSG, "logprobs": 3}, 400, "invalid_value"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "invalid_value"),
    ("presence_penalty beyond 2", CHAT, {"messages": MSG, "presence_penalty": 2.5}, 400, "invalid_value"),
    ("repetition_penalty zero", COMPLETIONS, {"prompt": "a", "repetition_penalty": 0}, 400, "invalid_value"),
    ("repetition_penalty tiny", COMPLETIONS, {"prompt": "a", "repetition_penalty": 1e-300}, 400, "invalid_value"),
    ("min_p above one", COMPLETIONS, {"prompt": "a", "min_p": 1.5}, 400, "invalid_value"),
    ("logit_bias key not an id", COMPLETIONS, {"prompt": "a", "logit_bias": {"x": 1}}, 400, "invalid_value"),
    ("logit_bias beyond 100", COMPLETIONS, {"prompt": "a", "logit_bias": {"5": 101}}, 400, "invalid_value"),
    ("logit_bias id beyond vocabulary", COMPLETIONS, {"prompt": "a", "logit_bias": {"99999999": 1}}, 400,
     "invalid_request"),
    ("unknown response_format", CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, 400, "invalid_value"),
    ("json_schema format without a schema", CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}},
     400, "missing_required_parameter"),
    ("unsupported JSON schema", CHAT,
     {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     400, "invalid_request"),
    ("unsupported regex", COMPLETIONS, {"prompt": "a", "regex": "(a"}, 400, "invalid_request"),
    ("unsupported EBNF grammar", COMPLETIONS, {"prompt": "a", "structured_outputs": {"grammar": "root = 'a'"}}, 400,
     "invalid_request"),
    ("unsupported structural tag", COMPLETIONS, {"prompt": "a", "structured_outputs": {"structural_tag": "[1]"}}, 400,
     "invalid_request"),
    ("two kinds of structured output", CHAT,
     {"messages": MSG, "regex": "a", "response_format": {"type": "json_object"}}, 400, "invalid_value"),
    ("structured_outputs with two constraints", COMPLETIONS,
     {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "invalid_value"),
    ("structured_outputs with none", COMPLETIONS, {"prompt": "a", "structured_outputs": {"json_object": False}}, 400,
     "invalid_value"),
    ("structured_outputs without choices", COMPLETIONS, {"prompt": "a", "structured_outputs": {"choice": []}}, 400,
     "invalid_value"),
    ("empty stop string", COMPLETIONS, {"prompt": "a", "stop": [""]}, 400, "invalid_value"),
    ("unknown model", CHAT, {"model": "gpt-17", "messages": MSG}, 404, "model_not_found"),
    ("generate without max_tokens", "/generate", {"prompt": "a"}, 400, "missing_required_parameter"),
]


@pytest.mark.parametrize("name, path, body, status, code", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_openai_error_and_server_keeps_serving(tiny_server, name, path, body, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{tiny_server.base_url}{path}", content=content,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["code"] == code and error["type"] and error["message"]
    _good_request_works(tiny_server)


@pytest.mark.parametrize("path, body, param, says", [
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, "functions", "function calls"),
    (COMPLETIONS, {"prompt": "a", "suffix": "b"}, "suffix", "insertion"),
    (COMPLETIONS, {"prompt": "a", "max_token": 3}, "max_token", "did you mean 'max_tokens'"),
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", "JSON's whitespace"),
])
def test_refusal_names_the_field(tiny_server, path, body, param, says):
    r = httpx.post(f"{tiny_server.base_url}{path}", json=body, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param
    *where, name = param.split(".")
    assert f"'{name}'" in error["message"] and says in error["message"], error
    if where:  # a nested object's field: "object: 'field' is not ..."
        assert error["message"].startswith(f"{'.'.join(where)}: '{name}'"), error


def test_values_that_ask_for_nothing_are_accepted(tiny_server):
    """Clients often send OpenAI's defaults explicitly; those request nothing we do not do."""
    neutral = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "tools": [],
               "tool_choice": "none", "response_format": {"type": "text"}, "logit_bias": {}, "user": None}
    r = httpx.post(f"{tiny_server.base_url}{CHAT}", json={"messages": MSG, "max_tokens": 2, **neutral}, timeout=60)
    assert r.status_code == 200, r.text


def test_unknown_route_and_method_are_openai_errors(tiny_server):
    r = httpx.get(f"{tiny_server.base_url}/v1/nothing-here", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{tiny_server.base_url}/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"  # RFC 9110
    _good_request_works(tiny_server)

"""vLLM's /tokenize and /detokenize against the model's tokenizer, and against what /v1/chat/completions runs."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from stage4_fast.harness import ServerProcess

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


def test_a_prompt_is_encoded_as_the_tokenizer_encodes_it(tiny_server, tiny_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    for body, add in (({"prompt": "Hello world, again."}, True),
                      ({"prompt": "Hello world, again.", "add_special_tokens": False}, False)):
        r = _post(tiny_server, "/tokenize", body).json()
        assert r["tokens"] == tokenizer.encode(body["prompt"], add_special_tokens=add)
        assert r["count"] == len(r["tokens"]) and r["max_model_len"] > 0


def test_messages_count_what_a_chat_completion_runs(tiny_server):
    for options in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"x": 1}}):
        counted = _post(tiny_server, "/tokenize", {"messages": MESSAGES, **options}).json()["count"]
        r = _post(tiny_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, **options}).json()
        assert counted == r["usage"]["prompt_tokens"], options


def test_tools_count_only_where_the_template_renders_them(tiny_server, tools_server):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    plain = _post(tools_server, "/tokenize", {"messages": MESSAGES}).json()["count"]
    with_tools = _post(tools_server, "/tokenize", {"messages": MESSAGES, "tools": tools}).json()["count"]
    assert with_tools > plain
    r = _post(tiny_server, "/tokenize", {"messages": MESSAGES, "tools": tools})
    assert r.status_code == 400 and "does not render tools" in r.json()["error"]["message"]


def test_ids_come_back_as_text_and_an_id_outside_the_vocabulary_is_a_400(tiny_server, tiny_dir: Path):
    ids = _post(tiny_server, "/tokenize", {"prompt": "The fox, the dog."}).json()["tokens"]
    assert _post(tiny_server, "/detokenize", {"tokens": ids}).json() == {
        "prompt": AutoTokenizer.from_pretrained(tiny_dir).decode(ids)}
    r = _post(tiny_server, "/detokenize", {"tokens": [5, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens" and "1000000" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, says", [
    ({}, "a prompt or messages"),
    ({"prompt": "x", "messages": MESSAGES}, "a prompt or messages"),
    ({"prompt": "x", "add_generation_prompt": True}, "go with messages"),
    ({"messages": MESSAGES, "add_special_tokens": True}, "goes with a prompt"),
    ({"prompt": "x", "model": "gpt-17"}, "does not exist"),
    ({"prompt": "x", "max_tokens": 3}, "max_tokens"),
])
def test_what_cannot_be_tokenized_is_refused_by_name(tiny_server, body, says):
    r = _post(tiny_server, "/tokenize", body)
    assert r.status_code in (400, 404) and says in r.json()["error"]["message"], r.json()


def test_add_special_tokens_reaches_the_tokenizer():
    """(The repository's tokenizers add no special token to a raw prompt, so the flag is checked on its way.)"""
    from types import SimpleNamespace

    from stage4_fast.server.protocol.tokenize import TokenizeRequest
    from stage4_fast.server.tokenize_api import _encode

    seen = []
    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: seen.append(add_special_tokens) or [1])
    for body in ({"prompt": "x"}, {"prompt": "x", "add_special_tokens": True},
                 {"prompt": "x", "add_special_tokens": False}):
        _encode(SimpleNamespace(tokenizer=tokenizer), TokenizeRequest.model_validate(body))
    assert seen == [True, True, False]

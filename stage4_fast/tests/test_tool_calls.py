"""Tool calls: the Hermes parser (whole and streamed), the JSON a forced call is held to, the request rules, and a
server whose model's chat template renders tools (``tools_server``: the tiny random model with a Hermes-style
template, conftest.py).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers import AutoTokenizer

from stage4_fast.harness import ServerProcess
from stage4_fast.server.protocol.chat import ChatCompletionRequest
from stage4_fast.server.tool_calls import HermesStream, ToolCallReader, forced_calls, forced_schema, parse_hermes

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"enum": ["Paris", "Lyon"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# ---- the Hermes parser ---------------------------------------------------------------------------------------------

def _calls(calls: list) -> list:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_hermes_blocks_become_calls_and_the_rest_content():
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> Done.')
    content, calls = parse_hermes(text)
    assert content == "Let me look.  Done."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "<tool_call>not json</tool_call> after",  # not a call: stays text
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "get_time", "arguments": {"zone"',  # cut short by max_tokens
    "a < b and <tool_ca",
])
def test_what_is_not_a_whole_call_stays_text(text):
    assert parse_hermes(text) == (text, [])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'a<b <tool_call>{"name": "f", "arguments": {}}</tool_call>x<tool_call>{"name": "g", "arguments": "{}"}'
    '</tool_call> <tool_call>{"name": "h"',
    "<<tool_call>bad</tool_call><tool_",
]), st.lists(st.integers(0, 120), max_size=8))
def test_a_stream_split_anywhere_reads_as_the_whole_text(text, cuts):
    stream, content, calls = HermesStream(), [], []
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        shown, new = stream.feed(text[a:b], final=i == len(bounds) - 2)
        content.append(shown)
        calls.extend(new)
    whole_content, whole_calls = parse_hermes(text)
    assert "".join(content) == whole_content and _calls(calls) == _calls(whole_calls)


def test_a_stream_shows_content_before_a_call_at_once_and_holds_what_may_start_one():
    stream = HermesStream()
    assert stream.feed("Hello <tool") == ("Hello ", [])
    assert stream.feed("_call>{\"name\": \"f\", ") == ("", [])
    shown, calls = stream.feed('"arguments": {}}</tool_call> bye')
    assert shown == " bye" and _calls(calls) == [("f", {})]


def test_forced_calls_read_the_json_the_schema_holds_the_output_to():
    jsonschema = pytest.importorskip("jsonschema")
    named = forced_schema(TOOLS, "get_time")
    assert named == TIME["function"]["parameters"]
    assert _calls(forced_calls('{"zone": "CET"}', "get_time")) == [("get_time", {"zone": "CET"})]
    required = forced_schema(TOOLS, None)
    output = ('[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
              '{"name": "get_weather", "arguments": {"city": "Lyon"}}]')
    jsonschema.validate(json.loads(output), required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "Lyon"}}], required)
    assert _calls(forced_calls(output, None)) == [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Lyon"})]
    cut = forced_calls('{"zone": "C', "get_time")  # cut short: a named call's arguments are what was written
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in cut] == [("get_time", '{"zone": "C')]
    assert forced_calls("[", None) == []  # a list cut short holds no call
    assert forced_calls('{"name": "get_time"}', None) == forced_calls("[1]", None) == []  # not a list of calls


TWO_CALLS = ('Both. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> and '
             '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call> done')


def test_without_parallel_calls_a_choice_keeps_its_first_call():
    jsonschema = pytest.importorskip("jsonschema")
    one = forced_schema(TOOLS, None, parallel=False)  # required: held to one call
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}] * 2, one)
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}] * 2, forced_schema(TOOLS, None))
    content, calls, finish = ToolCallReader("auto", parallel=False).whole(TWO_CALLS, "stop")  # auto: the first
    assert _calls(calls) == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"
    assert content == "Both.  and  done"
    assert len(ToolCallReader("auto").whole(TWO_CALLS, "stop")[1]) == 2
    reader, streamed = ToolCallReader("auto", parallel=False), []
    for i in range(0, len(TWO_CALLS), 7):  # streamed: the first call, and no other
        piece = TWO_CALLS[i:i + 7]
        streamed.extend(reader.piece(0, piece, "stop" if i + 7 >= len(TWO_CALLS) else None)[1])
    assert [c["index"] for c in streamed] == [0] and _calls(streamed) == [("get_weather", {"city": "Paris"})]


# ---- the request --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, why", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": TOOLS, "tool_choice": "required", "regex": "a"}, "no other structured output"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "pattern"),
])
def test_tool_requests_that_cannot_hold_are_refused(fields, why):
    with pytest.raises(ValidationError, match=why):
        ChatCompletionRequest.model_validate({"messages": ASK, **fields})


@pytest.mark.parametrize("message, why", [
    ({"role": "assistant"}, "content or tool_calls"),
    ({"role": "tool", "content": "sunny"}, "tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "c1"}, "Extra inputs"),
])
def test_messages_of_each_role_take_their_own_fields(message, why):
    with pytest.raises(ValidationError, match=why):
        ChatCompletionRequest.model_validate({"messages": [message]})


def test_tools_reach_the_template_whatever_the_tool_choice():
    for choice in (None, "none", "auto", "required"):
        request = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": choice})
        assert request.chat_options()["tools"] == TOOLS


# ---- a server -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(tools_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="none")


def _chat(client: openai.OpenAI, **fields):
    fields = {"max_tokens": 60, **fields}
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=ASK, temperature=1.0,
                                          seed=3, **fields)


def test_a_named_tool_is_called_with_arguments_its_schema_holds(client):
    jsonschema = pytest.importorskip("jsonschema")
    r = _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_calls_one_or_more_of_the_tools(client):
    r = _chat(client, tools=TOOLS, tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    assert {c.function.name for c in calls} <= {"get_weather", "get_time"}


def test_required_without_parallel_calls_calls_one_tool(client):
    r = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=4)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


# auto leaves the model free; the random model is held to a Hermes reply by an EBNF grammar, so the parser has
# a call to find
HERMES_REPLY = ('root ::= "Let me check. <tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
                '{\\"city\\": \\"Paris\\"}}\\n</tool_call>"')


def test_auto_reads_the_calls_out_of_the_text(client):
    r = _chat(client, tools=TOOLS, extra_body={"ebnf": HERMES_REPLY})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content == "Let me check. "
    assert _calls([c.model_dump() for c in message.tool_calls]) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("fields", [{"extra_body": {"ebnf": HERMES_REPLY}},
                                    {"tool_choice": {"type": "function", "function": {"name": "get_time"}}}],
                         ids=["auto", "named"])
def test_a_stream_carries_content_then_each_call_once(client, fields):
    stream = _chat(client, tools=TOOLS, stream=True, **fields)
    content, calls, finishes = [], [], []
    for chunk in stream:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        calls.extend(delta.tool_calls or [])
        finishes.append(chunk.choices[0].finish_reason)
    assert finishes[-1] == "tool_calls" and {c.index for c in calls} == {0}
    assert calls[0].id and all(c.id is None and c.function.name is None for c in calls[1:])  # named once
    arguments = "".join(c.function.arguments for c in calls)
    if "extra_body" in fields:  # the block's call, whole
        assert "".join(content) == "Let me check. " and calls[0].function.name == "get_weather" and len(calls) == 1
    else:  # the named tool's arguments, in pieces as they come
        assert "".join(content) == "" and calls[0].function.name == "get_time" and len(calls) > 1
    assert json.loads(arguments)["zone" if "extra_body" not in fields else "city"] in ("UTC", "CET", "Paris")


def test_auto_without_parallel_calls_keeps_the_first(client):
    two = 'root ::= "' + TWO_CALLS.replace('"', '\\"') + '"'
    for parallel, expected in ((True, 2), (False, 1)):
        r = _chat(client, tools=TOOLS, parallel_tool_calls=parallel, extra_body={"ebnf": two}, max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == expected


def test_a_conversation_with_calls_and_their_results_renders_as_transformers_does(client, tools_model):
    called = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [called]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, tools=TOOLS,
                                       tool_choice="none", max_tokens=1)
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    as_template = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**called, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    prompt = tokenizer.apply_chat_template(as_template, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_tools_for_a_template_that_ignores_them_or_auto_without_a_parser_are_a_400(tiny_server, tools_server):
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 2}
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
    assert r.status_code == 400 and "does not render tools" in r.json()["error"]["message"]
    r = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=60)  # auto, the default
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "tool_choice"

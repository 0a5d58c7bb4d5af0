"""Reasoning: the thinking block read out of the output (whole and streamed), and a server with
``--reasoning-parser qwen3`` (``tools_server``, conftest.py) whose random model is held to a reply by an EBNF grammar.
"""

from __future__ import annotations

import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stage4_fast.harness import ServerProcess
from stage4_fast.server.reasoning import ReasoningStream, split_reasoning


@pytest.mark.parametrize("parser, text, reasoning, content", [
    ("qwen3", "<think>\nhmm\n</think>\n\nHi", "\nhmm\n", "\n\nHi"),
    ("qwen3", "\n<think>a</think>b", "a", "b"),  # blank before the tag
    ("qwen3", "Hi <think>x</think>", None, "Hi <think>x</think>"),  # thinking off: no block at the start
    ("qwen3", "<think>cut short by max_tok", "cut short by max_tok", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("deepseek-r1", "hmm</think>Hi", "hmm", "Hi"),  # the template opened the block
    ("deepseek-r1", "<think>hmm</think>Hi", "hmm", "Hi"),
    ("deepseek_r1", "no end", "no end", ""),
])
def test_the_block_is_the_reasoning_and_the_rest_the_content(parser, text, reasoning, content):
    assert split_reasoning(parser, text) == (reasoning, content)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["qwen3", "deepseek-r1"]),
       st.sampled_from(["<think>\nI think.\n</think>\n\nAnswer", " <think>a</th</think>b</think>", "<th",
                        "plain <think>", "x</think>y", "<think>open"]),
       st.lists(st.integers(0, 40), max_size=6), st.booleans())
def test_a_stream_split_anywhere_reads_as_the_whole_text(parser, text, cuts, stream_reasoning):
    stream, reasoning, content = ReasoningStream(parser, stream_reasoning), [], []
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        r, c = stream.feed(text[a:b], final=i == len(bounds) - 2)
        reasoning.append(r)
        content.append(c)
    assert ("".join(reasoning) or None, "".join(content)) == split_reasoning(parser, text)
    if not stream_reasoning:  # held back and sent once, whole
        assert len([r for r in reasoning if r]) <= 1


# the random model held to a thinking model's reply
REPLY = 'root ::= "<think>\\nLet me see.\\n</think>\\n\\nParis."'


@pytest.fixture(scope="module")
def client(tools_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="none")


def _chat(client: openai.OpenAI, **fields):
    return client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=120, temperature=0,
                                          messages=[{"role": "user", "content": "The capital of France?"}], **fields)


def test_the_reply_has_its_reasoning_apart(client):
    message = _chat(client, extra_body={"ebnf": REPLY}).choices[0].message
    assert message.reasoning_content == "\nLet me see.\n" and message.content == "\n\nParis."


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_a_stream_sends_the_reasoning_then_the_content(client, stream_reasoning):
    chunks = list(_chat(client, stream=True, extra_body={"ebnf": REPLY, "stream_reasoning": stream_reasoning}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    content = [d.content or "" for d in deltas]
    assert "".join(reasoning) == "\nLet me see.\n" and "".join(content) == "\n\nParis."
    last_reasoning = max(i for i, r in enumerate(reasoning) if r)
    # content only after the reasoning: never in a chunk before the one that ends it (replies that queued up are
    # merged into one chunk, which then carries the reasoning's end and the content after it)
    assert all(not c for c in content[:last_reasoning])
    sent = [r for r in reasoning if r]
    assert len(sent) == 1 if not stream_reasoning else len(sent) > 1  # held back and sent whole, or as it comes


def test_separate_reasoning_false_keeps_the_block_in_the_content(client):
    message = _chat(client, extra_body={"ebnf": REPLY, "separate_reasoning": False}).choices[0].message
    assert message.content == "<think>\nLet me see.\n</think>\n\nParis."
    assert getattr(message, "reasoning_content", None) is None


def test_a_tool_call_after_the_thinking_is_read_and_one_inside_it_is_not(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = '<tool_call>{\\"name\\": \\"f\\", \\"arguments\\": {}}</tool_call>'
    reply = f'root ::= "<think>maybe {call}</think>Sure. {call}"'
    r = _chat(client, tools=tools, extra_body={"ebnf": reply})
    message = r.choices[0].message
    assert message.reasoning_content == 'maybe <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert message.content == "Sure. " and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [("f", {})]

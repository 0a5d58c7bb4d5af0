"""Schemathesis hooks for test_openapi.py (loaded by the schemathesis CLI through SCHEMATHESIS_HOOKS).

Generation is bounded so the run stays short: a schema-valid max_tokens (or none, which means up to the whole
context for chat) becomes 1 right before the request is sent; schemathesis re-derives what it expects from the
body actually sent, and 1 is as valid as the value it replaces. Invalid values (0, beyond the context, wrong types)
are left alone: they must still be refused. The vocabulary bounds logit_bias' token ids at run time too (the
schema's key pattern says only "digits"): an id beyond it becomes one within. And n times the number of prompts is
at most MAX_CHOICES, a rule across two fields that the schema states in words: a valid n becomes one that keeps to
it.

A body that asks for structured output in more than one way keeps only the first: the server refuses the rest
(400), and the schema states that rule in words only (``protocol.sampling.sampling_request_rules`` says why). A regular
expression, grammar or schema given as text is a string to the schema, and compiles or is a 400 at run time (as a
context length is a bound known at run time); a string there becomes one that compiles, and so does a structural
tag response format (each structure's begin must start with a trigger, which the schema says in words). The tiny
model's chat
template renders no tools, which the server finds out at run time (a 400): a chat or /tokenize body's tools (and
tool_choice) are left out (``tests/test_tool_calls.py`` serves them with a template that renders them).
"""

from __future__ import annotations

import os

import schemathesis

from stage4_fast.server.protocol.common import MAX_CHOICES
from stage4_fast.server.protocol.structured import STRUCTURED_OUTPUT_FIELDS

MAX_TOKENS = 1
CONTEXT = int(os.environ.get("MINISGL_TEST_CONTEXT_LENGTH", "0"))
VOCAB = int(os.environ.get("MINISGL_TEST_VOCAB_SIZE", "1"))
# text the grammar compiler takes, by field: the request's own, and structured_outputs'
COMPILABLE = {"regex": "[a-z]", "ebnf": 'root ::= "a"', "json_schema": '{"type": "object"}'}
# a structural tag response format the schema allows becomes this one: the schema cannot say that each begin
# starts with a trigger, and xgrammar takes no text that is not UTF-8 (a lone surrogate)
COMPILABLE_TAG_FORMAT = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}],
                         "triggers": ["<a"]}
COMPILABLE_NESTED = {"regex": "[a-z]", "grammar": 'root ::= "a"', "json": '{"type": "object"}',
                     "structural_tag": '{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}], '
                                       '"triggers": ["<a>"]}'}


def _asks_for_structure(name: str, value: object) -> bool:
    return value is not None and not (name == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text")


def _schema_valid_tag_format(fmt: dict) -> bool:
    structures, triggers = fmt.get("structures"), fmt.get("triggers")
    return (set(fmt) == {"type", "structures", "triggers"} and isinstance(structures, list) and bool(structures)
            and all(isinstance(s, dict) and set(s) == {"begin", "schema", "end"} and isinstance(s["begin"], str)
                    and s["begin"] and isinstance(s["schema"], dict) and isinstance(s["end"], str) for s in structures)
            and isinstance(triggers, list) and bool(triggers) and all(isinstance(t, str) and t for t in triggers))


def _valid_count(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value <= CONTEXT


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body, path = case.body, context.operation.path
    if isinstance(body, dict) and path in ("/v1/chat/completions", "/tokenize"):
        body.pop("tools", None)
        body.pop("tool_choice", None)
    if not isinstance(body, dict) or path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
        return
    keys = ["max_tokens", "max_completion_tokens"] if path == "/v1/chat/completions" else ["max_tokens"]
    for key in keys:
        if _valid_count(body.get(key)):
            body[key] = MAX_TOKENS
    if path != "/generate" and all(body.get(key) is None for key in keys):
        body[keys[0]] = MAX_TOKENS
    prompt, n = body.get("prompt"), body.get("n")
    if path == "/v1/completions" and isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        # JSON Schema's integers include integral floats (41.0), which the server takes as 41
        if isinstance(n, (int, float)) and not isinstance(n, bool) and 1 <= n <= MAX_CHOICES and n == int(n):
            body["n"] = min(int(n), max(1, MAX_CHOICES // len(prompt)))
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") == "structural_tag" and _schema_valid_tag_format(fmt):
        body["response_format"] = COMPILABLE_TAG_FORMAT
    bias = body.get("logit_bias")
    if isinstance(bias, dict):
        body["logit_bias"] = {(str(int(k) % VOCAB) if k.isascii() and k.isdigit() else k): v for k, v in bias.items()}
    asked = [name for name in STRUCTURED_OUTPUT_FIELDS if _asks_for_structure(name, body.get(name))]
    for name in asked[1:]:
        del body[name]
    for fields, compilable in ((body, COMPILABLE), (body.get("structured_outputs"), COMPILABLE_NESTED)):
        for name, text in compilable.items():
            if isinstance(fields, dict) and isinstance(fields.get(name), str):
                fields[name] = text

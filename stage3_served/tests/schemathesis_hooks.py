"""Schemathesis hooks for test_openapi.py (loaded by the schemathesis CLI through SCHEMATHESIS_HOOKS).

Generation is bounded so the run stays short: a schema-valid max_tokens (or none, which means up to the whole
context for chat) becomes 1 right before the request is sent; schemathesis re-derives what it expects from the
body actually sent, and 1 is as valid as the value it replaces. Invalid values (0, beyond the context, wrong types)
are left alone: they must still be refused.
"""

from __future__ import annotations

import os

import schemathesis

MAX_TOKENS = 1
CONTEXT = int(os.environ.get("MINISGL_TEST_CONTEXT_LENGTH", "0"))


def _valid_count(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 1 <= value <= CONTEXT


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    body, path = case.body, context.operation.path
    if not isinstance(body, dict) or path not in ("/v1/completions", "/v1/chat/completions", "/generate"):
        return
    keys = ["max_tokens", "max_completion_tokens"] if path == "/v1/chat/completions" else ["max_tokens"]
    for key in keys:
        if _valid_count(body.get(key)):
            body[key] = MAX_TOKENS
    if path != "/generate" and all(body.get(key) is None for key in keys):
        body[keys[0]] = MAX_TOKENS

"""Schema fuzzing: requests drawn from the server's own OpenAPI document (valid ones, and ones with a field broken,
plus garbage bodies, wrong methods and unknown paths) against a real server. Never a 5xx, never a hung request;
afterwards the server answers a greedy request exactly as before.

Generation is bounded to keep CI fast: a drawn ``max_tokens`` within the context (or null) is cut to 8, and a chat
request without one gets 8 (otherwise each would run to the end of the context); a drawn ``n`` above 4 is cut to 4.
"""

from __future__ import annotations

import json
from typing import Any, Dict

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from stage4_fast.harness import ServerProcess

from .common import wait_idle

EXAMPLES_PER_BODY_ENDPOINT = 140
EXAMPLES_OTHER = 90
MAX_TOKENS_CAP = 8
MAX_CHOICES_CAP = 4
CLIENT_TIMEOUT_S = 30.0  # a request that takes longer counts as hung
_sent: Dict[str, int] = {}
# no shrinking: a failure prints the request as drawn, and shrinking would replay hung requests for minutes
_SETTINGS = dict(deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                 suppress_health_check=list(HealthCheck))

_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                       st.text(max_size=20))
_json = st.recursive(_json_leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=3), max_leaves=6)


def from_schema(schema: Dict[str, Any], doc: Dict[str, Any]) -> st.SearchStrategy[Any]:
    """A value the JSON schema accepts (the subset FastAPI/pydantic emit)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(doc["components"]["schemas"][name], doc)
    if ("anyOf" in schema or "oneOf" in schema) and "properties" in schema:
        # an object with a rule across its fields (one of several combinations): drawn as the object, kept when a
        # combination holds (the combinations name no other schema)
        combinations = [jsonschema.Draft202012Validator(c) for c in schema.get("anyOf", schema.get("oneOf"))]
        plain = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf")}
        return from_schema(plain, doc).filter(lambda value: any(c.is_valid(value) for c in combinations))
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s, doc) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "string":
        return st.text(max_size=40)
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        return st.integers(None if lo is None else int(lo), None if hi is None else int(hi))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), doc), min_size=schema.get("minItems", 0),
                        max_size=max(4, schema.get("minItems", 0)))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, doc) for k, v in props.items() if k in required},
            optional={k: from_schema(v, doc) for k, v in props.items() if k not in required},
        )
    return _json


def _bounded(path: str, body: Any, max_seq_len: int) -> Any:
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if (key in body and v is None) or (isinstance(v, int) and not isinstance(v, bool)
                                           and MAX_TOKENS_CAP < v <= max_seq_len):
            body[key] = MAX_TOKENS_CAP  # null means "up to the context", as long as an absent one
    if path == "/v1/chat/completions" and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS_CAP
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and MAX_CHOICES_CAP < n:
        body["n"] = MAX_CHOICES_CAP  # n choices are n requests
    return body


@pytest.fixture(scope="module")
def openapi(tiny_server: ServerProcess) -> Dict[str, Any]:
    r = httpx.get(f"{tiny_server.base_url}/openapi.json", timeout=10)
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def client(tiny_server: ServerProcess):
    with httpx.Client(base_url=tiny_server.base_url, timeout=CLIENT_TIMEOUT_S) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client) -> str:
    return _greedy(client)


def _greedy(client: httpx.Client) -> str:
    r = client.post("/v1/completions", json={"prompt": "The fuzzing reference:", "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _send(client: httpx.Client, method: str, path: str, content: bytes | None, schema_valid: bool) -> None:
    headers = {"content-type": "application/json"} if content is not None else {}
    with client.stream(method, path, content=content, headers=headers) as r:
        raw = r.read()  # a stream is read to its end; a hung one raises ReadTimeout
    _sent[path] = _sent.get(path, 0) + 1
    assert r.status_code < 500, (method, path, content, r.status_code, raw[:500])
    if r.headers.get("content-type", "").startswith("application/json") and raw:
        body = json.loads(raw)
        if r.status_code >= 400:
            assert set(body["error"]) >= {"message", "type", "code"}, body
            if schema_valid:  # what the schema allows never fails type/bound validation: the schema is accurate
                assert "Input should be" not in body["error"]["message"], (content, body)
    elif r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]


def _body_endpoints(doc: Dict[str, Any]) -> list[str]:
    return [p for p, ops in doc["paths"].items() if "post" in ops and "requestBody" in ops["post"]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"])
def test_fuzz_body_endpoint(path, openapi, client, tiny_server, reference):
    assert path in _body_endpoints(openapi)  # every endpoint with a body is fuzzed (checked in the summary too)
    schema = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = from_schema(schema, openapi)
    max_seq_len = httpx.get(f"{tiny_server.base_url}/v1/models").json()["data"][0]["max_model_len"]

    def broken(d: Dict[str, Any]) -> st.SearchStrategy[Any]:
        if not d:
            return _json
        return st.tuples(st.sampled_from(sorted(d)), _json).map(lambda kv: {**d, kv[0]: kv[1]})

    kinds = st.one_of(
        valid.map(lambda b: ("valid", b)),
        valid.flatmap(broken).map(lambda b: ("broken", b)),
        _json.map(lambda b: ("json", b)),
        st.binary(max_size=40).map(lambda b: ("bytes", b)),
    )

    @settings(max_examples=EXAMPLES_PER_BODY_ENDPOINT, **_SETTINGS)
    @given(kinds)
    def run(case):
        kind, body = case
        content = body if kind == "bytes" else json.dumps(_bounded(path, body, max_seq_len)).encode()
        _send(client, "POST", path, content, schema_valid=kind == "valid")

    run()


def test_fuzz_other_endpoints_methods_and_paths(openapi, client):
    paths = sorted(openapi["paths"]) + ["/v1", "/nope", "/v1/completions/x", "/v1/models/../stats"]
    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]

    @settings(max_examples=EXAMPLES_OTHER, **_SETTINGS)
    @given(st.sampled_from(methods), st.sampled_from(paths), st.none() | _json)
    def run(method, path, body):
        if method == "POST" and path in _body_endpoints(openapi):
            body = _bounded(path, body, 10**9)
        _send(client, method, path, None if body is None else json.dumps(body).encode(), schema_valid=False)

    run()


def test_after_fuzzing_the_server_is_alive_idle_and_correct(client, reference, tiny_server):
    total = sum(_sent.values())
    print(f"fuzzed {total} requests: {_sent}")
    assert total >= 500, _sent
    assert client.get("/health").status_code == 200
    wait_idle(tiny_server)
    assert _greedy(client) == reference

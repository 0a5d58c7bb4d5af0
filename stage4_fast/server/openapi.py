"""The OpenAPI document (`/openapi.json`, `/docs`) made to tell the truth about this server (not upstream).

Each operation lists the statuses it answers with OpenAI's error body (its own and the front door's), not FastAPI's
422; streamed answers are ``text/event-stream``; the model's bounds are filled in. Schemathesis checks it (tests)."""

from __future__ import annotations

from typing import Any, Dict

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from .guard import OPEN_PATHS
from .protocol.common import BOUND_KEY


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


_DESCRIPTIONS = {400: "invalid request: a value, an unsupported or unknown field, a prompt the model cannot take",
                 401: "missing or wrong API key", 404: "unknown model",
                 413: "request body larger than --max-request-bytes",
                 503: "overloaded (with Retry-After), stopping, or a worker died"}
# one server-sent event: `data:` carries a JSON chunk, the last one `[DONE]`
SSE = {"text/event-stream": {"schema": {"type": "object", "properties": {"data": {"type": "string"}},
                                        "required": ["data"]}}}


def error_responses(*statuses: int, streams: bool = False) -> Dict[int | str, Dict[str, Any]]:
    """A route's own error statuses (and its event-stream 200) for FastAPI's ``responses=``."""
    responses: Dict[int | str, Dict[str, Any]] = {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
                                                  for status in statuses}
    if streams:
        responses[200] = {"content": SSE, "description": "JSON, or with `\"stream\": true` server-sent events"}
    return responses


def _fill_bounds(node: Any, bounds: Dict[str, int]) -> None:
    """Replace each `x-bound` marker (protocol/common.py) with the maximum it stands for on its integer."""
    if not isinstance(node, dict):
        for item in node if isinstance(node, list) else ():
            _fill_bounds(item, bounds)
        return
    if (kind := node.pop(BOUND_KEY, None)) is not None:
        for target in [node, *node.get("anyOf", [])]:
            if target.get("type") == "integer":
                target["maximum"] = bounds[kind] - (1 if kind == "vocab_size" else 0)
                if kind == "vocab_size":
                    target["minimum"] = 0
    for value in node.values():
        _fill_bounds(value, bounds)


def install_openapi(app: FastAPI, *, context_length: int, vocab_size: int, api_key: bool) -> None:
    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes, description=app.description)
        error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
        for path, operation in ((p, op) for p, item in doc.get("paths", {}).items() for op in item.values()):
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # never sent: validation errors are 400
            shared = [400, 413] + ([401] if api_key and path not in OPEN_PATHS else [])
            for status in shared:
                responses.setdefault(str(status), {"description": _DESCRIPTIONS[status],
                                                   "content": {"application/json": {"schema": error_ref}}})
            if api_key and path not in OPEN_PATHS:
                operation["security"] = [{"bearer": []}]
        schemas = doc["components"]["schemas"]  # ErrorResponse is there: the routes' error_responses name it
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        if api_key:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        _fill_bounds(doc, {"context_length": context_length, "vocab_size": vocab_size})
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]

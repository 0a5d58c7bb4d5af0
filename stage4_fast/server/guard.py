"""The front door (not upstream): Bearer auth, a body size limit, the request counter.

An ASGI middleware sees every request before FastAPI reads a body; an oversized body is refused from its
Content-Length or as soon as the bytes read exceed it."""

from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable, Dict

from fastapi import HTTPException

from .metrics import ServerMetrics

Scope = Dict[str, Any]
Message = Dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials


class _BodyTooLarge(HTTPException):
    """Raised from ``receive``: FastAPI passes an HTTPException through (any other would become its generic 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body exceeds {limit} bytes")


def _error(status: int, message: str, code: str, type: str = "invalid_request_error") -> bytes:
    return json.dumps({"error": {"message": message, "type": type, "param": None, "code": code}}).encode()


class GuardMiddleware:
    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int, metrics: ServerMetrics) -> None:
        self.app, self.max_request_bytes, self.metrics = app, max_request_bytes, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        status_seen: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
                self.metrics.count_request(path, message["status"])
            await send(message)

        async def reply(status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:  # type: ignore
            await counting_send({"type": "http.response.start", "status": status,
                                 "headers": [(b"content-type", b"application/json"), *headers]})
            await send({"type": "http.response.body", "body": body})

        headers = dict(scope["headers"])
        if self.expected is not None and path not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time: no key guessing by timing
                await reply(401, _error(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                        "invalid_api_key"), [(b"www-authenticate", b"Bearer")])
                return
        too_large = _error(413, f"the request body exceeds {self.max_request_bytes} bytes", "request_too_large")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
            await reply(413 if length.isdigit() else 400,
                        too_large if length.isdigit() else _error(400, "bad Content-Length", "invalid_request"))
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_request_bytes:
                    raise _BodyTooLarge(self.max_request_bytes)
            return message

        try:
            await self.app(scope, limited_receive, counting_send)
        except _BodyTooLarge:
            if not status_seen:
                await reply(413, too_large)

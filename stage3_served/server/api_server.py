"""The OpenAI-compatible HTTP API (plain and SSE), models, health, stats, and upstream's /generate.

What only the backend can check (prompt length, token ids) comes back as the request's first reply; we wait for it
before answering, so even a streamed request the scheduler refuses gets a real 4xx status."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Dict, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core import SamplingParams
from .args import ServerArgs
from .frontend import BackendUnavailable, FrontendManager, QueueFull, RequestRejected
from .guard import GuardMiddleware
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .openapi import error_responses, install_openapi
from .protocol.chat import ChatCompletionRequest
from .protocol.common import APIError, unknown_field_message, usage_dict
from .protocol.completions import CompletionRequest, GenerateRequest
from .protocol.sampling import SamplingFields
from .stream import Delta, generate_deltas

T = TypeVar("T")
# each endpoint's request model: the fields it implements (see protocol/)
REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/generate": GenerateRequest}


@dataclass
class BackendInfo:  # what the scheduler reported when it became ready
    max_seq_len: int
    num_pages: int
    page_size: int
    vocab_size: int


class ClientGone(Exception):
    pass


def create_app(config: ServerArgs, backend: BackendInfo) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()  # the worker watchdog thread reaches the frontend through it
        app.state.frontend = FrontendManager(config, metrics)
        try:
            yield
        finally:
            app.state.frontend.shutdown()

    metrics = ServerMetrics()
    app = FastAPI(title="mini-sglang stage3_served", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_request_bytes=config.max_request_bytes,
                       metrics=metrics)
    app.state.metrics, app.state.config, app.state.backend = metrics, config, backend
    app.state.created = int(time.time())
    _install_error_handlers(app)
    _add_status_routes(app)
    _add_completion_routes(app)
    _add_chat_routes(app)
    install_openapi(app, context_length=backend.max_seq_len, vocab_size=backend.vocab_size,
                    api_key=config.api_key is not None)
    return app


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        kind = first.get("type")
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if kind == "json_invalid":
            return _error_response(APIError(400, "the request body is not valid JSON", "invalid_json"))
        if kind == "not_implemented":  # a known field at a value that asks for something we do not do
            param = first["ctx"]["param"]
            return _error_response(APIError(400, str(first["msg"]), "unsupported_parameter", param=param))
        if kind == "extra_forbidden":  # no field of that name: refused, never ignored
            model = REQUEST_MODELS.get(request.url.path) if len(loc) == 1 else None
            message = unknown_field_message(model, loc[-1]) + (f" in {'.'.join(loc[:-1])}" if len(loc) > 1 else "")
            return _error_response(APIError(400, message, "unknown_parameter", param=where))
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg"))
        code = "missing_required_parameter" if kind == "missing" else "invalid_value"
        return _error_response(APIError(400, message, code, param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        # a 405 carries Starlette's Allow header (RFC 9110)
        return _error_response(APIError(exc.status_code, str(exc.detail), code or "http_error", headers=exc.headers))

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's code for "client closed the request"

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug, but keep OpenAI's shape
        return _error_response(APIError(500, f"internal error: {exc!r}", "internal_error", type="server_error"))


def _unavailable(reason: str) -> APIError:
    return APIError(503, reason, "server_unavailable", type="server_error")


def _check_model(app: FastAPI, model: str | None) -> str:
    config: ServerArgs = app.state.config
    if model is not None and model not in config.model_ids:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {config.served_model_name!r}",
                       "model_not_found", param="model")
    return config.served_model_name


def _within_context(app: FastAPI, param: str, max_tokens: int | None) -> None:
    max_seq_len = app.state.backend.max_seq_len
    if max_tokens is not None and max_tokens > max_seq_len:
        raise APIError(400, f"{param}={max_tokens} exceeds the context length of {max_seq_len} tokens",
                       "context_length_exceeded", param=param)


def _sampling_params(app: FastAPI, req: SamplingFields, max_tokens: int | None) -> SamplingParams:
    max_seq_len = app.state.backend.max_seq_len
    _within_context(app, "max_tokens", max_tokens)
    return SamplingParams(
        temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, ignore_eos=req.ignore_eos,
        # none given: as many as fit (the scheduler clamps to the context left after the prompt)
        max_tokens=max_tokens if max_tokens is not None else max_seq_len,
        seed=req.seed, stop_token_ids=list(req.stop_token_ids or []), skip_special_tokens=req.skip_special_tokens,
    )


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, or cancel it and raise ClientGone if the client leaves first (Starlette covers streams)."""
    work_task, gone_task = asyncio.ensure_future(work), asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, gone_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with suppress(BaseException):
                await work_task
    if not work_task.done() or work_task.cancelled():
        raise ClientGone()
    return work_task.result()


RETRY_AFTER_S = 1  # a full queue drains within seconds; clients back off at least this long


def _backend_error(exc: Exception) -> APIError:
    if isinstance(exc, RequestRejected):
        return APIError(400, str(exc), "invalid_request")
    if isinstance(exc, QueueFull):
        return APIError(503, f"the server is overloaded: {exc}; retry later", "queue_full", type="server_error",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return _unavailable(str(exc))


async def _start(request: Request, deltas: AsyncIterator[Delta]) -> Delta:
    """The first delta, or the request's rejection as an APIError."""
    try:
        return await _unless_disconnected(request, deltas.__anext__())
    except (RequestRejected, BackendUnavailable, QueueFull) as e:
        raise _backend_error(e) from None


async def _collect(request: Request, deltas: AsyncIterator[Delta]) -> Delta:
    async def run() -> Delta:
        parts: list[str] = []
        async for d in deltas:
            parts.append(d.text)
            if d.finish_reason is not None:
                return Delta("".join(parts), d.finish_reason, d.prompt_tokens, d.completion_tokens, d.cached_tokens)
        raise BackendUnavailable("the request ended without a final reply")

    try:
        return await _unless_disconnected(request, run())
    except (RequestRejected, BackendUnavailable, QueueFull) as e:
        raise _backend_error(e) from None
    finally:
        await deltas.aclose()  # removes the request's entry (and aborts it if it had not finished)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _sse_stream(first: Delta, deltas: AsyncIterator[Delta], make_chunk, usage_chunk,
                      head: bool = False) -> AsyncIterator[str]:
    """``make_chunk(None)`` first if ``head``, then chunks for every non-empty delta and the final one; an error
    after the start ends the stream with an error event (the status line is long gone)."""
    try:
        if head:
            yield _sse(make_chunk(None))
        d: Delta | None = first
        while d is not None:
            if d.text or d.finish_reason is not None:
                yield _sse(make_chunk(d))
            if d.finish_reason is not None:
                if usage_chunk is not None:
                    yield _sse(usage_chunk(d))
                break
            d = await deltas.__anext__()
    except (RequestRejected, BackendUnavailable) as e:
        yield _sse(_backend_error(e).body())
    finally:
        await deltas.aclose()
    yield "data: [DONE]\n\n"


def _stream_response(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _frontend(app: FastAPI) -> FrontendManager:
    fm: FrontendManager = app.state.frontend
    if fm.dead_reason is not None:
        raise _unavailable(fm.dead_reason)
    return fm


async def _scheduler_stats(fm: FrontendManager) -> Dict[str, Any]:
    try:
        return await fm.query_stats()
    except (TimeoutError, asyncio.TimeoutError, BackendUnavailable) as e:
        raise _unavailable(f"no stats from the scheduler: {e!r}") from None


def _add_status_routes(app: FastAPI) -> None:
    @app.get("/health", responses=error_responses(503))
    async def health() -> Dict[str, str]:
        _frontend(app)
        return {"status": "ok"}

    # a probe some clients send; out of the schema (one operation id cannot name several methods)
    @app.api_route("/v1", methods=["GET", "POST", "HEAD", "OPTIONS"], include_in_schema=False)
    async def v1_root() -> Dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Dict[str, Any]:
        config: ServerArgs = app.state.config
        card = {"id": config.served_model_name, "object": "model", "created": app.state.created,
                "owned_by": "mini-sglang", "root": config.model_path, "max_model_len": app.state.backend.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.get("/v1/stats", responses=error_responses(503))
    async def stats() -> Dict[str, Any]:
        """The scheduler's KV pool / prefix cache / queue figures and the requests in flight here."""
        fm = _frontend(app)
        scheduler = await _scheduler_stats(fm)
        return {"scheduler": scheduler, "frontend": {"inflight_requests": fm.num_inflight}}

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(503))
    async def metrics() -> Response:
        """Prometheus text format; the gauges are the scheduler's stats at this moment."""
        fm = _frontend(app)
        scheduler = await _scheduler_stats(fm)
        return Response(app.state.metrics.render(scheduler, fm.num_requests), media_type=CONTENT_TYPE_LATEST)


def _add_completion_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", responses=error_responses(404, 503, streams=True))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        model = _check_model(app, req.model)
        params = _sampling_params(app, req, req.max_tokens)
        deltas = generate_deltas(_frontend(app), req.prompt, params, req.stop_list())
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(d: Delta) -> Dict[str, Any]:
            choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
            return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]}

        return await _respond(request, req, deltas, chunk, rid, created, model, chat=False)

    @app.post("/generate", responses=error_responses(503, streams=True))
    async def generate(req: GenerateRequest, request: Request) -> Response:
        """Upstream's greedy endpoint; a streamed event carries ``{"text": ...}`` (raw text broke on newlines)."""
        params = _sampling_params(app, SamplingFields(temperature=0.0, ignore_eos=req.ignore_eos), req.max_tokens)
        deltas = generate_deltas(_frontend(app), req.prompt, params, [])
        if not req.stream:
            d = await _collect(request, deltas)
            return JSONResponse({"text": d.text, "finish_reason": d.finish_reason,
                                 "usage": usage_dict(d.prompt_tokens, d.completion_tokens, d.cached_tokens)})
        first = await _start(request, deltas)
        return _stream_response(_sse_stream(first, deltas, lambda d: {"text": d.text}, None))


def _add_chat_routes(app: FastAPI) -> None:
    """/v1/chat/completions."""
    @app.post("/v1/chat/completions", responses=error_responses(404, 503, streams=True))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        model = _check_model(app, req.model)
        for name in ("max_completion_tokens", "max_tokens"):  # either may be sent; both must fit
            _within_context(app, name, getattr(req, name))
        params = _sampling_params(app, req, req.max_completion_tokens or req.max_tokens)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        deltas = generate_deltas(_frontend(app), messages, params, req.stop_list())
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(d: Delta | None) -> Dict[str, Any]:
            # as OpenAI: a first chunk that names the role (d is None), content chunks, a final empty delta
            delta: Dict[str, Any] = {"content": d.text} if d is not None and d.text else {}
            if d is None:
                delta = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": d and d.finish_reason}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [choice]}

        return await _respond(request, req, deltas, chunk, rid, created, model, chat=True)


async def _respond(request: Request, req: SamplingFields, deltas: AsyncIterator[Delta], chunk, rid: str,
                   created: int, model: str, chat: bool) -> Response:
    if req.stream:
        first = await _start(request, deltas)
        obj = "chat.completion.chunk" if chat else "text_completion"

        def usage_chunk(d: Delta) -> Dict[str, Any]:
            return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": usage_dict(d.prompt_tokens, d.completion_tokens, d.cached_tokens)}

        with_usage = req.stream_options is not None and req.stream_options.include_usage
        return _stream_response(_sse_stream(first, deltas, chunk, usage_chunk if with_usage else None, head=chat))
    d = await _collect(request, deltas)
    if chat:
        choice: Dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": d.text},
                                  "logprobs": None, "finish_reason": d.finish_reason}
    else:
        choice = {"index": 0, "text": d.text, "logprobs": None, "finish_reason": d.finish_reason}
    return JSONResponse({
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
        "model": model, "choices": [choice],
        "usage": usage_dict(d.prompt_tokens, d.completion_tokens, d.cached_tokens),
    })

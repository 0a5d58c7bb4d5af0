"""The OpenAI-compatible HTTP API (plain and SSE), models, health, stats, and upstream's /generate.

What only the backend can check (prompt length, token ids) comes back as the request's first reply; we wait for it
before answering, so even a streamed request the scheduler refuses gets a real 4xx status."""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Sequence, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core import SamplingParams
from .args import ServerArgs
from .choices import close_all, collect_choice, first_deltas, merged_deltas, open_choices, totals
from .frontend import BackendUnavailable, FrontendManager, QueueFull, RequestRejected
from .guard import GuardMiddleware
from .logprobs import CompletionLogprobs, chat_logprobs
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .openapi import error_responses, install_openapi
from .protocol.chat import ChatCompletionRequest
from .protocol.common import APIError, unknown_field_message, usage_dict
from .protocol.completions import CompletionRequest, GenerateRequest
from .protocol.sampling import SamplingFields
from .protocol.tokenize import DetokenizeRequest, TokenizeRequest
from .reasoning import ReasoningStream, split_reasoning
from .stream import Delta, DeltaStream
from .tokenize_api import add_tokenize_routes
from .tool_calls import tool_call_reader

T = TypeVar("T")
# each endpoint's request model: the fields it implements (see protocol/)
REQUEST_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/generate": GenerateRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


@dataclass
class BackendInfo:  # what the scheduler reported when it became ready
    max_seq_len: int
    num_pages: int
    page_size: int
    vocab_size: int


class ClientGone(Exception):
    pass


def create_app(config: ServerArgs, backend: BackendInfo, api_index: int = 0, created: int | None = None,
               on_ready: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """``created``: the /v1/models timestamp (equal in every process); ``on_ready``: awaited before any answer."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()  # the worker watchdog thread reaches the frontend through it
        app.state.frontend = FrontendManager(config, metrics, api_index)
        if on_ready is not None:
            await on_ready()  # (uvicorn opens the sockets after the lifespan's start-up)
        try:
            yield
        finally:
            app.state.frontend.shutdown()

    metrics = ServerMetrics(multiprocess=config.api_server_count > 1)
    app = FastAPI(title="mini-sglang stage4_fast", lifespan=lifespan)
    app.add_middleware(GuardMiddleware, api_key=config.api_key, max_request_bytes=config.max_request_bytes,
                       metrics=metrics)
    app.state.metrics, app.state.config, app.state.backend = metrics, config, backend
    app.state.created = int(time.time()) if created is None else created
    _install_error_handlers(app)
    _add_status_routes(app)
    _add_completion_routes(app)
    _add_chat_routes(app)
    add_tokenize_routes(app, _check_model)
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
            param = ".".join([*loc, first["ctx"]["param"]])  # a nested object's field named with its path
            message = f"{where}: {first['msg']}" if where else str(first["msg"])
            return _error_response(APIError(400, message, "unsupported_parameter", param=param))
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


def _sampling_params(app: FastAPI, req: SamplingFields, max_tokens: int | None, logprobs: int | None = None,
                     echo: bool = False, grammar: Dict[str, str] | None = None) -> SamplingParams:
    """``grammar``: the structured output, when not the request's own fields' (``SamplingFields.grammar``)."""
    max_seq_len = app.state.backend.max_seq_len
    _within_context(app, "max_tokens", max_tokens)
    # no max_tokens: as many as fit (the scheduler clamps to the context left after the prompt); a grammar xgrammar
    # cannot compile is a 400 from the scheduler
    return SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, ignore_eos=req.ignore_eos,
                          max_tokens=max_tokens if max_tokens is not None else max_seq_len, seed=req.seed,
                          stop_token_ids=list(req.stop_token_ids or []), skip_special_tokens=req.skip_special_tokens,
                          presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                          repetition_penalty=req.repetition_penalty, min_p=req.min_p, logit_bias=req.logit_bias_list(),
                          logprobs=logprobs, echo=echo, min_tokens=req.min_tokens,
                          **(req.grammar() if grammar is None else grammar))


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


async def _start(request: Request, streams: Sequence[AsyncIterator[Delta]]) -> List[Delta]:
    """Every choice's first delta, or the request's rejection as an APIError (every choice closed then)."""
    try:
        return await _unless_disconnected(request, first_deltas(streams))
    except (RequestRejected, BackendUnavailable, QueueFull) as e:
        raise _backend_error(e) from None
    except BaseException:
        await close_all(streams)
        raise


async def _collect(request: Request, firsts: Sequence[Delta], streams: Sequence[AsyncIterator[Delta]]) -> List[Delta]:
    """Every choice's whole output (text and logprobs joined), in choice order."""
    try:
        return list(await _unless_disconnected(request, asyncio.gather(*map(collect_choice, firsts, streams))))
    except (RequestRejected, BackendUnavailable, QueueFull) as e:
        raise _backend_error(e) from None
    finally:
        await close_all(streams)  # removes the requests' entries (and aborts those that had not finished)


def _sse(obj: Any) -> bytes:
    # orjson, as a chunk is encoded per token per stream: UTF-8 as json.dumps(ensure_ascii=False), NaN becomes null
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _sse_stream(firsts: Sequence[Delta], streams: Sequence[AsyncIterator[Delta]],
                      make_chunk: Callable[[int, Delta], Dict[str, Any]],
                      usage_chunk: Callable[[List[Delta]], Dict[str, Any]] | None,
                      heads: Sequence[Dict[str, Any]] = ()) -> AsyncIterator[bytes]:
    """``heads``, a chunk per delta that shows something, the usage at the end; a later error is an error event."""
    finals: List[Delta | None] = [None] * len(streams)
    try:
        for head in heads:
            yield _sse(head)
        async with aclosing(merged_deltas(firsts, streams)) as merged:
            async for index, d in merged:
                if isinstance(d, Exception):
                    known = isinstance(d, (RequestRejected, BackendUnavailable))
                    yield _sse((_backend_error(d) if known else _unavailable(f"the request failed: {d!r}")).body())
                    break
                if d.text or d.finish_reason is not None or d.logprobs is not None or d.prompt_logprobs is not None:
                    yield _sse(make_chunk(index, d))
                if d.finish_reason is not None:
                    finals[index] = d
            else:
                if usage_chunk is not None:
                    yield _sse(usage_chunk([d for d in finals if d is not None]))
    finally:
        await close_all(streams)
    yield b"data: [DONE]\n\n"


def _with_usage_so_far(chunk: Callable[[int, Delta | None], Dict[str, Any]],
                       firsts: Sequence[Delta]) -> Callable[[int, Delta | None], Dict[str, Any]]:
    """``chunk`` with its choice's usage so far (vLLM's continuous_usage_stats); ``d`` None: the role chunk."""
    def with_usage(index: int, d: Delta | None) -> Dict[str, Any]:
        first = firsts[index]
        usage = (usage_dict(first.prompt_tokens, 0, first.cached_tokens) if d is None
                 else usage_dict(d.prompt_tokens, d.completion_tokens, d.cached_tokens))
        return {**chunk(index, d), "usage": usage}

    return with_usage


def _stream_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _frontend(app: FastAPI) -> FrontendManager:
    fm: FrontendManager = app.state.frontend
    if fm.dead_reason is not None:
        raise _unavailable(fm.dead_reason)
    return fm


def _submit_choices(app: FastAPI, prompts: Sequence[object], params: SamplingParams, n: int, stops: List[str],
                    chat_options: Dict[str, Any] | None = None, keep_stop: bool = False,
                    user: str | None = None) -> List[DeltaStream]:
    """Every choice submitted now (``open_choices``); a refusal becomes the client's 4xx / 503."""
    fm = _frontend(app)
    if len(prompts) * n > fm.max_requests:  # could never be admitted at once: a 503 would ask for a vain retry
        raise APIError(400, f"{len(prompts) * n} choices (n times the prompts) exceed the {fm.max_requests} "
                       "requests this server admits at once", "invalid_value", param="n")
    try:
        return open_choices(fm, prompts, params, n, stops, chat_options, keep_stop, user)
    except (RequestRejected, BackendUnavailable, QueueFull) as e:
        raise _backend_error(e) from None


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
        # with several API server processes, the frontend figures are those of the one that answered
        return {"scheduler": scheduler, "frontend": {"inflight_requests": fm.num_inflight,
                                                     "api_server": fm.api_index, "api_servers": fm.api_count}}

    @app.get("/metrics", response_class=PlainTextResponse, responses=error_responses(503))
    async def metrics() -> Response:
        """Prometheus text format; the gauges are the scheduler's stats at this moment."""
        scheduler = await _scheduler_stats(_frontend(app))
        return Response(app.state.metrics.render(scheduler), media_type=CONTENT_TYPE_LATEST)


def _add_completion_routes(app: FastAPI) -> None:
    @app.post("/v1/completions", responses=error_responses(404, 503, streams=True))
    async def completions(req: CompletionRequest, request: Request) -> Response:
        model = _check_model(app, req.model)
        params = _sampling_params(app, req, req.max_tokens, logprobs=req.logprobs, echo=req.echo)
        prompts = req.prompts()
        streams = _submit_choices(app, prompts, params, req.n, req.stop_list(),
                                  keep_stop=req.include_stop_str_in_output, user=req.user)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        logprob_builders = [CompletionLogprobs() for _ in streams]

        def choice(index: int, d: Delta) -> Dict[str, Any]:
            text, prompt_logprobs = d.text, None
            if req.echo and d.prompt_logprobs is not None:  # (only the first delta carries the prompt)
                prompt = prompts[index // req.n]
                text = (prompt if isinstance(prompt, str) else d.prompt_text or "") + text
                prompt_logprobs = d.prompt_logprobs
            logprobs = None if req.logprobs is None else logprob_builders[index].format(prompt_logprobs, d.logprobs)
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": d.finish_reason}

        def chunk(index: int, d: Delta) -> Dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice(index, d)]}

        return await _respond(request, req, streams, choice, chunk, rid, created, model, chat=False)

    @app.post("/generate", responses=error_responses(503, streams=True))
    async def generate(req: GenerateRequest, request: Request) -> Response:
        """Upstream's greedy endpoint; a streamed event carries ``{"text": ...}`` (raw text broke on newlines)."""
        params = _sampling_params(app, SamplingFields(temperature=0.0, ignore_eos=req.ignore_eos), req.max_tokens)
        streams = _submit_choices(app, [req.prompt], params, 1, [])
        firsts = await _start(request, streams)
        if not req.stream:
            d = (await _collect(request, firsts, streams))[0]
            return JSONResponse({"text": d.text, "finish_reason": d.finish_reason,
                                 "usage": usage_dict(d.prompt_tokens, d.completion_tokens, d.cached_tokens)})
        return _stream_response(_sse_stream(firsts, streams, lambda i, d: {"text": d.text}, None))


def _add_chat_routes(app: FastAPI) -> None:
    """/v1/chat/completions: the thinking block read out first (--reasoning-parser), then tool calls."""
    @app.post("/v1/chat/completions", responses=error_responses(404, 503, streams=True))
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        model = _check_model(app, req.model)
        for name in ("max_completion_tokens", "max_tokens"):  # either may be sent; both must fit
            _within_context(app, name, getattr(req, name))
        reader, grammar = tool_call_reader(req, app.state.config.tool_call_parser)
        params = _sampling_params(app, req, req.max_completion_tokens or req.max_tokens,
                                  logprobs=req.num_logprobs(), grammar=grammar)
        if reader is not None and reader.mode == "auto":
            params = replace(params, skip_special_tokens=False)  # a model's <tool_call> may be a special token
        messages = [m.for_template() for m in req.messages]
        streams = _submit_choices(app, [messages], params, req.n, req.stop_list(), req.chat_options(),
                                  req.include_stop_str_in_output, req.user)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        thinking = app.state.config.reasoning_parser if req.separate_reasoning else None
        thoughts: Dict[int, ReasoningStream] = {}

        def logprobs(d: Delta) -> Dict[str, Any] | None:
            return chat_logprobs(d.logprobs) if req.logprobs else None

        def choice(index: int, d: Delta) -> Dict[str, Any]:
            message: Dict[str, Any] = {"role": "assistant", "content": d.text}
            finish = d.finish_reason
            if thinking is not None:
                message["reasoning_content"], message["content"] = split_reasoning(thinking, d.text)
            if reader is not None:
                content, calls, finish = reader.whole(message["content"], finish)
                if calls:
                    message.update(content=content, tool_calls=calls)
            return {"index": index, "message": message, "logprobs": logprobs(d), "finish_reason": finish}

        def chunk(index: int, d: Delta | None) -> Dict[str, Any]:
            # as OpenAI: a first chunk per choice that names the role (d is None), content chunks, a final one
            if d is None:
                piece = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
            else:
                text, calls, finish, reasoning = d.text, [], d.finish_reason, ""
                if thinking is not None:
                    stream = thoughts.setdefault(index, ReasoningStream(thinking, req.stream_reasoning))
                    reasoning, text = stream.feed(text, final=finish is not None)
                if reader is not None:
                    text, calls, finish = reader.piece(index, text, finish)
                parts = (("reasoning_content", reasoning), ("content", text), ("tool_calls", calls))
                delta = {name: value for name, value in parts if value}
                piece = {"index": index, "delta": delta, "logprobs": logprobs(d), "finish_reason": finish}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [piece]}

        return await _respond(request, req, streams, choice, chunk, rid, created, model, chat=True)


async def _respond(request: Request, req: SamplingFields, streams: List[AsyncIterator[Delta]], choice, chunk,
                   rid: str, created: int, model: str, chat: bool) -> Response:
    firsts = await _start(request, streams)
    obj = "chat.completion" if chat else "text_completion"
    if req.stream:
        def usage_chunk(finals: List[Delta]) -> Dict[str, Any]:
            return {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created, "model": model,
                    "choices": [], "usage": usage_dict(*totals(finals, req.n))}

        options = req.stream_options
        with_usage = options is not None and options.include_usage
        if options is not None and options.continuous_usage_stats:
            chunk = _with_usage_so_far(chunk, firsts)
        heads = [chunk(i, None) for i in range(len(streams))] if chat else []
        return _stream_response(_sse_stream(firsts, streams, chunk, usage_chunk if with_usage else None, heads))
    finals = await _collect(request, firsts, streams)
    return JSONResponse({"id": rid, "object": obj, "created": created, "model": model,
                         "choices": [choice(i, d) for i, d in enumerate(finals)],
                         "usage": usage_dict(*totals(finals, req.n))})

"""vLLM's ``/tokenize`` and ``/detokenize``: a tokenizer loaded at the first call, chats rendered by the worker's
``TokenizeManager`` (the count ``/v1/chat/completions`` would run)."""

from __future__ import annotations

import asyncio
from typing import Any, List

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from .openapi import error_responses
from .protocol.common import APIError
from .protocol.tokenize import DetokenizeRequest, TokenizeRequest


async def _manager(app: FastAPI) -> Any:
    async with app.state.tokenizer_lock:
        if app.state.tokenize_manager is None:
            from ..tokenizer.tokenize import TokenizeManager
            from ..utils.hf import load_tokenizer

            tokenizer = await asyncio.to_thread(load_tokenizer, app.state.config.model_path)
            app.state.tokenize_manager = TokenizeManager(tokenizer)
        return app.state.tokenize_manager


def _encode(manager: Any, req: TokenizeRequest) -> List[int]:
    if req.prompt is not None:
        return manager.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    messages = [m.for_template() for m in req.messages or []]
    try:
        return manager.tokenize_one(messages, req.chat_options()).tolist()
    except Exception as e:  # a template's own error (jinja2's, raise_exception) is the request's, as in the worker
        raise APIError(400, str(e), "invalid_request") from None


def add_tokenize_routes(app: FastAPI, check_model: Any) -> None:
    """``check_model(app, name)``: the chat endpoints' check of the request's ``model``."""
    app.state.tokenize_manager, app.state.tokenizer_lock = None, asyncio.Lock()

    @app.post("/tokenize", responses=error_responses(404))
    async def tokenize(req: TokenizeRequest) -> JSONResponse:
        check_model(app, req.model)
        manager = await _manager(app)
        ids = await asyncio.to_thread(_encode, manager, req)
        return JSONResponse({"count": len(ids), "max_model_len": app.state.backend.max_seq_len, "tokens": ids})

    @app.post("/detokenize", responses=error_responses(404))
    async def detokenize(req: DetokenizeRequest) -> JSONResponse:
        check_model(app, req.model)
        manager = await _manager(app)
        known = min(app.state.backend.vocab_size, len(manager.tokenizer))  # a padded vocabulary's ids have no text
        outside = next((t for t in req.tokens if not 0 <= t < known), None)
        if outside is not None:
            raise APIError(400, f"token id {outside} is outside the tokenizer's vocabulary (0..{known - 1})",
                           "invalid_value", param="tokens")
        return JSONResponse({"prompt": await asyncio.to_thread(manager.tokenizer.decode, req.tokens)})

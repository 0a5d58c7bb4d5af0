"""``n`` samples of each prompt, an engine request each, submitted at once (the radix cache shares the prefill).

Choice ``i * n + j`` is sample j of prompt i; with a seed, sample j is drawn with ``seed + j`` (as vLLM)."""

from __future__ import annotations

import asyncio
from copy import deepcopy
from dataclasses import replace
from typing import Any, AsyncIterator, Dict, List, Sequence, Tuple

from ..core import SamplingParams
from ..message import TextLogprobs
from .frontend import BackendUnavailable, FrontendManager
from .stream import Delta, DeltaStream, generate_deltas


def open_choices(frontend: FrontendManager, prompts: Sequence[object], params: SamplingParams, n: int,
                 stops: List[str], chat_options: Dict[str, Any] | None = None,
                 keep_stop: bool = False, user: str | None = None) -> List[DeltaStream]:
    """Every choice submitted now, in choice order; if one cannot be, those before it are aborted."""
    streams: List[DeltaStream] = []
    each = [params] * n if params.seed is None else [replace(params, seed=(params.seed + j) % 2**63) for j in range(n)]
    try:
        for prompt in prompts:
            for p in each:
                streams.append(generate_deltas(frontend, prompt, p, stops, chat_options, keep_stop,
                                               params.min_tokens, user))
    except BaseException:
        for stream in streams:
            frontend.abandon(stream.uid)
        raise
    return streams


async def close_all(streams: Sequence[AsyncIterator[Delta]]) -> None:
    """Closing a stream that has not finished aborts its request in the backend."""
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]


async def first_deltas(streams: Sequence[AsyncIterator[Delta]]) -> List[Delta]:
    """Every choice's first delta; if any is refused, all are closed and the first refusal raised (a 4xx)."""
    results = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        await close_all(streams)
        raise errors[0]
    return list(results)  # type: ignore[arg-type]


def merge_delta(total: Delta | None, d: Delta) -> Delta:
    """``total`` (the choice so far) followed by ``d``: texts and logprobs joined, the latest counts."""
    if total is None:  # a copy of the logprobs, which later deltas extend in place
        return replace(d, logprobs=deepcopy(d.logprobs))
    if d.logprobs is not None:
        total.logprobs = total.logprobs or TextLogprobs()
        total.logprobs.extend(d.logprobs)
    return replace(total, text=total.text + d.text, finish_reason=d.finish_reason, prompt_tokens=d.prompt_tokens,
                   completion_tokens=d.completion_tokens, cached_tokens=d.cached_tokens)


async def collect_choice(first: Delta, stream: AsyncIterator[Delta]) -> Delta:
    total = merge_delta(None, first)
    while total.finish_reason is None:
        try:
            d = await stream.__anext__()
        except StopAsyncIteration:
            raise BackendUnavailable("the request ended without a final reply") from None
        total = merge_delta(total, d)
    return total


async def merged_deltas(firsts: Sequence[Delta], streams: Sequence[AsyncIterator[Delta]]
                        ) -> AsyncIterator[Tuple[int, Delta | Exception]]:
    """(choice index, delta) as they come, to each final delta; a failure yields its exception and ends the merge."""
    queue: asyncio.Queue[Tuple[int, Delta | Exception]] = asyncio.Queue()

    async def pump(index: int, first: Delta, stream: AsyncIterator[Delta]) -> None:
        d = first
        try:
            while True:
                queue.put_nowait((index, d))
                if d.finish_reason is not None:
                    return
                d = await stream.__anext__()
        except Exception as e:
            queue.put_nowait((index, e))

    # one choice (the common case) is read directly; several are pumped into one queue by a task each
    tasks = [] if len(streams) == 1 else [asyncio.ensure_future(pump(i, f, s))
                                          for i, (f, s) in enumerate(zip(firsts, streams))]
    try:
        if not tasks:
            d: Delta = firsts[0]
            while True:
                yield 0, d
                if d.finish_reason is not None:
                    return
                try:
                    d = await streams[0].__anext__()
                except Exception as e:
                    yield 0, e
                    return
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            yield index, item
            if isinstance(item, Exception):
                return
            if item.finish_reason is not None:
                remaining -= 1
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_all(streams)


def totals(finals: Sequence[Delta], n: int) -> Tuple[int, int, int]:
    """(prompt, completion, cached) tokens: each prompt once (its first choice's), every choice's output."""
    prompts = finals[::n]
    return (sum(d.prompt_tokens for d in prompts), sum(d.completion_tokens for d in finals),
            sum(d.cached_tokens for d in prompts))


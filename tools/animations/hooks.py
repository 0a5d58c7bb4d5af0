"""Where the recorders hook into the stages: every class, method and function they wrap, in one table.

The recorders never edit a stage: they replace a method on its class for the length of one run (``wrapped``) and
put the original back afterwards. When a stage file is renamed or split, only this table changes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Any, Callable, Dict, Iterator, Tuple

# name -> "module:Owner.attribute" (or "module:function")
TARGETS: Dict[str, str] = {
    # stage 4, the offline LLM and its scheduler
    "llm4": "stage4_fast.llm:LLM",
    "sampling_params4": "stage4_fast.core:SamplingParams",
    "schedule4": "stage4_fast.scheduler.scheduler:Scheduler._schedule_next_batch",
    "forward_batch4": "stage4_fast.engine.engine:Engine.forward_batch",
    "step_log_env4": "stage4_fast.env:ENV",  # ENV.STEP_LOG: MINISGL_STEP_LOG=FILE (scheduler/step_log.py)
    # stage 4, the tokenizer / detokenizer worker's handling of one batch of messages, and its managers
    "tokenizer_handle4": "stage4_fast.tokenizer.server:_handle",
    "tokenize_manager4": "stage4_fast.tokenizer.tokenize:TokenizeManager",
    "detokenize_manager4": "stage4_fast.tokenizer.detokenize:DetokenizeManager",
    "tokenize_msg4": "stage4_fast.message:TokenizeMsg",
    "expand_columns4": "stage4_fast.message:expand_columns",
    # stage 4, tensor parallelism: every collective of the layers goes through this front door
    "all_reduce4": "stage4_fast.distributed.impl:DistributedCommunicator.all_reduce",
    "tp_split_problem4": "stage4_fast.utils.hf:tp_split_problem",  # why a model's heads do not split over N ranks
    # stage 4, the decode graphs (a CPU emulation of capture / replay)
    "graph_capture4": "stage4_fast.engine.graph:GraphRunner._capture_graphs",
    "graph_replay4": "stage4_fast.engine.graph:GraphRunner.replay",
    "graph_copy4": "stage4_fast.engine.graph:GraphCaptureBuffer.copy_from",
    # stage 2, the radix prefix cache and the offline LLM that drives it
    "llm2": "stage2_scheduled.llm:LLM",
    "sampling_params2": "stage2_scheduled.core:SamplingParams",
    "radix_match2": "stage2_scheduled.kvcache.radix_cache:RadixPrefixCache.match_prefix",
    "radix_insert2": "stage2_scheduled.kvcache.radix_cache:RadixPrefixCache.insert_prefix",
    "radix_evict2": "stage2_scheduled.kvcache.radix_cache:RadixPrefixCache.evict",
    "radix_split2": "stage2_scheduled.kvcache.radix_cache:RadixTreeNode.split_at",
}


def split(name: str) -> Tuple[str, str]:
    """(module, dotted attribute path) of a table entry."""
    module, _, attr = TARGETS[name].partition(":")
    return module, attr


def lookup(name: str) -> Any:
    module, attr = split(name)
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _owner(name: str) -> Tuple[Any, str]:
    module, attr = split(name)
    *path, last = attr.split(".")
    owner: Any = importlib.import_module(module)
    for part in path:
        owner = getattr(owner, part)
    return owner, last


Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def patch(name: str, make: Wrapper) -> Callable[[], None]:
    """Replace the target with ``make(original)``; returns the function that puts the original back."""
    owner, last = _owner(name)
    original = owner.__dict__[last] if isinstance(owner, type) else getattr(owner, last)
    replacement = functools.wraps(original)(make(original))
    setattr(owner, last, replacement)
    return lambda: setattr(owner, last, original)


@contextlib.contextmanager
def wrapped(**makers: Wrapper) -> Iterator[None]:
    """``with wrapped(schedule4=lambda orig: ...):`` the named targets wrapped for the block's length."""
    undo = []
    try:
        for name, make in makers.items():
            undo.append(patch(name, make))
        yield
    finally:
        for restore in reversed(undo):
            restore()


def after(record: Callable[..., None]) -> Wrapper:
    """A wrapper that calls the original, then ``record(result, *args, **kwargs)``; returns the result."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            record(result, *args, **kwargs)
            return result

        return wrapper

    return make

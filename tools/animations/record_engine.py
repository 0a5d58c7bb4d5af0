"""Recorders that run stage 4's offline LLM in this process: a request's trip through the workers, continuous
batching, the overlap loop's timeline and the decode graphs' replays. Each returns a ``Recording``: the events, in
the order they happened, plus the counts the stage itself reports, which the tests hold the frames to."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List
from unittest import mock

import torch

from .hooks import after, lookup, wrapped

PROMPTS = [
    "The capital of France is",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Water boils at",
    "The quick brown fox",
]


@dataclass
class Recording:
    name: str
    events: List[Dict[str, Any]]
    facts: Dict[str, Any] = field(default_factory=dict)  # what the stage itself counted, for the tests


def _params(max_tokens: int, stage: str = "4") -> Any:
    # ignore_eos: a tiny random model may draw EOS at once; every request runs its planned length
    return lookup(f"sampling_params{stage}")(max_tokens=max_tokens, ignore_eos=True)


def run_llm(model: str, prompts: List[str], params: Any, **kwargs: Any) -> None:
    """One offline `generate` of stage4's LLM over the prompts (fp32 unless asked), shut down after it."""
    kwargs.setdefault("dtype", torch.float32)
    llm = lookup("llm4")(model, **kwargs)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def _uids(reqs: Any) -> List[int]:
    return [int(r.uid) for r in reqs]


# -- 1. a request's life -------------------------------------------------------------------------------------
def record_request_life(model: str, n_requests: int = 3, max_tokens: int = 4) -> Recording:
    """The API server's TokenizeMsg goes through the real tokenizer handler (UserMsg), the scheduler, and back
    through the detokenizer (UserReply). The workers run in this process, one after another, so the arrows are
    the messages they would send over ZMQ; requests arrive two scheduler loops apart."""
    events: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    llm = _worker_llm()(model, dtype=torch.float32, max_running_req=8)
    tok = lookup("tokenize_manager4")(llm.tokenizer)
    detok = lookup("detokenize_manager4")(llm.tokenizer)
    handle, expand = lookup("tokenizer_handle4"), lookup("expand_columns4")
    incoming = [lookup("tokenize_msg4")(uid, PROMPTS[uid % len(PROMPTS)], _params(max_tokens))
                for uid in range(n_requests)]
    state = {"loop": 0, "done": 0}

    def log(src: str, dst: str, msg: Any) -> None:
        events.append({"t_ms": 1e3 * (time.perf_counter() - t0), "uid": int(msg.uid), "src": src, "dst": dst,
                       "type": type(msg).__name__, "finished": bool(getattr(msg, "finished", False))})

    def receive(blocking: bool = False) -> list:
        state["loop"] += 1
        arriving = incoming[:1] if state["loop"] % 2 == 1 else []
        del incoming[: len(arriving)]
        for msg in arriving:
            log("api", "tokenizer", msg)
        _, to_backend = handle(arriving, tok, detok) if arriving else ([], [])
        for msg in to_backend:
            log("tokenizer", "scheduler", msg)
        if blocking and not incoming and state["done"] == n_requests:
            raise _Finished
        return to_backend

    def send(reply: list) -> None:
        for msg in expand(list(reply)):
            log("scheduler", "detokenizer", msg)
        to_frontend, _ = handle(expand(list(reply)), tok, detok)
        for msg in to_frontend:
            log("detokenizer", "api", msg)
            state["done"] += bool(msg.finished)

    llm.receive_hook, llm.send_hook = receive, send
    try:
        llm.run_forever()
    except _Finished:
        pass
    finally:
        llm.shutdown()
    return Recording("request-life", events, {"requests": n_requests, "max_tokens": max_tokens})


class _Finished(Exception):
    pass


def _worker_llm() -> type:
    """The offline LLM whose receive / send go to the in-process workers (the scheduler's I/O mixin routes to the
    class's offline_receive_msg / offline_send_result, so they are overridden here, not on the instance)."""

    class WorkerLLM(lookup("llm4")):  # type: ignore[misc]
        def offline_receive_msg(self, blocking: bool = False) -> list:
            return self.receive_hook(blocking)

        def offline_send_result(self, reply: list) -> None:
            self.send_hook(reply)

    return WorkerLLM


# -- 2. continuous batching ----------------------------------------------------------------------------------
def _batch_event(scheduler: Any, fwd_input: Any) -> Dict[str, Any]:
    cache = scheduler.cache_manager
    event: Dict[str, Any] = {
        "waiting": [int(p.uid) for p in scheduler.prefill_manager.pending_list],
        # admitted and holding their pages, whether or not this batch runs them (a prefill step leaves them out)
        "running": sorted(_uids(scheduler.decode_manager.running_reqs)),
        "pages_used": int(cache.num_pages - len(cache.free_slots)),
        "pages_cached": int(cache.prefix_cache.size_info.evictable_size // cache.page_size),
        "num_pages": int(cache.num_pages),
    }
    if fwd_input is None:
        return {**event, "kind": None, "batch": [], "prefill": []}
    batch = fwd_input.batch
    return {**event, "kind": "prefill" if batch.is_prefill else "decode", "batch": _uids(batch.reqs),
            "prefill": _uids(batch.reqs[: batch.num_prefill_reqs]) if batch.is_prefill else [],
            "tokens": int(fwd_input.input_tuple[0].numel())}


def record_continuous_batching(model: str, n_requests: int = 6, max_running: int = 3) -> Recording:
    """Six requests of different lengths through a scheduler that runs at most ``max_running`` at once, with a small
    prefill budget: later requests wait, and join as earlier ones finish."""
    events: List[Dict[str, Any]] = []
    forwards = [0]

    def on_schedule(fwd_input: Any, scheduler: Any) -> None:
        event = _batch_event(scheduler, fwd_input)
        if event["kind"] is not None:
            event["step"] = len([e for e in events if e["kind"] is not None])
            events.append(event)

    def count_forward(result: Any, *args: Any, **kwargs: Any) -> None:
        forwards[0] += 1

    params = [_params(3 + 2 * (i % 3)) for i in range(n_requests)]
    with wrapped(schedule4=after(on_schedule), forward_batch4=after(count_forward)):
        run_llm(model, PROMPTS[:n_requests], params, max_running_req=max_running, max_extend_tokens=16,
                num_page_override=64)
    return Recording("continuous-batching", events,
                     {"forward_steps": forwards[0], "requests": n_requests, "max_running": max_running})


# -- 4. overlap scheduling -----------------------------------------------------------------------------------
def record_overlap(model: str, n_requests: int = 3, max_tokens: int = 5) -> Recording:
    """The overlap loop's own step log (MINISGL_STEP_LOG), plus when each forward began and ended."""
    forwards: List[Dict[str, float]] = []

    def timed(original: Any) -> Any:
        def forward_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(self, batch, *args, **kwargs)
            forwards.append({"t0": start, "t1": time.perf_counter(),
                             "kind": "prefill" if batch.is_prefill else "decode"})
            return out

        return forward_batch

    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "steps.jsonl"
        with mock.patch.dict(os.environ, {"MINISGL_STEP_LOG": str(log_path)}), wrapped(forward_batch4=timed):
            run_llm(model, PROMPTS[:n_requests], _params(max_tokens), overlap_scheduling=True)
        rows = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    events = _merge_steps(rows, forwards)
    return Recording("overlap", events, {"forward_steps": len(forwards), "loops": len(rows)})


def _merge_steps(rows: List[Dict[str, Any]], forwards: List[Dict[str, float]]) -> List[Dict[str, Any]]:
    """One event per loop: its phases as [start, end] in ms since the first loop, and the forward it launched
    (the launch phase holds it: on CPU the forward runs synchronously on the host's thread)."""
    if not rows:
        return []
    origin = rows[0]["t"]
    events = []
    pending = list(forwards)
    for row in rows:
        t = 1e3 * (row["t"] - origin)
        phases = {}
        for phase in ("receive", "schedule", "launch", "process"):
            phases[phase] = [t, t + row[f"{phase}_ms"]]
            t += row[f"{phase}_ms"]
        event = {"batch": row["batch"], "reqs": row["reqs"], "phases": phases, "wait_ms": row["wait_ms"],
                 "pending": row["pending"], "running": row["running"]}
        if row["batch"] is not None and pending:
            fwd = pending.pop(0)
            event["forward"] = [1e3 * (fwd["t0"] - origin), 1e3 * (fwd["t1"] - origin)]
        events.append(event)
    return events


# -- 6. decode graphs ----------------------------------------------------------------------------------------
def record_cuda_graph(model: str, n_requests: int = 5, max_bs: int = 8) -> Recording:
    """Decode steps replayed from the CPU emulation of CUDA graphs: the sizes captured, then per replay the real
    batch, its padding to the captured size, and the values copied into the fixed input buffers."""
    events: List[Dict[str, Any]] = []

    def on_capture(result: Any, runner: Any, *args: Any) -> None:
        events.append({"event": "capture", "sizes": list(runner.graph_bs_list), "max_bs": int(runner.max_graph_bs)})

    def on_copy(result: Any, buffer: Any, batch: Any) -> None:
        n = batch.padded_size
        events.append({"event": "replay", "size": int(batch.size), "padded": int(n), "uids": _uids(batch.reqs),
                       "input_ids": buffer.input_ids[:n].tolist(), "positions": buffer.positions[:n].tolist(),
                       "out_loc": buffer.out_loc[:n].tolist(), "buffer_len": int(buffer.input_ids.shape[0])})

    replays = [0]

    def count_replay(result: Any, *args: Any) -> None:
        replays[0] += 1

    params = [_params(2 + 2 * i) for i in range(n_requests)]
    with wrapped(graph_capture4=after(on_capture), graph_copy4=after(on_copy), graph_replay4=after(count_replay)):
        run_llm(model, PROMPTS[:n_requests], params, cuda_graph_max_bs=max_bs)
    return Recording("cuda-graph", events, {"replays": replays[0]})

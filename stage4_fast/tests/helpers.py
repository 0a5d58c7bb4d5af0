"""Helpers for stage2's own tests: a tiny LLM, and test doubles that make overlap races visible on CPU.

On CPU the forward is synchronous, so a batch "in flight" has in fact already completed and a race between the
scheduler and the device cannot corrupt anything. `InFlightTracker` restores the GPU's point of view: a launched
batch counts as running until the scheduler waits on its `copy_done_event`, and handing out a request slot or a KV
page that such a batch uses is reported as the race it would be on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Set, Tuple

import torch

from stage4_fast.core import Batch, SamplingParams
from stage4_fast.llm import LLM
from stage4_fast.message import BaseTokenizerMsg, DetokenizeMsg, expand_columns


def make_llm(model: Path | str, **kwargs) -> LLM:
    """An fp32 LLM on a tiny model (conftest's `tiny_model` fixture builds one without a tokenizer)."""
    kwargs.setdefault("dtype", torch.float32)
    # bounded KV pool: on a GPU an unbounded one takes 90% of the free memory and the next test's LLM cannot fit
    kwargs.setdefault("num_page_override", 16384 // kwargs.get("page_size", 1))
    return LLM(str(model), **kwargs)


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def watch_batches(llm: LLM, on_batch: Callable[[Batch], None]) -> None:
    """Call ``on_batch`` with every batch the engine is about to run (the tests that check what gets scheduled)."""
    forward_batch = llm.engine.forward_batch

    def watched(batch: Batch, args, before_sampling=None):
        on_batch(batch)
        return forward_batch(batch, args, before_sampling)

    llm.engine.forward_batch = watched  # type: ignore[method-assign]


class ReplyRecorder:
    """Records every message the scheduler sends, then passes it on to the LLM."""

    def __init__(self, llm: LLM) -> None:
        self.msgs: List[DetokenizeMsg] = []
        inner = llm.send_result

        def send_result(reply: List[BaseTokenizerMsg]) -> None:
            self.msgs.extend(expand_columns(reply))  # (a step's plain tokens travel as columns)
            inner(reply)

        llm.send_result = send_result  # type: ignore[method-assign]

    def by_uid(self) -> Dict[int, List[DetokenizeMsg]]:
        out: Dict[int, List[DetokenizeMsg]] = {}
        for msg in self.msgs:
            out.setdefault(msg.uid, []).append(msg)
        return out


class _TrackedEvent:
    def __init__(self, tracker: InFlightTracker, batch_no: int) -> None:
        self.tracker, self.batch_no = tracker, batch_no

    def synchronize(self) -> None:
        self.tracker.in_flight.pop(self.batch_no, None)

    def query(self) -> bool:
        return self.batch_no not in self.tracker.in_flight


class InFlightTracker:
    """Treats a launched batch as still running on the device until its copy_done_event is waited on, and records
    every request slot or KV page handed out while such a batch still uses it."""

    def __init__(self, llm: LLM) -> None:
        self.in_flight: Dict[int, Tuple[Set[int], Set[int]]] = {}  # batch no -> (rows, page starts) it uses
        self.violations: List[str] = []
        self.launched_uids: List[Set[int]] = []
        ps = llm.cache_manager.page_size
        engine, table, cache = llm.engine, llm.table_manager, llm.cache_manager
        forward_batch, allocate_slot, allocate_pages = engine.forward_batch, table.allocate, cache._allocate

        def tracked_forward(batch, args, before_sampling=None):
            rows = {r.table_idx for r in batch.reqs}
            slots = torch.cat([engine.page_table[r.table_idx, : r.device_len] for r in batch.reqs])
            pages = set((slots // ps * ps).tolist())
            # in flight from here: the previous batch may be processed inside (before_sampling) and free things
            batch_no = len(self.launched_uids)
            self.launched_uids.append({r.uid for r in batch.reqs})
            self.in_flight[batch_no] = (rows, pages)
            out = forward_batch(batch, args, before_sampling)
            return out._replace(copy_done_event=_TrackedEvent(self, batch_no))

        def tracked_allocate_slot() -> int:
            slot = allocate_slot()
            for batch_no, (rows, _) in self.in_flight.items():
                if slot in rows:
                    self.violations.append(f"request slot {slot} handed out while batch {batch_no} uses it")
            return slot

        def tracked_allocate_pages(needed_pages: int) -> torch.Tensor:
            pages = allocate_pages(needed_pages)
            for batch_no, (_, used) in self.in_flight.items():
                if clash := used & set(pages.tolist()):
                    self.violations.append(f"KV pages {sorted(clash)} handed out while batch {batch_no} uses them")
            return pages

        engine.forward_batch = tracked_forward  # type: ignore[method-assign]
        table.allocate = tracked_allocate_slot  # type: ignore[method-assign]
        cache._allocate = tracked_allocate_pages  # type: ignore[method-assign]


def assert_pool_accounted(llm: LLM) -> None:
    """Idle scheduler: no lock held, every request slot free once, every page free or cached exactly once, and
    after evicting the whole prefix cache every page is back on the free list."""
    cache = llm.cache_manager
    cache.check_integrity()
    slots = list(llm.table_manager._free_slots)
    assert sorted(slots) == list(range(llm.config.max_running_req)), "request slots leaked or freed twice"
    assert not llm.decode_manager.running_reqs and not llm.prefill_manager.pending_list
    assert not llm.finished_reqs, "finished requests were never released"
    evictable = cache.prefix_cache.size_info.evictable_size
    if evictable:
        cache.free_slots = torch.cat([cache.free_slots, cache.prefix_cache.evict(evictable)[:: cache.page_size]])
    assert len(cache.free_slots) == cache.num_pages
    assert len(torch.unique(cache.free_slots)) == cache.num_pages

"""Stage 2's radix prefix cache under prompts that share prefixes, in a KV pool small enough that later prompts
evict earlier ones: every match / split / insert / evict, each with a snapshot of the tree right after it."""

from __future__ import annotations

from typing import Any, Dict, List

import torch

from .hooks import lookup, wrapped
from .record_engine import Recording, _params

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTIONS = ["What is two plus two?", "Name a colour.", "What is the capital of Italy?", "Say hello."]


def _snapshot(cache: Any) -> List[Dict[str, Any]]:
    """The tree, parents before children: (id, parent id, tokens on the edge, lock count)."""
    nodes, stack = [], [cache.root_node]
    while stack:
        node = stack.pop()
        if not node.is_root():
            nodes.append({"id": node.uuid, "parent": None if node.parent.is_root() else node.parent.uuid,
                          "len": int(node.length), "ref": int(node.ref_count)})
        stack.extend(sorted(node.children.values(), key=lambda n: n.uuid, reverse=True))
    return nodes


def record_radix(model: str, num_pages: int = 40, max_tokens: int = 3) -> Recording:
    events: List[Dict[str, Any]] = []
    caches: List[Any] = []

    def log(cache: Any, kind: str, **extra: Any) -> None:
        if cache not in caches:
            caches.append(cache)
        events.append({"event": kind, "tree": _snapshot(cache), **extra})

    def match(original: Any) -> Any:
        def match_prefix(self: Any, input_ids: torch.Tensor) -> Any:
            result = original(self, input_ids)
            log(self, "match", tokens=len(input_ids), matched=int(result.cuda_handle.cached_len))
            return result

        return match_prefix

    def insert(original: Any) -> Any:
        def insert_prefix(self: Any, input_ids: torch.Tensor, indices: torch.Tensor) -> Any:
            result = original(self, input_ids, indices)
            log(self, "insert", tokens=len(input_ids), already=int(result.cached_len))
            return result

        return insert_prefix

    def evict(original: Any) -> Any:
        def evict_(self: Any, size: int) -> torch.Tensor:
            before = {n["id"] for n in _snapshot(self)}
            result = original(self, size)
            if size:
                after = {n["id"] for n in _snapshot(self)}
                log(self, "evict", asked=int(size), evicted=int(len(result)), nodes=sorted(before - after))
            return result

        return evict_

    splits: List[int] = []

    def split(original: Any) -> Any:
        def split_at(self: Any, pos: int) -> Any:
            new = original(self, pos)
            splits.append(int(pos))
            # the tree is the one the match / insert that split it leaves behind (_fill_split_trees)
            events.append({"event": "split", "at": int(pos), "node": int(new.uuid), "tree": None})
            return new

        return split_at

    with wrapped(radix_match2=match, radix_insert2=insert, radix_evict2=evict, radix_split2=split):
        llm = lookup("llm2")(model, dtype=torch.float32, num_page_override=num_pages, max_running_req=4)
        try:
            for wave in range(3):  # the second wave finds the first wave's prefixes, and needs their pages back
                prompts = [f"{SYSTEM} {q}" + " Think step by step." * wave for q in QUESTIONS]
                llm.generate(prompts, _params(max_tokens, "2"), use_tqdm=False)
        finally:
            llm.shutdown()
    _fill_split_trees(events)
    cache = caches[0] if caches else None
    facts = {"evicted_tokens": sum(e["evicted"] for e in events if e["event"] == "evict"),
             "splits": len(splits), "final_nodes": None if cache is None else int(cache.num_nodes),
             "final_tree": [] if cache is None else _snapshot(cache)}
    return Recording("radix-cache", events, facts)


def _fill_split_trees(events: List[Dict[str, Any]]) -> None:
    """A split happens inside a match or insert: it shows the tree that call left behind."""
    for i, event in enumerate(events):
        if event["tree"] is None:
            later = next((e["tree"] for e in events[i + 1:] if e["tree"] is not None), [])
            event["tree"] = later

"""Recorded events -> frames: plain dictionaries, one per picture, that say everything the picture shows. The
renderer only draws them; the tests read them."""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from .record_engine import Recording

Frame = Dict[str, Any]
LANES = ["api", "tokenizer", "scheduler", "detokenizer"]
LANE_TITLES = {"api": "API server", "tokenizer": "tokenizer", "scheduler": "scheduler", "detokenizer": "detokenizer"}


def request_life(rec: Recording) -> List[Frame]:
    """One frame per message: where each request is now, and the messages so far."""
    where: Dict[int, str] = {}
    replies: Dict[int, int] = {}
    frames = []
    for i, event in enumerate(rec.events):
        uid = event["uid"]
        where[uid] = event["dst"]
        if event["type"] == "UserReply":
            replies[uid] = replies.get(uid, 0) + 1
            if event["finished"]:
                where[uid] = "done"
        frames.append({"t_ms": event["t_ms"], "event": event, "where": dict(where), "replies": dict(replies),
                       "history": rec.events[max(0, i - 5): i + 1]})
    return frames


def continuous_batching(rec: Recording) -> List[Frame]:
    """One frame per scheduled batch; each holds the whole grid so far (request x step -> what it did)."""
    uids = sorted({u for e in rec.events for u in e["batch"] + e["waiting"] + e["running"]})
    grid: Dict[int, List[str]] = {u: [] for u in uids}
    frames = []
    for event in rec.events:
        for uid in uids:
            if uid in event["prefill"]:
                state = "prefill"
            elif uid in event["batch"]:
                state = "decode"
            elif uid in event["running"]:
                state = "running"
            elif uid in event["waiting"]:
                state = "waiting"
            else:
                state = ""
            grid[uid].append(state)
        frames.append({"step": event["step"], "kind": event["kind"], "batch": event["batch"],
                       "waiting": event["waiting"], "pages_used": event["pages_used"],
                       "num_pages": event["num_pages"], "grid": {u: list(s) for u, s in grid.items()}})
    return frames


def radix_cache(rec: Recording) -> List[Frame]:
    frames = []
    for event in rec.events:
        kind = event["event"]
        if kind == "match":
            label = f"match: {event['matched']} of {event['tokens']} prompt tokens cached"
        elif kind == "insert":
            label = f"insert {event['tokens']} tokens ({event['already']} already in the tree)"
        elif kind == "split":
            label = f"split a node at {event['at']} tokens: new parent node {event['node']}"
        else:
            label = f"evict {event['evicted']} tokens (asked {event['asked']}): nodes {event['nodes']}"
        frames.append({"event": kind, "label": label, "tree": event["tree"],
                       "evicted": event.get("evicted", 0), "gone": event.get("nodes", []),
                       "new": event.get("node")})
    return frames


def overlap(rec: Recording) -> List[Frame]:
    """One frame per scheduler loop that launched a batch, with the loops before it (a window of six)."""
    loops = [e for e in rec.events if e["batch"] is not None]
    return [{"loop": i, "loops": loops[max(0, i - 5): i + 1], "batch": e["batch"], "reqs": e["reqs"]}
            for i, e in enumerate(loops)]


def tp(rec: Recording) -> List[Frame]:
    """One frame per all-reduce of the step (both ranks side by side), in call order."""
    by_key: Dict[tuple, Dict[int, Dict[str, Any]]] = {}
    for event in rec.events:
        by_key.setdefault((event["step"], event["index"]), {})[event["rank"]] = event
    counts = {r: 0 for r in range(rec.facts.get("tp", 2))}
    frames = []
    for (step, index), ranks in sorted(by_key.items()):
        for rank in ranks:
            counts[rank] += 1
        first = next(iter(ranks.values()))
        frames.append({"step": step, "index": index, "caller": first["caller"], "shape": first["shape"],
                       "ranks": {r: ranks[r]["ms"] for r in sorted(ranks)}, "counts": dict(counts),
                       "calls_in_step": 1 + max(i for s, i in by_key if s == step)})
    return frames


def cuda_graph(rec: Recording) -> List[Frame]:
    sizes = next((e["sizes"] for e in rec.events if e["event"] == "capture"), [])
    frames = [{"event": "capture", "sizes": sizes, "replay": None}]
    frames += [{"event": "replay", "sizes": sizes, "replay": e} for e in rec.events if e["event"] == "replay"]
    return frames


BUILDERS: Dict[str, Callable[[Recording], List[Frame]]] = {
    "request-life": request_life, "continuous-batching": continuous_batching, "radix-cache": radix_cache,
    "overlap": overlap, "tp": tp, "cuda-graph": cuda_graph,
}


def build(rec: Recording) -> List[Frame]:
    return BUILDERS[rec.name](rec)


def thin(frames: List[Frame], max_frames: int) -> List[Frame]:
    """At most ``max_frames``, evenly spaced, the first and the last kept."""
    if max_frames <= 0 or len(frames) <= max_frames:
        return frames
    if max_frames == 1:
        return frames[-1:]
    step = (len(frames) - 1) / (max_frames - 1)
    return [frames[round(i * step)] for i in range(max_frames)]

"""Frames -> an animated GIF: matplotlib draws each frame, its Pillow writer collects them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, List

import matplotlib

matplotlib.use("Agg")  # no display: files only

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.animation import PillowWriter  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from .frames import LANE_TITLES, LANES, Frame  # noqa: E402
from .render_more import draw_cuda_graph, draw_overlap, draw_tp  # noqa: E402

COLORS = {"prefill": "#f28e2b", "decode": "#4e79a7", "running": "#a0cbe8", "waiting": "#d9d9d9", "": "white"}
LEGEND = {"prefill": "prefill", "decode": "decode", "running": "admitted, not in this batch", "waiting": "waiting"}
MSG_COLORS = {"TokenizeMsg": "#59a14f", "UserMsg": "#f28e2b", "DetokenizeMsg": "#4e79a7",
              "TokenColumnsMsg": "#4e79a7", "UserReply": "#b07aa1"}


def draw_request_life(fig: Any, frame: Frame) -> None:
    ax = fig.add_subplot(1, 1, 1)
    uids = sorted(frame["where"]) or [0]
    n = max(uids) + 1
    ax.set_xlim(-0.5, len(LANES) - 0.5)
    ax.set_ylim(n + 2.2, -1.0)
    ax.axis("off")
    for x, lane in enumerate(LANES):
        ax.add_patch(Rectangle((x - 0.42, -0.9), 0.84, 0.7, color="#eeeeee"))
        ax.text(x, -0.55, LANE_TITLES[lane], ha="center", va="center", fontsize=8, weight="bold")
        ax.axvline(x, color="#cccccc", lw=0.8, zorder=0)
    for uid, lane in frame["where"].items():
        y = uid + 0.5
        done = lane == "done"
        x = 0 if done else LANES.index(lane)
        ax.plot(x, y, "o", ms=9, color="#999999" if done else "#e15759")
        label = f"req {uid}" + (" done" if done else "") + f" ({frame['replies'].get(uid, 0)} replies)"
        ax.text(-0.48, y - 0.33, label, fontsize=6, color="#555555")
    e = frame["event"]
    y = e["uid"] + 0.5
    ax.add_patch(FancyArrowPatch((LANES.index(e["src"]), y), (LANES.index(e["dst"]), y), arrowstyle="-|>",
                                 mutation_scale=12, color=MSG_COLORS.get(e["type"], "k"), lw=2))
    ax.text((LANES.index(e["src"]) + LANES.index(e["dst"])) / 2, y - 0.15, e["type"], ha="center", fontsize=7,
            color=MSG_COLORS.get(e["type"], "k"))
    for i, h in enumerate(frame["history"]):
        ax.text(-0.45, n + 0.4 + 0.3 * i, f"{h['t_ms']:9.1f} ms  req {h['uid']}  {h['src']} -> {h['dst']}: "
                f"{h['type']}{' (finished)' if h['finished'] else ''}", fontsize=6, family="monospace")
    ax.set_title(f"A request's life through the workers, t = {frame['t_ms']:.1f} ms", fontsize=9)


def draw_continuous_batching(fig: Any, frame: Frame) -> None:
    ax = fig.add_subplot(1, 1, 1)
    uids = sorted(frame["grid"])
    steps = len(next(iter(frame["grid"].values()), []))
    for row, uid in enumerate(uids):
        for col, state in enumerate(frame["grid"][uid]):
            if state:
                ax.add_patch(Rectangle((col, row), 0.95, 0.9, color=COLORS[state]))
    ax.add_patch(Rectangle((steps - 1, -0.1), 1, len(uids) + 0.1, fill=False, ec="k", lw=1.5))
    ax.set_xlim(0, max(steps, 8))
    ax.set_ylim(len(uids) + 1.2, 0)
    ax.set_yticks([r + 0.45 for r in range(len(uids))], [f"req {u}" for u in uids], fontsize=7)
    ax.set_xlabel("scheduler step", fontsize=8)
    ax.tick_params(labelsize=7)
    used, total = frame["pages_used"], frame["num_pages"]
    ax.add_patch(Rectangle((0, len(uids) + 0.3), max(steps, 8) * used / total, 0.6, color="#76b7b2"))
    ax.text(0.1, len(uids) + 0.75, f"KV pages used {used}/{total}", fontsize=7, va="center")
    x = 0.0
    for state, label in LEGEND.items():
        fig.text(0.13 + x, 0.9, label, color=COLORS[state], fontsize=7, weight="bold")
        x += 0.04 + 0.009 * len(label)
    fig.suptitle(f"Step {frame['step']}: {frame['kind']} batch {frame['batch']}, waiting {frame['waiting']}",
                 fontsize=8, y=0.98)


def _tree_layout(tree: List[Dict[str, Any]]) -> Dict[int, tuple]:
    """(x start, x end, y) per node: x = token depth, y = leaf order (a parent sits at its first child's row)."""
    children: Dict[Any, List[Dict[str, Any]]] = {}
    for node in tree:
        children.setdefault(node["parent"], []).append(node)
    pos: Dict[int, tuple] = {}
    row = [0]

    def place(node: Dict[str, Any], start: int) -> None:
        end = start + node["len"]
        pos[node["id"]] = (start, end, row[0])
        kids = children.get(node["id"], [])
        for i, kid in enumerate(kids):
            if i:
                row[0] += 1
            place(kid, end)

    for i, top in enumerate(children.get(None, [])):
        if i:
            row[0] += 1
        place(top, 0)
    return pos


def draw_radix(fig: Any, frame: Frame) -> None:
    ax = fig.add_subplot(1, 1, 1)
    tree = frame["tree"]
    pos = _tree_layout(tree)
    parents = {n["id"]: n["parent"] for n in tree}
    for node in tree:
        start, end, y = pos[node["id"]]
        locked = node["ref"] > 0
        color = "#59a14f" if locked else "#bab0ac"
        if node["id"] == frame["new"]:
            color = "#f28e2b"
        ax.add_patch(Rectangle((start, y - 0.35), end - start, 0.7, color=color, ec="k", lw=0.5))
        ax.text((start + end) / 2, y, f"{node['len']}" + (f" r{node['ref']}" if locked else ""),
                ha="center", va="center", fontsize=6)
        parent = parents[node["id"]]
        if parent is not None and parent in pos:
            ax.plot([start, start], [pos[parent][2], y], color="k", lw=0.5)
    width = max([p[1] for p in pos.values()] + [10])
    rows = max([p[2] for p in pos.values()] + [3]) + 1
    ax.set_xlim(0, width + 1)
    ax.set_ylim(rows, -1)
    ax.set_xlabel("tokens from the root (locked: green, r = requests using it; evictable: grey; new split: orange)",
                  fontsize=6)
    ax.set_yticks([])
    ax.tick_params(labelsize=6)
    ax.set_title(f"{frame['label']}  [{len(tree)} nodes]", fontsize=8,
                 color="#e15759" if frame["event"] == "evict" else "k")


DRAW: Dict[str, Callable[[Any, Frame], None]] = {
    "request-life": draw_request_life, "continuous-batching": draw_continuous_batching, "radix-cache": draw_radix,
    "overlap": draw_overlap, "tp": draw_tp, "cuda-graph": draw_cuda_graph,
}


def render(name: str, frames: List[Frame], path: Path, size: tuple = (8.0, 4.5), dpi: int = 80,
           fps: float = 2.0) -> Path:
    """Draw every frame into one GIF at ``path`` (the last frame shown twice as long: a pause before the loop)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = plt.figure(figsize=size)
    writer = PillowWriter(fps=fps)
    try:
        with writer.saving(fig, str(path), dpi):
            for i, frame in enumerate(frames):
                fig.clear()
                DRAW[name](fig, frame)
                fig.text(0.99, 0.01, f"{i + 1}/{len(frames)}", ha="right", fontsize=6, color="#888888")
                writer.grab_frame()
            if frames:
                writer.grab_frame()
    finally:
        plt.close(fig)
    return path

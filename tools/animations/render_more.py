"""Drawings of the overlap loop's timeline, a TP step's all-reduces and a graph replay's buffers."""

from __future__ import annotations

from typing import Any, Dict

from matplotlib.patches import FancyArrowPatch, Rectangle

Frame = Dict[str, Any]
PHASE_COLORS = {"receive": "#bab0ac", "schedule": "#59a14f", "launch": "#f28e2b", "process": "#b07aa1"}


def draw_overlap(fig: Any, frame: Frame) -> None:
    """Host lane: the loop's four parts; forward lane: the batch's forward. On CPU the forward runs inside the
    launch, on the host's own thread, so the lanes never run side by side: that is what was recorded."""
    ax = fig.add_subplot(1, 1, 1)
    loops = frame["loops"]
    t0 = loops[0]["phases"]["receive"][0]
    t1 = max(loop["phases"]["process"][1] for loop in loops)
    for loop in loops:
        for phase, (a, b) in loop["phases"].items():
            ax.add_patch(Rectangle((a - t0, 1.1), max(b - a, (t1 - t0) * 0.002), 0.8, color=PHASE_COLORS[phase]))
        if "forward" in loop:
            a, b = loop["forward"]
            color = "#f28e2b" if loop["batch"] == "prefill" else "#4e79a7"
            ax.add_patch(Rectangle((a - t0, 0.1), b - a, 0.8, color=color))
            ax.text((a + b) / 2 - t0, 0.5, f"{loop['batch']} x{loop['reqs']}", ha="center", va="center", fontsize=6,
                    color="white")
        ax.axvline(loop["phases"]["receive"][0] - t0, color="k", lw=0.4, ls=":")
    ax.set_xlim(0, (t1 - t0) * 1.02 or 1)
    ax.set_ylim(-0.6, 2.6)
    ax.set_yticks([0.5, 1.5], ["forward", "host loop"], fontsize=7)
    ax.set_xlabel("ms (loops separated by dotted lines)", fontsize=7)
    ax.tick_params(labelsize=6)
    for i, (phase, color) in enumerate(PHASE_COLORS.items()):
        ax.text(0.02 + 0.16 * i, 0.93, phase, transform=ax.transAxes, color=color, fontsize=7, weight="bold")
    last = loops[-1]
    ax.set_title(f"Overlap loop {frame['loop']}: launch batch N+1 ({last['batch']}, {last['reqs']} reqs), then "
                 f"process batch N; waited {last['wait_ms']:.2f} ms for the forward", fontsize=8)


def _tp_label(i: int) -> str:
    """The i-th all-reduce of a step: the embedding's, then per decoder layer attention's and the MLP's."""
    return "embedding" if i == 0 else f"layer {(i - 1) // 2} " + ("attn o_proj" if i % 2 else "mlp down_proj")


TP_WINDOW = 9  # rows shown: a deep model's 61 all-reduces per step scroll past


def draw_tp(fig: Any, frame: Frame) -> None:
    ax = fig.add_subplot(1, 1, 1)
    calls, index = frame["calls_in_step"], frame["index"]
    first = max(0, min(index - TP_WINDOW // 2, calls - TP_WINDOW))
    rows = range(first, min(calls, first + TP_WINDOW))
    ranks = sorted(frame["counts"])
    for rank in ranks:
        x = 2.0 * rank
        ax.text(x + 0.5, first - 0.9, f"rank {rank}\n{frame['counts'][rank]} all-reduces so far", ha="center",
                fontsize=7, weight="bold")
        for i in rows:
            color = "#f28e2b" if i == index else "#76b7b2" if i < index else "#eeeeee"
            ax.add_patch(Rectangle((x, i), 1.0, 0.8, color=color, ec="k", lw=0.4))
            ax.text(x + 0.5, i + 0.4, _tp_label(i), ha="center", va="center", fontsize=6)
    y = index + 0.4
    for rank in ranks[:-1]:
        ax.add_patch(FancyArrowPatch((2.0 * rank + 1.02, y), (2.0 * rank + 1.98, y), arrowstyle="<|-|>",
                                     mutation_scale=10, color="#e15759", lw=1.5))
        ax.text(2.0 * rank + 1.5, y - 0.25, f"sum {frame['shape']}", ha="center", fontsize=6, color="#e15759")
    ms = ", ".join(f"rank {r}: {t:.2f} ms" for r, t in frame["ranks"].items())
    ax.text(len(ranks) - 0.5, rows[-1] + 1.4, f"this all-reduce took {ms}", ha="center", fontsize=6)
    ax.set_xlim(-0.1, 2.0 * len(ranks) - 0.9)
    ax.set_ylim(rows[-1] + 1.8, first - 1.5)
    ax.axis("off")
    ax.set_title(f"TP={len(ranks)} step {frame['step']}: all-reduce {index + 1}/{calls} ({frame['caller']})",
                 fontsize=8, pad=14)


def draw_cuda_graph(fig: Any, frame: Frame) -> None:
    ax = fig.add_subplot(1, 1, 1)
    sizes = frame["sizes"]
    replay = frame["replay"]
    ax.axis("off")
    ax.text(0, -1.2, "captured graphs:", fontsize=7, weight="bold")
    for i, bs in enumerate(sizes):
        hit = replay is not None and replay["padded"] == bs
        ax.add_patch(Rectangle((2.2 + 1.1 * i, -1.55), 1.0, 0.6, color="#f28e2b" if hit else "#eeeeee", ec="k",
                               lw=0.4))
        ax.text(2.7 + 1.1 * i, -1.25, f"bs {bs}", ha="center", va="center", fontsize=6)
    width = max(sizes, default=1)
    if replay is None:
        ax.set_title(f"Captured decode graphs for batch sizes {sizes}; fixed buffers of {width} rows", fontsize=8)
        ax.set_xlim(-0.2, max(width, 2.2 + 1.1 * len(sizes)) + 2.5)
        ax.set_ylim(4, -2)
        return
    for row, field in enumerate(("input_ids", "positions", "out_loc")):
        ax.text(-0.1, row + 0.4, field, ha="right", va="center", fontsize=6)
        for col in range(replay["buffer_len"]):
            if col < replay["size"]:
                color, hatch, text = "#4e79a7", None, str(replay[field][col])
            elif col < replay["padded"]:
                color, hatch, text = "#d9d9d9", "//", "pad"
            else:
                color, hatch, text = "white", None, ""
            ax.add_patch(Rectangle((col, row), 0.95, 0.8, facecolor=color, hatch=hatch, ec="k", lw=0.4))
            ax.text(col + 0.47, row + 0.4, text, ha="center", va="center", fontsize=5,
                    color="white" if col < replay["size"] else "k")
    ax.text(0, 3.4, f"requests {replay['uids']} + {replay['padded'] - replay['size']} dummy rows", fontsize=6)
    ax.set_xlim(-2.0, max(replay["buffer_len"], 2.2 + 1.1 * len(sizes)) + 0.5)
    ax.set_ylim(4, -2)
    ax.set_title(f"Replay: batch of {replay['size']} padded to the captured {replay['padded']}; its inputs copied "
                 "into the graph's fixed buffers", fontsize=8)

"""`python tools/animate.py`: each animation's frames describe the run it recorded (the counts the stage itself
reports), and each renders to a GIF. A tiny random model keeps the runs short; the GIFs are small and few-framed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tools")]

pytest.importorskip("matplotlib")

from animations import RECORDERS  # noqa: E402
from animations.frames import build, thin  # noqa: E402
from animations.render import render  # noqa: E402
from PIL import Image  # noqa: E402

import models  # noqa: E402


@pytest.fixture(scope="module")
def model() -> str:
    return str(models.ensure("tiny-qwen3"))


def run(name: str, model: str, tmp_path: Path):
    rec = RECORDERS[name](model)
    frames = build(rec)
    assert frames, f"{name}: no frames"
    shown = thin(frames, 3)
    gif = render(name, shown, tmp_path / f"{name}.gif", size=(3.0, 2.0), dpi=40)
    with Image.open(gif) as im:
        assert im.format == "GIF" and im.n_frames >= 1
    return rec, frames


def test_request_life_shows_every_request_with_its_real_messages(model, tmp_path):
    rec, frames = run("request-life", model, tmp_path)
    n, max_tokens = rec.facts["requests"], rec.facts["max_tokens"]
    for uid in range(n):
        hops = [(e["src"], e["dst"], e["type"]) for e in rec.events if e["uid"] == uid]
        assert hops[:2] == [("api", "tokenizer", "TokenizeMsg"), ("tokenizer", "scheduler", "UserMsg")]
        # one token per scheduler message (stream interval 1, EOS ignored), each answered by a UserReply
        assert sum(t == "DetokenizeMsg" for *_, t in hops) == max_tokens
        assert sum(t == "UserReply" for *_, t in hops) == max_tokens
        assert frames[-1]["where"][uid] == "done" and frames[-1]["replies"][uid] == max_tokens
    times = [f["t_ms"] for f in frames]
    assert times == sorted(times) and len(frames) == len(rec.events)


def test_continuous_batching_frames_are_the_scheduler_steps(model, tmp_path):
    rec, frames = run("continuous-batching", model, tmp_path)
    assert len(frames) == rec.facts["forward_steps"]
    assert all(len(f["batch"]) <= rec.facts["max_running"] for f in frames)
    assert any(f["waiting"] for f in frames), "admission never made a request wait"
    grid = frames[-1]["grid"]
    assert sorted(grid) == list(range(rec.facts["requests"]))
    for states in grid.values():
        assert "prefill" in states and "decode" in states
        first = states.index("prefill")
        assert set(states[:first]) <= {"", "waiting"}  # nothing runs before its admission
    assert all(0 < f["pages_used"] <= f["num_pages"] for f in frames)


def test_radix_frames_follow_the_cache(model, tmp_path):
    rec, frames = run("radix-cache", model, tmp_path)
    evicted = sum(f["evicted"] for f in frames if f["event"] == "evict")
    assert evicted > 0 and evicted == rec.facts["evicted_tokens"]
    assert sum(f["event"] == "split" for f in frames) == rec.facts["splits"] > 0
    assert any(f["event"] == "match" and "0 of" not in f["label"] for f in frames), "no prefix was ever shared"
    last = [(n["id"], n["parent"], n["len"]) for n in frames[-1]["tree"]]
    assert last == [(n["id"], n["parent"], n["len"]) for n in rec.facts["final_tree"]]
    assert len(last) == rec.facts["final_nodes"]
    for frame in frames:  # evicted nodes are gone from the tree shown with them
        assert not set(frame["gone"]) & {n["id"] for n in frame["tree"]}


def test_overlap_frames_hold_each_launched_forward(model, tmp_path):
    rec, frames = run("overlap", model, tmp_path)
    assert len(frames) == rec.facts["forward_steps"] > 1
    for frame in frames:
        loop = frame["loops"][-1]
        phases = [loop["phases"][p] for p in ("receive", "schedule", "launch", "process")]
        assert all(a[1] == pytest.approx(b[0]) for a, b in zip(phases, phases[1:]))
        launch, forward = loop["phases"]["launch"], loop["forward"]
        assert launch[0] <= forward[0] <= forward[1] <= launch[1]  # on CPU the forward runs inside the launch


def test_tp_ranks_all_reduce_alike(model, tmp_path):
    rec, frames = run("tp", model, tmp_path)
    assert rec.facts["rank0_all_reduces"] == rec.facts["rank1_all_reduces"] > 0
    assert frames[-1]["counts"] == {0: rec.facts["rank0_all_reduces"], 1: rec.facts["rank1_all_reduces"]}
    layers = json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"]
    for step in range(rec.facts["steps"]):
        per_rank = [[(e["caller"], e["shape"]) for e in rec.events if e["rank"] == r and e["step"] == step]
                    for r in (0, 1)]
        assert per_rank[0] == per_rank[1] and len(per_rank[0]) == 1 + 2 * layers


def test_cuda_graph_replays_pad_to_captured_sizes(model, tmp_path):
    rec, frames = run("cuda-graph", model, tmp_path)
    sizes = frames[0]["sizes"]
    replays = [f["replay"] for f in frames[1:]]
    assert sizes and len(replays) == rec.facts["replays"] > 0
    for replay in replays:
        assert replay["padded"] == min(s for s in sizes if s >= replay["size"])
        assert len(replay["uids"]) == replay["size"] and len(replay["input_ids"]) == replay["padded"]
    assert {r["padded"] for r in replays} - {r["size"] for r in replays}, "no replay was padded"

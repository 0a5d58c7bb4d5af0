"""`python -m bench worker`: an in-process engine gives its memory back before a server task starts (the server
sizes its KV pool from the free GPU memory), and a later engine task loads a fresh one."""

from __future__ import annotations

import argparse

from bench import worker


class FakeAdapter:
    released = False

    def generate(self, prompts, output_lens):
        return worker.GenResult([[1] * n for n in output_lens], [0.0] * len(prompts))


def test_engine_released_before_a_server_task(monkeypatch):
    events: list[str] = []
    loaded: list[FakeAdapter] = []

    def load(*args, **kwargs):
        loaded.append(FakeAdapter())
        events.append("load")
        return loaded[-1]

    def release(adapter):
        adapter.released = True
        events.append("release")

    def serve_offline(*args, **kwargs):
        assert all(a.released for a in loaded), "a server started while the engine still held its memory"
        events.append("serve")
        return {"tok_s": 1.0}

    monkeypatch.setattr(worker, "load_adapter", load)
    monkeypatch.setattr(worker, "release_adapter", release)
    monkeypatch.setattr(worker, "task_serve_offline", serve_offline)
    monkeypatch.setattr(worker, "task_offline", lambda adapter, w: events.append("offline") or {"tok_s": 1.0})
    monkeypatch.setattr(worker, "vocab_size", lambda model: 49152)
    args = argparse.Namespace(task="offline,serve_offline,offline", stage="stage4_fast", model="m", options="{}",
                              quick=True, gpu=False, log=None)
    result = worker.run(args)
    assert events == ["load", "offline", "release", "serve", "load", "offline"]
    assert set(result["tasks"]) == {"offline", "serve_offline"}

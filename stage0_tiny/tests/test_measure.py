"""The measuring exercises' checks (tools/exercises.toml: tiny-no-cache, tiny-scores, tiny-threads), on the seeded
tiny-qwen3 model: a 200-token prompt, 16 decode steps."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from stage0_tiny import measure
from stage0_tiny.tiny import TinyEngine

REPO = Path(__file__).resolve().parents[2]
PROMPT_TOKENS, STEPS = 200, 16


def prepared_model(name: str) -> Path:
    """A model of the repo's models/ folder, made through its CLI if missing (a stage never imports `models`)."""
    path = REPO / "models" / name
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, "-m", "models", "make", name], cwd=REPO, check=True)
    return path


@pytest.fixture(scope="module")
def engine() -> TinyEngine:
    return TinyEngine(prepared_model("tiny-qwen3"))


@pytest.fixture(scope="module")
def prompt(engine: TinyEngine) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, engine.cfg["vocab_size"], (PROMPT_TOKENS,), generator=gen).tolist()


@pytest.fixture
def one_thread():
    """One torch thread: the ratio is about the work done, and a thread team on a machine shared with other
    processes spends its time waiting for its slowest member."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_decode_without_cache_gives_the_same_tokens_and_is_slower(engine, prompt, one_thread):
    race = measure.race_cache(engine, prompt, STEPS)
    assert len(race.uncached) == STEPS
    assert race.uncached == race.cached, "without the cache, the tokens must not change"
    # each uncached step runs ~200 positions where the cached one runs 1; on this 2-layer model per-op overhead
    # hides much of that, yet the cache wins by ~3x: the bound leaves room for a busy machine
    assert race.speedup > 1.5, f"the cached decode is only {race.speedup:.2f}x as fast"


def test_score_matrix_matches_the_config_and_the_engine(engine, prompt, monkeypatch):
    cfg, heads = engine.cfg, engine.cfg["num_attention_heads"]
    seen: list[tuple[int, int, int]] = []  # [heads, queries, keys] of each attention call the engine makes
    real = F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
        seen.append((q.shape[0], q.shape[1], k.shape[1]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    engine.generate(prompt, 2)  # a prefill, then one decode step: one call per layer each
    layers, n = cfg["num_hidden_layers"], len(prompt)
    prefill, decode = measure.score_matrix(cfg, n, 0), measure.score_matrix(cfg, 1, n)
    assert prefill.shape == seen[0] == (heads, n, n)
    assert decode.shape == seen[layers] == (heads, 1, n + 1)
    assert prefill.bytes == heads * n * n * 4 and decode.bytes == heads * (n + 1) * 4  # fp32
    long = measure.score_matrix(cfg, 4096, 0)
    assert long.shape == (heads, 4096, 4096) and long.bytes == heads * 4096 * 4096 * 4 == 2**28
    assert measure.score_matrix(cfg, 1, 4096).bytes == heads * 4097 * 4
    assert measure.score_matrix(cfg, 4096, 0, torch.bfloat16).bytes == 2**27
    smollm2 = dict(num_attention_heads=9, num_key_value_heads=3)  # SmolLM2-135M: 9 query heads share 3 KV heads
    assert measure.score_matrix(smollm2, 4096, 0).bytes == 9 * 4096 * 4096 * 4  # 576 MiB for one layer


def test_thread_sweep_measures_each_count_with_the_same_tokens(engine, prompt):
    counts = list(range(1, min(os.cpu_count() or 1, 4) + 1))  # 1 .. the logical cores (at most 4 here)
    before = torch.get_num_threads()
    runs = measure.thread_sweep(engine, prompt[:32], 8, counts)
    assert [r.threads for r in runs] == counts, "one measurement per thread count, in order"
    assert all(r.decode_tps > 0 for r in runs)
    assert all(r.tokens == engine.generate(prompt[:32], 8) for r in runs), "threads must not change the tokens"
    assert torch.get_num_threads() == before


def test_knee_and_table():
    runs = [measure.ThreadRun(n, [1], tps) for n, tps in ((1, 10.0), (2, 19.0), (3, 20.0), (4, 20.5))]
    assert measure.knee(runs) == 2
    text = measure.table(runs, physical=2)
    assert text.splitlines()[2].endswith("<- physical cores") and "20.5" in text

"""`python -m bench kv-accuracy`'s free-running comparison: an output that stops early counts as a difference where
it stops, and a prompt the engine refuses stops the measurement instead of entering it as a row of no tokens."""

from __future__ import annotations

import pytest

import stage4_fast
from bench.kv_accuracy import greedy, token_stats


def test_an_output_that_stops_early_differs_where_it_stops():
    stats = token_stats([[1, 2, 3], [4], []], [[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    assert stats["prompts_identical"] == 1
    assert stats["token_agreement"] == 4 / 9
    assert stats["mean_first_difference_step"] == (3 + 1 + 0) / 3


class _RefusingLLM:
    """Stands in for stage4_fast.LLM: refuses the second prompt as the scheduler does (an "error" result)."""

    def __init__(self, path: str, **config) -> None:
        pass

    def generate(self, prompts, params, use_tqdm=False):
        return [{"token_ids": [1, 2]}, {"token_ids": [], "error": "prompt of 217 tokens leaves no room"}]

    def shutdown(self) -> None:
        pass


def test_a_refused_prompt_stops_the_measurement(monkeypatch):
    monkeypatch.setattr(stage4_fast, "LLM", _RefusingLLM)
    with pytest.raises(RuntimeError, match="refused 1 of 2 prompts; first: prompt 1: prompt of 217 tokens"):
        greedy("unused", [[1], [2]], steps=2)

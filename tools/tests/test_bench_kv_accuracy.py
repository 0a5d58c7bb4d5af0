"""`python -m bench kv-accuracy`'s free-running comparison: an output that stops early counts as a difference where
it stops, and a prompt the engine refuses stops the measurement instead of entering it as a row of no tokens. Its
simulated rows stand for an fp8 pool: per-layer scales through fake quantization are the engine's own logits."""

from __future__ import annotations

import pytest
import torch

import models
import stage4_fast
from bench.kv_accuracy import calibration_absmax, fake_quantized_kv, greedy, teacher_forced, token_stats


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


def test_fake_quantized_per_layer_scales_give_the_engines_fp8_logits():
    from stage4_fast.engine.engine import kv_scales_from_absmax

    path, common = models.ensure("tiny-qwen3"), dict(dtype=torch.float32, attention_backend="torch")
    prompts, forced = [[1, 5, 9, 30, 7], [3, 2, 8]], [[4, 6, 11], [12, 13, 14]]
    scales = kv_scales_from_absmax(calibration_absmax(path, **common).amax(-1, keepdim=True))  # [2, layers, 1]
    with fake_quantized_kv(*scales):
        simulated = teacher_forced(path, prompts, forced, **common)
    fp8 = teacher_forced(path, prompts, forced, **common, kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    assert torch.equal(simulated, fp8) and not torch.equal(simulated, teacher_forced(path, prompts, forced, **common))

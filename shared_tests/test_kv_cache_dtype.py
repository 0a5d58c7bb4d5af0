"""A KV cache stored in fewer bits (option ``kv_cache_dtype``): tolerance checks, kept apart from the token-equality
suite (test_hf_alignment.py), whose tests never pass this option.

Storing K/V in bf16 or fp8 under fp32 weights changes every later step's logits a little, so greedy outputs may part
from HF's. But up to the first token where they differ, both ran on the same tokens, so at that step the stage's
logits are HF's plus the KV-rounding error; greedy picks another token only if that error closes HF's top-2 gap,
which needs a gap below twice the largest logit error. So: wherever a stage's output first differs from HF's,
HF's own top-2 gap at that step must be below ``GAP_BOUND[kv]``.

The bounds are twice the largest |logit difference| that teacher forcing measured on SmolLM2 over 32 prompts x 64
steps against the full-precision KV cache (``python -m bench kv-accuracy``; bench/results/cpu-kv-cache.md), with
half as much again for prompts outside that set (these include random-token ones) and for the engine's fp32 sums,
whose order differs from HF's.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from .conftest import BATCH_PROMPTS, NEW_TOKENS, encode, hf_generate, long_prompt_ids, mixed_prompts
from .stages import require

# logits: 3 x max_abs_logit_diff of bench/results/cpu-kv-cache.md (bfloat16 0.22, fp8_e4m3 3.45, fp8_e5m2 7.53)
GAP_BOUND = {"bfloat16": 0.7, "fp8_e4m3": 10.5, "fp8_e5m2": 23.0}


@lru_cache(maxsize=None)
def _hf_gaps(model_dir: str, prompt: tuple[int, ...], out: tuple[int, ...]) -> list[float]:
    """HF fp32's top-1 minus top-2 logit at every step of its own greedy continuation ``out``."""
    import torch

    from .conftest import _hf_model

    with torch.inference_mode():
        logits = _hf_model(model_dir)(torch.tensor([list(prompt) + list(out[:-1])])).logits[0, len(prompt) - 1:]
    top2 = logits.float().topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


@pytest.mark.parametrize("kv", sorted(GAP_BOUND))
def test_quantized_kv_parts_from_hf_only_where_hf_was_unsure(stage, kv, model_dirs):
    d = model_dirs["smollm2"]
    h = require(stage, d, {"kv_cache_dtype": kv}, ("batch",))
    prompts = [encode(p) for p in BATCH_PROMPTS] + [long_prompt_ids()[:120]] + mixed_prompts(3, seed=5, lo=8, hi=60)
    ref = hf_generate(d, prompts)
    out = h.generate(str(d), prompts, NEW_TOKENS, kv_cache_dtype=kv)
    assert [len(o) for o in out] == [NEW_TOKENS] * len(prompts)
    for i, (got, want) in enumerate(zip(out, ref)):
        step = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if step is None:
            continue
        gap = _hf_gaps(str(d), tuple(prompts[i]), tuple(want))[step]
        assert gap < GAP_BOUND[kv], (
            f"prompt {i}: {kv} KV parts from HF at step {step}, where HF's top-2 gap {gap:.3f} exceeds what "
            f"KV rounding can flip ({GAP_BOUND[kv]})")


def test_kv_cache_dtype_auto_is_full_precision(stage, model_dirs):
    """``auto`` stores the model's own dtype: the output is HF's, token for token."""
    d = model_dirs["tiny-qwen3"]
    h = require(stage, d, {"kv_cache_dtype": "auto"}, ("batch",))
    prompts = [encode(p) for p in BATCH_PROMPTS]
    assert h.generate(str(d), prompts, NEW_TOKENS, kv_cache_dtype="auto") == hf_generate(d, prompts)

"""One HF-alignment suite for all five engines: fp32 greedy output equals transformers' generate, token for token.

Each test names the stage feature it needs; a stage without it is skipped with that reason (see stages.require).
"""

from __future__ import annotations

import pytest

from .conftest import (
    BATCH_PROMPTS,
    MODEL_NAMES,
    NEW_TOKENS,
    SHORT_PROMPT,
    encode,
    hf_generate,
    long_prompt_ids,
    mixed_prompts,
)
from .stages import require


def _check(stage_out: list[list[int]], ref: list[list[int]]) -> None:
    assert len(stage_out) == len(ref)
    for i, (got, want) in enumerate(zip(stage_out, ref)):
        assert got == want, f"prompt {i}: stage {got} != HF {want}"


@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_single_prompt_matches_hf(stage, model, prompt, model_dirs):
    d = model_dirs[model]
    h = require(stage, d)
    ids = encode(SHORT_PROMPT) if prompt == "short" else long_prompt_ids()
    _check(h.generate(str(d), [ids], NEW_TOKENS), hf_generate(d, [ids]))


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_batch_of_four_matches_hf(stage, model, page_size, model_dirs):
    d = model_dirs[model]
    h = require(stage, d, {"page_size": page_size}, ("batch",))
    prompts = [encode(p) for p in BATCH_PROMPTS]
    prompts[1] = prompts[1] + long_prompt_ids()[:40]  # lengths differ a lot inside the batch
    _check(h.generate(str(d), prompts, NEW_TOKENS, page_size=page_size), hf_generate(d, prompts))


def test_request_alone_equals_inside_batch(stage, model_dirs):
    d = model_dirs["tiny-qwen3"]
    h = require(stage, d, capabilities=("batch",))
    prompts = [encode(p) for p in BATCH_PROMPTS]
    alone = h.generate(str(d), prompts[:1], NEW_TOKENS)
    batched = h.generate(str(d), prompts, NEW_TOKENS)
    assert alone[0] == batched[0]


# Scheduler features: every family through four configurations that together cover each value of each factor,
# and the full 16-way product on tiny Qwen3.
SCHED_CONFIGS = [
    dict(cache_type="radix", max_extend_tokens=8, overlap=True, page_size=4),
    dict(cache_type="naive", max_extend_tokens=None, overlap=False, page_size=1),
    dict(cache_type="radix", max_extend_tokens=None, overlap=True, page_size=1),
    dict(cache_type="naive", max_extend_tokens=8, overlap=False, page_size=4),
]
FULL_PRODUCT = [
    dict(cache_type=c, max_extend_tokens=m, overlap=o, page_size=p)
    for c in ("naive", "radix") for m in (8, None) for o in (False, True) for p in (1, 4)
]


def _sched_case(stage, model_dirs, model, cfg):
    d = model_dirs[model]
    opts = {k: v for k, v in cfg.items() if v is not None}
    h = require(stage, d, opts, ("batch",))
    prompts = mixed_prompts(6, seed=7, lo=4, hi=40)
    ref = hf_generate(d, prompts)
    _check(h.generate(str(d), prompts, NEW_TOKENS, **opts), ref)
    # a second call on the same engine: with radix the shared prefixes now come from the cache
    _check(h.generate(str(d), prompts[::-1], NEW_TOKENS, **opts), ref[::-1])


@pytest.mark.parametrize("cfg", SCHED_CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_scheduler_configs_match_hf(stage, model, cfg, model_dirs):
    _sched_case(stage, model_dirs, model, cfg)


@pytest.mark.parametrize("cfg", FULL_PRODUCT, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_scheduler_full_product_tiny_qwen3(stage, cfg, model_dirs):
    _sched_case(stage, model_dirs, "tiny-qwen3", cfg)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama3"])
def test_many_requests_small_pool_match_hf(stage, model, model_dirs):
    """32 mixed-length requests, 8 slots, a KV pool smaller than the total demand: queueing, eviction and
    re-admission must not change any output."""
    d = model_dirs[model]
    opts = dict(max_running_req=8, num_pages=160, page_size=4, cache_type="radix", max_extend_tokens=64)
    h = require(stage, d, opts, ("batch",))
    prompts = mixed_prompts(32, seed=11, lo=8, hi=120)
    demand = sum(len(p) + NEW_TOKENS for p in prompts)
    assert demand > 160 * 4, "the workload must not fit the pool at once"
    _check(h.generate(str(d), prompts, NEW_TOKENS, **opts), hf_generate(d, prompts))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-moe-dense"])
def test_tensor_parallel_matches_hf(stage, model, tp, model_dirs):
    d = model_dirs[model]
    h = require(stage, d, {"tp": tp}, ("batch",))
    prompts = [encode(p) for p in BATCH_PROMPTS]
    _check(h.generate(str(d), prompts, NEW_TOKENS, tp=tp), hf_generate(d, prompts))


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_cuda_graph_on_off_match_hf(stage, cuda_graph, model_dirs):
    d = model_dirs["tiny-qwen3"]
    h = require(stage, d, {"cuda_graph": cuda_graph}, ("batch",))
    prompts = mixed_prompts(5, seed=3, lo=4, hi=30)
    _check(h.generate(str(d), prompts, NEW_TOKENS, cuda_graph=cuda_graph), hf_generate(d, prompts))


def test_server_end_to_end_matches_hf(stage, model_dirs):
    """One request through the real server (HTTP -> tokenizer -> scheduler -> detokenizer): greedy text equals HF."""
    d = model_dirs["smollm2"]
    h = require(stage, d, capabilities=("server",))
    from .conftest import tokenizer

    ids = encode(SHORT_PROMPT)
    want = tokenizer().decode(hf_generate(d, [ids])[0])
    with h.serve(str(d)) as base_url:
        import json
        import urllib.request

        body = json.dumps({"model": str(d), "prompt": SHORT_PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = json.loads(resp.read())["choices"][0]["text"]
    assert text == want

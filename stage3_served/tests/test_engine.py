from __future__ import annotations

import pytest
import torch

from stage3_served.core import Req, SamplingParams
from stage3_served.engine import ManualBatcher

from .conftest import forward_logits, hf_logits, make_engine

PROMPTS = [[11, 22, 33, 44, 55, 66, 77], [5, 6, 7], [100, 200, 300, 400, 500, 1, 2, 3, 4, 5, 6]]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_batched_prefill_and_decode_logits_match_hf(tiny_model, arch, page_size):
    path = tiny_model(arch)
    engine = make_engine(path, page_size=page_size)
    batcher = ManualBatcher(engine)
    reqs = [batcher.add_req(p, SamplingParams(max_tokens=3)) for p in PROMPTS]

    prefill = forward_logits(engine, batcher.make_batch(reqs, "prefill"))
    for prompt, logits in zip(PROMPTS, prefill):
        _close(logits, hf_logits(path, prompt)[-1])
    tokens = batcher.step(reqs, "prefill")
    assert tokens == prefill.argmax(-1).tolist()

    # one decode step over requests of different lengths (the padded, masked decode path)
    decode = forward_logits(engine, batcher.make_batch(reqs, "decode"))
    for prompt, token, logits in zip(PROMPTS, tokens, decode):
        _close(logits, hf_logits(path, prompt + [token])[-1])


@pytest.mark.parametrize("page_size", [1, 4])
def test_extend_after_cached_prefix_matches_full_prefill(tiny_model, page_size):
    """A request whose first 6 tokens already have KV (cached_len 6) extends by 5 more in one forward."""
    path = tiny_model("qwen3")
    engine = make_engine(path, page_size=page_size)
    batcher = ManualBatcher(engine)
    full = PROMPTS[2]
    first = batcher.add_req(full[:6], SamplingParams(max_tokens=1))
    batcher.step([first], "prefill")  # KV for positions 0..5 now in the pool

    # the same slot row and pages, now with the whole prompt and the prefix marked cached
    req = Req(torch.tensor(full, dtype=torch.int32), first.table_idx, 6, 1, 99, SamplingParams(max_tokens=1))
    batcher._pages[req] = batcher._pages.pop(first)
    batcher.token_pool[req.table_idx, : len(full)] = torch.tensor(full, dtype=torch.int32)
    batch = batcher.make_batch([req], "prefill")
    assert req.extend_len == 5 and batch.input_ids.tolist() == full[6:]
    _close(forward_logits(engine, batch)[0], hf_logits(path, full)[-1])


def test_request_alone_equals_inside_a_batch(tiny_model):
    engine = make_engine(tiny_model("llama3"), page_size=4)
    params = SamplingParams(max_tokens=8)
    alone = ManualBatcher(engine).generate(PROMPTS[:1], params)
    batched = ManualBatcher(engine).generate(PROMPTS, params)
    assert batched[0] == alone[0]


def test_two_engines_in_one_process_do_not_interfere(tiny_model):
    params = SamplingParams(max_tokens=5)
    a = make_engine(tiny_model("qwen2"))
    expected_a = ManualBatcher(a).generate(PROMPTS, params)
    b = make_engine(tiny_model("qwen3"), page_size=4)  # the newest engine installs its context globally
    expected_b = ManualBatcher(b).generate(PROMPTS, params)
    assert ManualBatcher(a).generate(PROMPTS, params) == expected_a
    assert ManualBatcher(b).generate(PROMPTS, params) == expected_b


def test_more_prompts_than_slots_run_in_groups(tiny_model):
    engine = make_engine(tiny_model("qwen2"), max_running_req=2)
    params = SamplingParams(max_tokens=4)
    together = ManualBatcher(engine).generate(PROMPTS, params)
    one_by_one = [ManualBatcher(engine).generate([p], params)[0] for p in PROMPTS]
    assert together == one_by_one


def test_pages_and_slots_return_to_the_free_lists(tiny_model):
    engine = make_engine(tiny_model("qwen2"), page_size=4)
    batcher = ManualBatcher(engine)
    pages, slots = sorted(batcher.free_pages), sorted(batcher.free_slots)
    batcher.generate(PROMPTS, SamplingParams(max_tokens=6))
    assert sorted(batcher.free_pages) == pages and sorted(batcher.free_slots) == slots


def test_pool_exhaustion_is_a_clear_error(tiny_model):
    engine = make_engine(tiny_model("qwen2"), page_size=4, num_page_override=2)
    with pytest.raises(RuntimeError, match="KV pool exhausted"):
        ManualBatcher(engine).generate([list(range(1, 7))] * 2, SamplingParams(max_tokens=1))


def test_shutdown_gives_the_kv_pool_back(tiny_model):
    """After shutdown nothing of the engine's keeps its KV pool alive: the global context forgets it too (a process
    that starts a server after running its own engine needs that memory back)."""
    import gc
    import weakref

    engine = make_engine(tiny_model("qwen3"))
    pool = weakref.ref(engine.ctx.kv_cache)
    engine.shutdown()
    del engine
    gc.collect()
    assert pool() is None

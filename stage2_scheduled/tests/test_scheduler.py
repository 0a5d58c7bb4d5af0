"""The scheduler as a whole on a tiny model: outputs independent of scheduling options, pool accounting after any
workload, chunked prefill interleaved with decode, prefix reuse, and requests that cannot be served."""

from __future__ import annotations

import gc
import itertools
import random
import weakref
from typing import List, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stage2_scheduled.core import SamplingParams
from stage2_scheduled.message import AbortBackendMsg
from stage2_scheduled.scheduler.prefill import ChunkedReq, PrefillManager

from .helpers import assert_pool_accounted, greedy, make_llm, watch_batches


def workload(seed: int, n: int = 10) -> Tuple[List[List[int]], List[int]]:
    """Prompts of mixed length, half of them behind one of two shared prefixes, and mixed output lengths."""
    rng = random.Random(seed)
    prefixes = [[rng.randint(3, 500) for _ in range(rng.randint(5, 14))] for _ in range(2)]
    prompts = []
    for i in range(n):
        tail = [rng.randint(3, 500) for _ in range(rng.randint(1, 20))]
        prompts.append((prefixes[i % 2] if i % 4 < 2 else []) + tail)
    return prompts, [rng.randint(1, 12) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Plain scheduling (no prefix cache, no overlap, no chunking, a roomy pool): the outputs to reproduce."""
    llm = make_llm(tiny_model("qwen3"), cache_type="naive", overlap_scheduling=False)

    def run(prompts: List[List[int]], max_tokens: List[int]) -> List[List[int]]:
        out = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
        return [o["token_ids"] for o in out]

    return run


CONFIGS = list(itertools.product(["radix", "naive"], [1, 4], [True, False], [8, 8192]))


@pytest.mark.parametrize("cache_type,page_size,overlap,chunk", CONFIGS)
def test_small_pool_outputs_and_accounting(tiny_model, reference, cache_type, page_size, overlap, chunk):
    """Three request slots and a pool far smaller than the demand: requests queue, the cache evicts, and still
    every output equals the plain run and every page and slot comes back."""
    prompts, max_tokens = workload(seed=1)
    llm = make_llm(
        tiny_model("qwen3"),
        cache_type=cache_type,
        page_size=page_size,
        overlap_scheduling=overlap,
        max_extend_tokens=chunk,
        max_running_req=3,
        num_page_override=96 // page_size,
    )
    assert sum(len(p) + n for p, n in zip(prompts, max_tokens)) > 96
    expected = reference(prompts, max_tokens)
    for _ in range(2):  # the second round starts with a warm prefix cache
        out = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
        assert [o["token_ids"] for o in out] == expected
        assert_pool_accounted(llm)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), abort_at=st.integers(0, 40), abort_uid=st.integers(0, 9))
def test_pool_accounting_after_random_workloads_with_an_abort(tiny_model, reference, seed, abort_at, abort_uid):
    """Any workload, with one abort delivered at a random step: the aborted request reports it, every other output
    equals the plain run, and the pool is whole afterwards."""
    prompts, max_tokens = workload(seed)
    llm = _pressured_llm(tiny_model("qwen3"))
    steps = itertools.count()
    inner = llm.receive_msg

    def receive_msg(blocking: bool = False):
        msgs = inner(blocking=blocking)
        if next(steps) == abort_at:
            msgs.append(AbortBackendMsg(abort_uid))
        return msgs

    llm.receive_msg = receive_msg  # type: ignore[method-assign]
    out = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    expected = reference(prompts, max_tokens)
    for uid, (result, want) in enumerate(zip(out, expected)):
        if result.get("error") == "aborted":
            assert uid == abort_uid and result["token_ids"] == want[: len(result["token_ids"])]
        else:
            assert result["token_ids"] == want, f"request {uid}"
    del llm.receive_msg  # the class's method again, and no bound method left on the (cached) LLM
    assert_pool_accounted(llm)


_PRESSURED: dict = {}


def _pressured_llm(model):
    # one engine for all hypothesis examples (state carried between workloads is part of what is tested)
    if model not in _PRESSURED:
        _PRESSURED[model] = make_llm(
            model, page_size=4, max_running_req=3, max_extend_tokens=8, num_page_override=24, cache_type="radix"
        )
    return _PRESSURED[model]


def test_chunked_prefill_alternates_with_decode(tiny_model):
    """A 20-token prompt at a budget of 8 goes in as three chunks, and the request already decoding gets a decode
    step between the chunks instead of waiting for the whole prompt."""
    llm = make_llm(tiny_model("qwen3"), max_extend_tokens=8, overlap_scheduling=False)
    launched: List[Tuple[str, List[int], List[bool]]] = []

    def record(batch):
        launched.append((batch.phase, [r.uid for r in batch.reqs], [isinstance(r, ChunkedReq) for r in batch.reqs]))

    watch_batches(llm, record)
    prompts = [[7, 8, 9], list(range(100, 120))]
    out = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [6, 6]
    chunks = [i for i, (phase, uids, _) in enumerate(launched) if phase == "prefill" and 1 in uids]
    assert len(chunks) == 3  # 5 + 8 + 7 tokens (request 0 takes 3 of the first step's 8)
    assert [launched[i][2][-1] for i in chunks] == [True, True, False]
    between = launched[chunks[0] + 1 : chunks[-1]]
    assert any(phase == "decode" and uids == [0] for phase, uids, _ in between)


def test_radix_cache_serves_a_repeated_prefix(tiny_model):
    llm = make_llm(tiny_model("qwen3"), cache_type="radix")
    shared = list(range(200, 232))
    extend_lens: List[int] = []

    def record(batch):
        if batch.is_prefill:
            extend_lens.extend(r.extend_len for r in batch.reqs)

    watch_batches(llm, record)
    first = llm.generate([shared + [5, 6]], greedy(4), use_tqdm=False)
    second = llm.generate([shared + [7, 8, 9]], greedy(4), use_tqdm=False)
    assert extend_lens == [34, 3]  # the second prompt computes only its own tail
    fresh = make_llm(tiny_model("qwen3"), cache_type="naive").generate([shared + [7, 8, 9]], greedy(4), use_tqdm=False)
    assert second[0]["token_ids"] == fresh[0]["token_ids"]
    assert first[0]["token_ids"] != []


def test_requests_that_cannot_be_served_get_an_error_and_do_not_block(tiny_model):
    """Upstream bug 6: an over-long prompt is dropped without a reply. Here it (and an empty prompt, and a
    non-positive max_tokens) gets an error result, and the requests behind it run normally."""
    llm = make_llm(tiny_model("qwen3"), num_page_override=32)  # a 32-token context
    assert llm.engine.max_seq_len == 32
    prompts = [list(range(10, 50)), [], [5, 6, 7], [8, 9]]
    params = [greedy(4), greedy(4), greedy(0), greedy(4)]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert "context of 32 tokens" in out[0]["error"]
    assert out[1]["error"] == "empty prompt"
    assert "max_tokens" in out[2]["error"]
    assert "error" not in out[3] and len(out[3]["token_ids"]) == 4
    assert_pool_accounted(llm)


def test_max_tokens_beyond_the_context_is_clamped_not_blocking(tiny_model):
    """A request asking for far more tokens than the KV pool holds is clamped to the context (as upstream) and runs;
    the caller's SamplingParams object, shared with another request, is left alone."""
    llm = make_llm(tiny_model("qwen3"), num_page_override=32)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    out = llm.generate([[1, 2, 3, 4], [5, 6]], params, use_tqdm=False)
    assert [len(o["token_ids"]) for o in out] == [28, 30]
    assert params.max_tokens == 10_000
    assert_pool_accounted(llm)


def test_a_head_request_that_never_fits_is_rejected_not_spun_on(tiny_model, monkeypatch):
    """Safety net behind admission control: if nothing runs and the head request still cannot be admitted, it gets
    an error instead of the loop spinning forever (forced here by an admission that always refuses)."""
    llm = make_llm(tiny_model("qwen3"))
    monkeypatch.setattr(PrefillManager, "schedule_next_batch", lambda self, budget: None)
    out = llm.generate([[1, 2, 3], [4, 5]], greedy(3), use_tqdm=False)
    assert [o["error"] for o in out] == ["request can never be scheduled"] * 2


def test_overlap_switch_env_and_config(tiny_model, monkeypatch):
    assert make_llm(tiny_model("qwen3")).overlap_scheduling
    assert not make_llm(tiny_model("qwen3"), overlap_scheduling=False).overlap_scheduling
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "1")
    assert not make_llm(tiny_model("qwen3")).overlap_scheduling


def test_idle_check_walks_the_cache_only_when_asked(tiny_model, monkeypatch):
    """The scheduler checks its pages whenever it goes idle. A server idle between requests with a million cached
    tokens spent ~0.2 s there walking the prefix cache, which the next request waited for: by default only the
    sizes are checked; the test suites (conftest.py) ask for the deep check."""
    llm = make_llm(tiny_model("qwen3"))
    llm.generate([[5, 6, 7, 8]], greedy(3), use_tqdm=False)
    walks: list = []
    monkeypatch.setattr(llm.cache_manager.prefix_cache, "check_integrity", lambda: walks.append(1))
    monkeypatch.delenv("MINISGL_CHECK_CACHE_DEEP", raising=False)
    llm.run_when_idle()
    assert walks == []
    monkeypatch.setenv("MINISGL_CHECK_CACHE_DEEP", "1")
    llm.run_when_idle()
    assert walks == [1]


def test_decode_batch_order_is_stable(tiny_model):
    """The running set keeps admission order, so a decode batch is laid out the same way on every run."""
    llm = make_llm(tiny_model("qwen3"), overlap_scheduling=False)
    orders: List[List[int]] = []

    def record(batch):
        if batch.is_decode:
            orders.append([r.uid for r in batch.reqs])

    watch_batches(llm, record)
    llm.generate([[1, 2], [3, 4, 5], [6]], greedy(3), use_tqdm=False)
    assert orders and all(order == sorted(order) for order in orders)


def test_string_prompts_need_a_tokenizer(tiny_model):
    llm = make_llm(tiny_model("qwen3"))
    llm.tokenizer = None
    with pytest.raises(ValueError, match="token-id prompts"):
        llm.generate(["hello"], greedy(2), use_tqdm=False)
    assert torch.equal(llm._tokenize_one([1, 2]), torch.tensor([1, 2], dtype=torch.int32))


def test_requests_submitted_together_share_a_system_prompt(tiny_model):
    """Six prompts with one 64-token system prompt, submitted at once: the first computes it, the others wait one
    prefill for it to reach the radix cache and then compute only their own question."""
    system = list(range(100, 164))
    prompts = [system + [300 + 7 * i + j for j in range(5)] for i in range(6)]
    llm = make_llm(tiny_model("qwen3"), cache_type="radix")
    computed: List[int] = []

    def record(batch):
        if batch.is_prefill:
            computed.extend(r.extend_len for r in batch.reqs)

    watch_batches(llm, record)
    out = llm.generate(prompts, greedy(5), use_tqdm=False)
    assert sorted(computed) == [5] * 5 + [69]
    plain = make_llm(tiny_model("qwen3"), cache_type="naive").generate(prompts, greedy(5), use_tqdm=False)
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in plain]
    assert_pool_accounted(llm)


def test_a_deleted_llm_is_freed_without_the_garbage_collector(tiny_model):
    """`del llm` frees the LLM and its engine (and with them the weights and the KV pool) at once: nothing the LLM
    holds points back at it. Upstream stored bound methods on it (`self.receive_msg = self.offline_receive_msg`), a
    reference cycle that kept everything until the garbage collector ran."""
    llm = make_llm(tiny_model("qwen3"))
    llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)
    scheduler, engine = weakref.ref(llm), weakref.ref(llm.engine)
    gc.disable()
    try:
        llm.shutdown()
        del llm
        assert scheduler() is None and engine() is None
    finally:
        gc.enable()

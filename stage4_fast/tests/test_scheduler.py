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

from stage4_fast.core import SamplingParams
from stage4_fast.message import AbortBackendMsg
from stage4_fast.scheduler.prefill import ChunkedReq, PrefillManager

from .helpers import ReplyRecorder, assert_pool_accounted, greedy, make_llm, watch_batches


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


CONFIGS = list(itertools.product(["radix", "naive"], [1, 4], [True, False], [8, 8192], [False, True]))


@pytest.mark.parametrize("cache_type,page_size,overlap,chunk,mixed", CONFIGS)
def test_small_pool_outputs_and_accounting(tiny_model, reference, cache_type, page_size, overlap, chunk, mixed):
    """Three request slots and a pool far smaller than the demand: requests queue, the cache evicts, and still
    every output equals the plain run and every page and slot comes back (running requests in steps of their own
    or, mixed, inside the prefill batches)."""
    prompts, max_tokens = workload(seed=1)
    llm = make_llm(
        tiny_model("qwen3"),
        cache_type=cache_type,
        page_size=page_size,
        overlap_scheduling=overlap,
        max_extend_tokens=chunk,
        max_running_req=3,
        num_page_override=96 // page_size,
        enable_mixed_chunk=mixed,
    )
    assert sum(len(p) + n for p, n in zip(prompts, max_tokens)) > 96
    expected = reference(prompts, max_tokens)
    for _ in range(2):  # the second round starts with a warm prefix cache
        out = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
        assert [o["token_ids"] for o in out] == expected
        assert_pool_accounted(llm)


@pytest.mark.parametrize("mixed", [False, True])
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), abort_at=st.integers(0, 40), abort_uid=st.integers(0, 9))
def test_pool_accounting_after_random_workloads_with_an_abort(tiny_model, reference, mixed, seed, abort_at,
                                                              abort_uid):
    """Any workload, with one abort delivered at a random step: the aborted request reports it, every other output
    equals the plain run, and the pool is whole afterwards."""
    prompts, max_tokens = workload(seed)
    llm = _pressured_llm(tiny_model("qwen3"), mixed)
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


def _pressured_llm(model, mixed: bool = False):
    # one engine for all hypothesis examples (state carried between workloads is part of what is tested)
    if (model, mixed) not in _PRESSURED:
        _PRESSURED[model, mixed] = make_llm(
            model, page_size=4, max_running_req=3, max_extend_tokens=8, num_page_override=24, cache_type="radix",
            enable_mixed_chunk=mixed,
        )
    return _PRESSURED[model, mixed]


def _chunked_launches(llm) -> Tuple[List[Tuple[str, List[int], List[bool]]], List[int]]:
    """A 20-token prompt behind a 3-token one at a budget of 8: every launched batch (phase, uids, chunked flags)
    and the indices of the long prompt's chunks."""
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
    return launched, chunks


def test_chunked_prefill_alternates_with_decode(tiny_model):
    """A server's scheduler (decode_between_chunks, the default): the request already decoding gets a decode step
    between the long prompt's chunks instead of waiting for the whole prompt."""
    llm = make_llm(tiny_model("qwen3"), max_extend_tokens=8, overlap_scheduling=False, decode_between_chunks=True)
    launched, chunks = _chunked_launches(llm)
    between = launched[chunks[0] + 1 : chunks[-1]]
    assert any(phase == "decode" and uids == [0] for phase, uids, _ in between)


def test_burst_of_short_prompts_is_prefilled_back_to_back(tiny_model):
    """A server's scheduler: prompts that each fit a step but are cut where a step full of prompts ends are not a
    long prompt; their steps go in back to back (prefill first, as SGLang) although the first request is already
    decoding, so a burst takes no decode step per step boundary. The outputs are those of the offline order."""
    llm = make_llm(tiny_model("qwen3"), max_extend_tokens=8, overlap_scheduling=False, decode_between_chunks=True)
    launched: List[Tuple[str, List[int]]] = []
    watch_batches(llm, lambda b: launched.append((b.phase, [r.uid for r in b.reqs])))
    prompts = [list(range(10 * i + 1, 10 * i + 6)) for i in range(5)]  # 5 x 5 tokens: cut at 8, 16 and 24
    out = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert launched[:4] == [("prefill", [0, 1]), ("prefill", [1, 2, 3]), ("prefill", [3, 4]), ("prefill", [4])]
    assert all(phase == "decode" for phase, _ in launched[4:])
    offline = make_llm(tiny_model("qwen3"), max_extend_tokens=8, overlap_scheduling=False)
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in offline.generate(prompts, greedy(4),
                                                                                       use_tqdm=False)]


def test_the_step_log_has_a_line_per_loop_with_its_batch(tiny_model, tmp_path, monkeypatch):
    """MINISGL_STEP_LOG (scheduler/step_log.py): when the scheduler goes idle, a JSON line per loop of the overlap
    loop, with the batch it launched (kind, requests, input tokens), the host's time by part and its wait for the
    device; the outputs are those of a run without it."""
    import json

    prompts = [list(range(10 * i + 1, 10 * i + 6)) for i in range(3)]  # 3 x 5 tokens: prefill steps of 8 and 7
    plain = make_llm(tiny_model("qwen3"), max_extend_tokens=8)
    expected = [o["token_ids"] for o in plain.generate(prompts, greedy(3), use_tqdm=False)]
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MINISGL_STEP_LOG", str(path))
    llm = make_llm(tiny_model("qwen3"), max_extend_tokens=8)
    launched: List[Tuple[str, int]] = []
    watch_batches(llm, lambda b: launched.append((b.phase, b.size)))
    assert [o["token_ids"] for o in llm.generate(prompts, greedy(3), use_tqdm=False)] == expected
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["batch"], r["reqs"]) for r in rows if r["batch"]] == launched
    assert [(r["batch"], r["reqs"], r["tokens"]) for r in rows[:2]] == [("prefill", 2, 8), ("prefill", 2, 7)]
    assert all(r["tokens"] == r["reqs"] for r in rows if r["batch"] == "decode")
    assert rows[-1]["batch"] is None and rows[-1]["running"] == 0  # the loop that processed the last batch
    times = [r["t"] for r in rows]
    assert times == sorted(times)
    parts = ("receive_ms", "schedule_ms", "launch_ms", "process_ms", "wait_ms")
    assert all(r[k] >= 0 for r in rows for k in parts)
    assert all(r["wait_ms"] <= r["process_ms"] for r in rows)  # the wait is part of processing the results
    llm.generate(prompts[:1], greedy(2), use_tqdm=False)  # a second call appends its own lines
    assert len(path.read_text().splitlines()) > len(rows)


def test_the_step_log_writes_a_busy_schedulers_lines_every_max_rows_and_says_when_it_cannot_log(
        tiny_model, tmp_path, monkeypatch, caplog):
    """A scheduler that never goes idle still writes its lines, MAX_ROWS at a time (its memory stays bounded); one
    running the normal loop (overlap scheduling off) says that nothing will be logged."""
    from stage4_fast.scheduler import step_log

    path = tmp_path / "steps.jsonl"
    monkeypatch.setattr(step_log, "MAX_ROWS", 3)
    log = step_log.StepLog(str(path))
    for _ in range(7):
        log.begin()
        for _ in range(3):
            log.mark()
        log.end("decode", 1, 1, 0, 0, 1)
    assert len(path.read_text().splitlines()) == 6  # two writes of 3; the 7th line waits for the next
    monkeypatch.setenv("MINISGL_STEP_LOG", str(path))
    make_llm(tiny_model("qwen3"), overlap_scheduling=False)
    assert "logs the overlap loop only" in caplog.text


def test_offline_chunks_go_in_back_to_back(tiny_model):
    """The offline LLM's default: nobody reads tokens as they come, so the chunks run one after another (a decode
    step between them would leave the GPU waiting on the host) and the outputs are the same."""
    llm = make_llm(tiny_model("qwen3"), max_extend_tokens=8, overlap_scheduling=False)
    assert llm.config.decode_between_chunks is False
    launched, chunks = _chunked_launches(llm)
    assert chunks == [0, 1, 2]
    alternating = make_llm(tiny_model("qwen3"), max_extend_tokens=8, decode_between_chunks=True)
    prompts = [[7, 8, 9], list(range(100, 120))]
    assert ([o["token_ids"] for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
            == [o["token_ids"] for o in alternating.generate(prompts, greedy(6), use_tqdm=False)])


def test_mixed_chunks_carry_the_running_requests(tiny_model):
    """enable_mixed_chunk: the request already decoding takes its steps inside the long prompt's chunks (its one
    token each out of the budget of 8) instead of in decode batches between them; only a request's first token
    reports what its prompt cost; the outputs are those of unmixed scheduling."""
    model = tiny_model("qwen3")
    llm = make_llm(model, max_extend_tokens=8, overlap_scheduling=False, enable_mixed_chunk=True)
    launched: List[Tuple[str, List[int], int, int]] = []
    after_chunk: List[bool] = []  # what the scheduler remembers of each batch: was it a long prompt's chunk alone?

    def record(b):
        launched.append((b.phase, [r.uid for r in b.reqs], b.decode_reqs, sum(r.extend_len for r in b.reqs)))
        after_chunk.append(llm._last_was_lone_chunk)

    watch_batches(llm, record)
    recorder = ReplyRecorder(llm)
    prompts = [[7, 8, 9], list(range(100, 120))]
    out = llm.generate(prompts, greedy(6), use_tqdm=False)
    chunks = [i for i, (phase, uids, _, _) in enumerate(launched) if phase == "prefill" and 1 in uids]
    assert [launched[i][1:] for i in chunks] == [([0, 1], 0, 8), ([1, 0], 1, 8), ([1, 0], 1, 8), ([1, 0], 1, 2)]
    assert all(phase == "prefill" for phase, *_ in launched[: chunks[-1] + 1])  # no decode step of its own
    # a chunk followed by mixed-in decode requests still counts as alone (for when mixing cannot apply next); the
    # first step, request 0's whole prompt and the chunk, does not
    assert [after_chunk[i] for i in chunks] == [False, True, True, False]
    assert sorted(m.uid for m in recorder.msgs if m.prompt_tokens) == [0, 1]
    assert [m.prompt_tokens for m in recorder.msgs if m.prompt_tokens] == [3, 20]
    plain = make_llm(model, max_extend_tokens=8, overlap_scheduling=False)
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in plain.generate(prompts, greedy(6),
                                                                                     use_tqdm=False)]
    assert llm.stats()["prefill_tokens"] == 23
    assert_pool_accounted(llm)


def test_a_steps_plain_tokens_leave_as_one_columns_message(tiny_model):
    """Every decode step's tokens that are not a request's first or last leave the scheduler as one
    TokenColumnsMsg; with a stream interval (which holds messages by uid) they stay messages. Either way the
    requests get the same tokens."""
    from stage4_fast.message import TokenColumnsMsg

    prompts = [[7, 8, 9], [10, 11], [12, 13, 14, 15]]
    outputs, columns = {}, {}
    for interval in (1, 3):
        llm = make_llm(tiny_model("qwen3"), stream_interval=interval)
        sends: List[list] = []
        inner = llm.send_result

        def send(reply, sends=sends, inner=inner):
            sends.append(list(reply))
            inner(reply)

        llm.send_result = send  # type: ignore[method-assign]
        outputs[interval] = [o["token_ids"] for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
        columns[interval] = [[m for m in reply if isinstance(m, TokenColumnsMsg)] for reply in sends]
        del llm.send_result
    assert all(len(found) <= 1 for found in columns[1])  # one per step at most
    assert sum(len(c.uids) for found in columns[1] for c in found) == 3 * 4  # tokens 2..5 of each request
    assert not any(columns[3])
    assert outputs[1] == outputs[3]


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


def test_offline_prefill_step_default_follows_the_gpu(monkeypatch):
    """The offline LLM's prefill budget: 16,384 tokens on a CUDA GPU of 70 GiB or more other than an A100 (vLLM's
    LLM-class default), the scheduler's 8,192 elsewhere; an explicit max_extend_tokens always wins."""
    from types import SimpleNamespace

    from stage4_fast.llm import llm as llm_module

    def gpu(name: str, gib: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        props = SimpleNamespace(name=name, total_memory=gib << 30)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)

    gpu("NVIDIA H200", 141)
    assert llm_module.offline_prefill_tokens() == 16384
    gpu("NVIDIA A100-SXM4-80GB", 80)
    assert llm_module.offline_prefill_tokens() == 8192
    gpu("NVIDIA L4", 24)
    assert llm_module.offline_prefill_tokens() == 8192
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert llm_module.offline_prefill_tokens() == 8192


def test_offline_llm_on_cpu_keeps_the_default_prefill_budget(tiny_model):
    from stage4_fast.llm import LLM

    llm = LLM(str(tiny_model("qwen3")), dtype=torch.float32)
    try:
        assert llm.config.max_extend_tokens == 8192
    finally:
        llm.shutdown()
    llm = LLM(str(tiny_model("qwen3")), dtype=torch.float32, max_extend_tokens=64)
    try:
        assert llm.config.max_extend_tokens == 64
    finally:
        llm.shutdown()


def test_a_prompt_chunks_sampled_token_goes_to_the_last_column():
    """A non-final chunk samples a token nobody reads: it is written to the last column of its row (-1), never to
    the position where the next chunk's first prompt token goes (with overlap scheduling that write can land after
    the next chunk's prompt was copied in, and it would replace a prompt token)."""
    from stage4_fast.attention.utils import batch_seq_lens
    from stage4_fast.core import Batch, Req, SamplingParams
    from stage4_fast.scheduler.prefill import ChunkedReq
    from stage4_fast.scheduler.scheduler import Scheduler
    from stage4_fast.scheduler.utils import _write_rows_and_cols

    ids = torch.arange(10, dtype=torch.int32)
    chunk = ChunkedReq(input_ids=ids[:6], table_idx=3, cached_len=0, output_len=4, uid=1,
                       sampling_params=SamplingParams())
    whole = Req(input_ids=ids, table_idx=5, cached_len=6, output_len=4, uid=2, sampling_params=SamplingParams())
    batch = Batch(reqs=[chunk, whole], phase="prefill")
    batch.padded_reqs = batch.reqs
    rows, cols = _write_rows_and_cols(batch, batch_seq_lens(batch))
    assert rows.tolist() == [3, 5] and cols.tolist() == [-1, 10]
    for req in batch.reqs:
        req.complete_one()
    assert Scheduler._length_finished(batch) == [True, False]  # the chunk produces no token to continue from


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


def _writes_to(tensors: List[torch.Tensor]):
    """A dispatch mode counting in-place writes (slice copies, index puts) into any of ``tensors``' memory: on a GPU
    each is a launch (and a host copy for host values)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    writes = {torch.ops.aten.copy_.default, torch.ops.aten.index_put_.default, torch.ops.aten._index_put_impl_.default}

    class CountWrites(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in writes and args[0].untyped_storage().data_ptr() in ptrs:
                CountWrites.count += 1
            return func(*args, **(kwargs or {}))

    return CountWrites()


@pytest.mark.parametrize("cached_prefix", [False, True])
def test_a_prefill_batch_writes_the_pools_in_a_fixed_number_of_operations(tiny_model, cached_prefix):
    """Admitting a prefill batch writes every request's prompt ids into the token pool, a cached prefix's slots and
    the new slots into the page table: one scatter each for the whole batch, whether it holds 2 requests or 24."""
    from stage4_fast.message import UserMsg

    counts = []
    for num_reqs in (2, 24):
        llm = make_llm(tiny_model("qwen3"))
        prefix = list(range(40, 72))
        # (prompts that share an uncached prefix would wait for the first one's prefill)
        prompts = [(prefix if cached_prefix else [200 + i] * 32) + [100 + i, 7, 8] for i in range(num_reqs)]
        if cached_prefix:
            llm.generate([prefix + [99]], greedy(1), use_tqdm=False)
        for uid, prompt in enumerate(prompts):
            llm.prefill_manager.add_one_req(UserMsg(uid, torch.tensor(prompt, dtype=torch.int32), greedy(4)))
        with _writes_to([llm.token_pool, llm.engine.page_table]) as mode:
            fwd_input = llm._schedule_next_batch()
        assert fwd_input is not None and fwd_input.batch.size == num_reqs
        assert all(req.cached_len == (32 if cached_prefix else 0) for req in fwd_input.batch.reqs)
        counts.append(mode.count)
        # the rows hold what a copy per request would have written
        for req, prompt in zip(fwd_input.batch.reqs, prompts):
            assert llm.token_pool[req.table_idx, : len(prompt)].tolist() == prompt
            slots = llm.engine.page_table[req.table_idx, : len(prompt)]
            assert len(set(slots.tolist())) == len(prompt)
        if cached_prefix:
            first, second = (llm.engine.page_table[r.table_idx, :32] for r in fwd_input.batch.reqs[:2])
            assert torch.equal(first, second)  # both read the cached prefix's slots
    assert counts[0] == counts[1] == (3 if cached_prefix else 2), counts

"""Regression tests for four upstream overlap-scheduling defects (stage2_scheduled/README.md, "Upstream defects
fixed here", 1-4, with upstream's file and line).

Each defect has a check that passes here, and a companion test that puts upstream's behaviour back by
monkeypatching the one scheduler method that carries our fix and asserts that the same check then FAILS. So the
suite itself shows that every check can tell fixed from broken.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

from stage3_served.llm import LLM
from stage3_served.message import AbortBackendMsg, DetokenizeMsg
from stage3_served.scheduler import Scheduler

from .helpers import InFlightTracker, ReplyRecorder, assert_pool_accounted, greedy, make_llm

PROMPTS = [[101 + 13 * i + 7 * j for j in range(6 + 5 * i)] for i in range(4)]


def reference_tokens(model: Path, prompts: List[List[int]], max_tokens: int) -> List[List[int]]:
    llm = make_llm(model, overlap_scheduling=False)
    return [o["token_ids"] for o in llm.generate(prompts, greedy(max_tokens), use_tqdm=False)]


def first_new_token_index(tokens: List[int], start: int = 2) -> int:
    """An index k >= start whose token does not occur before it: declaring that token EOS ends the request at k."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k
    raise AssertionError(f"no fresh token in {tokens}")


# -- bug 1: `finished` one token early --------------------------------------------------------------------------
def upstream_length_finished(batch):
    """Upstream reads req.can_decode while processing batch N, after batch N+1 has advanced the request."""

    class LiveView:
        def __getitem__(self, i: int) -> bool:
            return not batch.reqs[i].can_decode

    return LiveView()


def check_finished_only_on_last_token(model: Path) -> None:
    max_tokens = [1, 2, 5, 3]
    expected = [ref[:n] for ref, n in zip(reference_tokens(model, PROMPTS, 5), max_tokens)]
    llm = make_llm(model, overlap_scheduling=True)
    recorder = ReplyRecorder(llm)
    out = llm.generate(PROMPTS, [greedy(n) for n in max_tokens], use_tqdm=False)
    msgs = recorder.by_uid()
    for uid, n in enumerate(max_tokens):
        assert [m.finished for m in msgs[uid]] == [False] * (n - 1) + [True], f"request {uid}"
        assert out[uid]["token_ids"] == expected[uid]


def test_finished_flag_comes_with_the_last_token(tiny_model):
    """Upstream bug 1: under overlap scheduling a length-capped request with one token left after batch N is
    reported finished with batch N's token, since batch N+1 (already launched) has used up its last slot; the
    real last token follows as a second `finished` message, which a streaming client never reads."""
    check_finished_only_on_last_token(tiny_model("qwen3"))


def test_finished_flag_check_fails_on_upstream_behaviour(tiny_model, monkeypatch):
    monkeypatch.setattr(Scheduler, "_length_finished", staticmethod(upstream_length_finished))
    with pytest.raises(AssertionError):
        check_finished_only_on_last_token(tiny_model("qwen3"))


# -- bug 2: a stale message after EOS ---------------------------------------------------------------------------
def check_nothing_after_eos(model: Path) -> None:
    ref = reference_tokens(model, PROMPTS[:2], 10)
    k = first_new_token_index(ref[0])
    llm = make_llm(model, overlap_scheduling=True)
    llm.eos_token_id = ref[0][k]  # request 0 meets "EOS" as its (k+1)-th token
    recorder = ReplyRecorder(llm)
    out = llm.generate(PROMPTS[:2], [greedy(10, ignore_eos=False), greedy(10)], use_tqdm=False)
    msgs = recorder.by_uid()[0]
    assert [m.next_token for m in msgs] == ref[0][: k + 1], "a message after the EOS message"
    assert [m.finished for m in msgs] == [False] * k + [True]
    assert out[0]["token_ids"] == ref[0][:k]  # the EOS itself is not output
    assert out[1]["token_ids"] == ref[1]


def test_no_message_after_eos(tiny_model):
    """Upstream bug 2: a request that meets EOS in batch N is already part of batch N+1; upstream still sends that
    batch's token for it (a stale message after `finished`), and offline LLM.generate appends it to the output."""
    check_nothing_after_eos(tiny_model("qwen3"))


def test_eos_check_fails_on_upstream_behaviour(tiny_model, monkeypatch):
    monkeypatch.setattr(Scheduler, "_is_stale", lambda self, req: False)
    with pytest.raises(AssertionError):
        check_nothing_after_eos(tiny_model("qwen3"))


# -- bug 3: a request slot reused while its last batch is in flight ----------------------------------------------
def upstream_finish_req(self: Scheduler, req) -> None:
    """Upstream frees a finished request's slot and pages at once, while processing batch N, although batch N+1,
    launched before, may still use them. (It keeps the bug-2 fix, so only the release timing differs.)"""
    self.decode_manager.remove_req(req)
    self.finished_reqs.add(req)
    self._free_req_resources(req)


def check_no_reuse_in_flight(model: Path) -> None:
    ref = reference_tokens(model, PROMPTS[:2], 10)
    k = first_new_token_index(ref[0])
    # one request slot: request 1 can only start on the slot request 0 leaves behind
    llm = make_llm(model, overlap_scheduling=True, max_running_req=1, page_size=4)
    tracker = InFlightTracker(llm)
    llm.eos_token_id = ref[0][k]
    out = llm.generate(PROMPTS[:2], [greedy(10, ignore_eos=False), greedy(10)], use_tqdm=False)
    assert tracker.violations == []
    assert [o["token_ids"] for o in out] == [ref[0][:k], ref[1]]
    assert_pool_accounted(llm)


def test_slot_and_pages_not_reused_while_in_flight(tiny_model):
    """Upstream bug 3: a request finished (EOS) while processing batch N is still in batch N+1, which is running
    on the GPU and will write its sampled token into token_pool[slot] and its KV into the request's pages. Upstream
    frees slot and pages at once, so step N+2 hands them to a new request whose prompt can be overwritten. On CPU
    the tracker (conftest.py) stands for the GPU: a batch is in flight until its event is waited on."""
    check_no_reuse_in_flight(tiny_model("qwen3"))


def test_reuse_check_fails_on_upstream_behaviour(tiny_model, monkeypatch):
    monkeypatch.setattr(Scheduler, "_finish_req", upstream_finish_req)
    with pytest.raises(AssertionError):
        check_no_reuse_in_flight(tiny_model("qwen3"))


# -- bug 4: abort during an in-flight prefill ---------------------------------------------------------------------
def upstream_abort_req(self: Scheduler, uid: int) -> None:
    """Upstream frees an aborted request at once, unmarked, even when the batch in flight contains it. (The abort
    reply is ours, kept so that only the freeing differs.)"""
    found = self.prefill_manager.has_req(uid)
    req = self.prefill_manager.abort_req(uid)
    if req is None:
        req = self.decode_manager.abort_req(uid)
    if req is not None:
        self._free_req_resources(req)
    if found or req is not None:
        self.send_result([DetokenizeMsg(uid, -1, True, "aborted")])


def abort_after_first_launch(llm: LLM, tracker: InFlightTracker, uid: int) -> None:
    """Deliver AbortBackendMsg(uid) with the first messages received after a batch containing uid was launched:
    under overlap scheduling that batch is then still in flight."""
    inner = llm.receive_msg
    sent = False

    def receive_msg(blocking: bool = False):
        nonlocal sent
        msgs = inner(blocking=blocking)
        if not sent and any(uid in uids for uids in tracker.launched_uids):
            sent = True
            msgs.append(AbortBackendMsg(uid))
        return msgs

    llm.receive_msg = receive_msg  # type: ignore[method-assign]


def check_abort_in_flight(model: Path, chunked: bool) -> None:
    long_prompt = list(range(300, 320))  # 20 tokens: three chunks at a budget of 8
    ref = reference_tokens(model, [PROMPTS[1]], 6)
    llm = make_llm(model, overlap_scheduling=True, max_running_req=1, max_extend_tokens=8 if chunked else 8192)
    tracker = InFlightTracker(llm)
    abort_after_first_launch(llm, tracker, uid=0)
    out = llm.generate([long_prompt, PROMPTS[1]], greedy(6), use_tqdm=False)
    assert out[0].get("error") == "aborted"
    assert out[1]["token_ids"] == ref[0]
    assert tracker.violations == []
    assert_pool_accounted(llm)


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill", "chunk"])
def test_abort_during_in_flight_prefill(tiny_model, chunked):
    """Upstream bug 4: an abort arriving while the request's prefill batch is in flight frees the request at once;
    processing that batch then caches its prompt again (the pages end up both in the radix tree and on the free
    list, and a handle stays locked forever). For an in-flight chunk, slot and pages go to the next request while
    the chunk still runs."""
    check_abort_in_flight(tiny_model("qwen3"), chunked)


@pytest.mark.parametrize("chunked", [False, True], ids=["prefill", "chunk"])
def test_abort_check_fails_on_upstream_behaviour(tiny_model, monkeypatch, chunked):
    monkeypatch.setattr(Scheduler, "_abort_req", upstream_abort_req)
    with pytest.raises(AssertionError):
        check_abort_in_flight(tiny_model("qwen3"), chunked)

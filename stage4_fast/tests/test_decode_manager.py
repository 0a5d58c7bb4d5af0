"""The running set after a launch (scheduler/decode.py, DecodeManager.filter_reqs): the running set judged once, then
the batch's requests that were not in it. It must be the set (and order) of the union filtered, as before: running
requests first, then those that join."""

from __future__ import annotations

import random
from itertools import chain

import pytest
import torch

from stage4_fast.core import Req, SamplingParams
from stage4_fast.scheduler.decode import DecodeManager


def _req(uid: int, output_len: int) -> Req:
    return Req(input_ids=torch.tensor([1, 2, 3], dtype=torch.int32), table_idx=uid, cached_len=0,
               output_len=output_len, uid=uid, sampling_params=SamplingParams())


def _launch(reqs: list[Req]) -> None:
    for req in reqs:
        req.complete_one()


def test_a_decode_batch_drops_what_finished_and_keeps_the_order() -> None:
    dm = DecodeManager(page_size=1)
    reqs = [_req(uid, output_len) for uid, output_len in enumerate([3, 1, 2, 3])]
    _launch(reqs)  # the prefill: each request's first token
    dm.filter_reqs(reqs)
    assert [r.uid for r in dm.running_reqs] == [0, 2, 3]  # uid 1 had one token to give
    batch = dm.schedule_next_batch()
    assert batch is not None
    _launch(batch.reqs)
    dm.filter_reqs(batch.reqs)
    assert [r.uid for r in dm.running_reqs] == [0, 3]


def test_the_filter_gives_the_filtered_union() -> None:
    rng = random.Random(0)
    dm = DecodeManager(page_size=1)
    reqs = [_req(uid, rng.randint(1, 12)) for uid in range(40)]
    _launch(reqs)
    dm.filter_reqs(reqs)
    while (batch := dm.schedule_next_batch()) is not None:
        _launch(batch.reqs)
        general = [r for r in dict.fromkeys(chain(dm.running_reqs, batch.reqs)) if r.can_decode]
        dm.filter_reqs(batch.reqs)
        assert list(dm.running_reqs) == general


@pytest.mark.parametrize("with_flags", [False, True])
def test_a_batch_that_is_no_longer_the_running_set_still_gives_the_union(with_flags: bool) -> None:
    """With or without the batch's last-token flags: flags for a batch that is no longer the running set are not
    trusted."""
    dm = DecodeManager(page_size=1)
    reqs = [_req(uid, 5) for uid in range(3)]
    _launch(reqs)
    dm.filter_reqs(reqs)
    batch = dm.schedule_next_batch()
    assert batch is not None
    dm.remove_req(reqs[1])  # the running set changed after the batch was formed (the batch still holds it)
    _launch(batch.reqs)
    dm.filter_reqs(batch.reqs, [False] * 3 if with_flags else None)
    assert [r.uid for r in dm.running_reqs] == [0, 2, 1]  # running set first, then the batch's others


def test_a_prefill_batch_joins_the_running_set() -> None:
    dm = DecodeManager(page_size=1)
    old = [_req(0, 5)]
    _launch(old)
    dm.filter_reqs(old)
    new = [_req(1, 5)]
    _launch(new)
    dm.filter_reqs(new)
    assert [r.uid for r in dm.running_reqs] == [0, 1]


def test_a_decode_batchs_finished_flags_give_the_same_set() -> None:
    """The scheduler passes a decode batch's "token was its last" flags (it asked every request once already): the
    running set kept from them is the one the general filter gives."""
    rng = random.Random(1)
    dm = DecodeManager(page_size=1)
    reqs = [_req(uid, rng.randint(1, 12)) for uid in range(40)]
    _launch(reqs)
    dm.filter_reqs(reqs)
    steps = 0
    while (batch := dm.schedule_next_batch()) is not None:
        _launch(batch.reqs)
        general = [r for r in dict.fromkeys(chain(dm.running_reqs, batch.reqs)) if r.can_decode]
        dm.filter_reqs(batch.reqs, [not r.can_decode for r in batch.reqs])
        assert list(dm.running_reqs) == general
        steps += 1
    assert steps == 11  # the longest request: 12 tokens, the first from its prefill

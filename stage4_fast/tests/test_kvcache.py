from __future__ import annotations

import torch

from stage4_fast.core import SamplingParams
from stage4_fast.engine import ManualBatcher
from stage4_fast.kvcache import MHAKVCache

from .conftest import make_engine


def test_store_kv_writes_only_the_given_slots():
    pool = MHAKVCache(
        num_kv_heads=2,
        num_layers=3,
        head_dim=4,
        num_pages=5,
        page_size=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    for layer in range(3):
        pool.k_cache(layer).fill_(-1.0)
        pool.v_cache(layer).fill_(-2.0)
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    out_loc = torch.tensor([3, 6])
    pool.store_kv(k, v, out_loc, layer_id=1)

    k_slots = pool.k_cache(1).reshape(-1, 2, 4)
    v_slots = pool.v_cache(1).reshape(-1, 2, 4)
    assert torch.equal(k_slots[out_loc], k) and torch.equal(v_slots[out_loc], v)
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[out_loc] = False
    assert (k_slots[untouched] == -1.0).all() and (v_slots[untouched] == -2.0).all()
    for layer in (0, 2):
        assert (pool.k_cache(layer) == -1.0).all() and (pool.v_cache(layer) == -2.0).all()


def test_decode_step_writes_only_the_new_tokens_slots(tiny_model):
    engine = make_engine(tiny_model("qwen2"), page_size=4)
    batcher = ManualBatcher(engine)
    reqs = [batcher.add_req(list(range(10, 10 + n)), SamplingParams(max_tokens=4)) for n in (3, 8)]
    batcher.step(reqs, "prefill")
    table_before = engine.page_table.clone()
    kv_before = [engine.kv_cache.k_cache(i).clone() for i in range(2)] + [
        engine.kv_cache.v_cache(i).clone() for i in range(2)
    ]

    batch = batcher.make_batch(reqs, "decode")
    engine.forward_batch(batch, engine.sampler.prepare(batch))

    # page table: request 0 (positions 0..3) still fits its first page; request 1 (position 8) got a new page,
    # which fills exactly columns 8..11 of its row
    changed = (engine.page_table != table_before).nonzero().tolist()
    assert changed == [[reqs[1].table_idx, c] for c in range(8, 12)]
    new_slots = batch.out_loc.long()
    assert new_slots.tolist() == [engine.page_table[r.table_idx, r.cached_len - 1].item() for r in reqs]
    kv_after = [engine.kv_cache.k_cache(i) for i in range(2)] + [engine.kv_cache.v_cache(i) for i in range(2)]
    for before, after in zip(kv_before, kv_after):
        # compare bits, not values: never-written slots hold arbitrary bytes, possibly NaN (NaN != NaN)
        changed_bits = before.view(torch.int32) != after.view(torch.int32)
        diff_slots = changed_bits.flatten(2).any(2).flatten().nonzero().flatten()
        assert set(diff_slots.tolist()) == set(new_slots.tolist())


def test_requests_get_disjoint_pages(tiny_model):
    engine = make_engine(tiny_model("qwen2"), page_size=4)
    batcher = ManualBatcher(engine)
    reqs = [batcher.add_req(list(range(1, 1 + n)), SamplingParams(max_tokens=2)) for n in (5, 9, 2)]
    batcher.step(reqs, "prefill")
    slots = [set(engine.page_table[r.table_idx, : r.cached_len].tolist()) for r in reqs]
    assert sum(len(s) for s in slots) == len(set().union(*slots))
    for s in slots:  # page_size 4: a request's slots come in whole, aligned pages
        assert all(slot // 4 * 4 in s for slot in s)

"""Radix prefix cache: structure (split), LRU eviction, locking and reference counts.

The tree only needs host tensors: token ids are the keys, and made-up slot numbers play the KV slots.
"""

from __future__ import annotations

import pytest
import torch

from stage2_scheduled.kvcache.radix_cache import RadixCacheHandle, RadixPrefixCache, RadixTreeNode

CPU = torch.device("cpu")


def ids(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int32)


def slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int32)


def matched(cache: RadixPrefixCache, tokens: torch.Tensor) -> tuple[int, list[int]]:
    handle = cache.match_prefix(tokens).cuda_handle
    return handle.cached_len, handle.get_matched_indices().tolist()


def test_match_on_empty_cache_is_empty():
    cache = RadixPrefixCache(CPU)
    assert matched(cache, ids(1, 2, 3)) == (0, [])


def test_insert_then_match_returns_the_inserted_slots():
    cache = RadixPrefixCache(CPU)
    result = cache.insert_prefix(ids(1, 2, 3, 4), slots(100, 4))
    assert result.cached_len == 0 and result.handle.cached_len == 4
    assert matched(cache, ids(1, 2, 3, 4, 5)) == (4, [100, 101, 102, 103])
    assert matched(cache, ids(1, 2, 9)) == (2, [100, 101])
    assert matched(cache, ids(7)) == (0, [])
    cache.check_integrity()


def test_divergent_insert_splits_the_node_and_keeps_both_tails():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 2, 3, 4, 5, 6), slots(0, 6))
    result = cache.insert_prefix(ids(1, 2, 3, 9, 9), slots(50, 5))
    assert result.cached_len == 3  # the shared head was already there: the caller frees its own slots 50..52
    (head,) = cache.root_node.children.values()
    assert head.key.tolist() == [1, 2, 3] and head.value.tolist() == [0, 1, 2]
    tails = sorted(child.key.tolist() for child in head.children.values())
    assert tails == [[4, 5, 6], [9, 9]]
    assert matched(cache, ids(1, 2, 3, 4, 5, 6)) == (6, [0, 1, 2, 3, 4, 5])
    assert matched(cache, ids(1, 2, 3, 9, 9)) == (5, [0, 1, 2, 53, 54])
    assert cache.size_info.evictable_size == 8
    cache.check_integrity()


def test_match_in_the_middle_of_a_node_splits_it_without_changing_content():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 2, 3, 4), slots(10, 4))
    length, indices = matched(cache, ids(1, 2, 7))
    assert (length, indices) == (2, [10, 11])
    assert matched(cache, ids(1, 2, 3, 4)) == (4, [10, 11, 12, 13])
    assert cache.size_info.evictable_size == 4
    cache.check_integrity()


def test_page_size_aligns_matches_and_inserts_down():
    cache = RadixPrefixCache(CPU, page_size=4)
    result = cache.insert_prefix(ids(*range(10)), slots(0, 10))
    assert result.handle.cached_len == 8  # two whole pages; the partial third page stays with the caller
    assert matched(cache, ids(*range(10))) == (8, list(range(8)))
    assert matched(cache, ids(0, 1, 2, 3, 4, 5, 9, 9)) == (4, [0, 1, 2, 3])  # 6 common tokens -> one page
    assert matched(cache, ids(0, 1, 2)) == (0, [])
    cache.check_integrity()


def test_children_are_keyed_by_their_first_page():
    cache = RadixPrefixCache(CPU, page_size=2)
    cache.insert_prefix(ids(1, 2, 3, 4), slots(0, 4))
    cache.insert_prefix(ids(1, 5, 3, 4), slots(10, 4))  # same first token, different first page
    assert set(cache.root_node.children) == {(1, 2), (1, 5)}
    assert matched(cache, ids(1, 5, 3, 4)) == (4, [10, 11, 12, 13])
    cache.check_integrity()


def test_eviction_takes_least_recently_used_leaves_first():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 1), slots(0, 2))  # A
    cache.insert_prefix(ids(2, 2), slots(2, 2))  # B
    cache.insert_prefix(ids(3, 3), slots(4, 2))  # C
    cache.match_prefix(ids(1, 1))  # touching A makes B the oldest
    assert cache.evict(2).tolist() == [2, 3]
    assert cache.evict(1).tolist() == [4, 5]  # whole nodes: may return more than asked
    assert cache.evict(2).tolist() == [0, 1]
    assert cache.size_info == (0, 0)
    cache.check_integrity()


def test_eviction_walks_up_once_a_parent_becomes_a_leaf():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 2, 3), slots(0, 3))
    cache.insert_prefix(ids(1, 2, 4), slots(10, 3))  # splits into [1,2] -> {[3], [4]}
    cache.insert_prefix(ids(5), slots(20, 1))
    evicted = cache.evict(4)
    # the two tails are older than [5]; once both are gone their parent [1, 2] is a leaf and goes next
    assert sorted(evicted.tolist()) == [0, 1, 2, 12]
    assert matched(cache, ids(5)) == (1, [20])
    cache.check_integrity()


def _nodes_evict_looks_at(monkeypatch, num_leaves: int, evict_leaves: int) -> int:
    """Nodes evict() examines (is_leaf calls) when it takes back `evict_leaves` of `num_leaves` two-token leaves,
    half of them touched since they were inserted (their queue entries are stale)."""
    cache = RadixPrefixCache(CPU)
    for i in range(num_leaves):
        cache.insert_prefix(ids(i, i), slots(2 * i, 2))
    for i in range(0, num_leaves, 2):
        cache.match_prefix(ids(i, i))
    calls = 0
    is_leaf = RadixTreeNode.is_leaf

    def counting(node: RadixTreeNode) -> bool:
        nonlocal calls
        calls += 1
        return is_leaf(node)

    monkeypatch.setattr(RadixTreeNode, "is_leaf", counting)
    evicted = cache.evict(2 * evict_leaves)
    monkeypatch.setattr(RadixTreeNode, "is_leaf", is_leaf)
    untouched = [2 * i + j for i in range(1, 2 * evict_leaves, 2) for j in (0, 1)]  # the odd leaves, oldest first
    assert sorted(evicted.tolist()) == untouched
    cache.check_integrity()
    return calls


def test_eviction_cost_grows_with_what_is_evicted_not_with_the_tree(monkeypatch):
    """A server whose pool is full evicts every few steps, from a tree that holds everything it has served. Upstream
    (and this cache before) walked every node on each evict() call; now evicting k leaves looks at O(k) nodes."""
    small = _nodes_evict_looks_at(monkeypatch, 40, 5)
    large = _nodes_evict_looks_at(monkeypatch, 4000, 5)
    assert large == small <= 4 * 5 * 2  # the untouched leaves, the touched ones re-queued, and their parents
    assert _nodes_evict_looks_at(monkeypatch, 4000, 50) <= 10 * small


def test_lock_and_touch_cycles_keep_the_eviction_queue_bounded():
    cache = RadixPrefixCache(CPU)
    for i in range(10):
        cache.insert_prefix(ids(i, i, i), slots(3 * i, 3))
    for step in range(5000):  # every cycle queues the leaf again; stale entries must not pile up
        handle = cache.match_prefix(ids(step % 10, step % 10)).cuda_handle  # splits once, then touches
        cache.lock_handle(handle)
        cache.lock_handle(handle, unlock=True)
    assert len(cache._leaf_heap) <= 2 * cache.num_nodes + 65
    cache.check_integrity()
    assert cache.evict(cache.size_info.evictable_size).numel() == 30


def test_evicting_zero_is_a_no_op_and_more_than_evictable_is_an_error():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 2), slots(0, 2))
    assert cache.evict(0).numel() == 0
    with pytest.raises(AssertionError):
        cache.evict(3)


def test_locked_nodes_are_never_evicted():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 2, 3, 4), slots(0, 4))
    cache.insert_prefix(ids(1, 2, 7, 7), slots(10, 4))
    cache.insert_prefix(ids(9, 9), slots(20, 2))
    handle = cache.match_prefix(ids(1, 2, 3, 4)).cuda_handle
    cache.lock_handle(handle)
    assert cache.size_info == (4, 4)  # [1,2] and [3,4] protected; [7,7] and [9,9] evictable
    evicted = cache.evict(cache.size_info.evictable_size)
    assert sorted(evicted.tolist()) == [12, 13, 20, 21]
    assert matched(cache, ids(1, 2, 3, 4)) == (4, [0, 1, 2, 3])
    with pytest.raises(AssertionError):
        cache.evict(1)  # nothing evictable is left; the locked path stays
    cache.lock_handle(handle, unlock=True)
    assert cache.size_info == (4, 0)
    assert sorted(cache.evict(4).tolist()) == [0, 1, 2, 3]
    cache.check_integrity()


def test_split_of_a_locked_node_keeps_it_protected():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 2, 3, 4), slots(0, 4))
    handle = cache.match_prefix(ids(1, 2, 3, 4)).cuda_handle
    cache.lock_handle(handle)
    cache.insert_prefix(ids(1, 2, 8), slots(10, 3))  # splits the locked node
    cache.check_integrity()
    assert cache.size_info == (1, 4)
    assert sorted(cache.evict(1).tolist()) == [12]
    cache.lock_handle(handle, unlock=True)
    cache.check_integrity()


def test_reference_counts_return_to_zero():
    cache = RadixPrefixCache(CPU, page_size=2)
    prompts = [ids(1, 2, 3, 4, 5, 6), ids(1, 2, 3, 4, 7, 8), ids(1, 2, 9, 9), ids(4, 4)]
    handles: list[RadixCacheHandle] = []
    for i, prompt in enumerate(prompts):
        cache.insert_prefix(prompt, slots(100 * i, len(prompt)))
    for prompt in prompts + prompts[:2]:  # shared prefixes are locked several times over
        handle = cache.match_prefix(prompt).cuda_handle
        cache.lock_handle(handle)
        handles.append(handle)
    cache.check_integrity()
    assert cache.size_info.evictable_size == 0
    for handle in reversed(handles):
        cache.lock_handle(handle, unlock=True)
        cache.check_integrity()
    nodes = cache._all_nodes()
    assert nodes and all(node.ref_count == 0 for node in nodes)
    assert cache.size_info == (sum(n.length for n in nodes), 0)
    with pytest.raises(AssertionError):
        cache.lock_handle(handles[0], unlock=True)  # one unlock too many is caught, not absorbed


def test_inserted_copies_do_not_alias_the_callers_tensors():
    cache = RadixPrefixCache(CPU)
    tokens, indices = ids(1, 2, 3), slots(0, 3)
    cache.insert_prefix(tokens, indices)
    tokens[:] = 9
    indices[:] = 99
    assert matched(cache, ids(1, 2, 3)) == (3, [0, 1, 2])


def test_check_integrity_catches_a_slot_owned_twice():
    cache = RadixPrefixCache(CPU)
    cache.insert_prefix(ids(1, 2), slots(0, 2))
    cache.insert_prefix(ids(3, 4), slots(1, 2))  # slot 1 handed to the tree twice
    with pytest.raises(AssertionError, match="owned by two"):
        cache.check_integrity()

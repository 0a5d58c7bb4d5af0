"""Property test: the radix cache against a brute-force model of what a prefix cache must answer.

The model stores, for every cached prefix (a tuple of token ids ending on a page boundary), the slots of its last
page. Matching is then "the longest page-aligned prefix present", inserting adds the missing prefixes, and eviction
may only remove prefixes that no locked handle covers, never a prefix while keeping one of its extensions.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from stage4_fast.kvcache.radix_cache import RadixCacheHandle, RadixPrefixCache

Key = Tuple[int, ...]

# a tiny alphabet makes prompts share prefixes and diverge inside nodes (splits, also of locked nodes)
token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class RadixVersusModel(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.cache = RadixPrefixCache(torch.device("cpu"), page_size)
        self.model: Dict[Key, List[int]] = {}  # page-aligned prefix -> slots of its last page
        self.locked: List[Tuple[RadixCacheHandle, Key]] = []
        self.next_slot = 0

    # -- the model -------------------------------------------------------------------------------------------
    def model_match(self, tokens: List[int]) -> Tuple[int, List[int]]:
        length, indices = 0, []
        while length + self.ps <= len(tokens) and tuple(tokens[: length + self.ps]) in self.model:
            length += self.ps
            indices += self.model[tuple(tokens[:length])]
        return length, indices

    def protected_keys(self) -> set[Key]:
        return {key[:end] for _, key in self.locked for end in range(self.ps, len(key) + 1, self.ps)}

    # -- operations ------------------------------------------------------------------------------------------
    @rule(tokens=token_lists)
    def insert(self, tokens: List[int]) -> None:
        indices = list(range(self.next_slot, self.next_slot + len(tokens)))
        self.next_slot += len(tokens)
        result = self.cache.insert_prefix(torch.tensor(tokens, dtype=torch.int32), torch.tensor(indices))
        expected_cached, _ = self.model_match(tokens)
        aligned = len(tokens) // self.ps * self.ps
        assert result.cached_len == expected_cached
        assert result.handle.cached_len == aligned
        for end in range(expected_cached + self.ps, aligned + 1, self.ps):
            self.model[tuple(tokens[:end])] = indices[end - self.ps : end]

    @rule(tokens=token_lists)
    def match(self, tokens: List[int]) -> None:
        handle = self.cache.match_prefix(torch.tensor(tokens, dtype=torch.int32)).cuda_handle
        assert (handle.cached_len, handle.get_matched_indices().tolist()) == self.model_match(tokens)

    @rule(tokens=token_lists)
    def lock(self, tokens: List[int]) -> None:
        handle = self.cache.match_prefix(torch.tensor(tokens, dtype=torch.int32)).cuda_handle
        self.cache.lock_handle(handle)
        self.locked.append((handle, tuple(tokens[: handle.cached_len])))

    @precondition(lambda self: self.locked)
    @rule(pick=st.integers(0, 1000))
    def unlock(self, pick: int) -> None:
        handle, _ = self.locked.pop(pick % len(self.locked))
        self.cache.lock_handle(handle, unlock=True)

    @rule(fraction=st.floats(0, 1))
    def evict(self, fraction: float) -> None:
        evictable = self.cache.size_info.evictable_size
        size = int(evictable * fraction)
        evicted = set(self.cache.evict(size).tolist())
        assert len(evicted) >= size
        protected = self.protected_keys()
        gone = {key for key, page in self.model.items() if set(page) <= evicted}
        assert all(set(page).isdisjoint(evicted) for key, page in self.model.items() if key not in gone), (
            "evict() split a page"
        )
        assert sum(len(self.model[key]) for key in gone) == len(evicted)
        assert not gone & protected, "a locked prefix was evicted"
        for key in gone:
            del self.model[key]
        for key in self.model:  # no hole: every surviving prefix still has all its shorter prefixes
            assert all(key[:end] in self.model for end in range(self.ps, len(key), self.ps))

    # -- invariants ------------------------------------------------------------------------------------------
    @invariant()
    def sizes_and_integrity(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        protected = self.protected_keys()
        protected_tokens = sum(len(self.model[key]) for key in protected)
        total = sum(len(page) for page in self.model.values())
        assert self.cache.size_info == (total - protected_tokens, protected_tokens)
        assert sorted(self.cache.all_indices().tolist()) == sorted(s for page in self.model.values() for s in page)


RadixVersusModel.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None, derandomize=True)
test_radix_cache_matches_brute_force_model = RadixVersusModel.TestCase

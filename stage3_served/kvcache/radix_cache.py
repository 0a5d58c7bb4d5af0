"""Radix-tree prefix cache (`--cache radix`): requests that share a prompt prefix share its KV slots.

A node holds token ids (`key`, host) and their KV slots (`value`, device); children are keyed by their first page,
and every length is a multiple of the page size. Locking a handle counts a reference on every node up to the root;
only unlocked leaves are evicted, least recently used first, from a heap (upstream walks the whole tree per evict).
Stale heap entries are skipped when popped; the heap is rebuilt past twice the node count (O(1) amortised)."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from ..utils import align_down
from .base import BaseCacheHandle, BasePrefixCache, InsertResult, MatchResult, SizeInfo

# a logical clock, not upstream's time.monotonic_ns(): no ties, so eviction order is deterministic
_CLOCK = itertools.count(1)
_UUID = itertools.count()


def fast_compare_key(x: torch.Tensor, y: torch.Tensor) -> int:
    """Length of the common prefix of two 1-D host tensors (upstream: a C++ std::mismatch kernel)."""
    n = min(len(x), len(y))
    if n == 0:
        return 0
    mismatch = (x[:n] != y[:n]).nonzero()
    return int(mismatch[0]) if len(mismatch) else n


class RadixTreeNode:
    def __init__(self, key_fn: Callable[[torch.Tensor], Hashable], tic: int | None = None) -> None:
        self.key_fn = key_fn
        self.children: dict[Hashable, RadixTreeNode] = {}
        self._parent: RadixTreeNode | None = None
        self.ref_count = 0
        self.uuid = next(_UUID)
        self.timestamp = tic if tic is not None else next(_CLOCK)
        self._key = torch.empty(0, dtype=torch.int32)
        self._value = torch.empty(0, dtype=torch.int32)
        self._length = 0

    def set_key_value(self, key: torch.Tensor, value: torch.Tensor) -> None:
        assert len(key) == len(value)
        self._key, self._value, self._length = key, value, len(key)

    def set_parent(self, parent: RadixTreeNode) -> None:
        self._parent = parent
        parent.children[self.key_fn(self._key)] = self

    @property
    def length(self) -> int:
        return self._length

    @property
    def parent(self) -> RadixTreeNode:
        assert self._parent is not None, "the root has no parent"
        return self._parent

    @property
    def value(self) -> torch.Tensor:
        return self._value

    @property
    def key(self) -> torch.Tensor:
        return self._key

    def is_root(self) -> bool:
        return self._parent is None

    def is_leaf(self) -> bool:
        return not self.children

    def get_match_len(self, input_ids: torch.Tensor) -> int:
        return fast_compare_key(self._key, input_ids)

    def split_at(self, pos: int) -> RadixTreeNode:
        """Cut this node after `pos` tokens: a new head node (with its reference count) becomes its parent."""
        assert 0 < pos < self._length
        head = RadixTreeNode(self.key_fn, tic=self.timestamp)
        head.set_key_value(self._key[:pos], self._value[:pos])
        head.ref_count = self.ref_count
        head.set_parent(self.parent)  # same first page, so it replaces this node in the parent's dict
        self.set_key_value(self._key[pos:], self._value[pos:])
        self.set_parent(head)
        return head

    def __lt__(self, other: RadixTreeNode) -> bool:
        return self.timestamp < other.timestamp

    def __repr__(self) -> str:
        return f"RadixTreeNode(uuid={self.uuid}, len={self._length}, ref={self.ref_count}, t={self.timestamp})"


@dataclass(frozen=True)
class RadixCacheHandle(BaseCacheHandle):
    node: RadixTreeNode

    def get_matched_indices(self) -> torch.Tensor:
        values = []
        node = self.node
        while not node.is_root():
            values.append(node.value)
            node = node.parent
        values.append(node.value)  # the root's empty tensor: keeps device and dtype right when nothing matched
        return torch.cat(values[::-1])


class RadixPrefixCache(BasePrefixCache):
    # page_size is passed in (upstream reads the global context): kvcache/ stays below core.py
    def __init__(self, device: torch.device, page_size: int = 1) -> None:
        self.device = device
        self.page_size = page_size
        if page_size == 1:
            self.key_fn: Callable[[torch.Tensor], Hashable] = lambda ids: int(ids[0])
        else:
            self.key_fn = lambda ids: tuple(ids[:page_size].tolist())
        self.root_node = RadixTreeNode(self.key_fn)
        self.root_node._value = torch.empty(0, dtype=torch.int32, device=device)
        self.root_node.ref_count = 1  # the root is never evicted nor unlocked
        self.evictable_size = 0
        self.protected_size = 0
        self.num_nodes = 0  # without the root
        # (timestamp when queued, uuid, node) of leaves that were evictable then
        self._leaf_heap: list[tuple[int, int, RadixTreeNode]] = []

    def _tree_walk(self, input_ids: torch.Tensor) -> tuple[RadixTreeNode, int]:
        """Deepest node matching a page-aligned prefix of input_ids, and its length; a node matched in part is split."""
        tic = next(_CLOCK)
        node, prefix_len, total = self.root_node, 0, len(input_ids)
        while total - prefix_len >= self.page_size:
            child = node.children.get(self.key_fn(input_ids[prefix_len:]))
            if child is None:
                break
            node = child
            # the first page matched (it is the child's dict key), so match_len >= page_size
            match_len = align_down(node.get_match_len(input_ids[prefix_len:]), self.page_size)
            prefix_len += match_len
            if match_len < node.length:
                node = node.split_at(match_len)
                self.num_nodes += 1
                node.timestamp = tic
                break
            node.timestamp = tic
        return node, prefix_len

    def match_prefix(self, input_ids: torch.Tensor) -> MatchResult:
        node, prefix_len = self._tree_walk(input_ids)
        return MatchResult(RadixCacheHandle(prefix_len, node))

    def insert_prefix(self, input_ids: torch.Tensor, indices: torch.Tensor) -> InsertResult:
        insert_len = align_down(len(input_ids), self.page_size)
        input_ids, indices = input_ids[:insert_len], indices[:insert_len]
        node, prefix_len = self._tree_walk(input_ids)
        if prefix_len < insert_len:
            leaf = RadixTreeNode(self.key_fn)
            # copies: the caller's tensors are views into its request's ids and the page table, which change later
            leaf.set_key_value(input_ids[prefix_len:].clone(), indices[prefix_len:].clone())
            leaf.set_parent(node)
            self.evictable_size += leaf.length
            self.num_nodes += 1
            self._queue_if_evictable(leaf)
            node = leaf
        return InsertResult(prefix_len, RadixCacheHandle(insert_len, node))

    def lock_handle(self, handle: BaseCacheHandle, unlock: bool = False) -> None:
        assert isinstance(handle, RadixCacheHandle)
        node = handle.node
        while not node.is_root():
            if unlock:
                node.ref_count -= 1
                assert node.ref_count >= 0, f"{node} unlocked more often than locked"
                if node.ref_count == 0:
                    self.evictable_size += node.length
                    self.protected_size -= node.length
                    self._queue_if_evictable(node)
            else:
                if node.ref_count == 0:
                    self.evictable_size -= node.length
                    self.protected_size += node.length
                node.ref_count += 1
            node = node.parent

    def evict(self, size: int) -> torch.Tensor:
        if size == 0:
            return self.root_node.value
        assert size <= self.evictable_size, f"cannot evict {size} tokens, only {self.evictable_size} are evictable"
        evicted: list[torch.Tensor] = []
        evicted_size = 0
        while evicted_size < size:
            queued_at, _, node = heapq.heappop(self._leaf_heap)
            if not self._is_evictable_leaf(node):
                continue  # locked, has a child now, or already evicted: a stale entry
            if queued_at != node.timestamp:
                self._queue(node)  # used since it was queued: back in line at its new place
                continue
            parent = node.parent
            del parent.children[self.key_fn(node.key)]
            node._parent = None
            evicted.append(node.value)
            evicted_size += node.length
            self.evictable_size -= node.length
            self.num_nodes -= 1
            self._queue_if_evictable(parent)  # the root's count is 1, so it never qualifies
        return torch.cat(evicted)

    def _is_evictable_leaf(self, node: RadixTreeNode) -> bool:
        return node._parent is not None and node.ref_count == 0 and node.is_leaf()

    def _queue_if_evictable(self, node: RadixTreeNode) -> None:
        if self._is_evictable_leaf(node):
            self._queue(node)

    def _queue(self, node: RadixTreeNode) -> None:
        if len(self._leaf_heap) > 2 * self.num_nodes + 64:  # mostly stale entries: start again from the tree
            self._leaf_heap = [(n.timestamp, n.uuid, n) for n in self._all_nodes() if self._is_evictable_leaf(n)]
            heapq.heapify(self._leaf_heap)  # `node` is among them
        else:
            heapq.heappush(self._leaf_heap, (node.timestamp, node.uuid, node))

    def reset(self) -> None:
        raise NotImplementedError("evict(size_info.evictable_size) returns the slots; reset would lose them")

    @property
    def size_info(self) -> SizeInfo:
        return SizeInfo(self.evictable_size, self.protected_size)

    @property
    def num_locked_nodes(self) -> int:
        return sum(node.ref_count > 0 for node in self._all_nodes())

    def _all_nodes(self) -> list[RadixTreeNode]:
        nodes, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def all_indices(self) -> torch.Tensor:
        """Every KV slot the tree owns (for pool accounting)."""
        return torch.cat([self.root_node.value] + [n.value for n in self._all_nodes()])

    def check_integrity(self) -> None:
        """Sizes add up, children sit under their first page, locks nest, no slot is owned twice (upstream: no-op)."""
        evictable = protected = 0
        for node in self._all_nodes():
            assert node.length > 0 and node.length % self.page_size == 0, node
            assert len(node.key) == len(node.value) == node.length, node
            assert node.parent.children.get(self.key_fn(node.key)) is node, node
            assert node.ref_count >= sum(c.ref_count for c in node.children.values()) >= 0, node
            if node.ref_count == 0:
                evictable += node.length
            else:
                protected += node.length
        assert (evictable, protected) == (self.evictable_size, self.protected_size), ((evictable, protected),
                                                                                     self.size_info)
        indices = self.all_indices()
        assert len(torch.unique(indices)) == len(indices), "a KV slot is owned by two tree nodes"
        nodes = self._all_nodes()
        assert self.num_nodes == len(nodes), (self.num_nodes, len(nodes))
        queued = {id(n) for _, _, n in self._leaf_heap}
        assert all(id(n) in queued for n in nodes if self._is_evictable_leaf(n)), "an evictable leaf is not queued"

"""Request/batch state and the global context the model reads during a forward. It names backend and cache types
only for type checking, so the other packages import it without a cycle (upstream's imports tie 16 files into one)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, List, Literal

import torch

if TYPE_CHECKING:
    from .attention.base import BaseAttnBackend, BaseAttnMetadata
    from .kvcache.base import BaseCacheHandle, BaseKVCachePool


# below this temperature is greedy (as vLLM, SGLang): dividing the logits by less overflows them (inf, then NaN)
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    temperature: float = 0.0  # below GREEDY_TEMPERATURE (0, say) means greedy
    top_k: int = -1  # < 1 means disabled
    top_p: float = 1.0
    ignore_eos: bool = False
    max_tokens: int = 1024
    # stage 3 (the API exposes them): a per-request sampling seed, and token ids that end the request like EOS
    seed: int | None = None
    stop_token_ids: List[int] = field(default_factory=list)
    skip_special_tokens: bool = True  # the text leaves <|im_end|>, ... out (vLLM, SGLang); the token ids keep them

    @property
    def is_greedy(self) -> bool:
        return (self.temperature < GREEDY_TEMPERATURE or self.top_k == 1) and self.top_p == 1.0


@dataclass(eq=False)  # identity hashing: requests live in sets and dicts
class Req:
    input_ids: torch.Tensor  # host, 1-D int32: prompt plus every token generated so far
    table_idx: int  # row of the page table (request slot)
    cached_len: int  # prefix whose KV is already in the pool
    output_len: int  # how many new tokens this request may produce
    uid: int
    sampling_params: SamplingParams
    cache_handle: BaseCacheHandle | None = None

    def __post_init__(self) -> None:
        assert self.input_ids.device.type == "cpu", "Req.input_ids must live on the host"
        self.device_len = len(self.input_ids)
        self.max_device_len = len(self.input_ids) + self.output_len
        assert 0 <= self.cached_len < self.device_len <= self.max_device_len

    @property
    def extend_len(self) -> int:
        """Query length of the next forward."""
        return self.device_len - self.cached_len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def can_decode(self) -> bool:
        return self.remain_len > 0

    def complete_one(self) -> None:
        """Right after a forward's launch: all up to device_len has KV; the token being sampled takes the next slot."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, next_token: torch.Tensor) -> None:
        self.input_ids = torch.cat([self.input_ids, next_token.view(1).to(self.input_ids.dtype)])

    def __repr__(self) -> str:
        return (f"Req(table_idx={self.table_idx}, cached_len={self.cached_len}, device_len={self.device_len}, "
                f"max_device_len={self.max_device_len})")


@dataclass
class Batch:
    reqs: List[Req]
    phase: Literal["prefill", "decode"]
    # filled by whoever prepares the batch (the scheduler upstream; engine/manual.py here)
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    out_loc: torch.Tensor = field(init=False)
    padded_reqs: List[Req] = field(init=False)  # set by the graph runner's pad_batch
    attn_metadata: BaseAttnMetadata = field(init=False)  # set by the attention backend

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def padded_size(self) -> int:
        return len(self.padded_reqs)


@dataclass
class Context:
    page_size: int
    page_table: torch.Tensor = field(init=False)
    attn_backend: BaseAttnBackend = field(init=False)
    kv_cache: BaseKVCachePool = field(init=False)
    moe_backend: object | None = field(default=None, init=False)  # MoE arrives in a later stage
    _batch: Batch | None = field(default=None, init=False)

    @property
    def batch(self) -> Batch:
        assert self._batch is not None, "no batch is being forwarded"
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        assert self._batch is None, "nested forward_batch"
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context) -> None:
    # upstream allows one per process; tests and the harness build several engines (each re-installs its own)
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def release_global_ctx(ctx: Context) -> None:
    """Forget the global context if it is ``ctx``: a shut-down engine's KV pool must not stay alive through it."""
    global _GLOBAL_CTX
    if _GLOBAL_CTX is ctx:
        _GLOBAL_CTX = None


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "global context not set: build an Engine first"
    return _GLOBAL_CTX

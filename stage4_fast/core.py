"""Request/batch state and the global context the model reads during a forward. It names backend and cache types
only for type checking, so the other packages import it without a cycle (upstream's imports tie 16 files into one)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, List, Literal, Tuple

import numpy as np
import torch

if TYPE_CHECKING:
    from .attention.base import BaseAttnBackend, BaseAttnMetadata
    from .attention.hybrid_linear import LinearAttnMetadata
    from .attention.utils import SeqLens
    from .kvcache.base import BaseCacheHandle, BaseKVCachePool
    from .moe import BaseMoeBackend


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
    # stage 4, the production API (sampling/): vLLM / SGLang semantics, neutral by default
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output already holds
    frequency_penalty: float = 0.0  # ... times how often it holds it
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    logit_bias: List[Tuple[int, float]] = field(default_factory=list)  # (token id, added to its logit)
    logprobs: int | None = None  # report the sampled token's logprob and the `logprobs` most likely ones
    echo: bool = False  # the first reply carries the prompt's ids, with `logprobs` also their logprobs
    # structured output (sampling/grammar.py), SGLang's four fields; at most one is set
    json_schema: str | None = None  # the output is JSON valid against this schema (JSON text)
    regex: str | None = None  # the output matches this regular expression
    ebnf: str | None = None  # the output is a sentence of this EBNF grammar (xgrammar's dialect; its rule `root`)
    structural_tag: str | None = None  # free text until a trigger, then a tagged structure (xgrammar's, JSON)
    json_any_whitespace: bool = False  # free whitespace between a JSON schema's tokens (vLLM's default)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before the output has this many tokens (vLLM's)

    def __post_init__(self) -> None:
        # the wire carries tuples as lists
        self.logit_bias = [(int(token_id), float(bias)) for token_id, bias in self.logit_bias]

    @property
    def is_greedy(self) -> bool:
        return (self.temperature < GREEDY_TEMPERATURE or self.top_k == 1) and self.top_p == 1.0

    @property
    def has_penalty(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_api_fields(self) -> bool:
        """Whether the request asks for a field ``Sampler._prepare_api_fields`` builds tensors for (kept in step)."""
        return bool(self.logit_bias) or self.logprobs is not None or self.has_penalty or self.min_tokens > 0

    @property
    def grammar(self) -> Tuple[str, str] | None:
        """The structured output asked for, as (kind, source); None: free text. More than one is a ValueError, as
        is json_any_whitespace without a json_schema."""
        kinds = (("json_schema", self.json_schema), ("regex", self.regex), ("ebnf", self.ebnf),
                 ("structural_tag", self.structural_tag))
        asked = [(kind, source) for kind, source in kinds if source is not None]
        if len(asked) > 1:
            raise ValueError(f"only one of json_schema, regex, ebnf and structural_tag can be set (got "
                             f"{asked[0][0]} and {asked[1][0]})")
        if self.json_any_whitespace and [kind for kind, _ in asked] != ["json_schema"]:
            raise ValueError("json_any_whitespace applies to a json_schema only")
        return asked[0] if asked else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None


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
        self.device_len = self.input_ids.shape[0]  # (not len(): Tensor.__len__ is slow Python)
        self.max_device_len = self.device_len + self.output_len
        # the sampler's fast path asks it of every request at every step; parameters never change once admitted
        params = self.sampling_params
        self.samples_plain_greedy = params.is_greedy and not params.uses_api_fields
        assert 0 <= self.cached_len < self.device_len <= self.max_device_len
        # once a token was appended, the ids live in _host_buf[:_host_len] followed by _pending (appended, not
        # stored yet); input_ids is the view of the buffer, built when read after the pending ids are stored
        self._host_buf: torch.Tensor | None = None
        self._host_np: np.ndarray | None = None  # the same memory as _host_buf
        self._host_view: torch.Tensor | None = None
        self._host_len = 0
        self._pending: List[int] = []

    def __getattr__(self, name: str) -> torch.Tensor:
        # Called only for an attribute missing from the instance: input_ids after append_host dropped it.
        if name == "input_ids" and self.__dict__.get("_host_buf") is not None:
            self._store_pending()
            view = self._host_buf[: self._host_len]
            self.__dict__["input_ids"] = self._host_view = view
            return view
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def prompt_len(self) -> int:
        """Tokens the request was created with: its prompt (a chunk's: the prompt up to the chunk's end)."""
        return self.max_device_len - self.output_len

    @property
    def extend_len(self) -> int:
        """Query length of the next forward."""
        return self.device_len - self.cached_len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def can_decode(self) -> bool:
        return self.device_len < self.max_device_len  # remain_len > 0, without a second property call

    def complete_one(self) -> None:
        """Right after a forward's launch: all up to device_len has KV; the token being sampled takes the next slot."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, next_token: torch.Tensor | int) -> None:
        """Append one token to input_ids: a list append, every step; the ids reach the host buffer (spare room,
        grown by doubling) when input_ids is next read (``__getattr__``). Earlier views of input_ids never change."""
        if "input_ids" in self.__dict__:  # read or assigned since the last append: appends continue after it
            self._adopt(self.__dict__.pop("input_ids"))
        self._pending.append(next_token if type(next_token) is int else int(next_token))

    def _adopt(self, ids: torch.Tensor) -> None:
        if ids is not self._host_view:  # the prompt (the first append), or ids assigned from outside
            self._new_host_buf(ids, 0)
            self._pending.clear()
        self._host_view = None

    def _store_pending(self) -> None:
        pending, n = self._pending, self._host_len
        if pending:
            if n + len(pending) > self._host_np.shape[0]:
                self._new_host_buf(self._host_buf[:n], len(pending))
            self._host_np[n : n + len(pending)] = pending
            self._host_len = n + len(pending)
            pending.clear()

    def _new_host_buf(self, ids: torch.Tensor, extra: int) -> None:
        """A buffer holding ``ids`` with room for at least ``extra`` more."""
        n = ids.shape[0]  # (not len(): Tensor.__len__ is slow Python)
        need = n + max(extra, 1)
        buf = torch.empty(max(min(max(2 * n, n + 64), self.max_device_len), need), dtype=ids.dtype)
        buf[:n] = ids
        self._host_buf, self._host_np, self._host_len = buf, buf.numpy(), n

    def __repr__(self) -> str:
        return (f"Req(table_idx={self.table_idx}, cached_len={self.cached_len}, device_len={self.device_len}, "
                f"max_device_len={self.max_device_len})")


@dataclass
class Batch:
    reqs: List[Req]
    phase: Literal["prefill", "decode"]
    # stage 4, mixed chunks: a prefill batch's last `decode_reqs` requests are running ones taking their decode
    # step in it (one query token each, their KV in the pool: to the forward, prefills with a cached prefix)
    decode_reqs: int = 0
    # filled by whoever prepares the batch (the scheduler upstream; engine/manual.py here)
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    out_loc: torch.Tensor = field(init=False)
    padded_reqs: List[Req] = field(init=False)  # set by the graph runner's pad_batch
    attn_metadata: BaseAttnMetadata = field(init=False)  # set by the attention backend
    host_lens: SeqLens | None = field(default=None, init=False)  # the padded requests' lens (batch_seq_lens)
    # hybrid models only: per-request state slots of the linear-attention layers (attention/hybrid_linear.py)
    state_metadata: LinearAttnMetadata | None = field(default=None, init=False)
    # prefill only, for prompt logprobs (echo): the LM head keeps the final hidden states of these token rows
    prompt_logprob_rows: torch.Tensor | None = field(default=None, init=False)
    prompt_hidden: torch.Tensor | None = field(default=None, init=False)
    # a graph-captured decode batch: the LM head writes its logits into the graph's buffer (no memcpy per replay)
    logits_out: torch.Tensor | None = field(default=None, init=False)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def num_prefill_reqs(self) -> int:
        """The requests this batch prefills: a prefill batch's but its mixed-in decode requests; none of a decode's."""
        return len(self.reqs) - self.decode_reqs if self.is_prefill else 0

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
    moe_backend: BaseMoeBackend | None = field(default=None, init=False)  # MoE models only
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

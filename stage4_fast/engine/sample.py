"""Batched sampling: every request has its own temperature / top-k / top-p, all handled in one call. Stage 4 adds
the API's fields (``sampling/``), free for a batch where no request uses them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Callable, List

import torch

from ..core import GREEDY_TEMPERATURE
from ..kernel import greedy_argmax
from ..sampling import (
    MAX_TOP_LOGPROBS,
    BatchLogprobs,
    GrammarBackend,
    LogitBiasArgs,
    LogprobArgs,
    PenaltyArgs,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    compute_logprobs,
)
from ..utils.device import to_device

if TYPE_CHECKING:
    from ..core import Batch, Req


MAX_TEMPERATURE = 1e30


@dataclass
class BatchSamplingArgs:
    temperatures: torch.Tensor | None  # [bs] float32; None: the whole batch is greedy; 0 marks a greedy request
    top_k: torch.Tensor | None = None  # [bs] int64 (vocab size = no limit); None: no request limits it
    top_p: torch.Tensor | None = None  # [bs] float32 in (0, 1]; None: no request limits it
    seeds: List[int | None] | None = None  # per request (host); None: no request has a seed
    # stage 4, the production API; None: no request of the batch uses the field
    min_p: torch.Tensor | None = None  # [bs] float32 in [0, 1]
    logit_bias: LogitBiasArgs | None = None
    penalties: PenaltyArgs | None = None
    grammar_uids: List[int | None] | None = None  # per row, the uid whose grammar masks it (None: no mask)
    grammar_bitmask: torch.Tensor | None = None  # [bs, ceil(V / 32)] int32 on the device, by fill_grammar_mask
    grammar_rows: torch.Tensor | None = None  # [bs] bool on the device: the rows a grammar masks
    logprobs: LogprobArgs | None = None
    token_pool: torch.Tensor | None = None  # read by the penalties and the prompt logprobs

    @property
    def processes_logits(self) -> bool:
        return self.logit_bias is not None or self.penalties is not None or self.grammar_bitmask is not None


def make_device_tensor(data: List, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(data, dtype=dtype), device)


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Zero everything outside each row's top-k, then outside its top-p nucleus (of the top-k), and renormalise."""
    if top_k is None and top_p is None:
        return probs
    sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    if top_k is not None:
        sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
    if top_p is not None:
        mass_before = (sorted_probs.cumsum(-1) - sorted_probs) / sorted_probs.sum(-1, keepdim=True)
        # keep a token while the mass of the more likely ones is still short of top_p (the top token always stays)
        sorted_probs = sorted_probs.masked_fill((mass_before >= top_p[:, None]) & (rank > 0), 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    return filtered / filtered.sum(-1, keepdim=True)


def sample_impl(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor | None,
                top_p: torch.Tensor | None, generator: torch.Generator | None = None,
                seeds: List[int | None] | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    greedy = temperatures < GREEDY_TEMPERATURE
    # Upstream gives greedy requests temperature 1e-6, which is greedy only up to near-ties; we take the argmax.
    temps = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    # beyond float32's range a temperature is inf, and a masked logit over it NaN; at 1e30 finite logits give 0 anyway
    temps = temps.clamp(max=MAX_TEMPERATURE)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    if min_p is not None:  # before top-k / top-p, as vLLM
        probs = apply_min_p(probs, min_p)
    probs = filter_probs(probs, top_k, top_p)
    uniforms = torch.rand(probs.shape[0], generator=generator, device=probs.device, dtype=torch.float64)
    seeded = [(i, seeded_uniform(seed)) for i, seed in enumerate(seeds or ()) if seed is not None]
    if seeded:  # a seeded request's draw depends only on its seed and position, not on its batch
        rows, values = zip(*seeded)
        uniforms[list(rows)] = make_device_tensor(list(values), torch.float64, probs.device)
    return torch.where(greedy, logits.argmax(dim=-1), draw_by_inverse_cdf(probs, uniforms))


def seeded_uniform(seed: int) -> float:
    """A uniform in [0, 1) from a 64-bit seed (splitmix64's finaliser, top 53 bits): the same on every device."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def draw_by_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [bs, V] (rows need not sum to 1): the first whose cumulative mass exceeds
    ``uniforms`` [bs] times the row's total. float64: an fp32 sum over 152k entries shifts the smallest boundaries."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return drawn.clamp_(max=probs.shape[-1] - 1)  # only a NaN row (no valid distribution) lands past the end


_SAMPLES_PLAIN_GREEDY = attrgetter("samples_plain_greedy")


class Sampler:
    def __init__(self, device: torch.device, vocab_size: int, seed: int = 42) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.grammar: GrammarBackend | None = None  # plugged in by the scheduler (it owns the tokenizer)
        self.eos_token_id = -1  # set by the scheduler (min_tokens holds EOS back); -1: none

    def prepare(self, batch: Batch, token_pool: torch.Tensor | None = None) -> BatchSamplingArgs:
        """The batch's sampling tensors. ``token_pool``: read by penalties and prompt logprobs only."""
        grammar_on = self.grammar is not None and self.grammar.active
        if not grammar_on and all(map(_SAMPLES_PLAIN_GREEDY, batch.reqs)):
            return BatchSamplingArgs(temperatures=None)  # the common case, in one pass over the batch
        params = [req.sampling_params for req in batch.reqs]
        greedy = all(p.is_greedy for p in params)
        args = BatchSamplingArgs(temperatures=None) if greedy else self._prepare_random(batch, params)
        self._prepare_api_fields(batch, args, token_pool)
        return args

    def _prepare_random(self, batch: Batch, params: List) -> BatchSamplingArgs:
        temperatures = [0.0 if p.is_greedy else p.temperature for p in params]
        args = BatchSamplingArgs(make_device_tensor(temperatures, torch.float32, self.device))
        if any(p.top_k >= 1 for p in params):
            top_k = [p.top_k if p.top_k >= 1 else self.vocab_size for p in params]
            args.top_k = make_device_tensor(top_k, torch.int64, self.device)
        if any(p.top_p < 1.0 for p in params):
            top_p = [min(max(p.top_p, 1e-6), 1.0) for p in params]
            args.top_p = make_device_tensor(top_p, torch.float32, self.device)
        if any(p.min_p > 0.0 for p in params):
            args.min_p = make_device_tensor([p.min_p for p in params], torch.float32, self.device)
        if any(p.seed is not None for p in params):
            # mixed with the position of the token being sampled, so each step of a request draws differently
            args.seeds = [None if p.seed is None else (p.seed * 1_000_003 + req.device_len) % 2**63
                          for p, req in zip(params, batch.reqs)]
        return args

    def _prepare_api_fields(self, batch: Batch, args: BatchSamplingArgs, token_pool: torch.Tensor | None) -> None:
        grammar = self.grammar
        grammar_on = grammar is not None and grammar.active
        if not grammar_on and not any(req.sampling_params.uses_api_fields for req in batch.reqs):
            return  # a plain batch (the common case): none of the passes below would find anything
        # a prompt's chunk (can_decode False) samples a token nobody reads: no bias, penalty, mask or logprob
        sampled = [(i, req) for i, req in enumerate(batch.reqs) if req.can_decode]
        bias = [(i, tid, b) for i, req in sampled for tid, b in req.sampling_params.logit_bias]
        bias += [(i, tid, -math.inf) for i, req in sampled if req.sampling_params.min_tokens
                 for tid in self._stops_held_back(req)]
        if bias:
            rows, ids, values = zip(*bias)
            args.logit_bias = LogitBiasArgs(make_device_tensor(list(rows), torch.int64, self.device),
                                            make_device_tensor(list(ids), torch.int64, self.device),
                                            make_device_tensor(list(values), torch.float32, self.device))
        penalised = [(i, req) for i, req in sampled if req.sampling_params.has_penalty]
        args.penalties = self._penalty_args(penalised) if penalised else None
        if grammar_on and any(grammar.has(req.uid) for _, req in sampled):
            # the mask itself waits for fill_grammar_mask: it needs the matchers to have seen the previous token
            args.grammar_uids = [req.uid if req.can_decode else None for req in batch.reqs]
        args.logprobs = self._logprob_args(batch)
        if args.penalties is not None or (args.logprobs is not None and args.logprobs.prompt_rows is not None):
            assert token_pool is not None, "penalties and prompt logprobs read the token pool"
            args.token_pool = token_pool

    def _stops_held_back(self, req: Req) -> List[int]:
        """The stop tokens min_tokens holds back this step: EOS unless ignored, and stop_token_ids in the vocabulary.
        The step samples output token ``device_len - prompt_len + 1``."""
        params = req.sampling_params
        if req.device_len - req.prompt_len >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos or self.eos_token_id < 0 else [self.eos_token_id]
        return eos + [t for t in params.stop_token_ids if 0 <= t < self.vocab_size]

    def _penalty_args(self, penalised: List[tuple[int, Req]]) -> PenaltyArgs:
        # each row reads its output so far, and its prompt too when a repetition penalty is set
        starts = [0 if req.sampling_params.repetition_penalty != 1.0 else req.prompt_len for _, req in penalised]
        lengths = [req.device_len - start for (_, req), start in zip(penalised, starts)]
        params = [req.sampling_params for _, req in penalised]
        ints = make_device_tensor([[i for i, _ in penalised], [req.table_idx for _, req in penalised], starts, lengths,
                                   [req.prompt_len for _, req in penalised]], torch.int64, self.device)
        floats = make_device_tensor([[p.presence_penalty for p in params], [p.frequency_penalty for p in params],
                                     [p.repetition_penalty for p in params]], torch.float32, self.device)
        return PenaltyArgs(rows=ints[0], presence=floats[0], frequency=floats[1], repetition=floats[2],
                           pool_rows=ints[1], starts=ints[2], lengths=ints[3], prompt_lens=ints[4],
                           max_length=max(1, max(lengths)))

    def _logprob_args(self, batch: Batch) -> LogprobArgs | None:
        wanted = [(i, req) for i, req in enumerate(batch.reqs) if req.sampling_params.logprobs is not None]
        if not wanted:
            return None
        top_k = min(max(req.sampling_params.logprobs for _, req in wanted), MAX_TOP_LOGPROBS, self.vocab_size)
        rows = [i for i, req in wanted if req.can_decode]
        args = LogprobArgs(make_device_tensor(rows, torch.int64, self.device), rows, top_k)
        if batch.is_prefill:
            self._add_prompt_rows(batch, args)
        return args

    def _add_prompt_rows(self, batch: Batch, args: LogprobArgs) -> None:
        """Echo: each prompt token after the first gets the logprob its previous row predicts (last row: output's)."""
        flat_rows, positions, pool_rows, segments, offset, start = [], [], [], [], 0, 0
        for i, req in enumerate(batch.reqs):  # (a prefill is never padded)
            if req.sampling_params.wants_prompt_logprobs:
                count = req.extend_len if not req.can_decode else req.extend_len - 1
                if count > 0:
                    flat_rows.append(torch.arange(offset, offset + count))
                    positions.append(torch.arange(req.cached_len + 1, req.cached_len + 1 + count))
                    pool_rows += [req.table_idx] * count
                    segments.append((i, start, count))
                    start += count
            offset += req.extend_len
        if segments:
            args.prompt_rows = to_device(torch.cat(flat_rows), self.device)
            args.prompt_targets = (make_device_tensor(pool_rows, torch.int64, self.device),
                                   to_device(torch.cat(positions), self.device))
            args.prompt_segments = segments

    def fill_grammar_mask(self, args: BatchSamplingArgs) -> None:
        """The grammar rows' masks from their matchers, just before sampling (after the previous step's catch-up)."""
        grammar = self.grammar
        if args.grammar_uids is not None and grammar is not None:
            args.grammar_bitmask = grammar.device_bitmask(args.grammar_uids, self.device)
            rows = [uid is not None and grammar.has(uid) for uid in args.grammar_uids]
            args.grammar_rows = make_device_tensor(rows, torch.bool, self.device)

    def sample(self, logits: torch.Tensor, args: BatchSamplingArgs,
               greedy_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The batch's next tokens. ``greedy_tokens``: the graph's argmax, used (copied: the next replay overwrites
        it) for an all-greedy batch whose logits nothing changes."""
        if args.temperatures is None and not args.processes_logits and greedy_tokens is not None:
            return greedy_tokens.clone()
        if args.processes_logits:
            logits = logits.to(torch.float32, copy=True)  # the raw logits stay as they are, for the logprobs
            if args.logit_bias is not None:
                apply_logit_bias(logits, args.logit_bias)
            if args.penalties is not None:
                apply_penalties(logits, args.token_pool, args.penalties)
            if args.grammar_bitmask is not None:
                self.grammar.apply(logits, args.grammar_bitmask, args.grammar_rows)
        if args.temperatures is None:  # an all-greedy batch
            return greedy_argmax(logits)
        return sample_impl(logits, args.temperatures, args.top_k, args.top_p, self.generator, args.seeds, args.min_p)

    def logprobs(self, logits: torch.Tensor, next_tokens: torch.Tensor, args: BatchSamplingArgs, batch: Batch,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> BatchLogprobs | None:
        """Logprobs of the raw logits for the requests that asked (None if none did)."""
        if args.logprobs is None:
            return None
        return compute_logprobs(logits, next_tokens, args.logprobs, args.token_pool, batch.prompt_hidden,
                                compute_logits)

"""The per-rank control loop: admit requests, form a batch (prefill or decode), run it, hand out tokens, free.

Overlap scheduling (`overlap_loop`, the default; else `normal_loop`) launches batch N+1 before processing batch N's
results, N's tokens reaching N+1 through `token_pool`. Being one step behind causes upstream's races
(stage2_scheduled/README.md, defects 1-4), fixed here: results are judged by state snapshotted at launch (1) and
dropped for a finished or aborted request (2, 4), whose slot and pages are released once every batch launched so far
has completed (3, 4)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import replace
from typing import Any, Deque, Dict, List, NamedTuple, NoReturn, Sequence, Set, Tuple

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ..attention.utils import batch_seq_lens
from ..core import Batch, Req
from ..engine import Engine
from ..engine.engine import ForwardOutput
from ..engine.sample import BatchSamplingArgs
from ..env import ENV
from ..message import (
    AbortBackendMsg,
    BaseBackendMsg,
    BaseTokenizerMsg,
    BatchBackendMsg,
    DetokenizeMsg,
    ExitMsg,
    StatsBackendMsg,
    StatsMsg,
    TokenColumnsMsg,
    UserMsg,
)
from ..sampling import GrammarBackend
from ..utils.device import create_stream, is_cuda, stream_context, synchronize
from ..utils.hf import load_tokenizer, resolve_model_path
from .api_fields import ApiFieldsMixin
from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .io import SchedulerIOMixin
from .prefill import ChunkedReq, PrefillManager, estimated_kv_tokens
from .step_log import StepLog
from .stream_interval import StreamInterval
from .table import TableManager
from .utils import make_index_tuples, scatter_runs

logger = logging.getLogger(__name__)

WARM_UP_PREFILL_REQS = 16  # as in a full step of short prompts: launches a one-request step lacks (warm_up_prefill)


class ForwardInput(NamedTuple):
    batch: Batch
    sample_args: BatchSamplingArgs
    input_tuple: Tuple[torch.Tensor, torch.Tensor]  # (row, position) of every input token in token_pool
    write_tuple: Tuple[torch.Tensor, torch.Tensor]  # (row, position) where each request's sampled token goes


class ForwardData(NamedTuple):
    """A launched batch (upstream: a (ForwardInput, ForwardOutput) pair)."""

    fwd_input: ForwardInput
    fwd_output: ForwardOutput
    length_finished: Sequence[bool]  # upstream bug 1's fix: is each request's token of THIS batch its last, at launch
    batch_id: int  # launch order, to know when a released request's last batch has completed


class Scheduler(SchedulerIOMixin, ApiFieldsMixin):
    def __init__(self, config: SchedulerConfig) -> None:
        if config.max_extend_tokens < 1:
            raise ValueError("max_extend_tokens must be at least 1")
        self.config = config
        self.engine = Engine(config)
        self.device = self.engine.device
        self.engine.capture_prefill_graph(config.max_extend_tokens)
        warm_up = is_cuda(self.device)
        if warm_up:  # the first long prompt, the first step of many requests, a new token count: no first calls
            self.engine.warm_up_prefill(config.max_extend_tokens, WARM_UP_PREFILL_REQS)
            self.engine.warm_up_gemms(config.max_extend_tokens)
        self.stream = create_stream(self.device)  # scheduling work's own stream on a GPU, as upstream
        page_size = config.page_size
        self.table_manager = TableManager(config.max_running_req, self.engine.page_table)
        if warm_up:  # a prefill batch's scatter into the token pool loads its kernel: once here, zeros into zeros
            padding_row = self.engine.dummy_req.table_idx
            scatter_runs(self.table_manager.token_pool, [(padding_row, 0, torch.zeros(2, dtype=torch.int32))])
        # a linear layer's state cannot be rebuilt from a prefix's KV: hybrid models share no prefix (hybrid_linear.py)
        cache_type = "naive" if self.engine.config.model_config.linear_attn is not None else config.cache_type
        self.cache_manager = CacheManager(self.engine.num_pages, page_size, self.engine.page_table, cache_type)
        self.decode_manager = DecodeManager(page_size)
        self.prefill_manager = PrefillManager(self.cache_manager, self.table_manager, self.decode_manager)
        self.tokenizer = _try_load_tokenizer(config.model_path)
        self.eos_token_id = _eos_token_id(self.tokenizer, self.engine.config.hf_config)
        self.engine.sampler.eos_token_id = self.eos_token_id  # min_tokens holds it back
        self.grammar = GrammarBackend(self.tokenizer, self.engine.config.model_config.vocab_size)  # a matcher each
        self.engine.sampler.grammar = self.grammar
        if not config.offline_mode:  # a server: xgrammar's start-up cost off the first structured request's path
            self.grammar.warm_up_in_background()
        self._prompt_logprobs = {}  # echo with logprobs (ApiFieldsMixin)
        self.num_prefill_tokens = 0  # prompt tokens computed (not served by the prefix cache), for /v1/stats
        self.token_pool = self.table_manager.token_pool
        self.prefill_budget = config.max_extend_tokens
        self.overlap_scheduling = config.overlap_scheduling and not ENV.DISABLE_OVERLAP_SCHEDULING.value
        self.finished_reqs: Set[Req] = set()  # finished or aborted, resources not released yet: results are stale
        self._release_queue: Deque[Tuple[int, Req]] = deque()  # (release once this batch id completed, req)
        self._launched_id = 0  # newest launched batch
        self._done_id = 0  # newest batch whose results were processed (batches complete in launch order)
        self._last_was_lone_chunk = False
        self._cached_prompt: Dict[int, int] = {}  # uid -> prompt tokens the prefix cache served (usage), till 1st token
        self.num_aborted = 0  # requests aborted so far (clients that went away, stop strings), for /v1/stats
        self.stream_out = StreamInterval(config.stream_interval)  # which of a step's tokens leave now
        self.step_log = StepLog(ENV.STEP_LOG.value if config.tp_info.rank == 0 else "")  # a line per loop; "": off
        if self.step_log.path and not self.overlap_scheduling:
            logger.warning("MINISGL_STEP_LOG logs the overlap loop only; with overlap scheduling off it stays empty")
        super().__init__(config, self.engine.tp_cpu_group)

    def _process_one_msg(self, msg: BaseBackendMsg) -> None:
        if isinstance(msg, BatchBackendMsg):
            for m in msg.data:
                self._process_one_msg(m)
        elif isinstance(msg, ExitMsg):
            raise KeyboardInterrupt
        elif isinstance(msg, UserMsg):
            self._add_user_req(msg)
        elif isinstance(msg, AbortBackendMsg):
            self._abort_req(msg.uid)
        elif isinstance(msg, StatsBackendMsg):
            self.send_result([StatsMsg(msg.uid, self.stats())])
        else:
            raise TypeError(f"unknown message {msg!r}")

    def _add_user_req(self, msg: UserMsg) -> None:
        # Upstream bug 6: an over-long prompt is dropped silently; here every unservable request gets an error reply
        input_len, max_seq_len = len(msg.input_ids), self.engine.max_seq_len
        max_tokens = msg.sampling_params.max_tokens
        error = None
        vocab_size = self.engine.config.model_config.vocab_size
        if input_len == 0:
            error = "empty prompt"
        elif not 0 <= int(msg.input_ids.min()) <= int(msg.input_ids.max()) < vocab_size:
            # an id outside the embedding would crash the forward, and with it every request in the batch
            error = f"token ids must be in [0, {vocab_size})"
        elif input_len >= max_seq_len:
            error = f"prompt of {input_len} tokens leaves no room in the context of {max_seq_len} tokens"
        elif max_tokens < 1:
            error = f"max_tokens must be at least 1, got {max_tokens}"
        else:
            error = self._check_api_fields(msg)
        if error is None and max_tokens > max_seq_len - input_len:
            # clamp as upstream, on a copy: the caller may share one SamplingParams between requests
            msg.sampling_params = replace(msg.sampling_params, max_tokens=max_seq_len - input_len)
        if error is None:
            ps = self.cache_manager.page_size
            need = estimated_kv_tokens(input_len, msg.sampling_params.max_tokens, 0, ps)
            if need > self.cache_manager.num_pages * ps:  # would wait at the head of the queue forever
                error = f"request needs {need} KV slots, the pool has {self.cache_manager.num_pages * ps}"
        if error is None:
            try:
                grammar = msg.sampling_params.grammar
                if grammar is not None:
                    self.grammar.add(msg.uid, *grammar, msg.sampling_params.json_any_whitespace)
            except ValueError as e:  # GrammarError (it cannot compile), or more than one grammar asked
                error = str(e)
        if error is not None:
            logger.warning("rejecting request %d: %s", msg.uid, error)
            self.send_result([DetokenizeMsg(msg.uid, -1, True, error, "error", prompt_tokens=input_len)])
            return
        self.prefill_manager.add_one_req(msg)

    def _abort_req(self, uid: int) -> None:
        # Fix of upstream bug 4 (freed here while the batch in flight may hold it): _finish_req defers the release
        if self.prefill_manager.has_req(uid):
            req = self.prefill_manager.abort_req(uid)  # its chunk in progress, if one was admitted
        elif (req := self.decode_manager.abort_req(uid)) is None:
            return  # unknown, or finished already
        if req is not None:
            self._finish_req(req)
        self.num_aborted += 1
        self._cached_prompt.pop(uid, None)
        self._forget_api_state(uid)
        self.send_result(self.stream_out.release({uid}) + [DetokenizeMsg(uid, -1, True, "aborted", "abort")])

    def _finish_req(self, req: Req) -> None:
        """Take a finished or aborted request out of scheduling; release its slot and pages later."""
        self.decode_manager.remove_req(req)
        self.prefill_manager.prefix_cached(req.uid)  # nobody waits for its prefix any more
        self._forget_api_state(req.uid)
        self.finished_reqs.add(req)
        # Fix of upstream bug 3: the batch launched last may still write its slot and pages: release after it
        self._release_queue.append((self._launched_id, req))
        self._release_done()

    def _forget_api_state(self, uid: int) -> None:
        self.grammar.remove(uid)
        self._prompt_logprobs.pop(uid, None)

    def _release_done(self) -> None:
        while self._release_queue and self._release_queue[0][0] <= self._done_id:
            _, req = self._release_queue.popleft()
            self._free_req_resources(req)
            self.finished_reqs.discard(req)

    def _free_req_resources(self, req: Req) -> None:
        self.table_manager.free(req.table_idx)
        self.cache_manager.cache_req(req, finished=True)

    def _is_stale(self, req: Req) -> bool:
        """Fix of upstream bugs 2 and 4: a result that arrives after its request finished or was aborted."""
        return req in self.finished_reqs

    def _schedule_next_batch(self) -> ForwardInput | None:
        batch = None
        decoding = self.decode_manager.runnable
        budget = self.prefill_budget - len(self.decode_manager.running_reqs)
        if self.config.enable_mixed_chunk and decoding and budget > 0:
            # the running requests ride along, their one token each out of the prefill budget
            if (batch := self.prefill_manager.schedule_next_batch(budget)) is not None:
                self.decode_manager.join(batch)
        # Prefill first, as upstream, except after a long prompt's lone chunk while requests decode
        elif not (self._last_was_lone_chunk and decoding and self.config.decode_between_chunks):
            batch = self.prefill_manager.schedule_next_batch(self.prefill_budget)
        if batch is None:
            batch = self.decode_manager.schedule_next_batch()
        # (mixed-in decode requests come after the batch's prefill requests and do not count)
        self._last_was_lone_chunk = (batch is not None and batch.is_prefill and batch.num_prefill_reqs == 1
                                     and isinstance(batch.reqs[0], ChunkedReq))
        if batch is not None and batch.is_prefill:
            for req in batch.reqs[: batch.num_prefill_reqs]:  # a first chunk starts where its cache match ended
                self._cached_prompt.setdefault(req.uid, req.cached_len)
                self.num_prefill_tokens += req.extend_len
        return None if batch is None else self._prepare_batch(batch)

    def _prepare_batch(self, batch: Batch) -> ForwardInput:
        self.engine.pad_batch(batch)
        lens = batch_seq_lens(batch)  # one pass over the requests for everything below and the attention backend
        input_tuple, write_tuple = make_index_tuples(batch, lens, self.device)
        batch.positions = input_tuple[1].to(torch.int32)
        # a decode step's new slots go where its input tokens sit: (row, position) of the first batch.size inputs
        n = batch.size
        self.cache_manager.allocate_paged(
            batch.reqs, one_each_at=(input_tuple[0][:n], input_tuple[1][:n]) if batch.is_decode else None)
        batch.out_loc = self.engine.page_table[input_tuple]
        self.engine.attn_backend.prepare_metadata(batch)
        return ForwardInput(batch, self.engine.sampler.prepare(batch, self.token_pool), input_tuple, write_tuple)

    def _forward(self, fwd_input: ForwardInput, catch_up: ForwardData | None = None) -> ForwardData:
        """Launch the batch; ``catch_up`` (the previous batch) is processed after launch, before sampling (grammars)."""
        batch, sample_args, input_tuple, write_tuple = fwd_input
        batch.input_ids = self.token_pool[input_tuple]
        length_finished: Sequence[bool] = ()

        def before_sampling() -> None:
            # launched: in flight before the previous batch's results release any slot or page
            nonlocal length_finished
            length_finished = self._length_finished(batch)
            self.decode_manager.filter_reqs(batch.reqs, length_finished if batch.is_decode else None)
            self._launched_id += 1
            if catch_up is not None:
                with stream_context(self.stream):
                    self._process_last_data(catch_up)

        fwd_output = self.engine.forward_batch(batch, sample_args, before_sampling)  # advances every request
        self.token_pool[write_tuple] = fwd_output.next_tokens_gpu
        return ForwardData(fwd_input, fwd_output, length_finished, self._launched_id)

    @staticmethod
    def _length_finished(batch: Batch) -> Sequence[bool]:
        # right after complete_one: can_decode is False exactly when this batch's token is the last one allowed
        return [not req.can_decode for req in batch.reqs]

    def _process_last_data(self, last_data: ForwardData | None) -> None:
        if last_data is None:
            return
        fwd_input, fwd_output, length_finished, batch_id = last_data
        self.step_log.wait_for(fwd_output.copy_done_event)
        batch = fwd_input.batch
        tokens = fwd_output.next_tokens_cpu.tolist()
        token_logprobs = self._token_logprobs(batch, tokens, fwd_input.sample_args.logprobs, fwd_output.logprobs)
        reply: List[BaseTokenizerMsg] = []
        columns = TokenColumnsMsg([], [], [])  # plain tokens, not a message each (unless a stream interval)
        plain_uid, plain_token = columns.uids.append, columns.tokens.append
        plain_skip = columns.skip_special_tokens.append
        use_columns = self.stream_out.interval == 1
        # this loop runs for every running request at every step: what it reads is looked up once
        num_prefill, eos, grammar = batch.num_prefill_reqs, self.eos_token_id, self.grammar
        has_grammar = grammar.active
        with self.cache_manager.lazy_free_region():
            for i, (req, token) in enumerate(zip(batch.reqs, tokens)):
                if isinstance(req, ChunkedReq) or self._is_stale(req):
                    continue
                params = req.sampling_params
                is_prefill = i < num_prefill
                first = None
                if is_prefill:  # the request's first token: report what its prompt cost (before the append)
                    first = (len(req.input_ids), self._cached_prompt.pop(req.uid, 0),
                             self._echoed_prompt(req) if params.echo else None)
                req.append_host(token)
                stopped = (token == eos and not params.ignore_eos) or token in params.stop_token_ids
                if has_grammar and grammar.has(req.uid):
                    stopped |= grammar.accept(req.uid, token)
                finished = stopped or length_finished[i]
                row_logprobs = token_logprobs.get(i) if token_logprobs else None
                if use_columns and not finished and first is None and row_logprobs is None:
                    plain_uid(req.uid)
                    plain_token(token)
                    plain_skip(params.skip_special_tokens)
                else:
                    msg = DetokenizeMsg(req.uid, token, finished, skip_special_tokens=params.skip_special_tokens,
                                        logprobs=row_logprobs)
                    if first is not None:
                        msg.prompt_tokens, msg.cached_tokens, msg.prompt_logprobs = first
                    if finished:
                        msg.finish_reason = "stop" if stopped else "length"
                    reply.append(msg)
                if finished:
                    self._finish_req(req)
                elif is_prefill:
                    self.cache_manager.cache_req(req, finished=False)  # the prompt becomes shareable
                    self.prefill_manager.prefix_cached(req.uid)
            self._done_id = batch_id
            self._release_done()
        if columns.uids:
            reply.append(columns)
        if out := self.stream_out.step(reply):
            self.send_result(out)

    def _reject_stuck_head(self) -> None:
        """Nothing in flight and no prefill forms: reject the head request, not spin (upstream bug 6; unreachable)."""
        pending = self.prefill_manager.pending_list[0]
        self.prefill_manager.abort_req(pending.uid)
        logger.error("request %d can never be scheduled; rejecting it", pending.uid)
        self._cached_prompt.pop(pending.uid, None)
        self._forget_api_state(pending.uid)
        self.send_result([DetokenizeMsg(pending.uid, -1, True, "request can never be scheduled", "error")])

    def overlap_loop(self, last_data: ForwardData | None) -> ForwardData | None:
        """One step: launch batch N+1, then process batch N (`last_data`). Returns N+1."""
        blocking = not (last_data is not None or self.prefill_manager.runnable or self.decode_manager.runnable)
        if blocking:
            self.step_log.flush()  # idle: the file work waits for no step
        (log := self.step_log).begin()
        msgs = self.receive_msg(blocking=blocking)
        for msg in msgs:
            self._process_one_msg(msg)
        log.mark()
        fwd_input = self._schedule_next_batch()
        log.mark()
        ongoing_data = None
        if fwd_input is not None:
            # a grammar's mask for batch N+1 needs batch N's tokens: N is processed while N+1's forward runs
            catch_up = last_data if fwd_input.sample_args.grammar_uids is not None else None
            with stream_context(self.engine.stream):
                self.engine.stream.wait_stream(self.stream)  # the batch's inputs were written on our stream
                ongoing_data = self._forward(fwd_input, catch_up)
            if catch_up is not None:
                last_data = None
        elif last_data is None and self.prefill_manager.runnable:
            self._reject_stuck_head()
        log.mark()
        self._process_last_data(last_data)
        batch = None if fwd_input is None else fwd_input.batch
        log.end(None if batch is None else "prefill" if batch.is_prefill else "decode",
                0 if batch is None else batch.size, 0 if fwd_input is None else fwd_input.input_tuple[0].numel(),
                len(msgs), len(self.prefill_manager.pending_list), len(self.decode_manager.running_reqs))
        return ongoing_data

    def normal_loop(self) -> None:
        blocking = not (self.prefill_manager.runnable or self.decode_manager.runnable)
        for msg in self.receive_msg(blocking=blocking):
            self._process_one_msg(msg)
        fwd_input = self._schedule_next_batch()
        if fwd_input is not None:
            self._process_last_data(self._forward(fwd_input))
        elif self.prefill_manager.runnable:
            self._reject_stuck_head()

    def run_forever(self) -> NoReturn:
        with torch.inference_mode():
            if self.overlap_scheduling:
                data = None
                with stream_context(self.stream):
                    while True:
                        data = self.overlap_loop(data)
            else:
                with stream_context(self.engine.stream):  # one stream: no cross-stream ordering needed
                    while True:
                        self.normal_loop()

    def backend_info(self) -> Dict[str, int]:
        """What the API server needs to check requests before sending them (the scheduler's start-up ack)."""
        return {"max_seq_len": self.engine.max_seq_len, "num_pages": self.engine.num_pages,
                "page_size": self.config.page_size, "vocab_size": self.engine.config.model_config.vocab_size}

    def stats(self) -> Dict[str, Any]:
        """GET /v1/stats. At rest: free_pages + evictable_pages == num_pages, nothing locked, running or pending."""
        cm, ps = self.cache_manager, self.cache_manager.page_size
        size = cm.prefix_cache.size_info
        return {
            "num_pages": cm.num_pages, "page_size": ps, "free_pages": len(cm.free_slots),
            "evictable_pages": size.evictable_size // ps,  # cached prefixes nobody uses: reclaimable
            "protected_tokens": size.protected_size,  # cached prefixes locked by running requests
            "locked_nodes": cm.prefix_cache.num_locked_nodes, "cache_type": self.config.cache_type,
            "running_reqs": len(self.decode_manager.running_reqs),
            "pending_reqs": len(self.prefill_manager.pending_list),
            "releasing_reqs": len(self._release_queue),  # finished, resources freed once their batch completed
            "aborted_reqs": self.num_aborted,
            "prefill_tokens": self.num_prefill_tokens,  # prompt tokens computed so far (not served by the cache)
            "free_req_slots": self.table_manager.available_size, "max_running_req": self.config.max_running_req,
            "max_seq_len": self.engine.max_seq_len,
        }

    def run_when_idle(self) -> None:
        """Nothing is running or in flight: all pages must be free or cached."""
        self.cache_manager.check_integrity(deep=ENV.CHECK_CACHE_DEEP.value)

    def shutdown(self) -> None:
        self.step_log.flush()
        synchronize(self.device)
        self.sync_all_ranks()
        self.stop_io()
        self.engine.shutdown()


def _try_load_tokenizer(model_path: str) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer, or None for a checkpoint without one (the scheduler itself needs only EOS)."""
    try:
        return load_tokenizer(resolve_model_path(model_path))
    except (OSError, ValueError):
        return None


def _eos_token_id(tokenizer: PreTrainedTokenizerBase | None, hf_config: PretrainedConfig) -> int:
    # the model's config first: transformers makes up an EOS for a directory without a tokenizer
    eos = getattr(hf_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, (list, tuple)) else eos
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return -1 if eos is None else int(eos)  # -1: no EOS, requests end by length only



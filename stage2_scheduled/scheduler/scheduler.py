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
from typing import Deque, List, NamedTuple, NoReturn, Sequence, Set, Tuple

import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ..core import Batch, Req
from ..engine import Engine
from ..engine.engine import ForwardOutput
from ..engine.sample import BatchSamplingArgs
from ..env import ENV
from ..message import AbortBackendMsg, BaseBackendMsg, BatchBackendMsg, DetokenizeMsg, ExitMsg, UserMsg
from ..utils.device import create_stream, stream_context, synchronize, to_device
from ..utils.hf import load_tokenizer, resolve_model_path
from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .io import SchedulerIOMixin
from .prefill import ChunkedReq, PrefillManager, estimated_kv_tokens
from .table import TableManager

logger = logging.getLogger(__name__)


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


class Scheduler(SchedulerIOMixin):
    def __init__(self, config: SchedulerConfig) -> None:
        if config.max_extend_tokens < 1:
            raise ValueError("max_extend_tokens must be at least 1")
        self.config = config
        self.engine = Engine(config)
        self.device = self.engine.device
        self.stream = create_stream(self.device)  # scheduling work's own stream on a GPU, as upstream
        page_size = config.page_size
        self.table_manager = TableManager(config.max_running_req, self.engine.page_table)
        self.cache_manager = CacheManager(self.engine.num_pages, page_size, self.engine.page_table, config.cache_type)
        self.decode_manager = DecodeManager(page_size)
        self.prefill_manager = PrefillManager(self.cache_manager, self.table_manager, self.decode_manager)
        self.tokenizer = _try_load_tokenizer(config.model_path)
        self.eos_token_id = _eos_token_id(self.tokenizer, self.engine.config.hf_config)
        self.token_pool = self.table_manager.token_pool
        self.prefill_budget = config.max_extend_tokens
        self.overlap_scheduling = config.overlap_scheduling and not ENV.DISABLE_OVERLAP_SCHEDULING.value
        self.finished_reqs: Set[Req] = set()  # finished or aborted, resources not released yet: results are stale
        self._release_queue: Deque[Tuple[int, Req]] = deque()  # (release once this batch id completed, req)
        self._launched_id = 0  # newest launched batch
        self._done_id = 0  # newest batch whose results were processed (batches complete in launch order)
        self._last_was_chunk = False
        super().__init__(config)

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
        else:
            raise TypeError(f"unknown message {msg!r}")

    def _add_user_req(self, msg: UserMsg) -> None:
        # Upstream bug 6: an over-long prompt is dropped silently; here every unservable request gets an error reply
        input_len, max_seq_len = len(msg.input_ids), self.engine.max_seq_len
        max_tokens = msg.sampling_params.max_tokens
        error = None
        if input_len == 0:
            error = "empty prompt"
        elif input_len >= max_seq_len:
            error = f"prompt of {input_len} tokens leaves no room in the context of {max_seq_len} tokens"
        elif max_tokens < 1:
            error = f"max_tokens must be at least 1, got {max_tokens}"
        if error is None and max_tokens > max_seq_len - input_len:
            # clamp as upstream, on a copy: the caller may share one SamplingParams between requests
            msg.sampling_params = replace(msg.sampling_params, max_tokens=max_seq_len - input_len)
        if error is None:
            ps = self.cache_manager.page_size
            need = estimated_kv_tokens(input_len, msg.sampling_params.max_tokens, 0, ps)
            if need > self.cache_manager.num_pages * ps:  # would wait at the head of the queue forever
                error = f"request needs {need} KV slots, the pool has {self.cache_manager.num_pages * ps}"
        if error is not None:
            logger.warning("rejecting request %d: %s", msg.uid, error)
            self.send_result([DetokenizeMsg(msg.uid, -1, True, error)])
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
        self.send_result([DetokenizeMsg(uid, -1, True, "aborted")])

    def _finish_req(self, req: Req) -> None:
        """Take a finished or aborted request out of scheduling; release its slot and pages later."""
        self.decode_manager.remove_req(req)
        self.prefill_manager.prefix_cached(req.uid)  # nobody waits for its prefix any more
        self.finished_reqs.add(req)
        # Fix of upstream bug 3: the batch launched last may still write its slot and pages: release after it
        self._release_queue.append((self._launched_id, req))
        self._release_done()

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
        # Prefill first, as upstream, except right after a chunk when requests are decoding: then chunks and
        # decode steps alternate, so running requests keep producing tokens while a long prompt goes in.
        if not (self._last_was_chunk and self.decode_manager.runnable):
            batch = self.prefill_manager.schedule_next_batch(self.prefill_budget)
        if batch is None:
            batch = self.decode_manager.schedule_next_batch()
        self._last_was_chunk = batch is not None and batch.is_prefill and isinstance(batch.reqs[-1], ChunkedReq)
        return None if batch is None else self._prepare_batch(batch)

    def _prepare_batch(self, batch: Batch) -> ForwardInput:
        self.engine.graph_runner.pad_batch(batch)
        self.cache_manager.allocate_paged(batch.reqs)
        batch.positions = _make_positions(batch, self.device)
        input_tuple = _make_input_tuple(batch, self.device)
        write_tuple = _make_write_tuple(batch, self.device)
        batch.out_loc = self.engine.page_table[input_tuple]
        self.engine.attn_backend.prepare_metadata(batch)
        return ForwardInput(batch, self.engine.sampler.prepare(batch), input_tuple, write_tuple)

    def _forward(self, fwd_input: ForwardInput) -> ForwardData:
        batch, sample_args, input_tuple, write_tuple = fwd_input
        batch.input_ids = self.token_pool[input_tuple]
        fwd_output = self.engine.forward_batch(batch, sample_args)  # advances every request (complete_one)
        self.token_pool[write_tuple] = fwd_output.next_tokens_gpu
        self.decode_manager.filter_reqs(batch.reqs)
        self._launched_id += 1
        return ForwardData(fwd_input, fwd_output, self._length_finished(batch), self._launched_id)

    @staticmethod
    def _length_finished(batch: Batch) -> Sequence[bool]:
        # right after complete_one: can_decode is False exactly when this batch's token is the last one allowed
        return [not req.can_decode for req in batch.reqs]

    def _process_last_data(self, last_data: ForwardData | None) -> None:
        if last_data is None:
            return
        fwd_input, fwd_output, length_finished, batch_id = last_data
        fwd_output.copy_done_event.synchronize()
        batch = fwd_input.batch
        tokens_cpu = fwd_output.next_tokens_cpu
        reply: List[DetokenizeMsg] = []
        with self.cache_manager.lazy_free_region():
            for i, (req, token) in enumerate(zip(batch.reqs, tokens_cpu.tolist())):
                if isinstance(req, ChunkedReq) or self._is_stale(req):
                    continue
                req.append_host(tokens_cpu[i : i + 1])
                finished = length_finished[i] or (token == self.eos_token_id and not req.sampling_params.ignore_eos)
                reply.append(DetokenizeMsg(req.uid, token, finished))
                if finished:
                    self._finish_req(req)
                elif batch.is_prefill:
                    self.cache_manager.cache_req(req, finished=False)  # the prompt becomes shareable
                    self.prefill_manager.prefix_cached(req.uid)
            self._done_id = batch_id
            self._release_done()
        if reply:
            self.send_result(reply)

    def _reject_stuck_head(self) -> None:
        """Nothing in flight and no prefill forms: reject the head request, not spin (upstream bug 6; unreachable)."""
        pending = self.prefill_manager.pending_list[0]
        self.prefill_manager.abort_req(pending.uid)
        logger.error("request %d can never be scheduled; rejecting it", pending.uid)
        self.send_result([DetokenizeMsg(pending.uid, -1, True, "request can never be scheduled")])

    def overlap_loop(self, last_data: ForwardData | None) -> ForwardData | None:
        """One step: launch batch N+1, then process batch N (`last_data`). Returns N+1."""
        blocking = not (last_data is not None or self.prefill_manager.runnable or self.decode_manager.runnable)
        for msg in self.receive_msg(blocking=blocking):
            self._process_one_msg(msg)
        fwd_input = self._schedule_next_batch()
        ongoing_data = None
        if fwd_input is not None:
            with stream_context(self.engine.stream):
                self.engine.stream.wait_stream(self.stream)  # the batch's inputs were written on our stream
                ongoing_data = self._forward(fwd_input)
        elif last_data is None and self.prefill_manager.runnable:
            self._reject_stuck_head()
        self._process_last_data(last_data)
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

    def run_when_idle(self) -> None:
        """Nothing is running or in flight: all pages must be free or cached."""
        self.cache_manager.check_integrity(deep=ENV.CHECK_CACHE_DEEP.value)

    def shutdown(self) -> None:
        synchronize(self.device)
        self.sync_all_ranks()
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


def _make_positions(batch: Batch, device: torch.device) -> torch.Tensor:
    reqs = batch.padded_reqs
    if all(r.extend_len == 1 for r in reqs):
        positions = torch.tensor([r.cached_len for r in reqs], dtype=torch.int32)
    else:
        positions = torch.cat([torch.arange(r.cached_len, r.device_len, dtype=torch.int32) for r in reqs])
    return to_device(positions, device)


def _make_input_tuple(batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    reqs = batch.padded_reqs
    rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
    if any(r.extend_len != 1 for r in reqs):
        rows = rows.repeat_interleave(torch.tensor([r.extend_len for r in reqs]))
    return to_device(rows, device), batch.positions.to(torch.int64)


def _make_write_tuple(batch: Batch, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    # The sampled token's position is device_len before the forward. A chunk's token is junk: it goes to the last
    # column of its own row, which is never read before the request overwrites it (as upstream).
    rows = torch.tensor([r.table_idx for r in batch.reqs], dtype=torch.int64)
    cols = torch.tensor([r.device_len if r.can_decode else -1 for r in batch.reqs], dtype=torch.int64)
    return to_device(rows, device), to_device(cols, device)

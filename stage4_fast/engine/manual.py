"""Filling batches by hand. Stage1 has no scheduler, so this does, in the simplest way, what stage2's table manager,
cache manager and scheduler do: hand out request slots and KV pages from free lists, write the page table and the
token pool, and build each batch's positions / input_ids / out_loc."""

from __future__ import annotations

from typing import Dict, List, Literal, Sequence

import torch

from ..core import Batch, Req, SamplingParams
from ..utils import div_ceil
from ..utils.device import stream_context, to_device
from .engine import Engine


class ManualBatcher:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.page_size = engine.ctx.page_size
        self.free_pages: List[int] = list(range(engine.num_pages))  # page ids; slot = page * page_size + offset
        self.free_slots: List[int] = list(range(engine.config.max_running_req))  # page-table rows
        # token ids per (request slot, position), as upstream's token_pool: decode inputs stay on the device
        self.token_pool = torch.zeros_like(engine.page_table)
        self._pages: Dict[Req, List[int]] = {}
        self._uid = 0

    def add_req(self, input_ids: Sequence[int], sampling_params: SamplingParams) -> Req:
        if not self.free_slots:
            raise RuntimeError("no free request slot: raise max_running_req")
        output_len = sampling_params.max_tokens
        if len(input_ids) + output_len > self.engine.max_seq_len:
            raise ValueError(f"prompt + output ({len(input_ids)} + {output_len}) > max_seq_len")
        ids = torch.tensor(list(input_ids), dtype=torch.int32)
        req = Req(ids, self.free_slots.pop(0), 0, output_len, self._uid, sampling_params)
        self._uid += 1
        self.token_pool[req.table_idx, : len(ids)] = to_device(ids, self.token_pool.device)
        self._pages[req] = []
        return req

    def free_req(self, req: Req) -> None:
        self.free_pages.extend(self._pages.pop(req))
        self.free_slots.append(req.table_idx)

    def _allocate(self, req: Req) -> None:
        """Pages for every position up to device_len; only new pages are written into the page table."""
        pages = self._pages[req]
        need = div_ceil(req.device_len, self.page_size) - len(pages)
        if need > len(self.free_pages):
            raise RuntimeError(f"KV pool exhausted: need {need} pages, {len(self.free_pages)} free")
        for _ in range(need):
            page = self.free_pages.pop(0)
            start = len(pages) * self.page_size
            slots = torch.arange(page * self.page_size, (page + 1) * self.page_size, dtype=torch.int32)
            self.engine.page_table[req.table_idx, start : start + self.page_size] = slots
            pages.append(page)

    def make_batch(self, reqs: List[Req], phase: Literal["prefill", "decode"]) -> Batch:
        engine = self.engine
        batch = Batch(reqs, phase)
        engine.pad_batch(batch)
        for req in batch.reqs:
            self._allocate(req)
        rows = torch.cat([torch.full((r.extend_len,), r.table_idx, dtype=torch.int64) for r in batch.padded_reqs])
        positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in batch.padded_reqs])
        rows, positions = to_device(rows, engine.device), to_device(positions, engine.device)
        batch.positions = positions.to(torch.int32)
        batch.input_ids = self.token_pool[rows, positions]
        batch.out_loc = engine.page_table[rows, positions]
        engine.attn_backend.prepare_metadata(batch)
        return batch

    def step(self, reqs: List[Req], phase: Literal["prefill", "decode"]) -> List[int]:
        """One forward; returns the sampled token of each request (also appended to its host input_ids)."""
        with stream_context(self.engine.stream):  # on a GPU, forward_batch must run on the engine's stream
            return self._step(reqs, phase)

    def _step(self, reqs: List[Req], phase: Literal["prefill", "decode"]) -> List[int]:
        batch = self.make_batch(reqs, phase)
        # the sampled token goes where the request's next input sits: its device_len before the forward
        write_rows = torch.tensor([r.table_idx for r in reqs], dtype=torch.int64)
        write_cols = torch.tensor([r.device_len for r in reqs], dtype=torch.int64)
        out = self.engine.forward_batch(batch, self.engine.sampler.prepare(batch))
        device = self.engine.device
        self.token_pool[to_device(write_rows, device), to_device(write_cols, device)] = out.next_tokens_gpu
        out.copy_done_event.synchronize()
        for req, token in zip(reqs, out.next_tokens_cpu):
            req.append_host(token)
        return out.next_tokens_cpu.tolist()

    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams) -> List[List[int]]:
        """Prefill all prompts in one batch, then decode them together (EOS is not checked: a request runs until
        max_tokens). More prompts than request slots run in consecutive groups."""
        outputs: List[List[int]] = []
        group = self.engine.config.max_running_req
        for start in range(0, len(prompts), group):
            reqs = [self.add_req(p, sampling_params) for p in prompts[start : start + group]]
            self.step(reqs, "prefill")
            while running := [r for r in reqs if r.can_decode]:
                self.step(running, "decode")
            for req, prompt in zip(reqs, prompts[start : start + group]):
                outputs.append(req.input_ids[len(prompt) :].tolist())
                self.free_req(req)
        return outputs

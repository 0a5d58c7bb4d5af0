"""Every attention backend's metadata path against the fp32 reference, on a ragged batch with cached prefixes.

fi and fa run against the same-interface fakes of their libraries (tests/fakes); triton runs its real kernels
(under the interpreter on CPU). Graph hooks are checked the way the graph runner uses them: capture once, then
replay batches whose metadata must come only from the fixed buffers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import List

import pytest
import torch

from stage4_fast.attention import create_attention_backend, validate_attn_backend
from stage4_fast.attention.base import HybridBackend
from stage4_fast.core import Batch, Context, Req, SamplingParams, set_global_ctx
from stage4_fast.kernel.ref import quantize_kv, store_cache_ref
from stage4_fast.kvcache import MHAKVCache

from .attention_ref import gather_rows, paged_attention_ref

NUM_QO, NUM_KV, HEAD_DIM = 4, 2, 16


@dataclass
class FakeModelConfig:
    num_qo_heads: int = NUM_QO
    num_kv_heads: int = NUM_KV
    head_dim: int = HEAD_DIM


class World:
    """A context with a KV pool and page table; requests own random (non-contiguous) pages."""

    def __init__(self, page_size: int, num_pages: int = 64, rows: int = 8, width: int = 128, seed: int = 0,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, head_dim: int = HEAD_DIM,
                 kv_dtype: torch.dtype | None = None, kv_scales: tuple[float, float] | None = None):
        self.gen = torch.Generator().manual_seed(seed)
        self.page_size = page_size
        self.device, self.dtype, self.head_dim = torch.device(device), dtype, head_dim
        self.config = FakeModelConfig(head_dim=head_dim)
        self.ctx = Context(page_size=page_size)
        set_global_ctx(self.ctx)
        self.kv = self.ctx.kv_cache = MHAKVCache(NUM_KV, 1, head_dim, num_pages + 1, page_size, kv_dtype or dtype,
                                                 self.device, compute_dtype=dtype)
        if kv_scales is not None:  # an fp8 pool's per-layer scales
            self.kv.set_scales([kv_scales[0]], [kv_scales[1]])
        self.ctx.page_table = torch.zeros(rows + 1, width, dtype=torch.int32, device=self.device)
        self.dummy_slot = num_pages * page_size
        self.ctx.page_table[rows].fill_(self.dummy_slot)
        self.free_pages = torch.randperm(num_pages, generator=self.gen).tolist()
        self.next_row = 0

    def slots(self) -> torch.Tensor:
        return self.kv.k_cache(0).view(-1, NUM_KV, self.head_dim), self.kv.v_cache(0).view(-1, NUM_KV, self.head_dim)

    def add_req(self, cached_len: int, device_len: int) -> Req:
        """A request whose first cached_len tokens already have (random) KV in the pool."""
        row = self.next_row
        self.next_row += 1
        pages = [self.free_pages.pop() for _ in range(-(-device_len // self.page_size) + 1)]
        slots = torch.cat([torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages])
        self.ctx.page_table[row, : len(slots)] = slots.to(torch.int32)
        k, v = self.slots()
        prefix = slots[:cached_len].to(self.device)
        shape = (cached_len, NUM_KV, self.head_dim)
        k_new, v_new = (torch.randn(shape, generator=self.gen).to(self.device, self.dtype) for _ in range(2))
        store_cache_ref(k, v, prefix, k_new, v_new, self.kv.k_scales[0], self.kv.v_scales[0])
        req = Req(torch.zeros(device_len, dtype=torch.int32), row, 0, 4, uid=row, sampling_params=SamplingParams())
        req.cached_len = cached_len
        return req

    def batch(self, reqs: List[Req], phase: str) -> Batch:
        batch = Batch(reqs, phase)  # type: ignore[arg-type]
        batch.padded_reqs = list(reqs)
        rows = torch.cat([torch.full((r.extend_len,), r.table_idx) for r in reqs]).to(self.device)
        pos = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).to(self.device)
        batch.positions = pos.to(torch.int32)
        batch.out_loc = self.ctx.page_table[rows, pos]
        batch.input_ids = torch.zeros(len(pos), dtype=torch.int32, device=self.device)
        return batch

    def qkv(self, tokens: int):
        g = self.gen
        d = self.head_dim
        shapes = ((tokens, NUM_QO, d), (tokens, NUM_KV, d), (tokens, NUM_KV, d))
        return tuple(torch.randn(s, generator=g).to(self.device, self.dtype) for s in shapes)

    def reference(self, q: torch.Tensor, batch: Batch) -> torch.Tensor:
        k, v = self.slots()
        reqs = batch.padded_reqs
        cu = torch.tensor([0] + [r.extend_len for r in reqs]).cumsum(0).to(torch.int32)
        return paged_attention_ref(q, k, v, self.ctx.page_table, torch.tensor([r.table_idx for r in reqs]), cu,
                                   torch.tensor([r.device_len for r in reqs]), self.head_dim**-0.5,
                                   self.kv.k_scales[0], self.kv.v_scales[0])

    def stored(self, rows: torch.Tensor, which: int) -> torch.Tensor:
        """K (0) or V (1) rows as the pool stores them."""
        scale = (self.kv.k_scales, self.kv.v_scales)[which][0]
        return quantize_kv(rows, scale, self.kv.dtype)


def check_prefill(world: World, backend: str, atol: float = 1e-5) -> None:
    attn = create_attention_backend(backend, world.config)
    reqs = [world.add_req(0, 9), world.add_req(13, 21), world.add_req(4, 5), world.add_req(0, 1)]
    batch = world.batch(reqs, "prefill")
    attn.prepare_metadata(batch)
    q, k, v = world.qkv(batch.out_loc.shape[0])
    out = attn.forward(q, k, v, 0, batch)
    k_slots, v_slots = world.slots()
    loc = batch.out_loc.long()
    for stored, new, which in ((k_slots, k, 0), (v_slots, v, 1)):
        assert torch.equal(gather_rows(stored, loc).float(), world.stored(new, which).float())
    torch.testing.assert_close(out, world.reference(q, batch), atol=atol, rtol=atol)
    cu = torch.tensor([0, 9, 17, 18, 19])
    assert torch.equal(batch.attn_metadata.get_last_indices(4).cpu().long(), cu[1:] - 1)


def check_decode(world: World, backend: str, lens=(1, 7, 30, 12), atol: float = 1e-5) -> None:
    attn = create_attention_backend(backend, world.config)
    reqs = [world.add_req(n - 1, n) for n in lens]
    batch = world.batch(reqs, "decode")
    attn.prepare_metadata(batch)
    q, k, v = world.qkv(len(reqs))
    out = attn.forward(q, k, v, 0, batch)
    torch.testing.assert_close(out, world.reference(q, batch), atol=atol, rtol=atol)


def check_graph_hooks(world: World, backend: str, atol: float = 1e-5) -> None:
    """Capture a decode batch of 4 from dummy requests, then replay real batches (of 3 real + 1 dummy) through the
    captured metadata. The forward runs on the capture batch object, as a real graph would."""
    attn = create_attention_backend(backend, world.config)
    attn.init_capture_graph(max_seq_len=128, bs_list=[2, 4])
    dummy = Req(torch.zeros(1, dtype=torch.int32), 8, 0, 1, uid=-1, sampling_params=SamplingParams())
    captured = Batch([dummy] * 4, "decode")
    captured.padded_reqs = captured.reqs
    out_loc = torch.full((4,), world.dummy_slot, dtype=torch.int32, device=world.device)
    captured.out_loc, captured.positions = out_loc, torch.zeros(4, dtype=torch.int32, device=world.device)
    attn.prepare_for_capture(captured)
    for step, lens in enumerate([(3, 17, 40), (9, 2, 25)]):
        reqs = [world.add_req(n - 1, n) for n in lens] + [dummy]
        batch = world.batch(reqs, "decode")
        attn.prepare_metadata(batch)
        q, k, v = world.qkv(4)
        out_loc.copy_(batch.out_loc)  # the graph runner's copy_from
        attn.prepare_for_replay(batch)
        out = attn.forward(q, k, v, 0, captured)
        ref = world.reference(q, batch)
        torch.testing.assert_close(out[:3], ref[:3], atol=atol, rtol=atol, msg=f"step {step}")


BACKENDS = ["torch", "triton", "fi", "fa"]


@pytest.fixture
def libs(fake_flashinfer, fake_flash_attn):
    return fake_flashinfer, fake_flash_attn


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_with_cached_prefixes(backend, page_size, libs):
    check_prefill(World(page_size), backend)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode(backend, page_size, libs):
    check_decode(World(page_size), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_hooks_replay_reads_only_the_capture_buffers(backend, libs):
    check_graph_hooks(World(page_size=2), backend)


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("backend", ["torch", "triton", "fi"])
def test_fp8_pool_read_as_stored_times_scale(backend, kv, libs):
    """An fp8 pool with per-layer scales (not 1.0, so a forgotten scale shows): every backend that reads fp8
    stores each K/V row as quantize_kv gives it and attends as the fp32 reference over ``stored * scale``."""
    for check in (check_prefill, check_decode, check_graph_hooks):
        check(World(page_size=2, kv_dtype=FP8[kv], kv_scales=(0.5, 2.0)), backend)


@pytest.mark.parametrize("bs", range(1, 7))
def test_triton_metadata_vectors_start_on_16_byte_boundaries(bs):
    """The three vectors share one upload; each starts 16-byte aligned whatever the batch size, since Triton
    compiles a kernel once per pointer alignment (a misaligned view cost a fresh GPU machine ~2 s of compiling in
    the middle of its first run)."""
    world = World(page_size=1)
    attn = create_attention_backend("triton", world.config)
    reqs = [world.add_req(2, 3 + i) for i in range(bs)]
    for phase in ("prefill", "decode"):
        batch = world.batch(reqs, phase)
        attn.prepare_metadata(batch)
        meta = batch.attn_metadata
        for vector in (meta.cu_seqlens_q, meta.seq_lens, meta.table_idx):
            assert vector.data_ptr() % 16 == 0
        assert meta.seq_lens.tolist() == [r.device_len for r in reqs]
        assert meta.table_idx.tolist() == [r.table_idx for r in reqs]


def test_hybrid_backend_dispatches_by_phase_and_graphs_go_to_decode(libs):
    fi, fa = libs
    world = World(page_size=1)
    attn = create_attention_backend("fa,fi", world.config)
    assert isinstance(attn, HybridBackend)
    for phase, lens in (("prefill", [(0, 6), (2, 9)]), ("decode", [(5, 6), (8, 9)])):
        reqs = [world.add_req(c, n) for c, n in lens]
        batch = world.batch(reqs, phase)
        attn.prepare_metadata(batch)
        q, k, v = world.qkv(batch.out_loc.shape[0])
        torch.testing.assert_close(attn.forward(q, k, v, 0, batch), world.reference(q, batch), atol=1e-5, rtol=1e-5)
    assert len(fa.calls) == 1 and [c[0] for c in fi.calls] == ["decode"]
    attn.init_capture_graph(64, [1])
    assert attn.decode_backend.capture is not None and attn.prefill_backend.capture is None


def test_flashinfer_sees_page_size_one_whatever_the_engine_page_size(libs):
    fi, _ = libs
    world = World(page_size=4)
    attn = create_attention_backend("fi", world.config)
    batch = world.batch([world.add_req(0, 5)], "prefill")
    attn.prepare_metadata(batch)
    attn.forward(*world.qkv(5), 0, batch)
    assert fi.calls == [("prefill", dict(causal=True, page_size=1, q_data_type=torch.float32,
                                         kv_data_type=torch.float32))]
    assert torch.equal(batch.attn_metadata.indices, world.ctx.page_table[0, :5])


@pytest.mark.parametrize(
    "spec,ok", [("auto", True), ("fi", True), ("fa,fi", True), ("triton,torch", True), ("fi,", False),
                ("a,b,c", False), ("nope", False)]
)
def test_validate_attn_backend(spec, ok):
    if ok:
        assert validate_attn_backend(spec) == spec
    else:
        with pytest.raises((ValueError, argparse.ArgumentTypeError)):
            validate_attn_backend(spec)

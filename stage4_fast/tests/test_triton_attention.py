"""The Triton paged-attention kernels (interpreter on CPU) against a per-request fp32 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the [test] extra installs it)")

from stage4_fast.kernel.triton_attention import decode_attention  # noqa: E402
from stage4_fast.kernel.triton_prefill import (  # noqa: E402
    prefill_attention,
    prefill_block_m,
    prefill_block_map,
    prefill_block_map_capacity,
)

from .attention_ref import paged_attention_ref  # noqa: E402


def _paged_setup(seed: int, seq_lens: list[int], num_kv_heads: int, head_dim: int, width: int = 64):
    """A pool with random K/V and a page table whose rows hold shuffled slots (non-contiguous KV)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = 4 * width
    k_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    rows = len(seq_lens) + 2
    page_table = torch.stack([torch.randperm(num_slots, generator=gen)[:width] for _ in range(rows)]).to(torch.int32)
    table_idx = torch.randperm(rows, generator=gen)[: len(seq_lens)].to(torch.int32)  # rows out of order
    return gen, k_cache, v_cache, page_table, table_idx, torch.tensor(seq_lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "num_qo_heads,num_kv_heads,head_dim", [(4, 4, 32), (4, 2, 32), (8, 2, 64), (6, 2, 48)]
)
def test_prefill_with_cached_prefix_matches_reference(num_qo_heads, num_kv_heads, head_dim):
    seq_lens = [5, 37, 18, 1]
    extend = [5, 20, 1, 1]  # a fresh prompt, a chunk after a 17-token prefix, single tokens
    gen, k, v, pt, tidx, lens = _paged_setup(0, seq_lens, num_kv_heads, head_dim)
    cu = torch.tensor([0] + extend).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), num_qo_heads, head_dim, generator=gen)
    out = prefill_attention(q, k, v, pt, tidx, cu, lens, max(extend), head_dim**-0.5)
    ref = paged_attention_ref(q, k, v, pt, tidx, cu, lens, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_block_map_lists_every_query_block_once_most_keys_first():
    seqlens_q, seqlens_k = np.array([5, 40, 1, 17]), np.array([5, 57, 30, 17])
    m = prefill_block_map(seqlens_q, seqlens_k, 16)
    count, pairs = m[0], m[1:].reshape(-1, 2)
    assert count == len(pairs) == 1 + 3 + 1 + 2
    assert sorted(map(tuple, pairs.tolist())) == [(0, 0), (1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (3, 1)]
    keys = [seqlens_k[r] - seqlens_q[r] + min((b + 1) * 16, seqlens_q[r]) for r, b in pairs]
    assert keys == sorted(keys, reverse=True) and pairs[0].tolist() == [1, 2]  # request 1's last block: 57 keys
    assert count <= prefill_block_map_capacity(int(seqlens_q.sum()), 4, 16)


@pytest.mark.parametrize("num_qo_heads,num_kv_heads,head_dim", [(4, 2, 32), (6, 2, 48)])
def test_prefill_from_a_block_map_with_spare_entries_matches_reference(num_qo_heads, num_kv_heads, head_dim):
    """The graph-captured prefill's launch: a 1-D grid over a block map longer than its count (the capture's
    capacity) and metadata buffers longer than the batch, both holding an earlier batch's entries past the
    current ones (here a request 4 of 20 query rows after the batch's 27), and a max_seqlen_q that says nothing."""
    seq_lens, extend = [5, 37, 18, 1], [5, 20, 1, 1]
    gen, k, v, pt, tidx, lens = _paged_setup(1, seq_lens, num_kv_heads, head_dim)
    cu = torch.tensor([0] + extend).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]) + 20, num_qo_heads, head_dim, generator=gen)  # the rows past 27: fixed buffer
    block_m = prefill_block_m(q.dtype, num_qo_heads // num_kv_heads)
    exact = prefill_block_map(np.array(extend), np.array(seq_lens), block_m)
    stale = np.tile(np.array([4, 0], np.int32), prefill_block_map_capacity(47, 5, block_m))
    mapped = torch.from_numpy(np.concatenate([exact, stale]))
    cu_buf = torch.cat([cu, torch.tensor([47], dtype=torch.int32)])
    lens_buf, tidx_buf = torch.cat([lens, lens[1:2]]), torch.cat([tidx, tidx[1:2]])
    out = torch.zeros_like(q)
    prefill_attention(q, k, v, pt, tidx_buf, cu_buf, lens_buf, 1, head_dim**-0.5, out=out,
                      block_map=(block_m, mapped))
    ref = paged_attention_ref(q[:27], k, v, pt, tidx, cu, lens, head_dim**-0.5)
    torch.testing.assert_close(out[:27], ref, atol=1e-5, rtol=1e-5)
    assert not out[27:].any(), "a program past the map's count ran"
    with pytest.raises(AssertionError, match="another query block"):
        prefill_attention(q[:27], k, v, pt, tidx, cu, lens, 1, head_dim**-0.5,
                          block_map=(block_m * 2, torch.from_numpy(exact)))


def test_a_head_dim_below_the_block_reads_nothing_past_each_head():
    """head_dim 48 runs in 64-wide blocks: the padding columns of a K/V row are masked in every key block, the
    whole ones too. Here the pool's rows are views of 64-wide rows whose last 16 values are NaN; an unmasked load
    read them (and with them, in a real pool, the next head's values or memory past its end) and made rows NaN."""
    seq_lens, extend = [5, 37, 18, 1], [5, 20, 1, 1]
    _, k, v, pt, tidx, lens = _paged_setup(0, seq_lens, 2, 48)
    k_wide = torch.full((k.shape[0], 2, 64), float("nan"))
    v_wide = torch.full_like(k_wide, float("nan"))
    k_wide[..., :48], v_wide[..., :48] = k, v
    k_view, v_view = k_wide[..., :48], v_wide[..., :48]
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0] + extend).cumsum(0).to(torch.int32)
    q = torch.randn(int(cu[-1]), 6, 48, generator=gen)
    out = prefill_attention(q, k_view, v_view, pt, tidx, cu, lens, max(extend), 48**-0.5)
    torch.testing.assert_close(out, paged_attention_ref(q, k, v, pt, tidx, cu, lens, 48**-0.5), atol=1e-5, rtol=1e-5)
    q1 = torch.randn(len(seq_lens), 6, 48, generator=gen)
    one = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = decode_attention(q1, k_view, v_view, pt, tidx, lens, 48**-0.5, 2)
    torch.testing.assert_close(out, paged_attention_ref(q1, k, v, pt, tidx, one, lens, 48**-0.5), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("num_qo_heads,num_kv_heads,head_dim", [(4, 2, 32), (8, 1, 64), (3, 3, 16)])
def test_decode_matches_reference(num_qo_heads, num_kv_heads, head_dim, num_splits):
    seq_lens = [1, 9, 40, 64]  # splits past the end of short sequences hold no keys
    gen, k, v, pt, tidx, lens = _paged_setup(1, seq_lens, num_kv_heads, head_dim)
    q = torch.randn(len(seq_lens), num_qo_heads, head_dim, generator=gen)
    out = decode_attention(q, k, v, pt, tidx, lens, head_dim**-0.5, num_splits)
    cu = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    ref = paged_attention_ref(q, k, v, pt, tidx, cu, lens, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_decode_whole_block_loop_equals_the_masked_loop(monkeypatch, num_splits):
    """The decode kernel's two loops (whole blocks unmasked then a masked tail, as an fp8 pool runs; every block
    masked, as a 16-bit pool runs) give the same result for lengths below one block, on block edges and between
    them (the interpreter's key blocks hold 16 keys)."""
    from stage4_fast.kernel import triton_attention as ta

    seq_lens = [1, 15, 16, 17, 32, 33, 47, 64]
    gen, k, v, pt, tidx, lens = _paged_setup(3, seq_lens, 2, 32)
    q = torch.randn(len(seq_lens), 4, 32, generator=gen)
    outs = []
    for whole in (False, True):
        monkeypatch.setattr(ta, "DECODE_WHOLE_BLOCKS_16BIT", whole)
        outs.append(ta.decode_attention(q, k, v, pt, tidx, lens, 32**-0.5, num_splits))
    ref = paged_attention_ref(q, k, v, pt, tidx, torch.arange(len(seq_lens) + 1, dtype=torch.int32), lens, 32**-0.5)
    torch.testing.assert_close(outs[0], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=1e-6)


def test_decode_writes_into_given_scratch_and_output():
    """Under a CUDA graph the scratch and output are fixed buffers: the kernel must use the ones passed in."""
    gen, k, v, pt, tidx, lens = _paged_setup(2, [7, 30], 2, 32)
    q = torch.randn(2, 4, 32, generator=gen)
    out = torch.full_like(q, float("nan"))
    mid_o = torch.empty(4, 4, 16, 32)
    mid_lse = torch.empty(4, 4, 16)
    result = decode_attention(q, k, v, pt, tidx, lens, 32**-0.5, 3, out=out, mid_o=mid_o[:2], mid_lse=mid_lse[:2])
    assert result.data_ptr() == out.data_ptr()
    ref = paged_attention_ref(q, k, v, pt, tidx, torch.arange(3, dtype=torch.int32), lens, 32**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_strided_query_view_is_supported():
    """q arrives as a view of a wider tensor (after RoPE / the qkv split): row strides differ from H * D."""
    gen, k, v, pt, tidx, lens = _paged_setup(3, [12, 3], 2, 32)
    wide = torch.randn(2, 6, 32, generator=gen)
    q = wide[:, :4]
    out = decode_attention(q, k, v, pt, tidx, lens, 32**-0.5, 1)
    ref = paged_attention_ref(q.contiguous(), k, v, pt, tidx, torch.arange(3, dtype=torch.int32), lens, 32**-0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class _LaunchRecorder:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args)`` records the arguments instead of running."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(args)


def test_eager_decode_compiles_nothing_the_graphs_did_not(monkeypatch):
    """Triton compiles a kernel once per specialisation of its integer arguments (== 1, divisible by 16). An eager
    decode-shaped batch (its own scratch, any split count) must fall in the class the CUDA graphs were captured
    with (fixed scratch MAX_DECODE_SPLITS wide): a split count of 13 with a 13-wide scratch would compile a new
    variant at the first warm-cache prefill while every running request waits."""
    import inspect

    from stage4_fast.attention.triton import MAX_DECODE_SPLITS
    from stage4_fast.kernel import triton_attention as ta

    names = [p for p in inspect.signature(ta._decode_split_kernel.fn).parameters]
    recorder = _LaunchRecorder()
    monkeypatch.setattr(ta, "_decode_split_kernel", recorder)
    monkeypatch.setattr(ta, "_decode_combine_kernel", _LaunchRecorder())
    gen, k, v, pt, tidx, lens = _paged_setup(4, [7, 30], 2, 32)
    q = torch.randn(2, 16, 32, generator=gen)
    graph_o = torch.empty(8, 16, MAX_DECODE_SPLITS, 32)  # the capture buffers: [max_bs, Hq, MAX splits, D]
    graph_lse = torch.empty(8, 16, MAX_DECODE_SPLITS)
    ta.decode_attention(q, k, v, pt, tidx, lens, 1.0, 12, mid_o=graph_o[:2], mid_lse=graph_lse[:2])
    ta.decode_attention(q, k, v, pt, tidx, lens, 1.0, 16, mid_o=graph_o[:2], mid_lse=graph_lse[:2])
    graph_classes = set()
    for args in recorder.calls:
        graph_classes.add(tuple((v == 1, v % 16 == 0) for n, v in zip(names, args)
                                if isinstance(v, int) and n not in ta._DECODE_UNSPECIALISED))
    for splits in (2, 5, 13, 15):
        recorder.calls.clear()
        ta.decode_attention(q, k, v, pt, tidx, lens, 1.0, splits)
        (args,) = recorder.calls
        eager = tuple((v == 1, v % 16 == 0) for n, v in zip(names, args)
                      if isinstance(v, int) and n not in ta._DECODE_UNSPECIALISED)
        assert eager in graph_classes, f"{splits} splits: {eager} not among {graph_classes}"


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_fp8_cache_under_16_bit_queries_follows_the_reference(kv, q_dtype):
    """The GPU's fp8 path: 16-bit queries over an fp8 pool (the dots in fp16, see _fp16_dots), in decode with splits
    and in prefill, attend as the fp32 reference over stored x scale (scales not 1.0, so a forgotten one shows)."""
    from stage4_fast.kernel.ref import quantize_kv

    gen, k, v, pt, tidx, lens = _paged_setup(6, [9, 40, 64], 2, 32)
    k, v = quantize_kv(k * 3, 0.5, FP8[kv]), quantize_kv(v, 2.0, FP8[kv])
    scales = dict(k_scale=0.5, v_scale=2.0)
    qd = torch.randn(3, 4, 32, generator=gen).to(q_dtype)
    extend = torch.tensor([9, 20, 1])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), extend.cumsum(0).to(torch.int32)])
    qp = torch.randn(int(cu[-1]), 4, 32, generator=gen).to(q_dtype)
    got_d = decode_attention(qd, k, v, pt, tidx, lens, 32**-0.5, 2, **scales).float()
    got_p = prefill_attention(qp, k, v, pt, tidx, cu, lens, 20, 32**-0.5, **scales).float()
    ref_d = paged_attention_ref(qd, k, v, pt, tidx, torch.arange(4, dtype=torch.int32), lens, 32**-0.5, **scales)
    ref_p = paged_attention_ref(qp, k, v, pt, tidx, cu, lens, 32**-0.5, **scales)
    torch.testing.assert_close(got_d, ref_d.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got_p, ref_p.float(), atol=3e-2, rtol=3e-2)


def test_gpu_decode_launch_of_an_fp8_cache_caps_its_registers(monkeypatch):
    """On a GPU an fp8 pool's decode kernel launches with DECODE_LAUNCH_FP8, at most DECODE_MAXNREG_FP8 registers per
    thread (uncapped, it would hold so many that fewer programs fit an SM than a bf16 pool runs); a bf16 pool's
    launch stays uncapped. Checked on the launch arguments, with the kernel stubbed (the interpreter has no
    registers)."""
    from stage4_fast.kernel import triton_attention as ta

    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(ta, "_interpreting", lambda: False)
    monkeypatch.setattr(ta, "_decode_split_kernel", Recorder())
    gen, k, v, pt, tidx, lens = _paged_setup(6, [7, 30], 2, 32)
    q = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16)
    for pool in (torch.float8_e4m3fn, torch.bfloat16):
        ta.decode_attention(q, k.to(pool), v.to(pool), pt, tidx, lens, 1.0, 1)
    fp8, bf16 = launches
    assert (fp8["BLOCK_N"], fp8["num_warps"], fp8["num_stages"]) == ta.DECODE_LAUNCH_FP8
    assert ta.DECODE_MAXNREG_FP8 and fp8["maxnreg"] == ta.DECODE_MAXNREG_FP8
    assert "maxnreg" not in bf16 and bf16["BLOCK_N"] == ta.DECODE_BLOCK_N
    assert fp8["WHOLE_BLOCKS"] and not bf16["WHOLE_BLOCKS"]  # unmasked whole blocks pay for fp8 only


def test_fp8_decode_routes_to_the_cuda_kernel_where_it_applies(monkeypatch):
    """Where the CUDA fp8 kernel applies (stubbed here: it needs an sm_89+ GPU), decode_attention hands it the
    Triton kernel's arguments — base-2 softmax scale with the K scale folded in, the V scale, the split scratch —
    and merges its splits with the Triton merge kernel; asking for a Triton launch (the sweeps do) keeps Triton."""
    from stage4_fast.kernel import triton_attention as ta

    class CudaStub:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def decode_fp8(self, *args) -> None:
            self.calls.append(args)

    cuda, split_kernel, combine = CudaStub(), _LaunchRecorder(), _LaunchRecorder()
    monkeypatch.setattr(ta, "cuda_fp8_decode_module", lambda q, k_cache, page_table: cuda)
    monkeypatch.setattr(ta, "_decode_split_kernel", split_kernel)
    monkeypatch.setattr(ta, "_decode_combine_kernel", combine)
    monkeypatch.setattr(ta, "_num_sms", lambda device: 132)
    gen, k, v, pt, tidx, lens = _paged_setup(6, [7, 30], 2, 32)
    q = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16)
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    ta.decode_attention(q, k8, v8, pt, tidx, lens, 0.25, 3, k_scale=0.5, v_scale=2.0)
    (args,) = cuda.calls
    scale_log2, v_scale, splits, stages, heads_first, warps, dependent_launch = args[-7:]
    assert scale_log2 == pytest.approx(0.25 * 0.5 * ta.LOG2E) and v_scale == 2.0 and splits == 3
    assert stages == ta.DECODE_FP8_CUDA_STAGES and heads_first == ta.DECODE_FP8_CUDA_HEADS_FIRST
    assert warps == 8  # 2 x 2 x 3 programs: far fewer than 2 per SM
    assert dependent_launch is False  # a CPU tensor: kernel/pdl.py says no
    assert args[6].shape[2] >= 3 and len(combine.calls) == 1 and not split_kernel.calls
    ta.decode_attention(q, k8, v8, pt, tidx, lens, 0.25, 1)  # one split: output written directly, no merge
    assert len(cuda.calls) == 2 and len(combine.calls) == 1
    ta.decode_attention(q, k8, v8, pt, tidx, lens, 0.25, 3, block_n=64)
    assert len(cuda.calls) == 2 and len(split_kernel.calls) == 1


def test_the_cuda_fp8_kernel_splits_only_small_batches(monkeypatch):
    """The CUDA fp8 kernel's split rule (DECODE_PROGRAMS_PER_SM_CUDA_FP8 = 1 program per SM) against the Triton
    kernel's (11): Qwen3-0.6B's 8 KV heads on 132 SMs."""
    from stage4_fast.kernel import triton_attention as ta

    monkeypatch.setattr(ta, "_interpreting", lambda: False)
    assert [ta.decode_num_splits(bs, 8, 16, 132, cuda_fp8=True) for bs in (218, 23, 17, 16, 1)] == [1, 1, 1, 2, 16]
    assert [ta.decode_num_splits(bs, 8, 16, 132) for bs in (218, 23, 1)] == [1, 8, 16]


def test_the_cuda_fp8_kernel_widens_its_programs_for_small_batches():
    """8 warps per program below 2 programs per SM (DECODE_FP8_CUDA_WIDE_BELOW), 4 from there: Qwen3-0.6B's 8 KV
    heads on 132 SMs, with the split counts the engine picks (1 from batch 17 up, 16 at batch 1)."""
    from stage4_fast.kernel import triton_attention as ta

    shapes = ((218, 1), (101, 1), (33, 1), (32, 1), (23, 1), (16, 2), (1, 16))
    assert [ta.cuda_fp8_decode_warps(bs * 8 * splits, 132) for bs, splits in shapes] == [4, 4, 4, 8, 8, 8, 8]

"""GPU subset (skipped without CUDA): the kernels in bf16 and fp32 at real shapes, the real FlashInfer / FlashAttention
libraries behind the same checks the fakes pass on CPU, real CUDA graphs, and HF alignment on the GPU.

Run by `nox -s gpu` (tools/gpu_check.sh on a machine without network). fp32 token-for-token covers the backends
that compute in fp32 (torch, triton); FlashInfer and FlashAttention compute in 16-bit only, so they are checked in
bf16, teacher-forced against HF bf16 on the Qwen3-0.6B shape (logits of every step within a stated relative error;
argmax equal wherever HF's top-2 gap is clear).
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import itertools

import pytest
import torch

from stage4_fast.kernel.ref import fused_experts_ref, indexing_ref, quantize_kv, store_cache_ref

from .attention_ref import paged_attention_ref
from .conftest import REPO, prepared_model
from .fast_helpers import hf_generate, llm_generate
from .test_attention_backends import World, check_decode, check_graph_hooks, check_prefill

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nox -s gpu)")
CUDA = "cuda"


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:
        return False


def _libs() -> list[str]:
    return ["torch", "triton"] + [b for b, m in (("fi", "flashinfer"), ("fa", "flash_attn.cute")) if _installed(m)]


# ---- kernels -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_attention_at_qwen3_shape(dtype):
    from stage4_fast.kernel.triton_attention import decode_attention
    from stage4_fast.kernel.triton_prefill import prefill_attention

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, slots = 16, 8, 128, 8192
    k = torch.randn(slots, hkv, d, generator=gen).to(CUDA, dtype)
    v = torch.randn(slots, hkv, d, generator=gen).to(CUDA, dtype)
    lens = torch.tensor([1, 100, 1500, 777], dtype=torch.int32)
    extend = torch.tensor([1, 100, 300, 64], dtype=torch.int32)
    pt = torch.stack([torch.randperm(slots, generator=gen)[:2048] for _ in range(5)]).to(torch.int32)
    tidx = torch.tensor([4, 0, 2, 1], dtype=torch.int32)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), extend.cumsum(0).to(torch.int32)])
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(CUDA, dtype)
    args = [x.to(CUDA) for x in (pt, tidx, cu, lens)]
    out = prefill_attention(q, k, v, args[0], args[1], args[2], args[3], int(extend.max()), d**-0.5)
    ref = paged_attention_ref(q, k, v, args[0], tidx, cu, lens, d**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    qd = torch.randn(4, hq, d, generator=gen).to(CUDA, dtype)
    for splits in (1, 4, 16):
        out = decode_attention(qd, k, v, args[0], args[1], args[3], d**-0.5, splits)
        ref = paged_attention_ref(qd, k, v, args[0], tidx, torch.arange(5, dtype=torch.int32), lens, d**-0.5)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 4, 64, 1000])
def test_fused_moe_at_real_shapes(dtype, tokens):
    from stage4_fast.kernel.triton_moe import fused_experts
    from stage4_fast.moe import fused_topk

    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter = 64, 1024, 384
    x = torch.randn(tokens, hidden, generator=gen).to(CUDA, dtype)
    w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(CUDA, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(CUDA, dtype)
    weights, ids = fused_topk(x, torch.randn(tokens, experts, generator=gen).to(CUDA), 8, True)
    out, ref = fused_experts(x, w1, w2, weights, ids, unsorted_max_tokens=4), fused_experts_ref(x, w1, w2, weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_fused_moe_tuned_configs_match_reference():
    """Every config of the tuned files for this GPU (kernel/moe_configs, `python -m bench moe-tune`) at its own token
    count, in bf16, against the reference (hidden 2048, Qwen3-30B-A3B's; top-8)."""
    import json

    from stage4_fast.kernel.triton_moe import CONFIG_DIR, fused_experts, get_moe_config
    from stage4_fast.moe import fused_topk

    files = sorted(CONFIG_DIR.glob(f"*,device_name={torch.cuda.get_device_name().replace(' ', '_')}.json"))
    if not files:
        pytest.skip("no tuned MoE configs for this GPU (python -m bench moe-tune)")
    gen = torch.Generator().manual_seed(0)
    for f in files:
        experts, inter = (int(part.split("=")[1]) for part in f.name.split(",")[:2])
        hidden, dtype = 2048, torch.bfloat16
        w1 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(CUDA, dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(CUDA, dtype)
        for tokens in map(int, json.loads(f.read_text())):
            x = torch.randn(tokens, hidden, generator=gen).to(CUDA, dtype)
            weights, ids = fused_topk(x, torch.randn(tokens, experts, generator=gen).to(CUDA), 8, True)
            assert "num_warps" in get_moe_config(tokens, experts, inter, dtype)  # the file's, not the built-in one
            out, ref = (fn(x, w1, w2, weights, ids).float() for fn in (fused_experts, fused_experts_ref))
            # bf16 rounding gives ~0.4 % (2^-8); a wrong tile or mask gives errors of the output's own size
            assert (out - ref).norm() / ref.norm() < 1e-2, (f.name, tokens)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_copy_kernels_match_reference(dtype, index_dtype):
    from stage4_fast.kernel import indexing, load_cuda_kernels, store_cache

    assert load_cuda_kernels() is not None, "the JIT CUDA kernels did not build"
    heads, d = 8, 128
    kc, vc = (torch.zeros(100, heads, d, dtype=dtype, device=CUDA) for _ in range(2))
    qkv = torch.randn(5, 24 * d, dtype=dtype, device=CUDA)
    k, v = qkv[:, 8 * d:16 * d].view(5, heads, d), qkv[:, 16 * d:].view(5, heads, d)
    idx = torch.tensor([3, 99, 0, 42, 7], dtype=index_dtype, device=CUDA)
    store_cache(kc, vc, idx, k, v)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    store_cache_ref(kr, vr, idx, k, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    table = torch.randn(50, 1024, dtype=dtype, device=CUDA)
    ids = torch.tensor([0, 49, 120, 60, 100], dtype=index_dtype, device=CUDA)
    assert torch.equal(indexing(table, ids.clamp(max=49)), indexing_ref(table, ids.clamp(max=49)))
    assert torch.equal(indexing(table, ids, vocab_range=(50, 50)), indexing_ref(table, ids, vocab_range=(50, 50)))


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_fp8_store_matches_reference_bit_for_bit(dtype, kv):
    """The quantizing store kernel rounds (and saturates) exactly as quantize_kv: values spread over the whole fp8
    range and past it (e4m3 saturates above 448), two scales, int32 and int64 slots."""
    from stage4_fast.kernel import load_cuda_kernels, store_cache

    assert load_cuda_kernels() is not None, "the JIT CUDA kernels did not build"
    heads, d = 8, 128
    gen = torch.Generator().manual_seed(1)
    qkv = (torch.randn(7, 24 * d, generator=gen) * torch.logspace(-3, 3, 7)[:, None]).to(CUDA, dtype)
    k, v = qkv[:, 8 * d:16 * d].view(7, heads, d), qkv[:, 16 * d:].view(7, heads, d)
    for index_dtype, (k_scale, v_scale) in ((torch.int32, (1.0, 1.0)), (torch.int64, (0.37, 3.0))):
        idx = torch.tensor([3, 99, 0, 42, 7, 64, 11], dtype=index_dtype, device=CUDA)
        kc, vc = (torch.zeros(100, heads, d, dtype=FP8[kv], device=CUDA) for _ in range(2))
        kr, vr = (torch.zeros(100, heads, d, dtype=FP8[kv], device=CUDA) for _ in range(2))
        store_cache(kc, vc, idx, k, v, k_scale, v_scale)
        store_cache_ref(kr, vr, idx, k, v, k_scale, v_scale)
        assert torch.equal(kc.view(torch.uint8), kr.view(torch.uint8))
        assert torch.equal(vc.view(torch.uint8), vr.view(torch.uint8))
        assert torch.isfinite(kc.float()).all() and torch.isfinite(vc.float()).all()


@pytest.mark.parametrize("kv", FP8)
def test_triton_attention_reads_an_fp8_cache_at_qwen3_shape(kv):
    from stage4_fast.kernel.triton_attention import decode_attention
    from stage4_fast.kernel.triton_prefill import prefill_attention

    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, slots = 16, 8, 128, 8192
    k = quantize_kv(torch.randn(slots, hkv, d, generator=gen) * 3, 0.5, FP8[kv]).to(CUDA)
    v = quantize_kv(torch.randn(slots, hkv, d, generator=gen), 2.0, FP8[kv]).to(CUDA)
    scales = dict(k_scale=0.5, v_scale=2.0)
    lens = torch.tensor([1, 100, 1500, 777], dtype=torch.int32)
    extend = torch.tensor([1, 100, 300, 64], dtype=torch.int32)
    pt = torch.stack([torch.randperm(slots, generator=gen)[:2048] for _ in range(5)]).to(torch.int32).to(CUDA)
    tidx = torch.tensor([4, 0, 2, 1], dtype=torch.int32, device=CUDA)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), extend.cumsum(0).to(torch.int32)]).to(CUDA)
    lens = lens.to(CUDA)
    q = torch.randn(int(cu[-1]), hq, d, generator=gen).to(CUDA, torch.bfloat16)
    out = prefill_attention(q, k, v, pt, tidx, cu, lens, int(extend.max()), d**-0.5, **scales)
    ref = paged_attention_ref(q, k, v, pt, tidx, cu, lens, d**-0.5, **scales)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    qd = torch.randn(4, hq, d, generator=gen).to(CUDA, torch.bfloat16)
    for splits in (1, 4, 16):
        out = decode_attention(qd, k, v, pt, tidx, lens, d**-0.5, splits, **scales)
        ref = paged_attention_ref(qd, k, v, pt, tidx, torch.arange(5, dtype=torch.int32), lens, d**-0.5, **scales)
        torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_cuda_fp8_decode_kernel_matches_the_reference(kv, group):
    """The hand-written fp8 decode kernel (csrc/decode_fp8.cu) against the fp32 reference over ``stored * scale``:
    lengths on and around its 16-key tiles and 64- and 128-key warp rounds, more splits than a short sequence has
    keys (empty splits), every GQA group it takes, bf16 and fp16 queries, every shared-memory depth, grid order and
    program width (4 or 8 warps) it builds.
    Bound: the output is rounded to the queries' dtype
    (bf16: 2^-8 relative) after fp16 products (queries and probabilities rounded to 2^-11): 1e-2, where the Triton
    kernel's test above allows 3e-2."""
    from stage4_fast.kernel import triton_attention as ta

    gen = torch.Generator().manual_seed(group)
    hkv, d, slots = 4, 128, 8192
    hq = hkv * group
    k = quantize_kv(torch.randn(slots, hkv, d, generator=gen) * 3, 0.5, FP8[kv]).to(CUDA)
    v = quantize_kv(torch.randn(slots, hkv, d, generator=gen), 2.0, FP8[kv]).to(CUDA)
    lens = torch.tensor([1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1000, 2047], dtype=torch.int32)
    batch = lens.numel()
    pt = torch.stack([torch.randperm(slots, generator=gen)[:2048] for _ in range(batch)]).to(torch.int32).to(CUDA)
    tidx = torch.randperm(batch, generator=gen).to(torch.int32).to(CUDA)
    lens = lens.to(CUDA)
    cu = torch.arange(batch + 1, dtype=torch.int32)
    for q_dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(batch, hq, d, generator=gen).to(CUDA, q_dtype)
        if ta.cuda_fp8_decode_module(q, k, pt) is None:
            pytest.skip("the CUDA fp8 decode kernel needs sm_89+ and the JIT-built extension")
        ref = paged_attention_ref(q, k, v, pt, tidx, cu, lens, d**-0.5, k_scale=0.5, v_scale=2.0).float()
        for splits, stages, heads_first, warps in itertools.product((1, 3, 16), (2, 3, 4), (True, False), (4, 8)):
            out = ta.decode_attention(q, k, v, pt, tidx, lens, d**-0.5, splits, k_scale=0.5, v_scale=2.0,
                                      cuda_stages=stages, cuda_heads_first=heads_first, cuda_warps=warps)
            torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)


def _one_token_chain(weights: list, pool: dict, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The kernels of a one-token decode step as the engine chains them (GEMVs with the norm and the SiLU folded in,
    the q/k norm + RoPE with the KV store, the split decode attention and its merge, then the final norm, an LM
    head GEMV and the argmax); returns the token. Writes x, residual and the pools in place."""
    from stage4_fast.kernel import greedy_argmax, triton_attention, triton_fused, triton_gemv

    h = x
    for w in weights:
        qkv, res = triton_gemv.normed_gemv(h, residual, w["n1"], 1e-6, w["qkv"])
        q, _ = triton_fused.qk_norm_rope(qkv, 16, 8, 128, w["qn"], w["kn"], 1e-6, pool["cos_sin"], pool["pos"],
                                         kv_store=(w["kc"], w["vc"], pool["loc"]))
        a = triton_attention.decode_attention(q, w["kc"], w["vc"], pool["table"], pool["table_idx"],
                                              pool["lens"], 128**-0.5, 4, mid_o=pool["mid_o"],
                                              mid_lse=pool["mid_lse"])
        o = triton_gemv.gemv(a.view(1, -1), w["o"])
        gu, res = triton_gemv.normed_gemv(o, res, w["n2"], 1e-6, w["gu"])
        h = triton_gemv.gemv(gu, w["down"], gated=True)
        residual.copy_(res)
    x.copy_(h)
    normed = triton_fused.add_rmsnorm(h, residual, pool["final_norm"], 1e-6)
    return greedy_argmax(triton_gemv.gemv(normed, pool["lm_head"]))


def _pdl_seeded_bf16():
    """Skips where programmatic dependent launch is off (before compute capability 9.0); else a seeded source of
    random bf16 GPU tensors, rand(*shape, scale=1.0), and its generator."""
    from stage4_fast.kernel import pdl

    pdl._enabled.cache_clear()
    if not pdl.pdl_launch(torch.device(CUDA))[0]:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(CUDA, torch.bfloat16)

    return rand, gen


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_one_token_chain_gives_the_same_bits_with_dependent_launch_in_a_graph(monkeypatch, kv_dtype):
    """kernel/pdl.py: each kernel waits for the one before it before reading its results, so launching the chain
    with programmatic dependent launch (replayed from a CUDA graph, where it overlaps) changes no bit of the
    hidden state, the residual stream, the KV written into the pool or the token, against eager launches without
    it. 8 layers at the Qwen3-0.6B shape, each with its own weights; with an fp8 pool the attention is the CUDA
    kernel (csrc/decode_fp8.cu), which takes part in the dependent launch as the Triton kernels do."""
    from stage4_fast.kernel import pdl

    rand, gen = _pdl_seeded_bf16()
    slots, length = 4096, 700
    weights = [dict(n1=rand(1024) + 1, qkv=rand(4096, 1024, scale=0.03), qn=rand(128) + 1, kn=rand(128) + 1,
                    o=rand(1024, 2048, scale=0.02), n2=rand(1024) + 1, gu=rand(6144, 1024, scale=0.03),
                    down=rand(1024, 3072, scale=0.02), kc=rand(slots, 8, 128).to(kv_dtype),
                    vc=rand(slots, 8, 128).to(kv_dtype))
               for _ in range(8)]
    table = torch.randperm(slots, generator=gen)[:length].to(torch.int32).view(1, -1).to(CUDA)
    pool = dict(cos_sin=torch.randn(2048, 128, generator=gen).to(CUDA), pos=torch.tensor([length - 1], device=CUDA),
                loc=table[:, -1].clone(), table=table, table_idx=torch.zeros(1, dtype=torch.int32, device=CUDA),
                lens=torch.tensor([length], dtype=torch.int32, device=CUDA),
                mid_o=torch.empty(1, 16, 16, 128, device=CUDA), mid_lse=torch.empty(1, 16, 16, device=CUDA),
                final_norm=rand(1024) + 1, lm_head=rand(151936, 1024, scale=0.03))
    x0, r0 = rand(1, 1024), rand(1, 1024)
    caches0 = [(w["kc"].clone(), w["vc"].clone()) for w in weights]

    def state(token):
        return [token, x, residual] + [c for w in weights for c in (w["kc"], w["vc"])]

    with monkeypatch.context() as m:
        m.setattr(pdl, "_capable", lambda index: False)  # launched as before Hopper: no PDL
        pdl._enabled.cache_clear()
        x, residual = x0.clone(), r0.clone()
        eager = [t.clone() for t in state(_one_token_chain(weights, pool, x, residual))]
    pdl._enabled.cache_clear()
    x, residual = x0.clone(), r0.clone()
    _one_token_chain(weights, pool, x, residual)  # compiles the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token = _one_token_chain(weights, pool, x, residual)
    for _ in range(2):  # a replay overlaps its kernels; the second also starts right behind the first
        x.copy_(x0)
        residual.copy_(r0)
        for w, (kc, vc) in zip(weights, caches0):
            w["kc"].copy_(kc)
            w["vc"].copy_(vc)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(state(token), eager):  # fp8 compared as bytes (no fp8 equality kernel)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.element_size() == 1 \
                else torch.equal(got, want)


def test_kernels_after_cublas_gemms_launch_early_in_a_graph_and_give_the_same_bits():
    """kernel/pdl_graph.py: in a captured chain of cuBLAS GEMMs and our PDL kernels (64 rows, 8 MLP layers at the
    Qwen3-0.6B shape: gate_up GEMM, SiLU-and-mul, down GEMM, add-RMSNorm; then the LM head and the argmax), the
    edges out of the GEMMs are rewired to leave at launch order, and three replays of that graph give the same bits
    as replays of the same capture left as it was."""
    from stage4_fast.kernel import greedy_argmax, triton_fused
    from stage4_fast.kernel.pdl_graph import move_edges_to_launch_order

    rand, _ = _pdl_seeded_bf16()

    layers = [dict(gu=rand(6144, 1024, scale=0.03), down=rand(1024, 3072, scale=0.02), norm=rand(1024) + 1)
              for _ in range(8)]
    lm_head = rand(151936, 1024, scale=0.03)
    x0, r0 = rand(64, 1024), rand(64, 1024)
    x, residual = x0.clone(), r0.clone()

    def chain():
        h = x
        for w in layers:
            h = torch.nn.functional.linear(triton_fused.silu_and_mul(torch.nn.functional.linear(h, w["gu"])),
                                           w["down"])
            h = triton_fused.add_rmsnorm(h, residual, w["norm"], 1e-6)
        return h, greedy_argmax(torch.nn.functional.linear(h, lm_head))

    chain()  # compile outside the captures
    outputs = []
    for rewire in (False, True):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            out = chain()
        if rewire:
            assert move_edges_to_launch_order(graph) >= 2 * len(layers)
        graph.instantiate()
        runs = []
        for _ in range(3):
            x.copy_(x0)
            residual.copy_(r0)
            graph.replay()
            torch.cuda.synchronize()
            runs.append([t.clone() for t in (*out, residual)])
        outputs.append(runs)
    for plain, rewired in zip(*outputs):
        for got, want in zip(rewired, plain):
            assert torch.equal(got, want)


# ---- backends with the real libraries ------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", ["triton", "fi", "fa"])
def test_backend_metadata_paths_on_gpu(backend, page_size):
    if backend in ("fi", "fa") and backend not in _libs():
        pytest.skip(f"{backend}: library not installed on this machine")
    for check in (check_prefill, check_decode, check_graph_hooks):
        world = World(page_size, num_pages=256, device=CUDA, dtype=torch.bfloat16, head_dim=128)
        check(world, backend, atol=2e-2)


@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("backend", ["triton", "fi"])
def test_backend_reads_an_fp8_pool_on_gpu(backend, kv):
    """bf16 queries against an fp8 pool with scales 0.5 / 2.0, through the real kernels and library: the prefill,
    decode and graph-hook paths, each against the fp32 reference over ``stored * scale``."""
    if backend not in _libs():
        pytest.skip(f"{backend}: library not installed on this machine")
    for check in (check_prefill, check_decode, check_graph_hooks):
        world = World(1, num_pages=256, device=CUDA, dtype=torch.bfloat16, head_dim=128, kv_dtype=FP8[kv],
                      kv_scales=(0.5, 2.0))
        check(world, backend, atol=3e-2)


# ---- whole engine --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graph", "eager"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe", "tiny-qwen3-moe-dense"])
def test_fp32_engine_matches_hf_on_gpu(model, backend, graphs):
    path = prepared_model(model)
    # the torch backend cannot be captured: with it the engine turns graphs off by itself
    out = llm_generate(path, attention_backend=backend, cuda_graph_max_bs=None if graphs else 0, max_extend_tokens=8)
    assert out == hf_generate(path)


def test_an_engine_started_after_another_one_shut_down_gets_its_memory():
    """Two LLMs in turn in one process (a notebook, a benchmark comparing configurations): the second sizes its KV
    pool from what is free once the first is gone, not from what torch's allocator cache left on the device. No
    gc.collect() here: the engine must not need one."""
    from stage4_fast import LLM

    from .helpers import greedy

    path = str(prepared_model("tiny-qwen3"))
    pages = []
    for _ in range(2):
        llm = LLM(path, dtype=torch.bfloat16, cuda_graph_max_bs=8)
        llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
        pages.append(llm.engine.num_pages)
        llm.shutdown()
        del llm
    assert pages[1] >= 0.95 * pages[0], pages


def test_a_deleted_llm_gives_its_gpu_memory_back_without_the_garbage_collector():
    """`llm.shutdown(); del llm` releases the weights, the KV pool and the graphs' buffers at once (to torch's
    allocator cache, which the next engine empties): nothing the LLM holds points back at it, so no garbage
    collection is needed first."""
    from stage4_fast import LLM

    from .helpers import greedy

    path = str(prepared_model("tiny-qwen3"))
    gc.collect()
    before = torch.cuda.memory_allocated()
    gc.disable()
    try:
        llm = LLM(path, dtype=torch.bfloat16, cuda_graph_max_bs=8)
        llm.generate([[1, 2, 3]], greedy(4), use_tqdm=False)
        held = torch.cuda.memory_allocated() - before
        llm.shutdown()
        del llm
        left = torch.cuda.memory_allocated() - before
    finally:
        gc.enable()
    print(f"held {held / 2**30:.2f} GiB, left {left / 2**20:.1f} MiB")
    assert held > 1 << 30 and left < 0.01 * held, (held, left)


REL_L2_BOUND = 5e-2  # bf16 logits vs HF bf16 over 28 layers; the measured values are printed
CLEAR_GAP = 1.0  # logits; the random Qwen3-0.6B shape has logit std ~30


@pytest.mark.parametrize("backend", ["triton", "fi", "fa", "fa,fi"])
def test_bf16_qwen3_shape_teacher_forced_against_hf(backend):
    path = REPO / "models" / "qwen3-0.6b-shape"
    if not (path / "config.json").exists():
        pytest.skip("python -m models make qwen3-0.6b-shape --device cuda")
    if any(b not in _libs() for b in backend.split(",")):
        pytest.skip(f"{backend}: library not installed on this machine")
    from .teacher_forcing import hf_reference, stage_logits

    prompts, forced, ref = hf_reference(path, num_prompts=4, steps=24)
    # graphs: decode's, and the prefill step's where the backend is Triton's (padding: that step padded with dummy
    # prompts up to a graph of 37 tokens more)
    for graphs, padding in ((True, 0), (True, 37), (False, 0)):
        logits = stage_logits(path, prompts, forced, attention_backend=backend, dtype=torch.bfloat16,
                              cuda_graph_max_bs=None if graphs else 0, prefill_graph=graphs, prefill_padding=padding)
        rel = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > CLEAR_GAP
        agree = (logits.argmax(-1) == ref.argmax(-1))[clear].float().mean().item()
        print(f"[{backend} graphs={graphs} padding={padding}] max rel L2 {rel:.4f}, argmax agreement on clear "
              f"steps {agree:.4f} ({int(clear.sum())}/{clear.numel()} clear)")
        assert rel < REL_L2_BOUND and agree == 1.0


# A token whose router ranks its k-th and (k+1)-th expert closer than this (router logits, std ~1 here) may route
# differently in two correct bf16 engines: the router logits of HF bf16 and fp32 differ by up to ~0.02 on this
# shape, and one swapped expert moves that token's logits by up to ~8 % (measured on one layer). The bound of
# REL_L2_BOUND holds on the steps every layer routes clearly; a swap is allowed only where the router is that close.
MOE_ROUTE_GAP = 0.05


def _hf_router_gaps(path, prompts: list, forced: list) -> torch.Tensor:
    """[prompts, steps]: at each teacher-forced step's token, the smallest gap over the MoE layers between HF's
    k-th and (k+1)-th router logit (the same sequences as ``hf_reference``'s forward: prompt + forced[:-1])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(CUDA).eval()
    k, gaps = model.config.num_experts_per_tok, []
    with torch.inference_mode():
        for p, f in zip(prompts, forced):
            router = model(torch.tensor([p + f[:-1]], device=CUDA), output_router_logits=True).router_logits
            top = torch.stack([r[len(p) - 1:].float().topk(k + 1, dim=-1).values for r in router])
            gaps.append((top[..., k - 1] - top[..., k]).min(dim=0).values.cpu())
    del model
    torch.cuda.empty_cache()
    return torch.stack(gaps)


def test_bf16_fused_moe_qwen3_30b_a3b_shape_teacher_forced_against_hf():
    """The fused Triton MoE (tuned configs where a file for this GPU exists) at Qwen3-30B-A3B's layer shape, 2
    layers: bf16 logits against HF bf16 within REL_L2_BOUND wherever routing is clear, argmax equal where HF's
    top-2 gap is also clear."""
    path = REPO / "models" / "qwen3-30b-a3b-shape-2l"
    if not (path / "config.json").exists():
        pytest.skip("python -m models make qwen3-30b-a3b-shape --layers 2 --device cuda")
    from .teacher_forcing import hf_reference, stage_logits

    prompts, forced, ref = hf_reference(path, num_prompts=8, steps=32)
    routed = _hf_router_gaps(path, prompts, forced) > MOE_ROUTE_GAP
    logits = stage_logits(path, prompts, forced, moe_backend="fused", dtype=torch.bfloat16)
    rel = (logits - ref).norm(dim=-1) / ref.norm(dim=-1)
    top2 = ref.topk(2, dim=-1).values
    clear = routed & ((top2[..., 0] - top2[..., 1]) > CLEAR_GAP)
    agree = (logits.argmax(-1) == ref.argmax(-1))[clear].float().mean().item()
    print(f"routing clear on {int(routed.sum())}/{routed.numel()} steps: max rel L2 {rel[routed].max():.4f} there, "
          f"median over all {rel.median():.4f}, max {rel.max():.4f}; argmax agreement {agree:.4f} ({int(clear.sum())})")
    assert routed.float().mean() > 0.1  # the bound below is checked on enough steps
    assert rel[routed].max() < REL_L2_BOUND and rel.median() < REL_L2_BOUND and agree == 1.0


def test_deferred_norms_cost_no_accuracy_on_the_qwen3_shape(monkeypatch):
    """bf16's default, the norms deferred into the kernels after their projections (models/decoder.py), against
    the norm kernels they replace, both teacher-forced against HF: the error of the same size (1.5x the replaced
    path's at most; both measured values printed)."""
    path = REPO / "models" / "qwen3-0.6b-shape"
    if not (path / "config.json").exists():
        pytest.skip("python -m models make qwen3-0.6b-shape --device cuda")
    from stage4_fast.models import decoder

    from .teacher_forcing import stage_logits

    prompts, forced, ref = _forced_qwen3_shape()
    rel, logits = {}, {}
    for off in ("0", "1"):
        if off == "1":  # the norm kernels instead
            monkeypatch.setattr(decoder, "deferred_norms_apply", lambda layers: False)
        logits[off] = stage_logits(path, prompts, forced, attention_backend="triton", dtype=torch.bfloat16,
                                   cuda_graph_max_bs=8)
        rel[off] = ((logits[off] - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    print(f"max rel. L2 against HF: deferred norms {rel['0']:.4f}, norm kernels {rel['1']:.4f}")
    assert not torch.equal(logits["0"], logits["1"])  # the patch took effect: the two paths round differently
    assert rel["0"] < min(REL_L2_BOUND, 1.5 * rel["1"])


# ---- one model across machines ----------------------------------------------------------------------------------

# the two "machines" share a host here: without P2P, shared memory and InfiniBand NCCL takes its socket transport
# (over the loopback interface, where --dist-init-addr points), the path two machines on Ethernet use
NETWORK_ONLY = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_nodes_of_one_gpu_equal_tp2_on_one_node(monkeypatch):
    """`--tp 2 --nnodes 2`: node 0 on GPU 0, node 1 on GPU 1 (NCCL over its socket transport) gives the tokens of
    `--tp 2` on one node, and both give HF's (fp32)."""
    from stage4_fast.harness import free_port, server_process

    from .test_multinode import PROMPTS, complete, node_flags, node_log, start_node1

    model = prepared_model("tiny-qwen3")
    with server_process(str(model), tp=2, num_pages=256) as one_node:
        want = [complete(one_node.base_url, p) for p in PROMPTS]
    dist_port = free_port()
    for name, value in {**NETWORK_ONLY, "CUDA_VISIBLE_DEVICES": "0"}.items():
        monkeypatch.setenv(name, value)
    with start_node1(model, dist_port, tp=2, env={"CUDA_VISIBLE_DEVICES": "1"}) as node1, \
            server_process(str(model), tp=2, num_pages=256, extra_args=node_flags(0, dist_port, tp=2)) as node0:
        got = [complete(node0.base_url, p) for p in PROMPTS]
        assert "rank 1/2 on cuda:0" in node_log(node1)  # node 1's only rank, on its machine's first GPU
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    assert got == want == [tokenizer.decode(ids) for ids in hf_generate(model, PROMPTS)]


# fp8 KV against bf16 KV, same backend, teacher-forced on HF's tokens. Rounding to e4m3 (3 mantissa bits) moves a
# value by up to 2^-4 of itself, e5m2 (2 bits) by up to 2^-3: e5m2's error is twice e4m3's, and the bounds say so
# with headroom over the error of 16 prompts x 64 steps. A clear step is the bf16-KV run's top-2 gap above 1 logit,
# as for bf16 against HF; fp8 must pick the same argmax at each.
FP8_REL_L2_BOUND = {"fp8_e4m3": 0.1, "fp8_e5m2": 0.2}
FP8_CLEAR_GAP = 1.0  # logits (std ~30 on this model)


@functools.lru_cache(maxsize=None)
def _forced_qwen3_shape() -> tuple:
    from .teacher_forcing import hf_reference

    return hf_reference(REPO / "models" / "qwen3-0.6b-shape", num_prompts=4, steps=24)


@functools.lru_cache(maxsize=None)
def _qwen3_shape_logits(backend: str, kv: str, calculate_kv_scales: bool = False) -> torch.Tensor:
    from .teacher_forcing import stage_logits

    prompts, forced, _ = _forced_qwen3_shape()
    return stage_logits(REPO / "models" / "qwen3-0.6b-shape", prompts, forced, attention_backend=backend,
                        dtype=torch.bfloat16, kv_cache_dtype=kv, cuda_graph_max_bs=8,
                        calculate_kv_scales=calculate_kv_scales)


@pytest.mark.parametrize("calculate", [False, True], ids=["scale-1", "calculated-scales"])
@pytest.mark.parametrize("kv", FP8)
@pytest.mark.parametrize("backend", ["triton", "fi"])
def test_fp8_kv_qwen3_shape_teacher_forced_against_bf16_kv(backend, kv, calculate):
    """Also with --calculate-kv-scales: the scales set before capture reach the graphs' kernels (same bound)."""
    if not (REPO / "models" / "qwen3-0.6b-shape" / "config.json").exists():
        pytest.skip("python -m models make qwen3-0.6b-shape --device cuda")
    if backend not in _libs():
        pytest.skip(f"{backend}: library not installed on this machine")
    ref, logits = _qwen3_shape_logits(backend, "auto"), _qwen3_shape_logits(backend, kv, calculate)
    rel = ((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > FP8_CLEAR_GAP
    agree = (logits.argmax(-1) == ref.argmax(-1))[clear].float().mean().item()
    label = f"{backend} {kv}{' calculated scales' if calculate else ''}"
    print(f"[{label} vs bf16 KV, graphs] max rel. L2 {rel:.4f}, max |diff| {(logits - ref).abs().max():.3f}, "
          f"argmax agreement on clear steps {agree:.4f} ({int(clear.sum())}/{clear.numel()} clear)")
    assert rel < FP8_REL_L2_BOUND[kv] and agree == 1.0

"""Triton decode-attention launch sweep on a GPU at the upstream workload's real shapes and slot layout (one layer).

    python -m bench decode-sweep [--json out.json] [--kv-dtype fp8_e4m3]

Layout as the engine allocates with page size 1: each prompt's slots contiguous, in admission order, then every
decode step takes one slot per running request from the front of the free list (so decode tokens interleave).
Shapes: the running requests at decode steps 200, 600 and 950 (Qwen3-0.6B: 16 q heads, 8 KV heads, dim 128, bf16).
Prints the fastest launch configurations (block of keys, warps, stages, split count) per shape in TB/s of KV read,
the best configuration summed over the three shapes, and the fused q/k norm + RoPE kernel's time at batch 224.
This is how DECODE_* in stage4_fast/kernel/triton_attention.py were chosen (bench/gpu_notes.md);
``--kv-dtype fp8_e4m3`` sweeps the same shapes over an fp8 KV cache (DECODE_LAUNCH_FP8), bytes counted as stored;
``--layout
contiguous`` gives every request one contiguous run of slots (a page-size-1 pool without interleaved decode tokens):
whether the scattered rows, not the bytes, bound the kernel. Each compiled variant's registers, spills and shared
memory per program are printed at the end (what bounds the programs resident on an SM). Over an fp8 pool on a GPU
that has it, the hand-written CUDA kernel (csrc/decode_fp8.cu: no launch parameters, only the tiles per warp it keeps
in shared memory, ``--cuda-stages``, and its warps per program, ``--cuda-warps``) is timed beside the Triton launches
at every split count, as "cuda kernel".
"""
import argparse
import functools
import itertools
import json

import torch
import triton

from stage4_fast.kernel import triton_attention as ta
from stage4_fast.kernel import triton_fused as tf

from . import meta
from .workloads import offline_upstream


def cuda_config(stages: int, heads_first: bool, warps: int = 0) -> tuple[int, int, int, int]:
    """The CUDA kernel's rows: no Triton launch parameters, only its shared-memory stages, grid order and warps per
    program (0: the engine's choice for the shape)."""
    return (0, warps, stages, int(heads_first))


def is_cuda_config(c: tuple) -> bool:
    return c[0] == 0


def compiled_resources(kernel) -> list[str]:
    """Registers, spills and shared memory of every variant of a Triton kernel compiled in this process (Triton
    keeps them per device; a version whose cache looks different yields nothing rather than failing the sweep)."""
    lines = []
    try:
        for caches in kernel.device_caches.values():
            for compiled in caches[0].values():
                md = compiled.metadata
                lines.append(f"warps {md.num_warps} stages {md.num_stages}: {compiled.n_regs} regs, "
                             f"{compiled.n_spills} spills, {md.shared} B shared")
    except (AttributeError, IndexError, TypeError) as e:
        lines.append(f"(not available: {type(e).__name__} {e})")
    return sorted(set(lines))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench decode-sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write every timing here (with the run's date, commit, versions)")
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3", "fp8_e5m2"],
                    help="what the KV cache stores")
    ap.add_argument("--layout", default="engine", choices=["engine", "contiguous"],
                    help="slot layout: the engine's (decode tokens interleaved) or one run of slots per request")
    ap.add_argument("--blocks", type=int, nargs="+", default=None, help="key blocks to try (default: per dtype)")
    ap.add_argument("--warps", type=int, nargs="+", default=None, help="warp counts to try (default: per dtype)")
    ap.add_argument("--stages", type=int, nargs="+", default=None, help="pipeline stages to try (default: per dtype)")
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[-1],
                    help="register caps per thread to try (0: none; default: the engine's)")
    ap.add_argument("--splits", type=int, nargs="+", default=None,
                    help="split counts to time at every shape (default: the engine's, 1, and 2x and 4x the engine's)")
    ap.add_argument("--cuda-stages", type=int, nargs="+", default=None,
                    help="the CUDA kernel's shared-memory stages to time (default: the engine's)")
    ap.add_argument("--cuda-warps", type=int, nargs="+", default=[0], choices=[0, 4, 8],
                    help="the CUDA kernel's warps per program to time (0, the default: the engine's choice per shape)")
    ap.add_argument("--cuda-order", nargs="+", default=None, choices=["heads", "sequences"],
                    help="the CUDA kernel's grid orders to time: KV heads or sequences first (default: the engine's)")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="override a module constant first (e.g. stage4_fast.kernel.triton_attention."
                         "DECODE_WHOLE_BLOCKS_16BIT=True), for A/B runs")
    args = ap.parse_args(argv)
    meta.apply_sets(args.set)
    kv_dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[
        args.kv_dtype]

    dev = "cuda"
    w = offline_upstream()
    P = [len(p) for p in w.prompts]
    OUT_LENS = w.output_lens
    HQ, HKV, D = 16, 8, 128
    total_p = sum(P)
    starts = [sum(P[:i]) for i in range(len(P))]
    max_step = 1024
    slots_needed = total_p + 256 * (max_step + 1)
    k = torch.randn(slots_needed, HKV, D, device=dev, dtype=torch.bfloat16).to(kv_dtype)
    v = torch.randn(slots_needed, HKV, D, device=dev, dtype=torch.bfloat16).to(kv_dtype)
    width = 40960
    page_table = torch.zeros(257, width, dtype=torch.int32, device=dev)
    run_starts = [sum(P[:i]) + sum(OUT_LENS[:i]) for i in range(len(P))]
    for i in range(256):
        if args.layout == "contiguous":
            row = list(range(run_starts[i], run_starts[i] + P[i] + OUT_LENS[i]))
        else:
            row = list(range(starts[i], starts[i] + P[i])) + [total_p + t * 256 + i for t in range(OUT_LENS[i])]
        page_table[i, : len(row)] = torch.tensor(row, dtype=torch.int32, device=dev)

    def shape(step: int):
        running = [i for i in range(256) if OUT_LENS[i] > step]
        lens = [P[i] + step + 1 for i in running]
        return running, lens

    current = triton_launch = ta.decode_launch(torch.bfloat16, kv_dtype)  # the engine's Triton launch now
    results = []
    if kv_dtype.itemsize == 1:  # fp8 tiles are half as large: larger key blocks fit
        grid = [[64, 128, 256], [4, 8], [1, 2, 3, 4]]  # 1 stage: no prefetch
    else:
        grid = [[32, 64, 128], [2, 4, 8], [2, 3, 4]]
    for i, chosen in enumerate((args.blocks, args.warps, args.stages)):
        grid[i] = chosen or grid[i]
    engine_cap = ta.decode_max_registers(torch.bfloat16, kv_dtype) or 0
    caps = sorted({engine_cap if c < 0 else c for c in args.maxnreg})
    current = (*current, engine_cap)
    configs = list(itertools.product(*grid, caps))
    if current not in configs:  # the engine's own launch is always measured (the "current" lines)
        configs.append(current)
    cuda_kernel = ta.cuda_fp8_decode_module(torch.empty(1, HQ, D, device=dev, dtype=torch.bfloat16), k,
                                            page_table) is not None
    orders = [o == "heads" for o in args.cuda_order] if args.cuda_order else [ta.DECODE_FP8_CUDA_HEADS_FIRST]
    cuda_configs = [cuda_config(s, o, w) for s in (args.cuda_stages or [ta.DECODE_FP8_CUDA_STAGES]) for o in orders
                    for w in args.cuda_warps]
    if not cuda_kernel:
        cuda_configs = []
    else:  # what the engine runs over this pool; the Triton launches are timed against it
        current = cuda_config(ta.DECODE_FP8_CUDA_STAGES, ta.DECODE_FP8_CUDA_HEADS_FIRST)
        if current not in cuda_configs:
            cuda_configs.append(current)

    def label(c: tuple) -> str:
        if is_cuda_config(c):
            return (f"cuda kernel, {c[2]} stages, {'heads' if c[3] else 'sequences'} first, "
                    f"{c[1] or 'engine'} warps")
        return (f"block_n {c[0]:3d} warps {c[1]} stages {c[2]} "
                                                       f"maxnreg {c[3] or 'none'}")
    for step in (200, 600, 950):
        running, lens = shape(step)
        bs = len(running)
        tidx = torch.tensor(running, dtype=torch.int32, device=dev)
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = torch.randn(bs, HQ, D, device=dev, dtype=torch.bfloat16)
        nbytes = sum(lens) * HKV * D * 2 * kv_dtype.itemsize
        base_splits = ta.decode_num_splits(bs, HKV, 16, 132, cuda_kernel)
        split_opts = sorted(set(args.splits or {base_splits, 1, 2 * base_splits, 4 * base_splits}) & set(range(1, 17)))
        for splits in split_opts:
            mid_o = torch.empty(bs, HQ, 16, D, device=dev, dtype=torch.float32)
            mid_lse = torch.empty(bs, HQ, 16, device=dev, dtype=torch.float32)
            ref = ta.decode_attention(q, k, v, page_table, tidx, seq, D**-0.5, 1,  # Triton, one split: the reference
                                      **dict(zip(("block_n", "num_warps", "num_stages"), triton_launch)))
            for bn, nw, ns, cap in configs + cuda_configs:
                launch = dict(cuda_stages=ns, cuda_heads_first=bool(cap), cuda_warps=nw or None) if bn == 0 else dict(
                    block_n=bn, num_warps=nw, num_stages=ns, max_registers=cap)
                try:
                    fn = functools.partial(ta.decode_attention, q, k, v, page_table, tidx, seq, D**-0.5, splits,
                                           mid_o=mid_o, mid_lse=mid_lse, **launch)
                    out = fn()
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=40)
                except Exception as e:  # noqa: BLE001
                    print(f"step {step} bs {bs} splits {splits} bn {bn} w {nw} s {ns} maxnreg {cap}: "
                          f"{type(e).__name__} {e}"[:200])
                    continue
                r = dict(step=step, bs=bs, kv=sum(lens), splits=splits, block_n=bn, warps=nw, stages=ns, maxnreg=cap,
                         us=ms * 1e3,
                         tbs=nbytes / (ms * 1e-3) / 1e12, err=err,
                         default=(bn, nw, ns, cap) == current and splits == base_splits)
                results.append(r)
        rows = [r for r in results if r["step"] == step]
        rows.sort(key=lambda r: r["us"])
        d = next((r for r in rows if r["default"]), None)
        print(f"== step {step}: bs {bs}, {sum(lens):,} KV tokens, {nbytes / 1e9:.2f} GB/layer; engine splits "
              f"{base_splits}; current {d['us']:.1f} us = {d['tbs']:.2f} TB/s" if d else "")
        for r in rows[:8]:
            c = (r["block_n"], r["warps"], r["stages"], r["maxnreg"])
            print(f"   {r['us']:7.1f} us {r['tbs']:5.2f} TB/s  splits {r['splits']:2d} {label(c)}  err {r['err']:.3g}")

    # the whole-run view: each config's summed time over the three shapes (weights ~ steps spent near each shape)
    agg = {}
    for r in results:
        if r["splits"] != ta.decode_num_splits(r["bs"], HKV, 16, 132, cuda_kernel and r["block_n"] == 0):
            continue
        agg.setdefault((r["block_n"], r["warps"], r["stages"], r["maxnreg"]), []).append(r["us"])
    ranked = sorted((sum(v), c) for c, v in agg.items() if len(v) == 3)
    print("== sum over the three shapes (engine splits):")
    for tot, c in ranked[:6]:
        print(f"   {tot:7.1f} us  {label(c)}")
    print(f"   current ({label(current)}): {sum(agg[current]):.1f} us")

    # fused q/k norm + rope at the decode shape (28 calls per step)
    qkv = torch.randn(224, (HQ + 2 * HKV) * D, device=dev, dtype=torch.bfloat16)
    wq = torch.ones(D, device=dev, dtype=torch.bfloat16)
    cs = torch.randn(40960, D, device=dev)
    pos = torch.randint(0, 2000, (224,), device=dev, dtype=torch.int32)
    ms = triton.testing.do_bench(lambda: tf.qk_norm_rope(qkv, HQ, HKV, D, wq, wq, 1e-6, cs, pos), warmup=10, rep=40)
    print(f"== qk_norm_rope at T=224: {ms * 1e3:.2f} us/call")
    print("== compiled decode kernels (warps, stages: registers / spills / shared bytes per program):")
    for line in compiled_resources(ta._decode_split_kernel):
        print("   " + line)
    best = ranked[0][1]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta.run_meta("python -m bench decode-sweep", argv, gpu=True), "results": results,
                       "best": best}, f)
    print("BEST", *best)
    return 0

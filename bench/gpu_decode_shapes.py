"""What a decode-attention launch costs at fixed batch sizes as its sequences grow and spread (GPU).

    python -m bench decode-shapes [--batches 16 64 128 224] [--json out.json]

The engine's decode kernel (the CUDA kernel over an fp8 pool, the Triton one over bf16), 28 launches in one CUDA
graph as in a step (each on its own layer's pool, so that nothing stays in the L2), microseconds per launch:

* **lengths** (every request the same length, 190 / 380 / 760 / 1,520 tokens): a least-squares line through each
  batch's four points, launch time = a + b x (KV tokens): ``a`` is what a launch costs whatever its length, ``b``
  the rate at which it reads the KV once it streams;
* **spread** (``--spread-batches``): the same mean length for every request, lengths drawn from 300..1,224 (the
  workload's spread at decode step ~200) in random order, and those lengths longest first; for fp8 also the CUDA
  kernel with 3 and 4 shared-memory stages, with 8-warp programs, and with 2 and 3 splits forced.

A request's slots are one contiguous run (the engine's page-size-1 layout, decode tokens interleaved, read as fast
in the sweeps of ``bench/gpu_notes.md``, sections 9 and 18).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from . import meta
from .gpu_gemv_sweep import capture_graph, replay_ms

HQ, HKV, D, LAYERS = 16, 8, 128, 28
LENGTHS = (190, 380, 760, 1520)
SPREAD = (300, 1224)
DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "bfloat16": torch.bfloat16}
# the CUDA fp8 kernel's variants beside the engine's launch (decode_attention's keyword arguments)
FP8_VARIANTS = {"engine": {}, "3 stages": {"cuda_stages": 3}, "4 stages": {"cuda_stages": 4},
                "8 warps": {"cuda_warps": 8}, "2 splits": {"splits": 2}, "3 splits": {"splits": 3}}


def launch_us(kv_dtype: torch.dtype, lens: list[int], variant: dict) -> tuple[float, int]:
    """(us per launch, splits) of the engine's decode attention over ``lens`` (one request per length)."""
    from stage4_fast.kernel import triton_attention as ta

    batch, total = len(lens), sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ks = [torch.randn(total, HKV, D, device="cuda", generator=gen).to(kv_dtype) for _ in range(LAYERS)]
    vs = [torch.randn(total, HKV, D, device="cuda", generator=gen).to(kv_dtype) for _ in range(LAYERS)]
    page_table = torch.zeros(batch, (max(lens) + 3) // 4 * 4, device="cuda", dtype=torch.int32)
    start = 0
    for row, n in enumerate(lens):
        page_table[row, :n] = torch.arange(start, start + n, device="cuda", dtype=torch.int32)
        start += n
    table_idx = torch.arange(batch, device="cuda", dtype=torch.int32)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    variant = dict(variant)
    cuda = ta.cuda_fp8_decode_applies(q.dtype, kv_dtype, D, HQ // HKV, q.device)
    splits = variant.pop("splits", None) or ta.decode_num_splits(batch, HKV, ta.SCRATCH_SPLIT_ALIGN, cuda_fp8=cuda)
    mid_o = torch.empty(batch, HQ, ta.SCRATCH_SPLIT_ALIGN, D, device="cuda", dtype=torch.float32)
    mid_lse = torch.empty(batch, HQ, ta.SCRATCH_SPLIT_ALIGN, device="cuda", dtype=torch.float32)
    out = torch.empty_like(q)

    def step() -> None:
        for layer in range(LAYERS):
            ta.decode_attention(q, ks[layer], vs[layer], page_table, table_idx, seq_lens, D**-0.5, splits, out=out,
                                mid_o=mid_o, mid_lse=mid_lse, **variant)

    graph = capture_graph(step)
    us = min(replay_ms(graph, replays=10) for _ in range(3)) * 1000 / LAYERS
    del graph
    ks.clear()
    vs.clear()
    torch.cuda.empty_cache()
    return us, splits


def tbps(kv_dtype: torch.dtype, tokens: int, us: float) -> float:
    return tokens * HKV * D * kv_dtype.itemsize * 2 / us / 1e6


def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench decode-shapes", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 224], help="batch sizes of the lengths")
    ap.add_argument("--spread-batches", type=int, nargs="*", default=[224, 128, 64], help="batch sizes of the spread")
    ap.add_argument("--kv-dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="override a module constant first (e.g. stage4_fast.kernel.triton_attention."
                         "DECODE_FP8_CUDA_STAGES=3), for A/B runs")
    given = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(given)
    meta.apply_sets(args.set)
    results: dict = {"lengths": {}, "fit": {}, "spread": {}}
    for name in args.kv_dtypes:
        kv_dtype = DTYPES[name]
        for batch in args.batches:
            times = []
            for n in LENGTHS:
                us, splits = launch_us(kv_dtype, [n] * batch, {})
                times.append(us)
                results["lengths"][f"{name} {batch} {n}"] = us
                print(f"{name} batch {batch:4d} x {n:5d} tokens, {splits:2d} splits: {us:8.2f} us per launch "
                      f"({tbps(kv_dtype, batch * n, us):.2f} TB/s)", flush=True)
            a, b = line([batch * n for n in LENGTHS], times)
            per_token = HKV * D * kv_dtype.itemsize * 2
            results["fit"][f"{name} {batch}"] = {"us": a, "ns_per_token": b * 1000}
            print(f"{name} batch {batch}: {a:.2f} us + {b * 1000:.3f} ns per KV token "
                  f"({per_token / b / 1e6:.2f} TB/s once streaming)", flush=True)
    gen = torch.Generator().manual_seed(0)
    for batch in args.spread_batches:
        drawn = torch.randint(SPREAD[0], SPREAD[1] + 1, (batch,), generator=gen).tolist()
        cases = {"same length": [round(sum(drawn) / batch)] * batch, "spread": drawn,
                 "spread, longest first": sorted(drawn, reverse=True)}
        for name in args.kv_dtypes:
            kv_dtype = DTYPES[name]
            variants = FP8_VARIANTS if kv_dtype.itemsize == 1 else {"engine": {}}
            for variant, kwargs in variants.items():
                for case, lens in cases.items():
                    us, splits = launch_us(kv_dtype, lens, kwargs)
                    results["spread"][f"{name} {batch} {variant} | {case}"] = us
                    print(f"{name} batch {batch:4d} {variant:9s} {case:22s} {splits:2d} splits: {us:8.2f} us "
                          f"({tbps(kv_dtype, sum(lens), us):.2f} TB/s)", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta.run_meta("python -m bench decode-shapes", given, gpu=True),
                                         **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

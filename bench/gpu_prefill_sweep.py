"""The Triton prefill attention kernel's launch parameters at the offline workload's prefill steps (GPU).

    python -m bench prefill-sweep [--kv-dtype fp8_e4m3] [--step-tokens 16384] [--json out.json]

The upstream offline workload's 142,827 prompt tokens are cut into prefill steps of ``--step-tokens`` as the
scheduler cuts them (requests in order, the last one of a step chunked, its rest first in the next step after its
cached prefix), each request's KV in one run of slots (a fresh request's allocation). For every launch (query rows
per program, key block, warps, stages) one layer's prefill attention of every step is timed; the table gives its
sum (ms per layer for the whole workload), the same x 28 layers (the run's prefill attention, s) and the causal
work's rate (TFLOP/s). The engine's launch is always measured, and its output checked against the PyTorch
reference on the first step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from . import meta
from .workloads import offline_upstream

HQ, HKV, D, LAYERS = 16, 8, 128, 28


def prefill_steps(prompt_lens: list[int], step_tokens: int) -> list[list[tuple[int, int, int]]]:
    """Steps of (request, cached prefix, extend) chunks of at most ``step_tokens`` tokens, requests in order."""
    steps, current, room = [], [], step_tokens
    for i, length in enumerate(prompt_lens):
        done = 0
        while done < length:
            take = min(length - done, room)
            current.append((i, done, take))
            done += take
            room -= take
            if room == 0:
                steps.append(current)
                current, room = [], step_tokens
    if current:
        steps.append(current)
    return steps


def main(argv: list[str] | None = None) -> None:
    from stage4_fast.kernel import triton_attention as ta
    from stage4_fast.kernel.ref import paged_attention_ref

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-dtype", default="bfloat16", choices=["bfloat16", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--step-tokens", type=int, default=16384)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    given = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(given)
    kv_dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[
        args.kv_dtype]
    dev, dtype = "cuda", torch.bfloat16
    prompt_lens = [len(p) for p in offline_upstream().prompts]
    starts = [sum(prompt_lens[:i]) for i in range(len(prompt_lens))]
    gen = torch.Generator(device=dev).manual_seed(0)
    k_cache = torch.randn(sum(prompt_lens), HKV, D, device=dev, generator=gen).to(dtype).to(kv_dtype)
    v_cache = torch.randn(sum(prompt_lens), HKV, D, device=dev, generator=gen).to(dtype).to(kv_dtype)
    width = max(prompt_lens)
    page_table = torch.zeros(len(prompt_lens), width, dtype=torch.int32, device=dev)
    for i, (start, length) in enumerate(zip(starts, prompt_lens)):
        page_table[i, :length] = torch.arange(start, start + length, dtype=torch.int32, device=dev)
    steps = []
    flops = 0.0
    for chunks in prefill_steps(prompt_lens, args.step_tokens):
        extend = [e for _, _, e in chunks]
        lens = [p + e for _, p, e in chunks]
        flops += sum(4 * HQ * D * (e * p + e * (e + 1) / 2) for _, p, e in chunks)  # QK^T and PV, causal
        cu = torch.tensor([0] + extend, dtype=torch.int32).cumsum(0).to(torch.int32)
        steps.append(dict(
            q=torch.randn(int(cu[-1]), HQ, D, device=dev, generator=gen).to(dtype),
            table_idx=torch.tensor([i for i, _, _ in chunks], dtype=torch.int32, device=dev),
            cu=cu.to(dev), lens=torch.tensor(lens, dtype=torch.int32, device=dev), max_q=max(extend)))

    def run(step: dict, launch) -> torch.Tensor:
        return ta.prefill_attention(step["q"], k_cache, v_cache, page_table, step["table_idx"], step["cu"],
                                    step["lens"], step["max_q"], D**-0.5, launch=launch)

    def time_ms(launch) -> float:
        for step in steps:
            run(step, launch)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.reps):
            for step in steps:
                run(step, launch)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / args.reps

    engine = ta.prefill_launch(dtype)
    first = steps[0]
    ref = paged_attention_ref(first["q"], k_cache, v_cache, page_table, first["table_idx"], first["cu"],
                              first["lens"], D**-0.5)
    err = (run(first, engine).float() - ref.float()).abs().max().item()
    print(f"{len(steps)} prefill steps of <= {args.step_tokens} tokens, KV {args.kv_dtype}; engine launch "
          f"(rows, key block, warps, stages) {engine}: max |out - reference| on step 1 = {err:.3g}", flush=True)
    configs = list(itertools.product(args.rows, args.blocks, args.warps, args.stages))
    if engine not in configs:
        configs.append(engine)
    results = []
    for launch in configs:
        try:
            ms = time_ms(launch)
        except Exception as e:  # a tile that does not fit shared memory, etc.
            results.append({"launch": launch, "error": f"{type(e).__name__}: {str(e)[:120]}"})
            continue
        results.append({"launch": launch, "ms_per_layer": ms, "run_s": ms * LAYERS / 1e3,
                        "tflops": flops / (ms / 1e3) / 1e12})
    timed = sorted((r for r in results if "ms_per_layer" in r), key=lambda r: r["ms_per_layer"])
    print("rows  block  warps  stages   ms/layer  x28 layers (s)  TFLOP/s")
    for r in timed:
        mark = "  <- engine" if tuple(r["launch"]) == tuple(engine) else ""
        print(f"{r['launch'][0]:4d}  {r['launch'][1]:5d}  {r['launch'][2]:5d}  {r['launch'][3]:6d}   "
              f"{r['ms_per_layer']:8.3f}  {r['run_s']:14.3f}  {r['tflops']:7.1f}{mark}")
    failed = [r for r in results if "error" in r]
    if failed:
        print(f"{len(failed)} launches failed, e.g. {failed[0]['launch']}: {failed[0]['error']}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta.run_meta("python -m bench prefill-sweep", given,
                                                               gpu=True),
                                         "max_abs_err_engine_step1": err, "results": results}, indent=1))


if __name__ == "__main__":
    main()

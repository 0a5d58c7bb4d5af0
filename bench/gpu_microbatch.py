"""A decode step as two micro-batches on two CUDA streams (GPU): whether one half's latency-bound GEMMs can run
beside the other half's bandwidth-bound attention.

    python -m bench microbatch [--rows 64 128 224] [--kv-dtype fp8_e4m3] [--json out.json]

A decode step of the Qwen3-0.6B shape spends ~0.9 ms in 113 GEMMs that use a fraction of the SMs each (~6 us for
4-12 MB of weights) and ~2.5 ms in an attention that streams the KV cache (`bench/gpu_notes.md` sections 12-13).
The step here is the engine's kernels on random weights and a random KV pool (every request ``--kv-len`` tokens):
28 layers of add-RMSNorm, the qkv GEMM, the decode attention (the engine's kernel for the pool dtype), the o GEMM,
add-RMSNorm, the gate-up GEMM, SiLU-and-mul and the down GEMM, then the LM head and the argmax; captured in one
CUDA graph, timed per step (ms) three ways:

* ``one``: the whole batch on one stream (what the engine does);
* ``halves``: two half batches one after the other on one stream (what splitting costs by itself: each GEMM
  reads its weights twice);
* ``overlap``: the two halves on two streams, forked and joined inside the graph, so the GPU may run one half's
  GEMMs beside the other's attention.

The halves give the same tokens as the whole batch where cuBLAS picks the same reduction order (checked).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F

from . import meta
from .gpu_gemv_sweep import capture_graph, replay_ms

HIDDEN, INTER, HQ, HKV, D, LAYERS, VOCAB = 1024, 3072, 16, 8, 128, 28, 151936


class DecodeStep:
    def __init__(self, rows: int, kv_len: int, kv_dtype: torch.dtype, dev: str = "cuda"):
        from stage4_fast.kernel import triton_attention, triton_fused

        self.ta, self.fused = triton_attention, triton_fused
        g = torch.Generator(device=dev).manual_seed(0)
        dtype = torch.bfloat16

        def rand(*shape, scale=0.02):
            return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

        self.rows = rows
        self.w_qkv = [rand((HQ + 2 * HKV) * D, HIDDEN) for _ in range(LAYERS)]
        self.w_o = [rand(HIDDEN, HQ * D) for _ in range(LAYERS)]
        self.w_gu = [rand(2 * INTER, HIDDEN) for _ in range(LAYERS)]
        self.w_down = [rand(HIDDEN, INTER) for _ in range(LAYERS)]
        self.lm_head = rand(VOCAB, HIDDEN)
        self.norm_w = torch.ones(HIDDEN, device=dev, dtype=dtype)
        slots = rows * kv_len
        self.k_cache = [rand(slots, HKV, D, scale=1.0).to(kv_dtype) for _ in range(LAYERS)]
        self.v_cache = [rand(slots, HKV, D, scale=1.0).to(kv_dtype) for _ in range(LAYERS)]
        # the engine's layout at a large batch: prompts contiguous, decode tokens interleaved; here one run each
        self.page_table = torch.arange(slots, device=dev, dtype=torch.int32).view(rows, kv_len)
        self.table_idx = torch.arange(rows, device=dev, dtype=torch.int32)
        self.seq_lens = torch.full((rows,), kv_len, device=dev, dtype=torch.int32)
        self.x0 = rand(rows, HIDDEN, scale=1.0)
        self.res0 = rand(rows, HIDDEN, scale=1.0)

    def _splits(self, rows: int) -> int:
        cuda = self.ta.cuda_fp8_decode_applies(torch.bfloat16, self.k_cache[0].dtype, D, HQ // HKV,
                                                   self.k_cache[0].device)
        return self.ta.decode_num_splits(rows, HKV, 16, cuda_fp8=cuda)

    def forward(self, r0: int, r1: int, out_tokens: torch.Tensor) -> None:
        """Rows [r0, r1) through the step; their argmax tokens into out_tokens[r0:r1]."""
        rows = r1 - r0
        x, res = self.x0[r0:r1].clone(), self.res0[r0:r1].clone()
        splits = self._splits(rows)
        mid_o = torch.empty(rows, HQ, 16, D, device=x.device, dtype=torch.float32)
        mid_lse = torch.empty(rows, HQ, 16, device=x.device, dtype=torch.float32)
        for i in range(LAYERS):
            h = self.fused.add_rmsnorm(x, res, self.norm_w, 1e-6)
            qkv = F.linear(h, self.w_qkv[i])
            q = qkv[:, : HQ * D].view(rows, HQ, D)
            attn = self.ta.decode_attention(q, self.k_cache[i], self.v_cache[i], self.page_table,
                                            self.table_idx[r0:r1], self.seq_lens[r0:r1], D**-0.5, splits,
                                            mid_o=mid_o, mid_lse=mid_lse)
            o = F.linear(attn.view(rows, HQ * D), self.w_o[i])
            h = self.fused.add_rmsnorm(o, res, self.norm_w, 1e-6)
            x = F.linear(self.fused.silu_and_mul(F.linear(h, self.w_gu[i])), self.w_down[i])
        h = self.fused.add_rmsnorm(x, res, self.norm_w, 1e-6)
        out_tokens[r0:r1] = F.linear(h, self.lm_head).argmax(-1).to(torch.int32)


def capture(step: DecodeStep, mode: str, out: torch.Tensor) -> torch.cuda.CUDAGraph:
    half = step.rows // 2
    side = torch.cuda.Stream()

    def run():
        if mode == "one":
            step.forward(0, step.rows, out)
        elif mode == "halves":
            step.forward(0, half, out)
            step.forward(half, step.rows, out)
        else:  # overlap: the second half on a side stream, forked from and joined back to the capturing stream
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                step.forward(half, step.rows, out)
            step.forward(0, half, out)
            main.wait_stream(side)

    return capture_graph(run)


MODES = ("one", "halves", "overlap")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 224])
    ap.add_argument("--kv-len", type=int, default=760, help="KV tokens per request (step 200 of the workload: ~770)")
    ap.add_argument("--kv-dtype", default="fp8_e4m3", choices=["bfloat16", "fp8_e4m3"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    given = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(given)
    kv_dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[args.kv_dtype]
    results: Dict[str, dict] = {}
    for rows in args.rows:
        step = DecodeStep(rows, args.kv_len, kv_dtype)
        outs = {m: torch.zeros(rows, dtype=torch.int32, device="cuda") for m in MODES}
        graphs = {m: capture(step, m, outs[m]) for m in MODES}
        times: Dict[str, List[float]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for m in MODES:
                times[m].append(replay_ms(graphs[m], replays=10))
        agree = {m: float((outs[m] == outs["one"]).float().mean().item()) for m in MODES}
        best = {m: min(t) for m, t in times.items()}
        results[str(rows)] = {"ms_per_step": best, "all_rounds": times, "token_agreement_with_one": agree}
        print(f"rows {rows:4d}, {args.kv_len} KV tokens each ({args.kv_dtype}): ms per step  "
              + "  ".join(f"{m} {best[m]:.3f}" for m in MODES)
              + f"   (overlap / one {best['overlap'] / best['one']:.3f}; tokens equal to one's: {agree})", flush=True)
        del graphs, step
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"meta": meta.run_meta("python -m bench microbatch", given, gpu=True),
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()

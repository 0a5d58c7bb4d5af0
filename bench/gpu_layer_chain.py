"""A decode layer's chain of kernels at decode batch sizes, without the attention's arithmetic (GPU): what two
Hopper features would save on the fixed part of a decode step, before the engine is changed for them.

    python -m bench layer-chain [--rows 64 128 224] [--json out.json]

A decode step's fixed cost (~1.4 ms at the Qwen3-0.6B shape, `bench/gpu_notes.md` section 13) is mostly its 112
GEMMs, each latency-bound: ~6 us for 4-12 MB of weights that DRAM delivers in ~2. The chain here is 28 layers of
add-RMSNorm -> qkv GEMM -> a stand-in for the attention (a kernel that streams 64 MB, so that the L2 holds nothing
of the layer's weights, and writes the attention's output) -> o GEMM -> add-RMSNorm -> gate-up GEMM -> SiLU-and-mul
-> down GEMM, captured in one CUDA graph, timed per layer (us) in four variants:

* ``plain``: the kernels as the engine launches them;
* ``prefetch``: each of our kernels that precedes a GEMM first asks the L2 for that GEMM's weights (``prefetch.
  global.L2``, spread over its programs), so that the GEMM's first loads find them in flight or in the L2;
* ``pdl``: our kernels are launched with programmatic dependent launch (the launch overlaps the previous kernel's
  tail; each program waits for the previous kernel's memory with ``griddepcontrol.wait`` before reading it);
* ``both``: the prefetch is issued before that wait, so it overlaps the previous kernel too.

The GEMMs stay cuBLAS's (``bench gemm-sweep``: no Triton GEMM beats it one by one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Dict

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import meta
from .gpu_gemv_sweep import LAYERS, capture_graph, replay_ms

HIDDEN, INTER, QKV, ATTN_OUT = 1024, 3072, 4096, 2048
SCRUB_BYTES = 64 << 20  # more than the H200's 50 MB L2: the stand-in attention leaves nothing of the weights there


@triton.jit
def _prefetch_slice(P, total, pid, programs, LINES: tl.constexpr):
    """Program ``pid`` of ``programs`` asks the L2 for its share of the ``total`` bf16 elements at P, one
    ``prefetch`` per 128-byte line (64 elements)."""
    per_program = tl.cdiv(tl.cdiv(total, 64), programs) * 64
    start = pid * per_program
    for off in range(0, per_program, LINES * 64):
        offs = start + off + tl.arange(0, LINES) * 64
        offs = tl.minimum(offs, total - 1)  # past the end: the last line again (harmless)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [P + offs], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _norm_kernel(X, R, W, Out, P, p_total, N, eps, PREFETCH: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if PREFETCH:
        _prefetch_slice(P, p_total, tl.program_id(0), tl.num_programs(0), LINES=128)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(X + row * N + offs, mask=mask, other=0.0)
    r = tl.load(R + row * N + offs, mask=mask, other=0.0)
    x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    tl.store(R + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)).to(x.dtype)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Out + row * N + offs, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _silu_kernel(X, Out, P, p_total, N, PREFETCH: tl.constexpr, PDL: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    if PREFETCH:
        _prefetch_slice(P, p_total, tl.program_id(0) * tl.num_programs(1) + tl.program_id(1),
                        tl.num_programs(0) * tl.num_programs(1), LINES=128)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(X + t * 2 * N + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + t * 2 * N + N + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + t * N + offs, (g / (1.0 + tl.exp(-g)) * u).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _scrub_kernel(S, Q, Out, s_per_program, P, p_total, M, PREFETCH: tl.constexpr, PDL: tl.constexpr,
                  BLOCK: tl.constexpr):
    """The attention's stand-in: streams its share of S (evicting the L2), then writes Out [M, 2048] from q."""
    pid = tl.program_id(0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    base = pid.to(tl.int64) * s_per_program
    for off in range(0, s_per_program, BLOCK):
        acc += tl.load(S + base + off + tl.arange(0, BLOCK)).to(tl.float32)
    if PREFETCH:  # at the end, as an attention kernel would: the KV stream would evict it otherwise
        _prefetch_slice(P, p_total, pid, tl.num_programs(0), LINES=128)
    offs = tl.arange(0, BLOCK)
    for row in range(pid, M, tl.num_programs(0)):
        q = tl.load(Q + row * 4096 + offs).to(tl.float32)
        tl.store(Out + row * 2048 + offs, (q + tl.sum(acc, axis=0) * 0.0).to(Out.dtype.element_ty))
        tl.store(Out + row * 2048 + 1024 + offs, q.to(Out.dtype.element_ty))


class Chain:
    """28 layers' weights and the activations of one decode batch of ``rows``."""

    def __init__(self, rows: int, dev: str = "cuda", dtype: torch.dtype = torch.bfloat16):
        g = torch.Generator(device=dev).manual_seed(0)

        def rand(*shape):
            return (torch.randn(*shape, device=dev, generator=g) * 0.02).to(dtype)

        self.rows = rows
        self.w_qkv = [rand(QKV, HIDDEN) for _ in range(LAYERS)]
        self.w_o = [rand(HIDDEN, ATTN_OUT) for _ in range(LAYERS)]
        self.w_gu = [rand(2 * INTER, HIDDEN) for _ in range(LAYERS)]
        self.w_down = [rand(HIDDEN, INTER) for _ in range(LAYERS)]
        self.norm_w = torch.ones(HIDDEN, device=dev, dtype=dtype)
        self.x = rand(rows, HIDDEN)
        self.residual = rand(rows, HIDDEN)
        self.scrub = torch.zeros(SCRUB_BYTES // 2, device=dev, dtype=dtype)
        self.h = torch.empty(rows, HIDDEN, device=dev, dtype=dtype)
        self.attn = torch.empty(rows, ATTN_OUT, device=dev, dtype=dtype)
        self.act = torch.empty(rows, INTER, device=dev, dtype=dtype)
        self.qkv_stand_in = rand(rows, QKV)

    def layer(self, i: int, prefetch: bool, pdl: bool) -> None:
        rows, launch = self.rows, {"launch_pdl": True} if pdl else {}
        _norm_kernel[(rows,)](self.x, self.residual, self.norm_w, self.h, self.w_qkv[i], self.w_qkv[i].numel(),
                              HIDDEN, 1e-6, PREFETCH=prefetch, PDL=pdl, BLOCK=HIDDEN, num_warps=4, **launch)
        qkv = F.linear(self.h, self.w_qkv[i])
        programs = 132 * 2
        _scrub_kernel[(programs,)](self.scrub, qkv, self.attn, self.scrub.numel() // programs // 1024 * 1024,
                                   self.w_o[i], self.w_o[i].numel(), rows, PREFETCH=prefetch, PDL=pdl, BLOCK=1024,
                                   num_warps=4, **launch)
        o = F.linear(self.attn, self.w_o[i])
        _norm_kernel[(rows,)](o, self.residual, self.norm_w, self.h, self.w_gu[i], self.w_gu[i].numel(), HIDDEN,
                              1e-6, PREFETCH=prefetch, PDL=pdl, BLOCK=HIDDEN, num_warps=4, **launch)
        gu = F.linear(self.h, self.w_gu[i])
        block = 1024
        _silu_kernel[(rows, triton.cdiv(INTER, block))](gu, self.act, self.w_down[i], self.w_down[i].numel(),
                                                         INTER, PREFETCH=prefetch, PDL=pdl, BLOCK=block,
                                                         num_warps=4, **launch)
        self.x = F.linear(self.act, self.w_down[i])

    def step(self, prefetch: bool, pdl: bool) -> None:
        for i in range(LAYERS):
            self.layer(i, prefetch, pdl)


def graph_layer_us(run: Callable[[], None], replays: int = 20) -> float:
    """Device time per layer of ``run`` (the 28 layers) captured in one CUDA graph."""
    return replay_ms(capture_graph(run), replays) * 1e3 / LAYERS


def scrub_only_us(chain: Chain) -> float:
    """The stand-in attention alone (its share of each layer's time, subtracted in the report)."""
    programs = 132 * 2

    def run():
        for i in range(LAYERS):
            _scrub_kernel[(programs,)](chain.scrub, chain.qkv_stand_in, chain.attn,
                                       chain.scrub.numel() // programs // 1024 * 1024, chain.w_o[i], 1, chain.rows,
                                       PREFETCH=False, PDL=False, BLOCK=1024, num_warps=4)
    return graph_layer_us(run)


VARIANTS = {"plain": (False, False), "prefetch": (True, False), "pdl": (False, True), "both": (True, True)}


def same_result(chain: Chain) -> Dict[str, bool]:
    """Each variant's output of one eager step from the same inputs, against plain's (bit for bit: the same
    arithmetic; a PDL kernel that read before its wait would show here)."""
    x0, r0, outputs = chain.x.clone(), chain.residual.clone(), {}
    for name, (prefetch, pdl) in VARIANTS.items():
        chain.x, chain.residual = x0.clone(), r0.clone()
        chain.step(prefetch, pdl)
        outputs[name] = torch.cat([chain.x, chain.residual])
    chain.x, chain.residual = x0, r0
    return {name: bool(torch.equal(out, outputs["plain"])) for name, out in outputs.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 224])
    ap.add_argument("--rounds", type=int, default=3, help="each variant timed this many times, interleaved")
    ap.add_argument("--json", type=Path, default=None)
    given = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(given)
    results: Dict[str, dict] = {}
    for rows in args.rows:
        chain = Chain(rows)
        same = same_result(chain)
        times: Dict[str, list] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, (prefetch, pdl) in VARIANTS.items():
                times[name].append(graph_layer_us(lambda c=chain, p=prefetch, d=pdl: c.step(p, d)))
        scrub = scrub_only_us(chain)
        results[str(rows)] = {"us_per_layer": {name: min(t) for name, t in times.items()}, "all_rounds": times,
                              "stand_in_attention_us": scrub, "same_result_as_plain": same}
        line = "  ".join(f"{name} {min(t):6.2f}" for name, t in times.items())
        print(f"rows {rows:4d}: us per layer  {line}   (stand-in attention alone {scrub:.2f}; "
              f"bit-equal outputs {same})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta.run_meta("python -m bench layer-chain", given, gpu=True),
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()

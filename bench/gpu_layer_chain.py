"""A decode layer's chain of kernels at decode batch sizes, without the attention's arithmetic (GPU): what two
Hopper features would save on the fixed part of a decode step, before the engine is changed for them.

    python -m bench layer-chain [--rows 64 128 224] [--variants plain pdl ...] [--json out.json]

A decode step's fixed cost (~1.4 ms at the Qwen3-0.6B shape, `bench/gpu_notes.md` section 13) is mostly its 112
GEMMs, each latency-bound: ~6 us for 4-12 MB of weights that DRAM delivers in ~2. The chain here is 28 layers of
add-RMSNorm -> qkv GEMM -> a stand-in for the attention (a kernel that streams 64 MB, so that the L2 holds nothing
of the layer's weights, and writes the attention's output) -> o GEMM -> add-RMSNorm -> gate-up GEMM -> SiLU-and-mul
-> down GEMM, captured in one CUDA graph, timed per layer (us) in these variants:

* ``plain``: the kernels as the engine launches them;
* ``prefetch``: each of our kernels that precedes a GEMM first asks the L2 for that GEMM's weights (``prefetch.
  global.L2``, spread over its programs), so that the GEMM's first loads find them in flight or in the L2;
* ``pdl``: our kernels are launched with programmatic dependent launch (the launch overlaps the previous kernel's
  tail; each program waits for the previous kernel's memory with ``griddepcontrol.wait`` before reading it);
* ``both``: the prefetch is issued before that wait, so it overlaps the previous kernel too;
* ``triton-TILES[-pdl[-own]]``: the four GEMMs as a Triton GEMM with the tiles ``TILES`` of ``TRITON_TILES``, which
  cuBLAS's kernels cannot be: launched with PDL too (``-pdl``, so that every boundary of the layer overlaps), and
  asking the L2 for their own weights before their wait (``-own``: the weights depend on no earlier kernel);
* ``cutlass-CONFIG[-pdl]`` (asked for by name only: they build a CUDA extension first): the four GEMMs as a CUTLASS
  sm90 GEMM built to wait for the kernel before it (``bench/csrc/cutlass_gemm.cu``; CUTLASS's headers from the
  flashinfer-python wheel), so that with ``-pdl`` every boundary, into the GEMMs too, is a programmatic one.

Each variant's output is checked bit for bit against the one with the same GEMMs and neither prefetch nor PDL. On the
H200 none beat ``plain`` by more than ``pdl``'s 2 us per layer at 224 rows (bench/results/h200-layer-chain-triton.md).
"""

from __future__ import annotations

import argparse
import functools
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


@triton.jit
def _gemm_kernel(X, W, Y, M, N, K, PREFETCH_OWN: tl.constexpr, PDL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y [M, N] = X [M, K] @ W [N, K].T for a decode batch; with PREFETCH_OWN the program first asks the L2 for its
    slice of W (which depends on no earlier kernel), and only then waits for the previous kernel's output (PDL), so
    that under programmatic dependent launch the weights stream in while the previous kernel finishes."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PREFETCH_OWN:
        _prefetch_slice(W + pid_n.to(tl.int64) * BLOCK_N * K, BLOCK_N * K, pid_m, tl.num_programs(1), LINES=64)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# (block_m, block_n, block_k, warps, stages) per projection; "sweep" is bench gemm-sweep's best one-split launch
TRITON_TILES = {
    "sweep": {64: {"qkv": (64, 32, 128, 4, 4), "o": (64, 32, 128, 4, 4), "gu": (64, 64, 128, 4, 4),
                   "down": (64, 32, 128, 4, 4)},
              128: {"qkv": (64, 64, 128, 4, 4), "o": (64, 32, 128, 4, 4), "gu": (128, 64, 128, 8, 4),
                    "down": (64, 32, 128, 4, 4)},
              224: {"qkv": (64, 128, 128, 4, 3), "o": (64, 32, 128, 4, 4), "gu": (128, 128, 64, 8, 4),
                    "down": (64, 32, 128, 4, 4)}},
    "narrow": {rows: dict.fromkeys(("qkv", "o", "gu", "down"), (64, 32, 128, 4, 4)) for rows in (64, 128, 224)},
    "n64": {rows: dict.fromkeys(("qkv", "o", "gu", "down"), (64, 64, 128, 4, 4)) for rows in (64, 128, 224)},
}


def triton_linear(x: torch.Tensor, w: torch.Tensor, tile: tuple, prefetch_own: bool, pdl: bool) -> torch.Tensor:
    block_m, block_n, block_k, warps, stages = tile
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _gemm_kernel[grid](x, w, y, m, n, k, PREFETCH_OWN=prefetch_own, PDL=pdl, BLOCK_M=block_m, BLOCK_N=block_n,
                       BLOCK_K=block_k, num_warps=warps, num_stages=stages, **({"launch_pdl": True} if pdl else {}))
    return y


CUTLASS_SOURCES = [Path(__file__).resolve().parent / "csrc" / name
                   for name in ("cutlass_gemm_binding.cpp", "cutlass_gemm.cu")]
CUTLASS_CONFIGS = ("64x64-basic", "64x128-pingpong", "128x128-cooperative")
CUTLASS_WORKSPACE_BYTES = 1 << 20


@functools.cache
def load_cutlass():
    """The CUTLASS GEMM extension, built for sm_90a with the headers flashinfer-python's wheel carries."""
    import importlib.util
    import os

    from torch.utils.cpp_extension import load

    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        raise SystemExit("the cutlass-* variants need flashinfer-python: its wheel carries CUTLASS's headers")
    include = Path(spec.origin).parent / "data" / "cutlass" / "include"
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"  # wgmma and TMA: the sm_90a target, not plain sm_90
    try:
        return load(name="bench_cutlass_gemm", sources=[str(path) for path in CUTLASS_SOURCES],
                    extra_include_paths=[str(include)], extra_cflags=["-O3", "-std=c++17"],
                    # NDEBUG: a device assert is a function call, across which ptxas serializes the wgmma pipeline
                    # (its warning C7510)
                    extra_cuda_cflags=["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-DNDEBUG",
                                       "-DCUTLASS_ENABLE_GDC_FOR_SM90"], verbose=False)
    finally:
        if arch is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST")
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch


def cutlass_linear(x: torch.Tensor, w: torch.Tensor, config: str, pdl: bool, workspace: torch.Tensor) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
    load_cutlass().cutlass_linear(x, w, y, workspace, config, pdl)
    return y


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
        self.tiles: dict | None = None  # None: cuBLAS (or CUTLASS); else the Triton GEMM's tile per projection
        self.cutlass: str | None = None  # a CUTLASS_CONFIGS name: that GEMM instead of cuBLAS's
        self.cutlass_workspace = torch.empty(CUTLASS_WORKSPACE_BYTES, device=dev, dtype=torch.uint8)
        self.gemm_prefetch = False

    def linear(self, x: torch.Tensor, w: torch.Tensor, name: str, pdl: bool) -> torch.Tensor:
        if self.cutlass is not None:
            return cutlass_linear(x, w, self.cutlass, pdl, self.cutlass_workspace)
        if self.tiles is None:
            return F.linear(x, w)
        return triton_linear(x, w, self.tiles[name], self.gemm_prefetch, pdl)

    def layer(self, i: int, prefetch: bool, pdl: bool) -> None:
        rows, launch = self.rows, {"launch_pdl": True} if pdl else {}
        _norm_kernel[(rows,)](self.x, self.residual, self.norm_w, self.h, self.w_qkv[i], self.w_qkv[i].numel(),
                              HIDDEN, 1e-6, PREFETCH=prefetch, PDL=pdl, BLOCK=HIDDEN, num_warps=4, **launch)
        qkv = self.linear(self.h, self.w_qkv[i], "qkv", pdl)
        programs = 132 * 2
        _scrub_kernel[(programs,)](self.scrub, qkv, self.attn, self.scrub.numel() // programs // 1024 * 1024,
                                   self.w_o[i], self.w_o[i].numel(), rows, PREFETCH=prefetch, PDL=pdl, BLOCK=1024,
                                   num_warps=4, **launch)
        o = self.linear(self.attn, self.w_o[i], "o", pdl)
        _norm_kernel[(rows,)](o, self.residual, self.norm_w, self.h, self.w_gu[i], self.w_gu[i].numel(), HIDDEN,
                              1e-6, PREFETCH=prefetch, PDL=pdl, BLOCK=HIDDEN, num_warps=4, **launch)
        gu = self.linear(self.h, self.w_gu[i], "gu", pdl)
        block = 1024
        _silu_kernel[(rows, triton.cdiv(INTER, block))](gu, self.act, self.w_down[i], self.w_down[i].numel(),
                                                         INTER, PREFETCH=prefetch, PDL=pdl, BLOCK=block,
                                                         num_warps=4, **launch)
        self.x = self.linear(self.act, self.w_down[i], "down", pdl)

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


# name -> (Triton tiles or None for cuBLAS, GEMM prefetches its own weights, kernels prefetch the next GEMM's, PDL)
VARIANTS = {"plain": (None, False, False, False), "prefetch": (None, False, True, False),
            "pdl": (None, False, False, True), "both": (None, False, True, True)}
for _tiles in TRITON_TILES:
    VARIANTS[f"triton-{_tiles}"] = (_tiles, False, False, False)
    VARIANTS[f"triton-{_tiles}-pdl"] = (_tiles, False, False, True)
    VARIANTS[f"triton-{_tiles}-pdl-own"] = (_tiles, True, False, True)


for _config in CUTLASS_CONFIGS:
    VARIANTS[f"cutlass-{_config}"] = (f"cutlass:{_config}", False, False, False)
    VARIANTS[f"cutlass-{_config}-pdl"] = (f"cutlass:{_config}", False, False, True)
DEFAULT_VARIANTS = [name for name in VARIANTS if not name.startswith("cutlass")]


def set_variant(chain: Chain, name: str) -> tuple[bool, bool]:
    """Configures ``chain``'s GEMMs for variant ``name``; returns its (prefetch, pdl) step arguments."""
    tiles, own, prefetch, pdl = VARIANTS[name]
    chain.cutlass = tiles.split(":", 1)[1] if tiles is not None and tiles.startswith("cutlass:") else None
    chain.tiles = None if tiles is None or chain.cutlass is not None else TRITON_TILES[tiles][chain.rows]
    chain.gemm_prefetch = own
    return prefetch, pdl


def reference_of(name: str) -> str:
    """The variant with the same GEMMs and neither prefetch nor PDL: the same arithmetic."""
    tiles = VARIANTS[name][0]
    if tiles is None:
        return "plain"
    return f"cutlass-{tiles.split(':', 1)[1]}" if tiles.startswith("cutlass:") else f"triton-{tiles}"


def same_result(chain: Chain, names: list[str]) -> Dict[str, bool]:
    """Each variant's output of one eager step from the same inputs, against its reference's (bit for bit: the
    same arithmetic; a PDL kernel that read before its wait would show here)."""
    x0, r0, outputs = chain.x.clone(), chain.residual.clone(), {}
    for name in names:
        chain.x, chain.residual = x0.clone(), r0.clone()
        chain.step(*set_variant(chain, name))
        outputs[name] = torch.cat([chain.x, chain.residual])
    chain.x, chain.residual = x0, r0
    return {name: bool(torch.equal(out, outputs[reference_of(name)])) for name, out in outputs.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 128, 224])
    ap.add_argument("--rounds", type=int, default=3, help="each variant timed this many times, interleaved")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                    help="default: all but the cutlass-* ones")
    ap.add_argument("--json", type=Path, default=None)
    given = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(given)
    results: Dict[str, dict] = {}
    for rows in args.rows:
        chain = Chain(rows)
        names = sorted(set(args.variants) | {reference_of(n) for n in args.variants}, key=list(VARIANTS).index)
        same = same_result(chain, names)
        times: Dict[str, list] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                prefetch, pdl = set_variant(chain, name)
                times[name].append(graph_layer_us(lambda c=chain, p=prefetch, d=pdl: c.step(p, d)))
        scrub = scrub_only_us(chain)
        results[str(rows)] = {"us_per_layer": {name: min(t) for name, t in times.items()}, "all_rounds": times,
                              "stand_in_attention_us": scrub, "same_result_as_reference": same}
        line = "\n  ".join(f"{name:26s} {min(t):6.2f}" for name, t in times.items())
        print(f"rows {rows:4d}: us per layer (stand-in attention alone {scrub:.2f}; bit-equal to the reference "
              f"{same})\n  {line}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta.run_meta("python -m bench layer-chain", given, gpu=True),
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()

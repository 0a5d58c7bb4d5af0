"""Which of cuBLAS's GEMM kernels wait for the kernel before them (GPU): could a decode graph's edges *into* its
GEMMs be programmatic?

    python -m bench gemm-waits [--rows 1 2 4 8 16 ...] [--json out.json]

The decode graphs move the edges *out of* cuBLAS's GEMMs to launch order (``stage4_fast/kernel/pdl_graph.py``);
the edges into them stay as captured, because a GEMM launched early is correct only if it executes
``griddepcontrol.wait`` before it reads its input, and cuBLAS does not say whether its kernels do. This asks each
kernel: a Triton kernel launched with PDL lets its dependents launch at once, spins ~0.2 ms, then writes the GEMM's
input, which starts as zeros; the edge from it into the GEMM is made programmatic and the graph replayed. A GEMM
that waits gives the same bits as the graph left as captured; one that does not reads zeros. The control, torch's
elementwise kernel in the GEMM's place, must read the zeros (else the probe proves nothing).

A GEMM that reads zeros does not wait; the same bits are necessary, not sufficient (a GEMM whose programs could
not start before the copy ended would pass too). At the Qwen3-0.6B shape on an H200 with cuBLAS 13
(bench/results/h200-gemm-waits.md) every kernel of a decode layer's four GEMMs read the zeros at every batch size:
the edges into them stay as captured. The LM head's GEMM follows a cuBLAS workspace memset, not the copy: not asked.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import sys
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stage4_fast.kernel import pdl_graph
from stage4_fast.kernel.pdl import pdl_launch, pdl_wait

from . import meta

# (name, N, K) of the Qwen3-0.6B shape's decode GEMMs
SHAPES = [("qkv", 4096, 1024), ("o", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
          ("lm_head", 151936, 1024)]
DEPENDENCY_DEFAULT = 0  # cuda.h: CU_GRAPH_DEPENDENCY_TYPE_DEFAULT, a plain edge
SPINS = 100_000  # ~0.2 ms of dependent multiply-adds before the write


@triton.jit
def _late_copy(src, dst, n, spins, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)  # its dependents may launch from here on
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    t = tl.zeros([BLOCK], tl.float32)
    for _ in range(spins):
        t = t * 0.999 + 1.0
    value = tl.load(src + offs, mask=offs < n)
    tl.store(dst + offs, tl.where(t < 1e30, value, 0.0), mask=offs < n)  # never 0: the loop must run


class _KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _cuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")  # the node queries below; pdl_graph reads and rewires the edges


def _kernel_name(node: int) -> str:
    lib = _cuda()
    kind, params, name = ctypes.c_int(-1), _KernelNodeParams(), ctypes.c_char_p()
    if lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) != 0 or kind.value != 0:  # not a kernel
        return ""
    if lib.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)) != 0:
        return "?"
    if params.func:
        lib.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func))
    else:
        lib.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern))
    return (name.value or b"?").decode(errors="replace")


def _edges_out_of_first_kernel_made_programmatic(graph: torch.cuda.CUDAGraph) -> List[str]:
    """Make every plain edge out of the graph's source kernel (the late copy) into a kernel programmatic; returns
    the names of the kernels at their ends."""
    edges = pdl_graph.graph_edges(graph)
    assert edges is not None, "the CUDA driver has no graph edge functions (CUDA 12.3 or later needed)"
    has_input = {e.dst for e in edges}
    first = next(e.src for e in edges if e.src not in has_input)
    # into kernels only: a programmatic edge into another node (cuBLAS's workspace memset) is refused
    chosen = [e for e in edges if e.src == first and e.kind == DEPENDENCY_DEFAULT and _kernel_name(e.dst)]
    if chosen:
        assert pdl_graph.replace_edges(graph, chosen, pdl_graph.PORT_PROGRAMMATIC,
                                       pdl_graph.DEPENDENCY_PROGRAMMATIC), "the driver refused the edges"
    return [_kernel_name(e.dst) for e in chosen]


def probe(consumer: Callable[[torch.Tensor], torch.Tensor], src: torch.Tensor) -> tuple[List[str], bool]:
    """(the kernels right after the late copy, whether the rewired graph gave the captured graph's bits)."""
    pdl, options = pdl_launch(src.device)
    assert pdl, "programmatic dependent launch needs compute capability 9.0"
    x = torch.zeros_like(src)

    def step() -> torch.Tensor:
        _late_copy[(triton.cdiv(src.numel(), 1024),)](src, x, src.numel(), SPINS, BLOCK=1024, PDL=pdl, **options)
        return consumer(x)

    step()  # compiles, picks cuBLAS's algorithm
    outputs, names = [], []
    for rewire in (False, True):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            out = step()
        if rewire:
            names = _edges_out_of_first_kernel_made_programmatic(graph)
        graph.instantiate()
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        outputs.append(out.clone())
    return names, torch.equal(outputs[0], outputs[1])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench gemm-waits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4] + list(range(8, 257, 8)),
                    help="GEMM rows (decode batch sizes) to ask at; default the decode graphs' sizes")
    ap.add_argument("--json", type=Path, default=None, help="write every answer here (with the run's meta)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench gemm-waits: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    results: List[Dict] = []
    waits: Dict[str, set] = {}
    control_names, control_same = probe(lambda x: x * 2, torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16))
    print(f"control {control_names}: {'same bits (the probe proves nothing!)' if control_same else 'read the zeros'}")
    for label, n, k in SHAPES:
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
        for m in args.rows:
            names, same = probe(lambda x, w=weight: F.linear(x, w), torch.randn(m, k, device="cuda",
                                                                              dtype=torch.bfloat16))
            # no kernel right after the copy (a workspace memset between): nothing was asked
            results.append({"gemm": label, "rows": m, "n": n, "k": k, "kernels": names,
                            "waits": same if names else None})
            for name in names:
                waits.setdefault(name, set()).add(same)
        row = [r for r in results if r["gemm"] == label]
        asked = [r for r in row if r["waits"] is not None]
        print(f"{label:8s} N={n:6d} K={k}: waits at {sum(r['waits'] for r in asked)} of {len(asked)} row counts"
              f" ({len(row) - len(asked)} not asked: a memset before the GEMM)")
    for name, answers in sorted(waits.items()):
        print(f"  {'waits' if answers == {True} else 'no wait' if answers == {False} else 'mixed':8s} {name}")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta.run_meta("python -m bench gemm-waits", argv, gpu=True),
                                         "control": {"kernels": control_names, "same_bits": control_same},
                                         "results": results}, indent=1))
    return 1 if control_same else 0

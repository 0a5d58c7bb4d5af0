"""Dependent launch out of kernels that never signal: a captured CUDA graph's programmatic edges, rewired.

A kernel launched with programmatic dependent launch (``kernel/pdl.py``) may start before the kernel before it has
finished, but only once that kernel *lets* it: each of its programs executes ``griddepcontrol.launch_dependents``
or exits. cuBLAS's GEMMs never do, so a decode step's kernels after a GEMM (the q/k norm + RoPE, the add-RMSNorm,
SiLU-and-mul, the argmax) still launch only as the GEMM's last programs exit, and each pays its launch and ramp in
the open. In a graph, the edge from the GEMM can instead leave at the GEMM's *launch order* port
(``CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER``): it fires once all of the GEMM's programs have started, so the next
kernel launches while the GEMM runs and its programs wait in ``griddepcontrol.wait``, which returns only when the
GEMM has completed and its writes are visible (the CUDA driver API's description of programmatic edges; the PTX
manual's of ``griddepcontrol.wait``). What any kernel reads is unchanged, so the results are the same bits.

Which edges: those of the programmatic type (the capture made them for kernels launched with PDL) whose upstream
kernel was itself launched without PDL, i.e. has no programmatic edge coming in: a kernel that signals keeps the
``launch_dependents`` it chose. (One of ours whose predecessor is a copy node has no such edge either and is moved
too: harmless, since correctness rests on the dependent's wait, not on when it launches.) The graph must be captured
with ``torch.cuda.CUDAGraph(keep_graph=True)`` and instantiated after the rewiring. The CUDA driver
(``libcuda.so.1``) is called through ctypes; where it lacks the edge functions (drivers before CUDA 12.3) the graph
stays as captured.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from typing import List, Sequence

logger = logging.getLogger(__name__)

# cuda.h: CUgraphDependencyType and CUgraphKernelNodePort
DEPENDENCY_PROGRAMMATIC = 1
PORT_PROGRAMMATIC = 1
PORT_LAUNCH_ORDER = 2


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


@dataclass(frozen=True)
class Edge:
    src: int  # CUgraphNode handles
    dst: int
    kind: int  # CUgraphDependencyType
    from_port: int


def edges_to_launch_order(edges: Sequence[Edge]) -> List[int]:
    """Indices of the programmatic edges whose upstream node has no programmatic edge coming in (a kernel launched
    without PDL, which never signals its dependents): those are the edges to leave at launch order."""
    launched_with_pdl = {e.dst for e in edges if e.kind == DEPENDENCY_PROGRAMMATIC}
    return [i for i, e in enumerate(edges)
            if e.kind == DEPENDENCY_PROGRAMMATIC and e.from_port == PORT_PROGRAMMATIC
            and e.src not in launched_with_pdl]


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuGraphGetEdges_v2", "cuGraphRemoveDependencies_v2", "cuGraphAddDependencies_v2"):
            getattr(lib, name).restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        logger.warning("graph edges stay as captured: the CUDA driver has no edge functions (%s)", e)
        return None
    return lib


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


def _read_edges(lib: ctypes.CDLL, graph: ctypes.c_void_p) -> tuple:
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetEdges_v2(graph, None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    _check(lib.cuGraphGetEdges_v2(graph, src, dst, data, ctypes.byref(count)), "cuGraphGetEdges")
    edges = [Edge(src[i] or 0, dst[i] or 0, data[i].type, data[i].from_port) for i in range(n)]
    return edges, src, dst, data


def move_edges_to_launch_order(graph) -> int:
    """Rewire ``graph`` (a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True``, not yet instantiated) as the
    module docstring says; returns how many edges now leave at launch order (0 where the driver cannot: the graph
    then stays as captured, which is correct, only slower)."""
    lib = _driver()
    if lib is None:
        return 0
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    try:
        edges, src, dst, data = _read_edges(lib, handle)
    except RuntimeError as e:
        logger.warning("graph edges stay as captured: %s", e)
        return 0
    chosen = edges_to_launch_order(edges)
    if not chosen:
        return 0
    k = len(chosen)
    sel_src = (ctypes.c_void_p * k)(*(src[i] for i in chosen))
    sel_dst = (ctypes.c_void_p * k)(*(dst[i] for i in chosen))
    old = (_EdgeData * k)(*(data[i] for i in chosen))
    new = (_EdgeData * k)()
    for j in range(k):
        new[j].from_port, new[j].to_port, new[j].type = PORT_LAUNCH_ORDER, old[j].to_port, old[j].type
    _check(lib.cuGraphRemoveDependencies_v2(handle, sel_src, sel_dst, old, ctypes.c_size_t(k)),
           "cuGraphRemoveDependencies")
    result = lib.cuGraphAddDependencies_v2(handle, sel_src, sel_dst, new, ctypes.c_size_t(k))
    if result != 0:  # put the captured edges back: the graph stays as it was
        _check(lib.cuGraphAddDependencies_v2(handle, sel_src, sel_dst, old, ctypes.c_size_t(k)),
               "cuGraphAddDependencies")
        logger.warning("graph edges stay as captured: cuGraphAddDependencies failed (CUresult %d)", result)
        return 0
    return k

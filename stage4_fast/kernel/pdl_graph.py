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

Which edges: the programmatic ones whose upstream kernel has no programmatic edge coming in (launched without
PDL); a kernel that signals keeps the ``launch_dependents`` it chose. Moving one too many is harmless: correctness
rests on the dependent's wait, not on when it launches. The graph is captured with
``torch.cuda.CUDAGraph(keep_graph=True)`` and instantiated after the rewiring; the driver (``libcuda.so.1``) is
called through ctypes, and where it lacks the edge functions (before CUDA 12.3) the graph stays as captured.
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
    to_port: int = 0


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


def _edge_array(edges: Sequence[Edge], from_port: int | None = None, kind: int | None = None):
    """The driver's (sources, destinations, edge data) arrays for ``edges``, optionally with another port / type."""
    k = len(edges)
    src = (ctypes.c_void_p * k)(*(e.src for e in edges))
    dst = (ctypes.c_void_p * k)(*(e.dst for e in edges))
    data = (_EdgeData * k)()
    for d, e in zip(data, edges):
        d.from_port = e.from_port if from_port is None else from_port
        d.to_port = e.to_port
        d.type = e.kind if kind is None else kind
    return src, dst, data, ctypes.c_size_t(k)


def graph_edges(graph) -> List[Edge] | None:
    """The edges of ``graph`` (a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True``); None where the driver
    cannot say (no edge functions, or the call failed)."""
    lib = _driver()
    if lib is None:
        return None
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    count = ctypes.c_size_t(0)
    try:
        _check(lib.cuGraphGetEdges_v2(handle, None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
        n = count.value
        src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
        _check(lib.cuGraphGetEdges_v2(handle, src, dst, data, ctypes.byref(count)), "cuGraphGetEdges")
    except RuntimeError as e:
        logger.warning("graph edges stay as captured: %s", e)
        return None
    return [Edge(src[i] or 0, dst[i] or 0, data[i].type, data[i].from_port, data[i].to_port) for i in range(n)]


def replace_edges(graph, edges: Sequence[Edge], from_port: int, kind: int) -> bool:
    """Replace each of ``edges`` in ``graph`` by the same edge leaving at ``from_port`` with type ``kind``. Where the
    driver refuses the new edges the captured ones are put back and the graph is as it was: returns False."""
    lib = _driver()
    if lib is None or not edges:
        return False
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    _check(lib.cuGraphRemoveDependencies_v2(handle, *_edge_array(edges)), "cuGraphRemoveDependencies")
    result = lib.cuGraphAddDependencies_v2(handle, *_edge_array(edges, from_port, kind))
    if result != 0:
        _check(lib.cuGraphAddDependencies_v2(handle, *_edge_array(edges)), "cuGraphAddDependencies")
        logger.warning("graph edges stay as captured: cuGraphAddDependencies failed (CUresult %d)", result)
        return False
    return True


def move_edges_to_launch_order(graph) -> int:
    """Rewire ``graph`` (a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True``, not yet instantiated) as the
    module docstring says; returns how many edges now leave at launch order (0 where the driver cannot: the graph
    then stays as captured, which is correct, only slower)."""
    edges = graph_edges(graph)
    if edges is None:
        return 0
    chosen = [edges[i] for i in edges_to_launch_order(edges)]
    if not replace_edges(graph, chosen, PORT_LAUNCH_ORDER, DEPENDENCY_PROGRAMMATIC):
        return 0
    return len(chosen)

"""Dependent launch after kernels that never signal (cuBLAS GEMMs): a captured CUDA graph's edges, rewired.

Edges out of kernels launched without PDL move to the launch-order port, so the next kernel launches while the
GEMM runs; its ``griddepcontrol.wait`` still waits for the GEMM's writes, so the bits are unchanged. Rewired
through libcuda via ctypes (CUDA 12.3+); otherwise the graph stays as captured."""

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
    """Indices of the programmatic edges whose source was launched without PDL (no programmatic edge in)."""
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
    """The edges of ``graph`` (captured with ``keep_graph=True``); None where the driver cannot say."""
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
    """Re-add ``edges`` leaving at ``from_port`` with type ``kind``; if the driver refuses, restore them: False."""
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
    """Rewire ``graph`` (captured with ``keep_graph=True``, not instantiated); returns the edges moved (0: none)."""
    edges = graph_edges(graph)
    if edges is None:
        return 0
    chosen = [edges[i] for i in edges_to_launch_order(edges)]
    return len(chosen) if replace_edges(graph, chosen, PORT_LAUNCH_ORDER, DEPENDENCY_PROGRAMMATIC) else 0

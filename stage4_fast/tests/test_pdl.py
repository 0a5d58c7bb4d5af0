"""When the Triton kernels launch with programmatic dependent launch (kernel/pdl.py): only compiled on a GPU of
compute capability 9.0 or later, never under the interpreter. That PDL
changes no result is checked on the GPU (test_gpu.py: a one-token layer chain in a CUDA graph, bit for bit)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the [test] extra installs it)")

from stage4_fast.kernel import pdl  # noqa: E402


@pytest.fixture
def hopper(monkeypatch):
    """A compiled (not interpreted) launch on a CUDA device of capability 9.0, without needing one."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    pdl._enabled.cache_clear()
    yield
    pdl._enabled.cache_clear()


def _launch_after_change() -> tuple:
    pdl._enabled.cache_clear()  # the answer is kept per device: work it out again
    return pdl.pdl_launch(torch.device("cuda", 0))


def test_a_hopper_gpu_launches_with_pdl(hopper):
    assert pdl.pdl_launch(torch.device("cuda", 0)) == (True, {"launch_pdl": True})


def test_pdl_is_off_on_cpu_under_the_interpreter_and_before_hopper(hopper, monkeypatch):
    assert pdl.pdl_launch(torch.device("cpu")) == (False, {})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _launch_after_change() == (False, {})
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pdl, "_capable", lambda index: False)  # an A100 or older
    assert _launch_after_change() == (False, {})
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    assert _launch_after_change() == (True, {"launch_pdl": True})


def test_only_edges_out_of_kernels_that_never_signal_leave_at_launch_order():
    """kernel/pdl_graph.py: a captured decode step's programmatic edges (made for kernels launched with PDL) are
    rewired where their upstream kernel was launched without PDL (a cuBLAS GEMM: it has no programmatic edge coming
    in, so it never signals); a kernel of ours keeps the launch_dependents it executes, plain edges stay plain."""
    from stage4_fast.kernel.pdl_graph import DEPENDENCY_PROGRAMMATIC as PROG
    from stage4_fast.kernel.pdl_graph import PORT_LAUNCH_ORDER, PORT_PROGRAMMATIC, Edge, edges_to_launch_order

    gemm_qkv, qk_rope, attention, merge, gemm_o, add_norm, memcpy = range(1, 8)
    edges = [
        Edge(memcpy, gemm_qkv, 0, 0),  # a copy node before the first GEMM: a plain edge
        Edge(gemm_qkv, qk_rope, PROG, PORT_PROGRAMMATIC),  # GEMM -> ours: rewired
        Edge(qk_rope, attention, PROG, PORT_PROGRAMMATIC),  # ours -> ours: kept (qk_rope signals)
        Edge(attention, merge, PROG, PORT_PROGRAMMATIC),  # kept
        Edge(merge, gemm_o, 0, 0),  # ours -> GEMM: a plain edge (cuBLAS launches without PDL)
        Edge(gemm_o, add_norm, PROG, PORT_PROGRAMMATIC),  # rewired
        Edge(gemm_o, add_norm, PROG, PORT_LAUNCH_ORDER),  # already at launch order: nothing to do
    ]
    assert edges_to_launch_order(edges) == [1, 5]
    assert edges_to_launch_order([]) == []


class _FakeDriver:
    """The three CUDA driver edge functions over an edge list, as ctypes hands them their arguments."""

    def __init__(self, edges: list, add_fails: bool = False) -> None:
        self.edges, self.add_fails, self.calls = list(edges), add_fails, []

    def cuGraphGetEdges_v2(self, graph, src, dst, data, count):
        if src is None:  # the first call asks for the count
            count._obj.value = len(self.edges)
            return 0
        for i, (s, d, kind, port) in enumerate(self.edges):
            src[i], dst[i], data[i].type, data[i].from_port = s, d, kind, port
        return 0

    def _edges(self, src, dst, data, n) -> list:
        return [(src[i], dst[i], data[i].type, data[i].from_port) for i in range(n.value)]

    def cuGraphRemoveDependencies_v2(self, graph, src, dst, data, n):
        gone = self._edges(src, dst, data, n)
        self.calls.append("remove")
        self.edges = [e for e in self.edges if e not in gone]
        return 0

    def cuGraphAddDependencies_v2(self, graph, src, dst, data, n):
        self.calls.append("add")
        if self.add_fails and self.calls.count("add") == 1:
            return 1  # CUDA_ERROR_INVALID_VALUE
        self.edges += self._edges(src, dst, data, n)
        return 0


class _FakeGraph:
    def raw_cuda_graph(self) -> int:
        return 1234


def test_moving_edges_replaces_each_chosen_edge_and_puts_them_back_if_the_driver_refuses(monkeypatch):
    from stage4_fast.kernel import pdl_graph as pg

    prog, plain = (pg.DEPENDENCY_PROGRAMMATIC, pg.PORT_PROGRAMMATIC), (0, 0)
    captured = [(1, 2, *prog), (2, 3, *prog), (3, 4, *plain), (4, 5, *prog)]  # GEMM -> ours -> ours -> GEMM -> ours
    driver = _FakeDriver(captured)
    monkeypatch.setattr(pg, "_driver", lambda: driver)
    assert pg.move_edges_to_launch_order(_FakeGraph()) == 2
    launch_order = (pg.DEPENDENCY_PROGRAMMATIC, pg.PORT_LAUNCH_ORDER)
    assert sorted(driver.edges) == [(1, 2, *launch_order), (2, 3, *prog), (3, 4, *plain), (4, 5, *launch_order)]

    refusing = _FakeDriver(captured, add_fails=True)
    monkeypatch.setattr(pg, "_driver", lambda: refusing)
    assert pg.move_edges_to_launch_order(_FakeGraph()) == 0
    assert sorted(refusing.edges) == sorted(captured) and refusing.calls == ["remove", "add", "add"]
    monkeypatch.setattr(pg, "_driver", lambda: None)  # a driver without the edge functions
    assert pg.move_edges_to_launch_order(_FakeGraph()) == 0
    assert pg.graph_edges(_FakeGraph()) is None


def test_replacing_edges_keeps_the_others_and_the_destination_port(monkeypatch):
    """The public rewiring (``bench gemm-waits`` makes plain edges programmatic with it): only the edges given change,
    to the port and type asked."""
    from stage4_fast.kernel import pdl_graph as pg

    driver = _FakeDriver([(1, 2, 0, 0), (1, 3, 0, 0), (2, 3, 0, 0)])
    monkeypatch.setattr(pg, "_driver", lambda: driver)
    edges = pg.graph_edges(_FakeGraph())
    assert edges == [pg.Edge(1, 2, 0, 0), pg.Edge(1, 3, 0, 0), pg.Edge(2, 3, 0, 0)]
    chosen = [e for e in edges if e.src == 1]
    assert pg.replace_edges(_FakeGraph(), chosen, pg.PORT_PROGRAMMATIC, pg.DEPENDENCY_PROGRAMMATIC)
    prog = (pg.DEPENDENCY_PROGRAMMATIC, pg.PORT_PROGRAMMATIC)
    assert sorted(driver.edges) == [(1, 2, *prog), (1, 3, *prog), (2, 3, 0, 0)]
    assert not pg.replace_edges(_FakeGraph(), [], pg.PORT_PROGRAMMATIC, pg.DEPENDENCY_PROGRAMMATIC)


def test_importing_the_engine_does_not_import_triton():
    """The tests choose Triton's interpreter (TRITON_INTERPRET) after importing the engine and before the first
    kernel module loads triton; an engine module that imported triton at its top (kernel/pdl.py once did, through
    the graph runner) made every interpreted kernel that calls a helper fail on a CPU."""
    import subprocess
    import sys

    code = "import sys, stage4_fast.engine, stage4_fast.llm; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""When the Triton kernels launch with programmatic dependent launch (kernel/pdl.py): only compiled on a GPU of
compute capability 9.0 or later, never under the interpreter, and switched off by MINISGL_DISABLE_PDL. That PDL
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
    monkeypatch.delenv("MINISGL_DISABLE_PDL", raising=False)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    pdl._enabled.cache_clear()
    yield
    pdl._enabled.cache_clear()


def _launch_after_change() -> tuple:
    pdl._enabled.cache_clear()  # the answer is kept per device: work it out again
    return pdl.pdl_launch(torch.device("cuda", 0))


def test_a_hopper_gpu_launches_with_pdl(hopper):
    assert pdl.pdl_launch(torch.device("cuda", 0)) == (True, {"launch_pdl": True})


def test_pdl_is_off_on_cpu_under_the_interpreter_when_disabled_and_before_hopper(hopper, monkeypatch):
    assert pdl.pdl_launch(torch.device("cpu")) == (False, {})
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "1")
    assert _launch_after_change() == (False, {})
    monkeypatch.delenv("MINISGL_DISABLE_PDL")
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

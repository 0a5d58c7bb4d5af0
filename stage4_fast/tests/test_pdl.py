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

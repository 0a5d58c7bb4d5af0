"""The decode batch's gate_up GEMM with the deferred norm and SiLU-and-mul in its epilogue
(``kernel/triton_gate_up.py``) against the two kernels it replaces: the projection rounded to the activations'
dtype (what cuBLAS writes), then ``triton_fused.silu_and_mul`` with the deferred norm's row scale.

The products' fp32 sums run in another order than the reference's, so a product may round one ulp apart and SiLU
and the gate carry that on: the output is checked to within a few ulps of its typical magnitude (more under
Triton's interpreter, which truncates where the GPU rounds)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the [test] extra installs it)")

from stage4_fast.kernel import gate_up_kernel_for, triton_fused, triton_gate_up  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
DEVICES = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
DEVICES += ["cuda"] if torch.cuda.is_available() else []
HIDDEN, INTER = 256, 80  # 256: two K blocks of 128; 80: a partly masked column block of 32


def _inputs(rows: int, device: str, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, HIDDEN, generator=gen) * 3).to(device, dtype)
    weight = (torch.randn(2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5).to(device, dtype)
    return hidden, weight


def _reference(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The two-kernel path: the product in the activations' dtype, then SiLU-and-mul with the row scale."""
    gate_up = (hidden.float() @ weight.float().T).to(hidden.dtype)
    return triton_fused.silu_and_mul(gate_up, row_scale=(hidden, 1e-5))


def _near(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Each value within a few ulps of its own magnitude (a gate and an up value each a rounding apart multiply
    into ~3 ulps of the product), or of the typical magnitude for values near zero."""
    ulps = 8 if out.dtype == torch.bfloat16 and not out.is_cuda else 4
    bound = ulps * torch.finfo(out.dtype).eps * (ref.float().abs() + ref.float().abs().mean())
    err = (out.float() - ref.float()).abs()
    assert (err <= bound).all(), f"max difference {err.max().item()}, {int((err > bound).sum())} values over bound"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [5, 40])  # a partly masked row block of 16; two row blocks of 32
def test_gate_up_kernel_matches_the_gemm_then_silu_and_mul(dtype, device, rows):
    hidden, weight = _inputs(rows, device, dtype, seed=rows)
    out = triton_gate_up.gate_up_silu(hidden, weight, 1e-5)
    assert out.shape == (rows, INTER) and out.dtype == dtype
    _near(out, _reference(hidden, weight))


@pytest.mark.parametrize("device", DEVICES)
def test_gate_up_kernel_takes_each_launch_of_its_table(device):
    """Every launch ``default_launch`` picks gives the same output (a K block of 64 included)."""
    hidden, weight = _inputs(5, device, torch.bfloat16, seed=3)
    ref = _reference(hidden, weight)
    for rows in (8, 32, 64, 128, 256):
        launch = triton_gate_up.default_launch(rows, HIDDEN)
        _near(triton_gate_up.gate_up_silu(hidden, weight, 1e-5, launch=launch), ref)


def test_gate_up_kernel_only_for_decode_sized_16_bit_cuda_batches(monkeypatch):
    """The engine asks ``gate_up_kernel_for``: CPU rows, fp32, one row (the GEMV path), a prefill-sized batch, a
    hidden size that is no whole number of K blocks, or the A/B switch keep the GEMM and the SiLU-and-mul kernel."""
    weight = torch.empty(2 * INTER, HIDDEN)
    assert gate_up_kernel_for(torch.empty(8, HIDDEN, dtype=torch.bfloat16), weight) is None  # CPU
    assert triton_gate_up.applies(torch.empty(8, HIDDEN), weight)
    assert not triton_gate_up.applies(torch.empty(1, HIDDEN), weight)
    assert not triton_gate_up.applies(torch.empty(triton_gate_up.MAX_ROWS + 1, HIDDEN), weight)
    assert not triton_gate_up.applies(torch.empty(8, 96), torch.empty(2 * INTER, 96))
    if torch.cuda.is_available():
        rows = torch.empty(8, HIDDEN, dtype=torch.bfloat16, device="cuda")
        w = weight.to("cuda", torch.bfloat16)
        assert gate_up_kernel_for(rows, w) is triton_gate_up
        assert gate_up_kernel_for(rows.float(), w.float()) is None
        monkeypatch.setenv("MINISGL_DISABLE_GATE_UP_GEMM", "1")
        assert gate_up_kernel_for(rows, w) is None


def compile_gate_up_kernel_for_hopper(block_m: int) -> str:
    """PTX of the kernel at the Qwen3-0.6B shape with ``block_m`` rows per program, compiled for sm_90 on this
    machine (no GPU needed; not under TRITON_INTERPRET, which runs code the compiler refuses)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = triton_gate_up._gate_up_silu_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    _, block_n, block_k, _, _ = triton_gate_up.default_launch(block_m, 1024)
    consts = {"HIDDEN": 1024, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "F32_DOTS": False,
              "PDL": True}
    signature = {n: "constexpr" if n in consts else "*bf16" if n[0].isupper() else "fp32" if n == "hid_eps"
                 else "i32" for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_gate_up_kernel_compiles_for_a_hopper_gpu():
    """The kernel compiles for sm_90 on the CPU, without the interpreter (which runs code the compiler refuses),
    and its products run on the tensor cores (wgmma) with the engine's 128-row launch."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from stage4_fast.tests.test_gate_up_kernel import compile_gate_up_kernel_for_hopper as c; "
            "print('wgmma' if 'wgmma' in c(128) else 'no-wgmma'); c(16)")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "wgmma"

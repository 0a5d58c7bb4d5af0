"""The Triton GEMV of one-token forwards (kernel/triton_gemv.py) against F.linear: fp32 sums, one rounding. On CPU
it runs under Triton's interpreter (conftest), on a GPU compiled."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the [test] extra installs it)")

from stage4_fast.kernel import gemv_kernel_for, triton_gemv  # noqa: E402

DEVICES = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
DEVICES += ["cuda"] if torch.cuda.is_available() else []
# outputs that do not fill the last program's rows, K that does not fill the last slice, a weight whose rows are a
# strided view (a slice of a wider matrix), with and without bias
SHAPES = [(37, 700, False), (64, 1024, True), (4100, 96, False)]


def _weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k + 8, generator=gen)[:, :k]  # row stride k + 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,has_bias", SHAPES)
def test_gemv_fp32_equals_linear(device, n, k, has_bias):
    gen = torch.Generator().manual_seed(n + k)
    x, w = torch.randn(1, k, generator=gen).to(device), _weight(n, k, gen).to(device)
    bias = torch.randn(n, generator=gen).to(device) if has_bias else None
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    torch.testing.assert_close(triton_gemv.gemv(x, w, bias).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,has_bias", SHAPES)
def test_gemv_16_bit_is_the_rounded_fp32_result(device, dtype, n, k, has_bias):
    """One rounding of the fp32 result, as cuBLAS's fp32 accumulation: within one ulp of it (two where the
    interpreter truncates instead of rounding)."""
    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=gen).to(device, dtype), _weight(n, k, gen).to(device, dtype) / k**0.5
    bias = torch.randn(n, generator=gen).to(device, dtype) if has_bias else None
    exact = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    out = triton_gemv.gemv(x, w, bias)
    assert out.dtype == dtype and out.shape == (1, n)
    ulps = 1 if device == "cuda" else 2
    bound = ulps * torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny) + 1e-6
    assert ((out.double() - exact).abs() <= bound).all()


def test_gemv_applies_to_one_row_16_bit_cuda_activations_only():
    assert gemv_kernel_for(torch.zeros(1, 8, dtype=torch.bfloat16)) is None  # CPU: F.linear
    if torch.cuda.is_available():
        assert gemv_kernel_for(torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda")) is triton_gemv
        assert gemv_kernel_for(torch.zeros(2, 8, dtype=torch.bfloat16, device="cuda")) is None
        assert gemv_kernel_for(torch.zeros(1, 8, dtype=torch.float32, device="cuda")) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_gemv_equals_silu_and_mul_then_linear(device, dtype):
    """The down projection with silu(gate) * up folded in: the input rounded where the unfused kernels round, then
    the same GEMV. Bound: two ulps of the dot product's scale sum |w| |x| (an input element one ulp apart, as the
    interpreter's truncating bf16 casts give, moves the sum by at most that)."""
    from stage4_fast.layers.activation import silu_and_mul

    gen = torch.Generator().manual_seed(7)
    n, k = 48, 600
    gate_up = (torch.randn(1, 2 * k, generator=gen) * 3).to(device, dtype)
    w = (_weight(n, k, gen) / k**0.5).to(device, dtype)
    x = silu_and_mul(gate_up.cpu()).to(device)
    unfused = triton_gemv.gemv(x, w)
    fused = triton_gemv.gemv(gate_up, w, gated=True)
    scale = x.double().abs() @ w.double().abs().T
    assert ((fused.double() - unfused.double()).abs() <= 2 * torch.finfo(dtype).eps * scale).all()


def test_mlp_down_projection_takes_gate_up_on_every_path():
    """GatedMLP hands down_proj the [gate | up] halves: on a CPU (F.linear after silu_and_mul) the result is the
    unfused formula's."""
    from stage4_fast.layers.activation import silu_and_mul
    from stage4_fast.layers.linear import linear

    gen = torch.Generator().manual_seed(8)
    gate_up, w = torch.randn(3, 64, generator=gen), torch.randn(16, 32, generator=gen)
    torch.testing.assert_close(linear(gate_up, w, silu_mul_input=True), F.linear(silu_and_mul(gate_up), w))


# several K slices with and without a residual, the norm's row in one slice, and the wide launch (8 rows a program)
NORMED_CASES = [(37, 700, torch.bfloat16, True), (37, 700, torch.float16, False), (64, 1024, torch.float16, True),
                (64, 1024, torch.bfloat16, False), (4100, 96, torch.bfloat16, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,k,dtype,with_residual", NORMED_CASES)
def test_normed_gemv_is_add_rmsnorm_then_gemv(device, n, k, dtype, with_residual):
    """The add-RMSNorm folded into the GEMV: the new residual stream is x + residual rounded once (bit for bit),
    and y is the GEMV of the norm's output — rounded where the add-RMSNorm kernel rounds, so the same bits but
    where the sum of squares, added in another order, moves a normalised value by one ulp."""
    from stage4_fast.kernel import triton_fused

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(device, dtype)
    residual = torch.randn(1, k, generator=gen).to(device, dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype)
    w = (_weight(n, k, gen) / k**0.5).to(device, dtype)
    kept = None if residual is None else residual.clone()
    y, stream = triton_gemv.normed_gemv(x, residual, norm_weight, 1e-6, w)
    ref_stream = None if kept is None else kept.clone()
    ref_in = triton_fused.add_rmsnorm(x, ref_stream, norm_weight, 1e-6)  # updates ref_stream in place
    if residual is None:
        assert stream is x
    else:
        assert torch.equal(residual, kept), "the input residual is left as it was (other programs read it)"
        assert torch.equal(stream, ref_stream)
    ref = triton_gemv.gemv(ref_in, w)
    assert y.shape == (1, n) and y.dtype == dtype
    # one ulp in a normalised input moves y by about |w| * ulp(input) per such element
    tol = 4 * torch.finfo(dtype).eps * (ref.float().abs() + w.float().abs().sum(-1) * ref_in.float().abs().max())
    assert ((y.float() - ref.float()).abs() <= tol).all()


@pytest.mark.skipif("cpu" not in DEVICES, reason="runs the engine on the CPU under Triton's interpreter")
def test_one_token_decode_with_the_norm_folded_in_equals_the_unfolded_one(tiny_model, monkeypatch):
    """A bf16 engine decoding one request (every forward one token): with each add-RMSNorm folded into the qkv /
    gate_up GEMV (the Triton kernel, here under the interpreter), the tokens are those of the unfolded layer (the
    norm, then the projection) and the logits within bf16 rounding of its."""
    from stage4_fast.core import SamplingParams
    from stage4_fast.engine import ManualBatcher
    from stage4_fast.layers import linear as linear_module
    from stage4_fast.layers.activation import silu_and_mul

    from .conftest import forward_logits, make_engine

    calls = []

    class FoldsOnly:
        """The folds through the Triton kernel; every plain GEMV (the LM head's 49,152 rows too) as F.linear,
        which the interpreter would take minutes over."""

        @staticmethod
        def normed_gemv(*args, **kwargs):
            calls.append(1)
            return triton_gemv.normed_gemv(*args, **kwargs)

        @staticmethod
        def gemv(x, weight, bias=None, gated=False):
            return F.linear(silu_and_mul(x) if gated else x, weight, bias)

    def folds_only(x: torch.Tensor):
        return FoldsOnly if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 else None

    runs = {}
    for fold in (True, False):  # unfolded: no GEMV kernel, so the norm and then F.linear
        monkeypatch.setattr(linear_module, "gemv_kernel_for", folds_only if fold else lambda x: None)
        engine = make_engine(tiny_model("qwen3"), dtype=torch.bfloat16)
        batcher = ManualBatcher(engine)
        req = batcher.add_req([7], SamplingParams(max_tokens=2))
        tokens, logits = [], []
        for phase in ["prefill", "decode"]:
            logits.append(forward_logits(engine, batcher.make_batch([req], phase))[0].float())
            tokens += batcher.step([req], phase)
        runs[fold] = tokens, torch.stack(logits)
    assert len(calls) == 2 * 2 * 4, "two folds per layer (2 layers) in each of the four one-token forwards"
    assert runs[True][0] == runs[False][0]
    scale = runs[False][1].abs().max()
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=0, atol=float(4 * 2**-8 * scale))

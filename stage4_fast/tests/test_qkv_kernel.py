"""The decode batch's qkv GEMM with the q/k norm, RoPE and K/V store in its epilogue (``kernel/triton_qkv.py``)
against the two kernels it replaces: the projection rounded to the activations' dtype (what cuBLAS writes), then
``triton_fused.qk_norm_rope`` with the deferred norm's row scale.

The product's fp32 sum runs in another order than the reference's, so a product may round one ulp apart, and the
norm, the row factor and RoPE carry that on: q, k and v are checked to within a few ulps of the typical magnitude
(more under Triton's interpreter, which truncates where the GPU rounds). The pool gets exactly what the kernel
returns (quantized as the store kernel quantizes, for an fp8 pool) and nothing else."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the [test] extra installs it)")

from stage4_fast.kernel import qkv_kernel_for, triton_fused, triton_qkv  # noqa: E402
from stage4_fast.kernel.ref import quantize_kv  # noqa: E402
from stage4_fast.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
DEVICES = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
DEVICES += ["cuda"] if torch.cuda.is_available() else []
T, HIDDEN, HQ, HKV, D, SLOTS = 5, 256, 4, 2, 32, 16  # 5 rows: a partly masked row block; 256: two K blocks


def _inputs(device: str, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, HIDDEN, generator=gen) * 3).to(device, dtype)
    weight = (torch.randn((HQ + 2 * HKV) * D, HIDDEN, generator=gen) / HIDDEN**0.5).to(device, dtype)
    qw = (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype)
    kw = (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype)
    rope = RotaryEmbedding(D, D, 4096, 1e6, device=device)
    positions = torch.tensor([0, 3, 17, 1000, 4095], dtype=torch.int32, device=device)
    out_loc = torch.tensor([9, 2, 14, 0, 5], dtype=torch.int32, device=device)
    return hidden, weight, qw, kw, rope, positions, out_loc


def _reference(hidden, weight, qw, kw, rope, positions, with_norm: bool):
    """The two-kernel path: the product in the activations' dtype, then the q/k kernel with the row scale."""
    qkv = (hidden.float() @ weight.float().T).to(hidden.dtype)
    q, k = triton_fused.qk_norm_rope(qkv, HQ, HKV, D, qw if with_norm else None, kw if with_norm else None, 1e-6,
                                     rope.cos_sin_cache, positions, row_scale=(hidden, 1e-5))
    return q, k, qkv[:, (HQ + HKV) * D:].view(T, HKV, D)  # v scaled in place by the kernel


def _near(out: torch.Tensor, ref: torch.Tensor) -> None:
    ulps = 8 if out.dtype == torch.bfloat16 and not out.is_cuda else 4
    scale = ref.float().abs().mean().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= ulps * torch.finfo(out.dtype).eps * scale, f"max difference {err} at mean magnitude {scale}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_qkv_kernel_matches_the_gemm_then_the_qk_kernel(dtype, device, with_norm):
    hidden, weight, qw, kw, rope, positions, _ = _inputs(device, dtype, seed=0)
    q, k, v = triton_qkv.qkv_norm_rope(hidden, weight, HQ, HKV, D, qw if with_norm else None,
                                       kw if with_norm else None, 1e-6, 1e-5, rope.cos_sin_cache, positions)
    q_ref, k_ref, v_ref = _reference(hidden, weight, qw, kw, rope, positions, with_norm)
    _near(q, q_ref)
    _near(k, k_ref)
    _near(v, v_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_qkv_kernel_stores_this_steps_kv_in_the_pool(device, cache_dtype):
    """The pool's slots of the step's tokens get the k and v the kernel returns (an fp8 pool: divided by the
    layer's scales and quantized, bit for bit what the store kernel writes); no other slot changes."""
    dtype = torch.bfloat16
    hidden, weight, qw, kw, rope, positions, out_loc = _inputs(device, dtype, seed=1)
    k_cache = torch.zeros(SLOTS, HKV, D, dtype=torch.uint8 if cache_dtype != dtype else dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    if cache_dtype != dtype:
        k_cache, v_cache = k_cache.view(cache_dtype), v_cache.view(cache_dtype)
    scales = (1.0, 1.0) if cache_dtype == dtype else (0.37, 3.0)
    q, k, v = triton_qkv.qkv_norm_rope(hidden, weight, HQ, HKV, D, qw, kw, 1e-6, 1e-5, rope.cos_sin_cache,
                                       positions, (k_cache, v_cache, out_loc), scales)
    rows = out_loc.long()
    if cache_dtype == dtype:
        assert torch.equal(k_cache[rows], k) and torch.equal(v_cache[rows], v)
    else:
        assert torch.equal(k_cache[rows].view(torch.uint8), quantize_kv(k, scales[0], cache_dtype).view(torch.uint8))
        assert torch.equal(v_cache[rows].view(torch.uint8), quantize_kv(v, scales[1], cache_dtype).view(torch.uint8))
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert (k_cache[untouched.to(device)].float() == 0).all() and (v_cache[untouched.to(device)].float() == 0).all()


def test_qkv_kernel_only_for_decode_sized_16_bit_cuda_batches(monkeypatch):
    """The engine asks ``qkv_kernel_for``: CPU rows, fp32, one row (the GEMV path), a prefill-sized batch, a hidden
    size that is no whole number of K blocks, or the A/B switch keep the GEMM and the q/k kernel."""
    weight = torch.empty((HQ + 2 * HKV) * D, HIDDEN)
    assert qkv_kernel_for(torch.empty(8, HIDDEN, dtype=torch.bfloat16), weight, D) is None  # CPU
    assert triton_qkv.applies(torch.empty(8, HIDDEN), weight, D)
    assert not triton_qkv.applies(torch.empty(1, HIDDEN), weight, D)
    assert not triton_qkv.applies(torch.empty(triton_qkv.MAX_ROWS + 1, HIDDEN), weight, D)
    assert not triton_qkv.applies(torch.empty(8, 96), torch.empty((HQ + 2 * HKV) * D, 96), D)
    assert not triton_qkv.applies(torch.empty(8, HIDDEN), weight, 16)  # halves narrower than tl.dot's 16... 8
    if torch.cuda.is_available():
        rows = torch.empty(8, HIDDEN, dtype=torch.bfloat16, device="cuda")
        w = weight.to("cuda", torch.bfloat16)
        assert qkv_kernel_for(rows, w, D) is triton_qkv
        assert qkv_kernel_for(rows.float(), w.float(), D) is None
        monkeypatch.setenv("MINISGL_DISABLE_QKV_GEMM", "1")
        assert qkv_kernel_for(rows, w, D) is None


def compile_qkv_kernel_for_hopper(cache: str) -> str:
    """PTX of the kernel storing into a pool of Triton type ``cache``, compiled for sm_90 on this machine (no GPU
    needed; not under TRITON_INTERPRET, which runs code the compiler refuses)."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = triton_qkv._qkv_rope_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    fp8 = cache != "bf16"
    consts = {"HIDDEN": 1024, "HQ": 16, "HKV": 8, "D": 128, "HAS_NORM": True, "STORE_KV": True, "SCALED": fp8,
              "FP8_MAX": 448.0 if fp8 else 0.0, "FP8_MANT": 3 if fp8 else 0, "FP8_MIN_EXP": -6 if fp8 else 0,
              "BLOCK_M": 64, "BLOCK_K": 128, "F32_DOTS": False, "PDL": True}
    pointers = {"CosSin": "*fp32", "Pos": "*i32", "OutLoc": "*i32", "KCache": f"*{cache}", "VCache": f"*{cache}"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "*bf16") if n[0].isupper()
                 else "fp32" if n in ("eps", "hid_eps", "k_scale", "v_scale") else "i32" for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_qkv_kernel_compiles_for_a_hopper_gpu(cache):
    """The interpreter runs what the compiler refuses (a name bound to pointers of two types in the two branches of
    a run-time if): the kernel is compiled for sm_90 with a bf16 and an fp8 pool, on the CPU, without the
    interpreter, and its product runs on the tensor cores (wgmma)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from stage4_fast.tests.test_qkv_kernel import compile_qkv_kernel_for_hopper as c; "
            f"ptx = c({cache!r}); print('wgmma' if 'wgmma' in ptx else 'no-wgmma')")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "wgmma"

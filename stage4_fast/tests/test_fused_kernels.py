"""The fused element-wise Triton kernels against the PyTorch path they replace on a GPU (16-bit activations).

They round where PyTorch rounds. On a GPU the norms and SiLU must give PyTorch's bits except where the fp32 sum of
squares inside a norm lands differently (one ulp in a few elements); RoPE's two rounded products may come out one
ulp apart before their sum, so it is checked to two ulps of the typical magnitude. On CPU the kernels run under
Triton's interpreter, which rounds fp16 like the GPU but truncates when it narrows to bf16: there bf16 is checked
to within four ulps."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package (the [test] extra installs it)")

from stage4_fast.kernel import fused_kernels_for, triton_fused  # noqa: E402
from stage4_fast.layers.norm import rms_norm  # noqa: E402
from stage4_fast.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
# CPU tensors only under the interpreter (conftest sets it when there is no GPU); compiled kernels need CUDA ones
DEVICES = ["cpu"] if os.environ.get("TRITON_INTERPRET") == "1" else []
DEVICES += ["cuda"] if torch.cuda.is_available() else []


def _close(out: torch.Tensor, ref: torch.Tensor, cancelling: bool = False) -> None:
    """GPU, and fp16 anywhere: PyTorch's bits but for one-ulp differences in at most 2 % of the elements.
    bf16 under the interpreter (it truncates where the GPU rounds, up to three times in a row): within four ulps
    of the larger of the value and the mean magnitude."""
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.device == ref.device
    truncating = out.dtype == torch.bfloat16 and not out.is_cuda
    eps = torch.finfo(out.dtype).eps
    out, ref = out.float().cpu(), ref.float().cpu()
    diff = out != ref
    if not diff.any():
        return
    # relative to the typical magnitude too where a difference of two rounded products can cancel (RoPE): there
    # the compiled kernel may keep an intermediate in fp32 where PyTorch rounds it
    ulps = 4 if truncating else 2 if cancelling else 1
    floor = ref.abs().mean().item() if truncating or cancelling else 1e-3
    assert ((out - ref).abs() <= ulps * eps * ref.abs().clamp_min(floor))[diff].all(), f"more than {ulps} ulp apart"
    if not (truncating or cancelling):
        assert diff.float().mean().item() <= 0.02, f"{int(diff.sum())} of {diff.numel()} elements differ"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rmsnorm_matches_torch(dtype, with_residual, device):
    gen = torch.Generator().manual_seed(0)
    T, N = 7, 96  # N not a power of two: the masked tail
    x = (torch.randn(T, N, generator=gen) * 3).to(device, dtype)
    res = torch.randn(T, N, generator=gen).to(device, dtype)
    w = (1 + 0.1 * torch.randn(N, generator=gen)).to(device, dtype)
    res_ref = res.clone()
    if with_residual:
        res_ref.add_(x)
        ref = rms_norm(res_ref, w, 1e-6)
        out = triton_fused.add_rmsnorm(x, res, w, 1e-6)
        _close(res, res_ref)  # updated in place
    else:
        ref = rms_norm(x, w, 1e-6)
        out = triton_fused.add_rmsnorm(x, None, w, 1e-6)
    _close(out, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_matches_torch(dtype, with_norm, device):
    gen = torch.Generator().manual_seed(1)
    T, Hq, Hkv, D = 5, 4, 2, 32
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen) * 2).to(device, dtype)
    qw = (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype)
    kw = (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype)
    rope = RotaryEmbedding(D, D, 4096, 1e6, device=device)
    positions = torch.tensor([0, 3, 17, 1000, 4095], dtype=torch.int32, device=device)
    q, k = qkv[:, : Hq * D].view(T, Hq, D), qkv[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    if with_norm:
        q, k = rms_norm(q, qw, 1e-6), rms_norm(k, kw, 1e-6)
    qk, _ = rope.forward(positions, torch.cat([q, k], dim=1))
    out_q, out_k = triton_fused.qk_norm_rope(qkv, Hq, Hkv, D, qw if with_norm else None,
                                             kw if with_norm else None, 1e-6, rope.cos_sin_cache, positions)
    _close(out_q, qk[:, :Hq].contiguous(), cancelling=True)
    _close(out_k, qk[:, Hq:].contiguous(), cancelling=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_stores_this_steps_kv_in_the_pool(dtype, device):
    """With the pool's slots and each token's slot, the kernel writes the rotated k and the untouched v rows there
    (bit for bit what it returns / what qkv holds) and nothing else: the store kernel's job, one launch less."""
    gen = torch.Generator().manual_seed(2)
    T, Hq, Hkv, D, slots = 4, 4, 2, 32, 16
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen).to(device, dtype)
    w = torch.ones(D, dtype=dtype, device=device)
    rope = RotaryEmbedding(D, D, 4096, 1e6, device=device)
    positions = torch.tensor([5, 6, 7, 8], dtype=torch.int32, device=device)
    out_loc = torch.tensor([9, 2, 14, 0], dtype=torch.int32, device=device)
    k_cache = torch.full((slots, Hkv, D), 7.0, dtype=dtype, device=device)
    v_cache = torch.full((slots, Hkv, D), 7.0, dtype=dtype, device=device)
    q, k = triton_fused.qk_norm_rope(qkv, Hq, Hkv, D, w, w, 1e-6, rope.cos_sin_cache, positions,
                                     (k_cache, v_cache, out_loc))
    q_ref, k_ref = triton_fused.qk_norm_rope(qkv, Hq, Hkv, D, w, w, 1e-6, rope.cos_sin_cache, positions)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    rows = out_loc.long()
    assert torch.equal(k_cache[rows], k)
    assert torch.equal(v_cache[rows], qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert (k_cache[untouched.to(device)] == 7).all() and (v_cache[untouched.to(device)] == 7).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 3.0), (0.25, 4.0)])
def test_qk_norm_rope_stores_this_steps_kv_into_an_fp8_pool(dtype, device, cache_dtype, scales):
    """Into an fp8 pool the kernel writes what the quantizing store kernel writes, bit for bit: the rotated k and
    the v rows divided by the layer's scales, saturated and rounded to nearest even (kernel/ref.py quantize_kv).
    Inputs span subnormals to saturation."""
    from stage4_fast.kernel.ref import quantize_kv

    gen = torch.Generator().manual_seed(3)
    T, Hq, Hkv, D, slots = 4, 4, 2, 32, 16
    # magnitudes from ~5e-5 (e4m3's subnormals, and zeros) to ~400 (past e4m3's 448 after the 0.37 scale); no q/k
    # norm, so k keeps them; negative zeros must stay negative
    size = (T, (Hq + 2 * Hkv) * D)
    qkv = torch.randn(size, generator=gen) * torch.exp(torch.rand(size, generator=gen) * 16 - 10)
    qkv[:, -8:] = -0.0
    qkv = qkv.to(device, dtype)
    rope = RotaryEmbedding(D, D, 4096, 1e6, device=device)
    positions = torch.tensor([5, 6, 7, 8], dtype=torch.int32, device=device)
    out_loc = torch.tensor([9, 2, 14, 0], dtype=torch.int32, device=device)
    k_cache = torch.zeros(slots, Hkv, D, dtype=torch.uint8, device=device).view(cache_dtype)
    v_cache = torch.zeros(slots, Hkv, D, dtype=torch.uint8, device=device).view(cache_dtype)
    q, k = triton_fused.qk_norm_rope(qkv, Hq, Hkv, D, None, None, 0.0, rope.cos_sin_cache, positions,
                                     (k_cache, v_cache, out_loc), scales)
    v = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    rows = out_loc.long()
    k_ref, v_ref = quantize_kv(k, scales[0], cache_dtype), quantize_kv(v, scales[1], cache_dtype)
    assert torch.equal(k_cache[rows].view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache[rows].view(torch.uint8), v_ref.view(torch.uint8))
    assert (v_ref.float().abs() == torch.finfo(cache_dtype).max).any() or cache_dtype == torch.float8_e5m2 \
        or scales[1] > 1
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert (k_cache.view(torch.uint8)[untouched.to(device)] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("store", [False, True])
def test_qk_norm_rope_with_a_row_scale_is_the_kernel_on_scaled_rows(dtype, device, store):
    """The deferred input norm: with ``row_scale`` = (hidden, eps) the kernel gives what it gives for qkv whose
    rows were first multiplied by RMSNorm's factor of hidden's rows (``scale_by_rms_of``), writes the scaled v
    back into qkv (the attention reads it there) and stores the scaled k and v in the pool."""
    from stage4_fast.layers.norm import scale_by_rms_of

    gen = torch.Generator().manual_seed(4)
    T, Hq, Hkv, D, N, slots = 5, 4, 2, 32, 96, 8
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * D, generator=gen) * 2).to(device, dtype)
    hidden = (torch.randn(T, N, generator=gen) * torch.tensor([0.1, 1, 10, 100, 3]).view(T, 1)).to(device, dtype)
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(device, dtype)
    rope = RotaryEmbedding(D, D, 4096, 1e6, device=device)
    positions = torch.tensor([0, 3, 17, 1000, 4095], dtype=torch.int32, device=device)
    scaled, original = scale_by_rms_of(qkv, hidden, 1e-6), qkv.clone()
    q_ref, k_ref = triton_fused.qk_norm_rope(scaled, Hq, Hkv, D, w, w, 1e-6, rope.cos_sin_cache, positions)
    kv_store = None
    if store:
        k_cache = torch.zeros(slots, Hkv, D, dtype=dtype, device=device)
        v_cache = torch.zeros(slots, Hkv, D, dtype=dtype, device=device)
        kv_store = (k_cache, v_cache, torch.tensor([3, 0, 7, 5, 1], dtype=torch.int32, device=device))
    q, k = triton_fused.qk_norm_rope(qkv, Hq, Hkv, D, w, w, 1e-6, rope.cos_sin_cache, positions, kv_store,
                                     row_scale=(hidden, 1e-6))
    _close(q, q_ref, cancelling=True)
    _close(k, k_ref, cancelling=True)
    v = qkv[:, (Hq + Hkv) * D:]
    _close(v, scaled[:, (Hq + Hkv) * D:])
    assert torch.equal(qkv[:, : (Hq + Hkv) * D], original[:, : (Hq + Hkv) * D])  # only v is written back
    if store:
        rows = kv_store[2].long()
        assert torch.equal(k_cache[rows], k) and torch.equal(v_cache[rows], v.view(T, Hkv, D))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_with_a_row_scale_is_the_kernel_on_scaled_rows(dtype, device):
    """The deferred post-attention norm: gate and up scaled by RMSNorm's factor of hidden's rows first, even
    where a row spans several programs (N > 1024)."""
    from stage4_fast.layers.norm import scale_by_rms_of

    gen = torch.Generator().manual_seed(5)
    T, N, H = 3, 1100, 96
    x = (torch.randn(T, 2 * N, generator=gen) * 3).to(device, dtype)
    hidden = (torch.randn(T, H, generator=gen) * torch.tensor([0.5, 10, 300]).view(T, 1)).to(device, dtype)
    scaled = scale_by_rms_of(x, hidden, 1e-5)
    ref = torch.nn.functional.silu(scaled[:, :N]) * scaled[:, N:]
    _close(triton_fused.silu_and_mul(x, row_scale=(hidden, 1e-5)), ref)


@pytest.mark.skipif("cpu" not in DEVICES, reason="runs the engine on the CPU under Triton's interpreter")
@pytest.mark.parametrize("page_size,kv_cache_dtype", [(1, "auto"), (4, "auto"), (1, "fp8_e4m3")])
def test_engine_with_the_kv_stored_by_the_rope_kernel_equals_the_store_kernels(tiny_model, monkeypatch, page_size,
                                                                                kv_cache_dtype):
    """A bf16 engine whose attention layers take the fused q/k norm + RoPE kernel (the GPU path, here under the
    interpreter): with the kernel writing this step's K/V into the pool, the tokens generated and every slot of the
    pool are bit for bit what the pool's own store gives — the layer's views of the pool, its slots, an fp8 pool's
    scales and the backends' skipping of their store agree, at page size 1 and 4 and into an fp8 pool."""
    from stage4_fast.core import SamplingParams
    from stage4_fast.engine import ManualBatcher
    from stage4_fast.layers import attention as attention_layer

    from .conftest import make_engine

    monkeypatch.setattr(attention_layer, "fused_kernels_for", lambda x: triton_fused if x.dtype in DTYPES else None)
    prompts = [[11, 22, 33, 44, 55, 66, 77], [5, 6, 7], [100, 200, 300, 400, 500, 1, 2, 3, 4, 5, 6]]
    runs = {}
    for fused_store in (True, False):
        monkeypatch.setattr(attention_layer, "fused_kv_store_applies", lambda pool, act, on=fused_store: on)
        engine = make_engine(tiny_model("qwen3"), dtype=torch.bfloat16, page_size=page_size,
                             kv_cache_dtype=kv_cache_dtype)
        pool = engine.kv_cache
        if kv_cache_dtype != "auto":  # scales other than 1.0, as a checkpoint may carry
            pool.set_scales([0.5 + i for i in range(pool.num_layers)], [2.0 - 0.5 * i for i in range(pool.num_layers)])
        for i in range(pool.num_layers):  # the pool starts uninitialised; slots never written must compare too
            pool.k_cache(i).view(torch.uint8).zero_(), pool.v_cache(i).view(torch.uint8).zero_()
        tokens = ManualBatcher(engine).generate(prompts, SamplingParams(max_tokens=5))
        slots = torch.stack([torch.stack([pool.k_cache(i).view(torch.uint8), pool.v_cache(i).view(torch.uint8)])
                             for i in range(pool.num_layers)])
        runs[fused_store] = tokens, slots
    (fused_tokens, fused_slots), (tokens, slots) = runs[True], runs[False]
    assert fused_tokens == tokens
    assert slots.float().abs().sum() > 0 and torch.equal(fused_slots, slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype, device):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(6, 2 * 80, generator=gen) * 3).to(device, dtype)
    ref = torch.nn.functional.silu(x[:, :80]) * x[:, 80:]
    _close(triton_fused.silu_and_mul(x), ref)


def test_fused_path_only_for_16_bit_cuda(monkeypatch):
    assert fused_kernels_for(torch.zeros(2, 2, dtype=torch.bfloat16)) is None  # CPU keeps the PyTorch path
    assert fused_kernels_for(torch.zeros(2, 2)) is None
    if torch.cuda.is_available():
        assert fused_kernels_for(torch.zeros(2, 2, dtype=torch.bfloat16, device="cuda")) is triton_fused
        assert fused_kernels_for(torch.zeros(2, 2, device="cuda")) is None  # fp32 keeps HF's exact path


def compile_qk_norm_rope_for_hopper(cache: str) -> str:
    """PTX of the q/k norm + RoPE kernel storing into a pool of Triton type ``cache``, compiled for sm_90 on this
    machine (no GPU needed). Needs the compiled kernel, so not under TRITON_INTERPRET."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = triton_fused._qk_norm_rope_kernel
    names = list(inspect.signature(kernel.fn).parameters)
    fp8 = cache != "bf16"
    consts = {"HQ": 16, "HKV": 8, "D": 128, "BLOCK_H": 32, "BLOCK_HKV": 8, "HAS_NORM": True, "STORE_KV": True,
              "SCALED": fp8, "FP8_MAX": 448.0 if fp8 else 0.0, "FP8_MANT": 3 if fp8 else 0,
              "FP8_MIN_EXP": -6 if fp8 else 0, "ROW_SCALE": True, "BLOCK_HID": 1024}
    pointers = {"CosSin": "*fp32", "Pos": "*i32", "OutLoc": "*i32", "KCache": f"*{cache}", "VCache": f"*{cache}"}
    signature = {n: "constexpr" if n in consts else pointers.get(n, "*bf16") if n[0].isupper()
                 else "fp32" if n in ("eps", "hid_eps", "k_scale", "v_scale") else "i32" for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv", "fp8e5"])
def test_qk_norm_rope_compiles_for_a_hopper_gpu(cache):
    """Triton's interpreter runs what its compiler refuses (two returns of different types under a constexpr
    branch): the q/k norm + RoPE kernel, storing into a bf16 or an fp8 pool, is compiled for sm_90 — on the CPU,
    in a process without the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from stage4_fast.tests.test_fused_kernels import compile_qk_norm_rope_for_hopper as c; "
            f"ptx = c({cache!r}); print('satfinite' if 'cvt.rn.satfinite' in ptx else 'plain')")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    # the fp8 store converts with the hardware's saturating cvt
    assert run.stdout.split()[-1] == ("plain" if cache == "bf16" else "satfinite")


def _argmax_cases(dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    vocab = 3 * 8192 + 517  # several chunks, a partial last one
    rand = torch.randn(4, vocab, generator=gen)
    ties = torch.randint(0, 4, (5, vocab), generator=gen).float()  # the max in every chunk, many times per row
    ties[1, 9000] = 7.0  # one row's max once, in the second chunk
    ties[2, :] = 3.0  # all equal: index 0
    special = torch.randn(6, vocab, generator=gen)
    special[0, :] = float("-inf")  # a row masked out entirely
    special[1, 20000] = float("nan")  # a NaN beats every number
    special[2, [17, 24000]] = float("nan")  # the first NaN wins
    special[3, vocab - 1] = float("inf")  # in the partial last chunk
    special[4, [5, 8192 + 5]] = float("inf")  # two infs: the first
    special[5, 8191] = 50.0  # the last column of a chunk
    short = torch.randn(3, 700, generator=gen)  # narrower than one block
    return [t.to(device, dtype) for t in (rand, ties, special, short)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_matches_torch(dtype, device):
    """The greedy argmax kernel gives torch.argmax's indices: first of equal maxima, NaN above all, -inf rows 0."""
    from stage4_fast.kernel import triton_argmax

    for logits in _argmax_cases(dtype, device):
        out = triton_argmax.argmax_rows(logits)
        assert out.dtype == torch.int32
        assert out.tolist() == logits.argmax(-1).tolist()
    wide = torch.randn(6, 2 * 8192 + 40, dtype=dtype, device=device)  # rows of a wider buffer (a row stride > vocab)
    assert triton_argmax.argmax_rows(wide[:, :8200]).tolist() == wide[:, :8200].argmax(-1).tolist()


def test_greedy_argmax_takes_pytorch_off_gpu(monkeypatch):
    """Off the GPU (and for fp32 logits) greedy sampling is PyTorch's argmax, as int32 like the kernel's."""
    from stage4_fast.kernel import greedy_argmax, triton_argmax

    def no_kernel(logits):
        raise AssertionError("the Triton argmax ran off the GPU")

    monkeypatch.setattr(triton_argmax, "argmax_rows", no_kernel)
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(3, 50).to(dtype)
        tokens = greedy_argmax(logits)
        assert tokens.dtype == torch.int32 and tokens.tolist() == logits.argmax(-1).tolist()

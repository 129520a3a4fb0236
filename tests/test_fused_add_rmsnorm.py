# SPDX-License-Identifier: Apache-2.0
"""fused_add_rms_norm (scripts/rmsnorm.py): residual add + RMSNorm of an LLM decoder layer, with optional FP8
output (static per-tensor scale or dynamic per-token scales), against float64 references, transformers'
LlamaRMSNorm and a float64 quantize-dequantize reference; plus the FP8 encoder on every FP8 value."""

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl

import activations
import kernel_testing as kt
import rmsnorm
from conftest import clear_launch_plans
from kernel_testing import DEVICE, DTYPES, INTERPRET, TOL, assert_close, make_generator, poisoned_outputs, randn

FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}
# A mismatch is an element whose FP8 value differs from the float64 reference's by one FP8 step (the
# kernel's fp32 value fell on the other side of a rounding boundary); more than one step fails outright.
MAX_MISMATCH_FRACTION = 0.01


def _weight(n, dtype, gen):
    return randn((n,), dtype, gen, scale=0.2, offset=1.0)


def _round(t, dtype):
    """Round float64 values to dtype the way the kernel's casts do: round to nearest even natively;
    the interpreter truncates fp32 -> bf16 (references/troubleshooting.md, "Interpreter and compiler")."""
    if INTERPRET and dtype == torch.bfloat16:
        f = t.to(torch.float32)
        return (f.view(torch.int32) & -65536).view(torch.float32).to(t.dtype)
    return t.to(dtype).to(t.dtype)


def _sum_like_kernel(x, r):
    """x + r computed in fp32 and rounded once to x's dtype (torch's eager bf16/fp16 add does the same)."""
    s = x.double().float() + r.double().float()
    return _round(s.double(), x.dtype).to(x.dtype)


def _norm_ref(r, w, eps, cast_before_weight):
    """float64 RMSNorm of the kernel's own residual output, rounding where the kernel rounds."""
    rf = r.double()
    y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    if w is not None:
        if cast_before_weight:
            y = _round(y, r.dtype)
        y = y * w.double()
    return y


def _fp8_step(q, fp8_dtype):
    """Spacing of the FP8 grid at |q| (3 mantissa bits, subnormal spacing below the smallest normal)."""
    min_exp = {torch.float8_e4m3fn: -6, torch.float8_e4m3fnuz: -7}[fp8_dtype]
    _, e = torch.frexp(q.abs().clamp_min(2.0**min_exp))
    return rmsnorm._exact_pow2(e - 1 - 3, q.dtype)


def check_fp8(q_fp8, q_ref, fp8_dtype, name, seed, max_fraction=MAX_MISMATCH_FRACTION):
    """q_fp8: the kernel's FP8 tensor; q_ref: the reference's FP8 grid values (float64). Every element
    must match or be one FP8 step away; the fraction of one-step mismatches must stay under max_fraction."""
    assert q_fp8.dtype == fp8_dtype, f"{name}: dtype {q_fp8.dtype}, expected {fp8_dtype}"
    q = q_fp8.to("cpu", torch.float64)
    r = q_ref.to("cpu", torch.float64)
    assert not torch.isnan(q).any(), f"{name}: {int(torch.isnan(q).sum())} NaN (unwritten or invalid), seed {seed}"
    assert q.abs().max() <= FP8_MAX[fp8_dtype]
    diff = (q - r).abs()
    step = torch.maximum(_fp8_step(q, fp8_dtype), _fp8_step(r, fp8_dtype))
    far = diff > step
    assert not far.any(), (
        f"{name}: {int(far.sum())} elements more than one FP8 step from the reference, e.g. got "
        f"{q[far][:5].tolist()} expected {r[far][:5].tolist()} (seed {seed})"
    )
    frac = float((diff > 0).double().mean()) if q.numel() else 0.0
    assert frac <= max_fraction, (
        f"{name}: {frac:.2%} of elements one FP8 step off (limit {max_fraction:.0%}), seed {seed}"
    )
    return frac


# ---- no FP8: residual exact, output vs float64 -----------------------------------------------
SHAPES = [(1, 127), (1, 4096), (5, 2049), (32, 256), (2, 3, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_matches_float64(shape, dtype, gen):
    x = randn(shape, dtype, gen, scale=2.0)
    res = randn(shape, dtype, gen, scale=3.0, offset=0.5)
    w = _weight(shape[-1], dtype, gen)
    with poisoned_outputs():
        y, r = rmsnorm.fused_add_rms_norm(x, res, w, 1e-6)
    assert y.dtype == r.dtype == dtype and y.shape == r.shape == x.shape
    # the residual is exact: x + residual in fp32, rounded once
    assert torch.equal(r, _sum_like_kernel(x, res)), f"residual differs (seed {gen.seed_value})"
    # normalising the kernel's own residual isolates the norm's error
    y_ref = rmsnorm.fused_add_rms_norm_ref(r.double(), torch.zeros_like(r, dtype=torch.float64), w.double(), 1e-6)[0]
    assert_close(y, y_ref, dtype, seed=gen.seed_value)
    # and the float64 reference of the whole step, rounding where a model of this dtype rounds
    y_full, r_full = rmsnorm.fused_add_rms_norm_ref(x.double(), res.double(), w.double(), 1e-6, dtype=dtype)
    assert r_full.dtype == dtype
    # the interpreter truncates the residual too (a one-ulp different r): twice the tolerance there
    loose = {k: 2 * v for k, v in TOL[dtype].items()} if INTERPRET and dtype == torch.bfloat16 else {}
    assert_close(r, r_full.double(), dtype, name="residual", seed=gen.seed_value, **loose)
    assert_close(y, y_full.double(), dtype, name="y", seed=gen.seed_value, **loose)


def test_same_kernel_as_gated_residual(gen):
    x = randn((4, 300), torch.float16, gen)
    res = randn((4, 300), torch.float16, gen)
    w = _weight(300, torch.float16, gen)
    y, r = rmsnorm.fused_add_rms_norm(x, res, w, 1e-5, cast_before_weight=False)
    h2, y2 = rmsnorm.gated_residual_rms_norm_modulate(x, res, None, None, None, w, 1e-5, cast_before_weight=False)
    assert torch.equal(y, y2) and torch.equal(r, h2)


def test_weightless(gen):
    x = randn((3, 200), torch.float32, gen)
    res = randn((3, 200), torch.float32, gen)
    with poisoned_outputs():
        y, r = rmsnorm.fused_add_rms_norm(x, res, None)
    assert_close(y, rmsnorm.rms_norm_ref((x.double() + res.double())), torch.float32, seed=gen.seed_value)


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_matches_llama_rmsnorm_bf16(rows, gen):
    """LlamaRMSNorm(x + residual): natively the same bits (only the fp32 summation order can differ, at
    most one bf16 ulp on rare elements); the interpreter truncates its two bf16 casts (<= 2 ulps)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    D = 512
    m = LlamaRMSNorm(D, eps=1e-5)
    m.weight.data = randn((D,), torch.float32, gen, scale=0.2, offset=1.0, device="cpu")
    m = m.to(DEVICE, torch.bfloat16).requires_grad_(False)  # inference: the kernels have no backward
    x = randn((rows, D), torch.bfloat16, gen, scale=2.0)
    res = randn((rows, D), torch.bfloat16, gen, scale=4.0)
    with poisoned_outputs():
        y, r = rmsnorm.fused_add_rms_norm(x, res, m.weight, m.variance_epsilon)
    eager_r = x + res
    if not INTERPRET:
        assert torch.equal(r, eager_r)
    expected = m(r)  # the model applied to the residual stream (bit-identical to eager_r natively)
    diff = (y.float() - expected.float()).abs()
    ulp = expected.float().abs().clamp_min(2.0**-126) * 2.0**-7
    ulps = 2 if INTERPRET else 1
    assert bool((diff <= ulps * ulp).all()), (
        f"max diff {diff.max().item()} exceeds {ulps} bf16 ulp (seed {gen.seed_value})"
    )
    exact = float((y == expected).double().mean())
    if not INTERPRET:
        assert exact >= 0.999, f"only {exact:.4%} of elements bit-identical to LlamaRMSNorm (seed {gen.seed_value})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_rows(dtype, gen):
    """x sliced out of a wider tensor and a residual with transposed leading dims: read in place."""
    big = randn((2, 5, 3 * 96), dtype, gen)
    x = big[:, :, 96:192]
    res = randn((5, 2, 96), dtype, gen).transpose(0, 1)
    assert not x.is_contiguous() and not res.is_contiguous()
    w = _weight(96, dtype, gen)
    with poisoned_outputs():
        y, r = rmsnorm.fused_add_rms_norm(x, res, w)
        q, r8, s = rmsnorm.fused_add_rms_norm(x, res, w, fp8="per_token")
    assert torch.equal(r, _sum_like_kernel(x, res)) and torch.equal(r8, r)
    assert_close(y, _norm_ref(r, w, 1e-6, True), dtype, seed=gen.seed_value)
    q_ref, s_ref = rmsnorm.fp8_quantize_ref(_norm_ref(r, w, 1e-6, True), q.dtype)  # the device's format
    check_fp8(q, q_ref, q.dtype, "strided per_token", gen.seed_value)
    assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, name="scales", seed=gen.seed_value)


# ---- FP8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (32, 1024), (3, 2049), (2, 4, 127)])
def test_fp8_per_token(shape, dtype, fp8_dtype, gen):
    x = randn(shape, dtype, gen, scale=2.0)
    res = randn(shape, dtype, gen, scale=3.0)
    w = _weight(shape[-1], dtype, gen)
    with poisoned_outputs():
        q, r, s = rmsnorm.fused_add_rms_norm(x, res, w, 1e-6, fp8="per_token", fp8_dtype=fp8_dtype)
    assert q.shape == x.shape and s.shape == x.shape[:-1] and s.dtype == torch.float32
    assert torch.equal(r, _sum_like_kernel(x, res)), f"residual differs (seed {gen.seed_value})"
    y_ref = _norm_ref(r, w, 1e-6, True)
    q_ref, s_ref = rmsnorm.fp8_quantize_ref(y_ref, fp8_dtype)
    assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, name="scales", seed=gen.seed_value)
    check_fp8(q, q_ref, fp8_dtype, f"per_token {dtype}", gen.seed_value)
    # dequantised output: within half an FP8 step of the exact value (one step where the rounding differs)
    deq = q.double() * s.double()[..., None]
    bound = _fp8_step(q_ref, fp8_dtype) * s_ref[..., None] * 1.0001
    assert bool(((deq - y_ref).abs() <= bound).all())
    # the row maximum maps onto +-fp8_max
    assert torch.equal(
        q.double().abs().amax(-1), torch.full(s.shape, FP8_MAX[fp8_dtype], dtype=torch.float64, device=q.device)
    )


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cast_before_weight", [True, False])
def test_fp8_per_tensor(dtype, fp8_dtype, cast_before_weight, gen):
    shape = (16, 1024)
    x = randn(shape, dtype, gen, scale=2.0)
    res = randn(shape, dtype, gen, scale=3.0)
    w = _weight(shape[-1], dtype, gen)
    # a scale that maps the typical |y| (~1-4) onto the FP8 range, saturating the largest values
    scale = torch.tensor([3.0 / FP8_MAX[fp8_dtype]], dtype=torch.float32, device=DEVICE)
    with poisoned_outputs():
        q, r = rmsnorm.fused_add_rms_norm(
            x,
            res,
            w,
            1e-6,
            cast_before_weight=cast_before_weight,
            fp8="per_tensor",
            fp8_scale=scale,
            fp8_dtype=fp8_dtype,
        )
    assert torch.equal(r, _sum_like_kernel(x, res))
    y_ref = _norm_ref(r, w, 1e-6, cast_before_weight)
    q_ref, _ = rmsnorm.fp8_quantize_ref(y_ref, fp8_dtype, scale.double())
    check_fp8(q, q_ref, fp8_dtype, f"per_tensor {dtype}", gen.seed_value)
    assert (q.double().abs() == FP8_MAX[fp8_dtype]).any(), "expected some saturated values"


def test_fp8_reference_matches_module_reference(gen):
    """fused_add_rms_norm_ref's own FP8 path (fp16: no interpreter rounding caveat) agrees with the kernel."""
    x = randn((8, 640), torch.float16, gen, scale=2.0)
    res = randn((8, 640), torch.float16, gen)
    w = _weight(640, torch.float16, gen)
    sc = torch.tensor(0.01, dtype=torch.float32, device=DEVICE)  # shape [] is accepted too
    for fp8_dtype in FP8_DTYPES:
        q, r, s = rmsnorm.fused_add_rms_norm(x, res, w, fp8="per_token", fp8_dtype=fp8_dtype)
        q_ref, r_ref, s_ref = rmsnorm.fused_add_rms_norm_ref(
            x.double(), res.double(), w.double(), fp8="per_token", fp8_dtype=fp8_dtype, dtype=torch.float16
        )
        assert torch.equal(r, r_ref)
        check_fp8(q, q_ref, fp8_dtype, "module ref per_token", gen.seed_value)
        assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, seed=gen.seed_value)
        q, r = rmsnorm.fused_add_rms_norm(x, res, w, fp8="per_tensor", fp8_scale=sc, fp8_dtype=fp8_dtype)
        q_ref, _ = rmsnorm.fused_add_rms_norm_ref(
            x.double(),
            res.double(),
            w.double(),
            fp8="per_tensor",
            fp8_scale=sc,
            fp8_dtype=fp8_dtype,
            dtype=torch.float16,
        )
        check_fp8(q, q_ref, fp8_dtype, "module ref per_tensor", gen.seed_value)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_saturation_no_nan(fp8_dtype, gen):
    D = 256
    x = randn((4, D), torch.bfloat16, gen)
    res = randn((4, D), torch.bfloat16, gen)
    w = randn((D,), torch.bfloat16, gen, scale=1e4)  # |y| up to ~1e5: far beyond the FP8 range
    fmax = FP8_MAX[fp8_dtype]
    for scale in (1.0, 1e-30, 0.0):  # 0: every nonzero value saturates (1 / scale is capped)
        sc = torch.tensor([scale], dtype=torch.float32, device=DEVICE)
        with poisoned_outputs():
            q, r = rmsnorm.fused_add_rms_norm(x, res, w, fp8="per_tensor", fp8_scale=sc, fp8_dtype=fp8_dtype)
        qd = q.double()
        assert not torch.isnan(qd).any() and bool((qd.abs() <= fmax).all())
        y = _norm_ref(r, w, 1e-6, True)
        # the kernel multiplies by 1 / scale capped at 3e38; values near fp32's subnormal range are left out
        big = (y.abs() * min(1 / scale if scale else float("inf"), 3e38) > 1.01 * fmax) & (y.abs() > 1e-30)
        assert bool((qd[big].abs() == fmax).all()) and torch.equal(torch.sign(qd[big]), torch.sign(y[big]))
    # dynamic scales with huge weights: every row's maximum maps to fp8_max, nothing overflows
    q, r, s = rmsnorm.fused_add_rms_norm(x, res, w, fp8="per_token", fp8_dtype=fp8_dtype)
    assert not torch.isnan(q.double()).any() and torch.isfinite(s).all()
    assert torch.equal(q.double().abs().amax(-1), torch.full((4,), fmax, dtype=torch.float64, device=q.device))


def test_fp8_per_token_zero_row():
    """A row of zeros gets the minimum scale and zeros, never NaN."""
    x = torch.zeros((3, 64), device=DEVICE)
    x[1] = 1.0
    w = torch.ones(64, device=DEVICE)
    with poisoned_outputs():
        q, r, s = rmsnorm.fused_add_rms_norm(x, torch.zeros_like(x), w, fp8="per_token")
    assert not torch.isnan(q.double()).any()
    assert float(s[0]) == pytest.approx(1e-12) and float(s[2]) == pytest.approx(1e-12)
    assert bool((q.double()[0] == 0).all()) and bool((q.double()[1] == FP8_MAX[q.dtype]).all())


@pytest.mark.parametrize("width", [127, 2049])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_chunked_path(width, dtype, gen, monkeypatch):
    """Rows wider than one block: per-token FP8 adds a pass for the row maximum. Shrink the limits to
    exercise it cheaply."""
    monkeypatch.setattr(rmsnorm, "_MAX_FUSED_N", 64)
    monkeypatch.setattr(rmsnorm, "_CHUNK_N", 32)
    x = randn((3, width), dtype, gen, scale=2.0)
    res = randn((3, width), dtype, gen)
    w = _weight(width, dtype, gen)
    sc = torch.tensor([0.01], dtype=torch.float32, device=DEVICE)
    with poisoned_outputs():
        y, r0 = rmsnorm.fused_add_rms_norm(x, res, w)
        q1, r1 = rmsnorm.fused_add_rms_norm(x, res, w, fp8="per_tensor", fp8_scale=sc)
        q2, r2, s2 = rmsnorm.fused_add_rms_norm(x, res, w, fp8="per_token", fp8_dtype=torch.float8_e4m3fnuz)
    for r in (r0, r1, r2):
        assert torch.equal(r, _sum_like_kernel(x, res))
    y_ref = _norm_ref(r0, w, 1e-6, True)
    assert_close(y, y_ref, dtype, seed=gen.seed_value)
    check_fp8(
        q1, rmsnorm.fp8_quantize_ref(y_ref, q1.dtype, sc.double())[0], q1.dtype, "chunked per_tensor", gen.seed_value
    )
    q_ref, s_ref = rmsnorm.fp8_quantize_ref(y_ref, torch.float8_e4m3fnuz)
    check_fp8(q2, q_ref, torch.float8_e4m3fnuz, "chunked per_token", gen.seed_value)
    assert_close(s2, s_ref, torch.float32, rtol=1e-5, atol=0, seed=gen.seed_value)


# ---- the FP8 rounding helper: every FP8 value and every midpoint ------------------------------
@triton.jit
def _fp8_encode_probe_kernel(
    V,
    OUT,
    N,
    FP8_MAX: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    FP8_NAN: tl.constexpr,
    USE_ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    v = tl.load(V + offs, mask=mask, other=0.0)
    if USE_ACT:
        q = activations._fp8_encode(v, FP8_MAX, FP8_MIN_EXP, FP8_NAN)
    else:
        q = rmsnorm._fp8_encode(v, FP8_MAX, FP8_MIN_EXP, FP8_NAN)
    tl.store(OUT + offs, q.to(tl.uint8), mask=mask)


@pytest.mark.parametrize("module", ["rmsnorm", "activations"])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_encoding_every_value_and_midpoint(fp8_dtype, module):
    """Each copy of _fp8_encode (one per leaf file), stored through a uint8 view as the kernels do: every
    finite FP8 value comes back unchanged; every midpoint between neighbours rounds to the even code;
    values past the largest and infinities saturate; NaN gives NaN; random values of every magnitude round
    as torch's own (round-to-nearest-even) conversion does, and as fp8_quantize_ref does."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).double()
    vals = torch.unique(codes[~torch.isnan(codes)])  # sorted, finite, one zero
    mids = (vals[1:] + vals[:-1]) / 2
    fmax = FP8_MAX[fp8_dtype]
    g = make_generator()
    mags = torch.exp2(torch.randint(-14, 9, (4096,), generator=g)).double()  # from below the subnormals to 256
    rnd = torch.randn(4096, generator=g, dtype=torch.float64) * mags
    special = [fmax * 1.01, -fmax * 1.5, 1e30, -3e38, float("inf"), float("-inf"), -0.0, -1e-30]
    v = torch.cat([vals, mids, torch.tensor(special).double(), torch.tensor([float("nan")]).double(), rnd]).float()
    out = torch.empty(v.shape, dtype=fp8_dtype, device=DEVICE)
    mod = rmsnorm if module == "rmsnorm" else activations
    fp8_max, min_exp, nan_code = mod._FP8_FORMATS[fp8_dtype]
    _fp8_encode_probe_kernel[(triton.cdiv(v.numel(), 1024),)](
        v.to(DEVICE),
        out.view(torch.uint8),
        v.numel(),
        FP8_MAX=fp8_max,
        FP8_MIN_EXP=min_exp,
        FP8_NAN=nan_code,
        USE_ACT=module == "activations",
        BLOCK=1024,
    )
    got = out.cpu().double()
    bits = out.cpu().view(torch.uint8)
    n, k, m = vals.numel(), mids.numel(), len(special)
    assert torch.equal(got[:n], vals), "an FP8 value did not survive unchanged"
    # midpoints: ties to the neighbour with an even code (mantissa LSB 0)
    lo, hi = vals[:-1], vals[1:]
    lo_code = lo.to(fp8_dtype).view(torch.uint8).to(torch.int32)
    expect_mid = torch.where((lo_code & 1) == 0, lo, hi)
    assert torch.equal(got[n : n + k], expect_mid), "a midpoint did not round to even"
    assert got[n + k : n + k + m].tolist() == [fmax, -fmax, fmax, -fmax, fmax, -fmax, 0.0, 0.0]
    assert bits[n + k + m - 2 : n + k + m].tolist() == [0, 0], "a zero must be encoded as +0 (0x80 is NaN in e4m3fnuz)"
    assert bits[n + k + m].item() == nan_code and torch.isnan(got[n + k + m])
    # random values: same as torch's conversion after saturation, and as fp8_quantize_ref
    r = rnd.float().double().clamp(-fmax, fmax)
    tail = got[n + k + m + 1 :]
    assert torch.equal(tail, r.to(fp8_dtype).double())
    assert torch.equal(tail, mod.fp8_quantize_ref(r, fp8_dtype, torch.tensor(1.0))[0])


# ---- FP8 dtype choice --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target,expected",
    [
        (("hip", "gfx942", 64), torch.float8_e4m3fnuz),
        (("hip", "gfx942:sramecc+:xnack-", 64), torch.float8_e4m3fnuz),
        (("hip", "gfx950", 64), torch.float8_e4m3fn),
        (("hip", "gfx1201", 32), torch.float8_e4m3fn),
        (("cuda", 90, 32), torch.float8_e4m3fn),
        (("interpreter", None, 32), torch.float8_e4m3fn),
    ],
)
def test_fp8_dtype_by_target(target, expected, monkeypatch):
    for mod in (rmsnorm, activations):
        monkeypatch.setattr(mod, "_device_target", lambda device, t=target: t)
        assert mod._fp8_dtype_for(torch.device("cpu")) == expected


def test_default_fp8_dtype_here():
    x = torch.ones((2, 64), device=DEVICE)
    q, _, _ = rmsnorm.fused_add_rms_norm(x, x, None, fp8="per_token")
    assert q.dtype == rmsnorm._fp8_dtype_for(x.device)


# ---- empty input, errors ------------------------------------------------------------------------
def test_empty_inputs():
    x = torch.empty((0, 64), device=DEVICE, dtype=torch.bfloat16)
    w = torch.ones(64, device=DEVICE, dtype=torch.bfloat16)
    y, r = rmsnorm.fused_add_rms_norm(x, x, w)
    assert y.shape == r.shape == (0, 64)
    q, r, s = rmsnorm.fused_add_rms_norm(x, x, w, fp8="per_token")
    assert q.shape == (0, 64) and s.shape == (0,) and q.dtype in rmsnorm._FP8_FORMATS


def _error_inputs(gen):
    return SimpleNamespace(
        gen=gen,
        x=randn((2, 4, 64), torch.float32, gen),
        w=torch.ones(64, device=DEVICE),
        sc=torch.ones(1, device=DEVICE),
    )


def _far(*args, **kwargs):
    return rmsnorm.fused_add_rms_norm(*args, **kwargs)


ERROR_CASES = [
    (
        "fp8 mode",
        ValueError,
        "fp8 must be None, 'per_tensor' or 'per_token'",
        lambda t: _far(t.x, t.x, t.w, fp8="per_row"),
    ),
    ("fp8 True", ValueError, "fp8 must be None", lambda t: _far(t.x, t.x, t.w, fp8=True)),
    ("per_tensor without scale", ValueError, "needs fp8_scale", lambda t: _far(t.x, t.x, t.w, fp8="per_tensor")),
    (
        "per_token with scale",
        ValueError,
        "fp8_scale is only used with fp8='per_tensor'",
        lambda t: _far(t.x, t.x, t.w, fp8="per_token", fp8_scale=t.sc),
    ),
    (
        "scale without fp8",
        ValueError,
        "fp8_scale is only used with fp8='per_tensor'",
        lambda t: _far(t.x, t.x, t.w, fp8_scale=t.sc),
    ),
    (
        "fp8_scale shape",
        ValueError,
        r"fp8_scale must hold one element .* got shape \(2,\)",
        lambda t: _far(t.x, t.x, t.w, fp8="per_tensor", fp8_scale=torch.ones(2, device=DEVICE)),
    ),
    (
        "fp8_scale float64",
        TypeError,
        "fp8_scale has dtype float64; expected one of float32",
        lambda t: _far(t.x, t.x, t.w, fp8="per_tensor", fp8_scale=torch.ones(1, device=DEVICE, dtype=torch.float64)),
    ),
    (
        "fp8_scale a float",
        TypeError,
        "fp8_scale must be a torch.Tensor",
        lambda t: _far(t.x, t.x, t.w, fp8="per_tensor", fp8_scale=0.5),
    ),
    (
        "fp8_dtype e5m2",
        TypeError,
        "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz",
        lambda t: _far(t.x, t.x, t.w, fp8="per_token", fp8_dtype=torch.float8_e5m2),
    ),
    (
        "fp8_dtype without fp8",
        ValueError,
        "fp8_dtype is only used with",
        lambda t: _far(t.x, t.x, t.w, fp8_dtype=torch.float8_e4m3fn),
    ),
    (
        "residual shape",
        ValueError,
        r"residual has shape \(2, 4, 63\) but x has shape \(2, 4, 64\)",
        lambda t: _far(t.x, t.x[..., :63], t.w),
    ),
    (
        "residual dtype",
        TypeError,
        "residual has dtype torch.float16 but x has dtype torch.float32",
        lambda t: _far(t.x, t.x.half(), t.w),
    ),
    ("residual missing", ValueError, "residual is required", lambda t: _far(t.x, None, t.w)),
    (
        "weight shape",
        ValueError,
        r"weight must have shape \[64\]",
        lambda t: _far(t.x, t.x, torch.ones(63, device=DEVICE)),
    ),
    ("x float64", TypeError, "x has dtype float64", lambda t: _far(t.x.double(), t.x.double(), t.w)),
    (
        "x last stride",
        ValueError,
        "x must be contiguous in its last dimension",
        lambda t: _far(t.x.transpose(1, 2), t.x.transpose(1, 2), t.w[:4]),
    ),
    (
        "residual last stride",
        ValueError,
        "residual must be contiguous in its last dimension",
        lambda t: _far(t.x, randn((2, 64, 4), torch.float32, t.gen).transpose(1, 2), t.w),
    ),
    kt.on_gpu_and_cpu(
        (
            "fp8_scale on another device",
            ValueError,
            "fp8_scale is on cpu",
            lambda t: _far(t.x, t.x, None, fp8="per_tensor", fp8_scale=torch.ones(1)),
        )
    ),
]


@kt.error_cases(ERROR_CASES)
def test_errors(case, gen):
    kt.assert_error_case(case, _error_inputs(gen))


def test_custom_op_under_torch_compile(gen):
    """torch.compile traces through the op with FP8 outputs (aot_eager keeps it cheap on the CPU)."""
    x = randn((3, 128), torch.float32, gen)
    res = randn((3, 128), torch.float32, gen)
    w = _weight(128, torch.float32, gen)
    sc = torch.tensor([0.02], device=DEVICE)

    def f(x, res, w, sc):
        y, r = rmsnorm.fused_add_rms_norm(x, res, w, 1e-5)
        q, r2, s = rmsnorm.fused_add_rms_norm(y, r, w, 1e-5, fp8="per_token")
        q1, _ = rmsnorm.fused_add_rms_norm(y, r, w, 1e-5, fp8="per_tensor", fp8_scale=sc)
        return q.float() * s[:, None] + q1.float() * sc + r2

    compiled = kt.compile_aot_eager(f)
    assert torch.equal(compiled(x, res, w, sc), f(x, res, w, sc))
    torch._dynamo.reset()
    op = getattr(torch.ops, rmsnorm._NS).rms_norm_fused.default
    for args in [
        (x, res, None, w, None, None, 1e-6, True, None, 2, None),
        (x, res, None, w, None, None, 1e-6, True, torch.float8_e4m3fnuz, 1, sc),
        (x, res, None, w, None, None, 1e-6, True, None),  # the original arguments still work
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


# ---- the L2 eviction hint of the fused add (rmsnorm._input_evict) ----------------------------
class _LaunchSpy:
    """Stands in for rmsnorm._rms_norm_kernel: records each launch's constexprs, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_input_evict_rule():
    limit = rmsnorm._EVICT_FIRST_MAX_BYTES
    assert rmsnorm._input_evict(True, True, limit) == "evict_first"
    assert rmsnorm._input_evict(True, True, limit + 1) == ""
    assert rmsnorm._input_evict(False, True, 1) == ""  # the looped (wide-row) path keeps its default
    assert rmsnorm._input_evict(True, False, 1) == ""  # every other RMSNorm variant too


@pytest.mark.parametrize("fp8", [None, "per_token"])
def test_eviction_hint_launches_and_changes_nothing(fp8, gen, monkeypatch):
    """The fused add launches with the hint below the byte limit and without it above (limit lowered to
    reach both here); both launches agree with float64 and with each other bit for bit. Other RMSNorm
    calls never get it."""
    spy = _LaunchSpy(rmsnorm._rms_norm_kernel)
    monkeypatch.setattr(rmsnorm, "_rms_norm_kernel", spy)
    dtype = torch.bfloat16
    x = randn((5, 2049), dtype, gen, scale=2.0)
    res = randn((5, 2049), dtype, gen)
    w = _weight(2049, dtype, gen)
    outs = []
    for limit in (1 << 40, 5 * 2049 * 7 - 1):
        monkeypatch.setattr(rmsnorm, "_EVICT_FIRST_MAX_BYTES", limit)
        clear_launch_plans()
        with poisoned_outputs():
            outs.append(rmsnorm.fused_add_rms_norm(x, res, w, 1e-5, fp8=fp8))
    assert [k["INPUT_EVICT"] for k in spy.launches] == ["evict_first", ""]
    (y0, r0, *s0), (y1, r1, *s1) = outs
    assert torch.equal(r0, r1) and torch.equal(r0, _sum_like_kernel(x, res))
    assert torch.equal(y0.view(torch.uint8), y1.view(torch.uint8)) and all(torch.equal(a, b) for a, b in zip(s0, s1))
    y_ref = _norm_ref(r0, w, 1e-5, True)
    if fp8 is None:
        assert_close(y0, y_ref, dtype, seed=gen.seed_value)
    else:
        q_ref, s_ref = rmsnorm.fp8_quantize_ref(y_ref, y0.dtype)
        check_fp8(y0, q_ref, y0.dtype, "per_token with and without the hint", gen.seed_value)
        assert_close(s0[0], s_ref, torch.float32, rtol=1e-5, atol=0, seed=gen.seed_value)
    spy.launches.clear()
    monkeypatch.setattr(rmsnorm, "_EVICT_FIRST_MAX_BYTES", 1 << 40)
    clear_launch_plans()
    rmsnorm.rms_norm(x, w)
    rmsnorm.gated_residual_rms_norm_modulate(x, res, None, w, w)
    assert [k["INPUT_EVICT"] for k in spy.launches] == ["", ""]

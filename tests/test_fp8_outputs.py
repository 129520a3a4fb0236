# SPDX-License-Identifier: Apache-2.0
"""FP8 outputs for FP8 GEMM inputs: rms_norm_modulate and gated_residual_rms_norm_modulate (rmsnorm.py),
gelu and fp8_quantize (activations.py), per token and per tensor, against a float64 quantisation of the
float64 reference."""

import pytest
import torch

import activations as act
import rmsnorm
from kernel_testing import DEVICE, DTYPES, assert_close, poisoned_outputs, randn
from test_fused_add_rmsnorm import FP8_DTYPES, FP8_MAX, _fp8_step, _norm_ref, check_fp8

SHAPES = [(1, 127), (3, 2049), (2, 5, 96), (32, 256)]


def _check_per_token(q, s, y_ref, fp8_dtype, name, seed):
    """Per-token FP8 output q with scales s against the float64 output y_ref."""
    assert q.dtype == fp8_dtype and q.shape == y_ref.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == y_ref.shape[:-1]
    q_ref, s_ref = rmsnorm.fp8_quantize_ref(y_ref, fp8_dtype)
    assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, name=f"{name} scales", seed=seed)
    check_fp8(q, q_ref, fp8_dtype, name, seed)
    deq = q.double() * s.double()[..., None]
    assert bool(((deq - y_ref).abs() <= _fp8_step(q_ref, fp8_dtype) * s_ref[..., None] * 1.0001).all()), name


def _modulation(shape, dtype, gen):
    """scale and shift of one row per sample ([B, 1, D]) for a 3-D shape, else per token."""
    mshape = (shape[0], 1, shape[-1]) if len(shape) == 3 else shape
    return randn(mshape, dtype, gen, scale=0.5), randn(mshape, dtype, gen, scale=0.5)


# ---- rms_norm_modulate ---------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_modulate_per_token(shape, dtype, fp8_dtype, gen):
    x = randn(shape, dtype, gen, scale=2.0)
    scale, shift = _modulation(shape, dtype, gen)
    with poisoned_outputs():
        q, s = rmsnorm.rms_norm_modulate(x, scale, shift, fp8="per_token", fp8_dtype=fp8_dtype)
    y_ref = rmsnorm.rms_norm_modulate_ref(x.double(), scale.double(), shift.double())
    _check_per_token(q, s, y_ref, fp8_dtype, f"rms_norm_modulate {dtype}", gen.seed_value)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_modulate_per_tensor_with_weight(dtype, fp8_dtype, gen):
    shape = (2, 7, 320)
    x = randn(shape, dtype, gen, scale=2.0)
    scale, shift = _modulation(shape, dtype, gen)
    w = randn((320,), dtype, gen, scale=0.2, offset=1.0)
    fp8_scale = torch.tensor([2.0 / FP8_MAX[fp8_dtype]], dtype=torch.float32, device=DEVICE)  # saturates some
    with poisoned_outputs():
        q = rmsnorm.rms_norm_modulate(x, scale, shift, w, fp8="per_tensor", fp8_scale=fp8_scale, fp8_dtype=fp8_dtype)
    # rms(x) rounded to x's dtype before the weight (cast_before_weight, the default), as the kernel does
    y_ref = _norm_ref(x, w, 1e-6, True) * (1 + scale.double()) + shift.double()
    q_ref, _ = rmsnorm.fp8_quantize_ref(y_ref, fp8_dtype, fp8_scale.double())
    check_fp8(q, q_ref, fp8_dtype, f"rms_norm_modulate per_tensor {dtype}", gen.seed_value)
    assert (q.double().abs() == FP8_MAX[fp8_dtype]).any(), "expected some saturated values"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [True, False])
def test_gated_residual_rms_norm_modulate_per_token(gated, dtype, gen):
    shape = (2, 9, 160)
    h = randn(shape, dtype, gen, scale=2.0)
    y = randn(shape, dtype, gen)
    gate = randn((2, 1, 160), dtype, gen) if gated else None
    scale, shift = _modulation(shape, dtype, gen)
    with poisoned_outputs():
        h_new, q, s = rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, scale, shift, fp8="per_token")
        h_plain, _ = rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, scale, shift)
    assert torch.equal(h_new, h_plain), "the residual stream must not depend on the output format"
    y_ref = rmsnorm.rms_norm_modulate_ref(h_new.double(), scale.double(), shift.double())  # of the stored h
    _check_per_token(q, s, y_ref, q.dtype, f"gated residual {dtype}", gen.seed_value)


def test_gated_residual_per_tensor_returns_two(gen):
    h, y = randn((4, 64), torch.float32, gen), randn((4, 64), torch.float32, gen)
    fp8_scale = torch.tensor([0.01], device=DEVICE)
    with poisoned_outputs():
        out = rmsnorm.gated_residual_rms_norm_modulate(h, y, None, None, None, fp8="per_tensor", fp8_scale=fp8_scale)
    assert len(out) == 2 and out[1].dtype in FP8_DTYPES
    q_ref, _ = rmsnorm.fp8_quantize_ref(rmsnorm.rms_norm_ref(out[0].double()), out[1].dtype, fp8_scale.double())
    check_fp8(out[1], q_ref, out[1].dtype, "plain residual norm per_tensor", gen.seed_value)


# ---- gelu with FP8 output ------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_per_token(shape, dtype, approximate, fp8_dtype, gen):
    x = randn(shape, dtype, gen, scale=3.0)
    with poisoned_outputs():
        q, s = act.gelu(x, approximate, fp8="per_token", fp8_dtype=fp8_dtype)
    _check_per_token(q, s, act.gelu_ref(x.double(), approximate), fp8_dtype, f"gelu {approximate}", gen.seed_value)


def test_gelu_per_tensor_strided_rows(gen):
    wide = randn((6, 3 * 96), torch.bfloat16, gen, scale=3.0)
    x = wide[:, 96:192]  # rows 3 * 96 elements apart, read in place
    fp8_scale = torch.tensor([0.5 / 448.0], device=DEVICE)
    with poisoned_outputs():
        q = act.gelu(x, fp8="per_tensor", fp8_scale=fp8_scale, fp8_dtype=torch.float8_e4m3fn)
    q_ref, _ = rmsnorm.fp8_quantize_ref(act.gelu_ref(x.double()), torch.float8_e4m3fn, fp8_scale.double())
    check_fp8(q, q_ref, torch.float8_e4m3fn, "gelu per_tensor strided", gen.seed_value)


def test_gelu_per_token_two_pass_rows(gen, monkeypatch):
    """Rows wider than one block: a pass for the row maximum, then one that quantises."""
    monkeypatch.setattr(act, "_MAX_WHOLE_ROW", 64)
    monkeypatch.setattr(act, "_ROW_CHUNK", 32)
    x = randn((5, 300), torch.float32, gen, scale=3.0)
    with poisoned_outputs():
        q, s = act.gelu(x, fp8="per_token", fp8_dtype=torch.float8_e4m3fnuz)
    _check_per_token(q, s, act.gelu_ref(x.double()), torch.float8_e4m3fnuz, "gelu two-pass", gen.seed_value)


# ---- fp8_quantize --------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_quantize_per_token(shape, dtype, fp8_dtype, gen):
    x = randn(shape, dtype, gen, scale=4.0)
    with poisoned_outputs():
        q, s = act.fp8_quantize(x, fp8_dtype=fp8_dtype)
    _check_per_token(q, s, x.double(), fp8_dtype, f"fp8_quantize {dtype}", gen.seed_value)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_quantize_per_tensor_power_of_two_scale_is_exact(fp8_dtype, gen):
    """x / 2**-6 is exact in fp32 and float64: the kernel's FP8 values equal the reference's everywhere."""
    x = randn((8, 200), torch.bfloat16, gen, scale=2.0)
    fp8_scale = torch.tensor([2.0**-6], device=DEVICE)
    with poisoned_outputs():
        q = act.fp8_quantize(x, "per_tensor", fp8_scale=fp8_scale, fp8_dtype=fp8_dtype)
    q_ref, _ = rmsnorm.fp8_quantize_ref(x.double(), fp8_dtype, fp8_scale.double())
    assert torch.equal(q.double(), q_ref.to(q.device)), "a power-of-two scale must quantise exactly"


def test_fp8_quantize_zero_and_saturated_rows():
    x = torch.zeros((2, 64), device=DEVICE)
    x[1] = 5.0
    with poisoned_outputs():
        q, s = act.fp8_quantize(x, fp8_dtype=torch.float8_e4m3fn)
    assert float(s[0]) == pytest.approx(1e-12) and bool((q[0].double() == 0).all())
    assert bool((q[1].double() == 448.0).all())
    assert not torch.isnan(q.double()).any()


# ---- refused calls -------------------------------------------------------------------------------
def _x():
    return torch.ones((2, 64), device=DEVICE)


ERRORS = {
    "unknown mode": (lambda: act.fp8_quantize(_x(), "per_row"), ValueError, "fp8 must be"),
    "no mode": (lambda: act.fp8_quantize(_x(), None), ValueError, "fp8 must be"),
    "scale without per_tensor": (
        lambda: act.fp8_quantize(_x(), fp8_scale=torch.ones(1, device=DEVICE)),
        ValueError,
        "fp8_scale is only used",
    ),
    "per_tensor without scale": (lambda: act.fp8_quantize(_x(), "per_tensor"), ValueError, "fp8_scale"),
    "gelu fp8_dtype without fp8": (
        lambda: act.gelu(_x(), fp8_dtype=torch.float8_e4m3fn),
        ValueError,
        "fp8_dtype is only used",
    ),
    "gelu bad approximate": (lambda: act.gelu(_x(), "fast", fp8="per_token"), ValueError, "approximate"),
    "int input": (lambda: act.fp8_quantize(torch.ones((2, 4), dtype=torch.int32, device=DEVICE)), TypeError, "dtype"),
    "scalar input": (lambda: act.fp8_quantize(torch.ones((), device=DEVICE)), ValueError, "at least one dimension"),
    "modulate scale without per_tensor": (
        lambda: rmsnorm.rms_norm_modulate(_x(), _x(), _x(), fp8_scale=torch.ones(1, device=DEVICE)),
        ValueError,
        "fp8_scale is only used",
    ),
    "gated unknown mode": (
        lambda: rmsnorm.gated_residual_rms_norm_modulate(_x(), _x(), None, None, None, fp8="fp4"),
        ValueError,
        "fp8 must be",
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
    fn, exc, match = ERRORS[case]
    with pytest.raises(exc, match=match):
        fn()


def test_no_grad_required(gen):
    x = randn((2, 64), torch.float32, gen).requires_grad_()
    with pytest.raises(RuntimeError, match="requires grad"):
        act.fp8_quantize(x)
    with torch.no_grad():
        q, s = act.fp8_quantize(x)
    assert q.shape == x.shape


def test_ops_under_torch_compile(gen):
    """The FP8 outputs trace through torch.compile (registered ops with fakes) and give the eager result."""
    import kernel_testing as kt

    x = randn((3, 5, 64), torch.float32, gen, scale=2.0)
    scale, shift = _modulation(x.shape, torch.float32, gen)
    sc = torch.tensor([0.02], device=DEVICE)

    def f(x, scale, shift, sc):
        q, s = act.fp8_quantize(x)
        g = act.gelu(x, fp8="per_tensor", fp8_scale=sc)
        n, ns = rmsnorm.rms_norm_modulate(x, scale, shift, fp8="per_token")
        return q.float() * s[..., None] + g.float() * sc + n.float() * ns[..., None]

    compiled = kt.compile_aot_eager(f)
    assert torch.equal(compiled(x, scale, shift, sc), f(x, scale, shift, sc))
    torch._dynamo.reset()
    op = getattr(torch.ops, act._NS).act_fp8.default
    for args in [(x, 3, 2, None, None), (x, 1, 1, sc, torch.float8_e4m3fnuz), (x, 0, 2, None, torch.float8_e4m3fn)]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

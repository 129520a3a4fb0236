# SPDX-License-Identifier: Apache-2.0
"""RMSNorm, AdaLN-modulated RMSNorm and gated-residual + RMSNorm + modulation, against float64 references
and against the real diffusers / torch modules."""

from types import SimpleNamespace

import pytest
import torch

import kernel_testing as kt
import rmsnorm
from kernel_testing import DEVICE, DTYPES, INTERPRET, TOL, assert_close, ones, poisoned_outputs, randn


def _module_tol(dtype):
    """Kernel vs the real module: both round at the same places, so natively they differ by at most
    the last bit of an fp32 sum (<= 1 ulp of the output: half of TOL). The interpreter truncates
    each fp32 -> bf16 cast instead of rounding (up to 2 ulps after two casts): full TOL there."""
    t = TOL[dtype]
    return t if (INTERPRET and dtype == torch.bfloat16) else {k: v / 2 for k, v in t.items()}


SHAPES = [(1, 1), (1, 127), (3, 2049), (2, 5, 64), (2, 3, 7, 96)]


def _weight(n, dtype, gen):
    return randn((n,), dtype, gen, scale=0.2, offset=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_weight", [False, True])
def test_rms_norm_matches_float64(shape, dtype, with_weight, gen):
    x = randn(shape, dtype, gen, scale=3.0, offset=0.5)
    w = _weight(shape[-1], dtype, gen) if with_weight else None
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, w, eps=1e-6)
    ref = rmsnorm.rms_norm_ref(x.double(), None if w is None else w.double(), eps=1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref, dtype, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fp32_weight_multiply_and_out_dtype(dtype, gen):
    """diffusers RMSNorm with an fp32 weight multiplies in fp32 and returns fp32."""
    x = randn((4, 300), dtype, gen)
    w = _weight(300, torch.float32, gen)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, w, 1e-6, cast_before_weight=False, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = rmsnorm.rms_norm_ref(x.double(), w.double(), 1e-6, cast_before_weight=False)
    assert_close(out, ref, torch.float32, rtol=2e-6, atol=2e-6, seed=gen.seed_value)


@pytest.mark.parametrize("width", [1, 127, 2049])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_path_for_wide_rows(width, dtype, gen, monkeypatch):
    """Rows wider than one block are processed in chunks; shrink the limits to exercise that path cheaply."""
    monkeypatch.setattr(rmsnorm, "_MAX_FUSED_N", 64)
    monkeypatch.setattr(rmsnorm, "_CHUNK_N", 32)
    x = randn((3, width), dtype, gen)
    w = _weight(width, dtype, gen)
    h = randn((3, width), dtype, gen)
    gate = randn((width,), dtype, gen)
    sc = randn((3, width), dtype, gen, scale=0.3)
    sh = randn((width,), dtype, gen, scale=0.3)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, w)
        h_new, mod = rmsnorm.gated_residual_rms_norm_modulate(h, x, gate, sc, sh, w)
    assert_close(out, rmsnorm.rms_norm_ref(x.double(), w.double()), dtype, seed=gen.seed_value)
    h_ref, mod_ref = rmsnorm.gated_residual_rms_norm_modulate_ref(
        h.double(), x.double(), gate.double(), sc.double(), sh.double(), w.double()
    )
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    # normalise the kernel's own rounded h (as the model does), so only the norm's error is compared
    mod_ref2 = rmsnorm.rms_norm_modulate_ref(h_new.double(), sc.double(), sh.double(), w.double())
    assert_close(mod, mod_ref2, dtype, name="out", seed=gen.seed_value)


def test_wide_row_16384_single_pass(gen):
    x = randn((2, 16384), torch.float32, gen)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x)
    assert_close(out, rmsnorm.rms_norm_ref(x.double()), torch.float32, seed=gen.seed_value)


def test_wide_row_20000_default_chunking(gen):
    x = randn((1, 20000), torch.float32, gen)
    w = _weight(20000, torch.float32, gen)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, w)
    assert_close(out, rmsnorm.rms_norm_ref(x.double(), w.double()), torch.float32, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_without_copy(dtype, gen):
    """q sliced out of a fused [B, S, 3C] projection: rows are strided, the last dim is contiguous."""
    big = randn((2, 9, 3 * 96), dtype, gen)
    x = big[:, :, 96:192]
    assert not x.is_contiguous()
    w = _weight(96, dtype, gen)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, w)
    assert_close(out, rmsnorm.rms_norm_ref(x.double(), w.double()), dtype, seed=gen.seed_value)
    # a transposed leading layout ([S, B, C] viewed as [B, S, C])
    y = randn((9, 2, 96), dtype, gen).transpose(0, 1)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(y)
    assert_close(out, rmsnorm.rms_norm_ref(y.double()), dtype, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mod_shape", ["D", "B1D", "BSD", "11D"])
@pytest.mark.parametrize("with_weight", [False, True])
def test_rms_norm_modulate(dtype, mod_shape, with_weight, gen):
    B, S, D = 3, 5, 129
    x = randn((B, S, D), dtype, gen, scale=2.0)
    shape = {"D": (D,), "B1D": (B, 1, D), "BSD": (B, S, D), "11D": (1, 1, D)}[mod_shape]
    sc = randn(shape, dtype, gen, scale=0.5)
    sh = randn(shape, dtype, gen, scale=0.5)
    w = _weight(D, dtype, gen) if with_weight else None
    with poisoned_outputs():
        out = rmsnorm.rms_norm_modulate(x, sc, sh, w, eps=1e-6)
    ref = rmsnorm.rms_norm_modulate_ref(
        x.double(), sc.double(), sh.double(), None if w is None else w.double(), eps=1e-6
    )
    assert_close(out, ref, dtype, seed=gen.seed_value)


def test_modulate_with_ltx_views(gen):
    """scale/shift as LTX makes them: unbind of [B, 1, 6, D], so views with a stride of 6*D."""
    B, S, D = 2, 7, 64
    x = randn((B, S, D), torch.bfloat16, gen)
    ada = randn((B, 1, 6, D), torch.bfloat16, gen, scale=0.3)
    shift, scale, gate, *_ = ada.unbind(dim=2)
    with poisoned_outputs():
        out = rmsnorm.rms_norm_modulate(x, scale, shift)
    ref = rmsnorm.rms_norm_modulate_ref(x.double(), scale.double(), shift.double())
    assert_close(out, ref, torch.bfloat16, seed=gen.seed_value)


def _residual_inputs(B, S, D, dtype, gate_shape, gen):
    """h [B, S, D] (scale 2), y [B, S, D] and a gate of the given shape (None: no gate), drawn in that order."""
    h = randn((B, S, D), dtype, gen, scale=2.0)
    y = randn((B, S, D), dtype, gen)
    gate = None
    if gate_shape is not None:
        gate = randn({"B1D": (B, 1, D), "BSD": (B, S, D), "D": (D,)}[gate_shape], dtype, gen)
    return h, y, gate


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_shape", [None, "B1D", "BSD", "D"])
def test_gated_residual_rms_norm_modulate(dtype, gate_shape, gen):
    B, S, D = 2, 6, 131
    h, y, gate = _residual_inputs(B, S, D, dtype, gate_shape, gen)
    sc = randn((B, 1, D), dtype, gen, scale=0.5)
    sh = randn((B, 1, D), dtype, gen, scale=0.5)
    with poisoned_outputs():
        h_new, out = rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, sc, sh)
    h_ref, _ = rmsnorm.gated_residual_rms_norm_modulate_ref(
        h.double(), y.double(), None if gate is None else gate.double(), sc.double(), sh.double()
    )
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    out_ref = rmsnorm.rms_norm_modulate_ref(h_new.double(), sc.double(), sh.double())
    assert_close(out, out_ref, dtype, name="out", seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_shape", [None, "B1D", "BSD", "D"])
@pytest.mark.parametrize("chunked", [False, True])
def test_gated_residual_add(dtype, gate_shape, chunked, gen, monkeypatch):
    """h + y * gate alone (the norm switched off), one rounding; also through the chunked path."""
    if chunked:
        monkeypatch.setattr(rmsnorm, "_MAX_FUSED_N", 64)
        monkeypatch.setattr(rmsnorm, "_CHUNK_N", 32)
    B, S, D = 2, 5, 131
    h, y, gate = _residual_inputs(B, S, D, dtype, gate_shape, gen)
    with poisoned_outputs():
        out = rmsnorm.gated_residual_add(h, y, gate)
    ref = rmsnorm.gated_residual_add_ref(h.double(), y.double(), None if gate is None else gate.double())
    assert out.shape == h.shape and out.dtype == dtype
    assert_close(out, ref, dtype, seed=gen.seed_value)
    if not INTERPRET:  # natively it rounds exactly like torch.addcmul (fp32 math, one rounding)
        expect = torch.addcmul(h, y, gate) if gate is not None else h + y
        assert_close(
            out,
            expect.double(),
            dtype,
            rtol=TOL[dtype]["rtol"] / 2,
            atol=TOL[dtype]["atol"] / 2,
            name="vs addcmul",
            seed=gen.seed_value,
        )


def test_gated_residual_add_strided_and_errors(gen):
    base = randn((2, 8, 96), torch.float32, gen)
    h = base[:, ::2]  # strided rows, no copy
    y = randn((2, 4, 96), torch.float32, gen)
    gate = randn((2, 1, 96), torch.float32, gen)
    with poisoned_outputs():
        out = rmsnorm.gated_residual_add(h, y, gate)
    assert_close(
        out, rmsnorm.gated_residual_add_ref(h.double(), y.double(), gate.double()), torch.float32, seed=gen.seed_value
    )
    assert rmsnorm.gated_residual_add(h[:, :0], y[:, :0], gate).shape == (2, 0, 96)
    with pytest.raises(ValueError, match="y has shape"):
        rmsnorm.gated_residual_add(h, y[..., :95], gate)
    with pytest.raises(ValueError, match="does not broadcast"):
        rmsnorm.gated_residual_add(h, y, gate[..., :95])
    with pytest.raises(TypeError, match="y has dtype"):
        rmsnorm.gated_residual_add(h, y.half(), gate)
    with pytest.raises(ValueError, match="y is required"):
        rmsnorm.gated_residual_add(h, None, gate)


def test_residual_without_modulation(gen):
    h = randn((4, 100), torch.float16, gen)
    y = randn((4, 100), torch.float16, gen)
    w = _weight(100, torch.float16, gen)
    with poisoned_outputs():
        h_new, out = rmsnorm.gated_residual_rms_norm_modulate(h, y, None, None, None, w)
    h_ref, out_ref = rmsnorm.gated_residual_rms_norm_modulate_ref(h.double(), y.double(), None, None, None, w.double())
    assert_close(h_new, h_ref, torch.float16, seed=gen.seed_value)
    assert_close(out, rmsnorm.rms_norm_ref(h_new.double(), w.double()), torch.float16, seed=gen.seed_value)


# ---- against the real modules ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [False, True])
def test_matches_diffusers_rmsnorm(dtype, affine, gen):
    from diffusers.models.normalization import RMSNorm

    D = 200
    m = RMSNorm(D, eps=1e-6, elementwise_affine=affine)
    if affine:
        m.weight.data = randn((D,), torch.float32, gen, scale=0.2, offset=1.0, device="cpu")
    m = m.to(DEVICE, dtype).requires_grad_(False)  # inference: the kernels have no backward
    x = randn((2, 9, D), dtype, gen, scale=2.0)
    expected = m(x)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, m.weight, m.eps)
    assert out.dtype == expected.dtype
    # both round at the same places; the only difference is the order of fp32 summation: <= 1 ulp
    assert_close(out, expected.double(), dtype, **_module_tol(dtype), seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [1e-5, None])
def test_matches_torch_rmsnorm(dtype, eps, gen):
    D = 150
    m = torch.nn.RMSNorm(D, eps=eps)
    m.weight.data = randn((D,), torch.float32, gen, scale=0.2, offset=1.0, device="cpu")
    m = m.to(DEVICE, dtype).requires_grad_(False)  # inference: the kernels have no backward
    x = randn((3, 4, D), dtype, gen)
    expected = m(x)
    # torch.nn.RMSNorm multiplies the weight in fp32 and rounds once; eps=None means fp32's epsilon
    eff_eps = torch.finfo(torch.float32).eps if eps is None else eps
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, m.weight, eff_eps, cast_before_weight=False)
    assert_close(out, expected.double(), dtype, **_module_tol(dtype), seed=gen.seed_value)


def test_matches_llama_rmsnorm_bf16(gen):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    D = 256
    m = LlamaRMSNorm(D, eps=1e-5)
    m.weight.data = randn((D,), torch.float32, gen, scale=0.2, offset=1.0, device="cpu")
    m = m.to(DEVICE, torch.bfloat16).requires_grad_(False)  # inference: the kernels have no backward
    x = randn((5, D), torch.bfloat16, gen, scale=4.0)
    expected = m(x)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, m.weight, 1e-5)
    # Natively the results agree to one bf16 ulp (only the fp32 summation order differs); the
    # interpreter truncates its two fp32 -> bf16 casts, which can cost two ulps.
    diff = (out.float() - expected.float()).abs()
    ulps = 2 if INTERPRET else 1
    ulp = expected.float().abs().clamp_min(2.0**-126) * 2.0**-7
    assert bool((diff <= ulps * ulp).all()), f"max diff {diff.max().item()} exceeds {ulps} bf16 ulp"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gemma_offset_weight(dtype, gen):
    """Gemma-style norms store the weight as an offset and compute norm(x) * (1 + w) in fp32 with one
    rounding: rms_norm(x, 1 + w in fp32, cast_before_weight=False) reproduces Gemma2RMSNorm up to the
    fp32 summation order (one ulp of fp16; in fp32 the order changes rstd by an ulp or two, which the
    products carry: four ulps)."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    D = 256
    m = gemma2.Gemma2RMSNorm(D, eps=1e-6)
    m.weight.data = randn((D,), torch.float32, gen, scale=0.3, device="cpu")
    m = m.to(DEVICE, dtype).requires_grad_(False)  # inference: the kernels have no backward
    x = randn((8, D), dtype, gen, scale=2.0, offset=0.3)
    expected = m(x)
    with poisoned_outputs():
        out = rmsnorm.rms_norm(x, 1.0 + m.weight.float(), 1e-6, cast_before_weight=False)
    assert out.dtype == dtype and out.shape == x.shape
    diff = (out.float() - expected.float()).abs()
    ulps, frac_bits = (1, 10) if dtype == torch.float16 else (4, 23)
    ulp = expected.float().abs().clamp_min(2.0**-14) * 2.0**-frac_bits
    assert bool((diff <= ulps * ulp).all()), f"max diff {diff.max().item()} exceeds {ulps} ulp (seed {gen.seed_value})"
    if dtype == torch.float16:
        # one rounding, as Gemma: bit-equal nearly everywhere (rounding before the weight, the Llama
        # convention, changes about a quarter of the elements by an ulp)
        assert (out != expected).float().mean().item() <= 0.01


# ---- empty and bad input --------------------------------------------------------------------
def test_empty_inputs():
    x = torch.empty((0, 64), device=DEVICE)
    assert rmsnorm.rms_norm(x).shape == (0, 64)
    x3 = torch.empty((2, 0, 64), device=DEVICE)
    sc = torch.ones((2, 1, 64), device=DEVICE)
    assert rmsnorm.rms_norm_modulate(x3, sc, sc).shape == (2, 0, 64)
    h_new, out = rmsnorm.gated_residual_rms_norm_modulate(x3, x3, None, sc, sc)
    assert h_new.shape == out.shape == (2, 0, 64)


def _error_inputs(gen):
    return SimpleNamespace(gen=gen, x=randn((2, 4, 64), torch.float32, gen))


ERROR_CASES = [
    *kt.norm_error_cases(rmsnorm.rms_norm, rmsnorm.rms_norm_modulate, rmsnorm.gated_residual_rms_norm_modulate),
    (
        "scale broadcast",
        ValueError,
        r"scale of shape \(3, 1, 64\) does not broadcast",
        lambda t: rmsnorm.rms_norm_modulate(t.x, ones(3, 1, 64), ones(2, 1, 64)),
    ),
    (
        "gated y dtype",
        TypeError,
        "y has dtype",
        lambda t: rmsnorm.gated_residual_rms_norm_modulate(t.x, t.x.half(), None, None, None),
    ),
    ("out_dtype int8", TypeError, "out_dtype", lambda t: rmsnorm.rms_norm(t.x, out_dtype=torch.int8)),
]


@kt.error_cases(ERROR_CASES)
def test_errors(case, gen):
    kt.assert_error_case(case, _error_inputs(gen))


@kt.cpu_only
def test_cpu_tensor_without_interpreter_is_rejected(monkeypatch):
    kt.assert_cpu_tensor_refused_without_interpreter(monkeypatch, lambda: rmsnorm.rms_norm(torch.ones(2, 8)))


def test_custom_op_under_torch_compile(gen):
    """torch.compile traces through the registered op (aot_eager keeps it cheap on the CPU)."""
    x = randn((2, 3, 64), torch.float32, gen)
    sc = randn((2, 1, 64), torch.float32, gen, scale=0.2)
    sh = randn((2, 1, 64), torch.float32, gen, scale=0.2)

    def f(x, sc, sh):
        h, out = rmsnorm.gated_residual_rms_norm_modulate(x, x * 2, None, sc, sh)
        return rmsnorm.rms_norm(out + h) * 3

    compiled = kt.compile_aot_eager(f)
    got = compiled(x, sc, sh)
    assert_close(got, f(x, sc, sh).double(), torch.float32, seed=gen.seed_value)
    torch.library.opcheck(
        getattr(torch.ops, rmsnorm._NS).rms_norm_fused.default,
        (x, x * 2, None, None, sc, sh, 1e-6, True, None),
        test_utils=("test_schema", "test_faketensor"),
    )


# ---- inputs requiring grad, eps validation, dtype under torch.compile -------------------------------
def _grad_cases(gen):
    """Public function -> (call taking a dict of named tensors, the tensors)."""
    f = torch.float32
    x, y = randn((2, 3, 64), f, gen), randn((2, 3, 64), f, gen)
    w, sc, sh, g = _weight(64, f, gen), randn((2, 1, 64), f, gen), randn((2, 1, 64), f, gen), randn((64,), f, gen)
    return {
        "rms_norm": (lambda t: rmsnorm.rms_norm(t["x"], t["weight"]), dict(x=x, weight=w)),
        "rms_norm_modulate": (
            lambda t: rmsnorm.rms_norm_modulate(t["x"], t["scale"], t["shift"], t["weight"]),
            dict(x=x, scale=sc, shift=sh, weight=w),
        ),
        "gated_residual_rms_norm_modulate": (
            lambda t: rmsnorm.gated_residual_rms_norm_modulate(
                t["h"], t["y"], t["gate"], t["scale"], t["shift"], t["weight"]
            ),
            dict(h=x, y=y, gate=g, scale=sc, shift=sh, weight=w),
        ),
        "gated_residual_add": (lambda t: rmsnorm.gated_residual_add(t["h"], t["y"], t["gate"]), dict(h=x, y=y, gate=g)),
        "fused_add_rms_norm": (
            lambda t: rmsnorm.fused_add_rms_norm(t["x"], t["residual"], t["weight"]),
            dict(x=x, residual=y, weight=w),
        ),
    }


@pytest.mark.parametrize(
    "fn",
    ["rms_norm", "rms_norm_modulate", "gated_residual_rms_norm_modulate", "gated_residual_add", "fused_add_rms_norm"],
)
def test_inputs_requiring_grad_are_refused_in_grad_mode(fn, gen):
    from test_launch import assert_refuses_inputs_requiring_grad

    call, tensors = _grad_cases(gen)[fn]
    assert_refuses_inputs_requiring_grad(fn, call, tensors)


def test_fp8_scale_requiring_grad_is_refused(gen):
    x, r, w = randn((2, 64), torch.float32, gen), randn((2, 64), torch.float32, gen), _weight(64, torch.float32, gen)
    s = torch.ones(1, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match="^fused_add_rms_norm: fp8_scale requires grad"):
        rmsnorm.fused_add_rms_norm(x, r, w, fp8="per_tensor", fp8_scale=s)


_EPS_CALLS = {
    "rms_norm": lambda x, eps: rmsnorm.rms_norm(x, eps=eps),
    "rms_norm_modulate": lambda x, eps: rmsnorm.rms_norm_modulate(x, x[:, :1], x[:, :1], eps=eps),
    "gated_residual_rms_norm_modulate": lambda x, eps: rmsnorm.gated_residual_rms_norm_modulate(
        x, x, None, None, None, eps=eps
    ),
    "fused_add_rms_norm": lambda x, eps: rmsnorm.fused_add_rms_norm(x, x, None, eps=eps),
}


@pytest.mark.parametrize("fn", sorted(_EPS_CALLS))
def test_eps_nan_and_bool_are_rejected(fn, gen):
    """eps must be a real non-negative number, as in layernorm.py: NaN (which never equals itself, so
    never finds a cached plan) and booleans are refused, also after a plan was cached for eps=1.0
    (True == 1.0 and hash(True) == hash(1.0): the plan key holds type(eps))."""
    import math

    call = _EPS_CALLS[fn]
    x = randn((2, 3, 64), torch.float32, gen)
    call(x, 1.0)
    call(x, 1)  # an int is a number
    for bad in (True, False, float("nan"), math.nan, math.nan, -1.0, "1e-6", None):
        with pytest.raises(ValueError, match="eps must be a non-negative float"):
            call(x, bad)


def test_eps_bool_rejected_under_torch_compile(gen):
    """The compiled path hands eps to a torch.library op, which takes True for 1.0: a bool must be refused
    before that."""
    x = randn((2, 64), torch.float32, gen)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: rmsnorm.rms_norm(x, eps=True), backend="eager")
    with pytest.raises(ValueError, match="eps must be a (non-negative )?float, got True"):
        compiled(x)


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16, None])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_gated_residual_add_dtype_under_torch_compile(gate_dtype, backend, gen):
    """bf16 h and y with an fp32 gate (Wan's modulation is fp32): eager returns bf16 (fp32 math, one
    rounding to h's dtype); the compiled path must return the same dtype and values."""
    h = randn((2, 5, 96), torch.bfloat16, gen, scale=2.0)
    y = randn((2, 5, 96), torch.bfloat16, gen)
    gate = None if gate_dtype is None else randn((2, 1, 96), gate_dtype, gen)
    eager = rmsnorm.gated_residual_add(h, y, gate)
    torch._dynamo.reset()
    compiled = torch.compile(rmsnorm.gated_residual_add, backend=backend, fullgraph=True)(h, y, gate)
    assert eager.dtype == compiled.dtype == torch.bfloat16
    ref = rmsnorm.gated_residual_add_ref(h.double(), y.double(), None if gate is None else gate.double())
    assert_close(compiled, ref, torch.bfloat16, seed=gen.seed_value, name="compiled")
    # one rounding of the same fp32 value: at most one bf16 step apart from the kernel (the interpreter
    # truncates where torch rounds), equal natively but for an FMA
    assert_close(
        compiled, eager.double(), torch.bfloat16, rtol=2.0**-7, atol=1e-6, name="compiled vs eager", seed=gen.seed_value
    )

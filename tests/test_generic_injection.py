# SPDX-License-Identifier: Apache-2.0
"""inject_generic_kernels / remove_generic_kernels (scripts/generic_injection.py): every module kind the
generic layer takes, injected into a small container, against the stock module on the same inputs (fp32 and
bf16) with the kernels' outputs poisoned before the launch; the kernel calls, the counts and the bit-exact
restoration; the fallbacks (autograd, hooks, subclasses, instance forwards, dtype mixes, layouts, GEGLU's
deprecated argument); the apply_rotary_emb dispatcher of a tiny FLUX's model file (install, removal, two
models of one file, each call form against diffusers' function, the forms it leaves to diffusers, pickling
and deep copies); and models a family takes, which get nothing of this layer. Tiny shapes through Triton's
interpreter on the CPU, or on a GPU."""

import types

import pytest
import torch
import torch.nn.functional as F
from diffusers.models import embeddings
from diffusers.models.activations import GEGLU, GELU, SwiGLU
from diffusers.models.normalization import (
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    CogVideoXLayerNormZero,
    FP32LayerNorm,
    LuminaRMSNormZero,
    RMSNorm,
    SD35AdaLayerNormZeroX,
)
from diffusers.models.transformers import transformer_flux
from torch import nn

import activations
import diffusers_injection as di
import generic_injection as gi
import injection_common as ic
import layernorm
import mmdit_injection as mi
import rmsnorm
import rope
from kernel_testing import (
    DEVICE,
    copied,
    count_calls,
    interpreter_bf16_round_to_nearest_even,
    needs_gpu_and_cpu,
    poisoned_outputs,
    randn,
    rel_l2,
    rel_max,
    run_model,
)

DIFFUSERS_ROPE = embeddings.apply_rotary_emb  # diffusers' own function (embeddings.py is never patched)
ZERO = {k: 0 for k in gi.KINDS}

# fp32 through the tiny FLUX: each kernel is the same math with one rounding and another summation order,
# a few fp32 ulps per op; far below 1e-5 of the output's magnitude.
FP32_REL = 1e-5


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the leaf kernels the generic layer uses (proves the kernels, not torch, ran). The GELU
    in a GEMM's epilogue is off here (where a GPU's BLAS verifies it, a bf16 GELU would not reach the GELU
    kernel): test_gelu_tanh_in_the_gemm_epilogue_where_verified takes that path."""
    monkeypatch.setattr(ic, "gemm_gelu_tanh_ok", lambda device, dtype: False)
    return count_calls(
        monkeypatch,
        (
            (rmsnorm, "rms_norm"),
            (rmsnorm, "rms_norm_modulate"),
            (layernorm, "layer_norm"),
            (layernorm, "layer_norm_modulate"),
            (layernorm, "layer_norm_modulate_dual"),
            (activations, "gelu_tanh"),
            (activations, "geglu"),
            (activations, "swiglu"),
            (rope, "rope_interleaved"),
            (rope, "rope_rotate_half"),
        ),
    )


@pytest.fixture(autouse=True)
def _rope_restored():
    """A failing test must not leave the RoPE dispatcher in a model file for the next one."""
    yield
    for site in list(gi._ROPE_SITES.values()):
        if site["globals"].get("apply_rotary_emb") is gi.apply_rotary_emb:
            site["globals"]["apply_rotary_emb"] = site["original"]
    gi._ROPE_SITES.clear()
    for mod in (transformer_flux, embeddings, mi):
        if mod.__dict__.get("apply_rotary_emb") is gi.apply_rotary_emb:
            mod.apply_rotary_emb = DIFFUSERS_ROPE


class Holder(nn.Module):
    """A small model holding one module (the generic layer searches a model's modules)."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *args, **kwargs):
        return self.m(*args, **kwargs)


def _run(module, args, kwargs=None):
    with torch.no_grad():
        return module(*args, **(kwargs or {}))


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _nothing_left(model):
    for m in model.modules():
        assert gi.STATE not in m.__dict__, f"{type(m).__name__} still marked as patched"
        assert "forward" not in m.__dict__, f"{type(m).__name__} keeps a patched forward"
        assert "_rtk_generic_rope" not in m.__dict__


# --------------------------------------------------------------------------------------------
# Tolerances against the stock module
# --------------------------------------------------------------------------------------------
# Each kernel computes in fp32 and rounds once to the output dtype (round to nearest even: under the
# interpreter inside interpreter_bf16_round_to_nearest_even, which makes its fp32 -> bf16 casts round as
# torch's and the GPUs' do). The stock module rounds its final result too, and in low precision it also
# rounds k intermediates (diffusers' RMSNorm: the normalised value before a bf16 weight, the product before
# a bias; an AdaLN: the norm, 1 + scale and the product before the shift; a GLU: the activation before the
# product). So, elementwise:
#   |kernel - stock| <= ulps * eps * |stock|        one ulp of the output (1 in bf16: both round once from
#                                                   fp32 values that differ by fp32 noise, so at most one
#                                                   rounding step apart; 4 in fp32, where that noise, from
#                                                   another summation order and rsqrt, is itself a few ulps)
#                     + k * eps * mag                one ulp of each intermediate the stock rounds (mag: the
#                                                   magnitude of the terms, float64, e.g. |norm * (1 + scale)|)
#                     + 2^-20 * (mag + 1)            fp32 arithmetic noise on values of that magnitude (the
#                                                   normalised rows have RMS 1: an absolute 2^-20 for a value
#                                                   near zero, where a sum of O(1) terms cancels)
# with eps the output dtype's (2^-7 bf16, 2^-23 fp32): about 2.5e-6 of an O(1) value in fp32. Where the kernel
# rounds where the module does (the norms, the GELUs: Case.same_rounding), two roundings of near-equal fp32
# values agree but where fp32 noise straddles a rounding boundary, so in bf16 at most a few percent of the
# elements may differ at all (0 to 0.2% for the norms, 1 to 2.5% for GELU's tanh, as measured here; an extra
# or a missing rounding, e.g. a wrong cast_before_weight, changes a quarter of them or more). A wrong weight,
# scale, shift, activation or channel pairing is off by far more, and so, in fp32, is a wrong eps: the rows'
# variance is ~0.1 (X_SCALE), where eps 1e-5 instead of 1e-6 moves a normalised value by ~5e-5 relative.
def assert_like_stock(got, stock, mag=None, k=0, *, same_rounding=False, what="output", seed=None):
    assert got.shape == stock.shape and got.dtype == stock.dtype, f"{what}: {got.shape}/{got.dtype} vs stock"
    eps = torch.finfo(stock.dtype).eps
    ulps = 1 if stock.dtype in (torch.bfloat16, torch.float16) else 4
    g, s = got.detach().double().cpu(), stock.detach().double().cpu()
    mag = s.abs() if mag is None else mag.detach().double().cpu().expand_as(s)
    tol = ulps * eps * torch.maximum(s.abs(), g.abs()) + k * eps * mag + 2.0**-20 * (mag + 1)
    err = (g - s).abs()
    if same_rounding and stock.dtype in (torch.bfloat16, torch.float16):
        differ = float((g != s).double().mean())
        assert differ <= 0.05, f"{what}: {differ:.1%} of the elements differ from the stock ones (seed {seed})"
    bad = ~(err <= tol)  # NaN (an element the kernel did not write) is bad
    if bad.any():
        i = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {s.numel()} elements beyond tolerance (seed {seed}); first at {i}: "
            f"got {g[i].item()!r}, stock {s[i].item()!r}, tol {tol[i].item():.3e}; max err {err.max().item():.3e}"
        )


def _ln64(x, eps):
    return F.layer_norm(x.double(), (x.shape[-1],), eps=eps)


def _rms64(x, eps):
    x = x.double()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def _p(t):
    return None if t is None else t.detach().double()


def _modulated(norm_mag, scale, shift=None):
    """The terms' magnitude of norm * (1 + scale[:, None]) + shift[:, None] (per-sample [B, D] chunks)."""
    mag = norm_mag * (1 + _p(scale))[:, None].abs()
    return mag if shift is None else mag + _p(shift)[:, None].abs()


def _affine(n, weight, bias):
    """|n * weight| + |bias| (+ |weight|: the norm's own O(1) terms), for the noise term."""
    w = torch.ones(()) if weight is None else _p(weight).abs()
    mag = (n.abs() + 1) * w
    return mag if bias is None else mag + _p(bias).abs()


# --------------------------------------------------------------------------------------------
# The module kinds, each in a small container, against the stock module
# --------------------------------------------------------------------------------------------
D = 64  # hidden size; x is [B, S, D] = [2, 5, 64] (B != S: the per-sample chunks are unambiguous)
X_SCALE = 0.3  # row variance ~0.1: an eps off by 1e-5 moves a normalised value by ~5e-5 relative


def _init_(module, gen):
    """Fresh random parameters from gen: norm weights around 1, small biases, matrices (linear, conv) of scale
    1 / sqrt(fan_in)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(randn(p.shape, p.dtype, gen, scale=p[0].numel() ** -0.5))
            elif name.endswith("weight"):
                p.copy_(randn(p.shape, p.dtype, gen, scale=0.2, offset=1.0))
            else:
                p.copy_(randn(p.shape, p.dtype, gen, scale=0.2))
    return module


class Case:
    """A module of one kind with its inputs: module, args, kwargs, the kind it counts under, the kernel calls
    one forward makes, and checks: {output index: (mag, k)} for the outputs the kernels compute (every other
    output must equal the stock one bit for bit); same_rounding: see assert_like_stock."""

    def __init__(self, module, args, kind, calls, checks, kwargs=None, same_rounding=False):
        self.module, self.args, self.kind, self.calls, self.checks = module, args, kind, calls, checks
        self.kwargs = kwargs or {}
        self.same_rounding = same_rounding  # the kernel rounds where the module does (see assert_like_stock)


def _x(dtype, gen, s=5):
    return randn((2, s, D), dtype, gen, scale=X_SCALE)


def _build(module, dtype, gen, keep_fp32=()):
    """module with random parameters, in dtype (the parameters named in keep_fp32 stay fp32)."""
    _init_(module.to(DEVICE), gen)
    for name, p in module.named_parameters():
        if name not in keep_fp32:
            p.data = p.data.to(dtype)
    return module


def _rms_case(m, dtype, gen, eps, k):
    x = _x(dtype, gen)
    mag = _affine(_rms64(x, eps), m.weight, getattr(m, "bias", None))
    return Case(m, (x,), "generic_rmsnorm", {"rms_norm": 1}, {0: (mag, k)}, same_rounding=True)


def case_rmsnorm_no_weight(dtype, gen):
    return _rms_case(_build(RMSNorm(D, eps=1e-6, elementwise_affine=False), dtype, gen), dtype, gen, 1e-6, 0)


def case_rmsnorm_weight(dtype, gen):
    # a weight of the model's dtype: bf16 rounds the normalised value before the multiply (the kernel too)
    return _rms_case(_build(RMSNorm(D, eps=1e-5), dtype, gen), dtype, gen, 1e-5, 1)


def case_rmsnorm_fp32_weight(dtype, gen):
    # an fp32 weight on a bf16 input: torch's promotion makes the result fp32 (no bf16 rounding at all)
    return _rms_case(_build(RMSNorm(D, eps=1e-6), dtype, gen, keep_fp32=("weight",)), dtype, gen, 1e-6, 0)


def case_rmsnorm_bias(dtype, gen):
    # diffusers adds the bias after the weight, in the result's dtype: the product is rounded before the add
    return _rms_case(_build(RMSNorm(D, eps=1e-6, bias=True), dtype, gen), dtype, gen, 1e-6, 2)


def _torch_rmsnorm_case(eps):
    def case(dtype, gen):
        # torch rounds once after the weight (2.13), or also before it: the probe the kernel follows tells
        k = 1 if gi._torch_rms_rounding() else 0
        e = torch.finfo(torch.float32).eps if eps is None else eps
        return _rms_case(_build(nn.RMSNorm(D, eps=eps), dtype, gen), dtype, gen, e, k)

    return case


def _layernorm_case(cls, **kw):
    def case(dtype, gen):
        m = _build(cls(D, **kw), dtype, gen)
        x = _x(dtype, gen)
        mag = _affine(_ln64(x, m.eps), m.weight, m.bias)
        return Case(m, (x,), "generic_layernorm", {"layer_norm": 1}, {0: (mag, 0)}, same_rounding=True)

    return case


def _emb(dtype, gen, n=32):
    return randn((2, n), dtype, gen)


def _chunks(m, emb, n):
    with torch.no_grad():
        return m.linear(m.silu(emb)).chunk(n, dim=1)


def _adaln_zero_case(norm_type):
    def case(dtype, gen):
        m = _build(AdaLayerNormZero(D, norm_type=norm_type), dtype, gen)
        x, emb = _x(dtype, gen), _emb(dtype, gen, D)
        shift, scale = _chunks(m, emb, 6)[:2]
        mag = _modulated(_ln64(x, m.norm.eps).abs() + 1, scale, shift)
        return Case(m, (x,), "generic_adaln", {"layer_norm_modulate": 1}, {0: (mag, 3)}, kwargs={"emb": emb})

    return case


def case_adaln_zero_class_labels(dtype, gen):
    # DiT's: the module embeds the timestep and the class label itself (eval: no label dropout)
    m = _build(AdaLayerNormZero(D, num_embeddings=10), dtype, gen).eval()
    x = _x(dtype, gen)
    t, labels = torch.tensor([3.0, 700.0], device=DEVICE), torch.tensor([1, 7], device=DEVICE)
    with torch.no_grad():
        shift, scale = _chunks(m, m.emb(t, labels, hidden_dtype=dtype), 6)[:2]
    mag = _modulated(_ln64(x, m.norm.eps).abs() + 1, scale, shift)
    return Case(m, (x, t, labels, dtype), "generic_adaln", {"layer_norm_modulate": 1}, {0: (mag, 3)})


def case_adaln_zero_single(dtype, gen):
    m = _build(AdaLayerNormZeroSingle(D), dtype, gen)
    x, emb = _x(dtype, gen), _emb(dtype, gen, D)
    shift, scale = _chunks(m, emb, 3)[:2]
    mag = _modulated(_ln64(x, m.norm.eps).abs() + 1, scale, shift)
    return Case(m, (x, emb), "generic_adaln", {"layer_norm_modulate": 1}, {0: (mag, 3)})


def _adaln_continuous_case(norm_type):
    def case(dtype, gen):
        m = _build(AdaLayerNormContinuous(D, 32, elementwise_affine=True, eps=1e-5, norm_type=norm_type), dtype, gen)
        x, cond = _x(dtype, gen), _emb(dtype, gen)
        scale, shift = _chunks(m, cond, 2)
        if norm_type == "layer_norm":
            n, calls, k = _affine(_ln64(x, 1e-5), m.norm.weight, m.norm.bias), {"layer_norm_modulate": 1}, 3
        else:  # diffusers' RMSNorm with a weight: in bf16 also the normalised value is rounded before it
            n, calls, k = _affine(_rms64(x, 1e-5), m.norm.weight, None), {"rms_norm_modulate": 1}, 4
        return Case(m, (x, cond), "generic_adaln", calls, {0: (_modulated(n, scale, shift), k)})

    return case


def case_sd35_adaln_zero_x(dtype, gen):
    m = _build(SD35AdaLayerNormZeroX(D), dtype, gen)
    x, emb = _x(dtype, gen), _emb(dtype, gen, D)
    c = _chunks(m, emb, 9)
    n = _ln64(x, m.norm.eps).abs() + 1
    checks = {0: (_modulated(n, c[1], c[0]), 3), 5: (_modulated(n, c[7], c[6]), 3)}
    return Case(m, (x, emb), "generic_adaln", {"layer_norm_modulate_dual": 1}, checks)


def case_cogvideox_layernorm_zero(dtype, gen):
    m = _build(CogVideoXLayerNormZero(32, D, elementwise_affine=True, eps=1e-5), dtype, gen)
    h, enc, temb = _x(dtype, gen), _x(dtype, gen, s=3), _emb(dtype, gen)
    shift, scale, _, enc_shift, enc_scale, _ = _chunks(m, temb, 6)
    w, b = m.norm.weight, m.norm.bias
    checks = {
        0: (_modulated(_affine(_ln64(h, 1e-5), w, b), scale, shift), 3),
        1: (_modulated(_affine(_ln64(enc, 1e-5), w, b), enc_scale, enc_shift), 3),
    }
    return Case(m, (h, enc, temb), "generic_adaln", {"layer_norm_modulate": 2}, checks)


def case_lumina_rmsnorm_zero(dtype, gen):
    m = _build(LuminaRMSNormZero(D, norm_eps=1e-5, norm_elementwise_affine=True), dtype, gen)
    x, emb = _x(dtype, gen), _emb(dtype, gen, D)
    scale = _chunks(m, emb, 4)[0]
    mag = _modulated(_affine(_rms64(x, 1e-5), m.norm.weight, None), scale)
    return Case(m, (x, emb), "generic_adaln", {"rms_norm_modulate": 1}, {0: (mag, 3)})


def _proj(m, x):
    with torch.no_grad():
        return m.proj(x).double()


def case_diffusers_gelu_tanh(dtype, gen):
    m = _build(GELU(32, D, approximate="tanh"), dtype, gen)
    x = randn((2, 5, 32), dtype, gen, scale=2.0)
    # tanh's fp32 error is absolute: for z << 0, gelu(z) = z (1 + tanh(.)) / 2 cancels (noise term: |z|)
    return Case(m, (x,), "generic_gelu_tanh", {"gelu_tanh": 1}, {0: (_proj(m, x).abs(), 0)}, same_rounding=True)


def case_torch_gelu_tanh(dtype, gen):
    x = randn((2, 5, D), dtype, gen, scale=2.0)
    gelu = nn.GELU(approximate="tanh")
    return Case(gelu, (x,), "generic_gelu_tanh", {"gelu_tanh": 1}, {0: (_p(x).abs(), 0)}, same_rounding=True)


def _glu_case(cls, kernel):
    def case(dtype, gen):
        m = _build(cls(32, D), dtype, gen)
        x = randn((2, 5, 32), dtype, gen, scale=2.0)
        value, gate = _proj(m, x).chunk(2, dim=-1)
        # the stock rounds the activation before the product
        return Case(m, (x,), "generic_glu", {kernel: 1}, {0: (value.abs() * (gate.abs() + 1), 1)})

    return case


CASES = {
    "rmsnorm_no_weight": case_rmsnorm_no_weight,
    "rmsnorm_weight": case_rmsnorm_weight,
    "rmsnorm_fp32_weight": case_rmsnorm_fp32_weight,
    "rmsnorm_bias": case_rmsnorm_bias,
    "torch_rmsnorm_eps_none": _torch_rmsnorm_case(None),
    "torch_rmsnorm_eps_1e-3": _torch_rmsnorm_case(1e-3),
    "layernorm_affine": _layernorm_case(nn.LayerNorm, eps=1e-5),
    "layernorm_plain": _layernorm_case(nn.LayerNorm, eps=1e-6, elementwise_affine=False),
    "layernorm_no_bias": _layernorm_case(nn.LayerNorm, eps=1e-5, bias=False),
    "fp32_layernorm": _layernorm_case(FP32LayerNorm, eps=1e-6),
    "adaln_zero": _adaln_zero_case("layer_norm"),
    "adaln_zero_fp32_layernorm": _adaln_zero_case("fp32_layer_norm"),
    "adaln_zero_class_labels": case_adaln_zero_class_labels,
    "adaln_zero_single": case_adaln_zero_single,
    "adaln_continuous_layernorm": _adaln_continuous_case("layer_norm"),
    "adaln_continuous_rmsnorm": _adaln_continuous_case("rms_norm"),
    "sd35_adaln_zero_x": case_sd35_adaln_zero_x,
    "cogvideox_layernorm_zero": case_cogvideox_layernorm_zero,
    "lumina_rmsnorm_zero": case_lumina_rmsnorm_zero,
    "diffusers_gelu_tanh": case_diffusers_gelu_tanh,
    "torch_gelu_tanh": case_torch_gelu_tanh,
    "geglu": _glu_case(GEGLU, "geglu"),
    "swiglu": _glu_case(SwiGLU, "swiglu"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_module_kind_matches_stock(name, dtype, kernel_calls, gen):
    """Each kind in a small container: the counts, one kernel launch per norm / activation (outputs poisoned
    first), every output against the stock module's within the tolerance above (those the kernels do not
    compute, such as an AdaLN's gates, bit for bit); removal restores the stock output bit for bit."""
    case = CASES[name](dtype, gen)
    model = Holder(case.module)
    stock = _outputs(_run(model, case.args, case.kwargs))
    counts = gi.inject_generic_kernels(model, verbose=False)
    assert counts == {**ZERO, case.kind: 1}
    assert gi.generic_injected_counts(model) == counts
    with poisoned_outputs(), interpreter_bf16_round_to_nearest_even():
        got = _outputs(_run(model, case.args, case.kwargs))
    assert dict(kernel_calls) == case.calls
    assert len(got) == len(stock)
    for i, (g, s) in enumerate(zip(got, stock)):
        if i in case.checks:
            mag, k = case.checks[i]
            what = f"{name} output {i}"
            assert_like_stock(g, s, mag, k, same_rounding=case.same_rounding, what=what, seed=gen.seed_value)
        else:
            assert torch.equal(g, s), f"{name} output {i} differs from the stock one"
    assert gi.remove_generic_kernels(model, verbose=False) == counts
    _nothing_left(model)
    again = _outputs(_run(model, case.args, case.kwargs))
    assert all(torch.equal(a, s) for a, s in zip(again, stock))
    assert gi.generic_injected_counts(model) == ZERO


def test_gelu_tanh_in_the_gemm_epilogue_where_verified(monkeypatch, gen):
    """diffusers' GELU(approximate="tanh") runs its projection with the GELU in the GEMM's epilogue where that
    path is verified (forced here: the CPU's _addmm_activation computes the erf form, which bf16 cannot tell
    from the tanh one at this tolerance) and no GELU kernel; within the bf16 parity bound of the stock module."""
    monkeypatch.setattr(ic, "gemm_gelu_tanh_ok", lambda device, dtype: True)
    calls = count_calls(monkeypatch, ((activations, "gelu_tanh"), (ic, "linear_gelu_tanh")))
    case = CASES["diffusers_gelu_tanh"](torch.bfloat16, gen)
    stock = _run(case.module, case.args)
    gi.inject_generic_kernels(case.module, verbose=False)
    got = _run(case.module, case.args)
    assert dict(calls) == {"linear_gelu_tanh": 1}
    assert got.dtype == stock.dtype and rel_l2(got, stock) <= 2.0**-5
    gi.remove_generic_kernels(case.module, verbose=False)
    assert torch.equal(_run(case.module, case.args), stock)


def test_injecting_twice_wraps_nothing_twice(kernel_calls, gen):
    """A second injection finds everything in place: the same counts, the same forwards, one removal."""
    model = nn.Sequential(
        _build(RMSNorm(D, eps=1e-6), torch.float32, gen),
        _build(nn.LayerNorm(D), torch.float32, gen),
        _build(GEGLU(D, D), torch.float32, gen),
    )
    x = _x(torch.float32, gen)
    stock = _run(model, (x,))
    first = gi.inject_generic_kernels(model, verbose=False)
    forwards = [m.__dict__.get("forward") for m in model]
    assert gi.inject_generic_kernels(model, verbose=False) == first
    assert [m.__dict__.get("forward") for m in model] == forwards
    assert all(m.__dict__[gi.STATE]["prev"] is None for m in model)
    got = _run(model, (x,))
    assert dict(kernel_calls) == {"rms_norm": 1, "layer_norm": 1, "geglu": 1}
    assert (got - stock).abs().max() <= 1e-4 * stock.abs().max()
    assert gi.remove_generic_kernels(model, verbose=False) == first
    _nothing_left(model)
    assert torch.equal(_run(model, (x,)), stock)
    assert gi.remove_generic_kernels(model, verbose=False) == ZERO


# --------------------------------------------------------------------------------------------
# Fallbacks: what the kernels do not take runs the original forward
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["rmsnorm_weight", "torch_rmsnorm_eps_none", "layernorm_affine", "adaln_zero",
                                  "lumina_rmsnorm_zero", "torch_gelu_tanh", "geglu", "swiglu"])  # fmt: skip
def test_autograd_runs_the_original(name, kernel_calls, gen):
    """In grad mode with inputs or parameters that require a gradient, the original code runs (the kernels
    have no backward): the same output as the stock module, bit for bit, and the same gradients."""
    case = CASES[name](torch.float32, gen)
    x = case.args[0].clone().requires_grad_(True)
    args = (x, *case.args[1:])

    def grads():
        case.module.zero_grad(set_to_none=True)
        x.grad = None
        out = _outputs(case.module(*args, **case.kwargs))[0]
        out.square().sum().backward()
        return out.detach(), x.grad.clone(), [p.grad.clone() for p in case.module.parameters()]

    ref = grads()
    gi.inject_generic_kernels(case.module, verbose=False)
    got = grads()
    gi.remove_generic_kernels(case.module, verbose=False)
    assert sum(kernel_calls.values()) == 0
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))


def _hooked(norm, fired):
    return norm.register_forward_hook(lambda m, a, o: fired.append(1) or o * 1.25)


def test_hook_on_a_patched_norm_runs(kernel_calls, gen):
    """A forward hook on a patched norm runs around the kernel (Module.__call__ still calls it)."""
    case = CASES["layernorm_affine"](torch.float32, gen)
    fired = []
    handle = _hooked(case.module, fired)
    stock = _run(case.module, case.args)
    gi.inject_generic_kernels(case.module, verbose=False)
    with poisoned_outputs():
        got = _run(case.module, case.args)
    handle.remove()
    assert len(fired) == 2 and kernel_calls["layer_norm"] == 1
    assert_like_stock(got, stock, 1.25 * case.checks[0][0], seed=gen.seed_value)


@pytest.mark.parametrize("name", ["adaln_zero", "adaln_continuous_rmsnorm", "lumina_rmsnorm_zero",
                                  "cogvideox_layernorm_zero", "sd35_adaln_zero_x"])  # fmt: skip
def test_hook_on_an_adaln_norm_runs(name, kernel_calls, gen):
    """The fused norm + modulation does not call the AdaLN module's norm: where that norm has a hook, the
    module computes as the stock one does (the norm called, then the modulation), bit for bit."""
    case = CASES[name](torch.float32, gen)
    fired = []
    handle = _hooked(case.module.norm, fired)
    stock = _outputs(_run(case.module, case.args, case.kwargs))
    n_stock = len(fired)
    gi.inject_generic_kernels(case.module, verbose=False)
    got = _outputs(_run(case.module, case.args, case.kwargs))
    handle.remove()
    assert n_stock > 0 and len(fired) == 2 * n_stock
    assert sum(kernel_calls.values()) == 0
    assert all(torch.equal(g, s) for g, s in zip(got, stock))


def test_subclass_with_its_own_forward_left_alone(kernel_calls, gen):
    """A subclass that overrides forward computes something else: left alone and named in `skipped`; a
    subclass that keeps the class's forward is taken."""

    class ScaledRMSNorm(RMSNorm):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    class PlainRMSNorm(RMSNorm):
        pass

    own = _build(ScaledRMSNorm(D, eps=1e-6), torch.float32, gen)
    plain = _build(PlainRMSNorm(D, eps=1e-6), torch.float32, gen)
    x = _x(torch.float32, gen)
    stock = _run(own, (x,))
    skipped = []
    counts = gi.inject_generic_kernels(nn.ModuleList([own, plain]), verbose=False, skipped=skipped)
    assert counts == {**ZERO, "generic_rmsnorm": 1}
    assert skipped == ["ScaledRMSNorm (a subclass with a forward of its own)"]
    assert gi.STATE not in own.__dict__ and gi.STATE in plain.__dict__
    assert torch.equal(_run(own, (x,)), stock) and sum(kernel_calls.values()) == 0


def test_instance_forward_left_alone(kernel_calls, gen):
    """A forward the user put on the instance is not replaced (nor restored over)."""
    norm = _build(nn.LayerNorm(D), torch.float32, gen)
    mine = types.MethodType(lambda self, x: x * 3, norm)
    norm.forward = mine
    skipped = []
    counts = gi.inject_generic_kernels(Holder(norm), verbose=False, skipped=skipped)
    assert counts == ZERO and skipped == ["LayerNorm with a forward of its own"]
    x = _x(torch.float32, gen)
    assert torch.equal(_run(norm, (x,)), x * 3) and sum(kernel_calls.values()) == 0
    gi.remove_generic_kernels(norm, verbose=False)
    assert norm.__dict__["forward"] is mine


def test_layernorm_fp32_weight_on_bf16_input_falls_back(kernel_calls, gen):
    """nn.LayerNorm with fp32 parameters on a bf16 input (torch's mixed-dtype layer norm on the CPU; an error on a
    GPU) runs the original: the same result, or the same error."""
    norm = _build(nn.LayerNorm(D), torch.float32, gen)
    x = _x(torch.bfloat16, gen)
    try:
        stock, raised = _run(norm, (x,)), None
    except RuntimeError as e:
        stock, raised = None, str(e)
    gi.inject_generic_kernels(norm, verbose=False)
    assert gi.STATE in norm.__dict__
    if raised is not None:
        with pytest.raises(RuntimeError) as err:
            _run(norm, (x,))
        assert str(err.value) == raised
    else:
        assert torch.equal(_run(norm, (x,)), stock)
    assert sum(kernel_calls.values()) == 0


@pytest.mark.parametrize("call", ["keyword", "positional"])
def test_geglu_scale_argument_goes_to_the_original(call, kernel_calls, gen):
    """GEGLU's deprecated `scale` argument: the original forward runs (and warns, as diffusers does)."""
    m = _build(GEGLU(32, D), torch.float32, gen)
    x = randn((2, 5, 32), torch.float32, gen)
    args, kwargs = ((x,), {"scale": 1.0}) if call == "keyword" else ((x, 1.0), {})
    with pytest.warns(FutureWarning):
        stock = _run(m, args, kwargs)
    gi.inject_generic_kernels(m, verbose=False)
    with pytest.warns(FutureWarning):
        got = _run(m, args, kwargs)
    assert torch.equal(got, stock) and sum(kernel_calls.values()) == 0


def _norm_mag(norm, x):
    """The magnitude of a norm's terms for assert_like_stock (see there)."""
    if isinstance(norm, nn.LayerNorm):
        return _affine(_ln64(x, norm.eps), norm.weight, norm.bias)
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    return _affine(_rms64(x, eps), norm.weight, getattr(norm, "bias", None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["rmsnorm_no_weight", "rmsnorm_weight", "rmsnorm_bias", "torch_rmsnorm_eps_none",
                                  "layernorm_affine", "fp32_layernorm"])  # fmt: skip
def test_norm_of_a_heads_view(name, dtype, gen):
    """A q/k norm applied to q.view(B, S, H, Dh).transpose(1, 2), as diffusers' attention processors do
    (CogVideoX's, AttnProcessor2_0 with qk_norm): rows the kernels cannot address with two strides. The
    result is the stock module's, in the layout the stock module returns (the norm no longer raises)."""
    norm = CASES[name](dtype, gen).module
    x = randn((2, 5, 3, D), dtype, gen, scale=X_SCALE).transpose(1, 2)
    stock = _run(norm, (x,))
    gi.inject_generic_kernels(norm, verbose=False)
    with poisoned_outputs(), interpreter_bf16_round_to_nearest_even():
        got = _run(norm, (x,))
    assert_like_stock(got, stock, _norm_mag(norm, x), 2, same_rounding=True, what=name, seed=gen.seed_value)
    assert got.stride() == stock.stride()


def test_torch_gelu_tanh_on_a_heads_view_reads_it_in_place(kernel_calls, gen):
    """nn.GELU(approximate="tanh") on q.view(B, S, H, Dh).transpose(1, 2) (a dense permutation, three levels of
    rows): the kernel reads it in place, the result in the input's layout as torch's elementwise op returns it."""
    gelu = nn.GELU(approximate="tanh")
    x = randn((2, 5, 3, 16), torch.float32, gen).transpose(1, 2)
    stock = _run(gelu, (x,))
    gi.inject_generic_kernels(gelu, verbose=False)
    with poisoned_outputs():
        got = _run(gelu, (x,))
    assert kernel_calls["gelu_tanh"] == 1 and got.stride() == stock.stride()
    assert float((got - stock).abs().max()) <= 1e-6 * float(stock.abs().max())


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "strided_last_dim"])
def test_torch_gelu_tanh_on_other_layouts_runs_the_original(layout, kernel_calls, gen):
    """nn.GELU(approximate="tanh") on inputs whose rows the kernel does not address in place (a strided last dim,
    as a channels-last feature map or a transposed map has): the original runs, bit for bit."""
    gelu = nn.GELU(approximate="tanh")
    x = {
        "transposed": lambda: randn((2, D, 5), torch.float32, gen).transpose(1, 2),
        "channels_last": lambda: randn((2, 8, 4, 4), torch.float32, gen).to(memory_format=torch.channels_last),
        "strided_last_dim": lambda: randn((2, 5, 2 * D), torch.float32, gen)[..., ::2],
    }[layout]()
    stock = _run(gelu, (x,))
    gi.inject_generic_kernels(gelu, verbose=False)
    got = _run(gelu, (x,))
    assert torch.equal(got, stock) and got.stride() == stock.stride()
    assert sum(kernel_calls.values()) == 0


def test_tiny_cogvideox_transformer(kernel_calls, gen):
    """diffusers' CogVideoX (q/k LayerNorms on the heads view, CogVideoXLayerNormZero, RoPE through
    attention_processor.py's call-time import, on a slice of q): injected, it runs and matches the stock
    model; removal restores it bit for bit."""
    from diffusers import CogVideoXTransformer3DModel

    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=16,
        text_embed_dim=16, num_layers=1, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        max_text_seq_length=4, use_rotary_positional_embeddings=True,
    )  # fmt: skip
    _init_(model.to(DEVICE), gen)
    rope_emb = embeddings.get_3d_rotary_pos_embed(16, ((0, 0), (4, 4)), (4, 4), 2, device=DEVICE)  # 2 x 4 x 4
    kw = dict(
        hidden_states=randn((2, 2, 4, 8, 8), torch.float32, gen),
        encoder_hidden_states=randn((2, 4, 16), torch.float32, gen),
        timestep=torch.tensor([3, 500], device=DEVICE),
        image_rotary_emb=rope_emb,
        return_dict=False,
    )
    ref = run_model(model, kw)
    counts = gi.inject_generic_kernels(model, verbose=False)
    # norm_q / norm_k / norm_final / norm_out's LayerNorm, norm1 / norm2, the feed-forward's GELU; no model file
    # of CogVideoX calls apply_rotary_emb through its globals
    assert counts == {**ZERO, "generic_layernorm": 4, "generic_adaln": 2, "generic_gelu_tanh": 1}
    out = run_model(model, kw)
    # the q/k norms see the heads view: torch's own layer norm (it copies the rows itself)
    assert {k: v for k, v in kernel_calls.items() if v} == {"layer_norm_modulate": 4, "layer_norm": 2, "gelu_tanh": 1}
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    assert gi.remove_generic_kernels(model, verbose=False) == counts
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)


def test_geglu_subclass_computes_gelu(kernel_calls, gen):
    """A subclass of GEGLU that keeps its forward and gelu is taken, and computes GEGLU (not SwiGLU)."""

    class MyGEGLU(GEGLU):
        pass

    m = _build(MyGEGLU(32, D), torch.float32, gen)
    x = randn((2, 5, 32), torch.float32, gen, scale=2.0)
    value, gate = _proj(m, x).chunk(2, dim=-1)
    stock = _run(m, (x,))
    assert gi.inject_generic_kernels(m, verbose=False) == {**ZERO, "generic_glu": 1}
    with poisoned_outputs():
        got = _run(m, (x,))
    assert dict(kernel_calls) == {"geglu": 1}
    assert_like_stock(got, stock, value.abs() * (gate.abs() + 1), 1, seed=gen.seed_value)


@pytest.mark.parametrize("change", ["swiglu_activation_hook", "swiglu_activation_replaced", "geglu_instance_gelu"])
def test_glu_activation_as_the_module_has_it_when_called(change, kernel_calls, gen):
    """The GLU kernels compute the class's own activation: a forward hook on SwiGLU's activation module, an
    activation module put in its place, or a gelu method put on a GEGLU instance, after the injection,
    makes the module compute as the stock one does (the activation called), bit for bit."""
    fired = []
    if change == "geglu_instance_gelu":
        m = _build(GEGLU(32, D), torch.float32, gen)
        gi.inject_generic_kernels(m, verbose=False)
        m.gelu = lambda gate: fired.append(1) or F.gelu(gate, approximate="tanh")
    else:
        m = _build(SwiGLU(32, D), torch.float32, gen)
        gi.inject_generic_kernels(m, verbose=False)
        if change == "swiglu_activation_hook":
            m.activation.register_forward_hook(lambda mod, a, o: fired.append(1) or o * 1.25)
        else:
            m.activation = nn.GELU()
            m.activation.register_forward_pre_hook(lambda mod, a: fired.append(1))
    x = randn((2, 5, 32), torch.float32, gen)
    got = _run(m, (x,))
    assert len(fired) == 1 and sum(kernel_calls.values()) == 0
    gi.remove_generic_kernels(m, verbose=False)
    assert torch.equal(got, _run(m, (x,)))


@pytest.mark.parametrize("affine", [False, True], ids=["no_weight", "weight"])
def test_torch_rmsnorm_of_another_size_raises_as_torch_does(affine, gen):
    """nn.RMSNorm(64) on rows of 128: torch refuses the call; so does the patched module (the kernel would
    normalise the 128 values)."""
    norm = _build(nn.RMSNorm(D, elementwise_affine=affine), torch.float32, gen)
    x = randn((2, 5, 2 * D), torch.float32, gen)
    with pytest.raises(RuntimeError), torch.no_grad():
        norm(x)
    gi.inject_generic_kernels(norm, verbose=False)
    with pytest.raises(RuntimeError), torch.no_grad():
        norm(x)


def test_diffusers_rmsnorm_of_two_dims_runs_the_original(kernel_calls, gen):
    """diffusers' RMSNorm((3, 64)) normalises the last dim and multiplies a [3, 64] weight (broadcast): the
    kernel takes a [64] weight, so the original runs, bit for bit."""
    norm = _build(RMSNorm((3, D), eps=1e-6), torch.float32, gen)
    x = randn((2, 3, D), torch.float32, gen)
    stock = _run(norm, (x,))
    gi.inject_generic_kernels(norm, verbose=False)
    assert torch.equal(_run(norm, (x,)), stock) and sum(kernel_calls.values()) == 0


# --------------------------------------------------------------------------------------------
# The apply_rotary_emb dispatcher in a model file (a tiny FLUX: transformer_flux.py calls it)
# --------------------------------------------------------------------------------------------
def _flux(seed):
    return mi.build_flux_transformer("tiny", dtype=torch.float32, device=DEVICE, seed=seed)


def _flux_inputs(model, seed):
    return mi.make_mmdit_inputs(model, batch=2, height=64, width=64, text_len=7, dtype=torch.float32,
                                device=DEVICE, seed=seed)  # fmt: skip


# the tiny FLUX (1 double + 1 single block) as the generic layer sees it: AdaLayerNormZero x2, ZeroSingle and
# Continuous (norm_out); the double block's norm2 / norm2_context LayerNorms; q/k RMSNorms (4 in the double
# block, 2 in the single one); the feed-forwards' GELU-tanh x2 and the single block's nn.GELU(tanh); one file
TINY_FLUX_COUNTS = {
    "generic_rmsnorm": 6,
    "generic_layernorm": 2,
    "generic_adaln": 4,
    "generic_gelu_tanh": 3,
    "generic_glu": 0,
    "generic_rope": 1,
}


def test_rope_dispatcher_in_the_model_file(kernel_calls, gen):
    """While a FLUX is injected, transformer_flux.py's apply_rotary_emb is the dispatcher, which runs the
    kernels for FLUX's calls (q and k of both blocks); removal puts diffusers' function back and the output
    is the stock one bit for bit."""
    model = _flux(gen.seed_value % 1000)
    kw = _flux_inputs(model, gen.seed_value)
    ref = run_model(model, kw)
    assert gi.inject_generic_kernels(model, verbose=False) == TINY_FLUX_COUNTS
    assert transformer_flux.apply_rotary_emb is gi.apply_rotary_emb
    out = run_model(model, kw)
    assert kernel_calls["rope_interleaved"] == 4
    assert {k: v for k, v in kernel_calls.items() if v} == {
        "rope_interleaved": 4,
        "rms_norm": 6,
        "layer_norm": 2,
        "layer_norm_modulate": 4,
        "gelu_tanh": 3,
    }
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    assert gi.remove_generic_kernels(model, verbose=False) == TINY_FLUX_COUNTS
    assert transformer_flux.apply_rotary_emb is DIFFUSERS_ROPE
    assert not gi._ROPE_SITES
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)


def test_rope_dispatcher_leaves_diffusers_embeddings_alone(gen):
    """The dispatcher stands in for the function in the model files that call it through their globals, not
    in embeddings.py, where diffusers defines it: there it would serve every model that imports the function
    at call time, injected or not, and a model file imported meanwhile would bind the dispatcher for good."""
    model = _flux(gen.seed_value % 1000)
    counts = gi.inject_generic_kernels(model, verbose=False)
    try:
        assert counts["generic_rope"] == 1 and set(gi._ROPE_SITES) == {transformer_flux.__name__}
        assert embeddings.apply_rotary_emb is DIFFUSERS_ROPE
        late = types.ModuleType("late_model_file")  # a model file imported while FLUX is injected
        exec("from diffusers.models.embeddings import apply_rotary_emb", late.__dict__)
        assert late.apply_rotary_emb is DIFFUSERS_ROPE
    finally:
        gi.remove_generic_kernels(model, verbose=False)
    assert embeddings.apply_rotary_emb is DIFFUSERS_ROPE and transformer_flux.apply_rotary_emb is DIFFUSERS_ROPE


def test_two_models_of_one_file(kernel_calls, gen):
    """Two FLUX models hold the dispatcher of one file: removing one keeps it (and its kernels) for the other."""
    a, b = _flux(gen.seed_value % 1000), _flux(gen.seed_value % 1000 + 1)
    gi.inject_generic_kernels(a, verbose=False)
    gi.inject_generic_kernels(b, verbose=False)
    assert gi.remove_generic_kernels(a, verbose=False)["generic_rope"] == 1
    assert transformer_flux.apply_rotary_emb is gi.apply_rotary_emb
    assert gi.generic_injected_counts(b)["generic_rope"] == 1 and gi.generic_injected_counts(a) == ZERO
    run_model(b, _flux_inputs(b, gen.seed_value))
    assert kernel_calls["rope_interleaved"] == 4
    assert gi.remove_generic_kernels(b, verbose=False)["generic_rope"] == 1
    assert transformer_flux.apply_rotary_emb is DIFFUSERS_ROPE and not gi._ROPE_SITES


def _tables(s, d, gen, dtype=torch.float32):
    """cos/sin [S, D] of independent random angles per channel (a kernel mixing up channels shows)."""
    theta = randn((s, d), torch.float32, gen, scale=3.0)
    return theta.cos().to(dtype), theta.sin().to(dtype)


def _complex(b, s, d, gen):
    return torch.polar(torch.ones(b, s, d // 2), torch.randn(b, s, d // 2, generator=gen) * 3).to(DEVICE)


PAIRS, HALVES = "rope_interleaved", "rope_rotate_half"
BHSD, BSHD = (2, 3, 5, 16), (2, 5, 3, 16)
# (id, x shape, apply_rotary_emb's arguments (batch: the complex table's), the kernel that takes the call)
FORMS = [
    ("real_pairs_seq2", BHSD, dict(use_real=True, use_real_unbind_dim=-1, sequence_dim=2), PAIRS),
    ("real_pairs_seq1", BSHD, dict(use_real=True, use_real_unbind_dim=-1, sequence_dim=1), PAIRS),
    ("real_halves_seq2", BHSD, dict(use_real=True, use_real_unbind_dim=-2, sequence_dim=2), HALVES),
    ("real_halves_seq1", BSHD, dict(use_real=True, use_real_unbind_dim=-2, sequence_dim=1), HALVES),
    ("complex_per_sample", BSHD, dict(use_real=False, batch=2), PAIRS),  # freqs [B, S, D // 2]
    ("complex_shared", BSHD, dict(use_real=False, batch=1), PAIRS),  # freqs [1, S, D // 2]
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", FORMS, ids=[f[0] for f in FORMS])
def test_rope_call_forms_match_diffusers(form, dtype, kernel_calls, gen):
    """Each call form the dispatcher takes, against diffusers' function on the same inputs: one kernel call,
    the output within the tolerance above (diffusers computes in fp32 and rounds once, so k = 0) and in the
    layout diffusers returns."""
    _, shape, kw, kernel = form
    kw = dict(kw)
    x = randn(shape, dtype, gen)
    if kw["use_real"]:
        seq = shape[kw["sequence_dim"]]
        freqs = _tables(seq, shape[-1], gen)
    else:
        freqs = _complex(kw.pop("batch"), shape[1], shape[-1], gen)
    ref = DIFFUSERS_ROPE(x, freqs, **kw)
    with poisoned_outputs(), interpreter_bf16_round_to_nearest_even():
        got = gi.apply_rotary_emb(x, freqs, **kw)
    assert dict(kernel_calls) == {kernel: 1}
    # |x cos| + |x' sin| <= 2 max|x| of the row: the noise term's magnitude
    assert_like_stock(got, ref, 2 * _p(x).abs().amax(-1, keepdim=True), what=form[0], seed=gen.seed_value)
    assert got.stride() == ref.stride()


def _fallback_forms(gen):
    x = randn((2, 3, 5, 16), torch.float32, gen)
    tables = _tables(5, 16, gen)
    xs = randn((2, 5, 3, 16), torch.float32, gen)
    freqs = _complex(2, 5, 16, gen)
    return {
        # CogVideoX-style: the image tokens of q, a slice along S (not dense)
        "non_dense_x": (x[:, :, 1:], _tables(4, 16, gen), {}),
        "x_3d": (x[0], tables, {"use_real_unbind_dim": -2}),  # diffusers broadcasts it to [1, H, S, D]
        "tables_broadcast": (x, (tables[0][:1], tables[1][:1]), {}),
        "tables_float64": (x, (tables[0].double(), tables[1].double()), {}),
        "x_float64": (x.double(), tables, {}),
        "last_dim_strided": (x.transpose(-1, -2).contiguous().transpose(-1, -2), tables, {}),
        "complex128": (xs, freqs.to(torch.complex128), {"use_real": False}),
        "complex_conj": (xs, freqs.conj(), {"use_real": False}),
        "complex_unbind_-2": (xs, freqs, {"use_real": False, "use_real_unbind_dim": -2}),
    }


@pytest.mark.parametrize(
    "name",
    ["non_dense_x", "x_3d", "tables_broadcast", "tables_float64", "x_float64", "last_dim_strided", "complex128",
     "complex_conj", "complex_unbind_-2"],
)  # fmt: skip
def test_rope_forms_the_kernels_do_not_take_run_diffusers(name, kernel_calls, gen):
    """Calls the kernels do not take go to diffusers' function: the same output bit for bit, no kernel."""
    x, freqs, kw = _fallback_forms(gen)[name]
    ref = DIFFUSERS_ROPE(x, freqs, **kw)
    got = gi.apply_rotary_emb(x, freqs, **kw)
    assert torch.equal(got, ref) and got.stride() == ref.stride()
    assert sum(kernel_calls.values()) == 0


def test_rope_with_autograd_runs_diffusers(kernel_calls, gen):
    """x requiring a gradient in grad mode: diffusers' function (the kernels have no backward)."""
    x = randn((2, 3, 5, 16), torch.float32, gen).requires_grad_(True)
    tables = _tables(5, 16, gen)
    got = gi.apply_rotary_emb(x, tables)
    got.sum().backward()
    assert torch.equal(got, DIFFUSERS_ROPE(x, tables)) and x.grad is not None
    assert sum(kernel_calls.values()) == 0


@needs_gpu_and_cpu
def test_rope_tables_on_another_device_run_diffusers(kernel_calls, gen):
    """Tables on the CPU for x on the GPU: diffusers moves them; the dispatcher leaves the call to it."""
    x = randn((2, 3, 5, 16), torch.float32, gen)
    tables = tuple(t.cpu() for t in _tables(5, 16, gen))
    assert torch.equal(gi.apply_rotary_emb(x, tables), DIFFUSERS_ROPE(x, tables))
    assert sum(kernel_calls.values()) == 0


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_keep_the_dispatcher(how, gen):
    """A deep copy, or a torch.save / torch.load(weights_only=False) round trip, of an injected model is
    injected too: it holds the dispatcher of its file itself (removing the original keeps it), runs the
    kernels with the original's output, and its removal restores the stock output and diffusers' function."""
    model = _flux(gen.seed_value % 1000)
    kw = _flux_inputs(model, gen.seed_value)
    ref = run_model(model, kw)
    gi.inject_generic_kernels(model, verbose=False)
    out = run_model(model, kw)
    twin = copied(model, how)
    assert gi.generic_injected_counts(twin) == TINY_FLUX_COUNTS
    gi.remove_generic_kernels(model, verbose=False)
    assert transformer_flux.apply_rotary_emb is gi.apply_rotary_emb  # the copy holds it
    assert torch.equal(run_model(twin, kw), out)
    assert gi.remove_generic_kernels(twin, verbose=False) == TINY_FLUX_COUNTS
    assert transformer_flux.apply_rotary_emb is DIFFUSERS_ROPE and not gi._ROPE_SITES
    _nothing_left(twin)
    assert torch.equal(run_model(twin, kw), ref)


# --------------------------------------------------------------------------------------------
# Models a family takes; pipelines
# --------------------------------------------------------------------------------------------
def _family_only(counts):
    assert {k: counts[k] for k in gi.KINDS} == ZERO
    assert counts["mmdit_fused_blocks"] == 2


def test_family_model_gets_nothing_generic(gen):
    """A FLUX is the MMDiT family's: inject_optimized_kernels leaves it to the family entirely."""
    model = _flux(gen.seed_value % 1000)
    _family_only(di.inject_optimized_kernels(model, verbose=False))
    assert transformer_flux.apply_rotary_emb is DIFFUSERS_ROPE and not gi._ROPE_SITES
    assert all(gi.STATE not in m.__dict__ for m in model.modules())
    di.remove_optimized_kernels(model, verbose=False)


def test_family_model_inside_a_module_gets_nothing_generic(gen):
    """The same FLUX inside a module of the user's: the generic layer skips it with everything inside it,
    the model files its modules call apply_rotary_emb from included."""
    model = _flux(gen.seed_value % 1000)
    box = Holder(model)
    _family_only(di.inject_optimized_kernels(box, verbose=False))
    assert gi.generic_injected_counts(box) == ZERO and not gi._ROPE_SITES
    assert transformer_flux.apply_rotary_emb is DIFFUSERS_ROPE and mi.apply_rotary_emb is DIFFUSERS_ROPE
    di.remove_optimized_kernels(box, verbose=False)


def test_pipeline_components(kernel_calls, gen):
    """A pipeline-like object (.components): the FLUX goes to its family, the other module to this layer
    (through inject_optimized_kernels and directly); removal restores both."""
    flux = _flux(gen.seed_value % 1000)
    case = CASES["adaln_zero"](torch.float32, gen)
    other = Holder(case.module)

    class Pipe:
        components = {"transformer": flux, "other": other, "scheduler": object(), "name": "tiny"}

    stock = _run(other, case.args, case.kwargs)
    counts = di.inject_optimized_kernels(Pipe(), verbose=False)
    assert {k: counts[k] for k in gi.KINDS} == {**ZERO, "generic_adaln": 1}
    assert gi.generic_injected_counts(Pipe()) == {**ZERO, "generic_adaln": 1}
    assert all(gi.STATE not in m.__dict__ for m in flux.modules())
    got = _run(other, case.args, case.kwargs)
    assert kernel_calls["layer_norm_modulate"] == 1
    assert_like_stock(got[0], stock[0], *case.checks[0], seed=gen.seed_value)
    di.remove_optimized_kernels(Pipe(), verbose=False)
    _nothing_left(other)
    # the generic layer alone takes every component, the FLUX included
    both = {**TINY_FLUX_COUNTS, "generic_adaln": 5}
    assert gi.inject_generic_kernels(Pipe(), verbose=False) == both
    assert transformer_flux.apply_rotary_emb is gi.apply_rotary_emb
    assert gi.remove_generic_kernels(Pipe(), verbose=False) == both
    assert transformer_flux.apply_rotary_emb is DIFFUSERS_ROPE
    _nothing_left(other)
    _nothing_left(flux)
    assert all(torch.equal(a, b) for a, b in zip(_run(other, case.args, case.kwargs), stock))
    with pytest.raises(TypeError, match="diffusers pipeline or a torch.nn.Module"):
        gi.inject_generic_kernels(object(), verbose=False)

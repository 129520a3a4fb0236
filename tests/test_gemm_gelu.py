# SPDX-License-Identifier: Apache-2.0
"""Tests for injection_common's Linear + GELU-tanh in one BLAS call (torch._addmm_activation with the
activation in the GEMM epilogue): the check of which GELU form the library computes, the conditions
under which the path applies, that torch.compile keeps it, the LTX-Video and FLUX wiring, and on a GPU
its output against a float64 reference. Fresh random inputs (seed printed on failure)."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import diffusers_injection as di
import injection_common as ic
from kernel_testing import DEVICE, assert_close, make_generator, rel_l2

ON_GPU = DEVICE.type == "cuda"


def _exact_z(n, lo, hi, dtype, gen):
    """n random pre-activations in [lo, hi], exactly representable in dtype (float64)."""
    z = lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)
    return z.to(dtype).double()


# --------------------------------------------------------------------------------------------
# The form check
# --------------------------------------------------------------------------------------------
def test_forms_told_apart_in_fp16():
    gen = make_generator()
    z = _exact_z(4096, -4.0, 3.0, torch.float16, gen)
    tanh_y = F.gelu(z.float(), approximate="tanh").half().double()
    erf_y = F.gelu(z.float()).half().double()
    assert ic.gelu_forms_matched(tanh_y, z, torch.float16) == (True, False), gen.seed_value
    assert ic.gelu_forms_matched(erf_y, z, torch.float16) == (False, True), gen.seed_value
    # a result a few fp16 steps off in the discriminating range matches neither
    off = tanh_y.clone()
    i = int(((z > -3.0) & (z < -2.0)).nonzero()[0])
    off[i] += 4 * torch.finfo(torch.float16).eps * abs(off[i]) + 1e-3
    assert ic.gelu_forms_matched(off, z, torch.float16) == (False, False), gen.seed_value


def test_bf16_accepts_the_tanh_form():
    gen = make_generator()
    z = _exact_z(4096, -4.0, 3.0, torch.bfloat16, gen)
    y = F.gelu(z.float(), approximate="tanh").bfloat16().double()
    assert ic.gelu_forms_matched(y, z, torch.bfloat16)[0], gen.seed_value


def _fake_addmm_activation(form):
    """A stand-in for torch._addmm_activation computing GELU in the given form (fp32 math, one rounding)."""

    def fn(bias, mat1, mat2, beta=1, alpha=1, use_gelu=False):
        z = torch.addmm(bias.float(), mat1.float(), mat2.float())
        if form == "tanh":
            y = F.gelu(z, approximate="tanh")
        elif form == "erf":
            y = F.gelu(z)
        elif form == "sigmoid":  # the x * sigmoid(1.702 x) approximation
            y = z * torch.sigmoid(1.702 * z)
        else:  # no activation at all
            y = z
        return y.to(bias.dtype)

    return fn


@pytest.mark.parametrize("form", ["tanh", "erf", "sigmoid", "none"])
def test_probe_accepts_only_the_tanh_form(form, monkeypatch):
    monkeypatch.setattr(torch, "_addmm_activation", _fake_addmm_activation(form))
    assert ic.probe_gemm_gelu_tanh("cpu", torch.bfloat16) == (form == "tanh")
    assert ic.probe_gemm_gelu_tanh("cpu", torch.float16) == (form == "tanh")


def test_probe_says_no_when_the_call_fails(monkeypatch):
    def broken(*a, **k):
        raise TypeError("changed signature")

    monkeypatch.setattr(torch, "_addmm_activation", broken)
    assert ic.probe_gemm_gelu_tanh("cpu", torch.bfloat16) is False


def test_probe_follows_the_form_the_cpu_computes():
    """The real CPU kernel (torch 2.13 computes the erf form there): the probe must agree with an
    independent float64 identification of that form."""
    gen = make_generator()
    x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(12, generator=gen, dtype=torch.float64)
    y = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    pre = x @ w.t() + b
    is_tanh = torch.allclose(y, F.gelu(pre, approximate="tanh"), rtol=0, atol=1e-12)
    is_erf = torch.allclose(y, F.gelu(pre), rtol=0, atol=1e-12)
    assert is_tanh != is_erf
    assert ic.probe_gemm_gelu_tanh("cpu", torch.bfloat16) == is_tanh


# --------------------------------------------------------------------------------------------
# When the path may be used at all
# --------------------------------------------------------------------------------------------
def _probe_must_not_run(*a, **k):
    raise AssertionError("the probe ran")


def test_never_on_the_cpu_or_when_turned_off(monkeypatch):
    monkeypatch.setattr(ic, "interpreting", lambda: False)  # decide as on a GPU machine
    monkeypatch.setattr(ic, "probe_gemm_gelu_tanh", _probe_must_not_run)
    monkeypatch.setattr(ic, "_GEMM_GELU_TANH", {})
    assert not ic.gemm_gelu_tanh_ok("cpu", torch.bfloat16)
    monkeypatch.setenv("RTK_GEMM_GELU", "0")
    assert not ic.gemm_gelu_tanh_ok("cuda:0", torch.bfloat16)
    assert not ic._GEMM_GELU_TANH


def test_result_cached_and_lt_path_required(monkeypatch):
    monkeypatch.setattr(ic, "interpreting", lambda: False)
    monkeypatch.setattr(ic, "_GEMM_GELU_TANH", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    runs = Counter()

    def probe(device, dtype):
        runs["probe"] += 1
        return True

    monkeypatch.setattr(ic, "probe_gemm_gelu_tanh", probe)
    monkeypatch.setattr(ic, "gemm_gelu_lt_expected", lambda device: True)
    assert ic.gemm_gelu_tanh_ok("cuda:0", torch.bfloat16)
    assert ic.gemm_gelu_tanh_ok("cuda:0", torch.bfloat16)
    assert runs["probe"] == 1
    monkeypatch.setattr(ic, "gemm_gelu_lt_expected", lambda device: False)
    assert not ic.gemm_gelu_tanh_ok("cuda:0", torch.float16)  # a GEMM then torch's GELU: keep the kernel
    assert runs["probe"] == 1


def test_no_probe_during_graph_capture(monkeypatch):
    monkeypatch.setattr(ic, "interpreting", lambda: False)
    monkeypatch.setattr(ic, "_GEMM_GELU_TANH", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(ic, "probe_gemm_gelu_tanh", _probe_must_not_run)
    assert not ic.gemm_gelu_tanh_ok("cuda:0", torch.bfloat16)
    assert not ic._GEMM_GELU_TANH  # nothing cached: decided again after the capture


class _Props:
    def __init__(self, arch):
        self.gcnArchName = arch


@pytest.mark.parametrize(
    "hip, arch, expected",
    [
        (None, None, True),  # CUDA
        ("6.2.41133", "gfx942:sramecc+:xnack-", True),
        ("6.2.41133", "gfx1201", False),
        ("6.3.42131", "gfx1201", True),
        ("6.4.43482", "gfx950", False),
        ("7.0.51831", "gfx950", True),
        ("7.0.51831", "gfx1030", False),
    ],
)
def test_lt_path_expected_by_platform(hip, arch, expected, monkeypatch):
    monkeypatch.delenv("DISABLE_ADDMM_CUDA_LT", raising=False)
    monkeypatch.delenv("DISABLE_ADDMM_HIP_LT", raising=False)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(arch))
    assert ic.gemm_gelu_lt_expected("cuda:0") is expected
    monkeypatch.setenv("DISABLE_ADDMM_CUDA_LT", "1")
    assert ic.gemm_gelu_lt_expected("cuda:0") is False


@pytest.mark.parametrize(
    "hip, arch",
    [(None, None), ("6.3.42131", "gfx1201"), ("7.0.51831", "gfx950"), ("6.2.41133", "gfx1201")],
)
def test_lt_path_env_var_names(hip, arch, monkeypatch):
    """PyTorch reads DISABLE_ADDMM_CUDA_LT on CUDA and on ROCm (isGloballyDisabledAddmmCudaLt in
    aten/src/ATen/native/cuda/Blas.cpp); DISABLE_ADDMM_HIP_LT is not read, so it changes nothing."""
    monkeypatch.delenv("DISABLE_ADDMM_CUDA_LT", raising=False)
    monkeypatch.delenv("DISABLE_ADDMM_HIP_LT", raising=False)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(arch))
    unset = ic.gemm_gelu_lt_expected("cuda:0")
    monkeypatch.setenv("DISABLE_ADDMM_HIP_LT", "1")
    assert ic.gemm_gelu_lt_expected("cuda:0") is unset
    monkeypatch.delenv("DISABLE_ADDMM_HIP_LT")
    monkeypatch.setenv("DISABLE_ADDMM_CUDA_LT", "1")
    assert ic.gemm_gelu_lt_expected("cuda:0") is False


def _linear(n_in, n_out, dtype, gen, bias=True, device=DEVICE):
    lin = torch.nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=gen, dtype=torch.float64) * n_in**-0.5)
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=gen, dtype=torch.float64) * 0.5)
    return lin


class _Wrapped(torch.Tensor):
    """A trivial tensor subclass standing in for quantized / distributed weights."""


@torch.no_grad()
def test_applies_only_where_it_should(monkeypatch):
    """With the form check forced to pass, the plain case runs and matches a float64 reference of the
    form this CPU computes; every excluded case returns None."""
    monkeypatch.setattr(ic, "gemm_gelu_tanh_ok", lambda device, dtype: True)
    gen = make_generator()
    dt = torch.bfloat16
    lin = _linear(24, 40, dt, gen, device="cpu")
    x = torch.randn(2, 5, 24, generator=gen).to(dt)
    y = ic.linear_gelu_tanh(x, lin)
    assert y is not None and y.shape == (2, 5, 40) and y.dtype == dt
    pre = x.double() @ lin.weight.double().t() + lin.bias.double()
    cpu_tanh = torch.allclose(
        torch._addmm_activation(pre[0, :1] * 0, pre[0, :1], torch.eye(40, dtype=torch.float64), use_gelu=True),
        F.gelu(pre[0, :1], approximate="tanh"),
        rtol=0,
        atol=1e-12,
    )
    ref = F.gelu(pre, approximate="tanh" if cpu_tanh else "none")
    assert_close(y, ref, dt, name="linear_gelu_tanh(cpu form)", seed=gen.seed_value)

    assert ic.linear_gelu_tanh(x.float(), lin) is None  # fp32 input
    assert ic.linear_gelu_tanh(x, _linear(24, 40, dt, gen, bias=False, device="cpu")) is None
    assert ic.linear_gelu_tanh(x[..., :20], _linear(20, 40, torch.float16, gen, device="cpu")) is None  # dtype mix
    assert ic.linear_gelu_tanh(x[..., :20], lin) is None  # width mismatch
    hooked = _linear(24, 40, dt, gen, device="cpu")
    hooked.register_forward_pre_hook(lambda m, a: None)
    assert ic.linear_gelu_tanh(x, hooked) is None
    replaced = _linear(24, 40, dt, gen, device="cpu")
    replaced.forward = lambda t: t
    assert ic.linear_gelu_tanh(x, replaced) is None
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert ic.linear_gelu_tanh(x, lin) is None  # a global hook would be bypassed
    finally:
        handle.remove()
    assert ic.linear_gelu_tanh(x, lin) is not None
    on_meta = torch.nn.Linear(24, 40, dtype=dt, device="meta")  # offloaded weights not yet loaded
    assert ic.linear_gelu_tanh(x, on_meta) is None
    sub = _linear(24, 40, dt, gen, device="cpu")
    sub.weight = torch.nn.Parameter(sub.weight.detach().as_subclass(_Wrapped), requires_grad=False)
    assert type(sub.weight) is not torch.nn.Parameter
    assert ic.linear_gelu_tanh(x, sub) is None
    assert ic.linear_gelu_tanh(x.as_subclass(_Wrapped), lin) is None

    class MyLinear(torch.nn.Linear):
        pass

    assert ic.linear_gelu_tanh(x, MyLinear(24, 40, dtype=dt)) is None
    with torch.enable_grad():
        assert ic.linear_gelu_tanh(x, _linear(24, 40, dt, gen, device="cpu").requires_grad_(True)) is None


def test_torch_compile_keeps_the_fused_call(monkeypatch):
    """Traced by torch.compile (graph recorded, not run by Inductor), the patched diffusers GELU forward
    still issues one _addmm_activation and no separate activation."""
    from diffusers.models.activations import GELU as DiffusersGELU

    monkeypatch.setattr(ic, "gemm_gelu_tanh_ok", lambda device, dtype: True)
    gen = make_generator()
    m = DiffusersGELU(16, 64, approximate="tanh").to(torch.bfloat16)
    x = torch.randn(2, 3, 16, generator=gen).to(torch.bfloat16)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda t: di._gelu_tanh_forward(m, t), backend=backend, fullgraph=True)
    with torch.no_grad():
        out = fn(x)
    assert out.shape == (2, 3, 64)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("_addmm_activation" in t for t in targets), targets
    assert not any("gelu" in t.lower() and "_addmm_activation" not in t for t in targets), targets


# --------------------------------------------------------------------------------------------
# Wiring in the LTX-Video injection
# --------------------------------------------------------------------------------------------
def test_ltx_feed_forwards_take_the_fused_path(monkeypatch):
    """With the check forced to pass, both tiny LTX feed-forwards go through linear_gelu_tanh and the
    GELU kernel is not called; bf16 output within the bf16 parity bound of the unpatched model."""
    import activations

    monkeypatch.setattr(ic, "gemm_gelu_tanh_ok", lambda device, dtype: True)
    fused, kernel = Counter(), Counter()
    orig, orig_kernel = ic.linear_gelu_tanh, activations.gelu_tanh

    def spy(x, proj):
        y = orig(x, proj)
        fused["fused" if y is not None else "declined"] += 1
        return y

    def kernel_spy(*a, **k):
        kernel["gelu_tanh"] += 1
        return orig_kernel(*a, **k)

    monkeypatch.setattr(ic, "linear_gelu_tanh", spy)
    monkeypatch.setattr(activations, "gelu_tanh", kernel_spy)
    gen = make_generator()
    tr = di.build_tiny_ltx_pipeline(num_layers=2).transformer.to(DEVICE, torch.bfloat16)
    b, f, h, w, t = 2, 3, 8, 8, 16
    kw = dict(
        hidden_states=torch.randn(b, f * h * w, 8, generator=gen).to(DEVICE, torch.bfloat16),
        encoder_hidden_states=torch.randn(b, t, 16, generator=gen).to(DEVICE, torch.bfloat16),
        timestep=torch.tensor([700.0, 300.0], device=DEVICE),
        encoder_attention_mask=torch.ones(b, t, device=DEVICE),
        num_frames=f,
        height=h,
        width=w,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )
    with torch.no_grad():
        stock = tr(**kw)[0]
        di.inject_optimized_kernels(tr, verbose=False)
        patched = tr(**kw)[0]
    assert fused == {"fused": 2} and kernel["gelu_tanh"] == 0
    assert rel_l2(patched, stock) <= 2.0**-5, gen.seed_value
    di.remove_optimized_kernels(tr, verbose=False)


def test_injection_note_empty_without_gpu_projections():
    from diffusers.models.activations import GELU as DiffusersGELU

    m = DiffusersGELU(16, 64, approximate="tanh").to(torch.bfloat16)
    assert ic.probe_gelu_modules([m]) == ""


# --------------------------------------------------------------------------------------------
# On a GPU: the real library
# --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU projection")
def test_injection_note_names_the_device():
    from diffusers.models.activations import GELU as DiffusersGELU

    ic._GEMM_GELU_TANH.clear()
    m = DiffusersGELU(16, 64, approximate="tanh").to(DEVICE, torch.bfloat16)
    note = ic.probe_gelu_modules([m, m])
    if ic.gemm_gelu_tanh_ok(DEVICE, torch.bfloat16):
        assert note.startswith("feed-forward GELU in the GEMM epilogue on cuda") and "bfloat16" in note
    else:
        assert note.startswith("GELU kernel after the GEMM on cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the BLAS epilogue runs on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 77, 256), (3, 1, 128)])
@torch.no_grad()
def test_gpu_result_against_float64(dtype, shape):
    ic._GEMM_GELU_TANH.clear()
    if not ic.gemm_gelu_tanh_ok(DEVICE, dtype):
        pytest.skip("this device's BLAS does not compute the tanh form in the epilogue")
    gen = make_generator()
    lin = _linear(shape[-1], 4 * shape[-1], dtype, gen)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    y = ic.linear_gelu_tanh(x, lin)
    assert y is not None and y.shape == (*shape[:-1], 4 * shape[-1])
    ref = F.gelu(x.double() @ lin.weight.double().t() + lin.bias.double(), approximate="tanh")
    assert_close(y, ref, dtype, name="linear_gelu_tanh", seed=gen.seed_value)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="the BLAS epilogue runs on a GPU")
@torch.no_grad()
def test_gpu_form_on_random_gemms_in_the_discriminating_range():
    """fp16, pre-activations around -2.5 (where tanh and erf GELU differ by 1e-4 to 4.7e-4): the fused
    result must match the tanh form and not the erf form at one fp16 rounding."""
    ic._GEMM_GELU_TANH.clear()
    if not ic.gemm_gelu_tanh_ok(DEVICE, torch.float16):
        pytest.skip("this device's BLAS does not compute the tanh form in the epilogue")
    gen = make_generator()
    lin = torch.nn.Linear(64, 512, dtype=torch.float16, device=DEVICE)
    lin.weight.copy_(torch.randn(512, 64, generator=gen, dtype=torch.float64) * 0.02)
    lin.bias.copy_(-2.5 + 0.3 * torch.rand(512, generator=gen, dtype=torch.float64))
    x = torch.randn(256, 64, generator=gen, dtype=torch.float64).to(DEVICE, torch.float16)
    y = ic.linear_gelu_tanh(x, lin)
    z = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert ic.gelu_forms_matched(y.double().cpu(), z.cpu(), torch.float16) == (True, False), gen.seed_value

"""Tests for injection_common's Linear + GELU-tanh in one BLAS call (torch._addmm_activation with the
activation in the GEMM epilogue): the check of which GELU form the library computes, the conditions
under which the path applies, and on a GPU its output against a float64 reference."""

import pytest
import torch
import torch.nn.functional as F

import injection_common as ic
from kernel_testing import DEVICE, assert_close, make_generator

ON_GPU = DEVICE.type == "cuda"


def _exact_z(n, lo, hi, dtype, gen):
    """n random pre-activations in [lo, hi], exactly representable in dtype (float64)."""
    z = lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)
    return z.to(dtype).double()


@pytest.mark.parametrize("seed", [0, 1])
def test_forms_told_apart_in_fp16(seed):
    gen = make_generator(seed)
    z = _exact_z(4096, -4.0, 3.0, torch.float16, gen)
    tanh_y = F.gelu(z.float(), approximate="tanh").half().double()
    erf_y = F.gelu(z.float()).half().double()
    assert ic.gelu_forms_matched(tanh_y, z, torch.float16) == (True, False)
    assert ic.gelu_forms_matched(erf_y, z, torch.float16) == (False, True)
    # a result one fp16 step off in the discriminating range matches neither
    off = tanh_y.clone()
    i = int(((z > -3.0) & (z < -2.0)).nonzero()[0])
    off[i] += 4 * torch.finfo(torch.float16).eps * abs(off[i]) + 1e-3
    assert ic.gelu_forms_matched(off, z, torch.float16) == (False, False)


def test_bf16_accepts_the_tanh_form():
    gen = make_generator(2)
    z = _exact_z(4096, -4.0, 3.0, torch.bfloat16, gen)
    y = F.gelu(z.float(), approximate="tanh").bfloat16().double()
    assert ic.gelu_forms_matched(y, z, torch.bfloat16)[0]


def test_probe_follows_the_form_the_cpu_computes():
    """torch's CPU build computes some form of GELU in _addmm_activation; the probe must say True
    exactly when that is the tanh form (torch 2.13's CPU build computes the erf form)."""
    gen = make_generator(3)
    x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
    w = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(12, generator=gen, dtype=torch.float64)
    y = torch._addmm_activation(b, x, w.t(), use_gelu=True)
    pre = x @ w.t() + b
    is_tanh = torch.allclose(y, F.gelu(pre, approximate="tanh"), rtol=0, atol=1e-12)
    is_erf = torch.allclose(y, F.gelu(pre), rtol=0, atol=1e-12)
    assert is_tanh != is_erf
    assert ic.probe_gemm_gelu_tanh("cpu", torch.bfloat16) == is_tanh


def test_never_on_the_cpu_or_when_turned_off(monkeypatch):
    ic._GEMM_GELU_TANH.clear()
    assert not ic.gemm_gelu_tanh_ok("cpu", torch.bfloat16)
    monkeypatch.setenv("RTK_GEMM_GELU", "0")
    assert not ic.gemm_gelu_tanh_ok("cuda", torch.bfloat16)  # decided before any probe runs
    assert not ic._GEMM_GELU_TANH


def _linear(n_in, n_out, dtype, gen, bias=True, device=DEVICE):
    lin = torch.nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=gen, dtype=torch.float64) * n_in**-0.5)
        if bias:
            lin.bias.copy_(torch.randn(n_out, generator=gen, dtype=torch.float64) * 0.5)
    return lin


@torch.no_grad()
def test_applies_only_where_it_should(monkeypatch):
    """With the form check forced to pass, the plain case runs (shape kept, result equal to the same
    call on 2-D input) and every excluded case returns None."""
    monkeypatch.setattr(ic, "gemm_gelu_tanh_ok", lambda device, dtype: True)
    gen = make_generator(4)
    dt = torch.bfloat16
    lin = _linear(24, 40, dt, gen, device="cpu")
    x = torch.randn(2, 5, 24, generator=gen).to(dt)
    y = ic.linear_gelu_tanh(x, lin)
    assert y is not None and y.shape == (2, 5, 40) and y.dtype == dt
    ref = torch._addmm_activation(lin.bias, x.reshape(10, 24), lin.weight.t(), use_gelu=True)
    assert torch.equal(y.reshape(10, 40), ref)

    assert ic.linear_gelu_tanh(x.float(), lin) is None  # fp32 input
    assert ic.linear_gelu_tanh(x, _linear(24, 40, dt, gen, bias=False, device="cpu")) is None
    assert ic.linear_gelu_tanh(x[..., :20], _linear(20, 40, torch.float16, gen, device="cpu")) is None  # dtype mix
    hooked = _linear(24, 40, dt, gen, device="cpu")
    hooked.register_forward_pre_hook(lambda m, a: None)
    assert ic.linear_gelu_tanh(x, hooked) is None
    replaced = _linear(24, 40, dt, gen, device="cpu")
    replaced.forward = lambda t: t
    assert ic.linear_gelu_tanh(x, replaced) is None

    class MyLinear(torch.nn.Linear):
        pass

    assert ic.linear_gelu_tanh(x, MyLinear(24, 40, dtype=dt)) is None
    with torch.enable_grad():
        assert ic.linear_gelu_tanh(x, _linear(24, 40, dt, gen, device="cpu").requires_grad_(True)) is None


@pytest.mark.skipif(not ON_GPU, reason="the BLAS epilogue runs on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 77, 256), (3, 1, 128)])
@torch.no_grad()
def test_gpu_result_against_float64(dtype, shape):
    ic._GEMM_GELU_TANH.clear()
    if not ic.gemm_gelu_tanh_ok(DEVICE, dtype):
        pytest.skip("this device's BLAS does not compute the tanh form in the epilogue")
    gen = make_generator(5)
    lin = _linear(shape[-1], 4 * shape[-1], dtype, gen)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    y = ic.linear_gelu_tanh(x, lin)
    assert y is not None and y.shape == (*shape[:-1], 4 * shape[-1])
    ref = F.gelu(x.double() @ lin.weight.double().t() + lin.bias.double(), approximate="tanh")
    assert_close(y, ref, dtype, name="linear_gelu_tanh", seed=5)


def test_injection_note_empty_without_gpu_projections():
    from diffusers.models.activations import GELU as DiffusersGELU

    m = DiffusersGELU(16, 64, approximate="tanh").to(torch.bfloat16)
    assert ic.probe_gelu_modules([m]) == ""


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

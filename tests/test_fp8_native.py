# SPDX-License-Identifier: Apache-2.0
"""FP8 output through Triton's own cast (hardware conversion) vs the integer encoder (_fp8_encode).

On a GPU where scripts/rmsnorm.py and scripts/activations.py pick the native cast (`_native_fp8`), the
same launch with the integer encoder forced must give the same bytes: every finite value rounds to
nearest even and saturates, identically. Inputs are bfloat16 bit patterns over the whole FP8 range
(ties, subnormals, values past the largest finite FP8), plus infinities and NaN. On the CPU (the
interpreter) only the choice table is checked: the interpreter always uses the integer encoder.
"""

import pytest
import torch

import activations as act
import rmsnorm
from conftest import clear_launch_plans
from kernel_testing import DEVICE, INTERPRET, make_generator, poisoned_outputs

MODULES = [rmsnorm, act]
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0}


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
@pytest.mark.parametrize(
    "target, fmt, expected",
    [
        (("cuda", 90, 32), torch.float8_e4m3fn, True),
        (("cuda", 89, 32), torch.float8_e4m3fn, True),
        (("cuda", 80, 32), torch.float8_e4m3fn, False),  # no FP8 conversion instruction before sm_89
        (("cuda", 90, 32), torch.float8_e4m3fnuz, False),
        (("hip", "gfx942", 64), torch.float8_e4m3fnuz, True),
        (("hip", "gfx942:sramecc+:xnack-", 64), torch.float8_e4m3fnuz, True),
        (("hip", "gfx942", 64), torch.float8_e4m3fn, False),
        (("hip", "gfx950", 64), torch.float8_e4m3fn, True),
        (("hip", "gfx950", 64), torch.float8_e4m3fnuz, False),
        (("hip", "gfx1201", 32), torch.float8_e4m3fn, False),  # Triton's own lowering is software there
    ],
)
def test_native_choice(mod, target, fmt, expected, monkeypatch):
    monkeypatch.setattr(mod, "_device_target", lambda device: target)
    monkeypatch.setattr(mod, "_interpreting", lambda: False)
    monkeypatch.setattr(mod, "_TRITON_VERSION", (3, 9))
    assert mod._native_fp8(torch.device("cuda", 0), fmt) is expected


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
def test_gfx950_native_from_triton_3_6(mod, monkeypatch):
    """Triton 3.6 and 3.9 both lower fp32 -> e4m3fn on gfx950 to v_cvt_scalef32_pk_fp8_f32 (ahead-of-time
    output); versions before 3.6 were not checked and keep the integer encoder."""
    monkeypatch.setattr(mod, "_device_target", lambda device: ("hip", "gfx950", 64))
    monkeypatch.setattr(mod, "_interpreting", lambda: False)
    monkeypatch.setattr(mod, "_TRITON_VERSION", (3, 5))
    assert mod._native_fp8(torch.device("cuda", 0), torch.float8_e4m3fn) is False
    for version in ((3, 6), (3, 9), (3, 10)):
        monkeypatch.setattr(mod, "_TRITON_VERSION", version)
        assert mod._native_fp8(torch.device("cuda", 0), torch.float8_e4m3fn) is True


@pytest.mark.parametrize("mod", MODULES, ids=lambda m: m.__name__)
def test_interpreter_never_native(mod):
    if not INTERPRET:
        pytest.skip("checks the interpreter's choice")
    assert mod._native_fp8(torch.device("cpu"), torch.float8_e4m3fn) is False


def _bf16_over_fp8_range(n: int, fmt, gen) -> torch.Tensor:
    """bfloat16 values whose magnitudes span FP8's subnormals to 4x its largest finite value, with random
    low mantissa bits (so exact ties of FP8's 3-bit mantissa occur), both signs, and a few infinities
    and NaNs."""
    exp = torch.randint(-12, 11, (n,), generator=gen)  # 2**-12 ... 2**10 (FP8 e4m3 max 448 / 240)
    mant = torch.randint(0, 128, (n,), generator=gen).float() / 128.0
    sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    v = (sign * (1.0 + mant) * torch.pow(2.0, exp.float())).to(torch.bfloat16)
    v[:: max(1, n // 7)] = float("inf")
    v[3 :: max(1, n // 5)] = float("-inf")
    v[5 :: max(1, n // 3)] = float("nan")
    return v


def _same_fp8(a: torch.Tensor, b: torch.Tensor, fmt) -> None:
    assert a.dtype == b.dtype == fmt
    af, bf = a.float(), b.float()
    nan_a, nan_b = torch.isnan(af), torch.isnan(bf)
    assert torch.equal(nan_a, nan_b), "NaN in one encoding and not the other"
    # NaN codes may carry either sign; every other byte must be identical
    ab, bb = a.view(torch.uint8)[~nan_a], b.view(torch.uint8)[~nan_b]
    bad = (ab != bb).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {ab.numel()} bytes differ; first: native {ab[bad[:5]].tolist()} vs "
        f"integer encoder {bb[bad[:5]].tolist()} for {af[~nan_a][bad[:5]].tolist()}"
    )


def _native_and_software(mod, fmt, monkeypatch, call):
    if INTERPRET:
        pytest.skip("the native FP8 cast runs on a GPU only")
    if not mod._native_fp8(DEVICE, fmt):
        pytest.skip(f"{mod.__name__} does not use the native cast for {fmt} on this GPU")
    with poisoned_outputs():
        native = call()
    with monkeypatch.context() as m:
        m.setattr(mod, "_native_fp8", lambda device, dtype: False)
        clear_launch_plans()
        with poisoned_outputs():
            software = call()
    return native, software


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FP8_MAX))
@pytest.mark.parametrize("mode", ["per_tensor", "per_token"])
def test_swiglu_native_equals_integer_encoder(fmt, mode, monkeypatch):
    gen = make_generator()
    rows, h = 64, 1000
    # silu(64) == 64 exactly in fp32 (sigmoid(64) rounds to 1), and 1 / 64 is exact: with a per-tensor
    # scale of 64 the value handed to the encoder is exactly `up`, so the crafted bit patterns reach it
    gate = torch.full((rows, h), 64.0, dtype=torch.bfloat16)
    up = _bf16_over_fp8_range(rows * h, fmt, gen).reshape(rows, h)
    if mode == "per_token":  # finite rows only: a per-row maximum of inf or NaN makes every scale inf/NaN
        up = torch.nan_to_num(up, nan=1.0, posinf=3e3, neginf=-3e3)
    gate, up = gate.to(DEVICE), up.to(DEVICE)
    scale = torch.tensor([64.0], device=DEVICE) if mode == "per_tensor" else None

    def call():
        out = act.swiglu(gate, up, fp8=mode, fp8_scale=scale, fp8_dtype=fmt)
        return out if mode == "per_tensor" else out[0]

    native, software = _native_and_software(act, fmt, monkeypatch, call)
    _same_fp8(native, software, fmt)
    if mode == "per_tensor":  # the crafted values really cover saturation and the subnormals
        q = native.float()
        assert (q.abs() == FP8_MAX[fmt]).any() and ((q != 0) & (q.abs() < 2.0**-6)).any()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", list(FP8_MAX))
@pytest.mark.parametrize("mode", ["per_tensor", "per_token"])
@pytest.mark.parametrize("h", [4096, 5000, 20000])  # one pass in registers, masked tail, chunked passes
def test_fused_add_rmsnorm_native_equals_integer_encoder(fmt, mode, h, monkeypatch):
    gen = make_generator()
    rows = 33
    x = (torch.randn(rows, h, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    r = (torch.randn(rows, h, generator=gen)).to(torch.bfloat16).to(DEVICE)
    w = (torch.rand(h, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    # a small per-tensor scale saturates the largest outputs and leaves the smallest subnormal
    scale = torch.tensor([0.01], device=DEVICE) if mode == "per_tensor" else None

    def call():
        return rmsnorm.fused_add_rms_norm(x, r, w, 1e-6, fp8=mode, fp8_scale=scale, fp8_dtype=fmt)[0]

    native, software = _native_and_software(rmsnorm, fmt, monkeypatch, call)
    _same_fp8(native, software, fmt)

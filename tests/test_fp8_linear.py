# SPDX-License-Identifier: Apache-2.0
"""fp8_linear.py: per-channel FP8 weights, per-token FP8 inputs and torch._scaled_mm, against float64."""

import pytest
import torch

import activations
import fp8_linear as fl
from kernel_testing import DEVICE, assert_close, poisoned_outputs, randn
from test_fused_add_rmsnorm import FP8_DTYPES, FP8_MAX, _fp8_step


def _layer(k, n, gen, bias=True, dtype=torch.bfloat16):
    lin = torch.nn.Linear(k, n, bias=bias).to(DEVICE, dtype)
    with torch.no_grad():
        lin.weight.copy_(randn((n, k), torch.float32, gen, scale=k**-0.5))
        if bias:
            lin.bias.copy_(randn((n,), torch.float32, gen, scale=0.1))
    return lin


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_quantize_weight_per_channel(fp8_dtype, gen):
    w = randn((48, 64), torch.bfloat16, gen)
    w[5] = 0.0  # a zero row: scale 1e-12, values 0
    q, s = fl.quantize_weight(w, fp8_dtype)
    assert q.dtype == fp8_dtype and s.dtype == torch.float32 and s.shape == (48,)
    expected = (w.double().abs().amax(1) / FP8_MAX[fp8_dtype]).clamp_min(1e-12)
    assert_close(s, expected, torch.float32, rtol=1e-6, atol=0, name="scales", seed=gen.seed_value)
    v = w.double() / s.double()[:, None]
    assert bool(((q.double() - v).abs() <= _fp8_step(q.double(), fp8_dtype) / 2 * 1.0001).all())
    assert bool((q[5].double() == 0).all()) and not torch.isnan(q.double()).any()
    assert torch.equal(q.double().abs().amax(1).cpu()[torch.arange(48) != 5], torch.full((47,), FP8_MAX[fp8_dtype]))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("shape", [(7, 64), (2, 5, 128)])
def test_fp8_linear_matches_float64(shape, per_token, fp8_dtype, gen):
    k, n = shape[-1], 96
    x = randn(shape, torch.bfloat16, gen, scale=2.0)
    if per_token:
        xq, xs = activations.fp8_quantize(x, fp8_dtype=fp8_dtype)
    else:
        xs = torch.tensor([2.0**-6], device=DEVICE)
        xq = activations.fp8_quantize(x, "per_tensor", fp8_scale=xs, fp8_dtype=fp8_dtype)
    wq, ws = fl.quantize_weight(randn((n, k), torch.float32, gen, scale=k**-0.5), fp8_dtype)
    bias = randn((n,), torch.bfloat16, gen, scale=0.1)
    if DEVICE.type != "cpu" and fp8_dtype != activations._fp8_dtype_for(DEVICE):
        with pytest.raises(TypeError, match="not this GPU's FP8 format"):  # the BLAS would assert or fail
            fl.fp8_linear(xq, xs, wq, ws, bias)
        return
    y = fl.fp8_linear(xq, xs, wq, ws, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (*shape[:-1], n)
    # one bf16 rounding of an fp32 accumulation of exact products
    assert_close(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias), torch.bfloat16, seed=gen.seed_value)


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the CPU computes either format; a GPU's BLAS takes one")
@pytest.mark.parametrize("made_on", ["gpu", "cpu, then moved"])
def test_fp8_layer_in_the_other_format_refused_on_a_gpu(made_on, gen):
    """An Fp8Linear holding the format the GPU's BLAS does not take raises a TypeError on forward and
    forward_fp8 (cuBLASLt would fail with an internal assert), also when it was made on the CPU and moved."""
    other = {torch.float8_e4m3fn: torch.float8_e4m3fnuz, torch.float8_e4m3fnuz: torch.float8_e4m3fn}[
        activations._fp8_dtype_for(DEVICE)
    ]
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    layer = fl.Fp8Linear.from_linear(lin.to(DEVICE) if made_on == "gpu" else lin, other).to(DEVICE)
    x = randn((3, 64), torch.bfloat16, gen)
    with torch.no_grad(), pytest.raises(TypeError, match="does not take"):
        layer(x)
    xq, xs = activations.fp8_quantize(x, fp8_dtype=other)
    with torch.no_grad(), pytest.raises(TypeError, match="does not take"):
        layer.forward_fp8(xq, xs)


def test_fp8_linear_float32_output_with_bias(gen):
    """torch._scaled_mm takes no bias with float32 output: the bias is added after it, in fp32. A GPU's FP8
    matrix units may accumulate with fewer bits than fp32 (about 1e-4 relative on an H200), far below a
    misplaced bias (about 1 here)."""
    xq, xs = activations.fp8_quantize(randn((4, 32), torch.float32, gen))
    wq, ws = fl.quantize_weight(randn((16, 32), torch.float32, gen))
    bias = randn((16,), torch.float32, gen)
    y = fl.fp8_linear(xq, xs, wq, ws, bias, out_dtype=torch.float32)
    tol = 1e-5 if DEVICE.type == "cpu" else 1e-3
    assert_close(y, fl.fp8_linear_ref(xq, xs, wq, ws, bias), torch.float32, rtol=tol, atol=tol, seed=gen.seed_value)


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_layer_against_bf16_layer(bias, gen):
    lin = _layer(256, 128, gen, bias)
    x = randn((3, 9, 256), torch.bfloat16, gen)
    f8 = fl.Fp8Linear.from_linear(lin)
    assert f8.weight_fp8.dtype == activations._fp8_dtype_for(DEVICE) and f8.out_dtype == torch.bfloat16
    with torch.no_grad(), poisoned_outputs():
        y8, y = f8(x), lin(x)
        xq, xs = activations.fp8_quantize(x, fp8_dtype=f8.weight_fp8.dtype)
        assert torch.equal(f8.forward_fp8(xq, xs), y8), "forward is fp8_quantize then forward_fp8"
    # the product itself is exact up to the output rounding: the error is FP8's, a few percent
    assert_close(y8, fl.fp8_linear_ref(xq, xs, f8.weight_fp8, f8.weight_scale, f8.bias), torch.bfloat16)
    rel = float((y8.double() - y.double()).norm() / y.double().norm())
    assert 1e-4 < rel < 0.06, f"FP8 layer off the bf16 layer by rel. L2 {rel:.4f} (seed {gen.seed_value})"


ERRORS = {
    "K not a multiple of 16": (lambda g: fl.Fp8Linear.from_linear(torch.nn.Linear(40, 32)), ValueError, "multiples"),
    "N not a multiple of 16": (lambda g: fl.Fp8Linear.from_linear(torch.nn.Linear(32, 40)), ValueError, "multiples"),
    "not a linear layer": (lambda g: fl.Fp8Linear.from_linear(torch.nn.Conv1d(16, 16, 1)), TypeError, "nn.Linear"),
    "int8 weight": (
        lambda g: fl.quantize_weight(torch.ones((16, 16), dtype=torch.int8)),
        ValueError,
        "floating-point",
    ),
    "bad fp8 dtype": (lambda g: fl.quantize_weight(torch.ones(16, 16), torch.float8_e5m2), TypeError, "fp8_dtype"),
    "mixed fp8 dtypes": (
        lambda g: fl.fp8_linear(
            torch.ones(2, 16).to(torch.float8_e4m3fn),
            torch.ones(2),
            torch.ones(16, 16).to(torch.float8_e4m3fnuz),
            torch.ones(16),
        ),
        TypeError,
        "share one FP8 dtype",
    ),
    "wrong x_scale shape": (
        lambda g: fl.fp8_linear(
            torch.ones(2, 16).to(torch.float8_e4m3fn),
            torch.ones(3),
            torch.ones(16, 16).to(torch.float8_e4m3fn),
            torch.ones(16),
        ),
        ValueError,
        "x_scale",
    ),
    "wrong feature count": (
        lambda g: fl.Fp8Linear.from_linear(torch.nn.Linear(32, 16)).forward(torch.ones(2, 16, device=DEVICE)),
        ValueError,
        "features",
    ),
}


@pytest.mark.parametrize(
    "bad",
    ["scales transposed", "input transposed, scales not", "one scale per batch", "other format", "float16 scales"],
)
def test_forward_fp8_refuses_inputs_its_scales_do_not_match(bad, gen):
    """forward_fp8 takes scales shaped like the input's rows (or one value): scales with the right number of
    elements in another layout would be applied to the wrong rows (no error from the GEMM)."""
    layer = fl.Fp8Linear.from_linear(_layer(64, 32, gen))
    x = randn((2, 3, 64), torch.bfloat16, gen)
    xq, xs = activations.fp8_quantize(x, fp8_dtype=layer.weight_fp8.dtype)
    other = {torch.float8_e4m3fn: torch.float8_e4m3fnuz, torch.float8_e4m3fnuz: torch.float8_e4m3fn}
    args, exc = {
        "scales transposed": ((xq, xs.t().contiguous()), ValueError),
        "input transposed, scales not": ((xq.transpose(0, 1), xs), ValueError),
        "one scale per batch": ((xq, xs[:, :1]), ValueError),
        "other format": ((xq.view(torch.uint8).view(other[xq.dtype]), xs), TypeError),
        "float16 scales": ((xq, xs.half()), TypeError),
    }[bad]
    with torch.no_grad(), pytest.raises(exc, match="forward_fp8 takes"):
        layer.forward_fp8(*args)


@pytest.mark.parametrize("replaced", ["same values", "bias of one element", "bf16 scales", "other shape"])
def test_a_buffer_put_in_place_is_checked_like_a_new_layer(replaced, gen):
    """A buffer replaced in module._buffers (as accelerate's offloading moves tensors) is checked as the
    constructor would check it: one the layer can use computes (and in-place writes to it are refused
    again), others raise ValueError instead of broadcasting or reaching the BLAS."""
    layer = fl.Fp8Linear.from_linear(_layer(64, 32, gen))
    x = randn((5, 64), torch.bfloat16, gen)
    with torch.no_grad():
        before = layer(x)
    b = layer._buffers
    b.update(
        {
            "same values": {"weight_fp8": b["weight_fp8"].clone(), "bias": b["bias"].clone()},
            "bias of one element": {"bias": b["bias"][:1].float()},
            "bf16 scales": {"weight_scale": b["weight_scale"].bfloat16()},
            "other shape": {"weight_fp8": b["weight_fp8"].reshape(64, 32)},
        }[replaced]
    )
    with torch.no_grad():
        if replaced != "same values":
            with pytest.raises(ValueError, match="replaced by one it cannot use"):
                layer(x)
            return
        assert torch.equal(layer(x), before)
        layer.bias.add_(1.0)
        with pytest.raises(RuntimeError, match="written after quantisation"):
            layer(x)


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case, gen):
    fn, exc, match = ERRORS[case]
    with pytest.raises(exc, match=match):
        fn(gen)


def test_self_check_runs(capsys):
    assert fl._main(["--tokens", "16", "--in-features", "64", "--out-features", "32"]) == 0
    assert '"ok": true' in capsys.readouterr().out


def test_swap_keeps_a_layer_an_accelerate_or_diffusers_hook_wraps(gen):
    """Such a hook lives in the module's instance (not in torch's hook lists): replacing the module would
    drop it, so the layer stays in bf16."""
    root = torch.nn.Sequential(_layer(32, 32, gen), _layer(32, 32, gen), _layer(32, 32, gen))
    root[0]._hf_hook = object()  # what accelerate's add_hook_to_module leaves on a module
    root[1]._diffusers_hook = object()  # likewise diffusers' HookRegistry
    swapped, left = fl.swap_in_fp8(root, [root])
    assert swapped == 1 and isinstance(root[2], fl.Fp8Linear)
    assert type(root[0]) is torch.nn.Linear and type(root[1]) is torch.nn.Linear and len(left) == 2
    assert fl.restore_from_fp8(root) == 1 and type(root[2]) is torch.nn.Linear


def test_layer_moved_out_of_the_meta_device_raises_until_its_state_is_loaded(gen):
    """meta -> to_empty gives memory without values: the layer raises instead of computing with them, refuses
    half a state, and computes as before once its own state dict is loaded."""
    f8 = fl.Fp8Linear.from_linear(_layer(64, 32, gen), None)
    x = randn((5, 64), torch.bfloat16, gen)
    before, sd = f8(x), {k: v.clone() for k, v in f8.state_dict().items()}
    f8.to("meta")
    f8.to_empty(device=DEVICE)
    with pytest.raises(RuntimeError, match="never set"):
        f8(x)
    with pytest.raises(RuntimeError, match="load both"):
        f8.load_state_dict({"weight_fp8": sd["weight_fp8"]}, strict=False)
    f8.load_state_dict(sd)
    assert torch.equal(f8(x), before)


def test_restore_keeps_each_original_as_it_was(gen):
    """A bf16 layer with a float32 bias comes back with it (only a model cast since changes the dtype)."""
    root = torch.nn.Sequential(_layer(64, 32, gen))
    with torch.no_grad():
        root[0].bias.data = root[0].bias.float()
    original = root[0]
    assert fl.swap_in_fp8(root, [root], offload=False)[0] == 1
    assert fl.restore_from_fp8(root) == 1
    assert root[0] is original and original.bias.dtype == torch.float32 and original.weight.dtype == torch.bfloat16


def test_a_module_named_base_layer_is_not_taken_for_an_adapter(gen):
    """Only peft's tuner layers (class attribute adapter_layer_names) keep their linear layers in bf16."""

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_layer = _layer(64, 32, gen)

    class Tuner(Holder):
        adapter_layer_names = ("lora_A", "lora_B")

    plain, tuned = torch.nn.Sequential(Holder()), torch.nn.Sequential(Tuner())
    assert fl.swap_in_fp8(plain, list(plain.modules()), offload=False) == (1, [])
    done, left = fl.swap_in_fp8(tuned, list(tuned.modules()), offload=False)
    assert done == 0 and left == [fl._ADAPTED] and type(tuned[0].base_layer) is torch.nn.Linear


def test_replacing_one_buffer_keeps_an_in_place_write_to_another_refused(gen):
    layer = fl.Fp8Linear.from_linear(_layer(64, 32, gen))
    x = randn((5, 64), torch.bfloat16, gen)
    with torch.no_grad():
        layer(x)
        layer.weight_scale.mul_(2.0)
        layer._buffers["bias"] = layer.bias.clone()  # as offloading moves a buffer
        with pytest.raises(RuntimeError, match="written after quantisation"):
            layer(x)


def test_a_bias_replaced_by_none_is_taken_as_no_bias(gen):
    """Also once the sealed bias tensor is freed (its weak reference then answers None, as no bias does)."""
    import gc

    layer = fl.Fp8Linear.from_linear(_layer(64, 32, gen))
    x = randn((5, 64), torch.bfloat16, gen)
    layer._buffers["bias"] = None
    gc.collect()
    with torch.no_grad():
        y = layer(x)
        xq, xs = activations.fp8_quantize(x, fp8_dtype=layer.weight_fp8.dtype)
    assert_close(y, fl.fp8_linear_ref(xq, xs, layer.weight_fp8, layer.weight_scale, None), torch.bfloat16)


@pytest.mark.parametrize("fast", [True, False])
def test_accumulation_setting_reaches_the_gemm_and_a_long_sum_stays_accurate(fast, gen, monkeypatch):
    """fp8_linear.FAST_ACCUMULATION is what every FP8 GEMM asks torch._scaled_mm for (Fp8Linear's forward and
    forward_fp8, fp8_linear), read at each call. With K = 4096 (LTX-Video's and FLUX's feed-forward down
    projections are 8192-12288) the product of exact FP8 values stays within 1 % (rel. L2) of float64 in
    either setting: a GPU's fast mode promotes partial sums less often, and that error must stay well under
    the 3-4 % that quantisation itself adds per layer."""
    monkeypatch.setattr(fl, "FAST_ACCUMULATION", fast)
    seen, real = [], torch._scaled_mm

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_fast_accum"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    k, n = 4096, 256
    layer = fl.Fp8Linear.from_linear(_layer(k, n, gen))
    x = randn((3, 37, k), torch.bfloat16, gen, offset=0.25)  # an offset: long sums of one sign
    with torch.no_grad():
        xq, xs = activations.fp8_quantize(x, fp8_dtype=layer.weight_fp8.dtype)
        outs = [layer(x), layer.forward_fp8(xq, xs), fl.fp8_linear(xq, xs, layer.weight_fp8, layer.weight_scale)]
    assert seen == [fast] * 3
    ref = fl.fp8_linear_ref(xq, xs, layer.weight_fp8, layer.weight_scale, layer.bias)
    no_bias = fl.fp8_linear_ref(xq, xs, layer.weight_fp8, layer.weight_scale)
    for out, ref in zip(outs, (ref, ref, no_bias)):
        rel = float((out.double() - ref).norm() / ref.norm())
        assert rel < 1e-2, f"rel. L2 {rel:.2e} from the exact FP8 product (seed {gen.seed_value})"

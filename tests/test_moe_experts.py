# SPDX-License-Identifier: Apache-2.0
"""moe_swiglu_experts (scripts/moe_experts.py): the routed experts' SwiGLU MLPs of a decode step against a float64
reference (rounded where transformers' experts round), its checks, and the transformers experts modules it
replaces at decode (their probe, the forward it takes over, restoration)."""

import pytest
import torch

import moe_experts as me
from kernel_testing import DEVICE, DTYPES, assert_close, poisoned_outputs, randn


def _case(t, e, k, h, i, dtype, gen, w_dtype=torch.float32):
    x = randn((t, h), dtype, gen)
    gate_up = randn((e, 2 * i, h), dtype, gen, scale=h**-0.5)
    down = randn((e, h, i), dtype, gen, scale=i**-0.5)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(DEVICE)
    w = torch.rand(t, k, generator=gen).softmax(-1).to(DEVICE, w_dtype)
    return x, idx, w, gate_up, down


def _ref(x, idx, w, gate_up, down, gate_first=True):
    return me.moe_swiglu_experts_ref(
        x.double(), idx.cpu(), w, gate_up.double(), down.double(), gate_first, dtype=x.dtype
    )


@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8, 2, 64, 96), (3, 4, 2, 40, 33), (2, 16, 8, 128, 24), (1, 1, 1, 300, 520)])
def test_matches_float64(shape, dtype, gate_first, gen):
    x, idx, w, gate_up, down = _case(*shape, dtype, gen)
    with poisoned_outputs():
        out = me.moe_swiglu_experts(x, idx, w, gate_up, down, gate_first=gate_first)
    assert out.dtype == dtype and out.shape == x.shape
    ref = _ref(x, idx, w.double(), gate_up, down, gate_first)
    assert_close(out, ref, dtype, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_routing_weights_round_the_product(dtype, gen):
    """bf16 weights with bf16 x: torch rounds w * y to bf16 before the sum; the kernel does too."""
    x, idx, w, gate_up, down = _case(2, 8, 4, 64, 48, dtype, gen, w_dtype=dtype)
    out = me.moe_swiglu_experts(x, idx, w, gate_up, down)
    assert_close(out, _ref(x, idx, w.cpu(), gate_up, down), dtype, seed=gen.seed_value)


def test_int32_index_and_strided_routing(gen):
    x, idx, w, gate_up, down = _case(3, 6, 2, 32, 16, torch.float32, gen)
    wide = torch.zeros(3, 4, device=DEVICE)
    wide[:, ::2] = w  # a strided [T, K] view
    out = me.moe_swiglu_experts(x, idx.int(), wide[:, ::2], gate_up, down)
    assert_close(out, _ref(x, idx, w.double(), gate_up, down), torch.float32, seed=gen.seed_value)


def test_checks():
    x = torch.zeros(2, 16, device=DEVICE)
    gu, dn = torch.zeros(4, 12, 16, device=DEVICE), torch.zeros(4, 16, 6, device=DEVICE)
    idx, w = torch.zeros(2, 2, dtype=torch.long, device=DEVICE), torch.zeros(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="down must have shape"):
        me.moe_swiglu_experts(x, idx, w, gu, dn[:, :, :5])
    with pytest.raises(ValueError, match=r"must both have shape \[2, K\]"):
        me.moe_swiglu_experts(x, idx[:1], w[:1], gu, dn)
    with pytest.raises(TypeError, match="gate_up has dtype float16"):
        me.moe_swiglu_experts(x, idx, w, gu.half(), dn)
    with pytest.raises(ValueError, match="more than MAX_PAIRS"):
        big = me.MAX_PAIRS + 1
        me.moe_swiglu_experts(x.new_zeros(big, 16), idx.new_zeros(big, 1), w.new_zeros(big, 1), gu, dn)
    with pytest.raises(RuntimeError, match="no backward"), torch.enable_grad():
        me.moe_swiglu_experts(x.requires_grad_(), idx, w, gu, dn)


def test_expert_id_out_of_range_reads_nothing(gen):
    """An id outside [0, E) contributes zero: no read past the weights (the kernel cannot raise)."""
    x, idx, w, gate_up, down = _case(1, 4, 2, 32, 16, torch.float32, gen)
    bad = idx.clone()
    bad[0, 1] = 4
    out = me.moe_swiglu_experts(x, bad, w, gate_up, down)
    one = me.moe_swiglu_experts(x, idx[:, :1], w[:, :1], gate_up, down)
    assert torch.equal(out, one)


# ---- the transformers experts modules it serves at decode (transformers_injection._experts_forward) ---------
def _tiny(family, gen):
    import transformers_families as tf

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    return tf.build(tf.tiny_config(family), device=DEVICE, dtype=torch.float32, seed=seed)


def _experts(model):
    import transformers_injection as ti

    return [m for m in model.modules() if ti._experts_structure(m) is not None]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_injection_serves_decode_and_steps_aside(family, gen):
    """At decode (pairs <= experts) the experts module's forward is the two kernels, with the stock module's
    output to fp32 rounding; with more pairs, autograd or a hooked activation, its own forward runs; removal
    leaves no instance attribute."""
    import transformers_injection as ti

    model = _tiny(family, gen)
    ex = _experts(model)[0]
    n_exp, _, h = ex.gate_up_proj.shape
    x = randn((n_exp, h), torch.float32, gen)
    idx = torch.stack([torch.randperm(n_exp, generator=gen)[:2] for _ in range(n_exp)]).to(DEVICE)
    w = torch.rand(n_exp, 2, generator=gen).to(DEVICE)
    with torch.no_grad():
        ref = ex(x, idx, w)
    ti.inject_optimized_kernels(model, verbose=False)
    assert getattr(ex.__dict__.get("forward"), "__func__", None) is ti._experts_forward
    for t, want in ((1, 1), (n_exp // 2, 1), (n_exp, 0)):  # pairs = 2 t: at most the experts -> kernels
        with torch.no_grad(), ti.count_kernel_calls() as calls:
            out = ex(x[:t], idx[:t], w[:t])
        assert calls["moe_swiglu_experts"] == want, (t, dict(calls))
        assert_close(out, ref[:t], torch.float32, rtol=1e-5, atol=1e-6)
    ex.act_fn.register_forward_hook(lambda *a: None) if hasattr(ex, "act_fn") else None
    with torch.no_grad(), ti.count_kernel_calls() as calls:
        ex(x[:1], idx[:1], w[:1])
    assert calls["moe_swiglu_experts"] == int(not hasattr(ex, "act_fn"))
    ti.remove_optimized_kernels(model, verbose=False)
    assert "forward" not in ex.__dict__ and "_apply_gate" not in ex.__dict__ and ti._STATE not in ex.__dict__


def test_injection_leaves_experts_that_compute_something_else(gen):
    """Experts whose forward ignores the routing weights keep their _apply_gate kernel but not the decode path:
    the probe of what the forward computes finds the difference."""
    import transformers_injection as ti

    model = _tiny("mixtral", gen)
    ex = _experts(model)[0]
    cls = type(ex)
    odd = type("UnweightedExperts", (cls,), {"forward": lambda self, h, i, w: cls.forward(self, h, i, w * 0 + 1)})
    for m in _experts(model):
        m.__class__ = odd
    ti.inject_optimized_kernels(model, verbose=False)
    assert "_apply_gate" in ex.__dict__ and "forward" not in ex.__dict__
    reason = ti._probe("experts_decode", ex, lambda m: ti._experts_decode_probe(m, "act_fn", True), extra=("t",))
    assert "another function" in reason
    ti.remove_optimized_kernels(model, verbose=False)

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
    """Experts whose forward ignores the routing weights, or clamps large outputs, keep their _apply_gate kernel but
    not the decode path: the probe of what the forward computes (at small and large scales) finds the difference."""
    import transformers_injection as ti

    cls = type(_experts(_tiny("mixtral", gen))[0])
    for name, fwd in (
        ("UnweightedExperts", lambda self, h, i, w: cls.forward(self, h, i, w * 0 + 1)),
        ("ClampedOutputExperts", lambda self, h, i, w: cls.forward(self, h, i, w).clamp(-1e3, 1e3)),  # large only
    ):
        model = _tiny("mixtral", gen)
        for m in _experts(model):
            m.__class__ = type(name, (cls,), {"forward": fwd})
        ex = _experts(model)[0]
        ti.inject_optimized_kernels(model, verbose=False)
        assert "_apply_gate" in ex.__dict__ and "forward" not in ex.__dict__, name
        reason = ti._probe("experts_decode", ex, lambda m: ti._experts_decode_probe(m, "act_fn", True), extra=(name,))
        assert "another function" in reason, name
        ti.remove_optimized_kernels(model, verbose=False)


@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.float16])
def test_rounds_where_transformers_rounds(w_dtype, gate_first, gen):
    """fp16 (the interpreter rounds fp16 as a GPU does): the kernel's result is the float64 reference rounded at
    the same points (the GEMM outputs, silu(g) * u once, w * y where torch's promotion gives fp16, the sum once)
    in almost every element; a rounding point left out or added moves a large share of them by an ulp."""
    x, idx, w, gate_up, down = _case(4, 8, 2, 256, 96, torch.float16, gen, w_dtype=w_dtype)
    out = me.moe_swiglu_experts(x, idx, w, gate_up, down, gate_first=gate_first)
    ref = me.moe_swiglu_experts_ref(
        x.double(), idx.cpu(), w.cpu(), gate_up.double(), down.double(), gate_first, dtype=torch.float16
    )
    same = float((out.cpu() == ref).double().mean())
    assert same >= 0.97, f"{same:.3f} of the elements equal the reference's roundings (seed {gen.seed_value})"


def test_out_of_range_ids_read_no_neighbouring_memory(gen):
    """The weights as views into larger buffers whose neighbouring experts hold NaN: an id of E (or -1) must read
    none of them (it contributes 0; a NaN read by either kernel reaches the output, 0 * NaN being NaN)."""
    x, idx, w, gate_up, down = _case(1, 4, 2, 32, 16, torch.float32, gen)
    nan = float("nan")
    big_gu, big_dn = torch.full((6, 32, 32), nan, device=DEVICE), torch.full((6, 32, 16), nan, device=DEVICE)
    big_gu[1:5], big_dn[1:5] = gate_up, down
    gu, dn = big_gu[1:5], big_dn[1:5]  # experts 0..3; -1 and 4 would be the NaN ones
    want = me.moe_swiglu_experts(x, idx[:, :1], w[:, :1], gu, dn)
    for bad in (4, -1):
        ids = idx.clone()
        ids[0, 1] = bad
        assert torch.equal(me.moe_swiglu_experts(x, ids, w, gu, dn), want), bad


# ---- what the injection's decode path steps aside for, and the modules it must not take ------------------------
def _injected_mixtral(gen, **cfg):
    import transformers_families as tf
    import transformers_injection as ti

    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    model = tf.build(tf.tiny_config("mixtral", **cfg), device=DEVICE, dtype=torch.float32, seed=seed)
    ex = _experts(model)[0]
    n_exp, _, h = ex.gate_up_proj.shape
    args = (
        randn((1, h), torch.float32, gen),
        torch.tensor([[0, n_exp - 1]], device=DEVICE),
        torch.rand(1, 2, device=DEVICE),
    )
    with torch.no_grad():
        ref = ex(*args)
    ti.inject_optimized_kernels(model, verbose=False)
    return ti, model, ex, args, ref


def _calls(ti, fn):
    with ti.count_kernel_calls() as calls:
        out = fn()
    return out, calls["moe_swiglu_experts"]


def test_decode_path_steps_aside(gen):
    ti, model, ex, args, ref = _injected_mixtral(gen)
    with torch.no_grad():
        assert _calls(ti, lambda: ex(*args))[1] == 1
        ex._is_expert_parallel = True
        out, n = _calls(ti, lambda: ex(*args))
        assert n == 0 and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
        ex._is_expert_parallel = False
        with pytest.raises(TypeError):  # an argument the module does not take: its own forward says so
            ex(*args, 1.0)
    ex.gate_up_proj.requires_grad_(True)
    with torch.enable_grad():  # trainable weights in grad mode: no backward in the kernels
        out, n = _calls(ti, lambda: ex(*args))
        assert n == 0 and out.requires_grad and torch.allclose(out.detach(), ref, rtol=1e-5, atol=1e-6)
    ex.gate_up_proj.requires_grad_(False)

    class Wrapped(torch.Tensor):  # a tensor subclass (quantised or distributed weights): no raw pointer to read
        pass

    gu = ex.gate_up_proj
    ex.gate_up_proj = torch.nn.Parameter(gu.detach().as_subclass(Wrapped), requires_grad=False)
    with torch.no_grad():
        assert _calls(ti, lambda: ex(*args))[1] == 0
    ex.gate_up_proj = gu
    ti.remove_optimized_kernels(model, verbose=False)


def test_decode_path_follows_what_changes_after_injection(gen):
    """The experts implementation switched to another function, or an instance _apply_gate set, after injection:
    the module's own forward runs (the probe's finding no longer holds)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ti, model, ex, args, ref = _injected_mixtral(gen)
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    ALL_EXPERTS_FUNCTIONS["doubled_mm_test"] = lambda self, *a: 2 * grouped(self, *a)  # (this interface only)
    try:
        model.config._experts_implementation = "doubled_mm_test"
        with torch.no_grad():
            out, n = _calls(ti, lambda: ex(*args))
        assert n == 0 and torch.allclose(out, 2 * ref, rtol=1e-5, atol=1e-6)
        model.config._experts_implementation = "grouped_mm"
        stock_gate = type(ex)._apply_gate
        ex._apply_gate = lambda y: stock_gate(ex, y.clamp(-0.01, 0.01))
        with torch.no_grad():
            assert _calls(ti, lambda: ex(*args))[1] == 0
        del ex._apply_gate
    finally:
        model.config._experts_implementation = "grouped_mm"
        del ALL_EXPERTS_FUNCTIONS["doubled_mm_test"]
    ti.remove_optimized_kernels(model, verbose=False)
    # injected while the doubling implementation is configured: the probe sees another function
    ALL_EXPERTS_FUNCTIONS["doubled_mm_test"] = lambda self, *a: 2 * grouped(self, *a)
    try:
        model.config._experts_implementation = "doubled_mm_test"
        ti.inject_optimized_kernels(model, verbose=False)
        assert "forward" not in ex.__dict__ and "_apply_gate" in ex.__dict__
        ti.remove_optimized_kernels(model, verbose=False)
    finally:
        model.config._experts_implementation = "grouped_mm"
        del ALL_EXPERTS_FUNCTIONS["doubled_mm_test"]


def test_gate_second_experts_and_clamped_swiglu(gen):
    """Experts whose _apply_gate takes [up | gate] run the kernels with gate_first=False (the stock output to fp32
    rounding); experts that clamp the gate at 30 (as some MoE models do) are no SwiGLU site at all."""
    import transformers_injection as ti

    model = _tiny("mixtral", gen)
    cls = type(_experts(model)[0])

    def up_first(self, y):
        up, gate = y.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def clamped(self, y):
        gate, up = y.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=30.0)) * up.clamp(-30.0, 30.0)

    for name, gate_fn, patched in (("UpFirstExperts", up_first, True), ("ClampedExperts", clamped, False)):
        m = _tiny("mixtral", gen)
        for ex in _experts(m):
            ex.__class__ = type(name, (cls,), {"_apply_gate": gate_fn})
        ex = _experts(m)[0]
        n_exp, _, h = ex.gate_up_proj.shape
        args = (
            randn((1, h), torch.float32, gen, scale=50.0),
            torch.tensor([[1, 2]], device=DEVICE),
            torch.rand(1, 2, device=DEVICE),
        )
        with torch.no_grad():
            ref = ex(*args)
        ti.inject_optimized_kernels(m, verbose=False)
        assert ("forward" in ex.__dict__) == patched and ("_apply_gate" in ex.__dict__) == patched, name
        with torch.no_grad():
            out, n = _calls(ti, lambda: ex(*args))
        assert n == int(patched) and torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max())), name
        many = (args[0].expand(n_exp, h), args[1].expand(n_exp, 2), args[2].expand(n_exp, 2))  # prefill-sized
        with torch.no_grad(), ti.count_kernel_calls() as calls:
            out = ex(*many)
        assert calls["swiglu"] == int(patched) and calls["moe_swiglu_experts"] == 0, name  # the _apply_gate kernel
        assert torch.allclose(out, ref.expand(n_exp, h), rtol=1e-5, atol=1e-5 * float(ref.abs().max())), name
        ti.remove_optimized_kernels(m, verbose=False)


def test_removal_with_a_hook_added_after_injection(gen):
    """accelerate moves the forward to _old_forward when it hooks a module (dispatch, offload): removal puts the
    class's forward there, and the module computes as stock with and without the hook."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    ti, model, ex, args, ref = _injected_mixtral(gen)
    add_hook_to_module(ex, ModelHook())
    with torch.no_grad():
        assert _calls(ti, lambda: ex(*args))[1] == 1
        ti.remove_optimized_kernels(model, verbose=False)
        out, n = _calls(ti, lambda: ex(*args))
        assert n == 0 and torch.equal(out, ref)
        remove_hook_from_module(ex)
        assert getattr(ex.forward, "__func__", None) is type(ex).forward and torch.equal(ex(*args), ref)


@pytest.mark.slow
def test_compiled_decode_step_traces_transformers_path(gen):
    """Under torch.compile the experts module's own forward is traced (the kernels are no registered ops): one
    decode-sized step compiles, with fullgraph, and computes the stock result."""
    ti, model, ex, args, ref = _injected_mixtral(gen)
    torch._dynamo.reset()
    with torch.no_grad():
        out, n = _calls(ti, lambda: torch.compile(ex, backend="aot_eager", fullgraph=True)(*args))
    assert n == 0 and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    ti.remove_optimized_kernels(model, verbose=False)


def _stock_logits(model_cls, cfg):
    """A tiny random model of model_cls on the test device, 6 token ids, and its stock logits for them."""
    torch.manual_seed(0)
    model = model_cls(cfg).eval().to(DEVICE)
    ids = torch.randint(0, 256, (1, 6), device=DEVICE)
    with torch.no_grad():
        return model, ids, model(ids).logits


def _close_to(out, ref):
    return torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_deepseek_v3_rope_branch_is_named_in_the_log(caplog):
    """DeepSeek-V3's attention calls apply_rotary_pos_emb_interleave where its config asks (the default): the RoPE
    site counts as patched, but the log says the kernel runs only on the other branch. Its MoE runs the decode
    path and the whole model matches stock."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    import transformers_injection as ti

    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=160, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model, ids, ref = _stock_logits(DeepseekV3ForCausalLM, cfg)
    with caplog.at_level("INFO", logger="transformers_injection"):
        counts = ti.inject_optimized_kernels(model, verbose=False)
    assert counts["rope"] == 2 and "can call apply_rotary_pos_emb_interleave instead" in caplog.text
    with torch.no_grad(), ti.count_kernel_calls() as calls:
        model(ids[:, :1])
    assert calls["moe_swiglu_experts"] == 1 and calls["rope_rotate_half"] == 0  # layer 1's experts; interleaved RoPE
    with torch.no_grad():
        assert _close_to(model(ids).logits, ref)
    ti.remove_optimized_kernels(model, verbose=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def test_deepseek_v2_rope_of_another_form_is_named_in_the_log(caplog):
    """DeepSeek-V2's attention rotates through its own complex apply_rotary_emb, no apply_rotary_pos_emb: no RoPE
    site, and the log says that RoPE runs PyTorch's code (it said nothing). Its MoE runs the decode path."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    import transformers_injection as ti

    cfg = DeepseekV2Config(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=160, moe_intermediate_size=48, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model, ids, ref = _stock_logits(DeepseekV2ForCausalLM, cfg)
    with caplog.at_level("INFO", logger="transformers_injection"):
        counts = ti.inject_optimized_kernels(model, verbose=False)
    assert counts["rope"] == 0 and counts["moe_swiglu"] == 1
    assert "DeepseekV2Attention.forward applies RoPE through apply_rotary_emb" in caplog.text
    with torch.no_grad(), ti.count_kernel_calls() as calls:
        model(ids[:, :1])
    assert calls["moe_swiglu_experts"] == 1
    with torch.no_grad():
        assert _close_to(model(ids).logits, ref)
    ti.remove_optimized_kernels(model, verbose=False)


def test_experts_with_a_gate_of_their_own_are_named_and_left_alone():
    """GPT-OSS's experts compute a clamped, interleaved gate in _apply_gate, with no activation module: a MoE site
    the kernels skip, named in the log's reasons (missing_kinds), the model's outputs unchanged. Its decoder
    layers, whose MLP returns (output, router scores), get the residual add + norm kernel (they were refused as
    "another function than a residual decoder layer"), and its RoPE, whose tables hold one value per channel pair
    (cos [B, S, D / 2]), the rotate-half kernel (it was "another function than rotate-half RoPE")."""
    from transformers import GptOssConfig, GptOssForCausalLM

    import transformers_injection as ti

    cfg = GptOssConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    model, ids, ref = _stock_logits(GptOssForCausalLM, cfg)
    counts = ti.inject_optimized_kernels(model, verbose=False)
    assert counts["moe_swiglu"] == 0 and counts["fused_add_rmsnorm"] == 2 and counts["rope"] == 2
    missing = ti.missing_kinds(model)
    assert "GptOssExperts: experts with no activation module" in missing["moe_swiglu"]
    assert "fused_add_rmsnorm" not in missing and "rope" not in missing
    assert ti._rope_probe(ti._rope_function_of(model.model.layers[0].self_attn))[3]  # half-width tables
    with torch.no_grad(), ti.count_kernel_calls() as calls:
        assert _close_to(model(ids).logits, ref)
    assert calls["fused_add_rms_norm"] == 2 and calls["rope_rotate_half"] == 4  # q and k of each layer
    ti.remove_optimized_kernels(model, verbose=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


@pytest.mark.parametrize("context", ["autocast", "float64_default"])
def test_decode_probe_ignores_the_callers_context(gen, monkeypatch, context):
    """Injected under CPU autocast or with float64 as the default dtype, the decode path is still found (the probe
    gives its own dtypes and turns autocast off); the default dtype is the caller's again afterwards."""
    import contextlib

    import transformers_injection as ti

    monkeypatch.setattr(ti, "_PROBES", {})  # no result cached by an earlier test
    model = _tiny("mixtral", gen)
    ex = _experts(model)[0]
    saved = torch.get_default_dtype()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if context == "autocast" else contextlib.nullcontext()
    if context == "float64_default":
        torch.set_default_dtype(torch.float64)
    try:
        with ctx:
            ti.inject_optimized_kernels(model, verbose=False)
        assert torch.get_default_dtype() == (torch.float64 if context == "float64_default" else saved)
    finally:
        torch.set_default_dtype(saved)
    assert getattr(ex.__dict__.get("forward"), "__func__", None) is ti._experts_forward
    ti.remove_optimized_kernels(model, verbose=False)


def test_decode_path_follows_a_remapped_implementation(gen):
    """The same implementation name mapped to another function after injection: the module's own forward runs."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ti, model, ex, args, ref = _injected_mixtral(gen)
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    ALL_EXPERTS_FUNCTIONS["grouped_mm"] = lambda self, *a: 2 * grouped(self, *a)  # this interface's own mapping
    try:
        with torch.no_grad():
            out, n = _calls(ti, lambda: ex(*args))
        assert n == 0 and torch.allclose(out, 2 * ref, rtol=1e-5, atol=1e-6)
    finally:
        del ALL_EXPERTS_FUNCTIONS["grouped_mm"]  # the global mapping's grouped_mm again
    with torch.no_grad():
        assert _calls(ti, lambda: ex(*args))[1] == 1
    ti.remove_optimized_kernels(model, verbose=False)

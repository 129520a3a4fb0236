# SPDX-License-Identifier: Apache-2.0
"""inject_wan_kernels / remove_wan_kernels on diffusers' WanTransformer3DModel (Wan 2.1 T2V / I2V, Wan
2.2 TI2V with per-token modulation): parity with the unpatched model in fp32 and bf16 (tiny random models
through the interpreter on the CPU), with both fp32-kept and fully cast weights, counts on the released
architectures (meta device), the kernels actually called, exact restoration, idempotence, and the
fallbacks (autograd with a trainable weight inside a block, hooks, another processor, fused projections,
a carried norm after an in-place change)."""

import logging

import pytest
import torch
from diffusers import (
    ChronoEditTransformer3DModel,
    SkyReelsV2Transformer3DModel,
    WanAnimateTransformer3DModel,
    WanVACETransformer3DModel,
)
from diffusers.models.transformers import transformer_chronoedit as chrono
from diffusers.models.transformers import transformer_skyreels_v2 as sky
from diffusers.models.transformers import transformer_wan_animate as anim
from diffusers.models.transformers import transformer_wan_animate_2 as anim2
from diffusers.models.transformers import transformer_wan_vace as vace_file

import activations
import generic_injection as gi
import layernorm
import qk_norm_rope
import rmsnorm
import wan_injection as wi
from kernel_testing import (
    DEVICE,
    INTERPRET,
    block_kernel_calls,
    interpreter_bf16_round_to_nearest_even,
    make_generator,
    randn,
    rel_l2,
    run_model,
    without_and_with_kernels,
)

# fp32: each fused step is the same math with one rounding and another summation order
FP32_REL = 1e-5

VARIANTS = {
    # name: (config, input options)
    "t2v": ("tiny", dict()),
    "t2v_no_cross_norm": ("tiny", dict()),
    "ti2v_per_token": ("tiny", dict(per_token_timestep=True)),
    "i2v": ("tiny-i2v", dict(text_len=512, image_len=5)),
}


def _model(variant, dtype=torch.float32, keep_fp32=True, seed=0):
    config, _ = VARIANTS[variant]
    extra = dict(cross_attn_norm=False) if variant == "t2v_no_cross_norm" else {}
    return wi.build_wan_transformer(config, dtype=dtype, device=DEVICE, seed=seed, keep_fp32=keep_fp32, **extra)


def _inputs(model, variant, dtype=torch.float32, seed=0):
    return wi.make_wan_inputs(model, dtype=dtype, device=DEVICE, seed=seed, **VARIANTS[variant][1])


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the leaf kernels (proves that the kernels, not torch, ran)."""
    return block_kernel_calls(
        monkeypatch, (rmsnorm, "rms_norm"), (qk_norm_rope, "ltx_qk_rmsnorm_rope"), (activations, "gelu_tanh")
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_matches_unpatched(variant, kernel_calls, gen):
    model = _model(variant, seed=gen.seed_value % 1000)
    kw = _inputs(model, variant, seed=gen.seed_value)
    ref = run_model(model, kw)
    counts = wi.inject_wan_kernels(model, verbose=False)
    layers = model.config.num_layers
    i2v = variant == "i2v"
    assert counts == {
        "wan_blocks": layers,
        "wan_vace_blocks": 0,
        "wan_rmsnorm_weighted": (5 if i2v else 4) * layers,
        "wan_gelu_tanh": layers,
    }
    out = run_model(model, kw)
    assert torch.isfinite(out).all()
    err = rel_l2(out, ref)
    assert err < FP32_REL, f"{variant}: rel L2 {err:.3g} against the unpatched model"
    # every site ran its kernel: block 0 computes block 1's norm1 (carried), so norm1 runs once
    assert kernel_calls["layer_norm_modulate"] == 1
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == layers
    assert kernel_calls["gelu_tanh"] == layers
    # per block: norm3 (+ norm2 with cross_attn_norm), and block 0's last residual with block 1's norm1
    per_block = 1 if variant == "t2v_no_cross_norm" else 2
    assert kernel_calls["gated_residual_layer_norm_modulate"] == per_block * layers + (layers - 1)
    # cross-attention q/k norms (+ I2V's norm_added_k) through the RMSNorm kernel
    assert kernel_calls["rms_norm"] == (3 if i2v else 2) * layers
    wi.remove_wan_kernels(model, verbose=False)
    assert torch.equal(run_model(model, kw), ref), "removal must restore the original forwards exactly"


@pytest.mark.parametrize("keep_fp32", [True, False], ids=["from_pretrained_fp32_kept", "model_to_bf16"])
@pytest.mark.parametrize("variant", ["t2v", "ti2v_per_token"])
def test_bf16_is_as_accurate_as_unpatched(variant, keep_fp32, gen):
    """bf16 with Wan's fp32-kept modules (as from_pretrained(torch_dtype=bf16) loads it) and fully cast
    (model.to(bf16)): the patched model is no further from an fp32 run of the same weights than the
    unpatched bf16 model is (the kernels round once per fused step, where Wan also rounds once)."""
    ref_model = _model(variant, seed=gen.seed_value % 1000)
    kw32 = _inputs(ref_model, variant, seed=gen.seed_value)
    ref = run_model(ref_model, kw32)
    model = _model(variant, dtype=torch.bfloat16, keep_fp32=keep_fp32, seed=gen.seed_value % 1000)
    kw = _inputs(model, variant, dtype=torch.bfloat16, seed=gen.seed_value)
    base = run_model(model, kw).float()
    counts = wi.inject_wan_kernels(model, verbose=False)
    assert counts["wan_blocks"] == model.config.num_layers
    out = run_model(model, kw).float()
    e_base, e_out = rel_l2(base, ref), rel_l2(out, ref)
    assert e_out <= 1.5 * e_base + 1e-3, f"patched {e_out:.4g} vs unpatched {e_base:.4g} (rel L2 to fp32)"
    assert rel_l2(out, base) < 0.05


@pytest.mark.parametrize(
    "config,blocks,norms",
    [
        ("2.1-t2v-1.3b", 30, 120),
        ("2.1-t2v-14b", 40, 160),
        ("2.1-i2v-14b", 40, 200),
        ("2.2-ti2v-5b", 30, 120),
    ],
)
def test_counts_on_released_architectures(config, blocks, norms):
    model = wi.build_wan_transformer(config, device="meta", dtype=torch.bfloat16)
    counts = wi.inject_wan_kernels(model, verbose=False)
    assert counts == {
        "wan_blocks": blocks,
        "wan_vace_blocks": 0,
        "wan_rmsnorm_weighted": norms,
        "wan_gelu_tanh": blocks,
    }
    assert wi.inject_wan_kernels(model, verbose=False) == counts  # idempotent
    assert wi.remove_wan_kernels(model, verbose=False) == counts
    assert wi.wan_injected_counts(model) == {k: 0 for k in counts}


def test_trainable_weight_inside_a_block_gets_its_gradient(gen):
    """LoRA-style training: base frozen, one weight inside a block trainable. The patched model must
    give that weight the same gradient as the unpatched one (the kernels have no backward: the block
    runs its original forward)."""
    model = _model("t2v", seed=gen.seed_value % 1000)
    kw = _inputs(model, "t2v", seed=gen.seed_value)
    for p in model.parameters():
        p.requires_grad_(False)
    w = model.blocks[1].attn1.to_v.weight
    w.requires_grad_(True)
    model(**kw)[0].square().mean().backward()
    ref = w.grad.clone()
    w.grad = None
    wi.inject_wan_kernels(model, verbose=False)
    model(**kw)[0].square().mean().backward()
    assert w.grad is not None and torch.allclose(w.grad, ref, rtol=1e-5, atol=1e-7)


def test_hooks_on_skipped_modules_still_run(gen):
    """A forward hook on a module the fused path would not call (the self-attention, its q norm, the
    block) still runs, and the output stays right."""
    model = _model("t2v", seed=gen.seed_value % 1000)
    kw = _inputs(model, "t2v", seed=gen.seed_value)
    ref = run_model(model, kw)
    wi.inject_wan_kernels(model, verbose=False)
    for target in (model.blocks[0].attn1, model.blocks[0].attn1.norm_q, model.blocks[1], model.blocks[0].norm1):
        seen = []
        handle = target.register_forward_hook(lambda m, a, o: seen.append(1))
        out = run_model(model, kw)
        handle.remove()
        assert seen, f"hook on {type(target).__name__} did not run"
        assert rel_l2(out, ref) < FP32_REL


@pytest.mark.parametrize("where", ["post_hook_on_block_0", "pre_hook_on_block_1"])
def test_carry_ignored_after_an_in_place_change_between_blocks(where, gen):
    """A hook that changes the residual stream in place between two blocks: block 1 must not use a norm
    block 0 computed from the old values."""
    model = _model("t2v", seed=gen.seed_value % 1000)
    kw = _inputs(model, "t2v", seed=gen.seed_value)
    b0, b1 = model.blocks

    def change(h):  # not a shift or a scaling: LayerNorm would not see those
        h.add_(0.5 * h.flip(-1))

    handle = (
        b0.register_forward_hook(lambda m, a, o: change(o))
        if where.startswith("post")
        else b1.register_forward_pre_hook(lambda m, a: change(a[0]))
    )
    ref, got, _ = without_and_with_kernels(model, kw, wi.inject_wan_kernels, wi.remove_wan_kernels, [handle])
    assert rel_l2(got, ref) < FP32_REL


@pytest.mark.parametrize("change", ["rope hook", "rope hook, then written in place in block 0"])
def test_rope_tables_not_repeated_over_pairs_give_what_diffusers_computes(change, kernel_calls, gen):
    """diffusers' Wan attention reads cos[..., 0::2] and sin[..., 1::2] only, one value per channel pair. A hook
    on the rope module that scales every channel by its own factor (the pairs no longer repeat) changes what
    both models compute alike; written in place again after block 0 used them, block 1 reads the new values."""
    model = _model("t2v", seed=gen.seed_value % 1000)
    kw = _inputs(model, "t2v", seed=gen.seed_value)
    plain = run_model(model, kw)
    f_cos, f_sin, f_again = (0.5 + torch.rand(3, model.config.attention_head_dim, generator=gen)).to(DEVICE)
    tables = []

    def scale(module, args, out):
        tables[:] = out[0] * f_cos, out[1] * f_sin
        return tuple(tables)

    hooks = [model.rope.register_forward_hook(scale)]
    if change != "rope hook":  # the feed-forward runs after block 0's self-attention

        def write_again(module, args, out):
            for t in tables:
                t.mul_(f_again)

        hooks.append(model.blocks[0].ffn.register_forward_hook(write_again))
    ref, got, _ = without_and_with_kernels(model, kw, wi.inject_wan_kernels, wi.remove_wan_kernels, hooks)
    assert rel_l2(ref, plain) > 1e-3, "the hook changes the channels diffusers reads"
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == model.config.num_layers
    assert rel_l2(got, ref) < FP32_REL


def test_other_processor_or_fused_projections_fall_back(kernel_calls, gen):
    model = _model("t2v", seed=gen.seed_value % 1000)
    kw = _inputs(model, "t2v", seed=gen.seed_value)
    ref = run_model(model, kw)
    wi.inject_wan_kernels(model, verbose=False)

    class MyProcessor(wi.WanAttnProcessor):
        pass

    model.blocks[0].attn1.set_processor(MyProcessor())
    model.blocks[1].attn1.fuse_projections()
    out = run_model(model, kw)
    assert rel_l2(out, ref) < FP32_REL
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == 0


def test_dispatch_from_diffusers_injection():
    import diffusers_injection as di

    model = _model("t2v")
    counts = di.inject_optimized_kernels(model, verbose=False)
    assert counts["wan_blocks"] == model.config.num_layers
    restored = di.remove_optimized_kernels(model, verbose=False)
    assert restored["wan_blocks"] == model.config.num_layers
    assert wi.wan_injected_counts(model)["wan_blocks"] == 0


# --------------------------------------------------------------------------------------------
# Rounding like Wan: each fused site computes in fp32 and rounds once, where Wan also rounds once. With the
# interpreter rounding fp32 -> bf16 to nearest even (as GPUs and torch do), elementwise sites are exact.
# --------------------------------------------------------------------------------------------
@pytest.mark.skipif(
    not INTERPRET,
    reason="on a GPU the compiler contracts the multiply-add into an FMA (one "
    "rounding) where torch's eager ops round the product and the sum separately",
)
@pytest.mark.parametrize("per_token", [False, True], ids=["per_sample_gate", "per_token_gate"])
def test_gated_residuals_are_bit_identical_to_wan(per_token):
    """(h.float() + y * gate).type_as(h), Wan's gated residual with an fp32 gate, bit for bit."""
    gen = make_generator()
    b, s, d = 2, 9, 40
    h, y = randn((b, s, d), torch.bfloat16, gen, scale=3.0), randn((b, s, d), torch.bfloat16, gen)
    # the gate as Wan slices it: a [B, 1, D] chunk, or a [B, S, D] view of a [B, S, 6, D] table
    table = randn((b, s if per_token else 1, 6, d), torch.float32, gen)
    gate = table[:, :, 2]
    with interpreter_bf16_round_to_nearest_even():
        got = rmsnorm.gated_residual_add(h, y, gate)
    assert torch.equal(got, (h.float() + y * gate).type_as(h)), f"seed {gen.seed_value}"


@pytest.mark.skipif(not INTERPRET, reason="checks the interpreter's rounding of the LayerNorm sites")
def test_norm_sites_round_like_wan():
    """Wan's norm1 + modulation and norm2 (weight, bias): with the rounding of a GPU, the kernels differ
    from Wan's expression only where their fp32 sums (another order) cross a bf16 rounding boundary: at
    most one bf16 ulp, in few elements. Where the result nearly cancels (norm * (1 + scale) + shift near 0)
    its bf16 ulp is below the fp32 rounding of its terms, which bounds the difference there instead."""
    import torch.nn.functional as F

    gen = make_generator()
    b, s, d = 2, 33, 96
    x = randn((b, s, d), torch.bfloat16, gen, scale=2.0, offset=0.5)
    y = randn((b, s, d), torch.bfloat16, gen)
    scale, shift, gate = (randn((b, 1, d), torch.float32, gen, scale=0.3) for _ in range(3))
    w, bias = randn((d,), torch.float32, gen, 0.2, 1.0), randn((d,), torch.float32, gen, 0.2)
    with interpreter_bf16_round_to_nearest_even():
        n1 = layernorm.layer_norm_modulate(x, scale, shift, 1e-6)
        h2, n2 = layernorm.gated_residual_layer_norm_modulate(x, y, gate, None, None, 1e-6, weight=w, bias=bias)
    want_n1 = (F.layer_norm(x.float(), (d,), eps=1e-6) * (1 + scale) + shift).type_as(x)
    want_h2 = (x.float() + y * gate).type_as(x)
    want_n2 = F.layer_norm(want_h2.float(), (d,), w, bias, 1e-6).type_as(x)
    assert torch.equal(h2, want_h2), f"seed {gen.seed_value}"
    normed1 = F.layer_norm(x.double(), (d,), eps=1e-6)
    normed2 = F.layer_norm(want_h2.double(), (d,), eps=1e-6)
    terms1 = normed1.abs() * (1 + scale.double()).abs() + shift.double().abs()  # magnitudes summed
    terms2 = normed2.abs() * w.double().abs() + bias.double().abs()
    for got, want, terms in ((n1, want_n1, terms1), (n2, want_n2, terms2)):
        ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0**-120))) - 7)
        ulp = torch.maximum(ulp, (terms * 2.0**-22).float())  # four fp32 roundings of the terms
        assert ((got.float() - want.float()).abs() <= ulp).all(), f"seed {gen.seed_value}"
        assert (got == want).float().mean() >= 0.99, f"seed {gen.seed_value}"


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's rounding")
def test_whole_model_with_gpu_rounding_is_much_closer_than_with_truncation(gen):
    """The tiny Wan model in the from_pretrained layout: with the interpreter rounding like a GPU, the patched
    model's output is equal to the unpatched one's except where an fp32 sum of another order crossed a bf16
    rounding boundary somewhere; it is far closer than with the interpreter's truncation."""
    model = _model("t2v", dtype=torch.bfloat16, seed=gen.seed_value % 1000)
    kw = _inputs(model, "t2v", dtype=torch.bfloat16, seed=gen.seed_value)
    base = run_model(model, kw)
    wi.inject_wan_kernels(model, verbose=False)
    trunc = run_model(model, kw)
    with interpreter_bf16_round_to_nearest_even():
        rne = run_model(model, kw)
    assert rel_l2(rne.float(), base.float()) <= 0.25 * rel_l2(trunc.float(), base.float())


# --------------------------------------------------------------------------------------------
# Wan derivatives: blocks of other classes that compute what WanTransformerBlock computes (found by a probe)
# --------------------------------------------------------------------------------------------
_TINY = dict(num_attention_heads=2, attention_head_dim=16, text_dim=24, freq_dim=32, ffn_dim=64, rope_max_seq_len=64)


def _derivative(name, seed=0):
    """A tiny Wan derivative with random weights, its inputs, and what the injection must do in it:
    (model, kwargs, fused main blocks, fused VACE blocks, blocks that compute their own norm1, the others
    taking the one their predecessor computed)."""
    torch.manual_seed(seed)
    g = make_generator(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    kw = dict(timestep=(torch.rand(2, generator=g) * 1000).to(DEVICE), encoder_hidden_states=r(2, 7, 24) * 0.5)
    kw.update(hidden_states=r(2, 4, 3, 8, 8), return_dict=False)
    if name == "vace":  # hints added after blocks 0 and 2: block 1 computes its own norm1, block 2 takes block 1's
        model = WanVACETransformer3DModel(**_TINY, in_channels=4, num_layers=3, vace_layers=[0, 2], vace_in_channels=8)
        kw.update(control_hidden_states=r(2, 8, 3, 8, 8), control_hidden_states_scale=torch.tensor([0.7, 1.3]))
        own = 2 + 2  # (and each VACE block its own)
        fused = (3, 2)
    elif name == "animate":  # the face adapter's output added after block 0: block 1 computes its own norm1
        model = WanAnimateTransformer3DModel(
            **_TINY,
            in_channels=12,
            latent_channels=4,
            num_layers=2,
            image_dim=None,
            motion_encoder_channel_sizes={"8": 8, "4": 8},
            motion_encoder_size=8,
            motion_style_dim=16,
            motion_dim=4,
            motion_encoder_dim=16,
            face_encoder_hidden_dim=16,
            face_encoder_num_heads=2,
            inject_face_latents_blocks=2,
        )
        kw.update(hidden_states=r(2, 12, 3, 8, 8), pose_hidden_states=r(2, 4, 2, 8, 8))
        kw.update(face_pixel_values=r(2, 3, 5, 8, 8))
        own, fused = 2, (2, 0)
    elif name.startswith("skyreels"):  # diffusion forcing: one timestep per latent frame, [B, 6, S, D] modulation
        model = SkyReelsV2Transformer3DModel(**_TINY, in_channels=4, out_channels=4, num_layers=2)
        kw.update(hidden_states=r(2, 4, 4, 8, 8))
        if name != "skyreels":
            kw.update(timestep=(torch.rand(2, 4, generator=g) * 1000).to(DEVICE), enable_diffusion_forcing=True)
        if name == "skyreels_df_causal":  # frame-block causal self-attention mask
            model._set_ar_attention(2)
        own, fused = 1, (2, 0)
    else:
        model = ChronoEditTransformer3DModel(**_TINY, in_channels=4, out_channels=4, num_layers=2)
        own, fused = 1, (2, 0)
    return model.eval().to(DEVICE), kw, *fused, own


DERIVATIVES = ["vace", "animate", "skyreels", "skyreels_df", "skyreels_df_causal", "chronoedit"]


@pytest.mark.parametrize("name", DERIVATIVES)
def test_derivative_fp32_matches_unpatched(name, kernel_calls, gen):
    model, kw, blocks, vace, own = _derivative(name, seed=gen.seed_value % 1000)
    ref = run_model(model, kw)
    counts = wi.inject_wan_kernels(model, verbose=False)
    assert (counts["wan_blocks"], counts["wan_vace_blocks"]) == (blocks, vace)
    out = run_model(model, kw)
    assert rel_l2(out, ref) < FP32_REL, f"{name}: rel L2 {rel_l2(out, ref):.3g} against the unpatched model"
    # every self-attention (the causal one too) ran the q/k norm + RoPE kernel; norm1 ran where no carried
    # value may be used (a hint or the face adapter's output added between two blocks)
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == blocks + vace
    assert kernel_calls["layer_norm_modulate"] == own
    assert kernel_calls["gelu_tanh"] == blocks + vace + 1  # (+ the text embedder's: the generic layer's)
    wi.remove_wan_kernels(model, verbose=False)
    assert torch.equal(run_model(model, kw), ref), "removal must restore the original forwards exactly"


def test_vace_hints_reach_the_output(gen):
    """The control hints change what the tiny VACE model computes (so the test above sees a carried norm1
    used after a hint), and the patched model follows a change of their scale."""
    model, kw, *_ = _derivative("vace", seed=gen.seed_value % 1000)
    zero = dict(kw, control_hidden_states_scale=torch.zeros(2))
    ref, ref0 = run_model(model, kw), run_model(model, zero)
    assert rel_l2(ref0, ref) > 1e-2
    wi.inject_wan_kernels(model, verbose=False)
    assert rel_l2(run_model(model, zero), ref0) < FP32_REL and rel_l2(run_model(model, kw), ref) < FP32_REL


def test_probe_verdicts():
    """What the probe finds in diffusers' classes: SkyReels-V2 reads a per-token modulation as [B, 6, S, D] and
    hands its fifth input to the self-attention as the mask; Wan Animate 2's block computes another function."""

    def verdict(cls, role="block"):
        return wi._verdict(cls.__new__(cls), role)

    rng = torch.get_rng_state()
    wi._VERDICTS.pop(("block", sky.SkyReelsV2TransformerBlock), None)  # a fresh probe
    v = verdict(sky.SkyReelsV2TransformerBlock)
    assert torch.equal(torch.get_rng_state(), rng), "the probe must not draw from the caller's random state"
    assert (v["params"], v["mask"], v["layout"]) == (5, True, "b6sd")
    assert v["attn"] == (sky.SkyReelsV2Attention, sky.SkyReelsV2AttnProcessor)
    v = verdict(anim.WanTransformerBlock)
    assert (v["params"], v["mask"], v["layout"], v["attn"]) == (
        4,
        False,
        "bs6d",
        (anim.WanAttention, anim.WanAttnProcessor),
    )
    assert verdict(vace_file.WanVACETransformerBlock, "vace")["attn"] == (wi.WanAttention, wi.WanAttnProcessor)
    assert isinstance(verdict(anim2.WanAnimate2TransformerBlock), str)
    assert isinstance(verdict(vace_file.WanVACETransformerBlock), str)  # not a main block (other inputs)


def test_block_computing_something_else_is_left_to_the_generic_layer(caplog, gen):
    """A block class whose forward computes another function (here: half the time embedding) inside a
    derivative the family takes: not fused, named in the log line, its norms served by the generic layer; no
    norm carried into it; the output stays the stock one."""

    class HalfTembBlock(chrono.WanTransformerBlock):
        def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
            return super().forward(hidden_states, encoder_hidden_states, temb * 0.5, rotary_emb)

    model, kw, *_ = _derivative("chronoedit", seed=gen.seed_value % 1000)
    model.blocks[1].__class__ = HalfTembBlock
    ref = run_model(model, kw)
    with caplog.at_level(logging.INFO, logger="wan_injection"):
        counts = wi.inject_wan_kernels(model, verbose=False)
    assert counts["wan_blocks"] == 1
    assert "HalfTembBlock (computes another function than WanTransformerBlock)" in caplog.text
    b1 = model.blocks[1]
    assert all(gi.STATE in n.__dict__ for n in (b1.norm1, b1.norm2, b1.norm3)), "the generic layer takes its norms"
    assert rel_l2(run_model(model, kw), ref) < FP32_REL
    wi.remove_wan_kernels(model, verbose=False)
    assert not any(gi.STATE in m.__dict__ for m in model.modules())
    assert torch.equal(run_model(model, kw), ref)


def test_derivative_keeps_the_generic_layer_elsewhere(gen):
    """Through diffusers_injection: Wan Animate's face encoder and face adapter (LayerNorms, outside the blocks)
    keep the generic kernels they had before the Wan family took the model; removal leaves nothing."""
    import diffusers_injection as di

    model, kw, blocks, *_ = _derivative("animate", seed=gen.seed_value % 1000)
    ref = run_model(model, kw)
    counts = di.inject_optimized_kernels(model, verbose=False)
    layer_norms = [
        m for m in (*model.face_encoder.modules(), *model.face_adapter.modules()) if isinstance(m, torch.nn.LayerNorm)
    ]
    assert counts["wan_blocks"] == blocks and counts["generic_layernorm"] >= len(layer_norms) == 5
    assert rel_l2(run_model(model, kw), ref) < FP32_REL
    restored = di.remove_optimized_kernels(model, verbose=False)
    assert restored["wan_blocks"] == blocks and not any(di.injected_counts(model).values())
    assert torch.equal(run_model(model, kw), ref)


def test_fifth_input_that_is_not_the_mask_is_not_handed_to_the_attention(kernel_calls, gen):
    """A SkyReels-V2 block class that takes the causal mask as its fifth input but does not use it: the probe finds
    it is no self-attention mask, so a block given one runs its own code (no mask applied, as the stock model
    computes); without a mask the same blocks run fused."""

    class MaskIgnoringBlock(sky.SkyReelsV2TransformerBlock):
        def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb, attention_mask):
            return super().forward(hidden_states, encoder_hidden_states, temb, rotary_emb, None)

    model, kw, blocks, *_ = _derivative("skyreels_df_causal", seed=gen.seed_value % 1000)
    for b in model.blocks:
        b.__class__ = MaskIgnoringBlock
    v = wi._verdict(model.blocks[0])
    assert (v["params"], v["mask"], v["layout"]) == (5, False, "b6sd")
    ref = run_model(model, kw)
    assert wi.inject_wan_kernels(model, verbose=False)["wan_blocks"] == blocks
    assert rel_l2(run_model(model, kw), ref) < FP32_REL
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == 0, "a block given a fifth input the probe found no mask: its own code"
    model._set_ar_attention(1)  # (one frame per block: no causal mask, None as the fifth input)
    got = run_model(model, kw)
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == blocks
    wi.remove_wan_kernels(model, verbose=False)
    assert rel_l2(got, run_model(model, kw)) < FP32_REL


@pytest.mark.parametrize("name", ["skyreels", "animate", "vace"])
def test_derivative_other_processor_falls_back(name, kernel_calls, gen):
    """The derivative's own attention processor class, subclassed on one block (or an attention backend set on
    every processor): that self-attention runs diffusers' processor, the rest stays fused and right."""
    model, kw, blocks, vace, _ = _derivative(name, seed=gen.seed_value % 1000)
    ref = run_model(model, kw)
    wi.inject_wan_kernels(model, verbose=False)
    attn = model.blocks[0].attn1
    attn.set_processor(type("MyProcessor", (type(attn.processor),), {})())
    assert rel_l2(run_model(model, kw), ref) < FP32_REL
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == blocks + vace - 1
    model.set_attention_backend("native")
    kernel_calls.clear()
    assert rel_l2(run_model(model, kw), ref) < FP32_REL
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == 0


@pytest.mark.parametrize(
    "name,blocks,vace",
    [
        ("WanVACETransformer3DModel", 40, 8),
        ("WanAnimateTransformer3DModel", 40, 0),
        ("SkyReelsV2Transformer3DModel", 32, 0),
        ("ChronoEditTransformer3DModel", 40, 0),
        ("WanAnimate2Transformer3DModel", 0, 0),
    ],
)
def test_counts_on_default_derivative_architectures(name, blocks, vace, caplog):
    import diffusers

    with torch.device("meta"):
        model = getattr(diffusers, name)()
    assert len(wi.find_wan_models(model)) == (1 if blocks else 0)  # Animate 2's blocks: not Wan's computation
    with caplog.at_level(logging.INFO, logger="wan_injection"):
        counts = wi.inject_wan_kernels(model, verbose=False)
    assert (counts["wan_blocks"], counts["wan_vace_blocks"]) == (blocks, vace)
    # a model it does not take is named in the log line, with why
    assert (f"left untouched: {name} (WanAnimate2TransformerBlock (not " in caplog.text) == (not blocks), caplog.text
    wi.remove_wan_kernels(model, verbose=False)
    assert not any(wi.wan_injected_counts(model).values())

# SPDX-License-Identifier: Apache-2.0
"""The LTX-2 family (scripts/ltx2_injection.py) on diffusers' LTX2VideoTransformer3DModel: tiny random models
with the LTX-2 pipelines' inputs (packed video and audio latents, text embeddings and masks, timesteps and
sigma, RoPE coordinates), through Triton's interpreter on the CPU or on a GPU. fp32 parity of the video and
the audio output with the stock model (the released LTX-2's split RoPE, the class default interleaved one,
LTX-2.3's gated, prompt-modulated, perturbed-attention blocks with spatio-temporal guidance, image-to-video's
per-token timesteps, isolated modalities), the kernels really called, counts, removal bit for bit, hooks that
make their path step aside, subclasses and other processors left alone, torch.compile, autograd, bf16, FP8."""

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.transformers import transformer_ltx2 as t2
from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

import diffusers_injection as di
import fp8_linear
import injection_common as ic
import ltx2_injection as l2
import qk_norm_rope
import rmsnorm
import rope
from kernel_testing import (
    DEVICE,
    assert_compiles_stock,
    count_calls,
    interpreter_bf16_round_to_nearest_even,
    make_generator,
    poisoned_outputs,
    rel_l2,
    rel_max,
)

FP32_REL = 1e-5  # relative max difference: the same math, one rounding per fused step, another summation order
LAYERS = 2
# the release's argument names, tiny: video 2 heads x 16, audio 2 x 8 (the cross-modal attentions are audio wide)
TINY = dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32,
            audio_in_channels=16, audio_out_channels=16, audio_num_attention_heads=2, audio_attention_head_dim=8,
            audio_cross_attention_dim=16, num_layers=LAYERS, caption_channels=24)  # fmt: skip
LTX23 = dict(gated_attn=True, audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True,
             use_prompt_embeddings=False, perturbed_attn=True, ff_bias=False)  # fmt: skip
VARIANTS = {  # name: (constructor arguments over TINY, inputs)
    "ltx2": (dict(rope_type="split"), {}),  # the released LTX-2 (split RoPE)
    "interleaved": (dict(rope_type="interleaved"), {}),  # the class default
    "ltx2.3_stg": (dict(LTX23, rope_type="split"), dict(stg=True)),
    "i2v_per_token": (dict(rope_type="split"), dict(per_token=True)),
    "isolated": (dict(rope_type="interleaved"), dict(isolate_modalities=True)),
}


def _model(variant="ltx2", seed=0, dtype=torch.float32, **over):
    torch.manual_seed(seed)
    model = t2.LTX2VideoTransformer3DModel(**{**TINY, **VARIANTS[variant][0], **over}).eval()
    return model.to(DEVICE, dtype)


def _inputs(model, gen, variant="ltx2", dtype=torch.float32, batch=2, frames=2, height=2, width=3, audio=5, text=7):
    """A forward's keyword arguments as LTX2Pipeline builds them: latents [B, C, F, H, W] and audio latents
    [B, 8, L, mel] packed, text embeddings (caption_channels wide, or the model's widths without the prompt
    projections: LTX-2.3's connectors give those), the second prompt padded (its mask), timestep = sigma
    (image-to-video: per video token, the conditioned first frame at 0, the audio's per sample), the RoPE
    coordinates precomputed by the rope modules at 24 fps."""
    cfg, opts = model.config, VARIANTS[variant][1]

    def rnd(*shape):
        return torch.randn(shape, generator=gen).to(DEVICE, dtype)

    wide = cfg.use_prompt_embeddings
    video_text = cfg.caption_channels if wide else cfg.num_attention_heads * cfg.attention_head_dim
    audio_text = cfg.caption_channels if wide else cfg.audio_num_attention_heads * cfg.audio_attention_head_dim
    mask = torch.ones(batch, text, device=DEVICE)
    mask[1, text - 2 :] = 0
    t = torch.tensor([700.0, 300.0, 500.0, 900.0][:batch], device=DEVICE)
    kw = dict(
        hidden_states=LTX2Pipeline._pack_latents(rnd(batch, cfg.in_channels, frames, height, width), 1, 1),
        audio_hidden_states=LTX2Pipeline._pack_audio_latents(rnd(batch, 8, audio, cfg.audio_in_channels // 8)),
        encoder_hidden_states=rnd(batch, text, video_text),
        audio_encoder_hidden_states=rnd(batch, text, audio_text),
        timestep=t,
        sigma=t,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        fps=24.0,
        audio_num_frames=audio,
        video_coords=model.rope.prepare_video_coords(batch, frames, height, width, DEVICE, fps=24.0),
        audio_coords=model.audio_rope.prepare_audio_coords(batch, audio, DEVICE),
        isolate_modalities=opts.get("isolate_modalities", False),
        use_cross_timestep=bool(opts.get("stg")),
        return_dict=False,
    )
    if opts.get("per_token"):
        conditioned = torch.zeros(batch, frames * height * width, device=DEVICE)
        conditioned[:, : height * width] = 1.0  # the first latent frame
        kw.update(timestep=t[:, None] * (1 - conditioned), audio_timestep=t)
    if opts.get("stg"):  # spatio-temporal guidance in block 1, for the second sample
        kw.update(spatio_temporal_guidance_blocks=[1], perturbation_mask=torch.tensor([1.0, 0.0], device=DEVICE))
    return kw


def _run(model, kw):
    """(video output, audio output), no autograd."""
    with torch.no_grad():
        return model(**kw)


def _assert_parity(outs, refs, what=""):
    for name, out, ref in zip(("video", "audio"), outs, refs):
        assert out.shape == ref.shape and out.dtype == ref.dtype
        err = rel_max(out, ref)
        assert err <= FP32_REL, f"{what} {name}: rel max {err:.3g}"


def _nothing_left(model):
    for m in model.modules():
        assert ic.bundle_state(m) is None, type(m).__name__
        assert l2._CARRY not in m.__dict__
        if isinstance(m, t2.LTX2Attention):
            assert type(m.processor) in (t2.LTX2AudioVideoAttnProcessor, t2.LTX2PerturbedAttnProcessor)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls of the kernels the family runs (proves the kernels, not torch, computed each site)."""
    return count_calls(
        monkeypatch,
        (
            (rmsnorm, "rms_norm_modulate"),
            (rmsnorm, "gated_residual_rms_norm_modulate"),
            (rmsnorm, "gated_residual_add"),
            (qk_norm_rope, "ltx_qk_rmsnorm_rope"),
            (rope, "ltx_rope"),
            (rope, "rope_rotate_half"),
        ),
    )


def _expected_calls(variant) -> dict:
    """Per forward of LAYERS blocks, per stream: norm1 + modulation in block 0 only (later blocks get it carried
    from the block before); h + attn1 with norm2, h + attn2 with the cross-modal norm and its a2v modulation (+ the
    v2a one alone), h + a2v with norm3; h + ff with the next block's norm1 (per-sample modulation), the last
    block's alone. Isolated modalities: h + attn2 with norm3. RoPE: split, q and k of 4 attentions alone;
    interleaved, the self-attentions' q/k norms + RoPE in one launch, the cross-modal ones' RoPE per tensor."""
    cfg, opts = VARIANTS[variant]
    isolated = opts.get("isolate_modalities", False)
    per_block = 2 if isolated else 3
    calls = {
        "rms_norm_modulate": 2 * (1 + (0 if isolated else LAYERS)),
        "gated_residual_rms_norm_modulate": 2 * (per_block * LAYERS + LAYERS - 1),
        "gated_residual_add": 2,
    }
    attns = 2 if isolated else 4
    if opts.get("per_token"):  # per-token video modulation: each block computes its own norm1 (nothing carried)
        calls["rms_norm_modulate"] += LAYERS - 1
        calls["gated_residual_rms_norm_modulate"] -= LAYERS - 1
        calls["gated_residual_add"] += LAYERS - 1
    if cfg["rope_type"] == "split":
        calls["rope_rotate_half"] = 2 * attns * LAYERS
    else:
        calls["ltx_qk_rmsnorm_rope"] = 2 * LAYERS
        if not isolated:
            calls["ltx_rope"] = 4 * LAYERS
    return calls


# --------------------------------------------------------------------------------------------
# The kernels compute diffusers' RoPE forms (checked against their reference functions first)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_the_kernels_compute_ltx2s_rotary_forms(rope_type, gen):
    """The rope modules' tables through diffusers' apply_interleaved_rotary_emb / apply_split_rotary_emb equal
    rope.ltx_rope_ref / rope_rotate_half_ref (split tables: one value per channel pair, heads as the table splits
    them) and the kernels, which read the split tables in place (no copy), in fp32; dims that do not divide into
    the rope's axes (padding channels)."""
    b, s, heads, d = 2, 5, 2, 22  # 44 channels: 44 % 6 = 2 padding channels for video, 44 % 2 for split
    mod = t2.LTX2AudioVideoRotaryPosEmbed(
        dim=heads * d, modality="video", rope_type=rope_type, num_attention_heads=heads
    )
    cos, sin = mod(mod.prepare_video_coords(b, 1, 1, s, DEVICE))
    x = torch.randn(b, s, heads * d, generator=gen).to(DEVICE)
    if rope_type == "interleaved":
        ref = t2.apply_interleaved_rotary_emb(x, (cos, sin))
        outs = rope.ltx_rope_ref(x, cos, sin), rope.ltx_rope(x, cos, sin)
    else:
        ref = t2.apply_split_rotary_emb(x, (cos, sin))
        x4 = x.unflatten(2, (heads, d)).transpose(1, 2)
        assert cos.shape == (b, heads, s, d // 2) and cos.stride(-1) == 1  # [B, H, S, D / 2], token-major
        doubled = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
        with poisoned_outputs():
            half = rope.rope_rotate_half(x4, cos, sin)
        outs = (rope.rope_rotate_half_ref(x4, cos, sin), half)
        outs = [o.transpose(1, 2).reshape(b, s, -1) for o in outs]
        assert torch.equal(half, rope.rope_rotate_half(x4, *doubled)), "the same values as per-channel tables"
        assert torch.equal(l2._rope("split", x, (cos, sin)), outs[1])
    for out in outs:
        assert rel_max(out, ref) <= 1e-6


# --------------------------------------------------------------------------------------------
# Parity, kernels, counts, removal
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp32_matches_stock_and_removal_restores_it(variant, kernel_calls, gen):
    model = _model(variant, seed=gen.seed_value % 1000)
    kw = _inputs(model, gen, variant)
    ref = _run(model, kw)
    counts = di.inject_optimized_kernels(model, verbose=False)
    assert counts["ltx2_blocks"] == LAYERS and counts["ltx2_qk_norm_rope"] == 4 * LAYERS
    assert counts["generic_rmsnorm"] > 0 and counts["generic_gelu_tanh"] >= 2 * LAYERS
    assert l2.injected_counts(model) == {"ltx2_blocks": LAYERS, "ltx2_qk_norm_rope": 4 * LAYERS}
    kernel_calls.clear()
    out = _run(model, kw)
    _assert_parity(out, ref, f"{variant} (seed {gen.seed_value})")
    assert dict(kernel_calls) == _expected_calls(variant)
    assert di.inject_optimized_kernels(model, verbose=False) == counts, "a second injection changes nothing"
    _assert_parity(_run(model, kw), ref, variant)
    restored = di.remove_optimized_kernels(model, verbose=False)
    assert restored["ltx2_blocks"] == LAYERS and restored["ltx2_qk_norm_rope"] == 4 * LAYERS
    _nothing_left(model)
    back = _run(model, kw)
    assert all(torch.equal(a, b) for a, b in zip(back, ref)), "removal restores the stock model bit for bit"


def test_counts_on_the_released_architecture():
    """LTX-2 19B (48 audio-video blocks, split RoPE) on the meta device: every block and the 4 RoPE attentions of
    each; found by diffusers_injection's router (FAMILIES)."""
    assert "ltx2_injection" in di.FAMILIES or l2 in di.FAMILIES
    with torch.device("meta"):
        model = t2.LTX2VideoTransformer3DModel(rope_type="split")
    counts = di.inject_optimized_kernels(model, verbose=False)
    assert counts["ltx2_blocks"] == 48 and counts["ltx2_qk_norm_rope"] == 4 * 48
    assert di.remove_optimized_kernels(model, verbose=False)["ltx2_blocks"] == 48
    _nothing_left(model)


# --------------------------------------------------------------------------------------------
# What steps aside
# --------------------------------------------------------------------------------------------
def _scale_first(m, args, out):
    return (out[0] * 1.25, *out[1:]) if isinstance(out, tuple) else out * 1.25


HOOKS = {  # target: (variant, hook, the expected kernel calls' change)
    # a hooked block is not carried out of: both streams' last residuals alone, block 1's norm1s its own
    "transformer_blocks.0": ("ltx2", _scale_first, {"gated_residual_rms_norm_modulate": -2, "gated_residual_add": 2,
                                                    "rms_norm_modulate": 2}),
    "transformer_blocks.1.norm1": ("ltx2", _scale_first, {"gated_residual_rms_norm_modulate": -1,
                                                          "gated_residual_add": 1}),
    "transformer_blocks.1.audio_norm1": ("interleaved", _scale_first, {"gated_residual_rms_norm_modulate": -1,
                                                                       "gated_residual_add": 1}),
    "transformer_blocks.0.audio_to_video_norm": ("ltx2", _scale_first, {"gated_residual_rms_norm_modulate": -1,
                                                                        "rms_norm_modulate": -1}),
    "transformer_blocks.0.attn1.norm_q": ("interleaved", _scale_first, {"ltx_qk_rmsnorm_rope": -1, "ltx_rope": 2}),
    "transformer_blocks.1.audio_attn1.norm_k": ("interleaved", _scale_first, {"ltx_qk_rmsnorm_rope": -1,
                                                                              "ltx_rope": 2}),
    "transformer_blocks.0.attn1": ("ltx2", _scale_first, {}),
    "rope": ("ltx2", lambda m, a, o: (o[0] * 0.75, o[1] * 0.5), {}),
    "cross_attn_audio_rope": ("interleaved", lambda m, a, o: (o[0] * 0.75, o[1] * 0.5), {}),
}  # fmt: skip


@pytest.mark.parametrize("target", sorted(HOOKS))
def test_a_hook_runs_and_its_path_steps_aside(target, kernel_calls, gen):
    """A forward hook that changes the output of a block, a norm the fused kernels would skip (a block norm, the
    next block's carried norm1, the cross-modal norm modulated twice, a q/k norm of the one-launch q/k + RoPE
    kernel), an attention or a rope module: it fires as often as in the stock model, the output is the stock
    model's with the hook, and only the fusions that would skip the hooked module step aside."""
    variant, hook, change = HOOKS[target]
    model = _model(variant, seed=gen.seed_value % 1000)
    kw = _inputs(model, gen, variant)
    fired = []
    handle = dict(model.named_modules())[target].register_forward_hook(lambda m, a, o: fired.append(1) or hook(m, a, o))
    try:
        ref = _run(model, kw)
        n_ref, fired[:] = len(fired), []
        di.inject_optimized_kernels(model, verbose=False)
        kernel_calls.clear()
        out = _run(model, kw)
    finally:
        handle.remove()
        di.remove_optimized_kernels(model, verbose=False)
    assert len(fired) == n_ref >= 1
    _assert_parity(out, ref, f"{target} (seed {gen.seed_value})")
    expected = _expected_calls(variant)
    for k, d in change.items():
        expected[k] = expected.get(k, 0) + d
    assert dict(kernel_calls) == {k: v for k, v in expected.items() if v}


def _change_(h):  # in place, and not a scaling (which an RMSNorm would not see)
    h.add_(0.5 * h.flip(-1))


@pytest.mark.parametrize("where", ["post_hook_on_block_0", "pre_hook_on_block_1"])
def test_carry_ignored_after_an_in_place_change_between_blocks(where, gen):
    """A hook changes both streams in place between two blocks: block 1 computes its norm1s from the new values
    (the stock model with the same hook is the reference)."""
    model = _model("ltx2", seed=gen.seed_value % 1000)
    kw = _inputs(model, gen)
    b0, b1 = model.transformer_blocks

    def pre(m, args, kwargs):
        _change_(kwargs["hidden_states"])
        _change_(kwargs["audio_hidden_states"])

    if where.startswith("post"):
        handle = b0.register_forward_hook(lambda m, a, out: [_change_(t) for t in out] and None)
    else:
        handle = b1.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        ref = _run(model, kw)
        di.inject_optimized_kernels(model, verbose=False)
        out = _run(model, kw)
    finally:
        handle.remove()
        di.remove_optimized_kernels(model, verbose=False)
    _assert_parity(out, ref, f"{where} (seed {gen.seed_value})")


class _OwnBlock(t2.LTX2VideoTransformerBlock):
    def forward(self, *args, **kwargs):
        h, a = super().forward(*args, **kwargs)
        return h * 0.5, a


def test_subclass_and_other_processors_left_alone(gen):
    """A block of a subclass with a forward of its own keeps it (and its attentions' processors); another
    processor set before injection stays; a processor's backend setting moves to the fused one and back."""
    model = _model("ltx2", seed=gen.seed_value % 1000)
    kw = _inputs(model, gen)
    blocks = model.transformer_blocks
    blocks[1].__class__ = _OwnBlock
    other = t2.LTX2AudioVideoAttnProcessor()
    other.__class__ = type("OtherProcessor", (t2.LTX2AudioVideoAttnProcessor,), {})
    blocks[0].audio_attn1.set_processor(other)
    blocks[0].attn1.processor._attention_backend = AttentionBackendName.NATIVE
    ref = _run(model, kw)
    counts = di.inject_optimized_kernels(model, verbose=False)
    assert counts["ltx2_blocks"] == 1 and counts["ltx2_qk_norm_rope"] == 3
    assert "forward" not in blocks[1].__dict__ and ic.bundle_state(blocks[1]) is None
    assert type(blocks[1].attn1.processor) is t2.LTX2AudioVideoAttnProcessor
    assert blocks[0].audio_attn1.processor is other
    assert type(blocks[0].attn1.processor) is l2.LTX2FusedAttnProcessor
    assert blocks[0].attn1.processor._attention_backend == AttentionBackendName.NATIVE
    assert ic.next_block(blocks[0]) is None, "no carry into a block that is not fused"
    _assert_parity(_run(model, kw), ref, f"seed {gen.seed_value}")
    di.remove_optimized_kernels(model, verbose=False)
    assert blocks[0].attn1.processor._attention_backend == AttentionBackendName.NATIVE
    assert type(blocks[0].attn1.processor) is t2.LTX2AudioVideoAttnProcessor
    assert all(torch.equal(a, b) for a, b in zip(_run(model, kw), ref))


def test_autograd_falls_back_with_the_same_gradients(kernel_calls, gen):
    """Training (trainable weights, grad mode): the stock computation, no kernel, the same gradients."""
    model = _model("ltx2", seed=gen.seed_value % 1000)
    kw = _inputs(model, gen)
    weight = model.transformer_blocks[0].attn1.to_q.weight

    def loss_and_grad():
        model.zero_grad()
        video, audio = model(**kw)
        (video.square().sum() + audio.square().sum()).backward()
        return video.detach(), audio.detach(), weight.grad.clone()

    model.requires_grad_(True)
    ref = loss_and_grad()
    di.inject_optimized_kernels(model, verbose=False)
    kernel_calls.clear()
    out = loss_and_grad()
    di.remove_optimized_kernels(model, verbose=False)
    assert not any(kernel_calls.values()), dict(kernel_calls)
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.parametrize("rope_type", ["split", "interleaved"])
def test_torch_compile_traces_the_stock_model(rope_type, kernel_calls, gen):
    """LTX-2 is marked stock under torch.compile (Inductor's own fusions were faster than the kernels'): with the
    kernels injected, compile traces the stock model's graph, no kernel op in it, and gives its output bit for
    bit; eager calls of the same injected model run the kernels."""
    model = _model("ltx2", seed=gen.seed_value % 1000, rope_type=rope_type)
    kw = _inputs(model, gen)
    assert_compiles_stock(model, kw, di.inject_optimized_kernels, di.remove_optimized_kernels)
    kernel_calls.clear()
    di.inject_optimized_kernels(model, verbose=False)
    try:
        _run(model, kw)
    finally:
        di.remove_optimized_kernels(model, verbose=False)
    assert kernel_calls["rms_norm_modulate"] and kernel_calls["gated_residual_rms_norm_modulate"], dict(kernel_calls)


def test_bf16_as_accurate_as_stock(gen):
    """bf16: the injected model no further from an fp32 run of the same weights than the stock bf16 model (the
    interpreter rounding to nearest even, as GPUs do)."""
    seed = gen.seed_value % 1000
    model32 = _model("ltx2", seed=seed)
    kw32 = _inputs(model32, make_generator(gen.seed_value))
    ref = _run(model32, kw32)
    model = _model("ltx2", seed=seed, dtype=torch.bfloat16)
    kw = _inputs(model, make_generator(gen.seed_value), dtype=torch.bfloat16)
    with interpreter_bf16_round_to_nearest_even():
        stock = _run(model, kw)
        di.inject_optimized_kernels(model, verbose=False)
        out = _run(model, kw)
    di.remove_optimized_kernels(model, verbose=False)
    for name, o, s, r in zip(("video", "audio"), out, stock, ref):
        assert o.dtype == torch.bfloat16
        e_out, e_stock = rel_l2(o.float(), r), rel_l2(s.float(), r)
        assert e_out <= 1.5 * e_stock + 1e-3, f"{name}: {e_out:.4g} vs stock {e_stock:.4g} (seed {gen.seed_value})"


def test_fp8_swaps_the_block_layers_and_removal_restores(gen):
    """fp8=True on a bf16 LTX-2: the linear layers of the blocks become FP8 (not the embedders, the prompt
    projections or the output layers), the fused blocks and processors run on them (q/k/v from one quantised
    input), the output stays near the bf16 kernels' one, and removal gives back the stock model bit for bit."""
    model = _model("ltx2", seed=gen.seed_value % 1000, dtype=torch.bfloat16)
    kw = _inputs(model, gen, dtype=torch.bfloat16)
    stock = _run(model, kw)
    di.inject_optimized_kernels(model, verbose=False)
    bf16 = _run(model, kw)
    di.remove_optimized_kernels(model, verbose=False)
    counts = di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        # per block: 6 attentions x 4 projections, 2 feed-forwards x 2
        assert counts["fp8_linear"] == 28 * LAYERS and counts["ltx2_blocks"] == LAYERS
        modules = dict(model.named_modules())
        assert isinstance(modules["transformer_blocks.0.audio_to_video_attn.to_k"], fp8_linear.Fp8Linear)
        assert isinstance(modules["transformer_blocks.1.audio_ff.net.2"], fp8_linear.Fp8Linear)
        assert all(type(modules[n]) is torch.nn.Linear for n in ("proj_in", "audio_proj_out", "time_embed.linear"))
        out = _run(model, kw)
    finally:
        restored = di.remove_optimized_kernels(model, verbose=False)
    assert restored["fp8_linear"] == 28 * LAYERS
    for name, o, b in zip(("video", "audio"), out, bf16):
        assert torch.isfinite(o).all()
        assert 1e-3 < rel_l2(o.float(), b.float()) < 0.15, f"{name} (seed {gen.seed_value})"
    _nothing_left(model)
    assert all(torch.equal(a, b) for a, b in zip(_run(model, kw), stock))

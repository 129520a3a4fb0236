# SPDX-License-Identifier: Apache-2.0
"""The Qwen-Image family (scripts/qwen_image_injection.py) on diffusers' QwenImageTransformer2DModel: a tiny
random model (2 blocks of 2 heads x 16) with its pipelines' inputs (Qwen-Image: one image, a padded prompt
mask; the Edit models: zero_cond_t, a condition image, per-token modulation), through Triton's interpreter
on the CPU or natively on a GPU. Parity with the stock model in fp32 (and bf16 as accurate as stock), the
fused kernels called, counts, exact removal, hooks and subclasses making the fused path step aside, the RoPE
tables handed from block to block, torch.compile(fullgraph=True), autograd, attention backends and FP8."""

import copy

import pytest
import torch
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
)
from torch import nn

import activations
import diffusers_injection as di
import fp8_linear
import head_norm_rope
import injection_common as ic
import qwen_image_injection as qi
from kernel_testing import (
    DEVICE,
    assert_bf16_parity,
    block_kernel_calls,
    compiled_with_kernels,
    count_calls,
    rel_l2,
    rel_max,
    run_model,
    without_and_with_kernels,
)

FP32_REL = 1e-5  # relative max difference: the same math, one rounding per fused step, other summation orders
LAYERS = 2
TINY = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=LAYERS,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    axes_dims_rope=(4, 6, 6),  # sums to the head dim
)
VARIANTS = ("qwen-image", "qwen-image-masked", "edit", "edit-masked")  # edit: zero_cond_t, two images


def _model(edit=False, dtype=torch.float32, *, seed):
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(**TINY, zero_cond_t=edit)
    with torch.no_grad():  # trained q/k norms have non-unit weights: unit ones would hide a swapped weight
        for m in model.modules():
            if isinstance(m, RMSNorm) and m.weight is not None:
                m.weight.normal_(1.0, 0.1)
    return nn.Module.to(model, DEVICE, dtype).eval()


def _inputs(model, *, seed, masked=True, dtype=torch.float32, batch=2, height=4, width=6, text=7):
    """One forward's arguments as QwenImagePipeline / QwenImageEditPlusPipeline build them: packed latents
    (the Edit models: the generated image's tokens, then a condition image's), img_shapes per sample, the
    prompt mask (the last prompt 3 tokens short; the pipeline passes None where nothing is padded), timestep / 1000."""
    g = torch.Generator().manual_seed(seed)
    images = 2 if model.config.zero_cond_t else 1
    mask = None
    if masked:
        mask = torch.ones(batch, text, dtype=torch.long)
        mask[-1, text - 3 :] = 0
    return dict(
        hidden_states=torch.randn(batch, images * height * width, model.config.in_channels, generator=g).to(
            DEVICE, dtype
        ),
        encoder_hidden_states=torch.randn(batch, text, model.config.joint_attention_dim, generator=g).to(DEVICE, dtype),
        encoder_hidden_states_mask=None if mask is None else mask.to(DEVICE),
        timestep=torch.linspace(0.9, 0.2, batch).to(DEVICE, dtype),
        img_shapes=[[(1, height, width)] * images] * batch,
        return_dict=False,
    )


def _case(variant, seed, dtype=torch.float32):
    model = _model(variant.startswith("edit"), dtype, seed=seed % 1000)
    return model, _inputs(model, seed=seed, masked=variant.endswith("masked"), dtype=dtype)


def _nothing_left(model):
    for m in model.modules():
        assert ic.bundle_state(m) is None, f"{type(m).__name__} still patched"
        assert "forward" not in m.__dict__ and qi._CARRY not in m.__dict__, type(m).__name__


@pytest.fixture
def kernel_calls(monkeypatch):
    return block_kernel_calls(monkeypatch, (head_norm_rope, "joint_head_rms_norm_rope"), (activations, "gelu_tanh"))


# per forward of the tiny model: norm1 of both streams in each block and norm_out; h + gate * attn with norm2
# and h + gate * ff per stream and block; the q/k norms + RoPE of both streams once per block; the GELUs
FUSED_CALLS = {
    "layer_norm_modulate": 2 * LAYERS + 1,
    "gated_residual_layer_norm_modulate": 2 * LAYERS,
    "gated_residual_add": 2 * LAYERS,
    "joint_head_rms_norm_rope": LAYERS,
    "gelu_tanh": 2 * LAYERS,
}


# --------------------------------------------------------------------------------------------
# Parity, kernels called, counts, exact removal
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_fp32_parity_kernels_called_and_exact_removal(variant, kernel_calls, gen):
    model, kw = _case(variant, gen.seed_value)
    ref = run_model(model, kw)
    counts = di.inject_optimized_kernels(model, verbose=False)
    assert counts["qwen_image_blocks"] == counts["qwen_image_attention"] == LAYERS
    # the generic layer in the rest: txt_norm and the q/k norms, the block LayerNorms (their fallbacks), GELUs,
    # norm_out
    assert counts["generic_rmsnorm"] == 1 + 4 * LAYERS and counts["generic_layernorm"] == 4 * LAYERS
    assert counts["generic_gelu_tanh"] == 2 * LAYERS and counts["generic_adaln"] == 1
    assert di.injected_counts(model) == counts
    out = run_model(model, kw)
    assert dict(kernel_calls) == FUSED_CALLS
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    restored = di.remove_optimized_kernels(model, verbose=False)
    assert restored["qwen_image_blocks"] == restored["qwen_image_attention"] == LAYERS
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref), "removal restores the stock model bit for bit"


def test_bf16_as_accurate_as_stock(gen):
    model, kw = _case("edit-masked", gen.seed_value)
    ref32 = run_model(model, kw)
    low = nn.Module.to(copy.deepcopy(model), torch.bfloat16)
    kw16 = {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()
    }
    assert_bf16_parity(low, kw16, ref32, di.inject_optimized_kernels, di.remove_optimized_kernels, gen.seed_value)


def test_counts_on_the_released_architecture_and_injecting_twice():
    """Qwen-Image's config (60 blocks of 24 x 128) on the meta device: every block and attention taken, a second
    injection changes nothing, removal undoes all."""
    with torch.device("meta"):
        model = QwenImageTransformer2DModel()
    counts = qi.inject(model, verbose=False)
    assert counts == {"qwen_image_blocks": 60, "qwen_image_attention": 60}
    assert qi.inject(model, verbose=False) == counts == qi.injected_counts(model)
    assert qi.remove(model, verbose=False) == counts
    _nothing_left(model)
    assert qi.remove(model, verbose=False) == {k: 0 for k in qi.KINDS}
    assert qi.find_models(torch.nn.Linear(2, 2)) == []


# --------------------------------------------------------------------------------------------
# The RoPE tables: made once per forward, made again where they changed
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change", [False, True], ids=["unchanged", "written_in_place_after_block_0"])
def test_rope_tables_handed_on_only_while_unchanged(change, monkeypatch, gen):
    """The joint cos/sin tables are made by the first block and handed on; where a hook rewrites the image
    frequencies in place after block 0's attention, block 1 makes them again from the new values (what
    diffusers reads there)."""
    model, kw = _case("qwen-image-masked", gen.seed_value)
    plain = run_model(model, kw)
    tables = []
    hooks = [model.pos_embed.register_forward_hook(lambda m, a, o: tables.__setitem__(slice(None), o))]
    if change:  # (the image table is made anew each forward; the text one is a view of the cached table)
        turn = torch.polar(torch.tensor(1.0), torch.tensor(0.7)).to(DEVICE)

        def rewrite(module, args, out):
            tables[0].mul_(turn)

        hooks.append(model.transformer_blocks[0].img_mlp.register_forward_hook(rewrite))
    calls = count_calls(monkeypatch, [(torch, "view_as_real")])
    ref, got, _ = without_and_with_kernels(model, kw, di.inject_optimized_kernels, di.remove_optimized_kernels, hooks)
    if change:
        assert rel_max(ref, plain) > 1e-3, "the rewritten frequencies change the output"
    assert rel_max(got, ref) <= FP32_REL
    # stock: 4 calls per block (apply_rotary_emb_qwen); injected: the text and image tables, once or twice
    assert calls["view_as_real"] == 4 * LAYERS + (4 if change else 2)


# --------------------------------------------------------------------------------------------
# Fallbacks: hooks, subclasses, other processors, autograd
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["img_norm1", "txt_norm2", "norm_q", "norm_added_k", "attn", "block"])
def test_hooks_on_modules_the_fused_path_skips_still_run(where, kernel_calls, gen):
    """A forward hook (scaling the output) on a norm the fused block or attention does not call makes that
    step run the module as diffusers does; one on the attention or the block runs around the fused code."""
    model, kw = _case("edit-masked", gen.seed_value)
    blk = model.transformer_blocks[0]
    target = {"img_norm1": blk.img_norm1, "txt_norm2": blk.txt_norm2, "norm_q": blk.attn.norm_q}.get(where)
    target = {"norm_added_k": blk.attn.norm_added_k, "attn": blk.attn, "block": blk}.get(where, target)
    fired = []

    def hook(module, args, out):
        fired.append(1)
        return out * 1.25 if isinstance(out, torch.Tensor) else (out[0] * 1.25, out[1])

    handle = target.register_forward_hook(hook)
    ref, got, n_ref = without_and_with_kernels(
        model, kw, di.inject_optimized_kernels, di.remove_optimized_kernels, [handle], fired
    )
    assert len(fired) == n_ref > 0
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"
    stepped_aside = {
        "img_norm1": ("layer_norm_modulate", 1),
        "txt_norm2": ("gated_residual_layer_norm_modulate", 1),
        "norm_q": ("joint_head_rms_norm_rope", 1),
        "norm_added_k": ("joint_head_rms_norm_rope", 1),
    }
    name, fewer = stepped_aside.get(where, ("layer_norm_modulate", 0))
    assert kernel_calls[name] == FUSED_CALLS[name] - fewer


class _OwnBlock(QwenImageTransformerBlock):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class _OwnProcessor(QwenDoubleStreamAttnProcessor2_0):
    pass


def test_subclasses_and_other_processors_left_alone(kernel_calls, gen):
    """A block subclass with a forward of its own is not patched; an attention with a processor of another class
    (a subclass too) is not patched, or steps aside where the processor is replaced after injection."""
    model, kw = _case("edit-masked", gen.seed_value)
    ref = run_model(model, kw)
    b0, b1 = model.transformer_blocks
    b0.__class__ = _OwnBlock
    b1.attn.set_processor(_OwnProcessor())
    counts = qi.inject(model, verbose=False)
    assert counts == {"qwen_image_blocks": 1, "qwen_image_attention": 1}
    assert "forward" not in b0.__dict__ and "forward" not in b1.attn.__dict__
    b0.attn.set_processor(_OwnProcessor())  # after injection: the patched attention runs the processor
    out = run_model(model, kw)
    assert kernel_calls["joint_head_rms_norm_rope"] == 0 and kernel_calls["gated_residual_add"] == 2
    assert rel_max(out, ref) <= FP32_REL
    qi.remove(model, verbose=False)
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)


def test_attention_backend_set_after_injection_is_used(monkeypatch, gen):
    """The fused attention calls dispatch_attention_fn with the processor's backend as it is when it runs."""
    model, kw = _case("qwen-image-masked", gen.seed_value)
    model.set_attention_backend("_native_math")
    ref = run_model(model, kw)
    model.reset_attention_backend()
    qi.inject(model, verbose=False)
    model.set_attention_backend("_native_math")
    seen = []
    dispatch = qi._qwen.dispatch_attention_fn
    monkeypatch.setattr(
        qi._qwen, "dispatch_attention_fn", lambda *a, **k: seen.append(k["backend"]) or dispatch(*a, **k)
    )
    out = run_model(model, kw)
    qi.remove(model, verbose=False)
    assert seen == [AttentionBackendName._NATIVE_MATH] * LAYERS
    assert rel_max(out, ref) <= FP32_REL


def test_autograd_falls_back_and_gives_the_same_gradient(kernel_calls, gen):
    """Training a weight inside a block (LoRA-style): the kernels have no backward, so the blocks and their
    attention run diffusers' code and the weight gets stock's gradient."""
    model, kw = _case("edit-masked", gen.seed_value)
    model.requires_grad_(False)
    w = model.transformer_blocks[0].attn.to_v.weight
    w.requires_grad_(True)
    model(**kw)[0].square().mean().backward()
    ref, w.grad = w.grad.clone(), None
    qi.inject(model, verbose=False)
    model(**kw)[0].square().mean().backward()
    assert sum(kernel_calls.values()) == 0, dict(kernel_calls)
    assert w.grad is not None and torch.allclose(w.grad, ref, rtol=1e-5, atol=1e-7)
    qi.remove(model, verbose=False)


# --------------------------------------------------------------------------------------------
# torch.compile and FP8
# --------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_traces_the_fused_kernels(gen):
    """The stock model traces with fullgraph=True; the injected one too, its graph calling the fused LayerNorm
    and q/k norm + RoPE kernels (per-token modulation and the joint mask included)."""
    model, kw = _case("edit-masked", gen.seed_value)
    ref, out, ops, seen = compiled_with_kernels(model, kw, qi.inject, qi.remove)
    assert {"head_rms_norm_rope", "layer_norm_fused"} <= ops, sorted(seen)
    assert rel_max(out, ref) <= FP32_REL, f"seed {gen.seed_value}"


def test_fp8_linear_layers_run_through_the_fused_blocks(gen):
    """fp8=True: the block projections become FP8 (q, k, v quantise their input once per stream), the fused
    blocks and attention run on them, the output stays near the bf16 one, and removal restores stock exactly."""
    model, kw = _case("edit-masked", gen.seed_value)
    model = nn.Module.to(model, torch.bfloat16)
    kw = {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()
    }
    stock = run_model(model, kw)
    counts = di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        assert counts["fp8_linear"] > 0 and counts["qwen_image_blocks"] == counts["qwen_image_attention"] == LAYERS
        assert isinstance(model.transformer_blocks[0].attn.to_q, fp8_linear.Fp8Linear)
        assert isinstance(model.transformer_blocks[1].txt_mlp.net[2], fp8_linear.Fp8Linear)
        out = run_model(model, kw)
    finally:
        di.remove_optimized_kernels(model, verbose=False)
    assert torch.isfinite(out).all()
    assert 1e-3 < rel_l2(out, stock) < 0.15, f"FP8 output off the bf16 one by {rel_l2(out, stock):.4f}"
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), stock)

# SPDX-License-Identifier: Apache-2.0
"""The HunyuanVideo 1.5 family plug-in (scripts/hunyuan_video15_injection.py) on tiny random transformers with
inputs as the pipelines build them (a padded text mask among them): fp32 parity with stock, the fused kernels
called, counts, exact removal, hooks and subclasses making the fused path step aside, torch.compile of the
blocks, autograd, bf16, FP8, and HunyuanVideo 1.0's double-stream blocks."""

import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15AttnProcessor2_0,
    HunyuanVideo15TransformerBlock,
)

import diffusers_injection as di
import fp8_linear
import head_norm_rope
import hunyuan_video15_injection as hv
import injection_common as ic
import layernorm
import rmsnorm
from kernel_testing import (
    DEVICE,
    assert_bf16_parity,
    count_calls,
    rel_l2,
    rel_max,
    run_compiled_fullgraph,
    run_model,
    without_and_with_kernels,
)

FP32_REL = 1e-5
FUSED = [
    (head_norm_rope, "joint_head_rms_norm_rope"),
    (layernorm, "gated_residual_layer_norm_modulate"),
    (layernorm, "layer_norm_modulate"),
    (rmsnorm, "gated_residual_add"),
]
# 2 blocks; per stream: attention residual + norm2 in each block, block 0's last residual + block 1's norm1,
# block 1's last residual alone; norm1 of block 0 (both streams) and the output norm
CALLS = {
    "joint_head_rms_norm_rope": 2,
    "gated_residual_layer_norm_modulate": 6,
    "gated_residual_add": 2,
    "layer_norm_modulate": 3,
}


def _randomise_norms(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # trained q/k norms are not ones: a swapped weight must show
        for m in model.modules():
            if isinstance(m, RMSNorm) and m.weight is not None:
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))


def _model(seed, dtype=torch.float32, layers=2):
    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=9,  # latents (4) + condition latents (4) + mask (1), as the pipeline concatenates them
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=layers,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        text_embed_dim=24,
        text_embed_2_dim=20,
        image_embed_dim=12,
        rope_axes_dim=(4, 6, 6),
    )
    _randomise_norms(model, seed)
    return torch.nn.Module.to(model, DEVICE, dtype).eval()  # (ModelMixin.to warns on every cast)


def _inputs(seed, dtype=torch.float32, batch=2):
    """As HunyuanVideo15Pipeline builds them (t2v): latents with zero condition latents and mask, the LLM's
    and byT5's embeddings with masks of the transformer's dtype (padding in one sample each), zero image
    embeddings, timestep = sigma * 1000 in the latents' dtype."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    latents = torch.cat([rnd(batch, 4, 2, 4, 4), torch.zeros(batch, 5, 2, 4, 4, device=DEVICE, dtype=dtype)], dim=1)
    mask = torch.ones(batch, 12, device=DEVICE, dtype=dtype)
    mask[-1, 7:] = 0
    mask_2 = torch.ones(batch, 6, device=DEVICE, dtype=dtype)
    mask_2[0, 4:] = 0
    return dict(
        hidden_states=latents,
        timestep=torch.tensor([700.0, 300.0][:batch], device=DEVICE).to(dtype),
        encoder_hidden_states=rnd(batch, 12, 24),
        encoder_attention_mask=mask,
        encoder_hidden_states_2=rnd(batch, 6, 20),
        encoder_attention_mask_2=mask_2,
        image_embeds=torch.zeros(batch, 5, 12, device=DEVICE, dtype=dtype),
        return_dict=False,
    )


def _nothing_left(model):
    assert not any(ic.bundle_state(m) for m in model.modules())
    assert not any("forward" in m.__dict__ for m in model.modules())
    procs = [type(m.processor) for m in model.modules() if hasattr(m, "processor")]
    assert hv.HunyuanVideo15FusedAttnProcessor not in procs


def _inject(model, verbose=False):
    return di.inject_optimized_kernels(model, verbose=verbose)


def _remove(model, verbose=False):
    return di.remove_optimized_kernels(model, verbose=verbose)


def test_fp32_parity_kernels_counts_and_exact_removal(gen, monkeypatch):
    model, kw = _model(gen.seed_value % 1000), _inputs(gen.seed_value)
    ref = run_model(model, kw)
    calls = count_calls(monkeypatch, FUSED)
    counts = _inject(model)
    assert counts["hunyuan_video15_blocks"] == 2 and counts["hunyuan_video15_qk_norm_rope"] == 2
    assert counts["hunyuan_video15_patch_embed"] == 1
    assert counts["generic_adaln"] == 5 and counts["generic_gelu_tanh"] == 4  # norm1s + norm_out, feed-forwards
    assert di.injected_counts(model) == counts and _inject(model) == counts  # a second call changes nothing
    with torch.no_grad():  # the patch embedding's tokens: the same values, as contiguous rows
        tokens = model.x_embedder(kw["hidden_states"])
        stock_tokens = type(model.x_embedder).forward(model.x_embedder, kw["hidden_states"])
    assert tokens.is_contiguous() and not stock_tokens.is_contiguous() and torch.equal(tokens, stock_tokens)
    out = run_model(model, kw)
    assert dict(calls) == CALLS
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    restored = _remove(model)
    assert restored["hunyuan_video15_blocks"] == 2 and restored["hunyuan_video15_qk_norm_rope"] == 2
    assert restored["hunyuan_video15_patch_embed"] == 1
    _nothing_left(model)
    assert all(type(m.processor) is HunyuanVideo15AttnProcessor2_0 for b in model.transformer_blocks for m in [b.attn])
    assert torch.equal(run_model(model, kw), ref)


def test_rope_on_image_tokens_only_one_launch(gen):
    """The joint kernel rotates every token by one table: the text rows are the identity rotation, so the
    result equals diffusers' norm + RoPE of the image tokens, then the normalised text tokens (no RoPE)."""
    model = _model(gen.seed_value % 1000, layers=1)
    attn = model.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(gen.seed_value)
    q, k = (torch.randn(2, 32, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    eq, ek = (torch.randn(2, 9, 2, 16, generator=g).to(DEVICE) for _ in range(2))
    cos, sin = model.rope(torch.zeros(1, 9, 2, 4, 4, device=DEVICE))
    from diffusers.models.embeddings import apply_rotary_emb

    with torch.no_grad():
        got = hv._fused_qk(attn, q, k, eq, ek, (cos, sin))
        want_q = torch.cat([apply_rotary_emb(attn.norm_q(q), (cos, sin), sequence_dim=1), attn.norm_added_q(eq)], 1)
        want_k = torch.cat([apply_rotary_emb(attn.norm_k(k), (cos, sin), sequence_dim=1), attn.norm_added_k(ek)], 1)
        assert rel_max(got[0], want_q) <= FP32_REL and rel_max(got[1], want_k) <= FP32_REL
        again = hv._joint_tables(cos, sin, 9)
        assert all(a is b for a, b in zip(again, hv._joint_tables(cos, sin, 9)))  # built once per table
        cos.mul_(1.0)  # an in-place change: built again
        assert hv._joint_tables(cos, sin, 9)[0] is not again[0]


def test_hunyuan_video_1_0_double_stream_blocks(gen, monkeypatch):
    """HunyuanVideo 1.0: its double-stream block forward is the same code and its processor differs only in
    the mask (passed through): both fused; the single-stream blocks keep their processor (generic layer)."""
    seed = gen.seed_value % 1000
    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=24, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6),
    )  # fmt: skip
    _randomise_norms(model, seed)
    model = model.to(DEVICE).eval()
    g = torch.Generator().manual_seed(gen.seed_value)
    mask = torch.ones(2, 10, device=DEVICE)
    mask[1, 6:] = 0
    kw = dict(
        hidden_states=torch.randn(2, 4, 2, 4, 4, generator=g).to(DEVICE),
        timestep=torch.tensor([700, 300], device=DEVICE),
        encoder_hidden_states=torch.randn(2, 10, 24, generator=g).to(DEVICE),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(2, 8, generator=g).to(DEVICE),
        guidance=torch.tensor([6000.0, 6000.0], device=DEVICE),
        return_dict=False,
    )
    ref = run_model(model, kw)
    calls = count_calls(monkeypatch, FUSED)
    counts = _inject(model)
    assert counts["hunyuan_video15_blocks"] == 2 and counts["hunyuan_video15_qk_norm_rope"] == 2
    assert type(model.single_transformer_blocks[0].attn.processor) is HunyuanVideoAttnProcessor2_0
    out = run_model(model, kw)
    assert calls["joint_head_rms_norm_rope"] == 2 and calls["gated_residual_layer_norm_modulate"] == 6
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    _remove(model)
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)


@pytest.mark.parametrize("where", ["block", "attn", "norm_q", "norm_added_k", "norm2", "next_norm1", "ff_proj"])
def test_hooks_make_the_fused_path_step_aside_and_run(where, gen, monkeypatch):
    """A forward hook on a module the fused path would not call (or on a block, which stops the carry into
    the next one): the hook runs as often as in the stock model, and may change the output."""
    model, kw = _model(gen.seed_value % 1000), _inputs(gen.seed_value)
    b0, b1 = model.transformer_blocks
    target = {
        "block": b0,
        "attn": b0.attn,
        "norm_q": b0.attn.norm_q,
        "norm_added_k": b1.attn.norm_added_k,
        "norm2": b0.norm2_context,
        "next_norm1": b1.norm1,
        "ff_proj": b0.ff.net[2],
    }[where]
    fired = []

    def hook(module, args, output):
        fired.append(1)
        if isinstance(output, torch.Tensor):
            return output * 1.25
        return (output[0] * 1.25, *output[1:])

    calls = count_calls(monkeypatch, FUSED)
    handle = target.register_forward_hook(hook)
    ref, got, n_ref = without_and_with_kernels(model, kw, _inject, _remove, [handle], fired)
    assert len(fired) == n_ref > 0
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e} (seed {gen.seed_value})"
    if where in ("norm_q", "norm_added_k"):  # that attention unfused, the other one fused
        assert calls["joint_head_rms_norm_rope"] == 1
    if where in ("block", "next_norm1"):  # block 0's last residuals not fused into block 1's norm1
        assert calls["gated_residual_layer_norm_modulate"] == 4 + (where == "next_norm1")
    _nothing_left(model)


class _OwnBlock(HunyuanVideo15TransformerBlock):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class _OwnProcessor(HunyuanVideo15AttnProcessor2_0):
    pass


def test_subclasses_and_other_processors_left_alone(gen, monkeypatch):
    model, kw = _model(gen.seed_value % 1000), _inputs(gen.seed_value)
    model.transformer_blocks[1].__class__ = _OwnBlock
    model.transformer_blocks[0].attn.set_processor(_OwnProcessor())
    ref = run_model(model, kw)
    calls = count_calls(monkeypatch, FUSED)
    counts = _inject(model)
    assert counts["hunyuan_video15_blocks"] == 1 and counts["hunyuan_video15_qk_norm_rope"] == 1
    assert "forward" not in model.transformer_blocks[1].__dict__
    assert type(model.transformer_blocks[0].attn.processor) is _OwnProcessor
    out = run_model(model, kw)
    assert calls["joint_head_rms_norm_rope"] == 1
    assert rel_max(out, ref) <= FP32_REL
    _remove(model)
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)


class _Blocks(torch.nn.Module):
    """The transformer blocks of a model on the inputs the model gives them (diffusers compiles HunyuanVideo
    1.5 by its repeated blocks: the model's own forward branches on data, is_t2v)."""

    def __init__(self, model):
        super().__init__()
        self.blocks = model.transformer_blocks

    def forward(self, hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis):
        for block in self.blocks:
            hidden_states, encoder_hidden_states = block(
                hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis
            )
        return hidden_states, encoder_hidden_states


def _block_inputs(model, kw):
    seen = {}

    def grab(module, args):
        seen.update(zip(("hidden_states", "encoder_hidden_states", "temb", "attention_mask"), args))
        seen["freqs_cis"] = args[4]

    handle = model.transformer_blocks[0].register_forward_pre_hook(grab)
    try:
        run_model(model, kw)
    finally:
        handle.remove()
    return seen


def test_torch_compile_fullgraph_traces_the_blocks(gen):
    """fullgraph=True on the blocks (stock traces too): the fused q/k norm + RoPE and residual + LayerNorm +
    modulation kernels in the graph, which computes what the stock blocks compute."""
    model, kw = _model(gen.seed_value % 1000), _inputs(gen.seed_value)
    blocks = _Blocks(model)
    bkw = _block_inputs(model, kw)
    ref, _, _ = run_compiled_fullgraph(blocks, bkw)  # stock blocks trace with fullgraph=True
    _inject(model)
    try:
        eager = run_model(blocks, bkw)
        out, ops, seen = run_compiled_fullgraph(blocks, bkw)
    finally:
        _remove(model)
    # (the last gated residual is PyTorch's expression under compile, for the compiler to fuse: no carry there)
    assert {"head_rms_norm_rope", "layer_norm_fused"} <= ops, sorted(seen)
    assert rel_max(out, ref) <= FP32_REL and rel_max(eager, ref) <= FP32_REL, f"seed {gen.seed_value}"


def test_autograd_runs_the_original_code(gen, monkeypatch):
    """Under autograd (a trainable weight inside a block) the blocks and processors run diffusers' code."""
    model, kw = _model(gen.seed_value % 1000), _inputs(gen.seed_value)
    model.requires_grad_(False)
    w = model.transformer_blocks[0].attn.to_v.weight
    w.requires_grad_(True)
    ref = model(**kw)[0]
    ref.square().mean().backward()
    ref_grad, w.grad = w.grad.clone(), None
    calls = count_calls(monkeypatch, FUSED)
    _inject(model)
    try:
        out = model(**kw)[0]
        out.square().mean().backward()
    finally:
        _remove(model)
    assert calls["joint_head_rms_norm_rope"] == calls["gated_residual_layer_norm_modulate"] == 0
    # (the generic layer's norms still run where no input needs a gradient)
    assert rel_max(out.detach(), ref.detach()) <= FP32_REL
    torch.testing.assert_close(w.grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_bf16_parity(gen):
    seed = gen.seed_value
    ref32 = run_model(_model(seed % 1000), _inputs(seed))
    model = _model(seed % 1000, torch.bfloat16)
    assert_bf16_parity(model, _inputs(seed, torch.bfloat16), ref32, _inject, _remove, seed)


def test_fp8_mode(gen, monkeypatch):
    """fp8=True: the blocks' linear layers become FP8 (not the AdaLN norms'), the fused kernels still run, the
    output stays near the bf16 kernels' one, and removal gives back the stock model bit for bit."""
    seed = gen.seed_value
    model, kw = _model(seed % 1000, torch.bfloat16), _inputs(seed, torch.bfloat16)
    stock = run_model(model, kw)
    _inject(model)
    bf16 = run_model(model, kw)
    _remove(model)
    calls = count_calls(monkeypatch, FUSED)
    counts = di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        layers = [n for n, m in model.named_modules() if isinstance(m, fp8_linear.Fp8Linear)]
        assert "transformer_blocks.0.attn.add_k_proj" in layers and "transformer_blocks.1.ff.net.2" in layers
        assert not any(".norm1" in n for n in layers) and counts["fp8_linear"] == len(layers)
        out = run_model(model, kw)
    finally:
        _remove(model)
    assert calls["joint_head_rms_norm_rope"] == 2 and calls["gated_residual_layer_norm_modulate"] == 6
    assert torch.isfinite(out).all() and rel_l2(out, bf16) < 0.15, f"seed {seed}"
    assert torch.equal(run_model(model, kw), stock)

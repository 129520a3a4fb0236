# SPDX-License-Identifier: Apache-2.0
"""model_zoo: each tiny model's forward on the inputs its pipeline would give it (finite, the expected shape),
then with the kernels injected (its family's fusions or the generic layer: the counts, the kernels called, fp32
parity with the stock forward) and removed (the stock output bit for bit); the real architectures on the meta
device (block lists, widths, parameter counts, token counts of the pipelines' default inputs) and --list."""

import json

import pytest
import torch

import activations
import diffusers_injection as di
import head_norm_rope
import layernorm
import model_zoo as mz
import qk_norm_rope
import rmsnorm
import rope
from kernel_testing import DEVICE, count_calls, rel_max

# fp32: each fused step is the same math with one rounding and another summation order: a few fp32 ulps per
# op, far below 1e-5 of the output's magnitude through the tiny models
FP32_REL = 1e-5
KERNELS = {
    rmsnorm: ("rms_norm", "rms_norm_modulate", "gated_residual_add"),
    layernorm: ("layer_norm", "layer_norm_modulate", "layer_norm_modulate_dual", "gated_residual_layer_norm_modulate"),
    activations: ("gelu_tanh", "geglu", "swiglu"),
    rope: ("rope_interleaved", "rope_rotate_half", "ltx_rope"),
    qk_norm_rope: ("ltx_qk_rmsnorm_rope",),
    head_norm_rope: ("joint_head_rms_norm_rope",),
}

# per model at size tiny: (output shape for a batch of B, kernels that must run); FLUX.2, Qwen-Image, HunyuanVideo
# 1.5, LTX-2 and Wan VACE are their families' (fused blocks and q/k norm + RoPE), the others the generic layer's
TINY = {
    "flux2": (
        lambda b: (b, 16, 16),
        {"layer_norm_modulate", "gated_residual_layer_norm_modulate", "swiglu", "joint_head_rms_norm_rope"},
    ),
    "qwen_image": (
        lambda b: (b, 16, 16),
        {"layer_norm_modulate", "gated_residual_layer_norm_modulate", "gelu_tanh", "joint_head_rms_norm_rope"},
    ),
    "ltx2": (lambda b: (b, 8, 8), {"rms_norm_modulate", "gelu_tanh"}),
    "hunyuan_video15": (
        lambda b: (b, 4, 2, 4, 4),
        {"layer_norm_modulate", "gated_residual_layer_norm_modulate", "gelu_tanh", "joint_head_rms_norm_rope"},
    ),
    "z_image": (lambda b: (b, 4, 1, 8, 8), {"rms_norm", "layer_norm"}),
    "cogvideox": (lambda b: (b, 2, 4, 4, 4), {"layer_norm", "layer_norm_modulate", "gelu_tanh"}),
    "sana": (lambda b: (b, 4, 4, 4), {"rms_norm", "layer_norm", "gelu_tanh"}),
    "wan_vace": (
        lambda b: (b, 4, 3, 8, 8),
        {"layer_norm_modulate", "gated_residual_layer_norm_modulate", "gelu_tanh", "ltx_qk_rmsnorm_rope"},
    ),
}
# CogVideoX's per-head q/k LayerNorms get q/k [B, H, S, D] as a transposed view of the [B, S, H, D] projection
# (the generic layer reads such a view in place: generic_injection.rowwise); batch 1 too (a dim of one)
CASES = [pytest.param(n, 2, id=n) for n in mz.NAMES]
CASES.append(pytest.param("cogvideox", 1, id="cogvideox-batch1"))

# per model at size real: (block list lengths, an attention module, heads, head dim, parameters in billions,
# tokens from the inputs, counted from their shapes)
REAL = {
    "flux2": (dict(transformer_blocks=8, single_transformer_blocks=48), "transformer_blocks.0.attn", 48, 128, 32.2),
    "qwen_image": (dict(transformer_blocks=60), "transformer_blocks.0.attn", 24, 128, 20.4),
    "ltx2": (dict(transformer_blocks=48), "transformer_blocks.0.attn1", 32, 128, 18.9),
    "hunyuan_video15": (dict(transformer_blocks=54), "transformer_blocks.0.attn", 16, 128, 8.3),
    "z_image": (dict(layers=30, noise_refiner=2, context_refiner=2), "layers.0.attention", 30, 128, 6.2),
    "cogvideox": (dict(transformer_blocks=42), "transformer_blocks.0.attn1", 48, 64, 5.6),
    "sana": (dict(transformer_blocks=20), "transformer_blocks.0.attn1", 70, 32, 1.6),
    "wan_vace": (dict(blocks=30, vace_blocks=15), "blocks.0.attn1", 12, 128, 2.2),
}
TOKENS = {
    "flux2": lambda kw: dict(image=kw["hidden_states"].shape[1], text=kw["encoder_hidden_states"].shape[1]),
    "qwen_image": lambda kw: dict(image=kw["hidden_states"].shape[1], text=kw["encoder_hidden_states"].shape[1]),
    "ltx2": lambda kw: dict(
        video=kw["hidden_states"].shape[1],
        audio=kw["audio_hidden_states"].shape[1],
        text=kw["encoder_hidden_states"].shape[1],
    ),
    "hunyuan_video15": lambda kw: dict(
        video=kw["hidden_states"][0, 0].numel(),
        text=kw["encoder_hidden_states"].shape[1],
        glyph=kw["encoder_hidden_states_2"].shape[1],
        image=kw["image_embeds"].shape[1],
    ),
    "z_image": lambda kw: dict(image=kw["x"][0][0].numel() // 4, text=kw["cap_feats"][0].shape[0]),
    "cogvideox": lambda kw: dict(
        video=kw["hidden_states"][0, :, 0].numel() // 4, text=kw["encoder_hidden_states"].shape[1]
    ),
    "sana": lambda kw: dict(image=kw["hidden_states"][0, 0].numel(), text=kw["encoder_hidden_states"].shape[1]),
    "wan_vace": lambda kw: dict(
        video=kw["hidden_states"][0, 0].numel() // 4, text=kw["encoder_hidden_states"].shape[1]
    ),
}
REAL_TOKENS = {
    "flux2": dict(image=4096, text=512),  # 1024x1024: (1024 / 16)^2
    "qwen_image": dict(image=4096, text=512),
    "ltx2": dict(video=6144, audio=126, text=1024),  # 16 x 16 x 24 latents of 121 x 512 x 768; 5.04 s x 25 / s
    "hunyuan_video15": dict(video=49290, text=1000, glyph=256, image=729),  # 31 x 30 x 53 of 121 x 480 x 848
    "z_image": dict(image=4096, text=512),
    "cogvideox": dict(video=17550, text=226),  # 13 x 30 x 45 of 49 x 480 x 720
    "sana": dict(image=1024, text=300),  # (1024 / 32)^2
    "wan_vace": dict(video=32760, text=512),  # 21 x 30 x 52 of 81 x 480 x 832
}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the leaf kernels the generic layer runs (proves that the kernels, not torch, ran)."""
    return count_calls(monkeypatch, [(mod, name) for mod, names in KERNELS.items() for name in names])


@pytest.mark.parametrize("name, batch", CASES)
def test_tiny_forward_stock_injected_and_removed(name, batch, gen, kernel_calls):
    seed = int(torch.randint(2**31, (1,), generator=gen))
    model = mz.build(name, "tiny", device=DEVICE, seed=seed)
    kw = mz.inputs(name, model, "tiny", batch=batch, seed=seed + 1)
    ref = mz.run(model, kw)
    shape, kernels = TINY[name]
    assert ref.shape == shape(batch) and ref.dtype == torch.float32
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    try:
        counts = di.inject_optimized_kernels(model, verbose=False)
        kernel_calls.clear()
        got = mz.run(model, kw)
    finally:
        restored = di.remove_optimized_kernels(model, verbose=False)
    injected = {k: v for k, v in counts.items() if v}
    assert any(k.startswith("generic_") for k in injected)  # (a family runs the generic layer first, too)
    assert {k: v for k, v in restored.items() if k in injected} == injected
    assert kernels <= set(kernel_calls), f"kernels called: {dict(kernel_calls)}"
    rel = rel_max(got, ref)
    assert rel <= FP32_REL, f"{name}: injected vs stock {rel:.3e} of the output's max (kernels: {dict(kernel_calls)})"
    assert torch.equal(mz.run(model, kw), ref)


@pytest.mark.parametrize("name", mz.NAMES)
def test_real_architecture_and_inputs_on_meta(name):
    blocks, attn_path, heads, head_dim, billions = REAL[name]
    model = mz.build(name, "real", dtype=torch.bfloat16, device="meta")
    assert {k: len(getattr(model, k)) for k in blocks} == blocks
    attn = model.get_submodule(attn_path)
    assert (attn.heads, attn.to_q.out_features) == (heads, heads * head_dim)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 1) == billions
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    kw = mz.inputs(name, model, "real")
    tensors = [t for v in kw.values() for t in (v if isinstance(v, (list, tuple)) else [v]) if torch.is_tensor(t)]
    assert all(t.device.type == "meta" for t in tensors)
    assert TOKENS[name](kw) == REAL_TOKENS[name] == mz.token_counts(name, "real")
    line = mz.describe(name)
    assert all(f" {n} {stream}" in line for stream, n in REAL_TOKENS[name].items()), line
    few = mz.build(name, "real", device="meta", blocks=2)
    # (Wan VACE's blocks attach after blocks 0, 2, ...: of two blocks kept, block 0 has one)
    want = dict(blocks=2, vace_blocks=1) if name == "wan_vace" else {k: min(2, n) for k, n in blocks.items()}
    assert {k: len(getattr(few, k)) for k in blocks} == want


def test_list_prints_every_model(capsys):
    assert mz._main(["--list"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in listed] == list(mz.NAMES)
    for m in listed:
        assert m["tokens"] == REAL_TOKENS[m["name"]] and m["describe"] == mz.describe(m["name"])
        assert round(m["params"] / 1e9, 1) == REAL[m["name"]][4]

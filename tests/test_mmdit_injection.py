# SPDX-License-Identifier: Apache-2.0
"""inject_mmdit_kernels / remove_mmdit_kernels on diffusers' SD3 (SD3.5 MMDiT-X) and FLUX transformers:
parity with the unpatched model in fp32 and bf16 (tiny random models through the interpreter), counts
on the released architectures (meta device), exact restoration, idempotence, fallbacks, fused qkv
projections, torch.compile, the dispatch from diffusers_injection, the input builder and the command line."""

import json
from collections import Counter

import pytest
import torch

import activations
import diffusers_injection as di
import head_norm_rope
import injection_common as ic
import layernorm
import mmdit_injection as mi
from kernel_testing import (
    DEVICE,
    assert_bf16_parity,
    assert_injecting_twice_is_harmless,
    assert_unpatched_again,
    compiled_with_kernels,
    count_calls,
    hooked_norm_outputs,
    make_generator,
    rel_l2,
    rel_max,
    run_model,
    without_and_with_kernels,
)

# fp32: each fused step is the same math with one rounding and another summation order: a few fp32
# ulps per op, far below 1e-5 of the output's magnitude through the tiny models.
FP32_REL = 1e-5

EXPECTED_TINY = {
    "sd3": {
        "mmdit_adaln_zero": 2,
        "mmdit_adaln_zero_x": 1,
        "mmdit_adaln_zero_single": 0,
        "mmdit_adaln_continuous": 2,
        "mmdit_fused_blocks": 2,
        "mmdit_qk_norm_fused": 3,
        "mmdit_qk_norm_rope_fused": 0,
        "mmdit_gelu_tanh": 3,
    },
    "flux": {
        "mmdit_adaln_zero": 2,
        "mmdit_adaln_zero_x": 0,
        "mmdit_adaln_zero_single": 1,
        "mmdit_adaln_continuous": 1,
        "mmdit_fused_blocks": 2,
        "mmdit_qk_norm_fused": 0,
        "mmdit_qk_norm_rope_fused": 2,
        "mmdit_gelu_tanh": 3,
    },
}
# kernel calls in one forward of each tiny model
EXPECTED_CALLS = {
    # block 0: norm1 (dual), norm1_context, residual+norm2 (after attn2), text residual+norm2, last residual +
    # block 1's norm1; block 1: norm1_context (continuous), residual+norm2; norm_out; q/k: block 0 joint +
    # attn2, block 1 joint
    "sd3": {
        "layer_norm_modulate": 3,
        "layer_norm_modulate_dual": 1,
        "gated_residual_layer_norm_modulate": 4,
        "joint_head_rms_norm_rope": 3,
        "gelu_tanh": 3,
    },
    # double block: norm1, norm1_context, 2 x residual+norm2, q/k of text+image; single block: norm, q/k;
    # norm_out; GELU: ff, ff_context, act_mlp
    "flux": {
        "layer_norm_modulate": 4,
        "layer_norm_modulate_dual": 0,
        "gated_residual_layer_norm_modulate": 2,
        "joint_head_rms_norm_rope": 2,
        "gelu_tanh": 3,
    },
}


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the leaf kernels the integration uses (proves the kernels, not torch, ran)."""
    return count_calls(
        monkeypatch,
        (
            (layernorm, "layer_norm_modulate"),
            (layernorm, "layer_norm_modulate_dual"),
            (layernorm, "gated_residual_layer_norm_modulate"),
            (layernorm, "gated_residual_layer_norm_modulate_dual"),
            (head_norm_rope, "joint_head_rms_norm_rope"),
            (activations, "gelu_tanh"),
        ),
    )


def _model(kind, dtype=torch.float32, *, seed):
    build = mi.build_sd3_transformer if kind == "sd3" else mi.build_flux_transformer
    return build("tiny", dtype=dtype, device=DEVICE, seed=seed)


def _inputs(model, dtype=torch.float32, *, seed):
    # 64x64 pixels: 16 image tokens in both models; 7 text tokens
    return mi.make_mmdit_inputs(model, batch=2, height=64, width=64, text_len=7, dtype=dtype, device=DEVICE, seed=seed)


def _no_injection_left(model):
    for m in model.modules():
        assert mi._STATE not in m.__dict__, f"{type(m).__name__} still marked as patched"
        assert "forward" not in m.__dict__ or hasattr(m, "_hf_hook"), f"{type(m).__name__} keeps a patched forward"
        assert type(getattr(m, "processor", None)) not in (mi.SD3FusedJointAttnProcessor, mi.FluxFusedAttnProcessor)


# --------------------------------------------------------------------------------------------
# Parity and exact restoration
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_fp32_parity_and_exact_restore(kind, kernel_calls):
    gen = make_generator()
    model = _model(kind, seed=gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    ref = run_model(model, kw)
    counts = mi.inject_mmdit_kernels(model, verbose=False)
    assert counts == EXPECTED_TINY[kind]
    out = run_model(model, kw)
    assert dict(kernel_calls) == {k: v for k, v in EXPECTED_CALLS[kind].items() if v}
    assert torch.isfinite(out).all()
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    assert mi.remove_mmdit_kernels(model, verbose=False) == counts
    assert_unpatched_again(model, kw, ref, _no_injection_left)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_bf16_parity(kind):
    """bf16: the unpatched model is itself away from its fp32 run (bf16 rounding after every op). The
    kernels round less often (fp32 inside each fused step), so the patched model must be no further
    from fp32 than 1.5x the unpatched distance (the interpreter's truncating casts included), and
    patched vs unpatched within 2^-5 relative L2 (a wrong result is of order 1)."""
    gen = make_generator()
    model = _model(kind, seed=gen.seed_value % 1000)
    kw32 = _inputs(model, seed=gen.seed_value)
    ref32 = run_model(model, kw32).double()
    torch.nn.Module.to(model, torch.bfloat16)
    kw = _inputs(model, dtype=torch.bfloat16, seed=gen.seed_value)
    assert_bf16_parity(model, kw, ref32, mi.inject_mmdit_kernels, mi.remove_mmdit_kernels, gen.seed_value)


@pytest.mark.parametrize("kind, hook_act_mlp", [("sd3", False), ("flux", False), ("flux", True)])
def test_gemm_gelu_path_taken_where_verified(kind, hook_act_mlp, kernel_calls, monkeypatch):
    """With the GEMM-epilogue GELU verified (forced here: the CPU's _addmm_activation computes the erf
    form, which bf16 cannot tell from the tanh one at this tolerance), every feed-forward and FLUX's
    single-block proj_mlp + act_mlp go through injection_common.linear_gelu_tanh instead of
    activations.gelu_tanh, and the output stays within the bf16 parity bound. A hook on FLUX's act_mlp
    keeps that one on the module (its hook must run), through the GELU kernel."""
    import injection_common as ic

    monkeypatch.setattr(ic, "gemm_gelu_tanh_ok", lambda device, dtype: True)
    fused = Counter()
    orig = ic.linear_gelu_tanh

    def spy(x, proj):
        y = orig(x, proj)
        fused["fused" if y is not None else "declined"] += 1
        return y

    monkeypatch.setattr(ic, "linear_gelu_tanh", spy)
    gen = make_generator()
    model = _model(kind, dtype=torch.bfloat16, seed=gen.seed_value % 1000)
    kw = _inputs(model, dtype=torch.bfloat16, seed=gen.seed_value)
    hook_calls = Counter()
    if hook_act_mlp:
        for blk in model.single_transformer_blocks:
            blk.act_mlp.register_forward_hook(lambda m, a, o: hook_calls.update(["act_mlp"]))
    stock = run_model(model, kw)
    hook_calls.clear()
    mi.inject_mmdit_kernels(model, verbose=False)
    patched = run_model(model, kw)
    n_single = len(model.single_transformer_blocks) if hook_act_mlp else 0
    assert fused == {"fused": EXPECTED_TINY[kind]["mmdit_gelu_tanh"] - n_single}
    assert kernel_calls["gelu_tanh"] == n_single
    assert hook_calls["act_mlp"] == n_single
    assert rel_l2(patched, stock) <= 2.0**-5
    mi.remove_mmdit_kernels(model, verbose=False)
    assert torch.equal(run_model(model, kw), stock)


def test_plain_tanh_gelu_check_traces_like_eager():
    """FLUX's single block decides per call whether act_mlp may be folded into the GEMM; under
    torch.compile that check must give eager's answer (a form that read act.forward.__func__ traced to
    False for the patched forward under torch 2.11, and for the class's own forward under 2.13, which
    silently kept the fused path off under compile). Checked with fullgraph compilation."""
    import types

    ours = torch.nn.GELU(approximate="tanh")
    mi._patch_forward(ours, mi._torch_gelu_tanh_forward, "mmdit_gelu_tanh")
    replaced = torch.nn.GELU(approximate="tanh")
    replaced.forward = types.MethodType(lambda self, x: x * 2, replaced)
    hooked = torch.nn.GELU(approximate="tanh")
    hooked.register_forward_hook(lambda m, a, o: None)
    lam = torch.nn.GELU(approximate="tanh")
    lam.forward = lambda x: x
    cases = [
        ("ours", ours, True),
        ("class forward", torch.nn.GELU(approximate="tanh"), True),
        ("replaced method", replaced, False),
        ("hooked", hooked, False),
        ("plain function", lam, False),
        ("erf", torch.nn.GELU(), False),
    ]
    for name, act, want in cases:
        assert mi._plain_tanh_gelu(act) is want, name
        torch._dynamo.reset()

        @torch.compile(backend="eager", fullgraph=True)
        def probe(x, act=act):
            return x + 1 if mi._plain_tanh_gelu(act) else x - 1

        traced = bool(probe(torch.zeros(1)).item() == 1)
        assert traced is want, f"{name}: compiled check gave {traced}, eager {want}"
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# A block's last gated residual fused with the next block's norm1 / norm1_context
# --------------------------------------------------------------------------------------------
def _deep_model(kind, seed):
    """SD3: 3 blocks (dual, dual, context_pre_only); FLUX: 2 double + 1 single block (tiny widths)."""
    if kind == "sd3":
        cfg = dict(mi.SD3_CONFIGS["tiny"], num_layers=3, dual_attention_layers=(0, 1))
        return mi._build(mi.SD3Transformer2DModel, cfg, torch.float32, DEVICE, seed)
    cfg = dict(mi.FLUX_CONFIGS["tiny"], num_layers=2)
    return mi._build(mi.FluxTransformer2DModel, cfg, torch.float32, DEVICE, seed)


def _count_norm_calls(model):
    """Wrap every block's norm1 / norm1_context so that calls are counted per (block index, name).
    Returns (counts, undo)."""
    calls, wrapped = Counter(), []
    for i, blk in enumerate(model.transformer_blocks):
        for name in ("norm1", "norm1_context"):
            norm = getattr(blk, name)
            state = norm.__dict__.get(mi._STATE)
            if state is None:  # not patched (e.g. an AdaLayerNormContinuous the injection left alone)
                inner = norm.forward

                def counted(*a, _inner=inner, _key=(i, name), **k):
                    calls[_key] += 1
                    return _inner(*a, **k)

                norm.forward = counted
                wrapped.append((norm, inner, None))
                continue
            # a patched norm: count inside the integration's own patch (a foreign forward would make the
            # blocks call the norm instead of carrying it, which is what the tests count)
            patched = state["patched"]
            fn = ic.patched_function(patched)

            def counted_fn(self, *a, _fn=fn, _key=(i, name), **k):
                calls[_key] += 1
                return _fn(self, *a, **k)

            bound = ic.BoundForward(counted_fn, norm)
            norm.__dict__["forward"], state["patched"] = bound, bound
            wrapped.append((norm, patched, state))

    def undo():
        for norm, inner, state in wrapped:
            if state is None:
                norm.forward = inner
            else:
                norm.__dict__["forward"], state["patched"] = inner, inner

    return calls, undo


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_last_residual_fused_into_the_next_norm(kind, kernel_calls):
    """Blocks after the first take their norm1 (and norm1_context where it is an AdaLayerNormZero) from
    the previous block's fused residual kernel; the output stays within fp32 parity; removal unlinks."""
    gen = make_generator()
    model = _deep_model(kind, gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    ref = run_model(model, kw)
    mi.inject_mmdit_kernels(model, verbose=False)
    calls, undo = _count_norm_calls(model)
    out = run_model(model, kw)
    undo()
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    n = len(model.transformer_blocks)
    # block 0 computes its own norms; the others only a norm the previous block cannot fuse
    # (SD3's last block: norm1_context is an AdaLayerNormContinuous)
    expected = {(0, "norm1"): 1, (0, "norm1_context"): 1}
    if kind == "sd3":
        expected[(n - 1, "norm1_context")] = 1
        assert kernel_calls["gated_residual_layer_norm_modulate_dual"] == 1  # block 0 -> block 1 (both dual)
    assert dict(calls) == expected
    assert all(not blk.__dict__.get(mi._CARRY) for blk in model.transformer_blocks)  # nothing left behind
    mi.remove_mmdit_kernels(model, verbose=False)
    assert all(ic.next_block(b) is None and mi._CARRY not in b.__dict__ for b in model.transformer_blocks)
    assert torch.equal(run_model(model, kw), ref)


def test_carry_ignored_when_the_stream_changes_between_blocks():
    """Anything done to h between two blocks (here: what a ControlNet residual does) makes the next block
    compute its norm itself; the result equals the unpatched block on the same input."""
    gen = make_generator()
    model = _deep_model("sd3", gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    b0, b1 = model.transformer_blocks[0], model.transformer_blocks[1]
    with torch.no_grad():
        temb = model.time_text_embed(kw["timestep"], kw["pooled_projections"])
        h = model.pos_embed(kw["hidden_states"]).contiguous()  # as the transformer's forward does
        c = model.context_embedder(kw["encoder_hidden_states"])
        c0, h0 = b0(h, c, temb)
        # a new tensor, changed along the rows (LayerNorm ignores a constant offset or a common scale)
        delta = torch.randn(h0.shape, generator=gen).to(h0) * h0.abs().mean()
        c_ref, h_ref = b1(h0 + delta, c0, temb)
        mi.inject_mmdit_kernels(model, verbose=False)
        pc0, ph0 = b0(h, c, temb)
        assert b1.__dict__[mi._CARRY]  # block 0 left block 1's norms
        pc1, ph1 = b1(ph0 + delta, pc0, temb)
        assert not b1.__dict__[mi._CARRY]  # taken off (and not used: h differs)
    assert rel_max(ph1, h_ref) <= FP32_REL and rel_max(pc1, c_ref) <= FP32_REL


def test_transposed_rows_fall_back_to_torch():
    """A block input whose rows are not contiguous (PatchEmbed's output before the transformer's
    .contiguous()) runs the original operations instead of raising."""
    gen = make_generator()
    model = _deep_model("sd3", gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    blk = model.transformer_blocks[0]
    with torch.no_grad():
        temb = model.time_text_embed(kw["timestep"], kw["pooled_projections"])
        h = model.pos_embed(kw["hidden_states"])
        assert h.stride(-1) != 1
        c = model.context_embedder(kw["encoder_hidden_states"])
        ref = blk(h, c, temb)
        mi.inject_mmdit_kernels(model, verbose=False)
        got = blk(h, c, temb)
    assert rel_max(got[1], ref[1]) <= FP32_REL and rel_max(got[0], ref[0]) <= FP32_REL


def test_injecting_twice_is_harmless(kernel_calls):
    gen = make_generator()
    model = _model("flux", seed=gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    assert_injecting_twice_is_harmless(
        model,
        kw,
        kernel_calls,
        mi,
        mi.inject_mmdit_kernels,
        mi.remove_mmdit_kernels,
        _no_injection_left,
        fused=(mi.FluxFusedAttnProcessor,),
    )


def test_fused_qkv_projections(kernel_calls):
    """model.fuse_qkv_projections(): q/k/v are chunks of one projection, read in place (strided)."""
    gen = make_generator()
    model = _model("flux", seed=gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    model.fuse_qkv_projections()
    ref = run_model(model, kw)
    mi.inject_mmdit_kernels(model, verbose=False)
    out = run_model(model, kw)
    assert kernel_calls["joint_head_rms_norm_rope"] == 2
    assert rel_max(out, ref) <= FP32_REL


def test_autograd_runs_the_original_code(kernel_calls):
    """The kernels have no backward: with gradients wanted, the original operations run and backward works."""
    gen = make_generator()
    model = _model("sd3", seed=gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    ref = model(**kw)[0]
    mi.inject_mmdit_kernels(model, verbose=False)
    out = model(**kw)[0]
    assert sum(kernel_calls.values()) == 0
    assert rel_max(out, ref) <= FP32_REL  # torch.addcmul instead of mul + add: an ulp here and there
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.transformer_blocks[0].norm1.linear.parameters())


def test_other_processor_and_ff_chunking_left_to_the_original(gen):
    """A processor set by the user is not replaced (and not restored over); FF chunking runs the original block."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    model = _model("sd3", seed=gen.seed_value % 1000)
    attn2 = model.transformer_blocks[0].attn2
    attn2.set_processor(AttnProcessor2_0())
    counts = mi.inject_mmdit_kernels(model, verbose=False)
    assert counts["mmdit_qk_norm_fused"] == 2 and type(attn2.processor) is AttnProcessor2_0
    model.enable_forward_chunking(chunk_size=1, dim=0)
    kw = _inputs(model, seed=gen.seed_value)
    out = run_model(model, kw)
    mi.remove_mmdit_kernels(model, verbose=False)
    assert rel_max(out, run_model(model, kw)) <= FP32_REL


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_torch_compile_fullgraph_traces_the_kernels(kind):
    """The patched model compiles without graph breaks (the kernels are torch.library custom ops), and the
    captured graph calls the fused q/k norm + RoPE and LayerNorm kernels: the checks that send a hooked
    q/k norm down the unfused path trace, and take the fused path where nothing is hooked."""
    gen = make_generator()
    model = _model(kind, seed=gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    ref, out, ops, seen = compiled_with_kernels(model, kw, mi.inject_mmdit_kernels, mi.remove_mmdit_kernels)
    assert {"head_rms_norm_rope", "layer_norm_fused"} <= ops, sorted(seen)
    assert rel_max(out, ref) <= FP32_REL, f"seed {gen.seed_value}"


# --------------------------------------------------------------------------------------------
# Real architectures on the meta device (no memory, no interpreter)
# --------------------------------------------------------------------------------------------
REAL_COUNTS = {
    "sd3.5-medium": {
        "mmdit_adaln_zero": 34,
        "mmdit_adaln_zero_x": 13,
        "mmdit_adaln_zero_single": 0,
        "mmdit_adaln_continuous": 2,
        "mmdit_fused_blocks": 24,
        "mmdit_qk_norm_fused": 37,
        "mmdit_qk_norm_rope_fused": 0,
        "mmdit_gelu_tanh": 47,
    },
    "sd3-medium": {
        "mmdit_adaln_zero": 47,
        "mmdit_adaln_zero_x": 0,
        "mmdit_adaln_zero_single": 0,
        "mmdit_adaln_continuous": 2,
        "mmdit_fused_blocks": 24,
        "mmdit_qk_norm_fused": 0,
        "mmdit_qk_norm_rope_fused": 0,
        "mmdit_gelu_tanh": 47,
    },
    "flux.1-dev": {
        "mmdit_adaln_zero": 38,
        "mmdit_adaln_zero_x": 0,
        "mmdit_adaln_zero_single": 38,
        "mmdit_adaln_continuous": 1,
        "mmdit_fused_blocks": 57,
        "mmdit_qk_norm_fused": 0,
        "mmdit_qk_norm_rope_fused": 57,
        "mmdit_gelu_tanh": 76,
    },
}


@pytest.mark.parametrize("name", list(REAL_COUNTS))
def test_real_architecture_counts(name):
    if name == "flux.1-dev":
        model = mi.build_flux_transformer("real", device="meta")
        assert model.inner_dim == 3072 and model.config.guidance_embeds
    else:
        model = mi.build_sd3_transformer("real", device="meta", variant=name)
        assert model.inner_dim == 1536
    params = sum(p.numel() for p in model.parameters())
    assert params == {"sd3.5-medium": 2_243_171_520, "sd3-medium": 2_028_328_000, "flux.1-dev": 11_901_408_320}[name]
    assert mi.inject_mmdit_kernels(model, verbose=False) == REAL_COUNTS[name]
    assert mi.remove_mmdit_kernels(model, verbose=False) == REAL_COUNTS[name]
    _no_injection_left(model)


def test_make_inputs_at_1024():
    """The token counts at 1024x1024: SD3 (128 / 2)^2 = 4096 image tokens + 333 text tokens; FLUX 4096 + 512."""
    sd3 = mi.build_sd3_transformer("real", device="meta")
    kw = mi.make_mmdit_inputs(sd3, batch=2, device="meta")
    assert kw["hidden_states"].shape == (2, 16, 128, 128) and kw["encoder_hidden_states"].shape == (2, 333, 4096)
    assert kw["pooled_projections"].shape == (2, 2048) and kw["timestep"].shape == (2,)
    flux = mi.build_flux_transformer("real", device="meta")
    kw = mi.make_mmdit_inputs(flux, device="meta")
    assert kw["hidden_states"].shape == (1, 4096, 64) and kw["encoder_hidden_states"].shape == (1, 512, 4096)
    assert kw["img_ids"].shape == (4096, 3) and kw["txt_ids"].shape == (512, 3) and kw["guidance"].shape == (1,)
    with pytest.raises(ValueError, match="multiples of 16"):
        mi.make_mmdit_inputs(flux, height=1000, device="meta")
    with pytest.raises(TypeError, match="SD3Transformer2DModel or a FluxTransformer2DModel"):
        mi.make_mmdit_inputs(torch.nn.Linear(2, 2), device="meta")
    with pytest.raises(ValueError, match="unknown SD3 variant"):
        mi.build_sd3_transformer("real", device="meta", variant="sd4")


# --------------------------------------------------------------------------------------------
# Dispatch from diffusers_injection, other models, the command line
# --------------------------------------------------------------------------------------------
def test_dispatch_from_inject_optimized_kernels(kernel_calls):
    """inject_optimized_kernels on an object with a FLUX transformer (a pipeline-like .components)
    injects the MMDiT kernels and reports their kinds next to the LTX kinds; removal restores it."""
    gen = make_generator()
    model = _model("flux", seed=gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    ref = run_model(model, kw)

    class Pipe:
        components = {"transformer": model, "scheduler": object()}

    counts = di.inject_optimized_kernels(Pipe(), verbose=False)
    assert {k: counts[k] for k in mi.KINDS} == EXPECTED_TINY["flux"]
    assert all(counts[k] == 0 for k in di.KINDS)
    assert di.injected_counts(Pipe()) == counts
    assert rel_max(run_model(model, kw), ref) <= FP32_REL and kernel_calls["joint_head_rms_norm_rope"] == 2
    assert di.remove_optimized_kernels(Pipe(), verbose=False) == counts
    assert_unpatched_again(model, kw, ref, _no_injection_left)
    assert set(di.injected_counts(model).values()) == {0}


def test_non_mmdit_model_untouched():
    model = di.build_tiny_ltx_pipeline(num_layers=1).transformer
    assert mi.inject_mmdit_kernels(model, verbose=False) == {k: 0 for k in mi.KINDS}
    _no_injection_left(model)
    with pytest.raises(TypeError, match="diffusers pipeline or a torch.nn.Module"):
        mi.inject_mmdit_kernels(object(), verbose=False)


def test_command_line(capsys):
    assert mi._main([]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and {k: v["injected"] for k, v in report["models"].items()} == REAL_COUNTS
    with pytest.raises(SystemExit) as exc:
        mi._main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "usage" in out and "qk_norm_rope_fused=57" in out


# --------------------------------------------------------------------------------------------
# Training edge cases: gradient checkpointing, trainable weights inside blocks, in-place changes
# --------------------------------------------------------------------------------------------
def _model_with_blocks(kind, seed):
    """The tiny models, FLUX with two double blocks (the cross-block hand-over needs two)."""
    if kind == "sd3":
        return _model(kind, seed=seed)
    cfg = dict(mi.FLUX_CONFIGS["tiny"], num_layers=2)
    return mi._build(mi.FluxTransformer2DModel, cfg, torch.float32, DEVICE, seed)


def _all_grads(model, kw):
    model.zero_grad(set_to_none=True)
    out = model(**kw)[0]
    out.square().mean().backward()
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_gradient_checkpointing_matches_without_it(kind, gen):
    """diffusers' gradient-checkpointing equivalence, with the kernels injected: checkpointing recomputes
    each block in backward, which must take the path the first run took (no hand-over of a norm to the
    next block while autograd records), and the gradients must equal those without checkpointing."""
    model = _model_with_blocks(kind, gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    model.train()
    ref = _all_grads(model, kw)
    mi.inject_mmdit_kernels(model, verbose=False)
    try:
        plain = _all_grads(model, kw)
        model.enable_gradient_checkpointing()
        ckpt = _all_grads(model, kw)
    finally:
        mi.remove_mmdit_kernels(model, verbose=False)
    for name, g in ref.items():
        for got, what in ((plain, "injected"), (ckpt, "injected + checkpointing")):
            assert (got[name] is None) == (g is None), f"{what}: {name}"
            if g is not None:
                torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=f"{what}: {name}")


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_trainable_weight_inside_a_block_gets_its_gradient(kind, gen):
    """LoRA-style: everything frozen but one projection inside block 0's attention."""
    model = _model_with_blocks(kind, gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    model.requires_grad_(False)
    name = "transformer_blocks.0.attn.to_v.weight"
    model.get_parameter(name).requires_grad_(True)
    ref = _all_grads(model, kw)[name]
    mi.inject_mmdit_kernels(model, verbose=False)
    try:
        got = _all_grads(model, kw)[name]
    finally:
        mi.remove_mmdit_kernels(model, verbose=False)
    assert got is not None
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_carry_ignored_after_an_in_place_change_between_blocks(kind, gen):
    """A forward hook on block 0 changes its output in place: block 1 must not use the norm block 0
    computed from the old values."""
    model = _model_with_blocks(kind, gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    b0 = model.transformer_blocks[0]

    def post(module, args, output):
        for t in output if isinstance(output, tuple) else (output,):
            if isinstance(t, torch.Tensor):
                t.add_(0.5 * t.flip(-1))

    ref, got, _ = without_and_with_kernels(
        model, kw, mi.inject_mmdit_kernels, mi.remove_mmdit_kernels, [b0.register_forward_hook(post)]
    )
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_hook_on_a_block_layernorm_still_runs(kind, gen):
    """The fused residual + LayerNorm + modulation does not call the block's norm2: where norm2 has a
    hook, the block must call it as the original does."""
    model = _model_with_blocks(kind, gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    norm = model.transformer_blocks[0].norm2
    ref, got = hooked_norm_outputs(norm, model, kw, mi.inject_mmdit_kernels, mi.remove_mmdit_kernels)
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("kind", ["sd3", "flux"])
@pytest.mark.parametrize(
    "where", ["attn", "ff", "ff_proj", "single_attn", "norm_q", "norm_added_k", "single_norm_k", "global"]
)
def test_hooks_on_submodules_still_run(kind, where, gen):
    """The patched blocks call attention processors and feed-forward layers without Module.__call__
    only where nothing hooks them: a forward hook on any of them (or a global one) must still run. The
    q/k norms too: the fused q/k norm (+ RoPE) kernel calls no norm module, so a hooked norm sends its
    attention down the unfused path (the hook ran 0 times before)."""
    model = _model_with_blocks(kind, gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    blk = model.transformer_blocks[0]
    single = getattr(model, "single_transformer_blocks", None)
    target = {
        "attn": blk.attn,
        "ff": blk.ff,
        "ff_proj": blk.ff.net[2],
        "single_attn": single[0].attn if single else blk.attn,
        "norm_q": blk.attn.norm_q,
        "norm_added_k": blk.attn.norm_added_k,
        "single_norm_k": single[0].attn.norm_k if single else blk.attn.norm_k,
    }.get(where)
    fired = []

    def hook(module, args, output):
        fired.append(1)
        return output * 1.5 if isinstance(output, torch.Tensor) else output

    if target is None:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: hook(m, a, o) if m is blk.ff.net[2] else None
        )
    else:
        handle = target.register_forward_hook(hook)
    ref, got, n_ref = without_and_with_kernels(
        model, kw, mi.inject_mmdit_kernels, mi.remove_mmdit_kernels, [handle], fired
    )
    assert len(fired) == n_ref > 0
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_hook_on_the_next_block_norm1_still_runs(kind, gen):
    """Block 0 may compute block 1's norm1 with its own last residual; not where block 1's norm1 has a
    hook, which must run and may change the output."""
    model = _model_with_blocks(kind, gen.seed_value % 1000)
    kw = _inputs(model, seed=gen.seed_value)
    fired = []

    def hook(m, a, o):
        fired.append(1)
        return (o[0] * 1.5,) + tuple(o[1:])

    handle = model.transformer_blocks[1].norm1.register_forward_hook(hook)
    ref, got, n_ref = without_and_with_kernels(
        model, kw, mi.inject_mmdit_kernels, mi.remove_mmdit_kernels, [handle], fired
    )
    assert len(fired) == n_ref == 1
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"

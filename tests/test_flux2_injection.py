# SPDX-License-Identifier: Apache-2.0
"""The FLUX.2 family (scripts/flux2_injection.py) on a tiny Flux2Transformer2DModel with the inputs Flux2Pipeline
builds: parity with the stock model (fp32, bf16), the fused kernels really called, the counts, removal bit for
bit, hooks, subclasses and other processors (the KV-cache ones) left to the original code, torch.compile,
autograd, fp16 clipping and fp8=True."""

import json
from collections import Counter

import pytest
import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2Modulation,
    Flux2ParallelSelfAttnProcessor,
    Flux2SingleTransformerBlock,
    Flux2Transformer2DModel,
    Flux2TransformerBlock,
)

import activations
import diffusers_injection as di
import flux2_injection as f2
import fp8_linear
import generic_injection as gi
import head_norm_rope
import injection_common as ic
import layernorm
import mmdit_injection as mi
import rmsnorm
import rope
from kernel_testing import (
    DEVICE,
    assert_bf16_parity,
    assert_compiles_stock,
    block_kernel_calls,
    make_generator,
    rel_l2,
    rel_max,
    run_compiled_fullgraph,
    run_model,
    without_and_with_kernels,
)

FP32_REL = 1e-5  # one rounding per fused step and another summation order: a few fp32 ulps
# 1 double + 1 single block, 2 heads of 16, RoPE axes 4 + 4 + 4 + 4 (T, H, W, L as the pipeline's ids)
TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=True,
)
EXPECTED = {
    "flux2_double_blocks": 1,
    "flux2_single_blocks": 1,
    "flux2_attention": 1,
    "flux2_parallel_attention": 1,
    "flux2_swiglu": 3,  # ff, ff_context, the single block's MLP half
}
# the generic layer underneath: 5 LayerNorms, 6 q/k RMSNorms, norm_out's AdaLayerNormContinuous
GENERIC = {"generic_layernorm": 5, "generic_rmsnorm": 6, "generic_adaln": 1}
# one forward: norm1, norm1_context, the single block's norm, norm_out; residual + norm2 of both streams; the
# feed-forwards' residuals and the single block's; q/k of the double and the single block; 3 SwiGLUs. The
# unfused kernels (plain norms, RoPE) run not at all.
CALLS = {
    "layer_norm_modulate": 4,
    "gated_residual_layer_norm_modulate": 2,
    "gated_residual_add": 3,
    "joint_head_rms_norm_rope": 2,
    "swiglu": 3,
}


@pytest.fixture
def kernel_calls(monkeypatch):
    return block_kernel_calls(
        monkeypatch,
        (head_norm_rope, "joint_head_rms_norm_rope"),
        (activations, "swiglu"),
        (layernorm, "layer_norm"),
        (rmsnorm, "rms_norm"),
        (rope, "rope_interleaved"),
    )


def _model(seed, dtype=torch.float32, **cfg):
    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(**{**TINY, **cfg})
    with torch.no_grad():  # trained q/k norms have non-unit weights; unit ones would hide a swapped weight
        for m in model.modules():
            if isinstance(m, torch.nn.RMSNorm) and m.weight is not None:
                m.weight.normal_(1.0, 0.1)
            elif isinstance(m, Flux2Modulation):  # shift / scale / gate of order 0.5, not 0.04 as initialised
                m.linear.weight.mul_(12)
    return torch.nn.Module.to(model, DEVICE, dtype).eval()


def _inputs(model, seed, dtype=torch.float32, batch=2, height=4, width=4, text_len=7):
    """As Flux2Pipeline builds them: packed latents [B, H * W, C] (a permuted view of [B, C, H, W]), position ids
    [B, S, 4] (T, H, W, L) from cartesian products, the prompt embeddings, timestep t / 1000 and guidance."""
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, model.config.in_channels, height, width, generator=g)
    packed = latents.reshape(batch, -1, height * width).permute(0, 2, 1)
    one, ar = torch.arange(1), torch.arange
    img_ids = torch.cartesian_prod(one, ar(height), ar(width), one).unsqueeze(0).expand(batch, -1, -1)
    txt_ids = torch.stack([torch.cartesian_prod(one, one, one, ar(text_len))] * batch)
    t = torch.rand(batch, generator=g) * 1000
    return dict(
        hidden_states=packed.to(DEVICE, dtype),
        encoder_hidden_states=torch.randn(batch, text_len, model.config.joint_attention_dim, generator=g).to(
            DEVICE, dtype
        ),
        timestep=(t.to(dtype) / 1000).to(DEVICE),
        img_ids=img_ids.to(DEVICE),
        txt_ids=txt_ids.to(DEVICE),
        guidance=torch.full((batch,), 4.0, device=DEVICE),
        return_dict=False,
    )


def _case(dtype=torch.float32, **cfg):
    gen = make_generator()
    model = _model(gen.seed_value % 1000, dtype, **cfg)
    return model, _inputs(model, gen.seed_value, dtype), gen.seed_value


def _nothing_left(model):
    for m in model.modules():
        assert ic.bundle_state(m) is None and "forward" not in m.__dict__, type(m).__name__
        assert type(getattr(m, "processor", None)) not in f2._FUSED_PROCESSORS


# --------------------------------------------------------------------------------------------
# Parity, kernels, counts, removal
# --------------------------------------------------------------------------------------------
def test_fp32_parity_fused_kernels_counts_and_exact_removal(kernel_calls):
    model, kw, seed = _case()
    ref = run_model(model, kw)
    counts = di.inject_optimized_kernels(model, verbose=False)
    assert {k: counts[k] for k in f2.KINDS} == EXPECTED
    assert {k: counts[k] for k in GENERIC} == GENERIC
    assert di.injected_counts(model) == counts and f2.injected_counts(model) == EXPECTED
    out = run_model(model, kw)
    assert dict(kernel_calls) == CALLS
    assert torch.isfinite(out).all()
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {seed})"
    restored = di.remove_optimized_kernels(model, verbose=False)
    assert {k: restored[k] for k in f2.KINDS} == EXPECTED
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)


def test_family_api_twice_and_once_removed(kernel_calls):
    """inject twice: the same counts, nothing wrapped twice, the same output; remove once: the stock model."""
    model, kw, _ = _case()
    ref = run_model(model, kw)
    assert f2.inject(model, verbose=False) == EXPECTED
    once = run_model(model, kw)
    assert f2.inject(model, verbose=False) == EXPECTED
    assert all(s["prev"] is None for m in model.modules() if (s := m.__dict__.get(f2.STATE)) and "patched" in s)
    assert torch.equal(run_model(model, kw), once)
    assert f2.remove(model, verbose=False) == EXPECTED
    _nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)
    assert f2.remove(model, verbose=False) == dict.fromkeys(f2.KINDS, 0)
    other = torch.nn.Sequential(torch.nn.LayerNorm(8))
    assert f2.find_models(other) == [] and f2.inject(other, verbose=False) == dict.fromkeys(f2.KINDS, 0)
    _nothing_left(other)


def test_fused_qkv_projections(kernel_calls):
    """model.fuse_qkv_projections(): the double blocks' q/k/v are chunks of one projection, read in place."""
    model, kw, seed = _case()
    model.fuse_qkv_projections()
    ref = run_model(model, kw)
    f2.inject(model, verbose=False)
    out = run_model(model, kw)
    f2.remove(model, verbose=False)
    assert kernel_calls["joint_head_rms_norm_rope"] == 2
    assert rel_max(out, ref) <= FP32_REL, f"seed {seed}"


def test_bf16_parity():
    """bf16: no further from the fp32 run than 1.5x the stock model, within 2^-5 of it, removal bit for bit."""
    model, kw32, seed = _case()
    ref32 = run_model(model, kw32).double()
    torch.nn.Module.to(model, torch.bfloat16)
    kw = _inputs(model, seed, torch.bfloat16)
    assert_bf16_parity(model, kw, ref32, di.inject_optimized_kernels, di.remove_optimized_kernels, seed)


# --------------------------------------------------------------------------------------------
# What steps aside: hooks, subclasses, other processors, per-token modulation, autograd
# --------------------------------------------------------------------------------------------
_HOOKED = {
    "norm_q": lambda m: m.transformer_blocks[0].attn.norm_q,
    "norm_added_k": lambda m: m.transformer_blocks[0].attn.norm_added_k,
    "single_norm_k": lambda m: m.single_transformer_blocks[0].attn.norm_k,
    "norm1": lambda m: m.transformer_blocks[0].norm1,
    "norm2_context": lambda m: m.transformer_blocks[0].norm2_context,
    "single_norm": lambda m: m.single_transformer_blocks[0].norm,
    "attn": lambda m: m.transformer_blocks[0].attn,
    "ff": lambda m: m.transformer_blocks[0].ff_context,
    "ff_act": lambda m: m.transformer_blocks[0].ff.act_fn,
    "single_attn": lambda m: m.single_transformer_blocks[0].attn,
    "single_mlp_act": lambda m: m.single_transformer_blocks[0].attn.mlp_act_fn,
    "block": lambda m: m.transformer_blocks[0],
    "single_block": lambda m: m.single_transformer_blocks[0],
}


@pytest.mark.parametrize("where", list(_HOOKED))
def test_a_hook_runs_and_changes_the_output_as_in_stock(where):
    """A forward hook scaling a module's output: the fused path calls that module (a hooked q/k norm sends its
    attention down the unfused sequence), the hook runs as often as in the stock model, the output matches."""
    model, kw, seed = _case()
    fired = []

    def hook(module, args, out):
        fired.append(1)
        if isinstance(out, tuple):
            return tuple(o * 1.5 for o in out)
        return out * 1.5

    handle = _HOOKED[where](model).register_forward_hook(hook)
    ref, got, n_ref = without_and_with_kernels(
        model, kw, di.inject_optimized_kernels, di.remove_optimized_kernels, [handle], fired
    )
    assert len(fired) == n_ref > 0
    assert rel_max(got, ref) <= FP32_REL, f"{where}: rel max diff {rel_max(got, ref):.3e} (seed {seed})"


class _ScaledBlock(Flux2TransformerBlock):
    def forward(self, *args, **kwargs):
        enc, h = super().forward(*args, **kwargs)
        return enc * 0.5, h


class _ScaledSingleBlock(Flux2SingleTransformerBlock):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 0.5


def test_subclasses_with_their_own_forward_are_left_alone(kernel_calls):
    model, kw, seed = _case()
    model.transformer_blocks[0].__class__ = _ScaledBlock
    model.single_transformer_blocks[0].__class__ = _ScaledSingleBlock
    ref = run_model(model, kw)
    counts = f2.inject(model, verbose=False)
    assert counts["flux2_double_blocks"] == counts["flux2_single_blocks"] == 0
    out = run_model(model, kw)
    f2.remove(model, verbose=False)
    assert kernel_calls["layer_norm_modulate"] == 1 and kernel_calls["gated_residual_add"] == 0  # norm_out only
    assert kernel_calls["layer_norm"] == 5  # the blocks' own norms, through the generic layer
    assert rel_max(out, ref) <= FP32_REL, f"seed {seed}"


class _MyParallelProcessor(Flux2ParallelSelfAttnProcessor):
    pass


def test_other_processors_are_left_in_place(kernel_calls):
    """A user's processor and the KV-cache one are not replaced (nor put back over at removal); the blocks
    around them still fuse."""
    model, kw, seed = _case()
    double, single = model.transformer_blocks[0].attn, model.single_transformer_blocks[0].attn
    double.set_processor(Flux2KVAttnProcessor())
    single.set_processor(_MyParallelProcessor())
    ref = run_model(model, kw)
    counts = f2.inject(model, verbose=False)
    assert counts["flux2_attention"] == counts["flux2_parallel_attention"] == 0 and counts["flux2_double_blocks"] == 1
    out = run_model(model, kw)
    f2.remove(model, verbose=False)
    assert type(double.processor) is Flux2KVAttnProcessor and type(single.processor) is _MyParallelProcessor
    assert kernel_calls["joint_head_rms_norm_rope"] == 0 and kernel_calls["gated_residual_layer_norm_modulate"] == 2
    assert rel_max(out, ref) <= FP32_REL, f"seed {seed}"


def test_backend_and_parallel_config_follow_the_processor():
    model, _, _ = _case()
    attn = model.transformer_blocks[0].attn
    attn.processor._attention_backend = "native"
    f2.inject(model, verbose=False)
    assert type(attn.processor) is f2.Flux2FusedAttnProcessor and attn.processor._attention_backend == "native"
    single = model.single_transformer_blocks[0].attn
    single.processor._parallel_config = marker = object()  # as enable_parallelism sets it after injection
    f2.remove(model, verbose=False)
    assert attn.processor._attention_backend == "native" and single.processor._parallel_config is marker


def test_kv_cache_extract_and_cached_steps_match_stock(kernel_calls):
    """FLUX.2 Klein KV: the pipeline sets the KV processors (here after injection, as it does per call); the
    extract step blends per-token modulation for the reference tokens (the blocks run the original code), the
    cached steps fuse the blocks around the KV processors."""
    model, kw, seed = _case()
    ref_tokens = 4
    extract = dict(kw, hidden_states=torch.cat([kw["hidden_states"][:, :ref_tokens], kw["hidden_states"]], dim=1))
    extract["img_ids"] = torch.cat(
        [kw["img_ids"][:, :ref_tokens] + torch.tensor([10, 0, 0, 0], device=kw["img_ids"].device), kw["img_ids"]], dim=1
    )

    def run(kernels):
        if kernels:
            f2.inject(model, verbose=False)
        for blk in model.transformer_blocks:
            blk.attn.set_processor(Flux2KVAttnProcessor())
        for blk in model.single_transformer_blocks:
            blk.attn.set_processor(Flux2KVParallelSelfAttnProcessor())
        with torch.no_grad():
            out0, cache = model(**extract, kv_cache_mode="extract", num_ref_tokens=ref_tokens)
            calls_extract = dict(kernel_calls)
            out1 = model(**kw, kv_cache=cache, kv_cache_mode="cached")[0]
        f2.remove(model, verbose=False)
        return out0, out1, calls_extract

    ref0, ref1, _ = run(False)
    kernel_calls.clear()
    got0, got1, calls_extract = run(True)
    assert calls_extract["layer_norm_modulate"] == 1 and "gated_residual_add" not in calls_extract  # norm_out only
    assert kernel_calls["gated_residual_layer_norm_modulate"] == 2 and kernel_calls["gated_residual_add"] == 3
    assert rel_max(got0, ref0) <= FP32_REL and rel_max(got1, ref1) <= FP32_REL, f"seed {seed}"


@pytest.mark.parametrize("trainable", ["all", "one_inside"])
def test_autograd_runs_the_original_code(trainable, kernel_calls):
    """The kernels have no backward: with gradients wanted (the whole model, or LoRA-style one weight inside a
    block, the block's inputs needing none) the blocks run the original code and the gradients are the stock
    ones."""
    model, kw, seed = _case()
    name = "transformer_blocks.0.attn.to_v.weight"
    if trainable == "one_inside":
        model.requires_grad_(False)
        model.get_parameter(name).requires_grad_(True)
    ref = model(**kw)[0]
    ref.square().mean().backward()
    ref_grad, model.get_parameter(name).grad = model.get_parameter(name).grad, None
    f2.inject(model, verbose=False)
    try:
        out = model(**kw)[0]
        if trainable == "all":
            assert sum(kernel_calls.values()) == 0
        else:  # the blocks run the original code (their q/k norms and LayerNorms, needing no gradient, kernels)
            assert kernel_calls["layer_norm_modulate"] == kernel_calls["gated_residual_layer_norm_modulate"] == 0
        out.square().mean().backward()
    finally:
        f2.remove(model, verbose=False)
    assert rel_max(out, ref) <= FP32_REL, f"seed {seed}"
    torch.testing.assert_close(model.get_parameter(name).grad, ref_grad, rtol=1e-4, atol=1e-6)


def test_fp16_clipping_is_kept(kernel_calls):
    """fp16: diffusers clips the text stream after a double block and the stream after a single block to
    +-65504; the fused residual overflows to inf, then is clipped the same way."""
    gen = make_generator()
    model = _model(gen.seed_value % 1000, torch.float16)
    double, single = model.transformer_blocks[0], model.single_transformer_blocks[0]
    h = torch.randn(2, 5, 32, generator=gen).to(DEVICE, torch.float16)
    c = (torch.randn(2, 3, 32, generator=gen).sign() * 65504).to(DEVICE, torch.float16)  # the text stream at fp16's max
    # shift, scale, gate (per set): no modulation, gate_msa 0 (the attention residual keeps c), a last gate of 100
    mod2 = torch.zeros(2, 1, 6, 32, dtype=torch.float16, device=DEVICE)
    mod2[:, :, 5] = 100
    mod2 = mod2.flatten(2)
    mod1 = torch.zeros(2, 1, 3, 32, dtype=torch.float16, device=DEVICE)
    mod1[:, :, 2] = 100
    mod1 = mod1.flatten(2)
    with torch.no_grad():
        ref_d = double(h, c, mod2, mod2)
        ref_s = single(torch.cat([c, h], dim=1), None, mod1)
        f2.inject(model, verbose=False)
        got_d = double(h, c, mod2, mod2)
        got_s = single(torch.cat([c, h], dim=1), None, mod1)
    f2.remove(model, verbose=False)
    assert kernel_calls["gated_residual_add"] == 3 and kernel_calls["layer_norm_modulate"] == 3  # the fused path ran
    assert ref_d[0].abs().max() == ref_s.abs().max() == 65504  # the case clips, finite
    assert torch.isfinite(ref_d[0]).all() and torch.isfinite(ref_s).all()
    for got, ref in ((got_d[0], ref_d[0]), (got_s, ref_s)):
        assert torch.isfinite(got).all() and got.abs().max() == 65504
        assert rel_l2(got, ref) <= 2.0**-8


# --------------------------------------------------------------------------------------------
# torch.compile, FP8, the command line
# --------------------------------------------------------------------------------------------
def test_torch_compile_traces_the_stock_model():
    """FLUX.2 is marked stock under torch.compile (Inductor's own fusions were faster than the kernels'): with the
    kernels injected, compile traces the stock model's graph, no kernel op in it, and gives its output bit for
    bit (the eager kernels: the other tests)."""
    model, kw, seed = _case()
    assert_compiles_stock(model, kw, f2.inject, f2.remove)


def test_torch_compile_traces_the_stock_model_with_a_backend_set_after_injection():
    """set_attention_backend after injection sets the backend on the fused processors only: traced, the stock
    processors run with it (they ran the kernels: the fused processors were kept when the settings differed)."""
    model, kw, seed = _case()

    def inject(m, verbose):
        f2.inject(m, verbose=verbose)
        m.set_attention_backend("native")

    assert_compiles_stock(model, kw, inject, f2.remove)


@pytest.mark.parametrize("case", ["deepcopy", "pickled", "gone", "generic_again"])
def test_torch_compile_traces_the_stock_model_after(case):
    """The RoPE dispatcher runs diffusers' function under compile while only marked models hold it, also after a
    copy of the marked model took a hold (deepcopy, pickle), after an unmarked holder went away without removal,
    and after the generic layer alone was removed and injected again (its new records marked too)."""
    import copy
    import gc
    import pickle

    model, kw, seed = _case()
    ref, _, _ = run_compiled_fullgraph(model, kw)
    f2.inject(model, verbose=False)
    keep = []
    try:
        if case == "deepcopy":
            keep.append(copy.deepcopy(model))
        elif case == "pickled":
            keep.append(pickle.loads(pickle.dumps(model)))
        elif case == "gone":
            flux1 = mi.build_flux_transformer("tiny", dtype=torch.float32, device=DEVICE, seed=seed % 1000)
            gi.inject_generic_kernels(flux1, verbose=False)
            assert not gi._ROPE_STOCK_UNDER_COMPILE[0]
            del flux1
            gc.collect()
        else:
            gi.remove_generic_kernels(model, verbose=False)
            gi.inject_generic_kernels(model, verbose=False)
        out, ops, seen = run_compiled_fullgraph(model, kw)
        assert not ops and torch.equal(out, ref), sorted(ops)
    finally:
        for m in (model, *keep):
            f2.remove(m, verbose=False)


def test_stock_under_compile_only_where_it_computes_the_same(monkeypatch):
    """The mark applies while torch.compile traces, not in eager calls; a backend set on the fused processor after
    injection is given to the stock one it replaced before that runs (as removal gives it);
    the RoPE dispatcher runs diffusers' function only while every model holding it is marked (an unmarked FLUX.1
    model of another file injected beside it: the kernels), and removal drops the mark."""
    model, kw, seed = _case()
    flux1 = mi.build_flux_transformer("tiny", dtype=torch.float32, device=DEVICE, seed=seed % 1000)
    f2.inject(model, verbose=False)
    try:
        attn = next(m for m in model.modules() if type(m.__dict__.get("processor")) is f2.Flux2FusedAttnProcessor)
        block = next(m for m in model.modules() if isinstance(m, Flux2TransformerBlock))
        assert not ic.stock_under_compile(block) and ic.stock_processor(attn, attn.processor) is None
        assert gi._ROPE_STOCK_UNDER_COMPILE[0]
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            assert ic.stock_under_compile(block)
            assert ic.stock_processor(attn, attn.processor) is ic.bundle_state(attn)["prev"]
            attn.processor._attention_backend = "flash"  # set after injection: the stock one gets it too
            assert ic.stock_processor(attn, attn.processor)._attention_backend == "flash"
        gi.inject_generic_kernels(flux1, verbose=False)
        assert not gi._ROPE_STOCK_UNDER_COMPILE[0]
        gi.remove_generic_kernels(flux1, verbose=False)
        assert gi._ROPE_STOCK_UNDER_COMPILE[0]
    finally:
        gi.remove_generic_kernels(flux1, verbose=False)
        f2.remove(model, verbose=False)
    assert not gi._ROPE_STOCK_UNDER_COMPILE[0] and gi._MODEL_MARK not in model.__dict__
    gi.inject_generic_kernels(model, verbose=False)  # the generic layer alone marks nothing
    try:
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            assert not any(ic.stock_under_compile(x) for x in model.modules() if ic.bundle_state(x) is not None)
    finally:
        gi.remove_generic_kernels(model, verbose=False)


def test_fp8_true(monkeypatch):
    """fp8=True in bf16: the block linear layers become FP8 (14 here), the feed-forwards' SwiGLU writes
    linear_out's FP8 input (per-token scales, quantised from fp32): within a few FP8 roundings of the FP8 model
    with that path off (linear_out quantising the bf16 SwiGLU output itself; about 1e-2 relative L2, a
    wrong SwiGLU 0.2), within FP8's error of the bf16 kernels' output; removal gives back the stock model."""
    model, kw, seed = _case(torch.bfloat16)
    stock = run_model(model, kw)
    di.inject_optimized_kernels(model, verbose=False)
    bf16 = run_model(model, kw)
    di.remove_optimized_kernels(model, verbose=False)
    fp8_calls = []
    swiglu = activations.swiglu
    monkeypatch.setattr(activations, "swiglu", lambda *a, **k: fp8_calls.append(k.get("fp8")) or swiglu(*a, **k))
    counts = di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        assert counts["fp8_linear"] == 14 and {k: counts[k] for k in f2.KINDS} == EXPECTED
        out = run_model(model, kw)
        assert Counter(fp8_calls) == {"per_token": 2, None: 1}  # ff, ff_context; the single block's MLP half
        with monkeypatch.context() as m:
            m.setattr(fp8_linear, "direct_fp8_format", lambda layers: None)
            unfused = run_model(model, kw)
    finally:
        di.remove_optimized_kernels(model, verbose=False)
    assert torch.isfinite(out).all() and rel_l2(out, unfused) < 2.0**-5, f"seed {seed}"
    assert 1e-3 < rel_l2(out, bf16) < 0.15, f"seed {seed}"
    assert torch.equal(run_model(model, kw), stock)


def test_command_line(capsys):
    assert f2._main([]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["flux.2-dev"] == {
        "flux2_double_blocks": 8,
        "flux2_single_blocks": 48,
        "flux2_attention": 8,
        "flux2_parallel_attention": 48,
        "flux2_swiglu": 64,
    }

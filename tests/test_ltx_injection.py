# SPDX-License-Identifier: Apache-2.0
"""inject_optimized_kernels / remove_optimized_kernels on diffusers' LTX-Video: parity with the
unpatched model (tiny random transformer, VAE and full pipeline), counts on the real architecture,
exact restoration, idempotence, non-LTX models left alone, accelerate offload, torch.compile, and
the example script. Runs on the CPU through Triton's interpreter (tiny shapes) or on a GPU."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLLTXVideo, LTXVideoTransformer3DModel
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor

import activations
import diffusers_injection as di
import generic_injection as gi
import injection_common as ic
import qk_norm_rope
import rmsnorm
from kernel_testing import (
    DEVICE,
    assert_bf16_parity,
    assert_injecting_twice_is_harmless,
    assert_unpatched_again,
    count_calls,
    hooked_norm_outputs,
    ltx_inputs,
    make_generator,
    rel_max,
    run_model,
    with_interpreter_speedup,
    without_and_with_kernels,
)

ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available()

# fp32: the fused kernels do the same math with one rounding per fused step and another summation
# order, a few fp32 ulps per op; through 2 blocks (and 2 denoising steps) that stays far below 1e-4
# of the output's magnitude.
FP32_REL = 1e-4


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts calls of the leaf kernels the integration uses (proves the kernels, not torch, ran)."""
    return count_calls(
        monkeypatch,
        (
            (rmsnorm, "rms_norm"),
            (rmsnorm, "rms_norm_modulate"),
            (rmsnorm, "gated_residual_rms_norm_modulate"),
            (qk_norm_rope, "ltx_qk_rmsnorm_rope"),
            (qk_norm_rope, "ltx_qk_rmsnorm_rope_coords"),
            (activations, "gelu_tanh"),
        ),
    )


def _tiny_transformer(num_layers=2):
    return di.build_tiny_ltx_pipeline(num_layers=num_layers).transformer.to(DEVICE)


# The inputs of the tests of what runs where (hooks, carries, fallbacks, gradients, compile): 2 x 4 x 8 latent
# tokens a sample, 128 rows where ltx_inputs' default 3 x 8 x 8 gives 384, so that every kernel still runs several
# programs (the norms 8 of 16 rows, the q/k norm + RoPE 2 of 64, the GELU 16), at a third of the interpreter's
# time; the same 16 text tokens, the last prompt padded. The parity tests keep the default size.
SMALL = dict(frames=2, height=4, width=8)


def _tiny_case(num_layers=2, size=SMALL):
    """A generator with a fresh seed, the tiny transformer and its inputs drawn from that generator."""
    gen = make_generator()
    tr = _tiny_transformer(num_layers)
    return gen, tr, ltx_inputs(gen, **size)


def _transformer_counts(blocks):
    """The injection's counts for an LTX-Video transformer of that many blocks: per block two weightless
    RMSNorms (norm1, norm2), four weighted ones (q/k norms of both attentions), the fused block, q/k
    norm + RoPE, the cross-attention and a GELU; one RoPE (coords) for the model; no VAE."""
    return {
        "rmsnorm_weightless": 2 * blocks,
        "rmsnorm_weighted": 4 * blocks,
        "adaln_fused_blocks": blocks,
        "qk_norm_rope_fused": blocks,
        "cross_attn": blocks,
        "rope_coords": 1,
        "gelu_tanh": blocks,
        "vae_rmsnorm": 0,
        "fp8_linear": 0,
        "graphs": 0,  # graph mode is off unless asked for
        **{k: 0 for k in gi.KINDS},  # the generic layer leaves a model LTX-Video's family took alone
    }


def _no_injection_left(model):
    for m in model.modules():
        assert di._STATE not in m.__dict__, f"{type(m).__name__} still marked as patched"
        assert "forward" not in m.__dict__ or hasattr(m, "_hf_hook"), f"{type(m).__name__} keeps a patched forward"
        assert type(getattr(m, "processor", None)) is not di.LTXFusedSelfAttnProcessor


# --------------------------------------------------------------------------------------------
# Parity and exact restoration
# --------------------------------------------------------------------------------------------
def test_tiny_transformer_fp32_parity_and_exact_restore(kernel_calls):
    gen, tr, kw = _tiny_case(size={})
    ref = run_model(tr, kw)
    counts = di.inject_optimized_kernels(tr, verbose=False)
    assert counts == _transformer_counts(blocks=2)
    out = run_model(tr, kw)
    # every block used each fused kernel: norm1+mod (block 1's together with block 0's last residual),
    # residual+norm2+mod, q/k norm+RoPE (coords), GELU, and the cross-attention q/k norms went through
    # the RMSNorm kernel
    assert kernel_calls["rms_norm_modulate"] == 1
    assert kernel_calls["gated_residual_rms_norm_modulate"] == 3
    assert kernel_calls["ltx_qk_rmsnorm_rope_coords"] == 2
    assert kernel_calls["gelu_tanh"] == 2
    assert kernel_calls["rms_norm"] == 4
    assert torch.isfinite(out).all()
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"

    assert di.remove_optimized_kernels(tr, verbose=False) == counts
    assert_unpatched_again(tr, kw, ref, _no_injection_left)


def test_last_residual_fused_into_the_next_norm1():
    """Block i's last gated residual and block i+1's norm1 + modulation run as one kernel: with 3 blocks
    only block 0 calls its norm1 itself; parity holds; removal unlinks the blocks."""
    gen, tr, kw = _tiny_case(num_layers=3)
    ref = run_model(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False)
    blocks = list(tr.transformer_blocks)
    assert [ic.next_block(b) is not None for b in blocks] == [True, True, False]
    calls, seen_norm = Counter(), []
    orig = rmsnorm.gated_residual_rms_norm_modulate

    def spy(*a, **k):
        calls["fused"] += 1
        return orig(*a, **k)

    fwd = rmsnorm.rms_norm_modulate

    def spy_norm(*a, **k):
        seen_norm.append(a[0].shape)
        return fwd(*a, **k)

    try:
        rmsnorm.gated_residual_rms_norm_modulate, rmsnorm.rms_norm_modulate = spy, spy_norm
        out = run_model(tr, kw)
    finally:
        rmsnorm.gated_residual_rms_norm_modulate, rmsnorm.rms_norm_modulate = orig, fwd
    assert len(seen_norm) == 1 and calls["fused"] == 3 + 2  # norm2 in 3 blocks + 2 block boundaries
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    assert all(not b.__dict__[di._CARRY] for b in blocks)  # nothing left behind
    di.remove_optimized_kernels(tr, verbose=False)
    assert all(ic.next_block(b) is None and di._CARRY not in b.__dict__ for b in blocks)
    assert torch.equal(run_model(tr, kw), ref)


def test_carry_ignored_when_the_stream_changes_between_blocks():
    """If h changes between two blocks, the next block computes its own norm1: the result equals the
    unpatched block on that input."""
    gen = make_generator()
    tr = _tiny_transformer(num_layers=2)
    b0, b1 = tr.transformer_blocks
    h = torch.randn(2, 16, b0.scale_shift_table.shape[1], generator=gen).to(DEVICE)
    enc = torch.randn(2, 5, b0.scale_shift_table.shape[1], generator=gen).to(DEVICE)
    temb = torch.randn(2, 1, 6 * b0.scale_shift_table.shape[1], generator=gen).to(DEVICE) * 0.3
    with torch.no_grad():
        h0 = b0(h, enc, temb)
        delta = torch.randn(h0.shape, generator=gen).to(h0) * h0.abs().mean()  # changes each row's norm
        ref = b1(h0 + delta, enc, temb)
        di.inject_optimized_kernels(tr, verbose=False)
        ph0 = b0(h, enc, temb)
        assert b1.__dict__[di._CARRY]  # block 0 left block 1's normalised input
        got = b1(ph0 + delta, enc, temb)
        assert not b1.__dict__[di._CARRY]
    assert rel_max(got, ref) <= FP32_REL
    di.remove_optimized_kernels(tr, verbose=False)


def test_tiny_transformer_bf16_parity():
    """bf16: the unpatched model is itself ~2^-8-relative away from its fp32 run (bf16 rounding after
    every op). The kernels round less often (fp32 inside each fused step), so the patched model must
    be no further from fp32 than 1.5x the unpatched distance. The interpreter truncates fp32 -> bf16
    casts instead of rounding, which the 1.5x also absorbs; and patched vs unpatched must stay within
    2^-5 relative L2 (a handful of bf16 ulps), far from a wrong result (relative L2 of order 1)."""
    gen = make_generator()
    tr = _tiny_transformer()
    kw32 = ltx_inputs(gen)
    ref32 = run_model(tr, kw32).double()
    tr.to(torch.bfloat16)
    kw = {
        k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and v.dim() == 3 else v)
        for k, v in kw32.items()
    }
    assert_bf16_parity(tr, kw, ref32, di.inject_optimized_kernels, di.remove_optimized_kernels, gen.seed_value)


def _pipe_latents(pipe, seed=0, steps=2):
    g = torch.Generator(DEVICE).manual_seed(seed)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        "a red fox runs through a snowy forest",
        num_frames=9,
        height=32,
        width=32,
        num_inference_steps=steps,
        generator=g,
        output_type="latent",
        max_sequence_length=16,
    ).frames


def test_tiny_pipeline_parity_and_exact_restore(kernel_calls):
    pipe = di.build_tiny_ltx_pipeline().to(DEVICE)
    ref = _pipe_latents(pipe)
    counts = di.inject_optimized_kernels(pipe, verbose=False)
    assert counts["adaln_fused_blocks"] == 2 and counts["vae_rmsnorm"] > 0
    out = _pipe_latents(pipe)
    assert kernel_calls["ltx_qk_rmsnorm_rope_coords"] == 2 * 2  # 2 blocks x 2 steps (CFG is one batch)
    assert rel_max(out, ref) <= FP32_REL
    di.remove_optimized_kernels(pipe, verbose=False)
    for comp in (pipe.transformer, pipe.vae):
        _no_injection_left(comp)
    assert torch.equal(_pipe_latents(pipe), ref)


def test_vae_rmsnorm_parity_and_layout(kernel_calls):
    """The VAE normalises x.movedim(1, -1) (channel-last view, strided last dim): the result must
    match and keep the layout torch gives it, so the following conv sees the same strides."""
    gen = make_generator()
    vae = di.build_tiny_ltx_pipeline().vae.to(DEVICE)
    z = torch.randn(1, 8, 2, 4, 4, generator=gen).to(DEVICE)
    # cuDNN runs fp32 convolutions in TF32 by default on CUDA: one-ulp differences from the norm
    # can then round a conv input to the other side (1e-3 relative): compare in full fp32
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        ref = vae.decode(z).sample
        n = sum(isinstance(m, DiffusersRMSNorm) for m in vae.modules())
        assert di.inject_optimized_kernels(vae, verbose=False)["vae_rmsnorm"] == n > 0
        out = vae.decode(z).sample
        assert kernel_calls["rms_norm"] > 0
        assert rel_max(out, ref) <= FP32_REL, f"seed {gen.seed_value}"
        norm = next(m for m in vae.modules() if isinstance(m, DiffusersRMSNorm))
        x = torch.randn(1, norm.dim[0], 3, 4, 5, generator=gen).to(DEVICE).movedim(1, -1)
        got, want = norm(x), DiffusersRMSNorm.forward(norm, x)
        assert got.stride() == want.stride() and got.dtype == want.dtype
        assert rel_max(got, want) <= 1e-5
    di.remove_optimized_kernels(vae, verbose=False)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        assert torch.equal(vae.decode(z).sample, ref)


@pytest.mark.parametrize(
    "x_dtype,w_dtype,affine",
    [
        (torch.bfloat16, None, False),
        (torch.float32, None, False),
        (torch.bfloat16, torch.bfloat16, True),
        (torch.float16, torch.float16, True),
        (torch.bfloat16, torch.float32, True),  # diffusers promotes: fp32 output
        (torch.float32, torch.float32, True),
    ],
)
def test_rmsnorm_module_semantics(x_dtype, w_dtype, affine):
    """Each patched RMSNorm returns what the module returns: same dtype, values within rounding."""
    gen = make_generator()
    x = torch.randn(5, 3, 96, generator=gen).to(DEVICE, x_dtype)
    # both round to the output dtype (plus once before the weight for half weights): within 1 ulp
    # natively; the interpreter truncates instead of rounding, up to 2 ulps (eps = 1 ulp at 1.0)
    tol = 1e-5 if x_dtype == torch.float32 else 2 * torch.finfo(x_dtype).eps
    mods = [DiffusersRMSNorm(96, eps=1e-6, elementwise_affine=affine)]
    if affine:
        mods.append(torch.nn.RMSNorm(96, eps=None))  # eps None: finfo(float32).eps
        mods.append(torch.nn.RMSNorm(96, eps=1e-5))
    for m in mods:
        m.to(DEVICE)
        if m.weight is not None:
            with torch.no_grad():
                m.weight.copy_(1 + 0.3 * torch.randn(96, generator=gen))
            m.to(w_dtype if isinstance(m, DiffusersRMSNorm) else x_dtype)
        with torch.no_grad():
            want = m(x)
            fn = di._diffusers_rmsnorm_forward if isinstance(m, DiffusersRMSNorm) else di._torch_rmsnorm_forward
            di._patch_forward(m, fn, "test")
            got = m(x)
        assert got.dtype == want.dtype, type(m).__name__
        assert rel_max(got, want) <= tol, (type(m).__name__, rel_max(got, want))
        di._unpatch(m)
        assert "forward" not in m.__dict__


def test_rmsnorm_with_bias_is_left_alone():
    m = DiffusersRMSNorm(32, eps=1e-6, elementwise_affine=True, bias=True)
    assert di._rmsnorm_kind(m) is None


# --------------------------------------------------------------------------------------------
# Counts on the real architecture (meta device: no memory, no weights)
# --------------------------------------------------------------------------------------------
def test_default_architecture_counts():
    with torch.device("meta"):
        tr = LTXVideoTransformer3DModel()
        vae = AutoencoderKLLTXVideo()
    counts = di.inject_optimized_kernels(tr, verbose=False)
    assert counts == _transformer_counts(blocks=28)
    n_vae = sum(isinstance(m, DiffusersRMSNorm) for m in vae.modules())
    assert di.inject_optimized_kernels(vae, verbose=False)["vae_rmsnorm"] == n_vae > 0
    di.remove_optimized_kernels(tr, verbose=False)
    di.remove_optimized_kernels(vae, verbose=False)
    _no_injection_left(tr)
    _no_injection_left(vae)


def test_injecting_twice_is_harmless(kernel_calls):
    _, tr, kw = _tiny_case()
    assert_injecting_twice_is_harmless(
        tr, kw, kernel_calls, di, di.inject_optimized_kernels, di.remove_optimized_kernels, _no_injection_left
    )


# --------------------------------------------------------------------------------------------
# Models that are not LTX-Video
# --------------------------------------------------------------------------------------------
def test_tiny_llama_untouched(gen):
    import transformers_injection as ti

    model = ti.build_llama(ti.tiny_llama_config(num_hidden_layers=1), device=DEVICE, seed=gen.seed_value)
    ids = torch.randint(0, 64, (1, 7), device=DEVICE)
    with torch.no_grad():
        ref = model(ids).logits
        assert set(di.inject_optimized_kernels(model, verbose=False).values()) == {0}
        assert torch.equal(model(ids).logits, ref)
    _no_injection_left(model)


def test_tiny_sd3_gets_no_ltx_kernels(gen):
    """SD3 has diffusers RMSNorm q/k norms and tanh-GELU feed-forwards, but it is not LTX-Video: none of
    the LTX kinds is injected (its own kernels come from mmdit_injection, counted under mmdit_* keys),
    the output stays within fp32 rounding, and removal restores it bit for bit."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(gen.seed_value)
    model = (
        SD3Transformer2DModel(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=1,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            caption_projection_dim=16,
            pooled_projection_dim=8,
            out_channels=4,
            qk_norm="rms_norm",
        )
        .eval()
        .to(DEVICE)
    )
    assert any(isinstance(m, DiffusersRMSNorm) for m in model.modules())
    kw = dict(
        hidden_states=torch.randn(1, 4, 8, 8, device=DEVICE),
        encoder_hidden_states=torch.randn(1, 5, 16, device=DEVICE),
        pooled_projections=torch.randn(1, 8, device=DEVICE),
        timestep=torch.tensor([3.0], device=DEVICE),
        return_dict=False,
    )
    with torch.no_grad():
        ref = model(**kw)[0]
        counts = di.inject_optimized_kernels(model, verbose=False)
        assert all(counts[k] == 0 for k in di.KINDS), counts
        assert any(v for k, v in counts.items() if k.startswith("mmdit_")), counts
        out = model(**kw)[0]
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
        di.remove_optimized_kernels(model, verbose=False)
        assert torch.equal(model(**kw)[0], ref)
    _no_injection_left(model)


def test_rejects_other_objects():
    with pytest.raises(TypeError, match="diffusers pipeline or a torch.nn.Module"):
        di.inject_optimized_kernels(object(), verbose=False)


# --------------------------------------------------------------------------------------------
# Parameters read at call time: offload hooks, weight swaps
# --------------------------------------------------------------------------------------------
def test_inject_before_enable_model_cpu_offload(kernel_calls):
    """pipe.enable_model_cpu_offload() after injection: accelerate moves each model to the execution
    device when it is called, so the patched forwards must find their weights there at call time."""
    pytest.importorskip("accelerate")
    pipe = di.build_tiny_ltx_pipeline()
    ref = _pipe_latents(pipe.to(DEVICE))
    pipe.to("cpu")
    di.inject_optimized_kernels(pipe, verbose=False)
    pipe.enable_model_cpu_offload(device=DEVICE.type if DEVICE.type == "cpu" else None)
    assert hasattr(pipe.transformer, "_hf_hook")
    out = _pipe_latents(pipe)
    assert kernel_calls["rms_norm_modulate"] > 0 and kernel_calls["ltx_qk_rmsnorm_rope_coords"] > 0
    assert rel_max(out, ref) <= FP32_REL
    di.remove_optimized_kernels(pipe, verbose=False)
    assert hasattr(pipe.transformer, "_hf_hook")  # the offload hooks survive the removal
    assert torch.equal(_pipe_latents(pipe), ref)


def test_sequential_offload_hooks_and_weight_swaps():
    """accelerate's sequential offload keeps weights on the meta device until each module runs:
    patched code must not read a submodule's weight it does not call (it falls back to calling the
    module). Swapping a weight after injection must be seen by the patched forward."""
    accelerate = pytest.importorskip("accelerate")
    gen, tr, kw = _tiny_case()
    di.inject_optimized_kernels(tr, verbose=False)
    with torch.no_grad():  # a new weight after injection, and an in-place change of another
        tr.transformer_blocks[0].attn1.norm_q.weight = torch.nn.Parameter(
            1 + 0.5 * torch.randn(32, generator=gen).to(DEVICE)
        )
        tr.transformer_blocks[1].scale_shift_table.mul_(2.0)
    patched = run_model(tr, kw)
    di.remove_optimized_kernels(tr, verbose=False)
    ref = run_model(tr, kw)
    assert rel_max(patched, ref) <= FP32_REL

    di.inject_optimized_kernels(tr, verbose=False)
    accelerate.cpu_offload(tr, execution_device=DEVICE)
    assert tr.transformer_blocks[0].attn1.norm_q.weight.device.type == "meta"
    assert rel_max(run_model(tr, kw), ref) <= FP32_REL
    di.remove_optimized_kernels(tr, verbose=False)
    assert hasattr(tr.transformer_blocks[0].attn1.norm_q, "_hf_hook")
    assert torch.equal(run_model(tr, kw), ref)


# --------------------------------------------------------------------------------------------
# Fallbacks
# --------------------------------------------------------------------------------------------
def test_other_self_attention_processor_gets_cos_sin(kernel_calls):
    """If someone sets diffusers' own processor on one self-attention after injection, the patched
    rope returns (cos, sin) again, and the remaining fused processors use the cos/sin kernel."""
    gen, tr, kw = _tiny_case()
    ref = run_model(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False)
    tr.transformer_blocks[0].attn1.set_processor(LTXVideoAttnProcessor())
    out = run_model(tr, kw)
    assert kernel_calls["ltx_qk_rmsnorm_rope"] == 1 and kernel_calls["ltx_qk_rmsnorm_rope_coords"] == 0
    assert rel_max(out, ref) <= FP32_REL
    di.remove_optimized_kernels(tr, verbose=False)
    assert torch.equal(run_model(tr, kw), ref)


def test_autograd_runs_the_original_code(kernel_calls):
    """The kernels have no backward: with gradients enabled the original operations run, so the
    forward is bit-identical and gradients flow."""
    gen, tr, kw = _tiny_case(num_layers=1)
    ref = tr(**kw)[0]
    ref.square().mean().backward()
    g_ref = tr.proj_in.weight.grad.clone()
    tr.zero_grad()
    di.inject_optimized_kernels(tr, verbose=False)
    out = tr(**kw)[0]
    out.square().mean().backward()
    assert sum(kernel_calls.values()) == 0
    assert torch.equal(out, ref)
    if DEVICE.type == "cpu":
        assert torch.equal(tr.proj_in.weight.grad, g_ref)
    else:  # GPU attention backward may use atomics: not bitwise reproducible run to run
        torch.testing.assert_close(tr.proj_in.weight.grad, g_ref, rtol=1e-4, atol=1e-6)
    di.remove_optimized_kernels(tr, verbose=False)


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------
def test_torch_compile_fullgraph_traces_the_kernels():
    """fullgraph=True: no graph break anywhere in the patched transformer, and the captured graph
    calls the kernels as ops (rtk_<kernel file>::..., the "_triton" twins on a GPU)."""
    gen, tr, kw = _tiny_case(num_layers=1)
    di.inject_optimized_kernels(tr, verbose=False)
    eager = run_model(tr, kw)
    seen = set()

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")

        def fw(g, _):
            for node in g.graph.nodes:
                if node.op == "call_function":
                    seen.add(str(node.target))
            return g

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(tr, backend=backend, fullgraph=True)
    out = run_model(compiled, kw)
    torch._dynamo.reset()
    ops = {s.split(".")[1].removesuffix("_triton") for s in seen if s.startswith("rtk_")}
    assert {"rms_norm_fused", "ltx_qk_rmsnorm_rope_coords", "gelu"} <= ops, sorted(seen)
    assert rel_max(out, eager) <= FP32_REL
    di.remove_optimized_kernels(tr, verbose=False)


@pytest.mark.skipif(
    os.environ.get("LTX_INJECTION_SKIP_INDUCTOR") == "1",
    reason="LTX_INJECTION_SKIP_INDUCTOR=1 (inductor compiles for ~30 s on a 2-core CPU)",
)
def test_torch_compile_inductor():
    """The default torch.compile backend: inductor keeps the custom ops as calls and compiles the rest
    (C++ on the CPU, where the ops run the interpreted kernels; Triton on a GPU)."""
    gen, tr, kw = _tiny_case(num_layers=1)
    ref = run_model(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False)
    torch._dynamo.reset()
    out = run_model(torch.compile(tr, fullgraph=True), kw)
    torch._dynamo.reset()
    assert rel_max(out, ref) <= FP32_REL
    di.remove_optimized_kernels(tr, verbose=False)


# --------------------------------------------------------------------------------------------
# The example
# --------------------------------------------------------------------------------------------
def test_example_runs_without_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script must set it
    env = with_interpreter_speedup(env)
    cmd = [sys.executable, str(ROOT / "scripts" / "ltx_kernel_injection_example.py"), "--rounds", "2"]
    if HAS_GPU:
        cmd.append("--device-free")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["ok"] and summary["restored_bit_identical"]
    steps = summary["steps"]  # two alternating rounds: each pipeline timed twice, steps 2..N (end to end)
    assert summary["rounds"] == 2 and len(summary["step_ms"]["unpatched"]) == len(
        summary["step_ms"]["patched"]
    ) == 2 * (steps - 1)
    assert summary["graph_mode"] is False  # (no GPU: graph mode is for CUDA devices)
    assert summary["replaced"]["adaln_fused_blocks"] == 2 and summary["replaced"]["qk_norm_rope_fused"] == 2
    assert "injected kernels: rmsnorm_weightless=4" in proc.stderr


# --------------------------------------------------------------------------------------------
# Submodules called without Module.__call__ where nothing hooks them
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "where", ["attn1", "attn2", "to_q", "to_out", "ff", "ff_proj", "attn1.norm_q", "attn1.norm_k", "global"]
)
def test_hooks_on_submodules_still_run(where):
    """The patched block calls attention processors, Linear / Dropout layers and the feed-forward
    without Module.__call__ only where no hook would run: a forward hook registered on any of them
    (or globally) must run and may change the output, exactly as in the unpatched model. The
    self-attention's q/k norms too (the fused q/k norm + RoPE kernel calls neither; their hooks ran 0
    times before)."""
    gen, tr, kw = _tiny_case()
    blk = tr.transformer_blocks[1]
    target = {
        "attn1": blk.attn1,
        "attn2": blk.attn2,
        "to_q": blk.attn1.to_q,
        "to_out": blk.attn2.to_out[0],
        "ff": blk.ff,
        "ff_proj": blk.ff.net[2],
        "attn1.norm_q": blk.attn1.norm_q,
        "attn1.norm_k": blk.attn1.norm_k,
    }.get(where)
    fired = Counter()

    def hook(module, args, output):
        fired[type(module).__name__] += 1
        return output * 1.5 if isinstance(output, torch.Tensor) else output

    if target is None:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda m, a, o: hook(m, a, o) if m is blk.attn1.to_v else None
        )
    else:
        handle = target.register_forward_hook(hook)
    try:
        ref = run_model(tr, kw)
        n_ref = sum(fired.values())
        di.inject_optimized_kernels(tr, verbose=False)
        fired.clear()
        out = run_model(tr, kw)
        assert sum(fired.values()) == n_ref > 0, f"hook on {where} ran {sum(fired.values())} times, expected {n_ref}"
        assert rel_max(out, ref) <= FP32_REL, f"{where}: rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    finally:
        handle.remove()
        di.remove_optimized_kernels(tr, verbose=False)


def _stock_then_injected(tr, kw, add_hook, seen=None):
    """tr run with the hook add_hook() registers (add_hook returns its remover), then injected and run with
    it registered anew (after the injection: a diffusers hook wraps the patched forward); the injection is
    removed after. Returns (stock output, injected output, what the hook recorded in seen in each run)."""
    seen = [] if seen is None else seen
    remove = add_hook()
    try:
        ref = run_model(tr, kw)
    finally:
        remove()
    stock_seen = list(seen)
    seen.clear()
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        remove = add_hook()
        try:
            out = run_model(tr, kw)
        finally:
            remove()
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    return ref, out, stock_seen, list(seen)


@pytest.mark.parametrize("which", ["attn1", "attn2"])
def test_a_keyword_pre_hook_on_an_attention_sees_the_stock_call(which):
    """A pre-hook registered with_kwargs=True on a block's attention sees the call diffusers' block makes
    (attn1 by keywords, attn2 with hidden_states positional), and what it changes there counts: an
    injected block that passed attn1's hidden_states positionally made such a hook change nothing."""
    gen, tr, kw = _tiny_case()
    attn = getattr(tr.transformer_blocks[1], which)
    seen = []

    def pre(module, args, kwargs):
        seen.append((len(args), tuple(sorted(kwargs))))
        if "hidden_states" in kwargs:
            return args, dict(kwargs, hidden_states=kwargs["hidden_states"] * 0.5)
        return (args[0] * 0.5, *args[1:]), kwargs

    add = lambda: attn.register_forward_pre_hook(pre, with_kwargs=True).remove  # noqa: E731
    ref, out, stock_calls, calls = _stock_then_injected(tr, kw, add, seen)
    assert calls == stock_calls and stock_calls, f"{which}: the hook saw {calls}, in the stock model {stock_calls}"
    assert rel_max(out, ref) <= FP32_REL, f"{which}: rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"


def test_a_norm_subclass_with_its_own_forward_in_the_self_attention_is_run():
    """A q norm replaced by a subclass of torch.nn.RMSNorm with a forward of its own: the fused q/k norm +
    RoPE kernel would compute plain RMSNorm in its place (it did, ignoring the subclass); the attention
    takes the unfused path, which calls it."""

    class ScaledRMSNorm(torch.nn.RMSNorm):
        def forward(self, x):
            return super().forward(x) * 2.0

    gen, tr, kw = _tiny_case()
    old = tr.transformer_blocks[0].attn1.norm_q
    new = ScaledRMSNorm(old.normalized_shape, eps=old.eps).to(DEVICE)
    with torch.no_grad():
        new.weight.copy_(old.weight)
    tr.transformer_blocks[0].attn1.norm_q = new
    ref = run_model(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        out = run_model(tr, kw)
        assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def test_a_hook_on_the_rope_module_sees_cos_and_sin():
    """The injection's rope forward hands the fused processors token coordinates instead of (cos, sin);
    with a hook on the rope module it returns (cos, sin), as the stock module does, so the hook sees and
    may change those (it saw the coordinates, and its change scaled them)."""
    gen, tr, kw = _tiny_case()
    seen = []

    def hook(module, args, output):
        seen.append(tuple(tuple(t.shape) for t in output))
        return tuple(t * 0.9 for t in output)

    ref, out, stock_shapes, shapes = _stock_then_injected(
        tr, kw, lambda: tr.rope.register_forward_hook(hook).remove, seen
    )
    assert shapes == stock_shapes and stock_shapes, f"the hook saw {shapes}, in the stock model {stock_shapes}"
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"


@pytest.mark.parametrize("where", ["attn1 pre-hook", "block pre-hook", "diffusers hook on rope"])
def test_hooks_that_read_the_rotary_embedding_see_cos_and_sin(where):
    """The injection's rope hands the fused processors token coordinates in place of (cos, sin). A hook that
    reads or changes the rotary embedding on its way (a keyword pre-hook on a self-attention or a block, a
    diffusers hook on the rope module) gets (cos, sin), as in the stock model: it scaled the coordinates."""
    from diffusers.hooks import HookRegistry, ModelHook

    class ScaleOutputs(ModelHook):
        def post_forward(self, module, output):
            return tuple(t * 0.9 for t in output)

    def pre(module, args, kwargs):
        cos, sin = kwargs["image_rotary_emb"]
        return args, dict(kwargs, image_rotary_emb=(cos * 0.9, sin * 0.9))

    gen, tr, kw = _tiny_case()
    blk = tr.transformer_blocks[1]

    def add_hook():
        if where == "diffusers hook on rope":
            HookRegistry.check_if_exists_or_initialize(tr.rope).register_hook(ScaleOutputs(), "scale")
            return lambda: tr.rope._diffusers_hook.remove_hook("scale", recurse=False)
        target = blk.attn1 if where == "attn1 pre-hook" else blk
        return target.register_forward_pre_hook(pre, with_kwargs=True).remove

    ref, out, _, _ = _stock_then_injected(tr, kw, add_hook)
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"


def test_dropout_in_training_mode_is_applied(gen):
    """A Dropout with p > 0 in training mode is not skipped (it runs as the module would)."""
    import injection_common as ic

    d = torch.nn.Dropout(0.5).train()
    x = torch.ones(1000)
    torch.manual_seed(gen.seed_value)
    y = ic.call(d, x)
    assert (y == 0).any() and (y == 2).any()
    d.eval()
    assert ic.call(d, x) is x


@pytest.mark.parametrize("cls", [torch.nn.Linear, torch.nn.Dropout])
def test_call_runs_a_forward_patched_on_the_class(cls, gen, monkeypatch):
    """A forward put on nn.Linear or nn.Dropout itself (a profiler, a library's shim) runs through ic.call,
    as module(x) would run it: the inline paths are for PyTorch's own forwards only."""
    import injection_common as ic

    m = (torch.nn.Linear(8, 4) if cls is torch.nn.Linear else torch.nn.Dropout(0.5)).eval()
    x = torch.randn(3, 8, generator=gen)
    own = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, inp: own(self, inp) * 2 + 1)
    assert torch.equal(ic.call(m, x), m(x)) and not torch.equal(ic.call(m, x), own(m, x))


@pytest.mark.parametrize("bias", [True, False])
def test_call_computes_a_linear_as_its_forward_does(bias, gen):
    """ic.call reads a Linear's registered parameters directly; a weight or bias deleted and set again as a
    plain tensor attribute (no longer a registered parameter) must still be the one used."""
    import injection_common as ic

    x = torch.randn(3, 8, generator=gen)
    m = torch.nn.Linear(8, 4, bias=bias)
    assert torch.equal(ic.call(m, x), m(x))
    w = torch.randn(4, 8, generator=gen)
    del m.weight
    m.weight = w
    assert torch.equal(ic.call(m, x), torch.nn.functional.linear(x, w, m.bias))
    m2 = torch.nn.Linear(8, 4)
    b = torch.randn(4, generator=gen)
    del m2.bias
    m2.bias = b
    assert torch.equal(ic.call(m2, x), torch.nn.functional.linear(x, m2.weight, b))


# --------------------------------------------------------------------------------------------
# Training edge cases: trainable weights inside a block, in-place changes between blocks, checkpointing
# --------------------------------------------------------------------------------------------
def _grads(model, kw, names):
    model.zero_grad(set_to_none=True)
    out = model(**kw)[0]
    out.square().mean().backward()
    return out.detach(), {
        n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters() if n in names
    }


@pytest.mark.parametrize(
    "trainable",
    [
        "transformer_blocks.0.attn1.to_v.weight",
        "transformer_blocks.1.ff.net.2.weight",
        "transformer_blocks.0.attn2.to_k.weight",
        "transformer_blocks.1.scale_shift_table",
    ],
)
def test_trainable_weight_inside_a_block_gets_its_gradient(trainable):
    """LoRA-style training: the base model frozen, one weight inside a block trainable. The patched
    block must fall back to the original code (the kernels have no backward), so the weight gets the
    same gradient as in the unpatched model, not None."""
    gen, tr, kw = _tiny_case()
    tr.requires_grad_(False)
    tr.get_parameter(trainable).requires_grad_(True)
    ref_out, ref_g = _grads(tr, kw, {trainable})
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        out, g = _grads(tr, kw, {trainable})
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    assert g[trainable] is not None, f"{trainable} got no gradient through the patched blocks"
    torch.testing.assert_close(g[trainable], ref_g[trainable], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


def test_text_embedding_requiring_grad_gets_its_gradient():
    """Training the text side: encoder_hidden_states requires grad while the transformer is frozen."""
    gen = make_generator()
    tr = _tiny_transformer(num_layers=2)
    tr.requires_grad_(False)
    kw = ltx_inputs(gen, **SMALL)
    enc = kw["encoder_hidden_states"].clone().requires_grad_(True)

    def grad_of_enc():
        enc.grad = None
        tr(**{**kw, "encoder_hidden_states": enc})[0].square().mean().backward()
        return enc.grad

    ref = grad_of_enc().clone()
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        got = grad_of_enc()
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    assert got is not None
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("where", ["post-hook on block 0", "pre-hook on block 1"])
def test_carry_ignored_after_an_in_place_change_between_blocks(where):
    """A hook that changes the residual stream in place between two blocks: the tensor is the same object,
    so identity alone would let block 1 use a norm of the old values. The version counter catches it."""
    gen, tr, kw = _tiny_case()
    b0, b1 = tr.transformer_blocks

    def change(h):  # not a uniform scaling: RMSNorm would not see that
        h.add_(0.5 * h.flip(-1))

    def post(module, args, output):
        change(output)

    def pre(module, args, kwargs):
        change(args[0] if args else kwargs["hidden_states"])

    handle = (
        b0.register_forward_hook(post)
        if where.startswith("post")
        else b1.register_forward_pre_hook(pre, with_kwargs=True)
    )
    ref, got, _ = without_and_with_kernels(tr, kw, di.inject_optimized_kernels, di.remove_optimized_kernels, [handle])
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e} (seed {gen.seed_value})"


def test_gradient_checkpointing_matches_without_it():
    """Gradient checkpointing recomputes each block in backward: with the kernels injected, the
    gradients equal those of the unpatched model with checkpointing on."""
    gen, tr, kw = _tiny_case(num_layers=3)
    tr.train()
    names = {n for n, _ in tr.named_parameters()}
    _, ref = _grads(tr, kw, names)
    tr.enable_gradient_checkpointing()
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        _, got = _grads(tr, kw, names)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    for n in names:
        assert (got[n] is None) == (ref[n] is None), n
        if ref[n] is not None:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)


# --------------------------------------------------------------------------------------------
# Only what the kernels provably reproduce is patched
# --------------------------------------------------------------------------------------------
def test_block_subclass_with_its_own_forward_is_left_alone():
    from diffusers.models.transformers.transformer_ltx import LTXVideoTransformerBlock

    class ScaledBlock(LTXVideoTransformerBlock):
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs) * 0.5

    gen = make_generator()
    tr = _tiny_transformer(num_layers=2)
    tr.transformer_blocks[1].__class__ = ScaledBlock
    kw = ltx_inputs(gen, **SMALL)
    ref = run_model(tr, kw)
    counts = di.inject_optimized_kernels(tr, verbose=False)
    try:
        assert counts["adaln_fused_blocks"] == 1
        got = run_model(tr, kw)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("which", ["norm1", "norm2"])
def test_block_norm_swapped_for_layernorm_is_computed_as_layernorm(which):
    """A block whose norm1 / norm2 someone replaced by nn.LayerNorm (after or before injection) must run
    that LayerNorm, not the fused RMSNorm kernel."""
    gen, tr, kw = _tiny_case()
    blk = tr.transformer_blocks[1]
    dim = blk.scale_shift_table.shape[1]
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        setattr(blk, which, torch.nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6).to(DEVICE))
        got = run_model(tr, kw)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    ref = run_model(tr, kw)  # unpatched, same modules
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("which", ["norm1", "norm2"])
def test_hook_on_a_block_norm_still_runs(which):
    gen, tr, kw = _tiny_case()
    norm = getattr(tr.transformer_blocks[1], which)
    ref, got = hooked_norm_outputs(norm, tr, kw, di.inject_optimized_kernels, di.remove_optimized_kernels)
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("loader", ["example", "benchmark_e2e"])
def test_local_checkpoints_load_safetensors_only(loader, monkeypatch):
    """Weights from the local cache are read from safetensors files only (never pickled .bin files),
    in the example and in the end-to-end benchmark alike."""
    import huggingface_hub
    from diffusers import LTXPipeline

    seen = {}

    class FakePipe:
        def to(self, device):
            return self

    def fake_from_pretrained(name, **kwargs):
        seen.update(kwargs, name=name)
        return FakePipe()

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, fname: "/cache/" + fname)
    monkeypatch.setattr(LTXPipeline, "from_pretrained", staticmethod(fake_from_pretrained))
    if loader == "example":
        sys.path.insert(0, str(ROOT / "scripts"))
        import ltx_kernel_injection_example as mod

        pipe, what = mod.load_pipeline(True, 0)
    else:
        import benchmark_e2e as mod

        pipe, what = mod.load_pipeline("cuda", False, 0)
    assert isinstance(pipe, FakePipe) and "local cache" in what
    assert seen.get("use_safetensors") is True and seen.get("local_files_only") is True, seen


def test_carry_not_made_for_a_next_block_with_hooks():
    """A pre-hook of block 1 that brings in its parameters (as weight streaming or offloading does) runs
    after block 0 would have computed block 1's norm from them: with any hook on either block, nothing
    is carried, and block 1 computes its norm itself once its hooks have run."""
    gen, tr, kw = _tiny_case()
    b1 = tr.transformer_blocks[1]
    real = b1.scale_shift_table.detach().clone()

    def pre(module, args):
        module.scale_shift_table.data.copy_(real)

    def post(module, args, output):
        module.scale_shift_table.data.zero_()

    with torch.no_grad():
        b1.scale_shift_table.zero_()  # "offloaded" until its pre-hook runs
    handles = [b1.register_forward_pre_hook(pre), b1.register_forward_hook(post)]
    ref, got, _ = without_and_with_kernels(tr, kw, di.inject_optimized_kernels, di.remove_optimized_kernels, handles)
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_diffusers_hook_changing_a_block_output_in_place(mode):
    """A diffusers ModelHook (which wraps the instance's forward, not a torch hook) edits block 0's output
    in place. Under inference_mode there is no version counter to notice: nothing may be carried past a
    block with such a hook."""
    from diffusers.hooks import HookRegistry, ModelHook

    class InPlacePost(ModelHook):
        def post_forward(self, module, output):
            output.add_(0.5 * output.flip(-1))
            return output

    gen, tr, kw = _tiny_case()
    HookRegistry.check_if_exists_or_initialize(tr.transformer_blocks[0]).register_hook(InPlacePost(), "inplace")
    ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with ctx():
        ref = tr(**kw)[0]
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        with ctx():
            got = tr(**kw)[0]
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    assert rel_max(got, ref) <= FP32_REL, f"rel max diff {rel_max(got, ref):.3e}"


@pytest.mark.parametrize("interpret", ["1", None])
def test_injecting_into_a_cpu_model_without_the_interpreter_says_the_kernels_step_aside(monkeypatch, interpret):
    """On the CPU without TRITON_INTERPRET every injected forward runs the original code: the injection warns
    and says so in its log line, instead of reporting kernels that will never run."""
    import warnings

    pipe = di.build_tiny_ltx_pipeline()
    if interpret is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            di.inject_optimized_kernels(pipe, verbose=False)
        said = [str(w.message) for w in caught if "step aside" in str(w.message)]
        assert len(said) == (1 if interpret is None else 0), said
    finally:
        di.remove_optimized_kernels(pipe, verbose=False)

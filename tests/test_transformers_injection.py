# SPDX-License-Identifier: Apache-2.0
"""inject_llama_kernels / remove_llama_kernels on transformers' Llama: parity with the unpatched model
(logits, greedy tokens), the kernels really running, exact restoration, idempotence, counts (tiny model
and the Llama-3-8B architecture on the meta device), models that are not Llama left alone, fallbacks
(autograd, devices, dtype mixes, hooks, layers that differ from Llama's), and the example script.
Runs on the CPU through Triton's interpreter (tiny shapes) or on a GPU."""

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig, MistralForCausalLM
from transformers.models.llama import modeling_llama

import transformers_injection as ti
from kernel_testing import DEVICE, make_generator, rel_l2, run_python

ROOT = Path(__file__).resolve().parents[1]

# fp32: the kernels do the same math in fp32 with other summation orders and one rounding per fused
# step, a few ulps (~1e-7 relative) per op; measured ~3e-7 at the logits of the 2-layer model. 1e-5
# is 30x that, and 1000x below what a wrong formula, rounding convention or layout gives (>= 1e-2).
FP32_REL = 1e-5
# bf16: the patched model may be at most 1.5x further from the fp32 model's logits than the unpatched
# bf16 model is (relative L2); measured 1.13-1.22x under the interpreter, which truncates fp32 -> bf16
# where a GPU rounds to nearest.
BF16_FACTOR = 1.5

TINY_COUNTS = {"rmsnorm": 5, "fused_add_rmsnorm": 2, "swiglu": 2, "rope": 2, "skinny_gemm": 0}
# The sizes of the tiny Llama (ti.tiny_llama_config), for models built like it from other config classes
TINY_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def _rel_max(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _model(gen, dtype=torch.float32, **cfg):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    return ti.build_llama(ti.tiny_llama_config(**cfg), device=DEVICE, dtype=dtype, seed=seed)


def _ids(gen, batch=2, length=9, vocab=256):
    return torch.randint(3, vocab, (batch, length), generator=gen).to(DEVICE)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _greedy(model, ids, n=6):
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :]


def _rope_fn():
    return modeling_llama.apply_rotary_pos_emb


ORIGINAL_ROPE = ti._original_rope_function(modeling_llama.apply_rotary_pos_emb)


def _nothing_left(model):
    for m in model.modules():
        assert ti._STATE not in m.__dict__, f"{type(m).__name__} still marked as patched"
        fwd = m.__dict__.get("forward")
        # accelerate leaves the module's own bound forward behind when its hook is removed
        assert fwd is None or hasattr(m, "_hf_hook") or getattr(fwd, "__func__", None) is type(m).forward, (
            f"{type(m).__name__} keeps a patched forward"
        )
    assert _rope_fn() is ORIGINAL_ROPE, "apply_rotary_pos_emb was not restored"


@pytest.fixture(autouse=True)
def _clean_rope():
    yield
    # a failing test must not leave the dispatcher in place for the next one
    modeling_llama.apply_rotary_pos_emb = ORIGINAL_ROPE
    ti._ROPE_SITES.clear()


# --------------------------------------------------------------------------------------------
# Parity, kernels running, restoration
# --------------------------------------------------------------------------------------------
def test_fp32_parity_greedy_and_exact_restore():
    gen = make_generator()
    model = _model(gen)
    ids = _ids(gen)
    ref = _logits(model, ids)
    ref_tokens = _greedy(model, ids[:1])

    counts = ti.inject_llama_kernels(model, verbose=False)
    assert counts == TINY_COUNTS
    assert _rope_fn() is not ORIGINAL_ROPE
    with ti.count_kernel_calls() as calls:
        out = _logits(model, ids)
    # per layer: input_layernorm, fused residual + post-attention norm, q and k RoPE, SwiGLU; + final norm
    assert dict(calls) == {"rms_norm": 3, "fused_add_rms_norm": 2, "rope_rotate_half": 4, "swiglu": 2}
    assert out.dtype == ref.dtype and torch.isfinite(out).all()
    assert _rel_max(out, ref) <= FP32_REL, f"rel max diff {_rel_max(out, ref):.3e} (seed {gen.seed_value})"
    with ti.count_kernel_calls() as calls:
        tokens = _greedy(model, ids[:1])
    assert calls["fused_add_rms_norm"] > 0 and calls["rope_rotate_half"] > 0  # decode steps ran the kernels
    assert torch.equal(tokens, ref_tokens), f"greedy tokens differ (seed {gen.seed_value})"

    restored = ti.remove_llama_kernels(model, verbose=False)
    assert restored == counts
    _nothing_left(model)
    assert torch.equal(_logits(model, ids), ref)
    assert ti.injected_counts(model) == {k: 0 for k in ti.KINDS}


def test_bf16_parity_against_fp32_with_skinny_gemm():
    """bf16, all kinds including the skinny GEMM on the decode-sized calls: the patched logits may not be
    further from the fp32 model's than BF16_FACTOR x the unpatched bf16 model's distance."""
    gen = make_generator()
    model = _model(gen)
    ids = _ids(gen, batch=1, length=40)  # more than 32 rows: the prefill keeps nn.Linear
    ref32 = _logits(model, ids)
    model.to(torch.bfloat16)
    stock = _logits(model, ids)
    last = ids[:, -1:]  # a 1-row call, as in decoding: goes through the skinny GEMM
    stock_last = _logits(model, last)
    counts = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert counts == {**TINY_COUNTS, "skinny_gemm": 15}  # 7 per layer + lm_head
    with ti.count_kernel_calls() as calls:
        patched = _logits(model, ids)
    assert calls["skinny_gemm"] == 0 and calls["swiglu"] == 2
    with ti.count_kernel_calls() as calls:
        patched_last = _logits(model, last)
    assert calls["skinny_gemm"] == 15
    assert patched.dtype == torch.bfloat16
    e_stock, e_patched = rel_l2(stock, ref32), rel_l2(patched, ref32)
    assert e_patched <= BF16_FACTOR * e_stock, f"patched {e_patched:.3e} vs stock {e_stock:.3e} (seed {gen.seed_value})"
    assert rel_l2(patched_last, stock_last) <= 2.0**-4
    ti.remove_llama_kernels(model, verbose=False)
    assert torch.equal(_logits(model, ids), stock)
    _nothing_left(model)


def test_idempotent_and_incremental():
    gen = make_generator()
    model = _model(gen)
    first = ti.inject_llama_kernels(model, verbose=False)
    patched = {id(m): m.__dict__["forward"] for m in model.modules() if ti._STATE in m.__dict__}
    dispatcher = _rope_fn()
    again = ti.inject_llama_kernels(model, verbose=False)
    assert again == first
    assert {id(m): m.__dict__["forward"] for m in model.modules() if ti._STATE in m.__dict__} == patched
    assert _rope_fn() is dispatcher
    more = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert more == {**first, "skinny_gemm": 15}
    assert ti.remove_llama_kernels(model, verbose=False) == more
    assert ti.remove_llama_kernels(model, verbose=False) == {k: 0 for k in ti.KINDS}
    _nothing_left(model)


def test_options_select_kinds():
    model = _model(make_generator())
    counts = ti.inject_llama_kernels(model, fuse_residual=False, rope=False, verbose=False)
    assert counts == {**TINY_COUNTS, "fused_add_rmsnorm": 0, "rope": 0}
    assert _rope_fn() is ORIGINAL_ROPE
    ti.remove_llama_kernels(model, verbose=False)
    _nothing_left(model)


def test_llama3_8b_counts_on_meta_device():
    model = ti.build_meta_llama(ti.llama3_8b_config())
    assert all(p.device.type == "meta" for p in model.parameters())
    counts = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert counts == {"rmsnorm": 65, "fused_add_rmsnorm": 32, "swiglu": 32, "rope": 32, "skinny_gemm": 225}
    assert ti.remove_llama_kernels(model, verbose=False) == counts
    _nothing_left(model)


# --------------------------------------------------------------------------------------------
# What is and is not recognised
# --------------------------------------------------------------------------------------------
def test_non_llama_model_untouched():
    gen = make_generator()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    model = (
        GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64)).to(DEVICE).eval()
    )
    ids = _ids(gen, vocab=128)
    ref = _logits(model, ids)
    counts = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert counts == {k: 0 for k in ti.KINDS}
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert _rope_fn() is ORIGINAL_ROPE
    assert torch.equal(_logits(model, ids), ref)
    assert ti.remove_llama_kernels(model, verbose=False) == counts


def test_llama_copy_is_recognised():
    """Mistral's modules are copies of Llama's (same code): recognised by their code, same parity."""
    gen = make_generator()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    tiny = ti.tiny_llama_config()  # its sizes; Mistral's defaults otherwise
    cfg = MistralConfig(**{k: getattr(tiny, k) for k in TINY_SIZES}, pad_token_id=0)
    model = MistralForCausalLM(cfg).to(DEVICE).eval()
    ids = _ids(gen)
    ref = _logits(model, ids)
    assert ti.inject_llama_kernels(model, verbose=False) == TINY_COUNTS
    out = _logits(model, ids)
    assert _rel_max(out, ref) <= FP32_REL, f"seed {gen.seed_value}"
    ti.remove_llama_kernels(model, verbose=False)
    assert torch.equal(_logits(model, ids), ref)


def test_modified_decoder_layer_is_not_fused():
    """A decoder layer whose forward differs from Llama's is left alone (its norms and MLP still run
    the kernels), and the result is the modified layer's."""

    class ScaledResidualLayer(modeling_llama.LlamaDecoderLayer):
        def forward(
            self,
            hidden_states,
            attention_mask=None,
            position_ids=None,
            cache=None,
            use_cache=False,
            position_embeddings=None,
            **kwargs,
        ):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            hidden_states = residual + 0.5 * hidden_states  # not Llama's residual
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            return residual + hidden_states

    gen = make_generator()
    model = _model(gen)
    layer = model.model.layers[1]
    layer.__class__ = ScaledResidualLayer
    ids = _ids(gen)
    ref = _logits(model, ids)
    counts = ti.inject_llama_kernels(model, verbose=False)
    assert counts == {**TINY_COUNTS, "fused_add_rmsnorm": 1}
    assert ti._STATE not in layer.__dict__
    assert _rel_max(_logits(model, ids), ref) <= FP32_REL
    ti.remove_llama_kernels(model, verbose=False)


def test_decoder_layer_called_directly():
    """The patched layer takes the original's arguments (positional too) and returns what it returns."""
    gen = make_generator()
    model = _model(gen)
    layer = model.model.layers[0]
    h = torch.randn(2, 5, 64, generator=gen).to(DEVICE)
    pos = torch.arange(5, device=DEVICE)[None].expand(2, -1)
    cos_sin = model.model.rotary_emb(h, pos)
    with torch.no_grad():
        ref = layer(h, None, pos, position_embeddings=cos_sin)
        ti.inject_llama_kernels(model, verbose=False)
        with ti.count_kernel_calls() as calls:
            out = layer(h, None, pos, position_embeddings=cos_sin)
        assert calls["fused_add_rms_norm"] == 1
        assert type(out) is type(ref) and out.shape == ref.shape
        assert _rel_max(out, ref) <= FP32_REL
        with ti.count_kernel_calls() as calls:  # hidden_states by keyword: the original layer runs
            kw_out = layer(hidden_states=h, position_ids=pos, position_embeddings=cos_sin)
        assert calls["fused_add_rms_norm"] == 0 and calls["rms_norm"] == 2
        assert _rel_max(kw_out, ref) <= FP32_REL
        with pytest.raises(TypeError):
            layer(h, None, pos, position_ids=pos, position_embeddings=cos_sin)  # as the original would
    ti.remove_llama_kernels(model, verbose=False)


# --------------------------------------------------------------------------------------------
# Fallbacks
# --------------------------------------------------------------------------------------------
def test_autograd_falls_back_and_backward_works():
    gen = make_generator()
    model = _model(gen)
    model.requires_grad_(True)
    ids = _ids(gen)
    ref = model(ids).logits
    ref.float().pow(2).mean().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    with ti.count_kernel_calls() as calls:
        out = model(ids).logits
        out.float().pow(2).mean().backward()
    assert sum(calls.values()) == 0, dict(calls)
    assert torch.equal(out, ref)
    for p, g in zip(model.parameters(), ref_grads):
        assert torch.equal(p.grad, g)
    ti.remove_llama_kernels(model, verbose=False)


def test_unsupported_device_falls_back(monkeypatch):
    """CPU tensors without the interpreter: every patched forward runs the original code."""
    gen = make_generator()
    model = ti.build_llama(ti.tiny_llama_config(), device="cpu", seed=gen.seed_value % 2**31)
    ids = _ids(gen).cpu()
    ref = _logits(model, ids)
    ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    monkeypatch.setattr(ti.ic, "interpreting", lambda: False)
    with ti.count_kernel_calls() as calls:
        out = _logits(model, ids)
    assert sum(calls.values()) == 0
    assert torch.equal(out, ref)
    ti.remove_llama_kernels(model, verbose=False)


def test_dtype_mix_rmsnorm_falls_back():
    """An fp32 weight on bf16 input: LlamaRMSNorm returns fp32 (type promotion); so does the patch."""
    gen = make_generator()
    norm = modeling_llama.LlamaRMSNorm(48, eps=1e-5).to(DEVICE).requires_grad_(False)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.randn(48, generator=gen))
    model = torch.nn.Sequential(norm)
    x = torch.randn(3, 48, generator=gen).to(DEVICE, torch.bfloat16)
    ref = norm(x)
    assert ti.inject_llama_kernels(model, verbose=False)["rmsnorm"] == 1
    with ti.count_kernel_calls() as calls:
        out = norm(x)
    assert calls["rms_norm"] == 0
    assert out.dtype == torch.float32 and torch.equal(out, ref)
    with ti.count_kernel_calls() as calls:  # fp32 input on the fp32 weight: the kernel
        out32 = norm(x.float())
    assert calls["rms_norm"] == 1
    assert _rel_max(out32, modeling_llama.LlamaRMSNorm.forward(norm, x.float())) <= FP32_REL
    ti.remove_llama_kernels(model, verbose=False)


def test_hooked_norm_is_not_bypassed():
    """A forward hook on post_attention_layernorm: the fused path would skip it, so the layer adds and
    calls the norm as the original does; the hook sees every call."""
    gen = make_generator()
    model = _model(gen)
    seen = []
    norm = model.model.layers[0].post_attention_layernorm
    norm.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    ids = _ids(gen)
    ref = _logits(model, ids)
    ti.inject_llama_kernels(model, verbose=False)
    with ti.count_kernel_calls() as calls:
        out = _logits(model, ids)
    assert len(seen) == 2
    assert calls["fused_add_rms_norm"] == 1  # layer 1 only
    assert _rel_max(out, ref) <= FP32_REL
    ti.remove_llama_kernels(model, verbose=False)


def test_accelerate_hook_keeps_running():
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class Count(ModelHook):
        n = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.n += 1
            return args, kwargs

    gen = make_generator()
    model = _model(gen)
    norm = model.model.norm
    add_hook_to_module(norm, Count())
    ids = _ids(gen)
    ref = _logits(model, ids)
    ti.inject_llama_kernels(model, verbose=False)
    assert norm.__dict__[ti._STATE]["slot"] == "_old_forward"
    with ti.count_kernel_calls() as calls:
        out = _logits(model, ids)
    assert Count.n == 2 and calls["rms_norm"] == 3
    assert _rel_max(out, ref) <= FP32_REL
    ti.remove_llama_kernels(model, verbose=False)
    remove_hook_from_module(norm)
    _nothing_left(model)
    assert torch.equal(_logits(model, ids), ref)
    # the other order: the hook removed while the kernels are in, then the kernels
    add_hook_to_module(norm, Count())
    ti.inject_llama_kernels(model, verbose=False)
    remove_hook_from_module(norm)
    with ti.count_kernel_calls() as calls:
        assert _rel_max(_logits(model, ids), ref) <= FP32_REL
    assert calls["rms_norm"] == 3
    ti.remove_llama_kernels(model, verbose=False)
    _nothing_left(model)
    assert torch.equal(_logits(model, ids), ref)


def test_rope_is_per_instance():
    """Two models of one file: only the patched one's attention layers use the kernel; an unsupported
    unsqueeze_dim goes to the original; the function is restored when the last layer is unpatched."""
    gen = make_generator()
    a, b = _model(gen), _model(gen)
    ids = _ids(gen)
    ref_b = _logits(b, ids)
    ti.inject_llama_kernels(a, verbose=False)
    with ti.count_kernel_calls() as calls:
        out_b = _logits(b, ids)
    assert sum(calls.values()) == 0
    assert torch.equal(out_b, ref_b)
    q = torch.randn(1, 5, 2, 8, generator=gen).to(DEVICE)  # [B, S, H, D]: unsqueeze_dim=2
    cos, sin = torch.randn(1, 5, 8, generator=gen).to(DEVICE), torch.randn(1, 5, 8, generator=gen).to(DEVICE)
    ti._ROPE_ACTIVE.depth = 1
    try:
        with ti.count_kernel_calls() as calls:
            got = _rope_fn()(q, q, cos, sin, 2)
    finally:
        ti._ROPE_ACTIVE.depth = 0
    assert calls["rope_rotate_half"] == 0
    assert torch.equal(got[0], ORIGINAL_ROPE(q, q, cos, sin, 2)[0])
    ti.inject_llama_kernels(b, verbose=False)
    ti.remove_llama_kernels(a, verbose=False)
    assert _rope_fn() is not ORIGINAL_ROPE  # b still uses it
    ti.remove_llama_kernels(b, verbose=False)
    assert _rope_fn() is ORIGINAL_ROPE


def test_count_kernel_calls_restores_entry_points():
    import activations
    import rmsnorm

    before = (rmsnorm.rms_norm, activations.swiglu)
    with ti.count_kernel_calls():
        assert rmsnorm.rms_norm is not before[0]
    assert (rmsnorm.rms_norm, activations.swiglu) == before


def test_bad_argument():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ti.inject_llama_kernels("not a model")


# --------------------------------------------------------------------------------------------
# The scripts
# --------------------------------------------------------------------------------------------
def test_example_runs_on_cpu():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the example decides
    r = run_python([ROOT / "scripts" / "transformers_injection_example.py", "--device-free"], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["ok"] is True
    assert summary["replaced"] == TINY_COUNTS
    assert summary["fp32"]["greedy_tokens_identical"] and summary["fp32"]["restored_bit_identical"]
    assert summary["fp32"]["patched_vs_unpatched"]["rel_max_diff"] <= 1e-4


def test_injection_main_reports_meta_counts(capsys):
    assert ti._main(["--num-layers", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["injected"] == {"rmsnorm": 9, "fused_add_rmsnorm": 4, "swiglu": 4, "rope": 4, "skinny_gemm": 29}


def test_injecting_into_a_cpu_model_without_the_interpreter_warns(monkeypatch, gen):
    """On the CPU without TRITON_INTERPRET the patched forwards run the original code: the injection says so."""
    import warnings

    model = ti.build_llama(ti.tiny_llama_config(), device="cpu", dtype=torch.float32, seed=0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ti.inject_llama_kernels(model, verbose=False)
        assert [w for w in caught if "step aside" in str(w.message)]
    finally:
        ti.remove_llama_kernels(model, verbose=False)

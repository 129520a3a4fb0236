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
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.llama import modeling_llama

import kernel_testing as kt
import plain_rope_llama as prl
import transformers_injection as ti
from kernel_testing import DEVICE, make_generator, rel_l2, rel_max, run_python, with_interpreter_speedup
from transformers_testing import (
    ORIGINAL_ROPE,
    TINY_LLAMA_COUNTS,
    assert_autograd_falls_back,
    greedy,
    logits,
    restore_rope,
)

ROOT = Path(__file__).resolve().parents[1]

# fp32: the kernels do the same math in fp32 with other summation orders and one rounding per fused
# step, a few ulps (~1e-7 relative) per op; measured ~3e-7 at the logits of the 2-layer model. 1e-5
# is 30x that, and 1000x below what a wrong formula, rounding convention or layout gives (>= 1e-2).
FP32_REL = 1e-5
# bf16: the patched model may be at most 1.5x further from the fp32 model's logits than the unpatched
# bf16 model is (relative L2); measured 1.13-1.22x under the interpreter, which truncates fp32 -> bf16
# where a GPU rounds to nearest.
BF16_FACTOR = 1.5

ZERO = {k: 0 for k in ti.KINDS}
# The sizes of the tiny Llama (ti.tiny_llama_config), for models built like it from other config classes
TINY_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def _model(gen, dtype=torch.float32, **cfg):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    return ti.build_llama(ti.tiny_llama_config(**cfg), device=DEVICE, dtype=dtype, seed=seed)


def _ids(gen, batch=2, length=9, vocab=256):
    return torch.randint(3, vocab, (batch, length), generator=gen).to(DEVICE)


def _rope_fn():
    return modeling_llama.apply_rotary_pos_emb


# With the kernels package (a dependency from transformers 5.25) the model file's function is a module that
# routes each layer's calls to the layer's own copy, where the injection puts the kernel: nothing global
# changes. Without it (tests/plain_rope_llama.py) a dispatcher stands in for the model file's function.
HUB_FORM = isinstance(ORIGINAL_ROPE, torch.nn.Module)


def _nothing_left(model):
    for m in model.modules():
        assert ti._STATE not in m.__dict__, f"{type(m).__name__} still marked as patched"
        fwd = m.__dict__.get("forward")
        # accelerate leaves the module's own bound forward behind when its hook is removed
        assert fwd is None or hasattr(m, "_hf_hook") or getattr(fwd, "__func__", None) is type(m).forward, (
            f"{type(m).__name__} keeps a patched forward"
        )
    assert _rope_fn() is ORIGINAL_ROPE, "apply_rotary_pos_emb was not restored"
    assert prl.current() is prl.ORIGINAL, "the plain model file's apply_rotary_pos_emb was not restored"
    for m in model.modules():
        for copy in (m.__dict__.get("_kernel_funcs") or {}).values():
            assert "forward" not in copy.__dict__, f"{type(m).__name__}'s copy of the RoPE function keeps the kernel"


@pytest.fixture(autouse=True)
def _clean_rope():
    yield
    restore_rope()


# --------------------------------------------------------------------------------------------
# Parity, kernels running, restoration
# --------------------------------------------------------------------------------------------
def test_fp32_parity_greedy_and_exact_restore():
    gen = make_generator()
    model = _model(gen)
    ids = _ids(gen)
    ref = logits(model, ids)
    ref_tokens = greedy(model, ids[:1])

    counts = ti.inject_llama_kernels(model, verbose=False)
    assert counts == TINY_LLAMA_COUNTS
    assert (_rope_fn() is ORIGINAL_ROPE) == HUB_FORM  # with the kernels package nothing global changes
    with ti.count_kernel_calls() as calls:
        out = logits(model, ids)
    # per layer: input_layernorm, fused residual + post-attention norm, q and k RoPE, SwiGLU; + final norm
    assert dict(calls) == {"rms_norm": 3, "fused_add_rms_norm": 2, "rope_rotate_half": 4, "swiglu": 2}
    assert out.dtype == ref.dtype and torch.isfinite(out).all()
    assert rel_max(out, ref) <= FP32_REL, f"rel max diff {rel_max(out, ref):.3e} (seed {gen.seed_value})"
    with ti.count_kernel_calls() as calls:
        tokens = greedy(model, ids[:1])
    assert calls["fused_add_rms_norm"] > 0 and calls["rope_rotate_half"] > 0  # decode steps ran the kernels
    assert torch.equal(tokens, ref_tokens), f"greedy tokens differ (seed {gen.seed_value})"

    restored = ti.remove_llama_kernels(model, verbose=False)
    assert restored == counts
    _nothing_left(model)
    assert torch.equal(logits(model, ids), ref)
    assert ti.injected_counts(model) == {k: 0 for k in ti.KINDS}


def test_bf16_parity_against_fp32_with_skinny_gemm():
    """bf16, all kinds including the skinny GEMM on the decode-sized calls: the patched logits may not be
    further from the fp32 model's than BF16_FACTOR x the unpatched bf16 model's distance."""
    gen = make_generator()
    model = _model(gen)
    ids = _ids(gen, batch=1, length=40)  # more than 32 rows: the prefill keeps nn.Linear
    ref32 = logits(model, ids)
    model.to(torch.bfloat16)
    stock = logits(model, ids)
    last = ids[:, -1:]  # a 1-row call, as in decoding: goes through the skinny GEMM
    stock_last = logits(model, last)
    counts = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert counts == {**TINY_LLAMA_COUNTS, "skinny_gemm": 15}  # 7 per layer + lm_head
    with ti.count_kernel_calls() as calls:
        patched = logits(model, ids)
    assert calls["skinny_gemm"] == 0 and calls["swiglu"] == 2
    with ti.count_kernel_calls() as calls:
        patched_last = logits(model, last)
    assert calls["skinny_gemm"] == 15
    assert patched.dtype == torch.bfloat16
    e_stock, e_patched = rel_l2(stock, ref32), rel_l2(patched, ref32)
    assert e_patched <= BF16_FACTOR * e_stock, f"patched {e_patched:.3e} vs stock {e_stock:.3e} (seed {gen.seed_value})"
    assert rel_l2(patched_last, stock_last) <= 2.0**-4
    ti.remove_llama_kernels(model, verbose=False)
    assert torch.equal(logits(model, ids), stock)
    _nothing_left(model)


def _patched_callables(model) -> dict:
    """What each patched module runs now: its forward, or for the RoPE kind its copy of the function's."""
    out = {}
    for m in model.modules():
        st = m.__dict__.get(ti._STATE)
        if st is not None:
            out[id(m)] = st["rope_slot"].__dict__["forward"] if "rope_slot" in st else m.__dict__["forward"]
    return out


@pytest.mark.parametrize("form", ["installed", "plain"])
def test_idempotent_and_incremental(form):
    gen = make_generator()
    model = _model(gen)
    if form == "plain":
        prl.use_plain_rope(model)
    current = prl.current if form == "plain" else _rope_fn
    first = ti.inject_llama_kernels(model, verbose=False)
    patched = _patched_callables(model)
    dispatcher = current()
    assert (dispatcher is ORIGINAL_ROPE) == (form == "installed" and HUB_FORM)
    again = ti.inject_llama_kernels(model, verbose=False)
    assert again == first
    assert _patched_callables(model) == patched
    assert current() is dispatcher
    more = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert more == {**first, "skinny_gemm": 15}
    assert ti.remove_llama_kernels(model, verbose=False) == more
    assert ti.remove_llama_kernels(model, verbose=False) == {k: 0 for k in ti.KINDS}
    _nothing_left(model)


def test_options_select_kinds():
    model = _model(make_generator())
    counts = ti.inject_llama_kernels(model, fuse_residual=False, rope=False, verbose=False)
    assert counts == {**TINY_LLAMA_COUNTS, "fused_add_rmsnorm": 0, "rope": 0}
    assert _rope_fn() is ORIGINAL_ROPE
    ti.remove_llama_kernels(model, verbose=False)
    _nothing_left(model)


def test_llama3_8b_counts_on_meta_device():
    model = ti.build_meta_llama(ti.llama3_8b_config())
    assert all(p.device.type == "meta" for p in model.parameters())
    counts = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert counts == {**ZERO, "rmsnorm": 65, "fused_add_rmsnorm": 32, "swiglu": 32, "rope": 32, "skinny_gemm": 225}
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
    ref = logits(model, ids)
    counts = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert counts == {k: 0 for k in ti.KINDS}
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert _rope_fn() is ORIGINAL_ROPE
    assert torch.equal(logits(model, ids), ref)
    assert ti.remove_llama_kernels(model, verbose=False) == counts


# Llama copies and near-copies in transformers: (model class, config class, RMSNorms beyond Llama's 5)
COPIES = {
    "mistral": ("MistralForCausalLM", "MistralConfig", 0),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", 0),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", 4),  # per-head q and k RMSNorms in each of 2 layers
}


@pytest.mark.parametrize("family", sorted(COPIES))
def test_llama_copy_is_recognised(family):
    """Models whose modules compute what Llama's compute (Mistral's and Qwen2's are copies; Qwen3 adds RMSNorms
    on q and k): recognised by what they compute, every kind injected, same parity."""
    model_cls, config_cls, extra_norms = COPIES[family]
    gen = make_generator()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    tiny = ti.tiny_llama_config()  # its sizes; the family's defaults otherwise
    cfg = getattr(transformers, config_cls)(**{k: getattr(tiny, k) for k in TINY_SIZES}, pad_token_id=0)
    model = getattr(transformers, model_cls)(cfg).to(DEVICE).eval()
    ids = _ids(gen)
    ref = logits(model, ids)
    counts = ti.inject_llama_kernels(model, verbose=False)
    assert counts == {**TINY_LLAMA_COUNTS, "rmsnorm": TINY_LLAMA_COUNTS["rmsnorm"] + extra_norms}, (
        f"transformers {transformers.__version__}: {ti.missing_kinds(model)}"
    )
    assert ti.missing_kinds(model) == {}
    with ti.count_kernel_calls() as calls:
        out = logits(model, ids)
    assert calls["rope_rotate_half"] == 4
    assert rel_max(out, ref) <= FP32_REL, f"seed {gen.seed_value}"
    ti.remove_llama_kernels(model, verbose=False)
    assert torch.equal(logits(model, ids), ref)


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
    ref = logits(model, ids)
    counts = ti.inject_llama_kernels(model, verbose=False)
    assert counts == {**TINY_LLAMA_COUNTS, "fused_add_rmsnorm": 1}
    assert ti._STATE not in layer.__dict__
    assert rel_max(logits(model, ids), ref) <= FP32_REL
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
        assert rel_max(out, ref) <= FP32_REL
        with ti.count_kernel_calls() as calls:  # hidden_states by keyword: the original layer runs
            kw_out = layer(hidden_states=h, position_ids=pos, position_embeddings=cos_sin)
        assert calls["fused_add_rms_norm"] == 0 and calls["rms_norm"] == 2
        assert rel_max(kw_out, ref) <= FP32_REL
        with pytest.raises(TypeError):
            layer(h, None, pos, position_ids=pos, position_embeddings=cos_sin)  # as the original would
    ti.remove_llama_kernels(model, verbose=False)


# --------------------------------------------------------------------------------------------
# Fallbacks
# --------------------------------------------------------------------------------------------
def test_autograd_falls_back_and_backward_works():
    gen = make_generator()
    model = _model(gen)
    assert_autograd_falls_back(
        model,
        _ids(gen),
        lambda m: ti.inject_llama_kernels(m, skinny_gemm=True, verbose=False),
        lambda m: ti.remove_llama_kernels(m, verbose=False),
    )


def test_unsupported_device_falls_back(monkeypatch):
    """CPU tensors without the interpreter: every patched forward runs the original code."""
    gen = make_generator()
    model = ti.build_llama(ti.tiny_llama_config(), device="cpu", seed=gen.seed_value % 2**31)
    ids = _ids(gen).cpu()
    ref = logits(model, ids)
    ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    monkeypatch.setattr(ti.ic, "interpreting", lambda: False)
    with ti.count_kernel_calls() as calls:
        out = logits(model, ids)
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
    assert rel_max(out32, modeling_llama.LlamaRMSNorm.forward(norm, x.float())) <= FP32_REL
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
    ref = logits(model, ids)
    ti.inject_llama_kernels(model, verbose=False)
    with ti.count_kernel_calls() as calls:
        out = logits(model, ids)
    assert len(seen) == 2
    assert calls["fused_add_rms_norm"] == 1  # layer 1 only
    assert rel_max(out, ref) <= FP32_REL
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
    ref = logits(model, ids)
    ti.inject_llama_kernels(model, verbose=False)
    assert norm.__dict__[ti._STATE]["slot"] == "_old_forward"
    with ti.count_kernel_calls() as calls:
        out = logits(model, ids)
    assert Count.n == 2 and calls["rms_norm"] == 3
    assert rel_max(out, ref) <= FP32_REL
    ti.remove_llama_kernels(model, verbose=False)
    remove_hook_from_module(norm)
    _nothing_left(model)
    assert torch.equal(logits(model, ids), ref)
    # the other order: the hook removed while the kernels are in, then the kernels
    add_hook_to_module(norm, Count())
    ti.inject_llama_kernels(model, verbose=False)
    remove_hook_from_module(norm)
    with ti.count_kernel_calls() as calls:
        assert rel_max(logits(model, ids), ref) <= FP32_REL
    assert calls["rms_norm"] == 3
    ti.remove_llama_kernels(model, verbose=False)
    _nothing_left(model)
    assert torch.equal(logits(model, ids), ref)


def test_rope_is_per_instance():
    """Two models of one (plain) model file: only the patched one's attention layers use the kernel; an
    unsupported unsqueeze_dim goes to the original; the function is restored when the last layer is
    unpatched."""
    gen = make_generator()
    a, b = prl.use_plain_rope(_model(gen)), prl.use_plain_rope(_model(gen))
    ids = _ids(gen)
    ref_b = logits(b, ids)
    ti.inject_llama_kernels(a, verbose=False)
    assert prl.current() is not prl.ORIGINAL
    with ti.count_kernel_calls() as calls:
        out_b = logits(b, ids)
    assert sum(calls.values()) == 0
    assert torch.equal(out_b, ref_b)
    q = torch.randn(1, 5, 2, 8, generator=gen).to(DEVICE)  # [B, S, H, D]: unsqueeze_dim=2
    cos, sin = torch.randn(1, 5, 8, generator=gen).to(DEVICE), torch.randn(1, 5, 8, generator=gen).to(DEVICE)
    ti._ROPE_ACTIVE.depth = 1
    try:
        with ti.count_kernel_calls() as calls:
            got = prl.current()(q, q, cos, sin, 2)
    finally:
        ti._ROPE_ACTIVE.depth = 0
    assert calls["rope_rotate_half"] == 0
    assert torch.equal(got[0], prl.ORIGINAL(q, q, cos, sin, 2)[0])
    ti.inject_llama_kernels(b, verbose=False)
    ti.remove_llama_kernels(a, verbose=False)
    assert prl.current() is not prl.ORIGINAL  # b still uses it
    ti.remove_llama_kernels(b, verbose=False)
    assert prl.current() is prl.ORIGINAL


@pytest.mark.skipif(not HUB_FORM, reason="transformers without the kernels package: no per-layer copies")
def test_rope_in_each_layers_copy():
    """With the kernels package, the kernel goes into each patched layer's own copy of the function: another
    model of the same file runs transformers' function, a call form the probe did not check (unsqueeze_dim
    given) goes to transformers' function, and removal takes the kernel out of the copies."""
    gen = make_generator()
    a, b = _model(gen), _model(gen)
    ids = _ids(gen)
    ref_a, ref_b = logits(a, ids), logits(b, ids)
    assert ti.inject_llama_kernels(a, verbose=False)["rope"] == 2
    assert _rope_fn() is ORIGINAL_ROPE
    with ti.count_kernel_calls() as calls:
        assert torch.equal(logits(b, ids), ref_b)
    assert sum(calls.values()) == 0
    with ti.count_kernel_calls() as calls:
        assert rel_max(logits(a, ids), ref_a) <= FP32_REL
    assert calls["rope_rotate_half"] == 4
    slot = a.model.layers[0].self_attn.__dict__[ti._STATE]["rope_slot"]
    q = torch.randn(1, 5, 2, 8, generator=gen).to(DEVICE)  # [B, S, H, D]: unsqueeze_dim=2
    cos, sin = torch.randn(1, 5, 8, generator=gen).to(DEVICE), torch.randn(1, 5, 8, generator=gen).to(DEVICE)
    with ti.count_kernel_calls() as calls:
        got = slot(q, q, cos, sin, unsqueeze_dim=2)
    assert calls["rope_rotate_half"] == 0
    assert torch.equal(got[0], ORIGINAL_ROPE(q, q, cos, sin, unsqueeze_dim=2)[0])
    ti.remove_llama_kernels(a, verbose=False)
    assert torch.equal(logits(a, ids), ref_a)
    _nothing_left(a)


def test_installed_transformers_gets_every_kind():
    """The Llama of the installed transformers (what a new user gets: CI installs the newest release the
    requirements allow) gets every kind, and its kernels run. Fails naming the versions it ran with."""
    import diffusers

    versions = f"transformers {transformers.__version__}, diffusers {diffusers.__version__}, torch {torch.__version__}"
    model = _model(make_generator())
    counts = ti.inject_llama_kernels(model, skinny_gemm=True, verbose=False)
    assert ti.missing_kinds(model) == {}, f"{versions}: {ti.missing_kinds(model)}"
    llama_kinds = ("rmsnorm", "fused_add_rmsnorm", "swiglu", "rope", "skinny_gemm")  # Llama has no GeGLU, no experts
    assert all(counts[k] for k in llama_kinds), f"{versions}: a kind was not injected: {counts}"
    model.to(torch.bfloat16)  # the skinny GEMM takes fp16 / bf16
    with ti.count_kernel_calls() as calls:
        logits(model, _ids(make_generator(), batch=1, length=1))  # one row: the skinny GEMM's case
    want = {"rms_norm", "fused_add_rms_norm", "swiglu", "rope_rotate_half", "skinny_gemm"}
    assert want <= set(calls), f"{versions}: these kernels never ran: {sorted(want - set(calls))}"
    ti.remove_llama_kernels(model, verbose=False)


class _RewrittenRMSNorm(modeling_llama.LlamaRMSNorm):
    """Llama's RMSNorm, written differently: same function."""

    def forward(self, x):
        dtype = x.dtype
        xf = x.float()
        inv = (xf * xf).mean(dim=-1, keepdim=True).add(self.variance_epsilon).rsqrt()
        return (xf * inv).to(dtype) * self.weight


class _HalfOffsetRMSNorm(modeling_llama.LlamaRMSNorm):
    """Gemma's (1 + weight) RMSNorm with the offset added in the weight's dtype (bf16 for a bf16 model), not
    in fp32: in half precision another function than the kernel's (fp32 1 + weight), though equal in fp32."""

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (y * (1.0 + self.weight)).to(x.dtype)


class _RewrittenLayer(modeling_llama.LlamaDecoderLayer):
    """Llama's decoder layer, written differently (other names, order of the operands, a helper): same function."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):  # fmt: skip
        skip = hidden_states
        attn_out = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            cache=cache,
            **kwargs,
        )[0]
        mid = attn_out + skip
        return mid + self.mlp(self.post_attention_layernorm(mid))


def test_recognised_by_what_it_computes(caplog):
    """Rewritten code that computes the same function gets the kernels; code that computes another function
    (an RMSNorm rounding 1 + weight to bf16) is left alone, runs its own forward, and the log line says which
    and why."""
    gen = make_generator()
    model = _model(gen)
    layers = model.model.layers
    layers[0].input_layernorm.__class__ = _RewrittenRMSNorm
    layers[1].input_layernorm.__class__ = _HalfOffsetRMSNorm
    layers[0].__class__ = _RewrittenLayer
    ids = _ids(gen)
    ref = logits(model, ids)
    with caplog.at_level("INFO", logger="transformers_injection"):
        counts = ti.inject_llama_kernels(model, verbose=False)
    assert counts == {**TINY_LLAMA_COUNTS, "rmsnorm": 4}
    assert ti._STATE in layers[0].__dict__ and ti._STATE in layers[0].input_layernorm.__dict__
    assert ti._STATE not in layers[1].input_layernorm.__dict__
    assert "_HalfOffsetRMSNorm.forward computes another function" in caplog.text
    with ti.count_kernel_calls() as calls:
        out = logits(model, ids)
    assert calls["fused_add_rms_norm"] == 2 and calls["rms_norm"] == 2
    assert rel_max(out, ref) <= FP32_REL, f"seed {gen.seed_value}"
    assert ti.missing_kinds(model) == {}  # 4 of the 5 RMSNorms run the kernel
    ti.remove_llama_kernels(model, verbose=False)
    assert torch.equal(logits(model, ids), ref)


def _rotated_the_other_way(q, k, cos, sin, unsqueeze_dim=1):
    """Not transformers' RoPE: rotates by -angle."""
    return prl.ORIGINAL(q, k, cos, -sin, unsqueeze_dim)


def test_a_kind_with_sites_but_no_kernel_warns(caplog, monkeypatch):
    """A model file whose apply_rotary_pos_emb computes something else: the RoPE is left alone, and since the
    architecture has RoPE sites, the log line is a warning naming the kind, the function and why, and
    missing_kinds reports it (the examples' ok is false then)."""
    gen = make_generator()
    model = prl.use_plain_rope(_model(gen))
    monkeypatch.setitem(vars(prl), "apply_rotary_pos_emb", _rotated_the_other_way)
    ids = _ids(gen)
    ref = logits(model, ids)
    with caplog.at_level("INFO", logger="transformers_injection"):
        counts = ti.inject_llama_kernels(model, verbose=False)
    assert counts == {**TINY_LLAMA_COUNTS, "rope": 0}
    missing = ti.missing_kinds(model)
    assert list(missing) == ["rope"] and "2 sites, none replaced" in missing["rope"]
    assert "computes another function than rotate-half RoPE" in missing["rope"]
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "WARNING rope: 2 sites, none replaced" in warnings[0].getMessage()
    assert rel_max(logits(model, ids), ref) <= FP32_REL
    assert ti.missing_kinds(model, rope=False) == {}  # not asked for: not missing
    ti.remove_llama_kernels(model, verbose=False)


def test_compiled_fullgraph_calls_the_kernels():
    """torch.compile(fullgraph=True) of an injected model traces the kernels as ops, RoPE included (under
    compile transformers calls a layer's copy of the function through the model file's instance), with the
    eager output."""
    gen = make_generator()
    model = _model(gen)
    ids = _ids(gen)
    ti.inject_llama_kernels(model, verbose=False)
    eager = logits(model, ids)
    with torch.no_grad():
        out, ops, _ = kt.run_compiled_fullgraph(model, {"input_ids": ids})
    assert {"rms_norm_fused", "swiglu", "rope_rotate_half"} <= ops, sorted(ops)
    assert rel_max(out, eager) <= FP32_REL
    ti.remove_llama_kernels(model, verbose=False)


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
    script = ROOT / "scripts" / "transformers_injection_example.py"
    r = run_python([script, "--device-free"], env=with_interpreter_speedup(env), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["ok"] is True
    assert summary["replaced"] == TINY_LLAMA_COUNTS
    assert summary["fp32"]["greedy_tokens_identical"] and summary["fp32"]["restored_bit_identical"]
    assert summary["fp32"]["patched_vs_unpatched"]["rel_max_diff"] <= 1e-4


def test_injection_main_reports_meta_counts(capsys):
    assert ti._main(["--num-layers", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["injected"] == {**ZERO, "rmsnorm": 9, "fused_add_rmsnorm": 4, "swiglu": 4, "rope": 4, "skinny_gemm": 29}
    assert out["ok"] is True and out["missing_kinds"] == {} and out["kernel_gaps"] == {}


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

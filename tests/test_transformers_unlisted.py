# SPDX-License-Identifier: Apache-2.0
"""transformers architectures the docs do not list, where the probes must tell what a part computes: a clamped
SwiGLU MLP (DeepSeek-V4), a gated RMSNorm (Falcon-H1), decoder layers with a required argument (VaultGemma), a
layer that keeps its MLP's second output, torch.nn.RMSNorm, a LayerNorm without bias, experts whose activation is a
function (LFM2-MoE). Tiny random models in fp32, the kernels through Triton's interpreter on the CPU."""

import pytest
import torch

from kernel_testing import DEVICE

ti = pytest.importorskip("transformers_injection")
transformers = pytest.importorskip("transformers")


def _tiny(model_cls, cfg, seed=0):
    torch.manual_seed(seed)
    return model_cls(cfg).eval().to(DEVICE)


def _close_to(out, ref):
    return torch.allclose(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_clamped_swiglu_mlp_is_left_alone():
    """DeepSeek-V4's MLP clamps the gate and up (swiglu_limit 10): the probe's large rows see it, so the MLP is no
    SwiGLU site (it was taken, and its output was 15 % off once activations passed the limit)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4MLP

    mlp = _tiny(DeepseekV4MLP, transformers.DeepseekV4Config(hidden_size=64, intermediate_size=128, hidden_act="silu"))
    x = torch.randn(1, 6, 64, device=DEVICE) * 8
    with torch.no_grad():
        ref = mlp(x)
        assert ti.inject_optimized_kernels(mlp, verbose=False)["swiglu"] == 0
        with ti.count_kernel_calls() as calls:
            out = mlp(x)
    assert not calls and torch.equal(out, ref)
    assert "DeepseekV4MLP.forward computes another function" in ti.missing_kinds(mlp)["swiglu"]
    ti.remove_optimized_kernels(mlp, verbose=False)


def test_gated_rmsnorm_is_named_and_left_alone():
    """Falcon-H1's gated norm, norm(x, gate): no RMSNorm site (it was one, and the first forward raised a TypeError:
    the patched forward took the input alone)."""
    cfg = transformers.FalconH1Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, mamba_rms_norm=True,
    )  # fmt: skip
    model = _tiny(transformers.FalconH1ForCausalLM, cfg)
    ids = torch.tensor([[1, 7, 23, 45, 99, 3]], device=DEVICE)
    with torch.no_grad():
        ref = model(ids).logits
        ti.inject_optimized_kernels(model, verbose=False)
        out = model(ids).logits
    assert _close_to(out, ref)
    gated = [m for m in model.modules() if type(m).__name__ == "FalconH1RMSNormGated"]
    assert gated and all(ti._STATE not in m.__dict__ for m in gated)
    assert "takes more than the input (gate)" in ti._why_not(gated[0], "rmsnorm")
    ti.remove_optimized_kernels(model, verbose=False)


def test_layer_with_a_required_argument_is_fused():
    """VaultGemma's layers take position_embeddings without a default: the probe gives it (it called the layer
    without it, and every layer was refused); a caller that leaves it out gets the original's TypeError."""
    cfg = transformers.VaultGemmaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = _tiny(transformers.VaultGemmaForCausalLM, cfg)
    ids = torch.tensor([[1, 7, 23, 45, 99, 3]], device=DEVICE)
    with torch.no_grad():
        ref = model(ids).logits
        assert ti.inject_optimized_kernels(model, verbose=False)["fused_add_rmsnorm"] == 2
        with ti.count_kernel_calls() as calls:
            out = model(ids).logits
    assert calls["fused_add_rms_norm"] == 2 and _close_to(out, ref)
    layer = model.model.layers[0]
    assert ti.layer_form(layer) == "pre-norm"
    with pytest.raises(TypeError, match="position_embeddings"), torch.no_grad():
        layer(torch.randn(1, 3, 64, device=DEVICE))
    ti.remove_optimized_kernels(model, verbose=False)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)


def _gpt_oss(layers=2):
    cfg = transformers.GptOssConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"][:layers],
    )  # fmt: skip
    return _tiny(transformers.GptOssForCausalLM, cfg)


def test_layer_that_keeps_its_mlps_second_output_is_left_alone():
    """A GPT-OSS layer that stores its router scores: the fused path would drop them, so the layer is refused (the
    pair-returning MLP's second item must be neither used nor kept)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssDecoderLayer

    class ScoreKeepingLayer(GptOssDecoderLayer):
        def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                    position_embeddings=None, **kwargs):  # fmt: skip
            residual = hidden_states
            hidden_states, _ = self.self_attn(
                hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                position_ids=position_ids, cache=cache, use_cache=use_cache,
                position_embeddings=position_embeddings, **kwargs,
            )  # fmt: skip
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states, self.router_scores = self.mlp(self.post_attention_layernorm(hidden_states))
            return residual + hidden_states

    model = _gpt_oss()
    for layer in model.model.layers:
        layer.__class__ = ScoreKeepingLayer
    assert ti.inject_optimized_kernels(model, verbose=False)["fused_add_rmsnorm"] == 0
    assert "keeps its MLP's second output" in ti.missing_kinds(model)["fused_add_rmsnorm"]
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 6), device=DEVICE))
    assert all(hasattr(layer, "router_scores") for layer in model.model.layers)
    ti.remove_optimized_kernels(model, verbose=False)


def test_pair_mlp_output_is_unpacked_as_the_layer_does():
    """A hook that hands on GPT-OSS's MoE output alone: the stock layer's `h, _ = mlp(h)` raises on a batch of 3;
    the fused layer raises the same (it took row 0 of the output and broadcast it over the batch)."""
    model = _gpt_oss()
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda m, i, o: o[0])
    ids = torch.randint(0, 256, (3, 6), device=DEVICE)
    with pytest.raises(ValueError, match="too many values to unpack"), torch.no_grad():
        model(ids)
    ti.inject_optimized_kernels(model, verbose=False)
    with pytest.raises(ValueError, match="too many values to unpack"), torch.no_grad():
        model(ids)
    ti.remove_optimized_kernels(model, verbose=False)


def test_torch_rmsnorm_is_a_site_and_layernorm_is_none():
    """torch.nn.RMSNorm runs the kernel (the probe dropped its normalized_shape, a tuple, and refused it); a
    LayerNorm without bias is no RMSNorm site (it was counted as one and warned about)."""

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(64, eps=1e-6)
            self.ln = torch.nn.LayerNorm(64, bias=False)

        def forward(self, x):
            return self.ln(self.norm(x))

    m = Tiny().to(DEVICE)
    with torch.no_grad():
        m.norm.weight.normal_(1.0, 0.2)
    x = torch.randn(2, 5, 64, device=DEVICE)
    with torch.no_grad():
        ref = m(x)
        assert ti.inject_optimized_kernels(m, verbose=False)["rmsnorm"] == 1
        with ti.count_kernel_calls() as calls:
            out = m(x)
    assert calls["rms_norm"] == 1 and _close_to(out, ref)
    assert ti.coverage(m)["rmsnorm"]["sites"] == 1 and not ti.missing_kinds(m)
    ti.remove_optimized_kernels(m, verbose=False)


def test_experts_with_a_function_activation_are_named():
    """LFM2-MoE's experts hold F.silu as act_fn (no module): the log says so (it said they compute another
    function than act(gate) * up, which they do not)."""
    cfg = transformers.Lfm2MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        layer_types=["conv", "full_attention"], num_dense_layers=1,
    )  # fmt: skip
    model = _tiny(transformers.Lfm2MoeForCausalLM, cfg)
    ti.inject_optimized_kernels(model, verbose=False)
    why = ti.missing_kinds(model)["moe_swiglu"]
    assert "activation act_fn is a function, not a module" in why and "not the act(gate) * up" not in why
    ti.remove_optimized_kernels(model, verbose=False)


def test_optional_argument_derived_from_a_required_one_is_refused():
    """A layer whose optional argument falls back to a required one (position_embeddings_local = position_embeddings
    when left out): no default can be recorded for it, so the layer is refused (the probe's sentinel was recorded
    as its default and handed to the real self_attn when a caller left it out)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(16, 16)

        def forward(self, hidden_states, position_embeddings, position_embeddings_local=None, **kw):
            assert isinstance(position_embeddings_local, torch.Tensor), repr(position_embeddings_local)
            return self.q(hidden_states) + position_embeddings_local, None

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = Attn(), torch.nn.Linear(16, 16)
            self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(16), LlamaRMSNorm(16)

        def forward(self, hidden_states, position_embeddings, position_embeddings_local=None, **kwargs):
            if position_embeddings_local is None:
                position_embeddings_local = position_embeddings
            h, _ = self.self_attn(
                hidden_states=self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                position_embeddings_local=position_embeddings_local, **kwargs,
            )  # fmt: skip
            h = hidden_states + h
            return h + self.mlp(self.post_attention_layernorm(h))

    torch.manual_seed(0)
    layer = Layer().eval().to(DEVICE)
    x, pe = torch.randn(1, 3, 16, device=DEVICE), torch.randn(1, 3, 16, device=DEVICE)
    with torch.no_grad():
        ref = layer(x, pe)
        assert ti.inject_optimized_kernels(torch.nn.ModuleList([layer]), verbose=False)["fused_add_rmsnorm"] == 0
        assert _close_to(layer(x, pe), ref)  # (its norms run the RMSNorm kernel)
    assert "derives an optional argument from a required one" in ti._why_not(layer, "fused_add_rmsnorm")

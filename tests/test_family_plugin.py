# SPDX-License-Identifier: Apache-2.0
"""A model family written from outside the bundle with its public names only (references/adding-a-model.md):
a DiT-style model the bundle does not know, a plug-in that gives it the generic kernels and fuses its blocks'
norm + modulation and gated residual + norm + modulation, registered with register_family. The injected
model computes what the stock one does, runs the fused kernels, and removal restores it bit for bit."""

import torch
from diffusers.models.attention import FeedForward
from diffusers.models.attention_processor import Attention, AttnProcessor2_0
from diffusers.models.normalization import RMSNorm
from torch import nn

import diffusers_injection as di
import generic_injection as gi
import injection_common as ic
import rmsnorm
from kernel_testing import DEVICE, count_calls, make_generator


# ---- the model the bundle does not know -------------------------------------------------------------
class ToyBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        self.norm2 = RMSNorm(dim, eps=1e-6, elementwise_affine=False)
        self.attn = Attention(dim, heads=heads, dim_head=dim // heads, qk_norm="rms_norm", processor=AttnProcessor2_0())
        self.ff = FeedForward(dim, activation_fn="gelu-approximate")
        self.table = nn.Parameter(torch.randn(6, dim) / dim**0.5)

    def forward(self, h, temb):
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.table + temb.unflatten(1, (6, -1))).unbind(1)
        h = h + gate1[:, None] * self.attn(self.norm1(h) * (1 + scale1[:, None]) + shift1[:, None])
        return h + gate2[:, None] * self.ff(self.norm2(h) * (1 + scale2[:, None]) + shift2[:, None])


class ToyModel(nn.Module):
    def __init__(self, dim=32, heads=2, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock(dim, heads) for _ in range(depth))
        self.time = nn.Linear(dim, 6 * dim)
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, h, t):
        temb = self.time(t)
        for block in self.blocks:
            h = block(h, temb)
        return self.norm_out(h)


# ---- the plug-in: public names only --------------------------------------------------------------------
class ToyFamily:
    KINDS = ("toy_blocks",)
    STATE = ic.register_state_key("_toy_family")  # its own record key: it never undoes another's patches

    @staticmethod
    def find_models(pipe_or_model):
        return [m for m in ic.unique_modules(pipe_or_model) if type(m) is ToyModel]

    @classmethod
    def inject(cls, pipe_or_model, *, verbose=False):
        for model in cls.find_models(pipe_or_model):
            gi.inject_generic_kernels(model, verbose=False)  # norms, GELU, RoPE: the shared modules
            for block in model.blocks:
                if type(block).forward is ToyBlock.forward:  # a subclass with its own forward: left alone
                    gi.patch(block, toy_block_forward, "toy_blocks", cls.STATE)
        return cls.injected_counts(pipe_or_model)

    @classmethod
    def remove(cls, pipe_or_model, *, verbose=False):
        restored = {k: 0 for k in cls.KINDS}
        for model in cls.find_models(pipe_or_model):
            for block in model.blocks:
                restored["toy_blocks"] += gi.unpatch(block, cls.STATE) is not None
            gi.remove_generic_kernels(model, verbose=False)
        return restored

    @classmethod
    def injected_counts(cls, pipe_or_model):
        return ic.kind_counts(ic.unique_modules(pipe_or_model), cls.STATE, cls.KINDS)


def toy_block_forward(self, h, temb):
    """ToyBlock.forward with norm1 + modulation and `h + gate1 * attn` + norm2 + modulation as one kernel each
    (module level: the model pickles)."""
    if ic.needs_autograd(self, h, temb):
        return gi.original(self)(h, temb)
    shift1, scale1, gate1, shift2, scale2, gate2 = (self.table + temb.unflatten(1, (6, -1))).unbind(1)
    a = self.attn(gi.norm_modulate(self.norm1, h, scale1, shift1))
    h, x = gi.residual_norm_modulate(h, a, gate1, self.norm2, scale2, shift2)
    return gi.gated_add(h, gate2, self.ff(x))


# ---- the test ---------------------------------------------------------------------------------------
def test_a_family_written_with_public_names(monkeypatch):
    gen = make_generator()
    torch.manual_seed(gen.seed_value)
    model = ToyModel().to(DEVICE).eval().requires_grad_(False)
    h, t = torch.randn(2, 7, 32, generator=gen).to(DEVICE), torch.randn(2, 32, generator=gen).to(DEVICE)
    with torch.no_grad():
        ref = model(h, t)
    monkeypatch.setattr(di, "FAMILIES", list(di.FAMILIES))  # registered for this test only
    di.register_family(ToyFamily, first=True)

    counts = di.inject_optimized_kernels(model, verbose=False)
    assert counts["toy_blocks"] == 2 and counts["generic_rmsnorm"] == 2 * 4  # norm1, norm2 and the q/k norms
    assert counts["generic_gelu_tanh"] == 2 and counts["generic_layernorm"] == 1
    calls = count_calls(monkeypatch, [(rmsnorm, "rms_norm_modulate"), (rmsnorm, "gated_residual_rms_norm_modulate")])
    with torch.no_grad():
        out = model(h, t)
    assert calls["rms_norm_modulate"] == 2 and calls["gated_residual_rms_norm_modulate"] == 2
    assert float((out - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), f"seed {gen.seed_value}"
    assert di.injected_counts(model) == counts

    restored = di.remove_optimized_kernels(model, verbose=False)
    assert restored["toy_blocks"] == 2 and not any(ic.bundle_state(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(h, t), ref)

# SPDX-License-Identifier: Apache-2.0
"""Put the project's Triton kernels into diffusers' MMDiT transformers (SD3 / SD3.5 and FLUX), and take
them out again.

    counts = inject_mmdit_kernels(pipe)      # or a bare SD3Transformer2DModel / FluxTransformer2DModel
    ...                                      # pipe(...) now runs the kernels
    remove_mmdit_kernels(pipe)               # original forwards and processors are back

``diffusers_injection.inject_optimized_kernels`` calls these functions too, for the SD3 / FLUX
transformers it finds. What is replaced, per kind (counts on SD3.5-medium / FLUX.1-dev):

* ``mmdit_adaln_zero`` (34 / 38): ``AdaLayerNormZero``: its linear layer as before, then LayerNorm +
  ``* (1 + scale_msa) + shift_msa`` in one kernel (``layernorm.layer_norm_modulate``).
* ``mmdit_adaln_zero_x`` (13 / 0): SD3.5's ``SD35AdaLayerNormZeroX``: one LayerNorm, two modulations,
  one kernel reading x once (``layernorm.layer_norm_modulate_dual``).
* ``mmdit_adaln_zero_single`` (0 / 38): FLUX's ``AdaLayerNormZeroSingle``.
* ``mmdit_adaln_continuous`` (2 / 1): ``AdaLayerNormContinuous`` (``norm_out``, and SD3's last
  ``norm1_context``): note its chunk order is (scale, shift), not (shift, scale).
* ``mmdit_fused_blocks`` (24 / 57): ``JointTransformerBlock`` / ``FluxTransformerBlock`` /
  ``FluxSingleTransformerBlock`` forwards: ``h + gate * attn`` then norm2 + MLP modulation in one kernel
  (``layernorm.gated_residual_layer_norm_modulate``, returning both the residual and the normalised
  input of the feed-forward), the same for the text stream, and ``rmsnorm.gated_residual_add`` for
  the other gated residual adds. Between two blocks of one kind, a block's last gated residual also
  computes the next block's norm1 (and AdaLayerNormZero norm1_context) in the same kernel; the next
  block uses that result only if it receives the very same hidden states (see _CARRY, ic.next_block).
* ``mmdit_qk_norm_fused`` (37 / 0): SD3 attention processors (``JointAttnProcessor2_0`` with
  ``qk_norm="rms_norm"``): the per-head q/k RMSNorms of the image and text streams in one launch,
  written straight into the concatenated ``[B, S_img + S_txt, H, D]`` buffers that SDPA reads
  (``head_norm_rope.joint_head_rms_norm_rope``); the SDPA call is unchanged.
* ``mmdit_qk_norm_rope_fused`` (0 / 57): FLUX processors (``FluxAttnProcessor``): per-head q/k RMSNorms
  of text and image, concatenation and the rotary embedding in one launch; ``dispatch_attention_fn`` as
  before.
* ``mmdit_gelu_tanh`` (47 / 76): diffusers ``GELU(approximate="tanh")`` (feed-forwards) and
  ``torch.nn.GELU(approximate="tanh")`` (FLUX single blocks): ``activations.gelu_tanh``; a
  feed-forward's projection + activation run as one GEMM with the activation in its epilogue where
  the device's BLAS computes the tanh form (``injection_common.linear_gelu_tanh``).

Modules are recognised by exact class; anything else is left untouched. Every patched forward reads its
parameters when it runs and falls back to the original operations for inputs the kernels do not cover
(autograd, a device the kernels cannot run on, unusual dtype mixes, FF chunking). Injecting twice
changes nothing; removal restores the original forwards and processors, so outputs become bit-identical
to the unpatched model.

Also here: ``build_sd3_transformer`` / ``build_flux_transformer`` (tiny test models, or the released
SD3.5-medium / SD3-medium / FLUX.1-dev architectures with random weights, no hub access) and
``make_mmdit_inputs`` (the keyword arguments of one transformer forward, as the pipelines build them).
Run ``python mmdit_injection.py`` for the counts on the real architectures (meta device, no memory).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the leaf kernels live beside this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers.models.activations import GELU as DiffusersGELU  # noqa: E402
from diffusers.models.attention import JointTransformerBlock  # noqa: E402
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0  # noqa: E402
from diffusers.models.embeddings import apply_rotary_emb  # noqa: E402
from diffusers.models.normalization import (  # noqa: E402
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    SD35AdaLayerNormZeroX,
)
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_flux import (  # noqa: E402
    FluxAttention,
    FluxAttnProcessor,
    FluxSingleTransformerBlock,
    FluxTransformer2DModel,
    FluxTransformerBlock,
)
from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel  # noqa: E402
from torch import nn  # noqa: E402

import fp8_linear  # noqa: E402
import generic_injection as gi  # noqa: E402
import head_norm_rope  # noqa: E402
import injection_common as ic  # noqa: E402

__all__ = [
    "inject_mmdit_kernels",
    "remove_mmdit_kernels",
    "mmdit_injected_counts",
    "find_mmdit_models",
    "SD3FusedJointAttnProcessor",
    "FluxFusedAttnProcessor",
    "flux_qk_norm_rope",
    "build_sd3_transformer",
    "build_flux_transformer",
    "make_mmdit_inputs",
    "SD3_CONFIGS",
    "FLUX_CONFIGS",
    "KINDS",
]

logger = logging.getLogger("mmdit_injection")

KINDS = (
    "mmdit_adaln_zero",
    "mmdit_adaln_zero_x",
    "mmdit_adaln_zero_single",
    "mmdit_adaln_continuous",
    "mmdit_fused_blocks",
    "mmdit_qk_norm_fused",
    "mmdit_qk_norm_rope_fused",
    "mmdit_gelu_tanh",
)

# Per-module record of what was patched and how to undo it. A key of its own (not the one of
# diffusers_injection.py), so the two injectors never undo each other's patches.
_STATE = ic.register_state_key("_rtk_mmdit_injection")
_HALF = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_PROCESSOR_KINDS = ("mmdit_qk_norm_fused", "mmdit_qk_norm_rope_fused")


# --------------------------------------------------------------------------------------------
# When may a kernel run?
# --------------------------------------------------------------------------------------------
_interpreting = ic.interpreting
_usable = ic.usable


# torch.nn.RMSNorm (FLUX's q/k norms) multiplies the weight in fp32 and rounds once in current torch
# releases; others rounded to the input dtype before the weight multiply: probed once (the generic layer's
# gi._torch_rms_rounding), at injection, before any torch.compile trace reads it.


# --------------------------------------------------------------------------------------------
# Patching instance forwards, reversibly (the mechanism of diffusers_injection.py, own state key)
# --------------------------------------------------------------------------------------------
def _patch_forward(module: nn.Module, fn, kind: str) -> bool:
    """Make fn(module, ...) the module's forward (see injection_common.patch_forward)."""
    return ic.patch_forward(module, fn, kind, _STATE)


def _original_forward(module: nn.Module):
    """The forward the module had before patching (used for inputs the kernels do not cover)."""
    return ic.original_forward(module, _STATE)


def _patch_processor(attn: nn.Module, proc, kind: str) -> bool:
    if _STATE in attn.__dict__:
        return False
    prev = attn.processor
    ic.carry_processor_settings(prev, proc)  # keep backend / parallel choices
    attn.set_processor(proc)
    attn.__dict__[_STATE] = {"kind": kind, "prev": prev}
    return True


# --------------------------------------------------------------------------------------------
# A block's last gated residual fused with the next block's AdaLN norm
# --------------------------------------------------------------------------------------------
# Between two blocks the stream is h = h + gate_mlp * ff(...) (end of block i), then the next block's
# norm1: LayerNorm(h) * (1 + scale_msa) + shift_msa. Apart that is two kernels and an extra read of h;
# block i runs both in one (layernorm.gated_residual_layer_norm_modulate[_dual]) and leaves the norm's
# outputs in the next block's carry dict. The next block takes them only if it receives that very h
# and temb (identity), so anything done to h between the blocks (ControlNet residuals, skipped
# blocks) makes it compute its norm itself. Set up by inject_mmdit_kernels for consecutive blocks of
# one transformer: ic.link_next(block i, block i + 1) (kept outside the blocks), _CARRY on every linked block.
_CARRY = "_rtk_mmdit_carry"


def _residual_into_adaln(h, gate, y, norm, temb):
    """(h + gate[:, None] * y, the outputs of norm(h_new, emb=temb)) for an AdaLayerNormZero or
    SD35AdaLayerNormZeroX norm whose embedding comes from temb (one kernel where it reproduces the
    module, the original operations otherwise); None for any other norm."""
    if getattr(norm, "emb", None) is not None:
        return None
    # the next block's norm is computed here, before that block runs: it and its layers must run nothing
    # but their forwards (no hook would see or change what they compute)
    if not all(ic.unwrapped(m, _STATE) for m in norm.modules()):
        return None
    if type(norm) is AdaLayerNormZero:
        return gi.adaln_zero_apply(norm, h, temb, y, gate)
    if type(norm) is SD35AdaLayerNormZeroX:
        return gi.adaln_zero_x_apply(norm, h, temb, y, gate)
    return None


def _gated_add_to_next(block, key, h, gate, y, temb):
    """The block's last gated residual h + gate[:, None] * y; fused with the next block's norm1 (key "x")
    or norm1_context (key "c") when the blocks are linked and the kernel reproduces that norm."""
    nxt = ic.next_block(block)
    if nxt is not None and ic.may_carry(block, nxt, temb, _STATE):
        fused = _residual_into_adaln(h, gate, y, nxt.norm1 if key == "x" else nxt.norm1_context, temb)
        if fused is not None:
            ic.put_carry(nxt, _CARRY, key, fused[0], temb, fused[1])
            return fused[0]
    return gi.gated_add(h, gate, y)


def _take_carry(block, key, h, temb):
    """The norm outputs the previous block computed for this block's input h, or None (always clears)."""
    return ic.take_carry(block, _CARRY, key, h, temb)


def _link_blocks(model) -> None:
    """Link consecutive patched blocks of one transformer for _gated_add_to_next (idempotent)."""
    blocks = list(getattr(model, "transformer_blocks", None) or [])
    for i, blk in enumerate(blocks):
        if type(blk) not in (JointTransformerBlock, FluxTransformerBlock) or _STATE not in blk.__dict__:
            continue
        blk.__dict__.setdefault(_CARRY, {})
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        linked = nxt is not None and type(nxt) is type(blk) and _STATE in nxt.__dict__
        ic.link_next(blk, nxt if linked else None)
        if linked:
            nxt.__dict__.setdefault(_CARRY, {})


# --------------------------------------------------------------------------------------------
# Replacement forwards: activations
# --------------------------------------------------------------------------------------------
# diffusers GELU(approximate="tanh"): LTX-Video's replacement (the projection with the activation in its
# epilogue where the device's BLAS verifiably computes the tanh form, else the projection, then the kernel)
_diffusers_gelu_tanh_forward = gi._gelu_tanh_forward


_torch_gelu_tanh_forward = gi._torch_gelu_tanh_forward


# --------------------------------------------------------------------------------------------
# Replacement forwards: transformer blocks
# --------------------------------------------------------------------------------------------
def _joint_block_forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
    """JointTransformerBlock.forward (SD3 / SD3.5) with the residual + norm2 + modulation steps fused.

    Same math as diffusers' block; the kernels compute each fused step in fp32 and round once.
    """
    carried_x = _take_carry(self, "x", hidden_states, temb)  # norm1 / norm1_context outputs the previous
    carried_c = _take_carry(self, "c", encoder_hidden_states, temb)  # block computed with its residual
    if self._chunk_size is not None:  # chunked feed-forward: the original code
        return _original_forward(self)(hidden_states, encoder_hidden_states, temb, joint_attention_kwargs)
    joint_attention_kwargs = joint_attention_kwargs or {}
    if self.use_dual_attention:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp, norm_hidden_states2, gate_msa2 = (
            carried_x if carried_x is not None and len(carried_x) == 7 else self.norm1(hidden_states, emb=temb)
        )
    else:
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            carried_x if carried_x is not None and len(carried_x) == 5 else self.norm1(hidden_states, emb=temb)
        )
    if self.context_pre_only:
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states, temb)
    else:
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
            carried_c if carried_c is not None else self.norm1_context(encoder_hidden_states, emb=temb)
        )

    attn_output, context_attn_output = _attend(
        self.attn, joint_attention_kwargs, norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states
    )
    if self.use_dual_attention:
        hidden_states = gi.gated_add(hidden_states, gate_msa, attn_output)
        attn_output2 = _attend(self.attn2, joint_attention_kwargs, norm_hidden_states2)
        hidden_states, norm_hidden_states = gi.residual_norm_modulate(
            hidden_states, attn_output2, gate_msa2, self.norm2, scale_mlp, shift_mlp
        )
    else:
        hidden_states, norm_hidden_states = gi.residual_norm_modulate(
            hidden_states, attn_output, gate_msa, self.norm2, scale_mlp, shift_mlp
        )
    ff_output = gi.feed_forward(self.ff, norm_hidden_states, _STATE)
    hidden_states = _gated_add_to_next(self, "x", hidden_states, gate_mlp, ff_output, temb)

    if self.context_pre_only:
        encoder_hidden_states = None
    else:
        encoder_hidden_states, norm_encoder_hidden_states = gi.residual_norm_modulate(
            encoder_hidden_states, context_attn_output, c_gate_msa, self.norm2_context, c_scale_mlp, c_shift_mlp
        )
        context_ff_output = gi.feed_forward(self.ff_context, norm_encoder_hidden_states, _STATE)
        encoder_hidden_states = _gated_add_to_next(
            self, "c", encoder_hidden_states, c_gate_mlp, context_ff_output, temb
        )
    return encoder_hidden_states, hidden_states


def _attention(attn, hidden_states, encoder_hidden_states, image_rotary_emb, kwargs):
    """The processor of attn called directly, or None where the block must call attn itself. diffusers
    0.42's Attention.forward (SD3) and FluxAttention.forward only drop keyword arguments their processor
    does not take, found with inspect.signature on every call, then call the processor; with no extra
    keyword arguments, no hook and no replaced forward, calling the processor is that call."""
    if kwargs or "forward" in attn.__dict__ or not ic.hook_free(attn):
        return None
    if type(attn) is FluxAttention:
        return attn.processor(attn, hidden_states, encoder_hidden_states, None, image_rotary_emb)
    if type(attn) is Attention and image_rotary_emb is None:
        return attn.processor(attn, hidden_states, encoder_hidden_states=encoder_hidden_states, attention_mask=None)
    return None


def _attend(attn, kwargs: dict, hidden_states, **inputs):
    """attn(hidden_states=hidden_states, **inputs, **kwargs), inputs being encoder_hidden_states and
    image_rotary_emb where the block passes them: its processor called directly where that is the same
    call (_attention)."""
    out = _attention(attn, hidden_states, inputs.get("encoder_hidden_states"), inputs.get("image_rotary_emb"), kwargs)
    return out if out is not None else attn(hidden_states=hidden_states, **inputs, **kwargs)


def _flux_block_forward(
    self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None
):
    """FluxTransformerBlock.forward (double stream) with the residual + norm2 + modulation steps fused."""
    carried_x = _take_carry(self, "x", hidden_states, temb)
    carried_c = _take_carry(self, "c", encoder_hidden_states, temb)
    norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        carried_x if carried_x is not None else self.norm1(hidden_states, emb=temb)
    )
    norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
        carried_c if carried_c is not None else self.norm1_context(encoder_hidden_states, emb=temb)
    )
    joint_attention_kwargs = joint_attention_kwargs or {}
    attention_outputs = _attend(
        self.attn,
        joint_attention_kwargs,
        norm_hidden_states,
        encoder_hidden_states=norm_encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
    )
    ip_attn_output = None
    if len(attention_outputs) == 3:
        attn_output, context_attn_output, ip_attn_output = attention_outputs
    else:
        attn_output, context_attn_output = attention_outputs

    hidden_states, norm_hidden_states = gi.residual_norm_modulate(
        hidden_states, attn_output, gate_msa, self.norm2, scale_mlp, shift_mlp
    )
    ff_output = gi.feed_forward(self.ff, norm_hidden_states, _STATE)
    if ip_attn_output is not None:  # h changes after the gated residual: no fusion into the next norm
        hidden_states = gi.gated_add(hidden_states, gate_mlp, ff_output) + ip_attn_output
    else:
        hidden_states = _gated_add_to_next(self, "x", hidden_states, gate_mlp, ff_output, temb)

    encoder_hidden_states, norm_encoder_hidden_states = gi.residual_norm_modulate(
        encoder_hidden_states, context_attn_output, c_gate_msa, self.norm2_context, c_scale_mlp, c_shift_mlp
    )
    context_ff_output = gi.feed_forward(self.ff_context, norm_encoder_hidden_states, _STATE)
    if encoder_hidden_states.dtype == torch.float16:  # clipped below: no fusion into the next norm
        encoder_hidden_states = gi.gated_add(encoder_hidden_states, c_gate_mlp, context_ff_output)
    else:
        encoder_hidden_states = _gated_add_to_next(
            self, "c", encoder_hidden_states, c_gate_mlp, context_ff_output, temb
        )
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _tanh_gelu_modules(model):
    """diffusers GELU(approximate="tanh") modules of model (the ones with a projection)."""
    return [m for m in model.modules() if type(m) is DiffusersGELU and m.approximate == "tanh"]


def _plain_tanh_gelu(act) -> bool:
    """act is a torch.nn.GELU(approximate="tanh") with no hooks and no forward but its own or ours
    (ours may sit in the instance dict, or behind accelerate's hook as _old_forward: then act has a hook)."""
    if type(act) is not nn.GELU or act.approximate != "tanh" or act._forward_hooks or act._forward_pre_hooks:
        return False
    # Read through the instance dict with injection_common.patched_function: under torch.compile, torch
    # 2.11 traced act.forward.__func__, and getattr(f, "__func__", None), to a different answer than eager
    # (False for our forward: FLUX's single blocks ran GEMM + GELU kernel under compile instead of the
    # fused call), and torch 2.13 to False for the class's own forward. patched_function gives eager's
    # answer under compile too (tests/test_mmdit_injection.py checks it under the installed torch).
    if "forward" not in act.__dict__:
        return True
    return ic.patched_function(act.__dict__["forward"]) is _torch_gelu_tanh_forward


def _flux_single_block_forward(
    self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None
):
    """FluxSingleTransformerBlock.forward with the gated residual as one kernel (see gi.gated_add), and
    proj_mlp + its tanh-GELU as one GEMM where injection_common.linear_gelu_tanh applies."""
    text_seq_len = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
    mlp_hidden_states = None
    if _plain_tanh_gelu(self.act_mlp):  # proj_mlp + act_mlp as one GEMM where verified (linear_gelu_tanh)
        mlp_hidden_states = ic.linear_gelu_tanh(norm_hidden_states, self.proj_mlp)
    if mlp_hidden_states is None:
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))
    joint_attention_kwargs = joint_attention_kwargs or {}
    attn_output = _attend(self.attn, joint_attention_kwargs, norm_hidden_states, image_rotary_emb=image_rotary_emb)
    hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
    hidden_states = gi.gated_add(residual, gate, self.proj_out(hidden_states))
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    encoder_hidden_states, hidden_states = hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return encoder_hidden_states, hidden_states


# --------------------------------------------------------------------------------------------
# Attention processors
# --------------------------------------------------------------------------------------------
_torch_rmsnorm_eps = ic.torch_rmsnorm_eps


def _fusable_parts(parts, head_dim, dtype, norm_cls):
    """(weights per part, eps per part, cast_before_weight) if every (q, k, norm_q, norm_k) part can go
    through head_norm_rope with the modules' exact numerics, else None.

    norm_cls torch.nn.RMSNorm (FLUX): weight in q's dtype; rounding probed from the installed torch.
    norm_cls diffusers RMSNorm (SD3): no bias; a half weight rounds before the multiply; an fp32 weight
    needs fp32 activations (the module would promote bf16 activations to an fp32 output).
    """
    weights, eps_list, dtypes = [], [], set()
    for q, k, nq, nk in parts:
        if type(nq) is not norm_cls or type(nk) is not norm_cls or q.shape != k.shape or q.dtype != dtype:
            return None
        if not (ic.unwrapped(nq) and ic.unwrapped(nk)):  # a hook (or forward) the fused path would not run
            return None
        if norm_cls is nn.RMSNorm:
            if tuple(nq.normalized_shape) != (head_dim,) or tuple(nk.normalized_shape) != (head_dim,):
                return None
            eq, ek = _torch_rmsnorm_eps(nq), _torch_rmsnorm_eps(nk)
        else:
            if (
                tuple(nq.dim) != (head_dim,)
                or tuple(nk.dim) != (head_dim,)
                or nq.bias is not None
                or nk.bias is not None
            ):
                return None
            eq, ek = float(nq.eps), float(nk.eps)
        if eq != ek or (nq.weight is None) != (nk.weight is None):
            return None
        for w in (nq.weight, nk.weight):
            if w is not None:
                dtypes.add(w.dtype)
        weights.append((nq.weight, nk.weight))
        eps_list.append(eq)
    if len({w[0] is None for w in weights}) != 1 or len(dtypes) > 1:
        return None
    wdtype = next(iter(dtypes)) if dtypes else dtype
    if norm_cls is nn.RMSNorm:
        if wdtype != dtype:
            return None
        cbw = gi._torch_rms_rounding()
    else:
        if dtypes and wdtype != dtype:
            return None
        cbw = wdtype in _HALF
    return weights, eps_list, cbw


class SD3FusedJointAttnProcessor:
    """JointAttnProcessor2_0 (SD3 / SD3.5 with ``qk_norm="rms_norm"``) with the per-head q/k RMSNorms of
    the image and the text stream in ONE launch, written into the concatenated [B, S_img + S_txt, H, D]
    buffers SDPA reads (no transposed copies, no torch.cat of q and k). The SDPA call and the output
    projections are diffusers'. Inputs the kernel does not cover run the original operations."""

    def __call__(
        self, attn: Attention, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs
    ):
        residual = hidden_states
        batch_size = hidden_states.shape[0]

        # (with FP8 layers each input is quantised once for its three projections: fp8_linear.project)
        query, key, value = fp8_linear.project(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        # [B, S, H, D] views of the projections (the original transposes them to [B, H, S, D])
        query = query.view(batch_size, -1, attn.heads, head_dim)
        key = key.view(batch_size, -1, attn.heads, head_dim)
        value = value.view(batch_size, -1, attn.heads, head_dim)
        parts = [(query, key, attn.norm_q, attn.norm_k)]
        values = [value]
        if encoder_hidden_states is not None:
            shape = (batch_size, -1, attn.heads, head_dim)
            eq, ek, ev = fp8_linear.project(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            parts.append((eq.view(shape), ek.view(shape), attn.norm_added_q, attn.norm_added_k))
            values.append(ev.view(shape))

        fusable = _fusable_parts(parts, head_dim, query.dtype, DiffusersRMSNorm)
        if fusable is not None and _usable(*(t for p in parts for t in p[:2]), *(w for pw in fusable[0] for w in pw)):
            weights, eps, cbw = fusable
            q_out, k_out = head_norm_rope.joint_head_rms_norm_rope(
                [(p[0], p[1], w[0], w[1]) for p, w in zip(parts, weights)], eps, cast_before_weight=cbw
            )
            value = torch.cat(values, dim=1) if len(values) > 1 else values[0]
            query, key, value = q_out.transpose(1, 2), k_out.transpose(1, 2), value.transpose(1, 2)
        else:  # the original sequence
            qs, ks = [], []
            for q, k, nq, nk in parts:
                q, k = q.transpose(1, 2), k.transpose(1, 2)
                qs.append(nq(q) if nq is not None else q)
                ks.append(nk(k) if nk is not None else k)
            query, key = torch.cat(qs, dim=2), torch.cat(ks, dim=2)
            value = torch.cat([v.transpose(1, 2) for v in values], dim=2)

        hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, : residual.shape[1]],
                hidden_states[:, residual.shape[1] :],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


def _flux_projections(attn, hidden_states, encoder_hidden_states):
    """FLUX's q/k/v (and text q/k/v) projections, fused or not, as diffusers' processor makes them."""
    if getattr(attn, "fused_projections", False):
        query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        eq = ek = ev = None
        if encoder_hidden_states is not None and hasattr(attn, "to_added_qkv"):
            eq, ek, ev = attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1)
        return query, key, value, eq, ek, ev
    # (with FP8 layers each input is quantised once for its three projections: fp8_linear.project)
    query, key, value = fp8_linear.project(hidden_states, attn.to_q, attn.to_k, attn.to_v)
    eq = ek = ev = None
    if encoder_hidden_states is not None and attn.added_kv_proj_dim is not None:
        eq, ek, ev = fp8_linear.project(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
    return query, key, value, eq, ek, ev


class FluxFusedAttnProcessor:
    """FluxAttnProcessor with the per-head q/k RMSNorms of the text and image streams, their
    concatenation and the rotary embedding in ONE launch (head_norm_rope.joint_head_rms_norm_rope),
    writing the [B, S_txt + S_img, H, D] q and k that dispatch_attention_fn takes. Attention and the
    output projections are diffusers'. Inputs the kernel does not cover run the original operations."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        image_rotary_emb=None,
    ) -> torch.Tensor:
        query, key, value, encoder_query, encoder_key, encoder_value = _flux_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = query.unflatten(-1, (-1, attn.head_dim))
        key = key.unflatten(-1, (-1, attn.head_dim))
        value = value.unflatten(-1, (-1, attn.head_dim))
        parts, values = [(query, key, attn.norm_q, attn.norm_k)], [value]
        if attn.added_kv_proj_dim is not None:
            encoder_query = encoder_query.unflatten(-1, (-1, attn.head_dim))
            encoder_key = encoder_key.unflatten(-1, (-1, attn.head_dim))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            parts.insert(0, (encoder_query, encoder_key, attn.norm_added_q, attn.norm_added_k))
            values.insert(0, encoder_value)
        query, key, value = flux_qk_norm_rope(parts, values, attn.head_dim, image_rotary_emb)

        hidden_states = gi.dispatch_attention(self, query, key, value, attention_mask)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
            )
            hidden_states = attn.to_out[0](hidden_states.contiguous())
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states
        return hidden_states


def _fused_qk(parts, head_dim, image_rotary_emb):
    """(q, k) from the kernel, or None when it would not reproduce the modules."""
    fusable = _fusable_parts(parts, head_dim, parts[0][0].dtype, nn.RMSNorm)
    if fusable is None:
        return None
    cos = sin = None
    if image_rotary_emb is not None:
        if not (isinstance(image_rotary_emb, (tuple, list)) and len(image_rotary_emb) == 2):
            return None
        cos, sin = image_rotary_emb
        total = sum(p[0].shape[1] for p in parts)
        if not all(
            isinstance(t, torch.Tensor) and t.dim() == 2 and tuple(t.shape) == (total, head_dim) for t in (cos, sin)
        ):
            return None
    weights, eps, cbw = fusable
    if not _usable(*(t for p in parts for t in p[:2]), *(w for pw in weights for w in pw), cos, sin):
        return None
    return head_norm_rope.joint_head_rms_norm_rope(
        [(p[0], p[1], w[0], w[1]) for p, w in zip(parts, weights)], eps, cos, sin, cast_before_weight=cbw
    )


def flux_qk_norm_rope(parts, values, head_dim, image_rotary_emb):
    """q, k and v for dispatch_attention_fn in FLUX's processors (FLUX.1 and FLUX.2, see flux2_injection.py):
    parts [(q, k, norm_q, norm_k)] and values, one per stream in concatenation order, each [B, S_i, H, D].
    The per-head RMSNorms, the concatenation and the RoPE in one launch where the kernel reproduces the
    modules; else the original sequence (the image stream's norms first, as diffusers calls them)."""
    fused = _fused_qk(parts, head_dim, image_rotary_emb)
    value = torch.cat(values, dim=1) if len(values) > 1 else values[0]
    if fused is not None:
        return fused[0], fused[1], value
    normed = [(nq(q), nk(k)) for q, k, nq, nk in reversed(parts)][::-1]
    query = torch.cat([q for q, _ in normed], dim=1) if len(normed) > 1 else normed[0][0]
    key = torch.cat([k for _, k in normed], dim=1) if len(normed) > 1 else normed[0][1]
    if image_rotary_emb is not None:
        query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
        key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
    return query, key, value


_FUSED = (SD3FusedJointAttnProcessor, FluxFusedAttnProcessor)  # what removal swaps the previous processor back over


# --------------------------------------------------------------------------------------------
# Discovery and counts
# --------------------------------------------------------------------------------------------
def find_mmdit_models(pipe_or_model) -> list:
    """Every SD3Transformer2DModel / FluxTransformer2DModel inside the input, each once."""
    return [
        m for m in ic.unique_modules(pipe_or_model) if isinstance(m, (SD3Transformer2DModel, FluxTransformer2DModel))
    ]


def _empty_counts() -> dict:
    return {k: 0 for k in KINDS}


def mmdit_injected_counts(pipe_or_model) -> dict:
    """Counts per kind of what is currently injected in pipe_or_model."""
    return ic.kind_counts(ic.unique_modules(pipe_or_model), _STATE, KINDS)


# The AdaLN modules' replacement forwards: the generic layer's (generic_injection.py)
_FORWARDS = {
    AdaLayerNormZero: ("mmdit_adaln_zero", gi._adaln_zero_forward),
    SD35AdaLayerNormZeroX: ("mmdit_adaln_zero_x", gi._adaln_zero_x_forward),
    AdaLayerNormZeroSingle: ("mmdit_adaln_zero_single", gi._adaln_zero_single_forward),
    AdaLayerNormContinuous: ("mmdit_adaln_continuous", gi.adaln_continuous_forward),
    JointTransformerBlock: ("mmdit_fused_blocks", _joint_block_forward),
    FluxTransformerBlock: ("mmdit_fused_blocks", _flux_block_forward),
    FluxSingleTransformerBlock: ("mmdit_fused_blocks", _flux_single_block_forward),
}


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def inject_mmdit_kernels(pipe_or_model, *, verbose: bool = True) -> dict:
    """Replace the AdaLN norms, gated residual + norm steps, per-head q/k norms (+ RoPE) and tanh-GELUs
    of every SD3Transformer2DModel / FluxTransformer2DModel in pipe_or_model with the kernels.

    pipe_or_model: a diffusers pipeline (only its SD3 / FLUX transformers are touched), a transformer,
    or any module containing them. Returns the counts per kind of what is injected after the call (a
    second call returns the same counts and wraps nothing twice).
    """
    gi._torch_rms_rounding()  # probed here, not inside a traced forward
    models = find_mmdit_models(pipe_or_model)
    new = _empty_counts()
    skipped = []
    for model in models:
        for m in model.modules():
            entry = _FORWARDS.get(type(m))
            if entry is not None:
                new[entry[0]] += _patch_forward(m, entry[1], entry[0])
            elif type(m) is DiffusersGELU and getattr(m, "approximate", None) == "tanh":
                new["mmdit_gelu_tanh"] += _patch_forward(m, _diffusers_gelu_tanh_forward, "mmdit_gelu_tanh")
            elif type(m) is nn.GELU and m.approximate == "tanh":
                new["mmdit_gelu_tanh"] += _patch_forward(m, _torch_gelu_tanh_forward, "mmdit_gelu_tanh")
            elif type(m) is Attention and isinstance(getattr(m, "norm_q", None), DiffusersRMSNorm):
                if _STATE in m.__dict__:
                    continue
                if type(m.processor) is not JointAttnProcessor2_0:
                    skipped.append(f"SD3 attention with processor {type(m.processor).__name__}")
                    continue
                new["mmdit_qk_norm_fused"] += _patch_processor(m, SD3FusedJointAttnProcessor(), "mmdit_qk_norm_fused")
            elif type(m) is FluxAttention:
                if _STATE in m.__dict__:
                    continue
                if type(m.processor) is not FluxAttnProcessor:
                    skipped.append(f"FLUX attention with processor {type(m.processor).__name__}")
                    continue
                new["mmdit_qk_norm_rope_fused"] += _patch_processor(
                    m, FluxFusedAttnProcessor(), "mmdit_qk_norm_rope_fused"
                )
    gelu_notes = []
    for model in models:
        _link_blocks(model)
        gelu_notes.append(ic.probe_gelu_modules(_tanh_gelu_modules(model)))
    counts = mmdit_injected_counts(pipe_or_model)
    none_found = "" if models else "no SD3 or FLUX transformer found"
    msg = ic.counts_message(
        "injected MMDiT kernels", counts, new, none_found=none_found, skipped=skipped, notes=gelu_notes
    )
    ic.report(logger, msg, verbose)
    return counts


def remove_mmdit_kernels(pipe_or_model, *, verbose: bool = True) -> dict:
    """Undo inject_mmdit_kernels: restore the original forwards and attention processors.
    Returns the counts per kind of what was restored."""
    restored = ic.unpatch_all(ic.unique_modules(pipe_or_model), _STATE, KINDS, _PROCESSOR_KINDS, _FUSED, carry=_CARRY)
    ic.report(logger, ic.counts_message("removed MMDiT kernels", restored), verbose)
    return restored


# The family plug-in interface of diffusers_injection.inject_optimized_kernels (diffusers_injection.FAMILIES)
find_models = find_mmdit_models
inject = inject_mmdit_kernels
remove = remove_mmdit_kernels
injected_counts = mmdit_injected_counts


# --------------------------------------------------------------------------------------------
# Model builders (random weights, no hub) and forward inputs
# --------------------------------------------------------------------------------------------
# The released transformer configurations (transformer/config.json of each checkpoint).
# stabilityai/stable-diffusion-3.5-medium: MMDiT-X, 24 blocks of 24 x 64 = 1536, q/k RMSNorm, a second
# (image-only) attention in blocks 0-12; about 2.24 B parameters
_SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    out_channels=16,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# The tiny test models' widths: 2 heads x 16 = 32, text embeddings of 24, pooled text of 16
_TINY = dict(num_attention_heads=2, attention_head_dim=16, joint_attention_dim=24, pooled_projection_dim=16)
SD3_CONFIGS = {
    "sd3.5-medium": _SD35_MEDIUM,
    # stabilityai/stable-diffusion-3-medium-diffusers: same widths, no q/k norm, no dual attention
    "sd3-medium": dict(_SD35_MEDIUM, pos_embed_max_size=192, dual_attention_layers=(), qk_norm=None),
    # 2 blocks of 2 x 16 = 32: block 0 has the dual attention, block 1 is the context_pre_only last block
    "tiny": dict(
        _SD35_MEDIUM,
        **_TINY,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        num_layers=2,
        caption_projection_dim=32,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
    ),
}
# black-forest-labs/FLUX.1-dev: 19 double + 38 single blocks of 24 x 128 = 3072, guidance embedding,
# RoPE axes 16 + 56 + 56; about 11.9 B parameters
_FLUX1_DEV = dict(
    patch_size=1,
    in_channels=64,
    out_channels=None,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
FLUX_CONFIGS = {
    "flux.1-dev": _FLUX1_DEV,
    # 1 double + 1 single block of 2 x 16 = 32, RoPE axes 4 + 6 + 6
    "tiny": dict(_FLUX1_DEV, **_TINY, in_channels=16, num_layers=1, num_single_layers=1, axes_dims_rope=(4, 6, 6)),
}


def _build(cls, cfg: dict, dtype, device, seed: int):
    device = torch.device(device)
    if device.type != "meta":
        torch.manual_seed(seed)
    with ic.default_dtype(dtype), torch.device(device):
        model = cls(**cfg)
        if device.type != "meta":
            # trained checkpoints have non-unit norm weights; unit weights would hide a swapped weight
            with torch.no_grad():
                for m in model.modules():
                    if isinstance(m, (nn.RMSNorm, DiffusersRMSNorm)) and m.weight is not None:
                        m.weight.normal_(1.0, 0.1)
    # torch's own Module.to: ModelMixin.to warns about fp32 modules (none here) on every cast
    return nn.Module.to(model, dtype).eval()


def build_sd3_transformer(
    size: str = "tiny", dtype=torch.float32, device="cpu", *, variant: str = "sd3.5-medium", seed: int = 0
):
    """An SD3Transformer2DModel with random weights, built directly on `device` in `dtype`.

    size="real": the released architecture of `variant` ("sd3.5-medium", default, or "sd3-medium");
    size="tiny": 2 blocks of width 32 for CPU tests (dual attention in block 0, q/k RMSNorm).
    device="meta" builds it without memory (for counting modules).
    """
    if size not in ("tiny", "real"):
        raise ValueError(f"size must be 'tiny' or 'real', got {size!r}")
    key = "tiny" if size == "tiny" else variant
    if key not in SD3_CONFIGS or key == "tiny" and size != "tiny":
        raise ValueError(f"unknown SD3 variant {variant!r}; choose 'sd3.5-medium' or 'sd3-medium'")
    return _build(SD3Transformer2DModel, SD3_CONFIGS[key], dtype, device, seed)


def build_flux_transformer(size: str = "tiny", dtype=torch.float32, device="cpu", *, seed: int = 0):
    """A FluxTransformer2DModel with random weights, built directly on `device` in `dtype`.

    size="real": FLUX.1-dev's architecture (19 + 38 blocks, 3072 wide, guidance embedding);
    size="tiny": 1 double + 1 single block of width 32 for CPU tests. device="meta": no memory.
    """
    if size not in ("tiny", "real"):
        raise ValueError(f"size must be 'tiny' or 'real', got {size!r}")
    return _build(FluxTransformer2DModel, FLUX_CONFIGS["tiny" if size == "tiny" else "flux.1-dev"], dtype, device, seed)


def make_mmdit_inputs(
    model,
    batch: int = 1,
    height: int = 1024,
    width: int = 1024,
    text_len: Optional[int] = None,
    dtype=torch.bfloat16,
    device="cuda",
    seed: int = 0,
) -> dict:
    """Keyword arguments of one transformer forward, shaped as the diffusers pipelines build them.

    height/width: the image size in pixels (the VAE downsamples 8x). SD3: latents [B, C, H/8, W/8]
    (the model patchifies 2x2: (H/16) * (W/16) image tokens), text_len default 333 (77 CLIP + 256 T5
    tokens), timestep in [0, 1000). FLUX: packed latents [B, (H/16) * (W/16), 64], text_len default 512
    (T5), timestep in (0, 1), img_ids / txt_ids [S, 3], guidance 3.5 when the model embeds it.
    return_dict=False: the model returns a tuple.
    """
    if not isinstance(model, (SD3Transformer2DModel, FluxTransformer2DModel)):
        raise TypeError(f"expected an SD3Transformer2DModel or a FluxTransformer2DModel, got {type(model).__name__}")
    cfg = model.config
    g = torch.Generator("cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    if isinstance(model, SD3Transformer2DModel):
        factor = 8 * cfg.patch_size
        if height % factor or width % factor:
            raise ValueError(f"height and width must be multiples of {factor} for this SD3 model")
        text_len = 333 if text_len is None else text_len
        return dict(
            hidden_states=rnd(batch, cfg.in_channels, height // 8, width // 8),
            encoder_hidden_states=rnd(batch, text_len, cfg.joint_attention_dim),
            pooled_projections=rnd(batch, cfg.pooled_projection_dim),
            timestep=(torch.rand(batch, generator=g) * 1000).to(device),
            return_dict=False,
        )
    if height % 16 or width % 16:
        raise ValueError("height and width must be multiples of 16 for FLUX (8x VAE, 2x2 packing)")
    text_len = 512 if text_len is None else text_len
    lh, lw = height // 16, width // 16
    img_ids = torch.zeros(lh, lw, 3)
    img_ids[..., 1] += torch.arange(lh)[:, None]
    img_ids[..., 2] += torch.arange(lw)[None, :]
    return dict(
        hidden_states=rnd(batch, lh * lw, cfg.in_channels),
        encoder_hidden_states=rnd(batch, text_len, cfg.joint_attention_dim),
        pooled_projections=rnd(batch, cfg.pooled_projection_dim),
        timestep=torch.rand(batch, generator=g).clamp_min(1e-3).to(device=device, dtype=dtype),
        img_ids=img_ids.reshape(lh * lw, 3).to(device=device, dtype=dtype),
        txt_ids=torch.zeros(text_len, 3, device=device, dtype=dtype),
        guidance=torch.full((batch,), 3.5, device=device) if cfg.guidance_embeds else None,
        return_dict=False,
    )


# --------------------------------------------------------------------------------------------
# Command line: counts on the released architectures (meta device)
# --------------------------------------------------------------------------------------------
def _meta_report() -> dict:
    report = {}
    for name, build in (
        ("sd3.5-medium", lambda: build_sd3_transformer("real", device="meta")),
        ("sd3-medium", lambda: build_sd3_transformer("real", device="meta", variant="sd3-medium")),
        ("flux.1-dev", lambda: build_flux_transformer("real", device="meta")),
    ):
        model = build()
        counts = inject_mmdit_kernels(model, verbose=False)
        again = inject_mmdit_kernels(model, verbose=False)
        restored = remove_mmdit_kernels(model, verbose=False)
        left = mmdit_injected_counts(model)
        report[name] = {"injected": counts, "ok": counts == again == restored and not any(left.values())}
    return report


def _main(argv=None) -> int:
    import argparse
    import json

    report = _meta_report()
    summary = "; ".join(
        f"{name}: " + ", ".join(f"{k.replace('mmdit_', '')}={v}" for k, v in r["injected"].items() if v)
        for name, r in report.items()
    )
    p = argparse.ArgumentParser(
        description="Inject the kernels into the released SD3.5-medium, SD3-medium and FLUX.1-dev transformer "
        "architectures (built on the meta device: no memory, no weights), remove them again, and print the counts "
        "per kind as JSON. Library use: inject_mmdit_kernels(pipe) / remove_mmdit_kernels(pipe).",
        epilog=f"Counts on the meta device: {summary}.",
    )
    p.parse_args(argv)
    ok = all(r["ok"] for r in report.values())
    print(json.dumps({"models": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

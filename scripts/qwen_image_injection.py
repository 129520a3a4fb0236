# SPDX-License-Identifier: Apache-2.0
"""Qwen-Image's family plug-in: the bundle's kernels in diffusers' ``QwenImageTransformer2DModel`` (Qwen-Image,
and the Edit models with ``zero_cond_t``), and out again.

    import qwen_image_injection as qi
    counts = qi.inject(pipe)          # or a bare QwenImageTransformer2DModel
    ...                               # pipe(...) now runs the kernels
    qi.remove(pipe)                   # original forwards back, outputs bit for bit

``diffusers_injection.inject_optimized_kernels`` takes Qwen-Image models through this file (di.FAMILIES).
First the generic layer (``generic_injection``: the q/k RMSNorms, the tanh GELUs, ``txt_norm`` and
``norm_out``, and the block LayerNorms, which a fused block calls only where it steps aside), then, per kind:

* ``qwen_image_blocks``: ``QwenImageTransformerBlock.forward``, each step one kernel with fp32 math and one
  rounding: norm1 + modulation of the image and of the text stream (``layernorm.layer_norm_modulate``);
  ``h + gate * attn`` with norm2 + modulation (``layernorm.gated_residual_layer_norm_modulate``, per
  stream); ``h + gate * ff`` (``rmsnorm.gated_residual_add``, per stream). Modulation is per sample
  (``[B, 1, D]`` views of the ``img_mod`` / ``txt_mod`` output), or per token for the image stream where the
  model passes ``modulate_index`` (``zero_cond_t``: the generated image's tokens take the timestep's
  parameters, the condition images' those of timestep 0): one ``torch.where`` picks all six ``[B, S, D]``
  tensors, as ``_modulate`` picks them one by one, and the kernels read them in place.
* ``qwen_image_attention``: the joint attention (``Attention`` running ``QwenDoubleStreamAttnProcessor2_0``):
  the projections (with FP8 layers each input quantised once for its q, k and v), then the per-head q/k
  RMSNorms of the text and the image stream, their concatenation and Qwen's complex RoPE in ONE launch
  (``head_norm_rope.joint_head_rms_norm_rope``, writing the ``[B, S_txt + S_img, H, D]`` q and k), then
  ``dispatch_attention_fn`` with the processor's backend and parallel settings and the joint mask built as
  the processor builds it. ``apply_rotary_emb_qwen`` multiplies each channel pair by a complex number; the
  kernel rotates pairs with a cos and a sin per channel, so it gets the tables' real and imaginary parts
  repeated over each pair: one small copy, made by the first block and handed to the next (``ic.take_carry``;
  made in every block under torch.compile and in inference mode, where no version counter tells a change).
  The q/k norms and RoPE round where diffusers rounds (after the norm, after the rotation).

Numerics: fp32 in every kernel. In fp32 the output matches diffusers' to fp32 rounding; in bf16 / fp16 each
fused step rounds once where diffusers rounds after the norm, the product and the sum. Every patched forward
reads its parameters when it runs and falls back to diffusers' code for anything else: autograd (the kernels
have no backward), hooks on the modules the fused path does not call (those are called), other processors,
subclasses with a forward of their own (never patched), other RoPE tables, norms or dtype mixes.
"""

from __future__ import annotations

import logging
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the leaf kernels live beside this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402
from diffusers.models.normalization import RMSNorm  # noqa: E402
from diffusers.models.transformers import transformer_qwenimage as _qwen  # noqa: E402
from diffusers.models.transformers.transformer_qwenimage import (  # noqa: E402
    QwenDoubleStreamAttnProcessor2_0,
    QwenImageTransformer2DModel,
    QwenImageTransformerBlock,
)

import fp8_linear  # noqa: E402
import generic_injection as gi  # noqa: E402
import head_norm_rope  # noqa: E402
import injection_common as ic  # noqa: E402
import layernorm  # noqa: E402
import rmsnorm  # noqa: E402

__all__ = ["KINDS", "find_models", "inject", "remove", "injected_counts"]

logger = logging.getLogger("qwen_image_injection")

KINDS = ("qwen_image_blocks", "qwen_image_attention")
_STATE = ic.register_state_key("_rtk_qwen_image")  # per-module record of what was patched and how to undo it
_CARRY = "_rtk_qwen_image_carry"  # on an attention module: the RoPE tables the previous block's made
_PROCESSOR_ARGS = ("encoder_hidden_states_mask", "image_rotary_emb")  # what the processor takes besides
_QWEN_ROPE = _qwen.apply_rotary_emb_qwen  # diffusers' own: the fused path runs while the model file calls it


# --------------------------------------------------------------------------------------------
# The block: norm + modulation, gated residual + norm + modulation, gated residual
# --------------------------------------------------------------------------------------------
def _fits(x, *vectors) -> bool:
    """x [B, S, D] with contiguous rows, every vector [B or 1, S or 1, D] of x's dtype with a contiguous last
    dim: what the kernels read in place as the block's broadcast computes it."""
    if x.dim() != 3 or x.stride(-1) != 1:
        return False
    b, s, d = x.shape
    return all(
        v.dim() == 3 and v.shape[0] in (1, b) and v.shape[1] in (1, s) and v.shape[2] == d and v.dtype == x.dtype
        for v in vectors
    ) and all(v.stride(-1) == 1 for v in vectors)


def _same_rows(h, y) -> bool:
    return y.shape == h.shape and y.dtype == h.dtype and y.stride(-1) == 1


def _modulation(params, index):
    """(shift1, scale1, gate1, shift2, scale2, gate2) as QwenImageTransformerBlock._modulate selects them from
    img_mod / txt_mod's output [N, 6D]: [N, 1, D] views, or with index [B, S] (zero_cond_t) [B, S, D] views of
    one torch.where over all six (the first half of the rows where index is 0, the second half elsewhere)."""
    if index is None:
        p = params.unsqueeze(1)
    else:
        n = params.size(0) // 2
        p = torch.where(index.unsqueeze(-1) == 0, params[:n].unsqueeze(1), params[n:].unsqueeze(1))
    first, second = p.chunk(2, dim=-1)
    return (*first.chunk(3, dim=-1), *second.chunk(3, dim=-1))


def _norm_modulate(norm, x, scale, shift):
    """norm(x) * (1 + scale) + shift: one kernel where norm is a LayerNorm the kernel reproduces."""
    args = gi.ln_args(norm, x)
    if args is not None and _fits(x, scale, shift) and ic.usable(x, scale, shift, args[0], args[1]):
        return layernorm.layer_norm_modulate(x, scale, shift, args[2], weight=args[0], bias=args[1])
    return norm(x) * (1 + scale) + shift


def _residual_norm_modulate(h, y, gate, norm, scale, shift):
    """(h + gate * y, norm(that) * (1 + scale) + shift): one kernel where norm is a LayerNorm it reproduces."""
    args = gi.ln_args(norm, h)
    if (
        args is not None
        and _same_rows(h, y)
        and _fits(h, gate, scale, shift)
        and ic.usable(h, y, gate, scale, shift, args[0], args[1])
    ):
        return layernorm.gated_residual_layer_norm_modulate(
            h, y, gate, scale, shift, args[2], weight=args[0], bias=args[1]
        )
    h = h + gate * y
    return h, norm(h) * (1 + scale) + shift


def _gated_add(h, gate, y):
    """h + gate * y: one kernel (fp32 math, one rounding)."""
    if _same_rows(h, y) and _fits(h, gate) and ic.usable(h, gate, y):
        return rmsnorm.gated_residual_add(h, y, gate)
    return h + gate * y


def _block_forward(
    self,
    hidden_states,
    encoder_hidden_states,
    encoder_hidden_states_mask,
    temb,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
    modulate_index=None,
):
    """QwenImageTransformerBlock.forward with norm1 + modulation, the gated residual + norm2 + modulation and
    the last gated residual of each stream as one kernel each (module docstring)."""
    if ic.needs_autograd(self, hidden_states, encoder_hidden_states, temb):
        return gi.original(self)(
            hidden_states,
            encoder_hidden_states,
            encoder_hidden_states_mask,
            temb,
            image_rotary_emb,
            joint_attention_kwargs,
            modulate_index,
        )
    img_shift1, img_scale1, img_gate1, img_shift2, img_scale2, img_gate2 = _modulation(
        self.img_mod(temb), modulate_index
    )
    if self.zero_cond_t:
        temb = torch.chunk(temb, 2, dim=0)[0]
    txt_shift1, txt_scale1, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = _modulation(self.txt_mod(temb), None)

    img_modulated = _norm_modulate(self.img_norm1, hidden_states, img_scale1, img_shift1)
    txt_modulated = _norm_modulate(self.txt_norm1, encoder_hidden_states, txt_scale1, txt_shift1)
    img_attn_output, txt_attn_output = self.attn(
        hidden_states=img_modulated,
        encoder_hidden_states=txt_modulated,
        encoder_hidden_states_mask=encoder_hidden_states_mask,
        image_rotary_emb=image_rotary_emb,
        **(joint_attention_kwargs or {}),
    )
    img_modulated = txt_modulated = None  # (each value dropped once read: diffusers' block holds them to the end)

    hidden_states, img_modulated2 = _residual_norm_modulate(
        hidden_states, img_attn_output, img_gate1, self.img_norm2, img_scale2, img_shift2
    )
    img_attn_output = None
    encoder_hidden_states, txt_modulated2 = _residual_norm_modulate(
        encoder_hidden_states, txt_attn_output, txt_gate1, self.txt_norm2, txt_scale2, txt_shift2
    )
    txt_attn_output = None
    hidden_states = _gated_add(hidden_states, img_gate2, gi.feed_forward(self.img_mlp, img_modulated2, _STATE))
    encoder_hidden_states = _gated_add(
        encoder_hidden_states, txt_gate2, gi.feed_forward(self.txt_mlp, txt_modulated2, _STATE)
    )
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


# --------------------------------------------------------------------------------------------
# The joint attention: q/k norms of both streams, concatenation and RoPE in one launch
# --------------------------------------------------------------------------------------------
def _qk_norm(norm, x, head_dim: int):
    """(weight, eps) of a q/k norm the kernel reproduces on x [B, S, H, head_dim]: diffusers' RMSNorm over the
    head dim, no bias, no weight or one of x's dtype (an fp32 weight on bf16 rows gives fp32), running nothing
    but its forward (or the bundle's patch of it); else None."""
    if not (ic.class_forward(norm, RMSNorm) and ic.unwrapped(norm)) or norm.bias is not None:
        return None
    if tuple(norm.dim) != (head_dim,) or (norm.weight is not None and norm.weight.dtype != x.dtype):
        return None
    return norm.weight, float(norm.eps)


def _rope_tables(attn, rotary, s_txt: int, s_img: int, head_dim: int):
    """(cos, sin) [S_txt + S_img, head_dim] for the kernel from QwenEmbedRope's complex (image, text) tables
    [S, head_dim / 2]: each pair's real / imaginary part twice (complex x * f is the pair rotation with
    cos = Re f, sin = Im f), text rows first, as the processor concatenates the streams; one cat of two
    broadcast views. The next block's attention gets them for the very same tables, unchanged since
    (ic.take_carry: not under torch.compile or inference mode, where no version counter can tell). None where
    the tables have another form."""
    if not isinstance(rotary, (tuple, list)) or len(rotary) != 2 or head_dim % 2:
        return None
    img, txt = rotary
    half = head_dim // 2
    for t, s in ((img, s_img), (txt, s_txt)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.complex64 or tuple(t.shape) != (s, half):
            return None
    tables = ic.take_carry(attn, _CARRY, "rope", img, txt)
    if tables is None:
        parts = [torch.view_as_real(t).transpose(1, 2).unsqueeze(-1).expand(-1, 2, half, 2) for t in (txt, img)]
        both = torch.cat(parts).view(s_txt + s_img, 2, head_dim)
        tables = both[:, 0], both[:, 1]
    nxt = ic.next_block(attn)
    if nxt is not None and ic.may_carry(attn, nxt, txt, _STATE):
        ic.put_carry(nxt, _CARRY, "rope", img, txt, tables)
    return tables


def _fused_qk(attn, txt_q, txt_k, img_q, img_k, rotary, head_dim: int):
    """(joint q, joint k) [B, S_txt + S_img, H, D] from the kernel, or None where it would not reproduce the
    processor's norms, RoPE and concatenation."""
    args = [_qk_norm(n, img_q, head_dim) for n in (attn.norm_added_q, attn.norm_added_k, attn.norm_q, attn.norm_k)]
    if any(a is None for a in args) or len({a[0] is None for a in args}) != 1:
        return None
    if args[0][1] != args[1][1] or args[2][1] != args[3][1] or _qwen.apply_rotary_emb_qwen is not _QWEN_ROPE:
        return None
    qk = (txt_q, txt_k, img_q, img_k)
    if any(t.dtype != img_q.dtype or t.stride(-1) != 1 for t in qk) or txt_q.shape != txt_k.shape:
        return None
    if img_q.shape != img_k.shape or txt_q.shape[0] != img_q.shape[0] or txt_q.shape[2:] != img_q.shape[2:]:
        return None
    tables = (None, None)
    if rotary is not None:
        tables = _rope_tables(attn, rotary, txt_q.shape[1], img_q.shape[1], head_dim)
        if tables is None:
            return None
    weights = [a[0] for a in args]
    if not ic.usable(*qk, *weights, *tables):
        return None
    return head_norm_rope.joint_head_rms_norm_rope(
        [(txt_q, txt_k, weights[0], weights[1]), (img_q, img_k, weights[2], weights[3])],
        [args[0][1], args[2][1]],
        *tables,
        cast_before_weight=img_q.dtype in ic.HALF,
    )


def _stock_qk(attn, txt_q, txt_k, img_q, img_k, rotary):
    """The processor's own q/k steps: the norms, apply_rotary_emb_qwen, the concatenation (text first)."""
    if attn.norm_q is not None:
        img_q = attn.norm_q(img_q)
    if attn.norm_k is not None:
        img_k = attn.norm_k(img_k)
    if attn.norm_added_q is not None:
        txt_q = attn.norm_added_q(txt_q)
    if attn.norm_added_k is not None:
        txt_k = attn.norm_added_k(txt_k)
    if rotary is not None:
        img_freqs, txt_freqs = rotary
        img_q = _qwen.apply_rotary_emb_qwen(img_q, img_freqs, use_real=False)
        img_k = _qwen.apply_rotary_emb_qwen(img_k, img_freqs, use_real=False)
        txt_q = _qwen.apply_rotary_emb_qwen(txt_q, txt_freqs, use_real=False)
        txt_k = _qwen.apply_rotary_emb_qwen(txt_k, txt_freqs, use_real=False)
    return torch.cat([txt_q, img_q], dim=1), torch.cat([txt_k, img_k], dim=1)


def _attention_forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
    """Attention.forward with diffusers' QwenDoubleStreamAttnProcessor2_0 computed here, its q/k norms,
    RoPE and concatenation in one launch (_fused_qk). Another processor (a subclass too), an input the
    processor refuses or does not take, or autograd: Attention.forward as it was."""
    proc = self.processor
    if (
        type(proc) is not QwenDoubleStreamAttnProcessor2_0
        or encoder_hidden_states is None
        or attention_mask is not None
        or any(k not in _PROCESSOR_ARGS for k in kwargs)
        or ic.needs_autograd(self, hidden_states, encoder_hidden_states)
    ):
        return gi.original(self)(hidden_states, encoder_hidden_states, attention_mask, **kwargs)
    mask = kwargs.get("encoder_hidden_states_mask")
    rotary = kwargs.get("image_rotary_emb")
    if mask is not None:  # as the processor builds it: text mask, then every image token
        image_mask = torch.ones(
            (hidden_states.shape[0], hidden_states.shape[1]), dtype=torch.bool, device=hidden_states.device
        )
        attention_mask = torch.cat([mask, image_mask], dim=1)[:, None, None, :]
    seq_txt = encoder_hidden_states.shape[1]
    img_q, img_k, img_v = fp8_linear.project(hidden_states, self.to_q, self.to_k, self.to_v)
    txt_q, txt_k, txt_v = fp8_linear.project(encoder_hidden_states, self.add_q_proj, self.add_k_proj, self.add_v_proj)
    head_dim = self.inner_dim // self.heads
    img_q, img_k, img_v, txt_q, txt_k, txt_v = (
        t.unflatten(-1, (-1, head_dim)) for t in (img_q, img_k, img_v, txt_q, txt_k, txt_v)
    )
    fused = _fused_qk(self, txt_q, txt_k, img_q, img_k, rotary, head_dim)
    query, key = fused if fused is not None else _stock_qk(self, txt_q, txt_k, img_q, img_k, rotary)
    value = torch.cat([txt_v, img_v], dim=1)
    fused = img_q = img_k = img_v = txt_q = txt_k = txt_v = None  # the projections, read: not held by the attention

    out = gi.dispatch_attention(proc, query, key, value, attention_mask, fn=_qwen.dispatch_attention_fn)
    out = out.flatten(2, 3).to(query.dtype)
    txt_out, img_out = out[:, :seq_txt, :], out[:, seq_txt:, :]
    img_out = ic.call(self.to_out[0], img_out.contiguous())
    if len(self.to_out) > 1:
        img_out = ic.call(self.to_out[1], img_out)
    return img_out, ic.call(self.to_add_out, txt_out.contiguous())


# --------------------------------------------------------------------------------------------
# The family interface (diffusers_injection.FAMILIES)
# --------------------------------------------------------------------------------------------
def find_models(pipe_or_model) -> list:
    """Every QwenImageTransformer2DModel inside the input (a pipeline's components, or a module), each once."""
    return [m for m in ic.unique_modules(pipe_or_model) if isinstance(m, QwenImageTransformer2DModel)]


def injected_counts(pipe_or_model) -> dict:
    """Counts per kind of what this family holds injected in pipe_or_model."""
    return ic.kind_counts(ic.modules_once(find_models(pipe_or_model)), _STATE, KINDS)


def _plan(m):
    """(kind, forward) for a module of a Qwen-Image model this family patches, else None."""
    if ic.class_forward(m, QwenImageTransformerBlock):
        return "qwen_image_blocks", _block_forward
    if type(m) is Attention and type(m.processor) is QwenDoubleStreamAttnProcessor2_0:
        return "qwen_image_attention", _attention_forward
    return None


def _link_attention(model) -> None:
    """Link the patched attention modules of consecutive blocks: each hands its RoPE tables to the next."""
    attns = [getattr(b, "attn", None) for b in getattr(model, "transformer_blocks", None) or ()]
    ours = [a if a is not None and _STATE in a.__dict__ else None for a in attns]
    for i, attn in enumerate(ours):
        if attn is not None:
            attn.__dict__.setdefault(_CARRY, {})
            ic.link_next(attn, ours[i + 1] if i + 1 < len(ours) else None)


def inject(pipe_or_model, *, verbose: bool = True) -> dict:
    """The generic kernels, then this family's fusions, in every Qwen-Image transformer of pipe_or_model
    (module docstring). Returns the counts per kind after the call; a second call patches nothing twice."""
    skipped, notes = [], []
    models = find_models(pipe_or_model)
    for model in models:
        gi.inject_generic_kernels(model, verbose=False, skipped=skipped)
        for m in model.modules():
            plan = _plan(m)
            if plan is None:
                if isinstance(m, QwenImageTransformerBlock):
                    skipped.append(f"{type(m).__name__} (a forward of its own)")
                continue
            if "forward" in m.__dict__ and not hasattr(m, "_hf_hook") and "_diffusers_hook" not in m.__dict__:
                if ic.bundle_state(m) is None:
                    skipped.append(f"{type(m).__name__} with a forward of its own")
                continue
            gi.patch(m, plan[1], plan[0], _STATE)
        _link_attention(model)
        # the GEMM-GELU probe now, so a torch.compile trace later finds its result cached
        notes.append(ic.probe_gelu_modules(m for m in model.modules() if gi.is_gelu_tanh(m)))
    counts = injected_counts(pipe_or_model)
    none_found = "" if models else "no Qwen-Image transformer found"
    msg = ic.counts_message("injected Qwen-Image kernels", counts, none_found=none_found, skipped=skipped, notes=notes)
    ic.report(logger, msg, verbose)
    return counts


def remove(pipe_or_model, *, verbose: bool = True) -> dict:
    """Undo inject (this family's patches and the generic layer's in its models). Returns the counts restored
    per kind (KINDS; the generic layer logs its own)."""
    return gi.remove_family(find_models(pipe_or_model), _STATE, KINDS, logger, "Qwen-Image", verbose, carry=_CARRY)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="Qwen-Image's kernel family (nothing to run on its own): "
        "diffusers_injection.inject_optimized_kernels uses it for QwenImageTransformer2DModel; import it to "
        "inject / remove directly."
    ).parse_args()

# SPDX-License-Identifier: Apache-2.0
"""Put the project's Triton kernels into diffusers' LTX-Video pipeline, and take them out again.

    counts = inject_optimized_kernels(pipe)      # or a bare LTXVideoTransformer3DModel / VAE
    ...                                          # pipe(...) now runs the kernels
    remove_optimized_kernels(pipe)               # original forwards and processors are back

What is replaced, per kind (the default LTX-Video transformer has 28 blocks):

* ``rmsnorm_weightless`` (56): each block's norm1/norm2, diffusers ``RMSNorm`` without a weight.
* ``rmsnorm_weighted`` (112): the q/k norms of both attentions, ``torch.nn.RMSNorm`` with a weight
  (diffusers ``RMSNorm`` with a weight is handled too; one with a bias is left alone).
* ``adaln_fused_blocks`` (28): ``LTXVideoTransformerBlock.forward``: norm1 + AdaLN modulation in one
  kernel; ``h + attn2`` + norm2 + modulation in one kernel that returns both the residual and the
  normalised output; the gated residuals ``h + y * gate`` are one kernel each (``gated_residual_add``),
  except a block's last one, which runs with the next block's norm1 + modulation in one kernel when
  blocks follow each other (the next block uses that only if it receives the very same h).
* ``qk_norm_rope_fused`` (28): a self-attention processor (diffusers' processor API) that runs the
  q and k RMSNorms and the rotary embedding in one launch, with cos/sin computed in the kernel from
  the token coordinates (the model's ``rope`` module is patched to hand those over: ``rope_coords``).
* ``cross_attn`` (28): the cross-attention processors: the same processor class, without RoPE; the
  prompt mask is broadcast over the heads instead of copied once per head. Same result; it is also
  what lets a padded prompt run under Ulysses context parallelism, where diffusers 0.42.1 hands the
  attention a per-head mask with all heads after the all-to-all left each rank some of them.
* ``gelu_tanh`` (28): each feed-forward's ``GELU(approximate="tanh")``: on a GPU whose BLAS computes
  the tanh form in a GEMM epilogue (checked once per device and dtype), the projection and the
  activation are one ``torch._addmm_activation`` call; elsewhere the projection, then the kernel.
* ``vae_rmsnorm``: the ``RMSNorm`` layers of ``AutoencoderKLLTXVideo`` (eps 1e-8, channel-last).
* ``mmdit_*``: SD3 and FLUX transformers are handed to ``mmdit_injection.py`` (its counts are merged
  in under ``mmdit_`` keys).
* ``wan_*``: Wan 2.1 / 2.2 transformers are handed to ``wan_injection.py`` (counts under ``wan_`` keys).

Modules are recognised by class and attributes; anything else is left untouched (a model that is
neither LTX-Video, SD3/FLUX nor Wan gets all-zero counts). Every patched forward reads its parameters when it runs (so accelerate's
offload hooks, dtype casts and weight swaps keep working) and falls back to the original code for
inputs the kernels do not cover: autograd (the kernels have no backward), tensors on a device the
kernels cannot run on, unusual dtype mixes. Injecting twice changes nothing; removal restores the
original forwards and processors, so outputs become bit-identical to the unpatched model.

Also here: ``build_tiny_ltx_pipeline`` / ``build_ltx_pipeline``, offline LTXPipeline builders
(random weights, in-memory tokenizer, no hub access) shared by the tests and the example.
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
from diffusers.models.attention import FeedForward  # noqa: E402
from diffusers.models.autoencoders.autoencoder_kl_ltx import AutoencoderKLLTXVideo  # noqa: E402
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_ltx import (  # noqa: E402
    LTXAttention,
    LTXVideoAttnProcessor,
    LTXVideoRotaryPosEmbed,
    LTXVideoTransformer3DModel,
    LTXVideoTransformerBlock,
    apply_rotary_emb,
)

import fp8_linear  # noqa: E402
import generic_injection as gi  # noqa: E402
import graph_mode  # noqa: E402
import injection_common as ic  # noqa: E402
import qk_norm_rope  # noqa: E402
import rmsnorm  # noqa: E402

__all__ = [
    "inject_optimized_kernels",
    "remove_optimized_kernels",
    "injected_counts",
    "LTXFusedSelfAttnProcessor",
    "build_tiny_ltx_pipeline",
    "build_ltx_pipeline",
    "load_ltx_pipeline",
    "make_offline_t5_tokenizer",
]

logger = logging.getLogger("diffusers_injection")

KINDS = (
    "rmsnorm_weightless",
    "rmsnorm_weighted",
    "adaln_fused_blocks",
    "qk_norm_rope_fused",
    "cross_attn",
    "rope_coords",
    "gelu_tanh",
    "vae_rmsnorm",
    "fp8_linear",
    "graphs",
    *gi.KINDS,
)

_PROCESSOR_KINDS = ("qk_norm_rope_fused", "cross_attn")
_STATE = ic.register_state_key("_rtk_injection")  # per-module record of what was patched and how to undo it
_HALF = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# When may a kernel run?
# --------------------------------------------------------------------------------------------
_interpreting = ic.interpreting
_usable = ic.usable


# torch.nn.RMSNorm multiplies the weight in fp32 and rounds once in torch 2.11 (CUDA) and 2.13
# (CPU); other releases may round to the input dtype before the weight multiply instead.
# Probed once at injection time, so the patched forward matches the installed torch.
_TORCH_RMSNORM_CASTS_BEFORE_WEIGHT = False


_probe_torch_rmsnorm = ic.probe_torch_rmsnorm
_torch_rmsnorm_eps = ic.torch_rmsnorm_eps


# --------------------------------------------------------------------------------------------
# Patching instance forwards, reversibly
# --------------------------------------------------------------------------------------------
def _patch_forward(module: torch.nn.Module, fn, kind: str) -> bool:
    """Make fn(module, ...) the module's forward (see injection_common.patch_forward)."""
    return ic.patch_forward(module, fn, kind, _STATE)


def _original_forward(module: torch.nn.Module):
    """The forward the module had before patching (used for inputs the kernels do not cover)."""
    return ic.original_forward(module, _STATE)


def _unpatch(module: torch.nn.Module) -> Optional[str]:
    """Undo whatever was patched on this module; returns its kind (None if nothing was)."""
    state = ic.unpatch(module, _STATE, _PROCESSOR_KINDS, (LTXFusedSelfAttnProcessor,))
    if state is None:
        return None
    if state["kind"] not in _PROCESSOR_KINDS:
        module.__dict__.pop("_rtk_attn1_modules", None)
        module.__dict__.pop("_rtk_rope_readers", None)
    return state["kind"]


# --------------------------------------------------------------------------------------------
# Replacement forwards
# --------------------------------------------------------------------------------------------
# The replacement forwards every integration shares live in generic_injection.py (they fall back to the
# original forward under whichever state key a module was patched).
_norm_any_layout = gi._norm_any_layout
_diffusers_rmsnorm_forward = gi._diffusers_rmsnorm_forward
_torch_rmsnorm_forward = gi._torch_rmsnorm_forward
_gelu_tanh_forward = gi._gelu_tanh_forward


def _runs_class_forward(m, cls) -> bool:
    """Whether m is a cls whose forward is cls.forward (a subclass may not override it), and calling m
    runs that forward (or this file's patch of it) and nothing else (ic.unwrapped: no hook of any kind)."""
    return isinstance(m, cls) and type(m).forward is cls.forward and ic.unwrapped(m, _STATE)


def _modulated_norm_args(norm, x):
    """(weight, cast_before_weight) for a fused norm+modulate replacing diffusers RMSNorm `norm`
    followed by `* (1 + scale) + shift`, or None when the fused kernel would not reproduce it: norm is
    not diffusers' RMSNorm as diffusers computes it (another norm put in its place, a subclass with its
    own forward, a hook that would see or change its output), or has a bias."""
    if not _runs_class_forward(norm, DiffusersRMSNorm) or getattr(norm, "bias", None) is not None:
        return None
    w = norm.weight
    if w is None:
        return None, True
    if w.dtype == x.dtype:
        return w, w.dtype in _HALF
    return None  # e.g. an fp32 weight on bf16 activations: the original promotes to fp32


# A block's last gated residual h + ff * gate_mlp and the next block's norm1 + modulation run as one
# kernel (rmsnorm.gated_residual_rms_norm_modulate): block i computes block i+1's ada values for it and
# leaves the normalised output in block i+1's carry dict. Block i+1 takes it only if it receives that
# very h and temb (identity), so anything done to h between blocks makes it compute its norm itself.
# Linked at injection (ic.link_next, kept outside the blocks), unlinked at removal.
_CARRY = "_rtk_carry"


def _ada_values(block, temb):
    table = block.scale_shift_table
    ada = table[None, None].to(temb.device) + temb.reshape(temb.size(0), temb.size(1), table.shape[0], -1)
    return ada.unbind(dim=2)  # shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp


def _residual_into_next_norm1(block, h, y, gate, temb):
    """(h + y * gate, next block's norm1(h_new) * (1 + scale_msa) + shift_msa) in one kernel, the
    norm left in the next block's carry; None when blocks are not linked or the kernel would not
    reproduce the next block's norm."""
    nxt = ic.next_block(block)
    if nxt is None or not ic.may_carry(block, nxt, temb, _STATE):
        return None
    args = _modulated_norm_args(nxt.norm1, h)
    table = nxt.scale_shift_table
    if args is None or torch.promote_types(table.dtype, temb.dtype) != h.dtype or not _usable(h, y, table, args[0]):
        return None
    if y.shape != h.shape or y.dtype != h.dtype or y.stride(-1) != 1:
        return None
    shift_msa, scale_msa = _ada_values(nxt, temb)[:2]
    h_new, norm = rmsnorm.gated_residual_rms_norm_modulate(
        h, y, gate, scale_msa, shift_msa, args[0], nxt.norm1.eps, cast_before_weight=args[1]
    )
    ic.put_carry(nxt, _CARRY, "x", h_new, temb, norm)
    return h_new


def _take_carry(block, h, temb):
    """The normalised input the previous block computed for this block's h, or None (always clears)."""
    return ic.take_carry(block, _CARRY, "x", h, temb)


def _link_blocks(model) -> None:
    """Link consecutive patched LTX blocks of one transformer for _residual_into_next_norm1."""
    blocks = list(getattr(model, "transformer_blocks", None) or [])
    for i, blk in enumerate(blocks):
        if type(blk) is not LTXVideoTransformerBlock or _STATE not in blk.__dict__:
            continue
        blk.__dict__.setdefault(_CARRY, {})
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        linked = type(nxt) is LTXVideoTransformerBlock and _STATE in nxt.__dict__
        ic.link_next(blk, nxt if linked else None)


def _project_qkv(attn, hidden_states, encoder_hidden_states):
    """(to_q(hidden_states), to_k(encoder_hidden_states), to_v(encoder_hidden_states)). With FP8 layers
    each input is quantised once, not once per layer that reads it (fp8_linear.project)."""
    if encoder_hidden_states is hidden_states:
        return tuple(fp8_linear.project(hidden_states, attn.to_q, attn.to_k, attn.to_v))
    q = ic.call(attn.to_q, hidden_states)
    return (q, *fp8_linear.project(encoder_hidden_states, attn.to_k, attn.to_v))


_fp8_feed_forward = gi.fp8_feed_forward
_fp8_gelu_down = gi.fp8_gelu_down
feed_forward = gi.feed_forward


def _attention_module(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb, cross: bool):
    """attn(hidden_states, ...): for a plain LTXAttention without hooks, its processor called directly.
    LTXAttention.forward (diffusers 0.42) only drops keyword arguments its processor does not take
    (there are none here) before calling the processor, and finds them with inspect.signature on every
    call, which costs more host time than the rest of a small attention's Python."""
    if type(attn) is LTXAttention and "forward" not in attn.__dict__ and ic.hook_free(attn):
        return attn.processor(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
    # otherwise the call diffusers' block makes, argument for argument (a hook taking keyword arguments
    # sees what it would see in the stock model): attn1 by keywords, without a mask; attn2 (cross) as below
    if not cross:
        return attn(hidden_states=hidden_states, encoder_hidden_states=None, image_rotary_emb=image_rotary_emb)
    return attn(
        hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        attention_mask=attention_mask,
    )


def _ltx_block_forward(
    self,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    image_rotary_emb=None,
    encoder_attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """LTXVideoTransformerBlock.forward with the norms, modulation and residuals fused.

    Same math as diffusers' block: ada_values = scale_shift_table + temb (6 per-sample vectors);
    h1 = h + attn1(norm1(h) * (1 + scale_msa) + shift_msa) * gate_msa; h2 = h1 + attn2(h1, text);
    out = h2 + ff(norm2(h2) * (1 + scale_mlp) + shift_mlp) * gate_mlp. The kernels compute each
    fused step in fp32 and round once, where the original rounds after every op.
    """
    carried = _take_carry(self, hidden_states, temb)
    table = self.scale_shift_table
    args1 = _modulated_norm_args(self.norm1, hidden_states)
    args2 = _modulated_norm_args(self.norm2, hidden_states)
    ada_dtype = torch.promote_types(table.dtype, temb.dtype)
    if (
        args1 is None
        or args2 is None
        or ada_dtype != hidden_states.dtype
        or not _usable(hidden_states, temb, table, args1[0], args2[0])
        or ic.needs_autograd(self, encoder_hidden_states, encoder_attention_mask, image_rotary_emb)
    ):
        return _original_forward(self)(
            hidden_states, encoder_hidden_states, temb, image_rotary_emb, encoder_attention_mask
        )

    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _ada_values(self, temb)

    if carried is not None:  # norm1 + modulation, computed with the previous block's last residual
        norm_hidden_states = carried
    else:
        norm_hidden_states = rmsnorm.rms_norm_modulate(
            hidden_states, scale_msa, shift_msa, args1[0], self.norm1.eps, cast_before_weight=args1[1]
        )
    attn_hidden_states = _attention_module(self.attn1, norm_hidden_states, None, None, image_rotary_emb, cross=False)
    hidden_states = rmsnorm.gated_residual_add(hidden_states, attn_hidden_states, gate_msa)

    attn_hidden_states = _attention_module(
        self.attn2, hidden_states, encoder_hidden_states, encoder_attention_mask, None, cross=True
    )
    # h + attn2, then norm2 + modulation, one kernel returning both the new residual and the norm.
    # With an FP8 feed-forward the norm writes the up-projection's FP8 input and per-token scales and the
    # GELU the down-projection's (no separate quantisation pass for either).
    fp8_ff = _fp8_feed_forward(self.ff)
    fp8 = dict(fp8="per_token", fp8_dtype=fp8_ff[0].weight_fp8.dtype) if fp8_ff is not None else {}
    hidden_states, *norm = rmsnorm.gated_residual_rms_norm_modulate(
        hidden_states, attn_hidden_states, None, scale_mlp, shift_mlp, args2[0], self.norm2.eps,
        cast_before_weight=args2[1], **fp8,
    )  # fmt: skip
    if fp8_ff is not None:
        up, down = fp8_ff
        ff_output = _fp8_gelu_down(up.forward_fp8(*norm), down)
    else:
        ff_output = ic.feed_forward(self.ff, norm[0], FeedForward)
    fused = _residual_into_next_norm1(self, hidden_states, ff_output, gate_mlp, temb)
    return fused if fused is not None else rmsnorm.gated_residual_add(hidden_states, ff_output, gate_mlp)


_CP_HOOK_PREFIXES = ("cp_input---", "cp_output---")  # diffusers' context-parallel split/gather hooks


def _rope_hands_coords(rope_mod) -> bool:
    """Whether the patched rope may return coordinates: every self-attention runs the fused processor, and no
    hook could see or change rope's output where it expects (cos, sin): none on the rope module (PyTorch's,
    accelerate's, or a diffusers hook other than context parallelism's split, which slices coordinates
    consistently), and no PyTorch hook on the blocks or self-attentions that receive it as an argument."""
    d = rope_mod.__dict__
    if not ic.hook_free(rope_mod) or "_hf_hook" in d:
        return False
    registry = d.get("_diffusers_hook")
    if registry is not None and not all(name.startswith(_CP_HOOK_PREFIXES) for name in registry.hooks):
        return False
    for a in d.get("_rtk_attn1_modules", ()):
        if type(a.processor) is not LTXFusedSelfAttnProcessor or not ic.hook_free(a):
            return False
    return all(ic.hook_free(b) for b in d.get("_rtk_rope_readers", ()))


def _ltx_rope_forward(
    self,
    hidden_states: torch.Tensor,
    num_frames: Optional[int] = None,
    height: Optional[int] = None,
    width: Optional[int] = None,
    rope_interpolation_scale=None,
    video_coords: Optional[torch.Tensor] = None,
):
    """LTXVideoRotaryPosEmbed.forward returning (coords, freqs) instead of (cos, sin).

    coords: fp32 [B, S, 3], the scaled (frame, row, column) grid exactly as the original builds it
    (before its `* 2 - 1`); freqs: fp32 [B, S, dim // 6], the frequency vector (times pi/2)
    expanded over the tokens as a zero-stride view (no memory). The fused processor computes the
    angles in its kernel instead of reading two fp32 [B, S, dim] tables in every block.

    Both outputs are per-token along dim 1, so the context-parallel plan of the model
    (`_cp_plan["rope"]` splits outputs 0 and 1 along dim 1) still slices them consistently; the
    processor only reads freqs[0, 0], which every slice contains. If any self-attention of the model
    no longer runs the fused processor (someone set another one), or a hook could see this module's
    output (_rope_hands_coords), the original (cos, sin) is returned, so other processors and hooks see
    what they expect.
    """
    if not _rope_hands_coords(self):
        return _original_forward(self)(hidden_states, num_frames, height, width, rope_interpolation_scale, video_coords)
    batch_size = hidden_states.size(0)
    if video_coords is None:
        # every sample of the batch has the same grid: build one and broadcast it (batch stride 0: one
        # [S, 3] grid in memory, read by the rows of every sample; the kernel still computes the angles
        # per row)
        grid = self._prepare_video_coords(
            1,
            num_frames,
            height,
            width,
            rope_interpolation_scale=rope_interpolation_scale,
            device=hidden_states.device,
        ).expand(batch_size, -1, -1)
    else:
        grid = torch.stack(
            [
                video_coords[:, 0] / self.base_num_frames,
                video_coords[:, 1] / self.base_height,
                video_coords[:, 2] / self.base_width,
            ],
            dim=-1,
        )
    grid = grid.to(torch.float32)
    freqs = qk_norm_rope.ltx_rope_freqs(self.dim, theta=self.theta, device=hidden_states.device)
    freqs = freqs.expand(grid.shape[0], grid.shape[1], freqs.shape[-1])
    return grid, freqs


def _is_coords_form(image_rotary_emb, width: int) -> bool:
    # (coords [B, S, 3], freqs [.., F]) from the patched rope vs (cos, sin) [B, S, width].
    first = image_rotary_emb[0]
    return first.shape[-1] == 3 and width != 3


def _install_processor(attn, kind: str) -> int:
    """Put an LTXFusedSelfAttnProcessor on `attn`, keeping the replaced one (and its backend /
    parallel settings) for removal."""
    prev = attn.processor
    proc = LTXFusedSelfAttnProcessor()
    ic.carry_processor_settings(prev, proc)  # keep backend / parallel choices
    attn.set_processor(proc)
    attn.__dict__[_STATE] = {"kind": kind, "prev": prev}
    return 1


def _broadcast_mask(attn, mask, sequence_length: int, batch_size: int):
    """The attention mask as [B, 1, 1, T] (one copy, broadcast over the heads) where diffusers'
    processor makes [B, heads, 1, T] (prepare_attention_mask repeats it per head). The values are
    the same. Under Ulysses context parallelism each rank attends with heads / degree heads, and
    diffusers 0.42.1 gathers the mask over the tokens but not its head axis: the per-head copy then
    fails to broadcast (huggingface/diffusers#14316), the single copy does not. Masks of other
    shapes go through diffusers' own preparation."""
    if mask.dim() == 3 and mask.shape[0] == batch_size and mask.shape[1] == 1 and mask.shape[-1] == sequence_length:
        return mask.unsqueeze(1)
    mask = attn.prepare_attention_mask(mask, sequence_length, batch_size)
    return mask.view(batch_size, attn.heads, -1, mask.shape[-1])


def _split_heads(t, heads: int):
    """t.unflatten(2, (heads, -1)) for [B, S, heads * D]: a view (Tensor.unflatten's Python wrapper
    costs more host time than the view)."""
    if t.dim() == 3 and t.stride(-1) == 1:
        return t.view(t.shape[0], t.shape[1], heads, -1)
    return t.unflatten(2, (heads, -1))


_native_attention_active = gi.native_attention_active


class LTXFusedSelfAttnProcessor:
    """Self-attention processor for LTXAttention: to_q/to_k/to_v, ONE kernel for the q and k
    RMSNorms (across heads) plus the rotary embedding, diffusers' dispatch_attention_fn, to_out.

    Accepts the rotary embedding in either form: (cos, sin) as diffusers' rope module returns it,
    or (coords, freqs) as the patched rope module returns it (angles computed in the kernel).
    Without a rotary embedding (cross-attention) it runs the module's q/k norms (patched to the
    RMSNorm kernel) and behaves like LTXVideoAttnProcessor, except that a prompt mask stays one
    copy broadcast over the heads (see _broadcast_mask). Inputs the kernel does not cover run the
    original sequence of operations.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: LTXAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        image_rotary_emb=None,
    ) -> torch.Tensor:
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = _broadcast_mask(attn, attention_mask, sequence_length, batch_size)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        query, key, value = _project_qkv(attn, hidden_states, encoder_hidden_states)

        if image_rotary_emb is None:
            query = ic.call(attn.norm_q, query)
            key = ic.call(attn.norm_k, key)
        else:
            query, key = self._qk_norm_rope(attn, query, key, image_rotary_emb)

        heads = attn.heads
        query = _split_heads(query, heads)
        key = _split_heads(key, heads)
        value = _split_heads(value, heads)

        if self._attention_backend is None and self._parallel_config is None and _native_attention_active():
            # what diffusers' native backend computes for these arguments, without its dispatch
            hidden_states = F.scaled_dot_product_attention(
                query.permute(0, 2, 1, 3),
                key.permute(0, 2, 1, 3),
                value.permute(0, 2, 1, 3),
                attn_mask=attention_mask,
                dropout_p=0.0,
                is_causal=False,
            ).permute(0, 2, 1, 3)
        else:
            hidden_states = gi.dispatch_attention(self, query, key, value, attention_mask)
        hidden_states = hidden_states.flatten(2, 3)
        if hidden_states.dtype != query.dtype:
            hidden_states = hidden_states.to(query.dtype)
        to_out = attn.to_out
        hidden_states = ic.call(to_out[0], hidden_states)
        return ic.call(to_out[1], hidden_states)

    @staticmethod
    def _qk_norm_rope(attn, query, key, image_rotary_emb):
        nq, nk = attn.norm_q, attn.norm_k
        coords_form = _is_coords_form(image_rotary_emb, query.shape[-1])
        a, b = image_rotary_emb
        fusable = (  # the norms as their class computes them, with nothing hooked on them (the kernel calls neither)
            _runs_class_forward(nq, torch.nn.RMSNorm)
            and _runs_class_forward(nk, torch.nn.RMSNorm)
            and len(nq.normalized_shape) == 1
            and len(nk.normalized_shape) == 1
            and nq.weight is not None
            and nk.weight is not None
            and _torch_rmsnorm_eps(nq) == _torch_rmsnorm_eps(nk)
            and query.shape == key.shape
            and query.dtype == key.dtype == nq.weight.dtype == nk.weight.dtype
            and _usable(query, key, nq.weight, nk.weight, a, b)
        )
        if fusable:
            eps = _torch_rmsnorm_eps(nq)
            cbw = _TORCH_RMSNORM_CASTS_BEFORE_WEIGHT
            if coords_form:
                return qk_norm_rope.ltx_qk_rmsnorm_rope_coords(
                    query, key, nq.weight, nk.weight, eps, a, b[0, 0], cast_before_weight=cbw
                )
            return qk_norm_rope.ltx_qk_rmsnorm_rope(query, key, nq.weight, nk.weight, eps, a, b, cast_before_weight=cbw)
        # Unfused: the module norms (which may still run the RMSNorm kernel), then diffusers' RoPE.
        query = nq(query)
        key = nk(key)
        if coords_form:
            cos, sin = qk_norm_rope.ltx_cos_sin_from_coords(a, b[0, 0], query.shape[-1])
        else:
            cos, sin = a, b
        return apply_rotary_emb(query, (cos, sin)), apply_rotary_emb(key, (cos, sin))


# --------------------------------------------------------------------------------------------
# Discovery
# --------------------------------------------------------------------------------------------
def _ltx_models(pipe_or_model):
    """(transformers, vaes): every LTX-Video transformer / VAE inside the input, each once."""
    transformers, vaes = [], []
    for m in ic.unique_modules(pipe_or_model):
        if isinstance(m, LTXVideoTransformer3DModel):
            transformers.append(m)
        elif isinstance(m, AutoencoderKLLTXVideo):
            vaes.append(m)
    return transformers, vaes


_is_gelu_tanh = gi.is_gelu_tanh
_class_forward = ic.class_forward


def _rmsnorm_kind(m) -> Optional[str]:
    """Kind of an RMSNorm the kernel can replace, or None (not an RMSNorm, a subclass with its own
    forward, or one with a bias)."""
    if _class_forward(m, DiffusersRMSNorm):
        if m.bias is not None:
            return None
        return "rmsnorm_weightless" if m.weight is None else "rmsnorm_weighted"
    if _class_forward(m, torch.nn.RMSNorm):
        return "rmsnorm_weightless" if m.weight is None else "rmsnorm_weighted"
    return None


def _empty_counts() -> dict:
    return {k: 0 for k in KINDS}


def injected_counts(pipe_or_model) -> dict:
    """Counts per kind of what is currently injected in pipe_or_model."""
    counts = ic.kind_counts(ic.unique_modules(pipe_or_model), _STATE, KINDS)
    counts["fp8_linear"] = fp8_linear.fp8_linear_count(*_fp8_models(pipe_or_model))  # a shared layer once
    counts.update(gi.generic_injected_counts(pipe_or_model))
    counts["graphs"] = sum(graph_mode.enabled(m) for m in ic.unique_modules(pipe_or_model))
    for family in _present_families(pipe_or_model):  # each family's own kinds
        counts.update(family.injected_counts(pipe_or_model))
    return counts


# --------------------------------------------------------------------------------------------
# Model families: plug-ins that take the models they know and add the fusions that pay
# --------------------------------------------------------------------------------------------
# A family is a module (or any object) with:
#   KINDS                                      its count keys (prefixed with the family's name)
#   find_models(pipe_or_model) -> list         the models it takes, each once
#   inject(pipe_or_model, *, verbose) -> dict  inject into those models; the counts per kind after the call
#   remove(pipe_or_model, *, verbose) -> dict  undo; the counts restored per kind
#   injected_counts(pipe_or_model) -> dict     the counts per kind now
# It must not import this file (it is written on generic_injection and injection_common). Families are asked
# in order; a model the first one takes is not offered to the others, and every model no family takes gets
# the generic layer. LTX-Video is this file's own family (below); the others are imported on first use.
FAMILIES: list = [
    "wan_injection",
    "mmdit_injection",
    "flux2_injection",
    "qwen_image_injection",
    "hunyuan_video15_injection",
    "ltx2_injection",
]


def register_family(family, *, first: bool = False) -> None:
    """Add a family plug-in (a module, an object with the attributes above, or the name of a module on
    sys.path, imported on first use); first=True asks it before the others."""
    missing = [] if isinstance(family, str) else [a for a in _FAMILY_API if not hasattr(family, a)]
    if missing:
        raise TypeError(f"{family!r} is no family plug-in: it lacks {', '.join(missing)}")
    if family not in FAMILIES:
        FAMILIES.insert(0, family) if first else FAMILIES.append(family)


_FAMILY_API = ("KINDS", "find_models", "inject", "remove", "injected_counts")


def _families():
    """The registered families, modules named by a string imported (and kept) on first use."""
    import importlib

    for i, family in enumerate(FAMILIES):
        if isinstance(family, str):
            family = FAMILIES[i] = importlib.import_module(family)
        yield family


def _present_families(pipe_or_model):
    """The families that take a model of pipe_or_model, each with its models: [(family, models)] (a family
    also appears with its models claimed by an earlier one removed)."""
    out, taken = [], set()
    for family in _families():
        models = [m for m in family.find_models(pipe_or_model) if id(m) not in taken]
        if models:
            taken.update(id(m) for m in models)
            out.append(family)
    return out


def _claimed(pipe_or_model) -> list:
    """Every model a family takes (LTX-Video's transformers and VAEs included)."""
    transformers, vaes = _ltx_models(pipe_or_model)
    return [*transformers, *vaes, *(m for f in _families() for m in f.find_models(pipe_or_model))]


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def inject_optimized_kernels(
    pipe_or_model, *, verbose: bool = True, fp8: bool = False, fp8_skip=(), graphs: bool = False
) -> dict:
    """Replace LTX-Video's norms, AdaLN modulation, q/k norm + RoPE and GELU with the kernels.

    pipe_or_model: an LTXPipeline (or any diffusers pipeline: only its LTX components are touched),
    an LTXVideoTransformer3DModel, an AutoencoderKLLTXVideo, or any module containing them.
    Returns the counts per kind of what is injected after the call (a second call returns the same
    counts and wraps nothing twice). Call it before enable_model_cpu_offload() or after, and
    before torch.compile (the kernels are torch.library ops, so compile traces them).

    fp8=True (LTX-Video, SD3, FLUX and Wan transformers; inference only): the bf16 linear layers of the
    transformer blocks (fp8_parents: not the AdaLN norms' layers) become fp8_linear.Fp8Linear (FP8
    weight, one scale per output channel; inputs quantised per token; torch._scaled_mm); their bf16
    weights move to the CPU until remove_optimized_kernels puts the same modules back. Layers under a LoRA or other adapter stay bf16. FP8 changes the output by more
    than the kernels alone do: check it on your weights (references/fp8.md). A later
    call with fp8=False adds the bf16 kernels only; it does not take FP8 out (remove_optimized_kernels does).
    injected_counts counts the FP8 layers a model holds, also in modules it shares with another (t2.blocks =
    t1.blocks); the save_pretrained of each transformer found here refuses while it holds any. Inside
    torch.inference_mode(), fp8=True raises ValueError before changing anything: inject outside it.
    fp8_skip: names of linear layers to leave in bf16, as the transformer's named_modules() gives them (e.g.
    "transformer_blocks.3.attn.to_out.0", from fp8_linear.layer_errors); a name no transformer has raises.

    graphs=True: every transformer's forward is also served from CUDA graphs (scripts/graph_mode.py: one per
    input signature, captured on the second call of a signature, replayed with the inputs copied in; eager where
    a replay might differ, with a log line saying why). Counted under "graphs" (models); removal frees them.
    """
    if type(fp8) is not bool:
        raise ValueError(f"fp8 must be True or False, got {fp8!r}")
    if type(graphs) is not bool:
        raise ValueError(f"graphs must be True or False, got {graphs!r}")
    if isinstance(fp8_skip, (str, bytes)) or not hasattr(fp8_skip, "__iter__"):
        raise TypeError(f"fp8_skip takes a collection of layer names, got {fp8_skip!r}")
    fp8_skip = tuple(fp8_skip)  # (a generator would be used up by the check below)
    if not all(isinstance(n, str) for n in fp8_skip):
        raise TypeError(f"fp8_skip takes a collection of layer names, got {fp8_skip!r}")
    if fp8_skip and not fp8:
        raise ValueError("fp8_skip names layers to leave out of fp8=True; pass fp8=True with it")
    if fp8 and torch.is_inference_mode_enabled():
        raise ValueError(fp8_linear._INFERENCE_MODE_REFUSAL)
    global _TORCH_RMSNORM_CASTS_BEFORE_WEIGHT
    _TORCH_RMSNORM_CASTS_BEFORE_WEIGHT = _probe_torch_rmsnorm()

    transformers, vaes = _ltx_models(pipe_or_model)
    new = _empty_counts()
    skipped = []
    gelu_notes = []
    generic_before = gi.generic_injected_counts(pipe_or_model)  # (families may run the generic layer themselves)
    if fp8:  # first: a transformer with nothing to replace raises before anything is injected
        new["fp8_linear"] += _swap_in_fp8(pipe_or_model, skipped, fp8_skip)
        _guard_pipeline_save(pipe_or_model)
    for model in transformers:
        _inject_ltx_transformer(model, new, skipped, gelu_notes)
    for vae in vaes:
        for m in vae.modules():
            if _class_forward(m, DiffusersRMSNorm) and m.bias is None:
                new["vae_rmsnorm"] += _patch_forward(m, _diffusers_rmsnorm_forward, "vae_rmsnorm")

    for family in _present_families(pipe_or_model):  # Wan, SD3 / FLUX, ... (FAMILIES)
        before = family.injected_counts(pipe_or_model)
        after = family.inject(pipe_or_model, verbose=False)
        new.update({k: after[k] - before[k] for k in after})
    gelu_notes.append(ic.probe_gelu_modules(m for m in ic.unique_modules(pipe_or_model) if gi.is_gelu_tanh(m)))

    # every model no family took: the generic kernels (diffusers' shared modules, wherever they are)
    claimed = _claimed(pipe_or_model)
    after = gi.inject_generic_kernels(pipe_or_model, verbose=False, skip=claimed, skipped=skipped)
    new.update({k: after[k] - generic_before[k] for k in gi.KINDS})

    if graphs:  # last: the graphs capture the forward with every kernel in place
        for model in _fp8_models(pipe_or_model):
            new["graphs"] += graph_mode.enable(model)

    counts = injected_counts(pipe_or_model)
    found = bool(claimed) or any(counts[k] for k in gi.KINDS)
    none_found = "" if found else "no module the kernels replace found"
    notes = [*gelu_notes, ic.cpu_fallback_note(pipe_or_model, new)]
    msg = ic.counts_message("injected kernels", counts, new, none_found=none_found, skipped=skipped, notes=notes)
    ic.report(logger, msg, verbose)
    return counts


def _fp8_models(pipe_or_model) -> list:
    """The transformers fp8=True applies to, each once: LTX-Video's, every family's, and every other diffusers
    transformer model (a class of diffusers.models.transformers) among the roots of pipe_or_model."""
    found = [*_ltx_models(pipe_or_model)[0], *(m for f in _families() for m in f.find_models(pipe_or_model))]
    seen = {id(m) for m in found}
    for root in ic.roots(pipe_or_model):
        if type(root).__module__.startswith("diffusers.models.transformers.") and id(root) not in seen:
            found.append(root)
            seen.add(id(root))
    return found


def fp8_parents(model: torch.nn.Module) -> list:
    """The modules whose nn.Linear children fp8=True turns into FP8: everything inside the transformer blocks
    (attention projections, feed-forward, FLUX's single-block MLP) except the AdaLN norms and what they hold.
    Those norms' linear layers (SD3, FLUX) take the timestep embedding, one row per sample, so FP8 would
    speed nothing up, and their outputs scale and shift every token, so their error would reach all of them."""
    blocks = [b for child in model.children() if isinstance(child, torch.nn.ModuleList) for b in child]
    parents, inside_norm = [], set()
    for blk in blocks:
        for m in blk.modules():  # pre-order: a norm comes before its children
            if id(m) in inside_norm:
                continue
            if "Norm" in type(m).__name__:
                inside_norm.update(id(x) for x in m.modules())
                continue
            parents.append(m)
    return parents


_FP8_SKIP = "_rtk_fp8_skip"  # on a transformer: the layer names fp8_skip left in bf16 (later calls keep them so)


def _swap_in_fp8(pipe_or_model, skipped: list, skip_names=()) -> int:
    """fp8=True: swap the block linear layers of every supported transformer (fp8_parents) for Fp8Linear,
    except those named in skip_names (in any of the transformers). Raises ValueError, having changed nothing
    it cannot undo, where there is no such transformer, a name matches no linear layer of any, or a
    transformer has no layer it can swap. Adds the layers left in bf16 to skipped; returns the count."""
    models = _fp8_models(pipe_or_model)
    if not models:
        raise ValueError(
            "fp8=True is implemented for LTX-Video, SD3, FLUX and Wan transformers; none was found in the argument"
        )
    named = [dict(m.named_modules()) for m in models]
    for n in skip_names:
        found = [d[n] for d in named if n in d]
        if any(isinstance(m, fp8_linear.Fp8Linear) for m in found):
            raise ValueError(
                f"fp8_skip: {n!r} is FP8 already (an earlier call made it so): remove_optimized_kernels(model), "
                "then inject with fp8_skip"
            )
        if not any(isinstance(m, torch.nn.Linear) for m in found):
            what = f"it is a {type(found[0]).__name__}" if found else "no module has that name"
            raise ValueError(
                f"fp8_skip: {n!r} names no nn.Linear of the transformer ({what}); use the names named_modules() "
                "gives from the transformer itself, as layer_errors(transformer, ...) does"
            )
    # names skipped by an earlier call stay skipped: a second call changes nothing it left as it was
    skip_names = set(skip_names).union(*(m.__dict__.get(_FP8_SKIP, ()) for m in models))
    skip = {id(d[n]) for d in named for n in skip_names if n in d}
    total = 0
    before = [twin for *_, twin in fp8_linear._swapped_slots(*models)]  # an earlier call's (kept on a failure)
    skip_before = [m.__dict__.get(_FP8_SKIP) for m in models]
    for i, model in enumerate(models):
        layers_left = []
        swapped, left = fp8_linear.swap_in_fp8(model, fp8_parents(model), left_layers=layers_left, skip=skip)
        if left and not swapped and not fp8_linear.fp8_linear_count(model):
            hint = ""
            if any(why not in (fp8_linear._ADAPTED, fp8_linear._SKIPPED) for why in left):
                hint = (
                    ". The FP8 layers take bf16 weights on the GPU: move the transformer there in bf16 first "
                    "(and inject before enable_model_cpu_offload())"
                )
            for done, kept_skip in zip(models[:i], skip_before):  # nothing half done
                fp8_linear.restore_from_fp8(done, keep=before)  # (this call's swaps undone)
                if kept_skip is None:
                    done.__dict__.pop(_FP8_SKIP, None)
                else:
                    done.__dict__[_FP8_SKIP] = kept_skip
            raise ValueError(
                f"fp8=True replaced no linear layer of the {type(model).__name__}: "
                + "; ".join(sorted(set(left)))
                + hint
            )
        total += swapped
        if skip_names:
            model.__dict__[_FP8_SKIP] = frozenset(skip_names)
        names, by_reason = {id(m): n for n, m in model.named_modules()}, {}
        for layer, why in layers_left:
            by_reason.setdefault(why, []).append(names.get(id(layer), type(layer).__name__))
        for why, where in by_reason.items():
            shown = ", ".join(where[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
            skipped.append(f"{why}: not made FP8, left as they are ({shown})")
        reported = {names.get(id(layer)) for layer, _ in layers_left}
        for n in sorted(set(skip_names) - reported):
            if isinstance(named[i].get(n), torch.nn.Linear):
                skipped.append(f"fp8_skip names {n}, which fp8=True leaves as it is anyway (outside fp8_parents)")
    return total


def _guard_pipeline_save(pipe) -> None:
    """A pipeline (not an nn.Module) given to fp8=True: its save_pretrained refuses, before it writes anything,
    until remove_optimized_kernels(pipe). The pipeline's own would write model_index.json and the components
    before the transformer, whose save_pretrained refuses (fp8_linear), so a half-written folder would be
    left."""
    if isinstance(pipe, torch.nn.Module) or "save_pretrained" in getattr(pipe, "__dict__", {"save_pretrained": None}):
        return
    if callable(getattr(pipe, "save_pretrained", None)):
        pipe.__dict__["save_pretrained"] = ic.BoundForward(_refuse_pipeline_save, pipe)


def _refuse_pipeline_save(pipe, *args, **kwargs):
    """save_pretrained of a pipeline given to fp8=True, until remove_optimized_kernels(pipe) takes this away. It
    never saves, even with the FP8 layers gone (removed through the transformer): a shallow copy of the
    pipeline shares this function, bound to the original, and would save the original's components."""
    held = sorted({type(m).__name__ for m in _fp8_models(pipe) if fp8_linear.fp8_linear_count(m)})
    now = f"its {' and '.join(held)} holds FP8 layers" if held else "it was given to fp8=True"
    raise RuntimeError(
        f"save_pretrained of this pipeline: {now}, which a checkpoint cannot carry (from_pretrained would "
        "initialise those layers at random); nothing was written. Call remove_optimized_kernels(pipe) first "
        "(on this pipeline object), save, then inject again"
    )


def _inject_ltx_transformer(model, new: dict, skipped: list, gelu_notes: list) -> None:
    """Inject the kernels into one LTX-Video transformer: its norms, GELUs and blocks, then its attention
    processors and RoPE. Adds to new (counts per kind), skipped (what was left untouched and why) and
    gelu_notes."""
    for m in model.modules():
        kind = _rmsnorm_kind(m)
        if kind is not None:
            fn = _diffusers_rmsnorm_forward if isinstance(m, DiffusersRMSNorm) else _torch_rmsnorm_forward
            new[kind] += _patch_forward(m, fn, kind)
        elif isinstance(m, (DiffusersRMSNorm, torch.nn.RMSNorm)):
            skipped.append(f"{type(m).__name__} (a bias, or a forward of its own)")
        elif _is_gelu_tanh(m):
            new["gelu_tanh"] += _patch_forward(m, _gelu_tanh_forward, "gelu_tanh")
        elif _class_forward(m, LTXVideoTransformerBlock):
            new["adaln_fused_blocks"] += _patch_forward(m, _ltx_block_forward, "adaln_fused_blocks")
        elif isinstance(m, LTXVideoTransformerBlock):
            skipped.append(f"{type(m).__name__} (a forward of its own)")

    attn1s = _install_ltx_processors(model, new, skipped)
    _link_blocks(model)
    gelu_notes.append(ic.probe_gelu_modules(m for m in model.modules() if _is_gelu_tanh(m)))
    rope_mod = getattr(model, "rope", None)
    if _class_forward(rope_mod, LTXVideoRotaryPosEmbed) and attn1s:
        if _patch_forward(rope_mod, _ltx_rope_forward, "rope_coords"):
            new["rope_coords"] += 1
        # a plain tuple attribute: not registered as submodules (no second parent in the tree)
        rope_mod.__dict__["_rtk_attn1_modules"] = tuple(attn1s)
        rope_mod.__dict__["_rtk_rope_readers"] = tuple(getattr(model, "transformer_blocks", ()))


def _install_ltx_processors(model, new: dict, skipped: list) -> list:
    """The kernels' attention processors, only where diffusers' own LTX processor is in place: self-attention
    (q/k norm + RoPE fused) and cross-attention (same class, no RoPE, mask broadcast over heads). Returns
    every block's self-attention: the patched RoPE hands over coords only if all of them are fused."""
    attn1s = []
    for block in model.modules():
        if isinstance(block, LTXVideoTransformerBlock) and not _class_forward(block, LTXVideoTransformerBlock):
            attn1s.append(block.attn1)
        if not _class_forward(block, LTXVideoTransformerBlock):
            continue
        for attn, kind, what in ((block.attn1, "qk_norm_rope_fused", "self"), (block.attn2, "cross_attn", "cross")):
            if not isinstance(attn, LTXAttention):
                continue
            if _STATE not in attn.__dict__:
                if type(attn.processor) is not LTXVideoAttnProcessor:
                    skipped.append(f"{what}-attention with processor {type(attn.processor).__name__}")
                    continue
                new[kind] += _install_processor(attn, kind)
            if kind == "qk_norm_rope_fused":
                attn1s.append(attn)
    return attn1s


def remove_optimized_kernels(pipe_or_model, *, verbose: bool = True) -> dict:
    """Undo inject_optimized_kernels: restore the original forwards and attention processors.

    FP8 layers in modules the model shares with another (t2.blocks = t1.blocks) are the very same layers in
    both: removed through either model, their bf16 layers are back in both (both then count none, and both
    save_pretrained save). Returns the counts per kind of what was restored.
    """
    restored = _empty_counts()
    generic_before = gi.generic_injected_counts(pipe_or_model)  # (a family's removal may undo some of them)
    for m in ic.unique_modules(pipe_or_model):
        restored["graphs"] += graph_mode.disable(m)
    for model in _fp8_models(pipe_or_model):
        restored["fp8_linear"] += fp8_linear.restore_from_fp8(model)
        model.__dict__.pop(_FP8_SKIP, None)
    own = getattr(pipe_or_model, "__dict__", {}).get("save_pretrained")
    if isinstance(own, ic.BoundForward) and own.func is _refuse_pipeline_save:
        del pipe_or_model.__dict__["save_pretrained"]
    for m in ic.unique_modules(pipe_or_model):
        ic.link_next(m, None)
        m.__dict__.pop(_CARRY, None)
        kind = _unpatch(m)
        if kind is not None:
            restored[kind] += 1
    for family in _present_families(pipe_or_model):
        restored.update(family.remove(pipe_or_model, verbose=False))
    gi.remove_generic_kernels(pipe_or_model, verbose=False)
    restored.update(generic_before)  # every generic patch is gone now, whoever undid it
    ic.report(logger, ic.counts_message("removed kernels", restored), verbose)
    return restored


# --------------------------------------------------------------------------------------------
# Offline pipelines (random weights, no hub): shared by the tests and the example
# --------------------------------------------------------------------------------------------
_WORDS = (
    "a an the of in on at with and to is are by from over under through across near far "
    "cat dog bird fish horse man woman child person car boat city street forest river sea sky "
    "mountain field road house tree flower light water fire snow rain sun moon night day "
    "red blue green yellow white black golden bright dark slow fast small large old young "
    "walks runs flies swims moves stands sits looks turns waves shines falls rises camera video "
    "shot close wide view scene background foreground motion gentle soft sharp detailed fox snowy "
    "follows runs"
).split()


def make_offline_t5_tokenizer(model_max_length: int = 128):
    """A T5 tokenizer (SentencePiece-style Unigram) built from an in-memory vocabulary.

    Token ids: 0 <pad>, 1 </s>, 2 <unk>, then whole words (with the leading-space marker) and single
    characters, so any text tokenises. Returns (tokenizer, vocab_size).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import T5TokenizerFast

    marker = "\u2581"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (marker, -4.0)]
    vocab += [(marker + w, -2.0) for w in _WORDS]
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-:;()"
    vocab += [(c, -6.0) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    t5 = T5TokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=model_max_length,
    )
    return t5, len(vocab)


def _t5_encoder(d_model: int, vocab_size: int, *, layers: int = 1, heads: int = 2, d_kv: int = 8, d_ff: int = 32):
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(
        vocab_size=vocab_size,
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=layers,
        num_heads=heads,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(cfg).eval()


def _ltx_vae(channels: int, real_compression: bool):
    """A small-channel AutoencoderKLLTXVideo. real_compression=True keeps the released model's
    32x spatial / 8x temporal compression (so latent sizes match), else 4x / 4x (more tokens for a
    tiny video)."""
    if real_compression:
        scaling, patch = (True, True, True, False), 4
    else:
        scaling, patch = (True, True, False, False), 1
    c = (channels,) * 4
    vae = AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=8 if not real_compression else 128,
        block_out_channels=c,
        decoder_block_out_channels=c,
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=scaling,
        decoder_spatio_temporal_scaling=scaling,
        decoder_inject_noise=(False,) * 5,
        upsample_residual=(False,) * 4,
        upsample_factor=(1,) * 4,
        timestep_conditioning=False,
        patch_size=patch,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return vae.eval()


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # The released LTX-Video scheduler configuration.
    return FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )


def build_tiny_ltx_pipeline(*, seed: int = 0, num_layers: int = 2, max_length: int = 16):
    """A tiny fp32 LTXPipeline on the CPU (random weights, no hub): 2-block transformer of width 32
    (2 heads x 16; 32 % 6 == 2 so the RoPE padding channels are exercised), a 1-layer T5 and a
    4x/4x-compression VAE. 9 frames at 32x32 give 3 x 8 x 8 = 192 latent tokens."""
    from diffusers import LTXPipeline

    torch.manual_seed(seed)
    tokenizer, vocab = make_offline_t5_tokenizer(max_length)
    text_encoder = _t5_encoder(16, vocab)
    transformer = LTXVideoTransformer3DModel(
        in_channels=8,
        out_channels=8,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=16,
        cross_attention_dim=32,
        num_layers=num_layers,
        caption_channels=16,
    ).eval()
    vae = _ltx_vae(8, real_compression=False)
    return LTXPipeline(
        scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


def build_ltx_pipeline(*, device="cuda", transformer_dtype=torch.float32, seed: int = 0, max_length: int = 128):
    """The real-size LTX-Video transformer (LTXVideoTransformer3DModel() defaults, ~1.9 B parameters,
    random weights) built directly on `device`, with a small random T5 of the real width (4096) and
    a small-channel VAE with the released 32x/8x compression (latent sizes match the real model;
    the VAE only runs if the output is decoded). No network, no checkpoint."""
    from diffusers import LTXPipeline

    torch.manual_seed(seed)
    tokenizer, vocab = make_offline_t5_tokenizer(max_length)
    with torch.device(device):
        transformer = LTXVideoTransformer3DModel().to(transformer_dtype).eval()
        text_encoder = _t5_encoder(4096, vocab, layers=2, heads=8, d_kv=64, d_ff=1024)
        vae = _ltx_vae(32, real_compression=True)
    return LTXPipeline(
        scheduler=_scheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )


def load_ltx_pipeline(*, device="cuda", seed: int = 0, log=None):
    """(LTXPipeline in fp32 on `device`, what its weights are): Lightricks/LTX-Video from the local
    Hugging Face cache if it is there (offline, safetensors files only: no pickled weights are ever
    loaded), else build_ltx_pipeline's real-size random model. `log` gets a line saying why the cache
    was not used."""
    say = log or (lambda *a: None)
    try:
        from diffusers import LTXPipeline
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache("Lightricks/LTX-Video", "model_index.json"), str):
            pipe = LTXPipeline.from_pretrained(
                "Lightricks/LTX-Video", torch_dtype=torch.float32, local_files_only=True, use_safetensors=True
            )
            return pipe.to(device), "Lightricks/LTX-Video from the local cache"
        say(
            "LTX-Video weights are not in the local Hugging Face cache: using the real-size architecture with "
            "random weights"
        )
    except Exception as exc:  # a partial or unreadable cache: say why, then go on without it
        say(f"could not load LTX-Video from the local cache ({type(exc).__name__}: {exc}); using random weights")
    return build_ltx_pipeline(
        device=device, seed=seed
    ), "real-size LTX-Video transformer, random weights (no checkpoint)"


def _main(argv=None) -> int:
    """Report what injection replaces in the released LTX-Video architecture (built on the meta
    device: no memory, no weights) and check that removal restores every module."""
    import argparse
    import json

    p = argparse.ArgumentParser(
        description="Inject the kernels into LTX-Video's default transformer architecture (built on the meta "
        "device, no weights) and report the counts per kind as JSON. Library use: "
        "inject_optimized_kernels(pipe) / remove_optimized_kernels(pipe)."
    )
    p.add_argument("--num-layers", type=int, default=28, help="transformer blocks (default 28, the released model)")
    args = p.parse_args(argv)
    with torch.device("meta"):
        model = LTXVideoTransformer3DModel(num_layers=args.num_layers)
    counts = inject_optimized_kernels(model, verbose=False)
    again = inject_optimized_kernels(model, verbose=False)
    restored = remove_optimized_kernels(model, verbose=False)
    left = injected_counts(model)
    ok = counts == again == restored and not any(left.values())
    print(json.dumps({"injected": counts, "second_injection": again, "restored": restored, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

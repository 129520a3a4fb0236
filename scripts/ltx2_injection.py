# SPDX-License-Identifier: Apache-2.0
"""LTX-2 (diffusers' LTX2VideoTransformer3DModel, the audio-video transformer): a family plug-in of
diffusers_injection (references/adding-a-model.md). The generic layer first (each RMSNorm, LayerNorm and
tanh GELU one kernel), then the fusions across module boundaries, for the video and the audio stream alike:

* ``ltx2_blocks``: ``LTX2VideoTransformerBlock.forward``. Per stream, each step one kernel with fp32 math
  and one rounding: norm1 + AdaLN modulation; ``h + attn1 * gate`` with norm2 (and the text query's
  modulation where the block has one, LTX-2.3); ``h + attn2`` (gated, LTX-2.3) with the cross-modal norm
  and the audio-to-video modulation, then the video-to-audio modulation of the same norm (a second kernel:
  there is no RMSNorm kernel with two modulations); ``h + gate * a2v`` (``v2a`` for audio) with norm3 +
  modulation; ``h + ff * gate`` with the next block's norm1 + modulation when blocks follow each other
  and the modulation is per sample (the next block uses it only for the very same h and temb, unchanged:
  ic.take_carry), else alone.
  Modulation per sample (``[B, 1, D]``) or per token (``[B, S, D]``: the image-to-video pipeline's
  timesteps). The text encoder states' own modulation (LTX-2.3) and the embedders stay PyTorch ops.
* ``ltx2_qk_norm_rope``: the attention processor of each block's video and audio self-attention and of the
  audio-to-video and video-to-audio attentions (``LTX2AudioVideoAttnProcessor`` replaced by
  ``LTX2FusedAttnProcessor``, LTX-2.3's ``LTX2PerturbedAttnProcessor`` by ``LTX2FusedPerturbedAttnProcessor``;
  the prompt cross-attentions have no RoPE and keep theirs). The q/k RMSNorms (across heads) and the RoPE:
  - ``rope_type="interleaved"`` (the class default): self-attention's q and k norms + RoPE in ONE launch
    (``qk_norm_rope.ltx_qk_rmsnorm_rope``, LTX-Video's kernel: the same ``apply_interleaved_rotary_emb`` form and
    tables); the cross-modal attentions, whose q and k have their own lengths and tables: the norm
    kernel, then ``rope.ltx_rope``, per tensor.
  - ``rope_type="split"`` (the released LTX-2's): per head, the first half of the channels rotated with
    the second, with one cos/sin value per pair and head (``[B, H, S, D / 2]`` tables): the norm kernel,
    then ``rope.rope_rotate_half`` per tensor (no kernel fuses a norm across heads with this form), which
    reads diffusers' [B, H, S, D / 2] tables in place (one value per channel pair): no table is copied, so
    the forward holds no more table memory than diffusers'; under torch.compile diffusers' function runs.
  The attention itself is diffusers' dispatch_attention_fn with the processor's backend and parallel
  settings (carried over from the processor replaced, and back at removal); gated attention (LTX-2.3)
  as diffusers computes it.

Under torch.compile the model is the stock model: every patched forward and processor runs diffusers' code
while traced (ic.STOCK_UNDER_COMPILE: Inductor's own fusions were faster than the kernels here); eager calls and
graph mode run the kernels.

Everything falls back to diffusers' code where the kernels would not compute what it computes: autograd
(the kernels have no backward; a trainable weight inside a block counts), a hook on a module the fused
path would not call (a block norm, a q/k norm: that site runs the module; a hooked block is not carried
into), blocks of a subclass with a forward of its own (left alone, with their attentions), other attention
processors (set before injection: left in place; set after: they run), dtype mixes (an fp32
modulation table on bf16 activations promotes in diffusers), tables or vectors of other shapes. The rope
modules are not touched: a hook on them runs and its output is what the kernels read. Injecting twice
changes nothing; removal restores the original forwards and processors, outputs then bit for bit.
"""

from __future__ import annotations

import logging
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the leaf kernels live beside this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from diffusers.models.transformers.transformer_ltx2 import (  # noqa: E402
    LTX2Attention,
    LTX2AudioVideoAttnProcessor,
    LTX2PerturbedAttnProcessor,
    LTX2VideoTransformer3DModel,
    LTX2VideoTransformerBlock,
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)

import fp8_linear  # noqa: E402
import generic_injection as gi  # noqa: E402
import injection_common as ic  # noqa: E402
import qk_norm_rope  # noqa: E402
import rmsnorm  # noqa: E402
import rope  # noqa: E402

__all__ = [
    "KINDS",
    "find_models",
    "inject",
    "remove",
    "injected_counts",
    "LTX2FusedAttnProcessor",
    "LTX2FusedPerturbedAttnProcessor",
]

logger = logging.getLogger("ltx2_injection")

KINDS = ("ltx2_blocks", "ltx2_qk_norm_rope")
STATE = ic.register_state_key("_rtk_ltx2")  # per-module record of what was patched and how to undo it
_CARRY = "_rtk_ltx2_carry"  # what the previous block left for this one (per stream)
_PROCESSOR_KINDS = ("ltx2_qk_norm_rope",)
_ROPE_ATTENTIONS = ("attn1", "audio_attn1", "audio_to_video_attn", "video_to_audio_attn")
_ATTN_ARGS = frozenset(
    ("hidden_states", "encoder_hidden_states", "attention_mask", "query_rotary_emb", "key_rotary_emb")
)
_PERTURBATION_ARGS = frozenset(("perturbation_mask", "all_perturbed"))
_GET_MOD_PARAMS = LTX2VideoTransformerBlock.get_mod_params


# --------------------------------------------------------------------------------------------
# Norm + modulation sites of a block
# --------------------------------------------------------------------------------------------
def _fits(h, y, vectors) -> bool:
    """The kernels take h [B, S, D], y (None, or like h) and the vectors (None, or [B, 1 or S, D] of h's dtype,
    contiguous channels: the per-sample or per-token chunks of get_mod_params, read in place)."""
    if h.dim() != 3 or h.stride(-1) != 1 or h.shape[-1] < 2:
        return False
    if y is not None and (y.shape != h.shape or y.dtype != h.dtype or y.stride(-1) != 1):
        return False
    b, s, d = h.shape
    for v in vectors:
        if v is not None and not (
            v.dim() == 3 and v.shape[0] == b and v.shape[1] in (1, s) and v.shape[2] == d and v.dtype == h.dtype
        ):
            return False
        if v is not None and v.stride(-1) != 1:
            return False
    return ic.usable(h, y, *vectors)


def _kernel_args(norm, h, y, vectors):
    """(weight, eps, cast_before_weight) of norm when one kernel may compute its site for these tensors
    (gi.rms_args: a norm the kernel reproduces, with no hook), else None."""
    args = gi.rms_args(norm, h)
    if args is None or not _fits(h, y, vectors) or not ic.usable(h, args[0]):
        return None
    return args


def _res_norm(h, y, gate, norm, mods):
    """h + y * gate (y None: h as it is; gate None: h + y), then norm(h) * (1 + scale) + shift for each
    (scale, shift) of mods ((None, None): norm(h) alone). Returns (h, [outputs]). The residual and the first
    output are one kernel, each further output one more; where the kernels do not apply, diffusers' ops (the
    norm called once, as the block calls it)."""
    args = _kernel_args(norm, h, y, [gate, *(t for m in mods for t in m)])
    if args is None:
        if y is not None:
            h = h + y if gate is None else h + y * gate
        n = norm(h)
        return h, [n if s is None else n * (1 + s) + t for s, t in mods]
    w, eps, cbw = args
    outs = []
    for i, (s, t) in enumerate(mods):
        if i == 0 and y is not None:
            h, out = rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, s, t, w, eps, cast_before_weight=cbw)
        elif s is None:
            out = rmsnorm.rms_norm(h, w, eps, cast_before_weight=cbw)
        else:
            out = rmsnorm.rms_norm_modulate(h, s, t, w, eps, cast_before_weight=cbw)
        outs.append(out)
    return h, outs


def _residual_out(block, h, y, gate, temb, stream: str):
    """h + y * gate, the block's last residual of a stream: with the next block's first norm + modulation in
    the same kernel where blocks are linked (left in its carry), else one kernel alone (or diffusers' ops)."""
    nxt = ic.next_block(block)
    if nxt is not None and type(nxt).get_mod_params is _GET_MOD_PARAMS and ic.may_carry(block, nxt, temb, STATE):
        video = stream == "video"
        norm = nxt.norm1 if video else nxt.audio_norm1
        table = nxt.scale_shift_table if video else nxt.audio_scale_shift_table
        d = table.shape[-1]
        # per-sample modulation only: per token, making the next block's shift and scale twice costs more than
        # the norm's pass saves
        if temb.dim() == 3 and temb.shape[1] == 1 and temb.shape[-1] == table.shape[0] * d:
            # shift and scale as the next block's get_mod_params computes them (its first two chunks)
            shift, scale = nxt.get_mod_params(table[:2], temb[..., : 2 * d], h.size(0))
            args = _kernel_args(norm, h, y, (gate, scale, shift))
            if args is not None:
                h, out = rmsnorm.gated_residual_rms_norm_modulate(
                    h, y, gate, scale, shift, args[0], args[1], cast_before_weight=args[2]
                )
                ic.put_carry(nxt, _CARRY, stream, h, temb, out)
                return h
    if _fits(h, y, (gate,)):
        return rmsnorm.gated_residual_add(h, y, gate)
    return h + y * gate


def _attend(attn, *args, **kw):
    """attn(*args, **kw), the call the block makes: for a plain LTX2Attention with no hook, its processor
    called as LTX2Attention.forward calls it (without the forward's signature inspection on every call)."""
    if type(attn) is LTX2Attention and "forward" not in attn.__dict__ and ic.hook_free(attn):
        extra = {k: v for k, v in kw.items() if k not in _ATTN_ARGS}  # a comprehension dynamo traces
        if not extra or (extra.keys() <= _PERTURBATION_ARGS and type(attn.processor) in _PERTURBED):
            x = args[0] if args else kw["hidden_states"]
            get = kw.get
            return attn.processor(attn, x, get("encoder_hidden_states"), get("attention_mask"),
                                  get("query_rotary_emb"), get("key_rotary_emb"), **extra)  # fmt: skip
    return attn(*args, **kw)


def _self_attention(block, attn, x, rotary_emb, mask, perturbation_mask, all_perturbed):
    kw = dict(hidden_states=x, encoder_hidden_states=None, query_rotary_emb=rotary_emb, attention_mask=mask)
    if block.perturbed_attn:
        kw.update(perturbation_mask=perturbation_mask, all_perturbed=all_perturbed)
    return _attend(attn, **kw)


def _block_forward(
    self,
    hidden_states,
    audio_hidden_states,
    encoder_hidden_states,
    audio_encoder_hidden_states,
    temb,
    temb_audio,
    temb_ca_scale_shift,
    temb_ca_audio_scale_shift,
    temb_ca_gate,
    temb_ca_audio_gate,
    temb_prompt=None,
    temb_prompt_audio=None,
    video_rotary_emb=None,
    audio_rotary_emb=None,
    ca_video_rotary_emb=None,
    ca_audio_rotary_emb=None,
    encoder_attention_mask=None,
    audio_encoder_attention_mask=None,
    self_attention_mask=None,
    audio_self_attention_mask=None,
    a2v_cross_attention_mask=None,
    v2a_cross_attention_mask=None,
    use_a2v_cross_attention=True,
    use_v2a_cross_attention=True,
    perturbation_mask=None,
    all_perturbed=None,
):
    """LTX2VideoTransformerBlock.forward with its norms, modulations and residuals fused (module docstring).
    The same math: each fused step in fp32 with one rounding, where diffusers rounds after every op."""
    inputs = (
        hidden_states,
        audio_hidden_states,
        encoder_hidden_states,
        audio_encoder_hidden_states,
        temb,
        temb_audio,
        temb_ca_scale_shift,
        temb_ca_audio_scale_shift,
        temb_ca_gate,
        temb_ca_audio_gate,
        temb_prompt,
        temb_prompt_audio,
        video_rotary_emb,
        audio_rotary_emb,
        ca_video_rotary_emb,
        ca_audio_rotary_emb,
        encoder_attention_mask,
        audio_encoder_attention_mask,
        self_attention_mask,
        audio_self_attention_mask,
        a2v_cross_attention_mask,
        v2a_cross_attention_mask,
    )
    h, a = hidden_states, audio_hidden_states
    carried = ic.take_carry(self, _CARRY, "video", h, temb)  # (cleared either way)
    carried_audio = ic.take_carry(self, _CARRY, "audio", a, temb_audio)
    if h.dim() != 3 or a.dim() != 3 or ic.stock_under_compile(self) or ic.needs_autograd(self, *inputs):
        return gi.original(self)(
            *inputs, use_a2v_cross_attention, use_v2a_cross_attention, perturbation_mask, all_perturbed
        )
    batch_size = h.size(0)
    v = self.get_mod_params(self.scale_shift_table, temb, batch_size)  # shift, scale, gate (msa, mlp[, text q])
    av = self.get_mod_params(self.audio_scale_shift_table, temb_audio, batch_size)

    # 1. self-attention: norm1 + modulation (or the previous block's carry); h + attn1 * gate with norm2
    # Memory: each value is dropped once read (a name rebound, or set to None), so that no block output waits for
    # the feed-forward's peak; diffusers' block keeps most of its intermediates until it returns.
    n = carried if carried is not None else _res_norm(h, None, None, self.norm1, [(v[1], v[0])])[1][0]
    carried = None
    y = _self_attention(self, self.attn1, n, video_rotary_emb, self_attention_mask, perturbation_mask, all_perturbed)
    n = None
    h, (n,) = _res_norm(h, y, v[2], self.norm2, [(v[7], v[6]) if self.video_cross_attn_adaln else (None, None)])
    y = None
    na = (
        carried_audio
        if carried_audio is not None
        else _res_norm(a, None, None, self.audio_norm1, [(av[1], av[0])])[1][0]
    )
    carried_audio = None
    y = _self_attention(
        self, self.audio_attn1, na, audio_rotary_emb, audio_self_attention_mask, perturbation_mask, all_perturbed
    )
    na = None
    a, (na,) = _res_norm(
        a, y, av[2], self.audio_norm2, [(av[7], av[6]) if self.audio_cross_attn_adaln else (None, None)]
    )
    y = None

    # 2. prompt cross-attention (the text states' modulation as diffusers computes it)
    if self.cross_attn_adaln:
        if temb_prompt is not None:
            shift_text_kv, scale_text_kv = self.get_mod_params(self.prompt_scale_shift_table, temb_prompt, batch_size)
        else:
            shift_text_kv, scale_text_kv = (
                self.prompt_scale_shift_table[None, None].to(device=h.device, dtype=h.dtype).unbind(dim=2)
            )
        if temb_prompt_audio is not None:
            audio_shift_text_kv, audio_scale_text_kv = self.get_mod_params(
                self.audio_prompt_scale_shift_table, temb_prompt_audio, batch_size
            )
        else:
            audio_shift_text_kv, audio_scale_text_kv = (
                self.audio_prompt_scale_shift_table[None, None].to(device=a.device, dtype=a.dtype).unbind(dim=2)
            )
        encoder_hidden_states = encoder_hidden_states * (1 + scale_text_kv) + shift_text_kv
        audio_encoder_hidden_states = audio_encoder_hidden_states * (1 + audio_scale_text_kv) + audio_shift_text_kv
    y = _attend(self.attn2, n, encoder_hidden_states=encoder_hidden_states, query_rotary_emb=None,
                attention_mask=encoder_attention_mask)  # fmt: skip
    n = None
    ya = _attend(self.audio_attn2, na, encoder_hidden_states=audio_encoder_hidden_states, query_rotary_emb=None,
                 attention_mask=audio_encoder_attention_mask)  # fmt: skip
    na = None
    gate = v[8] if self.video_cross_attn_adaln else None
    audio_gate = av[8] if self.audio_cross_attn_adaln else None

    # 3. audio-to-video and video-to-audio: h + attn2 with the cross-modal norm and its modulations
    a2v, v2a = use_a2v_cross_attention, use_v2a_cross_attention
    if a2v or v2a:
        vt, at = self.video_a2v_cross_attn_scale_shift_table, self.audio_a2v_cross_attn_scale_shift_table
        vs = self.get_mod_params(vt[:4, :], temb_ca_scale_shift, batch_size)  # a2v scale, shift; v2a scale, shift
        a2v_gate = self.get_mod_params(vt[4:, :], temb_ca_gate, batch_size)[0].squeeze(2)
        avs = self.get_mod_params(at[:4, :], temb_ca_audio_scale_shift, batch_size)
        v2a_gate = self.get_mod_params(at[4:, :], temb_ca_audio_gate, batch_size)[0].squeeze(2)
        sel = [i for i, on in ((0, a2v), (2, v2a)) if on]
        h, vm = _res_norm(h, y, gate, self.audio_to_video_norm, [(vs[i].squeeze(2), vs[i + 1].squeeze(2)) for i in sel])
        y = None
        a, am = _res_norm(a, ya, audio_gate, self.video_to_audio_norm,
                          [(avs[i].squeeze(2), avs[i + 1].squeeze(2)) for i in sel])  # fmt: skip
        ya = None
        mlp, audio_mlp = [(v[4], v[3])], [(av[4], av[3])]
        if a2v:
            y = _attend(self.audio_to_video_attn, vm[0], encoder_hidden_states=am[0], query_rotary_emb=ca_video_rotary_emb,
                        key_rotary_emb=ca_audio_rotary_emb, attention_mask=a2v_cross_attention_mask)  # fmt: skip
            vm, am = vm[-1:] if v2a else [], am[-1:] if v2a else []  # (the a2v inputs, read)
            h, (n,) = _res_norm(h, y, a2v_gate, self.norm3, mlp)
            y = None
        else:
            n = _res_norm(h, None, None, self.norm3, mlp)[1][0]
        if v2a:
            y = _attend(self.video_to_audio_attn, am[-1], encoder_hidden_states=vm[-1], query_rotary_emb=ca_audio_rotary_emb,
                        key_rotary_emb=ca_video_rotary_emb, attention_mask=v2a_cross_attention_mask)  # fmt: skip
            vm = am = None
            a, (na,) = _res_norm(a, y, v2a_gate, self.audio_norm3, audio_mlp)
            y = None
        else:
            na = _res_norm(a, None, None, self.audio_norm3, audio_mlp)[1][0]
        vm = am = None
    else:  # h + attn2 with norm3 + modulation
        h, (n,) = _res_norm(h, y, gate, self.norm3, [(v[4], v[3])])
        y = None
        a, (na,) = _res_norm(a, ya, audio_gate, self.audio_norm3, [(av[4], av[3])])
        ya = None

    # 4. feed-forward; h + ff * gate (with the next block's norm1 + modulation where blocks are linked)
    y = gi.feed_forward(self.ff, n, STATE)
    n = None
    h = _residual_out(self, h, y, v[5], temb, "video")
    y = gi.feed_forward(self.audio_ff, na, STATE)
    na = None
    a = _residual_out(self, a, y, av[5], temb_audio, "audio")
    return h, a


# --------------------------------------------------------------------------------------------
# Attention: q/k RMSNorm + RoPE through the kernels
# --------------------------------------------------------------------------------------------
def _interleaved_ok(x, tables) -> bool:
    """(cos, sin) are per-channel tables [B or 1, S, C] or [S, C] for x [B, S, C] (what the kernels take)."""
    if not isinstance(tables, (tuple, list)) or len(tables) != 2 or x.dim() != 3 or x.stride(-1) != 1:
        return False
    b, s, c = x.shape
    for t in tables:
        if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3) or t.shape[-2:] != (s, c) or t.stride(-1) != 1:
            return False
        if t.dim() == 3 and t.shape[0] not in (1, b):
            return False
    return ic.usable(x, *tables)


def _rope(kind: str, x, tables):
    """diffusers' apply_interleaved_rotary_emb / apply_split_rotary_emb (as the processor picks them) through
    rope.ltx_rope / rope.rope_rotate_half where they take the tables, else diffusers' function."""
    if kind == "interleaved":
        return rope.ltx_rope(x, *tables) if _interleaved_ok(x, tables) else apply_interleaved_rotary_emb(x, tables)
    cos, sin = tables
    if x.dim() == 3 and cos.dim() == 4 and x.stride(-1) == 1 and not torch.compiler.is_compiling():
        b, heads, s, r = cos.shape
        rows = all(t.stride(-1) == 1 or r == 1 for t in (cos, sin))  # (the kernel reads the tables in place)
        if sin.shape == cos.shape and x.shape == (b, s, 2 * heads * r) and rows and ic.usable(x, cos, sin):
            out = rope.rope_rotate_half(x.unflatten(2, (heads, 2 * r)).transpose(1, 2), cos, sin)
            return out.transpose(1, 2).reshape(b, s, -1)
    return apply_split_rotary_emb(x, tables)


def _qk_norm_rope(attn, query, key, query_rotary_emb, key_rotary_emb):
    """(rope(norm_q(query)), rope(norm_k(key))) as LTX2AudioVideoAttnProcessor computes them."""
    nq, nk, kind = attn.norm_q, attn.norm_k, attn.rope_type
    if query_rotary_emb is None or kind not in ("interleaved", "split"):
        return ic.call(nq, query), ic.call(nk, key)
    same = key_rotary_emb is None or all(a is b for a, b in zip(query_rotary_emb, key_rotary_emb))
    key_rotary_emb = query_rotary_emb if key_rotary_emb is None else key_rotary_emb
    if kind == "interleaved" and same and query.shape == key.shape and query.dtype == key.dtype:
        qa, ka = gi.rms_args(nq, query), gi.rms_args(nk, key)
        if (
            qa is not None
            and ka is not None
            and qa[1:] == ka[1:]
            and (qa[0] is None) == (ka[0] is None)
            and _interleaved_ok(query, query_rotary_emb)
            and ic.usable(key, qa[0], ka[0])
        ):  # one launch: both norms (across heads) and the rotation
            return qk_norm_rope.ltx_qk_rmsnorm_rope(
                query, key, qa[0], ka[0], qa[1], *query_rotary_emb, cast_before_weight=qa[2]
            )
    query, key = ic.call(nq, query), ic.call(nk, key)  # the norm modules (each one kernel: the generic layer)
    return _rope(kind, query, query_rotary_emb), _rope(kind, key, key_rotary_emb)


def _attention(
    proc,
    attn,
    hidden_states,
    encoder_hidden_states,
    attention_mask,
    query_rotary_emb,
    key_rotary_emb,
    perturbation_mask,
    all_perturbed,
):
    """What LTX2AudioVideoAttnProcessor (perturbation_mask None, all_perturbed False) and
    LTX2PerturbedAttnProcessor compute, the q/k norms and RoPE through the kernels (_qk_norm_rope)."""
    batch_size, sequence_length, _ = (
        hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
    )
    if attention_mask is not None:
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
    if encoder_hidden_states is None:
        encoder_hidden_states = hidden_states
    gate_logits = None if attn.to_gate_logits is None else ic.call(attn.to_gate_logits, hidden_states)
    if all_perturbed:  # (spatio-temporal guidance) the values stand in for the attention
        hidden_states = ic.call(attn.to_v, encoder_hidden_states)
    else:
        if encoder_hidden_states is hidden_states:
            query, key, value = fp8_linear.project(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        else:
            query = ic.call(attn.to_q, hidden_states)
            key, value = fp8_linear.project(encoder_hidden_states, attn.to_k, attn.to_v)
        query, key = _qk_norm_rope(attn, query, key, query_rotary_emb, key_rotary_emb)
        heads = (attn.heads, -1)
        hidden_states = gi.dispatch_attention(
            proc, query.unflatten(2, heads), key.unflatten(2, heads), value.unflatten(2, heads), attention_mask
        )
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if perturbation_mask is not None:
            hidden_states = torch.lerp(value, hidden_states, perturbation_mask)
    if gate_logits is not None:
        hidden_states = hidden_states.unflatten(2, (attn.heads, -1))
        gates = 2.0 * torch.sigmoid(gate_logits)
        hidden_states = (hidden_states * gates.unsqueeze(-1)).flatten(2, 3)
    return ic.call(attn.to_out[1], ic.call(attn.to_out[0], hidden_states))


class LTX2FusedAttnProcessor:
    """LTX2AudioVideoAttnProcessor with the q/k RMSNorms and the RoPE through the kernels (_qk_norm_rope):
    the projections (with FP8 layers the input quantised once for all that read it), diffusers'
    dispatch_attention_fn with this processor's backend and parallel settings, the per-head gates of gated
    attention, the output projection; otherwise the same steps as diffusers' processor."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
        key_rotary_emb=None,
    ):  # fmt: skip
        stock = ic.stock_processor(attn, self)  # (under torch.compile in a marked model: ic.STOCK_UNDER_COMPILE)
        if stock is not None:
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
        return _attention(self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                          key_rotary_emb, None, False)  # fmt: skip


class LTX2FusedPerturbedAttnProcessor(LTX2FusedAttnProcessor):
    """LTX2PerturbedAttnProcessor (LTX-2.3's: spatio-temporal guidance) the same way: with no perturbation asked
    for it is LTX2FusedAttnProcessor; a perturbation mask mixes the values in as diffusers does."""

    def __call__(
        self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
        key_rotary_emb=None, perturbation_mask=None, all_perturbed=None,
    ):  # fmt: skip
        stock = ic.stock_processor(attn, self)
        if stock is not None:
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb,
                         perturbation_mask, all_perturbed)  # fmt: skip
        if all_perturbed is None:
            all_perturbed = torch.all(perturbation_mask == 0) if perturbation_mask is not None else False
        return _attention(self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb,
                          key_rotary_emb, perturbation_mask, all_perturbed)  # fmt: skip


_FUSED = {
    LTX2AudioVideoAttnProcessor: LTX2FusedAttnProcessor,
    LTX2PerturbedAttnProcessor: LTX2FusedPerturbedAttnProcessor,
}
_PERTURBED = (LTX2PerturbedAttnProcessor, LTX2FusedPerturbedAttnProcessor)


# --------------------------------------------------------------------------------------------
# Public API (the family plug-in interface of diffusers_injection.FAMILIES)
# --------------------------------------------------------------------------------------------
def find_models(pipe_or_model) -> list:
    """Every LTX2VideoTransformer3DModel inside the input (a pipeline's components, or a module), each once."""
    return [m for m in ic.unique_modules(pipe_or_model) if isinstance(m, LTX2VideoTransformer3DModel)]


def injected_counts(pipe_or_model) -> dict:
    """Counts per kind of what this family holds injected in pipe_or_model."""
    return ic.kind_counts(ic.modules_once(find_models(pipe_or_model)), STATE, KINDS)


def _install_processor(attn) -> bool:
    """An LTX2FusedAttnProcessor in place of diffusers' LTX2AudioVideoAttnProcessor (its backend and parallel
    settings carried over), the replaced one kept for removal."""
    fused = _FUSED.get(type(attn.processor))
    if ic.bundle_state(attn) is not None or fused is None:
        return False
    prev, proc = attn.processor, fused()
    ic.carry_processor_settings(prev, proc)
    attn.set_processor(proc)
    attn.__dict__[STATE] = {"kind": "ltx2_qk_norm_rope", "prev": prev}
    return True


def _link_blocks(model) -> None:
    """Link consecutive patched blocks of one transformer for the carried norm1 (_residual_out)."""
    blocks = list(model.transformer_blocks)
    patched = [b.__dict__.get(STATE, {}).get("kind") == "ltx2_blocks" for b in blocks]
    for i, blk in enumerate(blocks):
        if patched[i]:
            blk.__dict__.setdefault(_CARRY, {})
            linked = i + 1 < len(blocks) and patched[i + 1]
            ic.link_next(blk, blocks[i + 1] if linked else None)


def inject(pipe_or_model, *, verbose: bool = True) -> dict:
    """The generic kernels, then the fused blocks and attention processors, in every LTX-2 transformer of
    pipe_or_model. Returns the counts per kind after the call; a second call wraps nothing twice."""
    skipped = []
    gi._torch_rms_rounding()  # torch.nn.RMSNorm's rounding, probed now: a torch.compile trace cannot probe it
    for model in find_models(pipe_or_model):
        gi.inject_generic_kernels(model, verbose=False, skipped=skipped)
        for m in model.modules():
            if not isinstance(m, LTX2VideoTransformerBlock):
                continue
            if not ic.class_forward(m, LTX2VideoTransformerBlock):
                skipped.append(f"{type(m).__name__} (a forward of its own)")
                continue
            gi.patch(m, _block_forward, "ltx2_blocks", STATE)
            for name in _ROPE_ATTENTIONS:
                attn = getattr(m, name)
                if isinstance(attn, LTX2Attention) and not _install_processor(attn) and STATE not in attn.__dict__:
                    skipped.append(f"{name} with processor {type(attn.processor).__name__}")
        _link_blocks(model)
        gi.mark_stock_under_compile([model])  # Inductor's own fusions are faster here (ic.STOCK_UNDER_COMPILE)
    counts = injected_counts(pipe_or_model)
    none_found = "" if find_models(pipe_or_model) else "no LTX-2 transformer found"
    msg = ic.counts_message("injected LTX-2 kernels", counts, none_found=none_found, skipped=skipped)
    ic.report(logger, msg, verbose)
    return counts


def remove(pipe_or_model, *, verbose: bool = True) -> dict:
    """Undo inject: the original forwards and processors back (and the generic layer removed). Returns the
    counts restored per kind."""
    fused = tuple(_FUSED.values())
    return gi.remove_family(
        find_models(pipe_or_model), STATE, KINDS, logger, "LTX-2", verbose, _PROCESSOR_KINDS, fused, carry=_CARRY
    )


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="The LTX-2 family plug-in of diffusers_injection (nothing to run on its own): "
        "diffusers_injection.inject_optimized_kernels(pipe) uses it for every LTX2VideoTransformer3DModel; "
        "tests/test_ltx2_injection.py checks it."
    ).parse_args()

# SPDX-License-Identifier: Apache-2.0
"""The HunyuanVideo 1.5 family plug-in (diffusers_injection.FAMILIES): the generic layer, then the fusions
across module boundaries that the generic layer cannot make.

    import hunyuan_video15_injection as hv
    counts = hv.inject(pipe)        # or di.inject_optimized_kernels(pipe), which asks this family
    hv.remove(pipe)                 # original forwards and processors back, outputs bit for bit

It takes ``HunyuanVideo15Transformer3DModel`` and HunyuanVideo 1.0's ``HunyuanVideoTransformer3DModel``,
whose double-stream block forward is the same code and whose attention processor differs only in the mask
(1.5 builds its [B, 1, S, S] mask from the text mask inside the processor, 1.0 passes the model's through).
First ``generic_injection.inject_generic_kernels`` (AdaLayerNormZero norm + modulation, LayerNorms, the
output AdaLayerNormContinuous, tanh-GELU, ...), then, per kind:

* ``hunyuan_video15_blocks``: ``HunyuanVideo15TransformerBlock`` / ``HunyuanVideoTransformerBlock`` (both
  streams): ``h + gate_msa * attn`` with norm2 and the MLP modulation in one kernel
  (``layernorm.gated_residual_layer_norm_modulate``, returning the residual and the feed-forward's input);
  ``h + gate_mlp * ff`` in one kernel (``rmsnorm.gated_residual_add``) or, between two linked blocks,
  together with the next block's norm1 / norm1_context (AdaLayerNormZero, ``gi.adaln_zero_apply``), which
  that block uses only for the very tensors it was computed from (``ic.take_carry``). The attention
  processor is called directly where ``Attention.forward`` would only call it (no hook, no extra arguments).
* ``hunyuan_video15_patch_embed``: the patch embedding (``HunyuanVideo15PatchEmbed`` /
  ``HunyuanVideoPatchEmbed``) returns its tokens as contiguous rows. Its conv output [B, C, N] read as
  [B, N, C] has rows strided by N, which the row kernels cannot read; copied here, the strided view dies at
  once, where a copy made by the first block would be held next to it (the model's forward keeps the view)
  through that block's attention. The same values, the same one copy.
* ``hunyuan_video15_qk_norm_rope``: the joint attention's processor (``HunyuanVideo15AttnProcessor2_0`` /
  ``HunyuanVideoAttnProcessor2_0`` of the double-stream blocks): the per-head q/k RMSNorms of the image and
  text streams, the RoPE of the image tokens and the [image, text] concatenation in one launch
  (``head_norm_rope.joint_head_rms_norm_rope``). The kernel rotates every token by one [S, D] table, so the
  text rows of its table are the identity rotation (cos 1, sin 0: the normalised value comes back
  unchanged), built once per RoPE table and text length. ``dispatch_attention_fn`` (with the processor's
  backend and parallel settings) and the output projections are diffusers'; 1.5's [B, 1, S, S] mask is the
  processor's, built in one broadcast op where diffusers repeats the text mask to [B, 1, S, S] first and keeps
  that copy through the attention (the same values: S * S bytes less at the attention's peak). The
  projections are dropped once the kernel has read them, as diffusers drops its own.

Falls back to diffusers' code for whatever the kernels do not reproduce: autograd (no backward), a block
whose class has a forward of its own, hooks on a module the fused path would not call (q/k norms, norm2,
the next block's norm1, the attention module, the feed-forward's layers), another processor or a processor
call without text stream / mask, dtype mixes (an fp32 q/k norm weight on bf16 activations), tables other
than [S_img, D] cos/sin. HunyuanVideo 1.0's single-stream and token-replace blocks get the generic layer.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the kernels live beside this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers.models.attention_processor import Attention  # noqa: E402
from diffusers.models.normalization import AdaLayerNormZero, RMSNorm  # noqa: E402
from diffusers.models.transformers.transformer_hunyuan_video import (  # noqa: E402
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoPatchEmbed,
    HunyuanVideoTransformer3DModel,
    HunyuanVideoTransformerBlock,
)
from diffusers.models.transformers.transformer_hunyuan_video15 import (  # noqa: E402
    HunyuanVideo15AttnProcessor2_0,
    HunyuanVideo15PatchEmbed,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideo15TransformerBlock,
)
from torch.utils.weak import WeakIdKeyDictionary  # noqa: E402

import fp8_linear  # noqa: E402
import generic_injection as gi  # noqa: E402
import head_norm_rope  # noqa: E402
import injection_common as ic  # noqa: E402

__all__ = ["KINDS", "find_models", "inject", "remove", "injected_counts", "HunyuanVideo15FusedAttnProcessor"]

logger = logging.getLogger("hunyuan_video15_injection")

KINDS = ("hunyuan_video15_blocks", "hunyuan_video15_patch_embed", "hunyuan_video15_qk_norm_rope")
_STATE = ic.register_state_key("_rtk_hunyuan_video15")  # per-module record of what this family patched
_CARRY = "_rtk_hunyuan_video15_carry"  # the norm1 outputs the previous block computed for this one
_PROCESSOR_KINDS = ("hunyuan_video15_qk_norm_rope",)
_MODELS = (HunyuanVideo15Transformer3DModel, HunyuanVideoTransformer3DModel)
_BLOCKS = (HunyuanVideo15TransformerBlock, HunyuanVideoTransformerBlock)
_STOCK_PROCESSORS = (HunyuanVideo15AttnProcessor2_0, HunyuanVideoAttnProcessor2_0)
_PATCH_EMBEDS = (HunyuanVideo15PatchEmbed, HunyuanVideoPatchEmbed)


# --------------------------------------------------------------------------------------------
# Transformer blocks
# --------------------------------------------------------------------------------------------
def _attend(attn, x, c, attention_mask, freqs_cis):
    """attn(hidden_states=x, encoder_hidden_states=c, attention_mask=..., image_rotary_emb=...) as the block
    calls it: the processor called directly where Attention.forward would do nothing else (an unhooked
    Attention whose processor takes image_rotary_emb, so its signature filter drops nothing)."""
    if type(attn) is Attention and ic.unwrapped(attn) and type(attn.processor) in _PROCESSORS:
        return attn.processor(
            attn, x, encoder_hidden_states=c, attention_mask=attention_mask, image_rotary_emb=freqs_cis
        )
    return attn(hidden_states=x, encoder_hidden_states=c, attention_mask=attention_mask, image_rotary_emb=freqs_cis)


def _gated_add_to_next(block, key, h, gate, y, temb):
    """The block's last gated residual h + gate[:, None] * y; between linked blocks computed together with the
    next block's norm1 (key "x") or norm1_context (key "c"), left in that block's carry."""
    nxt = ic.next_block(block)
    if nxt is not None and ic.may_carry(block, nxt, temb, _STATE):
        norm = nxt.norm1 if key == "x" else nxt.norm1_context
        # computed before the next block runs: the norm and its layers must run nothing but their forwards
        if type(norm) is AdaLayerNormZero and norm.emb is None and all(ic.unwrapped(m) for m in norm.modules()):
            h, outputs = gi.adaln_zero_apply(norm, h, temb, y, gate)
            ic.put_carry(nxt, _CARRY, key, h, temb, outputs)
            return h
    return gi.gated_add(h, gate, y)


def _rows(t):
    return t if t.stride(-1) == 1 else t.contiguous()


def _patch_embed_forward(self, hidden_states):
    """HunyuanVideo15PatchEmbed / HunyuanVideoPatchEmbed.forward with its [B, N, C] tokens as contiguous rows
    (the conv's [B, C, N] output read as [B, N, C], copied while nothing else holds it; module docstring)."""
    return _rows(gi.original(self)(hidden_states))


def _block_forward(self, hidden_states, encoder_hidden_states, temb, attention_mask=None, freqs_cis=None, *args, **kw):
    """HunyuanVideo15TransformerBlock.forward (HunyuanVideoTransformerBlock's is the same code) with the
    gated residual + norm2 + modulation of each stream in one kernel and the last gated residual fused into
    the next block's norm1 where linked (see the module docstring)."""
    carried_x = ic.take_carry(self, _CARRY, "x", hidden_states, temb)  # (always cleared)
    carried_c = ic.take_carry(self, _CARRY, "c", encoder_hidden_states, temb)
    if ic.needs_autograd(self, hidden_states, encoder_hidden_states, temb):  # the kernels have no backward
        return gi.original(self)(hidden_states, encoder_hidden_states, temb, attention_mask, freqs_cis, *args, **kw)
    # The patch embedding's [B, C, N] output read as [B, N, C] (rows strided by N) would keep that layout through
    # every block (torch's elementwise ops do), and the row kernels would all step aside: the injected patch
    # embedding returns contiguous rows. Where it did not run (a subclass of it, say), block 0 copies them here.
    hidden_states, encoder_hidden_states = _rows(hidden_states), _rows(encoder_hidden_states)
    x, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
        carried_x if carried_x is not None else self.norm1(hidden_states, emb=temb)
    )
    c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = (
        carried_c if carried_c is not None else self.norm1_context(encoder_hidden_states, emb=temb)
    )
    carried_x = carried_c = None  # (x and c are dropped below as soon as they are replaced, as in diffusers)
    attn_output, context_attn_output = _attend(self.attn, x, c, attention_mask, freqs_cis)
    hidden_states, x = gi.residual_norm_modulate(hidden_states, attn_output, gate_msa, self.norm2, scale_mlp, shift_mlp)
    encoder_hidden_states, c = gi.residual_norm_modulate(
        encoder_hidden_states, context_attn_output, c_gate_msa, self.norm2_context, c_scale_mlp, c_shift_mlp
    )
    attn_output = context_attn_output = None  # (read: not held through the feed-forward)
    ff_output = gi.feed_forward(self.ff, x, _STATE)
    context_ff_output = gi.feed_forward(self.ff_context, c, _STATE)
    hidden_states = _gated_add_to_next(self, "x", hidden_states, gate_mlp, ff_output, temb)
    encoder_hidden_states = _gated_add_to_next(self, "c", encoder_hidden_states, c_gate_mlp, context_ff_output, temb)
    return hidden_states, encoder_hidden_states


def _link_blocks(model) -> None:
    """Link consecutive patched blocks of model.transformer_blocks for the carry (idempotent)."""
    blocks = list(getattr(model, "transformer_blocks", None) or [])
    for blk, nxt in zip(blocks, blocks[1:] + [None]):
        if _STATE not in blk.__dict__:
            continue
        linked = nxt is not None and type(nxt) is type(blk) and _STATE in nxt.__dict__
        ic.link_next(blk, nxt if linked else None)
        for b in (blk, nxt) if linked else (blk,):
            b.__dict__.setdefault(_CARRY, {})


# --------------------------------------------------------------------------------------------
# Attention processor
# --------------------------------------------------------------------------------------------
# The kernel rotates all tokens of its output by one [S_total, D] table; the text tokens are not rotated, so
# their rows hold the identity (cos 1, sin 0: y * 1 + partner * 0 is y exactly). Built once per RoPE table
# (every block of a forward gets the same (cos, sin) tensors) and text length, and dropped with the table; a
# table changed in place (version counter) is built again. Inference tensors keep no version counter and
# torch.compile traces none: the table is built on every call there.
_TABLES = WeakIdKeyDictionary()  # cos -> (weakref to sin, (versions, text length), (joint cos, joint sin))


def _joint_tables(cos, sin, text_len):
    cached = not torch.compiler.is_compiling() and not (cos.is_inference() or sin.is_inference())
    if cached:
        key = (cos._version, sin._version, text_len)
        hit = _TABLES.get(cos)
        if hit is not None and hit[0]() is sin and hit[1] == key:
            return hit[2]
    d = cos.shape[1]
    tables = (torch.cat([cos, cos.new_ones(text_len, d)]), torch.cat([sin, sin.new_zeros(text_len, d)]))
    if cached:
        _TABLES[cos] = (weakref.ref(sin), key, tables)
    return tables


def _rms(norm, x):
    """(weight, eps, cast_before_weight) where the kernel reproduces norm(x) for per-head rows x, else None:
    gi.rms_args, and diffusers' RMSNorm with an fp32 weight on fp32 rows (fp32 throughout)."""
    args = gi.rms_args(norm, x)
    if args is None and type(norm) is RMSNorm and x.dtype == torch.float32 and ic.unwrapped(norm):
        w = norm.weight
        if w is not None and w.dtype == torch.float32 and norm.bias is None and tuple(norm.dim) == (x.shape[-1],):
            args = (w, float(norm.eps), False)
    return args


def _fused_qk(attn, q, k, eq, ek, image_rotary_emb):
    """(q, k) [B, S_img + S_txt, H, D]: rope(norm_q(q)) then norm_added_q(eq), the same for k, from the kernel;
    None where it would not reproduce the modules."""
    if k.shape != q.shape or ek.shape != eq.shape or eq.dtype != q.dtype:
        return None
    if eq.shape[0] != q.shape[0] or eq.shape[2:] != q.shape[2:]:
        return None
    args = [
        _rms(n, t) for n, t in ((attn.norm_q, q), (attn.norm_k, k), (attn.norm_added_q, eq), (attn.norm_added_k, ek))
    ]
    if any(a is None for a in args):
        return None
    (wq, eps, cbw), (wk, eps_k, cbw_k), (wq2, eps2, cbw2), (wk2, eps2_k, cbw2_k) = args
    weights = (wq, wk, wq2, wk2)
    if eps != eps_k or eps2 != eps2_k or len({w is None for w in weights}) != 1:
        return None
    if wq is not None and (len({cbw, cbw_k, cbw2, cbw2_k}) != 1 or len({w.dtype for w in weights}) != 1):
        return None
    cos = sin = None
    if image_rotary_emb is not None:
        tables = gi.rope_tables(image_rotary_emb, q, 1, True)  # [S_img, D] cos and sin, or None
        if tables is None or not ic.usable(*tables):
            return None
        cos, sin = _joint_tables(*tables, eq.shape[1])
    if not ic.usable(q, k, eq, ek, *weights, cos, sin):
        return None
    return head_norm_rope.joint_head_rms_norm_rope(
        [(q, k, wq, wk), (eq, ek, wq2, wk2)], [eps, eps2], cos, sin, cast_before_weight=cbw
    )


class HunyuanVideo15FusedAttnProcessor:
    """HunyuanVideo15AttnProcessor2_0 (or HunyuanVideo 1.0's HunyuanVideoAttnProcessor2_0, ``stock``) of a joint
    attention with the per-head q/k RMSNorms of both streams, the image tokens' RoPE and the concatenation in
    one launch. Calls it does not cover (no text stream, no mask for 1.5, autograd) run the stock processor's
    code with this processor's backend and parallel settings."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, stock=HunyuanVideo15AttnProcessor2_0):
        self.stock = stock

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        v15 = self.stock is HunyuanVideo15AttnProcessor2_0
        norms = (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k)
        if (
            encoder_hidden_states is None
            or attn.add_q_proj is None
            or any(n is None for n in norms)
            or (v15 and attention_mask is None)
            or ic.needs_autograd(attn, hidden_states, encoder_hidden_states)
        ):
            return self.stock.__call__(
                self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        # (with FP8 layers each input is quantised once for its three projections: fp8_linear.project)
        q, k, v = fp8_linear.project(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        eq, ek, ev = fp8_linear.project(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        q, k, v, eq, ek, ev = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v, eq, ek, ev))
        fused = _fused_qk(attn, q, k, eq, ek, image_rotary_emb)
        if fused is not None:
            query, key = fused
        else:  # the stock sequence
            q, k = attn.norm_q(q), attn.norm_k(k)
            if image_rotary_emb is not None:
                q = gi.apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
                k = gi.apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
            query = torch.cat([q, attn.norm_added_q(eq)], dim=1)
            key = torch.cat([k, attn.norm_added_k(ek)], dim=1)
        value = torch.cat([v, ev], dim=1)
        # the projections, read: dropped before the attention (diffusers' processor replaces its own as it goes)
        fused = q = k = v = eq = ek = ev = None

        if v15:  # HunyuanVideo 1.5 pads the text mask over the image tokens and pairs it (module docstring)
            batch_size, seq_len = query.shape[:2]
            mask = F.pad(attention_mask, (seq_len - attention_mask.shape[1], 0), value=True).bool()
            # [b, 0, i, j] = mask[b, i] & mask[b, j]: diffusers' (mask repeated over the rows) & (its transpose)
            attention_mask = mask.view(batch_size, 1, 1, seq_len) & mask.view(batch_size, 1, seq_len, 1)
            mask = None

        hidden_states = gi.dispatch_attention(self, query, key, value, attention_mask)
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states, encoder_hidden_states = (
            hidden_states[:, : -encoder_hidden_states.shape[1]],
            hidden_states[:, -encoder_hidden_states.shape[1] :],
        )
        if getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


_PROCESSORS = (HunyuanVideo15FusedAttnProcessor, *_STOCK_PROCESSORS)


def _patch_processor(attn) -> bool:
    if ic.bundle_state(attn) is not None:
        return False
    prev = attn.processor
    proc = HunyuanVideo15FusedAttnProcessor(type(prev))
    ic.carry_processor_settings(prev, proc)  # keep backend / parallel choices
    attn.set_processor(proc)
    attn.__dict__[_STATE] = {"kind": "hunyuan_video15_qk_norm_rope", "prev": prev}
    return True


# --------------------------------------------------------------------------------------------
# The family interface
# --------------------------------------------------------------------------------------------
def find_models(pipe_or_model) -> list:
    """Every HunyuanVideo 1.5 (and 1.0) transformer inside the input, each once."""
    return [m for m in ic.unique_modules(pipe_or_model) if isinstance(m, _MODELS)]


def injected_counts(pipe_or_model) -> dict:
    return ic.kind_counts(ic.unique_modules(pipe_or_model), _STATE, KINDS)


def inject(pipe_or_model, *, verbose: bool = True) -> dict:
    """The generic layer, then the fused blocks and attention processors, into every model find_models
    returns. Returns the counts per kind after the call (a second call wraps nothing twice)."""
    models = find_models(pipe_or_model)
    new, skipped = {k: 0 for k in KINDS}, []
    for model in models:
        # (what is inside an AdaLN module the generic layer took stays out of a second pass, as in the first)
        adaln = [m for m in model.modules() if (m.__dict__.get(gi.STATE) or {}).get("kind") == "generic_adaln"]
        gi.inject_generic_kernels(model, verbose=False, skip=[c for m in adaln for c in m.children()])
        for m in model.modules():
            if type(m) in _PATCH_EMBEDS:
                new["hunyuan_video15_patch_embed"] += gi.patch(
                    m, _patch_embed_forward, "hunyuan_video15_patch_embed", _STATE
                )
            elif isinstance(m, _BLOCKS):
                if any(ic.class_forward(m, cls) for cls in _BLOCKS):
                    new["hunyuan_video15_blocks"] += gi.patch(m, _block_forward, "hunyuan_video15_blocks", _STATE)
                else:
                    skipped.append(f"{type(m).__name__} with a forward of its own")
            elif type(m) is Attention and getattr(m, "add_q_proj", None) is not None:
                if type(m.processor) in _STOCK_PROCESSORS:
                    new["hunyuan_video15_qk_norm_rope"] += _patch_processor(m)
                elif type(m.processor) is not HunyuanVideo15FusedAttnProcessor:
                    skipped.append(f"joint attention with processor {type(m.processor).__name__}")
        _link_blocks(model)
    counts = injected_counts(pipe_or_model)
    none_found = "" if models else "no HunyuanVideo transformer found"
    ic.report(
        logger,
        ic.counts_message("injected HunyuanVideo kernels", counts, new, none_found=none_found, skipped=skipped),
        verbose,
    )
    return counts


def remove(pipe_or_model, *, verbose: bool = True) -> dict:
    """Undo inject (the generic layer of these models included). Returns the counts restored per kind."""
    models, fused = find_models(pipe_or_model), (HunyuanVideo15FusedAttnProcessor,)
    return gi.remove_family(
        models, _STATE, KINDS, logger, "HunyuanVideo", verbose, _PROCESSOR_KINDS, fused, carry=_CARRY
    )


# --------------------------------------------------------------------------------------------
# Command line: counts on the released architectures (meta device: no memory, no weights)
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json

    argparse.ArgumentParser(
        description="Inject this family's kernels into the released HunyuanVideo 1.5 and HunyuanVideo 1.0 transformer "
        "architectures (the classes' default configurations, built on the meta device), remove them again and print "
        "the counts per kind as JSON. Library use: inject(pipe) / remove(pipe), or diffusers_injection."
        "inject_optimized_kernels(pipe), which asks this family.",
    ).parse_args(argv)
    report = {}
    for cls in _MODELS:
        with torch.device("meta"):
            model = cls()
        counts = inject(model, verbose=False)
        again = inject(model, verbose=False)
        generic = gi.generic_injected_counts(model)
        restored = remove(model, verbose=False)
        left = any(ic.bundle_state(m) for m in model.modules())
        ok = counts == again == restored and not left
        report[cls.__name__] = {"injected": {**counts, **{k: v for k, v in generic.items() if v}}, "ok": ok}
    ok = all(r["ok"] for r in report.values())
    print(json.dumps({"models": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

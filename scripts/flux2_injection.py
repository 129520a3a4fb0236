# SPDX-License-Identifier: Apache-2.0
"""The FLUX.2 family: the project's Triton kernels in diffusers' Flux2Transformer2DModel (FLUX.2 dev, Klein).

    import flux2_injection as f2
    counts = f2.inject_flux2_kernels(pipe)      # or a bare Flux2Transformer2DModel
    ...                                         # pipe(...) now runs the kernels
    f2.remove_flux2_kernels(pipe)               # original forwards and processors are back

``diffusers_injection.inject_optimized_kernels`` hands FLUX.2 transformers to this family (FAMILIES). The
generic layer comes first (generic_injection: the LayerNorms, the q/k RMSNorms where they still run, norm_out's
AdaLayerNormContinuous, apply_rotary_emb), then the fusions below. Per kind (counts on FLUX.2 dev: 8 double
and 48 single blocks, 48 heads of 128):

* ``flux2_double_blocks`` (8): ``Flux2TransformerBlock.forward``. norm1 + ``(1 + scale) * . + shift`` and
  norm1_context + its modulation (``layernorm.layer_norm_modulate``, one kernel each); ``h + gate_msa * attn``
  with norm2 + modulation in one kernel returning both (``layernorm.gated_residual_layer_norm_modulate``), the
  same for the text stream; ``h + gate_mlp * ff`` as one kernel per stream (``rmsnorm.gated_residual_add``).
  With FP8 layers (fp8=True) the feed-forward's SwiGLU writes linear_out's FP8 input and per-token scales.
* ``flux2_single_blocks`` (48): ``Flux2SingleTransformerBlock.forward``. norm + modulation in one kernel;
  ``h + gate * attn`` in one kernel.
* ``flux2_attention`` (8): ``Flux2AttnProcessor`` becomes ``Flux2FusedAttnProcessor``: the per-head q/k
  RMSNorms of text and image, their concatenation and the RoPE in one launch
  (``head_norm_rope.joint_head_rms_norm_rope``, through mmdit_injection.flux_qk_norm_rope, shared with FLUX.1).
* ``flux2_parallel_attention`` (48): ``Flux2ParallelSelfAttnProcessor`` becomes
  ``Flux2FusedParallelSelfAttnProcessor``: q/k RMSNorms + RoPE of the fused projection's q/k views in one launch.
* ``flux2_swiglu`` (64): ``Flux2SwiGLU`` (every feed-forward and each single block's MLP half):
  ``silu(x[..., :H]) * x[..., H:]`` in one kernel (``activations.swiglu``, gate first).

Each kernel computes in fp32 and rounds once; diffusers rounds after every op in bf16 / fp16, so the two
differ by those roundings there (in fp32 by a few ulps). Attention runs through diffusers'
``dispatch_attention_fn`` with the backend and parallel config of the replaced processor. fp16 clipping
(the text stream after each double block, the stream after each single block) is kept. Where the kernels do
not cover a call, the original code runs: autograd (a trainable weight inside, or an input requiring grad),
per-token modulation (the KV-cache "extract" step blends reference tokens' modulation), a hook on a module the
fused path would not call (a norm, a q/k norm, an attention or feed-forward module: it is called then), a
subclass with a forward of its own, another processor (Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor,
any user processor: left in place), devices and dtype mixes the kernels refuse. Injecting twice changes
nothing; removal restores the original forwards and processors, so outputs become bit-identical.
Not fused: a block's last residual with the next block's norm (mmdit_injection's carry); it would save one
read of the stream per block, well under 1% of a FLUX.2 dev forward. Run ``python flux2_injection.py`` for the
counts on FLUX.2 dev's architecture (meta device, no memory).
"""

from __future__ import annotations

import logging
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the leaf kernels live beside this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from diffusers.models.transformers.transformer_flux2 import (  # noqa: E402
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2FeedForward,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2SingleTransformerBlock,
    Flux2SwiGLU,
    Flux2Transformer2DModel,
    Flux2TransformerBlock,
)
from torch import nn  # noqa: E402

import activations  # noqa: E402
import fp8_linear  # noqa: E402
import generic_injection as gi  # noqa: E402
import injection_common as ic  # noqa: E402
import mmdit_injection as mi  # noqa: E402

__all__ = [
    "inject_flux2_kernels",
    "remove_flux2_kernels",
    "flux2_injected_counts",
    "find_flux2_models",
    "Flux2FusedAttnProcessor",
    "Flux2FusedParallelSelfAttnProcessor",
    "KINDS",
]

logger = logging.getLogger("flux2_injection")

KINDS = ("flux2_double_blocks", "flux2_single_blocks", "flux2_attention", "flux2_parallel_attention", "flux2_swiglu")
STATE = ic.register_state_key("_rtk_flux2")  # per-module record of what this family patched
_PROCESSOR_KINDS = ("flux2_attention", "flux2_parallel_attention")


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------
def _mods(mod, sets: int):
    """Flux2Modulation.split(mod, sets) as per-sample [B, D] vectors ((shift, scale, gate) per set), which the
    building blocks take; None where the modulation is per token ([B, S, 3 * sets * D] with S > 1: the KV-cache
    extract step), which the original forward computes."""
    if mod.dim() == 3 and mod.shape[1] == 1:
        mod = mod[:, 0]
    if mod.dim() != 2:
        return None
    chunks = mod.chunk(3 * sets, dim=-1)
    return [chunks[3 * i : 3 * i + 3] for i in range(sets)]


def _attend(attn, kwargs: dict, hidden_states, encoder_hidden_states, image_rotary_emb):
    """The block's attention call. diffusers' Flux2Attention / Flux2ParallelSelfAttention forward drops the
    keyword arguments its processor does not take (inspect.signature, every call) and calls the processor: with
    no keyword arguments, no hook and no forward put in its place, the processor is called directly."""
    if not kwargs and type(attn) in (Flux2Attention, Flux2ParallelSelfAttention) and ic.unwrapped(attn):
        if type(attn) is Flux2ParallelSelfAttention:
            return attn.processor(attn, hidden_states, None, image_rotary_emb)
        return attn.processor(attn, hidden_states, encoder_hidden_states, None, image_rotary_emb)
    if encoder_hidden_states is None:
        return attn(hidden_states=hidden_states, image_rotary_emb=image_rotary_emb, **kwargs)
    return attn(
        hidden_states=hidden_states,
        encoder_hidden_states=encoder_hidden_states,
        image_rotary_emb=image_rotary_emb,
        **kwargs,
    )


def _swiglu_takes(x) -> bool:
    """x may go to activations.swiglu: a kernel dtype and device, no autograd, even last dim contiguous, rows
    addressable with two strides (any 3-D view, e.g. the MLP half of the single blocks' fused projection)."""
    return (
        ic.usable(x)
        and 0 < x.dim()
        and x.shape[-1] % 2 == 0
        and x.stride(-1) == 1
        and (x.dim() <= 3 or x.is_contiguous())
    )


def _plain_silu(act) -> bool:
    return type(act) is nn.SiLU and not act.inplace and ic.unwrapped(act)


def _swiglu_forward(self, x):
    """Flux2SwiGLU: silu(x[..., :half]) * x[..., half:] in one kernel (fp32 math, one rounding)."""
    if _plain_silu(self.gate_fn) and _swiglu_takes(x) and not ic.stock_under_compile(self):
        return activations.swiglu(x, gate_first=True)
    return gi.original(self)(x)


def _feed_forward(ff, x):
    """ff(x); for a Flux2FeedForward whose linear_out is an FP8 layer taking inputs quantised elsewhere
    (fp8_linear.direct_fp8_format), the SwiGLU kernel writes that input (FP8 values and per-token scales,
    quantised from fp32: one pass fewer than the layer quantising the bf16 product itself)."""
    if type(ff) is not Flux2FeedForward or not ic.unwrapped(ff):
        return ff(x)
    fmt = fp8_linear.direct_fp8_format((ff.linear_out,))
    act = ff.act_fn
    if fmt is None or type(act) is not Flux2SwiGLU or not ic.unwrapped(act, STATE) or not _plain_silu(act.gate_fn):
        return ff(x)
    h = ic.call(ff.linear_in, x)
    if not _swiglu_takes(h):
        return ff.linear_out(act(h))
    return ff.linear_out.forward_fp8(*activations.swiglu(h, gate_first=True, fp8="per_token", fp8_dtype=fmt))


# --------------------------------------------------------------------------------------------
# Replacement forwards: the blocks
# --------------------------------------------------------------------------------------------
def _double_block_forward(
    self,
    hidden_states,
    encoder_hidden_states,
    temb_mod_img,
    temb_mod_txt,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
):
    """Flux2TransformerBlock.forward with norm + modulation and gated residual + norm + modulation fused."""
    img, txt = _mods(temb_mod_img, 2), _mods(temb_mod_txt, 2)
    inputs = (hidden_states, encoder_hidden_states, temb_mod_img, temb_mod_txt, image_rotary_emb)
    if img is None or txt is None or ic.stock_under_compile(self) or ic.needs_autograd(self, *inputs):
        return gi.original(self)(*inputs, joint_attention_kwargs)
    (shift_msa, scale_msa, gate_msa), (shift_mlp, scale_mlp, gate_mlp) = img
    (c_shift_msa, c_scale_msa, c_gate_msa), (c_shift_mlp, c_scale_mlp, c_gate_mlp) = txt

    norm_hidden_states = gi.norm_modulate(self.norm1, hidden_states, scale_msa, shift_msa)
    norm_encoder_hidden_states = gi.norm_modulate(self.norm1_context, encoder_hidden_states, c_scale_msa, c_shift_msa)
    attn_output, context_attn_output = _attend(
        self.attn, joint_attention_kwargs or {}, norm_hidden_states, norm_encoder_hidden_states, image_rotary_emb
    )

    hidden_states, norm_hidden_states = gi.residual_norm_modulate(
        hidden_states, attn_output, gate_msa, self.norm2, scale_mlp, shift_mlp
    )
    attn_output = None  # (read: not held through the feed-forward, as diffusers' block holds it)
    hidden_states = gi.gated_add(hidden_states, gate_mlp, _feed_forward(self.ff, norm_hidden_states))
    norm_hidden_states = None

    encoder_hidden_states, norm_encoder_hidden_states = gi.residual_norm_modulate(
        encoder_hidden_states, context_attn_output, c_gate_msa, self.norm2_context, c_scale_mlp, c_shift_mlp
    )
    context_attn_output = None
    context_ff_output = _feed_forward(self.ff_context, norm_encoder_hidden_states)
    encoder_hidden_states = gi.gated_add(encoder_hidden_states, c_gate_mlp, context_ff_output)
    if encoder_hidden_states.dtype == torch.float16:
        encoder_hidden_states = encoder_hidden_states.clip(-65504, 65504)
    return encoder_hidden_states, hidden_states


def _single_block_forward(
    self,
    hidden_states,
    encoder_hidden_states,
    temb_mod,
    image_rotary_emb=None,
    joint_attention_kwargs=None,
    split_hidden_states=False,
    text_seq_len=None,
):
    """Flux2SingleTransformerBlock.forward with norm + modulation and the gated residual as one kernel each."""
    mods = _mods(temb_mod, 1)
    inputs = (hidden_states, encoder_hidden_states, temb_mod, image_rotary_emb)
    if mods is None or ic.stock_under_compile(self) or ic.needs_autograd(self, *inputs):
        return gi.original(self)(*inputs, joint_attention_kwargs, split_hidden_states, text_seq_len)
    if encoder_hidden_states is not None:
        text_seq_len = encoder_hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    ((shift, scale, gate),) = mods

    norm_hidden_states = gi.norm_modulate(self.norm, hidden_states, scale, shift)
    attn_output = _attend(self.attn, joint_attention_kwargs or {}, norm_hidden_states, None, image_rotary_emb)
    hidden_states = gi.gated_add(hidden_states, gate, attn_output)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    if split_hidden_states:
        return hidden_states[:, :text_seq_len], hidden_states[:, text_seq_len:]
    return hidden_states


# --------------------------------------------------------------------------------------------
# Attention processors
# --------------------------------------------------------------------------------------------
class Flux2FusedAttnProcessor:
    """Flux2AttnProcessor (double blocks) with the per-head q/k RMSNorms of the text and image streams, their
    concatenation and the RoPE in one launch (mmdit_injection.flux_qk_norm_rope); projections (each input
    quantised once for q, k and v with FP8 layers), attention (dispatch_attention_fn, with this processor's
    backend and parallel config) and the output projections as diffusers runs them."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        stock = ic.stock_processor(attn, self)  # (under torch.compile in a marked model: ic.STOCK_UNDER_COMPILE)
        if stock is not None:
            return stock(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key, value, encoder_query, encoder_key, encoder_value = mi._flux_projections(
            attn, hidden_states, encoder_hidden_states
        )
        heads = (-1, attn.head_dim)
        parts = [(query.unflatten(-1, heads), key.unflatten(-1, heads), attn.norm_q, attn.norm_k)]
        values = [value.unflatten(-1, heads)]
        if attn.added_kv_proj_dim is not None:
            enc_q, enc_k = encoder_query.unflatten(-1, heads), encoder_key.unflatten(-1, heads)
            parts.insert(0, (enc_q, enc_k, attn.norm_added_q, attn.norm_added_k))
            values.insert(0, encoder_value.unflatten(-1, heads))
        query, key, value = mi.flux_qk_norm_rope(parts, values, attn.head_dim, image_rotary_emb)
        # the projections, read: not held through the attention (diffusers' processor replaces them as it goes)
        parts = values = enc_q = enc_k = encoder_query = encoder_key = encoder_value = None

        hidden_states = gi.dispatch_attention(self, query, key, value, attention_mask)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]], dim=1
            )
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class Flux2FusedParallelSelfAttnProcessor:
    """Flux2ParallelSelfAttnProcessor (single blocks) with the per-head q/k RMSNorms and the RoPE of the q/k
    views of the fused projection in one launch; the MLP half's SwiGLU is the module's (one kernel once
    injected: flux2_swiglu); projections and attention as diffusers runs them."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states, attention_mask=None, image_rotary_emb=None):
        stock = ic.stock_processor(attn, self)
        if stock is not None:
            return stock(attn, hidden_states, attention_mask, image_rotary_emb)
        hidden_states = ic.call(attn.to_qkv_mlp_proj, hidden_states)
        # split by the global QKV : MLP ratio, as diffusers does (the same code with column-sharded projections)
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in qkv.chunk(3, dim=-1))
        query, key, value = mi.flux_qk_norm_rope(
            [(query, key, attn.norm_q, attn.norm_k)], [value], attn.head_dim, image_rotary_emb
        )

        hidden_states = gi.dispatch_attention(self, query, key, value, attention_mask)
        dtype = query.dtype
        # Memory: q, k and the fused projection's q/k/v part are dropped after the attention, so the projection
        # (3 + 2 * mlp_ratio times the width) dies with the activation's input below; the attention output and
        # the activation once concatenated. diffusers' processor holds all of them through the output projection.
        query = key = value = qkv = None
        hidden_states = hidden_states.flatten(2, 3).to(dtype)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        hidden_states = torch.cat([hidden_states, mlp_hidden_states], dim=-1)
        mlp_hidden_states = None
        return attn.to_out(hidden_states)


# --------------------------------------------------------------------------------------------
# Discovery, injection, removal, counts
# --------------------------------------------------------------------------------------------
_BLOCKS = {
    Flux2TransformerBlock: ("flux2_double_blocks", _double_block_forward),
    Flux2SingleTransformerBlock: ("flux2_single_blocks", _single_block_forward),
    Flux2SwiGLU: ("flux2_swiglu", _swiglu_forward),
}
# attention class -> (the stock processor replaced, its fused twin, kind)
_PROCESSORS = {
    Flux2Attention: (Flux2AttnProcessor, Flux2FusedAttnProcessor, "flux2_attention"),
    Flux2ParallelSelfAttention: (
        Flux2ParallelSelfAttnProcessor,
        Flux2FusedParallelSelfAttnProcessor,
        "flux2_parallel_attention",
    ),
}
_FUSED_PROCESSORS = (Flux2FusedAttnProcessor, Flux2FusedParallelSelfAttnProcessor)


def find_flux2_models(pipe_or_model) -> list:
    """Every Flux2Transformer2DModel inside the input (a pipeline's components, or a module), each once."""
    return [m for m in ic.unique_modules(pipe_or_model) if isinstance(m, Flux2Transformer2DModel)]


def flux2_injected_counts(pipe_or_model) -> dict:
    """Counts per kind of what this family holds injected in the FLUX.2 transformers of pipe_or_model."""
    return ic.kind_counts(ic.modules_once(find_flux2_models(pipe_or_model)), STATE, KINDS)


def _own_forward(m) -> bool:
    """A forward put on the instance (not by accelerate's or diffusers' hooks, which patch_forward wraps)."""
    return "forward" in m.__dict__ and not hasattr(m, "_hf_hook") and "_diffusers_hook" not in m.__dict__


def _swap_processor(attn, proc, kind: str) -> bool:
    if ic.bundle_state(attn) is not None:
        return False
    prev = attn.processor
    ic.carry_processor_settings(prev, proc)  # the backend and parallel config follow the processor in place
    attn.set_processor(proc)
    attn.__dict__[STATE] = {"kind": kind, "prev": prev}
    return True


def _inject_module(m, skipped: list) -> None:
    if ic.bundle_state(m) is not None:  # injected already
        return
    for cls, (kind, fn) in _BLOCKS.items():
        if isinstance(m, cls):
            if not ic.class_forward(m, cls) or _own_forward(m):
                skipped.append(f"{type(m).__name__} (a forward of its own)")
            else:
                gi.patch(m, fn, kind, STATE)
            return
    for cls, (stock, fused, kind) in _PROCESSORS.items():
        if isinstance(m, cls):
            if type(m.processor) is stock:
                _swap_processor(m, fused(), kind)
            elif type(m.processor) is not fused:
                skipped.append(f"{type(m).__name__} with processor {type(m.processor).__name__}")
            return


def inject_flux2_kernels(pipe_or_model, *, verbose: bool = True) -> dict:
    """Inject the generic layer, then the FLUX.2 fusions (module docstring), into every Flux2Transformer2DModel
    of pipe_or_model. Returns the counts per kind after the call; a second call wraps nothing twice. The models
    are marked stock under torch.compile (ic.STOCK_UNDER_COMPILE): compiled, they are the stock model."""
    gi._torch_rms_rounding()  # torch.nn.RMSNorm's rounding, probed now (not inside a traced forward)
    models, skipped = find_flux2_models(pipe_or_model), []
    before = flux2_injected_counts(pipe_or_model)
    for model in models:
        gi.inject_generic_kernels(model, verbose=False, skipped=skipped)
        for m in model.modules():
            _inject_module(m, skipped)
        gi.mark_stock_under_compile([model])  # Inductor's own fusions are faster here (ic.STOCK_UNDER_COMPILE)
    counts = flux2_injected_counts(pipe_or_model)
    new = {k: counts[k] - before[k] for k in KINDS}
    none_found = "" if models else "no FLUX.2 transformer found"
    msg = ic.counts_message("injected FLUX.2 kernels", counts, new, none_found=none_found, skipped=skipped)
    ic.report(logger, msg, verbose)
    return counts


def remove_flux2_kernels(pipe_or_model, *, verbose: bool = True) -> dict:
    """Undo inject_flux2_kernels (the generic layer in those models too): original forwards and processors back.
    Returns the counts restored per kind of this family."""
    models = find_flux2_models(pipe_or_model)
    return gi.remove_family(models, STATE, KINDS, logger, "FLUX.2", verbose, _PROCESSOR_KINDS, _FUSED_PROCESSORS)


# The family plug-in interface of diffusers_injection.inject_optimized_kernels (diffusers_injection.FAMILIES)
find_models = find_flux2_models
inject = inject_flux2_kernels
remove = remove_flux2_kernels
injected_counts = flux2_injected_counts


def _main(argv=None) -> int:
    """FLUX.2 dev's architecture (Flux2Transformer2DModel's defaults) on the meta device: inject, count, remove."""
    import argparse
    import json

    argparse.ArgumentParser(
        description="Inject the FLUX.2 kernels into FLUX.2 dev's transformer architecture (built on the meta device: "
        "no memory, no weights), remove them again, and print the counts per kind as JSON. Library use: "
        "inject_flux2_kernels(pipe) / remove_flux2_kernels(pipe), or diffusers_injection.inject_optimized_kernels."
    ).parse_args(argv)
    with torch.device("meta"):
        model = Flux2Transformer2DModel()
    counts = inject_flux2_kernels(model, verbose=False)
    again = inject_flux2_kernels(model, verbose=False)
    restored = remove_flux2_kernels(model, verbose=False)
    ok = counts == again == restored and not any(ic.bundle_state(m) for m in model.modules())
    print(json.dumps({"flux.2-dev": counts, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

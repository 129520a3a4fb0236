# SPDX-License-Identifier: Apache-2.0
"""Kernels for any diffusers model, keyed on the modules diffusers shares between its models, and the
building blocks a model family's plug-in is written with (references/adding-a-model.md).

    import generic_injection as gi
    counts = gi.inject_generic_kernels(model)     # any diffusers model, pipeline or module
    ...                                           # the model now runs the kernels
    gi.remove_generic_kernels(model)              # original forwards back, outputs bit for bit

``diffusers_injection.inject_optimized_kernels`` runs this layer on every model no family claims.
What it replaces, wherever it appears (a module is taken when its class computes what the kernel
computes: diffusers' or torch's own class, or a class whose forward a probe finds to compute the same):

* ``generic_rmsnorm``: diffusers ``RMSNorm`` (without weight, with an fp16/bf16 weight, with an fp32
  weight, with a bias) and ``torch.nn.RMSNorm``: one kernel (stock diffusers runs about six).
* ``generic_layernorm``: ``torch.nn.LayerNorm`` and diffusers ``FP32LayerNorm`` (affine or not), fp32 math
  and one rounding (FP32LayerNorm's stock upcast, norm and downcast are three passes).
* ``generic_adaln``: ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``AdaLayerNormContinuous``,
  ``SD35AdaLayerNormZeroX``, ``CogVideoXLayerNormZero``, ``LuminaRMSNormZero``: the module's projection as
  before, then the norm and its modulation in one kernel (their norms are counted under this module).
* ``generic_gelu_tanh``: diffusers ``GELU(approximate="tanh")`` (the projection with the activation in
  its epilogue where the GPU's BLAS verifiably computes that form, else the projection then the kernel)
  and ``torch.nn.GELU(approximate="tanh")``.
* ``generic_glu``: diffusers ``GEGLU`` and ``SwiGLU``: the projection, then ``value * act(gate)`` in one
  kernel.
* ``generic_rope``: diffusers' ``apply_rotary_emb`` as model files call it (real pairs, real halves,
  complex tables): while a model of a file is injected, a dispatcher stands in for the function in that
  file and runs ``rope.rope_interleaved`` / ``rope_rotate_half`` for the call forms a probe checked; any
  other call, and every call once the last model of the file is removed, runs diffusers' function.

Numerics: each kernel computes in fp32 and rounds once where the class rounds once; where diffusers
rounds twice in low precision (a GLU's product, an RMSNorm's bias add) the kernel's single rounding is
the closer to exact. Every patched forward reads its parameters when it runs and falls back to the
original forward for inputs the kernels do not cover (autograd, devices, dtype mixes, layouts, hooks).
Removal restores the original forwards and functions, so outputs become bit-identical to before.

The public names below are the extension API: ``patch`` / ``original`` / ``unpatch`` (reversible
per-instance forwards under any state key), ``ln_args`` / ``rms_args`` (what a norm module computes, for a
fused kernel), ``norm_modulate``, ``residual_norm_modulate``, ``gated_add``, the AdaLN forwards, the RoPE
dispatch (``apply_rotary_emb``, ``rope_tables``) and ``sites`` / ``covered`` (what the coverage command
counts).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import weakref
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the leaf kernels live beside this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from diffusers.models import embeddings as _embeddings  # noqa: E402
from diffusers.models.activations import GEGLU, GELU, SwiGLU  # noqa: E402
from diffusers.models.attention import FeedForward  # noqa: E402
from diffusers.models.attention_dispatch import (  # noqa: E402
    AttentionBackendName,
    _AttentionBackendRegistry,
    dispatch_attention_fn,
)
from diffusers.models.normalization import (  # noqa: E402
    AdaLayerNormContinuous,
    AdaLayerNormZero,
    AdaLayerNormZeroSingle,
    CogVideoXLayerNormZero,
    FP32LayerNorm,
    LuminaRMSNormZero,
    RMSNorm,
    SD35AdaLayerNormZeroX,
)
from torch import nn  # noqa: E402

import activations  # noqa: E402
import fp8_linear  # noqa: E402
import injection_common as ic  # noqa: E402
import layernorm  # noqa: E402
import rmsnorm  # noqa: E402
import rope  # noqa: E402

__all__ = [
    "inject_generic_kernels",
    "mark_stock_under_compile",
    "remove_generic_kernels",
    "generic_injected_counts",
    "KINDS",
    "STATE",
    "patch",
    "original",
    "unpatch",
    "ln_args",
    "rms_args",
    "norm_modulate",
    "residual_norm_modulate",
    "gated_add",
    "rowwise",
    "dense_rows",
    "dispatch_attention",
    "adaln_zero_apply",
    "adaln_continuous_forward",
    "apply_rotary_emb",
    "rope_tables",
    "sites",
    "covered",
]

logger = logging.getLogger("generic_injection")

KINDS = (
    "generic_rmsnorm",
    "generic_layernorm",
    "generic_adaln",
    "generic_gelu_tanh",
    "generic_glu",
    "generic_rope",
)
STATE = ic.register_state_key("_rtk_generic")  # per-module record of what this layer patched
_usable = ic.usable
_HALF = ic.HALF

# torch.nn.RMSNorm's rounding (before or after the weight multiply) on the installed torch, probed once at
# the first injection (ic.probe_torch_rmsnorm), so the patched forward matches it.
_TORCH_RMSNORM_CASTS_BEFORE_WEIGHT = None


# --------------------------------------------------------------------------------------------
# Reversible per-instance forwards, under any state key (the API a family plug-in uses)
# --------------------------------------------------------------------------------------------
def patch(module: nn.Module, fn, kind: str, state_key: str = STATE, **extra) -> bool:
    """Make fn(module, ...) module's forward, recorded under state_key (register a key of your own with
    injection_common.register_state_key): False if the module carries a record of the bundle already. fn must
    be a module-level function (the model then pickles) that falls back to original(module)."""
    if ic.bundle_state(module) is not None:
        return False
    return ic.patch_forward(module, fn, kind, state_key, **extra)


def original(module: nn.Module):
    """The forward module had before the bundle patched it, under whichever state key it was patched."""
    return ic.original(module)


def unpatch(module: nn.Module, state_key: str = STATE) -> Optional[str]:
    """Undo what was patched on module under state_key; its kind, or None if nothing was."""
    state = ic.unpatch(module, state_key)
    return None if state is None else state["kind"]


# --------------------------------------------------------------------------------------------
# Norms: what a norm module computes, for a kernel that skips calling it
# --------------------------------------------------------------------------------------------
def _runs(m, cls) -> bool:
    """m is a cls running cls's forward (or the bundle's patch of it) and nothing else: no hook of any kind."""
    return isinstance(m, cls) and type(m).forward is cls.forward and ic.unwrapped(m)


def ln_args(norm, x: torch.Tensor):
    """(weight, bias, eps) if norm is a LayerNorm over x's last dim that the kernel reproduces (torch's
    nn.LayerNorm with parameters of x's dtype, or diffusers' FP32LayerNorm with any), running nothing but
    its forward; else None. Both compute in fp32 and round once: the kernel's math."""
    return _ln_params(norm, x) if ic.unwrapped(norm) else None


def _ln_params(norm, x: torch.Tensor):
    """ln_args without the check that nothing but the forward runs (inside the norm's own forward)."""
    if type(norm) not in (nn.LayerNorm, FP32LayerNorm) or len(norm.normalized_shape) != 1:
        return None
    if norm.normalized_shape[0] != x.shape[-1]:
        return None
    w, b = norm.weight, norm.bias
    if type(norm) is nn.LayerNorm and any(p is not None and p.dtype != x.dtype for p in (w, b)):
        return None
    return w, b, float(norm.eps)


def _torch_rms_rounding() -> bool:
    global _TORCH_RMSNORM_CASTS_BEFORE_WEIGHT
    if _TORCH_RMSNORM_CASTS_BEFORE_WEIGHT is None:
        _TORCH_RMSNORM_CASTS_BEFORE_WEIGHT = ic.probe_torch_rmsnorm()
    return _TORCH_RMSNORM_CASTS_BEFORE_WEIGHT


def rms_args(norm, x: torch.Tensor):
    """(weight, eps, cast_before_weight) if norm is an RMSNorm over x's last dim whose result (of x's dtype)
    the kernel reproduces: diffusers' RMSNorm without bias (no weight, or a weight of x's dtype) or
    torch.nn.RMSNorm (a weight of x's dtype), running nothing but its forward; else None."""
    if _runs(norm, RMSNorm):
        w = norm.weight
        if norm.bias is not None or norm.dim[-1] != x.shape[-1] or len(norm.dim) != 1:
            return None
        if w is None:
            return None, float(norm.eps), True
        return (w, float(norm.eps), True) if w.dtype == x.dtype else None
    if _runs(norm, nn.RMSNorm):
        w = norm.weight
        if len(norm.normalized_shape) != 1 or norm.normalized_shape[0] != x.shape[-1]:
            return None
        if w is not None and w.dtype != x.dtype:
            return None
        return w, ic.torch_rmsnorm_eps(norm), _torch_rms_rounding()
    return None


def dense_rows(x: torch.Tensor):
    """(view, back): x with its leading dims in memory order (a contiguous view, where x is a permutation of a
    contiguous tensor, as a [B, S, H, D] projection read as [B, H, S, D] is), and the permutation that puts a
    result of the view's shape back into x's order (None: x is contiguous already). None when x is not dense
    with a contiguous last dim: the row kernels would need more than two strides for its rows."""
    if x.is_contiguous():
        return x, None
    if x.dim() < 2 or x.stride(-1) != 1:
        return None
    return ic.memory_order(x)


def rowwise(fn, x: torch.Tensor, *args, **kwargs):
    """fn(x, *args, **kwargs) for a row-wise kernel (over the last dim) on a dense x of any dim order, the result
    in x's order and layout (what torch's elementwise ops return); None where x is not dense."""
    rows = dense_rows(x)
    if rows is None:
        return None
    view, back = rows
    out = fn(view, *args, **kwargs)
    return out if back is None else out.permute(back)


def _rows_ok(x: torch.Tensor) -> bool:
    """Whether the kernels read x's rows in place: its last dim contiguous (or of size 1) and its leading dims
    addressed with two strides, as rmsnorm / layernorm / activations require ([B, S, D] or a slice of it; not
    q.view(B, S, H, Dh).transpose(1, 2), the heads view attention processors normalise, whose rows need three)."""
    if x.dim() == 0:
        return True
    if x.stride(-1) != 1 and x.shape[-1] != 1:
        return False
    lead = [(n, st) for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n != 1]
    return sum(lead[i][1] != lead[i + 1][0] * lead[i + 1][1] for i in range(len(lead) - 1)) <= 1


def _norm_any_layout(x, weight, eps, cast_before_weight, out_dtype=None, keep_layout=True):
    """rms_norm over the last dim. keep_layout (what diffusers' RMSNorm, a chain of elementwise ops, returns: the
    input's layout): a dense x of any dim order is read in place (rowwise). Without it (torch's RMSNorm returns a
    contiguous tensor): rows the kernel reads in place are read so. Any other input (a VAE normalises
    x.movedim(1, -1), whose last dim is strided) is copied to a contiguous buffer first, and the result put back
    into the input's layout where keep_layout asks for it."""
    if keep_layout:
        out = rowwise(rmsnorm.rms_norm, x, weight, eps, cast_before_weight=cast_before_weight, out_dtype=out_dtype)
        if out is not None:
            return out
    elif _rows_ok(x):
        return rmsnorm.rms_norm(x, weight, eps, cast_before_weight=cast_before_weight, out_dtype=out_dtype)
    y = rmsnorm.rms_norm(x.contiguous(), weight, eps, cast_before_weight=cast_before_weight, out_dtype=out_dtype)
    if not keep_layout:
        return y
    out = torch.empty_like(x, dtype=y.dtype)
    out.copy_(y)
    return out


def _diffusers_rmsnorm_forward(self, hidden_states):
    """diffusers RMSNorm: without a weight the result has the input dtype; with an fp16/bf16 weight the
    normalised value is rounded to that dtype before the multiply; with an fp32 weight the multiply is in
    fp32 and the result is fp32 (torch's type promotion in the original); a bias is added after, as
    diffusers adds it (in the result's dtype). A weight of another shape than [D] (RMSNorm((3, D)) broadcasts
    a [3, D] one) goes to the original."""
    if ic.stock_under_compile(self):
        return original(self)(hidden_states)
    w, b = self.weight, self.bias
    if not _usable(hidden_states, w, b) or (b is not None and (w is None or b.dtype != w.dtype)):
        return original(self)(hidden_states)
    if w is not None and w.shape != hidden_states.shape[-1:]:
        return original(self)(hidden_states)
    if w is None:
        return _norm_any_layout(hidden_states, None, self.eps, True)
    if w.dtype in _HALF:
        if hidden_states.dtype != w.dtype:
            return original(self)(hidden_states)
        y = _norm_any_layout(hidden_states, w, self.eps, True)
    else:
        y = _norm_any_layout(hidden_states, w, self.eps, False, out_dtype=torch.float32)
    return y if b is None else y + b


def _torch_rmsnorm_forward(self, x):
    """torch.nn.RMSNorm over one trailing dim, weight in the input's dtype (else the original: also for rows of
    another size, which torch refuses)."""
    if ic.stock_under_compile(self):
        return original(self)(x)
    w = self.weight
    if tuple(self.normalized_shape) != x.shape[-1:] or not _usable(x, w) or (w is not None and w.dtype != x.dtype):
        return original(self)(x)
    return _norm_any_layout(x, w, ic.torch_rmsnorm_eps(self), _torch_rms_rounding(), keep_layout=False)


def _layernorm_forward(self, x):
    """torch.nn.LayerNorm / diffusers FP32LayerNorm over one trailing dim: fp32 math, one rounding. Rows the
    kernel does not read in place go to the original (torch's layer norm copies them itself)."""
    if ic.stock_under_compile(self):
        return original(self)(x)
    args = _ln_params(self, x)
    if args is None or x.dim() == 0 or not _rows_ok(x) or not _usable(x, args[0], args[1]):
        return original(self)(x)
    return layernorm.layer_norm(x, args[0], args[1], args[2])  # (contiguous, as torch's layer norm returns)


def _per_sample_ok(x: torch.Tensor, *vectors) -> bool:
    """x [B, S, D] with contiguous rows and every vector [B or 1, D] of x's dtype: the per-sample AdaLN chunks
    the kernels read in place."""
    if x.dim() != 3 or x.stride(-1) != 1:
        return False
    b, s, d = x.shape
    if s == b > 1:  # the kernels cannot tell [B, D] per sample from [S, D] per token then (they refuse)
        return False
    return all(v.dim() == 2 and v.shape[0] in (1, b) and v.shape[1] == d and v.dtype == x.dtype for v in vectors)


def norm_modulate(norm, x, scale, shift):
    """norm(x) * (1 + scale[:, None]) + shift[:, None] for per-sample scale/shift [B, D] (shift may be None):
    one kernel where norm is a LayerNorm or RMSNorm the kernels reproduce, else the stock expression."""
    vectors = (scale,) if shift is None else (scale, shift)
    if _per_sample_ok(x, *vectors):
        args = ln_args(norm, x)
        if args is not None and shift is not None and _usable(x, scale, shift, args[0], args[1]):
            return layernorm.layer_norm_modulate(x, scale, shift, args[2], weight=args[0], bias=args[1])
        args = rms_args(norm, x)
        if args is not None and _usable(x, scale, shift, args[0]):
            shift = torch.zeros_like(scale) if shift is None else shift  # (LuminaRMSNormZero has none)
            return rmsnorm.rms_norm_modulate(
                x, scale[:, None], shift[:, None], args[0], args[1], cast_before_weight=args[2]
            )
    out = norm(x) * (1 + scale[:, None])
    return out if shift is None else out + shift[:, None]


def _same_rows(h, y) -> bool:
    return y.shape == h.shape and y.dtype == h.dtype and y.stride(-1) == 1


def residual_norm_modulate(h, y, gate, norm, scale, shift):
    """h = h + gate[:, None] * y (gate None: h + y), then norm(h) * (1 + scale[:, None]) + shift[:, None]
    (scale and shift both None: norm(h)); returns (h, out): one kernel where norm is a LayerNorm or an RMSNorm
    the kernels reproduce and the per-sample vectors are [B, D]."""
    vectors = [v for v in (gate, scale, shift) if v is not None]
    if _same_rows(h, y) and _per_sample_ok(h, *vectors) and (scale is None) == (shift is None):
        args = ln_args(norm, h)
        if args is not None and _usable(h, y, *vectors, args[0], args[1]):
            return layernorm.gated_residual_layer_norm_modulate(
                h, y, gate, scale, shift, args[2], weight=args[0], bias=args[1]
            )
        args = rms_args(norm, h)
        if args is not None and _usable(h, y, *vectors, args[0]):
            col = [None if v is None else v[:, None] for v in (gate, scale, shift)]
            return rmsnorm.gated_residual_rms_norm_modulate(h, y, *col, args[0], args[1], cast_before_weight=args[2])
    h = h + y if gate is None else h + gate.unsqueeze(1) * y
    n = norm(h)
    return h, n if scale is None else n * (1 + scale[:, None]) + shift[:, None]


def gated_add(h, gate, y):
    """h + gate[:, None] * y: one kernel (fp32 math, one rounding) where dtypes agree, else torch.addcmul or
    the plain expression."""
    if h.dtype == gate.dtype == y.dtype and gate.dim() == 2 and h.shape == y.shape:
        if _usable(h, gate, y) and h.stride(-1) == 1 and y.stride(-1) == 1:
            return rmsnorm.gated_residual_add(h, y, gate.unsqueeze(1))
        return torch.addcmul(h, gate.unsqueeze(1), y)
    return h + gate.unsqueeze(1) * y


# --------------------------------------------------------------------------------------------
# AdaLN modules
# --------------------------------------------------------------------------------------------
def adaln_zero_apply(norm, x, emb, y=None, gate=None):
    """AdaLayerNormZero's projection of emb, then LayerNorm + MSA modulation of x in one kernel, or, with y,
    of h = x + gate[:, None] * y. Returns (h, outputs as the module returns them); h is x without y."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = norm.linear(norm.silu(emb)).chunk(6, dim=1)
    if y is None:
        h, out = x, norm_modulate(norm.norm, x, scale_msa, shift_msa)
    else:
        h, out = residual_norm_modulate(x, y, gate, norm.norm, scale_msa, shift_msa)
    return h, (out, gate_msa, shift_mlp, scale_mlp, gate_mlp)


def _adaln_zero_forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):
    if ic.stock_under_compile(self):
        return original(self)(x, timestep=timestep, class_labels=class_labels, hidden_dtype=hidden_dtype, emb=emb)
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    return adaln_zero_apply(self, x, emb)[1]


def _adaln_zero_single_forward(self, x, emb=None):
    if ic.stock_under_compile(self):
        return original(self)(x, emb=emb)
    shift_msa, scale_msa, gate_msa = self.linear(self.silu(emb)).chunk(3, dim=1)
    return norm_modulate(self.norm, x, scale_msa, shift_msa), gate_msa


def adaln_zero_x_apply(norm, x, emb, y=None, gate=None):
    """SD35AdaLayerNormZeroX: one LayerNorm, two modulations, x read once; with y, of h = x + gate[:, None] * y
    in the same kernel. Returns (h, outputs as the module returns them)."""
    chunks = norm.linear(norm.silu(emb)).chunk(9, dim=1)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, shift_msa2, scale_msa2, gate_msa2 = chunks
    mods = (scale_msa, shift_msa, scale_msa2, shift_msa2)
    args = ln_args(norm.norm, x)
    fused = args is not None and args[0] is None and args[1] is None and _per_sample_ok(x, *mods) and _usable(x, *mods)
    if y is None and fused:
        h, (out, out2) = x, layernorm.layer_norm_modulate_dual(x, *mods, args[2])
    elif y is not None and fused and _usable(y, gate) and _per_sample_ok(x, gate) and _same_rows(x, y):
        h, out, out2 = layernorm.gated_residual_layer_norm_modulate_dual(x, y, gate, *mods, args[2])
    else:
        h = x if y is None else x + gate.unsqueeze(1) * y
        n = norm.norm(h)
        out = n * (1 + scale_msa[:, None]) + shift_msa[:, None]
        out2 = n * (1 + scale_msa2[:, None]) + shift_msa2[:, None]
    return h, (out, gate_msa, shift_mlp, scale_mlp, gate_mlp, out2, gate_msa2)


def _adaln_zero_x_forward(self, hidden_states, emb=None):
    if ic.stock_under_compile(self):
        return original(self)(hidden_states, emb=emb)
    return adaln_zero_x_apply(self, hidden_states, emb)[1]


def adaln_continuous_forward(self, x, conditioning_embedding):
    """AdaLayerNormContinuous.forward (chunk order: scale, then shift; a LayerNorm or an RMSNorm inside)."""
    if ic.stock_under_compile(self):
        return original(self)(x, conditioning_embedding)
    emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
    scale, shift = torch.chunk(emb, 2, dim=1)
    return norm_modulate(self.norm, x, scale, shift)


def _cogvideox_norm_zero_forward(self, hidden_states, encoder_hidden_states, temb):
    """CogVideoXLayerNormZero: one projection, the LayerNorm + modulation of both streams (one kernel each)."""
    if ic.stock_under_compile(self):
        return original(self)(hidden_states, encoder_hidden_states, temb)
    shift, scale, gate, enc_shift, enc_scale, enc_gate = self.linear(self.silu(temb)).chunk(6, dim=1)
    hidden_states = norm_modulate(self.norm, hidden_states, scale, shift)
    encoder_hidden_states = norm_modulate(self.norm, encoder_hidden_states, enc_scale, enc_shift)
    return hidden_states, encoder_hidden_states, gate[:, None, :], enc_gate[:, None, :]


def _lumina_rmsnorm_zero_forward(self, x, emb=None):
    """LuminaRMSNormZero: RMSNorm * (1 + scale_msa), no shift, in one kernel."""
    if ic.stock_under_compile(self):
        return original(self)(x, emb=emb)
    scale_msa, gate_msa, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(4, dim=1)
    return norm_modulate(self.norm, x, scale_msa, None), gate_msa, scale_mlp, gate_mlp


# class -> (replacement forward); a module is taken only while its class's forward is the class's own
_ADALN = {
    AdaLayerNormZero: _adaln_zero_forward,
    AdaLayerNormZeroSingle: _adaln_zero_single_forward,
    SD35AdaLayerNormZeroX: _adaln_zero_x_forward,
    AdaLayerNormContinuous: adaln_continuous_forward,
    CogVideoXLayerNormZero: _cogvideox_norm_zero_forward,
    LuminaRMSNormZero: _lumina_rmsnorm_zero_forward,
}


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------
def is_gelu_tanh(m) -> bool:
    """m is diffusers' GELU(approximate="tanh") computing what that class computes (forward and gelu method
    the class's own)."""
    return ic.class_forward(m, GELU) and type(m).gelu is GELU.gelu and getattr(m, "approximate", None) == "tanh"


def _gelu_tanh_forward(self, hidden_states):
    """diffusers GELU(approximate="tanh"): the projection with the activation in its epilogue where the
    device's BLAS verifiably computes the tanh form (injection_common.linear_gelu_tanh), else the projection,
    then the kernel. A gelu method put on the instance runs as the class's forward would run it."""
    if ic.stock_under_compile(self):
        return original(self)(hidden_states)
    own_gelu = "gelu" in self.__dict__
    if not own_gelu:
        fused = ic.linear_gelu_tanh(hidden_states, self.proj)
        if fused is not None:
            return fused
    hidden_states = ic.call(self.proj, hidden_states)
    if own_gelu or not _usable(hidden_states):
        return self.gelu(hidden_states)
    return activations.gelu_tanh(hidden_states)


def fp8_feed_forward(ff, state_key: Optional[str] = None):
    """(up, down): the two Fp8Linear projections of diffusers' FeedForward ff when it computes exactly
    down(gelu_tanh(up(x))): the class's forward, no hooks, its modules the GELU-tanh (its own forward or a
    bundle patch of it) holding up, an identity Dropout and down, both FP8 in one format. Then the GELU writes
    the down projection's FP8 input (and in LTX-Video's blocks the norm before it the up projection's). Else
    None (the modules run as they are)."""
    if type(ff) is not FeedForward or not ic.unwrapped(ff):
        return None
    net = ff.net
    if type(net) is not nn.ModuleList or len(net) != 3:
        return None
    gelu, drop, down = net
    # every module the fused path does not call must be one that would run only its own forward (or a bundle
    # patch of it): no torch, accelerate or diffusers hook, no forward put in its place
    if not (is_gelu_tanh(gelu) and "gelu" not in gelu.__dict__ and ic.unwrapped(gelu, state_key)):
        return None  # ("gelu" in __dict__: a gelu method put on the instance)
    if type(drop) is not nn.Dropout or (drop.training and drop.p > 0) or not ic.unwrapped(drop):
        return None
    return (gelu.proj, down) if fp8_linear.direct_fp8_format((gelu.proj, down)) is not None else None


def fp8_gelu_down(up_out, down):
    """down(gelu_tanh(up_out)), the GELU kernel writing down's FP8 input and per-token scales: the GELU is
    quantised from fp32, without the bf16 rounding a separate quantisation pass would read."""
    g8, g_scale = activations.gelu(up_out, "tanh", fp8="per_token", fp8_dtype=down.weight_fp8.dtype)
    return down.forward_fp8(g8, g_scale)


def feed_forward(ff, x, state_key: Optional[str] = None):
    """ff(x) for diffusers' FeedForward: with FP8 projections that fp8_feed_forward accepts, the up projection,
    then fp8_gelu_down (one quantisation pass fewer than calling the modules); else the modules in turn
    (injection_common.feed_forward)."""
    layers = fp8_feed_forward(ff, state_key)
    if layers is None:
        return ic.feed_forward(ff, x, FeedForward)
    up, down = layers
    return fp8_gelu_down(up.forward(x), down)


def dispatch_attention(proc, query, key, value, attn_mask=None, *, fn=dispatch_attention_fn):
    """fn (diffusers' dispatch_attention_fn) on [B, S, H, D] q, k, v with the backend and parallel config of the
    attention processor proc as they are when it runs (set_attention_backend, enable_parallelism), as diffusers'
    processors call it: no dropout, not causal."""
    return fn(
        query, key, value, attn_mask=attn_mask, backend=proc._attention_backend, parallel_config=proc._parallel_config
    )


def native_attention_active() -> bool:
    """Whether dispatch_attention_fn without a backend would run diffusers' native (SDPA) backend with no
    argument checks: a processor may then call SDPA itself, the same call with less host time."""
    reg = _AttentionBackendRegistry
    return reg._active_backend == AttentionBackendName.NATIVE and not reg._checks_enabled


def _torch_gelu_tanh_forward(self, x):
    """torch.nn.GELU(approximate="tanh"): a dense input of any dim order read in place, the result in its layout
    (what torch's elementwise op returns); any other (a strided view) goes to the original."""
    if ic.stock_under_compile(self):
        return original(self)(x)
    out = rowwise(activations.gelu_tanh, x) if _usable(x) and x.dim() > 0 else None
    return original(self)(x) if out is None else out


def _glu_forward(self, hidden_states, *args, **kwargs):
    """diffusers GEGLU / SwiGLU: the projection, then value * act(gate) in one kernel (chunk order: value first,
    gate second). The deprecated scale argument of GEGLU and any other input go to the original forward."""
    if args or kwargs or ic.stock_under_compile(self):
        return original(self)(hidden_states, *args, **kwargs)
    h = ic.call(self.proj, hidden_states)
    geglu = isinstance(self, GEGLU)  # (a subclass of GEGLU that _is_glu took included)
    # the activation the class's forward would call, as the kernels compute it: GEGLU's own gelu method (not one
    # put on the instance), SwiGLU's SiLU module with nothing else to run (no hook; not replaced since injection)
    own = "gelu" not in self.__dict__ if geglu else type(self.activation) is nn.SiLU and ic.unwrapped(self.activation)
    if not own or not _usable(h) or h.dim() == 0 or h.stride(-1) != 1 or h.shape[-1] % 2:
        value, gate = h.chunk(2, dim=-1)
        return value * (self.gelu(gate) if geglu else self.activation(gate))
    if geglu:
        return activations.geglu(h, "none")
    return activations.swiglu(h, gate_first=False)


def _is_glu(m) -> bool:
    if ic.class_forward(m, GEGLU):
        return type(m).gelu is GEGLU.gelu
    return ic.class_forward(m, SwiGLU) and type(m.activation) is nn.SiLU and "forward" not in m.activation.__dict__


# --------------------------------------------------------------------------------------------
# RoPE: diffusers' apply_rotary_emb, in the model files that call it
# --------------------------------------------------------------------------------------------
_ROPE_NAME = "apply_rotary_emb"
_DIFFUSERS_ROPE = _embeddings.apply_rotary_emb
_ROPE_LOCK = threading.RLock()
_ROPE_SITES: dict = {}  # model file's module name -> {"globals", "original", "dispatcher", "users": WeakSet}
# Whether every model holding a dispatcher is marked stock under torch.compile (mark_stock_under_compile: an
# attribute of the model, which copies and pickles with it): then the dispatcher, which cannot tell which model
# calls it, runs diffusers' function while torch.compile traces. With an unmarked model holding one too it runs
# the kernels there (the same result). Recomputed when a model takes or drops a hold or is marked; a model that
# goes away unremoved, or a copy whose hold was taken before its mark was copied, leaves it stale (False where it
# could be True: the kernels traced) until the next eager call of the dispatcher recomputes it (_ROPE_DIRTY).
_MODEL_MARK = "_rtk_stock_under_compile"
_ROPE_STOCK_UNDER_COMPILE = [False]
_ROPE_DIRTY = [False]


def _rope_stock_update() -> None:
    users = [u for site in _ROPE_SITES.values() for u in site["users"]]
    _ROPE_STOCK_UNDER_COMPILE[0] = bool(users) and all(u.__dict__.get(_MODEL_MARK, False) for u in users)
    _ROPE_DIRTY[0] = False


def _rope_gone() -> None:
    """A holder went away unremoved (weakref.finalize): recompute, unless another thread holds the lock (no
    waiting inside garbage collection): then the next eager call of the dispatcher does."""
    _ROPE_DIRTY[0] = True
    if _ROPE_LOCK.acquire(blocking=False):
        try:
            _rope_stock_update()
        finally:
            _ROPE_LOCK.release()


def mark_stock_under_compile(models) -> int:
    """For a family whose models compile faster without the kernels (injection_common.STOCK_UNDER_COMPILE): call it
    after injecting models. While torch.compile traces, every forward and processor the bundle patched in them
    runs the code it replaced, and so does the RoPE dispatcher while only marked models hold it; eager calls and
    graph mode keep the kernels. Removal drops the mark. Returns how many modules are marked."""
    models = list(models)
    n = ic.mark_stock_under_compile(models)
    with _ROPE_LOCK:
        for model in models:
            model.__dict__[_MODEL_MARK] = True
        _rope_stock_update()
    return n


def rope_tables(freqs_cis, x: torch.Tensor, sequence_dim: int, use_real: bool):
    """(cos, sin) as rope.rope_interleaved / rope_rotate_half read them for apply_rotary_emb's freqs_cis, or
    None where the kernels do not take this call: real tables [S, D] (the tuple apply_rotary_emb takes), or a
    complex [B or 1, S, D // 2] table, whose real and imaginary parts are read in place (strided views)."""
    seq, dim = x.shape[sequence_dim], x.shape[-1]
    if use_real:
        if not isinstance(freqs_cis, (tuple, list)) or len(freqs_cis) != 2:
            return None
        cos, sin = freqs_cis
        if not all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape == (seq, dim) for t in (cos, sin)):
            return None
        return cos, sin
    if not isinstance(freqs_cis, torch.Tensor) or freqs_cis.dtype != torch.complex64 or freqs_cis.dim() != 3:
        return None
    if freqs_cis.is_conj():  # (a lazily conjugated view: view_as_real refuses it)
        return None
    if freqs_cis.shape[0] not in (1, x.shape[0]) or freqs_cis.shape[1:] != (seq, dim // 2):
        return None
    parts = torch.view_as_real(freqs_cis)
    return parts[..., 0], parts[..., 1]


def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' apply_rotary_emb through the kernels where they take the call (x [B, H, S, D] or, with
    sequence_dim=1 or complex tables, [B, S, H, D], dense, fp16/bf16/fp32; the tables as rope_tables takes
    them); else diffusers' function. The dispatcher a model file gets while a model of it is injected."""
    if _ROPE_STOCK_UNDER_COMPILE[0] and torch.compiler.is_compiling():
        return _DIFFUSERS_ROPE(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)
    if not torch.compiler.is_compiling() and _ROPE_DIRTY[0]:  # (not read while tracing: no guard on it)
        with _ROPE_LOCK:
            _rope_stock_update()
    if isinstance(x, torch.Tensor) and x.dim() == 4 and x.dtype in ic.KERNEL_DTYPES and x.shape[-1] % 2 == 0:
        seq_dim = 1 if not use_real else sequence_dim
        if seq_dim in (1, 2) and use_real_unbind_dim in (-1, -2) and (use_real or use_real_unbind_dim == -1):
            x4 = x.transpose(1, 2) if seq_dim == 1 else x
            dense = x4.is_contiguous() or x4.transpose(1, 2).is_contiguous()
            tables = rope_tables(freqs_cis, x, seq_dim, use_real) if dense else None
            if tables is not None and _usable(x, *tables) and (x.stride(-1) == 1 or x.shape[-1] == 1):
                kernel = rope.rope_interleaved if use_real_unbind_dim == -1 else rope.rope_rotate_half
                out = kernel(x4, *tables)
                return out.transpose(1, 2) if seq_dim == 1 else out
    return _DIFFUSERS_ROPE(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)


apply_rotary_emb._rtk_original = _DIFFUSERS_ROPE


def _rope_files(model, skip_ids=frozenset()) -> list:
    """Names of the model files (Python modules) through whose globals the model's modules and attention
    processors call diffusers' apply_rotary_emb (or this file's dispatcher standing in for it); modules whose
    id is in skip_ids (with their processors) left out. Not embeddings.py, which defines the function and
    calls it nowhere: a dispatcher there would serve every file that imports it at call time, whichever model
    runs, and be bound for good by any file imported meanwhile."""
    names = {}
    for m in model.modules():
        if id(m) in skip_ids:
            continue
        names[type(m).__module__] = None
        proc = getattr(m, "processor", None)
        if proc is not None:
            names[type(proc).__module__] = None
    found = []
    names.pop(_DIFFUSERS_ROPE.__module__, None)
    for name in names:
        g = getattr(sys.modules.get(name), "__dict__", None)
        fn = g.get(_ROPE_NAME) if g is not None else None
        if fn is _DIFFUSERS_ROPE or fn is apply_rotary_emb:
            found.append(name)
    return found


class _RopeHold:
    """A model's hold on the dispatcher in one model file (kept in the model's record). Pickles as the file's
    module name; unpickling or deep-copying the model takes a hold for the new model, as injecting it would."""

    __slots__ = ("model", "name", "__weakref__")

    def __init__(self, model, name: str):
        self.model, self.name = model, name

    def __reduce__(self):
        return _rope_hold_for, (self.model, self.name, bool(self.model.__dict__.get(_MODEL_MARK)))


def _rope_hold_for(model, name: str, marked: bool = False) -> _RopeHold:
    if marked:  # (the copy's own mark may be copied after this hold)
        model.__dict__[_MODEL_MARK] = True
    _rope_acquire(model, name)
    return _RopeHold(model, name)


def _rope_acquire(model, name: str) -> None:
    with _ROPE_LOCK:
        g = sys.modules[name].__dict__
        site = _ROPE_SITES.get(name)
        if site is None or g.get(_ROPE_NAME) is not apply_rotary_emb:
            site = _ROPE_SITES[name] = {"globals": g, "original": g[_ROPE_NAME], "users": weakref.WeakSet()}
            g[_ROPE_NAME] = apply_rotary_emb
        if model not in site["users"]:
            weakref.finalize(model, _rope_gone)
        site["users"].add(model)
        _rope_stock_update()


def _rope_release(model, name: str) -> None:
    with _ROPE_LOCK:
        site = _ROPE_SITES.get(name)
        if site is None:
            return
        site["users"].discard(model)
        if not len(site["users"]):
            if site["globals"].get(_ROPE_NAME) is apply_rotary_emb:  # not if someone replaced it since
                site["globals"][_ROPE_NAME] = site["original"]
            del _ROPE_SITES[name]
        _rope_stock_update()


# --------------------------------------------------------------------------------------------
# What the layer replaces, and what the coverage command counts
# --------------------------------------------------------------------------------------------
def _plan(m):
    """(kind, replacement forward) for a module this layer replaces, else None."""
    if ic.class_forward(m, RMSNorm):
        return "generic_rmsnorm", _diffusers_rmsnorm_forward
    if ic.class_forward(m, nn.RMSNorm):
        return "generic_rmsnorm", _torch_rmsnorm_forward
    if type(m) in (nn.LayerNorm, FP32LayerNorm) and ic.class_forward(m, type(m)):
        return "generic_layernorm", _layernorm_forward
    for cls, fn in _ADALN.items():
        if ic.class_forward(m, cls):
            return "generic_adaln", fn
    if is_gelu_tanh(m):
        return "generic_gelu_tanh", _gelu_tanh_forward
    if type(m) is nn.GELU and m.approximate == "tanh":
        return "generic_gelu_tanh", _torch_gelu_tanh_forward
    if _is_glu(m):
        return "generic_glu", _glu_forward
    return None


_SHARED = (RMSNorm, nn.RMSNorm, nn.LayerNorm, GELU, nn.GELU, GEGLU, SwiGLU, *_ADALN)


def _why_not(m) -> str:
    """Why a module of a class this layer knows is left alone ("" for a module of no such class)."""
    if not isinstance(m, _SHARED):
        return ""
    name = type(m).__name__
    if type(m).forward not in {c.forward for c in _SHARED}:
        return f"{name} (a subclass with a forward of its own)"
    if isinstance(m, (GELU, nn.GELU)) and getattr(m, "approximate", None) != "tanh":
        return ""  # exact GELU: torch's own kernel, nothing to fuse
    if isinstance(m, (GELU, GEGLU)) and "gelu" in type(m).__dict__:
        return f"{name} (a gelu method of its own)"
    if isinstance(m, SwiGLU):
        return f"{name} (activation {type(m.activation).__name__})"
    if isinstance(m, nn.LayerNorm):
        return f"{name} (a subclass: {type(m).__mro__[1].__name__}'s forward, another class)"
    return ""


def sites(model) -> dict:
    """{module: kind} for every norm / GELU-tanh site of model, by class alone (what the coverage command counts):
    RMSNorm (diffusers', torch's), LayerNorm (torch's, FP32LayerNorm), AdaLayerNorm* modules and tanh GELUs."""
    out = {}
    for m in model.modules():
        if isinstance(m, (RMSNorm, nn.RMSNorm)):
            out[m] = "rmsnorm"
        elif isinstance(m, nn.LayerNorm):
            out[m] = "layernorm"
        elif type(m).__name__.startswith("AdaLayerNorm"):
            out[m] = "adaln"
        elif isinstance(m, (GELU, nn.GELU)) and getattr(m, "approximate", None) == "tanh":
            out[m] = "gelu_tanh"
    return out


def covered(model) -> set:
    """The modules of model that run the bundle's code: those carrying a record of any integration, and
    everything inside them (a patched AdaLN runs its norm in its kernel; a patched block, its parts)."""
    done = set()

    def walk(m, inside):
        state = ic.bundle_state(m)
        inside = inside or (state is not None and state.get("kind") != "graphs")  # (graph mode runs the model)
        if inside:
            done.add(m)
        for child in m.children():
            walk(child, inside)

    walk(model, False)
    return done


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def _empty_counts() -> dict:
    return {k: 0 for k in KINDS}


def generic_injected_counts(pipe_or_model) -> dict:
    """Counts per kind of what this layer holds injected in pipe_or_model (generic_rope: the model files whose
    apply_rotary_emb runs the kernels for it)."""
    counts = ic.kind_counts(ic.unique_modules(pipe_or_model), STATE, KINDS)
    counts["generic_rope"] = sum(len(r) for r in _rope_records(pipe_or_model))
    return counts


def _rope_records(pipe_or_model):
    for root in ic.roots(pipe_or_model):
        for m in root.modules():
            holds = m.__dict__.get("_rtk_generic_rope")
            if holds:
                yield holds


def inject_generic_kernels(pipe_or_model, *, verbose: bool = True, skip=None, skipped=None) -> dict:
    """Inject the generic kernels into every module of pipe_or_model that this layer replaces (see the module
    docstring), except modules carrying a record of the bundle already and the norms inside an AdaLN module this
    layer takes. skip: modules (with everything inside them) to leave alone, e.g. the models a family took.
    skipped: a list to which what was left alone is added, with the reason (also in the log line).
    Returns the counts per kind after the call; a second call wraps nothing twice."""
    skip_ids = {id(m) for s in (skip or ()) for m in s.modules()}
    new = _empty_counts()
    skipped = [] if skipped is None else skipped
    _torch_rms_rounding()  # probed now, not inside a forward that torch.compile may be tracing
    for root in ic.roots(pipe_or_model):
        if id(root) in skip_ids:
            continue
        inside_adaln = set()
        for m in root.modules():  # pre-order: an AdaLN module comes before its norm
            if id(m) in skip_ids or id(m) in inside_adaln:
                continue
            if any(ic.class_forward(m, cls) for cls in _ADALN):  # its norms run in its kernel (patched already or now)
                inside_adaln.update(id(x) for x in m.modules() if x is not m)
            if ic.bundle_state(m) is not None:
                continue
            plan = _plan(m)
            if plan is None:
                why = _why_not(m)
                if why:
                    skipped.append(why)
                continue
            kind, fn = plan
            if "forward" in m.__dict__ and not hasattr(m, "_hf_hook") and "_diffusers_hook" not in m.__dict__:
                skipped.append(f"{type(m).__name__} with a forward of its own")
                continue
            new[kind] += patch(m, fn, kind)
        if root.__dict__.get(_MODEL_MARK):  # a family marked it: what is patched now compiles as stock too
            ic.mark_stock_under_compile([root])
        names = _rope_files(root, skip_ids)
        held = {h.name for h in root.__dict__.get("_rtk_generic_rope", ())}
        for name in names:
            if name not in held:
                _rope_acquire(root, name)
                root.__dict__.setdefault("_rtk_generic_rope", []).append(_RopeHold(root, name))
                new["generic_rope"] += 1
    counts = generic_injected_counts(pipe_or_model)
    notes = [ic.cpu_fallback_note(pipe_or_model, new)]
    msg = ic.counts_message("injected generic kernels", counts, new, skipped=skipped, notes=notes)
    ic.report(logger, msg, verbose)
    return counts


def remove_family(
    models,
    state_key: str,
    kinds,
    logger,
    title: str,
    verbose: bool,
    processor_kinds=(),
    processor_classes=(),
    *,
    carry=None,
) -> dict:
    """The remove of a family plug-in: its patches in models undone (ic.unpatch_all over their modules, each once),
    then the generic layer's in those models; logs "removed <title> kernels". Returns the family's counts restored
    per kind (the generic layer logs its own)."""
    restored = ic.unpatch_all(
        ic.modules_once(models), state_key, kinds, processor_kinds, processor_classes, carry=carry
    )
    for model in models:
        remove_generic_kernels(model, verbose=False)
        with _ROPE_LOCK:
            model.__dict__.pop(_MODEL_MARK, None)
            _rope_stock_update()
    ic.report(logger, ic.counts_message(f"removed {title} kernels", restored), verbose)
    return restored


def remove_generic_kernels(pipe_or_model, *, verbose: bool = True) -> dict:
    """Undo inject_generic_kernels: original forwards and model files' functions back. Counts restored per kind."""
    restored = _empty_counts()
    for m in ic.unique_modules(pipe_or_model):
        kind = unpatch(m)
        if kind is not None:
            restored[kind] += 1
        for hold in m.__dict__.pop("_rtk_generic_rope", ()):
            _rope_release(m, hold.name)
            restored["generic_rope"] += 1
    ic.report(logger, ic.counts_message("removed generic kernels", restored), verbose)
    return restored


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="The generic kernel layer for diffusers models (nothing to run on its own): import it, or run "
        "scripts/diffusers_coverage.py to see what it covers in every transformer class of the installed diffusers."
    ).parse_args()

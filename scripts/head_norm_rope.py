# SPDX-License-Identifier: Apache-2.0
"""Per-head RMSNorm of q and k, optionally followed by interleaved-pair RoPE, in one launch.

    y = cast(x / sqrt(mean(x**2 over the head dim) + eps) [cast] * w)        (per head, per token)
    out[2i]   = y[2i]   * cos[s, 2i]   - y[2i+1] * sin[s, 2i]                 (optional RoPE)
    out[2i+1] = y[2i+1] * cos[s, 2i+1] + y[2i]   * sin[s, 2i+1]
    all arithmetic in fp32; y is rounded to the input dtype (the norm module's output), out once more.

The q/k step of diffusers' MMDiT attention processors: FLUX (``FluxAttnProcessor``: ``torch.nn.RMSNorm(head_dim)``
on ``[B, S, H, D]`` rows, text then image tokens, then ``apply_rotary_emb(..., sequence_dim=1)`` with fp32 cos/sin
``[S, D]``) and SD3 with ``qk_norm="rms_norm"`` (``JointAttnProcessor2_0``: image then text, no RoPE). Public:

* ``head_rms_norm_rope(q, k, q_weight, k_weight, eps, cos=None, sin=None)``: q, k ``[B, S, H, D]`` (any strides
  with a contiguous last dim, e.g. a slice of a fused qkv projection); returns contiguous ``[B, S, H, D]``
  (q_out, k_out), the layout diffusers' ``dispatch_attention_fn`` and SDPA's flash kernels read natively.
* ``joint_head_rms_norm_rope(parts, eps, cos=None, sin=None)``: token segments ``(q, k, q_weight, k_weight)``
  with their own norm weights, written one after the other into ONE output pair (the processor's ``torch.cat``
  is free); cos/sin ``[S_total, D]`` index the concatenated tokens.

``cast_before_weight``: True rounds the normalised value to the input dtype before the weight multiply
(diffusers ``RMSNorm``); False multiplies in fp32 and rounds once (``torch.nn.RMSNorm``). Each ``*_ref`` is the
plain-PyTorch math the kernel replaces. Depends on torch and triton only; ``python head_norm_rope.py --help``.
Inside this bundle, kernel_runtime.py adds cached launch plans and torch.library ops.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = [
    "head_rms_norm_rope",
    "joint_head_rms_norm_rope",
    "head_rms_norm_rope_ref",
    "joint_head_rms_norm_rope_ref",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Weights and cos/sin are read and converted to fp32 in the kernel: any float dtype.
_ANY_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# A head is normalised from registers in one pass; 4096 channels of q and k over 16 warps is at most
# 8 fp32 values per lane and tensor. MMDiT heads are 64 (SD3) or 128 (FLUX) wide.
_MAX_HEAD_DIM = 4096
# Elements of q (and as many of k) per step of a token's program: at most 8 FLUX heads of 128, or 16 SD3
# heads of 64 (both models have 24 heads: 3 steps of 8).
_ELEMS_PER_STEP = 1024
# Head steps unrolled up to this many (more would only grow the code and its compile time: e.g. 128 heads
# of 256 take 32 steps); beyond it the kernel loops.
_MAX_UNROLL = 8


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def _norm_heads(x, w, D, eps, DT: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr):
    """RMSNorm of fp32 heads x [BLOCK_H, BLOCK_D] (zeros past D) with the fp32 weight tile w (None: no
    weight), rounded to DT where the module rounds; returns fp32 holding DT values."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    y = x * rstd[:, None]
    if w is not None:
        if CAST_BEFORE_WEIGHT:
            y = y.to(DT).to(tl.float32)
        y = y * w
    return y.to(DT).to(tl.float32)  # the norm module's output is in the input dtype


@triton.jit
def _rotate_pairs(y, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_H, BLOCK_D] -> the interleaved partner of every channel: (-y[2i+1], y[2i]).

    The reshape keeps each lane's pairs together (a lane holds consecutive channels), so split/join
    move no data between lanes.
    """
    even, odd = tl.split(tl.reshape(y, [BLOCK_H, BLOCK_D // 2, 2]))
    return tl.reshape(tl.join(-odd, even), [BLOCK_H, BLOCK_D])


@triton.jit
def _norm_rope_store(
    xq,
    xk,
    wq,
    wk,
    c,
    sn,
    heads,
    mask,
    QO,
    KO,
    out_tok,
    cols,
    D,
    eps,
    CAST_BEFORE_WEIGHT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Normalise (and, with the cos/sin tiles c and sn, rotate) one step's heads of q and k and store them
    at their output rows."""
    DT: tl.constexpr = QO.dtype.element_ty
    yq = _norm_heads(xq, wq, D, eps, DT, CAST_BEFORE_WEIGHT)
    yk = _norm_heads(xk, wk, D, eps, DT, CAST_BEFORE_WEIGHT)
    if c is not None:
        yq = yq * c + _rotate_pairs(yq, BLOCK_H, BLOCK_D) * sn
        yk = yk * c + _rotate_pairs(yk, BLOCK_H, BLOCK_D) * sn
    out = out_tok + heads[:, None] * D + cols[None, :]
    tl.store(QO + out, yq.to(DT), mask=mask)
    tl.store(KO + out, yk.to(DT), mask=mask)


@triton.jit
def _load_heads(q_tok, k_tok, q_sh, k_sh, heads, cols, mask):
    """fp32 tiles [BLOCK_H, BLOCK_D] of q and k at the given heads of one token."""
    xq = tl.load(q_tok + heads[:, None] * q_sh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xk = tl.load(k_tok + heads[:, None] * k_sh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return xq, xk


@triton.jit
def _head_step(
    q_tok, k_tok, q_sh, k_sh, xq, xk, heads, mask, col_mask, wq, wk, c, sn, QO, KO, out_tok, cols, H, D, eps,
    CAST_BEFORE_WEIGHT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """One step of heads: load the next step's q and k (PREFETCH; a fully masked load past the last head
    moves no data), then normalise, rotate and store this step's. Returns the next step's (heads, mask,
    xq, xk)."""
    nxt = heads
    nmask = mask
    xq_next = xq
    xk_next = xk
    if PREFETCH:
        nxt = heads + BLOCK_H
        nmask = col_mask & (nxt < H)[:, None]
        xq_next, xk_next = _load_heads(q_tok, k_tok, q_sh, k_sh, nxt, cols, nmask)
    _norm_rope_store(
        xq, xk, wq, wk, c, sn, heads, mask, QO, KO, out_tok, cols, D, eps, CAST_BEFORE_WEIGHT, BLOCK_H, BLOCK_D
    )
    return nxt, nmask, xq_next, xk_next


@triton.jit
def _head_rms_norm_rope_kernel(
    Q, q_sb, q_ss, q_sh,  # q [B, S, H, D]: element strides of batch, token and head; D contiguous
    K, k_sb, k_ss, k_sh,  # k [B, S, H, D], same shape and dtype as q, its own strides
    QW, KW,  # RMSNorm weights [D] of q and k (None: no weight)
    COS, c_ss,  # cos [S_OUT, D] (None: no RoPE): token stride; channels contiguous
    SIN, s_ss,  # sin [S_OUT, D] (with COS)
    QO, KO,  # contiguous [B, S_OUT, H, D] outputs; this launch writes tokens SEQ_OFF .. SEQ_OFF + S - 1
    S, H, D,  # tokens of this segment, heads, head dim
    S_OUT, SEQ_OFF,  # tokens of the output, first output token of this segment
    eps,  # RMSNorm epsilon
    CAST_BEFORE_WEIGHT: tl.constexpr,  # round the normalised row to the dtype before the weight
    BLOCK_H: tl.constexpr,  # heads per step
    N_STEPS: tl.constexpr,  # cdiv(H, BLOCK_H): a program covers all H heads of one token
    MAX_UNROLL: tl.constexpr,  # unroll the steps when N_STEPS <= MAX_UNROLL (see _MAX_UNROLL)
    BLOCK_D: tl.constexpr,  # >= D (whole heads)
):  # fmt: skip
    # combinations the launcher never makes (a direct caller gets a compile error, not wrong output)
    tl.static_assert((QW is None) == (KW is None), "QW and KW come together")
    tl.static_assert((COS is None) == (SIN is None), "COS and SIN come together")
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64 (a triton_op launch); Triton as fp32
    # One program per token: the norm weights and the token's cos/sin row are loaded once and serve
    # all its heads (programs of 8 heads load them three times per FLUX token, as many load instructions
    # as q and k themselves): 9 % faster for FLUX's q/k + RoPE on an H200, 2 % slower for SD3.5's q/k
    # without RoPE, which has no table to share (references/kernel-rope-activations.md).
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    tok = SEQ_OFF + s  # token index in the output (and in the cos/sin tables)
    hh = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    # per-token operands are loaded at the tile's full shape so they share its register layout
    tile = cols[None, :] + 0 * hh[:, None]
    col_mask = tile < D
    wq = None
    wk = None
    if QW is not None:
        wq = tl.load(QW + tile, mask=col_mask, other=0.0).to(tl.float32)
        wk = tl.load(KW + tile, mask=col_mask, other=0.0).to(tl.float32)
    c = None
    sn = None
    if COS is not None:
        c = tl.load(COS + tok * c_ss + tile, mask=col_mask, other=0.0).to(tl.float32)
        sn = tl.load(SIN + tok * s_ss + tile, mask=col_mask, other=0.0).to(tl.float32)
    q_tok = Q + b * q_sb + s * q_ss
    k_tok = K + b * k_sb + s * k_ss
    out_tok = (b * S_OUT + tok) * H * D
    # N_STEPS steps of BLOCK_H heads; the next step's heads are loaded before this step's are stored, so
    # their latency overlaps the arithmetic. Up to _MAX_UNROLL steps the loop is unrolled (faster at
    # FLUX's and SD3's 3 steps); beyond, a loop whose last "next" load is fully masked (no traffic).
    heads = hh.to(tl.int64)
    mask = col_mask & (heads < H)[:, None]
    xq, xk = _load_heads(q_tok, k_tok, q_sh, k_sh, heads, cols, mask)
    if N_STEPS <= MAX_UNROLL:
        for step in tl.static_range(N_STEPS):
            heads, mask, xq, xk = _head_step(
                q_tok, k_tok, q_sh, k_sh, xq, xk, heads, mask, col_mask, wq, wk, c, sn, QO, KO, out_tok, cols, H, D, eps,
                CAST_BEFORE_WEIGHT, BLOCK_H, BLOCK_D, step + 1 < N_STEPS,
            )  # fmt: skip
    else:
        for _ in range(0, N_STEPS):
            heads, mask, xq, xk = _head_step(
                q_tok, k_tok, q_sh, k_sh, xq, xk, heads, mask, col_mask, wq, wk, c, sn, QO, KO, out_tok, cols, H, D, eps,
                CAST_BEFORE_WEIGHT, BLOCK_H, BLOCK_D, True,
            )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@torch.compiler.assume_constant_result  # a constant for Dynamo: it need not trace Triton's driver
@functools.lru_cache(maxsize=None)
def _device_target(device: torch.device):
    """(backend, arch, warp size), e.g. ("hip", "gfx942", 64) or ("cuda", 90, 32); ("interpreter", None, 32)
    on the CPU. Cached per device."""
    if device.type == "cpu":
        return ("interpreter", None, 32)
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _check(name: str, t, dtypes, device=None) -> None:
    """Refuse t unless it is a tensor of one of dtypes, on device (when given), contiguous in its last dim."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        expected = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {expected}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move them to one device")
    if t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


def _launch_config(head_dim: int, heads: int, warp_size: int):
    """(BLOCK_H, BLOCK_D, num_warps): heads per step of a token's program, padded head dim, warps.

    A step normalises whole heads (the norm needs the full head before anything is written) and moves about
    _ELEMS_PER_STEP elements of each of q and k; BLOCK_H is the largest power of two within that budget that
    divides the head count (no masked rows; FLUX's and SD3's 24 heads: 3 steps of 8), unless only a small
    one would (then a masked last step). Each lane holds about 8 consecutive elements of a tile (one 16-byte
    bf16 vector per tensor); the warp count follows from the lane count (32 on NVIDIA, 64 on CDNA).
    """
    block_d = _next_pow2(max(head_dim, 2))
    cap = max(1, _ELEMS_PER_STEP // block_d)
    block_h = min(cap, _next_pow2(max(heads, 1)))
    cand = block_h
    while cand >= max(1, cap // 4) and heads % cand:
        cand //= 2
    if cand >= max(1, cap // 4) and heads % cand == 0:
        block_h = cand
    num_warps = max(1, min(16, (block_h * block_d) // (warp_size * 8)))
    return block_h, block_d, _next_pow2(num_warps)


def _eps_list(eps, n: int) -> list:
    vals = list(eps) if isinstance(eps, (list, tuple)) else [eps] * n
    if len(vals) != n:
        raise ValueError(f"eps has {len(vals)} values for {n} parts; give one float or one per part")
    for e in vals:
        if isinstance(e, bool) or not isinstance(e, (float, int)) or not e >= 0:
            raise ValueError(f"eps must be a non-negative float, got {e!r}")
    return [float(e) for e in vals]


def _check_parts(qs, ks, q_weights, k_weights) -> int:
    """Check every part against the first one's q; returns the total number of tokens."""
    n_parts = len(qs)
    dev, dtype = qs[0].device, qs[0].dtype
    bsz, _, heads, dim = qs[0].shape
    has_weight = q_weights[0] is not None
    total = 0
    for i, (q, k, qw, kw) in enumerate(zip(qs, ks, q_weights, k_weights)):
        tag = "" if n_parts == 1 else f" (part {i})"
        _check("q" + tag, q, _SUPPORTED_DTYPES, dev)
        _check("k" + tag, k, _SUPPORTED_DTYPES, dev)
        if q.dim() != 4 or q.shape[0] != bsz or q.shape[2] != heads or q.shape[3] != dim:
            raise ValueError(
                f"q{tag} has shape {tuple(q.shape)}; expected [{bsz}, S, {heads}, {dim}] ([B, S, H, D], "
                "with the B, H and D of the first part)"
            )
        if k.shape != q.shape:
            raise ValueError(
                f"k{tag} has shape {tuple(k.shape)} but q{tag} has shape {tuple(q.shape)}; they must match"
            )
        if q.dtype != dtype or k.dtype != dtype:
            name = str(dtype).replace("torch.", "")
            raise TypeError(
                f"q{tag} / k{tag} have dtypes {str(q.dtype)[6:]} / {str(k.dtype)[6:]}; every q and k must have "
                f"the dtype {name}"
            )
        if (qw is None) != (kw is None) or (qw is not None) != has_weight:
            raise ValueError("q_weight and k_weight must both be tensors or both be None, in every part")
        for nm, w in (("q_weight" + tag, qw), ("k_weight" + tag, kw)):
            if w is not None:
                _check(nm, w, _ANY_FLOAT, dev)
                if w.dim() != 1 or w.shape[0] != dim:
                    raise ValueError(f"{nm} must have shape [{dim}] (the head dim of q), got {tuple(w.shape)}")
        total += q.shape[1]
    if dim > _MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {dim}; this kernel supports at most {_MAX_HEAD_DIM} (unsupported width)")
    return total


def _check_tables(cos, sin, total: int, dim: int, dev) -> bool:
    """Check the RoPE tables (both None: no rotation); returns whether there are any."""
    if cos is None and sin is None:
        return False
    if cos is None or sin is None:
        raise ValueError("cos and sin must be given together (or both None for no rotary embedding)")
    if dim % 2:
        raise ValueError(f"q has head dim {dim}; interleaved RoPE needs an even head dim")
    for nm, t in (("cos", cos), ("sin", sin)):
        _check(nm, t, _ANY_FLOAT, dev)
        if t.dim() != 2 or t.shape[0] != total or t.shape[1] != dim:
            raise ValueError(
                f"{nm} has shape {tuple(t.shape)}; expected [{total}, {dim}] (one row per token of the "
                "concatenated parts, as FluxPosEmbed returns it)"
            )
    return True


def _launch(
    q: list[Tensor], k: list[Tensor], q_weight: list[Optional[Tensor]], k_weight: list[Optional[Tensor]],
    eps: list[float], cos: Optional[Tensor], sin: Optional[Tensor], cast_before_weight: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Check every part (q[i], k[i], q_weight[i], k_weight[i]), allocate the joint contiguous outputs, launch
    the kernel once per part with tokens."""
    qs, ks, q_weights, k_weights = q, k, q_weight, k_weight
    n_parts = len(qs)
    if n_parts == 0 or len(ks) != n_parts or len(q_weights) != n_parts or len(k_weights) != n_parts:
        raise ValueError("parts must be a non-empty sequence of (q, k, q_weight, k_weight)")
    eps = _eps_list(eps, n_parts)
    _check("q", qs[0], _SUPPORTED_DTYPES)
    if qs[0].dim() != 4:
        raise ValueError(f"q must be [B, S, H, D] (4 dims), got shape {tuple(qs[0].shape)}")
    dev, dtype = qs[0].device, qs[0].dtype
    bsz, _, heads, dim = qs[0].shape
    total = _check_parts(qs, ks, q_weights, k_weights)
    has_rope = _check_tables(cos, sin, total, dim, dev)
    q_out = torch.empty((bsz, total, heads, dim), dtype=dtype, device=dev)
    k_out = torch.empty((bsz, total, heads, dim), dtype=dtype, device=dev)
    if q_out.numel() == 0:
        return q_out, k_out
    block_h, block_d, num_warps = _launch_config(dim, heads, _device_target(dev)[2])
    offset = 0
    for qi, ki, qw, kw, e in zip(qs, ks, q_weights, k_weights, eps):
        seq = qi.shape[1]
        if seq > 0:  # one program per token; absent weights and tables go as None (their uses compile away)
            _head_rms_norm_rope_kernel[(bsz * seq,)](
                qi, *qi.stride()[:3], ki, *ki.stride()[:3], qw, kw,
                cos, cos.stride(0) if has_rope else 0, sin, sin.stride(0) if has_rope else 0,
                q_out, k_out, seq, heads, dim, total, offset, e,
                CAST_BEFORE_WEIGHT=bool(cast_before_weight), BLOCK_H=block_h, N_STEPS=-(-heads // block_h),
                MAX_UNROLL=_MAX_UNROLL, BLOCK_D=block_d, num_warps=num_warps,
            )  # fmt: skip
        offset += seq
    return q_out, k_out


def _no_backward(fn: str, names, tensors) -> None:
    """In grad mode, refuse an input that requires grad: the kernel has no backward, so its outputs would
    carry no grad_fn and gradients would stop there without a word."""
    if torch.is_grad_enabled():
        for name, t in zip(names, tensors):
            if t is not None and getattr(t, "requires_grad", False):
                raise RuntimeError(
                    f"{fn}: {name} requires grad, but this Triton kernel has no backward (its outputs would "
                    f"carry no grad_fn, and gradients would silently stop there); call {fn} under "
                    "torch.no_grad() or torch.inference_mode(), or use the PyTorch reference "
                    f"({fn}_ref) where gradients are needed"
                )


def _dispatch(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight, fn):
    if torch.is_grad_enabled():
        kinds = ("q", "k", "q_weight", "k_weight")
        names = (
            list(kinds)
            if len(qs) == 1 and fn == "head_rms_norm_rope"
            else [f"{n} of part {i}" for i in range(len(qs)) for n in kinds]
        )
        _no_backward(fn, names + ["cos", "sin"], [t for p in zip(qs, ks, q_weights, k_weights) for t in p] + [cos, sin])
    eps = _eps_list(eps, max(len(qs), 1))  # (a list of floats: the op's argument under torch.compile)
    return _launch(qs, ks, q_weights, k_weights, eps, cos, sin, bool(cast_before_weight))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def head_rms_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    eps: float,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    *,
    cast_before_weight: bool = False,
):
    """``rope(norm_q(q)), rope(norm_k(k))`` per head in one launch (no RoPE when cos/sin are None).

    q, k: [B, S, H, D], same shape and dtype (fp16/bf16/fp32), any strides with a contiguous last dim.
    q_weight, k_weight: [D] (any float dtype) or both None. cos/sin: [S, D] (fp32 from FluxPosEmbed),
    interleaved pairs (diffusers ``apply_rotary_emb(..., use_real_unbind_dim=-1)``), D even.
    Returns contiguous [B, S, H, D] (q_out, k_out) of q's dtype. See the module docstring for
    ``cast_before_weight``.
    The kernel has no backward: in grad mode, an input that requires grad raises RuntimeError (call it
    under torch.no_grad() / torch.inference_mode(), or use head_rms_norm_rope_ref where gradients are needed).
    """
    return _dispatch([q], [k], [q_weight], [k_weight], eps, cos, sin, cast_before_weight, "head_rms_norm_rope")


def joint_head_rms_norm_rope(
    parts: Sequence[tuple],
    eps: Union[float, Sequence[float]],
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    *,
    cast_before_weight: bool = False,
):
    """Per-head q/k RMSNorm (+ RoPE) of several token segments, concatenated along the tokens.

    parts: [(q, k, q_weight, k_weight), ...], each q/k [B, S_i, H, D] with its own strides and norm
    weights; B, H, D and the dtype are shared. eps: one float, or one per part. cos/sin: None, or
    [sum S_i, D] for the concatenated tokens. Returns (q_out, k_out), contiguous [B, sum S_i, H, D],
    equal to ``torch.cat([rope(norm(q_i)) ...], dim=1)`` (and the same for k) without the copies.
    FLUX's double-stream attention: parts = [(text q, text k, norm_added_q.weight, norm_added_k.weight),
    (image q, image k, norm_q.weight, norm_k.weight)].
    No backward: in grad mode, an input that requires grad raises RuntimeError (see head_rms_norm_rope).
    """
    if isinstance(parts, tuple) and parts and isinstance(parts[0], torch.Tensor):
        raise TypeError("parts must be a sequence of (q, k, q_weight, k_weight) tuples")
    parts = [tuple(p) for p in parts]
    if any(len(p) != 4 for p in parts):
        raise ValueError("each part must be a (q, k, q_weight, k_weight) tuple")
    qs, ks, qws, kws = (list(c) for c in zip(*parts)) if parts else ([], [], [], [])
    return _dispatch(qs, ks, qws, kws, eps, cos, sin, cast_before_weight, fn="joint_head_rms_norm_rope")


# --------------------------------------------------------------------------------------------
# References: the plain-PyTorch math the kernel replaces (run them in float64 for testing)
# --------------------------------------------------------------------------------------------
def _rms_norm_module_ref(x, weight, eps, cast_before_weight):
    """RMSNorm over the last dim, rounded where the modules round (nothing rounds in float64)."""
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(f)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if cast_before_weight:
            y = y.to(x.dtype).to(f)
        y = y * weight.to(f)
    return y.to(x.dtype)


def _rope_ref(x, cos, sin):
    """diffusers apply_rotary_emb(x, (cos, sin), sequence_dim=1) for x [B, S, H, D]: fp32 math
    (float64 for float64 x), one rounding."""
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(f)
    even, odd = xf.unflatten(-1, (-1, 2)).unbind(-1)
    partner = torch.stack([-odd, even], dim=-1).flatten(-2)
    c, s = cos.to(f)[None, :, None, :], sin.to(f)[None, :, None, :]
    return (xf * c + partner * s).to(x.dtype)


def joint_head_rms_norm_rope_ref(parts, eps, cos=None, sin=None, cast_before_weight=False):
    eps = list(eps) if isinstance(eps, (list, tuple)) else [eps] * len(parts)
    qn = torch.cat([_rms_norm_module_ref(q, qw, e, cast_before_weight) for (q, _, qw, _), e in zip(parts, eps)], dim=1)
    kn = torch.cat([_rms_norm_module_ref(k, kw, e, cast_before_weight) for (_, k, _, kw), e in zip(parts, eps)], dim=1)
    if cos is None:
        return qn, kn
    return _rope_ref(qn, cos, sin), _rope_ref(kn, cos, sin)


def head_rms_norm_rope_ref(q, k, q_weight, k_weight, eps, cos=None, sin=None, cast_before_weight=False):
    return joint_head_rms_norm_rope_ref([(q, k, q_weight, k_weight)], eps, cos, sin, cast_before_weight)


# --------------------------------------------------------------------------------------------
# Self-check: python head_norm_rope.py [--tokens S] [--heads H] [--head-dim D] [--dtype bf16]
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(
        description="Check the per-head q/k RMSNorm (+ RoPE) kernel against a float64 reference, with the "
        "FLUX layout: text and image segments, fp32 cos/sin tables."
    )
    p.add_argument("--text-tokens", type=int, default=8, help="tokens of the first segment (default 8)")
    p.add_argument("--tokens", type=int, default=24, help="tokens of the second segment (default 24)")
    p.add_argument("--heads", type=int, default=4, help="heads (default 4)")
    p.add_argument("--head-dim", type=int, default=128, help="head dim (default 128, FLUX)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("tokens", "heads", "head_dim"):  # sizes: at least 1
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() and not _interpreting() else "cpu"
    if device == "cpu" and not _interpreting():
        print("no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter", file=sys.stderr)
        return 2
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    B, H, D, St, Si = 1, args.heads, args.head_dim, args.text_tokens, args.tokens

    def rnd(*shape, scale=1.0, offset=0.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale + offset).to(device, dt)

    # q, k, v of each stream as the projections produce them: [B, S, H*D] viewed as [B, S, H, D]
    txt = rnd(B, St, 3 * H * D, scale=2.0)
    img = rnd(B, Si, 3 * H * D, scale=2.0)
    tq, tk = (t.unflatten(-1, (H, D)) for t in txt[..., : 2 * H * D].chunk(2, dim=-1))
    iq, ik = (t.unflatten(-1, (H, D)) for t in img[..., : 2 * H * D].chunk(2, dim=-1))
    ws = [rnd(D, scale=0.2, offset=1.0) for _ in range(4)]
    angles = torch.randn(St + Si, D // 2, generator=g, dtype=torch.float64) * 10
    cos = angles.cos().repeat_interleave(2, dim=-1).float().to(device)
    sin = angles.sin().repeat_interleave(2, dim=-1).float().to(device)
    parts = [(tq, tk, ws[0], ws[1]), (iq, ik, ws[2], ws[3])]
    q_out, k_out = joint_head_rms_norm_rope(parts, 1e-6, cos, sin)
    dparts = [tuple(t.double() for t in part) for part in parts]
    q_ref, k_ref = joint_head_rms_norm_rope_ref(dparts, 1e-6, cos.double(), sin.double())
    q_nr, k_nr = joint_head_rms_norm_rope(parts, 1e-6, cast_before_weight=True)
    q_nr_ref, k_nr_ref = joint_head_rms_norm_rope_ref(dparts, 1e-6)
    checks = {
        "q_rope": (q_out, q_ref),
        "k_rope": (k_out, k_ref),
        "q_norm_only": (q_nr, q_nr_ref),
        "k_norm_only": (k_nr, k_nr_ref),
    }
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}[dtype]
    report, ok = {}, True
    for name, (got, ref) in checks.items():
        err = ((got.double() - ref.double()).abs() / (1 + ref.double().abs())).max().item()
        good = bool(err <= tol)
        report[name] = {"max_rel_err": err, "ok": good}
        ok &= good
    print(
        json.dumps(
            {"device": str(device), "dtype": args.dtype, "shape": [B, St + Si, H, D], "checks": report, "ok": bool(ok)}
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

# Inside this bundle (kernel_runtime.py beside this file): cached launch plans, torch.library ops and device
# checks for the launcher. Copied alone, the file keeps its plain launcher.
try:
    import kernel_runtime
except ImportError:
    pass
else:
    kernel_runtime.accelerate(globals(), head_rms_norm_rope="_launch")

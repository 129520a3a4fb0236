# SPDX-License-Identifier: Apache-2.0
"""Per-head RMSNorm of q and k, optionally followed by interleaved-pair RoPE, in one launch.

    y = cast(x / sqrt(mean(x**2 over the head dim) + eps) [cast] * w)        (per head, per token)
    out[2i]   = y[2i]   * cos[s, 2i]   - y[2i+1] * sin[s, 2i]                 (optional RoPE)
    out[2i+1] = y[2i+1] * cos[s, 2i+1] + y[2i]   * sin[s, 2i+1]
    all arithmetic in fp32; y is rounded to the input dtype (the norm module's output), out once more.

The q/k step of diffusers' MMDiT attention processors: FLUX (``FluxAttnProcessor``: ``torch.nn.RMSNorm(head_dim)``
on ``[B, S, H, D]``, text then image tokens, then ``apply_rotary_emb(..., sequence_dim=1)`` with fp32 cos/sin
``[S, D]``) and SD3 (``JointAttnProcessor2_0``, ``qk_norm="rms_norm"``: image then text, no RoPE). The joint form
writes the segments into ONE output pair (the processor's ``torch.cat`` is free). ``cast_before_weight``: True rounds
y to x's dtype before the weight multiply (diffusers ``RMSNorm``), False once (``torch.nn.RMSNorm``).
Depends on torch and triton only; ``python head_norm_rope.py --help``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["head_rms_norm_rope", "joint_head_rms_norm_rope", "head_rms_norm_rope_ref", "joint_head_rms_norm_rope_ref"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ANY_FLOAT = _SUPPORTED_DTYPES + (torch.float64,)  # weights and cos/sin: read and converted to fp32 in the kernel
_MAX_HEAD_DIM = 4096  # a head is normalised from registers: 16 warps hold at most 8 fp32 values per lane and tensor
# Elements of q (and as many of k) per step of a token's program: 8 FLUX heads of 128 or 16 SD3 heads of 64 (24
# heads: 3 steps of 8). Steps unrolled up to _MAX_UNROLL (more only grows code and compile time), else a loop.
_ELEMS_PER_STEP, _MAX_UNROLL = 1024, 8


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


# ---- launcher ---------------------------------------------------------------------------------------------
@torch.compiler.assume_constant_result  # a constant for Dynamo: it need not trace Triton's driver
@functools.lru_cache(maxsize=None)
def _device_target(device: torch.device):  # (backend, arch, warp size), e.g. ("hip", "gfx942", 64) or ("cuda", 90, 32)
    if device.type == "cpu":
        return ("interpreter", None, 32)
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _check(name: str, t, dtypes, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected one of {', '.join(str(d)[6:] for d in dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move them to one device")
    if t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")


def _launch_config(head_dim: int, heads: int, warp_size: int):
    """(BLOCK_H, BLOCK_D, num_warps). A step normalises whole heads (the norm needs all of a head), ~_ELEMS_PER_STEP
    elements: BLOCK_H is the largest power of two in that budget dividing the head count (no masked rows) unless
    only a small one would (then a masked last step). A lane holds ~8 consecutive elements (16 bytes of bf16)."""
    pow2 = lambda n: 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds
    block_d = pow2(max(head_dim, 2))
    cap = max(1, _ELEMS_PER_STEP // block_d)
    block_h = min(cap, pow2(heads))
    divisors = (c for c in (block_h >> i for i in range(block_h.bit_length())) if c >= cap // 4 and heads % c == 0)
    block_h = next(divisors, block_h)
    return block_h, block_d, pow2(max(1, min(16, (block_h * block_d) // (warp_size * 8))))


def _launch(
    q: list[Tensor], k: list[Tensor], q_weight: list[Optional[Tensor]], k_weight: list[Optional[Tensor]],
    eps: list[float], cos: Optional[Tensor], sin: Optional[Tensor], cast_before_weight: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Check the parts against the first one's q and the RoPE tables, launch the kernel once per part with tokens."""
    n_parts = len(q)
    if n_parts == 0 or len(k) != n_parts or len(q_weight) != n_parts or len(k_weight) != n_parts:
        raise ValueError("parts must be a non-empty sequence of (q, k, q_weight, k_weight)")
    if len(eps) != n_parts:
        raise ValueError(f"eps has {len(eps)} values for {n_parts} parts; give one float or one per part")
    _check("q", q[0], _SUPPORTED_DTYPES)
    if q[0].dim() != 4:
        raise ValueError(f"q must be [B, S, H, D] (4 dims), got shape {tuple(q[0].shape)}")
    dev, dtype, (bsz, _, heads, dim), total = q[0].device, q[0].dtype, q[0].shape, 0
    for i, (qi, ki, qw, kw) in enumerate(zip(q, k, q_weight, k_weight)):
        tag = "" if n_parts == 1 else f" (part {i})"
        _check("q" + tag, qi, _SUPPORTED_DTYPES, dev)
        _check("k" + tag, ki, _SUPPORTED_DTYPES, dev)
        if qi.dim() != 4 or qi.shape[0] != bsz or qi.shape[2] != heads or qi.shape[3] != dim:
            raise ValueError(f"q{tag} has shape {tuple(qi.shape)}; expected [{bsz}, S, {heads}, {dim}] ([B, S, H, D], with the B, H and D of the first part)")  # fmt: skip
        if ki.shape != qi.shape:
            raise ValueError(f"k{tag} has shape {tuple(ki.shape)} but q{tag} has shape {tuple(qi.shape)}; they must match")  # fmt: skip
        if qi.dtype != dtype or ki.dtype != dtype:
            raise TypeError(f"q{tag} / k{tag} have dtypes {str(qi.dtype)[6:]} / {str(ki.dtype)[6:]}; every q and k must have the dtype {str(dtype)[6:]}")  # fmt: skip
        if (qw is None) != (kw is None) or (qw is None) != (q_weight[0] is None):
            raise ValueError("q_weight and k_weight must both be tensors or both be None, in every part")
        for nm, w in (("q_weight" + tag, qw), ("k_weight" + tag, kw)) if qw is not None else ():
            _check(nm, w, _ANY_FLOAT, dev)
            if w.dim() != 1 or w.shape[0] != dim:
                raise ValueError(f"{nm} must have shape [{dim}] (the head dim of q), got {tuple(w.shape)}")
        total += qi.shape[1]
    if dim > _MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {dim}; this kernel supports at most {_MAX_HEAD_DIM} (unsupported width)")
    has_rope = cos is not None or sin is not None
    if has_rope and (cos is None or sin is None):
        raise ValueError("cos and sin must be given together (or both None for no rotary embedding)")
    if has_rope and dim % 2:
        raise ValueError(f"q has head dim {dim}; interleaved RoPE needs an even head dim")
    for nm, t in (("cos", cos), ("sin", sin)) if has_rope else ():
        _check(nm, t, _ANY_FLOAT, dev)
        if t.dim() != 2 or t.shape[0] != total or t.shape[1] != dim:
            raise ValueError(f"{nm} has shape {tuple(t.shape)}; expected [{total}, {dim}] (one row per token of the concatenated parts, as FluxPosEmbed returns it)")  # fmt: skip
    q_out, k_out = (torch.empty((bsz, total, heads, dim), dtype=dtype, device=dev) for _ in "qk")
    if q_out.numel() == 0:
        return q_out, k_out
    (block_h, block_d, num_warps), offset = _launch_config(dim, heads, _device_target(dev)[2]), 0
    for qi, ki, qw, kw, e in zip(q, k, q_weight, k_weight, eps):
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


def _dispatch(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight, fn):
    """Refuse inputs that require grad in grad mode (no backward: gradients would stop without a word), launch."""
    if torch.is_grad_enabled():
        kinds = ("q", "k", "q_weight", "k_weight")
        names = kinds if fn == "head_rms_norm_rope" else [f"{n} of part {i}" for i in range(len(qs)) for n in kinds]
        tensors = [t for part in zip(qs, ks, q_weights, k_weights) for t in part] + [cos, sin]
        for name, t in zip([*names, "cos", "sin"], tensors):
            if getattr(t, "requires_grad", False):
                raise RuntimeError(
                    f"{fn}: {name} requires grad, but this Triton kernel has no backward (its outputs would carry no "
                    f"grad_fn, and gradients would silently stop there); call {fn} under torch.no_grad() or "
                    f"torch.inference_mode(), or use the PyTorch reference ({fn}_ref) where gradients are needed"
                )
    eps = list(eps) if isinstance(eps, (list, tuple)) else [eps] * max(len(qs), 1)
    for e in eps:  # the launcher takes a list of floats (the op's argument under torch.compile)
        if isinstance(e, bool) or not isinstance(e, (float, int)) or not e >= 0:
            raise ValueError(f"eps must be a non-negative float, got {e!r}")
    return _launch(qs, ks, q_weights, k_weights, [float(e) for e in eps], cos, sin, bool(cast_before_weight))


def head_rms_norm_rope(q, k, q_weight, k_weight, eps, cos=None, sin=None, *, cast_before_weight=False):
    """``rope(norm_q(q)), rope(norm_k(k))`` per head (no RoPE when cos/sin are None). q, k: [B, S, H, D] of one dtype
    (fp16/bf16/fp32), last dim contiguous. q_weight, k_weight: [D] (any float dtype) or both None. cos/sin: [S, D]
    (fp32 from FluxPosEmbed), interleaved pairs, D even. Returns contiguous [B, S, H, D] (q_out, k_out), as SDPA's
    flash kernels read them. No backward: in grad mode an input that requires grad raises RuntimeError."""
    return _dispatch([q], [k], [q_weight], [k_weight], eps, cos, sin, cast_before_weight, "head_rms_norm_rope")


def joint_head_rms_norm_rope(parts, eps, cos=None, sin=None, *, cast_before_weight=False):
    """``torch.cat([rope(norm(q_i)) ...], dim=1)`` (and for k) without the copies. parts: [(q, k, q_weight, k_weight),
    ...], q/k [B, S_i, H, D] (B, H, D, dtype shared); eps: one float or one per part; cos/sin: None or [sum S_i, D].
    FLUX: [(text q, text k, norm_added_q.weight, norm_added_k.weight), (image q, image k, norm_q.weight, ...)]."""
    if isinstance(parts, tuple) and parts and isinstance(parts[0], torch.Tensor):
        raise TypeError("parts must be a sequence of (q, k, q_weight, k_weight) tuples")
    parts = [tuple(p) for p in parts]
    if any(len(p) != 4 for p in parts):
        raise ValueError("each part must be a (q, k, q_weight, k_weight) tuple")
    qs, ks, qws, kws = (list(c) for c in zip(*parts)) if parts else ([], [], [], [])
    return _dispatch(qs, ks, qws, kws, eps, cos, sin, cast_before_weight, fn="joint_head_rms_norm_rope")


def joint_head_rms_norm_rope_ref(parts, eps, cos=None, sin=None, cast_before_weight=False):
    """Each part's RMSNorm, rounded where the modules round (nothing rounds in float64), concatenated; then diffusers'
    apply_rotary_emb(x, (cos, sin), sequence_dim=1): fp32 math (float64 for float64 x), one rounding."""
    eps = list(eps) if isinstance(eps, (list, tuple)) else [eps] * len(parts)
    out = []
    for i in (0, 1):  # q, then k
        ys = []
        for part, e in zip(parts, eps):
            x, w, f = part[i], part[2 + i], torch.float64 if part[i].dtype == torch.float64 else torch.float32
            y = x.to(f) * torch.rsqrt(x.to(f).pow(2).mean(-1, keepdim=True) + e)
            y = y if w is None else (y.to(x.dtype).to(f) if cast_before_weight else y) * w.to(f)
            ys.append(y.to(x.dtype))
        y = torch.cat(ys, dim=1)
        if cos is not None:
            yf = y.to(torch.float64 if y.dtype == torch.float64 else torch.float32)
            even, odd = yf.unflatten(-1, (-1, 2)).unbind(-1)
            partner = torch.stack([-odd, even], dim=-1).flatten(-2)
            y = (yf * cos.to(yf.dtype)[None, :, None, :] + partner * sin.to(yf.dtype)[None, :, None, :]).to(y.dtype)
        out.append(y)
    return tuple(out)


def head_rms_norm_rope_ref(q, k, q_weight, k_weight, eps, cos=None, sin=None, cast_before_weight=False):
    return joint_head_rms_norm_rope_ref([(q, k, q_weight, k_weight)], eps, cos, sin, cast_before_weight)


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Check the kernel against a float64 reference in FLUX's layout.")
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
    dtype, tol = dict(fp32=(torch.float32, 1e-5), fp16=(torch.float16, 4e-3), bf16=(torch.bfloat16, 0.032))[args.dtype]
    device = "cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter\n")
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    H, D, St, Si = args.heads, args.head_dim, args.text_tokens, args.tokens
    # text and image q, k as the fused qkv projections leave them: [1, S, 3 * H * D] viewed as [1, S, H, D]
    tq, tk, _ = (torch.randn(1, St, 3, H, D, generator=g) * 2).to(device, dtype).unbind(2)
    iq, ik, _ = (torch.randn(1, Si, 3, H, D, generator=g) * 2).to(device, dtype).unbind(2)
    ws = [(torch.randn(D, generator=g) * 0.2 + 1).to(device, dtype) for _ in range(4)]
    angles = torch.randn(St + Si, D // 2, generator=g, dtype=torch.float64) * 10
    cos, sin = (f(angles).repeat_interleave(2, dim=-1).float().to(device) for f in (torch.cos, torch.sin))
    parts = [(tq, tk, ws[0], ws[1]), (iq, ik, ws[2], ws[3])]
    dparts = [tuple(t.double() for t in part) for part in parts]
    report = {}
    for name, outs, refs in (
        ("rope", joint_head_rms_norm_rope(parts, 1e-6, cos, sin), joint_head_rms_norm_rope_ref(dparts, 1e-6, cos.double(), sin.double())),
        ("norm_only", joint_head_rms_norm_rope(parts, 1e-6, cast_before_weight=True), joint_head_rms_norm_rope_ref(dparts, 1e-6)),
    ):  # fmt: skip
        for which, got, ref in zip("qk", outs, refs):
            err = ((got.double() - ref).abs() / (1 + ref.abs())).max().item()
            report[f"{which}_{name}"] = {"max_rel_err": err, "ok": bool(err <= tol)}
    ok = all(r["ok"] for r in report.values())
    print(json.dumps({"device": device, "dtype": args.dtype, "shape": [1, St + Si, H, D], "checks": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

# Beside kernel_runtime.py: cached launch plans, torch.library ops and device checks; copied alone: the plain launcher.
try:
    import kernel_runtime
except ImportError:
    pass
else:
    kernel_runtime.accelerate(globals(), head_rms_norm_rope="_launch")

# SPDX-License-Identifier: Apache-2.0
"""LTX-Video self-attention's q/k RMSNorm and RoPE in one launch (Wan's too, with a table one head wide).

    y   = cast(x / sqrt(mean(x**2 over the C channels) + eps) [cast] * w)   (torch.nn.RMSNorm(C), per token)
    out[2i]   = y[2i]   * cos[2i]   - y[2i+1] * sin[2i]                   (interleaved pairs, as ltx_rope)
    out[2i+1] = y[2i+1] * cos[2i+1] + y[2i]   * sin[2i+1]
    coords form: cos/sin of pair i computed in the kernel, angle freqs[p // 3] * (coords[p % 3] * 2 - 1) for
    p = i - (C % 6) // 2 (the leading pairs: identity), as diffusers' LTXVideoRotaryPosEmbed computes them.
    all arithmetic in fp32; y is rounded to the input dtype (the norm module's output), out once more.

Public: ltx_qk_rmsnorm_rope(_coords), ltx_rope_freqs, ltx_cos_sin_from_coords; each ``*_ref`` is the plain-PyTorch
math a kernel replaces (run it on float64). Depends on torch and triton only; ``python qk_norm_rope.py --help``.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ANY_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # cos/sin, weights, coords, freqs
_MAX_NORM_WIDTH = 16384  # fused RMSNorm + RoPE holds a whole row in registers: <= 32 fp32 per lane over 16 warps


@triton.jit
def _rotate_pairs(x, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """[BLOCK_M, BLOCK_C] -> the interleaved partner of every channel: (-x[2i+1], x[2i]).

    The row is loaded as one contiguous tile (16-byte vector loads) and split in registers: the
    reshape keeps each lane's pairs together, so split/join move no data between lanes.
    """
    even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_C // 2, 2]))
    return tl.reshape(tl.join(-odd, even), [BLOCK_M, BLOCK_C])


@triton.jit
def _rms_norm_rows(x, W, cols, C, eps, DTYPE: tl.constexpr, CAST_BEFORE_WEIGHT: tl.constexpr):
    """torch.nn.RMSNorm of fp32 rows x [BLOCK_M, BLOCK_C] (zeros past C), with weight W (None: none),
    rounded where the module rounds (to DTYPE, the input dtype); returns fp32."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / C + eps)
    y = x * rstd[:, None]
    if W is not None:
        if CAST_BEFORE_WEIGHT:
            y = y.to(DTYPE).to(tl.float32)
        w = tl.load(W + cols, mask=cols < C, other=0.0).to(tl.float32)
        y = y * w[None, :]
    return y.to(DTYPE).to(tl.float32)  # the module's output is in the input dtype


@triton.jit
def _sincos(a):
    """(sin(a), cos(a)) of fp32 a, |a| < 2**22, sharing one argument reduction: a = j * pi/2 + r with
    |r| <= pi/4 (pi/2 split in three fp32 parts, fused multiply-adds), then minimax polynomials of sin and
    cos on [-pi/4, pi/4] and the quadrant j mod 4. Within 2 ulp of the correctly rounded fp32 results for
    the angles of video RoPE (|a| <= ~2e4; tests/test_qk_norm_rope.py). tl.sin and tl.cos (libdevice / OCML) each
    reduce the argument on their own and carry a slow path for huge arguments. At |a| >= 2**22 the
    reduction no longer holds (round(a * 2/pi) leaves the trick's range): both results are NaN there, so
    an out-of-range angle shows in the output instead of giving plausible wrong values."""
    j = (a * 0.6366197723675814 + 12582912.0) - 12582912.0  # round(a * 2/pi): 1.5 * 2**23 trick
    r = tl.fma(j, -1.5707963705062866, a)
    r = tl.fma(j, 4.371138828673793e-08, r)
    r = tl.fma(j, 1.7151245100058819e-15, r)
    r2 = r * r
    s = tl.fma(tl.fma(tl.fma(r2, -1.9515295891e-4, 8.3321608736e-3), r2, -1.6666654611e-1) * r2, r, r)
    c = tl.fma(
        tl.fma(tl.fma(tl.fma(r2, 2.443315711809948e-5, -1.388731625493765e-3), r2, 4.166664568298827e-2), r2, -0.5),
        r2,
        1.0,
    )
    q = j.to(tl.int32) & 3
    sin_a = tl.where((q & 1) == 0, s, c)
    cos_a = tl.where((q & 1) == 0, c, s)
    sin_a = tl.where(q >= 2, -sin_a, sin_a)
    cos_a = tl.where((q == 1) | (q == 2), -cos_a, cos_a)
    out_of_range = tl.abs(a) >= 4194304.0  # 2**22 (also true for inf; NaN stays NaN through the math)
    return tl.where(out_of_range, float("nan"), sin_a), tl.where(out_of_range, float("nan"), cos_a)


@triton.jit
def _rope_by_pair(y, cp, sp, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """Interleaved RoPE of [BLOCK_M, BLOCK_C] rows with one (cos, sin) per pair, [BLOCK_M, BLOCK_C // 2]."""
    even, odd = tl.split(tl.reshape(y, [BLOCK_M, BLOCK_C // 2, 2]))
    return tl.reshape(tl.join(even * cp - odd * sp, odd * cp + even * sp), [BLOCK_M, BLOCK_C])


@triton.jit
def _coords_cos_sin(
    COORDS, g_sb, g_ss, g_sa, FREQS, f_s, b, s, row_mask, N_PAD_PAIRS, N_ROT_PAIRS, BLOCK_C: tl.constexpr
):
    """cos and sin per rotation pair, [BLOCK_M, BLOCK_C // 2], computed from the rows' grid coordinates.

    Pair i (channels 2i, 2i+1): identity for i < N_PAD_PAIRS, else p = i - N_PAD_PAIRS uses frequency
    p // 3 on axis p % 3 (frame, height, width), the angle computed in fp32 in the order diffusers uses:
    freq * (coord * 2 - 1). Both channels of a pair share the angle (diffusers' repeat_interleave(2)), so
    the trigonometry runs once per pair and the rotation is applied to the (even, odd) halves that
    tl.split produces."""
    pair = tl.arange(0, BLOCK_C // 2) - N_PAD_PAIRS
    valid = (pair >= 0) & (pair < N_ROT_PAIRS)
    pair = tl.where(valid, pair, 0)
    freq = tl.load(FREQS + (pair // 3) * f_s, mask=valid, other=0.0).to(tl.float32)
    # the row's three coordinates, then each pair picks its axis (no per-pair gather)
    g_row = COORDS + b * g_sb + s * g_ss
    g0 = tl.load(g_row, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    g1 = tl.load(g_row + g_sa, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    g2 = tl.load(g_row + 2 * g_sa, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    axis = (pair % 3)[None, :]
    coord = tl.where(axis == 0, g0, tl.where(axis == 1, g1, g2))
    angle = freq[None, :] * (coord * 2.0 - 1.0)
    # sin and cos share one argument reduction (_sincos): 16 % faster than tl.sin + tl.cos at LTX's
    # [2, 6144, 2048] on an H200, within 2 ulp of fp32 sin/cos (far below bf16 rounding).
    sa, ca = _sincos(angle)
    return tl.where(valid[None, :], ca, 1.0), tl.where(valid[None, :], sa, 0.0)


@triton.jit
def _ltx_qk_norm_rope_kernel(
    Q, q_sb, q_ss,  # q [B, S, C]: element strides of batch and token dims; channels contiguous
    K, k_sb, k_ss,  # k [B, S, C], same shape and dtype as q, its own strides
    QW, KW,  # RMSNorm weights [C] of q and k (None: no weight)
    COS, c_sb, c_ss,  # cos [B or 1, S, C] (None with COORDS; batch stride 0 when broadcast)
    SIN, s_sb, s_ss,  # sin, same layout rules as cos
    COORDS, g_sb, g_ss, g_sa,  # grid coordinates [B or 1, S, 3] (None with COS/SIN): batch, token, axis strides
    FREQS, f_s,  # frequencies [C // 6] (with COORDS), already times pi / 2
    QO, KO,  # contiguous [B, S, C] outputs
    M, B, C,  # rows (B * S), batch size, channels
    N_PAD_PAIRS, N_ROT_PAIRS,  # (C % 6) // 2 leading identity pairs, then 3 * (C // 6) rotated pairs
    eps,  # RMSNorm epsilon
    CAST_BEFORE_WEIGHT: tl.constexpr,  # round the normalised row to the dtype before the weight
    TABLE_W: tl.constexpr,  # 0: cos/sin rows are C wide; else D: one head's row, read by every head
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # >= C (whole rows)
):  # fmt: skip
    # combinations the launcher never makes (a direct caller gets a compile error, not wrong output)
    tl.static_assert((COORDS is None) != (COS is None), "cos/sin tables or COORDS, one of them")
    tl.static_assert((COS is None) == (SIN is None) and (COORDS is None) == (FREQS is None), "operands in pairs")
    tl.static_assert((QW is None) == (KW is None), "QW and KW come together")
    tl.static_assert(TABLE_W == 0 or COORDS is None, "TABLE_W applies to tables read, not COORDS")
    tl.static_assert(TABLE_W % 2 == 0 and TABLE_W <= BLOCK_C, "TABLE_W is even (rotation pairs) and at most BLOCK_C")
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64 (a triton_op launch); Triton as fp32
    # One program normalises and rotates the same rows of q AND k: the cos/sin of those rows are
    # read (or computed) once and used twice.
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = tl.where(row_mask, rows, 0)
    b = (rows % B).to(tl.int64)  # batch fastest: the B rows sharing a cos/sin row run side by side (L2 hits)
    s = (rows // B).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = row_mask[:, None] & (cols < C)[None, :]
    out_row = (b * (M // B) + s) * C  # contiguous [B, S, C] outputs
    # Issue both row loads first: their DRAM latency then overlaps the cos/sin work below.
    xq = tl.load(Q + (b * q_sb + s * q_ss)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    xk = tl.load(K + (b * k_sb + s * k_ss)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    DT: tl.constexpr = Q.dtype.element_ty
    if COORDS is not None:
        cp, sp = _coords_cos_sin(
            COORDS, g_sb, g_ss, g_sa, FREQS, f_s, b, s, row_mask, N_PAD_PAIRS, N_ROT_PAIRS, BLOCK_C
        )
        y = _rms_norm_rows(xq, QW, cols, C, eps, DT, CAST_BEFORE_WEIGHT)
        qo = _rope_by_pair(y, cp, sp, BLOCK_M, BLOCK_C)
        y = _rms_norm_rows(xk, KW, cols, C, eps, DT, CAST_BEFORE_WEIGHT)
        ko = _rope_by_pair(y, cp, sp, BLOCK_M, BLOCK_C)
    else:
        # cos/sin as given, channel by channel (cos[2i] and cos[2i+1] need not be equal); a per-head table
        # gives channel c the value of its channel within the head, c % D
        if TABLE_W > 0:
            tcols = cols % TABLE_W
        else:
            tcols = cols
        c = tl.load(COS + (b * c_sb + s * c_ss)[:, None] + tcols[None, :], mask=mask, other=0.0).to(tl.float32)
        sn = tl.load(SIN + (b * s_sb + s * s_ss)[:, None] + tcols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = _rms_norm_rows(xq, QW, cols, C, eps, DT, CAST_BEFORE_WEIGHT)
        qo = y * c + _rotate_pairs(y, BLOCK_M, BLOCK_C) * sn
        y = _rms_norm_rows(xk, KW, cols, C, eps, DT, CAST_BEFORE_WEIGHT)
        ko = y * c + _rotate_pairs(y, BLOCK_M, BLOCK_C) * sn
    tl.store(QO + out_row[:, None] + cols[None, :], qo.to(QO.dtype.element_ty), mask=mask)
    tl.store(KO + out_row[:, None] + cols[None, :], ko.to(KO.dtype.element_ty), mask=mask)


@torch.compiler.assume_constant_result  # a constant for Dynamo: it need not trace Triton's driver
@functools.lru_cache(maxsize=None)
def _device_target(device: torch.device):
    """(backend, arch, warp size), e.g. ("hip", "gfx942", 64); ("interpreter", None, 32) on the CPU."""
    if device.type == "cpu":
        return ("interpreter", None, 32)
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _check(names: str, dtypes, device, *tensors, contiguous=False) -> None:
    """Refuse each tensor unless it is a torch.Tensor of dtypes (on device if given; contiguous: in its last dim)."""
    for name, t in zip(names.split(","), tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            expected = ", ".join(str(d)[6:] for d in dtypes)
            raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected one of {expected}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the input is on {device}; move them to one device")
        if contiguous and t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and (st := t.stride(-1)) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {st}); call .contiguous()")


def _views(names: str, shape, what: str, *tensors) -> list:
    """Each tensor ([S, W] or [B or 1, S, W]) viewed at shape [B, S, W] without a copy; what: what a row holds,
    for the error ("cos" in it is replaced by the tensor's name)."""
    (b, s, w), views = shape, []
    for name, t in zip(names.split(","), tensors):
        orig = tuple(t.shape)
        t = t[None] if t.dim() == 2 else t  # [S, W]: the batch broadcast
        if t.dim() != 3 or t.shape[0] not in (1, b) or t.shape[1:] != (s, w):
            row = what.replace("cos", name)
            raise ValueError(f"{name} has shape {orig}; expected [{s}, {w}] or [{b} or 1, {s}, {w}] ({row})")
        views.append(t.expand(shape))
    return views


def _qk_launch(q: Tensor, k: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor], eps: float, cos: Tensor,
               sin: Tensor, cast_before_weight: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _qk(q, k, q_weight, k_weight, eps, cos, sin, None, None, cast_before_weight)


def _qk_coords_launch(q: Tensor, k: Tensor, q_weight: Optional[Tensor], k_weight: Optional[Tensor], eps: float,
                      coords: Tensor, freqs: Tensor, cast_before_weight: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    return _qk(q, k, q_weight, k_weight, eps, None, None, coords, freqs, cast_before_weight)


def _qk(q, k, q_weight, k_weight, eps, cos, sin, coords, freqs, cast_before_weight):
    """Check, configure and launch _ltx_qk_norm_rope_kernel (tables cos/sin, or coords/freqs)."""
    _check("q", _SUPPORTED_DTYPES, None, q, contiguous=True)
    if q.dim() != 3:
        raise ValueError(f"q must be [B, S, C] (3 dims), got shape {tuple(q.shape)}")
    if q.shape[-1] % 2:
        raise ValueError(f"q has channels {q.shape[-1]}; interleaved RoPE needs an even channel count")
    _check("k", _SUPPORTED_DTYPES, q.device, k, contiguous=True)
    if k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)}; they must match")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {str(k.dtype)[6:]} but q has dtype {str(q.dtype)[6:]}; they must match")
    (bsz, seq, ch), dev = q.shape, q.device
    if ch > _MAX_NORM_WIDTH:
        raise ValueError(f"q has {ch} channels; the fused RMSNorm + RoPE kernels support at most {_MAX_NORM_WIDTH} "
                         "(unsupported width: use an RMSNorm kernel followed by rope.py's ltx_rope)")  # fmt: skip
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be tensors or both be None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)) if q_weight is not None else ():
        _check(name, _ANY_FLOAT, dev, w, contiguous=True)
        if w.shape != (ch,):
            raise ValueError(f"{name} must have shape [{ch}] (the channel count of q), got {tuple(w.shape)}")
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not eps >= 0:  # NaN fails eps >= 0
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    table_w, tables, grid = ch, (None, 0, 0, None, 0, 0), (None, 0, 0, 0, None, 0)  # absent operands: None, strides 0
    if coords is not None:
        _check("coords,freqs", _ANY_FLOAT, dev, coords, freqs)
        (coords,) = _views("coords", (bsz, seq, 3), "the (frame, height, width) grid coordinate per token", coords)
        if freqs.shape != (ch // 6,):
            msg = f"freqs has shape {tuple(freqs.shape)}; expected [{ch // 6}] (C // 6 frequencies for C = {ch})"
            raise ValueError(msg)
        grid = (coords, *coords.stride(), freqs, freqs.stride(0))
    else:
        _check("cos,sin", _ANY_FLOAT, dev, cos, sin, contiguous=True)
        # a table one head wide (an even width dividing C: Wan's [1, S, 1, D] viewed as [1, S, D]) is read by every head
        table_w = cos.shape[-1] if cos.dim() in (2, 3) else ch
        if table_w != ch and not (table_w > 0 and table_w % 2 == 0 and ch % table_w == 0):
            table_w = ch  # the check below says what is expected
        what = "one row of C cos values per token, or of D per token shared by the C / D heads (D even, dividing C)"
        cos, sin = _views("cos,sin", (bsz, seq, table_w), what, cos, sin)
        tables = (cos, *cos.stride()[:2], sin, *sin.stride()[:2])
    q_out, k_out = (torch.empty(q.shape, dtype=q.dtype, device=dev) for _ in range(2))  # contiguous
    if q.numel() > 0:
        # whole rows, ~4096 elements of q and as many of k per program (narrow rows packed, up to 64, to amortise
        # per-program overhead), 16 per lane: 12-45 % faster than the alternatives at LTX shapes (H200)
        pow2 = lambda n: 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds
        m, block_c = bsz * seq, pow2(max(ch, 2))
        block_m = max(1, min(64, 4096 // block_c, pow2(m)))
        num_warps = pow2(max(1, min(16, (block_m * block_c) // (_device_target(dev)[2] * 16))))
        _ltx_qk_norm_rope_kernel[(-(-m // block_m),)](  # absent operands go as None: the kernel leaves them out
            q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), q_weight, k_weight, *tables, *grid, q_out, k_out,
            m, bsz, ch, (ch % 6) // 2, 3 * (ch // 6), float(eps),
            CAST_BEFORE_WEIGHT=bool(cast_before_weight), TABLE_W=0 if coords is not None or table_w == ch else table_w,
            BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps,
        )  # fmt: skip
    return q_out, k_out


def _no_backward(fn: str, names: str, *tensors) -> None:
    """In grad mode, refuse an input that requires grad: the kernels have no backward."""
    for name, t in zip(names.split(","), tensors) if torch.is_grad_enabled() else ():
        if getattr(t, "requires_grad", False):
            raise RuntimeError(
                f"{fn}: {name} requires grad, but this Triton kernel has no backward (its outputs would carry no "
                f"grad_fn, and gradients would silently stop there); call {fn} under torch.no_grad() or "
                f"torch.inference_mode(), or use the PyTorch reference ({fn}_ref) where gradients are needed"
            )


def ltx_qk_rmsnorm_rope(q, k, q_weight, k_weight, eps, cos, sin, *, cast_before_weight=False):
    """LTX self-attention's ``apply_rotary_emb(norm_q(q)), apply_rotary_emb(norm_k(k))`` in one launch. norm:
    ``torch.nn.RMSNorm(C, eps)`` over the whole row, weights [C] (or both None), output rounded to q's dtype;
    cast_before_weight True also rounds before the weight (the older composite form). q, k: [B, S, C]; cos/sin:
    [B or 1, S, C] or [S, C], or one head wide (D even dividing C). Returns contiguous (q_out, k_out). No backward."""
    _no_backward("ltx_qk_rmsnorm_rope", "q,k,q_weight,k_weight,cos,sin", q, k, q_weight, k_weight, cos, sin)
    return _qk_launch(q, k, q_weight, k_weight, eps, cos, sin, cast_before_weight)


def ltx_qk_rmsnorm_rope_coords(q, k, q_weight, k_weight, eps, coords, freqs, *, cast_before_weight=False):
    """``ltx_qk_rmsnorm_rope`` with cos/sin computed in the kernel. coords: [B or 1, S, 3] or [S, 3], diffusers'
    LTXVideoRotaryPosEmbed ``grid`` before ``* 2 - 1``; freqs: ``ltx_rope_freqs(C, theta)``. No backward."""
    names = "q,k,q_weight,k_weight,coords,freqs"
    _no_backward("ltx_qk_rmsnorm_rope_coords", names, q, k, q_weight, k_weight, coords, freqs)
    return _qk_coords_launch(q, k, q_weight, k_weight, eps, coords, freqs, cast_before_weight)


def ltx_rope_freqs(dim: int, theta: float = 10000.0, device=None) -> Tensor:
    """LTXVideoRotaryPosEmbed's fp32 frequencies [dim // 6] (times pi / 2), computed identically."""
    lo, hi = math.log(1.0, theta), math.log(theta, theta)  # 0 and 1, as diffusers computes them
    exponents = torch.linspace(lo, hi, dim // 6, device=device, dtype=torch.float32)
    return theta**exponents * math.pi / 2.0


def ltx_cos_sin_from_coords(coords: Tensor, freqs: Tensor, dim: int, out_dtype: torch.dtype = torch.float32):
    """(cos, sin), each [B, S, dim], as LTXVideoRotaryPosEmbed returns them: fp32 angles, pair p = frequency
    p // 3 on axis p % 3, first dim % 6 channels identity; cos and sin evaluated in out_dtype."""
    coords = coords.unsqueeze(0) if coords.dim() == 2 else coords
    angles = freqs.float() * (coords.float().unsqueeze(-1) * 2 - 1)  # [B, S, 3, F]
    angles = angles.transpose(-1, -2).flatten(2).to(out_dtype)  # [B, S, 3F], frequency-major
    cos, sin = angles.cos().repeat_interleave(2, dim=-1), angles.sin().repeat_interleave(2, dim=-1)
    pad = (*cos.shape[:-1], dim % 6)  # the first dim % 6 channels: cos 1, sin 0
    cos = torch.cat([torch.ones(pad, dtype=cos.dtype, device=cos.device), cos], dim=-1)
    return cos, torch.cat([torch.zeros(pad, dtype=sin.dtype, device=sin.device), sin], dim=-1)


def ltx_qk_rmsnorm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin, cast_before_weight=False):
    reps = q.shape[-1] // cos.shape[-1]  # a per-head cos/sin table is repeated over the heads
    cos, sin = (t.repeat(*((1,) * (t.dim() - 1)), reps) for t in (cos, sin))
    outs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        xf = x.double() if x.dtype == torch.float64 else x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # torch.nn.RMSNorm, rounded where it rounds
        if w is not None:
            y = (y.to(x.dtype).to(xf.dtype) if cast_before_weight else y) * w.to(xf.dtype)
        y = y.to(x.dtype).to(xf.dtype)
        even, odd = y.unflatten(-1, (-1, 2)).unbind(-1)  # then interleaved RoPE, as rope.ltx_rope_ref
        outs.append((y * cos.to(xf.dtype) + torch.stack([-odd, even], -1).flatten(-2) * sin.to(xf.dtype)).to(x.dtype))
    return tuple(outs)


def ltx_qk_rmsnorm_rope_coords_ref(q, k, q_weight, k_weight, eps, coords, freqs, cast_before_weight=False):
    f = torch.float64 if q.dtype == torch.float64 else torch.float32
    cos, sin = ltx_cos_sin_from_coords(coords, freqs, q.shape[-1], f)
    return ltx_qk_rmsnorm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin, cast_before_weight)


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Check the fused q/k RMSNorm + RoPE kernel against float64 references.")
    p.add_argument("--tokens", type=int, default=12, help="tokens per sample S (default 12; batch is 2)")
    p.add_argument("--width", type=int, default=2048, help="channels C of q/k (default 2048, LTX-Video)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.width % 2 or min(a.width, a.tokens) < 1:
        p.error("--width must be even and positive, --tokens positive")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not (torch.cuda.is_available() or interpreting):
        p.exit(2, "no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter\n")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    g, (b, s, c), dev = torch.Generator().manual_seed(a.seed), (2, a.tokens, a.width), "cpu" if interpreting else "cuda"
    q, k = (2 * torch.randn(2, b, s, c, generator=g)).to(dev, dtype)
    qw, kw = (1 + 0.2 * torch.randn(2, c, generator=g)).to(dev, dtype)
    coords, freqs = torch.rand(b, s, 3, generator=g).to(dev), ltx_rope_freqs(c, device=dev)
    cos, sin = ltx_cos_sin_from_coords(coords, freqs, c)
    f64 = [t.double() for t in (q, k, qw, kw)]
    # error budget relative to the values: a few roundings of the dtype plus the fp32 cos/sin of large angles
    tol, report = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}[dtype], {}
    for name, outs, refs in (  # kernel, float64 reference
        ("ltx_qk_rmsnorm_rope", ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, cos, sin), ltx_qk_rmsnorm_rope_ref(*f64, 1e-5, cos.double(), sin.double())),
        ("ltx_qk_rmsnorm_rope_coords", ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, coords, freqs), ltx_qk_rmsnorm_rope_coords_ref(*f64, 1e-5, coords, freqs)),
    ):  # fmt: skip
        out, ref = torch.cat(outs).double().cpu(), torch.cat(refs).cpu()
        err = ((out - ref).abs() / (1 + ref.abs())).max().item()
        report[name] = {"max_rel_err": err, "ok": err <= tol and bool(torch.isfinite(out).all())}
    ok = all(v["ok"] for v in report.values())
    print(json.dumps({"device": dev, "dtype": a.dtype, "shape": [b, s, c], "checks": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

try:  # kernel_runtime.py beside this file adds launch plans, torch.library ops and device checks
    import kernel_runtime
except ImportError:
    pass
else:
    kernel_runtime.accelerate(
        globals(), ltx_qk_rmsnorm_rope="_qk_launch", ltx_qk_rmsnorm_rope_coords="_qk_coords_launch"
    )

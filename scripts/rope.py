# SPDX-License-Identifier: Apache-2.0
"""Rotary position embeddings (RoPE), alone or fused with LTX-Video's q/k RMSNorm.

    interleaved (LTX-Video): out[2i]   = x[2i]   * cos[2i]   - x[2i+1] * sin[2i]
                             out[2i+1] = x[2i+1] * cos[2i+1] + x[2i]   * sin[2i+1]
    rotate-half (Llama/HF):  out = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin
    all arithmetic in fp32, one rounding to the input dtype at the end.

Public functions:

* ``ltx_rope(x, cos, sin)``: diffusers' ``apply_rotary_emb`` of ``transformer_ltx.py`` on x [B, S, C]
  (rows may be strided, e.g. a slice of a fused qkv projection), cos/sin [B or 1, S, C] (or [S, C]).
* ``rope_rotate_half(x, cos, sin)``: transformers' ``apply_rotary_pos_emb`` for one tensor, x [B, H, S, D]
  with any strides whose last dim is contiguous, cos/sin [S, D], [B or 1, S, D] or [B or 1, H or 1, S, D];
  or [.., D / 2], one value per channel pair (c, c + D / 2) (diffusers' split RoPE: LTX-2's tables).
* ``rope_interleaved(x, cos, sin)``: diffusers' ``apply_rotary_emb`` (pairs, ``use_real_unbind_dim=-1``, or a
  complex table) for x [B, H, S, D] with any strides whose last dim is contiguous; cos/sin per channel or per
  pair (the parts of a complex table), broadcast like rope_rotate_half's.
* ``ltx_qk_rmsnorm_rope(q, k, q_weight, k_weight, eps, cos, sin)``: LTX self-attention's
  ``apply_rotary_emb(norm_q(q))`` and ``apply_rotary_emb(norm_k(k))`` in one launch (RMSNorm across all
  heads, i.e. over the whole C-wide row); returns (q_out, k_out).
* ``ltx_qk_rmsnorm_rope_coords(q, k, q_weight, k_weight, eps, coords, freqs)``: the same, with cos/sin
  computed inside the kernel from the per-token grid coordinates [B or 1, S, 3] and the frequency
  vector [C // 6], so the 8 bytes per channel of fp32 cos/sin are never read from memory.
* ``ltx_rope_freqs(dim, theta)`` and ``ltx_cos_sin_from_coords(coords, freqs, dim)``: the frequency
  vector and the (cos, sin) pair exactly as diffusers' ``LTXVideoRotaryPosEmbed`` computes them.

Each ``*_ref`` function is the plain-PyTorch math the kernel replaces (run it on float64 inputs to
test). The file depends on torch and triton only; copy it into another project as is.
Run ``python rope.py --help``.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = [
    "ltx_rope",
    "rope_rotate_half",
    "rope_interleaved",
    "ltx_qk_rmsnorm_rope",
    "ltx_qk_rmsnorm_rope_coords",
    "ltx_rope_freqs",
    "ltx_cos_sin_from_coords",
    "ltx_rope_ref",
    "rope_rotate_half_ref",
    "rope_interleaved_ref",
    "ltx_qk_rmsnorm_rope_ref",
    "ltx_qk_rmsnorm_rope_coords_ref",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# cos/sin, weights, coords and freqs are read and converted to fp32 in the kernel: any float dtype.
_ANY_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The fused RMSNorm + RoPE kernels keep a whole row in registers (the norm needs the full row
# before anything can be written). 16384 channels over 16 warps is at most 32 fp32 values per lane
# and tensor; LTX-Video uses 2048.
_MAX_NORM_WIDTH = 16384
# The plain RoPE kernels are elementwise over pairs, so wide rows are split over a second grid
# axis in column chunks of at most this many elements (pairs never straddle a chunk: it is even).
_MAX_CHUNK = 4096
# Target elements per program and tensor: 2048 is one LTX row; bf16 in + out is 8 KiB per program.
_ELEMS_PER_PROGRAM = 2048


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _rotate_pairs(x, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """[BLOCK_M, BLOCK_C] -> the interleaved partner of every channel: (-x[2i+1], x[2i]).

    The row is loaded as one contiguous tile (16-byte vector loads) and split in registers: the
    reshape keeps each lane's pairs together, so split/join move no data between lanes.
    """
    even, odd = tl.split(tl.reshape(x, [BLOCK_M, BLOCK_C // 2, 2]))
    return tl.reshape(tl.join(-odd, even), [BLOCK_M, BLOCK_C])


@triton.jit
def _ltx_rope_kernel(
    X,
    x_sb,
    x_ss,  # input [B, S, C]: element strides of the batch and token dims; channels contiguous
    COS,
    c_sb,
    c_ss,  # cos [B or 1, S, C] (batch stride 0 when broadcast over the batch)
    SIN,
    s_sb,
    s_ss,  # sin, same layout rules as cos
    OUT,
    o_sb,
    o_ss,  # output [B, S, C]
    M,
    B,
    C,  # rows (B * S), batch size, channels
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # channels per program (even; the second grid axis walks the chunks)
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = tl.where(row_mask, rows, 0)  # keep masked-off rows' addresses in bounds
    # Row r is token r // B of sample r % B: the B rows that share a cos/sin row run side by side,
    # so a batch-broadcast cos/sin row is fetched from DRAM once and then hits in L2.
    b = (rows % B).to(tl.int64)
    s = (rows // B).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = row_mask[:, None] & (cols < C)[None, :]
    x = tl.load(X + (b * x_sb + s * x_ss)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(COS + (b * c_sb + s * c_ss)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(SIN + (b * s_sb + s * s_ss)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = x * c + _rotate_pairs(x, BLOCK_M, BLOCK_C) * sn
    tl.store(OUT + (b * o_sb + s * o_ss)[:, None] + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_rotate_half_kernel(
    X,
    x_sb,
    x_sh,
    x_ss,  # input [B, H, S, D]: element strides of batch, head, token; D contiguous
    COS,
    c_sb,
    c_sh,
    c_ss,  # cos broadcast to [B, H, S, D] (stride 0 on broadcast dims)
    SIN,
    s_sb,
    s_sh,
    s_ss,  # sin, same layout rules as cos
    OUT,
    o_sb,
    o_sh,
    o_ss,  # output [B, H, S, D]
    M,
    H,
    S,
    HALF,  # rows (B * H * S), heads, tokens, D // 2
    HALF_TABLES: tl.constexpr,  # cos/sin [.., D // 2]: one value per channel pair (c, c + D // 2), read for both
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # columns of each half per program (the second grid axis walks the chunks)
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = tl.where(row_mask, rows, 0)
    # Heads vary fastest: the H rows of one token share their cos/sin row ([B, S, D] broadcast over
    # heads, as transformers passes it), so a program's cos/sin loads hit the same lines.
    h = (rows % H).to(tl.int64)
    t = rows // H
    s = (t % S).to(tl.int64)
    b = (t // S).to(tl.int64)
    j = pid_c * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = row_mask[:, None] & (j < HALF)[None, :]
    j = j[None, :]
    xp = X + (b * x_sb + h * x_sh + s * x_ss)[:, None]
    cp = COS + (b * c_sb + h * c_sh + s * c_ss)[:, None]
    sp = SIN + (b * s_sb + h * s_sh + s * s_ss)[:, None]
    x1 = tl.load(xp + j, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF + j, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cp + j, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sp + j, mask=mask, other=0.0).to(tl.float32)
    if HALF_TABLES:
        c2 = c1
        s2 = s1
    else:
        c2 = tl.load(cp + HALF + j, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sp + HALF + j, mask=mask, other=0.0).to(tl.float32)
    op = OUT + (b * o_sb + h * o_sh + s * o_ss)[:, None]
    tl.store(op + j, (x1 * c1 - x2 * s1).to(OUT.dtype.element_ty), mask=mask)
    tl.store(op + HALF + j, (x2 * c2 + x1 * s2).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _rope_interleaved_kernel(
    X,
    x_sb,
    x_sh,
    x_ss,  # input [B, H, S, D]: element strides of batch, head, token; D contiguous
    COS,
    c_sb,
    c_sh,
    c_ss,
    c_sd,  # cos broadcast to [B, H, S, D] (or [B, H, S, D // 2]: PAIR_TABLES): strides, channels' last
    SIN,
    s_sb,
    s_sh,
    s_ss,
    s_sd,  # sin, same layout rules as cos
    OUT,
    o_sb,
    o_sh,
    o_ss,  # output [B, H, S, D]
    M,
    H,
    S,
    D,  # rows (B * H * S), heads, tokens, head dim
    PAIR_TABLES: tl.constexpr,  # one cos/sin value per channel pair (a complex table's parts), not per channel
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_C: tl.constexpr,  # channels per program (even; the second grid axis walks the chunks)
):
    pid_m = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = tl.where(row_mask, rows, 0)
    # Heads vary fastest: the H rows of one token share their cos/sin row (diffusers passes [S, D]).
    h = (rows % H).to(tl.int64)
    t = rows // H
    s = (t % S).to(tl.int64)
    b = (t // S).to(tl.int64)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = row_mask[:, None] & (cols < D)[None, :]
    tcols = (cols // 2 if PAIR_TABLES else cols).to(tl.int64)
    x = tl.load(X + (b * x_sb + h * x_sh + s * x_ss)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    cp = COS + (b * c_sb + h * c_sh + s * c_ss)[:, None] + (tcols * c_sd)[None, :]
    sp = SIN + (b * s_sb + h * s_sh + s * s_ss)[:, None] + (tcols * s_sd)[None, :]
    c = tl.load(cp, mask=mask, other=0.0).to(tl.float32)
    sn = tl.load(sp, mask=mask, other=0.0).to(tl.float32)
    out = x * c + _rotate_pairs(x, BLOCK_M, BLOCK_C) * sn
    op = OUT + (b * o_sb + h * o_sh + s * o_ss)[:, None] + cols[None, :]
    tl.store(op, out.to(OUT.dtype.element_ty), mask=mask)


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
    the angles of video RoPE (|a| <= ~2e4; tests/test_rope.py). tl.sin and tl.cos (libdevice / OCML) each
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
    b = (rows % B).to(tl.int64)  # batch fastest: see _ltx_rope_kernel
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


# --------------------------------------------------------------------------------------------
# Launcher helpers
# --------------------------------------------------------------------------------------------
# ---- shared block device begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _device_target(device: torch.device):
    """(backend, arch, warp_size) of the device, e.g. ("hip", "gfx942", 64) or ("cuda", 90, 32)."""
    if device.type == "cpu":
        return ("interpreter", None, 32)
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_target(index: int):
    # cached: asking the driver costs microseconds of host time on every launch
    with torch.cuda.device(index):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


# ---- shared block device end ----


# ---- shared block checks begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


def _check_tensor(name: str, t, dtypes, device: Optional[torch.device] = None, ref: str = "x"):
    """Refuse t unless it is a tensor of one of dtypes that this file's kernels can run on (_check_device)
    and, when device is given, on that device (ref: what the message calls the tensor that is there)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}; expected one of {names}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but {ref} is on {device}; move them to one device")
    _check_device(name, t)


def _check_last_contiguous(name: str, t: torch.Tensor):
    """Refuse a non-empty tensor whose last dimension (of more than one element) has a stride other than 1."""
    if t.numel() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")


# ---- shared block checks end ----


def _batch_table(name: str, t: torch.Tensor, batch: int, tokens: int, width: int, what: str) -> torch.Tensor:
    """Check a per-token table ([S, W] or [B or 1, S, W]) and return it as a [B, S, W] view
    (batch stride 0 when it is shared by the whole batch)."""
    if t.dim() == 2:
        t = t.unsqueeze(0)
    if t.dim() != 3 or t.shape[1] != tokens or t.shape[2] != width or t.shape[0] not in (1, batch):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected [{batch} or 1, {tokens}, {width}] or "
            f"[{tokens}, {width}] ({what})"
        )
    return t.expand(batch, tokens, width)


@functools.lru_cache(maxsize=1024)
def _launch_config(
    width: int, n_rows: int, warp_size: int, max_block: int, elems: int = _ELEMS_PER_PROGRAM, per_lane: int = 8
):
    """(BLOCK_M, BLOCK_C, num_warps) for row-wise kernels over `width`-wide rows.

    Reasons: a program should move about `elems` elements per tensor (2048: one LTX row; narrower
    rows are packed several to a program, up to 64, so that a program still moves a few KiB and
    the per-program overhead is amortised). Each lane should hold `per_lane` consecutive elements
    of a tensor: 8 is one 16-byte vector of bf16/fp16 (two of fp32), which is what makes the loads
    full-width; the warp count follows from the lane count (32 on NVIDIA and RDNA wave32, 64 on
    CDNA wave64), so a wave64 GPU gets half the warps for the same tile.
    """
    block_c = min(_next_pow2(max(width, 2)), max_block)
    block_m = max(1, min(64, elems // block_c, _next_pow2(max(n_rows, 1))))
    num_warps = max(1, min(16, (block_m * block_c) // (warp_size * per_lane)))
    return block_m, block_c, _next_pow2(num_warps)


# ---- shared block sizes begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a constexpr_function, microseconds per host call


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n; 1 for every n <= 1 (0 included)."""
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


# ---- shared block sizes end ----


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
_PLANS: dict = {}  # launch plans by call signature, for every launcher here (see _ltx_rope_launch)


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for d in reversed(tuple(shape)):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _ltx_rope_launch(x, cos, sin):
    """Check, configure and launch _ltx_rope_kernel; returns the output.

    The checks and the configuration depend only on the call's signature (each tensor's type, shape,
    strides, dtype and device), so they run once per signature (_ltx_rope_plan): the plan is kept and
    later calls with the same signature only allocate the output and launch.
    """
    try:
        key = ("ltx_rope", _sig(x), _sig(cos), _sig(sin))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _ltx_rope_plan(x, cos, sin)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, cos, sin)


def _ltx_rope_plan(x, cos, sin):
    """The checks and configuration of _ltx_rope_launch; returns run(x, cos, sin)."""
    _check_tensor("x", x, _SUPPORTED_DTYPES)
    dev = x.device
    _check_tensor("cos", cos, _ANY_FLOAT, dev, ref="the input")
    _check_tensor("sin", sin, _ANY_FLOAT, dev, ref="the input")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, S, C] (3 dims), got shape {tuple(x.shape)}")
    bsz, seq, ch = x.shape
    if ch % 2:
        raise ValueError(f"x has {ch} channels; interleaved RoPE needs an even channel count")
    # [B, S, C] views of the tables: the kernel gets the tables themselves (a view has their data
    # pointer) and the views' strides, which the signature fixes.
    cos_v = _batch_table("cos", cos, bsz, seq, ch, "one row of C cos values per token")
    sin_v = _batch_table("sin", sin, bsz, seq, ch, "one row of C sin values per token")
    for nm, t in (("x", x), ("cos", cos_v), ("sin", sin_v)):
        _check_last_contiguous(nm, t)
    shape_t, x_dtype = tuple(x.shape), x.dtype
    if x.numel() == 0:

        def run_empty(x, cos, sin):
            return torch.empty(shape_t, dtype=x_dtype, device=dev)

        return run_empty
    m = bsz * seq
    block_m, block_c, num_warps = _launch_config(ch, m, _device_target(dev)[2], _MAX_CHUNK)
    grid = (_cdiv(m, block_m), _cdiv(ch, block_c))
    o_strides = _contiguous_strides(shape_t)  # the output is contiguous
    launch = _Launch(
        _ltx_rope_kernel,
        grid,
        (
            None,
            x.stride(0),
            x.stride(1),
            None,
            cos_v.stride(0),
            cos_v.stride(1),
            None,
            sin_v.stride(0),
            sin_v.stride(1),
            None,
            o_strides[0],
            o_strides[1],
            m,
            bsz,
            ch,
        ),
        dict(BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps),
        (0, 3, 6, 9),
        dev,
    )
    like_x = _dense_like(x)

    def run(x, cos, sin):
        out = torch.empty_like(x) if like_x else torch.empty(shape_t, dtype=x_dtype, device=dev)
        launch(x, cos, sin, out)
        return out

    return run


def _rotate_half_table(name: str, t: torch.Tensor, shape) -> torch.Tensor:
    bsz, heads, seq, dim = shape
    orig = tuple(t.shape)
    if t.dim() == 3:  # [B, S, D]: transformers unsqueezes the head dim
        t = t.unsqueeze(1)
    elif t.dim() == 2:  # [S, D]
        t = t[None, None]
    ok = (
        t.dim() == 4 and t.shape[0] in (1, bsz) and t.shape[1] in (1, heads) and t.shape[2] == seq and t.shape[3] == dim
    )
    if not ok:
        raise ValueError(
            f"{name} has shape {orig}; expected [{seq}, {dim}], [{bsz} or 1, {seq}, {dim}] or "
            f"[{bsz} or 1, {heads} or 1, {seq}, {dim}] for x of shape {tuple(shape)}"
        )
    return t.expand(bsz, heads, seq, dim)


def _rope_rotate_half_launch(x, cos, sin):
    """Check, configure and launch _rope_rotate_half_kernel (a plan per call signature, as in
    _ltx_rope_launch); returns the output."""
    try:
        key = ("rope_rotate_half", _sig(x), _sig(cos), _sig(sin))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _rope_rotate_half_plan(x, cos, sin)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, cos, sin)


def _rope_rotate_half_plan(x, cos, sin):
    """The checks and configuration of _rope_rotate_half_launch; returns run(x, cos, sin)."""
    _check_tensor("x", x, _SUPPORTED_DTYPES)
    dev = x.device
    _check_tensor("cos", cos, _ANY_FLOAT, dev, ref="the input")
    _check_tensor("sin", sin, _ANY_FLOAT, dev, ref="the input")
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, S, D] (4 dims), got shape {tuple(x.shape)}")
    bsz, heads, seq, dim = x.shape
    if dim % 2:
        raise ValueError(f"x has head dim {dim}; rotate-half RoPE needs an even head dim")
    # one value per channel (width D) or per channel pair (c, c + D / 2) (width D / 2: diffusers' split RoPE)
    half_tables = dim > 0 and cos.dim() > 0 and cos.shape[-1] == dim // 2
    width = dim // 2 if half_tables else dim
    if half_tables and (sin.dim() == 0 or sin.shape[-1] != width):
        raise ValueError(
            f"cos and sin have shapes {tuple(cos.shape)} and {tuple(sin.shape)}; expected last dims {dim} (one "
            f"value per channel) or {dim // 2} (one per channel pair) for x of shape {tuple(x.shape)}"
        )
    # [B, H, S, width] views of the tables: the kernel gets the tables themselves (same data pointer)
    # and the views' strides, which the signature fixes.
    cos_v = _rotate_half_table("cos", cos, (bsz, heads, seq, width))
    sin_v = _rotate_half_table("sin", sin, (bsz, heads, seq, width))
    for nm, t in (("x", x), ("cos", cos_v), ("sin", sin_v)):
        _check_last_contiguous(nm, t)
    if x.numel() == 0:

        def run_empty(x, cos, sin):
            return torch.empty_like(x)

        return run_empty
    m = bsz * heads * seq
    half = dim // 2
    # A program covers BLOCK_H columns of both halves: the tile is sized on the half width (half
    # the usual elements, since each is paired with one from the other half), so each lane holds
    # about 8 consecutive columns of each half: one 16-byte bf16 vector from each.
    block_m, block_h, num_warps = _launch_config(
        half, m, _device_target(dev)[2], _MAX_CHUNK // 2, _ELEMS_PER_PROGRAM // 2
    )
    grid = (_cdiv(m, block_m), _cdiv(half, block_h))
    # The output is torch.empty_like(x) (x's layout when x is dense, as the eager expression returns):
    # its strides follow from x's type, shape and strides, which the signature fixes.
    o_stride = torch.empty_like(x).stride()
    launch = _Launch(
        _rope_rotate_half_kernel,
        grid,
        (
            None,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            None,
            cos_v.stride(0),
            cos_v.stride(1),
            cos_v.stride(2),
            None,
            sin_v.stride(0),
            sin_v.stride(1),
            sin_v.stride(2),
            None,
            o_stride[0],
            o_stride[1],
            o_stride[2],
            m,
            heads,
            seq,
            half,
        ),
        dict(HALF_TABLES=half_tables, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps),
        (0, 4, 8, 12),
        dev,
    )

    def run(x, cos, sin):
        out = torch.empty_like(x)
        launch(x, cos, sin, out)
        return out

    return run


def _rope_interleaved_launch(x, cos, sin):
    """Check, configure and launch _rope_interleaved_kernel (a plan per call signature, as in
    _ltx_rope_launch); returns the output."""
    try:
        key = ("rope_interleaved", _sig(x), _sig(cos), _sig(sin))
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _rope_interleaved_plan(x, cos, sin)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, cos, sin)


def _rope_interleaved_plan(x, cos, sin):
    """The checks and configuration of _rope_interleaved_launch; returns run(x, cos, sin)."""
    _check_tensor("x", x, _SUPPORTED_DTYPES)
    dev = x.device
    _check_tensor("cos", cos, _ANY_FLOAT, dev, ref="the input")
    _check_tensor("sin", sin, _ANY_FLOAT, dev, ref="the input")
    if x.dim() != 4:
        raise ValueError(f"x must be [B, H, S, D] (4 dims), got shape {tuple(x.shape)}")
    bsz, heads, seq, dim = x.shape
    if dim % 2:
        raise ValueError(f"x has head dim {dim}; interleaved RoPE needs an even head dim")
    _check_last_contiguous("x", x)
    if cos.shape[-1] != sin.shape[-1] or cos.shape[-1] not in (dim, dim // 2):
        raise ValueError(
            f"cos and sin have last dims {cos.shape[-1]} and {sin.shape[-1]}; expected {dim} (one value per "
            f"channel) or {dim // 2} (one per channel pair) for x of shape {tuple(x.shape)}"
        )
    pair = cos.shape[-1] != dim or dim == 0
    width = cos.shape[-1]
    # [B, H, S, width] views of the tables: the kernel gets the tables themselves and the views' strides
    cos_v = _rotate_half_table("cos", cos, (bsz, heads, seq, width))
    sin_v = _rotate_half_table("sin", sin, (bsz, heads, seq, width))
    if x.numel() == 0:

        def run_empty(x, cos, sin):
            return torch.empty_like(x)

        return run_empty
    m = bsz * heads * seq
    block_m, block_c, num_warps = _launch_config(dim, m, _device_target(dev)[2], _MAX_CHUNK)
    grid = (_cdiv(m, block_m), _cdiv(dim, block_c))
    o_stride = torch.empty_like(x).stride()  # x's layout when x is dense: fixed by the signature
    launch = _Launch(
        _rope_interleaved_kernel,
        grid,
        (
            None,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            None,
            cos_v.stride(0),
            cos_v.stride(1),
            cos_v.stride(2),
            cos_v.stride(3),
            None,
            sin_v.stride(0),
            sin_v.stride(1),
            sin_v.stride(2),
            sin_v.stride(3),
            None,
            o_stride[0],
            o_stride[1],
            o_stride[2],
            m,
            heads,
            seq,
            dim,
        ),
        dict(PAIR_TABLES=pair, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps),
        (0, 4, 9, 14),
        dev,
    )

    def run(x, cos, sin):
        out = torch.empty_like(x)
        launch(x, cos, sin, out)
        return out

    return run


def _qk_common_checks(q, k, q_weight, k_weight, eps):
    _check_tensor("q", q, _SUPPORTED_DTYPES)
    dev = q.device
    _check_tensor("k", k, _SUPPORTED_DTYPES, dev, ref="the input")
    if q.dim() != 3:
        raise ValueError(f"q must be [B, S, C] (3 dims), got shape {tuple(q.shape)}")
    if k.shape != q.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)}; they must match")
    if k.dtype != q.dtype:
        raise TypeError(f"k has dtype {_dtype_name(k.dtype)} but q has dtype {_dtype_name(q.dtype)}; they must match")
    ch = q.shape[-1]
    if ch % 2:
        raise ValueError(f"q has {ch} channels; interleaved RoPE needs an even channel count")
    if ch > _MAX_NORM_WIDTH:
        raise ValueError(
            f"q has {ch} channels; the fused RMSNorm + RoPE kernels support at most {_MAX_NORM_WIDTH} "
            "(unsupported width: use an RMSNorm kernel followed by ltx_rope)"
        )
    if (q_weight is None) != (k_weight is None):
        raise ValueError("q_weight and k_weight must both be tensors or both be None")
    for nm, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None:
            _check_tensor(nm, w, _ANY_FLOAT, dev, ref="the input")
            if w.dim() != 1 or w.shape[0] != ch:
                raise ValueError(f"{nm} must have shape [{ch}] (the channel count of q), got {tuple(w.shape)}")
            if ch > 1 and w.stride(0) != 1:
                raise ValueError(f"{nm} must be contiguous")
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    _check_last_contiguous("q", q)
    _check_last_contiguous("k", k)


def _qk_launch(q, k, q_weight, k_weight, eps, cos, sin, coords, freqs, cast_before_weight):
    """Shared launcher of the two fused q/k kernels (cos/sin given, or coords/freqs given); a plan
    per call signature, as in _ltx_rope_launch."""
    try:
        key = (
            "qk",
            _sig(q),
            _sig(k),
            q_weight if q_weight is None else _sig(q_weight),
            k_weight if k_weight is None else _sig(k_weight),
            type(eps),
            eps,
            cos if cos is None else _sig(cos),
            sin if sin is None else _sig(sin),
            coords if coords is None else _sig(coords),
            freqs if freqs is None else _sig(freqs),
            cast_before_weight,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _qk_plan(q, k, q_weight, k_weight, eps, cos, sin, coords, freqs, cast_before_weight)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(q, k, q_weight, k_weight, cos, sin, coords, freqs)


def _qk_plan(q, k, q_weight, k_weight, eps, cos, sin, coords, freqs, cast_before_weight):
    """The checks and configuration of _qk_launch; returns run(q, k, q_weight, k_weight, cos, sin,
    coords, freqs)."""
    _qk_common_checks(q, k, q_weight, k_weight, eps)
    dev = q.device
    bsz, seq, ch = q.shape
    from_coords = coords is not None
    # [B, S, W] views of the tables: the kernel gets the tables themselves (same data pointer) and
    # the views' strides, which the signature fixes.
    if from_coords:
        _check_tensor("coords", coords, _ANY_FLOAT, dev, ref="the input")
        _check_tensor("freqs", freqs, _ANY_FLOAT, dev, ref="the input")
        coords_v = _batch_table("coords", coords, bsz, seq, 3, "the (frame, height, width) grid coordinate per token")
        if freqs.dim() != 1 or freqs.shape[0] != ch // 6:
            raise ValueError(
                f"freqs has shape {tuple(freqs.shape)}; expected [{ch // 6}] (C // 6 frequencies for C = {ch})"
            )
    else:
        _check_tensor("cos", cos, _ANY_FLOAT, dev, ref="the input")
        _check_tensor("sin", sin, _ANY_FLOAT, dev, ref="the input")
        # a table one head wide (an even width dividing C: Wan's [1, S, 1, D] tables viewed as [1, S, D]) is
        # read in place by every head; any other width must be C
        tw = cos.shape[-1] if cos.dim() in (2, 3) else ch
        if tw != ch and not (tw > 0 and tw % 2 == 0 and ch % tw == 0):
            tw = ch  # the check below says what is expected
        what = (
            "one row of C cos values per token, or of D values per token shared by the C / D heads (D even, dividing C)"
        )
        cos_v = _batch_table("cos", cos, bsz, seq, tw, what)
        sin_v = _batch_table("sin", sin, bsz, seq, tw, what.replace("cos", "sin"))
        _check_last_contiguous("cos", cos_v)
        _check_last_contiguous("sin", sin_v)
    shape_t, dtype = tuple(q.shape), q.dtype
    if q.numel() == 0:

        def run_empty(q, k, q_weight, k_weight, cos, sin, coords, freqs):
            return (torch.empty(shape_t, dtype=dtype, device=dev), torch.empty(shape_t, dtype=dtype, device=dev))

        return run_empty
    m = bsz * seq
    # About 4096 elements of each of q and k per program (two LTX rows), 16 per lane (two 16-byte vectors
    # of each): 12-16 % faster than 2048 per program, 15-45 % faster than 8 or 32 per lane or 8192-16384
    # per program, at LTX shapes on an H200.
    block_m, block_c, num_warps = _launch_config(
        ch, m, _device_target(dev)[2], _MAX_NORM_WIDTH, 2 * _ELEMS_PER_PROGRAM, per_lane=16
    )
    grid = (_cdiv(m, block_m),)
    has_w = q_weight is not None
    # Absent tensors stay None: the kernel leaves out every use of them.
    table = not from_coords
    args, slots = _kernel_args(
        [True, q.stride(0), q.stride(1)],
        [True, k.stride(0), k.stride(1)],
        [has_w],  # QW
        [has_w],  # KW
        [table, *((cos_v.stride(0), cos_v.stride(1)) if table else (0, 0))],
        [table, *((sin_v.stride(0), sin_v.stride(1)) if table else (0, 0))],
        [from_coords, *(coords_v.stride()[:3] if from_coords else (0, 0, 0))],
        [from_coords, freqs.stride(0) if from_coords else 0],
        [True],  # QO
        [True],  # KO
        m,
        bsz,
        ch,
        (ch % 6) // 2,
        3 * (ch // 6),
        float(eps),
    )
    config = dict(
        CAST_BEFORE_WEIGHT=bool(cast_before_weight),
        TABLE_W=0 if from_coords or tw == ch else tw,
        BLOCK_M=block_m,
        BLOCK_C=block_c,
        num_warps=num_warps,
    )
    launch = _Launch(_ltx_qk_norm_rope_kernel, grid, args, config, slots, dev)
    like_q = _dense_like(q)  # k has q's shape and dtype

    def run(q, k, q_weight, k_weight, cos, sin, coords, freqs):
        if like_q:
            q_out, k_out = torch.empty_like(q), torch.empty_like(q)
        else:
            q_out = torch.empty(shape_t, dtype=dtype, device=dev)
            k_out = torch.empty(shape_t, dtype=dtype, device=dev)
        launch(q, k, q_weight, k_weight, cos, sin, coords, freqs, q_out, k_out)
        return q_out, k_out

    return run


# ---- launch block begin: the same in every kernel file (tests/test_launch.py compares the copies) ----
# Launching with little host time. Triton's JIT binds and specialises every argument on every call,
# which costs more host time than the launch itself. A launcher here checks a call and picks its
# configuration once per call signature, keeps the result (a plan holding a _Launch), and later calls
# with that signature only allocate their outputs and hand the data pointers to the compiled kernel.
_PLAN_CACHE_SIZE = 4096  # plans kept per kernel file; the cache is emptied when it is full


def _remember(plans: dict, key, plan):
    if len(plans) >= _PLAN_CACHE_SIZE:
        plans.clear()  # many distinct shapes (dynamic sizes): a new plan costs one slow call
    plans[key] = plan
    return plan


def _sig(t):
    """What a plan depends on about a tensor argument (None stays None)."""
    return None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device)


def _kernel_args(*operands):
    """A kernel's positional arguments and the launch slots of its tensors, from its operands in order: a
    scalar, or a list [present, *strides] for a tensor followed by its strides. Returns (args, slots):
    args with None in every tensor position (the plan's calls pass the tensors), slots the positions of the
    tensors in order, None for one that is not present (it stays None: the kernel leaves it out)."""
    args, slots = [], []
    for op in operands:
        if type(op) is list:
            slots.append(len(args) if op[0] else None)
            args += [None, *op[1:]]
        else:
            args.append(op)
    return tuple(args), slots


# How @triton.jit decorated this file's kernels above: for Triton's interpreter, or compiled for a GPU, as
# TRITON_INTERPRET said when the module was imported (the decoration cannot change afterwards).
_KERNELS_INTERPRETED = _interpreting()


def _check_device(name: str, t) -> None:
    """Refuse a tensor that this file's kernels cannot run on, with a clear error: a meta tensor (no data);
    a CPU tensor without the interpreter; any tensor once TRITON_INTERPRET has changed since the import
    (compiled kernels handed CPU tensors fail deep inside Triton, "0 active drivers"; interpreted ones
    handed GPU tensors are not what the caller meant). Run while a plan is made: the device is part of the
    plan's key, and a plan made while the two agreed keeps launching what it launched then. Exception: the
    ahead-of-time capture of scripts/check_amd_compile.py, which sets TRITON_INTERPRET and reports a GPU
    target for CPU tensors (``_device_target`` patched) to record launches without running them."""
    device = t.device
    if device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor: meta tensors hold no data (only a shape and a dtype), so no kernel can "
            "run on them; pass a tensor on the GPU (or on the CPU under the Triton interpreter)"
        )
    interpreting = _interpreting()
    if device.type == "cpu" and not interpreting:
        raise ValueError(
            f"{name} is a CPU tensor: Triton kernels run on a GPU (or on the CPU through the Triton "
            "interpreter: set TRITON_INTERPRET=1 before importing this module)"
            + (
                "; TRITON_INTERPRET was set when this module was imported and has been unset since"
                if _KERNELS_INTERPRETED
                else ""
            )
        )
    if interpreting != _KERNELS_INTERPRETED and not (
        device.type == "cpu" and _device_target(device)[0] != "interpreter"
    ):
        if interpreting:
            raise RuntimeError(
                f"TRITON_INTERPRET is set now but was not when {__name__} was imported: its kernels were "
                f"compiled for a GPU, not decorated for the Triton interpreter ({name} is on {device}). Set "
                "TRITON_INTERPRET=1 before importing the module, or unset it to run on a GPU"
            )
        raise RuntimeError(
            f"TRITON_INTERPRET was set when {__name__} was imported but is not now: its kernels were decorated "
            f"for the Triton interpreter, not compiled for a GPU ({name} is on {device}). Set TRITON_INTERPRET=1 "
            "before importing the module and leave it set, or unset it before importing the module to run "
            "compiled kernels"
        )


def _check_no_grad(fn: str, names, tensors, ref=None) -> None:
    """Refuse, in grad mode, a tensor input that requires grad: the kernels have no backward, so their
    outputs would carry no grad_fn and gradients would stop there without a word. Called on every eager
    call (grad mode is global state, not part of a plan's key): one call into torch, and in grad mode one
    attribute read per tensor. Under torch.compile the public functions call the registered ops, which
    have no autograd formula (torch refuses to differentiate through them) and run their launchers under
    no_grad, where this check passes."""
    if torch.is_grad_enabled():
        for name, t in zip(names, tensors):
            if t is not None and getattr(t, "requires_grad", False):  # (None first: the common absent input)
                raise RuntimeError(
                    f"{fn}: {name} requires grad, but this Triton kernel has no backward (its outputs would "
                    f"carry no grad_fn, and gradients would silently stop there); call {fn} under "
                    "torch.no_grad() or torch.inference_mode(), or use the PyTorch reference "
                    f"({ref or fn + '_ref'}) where gradients are needed"
                )


def _dense_like(x) -> bool:
    """Whether torch.empty_like(x) makes what torch.empty(x.shape, dtype=x.dtype) makes, with less host
    time: x is a plain tensor with exactly the contiguous strides (is_contiguous() allows any stride on
    a size-1 dim, and empty_like would copy it)."""
    if type(x) not in (torch.Tensor, torch.nn.Parameter) or not x.is_contiguous():
        return False
    expected, stride = [], 1
    for size in reversed(x.shape):
        expected.append(stride)
        stride *= max(size, 1)
    return x.stride() == tuple(reversed(expected))


# Where Triton keeps its launch hooks: triton.knobs.runtime from Triton 3.4, CompiledKernel before.
_HOOKS = getattr(getattr(triton, "knobs", None), "runtime", None) or triton.compiler.CompiledKernel


def _hooks_idle() -> bool:
    """Whether no Triton launch hook (a profiler's, say) is installed: the direct launch skips them."""
    for hook in (_HOOKS.launch_enter_hook, _HOOKS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # Triton 3.5+: an empty HookChain is idle
            return False
    return True


_DIRECT = {"ok": None}  # whether compiled kernels expose the runner interface used below (set once)


class _Launch:
    """``kernel[grid](*args, **kwargs)`` with everything but the tensors fixed.

    Built once per call signature; each call passes that call's tensors for the positions ``slots``
    of ``args``, in order (a slot of None: an argument this plan leaves as it is in ``args``, None for
    a tensor the kernel does not read; the call may pass anything there, or nothing where no slot after it is
    set). The first call goes through Triton's JIT, which compiles or finds the
    kernel and returns it; later calls hand the data pointers straight to that compiled kernel's
    runner, the call Triton's JIT itself ends with (Triton 3.3 to 3.9), without the JIT's per-call
    binding and specialisation of every argument. That call is a small function generated for the
    plan (``direct``), with every fixed argument written in as a constant.

    That is only right while the JIT would pick the same compiled kernel. The signature fixes every
    integer, dtype and constexpr the JIT specialises on; the one property of a tensor left is whether
    its address is 16-byte aligned, checked on each call (a pointer compiled as aligned must still
    be). AMD's buffer-load specialisation (storage under 2 GiB) needs no check: the offsets the
    kernel computes depend on shapes, strides and dtypes only, so if they fit in 32 bits for the
    first call they fit for every call with the same signature. Everything else goes through the JIT:
    the interpreter, tracing for torch.compile, launch hooks, a current device other than the
    tensors', a misaligned pointer, and a Triton whose compiled kernels lack the runner (a warning
    says so, once).
    """

    __slots__ = ("kernel", "grid", "args", "kwargs", "slots", "unset", "device", "direct")

    def __init__(self, kernel, grid, args, kwargs, slots, device):
        slots = list(slots)
        self.unset = 0
        while slots and slots[-1] is None:  # trailing positions left as they are: a call need not pass them
            slots.pop()
            self.unset += 1
        self.kernel, self.args, self.kwargs, self.slots = kernel, list(args), kwargs, tuple(slots)
        self.grid = tuple(grid)
        self.device = device.index if device.type == "cuda" else None
        # the generated direct launch: set once, in one store, after the first call (see _adopt)
        self.direct = None

    def __call__(self, *tensors):
        direct = self.direct
        if direct is None or not direct(*tensors):
            self._slow(tensors)

    def _slow(self, tensors):
        """Through Triton's JIT; the first such call also sets up the direct launch."""
        if len(tensors) < len(self.slots):
            raise TypeError(f"this launch takes {len(self.slots)} tensors, got {len(tensors)}")
        args = self.args[:]
        for i, t in zip(self.slots, tensors):
            if i is not None:
                args[i] = t
        fn = _as_launched(self.kernel)
        if self.device is None or fn is not self.kernel:
            fn[self.grid](*args, **self.kwargs)
            return
        with torch.cuda.device(self.device):
            compiled = fn[self.grid](*args, **self.kwargs)
        if self.direct is None and hasattr(compiled, "run") and _DIRECT["ok"] is not False:
            self._adopt(compiled, tensors)

    def _adopt(self, compiled, tensors):
        """Generate the direct launch of the compiled kernel the first call returned."""
        if _DIRECT["ok"] is None:
            _DIRECT["ok"] = all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
            if not _DIRECT["ok"]:
                import warnings

                warnings.warn(
                    f"Triton {triton.__version__}: compiled kernels lack the runner interface; "
                    "kernels launch through the JIT (more host time per call)",
                    stacklevel=4,
                )
        params = getattr(self.kernel, "params", None)  # None: not a JITFunction (a wrapper): keep the JIT path
        if not _DIRECT["ok"] or params is None:
            return
        bound = dict(zip(self.kernel.arg_names, self.args))
        full = [bound[p.name] if p.name in bound else self.kwargs.get(p.name, p.default) for p in params]
        # a pointer compiled as 16-byte aligned must stay aligned (mask 15); others may have any address
        masks = tuple(15 if i is not None and t.data_ptr() % 16 == 0 else 0 for i, t in zip(self.slots, tensors))
        ns = {
            "_run": compiled.run,
            "_function": compiled.function,
            "_metadata": compiled.packed_metadata,
            "_current_device": _current_device,
            "_current_stream": _current_stream,
            "_hooks_idle": _hooks_idle,
        }
        slot_of = {i: j for j, i in enumerate(self.slots) if i is not None}
        values = []
        for i, v in enumerate(full):
            if i in slot_of:
                values.append(f"p{slot_of[i]}")
            elif v is None or type(v) in (bool, int) or (type(v) is float and v == v and abs(v) != float("inf")):
                values.append(repr(v))  # repr of these reads back as the same value
            else:
                ns[f"_a{i}"] = v
                values.append(f"_a{i}")
        grid = self.grid + (1,) * (3 - len(self.grid))
        n = len(self.slots)
        aligned = [f"p{j}" for j in range(n) if masks[j]]
        src = "\n".join(
            [
                f"def direct({', '.join([f't{j}' for j in range(n)] + [f'_u{j}=None' for j in range(self.unset)])}):",
                f"    if _current_device() != {self.device!r} or not _hooks_idle():",
                "        return False",
            ]
            + [f"    p{j} = t{j}.data_ptr()" for j in range(n) if self.slots[j] is not None]
            + ([f"    if ({' | '.join(aligned)}) & 15:", "        return False"] if aligned else [])
            + [
                f"    _run({grid[0]!r}, {grid[1]!r}, {grid[2]!r}, _current_stream({self.device!r}), _function, _metadata, "
                f"None, None, None, {', '.join(values)})",
                "    return True",
                "",
            ]
        )
        exec(compile(src, f"<direct launch of {getattr(self.kernel, '__name__', 'a kernel')}>", "exec"), ns)
        direct = ns["direct"]
        direct.compiled_function, direct.masks = compiled.function, masks  # for inspection
        self.direct = direct


def _no_gpu(*_):
    return None


_current_device = getattr(torch._C, "_cuda_getDevice", _no_gpu)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _no_gpu)
# ---- launch block end ----


# --------------------------------------------------------------------------------------------
# torch.library ops: torch.compile traces through them instead of breaking the graph.
# --------------------------------------------------------------------------------------------
# ---- shared block ops begin: copies are identical (scripts/sync_shared_blocks.py) ----
# The ops' namespace comes from this file's module name (rtk_rmsnorm for rmsnorm.py), so a copy under another
# name (my_rmsnorm.py: rtk_my_rmsnorm) registers ops of its own, and torch.compile calls what the copy computes.
# A name is registered once per process: importing this very file again (importlib.reload) keeps the ops;
# other code under the same module name (another file, or this one edited since it registered them) raises
# (_claim) instead of leaving torch.compile to run the code registered first.
_NS = "rtk_" + "".join(c if c.isalnum() else "_" for c in __name__)


def _op_exists(name: str) -> bool:
    return hasattr(getattr(torch.ops, _NS), name) if hasattr(torch.ops, _NS) else False


def _source_digest():
    path = globals().get("__file__")
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


_SOURCE = _source_digest()


def _claim(name: str) -> bool:
    """Whether op NS::name is to be registered now: True if no op holds the name; False if this very file (the
    same bytes) registered it earlier in the process. Raises if other code holds it. Which file registered an
    op is kept beside the ops, on torch.ops.<namespace>."""
    owners = vars(getattr(torch.ops, _NS)).setdefault("_rtk_sources", {})
    if not _op_exists(name):
        owners[name] = _SOURCE
        return True
    if _SOURCE is not None and owners.get(name) == _SOURCE:
        return False
    raise RuntimeError(
        f"torch.library op {_NS}::{name} is registered already, by other code than {globals().get('__file__')} "
        f"(another file imported as module {__name__!r}, or this file before an edit). The op namespace comes "
        f"from the module's name: rename this file (e.g. my_{__name__.rsplit('.', 1)[-1]}.py) so that its ops get "
        "a namespace of their own, or restart Python to load the edited file"
    )


# Kernels launch through torch.library.wrap_triton while a triton_op body is traced: _TLS.tracing is set,
# in the tracing thread, by _triton_twin (registration block; a file without it never sets it).
_TLS = threading.local()


def _as_launched(fn):
    return torch.library.wrap_triton(fn) if getattr(_TLS, "tracing", False) else fn


# ---- shared block ops end ----


# ---- shared block registration begin: copies are identical (scripts/sync_shared_blocks.py) ----
# Each op is registered twice. custom_op: torch.compile calls back into the Python launcher through
# the dispatcher at run time. triton_op ("<name>_triton"): Inductor traces the launcher once and
# launches the Triton kernel from its own generated code: about 11x less time per call than the custom
# op for chained small fused norms on an H200 (examples/benchmark_launch_overhead_h200.json). The custom op
# serves the Triton interpreter (Inductor cannot run interpreted kernels) and symbolic sizes (the
# launcher picks its configuration from concrete sizes). torch.compile guards on _TRITON_OP.
_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton") and not _interpreting()


def _symbolic(args) -> bool:
    """Whether a tensor among args (or in a list among args) has a symbolic size or stride."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride())):
                return True
    return False


def _triton_twin(impl, name: str):
    """The body of the triton_op registration: impl with its kernels launched through wrap_triton.
    Traced with symbolic sizes (dynamic shapes) it defers to the custom op, which runs the launcher
    on real tensors at run time."""

    @functools.wraps(impl)
    def body(*args, **kwargs):
        if _symbolic(args) or _symbolic(kwargs.values()):
            return getattr(getattr(torch.ops, _NS), name)(*args, **kwargs)
        outer, _TLS.tracing = getattr(_TLS, "tracing", False), True
        try:
            return impl(*args, **kwargs)
        finally:
            _TLS.tracing = outer

    return body


def _register(name: str, impl, fake):
    """Register impl as custom op NS::name (with its fake) and, where available, as triton op
    NS::name_triton. Re-importing this very file (as importlib.reload does) keeps the first registration;
    other code registering the same name raises (_claim)."""
    if _claim(name):
        torch.library.custom_op(f"{_NS}::{name}", mutates_args=())(impl).register_fake(fake)
    if _TRITON_OP and _claim(name + "_triton"):
        torch.library.triton_op(f"{_NS}::{name}_triton", mutates_args=())(_triton_twin(impl, name))


def _compile_op(name: str):
    """The op that torch.compile records (see _TRITON_OP)."""
    return getattr(getattr(torch.ops, _NS), name + "_triton" if _TRITON_OP else name)


# ---- shared block registration end ----


def _ltx_rope_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _ltx_rope_launch(x, cos, sin)


def _ltx_rope_op_fake(x, cos, sin):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_register("ltx_rope", _ltx_rope_op, _ltx_rope_op_fake)


def _rope_rotate_half_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rope_rotate_half_launch(x, cos, sin)


def _rope_rotate_half_op_fake(x, cos, sin):
    return torch.empty_like(x)


_register("rope_rotate_half", _rope_rotate_half_op, _rope_rotate_half_op_fake)


def _rope_interleaved_op(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return _rope_interleaved_launch(x, cos, sin)


_register("rope_interleaved", _rope_interleaved_op, _rope_rotate_half_op_fake)


def _ltx_qk_rmsnorm_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _qk_launch(q, k, q_weight, k_weight, eps, cos, sin, None, None, cast_before_weight)


def _qk_fake(q, k, q_weight, k_weight, eps, table_a, table_b, cast_before_weight):
    """The fake of both q/k ops (tables: cos and sin, or coords and freqs)."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device)


_register("ltx_qk_rmsnorm_rope", _ltx_qk_rmsnorm_rope_op, _qk_fake)


def _ltx_qk_rmsnorm_rope_coords_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    eps: float,
    coords: torch.Tensor,
    freqs: torch.Tensor,
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _qk_launch(q, k, q_weight, k_weight, eps, None, None, coords, freqs, cast_before_weight)


_register("ltx_qk_rmsnorm_rope_coords", _ltx_qk_rmsnorm_rope_coords_op, _qk_fake)


def _eps_arg(eps) -> float:
    """eps for the compiled path's op: float(True) would hide a bool from the launcher's check."""
    if isinstance(eps, bool):
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return float(eps)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def ltx_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers LTX-Video ``apply_rotary_emb(x, (cos, sin))``: interleaved-pair RoPE, fp32 math.

    x: [B, S, C] fp16/bf16/fp32, C even, channels contiguous (rows may be strided: a slice of a
    fused qkv output is read in place). cos/sin: [B or 1, S, C] or [S, C], any float dtype (fp32
    from LTXVideoRotaryPosEmbed). Returns a contiguous [B, S, C] tensor of x's dtype.
    The kernel has no backward: in grad mode, an input that requires grad raises RuntimeError (call it
    under torch.no_grad() / torch.inference_mode(), or use ltx_rope_ref where gradients are needed).
    """
    if torch.compiler.is_compiling():
        return _compile_op("ltx_rope")(x, cos, sin)
    _check_no_grad("ltx_rope", ("x", "cos", "sin"), (x, cos, sin))
    return _ltx_rope_launch(x, cos, sin)  # eager: skip the custom-op dispatcher's overhead


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers ``x * cos + rotate_half(x) * sin`` with fp32 math and one rounding.

    x: [B, H, S, D], any strides with a contiguous last dim (e.g. the [B, S, H, D] -> [B, H, S, D]
    transpose of a projection). cos/sin: [S, D], [B or 1, S, D] (as transformers' rotary embedding
    returns them; the head dim is broadcast) or [B or 1, H or 1, S, D], any float dtype; or the same with
    last dim D / 2, one value for channels c and c + D / 2 (diffusers' apply_split_rotary_emb tables,
    [B, H, S, D / 2]: read in place, never doubled). The output has x's dtype, and x's layout when x is
    dense.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see ltx_rope).
    """
    if torch.compiler.is_compiling():
        return _compile_op("rope_rotate_half")(x, cos, sin)
    _check_no_grad("rope_rotate_half", ("x", "cos", "sin"), (x, cos, sin))
    return _rope_rotate_half_launch(x, cos, sin)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers ``apply_rotary_emb`` for x [B, H, S, D]: channel pairs (2i, 2i+1) rotated, fp32 math, one
    rounding. x: any strides with a contiguous last dim (a transpose of [B, S, H, D] is read in place).
    cos/sin: [S, W], [B or 1, S, W] or [B or 1, H or 1, S, W], any float dtype and any strides, with W = D
    (one value per channel, as use_real=True tables hold them) or W = D // 2 (one per channel pair: the
    real and imaginary parts of a complex table, ``torch.view_as_real(freqs)[..., 0]`` and ``[..., 1]``).
    The output has x's dtype, and x's layout when x is dense.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see ltx_rope).
    """
    if torch.compiler.is_compiling():
        return _compile_op("rope_interleaved")(x, cos, sin)
    _check_no_grad("rope_interleaved", ("x", "cos", "sin"), (x, cos, sin))
    return _rope_interleaved_launch(x, cos, sin)


def ltx_qk_rmsnorm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    cast_before_weight: bool = False,
):
    """LTX self-attention's ``apply_rotary_emb(norm_q(q)), apply_rotary_emb(norm_k(k))`` in one launch.

    norm_q/norm_k are ``torch.nn.RMSNorm(C, eps)`` over the whole row (all heads at once) with
    weights q_weight/k_weight ([C], or both None). The norm's output is rounded to q's dtype (the
    module returns it in that dtype), then RoPE runs in fp32 and rounds once. ``cast_before_weight``
    selects where the norm rounds: False (default) multiplies the weight in fp32 and rounds once, as
    the fused ``torch.nn.functional.rms_norm`` of current PyTorch does; True also rounds the
    normalised row to the dtype before the weight, as the older composite implementation did.
    q, k: [B, S, C] with the same shape and dtype, each with its own row strides.
    cos/sin: [B or 1, S, C] or [S, C]; or one head wide, [B or 1, S, D] or [S, D] with D even and dividing
    C, read in place by each of the C / D heads (Wan's [1, S, 1, D] tables, viewed as [1, S, D]: no
    expanded copy). Returns contiguous (q_out, k_out).
    No backward: in grad mode, an input that requires grad raises RuntimeError (see ltx_rope).
    """
    if torch.compiler.is_compiling():
        return _compile_op("ltx_qk_rmsnorm_rope")(
            q, k, q_weight, k_weight, _eps_arg(eps), cos, sin, bool(cast_before_weight)
        )
    _check_no_grad(
        "ltx_qk_rmsnorm_rope", ("q", "k", "q_weight", "k_weight", "cos", "sin"), (q, k, q_weight, k_weight, cos, sin)
    )
    return _qk_launch(q, k, q_weight, k_weight, eps, cos, sin, None, None, cast_before_weight)


def ltx_qk_rmsnorm_rope_coords(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    eps: float,
    coords: torch.Tensor,
    freqs: torch.Tensor,
    *,
    cast_before_weight: bool = False,
):
    """``ltx_qk_rmsnorm_rope`` with cos/sin computed in the kernel (no cos/sin tensors read).

    coords: [B or 1, S, 3] or [S, 3], the per-token (frame, height, width) coordinates exactly as
    diffusers' LTXVideoRotaryPosEmbed builds its ``grid`` (after rope_interpolation_scale and the
    base sizes, before ``* 2 - 1``). freqs: [C // 6], ``ltx_rope_freqs(C, theta)``. The first C % 6
    channels are identity (cos 1, sin 0); channel pair p after them uses freqs[p // 3] on axis p % 3.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see ltx_rope).
    """
    if torch.compiler.is_compiling():
        return _compile_op("ltx_qk_rmsnorm_rope_coords")(
            q, k, q_weight, k_weight, _eps_arg(eps), coords, freqs, bool(cast_before_weight)
        )
    _check_no_grad(
        "ltx_qk_rmsnorm_rope_coords",
        ("q", "k", "q_weight", "k_weight", "coords", "freqs"),
        (q, k, q_weight, k_weight, coords, freqs),
    )
    return _qk_launch(q, k, q_weight, k_weight, eps, None, None, coords, freqs, cast_before_weight)


def ltx_rope_freqs(dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """The fp32 frequency vector [dim // 6] of LTXVideoRotaryPosEmbed (already times pi / 2),
    computed with the same operations in the same order, so the values are identical."""
    exponents = torch.linspace(
        math.log(1.0, theta), math.log(theta, theta), dim // 6, device=device, dtype=torch.float32
    )
    return theta**exponents * math.pi / 2.0


def ltx_cos_sin_from_coords(
    coords: torch.Tensor, freqs: torch.Tensor, dim: int, out_dtype: torch.dtype = torch.float32
):
    """(cos, sin), each [B, S, dim], as LTXVideoRotaryPosEmbed returns them for this grid.

    coords: [B, S, 3] (or [S, 3]) grid coordinates before ``* 2 - 1``; freqs: [dim // 6]. The angles
    are computed in fp32 exactly as diffusers does (pair p = frequency p // 3 on axis p % 3); cos and
    sin are then evaluated in ``out_dtype`` (fp32 reproduces diffusers; float64 gives the exact
    cos/sin of the fp32 angles, for testing).
    """
    if coords.dim() == 2:
        coords = coords.unsqueeze(0)
    angles = freqs.float() * (coords.float().unsqueeze(-1) * 2 - 1)  # [B, S, 3, F]
    angles = angles.transpose(-1, -2).flatten(2).to(out_dtype)  # [B, S, 3F], frequency-major
    cos = angles.cos().repeat_interleave(2, dim=-1)
    sin = angles.sin().repeat_interleave(2, dim=-1)
    pad = dim % 6
    if pad:
        shape = (*cos.shape[:-1], pad)
        cos = torch.cat([torch.ones(shape, dtype=cos.dtype, device=cos.device), cos], dim=-1)
        sin = torch.cat([torch.zeros(shape, dtype=sin.dtype, device=sin.device), sin], dim=-1)
    return cos, sin


# --------------------------------------------------------------------------------------------
# References: the plain-PyTorch math each kernel replaces (run them in float64 for testing)
# --------------------------------------------------------------------------------------------
def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def ltx_rope_ref(x, cos, sin):
    """diffusers' apply_rotary_emb: pairs (2i, 2i+1) rotated, math in fp32 (float64 for float64 x)."""
    f = _compute_dtype(x)
    xf = x.to(f)
    even, odd = xf.unflatten(-1, (-1, 2)).unbind(-1)
    partner = torch.stack([-odd, even], dim=-1).flatten(-2)
    return (xf * cos.to(f) + partner * sin.to(f)).to(x.dtype)


def rope_rotate_half_ref(x, cos, sin):
    """transformers' q * cos + rotate_half(q) * sin for x [B, H, S, D] (cos [B, S, D] gets the head dim; tables
    of width D / 2 hold one value per channel pair (c, c + D / 2): doubled)."""
    f = _compute_dtype(x)
    if x.shape[-1] and cos.shape[-1] * 2 == x.shape[-1]:
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    xf = x.to(f)
    first, second = xf.chunk(2, dim=-1)
    return (xf * cos.to(f) + torch.cat([-second, first], dim=-1) * sin.to(f)).to(x.dtype)


def rope_interleaved_ref(x, cos, sin):
    """diffusers' apply_rotary_emb (use_real_unbind_dim=-1) for x [B, H, S, D]: pairs (2i, 2i+1) rotated, math
    in fp32 (float64 for float64 x); cos/sin per channel [.., S, D] or per pair [.., S, D // 2]."""
    f = _compute_dtype(x)
    if cos.shape[-1] * 2 == x.shape[-1]:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    if cos.dim() == 3:  # [B, S, W]: the head dim is broadcast
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    elif cos.dim() == 2:  # [S, W]
        cos, sin = cos[None, None], sin[None, None]
    xf = x.to(f)
    even, odd = xf.unflatten(-1, (-1, 2)).unbind(-1)
    partner = torch.stack([-odd, even], dim=-1).flatten(-2)
    return (xf * cos.to(f) + partner * sin.to(f)).to(x.dtype)


def _rms_norm_module_ref(x, weight, eps, cast_before_weight):
    """torch.nn.RMSNorm(C, eps) forward: fp32 math (float64 for float64 x), output in x's dtype."""
    f = _compute_dtype(x)
    xf = x.to(f)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if cast_before_weight:
            y = y.to(x.dtype).to(f)
        y = y * weight.to(f)
    return y.to(x.dtype)


def ltx_qk_rmsnorm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin, cast_before_weight=False):
    """(apply_rotary_emb(norm_q(q)), apply_rotary_emb(norm_k(k))) as LTX's attention processor does (a
    per-head cos/sin table is repeated over the heads first)."""
    reps = q.shape[-1] // cos.shape[-1]
    if reps > 1:
        cos, sin = (t.repeat(*((1,) * (t.dim() - 1)), reps) for t in (cos, sin))
    return (
        ltx_rope_ref(_rms_norm_module_ref(q, q_weight, eps, cast_before_weight), cos, sin),
        ltx_rope_ref(_rms_norm_module_ref(k, k_weight, eps, cast_before_weight), cos, sin),
    )


def ltx_qk_rmsnorm_rope_coords_ref(q, k, q_weight, k_weight, eps, coords, freqs, cast_before_weight=False):
    """ltx_qk_rmsnorm_rope_ref with cos/sin from ltx_cos_sin_from_coords (fp32 angles as diffusers
    computes them; cos/sin themselves evaluated in float64 when q is float64)."""
    cos, sin = ltx_cos_sin_from_coords(coords, freqs, q.shape[-1], out_dtype=_compute_dtype(q))
    return ltx_qk_rmsnorm_rope_ref(q, k, q_weight, k_weight, eps, cos, sin, cast_before_weight)


# --------------------------------------------------------------------------------------------
# Self-check: python rope.py [--tokens S] [--width C] [--dtype bf16]
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description="Check the RoPE kernels against float64 references on random inputs.")
    p.add_argument("--tokens", type=int, default=12, help="tokens per sample S (default 12; batch is 2)")
    p.add_argument("--width", type=int, default=2048, help="channels C of q/k (default 2048, LTX-Video)")
    p.add_argument("--head-dim", type=int, default=64, help="head dim of the rotate-half check (default 64)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    if args.width % 2 or args.head_dim % 2 or args.width < 2 or args.tokens < 1:
        p.error("--width and --head-dim must be even and positive, --tokens positive")
    device = "cuda" if torch.cuda.is_available() and not _interpreting() else "cpu"
    if device == "cpu" and not _interpreting():
        print("no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter", file=sys.stderr)
        return 2
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    bsz, seq, ch = 2, args.tokens, args.width

    def rnd(*shape, scale=1.0, offset=0.0):
        return torch.randn(*shape, generator=g) * scale + offset

    q64, k64 = rnd(bsz, seq, ch, scale=2.0), rnd(bsz, seq, ch, scale=2.0)
    qw64, kw64 = rnd(ch, scale=0.2, offset=1.0), rnd(ch, scale=0.2, offset=1.0)
    coords = torch.rand(bsz, seq, 3, generator=g)  # distinct per sample
    freqs = ltx_rope_freqs(ch)
    cos, sin = ltx_cos_sin_from_coords(coords, freqs, ch)
    heads = 4
    x4 = rnd(bsz, seq, heads, args.head_dim).transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
    ang = rnd(bsz, seq, args.head_dim // 2, scale=3.0)
    cos_h, sin_h = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def dev(t, dt=dtype):
        return t.to(device=device, dtype=dt)

    q, k, qw, kw = dev(q64), dev(k64), dev(qw64), dev(kw64)
    q64, k64, qw64, kw64 = q.double().cpu(), k.double().cpu(), qw.double().cpu(), kw.double().cpu()
    f32 = torch.float32
    checks = {
        "ltx_rope": (ltx_rope(q, dev(cos, f32), dev(sin, f32)), ltx_rope_ref(q64, cos, sin)),
        "rope_rotate_half": (
            rope_rotate_half(dev(x4), dev(cos_h, f32), dev(sin_h, f32)),
            rope_rotate_half_ref(dev(x4).double().cpu(), cos_h, sin_h),
        ),
        "ltx_qk_rmsnorm_rope": (
            torch.cat(ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, dev(cos, f32), dev(sin, f32))),
            torch.cat(ltx_qk_rmsnorm_rope_ref(q64, k64, qw64, kw64, 1e-5, cos, sin)),
        ),
        "ltx_qk_rmsnorm_rope_coords": (
            torch.cat(ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, dev(coords, f32), dev(freqs, f32))),
            torch.cat(ltx_qk_rmsnorm_rope_coords_ref(q64, k64, qw64, kw64, 1e-5, coords, freqs)),
        ),
    }
    # Error budget relative to the magnitude of the values: a few roundings of the dtype (the
    # interpreter truncates to bf16, a full ulp) plus the fp32 cos/sin of large angles.
    tol = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}[dtype]
    report, ok = {}, True
    for name, (out, ref) in checks.items():
        out = out.double().cpu()
        err = ((out - ref).abs() / (1 + ref.abs())).max().item()
        good = bool(err <= tol) and bool(torch.isfinite(out).all())
        report[name] = {"max_rel_err": err, "ok": good}
        ok &= good
    print(
        json.dumps({"device": device, "dtype": args.dtype, "shape": [bsz, seq, ch], "checks": report, "ok": bool(ok)})
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

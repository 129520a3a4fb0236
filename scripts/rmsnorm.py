# SPDX-License-Identifier: Apache-2.0
"""RMSNorm over the last dimension, optionally fused with AdaLN modulation, a gated residual and FP8 output.

    h   = h + y * gate                                   (optional: gated residual, h returned too)
    out = cast(rms(x) [cast] * w) * (1 + scale) + shift  (weight and modulation optional)
    with rms(x) = x / sqrt(mean(x**2) + eps), all arithmetic in fp32;
    FP8 output: out8 = fp8(clamp(out / s, -fp8_max, fp8_max)), s given (per tensor) or
    s[row] = max|out[row]| / fp8_max computed in the kernel (per token).

One Triton kernel implements every variant; an operand a call leaves out is passed as None, which removes
every use of it when the kernel is compiled.
Public functions:

* ``rms_norm(x, weight=None, eps=1e-6, cast_before_weight=True, out_dtype=None)``:
  diffusers ``RMSNorm`` and Llama's ``LlamaRMSNorm`` (cast_before_weight=True), ``torch.nn.RMSNorm``
  (cast_before_weight=False); see the function's docstring.
* ``rms_norm_modulate(x, scale, shift, weight=None, eps=1e-6)``: ``rms_norm(x) * (1 + scale) + shift``,
  scale/shift broadcastable to x ([D], [B, 1, D] as in LTX-Video/DiT, or [B, S, D]).
* ``gated_residual_rms_norm_modulate(h, y, gate, scale, shift, ...)``: ``h = h + y * gate`` (gate may be
  None for a plain residual add) then ``rms_norm_modulate(h, ...)``; returns ``(h, out)``.
* ``fused_add_rms_norm(x, residual, weight, eps=1e-6, fp8=None, fp8_scale=None, fp8_dtype=None)``: the
  LLM decoder-layer step ``r = x + residual; y = rms_norm(r, weight)``; returns ``(y, r)``, or with FP8
  output ``(y_fp8, r)`` (fp8="per_tensor", given scale) / ``(y_fp8, r, scales)`` (fp8="per_token").

FP8 format: the launcher picks float8_e4m3fnuz (max 240) on gfx942 (MI300X, whose matrix cores use it)
and the OCP float8_e4m3fn (max 448) everywhere else (gfx950, gfx12, NVIDIA); ``fp8_dtype=`` forces one.
Values are saturated to +-fp8_max and rounded to nearest (ties to even): a finite input never gives NaN.
Where the GPU has an FP8 conversion instruction that Triton emits for the format (NVIDIA sm_89+ e4m3fn,
gfx942 e4m3fnuz, gfx950 e4m3fn from Triton 3.6) the kernel uses Triton's cast, 7-35 % faster on an H200
(examples/benchmark_fp8_native_vs_integer_h200.json); elsewhere, and in the interpreter, an
integer-arithmetic encoder stored through a uint8 view. tests/test_fp8_native.py checks that both give
the same bytes (passed on an NVIDIA H200; the AMD paths are compiled, not yet run on AMD hardware).

Each ``*_ref`` function beside them is the plain-PyTorch math the kernel replaces. The file depends on
torch and triton only; copy it into another project as is. Run ``python rmsnorm.py --help``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "rms_norm",
    "rms_norm_modulate",
    "gated_residual_rms_norm_modulate",
    "gated_residual_add",
    "fused_add_rms_norm",
    "rms_norm_ref",
    "rms_norm_modulate_ref",
    "gated_residual_rms_norm_modulate_ref",
    "gated_residual_add_ref",
    "fused_add_rms_norm_ref",
    "fp8_quantize_ref",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Rows up to this many elements are normalised from registers in one pass (one read, one write).
# Wider rows are processed in chunks of _CHUNK_N: a first pass accumulates the sum of squares, a
# second pass re-reads the row and normalises it. The cap keeps the per-thread register footprint
# bounded (16384 fp32 values over 16 warps of 32 or 64 lanes is 32 or 16 values per lane).
_MAX_FUSED_N = 16384
_CHUNK_N = 4096


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
# ---- shared block fp8_kernels begin: copies are identical (scripts/sync_shared_blocks.py) ----
@triton.jit
def _fp8_encode(v, FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_NAN: tl.constexpr):
    """The e4m3 code (0..255, int32) of fp32 v: saturated to +-FP8_MAX, rounded to nearest, ties to even.

    Built with integer and fp32 arithmetic, stored through a uint8 view of the FP8 tensor: no Triton FP8
    type is involved, so it compiles the same on every backend and Triton version (Triton 3.6 cannot
    lower fp32 -> e4m3fnuz on gfx950/gfx1201, nor store it in its interpreter) and every backend gives
    the same bits. FP8_MIN_EXP: fp32 biased exponent of the format's smallest normal (127 + 1 - bias).
    Infinities saturate, NaN gives the format's NaN code, and a zero is never negative (0x80 is NaN in
    e4m3fnuz).
    """
    is_nan = v != v
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal range: round the 23-bit mantissa to 3 bits (ties to even); a carry moves into the exponent
    code = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((FP8_MIN_EXP - 1) << 3)
    # below the smallest normal: multiples of 2**(FP8_MIN_EXP - 130), code = the multiple (0..8); adding
    # 1.5 * 2**23 rounds to an integer, ties to even; the scaling by a power of two is exact
    k = (tl.abs(v) * (2.0 ** (130 - FP8_MIN_EXP)) + 12582912.0) - 12582912.0
    code = tl.where(mag < (FP8_MIN_EXP << 23), k.to(tl.int32), code)
    code = code | tl.where(code != 0, sign, 0)
    return tl.where(is_nan, FP8_NAN, code)


@triton.jit
def _fp8_convert(v, OUT, FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_NAN: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 v -> the element type of OUT (FP8 or, when not NATIVE, the uint8 view of an FP8 tensor).

    NATIVE: saturate, then Triton's own cast (round to nearest even), which is one hardware conversion
    per two values where the target has one (NVIDIA sm_89+: cvt.rn.satfinite; gfx942: v_cvt_pk_fp8_f32;
    gfx950: v_cvt_scalef32_pk_fp8_f32); the clamp keeps NaN (PropagateNan.ALL) and makes infinities
    saturate whatever the instruction does out of range. Else _fp8_encode's integer version, about 20
    operations a value; the native cast makes the fused FP8 kernels 7-35 % faster on an H200
    (examples/benchmark_fp8_native_vs_integer_h200.json).
    """
    if NATIVE:
        v = tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        # what rounds to zero becomes +0, as in _fp8_encode (no -0: 0x80 is NaN in e4m3fnuz); NaN stays NaN
        v = tl.where(tl.abs(v) <= 2.0 ** (FP8_MIN_EXP - 131), 0.0, v)
        return v.to(OUT.dtype.element_ty)
    else:
        return _fp8_encode(v, FP8_MAX, FP8_MIN_EXP, FP8_NAN).to(OUT.dtype.element_ty)


# ---- shared block fp8_kernels end ----


# ---- shared block row_kernels begin: copies are identical (scripts/sync_shared_blocks.py) ----
@triton.jit
def _row_block(rows, M, INNER):
    """A block's rows kept in bounds (masked-off rows address row 0), their mask, and their outer and inner
    indices (row r -> outer r // INNER, inner r % INNER; see _row_layout)."""
    row_mask = rows < M
    rows = tl.where(row_mask, rows, 0)
    return rows, row_mask, (rows // INNER).to(tl.int64), (rows % INNER).to(tl.int64)


@triton.jit
def _row_start(rows, outer, inner, stride_o, stride_i, DENSE: tl.constexpr = False):
    """Offset of each row's first element in a tensor with row strides (stride_o, stride_i). DENSE: row r
    starts at r * stride_i, so the address of the first load does not wait for the division by INNER."""
    if DENSE:
        return rows.to(tl.int64) * stride_i
    return outer * stride_o + inner * stride_i


@triton.jit
def _modulation(SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i, outer, inner):
    """(SCALE, SHIFT, their row offsets) for rows (outer, inner), or None without a modulation."""
    mod = None
    if SCALE is not None:
        mod = (SCALE, SHIFT, outer * s_stride_o + inner * s_stride_i, outer * t_stride_o + inner * t_stride_i)
    return mod


# ---- shared block row_kernels end ----


@triton.jit
def _load_weight_mod(W, MOD, rows, cols, mask):
    """fp32 tiles of the weight and of the modulation's scale and shift (0.0 for absent ones; MOD: see
    _modulation)."""
    w = 0.0
    sc = 0.0
    sh = 0.0
    if W is not None:
        # loaded at the tile's full [BLOCK_M, BLOCK_N] shape (rows re-read it from cache) so it
        # shares the tile's layout: a [BLOCK_N] or [1, BLOCK_N] load gets another layout and
        # costs a conversion through LDS plus a barrier
        w = tl.load(W + (cols[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32)
    if MOD is not None:
        SCALE, SHIFT, s_row, t_row = MOD
        sc = tl.load(SCALE + s_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(SHIFT + t_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return w, sc, sh


@triton.jit
def _apply_weight_mod(y, w, sc, sh, X, W, MOD, CAST_BEFORE_WEIGHT: tl.constexpr):
    """y = normalised rows (fp32) -> (cast) * w, then * (1 + scale) + shift (W, MOD: whether present)."""
    if W is not None:
        if CAST_BEFORE_WEIGHT:
            y = y.to(X.dtype.element_ty).to(tl.float32)
        y = y * w
    if MOD is not None:
        y = y * (1.0 + sc) + sh
    return y


@triton.jit
def _weight_modulate(y, X, W, MOD, rows, cols, mask, CAST_BEFORE_WEIGHT: tl.constexpr):
    """_apply_weight_mod with the loads issued here (the multi-pass loops)."""
    w, sc, sh = _load_weight_mod(W, MOD, rows, cols, mask)
    return _apply_weight_mod(y, w, sc, sh, X, W, MOD, CAST_BEFORE_WEIGHT)


@triton.jit
def _store_rows(
    y,
    OUT,
    out_row,
    cols,
    mask,
    q_scale,
    FP8_MODE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_MIN_EXP: tl.constexpr,
    FP8_NAN: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
):
    """Store fp32 rows y to OUT in OUT's dtype, or (FP8_MODE > 0) times q_scale (a scalar or a [BLOCK_M, 1]
    column), quantised to OUT's FP8 format. For FP8 the caller marks cols with tl.max_contiguous(cols, 8)
    where it makes them (a hint given here, on an argument, would be lost): stores of at most 8 contiguous
    bytes, like the 16-byte bf16 accesses; otherwise a lane holding 16 elements gets 16-byte FP8 stores in
    another register layout, converted through LDS."""
    if FP8_MODE == 0:
        tl.store(OUT + out_row[:, None] + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)
    else:
        q = _fp8_convert(y * q_scale, OUT, FP8_MAX, FP8_MIN_EXP, FP8_NAN, NATIVE_FP8)
        tl.store(OUT + out_row[:, None] + cols[None, :], q, mask=mask)


@triton.jit
def _residual_rows(X, Y, GATE, H_OUT, x_row, y_row, g_row, out_row, cols, mask):
    """fp32 tiles of x; with Y, h = x + y * gate (GATE None: no gate) rounded to h's dtype, stored to
    H_OUT and returned (the value normalised, as in the unfused model)."""
    x = tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if Y is not None:
        yv = tl.load(Y + y_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if GATE is not None:
            g = tl.load(GATE + g_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            yv = yv * g
        h = (x + yv).to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + out_row[:, None] + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _reread_rows(X, H_OUT, x_row, out_row, cols, mask):
    """fp32 tiles of the normalised input again (a later pass): the stored h with a residual, else x."""
    if H_OUT is not None:
        return tl.load(H_OUT + out_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _multi_pass_rows(
    X, Y, GATE, H_OUT, W, MOD, OUT, FP8_SCALE, offs, rows, row_mask, N, eps, q_scale,
    CAST_BEFORE_WEIGHT: tl.constexpr, FP8_MODE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
    FP8_NAN: tl.constexpr, MIN_SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A row block too wide for registers, BLOCK_N columns at a time: the sum of squares (and the residual
    update, stored once); for per-row FP8 the row maximum of the output; then normalise, weight, modulate
    (quantise) and store. offs: the rows' start offsets in X, Y, GATE and the outputs; q_scale: the
    per-tensor FP8 factor (FP8_MODE 1)."""
    x_row, y_row, g_row, out_row = offs
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _residual_rows(X, Y, GATE, H_OUT, x_row, y_row, g_row, out_row, cols, mask)
        acc += x * x
    if OUT is not None:
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
        if Y is not None:
            tl.debug_barrier()  # the next passes re-read h written by other lanes of this program
        if FP8_MODE == 2:
            amax = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_mask[:, None] & (cols < N)[None, :]
                x = _reread_rows(X, H_OUT, x_row, out_row, cols, mask)
                y = _weight_modulate(x * rstd[:, None], X, W, MOD, rows, cols, mask, CAST_BEFORE_WEIGHT)
                amax = tl.maximum(amax, tl.abs(y))
            row_scale = tl.maximum(tl.max(amax, axis=1) / FP8_MAX, MIN_SCALE)
            tl.store(FP8_SCALE + rows, row_scale, mask=row_mask)
            q_scale = (1.0 / row_scale)[:, None]
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            if FP8_MODE > 0:
                cols = tl.max_contiguous(cols, 8)  # see _store_rows
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = _reread_rows(X, H_OUT, x_row, out_row, cols, mask)
            y = _weight_modulate(x * rstd[:, None], X, W, MOD, rows, cols, mask, CAST_BEFORE_WEIGHT)
            _store_rows(y, OUT, out_row, cols, mask, q_scale, FP8_MODE, FP8_MAX, FP8_MIN_EXP, FP8_NAN, NATIVE_FP8)


@triton.jit
def _rms_norm_kernel(
    X, x_stride_o, x_stride_i,  # input rows (the residual stream h when Y is given); last dim contiguous
    Y, y_stride_o, y_stride_i,  # branch output added to h (None: no residual)
    GATE, g_stride_o, g_stride_i,  # per-channel gate multiplying Y (None: no gate), broadcast strides
    H_OUT,  # contiguous [M, N] output of the updated residual h (with Y)
    W,  # weight [N] (None: not applied)
    SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i,  # modulation (None: none), broadcast strides
    OUT,  # contiguous [M, N] output (None: only h = x + y * gate); FP8: the FP8 tensor or its uint8 view
    FP8_SCALE,  # FP8_MODE 1: one fp32 scale (read); FP8_MODE 2: [M] fp32 per-row scales (written)
    M, N, INNER, eps,  # rows, row width, rows per outer index (row r -> r // INNER, r % INNER), epsilon
    CAST_BEFORE_WEIGHT: tl.constexpr,  # round rms(x) to X's dtype before the weight multiply
    FP8_MODE: tl.constexpr,  # 0: no FP8; 1: static per-tensor scale; 2: dynamic per-row scales
    FP8_MAX: tl.constexpr,  # largest finite value of OUT's FP8 format (FP8_MODE > 0)
    FP8_MIN_EXP: tl.constexpr,  # fp32 biased exponent of its smallest normal (FP8_MODE > 0)
    FP8_NAN: tl.constexpr,  # its NaN code (FP8_MODE > 0)
    MIN_SCALE: tl.constexpr,  # lower bound of the per-row scales (FP8_MODE 2)
    NATIVE_FP8: tl.constexpr,  # FP8_MODE > 0: Triton's FP8 cast (see _fp8_convert), else _fp8_encode
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per step; >= N when SINGLE_PASS
    SINGLE_PASS: tl.constexpr,  # a row block held in registers: one read, one write
    X_DENSE: tl.constexpr, Y_DENSE: tl.constexpr,  # row r of X (Y) starts at r * x_stride_i (y_stride_i)
    INPUT_EVICT: tl.constexpr,  # single pass: L2 eviction hint of the X and Y loads ("" or "evict_first")
):  # fmt: skip
    # combinations the launcher never makes (a direct caller gets a compile error, not wrong output)
    tl.static_assert((Y is None) == (H_OUT is None), "Y and H_OUT come together")
    tl.static_assert(Y is not None or (GATE is None and not Y_DENSE), "GATE and Y_DENSE need Y")
    tl.static_assert((SCALE is None) == (SHIFT is None), "SCALE and SHIFT come together")
    tl.static_assert(
        OUT is not None or (Y is not None and W is None and SCALE is None and FP8_MODE == 0),
        "without OUT: only h = x + y * gate",
    )
    tl.static_assert(FP8_MODE == 0 or FP8_MODE == 1 or FP8_MODE == 2, "FP8_MODE is 0, 1 or 2")
    tl.static_assert((FP8_SCALE is None) == (FP8_MODE == 0), "FP8_SCALE goes with FP8_MODE 1 or 2")
    tl.static_assert(FP8_MODE > 0 or not NATIVE_FP8, "NATIVE_FP8 needs FP8_MODE > 0")
    tl.static_assert(SINGLE_PASS or INPUT_EVICT == "", "INPUT_EVICT applies to the single pass")
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64 (a triton_op launch); Triton as fp32
    pid = tl.program_id(0)
    rows, row_mask, outer, inner = _row_block(pid * BLOCK_M + tl.arange(0, BLOCK_M), M, INNER)
    x_row = _row_start(rows, outer, inner, x_stride_o, x_stride_i, X_DENSE)
    out_row = rows.to(tl.int64) * N
    y_row = _row_start(rows, outer, inner, y_stride_o, y_stride_i, Y_DENSE)
    g_row = _row_start(rows, outer, inner, g_stride_o, g_stride_i)
    mod = _modulation(SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i, outer, inner)
    cols0 = tl.arange(0, BLOCK_N)
    inv_scale = 1.0
    if FP8_MODE == 1:
        # read on the device (no host sync); capped so that a zero scale saturates instead of making 0 * inf
        inv_scale = tl.minimum(1.0 / tl.load(FP8_SCALE).to(tl.float32), 3.0e38)
    if SINGLE_PASS:
        if FP8_MODE > 0:
            cols0 = tl.max_contiguous(cols0, 8)  # see _store_rows
        mask = row_mask[:, None] & (cols0 < N)[None, :]
        x = tl.load(X + x_row[:, None] + cols0[None, :], mask=mask, other=0.0, eviction_policy=INPUT_EVICT)
        x = x.to(tl.float32)
        # weight, scale and shift are requested before the reduction, so their latency overlaps it
        # (2-3 % faster than loading them after it for AdaLN at LTX's [2, 6144, 2048] on an H200)
        w, sc, sh = _load_weight_mod(W, mod, rows, cols0, mask)
        if Y is not None:
            yv = tl.load(Y + y_row[:, None] + cols0[None, :], mask=mask, other=0.0, eviction_policy=INPUT_EVICT)
            yv = yv.to(tl.float32)
            if GATE is not None:
                yv = yv * tl.load(GATE + g_row[:, None] + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x + yv).to(H_OUT.dtype.element_ty)
            tl.store(H_OUT + out_row[:, None] + cols0[None, :], h, mask=mask)
            x = h.to(tl.float32)  # normalise the stored (rounded) h, as the unfused model does
        if OUT is not None:
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
            y = _apply_weight_mod(x * rstd[:, None], w, sc, sh, X, W, mod, CAST_BEFORE_WEIGHT)
            q_scale = inv_scale
            if FP8_MODE == 2:
                # masked-off columns hold 0 (zero-filled loads), so they do not change the maximum
                row_scale = tl.maximum(tl.max(tl.abs(y), axis=1) / FP8_MAX, MIN_SCALE)
                tl.store(FP8_SCALE + rows, row_scale, mask=row_mask)
                q_scale = (1.0 / row_scale)[:, None]
            _store_rows(y, OUT, out_row, cols0, mask, q_scale, FP8_MODE, FP8_MAX, FP8_MIN_EXP, FP8_NAN, NATIVE_FP8)
    else:
        _multi_pass_rows(
            X, Y, GATE, H_OUT, W, mod, OUT, FP8_SCALE, (x_row, y_row, g_row, out_row), rows, row_mask, N, eps,
            inv_scale, CAST_BEFORE_WEIGHT, FP8_MODE, FP8_MAX, FP8_MIN_EXP, FP8_NAN, MIN_SCALE, NATIVE_FP8, BLOCK_M, BLOCK_N,
        )  # fmt: skip


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


def _bcast_strides(name: str, t: torch.Tensor, shape) -> tuple:
    """Strides of t broadcast to shape (0 along broadcast dims), without materialising anything."""
    nd, td = len(shape), t.dim()
    if td > nd:
        raise ValueError(f"{name} of shape {tuple(t.shape)} has more dimensions than the input {tuple(shape)}")
    tshape, tstride = (1,) * (nd - td) + tuple(t.shape), (0,) * (nd - td) + tuple(t.stride())
    out = []
    for size, st, want in zip(tshape, tstride, shape):
        if size == want:
            out.append(st if want != 1 else 0)
        elif size == 1:
            out.append(0)
        else:
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} does not broadcast to the input's shape {tuple(shape)}; "
                "expected [D], [B, 1, D] or [B, S, D]"
            )
    if shape[-1] > 1 and out[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {out[-1]})")
    return tuple(out)


# ---- shared block strides begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _mergeable(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True if these dims can be addressed as one flat index with a single stride."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))


def _flat_stride(shape: Sequence[int], strides: Sequence[int]) -> int:
    dims = [st for s, st in zip(shape, strides) if s != 1]
    return dims[-1] if dims else 0


# ---- shared block strides end ----


# ---- shared block rows begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _row_layout(stride_sets, lead_shape):
    """Express the leading dims of every operand as two levels of rows.

    stride_sets holds each operand's strides (broadcast to the input's shape, last dim excluded).
    Row r of the flattened [M, N] problem lives at (r // inner) * stride_o + (r % inner) * stride_i.
    Up to two leading dims map directly (the common [B, S, D] and [M, D] cases cost nothing); more
    are collapsed where every operand allows it. No copy is ever made; a layout that needs more
    than two levels is rejected with a clear error.
    """
    nlead = len(lead_shape)
    if nlead <= 2:
        if nlead == 0:
            return 1, [(0, 0) for _ in stride_sets]
        if nlead == 1:
            return lead_shape[0], [(0, st[0]) for st in stride_sets]
        return lead_shape[1], [(st[0], st[1]) for st in stride_sets]
    for k in range(nlead, -1, -1):
        layouts = []
        for st in stride_sets:
            if not (_mergeable(lead_shape[:k], st[:k]) and _mergeable(lead_shape[k:], st[k:])):
                break
            layouts.append((_flat_stride(lead_shape[:k], st[:k]), _flat_stride(lead_shape[k:], st[k:])))
        else:
            inner = 1
            for s in lead_shape[k:]:
                inner *= s
            return max(inner, 1), layouts
    raise ValueError(
        "the leading dimensions of the inputs cannot be addressed with two strides "
        f"(shape {tuple(lead_shape)}, strides {[tuple(st) for st in stride_sets]}); "
        "call .contiguous() on the input first"
    )


def _dense(layout, m: int, inner: int) -> bool:
    """Whether rows at layout (stride_o, stride_i) sit at r * stride_i: one level of rows, or the outer
    stride spanning exactly INNER inner rows."""
    return m <= inner or layout[0] == inner * layout[1]


# ---- shared block rows end ----


def _launch_config(n_cols: int, n_rows: int, warp_size: int):
    return _launch_config_cached(n_cols, n_rows, warp_size, _MAX_FUSED_N, _CHUNK_N)


@functools.lru_cache(maxsize=1024)
def _launch_config_cached(n_cols: int, n_rows: int, warp_size: int, max_fused: int, chunk: int):
    """Block shape and warps: 16 elements per lane (two 16-byte loads per tensor in flight, fewer warps
    to reduce across), short rows packed to about 2048 elements per program (small programs pay
    scheduling overhead per row), rows wider than _MAX_FUSED_N in _CHUNK_N-wide chunks. One row x 4 warps
    ran 10-20 % faster than 2 rows x 16 warps at [12288, 2048] bf16 on an H200 (references/results-h200.md).
    """
    single = n_cols <= max_fused
    block_n = _next_pow2(n_cols) if single else chunk
    block_m = max(1, min(16, 2048 // block_n, _next_pow2(max(n_rows, 1))))
    elems = block_m * block_n
    num_warps = _next_pow2(max(1, min(16, elems // (warp_size * 16))))
    return block_m, block_n, single, num_warps


# The fused residual add + RMSNorm (LLM decoder layer) marks its two inputs "evict_first" in L2 (both are
# dead after the call) when the call moves at most this many bytes: 2-5 % faster at 1,024 x 4096-8192
# with inputs from DRAM on an H200 (examples/benchmark_decode_fusions_h200.json, "triton(no evict hint)"
# rows), 3.5-8.3 % slower from 128 MiB a call (unrecorded), hence the cut-off. It costs 3-17 % only when
# the same inputs are replayed from L2, which a decoder layer's residual (written several GEMMs before) is not.
# On AMD, Triton 3.6 and 3.9 emit the same code with and without it (tests/test_amd_compile.py).
_EVICT_FIRST_MAX_BYTES = 64 << 20


def _input_evict(single_pass: bool, fused_add: bool, nbytes: int) -> str:
    return "evict_first" if single_pass and fused_add and nbytes <= _EVICT_FIRST_MAX_BYTES else ""


# ---- shared block sizes begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a constexpr_function, microseconds per host call


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n; 1 for every n <= 1 (0 included)."""
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


# ---- shared block sizes end ----


# ---- shared block fp8 begin: copies are identical (scripts/sync_shared_blocks.py) ----
# FP8 output formats: torch dtype -> (largest finite value, fp32 biased exponent of the smallest normal,
# NaN code).
# e4m3fn (OCP): bias 7, max 448 = 1.75 * 2**8, smallest normal 2**-6. e4m3fnuz (AMD CDNA3): bias 8,
# max 240 = 1.875 * 2**7, smallest normal 2**-7. Both have 3 mantissa bits.
_FP8_FORMATS = {
    torch.float8_e4m3fn: (448.0, 127 - 6, 0x7F),
    torch.float8_e4m3fnuz: (240.0, 127 - 7, 0x80),
}
_FP8_MODES = {None: 0, "per_tensor": 1, "per_token": 2}
# Per-token scales never go below this: a row of zeros gets this scale (its FP8 values are zeros) and
# 1 / scale stays finite, so 0 * (1 / scale) cannot make a NaN.
_MIN_DYNAMIC_SCALE = 1e-12
_TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])


def _fp8_dtype_for(device: torch.device) -> torch.dtype:
    """The FP8 format the device's matrix cores take: e4m3fnuz on CDNA3 (gfx940-942), OCP e4m3fn elsewhere."""
    backend, arch, _ = _device_target(device)
    if backend == "hip" and str(arch).split(":")[0] in ("gfx940", "gfx941", "gfx942"):
        return torch.float8_e4m3fnuz
    return torch.float8_e4m3fn


def _native_fp8(device: torch.device, fp8_dtype: torch.dtype) -> bool:
    """Whether the kernel converts to FP8 with Triton's cast (one hardware instruction per two values)
    rather than _fp8_encode's integer arithmetic.

    Only where the compiled code was checked to use a conversion instruction for that format (Triton
    3.6 and 3.9 ahead-of-time output): NVIDIA sm_89+ for e4m3fn, gfx942 (CDNA3) for e4m3fnuz, gfx950
    (CDNA4) for e4m3fn from Triton 3.6 (earlier versions not checked). Elsewhere (gfx1201, whose Triton lowering is itself a
    software sequence; other formats; the interpreter, whose FP8 casts round differently) the integer
    encoder is used. tests/test_fp8_native.py checks on a GPU that both give the same bytes: passed on an
    NVIDIA H200; the AMD paths are compiled (scripts/check_amd_compile.py) but not yet run on AMD hardware.
    """
    backend, arch, _ = _device_target(device)
    if backend == "interpreter" or (device.type != "cpu" and _interpreting()):
        return False  # (the ahead-of-time check compiles CPU tensors for a GPU target: not excluded here)
    if backend == "cuda":
        return fp8_dtype == torch.float8_e4m3fn and isinstance(arch, int) and arch >= 89
    if backend == "hip":
        gfx = str(arch).split(":")[0]
        if gfx in ("gfx940", "gfx941", "gfx942"):
            return fp8_dtype == torch.float8_e4m3fnuz
        # gfx950: Triton 3.6 and 3.9 emit v_cvt_scalef32_pk_fp8_f32 (earlier versions not checked)
        return gfx == "gfx950" and fp8_dtype == torch.float8_e4m3fn and _TRITON_VERSION >= (3, 6)
    return False


def _fp8_mode(fp8) -> int:
    if not (fp8 is None or isinstance(fp8, str)) or fp8 not in _FP8_MODES:
        raise ValueError(f"fp8 must be None, 'per_tensor' or 'per_token', got {fp8!r}")
    return _FP8_MODES[fp8]


def _fp8_constexprs(fp8_mode: int, fp8_format, native: bool) -> dict:
    """The kernels' FP8 constexprs: the mode, the format's (largest value, fp32 exponent of its smallest
    normal, NaN code), the floor of the per-row scales and whether Triton's own cast is used."""
    fp8_max, fp8_min_exp, fp8_nan = fp8_format
    return dict(
        FP8_MODE=fp8_mode,
        FP8_MAX=fp8_max,
        FP8_MIN_EXP=fp8_min_exp,
        FP8_NAN=fp8_nan,
        MIN_SCALE=_MIN_DYNAMIC_SCALE,
        NATIVE_FP8=native,
    )


def _fp8_options(fp8, fp8_scale, fp8_dtype) -> int:
    """The FP8 mode of a public call's fp8= (0: none, 1: per tensor, 2: per token), refusing the options
    that the mode does not use."""
    mode = _fp8_mode(fp8)
    if fp8_dtype is not None and mode == 0:
        raise ValueError("fp8_dtype is only used with fp8='per_tensor' or fp8='per_token'")
    if mode != 1 and fp8_scale is not None:
        raise ValueError("fp8_scale is only used with fp8='per_tensor' (fp8='per_token' computes the scales)")
    return mode


def _check_fp8(device, fp8_dtype, fp8_mode: int, fp8_scale) -> torch.dtype:
    """Validate the FP8 arguments of an FP8 launch; returns the FP8 output dtype (fp8_dtype, or the
    device's when None)."""
    fp8_dtype = _fp8_dtype_for(device) if fp8_dtype is None else fp8_dtype
    if fp8_dtype not in _FP8_FORMATS:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {fp8_dtype}")
    if fp8_mode == 1:
        if fp8_scale is None:
            raise ValueError("fp8='per_tensor' needs fp8_scale: a one-element float32 tensor (out = y / fp8_scale)")
        _check_tensor("fp8_scale", fp8_scale, (torch.float32,), device, ref="the input")
        if fp8_scale.numel() != 1:
            raise ValueError(f"fp8_scale must hold one element (shape [] or [1]), got shape {tuple(fp8_scale.shape)}")
    elif fp8_scale is not None:
        raise ValueError("fp8_scale is only used with fp8='per_tensor' (fp8='per_token' computes the scales)")
    return fp8_dtype


# ---- shared block fp8 end ----


def _result_dtype(x: torch.Tensor, out_dtype, fp8_mode: int) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    return _fp8_dtype_for(x.device) if fp8_mode else x.dtype


_PLANS: dict = {}  # launch plans by call signature (see _launch)


def _launch(
    x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype, fp8_mode=0, fp8_scale=None,
    names=("x", "y", "h"), norm=True,
):  # fmt: skip
    """Validate, pick the launch configuration and run the kernel.

    Returns (h_out or None, out, per-row FP8 scales or None). fp8_mode 0: out has out_dtype (default
    x's); 1: out is FP8 (out_dtype, default per device) with the given fp8_scale; 2: FP8 with per-row
    scales computed in the kernel. names: how the messages call x, y, and x when compared with y.

    The checks and the configuration depend only on the call's signature (each tensor's type, shape,
    strides, dtype and device, and the options), so they run once per signature: the plan they produce
    is kept and later calls with the same signature only allocate the outputs and launch.
    """
    try:
        key = (
            _sig(x),
            y if y is None else _sig(y),
            gate if gate is None else _sig(gate),
            weight if weight is None else _sig(weight),
            scale if scale is None else _sig(scale),
            shift if shift is None else _sig(shift),
            fp8_scale if fp8_scale is None else _sig(fp8_scale),
            type(eps),
            eps,
            cast_before_weight,
            out_dtype,
            fp8_mode,
            norm,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _plan(
            x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype, fp8_mode, fp8_scale, names, norm
        )
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, y, gate, weight, scale, shift, fp8_scale)


def _plan(x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype, fp8_mode, fp8_scale, names, norm):
    """The checks and configuration of _launch; returns run(x, y, gate, weight, scale, shift, fp8_scale)."""
    g_strides, s_strides, t_strides = _check_operands(x, y, gate, weight, scale, shift, eps, names)
    device, shape, n = x.device, x.shape, x.shape[-1]
    has_residual, has_mod = y is not None, scale is not None
    out_dtype, fp8_format, native_fp8 = _check_output(x, out_dtype, fp8_mode, fp8_scale)
    x_dtype, dense_fp8 = x.dtype, fp8_mode and not native_fp8
    if x.numel() == 0:

        def run_empty(x, y, gate, weight, scale, shift, fp8_scale):
            h_out = torch.empty(shape, dtype=x_dtype, device=device) if has_residual else None
            out = torch.empty(shape, dtype=out_dtype, device=device) if norm else h_out
            row_scales = torch.empty(shape[:-1], dtype=torch.float32, device=device) if fp8_mode == 2 else None
            return h_out, out, row_scales

        return run_empty
    m = x.numel() // n
    stride_sets = [x.stride()[:-1]]
    if has_residual:
        stride_sets.append(y.stride()[:-1])
    if gate is not None:
        stride_sets.append(g_strides[:-1])
    if has_mod:
        stride_sets += [s_strides[:-1], t_strides[:-1]]
    inner, layouts = _row_layout(stride_sets, list(shape[:-1]))
    it = iter(layouts)
    xs = next(it)
    ys = next(it) if has_residual else (0, 0)
    gs = next(it) if gate is not None else (0, 0)
    ss = next(it) if has_mod else (0, 0)
    ts = next(it) if has_mod else (0, 0)

    _, _, warp_size = _device_target(device)
    block_m, block_n, single, num_warps = _launch_config(n, m, warp_size)
    grid = (_cdiv(m, block_m),)
    out_size = torch.empty((), dtype=out_dtype).element_size()
    # Absent tensors stay None: the kernel leaves out every use of them.
    args, slots = _kernel_args(
        [True, *xs],
        [has_residual, *ys],
        [gate is not None, *gs],
        [has_residual],  # H_OUT
        [weight is not None],
        [has_mod, *ss],
        [has_mod, *ts],
        [norm],  # OUT
        [fp8_mode != 0],  # FP8_SCALE
        m,
        n,
        inner,
        float(eps),
    )
    config = dict(
        CAST_BEFORE_WEIGHT=bool(cast_before_weight),
        **_fp8_constexprs(fp8_mode, fp8_format, native_fp8),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SINGLE_PASS=single,
        X_DENSE=_dense(xs, m, inner),
        Y_DENSE=has_residual and _dense(ys, m, inner),
        INPUT_EVICT=_input_evict(
            single, has_residual and gate is None and not has_mod and norm, m * n * (3 * x.element_size() + out_size)
        ),
        num_warps=num_warps,
    )
    launch = _Launch(_rms_norm_kernel, grid, args, config, slots, device)

    # outputs are contiguous; torch.empty_like(x) makes the same with less host time where _dense_like(x)
    like_x = _dense_like(x)
    shape_t = tuple(shape)

    def run(x, y, gate, weight, scale, shift, fp8_scale):
        h_out = None
        if has_residual:
            h_out = torch.empty_like(x) if like_x else torch.empty(shape_t, dtype=x_dtype, device=device)
        out = h_out
        if norm:
            out = (
                torch.empty_like(x, dtype=out_dtype) if like_x else torch.empty(shape_t, dtype=out_dtype, device=device)
            )
        row_scales = torch.empty(shape_t[:-1], dtype=torch.float32, device=device) if fp8_mode == 2 else None
        launch(
            x,
            y,
            gate,
            h_out,
            weight,
            scale,
            shift,
            out.view(torch.uint8) if dense_fp8 else out,
            fp8_scale if fp8_mode == 1 else row_scales,
        )
        return h_out, out, row_scales

    return run


def _check_operands(x, y, gate, weight, scale, shift, eps, names):
    """Check x, eps and the optional operands; returns the broadcast strides of gate, scale and shift
    (None for each one absent). names: how the messages call x, y, and x when compared with y."""
    x_name, y_name, h_name = names
    _check_tensor(x_name, x, _SUPPORTED_DTYPES)
    device = x.device
    if x.dim() == 0:
        raise ValueError(f"{x_name} must have at least one dimension (the normalised one)")
    n = x.shape[-1]
    shape = x.shape
    _check_last_contiguous(x_name, x)
    # bool is an int (True == 1.0 and hashes alike: the plan key holds type(eps) so that a plan made for
    # eps=1.0 never serves eps=True); NaN fails eps >= 0 (and never equals a cached key)
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if y is not None:
        _check_tensor(y_name, y, _SUPPORTED_DTYPES, device)
        if y.shape != shape:
            raise ValueError(
                f"{y_name} has shape {tuple(y.shape)} but {h_name} has shape {tuple(shape)}; they must match"
            )
        if y.dtype != x.dtype:
            raise TypeError(f"{y_name} has dtype {y.dtype} but {h_name} has dtype {x.dtype}; they must match")
        if y.numel() > 0 and y.stride(-1) != 1 and n > 1:
            raise ValueError(f"{y_name} must be contiguous in its last dimension; call .contiguous()")
    g_strides = s_strides = t_strides = None
    if gate is not None:
        _check_tensor("gate", gate, _SUPPORTED_DTYPES, device)
        g_strides = _bcast_strides("gate", gate, shape)
    if weight is not None:
        _check_tensor("weight", weight, _SUPPORTED_DTYPES, device)
        if weight.dim() != 1 or weight.shape[0] != n:
            raise ValueError(f"weight must have shape [{n}] (the last dim of {x_name}), got {tuple(weight.shape)}")
        if weight.stride(0) != 1 and n > 1:
            raise ValueError("weight must be contiguous")
    if scale is not None or shift is not None:
        if scale is None or shift is None:
            raise ValueError("scale and shift must be given together")
        _check_tensor("scale", scale, _SUPPORTED_DTYPES, device)
        _check_tensor("shift", shift, _SUPPORTED_DTYPES, device)
        s_strides = _bcast_strides("scale", scale, shape)
        t_strides = _bcast_strides("shift", shift, shape)
    return g_strides, s_strides, t_strides


def _check_output(x, out_dtype, fp8_mode, fp8_scale):
    """The output dtype, the FP8 format's (largest value, smallest normal's exponent, NaN code) and whether
    Triton casts to it natively; all zero and False without FP8."""
    if fp8_mode not in (0, 1, 2):
        raise ValueError(f"fp8_mode must be 0, 1 or 2, got {fp8_mode!r}")
    if fp8_mode:
        out_dtype = _check_fp8(x.device, out_dtype, fp8_mode, fp8_scale)
        return out_dtype, _FP8_FORMATS[out_dtype], _native_fp8(x.device, out_dtype)
    if fp8_scale is not None:
        raise ValueError("fp8_scale is only used with fp8='per_tensor'")
    if out_dtype is None:
        out_dtype = x.dtype
    elif out_dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be one of float16, bfloat16, float32, got {out_dtype}")
    return out_dtype, (0.0, 0, 0), False


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


def _rms_norm_fused_op(
    x: torch.Tensor,
    y: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    shift: Optional[torch.Tensor],
    eps: float,
    cast_before_weight: bool,
    out_dtype: Optional[torch.dtype],
    fp8_mode: int = 0,
    fp8_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h_out, out, row_scales = _launch(
        x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype, fp8_mode, fp8_scale
    )
    # custom ops cannot return None: absent outputs are empty tensors
    return (
        h_out if h_out is not None else x.new_empty(0),
        out,
        row_scales if row_scales is not None else x.new_empty(0, dtype=torch.float32),
    )


def _rms_norm_fused_op_fake(
    x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype, fp8_mode=0, fp8_scale=None
):
    out = torch.empty(x.shape, dtype=_result_dtype(x, out_dtype, fp8_mode), device=x.device)
    h_out = torch.empty_like(x, memory_format=torch.contiguous_format) if y is not None else x.new_empty(0)
    if fp8_mode == 2:
        row_scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    else:
        row_scales = x.new_empty(0, dtype=torch.float32)
    return h_out, out, row_scales


_register("rms_norm_fused", _rms_norm_fused_op, _rms_norm_fused_op_fake)


_GRAD_NAMES = ("x", "y", "gate", "weight", "scale", "shift", "fp8_scale")  # _dispatch's tensors, as named in errors


def _dispatch(
    x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype, fp8_mode=0, fp8_scale=None,
    names=("x", "y", "h"), fn="rms_norm", grad_names=_GRAD_NAMES,
):  # fmt: skip
    if torch.compiler.is_compiling():
        if isinstance(eps, bool):  # float(True) would hide it from the launcher's check
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        h_out, out, row_scales = _compile_op("rms_norm_fused")(
            x, y, gate, weight, scale, shift, float(eps), bool(cast_before_weight), out_dtype, fp8_mode, fp8_scale
        )
        return (h_out if y is not None else None), out, (row_scales if fp8_mode == 2 else None)
    # Eager: call the launcher directly; the custom-op dispatcher costs microseconds per call.
    _check_no_grad(fn, grad_names, (x, y, gate, weight, scale, shift, fp8_scale))
    return _launch(x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype, fp8_mode, fp8_scale, names)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    *,
    cast_before_weight: bool = True,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape, rows may be strided).

    cast_before_weight=True rounds x * rsqrt(mean(x^2) + eps) to x's dtype before multiplying by the
    weight: LlamaRMSNorm, and diffusers RMSNorm when its weight is fp16 or bf16.
    cast_before_weight=False multiplies the weight in fp32 and rounds once: torch.nn.RMSNorm /
    F.rms_norm (whose eps=None means torch.finfo(torch.float32).eps for fp16/bf16/fp32 input), and
    diffusers RMSNorm with an fp32 weight (which then returns fp32: pass out_dtype=torch.float32).
    The output dtype defaults to x's.
    The kernel has no backward: in grad mode, an input that requires grad raises RuntimeError (call it
    under torch.no_grad() / torch.inference_mode(), or use rms_norm_ref where gradients are needed).
    """
    return _dispatch(x, None, None, weight, None, None, eps, cast_before_weight, out_dtype)[1]


def rms_norm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    *,
    cast_before_weight: bool = True,
    fp8: Optional[str] = None,
    fp8_scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
):
    """AdaLN: rms_norm(x, weight) * (1 + scale) + shift in one pass, with fp32 math and one rounding.

    scale and shift broadcast to x: [D], [B, 1, D] (LTX-Video, DiT: one per sample) or [B, S, D].
    Returns out of x's dtype, or with FP8 output (the input of an FP8 GEMM), quantised from fp32:
      fp8="per_tensor": out_fp8 = fp8(clamp(out / fp8_scale, +-fp8_max)), fp8_scale a one-element float32
        tensor on x's device;
      fp8="per_token": (out_fp8, scales), scales[row] = max(max|out[row]| / fp8_max, 1e-12), float32, shape
        x.shape[:-1]; dequantise as out_fp8.float() * scales[..., None].
    fp8_dtype: None picks float8_e4m3fnuz on gfx942 and float8_e4m3fn elsewhere.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see rms_norm).
    """
    if scale is None or shift is None:
        raise ValueError("scale and shift are required; use rms_norm() for a plain norm")
    mode = _fp8_options(fp8, fp8_scale, fp8_dtype)
    _, out, row_scales = _dispatch(
        x, None, None, weight, scale, shift, eps, cast_before_weight, fp8_dtype, mode, fp8_scale, fn="rms_norm_modulate"
    )
    return (out, row_scales) if mode == 2 else out


def gated_residual_rms_norm_modulate(
    h: torch.Tensor,
    y: torch.Tensor,
    gate: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    shift: Optional[torch.Tensor],
    weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    *,
    cast_before_weight: bool = True,
    fp8: Optional[str] = None,
    fp8_scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
):
    """h_new = h + y * gate (gate None: h + y), rounded to h's dtype; out = rms_norm_modulate(h_new).

    Returns (h_new, out); with fp8="per_token" (h_new, out_fp8, scales), with fp8="per_tensor"
    (h_new, out_fp8): FP8 output as in rms_norm_modulate. scale/shift may both be None (plain fused
    residual add + RMSNorm).
    No backward: in grad mode, an input that requires grad raises RuntimeError (see rms_norm).
    """
    if y is None:
        raise ValueError("y is required; use rms_norm_modulate() without a residual")
    mode = _fp8_options(fp8, fp8_scale, fp8_dtype)
    h_out, out, row_scales = _dispatch(
        h, y, gate, weight, scale, shift, eps, cast_before_weight, fp8_dtype, mode, fp8_scale,
        fn="gated_residual_rms_norm_modulate", grad_names=("h",) + _GRAD_NAMES[1:],
    )  # fmt: skip
    return (h_out, out, row_scales) if mode == 2 else (h_out, out)


def gated_residual_add(h: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """h + y * gate (gate None: h + y), computed in fp32 and rounded once to h's dtype: the gated
    residual of DiT/LTX blocks (``torch.addcmul(h, y, gate)``; gate broadcasts like scale: [D],
    [B, 1, D] or [B, S, D]). Same kernel as the fused norms, with the norm switched off: torch's
    addcmul with a broadcast gate takes an unvectorised path that reaches about half the memory
    bandwidth on an H200. Under torch.compile the PyTorch expression is returned instead (the same fp32
    math and one rounding to h's dtype), so that the compiler fuses it with its neighbours.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see rms_norm).
    """
    if y is None:
        raise ValueError("y is required")
    if torch.compiler.is_compiling():
        # as the kernel: fp32 math, one rounding to h's dtype (torch's type promotion would return fp32 for
        # a bf16 h with an fp32 gate, and round y * gate to bf16 before the add with a bf16 gate)
        upd = y.float() if gate is None else y.float() * gate.float()
        return (h.float() + upd).to(h.dtype)
    _check_no_grad("gated_residual_add", ("h", "y", "gate"), (h, y, gate))
    return _launch(h, y, gate, None, None, None, 0.0, True, None, 0, None, ("h", "y", "h"), norm=False)[0]


def gated_residual_add_ref(h, y, gate):
    f = torch.float64 if h.dtype == torch.float64 else torch.float32
    upd = y.to(f) if gate is None else y.to(f) * gate.to(f)
    return (h.to(f) + upd).to(h.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float = 1e-6,
    *,
    cast_before_weight: bool = True,
    fp8: Optional[str] = None,
    fp8_scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
):
    """Residual add + RMSNorm of an LLM decoder layer, optionally with FP8 output, in one kernel.

        r = x + residual          (fp32 sum rounded once to x's dtype; returned, inputs untouched)
        y = rms_norm(r, weight)   (Llama numerics by default: see rms_norm's cast_before_weight)

    x and residual: same shape and dtype (fp16/bf16/fp32), last dim contiguous, rows may be strided.
    Returns (y, r) with y of x's dtype, or with FP8 output:
      fp8="per_tensor": (y_fp8, r) with y_fp8 = fp8(clamp(y / fp8_scale, +-fp8_max)); fp8_scale is a
        one-element float32 tensor on x's device (read by the kernel: no host synchronisation).
      fp8="per_token": (y_fp8, r, scales) with scales[row] = max(max|y[row]| / fp8_max, 1e-12), float32,
        shape x.shape[:-1], and y_fp8 = fp8(y / scales[..., None]); dequantise as y_fp8.float() * scales[..., None].
    y is quantised from its fp32 value (it is not rounded to x's dtype first). fp8_dtype: None picks
    float8_e4m3fnuz on gfx942 and float8_e4m3fn elsewhere; pass either to force it.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see rms_norm).
    """
    mode = _fp8_options(fp8, fp8_scale, fp8_dtype)
    if residual is None:
        raise ValueError("residual is required; use rms_norm() without a residual")
    r, out, row_scales = _dispatch(
        x,
        residual,
        None,
        weight,
        None,
        None,
        eps,
        cast_before_weight,
        fp8_dtype,
        mode,
        fp8_scale,
        names=("x", "residual", "x"),
        fn="fused_add_rms_norm",
        grad_names=("x", "residual") + _GRAD_NAMES[2:],
    )
    if mode == 2:
        return out, r, row_scales
    return out, r


# --------------------------------------------------------------------------------------------
# References: the plain-PyTorch math each kernel replaces (run them in float64 for testing)
# --------------------------------------------------------------------------------------------
def rms_norm_ref(x, weight=None, eps=1e-6, cast_before_weight=True, out_dtype=None):
    """diffusers/torch RMSNorm math. In float64 it is the exact value; in low precision it rounds
    where the modules round (after normalising when cast_before_weight, and at the end)."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if cast_before_weight:
            y = y.to(x.dtype).to(xf.dtype)
        y = y * weight.to(xf.dtype)
    return y.to(out_dtype or x.dtype)


def rms_norm_modulate_ref(x, scale, shift, weight=None, eps=1e-6, cast_before_weight=True):
    xf = x.double() if x.dtype == torch.float64 else x.float()
    n = rms_norm_ref(x, weight, eps, cast_before_weight, out_dtype=xf.dtype)
    return (n * (1 + scale.to(xf.dtype)) + shift.to(xf.dtype)).to(x.dtype)


def gated_residual_rms_norm_modulate_ref(h, y, gate, scale, shift, weight=None, eps=1e-6, cast_before_weight=True):
    f = torch.float64 if h.dtype == torch.float64 else torch.float32
    upd = y.to(f) if gate is None else y.to(f) * gate.to(f)
    h_new = (h.to(f) + upd).to(h.dtype)
    if scale is None:
        return h_new, rms_norm_ref(h_new, weight, eps, cast_before_weight)
    return h_new, rms_norm_modulate_ref(h_new, scale, shift, weight, eps, cast_before_weight)


# ---- shared block fp8_ref begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _exact_pow2(k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**k (integer k in the normal range) built from its exponent bits: exact on every device
    (torch.ldexp on CUDA multiplies by a computed power and can be one ulp off in float64)."""
    k = k.to(torch.int64)
    if dtype == torch.float64:
        return ((k + 1023) << 52).view(torch.float64)
    return ((k + 127) << 23).to(torch.int32).view(torch.float32).to(dtype)


def fp8_quantize_ref(y: torch.Tensor, fp8_dtype=torch.float8_e4m3fn, scale=None):
    """Saturating round-to-nearest-even FP8 quantisation, computed in y's precision (use float64).

    scale None: one dynamic scale per row (last dim), s = max(max|y_row| / fp8_max, 1e-12), shape
    y.shape[:-1]; else the given per-tensor scale (one element). Returns (q, s): q holds the FP8 values
    (each exactly representable in fp8_dtype) in y's dtype, so that y ~ q * s (q * s[..., None] per row);
    q.to(fp8_dtype) is exact.
    """
    fp8_max, min_exp, _ = _FP8_FORMATS[fp8_dtype]
    if scale is None:
        s = (y.abs().amax(-1) / fp8_max).clamp_min(_MIN_DYNAMIC_SCALE)
        v = y / s[..., None]
    else:
        s = scale.to(y.dtype).reshape(())
        v = y / s
    v = v.clamp(-fp8_max, fp8_max)
    _, e = torch.frexp(v)  # v = m * 2**e with 0.5 <= |m| < 1
    e = (e - 1).clamp_min(min_exp - 127)  # exponent of the binade, not below the smallest normal's
    step = _exact_pow2(e - 3, v.dtype)  # 3 mantissa bits
    return torch.round(v / step) * step, s  # torch.round rounds half to even


# ---- shared block fp8_ref end ----


def fused_add_rms_norm_ref(
    x,
    residual,
    weight,
    eps=1e-6,
    cast_before_weight=True,
    fp8=None,
    fp8_scale=None,
    fp8_dtype=torch.float8_e4m3fn,
    dtype=None,
):
    """The unfused math of fused_add_rms_norm, with the same return structure.

    dtype: where the model rounds (the residual sum, and rms(r) before the weight when
    cast_before_weight); default x's dtype. Call it on float64 inputs with dtype=torch.bfloat16 for the
    exact value of what a bf16 model computes. Without FP8, y is rounded to dtype; with FP8 the values
    are the FP8 grid values held in the working precision (see fp8_quantize_ref).
    """
    dtype = dtype or x.dtype
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    r = (x.to(f) + residual.to(f)).to(dtype)
    rf = r.to(f)
    y = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if cast_before_weight:
            y = y.to(dtype).to(f)
        y = y * weight.to(f)
    mode = _fp8_mode(fp8)
    if mode == 0:
        return y.to(dtype), r
    q, s = fp8_quantize_ref(y, fp8_dtype, fp8_scale if mode == 1 else None)
    return (q, r) if mode == 1 else (q, r, s)


# --------------------------------------------------------------------------------------------
# Self-check: python rmsnorm.py [--rows R] [--width N] [--dtype bf16]
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description="Check the RMSNorm kernels against a float64 reference on random inputs.")
    p.add_argument("--rows", type=int, default=64, help="rows (default 64)")
    p.add_argument("--width", type=int, default=2048, help="normalised width (default 2048)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rows", "width"):  # sizes: at least 1
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() and not _interpreting() else "cpu"
    if device == "cpu" and not _interpreting():
        print("no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter", file=sys.stderr)
        return 2
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.randn(2, args.rows, args.width, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(args.width, generator=g)).to(device, dtype)
    sc = (0.1 * torch.randn(2, 1, args.width, generator=g)).to(device, dtype)
    sh = (0.1 * torch.randn(2, 1, args.width, generator=g)).to(device, dtype)
    res = torch.randn(2, args.rows, args.width, generator=g).to(device, dtype)
    y, r = fused_add_rms_norm(x, res, w)
    q, r8, s8 = fused_add_rms_norm(x, res, w, fp8="per_token")
    # FP8 is compared after dequantisation with the float64 quantize-dequantize reference of the same math
    q_ref, _, s_ref = fused_add_rms_norm_ref(
        x.double(), res.double(), w.double(), fp8="per_token", fp8_dtype=q.dtype, dtype=dtype
    )
    checks = {
        "rms_norm": (rms_norm(x, w), rms_norm_ref(x.double(), w.double())),
        "rms_norm_modulate": (
            rms_norm_modulate(x, sc, sh),
            rms_norm_modulate_ref(x.double(), sc.double(), sh.double()),
        ),
        "fused_add_rms_norm": (y, fused_add_rms_norm_ref(x.double(), res.double(), w.double(), dtype=dtype)[0]),
        "fused_add_rms_norm_residual": (r, (x.double() + res.double()).to(dtype)),
        "fused_add_rms_norm_fp8_per_token": (q.double() * s8.double()[..., None], q_ref * s_ref[..., None]),
    }
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    tols = {"fused_add_rms_norm_fp8_per_token": 0.13}  # one FP8 step (2**-3 of the value) where rounding differs
    report, ok = {}, True
    for name, (out, ref) in checks.items():
        err = ((out.double() - ref.double()).abs() / (1 + ref.double().abs())).max().item()
        good = bool(err <= tols.get(name, tol))
        report[name] = {"max_rel_err": err, "ok": good}
        ok &= good
    fp8_mismatch = float((q.double() != q_ref).double().mean())
    report["fused_add_rms_norm_fp8_per_token"].update(
        fp8_dtype=str(q.dtype).replace("torch.", ""), fraction_one_step_off=fp8_mismatch
    )
    ok &= fp8_mismatch <= 0.05
    print(json.dumps({"device": str(device), "dtype": args.dtype, "checks": report, "ok": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

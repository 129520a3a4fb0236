# SPDX-License-Identifier: Apache-2.0
"""RMSNorm over the last dimension, optionally fused with AdaLN modulation, a gated residual and FP8 output.

    h   = h + y * gate                                   (optional: gated residual, h returned too)
    out = cast(rms(x) [cast] * w) * (1 + scale) + shift  (weight and modulation optional)
    with rms(x) = x / sqrt(mean(x**2) + eps), all arithmetic in fp32;
    FP8 output: out8 = fp8(clamp(out / s, -fp8_max, fp8_max)), s given (per tensor) or computed in the
    kernel, s[row] = max|out[row]| / fp8_max (per token).

One Triton kernel for every variant (an absent operand passed as None is compiled out). Public: rms_norm,
rms_norm_modulate (AdaLN), gated_residual_rms_norm_modulate, gated_residual_add, fused_add_rms_norm, each with a
plain-PyTorch ``*_ref``. FP8: e4m3fnuz (max 240) on gfx942, e4m3fn (max 448) elsewhere. Depends on torch and
triton only; ``python rmsnorm.py --help`` runs its self-check."""

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
_MAX_FUSED_N, _CHUNK_N = 16384, 4096  # rows up to _MAX_FUSED_N in one pass from registers, wider ones in chunks
# FP8 dtype -> (largest finite value, fp32 biased exponent of the smallest normal, NaN code)
_FP8_FORMATS = {torch.float8_e4m3fn: (448.0, 127 - 6, 0x7F), torch.float8_e4m3fnuz: (240.0, 127 - 7, 0x80)}
_FP8_MODES = {None: 0, "per_tensor": 1, "per_token": 2}
_MIN_DYNAMIC_SCALE = 1e-12  # per-token scales never go below it: a zero row stays finite (no 0 * inf)
_TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
# fused_add_rms_norm marks its dead-after-the-call inputs evict_first up to this size: 2-5 % faster from DRAM
# on an H200 (examples/benchmark_decode_fusions_h200.json), 3.5-8.3 % slower from 128 MiB a call.
_EVICT_FIRST_MAX_BYTES = 64 << 20


@triton.jit
def _fp8_encode(v, FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_NAN: tl.constexpr):
    """The e4m3 code (0..255, int32) of fp32 v, saturated to +-FP8_MAX, rounded to nearest even; infinities
    saturate, NaN gives FP8_NAN, a zero is never negative (0x80 is NaN in e4m3fnuz). Integer and fp32 arithmetic,
    stored through a uint8 view: the same bits on every backend and Triton version (Triton 3.6 cannot lower fp32 ->
    e4m3fnuz on gfx950/gfx1201, nor store it in its interpreter). FP8_MIN_EXP: fp32 biased exponent of the format's
    smallest normal (127 + 1 - bias).
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
    """fp32 v -> OUT's element type (FP8, or its uint8 view when not NATIVE). NATIVE: clamp (NaN kept, infinities
    saturate whatever the instruction does), then Triton's cast: one conversion per two values (sm_89+
    cvt.rn.satfinite, gfx942 v_cvt_pk_fp8_f32, gfx950 v_cvt_scalef32_pk_fp8_f32), 7-35 % faster fused FP8 kernels
    on an H200 than _fp8_encode's ~20 operations (examples/benchmark_fp8_native_vs_integer_h200.json)."""
    if NATIVE:
        v = tl.clamp(v, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        # what rounds to zero becomes +0, as in _fp8_encode (no -0: 0x80 is NaN in e4m3fnuz); NaN stays NaN
        v = tl.where(tl.abs(v) <= 2.0 ** (FP8_MIN_EXP - 131), 0.0, v)
        return v.to(OUT.dtype.element_ty)
    else:
        return _fp8_encode(v, FP8_MAX, FP8_MIN_EXP, FP8_NAN).to(OUT.dtype.element_ty)


@triton.jit
def _row_block(rows, M, INNER):
    """A block's rows kept in bounds (masked-off ones address row 0), their mask, outer r // INNER, inner r % INNER."""
    row_mask = rows < M
    rows = tl.where(row_mask, rows, 0)
    return rows, row_mask, (rows // INNER).to(tl.int64), (rows % INNER).to(tl.int64)


@triton.jit
def _row_start(rows, outer, inner, stride_o, stride_i, DENSE: tl.constexpr = False):
    """Row starts for row strides (stride_o, stride_i); DENSE: r * stride_i (no wait for the division by INNER)."""
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


@triton.jit
def _load_weight_mod(W, MOD, rows, cols, mask):
    """fp32 tiles of the weight and of the modulation's scale and shift (0.0 where absent; MOD: see _modulation)."""
    w = 0.0
    sc = 0.0
    sh = 0.0
    if W is not None:
        # loaded at the tile's full [BLOCK_M, BLOCK_N] shape (rows re-read it from cache) so it shares the tile's
        # layout: a [BLOCK_N] load gets another layout and costs a conversion through LDS plus a barrier
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
    y, OUT, out_row, cols, mask, q_scale, FP8_MODE: tl.constexpr, FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
    FP8_NAN: tl.constexpr, NATIVE_FP8: tl.constexpr,
):  # fmt: skip
    """Store fp32 rows y to OUT, or (FP8_MODE > 0) y * q_scale (scalar or [BLOCK_M, 1]) quantised to FP8. For FP8
    the caller marks cols tl.max_contiguous(cols, 8) where it makes them (a hint on an argument is lost): 8-byte
    stores, in the layout of the 16-byte bf16 accesses, not 16-byte ones converted through LDS."""
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
    """A row block too wide for registers, BLOCK_N columns at a time: the sum of squares (and h, stored once); for
    per-row FP8 the row maximum; then normalise, weight, modulate, (quantise,) store. offs: row starts in X, Y, GATE
    and the outputs; q_scale: the per-tensor FP8 factor (FP8_MODE 1)."""
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
    H_OUT, W,  # contiguous [M, N] output of the updated residual h (with Y); weight [N] (None: not applied)
    SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i,  # modulation (None: none), broadcast strides
    OUT,  # contiguous [M, N] output (None: only h = x + y * gate); FP8: the FP8 tensor or its uint8 view
    FP8_SCALE,  # FP8_MODE 1: one fp32 scale (read); FP8_MODE 2: [M] fp32 per-row scales (written)
    M, N, INNER, eps,  # rows, row width, rows per outer index (row r -> r // INNER, r % INNER), epsilon
    CAST_BEFORE_WEIGHT: tl.constexpr,  # round rms(x) to X's dtype before the weight multiply
    FP8_MODE: tl.constexpr,  # 0: no FP8; 1: static per-tensor scale; 2: dynamic per-row scales (>= MIN_SCALE)
    FP8_MAX: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_NAN: tl.constexpr,  # OUT's FP8 format (_FP8_FORMATS)
    MIN_SCALE: tl.constexpr, NATIVE_FP8: tl.constexpr,  # NATIVE_FP8: Triton's FP8 cast, else _fp8_encode
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # rows per program, columns per step (>= N when SINGLE_PASS)
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@torch.compiler.assume_constant_result  # a constant for Dynamo: it need not trace Triton's driver
@functools.lru_cache(maxsize=None)
def _device_target(device: torch.device):
    """(backend, arch, warp size), e.g. ("hip", "gfx942", 64); ("interpreter", None, 32) on the CPU."""
    if device.type == "cpu":
        return ("interpreter", None, 32)
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _fp8_dtype_for(device: torch.device) -> torch.dtype:
    """The FP8 format the device's matrix cores take: e4m3fnuz on CDNA3 (gfx940-942), OCP e4m3fn elsewhere."""
    backend, arch, _ = _device_target(device)
    cdna3 = backend == "hip" and str(arch).split(":")[0] in ("gfx940", "gfx941", "gfx942")
    return torch.float8_e4m3fnuz if cdna3 else torch.float8_e4m3fn


def _native_fp8(device: torch.device, fp8_dtype: torch.dtype) -> bool:
    """Triton's FP8 cast where it emits a conversion (sm_89+, gfx942, gfx950 from Triton 3.6), else _fp8_encode."""
    backend, arch, _ = _device_target(device)
    if backend == "interpreter" or (device.type != "cpu" and _interpreting()):
        return False  # (the ahead-of-time check compiles CPU tensors for a GPU target: not excluded here)
    if backend == "cuda":
        return fp8_dtype == torch.float8_e4m3fn and isinstance(arch, int) and arch >= 89
    gfx = str(arch).split(":")[0]
    lowered = gfx in ("gfx940", "gfx941", "gfx942") or (gfx == "gfx950" and _TRITON_VERSION >= (3, 6))
    return backend == "hip" and lowered and fp8_dtype == _fp8_dtype_for(device)  # the device's own format


def _check(name: str, t, device=None, dtypes=_SUPPORTED_DTYPES, shape=None):
    """Refuse t unless a tensor of dtypes, on device (if given), contiguous in its last dim. With shape: t's row strides
    broadcast to shape (0 along broadcast and size-1 dims), copying nothing."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected one of {', '.join(str(d)[6:] for d in dtypes)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; move them to one device")
    if t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")
    if shape is None:
        return None
    try:
        strides = t.expand(shape).stride()  # (a RuntimeError too where t has more dims than shape)
    except RuntimeError:
        msg = f"{name} of shape {tuple(t.shape)} does not broadcast to the input's shape {tuple(shape)}"
        raise ValueError(f"{msg}; expected [D], [B, 1, D] or [B, S, D]") from None
    strides = tuple(0 if s == 1 else st for s, st in zip(shape, strides))
    if shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {strides[-1]})")
    return strides[:-1]


def _row_layout(stride_sets, lead):
    """(INNER, [(stride_o, stride_i) per operand]): row r at (r // INNER) * stride_o + (r % INNER) * stride_i, no
    copy; more than two leading dims are split in two groups of one stride each, else refused."""
    if len(lead) <= 2:
        return ([1, 1] + list(lead))[-1], [(0,) * (2 - len(lead)) + tuple(st) for st in stride_sets]

    def flat(sizes, strides):  # the one stride addressing these dims as one index, or None
        dims = [(s, st) for s, st in zip(sizes, strides) if s != 1]
        return (dims[-1][1] if dims else 0) if all(a[1] == b[1] * b[0] for a, b in zip(dims, dims[1:])) else None

    for k in range(len(lead), -1, -1):
        layouts = [(flat(lead[:k], st[:k]), flat(lead[k:], st[k:])) for st in stride_sets]
        if all(None not in lay for lay in layouts):
            return max(math.prod(lead[k:]), 1), layouts
    raise ValueError(
        f"the leading dimensions of the inputs cannot be addressed with two strides (shape {tuple(lead)}, "
        f"strides {[tuple(st) for st in stride_sets]}); call .contiguous() on the input first"
    )


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


def _launch_config(n_cols: int, n_rows: int, warp_size: int):
    """(BLOCK_M, BLOCK_N, single pass, warps). 16 elements per lane, few warps to reduce across (1 row x 4 warps:
    10-20 % faster than 2 x 16 at [12288, 2048] bf16, H200); short rows packed to ~2048 elements per program."""
    single = n_cols <= _MAX_FUSED_N
    block_n = _next_pow2(n_cols) if single else _CHUNK_N
    block_m = max(1, min(16, 2048 // block_n, _next_pow2(max(n_rows, 1))))
    return block_m, block_n, single, _next_pow2(max(1, min(16, block_m * block_n // (warp_size * 16))))


def _input_evict(single_pass: bool, fused_add: bool, nbytes: int) -> str:
    return "evict_first" if single_pass and fused_add and nbytes <= _EVICT_FIRST_MAX_BYTES else ""


def _launch(
    x: Tensor, y: Optional[Tensor], gate: Optional[Tensor], weight: Optional[Tensor], scale: Optional[Tensor],
    shift: Optional[Tensor], eps: float, cast_before_weight: bool, out_dtype: Optional[torch.dtype],
    fp8_mode: int = 0, fp8_scale: Optional[Tensor] = None, norm: bool = True, names: str = "x,y,h",
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:  # fmt: skip
    """Check a call, pick the launch configuration, allocate the outputs, launch _rms_norm_kernel. Returns (h = x + y *
    gate, the norm (FP8 for fp8_mode 1, 2), per-row FP8 scales), None where absent; names: x, y, x beside y."""
    x_name, y_name, h_name = names.split(",")
    _check(x_name, x)
    device, shape = x.device, x.shape
    if x.dim() == 0:
        raise ValueError(f"{x_name} must have at least one dimension (the normalised one)")
    n = shape[-1]
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not eps >= 0:  # NaN fails eps >= 0
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    if (scale is None) != (shift is None):
        raise ValueError("scale and shift must be given together")
    strides = [x.stride()[:-1]]  # of every operand, broadcast to x's shape, for the row layout
    if y is not None:
        _check(y_name, y, device)
        if y.shape != shape:
            msg = f"{y_name} has shape {tuple(y.shape)} but {h_name} has shape {tuple(shape)}"
            raise ValueError(f"{msg}; they must match")
        if y.dtype != x.dtype:
            raise TypeError(f"{y_name} has dtype {y.dtype} but {h_name} has dtype {x.dtype}; they must match")
        strides.append(y.stride()[:-1])
    for name, t in (("gate", gate), ("scale", scale), ("shift", shift)):
        if t is not None:
            strides.append(_check(name, t, device, shape=shape))
    if weight is not None:
        _check("weight", weight, device)
        if weight.dim() != 1 or weight.shape[0] != n:
            raise ValueError(f"weight must have shape [{n}] (the last dim of {x_name}), got {tuple(weight.shape)}")
    if fp8_mode not in (0, 1, 2):
        raise ValueError(f"fp8_mode must be 0, 1 or 2, got {fp8_mode!r}")
    if fp8_mode == 1:
        if fp8_scale is None:
            raise ValueError("fp8='per_tensor' needs fp8_scale: a one-element float32 tensor (out = y / fp8_scale)")
        _check("fp8_scale", fp8_scale, device, (torch.float32,))
        if fp8_scale.numel() != 1:
            raise ValueError(f"fp8_scale must hold one element (shape [] or [1]), got shape {tuple(fp8_scale.shape)}")
    elif fp8_scale is not None:
        raise ValueError("fp8_scale is only used with fp8='per_tensor' (fp8='per_token' computes the scales)")
    out_dtype = out_dtype or (_fp8_dtype_for(device) if fp8_mode else x.dtype)
    if fp8_mode and out_dtype not in _FP8_FORMATS:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {out_dtype}")
    if not fp8_mode and out_dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be one of float16, bfloat16, float32, got {out_dtype}")
    h_out = torch.empty(shape, dtype=x.dtype, device=device) if y is not None else None
    out = torch.empty(shape, dtype=out_dtype, device=device) if norm else None
    row_scales = torch.empty(shape[:-1], dtype=torch.float32, device=device) if fp8_mode == 2 else None
    if x.numel() == 0:
        return h_out, out, row_scales
    m = x.numel() // n
    inner, layouts = _row_layout(strides, list(shape[:-1]))
    it = iter(layouts)  # (stride_o, stride_i) of x, then of each operand given; (0, 0) for one absent
    xs, ys, gs, ss, ts = (next(it) if t is not None else (0, 0) for t in (x, y, gate, scale, shift))
    block_m, block_n, single, num_warps = _launch_config(n, m, _device_target(device)[2])
    fused_add = y is not None and gate is None and scale is None and norm
    fp8_max, fp8_min_exp, fp8_nan = _FP8_FORMATS[out_dtype] if fp8_mode else (0.0, 0, 0)
    native = bool(fp8_mode) and _native_fp8(device, out_dtype)
    _rms_norm_kernel[(-(-m // block_m),)](
        x, *xs, y, *ys, gate, *gs, h_out, weight, scale, *ss, shift, *ts,
        out.view(torch.uint8) if fp8_mode and not native else out,  # _fp8_encode's codes go through a uint8 view
        fp8_scale if fp8_mode == 1 else row_scales, m, n, inner, float(eps),
        CAST_BEFORE_WEIGHT=bool(cast_before_weight), FP8_MODE=fp8_mode, FP8_MAX=fp8_max, FP8_MIN_EXP=fp8_min_exp,
        FP8_NAN=fp8_nan, MIN_SCALE=_MIN_DYNAMIC_SCALE, NATIVE_FP8=native, BLOCK_M=block_m, BLOCK_N=block_n,
        SINGLE_PASS=single, X_DENSE=m <= inner or xs[0] == inner * xs[1],  # row r of x starts at r * x_stride_i
        Y_DENSE=y is not None and (m <= inner or ys[0] == inner * ys[1]), num_warps=num_warps,
        INPUT_EVICT=_input_evict(single, fused_add, m * n * (3 * x.element_size() + out_dtype.itemsize)),
    )  # fmt: skip
    return h_out, out, row_scales


def _no_backward(fn: str, names: str, *tensors) -> None:
    """In grad mode, refuse an input that requires grad: the kernel has no backward, so gradients would stop."""
    for name, t in zip(names.split(","), tensors) if torch.is_grad_enabled() else ():
        if getattr(t, "requires_grad", False):
            raise RuntimeError(
                f"{fn}: {name} requires grad, but this Triton kernel has no backward (gradients would silently stop): "
                f"call {fn} under torch.no_grad() or torch.inference_mode(), or use the PyTorch reference ({fn}_ref)"
            )


def _fp8_mode(fp8, fp8_dtype=None) -> int:
    """The FP8 mode of fp8= (0: none, 1: per tensor, 2: per token); fp8_dtype only with one (fp8_scale: _launch)."""
    if not (fp8 is None or isinstance(fp8, str)) or fp8 not in _FP8_MODES:
        raise ValueError(f"fp8 must be None, 'per_tensor' or 'per_token', got {fp8!r}")
    if fp8_dtype is not None and fp8 is None:
        raise ValueError("fp8_dtype is only used with fp8='per_tensor' or fp8='per_token'")
    return _FP8_MODES[fp8]


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *, cast_before_weight: bool = True,
             out_dtype: Optional[torch.dtype] = None) -> Tensor:  # fmt: skip
    """RMSNorm over the last dim of x (any leading shape, rows may be strided), output in out_dtype (default x's).
    cast_before_weight=True rounds x * rsqrt(mean(x^2) + eps) to x's dtype before the weight (LlamaRMSNorm, diffusers
    RMSNorm with an fp16/bf16 weight); False multiplies in fp32 and rounds once (torch.nn.RMSNorm, diffusers RMSNorm
    with an fp32 weight: pass out_dtype=torch.float32). No backward: an input requiring grad raises in grad mode."""
    _no_backward("rms_norm", "x,weight", x, weight)
    return _launch(x, None, None, weight, None, None, eps, cast_before_weight, out_dtype)[1]


def rms_norm_modulate(x, scale, shift, weight=None, eps=1e-6, *, cast_before_weight=True, fp8=None, fp8_scale=None,
                      fp8_dtype=None):  # fmt: skip
    """AdaLN: rms_norm(x, weight) * (1 + scale) + shift, scale/shift broadcast to x ([D], [B, 1, D], [B, S, D]).
    fp8="per_tensor": fp8(clamp(out / fp8_scale)), fp8_scale a one-element float32 tensor; "per_token": (out_fp8,
    scales), scales[row] = max(max|out[row]| / fp8_max, 1e-12); fp8_dtype None: the device's format."""
    if scale is None or shift is None:
        raise ValueError("scale and shift are required; use rms_norm() for a plain norm")
    mode = _fp8_mode(fp8, fp8_dtype)
    _no_backward("rms_norm_modulate", "x,weight,scale,shift,fp8_scale", x, weight, scale, shift, fp8_scale)
    _, out, scales = _launch(x, None, None, weight, scale, shift, eps, cast_before_weight, fp8_dtype, mode, fp8_scale)
    return (out, scales) if mode == 2 else out


def gated_residual_rms_norm_modulate(h, y, gate, scale, shift, weight=None, eps=1e-6, *, cast_before_weight=True,
                                     fp8=None, fp8_scale=None, fp8_dtype=None):  # fmt: skip
    """h_new = h + y * gate (gate None: h + y), rounded to h's dtype; out = rms_norm_modulate(h_new). Returns
    (h_new, out), or (h_new, out_fp8[, scales]) with FP8 as in rms_norm_modulate; scale/shift may be None."""
    if y is None:
        raise ValueError("y is required; use rms_norm_modulate() without a residual")
    mode = _fp8_mode(fp8, fp8_dtype)
    names = "h,y,gate,weight,scale,shift,fp8_scale"
    _no_backward("gated_residual_rms_norm_modulate", names, h, y, gate, weight, scale, shift, fp8_scale)
    h_out, out, scales = _launch(h, y, gate, weight, scale, shift, eps, cast_before_weight, fp8_dtype, mode, fp8_scale)
    return (h_out, out, scales) if mode == 2 else (h_out, out)


def gated_residual_add(h: Tensor, y: Tensor, gate: Optional[Tensor]) -> Tensor:
    """h + y * gate (gate None: h + y) in fp32, rounded once to h's dtype (``torch.addcmul(h, y, gate)``, whose
    broadcast-gate path reaches about half the bandwidth on an H200). Under torch.compile: the PyTorch math."""
    if y is None:
        raise ValueError("y is required")
    if torch.compiler.is_compiling():  # as the kernel: fp32 math, one rounding to h's dtype
        return (h.float() + (y.float() if gate is None else y.float() * gate.float())).to(h.dtype)
    _no_backward("gated_residual_add", "h,y,gate", h, y, gate)
    return _add_launch(h, y, gate)


def _add_launch(h: Tensor, y: Tensor, gate: Optional[Tensor]) -> Tensor:
    """_launch with the norm switched off: h + y * gate."""
    return _launch(h, y, gate, None, None, None, 0.0, True, None, 0, None, False, "h,y,h")[0]


def fused_add_rms_norm(x, residual, weight, eps=1e-6, *, cast_before_weight=True, fp8=None, fp8_scale=None,
                       fp8_dtype=None):  # fmt: skip
    """r = x + residual (rounded once to x's dtype), y = rms_norm(r, weight): (y, r), or with FP8 (as in
    rms_norm_modulate) (y_fp8, r) per tensor, (y_fp8, r, scales) per token."""
    mode = _fp8_mode(fp8, fp8_dtype)
    if residual is None:
        raise ValueError("residual is required; use rms_norm() without a residual")
    _no_backward("fused_add_rms_norm", "x,residual,weight,fp8_scale", x, residual, weight, fp8_scale)
    args = (eps, cast_before_weight, fp8_dtype, mode, fp8_scale, True, "x,residual,x")
    r, out, scales = _launch(x, residual, None, weight, None, None, *args)
    return (out, r, scales) if mode == 2 else (out, r)


def rms_norm_ref(x, weight=None, eps=1e-6, cast_before_weight=True, out_dtype=None, *, round_dtype=None):
    """diffusers/torch RMSNorm math: exact in float64; in low precision it rounds where the modules round (before
    the weight: to round_dtype, default x's dtype; a model's dtype where x is a float64 copy of its input)."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if cast_before_weight:
            y = y.to(round_dtype or x.dtype).to(xf.dtype)
        y = y * weight.to(xf.dtype)
    return y.to(out_dtype or x.dtype)


def rms_norm_modulate_ref(x, scale, shift, weight=None, eps=1e-6, cast_before_weight=True):
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (rms_norm_ref(x, weight, eps, cast_before_weight, f) * (1 + scale.to(f)) + shift.to(f)).to(x.dtype)


def gated_residual_add_ref(h, y, gate):
    f = torch.float64 if h.dtype == torch.float64 else torch.float32
    return (h.to(f) + (y.to(f) if gate is None else y.to(f) * gate.to(f))).to(h.dtype)


def gated_residual_rms_norm_modulate_ref(h, y, gate, scale, shift, weight=None, eps=1e-6, cast_before_weight=True):
    h_new = gated_residual_add_ref(h, y, gate)
    if scale is None:
        return h_new, rms_norm_ref(h_new, weight, eps, cast_before_weight)
    return h_new, rms_norm_modulate_ref(h_new, scale, shift, weight, eps, cast_before_weight)


def _exact_pow2(k: Tensor, dtype: torch.dtype) -> Tensor:
    """2**k from its exponent bits: exact on every device (CUDA's torch.ldexp can be one ulp off in float64)."""
    k = k.to(torch.int64)
    if dtype == torch.float64:
        return ((k + 1023) << 52).view(torch.float64)
    return ((k + 127) << 23).to(torch.int32).view(torch.float32).to(dtype)


def fp8_quantize_ref(y: Tensor, fp8_dtype=torch.float8_e4m3fn, scale=None):
    """Saturating round-to-nearest-even FP8 in y's precision: (q, s), y ~ q * s, s per row (as in-kernel) or scale."""
    fp8_max, min_exp, _ = _FP8_FORMATS[fp8_dtype]
    s = (y.abs().amax(-1) / fp8_max).clamp_min(_MIN_DYNAMIC_SCALE) if scale is None else scale.to(y.dtype).reshape(())
    v = (y / (s[..., None] if scale is None else s)).clamp(-fp8_max, fp8_max)
    _, e = torch.frexp(v)  # v = m * 2**e with 0.5 <= |m| < 1
    step = _exact_pow2((e - 1).clamp_min(min_exp - 127) - 3, v.dtype)  # 3 mantissa bits in v's binade
    return torch.round(v / step) * step, s  # torch.round rounds half to even


def fused_add_rms_norm_ref(x, residual, weight, eps=1e-6, cast_before_weight=True, fp8=None, fp8_scale=None,
                           fp8_dtype=torch.float8_e4m3fn, dtype=None):  # fmt: skip
    """fused_add_rms_norm's unfused math; dtype: where the model rounds (float64 x and bfloat16: a bf16 model's)."""
    dtype, f = dtype or x.dtype, torch.float64 if x.dtype == torch.float64 else torch.float32
    r = (x.to(f) + residual.to(f)).to(dtype)
    y = rms_norm_ref(r.to(f), weight, eps, cast_before_weight, f, round_dtype=dtype)
    if _fp8_mode(fp8) == 0:
        return y.to(dtype), r
    q, s = fp8_quantize_ref(y, fp8_dtype, fp8_scale if fp8 == "per_tensor" else None)
    return (q, r) if fp8 == "per_tensor" else (q, r, s)


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Check the RMSNorm kernels against a float64 reference on random inputs.")
    p.add_argument("--rows", type=int, default=64, help="rows (default 64)")
    p.add_argument("--width", type=int, default=2048, help="normalised width (default 2048)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rows", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (torch.cuda.is_available() or _interpreting()):
        p.exit(2, "no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter\n")
    dtype, tol = dict(fp32=(torch.float32, 1e-5), fp16=(torch.float16, 2e-3), bf16=(torch.bfloat16, 1.6e-2))[args.dtype]
    device, g, d = ("cpu" if _interpreting() else "cuda"), torch.Generator().manual_seed(args.seed), args.width
    x, y = (torch.randn(2, args.rows, d, generator=g).to(device, dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(device, dtype)
    sc, sh, gate = (0.1 * torch.randn(2, 1, d, generator=g).to(device, dtype) for _ in range(3))
    x64, y64, w64, sc64, sh64, gate64 = (t.double() for t in (x, y, w, sc, sh, gate))
    q, _, s = fused_add_rms_norm(x, y, w, fp8="per_token")
    q_ref, _, s_ref = fused_add_rms_norm_ref(x64, y64, w64, fp8="per_token", fp8_dtype=q.dtype, dtype=dtype)
    report = {}
    for name, out, ref, limit in (  # output, float64 reference, tolerance relative to 1 + |reference|
        ("rms_norm", rms_norm(x, w), rms_norm_ref(x64, w64), tol),
        ("rms_norm_modulate", rms_norm_modulate(x, sc, sh), rms_norm_modulate_ref(x64, sc64, sh64), tol),
        ("gated_residual_add", gated_residual_add(x, y, gate), gated_residual_add_ref(x64, y64, gate64), tol),
        ("gated_residual_rms_norm_modulate", torch.stack(gated_residual_rms_norm_modulate(x, y, gate, sc, sh)),
         torch.stack(gated_residual_rms_norm_modulate_ref(x64, y64, gate64, sc64, sh64)), tol),
        ("fused_add_rms_norm", torch.stack(fused_add_rms_norm(x, y, w)),
         torch.stack(fused_add_rms_norm_ref(x64, y64, w64, dtype=dtype)), tol),
        # FP8 after dequantisation: one FP8 step (2**-3 of the value) where the rounding differs
        ("fused_add_rms_norm_fp8_per_token", q.double() * s.double()[..., None], q_ref * s_ref[..., None], 0.13),
    ):  # fmt: skip
        err = ((out.double() - ref.double()).abs() / (1 + ref.double().abs())).max().item()
        report[name] = {"max_rel_err": err, "ok": err <= limit}
    off = float((q.double() != q_ref).double().mean())  # FP8 values one step off the reference
    report["fused_add_rms_norm_fp8_per_token"].update(fp8_dtype=str(q.dtype)[6:], fraction_one_step_off=off)
    ok = all(v["ok"] for v in report.values()) and off <= 0.05
    print(json.dumps({"device": device, "dtype": args.dtype, "checks": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

try:  # kernel_runtime.py beside this file adds launch plans, torch.library ops and device checks
    import kernel_runtime
except ImportError:
    pass
else:
    kernel_runtime.accelerate(globals(), rms_norm_fused="_launch", gated_residual_add="_add_launch")

# SPDX-License-Identifier: Apache-2.0
"""GELU, GEGLU and SwiGLU activations, elementwise, with fp32 math and one rounding to the output dtype.

    gelu(x)  = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))            (approximate="none")
    gelu(x) ~= 0.5 * x * (1 + tanh(u)) = x * sigmoid(2 * u),
               u = sqrt(2 / pi) * (x + 0.044715 * x**3)                  (approximate="tanh")
    geglu(x) = hidden * gelu(gate), with hidden, gate = x.chunk(2, dim=-1)
    swiglu   = silu(gate) * up = gate * sigmoid(gate) * up               (optional FP8 output)

Public functions:

* ``gelu(x, approximate="tanh")``: ``torch.nn.functional.gelu`` on any shape. Contiguous inputs are
  processed as one flat array; inputs whose last dim is contiguous but whose rows are strided (a
  slice, a transpose of leading dims, a broadcast) are read in place, without a copy. LTX-Video's
  feed-forward uses the tanh form (diffusers ``GELU(approximate="tanh")``). ``gelu_tanh(x)`` is
  ``gelu(x, "tanh")``.
* ``geglu(x, approximate="none")``: diffusers ``GEGLU`` after its projection: the FIRST half of the
  last dim is the value, the SECOND half goes through GELU (the gate). diffusers' GEGLU uses the
  exact (erf) GELU, hence the default. [..., 2H] -> [..., H]; H may be odd; rows may be strided.
* ``swiglu(x, gate_first=True)`` / ``swiglu(gate, up)``: the gated MLP of Llama-family LLMs. A fused
  [..., 2H] gate/up projection (first half the gate by default, as transformers' Phi-3 and vLLM lay it
  out) or two [..., H] tensors (Llama's gate_proj and up_proj outputs). Optional FP8 output with a given
  per-tensor scale or per-row scales computed in the kernel (``fp8="per_tensor"`` / ``"per_token"``):
  float8_e4m3fnuz (max 240) on gfx942, OCP float8_e4m3fn (max 448) elsewhere, or forced by
  ``fp8_dtype=``; values are saturated to +-fp8_max and rounded to nearest (ties to even), so a finite
  input never gives NaN: Triton's FP8 cast where the GPU has a conversion instruction for the format
  (NVIDIA sm_89+, gfx942, gfx950 from Triton 3.6), else an integer-arithmetic encoder with the same bytes
  (checked on an NVIDIA H200; the AMD cast paths are compiled, not yet run on AMD hardware).

One row kernel serves GELU on strided rows, GEGLU and SwiGLU (a constexpr picks the activation).
All are overflow-safe: the output is finite and correct for any finite input in every dtype
(gelu(x) == x and silu(x) == x for large positive x, -0.0 for large negative x). The ``*_ref`` functions are the
plain-PyTorch math the kernels replace (run them on float64 inputs to test). The file depends on
torch and triton only; copy it into another project as is. Run ``python activations.py --help``.
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
    "gelu",
    "gelu_tanh",
    "geglu",
    "swiglu",
    "fp8_quantize",
    "gelu_ref",
    "geglu_ref",
    "swiglu_ref",
    "fp8_quantize_ref",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_APPROXIMATIONS = ("none", "tanh")


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _gelu_f32(x, APPROX_TANH: tl.constexpr):
    """GELU of an fp32 block. Finite for every finite x; NaN in, NaN out."""
    if APPROX_TANH:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u). The cubic uses x clamped to +-20, so x**3 cannot
        # overflow (x = 1e13 in fp32 would give inf, and inf * 0 = NaN further on); at |x| = 20,
        # 2u = 603 and sigmoid(2u) is already exactly 1 (or 0) in fp32, so clamping changes nothing.
        xc = tl.minimum(tl.maximum(x, -20.0), 20.0)
        z = 1.5957691216057308 * xc * (1.0 + 0.044715 * xc * xc)  # 2u = 2 * sqrt(2 / pi) * (...)
        # Stable sigmoid: e = exp(-|z|) lies in (0, 1] and never overflows; for z < 0 the result is
        # e / (1 + e), which underflows to exactly 0, so gelu(-large) = x * 0 = -0.0, as in torch.
        e = tl.exp(-tl.abs(z))
        r = 1.0 / (1.0 + e)
        s = tl.where(z >= 0.0, r, e * r)
        return x * s
    else:
        # erf saturates to +-1 exactly, so the factor is exactly 1 (or 0) for large |x|.
        return x * (0.5 + 0.5 * tl.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_flat_kernel(
    X,  # contiguous input, read as a flat array of n_elements
    OUT,  # contiguous output, same dtype and element count as X
    n_elements,  # total element count
    APPROX_TANH: tl.constexpr,  # True: tanh approximation; False: exact erf form
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0).to(tl.int64)  # int64: tensors may exceed 2**31 elements
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if (pid + 1) * BLOCK <= n_elements:
        # Full block: no mask, so the loads and stores are 16-byte vectors whatever n_elements is.
        x = tl.load(X + offs).to(tl.float32)
        tl.store(OUT + offs, _gelu_f32(x, APPROX_TANH).to(OUT.dtype.element_ty))
    else:
        mask = offs < n_elements
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offs, _gelu_f32(x, APPROX_TANH).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _silu_f32(x):
    """x * sigmoid(x) = x / (1 + exp(-x)) of an fp32 block. Overflow-safe as written: below x = -88.7
    exp(-x) is inf and x / inf = -0.0 (torch gives -0.0 too); above, the denominator is finite. One exp
    and one division, no select: faster than the exp(-|x|) form with a select for SwiGLU at 1,024 x 4096
    on an H200, where the data sits in L2 and instructions count."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _act_f32(x, ACT: tl.constexpr):
    """ACT 0: exact (erf) GELU; 1: tanh-approximate GELU; 2: SiLU; 3: none (x itself: FP8 quantisation)."""
    if ACT == 3:
        return x
    elif ACT == 2:
        return _silu_f32(x)
    else:
        return _gelu_f32(x, ACT == 1)


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


@triton.jit
def _load_tile(ptrs, mask, EVEN: tl.constexpr):
    """EVEN: the tile lies wholly inside the tensor, so the load needs no mask (and no select)."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_tile(ptrs, value, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


@triton.jit
def _act_tile(X, U, x_row, u_row, cols, mask, ACT: tl.constexpr, EVEN: tl.constexpr):
    """fp32 act(x) of a tile, times the tile of U when there is one (gated)."""
    x = _load_tile(X + x_row[:, None] + cols[None, :], mask, EVEN).to(tl.float32)
    y = _act_f32(x, ACT)
    if U is not None:
        u = _load_tile(U + u_row[:, None] + cols[None, :], mask, EVEN).to(tl.float32)
        y = u * y
    return y


@triton.jit
def _block_ids(n_col_blocks, GRID_2D: tl.constexpr):
    """(row block, column block) of this program: the two grid axes when GRID_2D, else one axis, row
    block major."""
    if GRID_2D:
        return tl.program_id(1), tl.program_id(0)
    pid = tl.program_id(0)
    return pid // n_col_blocks, pid % n_col_blocks


@triton.jit
def _act_rows_kernel(
    X, x_stride_o, x_stride_i,  # activation input (the gate when U is given), last dim contiguous; row strides (see _row_layout)
    U, u_stride_o, u_stride_i,  # None, or the operand multiplied by act(X) (GEGLU's value, SwiGLU's up); same rules
    OUT,  # contiguous [M, N] output (FP8_MODE > 0: the FP8 output, or its uint8 view when not NATIVE_FP8)
    FP8_SCALE,  # FP8_MODE 1: one fp32 scale (read); FP8_MODE 2: [M] fp32 per-row scales (written); else None
    M, N, INNER,  # rows, output width, rows per outer index (row r -> outer r // INNER, inner r % INNER)
    # cdiv(N, BLOCK_N), 1 with FP8_MODE 2; used when not GRID_2D: program p covers row block
    # p // n_col_blocks, column block p % n_col_blocks
    n_col_blocks,
    ACT: tl.constexpr,  # 0: GELU (erf); 1: GELU (tanh approximation); 2: SiLU; 3: none (with FP8_MODE > 0)
    FP8_MODE: tl.constexpr,  # 0: no FP8; 1: static per-tensor scale; 2: dynamic per-row scales (whole rows per program)
    FP8_MAX: tl.constexpr,  # largest finite value of OUT's FP8 format (FP8_MODE > 0)
    FP8_MIN_EXP: tl.constexpr,  # fp32 biased exponent of its smallest normal (FP8_MODE > 0)
    FP8_NAN: tl.constexpr,  # its NaN code (FP8_MODE > 0)
    MIN_SCALE: tl.constexpr,  # lower bound of the per-row scales (FP8_MODE 2)
    NATIVE_FP8: tl.constexpr,  # FP8_MODE > 0: Triton's FP8 cast (see _fp8_convert), else _fp8_encode
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program (per step with FP8_MODE 2)
    SINGLE_PASS: tl.constexpr,  # FP8_MODE 2 and BLOCK_N >= N: the row is held in registers
    GRID_2D: tl.constexpr,  # grid (column blocks, row blocks): no division of the program id
    EVEN: tl.constexpr,  # M % BLOCK_M == 0 and N % BLOCK_N == 0: no masks on loads and stores
):  # fmt: skip
    # combinations the launcher never makes (a direct caller gets a compile error, not wrong output)
    tl.static_assert(ACT >= 0 and ACT <= 3, "ACT is 0 (GELU erf), 1 (GELU tanh), 2 (SiLU) or 3 (none)")
    tl.static_assert(ACT != 3 or FP8_MODE > 0, "ACT 3 (none) is for FP8 quantisation")
    tl.static_assert(FP8_MODE == 0 or FP8_MODE == 1 or FP8_MODE == 2, "FP8_MODE is 0, 1 or 2")
    tl.static_assert((FP8_SCALE is None) == (FP8_MODE == 0), "FP8_SCALE goes with FP8_MODE 1 or 2")
    tl.static_assert(FP8_MODE > 0 or not NATIVE_FP8, "NATIVE_FP8 needs FP8_MODE > 0")
    tl.static_assert(FP8_MODE == 2 or not SINGLE_PASS, "SINGLE_PASS needs FP8_MODE 2")
    # per-row scales need a row maximum: each program covers whole rows
    WHOLE_ROWS: tl.constexpr = FP8_MODE == 2
    pid_m, pid_n = _block_ids(n_col_blocks, GRID_2D)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    if not EVEN:
        rows = tl.where(row_mask, rows, 0)  # keep masked-off rows' addresses in bounds
    outer = (rows // INNER).to(tl.int64)
    inner = (rows % INNER).to(tl.int64)
    x_row = outer * x_stride_o + inner * x_stride_i
    u_row = outer * u_stride_o + inner * u_stride_i  # (unused without U)
    out_row = rows.to(tl.int64) * N
    if not WHOLE_ROWS:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        y = _act_tile(X, U, x_row, u_row, cols, mask, ACT, EVEN)
        if FP8_MODE == 1:
            # read on the device (no host sync); capped: a zero scale saturates instead of making 0 * inf
            inv_scale = tl.minimum(1.0 / tl.load(FP8_SCALE).to(tl.float32), 3.0e38)
            q = _fp8_convert(y * inv_scale, OUT, FP8_MAX, FP8_MIN_EXP, FP8_NAN, NATIVE_FP8)
            _store_tile(OUT + out_row[:, None] + cols[None, :], q, mask, EVEN)
        else:
            _store_tile(OUT + out_row[:, None] + cols[None, :], y.to(OUT.dtype.element_ty), mask, EVEN)
    else:
        cols0 = tl.arange(0, BLOCK_N)
        if SINGLE_PASS:
            # the whole row in registers: one read, one write
            mask = row_mask[:, None] & (cols0 < N)[None, :]
            y = _act_tile(X, U, x_row, u_row, cols0, mask, ACT, EVEN)
            # masked-off elements are act(0) * 0 = 0: they do not change the maximum
            row_scale = tl.maximum(tl.max(tl.abs(y), axis=1) / FP8_MAX, MIN_SCALE)
            _store_tile(FP8_SCALE + rows, row_scale, row_mask, EVEN)
            q = _fp8_convert(y * (1.0 / row_scale)[:, None], OUT, FP8_MAX, FP8_MIN_EXP, FP8_NAN, NATIVE_FP8)
            _store_tile(OUT + out_row[:, None] + cols0[None, :], q, mask, EVEN)
        else:
            # wide rows: a first pass finds the row maximum, a second recomputes and quantises
            amax = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = row_mask[:, None] & (cols < N)[None, :]
                amax = tl.maximum(amax, tl.abs(_act_tile(X, U, x_row, u_row, cols, mask, ACT, EVEN)))
            row_scale = tl.maximum(tl.max(amax, axis=1) / FP8_MAX, MIN_SCALE)
            _store_tile(FP8_SCALE + rows, row_scale, row_mask, EVEN)
            inv_row_scale = 1.0 / row_scale
            for start in range(0, N, BLOCK_N):
                cols = start + cols0
                mask = row_mask[:, None] & (cols < N)[None, :]
                y = _act_tile(X, U, x_row, u_row, cols, mask, ACT, EVEN)
                q = _fp8_convert(y * inv_row_scale[:, None], OUT, FP8_MAX, FP8_MIN_EXP, FP8_NAN, NATIVE_FP8)
                _store_tile(OUT + out_row[:, None] + cols[None, :], q, mask, EVEN)


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


def _check_approximate(approximate) -> bool:
    """Returns True for the tanh approximation."""
    if not isinstance(approximate, str) or approximate not in _APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh' (as in torch.nn.functional.gelu), got {approximate!r}")
    return approximate == "tanh"


# ---- shared block strides begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _mergeable(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True if these dims can be addressed as one flat index with a single stride."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))


def _flat_stride(shape: Sequence[int], strides: Sequence[int]) -> int:
    dims = [st for s, st in zip(shape, strides) if s != 1]
    return dims[-1] if dims else 0


# ---- shared block strides end ----


def _row_layout(x: torch.Tensor):
    """Express the leading dims of x as two levels: (inner, stride_o, stride_i).

    Row r of the flattened [M, N] problem starts at (r // inner) * stride_o + (r % inner) * stride_i.
    Finds a split point k of the leading dims such that dims [:k] and dims [k:] each collapse to one
    stride. No copy is ever made; a layout that needs more than two levels is rejected.
    """
    # Fast paths (the generic search below costs microseconds of host time per call):
    if x.is_contiguous():  # size-1 dims may carry any stride: use the row width, not stride(-2)
        return 1, x.shape[-1], 0
    if x.dim() == 2:
        return 1, x.stride(0), 0
    lead = list(x.shape[:-1])
    st = x.stride()[:-1]
    for k in range(len(lead), -1, -1):
        if _mergeable(lead[:k], st[:k]) and _mergeable(lead[k:], st[k:]):
            inner = 1
            for s in lead[k:]:
                inner *= s
            return max(inner, 1), _flat_stride(lead[:k], st[:k]), _flat_stride(lead[k:], st[k:])
    raise ValueError(
        "the leading dimensions of x cannot be addressed with two strides "
        f"(shape {tuple(x.shape)}, strides {tuple(x.stride())}); call .contiguous() on x first"
    )


def _row_layout_pair(a: torch.Tensor, b: torch.Tensor):
    """One two-level row layout shared by two tensors of one shape: (inner, (a_o, a_i), (b_o, b_i))."""
    ia, ao, ai = _row_layout(a)
    ib, bo, bi = _row_layout(b)
    if ia == ib:
        return ia, (ao, ai), (bo, bi)
    lead = list(a.shape[:-1])
    sa, sb = a.stride()[:-1], b.stride()[:-1]
    for k in range(len(lead), -1, -1):
        if all(_mergeable(lead[:k], st[:k]) and _mergeable(lead[k:], st[k:]) for st in (sa, sb)):
            inner = 1
            for sz in lead[k:]:
                inner *= sz
            return (
                max(inner, 1),
                (_flat_stride(lead[:k], sa[:k]), _flat_stride(lead[k:], sa[k:])),
                (_flat_stride(lead[:k], sb[:k]), _flat_stride(lead[k:], sb[k:])),
            )
    raise ValueError(
        "the leading dimensions of gate and up cannot be addressed with one pair of row levels "
        f"(shape {tuple(a.shape)}, strides {tuple(a.stride())} and {tuple(b.stride())}); call .contiguous() on one"
    )


# Lanes (threads) per program: 8 warps of 32 or 4 wavefronts of 64. 256 lanes with two 16-byte
# vectors each keep 8 KiB of loads in flight per program; with several programs resident per
# compute unit that covers HBM latency. GELU-tanh reaches 92.8 % of copy bandwidth at [2, 6144, 8192]
# bf16 on an H200 (examples/benchmark_kernels_ltx_h200.json); blocks of 1024-8192 elements x 2-16 warps
# were within ~5 % of each other there (unrecorded).
_LANES = 256
_VECTORS_PER_LANE = 2


# ---- shared block sizes begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a constexpr_function, microseconds per host call


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n; 1 for every n <= 1 (0 included)."""
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


# ---- shared block sizes end ----


@functools.lru_cache(maxsize=1024)  # pure function of its arguments; saves host time per call
def _launch_config(n_elements: int, row_width: int, elem_bytes: int, warp_size: int, flat: bool):
    """Block shape and warps: (BLOCK_M, BLOCK_N, num_warps); BLOCK_M is 1 for the flat kernel.

    Flat kernel (GELU of a contiguous input): every lane loads 16-byte vectors (8 bf16/fp16 or 4 fp32
    elements), _VECTORS_PER_LANE of them, so a full-size program covers _LANES * 16 B * 2 = 8 KiB of
    input (4096 bf16 or 2048 fp32 elements). Small inputs get a smaller block (fewer warps) so that
    several programs share the work instead of one program running mostly masked lanes.

    Row kernel (GEGLU, SwiGLU, GELU of strided rows), budgeted on the output: one 16-byte vector per
    lane and operand (2048 bf16 outputs per program of 8 warps) and, while that leaves fewer than
    _MIN_ROW_PROGRAMS programs, down to 4 bytes per lane (512 bf16 outputs): at decode sizes the time is
    latency, and spreading a row over more programs with less work per lane shortens it. Narrow rows
    are packed several to a program (BLOCK_M) to the same budget (2048 outputs beat 4096 at 1,024 rows,
    512 beat 2048 at one row). With the kernel's 2D grid, unmasked tiles and SiLU form, SwiGLU got 13-22 %
    faster at 1-1,024 rows on an H200 (references/kernel-rope-activations.md). The threshold is the H200's (132
    SMs); untuned on AMD.
    """
    vec = max(1, 16 // elem_bytes)
    num_warps = max(1, _LANES // warp_size)
    if flat:
        target = _LANES * vec * _VECTORS_PER_LANE
        # Keep at least ~1024 programs when the input allows it (4-8 per compute unit on GPUs with
        # 132-304 SMs/CUs), but never go below one vector per lane.
        while target > _LANES * vec and _cdiv(n_elements, target) < 1024:
            target //= 2
        block = min(target, max(_next_pow2(n_elements), 16))
        warps = max(1, min(num_warps, block // (warp_size * vec)))
        return 1, block, warps
    target = _LANES * vec
    while target > _LANES * max(1, vec // 4) and _cdiv(n_elements, target) < _MIN_ROW_PROGRAMS:
        target //= 2
    block_n = min(_next_pow2(max(row_width, 1)), target)
    n_rows = max(1, n_elements // max(row_width, 1))
    block_m = max(1, min(target // block_n, _next_pow2(n_rows)))
    warps = max(1, min(num_warps, (block_m * block_n) // warp_size))
    return block_m, block_n, warps


# Row kernel: the smallest grid worth keeping before shrinking blocks further (see _launch_config).
_MIN_ROW_PROGRAMS = 256
# Largest second grid dimension: CUDA's gridDim.y limit, applied on every backend (HIP's limit for
# that dimension is not assumed to be larger). Beyond it the row kernel runs on a one-dimensional grid
# and divides the program id instead.
_MAX_GRID_Y = 65535


def _row_grid(m: int, n: int, block_m: int, block_n: int, whole_rows: bool = False):
    """(grid, GRID_2D, n_col_blocks, EVEN) of _act_rows_kernel over m rows of n outputs. whole_rows: each
    program walks its rows in BLOCK_N steps (one column block)."""
    n_row_blocks = _cdiv(m, block_m)
    n_col_blocks = 1 if whole_rows else _cdiv(n, block_n)
    even = m % block_m == 0 and n % block_n == 0
    if n_row_blocks <= _MAX_GRID_Y:
        return (n_col_blocks, n_row_blocks), True, n_col_blocks, even
    return (n_row_blocks * n_col_blocks,), False, n_col_blocks, even


# Dynamic (per-row) FP8 scales need a row's maximum before any of it is quantised, so each program
# covers whole rows: rows up to _MAX_WHOLE_ROW elements are held in registers (one read), wider rows
# are read twice in _ROW_CHUNK-wide steps (maximum, then quantise).
_MAX_WHOLE_ROW = 16384
_ROW_CHUNK = 4096


@functools.lru_cache(maxsize=1024)
def _whole_row_config(n_cols: int, n_rows: int, warp_size: int, max_whole: int, chunk: int):
    """(BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps) for whole-row programs.

    About 16 elements per lane per operand (two 16-byte bf16 vectors), so that fewer warps shorten the
    row maximum's cross-warp reduction: 1-11 % faster than 8 per lane at 4096- and 16384-wide rows with
    FP8 output on an H200. Short rows are packed several to a program so that each program still moves
    a few KiB; at most 1024 lanes (a workgroup's limit: 16 wave64 warps on CDNA).
    """
    single = n_cols <= max_whole
    block_n = _next_pow2(n_cols) if single else chunk
    block_m = max(1, min(16, 4096 // block_n, _next_pow2(max(n_rows, 1))))
    warps = max(1, min(1024 // warp_size, (block_m * block_n) // (warp_size * 16)))
    return block_m, block_n, single, warps


# --------------------------------------------------------------------------------------------
# FP8 output
# --------------------------------------------------------------------------------------------
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


_PLANS: dict = {}  # launch plans by call signature (see _gelu_launch)


def _gelu_launch(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """Validate and launch GELU; returns out.

    The checks and the configuration depend only on the call's signature (x's type, shape, strides,
    dtype and device, and approximate), so they run once per signature: the plan they produce is kept
    and later calls with the same signature only allocate the output and launch.
    """
    try:
        key = ("gelu", _sig(x), approximate)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable option: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _gelu_plan(x, approximate)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x)


def _gelu_plan(x: torch.Tensor, approximate: str):
    """The checks and configuration of _gelu_launch; returns run(x) -> out."""
    _check_tensor("x", x, _SUPPORTED_DTYPES)
    approx_tanh = _check_approximate(approximate)
    device, dtype, shape_t = x.device, x.dtype, tuple(x.shape)
    n_elements = x.numel()
    if n_elements == 0:

        def run_empty(x):
            return torch.empty(shape_t, dtype=dtype, device=device)

        return run_empty
    like_x = _dense_like(x)  # the output is contiguous; empty_like costs less host time where it gives the same
    _, _, warp_size = _device_target(device)
    if x.is_contiguous():
        _, block, warps = _launch_config(n_elements, n_elements, x.element_size(), warp_size, flat=True)
        launch = _Launch(
            _gelu_flat_kernel,
            (_cdiv(n_elements, block),),
            (None, None, n_elements),
            dict(APPROX_TANH=approx_tanh, BLOCK=block, num_warps=warps),
            (0, 1),
            device,
        )
    else:
        n = x.shape[-1]
        if x.stride(-1) != 1 and n > 1:
            raise ValueError(
                f"x must be contiguous in its last dimension (stride {x.stride(-1)}); call .contiguous() on x first"
            )
        m = n_elements // n
        inner, stride_o, stride_i = _row_layout(x)
        block_m, block_n, warps = _launch_config(n_elements, n, x.element_size(), warp_size, flat=False)
        grid, grid_2d, n_col_blocks, even = _row_grid(m, n, block_m, block_n)
        # X per call; U None (not gated); OUT per call; FP8_SCALE None
        launch = _Launch(
            _act_rows_kernel,
            grid,
            (None, stride_o, stride_i, None, 0, 0, None, None, m, n, inner, n_col_blocks),
            dict(
                ACT=int(approx_tanh),
                FP8_MODE=0,
                FP8_MAX=0.0,
                FP8_MIN_EXP=0,
                FP8_NAN=0,
                MIN_SCALE=0.0,
                NATIVE_FP8=False,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                SINGLE_PASS=False,
                GRID_2D=grid_2d,
                EVEN=even,
                num_warps=warps,
            ),
            (0, 6),
            device,
        )

        def run_rows(x):
            out = torch.empty(shape_t, dtype=dtype, device=device)  # x is not contiguous: no empty_like
            launch(x, out)
            return out

        return run_rows

    def run_flat(x):
        out = torch.empty_like(x) if like_x else torch.empty(shape_t, dtype=dtype, device=device)
        launch(x, out)
        return out

    return run_flat


def _geglu_launch(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """Validate and launch GEGLU; returns out. Plans kept per call signature, as in _gelu_launch."""
    try:
        key = ("geglu", _sig(x), approximate)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is None:
        plan = _geglu_plan(x, approximate)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, None, None)[0]


def _geglu_plan(x: torch.Tensor, approximate: str):
    """The checks and configuration of _geglu_launch; returns run(x, None, None) -> (out, None)."""
    _check_tensor("x", x, _SUPPORTED_DTYPES)
    approx_tanh = _check_approximate(approximate)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the last one is split into value and gate)")
    two_h = x.shape[-1]
    if two_h % 2:
        raise ValueError(f"the last dim of x must be even (value and gate halves of width H each), got {two_h}")
    h = two_h // 2
    # diffusers GEGLU: value first, gate second
    return _gated_plan(x[..., h:], x[..., :h], x, int(approx_tanh), 0, None, None, gate_second=True)


def _swiglu_launch(x, up, gate_first, fp8_mode: int, fp8_scale, fp8_dtype):
    """Validate and launch SwiGLU; returns (out, row scales or None). Plans kept per call signature, as
    in _gelu_launch."""
    try:
        key = (
            "swiglu",
            _sig(x),
            up if up is None else _sig(up),
            gate_first,
            fp8_mode,
            fp8_scale if fp8_scale is None else _sig(fp8_scale),
            fp8_dtype,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is None:
        plan = _swiglu_plan(x, up, gate_first, fp8_mode, fp8_scale, fp8_dtype)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, up, fp8_scale)


def _swiglu_plan(x, up, gate_first, fp8_mode: int, fp8_scale, fp8_dtype):
    """The checks and configuration of _swiglu_launch; returns run(x, up, fp8_scale) -> (out, row scales
    or None)."""
    if up is None:
        _check_tensor("x", x, _SUPPORTED_DTYPES)
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension (the last one is split into gate and up)")
        two_h = x.shape[-1]
        if two_h % 2:
            raise ValueError(f"the last dim of x must be even (gate and up halves of width H each), got {two_h}")
        h = two_h // 2
        first, second = x[..., :h], x[..., h:]
        gate, up_v = (first, second) if gate_first else (second, first)
        return _gated_plan(gate, up_v, x, 2, fp8_mode, fp8_scale, fp8_dtype, gate_second=not gate_first)
    _check_tensor("gate", x, _SUPPORTED_DTYPES)
    _check_tensor("up", up, _SUPPORTED_DTYPES, x.device, ref="gate")
    if up.dtype != x.dtype:
        raise TypeError(f"up has dtype {up.dtype} but gate has dtype {x.dtype}; they must match")
    if up.shape != x.shape:
        raise ValueError(f"up has shape {tuple(up.shape)} but gate has shape {tuple(x.shape)}; they must match")
    if x.dim() == 0:
        raise ValueError("gate and up must have at least one dimension")
    return _gated_plan(x, up, None, 2, fp8_mode, fp8_scale, fp8_dtype)


def _gated_layout(gate, up, parent):
    """(inner, gate row strides, up row strides) of the two operands (see _row_layout); parent: the [..., 2H]
    tensor both are views of (one layout for both), or None. up None: one operand, gate (no product)."""
    if up is None and parent is None:
        _check_last_contiguous("x", gate)
        inner, g_o, g_i = _row_layout(gate)
        return inner, (g_o, g_i), (0, 0)
    if parent is None:
        _check_last_contiguous("gate", gate)
        _check_last_contiguous("up", up)
        return _row_layout_pair(gate, up)
    if parent.stride(-1) != 1:
        raise ValueError(
            f"x must be contiguous in its last dimension (stride {parent.stride(-1)}); call .contiguous() on x first"
        )
    inner, g_o, g_i = _row_layout(parent)
    return inner, (g_o, g_i), (g_o, g_i)


def _act_fp8_launch(x, act: int, fp8_mode: int, fp8_scale, fp8_dtype):
    """Validate and launch act(x) with FP8 output (act 3: x itself); returns (out, row scales or None).
    Plans kept per call signature, as in _gelu_launch."""
    try:
        key = ("act_fp8", _sig(x), act, fp8_mode, fp8_scale if fp8_scale is None else _sig(fp8_scale), fp8_dtype)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):
        key = plan = None
    if plan is None:
        _check_tensor("x", x, _SUPPORTED_DTYPES)
        if x.dim() == 0:
            raise ValueError("x must have at least one dimension (its last one is a row)")
        if fp8_mode not in (1, 2):
            raise ValueError(f"fp8 must be 'per_tensor' or 'per_token' here, got mode {fp8_mode!r}")
        plan = _gated_plan(x, None, None, act, fp8_mode, fp8_scale, fp8_dtype)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, None, fp8_scale)


def _gated_plan(gate, up, parent, act: int, fp8_mode: int, fp8_scale, fp8_dtype, gate_second=False):
    """The checks and configuration of out = up * act(gate) for views gate/up of one shape [..., H];
    parent: the [..., 2H] tensor both are views of (one row layout for both), or None for two separate
    tensors.

    Returns run(x, up, fp8_scale) -> (out, row scales or None). With a parent, x is the parent (up is
    not used): its second half x[..., H:] is the gate when gate_second, else the up operand, and the
    other operand is x itself (the first half starts at x's address). Without, x is the gate. up and
    parent both None: out = act(gate) (with FP8 output; act 3 quantises gate itself).
    """
    device = gate.device
    if fp8_mode:
        out_dtype = _check_fp8(device, fp8_dtype, fp8_mode, fp8_scale)
        fp8_format, native_fp8 = _FP8_FORMATS[out_dtype], _native_fp8(device, out_dtype)
    else:
        out_dtype, fp8_format, native_fp8 = gate.dtype, (0.0, 0, 0), False
    shape_t = tuple(gate.shape)
    rows_t = shape_t[:-1]
    n_out = gate.numel()
    if n_out == 0:

        def run_empty(x, up, fp8_scale):
            out = torch.empty(shape_t, dtype=out_dtype, device=device)
            return out, (torch.empty(rows_t, dtype=torch.float32, device=device) if fp8_mode == 2 else None)

        return run_empty
    h = gate.shape[-1]
    inner, (g_o, g_i), (u_o, u_i) = _gated_layout(gate, up, parent)
    m = n_out // h
    _, _, warp_size = _device_target(device)
    if fp8_mode == 2:
        block_m, block_n, single, warps = _whole_row_config(h, m, warp_size, _MAX_WHOLE_ROW, _ROW_CHUNK)
    else:
        # Budget the tile on the output size: each output element reads two inputs.
        block_m, block_n, warps = _launch_config(n_out, h, gate.element_size(), warp_size, flat=False)
        single = False
    grid, grid_2d, n_col_blocks, even = _row_grid(m, h, block_m, block_n, whole_rows=fp8_mode == 2)
    # per call: X (gate), U (up), OUT and, with FP8, FP8_SCALE (the given scale or the per-row scales)
    launch = _Launch(
        _act_rows_kernel,
        grid,
        (None, g_o, g_i, None, u_o, u_i, None, None, m, h, inner, n_col_blocks),
        dict(
            ACT=act,
            **_fp8_constexprs(fp8_mode, fp8_format, native_fp8),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            SINGLE_PASS=single,
            GRID_2D=grid_2d,
            EVEN=even,
            num_warps=warps,
        ),
        (0, 3 if up is not None or parent is not None else None, 6, 7 if fp8_mode else None),
        device,
    )
    # the output has gate's shape: empty_like where gate is a dense plain tensor of the output dtype
    like_gate = parent is None and out_dtype == gate.dtype and _dense_like(gate)
    dense_fp8 = bool(fp8_mode) and not native_fp8  # stored through a uint8 view (see _fp8_convert)
    split = parent is not None

    def run(x, up, fp8_scale):
        if split:
            half = x[..., h:]  # the one view a call makes: the other half starts at x's own address
            g, u = (half, x) if gate_second else (x, half)
        else:
            g, u = x, up
        out = torch.empty_like(g) if like_gate else torch.empty(shape_t, dtype=out_dtype, device=device)
        if not fp8_mode:
            launch(g, u, out)
            return out, None
        if fp8_mode == 2:
            row_scales = torch.empty(rows_t, dtype=torch.float32, device=device)
            launch(g, u, out.view(torch.uint8) if dense_fp8 else out, row_scales)
            return out, row_scales
        launch(g, u, out.view(torch.uint8) if dense_fp8 else out, fp8_scale)
        return out, None

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


def _gelu_op(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return _gelu_launch(x, approximate)


def _gelu_op_fake(x, approximate):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


_register("gelu", _gelu_op, _gelu_op_fake)


def _geglu_op(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return _geglu_launch(x, approximate)


def _geglu_op_fake(x, approximate):
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)


_register("geglu", _geglu_op, _geglu_op_fake)


def _swiglu_op(
    x: torch.Tensor,
    up: Optional[torch.Tensor],
    gate_first: bool,
    fp8_mode: int,
    fp8_scale: Optional[torch.Tensor],
    fp8_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor]:
    out, row_scales = _swiglu_launch(x, up, gate_first, fp8_mode, fp8_scale, fp8_dtype)
    # custom ops cannot return None: without per-row scales the second output is empty
    return out, (row_scales if row_scales is not None else x.new_empty(0, dtype=torch.float32))


def _swiglu_op_fake(x, up, gate_first, fp8_mode, fp8_scale, fp8_dtype):
    h = x.shape[-1] if up is not None else x.shape[-1] // 2
    dtype = (fp8_dtype or _fp8_dtype_for(x.device)) if fp8_mode else x.dtype
    out = torch.empty((*x.shape[:-1], h), dtype=dtype, device=x.device)
    if fp8_mode == 2:
        return out, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    return out, x.new_empty(0, dtype=torch.float32)


_register("swiglu", _swiglu_op, _swiglu_op_fake)


def _act_fp8_op(
    x: torch.Tensor, act: int, fp8_mode: int, fp8_scale: Optional[torch.Tensor], fp8_dtype: Optional[torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor]:
    out, row_scales = _act_fp8_launch(x, act, fp8_mode, fp8_scale, fp8_dtype)
    return out, (row_scales if row_scales is not None else x.new_empty(0, dtype=torch.float32))


def _act_fp8_op_fake(x, act, fp8_mode, fp8_scale, fp8_dtype):
    out = torch.empty(x.shape, dtype=fp8_dtype or _fp8_dtype_for(x.device), device=x.device)
    if fp8_mode == 2:
        return out, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    return out, x.new_empty(0, dtype=torch.float32)


_register("act_fp8", _act_fp8_op, _act_fp8_op_fake)


def _act_fp8(x, act: int, fn: str, fp8, fp8_scale, fp8_dtype):
    """act(x) quantised to FP8 (see gelu's fp8=): out_fp8, or (out_fp8, scales) per token."""
    mode = _fp8_options(fp8, fp8_scale, fp8_dtype)
    if torch.compiler.is_compiling():
        out, row_scales = _compile_op("act_fp8")(x, act, mode, fp8_scale, fp8_dtype)
    else:
        _check_no_grad(fn, ("x", "fp8_scale"), (x, fp8_scale))
        out, row_scales = _act_fp8_launch(x, act, mode, fp8_scale, fp8_dtype)
    return (out, row_scales) if mode == 2 else out


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def gelu(
    x: torch.Tensor,
    approximate: str = "tanh",
    *,
    fp8: Optional[str] = None,
    fp8_scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
):
    """torch.nn.functional.gelu(x, approximate) for fp32/fp16/bf16 x of any shape.

    The result is contiguous, of x's shape and dtype. Rows may be strided as long as the last dim is
    contiguous. Note the default: "tanh" (LTX-Video, diffusers "gelu-approximate"); torch's default
    is "none". With FP8 output (the input of an FP8 GEMM, e.g. a feed-forward's down projection),
    quantised from the fp32 value:
      fp8="per_tensor": out_fp8 = fp8(clamp(out / fp8_scale, +-fp8_max)), fp8_scale a one-element
        float32 tensor on x's device;
      fp8="per_token": (out_fp8, scales), scales[row] = max(max|out[row]| / fp8_max, 1e-12), float32,
        shape x.shape[:-1]; dequantise as out_fp8.float() * scales[..., None].
    fp8_dtype: None picks float8_e4m3fnuz on gfx942 and float8_e4m3fn elsewhere.
    The kernel has no backward: in grad mode, an input that requires grad raises RuntimeError (call it
    under torch.no_grad() / torch.inference_mode(), or use gelu_ref where gradients are needed).
    """
    if fp8 is not None or fp8_scale is not None or fp8_dtype is not None:
        return _act_fp8(x, int(_check_approximate(approximate)), "gelu", fp8, fp8_scale, fp8_dtype)
    if torch.compiler.is_compiling():
        return _compile_op("gelu")(x, approximate)
    # Eager: call the launcher directly; the custom-op dispatcher costs microseconds per call.
    _check_no_grad("gelu", ("x",), (x,))
    return _gelu_launch(x, approximate)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """gelu(x, approximate="tanh"): torch.nn.functional.gelu(x, approximate="tanh").
    No backward: in grad mode, an input that requires grad raises RuntimeError (see gelu)."""
    if torch.compiler.is_compiling():
        return _compile_op("gelu")(x, "tanh")
    _check_no_grad("gelu_tanh", ("x",), (x,), ref='gelu_ref(x, "tanh")')
    return _gelu_launch(x, "tanh")


def geglu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """diffusers GEGLU after its projection: value, gate = x.chunk(2, -1); value * gelu(gate).

    x is [..., 2H] with a contiguous last dim (rows may be strided); the result is a contiguous
    [..., H] of x's dtype, computed in fp32 and rounded once. The default "none" (erf) is what
    diffusers' GEGLU uses.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see gelu).
    """
    if torch.compiler.is_compiling():
        return _compile_op("geglu")(x, approximate)
    _check_no_grad("geglu", ("x",), (x,))
    return _geglu_launch(x, approximate)


def swiglu(
    x: torch.Tensor,
    up: Optional[torch.Tensor] = None,
    *,
    gate_first: Optional[bool] = None,
    fp8: Optional[str] = None,
    fp8_scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
):
    """SwiGLU of an LLM MLP: silu(gate) * up, computed in fp32 and rounded once.

    swiglu(x): x is a fused gate/up projection [..., 2H]; gate_first (default True) says the FIRST half
      is the gate, as in transformers' Phi-3 (gate_up_proj then chunk(2)) and vLLM's SiluAndMul;
      gate_first=False for checkpoints that store [up | gate].
    swiglu(gate, up): two [..., H] tensors, e.g. Llama's gate_proj(x) and up_proj(x) (LlamaMLP computes
      down_proj(silu(gate_proj(x)) * up_proj(x))). Same shape and dtype; rows may be strided.
    Returns a contiguous [..., H] tensor of the input dtype, or with FP8 output:
      fp8="per_tensor": out_fp8 = fp8(clamp(out / fp8_scale, +-fp8_max)), fp8_scale a one-element
        float32 tensor on the input's device;
      fp8="per_token": (out_fp8, scales) with scales[row] = max(max|out[row]| / fp8_max, 1e-12), float32,
        shape [...]; dequantise as out_fp8.float() * scales[..., None].
    fp8_dtype: None picks float8_e4m3fnuz on gfx942 and float8_e4m3fn elsewhere; pass either to force it.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see gelu).
    """
    mode = _fp8_options(fp8, fp8_scale, fp8_dtype)
    if up is not None and gate_first is not None:
        raise ValueError("gate_first applies to the fused [..., 2H] input only; with two tensors the first is the gate")
    gate_first = True if gate_first is None else bool(gate_first)
    if torch.compiler.is_compiling():
        out, row_scales = _compile_op("swiglu")(x, up, gate_first, mode, fp8_scale, fp8_dtype)
    else:
        # Eager: call the launcher directly; the custom-op dispatcher costs microseconds per call.
        _check_no_grad(
            "swiglu", ("x", "up", "fp8_scale") if up is None else ("gate", "up", "fp8_scale"), (x, up, fp8_scale)
        )
        out, row_scales = _swiglu_launch(x, up, gate_first, mode, fp8_scale, fp8_dtype)
    return (out, row_scales) if mode == 2 else out


def fp8_quantize(
    x: torch.Tensor,
    fp8: str = "per_token",
    *,
    fp8_scale: Optional[torch.Tensor] = None,
    fp8_dtype: Optional[torch.dtype] = None,
):
    """x quantised to FP8 in one pass (the input of an FP8 GEMM whose producer cannot emit FP8 itself,
    e.g. an attention output): fp8="per_token" (default) returns (x_fp8, scales) with scales[row] =
    max(max|x[row]| / fp8_max, 1e-12), float32, shape x.shape[:-1]; fp8="per_tensor" returns
    x_fp8 = fp8(clamp(x / fp8_scale, +-fp8_max)). fp32/fp16/bf16 x, rows may be strided (last dim
    contiguous). fp8_dtype: None picks float8_e4m3fnuz on gfx942 and float8_e4m3fn elsewhere.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see gelu).
    """
    if fp8 is None:
        raise ValueError("fp8 must be 'per_tensor' or 'per_token'")
    return _act_fp8(x, 3, "fp8_quantize", fp8, fp8_scale, fp8_dtype)


# --------------------------------------------------------------------------------------------
# References: the plain-PyTorch math each kernel replaces (run them in float64 for testing)
# --------------------------------------------------------------------------------------------
def gelu_ref(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """torch.nn.functional.gelu; exact values when x is float64."""
    return torch.nn.functional.gelu(x, approximate=approximate)


def geglu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """diffusers GEGLU.forward after self.proj: the second half of the last dim is the gate."""
    value, gate = x.chunk(2, dim=-1)
    return value * torch.nn.functional.gelu(gate, approximate=approximate)


def swiglu_ref(x: torch.Tensor, up: Optional[torch.Tensor] = None, gate_first: bool = True) -> torch.Tensor:
    """silu(gate) * up in x's precision (exact values when float64); x is [..., 2H] when up is None."""
    if up is None:
        first, second = x.chunk(2, dim=-1)
        x, up = (first, second) if gate_first else (second, first)
    return torch.nn.functional.silu(x) * up


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


# --------------------------------------------------------------------------------------------
# Self-check: python activations.py [--rows R] [--width N] [--dtype bf16] [--bench]
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(
        description="Check gelu/geglu/swiglu against a float64 reference on random inputs (and optionally time them)."
    )
    p.add_argument("--rows", type=int, default=64, help="rows (default 64)")
    p.add_argument("--width", type=int, default=2048, help="row width; geglu/swiglu read 2 * width (default 2048)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bench",
        action="store_true",
        help="GPU only: also time gelu/geglu/swiglu against torch on a [2, rows, width] input with "
        "triton.testing.do_bench",
    )
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
    wide = (3 * torch.randn(args.rows, 2 * args.width, generator=g)).to(device, dtype)
    strided = wide[:, : args.width]  # rows strided by 2 * width, no copy
    sign = torch.where(torch.rand(args.width, generator=g) < 0.5, -1.0, 1.0)
    big = (sign * 10 ** (4 * torch.rand(args.width, generator=g))).to(device, dtype)  # |x| in [1, 1e4]
    checks = {
        "gelu_tanh": (gelu(x, "tanh"), gelu_ref(x.double(), "tanh")),
        "gelu_erf": (gelu(x, "none"), gelu_ref(x.double(), "none")),
        "gelu_tanh_strided_rows": (gelu(strided, "tanh"), gelu_ref(strided.double(), "tanh")),
        "gelu_tanh_large_magnitude": (gelu(big, "tanh"), gelu_ref(big.double(), "tanh")),
        "gelu_erf_large_magnitude": (gelu(big, "none"), gelu_ref(big.double(), "none")),
        "geglu_erf": (geglu(wide, "none"), geglu_ref(wide.double(), "none")),
        "geglu_tanh": (geglu(wide, "tanh"), geglu_ref(wide.double(), "tanh")),
        "swiglu": (swiglu(wide), swiglu_ref(wide.double())),
        "swiglu_two_tensors": (swiglu(wide[:, : args.width], wide[:, args.width :]), swiglu_ref(wide.double())),
    }
    # FP8 (per-row dynamic scales) is compared after dequantisation with the float64 quantize-dequantize
    # reference; one FP8 step (2**-3 of the value) is allowed where the rounding differs
    q, s8 = swiglu(wide, fp8="per_token")
    q_ref, s_ref = fp8_quantize_ref(swiglu_ref(wide.double()), q.dtype)
    checks["swiglu_fp8_per_token"] = (q.double() * s8.double()[:, None], q_ref * s_ref[:, None])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    tols = {"swiglu_fp8_per_token": 0.13}
    report, ok = {}, True
    for name, (out, ref) in checks.items():
        err = ((out.double() - ref).abs() / (1 + ref.abs())).max().item()
        good = bool(err <= tols.get(name, tol) and torch.isfinite(out).all().item())
        report[name] = {"max_rel_err": err, "ok": good}
        ok &= good
    fp8_mismatch = float((q.double() != q_ref).double().mean())
    report["swiglu_fp8_per_token"].update(
        fp8_dtype=str(q.dtype).replace("torch.", ""), fraction_one_step_off=fp8_mismatch
    )
    ok &= fp8_mismatch <= 0.05
    result = {"device": str(device), "dtype": args.dtype, "checks": report, "ok": bool(ok)}
    if args.bench:
        if device == "cpu":
            print("--bench needs a GPU", file=sys.stderr)
            return 2
        from triton.testing import do_bench

        f = torch.nn.functional
        xb = torch.randn(2, args.rows, args.width, device=device, dtype=dtype)
        xg = torch.randn(2, args.rows, 2 * args.width, device=device, dtype=dtype)
        nbytes = xb.numel() * xb.element_size()
        cases = {
            "gelu_tanh": (lambda: gelu(xb, "tanh"), lambda: f.gelu(xb, approximate="tanh"), 2 * nbytes),
            "gelu_erf": (lambda: gelu(xb, "none"), lambda: f.gelu(xb), 2 * nbytes),
            "geglu_erf": (lambda: geglu(xg, "none"), lambda: geglu_ref(xg, "none"), 3 * nbytes),
            "swiglu": (lambda: swiglu(xg), lambda: swiglu_ref(xg), 3 * nbytes),
        }
        bench = {}
        for name, (fn, ref_fn, moved) in cases.items():
            ms = do_bench(fn, return_mode="median")
            ms_ref = do_bench(ref_fn, return_mode="median")
            bench[name] = {"ms": ms, "GB_s": moved / ms / 1e6, "torch_ms": ms_ref, "speedup": ms_ref / ms}
        result["bench"] = {"shape": [2, args.rows, args.width], **bench}
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

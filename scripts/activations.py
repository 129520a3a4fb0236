# SPDX-License-Identifier: Apache-2.0
"""GELU, GEGLU and SwiGLU activations, elementwise, with fp32 math and one rounding to the output dtype.

    gelu(x)  = x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))            (approximate="none")
    gelu(x) ~= x * sigmoid(2 * u), u = sqrt(2 / pi) * (x + 0.044715 * x**3)  (approximate="tanh")
    geglu(x) = hidden * gelu(gate), with hidden, gate = x.chunk(2, dim=-1)
    swiglu   = silu(gate) * up = gate * sigmoid(gate) * up               (optional FP8 output)
    gelu_mul(gate, up) = gelu(gate) * up, of two tensors                 (tanh GELU by default)

Public: gelu, gelu_tanh, geglu, swiglu, gelu_mul, fp8_quantize, each with a plain-PyTorch ``*_ref`` (run it on
float64). Strided rows are read in place; outputs are finite for finite inputs. FP8 output (fp8="per_tensor" or
"per_token"): e4m3fnuz on gfx942, OCP e4m3fn elsewhere, saturated and rounded to nearest even. Depends on torch
and triton only; ``python activations.py --help`` runs its self-check."""

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
# FP8 dtype -> (largest finite value, fp32 biased exponent of the smallest normal, NaN code)
_FP8_FORMATS = {torch.float8_e4m3fn: (448.0, 127 - 6, 0x7F), torch.float8_e4m3fnuz: (240.0, 127 - 7, 0x80)}
_FP8_MODES = {None: 0, "per_tensor": 1, "per_token": 2}
_MIN_DYNAMIC_SCALE = 1e-12  # per-token scales never go below it: a zero row stays finite (no 0 * inf)
_TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
_LANES, _VECTORS_PER_LANE = 256, 2  # 8 warps of 32 (4 of 64), two 16-byte vectors each: 8 KiB in flight a program
_MIN_ROW_PROGRAMS = 256  # row kernel: the smallest grid worth keeping before shrinking blocks further
_MAX_GRID_Y = 65535  # CUDA's gridDim.y limit, on every backend; beyond it a 1-D grid divides the program id
_MAX_WHOLE_ROW, _ROW_CHUNK = 16384, 4096  # per-row FP8 scales: wider rows are read twice, in _ROW_CHUNK steps


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


def _check(name: str, t, device=None, ref="x", dtypes=_SUPPORTED_DTYPES) -> None:
    """Refuse t unless a tensor of one of dtypes, contiguous in its last dim and on device if given (ref: whose)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        expected = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {expected}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but {ref} is on {device}; move them to one device")
    if t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")


def _check_approximate(approximate) -> int:
    """The kernels' ACT of a GELU approximation: 0 for "none" (erf), 1 for "tanh"."""
    if not isinstance(approximate, str) or approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh' (as in torch.nn.functional.gelu), got {approximate!r}")
    return int(approximate == "tanh")


def _gated(x: Tensor, up: Optional[Tensor], halves: Optional[str], gate_first: bool = True):
    """(gate, up, parent) of up * act(gate). halves "first,second": x is a [..., 2H] parent, the gate its first half
    (the second unless gate_first); halves None: x is the gate, up a tensor of its shape, dtype and device."""
    if halves is None:
        _check("gate", x)
        _check("up", up, x.device, ref="gate")
        if up.dtype != x.dtype:
            raise TypeError(f"up has dtype {up.dtype} but gate has dtype {x.dtype}; they must match")
        if up.shape != x.shape:
            raise ValueError(f"up has shape {tuple(up.shape)} but gate has shape {tuple(x.shape)}; they must match")
        if x.dim() == 0:
            raise ValueError("gate and up must have at least one dimension")
        return x, up, None
    _check("x", x)
    first, second = halves.split(",")
    if x.dim() == 0:
        raise ValueError(f"x must have at least one dimension (the last one is split into {first} and {second})")
    if x.shape[-1] % 2:
        raise ValueError(f"the last dim of x must be even (halves {first} and {second}), got {x.shape[-1]}")
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return (a, b, x) if gate_first else (b, a, x)


def _row_layouts(*tensors):
    """(inner, [(stride_o, stride_i) per tensor]): row r starts at (r // inner) * stride_o + (r % inner) * stride_i."""
    if len(tensors) == 1 and tensors[0].is_contiguous():  # size-1 dims may carry any stride: use the row width
        return 1, [(tensors[0].shape[-1], 0)]

    def flat(sizes, strides):  # the one stride addressing these dims as one index, or None
        dims = [(s, st) for s, st in zip(sizes, strides) if s != 1]
        return (dims[-1][1] if dims else 0) if all(a[1] == b[1] * b[0] for a, b in zip(dims, dims[1:])) else None

    lead = list(tensors[0].shape[:-1])
    for k in range(len(lead), -1, -1):
        layouts = [(flat(lead[:k], t.stride()[:k]), flat(lead[k:], t.stride()[k:-1])) for t in tensors]
        if all(None not in lay for lay in layouts):
            return max(math.prod(lead[k:]), 1), layouts
    raise ValueError(
        "the leading dimensions of the inputs cannot be addressed with two strides (shape "
        f"{tuple(tensors[0].shape)}, strides {[t.stride() for t in tensors]}); call .contiguous() first"
    )


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


def _launch_config(n_elements: int, row_width: int, elem_bytes: int, warp_size: int, flat: bool):
    """(BLOCK_M, BLOCK_N, num_warps). Flat (BLOCK_M 1): 8 KiB per program, halved for small inputs to keep ~1024
    programs (4-8 per compute unit). Rows: a 16-byte vector per lane and operand, down to 4 bytes while under
    _MIN_ROW_PROGRAMS programs (decode sizes are latency-bound; SwiGLU 13-22 % faster at 1-1,024 rows, H200)."""
    vec = max(1, 16 // elem_bytes)
    num_warps = max(1, _LANES // warp_size)
    if flat:
        target = _LANES * vec * _VECTORS_PER_LANE
        while target > _LANES * vec and -(-n_elements // target) < 1024:
            target //= 2
        block = min(target, max(_next_pow2(n_elements), 16))
        return 1, block, max(1, min(num_warps, block // (warp_size * vec)))
    target = _LANES * vec
    while target > _LANES * max(1, vec // 4) and -(-n_elements // target) < _MIN_ROW_PROGRAMS:
        target //= 2
    block_n = min(_next_pow2(max(row_width, 1)), target)
    block_m = max(1, min(target // block_n, _next_pow2(max(1, n_elements // max(row_width, 1)))))
    return block_m, block_n, max(1, min(num_warps, (block_m * block_n) // warp_size))


def _whole_row_config(n_cols: int, n_rows: int, warp_size: int, max_whole: int, chunk: int):
    """(BLOCK_M, BLOCK_N, SINGLE_PASS, num_warps) for per-row FP8 scales: ~16 elements per lane (fewer warps,
    shorter cross-warp max: 1-11 % faster than 8 on an H200); at most 1024 lanes (a workgroup's limit)."""
    single = n_cols <= max_whole
    block_n = _next_pow2(n_cols) if single else chunk
    block_m = max(1, min(16, 4096 // block_n, _next_pow2(max(n_rows, 1))))
    return block_m, block_n, single, max(1, min(1024 // warp_size, (block_m * block_n) // (warp_size * 16)))


def _row_grid(m: int, n: int, block_m: int, block_n: int, whole_rows: bool = False):
    """(grid, GRID_2D, n_col_blocks, EVEN) of _act_rows_kernel over m rows of n outputs."""
    n_row_blocks, n_col_blocks = -(-m // block_m), 1 if whole_rows else -(-n // block_n)
    even = m % block_m == 0 and n % block_n == 0
    if n_row_blocks <= _MAX_GRID_Y:
        return (n_col_blocks, n_row_blocks), True, n_col_blocks, even
    return (n_row_blocks * n_col_blocks,), False, n_col_blocks, even


def _gelu_launch(x: Tensor, approximate: str) -> Tensor:
    """GELU: the flat kernel for a contiguous x, else the row kernel."""
    _check("x", x)
    act = _check_approximate(approximate)
    if not x.is_contiguous() and x.numel() > 0:
        return _rows_launch(x, None, None, act, 0, None, None)[0]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if (n := x.numel()) > 0:
        _, block, warps = _launch_config(n, n, x.element_size(), _device_target(x.device)[2], True)
        _gelu_flat_kernel[(-(-n // block),)](x, out, n, APPROX_TANH=act == 1, BLOCK=block, num_warps=warps)
    return out


def _geglu_launch(x: Tensor, approximate: str) -> Tensor:
    gate, up, parent = _gated(x, None, "value,gate", gate_first=False)
    return _rows_launch(gate, up, parent, _check_approximate(approximate), 0, None, None)[0]


def _swiglu_launch(x: Tensor, up: Optional[Tensor], gate_first: bool, fp8_mode: int, fp8_scale: Optional[Tensor],
                   fp8_dtype: Optional[torch.dtype]) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    gate, up, parent = _gated(x, up, "gate,up" if up is None else None, gate_first)
    return _rows_launch(gate, up, parent, 2, fp8_mode, fp8_scale, fp8_dtype)


def _gelu_mul_launch(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    gate, up, _ = _gated(gate, up, None)
    return _rows_launch(gate, up, None, _check_approximate(approximate), 0, None, None)[0]


def _act_fp8_launch(x: Tensor, act: int, fp8_mode: int, fp8_scale: Optional[Tensor], fp8_dtype: Optional[torch.dtype]
                    ) -> tuple[Tensor, Optional[Tensor]]:  # fmt: skip
    """act(x) with FP8 output (act 0 / 1: GELU erf / tanh, 3: x itself)."""
    _check("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (its last one is a row)")
    if fp8_mode not in (1, 2):
        raise ValueError(f"fp8 must be 'per_tensor' or 'per_token' here, got mode {fp8_mode!r}")
    return _rows_launch(x, None, None, act, fp8_mode, fp8_scale, fp8_dtype)


def _rows_launch(gate, up, parent, act: int, fp8_mode: int, fp8_scale, fp8_dtype):
    """(up * act(gate), per-row FP8 scales or None) over rows of views [..., H] (up None: act(gate)) on
    _act_rows_kernel; parent: the [..., 2H] tensor gate and up are halves of, or None."""
    device = gate.device
    if fp8_mode == 1:
        if fp8_scale is None:
            raise ValueError("fp8='per_tensor' needs fp8_scale: a one-element float32 tensor (out = y / fp8_scale)")
        _check("fp8_scale", fp8_scale, device, "the input", (torch.float32,))
        if fp8_scale.numel() != 1:
            raise ValueError(f"fp8_scale must hold one element (shape [] or [1]), got shape {tuple(fp8_scale.shape)}")
    elif fp8_scale is not None:
        raise ValueError("fp8_scale is only used with fp8='per_tensor' (fp8='per_token' computes the scales)")
    out_dtype = (_fp8_dtype_for(device) if fp8_dtype is None else fp8_dtype) if fp8_mode else gate.dtype
    if fp8_mode and out_dtype not in _FP8_FORMATS:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {out_dtype}")
    out = torch.empty(gate.shape, dtype=out_dtype, device=device)
    scales = torch.empty(gate.shape[:-1], dtype=torch.float32, device=device) if fp8_mode == 2 else None
    if gate.numel() == 0:
        return out, scales
    h, m, warp_size = gate.shape[-1], gate.numel() // gate.shape[-1], _device_target(device)[2]
    inner, layouts = _row_layouts(*((parent,) if parent is not None else (t for t in (gate, up) if t is not None)))
    (g_o, g_i), (u_o, u_i) = layouts[0], layouts[-1] if up is not None else (0, 0)
    if fp8_mode == 2:
        block_m, block_n, single, warps = _whole_row_config(h, m, warp_size, _MAX_WHOLE_ROW, _ROW_CHUNK)
    else:  # the tile is budgeted on the output: each output element reads two inputs
        (block_m, block_n, warps), single = _launch_config(m * h, h, gate.element_size(), warp_size, False), False
    grid, grid_2d, n_col_blocks, even = _row_grid(m, h, block_m, block_n, whole_rows=fp8_mode == 2)
    fp8_max, fp8_min_exp, fp8_nan = _FP8_FORMATS[out_dtype] if fp8_mode else (0.0, 0, 0)
    native = bool(fp8_mode) and _native_fp8(device, out_dtype)
    _act_rows_kernel[grid](
        gate, g_o, g_i, up, u_o, u_i,
        out.view(torch.uint8) if fp8_mode and not native else out,  # _fp8_encode's codes go through a uint8 view
        fp8_scale if fp8_mode == 1 else scales, m, h, inner, n_col_blocks,
        ACT=act, FP8_MODE=fp8_mode, FP8_MAX=fp8_max, FP8_MIN_EXP=fp8_min_exp, FP8_NAN=fp8_nan,
        MIN_SCALE=_MIN_DYNAMIC_SCALE, NATIVE_FP8=native, BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single,
        GRID_2D=grid_2d, EVEN=even, num_warps=warps,
    )  # fmt: skip
    return out, scales


def _no_backward(fn: str, names: str, *tensors, ref=None) -> None:
    """In grad mode, refuse an input that requires grad: the kernels have no backward, so gradients would stop."""
    for name, t in zip(names.split(","), tensors) if torch.is_grad_enabled() else ():
        if getattr(t, "requires_grad", False):
            ref = ref or fn + "_ref"
            raise RuntimeError(
                f"{fn}: {name} requires grad, but this Triton kernel has no backward (gradients would silently stop): "
                f"call {fn} under torch.no_grad() or torch.inference_mode(), or use the PyTorch reference ({ref})"
            )


def _fp8_mode(fp8, fp8_scale=None, fp8_dtype=None) -> int:
    """The FP8 mode of fp8= (0: none, 1: per tensor, 2: per token), refusing options the mode does not use."""
    if not (fp8 is None or isinstance(fp8, str)) or fp8 not in _FP8_MODES:
        raise ValueError(f"fp8 must be None, 'per_tensor' or 'per_token', got {fp8!r}")
    if fp8_dtype is not None and fp8 is None:
        raise ValueError("fp8_dtype is only used with fp8='per_tensor' or fp8='per_token'")
    if fp8 != "per_tensor" and fp8_scale is not None:
        raise ValueError("fp8_scale is only used with fp8='per_tensor' (fp8='per_token' computes the scales)")
    return _FP8_MODES[fp8]


def gelu(x: Tensor, approximate: str = "tanh", *, fp8=None, fp8_scale=None, fp8_dtype=None):
    """torch.nn.functional.gelu(x, approximate) for fp32/fp16/bf16 x of any shape (last dim contiguous), contiguous,
    of x's dtype; default "tanh" (LTX-Video), torch's is "none". fp8="per_tensor": fp8(clamp(out / fp8_scale)),
    fp8_scale a one-element float32 tensor; "per_token": (out_fp8, scales), scales[row] = max(max|out[row]| /
    fp8_max, 1e-12); fp8_dtype None: the device's. No backward: an input requiring grad raises in grad mode."""
    mode = _fp8_mode(fp8, fp8_scale, fp8_dtype)
    _no_backward("gelu", "x,fp8_scale", x, fp8_scale)
    if mode == 0:
        return _gelu_launch(x, approximate)
    out, scales = _act_fp8_launch(x, _check_approximate(approximate), mode, fp8_scale, fp8_dtype)
    return (out, scales) if mode == 2 else out


def gelu_tanh(x: Tensor) -> Tensor:
    """gelu(x, approximate="tanh"): torch.nn.functional.gelu(x, approximate="tanh"). No backward."""
    _no_backward("gelu_tanh", "x", x, ref='gelu_ref(x, "tanh")')
    return _gelu_launch(x, "tanh")


def geglu(x: Tensor, approximate: str = "none") -> Tensor:
    """diffusers GEGLU after its projection: value, gate = x.chunk(2, -1); value * gelu(gate). x: [..., 2H];
    returns a contiguous [..., H] of x's dtype. Default "none" (erf), as diffusers. No backward."""
    _no_backward("geglu", "x", x)
    return _geglu_launch(x, approximate)


def swiglu(x: Tensor, up: Optional[Tensor] = None, *, gate_first=None, fp8=None, fp8_scale=None, fp8_dtype=None):
    """silu(gate) * up of an LLM MLP: swiglu(x) of a fused [..., 2H] (gate_first, default True: the first half is
    the gate; False for [up | gate]) or swiglu(gate, up) of two [..., H] tensors; FP8 output as gelu's. No backward."""
    mode = _fp8_mode(fp8, fp8_scale, fp8_dtype)
    if up is not None and gate_first is not None:
        raise ValueError("gate_first applies to the fused [..., 2H] input only; with two tensors the first is the gate")
    _no_backward("swiglu", "x,up,fp8_scale" if up is None else "gate,up,fp8_scale", x, up, fp8_scale)
    out, scales = _swiglu_launch(x, up, True if gate_first is None else bool(gate_first), mode, fp8_scale, fp8_dtype)
    return (out, scales) if mode == 2 else out


def gelu_mul(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    """gelu(gate) * up of two [..., H] tensors of one shape, dtype and device: Gemma 2 / 3's gated MLP (tanh
    GELU by default). Returns a contiguous [..., H] tensor of the input dtype. No backward."""
    _no_backward("gelu_mul", "gate,up", gate, up)
    return _gelu_mul_launch(gate, up, approximate)


def fp8_quantize(x: Tensor, fp8: str = "per_token", *, fp8_scale=None, fp8_dtype=None):
    """x quantised to FP8 in one pass as gelu's FP8 output: (x_fp8, scales) per token, x_fp8 per tensor. No backward."""
    if fp8 is None:
        raise ValueError("fp8 must be 'per_tensor' or 'per_token'")
    mode = _fp8_mode(fp8, fp8_scale, fp8_dtype)
    _no_backward("fp8_quantize", "x,fp8_scale", x, fp8_scale)
    out, scales = _act_fp8_launch(x, 3, mode, fp8_scale, fp8_dtype)
    return (out, scales) if mode == 2 else out


def gelu_ref(x: Tensor, approximate: str = "tanh") -> Tensor:
    return torch.nn.functional.gelu(x, approximate=approximate)


def geglu_ref(x: Tensor, approximate: str = "none") -> Tensor:
    return gelu_mul_ref(*x.chunk(2, dim=-1)[::-1], approximate)  # value, gate = x.chunk(2, -1)


def gelu_mul_ref(gate: Tensor, up: Tensor, approximate: str = "tanh") -> Tensor:
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


def swiglu_ref(x: Tensor, up: Optional[Tensor] = None, gate_first: bool = True) -> Tensor:
    if up is None:
        x, up = x.chunk(2, dim=-1)[:: 1 if gate_first else -1]
    return torch.nn.functional.silu(x) * up


def fp8_quantize_ref(y: Tensor, fp8_dtype=torch.float8_e4m3fn, scale=None):
    """Saturating round-to-nearest-even FP8 in y's precision: (q, s), y ~ q * s, s per row (as in-kernel) or scale."""
    fp8_max, min_exp, _ = _FP8_FORMATS[fp8_dtype]
    s = (y.abs().amax(-1) / fp8_max).clamp_min(_MIN_DYNAMIC_SCALE) if scale is None else scale.to(y.dtype).reshape(())
    v = (y / (s[..., None] if scale is None else s)).clamp(-fp8_max, fp8_max)
    _, e = torch.frexp(v)  # v = m * 2**e with 0.5 <= |m| < 1
    k = ((e - 1).clamp_min(min_exp - 127) - 3).to(torch.int64)  # 3 mantissa bits in v's binade
    f64 = v.dtype == torch.float64  # 2**k from its exponent bits: exact on every device
    step = ((k + 1023) << 52).view(torch.float64) if f64 else ((k + 127) << 23).to(torch.int32).view(torch.float32)
    return torch.round(v / step.to(v.dtype)) * step.to(v.dtype), s  # torch.round rounds half to even


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Check the activation kernels against a float64 reference.")
    p.add_argument("--rows", type=int, default=64, help="rows (default 64)")
    p.add_argument("--width", type=int, default=2048, help="row width; geglu/swiglu read 2 * width (default 2048)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rows", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (torch.cuda.is_available() or _interpreting()):
        p.exit(2, "no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter\n")
    dtype, tol = dict(fp32=(torch.float32, 1e-5), fp16=(torch.float16, 2e-3), bf16=(torch.bfloat16, 1.6e-2))[args.dtype]
    device, w, g = ("cpu" if _interpreting() else "cuda"), args.width, torch.Generator().manual_seed(args.seed)
    x = (3 * torch.randn(args.rows, 2 * w, generator=g)).to(device, dtype)
    a, b = x[:, :w], x[:, w:]  # strided rows
    (q, s), (qa, sa) = swiglu(x, fp8="per_token"), fp8_quantize(a)
    (q_ref, s_ref), (qa_ref, sa_ref) = (fp8_quantize_ref(y, q.dtype) for y in (swiglu_ref(x.double()), a.double()))
    report = {}
    for name, out, ref, limit in (  # output, float64 reference, tolerance relative to 1 + |reference|
        ("gelu_erf", gelu(x, "none"), gelu_ref(x.double(), "none"), tol),
        ("gelu_tanh", gelu_tanh(a), gelu_ref(a.double(), "tanh"), tol),
        ("geglu_erf", geglu(x, "none"), geglu_ref(x.double(), "none"), tol),
        ("swiglu", swiglu(x), swiglu_ref(x.double()), tol),
        ("swiglu_two_tensors", swiglu(a, b), swiglu_ref(x.double()), tol),
        ("gelu_mul_tanh", gelu_mul(a, b), gelu_mul_ref(a.double(), b.double()), tol),
        # FP8 after dequantisation: one FP8 step (2**-3 of the value) where the rounding differs
        ("swiglu_fp8_per_token", q.double() * s.double()[:, None], q_ref * s_ref[:, None], 0.13),
        ("fp8_quantize_per_token", qa.double() * sa.double()[:, None], qa_ref * sa_ref[:, None], 0.13),
    ):
        err = ((out.double() - ref).abs() / (1 + ref.abs())).max().item()
        report[name] = {"max_rel_err": err, "ok": err <= limit and bool(torch.isfinite(out).all())}
    off = float((q.double() != q_ref).double().mean())  # FP8 values one step off the reference
    report["swiglu_fp8_per_token"].update(fp8_dtype=str(q.dtype)[6:], fraction_one_step_off=off)
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
    kernel_runtime.accelerate(globals(), gelu="_gelu_launch", geglu="_geglu_launch", swiglu="_swiglu_launch",
                              gelu_mul="_gelu_mul_launch", act_fp8="_act_fp8_launch")  # fmt: skip

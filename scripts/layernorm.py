# SPDX-License-Identifier: Apache-2.0
"""LayerNorm over the last dimension, optionally fused with AdaLN modulation and a gated residual.

    h   = h + gate * y                                          (optional: gated residual, h returned too)
    out = ((x - mean(x)) / sqrt(var(x) + eps) [* w] [+ b]) * (1 + scale) + shift   (parts optional)
    with the biased variance over the last dim, all arithmetic in fp32, one rounding per output.

One Triton kernel (an absent operand passed as None is compiled out) for diffusers' MMDiT norms (SD3, FLUX).
Public: layer_norm, layer_norm_modulate (AdaLN), layer_norm_modulate_dual, gated_residual_layer_norm_modulate and
..._dual, each with a plain-PyTorch ``*_ref``. scale / shift / gate broadcast to x as in torch; a 2-D [B, D] for x
[B, S, D] with B != S is one row per sample (diffusers' ``emb.chunk(6, dim=1)`` views, read in place); [X, D] with
X == B == S > 1 is ambiguous and refused. Torch and triton only; ``python layernorm.py --help``: self-check."""

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
_MAX_FUSED_N, _CHUNK_N = 16384, 4096  # rows up to _MAX_FUSED_N normalised from registers, wider in _CHUNK_N chunks
# LayerNorm + one modulation over single-pass rows runs on a persistent grid (see _persistent_config)
_PERSISTENT = True
_INTERPRETER_PROGRAMS = 3  # the persistent grid under the interpreter: CPU tests run its row loop


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
def _affine_modulate(y, W, BIAS, MOD, rows, cols, mask):
    """Normalised fp32 rows y -> (* w) (+ b), then * (1 + scale) + shift (MOD: see _modulation)."""
    if W is not None:
        # at the tile's full shape, in its register layout (a [BLOCK_N] load costs a conversion through LDS)
        w = tl.load(W + (cols[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32)
        y = y * w
    if BIAS is not None:
        b = tl.load(BIAS + (cols[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32)
        y = y + b
    if MOD is not None:
        SCALE, SHIFT, s_row, t_row = MOD
        sc = tl.load(SCALE + s_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(SHIFT + t_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = y * (1.0 + sc) + sh
    return y


@triton.jit
def _load_raw(X, Y, GATE, x_row, y_row, g_row, cols, mask):
    """The tiles of x, y and gate as stored (0.0 for an absent one)."""
    x = tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0)
    yv = 0.0
    g = 0.0
    if Y is not None:
        yv = tl.load(Y + y_row[:, None] + cols[None, :], mask=mask, other=0.0)
        if GATE is not None:
            g = tl.load(GATE + g_row[:, None] + cols[None, :], mask=mask, other=0.0)
    return x, yv, g


@triton.jit
def _residual(x, yv, g, H_OUT, GATE, out_row, cols, mask):
    """fp32 x; with H_OUT, h = x + gate * y (GATE: whether gated) rounded to h's dtype, stored and returned."""
    x = x.to(tl.float32)
    if H_OUT is not None:
        yv = yv.to(tl.float32)
        if GATE is not None:
            yv = g.to(tl.float32) * yv
        h = (x + yv).to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + out_row[:, None] + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)  # normalise the stored (rounded) h, as the unfused model does
    return x


@triton.jit
def _reread_rows(X, H_OUT, x_row, out_row, cols, mask):
    """fp32 tiles of the normalised input again (a later pass): the stored h with a residual, else x."""
    if H_OUT is not None:
        return tl.load(H_OUT + out_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _load_mod(MOD, cols, mask, PRE: tl.constexpr):
    """fp32 tiles of MOD's scale and shift when PRE (requested early), else 0.0 placeholders."""
    sc = 0.0
    sh = 0.0
    if PRE:
        SCALE, SHIFT, s_row, t_row = MOD
        sc = tl.load(SCALE + s_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sh = tl.load(SHIFT + t_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return sc, sh


@triton.jit
def _finish_rows(
    y, W, BIAS, MOD, MOD2, OUT, OUT2, out_row, rows, cols, mask, sc=0.0, sh=0.0, PRE: tl.constexpr = False
):
    """Normalised fp32 rows y -> affine, modulation(s), stores (OUT2 too); PRE: scale, shift are sc, sh (_load_mod)."""
    if MOD2 is not None:
        y2 = _affine_modulate(y, W, BIAS, MOD2, rows, cols, mask)
        tl.store(OUT2 + out_row[:, None] + cols[None, :], y2.to(OUT2.dtype.element_ty), mask=mask)
    if PRE:
        y = _affine_modulate(y, W, BIAS, None, rows, cols, mask)
        y = y * (1.0 + sc) + sh
    else:
        y = _affine_modulate(y, W, BIAS, MOD, rows, cols, mask)
    tl.store(OUT + out_row[:, None] + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _load_chunks(X, Y, GATE, x_row, y_row, g_row, row_mask, N, BLOCK_N: tl.constexpr, NCH: tl.constexpr):
    """A single-pass row block as stored: the (x, y, gate) tiles of chunks 0, 1, 2 (1 and 2 only when NCH == 3)."""
    cols0 = tl.arange(0, BLOCK_N)
    c0 = _load_raw(X, Y, GATE, x_row, y_row, g_row, cols0, row_mask[:, None] & (cols0 < N)[None, :])
    c1 = (0.0, 0.0, 0.0)
    c2 = (0.0, 0.0, 0.0)
    if NCH == 3:
        m1 = row_mask[:, None] & (cols0 + BLOCK_N < N)[None, :]
        m2 = row_mask[:, None] & (cols0 + 2 * BLOCK_N < N)[None, :]
        c1 = _load_raw(X, Y, GATE, x_row, y_row, g_row, cols0 + BLOCK_N, m1)
        c2 = _load_raw(X, Y, GATE, x_row, y_row, g_row, cols0 + 2 * BLOCK_N, m2)
    return c0, c1, c2


@triton.jit
def _single_pass_rows(
    chunks, H_OUT, GATE, W, BIAS, MOD, MOD2, OUT, OUT2, rows, row_mask, out_row, N, eps, BLOCK_N: tl.constexpr,
    NCH: tl.constexpr,
):  # fmt: skip
    """Normalise a row block held in registers (_load_chunks' tiles): one chunk of the next power of two above N, or
    three (N = 3 * BLOCK_N: SD3's 1536, FLUX's 3072; no lane idles), each reduction once over the chunks' sum."""
    cols0 = tl.arange(0, BLOCK_N)
    c1 = cols0 + BLOCK_N
    c2 = cols0 + 2 * BLOCK_N
    m0 = row_mask[:, None] & (cols0 < N)[None, :]
    m1 = row_mask[:, None] & (c1 < N)[None, :]
    m2 = row_mask[:, None] & (c2 < N)[None, :]
    # With a residual, scale and shift are requested before the reductions so that their latency overlaps them
    # (about 2 % faster at SD3's and FLUX's shapes on an H200); without one that was 1-2 % slower (loaded after).
    PRE: tl.constexpr = H_OUT is not None and MOD is not None and MOD2 is None
    x0, y0, g0 = chunks[0]
    x0 = _residual(x0, y0, g0, H_OUT, GATE, out_row, cols0, m0)
    sc0, sh0 = _load_mod(MOD, cols0, m0, PRE)
    tot = x0
    if NCH == 3:
        x1, y1, g1 = chunks[1]
        x2, y2, g2 = chunks[2]
        x1 = _residual(x1, y1, g1, H_OUT, GATE, out_row, c1, m1)
        x2 = _residual(x2, y2, g2, H_OUT, GATE, out_row, c2, m2)
        sc1, sh1 = _load_mod(MOD, c1, m1, PRE)
        sc2, sh2 = _load_mod(MOD, c2, m2, PRE)
        tot = x0 + x1 + x2
    mean = tl.sum(tot, axis=1)[:, None] / N
    d0 = tl.where(m0, x0 - mean, 0.0)
    ss = d0 * d0
    if NCH == 3:
        d1 = x1 - mean
        d2 = x2 - mean
        ss = ss + d1 * d1 + d2 * d2
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1)[:, None] / N + eps)
    _finish_rows(d0 * rstd, W, BIAS, MOD, MOD2, OUT, OUT2, out_row, rows, cols0, m0, sc0, sh0, PRE)
    if NCH == 3:
        _finish_rows(d1 * rstd, W, BIAS, MOD, MOD2, OUT, OUT2, out_row, rows, c1, m1, sc1, sh1, PRE)
        _finish_rows(d2 * rstd, W, BIAS, MOD, MOD2, OUT, OUT2, out_row, rows, c2, m2, sc2, sh2, PRE)


@triton.jit
def _multi_pass_rows(
    X, Y, GATE, H_OUT, W, BIAS, MOD, MOD2, OUT, OUT2, x_row, y_row, g_row, out_row, rows, row_mask, N, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """A row block too wide for registers, in three passes of BLOCK_N columns: the mean (and h, stored once), the
    variance around it (no cancellation, unlike a sum of squares), then normalise, affine, modulate and store."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x, yv, g = _load_raw(X, Y, GATE, x_row, y_row, g_row, cols, mask)
        acc += _residual(x, yv, g, H_OUT, GATE, out_row, cols, mask)
    mean = tl.sum(acc, axis=1) / N
    if H_OUT is not None:
        tl.debug_barrier()  # the next passes re-read h written by other lanes of this program
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _reread_rows(X, H_OUT, x_row, out_row, cols, mask)
        xc = tl.where(mask, x - mean[:, None], 0.0)
        acc += xc * xc
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _reread_rows(X, H_OUT, x_row, out_row, cols, mask)
        _finish_rows((x - mean[:, None]) * rstd[:, None], W, BIAS, MOD, MOD2, OUT, OUT2, out_row, rows, cols, mask)


@triton.jit
def _layer_norm_kernel(
    X, x_stride_o, x_stride_i,  # input rows (the residual stream h when Y is given); last dim contiguous
    Y, y_stride_o, y_stride_i,  # branch output added to h (None: no residual)
    GATE, g_stride_o, g_stride_i,  # gate multiplying Y (None: no gate), broadcast strides
    H_OUT, W, BIAS,  # contiguous [M, N] output of the updated residual h (with Y); weight, bias [N] (None: none)
    SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i,  # modulation (None: none), broadcast strides
    SCALE2, s2_stride_o, s2_stride_i, SHIFT2, t2_stride_o, t2_stride_i,  # second modulation (None: none)
    OUT, OUT2,  # contiguous [M, N] outputs (OUT2: the second modulation's)
    M, N, INNER, eps,  # rows, row width, rows per outer index (row r -> r // INNER, r % INNER), epsilon
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # rows per program (step); columns per step (SINGLE_PASS: chunk)
    SINGLE_PASS: tl.constexpr, NCH: tl.constexpr,  # a row block in registers (one read, one write) in 1 or 3 chunks
    X_DENSE: tl.constexpr, Y_DENSE: tl.constexpr,  # row r of X (Y) starts at r * x_stride_i (y_stride_i)
    PERSISTENT: tl.constexpr,  # SINGLE_PASS: program p takes row blocks p, p + G, ... (G programs)
):  # fmt: skip
    # flag combinations the launcher never makes (a direct caller gets a compile error, not wrong output)
    tl.static_assert((Y is None) == (H_OUT is None), "Y and H_OUT come together")
    tl.static_assert(Y is not None or (GATE is None and not Y_DENSE), "GATE and Y_DENSE need Y")
    tl.static_assert((SCALE is None) == (SHIFT is None), "SCALE and SHIFT come together")
    tl.static_assert(
        (SCALE2 is None) == (SHIFT2 is None) and (SHIFT2 is None) == (OUT2 is None),
        "SCALE2, SHIFT2, OUT2 come together",
    )
    tl.static_assert(SCALE is not None or SCALE2 is None, "SCALE2 needs SCALE")
    tl.static_assert(NCH == 1 or (NCH == 3 and SINGLE_PASS), "NCH is 1, or 3 with SINGLE_PASS")
    tl.static_assert(SINGLE_PASS or not PERSISTENT, "PERSISTENT needs SINGLE_PASS")
    eps = tl.cast(eps, tl.float32)  # Inductor passes Python floats as fp64 (a triton_op launch); Triton as fp32
    pid = tl.program_id(0)
    rows, row_mask, outer, inner = _row_block(pid * BLOCK_M + tl.arange(0, BLOCK_M), M, INNER)
    x_row = _row_start(rows, outer, inner, x_stride_o, x_stride_i, X_DENSE)
    y_row = _row_start(rows, outer, inner, y_stride_o, y_stride_i, Y_DENSE)
    g_row = _row_start(rows, outer, inner, g_stride_o, g_stride_i)
    if SINGLE_PASS and PERSISTENT:
        # A fixed number of programs, each looping over row blocks; the next block's inputs are requested before
        # this block's reductions, so a program keeps loads in flight while it reduces and stores.
        G = tl.num_programs(0)
        chunks = _load_chunks(X, Y, GATE, x_row, y_row, g_row, row_mask, N, BLOCK_N, NCH)
        for blk0 in range(pid, tl.cdiv(M, BLOCK_M), G):
            blk = blk0 + 0 * pid  # a tensor under the interpreter too
            rows, row_mask, outer, inner = _row_block(blk * BLOCK_M + tl.arange(0, BLOCK_M), M, INNER)
            out_row = rows.to(tl.int64) * N
            mod = _modulation(SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i, outer, inner)
            mod2 = _modulation(SCALE2, s2_stride_o, s2_stride_i, SHIFT2, t2_stride_o, t2_stride_i, outer, inner)
            # the next block (all masked off past the last one)
            nr, nm, no, ni = _row_block((blk + G) * BLOCK_M + tl.arange(0, BLOCK_M), M, INNER)
            nx = _row_start(nr, no, ni, x_stride_o, x_stride_i, X_DENSE)
            ny = _row_start(nr, no, ni, y_stride_o, y_stride_i, Y_DENSE)
            nxt = _load_chunks(X, Y, GATE, nx, ny, _row_start(nr, no, ni, g_stride_o, g_stride_i), nm, N, BLOCK_N, NCH)
            _single_pass_rows(
                chunks, H_OUT, GATE, W, BIAS, mod, mod2, OUT, OUT2, rows, row_mask, out_row, N, eps, BLOCK_N, NCH
            )
            chunks = nxt
    else:
        out_row = rows.to(tl.int64) * N
        mod = _modulation(SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i, outer, inner)
        mod2 = _modulation(SCALE2, s2_stride_o, s2_stride_i, SHIFT2, t2_stride_o, t2_stride_i, outer, inner)
        if SINGLE_PASS:
            chunks = _load_chunks(X, Y, GATE, x_row, y_row, g_row, row_mask, N, BLOCK_N, NCH)
            _single_pass_rows(
                chunks, H_OUT, GATE, W, BIAS, mod, mod2, OUT, OUT2, rows, row_mask, out_row, N, eps, BLOCK_N, NCH
            )
        else:
            _multi_pass_rows(
                X, Y, GATE, H_OUT, W, BIAS, mod, mod2, OUT, OUT2, x_row, y_row, g_row, out_row, rows, row_mask, N, eps,
                BLOCK_M, BLOCK_N,
            )  # fmt: skip


@torch.compiler.assume_constant_result  # a constant for Dynamo: it need not trace Triton's driver
@functools.lru_cache(maxsize=None)
def _device_target(device: torch.device):
    """(backend, arch, warp size), e.g. ("hip", "gfx942", 64); ("interpreter", None, 32) on the CPU."""
    if device.type == "cpu":
        return ("interpreter", None, 32)
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) of the device; 0 under the interpreter."""
    return 0 if device.type == "cpu" else torch.cuda.get_device_properties(device).multi_processor_count


def _check(name: str, t, device=None, shape=None):
    """Refuse t unless a tensor of a supported dtype, on device (if given), contiguous in its last dim. With shape:
    t's row strides (read as _per_sample says) broadcast to shape, 0 along broadcast and size-1 dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected one of float16, bfloat16, float32")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; move them to one device")
    if t.numel() > 0 and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")
    if shape is None:
        return None
    try:
        strides = _per_sample(t, shape, name).expand(shape).stride()  # (a RuntimeError too for more dims)
    except RuntimeError:
        msg = f"{name} of shape {tuple(t.shape)} does not broadcast to the input's shape {tuple(shape)}; expected [D]"
        raise ValueError(f"{msg}, [B, D] (one row per sample of [B, S, D]), [S, D], [B, 1, D] or [B, S, D]") from None
    strides = tuple(0 if s == 1 else st for s, st in zip(shape, strides))
    if shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {strides[-1]})")
    return strides[:-1]


def _per_sample(t: Tensor, shape, name: str = "scale") -> Tensor:
    """t as read against x of shape [B, S, D]: a 2-D [B, D] per sample if B != S, else as torch broadcasts (B == S > 1:
    ambiguous, refused)."""
    if len(shape) != 3 or t.dim() != 2:
        return t
    rows, batch, tokens = t.shape[0], shape[0], shape[1]
    if rows == batch and rows != tokens:
        return t.unsqueeze(1)
    if rows == batch == tokens and rows > 1:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} is ambiguous for x of shape {tuple(shape)}: [{rows}, D] could be one "
            f"row per sample (diffusers' AdaLN chunks) or, as torch broadcasts it, one per token; pass {name}[:, None] "
            f"([B, 1, D]) for one row per sample or {name}[None] ([1, S, D]) for one row per token"
        )
    return t


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


def _launch_config(n_cols: int, n_rows: int, warp_size: int, residual: bool = False):
    """(BLOCK_M, BLOCK_N, single pass, chunks per row, num_warps). ~32 elements per lane: fewer warps shorten the two
    reductions (12-31 % faster than 8, H200); short rows packed to ~2048 elements a program. Rows of 3 * 2**k: three
    chunks of 2**k, not one a quarter masked off (72-75 -> 80-87 % of copy bandwidth; with a residual: not, -2-3 %)."""
    single, third = n_cols <= _MAX_FUSED_N, n_cols // 3
    if single and not residual and n_cols % 3 == 0 and third >= 64 and third & (third - 1) == 0:
        per_program = 1 << max(0, (2048 // n_cols).bit_length() - 1)  # a power of two, <= 2048 / n_cols
        block_m = max(1, min(16, per_program, _next_pow2(max(n_rows, 1))))
        return block_m, third, True, 3, _next_pow2(max(1, min(16, (block_m * third) // (warp_size * 8))))
    block_n = _next_pow2(n_cols) if single else _CHUNK_N
    block_m = max(1, min(16, 2048 // block_n, _next_pow2(max(n_rows, 1))))
    return block_m, block_n, single, 1, _next_pow2(max(1, min(16, (block_m * block_n) // (warp_size * 32))))


def _persistent_variant(has_residual: bool, has_mod: bool, has_mod2: bool) -> bool:
    """LayerNorm + one modulation only: no gain for the plain norm, 8-39 % slower with two modulations or a residual
    on an H200 (examples/layernorm_grid_h200.json)."""
    return has_mod and not has_mod2 and not has_residual


def _persistent_config(n_blocks: int, block_m: int, n_cols: int, warp_size: int, n_sms: int):
    """(programs, num_warps) of the persistent grid, (0, 0) if no more row blocks than programs. <= 24 elements per
    lane (this row block and the next), ~1024 lanes per SM: ~10 % faster than one program per row on an H200
    (examples/layernorm_grid_h200.json). Untuned on AMD."""
    num_warps = min(_next_pow2(max(1, -(-block_m * n_cols // (warp_size * 24)))), 16)
    programs = n_sms * max(1, 1024 // (num_warps * warp_size)) if n_sms else _INTERPRETER_PROGRAMS
    return (0, 0) if n_blocks <= programs else (programs, num_warps)


def _launch(
    x: Tensor, y: Optional[Tensor], gate: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor],
    scale: Optional[Tensor], shift: Optional[Tensor], scale2: Optional[Tensor], shift2: Optional[Tensor], eps: float,
) -> tuple[Optional[Tensor], Tensor, Optional[Tensor]]:  # fmt: skip
    """Check a call, pick the launch configuration, allocate the outputs, launch _layer_norm_kernel. Returns (h =
    x + gate * y or None, out, out2: the second modulation's or None)."""
    _check("x", x)
    device, shape = x.device, x.shape
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalised one)")
    n = shape[-1]
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not eps >= 0:  # NaN fails eps >= 0
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    for sc_name, sh_name, sc, sh in (("scale", "shift", scale, shift), ("scale2", "shift2", scale2, shift2)):
        if (sc is None) != (sh is None):
            raise ValueError(f"{sc_name} and {sh_name} must be given together")
    if scale2 is not None and scale is None:
        raise ValueError("scale2/shift2 need scale/shift (the first modulation)")
    if y is None and gate is not None:
        raise ValueError("gate is only used with a residual branch y")
    strides = [x.stride()[:-1]]  # of every operand, broadcast to x's shape, for the row layout
    if y is not None:
        _check("y", y, device)
        if y.shape != shape:
            raise ValueError(f"y has shape {tuple(y.shape)} but h has shape {tuple(shape)}; they must match")
        if y.dtype != x.dtype:
            raise TypeError(f"y has dtype {str(y.dtype)[6:]} but h has dtype {str(x.dtype)[6:]}; they must match")
        strides.append(y.stride()[:-1])
    for name, t in (("gate", gate), ("scale", scale), ("shift", shift), ("scale2", scale2), ("shift2", shift2)):
        if t is not None:
            strides.append(_check(name, t, device, shape))
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            _check(name, p, device)
            if p.dim() != 1 or p.shape[0] != n:
                raise ValueError(f"{name} must have shape [{n}] (the last dim of x), got {tuple(p.shape)}")
    new = lambda: torch.empty(shape, dtype=x.dtype, device=device)
    out, out2, h_out = new(), new() if scale2 is not None else None, new() if y is not None else None
    if x.numel() == 0:
        return h_out, out, out2
    m = x.numel() // n
    inner, layouts = _row_layout(strides, list(shape[:-1]))
    it, ops = iter(layouts), (x, y, gate, scale, shift, scale2, shift2)  # (0, 0): the strides of an absent operand
    xs, ys, gs, ss, ts, s2, t2 = (next(it) if t is not None else (0, 0) for t in ops)
    warp_size = _device_target(device)[2]
    block_m, block_n, single, nch, num_warps = _launch_config(n, m, warp_size, y is not None)
    n_blocks, programs = -(-m // block_m), 0
    if single and _PERSISTENT and _persistent_variant(y is not None, scale is not None, scale2 is not None):
        programs, p_warps = _persistent_config(n_blocks, block_m, n, warp_size, _num_sms(device))
        num_warps = p_warps if programs else num_warps
    _layer_norm_kernel[(programs or n_blocks,)](  # absent operands go as None: the kernel leaves out their uses
        x, *xs, y, *ys, gate, *gs, h_out, weight, bias, scale, *ss, shift, *ts, scale2, *s2, shift2, *t2,
        out, out2, m, n, inner, float(eps), BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single, NCH=nch,
        X_DENSE=m <= inner or xs[0] == inner * xs[1],  # row r of x starts at r * x_stride_i
        Y_DENSE=y is not None and (m <= inner or ys[0] == inner * ys[1]), PERSISTENT=programs > 0, num_warps=num_warps,
    )  # fmt: skip
    return h_out, out, out2


def _no_backward(fn: str, names: str, *tensors) -> None:
    """In grad mode, refuse an input that requires grad: the kernel has no backward, so gradients would stop."""
    for name, t in zip(names.split(","), tensors) if torch.is_grad_enabled() else ():
        if getattr(t, "requires_grad", False):
            raise RuntimeError(
                f"{fn}: {name} requires grad, but this Triton kernel has no backward (gradients would silently stop): "
                f"call {fn} under torch.no_grad() or torch.inference_mode(), or use the PyTorch reference ({fn}_ref)"
            )


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, eps: float = 1e-5) -> Tensor:
    """``F.layer_norm(x, (D,), weight, bias, eps)``, fp32 math, one rounding; rows may be strided. No backward."""
    _no_backward("layer_norm", "x,weight,bias", x, weight, bias)
    return _launch(x, None, None, weight, bias, None, None, None, None, eps)[1]


def layer_norm_modulate(x, scale, shift, eps=1e-6, *, weight=None, bias=None) -> Tensor:
    """AdaLN: ``layer_norm(x, weight, bias) * (1 + scale) + shift``; scale/shift as in the module docstring."""
    if scale is None or shift is None:
        raise ValueError("scale and shift are required; use layer_norm() for a plain norm")
    _no_backward("layer_norm_modulate", "x,weight,bias,scale,shift", x, weight, bias, scale, shift)
    return _launch(x, None, None, weight, bias, scale, shift, None, None, eps)[1]


def layer_norm_modulate_dual(x, scale, shift, scale2, shift2, eps=1e-6):
    """(n * (1 + scale) + shift, n * (1 + scale2) + shift2), n = layer_norm(x), x read once (SD35AdaLayerNormZeroX)."""
    if scale is None or shift is None or scale2 is None or shift2 is None:
        raise ValueError("scale, shift, scale2 and shift2 are all required")
    _no_backward("layer_norm_modulate_dual", "x,scale,shift,scale2,shift2", x, scale, shift, scale2, shift2)
    return _launch(x, None, None, None, None, scale, shift, scale2, shift2, eps)[1:]


def gated_residual_layer_norm_modulate(h, y, gate, scale, shift, eps=1e-6, *, weight=None, bias=None):
    """(h_new, out): h_new = h + gate * y (gate None: h + y) in h's dtype, out = layer_norm_modulate(h_new) (scale and
    shift None: layer_norm); MMDiT's ``h = h + gate_msa[:, None] * attn; norm2(h) * (1 + scale_mlp) + shift_mlp``."""
    if y is None:
        raise ValueError("y is required; use layer_norm_modulate() without a residual")
    names = "h,y,gate,weight,bias,scale,shift"
    _no_backward("gated_residual_layer_norm_modulate", names, h, y, gate, weight, bias, scale, shift)
    return _launch(h, y, gate, weight, bias, scale, shift, None, None, eps)[:2]


def gated_residual_layer_norm_modulate_dual(h, y, gate, scale, shift, scale2, shift2, eps=1e-6):
    """(h_new, out, out2): h_new = h + gate * y in h's dtype, then layer_norm_modulate_dual(h_new) (SD3.5 blocks)."""
    if y is None:
        raise ValueError("y is required; use layer_norm_modulate_dual() without a residual")
    if scale is None or shift is None or scale2 is None or shift2 is None:
        raise ValueError("scale, shift, scale2 and shift2 are all required")
    names = "h,y,gate,scale,shift,scale2,shift2"
    _no_backward("gated_residual_layer_norm_modulate_dual", names, h, y, gate, scale, shift, scale2, shift2)
    return _launch(h, y, gate, None, None, scale, shift, scale2, shift2, eps)


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5):
    """F.layer_norm math: in float64 for float64 input, else fp32 then rounded to x's dtype."""
    xf = x.double() if x.dtype == torch.float64 else x.float()
    mean = xf.mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = y * weight.to(xf.dtype) if weight is not None else y
    return (y + bias.to(xf.dtype) if bias is not None else y).to(x.dtype)


def layer_norm_modulate_ref(x, scale, shift, eps=1e-6, weight=None, bias=None):
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    sc, sh = _per_sample(scale, x.shape, "scale").to(f), _per_sample(shift, x.shape, "shift").to(f)
    return (layer_norm_ref(x.to(f), weight, bias, eps) * (1 + sc) + sh).to(x.dtype)


def layer_norm_modulate_dual_ref(x, scale, shift, scale2, shift2, eps=1e-6):
    return layer_norm_modulate_ref(x, scale, shift, eps), layer_norm_modulate_ref(x, scale2, shift2, eps)


def gated_residual_layer_norm_modulate_ref(h, y, gate, scale, shift, eps=1e-6, weight=None, bias=None):
    f = torch.float64 if h.dtype == torch.float64 else torch.float32
    upd = y.to(f) if gate is None else _per_sample(gate, h.shape, "gate").to(f) * y.to(f)
    h_new = (h.to(f) + upd).to(h.dtype)
    if scale is None:
        return h_new, layer_norm_ref(h_new, weight, bias, eps)
    return h_new, layer_norm_modulate_ref(h_new, scale, shift, eps, weight, bias)


def gated_residual_layer_norm_modulate_dual_ref(h, y, gate, scale, shift, scale2, shift2, eps=1e-6):
    h_new, _ = gated_residual_layer_norm_modulate_ref(h, y, gate, None, None, eps)
    return (h_new, *layer_norm_modulate_dual_ref(h_new, scale, shift, scale2, shift2, eps))


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Check the LayerNorm kernels against a float64 reference on random inputs.")
    p.add_argument("--rows", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--width", type=int, default=3072, help="normalised width (default 3072, FLUX)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("rows", "width"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not (torch.cuda.is_available() or interpret):
        p.exit(2, "no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter\n")
    dtype, tol = dict(fp32=(torch.float32, 1e-5), fp16=(torch.float16, 4e-3), bf16=(torch.bfloat16, 3.2e-2))[args.dtype]
    device, d, g = ("cpu" if interpret else "cuda"), args.width, torch.Generator().manual_seed(args.seed)
    x = (2 * torch.randn(2, args.rows, d, generator=g) + 0.3).to(device, dtype)
    y = torch.randn(2, args.rows, d, generator=g).to(device, dtype)
    emb = (0.3 * torch.randn(2, 6 * d, generator=g)).to(device, dtype)  # diffusers AdaLN: chunks of [B, 6D]
    w, b = ((c + 0.2 * torch.randn(d, generator=g)).to(device, dtype) for c in (1.0, 0.0))  # weight, bias
    shift, scale, gate, shift2, scale2, _ = emb.chunk(6, dim=1)
    report = {}
    for fn, ref, inputs in (  # each public function against its float64 reference on the same inputs
        (layer_norm, layer_norm_ref, (x, w, b)),
        (layer_norm_modulate, layer_norm_modulate_ref, (x, scale, shift)),
        (layer_norm_modulate_dual, layer_norm_modulate_dual_ref, (x, scale, shift, scale2, shift2)),
        (gated_residual_layer_norm_modulate, gated_residual_layer_norm_modulate_ref, (x, y, gate, scale, shift)),
        (gated_residual_layer_norm_modulate_dual, gated_residual_layer_norm_modulate_dual_ref,
         (x, y, gate, scale, shift, scale2, shift2)),
    ):  # fmt: skip
        got, want = fn(*inputs), ref(*(t.double() for t in inputs))
        got, want = (torch.stack(o) if isinstance(o, tuple) else o for o in (got, want))
        err = ((got.double() - want).abs() / (1 + want.abs())).max().item()
        report[fn.__name__] = {"max_rel_err": err, "ok": err <= tol}
    ok = all(v["ok"] for v in report.values())
    print(json.dumps({"device": device, "dtype": args.dtype, "width": d, "checks": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

try:  # kernel_runtime.py beside this file adds launch plans, torch.library ops and device checks
    import kernel_runtime
except ImportError:
    pass
else:
    kernel_runtime.accelerate(globals(), layer_norm_fused="_launch")

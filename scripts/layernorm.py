# SPDX-License-Identifier: Apache-2.0
"""LayerNorm over the last dimension, optionally fused with AdaLN modulation and a gated residual.

    h   = h + gate * y                                          (optional: gated residual, h returned too)
    out = ((x - mean(x)) / sqrt(var(x) + eps) [* w] [+ b]) * (1 + scale) + shift   (parts optional)
    with the biased variance over the last dim, all arithmetic in fp32, one rounding per output.

One Triton kernel implements every variant; an operand a call leaves out is passed as None, which removes
every use of it when the kernel is compiled.
This is the norm of the MMDiT models in diffusers (SD3 ``JointTransformerBlock``, FLUX
``FluxTransformerBlock`` / ``FluxSingleTransformerBlock``): ``nn.LayerNorm(D, elementwise_affine=False,
eps=1e-6)`` followed by ``* (1 + scale) + shift`` with one scale/shift row per sample. Public functions:

* ``layer_norm(x, weight=None, bias=None, eps=1e-5)``: ``torch.nn.functional.layer_norm`` over the last dim.
* ``layer_norm_modulate(x, scale, shift, eps=1e-6)``: ``layer_norm(x) * (1 + scale) + shift``: diffusers
  ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` / ``AdaLayerNormContinuous`` after their linear layer.
* ``layer_norm_modulate_dual(x, scale, shift, scale2, shift2, eps=1e-6)``: two modulations of one
  normalised row, ``(out, out2)``: diffusers ``SD35AdaLayerNormZeroX`` (SD3.5 dual-attention blocks).
* ``gated_residual_layer_norm_modulate(h, y, gate, scale, shift, eps=1e-6)``: ``h = h + gate * y`` (gate
  None: ``h + y``), then ``layer_norm_modulate(h, ...)``; returns ``(h, out)``: the block step "attention
  output into the residual stream, then norm2 + MLP modulation".

scale / shift / gate shapes: anything that broadcasts to x as in torch ([D], [S, D], [B, 1, D], [B, S, D],
...), and also [B, D] for a 3-D x [B, S, D] where B != S, meaning one row per sample ([B, 1, D]): the form
of ``emb.chunk(6, dim=1)`` in diffusers' AdaLN modules, whose views (row stride 6 * D) are read in place,
and where torch broadcasting would fail. A 2-D [X, D] with X == B == S > 1 could be either (one row per
sample, or per token as torch broadcasts it) and is refused with ValueError: pass ``scale[:, None]`` for
one row per sample or ``scale[None]`` for one row per token. rmsnorm.py reads the unambiguous forms the
same way ([S, D] per token; it has no per-sample [B, D] form). Each ``*_ref`` function is the
plain-PyTorch math the kernel replaces (with the same reading of a 2-D scale/shift/gate). The kernels
have no backward: in grad mode, an input that requires grad raises RuntimeError. The file depends on torch and triton only; copy it into
another project as is. Run ``python layernorm.py --help``.
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
    "layer_norm",
    "layer_norm_modulate",
    "layer_norm_modulate_dual",
    "gated_residual_layer_norm_modulate",
    "layer_norm_ref",
    "layer_norm_modulate_ref",
    "layer_norm_modulate_dual_ref",
    "gated_residual_layer_norm_modulate_ref",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Rows up to this many elements are normalised from registers in one pass (one read, one write).
# Wider rows are processed in chunks of _CHUNK_N: a pass for the mean, a pass for the variance around
# it (no cancellation, unlike a single sum-of-squares pass), a pass that normalises. The cap keeps the
# per-lane register footprint bounded (16384 fp32 values over 16 warps is at most 32 per lane).
_MAX_FUSED_N = 16384
_CHUNK_N = 4096
# LayerNorm + one modulation (no residual) over single-pass rows runs on a persistent grid when there
# are more row blocks than programs (_persistent_config says why); False: one program per row block.
_PERSISTENT = True
_INTERPRETER_PROGRAMS = 3  # the persistent grid under the interpreter: CPU tests run its row loop


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
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
def _affine_modulate(y, W, BIAS, MOD, rows, cols, mask):
    """Normalised fp32 rows y -> (* w) (+ b), then * (1 + scale) + shift (MOD: see _modulation)."""
    if W is not None:
        # loaded at the tile's full shape so it shares the tile's register layout (a [BLOCK_N] load
        # gets another layout and costs a conversion through LDS)
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
    """fp32 x; with H_OUT, h = x + gate * y (GATE: whether there is a gate) rounded to h's dtype, stored
    to H_OUT and returned (the value normalised)."""
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
    """fp32 tiles of the normalised input again (a later pass of the chunked path): the stored h when
    a residual was added in pass 1, else x."""
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
    """Normalised fp32 rows y (columns `cols`) -> affine, modulation(s), stores to OUT (and OUT2).
    PRE: the modulation's scale and shift are the tiles sc, sh loaded earlier (_load_mod)."""
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
    """A single-pass row block as stored: the (x, y, gate) tiles of chunk 0, 1 and 2; chunks 1 and 2 only
    when NCH == 3 (0.0 placeholders otherwise)."""
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
    chunks,
    H_OUT,
    GATE,
    W,
    BIAS,
    MOD,
    MOD2,
    OUT,
    OUT2,
    rows,
    row_mask,
    out_row,
    N,
    eps,
    BLOCK_N: tl.constexpr,
    NCH: tl.constexpr,
):
    """Normalise a row block held in registers (the tiles of _load_chunks): one chunk of the next power
    of two above N, or three (N = 3 * BLOCK_N, e.g. SD3's 1536 and FLUX's 3072) so that no lane idles.
    Each reduction runs once over the chunks' elementwise sum."""
    cols0 = tl.arange(0, BLOCK_N)
    c1 = cols0 + BLOCK_N
    c2 = cols0 + 2 * BLOCK_N
    m0 = row_mask[:, None] & (cols0 < N)[None, :]
    m1 = row_mask[:, None] & (c1 < N)[None, :]
    m2 = row_mask[:, None] & (c2 < N)[None, :]
    # With a residual, scale and shift are requested before the reductions so that their latency
    # overlaps them (about 2 % faster at SD3's and FLUX's shapes on an H200); without one that was 1-2 %
    # slower, so they are loaded after, in _finish_rows.
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
    """A row block too wide for registers, in three passes over BLOCK_N columns at a time: the mean (and
    the residual update, stored once), the variance around the mean (no cancellation, unlike one
    sum-of-squares pass), then normalise, affine, modulate and store."""
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
    H_OUT,  # contiguous [M, N] output of the updated residual h (with Y)
    W, BIAS,  # weight and bias [N] (None: not applied)
    SCALE, s_stride_o, s_stride_i, SHIFT, t_stride_o, t_stride_i,  # modulation (None: none), broadcast strides
    SCALE2, s2_stride_o, s2_stride_i, SHIFT2, t2_stride_o, t2_stride_i,  # second modulation (None: none)
    OUT, OUT2,  # contiguous [M, N] outputs (OUT2: the second modulation's)
    M, N, INNER, eps,  # rows, row width, rows per outer index (row r -> r // INNER, r % INNER), epsilon
    BLOCK_M: tl.constexpr,  # rows per program (per step when PERSISTENT)
    BLOCK_N: tl.constexpr,  # columns per step (SINGLE_PASS: per chunk, NCH * BLOCK_N >= N)
    SINGLE_PASS: tl.constexpr,  # a row block held in registers: one read, one write
    NCH: tl.constexpr,  # SINGLE_PASS: chunks per row, 1 or 3
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
        # A fixed number of programs, each looping over row blocks; the next block's inputs are
        # requested before this block's reductions, so a program keeps loads in flight while it
        # reduces and stores (one launch-sized grid would leave that gap to other programs only).
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


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (NVIDIA) or compute units (AMD) of the device; 0 under the interpreter."""
    if device.type == "cpu":
        return 0
    return _gpu_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


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


def _per_sample(t: torch.Tensor, shape, name: str = "scale") -> torch.Tensor:
    """How a modulation tensor t reads against an input of shape ``shape``: a 2-D [X, D] tensor for a 3-D
    input [B, S, D] is one row per sample (viewed as [B, 1, D]) where X == B != S, as diffusers' AdaLN
    modules chunk it and where torch broadcasting would fail; where X == S != B (or X == 1) it broadcasts
    as in torch (one row per token), as in rmsnorm.py. X == B == S > 1 could mean either: refused."""
    if len(shape) != 3 or t.dim() != 2:
        return t
    rows, batch, tokens = t.shape[0], shape[0], shape[1]
    if rows == batch and rows != tokens:
        return t.unsqueeze(1)
    if rows == batch == tokens and rows > 1:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)} is ambiguous for x of shape {tuple(shape)}: [{rows}, D] could be one "
            f"row per sample (the [B, D] of diffusers' AdaLN chunks) or, as torch broadcasts it, one row per "
            f"token; pass {name}[:, None] ([B, 1, D]) for one row per sample or {name}[None] ([1, S, D]) for one "
            "row per token"
        )
    return t


def _bcast_strides(name: str, t: torch.Tensor, shape) -> tuple:
    """Strides of t broadcast to shape (0 along broadcast dims), without materialising anything.
    A [B, D] tensor for a 3-D input [B, S, D] with B != S is read as [B, 1, D] (see _per_sample)."""
    shown = tuple(t.shape)
    t = _per_sample(t, shape, name)
    nd, td = len(shape), t.dim()
    if td > nd:
        raise ValueError(f"{name} of shape {shown} has more dimensions than the input {tuple(shape)}")
    tshape, tstride = (1,) * (nd - td) + tuple(t.shape), (0,) * (nd - td) + tuple(t.stride())
    out = []
    for size, st, want in zip(tshape, tstride, shape):
        if size == want:
            out.append(st if want != 1 else 0)
        elif size == 1:
            out.append(0)
        else:
            raise ValueError(
                f"{name} of shape {shown} does not broadcast to the input's shape {tuple(shape)}; "
                "expected [D], [B, D] (one row per sample of a [B, S, D] input), [S, D], [B, 1, D] or [B, S, D]"
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


# ---- shared block sizes begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a constexpr_function, microseconds per host call


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n; 1 for every n <= 1 (0 included)."""
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


# ---- shared block sizes end ----


def _launch_config(n_cols: int, n_rows: int, warp_size: int, residual: bool = False):
    return _launch_config_cached(n_cols, n_rows, warp_size, _MAX_FUSED_N, _CHUNK_N, residual)


@functools.lru_cache(maxsize=1024)
def _launch_config_cached(n_cols: int, n_rows: int, warp_size: int, max_fused: int, chunk: int, residual: bool):
    """(BLOCK_M, BLOCK_D, single pass?, chunks per row, num_warps).

    About 32 elements of a row per lane (warps from the lane count, 32 or 64): LayerNorm reduces twice
    and fewer warps per row shorten each cross-warp reduction; 12-31 % faster than 8 per lane at SD3's
    and FLUX's shapes on an H200. Rows under 2048 elements are packed to about 2048 per program. Rows
    of 3 * 2**k (SD3's 1536, FLUX's 3072) are three chunks of 2**k (one 16-byte vector per lane each),
    not one of 4 * 2**k a quarter masked off: 72-75 % -> 80-87 % of copy bandwidth for the modulated
    norm; not with a residual (x, y, gate, h), where the chunks tied or lost 2-3 %.
    """
    single = n_cols <= max_fused
    third = n_cols // 3
    if single and not residual and n_cols % 3 == 0 and third >= 64 and third & (third - 1) == 0:
        per_program = 1 << max(0, (2048 // n_cols).bit_length() - 1)  # a power of two, <= 2048 / n_cols
        block_m = max(1, min(16, per_program, _next_pow2(max(n_rows, 1))))
        num_warps = _next_pow2(max(1, min(16, (block_m * third) // (warp_size * 8))))
        return block_m, third, True, 3, num_warps
    block_n = _next_pow2(n_cols) if single else chunk
    block_m = max(1, min(16, 2048 // block_n, _next_pow2(max(n_rows, 1))))
    num_warps = max(1, min(16, (block_m * block_n) // (warp_size * 32)))
    return block_m, block_n, single, 1, _next_pow2(num_warps)


def _persistent_variant(has_residual: bool, has_mod: bool, has_mod2: bool) -> bool:
    """Which variants may use the persistent grid: LayerNorm + one modulation without a residual. The
    plain norm gains nothing on it; two modulations or a residual are 8-39 % slower at SD3's and FLUX's
    shapes on an H200 (examples/layernorm_grid_h200.json)."""
    return has_mod and not has_mod2 and not has_residual


@functools.lru_cache(maxsize=1024)
def _persistent_config(n_blocks: int, block_m: int, n_cols: int, warp_size: int, n_sms: int):
    """(programs, num_warps) for the persistent single-pass kernel, or (0, 0) for one program per row
    block when there are no more row blocks than programs (nothing to prefetch). At most 24 elements of
    a row block per lane and about 1024 lanes per SM (half its warp slots: each lane holds two row
    blocks, the one it reduces and the next): about 10 % faster than one program per row for LayerNorm
    + modulation on an H200 (examples/layernorm_grid_h200.json, from scripts/benchmark_layernorm_grid.py).
    Untuned on AMD.
    """
    num_warps = _next_pow2(max(1, _cdiv(block_m * n_cols, warp_size * 24)))
    num_warps = min(num_warps, 16)
    programs = n_sms * max(1, 1024 // (num_warps * warp_size)) if n_sms else _INTERPRETER_PROGRAMS
    if n_blocks <= programs:
        return 0, 0
    return programs, num_warps


_PLANS: dict = {}  # launch plans by call signature (see _launch)


def _launch(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps):
    """Validate, pick the launch configuration and run the kernel.

    Returns (h_out or None, out, out2 or None). h_out is x + gate * y when y is given (x is then the
    residual stream h); out is the normalised (and modulated) row; out2 the second modulation.

    The checks and the configuration depend only on the call's signature (each tensor's type, shape,
    strides, dtype and device, and eps), so they run once per signature: the plan they produce is kept
    and later calls with the same signature only allocate the outputs and launch.
    """
    try:
        key = (
            _sig(x),
            y if y is None else _sig(y),
            gate if gate is None else _sig(gate),
            weight if weight is None else _sig(weight),
            bias if bias is None else _sig(bias),
            scale if scale is None else _sig(scale),
            shift if shift is None else _sig(shift),
            scale2 if scale2 is None else _sig(scale2),
            shift2 if shift2 is None else _sig(shift2),
            type(eps),
            eps,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _plan(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(x, y, gate, weight, bias, scale, shift, scale2, shift2)


def _plan(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps):
    """The checks and configuration of _launch; returns run(x, y, gate, weight, bias, scale, shift, scale2,
    shift2)."""
    g_strides, mods = _check_operands(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps)
    device, shape, n = x.device, x.shape, x.shape[-1]
    has_residual = y is not None
    has_mod, has_mod2 = mods[0] is not None, mods[1] is not None

    x_dtype = x.dtype
    if x.numel() == 0:

        def run_empty(x, y, gate, weight, bias, scale, shift, scale2, shift2):
            out = torch.empty(shape, dtype=x_dtype, device=device)
            out2 = torch.empty(shape, dtype=x_dtype, device=device) if has_mod2 else None
            h_out = torch.empty(shape, dtype=x_dtype, device=device) if has_residual else None
            return h_out, out, out2

        return run_empty
    m = x.numel() // n
    stride_sets = [x.stride()[:-1]]
    if has_residual:
        stride_sets.append(y.stride()[:-1])
    if gate is not None:
        stride_sets.append(g_strides[:-1])
    for mod in mods:
        if mod is not None:
            stride_sets += [mod[2][:-1], mod[3][:-1]]
    inner, layouts = _row_layout(stride_sets, list(shape[:-1]))
    it = iter(layouts)
    xs = next(it)
    ys = next(it) if has_residual else (0, 0)
    gs = next(it) if gate is not None else (0, 0)
    ss, ts = (next(it), next(it)) if has_mod else ((0, 0), (0, 0))
    s2, t2 = (next(it), next(it)) if has_mod2 else ((0, 0), (0, 0))

    _, _, warp_size = _device_target(device)
    block_m, block_n, single, nch, num_warps = _launch_config(n, m, warp_size, has_residual)
    n_blocks = _cdiv(m, block_m)
    programs = 0
    if single and _PERSISTENT and _persistent_variant(has_residual, has_mod, has_mod2):
        programs, p_warps = _persistent_config(n_blocks, block_m, n, warp_size, _num_sms(device))
        if programs:
            num_warps = p_warps
    grid = (programs or n_blocks,)
    # Absent tensors stay None: the kernel leaves out every use of them.
    args, slots = _kernel_args(
        [True, *xs],
        [has_residual, *ys],
        [gate is not None, *gs],
        [has_residual],  # H_OUT
        [weight is not None],
        [bias is not None],
        [has_mod, *ss],
        [has_mod, *ts],
        [has_mod2, *s2],
        [has_mod2, *t2],
        [True],  # OUT
        [has_mod2],  # OUT2
        m,
        n,
        inner,
        float(eps),
    )
    config = dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SINGLE_PASS=single,
        NCH=nch,
        X_DENSE=_dense(xs, m, inner),
        Y_DENSE=has_residual and _dense(ys, m, inner),
        PERSISTENT=programs > 0,
        num_warps=num_warps,
    )
    launch = _Launch(_layer_norm_kernel, grid, args, config, slots, device)

    # outputs are contiguous; torch.empty_like(x) makes the same with less host time where _dense_like(x)
    like_x = _dense_like(x)
    shape_t = tuple(shape)

    def run(x, y, gate, weight, bias, scale, shift, scale2, shift2):
        out = torch.empty_like(x) if like_x else torch.empty(shape_t, dtype=x_dtype, device=device)
        out2 = h_out = None
        if has_mod2:
            out2 = torch.empty_like(x) if like_x else torch.empty(shape_t, dtype=x_dtype, device=device)
        if has_residual:
            h_out = torch.empty_like(x) if like_x else torch.empty(shape_t, dtype=x_dtype, device=device)
        launch(x, y, gate, h_out, weight, bias, scale, shift, scale2, shift2, out, out2)
        return h_out, out, out2

    return run


def _check_operands(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps):
    """Check x, eps and the optional operands; returns (gate's broadcast strides or None, [modulation,
    second modulation]), each modulation (scale, shift, their broadcast strides) or None."""
    _check_tensor("x", x, _SUPPORTED_DTYPES)
    device = x.device
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalised one)")
    shape = x.shape
    n = shape[-1]
    _check_last_contiguous("x", x)
    if isinstance(eps, bool) or not isinstance(eps, (float, int)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    has_residual = y is not None
    if has_residual:
        _check_tensor("y", y, _SUPPORTED_DTYPES, device)
        if y.shape != shape:
            raise ValueError(f"y has shape {tuple(y.shape)} but h has shape {tuple(shape)}; they must match")
        if y.dtype != x.dtype:
            raise TypeError(
                f"y has dtype {_dtype_name(y.dtype)} but h has dtype {_dtype_name(x.dtype)}; they must match"
            )
        _check_last_contiguous("y", y)
    elif gate is not None:
        raise ValueError("gate is only used with a residual branch y")
    if gate is not None:
        _check_tensor("gate", gate, _SUPPORTED_DTYPES, device)
        g_strides = _bcast_strides("gate", gate, shape)
    for nm, p in (("weight", weight), ("bias", bias)):
        if p is not None:
            _check_tensor(nm, p, _SUPPORTED_DTYPES, device)
            if p.dim() != 1 or p.shape[0] != n:
                raise ValueError(f"{nm} must have shape [{n}] (the last dim of x), got {tuple(p.shape)}")
            if p.stride(0) != 1 and n > 1:
                raise ValueError(f"{nm} must be contiguous")
    mods = []
    for sc_name, sh_name, sc, sh in (("scale", "shift", scale, shift), ("scale2", "shift2", scale2, shift2)):
        if (sc is None) != (sh is None):
            raise ValueError(f"{sc_name} and {sh_name} must be given together")
        if sc is None:
            mods.append(None)
            continue
        _check_tensor(sc_name, sc, _SUPPORTED_DTYPES, device)
        _check_tensor(sh_name, sh, _SUPPORTED_DTYPES, device)
        mods.append((sc, sh, _bcast_strides(sc_name, sc, shape), _bcast_strides(sh_name, sh, shape)))
    if mods[1] is not None and mods[0] is None:
        raise ValueError("scale2/shift2 need scale/shift (the first modulation)")
    return g_strides if gate is not None else None, mods


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


def _layer_norm_fused_op(
    x: torch.Tensor,
    y: Optional[torch.Tensor],
    gate: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    shift: Optional[torch.Tensor],
    scale2: Optional[torch.Tensor],
    shift2: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h_out, out, out2 = _launch(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps)
    # custom ops cannot return None: absent outputs are empty tensors
    return (h_out if h_out is not None else x.new_empty(0), out, out2 if out2 is not None else x.new_empty(0))


def _layer_norm_fused_op_fake(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    h_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if y is not None else x.new_empty(0)
    out2 = torch.empty(x.shape, dtype=x.dtype, device=x.device) if scale2 is not None else x.new_empty(0)
    return h_out, out, out2


_register("layer_norm_fused", _layer_norm_fused_op, _layer_norm_fused_op_fake)


_GRAD_NAMES = ("x", "y", "gate", "weight", "bias", "scale", "shift", "scale2", "shift2")  # as errors name them


def _dispatch(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps, fn="layer_norm", grad_names=_GRAD_NAMES):
    if torch.compiler.is_compiling():
        if isinstance(eps, bool):  # float(True) would hide it from the launcher's check
            raise ValueError(f"eps must be a non-negative float, got {eps!r}")
        h_out, out, out2 = _compile_op("layer_norm_fused")(
            x, y, gate, weight, bias, scale, shift, scale2, shift2, float(eps)
        )
        return (h_out if y is not None else None), out, (out2 if scale2 is not None else None)
    # Eager: call the launcher directly; the custom-op dispatcher costs microseconds per call.
    _check_no_grad(fn, grad_names, (x, y, gate, weight, bias, scale, shift, scale2, shift2))
    return _launch(x, y, gate, weight, bias, scale, shift, scale2, shift2, eps)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm(x, (D,), weight, bias, eps)``: fp32 math, one rounding.

    x: any leading shape, last dim contiguous (rows may be strided). weight/bias: [D] or None.
    Output: x's dtype and shape, contiguous.
    The kernel has no backward: in grad mode, an input that requires grad raises RuntimeError (call it
    under torch.no_grad() / torch.inference_mode(), or use layer_norm_ref where gradients are needed).
    """
    return _dispatch(x, None, None, weight, bias, None, None, None, None, eps)[1]


def layer_norm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float = 1e-6,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """AdaLN: ``layer_norm(x, weight, bias) * (1 + scale) + shift`` in one pass, fp32 math, one rounding.

    scale/shift: [B, D] (one row per sample of x [B, S, D], as diffusers' AdaLN chunks them), or any
    shape broadcastable to x as in torch ([D], [S, D], [B, 1, D], [B, S, D]); a [B, D] with B == S > 1 is
    ambiguous and refused (see the module docstring). Strided views are read in place.
    No backward: in grad mode, an input that requires grad raises RuntimeError (see layer_norm).
    """
    if scale is None or shift is None:
        raise ValueError("scale and shift are required; use layer_norm() for a plain norm")
    return _dispatch(x, None, None, weight, bias, scale, shift, None, None, eps, fn="layer_norm_modulate")[1]


def layer_norm_modulate_dual(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    scale2: torch.Tensor,
    shift2: torch.Tensor,
    eps: float = 1e-6,
):
    """Two modulations of one LayerNorm: ``(n * (1 + scale) + shift, n * (1 + scale2) + shift2)`` with
    ``n = layer_norm(x)``, reading x once (diffusers ``SD35AdaLayerNormZeroX``). Returns (out, out2).
    No backward: in grad mode, an input that requires grad raises RuntimeError (see layer_norm)."""
    if scale is None or shift is None or scale2 is None or shift2 is None:
        raise ValueError("scale, shift, scale2 and shift2 are all required")
    _, out, out2 = _dispatch(
        x, None, None, None, None, scale, shift, scale2, shift2, eps, fn="layer_norm_modulate_dual"
    )
    return out, out2


def gated_residual_layer_norm_modulate(
    h: torch.Tensor,
    y: torch.Tensor,
    gate: Optional[torch.Tensor],
    scale: Optional[torch.Tensor],
    shift: Optional[torch.Tensor],
    eps: float = 1e-6,
    *,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
):
    """h_new = h + gate * y (gate None: h + y), rounded to h's dtype; out = layer_norm_modulate(h_new).

    The MMDiT step ``h = h + gate_msa[:, None] * attn; n = norm2(h) * (1 + scale_mlp[:, None]) +
    shift_mlp[:, None]`` in one kernel. gate/scale/shift: [B, D] per sample (or broadcastable to h).
    scale/shift may both be None (plain residual add + LayerNorm). Returns (h_new, out).
    No backward: in grad mode, an input that requires grad raises RuntimeError (see layer_norm).
    """
    if y is None:
        raise ValueError("y is required; use layer_norm_modulate() without a residual")
    h_out, out, _ = _dispatch(
        h,
        y,
        gate,
        weight,
        bias,
        scale,
        shift,
        None,
        None,
        eps,
        fn="gated_residual_layer_norm_modulate",
        grad_names=("h",) + _GRAD_NAMES[1:],
    )
    return h_out, out


def gated_residual_layer_norm_modulate_dual(
    h: torch.Tensor,
    y: torch.Tensor,
    gate: Optional[torch.Tensor],
    scale: torch.Tensor,
    shift: torch.Tensor,
    scale2: torch.Tensor,
    shift2: torch.Tensor,
    eps: float = 1e-6,
):
    """h_new = h + gate * y (gate None: h + y), rounded to h's dtype; then the two modulations of
    ``layer_norm_modulate_dual(h_new)``. One kernel for a block's last gated residual and the next
    block's ``SD35AdaLayerNormZeroX`` (SD3.5). Returns (h_new, out, out2).
    No backward: in grad mode, an input that requires grad raises RuntimeError (see layer_norm)."""
    if y is None:
        raise ValueError("y is required; use layer_norm_modulate_dual() without a residual")
    if scale is None or shift is None or scale2 is None or shift2 is None:
        raise ValueError("scale, shift, scale2 and shift2 are all required")
    return _dispatch(
        h,
        y,
        gate,
        None,
        None,
        scale,
        shift,
        scale2,
        shift2,
        eps,
        fn="gated_residual_layer_norm_modulate_dual",
        grad_names=("h",) + _GRAD_NAMES[1:],
    )


# --------------------------------------------------------------------------------------------
# References: the plain-PyTorch math each kernel replaces (run them in float64 for testing)
# --------------------------------------------------------------------------------------------
def _f(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def layer_norm_ref(x, weight=None, bias=None, eps=1e-5):
    """F.layer_norm math: in float64 for float64 input, else fp32 then rounded to x's dtype."""
    f = _f(x)
    xf = x.to(f)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).pow(2).mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(f)
    if bias is not None:
        y = y + bias.to(f)
    return y.to(x.dtype)


def layer_norm_modulate_ref(x, scale, shift, eps=1e-6, weight=None, bias=None):
    f = _f(x)
    n = layer_norm_ref(x.to(f), weight, bias, eps)
    sc, sh = _per_sample(scale, x.shape, "scale").to(f), _per_sample(shift, x.shape, "shift").to(f)
    return (n * (1 + sc) + sh).to(x.dtype)


def layer_norm_modulate_dual_ref(x, scale, shift, scale2, shift2, eps=1e-6):
    return layer_norm_modulate_ref(x, scale, shift, eps), layer_norm_modulate_ref(x, scale2, shift2, eps)


def gated_residual_layer_norm_modulate_ref(h, y, gate, scale, shift, eps=1e-6, weight=None, bias=None):
    f = _f(h)
    upd = y.to(f) if gate is None else _per_sample(gate, h.shape, "gate").to(f) * y.to(f)
    h_new = (h.to(f) + upd).to(h.dtype)
    if scale is None:
        return h_new, layer_norm_ref(h_new, weight, bias, eps)
    return h_new, layer_norm_modulate_ref(h_new, scale, shift, eps, weight, bias)


def gated_residual_layer_norm_modulate_dual_ref(h, y, gate, scale, shift, scale2, shift2, eps=1e-6):
    h_new, _ = gated_residual_layer_norm_modulate_ref(h, y, gate, None, None, eps)
    return (h_new, *layer_norm_modulate_dual_ref(h_new, scale, shift, scale2, shift2, eps))


# --------------------------------------------------------------------------------------------
# Self-check: python layernorm.py [--rows R] [--width N] [--dtype bf16]
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(
        description="Check the LayerNorm / AdaLN / gated-residual kernels against a float64 reference on random inputs."
    )
    p.add_argument("--rows", type=int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--width", type=int, default=3072, help="normalised width (default 3072, FLUX)")
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
    D = args.width

    def rnd(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g) * scale + offset).to(device, dtype)

    x = rnd(2, args.rows, D, scale=2.0, offset=0.3)
    y = rnd(2, args.rows, D)
    emb = rnd(2, 6 * D, scale=0.3)  # diffusers AdaLN: chunks of one [B, 6D] projection
    shift, scale, gate, shift2, scale2, _ = emb.chunk(6, dim=1)
    w, b = rnd(D, scale=0.2, offset=1.0), rnd(D, scale=0.2)
    d = {
        k: v.double()
        for k, v in dict(x=x, y=y, shift=shift, scale=scale, gate=gate, shift2=shift2, scale2=scale2, w=w, b=b).items()
    }
    h_new, out = gated_residual_layer_norm_modulate(x, y, gate, scale, shift)
    o1, o2 = layer_norm_modulate_dual(x, scale, shift, scale2, shift2)
    r1, r2 = layer_norm_modulate_dual_ref(d["x"], d["scale"], d["shift"], d["scale2"], d["shift2"])
    checks = {
        "layer_norm": (layer_norm(x, w, b), layer_norm_ref(d["x"], d["w"], d["b"])),
        "layer_norm_modulate": (
            layer_norm_modulate(x, scale, shift),
            layer_norm_modulate_ref(d["x"], d["scale"], d["shift"]),
        ),
        "layer_norm_modulate_dual": (torch.stack([o1, o2]), torch.stack([r1, r2])),
        "gated_residual_h": (
            h_new,
            gated_residual_layer_norm_modulate_ref(d["x"], d["y"], d["gate"], d["scale"], d["shift"])[0].to(dtype),
        ),
        "gated_residual_out": (out, layer_norm_modulate_ref(h_new.double(), d["scale"], d["shift"])),
    }
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}[dtype]
    report, ok = {}, True
    for name, (got, ref) in checks.items():
        err = ((got.double() - ref.double()).abs() / (1 + ref.double().abs())).max().item()
        good = bool(err <= tol)
        report[name] = {"max_rel_err": err, "ok": good}
        ok &= good
    print(json.dumps({"device": str(device), "dtype": args.dtype, "width": D, "checks": report, "ok": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

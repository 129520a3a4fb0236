"""RMSNorm over the last dimension, optionally fused with AdaLN modulation and a gated residual.

    h   = h + y * gate                                   (optional: gated residual, h returned too)
    out = cast(rms(x) [cast] * w) * (1 + scale) + shift  (weight and modulation optional)
    with rms(x) = x / sqrt(mean(x**2) + eps), all arithmetic in fp32.

One Triton kernel implements every variant; constexpr flags remove the parts a call does not use.
Public functions:

* ``rms_norm(x, weight=None, eps=1e-6, cast_before_weight=True, out_dtype=None)``:
  diffusers ``RMSNorm`` and Llama's ``LlamaRMSNorm`` (cast_before_weight=True), ``torch.nn.RMSNorm``
  (cast_before_weight=False); see the function's docstring.
* ``rms_norm_modulate(x, scale, shift, weight=None, eps=1e-6)``: ``rms_norm(x) * (1 + scale) + shift``,
  scale/shift broadcastable to x ([D], [B, 1, D] as in LTX-Video/DiT, or [B, S, D]).
* ``gated_residual_rms_norm_modulate(h, y, gate, scale, shift, ...)``: ``h = h + y * gate`` (gate may be
  None for a plain residual add) then ``rms_norm_modulate(h, ...)``; returns ``(h, out)``.

Each ``*_ref`` function beside them is the plain-PyTorch math the kernel replaces. The file depends on
torch and triton only; copy it into another project as is. Run ``python rmsnorm.py --help``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

__all__ = [
    "rms_norm",
    "rms_norm_modulate",
    "gated_residual_rms_norm_modulate",
    "rms_norm_ref",
    "rms_norm_modulate_ref",
    "gated_residual_rms_norm_modulate_ref",
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
@triton.jit
def _rms_norm_kernel(
    X,  # input rows (or the residual stream h when HAS_RESIDUAL); last dim contiguous
    x_stride_o, x_stride_i,  # element strides of the two leading levels of X (see _row_layout)
    Y, y_stride_o, y_stride_i,  # branch output added to h when HAS_RESIDUAL (else unused)
    GATE, g_stride_o, g_stride_i,  # per-channel gate for the residual (HAS_GATE), broadcast strides
    H_OUT,  # contiguous [M, N] output of the updated residual h (HAS_RESIDUAL)
    W,  # weight [N] (HAS_WEIGHT)
    SCALE, s_stride_o, s_stride_i,  # modulation scale (HAS_MOD), broadcast strides
    SHIFT, t_stride_o, t_stride_i,  # modulation shift (HAS_MOD), broadcast strides
    OUT,  # contiguous [M, N] output
    M, N, INNER,  # rows, row width, rows per outer index (row r -> outer r // INNER, inner r % INNER)
    eps,  # epsilon added to the mean of squares
    HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    CAST_BEFORE_WEIGHT: tl.constexpr,  # round rms(x) to X's dtype before the weight multiply
    HAS_MOD: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per step; >= N when SINGLE_PASS
    SINGLE_PASS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows = tl.where(row_mask, rows, 0)  # keep masked-off rows' addresses in bounds
    outer = (rows // INNER).to(tl.int64)
    inner = (rows % INNER).to(tl.int64)
    x_row = outer * x_stride_o + inner * x_stride_i
    out_row = rows.to(tl.int64) * N
    if HAS_RESIDUAL:
        y_row = outer * y_stride_o + inner * y_stride_i
        if HAS_GATE:
            g_row = outer * g_stride_o + inner * g_stride_i
    if HAS_MOD:
        s_row = outer * s_stride_o + inner * s_stride_i
        t_row = outer * t_stride_o + inner * t_stride_i
    cols0 = tl.arange(0, BLOCK_N)

    if SINGLE_PASS:
        col_mask = cols0 < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + x_row[:, None] + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            yv = tl.load(Y + y_row[:, None] + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_GATE:
                g = tl.load(GATE + g_row[:, None] + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
                yv = yv * g
            h = (x + yv).to(H_OUT.dtype.element_ty)
            tl.store(H_OUT + out_row[:, None] + cols0[None, :], h, mask=mask)
            x = h.to(tl.float32)  # normalise the stored (rounded) h, as the unfused model does
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        y = x * rstd[:, None]
        if HAS_WEIGHT:
            if CAST_BEFORE_WEIGHT:
                y = y.to(X.dtype.element_ty).to(tl.float32)
            # loaded at the tile's full [BLOCK_M, BLOCK_N] shape (rows re-read it from cache) so it
            # shares the tile's layout: a [BLOCK_N] or [1, BLOCK_N] load gets another layout and
            # costs a conversion through LDS plus a barrier
            w = tl.load(W + (cols0[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32)
            y = y * w
        if HAS_MOD:
            sc = tl.load(SCALE + s_row[:, None] + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
            sh = tl.load(SHIFT + t_row[:, None] + cols0[None, :], mask=mask, other=0.0).to(tl.float32)
            y = y * (1.0 + sc) + sh
        tl.store(OUT + out_row[:, None] + cols0[None, :], y.to(OUT.dtype.element_ty), mask=mask)
    else:
        # Pass 1: sum of squares (and the residual update, stored once).
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            mask = row_mask[:, None] & (cols < N)[None, :]
            x = tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                yv = tl.load(Y + y_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                if HAS_GATE:
                    g = tl.load(GATE + g_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                    yv = yv * g
                h = (x + yv).to(H_OUT.dtype.element_ty)
                tl.store(H_OUT + out_row[:, None] + cols[None, :], h, mask=mask)
                x = h.to(tl.float32)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / N + eps)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # pass 2 re-reads h written by other lanes of this program
        # Pass 2: normalise, weight, modulate.
        for start in range(0, N, BLOCK_N):
            cols = start + cols0
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            if HAS_RESIDUAL:
                x = tl.load(H_OUT + out_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = x * rstd[:, None]
            if HAS_WEIGHT:
                if CAST_BEFORE_WEIGHT:
                    y = y.to(X.dtype.element_ty).to(tl.float32)
                w = tl.load(W + (cols[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32)
                y = y * w
            if HAS_MOD:
                sc = tl.load(SCALE + s_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                sh = tl.load(SHIFT + t_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = y * (1.0 + sc) + sh
            tl.store(OUT + out_row[:, None] + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launcher helpers
# --------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _device_target(device: torch.device):
    """(backend, arch, warp_size) of the device, e.g. ("hip", "gfx942", 64) or ("cuda", 90, 32)."""
    if device.type == "cpu":
        return ("interpreter", None, 32)
    return _gpu_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _gpu_target(index: int):
    with torch.cuda.device(index):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _check_tensor(name: str, t, device: Optional[torch.device] = None, dtypes=_SUPPORTED_DTYPES):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {names}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; move them to one device")
    if t.device.type == "cpu" and not _interpreting():
        raise ValueError(
            f"{name} is a CPU tensor: Triton kernels run on a GPU (or on the CPU through the Triton "
            "interpreter: set TRITON_INTERPRET=1 before importing this module)"
        )


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


def _mergeable(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """True if these dims can be addressed as one flat index with a single stride."""
    dims = [(s, st) for s, st in zip(shape, strides) if s != 1]
    return all(dims[i][1] == dims[i + 1][1] * dims[i + 1][0] for i in range(len(dims) - 1))


def _flat_stride(shape: Sequence[int], strides: Sequence[int]) -> int:
    dims = [st for s, st in zip(shape, strides) if s != 1]
    return dims[-1] if dims else 0


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


def _launch_config(n_cols: int, n_rows: int, warp_size: int):
    return _launch_config_cached(n_cols, n_rows, warp_size, _MAX_FUSED_N, _CHUNK_N)


@functools.lru_cache(maxsize=1024)
def _launch_config_cached(n_cols: int, n_rows: int, warp_size: int, max_fused: int, chunk: int):
    """Block shape and warps.

    Reasons: each lane should issue 16-byte vector loads and hold a handful of them, so a program
    covers about 8 elements per lane per row chunk; short rows are packed several to a program
    so that one program still moves a few KiB (small programs leave bandwidth unused and pay
    scheduling overhead per row); rows wider than _MAX_FUSED_N loop over _CHUNK_N-wide chunks.
    """
    single = n_cols <= max_fused
    block_n = triton.next_power_of_2(n_cols) if single else chunk
    # Aim for about 4096 elements per program: ~8 KiB of bf16 in and out per program.
    block_m = max(1, min(16, 4096 // block_n, triton.next_power_of_2(max(n_rows, 1))))
    elems = block_m * block_n
    num_warps = max(1, min(16, elems // (warp_size * 8)))
    num_warps = triton.next_power_of_2(num_warps) if num_warps & (num_warps - 1) else num_warps
    return block_m, block_n, single, num_warps


def _launch(x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype):
    """Validate, pick the launch configuration and run the kernel. Returns (h_out or None, out)."""
    _check_tensor("x", x)
    device = x.device
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (the normalised one)")
    n = x.shape[-1]
    shape = x.shape
    if x.numel() > 0 and x.stride(-1) != 1 and n > 1:
        raise ValueError(f"x must be contiguous in its last dimension (stride {x.stride(-1)}); call .contiguous()")
    if not isinstance(eps, (float, int)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    has_residual = y is not None
    if has_residual:
        _check_tensor("y", y, device)
        if y.shape != shape:
            raise ValueError(f"y has shape {tuple(y.shape)} but h has shape {tuple(shape)}; they must match")
        if y.dtype != x.dtype:
            raise TypeError(f"y has dtype {y.dtype} but h has dtype {x.dtype}; they must match")
        if y.numel() > 0 and y.stride(-1) != 1 and n > 1:
            raise ValueError("y must be contiguous in its last dimension; call .contiguous()")
    if gate is not None:
        _check_tensor("gate", gate, device)
        g_strides = _bcast_strides("gate", gate, shape)
    if weight is not None:
        _check_tensor("weight", weight, device)
        if weight.dim() != 1 or weight.shape[0] != n:
            raise ValueError(f"weight must have shape [{n}] (the last dim of x), got {tuple(weight.shape)}")
        if weight.stride(0) != 1 and n > 1:
            raise ValueError("weight must be contiguous")
    has_mod = scale is not None or shift is not None
    if has_mod:
        if scale is None or shift is None:
            raise ValueError("scale and shift must be given together")
        _check_tensor("scale", scale, device)
        _check_tensor("shift", shift, device)
        s_strides = _bcast_strides("scale", scale, shape)
        t_strides = _bcast_strides("shift", shift, shape)
    if out_dtype is None:
        out_dtype = x.dtype
    elif out_dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"out_dtype must be one of float16, bfloat16, float32, got {out_dtype}")

    out = torch.empty(shape, dtype=out_dtype, device=device)
    h_out = torch.empty(shape, dtype=x.dtype, device=device) if has_residual else None
    if x.numel() == 0:
        return h_out, out
    lead = list(shape[:-1])
    m = x.numel() // n
    stride_sets = [x.stride()[:-1]]
    if has_residual:
        stride_sets.append(y.stride()[:-1])
    if gate is not None:
        stride_sets.append(g_strides[:-1])
    if has_mod:
        stride_sets += [s_strides[:-1], t_strides[:-1]]
    inner, layouts = _row_layout(stride_sets, lead)
    it = iter(layouts)
    xs = next(it)
    ys = next(it) if has_residual else (0, 0)
    gs = next(it) if gate is not None else (0, 0)
    ss = next(it) if has_mod else (0, 0)
    ts = next(it) if has_mod else (0, 0)

    _, _, warp_size = _device_target(device)
    block_m, block_n, single, num_warps = _launch_config(n, m, warp_size)
    grid = ((m + block_m - 1) // block_m,)  # plain Python: triton.cdiv is a jit function, slow on the host
    _rms_norm_kernel[grid](
        x, xs[0], xs[1],
        y, ys[0], ys[1],
        gate, gs[0], gs[1],
        h_out,
        weight,
        scale, ss[0], ss[1],
        shift, ts[0], ts[1],
        out,
        m, n, inner,
        float(eps),
        HAS_RESIDUAL=has_residual, HAS_GATE=gate is not None, HAS_WEIGHT=weight is not None,
        CAST_BEFORE_WEIGHT=bool(cast_before_weight), HAS_MOD=has_mod,
        BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_PASS=single,
        num_warps=num_warps,
    )
    return h_out, out


# --------------------------------------------------------------------------------------------
# torch.library custom ops: torch.compile traces through them instead of breaking the graph.
# --------------------------------------------------------------------------------------------
_NS = "rocm_triton_kernels"


def _op_exists(name: str) -> bool:
    return hasattr(getattr(torch.ops, _NS), name) if hasattr(torch.ops, _NS) else False


if not _op_exists("rms_norm_fused"):

    @torch.library.custom_op(f"{_NS}::rms_norm_fused", mutates_args=())
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h_out, out = _launch(x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype)
        # custom ops cannot return None: without a residual the first output is an empty tensor
        return (h_out if h_out is not None else x.new_empty(0)), out

    @_rms_norm_fused_op.register_fake
    def _(x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype):
        out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
        h_out = torch.empty_like(x, memory_format=torch.contiguous_format) if y is not None else x.new_empty(0)
        return h_out, out


def _dispatch(x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype):
    if torch.compiler.is_compiling():
        h_out, out = getattr(torch.ops, _NS).rms_norm_fused(
            x, y, gate, weight, scale, shift, float(eps), bool(cast_before_weight), out_dtype
        )
        return (h_out if y is not None else None), out
    # Eager: call the launcher directly; the custom-op dispatcher costs microseconds per call.
    return _launch(x, y, gate, weight, scale, shift, eps, cast_before_weight, out_dtype)


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
) -> torch.Tensor:
    """AdaLN: rms_norm(x, weight) * (1 + scale) + shift in one pass, with fp32 math and one rounding.

    scale and shift broadcast to x: [D], [B, 1, D] (LTX-Video, DiT: one per sample) or [B, S, D].
    """
    if scale is None or shift is None:
        raise ValueError("scale and shift are required; use rms_norm() for a plain norm")
    return _dispatch(x, None, None, weight, scale, shift, eps, cast_before_weight, None)[1]


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
):
    """h_new = h + y * gate (gate None: h + y), rounded to h's dtype; out = rms_norm_modulate(h_new).

    Returns (h_new, out). scale/shift may both be None (plain fused residual add + RMSNorm).
    """
    if y is None:
        raise ValueError("y is required; use rms_norm_modulate() without a residual")
    h_out, out = _dispatch(h, y, gate, weight, scale, shift, eps, cast_before_weight, None)
    return h_out, out


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
    checks = {
        "rms_norm": (rms_norm(x, w), rms_norm_ref(x.double(), w.double())),
        "rms_norm_modulate": (rms_norm_modulate(x, sc, sh), rms_norm_modulate_ref(x.double(), sc.double(), sh.double())),
    }
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    report, ok = {}, True
    for name, (out, ref) in checks.items():
        err = ((out.double() - ref).abs() / (1 + ref.abs())).max().item()
        report[name] = {"max_rel_err": err, "ok": bool(err <= tol)}
        ok &= err <= tol
    print(json.dumps({"device": str(device), "dtype": args.dtype, "checks": report, "ok": bool(ok)}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

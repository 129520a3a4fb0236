# SPDX-License-Identifier: Apache-2.0
"""Per-head RMSNorm of q and k, optionally followed by interleaved-pair RoPE, in one launch.

    y = cast(x / sqrt(mean(x**2 over the head dim) + eps) [cast] * w)        (per head, per token)
    out[2i]   = y[2i]   * cos[s, 2i]   - y[2i+1] * sin[s, 2i]                 (optional RoPE)
    out[2i+1] = y[2i+1] * cos[s, 2i+1] + y[2i]   * sin[s, 2i+1]
    all arithmetic in fp32; y is rounded to the input dtype (the norm module's output), out once more.

This is the q/k step of the MMDiT attention processors in diffusers: FLUX (``FluxAttnProcessor``:
``torch.nn.RMSNorm(head_dim)`` on ``[B, S, H, D]`` rows, text and image streams concatenated along the
tokens, then ``apply_rotary_emb(..., sequence_dim=1)`` with fp32 cos/sin ``[S, D]`` from ``FluxPosEmbed``),
and SD3 with ``qk_norm="rms_norm"`` (``JointAttnProcessor2_0``: diffusers ``RMSNorm(head_dim)``, image
then text, no RoPE). Public functions:

* ``head_rms_norm_rope(q, k, q_weight, k_weight, eps, cos=None, sin=None)``: q, k ``[B, S, H, D]`` (any
  strides with a contiguous last dim: a view of a projection, or a slice of a fused qkv projection);
  returns contiguous ``[B, S, H, D]`` (q_out, k_out), the layout diffusers' ``dispatch_attention_fn``
  takes (its native backend hands ``out.transpose(1, 2)`` views to SDPA, whose flash and efficient kernels
  read ``[B, S, H, D]`` memory natively).
* ``joint_head_rms_norm_rope(parts, eps, cos=None, sin=None)``: several token segments, each
  ``(q, k, q_weight, k_weight)`` with its own norm weights (FLUX's text stream uses ``norm_added_q/k``),
  written one after the other along the token dim of ONE output pair: the ``torch.cat`` of the
  processor is free. cos/sin ``[S_total, D]`` index the concatenated tokens.

``cast_before_weight`` selects where the norm rounds: True rounds the normalised value to the input
dtype before the weight multiply (diffusers ``RMSNorm`` with a half/bf16 weight); False multiplies in
fp32 and rounds once (``torch.nn.RMSNorm`` / ``F.rms_norm`` of current PyTorch). Each ``*_ref`` function
is the plain-PyTorch math the kernel replaces. The file depends on torch and triton only; copy it into
another project as is. Run ``python head_norm_rope.py --help``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from typing import Optional, Sequence, Union

import torch
import triton
import triton.language as tl

__all__ = [
    "head_rms_norm_rope",
    "joint_head_rms_norm_rope",
    "head_rms_norm_rope_ref",
    "joint_head_rms_norm_rope_ref",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Weights and cos/sin are read and converted to fp32 in the kernel: any float dtype.
_ANY_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# A head is normalised from registers in one pass; 4096 channels of q and k over 16 warps is at most
# 8 fp32 values per lane and tensor. MMDiT heads are 64 (SD3) or 128 (FLUX) wide.
_MAX_HEAD_DIM = 4096
# Elements of q (and as many of k) per step of a token's program: at most 8 FLUX heads of 128, or 16 SD3
# heads of 64 (both models have 24 heads: 3 steps of 8).
_ELEMS_PER_STEP = 1024
# Head steps unrolled up to this many (more would only grow the code and its compile time: e.g. 128 heads
# of 256 take 32 steps); beyond it the kernel loops.
_MAX_UNROLL = 8


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------
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


# ---- shared block sizes begin: copies are identical (scripts/sync_shared_blocks.py) ----
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # plain Python: triton.cdiv is a constexpr_function, microseconds per host call


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n; 1 for every n <= 1 (0 included)."""
    return 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds a call


# ---- shared block sizes end ----


@functools.lru_cache(maxsize=1024)
def _launch_config(head_dim: int, heads: int, warp_size: int):
    """(BLOCK_H, BLOCK_D, num_warps): heads per step of a token's program, padded head dim, warps.

    Reasons: a step normalises whole heads (the norm needs the full head before anything is written)
    and moves about _ELEMS_PER_STEP elements of each of q and k; BLOCK_H is the largest power of two
    within that budget that divides the head count (no masked rows; FLUX's and SD3's 24 heads: 3 steps
    of 8), unless only a small one would (then a masked last step). Each lane holds about 8 consecutive
    elements of a tile (one 16-byte bf16 vector per tensor); the warp count follows from the lane
    count (32 on NVIDIA and RDNA wave32, 64 on CDNA wave64).
    """
    block_d = _next_pow2(max(head_dim, 2))
    cap = max(1, _ELEMS_PER_STEP // block_d)
    block_h = min(cap, _next_pow2(max(heads, 1)))
    cand = block_h
    while cand >= max(1, cap // 4) and heads % cand:
        cand //= 2
    if cand >= max(1, cap // 4) and heads % cand == 0:
        block_h = cand
    num_warps = max(1, min(16, (block_h * block_d) // (warp_size * 8)))
    return block_h, block_d, _next_pow2(num_warps)


def _eps_list(eps, n: int):
    vals = list(eps) if isinstance(eps, (list, tuple)) else [eps] * n
    if len(vals) != n:
        raise ValueError(f"eps has {len(vals)} values for {n} parts; give one float or one per part")
    for e in vals:
        if isinstance(e, bool) or not isinstance(e, (float, int)) or not e >= 0:
            raise ValueError(f"eps must be a non-negative float, got {e!r}")
    return [float(e) for e in vals]


_PLANS: dict = {}  # launch plans by call signature (see _launch)


def _launch(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight):
    """Validate every part, allocate the joint outputs, run one kernel launch per part.

    The checks and the configuration depend only on the call's signature (each tensor's type, shape,
    strides, dtype and device, and the options), so they run once per signature: the plan they produce
    is kept and later calls with the same signature only allocate the outputs and launch.
    """
    try:
        key = (
            tuple(map(_sig, qs)),
            tuple(map(_sig, ks)),
            tuple(map(_sig, q_weights)),
            tuple(map(_sig, k_weights)),
            type(eps),
            tuple((type(e), e) for e in eps) if isinstance(eps, (list, tuple)) else eps,
            cos if cos is None else _sig(cos),
            sin if sin is None else _sig(sin),
            cast_before_weight,
        )
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable options: the checks say what is wrong
        key = plan = None
    if plan is None:
        plan = _plan(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight)
        if key is not None and not getattr(_TLS, "tracing", False):
            _remember(_PLANS, key, plan)
    return plan(qs, ks, q_weights, k_weights, cos, sin)


def _plan(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight):
    """The checks and configuration of _launch; returns run(qs, ks, q_weights, k_weights, cos, sin)."""
    n_parts = len(qs)
    if n_parts == 0 or len(ks) != n_parts or len(q_weights) != n_parts or len(k_weights) != n_parts:
        raise ValueError("parts must be a non-empty sequence of (q, k, q_weight, k_weight)")
    eps = _eps_list(eps, n_parts)
    _check_tensor("q", qs[0], _SUPPORTED_DTYPES)
    dev = qs[0].device
    if qs[0].dim() != 4:
        raise ValueError(f"q must be [B, S, H, D] (4 dims), got shape {tuple(qs[0].shape)}")
    bsz, _, heads, dim = qs[0].shape
    dtype = qs[0].dtype
    has_weight = q_weights[0] is not None
    total = _check_parts(qs, ks, q_weights, k_weights, has_weight)
    has_rope = _check_tables(cos, sin, total, dim, dev)
    out_shape = (bsz, total, heads, dim)
    if bsz * total * heads * dim == 0:

        def run_empty(qs, ks, q_weights, k_weights, cos, sin):
            return (torch.empty(out_shape, dtype=dtype, device=dev), torch.empty(out_shape, dtype=dtype, device=dev))

        return run_empty
    launches = _part_launches(qs, ks, eps, total, has_weight, (cos, sin) if has_rope else None, cast_before_weight)

    # outputs are contiguous; with one part they have q's shape and dtype, and torch.empty_like(q) makes
    # them with less host time where _dense_like(q)
    like_q = n_parts == 1 and _dense_like(qs[0])

    def run(qs, ks, q_weights, k_weights, cos, sin):
        if like_q:
            q_out, k_out = torch.empty_like(qs[0]), torch.empty_like(qs[0])
        else:
            q_out = torch.empty(out_shape, dtype=dtype, device=dev)
            k_out = torch.empty(out_shape, dtype=dtype, device=dev)
        for i, launch in launches:
            launch(qs[i], ks[i], q_weights[i], k_weights[i], cos, sin, q_out, k_out)
        return q_out, k_out

    return run


def _check_parts(qs, ks, q_weights, k_weights, has_weight: bool) -> int:
    """Check every part against the first one's q; returns the total number of tokens."""
    n_parts = len(qs)
    dev, dtype = qs[0].device, qs[0].dtype
    bsz, _, heads, dim = qs[0].shape
    total = 0
    for i, (q, k, qw, kw) in enumerate(zip(qs, ks, q_weights, k_weights)):
        tag = "" if n_parts == 1 else f" (part {i})"
        _check_tensor("q" + tag, q, _SUPPORTED_DTYPES, dev, ref="q")
        _check_tensor("k" + tag, k, _SUPPORTED_DTYPES, dev, ref="q")
        if q.dim() != 4 or q.shape[0] != bsz or q.shape[2] != heads or q.shape[3] != dim:
            raise ValueError(
                f"q{tag} has shape {tuple(q.shape)}; expected [{bsz}, S, {heads}, {dim}] ([B, S, H, D], "
                "with the B, H and D of the first part)"
            )
        if k.shape != q.shape:
            raise ValueError(
                f"k{tag} has shape {tuple(k.shape)} but q{tag} has shape {tuple(q.shape)}; they must match"
            )
        if q.dtype != dtype or k.dtype != dtype:
            raise TypeError(
                f"q{tag} / k{tag} have dtypes {_dtype_name(q.dtype)} / {_dtype_name(k.dtype)}; every q and k must "
                f"have the dtype {_dtype_name(dtype)}"
            )
        _check_last_contiguous("q" + tag, q)
        _check_last_contiguous("k" + tag, k)
        if (qw is None) != (kw is None) or (qw is not None) != has_weight:
            raise ValueError("q_weight and k_weight must both be tensors or both be None, in every part")
        for nm, w in (("q_weight" + tag, qw), ("k_weight" + tag, kw)):
            if w is not None:
                _check_tensor(nm, w, _ANY_FLOAT, dev, ref="q")
                if w.dim() != 1 or w.shape[0] != dim:
                    raise ValueError(f"{nm} must have shape [{dim}] (the head dim of q), got {tuple(w.shape)}")
                if dim > 1 and w.stride(0) != 1:
                    raise ValueError(f"{nm} must be contiguous")
        total += q.shape[1]
    if dim > _MAX_HEAD_DIM:
        raise ValueError(f"q has head dim {dim}; this kernel supports at most {_MAX_HEAD_DIM} (unsupported width)")
    return total


def _check_tables(cos, sin, total: int, dim: int, dev) -> bool:
    """Check the RoPE tables (both None: no rotation); returns whether there are any."""
    if cos is None and sin is None:
        return False
    if cos is None or sin is None:
        raise ValueError("cos and sin must be given together (or both None for no rotary embedding)")
    if dim % 2:
        raise ValueError(f"q has head dim {dim}; interleaved RoPE needs an even head dim")
    for nm, t in (("cos", cos), ("sin", sin)):
        _check_tensor(nm, t, _ANY_FLOAT, dev, ref="q")
        if t.dim() != 2 or t.shape[0] != total or t.shape[1] != dim:
            raise ValueError(
                f"{nm} has shape {tuple(t.shape)}; expected [{total}, {dim}] (one row per token of the "
                "concatenated parts, as FluxPosEmbed returns it)"
            )
        _check_last_contiguous(nm, t)
    return True


def _part_launches(qs, ks, eps, total: int, has_weight: bool, tables, cast_before_weight):
    """One launch per part with tokens: [(part index, _Launch)]. tables: (cos, sin), None without RoPE."""
    bsz, _, heads, dim = qs[0].shape
    dev = qs[0].device
    warp_size = _device_target(dev)[2]
    has_rope = tables is not None
    launches = []
    offset = 0
    for i, (q, k, e) in enumerate(zip(qs, ks, eps)):
        seq = q.shape[1]
        if bsz * seq * heads == 0:
            offset += seq
            continue
        block_h, block_d, num_warps = _launch_config(dim, heads, warp_size)
        # Absent weights and tables stay None: the kernel leaves out every use of them.
        args, slots = _kernel_args(
            [True, *q.stride()[:3]],
            [True, *k.stride()[:3]],
            [has_weight],  # QW
            [has_weight],  # KW
            [has_rope, tables[0].stride(0) if has_rope else 0],  # COS
            [has_rope, tables[1].stride(0) if has_rope else 0],  # SIN
            [True],  # QO
            [True],  # KO
            seq,
            heads,
            dim,
            total,
            offset,
            e,
        )
        config = dict(
            CAST_BEFORE_WEIGHT=bool(cast_before_weight),
            BLOCK_H=block_h,
            N_STEPS=_cdiv(heads, block_h),
            MAX_UNROLL=_MAX_UNROLL,
            BLOCK_D=block_d,
            num_warps=num_warps,
        )
        grid = (bsz * seq,)  # one program per token
        launches.append((i, _Launch(_head_rms_norm_rope_kernel, grid, args, config, slots, dev)))
        offset += seq
    return launches


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


def _head_rms_norm_rope_op(
    qs: list[torch.Tensor],
    ks: list[torch.Tensor],
    q_weights: list[Optional[torch.Tensor]],
    k_weights: list[Optional[torch.Tensor]],
    eps: list[float],
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    cast_before_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight)


def _head_rms_norm_rope_op_fake(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight):
    b, _, h, d = qs[0].shape
    total = sum(q.shape[1] for q in qs)
    return (
        torch.empty((b, total, h, d), dtype=qs[0].dtype, device=qs[0].device),
        torch.empty((b, total, h, d), dtype=qs[0].dtype, device=qs[0].device),
    )


_register("head_rms_norm_rope", _head_rms_norm_rope_op, _head_rms_norm_rope_op_fake)


def _dispatch(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight, fn="head_rms_norm_rope"):
    if torch.compiler.is_compiling():
        return _compile_op("head_rms_norm_rope")(
            list(qs),
            list(ks),
            list(q_weights),
            list(k_weights),
            _eps_list(eps, len(qs)),
            cos,
            sin,
            bool(cast_before_weight),
        )
    # Eager: call the launcher directly; the custom-op dispatcher costs microseconds per call.
    if torch.is_grad_enabled():  # (the names are built in grad mode only)
        kinds = ("q", "k", "q_weight", "k_weight")
        names = (
            list(kinds) if fn == "head_rms_norm_rope" else [f"{n} of part {i}" for i in range(len(qs)) for n in kinds]
        )
        tensors = [t for part in zip(qs, ks, q_weights, k_weights) for t in part]
        _check_no_grad(fn, names + ["cos", "sin"], tensors + [cos, sin])
    return _launch(qs, ks, q_weights, k_weights, eps, cos, sin, cast_before_weight)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def head_rms_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: Optional[torch.Tensor],
    k_weight: Optional[torch.Tensor],
    eps: float,
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    *,
    cast_before_weight: bool = False,
):
    """``rope(norm_q(q)), rope(norm_k(k))`` per head in one launch (no RoPE when cos/sin are None).

    q, k: [B, S, H, D], same shape and dtype (fp16/bf16/fp32), any strides with a contiguous last dim.
    q_weight, k_weight: [D] (any float dtype) or both None. cos/sin: [S, D] (fp32 from FluxPosEmbed),
    interleaved pairs (diffusers ``apply_rotary_emb(..., use_real_unbind_dim=-1)``), D even.
    Returns contiguous [B, S, H, D] (q_out, k_out) of q's dtype. See the module docstring for
    ``cast_before_weight``.
    The kernel has no backward: in grad mode, an input that requires grad raises RuntimeError (call it
    under torch.no_grad() / torch.inference_mode(), or use head_rms_norm_rope_ref where gradients are needed).
    """
    return _dispatch([q], [k], [q_weight], [k_weight], eps, cos, sin, cast_before_weight)


def joint_head_rms_norm_rope(
    parts: Sequence[tuple],
    eps: Union[float, Sequence[float]],
    cos: Optional[torch.Tensor] = None,
    sin: Optional[torch.Tensor] = None,
    *,
    cast_before_weight: bool = False,
):
    """Per-head q/k RMSNorm (+ RoPE) of several token segments, concatenated along the tokens.

    parts: [(q, k, q_weight, k_weight), ...], each q/k [B, S_i, H, D] with its own strides and norm
    weights; B, H, D and the dtype are shared. eps: one float, or one per part. cos/sin: None, or
    [sum S_i, D] for the concatenated tokens. Returns (q_out, k_out), contiguous [B, sum S_i, H, D],
    equal to ``torch.cat([rope(norm(q_i)) ...], dim=1)`` (and the same for k) without the copies.
    FLUX's double-stream attention: parts = [(text q, text k, norm_added_q.weight, norm_added_k.weight),
    (image q, image k, norm_q.weight, norm_k.weight)].
    No backward: in grad mode, an input that requires grad raises RuntimeError (see head_rms_norm_rope).
    """
    if isinstance(parts, tuple) and parts and isinstance(parts[0], torch.Tensor):
        raise TypeError("parts must be a sequence of (q, k, q_weight, k_weight) tuples")
    parts = [tuple(p) for p in parts]
    if any(len(p) != 4 for p in parts):
        raise ValueError("each part must be a (q, k, q_weight, k_weight) tuple")
    qs, ks, qws, kws = (list(c) for c in zip(*parts)) if parts else ([], [], [], [])
    return _dispatch(qs, ks, qws, kws, eps, cos, sin, cast_before_weight, fn="joint_head_rms_norm_rope")


# --------------------------------------------------------------------------------------------
# References: the plain-PyTorch math the kernel replaces (run them in float64 for testing)
# --------------------------------------------------------------------------------------------
def _rms_norm_module_ref(x, weight, eps, cast_before_weight):
    """RMSNorm over the last dim, rounded where the modules round (nothing rounds in float64)."""
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(f)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        if cast_before_weight:
            y = y.to(x.dtype).to(f)
        y = y * weight.to(f)
    return y.to(x.dtype)


def _rope_ref(x, cos, sin):
    """diffusers apply_rotary_emb(x, (cos, sin), sequence_dim=1) for x [B, S, H, D]: fp32 math
    (float64 for float64 x), one rounding."""
    f = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(f)
    even, odd = xf.unflatten(-1, (-1, 2)).unbind(-1)
    partner = torch.stack([-odd, even], dim=-1).flatten(-2)
    c, s = cos.to(f)[None, :, None, :], sin.to(f)[None, :, None, :]
    return (xf * c + partner * s).to(x.dtype)


def joint_head_rms_norm_rope_ref(parts, eps, cos=None, sin=None, cast_before_weight=False):
    eps = list(eps) if isinstance(eps, (list, tuple)) else [eps] * len(parts)
    qn = torch.cat([_rms_norm_module_ref(q, qw, e, cast_before_weight) for (q, _, qw, _), e in zip(parts, eps)], dim=1)
    kn = torch.cat([_rms_norm_module_ref(k, kw, e, cast_before_weight) for (_, k, _, kw), e in zip(parts, eps)], dim=1)
    if cos is None:
        return qn, kn
    return _rope_ref(qn, cos, sin), _rope_ref(kn, cos, sin)


def head_rms_norm_rope_ref(q, k, q_weight, k_weight, eps, cos=None, sin=None, cast_before_weight=False):
    return joint_head_rms_norm_rope_ref([(q, k, q_weight, k_weight)], eps, cos, sin, cast_before_weight)


# --------------------------------------------------------------------------------------------
# Self-check: python head_norm_rope.py [--tokens S] [--heads H] [--head-dim D] [--dtype bf16]
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(
        description="Check the per-head q/k RMSNorm (+ RoPE) kernel against a float64 reference, with the "
        "FLUX layout: text and image segments, fp32 cos/sin tables."
    )
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
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    device = "cuda" if torch.cuda.is_available() and not _interpreting() else "cpu"
    if device == "cpu" and not _interpreting():
        print("no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter", file=sys.stderr)
        return 2
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    B, H, D, St, Si = 1, args.heads, args.head_dim, args.text_tokens, args.tokens

    def rnd(*shape, scale=1.0, offset=0.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale + offset).to(device, dt)

    # q, k, v of each stream as the projections produce them: [B, S, H*D] viewed as [B, S, H, D]
    txt = rnd(B, St, 3 * H * D, scale=2.0)
    img = rnd(B, Si, 3 * H * D, scale=2.0)
    tq, tk = (t.unflatten(-1, (H, D)) for t in txt[..., : 2 * H * D].chunk(2, dim=-1))
    iq, ik = (t.unflatten(-1, (H, D)) for t in img[..., : 2 * H * D].chunk(2, dim=-1))
    ws = [rnd(D, scale=0.2, offset=1.0) for _ in range(4)]
    angles = torch.randn(St + Si, D // 2, generator=g, dtype=torch.float64) * 10
    cos = angles.cos().repeat_interleave(2, dim=-1).float().to(device)
    sin = angles.sin().repeat_interleave(2, dim=-1).float().to(device)
    parts = [(tq, tk, ws[0], ws[1]), (iq, ik, ws[2], ws[3])]
    q_out, k_out = joint_head_rms_norm_rope(parts, 1e-6, cos, sin)
    dparts = [tuple(t.double() for t in part) for part in parts]
    q_ref, k_ref = joint_head_rms_norm_rope_ref(dparts, 1e-6, cos.double(), sin.double())
    q_nr, k_nr = joint_head_rms_norm_rope(parts, 1e-6, cast_before_weight=True)
    q_nr_ref, k_nr_ref = joint_head_rms_norm_rope_ref(dparts, 1e-6)
    checks = {
        "q_rope": (q_out, q_ref),
        "k_rope": (k_out, k_ref),
        "q_norm_only": (q_nr, q_nr_ref),
        "k_norm_only": (k_nr, k_nr_ref),
    }
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}[dtype]
    report, ok = {}, True
    for name, (got, ref) in checks.items():
        err = ((got.double() - ref.double()).abs() / (1 + ref.double().abs())).max().item()
        good = bool(err <= tol)
        report[name] = {"max_rel_err": err, "ok": good}
        ok &= good
    print(
        json.dumps(
            {"device": str(device), "dtype": args.dtype, "shape": [B, St + Si, H, D], "checks": report, "ok": bool(ok)}
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

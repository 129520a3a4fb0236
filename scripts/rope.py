# SPDX-License-Identifier: Apache-2.0
"""Rotary position embeddings (RoPE) of q or k, one tensor a launch.

    interleaved (LTX-Video): out[2i]   = x[2i]   * cos[2i]   - x[2i+1] * sin[2i]
                             out[2i+1] = x[2i+1] * cos[2i+1] + x[2i]   * sin[2i+1]
    rotate-half (Llama/HF):  out = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin
    all arithmetic in fp32, one rounding to the input dtype at the end.

Public: ltx_rope, rope_rotate_half, rope_interleaved; each ``*_ref`` is the plain-PyTorch math a kernel replaces
(run it on float64). LTX-Video's q/k RMSNorm fused with the RoPE: qk_norm_rope.py.
Depends on torch and triton only; ``python rope.py --help`` runs its self-check.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ANY_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # cos/sin tables
_MAX_CHUNK = 4096  # RoPE splits wide rows over a second grid axis in even chunks of at most this
_ELEMS_PER_PROGRAM = 2048  # per program and tensor: one LTX row; bf16 in + out is 8 KiB


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


@torch.compiler.assume_constant_result  # a constant for Dynamo: it need not trace Triton's driver
@functools.lru_cache(maxsize=None)
def _device_target(device: torch.device):
    """(backend, arch, warp size), e.g. ("hip", "gfx942", 64); ("interpreter", None, 32) on the CPU."""
    if device.type == "cpu":
        return ("interpreter", None, 32)
    with torch.cuda.device(device):
        target = triton.runtime.driver.active.get_current_target()
    return (target.backend, target.arch, target.warp_size)


def _check(names: str, dtypes, device, *tensors, dims=None, kind=None) -> None:
    """Refuse each tensor unless it is a torch.Tensor of dtypes (on device if given); dims: an x of kind RoPE."""
    for name, t in zip(names.split(","), tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            expected = ", ".join(str(d)[6:] for d in dtypes)
            raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected one of {expected}")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the input is on {device}; move them to one device")
        if dims is not None and t.dim() != dims:
            shape = "B, S, C" if dims == 3 else "B, H, S, D"
            raise ValueError(f"{name} must be [{shape}] ({dims} dims), got shape {tuple(t.shape)}")
        if dims is not None and t.shape[-1] % 2:
            what = ("channels", "channel count") if dims == 3 else ("head dim", "head dim")
            raise ValueError(f"{name} has {what[0]} {t.shape[-1]}; {kind} RoPE needs an even {what[1]}")


def _contiguous_last(**tensors) -> None:
    for name, t in tensors.items():
        if t.numel() > 0 and t.shape[-1] > 1 and (st := t.stride(-1)) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (stride {st}); call .contiguous()")


def _views(names: str, shape, what: str, *tensors) -> list:
    """Each tensor ([S, W], [B or 1, S, W] or [B or 1, H or 1, S, W]) viewed at shape ([B, S, W] or [B, H, S, W])
    without a copy; what: what a row holds, for the error ("cos" in it is replaced by the tensor's name)."""
    b, s, w, views = shape[0], shape[-2], shape[-1], []
    for name, t in zip(names.split(","), tensors):
        orig = tuple(t.shape)
        t = t[(None,) * (len(shape) - 2)] if t.dim() == 2 else t  # [S, W]: every leading dim broadcast
        t = t.unsqueeze(1) if len(shape) == 4 and t.dim() == 3 else t  # [B, S, W]: transformers' unsqueeze(1)
        ok = t.dim() == len(shape) and t.shape[0] in (1, b) and t.shape[-2:] == (s, w)
        if not ok or (len(shape) == 4 and t.shape[1] not in (1, shape[1])):
            heads, row = f"{shape[1]} or 1, " if len(shape) == 4 else "", what.replace("cos", name)
            raise ValueError(f"{name} has shape {orig}; expected [{s}, {w}] or [{b} or 1, {heads}{s}, {w}] ({row})")
        views.append(t.expand(shape))
    return views


def _launch_config(width, n_rows, warp_size, max_block, elems=_ELEMS_PER_PROGRAM, per_lane=8):
    """(BLOCK_M, BLOCK_C, num_warps): about `elems` elements per program (narrow rows packed, up to 64, to
    amortise per-program overhead), `per_lane` consecutive elements per lane (8: one 16-byte bf16 vector)."""
    pow2 = lambda n: 1 << (max(n, 1) - 1).bit_length()  # plain Python: triton.next_power_of_2 costs microseconds
    block_c = min(pow2(max(width, 2)), max_block)
    block_m = max(1, min(64, elems // block_c, pow2(max(n_rows, 1))))
    return block_m, block_c, pow2(max(1, min(16, (block_m * block_c) // (warp_size * per_lane))))


def _rope_inputs(x: Tensor, cos, sin, dims: int, kind: str) -> list:
    """Check x and cos/sin; returns the tables viewed at x's shape, or at [B, H, S, D // 2] for per-pair tables."""
    _check("x", _SUPPORTED_DTYPES, None, x, dims=dims, kind=kind)
    _check("cos,sin", _ANY_FLOAT, x.device, cos, sin)
    if dims == 3:
        return _views("cos,sin", x.shape, "one row of C cos values per token", cos, sin)
    dim = x.shape[-1]
    if cos.shape[-1:] != sin.shape[-1:] or cos.shape[-1:] not in ((dim,), (dim // 2,)):
        raise ValueError(
            f"cos and sin have shapes {tuple(cos.shape)} and {tuple(sin.shape)}; expected {dim} (one value per "
            f"channel) or {dim // 2} (one per channel pair) as their last dim for x of shape {tuple(x.shape)}"
        )
    return _views("cos,sin", (*x.shape[:3], cos.shape[-1]), "one row per token", cos, sin)


def _ltx_rope_launch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    cos, sin = _rope_inputs(x, cos, sin, 3, "interleaved")
    _contiguous_last(x=x, cos=cos, sin=sin)
    (bsz, seq, ch), out = x.shape, torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() > 0:
        m = bsz * seq
        block_m, block_c, num_warps = _launch_config(ch, m, _device_target(x.device)[2], _MAX_CHUNK)
        _ltx_rope_kernel[(-(-m // block_m), -(-ch // block_c))](
            x, x.stride(0), x.stride(1), cos, cos.stride(0), cos.stride(1), sin, sin.stride(0), sin.stride(1),
            out, out.stride(0), out.stride(1), m, bsz, ch, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps,
        )  # fmt: skip
    return out


def _rope_rotate_half_launch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The output has x's layout when x is dense (torch.empty_like), as the eager expression returns it."""
    cos, sin = _rope_inputs(x, cos, sin, 4, "rotate-half")
    _contiguous_last(x=x, cos=cos, sin=sin)
    (bsz, heads, seq, dim), out = x.shape, torch.empty_like(x)
    if x.numel() > 0:
        # tile sized on the half width (each element pairs with one of the other half): one bf16 vector per half
        m, half, warp = bsz * heads * seq, dim // 2, _device_target(x.device)[2]
        block_m, block_h, num_warps = _launch_config(half, m, warp, _MAX_CHUNK // 2, _ELEMS_PER_PROGRAM // 2)
        _rope_rotate_half_kernel[(-(-m // block_m), -(-half // block_h))](
            x, *x.stride()[:3], cos, *cos.stride()[:3], sin, *sin.stride()[:3], out, *out.stride()[:3], m, heads,
            seq, half, HALF_TABLES=cos.shape[-1] != dim, BLOCK_M=block_m, BLOCK_H=block_h, num_warps=num_warps,
        )  # fmt: skip
    return out


def _rope_interleaved_launch(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """cos/sin may be strided (a complex table's parts); the output has x's layout when x is dense."""
    cos, sin = _rope_inputs(x, cos, sin, 4, "interleaved")
    _contiguous_last(x=x)
    (bsz, heads, seq, dim), out = x.shape, torch.empty_like(x)
    if x.numel() > 0:
        m = bsz * heads * seq
        block_m, block_c, num_warps = _launch_config(dim, m, _device_target(x.device)[2], _MAX_CHUNK)
        _rope_interleaved_kernel[(-(-m // block_m), -(-dim // block_c))](
            x, *x.stride()[:3], cos, *cos.stride(), sin, *sin.stride(), out, *out.stride()[:3], m, heads, seq, dim,
            PAIR_TABLES=cos.shape[-1] != dim or dim == 0, BLOCK_M=block_m, BLOCK_C=block_c, num_warps=num_warps,
        )  # fmt: skip
    return out


def _no_backward(fn: str, names: str, *tensors) -> None:
    """In grad mode, refuse an input that requires grad: the kernels have no backward."""
    for name, t in zip(names.split(","), tensors) if torch.is_grad_enabled() else ():
        if getattr(t, "requires_grad", False):
            raise RuntimeError(
                f"{fn}: {name} requires grad, but this Triton kernel has no backward (its outputs would carry no "
                f"grad_fn, and gradients would silently stop there); call {fn} under torch.no_grad() or "
                f"torch.inference_mode(), or use the PyTorch reference ({fn}_ref) where gradients are needed"
            )


def ltx_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """diffusers LTX-Video ``apply_rotary_emb(x, (cos, sin))``. x: [B, S, C], C even, channels contiguous (rows may
    be strided); cos/sin: [B or 1, S, C] or [S, C], any float dtype. Returns a contiguous [B, S, C] of x's dtype.
    No backward: in grad mode an input that requires grad raises RuntimeError (use ltx_rope_ref)."""
    _no_backward("ltx_rope", "x,cos,sin", x, cos, sin)
    return _ltx_rope_launch(x, cos, sin)


def rope_rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers ``x * cos + rotate_half(x) * sin``. x: [B, H, S, D], last dim contiguous; cos/sin: [S, W],
    [B or 1, S, W] or [B or 1, H or 1, S, W], W = D or D / 2 (diffusers' split RoPE tables, read in place).
    The output has x's dtype, and x's layout when x is dense. No backward."""
    _no_backward("rope_rotate_half", "x,cos,sin", x, cos, sin)
    return _rope_rotate_half_launch(x, cos, sin)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """diffusers ``apply_rotary_emb`` for x [B, H, S, D]: pairs (2i, 2i+1) rotated. cos/sin as rope_rotate_half's,
    W = D (per channel) or D // 2 (per pair: a complex table's parts). Output as rope_rotate_half's. No backward."""
    _no_backward("rope_interleaved", "x,cos,sin", x, cos, sin)
    return _rope_interleaved_launch(x, cos, sin)


def ltx_rope_ref(x, cos, sin):
    xf = x.double() if x.dtype == torch.float64 else x.float()
    even, odd = xf.unflatten(-1, (-1, 2)).unbind(-1)
    return (xf * cos.to(xf.dtype) + torch.stack([-odd, even], dim=-1).flatten(-2) * sin.to(xf.dtype)).to(x.dtype)


def rope_rotate_half_ref(x, cos, sin):
    if x.shape[-1] and cos.shape[-1] * 2 == x.shape[-1]:  # one value per channel pair (c, c + D / 2)
        cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    cos, sin = (cos.unsqueeze(1), sin.unsqueeze(1)) if cos.dim() == 3 else (cos, sin)
    xf = x.double() if x.dtype == torch.float64 else x.float()
    first, second = xf.chunk(2, dim=-1)
    return (xf * cos.to(xf.dtype) + torch.cat([-second, first], dim=-1) * sin.to(xf.dtype)).to(x.dtype)


def rope_interleaved_ref(x, cos, sin):
    if cos.shape[-1] * 2 == x.shape[-1]:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    if cos.dim() < 4:  # [B, S, W]: the head dim is broadcast; [S, W]: batch and heads
        cos, sin = (cos.unsqueeze(1), sin.unsqueeze(1)) if cos.dim() == 3 else (cos[None, None], sin[None, None])
    return ltx_rope_ref(x, cos, sin)


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Check the RoPE kernels against float64 references on random inputs.")
    p.add_argument("--tokens", type=int, default=12, help="tokens per sample S (default 12; batch is 2)")
    p.add_argument(
        "--width", type=int, default=2048, help="channels C of the [B, S, C] check (default 2048, LTX-Video)"
    )
    p.add_argument("--head-dim", type=int, default=64, help="head dim D of the [B, H, S, D] checks (default 64)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.width % 2 or a.head_dim % 2 or min(a.width, a.head_dim, a.tokens) < 1:
        p.error("--width and --head-dim must be even and positive, --tokens positive")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if not (torch.cuda.is_available() or interpreting):
        p.exit(2, "no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter\n")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    g, (b, s, c, d) = torch.Generator().manual_seed(a.seed), (2, a.tokens, a.width, a.head_dim)
    q = (2 * torch.randn(b, s, c, generator=g)).to(dtype)
    ang = 30 * torch.randn(b, s, c, generator=g)  # independent angles per channel, as large as video RoPE's
    x = torch.randn(b, s, 4, d, generator=g).transpose(1, 2).to(dtype)  # [B, H, S, D], strided
    half = 3 * torch.randn(b, s, d // 2, generator=g)  # tables of one value per channel pair
    checks = {  # name: (kernel, float64 reference, arguments)
        "ltx_rope": (ltx_rope, ltx_rope_ref, (q, ang.cos(), ang.sin())),
        "rope_rotate_half": (rope_rotate_half, rope_rotate_half_ref, (x, half.cos(), half.sin())),
        "rope_interleaved": (rope_interleaved, rope_interleaved_ref, (x, half.cos(), half.sin())),
    }
    # error budget relative to the values: a few roundings of the dtype plus the fp32 cos/sin of large angles
    tol = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}[dtype]
    device, report = "cpu" if interpreting else "cuda", {}
    for name, (fn, ref_fn, args) in checks.items():
        out = fn(*(t.to(device) if isinstance(t, Tensor) else t for t in args))
        ref = ref_fn(*(t.double() if isinstance(t, Tensor) else t for t in args))
        out, ref = (torch.cat(out), torch.cat(ref)) if isinstance(out, tuple) else (out, ref)
        err = ((out.double().cpu() - ref).abs() / (1 + ref.abs())).max().item()
        report[name] = {"max_rel_err": err, "ok": err <= tol and bool(torch.isfinite(out).all())}
    ok = all(v["ok"] for v in report.values())
    print(json.dumps({"device": device, "dtype": a.dtype, "shape": [b, s, c], "checks": report, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

try:  # kernel_runtime.py beside this file adds launch plans, torch.library ops and device checks
    import kernel_runtime
except ImportError:
    pass
else:
    kernel_runtime.accelerate(
        globals(), ltx_rope="_ltx_rope_launch", rope_rotate_half="_rope_rotate_half_launch",
        rope_interleaved="_rope_interleaved_launch",
    )  # fmt: skip

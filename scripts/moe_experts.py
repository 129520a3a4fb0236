# SPDX-License-Identifier: Apache-2.0
"""The experts of a mixture-of-experts SwiGLU MLP for decoding: each chosen expert's weights read once, in place.

    for each token t and each of its K chosen experts e = idx[t, k] (pair p = t * K + k):
        g, u   = rnd(x[t] @ Wgu[e, gate]^T), rnd(x[t] @ Wgu[e, up]^T)       Wgu: [E, 2 I, H], gate rows first or second
        a[p]   = rnd(silu(g) * u)                                             (fp32 math, one rounding)
    out[t] = rnd(sum_k w[t, k] * rnd(a[p] @ Wd[e]^T))                         Wd: [E, H, I], the sum in fp32, k in order
    rnd: to x's dtype, where transformers' experts round: a GEMM's output; w * y where torch's type promotion of
    the two gives x's dtype (bf16 w with bf16 x), not with fp32 w.

At decode a token reads K experts' weights (Mixtral-8x7B: 2 x 3 x 4096 x 14336 bf16 = 0.7 GB a layer), so the
time is the time to read them. Transformers' grouped_mm path sorts the pairs, gathers, runs two grouped GEMMs
sized for many rows per expert, and about ten small ops; here two kernels, each reading an expert's rows straight
from the [E, ...] weight at the expert id the GPU holds (no host sync: the decode step stays capturable):
  _gate_up_kernel   one program per (pair, BLOCK_N gate rows and the matching up rows): both GEMVs, SwiGLU
  _down_kernel      one program per (token, BLOCK_N output rows): the K experts' GEMVs and the weighted sum
Every weight element is read once per pair; with many tokens on one expert a grouped GEMM reads it once for all:
``moe_swiglu_experts`` is for few pairs (decode), see MAX_PAIRS. fp32 accumulation in [BLOCK_N, BLOCK_K] tiles,
reduced once (fixed order: bit-identical run to run). Public: moe_swiglu_experts, moe_swiglu_experts_ref
(float64-ready). Torch and triton only; ``python moe_experts.py --help`` runs the self-check."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_PAIRS = (
    64  # token-expert pairs a call takes: each pair reads its expert's weights (a grouped GEMM: each expert once)
)
_BLOCK_K = 256  # 512 bytes of a bf16 weight row per step: 16-byte vectors over a warp's lanes
_MIN_PROGRAMS_PER_CU = 4  # programs per CU / SM before BLOCK_N stops shrinking: enough loads in flight


@triton.jit
def _gemv_tile(rows, x_ptr, n_mask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k W[rows, k] * x[k] in fp32 for a [BLOCK_N] block of weight rows (pointers to each row's start)."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(rows[:, None] + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_kernel(
    X, stride_xt,  # [T, H] tokens, H contiguous
    IDX,  # [T * K] expert id of each pair, p = t * K + k
    W, stride_we, stride_wn,  # gate_up weight [E, 2 I, H], H contiguous
    A,  # out: [T * K, I] contiguous
    E, I, H,
    TOP_K: tl.constexpr,
    GATE_FIRST: tl.constexpr,  # gate rows are W[e, :I] (else W[e, I:])
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    p = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(IDX + p).to(tl.int64)
    valid = (e >= 0) & (e < E)  # an id outside [0, E) reads nothing (its output is 0), never out of bounds
    e = tl.where(valid, e, 0)
    n_mask = n < tl.where(valid, I, 0)
    x_row = X + (p // TOP_K).to(tl.int64) * stride_xt
    gate = W + e * stride_we + n.to(tl.int64) * stride_wn  # rows n of the first half
    up = gate + I.to(tl.int64) * stride_wn  # rows I + n (in int64: a permuted [2 I, E, H] storage is large)
    if not GATE_FIRST:
        gate, up = up, gate
    g = _gemv_tile(gate, x_row, n_mask, H, BLOCK_N, BLOCK_K)
    u = _gemv_tile(up, x_row, n_mask, H, BLOCK_N, BLOCK_K)
    g = g.to(A.dtype.element_ty).to(tl.float32)  # the gate/up GEMM's output in the model's dtype
    u = u.to(A.dtype.element_ty).to(tl.float32)
    a = g / (1.0 + tl.exp(-g)) * u  # silu(g) * u, overflow-safe as written (exp(-g) = inf gives -0.0)
    tl.store(A + p.to(tl.int64) * I + n, a.to(A.dtype.element_ty), mask=n < I)


@triton.jit
def _down_kernel(
    A,  # [T * K, I] contiguous: _gate_up_kernel's output
    IDX,  # [T * K] expert ids
    RW,  # [T * K] routing weights
    W, stride_we, stride_wn,  # down weight [E, H, I], I contiguous
    OUT, stride_ot,  # [T, H], H contiguous
    E, H, I,
    TOP_K: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,  # w * y rounds to the model's dtype (torch's promotion of y and w gives it)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        p = t * TOP_K + k
        e = tl.load(IDX + p).to(tl.int64)
        valid = (e >= 0) & (e < E)
        e = tl.where(valid, e, 0)
        rows = W + e * stride_we + n.to(tl.int64) * stride_wn
        y = _gemv_tile(rows, A + p.to(tl.int64) * I, n < tl.where(valid, H, 0), I, BLOCK_N, BLOCK_K)
        y = y.to(OUT.dtype.element_ty).to(tl.float32)  # the down GEMM's output in the model's dtype
        y = y * tl.load(RW + p).to(tl.float32)
        if ROUND_PRODUCT:
            y = y.to(OUT.dtype.element_ty).to(tl.float32)
        out += y
    tl.store(OUT + t.to(tl.int64) * stride_ot + n, out.to(OUT.dtype.element_ty), mask=n < H)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _compute_units(device: torch.device) -> int:
    if device.type == "cpu":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_n(programs_per_block: int, n: int, cus: int) -> int:
    """32 rows a program (16 KiB of bf16 weights a step), halved down to 4 while the grid has fewer than
    _MIN_PROGRAMS_PER_CU programs per CU: at decode the grid is all the parallelism there is."""
    block = 32
    while block > 4 and programs_per_block * triton.cdiv(n, block) < _MIN_PROGRAMS_PER_CU * cus:
        block //= 2
    return block


def _check(name, t, dtypes, dim, device=None, rows=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {str(t.dtype)[6:]}; expected one of {', '.join(str(d)[6:] for d in dtypes)}")
    if t.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; move them to one device")
    if rows and t.shape[-1] > 1 and t.stride(-1) != 1:  # (the small routing tensors are copied when strided)
        raise ValueError(f"{name} must be contiguous in its last dimension (stride {t.stride(-1)}); call .contiguous()")


def _launch(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
            gate_first: bool) -> Tensor:  # fmt: skip
    """Check a call, size the grids, launch the two kernels. Returns [T, H] in x's dtype."""
    _check("x", x, _DTYPES, 2)
    dev, (t, h) = x.device, x.shape
    _check("gate_up", gate_up, (x.dtype,), 3, dev)
    _check("down", down, (x.dtype,), 3, dev)
    _check("top_k_index", top_k_index, (torch.int64, torch.int32), 2, dev, rows=False)
    _check("top_k_weights", top_k_weights, _DTYPES, 2, dev, rows=False)
    e, two_i, _ = gate_up.shape
    i = two_i // 2
    if gate_up.shape[2] != h or two_i % 2:
        raise ValueError(f"gate_up must have shape [E, 2 I, {h}] (H = x's last dim), got {tuple(gate_up.shape)}")
    if tuple(down.shape) != (e, h, i):
        raise ValueError(f"down must have shape [{e}, {h}, {i}] ([E, H, I] of gate_up's), got {tuple(down.shape)}")
    if top_k_index.shape[0] != t or top_k_weights.shape != top_k_index.shape:
        msg = f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)}"
        raise ValueError(f"{msg} must both have shape [{t}, K] (one row per token of x)")
    k = top_k_index.shape[1]
    if t * k > MAX_PAIRS:
        raise ValueError(
            f"{t} tokens x {k} experts = {t * k} pairs, more than MAX_PAIRS ({MAX_PAIRS}): use a grouped GEMM"
        )
    out = torch.empty(t, h, dtype=x.dtype, device=dev)
    if t == 0 or h == 0:
        return out
    if k == 0 or i == 0:
        return out.zero_()
    idx = top_k_index.reshape(-1).contiguous()  # [T * K], p = t * K + k (a copy only if the index is strided)
    rw = top_k_weights.reshape(-1).contiguous()
    a = torch.empty(t * k, i, dtype=x.dtype, device=dev)
    cus = _compute_units(dev)
    bn = _block_n(t * k, i, cus)
    _gate_up_kernel[(t * k, triton.cdiv(i, bn))](
        x, x.stride(0), idx, gate_up, gate_up.stride(0), gate_up.stride(1), a, e, i, h,
        TOP_K=k, GATE_FIRST=bool(gate_first), BLOCK_N=bn, BLOCK_K=_BLOCK_K, num_warps=4,
    )  # fmt: skip
    bn = _block_n(t, h, cus)
    _down_kernel[(t, triton.cdiv(h, bn))](
        a, idx, rw, down, down.stride(0), down.stride(1), out, out.stride(0), e, h, i,
        TOP_K=k, ROUND_PRODUCT=torch.promote_types(x.dtype, top_k_weights.dtype) == x.dtype, BLOCK_N=bn, BLOCK_K=_BLOCK_K, num_warps=4,
    )  # fmt: skip
    return out


def moe_swiglu_experts(x: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor, *,
                       gate_first: bool = True) -> Tensor:  # fmt: skip
    """out[t] = sum_k top_k_weights[t, k] * down[e] @ swiglu(gate_up[e] @ x[t]), e = top_k_index[t, k] (module
    docstring), for x [T, H] with T * K <= MAX_PAIRS; gate_up [E, 2 I, H] (gate rows first unless gate_first=False),
    down [E, H, I], both in x's dtype. Expert ids must lie in [0, E) (one outside contributes 0: the kernel cannot
    raise). No backward: an input requiring grad raises in grad mode."""
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (x, top_k_weights, gate_up, down)):
        raise RuntimeError(
            "moe_swiglu_experts: an input requires grad, but this Triton kernel has no backward (gradients would "
            "silently stop): call it under torch.no_grad() or torch.inference_mode(), or use moe_swiglu_experts_ref"
        )
    return _launch(x, top_k_index, top_k_weights, gate_up, down, gate_first)


def moe_swiglu_experts_ref(x, top_k_index, top_k_weights, gate_up, down, gate_first=True, *, dtype=None):
    """The same math in plain PyTorch, pair by pair; exact in float64. dtype: where to round (default x's; a
    float64 copy of a bf16 model's input: torch.bfloat16, to round where the model rounds)."""
    dtype = dtype or x.dtype
    f = torch.float64 if x.dtype == torch.float64 else torch.float32

    def rnd(v):
        return v.to(dtype).to(f)

    out = torch.zeros(x.shape, dtype=f, device=x.device)
    i = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for k in range(top_k_index.shape[1]):
            e = int(top_k_index[t, k])
            gu = rnd(gate_up[e].to(f) @ x[t].to(f))
            g, u = (gu[:i], gu[i:]) if gate_first else (gu[i:], gu[:i])
            y = rnd(down[e].to(f) @ rnd(torch.nn.functional.silu(g) * u))
            w = top_k_weights[t, k]
            low = w.dtype in (torch.float16, torch.bfloat16) and torch.promote_types(dtype, w.dtype) == dtype
            out[t] += rnd(y * w.to(f)) if low else y * w.to(f)
    return out.to(dtype)


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="Check the MoE experts kernels against a float64 reference.")
    p.add_argument("--tokens", type=int, default=1, help="tokens (default 1: a decode step)")
    p.add_argument("--experts", type=int, default=8, help="experts E (default 8)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token K (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="H (default 512)")
    p.add_argument("--intermediate", type=int, default=1024, help="I (default 1024)")
    p.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for name in ("tokens", "experts", "top_k", "hidden", "intermediate"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.top_k > a.experts or a.tokens * a.top_k > MAX_PAIRS:
        p.error(f"need --top-k <= --experts and tokens x top-k <= {MAX_PAIRS}")
    if not (torch.cuda.is_available() or _interpreting()):
        p.exit(2, "no GPU found: rerun with TRITON_INTERPRET=1 to use the Triton interpreter\n")
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    device, g = ("cpu" if _interpreting() else "cuda"), torch.Generator().manual_seed(a.seed)
    t, e, k, h, i = a.tokens, a.experts, a.top_k, a.hidden, a.intermediate
    x = torch.randn(t, h, generator=g)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g) / h**0.5, torch.randn(e, h, i, generator=g) / i**0.5
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g).softmax(-1)
    args = [v.to(device, dtype) for v in (x, gate_up, down)]
    out = moe_swiglu_experts(args[0], idx.to(device), w.to(device), *args[1:])
    ref = moe_swiglu_experts_ref(*(v.double() for v in (x, idx)), w.double(), *(v.double() for v in (gate_up, down)))
    err = ((out.double().cpu() - ref).abs() / (1 + ref.abs())).max().item()
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]  # a few roundings of the dtype
    ok = err <= tol and bool(torch.isfinite(out).all())
    print(json.dumps({"device": device, "dtype": a.dtype, "shape": [t, e, k, h, i], "max_rel_err": err, "ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

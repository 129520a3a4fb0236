#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Micro-benchmarks: every kernel of the bundle against its peers, at LTX-Video's and LLM decoding's real shapes.

For each kernel and shape: a correctness check against a float64 reference first (any failure of
this bundle's kernel makes the script exit 1), then timings of every provider on the same inputs in
the same process: this bundle's Triton kernel ("triton"), PyTorch eager as the model writes it
("eager"), torch.nn.functional.rms_norm where it applies ("F.rms_norm"), torch.compile of the eager
code ("compile") and Liger-Kernel when it is installed ("liger").

Timing: triton.testing.do_bench (CUDA/HIP events, L2 flushed before every call, median with 20th and
80th percentiles), repeated in --rounds interleaved rounds (median of the rounds' medians, spread
reported); plus CUDA-graph replay timing (do_bench_cudagraph) for every shape: it removes host launch time,
which otherwise dominates do_bench for small ops (no L2 flush between replays: inputs smaller than the L2 may
stay cached). Every case is also timed cold (cold_graph_ms): CUDA graphs cycling through copies of the
inputs that span 1 GiB, so that no call finds its inputs in a cache (sizes too small for that get none;
the skinny GEMM cycles through copies of its weight in both timings instead).
Bandwidth: bytes each kernel must move (every input read once, every output written once, counted
explicitly per kernel) over the median time, and that as a percentage of the device's copy
bandwidth measured in the same run (a device-to-device copy of 512 MiB, read + write bytes). For this
bundle's kernels also against an elementwise kernel that moves the kernel's own byte count, timed the
same way in the same rounds (pct_same_size_copy, pct_same_size_copy_graph): whether a few tens of MB
reach the large-copy bandwidth at all. Cases whose traffic is several equal-size streams (the gated
residual + norm cases: x and y read, h and the output(s) written) are also set against an
elementwise Triton kernel with the same streams and bytes (same_pattern, pct_same_pattern_graph,
pct_same_pattern_cold_graph): the bound of that access pattern at that size.

JSON on stdout (or --output-json), a table on stderr, a PNG chart with --png when matplotlib is
installed. Works unchanged on ROCm (the device's gfx arch is recorded instead of sm_XY).

Suites (--suite): "ltx" (default: the LTX-Video transformer's norms, gated residual, RoPE and activations
at B=2 and --shapes tokens), "mmdit" (SD3.5-medium and FLUX.1-dev at 1024x1024: LayerNorm + modulation,
gated residual + LayerNorm + modulation, per-head q/k RMSNorm (+ FLUX's RoPE)), "decode" (LLM decoder-layer fusions: fused residual add + RMSNorm and SwiGLU, with and
without FP8 output, at --rows tokens in flight and --widths hidden sizes; the skinny GEMM at --gemm-rows
on Llama-3 8B/70B projection shapes, bf16 and FP8, with the weight bandwidth), or "all".

    python scripts/benchmark_kernels.py --output-json examples/benchmark_kernels_h200.json --png examples/benchmark_kernels_h200.png
    python scripts/benchmark_kernels.py --suite decode --rows 1,32 --widths 4096 --kernel swiglu
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

LTX_SHAPES = {"1320": (2, 1320), "6144": (2, 6144)}  # (batch with CFG, tokens): 25f 480x704, 121f 512x768
HIDDEN = 2048
FF = 8192
# LLM decoding: rows = tokens in flight (1 = one sequence decoding, up to a few thousand for a prefill
# chunk), widths = hidden size (Llama-3 8B 4096, 70B 8192, 405B 16384; for SwiGLU the output width H)
DECODE_ROWS = (1, 32, 1024, 4096)
DECODE_WIDTHS = (4096, 8192, 16384)
DEVICE = "cuda"  # where the cases build their inputs
# Skinny GEMMs of LLM decoding: (N, K) of the projections of Llama-3 8B and 70B (q/k/v and gate/up fused,
# as serving engines store them), at --gemm-rows rows (1 = one sequence decoding, 32 = a decode batch).
GEMM_SHAPES = {
    "8B_qkv": (6144, 4096),
    "8B_o": (4096, 4096),
    "8B_gate_up": (28672, 4096),
    "8B_down": (4096, 14336),
    "70B_qkv": (10240, 8192),
    "70B_o": (8192, 8192),
    "70B_gate_up": (57344, 8192),
    "70B_down": (8192, 28672),
}
GEMM_ROWS = (1, 8, 16, 32)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------
def device_info():
    props = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "unknown").split(":")[0]
    else:
        arch = f"sm_{props.major}{props.minor}"
    import triton

    info = {
        "gpu": torch.cuda.get_device_name(0),
        "arch": arch,
        "backend": "rocm" if torch.version.hip else "cuda",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        # as the runtime reports it (on AMD: the L2, not the Infinity Cache behind it)
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
    }
    for mod in ("diffusers", "liger_kernel"):
        try:
            info[mod] = __import__(mod).__version__ if mod != "liger_kernel" else _liger_version()
        except Exception:
            info[mod] = None
    return info


def _liger_version():
    from importlib.metadata import version

    return version("liger-kernel")


def measure_copy_bandwidth():
    from triton.testing import do_bench

    n = 512 * 1024 * 1024 // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), warmup=50, rep=200, return_mode="median")
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def same_size_copy(nbytes: int, cold: bool = False):
    """An elementwise kernel moving nbytes in all (nbytes / 2 read, nbytes / 2 written: torch.neg into
    a preallocated bf16 output), to be timed like the kernels, in the same rounds: the copy-like
    reference at a kernel's own size, where launch ramp, the last wave and L2 residency between graph
    replays may weigh on a copy too (a launched kernel, unlike the 512 MiB copy_, which is a memcpy).
    cold: cycle through input/output pairs spanning COLD_SPAN, like the cases' cold providers."""
    n = max(1, nbytes // 4)  # bf16 elements per side
    pairs = [
        (torch.randn(n, device="cuda", dtype=torch.bfloat16), torch.empty(n, device="cuda", dtype=torch.bfloat16))
        for _ in range(max(2, _copies_to_span(nbytes)) if cold else 1)
    ]
    if not cold:
        x, y = pairs[0]
        return lambda: torch.neg(x, out=y)
    return _cycling(lambda x, y: torch.neg(x, out=y), pairs)


_PATTERN_KERNEL = []


def _streams_kernel():
    """A Triton kernel reading N_IN and writing N_OUT equal-size bf16 streams elementwise (built on first
    use, so the module imports without Triton)."""
    if _PATTERN_KERNEL:
        return _PATTERN_KERNEL[0]
    import triton
    import triton.language as tl

    @triton.jit
    def _streams(X0, X1, Y0, Y1, Y2, n, N_IN: tl.constexpr, N_OUT: tl.constexpr, BLOCK: tl.constexpr):
        off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = off < n
        a = tl.load(X0 + off, mask=m).to(tl.float32)
        if N_IN > 1:
            a += tl.load(X1 + off, mask=m).to(tl.float32)
        tl.store(Y0 + off, a.to(Y0.dtype.element_ty), mask=m)
        if N_OUT > 1:
            tl.store(Y1 + off, (-a).to(Y1.dtype.element_ty), mask=m)
        if N_OUT > 2:
            tl.store(Y2 + off, (a * 0.5).to(Y2.dtype.element_ty), mask=m)

    _PATTERN_KERNEL.append(_streams)
    return _streams


def same_pattern(nbytes: int, n_in: int, n_out: int, cold: bool = False):
    """An elementwise Triton kernel with a case's access pattern: n_in (1-2) bf16 inputs read and n_out
    (1-3) bf16 outputs written, nbytes in all split equally among the streams, timed like the kernels in
    the same rounds. It is the bound for a kernel whose traffic is those streams: what the memory system
    gives that pattern at that size, with no reduction, broadcast operand or other work in the way. 2048
    elements per program, 4 warps: on an H200 the 2-in / 2-out form at 96 MiB (SD3's and FLUX's
    gated-residual size) took 2.5-3.0 % less time than with 4096 elements and 8 warps, over three runs.
    cold: cycle through stream sets spanning COLD_SPAN, like the cases' cold providers."""
    import triton

    if not (1 <= n_in <= 2 and 1 <= n_out <= 3):
        raise ValueError(f"same_pattern supports 1-2 inputs and 1-3 outputs, got {n_in}, {n_out}")
    kernel = _streams_kernel()
    n = max(1, nbytes // (2 * (n_in + n_out)))  # bf16 elements per stream
    block = 2048

    def make():
        ins = [torch.randn(n, device=DEVICE, dtype=torch.bfloat16) for _ in range(n_in)]
        outs = [torch.empty(n, device=DEVICE, dtype=torch.bfloat16) for _ in range(n_out)]
        ins += ins[:1] * (2 - n_in)  # unused pointer arguments (the constexpr counts drop them)
        outs += outs[:1] * (3 - n_out)
        return (*ins, *outs)

    grid = (triton.cdiv(n, block),)

    def launch(x0, x1, y0, y1, y2):
        kernel[grid](x0, x1, y0, y1, y2, n, N_IN=n_in, N_OUT=n_out, BLOCK=block, num_warps=4)

    sets = [make() for _ in range(max(2, _copies_to_span(nbytes)) if cold else 1)]
    call = (lambda: launch(*sets[0])) if not cold else _cycling(launch, sets)
    call.streams = sets  # (inputs..., outputs...) of each set, for the tests
    return call


# ---------------------------------------------------------------------------------------------
# Cases: each builds inputs, its float64 reference and its providers
# ---------------------------------------------------------------------------------------------
def _nbytes(*ts):
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _rand(shape, dtype, scale=1.0, offset=0.0):
    return (torch.randn(shape, device=DEVICE, dtype=torch.float32) * scale + offset).to(dtype)


def _liger():
    try:
        import liger_kernel.ops as lo  # noqa: F401

        return lo
    except Exception:
        return None


def case_rmsnorm(B, S, dtype, weighted):
    import rmsnorm

    x = _rand((B, S, HIDDEN), dtype, 2.0)
    w = _rand((HIDDEN,), dtype, 0.1, 1.0) if weighted else None
    eps = 1e-5 if weighted else 1e-6

    def eager(x):  # as diffusers' RMSNorm.forward writes it
        var = x.float().pow(2).mean(-1, keepdim=True)
        h = x * torch.rsqrt(var + eps)
        if w is not None:
            return h.to(w.dtype) * w
        return h.to(x.dtype)

    fns = {
        "triton": lambda x: rmsnorm.rms_norm(x, w, eps),
        "eager": eager,
        "F.rms_norm": lambda x: torch.nn.functional.rms_norm(x, (HIDDEN,), w, eps),
        "compile": torch.compile(eager, dynamic=False),
    }
    lo = _liger()
    if lo is not None:
        fns["liger"] = lambda x: lo.LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False)
    ref = rmsnorm.rms_norm_ref(x.double(), None if w is None else w.double(), eps)
    return _case(fns, (x,), ref, _nbytes(x, x, w))


def case_adaln(B, S, dtype):
    import rmsnorm

    x = _rand((B, S, HIDDEN), dtype, 2.0)
    scale = _rand((B, 1, HIDDEN), dtype, 0.3)
    shift = _rand((B, 1, HIDDEN), dtype, 0.3)
    eps = 1e-6

    def eager(x):  # LTX block: norm1(h) * (1 + scale_msa) + shift_msa
        var = x.float().pow(2).mean(-1, keepdim=True)
        n = (x * torch.rsqrt(var + eps)).to(x.dtype)
        return n * (1 + scale) + shift

    fns = {
        "triton": lambda x: rmsnorm.rms_norm_modulate(x, scale, shift, None, eps),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    lo = _liger()
    if lo is not None and hasattr(lo, "LigerModulatedRMSNormFunction"):
        fns["liger"] = lambda x: lo.LigerModulatedRMSNormFunction.apply(x, None, scale, shift, eps, 0.0, "llama", False)
    ref = rmsnorm.rms_norm_modulate_ref(x.double(), scale.double(), shift.double(), None, eps)
    return _case(fns, (x,), ref, _nbytes(x, x, scale, shift))


def _residual_adaln_case(h, y, gate, scale, shift, eps, h_ref, moved):
    """h + y (* gate unless None), then rms_norm(h) * (1 + scale) + shift of the new h: the fused kernel, PyTorch
    eager as the LTX block writes it and torch.compile of that. h_ref: the new h in the inputs' dtype."""
    import rmsnorm

    def eager(h, y):
        hn = h + y if gate is None else h + y * gate
        var = hn.float().pow(2).mean(-1, keepdim=True)
        n = (hn * torch.rsqrt(var + eps)).to(hn.dtype)
        return hn, n * (1 + scale) + shift

    fns = {
        "triton": lambda h, y: rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, scale, shift, None, eps),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    ref = (h_ref.double(), rmsnorm.rms_norm_modulate_ref(h_ref.double(), scale.double(), shift.double(), None, eps))
    return dict(_case(fns, (h, y), ref, moved), pattern=(2, 2))


def case_residual_adaln(B, S, dtype):
    """LTX block: h = h + attn2; norm2(h) * (1 + scale_mlp) + shift_mlp."""
    h = _rand((B, S, HIDDEN), dtype, 2.0)
    y = _rand((B, S, HIDDEN), dtype)
    scale = _rand((B, 1, HIDDEN), dtype, 0.3)
    shift = _rand((B, 1, HIDDEN), dtype, 0.3)
    h_ref = (h.double() + y.double()).to(dtype)
    return _residual_adaln_case(h, y, None, scale, shift, 1e-6, h_ref, _nbytes(h, y, h, h, scale, shift))


def case_gated_residual_adaln(B, S, dtype):
    """A block's last gated residual with the next block's norm1 + modulation (the injection's cross-block
    fusion): h + ff * gate_mlp, then rms_norm(h) * (1 + scale_msa) + shift_msa of the new h."""
    import rmsnorm

    h = _rand((B, S, HIDDEN), dtype, 2.0)
    y = _rand((B, S, HIDDEN), dtype)
    gate = _rand((B, 1, HIDDEN), dtype, 0.5)
    scale = _rand((B, 1, HIDDEN), dtype, 0.3)
    shift = _rand((B, 1, HIDDEN), dtype, 0.3)
    h_ref = rmsnorm.gated_residual_add_ref(h.double(), y.double(), gate.double()).to(dtype)
    return _residual_adaln_case(h, y, gate, scale, shift, 1e-6, h_ref, _nbytes(h, y, gate, h, h, scale, shift))


def case_gated_residual(B, S, dtype):
    import rmsnorm

    h = _rand((B, S, HIDDEN), dtype, 2.0)
    y = _rand((B, S, HIDDEN), dtype)
    gate = _rand((B, 1, HIDDEN), dtype, 0.5)

    def eager(h, y):  # LTX block as diffusers writes it: h + attn * gate_msa
        return h + y * gate

    fns = {
        "triton": lambda h, y: rmsnorm.gated_residual_add(h, y, gate),
        "eager": eager,
        "torch.addcmul": lambda h, y: torch.addcmul(h, y, gate),
        "compile": torch.compile(eager, dynamic=False),
    }
    ref = rmsnorm.gated_residual_add_ref(h.double(), y.double(), gate.double())
    return dict(_case(fns, (h, y), ref, _nbytes(h, y, gate, h)), pattern=(2, 1))


def _ltx_rope_inputs(B, S, dtype):
    import qk_norm_rope

    # coords as LTXVideoRotaryPosEmbed builds them for a 121-frame 512x768 latent grid (16 x 16 x 24)
    t = torch.arange(S, device="cuda")
    gw, gh = 24, 16
    f, hh, ww = t // (gh * gw), (t // gw) % gh, t % gw
    scale = (8 / 25, 32, 32)
    coords = torch.stack([f * scale[0] / 20, hh * scale[1] / 2048, ww * scale[2] / 2048], -1).float()
    coords = coords[None].expand(B, S, 3).contiguous()
    freqs = qk_norm_rope.ltx_rope_freqs(HIDDEN, device="cuda")
    cos, sin = qk_norm_rope.ltx_cos_sin_from_coords(coords, freqs, HIDDEN)
    return coords, freqs, cos, sin


def _apply_rotary_emb(x, cos, sin):  # diffusers' LTX apply_rotary_emb
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def case_ltx_rope(B, S, dtype):
    import rope

    x = _rand((B, S, HIDDEN), dtype)
    coords, freqs, cos, sin = _ltx_rope_inputs(B, S, dtype)
    eager = lambda x: _apply_rotary_emb(x, cos, sin)  # noqa: E731
    fns = {
        "triton": lambda x: rope.ltx_rope(x, cos, sin),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    if hasattr(rope, "ltx_rope_coords"):
        fns["triton(in-kernel cos/sin)"] = lambda x: rope.ltx_rope_coords(x, coords, freqs)
    ref = rope.ltx_rope_ref(x.double(), cos.double(), sin.double())
    # bytes as the eager op must move them: x in, x out, fp32 cos and sin (the cold timing rotates x only:
    # the tables are shared by every layer of a forward)
    return _case(fns, (x,), ref, _nbytes(x, x, cos, sin))


def case_ltx_qk_norm_rope(B, S, dtype):
    import qk_norm_rope

    q = _rand((B, S, HIDDEN), dtype, 2.0)
    k = _rand((B, S, HIDDEN), dtype, 2.0)
    wq = _rand((HIDDEN,), dtype, 0.1, 1.0)
    wk = _rand((HIDDEN,), dtype, 0.1, 1.0)
    eps = 1e-5
    coords, freqs, cos, sin = _ltx_rope_inputs(B, S, dtype)

    def eager(q, k):  # LTX self-attention: norm_q / norm_k (torch.nn.RMSNorm) then apply_rotary_emb
        qn = torch.nn.functional.rms_norm(q, (HIDDEN,), wq, eps)
        kn = torch.nn.functional.rms_norm(k, (HIDDEN,), wk, eps)
        return _apply_rotary_emb(qn, cos, sin), _apply_rotary_emb(kn, cos, sin)

    fns = {
        "triton(in-kernel cos/sin)": lambda q, k: qk_norm_rope.ltx_qk_rmsnorm_rope_coords(
            q, k, wq, wk, eps, coords, freqs
        ),
        "triton(cos/sin read)": lambda q, k: qk_norm_rope.ltx_qk_rmsnorm_rope(q, k, wq, wk, eps, cos, sin),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    ref = qk_norm_rope.ltx_qk_rmsnorm_rope_ref(
        q.double(), k.double(), wq.double(), wk.double(), eps, cos.double(), sin.double()
    )
    # the bytes the op must move: q, k in and out, weights, per-token coords (cos/sin are derivable);
    # the variant reading cos/sin tables moves more than that (no same-size copy figure for it)
    return dict(_case(fns, (q, k), ref, _nbytes(q, k, q, k, wq, wk, coords)), moves_more=("triton(cos/sin read)",))


def case_gelu(B, S, dtype):
    import activations

    x = _rand((B, S, FF), dtype, 3.0)
    eager = lambda x: torch.nn.functional.gelu(x, approximate="tanh")  # noqa: E731
    fns = {
        "triton": lambda x: activations.gelu(x, approximate="tanh"),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    ref = torch.nn.functional.gelu(x.double(), approximate="tanh")
    return _case(fns, (x,), ref, _nbytes(x, x))


def case_geglu(B, S, dtype):
    import activations

    x = _rand((B, S, 2 * FF), dtype, 3.0)

    def eager(x):  # diffusers GEGLU after its projection
        hidden, gate = x.chunk(2, dim=-1)
        return hidden * torch.nn.functional.gelu(gate, approximate="tanh")

    fns = {
        "triton": lambda x: activations.geglu(x, approximate="tanh"),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    hidden, gate = x.double().chunk(2, dim=-1)
    ref = hidden * torch.nn.functional.gelu(gate, approximate="tanh")
    moved = _nbytes(x, hidden.to(dtype))
    sets = _cold_sets((x,), moved)
    case = _case(fns, (x,), ref, moved, sets=sets)
    lo = _liger()
    if lo is not None and hasattr(lo, "LigerGELUMulFunction"):
        # Liger takes gate and value as two contiguous tensors (its kernel assumes equal row strides)
        _add_split_provider(
            case,
            "liger",
            lambda g, v: lo.LigerGELUMulFunction.apply(g, v),
            [(a[..., FF:].contiguous(), a[..., :FF].contiguous()) for (a,) in sets],
        )
    return case


def case_fp8_quantize(B, S, dtype):
    """Per-token FP8 quantisation of a [B, S, 2048] activation (an attention output before an FP8 to_out):
    the pass an FP8 linear layer adds where no kernel before it writes FP8."""
    import activations

    x = _rand((B, S, HIDDEN), dtype, 2.0)
    fp8_dtype = _fp8_dtype()
    eager = lambda x: _quant_per_token(x, fp8_dtype)  # noqa: E731
    fns = {
        "triton": lambda x: activations.fp8_quantize(x, fp8_dtype=fp8_dtype),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    case = _case(fns, (x,), x.double(), _nbytes(x) + x.numel() + 4 * B * S)  # bf16 in, FP8 + scales out
    case.update(post=lambda out: out[0].double() * out[1].double()[..., None], max_err=FP8_MAX_ERR)
    return case


def case_gelu_fp8(B, S, dtype):
    """GELU-tanh of the feed-forward's [B, S, 8192] up projection with per-token FP8 output (the down
    projection's input), against GELU then a separate quantisation."""
    import activations

    x = _rand((B, S, FF), dtype, 3.0)
    fp8_dtype = _fp8_dtype()
    eager = lambda x: _quant_per_token(torch.nn.functional.gelu(x, approximate="tanh"), fp8_dtype)  # noqa: E731
    fns = {
        "triton": lambda x: activations.gelu(x, "tanh", fp8="per_token", fp8_dtype=fp8_dtype),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    ref = torch.nn.functional.gelu(x.double(), approximate="tanh")
    case = _case(fns, (x,), ref, _nbytes(x) + x.numel() + 4 * B * S)
    case.update(post=lambda out: out[0].double() * out[1].double()[..., None], max_err=FP8_MAX_ERR)
    return case


CASES = {
    "rmsnorm_weighted": lambda B, S, dt: case_rmsnorm(B, S, dt, True),
    "rmsnorm_weightless": lambda B, S, dt: case_rmsnorm(B, S, dt, False),
    "adaln_rmsnorm_modulate": case_adaln,
    "residual_rmsnorm_modulate": case_residual_adaln,
    "ltx_rope": case_ltx_rope,
    "ltx_qk_rmsnorm_rope": case_ltx_qk_norm_rope,
    "gated_residual": case_gated_residual,
    "gated_residual_rmsnorm_modulate": case_gated_residual_adaln,
    "gelu_tanh": case_gelu,
    "geglu_tanh": case_geglu,
    "fp8_quantize_per_token": case_fp8_quantize,
    "gelu_tanh_fp8_per_token": case_gelu_fp8,
}

# ---------------------------------------------------------------------------------------------
# LLM decode cases: (rows, width, dtype) -> providers. FP8 providers return what the next FP8 GEMM takes
# (values and scales); "post" dequantises them for the correctness check (outside the timing).
# ---------------------------------------------------------------------------------------------
# FP8 results: one FP8 step is 2**-3 of the value at most; a rounding that differs by one step is allowed
FP8_MAX_ERR = 0.13


def _fp8_dtype():
    """The FP8 format the bundle's kernels pick for this device (e4m3fnuz on gfx942, e4m3fn elsewhere)."""
    import rmsnorm

    return rmsnorm._fp8_dtype_for(torch.device(DEVICE))


def _quant_per_token(y, fp8_dtype):
    """The unfused per-token dynamic FP8 quantisation: scale = amax / fp8_max per row."""
    fmax = torch.finfo(fp8_dtype).max
    s = (y.float().abs().amax(-1, keepdim=True) / fmax).clamp_min(1e-12)
    return (y.float() / s).clamp(-fmax, fmax).to(fp8_dtype), s.squeeze(-1)


def _quant_per_tensor(y, scale, fp8_dtype):
    fmax = torch.finfo(fp8_dtype).max
    return (y.float() / scale).clamp(-fmax, fmax).to(fp8_dtype)


def _with_attr(module, name, value, fn):
    """fn with module.<name> replaced by value for the duration of each call (restored after it). Launch plans
    (kernel_runtime) are keyed by call signature, not by module settings: this variant keeps its own."""
    runtime, store = sys.modules.get("kernel_runtime"), {}

    def run(*args):
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            with runtime.own_plans(module, store) if runtime else contextlib.nullcontext():
                return fn(*args)
        finally:
            setattr(module, name, saved)

    run.module_setting = name  # benchmark_before_after.py leaves these variants out
    return run


def _integer_fp8(module, fn):
    """fn with the module's FP8 output forced to the integer encoder (its `_native_fp8` answering False):
    the side-by-side that shows what the native FP8 cast is worth on this GPU."""
    return _with_attr(module, "_native_fp8", lambda device, fp8_dtype: False, fn)


def _no_evict_hint(module, fn):
    """fn with the fused add + RMSNorm's L2 eviction hint switched off (rmsnorm._input_evict answering ""):
    what the hint is worth, timed side by side."""
    return _with_attr(module, "_input_evict", lambda *a: "", fn)


# Cold timing: in a model the inputs of these ops come from other kernels and rarely sit in a cache (x
# may, right after the GEMM that wrote it). CUDA-graph replays of one call on the same tensors let inputs
# smaller than the last-level cache stay there between replays. The cold timing cycles through copies of
# the inputs (fresh random values) spanning COLD_SPAN bytes, so every call reads from DRAM: 1 GiB, four
# times the largest last-level cache of the targets (MI300X's and MI355X's 256 MiB Infinity Cache; the
# H200's L2 is recorded in the JSON as l2_cache_bytes). Where that would take more than COLD_MAX_SETS
# copies (calls moving under 16 MiB: the launch-bound sizes, where the question does not arise), no cold timing
# is taken. The span used is recorded as cold_span_bytes.
COLD_SPAN = 1 << 30
COLD_MAX_SETS = 64


def _copies_to_span(nbytes: int) -> int:
    """How many buffers of nbytes it takes to span COLD_SPAN."""
    return -(-COLD_SPAN // max(nbytes, 1))


def _cold_sets(inputs, moved):
    """[inputs] followed by copies (fresh values of the same distribution) so that the sets span COLD_SPAN."""
    k = _copies_to_span(moved)
    if k > COLD_MAX_SETS:
        return [inputs]
    gen = [
        tuple((torch.randn(t.shape, device=t.device) * t.float().std()).to(t.dtype) for t in inputs)
        for _ in range(max(k, 2) - 1)
    ]
    return [inputs] + gen


def _cycling(fn, sets):
    state = [0]

    def call():
        state[0] = (state[0] + 1) % len(sets)
        return fn(*sets[state[0]])

    return call


def _case(fns, inputs, ref, moved, sets=None):
    """A case: {provider: fn(*inputs)} as providers (timed on `inputs`) and, where the sizes allow it, as
    cold_providers cycling through copies of the inputs (sets[0] is `inputs`); ref and bytes moved."""
    sets = sets if sets is not None else _cold_sets(inputs, moved)
    providers = {p: (lambda f=f: f(*sets[0])) for p, f in fns.items()}
    cold = {p: _cycling(f, sets) for p, f in fns.items()} if len(sets) > 1 else None
    return dict(providers=providers, cold_providers=cold, ref=ref, bytes=moved)


def _add_split_provider(case, name, fn, split_sets):
    """A provider taking its own form of each input set (e.g. Liger's two contiguous halves of [gate | up]),
    split_sets[i] prepared from the case's i-th set, outside the timing."""
    case["providers"][name] = lambda: fn(*split_sets[0])
    if case["cold_providers"] is not None:
        case["cold_providers"][name] = _cycling(fn, split_sets)


def case_fused_add_rmsnorm(M, H, dtype, fp8=None):
    import rmsnorm

    x = _rand((M, H), dtype, 1.0)
    res = _rand((M, H), dtype, 2.0)
    w = _rand((H,), dtype, 0.1, 1.0)
    eps = 1e-5
    fp8_dtype = _fp8_dtype()
    y_ref, r_ref = rmsnorm.fused_add_rms_norm_ref(x.double(), res.double(), w.double(), eps, dtype=dtype)
    # a static scale as a calibration would set it: the output's maximum maps onto the FP8 maximum
    scale = (y_ref.abs().max() / torch.finfo(fp8_dtype).max).float().reshape(1)

    def norm(x, res):  # a Llama decoder layer: residual add, then LlamaRMSNorm
        r = x + res
        hf = r.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return w * hf.to(dtype), r

    if fp8 is None:
        eager = norm
    elif fp8 == "per_token":

        def eager(x, res):
            y, r = norm(x, res)
            q, s = _quant_per_token(y, fp8_dtype)
            return q, r, s
    else:

        def eager(x, res):
            y, r = norm(x, res)
            return _quant_per_tensor(y, scale, fp8_dtype), r

    kw = {} if fp8 is None else dict(fp8=fp8, fp8_scale=scale if fp8 == "per_tensor" else None)
    ours = lambda x, res: rmsnorm.fused_add_rms_norm(x, res, w, eps, **kw)  # noqa: E731
    fns = {
        "triton": ours,
        "triton(no evict hint)": _no_evict_hint(rmsnorm, ours),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    if fp8 is not None and rmsnorm._native_fp8(x.device, fp8_dtype):
        fns["triton(integer FP8)"] = _integer_fp8(rmsnorm, ours)
    lo = _liger()
    if fp8 is None and lo is not None and hasattr(lo, "LigerFusedAddRMSNormFunction"):
        fns["liger"] = lambda x, res: lo.LigerFusedAddRMSNormFunction.apply(x, res, w, eps, 0.0, "llama", False)
    # bytes the op must move: x, residual and the weight in; the new residual and y (and scales) out
    moved = _nbytes(x, res, w, x) + M * H * (x.element_size() if fp8 is None else 1)
    if fp8 == "per_token":
        moved += 4 * M
    case = _case(fns, (x, res), (y_ref.double(), r_ref.double()), moved)
    if fp8 == "per_token":
        case.update(post=lambda out: (out[0].double() * out[2].double()[:, None], out[1]), max_err=FP8_MAX_ERR)
    elif fp8 == "per_tensor":
        case.update(post=lambda out: (out[0].double() * scale.double(), out[1]), max_err=FP8_MAX_ERR)
    return case


def case_swiglu(M, H, dtype, fp8=None):
    import activations

    x = _rand((M, 2 * H), dtype, 2.0)  # a fused gate/up projection: [gate | up]
    fp8_dtype = _fp8_dtype()
    ref = activations.swiglu_ref(x.double())
    scale = (ref.abs().max() / torch.finfo(fp8_dtype).max).float().reshape(1)  # calibrated static scale

    def act(x):
        return torch.nn.functional.silu(x[..., :H]) * x[..., H:]

    if fp8 is None:
        eager = act
    elif fp8 == "per_token":
        eager = lambda x: _quant_per_token(act(x), fp8_dtype)  # noqa: E731
    else:
        eager = lambda x: _quant_per_tensor(act(x), scale, fp8_dtype)  # noqa: E731
    kw = {} if fp8 is None else dict(fp8=fp8, fp8_scale=scale if fp8 == "per_tensor" else None)
    ours = lambda x: activations.swiglu(x, **kw)  # noqa: E731
    fns = {"triton": ours, "eager": eager, "compile": torch.compile(eager, dynamic=False)}
    if fp8 is not None and activations._native_fp8(x.device, fp8_dtype):
        fns["triton(integer FP8)"] = _integer_fp8(activations, ours)
    moved = _nbytes(x) + M * H * (x.element_size() if fp8 is None else 1)
    if fp8 == "per_token":
        moved += 4 * M
    sets = _cold_sets((x,), moved)
    case = _case(fns, (x,), ref, moved, sets=sets)
    lo = _liger()
    if fp8 is None and lo is not None and hasattr(lo, "LigerSiLUMulFunction"):
        # Liger takes gate and up as two contiguous tensors (it would copy strided views on every call)
        _add_split_provider(
            case,
            "liger",
            lambda g, u: lo.LigerSiLUMulFunction.apply(g, u),
            [(a[..., :H].contiguous(), a[..., H:].contiguous()) for (a,) in sets],
        )
    if fp8 == "per_token":
        case.update(post=lambda out: out[0].double() * out[1].double()[:, None], max_err=FP8_MAX_ERR)
    elif fp8 == "per_tensor":
        case.update(post=lambda out: out.double() * scale.double(), max_err=FP8_MAX_ERR)
    return case


def case_skinny_gemm(M, N, K, dtype, fp8=False):
    """y = x @ W^T. bf16: against torch.matmul (F.linear). FP8 (x and W FP8, per-tensor scales, bf16
    out): against torch._scaled_mm. "triton" is skinny_gemm as dispatched (it hands M above the
    measured per-arch bound back to torch); "triton_kernel" always runs the kernel (the measurement
    behind that bound)."""
    import skinny_gemm as sg

    x = _rand((M, K), dtype, 1.0)
    w = _rand((N, K), dtype, K**-0.5)
    ws = xs = None
    if fp8:
        f8 = _fp8_dtype()
        fmax = torch.finfo(f8).max
        ws = (w.float().abs().max() / fmax).reshape(1)
        xs = (x.float().abs().max() / fmax).reshape(1)
        w = (w.float() / ws).to(f8)
        x = (x.float() / xs).to(f8)
    ref = sg.skinny_gemm_ref(x, w, weight_scale=ws, x_scale=xs)

    # In a model every layer reads other weights, so they come from DRAM, not from a cache. The CUDA-graph
    # timing replays calls back to back without flushing it: give each call another copy of W (identical
    # values), enough copies to span COLD_SPAN, so every read misses.
    n_copies = min(COLD_MAX_SETS, _copies_to_span(_nbytes(w)))
    copies = [w] + [w.clone() for _ in range(n_copies - 1)]

    def cycling(fn):
        state = [0]

        def call():
            state[0] = (state[0] + 1) % n_copies
            return fn(copies[state[0]])

        return call

    def kernel_only(W):
        saved = dict(sg._KERNEL_MAX_M)
        sg._KERNEL_MAX_M.clear()
        try:
            return sg.skinny_gemm(x, W, weight_scale=ws, x_scale=xs)
        finally:
            sg._KERNEL_MAX_M.update(saved)

    providers = {
        "triton": cycling(lambda W: sg.skinny_gemm(x, W, weight_scale=ws, x_scale=xs)),
        "triton_kernel": cycling(kernel_only),
    }
    if fp8:
        if sg._torch_linear(x, w, None, ws, xs, torch.bfloat16) is not None:
            providers["torch._scaled_mm"] = cycling(
                lambda W: torch._scaled_mm(
                    x, W.t(), scale_a=xs.reshape(()), scale_b=ws.reshape(()), out_dtype=torch.bfloat16
                )
            )
    else:
        providers["torch.matmul"] = cycling(lambda W: torch.matmul(x, W.t()))
    moved = _nbytes(x, w) + M * N * 2
    return dict(providers=providers, ref=ref, bytes=moved, weight_bytes=_nbytes(w))


DECODE_CASES = {
    "fused_add_rmsnorm": lambda M, H, dt: case_fused_add_rmsnorm(M, H, dt),
    "fused_add_rmsnorm_fp8_per_token": lambda M, H, dt: case_fused_add_rmsnorm(M, H, dt, "per_token"),
    "fused_add_rmsnorm_fp8_per_tensor": lambda M, H, dt: case_fused_add_rmsnorm(M, H, dt, "per_tensor"),
    "swiglu": lambda M, H, dt: case_swiglu(M, H, dt),
    "swiglu_fp8_per_token": lambda M, H, dt: case_swiglu(M, H, dt, "per_token"),
    "swiglu_fp8_per_tensor": lambda M, H, dt: case_swiglu(M, H, dt, "per_tensor"),
}

GEMM_CASES = {
    "skinny_gemm_bf16": lambda M, N, K, dt: case_skinny_gemm(M, N, K, dt),
    "skinny_gemm_fp8": lambda M, N, K, dt: case_skinny_gemm(M, N, K, dt, fp8=True),
}

# ---------------------------------------------------------------------------------------------
# SD3 / FLUX cases at 1024x1024: SD3.5-medium (B=2 with guidance, 4096 image tokens, width 1536, 24
# heads x 64, 333 text tokens) and FLUX.1-dev (B=1, 4096 image + 512 text tokens, width 3072, 24 heads x 128)
# ---------------------------------------------------------------------------------------------
MMDIT_SHAPES = {"sd3": dict(B=2, S=4096, T=333, D=1536, H=24), "flux": dict(B=1, S=4096, T=512, D=3072, H=24)}


def case_layernorm_modulate(model, dtype):
    import layernorm

    c = MMDIT_SHAPES[model]
    B, S, D = c["B"], c["S"], c["D"]
    x = _rand((B, S, D), dtype, 2.0, 0.3)
    emb = _rand((B, 2 * D), dtype, 0.3)
    shift, scale = emb.chunk(2, dim=1)  # [B, D] views, as AdaLayerNormZero's chunk gives them
    eps = 1e-6

    def eager(x):  # AdaLayerNormZero: LayerNorm without affine, then * (1 + scale[:, None]) + shift[:, None]
        return torch.nn.functional.layer_norm(x, (D,), eps=eps) * (1 + scale[:, None]) + shift[:, None]

    fns = {
        "triton": lambda x: layernorm.layer_norm_modulate(x, scale, shift, eps),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    ref = layernorm.layer_norm_modulate_ref(x.double(), scale.double(), shift.double(), eps)
    return _case(fns, (x,), ref, _nbytes(x, x, scale, shift))


def case_residual_layernorm_modulate(model, dtype):
    import layernorm

    c = MMDIT_SHAPES[model]
    B, S, D = c["B"], c["S"], c["D"]
    h = _rand((B, S, D), dtype, 2.0)
    y = _rand((B, S, D), dtype)
    emb = _rand((B, 3 * D), dtype, 0.3)
    gate, shift, scale = emb.chunk(3, dim=1)
    eps = 1e-6

    def eager(h, y):  # JointTransformerBlock / FluxTransformerBlock: h + gate * attn, then norm2 + MLP modulation
        hn = h + gate[:, None] * y
        return hn, torch.nn.functional.layer_norm(hn, (D,), eps=eps) * (1 + scale[:, None]) + shift[:, None]

    fns = {
        "triton": lambda h, y: layernorm.gated_residual_layer_norm_modulate(h, y, gate, scale, shift, eps),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    h_ref, _ = layernorm.gated_residual_layer_norm_modulate_ref(
        h.double(), y.double(), gate.double(), scale.double(), shift.double(), eps
    )
    out_ref = layernorm.layer_norm_modulate_ref(h_ref.to(dtype).double(), scale.double(), shift.double(), eps)
    return dict(_case(fns, (h, y), (h_ref, out_ref), _nbytes(h, y, gate, scale, shift, h, h)), pattern=(2, 2))


def case_residual_layernorm_modulate_dual(model, dtype):
    """A block's last gated residual with the next block's SD35AdaLayerNormZeroX (SD3.5: one LayerNorm, two
    modulations): h + gate * ff, then both modulated norms of the new h (mmdit_injection's cross-block fusion)."""
    import layernorm

    c = MMDIT_SHAPES[model]
    B, S, D = c["B"], c["S"], c["D"]
    h = _rand((B, S, D), dtype, 2.0)
    y = _rand((B, S, D), dtype)
    emb = _rand((B, 5 * D), dtype, 0.3)
    gate, scale, shift, scale2, shift2 = emb.chunk(5, dim=1)
    eps = 1e-6

    def eager(h, y):
        hn = h + gate[:, None] * y
        n = torch.nn.functional.layer_norm(hn, (D,), eps=eps)
        return hn, n * (1 + scale[:, None]) + shift[:, None], n * (1 + scale2[:, None]) + shift2[:, None]

    fns = {
        "triton": lambda h, y: layernorm.gated_residual_layer_norm_modulate_dual(
            h, y, gate, scale, shift, scale2, shift2, eps
        ),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    d = [t.double() for t in (h, y, gate, scale, shift, scale2, shift2)]
    h_ref, _, _ = layernorm.gated_residual_layer_norm_modulate_dual_ref(*d, eps)
    o1, o2 = layernorm.layer_norm_modulate_dual_ref(h_ref.to(dtype).double(), *d[3:], eps)
    return dict(
        _case(fns, (h, y), (h_ref, o1, o2), _nbytes(h, y, gate, scale, shift, scale2, shift2, h, h, h)), pattern=(2, 3)
    )


def case_head_qk_norm(model, dtype):
    """Per-head q/k RMSNorm with a weight; FLUX also applies its interleaved RoPE (cos/sin [S, 128] fp32)."""
    import head_norm_rope

    c = MMDIT_SHAPES[model]
    B, S, H = c["B"], c["S"] + c["T"], c["H"]
    Dh = c["D"] // H
    q = _rand((B, S, H, Dh), dtype, 2.0)
    k = _rand((B, S, H, Dh), dtype, 2.0)
    wq = _rand((Dh,), dtype, 0.1, 1.0)
    wk = _rand((Dh,), dtype, 0.1, 1.0)
    eps = 1e-6
    rope = model == "flux"
    cos = sin = None
    if rope:
        ang = torch.rand(S, Dh // 2, device=DEVICE) * 100
        cos = ang.cos().repeat_interleave(2, -1)
        sin = ang.sin().repeat_interleave(2, -1)

    def rot(x):  # diffusers apply_rotary_emb(sequence_dim=1), interleaved pairs, fp32 math
        xr, xi = x.unflatten(-1, (-1, 2)).unbind(-1)
        xrot = torch.stack([-xi, xr], dim=-1).flatten(-2)
        return (x.float() * cos[None, :, None] + xrot.float() * sin[None, :, None]).to(x.dtype)

    # FLUX's norm_q / norm_k are torch.nn.RMSNorm (F.rms_norm); SD3's are diffusers RMSNorm, which rounds
    # before its half-precision weight: the same bytes and nearly the same math, timed with F.rms_norm here.
    def eager(q, k):  # the processors' norm_q / norm_k on [B, S, H, Dh] (FLUX: then RoPE)
        qn = torch.nn.functional.rms_norm(q, (Dh,), wq, eps)
        kn = torch.nn.functional.rms_norm(k, (Dh,), wk, eps)
        return (rot(qn), rot(kn)) if rope else (qn, kn)

    fns = {
        "triton": lambda q, k: head_norm_rope.head_rms_norm_rope(q, k, wq, wk, eps, cos, sin),
        "eager": eager,
        "compile": torch.compile(eager, dynamic=False),
    }
    ref = head_norm_rope.head_rms_norm_rope_ref(
        q.double(),
        k.double(),
        wq.double(),
        wk.double(),
        eps,
        None if cos is None else cos.double(),
        None if sin is None else sin.double(),
    )
    return _case(fns, (q, k), ref, _nbytes(q, k, q, k, wq, wk, cos, sin))


MMDIT_CASES = {
    "layernorm_modulate": case_layernorm_modulate,
    "residual_layernorm_modulate": case_residual_layernorm_modulate,
    "residual_layernorm_modulate_dual": case_residual_layernorm_modulate_dual,
    "head_qk_rmsnorm_rope": case_head_qk_norm,
}

# output tolerance against the float64 reference, max |out - ref| / (1 + |ref|)
MAX_ERR = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


def max_err(out, ref):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    worst = 0.0
    for o, r in zip(outs, refs):
        o = o.double()
        e = ((o - r).abs() / (1 + r.abs())).max().item()
        if not math.isfinite(e):
            return float("inf")
        worst = max(worst, e)
    return worst


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def time_provider(fn, graph, cold_fn=None):
    """do_bench (L2 flushed) and, with graph, CUDA-graph replay timing; with cold_fn (the same op cycling
    through input copies that span COLD_SPAN) also its CUDA-graph timing, cold_graph_ms."""
    from triton.testing import do_bench, do_bench_cudagraph

    q = do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
    rec = {"ms": q[0], "ms_p20": q[1], "ms_p80": q[2]}
    if graph:
        for key, f in (("graph_ms", fn), ("cold_graph_ms", cold_fn)):
            if f is None:
                continue
            try:
                rec[key] = do_bench_cudagraph(f, rep=50, return_mode="median")
            except Exception as e:  # some providers (e.g. host syncs) cannot be captured
                rec[key] = None
                rec[key.replace("_ms", "_error")] = f"{type(e).__name__}: {e}"[:200]
    return rec


def work_items(args):
    """(kernel name, builder() -> case, record fields, shape label, use CUDA-graph timing) for the chosen suite."""
    items = []
    flt = args.kernel
    if args.suite in ("ltx", "all"):
        for name in [k for k in CASES if not flt or any(f in k for f in flt)]:
            for s in args.shapes:
                B, S = LTX_SHAPES[s]
                items.append(
                    (
                        name,
                        lambda name=name, B=B, S=S: CASES[name](B, S, args.torch_dtype),
                        {"suite": "ltx", "tokens": S, "batch": B, "width": None},
                        f"B={B} S={S}",
                        True,
                    )
                )
    if args.suite in ("mmdit", "all"):
        for name in [k for k in MMDIT_CASES if not flt or any(f in k for f in flt)]:
            for model in MMDIT_SHAPES:
                c = MMDIT_SHAPES[model]
                items.append(
                    (
                        name,
                        lambda name=name, model=model: MMDIT_CASES[name](model, args.torch_dtype),
                        {"suite": "mmdit", "tokens": c["S"], "batch": c["B"], "width": c["D"], "model": model},
                        f"{model} B={c['B']} S={c['S']}",
                        True,
                    )
                )
    if args.suite in ("decode", "all"):
        for name in [k for k in DECODE_CASES if not flt or any(f in k for f in flt)]:
            for h in args.widths:
                for m in args.rows:
                    items.append(
                        (
                            name,
                            lambda name=name, m=m, h=h: DECODE_CASES[name](m, h, args.torch_dtype),
                            {"suite": "decode", "tokens": m, "batch": 1, "width": h},
                            f"M={m} H={h}",
                            True,
                        )
                    )
        for name in [k for k in GEMM_CASES if not flt or any(f in k for f in flt)]:
            for shape in args.gemm_shapes:
                n, k = GEMM_SHAPES[shape]
                for m in args.gemm_rows:
                    items.append(
                        (
                            name,
                            lambda name=name, m=m, n=n, k=k: GEMM_CASES[name](m, n, k, args.torch_dtype),
                            {"suite": "decode", "tokens": m, "batch": 1, "width": n, "k": k, "gemm": shape},
                            f"{shape} M={m}",
                            True,
                        )
                    )
    return items


def check_case(name, label, case, dtype):
    """Run every provider once: {provider: max error vs the float64 reference}, and this bundle's failures."""
    errs, failures = {}, []
    post = case.get("post", lambda out: out)
    tol = case.get("max_err", MAX_ERR[dtype])
    for prov, fn in case["providers"].items():
        try:
            errs[prov] = max_err(post(fn()), case["ref"])
        except Exception as e:
            errs[prov] = float("nan")
            log(f"  {name} {label} {prov}: failed to run: {type(e).__name__}: {e}")
            if prov.startswith("triton"):
                failures.append(f"{name} {label} {prov} raised {type(e).__name__}")
    for prov, e in errs.items():
        if prov.startswith("triton") and not (e <= tol):
            failures.append(f"{name} {label} {prov}: max error {e:.3g} > {tol}")
    return errs, failures


def run(args):
    dtype = args.torch_dtype
    info = device_info()
    log(f"device: {info['gpu']} ({info['arch']}), torch {info['torch']}, triton {info['triton']}")
    copy_gbs = measure_copy_bandwidth()
    info["copy_bandwidth_GBps"] = copy_gbs
    log(f"copy bandwidth: {copy_gbs:.0f} GB/s")
    records, failures = [], []
    for name, build, fields, label, graph in work_items(args):
        torch.manual_seed(0)
        # Every case compiles its own closure `eager`; one code object per case function, so without a
        # reset Dynamo stops recompiling after config.recompile_limit (8) shapes and silently runs the
        # later shapes eagerly under the "compile" label.
        torch._dynamo.reset()
        try:
            case = build()
        except (ImportError, AttributeError) as e:
            log(f"skip {name}: {e}")
            continue
        # correctness first, every provider (only this bundle's kernels decide the exit code)
        errs, bad = check_case(name, label, case, dtype)
        failures += bad
        timed = _time_case(case, errs, graph, args.rounds, dtype)
        head = {"kernel": name, **fields, "shape": label, "dtype": args.dtype}
        for prov, recs in timed["providers"].items():
            records.append(_record(head, prov, recs, case, errs[prov], copy_gbs, timed))
        del case, timed
        torch.cuda.empty_cache()
        _print_rows(records, name, label)
    info["cold_span_bytes"] = COLD_SPAN
    return {"device": info, "command": " ".join(sys.argv), "records": records, "failures": failures}


def _time_case(case, errs, graph, rounds, dtype) -> dict:
    """Interleaved timing rounds of the providers that ran (each round: every provider, then the references).
    Returns the timings per provider ("providers"), of the same-size copy ("copy", for this bundle's kernels
    whose counted bytes are what they move) and of the same access pattern ("pattern", n_in reads and n_out
    writes, for bf16 cases that declare one: "pattern_shape")."""
    per = {p: [] for p in case["providers"] if math.isfinite(errs.get(p, float("nan")))}
    copy_fn = same_size_copy(case["bytes"]) if "weight_bytes" not in case else None
    cold = case.get("cold_providers") or {}
    copy_cold = same_size_copy(case["bytes"], cold=True) if copy_fn is not None and cold else None
    copy_recs = []
    pattern = case.get("pattern") if dtype == torch.bfloat16 else None
    pat_fn = same_pattern(case["bytes"], *pattern) if pattern else None
    pat_cold = same_pattern(case["bytes"], *pattern, cold=True) if pattern and cold else None
    pat_recs = []
    for _ in range(rounds):
        for prov in per:
            per[prov].append(time_provider(case["providers"][prov], graph, cold.get(prov)))
        if copy_fn is not None:
            copy_recs.append(time_provider(copy_fn, graph, copy_cold))
        if pat_fn is not None:
            pat_recs.append(time_provider(pat_fn, graph, pat_cold))
    return {"providers": per, "copy": copy_recs, "pattern": pat_recs, "pattern_shape": pattern}


def _record(head, prov, recs, case, err, copy_gbs, timed) -> dict:
    """One provider's JSON record: head (kernel, the work item's fields, shape, dtype), its median times
    over the rounds, the bandwidths they mean and, for this bundle's kernels, the time of the same-size copy
    and of the same access pattern relative to theirs."""
    ms = statistics.median(r["ms"] for r in recs)
    gms = [r.get("graph_ms") for r in recs if r.get("graph_ms")]
    rec = {
        **head,
        "provider": prov,
        "bytes": case["bytes"],
        "ms": ms,
        "ms_rounds": [r["ms"] for r in recs],
        "ms_p20": statistics.median(r["ms_p20"] for r in recs),
        "ms_p80": statistics.median(r["ms_p80"] for r in recs),
        "graph_ms": statistics.median(gms) if gms else None,
        "GBps": case["bytes"] / (ms * 1e-3) / 1e9,
        "max_err_vs_fp64": err,
    }
    rec["pct_copy"] = 100 * rec["GBps"] / copy_gbs
    if "weight_bytes" in case:  # skinny GEMM: the weight read is the bound that matters
        rec["weight_GBps"] = case["weight_bytes"] / (ms * 1e-3) / 1e9
        if rec["graph_ms"]:
            rec["weight_GBps_graph"] = case["weight_bytes"] / (rec["graph_ms"] * 1e-3) / 1e9
            rec["weight_pct_copy_graph"] = 100 * rec["weight_GBps_graph"] / copy_gbs
    if rec["graph_ms"]:
        rec["GBps_graph"] = case["bytes"] / (rec["graph_ms"] * 1e-3) / 1e9
        rec["pct_copy_graph"] = 100 * rec["GBps_graph"] / copy_gbs
    cgms = [r["cold_graph_ms"] for r in recs if r.get("cold_graph_ms")]
    if cgms:
        rec["cold_graph_ms"] = statistics.median(cgms)
        rec["GBps_cold_graph"] = case["bytes"] / (rec["cold_graph_ms"] * 1e-3) / 1e9
        rec["pct_copy_cold_graph"] = 100 * rec["GBps_cold_graph"] / copy_gbs
    ours = prov.startswith("triton") and prov not in case.get("moves_more", ())
    if timed["copy"] and ours:
        _add_same_size_copy(rec, timed["copy"])
    if timed["pattern"] and ours:
        _add_same_pattern(rec, timed["pattern"], timed["pattern_shape"])
    return rec


def _add_same_size_copy(rec, copy_recs) -> None:
    """The same-size copy's median times, and their share of the record's (eager, graph, cold graph)."""
    rec["same_size_copy_ms"] = statistics.median(r["ms"] for r in copy_recs)
    rec["pct_same_size_copy"] = 100 * rec["same_size_copy_ms"] / rec["ms"]
    cg = [r["graph_ms"] for r in copy_recs if r.get("graph_ms")]
    if rec["graph_ms"] and cg:
        rec["same_size_copy_graph_ms"] = statistics.median(cg)
        rec["pct_same_size_copy_graph"] = 100 * rec["same_size_copy_graph_ms"] / rec["graph_ms"]
    ccg = [r["cold_graph_ms"] for r in copy_recs if r.get("cold_graph_ms")]
    if rec.get("cold_graph_ms") and ccg:
        rec["same_size_copy_cold_graph_ms"] = statistics.median(ccg)
        rec["pct_same_size_copy_cold_graph"] = 100 * rec["same_size_copy_cold_graph_ms"] / rec["cold_graph_ms"]


def _add_same_pattern(rec, pat_recs, pattern) -> None:
    """The same access pattern's median graph times, and their share of the record's."""
    rec["same_pattern"] = list(pattern)
    for key in ("graph_ms", "cold_graph_ms"):
        t = [r[key] for r in pat_recs if r.get(key)]
        if rec.get(key) and t:
            rec[f"same_pattern_{key}"] = statistics.median(t)
            rec[f"pct_same_pattern_{key[:-3]}"] = 100 * rec[f"same_pattern_{key}"] / rec[key]


def _print_rows(records, name, label):
    rows = [r for r in records if r["kernel"] == name and r["shape"] == label]
    peers = [r for r in rows if not r["provider"].startswith("triton")]
    best_peer = min((r["ms"] for r in peers), default=None)
    best_peer_g = min((r["graph_ms"] for r in peers if r.get("graph_ms")), default=None)
    best_peer_c = min((r["cold_graph_ms"] for r in peers if r.get("cold_graph_ms")), default=None)
    for r in rows:
        ours = r["provider"].startswith("triton")
        sp = f"{best_peer / r['ms']:.2f}x" if best_peer and ours else ""
        spg = f"{best_peer_g / r['graph_ms']:.2f}x" if best_peer_g and ours and r.get("graph_ms") else ""
        g = f"{r['graph_ms'] * 1e3:7.1f}" if r.get("graph_ms") else "      -"
        gp = f"{r['pct_copy_graph']:5.1f}%" if r.get("pct_copy_graph") else "    -"
        ss = f"  same-size copy {r['pct_same_size_copy_graph']:.0f}%" if r.get("pct_same_size_copy_graph") else ""
        if r.get("pct_same_pattern_cold_graph"):
            ss += f"  same pattern {r['pct_same_pattern_cold_graph']:.0f}% cold"
        if r.get("cold_graph_ms"):
            ss += f"  cold {r['cold_graph_ms'] * 1e3:.1f} us {r['pct_copy_cold_graph']:.1f}%"
            if ours and best_peer_c:
                ss += f" ({best_peer_c / r['cold_graph_ms']:.2f}x)"
        log(
            f"{name:32s} {label:14s} {r['provider']:27s} {r['ms'] * 1e3:8.1f} us {r['pct_copy']:5.1f}%  "
            f"graph {g} us {gp}  err {r['max_err_vs_fp64']:.1e}  vs best peer {sp} (graph {spg}){ss}"
        )


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only), or None where matplotlib is not installed (logged: no
    chart). benchmark_e2e.py's chart uses it too."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no chart")
        return None
    return plt


def chart(result, path):
    plt = pyplot()
    if plt is None:
        return
    recs = result["records"]
    shapes = list(dict.fromkeys(r.get("shape") or f"B={r['batch']} S={r['tokens']}" for r in recs))
    provs = list(dict.fromkeys(r["provider"] for r in recs))
    fig, axes = plt.subplots(len(shapes), 1, figsize=(13, 4.2 * len(shapes)), squeeze=False)
    width = 0.8 / max(len(provs), 1)
    for ax, shape in zip(axes[:, 0], shapes):
        at = [x for x in recs if (x.get("shape") or f"B={x['batch']} S={x['tokens']}") == shape]
        kernels = list(dict.fromkeys(r["kernel"] for r in at))
        top = result["device"]["copy_bandwidth_GBps"]
        for i, p in enumerate(provs):
            vals = []
            for k in kernels:
                r = [x for x in at if x["kernel"] == k and x["provider"] == p]
                vals.append((r[0].get("GBps_cold_graph") or r[0].get("GBps_graph") or r[0]["GBps"]) if r else 0)
            ax.bar([j + i * width for j in range(len(kernels))], vals, width, label=p)
            top = max([top] + vals)
        ax.set_ylim(0, 1.3 * top)  # headroom above the bars for the legend
        ax.axhline(result["device"]["copy_bandwidth_GBps"], color="k", ls="--", lw=1, label="copy bandwidth")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kernels))])
        ax.set_xticklabels(kernels, rotation=15, fontsize=8)
        ax.set_ylabel("GB/s (bytes the op must move; CUDA-graph\ntiming, inputs from DRAM where timed cold)")
        ax.set_title(f"{result['device']['gpu']} ({result['device']['arch']}), {shape}, {recs[0]['dtype']}")
    axes[0, 0].legend(fontsize=7, ncol=5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"chart: {path}")


def positive_ints(text, not_ints, not_positive):
    """The comma-separated integers of a command-line value; argparse.ArgumentTypeError(not_ints) if one is not
    an integer, (not_positive) if there are none or one is below 1. Shared by the benchmarks' parsers."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(not_ints)
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(not_positive)
    return vals


def _add_int_list(p, flag, default, doc):
    """An option of comma-separated positive integers; its help ends with the default."""
    p.add_argument(
        flag,
        type=lambda text: positive_ints(
            text,
            f"{flag} must be comma-separated integers, got {text!r}",
            f"{flag} must be positive integers, got {text!r}",
        ),
        default=list(default),
        help=f"{doc}, default {','.join(map(str, default))}",
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--suite",
        choices=["ltx", "mmdit", "decode", "all"],
        default="ltx",
        help="ltx: LTX-Video kernels at --shapes (default); mmdit: SD3.5-medium and FLUX.1-dev kernels "
        "at 1024x1024; decode: LLM decode fusions at --rows x --widths and the skinny GEMM; all: every suite",
    )
    p.add_argument(
        "--kernel",
        action="append",
        default=[],
        help=f"substring filter, repeatable; ltx kernels: {', '.join(CASES)}; "
        f"mmdit kernels: {', '.join(MMDIT_CASES)}; "
        f"decode kernels: {', '.join(DECODE_CASES)}, {', '.join(GEMM_CASES)}",
    )
    p.add_argument(
        "--shapes", default="1320,6144", help="ltx suite: token counts (B=2): 1320 (25f 480x704), 6144 (121f 512x768)"
    )
    _add_int_list(p, "--rows", DECODE_ROWS, "decode suite: rows (tokens in flight)")
    _add_int_list(p, "--widths", DECODE_WIDTHS, "decode suite: hidden sizes (SwiGLU: output width H, input 2H)")
    _add_int_list(p, "--gemm-rows", GEMM_ROWS, "decode suite, skinny GEMM: rows M (1..32)")
    p.add_argument(
        "--gemm-shapes",
        default=",".join(GEMM_SHAPES),
        help=f"decode suite, skinny GEMM: named (N, K) shapes, default all: {', '.join(GEMM_SHAPES)}",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    p.add_argument("--output-json", help="write the JSON here (default: stdout)")
    p.add_argument("--png", help="write a GB/s chart here (needs matplotlib)")
    args = p.parse_args(argv)
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    for s in args.shapes:
        if s not in LTX_SHAPES:
            p.error(f"unknown shape {s}; choose from {', '.join(LTX_SHAPES)}")
    args.gemm_shapes = [s.strip() for s in args.gemm_shapes.split(",") if s.strip()]
    for s in args.gemm_shapes:
        if s not in GEMM_SHAPES:
            p.error(f"unknown GEMM shape {s}; choose from {', '.join(GEMM_SHAPES)}")
    if max(args.gemm_rows) > 32:
        p.error("--gemm-rows: the skinny GEMM takes at most 32 rows")
    args.torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if not work_items(args):
        p.error(f"no kernel of the {args.suite} suite matches {args.kernel}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        log("no GPU (CUDA or ROCm) found: the benchmarks need one")
        return 2
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        log("TRITON_INTERPRET is set: unset it to benchmark")
        return 2
    result = run(args)
    text = json.dumps(result, indent=1)
    if args.output_json:
        Path(args.output_json).write_text(text)
        log(f"json: {args.output_json}")
    else:
        print(text)
    if args.png:
        chart(result, args.png)
    if result["failures"]:
        log("FAILED correctness:\n  " + "\n  ".join(result["failures"]))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

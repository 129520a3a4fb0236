# SPDX-License-Identifier: Apache-2.0
"""Ahead-of-time compile check of every Triton kernel of the bundle for AMD (and NVIDIA) GPUs, on any machine.

For each case of ``CASES`` (a public launcher called on inputs of a real model's shapes) and each target
(gfx942 and gfx950: wave64; gfx1201: wave32; sm90), the launcher is run on CPU tensors while launches are
captured instead of executed, with the leaf module's ``_device_target`` answering the target being checked,
so the launcher picks the block sizes and warps it would pick on that GPU. Each captured launch is then
specialised the way Triton's JIT specialises a real launch on a GPU (types, 16-byte alignment of pointers,
divisibility of integers by 16, buffer-op pointer ranges on AMD) and compiled with ``triton.compile`` for the
target. No GPU, ROCm or CUDA driver is needed.

Reported per kernel launch and target:
  AMD:    VGPRs, AGPRs, SGPRs, VGPR/SGPR spills, scratch bytes, occupancy (waves per SIMD, the compiler's
          register-based figure), wave size, LDS bytes (Triton's LDS is dynamic: read from the kernel's metadata).
  NVIDIA: registers, spill stores/loads, local/stack bytes (cuobjdump / ptxas -v on the real cubin/PTX, if
          those tools exist in the triton wheel), shared memory bytes.
  Both:   the FP8 conversion instructions in the code (``fp8_conversions``; empty for a software encoder).
Fails (exit 1) when a kernel does not compile, spills or uses scratch on an AMD target, or needs more
LDS/shared memory than one workgroup/block may use. NVIDIA spills are reported as warnings.

JSON on stdout (tool versions and one record per launch x target), a table on stderr.

    python scripts/check_amd_compile.py [--targets gfx942,gfx950,gfx1201,sm90] [--kernel NAME]
                                        [--output-json PATH]

The check must run without the Triton interpreter (TRITON_INTERPRET): run as a script it restarts itself
without that variable; ``compile_all()`` refuses to run in a process that has it set.

Adding a kernel file: append lines to ``CASES`` (name -> (leaf module, function calling its public API on
real-size CPU tensors)). Nothing else is needed as long as the launcher calls ``kernel[grid](...)`` and keys
its launch heuristics on the module's ``_device_target(device)``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import triton

_HERE = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------
# name -> (backend, arch, warp size), as triton.backends.compiler.GPUTarget takes them.
TARGETS: Dict[str, Tuple[str, object, int]] = {
    "gfx942": ("hip", "gfx942", 64),  # MI300X / MI325X, CDNA3
    "gfx950": ("hip", "gfx950", 64),  # MI350X / MI355X, CDNA4
    "gfx1201": ("hip", "gfx1201", 32),  # Radeon AI PRO R9700 / RX 9070, RDNA4
    "sm90": ("cuda", 90, 32),  # H100 / H200
}
DEFAULT_TARGETS = tuple(TARGETS)
# Compute units (CUs / SMs) a launcher sizes its grid for, there being no device to ask (MI300X, MI355X, R9700,
# H100 / H200, B200); 64 for another arch.
NOMINAL_CUS = {"gfx942": 304, "gfx950": 256, "gfx1201": 64, 90: 132, 100: 148}

# Largest LDS / shared memory one workgroup (block) may allocate. AMD: 64 KiB per workgroup, except
# gfx950 whose CU has 160 KiB of LDS (ROCm "GPU hardware specifications" table). Hopper: 227 KiB per
# block with the opt-in attribute Triton sets.
LDS_LIMIT_BYTES = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "gfx1201": 64 * 1024, "sm90": 227 * 1024}


# --------------------------------------------------------------------------------------------
# Cases: name -> (leaf module under scripts/, function(module) calling its public launcher)
# Inputs only need the real shapes, dtypes and strides: nothing is executed, so torch.empty suffices.
# --------------------------------------------------------------------------------------------
def _bf16(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bfloat16)


def _f32(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


def _t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _qk(*shape: int, dtype: torch.dtype = torch.bfloat16) -> Tuple[torch.Tensor, ...]:
    """q and k of ``shape`` and their norm weights (over the last dimension)."""
    return _t(*shape, dtype=dtype), _t(*shape, dtype=dtype), _t(shape[-1], dtype=dtype), _t(shape[-1], dtype=dtype)


def _cos_sin(*shape: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 RoPE cos and sin tables of ``shape``."""
    return _f32(*shape), _f32(*shape)


def _hy(*shape: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A residual stream h and the branch output y added to it, both bf16 of ``shape``."""
    return _bf16(*shape), _bf16(*shape)


def _emb_chunks(b: int, d: int, n: int) -> Tuple[torch.Tensor, ...]:
    """The ``n`` [b, d] modulation vectors of an AdaLN projection's [b, n * d] output: emb.chunk(n, dim=1) (row
    stride n * d)."""
    return _bf16(b, n * d).chunk(n, dim=1)


def _gated_residual_ln(b: int, s: int, d: int, dual: bool = False) -> Tuple[str, Callable]:
    """layernorm's gated residual + LayerNorm + modulation (``dual``: two modulations) on [b, s, d] rows, with
    the gate and modulation vectors chunks of one AdaLN projection."""
    if dual:
        return "layernorm", lambda m: m.gated_residual_layer_norm_modulate_dual(*_hy(b, s, d), *_emb_chunks(b, d, 5))
    return "layernorm", lambda m: m.gated_residual_layer_norm_modulate(*_hy(b, s, d), *_emb_chunks(b, d, 3))


def _device_fp8(module) -> torch.dtype:
    """The FP8 format of the target ``module`` is compiled for: e4m3fnuz on gfx942, e4m3fn elsewhere."""
    return torch.float8_e4m3fnuz if module._device_target(None)[1] == "gfx942" else torch.float8_e4m3fn


def _wan_cases(model: str, d: int, ffn: int) -> Dict[str, Tuple[str, Callable]]:
    """The cases of one Wan 2.1 T2V size (``d`` wide, MLP ``ffn`` wide): see the Wan section of ``CASES``."""
    s = 32760
    return {
        f"wan_{model}_qk_rmsnorm_rope[per-head table 1x{s}x{d}]": (
            "qk_norm_rope",
            lambda m: m.ltx_qk_rmsnorm_rope(*_qk(1, s, d), 1e-6, *_cos_sin(1, s, 128)),
        ),
        f"wan_{model}_layer_norm_modulate[fp32 modulation 1x{s}x{d}]": (
            "layernorm",
            lambda m: m.layer_norm_modulate(_bf16(1, s, d), _f32(1, 1, d), _f32(1, 1, d), 1e-6),
        ),
        f"wan_{model}_gated_residual_layer_norm[fp32 gate, weight, bias 1x{s}x{d}]": (
            "layernorm",
            lambda m: m.gated_residual_layer_norm_modulate(
                *_hy(1, s, d), _f32(1, 1, d), None, None, 1e-6, weight=_f32(d), bias=_f32(d)
            ),
        ),
        f"wan_{model}_residual_layer_norm_modulate[1x{s}x{d}]": (
            "layernorm",
            lambda m: m.gated_residual_layer_norm_modulate(*_hy(1, s, d), None, _f32(1, 1, d), _f32(1, 1, d), 1e-6),
        ),
        f"wan_{model}_gated_residual_add[fp32 gate 1x{s}x{d}]": (
            "rmsnorm",
            lambda m: m.gated_residual_add(*_hy(1, s, d), _f32(1, 1, d)),
        ),
        f"wan_{model}_cross_attn_rms_norm+w[1x512x{d}]": (
            "rmsnorm",
            lambda m: m.rms_norm(_bf16(1, 512, d), _bf16(d), 1e-6),
        ),
        f"wan_{model}_gelu_tanh[1x{s}x{ffn}]": ("activations", lambda m: m.gelu_tanh(_bf16(1, s, ffn))),
    }


# LTX-Video transformer: 2048 wide (32 heads x 64), B = 2 with classifier-free guidance, 1,320 tokens
# (25 frames 480x704) and 6,144 tokens (121 frames 512x768). VAE: channel-last RMSNorm over 128..512 channels.
CASES: Dict[str, Tuple[str, Callable]] = {
    # ---- scripts/rmsnorm.py ----
    # norm1 / norm2: weightless diffusers RMSNorm; attn norm_q / norm_k: weighted torch.nn.RMSNorm.
    "rms_norm[2x1320x2048]": ("rmsnorm", lambda m: m.rms_norm(_bf16(2, 1320, 2048))),
    "rms_norm[2x6144x2048]": ("rmsnorm", lambda m: m.rms_norm(_bf16(2, 6144, 2048))),
    "rms_norm+w[2x1320x2048]": ("rmsnorm", lambda m: m.rms_norm(_bf16(2, 1320, 2048), _bf16(2048), 1e-5)),
    "rms_norm+w[2x6144x2048]": ("rmsnorm", lambda m: m.rms_norm(_bf16(2, 6144, 2048), _bf16(2048), 1e-5)),
    # widest single-pass row, in bf16 and fp32 (twice the registers per element)
    "rms_norm+w[2x256x16384]": ("rmsnorm", lambda m: m.rms_norm(_bf16(2, 256, 16384), _bf16(16384))),
    "rms_norm+w[fp32 2x256x16384]": (
        "rmsnorm",
        lambda m: m.rms_norm(_t(2, 256, 16384, dtype=torch.float32), _t(16384, dtype=torch.float32)),
    ),
    # chunked two-pass path (rows wider than the single-pass limit)
    "rms_norm+w[2x128x32768]": ("rmsnorm", lambda m: m.rms_norm(_bf16(2, 128, 32768), _bf16(32768))),
    # narrow rows packed several per program: VAE channel-last norms
    "rms_norm[vae 1x80640x128]": ("rmsnorm", lambda m: m.rms_norm(_bf16(1, 80640, 128), eps=1e-8)),
    "rms_norm[vae 1x20160x512]": ("rmsnorm", lambda m: m.rms_norm(_bf16(1, 20160, 512), eps=1e-8)),
    # AdaLN: norm(x) * (1 + scale) + shift with per-sample scale/shift [B, 1, D]
    "rms_norm_modulate[2x1320x2048]": (
        "rmsnorm",
        lambda m: m.rms_norm_modulate(_bf16(2, 1320, 2048), _bf16(2, 1, 2048), _bf16(2, 1, 2048)),
    ),
    "rms_norm_modulate[2x6144x2048]": (
        "rmsnorm",
        lambda m: m.rms_norm_modulate(_bf16(2, 6144, 2048), _bf16(2, 1, 2048), _bf16(2, 1, 2048)),
    ),
    # h = h + attn * gate_msa, then norm2 + modulation; gate None: h = h + attn2 (cross-attention)
    "gated_residual_rms_norm_modulate[2x6144x2048]": (
        "rmsnorm",
        lambda m: m.gated_residual_rms_norm_modulate(
            *_hy(2, 6144, 2048), _bf16(2, 1, 2048), _bf16(2, 1, 2048), _bf16(2, 1, 2048)
        ),
    ),
    "gated_residual_rms_norm_modulate[gate=None 2x6144x2048]": (
        "rmsnorm",
        lambda m: m.gated_residual_rms_norm_modulate(*_hy(2, 6144, 2048), None, _bf16(2, 1, 2048), _bf16(2, 1, 2048)),
    ),
    # the gated residuals alone (h + attn1 * gate_msa, h + ff * gate_mlp): the same kernel, norm off
    "gated_residual_add[2x6144x2048]": (
        "rmsnorm",
        lambda m: m.gated_residual_add(*_hy(2, 6144, 2048), _bf16(2, 1, 2048)),
    ),
    "gated_residual_add[2x256x32768]": (
        "rmsnorm",
        lambda m: m.gated_residual_add(*_hy(2, 256, 32768), _bf16(2, 1, 32768)),
    ),
    # ---- scripts/rope.py ----
    # LTX interleaved RoPE on q/k [B, S, 2048] with fp32 cos/sin [B, S, 2048] from LTXVideoRotaryPosEmbed
    "ltx_rope[2x1320x2048]": (
        "rope",
        lambda m: m.ltx_rope(_bf16(2, 1320, 2048), *_cos_sin(2, 1320, 2048)),
    ),
    "ltx_rope[2x6144x2048]": (
        "rope",
        lambda m: m.ltx_rope(_bf16(2, 6144, 2048), *_cos_sin(2, 6144, 2048)),
    ),
    # rows strided: q read in place from a fused [B, S, 3 * 2048] qkv projection
    "ltx_rope[qkv slice 2x6144x2048]": (
        "rope",
        lambda m: m.ltx_rope(_bf16(2, 6144, 3 * 2048)[..., 2048:4096], *_cos_sin(2, 6144, 2048)),
    ),
    # transformers' rotate-half layout: [B, H, S, D] (Llama-like head dim 128), and a [B, S, H, D] transpose
    "rope_rotate_half[1x32x4096x128]": (
        "rope",
        lambda m: m.rope_rotate_half(_bf16(1, 32, 4096, 128), _bf16(1, 4096, 128), _bf16(1, 4096, 128)),
    ),
    "rope_rotate_half[transposed 2x32x6144x64]": (
        "rope",
        lambda m: m.rope_rotate_half(_bf16(2, 6144, 32, 64).transpose(1, 2), *_cos_sin(2, 6144, 64)),
    ),
    # diffusers' apply_rotary_emb on [B, S, H, D] q/k read transposed (FLUX.2: 48 heads of 128, fp32 [S, D]
    # tables), and with a complex table's parts (one value per channel pair, strided views)
    "rope_interleaved[transposed 1x48x4608x128]": (
        "rope",
        lambda m: m.rope_interleaved(_bf16(1, 4608, 48, 128).transpose(1, 2), *_cos_sin(4608, 128)),
    ),
    "rope_interleaved[complex parts 1x24x4096x128]": (
        "rope",
        lambda m: m.rope_interleaved(_bf16(1, 4096, 24, 128).transpose(1, 2), *_f32(4096, 64, 2).unbind(-1)),
    ),
    # ---- scripts/qk_norm_rope.py ----
    # LTX self-attention: norm_q/norm_k (weighted RMSNorm over 2048, eps 1e-5) + RoPE, one launch
    "ltx_qk_rmsnorm_rope[2x1320x2048]": (
        "qk_norm_rope",
        lambda m: m.ltx_qk_rmsnorm_rope(*_qk(2, 1320, 2048), 1e-5, *_cos_sin(2, 1320, 2048)),
    ),
    "ltx_qk_rmsnorm_rope[2x6144x2048]": (
        "qk_norm_rope",
        lambda m: m.ltx_qk_rmsnorm_rope(*_qk(2, 6144, 2048), 1e-5, *_cos_sin(2, 6144, 2048)),
    ),
    # the same with cos/sin computed in the kernel from grid coordinates [B, S, 3] and 2048 // 6 frequencies
    "ltx_qk_rmsnorm_rope_coords[2x6144x2048]": (
        "qk_norm_rope",
        lambda m: m.ltx_qk_rmsnorm_rope_coords(*_qk(2, 6144, 2048), 1e-5, _f32(2, 6144, 3), _f32(2048 // 6)),
    ),
    # ---- scripts/activations.py ----
    # LTX feed-forward: GELU(tanh) on the [B, S, 8192] up-projection (contiguous: flat kernel)
    "gelu[tanh 2x6144x8192]": ("activations", lambda m: m.gelu(_bf16(2, 6144, 8192), "tanh")),
    "gelu[erf 2x6144x8192]": ("activations", lambda m: m.gelu(_bf16(2, 6144, 8192), "none")),
    # strided rows (a slice of a wider projection): row kernel
    "gelu[tanh rows 2x6144x8192 of 16384]": (
        "activations",
        lambda m: m.gelu(_bf16(2, 6144, 16384)[..., :8192], "tanh"),
    ),
    # diffusers GEGLU: [B, S, 2 x 8192] -> [B, S, 8192]
    "geglu[erf 2x6144x16384]": ("activations", lambda m: m.geglu(_bf16(2, 6144, 16384), "none")),
    "geglu[tanh 2x6144x16384]": ("activations", lambda m: m.geglu(_bf16(2, 6144, 16384), "tanh")),
    # ---- LLM decode: Llama-3 8B / 70B (hidden 4096 / 8192, MLP 14336 / 28672); rows = tokens in flight ----
    # scripts/rmsnorm.py fused_add_rms_norm: residual add + RMSNorm, plain and with FP8 output in the device's
    # format (e4m3fnuz on gfx942, e4m3fn elsewhere) with a static per-tensor scale or dynamic per-token scales
    **{
        f"fused_add_rms_norm{tag}[{m}x{h}]": (
            "rmsnorm",
            lambda mod, m=m, h=h, kw=kw: mod.fused_add_rms_norm(*_hy(m, h), _bf16(h), 1e-5, **kw()),
        )
        for h in (4096, 8192)
        for m in (1, 32, 4096)
        for tag, kw in (
            ("", dict),
            ("+fp8 per_tensor", lambda: dict(fp8="per_tensor", fp8_scale=_f32(1))),
            ("+fp8 per_token", lambda: dict(fp8="per_token")),
        )
    },
    # each FP8 format forced on every target (the native cast where the target has it, else the integer encoder)
    **{
        f"fused_add_rms_norm+fp8 {mode} {name}[32x{h}]": (
            "rmsnorm",
            lambda mod, h=h, mode=mode, dt=dt: mod.fused_add_rms_norm(
                _bf16(32, h),
                _bf16(32, h),
                _bf16(h),
                1e-5,
                fp8=mode,
                fp8_dtype=dt,
                fp8_scale=_f32(1) if mode == "per_tensor" else None,
            ),
        )
        for h in (4096, 8192)
        for mode in ("per_tensor", "per_token")
        for name, dt in (("e4m3fn", torch.float8_e4m3fn), ("e4m3fnuz", torch.float8_e4m3fnuz))
    },
    # rows wider than the single-pass limit: per-token FP8 adds a pass for the row maximum
    "fused_add_rms_norm+fp8 per_token[32x32768]": (
        "rmsnorm",
        lambda m: m.fused_add_rms_norm(*_hy(32, 32768), _bf16(32768), 1e-5, fp8="per_token"),
    ),
    # scripts/activations.py swiglu: fused [rows, 2 x 14336] gate/up projection, plain and FP8 (device format)
    **{
        f"swiglu{tag}[{m}x2x14336]": ("activations", lambda mod, m=m, kw=kw: mod.swiglu(_bf16(m, 2 * 14336), **kw()))
        for m in (1, 4096)
        for tag, kw in (
            ("", dict),
            ("+fp8 per_tensor", lambda: dict(fp8="per_tensor", fp8_scale=_f32(1))),
            ("+fp8 per_token", lambda: dict(fp8="per_token")),
        )
    },
    "swiglu[gate, up 4096x14336]": ("activations", lambda m: m.swiglu(_bf16(4096, 14336), _bf16(4096, 14336))),
    # Gemma 2 / 3 MLP: tanh GELU of the gate projection times the up projection (Gemma-3-12B: intermediate 15360)
    **{
        f"gelu_mul[tanh {m}x15360]": ("activations", lambda mod, m=m: mod.gelu_mul(_bf16(m, 15360), _bf16(m, 15360)))
        for m in (1, 2048)
    },
    # more row blocks than a grid's second dimension takes (65,535): the row kernel's one-dimensional grid
    "swiglu[70000x2x4096, 1D grid]": ("activations", lambda m: m.swiglu(_bf16(70000, 2 * 4096))),
    # 70B MLP rows (28672 > the whole-row limit): per-token FP8 reads each row twice
    "swiglu+fp8 per_token[32x2x28672]": ("activations", lambda m: m.swiglu(_bf16(32, 2 * 28672), fp8="per_token")),
    # FP8 inputs of a diffusion transformer's FP8 GEMMs at LTX-Video's [2, 6144, 2048] (FF inner 8192): the AdaLN
    # norm with per-token FP8 output (q/k/v and FF up-projection inputs), with the gated residual before it, the
    # feed-forward's GELU with FP8 output (down-projection input), and the attention output quantised
    "rms_norm_modulate+fp8 per_token[2x6144x2048]": (
        "rmsnorm",
        lambda m: m.rms_norm_modulate(_bf16(2, 6144, 2048), _bf16(2, 1, 2048), _bf16(2, 1, 2048), fp8="per_token"),
    ),
    "gated_residual_rms_norm_modulate+fp8 per_token[2x6144x2048]": (
        "rmsnorm",
        lambda m: m.gated_residual_rms_norm_modulate(
            *_hy(2, 6144, 2048), _bf16(2, 1, 2048), _bf16(2, 1, 2048), _bf16(2, 1, 2048), fp8="per_token"
        ),
    ),
    "gelu_tanh+fp8 per_token[2x6144x8192]": ("activations", lambda m: m.gelu(_bf16(2, 6144, 8192), fp8="per_token")),
    "fp8_quantize per_token[2x6144x2048]": ("activations", lambda m: m.fp8_quantize(_bf16(2, 6144, 2048))),
    "fp8_quantize per_tensor[2x6144x2048]": (
        "activations",
        lambda m: m.fp8_quantize(_bf16(2, 6144, 2048), "per_tensor", fp8_scale=_f32(1)),
    ),
    # ---- scripts/skinny_gemm.py: decode-time linear layers y = x @ W^T, M = 1..32 rows ----
    # Llama-3 8B (q/o 4096x4096, gate/up 14336x4096, k/v 1024x4096 with GQA, down 4096x14336) and 70B (q/o
    # 8192x8192, gate/up 28672x8192, down 8192x28672); bf16 weights and FP8 weights in the device's format
    # (e4m3fnuz on gfx942, e4m3fn elsewhere) with per-output-channel fp32 scales
    **{
        f"skinny_gemm{tag}[{name} M{m}]": (
            "skinny_gemm",
            lambda mod, m=m, n=n, k=k, fp8=fp8: mod.skinny_gemm(
                _bf16(m, k),
                _t(n, k, dtype=_device_fp8(mod) if fp8 else torch.bfloat16),
                weight_scale=_f32(n) if fp8 else None,
            ),
        )
        for name, (n, k) in (
            ("8B qo 4096x4096", (4096, 4096)),
            ("8B gate-up 14336x4096", (14336, 4096)),
            ("8B kv 1024x4096", (1024, 4096)),
            ("8B down 4096x14336", (4096, 14336)),
            ("70B qo 8192x8192", (8192, 8192)),
            ("70B gate-up 28672x8192", (28672, 8192)),
            ("70B down 8192x28672", (8192, 28672)),
        )
        for m in (1, 32)
        for tag, fp8 in (("", False), ("+fp8", True))
    },
    # the rows between: M = 2, 4 (multiply-add path), 8, 16 (tl.dot path)
    **{
        f"skinny_gemm[8B qo 4096x4096 M{m}]": (
            "skinny_gemm",
            lambda mod, m=m: mod.skinny_gemm(_bf16(m, 4096), _bf16(4096, 4096)),
        )
        for m in (2, 4, 8, 16)
    },
    # each FP8 format on every target (decoded from its bits where the GPU has no conversion for it)
    **{
        f"skinny_gemm+{fname}[8B qo 4096x4096 M{m}]": (
            "skinny_gemm",
            lambda mod, m=m, dt=dt: mod.skinny_gemm(_bf16(m, 4096), _t(4096, 4096, dtype=dt), weight_scale=_f32(4096)),
        )
        for m in (1, 4, 32)
        for fname, dt in (("e4m3fn", torch.float8_e4m3fn), ("e4m3fnuz", torch.float8_e4m3fnuz))
    },
    # FP8 x and W with per-tensor scales and a bias (the torch._scaled_mm form)
    **{
        f"skinny_gemm+fp8 x[8B qo 4096x4096 M{m}]": (
            "skinny_gemm",
            lambda mod, m=m: mod.skinny_gemm(
                _t(m, 4096, dtype=_device_fp8(mod)),
                _t(4096, 4096, dtype=_device_fp8(mod)),
                _bf16(4096),
                weight_scale=_f32(1),
                x_scale=_f32(1),
            ),
        )
        for m in (1, 32)
    },
    # ---- scripts/moe_experts.py: the routed experts of a decode step. Mixtral-8x7B (8 experts, top 2, 4096 wide,
    # experts 14336 wide) at 1 and 4 tokens, Qwen3-30B-A3B (128 experts, top 8, 2048 wide, experts 768 wide) ----
    **{
        f"moe_swiglu_experts[{name} T{t}]": (
            "moe_experts",
            lambda mod, t=t, e=e, k=k, h=h, i=i: mod.moe_swiglu_experts(
                _bf16(t, h), _t(t, k, dtype=torch.int64), _f32(t, k), _bf16(e, 2 * i, h), _bf16(e, h, i)
            ),
        )
        for name, (e, k, h, i), ts in (
            ("Mixtral-8x7B", (8, 2, 4096, 14336), (1, 4)),
            ("Qwen3-30B-A3B", (128, 8, 2048, 768), (1,)),
        )
        for t in ts
    },
    # ---- new leaf files: append their cases here ----
    # ---- scripts/layernorm.py: MMDiT blocks at 1024x1024. SD3.5-medium: 1536 wide, B = 2 (CFG), 4096 image
    # + 333 text tokens; FLUX.1-dev: 3072 wide, B = 1, 4096 image + 512 text tokens (4608 in single blocks).
    # Modulation vectors are [B, D] views of the AdaLN projection's emb.chunk(n, dim=1) (row stride n * D).
    "layer_norm_modulate[sd3 2x4096x1536]": (
        "layernorm",
        lambda m: m.layer_norm_modulate(_bf16(2, 4096, 1536), *_emb_chunks(2, 1536, 6)[1::-1]),
    ),
    "layer_norm_modulate[flux single 1x4608x3072]": (
        "layernorm",
        lambda m: m.layer_norm_modulate(_bf16(1, 4608, 3072), *_emb_chunks(1, 3072, 3)[1::-1]),
    ),
    # no more row blocks than the persistent grid's programs: one program per row block
    "layer_norm_modulate[3 rows of 1536]": (
        "layernorm",
        lambda m: m.layer_norm_modulate(_bf16(1, 3, 1536), *_emb_chunks(1, 1536, 6)[1::-1]),
    ),
    # SD35AdaLayerNormZeroX: one norm, two modulations
    "layer_norm_modulate_dual[sd3.5 2x4096x1536]": (
        "layernorm",
        lambda m: m.layer_norm_modulate_dual(_bf16(2, 4096, 1536), *_emb_chunks(2, 1536, 4)),
    ),
    # h = h + gate * attn, then norm2 + MLP modulation (image and text streams)
    "gated_residual_layer_norm_modulate[sd3 2x4096x1536]": _gated_residual_ln(2, 4096, 1536),
    # a block's last gated residual + the next block's SD35AdaLayerNormZeroX (two modulations)
    "gated_residual_layer_norm_modulate_dual[sd3.5 2x4096x1536]": _gated_residual_ln(2, 4096, 1536, dual=True),
    "gated_residual_layer_norm_modulate[flux 1x4096x3072]": _gated_residual_ln(1, 4096, 3072),
    "gated_residual_layer_norm_modulate[flux text 1x512x3072]": _gated_residual_ln(1, 512, 3072),
    # nn.LayerNorm with weight and bias; the widest single-pass fp32 row; the chunked three-pass path
    "layer_norm+w+b[2x4096x1536]": (
        "layernorm",
        lambda m: m.layer_norm(_bf16(2, 4096, 1536), _bf16(1536), _bf16(1536)),
    ),
    "layer_norm+w+b[fp32 2x256x16384]": (
        "layernorm",
        lambda m: m.layer_norm(_f32(2, 256, 16384), _f32(16384), _f32(16384)),
    ),
    "gated_residual_layer_norm_modulate[chunked 1x64x32768]": _gated_residual_ln(1, 64, 32768),
    # ---- scripts/head_norm_rope.py: per-head q/k RMSNorm (+ RoPE) ----
    # FLUX double-stream attention: text (512) and image (4096) q/k as [1, S, 24, 128] (the layout of the
    # projections' [1, S, 3072] outputs viewed per head), their own norm weights, fp32 cos/sin [4608, 128] from
    # FluxPosEmbed, written into one [1, 4608, 24, 128]
    "joint_head_rms_norm_rope[flux double 1x(512+4096)x24x128]": (
        "head_norm_rope",
        lambda m: m.joint_head_rms_norm_rope([_qk(1, 512, 24, 128), _qk(1, 4096, 24, 128)], 1e-6, *_cos_sin(4608, 128)),
    ),
    # FLUX single-stream attention with fused qkv projections: q/k are chunks of one [1, 4608, 3 * 3072] output
    "head_rms_norm_rope[flux single qkv slices 1x4608x24x128]": (
        "head_norm_rope",
        lambda m: m.head_rms_norm_rope(
            _bf16(1, 4608, 3 * 3072)[..., :3072].unflatten(-1, (24, 128)),
            _bf16(1, 4608, 3 * 3072)[..., 3072:6144].unflatten(-1, (24, 128)),
            _bf16(128),
            _bf16(128),
            1e-6,
            *_cos_sin(4608, 128),
        ),
    ),
    # SD3.5 joint attention: diffusers RMSNorm(64) per head (bf16 weights: rounded before the multiply), no RoPE,
    # image (4096) then text (333) tokens, q/k [2, S, 24, 64] (the projections' [2, S, 1536] viewed per head)
    "joint_head_rms_norm_rope[sd3.5 norm only 2x(4096+333)x24x64]": (
        "head_norm_rope",
        lambda m: m.joint_head_rms_norm_rope(
            [_qk(2, 4096, 24, 64), _qk(2, 333, 24, 64)], 1e-6, cast_before_weight=True
        ),
    ),
    # fp32 activations (twice the registers per element) and a wide 256 head
    "head_rms_norm_rope[fp32 1x4608x24x128]": (
        "head_norm_rope",
        lambda m: m.head_rms_norm_rope(*_qk(1, 4608, 24, 128, dtype=torch.float32), 1e-6, *_cos_sin(4608, 128)),
    ),
    "head_rms_norm_rope[1x4096x16x256]": (
        "head_norm_rope",
        lambda m: m.head_rms_norm_rope(*_qk(1, 4096, 16, 256), 1e-6, *_cos_sin(4096, 256)),
    ),
    # more head steps than the kernel unrolls (64 heads of 256: 16 steps of 4): the looped form
    "head_rms_norm_rope[looped head steps 1x1024x64x256]": (
        "head_norm_rope",
        lambda m: m.head_rms_norm_rope(*_qk(1, 1024, 64, 256), 1e-6, *_cos_sin(1024, 256)),
    ),
    # ---- Wan 2.1 T2V (scripts/wan_injection.py): 1.3B 1536 wide (12 heads x 128), 14B 5120 (40 x 128); B = 1,
    # 32,760 tokens (81 frames 480x832); modulation, gates, norm2's weight and bias in fp32 (from_pretrained) ----
    **_wan_cases("1.3B", 1536, 8960),
    **_wan_cases("14B", 5120, 13824),
    # ---- scripts/xcd_remap.py ----
    # the XCD tile remap helper inside its demo kernel: 1003 programs (not a multiple of 8) over 8 XCDs
    "xcd_remap_demo[1003 programs, 8 XCDs]": ("xcd_remap", lambda m: m.xcd_remap_table(1003, 8)),
}


# --------------------------------------------------------------------------------------------
# Launch capture
# --------------------------------------------------------------------------------------------
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` call recorded by a launcher."""

    def __init__(self, kernel, args: tuple, kwargs: dict, grid):
        self.kernel = kernel
        self.args = args
        self.kwargs = kwargs
        self.grid = grid

    @property
    def name(self) -> str:
        fn = getattr(self.kernel, "fn", None)
        return getattr(fn, "__name__", None) or str(self.kernel)

    def grid_dims(self) -> Optional[List[int]]:
        grid = self.grid
        try:
            if callable(grid):
                meta = dict(zip(self.kernel.arg_names, self.args))
                meta.update(self.kwargs)
                grid = grid(meta)
            return [int(g) for g in grid]
        except Exception:
            return None


def _interpreting_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def _patched(obj, name: str, value):
    missing = object()
    old = obj.__dict__.get(name, missing) if isinstance(obj, type) else getattr(obj, name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


@contextlib.contextmanager
def capture_launches(module, target: Tuple[str, object, int]):
    """Record the Triton launches made inside the block instead of running them.

    While active: ``JITFunction.run`` (and ``Autotuner.run``: one launch per config) record their
    arguments; ``module._device_target`` returns ``target`` (``module._compute_units`` its NOMINAL_CUS count);
    the module's CPU-tensor guard is lifted (``module._interpreting`` returns True and TRITON_INTERPRET=1 is
    set in the environment, read by launchers only: the kernels were decorated without it).
    """
    from triton.runtime import autotuner
    from triton.runtime.jit import JITFunction

    launches: List[Launch] = []

    def record_run(self, *args, grid, warmup=False, **kwargs):
        launches.append(Launch(self, args, dict(kwargs), grid))
        return None

    def record_autotuned(self, *args, **kwargs):
        grid = kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        for config in self.configs:
            conf = config.all_kwargs() if hasattr(config, "all_kwargs") else dict(config.kwargs)
            self.fn.run(*args, grid=grid, warmup=False, **{**kwargs, **conf})
        return None

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(JITFunction, "run", record_run))
        stack.enter_context(_patched(autotuner.Autotuner, "run", record_autotuned))
        if hasattr(module, "_device_target"):
            stack.enter_context(_patched(module, "_device_target", lambda *a, **k: tuple(target)))
        if hasattr(module, "_interpreting"):
            stack.enter_context(_patched(module, "_interpreting", lambda *a, **k: True))
        if hasattr(module, "_compute_units"):  # no device to ask: the target's nominal CU / SM count
            stack.enter_context(_patched(module, "_compute_units", lambda *a, **k: NOMINAL_CUS.get(target[1], 64)))
        if hasattr(module, "_KERNEL_MAX_M"):  # compile the kernel for every M, not the measured dispatch to torch
            stack.enter_context(_patched(module, "_KERNEL_MAX_M", {}))
        old_env = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        # launch plans are cached per call signature, not per target: start and leave with none, so each
        # target's launches are planned (and recorded) afresh
        runtime = sys.modules.get("kernel_runtime")  # the bundle's launch runtime, where the module uses it
        if runtime is not None:
            runtime.clear_plans(module)
        try:
            yield launches
        finally:
            if runtime is not None:
                runtime.clear_plans(module)
            if old_env is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old_env


# --------------------------------------------------------------------------------------------
# Specialisation: what the JIT would build for this launch on a GPU of the target
# --------------------------------------------------------------------------------------------
_FAKE_BASE = 1 << 36  # a device address: the caching allocators return blocks aligned to >= 256 bytes


class _DeviceTensorStandIn:
    """What Triton's specialiser reads from a tensor, with the address a GPU allocation would have.

    The data pointer is a 256-byte-aligned base plus the view's byte offset (so a strided view's
    alignment follows from its storage offset, as on the GPU); the pointer range is the storage size
    (used for AMD buffer-op specialisation of tensors under 2 GiB).
    """

    def __init__(self, t: torch.Tensor):
        self.dtype = t.dtype
        self._ptr = _FAKE_BASE + t.storage_offset() * t.element_size()
        self._range = t.untyped_storage().nbytes()

    def data_ptr(self) -> int:
        return self._ptr

    def ptr_range(self) -> int:
        return self._range


def _stand_in(v):
    return _DeviceTensorStandIn(v) if isinstance(v, torch.Tensor) else v


def specialize(launch: Launch, target) -> dict:
    """signature, constexprs, attrs and options of ``launch`` as the JIT builds them for ``target``.

    Uses Triton's own binder (``create_function_from_signature``) and ``JITFunction._pack_args`` with the
    target's backend, so the result follows the installed Triton's rules (same API in Triton 3.6 to 3.9).
    """
    from triton.compiler import make_backend
    from triton.runtime import jit as jit_mod

    kernel = launch.kernel
    backend = make_backend(target)
    binder = jit_mod.create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs)
    # the options JITFunction.run adds from the environment before binding
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - older Triton
        knobs = None
    runtime_debug = bool(getattr(getattr(knobs, "runtime", None), "debug", False))
    kwargs["debug"] = bool(kwargs.get("debug", getattr(kernel, "debug", None)) or runtime_debug)
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):
        if hasattr(getattr(knobs, "compilation", None), name):
            kwargs.setdefault(name, getattr(knobs.compilation, name))
    notes = []
    try:
        args = [_stand_in(a) for a in launch.args]
        kw = {k: _stand_in(v) for k, v in kwargs.items()}
        bound_args, spec, options = binder(*args, **kw)
    except Exception as exc:  # a Triton whose specialiser only accepts real tensors
        notes.append(f"specialised with the CPU tensors' own addresses ({type(exc).__name__}: {exc})")
        bound_args, spec, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, spec, options)
    return {"options": options, "signature": signature, "constexprs": constexprs, "attrs": attrs, "notes": notes}


# --------------------------------------------------------------------------------------------
# Reading the compiled code
# --------------------------------------------------------------------------------------------
_AMDGCN_FIELDS = {
    "vgpr_count": r"\.vgpr_count:\s*(\d+)",
    "agpr_count": r"\.agpr_count:\s*(\d+)",
    "sgpr_count": r"\.sgpr_count:\s*(\d+)",
    "vgpr_spill_count": r"\.vgpr_spill_count:\s*(\d+)",
    "sgpr_spill_count": r"\.sgpr_spill_count:\s*(\d+)",
    "scratch_bytes": r";\s*ScratchSize:\s*(\d+)",
    "private_segment_bytes": r"\.private_segment_fixed_size:\s*(\d+)",
    "occupancy_waves_per_simd": r";\s*Occupancy:\s*(\d+)",
    "wavefront_size": r"\.wavefront_size:\s*(\d+)",
}
# Fields without which the verdict cannot be given: missing ones fail the check.
_AMDGCN_REQUIRED = ("vgpr_count", "sgpr_count", "vgpr_spill_count", "sgpr_spill_count", "scratch_bytes")


def parse_amdgcn(text: str) -> dict:
    """Register, spill, scratch and occupancy figures of an ``amdgcn`` assembly text.

    Counts are the maximum over every function in the text (a kernel and any non-inlined callee);
    occupancy is the minimum. A field absent from the text is None.
    """
    out = {}
    for key, pattern in _AMDGCN_FIELDS.items():
        vals = [int(v) for v in re.findall(pattern, text)]
        if not vals:
            out[key] = None
        else:
            out[key] = min(vals) if key == "occupancy_waves_per_simd" else max(vals)
    return out


def amd_problems(stats: dict, lds_bytes: Optional[int], lds_limit: Optional[int]) -> List[str]:
    """Reasons an AMD compile fails the check (empty when it passes)."""
    problems = [f"could not read {k} from the amdgcn text" for k in _AMDGCN_REQUIRED if stats.get(k) is None]
    if stats.get("vgpr_spill_count"):
        problems.append(f"spills {stats['vgpr_spill_count']} VGPRs")
    if stats.get("sgpr_spill_count"):
        problems.append(f"spills {stats['sgpr_spill_count']} SGPRs")
    scratch = max(stats.get("scratch_bytes") or 0, stats.get("private_segment_bytes") or 0)
    if scratch:
        problems.append(f"uses {scratch} bytes of scratch per lane")
    if lds_bytes is not None and lds_limit is not None and lds_bytes > lds_limit:
        problems.append(f"needs {lds_bytes} bytes of LDS, more than the {lds_limit} a workgroup may use")
    return problems


def _nvidia_tool(name: str) -> Optional[str]:
    """Path of a CUDA tool: the one this Triton would use, else the wheel's copy, else PATH."""
    if name == "ptxas":
        try:
            from triton.backends.nvidia.compiler import get_ptxas

            return get_ptxas(90).path
        except Exception:
            pass
    try:
        from triton import knobs

        return getattr(knobs.nvidia, name.replace("-", "_")).path
    except Exception:
        pass
    local = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return local if os.access(local, os.X_OK) else shutil.which(name)


def _tool_version(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except Exception:
        return None
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    rel = [ln for ln in lines if "release" in ln]
    return (rel or lines or [None])[-1]


def parse_cuobjdump_resource_usage(text: str) -> dict:
    """REG, STACK, SHARED and LOCAL of the first function in ``cuobjdump --dump-resource-usage`` output."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        return {}
    reg, stack, shared, local = map(int, m.groups())
    return {"registers": reg, "stack_bytes": stack, "static_shared_bytes": shared, "local_bytes": local}


def parse_ptxas_verbose(text: str) -> dict:
    """Registers and spill bytes from ``ptxas -v`` output."""
    out = {}
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if m:
        out["stack_bytes"], out["spill_store_bytes"], out["spill_load_bytes"] = map(int, m.groups())
    m = re.search(r"Used (\d+) registers", text)
    if m:
        out["registers"] = int(m.group(1))
    return out


_NVIDIA_STATS_CACHE: Dict[str, Tuple[dict, List[str]]] = {}


def nvidia_stats(compiled, fp_fusion: bool = True) -> Tuple[dict, List[str]]:
    """Registers, spills and local memory of a compiled NVIDIA kernel, from the cubin and the PTX."""
    key = f"{getattr(compiled.metadata, 'hash', None) or id(compiled)}:{fp_fusion}"
    if key not in _NVIDIA_STATS_CACHE:
        _NVIDIA_STATS_CACHE[key] = _nvidia_stats(compiled, fp_fusion)
    stats, notes = _NVIDIA_STATS_CACHE[key]
    return dict(stats), list(notes)


def _asm_for_tool(compiled, key: str, name: str, tool: str, unknown: str, tmp: str, notes: list):
    """(the path of tool, compiled.asm[key] (name: what the notes call it), the file in tmp it was written to), or
    None with a note why not: the compile produced none, or the tool is not found (unknown: what that leaves)."""
    data, exe = compiled.asm.get(key), _nvidia_tool(tool)
    if data is None:
        notes.append(f"no {name} produced")
        return None
    if not exe:
        notes.append(f"{tool} not found: {unknown}")
        return None
    path = os.path.join(tmp, f"kernel.{key}")
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
    return exe, data, path


def _nvidia_stats(compiled, fp_fusion: bool) -> Tuple[dict, List[str]]:
    stats, notes = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        found = _asm_for_tool(compiled, "cubin", "cubin", "cuobjdump", "registers read from ptxas -v only", tmp, notes)
        if found:
            cuobjdump, _, path = found
            res = subprocess.run([cuobjdump, "--dump-resource-usage", path], capture_output=True, text=True)
            stats.update(parse_cuobjdump_resource_usage(res.stdout))
            if not stats:
                notes.append(f"cuobjdump gave no resource usage: {(res.stderr or res.stdout).strip()[:200]}")
        found = _asm_for_tool(compiled, "ptx", "PTX", "ptxas", "spill bytes unknown", tmp, notes)
        if found:
            ptxas, ptx, src = found
            m = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
            arch = m.group(1) if m else "sm_90a"
            cmd = [ptxas, "-v", "-lineinfo", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "ptxas.cubin")]
            if not fp_fusion:
                cmd.insert(1, "--fmad=false")
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                notes.append(f"{os.path.basename(ptxas)} -v failed: {res.stderr.strip()[:200]}")
            else:
                ptxas_stats = parse_ptxas_verbose(res.stderr + res.stdout)
                for k, v in ptxas_stats.items():
                    stats.setdefault(k, v)
                if "registers" in ptxas_stats and ptxas_stats["registers"] != stats.get("registers"):
                    notes.append(f"ptxas -v reports {ptxas_stats['registers']} registers")
    return stats, notes


# --------------------------------------------------------------------------------------------
# Compiling
# --------------------------------------------------------------------------------------------
def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return str(v)


_FP8_CVT = re.compile(r"\b(v_cvt\w*_(?:fp8|bf8)\w*|cvt\.\w+(?:\.\w+)*\.e[45]m[23]x2\.\w+)")


def compile_launch(launch: Launch, target_name: str) -> dict:
    """Compile one captured launch for one target and return its record."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    backend_name, arch, warp_size = TARGETS[target_name]
    target = GPUTarget(backend_name, arch, warp_size)
    rec = {
        "kernel": launch.name,
        "target": target_name,
        "backend": backend_name,
        "arch": arch,
        "warp_size": warp_size,
        "grid": launch.grid_dims(),
        "ok": False,
        "problems": [],
        "warnings": [],
        "notes": [],
    }
    t0 = time.perf_counter()
    try:
        spec = specialize(launch, target)
        names = launch.kernel.arg_names
        opts = spec["options"]
        rec["num_warps"] = opts.num_warps
        rec["num_stages"] = opts.num_stages
        if getattr(opts, "waves_per_eu", 0):
            rec["waves_per_eu"] = opts.waves_per_eu
        rec["constexprs"] = {names[p[0]]: _jsonable(v) for p, v in spec["constexprs"].items() if len(p) == 1}
        rec["signature"] = {k: v for k, v in spec["signature"].items() if v != "constexpr"}
        # e.g. {"X": ["tt.divisibility=16", "tt.pointer_range=32"]}: what the JIT would assume of each argument
        rec["arg_attrs"] = {
            names[p[0]]: [f"{k}={v}" for k, v in a] for p, a in spec["attrs"].items() if a and len(p) == 1
        }
        rec["notes"] += spec["notes"]
        src = ASTSource(
            fn=launch.kernel, signature=spec["signature"], constexprs=spec["constexprs"], attrs=spec["attrs"]
        )
        compiled = triton.compile(src, target=target, options=opts.__dict__)
    except Exception as exc:
        rec["compile_s"] = round(time.perf_counter() - t0, 3)
        msg = f"{type(exc).__name__}: {exc}"
        rec["problems"].append("did not compile: " + (msg if len(msg) <= 2000 else msg[:1000] + " ... " + msg[-1000:]))
        return rec
    rec["compile_s"] = round(time.perf_counter() - t0, 3)
    # FP8 conversion instructions in the code (e.g. v_cvt_pk_fp8_f32, cvt.rn.satfinite.e4m3x2.f32): shows
    # whether an FP8 kernel got the target's hardware conversion or a software sequence
    asm_text = compiled.asm.get("amdgcn", "") if backend_name == "hip" else compiled.asm.get("ptx", "")
    rec["fp8_conversions"] = sorted(set(_FP8_CVT.findall(asm_text or "")))
    lds = getattr(compiled.metadata, "shared", None)
    rec["lds_bytes"] = lds
    rec["lds_limit_bytes"] = LDS_LIMIT_BYTES.get(target_name)
    if backend_name == "hip":
        stats = parse_amdgcn(compiled.asm.get("amdgcn", ""))
        rec.update(stats)
        rec["problems"] += amd_problems(stats, lds, rec["lds_limit_bytes"])
        if stats.get("wavefront_size") not in (None, warp_size):
            rec["problems"].append(f"compiled for wave{stats['wavefront_size']}, expected wave{warp_size}")
    else:
        try:
            stats, notes = nvidia_stats(compiled, bool(getattr(spec["options"], "enable_fp_fusion", True)))
        except Exception as exc:  # a CUDA tool that exists but cannot run here
            stats, notes = {}, [f"registers/spills unknown: {type(exc).__name__}: {exc}"]
        rec.update(stats)
        rec["notes"] += notes
        if stats.get("spill_store_bytes") or stats.get("spill_load_bytes"):
            rec["warnings"].append(
                f"spills ({stats.get('spill_store_bytes')} bytes stored, {stats.get('spill_load_bytes')} loaded)"
            )
        elif stats.get("local_bytes") or stats.get("stack_bytes"):
            rec["warnings"].append(
                f"uses local memory ({stats.get('stack_bytes')} bytes of stack, {stats.get('local_bytes')} local)"
            )
        if lds is not None and lds > rec["lds_limit_bytes"]:
            rec["problems"].append(f"needs {lds} bytes of shared memory, more than {rec['lds_limit_bytes']}")
    rec["ok"] = not rec["problems"]
    return rec


def _kernels_are_compilable(module) -> Optional[str]:
    """A reason the module's kernels cannot be compiled in this process, or None."""
    for name, obj in vars(module).items():
        if type(obj).__name__ == "InterpretedFunction":
            return (
                f"{module.__name__}.{name} was decorated under the Triton interpreter (TRITON_INTERPRET was set "
                "when the module was imported); run the check in a process without TRITON_INTERPRET"
            )
    return None


def _import_leaf(name: str):
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    return importlib.import_module(name)


def compile_cases(
    cases: Dict[str, Tuple[str, Callable]],
    targets: Optional[Iterable[str]] = None,
    kernel_filter: Optional[str] = None,
    num_warps: Optional[int] = None,
    waves_per_eu: Optional[int] = None,
) -> List[dict]:
    """Capture each case's launches for each target and compile them. One record per launch x target.

    ``cases`` maps a case name to (module name, function(module) that calls the public launcher).
    ``kernel_filter`` keeps the cases whose name, or the launches whose kernel name, contains it.
    ``num_warps`` replaces the launchers' choice in every compiled launch (what-if: registers, occupancy
    and LDS at another warp count; the records say "num_warps_override"). ``waves_per_eu`` likewise sets
    the AMD occupancy hint on every launch for the hip targets ("waves_per_eu_override").
    """
    if _interpreting_env():
        raise RuntimeError(
            "TRITON_INTERPRET is set in this process: kernels decorated under the interpreter cannot be "
            "compiled. Run the check in a process without it (python scripts/check_amd_compile.py restarts "
            "itself without it)."
        )
    warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
    targets = list(targets or DEFAULT_TARGETS)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"unknown target(s) {unknown}; expected some of {sorted(TARGETS)}")
    flt = (kernel_filter or "").lower()
    records: List[dict] = []
    for case_name, (module_name, build) in cases.items():
        case_matches = flt in case_name.lower()
        try:
            module = _import_leaf(module_name)
            reason = _kernels_are_compilable(module)
            if reason:
                raise RuntimeError(reason)
        except Exception as exc:
            if case_matches:
                for tname in targets:
                    records.append(
                        _failed(case_name, module_name, tname, f"cannot import: {type(exc).__name__}: {exc}")
                    )
            continue
        for tname in targets:
            try:
                with capture_launches(module, TARGETS[tname]) as launches:
                    build(module)
            except Exception as exc:
                if case_matches:
                    records.append(
                        _failed(case_name, module_name, tname, f"launcher raised {type(exc).__name__}: {exc}")
                    )
                continue
            selected = [ln for ln in launches if case_matches or flt in ln.name.lower()]
            if not launches and case_matches:
                records.append(_failed(case_name, module_name, tname, "the case launched no Triton kernel"))
            for launch in selected:
                if num_warps is not None:
                    launch.kwargs["num_warps"] = num_warps
                hint = waves_per_eu is not None and TARGETS[tname][0] == "hip"
                if hint:
                    launch.kwargs["waves_per_eu"] = waves_per_eu
                rec = compile_launch(launch, tname)
                if num_warps is not None:
                    rec["num_warps_override"] = num_warps
                if hint:
                    rec["waves_per_eu_override"] = waves_per_eu
                records.append({"case": case_name, "module": module_name, **rec})
    return records


def _failed(case: str, module: str, target: str, problem: str) -> dict:
    backend, arch, warp = TARGETS[target]
    return {
        "case": case,
        "module": module,
        "kernel": None,
        "target": target,
        "backend": backend,
        "arch": arch,
        "warp_size": warp,
        "ok": False,
        "problems": [problem],
        "warnings": [],
        "notes": [],
    }


def compile_all(
    targets: Optional[Iterable[str]] = None,
    kernel_filter: Optional[str] = None,
    num_warps: Optional[int] = None,
    waves_per_eu: Optional[int] = None,
) -> List[dict]:
    """Compile every case of ``CASES`` for ``targets`` (default: all); see ``compile_cases``."""
    return compile_cases(CASES, targets, kernel_filter, num_warps, waves_per_eu)


def tool_versions() -> dict:
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }
    for tool in ("ptxas", "cuobjdump"):
        path = _nvidia_tool(tool)
        versions[tool] = {"path": path, "version": _tool_version(path)} if path else None
    versions["TRITON_DEFAULT_FP_FUSION"] = os.environ.get("TRITON_DEFAULT_FP_FUSION")
    return versions


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def format_table(records: Sequence[dict]) -> str:
    head = ("case", "kernel", "target", "warps", "regs", "sgpr", "spill v/s", "scratch", "occ", "LDS", "s", "status")
    rows = []
    for r in records:
        if r.get("backend") == "hip":
            regs = r.get("vgpr_count")
            if r.get("agpr_count"):
                regs = f"{regs}+{r['agpr_count']}a"
            sgpr, spill = r.get("sgpr_count"), f"{r.get('vgpr_spill_count')}/{r.get('sgpr_spill_count')}"
            scratch, occ = r.get("scratch_bytes"), r.get("occupancy_waves_per_simd")
        else:
            regs, sgpr = r.get("registers"), "-"
            st, ld = r.get("spill_store_bytes"), r.get("spill_load_bytes")
            spill = "?" if st is None else f"{st}B/{ld}B"
            scratch, occ = r.get("stack_bytes"), "-"
        status = "ok" if r.get("ok") else "FAIL: " + "; ".join(r.get("problems", []))
        if r.get("ok") and r.get("warnings"):
            status = "warn: " + "; ".join(r["warnings"])
        cells = (
            r.get("case"),
            r.get("kernel"),
            r.get("target"),
            r.get("num_warps"),
            regs,
            sgpr,
            spill,
            scratch,
            occ,
            r.get("lds_bytes"),
            r.get("compile_s"),
            status,
        )
        rows.append(["-" if c is None else str(c) for c in cells])
    widths = [max(len(h), *(min(len(row[i]), 60) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    widths[-1] = len(head[-1])
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    return "\n".join(lines)


def _reexec_without_interpreter(argv: Sequence[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    print("TRITON_INTERPRET is set: restarting without it (the check compiles real GPU code)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, targets = _parse_args(argv)
    if args.list:
        for name, (module, _) in CASES.items():
            print(f"{module:14s} {name}")
        return 0
    if _interpreting_env():
        _reexec_without_interpreter(argv)  # does not return

    t0 = time.perf_counter()
    records = compile_all(targets, args.kernel, args.num_warps, args.waves_per_eu)
    elapsed = time.perf_counter() - t0
    failures = [r for r in records if not r["ok"]]
    report = {
        "tools": tool_versions(),
        "targets": {t: {"backend": TARGETS[t][0], "arch": TARGETS[t][1], "warp_size": TARGETS[t][2]} for t in targets},
        "kernel_filter": args.kernel,
        "num_warps_override": args.num_warps,
        "waves_per_eu_override": args.waves_per_eu,
        "records": records,
        "n_records": len(records),
        "n_failed": len(failures),
        "elapsed_s": round(elapsed, 2),
        "ok": bool(records) and not failures,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    print(format_table(records), file=sys.stderr)
    if not records:
        print(f"no case or kernel matches {args.kernel!r}", file=sys.stderr)
    print(f"{len(records)} compiles, {len(failures)} failed, {elapsed:.1f} s", file=sys.stderr)
    return 0 if report["ok"] else 1


def _parse_args(argv: Sequence[str]):
    """(parsed command line, the targets it names); exits with status 2 on a bad one."""
    import argparse

    p = argparse.ArgumentParser(
        description="Compile every Triton kernel of the bundle ahead of time for AMD and NVIDIA targets, at the "
        "launch configurations the launchers choose for real model shapes, and report registers, spills, "
        "scratch, occupancy and LDS. Exit 1 if a kernel fails to compile, spills or uses scratch on AMD.",
    )
    p.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated targets among {','.join(TARGETS)} (default: all)",
    )
    p.add_argument(
        "--kernel",
        default=None,
        metavar="NAME",
        help="only cases whose name, or kernels whose name, contains NAME (case-insensitive)",
    )
    p.add_argument(
        "--num-warps",
        type=int,
        default=None,
        metavar="N",
        help="compile every selected launch with N warps instead of the launcher's choice (a what-if: "
        "registers, occupancy and LDS at another warp count; a power of two, 1-32)",
    )
    p.add_argument(
        "--waves-per-eu",
        type=int,
        default=None,
        metavar="N",
        help="compile every selected launch for the AMD targets with the occupancy hint waves_per_eu=N "
        "(a what-if; 1-16; NVIDIA targets are compiled without it)",
    )
    p.add_argument("--output-json", default=None, metavar="PATH", help="also write the JSON report to PATH")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        p.error(f"unknown target(s) {bad}; choose among {','.join(TARGETS)}")
    if args.num_warps is not None and (
        args.num_warps < 1 or args.num_warps > 32 or args.num_warps & (args.num_warps - 1)
    ):
        p.error(f"--num-warps must be a power of two from 1 to 32, got {args.num_warps}")
    if args.waves_per_eu is not None and not 1 <= args.waves_per_eu <= 16:
        p.error(f"--waves-per-eu must be from 1 to 16, got {args.waves_per_eu}")
    return args, targets


if __name__ == "__main__":
    raise SystemExit(main())

# SPDX-License-Identifier: Apache-2.0
"""Flag combinations a kernel cannot serve are refused when it is compiled.

The launchers only make valid combinations; a caller launching a kernel directly (a copied file, a new
launcher) gets a compile error naming the conflict instead of a kernel that computes something else.
Each case takes a valid launch recorded from a public function and changes one flag, or the operands
that stand for one (a tensor given or left out as None).
"""

from __future__ import annotations

import re

import pytest
import torch

from kernel_testing import randn


def _recorded_launch(module, call):
    """(kernel, grid, args, kwargs) of the last kernel launch `call()` made (through kernel_runtime, which
    routes the launches of the module's launchers; its plans are cleared so that the launcher runs)."""
    import kernel_runtime

    seen = []
    original = kernel_runtime._launch_kernel

    def record(kernel, grid, *args, **kwargs):
        seen.append((kernel, grid, args, kwargs))
        return original(kernel, grid, *args, **kwargs)

    kernel_runtime._launch_kernel = record
    kernel_runtime.clear_plans(module)
    try:
        call()
    finally:
        kernel_runtime._launch_kernel = original
    kernel, grid, args, kwargs = seen[-1]
    return kernel, grid, list(args), dict(kwargs)


def _rms_norm(gen, monkeypatch):
    import rmsnorm

    x, w = randn((4, 64), torch.bfloat16, gen), randn((64,), torch.bfloat16, gen)
    return rmsnorm, lambda: rmsnorm.rms_norm(x, w)


def _layer_norm(gen, monkeypatch):
    import layernorm

    x = randn((2, 3, 64), torch.bfloat16, gen)
    scale, shift = randn((2, 1, 64), torch.bfloat16, gen), randn((2, 1, 64), torch.bfloat16, gen)
    return layernorm, lambda: layernorm.layer_norm_modulate(x, scale, shift)


def _gelu(gen, monkeypatch):
    import activations

    x = randn((4, 128), torch.bfloat16, gen)[:, :64]  # strided rows: the rows kernel (dense input: a flat one)
    return activations, lambda: activations.gelu_tanh(x)


def _swiglu(gen, monkeypatch):
    import activations

    x = randn((4, 128), torch.bfloat16, gen)
    return activations, lambda: activations.swiglu(x)


def _qk_rope(gen, monkeypatch):
    import qk_norm_rope

    q, k = randn((2, 5, 64), torch.bfloat16, gen), randn((2, 5, 64), torch.bfloat16, gen)
    wq, wk = randn((64,), torch.bfloat16, gen), randn((64,), torch.bfloat16, gen)
    cos, sin = randn((1, 5, 16), torch.float32, gen), randn((1, 5, 16), torch.float32, gen)
    return qk_norm_rope, lambda: qk_norm_rope.ltx_qk_rmsnorm_rope(q, k, wq, wk, 1e-6, cos, sin)


def _skinny(gen, monkeypatch):
    import skinny_gemm

    # always the kernel: on a GPU, rows above the bound measured for its arch go to torch
    monkeypatch.setattr(skinny_gemm, "_KERNEL_MAX_M", {})
    x, w = randn((2, 64), torch.bfloat16, gen), randn((32, 64), torch.bfloat16, gen)
    return skinny_gemm, lambda: skinny_gemm.skinny_gemm(x, w)


CASES = {
    "rms_norm-gate_without_residual": (_rms_norm, {"GATE": "=X"}, "GATE and Y_DENSE need Y"),
    "rms_norm-residual_without_h_out": (_rms_norm, {"Y": "=X"}, "Y and H_OUT come together"),
    "rms_norm-no_out_no_residual": (_rms_norm, {"OUT": None}, "without OUT: only h = x + y * gate"),
    "rms_norm-fp8_mode_3": (_rms_norm, {"FP8_MODE": 3}, "FP8_MODE is 0, 1 or 2"),
    "rms_norm-fp8_without_scale_tensor": (_rms_norm, {"FP8_MODE": 1}, "FP8_SCALE goes with FP8_MODE 1 or 2"),
    "rms_norm-native_fp8_without_fp8": (_rms_norm, {"NATIVE_FP8": True}, "NATIVE_FP8 needs FP8_MODE > 0"),
    "rms_norm-evict_in_two_passes": (
        _rms_norm,
        {"SINGLE_PASS": False, "INPUT_EVICT": "evict_first"},
        "INPUT_EVICT applies to the single pass",
    ),
    "layer_norm-scale_without_shift": (_layer_norm, {"SHIFT": None}, "SCALE and SHIFT come together"),
    "layer_norm-mod2_without_out2": (
        _layer_norm,
        {"SCALE2": "=SCALE", "SHIFT2": "=SHIFT"},
        "SCALE2, SHIFT2, OUT2 come together",
    ),
    "layer_norm-mod2_without_mod": (
        _layer_norm,
        {"SCALE2": "=SCALE", "SHIFT2": "=SHIFT", "OUT2": "=OUT", "SCALE": None, "SHIFT": None},
        "SCALE2 needs SCALE",
    ),
    "layer_norm-nch_2": (_layer_norm, {"NCH": 2}, "NCH is 1, or 3 with SINGLE_PASS"),
    "layer_norm-persistent_two_passes": (
        _layer_norm,
        {"SINGLE_PASS": False, "PERSISTENT": True},
        "PERSISTENT needs SINGLE_PASS",
    ),
    "gelu-act_4": (_gelu, {"ACT": 4}, "ACT is 0 (GELU erf), 1 (GELU tanh), 2 (SiLU) or 3 (none)"),
    "gelu-identity_without_fp8": (_gelu, {"ACT": 3}, "ACT 3 (none) is for FP8 quantisation"),
    "swiglu-row_scales_without_scale_tensor": (_swiglu, {"FP8_MODE": 2}, "FP8_SCALE goes with FP8_MODE 1 or 2"),
    "swiglu-single_pass_without_row_scales": (_swiglu, {"SINGLE_PASS": True}, "SINGLE_PASS needs FP8_MODE 2"),
    "qk_rope-table_width_with_coords": (
        _qk_rope,
        {"COS": None, "SIN": None, "COORDS": "=COS", "FREQS": "=SIN"},
        "TABLE_W applies to tables read, not COORDS",
    ),
    "qk_rope-tables_and_coords": (
        _qk_rope,
        {"COORDS": "=COS", "FREQS": "=SIN"},
        "cos/sin tables or COORDS, one of them",
    ),
    "qk_rope-one_weight": (_qk_rope, {"KW": None}, "QW and KW come together"),
    "qk_rope-odd_table_width": (_qk_rope, {"TABLE_W": 15}, "TABLE_W is even (rotation pairs) and at most BLOCK_C"),
    "skinny-fp8_dot_without_dot": (_skinny, {"USE_DOT": False, "FP8_DOT": True}, "FP8_DOT needs USE_DOT"),
    "skinny-fp8_dot_with_bits": (
        _skinny,
        {"USE_DOT": True, "FP8_DOT": True, "W_BITS": True},
        "FP8_DOT takes FP8 operands, not their bits",
    ),
    "skinny-w_scale_mode_3": (_skinny, {"W_SCALE_MODE": 3}, "W_SCALE_MODE is 0, 1 or 2"),
    "skinny-scale_mode_without_scale": (_skinny, {"W_SCALE_MODE": 1}, "W_SCALE goes with W_SCALE_MODE 1 or 2"),
    "skinny-workspace_without_counters": (_skinny, {"WS": "=OUT"}, "WS and COUNTERS come together"),
}


def _changed(kernel, args, kwargs, change):
    """args and kwargs with the named parameters set as `change` says: a value, or "=NAME" for the
    argument the recorded launch passed as NAME."""
    names = list(kernel.arg_names)
    given = {**dict(zip(names, args)), **kwargs}
    args, kwargs = list(args), dict(kwargs)
    for name, value in change.items():
        if isinstance(value, str) and value.startswith("="):
            value = given[value[1:]]
        if name in kwargs or names.index(name) >= len(args):
            kwargs[name] = value
        else:
            args[names.index(name)] = value
    return args, kwargs


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_flag_combination_is_refused(case, gen, monkeypatch):
    make, change, message = CASES[case]
    module, call = make(gen, monkeypatch)
    kernel, grid, args, kwargs = _recorded_launch(module, call)
    kernel[grid](*args, **kwargs)  # the recorded launch itself compiles and runs
    args, kwargs = _changed(kernel, args, kwargs, change)
    with pytest.raises(Exception, match=re.escape(message)):
        kernel[grid](*args, **kwargs)

# SPDX-License-Identifier: Apache-2.0
"""swiglu (scripts/activations.py): silu(gate) * up from a fused [..., 2H] projection or two [..., H] tensors,
optionally with FP8 output, against float64 references, transformers' Llama / Phi-3 MLP conventions and a float64
quantize-dequantize reference."""

from types import SimpleNamespace

import pytest
import torch

import activations as act
import kernel_testing as kt
from kernel_testing import DEVICE, DTYPES, INTERPRET, assert_close, poisoned_outputs, randn
from test_fused_add_rmsnorm import FP8_DTYPES, FP8_MAX, _fp8_step, check_fp8


def _inputs(shape, dtype, gen):
    # gates over the range where silu bends (and beyond), ups around +-1
    return randn(shape, dtype, gen, scale=3.0)


# ---- fused [..., 2H] and two-tensor forms vs float64 -------------------------------------------
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 127), (1, 2 * 4096), (5, 2 * 2049), (32, 2 * 96), (2, 3, 2 * 33)])
def test_swiglu_fused_matches_float64(shape, dtype, gate_first, gen):
    x = _inputs(shape, dtype, gen)
    with poisoned_outputs():
        out = act.swiglu(x, gate_first=gate_first)
    h = shape[-1] // 2
    assert out.dtype == dtype and out.shape == (*shape[:-1], h) and out.is_contiguous()
    assert_close(out, act.swiglu_ref(x.double(), gate_first=gate_first), dtype, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_two_tensors(dtype, gen):
    gate = _inputs((7, 300), dtype, gen)
    up = _inputs((7, 300), dtype, gen)
    with poisoned_outputs():
        out = act.swiglu(gate, up)
    assert_close(out, act.swiglu_ref(gate.double(), up.double()), dtype, seed=gen.seed_value)
    # the same numbers as the fused form with the halves concatenated
    assert torch.equal(out, act.swiglu(torch.cat([gate, up], -1)))
    assert torch.equal(out, act.swiglu(torch.cat([up, gate], -1), gate_first=False))


def test_swiglu_strided_rows(gen):
    """Views read in place: rows of a wider buffer, transposed leading dims, and gate/up with different
    layouts (one contiguous, one transposed) sharing one row indexing."""
    dtype = torch.bfloat16
    wide = _inputs((6, 2 * 130 + 10), dtype, gen)
    x = wide[:, 10:]  # a [..., 2H] view whose rows are strided
    with poisoned_outputs():
        out = act.swiglu(x)
    assert_close(out, act.swiglu_ref(x.double()), dtype, seed=gen.seed_value)
    gate = _inputs((3, 5, 64), dtype, gen)
    up = _inputs((5, 3, 64), dtype, gen).transpose(0, 1)
    with poisoned_outputs():
        out = act.swiglu(gate, up)
    assert_close(out, act.swiglu_ref(gate.double(), up.double()), dtype, seed=gen.seed_value)
    gate_t = _inputs((5, 3, 64), dtype, gen).transpose(0, 1)
    up_s = _inputs((3, 5, 128), dtype, gen)[..., 64:]
    with poisoned_outputs():
        q, s = act.swiglu(gate_t, up_s, fp8="per_token")
    q_ref, s_ref = act.fp8_quantize_ref(act.swiglu_ref(gate_t.double(), up_s.double()), q.dtype)
    check_fp8(q, q_ref, q.dtype, "strided per_token", gen.seed_value)
    assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, seed=gen.seed_value)


def test_large_magnitudes_overflow_safe(gen):
    """|gate| up to 1e4: silu(x) == x for large x and -0.0 for very negative x; no NaN, no inf."""
    n = 4096
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    g = sign * 10 ** (4 * torch.rand(n, generator=gen))
    u = torch.randn(n, generator=gen)
    for dtype in DTYPES:
        gate, up = g.to(DEVICE, dtype), u.to(DEVICE, dtype)
        with poisoned_outputs():
            out = act.swiglu(gate[None], up[None])
        assert torch.isfinite(out).all()
        assert_close(out, act.swiglu_ref(gate.double(), up.double())[None], dtype, seed=gen.seed_value)


# ---- against transformers' conventions ------------------------------------------------------------
def test_matches_llama_mlp_activation_bf16(gen):
    """LlamaMLP: act_fn(gate_proj(x)) * up_proj(x) with act_fn = ACT2FN['silu']. torch rounds silu(gate) to
    bf16 and then the product (two roundings); the kernel rounds once: within 2 bf16 ulps (3 in the
    interpreter, whose final cast truncates)."""
    from transformers.activations import ACT2FN

    gate = _inputs((9, 1000), torch.bfloat16, gen)
    up = _inputs((9, 1000), torch.bfloat16, gen)
    expected = ACT2FN["silu"](gate) * up
    with poisoned_outputs():
        out = act.swiglu(gate, up)
    ulp = expected.float().abs().clamp_min(2.0**-126) * 2.0**-7
    diff = (out.float() - expected.float()).abs()
    ulps = 3 if INTERPRET else 2
    assert bool((diff <= ulps * ulp).all()), (
        f"max diff {diff.max().item()} exceeds {ulps} bf16 ulps (seed {gen.seed_value})"
    )


def test_matches_phi3_fused_gate_up_convention(gen):
    """transformers' Phi3MLP: gate, up = gate_up_proj(x).chunk(2, -1); up * act(gate): the first half is the gate."""
    from transformers.models.phi3.configuration_phi3 import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    cfg = Phi3Config(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = Phi3MLP(cfg).to(DEVICE, torch.float32).requires_grad_(False)  # the kernels have no backward
    x = _inputs((4, 64), torch.float32, gen)
    gate_up = mlp.gate_up_proj(x)
    with poisoned_outputs():
        h = act.swiglu(gate_up)
    assert_close(mlp.down_proj(h), mlp(x).double(), torch.float32, rtol=1e-5, atol=1e-5, seed=gen.seed_value)


# ---- FP8 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 4096), (32, 2 * 1024), (3, 2 * 2049), (2, 2, 2 * 127)])
def test_fp8_per_token(shape, dtype, fp8_dtype, gen):
    x = _inputs(shape, dtype, gen)
    with poisoned_outputs():
        q, s = act.swiglu(x, fp8="per_token", fp8_dtype=fp8_dtype)
    assert q.shape == (*shape[:-1], shape[-1] // 2) and s.shape == shape[:-1] and s.dtype == torch.float32
    y_ref = act.swiglu_ref(x.double())
    q_ref, s_ref = act.fp8_quantize_ref(y_ref, fp8_dtype)
    assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, name="scales", seed=gen.seed_value)
    check_fp8(q, q_ref, fp8_dtype, f"per_token {dtype}", gen.seed_value)
    deq = q.double() * s.double()[..., None]
    assert bool(((deq - y_ref).abs() <= _fp8_step(q_ref, fp8_dtype) * s_ref[..., None] * 1.0001).all())
    assert torch.equal(
        q.double().abs().amax(-1), torch.full(s.shape, FP8_MAX[fp8_dtype], dtype=torch.float64, device=q.device)
    )


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_per_tensor(dtype, fp8_dtype, gen):
    gate = _inputs((16, 1000), dtype, gen)
    up = _inputs((16, 1000), dtype, gen)
    sc = torch.tensor([4.0 / FP8_MAX[fp8_dtype]], dtype=torch.float32, device=DEVICE)  # saturates the largest
    with poisoned_outputs():
        q = act.swiglu(gate, up, fp8="per_tensor", fp8_scale=sc, fp8_dtype=fp8_dtype)
    q_ref, _ = act.fp8_quantize_ref(act.swiglu_ref(gate.double(), up.double()), fp8_dtype, sc.double())
    check_fp8(q, q_ref, fp8_dtype, f"per_tensor {dtype}", gen.seed_value)
    assert (q.double().abs() == FP8_MAX[fp8_dtype]).any()


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_fp8_saturation_no_nan(fp8_dtype, gen):
    x = randn((4, 2 * 256), torch.bfloat16, gen, scale=1e3)
    fmax = FP8_MAX[fp8_dtype]
    y = act.swiglu_ref(x.double())
    for scale in (1.0, 1e-30, 0.0):
        sc = torch.tensor(scale, dtype=torch.float32, device=DEVICE)
        with poisoned_outputs():
            q = act.swiglu(x, fp8="per_tensor", fp8_scale=sc, fp8_dtype=fp8_dtype).double()
        assert not torch.isnan(q).any() and bool((q.abs() <= fmax).all())
        # the kernel multiplies by 1 / scale capped at 3e38; values near fp32's subnormal range are left out
        big = (y.abs() * min(1 / scale if scale else float("inf"), 3e38) > 1.01 * fmax) & (y.abs() > 1e-30)
        assert big.any() and bool((q[big].abs() == fmax).all()) and torch.equal(torch.sign(q[big]), torch.sign(y[big]))
    q, s = act.swiglu(x, fp8="per_token", fp8_dtype=fp8_dtype)
    assert not torch.isnan(q.double()).any() and torch.isfinite(s).all()


def test_fp8_per_token_zero_row():
    x = torch.zeros((2, 2 * 64), device=DEVICE)
    x[1] = 1.0
    with poisoned_outputs():
        q, s = act.swiglu(x, fp8="per_token")
    assert not torch.isnan(q.double()).any() and float(s[0]) == pytest.approx(1e-12)
    assert bool((q.double()[0] == 0).all()) and bool((q.double()[1] == FP8_MAX[q.dtype]).all())


@pytest.mark.parametrize("h", [127, 300])
def test_fp8_per_token_two_pass_rows(h, gen, monkeypatch):
    """Rows wider than one block: a pass for the row maximum, then one that quantises. Shrink the limits
    to exercise it cheaply."""
    monkeypatch.setattr(act, "_MAX_WHOLE_ROW", 64)
    monkeypatch.setattr(act, "_ROW_CHUNK", 32)
    x = _inputs((5, 2 * h), torch.float32, gen)
    with poisoned_outputs():
        q, s = act.swiglu(x, fp8="per_token", fp8_dtype=torch.float8_e4m3fnuz)
    q_ref, s_ref = act.fp8_quantize_ref(act.swiglu_ref(x.double()), torch.float8_e4m3fnuz)
    check_fp8(q, q_ref, torch.float8_e4m3fnuz, "two-pass per_token", gen.seed_value)
    assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, seed=gen.seed_value)


@pytest.mark.parametrize("warp_size", [32, 64])
def test_whole_row_config_fits_a_workgroup(warp_size):
    """Per-token FP8 rows are whole-row programs: the block covers the row (single pass) or the chunk,
    and the lanes per program never exceed 1024 (the workgroup limit on AMD and NVIDIA), for every
    width up to past the single-pass limit and several row counts."""
    widths = sorted(
        {1, 2, 3, 64, 127, 1000, 4096, 8191, 8192, 14336, 16384, 16385, 28672} | {1 << k for k in range(15)}
    )
    for h in widths:
        for m in (1, 5, 32, 1024, 4096):
            block_m, block_n, single, warps = act._whole_row_config(h, m, warp_size, act._MAX_WHOLE_ROW, act._ROW_CHUNK)
            assert 1 <= warps and warps * warp_size <= 1024, (h, m, warps)
            assert warps & (warps - 1) == 0, (h, m, warps)  # Triton needs a power of two
            assert single == (h <= act._MAX_WHOLE_ROW), (h, m)
            assert (block_n >= h) if single else (block_n == act._ROW_CHUNK), (h, m, block_n)
            assert block_m >= 1 and block_m * block_n <= max(4096, block_n), (h, m, block_m)


class _LaunchSpy:
    """Stands in for act._act_rows_kernel: records each launch's grid and constexprs, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((grid, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.mark.parametrize("max_grid_y", [65535, 2])
@pytest.mark.parametrize("mode", [None, "per_tensor", "per_token"])
@pytest.mark.parametrize("shape", [(1, 2 * 4096), (4, 2 * 512), (5, 2 * 2049), (3, 2 * 96)])
def test_row_kernel_grid_and_mask_paths(shape, mode, max_grid_y, gen, monkeypatch):
    """The row kernel's four paths agree with float64: a 2D grid or, past the grid's second-dimension
    limit (lowered here to 2), a 1D grid that divides the program id; and tiles that fit the tensor
    exactly (no masks, EVEN) or overhang it. The spy checks that each case took the path it should."""
    monkeypatch.setattr(act, "_MAX_GRID_Y", max_grid_y)
    spy = _LaunchSpy(act._act_rows_kernel)
    monkeypatch.setattr(act, "_act_rows_kernel", spy)
    dtype = torch.bfloat16
    x = _inputs(shape, dtype, gen)
    ref = act.swiglu_ref(x.double())
    with poisoned_outputs():
        if mode is None:
            out = act.swiglu(x)
            assert_close(out, ref, dtype, seed=gen.seed_value)
        elif mode == "per_tensor":
            scale = torch.tensor([float(ref.abs().max()) / FP8_MAX[torch.float8_e4m3fn]], device=DEVICE)
            q = act.swiglu(x, fp8="per_tensor", fp8_scale=scale, fp8_dtype=torch.float8_e4m3fn)
            q_ref, _ = act.fp8_quantize_ref(ref, torch.float8_e4m3fn, scale.double())
            check_fp8(q, q_ref, torch.float8_e4m3fn, "per_tensor", gen.seed_value)
        else:
            q, s = act.swiglu(x, fp8="per_token", fp8_dtype=torch.float8_e4m3fn)
            q_ref, s_ref = act.fp8_quantize_ref(ref, torch.float8_e4m3fn)
            check_fp8(q, q_ref, torch.float8_e4m3fn, "per_token", gen.seed_value)
            assert_close(s, s_ref, torch.float32, rtol=1e-5, atol=0, seed=gen.seed_value)
    ((grid, kw),) = spy.launches
    m, h = shape[0], shape[1] // 2
    n_row_blocks = -(-m // kw["BLOCK_M"])
    n_col_blocks = 1 if mode == "per_token" else -(-h // kw["BLOCK_N"])
    assert kw["GRID_2D"] == (n_row_blocks <= max_grid_y)
    assert grid == ((n_col_blocks, n_row_blocks) if kw["GRID_2D"] else (n_row_blocks * n_col_blocks,))
    assert kw["EVEN"] == (m % kw["BLOCK_M"] == 0 and h % kw["BLOCK_N"] == 0)
    assert kw["EVEN"] == (shape in ((1, 2 * 4096), (4, 2 * 512)))  # both paths are exercised


@pytest.mark.parametrize("warp_size", [32, 64])
def test_row_launch_config(warp_size):
    """Row-kernel blocks for the (non-per-token) SwiGLU / GEGLU launches: powers of two, at most 256
    lanes, never more outputs than the row has, one 16-byte vector per lane and operand (2048 bf16
    outputs) for large inputs, down to 4 bytes per lane (512) while the grid has fewer than
    _MIN_ROW_PROGRAMS programs, and narrow rows packed to the same budget."""
    for m, h, want in [
        (1, 4096, (1, 512)),
        (32, 4096, (1, 512)),
        (32, 8192, (1, 1024)),
        (32, 16384, (1, 2048)),
        (1024, 4096, (1, 2048)),
        (4096, 14336, (1, 2048)),
        (4096, 64, (16, 64)),
        (65536, 64, (32, 64)),
        (1, 64, (1, 64)),
        (3, 100, (4, 128)),
    ]:
        block_m, block_n, warps = act._launch_config(m * h, h, 2, warp_size, flat=False)
        assert (block_m, block_n) == want, (m, h, block_m, block_n)
        assert warps & (warps - 1) == 0 and 1 <= warps * warp_size <= 256, (m, h, warps)
        assert warps * warp_size <= max(block_m * block_n, warp_size), (m, h, warps)
    # fp32: the same bytes per lane, half the elements
    assert act._launch_config(1024 * 4096, 4096, 4, warp_size, flat=False)[:2] == (1, 1024)
    assert act._launch_config(4096, 4096, 4, warp_size, flat=False)[:2] == (1, 256)


def test_default_fp8_dtype_here():
    q = act.swiglu(torch.ones((2, 64), device=DEVICE), fp8="per_token")[0]
    assert q.dtype == act._fp8_dtype_for(torch.device(DEVICE))


# ---- empty, errors, custom op -------------------------------------------------------------------------
def test_empty_inputs():
    x = torch.empty((0, 64), device=DEVICE, dtype=torch.bfloat16)
    assert act.swiglu(x).shape == (0, 32)
    q, s = act.swiglu(x, fp8="per_token")
    assert q.shape == (0, 32) and s.shape == (0,)
    assert act.swiglu(torch.empty((3, 0), device=DEVICE)).shape == (3, 0)
    assert act.swiglu(x[:, :32], x[:, 32:]).shape == (0, 32)


def _error_inputs(gen):
    return SimpleNamespace(gen=gen, x=randn((4, 64), torch.float32, gen), sc=torch.ones(1, device=DEVICE))


def _three_row_levels(t):
    """A layout that needs more than two row levels (gate and up disagree)."""
    g = randn((4, 3, 5, 8), torch.float32, t.gen).permute(1, 0, 2, 3)[:, :, ::2]
    u = randn((3, 4, 3, 8), torch.float32, t.gen)
    act.swiglu(g, u)


ERROR_CASES = [
    ("odd last dim", ValueError, "the last dim of x must be even", lambda t: act.swiglu(t.x[:, :63])),
    ("x not a tensor", TypeError, "x must be a torch.Tensor", lambda t: act.swiglu([1.0, 2.0])),
    (
        "x int32",
        TypeError,
        "x has dtype int32",
        lambda t: act.swiglu(torch.ones((2, 4), dtype=torch.int32, device=DEVICE)),
    ),
    ("x 0-d", ValueError, "x must have at least one dimension", lambda t: act.swiglu(torch.tensor(1.0, device=DEVICE))),
    (
        "x last stride",
        ValueError,
        "x must be contiguous in its last dimension",
        lambda t: act.swiglu(randn((64, 4), torch.float32, t.gen).t()),
    ),
    (
        "up shape",
        ValueError,
        r"up has shape \(4, 31\) but gate has shape \(4, 32\)",
        lambda t: act.swiglu(t.x[:, :32], t.x[:, 33:]),
    ),
    (
        "up dtype",
        TypeError,
        "up has dtype torch.float16 but gate has dtype torch.float32",
        lambda t: act.swiglu(t.x[:, :32], t.x[:, 32:].half()),
    ),
    (
        "up int64",
        TypeError,
        "up has dtype int64",
        lambda t: act.swiglu(t.x[:, :32], torch.ones((4, 32), dtype=torch.int64, device=DEVICE)),
    ),
    (
        "up last stride",
        ValueError,
        "up must be contiguous in its last dimension",
        lambda t: act.swiglu(t.x[:, :4], randn((4, 4), torch.float32, t.gen).t()),
    ),
    (
        "gate_first with up",
        ValueError,
        "gate_first applies to the fused",
        lambda t: act.swiglu(t.x[:, :32], t.x[:, 32:], gate_first=False),
    ),
    ("fp8 mode", ValueError, "fp8 must be None, 'per_tensor' or 'per_token'", lambda t: act.swiglu(t.x, fp8="dynamic")),
    ("per_tensor without scale", ValueError, "needs fp8_scale", lambda t: act.swiglu(t.x, fp8="per_tensor")),
    (
        "per_token with scale",
        ValueError,
        "fp8_scale is only used with fp8='per_tensor'",
        lambda t: act.swiglu(t.x, fp8="per_token", fp8_scale=t.sc),
    ),
    (
        "fp8_scale shape",
        ValueError,
        r"fp8_scale must hold one element .* got shape \(1, 2\)",
        lambda t: act.swiglu(t.x, fp8="per_tensor", fp8_scale=torch.ones((1, 2), device=DEVICE)),
    ),
    (
        "fp8_scale bfloat16",
        TypeError,
        "fp8_scale has dtype bfloat16; expected one of float32",
        lambda t: act.swiglu(t.x, fp8="per_tensor", fp8_scale=torch.ones(1, device=DEVICE, dtype=torch.bfloat16)),
    ),
    (
        "fp8_dtype bfloat16",
        TypeError,
        "fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz",
        lambda t: act.swiglu(t.x, fp8="per_token", fp8_dtype=torch.bfloat16),
    ),
    (
        "fp8_dtype without fp8",
        ValueError,
        "fp8_dtype is only used with",
        lambda t: act.swiglu(t.x, fp8_dtype=torch.float8_e4m3fn),
    ),
    ("rows need three levels", ValueError, "cannot be addressed", _three_row_levels),
]


@kt.error_cases(ERROR_CASES)
def test_errors(case, gen):
    kt.assert_error_case(case, _error_inputs(gen))


def test_custom_op_under_torch_compile(gen):
    x = _inputs((3, 2 * 64), torch.float32, gen)
    sc = torch.tensor([0.05], device=DEVICE)

    def f(x, sc):
        y = act.swiglu(x)
        q, s = act.swiglu(x, fp8="per_token")
        q1 = act.swiglu(x[:, :64], x[:, 64:], fp8="per_tensor", fp8_scale=sc)
        return y + q.float() * s[:, None] + q1.float() * sc

    compiled = kt.compile_aot_eager(f)
    assert torch.equal(compiled(x, sc), f(x, sc))
    torch._dynamo.reset()
    op = getattr(torch.ops, act._NS).swiglu.default
    for args in [
        (x, None, True, 0, None, None),
        (x, None, False, 2, None, torch.float8_e4m3fnuz),
        (x[:, :64], x[:, 64:], True, 1, sc, None),
    ]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

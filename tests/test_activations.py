# SPDX-License-Identifier: Apache-2.0
"""Tests for scripts/activations.py: gelu (tanh and erf forms), geglu and gelu_mul (GeGLU of two tensors)
against float64 references, torch.nn.functional.gelu, diffusers' GELU/GEGLU modules and transformers' Gemma
MLP, on fresh random inputs."""

import math

import pytest
import torch

import activations as act
import kernel_testing as kt
from kernel_testing import DEVICE, DTYPES, TOL, assert_close, make_generator, poisoned_outputs, randn

APPROX = ["tanh", "none"]


def _check_gelu(x, approximate, seed, name="gelu"):
    with poisoned_outputs():
        out = act.gelu(x, approximate)
    assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
    assert_close(out, act.gelu_ref(x.double(), approximate), x.dtype, name=f"{name}[{approximate}]", seed=seed)
    return out


def _check_geglu(x, approximate, seed, name="geglu"):
    with poisoned_outputs():
        out = act.geglu(x, approximate)
    h = x.shape[-1] // 2
    assert out.dtype == x.dtype and out.shape == (*x.shape[:-1], h) and out.is_contiguous()
    assert_close(out, act.geglu_ref(x.double(), approximate), x.dtype, name=f"{name}[{approximate}]", seed=seed)
    return out


def _signed_logspace(n, lo_exp, hi_exp, gen):
    """n values with |x| log-uniform in [10**lo_exp, 10**hi_exp] and random signs (float64)."""
    mag = 10.0 ** (lo_exp + (hi_exp - lo_exp) * torch.rand(n, generator=gen, dtype=torch.float64))
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    return sign * mag


# ------------------------------------------------------------------------------------------
# gelu: contiguous inputs (flat kernel)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (127,), (2049,), (3 * 1000 + 7,), (4096,), (3, 5, 7), (2, 33, 64)])
def test_gelu_contiguous(shape, dtype, approximate):
    g = make_generator()
    x = randn(shape, dtype, g, scale=3.0)
    _check_gelu(x, approximate, g.seed_value)


def test_gelu_scalar_and_alias():
    g = make_generator()
    x = randn((), torch.float32, g, scale=2.0)
    _check_gelu(x, "tanh", g.seed_value)
    y = randn((5, 9), torch.bfloat16, g)
    with poisoned_outputs():
        out = act.gelu_tanh(y)
    assert_close(out, act.gelu_ref(y.double(), "tanh"), torch.bfloat16, seed=g.seed_value)


def test_gelu_default_is_tanh():
    g = make_generator()
    x = randn((257,), torch.float32, g, scale=3.0)
    assert_close(act.gelu(x), act.gelu_ref(x.double(), "tanh"), torch.float32, seed=g.seed_value)


# ------------------------------------------------------------------------------------------
# gelu: strided rows (row kernel, read in place)
# ------------------------------------------------------------------------------------------
def _strided_views(g, dtype):
    """Views whose last dim is contiguous but which are not contiguous, and what they test."""
    wide = randn((7, 2 * 2049 + 3), dtype, g, scale=3.0)
    base3 = randn((4, 6, 131), dtype, g, scale=3.0)
    row = randn((1, 1, 37), dtype, g, scale=3.0)
    big = randn((3, 5, 4, 24), dtype, g, scale=3.0)
    return {
        "column slice, 2 column blocks": wide[:, 5 : 5 + 2049],
        "every other row": wide[::2, :100],
        "transposed leading dims": base3.transpose(0, 1),
        "broadcast rows (stride 0)": row.expand(3, 4, 37),
        "sliced 4-d": big[:, 1:4, :, 3:20],
        "narrow rows packed per program": base3[:, :, :3],
    }


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_strided_rows(dtype, approximate):
    g = make_generator()
    for what, x in _strided_views(g, dtype).items():
        assert not x.is_contiguous() and x.stride(-1) == 1
        _check_gelu(x, approximate, g.seed_value, name=f"gelu {what}")


# ------------------------------------------------------------------------------------------
# gelu: large magnitudes, overflow safety
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_large_magnitudes(dtype, approximate):
    g = make_generator()
    vals = _signed_logspace(2000, 0.0, 4.0, g)  # |x| in [1, 1e4]
    if dtype == torch.float32:
        vals = torch.cat([vals, _signed_logspace(500, 4.0, 30.0, g), torch.tensor([3.0e38, -3.0e38, 1e13, -1e13])])
    x = vals.to(DEVICE, dtype)
    out = _check_gelu(x, approximate, g.seed_value, name="gelu large |x|")
    o = out.cpu()
    xs = x.cpu()
    assert torch.isfinite(o).all(), f"non-finite outputs for finite inputs (seed {g.seed_value})"
    # Far in the tails the factor is exactly 1 or 0: gelu(x) == x, gelu(-x) == -0.0 (as torch gives).
    pos, neg = xs >= 20, xs <= -20
    assert torch.equal(o[pos], xs[pos]), f"gelu(x) != x for large positive x (seed {g.seed_value})"
    assert (o[neg] == 0).all() and torch.signbit(o[neg]).all(), (
        f"gelu(x) is not -0.0 for large negative x (seed {g.seed_value})"
    )


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf * 0 in numpy
@pytest.mark.parametrize("approximate", APPROX)
def test_gelu_special_values(approximate):
    """inf, -inf, nan, +-0 behave as in torch.nn.functional.gelu (which gives nan for -inf)."""
    x = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-30, -1e-30], dtype=torch.float32)
    with poisoned_outputs():
        out = act.gelu(x.to(DEVICE), approximate).cpu()
    ref = act.gelu_ref(x.double(), approximate).float()
    assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"got {out.tolist()}, torch gives {ref.tolist()}"
    fin = ~torch.isnan(ref)
    assert torch.allclose(out[fin], ref[fin], rtol=1e-6, atol=0), f"got {out.tolist()}, torch gives {ref.tolist()}"


# ------------------------------------------------------------------------------------------
# gelu vs torch / diffusers in the working dtype
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_matches_torch_and_diffusers(dtype, approximate):
    GELU = pytest.importorskip("diffusers.models.activations").GELU

    g = make_generator()
    x = randn((3, 97), dtype, g, scale=3.0)
    module = GELU(97, 97, approximate=approximate).to(DEVICE, dtype)
    with poisoned_outputs():
        out = act.gelu(x, approximate)
    with torch.no_grad():
        ref_module = module.gelu(x)
    ref_torch = torch.nn.functional.gelu(x, approximate=approximate)
    # Both round once from fp32 (the interpreter truncates bf16: 1 ulp): 2x the float64 tolerance.
    tol = {k: 2 * v for k, v in TOL[dtype].items()}
    assert_close(out, ref_module, dtype, **tol, name="vs diffusers GELU.gelu", seed=g.seed_value)
    assert_close(out, ref_torch, dtype, **tol, name="vs torch gelu", seed=g.seed_value)


# ------------------------------------------------------------------------------------------
# geglu
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2,), (1, 2), (3, 2 * 127), (2, 5, 2 * 2049), (4, 2 * 64)])
def test_geglu(shape, dtype, approximate):
    g = make_generator()
    x = randn(shape, dtype, g, scale=3.0)
    _check_geglu(x, approximate, g.seed_value)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_strided_rows(dtype, approximate):
    g = make_generator()
    wide = randn((6, 2 * 2 * 131 + 5), dtype, g, scale=3.0)
    base = randn((4, 3, 2 * 33), dtype, g, scale=3.0)
    views = {
        "column slice, odd H": wide[:, 3 : 3 + 2 * 131],
        "every other row": wide[::2, : 2 * 100],
        "transposed leading dims": base.transpose(0, 1),
        "broadcast rows": randn((1, 2 * 9), dtype, g, scale=3.0).expand(5, 2 * 9),
        # contiguous, but the size-1 dim carries an arbitrary stride
        "odd stride on a size-1 dim": randn((4 * 2 * 10,), dtype, g, scale=3.0).as_strided((4, 1, 20), (20, 999, 1)),
        "single strided row": wide[1:2, 2 : 2 + 2 * 7],
    }
    for what, x in views.items():
        assert x.stride(-1) == 1
        _check_geglu(x, approximate, g.seed_value, name=f"geglu {what}")


@pytest.mark.parametrize("max_grid_y", [65535, 1])
@pytest.mark.parametrize("shape", [(3, 2 * 2048), (5, 2 * 700)])
def test_row_kernel_one_dimensional_grid_fallback(shape, max_grid_y, monkeypatch):
    """GEGLU and GELU of strided rows on both grids of the row kernel: (column blocks, row blocks), and
    the one-dimensional grid used past the second dimension's limit (lowered here to 1), with tiles that
    fit the tensor exactly (3 x 2048) and tiles that overhang it (5 x 700); row and column block counts
    differ, so a swapped program-id split would miss tiles."""
    monkeypatch.setattr(act, "_MAX_GRID_Y", max_grid_y)
    gen = make_generator()
    x = randn(shape, torch.bfloat16, gen, scale=3.0)
    _check_geglu(x, "none", gen.seed_value)
    _check_gelu(x[..., : shape[-1] // 2], "tanh", gen.seed_value, name="gelu strided rows")
    block_m, block_n, _ = act._launch_config(x.numel() // 2, shape[-1] // 2, 2, 32, flat=False)
    n_row_blocks = -(-shape[0] // block_m)
    assert act._row_grid(shape[0], 2 * block_n, block_m, block_n)[1] == (n_row_blocks <= max_grid_y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_large_magnitudes(dtype):
    g = make_generator()
    n = 600
    value = randn((n,), torch.float32, g, device="cpu").double()
    gate = _signed_logspace(n, 0.0, 4.0, g)
    x = torch.cat([value, gate]).to(DEVICE, dtype)
    for approximate in APPROX:
        out = _check_geglu(x, approximate, g.seed_value, name="geglu large gate")
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_matches_diffusers_module(dtype):
    """diffusers GEGLU(x) == geglu(GEGLU.proj(x)): same halves, same (erf) GELU."""
    GEGLU = pytest.importorskip("diffusers.models.activations").GEGLU

    g = make_generator()
    torch.manual_seed(g.seed_value)
    module = GEGLU(24, 37).to(DEVICE, dtype)
    x = randn((2, 7, 24), dtype, g)
    with torch.no_grad():
        ref = module(x)
        proj = module.proj(x)
    with poisoned_outputs():
        out = act.geglu(proj)  # default approximate matches the module
    tol = {k: 2 * v for k, v in TOL[dtype].items()}
    assert_close(out, ref, dtype, **tol, name="vs diffusers GEGLU", seed=g.seed_value)
    # The gate is the second half: swapping the halves must give a different answer.
    swapped = torch.cat([proj[..., 37:], proj[..., :37]], dim=-1)
    assert not torch.allclose(act.geglu(swapped).float(), ref.float(), atol=1e-2)


# ------------------------------------------------------------------------------------------
# gelu_mul: gelu(gate) * up of two tensors
# ------------------------------------------------------------------------------------------
def _check_gelu_mul(gate, up, approximate, seed, name="gelu_mul"):
    with poisoned_outputs():
        out = act.gelu_mul(gate, up, approximate)
    assert out.dtype == gate.dtype and out.shape == gate.shape and out.is_contiguous()
    # independent float64 reference: torch's GELU formula on the gate, times up
    g64, u64 = gate.double(), up.double()
    if approximate == "tanh":
        ref = 0.5 * g64 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64**3))) * u64
    else:
        ref = 0.5 * g64 * (1 + torch.erf(g64 / math.sqrt(2))) * u64
    assert_close(out, ref, gate.dtype, name=f"{name}[{approximate}]", seed=seed)
    return out


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (1, 127), (3, 2049), (2, 5, 96), (32, 64)])
def test_gelu_mul(shape, dtype, approximate):
    g = make_generator()
    gate, up = randn(shape, dtype, g, scale=3.0), randn(shape, dtype, g, scale=2.0)
    _check_gelu_mul(gate, up, approximate, g.seed_value)


def test_gelu_mul_default_is_tanh_and_matches_geglu():
    """The default is the tanh GELU (Gemma's); the numbers are geglu's with the halves concatenated [up | gate]
    (one kernel, one rounding), and the operands are not interchangeable."""
    g = make_generator()
    gate, up = randn((7, 300), torch.bfloat16, g, scale=3.0), randn((7, 300), torch.bfloat16, g, scale=3.0)
    with poisoned_outputs():
        out = act.gelu_mul(gate, up)
    assert_close(out, act.gelu_mul_ref(gate.double(), up.double(), "tanh"), torch.bfloat16, seed=g.seed_value)
    assert torch.equal(out, act.geglu(torch.cat([up, gate], -1), "tanh"))
    assert torch.equal(act.gelu_mul(gate, up, "none"), act.geglu(torch.cat([up, gate], -1), "none"))
    assert not torch.allclose(act.gelu_mul(up, gate).float(), out.float(), atol=1e-2)


@pytest.mark.parametrize("approximate", APPROX)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul_strided_rows(dtype, approximate):
    """Views read in place: halves of one buffer, rows of a wider buffer, transposed leading dims, a broadcast
    up, and gate / up with different layouts sharing one row indexing."""
    g = make_generator()
    wide = randn((6, 2 * 131 + 5), dtype, g, scale=3.0)
    a = randn((3, 5, 64), dtype, g, scale=3.0)
    b = randn((5, 3, 64), dtype, g, scale=3.0).transpose(0, 1)
    c = randn((3, 5, 128), dtype, g, scale=3.0)[..., 64:]
    pairs = {
        "halves of one buffer": (wide[:, 5 : 5 + 131], wide[:, 5 + 131 :]),
        "every other row": (wide[::2, :100], wide[1::2, 100:200]),
        "transposed up": (a, b),
        "transposed gate, sliced up": (b, c),
        "broadcast up (stride 0)": (a, randn((1, 1, 64), dtype, g, scale=3.0).expand(3, 5, 64)),
    }
    for what, (gate, up) in pairs.items():
        assert gate.stride(-1) == 1 and up.stride(-1) == 1 and not (gate.is_contiguous() and up.is_contiguous())
        _check_gelu_mul(gate, up, approximate, g.seed_value, name=f"gelu_mul {what}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_mul_large_magnitudes(dtype):
    g = make_generator()
    gate = _signed_logspace(600, 0.0, 4.0, g).to(DEVICE, dtype)  # |gate| in [1, 1e4]
    up = randn((600,), dtype, g)
    for approximate in APPROX:
        out = _check_gelu_mul(gate[None], up[None], approximate, g.seed_value, name="gelu_mul large gate")
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_mul_matches_gemma_mlp(dtype):
    """transformers' Gemma MLP: down_proj(act_fn(gate_proj(x)) * up_proj(x)), act_fn the tanh GELU
    (hidden_activation "gelu_pytorch_tanh"): down_proj(gelu_mul(gate_proj(x), up_proj(x))) gives its output.
    In bf16 torch rounds the GELU and then the product, the kernel once: within twice the bf16 tolerance."""
    from transformers.models.gemma2.configuration_gemma2 import Gemma2Config
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

    g = make_generator()
    torch.manual_seed(g.seed_value)
    cfg = Gemma2Config(hidden_size=64, intermediate_size=96, hidden_activation="gelu_pytorch_tanh")
    mlp = Gemma2MLP(cfg).to(DEVICE, dtype).requires_grad_(False)
    x = randn((2, 5, 64), dtype, g)
    with torch.no_grad():
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        ref = mlp.act_fn(gate) * up
        with poisoned_outputs():
            h = act.gelu_mul(gate, up)
        out, want = mlp.down_proj(h), mlp(x)
    tol = {k: 2 * v for k, v in TOL[dtype].items()}
    assert_close(h, ref, dtype, **tol, name="vs act_fn(gate) * up", seed=g.seed_value)
    assert_close(out, want, dtype, **tol, name="vs Gemma2MLP", seed=g.seed_value)


# ------------------------------------------------------------------------------------------
# Empty inputs, errors, custom ops
# ------------------------------------------------------------------------------------------
def test_empty_inputs():
    for shape in [(0,), (3, 0, 5), (4, 0)]:
        x = torch.empty(shape, device=DEVICE, dtype=torch.bfloat16)
        out = act.gelu(x)
        assert out.shape == x.shape and out.dtype == x.dtype
    x = torch.empty((0, 5), device=DEVICE)[:, ::2]  # empty and strided: nothing to check, no error
    assert act.gelu(x).shape == (0, 3)
    assert act.geglu(torch.empty((0, 8), device=DEVICE)).shape == (0, 4)
    assert act.geglu(torch.empty((3, 0), device=DEVICE, dtype=torch.float16)).shape == (3, 0)
    empty = torch.empty((0, 8), device=DEVICE)
    assert act.gelu_mul(empty, empty).shape == (0, 8)
    assert act.gelu_mul(empty[:, :4], empty[:, 4:]).shape == (0, 4)


def _ones(*shape, dtype=None):
    return torch.ones(*shape, dtype=dtype, device=DEVICE)


# Refused by both gelu and geglu: (id, exception, message, call taking the function)
_GELU_AND_GEGLU_ERRORS = [
    ("x int32", TypeError, "x has dtype int32; expected one of", lambda fn: fn(_ones(4, 8, dtype=torch.int32))),
    ("x float64", TypeError, "x has dtype float64", lambda fn: fn(_ones(4, 8).double())),
    ("x not a tensor", TypeError, "x must be a torch.Tensor", lambda fn: fn([1.0, 2.0])),
    *[
        (
            f"approximate={bad!r}",
            ValueError,
            "approximate must be 'none' or 'tanh'",
            lambda fn, bad=bad: fn(_ones(4, 8), bad),
        )
        for bad in ("Tanh", "exact", None, True)
    ],
    ("x transposed", ValueError, "contiguous in its last dimension", lambda fn: fn(_ones(8, 4).t())),
    ("x last stride 2", ValueError, "contiguous in its last dimension", lambda fn: fn(_ones(4, 16)[:, ::2])),
    ("rows need three strides", ValueError, "two strides", lambda fn: fn(_ones(4, 6, 8, 10)[::2, ::2, ::2, :4])),
]

ERROR_CASES = [
    (f"{name} {what}", exc, match, lambda name=name, call=call: call(getattr(act, name)))
    for name in ("gelu", "geglu")
    for what, exc, match, call in _GELU_AND_GEGLU_ERRORS
] + [
    ("geglu odd last dim", ValueError, "last dim of x must be even", lambda: act.geglu(_ones(3, 7))),
    ("geglu x 0-d", ValueError, "at least one dimension", lambda: act.geglu(torch.ones((), device=DEVICE))),
    ("gelu_mul gate not a tensor", TypeError, "gate must be a torch.Tensor", lambda: act.gelu_mul([1.0], _ones(1))),
    ("gelu_mul up not a tensor", TypeError, "up must be a torch.Tensor", lambda: act.gelu_mul(_ones(4, 8), None)),
    (
        "gelu_mul gate int32",
        TypeError,
        "gate has dtype int32; expected one of",
        lambda: act.gelu_mul(_ones(4, 8, dtype=torch.int32), _ones(4, 8)),
    ),
    (
        "gelu_mul up float64",
        TypeError,
        "up has dtype float64; expected one of",
        lambda: act.gelu_mul(_ones(4, 8), _ones(4, 8).double()),
    ),
    (
        "gelu_mul dtypes differ",
        TypeError,
        "up has dtype torch.float16 but gate has dtype torch.float32",
        lambda: act.gelu_mul(_ones(4, 8), _ones(4, 8).half()),
    ),
    (
        "gelu_mul shapes differ",
        ValueError,
        r"up has shape \(4, 7\) but gate has shape \(4, 8\)",
        lambda: act.gelu_mul(_ones(4, 8), _ones(4, 7)),
    ),
    (
        "gelu_mul broadcastable up",
        ValueError,
        r"up has shape \(8,\) but gate has shape \(4, 8\)",
        lambda: act.gelu_mul(_ones(4, 8), _ones(8)),
    ),
    ("gelu_mul 0-d", ValueError, "at least one dimension", lambda: act.gelu_mul(_ones(()), _ones(()))),
    (
        "gelu_mul gate last stride",
        ValueError,
        "gate must be contiguous in its last dimension",
        lambda: act.gelu_mul(_ones(8, 4).t(), _ones(4, 8)),
    ),
    (
        "gelu_mul up last stride 2",
        ValueError,
        "up must be contiguous in its last dimension",
        lambda: act.gelu_mul(_ones(4, 8), _ones(4, 16)[:, ::2]),
    ),
    *[
        (
            f"gelu_mul approximate={bad!r}",
            ValueError,
            "approximate must be 'none' or 'tanh'",
            lambda bad=bad: act.gelu_mul(_ones(4, 8), _ones(4, 8), bad),
        )
        for bad in ("Tanh", "exact", None)
    ],
    (
        "gelu_mul rows need three strides",
        ValueError,
        "two strides",
        lambda: act.gelu_mul(_ones(4, 6, 8, 10)[::2, ::2, ::2, :4], _ones(2, 3, 4, 4)),
    ),
]


@kt.error_cases(ERROR_CASES)
def test_errors(case):
    kt.assert_error_case(case)


def test_cpu_tensor_without_interpreter():
    """Without TRITON_INTERPRET a CPU tensor is refused with a clear message (checked in a fresh
    process: the flag is read when the kernels are decorated)."""
    import os
    from pathlib import Path

    from forked_python import TORCH_TRITON, run_python_forked

    code = (
        "import torch, activations as a\n"
        "for f in (a.gelu, a.geglu, lambda t: a.gelu_mul(t, t)):\n"
        "    try:\n"
        "        f(torch.ones(3, 4))\n"
        "    except ValueError as e:\n"
        "        assert 'x is a CPU tensor' in str(e) or 'gate is a CPU tensor' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no error raised')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    scripts = str(Path(act.__file__).resolve().parent)
    env["PYTHONPATH"] = scripts + os.pathsep + env.get("PYTHONPATH", "")
    # as `python -c code` runs, forked from a process that has imported torch and triton (without the flag)
    r = run_python_forked(["-c", code], preload=TORCH_TRITON, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_custom_ops():
    g = make_generator()
    x = randn((3, 2 * 45), torch.bfloat16, g, scale=3.0)
    ops = getattr(torch.ops, act._NS)
    with poisoned_outputs():
        y = ops.gelu(x, "tanh")
        z = ops.geglu(x, "none")
        w = ops.gelu_mul(x[:, 45:], x[:, :45], "tanh")
    assert_close(y, act.gelu_ref(x.double(), "tanh"), torch.bfloat16, seed=g.seed_value)
    assert_close(z, act.geglu_ref(x.double(), "none"), torch.bfloat16, seed=g.seed_value)
    assert_close(w, act.geglu_ref(x.double(), "tanh"), torch.bfloat16, seed=g.seed_value)
    for op, args in (
        (ops.gelu.default, (x, "tanh")),
        (ops.geglu.default, (x[:, 1:61], "none")),
        (ops.gelu_mul.default, (x[:, 45:], x[:, :45], "tanh")),
        (ops.gelu_mul.default, (x[:, 2:9], x[:, 11:18], "none")),
    ):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_custom_ops():
    """Under torch.compile the public functions go through the registered custom ops (no graph break)."""
    g = make_generator()
    x = randn((4, 2 * 24), torch.float32, g, scale=3.0)

    def f(t):
        return act.gelu(act.geglu(t, "tanh"), "none") + act.gelu_mul(t[:, 24:], t[:, :24])

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    with poisoned_outputs():
        out = compiled(x)
    x64 = x.double()
    ref = act.gelu_ref(act.geglu_ref(x64, "tanh"), "none") + act.gelu_mul_ref(x64[:, 24:], x64[:, :24])
    assert_close(out, ref, torch.float32, seed=g.seed_value)


# ---- inputs requiring grad ------------------------------------------------------------------------
def _grad_cases(gen):
    """Public function -> (call taking a dict of named tensors, the tensors)."""
    f = torch.float32
    x, up = randn((2, 3, 64), f, gen), randn((2, 3, 64), f, gen)
    return {
        "gelu": (lambda t: act.gelu(t["x"]), dict(x=x)),
        "gelu_tanh": (lambda t: act.gelu_tanh(t["x"]), dict(x=x)),
        "geglu": (lambda t: act.geglu(t["x"]), dict(x=x)),
        "swiglu": (lambda t: act.swiglu(t["x"]), dict(x=x)),
        "swiglu(gate, up)": (lambda t: act.swiglu(t["gate"], t["up"]), dict(gate=x, up=up)),
        "gelu_mul": (lambda t: act.gelu_mul(t["gate"], t["up"]), dict(gate=x, up=up)),
        "swiglu(fp8)": (
            lambda t: act.swiglu(t["x"], fp8="per_tensor", fp8_scale=t["fp8_scale"]),
            dict(x=x, fp8_scale=torch.full((1,), 0.5, device=DEVICE)),
        ),
    }


@pytest.mark.parametrize(
    "case", ["gelu", "gelu_tanh", "geglu", "swiglu", "swiglu(gate, up)", "swiglu(fp8)", "gelu_mul"]
)
def test_inputs_requiring_grad_are_refused_in_grad_mode(case):
    from test_launch import assert_refuses_inputs_requiring_grad

    gen = make_generator()
    call, tensors = _grad_cases(gen)[case]
    assert_refuses_inputs_requiring_grad(case.split("(")[0], call, tensors)

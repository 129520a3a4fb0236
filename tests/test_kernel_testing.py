# SPDX-License-Identifier: Apache-2.0
"""The test helpers themselves: poisoning must poison, and must not leak into torch's state."""

import os
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from forked_python import TORCH_TRITON, run_python_forked
from kernel_testing import INTERPRET, poisoned_outputs, run_python


def test_poisoned_outputs_fill_nan_and_restore():
    originals = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
    with poisoned_outputs():
        a = torch.empty(4)
        b = torch.empty_like(a)
        c = a.new_empty(3)
        i = torch.empty(2, dtype=torch.int32)
    assert torch.isnan(a).all() and torch.isnan(b).all() and torch.isnan(c).all()
    assert (i == torch.iinfo(torch.int32).max).all()
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == originals


def test_poisoned_outputs_keep_meta_device_working():
    """Inside the patch, `with torch.device(...)` fills torch's cached set of factory functions; it must
    be filled with the real functions, or later `with torch.device("meta")` allocates real memory."""
    code = (
        "import torch\n"
        "from kernel_testing import poisoned_outputs\n"
        "with poisoned_outputs():\n"
        "    with torch.device('meta'):\n"
        "        torch.zeros(1)\n"
        "with torch.device('meta'):\n"
        "    t = torch.empty(10)\n"
        "assert t.device.type == 'meta', t.device\n"
    )
    tests_dir = str(Path(__file__).resolve().parent)
    # as `python -c code` runs, forked from a process that has imported torch and triton (nothing of them used yet)
    r = run_python_forked(["-c", code], preload=TORCH_TRITON, cwd=tests_dir, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_interpreter_bf16_rounding_matches_torch():
    """interpreter_bf16_round_to_nearest_even: a kernel's fp32 -> bf16 cast gives torch's bits (nearest, ties
    to even, overflow to inf, NaN kept) on values chosen to hit every case; on a GPU the helper is a no-op
    and the hardware's cast must give the same."""
    import triton
    import triton.language as tl

    from kernel_testing import DEVICE, INTERPRET, interpreter_bf16_round_to_nearest_even

    @triton.jit
    def to_bf16(X, Y, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < N
        tl.store(Y + offs, tl.load(X + offs, mask=m).to(tl.bfloat16), mask=m)

    g = torch.Generator().manual_seed(int.from_bytes(__import__("os").urandom(4), "little"))
    normal = torch.randn(4000, generator=g) * torch.logspace(-30, 30, 4000)
    hi = torch.randint(0, 1 << 15, (1000,), generator=g, dtype=torch.int32) << 16
    ties = (hi | 0x8000).view(torch.float32)  # exactly halfway between two bf16 values
    near = torch.cat([(hi | 0x7FFF).view(torch.float32), (hi | 0x8001).view(torch.float32)])
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            3.3895313892515355e38,
            torch.finfo(torch.float32).max,
            torch.finfo(torch.float32).tiny,
            1e-45,
            -1e-45,
        ]
    )
    x = torch.cat([normal, ties, -ties, near, special]).to(DEVICE)
    want = x.to(torch.bfloat16)
    y = torch.full_like(want, float("nan"))
    with interpreter_bf16_round_to_nearest_even():
        to_bf16[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan)
    bad = (y.view(torch.int16) != want.view(torch.int16)) & ~nan
    assert not bad.any(), f"{int(bad.sum())} values differ, e.g. {x[bad][:4].tolist()}"
    if INTERPRET:  # without the helper the interpreter truncates: the ties and the values above them differ
        to_bf16[(1,)](x, y, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
        assert ((y.view(torch.int16) != want.view(torch.int16)) & ~nan).any()


def test_plan_check_reports_a_plan_that_differs(monkeypatch, gen):
    """kernel_runtime.VERIFY_PLANS (set under the interpreter by conftest): a call whose signature has a plan
    records the plain launcher again, and a kept plan that would hand a kernel another argument fails."""
    import kernel_runtime
    import rmsnorm as R
    from kernel_testing import randn

    monkeypatch.setattr(kernel_runtime, "VERIFY_PLANS", True)
    kernel_runtime.clear_plans(R)
    x, w = randn((5, 64), torch.float32, gen), randn((64,), torch.float32, gen)
    R.rms_norm(x, w)
    R.rms_norm(x, w)  # checked: the same plan
    (plan,) = kernel_runtime.plans(R).values()
    kernel, grid, compiled, values, slots = plan.launches[0]
    i = next(i for i, v in enumerate(values) if type(v) is int)
    wrong = values[:i] + (values[i] + 1,) + values[i + 1 :]
    monkeypatch.setattr(plan, "launches", ((kernel, grid, compiled, wrong, slots),))
    with pytest.raises(AssertionError, match="differs from the plan this call makes"):
        R.rms_norm(x, w)


def test_forked_python_runs_as_python_does(tmp_path):
    """forked_python.run_python_forked gives what python itself gives: exit status, stdout and stderr of a
    script and of -c code (sys.argv, sys.path with PYTHONPATH, __name__, the working directory, the
    environment, SystemExit's codes, a traceback, a missing script); nothing of this project is imported
    before the run."""
    show = (
        "import json, os, sys\n"
        "print(json.dumps([sys.argv, sys.path[:2], __name__, os.getcwd(), os.environ.get('X'), "
        "sorted(m for m in ('conftest', 'kernel_testing', 'rmsnorm', 'kernel_runtime') if m in sys.modules)]))\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    (tmp_path / "show.py").write_text(show)
    (tmp_path / "lib").mkdir()
    env = {**os.environ, "X": "7", "PYTHONPATH": str(tmp_path / "lib")}
    for args in (
        [tmp_path / "show.py", "3"],
        ["show.py", "0"],
        ["-c", show, "5"],
        ["-c", "raise ValueError('boom')"],
        ["-c", "import sys; sys.exit('a message')"],
        [tmp_path / "missing.py"],
    ):
        forked = run_python_forked(args, preload=("json",), env=env, cwd=tmp_path, timeout=60)
        plain = run_python(args, env=env, cwd=tmp_path, timeout=60)
        assert (forked.returncode, forked.stdout, forked.stderr) == (plain.returncode, plain.stdout, plain.stderr)


@triton.jit
def _scaled(x, s):
    return x * s


@triton.jit
def _sum_max_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(X + offs, mask=m, other=0.0)
    tl.store(Y + offs, _scaled(x, tl.sum(x, axis=0)) + tl.max(x, axis=0), mask=m)


def _skip_without_speedup():
    import interpreter_speedup

    if interpreter_speedup.NOT_INSTALLED is not None:
        pytest.skip(interpreter_speedup.NOT_INSTALLED)


@pytest.mark.skipif(not INTERPRET, reason="Triton's interpreter's launch path")
def test_interpreter_speedup_is_in_place():
    """conftest.py installed interpreter_speedup's wrappers where this Triton's interpreter is one they were checked
    against. With another, the kernels run through Triton's own interpreter (unchanged, slower) and this test is
    skipped saying what to review: a new Triton release must not turn the suite red through a test speed-up."""
    from triton.runtime import interpreter as ti

    import interpreter_speedup

    _skip_without_speedup()
    assert hasattr(ti._patch_lang, "original") and hasattr(ti.GridExecutor.__call__, "original")
    assert interpreter_speedup.interpreter_fingerprint() in interpreter_speedup.KNOWN_INTERPRETERS


def test_interpreter_speedup_steps_aside_over_an_unknown_interpreter():
    """Over an interpreter whose fingerprint it was not checked against (as after a new Triton release),
    install() leaves Triton's interpreter as it is, says why, and a kernel still runs (through Triton's own)."""
    code = (
        "import os, sys\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import torch, triton, triton.language as tl\n"
        "from triton.runtime import interpreter as ti\n"
        "import interpreter_speedup as s\n"
        "s.KNOWN_INTERPRETERS = {}\n"
        "print(s.install(), hasattr(ti._patch_lang, 'original'), 'not one' in (s.NOT_INSTALLED or ''))\n"
        "@triton.jit\n"
        "def k(X, N, B: tl.constexpr):\n"
        "    o = tl.arange(0, B)\n"
        "    tl.store(X + o, tl.load(X + o, mask=o < N) * 2, mask=o < N)\n"
        "x = torch.arange(5.0)\n"
        "k[(1,)](x, 5, B=8)\n"
        "print(x.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    r = run_python_forked(["-c", code], preload=TORCH_TRITON, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["False", "False", "True", "True"], (r.stdout, r.stderr[-2000:])


@pytest.mark.skipif(not INTERPRET, reason="Triton's interpreter's launch path")
def test_interpreter_swaps_the_language_once_a_launch(monkeypatch):
    """interpreter_speedup.install() (conftest.py runs it): the @triton.jit functions a kernel calls (its own
    helper, tl.sum, tl.max) skip the interpreter's swap of triton.language once their launch has made it, and the
    kernel computes what it computes with Triton's own swap at every call, bit for bit (and its float64 reference);
    after the launch the language is left as Triton leaves it."""
    from triton.runtime import interpreter as ti

    _skip_without_speedup()
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    x = torch.randn(100, generator=g, dtype=torch.float64).float()

    def run():
        y = torch.full_like(x, float("nan"))
        _sum_max_kernel[(4,)](x, y, 100, BLOCK=32)
        return y

    def language_state():
        mods = (tl, tl.core, tl.math, tl.tensor)
        return [(m.__name__, n, tl.core.is_builtin(v)) for m in mods for n, v in sorted(vars(m).items())]

    skipped = ti._patch_lang.skipped
    fast = run()
    assert ti._patch_lang.skipped > skipped, "no call of a @triton.jit function skipped the swap"
    after_fast = language_state()
    monkeypatch.setattr(ti, "_patch_lang", ti._patch_lang.original)
    monkeypatch.setattr(ti.GridExecutor, "__call__", ti.GridExecutor.__call__.original)
    stock = run()
    assert torch.equal(fast, stock)
    assert language_state() == after_fast
    blocks = x.double().split(32)  # the masked tail reads as zeros
    ref = torch.cat([b * b.sum() + torch.nn.functional.pad(b, (0, 32 - len(b))).max() for b in blocks])
    assert torch.allclose(fast.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not INTERPRET, reason="Triton's interpreter's launch path")
def test_interpreter_speedup_in_the_processes_the_tests_start():
    """A Python started with kernel_testing.with_interpreter_speedup(env), plainly or forked (forked_python), has
    interpreter_speedup.install()'s wrappers once it imports Triton's interpreter, also where the script sets
    TRITON_INTERPRET itself before importing the kernels (as the examples do); without it, Triton's own."""
    from forked_python import TORCH_TRITON, run_python_forked
    from kernel_testing import with_interpreter_speedup

    _skip_without_speedup()
    code = (
        "import os, sys\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import triton\n"
        "from triton.runtime import interpreter as ti\n"
        "print(hasattr(ti._patch_lang, 'original'), hasattr(ti.GridExecutor.__call__, 'original'))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for env, want in ((with_interpreter_speedup(base), "True True"), (base, "False False")):
        for run in (run_python, lambda args, env: run_python_forked(args, preload=TORCH_TRITON, env=env)):
            r = run(["-c", code], env=env)
            assert r.returncode == 0 and r.stdout.split() == want.split(), (r.stdout, r.stderr[-2000:])

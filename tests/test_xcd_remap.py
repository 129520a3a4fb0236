# SPDX-License-Identifier: Apache-2.0
"""XCD-aware program-id remap: bijection on [0, N) for any N and XCD count, the Triton helper against the
Python reference (through the demo kernel), and the locality property it exists for."""

import itertools

import pytest
import torch

import xcd_remap
from forked_python import TORCH_TRITON, run_python_forked
from kernel_testing import DEVICE, INTERPRET, make_generator, poisoned_outputs

# (num_pids, num_xcds): fewer programs than XCDs, exact multiples, remainders 1 and X - 1, primes,
# one XCD, and the XCD counts of today's parts (8) beside odd ones.
CASES = [
    (1, 8),
    (3, 8),
    (7, 8),
    (8, 8),
    (9, 8),
    (15, 8),
    (16, 8),
    (17, 8),
    (63, 8),
    (64, 8),
    (65, 8),
    (127, 8),
    (1000, 8),
    (1003, 8),
    (1, 1),
    (5, 1),
    (97, 1),
    (2, 3),
    (10, 3),
    (11, 3),
    (12, 3),
    (101, 7),
    (304, 8),
    (256, 8),
    (300, 6),
    (13, 4),
    (4, 5),
]


def _ref_table(n, x):
    return [xcd_remap.xcd_remap_ref(p, n, x) for p in range(n)]


def _naive(p, n, x):
    """The often-copied remap without the remainder term: right only when x divides n."""
    return (p % x) * (n // x) + p // x


@pytest.mark.parametrize("num_pids,num_xcds", CASES)
def test_reference_is_a_bijection(num_pids, num_xcds):
    assert sorted(_ref_table(num_pids, num_xcds)) == list(range(num_pids))


def test_reference_bijection_exhaustive_small():
    for n, x in itertools.product(range(0, 130), range(1, 17)):
        assert sorted(_ref_table(n, x)) == list(range(n)), (n, x)


@pytest.mark.parametrize("num_pids,num_xcds", CASES)
def test_tiles_of_one_xcd_are_one_contiguous_run(num_pids, num_xcds):
    """Consecutive programs of one XCD get consecutive tile ids; XCD x's run starts where XCD x-1's ends."""
    ref = _ref_table(num_pids, num_xcds)
    start = 0
    for x in range(num_xcds):
        tiles = [ref[p] for p in range(x, num_pids, num_xcds)]  # XCD x's programs, in dispatch order
        assert tiles == list(range(start, start + len(tiles))), (x, tiles)
        start += len(tiles)
    assert start == num_pids


@pytest.mark.parametrize("num_pids,num_xcds", [(5, 8), (1, 3), (97, 1)])
def test_identity_when_one_xcd_or_fewer_programs_than_xcds(num_pids, num_xcds):
    assert _ref_table(num_pids, num_xcds) == list(range(num_pids))


def test_naive_remap_breaks_when_not_a_multiple():
    """Documents why the remainder term exists: without it tiles are repeated and others never computed."""
    n, x = 1003, 8
    naive = [_naive(p, n, x) for p in range(n)]
    assert sorted(naive) != list(range(n))
    assert len(set(naive)) < n
    # and it agrees with xcd_remap when x divides n
    assert [_naive(p, 1000, 8) for p in range(1000)] == _ref_table(1000, 8)
    # it is a bijection exactly when x divides n (or n <= 1)
    for n, x in itertools.product(range(0, 70), range(1, 10)):
        is_bijection = sorted(_naive(p, n, x) for p in range(n)) == list(range(n))
        assert is_bijection == (n % x == 0 or n <= 1), (n, x)


@pytest.mark.parametrize("num_pids,num_xcds", CASES)
def test_kernel_matches_reference(num_pids, num_xcds):
    with poisoned_outputs():
        out = xcd_remap.xcd_remap_table(num_pids, num_xcds, device=DEVICE)
    assert out.dtype == torch.int32 and out.shape == (num_pids,)
    assert out.cpu().tolist() == _ref_table(num_pids, num_xcds)


def test_kernel_random_sizes():
    gen = make_generator()
    for _ in range(6):
        n = int(torch.randint(1, 700, (1,), generator=gen))
        x = int(torch.randint(1, 13, (1,), generator=gen))
        with poisoned_outputs():
            out = xcd_remap.xcd_remap_table(n, x, device=DEVICE).cpu().tolist()
        assert out == _ref_table(n, x), f"num_pids={n} num_xcds={x} seed={gen.seed_value}"


def test_empty_grid():
    out = xcd_remap.xcd_remap_table(0, 8, device=DEVICE)
    assert out.shape == (0,) and out.dtype == torch.int32


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((-1, 8), ValueError, "num_pids must be"),
        ((10, 0), ValueError, "num_xcds must be"),
        ((10, 1000), ValueError, "num_xcds must be"),
        ((10.0, 8), TypeError, "num_pids must be an int"),
        ((10, True), TypeError, "num_xcds must be an int"),
    ],
)
def test_launcher_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        xcd_remap.xcd_remap_table(*args, device=DEVICE)


@pytest.mark.skipif(not INTERPRET, reason="the CPU-tensor guard only applies without a GPU")
def test_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setattr(xcd_remap, "_interpreting", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        xcd_remap.xcd_remap_table(4, 8, device="cpu")


@pytest.mark.parametrize(
    "args,exc,match",
    [
        ((5, 5, 8), ValueError, "pid must be < num_pids"),
        ((-1, 5, 8), ValueError, "pid must be"),
        ((0, 5, 0), ValueError, "num_xcds must be"),
        ((0, 5.0, 8), TypeError, "num_pids must be an int"),
    ],
)
def test_reference_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        xcd_remap.xcd_remap_ref(*args)


def test_self_check_cli():
    script = xcd_remap.__file__
    # as `python xcd_remap.py ...` runs, forked from a process that has imported torch and triton already
    res = run_python_forked([script, "--help"], preload=TORCH_TRITON, timeout=120)
    assert res.returncode == 0 and "--num-xcds" in res.stdout
    res = run_python_forked([script, "--num-pids", "203", "--num-xcds", "8"], preload=TORCH_TRITON, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert '"ok": true' in res.stdout

# SPDX-License-Identifier: Apache-2.0
"""XCD-aware program-id remapping for tiled kernels (GEMMs) on multi-die AMD Instinct GPUs.

    tile = (pid % X) * (N // X) + min(pid % X, N % X) + pid // X      (N programs, X XCDs)

MI300X (gfx942) and MI355X (gfx950) are built from 8 accelerator complex dies (XCDs), each with its
own L2 cache. In the default single-partition mode the hardware hands workgroups to the XCDs round
robin: program ``pid`` runs on XCD ``pid % X``. Consecutive program ids, which a GEMM usually maps
to neighbouring output tiles that read the same rows of A or columns of B, therefore land on
different XCDs and share no L2. ``xcd_remap`` renumbers the programs so that the tiles an XCD
executes are a contiguous run of tile ids; the usual grouped (``GROUP_M``) tile ordering applied
to the remapped id then keeps neighbouring tiles in one L2.

Derivation. Program ``pid`` is the ``k = pid // X``-th program dispatched to XCD ``x = pid % X``.
XCD ``x`` receives ``n_x = q + (1 if x < r else 0)`` programs, with ``q = N // X`` and
``r = N % X`` (the first ``r`` XCDs get one extra when N is not a multiple of X). Give XCD ``x``
the tile range ``[s_x, s_x + n_x)`` with ``s_x = n_0 + ... + n_{x-1} = x * q + min(x, r)`` and
hand its k-th program tile ``s_x + k``. The ranges tile ``[0, N)`` end to end
(``s_{x+1} = s_x + n_x`` and ``s_X = N``) and ``k`` runs over exactly ``0 .. n_x - 1`` on XCD
``x`` (``x + k * X < N`` iff ``k < n_x``), so the map is a bijection on ``[0, N)`` for every
N >= 0 and X >= 1, including N < X (then q = 0 and the map is the identity) and X = 1 (identity).
The often-copied form ``(pid % X) * (N // X) + pid // X`` is a bijection only when X divides N
(or N <= 1): otherwise it repeats some tile ids and skips others (see tests/test_xcd_remap.py).

Public functions:

* ``xcd_remap(pid, num_pids, NUM_XCDS)``: ``@triton.jit`` helper to call at the top of a kernel,
  ``tile_id = xcd_remap(tl.program_id(0), tl.num_programs(0), 8)``; works on scalars and tensors.
* ``xcd_remap_ref(pid, num_pids, num_xcds)``: the same map in plain Python.
* ``xcd_remap_table(num_pids, num_xcds, device=None)``: launches a demo kernel with ``num_pids``
  programs, each writing its remapped id; returns the int32 table (used by the tests).

NUM_XCDS is the number of XCDs of the device the kernel runs on: 8 on MI300X and MI355X in the
default (SPX) compute partition, the device's share of them when the GPU is compute-partitioned,
and 1 on GPUs without XCDs such as the RDNA4 Radeons, where the remap is the identity. The remap
changes which tile a program computes, not what is computed: results do not depend on it. Whether
it pays off is a property of the kernel (how much neighbouring tiles share) and must be measured
on the GPU.

The file depends on torch and triton only; copy it into another project as is.
Run ``python xcd_remap.py --help``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["xcd_remap", "xcd_remap_ref", "xcd_remap_table"]

# Largest XCD count accepted by the launcher: a sanity bound (today's parts have at most 8 per
# device), not a hardware fact the code depends on.
_MAX_XCDS = 64


# --------------------------------------------------------------------------------------------
# Device helper and demo kernel
# --------------------------------------------------------------------------------------------
@triton.jit
def xcd_remap(pid, num_pids, NUM_XCDS: tl.constexpr):
    """Tile id for program ``pid`` of ``num_pids`` so that each XCD runs a contiguous run of tiles.

    Assumes round-robin dispatch (program ``pid`` on XCD ``pid % NUM_XCDS``). A bijection on
    ``[0, num_pids)`` for any ``num_pids >= 0``; the identity when ``NUM_XCDS == 1``. Integer
    arithmetic only (int32 program ids); ``pid`` may be a scalar or a tensor of program ids.
    """
    xcd = pid % NUM_XCDS  # the XCD this program was dispatched to
    k = pid // NUM_XCDS  # its rank among the programs of that XCD
    q = num_pids // NUM_XCDS  # programs every XCD receives
    r = num_pids % NUM_XCDS  # the first r XCDs receive one more
    return xcd * q + tl.minimum(xcd, r) + k


@triton.jit
def _xcd_remap_demo_kernel(
    OUT,  # int32 [num_programs]: OUT[pid] = xcd_remap(pid, num_programs, NUM_XCDS)
    NUM_XCDS: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = xcd_remap(pid, tl.num_programs(0), NUM_XCDS)
    tl.store(OUT + pid, tile)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------
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


def _check_int(name: str, v, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {rng}, got {v}")
    return v


def _launch_config(warp_size: int):
    # Each program computes and stores one int32: one wavefront (64 lanes on CDNA, 32 on RDNA,
    # a 32-thread warp on NVIDIA) is the smallest launch and more would only idle.
    del warp_size
    return 1


def xcd_remap_table(num_pids: int, num_xcds: int, device=None) -> torch.Tensor:
    """Launch ``num_pids`` programs of the demo kernel; element ``pid`` of the int32 result is the
    tile id ``xcd_remap`` gives program ``pid``. ``device`` defaults to the current GPU (or the CPU
    under TRITON_INTERPRET=1)."""
    _check_int("num_pids", num_pids, 0, 2**31 - 1)
    _check_int("num_xcds", num_xcds, 1, _MAX_XCDS)
    if device is None:
        device = "cuda" if torch.cuda.is_available() and not _interpreting() else "cpu"
    device = torch.device(device)
    if device.type == "cpu" and not _interpreting():
        raise ValueError(
            "device is the CPU: Triton kernels run on a GPU (or on the CPU through the Triton "
            "interpreter: set TRITON_INTERPRET=1 before importing this module)"
        )
    out = torch.empty(num_pids, dtype=torch.int32, device=device)
    if num_pids == 0:
        return out
    num_warps = _launch_config(_device_target(device)[2])
    _xcd_remap_demo_kernel[(num_pids,)](out, NUM_XCDS=num_xcds, num_warps=num_warps)
    return out


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def xcd_remap_ref(pid: int, num_pids: int, num_xcds: int) -> int:
    """Plain-Python ``xcd_remap``: the tile id of program ``pid`` of ``num_pids`` over ``num_xcds`` XCDs."""
    _check_int("num_xcds", num_xcds, 1)
    _check_int("num_pids", num_pids, 0)
    _check_int("pid", pid, 0)
    if pid >= num_pids:
        raise ValueError(f"pid must be < num_pids ({num_pids}), got {pid}")
    xcd, k = pid % num_xcds, pid // num_xcds
    q, r = divmod(num_pids, num_xcds)
    return xcd * q + min(xcd, r) + k


# --------------------------------------------------------------------------------------------
# Self-check: python xcd_remap.py [--num-pids N] [--num-xcds X]
# --------------------------------------------------------------------------------------------
def _main(argv=None) -> int:
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(
        description="Check the XCD remap: the kernel against the Python reference, bijection on [0, N), "
        "and that the tiles of each XCD form one contiguous run."
    )
    p.add_argument("--num-pids", type=int, default=1000, help="programs in the grid (default 1000)")
    p.add_argument("--num-xcds", type=int, default=8, help="XCDs (default 8: MI300X, MI355X)")
    p.add_argument("--show", type=int, default=0, metavar="K", help="also print the first K (pid, xcd, tile)")
    args = p.parse_args(argv)
    for name in ("num_pids",):  # sizes: at least 1
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    n, x = args.num_pids, args.num_xcds
    try:
        _check_int("--num-pids", n, 0, 2**31 - 1)
        _check_int("--num-xcds", x, 1, _MAX_XCDS)
    except (TypeError, ValueError) as exc:
        p.error(str(exc))
    ref = [xcd_remap_ref(i, n, x) for i in range(n)]
    bijection = sorted(ref) == list(range(n))
    runs = {}
    for pid, tile in enumerate(ref):
        runs.setdefault(pid % x, []).append(tile)
    contiguous = all(all(b == a + 1 for a, b in zip(t, t[1:])) for t in runs.values())
    report = {"num_pids": n, "num_xcds": x, "reference_bijection": bijection, "xcd_runs_contiguous": contiguous}
    ok = bijection and contiguous
    if torch.cuda.is_available() or _interpreting():
        table = xcd_remap_table(n, x).cpu().tolist()
        report["device"] = "cpu (Triton interpreter)" if _interpreting() else str(torch.device("cuda"))
        report["kernel_matches_reference"] = table == ref
        ok = ok and table == ref
    else:
        report["kernel_matches_reference"] = None
        print(
            "no GPU found: the kernel was not run (rerun with TRITON_INTERPRET=1 to use the Triton interpreter)",
            file=sys.stderr,
        )
    if args.show:
        report["first"] = [(i, i % x, ref[i]) for i in range(min(args.show, n))]
    # null when the kernel could not be run: the check is incomplete, not passed
    report["ok"] = None if report["kernel_matches_reference"] is None else bool(ok)
    print(json.dumps(report))
    if report["ok"] is None:
        return 2 if ok else 1
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

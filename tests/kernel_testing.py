# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the kernel tests: device choice, poisoned outputs, fresh random inputs and a
verbose closeness check against a float64 reference."""

from __future__ import annotations

import contextlib
import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cpu") if INTERPRET else torch.device("cuda")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# Tolerances against a float64 reference, |out - ref| <= atol + rtol * |ref|.
# One rounding to the output dtype costs half an ulp (2^-24, 2^-11, 2^-8 relative); kernels that
# round an intermediate (e.g. cast before the weight multiply) cost one more. The interpreter
# truncates fp32 -> bf16 instead of rounding (a full ulp). bf16: 4 ulps; fp16: 4 ulps; fp32: fp32
# accumulation over rows of up to ~16K elements stays well under 1e-5 relative.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=4 * 2.0**-11, atol=4 * 2.0**-11),
    torch.bfloat16: dict(rtol=4 * 2.0**-8, atol=4 * 2.0**-8),
}


class SeededGenerator(torch.Generator):
    """A torch.Generator that remembers its seed (``seed_value``) so a failure can be replayed."""

    seed_value: int = 0


# Seeds that make_generator() drew (or read from KERNEL_TEST_SEED) since conftest.py last cleared the list,
# at the start of each test: the failure report of a test names them (see pytest_runtest_makereport there).
FRESH_SEEDS: list[int] = []


def make_generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator: fresh entropy unless a seed is given (set KERNEL_TEST_SEED to replay)."""
    if seed is None:
        env = os.environ.get("KERNEL_TEST_SEED")
        seed = int(env) if env else int.from_bytes(os.urandom(4), "little")
        FRESH_SEEDS.append(seed)
    g = SeededGenerator(device="cpu")
    g.manual_seed(seed)
    g.seed_value = seed  # reported on failure so a run can be replayed
    return g


def randn(shape, dtype, gen, scale=1.0, offset=0.0, device=DEVICE):
    """Random normal data made on the CPU (reproducible from the seed), then moved."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale + offset
    return t.to(device=device, dtype=dtype)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so an element the kernel fails to write shows up as a mismatch."""
    return t.fill_(float("nan"))


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype=None, *, rtol=None, atol=None, name="output", seed=None):
    """Compare out with a (float64) reference; on failure, say where, how much and with which seed."""
    dtype = dtype or out.dtype
    tol = TOL.get(dtype, TOL[torch.float32])
    rtol = tol["rtol"] if rtol is None else rtol
    atol = tol["atol"] if atol is None else atol
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    nan = torch.isnan(o) & ~torch.isnan(r)
    bad = nan | ((o - r).abs() > atol + rtol * r.abs())
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        err = (o - r).abs()
        worst = int(torch.nan_to_num(err, nan=float("inf")).argmax())
        msg = [
            f"{name}: {int(bad.sum())} of {o.numel()} elements differ (dtype {dtype}, rtol {rtol:.2e}, atol {atol:.2e}, "
            f"seed {seed}); {int(nan.sum())} NaN (unwritten or invalid)",
            f"  max abs err {float(torch.nan_to_num(err, nan=float('inf')).max()):.3e} at flat index {worst}",
        ]
        for i in idx:
            msg.append(f"  at {tuple(i)}: got {o[tuple(i)].item()!r}, expected {r[tuple(i)].item()!r}")
        raise AssertionError("\n".join(msg))


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    return float((o - r).norm() / r.norm().clamp_min(1e-300))


class poisoned_outputs:
    """Context manager: every torch.empty / torch.empty_like / Tensor.new_empty made from Python
    code inside it (the kernels' launchers allocate their outputs this way) comes back filled with
    NaN (floats) or a sentinel (integers), so an element the kernel does not write fails the test."""

    def __enter__(self):
        # torch caches its list of factory functions (used by `with torch.device(...)`) on first use;
        # fill that cache with the real functions first, so patching here cannot leak into it (if the
        # patched lambdas were cached, `with torch.device("meta")` would later allocate real memory).
        try:
            from torch.utils._device import _device_constructors

            _device_constructors()
        except ImportError:  # pragma: no cover - a torch without that private helper
            pass
        self._empty, self._empty_like, self._new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

        def fill(t):
            if t.is_floating_point():
                t.fill_(float("nan"))
            elif t.dtype != torch.bool and t.numel():
                t.fill_(torch.iinfo(t.dtype).max if t.dtype.is_signed or t.dtype == torch.uint8 else 0)
            return t

        orig_empty, orig_like, orig_new = self._empty, self._empty_like, self._new_empty
        torch.empty = lambda *a, **k: fill(orig_empty(*a, **k))
        torch.empty_like = lambda *a, **k: fill(orig_like(*a, **k))
        torch.Tensor.new_empty = lambda self_, *a, **k: fill(orig_new(self_, *a, **k))
        return self

    def __exit__(self, *exc):
        torch.empty, torch.empty_like, torch.Tensor.new_empty = self._empty, self._empty_like, self._new_empty
        return False


def _f32_to_bf16_bits_rne(a):
    """bf16 bit patterns (uint16) of float32 values, rounded to nearest, ties to even (NaN stays a quiet NaN
    of the same sign): what torch's and the GPUs' conversion gives."""
    import numpy as np

    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    nan = np.isnan(a)
    safe = np.where(nan, np.uint32(0), u)  # (no overflow of the addition below for NaN bit patterns)
    r = ((safe + np.uint32(0x7FFF) + ((safe >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return np.where(nan, ((u >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16), r)


@contextlib.contextmanager
def interpreter_bf16_round_to_nearest_even():
    """Within the block, Triton's interpreter rounds fp32 -> bf16 to nearest even, as torch and GPUs do (it
    truncates otherwise, which costs a full ulp per rounding and builds up over a model). Then a kernel
    whose rounding points match a PyTorch expression's can be compared with it bit for bit on the CPU. A
    no-op outside the interpreter (a GPU rounds to nearest even already)."""
    if not INTERPRET:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    cast_impl, fp_to_fp = builder.cast_impl, builder.create_fp_to_fp

    def rne(src):
        return ti.TensorHandle(_f32_to_bf16_bits_rne(src.data), tl.bfloat16)

    def patched_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return rne(src)
        return cast_impl(self, src, dst_type)

    def patched_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return rne(src)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    builder.cast_impl, builder.create_fp_to_fp = patched_cast, patched_fp_to_fp
    try:
        yield
    finally:
        builder.cast_impl, builder.create_fp_to_fp = cast_impl, fp_to_fp

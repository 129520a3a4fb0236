"""The launch path shared by the kernel files: plans cached per call signature, launched directly.

Every kernel file carries the same launch block (so that each file stays copyable alone); these tests
check that the copies are identical, that a plan is reused only for calls of the same signature, and
that a cached plan computes what a fresh one computes for every call it serves.
"""

from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_MODULES, SCRIPTS
from kernel_testing import INTERPRET, assert_close, make_generator, poisoned_outputs, randn

BEGIN = "# ---- launch block begin"
END = "# ---- launch block end ----"


def _block(name: str) -> str:
    text = (SCRIPTS / f"{name}.py").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"{name}.py must hold the launch block once"
    return text[text.index(BEGIN):text.index(END) + len(END)]


def test_launch_block_copies_are_identical():
    blocks = {name: _block(name) for name in KERNEL_MODULES}
    first = blocks["rmsnorm"]
    for name, text in blocks.items():
        assert text == first, f"scripts/{name}.py's launch block differs from scripts/rmsnorm.py's"


@pytest.fixture
def gen():
    return make_generator()


def test_plan_reused_only_for_the_same_signature(gen):
    import rmsnorm

    dtype = torch.bfloat16
    w = randn((96,), dtype, gen)
    x = randn((3, 5, 96), dtype, gen)
    base = randn((3, 5, 2 * 96), dtype, gen)
    strided = base[..., :96]  # same shape, other row stride
    rmsnorm._PLANS.clear()
    for t in (x, randn((3, 5, 96), dtype, gen), strided, x.float(), x):
        with poisoned_outputs():
            out = rmsnorm.rms_norm(t, w if t.dtype == dtype else w.float())
        ref = rmsnorm.rms_norm_ref(t.double(), (w if t.dtype == dtype else w.float()).double())
        assert_close(out, ref.to(t.dtype), t.dtype, seed=gen.seed_value)
    assert len(rmsnorm._PLANS) == 3  # contiguous bf16, strided bf16, fp32


def test_bad_input_after_a_cached_plan_still_raises(gen):
    import rmsnorm

    x = randn((4, 64), torch.float32, gen)
    w = randn((64,), torch.float32, gen)
    rmsnorm.rms_norm(x, w)
    with pytest.raises(ValueError, match="weight must have shape"):
        rmsnorm.rms_norm(x, randn((63,), torch.float32, gen))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        rmsnorm.rms_norm(x.tolist(), w)
    with pytest.raises(ValueError, match="eps"):
        rmsnorm.rms_norm(x, w, eps=-1.0)


@pytest.mark.skipif(INTERPRET, reason="the direct launch exists for compiled kernels only")
def test_direct_launch_serves_misaligned_and_aligned_pointers(gen):
    """A plan compiled for 16-byte aligned pointers must not serve a misaligned one (it falls back to
    the JIT, which compiles the unaligned variant), and the aligned case keeps working after that."""
    import rmsnorm

    dtype = torch.bfloat16
    w = randn((128,), dtype, gen)
    big = randn((6, 129), dtype, gen)
    aligned, misaligned = big[:, :128], big[:, 1:]  # same shape and strides, address off by 2 bytes
    rmsnorm._PLANS.clear()
    for t in (aligned, aligned, misaligned, misaligned, aligned):
        with poisoned_outputs():
            out = rmsnorm.rms_norm(t, w)
        assert_close(out, rmsnorm.rms_norm_ref(t.double(), w.double()).to(dtype), dtype, seed=gen.seed_value)
    assert len(rmsnorm._PLANS) == 1
    launch = next(c.cell_contents for c in next(iter(rmsnorm._PLANS.values())).__closure__
                  if isinstance(c.cell_contents, rmsnorm._Launch))
    assert launch.run is not None, "the plan should launch directly after its first call"

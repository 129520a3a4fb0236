"""The launch path shared by the kernel files: plans cached per call signature, launched directly.

Every kernel file carries the same launch block (so that each file stays copyable alone); these tests
check that the copies are identical, that a plan is reused only for calls of the same signature, and
that a cached plan computes what a fresh one computes for every call it serves.
"""

from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_MODULES, SCRIPTS
from kernel_testing import DEVICE, INTERPRET, assert_close, make_generator, poisoned_outputs, randn

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


def _public_calls(gen):
    """(name, fn) pairs: each fn makes fresh inputs, calls one public kernel and returns its inputs."""
    import activations
    import head_norm_rope
    import layernorm
    import rope
    import skinny_gemm

    dt = torch.float32

    def r(*shape, scale=1.0):
        return randn(shape, dt, gen, scale=scale)

    def rms():
        x, w, sc, sh, y = r(2, 3, 64), r(64), r(2, 1, 64), r(2, 1, 64), r(2, 3, 64)
        import rmsnorm
        rmsnorm.rms_norm(x, w)
        rmsnorm.rms_norm_modulate(x, sc, sh)
        rmsnorm.gated_residual_rms_norm_modulate(x, y, sc, sc, sh)
        rmsnorm.gated_residual_add(x, y, sc)
        rmsnorm.fused_add_rms_norm(x, y, w)
        return [x, w, sc, sh, y]

    def ln():
        x, y, e = r(2, 3, 64), r(2, 3, 64), r(2, 5 * 64)
        g, sc, sh, sc2, sh2 = e.chunk(5, dim=1)
        layernorm.layer_norm(x, r(64), r(64))
        layernorm.layer_norm_modulate(x, sc, sh)
        layernorm.layer_norm_modulate_dual(x, sc, sh, sc2, sh2)
        layernorm.gated_residual_layer_norm_modulate(x, y, g, sc, sh)
        layernorm.gated_residual_layer_norm_modulate_dual(x, y, g, sc, sh, sc2, sh2)
        return [x, y, e]

    def ropes():
        x = r(2, 4, 48)
        ang = r(2, 4, 24)
        cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
        rope.ltx_rope(x, cos, sin)
        rope.rope_rotate_half(r(1, 2, 4, 48), r(4, 48), r(4, 48))
        q, k, wq, wk = r(2, 4, 48), r(2, 4, 48), r(48), r(48)
        rope.ltx_qk_rmsnorm_rope(q, k, wq, wk, 1e-6, cos, sin)
        coords = torch.rand(2, 4, 3, generator=gen).to(DEVICE)
        rope.ltx_qk_rmsnorm_rope_coords(q, k, wq, wk, 1e-6, coords, rope.ltx_rope_freqs(48, device=DEVICE))
        return [x, cos, sin, q, k, wq, wk, coords]

    def heads():
        q, k, w = r(2, 4, 3, 32), r(2, 4, 3, 32), r(32)
        head_norm_rope.head_rms_norm_rope(q, k, w, w, 1e-6)
        return [q, k, w]

    def acts():
        x = r(2, 3, 64)
        activations.gelu(x)
        activations.geglu(x)
        activations.swiglu(x)
        return [x]

    def gemm():
        x, w = randn((1, 64), torch.bfloat16, gen), randn((32, 64), torch.bfloat16, gen)
        skinny_gemm.skinny_gemm(x, w)
        return [x, w]

    return [("rmsnorm", rms), ("layernorm", ln), ("rope", ropes), ("head_norm_rope", heads),
            ("activations", acts), ("skinny_gemm", gemm)]


@pytest.mark.parametrize("which", ["rmsnorm", "layernorm", "rope", "head_norm_rope", "activations", "skinny_gemm"])
def test_plans_keep_no_tensor_alive(which, gen):
    """A kept plan must not hold on to the tensors of the call that built it (a plan lives as long as
    the process; holding an input would keep its memory)."""
    import gc
    import weakref

    fn = dict(_public_calls(gen))[which]
    inputs = fn()
    refs = [weakref.ref(t) for t in inputs]
    del inputs
    gc.collect()
    alive = [i for i, ref in enumerate(refs) if ref() is not None]
    assert not alive, f"{which}: inputs {alive} are still referenced after the call (by a cached plan?)"

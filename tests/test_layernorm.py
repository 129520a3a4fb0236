# SPDX-License-Identifier: Apache-2.0
"""LayerNorm, AdaLN-modulated LayerNorm (single and dual) and gated-residual + LayerNorm + modulation,
against float64 references and against the real diffusers / torch modules (AdaLayerNormZero,
AdaLayerNormZeroSingle, AdaLayerNormContinuous, SD35AdaLayerNormZeroX, nn.LayerNorm)."""

from types import SimpleNamespace

import pytest
import torch

import kernel_testing as kt
import layernorm
from conftest import clear_launch_plans
from kernel_testing import DEVICE, DTYPES, INTERPRET, TOL, assert_close, ones, poisoned_outputs, randn, rel_l2

SHAPES = [(1, 1), (1, 127), (3, 2049), (2, 5, 64), (2, 3, 7, 96)]


def _module_tol(dtype):
    """Kernel vs a module that rounds at the same places: natively within 1 ulp (fp32 summation order);
    the interpreter truncates fp32 -> bf16 casts instead of rounding: full TOL there."""
    t = TOL[dtype]
    return t if (INTERPRET and dtype == torch.bfloat16) else {k: v / 2 for k, v in t.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_matches_float64(shape, dtype, affine, gen):
    x = randn(shape, dtype, gen, scale=3.0, offset=1.5)  # an offset: the mean subtraction matters
    w = randn((shape[-1],), dtype, gen, scale=0.2, offset=1.0) if affine else None
    b = randn((shape[-1],), dtype, gen, scale=0.2) if affine else None
    with poisoned_outputs():
        out = layernorm.layer_norm(x, w, b, eps=1e-5)
    ref = layernorm.layer_norm_ref(
        x.double(), None if w is None else w.double(), None if b is None else b.double(), 1e-5
    )
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, ref, dtype, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mod_shape", ["BD", "B1D", "BSD", "D", "1D"])
def test_layer_norm_modulate(dtype, mod_shape, gen):
    B, S, D = 3, 5, 131
    x = randn((B, S, D), dtype, gen, scale=2.0, offset=-0.7)
    shape = {"BD": (B, D), "B1D": (B, 1, D), "BSD": (B, S, D), "D": (D,), "1D": (1, D)}[mod_shape]
    sc = randn(shape, dtype, gen, scale=0.5)
    sh = randn(shape, dtype, gen, scale=0.5)
    with poisoned_outputs():
        out = layernorm.layer_norm_modulate(x, sc, sh, eps=1e-6)
    ref = layernorm.layer_norm_modulate_ref(x.double(), sc.double(), sh.double(), eps=1e-6)
    assert_close(out, ref, dtype, seed=gen.seed_value)


def test_per_sample_rule_for_2d_modulation(gen):
    """[B, D] scale/shift with a 3-D x means one row per sample: the same as [B, 1, D]."""
    B, S, D = 2, 4, 40
    x = randn((B, S, D), torch.float32, gen)
    sc, sh = randn((B, D), torch.float32, gen), randn((B, D), torch.float32, gen)
    a = layernorm.layer_norm_modulate(x, sc, sh)
    b = layernorm.layer_norm_modulate(x, sc[:, None], sh[:, None])
    assert torch.equal(a, b)
    # for a 2-D x, [M, D] is per row (ordinary broadcasting)
    x2 = randn((B, D), torch.float32, gen)
    assert_close(
        layernorm.layer_norm_modulate(x2, sc, sh),
        layernorm.layer_norm_ref(x2.double(), eps=1e-6) * (1 + sc.double()) + sh.double(),
        torch.float32,
        seed=gen.seed_value,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_modulate_with_adaln_chunk_views(dtype, gen):
    """scale/shift/gate as diffusers' AdaLN makes them: emb.chunk(6, dim=1) of [B, 6D], row stride 6D."""
    B, S, D = 2, 7, 96
    x = randn((B, S, D), dtype, gen, scale=2.0)
    y = randn((B, S, D), dtype, gen)
    emb = randn((B, 6 * D), dtype, gen, scale=0.3)
    shift, scale, gate, shift2, scale2, _ = emb.chunk(6, dim=1)
    assert not scale.is_contiguous()
    with poisoned_outputs():
        out = layernorm.layer_norm_modulate(x, scale, shift)
        o1, o2 = layernorm.layer_norm_modulate_dual(x, scale, shift, scale2, shift2)
        h_new, o3 = layernorm.gated_residual_layer_norm_modulate(x, y, gate, scale, shift)
    d = {
        k: v.double()
        for k, v in dict(x=x, y=y, shift=shift, scale=scale, gate=gate, shift2=shift2, scale2=scale2).items()
    }
    ref = layernorm.layer_norm_modulate_ref(d["x"], d["scale"], d["shift"])
    assert_close(out, ref, dtype, seed=gen.seed_value)
    assert_close(o1, ref, dtype, name="out", seed=gen.seed_value)
    assert_close(
        o2, layernorm.layer_norm_modulate_ref(d["x"], d["scale2"], d["shift2"]), dtype, name="out2", seed=gen.seed_value
    )
    h_ref, _ = layernorm.gated_residual_layer_norm_modulate_ref(d["x"], d["y"], d["gate"], d["scale"], d["shift"])
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    assert_close(
        o3,
        layernorm.layer_norm_modulate_ref(h_new.double(), d["scale"], d["shift"]),
        dtype,
        name="out",
        seed=gen.seed_value,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_shape", [None, "BD", "B1D", "BSD"])
def test_gated_residual_layer_norm_modulate(dtype, gate_shape, gen):
    B, S, D = 2, 6, 131
    h = randn((B, S, D), dtype, gen, scale=2.0, offset=0.5)
    y = randn((B, S, D), dtype, gen)
    gate = None
    if gate_shape is not None:
        gate = randn({"BD": (B, D), "B1D": (B, 1, D), "BSD": (B, S, D)}[gate_shape], dtype, gen)
    sc = randn((B, D), dtype, gen, scale=0.5)
    sh = randn((B, D), dtype, gen, scale=0.5)
    with poisoned_outputs():
        h_new, out = layernorm.gated_residual_layer_norm_modulate(h, y, gate, sc, sh)
    h_ref, _ = layernorm.gated_residual_layer_norm_modulate_ref(
        h.double(), y.double(), None if gate is None else gate.double(), sc.double(), sh.double()
    )
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    # normalise the kernel's own rounded h (as the model does), so only the norm's error is compared
    assert_close(
        out,
        layernorm.layer_norm_modulate_ref(h_new.double(), sc.double(), sh.double()),
        dtype,
        name="out",
        seed=gen.seed_value,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [131, 1536])
def test_gated_residual_layer_norm_modulate_dual(dtype, width, gen):
    """A block's last gated residual fused with the next block's two modulations (SD3.5's
    SD35AdaLayerNormZeroX): the per-sample chunks are strided views of one embedding, as the model makes them."""
    B, S, D = 2, 7, width
    h = randn((B, S, D), dtype, gen, scale=2.0, offset=0.5)
    y = randn((B, S, D), dtype, gen)
    emb = randn((B, 5 * D), dtype, gen, scale=0.5)
    gate, sc, sh, sc2, sh2 = emb.chunk(5, dim=1)
    with poisoned_outputs():
        h_new, o1, o2 = layernorm.gated_residual_layer_norm_modulate_dual(h, y, gate, sc, sh, sc2, sh2)
    d = [t.double() for t in (h, y, gate, sc, sh, sc2, sh2)]
    h_ref, _, _ = layernorm.gated_residual_layer_norm_modulate_dual_ref(*d)
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    # both modulations of the kernel's own rounded h (as the model normalises the stored h)
    _, r1, r2 = layernorm.gated_residual_layer_norm_modulate_dual_ref(
        h_new.double(), torch.zeros_like(d[1]), None, *d[3:]
    )
    assert_close(o1, r1, dtype, name="out", seed=gen.seed_value)
    assert_close(o2, r2, dtype, name="out2", seed=gen.seed_value)
    with pytest.raises(ValueError, match="all required"):
        layernorm.gated_residual_layer_norm_modulate_dual(h, y, gate, sc, sh, None, sh2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(13, 192), (3, 1536), (2, 3072)])
def test_three_chunk_rows(rows, width, dtype, gen):
    """Widths 3 * 2**k are held as three chunks (SD3's 1536, FLUX's 3072) when there is no residual
    branch: every variant, with a partial last program of rows, against float64."""
    block_m, block_n, single, nch, _ = layernorm._launch_config(width, rows, 32)
    assert single and nch == 3 and 3 * block_n == width  # the path under test is the one taken
    assert layernorm._launch_config(width, rows, 32, residual=True)[3] == 1
    x = randn((rows, width), dtype, gen, scale=2.0, offset=0.8)
    y = randn((rows, width), dtype, gen)
    w = randn((width,), dtype, gen, scale=0.2, offset=1.0)
    b = randn((width,), dtype, gen, scale=0.2)
    emb = randn((rows, 5 * width), dtype, gen, scale=0.3)
    sc, sh, gate, sc2, sh2 = emb.chunk(5, dim=1)
    d = {k: v.double() for k, v in dict(x=x, y=y, w=w, b=b, sc=sc, sh=sh, gate=gate, sc2=sc2, sh2=sh2).items()}
    with poisoned_outputs():
        out = layernorm.layer_norm(x, w, b, eps=1e-5)
        o1, o2 = layernorm.layer_norm_modulate_dual(x, sc, sh, sc2, sh2)
        h_new, o3 = layernorm.gated_residual_layer_norm_modulate(x, y, gate, sc, sh)
    assert_close(out, layernorm.layer_norm_ref(d["x"], d["w"], d["b"], 1e-5), dtype, seed=gen.seed_value)
    assert_close(
        o1, layernorm.layer_norm_modulate_ref(d["x"], d["sc"], d["sh"]), dtype, name="out", seed=gen.seed_value
    )
    assert_close(
        o2, layernorm.layer_norm_modulate_ref(d["x"], d["sc2"], d["sh2"]), dtype, name="out2", seed=gen.seed_value
    )
    h_ref, _ = layernorm.gated_residual_layer_norm_modulate_ref(d["x"], d["y"], d["gate"], d["sc"], d["sh"])
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    assert_close(
        o3, layernorm.layer_norm_modulate_ref(h_new.double(), d["sc"], d["sh"]), dtype, name="out", seed=gen.seed_value
    )


def _spy_persistent(monkeypatch):
    """Record what the launcher's persistent-grid rule returns (programs, warps) on each launch."""
    seen = []
    real = layernorm._persistent_config

    def spy(*args):
        seen.append(real(*args))
        return seen[-1]

    monkeypatch.setattr(layernorm, "_persistent_config", spy)
    return seen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 2048, 100])
def test_persistent_grid_layer_norm_modulate(width, dtype, gen, monkeypatch):
    """LayerNorm + one modulation with more row blocks than programs runs on the persistent grid
    (each program loops over row blocks, prefetching the next): per-sample scale/shift ([B, D] views of
    an AdaLN embedding) change inside a program's loop, the last block is partial; against float64, and
    the same call with the persistent grid switched off."""
    seen = _spy_persistent(monkeypatch)
    warp_size = 32 if DEVICE.type == "cpu" else layernorm._device_target(DEVICE)[2]
    block_m = layernorm._launch_config(width, 1 << 20, warp_size)[0]  # rows per block at many rows
    if DEVICE.type == "cpu":
        b, s = 2, 4 * block_m + 1  # the interpreter's persistent grid is 3 programs: 9 blocks
    else:
        b, s = 3, block_m * layernorm._num_sms(DEVICE) * 16 + 7  # more blocks than the rule's programs
    x = randn((b, s, width), dtype, gen, scale=2.0, offset=0.8)
    emb = randn((b, 6 * width), dtype, gen, scale=0.3)
    sc, sh = emb.chunk(6, dim=1)[:2]
    ref = layernorm.layer_norm_modulate_ref(x.double(), sc.double()[:, None], sh.double()[:, None])
    with poisoned_outputs():
        out = layernorm.layer_norm_modulate(x, sc, sh)
    programs, _ = seen[-1]
    assert 0 < programs < -(-b * s // block_m)  # the persistent path, with several blocks per program
    assert_close(out, ref, dtype, seed=gen.seed_value)
    monkeypatch.setattr(layernorm, "_PERSISTENT", False)
    clear_launch_plans()
    with poisoned_outputs():
        plain = layernorm.layer_norm_modulate(x, sc, sh)
    assert_close(plain, ref, dtype, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_persistent_grid_strided_rows_and_token_modulation(dtype, gen, monkeypatch):
    """The persistent loop with rows read in place from a wider tensor (the two-level row addressing,
    a row stride that is not the width) and a per-token [B, S, D] modulation, against float64."""
    seen = _spy_persistent(monkeypatch)
    width = 192
    b, s = (2, 41) if DEVICE.type == "cpu" else (2, 128 * layernorm._num_sms(DEVICE) + 3)
    wide = randn((b, s + 3, 2 * width + 5), dtype, gen, scale=2.0, offset=0.5)
    x = wide[:, 1 : s + 1, 3 : width + 3]  # strided rows, offset start
    sc = randn((b, s, width), dtype, gen, scale=0.3)
    sh = randn((b, s, width), dtype, gen, scale=0.3)
    with poisoned_outputs():
        out = layernorm.layer_norm_modulate(x, sc, sh)
    assert seen and seen[-1][0] > 0  # the persistent path ran
    ref = layernorm.layer_norm_modulate_ref(x.double(), sc.double(), sh.double())
    assert_close(out, ref, dtype, seed=gen.seed_value)


def test_persistent_grid_only_for_one_modulation_without_residual(gen, monkeypatch):
    """The rule is applied to LayerNorm + one modulation only (the residual and dual variants were
    slower on it): those launches do not consult it."""
    seen = _spy_persistent(monkeypatch)
    x = randn((2, 9, 192), torch.float32, gen)
    y = randn((2, 9, 192), torch.float32, gen)
    sc, sh, sc2, sh2 = randn((2, 4 * 192), torch.float32, gen, scale=0.3).chunk(4, dim=1)
    with poisoned_outputs():
        layernorm.layer_norm(x)
        layernorm.layer_norm_modulate_dual(x, sc, sh, sc2, sh2)
        layernorm.gated_residual_layer_norm_modulate(x, y, None, sc, sh)
    assert seen == []
    with poisoned_outputs():
        layernorm.layer_norm_modulate(x, sc, sh)
    assert len(seen) == 1


def test_residual_with_affine_and_without_modulation(gen):
    h = randn((4, 100), torch.float16, gen)
    y = randn((4, 100), torch.float16, gen)
    w = randn((100,), torch.float16, gen, scale=0.2, offset=1.0)
    b = randn((100,), torch.float16, gen, scale=0.2)
    with poisoned_outputs():
        h_new, out = layernorm.gated_residual_layer_norm_modulate(h, y, None, None, None, 1e-5, weight=w, bias=b)
    h_ref, _ = layernorm.gated_residual_layer_norm_modulate_ref(h.double(), y.double(), None, None, None, 1e-5)
    assert_close(h_new, h_ref, torch.float16, seed=gen.seed_value)
    assert_close(
        out, layernorm.layer_norm_ref(h_new.double(), w.double(), b.double(), 1e-5), torch.float16, seed=gen.seed_value
    )


@pytest.mark.parametrize("width", [1, 127, 2049])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_path_for_wide_rows(width, dtype, gen, monkeypatch):
    """Rows wider than one block take the three-pass chunked path; shrink the limits to reach it cheaply."""
    monkeypatch.setattr(layernorm, "_MAX_FUSED_N", 64)
    monkeypatch.setattr(layernorm, "_CHUNK_N", 32)
    x = randn((3, width), dtype, gen, scale=2.0, offset=3.0)
    h = randn((3, width), dtype, gen)
    w = randn((width,), dtype, gen, scale=0.2, offset=1.0)
    b = randn((width,), dtype, gen, scale=0.2)
    gate = randn((3, width), dtype, gen)
    sc, sh = randn((3, width), dtype, gen, scale=0.3), randn((width,), dtype, gen, scale=0.3)
    sc2, sh2 = randn((3, width), dtype, gen, scale=0.3), randn((3, width), dtype, gen, scale=0.3)
    with poisoned_outputs():
        out = layernorm.layer_norm(x, w, b)
        o1, o2 = layernorm.layer_norm_modulate_dual(x, sc, sh, sc2, sh2)
        h_new, mod = layernorm.gated_residual_layer_norm_modulate(h, x, gate, sc, sh, weight=w)
    assert_close(out, layernorm.layer_norm_ref(x.double(), w.double(), b.double()), dtype, seed=gen.seed_value)
    assert_close(
        o1, layernorm.layer_norm_modulate_ref(x.double(), sc.double(), sh.double()), dtype, seed=gen.seed_value
    )
    assert_close(
        o2, layernorm.layer_norm_modulate_ref(x.double(), sc2.double(), sh2.double()), dtype, seed=gen.seed_value
    )
    h_ref, _ = layernorm.gated_residual_layer_norm_modulate_ref(
        h.double(), x.double(), gate.double(), sc.double(), sh.double(), weight=w.double()
    )
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    mod_ref = layernorm.layer_norm_modulate_ref(h_new.double(), sc.double(), sh.double(), weight=w.double())
    assert_close(mod, mod_ref, dtype, name="out", seed=gen.seed_value)


def test_wide_row_20000_default_chunking(gen):
    x = randn((1, 20000), torch.float32, gen, offset=5.0)
    with poisoned_outputs():
        out = layernorm.layer_norm(x)
    assert_close(out, layernorm.layer_norm_ref(x.double()), torch.float32, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_without_copy(dtype, gen):
    """Rows sliced out of a wider tensor, and a transposed leading layout ([S, B, D] viewed as [B, S, D])."""
    big = randn((2, 9, 3 * 96), dtype, gen)
    x = big[:, :, 96:192]
    assert not x.is_contiguous()
    sc = randn((2, 96), dtype, gen, scale=0.3)
    sh = randn((2, 96), dtype, gen, scale=0.3)
    with poisoned_outputs():
        out = layernorm.layer_norm_modulate(x, sc, sh)
    assert_close(
        out, layernorm.layer_norm_modulate_ref(x.double(), sc.double(), sh.double()), dtype, seed=gen.seed_value
    )
    y = randn((9, 2, 96), dtype, gen).transpose(0, 1)
    h = randn((9, 2, 96), dtype, gen).transpose(0, 1)
    with poisoned_outputs():
        h_new, out = layernorm.gated_residual_layer_norm_modulate(h, y, sc, sc, sh)
    h_ref, _ = layernorm.gated_residual_layer_norm_modulate_ref(
        h.double(), y.double(), sc.double(), sc.double(), sh.double()
    )
    assert_close(h_new, h_ref, dtype, name="h", seed=gen.seed_value)
    assert_close(
        out, layernorm.layer_norm_modulate_ref(h_new.double(), sc.double(), sh.double()), dtype, seed=gen.seed_value
    )


# ---- against the real modules ---------------------------------------------------------------
def _rand_module(m, gen):
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return m


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_diffusers_adaln_modules(dtype, gen):
    """The kernels applied to the modules' own linear outputs reproduce AdaLayerNormZero,
    AdaLayerNormZeroSingle, AdaLayerNormContinuous and SD35AdaLayerNormZeroX. fp32: elementwise, tight.
    fp16/bf16: the modules round after every op (norm, 1 + scale, product, sum), so an element's error
    follows the intermediates' magnitude, not the output's; compared by relative L2 within 4 ulps (a
    wrong chunk order or a missing term is an O(1) error)."""
    from diffusers.models.normalization import (
        AdaLayerNormContinuous,
        AdaLayerNormZero,
        AdaLayerNormZeroSingle,
        SD35AdaLayerNormZeroX,
    )

    B, S, D = 2, 5, 48
    x = randn((B, S, D), dtype, gen, scale=2.0, offset=0.5)
    temb = randn((B, D), dtype, gen)

    def check(got, want, name):
        if dtype == torch.float32:
            assert_close(got, want.double(), dtype, rtol=2e-6, atol=2e-6, name=name, seed=gen.seed_value)
        else:
            err = rel_l2(got, want)
            assert err <= 4 * torch.finfo(dtype).eps, f"{name}: relative L2 {err:.3e} (seed {gen.seed_value})"

    with torch.no_grad():
        m = _rand_module(AdaLayerNormZero(D), gen).to(DEVICE, dtype)
        want = m(x, emb=temb)
        shift, scale, *_ = m.linear(m.silu(temb)).chunk(6, dim=1)
        got = layernorm.layer_norm_modulate(x, scale, shift, m.norm.eps)
        check(got, want[0], "AdaLayerNormZero")

        m = _rand_module(AdaLayerNormZeroSingle(D), gen).to(DEVICE, dtype)
        want = m(x, emb=temb)
        shift, scale, _ = m.linear(m.silu(temb)).chunk(3, dim=1)
        got = layernorm.layer_norm_modulate(x, scale, shift, m.norm.eps)
        check(got, want[0], "AdaLayerNormZeroSingle")

        m = _rand_module(AdaLayerNormContinuous(D, D, elementwise_affine=False, eps=1e-6), gen).to(DEVICE, dtype)
        want = m(x, temb)
        scale, shift = m.linear(m.silu(temb)).chunk(2, dim=1)  # scale first in this module
        got = layernorm.layer_norm_modulate(x, scale, shift, m.norm.eps)
        check(got, want, "AdaLayerNormContinuous")

        m = _rand_module(SD35AdaLayerNormZeroX(D), gen).to(DEVICE, dtype)
        want = m(x, emb=temb)
        c = m.linear(m.silu(temb)).chunk(9, dim=1)
        o1, o2 = layernorm.layer_norm_modulate_dual(x, c[1], c[0], c[7], c[6], m.norm.eps)
        check(o1, want[0], "SD35AdaLayerNormZeroX out")
        check(o2, want[5], "SD35AdaLayerNormZeroX out2")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [False, True])
def test_matches_torch_layernorm(dtype, affine, gen):
    """nn.LayerNorm computes in fp32 and rounds once, as the kernel does."""
    D = 150
    m = torch.nn.LayerNorm(D, eps=1e-6, elementwise_affine=affine)
    if affine:
        _rand_module(m, gen)
    m = m.to(DEVICE, dtype)
    x = randn((3, 4, D), dtype, gen, scale=2.0, offset=1.0)
    with torch.no_grad():
        want = m(x)
    with poisoned_outputs(), torch.no_grad():  # the parameters require grad; the kernel has no backward
        got = layernorm.layer_norm(x, m.weight, m.bias, m.eps)
    assert_close(got, want.double(), dtype, **_module_tol(dtype), seed=gen.seed_value)


def test_matches_mmdit_block_step_in_fp32(gen):
    """The FLUX/SD3 block step: h = h + gate[:, None] * attn; norm2(h) * (1 + scale[:, None]) + shift[:, None]."""
    B, S, D = 2, 9, 64
    h = randn((B, S, D), torch.float32, gen)
    attn = randn((B, S, D), torch.float32, gen)
    gate, scale, shift = (randn((B, D), torch.float32, gen, scale=0.5) for _ in range(3))
    norm2 = torch.nn.LayerNorm(D, elementwise_affine=False, eps=1e-6).to(DEVICE)
    want_h = h + gate.unsqueeze(1) * attn
    want = norm2(want_h) * (1 + scale[:, None]) + shift[:, None]
    with poisoned_outputs():
        got_h, got = layernorm.gated_residual_layer_norm_modulate(h, attn, gate, scale, shift, 1e-6)
    assert_close(got_h, want_h.double(), torch.float32, rtol=1e-6, atol=1e-6, seed=gen.seed_value)
    assert_close(got, want.double(), torch.float32, rtol=2e-6, atol=2e-6, seed=gen.seed_value)


# ---- empty and bad input --------------------------------------------------------------------
def test_empty_inputs():
    x = torch.empty((0, 64), device=DEVICE)
    assert layernorm.layer_norm(x).shape == (0, 64)
    x3 = torch.empty((2, 0, 64), device=DEVICE)
    sc = torch.ones((2, 64), device=DEVICE)
    assert layernorm.layer_norm_modulate(x3, sc, sc).shape == (2, 0, 64)
    o1, o2 = layernorm.layer_norm_modulate_dual(x3, sc, sc, sc, sc)
    assert o1.shape == o2.shape == (2, 0, 64)
    h_new, out = layernorm.gated_residual_layer_norm_modulate(x3, x3, sc, sc, sc)
    assert h_new.shape == out.shape == (2, 0, 64)


def _error_inputs(gen):
    return SimpleNamespace(gen=gen, x=randn((2, 4, 64), torch.float32, gen), one=torch.ones(64, device=DEVICE))


ERROR_CASES = [
    *kt.norm_error_cases(
        layernorm.layer_norm, layernorm.layer_norm_modulate, layernorm.gated_residual_layer_norm_modulate
    ),
    ("bias shape", ValueError, r"bias must have shape \[64\]", lambda t: layernorm.layer_norm(t.x, None, ones(2, 64))),
    (
        "scale broadcast",
        ValueError,
        r"scale of shape \(3, 64\) does not broadcast",
        lambda t: layernorm.layer_norm_modulate(t.x, ones(3, 64), ones(2, 64)),
    ),
    (
        "scale last stride",
        ValueError,
        "scale must be contiguous in its last dimension",
        lambda t: layernorm.layer_norm_modulate(t.x, ones(2, 64, 2)[..., 0], t.one),
    ),
    (
        "dual scale2 missing",
        ValueError,
        "scale, shift, scale2 and shift2 are all required",
        lambda t: layernorm.layer_norm_modulate_dual(t.x, t.one, t.one, None, t.one),
    ),
    (
        "gated y float16",
        TypeError,
        "y has dtype float16",
        lambda t: layernorm.gated_residual_layer_norm_modulate(t.x, t.x.half(), None, None, None),
    ),
    (
        "gate broadcast",
        ValueError,
        r"gate of shape \(5, 64\) does not broadcast",
        lambda t: layernorm.gated_residual_layer_norm_modulate(t.x, t.x, ones(5, 64), None, None),
    ),
    (
        "launch gate without residual",
        ValueError,
        "gate is only used with a residual",
        lambda t: layernorm._launch(t.x, None, t.one, None, None, None, None, None, None, 1e-6),
    ),
    (
        "launch scale2 without scale",
        ValueError,
        "scale2/shift2 need scale/shift",
        lambda t: layernorm._launch(t.x, None, None, None, None, None, None, t.one, t.one, 1e-6),
    ),
]


@kt.error_cases(ERROR_CASES)
def test_errors(case, gen):
    kt.assert_error_case(case, _error_inputs(gen))


@kt.cpu_only
def test_cpu_tensor_without_interpreter_is_rejected(monkeypatch):
    kt.assert_cpu_tensor_refused_without_interpreter(monkeypatch, lambda: layernorm.layer_norm(torch.ones(2, 8)))


def test_custom_op_under_torch_compile(gen):
    """torch.compile traces through the registered op (aot_eager keeps it cheap on the CPU)."""
    x = randn((2, 3, 64), torch.float32, gen)
    sc = randn((2, 64), torch.float32, gen, scale=0.2)
    sh = randn((2, 64), torch.float32, gen, scale=0.2)

    def f(x, sc, sh):
        h, out = layernorm.gated_residual_layer_norm_modulate(x, x * 2, sc, sc, sh)
        o1, o2 = layernorm.layer_norm_modulate_dual(out + h, sc, sh, sh, sc)
        return layernorm.layer_norm(o1 - o2) * 3

    compiled = kt.compile_aot_eager(f)
    got = compiled(x, sc, sh)
    assert_close(got, f(x, sc, sh).double(), torch.float32, seed=gen.seed_value)
    torch.library.opcheck(
        getattr(torch.ops, layernorm._NS).layer_norm_fused.default,
        (x, x * 2, sc, None, None, sc, sh, sh, sc, 1e-6),
        test_utils=("test_schema", "test_faketensor"),
    )


# ---- inputs requiring grad ------------------------------------------------------------------------
def _grad_cases(gen):
    """Public function -> (call taking a dict of named tensors, the tensors)."""
    f = torch.float32
    x, y = randn((2, 3, 64), f, gen), randn((2, 3, 64), f, gen)
    w, b = randn((64,), f, gen, scale=0.2, offset=1.0), randn((64,), f, gen, scale=0.2)
    g, sc, sh, sc2, sh2 = (randn((2, 64), f, gen, scale=0.3) for _ in range(5))
    return {
        "layer_norm": (lambda t: layernorm.layer_norm(t["x"], t["weight"], t["bias"]), dict(x=x, weight=w, bias=b)),
        "layer_norm_modulate": (
            lambda t: layernorm.layer_norm_modulate(t["x"], t["scale"], t["shift"], weight=t["weight"], bias=t["bias"]),
            dict(x=x, scale=sc, shift=sh, weight=w, bias=b),
        ),
        "layer_norm_modulate_dual": (
            lambda t: layernorm.layer_norm_modulate_dual(t["x"], t["scale"], t["shift"], t["scale2"], t["shift2"]),
            dict(x=x, scale=sc, shift=sh, scale2=sc2, shift2=sh2),
        ),
        "gated_residual_layer_norm_modulate": (
            lambda t: layernorm.gated_residual_layer_norm_modulate(
                t["h"], t["y"], t["gate"], t["scale"], t["shift"], weight=t["weight"], bias=t["bias"]
            ),
            dict(h=x, y=y, gate=g, scale=sc, shift=sh, weight=w, bias=b),
        ),
        "gated_residual_layer_norm_modulate_dual": (
            lambda t: layernorm.gated_residual_layer_norm_modulate_dual(
                t["h"], t["y"], t["gate"], t["scale"], t["shift"], t["scale2"], t["shift2"]
            ),
            dict(h=x, y=y, gate=g, scale=sc, shift=sh, scale2=sc2, shift2=sh2),
        ),
    }


@pytest.mark.parametrize(
    "fn",
    [
        "layer_norm",
        "layer_norm_modulate",
        "layer_norm_modulate_dual",
        "gated_residual_layer_norm_modulate",
        "gated_residual_layer_norm_modulate_dual",
    ],
)
def test_inputs_requiring_grad_are_refused_in_grad_mode(fn, gen):
    from test_launch import assert_refuses_inputs_requiring_grad

    call, tensors = _grad_cases(gen)[fn]
    assert_refuses_inputs_requiring_grad(fn, call, tensors)


# ---- 2-D [X, D] modulation with a 3-D x [B, S, D] ----------------------------------------------------
def _torch_modulate(x, sc, sh, eps=1e-6):
    """What torch broadcasting computes: layer_norm(x) * (1 + scale) + shift, in float64."""
    return layernorm.layer_norm_ref(x.double(), eps=eps) * (1 + sc.double()) + sh.double()


def test_2d_modulation_per_token_where_torch_broadcasts_it(gen):
    """[S, D] with S != B: torch broadcasts it per token (rmsnorm.py does the same); so does the kernel."""
    B, S, D = 2, 3, 48
    x = randn((B, S, D), torch.float32, gen)
    sc, sh = randn((S, D), torch.float32, gen, scale=0.3), randn((S, D), torch.float32, gen, scale=0.3)
    with poisoned_outputs():
        out = layernorm.layer_norm_modulate(x, sc, sh)
    assert_close(out, _torch_modulate(x, sc, sh), torch.float32, seed=gen.seed_value)
    assert_close(
        layernorm.layer_norm_modulate_ref(x.double(), sc.double(), sh.double()),
        _torch_modulate(x, sc, sh),
        torch.float32,
        seed=gen.seed_value,
        name="reference",
    )
    # the same reading in the gated residual (gate [S, D]) and the dual modulation
    y, g = randn((B, S, D), torch.float32, gen), randn((S, D), torch.float32, gen)
    h_new, out = layernorm.gated_residual_layer_norm_modulate(x, y, g, sc, sh)
    h_ref = x.double() + g.double() * y.double()
    assert_close(h_new, h_ref, torch.float32, seed=gen.seed_value, name="h")
    assert_close(out, _torch_modulate(h_new, sc, sh), torch.float32, seed=gen.seed_value)
    o1, o2 = layernorm.layer_norm_modulate_dual(x, sc, sh, sh, sc)
    assert_close(o2, _torch_modulate(x, sh, sc), torch.float32, seed=gen.seed_value, name="out2")
    # rmsnorm.py reads [S, D] the same way
    import rmsnorm

    assert_close(
        rmsnorm.rms_norm_modulate(x, sc, sh),
        rmsnorm.rms_norm_ref(x.double()) * (1 + sc.double()) + sh.double(),
        torch.float32,
        seed=gen.seed_value,
        name="rmsnorm",
    )


def test_2d_modulation_per_sample_where_torch_would_fail(gen):
    """[B, D] with B != S: torch cannot broadcast it; it means one row per sample (diffusers' AdaLN chunks)."""
    B, S, D = 3, 2, 48
    x = randn((B, S, D), torch.float32, gen)
    sc, sh = randn((B, D), torch.float32, gen, scale=0.3), randn((B, D), torch.float32, gen, scale=0.3)
    assert_close(
        layernorm.layer_norm_modulate(x, sc, sh),
        _torch_modulate(x, sc[:, None], sh[:, None]),
        torch.float32,
        seed=gen.seed_value,
    )
    # one row for everything: [1, D] reads the same either way
    assert_close(
        layernorm.layer_norm_modulate(x, sc[:1], sh[:1]),
        _torch_modulate(x, sc[:1], sh[:1]),
        torch.float32,
        seed=gen.seed_value,
        name="[1, D]",
    )


@pytest.mark.parametrize("which", ["scale", "shift", "gate", "scale2"])
def test_2d_modulation_ambiguous_when_batch_equals_tokens(which, gen):
    """x [3, 3, 48] with a [3, 48] scale: per sample (the diffusers form) or per token (torch
    broadcasting)? They give different answers; the kernel refuses and says how to disambiguate."""
    B = S = 3
    D = 48
    x, y = randn((B, S, D), torch.float32, gen), randn((B, S, D), torch.float32, gen)
    t = {k: randn((B, 1, D), torch.float32, gen, scale=0.3) for k in ("scale", "shift", "gate", "scale2", "shift2")}
    t[which] = t[which][:, 0]  # [3, 48]
    call = {
        "scale": lambda: layernorm.layer_norm_modulate(x, t["scale"], t["shift"]),
        "shift": lambda: layernorm.layer_norm_modulate(x, t["scale"], t["shift"]),
        "gate": lambda: layernorm.gated_residual_layer_norm_modulate(x, y, t["gate"], t["scale"], t["shift"]),
        "scale2": lambda: layernorm.layer_norm_modulate_dual(x, t["scale"], t["shift"], t["scale2"], t["shift2"]),
    }[which]
    pattern = (
        rf"{which} of shape \(3, 48\) is ambiguous for x of shape \(3, 3, 48\).*"
        rf"{which}\[:, None\].*one row per sample.*{which}\[None\].*one row per token"
    )
    with pytest.raises(ValueError, match=pattern):
        call()
    # the reference refuses it too, and both explicit forms work
    if which in ("scale", "shift"):
        with pytest.raises(ValueError, match="ambiguous"):
            layernorm.layer_norm_modulate_ref(x, t["scale"], t["shift"])
        sc, sh = t["scale"], t["shift"]
        per_sample = [v[:, None] if v.dim() == 2 else v for v in (sc, sh)]
        per_token = [v[None] if v.dim() == 2 else v for v in (sc, sh)]
        for name, args in (("per sample", per_sample), ("per token", per_token)):
            out = layernorm.layer_norm_modulate(x, *args)
            assert_close(out, _torch_modulate(x, *args), torch.float32, seed=gen.seed_value, name=name)

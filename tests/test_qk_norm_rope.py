# SPDX-License-Identifier: Apache-2.0
"""The fused LTX q/k RMSNorm + RoPE kernel (cos/sin given, or computed from grid coordinates in the kernel)
against float64 references and against the real diffusers / torch modules it replaces."""

import math

import pytest
import torch

import kernel_testing as kt
import qk_norm_rope as qkr
from kernel_testing import DEVICE, DTYPES, INTERPRET, assert_close, poisoned_outputs, randn
from test_rope import _angles_cos_sin, _weight, assert_pairs_close

ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")

# Tolerances: see tests/test_rope.py. RMSNorm + RoPE rounds the norm's output (once, or twice with
# cast_before_weight) before the rotation: each channel is off by <= 2 ULP of itself, an output by <= 2 ULP * r
# (r: the magnitude of the rotated pair), plus the final rounding: <= 3 ULP * r. Allow 5 ULP.


def _normed(x, w, eps=1e-5):
    """The float64 RMSNorm output (torch.nn.RMSNorm, no rounding before the weight): the pair the kernel rotates."""
    xf = x.double()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


# ---------------------------------------------------------------------------------------------
# 1. ltx_qk_rmsnorm_rope: norm_q/norm_k (torch.nn.RMSNorm across all heads) + RoPE, one launch
# ---------------------------------------------------------------------------------------------
def _fused_qk(batch, seq, ch, dtype, gen):
    """q and k as slices of one fused [B, S, 3C] projection (different base offsets, row stride 3C)."""
    qkv = randn((batch, seq, 3 * ch), dtype, gen, scale=2.0, offset=0.3)
    return qkv[:, :, :ch], qkv[:, :, ch : 2 * ch]


def _torch_norm(ch, weight, eps=1e-5):
    m = torch.nn.RMSNorm(ch, eps=eps, elementwise_affine=True, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        m.weight.copy_(weight)
    return m


@pytest.mark.parametrize(
    "dtype,batch,seq,ch,cast_before_weight",
    [
        (torch.bfloat16, 2, 3, 2048, False),
        (torch.bfloat16, 2, 5, 134, True),
        (torch.float32, 2, 5, 134, False),
        (torch.float16, 3, 3, 96, False),
        (torch.bfloat16, 1, 7, 128, False),
    ],
)
def test_qk_rmsnorm_rope_matches_float64_and_modules(dtype, batch, seq, ch, cast_before_weight, gen):
    q, k = _fused_qk(batch, seq, ch, dtype, gen)
    qw, kw = _weight(ch, dtype, gen), _weight(ch, dtype, gen)
    cos, sin = _angles_cos_sin((batch, seq, ch), gen)
    with poisoned_outputs():
        qo, ko = qkr.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, cos, sin, cast_before_weight=cast_before_weight)
    assert qo.dtype == ko.dtype == dtype and qo.shape == ko.shape == q.shape
    qr, kr = qkr.ltx_qk_rmsnorm_rope_ref(
        q.double(), k.double(), qw.double(), kw.double(), 1e-5, cos.double(), sin.double()
    )
    qn, kn = _normed(q, qw), _normed(k, kw)
    assert_pairs_close(qo, qr, qn, dtype, 5, True, gen, "q vs float64")
    assert_pairs_close(ko, kr, kn, dtype, 5, True, gen, "k vs float64")
    # The real modules in the low-precision dtype: torch.nn.RMSNorm then diffusers' apply_rotary_emb.
    # Whichever rounding this torch version's RMSNorm uses, both stay within the 5 ULP budget.
    with torch.no_grad():
        qe = ltx.apply_rotary_emb(_torch_norm(ch, qw)(q), (cos, sin))
        ke = ltx.apply_rotary_emb(_torch_norm(ch, kw)(k), (cos, sin))
    assert_pairs_close(qo, qe, qn, dtype, 5, True, gen, "q vs modules")
    assert_pairs_close(ko, ke, kn, dtype, 5, True, gen, "k vs modules")
    # The same-dtype reference with the same rounding choice rounds at the same places: natively
    # only the last fp32 bit can differ (2 ULP); the interpreter truncates each bf16 cast (4 ULP).
    ulps = 4 if INTERPRET and dtype == torch.bfloat16 else 2
    qr2, kr2 = qkr.ltx_qk_rmsnorm_rope_ref(q, k, qw, kw, 1e-5, cos, sin, cast_before_weight)
    assert_pairs_close(qo, qr2, qn, dtype, ulps, True, gen, "q vs same-dtype ref")
    assert_pairs_close(ko, kr2, kn, dtype, ulps, True, gen, "k vs same-dtype ref")


def test_qk_rmsnorm_rope_broadcast_tables_no_weight_and_separate_tensors(gen):
    """Separate contiguous q/k (to_q / to_k outputs), cos/sin [1, S, C], weightless norm, fp32 weights."""
    batch, seq, ch, dtype = 3, 3, 100, torch.bfloat16
    q = randn((batch, seq, ch), dtype, gen, scale=2.0)
    k = randn((batch, seq, ch), dtype, gen, scale=0.5)
    cos, sin = _angles_cos_sin((1, seq, ch), gen)
    for qw, kw in ((None, None), (_weight(ch, torch.float32, gen), _weight(ch, torch.float32, gen))):
        with poisoned_outputs():
            qo, ko = qkr.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-6, cos, sin)
        f64 = lambda t: None if t is None else t.double()  # noqa: E731
        qr, kr = qkr.ltx_qk_rmsnorm_rope_ref(q.double(), k.double(), f64(qw), f64(kw), 1e-6, cos.double(), sin.double())
        assert_pairs_close(qo, qr, _normed(q, qw, 1e-6), dtype, 5, True, gen, "q")
        assert_pairs_close(ko, kr, _normed(k, kw, 1e-6), dtype, 5, True, gen, "k")


@pytest.mark.parametrize("table_shape", ["1,S,D", "S,D", "B,S,D"])
@pytest.mark.parametrize(
    "dtype,heads,head_dim", [(torch.bfloat16, 3, 8), (torch.float32, 2, 6), (torch.float16, 5, 16)]
)
def test_qk_rmsnorm_rope_reads_a_per_head_table(table_shape, dtype, heads, head_dim, gen):
    """cos/sin of one head's width D (Wan: one row per token shared by every head) are read in place for
    each of the C / D heads: the same result as the table repeated over the heads (bit for bit: the kernel
    computes each element alike), and within the float64 reference's budget."""
    batch, seq = 2, 5
    ch = heads * head_dim
    q = randn((batch, seq, ch), dtype, gen, scale=2.0)
    k = randn((batch, seq, ch), dtype, gen, scale=0.5)
    qw, kw = _weight(ch, dtype, gen), _weight(ch, dtype, gen)
    lead = {"1,S,D": (1, seq), "S,D": (seq,), "B,S,D": (batch, seq)}[table_shape]
    cos, sin = _angles_cos_sin(lead + (head_dim,), gen)
    with poisoned_outputs():
        qo, ko = qkr.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-6, cos, sin)
    full = [t.repeat(*((1,) * (t.dim() - 1)), heads) for t in (cos, sin)]
    assert full[0].shape[-1] == ch
    qf, kf = qkr.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-6, *full)
    assert torch.equal(qo, qf) and torch.equal(ko, kf)
    qr, kr = qkr.ltx_qk_rmsnorm_rope_ref(
        q.double(), k.double(), qw.double(), kw.double(), 1e-6, cos.double(), sin.double()
    )
    assert_pairs_close(qo, qr, _normed(q, qw, 1e-6), dtype, 5, True, gen, "q vs float64")
    assert_pairs_close(ko, kr, _normed(k, kw, 1e-6), dtype, 5, True, gen, "k vs float64")


@pytest.mark.parametrize("width", [5, 6, 7])
def test_qk_rmsnorm_rope_refuses_a_table_that_is_not_per_head(width, gen):
    """A table narrower than C must be an even width dividing C (one head's pairs); others are refused."""
    q = randn((1, 3, 20), torch.float32, gen)
    cos, sin = _angles_cos_sin((1, 3, width), gen)
    with pytest.raises(ValueError, match="cos has shape"):
        qkr.ltx_qk_rmsnorm_rope(q, q.clone(), None, None, 1e-6, cos, sin)


# ---------------------------------------------------------------------------------------------
# 2. ltx_qk_rmsnorm_rope_coords: cos/sin computed in the kernel from the grid coordinates
# ---------------------------------------------------------------------------------------------
def _rope_module(ch):
    return ltx.LTXVideoRotaryPosEmbed(
        dim=ch, base_num_frames=20, base_height=2048, base_width=2048, patch_size=1, patch_size_t=1, theta=10000.0
    )


def _module_grid_and_tables(ch, batch, frames, height, width, scale, video_coords=None):
    """diffusers' (cos, sin) for this latent grid, and the grid the module built them from."""
    mod = _rope_module(ch)
    if video_coords is None:
        hs = torch.zeros(batch, frames * height * width, ch, device=DEVICE)
        cos, sin = mod(hs, frames, height, width, scale)
        grid = mod._prepare_video_coords(batch, frames, height, width, scale, DEVICE)
    else:
        hs = torch.zeros(batch, video_coords.shape[-1], ch, device=DEVICE)
        cos, sin = mod(hs, video_coords=video_coords)
        # the module's video_coords branch: divide each axis by its base size
        grid = torch.stack(
            [
                video_coords[:, 0] / mod.base_num_frames,
                video_coords[:, 1] / mod.base_height,
                video_coords[:, 2] / mod.base_width,
            ],
            dim=-1,
        )
    return grid, cos, sin


# rope_interpolation_scale as the LTX pipeline passes it: (temporal compression / frame rate, 32, 32)
LTX_SCALE = (8 / 25, 32, 32)


@pytest.mark.parametrize("ch", [2048, 134, 96, 100, 10])
def test_cos_sin_helpers_reproduce_diffusers_exactly(ch):
    """ltx_rope_freqs + ltx_cos_sin_from_coords give the module's cos/sin bit for bit (channel order,
    padding in front, frequency-major pairs)."""
    grid, cos, sin = _module_grid_and_tables(ch, 2, 3, 4, 5, LTX_SCALE)
    freqs = qkr.ltx_rope_freqs(ch, 10000.0, device=DEVICE)
    assert freqs.shape == (ch // 6,) and freqs.dtype == torch.float32
    c2, s2 = qkr.ltx_cos_sin_from_coords(grid, freqs, ch)
    assert c2.shape == cos.shape == (2, 60, ch)
    assert torch.equal(c2, cos) and torch.equal(s2, sin)


@pytest.mark.parametrize(
    "ch,dtype,frames,height,width",
    [
        (2048, torch.float32, 3, 1, 3),
        (134, torch.float32, 3, 3, 3),
        (96, torch.bfloat16, 1, 3, 5),
        (100, torch.float32, 2, 3, 3),
        (10, torch.float32, 1, 1, 3),
    ],
)
def test_coords_kernel_matches_cos_sin_kernel_fed_with_diffusers_tables(ch, dtype, frames, height, width, gen):
    """The coords form (cos/sin from coords in the kernel) vs the tables form fed with LTXVideoRotaryPosEmbed's
    cos/sin, and vs the float64 reference; odd S; C % 6 in {2, 0, 4}; C = 10 has one frequency."""
    batch = 2
    grid, cos, sin = _module_grid_and_tables(ch, batch, frames, height, width, LTX_SCALE)
    freqs = qkr.ltx_rope_freqs(ch, device=DEVICE)
    q, k = _fused_qk(batch, frames * height * width, ch, dtype, gen)
    qw, kw = _weight(ch, dtype, gen), _weight(ch, dtype, gen)
    with poisoned_outputs():
        q4, k4 = qkr.ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, grid, freqs)
        q3, k3 = qkr.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, cos, sin)
    qn, kn = _normed(q, qw), _normed(k, kw)
    if dtype == torch.float32:
        # only the in-kernel cos/sin differ from torch's (a few fp32 ulps of values <= 1)
        assert_close(q4, q3, torch.float32, rtol=1e-5, atol=1e-5, name="q: coords vs tables", seed=gen.seed_value)
        assert_close(k4, k3, torch.float32, rtol=1e-5, atol=1e-5, name="k: coords vs tables", seed=gen.seed_value)
    else:
        assert_pairs_close(q4, q3, qn, dtype, 2, True, gen, "q: coords vs tables")
        assert_pairs_close(k4, k3, kn, dtype, 2, True, gen, "k: coords vs tables")
    qr, kr = qkr.ltx_qk_rmsnorm_rope_coords_ref(q.double(), k.double(), qw.double(), kw.double(), 1e-5, grid, freqs)
    assert_pairs_close(q4, qr, qn, dtype, 5, True, gen, "q vs float64")
    assert_pairs_close(k4, kr, kn, dtype, 5, True, gen, "k vs float64")


def test_coords_kernel_padding_only_width(gen):
    """C = 4 < 6: no frequencies, every channel is padding (cos 1, sin 0): the output is the norm.
    (diffusers' module itself returns a 0-wide table for dim < 6, so compare with the helpers.)"""
    q, k = _fused_qk(2, 3, 4, torch.float32, gen)
    grid = torch.rand(2, 3, 3, generator=gen).to(DEVICE)
    freqs = qkr.ltx_rope_freqs(4, device=DEVICE)
    assert freqs.numel() == 0
    cos, sin = qkr.ltx_cos_sin_from_coords(grid, freqs, 4)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    with poisoned_outputs():
        q4, k4 = qkr.ltx_qk_rmsnorm_rope_coords(q, k, None, None, 1e-5, grid, freqs)
    assert_close(q4, _normed(q, None), torch.float32, name="q", seed=gen.seed_value)
    assert_close(k4, _normed(k, None), torch.float32, name="k", seed=gen.seed_value)


def test_coords_kernel_distinct_per_sample_coords_and_broadcast(gen):
    """The module's video_coords path gives each sample its own grid; coords [1, S, 3] and [S, 3]
    broadcast over the batch; coords may be strided (a transpose of [B, 3, S])."""
    ch, batch, seq = 134, 2, 7
    vc = torch.stack(
        [
            torch.rand(batch, seq, generator=gen) * 30,
            torch.rand(batch, seq, generator=gen) * 900,
            torch.rand(batch, seq, generator=gen) * 900,
        ],
        dim=1,
    ).to(DEVICE)  # [B, 3, S] in frames / pixels, as the module's video_coords argument
    grid, cos, sin = _module_grid_and_tables(ch, batch, None, None, None, None, video_coords=vc)
    assert not torch.equal(cos[0], cos[1])
    freqs = qkr.ltx_rope_freqs(ch, device=DEVICE)
    q, k = _fused_qk(batch, seq, ch, torch.float32, gen)
    qw, kw = _weight(ch, torch.float32, gen), _weight(ch, torch.float32, gen)
    grid_t = grid.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (3S, 1, S)
    with poisoned_outputs():
        q4, k4 = qkr.ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, grid_t, freqs)
        q3, k3 = qkr.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, cos, sin)
    assert_close(q4, q3, torch.float32, rtol=1e-5, atol=1e-5, name="q", seed=gen.seed_value)
    assert_close(k4, k3, torch.float32, rtol=1e-5, atol=1e-5, name="k", seed=gen.seed_value)
    for g in (grid[:1], grid[0]):
        with poisoned_outputs():
            q4, k4 = qkr.ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, g, freqs)
        c1, s1 = qkr.ltx_cos_sin_from_coords(g, freqs, ch)
        q3, k3 = qkr.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, c1, s1)
        assert_close(q4, q3, torch.float32, rtol=1e-5, atol=1e-5, name="q broadcast", seed=gen.seed_value)
        assert_close(k4, k3, torch.float32, rtol=1e-5, atol=1e-5, name="k broadcast", seed=gen.seed_value)


def test_ltx_rope_freqs_other_theta():
    for theta in (10000.0, 500.0):
        ref = theta ** torch.linspace(math.log(1.0, theta), math.log(theta, theta), 20, dtype=torch.float32)
        assert torch.equal(qkr.ltx_rope_freqs(120, theta), ref * math.pi / 2.0)


# ---------------------------------------------------------------------------------------------
# Custom ops, torch.compile tracing, empty inputs, errors
# ---------------------------------------------------------------------------------------------
def test_custom_ops_match_public_functions(gen):
    ops = getattr(torch.ops, qkr._NS)
    assert qkr._NS == "rtk_qk_norm_rope"
    batch, seq, ch = 2, 3, 96
    x = randn((batch, seq, ch), torch.bfloat16, gen)
    cos, sin = _angles_cos_sin((batch, seq, ch), gen)
    w = _weight(ch, torch.bfloat16, gen)
    a = ops.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, cos, sin, False)
    b = qkr.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, cos, sin)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    grid = torch.rand(1, seq, 3, generator=gen).to(DEVICE)
    freqs = qkr.ltx_rope_freqs(ch, device=DEVICE)
    a = ops.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid, freqs, False)
    b = qkr.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid, freqs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_opcheck_fake_registrations(gen):
    """torch.library.opcheck: schema and fake (meta) implementations agree with the kernels."""
    ops = getattr(torch.ops, qkr._NS)
    x = randn((2, 3, 12), torch.float32, gen)
    cos, sin = _angles_cos_sin((1, 3, 12), gen)
    w = _weight(12, torch.float32, gen)
    grid = torch.rand(2, 3, 3, generator=gen).to(DEVICE)
    freqs = qkr.ltx_rope_freqs(12, device=DEVICE)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.ltx_qk_rmsnorm_rope, (x, x, w, w, 1e-5, cos, sin, False), test_utils=tests)
    torch.library.opcheck(ops.ltx_qk_rmsnorm_rope_coords, (x, x, w, w, 1e-5, grid, freqs, True), test_utils=tests)


def test_compiled_graph_calls_the_custom_op(gen):
    """Under torch.compile the public function routes through the custom op (no graph break)."""
    x = randn((2, 3, 12), torch.float32, gen)
    k = randn((2, 3, 12), torch.float32, gen)
    w = _weight(12, torch.float32, gen)
    grid = torch.rand(2, 3, 3, generator=gen).to(DEVICE)
    freqs = qkr.ltx_rope_freqs(12, device=DEVICE)

    def f(q, k):
        return qkr.ltx_qk_rmsnorm_rope_coords(q, k, w, w, 1e-5, grid, freqs)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    a, b = compiled(x, k), f(x, k)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_inputs():
    for batch, seq in ((2, 0), (0, 3)):
        x = torch.empty(batch, seq, 96, device=DEVICE, dtype=torch.bfloat16)
        cos = torch.empty(1, seq, 96, device=DEVICE)
        qo, ko = qkr.ltx_qk_rmsnorm_rope(x, x, None, None, 1e-5, cos, cos)
        assert qo.shape == ko.shape == x.shape
        grid = torch.empty(1, seq, 3, device=DEVICE)
        qo, ko = qkr.ltx_qk_rmsnorm_rope_coords(x, x, None, None, 1e-5, grid, qkr.ltx_rope_freqs(96, device=DEVICE))
        assert qo.shape == ko.shape == x.shape


def _error_cases():
    d, bf = DEVICE, torch.bfloat16
    x = torch.ones(2, 3, 12, device=d, dtype=bf)
    cs = torch.ones(2, 3, 12, device=d)
    w = torch.ones(12, device=d, dtype=bf)
    grid = torch.zeros(2, 3, 3, device=d)
    fr = torch.ones(2, device=d)
    wide = torch.empty(1, 0, 16386, device=d)
    return [
        (
            "qk q 2d",
            ValueError,
            r"q must be \[B, S, C\]",
            lambda: qkr.ltx_qk_rmsnorm_rope(x[0], x[0], w, w, 1e-5, cs, cs),
        ),
        (
            "qk odd C",
            ValueError,
            "even channel count",
            lambda: qkr.ltx_qk_rmsnorm_rope(x[..., :11], x[..., :11], None, None, 1e-5, cs[..., :11], cs[..., :11]),
        ),
        (
            "qk q last stride",
            ValueError,
            "q must be contiguous in its last dimension",
            lambda: qkr.ltx_qk_rmsnorm_rope(x.repeat(1, 1, 2)[..., ::2], x, w, w, 1e-5, cs, cs),
        ),
        (
            "qk cos last stride",
            ValueError,
            "cos must be contiguous in its last dimension",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, torch.ones(2, 3, 24, device=d)[..., ::2], cs),
        ),
        (
            "qk device",
            ValueError,
            "cos is on meta",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, cs.to("meta"), cs),
        ),
        ("qk k shape", ValueError, "k has shape", lambda: qkr.ltx_qk_rmsnorm_rope(x, x[:, :2], w, w, 1e-5, cs, cs)),
        (
            "qk k dtype",
            TypeError,
            "k has dtype float16 but q has dtype bfloat16",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x.half(), w, w, 1e-5, cs, cs),
        ),
        (
            "qk weight shape",
            ValueError,
            r"q_weight must have shape \[12\]",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w[:6], w, 1e-5, cs, cs),
        ),
        (
            "qk one weight",
            ValueError,
            "both be tensors or both be None",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w, None, 1e-5, cs, cs),
        ),
        (
            "qk weight stride",
            ValueError,
            "k_weight must be contiguous",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w, torch.ones(24, device=d)[::2], 1e-5, cs, cs),
        ),
        (
            "qk eps",
            ValueError,
            "eps must be a non-negative float",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w, w, -1.0, cs, cs),
        ),
        (
            "qk eps type",
            ValueError,
            "eps must be a non-negative float",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w, w, "1e-5", cs, cs),
        ),
        (
            "qk cos shape",
            ValueError,
            r"cos has shape \(2, 2, 12\)",
            lambda: qkr.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, cs[:, :2], cs),
        ),
        (
            "qk width",
            ValueError,
            "unsupported width",
            lambda: qkr.ltx_qk_rmsnorm_rope(wide, wide, None, None, 1e-5, wide[0], wide[0]),
        ),
        (
            "coords freqs len",
            ValueError,
            r"freqs has shape \(3,\); expected \[2\]",
            lambda: qkr.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid, torch.ones(3, device=d)),
        ),
        (
            "coords shape",
            ValueError,
            r"coords has shape \(2, 3, 2\)",
            lambda: qkr.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid[..., :2], fr),
        ),
        (
            "coords dtype",
            TypeError,
            "coords has dtype int64",
            lambda: qkr.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid.long(), fr),
        ),
        (
            "coords q int",
            TypeError,
            "q has dtype int32",
            lambda: qkr.ltx_qk_rmsnorm_rope_coords(x.int(), x, w, w, 1e-5, grid, fr),
        ),
    ]


@kt.error_cases(_error_cases())
def test_errors(case):
    kt.assert_error_case(case)


@kt.cpu_only
def test_cpu_tensor_without_interpreter_is_rejected(monkeypatch):
    x = torch.ones(1, 2, 4)
    kt.assert_cpu_tensor_refused_without_interpreter(
        monkeypatch,
        lambda: qkr.ltx_qk_rmsnorm_rope(x, x, None, None, 1e-6, x, x),
        match="CPU tensor: Triton kernels run on a GPU",
    )


def test_supported_dtypes():
    assert set(DTYPES) == set(qkr._SUPPORTED_DTYPES)


def test_sincos_over_video_rope_angles(gen):
    """The kernel's shared-reduction sin/cos (_sincos) against float64 over |angle| <= 2e4 (LTX-Video's
    largest frequency is 10000 * pi / 2 times coordinates in [-1, 1]) and around the quadrant edges."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(A, S, C, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        s, c = qkr._sincos(tl.load(A + offs, mask=m, other=0.0))
        tl.store(S + offs, s, mask=m)
        tl.store(C + offs, c, mask=m)

    edges = torch.arange(-40, 41, dtype=torch.float64) * (math.pi / 4)
    a = (
        torch.cat(
            [
                (torch.rand(20000, generator=gen, dtype=torch.float64) * 2 - 1) * 2e4,
                torch.randn(5000, generator=gen, dtype=torch.float64) * 3,
                (edges[:, None] + torch.linspace(-1e-5, 1e-5, 11, dtype=torch.float64)).flatten(),
            ]
        )
        .float()
        .to(DEVICE)
    )
    s = torch.full_like(a, float("nan"))
    c = torch.full_like(a, float("nan"))
    _probe[(triton.cdiv(a.numel(), 1024),)](a, s, c, a.numel(), BLOCK=1024)
    ad = a.double()
    err = max((s.double() - torch.sin(ad)).abs().max().item(), (c.double() - torch.cos(ad)).abs().max().item())
    assert err < 2.5e-7, f"max |error| {err:.3g} (fp32 ulp at 1 is 1.2e-7)"


# ---------------------------------------------------------------------------------------------
# Inputs requiring grad
# ---------------------------------------------------------------------------------------------
def _grad_cases(gen):
    """Public function -> (call taking a dict of named tensors, the tensors)."""
    f = torch.float32
    q, k = randn((2, 4, 48), f, gen), randn((2, 4, 48), f, gen)
    cos, sin = _angles_cos_sin((2, 4, 48), gen)
    wq, wk = _weight(48, f, gen), _weight(48, f, gen)
    coords = torch.rand(2, 4, 3, generator=gen).to(DEVICE)
    freqs = qkr.ltx_rope_freqs(48, device=DEVICE)
    return {
        "ltx_qk_rmsnorm_rope": (
            lambda t: qkr.ltx_qk_rmsnorm_rope(t["q"], t["k"], t["q_weight"], t["k_weight"], 1e-6, t["cos"], t["sin"]),
            dict(q=q, k=k, q_weight=wq, k_weight=wk, cos=cos, sin=sin),
        ),
        "ltx_qk_rmsnorm_rope_coords": (
            lambda t: qkr.ltx_qk_rmsnorm_rope_coords(
                t["q"], t["k"], t["q_weight"], t["k_weight"], 1e-6, t["coords"], t["freqs"]
            ),
            dict(q=q, k=k, q_weight=wq, k_weight=wk, coords=coords, freqs=freqs),
        ),
    }


@pytest.mark.parametrize("fn", ["ltx_qk_rmsnorm_rope", "ltx_qk_rmsnorm_rope_coords"])
def test_inputs_requiring_grad_are_refused_in_grad_mode(fn, gen):
    from test_launch import assert_refuses_inputs_requiring_grad

    call, tensors = _grad_cases(gen)[fn]
    assert_refuses_inputs_requiring_grad(fn, call, tensors)


@pytest.mark.parametrize("magnitude", [1e3, 1e5, 1e7, 1e9])
def test_coords_kernel_angles_far_out_are_right_or_nan(magnitude, gen):
    """The in-kernel sin/cos reduce the angle exactly only below 2**22 rad. Below that the output must
    match the float64 reference; at or above it every output pair that used such an angle must be NaN,
    never a plausible wrong (let alone unbounded) value."""
    ch, batch, seq = 12, 1, 6
    q, k = _fused_qk(batch, seq, ch, torch.float32, gen)
    freqs = qkr.ltx_rope_freqs(ch, device=DEVICE)  # 2 frequencies, the largest pi/2
    coords = (torch.rand(batch, seq, 3, generator=gen) * magnitude).to(DEVICE)
    with poisoned_outputs():
        q4, _ = qkr.ltx_qk_rmsnorm_rope_coords(q, k, None, None, 1e-5, coords, freqs)
    qr, _ = qkr.ltx_qk_rmsnorm_rope_coords_ref(q.double(), k.double(), None, None, 1e-5, coords, freqs)
    # the angle of each output channel pair, as diffusers forms it: pair p (after the C % 6 padding
    # pairs; none here) uses freqs[p // 3] on axis p % 3 of coords * 2 - 1
    grid = coords.double() * 2 - 1
    angles = torch.stack([grid[..., p % 3] * freqs[p // 3].double() for p in range(ch // 2)], -1)
    angles = angles.repeat_interleave(2, -1).abs().cpu()
    far, near = angles >= 2.0**22 * (1 + 1e-5), angles < 2.0**22 * (1 - 1e-5)  # fp32 rounding at the edge
    q4c, qrc = q4.cpu().double(), qr.cpu().double()
    assert torch.isnan(q4c[far]).all(), "angles >= 2**22 must give NaN"
    assert torch.isfinite(q4c[near]).all()
    # fp32 angles near 1e7 carry an absolute error of about 0.5 rad already in torch's own fp32 product;
    # compare with the reference computed from the same fp32 angles only where that error is small
    small = near & (angles < 2.0**14)
    assert_close(q4c[small], qrc[small], torch.float64, rtol=1e-4, atol=1e-4, name="q", seed=gen.seed_value)

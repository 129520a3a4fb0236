# SPDX-License-Identifier: Apache-2.0
"""RoPE kernels (interleaved LTX-Video, rotate-half Llama/HF, fused LTX q/k RMSNorm + RoPE with cos/sin
given or computed from grid coordinates) against float64 references and against the real diffusers /
transformers / torch code they replace."""

import math

import pytest
import torch

import kernel_testing as kt
import rope
from kernel_testing import DEVICE, DTYPES, INTERPRET, assert_close, poisoned_outputs, randn

ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")

# ---------------------------------------------------------------------------------------------
# Tolerances. A rotation mixes the two channels of a pair, so an output can be much smaller than
# the inputs that produced it (cancellation): errors are measured relative to the magnitude
# r = sqrt(a^2 + b^2) of the pair (a, b) that is rotated (x itself, or the normalised x in the
# fused kernels). With cos^2 + sin^2 = 1 per channel, every output is at most r in magnitude.
# ULP is the spacing of the dtype at 1.0 (2^-7 for bf16): the interpreter truncates fp32 -> bf16,
# which costs up to one ULP of relative error instead of half.
# * RoPE alone rounds once at the end: <= 1 ULP * r, plus fp32 math (~1e-7). Allow 2 ULP.
# * RMSNorm + RoPE also rounds the norm's output (once, or twice with cast_before_weight) before
#   the rotation: each channel is off by <= 2 ULP of itself, an output by <= 2 ULP * r, plus the
#   final rounding: <= 3 ULP * r. Allow 5 ULP.
# fp32 outputs: 1e-5 * r covers the fp32 reduction, rsqrt and cos/sin of angles up to ~2e4 rad.
# ---------------------------------------------------------------------------------------------
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _tol(dtype, ulps):
    return 1e-5 if dtype == torch.float32 else ulps * ULP[dtype]


def _pair_norm(t, interleaved):
    t = t.detach().to("cpu", torch.float64)
    if interleaved:
        return t.unflatten(-1, (-1, 2)).pow(2).sum(-1).sqrt().repeat_interleave(2, dim=-1)
    a, b = t.chunk(2, dim=-1)
    r = (a * a + b * b).sqrt()
    return torch.cat([r, r], dim=-1)


def assert_pairs_close(out, ref, rotated, dtype, ulps, interleaved, gen, name="output"):
    """|out - ref| <= ulps * ULP * (magnitude of the rotated input pair), elementwise."""
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    scale = torch.maximum(_pair_norm(rotated, interleaved), _pair_norm(r, interleaved)).clamp_min(1e-30)
    assert_close(o / scale, r / scale, dtype, rtol=0.0, atol=_tol(dtype, ulps), name=name, seed=gen.seed_value)


def _normed(x, w, eps=1e-5):
    """The float64 RMSNorm output: the pair that the fused kernels rotate."""
    return rope._rms_norm_module_ref(x.double(), None if w is None else w.double(), eps, False)


def _angles_cos_sin(shape, gen, dtype=torch.float32, scale=20.0):
    """Independent random angles per channel (cos[2i] != cos[2i+1]): the generic kernels must apply
    the formula channel by channel, as diffusers' apply_rotary_emb does."""
    a = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    return a.cos().to(DEVICE, dtype), a.sin().to(DEVICE, dtype)


def _weight(n, dtype, gen):
    return randn((n,), dtype, gen, scale=0.2, offset=1.0)


# ---------------------------------------------------------------------------------------------
# 1. ltx_rope: interleaved pairs (diffusers' LTX apply_rotary_emb)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,batch,seq,ch",
    [
        (torch.bfloat16, 2, 3, 2048),
        (torch.float32, 2, 5, 134),
        (torch.float16, 2, 7, 96),
        (torch.bfloat16, 3, 5, 128),
        (torch.float32, 1, 1, 2),
    ],
)
def test_ltx_rope_matches_float64_and_diffusers(dtype, batch, seq, ch, gen):
    x = randn((batch, seq, ch), dtype, gen, scale=2.0, offset=0.1)
    cos, sin = _angles_cos_sin((batch, seq, ch), gen)  # distinct per sample
    with poisoned_outputs():
        out = rope.ltx_rope(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    ref = rope.ltx_rope_ref(x.double(), cos.double(), sin.double())
    assert_pairs_close(out, ref, x, dtype, 2, True, gen, "vs float64")
    eager = ltx.apply_rotary_emb(x, (cos, sin))
    assert_pairs_close(out, eager, x, dtype, 2, True, gen, "vs diffusers")
    # the pure-PyTorch reference is diffusers' formula in the low-precision dtype too
    assert_pairs_close(rope.ltx_rope_ref(x, cos, sin), eager, x, dtype, 1, True, gen, "ref vs diffusers")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("table", ["batch1", "2d", "bf16"])
def test_ltx_rope_strided_rows_and_broadcast_tables(dtype, table, gen):
    """x is the k slice of a fused [B, S, 3C] projection (read in place); cos/sin shared by the batch."""
    batch, seq, ch = 2, 5, 96
    fused = randn((batch, seq, 3 * ch), dtype, gen, scale=2.0)
    x = fused[:, :, ch : 2 * ch]
    assert not x.is_contiguous()
    cos, sin = _angles_cos_sin((1, seq, ch), gen, torch.bfloat16 if table == "bf16" else torch.float32)
    if table == "2d":
        cos, sin = cos[0], sin[0]
    with poisoned_outputs():
        out = rope.ltx_rope(x, cos, sin)
    ref = rope.ltx_rope_ref(x.double(), cos.double(), sin.double())
    assert_pairs_close(out, ref, x, dtype, 2, True, gen)
    eager = ltx.apply_rotary_emb(x, (cos.float(), sin.float()))
    assert_pairs_close(out, eager, x, dtype, 2, True, gen, "vs diffusers")


def test_ltx_rope_wide_rows_use_column_chunks(gen):
    """Rows wider than one program's chunk (4096) are split over a second grid axis; 4102 leaves a
    partial last chunk."""
    ch = rope._MAX_CHUNK + 6
    x = randn((1, 2, ch), torch.bfloat16, gen)
    cos, sin = _angles_cos_sin((1, 2, ch), gen)
    with poisoned_outputs():
        out = rope.ltx_rope(x, cos, sin)
    ref = rope.ltx_rope_ref(x.double(), cos.double(), sin.double())
    assert_pairs_close(out, ref, x, torch.bfloat16, 2, True, gen)


# ---------------------------------------------------------------------------------------------
# 2. rope_rotate_half: Llama / HF transformers
# ---------------------------------------------------------------------------------------------
def _hf_cos_sin(batch, seq, dim, gen, dtype):
    """cos/sin as transformers' rotary embedding returns them: [B, S, D], both halves equal."""
    a = torch.randn(batch, seq, dim // 2, generator=gen, dtype=torch.float64) * 10
    a = torch.cat([a, a], dim=-1)
    return a.cos().to(DEVICE, dtype), a.sin().to(DEVICE, dtype)


@pytest.mark.parametrize(
    "dtype,dim,table",
    [
        (torch.bfloat16, 64, "bsd"),
        (torch.float32, 128, "bsd"),
        (torch.float16, 6, "sd"),
        (torch.bfloat16, 96, "b1sd"),
        (torch.float32, 2, "1hsd"),
    ],
)
def test_rope_rotate_half_matches_float64_and_transformers(dtype, dim, table, gen):
    batch, heads, seq = 2, 3, 5
    # [B, S, H, D] -> [B, H, S, D] view, as attention layers produce q/k
    x = randn((batch, seq, heads, dim), dtype, gen, scale=2.0).transpose(1, 2)
    cos, sin = _hf_cos_sin(batch, seq, dim, gen, dtype)  # distinct per sample, in the model dtype as HF does
    if table == "sd":
        cos, sin = cos[0], sin[0]
    elif table == "b1sd":
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    elif table == "1hsd":  # per-head tables, shared by the batch
        c64 = torch.randn(1, heads, seq, dim, generator=gen, dtype=torch.float64)
        cos, sin = c64.cos().to(DEVICE, torch.float32), c64.sin().to(DEVICE, torch.float32)
    with poisoned_outputs():
        out = rope.rope_rotate_half(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    assert out.stride() == x.stride()  # same layout as the eager expression returns for a dense x
    ref = rope.rope_rotate_half_ref(x.double(), cos.double(), sin.double())
    assert_pairs_close(out, ref, x, dtype, 2, False, gen, "vs float64")
    if table in ("bsd", "sd"):
        # transformers computes in the model dtype (three roundings): allow 4 ULP of the pair
        llama = pytest.importorskip("transformers.models.llama.modeling_llama")
        c3, s3 = (cos, sin) if table == "bsd" else (cos[None], sin[None])  # HF wants [B or 1, S, D]
        q_embed, _ = llama.apply_rotary_pos_emb(x, x, c3.to(dtype), s3.to(dtype))
        assert_pairs_close(out, q_embed, x, dtype, 4, False, gen, "vs transformers")


def test_rope_rotate_half_strided_slice_and_wide_head(gen):
    """q sliced out of a fused [B, S, 3, H, D] projection (not dense: the output is contiguous), and a
    head dim whose half exceeds one program's chunk."""
    batch, seq, heads, dim = 2, 3, 2, 32
    qkv = randn((batch, seq, 3, heads, dim), torch.bfloat16, gen)
    q = qkv[:, :, 0].transpose(1, 2)
    cos, sin = _hf_cos_sin(batch, seq, dim, gen, torch.float32)
    with poisoned_outputs():
        out = rope.rope_rotate_half(q, cos, sin)
    ref = rope.rope_rotate_half_ref(q.double(), cos.double(), sin.double())
    assert_pairs_close(out, ref, q, torch.bfloat16, 2, False, gen)

    dim = rope._MAX_CHUNK + 4  # half = 2050 > 2048 columns per program
    x = randn((1, 1, 2, dim), torch.float32, gen)
    cos, sin = _hf_cos_sin(1, 2, dim, gen, torch.float32)
    with poisoned_outputs():
        out = rope.rope_rotate_half(x, cos, sin)
    ref = rope.rope_rotate_half_ref(x.double(), cos.double(), sin.double())
    assert_pairs_close(out, ref, x, torch.float32, 2, False, gen, "wide")


@pytest.mark.parametrize("dtype,table", [(torch.bfloat16, "bhsr"), (torch.float32, "bsr"), (torch.float16, "sr")])
def test_rope_rotate_half_reads_tables_per_channel_pair(dtype, table, gen):
    """cos/sin of width D / 2 (diffusers' apply_split_rotary_emb: one value for channels c and c + D / 2, here as
    LTX-2's rope module returns them, [B, H, S, D / 2] views of token-major tables) are read in place: the
    float64 reference of the doubled tables, bit for bit what the doubled tables give the kernel, and diffusers'
    function."""
    batch, heads, seq, dim = 2, 3, 5, 24
    x = randn((batch, seq, heads, dim), dtype, gen, scale=2.0).transpose(1, 2)
    a = torch.randn(batch, seq, heads, dim // 2, generator=gen, dtype=torch.float64) * 10
    cos, sin = (t.to(DEVICE, torch.float32).transpose(1, 2) for t in (a.cos(), a.sin()))  # [B, H, S, D / 2] views
    if table == "bsr":
        cos, sin = cos[:, 0], sin[:, 0]
    elif table == "sr":
        cos, sin = cos[0, 0], sin[0, 0]
    with poisoned_outputs():
        out = rope.rope_rotate_half(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape and out.stride() == x.stride()
    doubled = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    ref = rope.rope_rotate_half_ref(x.double(), *(t.double() for t in doubled))
    assert_pairs_close(out, ref, x, dtype, 2, False, gen, "vs float64")
    assert torch.equal(out, rope.rope_rotate_half(x, *doubled)), "the doubled tables give the same values"
    assert torch.equal(rope.rope_rotate_half_ref(x, cos, sin), rope.rope_rotate_half_ref(x, *doubled))
    if table == "bhsr":
        ltx2 = pytest.importorskip("diffusers.models.transformers.transformer_ltx2")
        theirs = ltx2.apply_split_rotary_emb(x.transpose(1, 2).flatten(2), (cos, sin))
        assert_pairs_close(out, theirs.unflatten(2, (heads, dim)).transpose(1, 2), x, dtype, 2, False, gen)
    with pytest.raises(ValueError, match="one per channel pair"):
        rope.rope_rotate_half(x, cos, doubled[1])


# ---------------------------------------------------------------------------------------------
# 2b. rope_interleaved: diffusers' apply_rotary_emb on [B, H, S, D] (real per-channel or complex tables)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype,dim,table",
    [
        (torch.bfloat16, 64, "sd"),  # FLUX / CogVideoX: [S, D] fp32 tables, x [B, S, H, D] read transposed
        (torch.float32, 128, "bsd"),
        (torch.float16, 6, "1hsd"),
        (torch.bfloat16, 96, "complex"),  # Lumina-style complex [B, S, D // 2]: its parts are strided views
        (torch.float32, 2, "complex_sd"),
    ],
)
def test_rope_interleaved_matches_float64_and_diffusers(dtype, dim, table, gen):
    from diffusers.models.embeddings import apply_rotary_emb

    batch, heads, seq = 2, 3, 5
    x_bshd = randn((batch, seq, heads, dim), dtype, gen, scale=2.0)
    x = x_bshd.transpose(1, 2)  # [B, H, S, D] view, as processors with sequence_dim=1 hold q/k
    angles = torch.randn(batch, seq, dim // 2, generator=gen, dtype=torch.float64) * 10
    if table.startswith("complex"):
        freqs = torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(DEVICE)
        freqs = freqs[:1] if table == "complex_sd" else freqs  # [1, S, D/2] shared by the batch
        parts = torch.view_as_real(freqs)
        cos, sin = parts[..., 0], parts[..., 1]  # strided views: one value per channel pair
    else:
        a = angles.repeat_interleave(2, -1)  # per channel, pairs equal (as diffusers' tables)
        cos, sin = a.cos().to(DEVICE, torch.float32), a.sin().to(DEVICE, torch.float32)
        if table == "sd":
            cos, sin = cos[0], sin[0]
        elif table == "1hsd":
            c64 = torch.randn(1, heads, seq, dim, generator=gen, dtype=torch.float64)
            cos, sin = c64.cos().to(DEVICE, torch.float32), c64.sin().to(DEVICE, torch.float32)
    with poisoned_outputs():
        out = rope.rope_interleaved(x, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape and out.stride() == x.stride()
    ref = rope.rope_interleaved_ref(x.double(), cos.double(), sin.double())
    assert_pairs_close(out, ref, x, dtype, 2, True, gen, "vs float64")
    if table == "sd":  # diffusers computes in fp32 and rounds once too
        want = apply_rotary_emb(x_bshd, (cos, sin), sequence_dim=1).transpose(1, 2)
        assert_pairs_close(out, want, x, dtype, 1, True, gen, "vs diffusers")
    elif table.startswith("complex"):
        want = apply_rotary_emb(x_bshd, freqs, use_real=False).transpose(1, 2)
        assert_pairs_close(out, want, x, dtype, 1, True, gen, "vs diffusers")


def test_rope_interleaved_wide_head_and_bad_tables(gen):
    dim = rope._MAX_CHUNK + 4  # more channels than one program's chunk
    x = randn((1, 1, 2, dim), torch.float32, gen)
    a = torch.randn(2, dim, generator=gen, dtype=torch.float64)
    cos, sin = a.cos().to(DEVICE, torch.float32), a.sin().to(DEVICE, torch.float32)  # pairs not equal: any table
    with poisoned_outputs():
        out = rope.rope_interleaved(x, cos, sin)
    assert_pairs_close(
        out, rope.rope_interleaved_ref(x.double(), cos.double(), sin.double()), x, torch.float32, 2, True, gen
    )
    with pytest.raises(ValueError, match="expected 6 .one value per channel. or 3 .one per channel pair."):
        rope.rope_interleaved(x[..., :6], cos[:, :5], sin[:, :5])
    with pytest.raises(ValueError, match="even head dim"):
        rope.rope_interleaved(x[..., :5], cos[:, :5], sin[:, :5])


# ---------------------------------------------------------------------------------------------
# 3. ltx_qk_rmsnorm_rope: norm_q/norm_k (torch.nn.RMSNorm across all heads) + RoPE, one launch
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
        qo, ko = rope.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, cos, sin, cast_before_weight=cast_before_weight)
    assert qo.dtype == ko.dtype == dtype and qo.shape == ko.shape == q.shape
    qr, kr = rope.ltx_qk_rmsnorm_rope_ref(
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
    qr2, kr2 = rope.ltx_qk_rmsnorm_rope_ref(q, k, qw, kw, 1e-5, cos, sin, cast_before_weight)
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
            qo, ko = rope.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-6, cos, sin)
        f64 = lambda t: None if t is None else t.double()  # noqa: E731
        qr, kr = rope.ltx_qk_rmsnorm_rope_ref(
            q.double(), k.double(), f64(qw), f64(kw), 1e-6, cos.double(), sin.double()
        )
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
        qo, ko = rope.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-6, cos, sin)
    full = [t.repeat(*((1,) * (t.dim() - 1)), heads) for t in (cos, sin)]
    assert full[0].shape[-1] == ch
    qf, kf = rope.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-6, *full)
    assert torch.equal(qo, qf) and torch.equal(ko, kf)
    qr, kr = rope.ltx_qk_rmsnorm_rope_ref(
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
        rope.ltx_qk_rmsnorm_rope(q, q.clone(), None, None, 1e-6, cos, sin)


# ---------------------------------------------------------------------------------------------
# 4. ltx_qk_rmsnorm_rope_coords: cos/sin computed in the kernel from the grid coordinates
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
    freqs = rope.ltx_rope_freqs(ch, 10000.0, device=DEVICE)
    assert freqs.shape == (ch // 6,) and freqs.dtype == torch.float32
    c2, s2 = rope.ltx_cos_sin_from_coords(grid, freqs, ch)
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
    """Kernel 4 (cos/sin from coords in the kernel) vs kernel 3 fed with LTXVideoRotaryPosEmbed's
    cos/sin, and vs the float64 reference; odd S; C % 6 in {2, 0, 4}; C = 10 has one frequency."""
    batch = 2
    grid, cos, sin = _module_grid_and_tables(ch, batch, frames, height, width, LTX_SCALE)
    freqs = rope.ltx_rope_freqs(ch, device=DEVICE)
    q, k = _fused_qk(batch, frames * height * width, ch, dtype, gen)
    qw, kw = _weight(ch, dtype, gen), _weight(ch, dtype, gen)
    with poisoned_outputs():
        q4, k4 = rope.ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, grid, freqs)
        q3, k3 = rope.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, cos, sin)
    qn, kn = _normed(q, qw), _normed(k, kw)
    if dtype == torch.float32:
        # only the in-kernel cos/sin differ from torch's (a few fp32 ulps of values <= 1)
        assert_close(q4, q3, torch.float32, rtol=1e-5, atol=1e-5, name="q: coords vs tables", seed=gen.seed_value)
        assert_close(k4, k3, torch.float32, rtol=1e-5, atol=1e-5, name="k: coords vs tables", seed=gen.seed_value)
    else:
        assert_pairs_close(q4, q3, qn, dtype, 2, True, gen, "q: coords vs tables")
        assert_pairs_close(k4, k3, kn, dtype, 2, True, gen, "k: coords vs tables")
    qr, kr = rope.ltx_qk_rmsnorm_rope_coords_ref(q.double(), k.double(), qw.double(), kw.double(), 1e-5, grid, freqs)
    assert_pairs_close(q4, qr, qn, dtype, 5, True, gen, "q vs float64")
    assert_pairs_close(k4, kr, kn, dtype, 5, True, gen, "k vs float64")


def test_coords_kernel_padding_only_width(gen):
    """C = 4 < 6: no frequencies, every channel is padding (cos 1, sin 0): the output is the norm.
    (diffusers' module itself returns a 0-wide table for dim < 6, so compare with the helpers.)"""
    q, k = _fused_qk(2, 3, 4, torch.float32, gen)
    grid = torch.rand(2, 3, 3, generator=gen).to(DEVICE)
    freqs = rope.ltx_rope_freqs(4, device=DEVICE)
    assert freqs.numel() == 0
    cos, sin = rope.ltx_cos_sin_from_coords(grid, freqs, 4)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))
    with poisoned_outputs():
        q4, k4 = rope.ltx_qk_rmsnorm_rope_coords(q, k, None, None, 1e-5, grid, freqs)
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
    freqs = rope.ltx_rope_freqs(ch, device=DEVICE)
    q, k = _fused_qk(batch, seq, ch, torch.float32, gen)
    qw, kw = _weight(ch, torch.float32, gen), _weight(ch, torch.float32, gen)
    grid_t = grid.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (3S, 1, S)
    with poisoned_outputs():
        q4, k4 = rope.ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, grid_t, freqs)
        q3, k3 = rope.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, cos, sin)
    assert_close(q4, q3, torch.float32, rtol=1e-5, atol=1e-5, name="q", seed=gen.seed_value)
    assert_close(k4, k3, torch.float32, rtol=1e-5, atol=1e-5, name="k", seed=gen.seed_value)
    for g in (grid[:1], grid[0]):
        with poisoned_outputs():
            q4, k4 = rope.ltx_qk_rmsnorm_rope_coords(q, k, qw, kw, 1e-5, g, freqs)
        c1, s1 = rope.ltx_cos_sin_from_coords(g, freqs, ch)
        q3, k3 = rope.ltx_qk_rmsnorm_rope(q, k, qw, kw, 1e-5, c1, s1)
        assert_close(q4, q3, torch.float32, rtol=1e-5, atol=1e-5, name="q broadcast", seed=gen.seed_value)
        assert_close(k4, k3, torch.float32, rtol=1e-5, atol=1e-5, name="k broadcast", seed=gen.seed_value)


def test_ltx_rope_freqs_other_theta():
    for theta in (10000.0, 500.0):
        ref = theta ** torch.linspace(math.log(1.0, theta), math.log(theta, theta), 20, dtype=torch.float32)
        assert torch.equal(rope.ltx_rope_freqs(120, theta), ref * math.pi / 2.0)


# ---------------------------------------------------------------------------------------------
# Custom ops, torch.compile tracing, empty inputs, errors
# ---------------------------------------------------------------------------------------------
def test_custom_ops_match_public_functions(gen):
    ops = getattr(torch.ops, rope._NS)
    batch, seq, ch = 2, 3, 96
    x = randn((batch, seq, ch), torch.bfloat16, gen)
    cos, sin = _angles_cos_sin((batch, seq, ch), gen)
    assert torch.equal(ops.ltx_rope(x, cos, sin), rope.ltx_rope(x, cos, sin))
    x4 = randn((batch, 2, seq, 64), torch.bfloat16, gen)
    c4, s4 = _hf_cos_sin(batch, seq, 64, gen, torch.float32)
    assert torch.equal(ops.rope_rotate_half(x4, c4, s4), rope.rope_rotate_half(x4, c4, s4))
    w = _weight(ch, torch.bfloat16, gen)
    a = ops.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, cos, sin, False)
    b = rope.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, cos, sin)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    grid = torch.rand(1, seq, 3, generator=gen).to(DEVICE)
    freqs = rope.ltx_rope_freqs(ch, device=DEVICE)
    a = ops.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid, freqs, False)
    b = rope.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid, freqs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_opcheck_fake_registrations(gen):
    """torch.library.opcheck: schema and fake (meta) implementations agree with the kernels."""
    ops = getattr(torch.ops, rope._NS)
    x = randn((2, 3, 12), torch.float32, gen)
    cos, sin = _angles_cos_sin((1, 3, 12), gen)
    w = _weight(12, torch.float32, gen)
    grid = torch.rand(2, 3, 3, generator=gen).to(DEVICE)
    freqs = rope.ltx_rope_freqs(12, device=DEVICE)
    x4 = randn((2, 3, 2, 8), torch.float32, gen).transpose(1, 2)
    c4, s4 = _hf_cos_sin(2, 3, 8, gen, torch.float32)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.ltx_rope, (x, cos, sin), test_utils=tests)
    torch.library.opcheck(ops.rope_rotate_half, (x4, c4, s4), test_utils=tests)
    torch.library.opcheck(ops.ltx_qk_rmsnorm_rope, (x, x, w, w, 1e-5, cos, sin, False), test_utils=tests)
    torch.library.opcheck(ops.ltx_qk_rmsnorm_rope_coords, (x, x, w, w, 1e-5, grid, freqs, True), test_utils=tests)


def test_compiled_graph_calls_the_custom_op(gen):
    """Under torch.compile the public function routes through the custom op (no graph break)."""
    x = randn((2, 3, 12), torch.float32, gen)
    k = randn((2, 3, 12), torch.float32, gen)
    w = _weight(12, torch.float32, gen)
    grid = torch.rand(2, 3, 3, generator=gen).to(DEVICE)
    freqs = rope.ltx_rope_freqs(12, device=DEVICE)

    def f(q, k):
        return rope.ltx_qk_rmsnorm_rope_coords(q, k, w, w, 1e-5, grid, freqs)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    a, b = compiled(x, k), f(x, k)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_empty_inputs():
    for batch, seq in ((2, 0), (0, 3)):
        x = torch.empty(batch, seq, 96, device=DEVICE, dtype=torch.bfloat16)
        cos = torch.empty(1, seq, 96, device=DEVICE)
        assert rope.ltx_rope(x, cos, cos).shape == x.shape
        qo, ko = rope.ltx_qk_rmsnorm_rope(x, x, None, None, 1e-5, cos, cos)
        assert qo.shape == ko.shape == x.shape
        grid = torch.empty(1, seq, 3, device=DEVICE)
        qo, ko = rope.ltx_qk_rmsnorm_rope_coords(x, x, None, None, 1e-5, grid, rope.ltx_rope_freqs(96, device=DEVICE))
        assert qo.shape == ko.shape == x.shape
        x4 = torch.empty(batch, 2, seq, 64, device=DEVICE)
        t = torch.empty(seq, 64, device=DEVICE)
        assert rope.rope_rotate_half(x4, t, t).shape == x4.shape


def _error_cases():
    d, bf = DEVICE, torch.bfloat16
    x = torch.ones(2, 3, 12, device=d, dtype=bf)
    cs = torch.ones(2, 3, 12, device=d)
    w = torch.ones(12, device=d, dtype=bf)
    grid = torch.zeros(2, 3, 3, device=d)
    fr = torch.ones(2, device=d)
    x4 = torch.ones(2, 2, 3, 8, device=d)
    c4 = torch.ones(2, 3, 8, device=d)
    wide = torch.empty(1, 0, 16386, device=d)
    return [
        ("ltx x int", TypeError, "x has dtype int32", lambda: rope.ltx_rope(x.int(), cs, cs)),
        ("ltx x float64", TypeError, "x has dtype float64", lambda: rope.ltx_rope(x.double(), cs, cs)),
        ("ltx not tensor", TypeError, "cos must be a torch.Tensor", lambda: rope.ltx_rope(x, 1.0, cs)),
        ("ltx cos int", TypeError, "cos has dtype int64", lambda: rope.ltx_rope(x, cs.long(), cs)),
        ("ltx x 2d", ValueError, r"x must be \[B, S, C\]", lambda: rope.ltx_rope(x[0], cs, cs)),
        ("ltx odd C", ValueError, "even channel count", lambda: rope.ltx_rope(x[..., :11], cs[..., :11], cs[..., :11])),
        ("ltx cos shape", ValueError, r"cos has shape \(2, 3, 10\)", lambda: rope.ltx_rope(x, cs[..., :10], cs)),
        (
            "ltx cos batch",
            ValueError,
            r"sin has shape \(3, 3, 12\)",
            lambda: rope.ltx_rope(x, cs, torch.ones(3, 3, 12, device=d)),
        ),
        (
            "ltx x last stride",
            ValueError,
            "x must be contiguous in its last dimension",
            lambda: rope.ltx_rope(torch.ones(2, 3, 24, device=d, dtype=bf)[..., ::2], cs, cs),
        ),
        (
            "ltx cos last stride",
            ValueError,
            "cos must be contiguous in its last dimension",
            lambda: rope.ltx_rope(x, torch.ones(2, 3, 24, device=d)[..., ::2], cs),
        ),
        ("ltx device", ValueError, "cos is on meta", lambda: rope.ltx_rope(x, cs.to("meta"), cs)),
        ("rh x 3d", ValueError, r"x must be \[B, H, S, D\]", lambda: rope.rope_rotate_half(x, cs, cs)),
        ("rh odd D", ValueError, "even head dim", lambda: rope.rope_rotate_half(x4[..., :7], c4[..., :7], c4[..., :7])),
        (
            "rh cos heads",
            ValueError,
            r"cos has shape \(2, 3, 3, 8\)",
            lambda: rope.rope_rotate_half(x4, torch.ones(2, 3, 3, 8, device=d), c4),
        ),
        (
            "rh cos seq",
            ValueError,
            r"sin has shape \(2, 4, 8\)",
            lambda: rope.rope_rotate_half(x4, c4, torch.ones(2, 4, 8, device=d)),
        ),
        ("qk k shape", ValueError, "k has shape", lambda: rope.ltx_qk_rmsnorm_rope(x, x[:, :2], w, w, 1e-5, cs, cs)),
        (
            "qk k dtype",
            TypeError,
            "k has dtype float16 but q has dtype bfloat16",
            lambda: rope.ltx_qk_rmsnorm_rope(x, x.half(), w, w, 1e-5, cs, cs),
        ),
        (
            "qk weight shape",
            ValueError,
            r"q_weight must have shape \[12\]",
            lambda: rope.ltx_qk_rmsnorm_rope(x, x, w[:6], w, 1e-5, cs, cs),
        ),
        (
            "qk one weight",
            ValueError,
            "both be tensors or both be None",
            lambda: rope.ltx_qk_rmsnorm_rope(x, x, w, None, 1e-5, cs, cs),
        ),
        (
            "qk weight stride",
            ValueError,
            "k_weight must be contiguous",
            lambda: rope.ltx_qk_rmsnorm_rope(x, x, w, torch.ones(24, device=d)[::2], 1e-5, cs, cs),
        ),
        (
            "qk eps",
            ValueError,
            "eps must be a non-negative float",
            lambda: rope.ltx_qk_rmsnorm_rope(x, x, w, w, -1.0, cs, cs),
        ),
        (
            "qk eps type",
            ValueError,
            "eps must be a non-negative float",
            lambda: rope.ltx_qk_rmsnorm_rope(x, x, w, w, "1e-5", cs, cs),
        ),
        (
            "qk cos shape",
            ValueError,
            r"cos has shape \(2, 2, 12\)",
            lambda: rope.ltx_qk_rmsnorm_rope(x, x, w, w, 1e-5, cs[:, :2], cs),
        ),
        (
            "qk width",
            ValueError,
            "unsupported width",
            lambda: rope.ltx_qk_rmsnorm_rope(wide, wide, None, None, 1e-5, wide[0], wide[0]),
        ),
        (
            "coords freqs len",
            ValueError,
            r"freqs has shape \(3,\); expected \[2\]",
            lambda: rope.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid, torch.ones(3, device=d)),
        ),
        (
            "coords shape",
            ValueError,
            r"coords has shape \(2, 3, 2\)",
            lambda: rope.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid[..., :2], fr),
        ),
        (
            "coords dtype",
            TypeError,
            "coords has dtype int64",
            lambda: rope.ltx_qk_rmsnorm_rope_coords(x, x, w, w, 1e-5, grid.long(), fr),
        ),
        (
            "coords q int",
            TypeError,
            "q has dtype int32",
            lambda: rope.ltx_qk_rmsnorm_rope_coords(x.int(), x, w, w, 1e-5, grid, fr),
        ),
    ]


@kt.error_cases(_error_cases())
def test_errors(case):
    kt.assert_error_case(case)


@kt.cpu_only
def test_cpu_tensor_without_interpreter_is_rejected(monkeypatch):
    x = torch.ones(1, 2, 4)
    kt.assert_cpu_tensor_refused_without_interpreter(
        monkeypatch, lambda: rope.ltx_rope(x, x, x), match="CPU tensor: Triton kernels run on a GPU"
    )


def test_supported_dtypes():
    assert set(DTYPES) == set(rope._SUPPORTED_DTYPES)


def test_sincos_over_video_rope_angles(gen):
    """The kernel's shared-reduction sin/cos (_sincos) against float64 over |angle| <= 2e4 (LTX-Video's
    largest frequency is 10000 * pi / 2 times coordinates in [-1, 1]) and around the quadrant edges."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe(A, S, C, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        s, c = rope._sincos(tl.load(A + offs, mask=m, other=0.0))
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
    x, q, k = randn((2, 4, 48), f, gen), randn((2, 4, 48), f, gen), randn((2, 4, 48), f, gen)
    cos, sin = _angles_cos_sin((2, 4, 48), gen)
    wq, wk = _weight(48, f, gen), _weight(48, f, gen)
    x4 = randn((1, 2, 4, 48), f, gen)
    c4, s4 = _angles_cos_sin((4, 48), gen)
    coords = torch.rand(2, 4, 3, generator=gen).to(DEVICE)
    freqs = rope.ltx_rope_freqs(48, device=DEVICE)
    return {
        "ltx_rope": (lambda t: rope.ltx_rope(t["x"], t["cos"], t["sin"]), dict(x=x, cos=cos, sin=sin)),
        "rope_rotate_half": (lambda t: rope.rope_rotate_half(t["x"], t["cos"], t["sin"]), dict(x=x4, cos=c4, sin=s4)),
        "rope_interleaved": (lambda t: rope.rope_interleaved(t["x"], t["cos"], t["sin"]), dict(x=x4, cos=c4, sin=s4)),
        "ltx_qk_rmsnorm_rope": (
            lambda t: rope.ltx_qk_rmsnorm_rope(t["q"], t["k"], t["q_weight"], t["k_weight"], 1e-6, t["cos"], t["sin"]),
            dict(q=q, k=k, q_weight=wq, k_weight=wk, cos=cos, sin=sin),
        ),
        "ltx_qk_rmsnorm_rope_coords": (
            lambda t: rope.ltx_qk_rmsnorm_rope_coords(
                t["q"], t["k"], t["q_weight"], t["k_weight"], 1e-6, t["coords"], t["freqs"]
            ),
            dict(q=q, k=k, q_weight=wq, k_weight=wk, coords=coords, freqs=freqs),
        ),
    }


@pytest.mark.parametrize(
    "fn", ["ltx_rope", "rope_rotate_half", "rope_interleaved", "ltx_qk_rmsnorm_rope", "ltx_qk_rmsnorm_rope_coords"]
)
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
    freqs = rope.ltx_rope_freqs(ch, device=DEVICE)  # 2 frequencies, the largest pi/2
    coords = (torch.rand(batch, seq, 3, generator=gen) * magnitude).to(DEVICE)
    with poisoned_outputs():
        q4, _ = rope.ltx_qk_rmsnorm_rope_coords(q, k, None, None, 1e-5, coords, freqs)
    qr, _ = rope.ltx_qk_rmsnorm_rope_coords_ref(q.double(), k.double(), None, None, 1e-5, coords, freqs)
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

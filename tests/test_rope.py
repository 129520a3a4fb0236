# SPDX-License-Identifier: Apache-2.0
"""RoPE kernels (interleaved LTX-Video, rotate-half Llama/HF, interleaved diffusers [B, H, S, D]) against
float64 references and against the real diffusers / transformers code they replace. The fused LTX q/k
RMSNorm + RoPE: tests/test_qk_norm_rope.py."""

import pytest
import torch

import kernel_testing as kt
import rope
from kernel_testing import DEVICE, DTYPES, assert_close, poisoned_outputs, randn

ltx = pytest.importorskip("diffusers.models.transformers.transformer_ltx")

# ---------------------------------------------------------------------------------------------
# Tolerances. A rotation mixes the two channels of a pair, so an output can be much smaller than
# the inputs that produced it (cancellation): errors are measured relative to the magnitude
# r = sqrt(a^2 + b^2) of the pair (a, b) that is rotated (x itself, or the normalised x in the
# fused kernels). With cos^2 + sin^2 = 1 per channel, every output is at most r in magnitude.
# ULP is the spacing of the dtype at 1.0 (2^-7 for bf16): the interpreter truncates fp32 -> bf16,
# which costs up to one ULP of relative error instead of half.
# * RoPE alone rounds once at the end: <= 1 ULP * r, plus fp32 math (~1e-7). Allow 2 ULP.
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
    assert torch.equal(ops.rope_interleaved(x4, c4, s4), rope.rope_interleaved(x4, c4, s4))


def test_opcheck_fake_registrations(gen):
    """torch.library.opcheck: schema and fake (meta) implementations agree with the kernels."""
    ops = getattr(torch.ops, rope._NS)
    x = randn((2, 3, 12), torch.float32, gen)
    cos, sin = _angles_cos_sin((1, 3, 12), gen)
    x4 = randn((2, 3, 2, 8), torch.float32, gen).transpose(1, 2)
    c4, s4 = _hf_cos_sin(2, 3, 8, gen, torch.float32)
    tests = ("test_schema", "test_faketensor")
    torch.library.opcheck(ops.ltx_rope, (x, cos, sin), test_utils=tests)
    torch.library.opcheck(ops.rope_rotate_half, (x4, c4, s4), test_utils=tests)
    torch.library.opcheck(ops.rope_interleaved, (x4, c4, s4), test_utils=tests)


def test_compiled_graph_calls_the_custom_op(gen):
    """Under torch.compile the public function routes through the custom op (no graph break)."""
    x = randn((2, 3, 12), torch.float32, gen)
    cos, sin = _angles_cos_sin((1, 3, 12), gen)

    def f(x):
        return rope.ltx_rope(x, cos, sin)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))


def test_empty_inputs():
    for batch, seq in ((2, 0), (0, 3)):
        x = torch.empty(batch, seq, 96, device=DEVICE, dtype=torch.bfloat16)
        cos = torch.empty(1, seq, 96, device=DEVICE)
        assert rope.ltx_rope(x, cos, cos).shape == x.shape
        x4 = torch.empty(batch, 2, seq, 64, device=DEVICE)
        t = torch.empty(seq, 64, device=DEVICE)
        assert rope.rope_rotate_half(x4, t, t).shape == x4.shape


def _error_cases():
    d, bf = DEVICE, torch.bfloat16
    x = torch.ones(2, 3, 12, device=d, dtype=bf)
    cs = torch.ones(2, 3, 12, device=d)
    x4 = torch.ones(2, 2, 3, 8, device=d)
    c4 = torch.ones(2, 3, 8, device=d)
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


# ---------------------------------------------------------------------------------------------
# Inputs requiring grad
# ---------------------------------------------------------------------------------------------
def _grad_cases(gen):
    """Public function -> (call taking a dict of named tensors, the tensors)."""
    f = torch.float32
    x = randn((2, 4, 48), f, gen)
    cos, sin = _angles_cos_sin((2, 4, 48), gen)
    x4 = randn((1, 2, 4, 48), f, gen)
    c4, s4 = _angles_cos_sin((4, 48), gen)
    return {
        "ltx_rope": (lambda t: rope.ltx_rope(t["x"], t["cos"], t["sin"]), dict(x=x, cos=cos, sin=sin)),
        "rope_rotate_half": (lambda t: rope.rope_rotate_half(t["x"], t["cos"], t["sin"]), dict(x=x4, cos=c4, sin=s4)),
        "rope_interleaved": (lambda t: rope.rope_interleaved(t["x"], t["cos"], t["sin"]), dict(x=x4, cos=c4, sin=s4)),
    }


@pytest.mark.parametrize("fn", ["ltx_rope", "rope_rotate_half", "rope_interleaved"])
def test_inputs_requiring_grad_are_refused_in_grad_mode(fn, gen):
    from test_launch import assert_refuses_inputs_requiring_grad

    call, tensors = _grad_cases(gen)[fn]
    assert_refuses_inputs_requiring_grad(fn, call, tensors)

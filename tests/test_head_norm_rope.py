# SPDX-License-Identifier: Apache-2.0
"""Per-head q/k RMSNorm (+ interleaved RoPE) against float64 references and against the real modules:
FLUX's torch.nn.RMSNorm(head_dim) + diffusers apply_rotary_emb(sequence_dim=1) with FluxPosEmbed tables,
and SD3's diffusers RMSNorm(head_dim) on the [B, H, S, D] view."""

from types import SimpleNamespace

import pytest
import torch

import head_norm_rope as hnr
import injection_common as ic
import kernel_testing as kt
from kernel_testing import DEVICE, DTYPES, INTERPRET, TOL, assert_close, poisoned_outputs, randn, rel_l2


def _tables(seq, dim, gen, device=DEVICE):
    """fp32 interleaved cos/sin [S, D] (repeat_interleave(2) of per-pair angles, as FluxPosEmbed makes them)."""
    ang = torch.randn(seq, dim // 2, generator=gen, dtype=torch.float64) * 20
    return (
        ang.cos().repeat_interleave(2, -1).float().to(device),
        ang.sin().repeat_interleave(2, -1).float().to(device),
    )


def _w(dim, dtype, gen):
    return randn((dim,), dtype, gen, scale=0.3, offset=1.0)


# The last five take several head steps per token's program (see test_shapes_cover_head_steps).
SHAPES = [
    (1, 1, 1, 2),
    (2, 5, 3, 64),
    (1, 7, 2, 130),
    (2, 3, 5, 128),
    (1, 3, 11, 128),
    (2, 2, 24, 64),
    (1, 2, 12, 128),
    (1, 2, 36, 256),
    (1, 2, 147, 64),
]


def test_shapes_cover_head_steps():
    """The launcher's head blocks for SHAPES include programs of several steps, with and without a masked
    last step, unrolled and looped, so test_matches_float64 exercises both forms of the head loop and their
    prefetch of the next step."""
    steps = {}
    for _, _, h, d in SHAPES:
        block_h = hnr._launch_config(d, h, 32)[0]
        steps[(h, d)] = (-(-h // block_h), h % block_h != 0)
    assert steps[(11, 128)] == (2, True)  # 8 heads, then 3 of a masked block
    assert steps[(24, 64)] == (3, False)  # SD3 / FLUX head count: 3 steps of 8
    assert steps[(12, 128)] == (3, False)  # 4 heads per step: 8 does not divide 12
    assert hnr._MAX_UNROLL < 9 < 10
    assert steps[(36, 256)] == (9, False)  # looped: more steps than _MAX_UNROLL
    assert steps[(147, 64)] == (10, True)  # looped, masked last step


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rope", [False, True])
def test_matches_float64(shape, dtype, rope, gen):
    """fp16/bf16: the kernel rounds the norm output to the dtype before RoPE (as the modules return it)
    and the float64 reference does not; that ulp of a unit-scale value is inside TOL's absolute term."""
    B, S, H, D = shape
    q = randn(shape, dtype, gen, scale=3.0, offset=0.2)
    k = randn(shape, dtype, gen, scale=0.5)
    qw, kw = _w(D, dtype, gen), _w(D, dtype, gen)
    cos, sin = _tables(S, D, gen) if rope else (None, None)
    for cbw in (False, True):
        with poisoned_outputs():
            qo, ko = hnr.head_rms_norm_rope(q, k, qw, kw, 1e-6, cos, sin, cast_before_weight=cbw)
        assert qo.shape == ko.shape == shape and qo.dtype == ko.dtype == dtype and qo.is_contiguous()
        qr, kr = hnr.head_rms_norm_rope_ref(
            q.double(),
            k.double(),
            qw.double(),
            kw.double(),
            1e-6,
            None if cos is None else cos.double(),
            None if sin is None else sin.double(),
        )
        # With RoPE in fp16/bf16 the norm output is rounded (and with cbw also the value before the
        # weight) before the rotation mixes two channels: up to two extra half-ulps of values up to ~4,
        # scaled by |w| <= 1.6 and |cos| + |sin| <= 1.42, i.e. about 3x TOL's absolute term.
        f = 3.0 if (rope and dtype != torch.float32) else 1.0
        tol = {k2: v * f for k2, v in TOL[dtype].items()}
        assert_close(qo, qr, dtype, name=f"q (cbw={cbw})", seed=gen.seed_value, **tol)
        assert_close(ko, kr, dtype, name=f"k (cbw={cbw})", seed=gen.seed_value, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_weights_and_odd_head_dim(dtype, gen):
    """No weights (elementwise_affine=False) and, without RoPE, an odd, non-power-of-two head dim."""
    q = randn((2, 4, 3, 7), dtype, gen, scale=2.0)
    k = randn((2, 4, 3, 7), dtype, gen)
    with poisoned_outputs():
        qo, ko = hnr.head_rms_norm_rope(q, k, None, None, 1e-5)
    qr, kr = hnr.head_rms_norm_rope_ref(q.double(), k.double(), None, None, 1e-5)
    assert_close(qo, qr, dtype, seed=gen.seed_value)
    assert_close(ko, kr, dtype, seed=gen.seed_value)


@pytest.mark.parametrize("dtype", DTYPES)
def test_joint_parts_concatenate_along_tokens(dtype, gen):
    """FLUX double-stream layout: text part (own weights, own eps) then image part; RoPE over the
    concatenated tokens; inputs are strided slices of fused qkv projections [B, S, 3 * H * D]."""
    B, H, D, St, Si = 2, 3, 32, 5, 11
    txt = randn((B, St, 3 * H * D), dtype, gen, scale=2.0)
    img = randn((B, Si, 3 * H * D), dtype, gen, scale=2.0)
    tq, tk, _ = (t.unflatten(-1, (H, D)) for t in txt.chunk(3, dim=-1))
    iq, ik, _ = (t.unflatten(-1, (H, D)) for t in img.chunk(3, dim=-1))
    assert not tq.is_contiguous()
    ws = [_w(D, dtype, gen) for _ in range(4)]
    cos, sin = _tables(St + Si, D, gen)
    parts = [(tq, tk, ws[0], ws[1]), (iq, ik, ws[2], ws[3])]
    with poisoned_outputs():
        qo, ko = hnr.joint_head_rms_norm_rope(parts, [1e-6, 1e-3], cos, sin)
    assert qo.shape == (B, St + Si, H, D)
    dparts = [tuple(t.double() for t in p) for p in parts]
    qr, kr = hnr.joint_head_rms_norm_rope_ref(dparts, [1e-6, 1e-3], cos.double(), sin.double())
    assert_close(qo, qr, dtype, name="q", seed=gen.seed_value)
    assert_close(ko, kr, dtype, name="k", seed=gen.seed_value)
    # the same as normalising each part separately and concatenating (no RoPE)
    with poisoned_outputs():
        qj, kj = hnr.joint_head_rms_norm_rope(parts, 1e-6)
        q0, k0 = hnr.head_rms_norm_rope(tq, tk, ws[0], ws[1], 1e-6)
        q1, k1 = hnr.head_rms_norm_rope(iq, ik, ws[2], ws[3], 1e-6)
    assert torch.equal(qj, torch.cat([q0, q1], dim=1)) and torch.equal(kj, torch.cat([k0, k1], dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_transposed_input_layout(dtype, gen):
    """q given as a [B, H, S, D] tensor's transpose (a [B, S, H, D] view with the head stride largest)."""
    B, H, S, D = 2, 4, 6, 64
    q = randn((B, H, S, D), dtype, gen).transpose(1, 2)
    k = randn((B, H, S, D), dtype, gen).transpose(1, 2)
    qw, kw = _w(D, dtype, gen), _w(D, dtype, gen)
    cos, sin = _tables(S, D, gen)
    with poisoned_outputs():
        qo, ko = hnr.head_rms_norm_rope(q, k, qw, kw, 1e-6, cos, sin)
    qr, kr = hnr.head_rms_norm_rope_ref(
        q.double(), k.double(), qw.double(), kw.double(), 1e-6, cos.double(), sin.double()
    )
    assert_close(qo, qr, dtype, seed=gen.seed_value)
    assert_close(ko, kr, dtype, seed=gen.seed_value)


def test_strided_cos_sin_rows(gen):
    B, S, H, D = 1, 5, 2, 16
    q = randn((B, S, H, D), torch.float32, gen)
    k = randn((B, S, H, D), torch.float32, gen)
    cs = _tables(S, 2 * D, gen)
    cos, sin = cs[0][:, :D], cs[1][:, D:]
    assert not cos.is_contiguous()
    with poisoned_outputs():
        qo, ko = hnr.head_rms_norm_rope(q, k, None, None, 1e-6, cos, sin)
    qr, kr = hnr.head_rms_norm_rope_ref(q.double(), k.double(), None, None, 1e-6, cos.double(), sin.double())
    assert_close(qo, qr, torch.float32, seed=gen.seed_value)
    assert_close(ko, kr, torch.float32, seed=gen.seed_value)


# ---- against the real modules ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_flux_processor_steps(dtype, gen):
    """FluxAttnProcessor's q/k path: torch.nn.RMSNorm(128, eps=1e-6) per head on [B, S, H, D], text before
    image, then apply_rotary_emb(sequence_dim=1) with FluxPosEmbed's (cos, sin)."""
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    B, H, D, St, Si = 1, 2, 128, 4, 12
    norms = [torch.nn.RMSNorm(D, eps=1e-6) for _ in range(4)]
    for n in norms:
        with torch.no_grad():
            n.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
        n.to(DEVICE, dtype).requires_grad_(False)  # inference: the kernels have no backward
    nq, nk, naq, nak = norms
    q, k = randn((B, Si, H, D), dtype, gen, scale=2.0), randn((B, Si, H, D), dtype, gen)
    eq, ek = randn((B, St, H, D), dtype, gen, scale=2.0), randn((B, St, H, D), dtype, gen)
    ids = torch.cat(
        [torch.zeros(St, 3), torch.stack([torch.zeros(Si), torch.arange(Si) // 4, torch.arange(Si) % 4], -1)]
    )
    cos, sin = FluxPosEmbed(theta=10000, axes_dim=[16, 56, 56])(ids.to(DEVICE))
    with torch.no_grad():
        want_q = apply_rotary_emb(torch.cat([naq(eq), nq(q)], dim=1), (cos, sin), sequence_dim=1)
        want_k = apply_rotary_emb(torch.cat([nak(ek), nk(k)], dim=1), (cos, sin), sequence_dim=1)
    cbw = dtype != torch.float32 and ic.rms_norm_rounds_before_weight(DEVICE)
    with poisoned_outputs():
        got_q, got_k = hnr.joint_head_rms_norm_rope(
            [(eq, ek, naq.weight, nak.weight), (q, k, nq.weight, nk.weight)], 1e-6, cos, sin, cast_before_weight=cbw
        )
    if dtype == torch.float32:
        assert_close(got_q, want_q.double(), dtype, rtol=2e-6, atol=2e-6, seed=gen.seed_value)
        assert_close(got_k, want_k.double(), dtype, rtol=2e-6, atol=2e-6, seed=gen.seed_value)
    else:
        # same rounding points; natively within an ulp of the summation order, the interpreter truncates
        ulps = 3 if INTERPRET else 2
        for got, want in ((got_q, want_q), (got_k, want_k)):
            diff = (got.double() - want.double()).abs()
            bound = ulps * torch.finfo(dtype).eps * (1 + want.double().abs().max())
            assert float(diff.max()) <= bound, f"max diff {float(diff.max()):.3e} > {bound:.3e} (seed {gen.seed_value})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_sd3_rmsnorm_on_transposed_heads(dtype, gen):
    """JointAttnProcessor2_0 with qk_norm="rms_norm": diffusers RMSNorm(64, eps=1e-6) (weight in the model
    dtype) on q.view(B, S, H, D).transpose(1, 2), image before text, no RoPE."""
    from diffusers.models.normalization import RMSNorm

    B, H, D, Si, St = 2, 3, 64, 9, 5
    norms = [RMSNorm(D, eps=1e-6) for _ in range(4)]
    for n in norms:
        with torch.no_grad():
            n.weight.copy_(1 + 0.3 * torch.randn(D, generator=gen))
        n.to(DEVICE, dtype).requires_grad_(False)  # inference: the kernels have no backward
    proj = randn((B, Si, 2 * H * D), dtype, gen, scale=2.0)
    eproj = randn((B, St, 2 * H * D), dtype, gen, scale=2.0)
    q, k = (t.view(B, Si, H, D) for t in proj.chunk(2, dim=-1))
    eq, ek = (t.view(B, St, H, D) for t in eproj.chunk(2, dim=-1))
    with torch.no_grad():
        want_q = torch.cat([norms[0](q.transpose(1, 2)), norms[2](eq.transpose(1, 2))], dim=2)
        want_k = torch.cat([norms[1](k.transpose(1, 2)), norms[3](ek.transpose(1, 2))], dim=2)
    with poisoned_outputs():
        got_q, got_k = hnr.joint_head_rms_norm_rope(
            [(q, k, norms[0].weight, norms[1].weight), (eq, ek, norms[2].weight, norms[3].weight)],
            1e-6,
            cast_before_weight=dtype != torch.float32,
        )
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else TOL[dtype]
    assert_close(got_q.transpose(1, 2), want_q.double(), dtype, **tol, name="q", seed=gen.seed_value)
    assert_close(got_k.transpose(1, 2), want_k.double(), dtype, **tol, name="k", seed=gen.seed_value)
    if dtype != torch.float32:
        assert rel_l2(got_q.transpose(1, 2), want_q) < torch.finfo(dtype).eps


# ---- empty and bad input --------------------------------------------------------------------
def test_empty_inputs(gen):
    e = torch.empty((2, 0, 3, 16), device=DEVICE)
    t = torch.empty(0, 16, device=DEVICE)
    qo, ko = hnr.head_rms_norm_rope(e, e, None, None, 1e-6, t, t)
    assert qo.shape == ko.shape == (2, 0, 3, 16)
    # an empty part next to a non-empty one
    x = randn((2, 4, 3, 16), torch.float32, gen)
    with poisoned_outputs():
        qo, ko = hnr.joint_head_rms_norm_rope([(e, e, None, None), (x, x, None, None)], 1e-6)
    assert_close(
        qo, hnr.head_rms_norm_rope_ref(x.double(), x.double(), None, None, 1e-6)[0], torch.float32, seed=gen.seed_value
    )
    b0 = torch.empty((0, 5, 3, 16), device=DEVICE)
    assert hnr.head_rms_norm_rope(b0, b0, None, None, 1e-6)[0].shape == (0, 5, 3, 16)


def _error_inputs(gen):
    x = randn((2, 4, 3, 16), torch.float32, gen)
    cos, sin = _tables(4, 16, gen)
    return SimpleNamespace(gen=gen, x=x, w=torch.ones(16, device=DEVICE), cos=cos, sin=sin)


def _odd_head_dim(t):
    y = randn((1, 4, 2, 7), torch.float32, t.gen)
    hnr.head_rms_norm_rope(y, y, None, None, 1e-6, t.cos[:, :7], t.sin[:, :7])


def _too_wide(t):
    big = torch.empty((1, 1, 1, 8192), device=DEVICE)
    hnr.head_rms_norm_rope(big, big, None, None, 1e-6)


ERROR_CASES = [
    (
        "q not a tensor",
        TypeError,
        "q must be a torch.Tensor",
        lambda t: hnr.head_rms_norm_rope([1.0], t.x, None, None, 1e-6),
    ),
    (
        "q float64",
        TypeError,
        "q has dtype float64",
        lambda t: hnr.head_rms_norm_rope(t.x.double(), t.x, None, None, 1e-6),
    ),
    (
        "q 3d",
        ValueError,
        r"q must be \[B, S, H, D\]",
        lambda t: hnr.head_rms_norm_rope(t.x[0], t.x[0], None, None, 1e-6),
    ),
    (
        "k shape",
        ValueError,
        r"k has shape \(2, 4, 3, 8\)",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x[..., :8], None, None, 1e-6),
    ),
    (
        "k dtype",
        TypeError,
        "every q and k must have the dtype float32",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x.half(), None, None, 1e-6),
    ),
    (
        "one weight",
        ValueError,
        "both be tensors or both be None",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x, t.w, None, 1e-6),
    ),
    (
        "weight shape",
        ValueError,
        r"q_weight must have shape \[16\]",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x, torch.ones(15, device=DEVICE), torch.ones(15, device=DEVICE), 1e-6),
    ),
    (
        "weight int64",
        TypeError,
        "q_weight has dtype int64",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x, torch.ones(16, dtype=torch.long, device=DEVICE), t.w, 1e-6),
    ),
    (
        "eps negative",
        ValueError,
        "eps must be a non-negative",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x, None, None, -1.0),
    ),
    (
        "x last stride",
        ValueError,
        "contiguous in its last dimension",
        lambda t: hnr.head_rms_norm_rope(t.x.transpose(2, 3), t.x.transpose(2, 3), None, None, 1e-6),
    ),
    (
        "cos without sin",
        ValueError,
        "cos and sin must be given together",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x, None, None, 1e-6, t.cos, None),
    ),
    (
        "cos shape",
        ValueError,
        r"cos has shape \(3, 16\); expected \[4, 16\]",
        lambda t: hnr.head_rms_norm_rope(t.x, t.x, None, None, 1e-6, t.cos[:3], t.sin[:3]),
    ),
    ("odd head dim", ValueError, "interleaved RoPE needs an even head dim", _odd_head_dim),
    ("head dim too wide", ValueError, "supports at most", _too_wide),
    (
        "joint part shape",
        ValueError,
        r"q \(part 1\) has shape \(2, 4, 2, 16\)",
        lambda t: hnr.joint_head_rms_norm_rope(
            [(t.x, t.x, None, None), (t.x[:, :, :2], t.x[:, :, :2], None, None)], 1e-6
        ),
    ),
    (
        "joint weights in one part",
        ValueError,
        "in every part",
        lambda t: hnr.joint_head_rms_norm_rope([(t.x, t.x, None, None), (t.x, t.x, t.w, t.w)], 1e-6),
    ),
    (
        "joint eps count",
        ValueError,
        "eps has 1 values for 2 parts",
        lambda t: hnr.joint_head_rms_norm_rope([(t.x, t.x, None, None), (t.x, t.x, None, None)], [1e-6]),
    ),
    (
        "joint part of 3",
        ValueError,
        "each part must be a",
        lambda t: hnr.joint_head_rms_norm_rope([(t.x, t.x, None)], 1e-6),
    ),
    (
        "joint parts a tuple",
        TypeError,
        "parts must be a sequence",
        lambda t: hnr.joint_head_rms_norm_rope((t.x, t.x, None, None), 1e-6),
    ),
    ("joint no parts", ValueError, "non-empty sequence", lambda t: hnr.joint_head_rms_norm_rope([], 1e-6)),
]


@kt.error_cases(ERROR_CASES)
def test_errors(case, gen):
    kt.assert_error_case(case, _error_inputs(gen))


@kt.cpu_only
def test_cpu_tensor_without_interpreter_is_rejected(monkeypatch):
    x = torch.ones(1, 2, 2, 8)
    kt.assert_cpu_tensor_refused_without_interpreter(
        monkeypatch, lambda: hnr.head_rms_norm_rope(x, x, None, None, 1e-6)
    )


@kt.needs_gpu_and_cpu
def test_device_mismatch(gen):
    x = randn((1, 2, 2, 8), torch.float32, gen)
    with pytest.raises(ValueError, match="q_weight is on cpu"):
        hnr.head_rms_norm_rope(x, x, torch.ones(8), torch.ones(8), 1e-6)


def test_custom_op_under_torch_compile(gen):
    """torch.compile traces through the registered op (aot_eager keeps it cheap on the CPU)."""
    B, S, H, D = 1, 6, 2, 16
    a = randn((B, 2, H, D), torch.float32, gen)
    x = randn((B, S - 2, H, D), torch.float32, gen)
    w = _w(D, torch.float32, gen)
    cos, sin = _tables(S, D, gen)

    def f(a, x, w, cos, sin):
        q, k = hnr.joint_head_rms_norm_rope([(a, a * 2, w, w), (x, x * 3, w, w)], [1e-6, 1e-5], cos, sin)
        q2, k2 = hnr.head_rms_norm_rope(q, k, None, None, 1e-6)
        return q2 - k2

    compiled = kt.compile_aot_eager(f)
    assert_close(compiled(a, x, w, cos, sin), f(a, x, w, cos, sin).double(), torch.float32, seed=gen.seed_value)
    torch.library.opcheck(
        getattr(torch.ops, hnr._NS).head_rms_norm_rope.default,
        ([a, x], [a * 2, x * 3], [w, w], [w, w], [1e-6, 1e-6], cos, sin, False),
        test_utils=("test_schema", "test_faketensor"),
    )


# ---- inputs requiring grad ------------------------------------------------------------------------
def _grad_cases(gen):
    """Public function -> (call taking a dict of named tensors, the tensors)."""
    f = torch.float32
    q, k, w1, w2 = randn((2, 3, 2, 32), f, gen), randn((2, 3, 2, 32), f, gen), _w(32, f, gen), _w(32, f, gen)
    q2, k2, w3, w4 = randn((2, 2, 2, 32), f, gen), randn((2, 2, 2, 32), f, gen), _w(32, f, gen), _w(32, f, gen)
    cos, sin = _tables(3, 32, gen)
    cos5, sin5 = _tables(5, 32, gen)

    def joint(t):
        parts = [
            (t["q of part 0"], t["k of part 0"], t["q_weight of part 0"], t["k_weight of part 0"]),
            (t["q of part 1"], t["k of part 1"], t["q_weight of part 1"], t["k_weight of part 1"]),
        ]
        return hnr.joint_head_rms_norm_rope(parts, 1e-6, t["cos"], t["sin"])

    return {
        "head_rms_norm_rope": (
            lambda t: hnr.head_rms_norm_rope(t["q"], t["k"], t["q_weight"], t["k_weight"], 1e-6, t["cos"], t["sin"]),
            dict(q=q, k=k, q_weight=w1, k_weight=w2, cos=cos, sin=sin),
        ),
        "joint_head_rms_norm_rope": (
            joint,
            {
                "q of part 0": q2,
                "k of part 0": k2,
                "q_weight of part 0": w3,
                "k_weight of part 0": w4,
                "q of part 1": q,
                "k of part 1": k,
                "q_weight of part 1": w1,
                "k_weight of part 1": w2,
                "cos": cos5,
                "sin": sin5,
            },
        ),
    }


@pytest.mark.parametrize("fn", ["head_rms_norm_rope", "joint_head_rms_norm_rope"])
def test_inputs_requiring_grad_are_refused_in_grad_mode(fn, gen):
    from test_launch import assert_refuses_inputs_requiring_grad

    call, tensors = _grad_cases(gen)[fn]
    assert_refuses_inputs_requiring_grad(fn, call, tensors)

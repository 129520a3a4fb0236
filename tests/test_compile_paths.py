# SPDX-License-Identifier: Apache-2.0
"""torch.compile over every registered kernel op, with static and dynamic shapes, against float64
references.

On a GPU the compiler is Inductor and the ops it records are the torch.library.triton_op twins
("<name>_triton"): Inductor launches those kernels from its own generated code, so this is the test
of that path (tracing the launcher on fake tensors, then the generated launch). With dynamic shapes
the twin defers to the custom op. Under the Triton interpreter (CPU) the backend is aot_eager and the
ops are the custom ops.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.backends.registry import lookup_backend

import activations as act
import head_norm_rope as hnr
import layernorm
import qk_norm_rope as qkr
import rmsnorm
import rope
from kernel_testing import DEVICE, assert_close, make_generator, poisoned_outputs, randn

GPU = DEVICE.type == "cuda"
TRITON_OP = GPU and hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")
DT = torch.bfloat16 if GPU else torch.float32  # the interpreter's bf16 rounding is not IEEE


def _recording_backend(seen: set):
    inner = lookup_backend("inductor" if GPU else "aot_eager")

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return inner(gm, example_inputs)

    return backend


def _poison_pool():
    """Inductor allocates outputs in generated code, where poisoned_outputs cannot reach: leave a
    NaN-filled block in the caching allocator so that freshly allocated outputs start as NaN."""
    if GPU:
        torch.full((1 << 24,), float("nan"), device=DEVICE, dtype=torch.float32)  # freed at once, kept cached


def _case_rmsnorm(gen, rows):
    d = 96
    h, y = randn((2, rows, d), DT, gen), randn((2, rows, d), DT, gen)
    emb = randn((2, 1, 3 * d), DT, gen, scale=0.3)
    gate, sc, sh = emb.chunk(3, dim=-1)  # strided views, as the models pass them
    w = randn((d,), DT, gen, scale=0.2, offset=1.0)

    def f(h, y, gate, sc, sh, w):
        return rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, sc, sh, w)

    args = (h, y, gate, sc, sh, w)
    ref = rmsnorm.gated_residual_rms_norm_modulate_ref(*(a.double() for a in args))
    return f, args, ref, "rms_norm_fused"


def _case_layernorm(gen, rows):
    d = 80
    h, y = randn((2, rows, d), DT, gen), randn((2, rows, d), DT, gen)
    emb = randn((2, 5 * d), DT, gen, scale=0.3)
    gate, sc, sh, sc2, sh2 = emb.chunk(5, dim=-1)

    def f(h, y, gate, sc, sh, sc2, sh2):
        h2, out = layernorm.gated_residual_layer_norm_modulate(h, y, gate, sc, sh)
        return (h2, out) + tuple(layernorm.layer_norm_modulate_dual(h2, sc, sh, sc2, sh2))

    args = (h, y, gate, sc, sh, sc2, sh2)
    d64 = [a.double() for a in args]
    h2, out = layernorm.gated_residual_layer_norm_modulate_ref(*d64[:5])
    # the dual output normalises the rounded residual stream, as the kernel does
    o1, o2 = layernorm.layer_norm_modulate_dual_ref(h2.to(DT).double(), *d64[3:])
    return f, args, (h2, out, o1, o2), "layer_norm_fused"


def _case_head_norm_rope(gen, rows):
    b, h, d = 2, 3, 64
    a = randn((b, 5, h, d), DT, gen)
    x = randn((b, rows, h, d), DT, gen)
    w1, w2 = (randn((d,), DT, gen, scale=0.3, offset=1.0) for _ in range(2))
    ang = torch.randn(5 + rows, d // 2, generator=gen, dtype=torch.float64) * 20
    cos = ang.cos().repeat_interleave(2, -1).float().to(DEVICE)
    sin = ang.sin().repeat_interleave(2, -1).float().to(DEVICE)

    def f(a, x, w1, w2, cos, sin):
        return hnr.joint_head_rms_norm_rope([(a, a * 2, w1, w2), (x, x * 3, w2, w1)], 1e-6, cos, sin)

    args = (a, x, w1, w2, cos, sin)
    d64 = [t.double() for t in args]
    parts = [(d64[0], (a * 2).double(), d64[2], d64[3]), (d64[1], (x * 3).double(), d64[3], d64[2])]
    ref = hnr.joint_head_rms_norm_rope_ref(parts, 1e-6, d64[4], d64[5])
    return f, args, ref, "head_rms_norm_rope"


def _case_ltx_rope(gen, rows):
    c = 96
    q, k = randn((2, rows, c), DT, gen), randn((2, rows, c), DT, gen)
    ang = torch.randn(1, rows, c // 2, generator=gen, dtype=torch.float64) * 10
    cos = ang.cos().repeat_interleave(2, -1).float().to(DEVICE)
    sin = ang.sin().repeat_interleave(2, -1).float().to(DEVICE)
    w = randn((c,), DT, gen, scale=0.2, offset=1.0)
    coords = torch.rand(1, rows, 3, generator=gen).to(DEVICE) * 8
    freqs = qkr.ltx_rope_freqs(c, device=DEVICE)

    def f(q, k, cos, sin, w, coords):
        qa, ka = qkr.ltx_qk_rmsnorm_rope(q, k, w, w, 1e-5, cos, sin)
        qb, kb = qkr.ltx_qk_rmsnorm_rope_coords(q, k, w, w, 1e-5, coords, freqs)
        return rope.ltx_rope(q, cos, sin), qa, ka, qb, kb

    args = (q, k, cos, sin, w, coords)
    q64, k64, w64 = q.double(), k.double(), w.double()
    ref = (
        rope.ltx_rope_ref(q64, cos.double(), sin.double()),
        *qkr.ltx_qk_rmsnorm_rope_ref(q64, k64, w64, w64, 1e-5, cos.double(), sin.double()),
        *qkr.ltx_qk_rmsnorm_rope_coords_ref(q64, k64, w64, w64, 1e-5, coords, freqs),
    )
    return f, args, ref, "ltx_rope"


def _case_rope_rotate_half(gen, rows):
    x = randn((2, rows, 4, 64), DT, gen).transpose(1, 2)  # [B, H, S, D] view of [B, S, H, D]
    a = torch.randn(2, rows, 32, generator=gen, dtype=torch.float64) * 10
    a = torch.cat([a, a], dim=-1)
    cos, sin = a.cos().float().to(DEVICE), a.sin().float().to(DEVICE)

    def f(x, cos, sin):
        return rope.rope_rotate_half(x, cos, sin)

    ref = rope.rope_rotate_half_ref(x.double(), cos.double(), sin.double())
    return f, (x, cos, sin), ref, "rope_rotate_half"


def _case_activations(gen, rows):
    x = randn((2, rows, 2 * 72), DT, gen, scale=2.0)

    def f(x):
        return act.gelu(x), act.geglu(x, "tanh"), act.swiglu(x)

    x64 = x.double()
    ref = (act.gelu_ref(x64), act.geglu_ref(x64, "tanh"), act.swiglu_ref(x64))
    return f, (x,), ref, "gelu"


def _case_gelu_mul(gen, rows):
    gate = randn((2, rows, 72), DT, gen, scale=2.0)
    up = randn((rows, 2, 72), DT, gen).transpose(0, 1)  # rows of two layouts

    def f(gate, up):
        return act.gelu_mul(gate, up)

    return f, (gate, up), act.gelu_mul_ref(gate.double(), up.double()), "gelu_mul"


CASES = [
    _case_rmsnorm,
    _case_layernorm,
    _case_head_norm_rope,
    _case_ltx_rope,
    _case_rope_rotate_half,
    _case_activations,
    _case_gelu_mul,
]


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__[len("_case_") :])
def test_compiled_ops_match_float64(case, dynamic):
    gen = make_generator()
    seen: set = set()
    torch._dynamo.reset()
    first = None
    # two sizes: with dynamic=True the second call reuses the symbolic graph
    for rows in (7, 33) if dynamic else (33,):
        f, args, ref, op_name = case(gen, rows)
        if first is None:
            first = torch.compile(f, backend=_recording_backend(seen), dynamic=dynamic, fullgraph=True)
        _poison_pool()
        # on the CPU the custom ops allocate from Python at run time: poison those allocations (on a GPU
        # the patched factories would end up in the traced graph instead)
        with poisoned_outputs() if not GPU else contextlib.nullcontext():
            out = first(*args)
        out = out if isinstance(out, (tuple, list)) else (out,)
        ref = ref if isinstance(ref, (tuple, list)) else (ref,)
        assert len(out) == len(ref)
        for i, (o, r) in enumerate(zip(out, ref)):
            assert_close(o, r, DT, name=f"{case.__name__} output {i} (rows {rows})", seed=gen.seed_value)
    name = f"{op_name}_triton" if TRITON_OP else op_name
    expected = {
        f"{m._NS}.{name}{suffix}" for m in (act, hnr, layernorm, rmsnorm, rope, qkr) for suffix in ("", ".default")
    }
    assert expected & seen, sorted(s for s in seen if s.startswith("rtk_"))


def test_triton_twin_defers_to_the_custom_op_on_symbolic_sizes():
    """The triton_op body hands symbolic sizes to the custom op (its launcher needs concrete sizes).
    Run with the twin registered by hand, so that this is checked under the interpreter as well."""
    if not (hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")):
        pytest.skip("this torch has no torch.library.triton_op")
    gen = make_generator()
    h, y = randn((2, 9, 64), torch.float32, gen), randn((2, 9, 64), torch.float32, gen)
    sc, sh = randn((2, 1, 64), torch.float32, gen, scale=0.2), randn((2, 1, 64), torch.float32, gen, scale=0.2)
    import kernel_runtime as kr

    wrapper, old, old_op = rmsnorm._launch, kr.TRITON_OP, rmsnorm._launch.compile_op
    try:
        kr.TRITON_OP = True
        kr._register(wrapper, rmsnorm._NS, "rms_norm_fused", kr._source_digest(rmsnorm.__file__), rmsnorm.__file__)
        seen: set = set()
        torch._dynamo.reset()
        compiled = torch.compile(
            rmsnorm.gated_residual_rms_norm_modulate, backend=_recording_backend(seen), dynamic=True, fullgraph=True
        )
        got = compiled(h, y, None, sc, sh)
    finally:
        kr.TRITON_OP, wrapper.compile_op = old, old_op
        torch._dynamo.reset()
    assert {f"{rmsnorm._NS}.rms_norm_fused_triton", f"{rmsnorm._NS}.rms_norm_fused_triton.default"} & seen
    ref = rmsnorm.gated_residual_rms_norm_modulate_ref(h.double(), y.double(), None, sc.double(), sh.double())
    for o, r in zip(got, ref):
        assert_close(o, r, torch.float32, seed=gen.seed_value)


def test_tracing_flag_is_per_thread():
    """While one thread traces a triton_op body (kernels through wrap_triton), eager launches in other
    threads keep the plain kernel: the runtime's launch mode is per thread."""
    import threading

    import kernel_runtime as kr

    seen = {}
    with kr._mode("trace"):
        t = threading.Thread(target=lambda: seen.setdefault("other", getattr(kr._TLS, "mode", None)))
        t.start()
        t.join()
        assert kr._TLS.mode == "trace"
    assert seen["other"] is None
    assert getattr(kr._TLS, "mode", None) is None

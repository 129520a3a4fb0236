# SPDX-License-Identifier: Apache-2.0
"""The launch runtime of the bundle (scripts/kernel_runtime.py): plans cached per call signature and
launched directly, the checks every call still gets, and clear errors for tensors no kernel can run on.
Under the interpreter every call with a plan also checks that the plan would hand each kernel what the
plain launcher did (tests/conftest.py sets kernel_runtime.VERIFY_PLANS)."""

from __future__ import annotations

import pytest
import torch

import kernel_runtime
from conftest import SCRIPTS
from kernel_testing import DEVICE, INTERPRET, assert_close, poisoned_outputs, randn


def test_plan_reused_only_for_the_same_signature(gen):
    import rmsnorm

    dtype = torch.bfloat16
    w = randn((96,), dtype, gen)
    x = randn((3, 5, 96), dtype, gen)
    base = randn((3, 5, 2 * 96), dtype, gen)
    strided = base[..., :96]  # same shape, other row stride
    kernel_runtime.clear_plans(rmsnorm)
    for t in (x, randn((3, 5, 96), dtype, gen), strided, x.float(), x):
        with poisoned_outputs():
            out = rmsnorm.rms_norm(t, w if t.dtype == dtype else w.float())
        ref = rmsnorm.rms_norm_ref(t.double(), (w if t.dtype == dtype else w.float()).double())
        assert_close(out, ref.to(t.dtype), t.dtype, seed=gen.seed_value)
    assert len(kernel_runtime.plans(rmsnorm)) == 3  # contiguous bf16, strided bf16, fp32


def test_plan_keys_tell_every_argument_kind_apart(gen):
    """A launcher's generated key function keys a positional call as _entry keys each argument (defaults filled
    in: leaving a default out and passing it give one key); an argument of a kind its position has not shown
    yet (a tensor where None or a value was, a float where a tensor was) never yields another call's key:
    the function raises or gives an entry led by another type, and the slow path writes it again."""
    calls = []

    def launcher(x, y=None, eps=1e-6, flag=True, parts=()):
        calls.append(x)

    w = kernel_runtime._Accelerated(launcher, "rtk_keytest", "launcher", {"__name__": "keytest"})
    t1, t2 = randn((4, 8), torch.float32, gen), randn((4, 8), torch.float32, gen)
    cases = [
        (t1,),
        (t1, None, 1e-6, True, ()),  # the defaults passed: the same key as (t1,)
        (t1, t2),
        (t1, t2.t()),
        (t1, t2.half()),
        (t1, torch.nn.Parameter(t2)),
        (t1, 1.0),  # a value where a tensor was
        (t1, None, 1),
        (t1, None, True),
        (t1, None, 1e-6, 1),
        (t1, None, 1e-6, True, (t2,)),
        (t1, None, 1e-6, True, [t2]),
        (t1, None, 1e-6, True, (t2, 2)),
        (None,),
        (0.5,),
        (t1, None, None),
    ]
    defaults = (None, 1e-6, True, ())
    for n, args in enumerate(cases):
        fast = None
        try:
            fast = w.key(*args)  # the function as it stands before this call's kinds are seen
        except kernel_runtime._KEY_ERRORS:
            pass
        key = w._key(args, {})
        full = args + defaults[len(args) - 1 :]
        assert key == tuple(kernel_runtime._entry(a) for a in full), args
        if fast is not None and fast != key:
            assert all(w._key(a, {}) != fast for a in cases[:n]), args  # a stale key finds no other call's plan
    keys = [w._key(a, {}) for a in cases]
    assert keys[0] == keys[1] and len(set(keys)) == len(cases) - 1
    assert w.key(t1) == keys[0]  # the written function, now it has seen every kind, keys as _entry does

    class Sub(torch.Tensor):
        pass

    # a call refused for a tensor subclass at one position learns nothing about the others (else a kind would be
    # marked seen with no function written for it, and the next call of that kind would crash)
    w = kernel_runtime._Accelerated(launcher, "rtk_keytest", "launcher", {"__name__": "keytest"})
    w._key((t1, t2), {})
    with pytest.raises(TypeError):
        w._key((None, t2.as_subclass(Sub)), {})
    assert w._key((None, t2), {}) == tuple(kernel_runtime._entry(a) for a in (None, t2) + defaults[1:])


def _counting_recorder(monkeypatch):
    recordings = []

    class Counting(kernel_runtime._Recorder):
        def __init__(self):
            super().__init__()
            recordings.append(self)

    monkeypatch.setattr(kernel_runtime, "_Recorder", Counting)
    return recordings


def test_an_unplannable_signature_is_recorded_once(gen, monkeypatch):
    """A call whose launcher computes with torch (here the skinny GEMM with K = 0 and a bias: the output is the
    bias, copied) makes no plan; later calls of that signature go straight to the plain launcher instead of
    recording it again (a recording traces every torch operation of the call: several times its own host cost)."""
    import skinny_gemm

    kernel_runtime.clear_plans(skinny_gemm)
    recordings = _counting_recorder(monkeypatch)
    x, w, b = randn((2, 0), torch.bfloat16, gen), randn((48, 0), torch.bfloat16, gen), randn((48,), torch.bfloat16, gen)
    for _ in range(3):
        assert torch.equal(skinny_gemm.skinny_gemm(x, w, b), b.expand(2, 48))
    (wrapper,) = [w_ for w_ in kernel_runtime._WRAPPERS if w_.owner is vars(skinny_gemm)]
    assert (
        not wrapper.plans
        and len(wrapper.unplanned) == 1
        and "computes with torch" in next(iter(wrapper.unplanned.values()))
    )
    assert len(recordings) == 1
    kernel_runtime.clear_plans(skinny_gemm)


def test_a_call_handed_to_torchs_gemm_is_replayed_without_the_launcher(gen, monkeypatch):
    """The skinny GEMM hands rows above its measured bound to torch's GEMM after checking the call: a later call
    of that signature makes the same torch call directly (a _TorchRoute plan), not the launcher's checks again;
    the result is torch's GEMM's, as the launcher returns it."""
    import skinny_gemm

    target = skinny_gemm._device_target(torch.device(DEVICE))
    monkeypatch.setitem(skinny_gemm._KERNEL_MAX_M, (target[0], target[1], "16-bit"), 0)  # every M to torch
    monkeypatch.setattr(kernel_runtime, "VERIFY_PLANS", False)
    kernel_runtime.clear_plans(skinny_gemm)
    recordings = _counting_recorder(monkeypatch)
    (wrapper,) = [w_ for w_ in kernel_runtime._WRAPPERS if w_.owner is vars(skinny_gemm)]
    launched = []
    launcher = wrapper.launcher
    monkeypatch.setattr(wrapper, "launcher", lambda *a, **k: launched.append(1) or launcher(*a, **k))
    w, b = randn((48, 64), torch.bfloat16, gen), randn((48,), torch.float32, gen)
    for _ in range(3):
        x = randn((1, 3, 64), torch.bfloat16, gen)  # fresh values, one signature
        out = skinny_gemm.skinny_gemm(x, w, b)
        want = (torch.nn.functional.linear(x.view(3, 64), w).float() + b).to(torch.bfloat16).view(1, 3, 48)
        assert out.shape == (1, 3, 48) and torch.equal(out, want)
    assert len(recordings) == 1 and len(launched) == 1, (len(recordings), len(launched))
    (plan,) = wrapper.plans.values()
    assert isinstance(plan, kernel_runtime._TorchRoute) and plan.rows == (3, 64)
    kernel_runtime.clear_plans(skinny_gemm)


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


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="the direct launch exists for compiled kernels only")
def test_direct_launch_serves_misaligned_and_aligned_pointers(gen):
    """A plan compiled for 16-byte aligned pointers must not serve a misaligned one (it goes to the plain
    launcher, whose JIT compiles the unaligned variant), and the aligned case keeps working after that."""
    import rmsnorm

    dtype = torch.bfloat16
    w = randn((128,), dtype, gen)
    big = randn((6, 129), dtype, gen)
    aligned, misaligned = big[:, :128], big[:, 1:]  # same shape and strides, address off by 2 bytes
    kernel_runtime.clear_plans(rmsnorm)
    for t in (aligned, aligned, misaligned, misaligned, aligned):
        with poisoned_outputs():
            out = rmsnorm.rms_norm(t, w)
        assert_close(out, rmsnorm.rms_norm_ref(t.double(), w.double()).to(dtype), dtype, seed=gen.seed_value)
    (plan,) = kernel_runtime.plans(rmsnorm).values()
    assert plan.runnable, "the plan should launch directly after its first call"


def test_plan_hands_the_runner_what_the_launcher_passed(gen, monkeypatch):
    """A plan's direct launch: the runner gets the grid, the current stream, the compiled kernel's function
    and metadata, then every kernel parameter in order (this call's pointers where the tensors go, the
    recorded arguments elsewhere). A pointer compiled as aligned that is not, another current device or a
    launch hook send the call to the plain launcher. A fake compiled kernel: any machine."""
    import rmsnorm

    ran = []

    class Compiled:
        function, packed_metadata = "the function", ("the", "metadata")

        def run(self, *a):
            ran.append(a)

    monkeypatch.setattr(kernel_runtime, "VERIFY_PLANS", False)
    kernel_runtime.clear_plans(rmsnorm)
    big = randn((4 * 64 + 1,), torch.float32, gen)
    w = randn((64,), torch.float32, gen)
    rmsnorm.rms_norm(big[:256].view(4, 64), w)  # records the plan (aligned pointers)
    (plan,) = kernel_runtime.plans(rmsnorm).values()
    kernel, grid, _, values, slots = plan.launches[0]
    monkeypatch.setattr(plan, "launches", ((kernel, grid, Compiled(), values, slots),))
    monkeypatch.setattr(plan, "runnable", True)
    device = {"index": plan.device}
    monkeypatch.setattr(kernel_runtime, "_current_device", lambda: device["index"])
    monkeypatch.setattr(kernel_runtime, "_current_stream", lambda d: 1000)
    x = randn((4, 64), torch.float32, gen)
    out = rmsnorm.rms_norm(x, w)
    assert len(ran) == 1
    got = ran[0]
    assert got[:9] == (*grid, 1000, "the function", ("the", "metadata"), None, None, None)
    assert len(got) == 9 + len(values)
    pointers = {got[9 + i] for i, *_ in slots}
    assert pointers == {x.data_ptr(), w.data_ptr(), out.data_ptr()}
    for i, v in enumerate(values):
        if i not in {s[0] for s in slots}:
            assert got[9 + i] is v or got[9 + i] == v
    # to the plain launcher: a misaligned pointer compiled as aligned; another current device; a launch hook
    rmsnorm.rms_norm(big[1:].view(4, 64), w)  # 4 bytes off
    assert len(ran) == 1
    device["index"] = "another"
    rmsnorm.rms_norm(x, w)
    assert len(ran) == 1
    device["index"] = plan.device
    monkeypatch.setattr(kernel_runtime, "_hooks_idle", lambda: False)
    rmsnorm.rms_norm(x, w)
    assert len(ran) == 1


def _public_calls(gen):
    """(name, fn) pairs: each fn makes fresh inputs, calls one public kernel and returns its inputs."""
    import activations
    import head_norm_rope
    import layernorm
    import qk_norm_rope
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
        return [x, cos, sin]

    def qk():
        ang = r(2, 4, 24)
        cos, sin = ang.cos().repeat_interleave(2, -1), ang.sin().repeat_interleave(2, -1)
        q, k, wq, wk = r(2, 4, 48), r(2, 4, 48), r(48), r(48)
        qk_norm_rope.ltx_qk_rmsnorm_rope(q, k, wq, wk, 1e-6, cos, sin)
        coords = torch.rand(2, 4, 3, generator=gen).to(DEVICE)
        freqs = qk_norm_rope.ltx_rope_freqs(48, device=DEVICE)
        qk_norm_rope.ltx_qk_rmsnorm_rope_coords(q, k, wq, wk, 1e-6, coords, freqs)
        return [cos, sin, q, k, wq, wk, coords]

    def heads():
        q, k, w = r(2, 4, 3, 32), r(2, 4, 3, 32), r(32)
        head_norm_rope.head_rms_norm_rope(q, k, w, w, 1e-6)
        return [q, k, w]

    def acts():
        x = r(2, 3, 64)
        activations.gelu(x)
        activations.geglu(x)
        activations.swiglu(x)
        activations.gelu_mul(x, x)
        return [x]

    def gemm():
        x, w = randn((1, 64), torch.bfloat16, gen), randn((32, 64), torch.bfloat16, gen)
        skinny_gemm.skinny_gemm(x, w)
        return [x, w]

    return [
        ("rmsnorm", rms),
        ("layernorm", ln),
        ("rope", ropes),
        ("qk_norm_rope", qk),
        ("head_norm_rope", heads),
        ("activations", acts),
        ("skinny_gemm", gemm),
    ]


@pytest.mark.parametrize(
    "which", ["rmsnorm", "layernorm", "rope", "qk_norm_rope", "head_norm_rope", "activations", "skinny_gemm"]
)
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


def _fake_runners(monkeypatch) -> list:
    """Plans made from here on replay through fake compiled kernels whose runner keeps (kernel, arguments) in
    the list returned (any machine); recordings still run the real kernels, on device 0, stream 1000."""
    ran = []

    class Compiled:
        function, packed_metadata = "the function", "the metadata"

        def run(self, *a):
            ran.append((self, a))

    record = kernel_runtime._Recorder.launch

    def launch(self, kernel, grid, args, kwargs):  # runs the kernel, keeps a fake as what it compiled to
        record(self, kernel, grid, args, kwargs)
        self.launches[-1] = self.launches[-1][:4] + (Compiled(),)
        return self.launches[-1][4]

    for name, value in (("_plan_device", lambda inputs: 0), ("_current_device", lambda: 0)):
        monkeypatch.setattr(kernel_runtime, name, value)
    monkeypatch.setattr(kernel_runtime, "_current_stream", lambda device: 1000)
    monkeypatch.setattr(kernel_runtime, "VERIFY_PLANS", False)
    monkeypatch.setitem(kernel_runtime._RUNNER, "ok", True)
    monkeypatch.setattr(kernel_runtime._Recorder, "launch", launch)
    return ran


def test_a_plan_recorded_with_one_tensor_twice_serves_only_such_calls(gen, monkeypatch):
    """A plan recorded from gated_residual_add(a, a, None) names input 0 for both operands; a later call of the
    same key with two distinct tensors must not replay it (it would compute a + a): it goes to the plain
    launcher. Calls with the one tensor twice still replay. (Compiled kernels here are fakes whose runner only
    counts; the plain launcher runs the real kernel.)"""
    import rmsnorm

    ran = _fake_runners(monkeypatch)
    kernel_runtime.clear_plans(rmsnorm)
    a, b = randn((4, 64), torch.float32, gen), randn((4, 64), torch.float32, gen)
    rmsnorm.gated_residual_add(a, a, None)  # recorded: the plan
    assert not ran
    rmsnorm.gated_residual_add(a, a, None)  # replayed (the fake runner)
    assert len(ran) == 1
    with poisoned_outputs():
        out = rmsnorm.gated_residual_add(a, b, None)  # one key, other tensors: the plain launcher
    assert len(ran) == 1
    assert torch.equal(out, (a.double() + b.double()).float())
    kernel_runtime.clear_plans(rmsnorm)


@pytest.mark.parametrize("which", ["rmsnorm", "layernorm", "rope", "head_norm_rope", "activations", "skinny_gemm"])
def test_generated_launch_hands_each_runner_what_the_plan_recorded(which, gen, monkeypatch):
    """Every public call of every kernel file, replayed through the launch function generated for its plan,
    with each compiled kernel a fake that keeps what its runner gets (any machine): one runner call per
    recorded launch, in order, each with the grid, the current stream, the kernel's function and metadata,
    then every parameter: the recorded value where no tensor goes, else this call's input pointer plus the
    recorded offset, or an allocation of this call (the same allocation at the same address in every launch
    of the call, the returned tensors' own)."""
    ran, calls = _fake_runners(monkeypatch), []
    call = kernel_runtime._Accelerated.__call__

    def keep(self, *args, **kwargs):
        calls.append((self, args, kwargs))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(kernel_runtime._Accelerated, "__call__", keep)
    kernel_runtime.clear_plans()
    dict(_public_calls(gen))[which]()  # every call records its plan
    replayed = 0
    for wrapper, args, kwargs in list(calls):
        plan = wrapper.plans.get(wrapper._key(args, kwargs))
        if plan is None:
            continue  # a call the launcher hands to torch (no plan), or one made inside another's recording
        del ran[:]
        out = call(wrapper, *args, **kwargs)
        assert len(ran) == len(plan.launches), f"{wrapper.__name__}: {len(ran)} runner calls for {plan.launches}"
        inputs = [args[i] if j is None else args[i][j] for i, j in plan.inputs]
        returned = {src: t for (src, _), t in zip(plan.result, _tensors_of(out)) if src >= len(inputs)}
        bases = {}
        for (compiled, got), (_, grid, recorded, values, slots) in zip(ran, plan.launches):
            assert compiled is recorded
            assert got[:9] == (*grid, 1000, "the function", "the metadata", None, None, None)
            assert len(got) == 9 + len(values)
            slot_of = {i: (src, off) for i, src, off, _ in slots}
            for i, v in enumerate(values):
                if i not in slot_of:
                    assert type(got[9 + i]) is type(v) and (got[9 + i] == v or v != v), (wrapper.__name__, i)
                    continue
                src, off = slot_of[i]
                if src < len(inputs):
                    assert got[9 + i] == inputs[src].data_ptr() + off, (wrapper.__name__, i)
                else:
                    base = bases.setdefault(src, got[9 + i] - off)
                    assert got[9 + i] - off == base, (wrapper.__name__, i)
        for src, t in returned.items():
            assert src not in bases or bases[src] == t.data_ptr()
        replayed += 1
    assert replayed, f"{which}: no call was replayed through a plan"
    kernel_runtime.clear_plans()


# ---- per-call state that is not part of the plan key ------------------------------------------
def _tensors_of(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def assert_refuses_inputs_requiring_grad(fn: str, call, tensors: dict):
    """The kernels have no backward: in grad mode, any tensor input that requires grad must raise (a
    RuntimeError naming the public function and the input), not return outputs without a grad_fn.
    ``call(tensors)`` calls ``fn`` with the tensors of the dict (keyed by the name the error should
    give). Each input is made to require grad in turn; the same call under torch.no_grad() and
    torch.inference_mode() must still run and give what it gives without grad."""
    import re

    expected = _tensors_of(call(tensors))
    for name in tensors:
        args = {k: (v.detach().requires_grad_() if k == name else v) for k, v in tensors.items()}
        pattern = (
            rf"^{re.escape(fn)}: {re.escape(name)} requires grad.*no backward.*"
            r"torch\.no_grad\(\).*torch\.inference_mode\(\).*PyTorch reference"
        )
        with pytest.raises(RuntimeError, match=pattern):
            call(args)
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                got = _tensors_of(call(args))
            assert len(got) == len(expected)
            for g, e in zip(got, expected):
                assert g.grad_fn is None and torch.equal(g, e), f"{fn} under {mode.__name__} with {name} requiring grad"
    # a cached plan does not skip the check (grad mode is not part of the plan key)
    every = {k: v.detach().requires_grad_() for k, v in tensors.items()}
    with pytest.raises(RuntimeError, match=rf"^{re.escape(fn)}: .* requires grad"):
        call(every)


def test_skinny_gemm_refuses_inputs_requiring_grad(gen):
    import skinny_gemm

    x, w = randn((2, 64), torch.bfloat16, gen), randn((32, 64), torch.bfloat16, gen)
    bias = randn((32,), torch.float32, gen)
    assert_refuses_inputs_requiring_grad(
        "skinny_gemm", lambda t: skinny_gemm.skinny_gemm(t["x"], t["weight"], t["bias"]), dict(x=x, weight=w, bias=bias)
    )


def _meta_calls():
    import activations
    import head_norm_rope
    import layernorm
    import qk_norm_rope
    import rmsnorm
    import rope
    import skinny_gemm

    def m(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta")

    return {
        "rmsnorm": ("x", lambda: rmsnorm.rms_norm(m(2, 64), m(64))),
        "rmsnorm_add": ("h", lambda: rmsnorm.gated_residual_add(m(2, 64), m(2, 64), m(64))),
        "layernorm": ("x", lambda: layernorm.layer_norm_modulate(m(2, 3, 64), m(2, 64), m(2, 64))),
        "rope": ("x", lambda: rope.ltx_rope(m(2, 3, 12), m(2, 3, 12), m(2, 3, 12))),
        "qk_norm_rope": (
            "q",
            lambda: qk_norm_rope.ltx_qk_rmsnorm_rope(m(2, 3, 12), m(2, 3, 12), None, None, 1e-6, m(3, 12), m(3, 12)),
        ),
        "activations": ("x", lambda: activations.gelu(m(2, 64))),
        "swiglu": ("x", lambda: activations.swiglu(m(2, 64), m(2, 64))),
        "head_norm_rope": (
            "q",
            lambda: head_norm_rope.head_rms_norm_rope(m(1, 2, 2, 8), m(1, 2, 2, 8), None, None, 1e-6),
        ),
        "skinny_gemm": (
            "x",
            lambda: skinny_gemm.skinny_gemm(m(2, 64, dtype=torch.bfloat16), m(32, 64, dtype=torch.bfloat16)),
        ),
    }


@pytest.mark.parametrize("case", sorted(_meta_calls()))
def test_meta_tensors_are_refused_clearly(case):
    """Meta tensors have a shape and a dtype but no data: a clear ValueError naming the argument, not a
    crash deep inside Triton (or torch.cuda)."""
    name, call = _meta_calls()[case]
    with pytest.raises(ValueError, match=rf"^{name} is a meta tensor: meta tensors hold no data"):
        call()


_MODE_SCRIPT = r"""
import json, os, sys, torch
import activations, head_norm_rope, kernel_runtime, layernorm, qk_norm_rope, rmsnorm, rope, skinny_gemm

dev = sys.argv[1]
def t(*shape, dtype=torch.float32):
    return torch.ones(shape, dtype=dtype, device=dev)

calls = {
    "rmsnorm": lambda: rmsnorm.rms_norm(t(2, 64), t(64)),
    "layernorm": lambda: layernorm.layer_norm(t(2, 64)),
    "rope": lambda: rope.ltx_rope(t(2, 3, 12), t(2, 3, 12), t(2, 3, 12)),
    "qk_norm_rope": lambda: qk_norm_rope.ltx_qk_rmsnorm_rope(t(2, 3, 12), t(2, 3, 12), None, None, 1e-6, t(3, 12), t(3, 12)),
    "activations": lambda: activations.gelu(t(2, 64)),
    "head_norm_rope": lambda: head_norm_rope.head_rms_norm_rope(t(1, 2, 2, 8), t(1, 2, 2, 8), None, None, 1e-6),
    "skinny_gemm": lambda: skinny_gemm.skinny_gemm(t(2, 64, dtype=torch.bfloat16), t(32, 64, dtype=torch.bfloat16)),
}
at_import = os.environ.get("TRITON_INTERPRET")
flipped = None if at_import else "1"
out = {}
for name, call in calls.items():
    row = {}
    for phase, value in (("as_imported", at_import), ("flipped", flipped)):
        if value is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = value
        try:
            call()
            row[phase] = "ok"
        except Exception as e:
            row[phase] = f"{type(e).__name__}: {e}"
        # the check runs when a plan is made: a plan made while the two agreed keeps serving its signature
        kernel_runtime.clear_plans()
    out[name] = row
print("RESULT " + json.dumps(out))
"""


def _run_mode_script(interpret_at_import: bool, device: str) -> dict:
    import json
    import os

    from forked_python import TORCH_TRITON, run_python_forked

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret_at_import:
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = str(SCRIPTS) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONWARNINGS", "ignore")
    # as `python -c` runs it, forked from a process that has imported torch and triton with the same flag
    r = run_python_forked(["-c", _MODE_SCRIPT, device], preload=TORCH_TRITON, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


def test_triton_interpret_set_after_import_is_refused_clearly():
    """Imported without TRITON_INTERPRET (kernels compiled for a GPU), called with CPU tensors: a clear
    ValueError (CPU tensor). Then TRITON_INTERPRET=1 set in the environment, same calls: a clear
    RuntimeError saying to set it before importing, not Triton's "0 active drivers" (or, on a GPU
    machine, compiled kernels handed CPU pointers)."""
    res = _run_mode_script(False, "cpu")
    for name, row in res.items():
        assert row["as_imported"].startswith("ValueError: x is a CPU tensor: Triton kernels run on a GPU") or row[
            "as_imported"
        ].startswith("ValueError: q is a CPU tensor: Triton kernels run on a GPU"), (name, row)
        assert row["flipped"].startswith("RuntimeError: "), (name, row)
        assert "TRITON_INTERPRET" in row["flipped"] and "before importing" in row["flipped"], (name, row)
        assert "active drivers" not in row["flipped"], (name, row)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU: kernels decorated for the interpreter then handed GPU tensors"
)
def test_triton_interpret_unset_after_import_is_refused_clearly():
    res = _run_mode_script(True, "cuda")
    for name, row in res.items():
        assert row["as_imported"] == "ok", (name, row)
        assert row["flipped"].startswith("RuntimeError: "), (name, row)
        assert "TRITON_INTERPRET" in row["flipped"] and "before importing" in row["flipped"], (name, row)


@pytest.mark.skipif(not INTERPRET, reason="this process imported the kernels for the interpreter")
@pytest.mark.parametrize(
    "case", ["rmsnorm", "layernorm", "rope", "qk_norm_rope", "activations", "head_norm_rope", "skinny_gemm"]
)
def test_cpu_tensor_after_unsetting_triton_interpret(case, monkeypatch):
    """This process imported the kernels under TRITON_INTERPRET; with it unset now, a CPU tensor is
    refused as before (ValueError: CPU tensor) and the message says that the variable was unset since
    the import."""
    import importlib

    mod = importlib.import_module(case)
    monkeypatch.delenv("TRITON_INTERPRET")

    def t(*shape, dtype=torch.float32):
        return torch.ones(shape, dtype=dtype)

    call = {
        "rmsnorm": lambda: mod.rms_norm(t(2, 64)),
        "layernorm": lambda: mod.layer_norm(t(2, 64)),
        "rope": lambda: mod.ltx_rope(t(2, 3, 12), t(2, 3, 12), t(2, 3, 12)),
        "qk_norm_rope": lambda: mod.ltx_qk_rmsnorm_rope(t(2, 3, 12), t(2, 3, 12), None, None, 1e-6, t(3, 12), t(3, 12)),
        "activations": lambda: mod.gelu(t(2, 64)),
        "head_norm_rope": lambda: mod.head_rms_norm_rope(t(1, 2, 2, 8), t(1, 2, 2, 8), None, None, 1e-6),
        "skinny_gemm": lambda: mod.skinny_gemm(t(2, 64, dtype=torch.bfloat16), t(32, 64, dtype=torch.bfloat16)),
    }[case]
    with pytest.raises(
        ValueError,
        match=r"CPU tensor: Triton kernels run on a GPU.*TRITON_INTERPRET was set "
        r"when this module was imported",
    ):
        call()


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="CUDA / HIP graphs need a GPU")
def test_direct_launch_inside_graph_capture(gen):
    """A plan first used eagerly, then captured into a CUDA / HIP graph: the replay computes from the
    captured input buffer's current values (fresh data copied in before each replay)."""
    import rmsnorm

    dtype = torch.bfloat16
    x = randn((2, 33, 256), dtype, gen)
    sc, sh = randn((2, 1, 256), dtype, gen, 0.1), randn((2, 1, 256), dtype, gen, 0.1)
    rmsnorm.rms_norm_modulate(x, sc, sh)  # plan built, direct launch adopted
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rmsnorm.rms_norm_modulate(static, sc, sh)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rmsnorm.rms_norm_modulate(static, sc, sh)
    for _ in range(2):
        fresh = randn((2, 33, 256), dtype, gen)
        static.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = rmsnorm.rms_norm_modulate_ref(fresh.double(), sc.double(), sh.double())
        assert_close(out, ref.to(dtype), dtype, seed=gen.seed_value)

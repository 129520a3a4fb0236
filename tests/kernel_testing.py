# SPDX-License-Identifier: Apache-2.0
"""Shared helpers for the kernel tests: device choice, poisoned outputs, fresh random inputs, a verbose
closeness check against a float64 reference, and the pieces several test files share (tables of refused
calls, device-check markers, call counters, subprocess runs, a stand-in Triton driver)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import subprocess
import sys
import zlib
from collections import Counter

import pytest
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


def once_per_run(tmp_path_factory, name: str, compute):
    """compute()'s JSON value, computed once per test run: under pytest-xdist each worker runs a module fixture
    of its own (a 30-40 s compile or model sweep twice on 2 cores), so the first worker to get here computes it
    under a file lock beside the workers' temp folders and the others read it. Without xdist: compute()."""
    import json

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return json.loads(json.dumps(compute()))
    from filelock import FileLock  # (a dependency of torch)

    path = tmp_path_factory.getbasetemp().parent / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if not path.is_file():
            path.write_text(json.dumps(compute()))
        return json.loads(path.read_text())


def _fixed_seed() -> int:
    """With KERNEL_TEST_SEEDS=fixed (CI sets it): the n-th seed a test draws, from its pytest node id and n,
    the same on every run, so a CI failure repeats on the next run; otherwise fresh entropy."""
    if os.environ.get("KERNEL_TEST_SEEDS") != "fixed":
        return int.from_bytes(os.urandom(4), "little")
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return zlib.crc32(f"{test}#{len(FRESH_SEEDS)}".encode())


def make_generator(seed: int | None = None) -> torch.Generator:
    """A CPU generator: fresh entropy (fixed per test with KERNEL_TEST_SEEDS=fixed) unless a seed is given;
    set KERNEL_TEST_SEED to replay a failing run's seed."""
    if seed is None:
        env = os.environ.get("KERNEL_TEST_SEED")
        seed = int(env) if env else _fixed_seed()
        FRESH_SEEDS.append(seed)
    g = SeededGenerator(device="cpu")
    g.manual_seed(seed)
    g.seed_value = seed  # reported on failure so a run can be replayed
    return g


def randn(shape, dtype, gen, scale=1.0, offset=0.0, device=DEVICE):
    """Random normal data made on the CPU (reproducible from the seed), then moved."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32) * scale + offset
    return t.to(device=device, dtype=dtype)


def ones(*shape, dtype=None):
    """torch.ones on the test device."""
    return torch.ones(*shape, dtype=dtype, device=DEVICE)


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


def rel_max(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest difference of out from ref, relative to ref's largest magnitude (in float64)."""
    out, ref = out.detach().double(), ref.detach().double()
    return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


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
            # while kernel_runtime records a launcher for a plan, the fill is left out of the recording (it
            # is the test's, not the launcher's); the plan's own allocations come back poisoned as well
            runtime = sys.modules.get("kernel_runtime")
            recorder = getattr(getattr(runtime, "_TLS", None), "mode", None)
            recorder = recorder if hasattr(recorder, "paused") else None
            paused = recorder is not None and recorder.paused
            if recorder is not None:
                recorder.paused = True
            try:
                if t.is_floating_point():
                    t.fill_(float("nan"))
                elif t.dtype != torch.bool and t.numel():
                    t.fill_(torch.iinfo(t.dtype).max if t.dtype.is_signed or t.dtype == torch.uint8 else 0)
            finally:
                if recorder is not None:
                    recorder.paused = paused
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


# --------------------------------------------------------------------------------------------
# The kernel files' API checks: tables of refused calls, device checks, torch.compile
# --------------------------------------------------------------------------------------------
def error_cases(cases):
    """Parametrizes a test over a table of refused calls, rows (id, exception, message pattern, call): one
    test id a row, the row's id."""
    return pytest.mark.parametrize("case", cases, ids=lambda c: c[0])


def assert_error_case(case, *args):
    """One row (id, exception, message pattern, call) of such a table: call(*args) raises that exception,
    with a message that matches."""
    _, exc, match, call = case
    with pytest.raises(exc, match=match):
        call(*args)


_TWO_DEVICES = pytest.mark.skipif(DEVICE.type == "cpu", reason="needs two devices: a GPU and the CPU")


def needs_gpu_and_cpu(test):
    """Marks a test of the device checks that needs two devices, a GPU and the CPU (marker gpu)."""
    return pytest.mark.gpu(_TWO_DEVICES(test))


def on_gpu_and_cpu(case):
    """A row of such a table that needs two devices, a GPU and the CPU, marked as needs_gpu_and_cpu marks a
    test: an operand on the CPU while x is on the GPU."""
    return pytest.param(case, id=case[0], marks=(pytest.mark.gpu, _TWO_DEVICES))


def norm_error_cases(norm, modulate, gated):
    """The refused calls that rmsnorm.py and layernorm.py share, as rows of such a table, for one file's
    norm(x, weight, ..., eps=), modulate(x, scale, shift) (the norm with modulation) and
    gated(x, y, gate, scale, shift) (gated residual, norm and modulation); t.x: an fp32 [2, 4, 64] tensor,
    t.gen: the test's generator."""
    return [
        ("x not a tensor", TypeError, "x must be a torch.Tensor", lambda t: norm([1.0, 2.0])),
        ("x int32", TypeError, "x has dtype int32", lambda t: norm(ones(2, 4, dtype=torch.int32))),
        ("x float64", TypeError, "x has dtype float64", lambda t: norm(t.x.double())),
        ("weight shape", ValueError, r"weight must have shape \[64\]", lambda t: norm(t.x, ones(63))),
        ("x last stride", ValueError, "contiguous in its last dimension", lambda t: norm(t.x.transpose(1, 2))),
        ("eps negative", ValueError, "eps must be a non-negative", lambda t: norm(t.x, eps=-1.0)),
        ("x 0-d", ValueError, "at least one dimension", lambda t: norm(torch.tensor(1.0, device=DEVICE))),
        (
            "rows need three strides",
            ValueError,
            "cannot be addressed with two strides",
            lambda t: norm(randn((4, 3, 5, 64), torch.float32, t.gen).permute(1, 0, 2, 3)[:, :, ::2]),
        ),
        (
            "shift broadcast",
            ValueError,
            r"shift of shape \(2, 1, 32\) does not broadcast",
            lambda t: modulate(t.x, ones(2, 1, 64), ones(2, 1, 32)),
        ),
        ("modulate no scale shift", ValueError, "scale and shift are required", lambda t: modulate(t.x, None, None)),
        (
            "scale int64",
            TypeError,
            "scale has dtype int64",
            lambda t: modulate(t.x, ones(64, dtype=torch.int64), ones(64)),
        ),
        (
            "gated shift without scale",
            ValueError,
            "scale and shift must be given together",
            lambda t: gated(t.x, t.x, None, ones(64), None),
        ),
        (
            "gated y shape",
            ValueError,
            r"y has shape \(2, 4, 63\)",
            lambda t: gated(t.x, t.x[..., :63], None, None, None),
        ),
        ("gated y missing", ValueError, "y is required", lambda t: gated(t.x, None, None, None, None)),
        on_gpu_and_cpu(
            (
                "weight on another device",
                ValueError,
                "weight is on cpu",
                lambda t: norm(randn((2, 64), torch.float32, t.gen), torch.ones(64)),
            )
        ),
    ]


# A test of what a CPU tensor meets with the interpreter switched off (the kernels run on the CPU here).
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason="the interpreter is off when a GPU runs the tests")


def assert_cpu_tensor_refused_without_interpreter(monkeypatch, call, match="CPU tensor"):
    """With TRITON_INTERPRET=0, call() (which passes CPU tensors to a kernel) raises a ValueError that says so."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=match):
        call()


def run_compiled_fullgraph(model, kw):
    """model(**kw)[0] through torch.compile(fullgraph=True) with a backend that runs Dynamo's graph as captured
    and records its calls. Returns (output, ops, targets): ops the bundle's torch.library ops the graph calls
    (rtk_<kernel file>::name, a GPU's "_triton" twin under its plain name), targets every call's target. The
    graph is before AOT autograd, where the ops keep their names on every device."""
    targets = set()

    def backend(gm, example_inputs):
        targets.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    try:
        out = run_model(torch.compile(model, backend=backend, fullgraph=True), kw)
    finally:
        torch._dynamo.reset()
    ops = {t.split(".")[1].removesuffix("_triton") for t in targets if t.startswith("rtk_")}
    return out, ops, targets


def compiled_with_kernels(model, kw, inject, remove):
    """A diffusers model's output (run_model) without the kernels, then with them injected
    (inject(model, verbose=False)) through run_compiled_fullgraph; the kernels removed after (remove), also on
    a failure. Returns (the output without, the compiled output with, its ops, its call targets)."""
    ref = run_model(model, kw)
    inject(model, verbose=False)
    try:
        out, ops, targets = run_compiled_fullgraph(model, kw)
    finally:
        remove(model, verbose=False)
    return ref, out, ops, targets


def assert_compiles_stock(model, kw, inject, remove):
    """For a family that marks its models (ic.mark_stock_under_compile): with the kernels injected, torch.compile
    traces the stock model, the very graph (the same call targets, no op of the bundle) and the same output, bit
    for bit, as without them; the kernels removed after, also on a failure."""
    try:
        ref, ref_ops, ref_seen = run_compiled_fullgraph(model, kw)
    except Exception as exc:  # noqa: BLE001 (whatever stops the stock model's trace)
        pytest.skip(f"the stock model does not trace fullgraph here: {type(exc).__name__}")
    assert not ref_ops
    inject(model, verbose=False)
    try:
        out, ops, seen = run_compiled_fullgraph(model, kw)
    finally:
        remove(model, verbose=False)
    assert not ops and seen == ref_seen, sorted(seen ^ ref_seen)
    assert torch.equal(out, ref)


def compile_aot_eager(fn):
    """torch.compile(fn) with the aot_eager backend (cheap on the CPU) and fullgraph, after a dynamo reset."""
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


# --------------------------------------------------------------------------------------------
# Injection into diffusers models: kernel call counts, outputs without and with the kernels
# --------------------------------------------------------------------------------------------
def count_calls(monkeypatch, targets) -> Counter:
    """Wraps each function (module, name) of targets so that its calls are counted by name in the Counter
    returned, then run as before (a test then proves that the kernels, not torch, ran)."""
    calls = Counter()
    for mod, name in targets:
        fn = getattr(mod, name)

        def spy(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        monkeypatch.setattr(mod, name, spy)
    return calls


def block_kernel_calls(monkeypatch, *more) -> Counter:
    """count_calls of the kernels of the AdaLN blocks the diffusers families fuse through the generic layer
    (layernorm's layer_norm_modulate and gated_residual_layer_norm_modulate, rmsnorm's gated_residual_add),
    and of more ((module, name) pairs)."""
    import layernorm
    import rmsnorm

    blocks = (
        (layernorm, "layer_norm_modulate"),
        (layernorm, "gated_residual_layer_norm_modulate"),
        (rmsnorm, "gated_residual_add"),
    )
    return count_calls(monkeypatch, (*blocks, *more))


def run_model(model, kw):
    """A diffusers model's output, model(**kw)[0], without autograd."""
    with torch.no_grad():
        return model(**kw)[0]


def copied(model, how: str):
    """A copy of model: copy.deepcopy (how "deepcopy"), or torch.save then torch.load (weights_only=False)
    through memory (how "torch.save")."""
    if how == "deepcopy":
        return copy.deepcopy(model)
    if how != "torch.save":
        raise ValueError(f"how must be 'deepcopy' or 'torch.save', got {how!r}")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)  # (torch.equal has no FP8 kernel everywhere)


def tensor_copies(model) -> dict:
    """Copies of every parameter and buffer of model (non-persistent buffers too), by name."""
    return {n: t.detach().clone() for n, t in (*model.named_parameters(), *model.named_buffers())}


def changed_tensors(model, copies) -> list:
    """The names of model's parameters and buffers that are not bit-identical to their copies (tensor_copies),
    or that were added or are gone since."""
    now = dict((*model.named_parameters(), *model.named_buffers()))
    return sorted(
        n
        for n in set(now) | set(copies)
        if n not in now
        or n not in copies
        or now[n].dtype != copies[n].dtype
        or now[n].shape != copies[n].shape
        or not torch.equal(_bits(now[n]), _bits(copies[n]))
    )


def without_and_with_kernels(model, kw, inject, remove, hooks=(), fired=None):
    """A diffusers model's output (run_model) without, then with the kernels injected
    (inject(model, verbose=False)); after, also on a failure, the hooks (handles) and the kernels (remove)
    are removed. Returns both outputs and len(fired) after the first run (fired: where a hook records its
    calls, emptied before the second run)."""
    fired = [] if fired is None else fired
    try:
        ref = run_model(model, kw)
        n_ref = len(fired)
        fired.clear()
        inject(model, verbose=False)
        got = run_model(model, kw)
    finally:
        for handle in hooks:
            handle.remove()
        remove(model, verbose=False)
    return ref, got, n_ref


def assert_unpatched_again(model, kw, ref, nothing_left):
    """After the kernels' removal: nothing of the injection left in model (nothing_left(model) checks it)
    and its output (model(**kw)[0]) the unpatched ref again, bit for bit."""
    nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)


def assert_bf16_parity(model, kw, ref32, inject, remove, seed):
    """A bf16 diffusers model on bf16 inputs kw, without and with the kernels: the patched output no further
    from the fp32 run's ref32 than 1.5x the unpatched one, within 2^-5 relative L2 of the unpatched one;
    after removal the unpatched output again, bit for bit. seed: named on failure."""
    stock = run_model(model, kw)
    inject(model, verbose=False)
    patched = run_model(model, kw)
    assert patched.dtype == stock.dtype == torch.bfloat16
    e_stock, e_patched = rel_l2(stock, ref32), rel_l2(patched, ref32)
    assert e_patched <= 1.5 * e_stock, f"patched {e_patched:.3e} vs stock {e_stock:.3e} (seed {seed})"
    assert rel_l2(patched, stock) <= 2.0**-5
    remove(model, verbose=False)
    assert torch.equal(run_model(model, kw), stock)


def hooked_norm_outputs(norm, model, kw, inject, remove):
    """without_and_with_kernels while a forward hook on norm (a block's norm module) scales its output by
    1.25: where a norm has a hook, the patched block must call it as the original does, once a run."""
    fired = []
    handle = norm.register_forward_hook(lambda m, a, o: fired.append(1) or o * 1.25)
    ref, got, n_ref = without_and_with_kernels(model, kw, inject, remove, [handle], fired)
    assert len(fired) == n_ref == 1
    return ref, got


def assert_injecting_twice_is_harmless(model, kw, kernel_calls, api, inject, remove, nothing_left, fused=()):
    """A second injection into an injected diffusers model: the same counts, nothing wrapped twice (each
    patched module's original is its class forward; a patched processor's original is none of the fused
    processor classes), the same output from the same kernel calls (kernel_calls: a count_calls Counter);
    one removal gives back the unpatched model (nothing_left(model) checks it) and output bit for bit, and
    a second removal finds nothing. api: the injection module (its _STATE, _PROCESSOR_KINDS and KINDS)."""
    ref = run_model(model, kw)
    first = inject(model, verbose=False)
    once = run_model(model, kw)
    calls_once = dict(kernel_calls)
    assert inject(model, verbose=False) == first
    for m in model.modules():
        state = m.__dict__.get(api._STATE)
        if state is not None and state["kind"] in api._PROCESSOR_KINDS:
            assert type(state["prev"]) not in fused
        elif state is not None:
            assert state["prev"] is None
    kernel_calls.clear()
    assert torch.equal(run_model(model, kw), once)
    assert dict(kernel_calls) == calls_once
    remove(model, verbose=False)
    nothing_left(model)
    assert torch.equal(run_model(model, kw), ref)
    assert remove(model, verbose=False) == {k: 0 for k in api.KINDS}


def ltx_inputs(gen, dtype=torch.float32, batch=2, frames=3, height=8, width=8, text=16):
    """Keyword arguments of a forward of diffusers' tiny LTX-Video transformer (8 latent and 16 text
    channels): random latents and prompt, the last prompt padded (the cross-attention mask matters),
    timesteps 700, 300 (500 for any further sample)."""
    hs = torch.randn(batch, frames * height * width, 8, generator=gen)
    enc = torch.randn(batch, text, 16, generator=gen)
    mask = torch.ones(batch, text)
    mask[-1, text // 2 :] = 0
    return dict(
        hidden_states=hs.to(DEVICE, dtype),
        encoder_hidden_states=enc.to(DEVICE, dtype),
        timestep=torch.tensor([700.0, 300.0][:batch] + [500.0] * max(0, batch - 2), device=DEVICE),
        encoder_attention_mask=mask.to(DEVICE),
        num_frames=frames,
        height=height,
        width=width,
        rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )


# --------------------------------------------------------------------------------------------
# Subprocesses, and compiling for a GPU target on a machine without it
# --------------------------------------------------------------------------------------------
def env_without_interpreter() -> dict:
    """os.environ without TRITON_INTERPRET (a subprocess that compiles for a GPU target), warnings off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


SUBPROCESS_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "subprocess_site")


def with_interpreter_speedup(env: dict) -> dict:
    """env with tests/subprocess_site first on PYTHONPATH: a Python started with it runs the kernels through
    Triton's interpreter as the test processes do, with interpreter_speedup.install()'s wrappers (the same results
    sooner), once it imports the interpreter."""
    path = [SUBPROCESS_SITE, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return {**env, "PYTHONPATH": os.pathsep.join(path)}


def run_python(args, *, env=None, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    """sys.executable run on args (a script and its arguments, or -c and code), its text output captured."""
    return subprocess.run(
        [sys.executable, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


class TargetOnlyDriver:
    """A stand-in for Triton's active driver that reports one target (a triton.backends.compiler.GPUTarget):
    enough to compile for that target on a machine without it; nothing is ever launched through it."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True

# SPDX-License-Identifier: Apache-2.0
"""The launch runtime of the bundle: what a kernel file gets when it is used inside this bundle.

A kernel file (rmsnorm.py, layernorm.py, rope.py, qk_norm_rope.py, activations.py, head_norm_rope.py,
skinny_gemm.py) stands alone: it imports torch and triton, holds its @triton.jit kernels, one plain launcher per op
(argument checks, launch heuristics, ``kernel[grid](...)``), its public functions and their PyTorch
references. Its last lines hand its launchers to this module when it sits beside it:

    try:
        import kernel_runtime
    except ImportError:  # copied alone: the plain launchers run
        pass
    else:
        kernel_runtime.accelerate(globals(), rms_norm_fused="_launch")

The hook sits in the kernel file rather than in the integrations (which could wrap the modules they import)
so that every importer gets the same module whatever the import order (injections, benchmarks, tests,
check_amd_compile.py), and so that a reader of the kernel file sees where its fast path comes from. A copy
without this file beside it takes the ImportError branch: its launchers run as written, eagerly and under
torch.compile (Dynamo traces the plain launcher and records ``kernel[grid](...)`` as a user-defined Triton
kernel, which Inductor launches from its generated code).

``accelerate(namespace, **ops)`` replaces each named launcher in the module with a wrapper that adds:

1. Launch plans, for host time. Triton's JIT binds and specialises every argument on every launch, and a
   launcher's checks and heuristics cost as much again: tens of microseconds a call, more than a small
   kernel runs. The first call of each signature (every tensor's shape, strides, dtype and device; every
   other argument's type and value) runs the plain launcher while recording what it does: the tensors it
   allocates, the views it takes, the kernels it launches (the compiled kernel Triton's JIT returns, its
   grid and arguments). The recording becomes a plan; a later call with that signature allocates the same
   outputs and hands the data pointers straight to each compiled kernel's runner (the call Triton's JIT
   ends with, Triton 3.3 to 3.9), then returns what the launcher returned. A plan is made only where the
   recording shows that this is exact, else the call stays with the plain launcher (``unplanned`` on the
   wrapper says why): the launcher did nothing but allocate, take views and launch (no computation with
   torch, no reading of tensor values); every tensor a kernel got is an input, an allocation of the call
   or a view of one of those; every tensor it returned is an input or an allocation. A launch argument that
   is not a tensor is kept as it was: it is fixed by the signature, as a launcher's choices depend on the
   signature only (its contract). One launcher computes with torch by design: skinny_gemm hands rows above
   its kernel's measured bound to torch's GEMM (through this module's _skinny_torch_linear); a recording
   whose only torch work is that call, on a view of its input and its other inputs as given, becomes a
   _TorchRoute, which makes that call directly. What Triton specialises on beyond that is the 16-byte alignment of each
   pointer: a pointer compiled as aligned must still be, checked on every call. AMD's buffer-load
   specialisation (storage under 2 GiB) needs no check: the offsets a kernel computes depend on shapes,
   strides and dtypes only. Everything else goes to the plain launcher: the interpreter (no compiled
   kernel), launch hooks (a profiler's), a current device other than the plan's, a misaligned pointer.
   A plan's replay and the key of a call (one key function per launcher) are Python functions written out
   and executed here, the bundle's only generated code (see "Generated code" below
   for why and what it costs).
2. torch.library ops, so that torch.compile traces through the launchers without a graph break: each
   launcher becomes op ``rtk_<module>::<name>`` (a custom op, which torch.compile calls back at run time)
   and, where torch has it, ``rtk_<module>::<name>_triton`` (a triton_op: Inductor traces the launcher once
   and launches its kernels from its own generated code, about 11x less host time per call than the custom
   op for chained small fused norms on an H200, examples/benchmark_launch_overhead_h200.json). The custom op
   serves the Triton interpreter (Inductor cannot run interpreted kernels) and symbolic sizes (a launcher
   picks its configuration from concrete sizes). The namespace comes from the module's name, so a copy
   under another name (my_rmsnorm.py: rtk_my_rmsnorm) registers ops of its own. A name is registered once
   per process: the same file imported again keeps its ops; other code under the same module name raises
   (``_claim``) instead of leaving torch.compile to run the code registered first. A custom op cannot
   return None: an absent output travels as an empty bool tensor and is None again at the call.
3. Clear errors for tensors no kernel can run on (a meta tensor; a CPU tensor without the interpreter;
   TRITON_INTERPRET changed since the module was imported), checked when a plan is made (the device is
   part of its key). A copy without the runtime gets Triton's own errors there.

Kept in the kernel files, and why. Each file must work alone, so what its launcher needs stays in it even
where another file needs the same: ``_device_target`` (the GPU target from
``triton.runtime.driver.active.get_current_target()``, five lines), the FP8 encode helpers and FP8 format
table (rmsnorm.py and activations.py: both have kernels with FP8 output), the two-level row layout of
broadcast operands (rmsnorm.py and layernorm.py). These few copies are the price of files that copy alone;
they are short and each sits beside the only kernels that use it. Checks that a standalone file needs for
correctness stay in it too: the refusal of inputs requiring grad (the kernels have no backward, so
gradients would stop without a word).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import threading
import typing
import warnings

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["accelerate", "plans", "clear_plans", "own_plans", "use_triton_op", "TRITON_OP"]

PLAN_CACHE_SIZE = 4096  # plans kept per launcher; the cache is emptied when it is full


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# torch.compile records the triton_op twins where torch has them, except under the interpreter.
TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton") and not _interpreting()
# Under the Triton interpreter a plan never launches (there is no compiled kernel); with VERIFY_PLANS set
# (tests/conftest.py sets it there) every call that has a plan records the plain launcher again and checks
# that the plan would have handed each kernel exactly those arguments.
VERIFY_PLANS = False


class _Local(threading.local):
    mode = None  # None (plain), _Recorder (making a plan), "fake" or "trace" (torch.compile)


_TLS = _Local()
_WRAPPERS: list = []  # every accelerated launcher, for plans() and clear_plans()
_MISS = object()


# --------------------------------------------------------------------------------------------
# Kernels as the launchers see them
# --------------------------------------------------------------------------------------------
class _Kernel:
    """Stands in, in an accelerated module, for a @triton.jit kernel that its launchers launch.

    ``kernel[grid](...)`` launches the kernel itself, recorded while a plan is made; in a fake run (the
    fake implementation of an op) nothing is launched; while a triton_op body is traced the launch goes
    through torch.library.wrap_triton. Attributes are the kernel's.
    """

    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return functools.partial(_launch_kernel, self.kernel, grid)

    def __repr__(self):
        return f"<{self.kernel!r} launched through kernel_runtime>"


def _launch_kernel(kernel, grid, *args, **kwargs):
    mode = _TLS.mode
    if mode is None:
        return kernel[grid](*args, **kwargs)
    if mode == "fake":
        return None
    if mode == "trace":
        return torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    return mode.launch(kernel, grid, args, kwargs)


@contextlib.contextmanager
def _mode(mode):
    outer, _TLS.mode = _TLS.mode, mode
    try:
        yield mode
    finally:
        _TLS.mode = outer


# --------------------------------------------------------------------------------------------
# Recording a call of the plain launcher
# --------------------------------------------------------------------------------------------
_aten = torch.ops.aten
_ALLOCATIONS = {
    _aten.empty.memory_format: "empty",
    _aten.empty_like.default: "empty",
    _aten.empty_strided.default: "empty",
    _aten.new_empty.default: "empty",
    _aten.new_empty_strided.default: "empty",
    _aten.zeros.default: "zeros",
    _aten.zeros_like.default: "zeros",
    _aten.new_zeros.default: "zeros",
}


class _Recorder(TorchDispatchMode):
    """The torch operations and kernel launches of one call of a plain launcher.

    Allocations and views are kept (each result with its parent), any other torch operation is noted as a
    computation (which rules a plan out); kernel launches run, with the torch operations of the launch
    itself (the interpreter's) left out."""

    def __init__(self):
        super().__init__()
        self.allocs, self.parents, self.computes, self.launches, self.paused = {}, {}, [], [], False
        self.routes = []  # calls of _skinny_torch_linear: (first compute, end of its computes, arguments, result)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        if func in _ALLOCATIONS:
            self.allocs[id(out)] = (out, _ALLOCATIONS[func])
        elif getattr(func, "is_view", False) and args and isinstance(args[0], torch.Tensor):
            for o in out if isinstance(out, (list, tuple)) else (out,):
                self.parents[id(o)] = (o, args[0])
        else:
            self.computes.append(str(func))
        return out

    def launch(self, kernel, grid, args, kwargs):
        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"), None)
        self.paused = True
        try:
            with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
                compiled = kernel[grid](*args, **kwargs)
        finally:
            self.paused = False
        self.launches.append((kernel, grid, args, kwargs, compiled))
        return compiled

    def root(self, t, inputs):
        """(0, input index) or (1, allocation) that tensor t is, or is a view of; None if neither."""
        for _ in range(64):
            for i, inp in enumerate(inputs):
                if t is inp:
                    return 0, i
            alloc = self.allocs.get(id(t))
            if alloc is not None and alloc[0] is t:
                return 1, t
            parent = self.parents.get(id(t))
            if parent is None or parent[0] is not t:
                return None
            t = parent[1]
        return None


# --------------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------------
def _no_gpu(*_):
    return None


_current_device = getattr(torch._C, "_cuda_getDevice", _no_gpu)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _no_gpu)
# Where Triton keeps its launch hooks: triton.knobs.runtime from Triton 3.4, CompiledKernel before.
_HOOKS = getattr(getattr(triton, "knobs", None), "runtime", None) or triton.compiler.CompiledKernel
_RUNNER = {"ok": None}  # whether compiled kernels expose the runner interface the plans use (set once)


def _hooks_idle() -> bool:
    """Whether no Triton launch hook (a profiler's, say) is installed: a plan's launch skips them."""
    for hook in (_HOOKS.launch_enter_hook, _HOOKS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # Triton 3.5+: an empty HookChain is idle
            return False
    return True


def _has_runner(compiled) -> bool:
    if _RUNNER["ok"] is None and compiled is not None:
        _RUNNER["ok"] = all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))
        if not _RUNNER["ok"]:
            warnings.warn(
                f"Triton {triton.__version__}: compiled kernels lack the runner interface; kernels launch "
                "through the JIT (more host time per call)",
                stacklevel=3,
            )
    return bool(_RUNNER["ok"]) and compiled is not None


def _dense(t: torch.Tensor) -> bool:
    """Whether torch.empty_like(t) makes a tensor of t's own shape and strides (t non-overlapping and dense,
    a plain tensor)."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1)
    expected = 1
    for st, s in dims:
        if st != expected:
            return False
        expected *= s
    return True


class _Plan:
    """The replay of one recorded call: its allocations, its launches with every argument fixed but the data
    pointers, its result. See the module docstring for what makes a recording a plan."""

    __slots__ = ("inputs", "specs", "launches", "result", "single", "device", "runnable", "run", "name", "aliases")

    def __init__(self, rec, inputs, positions, result, device, name="launcher"):
        if rec.computes:
            raise _Unplanned(f"the launcher computes with torch ({rec.computes[0]})")
        self.inputs, self.device, self.name = positions, device, name
        # inputs that were one tensor (w passed as q_weight and k_weight): their slots name the first; a later
        # call of the same key whose inputs are distinct tensors goes to the plain launcher
        first, aliases = {}, []
        for j, t in enumerate(inputs):
            i = first.setdefault(id(t), j)
            if i != j:
                aliases.append((i, j))
        self.aliases = tuple(aliases)
        allocs, made = [], {}  # allocation specs; id(allocation) -> its index

        def slot(t):
            r = rec.root(t, inputs)
            if r is None:
                raise _Unplanned("a tensor that is neither an input, an allocation nor a view of one")
            if r[0] == 0:
                return r[1], t.data_ptr() - inputs[r[1]].data_ptr()
            a = r[1]
            if id(a) not in made:
                made[id(a)] = len(allocs)
                allocs.append((tuple(a.shape), a.stride(), a.dtype, a.device, rec.allocs[id(a)][1]))
            return len(inputs) + made[id(a)], t.data_ptr() - a.data_ptr()

        single = isinstance(result, torch.Tensor)
        template = []
        for r in (result,) if single else result:
            if isinstance(r, torch.Tensor):
                src, off = slot(r)
                if off or (src >= len(inputs) and (r.shape, r.stride()) != allocs[src - len(inputs)][:2]):
                    raise _Unplanned("the launcher returns a view")
                template.append((src, None))
            elif r is None or isinstance(r, (bool, int, float, str, torch.dtype)):
                template.append((-1, r))
            else:
                raise _Unplanned(f"the launcher returns a {type(r).__name__}")
        launches, runnable = [], True
        for kernel, grid, args, kwargs, compiled in rec.launches:
            if callable(grid):
                raise _Unplanned("a grid given as a function")
            fn = getattr(kernel, "fn", kernel)
            params = inspect.signature(fn).parameters
            bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
            bound.apply_defaults()
            values, slots = list(bound.arguments.values()), []
            for i, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    src, off = slot(v)
                    slots.append((i, src, off, 15 if v.data_ptr() % 16 == 0 else 0))
                    values[i] = None
            grid = tuple(grid) + (1,) * (3 - len(grid))
            runnable &= _has_runner(compiled)
            launches.append((kernel, grid, compiled, tuple(values), tuple(slots)))
        self.launches, self.result, self.single = tuple(launches), tuple(template), single
        self.runnable = runnable and (not launches or device is not None)
        # an allocation of the same shape, strides, dtype and device as a dense input: torch.empty_like of it
        # (the least host time of torch's allocators)
        self.specs = tuple(
            spec + (next((i for i, t in enumerate(inputs) if _dense(t) and _layout(t) == spec[:4]), None),)
            for spec in allocs
        )
        self.run = self._first_run  # the launch function, generated at the first call that replays the plan

    def _first_run(self, args):
        self.run = _generate_launch(self)
        return self.run(args)

    def __call__(self, args):
        """The launcher's result for args, or _MISS where this call must go to the plain launcher."""
        return self.run(args)

    def describe(self):
        """What the plan fixes, alignment masks left out (a misaligned call is sent to the plain launcher):
        for comparing two plans."""
        launches = [(k, g, v, tuple(s[:3] for s in slots)) for k, g, _, v, slots in self.launches]
        return self.inputs, self.result, launches, self.specs, self.aliases


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


# --------------------------------------------------------------------------------------------
# Generated code: the one place this bundle writes Python source and executes it
# --------------------------------------------------------------------------------------------
# Why: a replayed call is all host time (the GPU work is queued), and a general loop over a plan's slots and a
# signature built argument by argument cost more Python than the launch itself: on the CPU, with the runner
# replaced by a no-op, a planned rms_norm call took 9.9 us that way against 5.4 us for a function written
# out per plan (benchmark_before_after.py measures it on a GPU). A generated function holds each constant
# as a literal or a closure cell and each pointer as a local: no lists built, no per-argument branches.
# What it does is exactly what the plan describes (describe(), which VERIFY_PLANS compares call by call).
_LITERAL_TYPES = (bool, int, str, type(None))


def _constant(value, consts: list) -> str:
    """Source text for a constant argument: a literal where repr gives back the same value and type, else a
    closure cell."""
    if type(value) in _LITERAL_TYPES or (type(value) is float and value == value and abs(value) != float("inf")):
        return repr(value)
    consts.append(value)
    return f"c{len(consts) - 1}"


def _compile(src: str, name: str, consts: list):
    """Execute src (which defines ``make(c0, c1, ...)`` returning the generated function) with this module's
    globals, so the generated code sees what tests patch here, and return make(*consts)."""
    scope = {}
    exec(compile(src, f"<kernel_runtime: {name}>", "exec"), globals(), scope)  # noqa: S102 - see above
    return scope["make"](*consts)


def _generate_launch(plan: _Plan):
    """The replay of a plan as one function of the call's args: checks, allocations, direct launches, result
    (the plan's launches as they are now: tests swap in a fake compiled kernel before the first replay)."""
    if not plan.runnable:
        return _never
    consts, body = [], []
    n_in = len(plan.inputs)
    if plan.launches:
        body.append(f"if _current_device() != {plan.device!r} or not _hooks_idle(): return _MISS")
    for k, (i, j) in enumerate(plan.inputs):
        body.append(f"t{k} = args[{i}]" + ("" if j is None else f"[{j}]"))
    used = sorted({s[1] for launch in plan.launches for s in launch[4]})
    for src in used:
        if src < n_in:
            body.append(f"p{src} = t{src}.data_ptr()")
    if plan.aliases:
        body.append("if " + " or ".join(f"t{i} is not t{j}" for i, j in plan.aliases) + ": return _MISS")
    aligned = sorted({(s[1], s[2]) for launch in plan.launches for s in launch[4] if s[1] < n_in and s[3]})
    if aligned:  # a pointer compiled as 16-byte aligned that is not: the plain launcher (its JIT recompiles)
        body.append("if " + " or ".join(f"(p{src} + {off}) & 15" for src, off in aligned) + ": return _MISS")
    for a, (shape, stride, dtype, device, kind, like) in enumerate(plan.specs):
        o = f"t{n_in + a}"
        contiguous = stride == _contiguous_strides(shape)
        sd = f"{_constant(shape, consts)}, dtype={_constant(dtype, consts)}, device={_constant(device, consts)}"
        st = _constant(stride, consts)
        if kind == "zeros":
            body.append(
                f"{o} = torch.zeros({sd})"
                if contiguous
                else f"{o} = torch.zeros_like(torch.empty_strided({_constant(shape, consts)}, {st}, "
                f"dtype={_constant(dtype, consts)}, device={_constant(device, consts)}))"
            )
        elif like is not None:
            body.append(f"{o} = torch.empty_like(t{like})")
        elif contiguous:
            body.append(f"{o} = torch.empty({sd})")
        else:
            body.append(
                f"{o} = torch.empty_strided({_constant(shape, consts)}, {st}, dtype={_constant(dtype, consts)}, "
                f"device={_constant(device, consts)})"
            )
        if n_in + a in used:
            body.append(f"p{n_in + a} = {o}.data_ptr()")
    if plan.launches:
        body.append(f"stream = _current_stream({plan.device!r})")
    for kernel, grid, compiled, values, slots in plan.launches:
        # the compiled kernel's runner, function handle and metadata, read once here (its run is a property)
        run, fn, meta = (_constant(v, consts) for v in (compiled.run, compiled.function, compiled.packed_metadata))
        vals = [_constant(v, consts) for v in values]
        for i, src, off, _ in slots:
            vals[i] = f"p{src} + {off}" if off else f"p{src}"
        grid_src = ", ".join(_constant(g, consts) for g in grid)
        body.append(f"{run}({grid_src}, stream, {fn}, {meta}, None, None, None, {', '.join(vals)})")
    if plan.single:
        body.append(f"return t{plan.result[0][0]}")
    else:
        items = [_constant(value, consts) if src < 0 else f"t{src}" for src, value in plan.result]
        body.append(f"return ({', '.join(items)},)")
    params = ", ".join(f"c{i}" for i in range(len(consts)))
    src = f"def make({params}):\n    def launch(args):\n" + "".join(f"        {line}\n" for line in body)
    src += "    return launch\n"
    return _compile(src, f"plan of {plan.name}", consts)


def _never(args):
    return _MISS


class _TorchRoute:
    """The replay of a recorded call whose launcher checked its arguments and then handed the whole call to
    torch's GEMM (skinny_gemm above the rows its kernel wins at: ``_skinny_torch_linear(x.view(m, k), weight,
    bias, weight_scale, x_scale, out_dtype).reshape(shape)`` with nothing else computed or launched). Those
    checks and that choice depend on the signature only, so a later call of the signature makes the same
    torch call directly. Where torch's GEMM declines (None), the plain launcher runs (its kernel)."""

    __slots__ = ("rows", "shape", "out_dtype", "namespace")
    launches, inputs, result = (), (), ()

    def __init__(self, rows, shape, out_dtype, namespace):
        self.rows, self.shape, self.out_dtype, self.namespace = rows, shape, out_dtype, namespace

    @classmethod
    def of(cls, rec, args, kwargs, result, namespace):
        """The route of this recording, or None where it is not one (then _Plan decides)."""
        if len(rec.routes) != 1 or rec.launches or kwargs or len(args) < 5:
            return None
        start, end, (x2, w, b, ws, xs, out_dtype), y = rec.routes[0]
        x = args[0]
        if start != 0 or end != len(rec.computes) or y is None or not isinstance(result, torch.Tensor):
            return None  # torch computed something besides the GEMM, or the GEMM declined
        if any(a is not c for a, c in zip(args[1:5], (w, b, ws, xs))) or rec.root(x2, [x]) != (0, 0):
            return None
        if x2.data_ptr() != x.data_ptr() or x2.stride() != x.view(x2.shape).stride():
            return None  # not x.view(m, k)
        made = result is y or (
            rec.parents.get(id(result), (None, None))[0] is result and rec.parents[id(result)][1] is y
        )
        return cls(tuple(x2.shape), tuple(result.shape), out_dtype, namespace) if made else None

    def run(self, args):  # through the module's _torch_linear, as the launcher calls it (a test may replace it)
        gemm = self.namespace["_torch_linear"]
        y = gemm(args[0].view(self.rows), args[1], args[2], args[3], args[4], self.out_dtype)
        return _MISS if y is None else y.reshape(self.shape)

    __call__ = run

    def describe(self):
        return "torch route", self.rows, self.shape, self.out_dtype


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for s in reversed(shape):
        strides.insert(0, step)
        step *= max(s, 1)
    return tuple(strides)


class _Unplanned(Exception):
    pass


def _plan_device(inputs):
    """The GPU index a plan launches on (its first input's), None for the CPU (no plan launches there)."""
    return inputs[0].device.index if inputs and inputs[0].device.type == "cuda" else None


# --------------------------------------------------------------------------------------------
# The wrapper of a launcher
# --------------------------------------------------------------------------------------------
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_is_compiling = torch.compiler.is_compiling


def _entry(a):
    """What a plan key holds of one argument: None for None; else the argument's type first (so that entries of
    different kinds never compare equal, and 1, 1.0 and True stay apart), then a tensor's layout, a list's or
    tuple's items (_items_key), or the value itself. TypeError for a tensor subclass (no plan serves it)."""
    t = type(a)
    if a is None:
        return None
    if t in _TENSOR_TYPES:
        return (t, a.shape, a.stride(), a.dtype, a.device)
    if t is list or t is tuple:
        return (t, _items_key(a))
    if isinstance(a, torch.Tensor):
        raise TypeError("a tensor subclass")
    return (t, a)


def _items_key(a) -> tuple:
    """The key of a list or tuple argument's items, as _entry makes each (TypeError for a tensor subclass)."""
    keys = []
    for b in a:
        t = type(b)
        if t in _TENSOR_TYPES:
            keys.append((t, b.shape, b.stride(), b.dtype, b.device))
        elif isinstance(b, torch.Tensor):
            raise TypeError("a tensor subclass")
        else:
            keys.append((t, b))
    return tuple(keys)


def _signature(args, kwargs):
    """The plan key of a call given keywords, and where its tensors are ([(argument index, item index or
    None)]). Raises TypeError for what no plan serves (a tensor subclass, an unhashable option)."""
    key, where = [_entry(a) for a in args], []
    for i, a in enumerate(args):
        if type(a) in _TENSOR_TYPES:
            where.append((i, None))
        elif type(a) is list or type(a) is tuple:
            where += [(i, j) for j, b in enumerate(a) if type(b) in _TENSOR_TYPES]
    for name, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            raise TypeError("a tensor passed by keyword")
        key.append((name, type(v), v))
    key = tuple(key)
    hash(key)
    return key, tuple(where)


# The key function of a launcher's positional calls (generated; see "Generated code" above): one per launcher,
# its parameters those of the launcher (defaults included, so that a call that leaves them out and one that
# passes them get one key), each argument keyed as _entry keys it by an expression written for the kinds of
# argument seen at its position so far: "none", "tensor", "value", "items" (a list or tuple). An argument of
# another kind makes the expression raise (_unseen, or an AttributeError: a float has no shape) or give an
# entry led by another type, which no recorded key holds; the call then takes the slow path, which adds the
# kind and writes the function again. Its keys equal _entry's, so plans survive a rewrite.
_KEY_ERRORS = (TypeError, AttributeError, ValueError)


class _NewKind(TypeError):
    pass


def _unseen(*_):
    raise _NewKind


def _kind(a) -> str:
    t = type(a)
    if a is None:
        return "none"
    if t in _TENSOR_TYPES:
        return "tensor"
    if t is list or t is tuple:
        return "items"
    if isinstance(a, torch.Tensor):
        raise TypeError("a tensor subclass")
    return "value"


def _key_expression(name: str, kinds: frozenset) -> str:
    core = {
        frozenset({"tensor"}): f"(type({name}), {name}.shape, {name}.stride(), {name}.dtype, {name}.device)",
        frozenset({"value"}): f"(type({name}), {name})",
        frozenset({"items"}): f"(type({name}), _items_key({name}))",
        frozenset(): "_unseen()",
    }.get(kinds - {"none"}, f"_entry({name})")
    return core if "none" not in kinds else f"(None if {name} is None else {core})"


def _generate_keyer(kinds: list, defaults: tuple):
    """The key function for a launcher whose positional arguments have been of these kinds (one set per
    parameter), with the launcher's trailing defaults."""
    consts, params = [], []
    for i in range(len(kinds)):
        d = len(kinds) - len(defaults)
        params.append(f"a{i}" if i < d else f"a{i}={_constant(defaults[i - d], consts)}")
    parts = [_key_expression(f"a{i}", frozenset(k)) for i, k in enumerate(kinds)]
    src = f"def make({', '.join(f'c{i}' for i in range(len(consts)))}):\n"
    src += f"    def key({', '.join(params)}):\n        return ({', '.join(parts)},)\n    return key\n"
    return _compile(src, "plan key", consts)


class _Accelerated:
    """A launcher with plans, torch.library ops and device checks (see the module docstring)."""

    def __init__(self, launcher, namespace, op, owner):
        self.launcher, self.namespace, self.op_name, self.owner = launcher, namespace, op, owner
        self.plans, self.unplanned = {}, {}
        signature = inspect.signature(launcher)
        self.params = list(signature.parameters)
        positional = all(p.kind is p.POSITIONAL_OR_KEYWORD for p in signature.parameters.values())
        self.arity = len(self.params) if positional else None  # None: calls keyed by _signature
        self.defaults = tuple(p.default for p in signature.parameters.values() if p.default is not p.empty)
        self.key = _unseen  # written at the first positional call (_key)
        self.keying = [frozenset()] * len(self.params), _unseen
        functools.update_wrapper(self, launcher)
        self.compile_op, self.numbers = None, ()  # set by _register

    def __call__(self, *args, **kwargs):
        if _is_compiling():
            for i, name, kind in self.numbers:  # the op would take True as 1: refuse it as the launcher does
                value = args[i] if i < len(args) else kwargs.get(name)
                if isinstance(value, bool):
                    raise ValueError(f"{name} must be a {kind.__name__}, got {value!r}")
            return self._unpack(self.compile_op(*args, **kwargs))
        if _TLS.mode is not None:  # called by a launcher being recorded, faked or traced
            return self.launcher(*args, **kwargs)
        if not kwargs and not VERIFY_PLANS:  # the fast path: key, plan, replay
            try:
                plan = self.plans.get(self.key(*args))
            except _KEY_ERRORS:  # an argument of a kind not seen at its position (or unhashable): below
                plan = None
            if plan is not None:
                out = plan.run(args)
                return out if out is not _MISS else self._plain(args, kwargs)
        try:
            key = self._key(args, kwargs)
            plan = self.plans.get(key)
        except _KEY_ERRORS:  # a tensor subclass, an unhashable value: no plan serves the call
            return self._plain(args, kwargs)
        if plan is not None:
            if VERIFY_PLANS:
                return self._record(args, kwargs, key, verify=plan)
            out = plan.run(args)
            if out is not _MISS:
                return out
            return self._plain(args, kwargs)
        if key in self.unplanned:  # recorded once and found unplannable: the plain launcher, not a new recording
            return self._plain(args, kwargs)
        return self._record(args, kwargs, key)

    def _key(self, args, kwargs):
        """The plan key of a call (TypeError where no plan serves it): with keywords, or for a launcher with other
        than plain parameters, _signature's; else self.key's, written again first where an argument is of a kind
        not yet seen at its position."""
        if kwargs or self.arity is None or len(args) > self.arity:
            return _signature(args, kwargs)[0]
        missing = self.arity - len(args)
        if missing > len(self.defaults):
            return _signature(args, kwargs)[0]  # a required argument left out: the launcher will say so
        full = args + self.defaults[len(self.defaults) - missing :]
        kinds = [_kind(a) for a in full]  # (TypeError for a tensor subclass, before anything changes)
        seen, key = self.keying  # the kinds seen and the function written for them, published together
        if key is _unseen or any(k not in s for k, s in zip(kinds, seen)):
            grown = [s | {k} for k, s in zip(kinds, seen)]
            key = _generate_keyer(grown, self.defaults)
            self.keying = grown, key
            self.key = key
        return key(*args)

    def _plain(self, args, kwargs):
        self._check_devices(args, kwargs)
        return self.launcher(*args, **kwargs)

    def _record(self, args, kwargs, key, verify=None):
        self._check_devices(args, kwargs)
        where = _signature(args, kwargs)[1]  # where the call's tensors are
        inputs = [args[i] if j is None else args[i][j] for i, j in where]
        rec = _Recorder()
        with _mode(rec), rec:
            result = self.launcher(*args, **kwargs)
        try:
            plan = _TorchRoute.of(rec, args, kwargs, result, self.owner) or _Plan(
                rec, inputs, where, result, _plan_device(inputs), self.__name__
            )
        except _Unplanned as e:
            if len(self.unplanned) >= PLAN_CACHE_SIZE:
                self.unplanned.clear()
            self.unplanned[key] = str(e)
            return result
        if verify is not None:
            _check_plan(self, verify, plan)
        else:
            if len(self.plans) >= PLAN_CACHE_SIZE:
                self.plans.clear()  # many distinct shapes (dynamic sizes): a new plan costs one slow call
            self.plans[key] = plan
        return result

    def _check_devices(self, args, kwargs):
        """Refuse, with a clear error, a first tensor argument that no kernel of the module can run on (see
        _check_device); the launcher itself refuses other tensors on another device than that one."""
        for name, a in zip(self.params, args):
            for j, t in enumerate(a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor):
                    label = name if not isinstance(a, (list, tuple)) or len(a) == 1 else f"{name} (part {j})"
                    return _check_device(label, t, self.owner)

    @staticmethod
    def _unpack(out):
        if isinstance(out, torch.Tensor):
            return out
        return tuple(None if _is_absent(t) else t for t in out)


def _check_plan(wrapper, plan, fresh) -> None:
    """VERIFY_PLANS: the plan kept for this call's signature must be the plan this call makes. Its pointer
    slots are each kernel tensor's (input or allocation, byte offset) as this call's plain launcher passed it,
    so equal plans mean the kept plan hands every kernel exactly what the plain launcher did."""
    if plan.describe() != fresh.describe():
        raise AssertionError(
            f"{wrapper.owner['__name__']}.{wrapper.__name__}: the plan kept for this call's signature differs "
            f"from the plan this call makes:\n  kept:  {plan.describe()}\n  fresh: {fresh.describe()}"
        )


# --------------------------------------------------------------------------------------------
# Device checks
# --------------------------------------------------------------------------------------------
def _check_device(name: str, t: torch.Tensor, owner: dict) -> None:
    """Refuse a tensor that the module's kernels cannot run on, with a clear error: a meta tensor (no data);
    a CPU tensor without the interpreter; any tensor once TRITON_INTERPRET has changed since the module was
    imported (compiled kernels handed CPU tensors fail deep inside Triton, "0 active drivers"; interpreted ones
    handed GPU tensors are not what the caller meant). Exception: the ahead-of-time capture of
    scripts/check_amd_compile.py, which sets TRITON_INTERPRET and reports a GPU target for CPU tensors (the
    module's ``_device_target`` patched) to record launches without running them."""
    device, module = t.device, owner["__name__"]
    if device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor: meta tensors hold no data (only a shape and a dtype), so no kernel can "
            "run on them; pass a tensor on the GPU (or on the CPU under the Triton interpreter)"
        )
    interpreting, at_import = _interpreting(), owner["_rtk_interpreted"]
    if device.type == "cpu" and not interpreting:
        raise ValueError(
            f"{name} is a CPU tensor: Triton kernels run on a GPU (or on the CPU through the Triton "
            "interpreter: set TRITON_INTERPRET=1 before importing this module)"
            + ("; TRITON_INTERPRET was set when this module was imported and has been unset since" if at_import else "")
        )
    target = owner.get("_device_target")
    if interpreting != at_import and not (device.type == "cpu" and target and target(device)[0] != "interpreter"):
        if interpreting:
            raise RuntimeError(
                f"TRITON_INTERPRET is set now but was not when {module} was imported: its kernels were "
                f"compiled for a GPU, not decorated for the Triton interpreter ({name} is on {device}). Set "
                "TRITON_INTERPRET=1 before importing the module, or unset it to run on a GPU"
            )
        raise RuntimeError(
            f"TRITON_INTERPRET was set when {module} was imported but is not now: its kernels were decorated "
            f"for the Triton interpreter, not compiled for a GPU ({name} is on {device}). Set TRITON_INTERPRET=1 "
            "before importing the module and leave it set, or unset it before importing the module to run "
            "compiled kernels"
        )


# --------------------------------------------------------------------------------------------
# torch.library ops
# --------------------------------------------------------------------------------------------
def _is_absent(t) -> bool:
    """Whether t is the stand-in for an absent (None) output: an empty 1-D bool tensor."""
    return t.dtype == torch.bool and t.dim() == 1 and t.shape[0] == 0


def _pack(out, like):
    """A launcher's result as an op returns it: a tensor, or a list with None as an empty bool tensor."""
    if isinstance(out, torch.Tensor):
        return out
    packed = []
    for t in out:
        if t is None:
            t = torch.empty(0, dtype=torch.bool, device=like.device)
        elif _is_absent(t):
            raise RuntimeError("a launcher returned an empty bool tensor, the stand-in for None")
        packed.append(t)
    return packed


def _symbolic(args) -> bool:
    """Whether a tensor among args (or in a list among args) has a symbolic size or stride."""
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride())):
                return True
    return False


def _first_tensor(args):
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, torch.Tensor):
                return t
    raise TypeError("an op needs at least one tensor argument")


def _claim(ns: str, name: str, source, file) -> bool:
    """Whether op ns::name is to be registered now: True if no op holds the name; False if the same file
    (the same bytes) registered it earlier in the process. Raises if other code holds it. Which file
    registered an op is kept beside the ops, on torch.ops.<namespace>."""
    ops = getattr(torch.ops, ns)
    owners = vars(ops).setdefault("_rtk_sources", {})
    if not hasattr(ops, name):
        owners[name] = source
        return True
    if source is not None and owners.get(name) == source:
        return False
    module = ns[len("rtk_") :]
    raise RuntimeError(
        f"torch.library op {ns}::{name} is registered already, by other code than {file} (another file "
        f"imported as module {module!r}, or this file before an edit). The op namespace comes from the "
        f"module's name: rename this file (e.g. my_{module.rsplit('_', 1)[-1]}.py) so that its ops get a "
        "namespace of their own, or restart Python to load the edited file"
    )


def _register(wrapper: _Accelerated, ns: str, name: str, source, file, twin_op: bool = True) -> None:
    """Register the launcher as custom op ns::name (its fake: the launcher run with no launch, on fake
    tensors) and, where torch has it and twin_op, as triton op ns::name_triton; set wrapper.compile_op."""
    launcher = wrapper.launcher
    hints = typing.get_type_hints(launcher)
    returns = torch.Tensor if hints.get("return") is torch.Tensor else list[torch.Tensor]
    params = [p.replace(annotation=hints[p.name]) for p in inspect.signature(launcher).parameters.values()]
    signature = inspect.Signature(params, return_annotation=returns)

    def impl(*args, **kwargs):
        with torch.no_grad():
            return _pack(wrapper(*args, **kwargs), _first_tensor(args))

    def fake(*args, **kwargs):
        with _mode("fake"):
            return _pack(launcher(*args, **kwargs), _first_tensor(args))

    def twin(*args, **kwargs):
        if _symbolic(args) or _symbolic(kwargs.values()):
            return getattr(getattr(torch.ops, ns), name)(*args, **kwargs)
        with _mode("trace"):
            return _pack(launcher(*args, **kwargs), _first_tensor(args))

    for f, suffix in ((impl, ""), (fake, "_fake"), (twin, "_triton")):
        f.__signature__, f.__name__ = signature, f"{name}{suffix}"
    if _claim(ns, name, source, file):
        torch.library.custom_op(f"{ns}::{name}", mutates_args=())(impl).register_fake(fake)
    twin_op = twin_op and TRITON_OP
    if twin_op and _claim(ns, name + "_triton", source, file):
        torch.library.triton_op(f"{ns}::{name}_triton", mutates_args=())(twin)
    wrapper.numbers = tuple((i, p.name, p.annotation) for i, p in enumerate(params) if p.annotation in (int, float))
    wrapper.compile_op = getattr(getattr(torch.ops, ns), name + "_triton" if twin_op else name)


# --------------------------------------------------------------------------------------------
# accelerate
# --------------------------------------------------------------------------------------------
def _launched_kernels(namespace: dict, launchers) -> set:
    """Names of the module's @triton.jit kernels that its launchers (and the Python functions of the module
    they call, and the functions nested in those) name."""
    kernel_type = triton.runtime.jit.KernelInterface
    seen, names = set(), set()
    todo = [f.__code__ for f in launchers]
    while todo:
        code = todo.pop()
        if code in seen:
            continue
        seen.add(code)
        todo += [c for c in code.co_consts if inspect.iscode(c)]
        for n in code.co_names:
            v = namespace.get(n)
            if isinstance(v, kernel_type):
                names.add(n)
            elif inspect.isfunction(v) and v.__module__ == namespace["__name__"]:
                todo.append(v.__code__)
    return names


def _source_digest(file):
    if not file or not os.path.isfile(file):
        return None
    with open(file, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def accelerate(namespace: dict, custom_only: tuple = (), **ops: str) -> None:
    """Give the launchers of a kernel module plans, torch.library ops and device checks.

    namespace: the module's globals(); ops: op name -> name of the launcher in the module
    (``rms_norm_fused="_launch"``); custom_only: ops registered without a triton_op twin (a launcher that
    may hand a call to a torch operator instead of its kernel, decided per call). Each launcher is replaced in the module by its accelerated wrapper (the
    public functions call it by name), and the kernels it launches by stand-ins that route their launches
    (see _Kernel). The module's op namespace is set as ``_NS``.
    """
    name = namespace["__name__"]
    ns = "rtk_" + "".join(c if c.isalnum() else "_" for c in name)
    file = namespace.get("__file__")
    source = _source_digest(file)
    namespace["_NS"] = ns
    # how @triton.jit decorated the module's kernels: for the interpreter or compiled, as TRITON_INTERPRET
    # said at import (the decoration cannot change afterwards)
    namespace["_rtk_interpreted"] = _interpreting()
    launchers = [namespace[launcher] for launcher in ops.values()]
    for kernel in _launched_kernels(namespace, launchers):
        namespace[kernel] = _Kernel(namespace[kernel])
    for op, launcher in ops.items():
        wrapper = _Accelerated(namespace[launcher], ns, op, namespace)
        _register(wrapper, ns, op, source, file, op not in custom_only)
        namespace[launcher] = wrapper
        _WRAPPERS.append(wrapper)


def plans(module=None) -> dict:
    """The plans kept by every accelerated launcher (of one module, given its name or the module), by key."""
    name = getattr(module, "__name__", module)
    out = {}
    for w in _WRAPPERS:
        if name is None or w.owner["__name__"] == name:
            out.update({(w.__name__,) + k: p for k, p in w.plans.items()})
    return out


def clear_plans(module=None) -> None:
    """Forget the plans of every accelerated launcher (of one module), so the next call of each signature
    records the plain launcher again (a setting that a launcher reads then applies)."""
    name = getattr(module, "__name__", module)
    for w in _WRAPPERS:
        if name is None or w.owner["__name__"] == name:
            w.plans.clear()
            w.unplanned.clear()


@contextlib.contextmanager
def own_plans(module, store: dict):
    """Within the block the module's launchers keep their plans in store instead of their own: for calls made
    under a changed module setting (a benchmark's variant), which the plan keys (call signatures) do not see."""
    name = getattr(module, "__name__", module)
    saved = [(w, w.plans, w.unplanned) for w in _WRAPPERS if w.owner["__name__"] == name]
    for w, _, _ in saved:
        w.plans, w.unplanned = store.setdefault(id(w), ({}, {}))
    try:
        yield
    finally:
        for w, plans_, unplanned in saved:
            w.plans, w.unplanned = plans_, unplanned


def use_triton_op(module, on: bool = True) -> None:
    """Which op torch.compile records for the module's launchers from now on: the triton_op twin (on, where
    it is registered) or the custom op. Compiled code guards on the choice: set it before compiling."""
    name = getattr(module, "__name__", module)
    for w in _WRAPPERS:
        if w.owner["__name__"] == name:
            twin = on and hasattr(getattr(torch.ops, w.namespace), w.op_name + "_triton")
            w.compile_op = getattr(getattr(torch.ops, w.namespace), w.op_name + ("_triton" if twin else ""))


def _main(argv=None) -> int:
    """python kernel_runtime.py: import the bundle's kernel files and list the ops each registered."""
    import argparse
    import importlib
    import json

    p = argparse.ArgumentParser(
        description="The launch runtime of the bundle's kernel files (cached launch plans, torch.library ops, "
        "device checks). Run alone, it imports the kernel files and prints the torch.library ops each registered."
    )
    p.add_argument("modules", nargs="*", default=list(KERNEL_FILES), help=f"kernel modules (default: {KERNEL_FILES})")
    args = p.parse_args(argv)
    for name in args.modules:
        importlib.import_module(name)
    ops = {}
    for w in _WRAPPERS:
        ops.setdefault(w.owner["__name__"], []).append(f"{w.namespace}::{w.op_name} (launcher {w.__name__})")
    print(json.dumps({"triton_op_twins": TRITON_OP, "ops": ops}, indent=1))
    return 0


KERNEL_FILES = ("rmsnorm", "layernorm", "rope", "qk_norm_rope", "activations", "head_norm_rope", "skinny_gemm")


# --- from skinny_gemm.py / head_norm_rope.py ---
# skinny_gemm.py hands the calls with more rows than its kernel is measured to win at to torch's GEMM (its op is
# a custom op only for that: accelerate's custom_only). The largest M that uses the kernel, per (backend, arch,
# "16-bit" or "fp8" weights), measured at M = 1..32 (benchmark_kernels.py --suite decode); above it F.linear, or
# torch._scaled_mm for FP8 x and W. Missing (AMD: not measured): the kernel for every M. H200
# (examples/benchmark_skinny_gemm_h200.json): bf16 0.86-1.18x cuBLAS at M = 1, behind from M = 8;
# torch._scaled_mm ahead on 6 of 8 shapes at M = 1, on all from M = 8. FP8 W with 16-bit x (no torch
# equivalent) and calls that force split_k always run the kernel (skinny_gemm._torch_max_m).
SKINNY_GEMM_KERNEL_MAX_M = {("cuda", 90, "16-bit"): 1, ("cuda", 90, "fp8"): 0}
_SKINNY_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n))


def skinny_gemm_torch_dispatch(namespace: dict) -> None:
    """Give skinny_gemm.py (its globals()) the measured bounds (``_KERNEL_MAX_M``, filled in place: callers that
    change the module's table keep doing so) and torch's GEMM for the calls above them (``_torch_linear``)."""
    namespace["_KERNEL_MAX_M"].update(SKINNY_GEMM_KERNEL_MAX_M)
    namespace["_torch_linear"] = _skinny_torch_linear


def _skinny_torch_linear(x2, weight, bias, weight_scale, x_scale, out_dtype):
    """_skinny_torch_gemm, noted by a recording of the launcher (a _TorchRoute replays it)."""
    rec = _TLS.mode
    if not isinstance(rec, _Recorder):
        return _skinny_torch_gemm(x2, weight, bias, weight_scale, x_scale, out_dtype)
    start = len(rec.computes)
    y = _skinny_torch_gemm(x2, weight, bias, weight_scale, x_scale, out_dtype)
    rec.routes.append((start, len(rec.computes), (x2, weight, bias, weight_scale, x_scale, out_dtype), y))
    return y


def _skinny_torch_gemm(x2, weight, bias, weight_scale, x_scale, out_dtype):
    """torch's GEMM for y = x2 @ W^T (scaled, + bias): F.linear (16-bit), torch._scaled_mm (FP8), else None."""
    if weight.dtype not in _SKINNY_FP8:
        if bias is not None and bias.dtype != x2.dtype:  # F.linear takes one dtype: add this bias in fp32
            return (torch.nn.functional.linear(x2, weight).float() + bias.float()).to(out_dtype)
        return torch.nn.functional.linear(x2, weight, bias).to(out_dtype)
    if x2.dtype not in _SKINNY_FP8 or not hasattr(torch, "_scaled_mm"):
        return None
    m, n = x2.shape[0], weight.shape[0]
    if weight_scale.numel() == 1:
        sa, sb = x_scale.reshape(()), weight_scale.reshape(())
    else:  # row-wise: one scale per row of x, one per column of W^T
        sa, sb = x_scale.reshape(1, 1).expand(m, 1).contiguous(), weight_scale.reshape(1, n)
    fused = bias if (bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32) else None
    try:
        y = torch._scaled_mm(x2, weight.t(), scale_a=sa, scale_b=sb, bias=fused, out_dtype=out_dtype)
    except (RuntimeError, NotImplementedError):
        return None  # a layout, shape or scaling this torch build's FP8 GEMM rejects: use the kernel
    return y if bias is None or fused is not None else (y.float() + bias.float()).to(out_dtype)


if __name__ == "__main__":
    import sys

    sys.modules.setdefault("kernel_runtime", sys.modules["__main__"])  # the kernel files import this module
    raise SystemExit(_main())

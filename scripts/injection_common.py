# SPDX-License-Identifier: Apache-2.0
"""Machinery shared by the integration scripts (diffusers_injection.py, mmdit_injection.py,
wan_injection.py, transformers_injection.py): when a kernel may replace torch for some tensors,
reversible per-instance forward patching, the counts and messages of an injection (and the header of
the examples' JSON summaries, and the default dtype and fp32 modules of the random-weight models). The
kernel files themselves do not use it (each stays copyable alone); an integration copied elsewhere needs
this file beside it.

Each integration passes its own state key, so two injectors never undo each other's patches.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import functools
import logging
import os
import shlex
import sys
import types
import warnings
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HALF = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# When may a kernel run?
# --------------------------------------------------------------------------------------------
def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_ok(t: torch.Tensor) -> bool:
    # "cuda" is also ROCm's device type. CPU tensors only through Triton's interpreter.
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())


def usable(*tensors) -> bool:
    """True if the kernels may replace torch for these tensors (None entries are ignored).

    The kernels are inference-only (no backward): under autograd with any input that requires a
    gradient the original code runs. All tensors must share one device the kernels can run on (a
    weight still on the meta device, as accelerate's sequential offload leaves it, fails this) and
    have a kernel dtype (fp16, bf16, fp32).
    """
    ts = [t for t in tensors if t is not None]
    if not ts or not device_ok(ts[0]):
        return False
    dev = ts[0].device
    grad = torch.is_grad_enabled()
    for t in ts:
        if t.device != dev or t.dtype not in KERNEL_DTYPES or (grad and t.requires_grad):
            return False
    return True


def memory_order(x: torch.Tensor):
    """(view, back): x with its leading dims permuted into memory order (largest stride first, the last dim kept
    last), and the permutation that puts a result of the view's shape back into x's order; None when that view
    is not contiguous (x is no permutation of a contiguous tensor)."""
    perm = (*sorted(range(x.dim() - 1), key=lambda i: -x.stride(i)), x.dim() - 1)
    view = x.permute(perm)
    if not view.is_contiguous():
        return None
    back = [0] * len(perm)
    for i, p in enumerate(perm):
        back[p] = i
    return view, back


def roots(pipe_or_model) -> list:
    """The nn.Modules to search: the model itself, or a diffusers pipeline's module components."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return [pipe_or_model]
    components = getattr(pipe_or_model, "components", None)
    if isinstance(components, dict):
        return [m for m in components.values() if isinstance(m, torch.nn.Module)]
    raise TypeError(f"expected a diffusers pipeline or a torch.nn.Module, got {type(pipe_or_model).__name__}")


def modules_once(models):
    """Every module of the given models (recursively), each once, even where models share one."""
    seen = set()
    for model in models:
        for m in model.modules():
            if id(m) not in seen:
                seen.add(id(m))
                yield m


def unique_modules(pipe_or_model):
    """Every module inside pipe_or_model (its roots, recursively), each once."""
    yield from modules_once(roots(pipe_or_model))


def class_forward(m, cls) -> bool:
    """m is a cls that computes what cls.forward computes: its class does not override forward."""
    return isinstance(m, cls) and type(m).forward is cls.forward


def needs_autograd(module: torch.nn.Module, *inputs) -> bool:
    """Whether autograd must see module's computation: grad mode is on and one of its parameters or of
    the inputs (tensors, or tuples of tensors) requires a gradient. A patched block that feeds the
    outputs of its submodules (attention, feed-forward) to the kernels must fall back then, even when
    its own first inputs need no gradient: a trainable weight inside (LoRA, partial fine-tuning) makes
    those outputs require one. Walks the parameters only in grad mode."""
    if not torch.is_grad_enabled():
        return False
    for t in inputs:
        for u in t if isinstance(t, (tuple, list)) else (t,):
            if isinstance(u, torch.Tensor) and u.requires_grad:
                return True
    return any(p.requires_grad for p in module.parameters())


# --------------------------------------------------------------------------------------------
# Calling submodules with less host time
# --------------------------------------------------------------------------------------------
# module(x) runs Module._call_impl, which looks for hooks before calling forward: a few microseconds
# per call, paid by every Linear, Dropout and attention module of every block. Where a module has no
# hook of any kind (its own or global) and torch.jit is not tracing, _call_impl calls forward(x) and
# nothing else, so the patched forwards call forward directly then. A Linear's forward is
# F.linear(x, weight, bias) and an nn.Dropout's in eval mode (or with p = 0) returns its input, so
# those two exact types are computed inline; subclasses, LoRA layers, hooked or offloaded modules
# (accelerate and diffusers put their hooks into the instance's forward, so they are hooked too, as
# far as this is concerned) go through module(x) as before, and so does every Linear or Dropout while
# its class's forward is not PyTorch's own (patched on the class by a profiler or a library).
_MM = torch.nn.modules.module


def _torch_own(fn, qualname: str):
    """fn if it is PyTorch's own method qualname (not a replacement already put on the class), else None."""
    own = getattr(fn, "__qualname__", None) == qualname and getattr(fn, "__module__", "").startswith("torch.nn.")
    return fn if own else None


_LINEAR_FORWARD = _torch_own(torch.nn.Linear.forward, "Linear.forward")
_DROPOUT_FORWARD = _torch_own(torch.nn.Dropout.forward, "Dropout.forward")


def hook_free(module: torch.nn.Module) -> bool:
    """Whether module(...) would run module.forward(...) and nothing else (no torch hook, no
    Module.compile() of it, no torch.jit tracing)."""
    return not (
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or _MM._global_forward_hooks
        or _MM._global_forward_pre_hooks
        or _MM._global_backward_hooks
        or _MM._global_backward_pre_hooks
        or getattr(module, "_compiled_call_impl", None) is not None
        or torch._C._get_tracing_state()
    )


# Every integration's state key (register_state_key): the key under which it records, per module, what it
# patched and how to undo it. A bundle patch computes what the class's forward computes (it falls back to the
# original for anything else), so code that reads a module's parameters instead of calling it may do so for
# a module carrying any of these records (unwrapped), and fallbacks find the original under any of them.
STATE_KEYS: list = []


def register_state_key(key: str) -> str:
    """Register an integration's state key (once per key); returns it."""
    if key not in STATE_KEYS:
        STATE_KEYS.append(key)
    return key


def bundle_state(module: torch.nn.Module) -> Optional[dict]:
    """The record an integration keeps on module (under any registered state key), or None."""
    d = module.__dict__
    for key in STATE_KEYS:
        state = d.get(key)
        if state is not None:
            return state
    return None


def original(module: torch.nn.Module):
    """The forward module had before an integration patched it, under whichever registered key it did."""
    state = bundle_state(module)
    if state is None or "original" not in state:
        raise KeyError(f"{type(module).__name__} carries no patched forward of the bundle")
    return state["original"]


# Under torch.compile, Inductor fuses some models' norms, modulations and residuals about as well as the kernels,
# and the kernels' custom ops then cut its fusions with the GEMMs around them: compiled with the kernels, LTX-2 and
# FLUX.2 ran 0.98x and 0.994x as fast as compiled without (H100 records, references/results-h100.md). A family
# marks such a model (mark_stock_under_compile, after injecting): while torch.compile traces a forward or processor
# the bundle patched in it, that forward calls the code it replaced, so Inductor compiles the stock model. Eager
# calls and graph mode keep the kernels. Eager cost: one torch.compiler.is_compiling() call per patched forward.
STOCK_UNDER_COMPILE = "stock_under_compile"  # an entry of a module's record (patch_forward's extra)


def mark_stock_under_compile(models) -> int:
    """Mark every module of models that carries a record of the bundle (its own forward patched, or its attention
    processor swapped): under torch.compile its patched code runs the code it replaced (see above). Removing the
    kernels drops the mark with the record. Returns how many modules are marked."""
    n = 0
    for m in modules_once(models):
        state = bundle_state(m)
        if state is not None:
            state[STOCK_UNDER_COMPILE] = True
            n += 1
    return n


def stock_under_compile(module: torch.nn.Module) -> bool:
    """True while torch.compile traces a patched forward (or processor) of a module marked by
    mark_stock_under_compile: the caller then runs the code it replaced (original(module), or the processor the
    record kept as "prev"). False in eager calls, at the cost of one is_compiling() call."""
    if not torch.compiler.is_compiling():
        return False
    state = bundle_state(module)
    return state is not None and state.get(STOCK_UNDER_COMPILE, False)


def stock_processor(attn, proc):
    """Under torch.compile in a marked model (stock_under_compile(attn)): the processor that proc, the processor in
    place on attn, replaced (the record's "prev"), to run instead of proc, given proc's backend and parallel settings
    first (set_attention_backend or enable_parallelism after injection set them on proc only; removal gives prev
    them too); else None (proc runs: eager calls, unmarked models)."""
    if not stock_under_compile(attn):
        return None
    prev = bundle_state(attn).get("prev")
    if prev is not None and any(getattr(prev, k, None) is not getattr(proc, k, None) for k in PROCESSOR_SETTINGS):
        carry_processor_settings(proc, prev)
    return prev


def diffusers_hooked(module: torch.nn.Module) -> bool:
    """Whether module carries a diffusers HookRegistry (_diffusers_hook) holding a hook. An empty registry wraps
    nothing: diffusers' pipelines create one on the transformer at their first call (cache_context), with no hook
    in it unless a cache or parallelism is enabled. A registry of another shape counts as hooked."""
    registry = module.__dict__.get("_diffusers_hook")
    if registry is None:
        return False
    hooks = getattr(registry, "hooks", None)
    return not isinstance(hooks, dict) or bool(hooks)


def unwrapped(module: torch.nn.Module, state_key: Optional[str] = None) -> bool:
    """Whether calling module runs its class's forward, or the forward an integration patched in (under
    state_key or any registered key), and nothing else: hook_free, and no accelerate (_hf_hook) or diffusers
    (_diffusers_hook) hook, which put their own wrapper into the instance's forward (offloading, caching,
    context parallelism). A fused path that does not call a module, or reads its parameters before the
    module would run, may do so only for such a module."""
    d = module.__dict__
    if not hook_free(module) or "_hf_hook" in d or diffusers_hooked(module):
        return False
    fwd = d.get("forward")
    if fwd is None:
        return True
    state = d.get(state_key) if state_key else None
    if state is None:
        state = bundle_state(module)
    if state is None or "patched" not in state:
        return False
    # the integration's own patch: the same function (compared through patched_function, which
    # torch.compile traces; it cannot trace an identity test of two partials) bound to this module
    fn = patched_function(fwd)
    return fn is not None and fn is patched_function(state["patched"]) and fwd.args[0] is module


def call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x), with the hook look-up skipped where there is none (see above)."""
    if not hook_free(module):
        return module(x)
    t = type(module)
    if "forward" not in module.__dict__:
        if t is torch.nn.Linear and t.forward is _LINEAR_FORWARD:
            # the registered parameters, read without Module.__getattr__ (a weight deleted and set again
            # as a plain attribute is no longer among them: the module's own forward runs then)
            p = module._parameters
            w = p.get("weight")
            if w is not None and "bias" in p:
                return F.linear(x, w, p["bias"])
        elif t is torch.nn.Dropout and t.forward is _DROPOUT_FORWARD and (not module.training or module.p == 0):
            return x
    return module.forward(x)


def feed_forward(ff: torch.nn.Module, x: torch.Tensor, ff_class) -> torch.Tensor:
    """ff(x) for diffusers' FeedForward (ff_class), whose forward applies the modules of ff.net in
    turn: done here through call() where ff is exactly that class, unhooked, with its own forward."""
    if type(ff) is ff_class and "forward" not in ff.__dict__ and hook_free(ff):
        for m in ff.net:
            x = call(m, x)
        return x
    return ff(x)


# --------------------------------------------------------------------------------------------
# Linear + GELU(tanh) as one BLAS call
# --------------------------------------------------------------------------------------------
# cuBLASLt and hipBLASLt can apply GELU to a GEMM's fp32 accumulator before the store, which
# saves the activation kernel's read and write of the [tokens, 4 * dim] tensor;
# torch._addmm_activation(bias, x, w.t(), use_gelu=True) reaches that epilogue where PyTorch's
# own conditions allow (else it runs addmm, then gelu). Which GELU the library computes is not
# part of that private API's contract: the CPU build of torch 2.13 computes the exact (erf) form.
# So the form is checked once per device and dtype (probe_gemm_gelu_tanh), and the path is used
# only where the check passed. Where PyTorch would not take its Lt path (gemm_gelu_lt_expected),
# the call would be a GEMM followed by PyTorch's own GELU, so the bundle's GELU kernel is kept
# there. RTK_GEMM_GELU=0 turns the path off.
_GEMM_GELU_TANH: dict = {}


def gemm_gelu_enabled() -> bool:
    return os.environ.get("RTK_GEMM_GELU", "1") not in ("", "0")


# Architectures PyTorch routes addmm's bias/GELU epilogue to hipBLASLt on, by minimum ROCm version, as
# read in aten/src/ATen/native/cuda/Blas.cpp (isSupportedHipLtROCmArch); other PyTorch releases may
# list others. Elsewhere PyTorch runs the GEMM, then gelu_(..., "tanh"). On ROCm as on CUDA the
# variable that turns the Lt path off is DISABLE_ADDMM_CUDA_LT=1; Blas.cpp reads no
# DISABLE_ADDMM_HIP_LT (getDisableAddmmCudaLt at pytorch/pytorch 960a68465f61,
# isGloballyDisabledAddmmCudaLt at ROCm/pytorch 03c1b4882649 and cyyever/pytorch 0cecc5c1817a).
_HIPBLASLT_ARCHS = (
    ((0, 0), ("gfx90a", "gfx942")),
    ((6, 3), ("gfx908", "gfx1100", "gfx1101", "gfx1200", "gfx1201")),
    ((7, 0), ("gfx950", "gfx1150", "gfx1151")),
)


def gemm_gelu_lt_expected(device) -> bool:
    """Whether PyTorch would run _addmm_activation on this GPU through cuBLASLt / hipBLASLt, so that
    the GELU happens in the GEMM's epilogue: not when DISABLE_ADDMM_CUDA_LT=1 (PyTorch reads that
    name on CUDA and on ROCm; it reads no DISABLE_ADDMM_HIP_LT), and on ROCm only on the
    architectures listed above."""
    if os.environ.get("DISABLE_ADDMM_CUDA_LT") == "1":
        return False
    if torch.version.hip is None:
        return True
    try:
        hip = tuple(int(v) for v in torch.version.hip.split(".")[:2])
        arch = torch.cuda.get_device_properties(torch.device(device)).gcnArchName.split(":")[0]
    except Exception:
        return False
    return any(hip >= need and arch in archs for need, archs in _HIPBLASLT_ARCHS)


def _gemm_gelu_outputs(device, dtype):
    """(y, z): torch._addmm_activation(..., use_gelu=True) on device in dtype for known
    pre-activations z (an exact GEMM: identity times a diagonal, plus a bias), y as float64 on the CPU."""
    k = torch.arange(-72, 33, dtype=torch.float64) / 16  # -4.5 ... 2.0, exact in fp16 / bf16
    n = k.numel()
    bias = torch.full((n,), 0.25, dtype=torch.float64)
    w = torch.diag(k - 0.25)  # z_ii = k_i; off-diagonal z = 0.25
    eye = torch.eye(n, dtype=torch.float64)
    y = torch._addmm_activation(bias.to(device, dtype), eye.to(device, dtype), w.to(device, dtype).t(), use_gelu=True)
    return y.double().cpu(), eye * (k - 0.25) + 0.25


def gelu_forms_matched(y: torch.Tensor, z: torch.Tensor, dtype) -> tuple:
    """(matches tanh form, matches erf form) for y computed in dtype from pre-activations z.

    "Matches": every element within one rounding of the output (eps * |ref|) plus an absolute
    eps / 16 (fp32 cancellation in 1 + tanh for very negative z). At fp16's precision the two forms
    are told apart (they differ by up to 4.7e-4 for z in [-3, -2]); at bf16's both may match.
    """
    eps = torch.finfo(dtype).eps
    out = []
    for ref in (F.gelu(z, approximate="tanh"), F.gelu(z)):
        out.append(bool(((y - ref).abs() <= eps * ref.abs() + eps / 16).all()))
    return tuple(out)


def probe_gemm_gelu_tanh(device, dtype) -> bool:
    """True if torch._addmm_activation(..., use_gelu=True) computes GELU's tanh form on this device:
    in fp16 it must match the tanh form and not the erf form, and in dtype the tanh form."""
    if not hasattr(torch, "_addmm_activation"):
        return False
    try:
        if gelu_forms_matched(*_gemm_gelu_outputs(device, torch.float16), torch.float16) != (True, False):
            return False
        return gelu_forms_matched(*_gemm_gelu_outputs(device, dtype), dtype)[0]
    except Exception:  # a dtype the device's addmm lacks, or a changed private signature: no fused path
        return False


def gemm_gelu_tanh_ok(device, dtype) -> bool:
    """Cached probe_gemm_gelu_tanh for a GPU device (False on the CPU, under the interpreter, and
    while torch.compile traces a forward before any probe ran: tracing does not run the probe)."""
    device = torch.device(device)
    if device.type != "cuda" or interpreting() or not gemm_gelu_enabled():
        return False
    key = (str(device), dtype)
    ok = _GEMM_GELU_TANH.get(key)
    if ok is None:
        # no probe while tracing, nor during CUDA-graph capture (its host copies are not allowed there)
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return False
        ok = gemm_gelu_lt_expected(device) and probe_gemm_gelu_tanh(device, dtype)
        _GEMM_GELU_TANH[key] = ok
    return ok


def linear_gelu_tanh(x: torch.Tensor, proj: torch.nn.Module) -> Optional[torch.Tensor]:
    """GELU-tanh(proj(x)) as one BLAS call with the activation in the epilogue, or None where that
    path does not apply (then the caller runs proj and the activation kernel).

    Applies to a plain nn.Linear with a bias (no hooks, forward not replaced, no global module hooks),
    plain-tensor weights (not a quantized or distributed tensor subclass) on x's GPU, fp16/bf16
    throughout, no autograd, and only where gemm_gelu_tanh_ok verified the form.
    """
    if type(proj) is not torch.nn.Linear or proj.bias is None:
        return None
    if proj._forward_hooks or proj._forward_pre_hooks or "forward" in proj.__dict__:
        return None
    mm = torch.nn.modules.module
    if getattr(mm, "_global_forward_hooks", None) or getattr(mm, "_global_forward_pre_hooks", None):
        return None
    w, b = proj.weight, proj.bias
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (x, w, b)):
        return None
    if x.dtype not in HALF or w.dtype != x.dtype or b.dtype != x.dtype:
        return None
    if w.device != x.device or b.device != x.device or x.shape[-1] != w.shape[1]:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or b.requires_grad):
        return None
    if not gemm_gelu_tanh_ok(x.device, x.dtype):
        return None
    y = torch._addmm_activation(b, x.reshape(-1, x.shape[-1]), w.t(), use_gelu=True)
    return y.view(*x.shape[:-1], w.shape[0])


def probe_gelu_modules(modules) -> str:
    """Run the GEMM-GELU probe at injection time for the devices/dtypes of these diffusers GELU
    modules' projections, so a later torch.compile trace finds the result cached. Returns a note for
    the injection message ("" when no projection is on a GPU in fp16/bf16)."""
    results = {}
    for m in modules:  # several models: the caller joins the notes
        w = getattr(getattr(m, "proj", None), "weight", None)
        if isinstance(w, torch.Tensor) and w.device.type == "cuda" and w.dtype in HALF:
            key = (str(w.device), str(w.dtype).replace("torch.", ""))
            if key not in results:
                results[key] = gemm_gelu_tanh_ok(w.device, w.dtype)
    if not results:
        return ""
    on = [f"{d} {t}" for (d, t), ok in results.items() if ok]
    off = [f"{d} {t}" for (d, t), ok in results.items() if not ok]
    parts = []
    if on:
        parts.append("feed-forward GELU in the GEMM epilogue on " + ", ".join(on))
    if off:
        parts.append("GELU kernel after the GEMM on " + ", ".join(off) + " (epilogue not verified or turned off)")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# torch.nn.RMSNorm numerics
# --------------------------------------------------------------------------------------------
def probe_torch_rmsnorm() -> bool:
    """True if the installed torch's F.rms_norm rounds to the input dtype before the weight multiply.

    torch 2.11 (CUDA) and 2.13 (CPU) multiply the weight in fp32 and round once; other releases
    have rounded first. Probed on the GPU when there is one: that is where the model will run, and
    torch's CPU and GPU implementations have not always rounded alike.
    """
    return rms_norm_rounds_before_weight("cuda" if torch.cuda.is_available() else "cpu")


def rms_norm_rounds_before_weight(device) -> bool:
    """probe_torch_rmsnorm's answer for F.rms_norm on the given device (bf16 rows of 64)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g).to(device, torch.bfloat16)
    w = (1 + torch.randn(64, generator=g)).to(device, torch.bfloat16)
    got = F.rms_norm(x, (64,), w, 1e-6).float()
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    after = (normed.to(torch.bfloat16) * w).float()
    once = (normed * w.float()).to(torch.bfloat16).float()
    return bool((got - after).abs().max() < (got - once).abs().max())


def torch_rmsnorm_eps(module: torch.nn.RMSNorm) -> float:
    # eps=None means the machine epsilon of the computation dtype, fp32 for fp32/fp16/bf16 inputs.
    return float(module.eps) if module.eps is not None else float(torch.finfo(torch.float32).eps)


# --------------------------------------------------------------------------------------------
# Patching instance forwards, reversibly
# --------------------------------------------------------------------------------------------
class BoundForward(functools.partial):
    """fn bound to a module, as the module's patched (or recorded original) forward: calling it calls
    fn(module, ...), like types.MethodType(fn, module), at the same C-level cost (a partial).

    Unlike a bound method it survives torch.save / pickle and copy.deepcopy of the model: a bound method
    pickles as getattr(module, fn.__name__), which fails on load for a function that is no attribute of
    the module's class; this pickles as fn (by its qualified name, so a module-level function: loading
    needs its file importable under the same name) and the module, and a deep copy is bound to the
    copied module. __func__ and __self__ read like a bound method's. Under torch.compile it is a
    functools.partial (see patched_function)."""

    __slots__ = ()

    @property
    def __func__(self):
        return self.func

    @property
    def __self__(self):
        return self.args[0]

    def __reduce__(self):
        fn = self.func
        name = getattr(fn, "__qualname__", None)
        found = sys.modules.get(getattr(fn, "__module__", None) or "")
        for part in (name or "<>").split("."):
            found = getattr(found, part, None)
        if found is not fn:
            raise TypeError(
                f"a patched forward of {type(self.__self__).__name__} calls {fn!r}, which pickle cannot "
                "find by name; remove the kernels (remove_optimized_kernels / remove_llama_kernels) "
                "before saving the model"
            )
        return type(self), (fn, self.__self__)

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        module = copy.deepcopy(self.__self__, memo)
        done = memo.get(id(self))  # copied meanwhile, as part of the module's own state
        return done if done is not None else type(self)(self.func, module)

    def __repr__(self):
        fn, module = self.func, self.__self__
        return f"<BoundForward {getattr(fn, '__qualname__', fn)} of {type(module).__name__} at {id(module):#x}>"


def patched_function(fwd):
    """The function a BoundForward calls (fn of patch_forward), else None. Written so that torch.compile
    traces it to eager's answer: dynamo sees a BoundForward as the functools.partial it is (an
    isinstance check on BoundForward traces to False), and reads a partial's func."""
    return fwd.func if isinstance(fwd, functools.partial) else None


def _diffusers_hook_slot(module: torch.nn.Module):
    """(function reference, attribute) holding the forward that diffusers' hooks wrap (the innermost
    one of the module's HookRegistry), or None if the module has no diffusers hook. diffusers'
    hooks (context-parallel splits and gathers, offloading, caching) replace module.forward with a
    wrapper that calls this reference at each call."""
    refs = getattr(module.__dict__.get("_diffusers_hook"), "_fn_refs", None)
    if not refs:
        return None
    ref = refs[0]
    return (ref, "original_forward") if getattr(ref, "original_forward", None) is not None else (ref, "forward")


def patch_forward(module: torch.nn.Module, fn, kind: str, state_key: str, **extra) -> bool:
    """Make fn(module, ...) the module's forward (a BoundForward: fn must be a module-level function
    for the model to pickle). False if the module is already patched (under this state key).

    If accelerate already hooked the module (its hook calls module._old_forward), the hooked
    function is replaced instead, so the hook keeps running around the kernel; the same for
    diffusers' hooks (enable_parallelism's context-parallel splits, for one), whose innermost
    function reference is replaced. The record kept under state_key holds the kind, the replaced
    function and any `extra` entries.
    """
    if state_key in module.__dict__:
        return False
    patched = BoundForward(fn, module)
    hook_slot = None
    if "_old_forward" in module.__dict__ and hasattr(module, "_hf_hook"):
        slot = "_old_forward"
        prev = module.__dict__.get(slot)
    elif _diffusers_hook_slot(module) is not None:
        slot = "diffusers_hook"
        hook_slot = _diffusers_hook_slot(module)
        prev = getattr(*hook_slot)
    else:
        slot = "forward"
        prev = module.__dict__.get(slot)
    original = prev if prev is not None else BoundForward(type(module).forward, module)
    module.__dict__[state_key] = {
        "kind": kind,
        "slot": slot,
        "prev": prev,
        "patched": patched,
        "original": original,
        **extra,
    }
    if hook_slot is not None:
        setattr(*hook_slot, patched)
    else:
        module.__dict__[slot] = patched
    return True


def original_forward(module: torch.nn.Module, state_key: str):
    """The forward the module had before patching (used for inputs the kernels do not cover)."""
    return module.__dict__[state_key]["original"]


def _is_class_forward(fn, module) -> bool:
    return getattr(fn, "__self__", None) is module and getattr(fn, "__func__", None) is type(module).forward


def restore_forward(module: torch.nn.Module, state: dict) -> None:
    """Put back the forward that patch_forward replaced (state: the record it kept, already removed
    from the module), wherever the patched function now is: a hook added after injection may have
    moved it to _old_forward (accelerate does) or into its function reference (diffusers' hooks do),
    and removing a diffusers hook moves it back to forward."""
    patched, prev = state["patched"], state["prev"]
    replacement = prev if prev is not None else types.MethodType(type(module).forward, module)
    for slot in ("forward", "_old_forward"):
        if module.__dict__.get(slot) is patched:
            if slot == "forward" and (prev is None or _is_class_forward(prev, module)):
                del module.__dict__["forward"]
            else:
                module.__dict__[slot] = replacement
            return
    for ref in getattr(module.__dict__.get("_diffusers_hook"), "_fn_refs", None) or ():
        for attr in ("forward", "original_forward"):
            if getattr(ref, attr, None) is patched:
                setattr(ref, attr, replacement)
                return


def pop_state(module: torch.nn.Module, state_key: str) -> Optional[dict]:
    return module.__dict__.pop(state_key, None)


def unpatch(module: torch.nn.Module, state_key: str, processor_kinds=(), processor_classes=()) -> Optional[dict]:
    """Undo what an integration patched on module under state_key; returns the record it kept (None if
    nothing was patched). A kind in processor_kinds swapped the attention processor (the record's "prev"
    is the one it replaced): that one is put back if the processor in place is still one of
    processor_classes (not if someone replaced it since), with the per-instance settings the processor
    in place gained meanwhile (enable_parallelism since, say). Any other kind: restore_forward."""
    state = pop_state(module, state_key)
    if state is None:
        return None
    if state["kind"] in processor_kinds:
        if type(module.processor) in processor_classes:
            carry_processor_settings(module.processor, state["prev"])
            module.set_processor(state["prev"])
    else:
        restore_forward(module, state)
    return state


# Attention-processor settings that diffusers stores on processor instances: the backend
# (set_attention_backend) and the parallel config (enable_parallelism). They must follow the
# processor that is in place, in both directions, or a model parallelised after injection would
# get back processors that attend over their local tokens only once the kernels are removed.
PROCESSOR_SETTINGS = ("_attention_backend", "_parallel_config")


# A block may compute the next block's first norm together with its own last residual and leave it in
# the next block's carry dict. The next block uses it only for the very tensors it was computed from, in
# the state they were in then: same objects, same version counters (an in-place change between the two
# blocks, by a hook or by code that runs the blocks itself, bumps the counter). Nothing is carried where
# no version counter can tell: inference tensors (torch.inference_mode) keep none, and torch.compile
# traces none; there an in-place change between two blocks would go unseen, so each block computes its
# own norm. A value is carried only when neither block has a hook of any kind (may_carry), which also
# keeps a hook of the next block from changing or bringing in the parameters the value was computed
# from. Nothing is carried while autograd records: gradient checkpointing recomputes a block alone, and
# the recomputation must take the path the first run took.
def _version(t):
    return None if torch.compiler.is_compiling() or t.is_inference() else t._version


# Which block follows which, for the carry: kept here, outside the blocks (weak on both sides), so that
# saving or copying one block does not take every later block with it, a copy starts unlinked (it computes
# its own norms until the kernels are injected into it), and a block dropped from the model is no longer
# fed by the one before it once the model is injected again.
_LINKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def link_next(block: torch.nn.Module, nxt: Optional[torch.nn.Module]) -> None:
    """Record nxt as the block after block (None: block has no linked successor)."""
    if nxt is None:
        _LINKS.pop(block, None)
    else:
        _LINKS[block] = weakref.ref(nxt)


def next_block(block: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The block linked after block, or None (always None while torch.compile traces: nothing is carried
    there, see above)."""
    if torch.compiler.is_compiling():
        return None
    ref = _LINKS.get(block)
    return None if ref is None else ref()


def may_carry(block: torch.nn.Module, nxt: torch.nn.Module, temb, state_key: str) -> bool:
    """Whether block may leave nxt a value computed from temb and a residual it is about to make (see
    above). Both blocks must be unwrapped (no hook of any kind): a hook of block could change its output
    after the value was computed, and one of nxt (an offloading hook, say) could change or bring in the
    parameters the value was computed from before nxt runs."""
    # (is_compiling first: torch.compile cannot trace torch.is_inference_mode_enabled)
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return False
    return unwrapped(block, state_key) and unwrapped(nxt, state_key)


def put_carry(nxt: torch.nn.Module, attr: str, key: str, h, temb, value) -> None:
    """Leave value, computed from h and temb, for nxt (checked by take_carry)."""
    getattr(nxt, attr)[key] = (h, _version(h), temb, _version(temb), value)


def take_carry(block: torch.nn.Module, attr: str, key: str, h, temb):
    """What the previous block left in block.<attr>[key] for this block: the value, if h and temb are
    the very tensors it was computed from and unchanged since (version counters), and autograd is not
    recording; else None. The entry is removed either way, so a stale one is never used twice."""
    carry = getattr(block, attr, None)
    if carry is None:
        return None
    pending = carry.pop(key, None)
    if pending is None or torch.is_grad_enabled():
        return None
    ph, vh, pt, vt, value = pending
    if ph is h and pt is temb and vh is not None and vt is not None and vh == _version(h) and vt == _version(temb):
        return value
    return None


def carry_processor_settings(src, dst) -> None:
    """Copy the per-instance attention settings of processor `src` onto processor `dst`."""
    for name in PROCESSOR_SETTINGS:
        if name in getattr(src, "__dict__", {}):
            setattr(dst, name, getattr(src, name))


# --------------------------------------------------------------------------------------------
# Counts per kind, the message of an injection, the header of an example's summary, random-weight models
# --------------------------------------------------------------------------------------------
def kind_counts(modules, state_key: str, kinds) -> dict:
    """Per kind (each of kinds, in that order, zeros included): how many of modules hold an integration's
    record under state_key."""
    counts = {k: 0 for k in kinds}
    for m in modules:
        state = m.__dict__.get(state_key)
        if state is not None:
            counts[state["kind"]] += 1
    return counts


def unpatch_all(modules, state_key: str, kinds, processor_kinds=(), processor_classes=(), *, carry=None) -> dict:
    """unpatch every module of modules (see unpatch); per kind (each of kinds, zeros included), how many were
    restored. carry: the attribute of the blocks' carry dicts (put_carry): each module is first unlinked from
    the block after it and its carry dict dropped."""
    restored = {k: 0 for k in kinds}
    for m in modules:
        if carry is not None:
            link_next(m, None)
            m.__dict__.pop(carry, None)
        state = unpatch(m, state_key, processor_kinds, processor_classes)
        if state is not None:
            restored[state["kind"]] += 1
    return restored


def counts_message(title: str, counts: dict, new=None, *, none_found: str = "", skipped=(), notes=()) -> str:
    """The line an injection (or removal) logs: "title: kind=count, ..."; then how many of those were
    already in place (where new, the counts this call added, is given); "(none_found: nothing replaced)"
    where none_found says what was not found; "; left untouched: " and the reasons in skipped (each once,
    sorted); and each distinct non-empty note of notes."""
    msg = f"{title}: " + ", ".join(f"{k}={v}" for k, v in counts.items())
    if new is not None:
        already = sum(counts.values()) - sum(new.values())
        if already:
            msg += f" ({already} were already in place)"
    if none_found:
        msg += f" ({none_found}: nothing replaced)"
    if skipped:
        msg += "; left untouched: " + ", ".join(sorted(set(skipped)))
    for note in dict.fromkeys(n for n in notes if n):
        msg += "; " + note
    return msg


def cpu_fallback_note(pipe_or_model, counts: dict) -> str:
    """A warning (also returned, for the injection's log line) when kernels were injected into a model with
    weights on the CPU without Triton's interpreter: every injected forward then steps aside to the
    original code, so a CPU run says nothing about the kernels. "" otherwise."""
    if interpreting() or not any(counts.values()):
        return ""
    if isinstance(pipe_or_model, torch.nn.Module):
        modules = [pipe_or_model]
    else:
        modules = [m for m in getattr(pipe_or_model, "components", {}).values() if isinstance(m, torch.nn.Module)]
    if not any(p.device.type == "cpu" for m in modules for p in m.parameters()):
        return ""
    note = (
        "weights on the CPU and TRITON_INTERPRET is not set: the injected forwards step aside and run the "
        "original code (move the model to the GPU, or start Python with TRITON_INTERPRET=1 to run the kernels "
        "through Triton's interpreter)"
    )
    warnings.warn(note, stacklevel=3)
    return note


def report(logger, msg: str, verbose: bool, *, warning: bool = False) -> None:
    """Log msg (INFO, or WARNING where warning) and, if verbose, print it to stderr: once, where logging is not
    configured and Python's last-resort handler already prints the warning there."""
    (logger.warning if warning else logger.info)(msg)
    printed = warning and logging.lastResort is not None and not logger.hasHandlers() and logger.isEnabledFor(30)
    if verbose and not printed:
        print(msg, file=sys.stderr)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Create parameters directly in dtype (half the memory and time of fp32-then-cast for bf16)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def keep_in_fp32_(model: torch.nn.Module) -> None:
    """Back to fp32: the modules and parameters named in the class's _keep_in_fp32_modules (what
    from_pretrained(torch_dtype=...) leaves in fp32)."""
    keep = set(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    if not keep:
        return
    for name, module in model.named_modules():
        if keep.intersection(name.split(".")):
            module.float()
    for name, param in model.named_parameters():
        if name.split(".")[-1] in keep:
            param.data = param.data.float()


def summary_header(gpu: bool, weights: str, library: str) -> dict:
    """The first entries of an example's JSON summary: the date (UTC), the command as run, the device (the
    GPU's name, or the CPU under Triton's interpreter), what the weights are, and the versions of torch,
    triton and library (the package the injected model comes from)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", os.path.relpath(sys.argv[0]) if sys.argv[0] else "-", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter)",
        "weights": weights,
        "versions": {
            "torch": torch.__version__,
            "triton": __import__("triton").__version__,
            library: __import__(library).__version__,
        },
    }


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="Shared helpers of the integration scripts (nothing to run): when a kernel may replace "
        "torch, and reversible forward patching. Import it; see diffusers_injection.py."
    ).parse_args()

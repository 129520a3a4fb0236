# SPDX-License-Identifier: Apache-2.0
"""Put the project's Triton kernels into Hugging Face transformers' Llama-family models, and take them out again.

    counts = inject_llama_kernels(model)     # LlamaForCausalLM, LlamaModel, or any module holding them
    model.generate(...)                      # now runs the kernels
    remove_llama_kernels(model)              # original code back: outputs bit-identical to before

What is replaced, per kind (counts for Llama-3-8B, 32 decoder layers):

* ``rmsnorm`` (65): every ``LlamaRMSNorm`` (two per layer and the final norm) -> ``rmsnorm.rms_norm`` with
  Llama's numerics (normalise in fp32, round to the input dtype, then multiply by the weight).
* ``fused_add_rmsnorm`` (32): ``LlamaDecoderLayer.forward``: ``residual + attention output`` and the
  ``post_attention_layernorm`` that follows become one ``rmsnorm.fused_add_rms_norm`` call, which returns
  both the new residual and the normalised input of the MLP. The rest of the layer is unchanged.
* ``swiglu`` (32): ``LlamaMLP.forward``: ``silu(gate_proj(x)) * up_proj(x)`` -> ``activations.swiglu``.
* ``rope`` (32): the attention layers' ``apply_rotary_pos_emb(q, k, cos, sin)`` -> ``rope.rope_rotate_half``
  for q and for k.
* ``skinny_gemm`` (225, only with ``skinny_gemm=True``): every ``nn.Linear`` of the model (7 per layer and
  ``lm_head``) -> ``skinny_gemm.skinny_gemm`` when the input has at most 32 rows (decoding) in fp16/bf16;
  larger inputs (the prefill) keep ``nn.Linear``.

Not fused: the MLP's residual add with the next layer's ``input_layernorm``. Layers hand a single tensor
to each other through ``LlamaModel.forward`` (which also records it for ``output_hidden_states``, and
sends the last one to the final norm), so that fusion would mean rewriting the model's forward or passing
state between layers behind its back; one elementwise add per layer is not worth that.

Modules are recognised by what they compute, not by their class name or source text: each candidate
class's forward is run once on small CPU tensors in a stand-in instance (probe parameters and submodules,
the real module's settings) and compared with the kernels' math: an RMSNorm bit for bit in bf16 (which also
tells whether it rounds before the weight multiply), the MLP and the pre-norm decoder layer in float64, the
decoder layer also for handing every argument on to self_attn unchanged; the model file's
``apply_rotary_pos_emb`` is run on float64 tensors against the rotate-half formula. Copies and rewrites
(Mistral, Qwen2, Qwen3's extra q/k norms, code reformatted by a release) match; anything that computes
another function is left untouched and named in the log line, so a non-Llama model gets all-zero counts.
A kind the architecture has sites of (an RMSNorm class, a gate/up/down MLP, a pre-norm layer, an attention
calling ``apply_rotary_pos_emb``) but none of which is replaced makes the log line a warning, and
``missing_kinds(model)`` returns it (the examples' ``ok`` is false then).

Patching is per instance (``module.forward`` set on the instance; the classes and other models are
untouched). RoPE is a module-level function in transformers. With the kernels package (a dependency from
transformers 5.25) that function routes each attention layer's calls to the layer's own copy of it, and the
kernel goes into the copies of the patched layers: nothing global changes. Without it, a dispatcher takes
the function's place in the model file while any attention layer is patched: it runs the kernel only inside
a patched attention layer and calls the original function everywhere else. A layer to which
``kernels.kernelize`` gave a hub kernel keeps it. Every patched forward reads its parameters when
it runs and falls back to the original code for inputs the kernels do not cover: autograd (the kernels
have no backward), gradient checkpointing, tensors on a device the kernels cannot use (CPU without
TRITON_INTERPRET=1, meta), dtype mixes where transformers would promote (an fp32 weight on bf16
activations), unusual layouts, and modules that carry hooks the fused path would skip. Injecting twice
changes nothing; removal restores the original forwards and function. An injected model survives
``copy.deepcopy`` and ``torch.save`` / ``torch.load(..., weights_only=False)`` (where this file is
importable under the same name): the copy is injected too, bound to its own modules, and holds the RoPE
kernel (or dispatcher) itself, so removing the kernels from one model leaves the other's in place.

``count_kernel_calls()`` counts the kernel calls made inside a ``with`` block (a patched model whose
inputs all fell back to torch shows zeros). Also here: ``tiny_llama_config``, ``llama3_8b_config``,
``build_llama`` (random weights, no hub access) and ``build_meta_llama`` (no memory), shared by the tests
and ``transformers_injection_example.py``. ``python transformers_injection.py`` reports
the counts for the Llama-3-8B architecture built on the meta device (no memory, no weights).
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import inspect
import logging
import os
import sys
import threading
import types
import weakref
from typing import Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the leaf kernels live beside this file
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from transformers.activations import SiLUActivation  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

import activations  # noqa: E402
import injection_common as ic  # noqa: E402
import rmsnorm  # noqa: E402
import rope as rope_kernels  # noqa: E402  (the name `rope` is an argument of inject_llama_kernels)
import skinny_gemm as skinny_kernels  # noqa: E402

__all__ = [
    "inject_llama_kernels",
    "remove_llama_kernels",
    "injected_counts",
    "count_kernel_calls",
    "missing_kinds",
    "KINDS",
    "tiny_llama_config",
    "llama3_8b_config",
    "build_llama",
    "build_meta_llama",
]

logger = logging.getLogger("transformers_injection")

KINDS = ("rmsnorm", "fused_add_rmsnorm", "swiglu", "rope", "skinny_gemm")

_STATE = ic.register_state_key("_rtk_llama_injection")  # per-module record of what was patched and how to undo it
_HALF = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ROPE_NAME = "apply_rotary_pos_emb"


# --------------------------------------------------------------------------------------------
# When may a kernel run?
# --------------------------------------------------------------------------------------------
_usable = ic.usable


def _has_hooks(m: torch.nn.Module) -> bool:
    """Hooks that calling the module would run (a fused path that skips its call would skip them)."""
    mm = torch.nn.modules.module
    return bool(
        m._forward_hooks
        or m._forward_pre_hooks
        or getattr(m, "_hf_hook", None) is not None
        or getattr(mm, "_global_forward_hooks", None)
        or getattr(mm, "_global_forward_pre_hooks", None)
    )


# --------------------------------------------------------------------------------------------
# Recognising Llama code: by what it computes
# --------------------------------------------------------------------------------------------
# A module is recognised by running its class's forward once on small CPU tensors, in a stand-in
# instance of that class (made without its __init__) that holds the real module's plain settings
# (eps, sizes, flags) beside probe parameters and submodules, and comparing the result with the math
# the kernels compute. The source text is never compared: transformers rewrites it from release to
# release (decorators, renamed arguments, hub-kernel wrappers) while what it computes stays. A class
# that computes something else, or whose forward does not run on the stand-in, is left alone, and the
# injection's log says which and why. Each probe runs once per class and settings and is cached; the
# cache may be filled from several threads (models injected concurrently): a probe runs under a lock
# and its result is stored whole, in one assignment.
_MISSING = object()
_PLAIN = (bool, int, float, str, type(None))
_PROBES: dict = {}  # (probe name, class, settings) -> result: a dict when recognised, else the reason (str)
_PROBE_LOCK = threading.RLock()


def _settings(m) -> tuple:
    """The module's plain settings (numbers, strings, flags): what its forward may read besides tensors."""
    return tuple(sorted((k, v) for k, v in m.__dict__.items() if type(v) in _PLAIN and not k.startswith("_")))


def _stand_in(m, **members):
    """An instance of type(m) built without its __init__: m's plain settings, then members (parameters,
    submodules, values). Nothing of m's tensors, hooks or instance forward."""
    obj = type(m).__new__(type(m))
    torch.nn.Module.__init__(obj)
    for k, v in m.__dict__.items():
        if type(v) in _PLAIN and not k.startswith("_"):
            object.__setattr__(obj, k, v)
    for k, v in members.items():
        setattr(obj, k, v)
    return obj


def _probe(name: str, m, run):
    """run(m) once per (name, class of m, plain settings of m); its result is cached. A forward that
    raises on the stand-in is not recognised (the reason names the exception)."""
    key = (name, type(m), _settings(m))
    result = _PROBES.get(key, _MISSING)
    if result is not _MISSING:
        return result
    with _PROBE_LOCK:
        result = _PROBES.get(key, _MISSING)
        if result is _MISSING:
            try:
                with torch.no_grad(), torch.device("cpu"):  # whatever device context the caller is in
                    result = run(m)
            except Exception as e:  # the forward does not run on the stand-in: not what the kernel replaces
                result = f"{type(m).__name__}.forward did not run on probe inputs ({type(e).__name__}: {e})"
            _PROBES[key] = result
    return result


def _eps_name(m) -> Optional[str]:
    for name in ("variance_epsilon", "eps"):
        if type(m.__dict__.get(name)) is float:
            return name
    return None


def _rmsnorm_probe(m):
    """{'eps': attribute name, 'cast_before_weight': bool} if type(m).forward is an RMSNorm over the last
    dim that the kernel computes bit for bit in bf16 (which tells the two rounding conventions apart:
    Llama's rounds the normalised value to the input dtype before the weight multiply)."""
    eps_name = _eps_name(m)
    w = getattr(m, "weight", None)
    if eps_name is None or not isinstance(w, torch.Tensor) or w.dim() != 1:
        return f"{type(m).__name__} has no 1-d weight and float eps (variance_epsilon or eps)"
    eps = m.__dict__[eps_name]
    g = torch.Generator().manual_seed(0)
    weight = (1 + torch.randn(48, generator=g)).to(torch.bfloat16)
    probe = _stand_in(m, weight=torch.nn.Parameter(weight, requires_grad=False))
    # inputs of the size of sqrt(eps), so that a forward using another eps (or none) differs too
    x = (torch.randn(6, 48, generator=g) * (3 * max(eps, 1e-12) ** 0.5)).to(torch.bfloat16)
    got = type(m).forward(probe, x)
    for cast_before_weight in (True, False):
        want = rmsnorm.rms_norm_ref(x, weight, eps, cast_before_weight=cast_before_weight)
        if isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want):
            return {"eps": eps_name, "cast_before_weight": cast_before_weight}
    return f"{type(m).__name__}.forward computes another function than the RMSNorm kernel (weight * normalised x)"


def _mlp_probe(m):
    """{} if type(m).forward computes down_proj(act_fn(gate_proj(x)) * up_proj(x)) (checked in float64 with
    probe layers and SiLU as act_fn; the module's own act_fn is checked apart, per instance)."""
    g = torch.Generator().manual_seed(1)

    def linear(i, o):
        lin = torch.nn.Linear(i, o, dtype=torch.float64)
        lin.weight.copy_(torch.randn(o, i, generator=g, dtype=torch.float64))
        lin.bias.copy_(torch.randn(o, generator=g, dtype=torch.float64))
        return lin

    gate, up, down = linear(8, 12), linear(8, 12), linear(12, 8)
    probe = _stand_in(m, gate_proj=gate, up_proj=up, down_proj=down, act_fn=torch.nn.SiLU())
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    got = type(m).forward(probe, x)
    want = down(torch.nn.functional.silu(gate(x)) * up(x))
    if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12):
        return {}
    return f"{type(m).__name__}.forward computes another function than down_proj(act_fn(gate_proj(x)) * up_proj(x))"


class _ProbeAttention(torch.nn.Module):
    """Stands in for a decoder layer's self_attn: records how it is called, returns (3 h + 1/4, None)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        h = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        return h * 3 + 0.25, None


class _ProbeMap(torch.nn.Module):
    """Stands in for a norm or an MLP: an elementwise function of its input."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _decoder_layer_probe(m):
    """How type(m).forward calls its parts, if it is the pre-norm decoder layer
        h = x + self_attn(input_layernorm(x))[0];  out = h + mlp(post_attention_layernorm(h))
    handing every argument it takes on to self_attn unchanged, by name (checked with probe parts and
    sentinel arguments). Returns {'params': names of its positional parameters, hidden states first,
    'hidden_key': the keyword self_attn gets the normalised input by, 'defaults': what self_attn gets for
    the parameters a caller leaves out}."""
    try:
        sig = inspect.signature(type(m).forward)
    except (TypeError, ValueError):
        return f"{type(m).__name__}.forward has no readable signature"
    params = list(sig.parameters.values())[1:]
    kinds = {p.kind for p in params}
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    if not positional or kinds - {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.VAR_KEYWORD}:
        return f"{type(m).__name__}.forward takes positional-only, *args or keyword-only parameters"

    attn = _ProbeAttention()
    probe = _stand_in(
        m,
        input_layernorm=_ProbeMap(lambda x: x * 2 + 1),
        post_attention_layernorm=_ProbeMap(lambda x: x * 0.5 - 2),
        mlp=_ProbeMap(torch.sin),
        self_attn=attn,
    )
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    h = x + ((x * 2 + 1) * 3 + 0.25)
    want = h + torch.sin(h * 0.5 - 2)
    sentinels = {name: object() for name in positional[1:]}
    extra = {"rtk_probe_extra": object()} if var_kw else {}
    runs = []
    for given in ({}, {**sentinels, **extra}):
        attn.calls.clear()
        out = type(m).forward(probe, x, **given)
        if len(attn.calls) != 1 or not isinstance(out, torch.Tensor):
            return f"{type(m).__name__}.forward does not call self_attn once and return one tensor"
        if not torch.allclose(out, want, rtol=1e-12, atol=1e-12):
            return f"{type(m).__name__}.forward computes another function than the pre-norm residual layer"
        args, kwargs = attn.calls[0]
        hidden = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if args or len(hidden) != 1:
            return f"{type(m).__name__}.forward does not call self_attn with its arguments by keyword"
        runs.append((hidden[0], {k: v for k, v in kwargs.items() if k != hidden[0]}))
    (hidden_key, defaults), (key2, passed) = runs
    if key2 != hidden_key or passed != {**sentinels, **extra} or set(defaults) != set(sentinels):
        return f"{type(m).__name__}.forward does not hand each of its arguments on to self_attn unchanged"
    return {"params": tuple(positional), "hidden_key": hidden_key, "defaults": defaults}


def _rope_probe(fn):
    """Whether fn(q, k, cos, sin) is transformers' rotate-half RoPE of q and k (float64, q and k
    [B, H, S, D], cos and sin [B, S, D]); cached per function."""
    key = ("rope", id(fn))
    hit = _PROBES.get(key)
    if hit is not None and hit[0] is fn:
        return hit[1]
    g = torch.Generator().manual_seed(3)
    with _PROBE_LOCK, torch.no_grad(), torch.device("cpu"):
        q = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
        k = torch.randn(1, 1, 5, 8, generator=g, dtype=torch.float64)
        cos = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
        sin = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
        try:
            fq, fk = fn(q, k, cos, sin)
            ok = all(
                isinstance(got, torch.Tensor)
                and torch.allclose(got, rope_kernels.rope_rotate_half_ref(t, cos, sin), rtol=1e-12, atol=1e-12)
                for got, t in ((fq, q), (fk, k))
            )
        except Exception:  # another signature or layout: not the function the kernel replaces
            ok = False
        _PROBES[key] = (fn, ok)
    return ok


def _recognised(result) -> bool:
    return isinstance(result, dict)


def _rmsnorm_plan(m):
    return _probe("rmsnorm", m, _rmsnorm_probe) if isinstance(getattr(m, "weight", None), torch.Tensor) else None


def _mlp_plan(m):
    if not all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return None
    return _probe("mlp", m, _mlp_probe)


def _decoder_layer_plan(m):
    if not all(hasattr(m, a) for a in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")):
        return None
    return _probe("decoder_layer", m, _decoder_layer_probe)


def _is_llama_rmsnorm(m) -> bool:
    return _recognised(_rmsnorm_plan(m))


def _is_plain_silu(act) -> bool:
    """act computes silu(x) and nothing else (no hooks, no instance forward)."""
    return type(act) in (SiLUActivation, torch.nn.SiLU) and "forward" not in act.__dict__ and not _has_hooks(act)


def _original_rope_function(fn):
    """The function a rope dispatcher stands in for (fn itself when it is not a dispatcher)."""
    return getattr(fn, "_rtk_original", fn)


def _rope_globals(cls) -> Optional[dict]:
    """The globals through which cls.forward (its own code, under any wrappers) calls apply_rotary_pos_emb,
    or None when it calls no such name. What the function computes is checked apart (_rope_probe)."""
    fwd = inspect.unwrap(cls.forward)
    code, g = getattr(fwd, "__code__", None), getattr(fwd, "__globals__", None)
    if code is None or g is None or _ROPE_NAME not in code.co_names or not callable(g.get(_ROPE_NAME)):
        return None
    return g


def _rope_slot(m, g: dict):
    """The layer's private copy of apply_rotary_pos_emb, if transformers routes the layer's calls through one:
    with the kernels package installed (a dependency from transformers 5.25), the model file's function is a
    module whose calls, while a layer runs, go to that layer's own instance in m._kernel_funcs (where
    kernels.kernelize puts a hub kernel). None where the function is a plain function (no kernels package)."""
    fn = g.get(_ROPE_NAME)
    own = m.__dict__.get("_kernel_funcs")
    slot = own.get(_slot_key(fn)) if isinstance(own, dict) else None
    if isinstance(fn, torch.nn.Module) and slot is not None and type(slot) is type(fn) and _slot_function(slot):
        return slot
    return None


def _slot_function(slot):
    """The function a copy of apply_rotary_pos_emb (see _rope_slot) wraps, read from its class's forward
    (which calls it); None if not found. The kernel's fallback calls it directly: under torch.compile the
    copy's forward is called on the model file's instance, whose own forward would route back to it."""
    cls = type(slot)
    fn = _SLOT_FUNCTIONS.get(cls)
    if fn is None:
        cells = getattr(getattr(cls, "forward", None), "__closure__", None) or ()
        found = [c.cell_contents for c in cells if isinstance(c.cell_contents, types.FunctionType)]
        found = [f for f in found if f.__name__ == _ROPE_NAME]
        fn = _SLOT_FUNCTIONS[cls] = found[0] if len(found) == 1 else False
    return fn or None


_SLOT_FUNCTIONS: dict = {}  # class of a copy of apply_rotary_pos_emb -> the function it wraps (False: none)


def _slot_key(fn):
    """The key of fn's copies in a layer's _kernel_funcs (as the kernels package names them)."""
    return getattr(fn, "__name__", None) or getattr(fn, "kernel_layer_name", None)


def _hub_kernel(m) -> bool:
    """Whether the kernels hub (kernels.kernelize) gave this layer a RoPE kernel of its own: its private
    copy of the function has a forward put on the instance, not this file's."""
    g = _rope_globals(type(m))
    own = m.__dict__.get("_kernel_funcs")
    fn = own.get(_slot_key(g.get(_ROPE_NAME))) if isinstance(own, dict) and g is not None else None
    fwd = getattr(fn, "__dict__", {}).get("forward")
    return fwd is not None and getattr(fwd, "__func__", None) is not _rope_slot_forward


# --------------------------------------------------------------------------------------------
# Patching instance forwards, reversibly
# --------------------------------------------------------------------------------------------
def _foreign_forward(module: torch.nn.Module) -> bool:
    """The instance has a forward of someone else's (not an accelerate hook, which we can wrap)."""
    return "forward" in module.__dict__ and not hasattr(module, "_hf_hook") and _STATE not in module.__dict__


def _patch_forward(module: torch.nn.Module, fn, kind: str, **extra) -> bool:
    """Make fn(module, ...) the module's forward (see injection_common.patch_forward)."""
    return ic.patch_forward(module, fn, kind, _STATE, **extra)


def _original_forward(module: torch.nn.Module):
    """The forward the module had before patching (used for inputs the kernels do not cover)."""
    return ic.original_forward(module, _STATE)


def _unpatch(module: torch.nn.Module) -> Optional[str]:
    """Undo whatever was patched on this module; returns its kind (None if nothing was)."""
    slot = module.__dict__.get(_STATE, {}).get("rope_slot")
    if slot is not None:  # the RoPE kernel put into the layer's private copy of the function
        del module.__dict__[_STATE]
        if getattr(slot.__dict__.get("forward"), "__func__", None) is _rope_slot_forward:
            del slot.__dict__["forward"]
        return "rope"
    state = ic.unpatch(module, _STATE)
    if state is None:
        return None
    if state["kind"] == "rope":
        _rope_release(module, state["site"].globals)
    return state["kind"]


# --------------------------------------------------------------------------------------------
# Replacement forwards
# --------------------------------------------------------------------------------------------
def _rmsnorm_forward(self, hidden_states):
    """An RMSNorm as its probe found it: fp32 normalisation, rounded to the input dtype before the weight
    multiply (Llama's) or after it, in one kernel."""
    st = self.__dict__[_STATE]
    w = self.weight
    if (
        w.dtype != hidden_states.dtype  # e.g. an fp32 weight on bf16 input: the original returns fp32
        or w.shape != hidden_states.shape[-1:]
        or hidden_states.dim() == 0
        or (hidden_states.stride(-1) != 1 and hidden_states.shape[-1] != 1)
        or not _usable(hidden_states, w)
    ):
        return _original_forward(self)(hidden_states)
    return rmsnorm.rms_norm(hidden_states, w, getattr(self, st["eps"]), cast_before_weight=st["cast_before_weight"])


def _mlp_forward(self, x):
    """LlamaMLP: down_proj(silu(gate_proj(x)) * up_proj(x)) with the SwiGLU in one kernel."""
    act = self.act_fn
    if not _is_plain_silu(act):
        return _original_forward(self)(x)
    gate = self.gate_proj(x)
    up = self.up_proj(x)
    if (
        gate.shape != up.shape
        or gate.dtype != up.dtype
        or not _usable(gate, up)
        or (gate.dim() and gate.stride(-1) != 1)
        or (up.dim() and up.stride(-1) != 1)
    ):
        return self.down_proj(act(gate) * up)
    return self.down_proj(activations.swiglu(gate, up))


def _fusable_norm(norm, x, residual) -> Optional[dict]:
    """The record of post_attention_layernorm when norm(residual + x) may run as one fused kernel that skips
    the norm's call: the norm runs this file's RMSNorm patch (its probe's eps and rounding are in the record)
    and nothing else, and the tensors suit the kernel. Else None."""
    st = norm.__dict__.get(_STATE)
    if st is None or st["kind"] != "rmsnorm" or _has_hooks(norm):
        return None
    fwd = norm.__dict__.get("forward")
    if fwd is None or ic.patched_function(fwd) is not _rmsnorm_forward:
        return None  # someone else's forward on the norm: let it run
    w = norm.weight
    ok = (
        x.shape == residual.shape
        and x.dtype == residual.dtype == w.dtype
        and w.shape == x.shape[-1:]
        and x.dim() > 0
        and (x.stride(-1) == 1 or x.shape[-1] == 1)
        and (residual.stride(-1) == 1 or residual.shape[-1] == 1)
        and _usable(x, residual, w)
    )
    return st if ok else None


def _decoder_layer_forward(self, *args, **kwargs):
    """The Llama decoder layer with `residual + attention` and post_attention_layernorm in one kernel.

    Computes what transformers' layer computes (its probe checked that at injection: _decoder_layer_probe),
    with the same arguments and return value: self_attn gets what the original hands it, each argument the
    caller gives by name and, for those left out, the layer's defaults.
    """
    st = self.__dict__[_STATE]
    names = st["params"]
    if (
        not args
        or len(args) > len(names)
        or any(n in kwargs for n in names[: len(args)])
        or (
            torch.is_grad_enabled()
            and (
                getattr(args[0], "requires_grad", False)
                or (self.training and getattr(self, "gradient_checkpointing", False))
            )
        )
    ):
        # keyword-only hidden_states, argument errors, autograd, gradient checkpointing: the original
        return _original_forward(self)(*args, **kwargs)
    hidden_states = args[0]
    given = kwargs
    kwargs = dict(st["defaults"])
    kwargs.update(given)
    for name, value in zip(names[1:], args[1:]):
        kwargs[name] = value

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    kwargs[st["hidden_key"]] = hidden_states
    hidden_states, _ = self.self_attn(**kwargs)
    norm = self.post_attention_layernorm
    norm_st = _fusable_norm(norm, hidden_states, residual)
    if norm_st is not None:
        # r = residual + attn (fp32 sum rounded once: the bits torch's add gives), y = norm(r)
        hidden_states, residual = rmsnorm.fused_add_rms_norm(
            hidden_states,
            residual,
            norm.weight,
            getattr(norm, norm_st["eps"]),
            cast_before_weight=norm_st["cast_before_weight"],
        )
    else:
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = norm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _linear_forward(self, x):
    """nn.Linear through the skinny GEMM when x has 1..32 rows in fp16/bf16 (decoding)."""
    w, b = self.weight, self.bias
    k = x.shape[-1] if x.dim() else 0
    rows = x.numel() // k if k else 0
    if (
        not 1 <= rows <= skinny_kernels.MAX_M
        or x.dtype not in _HALF
        or w.dtype != x.dtype
        or (b is not None and b.dtype not in _KERNEL_DTYPES)
        or not x.is_contiguous()
        or w.dim() != 2
        or w.stride(1) != 1
        or not _usable(x, w, b)
    ):
        return _original_forward(self)(x)
    return skinny_kernels.skinny_gemm(x, w, b)


# RoPE: transformers' attention calls the module-level apply_rotary_pos_emb of its model file. While
# any attention layer of that file is patched, a dispatcher stands in for the function; it uses the
# kernel only while a patched attention layer is running (a per-thread depth counter), so other models
# and unpatched layers in the process keep the original function. Putting the dispatcher in place and
# taking it out hold a lock: layers injected or removed from several threads share one dispatcher.
_ROPE_ACTIVE = threading.local()
_ROPE_SITES: dict = {}  # id(globals dict) -> {"globals", "original", "dispatcher", "users": WeakSet}
_ROPE_LOCK = threading.RLock()


class _RopeSite:
    """A patched attention layer's hold on the dispatcher in its model file's globals (the "site" of its
    record). The globals dict (it holds Python modules) does not pickle: this pickles as the model file's
    module name, and unpickling or deep-copying the layer puts the dispatcher in place for the new layer,
    as injecting it would, so its RoPE kernel outlives the original's removal."""

    __slots__ = ("module", "globals")

    def __init__(self, module, g: dict):
        self.module, self.globals = module, g

    def __reduce__(self):
        name = self.globals.get("__name__")
        if not isinstance(name, str) or getattr(sys.modules.get(name), "__dict__", None) is not self.globals:
            raise TypeError(
                f"{type(self.module).__name__} calls {_ROPE_NAME} from {name!r}, which is no importable module, "
                "so the injected model cannot be saved or copied; call remove_llama_kernels(model) first"
            )
        return _rope_site_for, (self.module, name)


def _rope_site_for(module, name: str) -> _RopeSite:
    """The _RopeSite of an unpickled or copied attention layer (see _RopeSite)."""
    g = importlib.import_module(name).__dict__
    _rope_acquire(module, g)
    return _RopeSite(module, g)


def _rope_usable(q, k, cos, sin) -> bool:
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return False
    b, s, d = q.shape[0], q.shape[2], q.shape[3]
    if k.shape[0] != b or k.shape[2:] != (s, d) or d % 2:
        return False
    for t in (cos, sin):
        if t.shape[0] not in (1, b) or t.shape[1:] != (s, d) or (d > 1 and t.stride(-1) != 1):
            return False
    # the original computes in promote(q, cos); the kernel returns q's dtype: require one dtype
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return False
    if d > 1 and (q.stride(-1) != 1 or k.stride(-1) != 1):
        return False
    return _usable(q, k, cos, sin)


def _make_rope_dispatcher(original):
    """The stand-in for a model file's apply_rotary_pos_emb: the kernel for the call form its probe checked,
    (q, k, cos, sin) inside a patched attention layer, with tensors the kernel takes; else the function
    it stands in for (a hub-kernel wrapper of transformers' function keeps its routing)."""

    def apply_rotary_pos_emb(*args, **kwargs):
        if getattr(_ROPE_ACTIVE, "depth", 0) and len(args) == 4 and not kwargs and _rope_usable(*args):
            q, k, cos, sin = args
            return rope_kernels.rope_rotate_half(q, cos, sin), rope_kernels.rope_rotate_half(k, cos, sin)
        return original(*args, **kwargs)

    apply_rotary_pos_emb._rtk_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _rope_slot_forward(self, *args, **kwargs):
    """The forward of a layer's private copy of apply_rotary_pos_emb (see _rope_slot): the kernel for the call
    form the probe checked, (q, k, cos, sin) with tensors the kernel takes; else transformers' function.
    Under torch.compile transformers calls it on the model file's instance, not on the layer's copy."""
    if len(args) == 4 and not kwargs and _rope_usable(*args):
        q, k, cos, sin = args
        return rope_kernels.rope_rotate_half(q, cos, sin), rope_kernels.rope_rotate_half(k, cos, sin)
    return _SLOT_FUNCTIONS[type(self)](*args, **kwargs)


def _rope_acquire(module, g: dict) -> None:
    with _ROPE_LOCK:
        site = _ROPE_SITES.get(id(g))
        if site is None or g.get(_ROPE_NAME) is not site["dispatcher"]:
            original = g[_ROPE_NAME]
            site = {
                "globals": g,
                "original": original,
                "dispatcher": _make_rope_dispatcher(original),
                "users": weakref.WeakSet(),
            }
            g[_ROPE_NAME] = site["dispatcher"]
            _ROPE_SITES[id(g)] = site
        site["users"].add(module)


def _rope_release(module, g: dict) -> None:
    with _ROPE_LOCK:
        site = _ROPE_SITES.get(id(g))
        if site is None:
            return
        site["users"].discard(module)
        if not len(site["users"]):
            if g.get(_ROPE_NAME) is site["dispatcher"]:  # not if someone replaced it since
                g[_ROPE_NAME] = site["original"]
            del _ROPE_SITES[id(g)]


def _attention_forward(self, *args, **kwargs):
    """The attention layer's own forward, with the RoPE dispatcher enabled while it runs."""
    depth = getattr(_ROPE_ACTIVE, "depth", 0)
    _ROPE_ACTIVE.depth = depth + 1
    try:
        return _original_forward(self)(*args, **kwargs)
    finally:
        _ROPE_ACTIVE.depth = depth


# --------------------------------------------------------------------------------------------
# Discovery and counts
# --------------------------------------------------------------------------------------------
def _empty_counts() -> dict:
    return {k: 0 for k in KINDS}


def _modules(model):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module (e.g. a LlamaForCausalLM), got {type(model).__name__}")
    return model.modules()  # each module once, even when shared


def injected_counts(model) -> dict:
    """Counts per kind of what is currently injected in model."""
    return ic.kind_counts(_modules(model), _STATE, KINDS)


@contextlib.contextmanager
def count_kernel_calls():
    """Count the kernel calls the patched forwards make inside the block (it wraps the kernel entry
    points for its duration): with counts as c: model(...); c is a Counter keyed by function name.
    A patched model that runs no kernel (every input fell back to torch) shows up as zero counts."""
    calls = collections.Counter()
    saved = []
    for mod, name in (
        (rmsnorm, "rms_norm"),
        (rmsnorm, "fused_add_rms_norm"),
        (activations, "swiglu"),
        (rope_kernels, "rope_rotate_half"),
        (skinny_kernels, "skinny_gemm"),
    ):
        fn = getattr(mod, name)
        saved.append((mod, name, fn))

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)

        setattr(mod, name, counted)
    try:
        yield calls
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def inject_llama_kernels(
    model: torch.nn.Module,
    *,
    fuse_residual: bool = True,
    rope: bool = True,
    skinny_gemm: bool = False,
    verbose: bool = True,
) -> dict:
    """Replace the RMSNorms, residual add + norm, SwiGLU, RoPE (and optionally the decode-time linear
    layers) of a Llama-family model with the kernels; see the module docstring for each kind.

    model: a LlamaForCausalLM / LlamaModel (or a Mistral/Qwen2-style copy), or any module containing one.
    fuse_residual, rope, skinny_gemm: which optional kinds to add (RMSNorm and SwiGLU are always
    injected). Returns the counts per kind of what is injected after the call. A second call wraps
    nothing twice and only adds kinds that were not asked for before; to drop a kind, remove and inject
    again. Inject before torch.compile (the kernels are torch.library custom ops, so compile traces them).
    A kind the model has sites of but none was replaced (missing_kinds) is a warning in the log line.
    """
    new = _empty_counts()
    skipped = []
    modules = list(_modules(model))
    llama_like = False

    for m in modules:
        llama_like |= _inject_module(m, fuse_residual, rope, new, skipped)

    if skinny_gemm and llama_like:
        for m in modules:
            # plain nn.Linear only: subclasses (quantised layers, LoRA) compute something else
            if type(m) is torch.nn.Linear and _STATE not in m.__dict__:
                if _foreign_forward(m):
                    skipped.append("Linear with its own instance forward")
                else:
                    new["skinny_gemm"] += _patch_forward(m, _linear_forward, "skinny_gemm")

    counts = injected_counts(model)
    missing = missing_kinds(model, fuse_residual=fuse_residual, rope=rope)
    none_found = "" if llama_like or missing else "no Llama-style RMSNorm, MLP, decoder layer or attention found"
    warning = "; ".join(f"WARNING {kind}: {why}" for kind, why in missing.items())
    ic.report(
        logger,
        ic.counts_message(
            "injected Llama kernels",
            counts,
            new,
            none_found=none_found,
            skipped=skipped,
            notes=[warning, ic.cpu_fallback_note(model, new)],
        ),
        verbose,
        warning=bool(missing),
    )
    return counts


def _site_kind(m) -> Optional[str]:
    """The kind of site m is by its structure alone (class name, attributes, the function its forward calls),
    whether or not the kernels can replace it: what missing_kinds counts."""
    if type(m) is torch.nn.Linear:
        return None
    if "rmsnorm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor):
        return "rmsnorm"
    if all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return "swiglu"
    if all(hasattr(m, a) for a in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")):
        return "fused_add_rmsnorm"
    if _rope_globals(type(m)) is not None:
        return "rope"
    return None


def _why_not(m, kind: str) -> Optional[str]:
    """Why the kernel of kind cannot replace m (None if it can): what the probes found, or what is in the way."""
    if kind == "rmsnorm":
        plan = _rmsnorm_plan(m)
    elif kind == "swiglu":
        plan = _mlp_plan(m)
        if _recognised(plan) and not _is_plain_silu(m.act_fn):
            return f"{type(m).__name__} with activation {type(m.act_fn).__name__}"
    elif kind == "fused_add_rmsnorm":
        plan = _decoder_layer_plan(m)
        if _recognised(plan) and not _is_llama_rmsnorm(m.post_attention_layernorm):
            return f"{type(m).__name__} whose post-attention norm is not an RMSNorm the kernel computes"
    else:
        g = _rope_globals(type(m))
        if g is None:
            return f"{type(m).__name__} calls no {_ROPE_NAME}"
        fn = _original_rope_function(g[_ROPE_NAME])
        if not _rope_probe(fn):
            return f"{_ROPE_NAME} of {g.get('__name__')} computes another function than rotate-half RoPE"
        if _hub_kernel(m):
            return f"{type(m).__name__} runs a RoPE kernel of the kernels hub (kernelize)"
        plan = {}
    if not _recognised(plan):
        return plan or f"{type(m).__name__} is no {kind} site"
    if _foreign_forward(m):
        return f"{type(m).__name__} with its own instance forward"
    return None


def _inject_module(m, fuse_residual: bool, rope: bool, new: dict, skipped: list) -> bool:
    """Inject the kernel of m's kind into m, if it has one and may take it (adding to new, or to skipped with
    the reason it may not); returns whether m is a Llama-style module (patched already, or of a kind the
    injection knows, injected or not)."""
    if _STATE in m.__dict__:
        return True
    if _eps_name(m) is not None and isinstance(getattr(m, "weight", None), torch.Tensor):
        kind = "rmsnorm"  # any class whose forward computes the RMSNorm, by any name
    else:
        kind = _site_kind(m)
    if kind is None or (kind == "fused_add_rmsnorm" and not fuse_residual):
        return kind is not None
    if kind == "rope" and not rope:
        return True
    why = _why_not(m, kind)
    if why is not None:
        if kind != "rmsnorm" or _site_kind(m) == "rmsnorm":  # (a LayerNorm is no RMSNorm site: no note)
            skipped.append(why)
        return _recognised_structure(m, kind)
    if kind == "rmsnorm":
        plan = _rmsnorm_plan(m)
        new["rmsnorm"] += _patch_forward(m, _rmsnorm_forward, "rmsnorm", **plan)
    elif kind == "swiglu":
        new["swiglu"] += _patch_forward(m, _mlp_forward, "swiglu")
    elif kind == "fused_add_rmsnorm":
        new["fused_add_rmsnorm"] += _patch_forward(
            m, _decoder_layer_forward, "fused_add_rmsnorm", **_decoder_layer_plan(m)
        )
    else:
        g = _rope_globals(type(m))
        slot = _rope_slot(m, g)
        if slot is not None:  # per layer, through transformers' own routing: nothing global changes
            slot.forward = types.MethodType(_rope_slot_forward, slot)
            m.__dict__[_STATE] = {"kind": "rope", "rope_slot": slot}
            new["rope"] += 1
        elif _patch_forward(m, _attention_forward, "rope", site=_RopeSite(m, g)):
            _rope_acquire(m, g)
            new["rope"] += 1
    return True


def _recognised_structure(m, kind: str) -> bool:
    """Whether m, left alone, still counts as a Llama-style module (a site of its kind by structure)."""
    return _site_kind(m) == kind


def missing_kinds(model: torch.nn.Module, *, fuse_residual: bool = True, rope: bool = True) -> dict:
    """{kind: why} for each kind the model has sites of (by structure: an RMSNorm class, an MLP with
    gate/up/down projections, a pre-norm decoder layer, an attention calling apply_rotary_pos_emb) but
    none of which is injected, e.g. {"rope": "32 sites, none replaced: ..."}; {} when every kind the model
    has runs its kernel somewhere. fuse_residual and rope as given to inject_llama_kernels (a kind not asked
    for is not missing). The examples' ok is false while this is not empty."""
    counts = injected_counts(model)
    sites, reasons = collections.Counter(), {}
    for m in _modules(model):
        kind = _site_kind(m)
        if kind is None or (kind == "fused_add_rmsnorm" and not fuse_residual) or (kind == "rope" and not rope):
            continue
        sites[kind] += 1
        if not counts[kind]:
            why = _why_not(m, kind)
            if why is not None:
                reasons.setdefault(kind, dict.fromkeys([]))[why] = None
    return {
        kind: f"{n} sites, none replaced: " + "; ".join(reasons.get(kind) or ["not injected"])
        for kind, n in sites.items()
        if not counts[kind]
    }


def remove_llama_kernels(model: torch.nn.Module, *, verbose: bool = True) -> dict:
    """Undo inject_llama_kernels: restore the original forwards (and apply_rotary_pos_emb once no
    patched attention layer of that model file is left). Returns the counts per kind restored."""
    restored = _empty_counts()
    for m in _modules(model):
        kind = _unpatch(m)
        if kind is not None:
            restored[kind] += 1
    ic.report(logger, ic.counts_message("removed Llama kernels", restored), verbose)
    return restored


# --------------------------------------------------------------------------------------------
# Random-weight Llama models (no hub): shared by the tests and the example
# --------------------------------------------------------------------------------------------
def tiny_llama_config(**overrides):
    """A 2-layer Llama for CPU tests: hidden 64 (4 query heads and 2 key/value heads of 16), MLP width
    160 (not a power of two), vocabulary 256, Llama-3's RoPE base and epsilon."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def llama3_8b_config(**overrides):
    """The architecture of Meta-Llama-3-8B (config.json of the release): 32 layers, hidden 4096, MLP
    14336, 32 query / 8 key-value heads of 128, vocabulary 128256, RoPE base 500000, eps 1e-5."""
    from transformers import LlamaConfig

    kw = dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    kw.update(overrides)
    return LlamaConfig(**kw)


def build_llama(config=None, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A LlamaForCausalLM with random weights, built directly on `device` in `dtype` (the 8B architecture
    in bf16 takes ~16 GB and never exists in fp32), in eval mode, parameters without gradients."""
    from transformers import LlamaForCausalLM

    config = config if config is not None else tiny_llama_config()
    torch.manual_seed(seed)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.requires_grad_(False)
    return model.eval()


def build_meta_llama(config):
    """A LlamaForCausalLM whose parameters are on the meta device (no memory, no weights), e.g. to count
    what injection replaces in a large architecture. accelerate's init_empty_weights backs up the
    torch.device("meta") context: torch caches the set of factory functions that context redirects,
    and if that cache was filled while torch.empty was wrapped (a test harness, a profiler), the context
    silently allocates real memory instead."""
    from accelerate import init_empty_weights
    from transformers import LlamaForCausalLM

    with torch.device("meta"), init_empty_weights():
        return LlamaForCausalLM(config)


def _main(argv=None) -> int:
    """Report what injection replaces in the Llama-3-8B architecture (built on the meta device: no
    memory, no weights) and check that removal restores every module and the RoPE function."""
    import argparse
    import json

    p = argparse.ArgumentParser(
        description="Inject the kernels into the Llama-3-8B architecture (built on the meta device, no weights) "
        "and report the counts per kind as JSON. Library use: inject_llama_kernels(model, fuse_residual=True, "
        "rope=True, skinny_gemm=False) / remove_llama_kernels(model)."
    )
    p.add_argument("--num-layers", type=int, default=32, help="decoder layers (default 32, Llama-3-8B)")
    p.add_argument("--no-skinny-gemm", action="store_true", help="leave the linear layers alone")
    args = p.parse_args(argv)
    model = build_meta_llama(llama3_8b_config(num_hidden_layers=args.num_layers))
    sg = not args.no_skinny_gemm
    counts = inject_llama_kernels(model, skinny_gemm=sg, verbose=False)
    missing = missing_kinds(model)
    again = inject_llama_kernels(model, skinny_gemm=sg, verbose=False)
    restored = remove_llama_kernels(model, verbose=False)
    left = injected_counts(model)
    rope_restored = modeling_llama.apply_rotary_pos_emb is _original_rope_function(modeling_llama.apply_rotary_pos_emb)
    ok = counts == again == restored and not any(left.values()) and rope_restored and not missing
    print(
        json.dumps(
            {
                "architecture": f"Llama-3-8B, {args.num_layers} layers",
                "injected": counts,
                "second_injection": again,
                "restored": restored,
                "missing_kinds": missing,
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

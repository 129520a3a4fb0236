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

Modules are recognised by what their code does, not by their class name: a norm, MLP or decoder layer
is patched when its ``forward`` is statement for statement the one of transformers' Llama classes
(copies such as Mistral's or Qwen2's match too), and an attention layer when it calls a module-level
``apply_rotary_pos_emb`` identical to Llama's. Anything else is left untouched, so a non-Llama model
gets all-zero counts. Before the first injection, Llama's RMSNorm and RoPE functions are run once on
small CPU tensors against the kernels' reference math, so a transformers release that changed their
numerics is refused instead of silently approximated.

Patching is per instance (``module.forward`` set on the instance; the classes and other models are
untouched). RoPE is a module-level function in transformers, so a dispatcher takes its place in the
model file while any attention layer is patched: it runs the kernel only inside a patched attention
layer and calls the original function everywhere else. Every patched forward reads its parameters when
it runs and falls back to the original code for inputs the kernels do not cover: autograd (the kernels
have no backward), gradient checkpointing, tensors on a device the kernels cannot use (CPU without
TRITON_INTERPRET=1, meta), dtype mixes where transformers would promote (an fp32 weight on bf16
activations), unusual layouts, and modules that carry hooks the fused path would skip. Injecting twice
changes nothing; removal restores the original forwards and function. An injected model survives
``copy.deepcopy`` and ``torch.save`` / ``torch.load(..., weights_only=False)`` (where this file is
importable under the same name): the copy is injected too, bound to its own modules, and holds the RoPE
dispatcher itself, so removing the kernels from one model leaves the other's in place.

``count_kernel_calls()`` counts the kernel calls made inside a ``with`` block (a patched model whose
inputs all fell back to torch shows zeros). Also here: ``tiny_llama_config``, ``llama3_8b_config``,
``build_llama`` (random weights, no hub access) and ``build_meta_llama`` (no memory), shared by the tests
and ``transformers_injection_example.py``. ``python transformers_injection.py`` reports
the counts for the Llama-3-8B architecture built on the meta device (no memory, no weights).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import importlib
import inspect
import logging
import os
import sys
import textwrap
import threading
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
    "KINDS",
    "tiny_llama_config",
    "llama3_8b_config",
    "build_llama",
    "build_meta_llama",
]

logger = logging.getLogger("transformers_injection")

KINDS = ("rmsnorm", "fused_add_rmsnorm", "swiglu", "rope", "skinny_gemm")

_STATE = "_rtk_llama_injection"  # per-module record of what was patched and how to undo it
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
# Recognising Llama code
# --------------------------------------------------------------------------------------------
# The caches below may be filled from several threads at once (separate models injected concurrently):
# each entry is computed in full, then stored in one assignment, and read with one lookup; the numerics
# probe, filled once for the process, is computed under a lock and published whole.
_MISSING = object()
_AST_CACHE: dict = {}


def _function_node(fn) -> Optional[ast.FunctionDef]:
    """The parsed definition of fn (decorators unwrapped), or None when its source is unavailable."""
    fn = inspect.unwrap(fn)
    node = _AST_CACHE.get(fn, _MISSING)
    if node is not _MISSING:
        return node
    node = None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)):
            node = tree.body[0]
    except (OSError, TypeError, SyntaxError):
        pass
    _AST_CACHE[fn] = node
    return node


def _body(node: ast.FunctionDef) -> list:
    """Statements of a function without its docstring."""
    body = list(node.body)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(getattr(body[0], "value", None), ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    return body


def _signature_key(node: ast.FunctionDef) -> tuple:
    a = node.args
    return (
        tuple(x.arg for x in a.posonlyargs + a.args),
        a.vararg.arg if a.vararg else None,
        tuple(x.arg for x in a.kwonlyargs),
        a.kwarg.arg if a.kwarg else None,
        len(a.defaults),
    )


def _code_key(fn):
    """Argument names and body (no docstring, annotations, decorators or comments) of fn."""
    node = _function_node(fn)
    if node is None:
        return None
    return _signature_key(node), tuple(ast.dump(s, annotate_fields=False) for s in _body(node))


def _same_code(fn, ref) -> bool:
    if fn is ref:
        return True
    a = _code_key(fn)
    return a is not None and a == _code_key(ref)


_CLASS_CACHE: dict = {}


def _class_matches(cls, ref_fn) -> bool:
    """cls.forward is ref_fn or a copy of it (cached per class)."""
    key = (cls, ref_fn)
    ok = _CLASS_CACHE.get(key)
    if ok is None:
        ok = _CLASS_CACHE[key] = _same_code(cls.forward, ref_fn)
    return ok


def _is_llama_rmsnorm(m) -> bool:
    return (
        isinstance(getattr(m, "weight", None), torch.Tensor)
        and hasattr(m, "variance_epsilon")
        and _class_matches(type(m), modeling_llama.LlamaRMSNorm.forward)
    )


def _is_llama_mlp(m) -> bool:
    return all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) and _class_matches(
        type(m), modeling_llama.LlamaMLP.forward
    )


def _is_plain_silu(act) -> bool:
    """act computes silu(x) and nothing else (no hooks, no instance forward)."""
    return type(act) in (SiLUActivation, torch.nn.SiLU) and "forward" not in act.__dict__ and not _has_hooks(act)


_LAYER_PLAN_CACHE: dict = {}

# The pre-norm decoder layer, statement by statement; None marks the attention call, checked apart.
_LAYER_STATEMENTS = (
    "residual = hidden_states",
    "hidden_states = self.input_layernorm(hidden_states)",
    None,
    "hidden_states = residual + hidden_states",
    "residual = hidden_states",
    "hidden_states = self.post_attention_layernorm(hidden_states)",
    "hidden_states = self.mlp(hidden_states)",
    "hidden_states = residual + hidden_states",
    "return hidden_states",
)


def _decoder_layer_plan(cls) -> Optional[tuple]:
    """Names of cls.forward's positional parameters (after self) if its body is exactly Llama's pre-norm
    decoder layer, with every parameter handed on unchanged to self.self_attn; else None.

    Checked on the installed source, so a transformers release that changes the layer (a tuple return
    value, another residual scheme) is left alone instead of being replaced by a wrong copy.
    """
    plan = _LAYER_PLAN_CACHE.get(cls, _MISSING)
    if plan is not _MISSING:
        return plan
    plan = None
    node = _function_node(cls.forward)
    if node is not None:
        plan = _match_layer(node)
    _LAYER_PLAN_CACHE[cls] = plan
    return plan


def _match_layer(node: ast.FunctionDef) -> Optional[tuple]:
    a = node.args
    names = [x.arg for x in a.args]
    if a.posonlyargs or a.vararg or a.kwonlyargs or len(names) < 2 or names[1] != "hidden_states":
        return None
    var_kw = a.kwarg.arg if a.kwarg else None
    body = _body(node)
    if len(body) != len(_LAYER_STATEMENTS):
        return None
    for stmt, want in zip(body, _LAYER_STATEMENTS):
        if want is not None:
            if ast.unparse(stmt) != want:
                return None
            continue
        # hidden_states, _ = self.self_attn(hidden_states=hidden_states, p=p, ..., **kwargs)
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            return None
        if ast.unparse(stmt.targets[0]).strip("()") != "hidden_states, _":
            return None
        call = stmt.value
        if not isinstance(call, ast.Call) or ast.unparse(call.func) != "self.self_attn" or call.args:
            return None
        passed = set()
        for kw in call.keywords:
            if not isinstance(kw.value, ast.Name):
                return None
            if kw.arg is None:
                if var_kw is None or kw.value.id != var_kw:
                    return None
            elif kw.arg != kw.value.id or kw.arg not in names[1:]:
                return None
            passed.add(kw.arg)
        if "hidden_states" not in passed or not set(names[2:]) <= passed:
            return None
        if var_kw is not None and None not in passed:
            return None
    return tuple(names[1:])


def _is_llama_decoder_layer(m) -> bool:
    return all(hasattr(m, a) for a in ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")) and (
        _decoder_layer_plan(type(m)) is not None
    )


def _original_rope_function(fn):
    """The function a rope dispatcher stands in for (fn itself when it is not a dispatcher)."""
    return getattr(fn, "_rtk_original", fn)


_ROPE_SITE_CACHE: dict = {}


def _rope_site(cls) -> Optional[dict]:
    """The globals dict through which cls.forward calls apply_rotary_pos_emb, if that function (and the
    rotate_half it calls) is Llama's or a copy of it; else None. Cached per class."""
    site = _ROPE_SITE_CACHE.get(cls, _MISSING)
    if site is _MISSING:
        site = _ROPE_SITE_CACHE[cls] = _find_rope_site(cls)
    return site


def _find_rope_site(cls) -> Optional[dict]:
    fwd = inspect.unwrap(cls.forward)
    code = getattr(fwd, "__code__", None)
    g = getattr(fwd, "__globals__", None)
    if code is None or g is None or _ROPE_NAME not in code.co_names:
        return None
    fn = _original_rope_function(g.get(_ROPE_NAME))
    ref = _original_rope_function(modeling_llama.apply_rotary_pos_emb)
    if not callable(fn) or not _same_code(fn, ref):
        return None
    fn_globals = getattr(inspect.unwrap(fn), "__globals__", {})
    rot = fn_globals.get("rotate_half")
    if rot is None or not _same_code(rot, modeling_llama.rotate_half):
        return None
    node = _function_node(ref)
    if node is None or _signature_key(node)[0] != ("q", "k", "cos", "sin", "unsqueeze_dim"):
        return None  # the dispatcher below has this signature
    return g


_NUMERICS_OK: dict = {}  # the probe's result once it ran ({} before): replaced whole, never filled in place
_NUMERICS_LOCK = threading.Lock()


def _llama_numerics_ok() -> dict:
    """Run transformers' (unpatched) Llama RMSNorm and RoPE once on small CPU tensors against the math
    the kernels implement. {'rmsnorm': bool, 'rope': bool}; cached. Several threads: one probes, the
    others wait for its result (a caller never sees it half-filled)."""
    global _NUMERICS_OK
    result = _NUMERICS_OK
    if result:
        return result
    with _NUMERICS_LOCK:
        if not _NUMERICS_OK:
            _NUMERICS_OK = _probe_llama_numerics()
        return _NUMERICS_OK


def _probe_llama_numerics() -> dict:
    result = {}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad(), torch.device("cpu"):  # whatever device context the caller is in
        # RMSNorm: bit-identical in bf16, which tells the two rounding conventions apart.
        norm = modeling_llama.LlamaRMSNorm(48, eps=1e-5).to(torch.bfloat16)
        norm.weight.copy_(1 + torch.randn(48, generator=g))
        x = torch.randn(6, 48, generator=g).to(torch.bfloat16)
        got = modeling_llama.LlamaRMSNorm.forward(norm, x)
        want = rmsnorm.rms_norm_ref(x, norm.weight, 1e-5, cast_before_weight=True)
        result["rmsnorm"] = bool(got.dtype == want.dtype and torch.equal(got, want))
        # RoPE: the rotate-half formula, in float64.
        q = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
        k = torch.randn(1, 1, 5, 8, generator=g, dtype=torch.float64)
        cos = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
        sin = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
        try:
            fq, fk = _original_rope_function(modeling_llama.apply_rotary_pos_emb)(q, k, cos, sin)
            ok = torch.allclose(fq, rope_kernels.rope_rotate_half_ref(q, cos, sin), rtol=1e-12, atol=1e-12)
            ok = ok and torch.allclose(fk, rope_kernels.rope_rotate_half_ref(k, cos, sin), rtol=1e-12, atol=1e-12)
        except Exception:  # a different signature or layout: not the function the kernel replaces
            ok = False
        result["rope"] = bool(ok)
    return result


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
    """LlamaRMSNorm: fp32 normalisation rounded to the input dtype, then times the weight."""
    w = self.weight
    if (
        w.dtype != hidden_states.dtype  # e.g. an fp32 weight on bf16 input: the original returns fp32
        or w.shape != hidden_states.shape[-1:]
        or hidden_states.dim() == 0
        or (hidden_states.stride(-1) != 1 and hidden_states.shape[-1] != 1)
        or not _usable(hidden_states, w)
    ):
        return _original_forward(self)(hidden_states)
    return rmsnorm.rms_norm(hidden_states, w, self.variance_epsilon, cast_before_weight=True)


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


def _fusable_norm(norm, x, residual) -> bool:
    """post_attention_layernorm(residual + x) may run as one fused kernel that skips the norm's call."""
    w = getattr(norm, "weight", None)
    if not _is_llama_rmsnorm(norm) or _has_hooks(norm):
        return False
    fwd = norm.__dict__.get("forward")
    if fwd is not None and ic.patched_function(fwd) is not _rmsnorm_forward:
        return False  # someone else's forward on the norm: let it run
    return (
        x.shape == residual.shape
        and x.dtype == residual.dtype == w.dtype
        and w.shape == x.shape[-1:]
        and x.dim() > 0
        and (x.stride(-1) == 1 or x.shape[-1] == 1)
        and (residual.stride(-1) == 1 or residual.shape[-1] == 1)
        and _usable(x, residual, w)
    )


def _decoder_layer_forward(self, *args, **kwargs):
    """The Llama decoder layer with `residual + attention` and post_attention_layernorm in one kernel.

    Same statements as transformers' layer (checked at injection by _decoder_layer_plan), same arguments
    and the same return value: every argument the caller gives is handed to self_attn by name, as the
    original does; arguments the caller leaves out keep self_attn's own defaults.
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
    for name, value in zip(names[1:], args[1:]):
        kwargs[name] = value

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
    norm = self.post_attention_layernorm
    if _fusable_norm(norm, hidden_states, residual):
        # r = residual + attn (fp32 sum rounded once: the bits torch's add gives), y = norm(r)
        hidden_states, residual = rmsnorm.fused_add_rms_norm(
            hidden_states, residual, norm.weight, norm.variance_epsilon, cast_before_weight=True
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
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if getattr(_ROPE_ACTIVE, "depth", 0) and unsqueeze_dim == 1 and _rope_usable(q, k, cos, sin):
            return rope_kernels.rope_rotate_half(q, cos, sin), rope_kernels.rope_rotate_half(k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._rtk_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


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
    """
    numerics = _llama_numerics_ok()
    new = _empty_counts()
    skipped = []
    modules = list(_modules(model))
    llama_like = False

    for m in modules:
        llama_like |= _inject_module(m, numerics, fuse_residual, rope, new, skipped)

    if skinny_gemm and llama_like:
        for m in modules:
            # plain nn.Linear only: subclasses (quantised layers, LoRA) compute something else
            if type(m) is torch.nn.Linear and _STATE not in m.__dict__:
                if _foreign_forward(m):
                    skipped.append("Linear with its own instance forward")
                else:
                    new["skinny_gemm"] += _patch_forward(m, _linear_forward, "skinny_gemm")

    counts = injected_counts(model)
    none_found = "" if llama_like else "no Llama-style RMSNorm, MLP, decoder layer or attention found"
    ic.report(
        logger,
        ic.counts_message(
            "injected Llama kernels",
            counts,
            new,
            none_found=none_found,
            skipped=skipped,
            notes=[ic.cpu_fallback_note(model, new)],
        ),
        verbose,
    )
    return counts


def _inject_module(m, numerics: dict, fuse_residual: bool, rope: bool, new: dict, skipped: list) -> bool:
    """Inject the kernel of m's kind into m, if it has one and may take it (adding to new, or to skipped with
    the reason it may not); returns whether m is a Llama-style module (patched already, or of a kind the
    injection knows, injected or not)."""
    if _STATE in m.__dict__:
        return True
    if _is_llama_rmsnorm(m):
        if not numerics["rmsnorm"]:
            skipped.append("RMSNorm (this transformers' LlamaRMSNorm numerics differ from the kernel's)")
        elif _foreign_forward(m):
            skipped.append(f"{type(m).__name__} with its own instance forward")
        else:
            new["rmsnorm"] += _patch_forward(m, _rmsnorm_forward, "rmsnorm")
    elif _is_llama_mlp(m):
        if not _is_plain_silu(m.act_fn):
            skipped.append(f"{type(m).__name__} with activation {type(m.act_fn).__name__}")
        elif _foreign_forward(m):
            skipped.append(f"{type(m).__name__} with its own instance forward")
        else:
            new["swiglu"] += _patch_forward(m, _mlp_forward, "swiglu")
    elif _is_llama_decoder_layer(m):
        if not fuse_residual:
            return True
        if not numerics["rmsnorm"] or not _is_llama_rmsnorm(m.post_attention_layernorm):
            skipped.append(f"{type(m).__name__} whose post-attention norm is not Llama's RMSNorm")
        elif _foreign_forward(m):
            skipped.append(f"{type(m).__name__} with its own instance forward")
        else:
            new["fused_add_rmsnorm"] += _patch_forward(
                m, _decoder_layer_forward, "fused_add_rmsnorm", params=_decoder_layer_plan(type(m))
            )
    elif rope and _rope_site(type(m)) is not None:
        if not numerics["rope"]:
            skipped.append("RoPE (this transformers' apply_rotary_pos_emb differs from the kernel's math)")
        elif _foreign_forward(m):
            skipped.append(f"{type(m).__name__} with its own instance forward")
        else:
            site = _rope_site(type(m))
            if _patch_forward(m, _attention_forward, "rope", site=_RopeSite(m, site)):
                _rope_acquire(m, site)
                new["rope"] += 1
    elif _rope_site(type(m)) is not None:
        pass  # an attention layer, RoPE not requested
    else:
        return False
    return True


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
    again = inject_llama_kernels(model, skinny_gemm=sg, verbose=False)
    restored = remove_llama_kernels(model, verbose=False)
    left = injected_counts(model)
    rope_restored = modeling_llama.apply_rotary_pos_emb is _original_rope_function(modeling_llama.apply_rotary_pos_emb)
    ok = counts == again == restored and not any(left.values()) and rope_restored
    print(
        json.dumps(
            {
                "architecture": f"Llama-3-8B, {args.num_layers} layers",
                "injected": counts,
                "second_injection": again,
                "restored": restored,
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

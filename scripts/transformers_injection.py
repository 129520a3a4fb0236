# SPDX-License-Identifier: Apache-2.0
"""Put the project's Triton kernels into Hugging Face transformers' decoder LLMs, and take them out again.

    counts = inject_optimized_kernels(model)  # a *ForCausalLM / *Model, or any module holding one
    model.generate(...)                       # now runs the kernels
    remove_optimized_kernels(model)           # original code back: outputs bit-identical to before

(``inject_llama_kernels`` / ``remove_llama_kernels`` are the same functions under their first names.)
Sites are recognised by what they compute, never by class name or source text, so Llama and its copies
(Mistral, Qwen2), Qwen3, Gemma 2 / 3, Phi-3, Mixtral, Qwen3-MoE, OLMo 2 and rewrites of them are served by
one set of probes. What is replaced, per kind:

* ``rmsnorm``: every RMSNorm module (the decoder layers' norms, the final norm, per-head q/k norms of
  Qwen3 / Gemma 3 and OLMo 2's q/k norms across heads) -> ``rmsnorm.rms_norm`` with the module's
  numerics, as its probe found them: the weight as stored (Llama) or as ``1 + weight`` in fp32 (Gemma),
  rounded to the input dtype before the weight multiply (Llama) or once at the end (Gemma, OLMo 2).
  Gemma's ``1 + weight`` is computed once and kept while the weight is unchanged (no launch per call).
* ``fused_add_rmsnorm``: a decoder layer in which a residual add is followed by a norm: ``residual +
  attention output`` and the norm in front of the MLP become one ``rmsnorm.fused_add_rms_norm`` call
  (Llama's post_attention_layernorm; in Gemma's sandwich layer, the add of the post-attention norm's
  output and pre_feedforward_layernorm). OLMo 2's post-norm layer adds after its norms and has no such
  pair: it is no site of this kind.
* ``swiglu``: gated MLPs with SiLU -> ``activations.swiglu``: two projections (Llama: gate_proj, up_proj)
  or one fused gate/up projection split in halves (Phi-3's gate_up_proj, gate first).
* ``geglu``: gated MLPs with tanh GELU -> ``activations.gelu_mul(gate, up)`` for two projections (Gemma 2 /
  3: gate_proj, up_proj) or ``activations.geglu`` for a fused [up | gate] projection. A fused projection
  with the gate first has no kernel: left to PyTorch, named in the log line and by ``kernel_gaps``.
* ``moe_swiglu``: the SwiGLU of MoE experts (Mixtral, Qwen3-MoE) -> ``activations.swiglu`` on the fused
  [gate | up] output. transformers' grouped_mm / batched_mm / deepgemm expert implementations (grouped_mm
  is the default) call the experts module's ``_apply_gate`` on that output; the injection puts the
  kernel there, per instance. The 'eager' loop computes ``act_fn(gate) * up`` inline and keeps PyTorch's.
* ``rope``: the attention layers' ``apply_rotary_pos_emb(q, k, cos, sin)`` -> ``rope.rope_rotate_half``
  for q and for k (with partial rotary, Phi-3 style, the first channels, the rest passed through; with
  tables of one value per channel pair, GPT-OSS style, read as they are).
* ``skinny_gemm`` (only with ``skinny_gemm=True``): every ``nn.Linear`` -> ``skinny_gemm.skinny_gemm``
  when the input has at most 32 rows (decoding) in fp16/bf16; larger inputs (the prefill) keep nn.Linear.

Not fused, and why: the MLP's residual add with the next layer's first norm (layers hand a single tensor to
each other through the model's forward, which also records it for ``output_hidden_states``); a norm
followed by the residual add (Gemma's post-attention / post-feedforward norms, OLMo 2's post-norms): no
kernel computes ``residual + rms_norm(x)``; per-head q/k RMSNorm + RoPE in one launch (Qwen3, Gemma 3):
head_norm_rope.py rotates interleaved pairs, transformers rotates halves, so the norms and the RoPE run
their own kernels.

How a site is recognised: each candidate class's forward is run once on small CPU tensors in a stand-in
instance (probe parameters and submodules, the real module's plain settings) and compared with the
kernels' math. An RMSNorm bit for bit in bf16 against each numerics variant (weight or 1 + weight, where
it rounds, which dtype it returns for an fp32 weight). An MLP in float64 with probe linears and a probe
nonlinearity in place of its activation, on rows at 1, 30 and 1000 scale so that a clamp shows (which
projection is the gate, whether a fused projection puts the gate first), its activation module apart on float64 inputs (SiLU, tanh GELU). A decoder layer in
float64 with distinct probe maps for its norms, attention and MLP, which tells where each norm sits
around the two residual adds (pre-norm, sandwich, post-norm) and that every argument reaches self_attn
unchanged. An experts module's ``_apply_gate`` like an MLP's activation. The model file's
``apply_rotary_pos_emb`` on float64 tensors against the rotate-half formula (full, partial and half-width
tables). A decoder layer whose MLP returns (output, router scores) and keeps the output (GPT-OSS) is one too.
A site whose function differs is left untouched and the log line names it and why; a kind the model
has sites of (by structure: a norm with a weight and an eps, a gated MLP, a decoder layer with a norm after
a residual add, an experts module, an attention calling ``apply_rotary_pos_emb``) but none replaced makes
the log line a warning and ``missing_kinds(model)`` returns it; sites computing a known function the bundle
has no kernel for are ``kernel_gaps(model)``; ``coverage(model)`` counts sites and replacements per kind.

Patching is per instance (``module.forward`` set on the instance; the classes and other models are
untouched). RoPE is a module-level function in transformers. With the kernels package (a dependency from
transformers 5.25) that function routes each attention layer's calls to the layer's own copy of it, and the
kernel goes into the copies of the patched layers: nothing global changes. Without it (and for model files
whose function is not routed, Phi-3's and OLMo 2's), a dispatcher takes the function's place in the model
file while any attention layer of it is patched: it runs the kernel only inside a patched attention layer
and calls the original function everywhere else. A layer to which ``kernels.kernelize`` gave a hub kernel
keeps it. Every patched forward reads its parameters when it runs and falls back to the original code for
inputs the kernels do not cover: autograd (the kernels have no backward), gradient checkpointing, tensors
on a device the kernels cannot use (CPU without TRITON_INTERPRET=1, meta), dtype mixes the probe did not
find the module to keep, unusual layouts, active dropout, and modules that carry hooks the fused path would
skip. Injecting twice changes nothing; removal restores the original forwards and function. An injected
model survives ``copy.deepcopy`` and ``torch.save`` / ``torch.load(..., weights_only=False)`` (where this
file is importable under the same name).

Decode speed: batch-1 decoding is host-bound, so no patched path launches more than the code it replaces
(each kernel stands for several PyTorch ops; Gemma's ``1 + weight`` is cached).

``count_kernel_calls()`` counts the kernel calls made inside a ``with`` block. Also here:
``tiny_llama_config``, ``llama3_8b_config``, ``build_llama`` and ``build_meta_llama``; other families'
configs (tiny ones and the released architectures' numbers) are in transformers_families.py.
``python transformers_injection.py`` reports the counts for an architecture built on the meta device (no
memory, no weights); ``--coverage`` prints the sites found / replaced per family.
"""

from __future__ import annotations

import collections
import contextlib
import dis
import importlib
import inspect
import itertools
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

import activations  # noqa: E402
import injection_common as ic  # noqa: E402
import moe_experts  # noqa: E402
import rmsnorm  # noqa: E402
import rope as rope_kernels  # noqa: E402  (the name `rope` is an argument of inject_optimized_kernels)
import skinny_gemm as skinny_kernels  # noqa: E402
import transformers_families as tf  # noqa: E402

__all__ = [
    "inject_optimized_kernels",
    "remove_optimized_kernels",
    "inject_llama_kernels",
    "remove_llama_kernels",
    "injected_counts",
    "count_kernel_calls",
    "missing_kinds",
    "kernel_gaps",
    "coverage",
    "layer_form",
    "KINDS",
    "tiny_llama_config",
    "llama3_8b_config",
    "build_llama",
    "build_meta_llama",
]

logger = logging.getLogger("transformers_injection")

KINDS = ("rmsnorm", "fused_add_rmsnorm", "swiglu", "geglu", "moe_swiglu", "rope", "skinny_gemm")

_STATE = ic.register_state_key("_rtk_llama_injection")  # per-module record of what was patched and how to undo it
_HALF = (torch.float16, torch.bfloat16)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ROPE_NAME = "apply_rotary_pos_emb"
_DROPOUT = torch.nn.modules.dropout._DropoutNd


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


def _plain(m: torch.nn.Module) -> bool:
    """Calling m runs its class's forward and nothing else (no instance forward, no hooks)."""
    return "forward" not in m.__dict__ and not _has_hooks(m)


def _two_level(x: torch.Tensor) -> bool:
    """Whether the row kernels address x's rows in place: its leading dims in at most two stride levels
    ([B, S, D], a view of a projection as [B, S, H, D]; not its [B, H, S, D] transpose, which needs three)."""
    lead = [(n, st) for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n != 1]
    return sum(lead[i][1] != lead[i + 1][0] * lead[i + 1][1] for i in range(len(lead) - 1)) <= 1


def _rowwise(fn, x: torch.Tensor, *args, **kwargs):
    """fn(x, ...) for a row kernel (over the last dim): rows it reads in place are read so; a dense x in
    another dim order (q.view(B, S, H, D).transpose(1, 2), as Gemma 3 normalises it) through its contiguous
    permutation, the result put back in x's order (the layout PyTorch's elementwise ops give). None for any
    other x (the caller runs the original code: no copy is made)."""
    if x.dim() == 0 or (x.stride(-1) != 1 and x.shape[-1] != 1):
        return None
    if _two_level(x):
        return fn(x, *args, **kwargs)
    rows = ic.memory_order(x)
    if rows is None:
        return None
    view, back = rows
    return fn(view, *args, **kwargs).permute(back)


# --------------------------------------------------------------------------------------------
# Recognising what a module computes
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
_PROBES: dict = {}  # (probe name, class, settings, extra) -> a dict when recognised, else the reason (str)
_PROBE_LOCK = threading.RLock()


class _Gap(str):
    """A reason a site is left alone that names a known function the bundle has no kernel for (not a
    difference from what the kernels compute): kernel_gaps, not missing_kinds."""


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


def _probe(name: str, m, run, extra=()):
    """run(m) once per (name, class of m, plain settings of m, extra); its result is cached. A forward that
    raises on the stand-in is not recognised (the reason names the exception)."""
    key = (name, type(m), _settings(m), extra)
    result = _PROBES.get(key, _MISSING)
    if result is not _MISSING:
        return result
    with _PROBE_LOCK:
        result = _PROBES.get(key, _MISSING)
        if result is _MISSING:
            try:
                # whatever device and autocast (thread-local) the caller is in: the probes compute as written (they
                # give their tensors' dtypes: the default dtype is process-wide, not theirs to set)
                with torch.no_grad(), torch.device("cpu"), torch.autocast("cpu", enabled=False):
                    result = run(m)
            except Exception as e:  # the forward does not run on the stand-in: not what the kernel replaces
                result = f"{type(m).__name__}.forward did not run on probe inputs ({type(e).__name__}: {e})"
            _PROBES[key] = result
    return result


def _close(a, b) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and a.shape == b.shape
        and a.dtype == b.dtype
        and torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    )


def _eps_name(m) -> Optional[str]:
    for name in ("variance_epsilon", "eps"):
        if type(m.__dict__.get(name)) is float:
            return name
    return None


def _norm_structure(m) -> bool:
    """m looks like an RMSNorm: a 1-d weight, a float eps (variance_epsilon or eps), no bias. What it
    computes is the probe's business (_rmsnorm_probe)."""
    w = m.__dict__.get("_parameters", {}).get("weight")
    return (
        not isinstance(m, torch.nn.LayerNorm)  # (a LayerNorm without bias has the same parts)
        and isinstance(w, torch.Tensor)
        and w.dim() == 1
        and _eps_name(m) is not None
        and not isinstance(getattr(m, "bias", None), torch.Tensor)
    )


def _rmsnorm_probe(m):
    """{'eps': attribute name, 'offset': 0.0 or 1.0, 'cast_before_weight': bool, 'mixed': bool} if
    type(m).forward is an RMSNorm over the last dim that rms_norm computes bit for bit in bf16 with weight
    (offset 0: Llama, OLMo 2) or 1 + weight in fp32 (offset 1: Gemma), rounded to the input dtype before the
    weight multiply (Llama) or after it. 'mixed': with an fp32 weight on bf16 input it returns bf16 with
    the same numerics (Gemma, OLMo 2; Llama's returns fp32 then, as type promotion has it)."""
    try:
        extra = list(inspect.signature(type(m).forward).parameters)[2:]
    except (TypeError, ValueError):
        extra = []
    if extra:  # e.g. Falcon-H1's gated norm, norm(x, gate): the kernel computes the call without them only
        return f"{type(m).__name__}.forward takes more than the input ({', '.join(extra)}): not a plain RMSNorm"
    eps_name = _eps_name(m)
    eps = m.__dict__[eps_name]
    g = torch.Generator().manual_seed(0)
    weight = (1 + torch.randn(48, generator=g)).to(torch.bfloat16)
    # inputs of the size of sqrt(eps), so that a forward using another eps (or none) differs too
    x = (torch.randn(6, 48, generator=g) * (3 * max(eps, 1e-12) ** 0.5)).to(torch.bfloat16)

    # torch.nn.RMSNorm's normalized_shape (a tuple: not a plain setting the stand-in copies) at the probe's width
    shape = {"normalized_shape": (48,)} if isinstance(getattr(m, "normalized_shape", None), tuple) else {}

    def run(w):
        return type(m).forward(_stand_in(m, weight=torch.nn.Parameter(w, requires_grad=False), **shape), x)

    got = run(weight)
    for offset, cast in itertools.product((0.0, 1.0), (True, False)):
        eff = 1.0 + weight.float() if offset else weight
        want = rmsnorm.rms_norm_ref(x, eff, eps, cast_before_weight=cast)
        if isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want):
            w32 = weight.float()
            mixed = run(w32)
            want32 = rmsnorm.rms_norm_ref(x, 1.0 + w32 if offset else w32, eps, cast_before_weight=cast)
            same = isinstance(mixed, torch.Tensor) and mixed.dtype == x.dtype and torch.equal(mixed, want32)
            return {"eps": eps_name, "offset": offset, "cast_before_weight": cast, "mixed": same}
    return (
        f"{type(m).__name__}.forward computes another function than the RMSNorm kernel "
        "(weight or 1 + weight times the normalised x)"
    )


# Activations an MLP may hand its gate to, by what they compute on float64 inputs.
_ACTIVATIONS = (
    ("silu", torch.nn.functional.silu),
    ("gelu_tanh", lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    ("gelu", torch.nn.functional.gelu),
)


def _activation(act) -> Optional[str]:
    """What the activation module act computes ('silu', 'gelu_tanh', 'gelu'), from its class's forward on
    float64 inputs (per instance: some hold the function they call), or None."""
    if not isinstance(act, torch.nn.Module) or "forward" in act.__dict__:
        return None
    x = torch.linspace(-6.0, 6.0, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = type(act).forward(act, x)
    except Exception:
        return None
    for name, fn in _ACTIVATIONS:
        if _close(y, fn(x)):
            return name
    return None


def _probe_nonlinearity(x):
    """Stands in for an activation in the MLP probes: no symmetry that would hide swapped operands."""
    return torch.sin(x) + 0.125 * x * x


class _ProbeMap(torch.nn.Module):
    """Stands in for a norm, an MLP or an activation: a function of its input; records its inputs."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.inputs = []

    def forward(self, x):
        self.inputs.append(x)
        return self.fn(x)


def _probe_linear(g, i, o):
    lin = torch.nn.Linear(i, o, dtype=torch.float64)
    lin.weight.copy_(torch.randn(o, i, generator=g, dtype=torch.float64))
    lin.bias.copy_(torch.randn(o, generator=g, dtype=torch.float64))
    return lin


def _linear_dims(c):
    i, o = getattr(c, "in_features", None), getattr(c, "out_features", None)
    return (i, o) if type(i) is int and type(o) is int else None


def _mlp_structure(m):
    """(linears [(name, (in, out))], activation name) if m is built like a gated MLP: two or three linear
    layers and one parameter-free activation module; else None."""
    lin, rest = [], []
    for name, c in m.named_children():
        dims = _linear_dims(c)
        (lin if dims else rest).append((name, c, dims))
    if len(lin) not in (2, 3) or len(rest) != 1:
        return None
    act_name, act, _ = rest[0]
    if next(act.parameters(), None) is not None or next(act.children(), None) is not None:
        return None
    return tuple((n, d) for n, _, d in lin), act_name


def _mlp_probe(m):
    """How type(m).forward computes down(act(gate) * up), if it does (float64, probe linears and a probe
    nonlinearity as the activation): {'form': 'split', 'gate', 'up', 'down': names} for two projections,
    {'form': 'fused', 'gate_up', 'down': names, 'gate_first': bool} for one projection split in halves;
    'act': the activation's name. Else the reason."""
    lin, act_name = _mlp_structure(m)
    g = torch.Generator().manual_seed(1)
    # rows of unit, x30 and x1000 scale: a clamp of the gate or up (swiglu limits of 7-50: DeepSeek-V4's MLP,
    # BailingHybrid's) computes another function
    x = torch.randn(3, 8, generator=g, dtype=torch.float64) * torch.tensor(
        [[1.0], [30.0], [1000.0]], dtype=torch.float64
    )
    act = _ProbeMap(_probe_nonlinearity)
    found = []

    def run(**parts):
        try:
            return type(m).forward(_stand_in(m, **parts, **{act_name: act}), x)
        except Exception:  # the projections in other roles do not fit together
            return None

    if len(lin) == 3:
        for (gn, gd), (un, ud), (dn, dd) in itertools.permutations(lin):
            if not (gd == ud and gd[0] == dd[1] and gd[1] == dd[0]):
                continue
            gate, up, down = _probe_linear(g, 8, 12), _probe_linear(g, 8, 12), _probe_linear(g, 12, 8)
            if _close(run(**{gn: gate, un: up, dn: down}), down(_probe_nonlinearity(gate(x)) * up(x))):
                found.append({"form": "split", "gate": gn, "up": un, "down": dn, "act": act_name})
    else:
        for (fn_, fd), (dn, dd) in itertools.permutations(lin):
            if not (fd[1] == 2 * dd[0] and fd[0] == dd[1]):
                continue
            gate_up, down = _probe_linear(g, 8, 24), _probe_linear(g, 12, 8)
            got = run(**{fn_: gate_up, dn: down})
            first, second = gate_up(x).chunk(2, dim=-1)
            for gate_first in (True, False):
                gate, up = (first, second) if gate_first else (second, first)
                if _close(got, down(_probe_nonlinearity(gate) * up)):
                    found.append(
                        {"form": "fused", "gate_up": fn_, "down": dn, "gate_first": gate_first, "act": act_name}
                    )
    if len(found) != 1:
        return f"{type(m).__name__}.forward computes another function than down_proj(act(gate) * up)"
    return found[0]


def _experts_structure(m) -> Optional[str]:
    """The activation's name if m is built like transformers' MoE experts module: its class has
    _apply_gate (called by the grouped_mm / batched_mm implementations on the fused gate/up output) and m
    holds one parameter-free module, the activation; else None."""
    if not callable(getattr(type(m), "_apply_gate", None)):
        return None
    kids = list(m.named_children())
    if len(kids) != 1 or next(kids[0][1].parameters(), None) is not None:
        return None
    return kids[0][0]


def _experts_like(m) -> bool:
    """m holds MoE experts as transformers builds them: its class has _apply_gate and m a 3-d gate_up_proj."""
    w = getattr(m, "gate_up_proj", None)
    return callable(getattr(type(m), "_apply_gate", None)) and isinstance(w, torch.Tensor) and w.dim() == 3


def _experts_probe(m):
    """{'act': name, 'gate_first': bool} if type(m)._apply_gate(y) computes act(gate) * up of y's two
    halves (float64, a probe nonlinearity as the activation); else the reason."""
    act_name = _experts_structure(m)
    probe = _stand_in(m, **{act_name: _ProbeMap(_probe_nonlinearity)})
    # rows of unit, x30 and x1000 scale: a clamp of the gate or up (swiglu limits of 7-30) computes another function
    y = torch.randn(3, 24, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    y = y * torch.tensor([[1.0], [30.0], [1000.0]], dtype=torch.float64)
    got = type(m)._apply_gate(probe, y)
    first, second = y.chunk(2, dim=-1)
    for gate_first in (True, False):
        gate, up = (first, second) if gate_first else (second, first)
        if _close(got, _probe_nonlinearity(gate) * up):
            return {"act": act_name, "gate_first": gate_first}
    return f"{type(m).__name__}._apply_gate computes another function than act(gate) * up"


def _experts_decode_probe(m, act_name: str, gate_first: bool):
    """{'decode': True} if m's forward (the experts implementation its config names) computes, for x [T, H],
    sum_k w[t, k] * down_proj[e] @ (act(gate) * up)(gate_up_proj[e] @ x[t]), e = top_k_index[t, k], with
    gate_up_proj [E, 2 I, H] and down_proj [E, H, I]: what moe_experts computes at decode. Else the reason.
    In float32 on small random weights (transformers' grouped_mm takes no float64), tokens of 0.1, 3 and 100 scale
    (a clamped SwiGLU shows at the large ones): another function differs by order 1, float32 rounding by 1e-6."""
    e = getattr(m, "gate_up_proj", None)
    if not isinstance(e, torch.Tensor) or e.dim() != 3 or getattr(getattr(m, "down_proj", None), "dim", int)() != 3:
        return f"{type(m).__name__} holds no [E, 2 I, H] gate_up_proj and [E, H, I] down_proj"
    n_exp, h, i = e.shape[0], 32, 8  # rows of 16-byte multiples (grouped_mm requires them); H != 2 I
    g = torch.Generator().manual_seed(5)
    private = {k: v for k, v in m.__dict__.items() if type(v) in _PLAIN and k.startswith("_")}  # _is_expert_parallel
    dims = {k: v for k, v in (("hidden_dim", h), ("intermediate_dim", i)) if k in m.__dict__}
    gate_up = torch.nn.Parameter(torch.randn(n_exp, 2 * i, h, generator=g, dtype=torch.float32), requires_grad=False)
    down = torch.nn.Parameter(torch.randn(n_exp, h, i, generator=g, dtype=torch.float32) / 3, requires_grad=False)
    probe = _stand_in(m, gate_up_proj=gate_up, down_proj=down, config=getattr(m, "config", None), **private, **dims,
                      **{act_name: getattr(m, act_name)})  # fmt: skip
    scale = torch.tensor([[0.1], [3.0], [100.0]], dtype=torch.float32)  # gate / up up to ~1e3 (clamps show)
    x = torch.randn(3, h, generator=g, dtype=torch.float32) * scale
    idx = torch.tensor([[0, n_exp - 1], [n_exp - 1, n_exp // 2], [n_exp // 2, 0]])
    w = torch.rand(3, 2, generator=g, dtype=torch.float32)
    got = probe(x, idx, w)
    ref = moe_experts.moe_swiglu_experts_ref(x, idx, w, gate_up, down, gate_first)
    ok = isinstance(got, torch.Tensor) and got.shape == ref.shape and got.dtype == ref.dtype
    if ok and all(torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max())) for a, b in zip(got, ref)):
        return {"decode": True}  # (each token's row to its own scale)
    return f"{type(m).__name__}.forward computes another function than the routed experts' SwiGLU MLPs"


class _ProbeAttention(torch.nn.Module):
    """Stands in for a decoder layer's self_attn: records how it is called, returns (3 h + 1/4, None)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        h = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        return h * 3 + 0.25, None


def _affine(c: float, d: float):
    return lambda x: x * c + d


def _residual_slots(x, attn_in, mlp_in, out, fns: dict):
    """Where the layer's norms sit around its two residual adds, from what its probe parts received:
        h = x + post_a(self_attn(pre_a(x)));  out = h + post_m(mlp(pre_m(h)))
    fns: {norm name: its probe map}; a slot holds a norm name or None (no norm there). Returns the tuple
    (pre_a, post_a, pre_m, post_m), or the reason when the layer computes something else."""
    ident = {None: lambda t: t, **fns}

    def distinct(*names):
        used = [n for n in names if n is not None]
        return len(used) == len(set(used))

    pre_a = [n for n, f in ident.items() if _close(f(x), attn_in)]
    if len(pre_a) != 1:
        return "the attention's input is not the layer's input or one norm of it"
    pre_a = pre_a[0]
    a = attn_in * 3 + 0.25  # what the probe attention returned
    pairs = [
        (pa, pm)
        for pa in ident
        for pm in ident
        if distinct(pre_a, pa, pm) and _close(ident[pm](x + ident[pa](a)), mlp_in)
    ]
    if len(pairs) != 1:
        return "the MLP's input is not (a norm of) the layer's input plus (a norm of) the attention's output"
    post_a, pre_m = pairs[0]
    h = x + ident[post_a](a)
    m_out = torch.sin(mlp_in)  # what the probe MLP returned
    posts = [n for n in ident if distinct(pre_a, post_a, pre_m, n) and _close(h + ident[n](m_out), out)]
    if len(posts) != 1:
        return "the output is not that sum plus (a norm of) the MLP's output"
    return pre_a, post_a, pre_m, posts[0]


def _layer_structure(m):
    """(norm child names, dropout child names) if m is built like a decoder layer: self_attn and mlp
    children, at least one norm child (_norm_structure), and nothing else but dropouts; else None."""
    kids = dict(m.named_children())
    if not isinstance(kids.get("self_attn"), torch.nn.Module) or not isinstance(kids.get("mlp"), torch.nn.Module):
        return None
    others = {n: c for n, c in kids.items() if n not in ("self_attn", "mlp")}
    norms = tuple(n for n, c in others.items() if _norm_structure(c))
    dropouts = tuple(n for n, c in others.items() if isinstance(c, _DROPOUT))
    if not norms or len(norms) + len(dropouts) != len(others):
        return None
    return norms, dropouts


def _decoder_layer_probe(m):
    """How type(m).forward calls its parts, if it is a residual decoder layer
        h = x + post_a(self_attn(pre_a(x))[0]);  out = h + post_m(mlp(pre_m(h)))
    with each of pre_a, post_a, pre_m, post_m one of its norms or nothing (Llama: input_layernorm and
    post_attention_layernorm before the two blocks; Gemma: all four; OLMo 2: post_a and post_m), dropouts
    (Phi-3's) as identities (the patched forward runs only while they are), handing every argument it
    takes on to self_attn unchanged, by name (checked with probe parts and sentinel arguments); an MLP that
    returns a pair (output, router scores) of which the layer keeps the output (GPT-OSS's) too. Returns
    {'params': names of its positional parameters, hidden states first, 'hidden_key': the keyword
    self_attn gets its input by, 'defaults': what self_attn gets for the parameters a caller leaves out,
    'pre_a', 'post_a', 'pre_m', 'post_m': norm names or None, 'dropouts': names, 'mlp_pair': bool}."""
    found = _decoder_layer_calls(m, mlp_pair=False)
    if isinstance(found, str):
        try:
            pair = _decoder_layer_calls(m, mlp_pair=True)
        except Exception:  # a layer that uses its MLP's output as one tensor: the first reason stands
            return found
        if isinstance(pair, str):  # the first reason, unless a pair-returning MLP got as far as its second item
            return pair if "second output" in pair else found
        return pair
    return found


def _decoder_layer_calls(m, mlp_pair: bool):
    """_decoder_layer_probe with the probe MLP returning one tensor, or (mlp_pair) a pair whose second item the
    layer must neither use (an object that is no tensor) nor keep (its reference count after the call)."""
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
    norms, dropouts = _layer_structure(m)
    maps = {n: _ProbeMap(_affine(1.5 + 0.25 * i, 0.5 - 0.375 * i)) for i, n in enumerate(norms)}
    attn = _ProbeAttention()
    marker = object()  # the second output of a pair-returning MLP (GPT-OSS's router scores)
    mlp = _ProbeMap((lambda t: (torch.sin(t), marker)) if mlp_pair else torch.sin)
    probe = _stand_in(m, self_attn=attn, mlp=mlp, **maps, **{n: torch.nn.Identity() for n in dropouts})
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    sentinels = {name: object() for name in positional[1:]}
    # parameters without a default (Qwen3-Next's, VaultGemma's position_embeddings): given in both runs
    required = tuple(p.name for p in params[1:] if p.kind == p.POSITIONAL_OR_KEYWORD and p.default is p.empty)
    extra = {"rtk_probe_extra": object()} if var_kw else {}
    runs = []
    kept = sys.getrefcount(marker)
    for given in ({n: sentinels[n] for n in required}, {**sentinels, **extra}):
        attn.calls.clear()
        for p in (mlp, *maps.values()):
            p.inputs.clear()
        out = type(m).forward(probe, x, **given)
        if len(attn.calls) != 1 or len(mlp.inputs) != 1 or not isinstance(out, torch.Tensor):
            return f"{type(m).__name__}.forward does not call self_attn and mlp once each and return one tensor"
        if sys.getrefcount(marker) != kept:
            return f"{type(m).__name__}.forward keeps its MLP's second output (the kernel path would drop it)"
        args, kwargs = attn.calls[0]
        hidden = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        if args or len(hidden) != 1:
            return f"{type(m).__name__}.forward does not call self_attn with its arguments by keyword"
        slots = _residual_slots(x, kwargs[hidden[0]], mlp.inputs[0], out, {n: p.fn for n, p in maps.items()})
        if isinstance(slots, str):
            return f"{type(m).__name__}.forward computes another function than a residual decoder layer ({slots})"
        if any(len(maps[n].inputs) != slots.count(n) for n in norms):
            return f"{type(m).__name__}.forward calls a norm outside its residual structure"
        runs.append((hidden[0], {k: v for k, v in kwargs.items() if k != hidden[0]}, slots))
    (hidden_key, defaults, slots), (key2, passed, slots2) = runs
    if key2 != hidden_key or slots2 != slots or passed != {**sentinels, **extra} or set(defaults) != set(sentinels):
        return f"{type(m).__name__}.forward does not hand each of its arguments on to self_attn unchanged"
    given_values = [sentinels[n] for n in required]
    if any(v is s for n, v in defaults.items() if n not in required for s in given_values):
        # an optional argument that falls back to a required one: no default to record for it
        return f"{type(m).__name__}.forward derives an optional argument from a required one"
    pre_a, post_a, pre_m, post_m = slots
    return {
        "params": tuple(positional),
        "required": required,
        "hidden_key": hidden_key,
        "defaults": {k: v for k, v in defaults.items() if k not in required},
        "pre_a": pre_a,
        "post_a": post_a,
        "pre_m": pre_m,
        "post_m": post_m,
        "dropouts": dropouts,
        "mlp_pair": mlp_pair,
    }


def _rope_probe(fn):
    """(ok, partial, mixed, half) for fn(q, k, cos, sin): ok, it is transformers' rotate-half RoPE of q and k
    (float64, q and k [B, H, S, D], cos and sin [B, S, D], or [B, S, D / 2] where half); partial, it also rotates
    only the first cos.shape[-1] channels and passes the rest when cos is narrower than the head, as Phi-3's does;
    mixed, with fp16 / bf16 q and k and fp32 cos and sin it returns q's dtype with fp32 math rounded once, what
    the kernel computes (OLMo 2's casts back; Llama's returns fp32 there); half, its tables hold one value per
    channel pair (c, c + D / 2), as GPT-OSS's do (x1 * cos - x2 * sin, x2 * cos + x1 * sin). Cached per
    function."""
    key = ("rope", id(fn))
    hit = _PROBES.get(key)
    if hit is not None and hit[0] is fn:
        return hit[1:]
    g = torch.Generator().manual_seed(3)
    with _PROBE_LOCK, torch.no_grad(), torch.device("cpu"):
        q = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
        k = torch.randn(1, 1, 5, 8, generator=g, dtype=torch.float64)
        cos = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)
        sin = torch.randn(1, 5, 8, generator=g, dtype=torch.float64)

        def matches(q, k, c, s, same=_close, whole=False):
            rd = q.shape[-1] if whole else c.shape[-1]  # whole: half-width tables (the reference widens them)
            try:
                got = fn(q, k, c, s)
            except Exception:  # another signature or layout: not the function the kernel replaces
                return False
            want = [
                torch.cat([rope_kernels.rope_rotate_half_ref(t[..., :rd], c, s), t[..., rd:]], dim=-1) for t in (q, k)
            ]
            return isinstance(got, tuple) and len(got) == 2 and all(same(o, w) for o, w in zip(got, want))

        def bits(a, b):
            return isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)

        ok = matches(q, k, cos, sin)
        half = not ok and matches(q, k, cos[..., :4], sin[..., :4], whole=True)
        partial = ok and matches(q, k, cos[..., :4], sin[..., :4])
        ok = ok or half
        c32, s32 = (cos[..., :4] if half else cos).float(), (sin[..., :4] if half else sin).float()
        mixed = ok and all(matches(q.to(dt), k.to(dt), c32, s32, bits, whole=half) for dt in _HALF)
        _PROBES[key] = (fn, ok, partial, mixed, half)
    return ok, partial, mixed, half


def _recognised(result) -> bool:
    return isinstance(result, dict)


def _rmsnorm_plan(m):
    return _probe("rmsnorm", m, _rmsnorm_probe) if _norm_structure(m) else None


def _mlp_plan(m):
    """(kind, plan) of a gated MLP: kind 'swiglu' (SiLU) or 'geglu' (tanh GELU; the exact erf GELU is
    neither) by what m's activation computes, plan its probe's dict when a kernel computes m's forward, else
    the reason (a _Gap where the function is known but no kernel has its form: tanh GELU with the gate first
    in a fused projection). (None, None) for anything else."""
    struct = _mlp_structure(m)
    if struct is None:
        return None, None
    lin, act_name = struct
    kind = {"silu": "swiglu", "gelu_tanh": "geglu"}.get(_activation(getattr(m, act_name)))
    if kind is None:
        return None, None
    plan = _probe("mlp", m, _mlp_probe, extra=lin)
    if not _recognised(plan):
        return kind, plan
    if kind == "geglu" and plan["form"] == "fused" and plan["gate_first"]:
        return kind, _Gap(
            f"{type(m).__name__}: tanh-GELU gate times up from a fused projection with the gate first; no "
            "kernel reads that form (activations.geglu takes one [..., 2H] tensor, gate second; "
            "activations.gelu_mul two projections)"
        )
    return kind, plan


def _experts_plan(m):
    """('moe_swiglu', plan) for an MoE experts module whose activation is SiLU (plan: its probe's dict, or
    the reason); (None, None) for anything else."""
    act_name = _experts_structure(m)
    if act_name is None or _activation(getattr(m, act_name)) != "silu":
        return None, None
    return "moe_swiglu", _probe("experts", m, _experts_probe, extra=(act_name,))


def _decoder_layer_plan(m):
    if _layer_structure(m) is None:
        return None
    return _probe("decoder_layer", m, _decoder_layer_probe)


def layer_form(m) -> Optional[str]:
    """Where a decoder layer's norms sit, as its probe found them: 'pre-norm' (Llama: a norm before the
    attention and before the MLP), 'sandwich' (Gemma: before and after both), 'post-norm' (OLMo 2: after
    both, before the residual adds), 'other' for another placement, None if m is no decoder layer the
    probe recognises."""
    plan = _decoder_layer_plan(m)
    if not _recognised(plan):
        return None
    pre = plan["pre_a"] is not None and plan["pre_m"] is not None
    post = plan["post_a"] is not None and plan["post_m"] is not None
    none_pre = plan["pre_a"] is None and plan["pre_m"] is None
    none_post = plan["post_a"] is None and plan["post_m"] is None
    if pre and none_post:
        return "pre-norm"
    if pre and post:
        return "sandwich"
    if post and none_pre:
        return "post-norm"
    return "other"


def _rms_recognised(m) -> bool:
    return _recognised(_rmsnorm_plan(m))


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
    kernels.kernelize puts a hub kernel). None where the function is a plain function (no kernels package,
    or a model file that does not route it)."""
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


def _rope_function_of(m):
    """The function m's attention calls as apply_rotary_pos_emb (the one a dispatcher or a routed copy
    stands in for), or None."""
    g = _rope_globals(type(m))
    if g is None:
        return None
    fn = _original_rope_function(g[_ROPE_NAME])
    slot = _rope_slot(m, g)
    return _slot_function(slot) if slot is not None else fn


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


def _patch_gate(module: torch.nn.Module, plan: dict) -> bool:
    """Make _experts_gate the experts module's _apply_gate, on the instance; and _experts_forward its forward
    where its probe finds the routed experts' SwiGLU MLPs (the decode path) and it has no forward of its own."""
    if _STATE in module.__dict__:
        return False
    patched = ic.BoundForward(_experts_gate, module)
    st = module.__dict__[_STATE] = {
        "kind": "moe_swiglu",
        "gate_slot": patched,
        "act": plan["act"],
        "act_module": getattr(module, plan["act"]),
        "gate_first": plan["gate_first"],
    }
    module.__dict__["_apply_gate"] = patched
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    impl_fn = _experts_function(impl)
    decode = _probe(
        "experts_decode", module, lambda m: _experts_decode_probe(m, plan["act"], plan["gate_first"]),
        extra=(plan["act"], plan["gate_first"], impl if type(impl) in _PLAIN else "?", impl_fn),
    )  # fmt: skip
    if _recognised(decode) and "forward" not in module.__dict__ and type(impl) in _PLAIN:
        st.update(impl=impl, impl_fn_id=id(impl_fn))  # (an id: the state pickles with the model)
        st["forward_slot"] = module.__dict__["forward"] = ic.BoundForward(_experts_forward, module)
    return True


def _unpatch(module: torch.nn.Module) -> Optional[str]:
    """Undo whatever was patched on this module; returns its kind (None if nothing was)."""
    st = module.__dict__.get(_STATE, {})
    slot = st.get("rope_slot")
    if slot is not None:  # the RoPE kernel put into the layer's private copy of the function
        del module.__dict__[_STATE]
        if getattr(slot.__dict__.get("forward"), "__func__", None) is _rope_slot_forward:
            del slot.__dict__["forward"]
        return "rope"
    if "gate_slot" in st:  # an experts module's _apply_gate (and forward)
        del module.__dict__[_STATE]
        if module.__dict__.get("_apply_gate") is st["gate_slot"]:
            del module.__dict__["_apply_gate"]
        if "forward_slot" in st:  # wherever a hook added since moved it
            ic.restore_forward(module, {"patched": st["forward_slot"], "prev": None})
        return "moe_swiglu"
    state = ic.unpatch(module, _STATE)
    if state is None:
        return None
    if state["kind"] == "rope":
        _rope_release(module, state["site"].globals)
    return state["kind"]


# --------------------------------------------------------------------------------------------
# Replacement forwards
# --------------------------------------------------------------------------------------------
# Gemma's norms multiply by 1 + weight in fp32. That tensor is made once per norm and kept while the weight
# is the same tensor with the same version counter (an in-place change bumps it; a new tensor is another
# object), so a decode step launches the norm kernel and nothing else. Under torch.compile it is computed
# in the graph (the compiler folds it), and where no version counter exists (an inference tensor) per call.
_OFFSET_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # norm -> (weakref(w), version, 1 + w)


def _offset_weight(norm, w: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return 1.0 + w.float()
    try:
        version = w._version
    except RuntimeError:  # an inference tensor keeps no version counter
        return 1.0 + w.float()
    hit = _OFFSET_WEIGHTS.get(norm)
    if hit is not None and hit[0]() is w and hit[1] == version:
        return hit[2]
    eff = 1.0 + w.float()
    _OFFSET_WEIGHTS[norm] = (weakref.ref(w), version, eff)
    return eff


def _norm_args(norm, st: dict, x: torch.Tensor):
    """(weight, eps, cast_before_weight) for rms_norm to compute norm(x) as the module does, or None where
    the module would compute something the probe did not check (another dtype mix, another shape)."""
    w = norm.weight
    if x.dim() == 0 or w.shape != x.shape[-1:]:
        return None
    if w.dtype != x.dtype and not (w.dtype == torch.float32 and st["mixed"]):
        return None  # e.g. an fp32 weight on bf16 input, where Llama's norm returns fp32
    eff = _offset_weight(norm, w) if st["offset"] else w
    return eff, getattr(norm, st["eps"]), st["cast_before_weight"]


def _rmsnorm_forward(self, hidden_states, *more, **more_kw):
    """An RMSNorm as its probe found it (weight or 1 + weight, rounded before the weight multiply or after
    it), in one kernel. Any other argument (the gate of Falcon-H1's gated norm: the probe saw the call without
    it) goes to the original forward."""
    st = self.__dict__[_STATE]
    if not (more or more_kw) and isinstance(hidden_states, torch.Tensor) and _usable(hidden_states, self.weight):
        args = _norm_args(self, st, hidden_states)
        if args is not None:
            w, eps, cast = args
            out = _rowwise(rmsnorm.rms_norm, hidden_states, w, eps, cast_before_weight=cast)
            if out is not None:
                return out
    return _original_forward(self)(hidden_states, *more, **more_kw)


def _act_ok(module, st: dict) -> bool:
    """The module's activation is the one its probe found, and calling it runs nothing else."""
    act = getattr(module, st["act"], None)
    return act is st["act_module"] and _plain(act)


def _gated_ok(*ts) -> bool:
    return all(t.dim() > 0 and (t.stride(-1) == 1 or t.shape[-1] == 1) and _two_level(t) for t in ts) and _usable(*ts)


def _mlp_forward(self, x):
    """A gated MLP, down(act(gate) * up), with the activation and the product in one kernel: with SiLU swiglu
    for two projections or a fused one (either half first); with tanh GELU gelu_mul for two projections,
    geglu for a fused [up | gate] projection."""
    st = self.__dict__[_STATE]
    if not _act_ok(self, st):
        return _original_forward(self)(x)
    act = getattr(self, st["act"])
    if st["form"] == "split":
        gate = getattr(self, st["gate"])(x)
        up = getattr(self, st["up"])(x)
        if gate.shape == up.shape and gate.dtype == up.dtype and _gated_ok(gate, up):
            if st["kind"] == "swiglu":
                h = activations.swiglu(gate, up)
            else:  # geglu: the probe found the tanh GELU (the erf form is no site)
                h = activations.gelu_mul(gate, up, approximate="tanh")
        else:
            h = act(gate) * up
        return getattr(self, st["down"])(h)
    gate_up = getattr(self, st["gate_up"])(x)
    if gate_up.dim() > 0 and gate_up.shape[-1] % 2 == 0 and _gated_ok(gate_up):
        if st["kind"] == "swiglu":
            h = activations.swiglu(gate_up, gate_first=st["gate_first"])
        else:  # geglu, gate second (the plan admits no other)
            h = activations.geglu(gate_up, approximate="tanh")
    else:
        first, second = gate_up.chunk(2, dim=-1)
        gate, up = (first, second) if st["gate_first"] else (second, first)
        h = act(gate) * up
    return getattr(self, st["down"])(h)


def _experts_gate(self, gate_up_out):
    """An MoE experts module's _apply_gate: act(gate) * up of the fused gate/up output in one kernel."""
    st = self.__dict__[_STATE]
    y = gate_up_out
    if (
        _act_ok(self, st)
        and isinstance(y, torch.Tensor)
        and y.dim() > 0
        and y.numel() > 0
        and y.shape[-1] % 2 == 0
        and _gated_ok(y)
    ):
        return activations.swiglu(y, gate_first=st["gate_first"])
    return type(self)._apply_gate(self, y)


def _experts_function(impl):
    """The function transformers' experts interface runs for the implementation named impl (None: the class's
    own forward, or no interface); what the decode probe's result holds for."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the experts interface
        return None
    return ALL_EXPERTS_FUNCTIONS.get(impl) if isinstance(impl, str) else None


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    """An MoE experts module's forward: at decode (token-expert pairs at most the number of experts, and at
    most moe_experts.MAX_PAIRS) the chosen experts' GEMVs, SwiGLU and the weighted sum in two kernels, each
    expert's weights read in place (moe_experts.py; its probe found that the module computes this); else the
    module's own forward. The kernels read an expert's weights once per pair, a grouped GEMM once per expert:
    with more pairs than experts some expert is read twice (measured at one token only). The module's own
    forward runs too when what the probe saw has changed since (the experts implementation, the instance's
    _apply_gate), under torch.compile, and after removal (a hook added after injection may still call this)."""
    st = self.__dict__.get(_STATE)
    x, idx, w = hidden_states, top_k_index, top_k_weights
    gu, dn = getattr(self, "gate_up_proj", None), getattr(self, "down_proj", None)
    if (
        not torch.compiler.is_compiling()  # (Dynamo traces transformers' path; the kernels are no ops)
        and st is not None
        and "forward_slot" in st
        and not args
        and not kwargs
        and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (x, idx, w, gu, dn))  # no subclass
        and x.dim() == idx.dim() == 2
        and gu.dim() == 3
        and 0 < x.shape[0] * idx.shape[1] <= min(moe_experts.MAX_PAIRS, gu.shape[0])  # see moe_experts.MAX_PAIRS
        and idx.shape[0] == x.shape[0]
        and w.shape == idx.shape
        and idx.dtype in (torch.int32, torch.int64)
        and idx.device == x.device
        and dn.dim() == 3
        and gu.dtype == dn.dtype == x.dtype
        and gu.shape[2] == x.shape[1]
        and dn.shape == (gu.shape[0], x.shape[1], gu.shape[1] // 2)
        and x.stride(-1) == gu.stride(-1) == dn.stride(-1) == 1
        and not getattr(self, "_is_expert_parallel", False)
        and self.__dict__.get("_apply_gate") is st["gate_slot"]
        and getattr(getattr(self, "config", None), "_experts_implementation", None) == st["impl"]
        and id(_experts_function(st["impl"])) == st["impl_fn_id"]
        and _act_ok(self, st)
        and _usable(x, w, gu, dn)
    ):
        return moe_experts.moe_swiglu_experts(x, idx, w, gu, dn, gate_first=st["gate_first"])
    return type(self).forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)


def _fusable_norm(norm, x, residual):
    """(weight, eps, cast_before_weight) when norm(residual + x) may run as one fused kernel that skips the
    norm's call: the norm runs this file's RMSNorm patch (its probe's numerics are in the record) and
    nothing else, and the tensors suit the kernel. Else None."""
    st = norm.__dict__.get(_STATE)
    if st is None or st["kind"] != "rmsnorm" or _has_hooks(norm):
        return None
    fwd = norm.__dict__.get("forward")
    if fwd is None or ic.patched_function(fwd) is not _rmsnorm_forward:
        return None  # someone else's forward on the norm: let it run
    ok = (
        isinstance(x, torch.Tensor)
        and isinstance(residual, torch.Tensor)
        and x.shape == residual.shape
        and x.dtype == residual.dtype
        and x.dim() > 0
        and _gated_ok(x, residual)
        and _usable(x, residual, norm.weight)
    )
    return _norm_args(norm, st, x) if ok else None


def _identity_dropouts(module, names) -> bool:
    """The layer's dropouts compute the identity now (eval mode or p = 0) and run nothing else."""
    for name in names:
        d = getattr(module, name, None)
        if not isinstance(d, _DROPOUT) or (d.training and d.p != 0) or not _plain(d):
            return False
    return True


def _decoder_layer_forward(self, *args, **kwargs):
    """The decoder layer with `residual + attention output` (after its norm, where it has one) and the norm
    in front of the MLP in one kernel.

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
        or not _identity_dropouts(self, st["dropouts"])
    ):
        # keyword-only hidden_states, argument errors, autograd, gradient checkpointing, active dropout
        return _original_forward(self)(*args, **kwargs)
    hidden_states = args[0]
    given = kwargs
    kwargs = dict(st["defaults"])
    kwargs.update(given)
    for name, value in zip(names[1:], args[1:]):
        kwargs[name] = value
    if any(n not in kwargs for n in st["required"]):  # the original raises its TypeError
        return _original_forward(self)(*args, **given)

    residual = hidden_states
    if st["pre_a"] is not None:
        hidden_states = getattr(self, st["pre_a"])(hidden_states)
    kwargs[st["hidden_key"]] = hidden_states
    hidden_states, _ = self.self_attn(**kwargs)
    if st["post_a"] is not None:
        hidden_states = getattr(self, st["post_a"])(hidden_states)
    norm = getattr(self, st["pre_m"])
    args = _fusable_norm(norm, hidden_states, residual)
    if args is not None:
        # r = residual + h (fp32 sum rounded once: the bits torch's add gives), y = norm(r)
        w, eps, cast = args
        hidden_states, residual = rmsnorm.fused_add_rms_norm(hidden_states, residual, w, eps, cast_before_weight=cast)
    else:
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = norm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    if st["mlp_pair"]:  # (output, router scores): the layer keeps the output (GPT-OSS), unpacked as it does
        hidden_states, _ = hidden_states
    if st["post_m"] is not None:
        hidden_states = getattr(self, st["post_m"])(hidden_states)
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
                "so the injected model cannot be saved or copied; call remove_optimized_kernels(model) "
                "(remove_llama_kernels) first"
            )
        return _rope_site_for, (self.module, name)


def _rope_site_for(module, name: str) -> _RopeSite:
    """The _RopeSite of an unpickled or copied attention layer (see _RopeSite)."""
    g = importlib.import_module(name).__dict__
    _rope_acquire(module, g)
    return _RopeSite(module, g)


def _rope_usable(q, k, cos, sin, partial: bool, mixed: bool, half: bool) -> bool:
    """The call has the form the probe checked and tensors the kernel takes: q, k [B, H, S, D], cos/sin
    [B or 1, S, D] (or [B or 1, S, R], R even and < D, where the function rotates the first R channels; or
    [B or 1, S, D / 2] only, where its tables hold one value per channel pair: half), all of one dtype (or fp32
    cos/sin with fp16 / bf16 q, k where the function returns q's dtype: mixed)."""
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return False
    b, s, d = q.shape[0], q.shape[2], q.shape[3]
    r = cos.shape[-1]
    width_ok = 2 * r == d if half else r == d or (partial and r < d)
    if k.shape[0] != b or k.shape[2:] != (s, d) or r % 2 or r < 2 or not width_ok:
        return False
    for t in (cos, sin):
        if t.shape[0] not in (1, b) or t.shape[1:] != (s, r) or t.stride(-1) != 1:
            return False
    # the original computes in promote(q, cos); the kernel returns q's dtype: one dtype, or the probed mix
    if q.dtype != k.dtype or cos.dtype != sin.dtype:
        return False
    if cos.dtype != q.dtype and not (mixed and cos.dtype == torch.float32 and q.dtype in _HALF):
        return False
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    return _usable(q, k, cos, sin)


def _rope_pair(q, k, cos, sin, half: bool):
    """(rope(q), rope(k)) with the rotate-half kernel (half: tables of one value per channel pair, which it reads
    as they are); with a narrower table, the first cos.shape[-1] channels rotated and the rest passed through
    (the concatenation the partial-rotary function makes)."""
    r = cos.shape[-1]
    if half or r == q.shape[-1]:
        return rope_kernels.rope_rotate_half(q, cos, sin), rope_kernels.rope_rotate_half(k, cos, sin)
    return tuple(torch.cat([rope_kernels.rope_rotate_half(t[..., :r], cos, sin), t[..., r:]], dim=-1) for t in (q, k))


def _make_rope_dispatcher(original):
    """The stand-in for a model file's apply_rotary_pos_emb: the kernel for the call form its probe checked,
    (q, k, cos, sin) inside a patched attention layer, with tensors the kernel takes; else the function
    it stands in for (a hub-kernel wrapper of transformers' function keeps its routing)."""
    _, partial, mixed, half = _rope_probe(original)

    def apply_rotary_pos_emb(*args, **kwargs):
        if (
            getattr(_ROPE_ACTIVE, "depth", 0)
            and len(args) == 4
            and not kwargs
            and _rope_usable(*args, partial, mixed, half)
        ):
            return _rope_pair(*args, half)
        return original(*args, **kwargs)

    apply_rotary_pos_emb._rtk_original = original
    apply_rotary_pos_emb.__doc__ = original.__doc__
    return apply_rotary_pos_emb


def _rope_slot_forward(self, *args, **kwargs):
    """The forward of a layer's private copy of apply_rotary_pos_emb (see _rope_slot): the kernel for the call
    form the probe checked, (q, k, cos, sin) with tensors the kernel takes; else transformers' function.
    Under torch.compile transformers calls it on the model file's instance, not on the layer's copy."""
    forms = _SLOT_FORMS.get(type(self), (False, False, False))
    if len(args) == 4 and not kwargs and _rope_usable(*args, *forms):
        return _rope_pair(*args, forms[2])
    return _SLOT_FUNCTIONS[type(self)](*args, **kwargs)


_SLOT_FORMS: dict = {}  # class of a copy of apply_rotary_pos_emb -> (partial, mixed, half) of its function (_rope_probe)


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
        (activations, "geglu"),
        (activations, "gelu_mul"),
        (rope_kernels, "rope_rotate_half"),
        (skinny_kernels, "skinny_gemm"),
        (moe_experts, "moe_swiglu_experts"),
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


def _site_kind(m) -> Optional[str]:
    """The kind of site m is by its structure (its parameters, children and the function its forward calls;
    never its class name), whether or not the kernels can replace it: what missing_kinds and coverage count.
    A decoder layer is a site where a norm follows a residual add (its probe says where its norms sit; one
    the probe does not recognise counts as a site)."""
    if type(m) is torch.nn.Linear:
        return None
    if _norm_structure(m):
        return "rmsnorm"
    kind, _ = _experts_plan(m)
    if kind is None and _experts_like(m):  # experts without a SiLU activation module: a site the kernels skip
        return "moe_swiglu"
    if kind is None:
        kind, _ = _mlp_plan(m)
    if kind is not None:
        return kind
    if _layer_structure(m) is not None:
        plan = _decoder_layer_plan(m)
        return "fused_add_rmsnorm" if not _recognised(plan) or plan["pre_m"] is not None else None
    if _rope_globals(type(m)) is not None:
        return "rope"
    return None


def _why_not(m, kind: str) -> Optional[str]:
    """Why the kernel of kind cannot replace m (None if it can): what the probes found, or what is in the way.
    A _Gap names a known function the bundle has no kernel for."""
    if kind == "rmsnorm":
        plan = _rmsnorm_plan(m)
    elif kind in ("swiglu", "geglu"):
        plan = _mlp_plan(m)[1]
    elif kind == "moe_swiglu":
        if _experts_plan(m)[0] is None:
            act, kids = _experts_structure(m), [name for name, _ in m.named_children()]
            if act is not None:
                what = f"activation {type(getattr(m, act)).__name__}, not SiLU"
            elif kids:
                what = f"modules {', '.join(kids)} besides or instead of one parameter-free activation"
            elif callable(getattr(m, "act_fn", None)):  # LFM2-MoE's F.silu: the kernel path checks a module only
                return (
                    f"{type(m).__name__}: experts whose activation act_fn is a function, not a module: left to PyTorch"
                )
            else:
                what = "no activation module (a gate of its own)"
            return f"{type(m).__name__}: experts with {what}: not the act(gate) * up the kernels compute"
        plan = _experts_plan(m)[1]
        if _recognised(plan) and "_apply_gate" in m.__dict__:
            return f"{type(m).__name__} with its own instance _apply_gate"
        if _recognised(plan) and not _plain(getattr(m, plan["act"])):
            return f"{type(m).__name__} whose activation has hooks or its own forward"
        return None if _recognised(plan) else plan
    elif kind == "fused_add_rmsnorm":
        plan = _decoder_layer_plan(m)
        if _recognised(plan) and not _rms_recognised(getattr(m, plan["pre_m"])):
            return f"{type(m).__name__} whose norm after the residual add is not an RMSNorm the kernel computes"
    else:
        g = _rope_globals(type(m))
        if g is None:
            return f"{type(m).__name__} calls no {_ROPE_NAME}"
        if not _rope_probe(_original_rope_function(g[_ROPE_NAME]))[0]:
            return f"{_ROPE_NAME} of {g.get('__name__')} computes another function than rotate-half RoPE"
        if _hub_kernel(m):
            return f"{type(m).__name__} runs a RoPE kernel of the kernels hub (kernelize)"
        plan = {}
    if not _recognised(plan):
        return plan or f"{type(m).__name__} is no {kind} site"
    if kind in ("swiglu", "geglu") and not _plain(getattr(m, plan["act"])):
        return f"{type(m).__name__} whose activation has hooks or its own forward"
    if _foreign_forward(m):
        return f"{type(m).__name__} with its own instance forward"
    return None


def _inject_module(m, fuse_residual: bool, rope: bool, new: dict, skipped: list, gaps: list) -> bool:
    """Inject the kernel of m's kind into m, if it has one and may take it (adding to new, or to skipped /
    gaps with the reason it may not); returns whether m is a site of a kind the injection knows (patched
    already, injected now or not)."""
    if _STATE in m.__dict__:
        return True
    kind = _site_kind(m)
    if kind is None:
        return False
    if (kind == "fused_add_rmsnorm" and not fuse_residual) or (kind == "rope" and not rope):
        return True
    why = _why_not(m, kind)
    if why is not None:
        (gaps if isinstance(why, _Gap) else skipped).append(why)
        return True
    if kind == "rmsnorm":
        new[kind] += _patch_forward(m, _rmsnorm_forward, kind, **_rmsnorm_plan(m))
    elif kind in ("swiglu", "geglu"):
        plan = _mlp_plan(m)[1]
        new[kind] += _patch_forward(m, _mlp_forward, kind, **plan, act_module=getattr(m, plan["act"]))
    elif kind == "moe_swiglu":
        new[kind] += _patch_gate(m, _experts_plan(m)[1])
    elif kind == "fused_add_rmsnorm":
        new[kind] += _patch_forward(m, _decoder_layer_forward, kind, **_decoder_layer_plan(m))
    else:
        g = _rope_globals(type(m))
        slot = _rope_slot(m, g)
        if slot is not None:  # per layer, through transformers' own routing: nothing global changes
            _SLOT_FORMS[type(slot)] = _rope_probe(_slot_function(slot))[1:]
            slot.forward = types.MethodType(_rope_slot_forward, slot)
            m.__dict__[_STATE] = {"kind": "rope", "rope_slot": slot}
            new["rope"] += 1
        elif _patch_forward(m, _attention_forward, "rope", site=_RopeSite(m, g)):
            _rope_acquire(m, g)
            new["rope"] += 1
    return True


def coverage(model: torch.nn.Module, *, fuse_residual: bool = True, rope: bool = True) -> dict:
    """Per kind: {'sites': how many sites of that kind the model has (by structure, see _site_kind; for
    skinny_gemm its nn.Linear layers), 'replaced': how many run the kernel's forward now, 'left': {reason:
    how many sites are left to PyTorch for it}}. Kinds not asked for (fuse_residual, rope as given to
    inject_optimized_kernels) count no sites."""
    out = {k: {"sites": 0, "replaced": 0, "left": collections.Counter()} for k in KINDS}
    for m in _modules(model):
        st = m.__dict__.get(_STATE)
        kind = st["kind"] if st is not None else ("skinny_gemm" if type(m) is torch.nn.Linear else _site_kind(m))
        if kind is None or (kind == "fused_add_rmsnorm" and not fuse_residual) or (kind == "rope" and not rope):
            continue
        row = out[kind]
        row["sites"] += 1
        if st is not None:
            row["replaced"] += 1
        elif kind == "skinny_gemm":
            row["left"]["skinny_gemm=False (decode-time linear layers are opt-in)"] += 1
        else:
            row["left"][_why_not(m, kind) or "not injected"] += 1
    for row in out.values():
        row["left"] = dict(row["left"])
    return out


def missing_kinds(model: torch.nn.Module, *, fuse_residual: bool = True, rope: bool = True) -> dict:
    """{kind: why} for each kind the model has sites of (by structure: an RMSNorm-like module, a gated MLP, a
    decoder layer with a norm after a residual add, an MoE experts module, an attention calling
    apply_rotary_pos_emb) but none of which is injected, for a reason other than a known gap (kernel_gaps),
    e.g. {"rope": "32 sites, none replaced: ..."}; {} when every such kind runs its kernel somewhere.
    fuse_residual and rope as given to inject_optimized_kernels (a kind not asked for is not missing). The
    examples' ok is false while this is not empty."""
    out = {}
    for kind, row in coverage(model, fuse_residual=fuse_residual, rope=rope).items():
        if kind == "skinny_gemm" or not row["sites"] or row["replaced"]:
            continue
        reasons = [r for r in row["left"] if not isinstance(r, _Gap)]
        if reasons:
            out[kind] = f"{row['sites']} sites, none replaced: " + "; ".join(reasons)
    return out


def kernel_gaps(model: torch.nn.Module) -> dict:
    """{kind: why} for each kind of which some sites compute a known function the bundle has no kernel for
    (a tanh GeGLU with the gate first in a fused projection), with how many: those sites run PyTorch's code."""
    out = {}
    for kind, row in coverage(model).items():
        gaps = {r: n for r, n in row["left"].items() if isinstance(r, _Gap)}
        if gaps:
            out[kind] = "; ".join(f"{n} sites: {r}" for r, n in gaps.items())
    return out


def _experts_notes(model) -> str:
    """A note naming the experts modules whose configured implementation never calls _apply_gate."""
    impls = collections.Counter()
    for m in _modules(model):
        st = m.__dict__.get(_STATE)
        if st is not None and st["kind"] == "moe_swiglu":
            impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
            if impl in ("eager", "sonicmoe"):
                impls[impl] += 1
    return "; ".join(
        f"{n} experts modules run experts_implementation={impl!r}, which does not call _apply_gate: their SwiGLU "
        "stays PyTorch's beyond decode-sized calls until the implementation is grouped_mm, batched_mm or deepgemm"
        for impl, n in impls.items()
    )


def _rotary_globals(m) -> set:
    """The global names m's class forward loads that look like a rotary function (apply_rotary_emb, ...)."""
    code = getattr(inspect.unwrap(type(m).forward), "__code__", None)
    names = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"} if code else set()
    return {n for n in names if "rotary" in n.lower() and "emb" in n.lower()}


def _rope_branch_note(model) -> str:
    """A note naming the attention classes with a replaced RoPE site whose forward can also call another rotary
    function (DeepSeek-V3's apply_rotary_pos_emb_interleave, picked by its config): the count says the site was
    patched, not that the kernel runs (count_kernel_calls() says that); and the classes whose forward applies RoPE
    through another function only (DeepSeek-V2's complex apply_rotary_emb): no site, their RoPE runs PyTorch."""
    branches, others = {}, {}
    for m in _modules(model):
        st = m.__dict__.get(_STATE)
        if st is not None and st["kind"] not in ("rope",):
            continue
        names = _rotary_globals(m)
        other = sorted(n for n in names if n != _ROPE_NAME)
        if not other:
            continue
        if st is not None:
            branches[type(m).__name__] = other
        elif _ROPE_NAME not in names:
            others[type(m).__name__] = other
    notes = [
        f"{cls}.forward can call {', '.join(names)} instead of {_ROPE_NAME} (a branch its config picks): its RoPE "
        "runs the kernel only where the latter is called; ti.count_kernel_calls() shows what ran"
        for cls, names in branches.items()
    ]
    notes += [
        f"{cls}.forward applies RoPE through {', '.join(names)}, not {_ROPE_NAME}: no site for the kernels, its "
        "RoPE runs PyTorch's code"
        for cls, names in others.items()
    ]
    return "; ".join(notes)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------
def inject_optimized_kernels(
    model: torch.nn.Module,
    *,
    fuse_residual: bool = True,
    rope: bool = True,
    skinny_gemm: bool = False,
    verbose: bool = True,
) -> dict:
    """Replace the RMSNorms, residual add + norm, gated MLP activations (SwiGLU, GeGLU, MoE experts'
    SwiGLU), RoPE (and optionally the decode-time linear layers) of a transformers decoder LLM with the
    kernels; see the module docstring for each kind and how sites are recognised.

    model: a *ForCausalLM / *Model of any family whose modules compute what the kernels do (Llama, Mistral,
    Qwen2/3, Qwen3-MoE, Mixtral, Gemma 2/3, Phi-3, OLMo 2, ...), or any module containing one.
    fuse_residual, rope, skinny_gemm: which optional kinds to add (norms and activations are always
    injected). Returns the counts per kind of what is injected after the call. A second call wraps
    nothing twice and only adds kinds that were not asked for before; to drop a kind, remove and inject
    again. Inject before torch.compile (the kernels are torch.library custom ops, so compile traces them).
    A kind the model has sites of but none was replaced (missing_kinds) is a warning in the log line;
    sites with no kernel for their function (kernel_gaps) are named in it.
    """
    new = _empty_counts()
    skipped, gaps = [], []
    modules = list(_modules(model))
    found = False

    for m in modules:
        found |= _inject_module(m, fuse_residual, rope, new, skipped, gaps)

    if skinny_gemm and found:
        for m in modules:
            # plain nn.Linear only: subclasses (quantised layers, LoRA) compute something else
            if type(m) is torch.nn.Linear and _STATE not in m.__dict__:
                if _foreign_forward(m):
                    skipped.append("Linear with its own instance forward")
                else:
                    new["skinny_gemm"] += _patch_forward(m, _linear_forward, "skinny_gemm")

    counts = injected_counts(model)
    missing = missing_kinds(model, fuse_residual=fuse_residual, rope=rope)
    none_found = "" if found or missing else "no RMSNorm, gated MLP, decoder layer, experts or RoPE attention found"
    warning = "; ".join(f"WARNING {kind}: {why}" for kind, why in missing.items())
    gap_note = ("no kernel for: " + ", ".join(sorted(set(gaps)))) if gaps else ""
    ic.report(
        logger,
        ic.counts_message(
            "injected kernels",
            counts,
            new,
            none_found=none_found,
            skipped=skipped,
            notes=[
                gap_note,
                _experts_notes(model),
                _rope_branch_note(model),
                warning,
                ic.cpu_fallback_note(model, new),
            ],
        ),
        verbose,
        warning=bool(missing),
    )
    return counts


def remove_optimized_kernels(model: torch.nn.Module, *, verbose: bool = True) -> dict:
    """Undo inject_optimized_kernels: restore the original forwards (and apply_rotary_pos_emb once no
    patched attention layer of that model file is left). Returns the counts per kind restored."""
    restored = _empty_counts()
    for m in _modules(model):
        kind = _unpatch(m)
        if kind is not None:
            restored[kind] += 1
    ic.report(logger, ic.counts_message("removed kernels", restored), verbose)
    return restored


# The names of the first release, which served Llama and its copies: the same functions.
inject_llama_kernels = inject_optimized_kernels
remove_llama_kernels = remove_optimized_kernels


# --------------------------------------------------------------------------------------------
# Random-weight Llama models (no hub): shared by the tests and the example
# --------------------------------------------------------------------------------------------
def tiny_llama_config(**overrides):
    """A 2-layer Llama for CPU tests: hidden 64 (4 query heads and 2 key/value heads of 16), MLP width
    160 (not a power of two), vocabulary 256, Llama-3's RoPE base and epsilon (transformers_families'
    tiny config of the llama family)."""
    return tf.tiny_config("llama", **overrides)


def llama3_8b_config(**overrides):
    """The architecture of Meta-Llama-3-8B (config.json of the release): 32 layers, hidden 4096, MLP
    14336, 32 query / 8 key-value heads of 128, vocabulary 128256, RoPE base 500000, eps 1e-5
    (transformers_families.ARCHS["llama3-8b"])."""
    return tf.release_config("llama3-8b", **overrides)


def build_llama(config=None, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """A LlamaForCausalLM with random weights, built directly on `device` in `dtype` (the 8B architecture
    in bf16 takes ~16 GB and never exists in fp32), in eval mode, parameters without gradients."""
    from transformers import LlamaForCausalLM

    config = config if config is not None else tiny_llama_config()
    model = tf.random_model(LlamaForCausalLM, config, device=device, dtype=dtype, seed=seed)
    model.requires_grad_(False)
    return model.eval()


def build_meta_llama(config):
    """A LlamaForCausalLM whose parameters are on the meta device (no memory, no weights), e.g. to count
    what injection replaces in a large architecture (transformers_families.meta_model)."""
    from transformers import LlamaForCausalLM

    return tf.meta_model(LlamaForCausalLM, config)


def _main(argv=None) -> int:
    """Report what injection replaces in a released architecture built on the meta device (no memory, no
    weights) and check that removal restores every module and the RoPE function; or, with --coverage, the
    sites found / replaced per family (transformers_families.py)."""
    import argparse
    import json

    p = argparse.ArgumentParser(
        description="Inject the kernels into a released architecture built on the meta device (no weights) "
        "and report the counts per kind as JSON; --coverage: the sites found / replaced per kind for every "
        "family (the table of references/transformers-integration.md). Library use: "
        "inject_optimized_kernels(model, fuse_residual=True, rope=True, skinny_gemm=False) / "
        "remove_optimized_kernels(model)."
    )
    p.add_argument("--arch", default="llama3-8b", choices=sorted(tf.ARCHS), help="architecture (default llama3-8b)")
    p.add_argument("--num-layers", type=int, help="decoder layers (default: the release's)")
    p.add_argument("--no-skinny-gemm", action="store_true", help="leave the linear layers alone")
    tf.add_coverage_options(p)
    args = p.parse_args(argv)
    if args.num_layers is not None and args.num_layers < 1:
        p.error(f"--num-layers must be at least 1, got {args.num_layers}")
    if tf.coverage_requested(args):
        return tf.coverage_main(args.markdown, args.write, args.check)
    model = tf.build_meta(args.arch, num_layers=args.num_layers)
    sg = not args.no_skinny_gemm
    counts = inject_optimized_kernels(model, skinny_gemm=sg, verbose=False)
    missing = missing_kinds(model)
    gaps = kernel_gaps(model)
    again = inject_optimized_kernels(model, skinny_gemm=sg, verbose=False)
    restored = remove_optimized_kernels(model, verbose=False)
    left = injected_counts(model)
    rope_restored = all(
        g[_ROPE_NAME] is _original_rope_function(g[_ROPE_NAME])
        for g in {id(g): g for g in (_rope_globals(type(m)) for m in model.modules()) if g is not None}.values()
    )
    ok = counts == again == restored and not any(left.values()) and rope_restored and not missing
    layers = model.config.num_hidden_layers
    print(
        json.dumps(
            {
                "architecture": f"{tf.ARCHS[args.arch].title}, {layers} layers",
                "injected": counts,
                "second_injection": again,
                "restored": restored,
                "missing_kinds": missing,
                "kernel_gaps": gaps,
                "ok": ok,
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

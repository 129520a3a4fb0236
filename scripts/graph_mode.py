# SPDX-License-Identifier: Apache-2.0
"""Replay a transformer's forward as CUDA graphs: the kernels without the host.

    import graph_mode
    graph_mode.enable(model)        # or diffusers_injection.inject_optimized_kernels(pipe, graphs=True)
    ...                             # model(...) / pipe(...): replayed graphs where they can be, eager elsewhere
    graph_mode.disable(model)       # the graphs and their memory are freed; the forward is the one before

An eager forward costs the host 8-14 us per kernel launch; at small and medium sizes the GPU waits on it.
A graph records the forward's launches once and replays them with one call. Per model, one graph per input
signature (the structure of the arguments, every tensor's shape, strides, dtype and device, every other
argument's value), at most MAX_GRAPHS of them, all in one memory pool. The first call of a signature runs
eager (it compiles the Triton kernels and fills the launch plans); the second runs eager too, watched: if it
changed the model as it ran (rebound an attribute, wrote one of the model's tensors, drew random numbers) the
signature stays eager, since a replay would do none of that; else the forward is captured from static copies of
its inputs; later calls copy their inputs into those and replay. Outputs are returned as fresh tensors (a
classifier-free-guidance pipeline keeps one call's output while it makes the next call), so what a caller
gets is what the eager forward would have returned.

A call runs the eager forward instead (the first time for a reason, a log line says why) where a replay might
not compute what the forward computes:
* autograd (grad mode with an input or parameter that requires grad); a model not on a CUDA device, or an input
  on another device; an argument that is neither a tensor nor a plain value (it could change what the forward
  does without changing the signature);
* the model changed since the capture: a parameter or buffer replaced, re-laid or written in place (a LoRA
  loaded or fused, new weights loaded), a module added, removed, renamed or replaced (or its class swapped), a
  hook added, removed or swapped, a forward or attention processor replaced (or a processor's backend or
  parallel setting), kernels injected or removed, a module's plain or container setting changed (train/eval,
  a LoRA's scale, peft's active adapters), or a process-wide setting: diffusers' attention backend, the FP8
  GEMMs' fast accumulation, autocast, matmul precision, TF32 and reduced-precision switches, SDPA's backend
  switches, deterministic algorithms. A fingerprint of all of this is taken at capture and compared on every
  call (flat lists over the modules; about 3 ms of a 2-core CPU for SD3.5-medium's thousand modules); after a
  change the signature's graph is dropped and captured again. To keep that host time off the GPU's critical
  path, a call first checks the part memory safety rests on (under a third of the cost: settings, every module's
  __dict__, every tensor the modules hold the same object at the same address, shape and strides, every
  container attribute the same object, those that held tensors holding the same ones at any depth), queues the
  replay,
  then compares the rest while the GPU works; a replay whose comparison fails is waited for and dropped (its
  result never handed out) and the call runs eager (a captured forward changed nothing torch can see when it
  was watched, see above, so a dropped replay leaves nothing of that kind behind). Not seen by any of this: tensors a forward reads from
  outside the modules' parameters, buffers, tensor attributes and containers (an attention processor's own
  tensors, a global cache) replaced after the capture, and writes torch does not count (through ``.data``, by a
  Triton kernel into a model tensor, into an inference tensor): a forward that makes those is not one to replay;
* accelerate's hooks or a diffusers hook (offloading, caching and parallelism hooks change what a call does or
  move weights between calls; the empty HookRegistry a pipeline puts on its transformer is no hook), global
  module hooks; a signature refused for such a hook is tried again once the model changed (the hook removed);
* an input whose elements overlap in memory (other than a broadcast, which is copied once per element), or an
  output that is not made of tensors and plain values in containers torch's pytree knows (a replay could not
  hand each caller fresh tensors);
* a forward that synchronises with the host (a value read back, a data-dependent shape: found by a run with
  torch.cuda's sync debug mode set to "error" before the capture, since a capture that fails that way would
  leave the CUDA generator unusable) or whose capture fails: that signature stays eager; a forward that writes into one of its inputs: that signature stays eager (the replay would write
  into the static copy, not the caller's tensor);
* more signatures than MAX_GRAPHS: the others run eager.

ROCm: PyTorch exposes HIP graphs through the same torch.cuda.CUDAGraph API; nothing here is specific to
NVIDIA. What this file promises was measured on NVIDIA H200 and H100 GPUs only (records in examples/).
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

import injection_common as ic  # noqa: E402

__all__ = ["enable", "disable", "enabled", "graph_stats", "MAX_GRAPHS", "BACKEND", "CudaGraphs"]

logger = logging.getLogger("graph_mode")

STATE = ic.register_state_key("_rtk_graphs")
MAX_GRAPHS = 4  # signatures captured per model; more run eager (a pipeline uses one or two)
WARMUP_CALLS = 1  # eager calls of a signature before it is captured
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


class CudaGraphs:
    """How graphs are made and replayed: torch.cuda's CUDA (HIP on ROCm) graphs. A test may put another object
    with these three methods in BACKEND (the CPU tests replay by running the forward again)."""

    def usable(self, device: torch.device) -> bool:
        return device.type == "cuda" and torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing()

    def settle(self, device: torch.device) -> None:
        """Wait for the work queued on device (a dropped replay: its graph is freed only once it has run)."""
        torch.cuda.current_stream(device).synchronize()

    def capture(self, forward, args, kwargs, graphs):
        """(replay, out): the forward captured on these (static) inputs; replay() reruns it into out."""
        if graphs.pool is None:
            graphs.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # On a side stream, as torch.cuda.graph's documentation asks, and with host synchronisations made
        # errors: a forward that waits for a value on the device (.item(), a data-dependent shape) cannot be
        # captured, and a capture that fails that way leaves the CUDA generator in capture state for the rest
        # of the process. Such a forward is refused here, before any capture starts.
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs.pool):
            out = forward(*args, **kwargs)
        return graph.replay, out


BACKEND = CudaGraphs()


class _Graphs:
    """A model's graphs: signature -> _Entry, the calls seen per signature, the reasons a call ran eager."""

    def __init__(self):
        self.entries = collections.OrderedDict()
        self.seen = collections.Counter()
        self.refused = {}  # signature -> why it stays eager
        self.recheck = {}  # signature -> the model's snapshot, for a refusal that holds only while it is unchanged
        self.reasons = collections.Counter()  # why calls ran eager (for graph_stats)
        self.replays = 0
        self.pool = None

    def __deepcopy__(self, memo):  # a copy of the model captures its own graphs
        return _Graphs()

    def __reduce__(self):  # graphs do not pickle: a loaded model captures again
        return _Graphs, ()


class _Entry:
    __slots__ = ("replay", "static", "out", "fingerprint", "writes")

    def __init__(self, replay, static, out, fingerprint, writes):
        self.replay, self.static, self.out, self.fingerprint = replay, static, out, fingerprint
        self.writes = writes  # per input: (the part of its static copy a call writes, the index that reads it)


def _elements_once(t):
    """(index, overlap): the index that reads each element of t's memory once (t itself: None; a broadcast input,
    t.expand(...) as pipelines pass a timestep, has stride-0 dimensions, read at their first position), and
    whether that part still overlaps itself (no static copy can hold such an input: its signature stays eager)."""
    if all(st or n <= 1 for st, n in zip(t.stride(), t.shape)):
        index, part = None, t
    else:
        index = tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for st, n in zip(t.stride(), t.shape))
        part = t[index]
    # No overlap if, taking the dimensions by increasing stride, each stride exceeds the reach of the smaller
    # ones (a sufficient test: it may refuse an unusual layout that does not overlap, never pass one that does).
    reach = 0
    for st, n in sorted((st, n) for st, n in zip(part.stride(), part.shape) if n > 1):
        if st <= reach:
            return index, True
        reach += st * (n - 1)
    return index, False


def _signature(args, kwargs):
    """(key, tensor leaves, (leaves, spec)) of a call, or (None, reason, None) where an argument cannot be
    keyed."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key, tensors = [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if type(leaf) not in (torch.Tensor, torch.nn.Parameter):
                return None, f"a {type(leaf).__name__} argument", None
            key.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
            tensors.append(leaf)
        elif isinstance(leaf, _PLAIN):
            key.append((type(leaf), leaf))
        else:
            return None, f"an argument of type {type(leaf).__name__}", None
    return (str(spec), tuple(key), torch.is_inference_mode_enabled()), tensors, (leaves, spec)


_SETTINGS = (int, float, bool, str, type(None))


def _global_settings() -> tuple:
    """Process-wide settings a forward reads at capture: diffusers' attention backend, the FP8 GEMMs' fast
    accumulation, autocast, matmul precision and reduced-precision switches, SDPA's backend switches, the
    deterministic-algorithm switch."""
    reg = getattr(sys.modules.get("diffusers.models.attention_dispatch"), "_AttentionBackendRegistry", None)
    fp8 = sys.modules.get("fp8_linear")
    cuda = torch.backends.cuda
    return (
        getattr(reg, "_active_backend", None),
        getattr(fp8, "FAST_ACCUMULATION", None),
        torch.is_autocast_enabled("cuda"),
        torch.get_autocast_dtype("cuda"),
        torch.is_autocast_cache_enabled(),
        torch.get_float32_matmul_precision(),
        cuda.matmul.allow_tf32,
        cuda.matmul.allow_bf16_reduced_precision_reduction,
        cuda.matmul.allow_fp16_reduced_precision_reduction,
        torch.backends.cudnn.allow_tf32,
        cuda.flash_sdp_enabled(),
        cuda.mem_efficient_sdp_enabled(),
        cuda.math_sdp_enabled(),
        cuda.cudnn_sdp_enabled(),
        torch.are_deterministic_algorithms_enabled(),
    )


_CONTAINERS = (dict, list, tuple, set, frozenset)  # (and their subclasses: OrderedDict, namedtuples, ...)
# nn.Module's own bookkeeping in a module's __dict__ (hooks are compared on their own; the rest is static)
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


def _contents(v) -> tuple:
    """(tokens, objects) of a container attribute's value, walked without recursion, each container once: a
    plain value as (type, value), a container as (type, length) with its identity among the objects, anything
    else (a tensor, a module, a function) among the objects (compared by identity; the snapshot keeps them
    alive). A value that is no longer a container (deleted, set to None) is an object: unequal to any recorded
    container. More than _MAX_CONTAINED containers: _Opaque."""
    tokens, objects, stack, seen = [], [], [v], set()
    while stack:
        x = stack.pop()
        t = type(x)
        if t in _SETTINGS or t is torch.dtype or t is torch.device:
            tokens.append((t, x))
        elif isinstance(x, _CONTAINERS):
            objects.append(x)
            if id(x) in seen:  # shared, or holding itself: walked once
                tokens.append((t, "again"))
                continue
            seen.add(id(x))
            if len(seen) > _MAX_CONTAINED:
                raise _Opaque(f"container attributes holding over {_MAX_CONTAINED} containers")
            tokens.append((t, len(x)))
            stack.extend(reversed([i for kv in x.items() for i in kv] if isinstance(x, dict) else list(x)))
        else:
            tokens.append((object,))
            objects.append(x)
    return tokens, objects


# settings of an attention processor that its forward reads (diffusers' per-processor backend and parallelism)
_PROCESSOR_SETTINGS = ("_attention_backend", "_parallel_config")


_DICT = operator.attrgetter("__dict__")
_CHILDREN, _PARAMS, _BUFFERS = (operator.attrgetter(a) for a in ("_modules", "_parameters", "_buffers"))
_HOOKS, _PRE_HOOKS = operator.attrgetter("_forward_hooks"), operator.attrgetter("_forward_pre_hooks")
_VERSION, _GRAD, _PTR = (
    operator.attrgetter("_version"),
    operator.attrgetter("requires_grad"),
    operator.methodcaller("data_ptr"),
)
_SHAPE, _STRIDE = operator.attrgetter("shape"), operator.methodcaller("stride")


def _versions(tensors) -> list:
    try:
        return list(map(_VERSION, tensors))
    except RuntimeError:  # an inference tensor has no version counter (an in-place write to it is not seen)
        return [None if t.is_inference() else t._version for t in tensors]


def _ptrs(tensors) -> list:
    try:
        return list(map(_PTR, tensors))
    except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage: its identity only
        return [_ptr(t) for t in tensors]


def _ptr(t):
    try:
        return t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(mods, tensor_dicts, tensor_keys) -> tuple:
    """(plain tensor attributes, every tensor: parameters, buffers, those attributes) of the modules."""
    chain, get, rep = itertools.chain.from_iterable, dict.get, itertools.repeat
    attributes = list(map(get, tensor_dicts, tensor_keys, rep(_MISSING)))
    tensors = [
        t for t in chain(map(dict.values, list(map(_PARAMS, mods)) + list(map(_BUFFERS, mods)))) if t is not None
    ]
    return attributes, tensors + [t for t in attributes if isinstance(t, torch.Tensor)]


def _state(mods, dicts, plain_dicts, plain_keys, box_dicts, box_keys, tensor_dicts, tensor_keys) -> tuple:
    """What _snapshot records of the modules mods (their __dict__s in dicts), as flat lists: each built by
    map() over the modules, so that comparing two of them costs the host little per module."""
    chain, get, rep = itertools.chain.from_iterable, dict.get, itertools.repeat
    children, params, buffers = list(map(_CHILDREN, mods)), list(map(_PARAMS, mods)), list(map(_BUFFERS, mods))
    hooks, pre_hooks = list(map(_HOOKS, mods)), list(map(_PRE_HOOKS, mods))
    attributes, tensors = _tensors(mods, tensor_dicts, tensor_keys)
    contents = [_contents(b) for b in map(get, box_dicts, box_keys, rep(_MISSING))]
    tensors += [o for c in contents for o in c[1] if isinstance(o, torch.Tensor)]  # (their versions, layouts)
    processors = [p for p in map(get, dicts, rep("processor")) if p is not None]
    plain = list(map(get, plain_dicts, plain_keys, rep(_MISSING)))
    return (
        list(map(type, mods)),
        list(map(get, dicts, rep("forward"))),
        processors,
        [getattr(p, "_parallel_config", None) for p in processors],
        list(chain(map(dict.values, children))),
        list(chain(map(dict.values, params))),
        list(chain(map(dict.values, buffers))),
        attributes,
        [o for c in contents for o in c[1]],
        tensors,
    ), (
        list(map(len, dicts)),
        list(map(len, children)),
        list(map(len, params)),
        list(map(len, buffers)),
        list(chain(map(dict.keys, children + params + buffers))),
        list(map(len, hooks)),
        list(map(len, pre_hooks)),
        list(chain(map(dict.keys, filter(None, hooks + pre_hooks)))),  # handle ids: a hook swapped is seen
        [getattr(p, "_attention_backend", None) for p in processors],
        plain,
        list(map(type, plain)),
        [c[0] for c in contents],
        _versions(tensors),
        _ptrs(tensors),
        list(map(_SHAPE, tensors)),
        list(map(_STRIDE, tensors)),
        list(map(_GRAD, tensors)),
    )


def _snapshot(model) -> tuple:
    """What a replay depends on besides the inputs: the process-wide settings, and per module its identity,
    children, instance forward, processor, hook counts, number of attributes, plain settings (training, eps, a
    LoRA's scale or active adapters) and tensors (parameters, buffers and plain tensor attributes: identity,
    storage, version, requires_grad); and what _replayable compares before a replay (the tensors' identities,
    addresses, shapes and strides, the container attributes' identities), holding the tensors found one level
    inside those containers so that a replay queued before the full comparison reads live memory."""
    mods = list(model.modules())
    dicts = list(map(_DICT, mods))
    plain = [(d, k) for d in dicts for k, v in d.items() if type(v) in _SETTINGS]
    attributes = [(d, k) for d in dicts for k, v in d.items() if isinstance(v, torch.Tensor)]
    skip = _MODULE_INTERNALS.union(ic.STATE_KEYS)  # (the bundle's own records: their forwards are compared)
    boxes = [(d, k) for d in dicts for k, v in d.items() if isinstance(v, _CONTAINERS) and k not in skip]
    where = (mods, dicts, [d for d, _ in plain], [k for _, k in plain], [d for d, _ in boxes], [k for _, k in boxes])
    where += ([d for d, _ in attributes], [k for _, k in attributes])
    state = _state(*where)
    boxed = _boxes(where)
    # the containers that held tensors at the capture: the only ones whose tensors a replay can read
    held = [i for i, b in enumerate(boxed) if _leaves([b])]
    tensors = _tensors(mods, where[6], where[7])[1] + _leaves([boxed[i] for i in held])
    guard = (tensors, _ptrs(tensors), list(map(_SHAPE, tensors)), list(map(_STRIDE, tensors)), boxed, held)
    return _global_settings(), where, state, guard


def _boxes(where) -> list:
    return list(map(dict.get, where[4], where[5], itertools.repeat(_MISSING)))


_MAX_CONTAINED = 100_000  # values walked in the container attributes; beyond: _Opaque (the signature stays eager)


class _Opaque(Exception):
    """Container attributes graph mode does not walk (too many): no replay."""


def _leaves(boxes) -> list:
    """The tensors inside the container attributes (dict, list, tuple, set and their subclasses), at any depth."""
    out, stack, seen = [], list(boxes), set()
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (dict, list, tuple, set, frozenset)):
            if id(v) in seen:  # shared, or holding itself: walked once
                continue
            if len(seen) > _MAX_CONTAINED:
                raise _Opaque(f"container attributes holding over {_MAX_CONTAINED} containers")
            seen.add(id(v))
            stack.extend(v.values() if isinstance(v, dict) else v)
    return out


def _replayable(model, snap) -> bool:
    """The part of _unchanged that a replay's memory safety rests on, cheap enough to run before it (a fraction
    of the full comparison): the process-wide settings, every recorded module's __dict__, and every tensor the
    modules hold (the same objects at the same addresses, shapes and strides: alive, so what the graph reads from
    them is live memory) and container attribute (the same objects; those that held tensors at the capture
    holding the same tensors at any depth)."""
    settings, where, _, (tensors, ptrs, shapes, strides, boxes, held) = snap
    if where[0][0] is not model or _global_settings() != settings or not _same(list(map(_DICT, where[0])), where[1]):
        return False
    now_boxes = _boxes(where)
    try:  # (a container that cannot be walked: not replayable)
        now = _tensors(where[0], where[6], where[7])[1] + (_leaves([now_boxes[i] for i in held]) if held else [])
    except Exception:
        return False
    return (
        _same(now, tensors)
        and _same(now_boxes, boxes)
        and _ptrs(now) == ptrs
        and list(map(_SHAPE, now)) == shapes
        and list(map(_STRIDE, now)) == strides
    )


def _same(a, b) -> bool:
    """Whether two lists hold the same objects, in order (identity: tensors' == is elementwise)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _unchanged(model, snap) -> bool:
    """Whether model is as _snapshot found it. Every module reachable from model is reached through children
    found identical to the snapshot's (from model itself down), so comparing the recorded modules' state sees a
    module added, removed or replaced anywhere."""
    settings, where, (objects, values), _guard = snap
    if where[0][0] is not model or _global_settings() != settings or not _same(list(map(_DICT, where[0])), where[1]):
        return False
    now_objects, now_values = _state(*where)
    return now_values == values and all(map(_same, now_objects, objects))


_MISSING = object()


def _why_eager(model, tensors) -> str:
    """Why this call must run the eager forward ("" if a graph may serve it)."""
    if not ic.hook_free(model) or "_hf_hook" in model.__dict__ or ic.diffusers_hooked(model):
        return "a hook on the model (offloading, caching, a torch hook)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "autograd"
    device = next((t.device for t in tensors), None)
    if device is None or any(t.device != device for t in tensors) or not BACKEND.usable(device):
        return "inputs not on one CUDA device (or a capture already in progress)"
    return ""


def _graph_forward(self, *args, **kwargs):
    """The model's forward through its graphs (see the module docstring); the eager forward where they
    cannot serve the call."""
    graphs = self.__dict__[STATE]["graphs"]
    key, tensors, tree = _signature(args, kwargs)
    why = tensors if key is None else _why_eager(self, tensors)
    if not why:
        why = graphs.refused.get(key, "")
        if why and key in graphs.recheck and not _unchanged(self, graphs.recheck[key]):
            del graphs.refused[key], graphs.recheck[key]  # refused for a hook the model had: it changed since
            graphs.seen[key], why = 0, ""
    if why:
        return _eager(self, graphs, why, args, kwargs)
    if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
        return _eager(self, graphs, "autograd", args, kwargs)
    entry = graphs.entries.get(key)
    if entry is not None:
        if _replayable(self, entry.fingerprint):
            for (part, index), t in zip(entry.writes, tensors):
                part.copy_(t if index is None else t[index])
            entry.replay()  # queued first: the full comparison runs on the host while the GPU replays
            if _still_unchanged(self, entry.fingerprint):
                graphs.replays += 1
                return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, entry.out)
            BACKEND.settle(tensors[0].device)  # the dropped replay has run before its graph is freed
        del graphs.entries[key]  # the model changed since the capture: capture again
        graphs.seen[key] = 0
        graphs.reasons["model changed since capture"] += 1
    graphs.seen[key] += 1
    if graphs.seen[key] <= WARMUP_CALLS:
        return _eager(self, graphs, "", args, kwargs)  # warm-up: compiles kernels, fills plans
    if len(graphs.entries) >= MAX_GRAPHS:
        return _eager(self, graphs, f"more than {MAX_GRAPHS} input signatures", args, kwargs)
    # This call's result is the eager forward's, watched: a forward that changes the model as it runs (rebinds an
    # attribute, writes one of its tensors, draws random numbers) cannot be replayed (a replay would compute with
    # what the capture's forwards left, and do none of it), so its signature stays eager; else it is captured.
    device = tensors[0].device
    try:
        before = _snapshot(self)
    except Exception as e:  # (too many containers, or one that raises when walked)
        graphs.refused[key] = f"the model's attributes cannot be compared ({type(e).__name__}: {str(e)[:80]})"
        return _eager(self, graphs, graphs.refused[key], args, kwargs)
    versions, rng = _versions(before[3][0]), _rng_state(device)
    out = _eager(self, graphs, "", args, kwargs)
    if (
        not _still_unchanged(self, before)
        or _versions(before[3][0]) != versions
        or not torch.equal(_rng_state(device), rng)
    ):
        graphs.refused[key] = "the forward changes the model's state (an attribute, a tensor, the random generator)"
        logger.info("%s: %s; this signature runs eager", type(self).__name__, graphs.refused[key])
        return out
    _capture(self, graphs, key, tensors, tree, before)
    return out


def _still_unchanged(model, snap) -> bool:
    try:
        return _unchanged(model, snap)
    except Exception:  # something in the model no longer compares (an odd value): treat it as changed
        return False


def _rng_state(device: torch.device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _eager(model, graphs, why, args, kwargs):
    if why and not graphs.reasons[why]:
        logger.info("%s: eager forward (%s)", type(model).__name__, why)
    if why:
        graphs.reasons[why] += 1
    return ic.original(model)(*args, **kwargs)


def _offloaded(model, device) -> str:
    """Why model's weights may move between calls (offloading or parallelism hooks, tensors off device), or ""."""
    for m in model.modules():
        if "_hf_hook" in m.__dict__ or ic.diffusers_hooked(m):
            return f"an accelerate or diffusers hook on {type(m).__name__} (offloading, caching, parallelism)"
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None and t.device != device:
                return f"a tensor of {type(m).__name__} on {t.device}, not {device}"
    return ""


def _capture(model, graphs, key, tensors, tree, fingerprint):
    """Capture the forward on static copies of this call's inputs; None (and the reason in graphs.refused)
    where it cannot be captured."""
    why = _offloaded(model, tensors[0].device)
    if why:
        graphs.refused[key], graphs.recheck[key] = why, _snapshot(model)  # (until the model changes)
        return None
    layout = [_elements_once(t) for t in tensors]
    if any(overlap for _, overlap in layout):
        graphs.refused[key] = "an input whose elements overlap in memory"
        return None
    with torch.inference_mode(False):  # static copies with version counters, also for a call in inference mode
        static = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in tensors]
    writes = [(s if index is None else s[index], index) for s, (index, _) in zip(static, layout)]
    for (part, index), t in zip(writes, tensors):
        part.copy_(t if index is None else t[index])
    leaves, spec = tree
    copies = iter(static)
    args, kwargs = pytree.tree_unflatten([next(copies) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
    versions = [s._version for s in static]
    try:
        replay, out = BACKEND.capture(ic.original(model), args, kwargs, graphs)
    except Exception as e:  # data-dependent control flow, a host sync, an op that cannot be captured
        graphs.refused[key] = f"the capture failed ({type(e).__name__}: {str(e)[:120]})"
        logger.info("%s: %s; this signature runs eager", type(model).__name__, graphs.refused[key])
        return None
    if [s._version for s in static] != versions:
        graphs.refused[key] = "the forward writes into one of its inputs"
        return None
    odd = [type(x).__name__ for x in pytree.tree_leaves(out) if not isinstance(x, (torch.Tensor, *_PLAIN))]
    if odd:  # a replay could not hand each caller fresh tensors inside it
        graphs.refused[key] = f"an output graph mode cannot copy (a {odd[0]})"
        return None
    entry = _Entry(replay, static, out, fingerprint, writes)
    graphs.entries[key] = entry
    return entry


def enable(model: torch.nn.Module) -> bool:
    """Serve model's forward from CUDA graphs (see the module docstring); False if it already is."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"graph_mode.enable takes a torch.nn.Module, got {type(model).__name__}")
    if STATE in model.__dict__:
        return False
    if ic.bundle_state(model) is not None:
        raise ValueError(
            f"{type(model).__name__}'s forward is patched by another part of the bundle; graph mode wraps a model "
            "whose own forward is its class's (the injections patch its blocks and modules, not the model itself)"
        )
    return ic.patch_forward(model, _graph_forward, "graphs", STATE, graphs=_Graphs())


def disable(model: torch.nn.Module) -> bool:
    """Take graph mode off model, freeing its graphs; False if it was not on."""
    state = ic.unpatch(model, STATE)
    if state is None:
        return False
    state["graphs"].entries.clear()
    return True


def enabled(model) -> bool:
    return STATE in getattr(model, "__dict__", {})


def graph_stats(model) -> dict:
    """{"graphs": captured signatures, "replays": calls served by a graph, "eager": {reason: calls}}."""
    st = model.__dict__.get(STATE)
    if st is None:
        return {"graphs": 0, "replays": 0, "eager": {}}
    g = st["graphs"]
    return {"graphs": len(g.entries), "replays": g.replays, "eager": dict(g.reasons)}


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(
        description="Graph mode for a transformer's forward (nothing to run on its own): graph_mode.enable(model), or "
        "diffusers_injection.inject_optimized_kernels(pipe, graphs=True); benchmark_e2e.py --mode triton+graphs times "
        "it, and the main job (ltx_kernel_injection_example.py) uses it on a GPU by default."
    ).parse_args()

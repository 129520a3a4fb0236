# SPDX-License-Identifier: Apache-2.0
"""Graph mode (scripts/graph_mode.py): which calls a graph serves and which run eager. On the CPU the capture
is a stand-in backend that replays by running the forward again into the captured outputs, so everything but
the CUDA graph itself is exercised: signatures, warm-up, static inputs, fresh outputs, the model-change checks,
the refusals. On a GPU the same tests run with real CUDA graphs."""

import copy
import dataclasses
import types

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.normalization import RMSNorm
from torch import nn
from torch.utils import _pytree as pytree

import diffusers_injection as di
import graph_mode
from kernel_testing import DEVICE, make_generator

GPU = DEVICE.type == "cuda"


class ReplayByRunning:
    """A capture that records the forward and replays it by running it again on the static inputs."""

    def __init__(self):
        self.captures = 0

    def usable(self, device):
        return True

    def settle(self, device):
        self.settled = getattr(self, "settled", 0) + 1

    capturing = False

    def capture(self, forward, args, kwargs, graphs):
        self.captures += 1
        self.capturing = True
        try:
            out = forward(*args, **kwargs)
        finally:
            self.capturing = False

        def replay():
            for dst, src in zip(pytree.tree_leaves(out), pytree.tree_leaves(forward(*args, **kwargs))):
                dst.copy_(src)

        return replay, out


@pytest.fixture
def backend(monkeypatch):
    if GPU:
        return None
    fake = ReplayByRunning()
    monkeypatch.setattr(graph_mode, "BACKEND", fake)
    return fake


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = RMSNorm(16, eps=1e-6)
        self.post = nn.Sequential(nn.Identity())  # a grandchild
        self.register_buffer("offset", torch.zeros(16))
        self.scale = 1.0  # a plain setting its forward reads
        self.options = {"mult": 1.0}  # a container setting its forward reads
        self.tags = ["a", "b"]  # a container setting its forward does not read

    def forward(self, x, cond=None, flag=True):
        y = self.post(self.norm(self.lin(x)) + self.offset + self.shift) * (self.scale * self.options["mult"])
        return (y + cond if cond is not None else y), y.sum(-1)


def _net(gen):
    torch.manual_seed(gen.seed_value)
    net = Net().to(DEVICE).eval().requires_grad_(False)
    net.shift = torch.zeros(16, device=DEVICE)  # a plain tensor attribute its forward reads (not a buffer)
    return net


def _x(gen, *shape):
    return torch.randn(*shape, generator=gen).to(DEVICE)


def test_second_call_is_captured_and_later_calls_replay_with_new_inputs(backend):
    gen = make_generator()
    net = _net(gen)
    xs = [_x(gen, 2, 3, 16) for _ in range(4)]
    cs = [_x(gen, 2, 3, 16) for _ in range(4)]
    with torch.no_grad():
        wants = [net(x, cond=c) for x, c in zip(xs, cs)]
        graph_mode.enable(net)
        gots = [net(x, cond=c) for x, c in zip(xs, cs)]
    stats = graph_mode.graph_stats(net)
    assert stats["graphs"] == 1 and stats["replays"] == 2, (
        stats
    )  # call 1 eager (warm-up), 2 eager and captured; 3-4 replayed
    for got, want in zip(gots, wants):  # each call's own result, though the graph's outputs are reused
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    graph_mode.disable(net)


def test_returned_outputs_are_fresh_tensors(backend):
    """Two calls of one signature (a guidance pipeline's cond and uncond): the first result survives the second."""
    gen = make_generator()
    net = _net(gen)
    graph_mode.enable(net)
    with torch.no_grad():
        net(_x(gen, 1, 4, 16))
        a, b = _x(gen, 1, 4, 16), _x(gen, 1, 4, 16)
        ra = net(a)
        keep = ra[0].clone()
        net(b)
        assert torch.equal(ra[0], keep)
    graph_mode.disable(net)


@pytest.mark.parametrize(
    "change",
    [
        "weight_in_place", "weight_replaced", "weight_data_swapped", "requires_grad", "buffer_replaced",
        "module_replaced", "grandchild_replaced", "module_added", "hook_added", "forward_replaced", "setting",
        "container_setting", "train_mode", "processor",
        "container_deleted", "hook_swapped", "class_swapped", "weight_layout", "processor_backend",
        "active_adapter", "matmul_precision", "tensor_attribute_replaced", "tensor_attribute_in_place",
    ],
)  # fmt: skip
def test_a_model_changed_after_capture_is_captured_again(change, backend):
    gen = make_generator()
    net = _net(gen)
    norm = net.norm
    if change == "forward_replaced":  # an instance forward (as an injection sets) replaced by another
        norm.forward = lambda h: RMSNorm.forward(norm, h)
    hook = net.lin.register_forward_hook(lambda m, a, o: o * 0.5) if change == "hook_swapped" else None
    if change == "processor_backend":
        net.lin.__dict__["processor"] = types.SimpleNamespace(_attention_backend=None, _parallel_config=None)
    if change == "active_adapter":
        net.lin._active_adapter = ["a"]  # (peft's BaseTunerLayer keeps its active adapters here)
    precision = torch.get_float32_matmul_precision()
    graph_mode.enable(net)
    x = _x(gen, 2, 2, 16)
    with torch.no_grad():
        net(x), net(x), net(x)
        assert graph_mode.graph_stats(net)["graphs"] == 1
        if change == "weight_in_place":
            net.lin.weight.mul_(2)
        elif change == "weight_replaced":
            net.lin.weight = nn.Parameter(net.lin.weight * 3, requires_grad=False)
        elif change == "weight_data_swapped":  # same Parameter, other storage (no version bump)
            net.lin.weight.data = net.lin.weight.detach() * 3
        elif change == "requires_grad":
            net.lin.bias.requires_grad_(True)
        elif change == "buffer_replaced":
            net.offset = torch.full_like(net.offset, 0.5)
        elif change == "module_replaced":
            net.norm = RMSNorm(16, eps=1e-2).to(DEVICE)
        elif change == "grandchild_replaced":
            net.post[0] = nn.Identity()
        elif change == "module_added":
            net.lin.extra = nn.Identity()
        elif change == "forward_replaced":
            norm.forward = lambda h: RMSNorm.forward(norm, h) * 2
        elif change == "container_setting":
            net.options["mult"] = 0.5
        elif change == "container_deleted":
            del net.tags
        elif change == "hook_swapped":  # as many hooks as before, another one
            hook.remove()
            net.lin.register_forward_hook(lambda m, a, o: o * 0.25)
        elif change == "class_swapped":
            norm.__class__ = type("OtherNorm", (RMSNorm,), {"forward": lambda self, h: RMSNorm.forward(self, h) * 3})
        elif change == "weight_layout":  # the same storage read as its transpose
            net.lin.weight.data = net.lin.weight.data.t()
        elif change == "processor_backend":
            net.lin.processor._attention_backend = "_native_math"
        elif change == "active_adapter":
            net.lin._active_adapter = ["b"]
        elif change == "matmul_precision":
            torch.set_float32_matmul_precision("medium" if precision != "medium" else "high")
        elif change == "tensor_attribute_replaced":
            net.shift = torch.full_like(net.shift, 0.5)
        elif change == "tensor_attribute_in_place":
            net.shift.add_(0.5)
        elif change == "hook_added":
            net.lin.register_forward_hook(lambda m, a, o: o * 0.5)
        elif change == "setting":
            net.scale = 0.25
        elif change == "train_mode":
            net.norm.train()
        else:
            net.lin.__dict__["processor"] = object()
        got = net(x)
        stats = graph_mode.graph_stats(net)
        graph_mode.disable(net)
        want = net(x)  # the eager forward under the same settings (on a GPU the matmul precision changes it)
    torch.set_float32_matmul_precision(precision)
    assert stats["eager"].get("model changed since capture") == 1, stats
    assert all(torch.equal(a, b) for a, b in zip(got, want)), change


def test_the_full_comparison_runs_while_the_replay_runs_where_that_is_safe(backend, monkeypatch):
    """A steady call queues its replay, then compares the model with its capture (the comparison costs no GPU
    time). Before that replay, the cheap part of the comparison that memory safety rests on: a tensor swapped or
    re-laid (``.data``) stops it (no replay reads memory the model let go). A change only the full comparison sees
    drops the replay (waited for), and the call runs eager. A forward that writes the model's tensors (a running
    statistic) or rebinds an attribute is not captured (a replay would not do what it does). An inference-mode
    tensor attribute (no version counter) is no obstacle."""
    gen = make_generator()
    x = _x(gen, 2, 2, 16)
    order = []
    unchanged = graph_mode._unchanged
    monkeypatch.setattr(graph_mode, "_unchanged", lambda *a: order.append("compare") or unchanged(*a))

    def spy(net):
        entry = next(iter(net.__dict__[graph_mode.STATE]["graphs"].entries.values()))
        replay = entry.replay
        entry.replay = lambda: order.append("replay") or replay()
        return entry

    for change in ("data_swapped", "setting"):
        net = _net(gen)
        graph_mode.enable(net)
        with torch.no_grad():
            net(x), net(x)  # warm-up, capture
            spy(net)
            order.clear()
            net(x)
            assert order == ["replay", "compare"], order
            order.clear()
            if change == "data_swapped":
                net.lin.weight.data = net.lin.weight.detach() * 3
            else:
                net.scale = 0.25
            got = net(x)
        stats = graph_mode.graph_stats(net)
        assert order == ([] if change == "data_swapped" else ["replay", "compare"]), (change, order)
        assert stats["eager"] == {"model changed since capture": 1} and stats["replays"] == 1, (change, stats)
        if backend is not None:
            assert getattr(backend, "settled", 0) == (change == "setting")
            backend.settled = 0
        graph_mode.disable(net)
        with torch.no_grad():
            want = net(x)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), change

    class Counts(nn.Module):  # writes its own buffer: a replay would not count (and the capture call twice)
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros((), device=DEVICE))

        def forward(self, x):
            self.calls.add_(1)
            return x * 2

    class Remembers(nn.Module):  # rebinds an attribute: a replay would subtract what the capture's forward left
        def forward(self, x):
            out = x - getattr(self, "prev", 0)
            self.prev = x * 1
            return out

    for net in (Counts(), Remembers()):
        graph_mode.enable(net)
        ref = type(net)()
        ref.to(DEVICE)
        with torch.no_grad():
            for n in range(4):
                xn = x + n
                assert torch.equal(net(xn), ref(xn))
        stats = graph_mode.graph_stats(net)
        assert stats["graphs"] == 0 and any("changes the model's state" in r for r in stats["eager"]), stats
        graph_mode.disable(net)
    assert net.prev is not None and Counts().calls == 0

    net = _net(gen)  # a container attribute that holds itself (and a shared one): walked once, replayed
    net.ring = [1, 2]
    net.ring.append(net.ring)
    net.lin.shared = net.post.shared = [torch.ones(1, device=DEVICE)]
    graph_mode.enable(net)
    with torch.no_grad():
        outs = [net(x) for _ in range(3)]
    assert graph_mode.graph_stats(net)["replays"] == 1 and all(torch.equal(o[0], outs[0][0]) for o in outs)
    graph_mode.disable(net)

    net = _net(gen)  # a tensor inside a container attribute, at depth two, replaced: no replay reads the old one
    net.tables = {"rope": (torch.ones(16, device=DEVICE), torch.zeros(16, device=DEVICE))}
    graph_mode.enable(net)
    with torch.no_grad():
        net(x), net(x)
        spy(net)
        order.clear()
        net.tables["rope"] = (torch.full((16,), 2.0, device=DEVICE), torch.zeros(16, device=DEVICE))
        net(x)
    assert order == [] and graph_mode.graph_stats(net)["eager"] == {"model changed since capture": 1}, order
    graph_mode.disable(net)

    class Cached(nn.Module):  # a table made lazily in the forward: under inference mode, an inference tensor
        def forward(self, x):
            if getattr(self, "table", None) is None:
                self.table = torch.ones(x.shape[-1], device=x.device) * 3
            return x * self.table

    net = Cached()
    graph_mode.enable(net)
    with torch.inference_mode():
        outs = [net(x) for _ in range(3)]
    assert graph_mode.graph_stats(net)["replays"] == 1 and all(torch.equal(o, x * 3) for o in outs)
    graph_mode.disable(net)


def test_calls_a_graph_must_not_serve_run_eager(backend, monkeypatch):
    gen = make_generator()
    net = _net(gen)
    graph_mode.enable(net)
    x = _x(gen, 2, 2, 16)
    with torch.no_grad():
        net(x, flag=object()), net(x, flag=object())  # an argument that is no plain value
    assert graph_mode.graph_stats(net)["eager"] == {"an argument of type object": 2}
    x.requires_grad_(True)
    net(x), net(x)  # autograd
    assert graph_mode.graph_stats(net)["eager"]["autograd"] == 2
    monkeypatch.setattr(graph_mode, "MAX_GRAPHS", 2)
    with torch.no_grad():
        for n in range(1, 5):
            y = _x(gen, 1, n, 16)
            net(y), net(y)
    stats = graph_mode.graph_stats(net)
    assert stats["graphs"] == 2 and stats["eager"]["more than 2 input signatures"] == 2
    graph_mode.disable(net)


def test_a_capture_that_fails_or_writes_its_input_stays_eager(backend):
    class Writes(nn.Module):
        def forward(self, x):
            x.add_(1)
            return x * 2

    class Syncs(nn.Module):
        def forward(self, x):
            if GPU:
                return x * float(x.sum())  # a host synchronisation: no capture
            if graph_mode.BACKEND.capturing:  # (the stand-in capture raises as a CUDA capture would)
                raise RuntimeError("operation not permitted when stream is capturing")
            return x * 2

    gen = make_generator()
    for model, why in ((Writes(), "writes into one of its inputs"), (Syncs(), "the capture failed")):
        graph_mode.enable(model)
        with torch.no_grad():
            for _ in range(3):
                x = _x(gen, 3, 4)
                want = model.__class__.forward(model, x.clone())
                assert torch.equal(model(x), want)
        stats = graph_mode.graph_stats(model)
        assert stats["graphs"] == 0 and any(why in r for r in stats["eager"]), stats
        graph_mode.disable(model)


def test_offloading_hooks_stay_eager(backend):
    gen = make_generator()
    net = _net(gen)
    net.lin.__dict__["_hf_hook"] = object()  # as accelerate's offloading marks a module
    graph_mode.enable(net)
    with torch.no_grad():
        x = _x(gen, 2, 2, 16)
        net(x), net(x), net(x)
    stats = graph_mode.graph_stats(net)
    assert stats["graphs"] == 0 and any("accelerate or diffusers hook" in r for r in stats["eager"])
    graph_mode.disable(net)


def test_enable_disable_copy_and_the_router(backend):
    gen = make_generator()
    net = _net(gen)
    assert graph_mode.enable(net) and not graph_mode.enable(net)
    cp = copy.deepcopy(net)
    assert graph_mode.enabled(cp) and graph_mode.graph_stats(cp)["graphs"] == 0
    assert graph_mode.disable(net) and not graph_mode.disable(net)
    assert "forward" not in net.__dict__
    with pytest.raises(TypeError, match="torch.nn.Module"):
        graph_mode.enable("not a model")
    with pytest.raises(ValueError, match="graphs must be True or False"):
        di.inject_optimized_kernels(net, graphs=1)

    import mmdit_injection as mi

    flux = mi.build_flux_transformer("tiny", dtype=torch.float32, device=DEVICE, seed=gen.seed_value % 1000)
    kw = mi.make_mmdit_inputs(flux, 1, 32, 32, 4, torch.float32, DEVICE, gen.seed_value)
    with torch.no_grad():
        ref = flux(**kw)[0]
        counts = di.inject_optimized_kernels(flux, verbose=False, graphs=True)
        assert counts["graphs"] == 1 and graph_mode.enabled(flux)
        outs = [flux(**kw)[0] for _ in range(3)]
        assert graph_mode.graph_stats(flux)["replays"] == 1
        assert all(float((o - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) for o in outs)
        assert di.remove_optimized_kernels(flux, verbose=False)["graphs"] == 1
        assert not graph_mode.enabled(flux) and torch.equal(flux(**kw)[0], ref)


class _Halve(ModelHook):
    def post_forward(self, module, output):
        return tuple(o * 0.5 for o in output)


def test_an_empty_diffusers_hook_registry_is_no_hook(backend):
    """diffusers' pipelines put an empty HookRegistry on the transformer at their first call (cache_context):
    it wraps nothing, so graphs serve the calls; a hook registered in it later makes the calls eager."""
    gen = make_generator()
    net = _net(gen)
    graph_mode.enable(net)
    HookRegistry.check_if_exists_or_initialize(net)  # as a pipeline's cache_context does
    x = _x(gen, 2, 2, 16)
    with torch.no_grad():
        net(x), net(x), net(x)
        assert graph_mode.graph_stats(net)["replays"] == 1, graph_mode.graph_stats(net)  # (warm-up, capture, replay)
        HookRegistry.check_if_exists_or_initialize(net).register_hook(_Halve(), "halve")
        got = net(x)
        stats = graph_mode.graph_stats(net)
        assert stats["replays"] == 1 and stats["eager"].get("a hook on the model (offloading, caching, a torch hook)")
        HookRegistry.check_if_exists_or_initialize(net).remove_hook("halve")
        graph_mode.disable(net)
        want = net(x)
    assert all(torch.equal(a, b * 0.5) for a, b in zip(got, want))


def test_the_ltx_pipeline_replays_its_transformer(backend):
    """Through the pipeline's own loop (with its cache_context): after the warm-up and the capture, every
    transformer call is a replay, and the latents are the eager injected pipeline's."""
    import argparse

    import ltx_kernel_injection_example as ex

    pipe = di.build_tiny_ltx_pipeline(seed=make_generator().seed_value % 1000).to(DEVICE)
    pipe.set_progress_bar_config(disable=True)
    args = argparse.Namespace(num_frames=9, height=32, width=32, steps=3, seed=0)
    di.inject_optimized_kernels(pipe, verbose=False)
    want = ex.generate(pipe, args, DEVICE.type)[0]
    di.remove_optimized_kernels(pipe, verbose=False)
    di.inject_optimized_kernels(pipe, verbose=False, graphs=True)
    runs = [ex.generate(pipe, args, DEVICE.type)[0] for _ in range(2)]
    stats = graph_mode.graph_stats(pipe.transformer)
    assert stats["graphs"] == 1 and stats["replays"] >= 3, stats  # (first run: warm-up, capture, one replay)
    assert all(torch.equal(r, want) for r in runs)
    di.remove_optimized_kernels(pipe, verbose=False)


def test_inference_mode_sliced_inputs_odd_outputs_and_a_hook_removed(backend):
    """Calls in torch.inference_mode() are captured and replayed; an input that is a slice of a larger tensor
    (strided, not overlapping) is captured; an output that is not a tensor container graph mode can copy stays
    eager; a signature refused for an offloading hook is captured once the hook is gone."""
    gen = make_generator()
    net = _net(gen)
    graph_mode.enable(net)
    wide = _x(gen, 2, 2, 32)
    x = wide[..., :16]  # rows strided by 32
    with torch.inference_mode():
        outs = [net(x) for _ in range(3)]
    stats = graph_mode.graph_stats(net)
    assert stats["graphs"] == 1 and stats["replays"] == 1 and not stats["eager"], stats
    graph_mode.disable(net)
    with torch.no_grad():
        want = net(x)
    assert all(torch.equal(a, b) for o in outs for a, b in zip(o, want))

    @dataclasses.dataclass
    class Out:  # not a pytree node: a replay would hand every caller the same tensor
        y: torch.Tensor

    class Odd(nn.Module):
        def forward(self, h):
            return Out(h * 2)

    odd = Odd()
    graph_mode.enable(odd)
    with torch.no_grad():
        ys = [odd(x).y for _ in range(3)]
    assert ys[0] is not ys[1] and torch.equal(ys[2], x * 2)
    stats = graph_mode.graph_stats(odd)
    assert stats["graphs"] == 0 and any("an output graph mode cannot copy" in r for r in stats["eager"]), stats

    net = _net(gen)
    net.lin.__dict__["_hf_hook"] = object()
    graph_mode.enable(net)
    with torch.no_grad():
        net(x), net(x), net(x)
        assert graph_mode.graph_stats(net)["graphs"] == 0
        del net.lin.__dict__["_hf_hook"]
        net(x), net(x), net(x)
    assert graph_mode.graph_stats(net)["graphs"] == 1 and graph_mode.graph_stats(net)["replays"] == 1


def test_container_attributes_of_any_name_size_and_kind_are_compared(backend):
    """Container attributes are compared by content, whatever their name (a private ``_cache``), size or kind
    (a set, an OrderedDict): a forward that updates one as it runs stays eager; one changed after the capture is
    seen; a private one-slot cache rebuilt for another input size stops the other size's replay (its graph read
    the old table). Each call's result is the eager forward's."""
    import collections

    gen = make_generator()

    class Every3rd(nn.Module):  # private state updated by the forward: a replay would not update it
        def __init__(self):
            super().__init__()
            self._state = {"n": 0}

        def forward(self, x):
            self._state["n"] += 1
            return x * (4 if self._state["n"] % 3 == 0 else 2)

    net, ref = Every3rd(), Every3rd()
    graph_mode.enable(net)
    x = _x(gen, 2, 4)
    with torch.no_grad():
        assert all(torch.equal(net(x), ref(x)) for _ in range(6))
    assert graph_mode.graph_stats(net)["graphs"] == 0
    graph_mode.disable(net)

    for change in ("big_dict", "set", "ordered"):
        net = _net(gen)
        net.options = {f"k{i}": 1.0 for i in range(20)} | {"mult": 1.0}  # the forward reads options["mult"]
        net.skip, net.order = set(), collections.OrderedDict(a=1)
        graph_mode.enable(net)
        x = _x(gen, 2, 2, 16)
        with torch.no_grad():
            net(x), net(x), net(x)
            if change == "big_dict":
                net.options["mult"] = 3.0
            elif change == "set":
                net.skip.add(1)
            else:
                net.order["b"] = 2
            got = net(x)
            stats = graph_mode.graph_stats(net)
            graph_mode.disable(net)
            want = net(x)
        assert stats["eager"] == {"model changed since capture": 1}, (change, stats)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), change

    class OneSlot(nn.Module):  # a private cache that keeps the table of the last size only
        def __init__(self):
            super().__init__()
            self._tables = {}

        def forward(self, x):
            n = x.shape[-1]
            if n not in self._tables:
                self._tables = {n: torch.arange(n, dtype=x.dtype, device=x.device)}
            return x + self._tables[n]

    net = OneSlot()
    graph_mode.enable(net)
    a, b = _x(gen, 2, 8), _x(gen, 2, 5)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(net(a), a + torch.arange(8.0, device=DEVICE))
        assert torch.equal(net(b), b + torch.arange(5.0, device=DEVICE))  # rebuilds the cache
        replays = graph_mode.graph_stats(net)["replays"]
        assert torch.equal(net(a), a + torch.arange(8.0, device=DEVICE))  # a's graph read the old table: eager
    assert graph_mode.graph_stats(net)["replays"] == replays
    graph_mode.disable(net)


def test_a_tensor_in_a_container_moved_or_an_unwalkable_container(backend):
    """A tensor inside a container attribute re-laid through .data (another address) stops the replay, as a
    parameter's does (the graph would read its old memory); a container that raises when walked keeps the
    signature eager instead of crashing the call."""
    gen = make_generator()

    class Tab(nn.Module):
        def __init__(self):
            super().__init__()
            self.tab = [torch.ones(4, device=DEVICE)]

        def forward(self, x):
            return x * self.tab[0]

    net = Tab()
    graph_mode.enable(net)
    x = _x(gen, 2, 4)
    with torch.no_grad():
        net(x), net(x), net(x)
        replays = graph_mode.graph_stats(net)["replays"]
        net.tab[0].data = torch.full((4,), 2.0, device=DEVICE)
        assert torch.equal(net(x), x * 2)
    stats = graph_mode.graph_stats(net)
    assert stats["replays"] == replays and stats["eager"] == {"model changed since capture": 1}, stats
    graph_mode.disable(net)

    class Odd(list):
        def __iter__(self):
            raise RuntimeError("not iterable today")

    net = _net(gen)
    net.odd = Odd([1])
    graph_mode.enable(net)
    x = _x(gen, 2, 2, 16)
    with torch.no_grad():
        outs = [net(x) for _ in range(3)]
    stats = graph_mode.graph_stats(net)
    assert stats["graphs"] == 0 and any("cannot be compared" in r for r in stats["eager"]), stats
    assert all(torch.equal(o[0], outs[0][0]) for o in outs)
    graph_mode.disable(net)

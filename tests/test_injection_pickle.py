# SPDX-License-Identifier: Apache-2.0
"""Injected models survive torch.save / torch.load (weights_only=False) and copy.deepcopy: the loaded or
copied model runs the kernels with the same output as the injected original, its patched forwards are
bound to its own modules (not the original's), and removing the kernels from it gives back the unpatched
outputs bit for bit. Tiny LTX-Video, SD3, FLUX and Llama models on the CPU (Triton's interpreter) or a GPU."""

import copy
import io
import pickle

import pytest
import torch
from transformers.models.llama import modeling_llama

import diffusers_injection as di
import injection_common as ic
import mmdit_injection as mi
import plain_rope_llama as prl
import transformers_injection as ti
from kernel_testing import DEVICE, copied, ltx_inputs, make_generator
from transformers_testing import ORIGINAL_ROPE, restore_rope

STATE_KEYS = (di._STATE, mi._STATE, ti._STATE)


@pytest.fixture(autouse=True)
def _clean_rope():
    yield
    restore_rope()


class Case:
    """A tiny model of one family with its inputs and the injection API that applies to it."""

    def __init__(self, kind):
        plain = kind == "llama_plain_rope"  # Llama without the kernels package: a dispatcher for its RoPE
        kind = self.kind = "llama" if plain else kind
        gen = make_generator()
        if kind == "ltx":
            self.model = di.build_tiny_ltx_pipeline(num_layers=2).transformer.to(DEVICE)
            self.kw = ltx_inputs(gen, frames=2, height=4, width=4, text=8)
        elif kind in ("sd3", "flux"):
            build = mi.build_sd3_transformer if kind == "sd3" else mi.build_flux_transformer
            self.model = build("tiny", dtype=torch.float32, device=DEVICE, seed=gen.seed_value % 1000)
            self.kw = mi.make_mmdit_inputs(
                self.model,
                batch=2,
                height=64,
                width=64,
                text_len=7,
                dtype=torch.float32,
                device=DEVICE,
                seed=gen.seed_value,
            )
        else:
            self.model = ti.build_llama(ti.tiny_llama_config(), device=DEVICE, seed=gen.seed_value % 1000)
            if plain:
                prl.use_plain_rope(self.model)
            self.kw = {"input_ids": torch.randint(3, 256, (2, 7), generator=gen).to(DEVICE)}

    def run(self, model):
        with torch.no_grad():
            out = model(**self.kw)
        return out.logits if self.kind == "llama" else out[0]

    def run_and_inject(self):
        """The model's output without the kernels, the counts of their injection, its output with them."""
        ref = self.run(self.model)
        counts = self.inject(self.model)
        return ref, counts, self.run(self.model)

    def inject(self, model):
        if self.kind == "llama":
            return ti.inject_llama_kernels(model, verbose=False)
        return di.inject_optimized_kernels(model, verbose=False)

    def remove(self, model):
        if self.kind == "llama":
            return ti.remove_llama_kernels(model, verbose=False)
        return di.remove_optimized_kernels(model, verbose=False)

    def counts(self, model):
        return ti.injected_counts(model) if self.kind == "llama" else di.injected_counts(model)


def _patched_modules(model):
    return [m for m in model.modules() if any(k in m.__dict__ for k in STATE_KEYS)]


def _records(m):
    return [m.__dict__[k] for k in STATE_KEYS if k in m.__dict__]


def _assert_bound_to(model):
    """Every patched forward (and every recorded original forward) of model is bound to its own module."""
    n = 0
    for m in _patched_modules(model):
        for rec in _records(m):
            if "rope_slot" in rec:  # the RoPE kernel in the layer's own copy of transformers' function
                slot = rec["rope_slot"]
                assert slot is m._kernel_funcs[ti._slot_key(slot)], f"{type(m).__name__}: another layer's copy"
                assert slot.__dict__["forward"].__self__ is slot, "the copy's forward is bound to another copy"
                n += 1
                continue
            if "patched" not in rec:  # an attention-processor record
                continue
            assert m.__dict__.get("forward") is rec["patched"], type(m).__name__
            assert rec["patched"].__self__ is m, f"{type(m).__name__}: patched forward bound to another module"
            assert rec["original"].__self__ is m, f"{type(m).__name__}: original forward bound to another module"
            n += 1
    assert n > 0


def _assert_nothing_left(model, rope_restored=True):
    for m in model.modules():
        assert not _records(m), f"{type(m).__name__} still marked as patched"
        assert "forward" not in m.__dict__, f"{type(m).__name__} keeps a patched forward"
    if rope_restored:
        assert modeling_llama.apply_rotary_pos_emb is ORIGINAL_ROPE
        assert prl.current() is prl.ORIGINAL


def _first_weight(model):
    """A parameter that a patched forward reads (through its own module): changing it must change the output."""
    for m in _patched_modules(model):
        for rec in _records(m):
            if rec["kind"] in (
                "rmsnorm",
                "rmsnorm_weighted",
                "adaln_fused_blocks",
                "mmdit_adaln_zero",
                "mmdit_adaln_zero_single",
            ):
                for p in m.parameters():
                    return p
    raise AssertionError("no patched module with a parameter")


KINDS = ["ltx", "sd3", "flux", "llama", "llama_plain_rope"]


@pytest.mark.parametrize("kind", KINDS)
def test_torch_save_and_load(kind):
    case = Case(kind)
    model = case.model
    ref, counts, out = case.run_and_inject()

    loaded = copied(model, "torch.save")
    assert loaded is not model
    assert case.counts(loaded) == counts
    _assert_bound_to(loaded)
    assert torch.equal(case.run(loaded), out)

    # removing the kernels from the original leaves the loaded model injected
    assert case.remove(model) == counts
    _assert_nothing_left(model, rope_restored=False)
    assert torch.equal(case.run(model), ref)
    if kind.startswith("llama"):
        with ti.count_kernel_calls() as calls:
            again = case.run(loaded)
        assert calls["rope_rotate_half"] == 4, "the loaded model lost the RoPE kernel with the original's removal"
    else:
        again = case.run(loaded)
    assert torch.equal(again, out)

    assert case.remove(loaded) == counts
    _assert_nothing_left(loaded)
    assert torch.equal(case.run(loaded), ref)


def test_llama_loaded_where_nothing_is_injected():
    """A pickle loaded where no model is injected (as in a fresh process) puts the RoPE dispatcher in place
    itself, and takes it out again on removal."""
    case = Case("llama_plain_rope")
    ref, counts, out = case.run_and_inject()
    data = io.BytesIO()
    torch.save(case.model, data)
    case.remove(case.model)
    assert prl.current() is prl.ORIGINAL

    data.seek(0)
    loaded = torch.load(data, weights_only=False)
    assert prl.current() is not prl.ORIGINAL
    with ti.count_kernel_calls() as calls:
        assert torch.equal(case.run(loaded), out)
    assert calls["rope_rotate_half"] == 4
    assert case.remove(loaded) == counts
    _assert_nothing_left(loaded)
    assert torch.equal(case.run(loaded), ref)


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy(kind):
    case = Case(kind)
    model = case.model
    ref, counts, out = case.run_and_inject()

    cp = copy.deepcopy(model)
    assert case.counts(cp) == counts
    _assert_bound_to(cp)
    _assert_bound_to(model)
    assert torch.equal(case.run(cp), out)

    # the copy's kernels read the copy's weights: changing one changes the copy's output only
    with torch.no_grad():
        _first_weight(cp).mul_(1.5)
    changed = case.run(cp)
    assert not torch.equal(changed, out), "the copy's patched forwards do not read the copy's weights"
    assert torch.equal(case.run(model), out)

    # each side removes its own kernels; the other keeps running them
    assert case.remove(model) == counts
    _assert_nothing_left(model, rope_restored=False)  # the copy still holds the RoPE dispatcher
    assert torch.equal(case.run(model), ref)
    if kind.startswith("llama"):
        with ti.count_kernel_calls() as calls:
            assert torch.equal(case.run(cp), changed)
        assert calls["rope_rotate_half"] == 4, "the copy lost the RoPE kernel with the original's removal"
    else:
        assert torch.equal(case.run(cp), changed)
    assert case.remove(cp) == counts
    _assert_nothing_left(cp)
    _assert_nothing_left(model)


def test_bound_forward_pickles_by_reference():
    """The patched forward object: calls fn(module, ...), exposes __func__ / __self__, and pickles as the
    function's qualified name plus the module (a lambda cannot be pickled: pickle says so)."""
    lin = torch.nn.Linear(3, 2)
    bound = ic.BoundForward(ti._linear_forward, lin)
    assert bound.__func__ is ti._linear_forward and bound.__self__ is lin
    lin2 = pickle.loads(pickle.dumps(lin))
    again = pickle.loads(pickle.dumps((lin, bound)))
    assert again[1].__self__ is again[0] and again[1].__func__ is ti._linear_forward
    assert type(lin2) is torch.nn.Linear
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pickle.dumps(ic.BoundForward(lambda self, x: x, lin))


def test_rope_site_of_no_importable_module_refuses_to_pickle():
    """A RoPE site whose functions live in no importable module cannot be rebuilt on load: pickling says to
    remove the kernels first, at save time."""
    attn = torch.nn.Linear(2, 2)
    site = ti._RopeSite(attn, {"__name__": "not_a_module_anywhere"})
    with pytest.raises(TypeError, match="remove_llama_kernels"):
        pickle.dumps(site)

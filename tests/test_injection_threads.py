# SPDX-License-Identifier: Apache-2.0
"""Injecting from several threads at once: the once-per-process caches of transformers_injection.py (the
probes that recognise the modules, the RoPE dispatcher of a model file) are filled safely, every model gets
all its kernels, and removal leaves the model file's apply_rotary_pos_emb as it was. The models' attention
layers call a plain module-level function (tests/plain_rope_llama.py: transformers without the kernels
package), the form in which a dispatcher stands in for it. The slow steps are made slower so that the
threads meet inside them."""

import threading
import time

import pytest
import torch

import plain_rope_llama as prl
import transformers_injection as ti
from kernel_testing import DEVICE
from transformers_testing import TINY_LLAMA_COUNTS

ORIGINAL_ROPE = prl.ORIGINAL
THREADS = 8


@pytest.fixture(autouse=True)
def _clean_rope():
    yield
    prl.reset()
    ti._ROPE_SITES.clear()


def _slowed(fn, seconds=0.05):
    def slow(*a, **k):
        time.sleep(seconds)
        return fn(*a, **k)

    return slow


def _in_threads(target, n, stagger=0.0):
    """Run target(i) for i < n in n threads released together (thread i after i * stagger seconds);
    the exceptions they raised."""
    barrier = threading.Barrier(n)
    errors = []

    def run(i):
        try:
            barrier.wait()
            time.sleep(i * stagger)
            target(i)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _rope_calls(model, ids):
    with ti.count_kernel_calls() as calls, torch.no_grad():
        model(ids)
    return calls["rope_rotate_half"]


def _models(n, **cfg):
    return [prl.use_plain_rope(ti.build_llama(ti.tiny_llama_config(**cfg), device=DEVICE, seed=i)) for i in range(n)]


def _inject_all(models, stagger=0.0):
    counts = [None] * len(models)
    errors = _in_threads(
        lambda i: counts.__setitem__(i, ti.inject_llama_kernels(models[i], verbose=False)), len(models), stagger
    )
    assert not errors, f"{len(errors)} threads failed, first: {errors[0]!r}"
    return counts


def test_probes_filled_from_many_threads(monkeypatch):
    """The first injections of the process, from 8 threads: every thread gets every module recognised (none
    may see a probe's result missing or half-made while another thread computes it)."""
    models = _models(THREADS, num_hidden_layers=1)
    # nothing probed yet in this process, and the RMSNorm and RoPE probes slow: the threads, started
    # 20 ms apart, come while the first one is inside them
    monkeypatch.setattr(ti, "_PROBES", {})
    monkeypatch.setattr(ti.rope_kernels, "rope_rotate_half_ref", _slowed(ti.rope_kernels.rope_rotate_half_ref, 0.2))
    monkeypatch.setattr(ti.rmsnorm, "rms_norm_ref", _slowed(ti.rmsnorm.rms_norm_ref, 0.2))
    counts = _inject_all(models, stagger=0.02)
    assert counts == [{**TINY_LLAMA_COUNTS, "rmsnorm": 3, "fused_add_rmsnorm": 1, "swiglu": 1, "rope": 1}] * THREADS
    assert all(isinstance(v, dict) or v[1] is True for v in ti._PROBES.values())
    for m in models:
        ti.remove_llama_kernels(m, verbose=False)
    assert prl.current() is ORIGINAL_ROPE


def test_rope_dispatcher_installed_from_many_threads(monkeypatch, gen):
    """8 threads put the RoPE dispatcher in place at once: one dispatcher, wrapping transformers' own
    function, held by every model, so that removing some models leaves the kernel to the others."""
    models = _models(THREADS)
    ids = torch.randint(3, 256, (1, 5), generator=gen).to(DEVICE)
    with torch.no_grad():
        refs = [m(ids).logits for m in models]
    # a slow dispatcher build: the threads meet while the model file's RoPE function is being replaced
    monkeypatch.setattr(ti, "_make_rope_dispatcher", _slowed(ti._make_rope_dispatcher))
    assert _inject_all(models) == [TINY_LLAMA_COUNTS] * THREADS

    dispatcher = prl.current()
    assert dispatcher is not ORIGINAL_ROPE and dispatcher._rtk_original is ORIGINAL_ROPE
    # removal, one model at a time: the others keep the RoPE kernel until the last one is gone
    for i, m in enumerate(models):
        assert ti.remove_llama_kernels(m, verbose=False) == TINY_LLAMA_COUNTS
        with torch.no_grad():
            assert torch.equal(m(ids).logits, refs[i])
        if i + 1 < THREADS:
            assert _rope_calls(models[-1], ids) == 4, f"RoPE kernel lost after removing {i + 1} models"
    assert prl.current() is ORIGINAL_ROPE
    assert not ti._ROPE_SITES


def test_concurrent_injection_and_removal_keep_one_dispatcher(monkeypatch):
    """Threads injecting and removing at once (each its own model, several rounds) leave no dispatcher
    behind and never wrap one dispatcher in another."""
    models = [ti.build_llama(ti.tiny_llama_config(num_hidden_layers=1), device=DEVICE, seed=i) for i in range(THREADS)]
    monkeypatch.setattr(ti, "_make_rope_dispatcher", _slowed(ti._make_rope_dispatcher, 0.01))
    seen = []

    def work(i):
        for _ in range(5):
            ti.inject_llama_kernels(models[i], verbose=False)
            fn = prl.current()
            seen.append(getattr(fn, "_rtk_original", fn))
            ti.remove_llama_kernels(models[i], verbose=False)

    errors = _in_threads(work, THREADS)
    assert not errors, f"{len(errors)} threads failed, first: {errors[0]!r}"
    assert all(f is ORIGINAL_ROPE for f in seen), "a dispatcher wrapped another dispatcher"
    assert prl.current() is ORIGINAL_ROPE
    assert not ti._ROPE_SITES

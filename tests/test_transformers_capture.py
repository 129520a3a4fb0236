# SPDX-License-Identifier: Apache-2.0
"""The static-cache decoding of transformers_injection_example.py (--capture): arguments, the refusal without a GPU,
and, on the CPU, the decode through transformers' StaticCache (uncaptured) against the dynamic cache's on tiny
models of two families: greedy tokens identical to generate(), teacher-forced logits within fp32 rounding, with
and without the kernels, with transformers' sliding-window layers or full-length ones in their place (what the
graph capture uses)."""

import pytest
import torch

import transformers_families as tf
import transformers_injection as ti
import transformers_injection_example as ex
from kernel_testing import DEVICE, make_generator, rel_max

FP32_REL = 1e-5  # as in test_transformers_families.py: other summation orders, far below a wrong position (>= 1e-2)


def test_capture_argument():
    assert ex.parse_args([]).capture == "none"
    assert ex.parse_args(["--capture", "graph"]).capture == "graph"
    assert ex.parse_args(["--capture", "compile"]).capture == "compile"
    with pytest.raises(SystemExit):
        ex.parse_args(["--capture", "cudagraph"])


def test_capture_without_a_gpu_is_refused(capsys):
    assert ex.main(["--device-free", "--capture", "graph"]) == 2
    assert "--capture graph needs a GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize("capture", ["graph", "compile"])
def test_decoder_capture_needs_a_gpu(capture):
    model = tf.build(tf.tiny_config("llama"), device="cpu")
    dec = ex.StaticDecoder(model, 16, capture)
    with pytest.raises(RuntimeError, match="needs a GPU"):
        dec.prepare(torch.randint(3, 256, (1, 5)))


@pytest.mark.parametrize(
    "family, full_layers, inject",
    [
        ("llama", False, False),
        ("llama", False, True),
        ("gemma3", False, False),  # sliding window 8: transformers' static sliding layers, full past the prompt
        ("gemma3", True, False),  # full-length layers in their place, the sliding-window mask doing the window
        ("gemma3", True, True),
    ],
)
def test_static_cache_decode_matches_the_dynamic_cache(family, full_layers, inject):
    gen = make_generator()
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    model = tf.build(tf.tiny_config(family), device=DEVICE, seed=seed)
    prompt = torch.randint(3, 256, (1, 10), generator=gen).to(DEVICE)
    n = 6
    if inject:
        ti.inject_optimized_kernels(model, verbose=False)
    want_tokens = ex.greedy_tokens(model, prompt, n)  # generate(): dynamic cache
    want_logits = ex.forced_logits(model, prompt, want_tokens)[prompt.shape[1] :]  # the decode steps' rows
    dec = ex.StaticDecoder(model, prompt.shape[1] + n + 2, "none", full_layers=full_layers)
    sliding = [getattr(layer, "is_sliding", False) for layer in dec.cache.layers]
    assert any(sliding) == (family == "gemma3" and not full_layers)
    with ti.count_kernel_calls() as calls:
        tokens = dec.greedy(prompt, n)
    assert (sum(calls.values()) > 0) == inject
    assert torch.equal(tokens, want_tokens), f"static {tokens.tolist()} vs dynamic {want_tokens.tolist()}"
    logits = dec.forced_logits(prompt, want_tokens)
    assert logits.shape == want_logits.shape
    assert rel_max(logits, want_logits) <= FP32_REL, f"{rel_max(logits, want_logits):.3e} (seed {seed})"
    again = dec.greedy(prompt, n)  # the prefill empties the cache: a second decode is the first one
    assert torch.equal(again, tokens)
    if inject:
        ti.remove_optimized_kernels(model, verbose=False)

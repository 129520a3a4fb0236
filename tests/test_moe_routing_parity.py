# SPDX-License-Identifier: Apache-2.0
"""The fp32 parity check of transformers_injection_example.py on MoE models (Routing, routing_verdict).

An MoE router picks its top-k experts by comparing logits; where the k-th and the (k+1)-th are a few fp32
ulps apart, any other rounding of the same math (the kernels', or stock's own with the norm computed in
float64) can pick the other expert, and that token's output moves by order 1e-2 (measured on
Qwen3-30B-A3B's shapes: one forced flip in the last MoE layer moved its logits row by 1.4e-2 of the largest
logit). The check therefore forces the unpatched run's routing where the patched run's flips, and judges
the flips apart: near ties only, and few. Here, on the tiny Qwen3-MoE (both layers sparse, 8 experts, top-2):
a flip on a near tie that the old rule (max |patched - unpatched| over the logits with free routing) fails
passes; an RMSNorm with twice the eps still fails with the routing forced; many flips fail even on near
ties; a flip on a wide margin fails."""

import argparse

import pytest
import torch

import transformers_families as tf
import transformers_injection as ti
import transformers_injection_example as ex
from kernel_testing import DEVICE, make_generator
from transformers_testing import logits, restore_rope_sites

PROMPT = 8
NEW = 4


@pytest.fixture(autouse=True)
def _clean_rope():
    yield
    restore_rope_sites()


def _moe(gen, **cfg):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    config = tf.tiny_config("qwen3_moe", num_experts=8, num_experts_per_tok=2, mlp_only_layers=[], **cfg)
    return tf.build(config, device=DEVICE, seed=seed)


def _prompt(gen):
    return torch.randint(3, 256, (1, PROMPT), generator=gen).to(DEVICE)


class _Patched:
    """transformers_injection as _check_fp32 uses it, with `extra(model)` run after the injection (hooks that
    stand in for what the patched model does otherwise; it returns their handles, removed before removal)."""

    def __init__(self, extra):
        self.extra, self.handles = extra, []

    def __getattr__(self, name):
        return getattr(ti, name)

    def inject_optimized_kernels(self, model, **kw):
        counts = ti.inject_optimized_kernels(model, **kw)
        self.handles = self.extra(model)
        return counts

    def remove_optimized_kernels(self, model, **kw):
        for h in self.handles:
            h.remove()
        return ti.remove_optimized_kernels(model, **kw)


def _check(model, prompt, extra=lambda model: []):
    args = argparse.Namespace(new_tokens=NEW)
    _, _, _, fp32, ok = ex._check_fp32(model, prompt, args, dict(verbose=False), _Patched(extra))
    return fp32, ok


def _router_input(model, prompt, layer=0):
    """The hidden states layer's router gets in the prompt's forward, and its logits [tokens, experts]."""
    router = model.model.layers[layer].mlp.gate
    seen = []
    h = router.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    logits(model, prompt)
    h.remove()
    x = seen[0].reshape(-1, router.weight.shape[1])
    return router, x, x @ router.weight.detach().t()


def _near_tie(model, prompt, token, rel_gap=1e-6):
    """Make the layer-0 router's k-th and (k+1)-th logit of `token` rel_gap of its largest |logit| apart (moves
    the (k+1)-th expert's router row along that token's hidden state). Returns (router, a, b, gap): a the
    k-th expert, b the (k+1)-th."""
    router, x, rl = _router_input(model, prompt)
    k = router.top_k
    order = rl[token].argsort(descending=True)
    a, b = order[k - 1].item(), order[k].item()
    h = x[token].double()
    gap = rel_gap * rl[token].abs().max().item()
    with torch.no_grad():
        w = router.weight.double()
        w[b] += ((rl[token, a] - rl[token, b]).item() - gap) * h / h.dot(h)
        router.weight.copy_(w.float())
    return router, a, b, gap


def _nudge(router, token, a, b, amount):
    """A pre-hook on the router that moves `token`'s input in the prompt's forward so that expert b's logit
    gains `amount` on expert a's: a change of the router's input of a few ulps, as another rounding of the
    layer's norm gives."""
    with torch.no_grad():
        d = router.weight[b].double() - router.weight[a].double()
        step = (amount * d / d.dot(d)).float()

    def pre(m, args):
        x = args[0]
        if x.reshape(-1, x.shape[-1]).shape[0] != PROMPT:
            return None
        x = x.clone()
        x.reshape(-1, x.shape[-1])[token] += step
        return (x, *args[1:])

    return router.register_forward_pre_hook(pre)


def test_routers_found_in_moe_families_only():
    gen = make_generator()
    for family, n in (("qwen3_moe", 1), ("mixtral", 2), ("llama", 0)):
        model = tf.build(
            tf.tiny_config(family), device=DEVICE, seed=int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        )
        assert len(ex.Routing(model, ti).routers) == n, family


def test_forcing_without_flips_keeps_the_output_bit_for_bit():
    """No flip: the routers' own outputs stand, the logits are those of the unforced run; all calls forced."""
    gen = make_generator()
    model, prompt = _moe(gen), _prompt(gen)
    routing = ex.Routing(model, ti)
    with routing.record() as rec:
        ref = logits(model, prompt)
    with routing.force(rec) as st:
        out = logits(model, prompt)
    assert torch.equal(out, ref)
    v = ex.routing_verdict(st)
    assert v["ok"] and v["flips"] == 0 and v["decisions"] == 2 * PROMPT and not v["unforced"]


def test_near_tie_flip_passes_with_the_routing_forced():
    """A decision on a margin of 1e-6 of the token's largest router logit, flipped by a change of the router's
    input of that size: with free routing the logits move by far more than 1e-4 (the old rule fails); with
    the unpatched routing forced they agree to fp32 rounding, the flip is reported with its margin, and the
    check passes."""
    gen = make_generator()
    model, prompt = _moe(gen), _prompt(gen)
    token = 5
    router, a, b, gap = _near_tie(model, prompt, token)
    fp32, ok = _check(model, prompt, lambda m: [_nudge(router, token, a, b, 2 * gap)])
    r = fp32["routing"]
    assert r["flips"] == 1, r  # the greedy run's prefill and the teacher-forced run's: the same decision, once
    flip = r["flip_details"][0]
    assert (flip["router"], flip["call"], flip["token"]) == ("model.layers.0.mlp.gate", 0, token)
    assert 0 < flip["rel_gap"] <= 2e-6, flip  # the unpatched margin; the patched run's own is about as wide
    assert fp32["patched_vs_unpatched_free_routing"]["rel_max_diff"] > 10 * ex.FP32_REL_MAX, fp32
    assert fp32["patched_vs_unpatched"]["rel_max_diff"] <= 1e-5, fp32
    assert r["ok"] and fp32["greedy_tokens_identical"] and fp32["restored_bit_identical"] and ok


def test_wrong_eps_fails_with_the_routing_forced(monkeypatch):
    """An RMSNorm kernel with twice the eps (the layers' norms, q/k norms, the fused add + norm): measured 1e-2 at
    the logits with the routing forced (1e-3 with 1.1x the eps; 8e-2 with 10x, which also flips decisions on
    margins of up to 0.56 of the router's largest logit). Forcing the routing does not hide it."""
    gen = make_generator()
    model, prompt = _moe(gen), _prompt(gen)
    import rmsnorm

    plain, fused = rmsnorm.rms_norm, rmsnorm.fused_add_rms_norm
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda x, w, eps, **k: plain(x, w, 2 * eps, **k))
    monkeypatch.setattr(rmsnorm, "fused_add_rms_norm", lambda x, r, w, eps, **k: fused(x, r, w, 2 * eps, **k))
    fp32, ok = _check(model, prompt)
    assert fp32["patched_vs_unpatched"]["rel_max_diff"] > 10 * ex.FP32_REL_MAX, fp32
    assert not ok


def _rerouted(router, noise, gen):
    """A forward hook on the router that moves its logits by `noise` of their size at random and routes by the
    moved logits as the router does (softmax, top-k, renormalised when the config says so)."""
    norm = router.norm_topk_prob

    def hook(m, args, out):
        lg, _, _ = out
        lg = lg * (1 + noise * torch.randn(lg.shape, generator=gen).to(lg))
        p = torch.softmax(lg.float(), -1)
        w, idx = p.topk(m.top_k, -1)
        if norm:
            w = w / w.sum(-1, keepdim=True)
        return lg, w.to(lg.dtype), idx

    return router.register_forward_hook(hook)


def test_many_near_tie_flips_fail():
    """Every decision of the layer-0 router a near tie (three experts' router rows 1e-6 apart in scale), and its
    logits moved by 1e-5 of their size: most decisions flip, each on a near tie, and the forced logits agree;
    the check fails on the count."""
    gen = make_generator()
    model, prompt = _moe(gen), _prompt(gen)
    router = model.model.layers[0].mlp.gate
    with torch.no_grad():
        w = router.weight
        for e in range(w.shape[0]):
            w[e] = w[e - e % 3] * (1 + (e % 3) * 1e-6)
    fp32, ok = _check(model, prompt, lambda m: [_rerouted(router, 1e-5, make_generator(0))])
    r = fp32["routing"]
    assert r["flips"] > r["flips_allowed"] and r["max_flip_rel_gap"] <= ex.ROUTING_TIE_REL, r
    assert not r["ok"] and not ok


def test_wide_margin_flip_fails():
    """One flip on a margin of 1e-2 of the token's largest router logit (the router's input moved by far more
    than rounding): not a near tie, the check fails."""
    gen = make_generator()
    model, prompt = _moe(gen), _prompt(gen)
    token = 3
    router, a, b, gap = _near_tie(model, prompt, token, rel_gap=1e-2)
    fp32, ok = _check(model, prompt, lambda m: [_nudge(router, token, a, b, 2 * gap)])
    r = fp32["routing"]
    assert r["flips"] == 1 and r["max_flip_rel_gap"] > ex.ROUTING_TIE_REL, r
    assert not r["ok"] and not ok


def test_unforced_calls_fail():
    """A call the record does not have (here: no record at all) keeps its own routing and fails the verdict."""
    gen = make_generator()
    model, prompt = _moe(gen), _prompt(gen)
    routing = ex.Routing(model, ti)
    with routing.force({}) as st:
        logits(model, prompt)
    v = ex.routing_verdict(st)
    assert not v["ok"] and len(v["unforced"]) == 2, v

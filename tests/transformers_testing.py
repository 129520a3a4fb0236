# SPDX-License-Identifier: Apache-2.0
"""Helpers the tests of transformers_injection.py share: a causal LM's logits and greedy tokens, the counts
per kind of the tiny Llama, Llama's RoPE function as the tests found it (put back after each test), and the
check that trainable weights in grad mode run no kernel."""

import torch
from transformers.models.llama import modeling_llama

import plain_rope_llama as prl
import transformers_injection as ti

# inject_llama_kernels on the tiny Llama (ti.tiny_llama_config: 2 layers)
TINY_LLAMA_COUNTS = {
    "rmsnorm": 5,
    "fused_add_rmsnorm": 2,
    "swiglu": 2,
    "geglu": 0,
    "moe_swiglu": 0,
    "rope": 2,
    "skinny_gemm": 0,
}
ORIGINAL_ROPE = ti._original_rope_function(modeling_llama.apply_rotary_pos_emb)


def restore_rope() -> None:
    """Llama's apply_rotary_pos_emb (that of transformers' model file and of tests/plain_rope_llama.py) as it
    was, no RoPE site recorded: a failing test must not leave a dispatcher in place for the next one."""
    modeling_llama.apply_rotary_pos_emb = ORIGINAL_ROPE
    prl.reset()
    ti._ROPE_SITES.clear()


def logits(model, ids):
    """model(ids).logits without autograd."""
    with torch.no_grad():
        return model(ids).logits


def greedy(model, ids, n=6):
    """The n tokens greedy decoding appends to ids (exactly n: no early stop)."""
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
        )
    return out[:, ids.shape[1] :]


def assert_autograd_falls_back(model, ids, inject, remove) -> None:
    """With model's weights trainable, in grad mode: after inject(model) no kernel runs (they have no backward),
    and the logits and every gradient are the stock model's, bit for bit; remove(model) at the end."""
    model.requires_grad_(True)
    ref = model(ids).logits
    ref.float().pow(2).mean().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    inject(model)
    with ti.count_kernel_calls() as calls:
        out = model(ids).logits
        out.float().pow(2).mean().backward()
    assert sum(calls.values()) == 0, dict(calls)
    assert torch.equal(out, ref)
    for p, g in zip(model.parameters(), ref_grads):
        assert torch.equal(p.grad, g)
    remove(model)


def restore_rope_sites():
    """Put back every model file's RoPE function that a dispatcher replaced (a failing test must not leave one
    for the next)."""
    import transformers_injection as ti

    for site in list(ti._ROPE_SITES.values()):
        if site["globals"].get(ti._ROPE_NAME) is site["dispatcher"]:
            site["globals"][ti._ROPE_NAME] = site["original"]
    ti._ROPE_SITES.clear()

# SPDX-License-Identifier: Apache-2.0
"""Llama attention as transformers runs it without the `kernels` package (before transformers 5.25, which
depends on it): the layer's forward calls a plain module-level apply_rotary_pos_emb. With the package,
that function is a module whose calls are routed to each layer's private copy, and the injection puts
the RoPE kernel into those copies; without it, the injection puts a dispatcher in place of the model
file's function. This file is such a model file: `use_plain_rope(model)` makes a Llama model's attention
layers run Llama's own forward code with this file's globals, in which apply_rotary_pos_emb is a plain
function computing what transformers' does."""

import types

from transformers.models.llama import modeling_llama

# The model file's names (the attention forward reads them as globals), then this file's own function.
globals().update({k: v for k, v in vars(modeling_llama).items() if not k.startswith("__")})


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):  # noqa: F811  (this file's plain function)
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin  # noqa: F821  (from the model file)


ORIGINAL = apply_rotary_pos_emb


def _llama_forward_with_these_globals():
    import inspect

    fn = inspect.unwrap(modeling_llama.LlamaAttention.forward)
    return types.FunctionType(fn.__code__, globals(), fn.__name__, fn.__defaults__, fn.__closure__)


class PlainRopeLlamaAttention(modeling_llama.LlamaAttention):
    """LlamaAttention whose forward calls this file's plain apply_rotary_pos_emb."""

    forward = _llama_forward_with_these_globals()


PlainRopeLlamaAttention.forward.__qualname__ = "PlainRopeLlamaAttention.forward"  # pickle finds it by this name


def use_plain_rope(model):
    """Make every LlamaAttention of model a PlainRopeLlamaAttention (in place); returns model."""
    for m in model.modules():
        if type(m) is modeling_llama.LlamaAttention:
            m.__class__ = PlainRopeLlamaAttention
    return model


def current():
    """The function this file's attention layers call now (a dispatcher while one is injected)."""
    return globals()["apply_rotary_pos_emb"]


def reset():
    globals()["apply_rotary_pos_emb"] = ORIGINAL

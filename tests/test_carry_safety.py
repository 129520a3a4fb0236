# SPDX-License-Identifier: Apache-2.0
"""A norm carried from one block to the next is used only where an in-place change of the residual stream
between the two blocks would be seen. Code that runs the blocks itself (a ControlNet-style residual, a
model subclass with its own loop) may add to h in place between blocks, with no hook anywhere: under
torch.inference_mode (inference tensors keep no version counter) and under torch.compile (which traces
none) the next block must compute its own norm."""

import pytest
import torch

import diffusers_injection as di
import wan_injection as wi
from kernel_testing import DEVICE, rel_l2

FP32_REL = 1e-5


def _wan_loop(model, x, t, e):
    """WanTransformer3DModel's block loop written out by a user, with an in-place change after block 0."""
    rot = model.rope(x)
    h = model.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
    _, tp, ehs, _ = model.condition_embedder(t, e, None)
    tp = tp.unflatten(1, (6, -1))
    for i, blk in enumerate(model.blocks):
        h = blk(h, ehs, tp, rot)
        if i == 0:
            h += 0.5 * h.flip(-1)  # not a shift or a scaling: a LayerNorm would not see those
    return h


def _ltx_loop(model, kw):
    """The same for LTX-Video: its transformer's own preparation, then the blocks run by the user."""
    blocks = model.transformer_blocks
    outs = {}

    def capture(module, args, kwargs):  # the inputs the model hands block 0, taken once
        outs["args"], outs["kwargs"] = args, kwargs
        raise StopIteration

    handle = blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model(**kw)
    except StopIteration:
        pass
    finally:
        handle.remove()
    args, kwargs = outs["args"], dict(outs["kwargs"])
    h = args[0] if args else kwargs.pop("hidden_states")
    rest = args[1:]
    for i, blk in enumerate(blocks):
        h = blk(h, *rest, **kwargs)
        if i == 0:
            h += 0.5 * h.flip(-1)
    return h


@pytest.mark.parametrize("mode", ["inference_mode", "compile"])
def test_wan_carry_not_used_after_an_in_place_change_by_the_caller(mode):
    model = wi.build_wan_transformer("tiny", num_layers=3, device=DEVICE)
    kw = wi.make_wan_inputs(model, device=DEVICE)
    args = (kw["hidden_states"], kw["timestep"], kw["encoder_hidden_states"])
    with torch.no_grad():
        ref = _wan_loop(model, *args)
    wi.inject_wan_kernels(model, verbose=False)
    try:
        if mode == "inference_mode":
            with torch.inference_mode():
                got = _wan_loop(model, *args)
        else:
            with torch.no_grad():
                got = torch.compile(_wan_loop, backend="eager")(model, *args)
    finally:
        wi.remove_wan_kernels(model, verbose=False)
    assert rel_l2(got, ref) < FP32_REL


def test_ltx_carry_not_used_after_an_in_place_change_by_the_caller():
    tr = di.build_tiny_ltx_pipeline(num_layers=3).transformer.to(DEVICE)
    g = torch.Generator().manual_seed(0)
    b, f, hh, ww = 2, 2, 4, 4
    kw = dict(
        hidden_states=torch.randn(b, f * hh * ww, 8, generator=g).to(DEVICE),
        encoder_hidden_states=torch.randn(b, 5, 16, generator=g).to(DEVICE),
        timestep=torch.tensor([300.0, 700.0]).to(DEVICE),
        encoder_attention_mask=torch.ones(b, 5).to(DEVICE),
        num_frames=f,
        height=hh,
        width=ww,
        rope_interpolation_scale=(1.0, 1.0, 1.0),
        return_dict=False,
    )
    with torch.no_grad():
        ref = _ltx_loop(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False)
    try:
        with torch.inference_mode():
            got = _ltx_loop(tr, kw)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    assert rel_l2(got, ref) < FP32_REL


def _pickled_size(obj) -> int:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def test_saving_or_copying_one_block_does_not_take_the_next_ones():
    """The link from a block to the next lives outside the blocks: one injected block saves to the same
    size whatever follows it, and a deep copy of it holds no other block."""
    import copy

    sizes = []
    for layers in (2, 4):
        model = wi.build_wan_transformer("tiny", num_layers=layers, seed=0)
        wi.inject_wan_kernels(model, verbose=False)
        sizes.append(_pickled_size(model.blocks[0]))
        dup = copy.deepcopy(model.blocks[0])
        assert sum(1 for m in dup.modules() if isinstance(m, wi.WanTransformerBlock)) == 1
    assert sizes[0] == sizes[1], sizes


def test_a_block_removed_from_the_model_is_no_longer_fed():
    import gc
    import weakref

    import injection_common as ic

    model = wi.build_wan_transformer("tiny", num_layers=4, device=DEVICE)
    kw = wi.make_wan_inputs(model, device=DEVICE)
    wi.inject_wan_kernels(model, verbose=False)
    last = model.blocks[3]
    del model.blocks[3]
    wi.inject_wan_kernels(model, verbose=False)  # injecting again relinks what is there now
    assert ic.next_block(model.blocks[2]) is None
    with torch.no_grad():
        model(**kw)
    assert not last.__dict__.get(wi._CARRY)
    gone = weakref.ref(last)
    del last
    gc.collect()
    assert gone() is None, "the removed block is still referenced"

# SPDX-License-Identifier: Apache-2.0
"""inject_optimized_kernels(fp8=True) on diffusers' LTX-Video: the transformer blocks' linear layers become
FP8 (fp8_linear.Fp8Linear), the output stays near the bf16 model's, and removal puts the very same modules
and weights back. Tiny random transformer, through Triton's interpreter on the CPU or natively on a GPU."""

import pytest
import torch

import diffusers_injection as di
import fp8_linear
import injection_common as ic
from kernel_testing import (
    DEVICE,
    changed_tensors,
    copied,
    count_calls,
    ltx_inputs,
    make_generator,
    run_compiled_fullgraph,
    run_model,
    tensor_copies,
)

# per block: attn1 to_q, to_k, to_v, to_out.0; attn2 the same four; the feed-forward's two projections
LINEARS_PER_BLOCK = 10
# quantisation passes (fp8_quantize) per block: self-attention 2 (q/k/v share their input's, to_out), cross-
# attention 3 (q, k/v sharing the text's, to_out); the feed-forward's inputs come in FP8 from the norm and the
# GELU, or take 2 more passes when that fusion is off
ATTN_QUANT_PASSES = 5


# The inputs of the tests whose checks are exact (counts, equalities, refusals): 2 x 4 x 8 latent tokens a sample,
# 128 rows where ltx_inputs' default 3 x 8 x 8 gives 384 (every kernel still several programs), the same text.
# The tests that bound how far FP8 moves the output (relative errors) keep the default size.
SMALL = dict(frames=2, height=4, width=8)


def _bf16_case(num_layers=2, size=None):
    gen = make_generator()
    tr = di.build_tiny_ltx_pipeline(num_layers=num_layers).transformer.to(DEVICE, torch.bfloat16)
    kw = {
        k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() and v.dim() == 3 else v)
        for k, v in ltx_inputs(gen, **(size or {})).items()
    }
    return gen, tr, kw


def _block_linears(tr):
    return [(n, m) for n, m in tr.transformer_blocks.named_modules() if isinstance(m, torch.nn.Linear)]


def test_fp8_linears_swapped_output_close_and_exact_restore():
    gen, tr, kw = _bf16_case()
    originals = _block_linears(tr)
    weights = {n: m.weight.detach().clone() for n, m in originals}
    stock = run_model(tr, kw)
    counts = di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    assert counts["fp8_linear"] == 2 * LINEARS_PER_BLOCK == len(originals)
    swapped = [m for m in tr.transformer_blocks.modules() if isinstance(m, fp8_linear.Fp8Linear)]
    assert len(swapped) == len(originals) and not _block_linears(tr)
    assert isinstance(tr.proj_out, torch.nn.Linear), "layers outside the blocks stay bf16"
    out = run_model(tr, kw)
    assert torch.isfinite(out).all()
    rel = float((out.double() - stock.double()).norm() / stock.double().norm())
    # FP8 inputs and weights (3 mantissa bits) through two blocks: a few percent, not a wrong result
    assert 1e-3 < rel < 0.15, f"FP8 output off the bf16 model's by rel. L2 {rel:.4f} (seed {gen.seed_value})"

    restored = di.remove_optimized_kernels(tr, verbose=False)
    assert restored["fp8_linear"] == len(originals)
    back = _block_linears(tr)
    assert [n for n, _ in back] == [n for n, _ in originals]
    assert all(m is o for (_, m), (_, o) in zip(back, originals)), "the very same modules are back"
    assert all(torch.equal(m.weight, weights[n]) and m.weight.device == weights[n].device for n, m in back)
    assert torch.equal(run_model(tr, kw), stock)


def test_injecting_fp8_twice_swaps_nothing_more():
    _, tr, _ = _bf16_case(num_layers=1)
    first = di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    assert di.inject_optimized_kernels(tr, verbose=False, fp8=True) == first
    assert fp8_linear.fp8_linear_count(tr) == LINEARS_PER_BLOCK
    di.remove_optimized_kernels(tr, verbose=False)
    assert fp8_linear.fp8_linear_count(tr) == 0 and len(_block_linears(tr)) == LINEARS_PER_BLOCK


def test_fp32_model_is_refused_with_the_reason():
    """FP8 asked for and no layer it could replace (fp32 weights): an error naming why, not a bf16 run."""
    tr = di.build_tiny_ltx_pipeline(num_layers=1).transformer.to(DEVICE)  # fp32 weights
    with pytest.raises(ValueError, match="replaced no linear layer.*float32 weight"):
        di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    assert len(_block_linears(tr)) == LINEARS_PER_BLOCK
    di.remove_optimized_kernels(tr, verbose=False)


def test_tied_linear_gets_one_twin_and_comes_back_tied():
    _, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    attn = tr.transformer_blocks[0].attn2
    attn.to_v = attn.to_k  # one module in two places
    stock = run_model(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    assert attn.to_k is attn.to_v and isinstance(attn.to_k, fp8_linear.Fp8Linear)
    di.remove_optimized_kernels(tr, verbose=False)
    assert attn.to_k is attn.to_v and type(attn.to_k) is torch.nn.Linear
    assert torch.equal(run_model(tr, kw), stock)


def test_a_layer_replaced_meanwhile_is_kept_on_removal():
    _, tr, _ = _bf16_case(num_layers=1)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    mine = torch.nn.Linear(32, 32).to(DEVICE, torch.bfloat16)
    tr.transformer_blocks[0].attn1.to_q = mine
    restored = di.remove_optimized_kernels(tr, verbose=False)
    assert restored["fp8_linear"] == LINEARS_PER_BLOCK - 1 and tr.transformer_blocks[0].attn1.to_q is mine
    assert fp8_linear.fp8_linear_count(tr) == 0


def test_hooked_linear_is_left_in_bf16():
    _, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    seen = []
    handle = tr.transformer_blocks[0].attn1.to_q.register_forward_hook(lambda m, a, o: seen.append(o.dtype))
    try:
        counts = di.inject_optimized_kernels(tr, verbose=False, fp8=True)
        assert counts["fp8_linear"] == LINEARS_PER_BLOCK - 1
        assert type(tr.transformer_blocks[0].attn1.to_q) is torch.nn.Linear
        run_model(tr, kw)
        assert seen == [torch.bfloat16], "the hook still sees the layer run"
    finally:
        handle.remove()
        di.remove_optimized_kernels(tr, verbose=False)


@pytest.mark.parametrize("bad", ["yes", 1.0, None])
def test_fp8_argument_checked(bad):
    _, tr, _ = _bf16_case(num_layers=1)
    with pytest.raises(ValueError, match="fp8 must be True or False"):
        di.inject_optimized_kernels(tr, verbose=False, fp8=bad)


def test_fp8_without_a_supported_transformer_is_refused():
    with pytest.raises(ValueError, match="LTX-Video, SD3, FLUX and Wan transformers"):
        di.inject_optimized_kernels(torch.nn.Sequential(torch.nn.Linear(16, 16)), verbose=False, fp8=True)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copies_of_an_fp8_model_compute_and_restore_alike(how):
    """A copy (deepcopy, or torch.save then torch.load) computes what the FP8 model computes, and removing
    the kernels from the copy gives the original bf16 model's output again, bit for bit."""
    _, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    stock = run_model(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    out = run_model(tr, kw)
    clone = copied(tr, how)
    assert torch.equal(run_model(clone, kw), out)
    assert di.remove_optimized_kernels(clone, verbose=False)["fp8_linear"] == LINEARS_PER_BLOCK
    assert torch.equal(run_model(clone, kw), stock)
    di.remove_optimized_kernels(tr, verbose=False)


def test_feed_forward_takes_fp8_from_the_norm_and_the_gelu(monkeypatch):
    """With both feed-forward projections FP8, the norm before them writes the up-projection's FP8 input and
    the GELU the down-projection's: two quantisation passes fewer per block than quantising each layer's
    input, and the same output up to where the bf16 rounding before quantisation is skipped."""
    import activations

    _, tr, kw = _bf16_case()
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    try:
        calls = count_calls(monkeypatch, [(activations, "fp8_quantize")])
        fused = run_model(tr, kw)
        assert calls["fp8_quantize"] == 2 * ATTN_QUANT_PASSES
        monkeypatch.setattr(di, "_fp8_feed_forward", lambda ff: None)
        calls.clear()
        separate = run_model(tr, kw)
        assert calls["fp8_quantize"] == 2 * (ATTN_QUANT_PASSES + 2)
        rel = float((fused.double() - separate.double()).norm() / separate.double().norm())
        assert rel < 0.05, f"fused FP8 feed-forward off the separately quantised one by rel. L2 {rel:.4f}"
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def test_hook_on_a_feed_forward_projection_turns_the_fusion_off(monkeypatch):
    import activations

    _, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    seen = []
    down = tr.transformer_blocks[0].ff.net[2]
    handle = down.register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape)))
    try:
        calls = count_calls(monkeypatch, [(activations, "fp8_quantize")])
        run_model(tr, kw)
        assert calls["fp8_quantize"] == ATTN_QUANT_PASSES + 2 and len(seen) == 1, "each layer ran as a module"
    finally:
        handle.remove()
        di.remove_optimized_kernels(tr, verbose=False)


def test_attention_inputs_quantised_once_and_output_close(monkeypatch):
    """q, k and v read one FP8 copy of their input (k and v of the cross-attention: one of the text); the
    output is that of quantising each layer's input separately (the same FP8 values, bit for bit)."""
    import activations

    _, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    try:
        calls = count_calls(monkeypatch, [(activations, "fp8_quantize")])
        shared = run_model(tr, kw)
        assert calls["fp8_quantize"] == ATTN_QUANT_PASSES
        calls.clear()
        # each of q, k, v through its own layer (which quantises its input), as without shared quantisation
        per_layer = lambda attn, h, e: (ic.call(attn.to_q, h), ic.call(attn.to_k, e), ic.call(attn.to_v, e))  # noqa: E731
        monkeypatch.setattr(di, "_project_qkv", per_layer)
        separate = run_model(tr, kw)
        # q, k, v of both attentions each quantising its own input, and both to_out layers
        assert calls["fp8_quantize"] == 6 + 2
        assert torch.equal(shared, separate)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def test_layer_errors_report_each_block_linear_and_leave_the_model_alone():
    _, tr, kw = _bf16_case()
    stock = run_model(tr, kw)
    errors = fp8_linear.layer_errors(tr.transformer_blocks, lambda: run_model(tr, kw))
    captured = {}
    to_q = tr.transformer_blocks[1].attn1.to_q
    h = to_q.register_forward_hook(lambda m, a, o: captured.update(x=a[0].clone(), y=o.clone()))
    try:
        run_model(tr, kw)  # deterministic: to_q sees the input it saw under layer_errors
    finally:
        h.remove()
    assert len(errors) == 2 * LINEARS_PER_BLOCK and "1.attn1.to_q" in errors
    assert all(0.0 < e < 0.1 for e in errors.values()), errors
    # the reported figure is the FP8 twin's error on the input the layer received
    with torch.no_grad():
        y8 = fp8_linear.Fp8Linear.from_linear(to_q)(captured["x"]).double()
    ref = captured["y"].double()
    assert errors["1.attn1.to_q"] == pytest.approx(float((y8 - ref).norm() / ref.norm()), rel=1e-9)
    assert not any(m._forward_hooks for m in tr.modules()) and torch.equal(run_model(tr, kw), stock)


def test_benchmark_summary_of_layer_errors():
    import benchmark_e2e as be

    _, tr, kw = _bf16_case(num_layers=1)
    s = be.fp8_layer_errors(tr, kw, di)
    assert s["layers"] == LINEARS_PER_BLOCK and 0 < s["median"] <= s["max"] < 0.1
    assert len(s["worst"]) == 5 and s["worst"][0]["rel_l2"] == s["max"]


@pytest.mark.parametrize("where", ["gelu", "dropout", "feed_forward"])
def test_forward_put_in_place_of_a_feed_forward_module_runs(where):
    """A forward assigned to the feed-forward's GELU, its dropout or the feed-forward itself (as accelerate
    and diffusers hooks do) must run: the fused FP8 feed-forward, which calls none of them, steps aside."""
    _, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    ff = tr.transformer_blocks[0].ff
    target = {"gelu": ff.net[0], "dropout": ff.net[1], "feed_forward": ff}[where]
    original, calls = target.forward, []

    def forward(x):
        calls.append(where)
        return original(x)

    target.forward = forward
    try:
        run_model(tr, kw)
        assert calls == [where]
    finally:
        del target.forward
        di.remove_optimized_kernels(tr, verbose=False)


def test_fused_feed_forward_wiring(monkeypatch):
    """The fused path runs the tanh GELU with per-token FP8 output, and the up projection's bias counts: a
    large bias moves the fused and the separately quantised outputs alike (and away from a zero bias)."""
    import activations

    _, tr, kw = _bf16_case(num_layers=1)
    up = tr.transformer_blocks[0].ff.net[0].proj
    with torch.no_grad():
        up.bias.fill_(3.0)  # before injection: FP8 layers take no new values
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    fused_path = di._fp8_feed_forward
    try:
        seen = []
        original = activations.gelu

        def spy(x, approximate="tanh", **kw):
            seen.append((approximate, kw.get("fp8")))
            return original(x, approximate, **kw)

        monkeypatch.setattr(activations, "gelu", spy)
        fused = run_model(tr, kw)
        assert seen == [("tanh", "per_token")]
        monkeypatch.setattr(di, "_fp8_feed_forward", lambda ff: None)
        separate = run_model(tr, kw)
        rel = float((fused.double() - separate.double()).norm() / separate.double().norm())
        assert rel < 0.02, f"fused FP8 feed-forward off the separately quantised one by rel. L2 {rel:.4f}"
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    monkeypatch.setattr(di, "_fp8_feed_forward", fused_path)
    with torch.no_grad():
        up.bias.zero_()
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    try:
        assert float((run_model(tr, kw).double() - fused.double()).norm() / fused.double().norm()) > 0.05
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def test_grad_mode_with_an_input_requiring_grad_raises():
    """FP8 layers have no backward: in training they raise instead of letting gradients stop silently."""
    _, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    try:
        kw["hidden_states"].requires_grad_(True)
        with pytest.raises(RuntimeError, match="no backward"):
            tr(**kw)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def test_torch_compile_fullgraph_traces_the_fp8_mode():
    """fullgraph=True on the FP8 model: no graph break; the captured graph calls the quantisation op and the
    FP8 outputs of the norm and the GELU; its output is the eager FP8 output up to bf16 rounding order.
    The graph is Dynamo's, before AOT autograd: there the ops keep their names on every device (after it,
    a GPU's triton_op twins become kernel-wrapper nodes)."""
    _, tr, kw = _bf16_case(num_layers=1)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    try:
        eager = run_model(tr, kw)
        out, ops, seen = run_compiled_fullgraph(tr, kw)
        assert {"act_fp8", "rms_norm_fused"} <= ops, sorted(seen)
        assert any("_scaled_mm" in s for s in seen), sorted(seen)
        rel = float((out.double() - eager.double()).norm() / eager.double().norm())
        assert rel < 2.0**-5, f"compiled FP8 model off the eager one by rel. L2 {rel:.4f}"
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


# --------------------------------------------------------------------------------------------
# States a user puts an FP8 model in: new weights, casts, adapters
# --------------------------------------------------------------------------------------------
def _fp8_injected(num_layers=1):
    gen, tr, kw = _bf16_case(num_layers=num_layers, size=SMALL)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    return gen, tr, kw


@pytest.mark.parametrize("state", ["bf16 model", "other FP8 model"])
@pytest.mark.parametrize("strict", [True, False])
def test_loading_other_weights_into_an_fp8_model_raises_and_changes_nothing(strict, state):
    """A bf16 state dict (a fine-tuned checkpoint, say), or another FP8 model's, cannot go into FP8 layers:
    load_state_dict raises, even with strict=False, before it writes anything (torch copies module by module:
    the layers before the first FP8 one would be overwritten), instead of casting the values into the FP8
    buffers without their scales."""
    gen, tr, kw = _fp8_injected()
    fp8_out = run_model(tr, kw)
    before = tensor_copies(tr)
    other = di.build_tiny_ltx_pipeline(num_layers=1, seed=7).transformer.to(DEVICE, torch.bfloat16)
    if state == "other FP8 model":
        di.inject_optimized_kernels(other, verbose=False, fp8=True)
    try:
        with pytest.raises(RuntimeError, match="cannot take new weights"):
            tr.load_state_dict(other.state_dict(), strict=strict)
        assert changed_tensors(tr, before) == [], "nothing written"
        assert torch.equal(run_model(tr, kw), fp8_out)
        layer = tr.transformer_blocks[0].attn1.to_q
        assert isinstance(layer, fp8_linear.Fp8Linear)
        with pytest.raises(RuntimeError, match="cannot take new weights"):
            layer.load_state_dict(other.transformer_blocks[0].attn1.to_q.state_dict(), strict=False)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
        di.remove_optimized_kernels(other, verbose=False)


def test_fp8_inside_inference_mode_is_refused_and_changes_nothing():
    """FP8 layers made inside torch.inference_mode() would hold inference tensors: no version counter (writes
    in place would go unnoticed), and load_state_dict cannot write them outside it. fp8=True there (and
    swap_in_fp8) raises before anything changes; injected outside, the model then runs inside it, its own
    state dict loads, and a write in place is caught."""
    gen, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    modules, before = list(tr.named_modules()), tensor_copies(tr)
    for inject in (
        lambda: di.inject_optimized_kernels(tr, verbose=False, fp8=True),
        lambda: fp8_linear.swap_in_fp8(tr, di.fp8_parents(tr)),
    ):
        with torch.inference_mode(), pytest.raises(ValueError, match=r"outside torch\.inference_mode\(\)"):
            inject()
        assert [(n, id(m)) for n, m in tr.named_modules()] == [(n, id(m)) for n, m in modules], "no module replaced"
        assert changed_tensors(tr, before) == []
        assert not any(di.injected_counts(tr).values()) and "save_pretrained" not in tr.__dict__

    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    try:
        out = run_model(tr, kw)
        with torch.inference_mode():
            assert torch.equal(tr(**kw)[0], out)
        tr.load_state_dict(tr.state_dict())
        with torch.no_grad():
            tr.transformer_blocks[0].attn1.to_k.weight_scale.mul_(2)
        with pytest.raises(RuntimeError, match="written after quantisation"):
            run_model(tr, kw)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def test_fp8_state_dict_round_trip_loads_and_computes_the_same():
    """The FP8 model's own state dict (FP8 values, scales, biases) loads back into it; the output is the same."""
    gen, tr, kw = _fp8_injected()
    try:
        out = run_model(tr, kw)
        sd = tr.state_dict()
        assert any(k.endswith("to_q.weight_fp8") for k in sd) and not any(k.endswith("to_q.weight") for k in sd)
        tr.load_state_dict(sd)
        assert torch.equal(run_model(tr, kw), out)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


@pytest.mark.parametrize("write", ["weight_fp8.copy_", "weight_scale.mul_", "bias.add_", "foreign fp8 state"])
def test_fp8_weights_written_in_place_make_the_next_call_raise(write):
    """FP8 values or scales changed after quantisation (in place, or a state dict of other FP8 values) would
    compute what no weight says, and removal would drop them: refused, or the next call raises."""
    gen, tr, kw = _fp8_injected()
    layer = tr.transformer_blocks[0].attn1.to_k
    try:
        with torch.no_grad():
            if write == "weight_fp8.copy_":
                layer.weight_fp8.copy_(torch.randn(layer.weight_fp8.shape, generator=gen).to(DEVICE, torch.bfloat16))
            elif write == "weight_scale.mul_":
                layer.weight_scale.mul_(2)
            elif write == "bias.add_":
                layer.bias.add_(1)
            else:
                sd = {k: v.clone() for k, v in layer.state_dict().items()}
                sd["weight_scale"].mul_(2)
                with pytest.raises(RuntimeError, match="differs from this layer's"):
                    layer.load_state_dict(sd)
                return
        tr.to(DEVICE)  # a move (here to where it is) does not make the layer take the written values as its own
        with pytest.raises(RuntimeError, match="written after quantisation"):
            run_model(tr, kw)
        with pytest.raises(RuntimeError, match="written after quantisation"):
            run_model(tr, kw)  # and it stays refused
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def test_casting_an_fp8_model_keeps_its_fp8_weights():
    """model.to(torch.bfloat16) (a pipeline's usual .to(device, dtype)) leaves the FP8 values and scales as
    they are and the output the same; a cast to fp16 makes the FP8 layers raise until the model is cast back;
    removal after such a cast brings the bf16 layers back in the model's dtype."""
    gen, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    stock = run_model(tr, kw)
    di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    layer = tr.transformer_blocks[0].ff.net[2]
    try:
        out = run_model(tr, kw)
        fp8_dtype, w = layer.weight_fp8.dtype, layer.weight_fp8.view(torch.uint8).clone()
        tr.to(DEVICE, torch.bfloat16)
        assert layer.weight_fp8.dtype == fp8_dtype and layer.weight_scale.dtype == torch.float32
        assert torch.equal(layer.weight_fp8.view(torch.uint8), w) and torch.equal(run_model(tr, kw), out)
        tr.half()
        assert layer.weight_fp8.dtype == fp8_dtype
        kw16 = {k: (v.half() if torch.is_tensor(v) and v.dtype == torch.bfloat16 else v) for k, v in kw.items()}
        with pytest.raises(RuntimeError, match="cast to torch.float16"):
            run_model(tr, kw16)
        tr.bfloat16()
        assert torch.equal(run_model(tr, kw), out)
        tr.half()
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    assert all(m.weight.dtype == torch.float16 for m in tr.transformer_blocks.modules() if type(m) is torch.nn.Linear)
    tr.bfloat16()
    assert torch.equal(run_model(tr, kw), stock)


def test_weight_of_an_fp8_layer_can_be_neither_read_nor_set():
    """An FP8 layer has no bf16 weight: reading .weight raises (code that builds layers from it would take FP8
    values without their scales), and so does setting it."""
    gen, tr, kw = _fp8_injected()
    layer = tr.transformer_blocks[0].attn2.to_v
    try:
        with pytest.raises(AttributeError, match="has no weight.*remove_optimized_kernels"):
            layer.weight
        assert not hasattr(layer, "weight") and hasattr(layer, "weight_fp8")
        with pytest.raises(AttributeError, match="cannot be set"):
            layer.weight = torch.zeros_like(layer.weight_fp8)
    finally:
        di.remove_optimized_kernels(tr, verbose=False)


def _lora(tr, targets, rank):
    peft = pytest.importorskip("peft")
    tr.add_adapter(peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False))


def test_layers_under_a_lora_stay_bf16_and_unloading_it_then_removing_fp8_restores_exactly():
    """A LoRA loaded before fp8=True: the layers it wraps (their base layers and the adapter's own, rank 16
    included) stay bf16, the others become FP8, the output stays near the LoRA model's; unloading the LoRA
    and removing the kernels gives back exactly the model without the LoRA."""
    gen, tr, kw = _bf16_case(num_layers=1)
    stock = run_model(tr, kw)
    _lora(tr, ["attn1.to_q", "ff.net.2"], rank=16)
    with_lora = run_model(tr, kw)
    assert _rel(with_lora, stock) > 0.02  # the adapter changes the output
    counts = di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    try:
        blk = tr.transformer_blocks[0]
        assert counts["fp8_linear"] == LINEARS_PER_BLOCK - 2
        assert type(blk.attn1.to_q.base_layer) is torch.nn.Linear and type(blk.ff.net[2].base_layer) is torch.nn.Linear
        assert all(type(m) is torch.nn.Linear for m in blk.attn1.to_q.modules() if isinstance(m, torch.nn.Linear))
        assert isinstance(blk.attn1.to_k, fp8_linear.Fp8Linear)
        assert _rel(run_model(tr, kw), with_lora) < 0.05
        tr.unload_lora()
        assert type(blk.attn1.to_q) is torch.nn.Linear
    finally:
        di.remove_optimized_kernels(tr, verbose=False)
    assert not any(isinstance(m, fp8_linear.Fp8Linear) for m in tr.modules())
    assert torch.equal(run_model(tr, kw), stock)


def test_lora_over_every_layer_leaves_nothing_for_fp8_and_says_why():
    gen, tr, kw = _bf16_case(num_layers=1, size=SMALL)
    _lora(tr, ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"], rank=4)
    before = run_model(tr, kw)
    with pytest.raises(ValueError, match="under a LoRA or other adapter") as err:
        di.inject_optimized_kernels(tr, verbose=False, fp8=True)
    assert "on the GPU" not in str(err.value)  # no advice that does not apply
    assert not di.injected_counts(tr)["fp8_linear"] and torch.equal(run_model(tr, kw), before)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_pipeline_save_pretrained_refused_before_writing_anything(tmp_path):
    """fp8=True on a pipeline: the pipeline's save_pretrained raises before it writes model_index.json or any
    other component (the transformer's own refusal came after those), also once the FP8 layers were removed
    through the transformer alone, and on a shallow copy (whose inherited check is bound to the original: it
    must never save the original's components for it). remove_optimized_kernels(pipe) ends it; the saved
    pipeline loads back."""
    import copy

    pipe = di.build_tiny_ltx_pipeline(num_layers=1)
    pipe.transformer.to(DEVICE, torch.bfloat16)
    di.inject_optimized_kernels(pipe, verbose=False, fp8=True)
    shallow = copy.copy(pipe)
    for undo in (None, lambda: di.remove_optimized_kernels(pipe.transformer, verbose=False)):
        if undo is not None:
            undo()
        for p in (pipe, shallow):
            with pytest.raises(RuntimeError, match="nothing was written"):
                p.save_pretrained(tmp_path / "fp8")
            assert not (tmp_path / "fp8").exists()
    di.remove_optimized_kernels(pipe, verbose=False)
    assert "save_pretrained" not in vars(pipe)
    pipe.save_pretrained(tmp_path / "bf16")
    with pytest.raises(RuntimeError, match="nothing was written"):
        shallow.save_pretrained(tmp_path / "copy")  # until removal on the copy itself
    di.remove_optimized_kernels(shallow, verbose=False)
    assert "save_pretrained" not in vars(shallow)
    loaded = type(pipe).from_pretrained(tmp_path / "bf16")
    for name, p in pipe.transformer.state_dict().items():
        assert torch.equal(loaded.transformer.state_dict()[name].to(p), p), name

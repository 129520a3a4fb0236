# SPDX-License-Identifier: Apache-2.0
"""inject_optimized_kernels(fp8=True) on SD3, FLUX and Wan: which linear layers become FP8, that the model
then computes the FP8 products (against a float64 PyTorch reference of them, hooked into the bf16 model),
and that removal puts the very same modules back. Tiny random transformers, through Triton's interpreter
on the CPU or natively on a GPU. LTX-Video's FP8 mode: test_ltx_fp8.py."""

import pytest
import torch

import diffusers_injection as di
import fp8_linear
import generic_injection as gi
import mmdit_injection as mi
import wan_injection as wi
from kernel_testing import (
    DEVICE,
    changed_tensors,
    count_calls,
    make_generator,
    run_compiled_fullgraph,
    run_model,
    tensor_copies,
)

MODELS = ("sd3", "flux", "wan", "wan-i2v")
# named independently of the rule in diffusers_injection.fp8_parents: layers that must become FP8, and the
# AdaLN norms' layers inside the blocks that must stay bf16
MUST_BE_FP8 = {
    "sd3": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.attn2.to_v",
            "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff_context.net.2"],
    "flux": ["transformer_blocks.0.attn.to_add_out", "transformer_blocks.0.ff.net.2",
             "single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.proj_out",
             "single_transformer_blocks.0.attn.to_q"],
    "wan": ["blocks.0.attn1.to_q", "blocks.0.attn2.to_out.0", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"],
    "wan-i2v": ["blocks.0.attn2.add_k_proj", "blocks.0.attn2.add_v_proj", "blocks.0.attn2.to_k"],
}  # fmt: skip
MUST_STAY_BF16 = {
    "sd3": ["transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
            "transformer_blocks.1.norm1.linear", "proj_out", "context_embedder"],
    "flux": ["transformer_blocks.0.norm1.linear", "transformer_blocks.0.norm1_context.linear",
             "single_transformer_blocks.0.norm.linear", "x_embedder", "proj_out"],
    "wan": ["condition_embedder.time_proj", "proj_out"],
    "wan-i2v": ["condition_embedder.time_proj", "proj_out"],
}  # fmt: skip


def _case(kind, seed):
    if kind.startswith("wan"):
        i2v = kind == "wan-i2v"  # image cross-attention (add_k_proj, add_v_proj); text_len 512 as I2V takes it
        model = wi.build_wan_transformer("tiny-i2v" if i2v else "tiny", dtype=torch.bfloat16, device=DEVICE, seed=seed)
        extra = dict(text_len=512, image_len=5) if i2v else {}
        return model, wi.make_wan_inputs(model, dtype=torch.bfloat16, device=DEVICE, seed=seed + 1, **extra)
    build = mi.build_sd3_transformer if kind == "sd3" else mi.build_flux_transformer
    model = build("tiny", dtype=torch.bfloat16, device=DEVICE, seed=seed)
    kw = mi.make_mmdit_inputs(model, batch=2, height=64, width=64, text_len=7, device=DEVICE, seed=seed + 1)
    return model, kw


def _expected_fp8_names(model):
    """By name: the nn.Linear layers inside the blocks with no norm module on their path (the AdaLN norms'
    linear layers take the timestep embedding and stay bf16)."""
    modules = dict(model.named_modules())
    names = []
    for name, m in modules.items():
        parts = name.split(".")
        if type(m) is not torch.nn.Linear or parts[0] not in (
            "transformer_blocks",
            "single_transformer_blocks",
            "blocks",
        ):
            continue
        path = [".".join(parts[:i]) for i in range(1, len(parts))]
        if not any("Norm" in type(modules[p]).__name__ for p in path):
            names.append(name)
    return names


def _fp8_product(x, layer, weight):
    """float64 FP8 product of an Fp8Linear on input x, by PyTorch ops from the bf16 weight it was made from:
    scale = max|row| / fp8 max per row of x and per output channel of the weight; x times 1 / scale in fp32
    (what the quantising kernels compute: one multiply) and the weight divided by its scale
    (fp8_linear.quantize_weight), each rounded to the nearest FP8; multiplied exactly, the bias added."""
    fp8 = layer.weight_fp8.dtype
    fmax = torch.finfo(fp8).max

    def scale_of(t):
        return (t.float().abs().amax(-1, keepdim=True) / fmax).clamp_min(1e-12)

    def fp8_values(q, scale):
        return q.clamp(-fmax, fmax).to(fp8).double() * scale.double()

    sx, sw = scale_of(x), scale_of(weight)
    y = fp8_values(x.float() * (1.0 / sx), sx) @ fp8_values(weight.float() / sw, sw).T
    return y if layer.bias is None else y + layer.bias.double()


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("kind", MODELS)
def test_fp8_layers_compute_the_fp8_products_and_removal_restores_exactly(kind):
    seed = make_generator().seed_value
    model, kw = _case(kind, seed)
    expected = _expected_fp8_names(model)
    originals = {n: m for n, m in model.named_modules() if n in expected}
    stock = run_model(model, kw)
    di.inject_optimized_kernels(model, verbose=False)
    bf16_kernels = run_model(model, kw)
    di.remove_optimized_kernels(model, verbose=False)

    counts = di.inject_optimized_kernels(model, verbose=False, fp8=True)
    errors, handles = {}, []
    try:
        layers = {n: m for n, m in model.named_modules() if isinstance(m, fp8_linear.Fp8Linear)}
        assert list(layers) == expected and counts["fp8_linear"] == len(expected) > 0
        modules = dict(model.named_modules())
        assert all(isinstance(modules[n], fp8_linear.Fp8Linear) for n in MUST_BE_FP8[kind])
        assert all(type(modules[n]) is torch.nn.Linear for n in MUST_STAY_BF16[kind])
        for name, layer in layers.items():  # each layer, on the input it gets in the model: its FP8 product
            weight = originals[name].weight.to(DEVICE)  # (the swap moved the bf16 layer to the CPU)

            def check(module, args, out, name=name, weight=weight):
                errors[name] = _rel(out, _fp8_product(args[0], module, weight))

            handles.append(layer.register_forward_hook(check))
        out = run_model(model, kw)
    finally:
        for h in handles:
            h.remove()
        restored = di.remove_optimized_kernels(model, verbose=False)

    assert sorted(errors) == sorted(expected), "every FP8 layer ran"
    # the bf16 rounding of the output (about 2e-3); the bf16 product would be 1.5e-2 to 4e-2 away (FP8's
    # error, test_layer_errors_cover_the_layers_fp8_replaces)
    assert max(errors.values()) < 5e-3, f"{kind}: {errors} (seed {seed})"
    assert torch.isfinite(out).all()
    to_bf16 = _rel(out, bf16_kernels)
    assert 1e-3 < to_bf16 < 0.15, f"{kind}: FP8 output off the bf16 model's by {to_bf16:.4f} (seed {seed})"
    assert restored["fp8_linear"] == len(expected)
    assert all(dict(model.named_modules())[n] is m for n, m in originals.items()), "the very same modules"
    assert torch.equal(run_model(model, kw), stock)


def test_a_model_with_nothing_to_swap_undoes_this_calls_swaps_in_the_others():
    """SD3 in bf16 and Wan in float32 in one container: Wan has no layer FP8 can take, so the call raises,
    and SD3 keeps only the FP8 layers of an earlier call (none, then all of its own)."""
    seed = make_generator().seed_value
    sd3, _ = _case("sd3", seed)
    wan = wi.build_wan_transformer("tiny", dtype=torch.float32, device=DEVICE, seed=seed)
    both = torch.nn.ModuleDict({"transformer": sd3, "transformer_2": wan})
    with pytest.raises(ValueError, match="replaced no linear layer of the WanTransformer3DModel.*float32 weight"):
        di.inject_optimized_kernels(both, verbose=False, fp8=True)
    assert fp8_linear.fp8_linear_count(sd3) == 0
    assert not any(isinstance(m, fp8_linear.Fp8Linear) for m in sd3.modules())
    assert di.injected_counts(both) == {k: 0 for k in di.injected_counts(both)}, "nothing injected"

    first = di.inject_optimized_kernels(sd3, verbose=False, fp8=True)["fp8_linear"]
    with pytest.raises(ValueError, match="replaced no linear layer"):
        di.inject_optimized_kernels(both, verbose=False, fp8=True)
    assert fp8_linear.fp8_linear_count(sd3) == first > 0, "the earlier call's FP8 layers stay"
    di.remove_optimized_kernels(both, verbose=False)
    assert fp8_linear.fp8_linear_count(sd3) == 0 and not any(isinstance(m, fp8_linear.Fp8Linear) for m in sd3.modules())


@pytest.mark.parametrize("kind", MODELS)
def test_layer_errors_cover_the_layers_fp8_replaces(kind):
    model, kw = _case(kind, make_generator().seed_value)
    errs = fp8_linear.layer_errors(model, lambda: run_model(model, kw), parents=di.fp8_parents(model))
    assert sorted(errs) == sorted(_expected_fp8_names(model))
    assert all(0 < e < 0.1 for e in errs.values()), errs
    assert list(errs.values()) == sorted(errs.values(), reverse=True), "worst first"


@pytest.mark.parametrize("model_state", ["fp8", "fp32", "no forward"])
def test_layer_errors_refuses_a_model_it_cannot_measure(model_state):
    """On an FP8 model, an fp32 one, or a forward that runs none of the layers, layer_errors raises with
    the reason instead of returning an empty result (which would read as "no error")."""
    model, kw = _case("sd3", make_generator().seed_value)
    if model_state == "fp8":
        di.inject_optimized_kernels(model, verbose=False, fp8=True)
    elif model_state == "fp32":
        model.float()
    forward = (lambda: None) if model_state == "no forward" else (lambda: run_model(model, kw))
    match = {"fp8": "remove_optimized_kernels", "fp32": "float32", "no forward": "ran none"}[model_state]
    try:
        with pytest.raises(ValueError, match=match):
            fp8_linear.layer_errors(model, forward, parents=di.fp8_parents(model))
    finally:
        di.remove_optimized_kernels(model, verbose=False)


@pytest.mark.parametrize("kind", MODELS)
def test_fusing_projections_after_fp8_raises_and_changes_nothing(kind):
    """diffusers' fuse_qkv_projections builds one layer from to_q/to_k/to_v's .weight. From FP8 layers that
    would be FP8 values without their scales (used as weights under autocast: 1.3 rel. L2 off, silently, on
    Wan, before FP8 layers refused .weight). Now the fusion raises, and the model computes as before."""
    model, kw = _case(kind, make_generator().seed_value)
    di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        out = run_model(model, kw)
        with pytest.raises(AttributeError, match="has no weight.*remove_optimized_kernels"):
            model.fuse_qkv_projections()
        assert not any(getattr(m, "fused_projections", False) for m in model.modules())
        assert torch.equal(run_model(model, kw), out)
    finally:
        di.remove_optimized_kernels(model, verbose=False)


def _fp8_layers(gen, n, k=32, out=48):
    layers = []
    for _ in range(n):
        lin = torch.nn.Linear(k, out).to(DEVICE, torch.bfloat16)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out, k, generator=gen).to(DEVICE) * k**-0.5)
            lin.bias.copy_(torch.randn(out, generator=gen).to(DEVICE) * 0.1)
        layers.append(fp8_linear.Fp8Linear.from_linear(lin))
    return layers


def test_project_quantises_its_input_once_and_equals_calling_each_layer(monkeypatch):
    import activations

    gen = make_generator()
    layers = _fp8_layers(gen, 3)
    x = torch.randn(2, 7, 32, generator=gen).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        each = [m(x) for m in layers]
        calls = count_calls(monkeypatch, [(activations, "fp8_quantize")])
        shared = fp8_linear.project(x, *layers)
        assert calls["fp8_quantize"] == 1
        assert all(torch.equal(a, b) for a, b in zip(shared, each)), "the same values as each layer's own call"

        fired = []
        layers[1].register_forward_hook(lambda m, a, o: fired.append(m))
        calls.clear()
        hooked = fp8_linear.project(x, *layers)
        assert calls["fp8_quantize"] == 3 and fired == [layers[1]], "a hooked layer: each layer called as usual"
        assert all(torch.equal(a, b) for a, b in zip(hooked, each))

        plain = torch.nn.Linear(32, 48).to(DEVICE, torch.bfloat16)
        calls.clear()
        mixed = fp8_linear.project(x, layers[0], plain, layers[2])
        assert calls["fp8_quantize"] == 2 and torch.equal(mixed[1], plain(x))


class _Doubled(fp8_linear.Fp8Linear):  # a subclass with a forward of its own
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("state", ["global hook", "instance forward", "subclass", "other format"])
def test_project_calls_each_layer_where_one_would_not_run_its_own_forward(state, monkeypatch):
    """Where a layer would run more than Fp8Linear.forward (a global hook, a forward put on the instance, a
    subclass's forward) or the layers differ in FP8 format, project calls each layer: same values as
    calling them, and whatever they add runs."""
    import activations

    gen = make_generator()
    layers = _fp8_layers(gen, 3)
    x = torch.randn(2, 7, 32, generator=gen).to(DEVICE, torch.bfloat16)
    fired, handles = [], []
    if state == "global hook":
        handles.append(torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: fired.append(m)))
    elif state == "instance forward":
        own = layers[2].forward
        layers[2].forward = lambda inp: own(inp) + 1
    elif state == "subclass":
        layers[1] = _Doubled(layers[1].weight_fp8, layers[1].weight_scale, layers[1].bias, torch.bfloat16)
    else:
        if DEVICE.type != "cpu":
            pytest.skip("a GPU takes its own FP8 format only (fp8_linear raises for the other)")
        other = {torch.float8_e4m3fn: torch.float8_e4m3fnuz, torch.float8_e4m3fnuz: torch.float8_e4m3fn}
        lin = torch.nn.Linear(32, 48).to(DEVICE, torch.bfloat16)
        layers[0] = fp8_linear.Fp8Linear.from_linear(lin, other[layers[1].weight_fp8.dtype])
    try:
        with torch.no_grad():
            each = [m(x) for m in layers]
            fired.clear()
            calls = count_calls(monkeypatch, [(activations, "fp8_quantize")])
            got = fp8_linear.project(x, *layers)
    finally:
        for h in handles:
            h.remove()
    assert calls["fp8_quantize"] == 3, "each layer quantised its own input"
    assert all(torch.equal(a, b) for a, b in zip(got, each))
    assert fired == (layers if state == "global hook" else [])


@pytest.mark.parametrize("kind", MODELS)
def test_attention_inputs_quantised_once_with_the_same_output(kind, monkeypatch):
    """Each attention input is quantised once for its q, k and v (fp8_linear.project); the model's output
    is bit for bit that of every layer quantising its own input (the same layers on the same inputs: that
    the processors pass the right ones is for the parity tests of test_mmdit_injection / test_wan_injection)."""
    import activations

    model, kw = _case(kind, make_generator().seed_value)
    di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        shared_projections = []
        project = fp8_linear.project

        def spy(x, *layers):
            shared_projections.append(all(isinstance(m, fp8_linear.Fp8Linear) for m in layers) and len(layers) == 3)
            return project(x, *layers)

        monkeypatch.setattr(fp8_linear, "project", spy)
        calls = count_calls(monkeypatch, [(activations, "fp8_quantize")])
        shared = run_model(model, kw)
        passes = calls["fp8_quantize"]
        assert sum(shared_projections) >= 2, "the processors project q, k, v through fp8_linear.project"
        monkeypatch.setattr(fp8_linear, "project", lambda x, *layers: [m(x) for m in layers])
        calls.clear()
        separate = run_model(model, kw)
        assert calls["fp8_quantize"] - passes == 2 * sum(shared_projections)
        assert torch.equal(shared, separate)
    finally:
        di.remove_optimized_kernels(model, verbose=False)


@pytest.mark.parametrize("state", ["input requires grad", "scale written in place", "model cast to fp16"])
def test_project_refuses_what_each_layer_refuses(state):
    """The shared path keeps every layer's own refusals: an input that requires grad (no backward), FP8
    state written after quantisation (checked for each layer, not only the first), a model cast away from
    the layers' output dtype."""
    gen = make_generator()
    layers = _fp8_layers(gen, 3)
    x = torch.randn(2, 7, 32, generator=gen).to(DEVICE, torch.bfloat16)
    if state == "input requires grad":
        x.requires_grad_(True)
        match = "requires grad"
    elif state == "scale written in place":
        with torch.no_grad():
            layers[2].weight_scale.mul_(2)
        match = "written after quantisation"
    else:
        layers[1].half()
        match = "cast to torch.float16"
    for call in (lambda: [m(x) for m in layers], lambda: fp8_linear.project(x, *layers)):
        with pytest.raises(RuntimeError, match=match):
            call()


@pytest.mark.parametrize("kind", ("sd3", "flux", "wan"))
def test_feed_forward_gelu_writes_the_down_projections_fp8_input(kind, monkeypatch):
    """In the blocks' feed-forwards (up -> GELU-tanh -> down, both FP8) the GELU kernel writes the down
    projection's FP8 input: one quantisation pass fewer per feed-forward. Each feed-forward's output is the
    float64 FP8 product chain on the input it received: up's FP8 product rounded to bf16, the GELU, its
    per-token FP8 values, down's FP8 product (the bias of each counted). A hook on a projection turns it off."""
    from diffusers.models.attention import FeedForward

    import activations

    seed = make_generator().seed_value
    model, kw = _case(kind, seed)
    with torch.no_grad():  # biases large enough that dropping one would show
        for m in model.modules():
            if type(m) is FeedForward:
                m.net[0].proj.bias.normal_(0.0, 0.5)
                m.net[2].bias.normal_(0.0, 0.5)
    ffs = [m for m in model.modules() if type(m) is FeedForward]
    weights = {id(m): (m.net[0].proj.weight.detach().clone(), m.net[2].weight.detach().clone()) for m in ffs}
    di.inject_optimized_kernels(model, verbose=False, fp8=True)
    seen, original = [], gi.feed_forward

    def spy(ff, x, state_key):
        out = original(ff, x, state_key)
        seen.append((ff, x, out))
        return out

    gelus, gelu = [], activations.gelu

    def gelu_spy(x, approximate="tanh", **options):
        gelus.append((approximate, options.get("fp8")))
        return gelu(x, approximate, **options)

    try:
        monkeypatch.setattr(gi, "feed_forward", spy)
        monkeypatch.setattr(activations, "gelu", gelu_spy)
        calls = count_calls(monkeypatch, [(activations, "fp8_quantize")])
        fused = run_model(model, kw)
        n_fused = calls["fp8_quantize"]
        assert len(seen) == len(ffs) > 0 and gelus == [("tanh", "per_token")] * len(ffs)
        errors = []
        for ff, x, out in seen:
            up, down = ff.net[0].proj, ff.net[2]
            w_up, w_down = weights[id(ff)]
            with torch.no_grad():
                up_out = _fp8_product(x, up, w_up).to(torch.bfloat16)  # the bf16 output of the up projection
                g = torch.nn.functional.gelu(up_out.double(), approximate="tanh")
                errors.append(_rel(out, _fp8_product(g, down, w_down)))
        # the bf16 rounding of the outputs (about 2e-3); a dropped bias or a skipped GELU is far off
        assert max(errors) < 5e-3, f"{kind}: {errors} (seed {seed})"

        hook = ffs[0].net[2].register_forward_hook(lambda m, a, o: None)
        calls.clear()
        hooked = run_model(model, kw)
        hook.remove()
        assert calls["fp8_quantize"] == n_fused + 1, "the hooked feed-forward quantises the GELU's output itself"
        assert _rel(hooked, fused) < 0.02
    finally:
        di.remove_optimized_kernels(model, verbose=False)


def _half_gelu(self, gate):
    return 0.5 * torch.nn.functional.gelu(gate, approximate=self.approximate)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("how", ["subclass", "instance"])
@pytest.mark.parametrize("kind", ("sd3", "wan"))
def test_a_gelu_method_of_its_own_is_called(kind, how, fp8, monkeypatch):
    """A feed-forward GELU whose gelu method is its own (a subclass overriding it, or one put on the instance)
    computes with it: neither the GELU patch nor the fused FP8 feed-forward, which call neither, takes it."""
    from diffusers.models.activations import GELU

    model, kw = _case(kind, make_generator().seed_value)
    ff = next(m for m in model.modules() if type(m).__name__ == "FeedForward")
    gelu = ff.net[0]
    if how == "subclass":
        gelu.__class__ = type("HalfGELU", (GELU,), {"gelu": _half_gelu})
    else:
        gelu.gelu = _half_gelu.__get__(gelu)
    di.inject_optimized_kernels(model, verbose=False, fp8=fp8)
    seen, original = [], gi.feed_forward

    def spy(f, x, state_key):
        out = original(f, x, state_key)
        if f is ff:
            seen.append((x, out))
        return out

    try:
        monkeypatch.setattr(gi, "feed_forward", spy)
        run_model(model, kw)
        assert len(seen) == 1
        x, out = seen[0]
        with torch.no_grad():
            expected = ff.net[2](_half_gelu(gelu, gelu.proj(x)))
        assert torch.equal(out, expected)
    finally:
        di.remove_optimized_kernels(model, verbose=False)


def test_save_pretrained_is_refused_while_fp8_layers_are_in(tmp_path):
    """A checkpoint saved with FP8 layers in place would load into a bf16 model with those layers randomly
    initialised (diffusers only warns): save_pretrained raises until the FP8 layers are removed, then saves
    a checkpoint that loads back to the same output. copies and pickles of the model keep the refusal."""
    import copy

    model, kw = _case("sd3", make_generator().seed_value)
    stock = run_model(model, kw)
    di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        for m in (model, copy.deepcopy(model)):
            with pytest.raises(RuntimeError, match="remove_optimized_kernels"):
                m.save_pretrained(tmp_path / "fp8")
        assert not (tmp_path / "fp8").exists()
    finally:
        di.remove_optimized_kernels(model, verbose=False)
    assert "save_pretrained" not in model.__dict__
    model.save_pretrained(tmp_path / "bf16")
    loaded = type(model).from_pretrained(tmp_path / "bf16", torch_dtype=torch.bfloat16).to(DEVICE)
    assert torch.equal(run_model(loaded, kw), stock)


@pytest.mark.parametrize("state", ["bf16 model", "other FP8 model"])
@pytest.mark.parametrize("kind", ("sd3", "wan"))
def test_a_refused_state_dict_writes_nothing(kind, state):
    """Another model's state dict (bf16, or FP8 with other values) is refused by the FP8 layers before torch
    copies anything: every parameter and buffer stays bit-identical (the tensors before the first FP8 layer
    included). With FP8 removed, the same state dict loads."""
    seed = make_generator().seed_value
    model, _ = _case(kind, seed)
    other, _ = _case(kind, seed + 1)
    bf16_state = {k: v.clone() for k, v in other.state_dict().items()}
    if state == "other FP8 model":
        di.inject_optimized_kernels(other, verbose=False, fp8=True)
    di.inject_optimized_kernels(model, verbose=False, fp8=True)
    before = tensor_copies(model)
    try:
        with pytest.raises(RuntimeError, match="cannot take new weights"):
            model.load_state_dict(other.state_dict(), strict=False)
        assert changed_tensors(model, before) == [], f"{kind}: written before the refusal"
    finally:
        di.remove_optimized_kernels(model, verbose=False)
        di.remove_optimized_kernels(other, verbose=False)
    model.load_state_dict(bf16_state)
    assert all(torch.equal(v, bf16_state[k]) for k, v in model.state_dict().items())


def test_blocks_shared_by_two_transformers_are_fp8_in_both_and_removed_from_both(tmp_path):
    """transformer_2.blocks = transformer.blocks, then fp8=True on both: the FP8 layers are the same layers in
    both, so each counts them and refuses save_pretrained; removal through transformer_2 puts the bf16 layers
    back in both (both count none, both compute their stock output, both save bf16 weights)."""
    from safetensors.torch import load_file

    seed = make_generator().seed_value
    t1, kw = _case("wan", seed)
    t2, _ = _case("wan", seed + 2)
    t2.blocks = t1.blocks
    pipe = torch.nn.ModuleDict({"transformer": t1, "transformer_2": t2})
    stock = [run_model(t, kw) for t in (t1, t2)]
    n = len(_expected_fp8_names(t1))
    try:
        assert di.inject_optimized_kernels(pipe, verbose=False, fp8=True)["fp8_linear"] == n
        assert [di.injected_counts(t)["fp8_linear"] for t in (t1, t2)] == [n, n]
        for t in (t1, t2):
            with pytest.raises(RuntimeError, match="remove_optimized_kernels"):
                t.save_pretrained(tmp_path / "fp8")
        assert not (tmp_path / "fp8").exists()
        assert di.remove_optimized_kernels(t2, verbose=False)["fp8_linear"] == n
        assert not any(isinstance(m, fp8_linear.Fp8Linear) for m in pipe.modules())
        assert [di.injected_counts(t)["fp8_linear"] for t in (t1, t2)] == [0, 0]
        assert torch.equal(run_model(t2, kw), stock[1])
        for i, t in enumerate((t1, t2)):
            t.save_pretrained(tmp_path / str(i))
            saved = set(load_file(next((tmp_path / str(i)).glob("*.safetensors"))))
            assert "blocks.0.attn1.to_q.weight" in saved and not any("weight_fp8" in k for k in saved)
    finally:
        di.remove_optimized_kernels(pipe, verbose=False)
    assert torch.equal(run_model(t1, kw), stock[0])


@pytest.mark.parametrize("kind", ("sd3", "wan"))
def test_fp8_skip_leaves_the_named_layers_in_bf16(kind, capsys):
    model, kw = _case(kind, make_generator().seed_value)
    stock = run_model(model, kw)
    expected = _expected_fp8_names(model)
    skip = [expected[0], expected[-1]]
    originals = {n: dict(model.named_modules())[n] for n in skip}
    counts = di.inject_optimized_kernels(model, fp8=True, fp8_skip=skip)
    try:
        modules = dict(model.named_modules())
        assert all(modules[n] is originals[n] and type(modules[n]) is torch.nn.Linear for n in skip)
        assert counts["fp8_linear"] == len(expected) - 2
        assert all(isinstance(modules[n], fp8_linear.Fp8Linear) for n in expected[1:-1])
        captured = capsys.readouterr()
        log = captured.out + captured.err
        assert "named in fp8_skip" in log and skip[0] in log
        assert torch.isfinite(run_model(model, kw)).all()
    finally:
        di.remove_optimized_kernels(model, verbose=False)
    assert torch.equal(run_model(model, kw), stock)


@pytest.mark.parametrize(
    "skip, exc, match",
    [
        (["transformer_blocks.0.attn.no_such_layer"], ValueError, "no module has that name"),
        (["transformer_blocks.0.attn"], ValueError, "it is a Attention|it is a JointAttention|names no nn.Linear"),
        ("transformer_blocks.0.attn.to_q", TypeError, "collection of layer names"),
    ],
)
def test_fp8_skip_refuses_what_names_no_linear_layer(skip, exc, match):
    model, kw = _case("sd3", make_generator().seed_value)
    stock = run_model(model, kw)
    with pytest.raises(exc, match=match):
        di.inject_optimized_kernels(model, verbose=False, fp8=True, fp8_skip=skip)
    assert fp8_linear.fp8_linear_count(model) == 0 and not any(_STATE_KEYS & set(m.__dict__) for m in model.modules())
    assert torch.equal(run_model(model, kw), stock)
    with pytest.raises(ValueError, match="pass fp8=True"):
        di.inject_optimized_kernels(model, verbose=False, fp8_skip=["transformer_blocks.0.attn.to_q"])


_STATE_KEYS = {"_rtk_mmdit_injection", "_rtk_injection", "_rtk_wan_injection"}


def test_fp8_skip_taken_from_a_generator_and_kept_by_a_later_call(capsys):
    """A generator of names (as filtered from layer_errors) is read once; a later fp8=True call keeps the
    skipped layers in bf16 (it changes nothing), and naming a layer that is FP8 already says so. A name
    outside the layers fp8=True replaces is reported as having no effect."""
    model, kw = _case("sd3", make_generator().seed_value)
    expected = _expected_fp8_names(model)
    errs = {expected[0]: 0.2, expected[1]: 0.01}
    counts = di.inject_optimized_kernels(
        model, verbose=False, fp8=True, fp8_skip=(n for n, e in errs.items() if e > 0.1)
    )
    try:
        modules = dict(model.named_modules())
        assert type(modules[expected[0]]) is torch.nn.Linear and counts["fp8_linear"] == len(expected) - 1
        out = run_model(model, kw)
        assert di.inject_optimized_kernels(model, verbose=False, fp8=True)["fp8_linear"] == len(expected) - 1
        assert type(dict(model.named_modules())[expected[0]]) is torch.nn.Linear
        assert torch.equal(run_model(model, kw), out)
        with pytest.raises(ValueError, match="FP8 already"):
            di.inject_optimized_kernels(model, verbose=False, fp8=True, fp8_skip=[expected[1]])
        with pytest.raises(ValueError, match="layer_errors measures a bf16 model"):
            fp8_linear.layer_errors(model, lambda: run_model(model, kw))  # parents=None: the whole model
    finally:
        di.remove_optimized_kernels(model, verbose=False)
    capsys.readouterr()
    di.inject_optimized_kernels(model, fp8=True, fp8_skip=["proj_out"])
    try:
        captured = capsys.readouterr()
        assert "fp8_skip names proj_out, which fp8=True leaves as it is anyway" in captured.out + captured.err
        assert fp8_linear.fp8_linear_count(model) == len(expected)
    finally:
        di.remove_optimized_kernels(model, verbose=False)


@pytest.mark.parametrize("kind", ("sd3", "wan"))
def test_torch_compile_fullgraph_traces_the_fp8_mode(kind):
    """fullgraph=True on an FP8 SD3 or Wan model: no graph break (the fused feed-forward, project and the
    layers' checks all trace); the graph calls the quantisation op and torch._scaled_mm, and its output is
    the eager FP8 output up to bf16 rounding order (Dynamo's graph, run as captured)."""
    model, kw = _case(kind, make_generator().seed_value)
    di.inject_optimized_kernels(model, verbose=False, fp8=True)
    try:
        eager = run_model(model, kw)
        out, ops, seen = run_compiled_fullgraph(model, kw)
        assert "act_fp8" in ops, sorted(seen)
        assert any("_scaled_mm" in s for s in seen), sorted(seen)
        assert _rel(out, eager) < 2.0**-5
    finally:
        di.remove_optimized_kernels(model, verbose=False)

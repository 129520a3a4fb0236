# SPDX-License-Identifier: Apache-2.0
"""Peak memory without a GPU: scripts/cpu_peak_memory.py's PeakMemory (the bytes of the tensor storages torch
allocates, each storage once, from its allocation to its death) checked on known sequences, then the injected
forward of each family's tiny model against the stock forward, in bf16 under torch.no_grad() as
benchmark_e2e.py runs them: the injected forward may not hold more at its peak than the stock one.

The tiny models get token counts in proportion to their width as the released models have them at their
pipelines' default sizes (so activations, not weights or per-call constants, set the peak), and the kernels run
through Triton's interpreter, whose own host copies the tracker does not count (on a GPU they do not exist)."""

import gc

import pytest
import torch

import activations
import diffusers_injection as di
import model_zoo as mz
from cpu_peak_memory import PeakMemory, compare
from kernel_testing import DEVICE, INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CPU tensors: the tracker measures the CPU run")


# --------------------------------------------------------------------------------------------
# The tracker itself
# --------------------------------------------------------------------------------------------
def test_tracker_follows_a_known_sequence():
    """Allocations, views, frees, in-place and out= ops, a resize and tensors made before: the peak and what is
    live are the sums of the storages' bytes, each storage counted once."""
    before = torch.ones(1000)  # made before: counts nothing, nor do views of it or ops writing into it
    with PeakMemory() as mem:
        a = torch.empty(1000)  # 4000 bytes
        view = a.view(10, 100)[2:]  # a view: no new storage
        half = torch.zeros(500, dtype=torch.float16)  # 1000 -> 5000
        assert (mem.live, mem.peak, mem.allocations) == (5000, 5000, 2)
        del a
        assert mem.live == 5000, "a storage lives while a view of it does"
        del view
        assert mem.live == 1000
        b = torch.ones(3000)  # 12000 -> 13000
        c = b * 2  # 12000 -> 25000: the peak
        c.add_(1)  # in place: nothing new
        torch.mul(b, 3, out=c)  # into an existing tensor: nothing new
        before.add_(1)
        before_view = before[:10]
        del b, c
        assert (mem.live, mem.peak) == (1000, 25000)
        r = torch.empty(0)
        r.resize_(250)  # the resize is counted at the new size
        assert mem.live == 2000
        del before_view
    assert (mem.peak, mem.live, mem.allocations, mem.cyclic) == (25000, 2000, 5, 0)
    del half, r
    assert mem.live == 0


def test_tracker_counts_a_reference_cycle_and_frees_the_interpreters():
    """A tensor the model's own code leaves in a reference cycle stays counted until a collection frees it, and is
    reported in ``cyclic``; the reference cycle in which Triton's interpreter keeps each launch's tensors is
    collected after each launch (on a GPU nothing holds them), so a kernel's output dies when dropped."""
    x = torch.randn(64, 256, device=DEVICE)
    activations.gelu_tanh(x)  # the launch plan, made outside the measurement
    gc.collect()
    with torch.no_grad(), PeakMemory() as mem:
        y = activations.gelu_tanh(x)
        assert mem.live == 64 * 256 * 4
        del y
        assert mem.live == 0, "the interpreter's cycle would keep the kernel's output alive"
        cycle = [torch.empty(100)]  # 400 bytes in a cycle of the caller's making
        cycle.append(cycle)
        del cycle
        assert mem.live == 400, "automatic collection is off while measuring"
    assert mem.cyclic == 400 and mem.live == 0 and mem.peak == 64 * 256 * 4


# --------------------------------------------------------------------------------------------
# Stock against injected, per family
# --------------------------------------------------------------------------------------------
# token geometry per model: tokens / width about as in the released model at its pipeline's default size (a 32
# wide tiny model), see model_zoo's "real" geometries and token_counts
GEOMETRY = {
    # 49,290 video tokens over 2048 channels (24 per channel); 192 here over 32 (6: the [S, S] attention mask,
    # which dwarfs the rest at 121 frames, is still the largest tensor)
    "hunyuan_video15": dict(frames=9, height=128, width=128),
    # 6,144 video tokens over 4096 channels; 48 over 32 (audio: 18 tokens)
    "ltx2": dict(frames=17, height=128, width=128),
    # 4,096 image + 512 text tokens over 6144 / 3072 / 3840 channels; 64 + 8 over 32
    "flux2": dict(height=128, width=128),
    "qwen_image": dict(height=128, width=128),
    "z_image": dict(height=128, width=128),
    # 17,550 video tokens over 3072 channels; 48 over 32
    "cogvideox": dict(frames=9, height=64, width=64),
}


def _peaks(name):
    model = mz.build(name, "tiny", dtype=torch.bfloat16)
    kw = mz.inputs(name, model, "tiny", geometry=GEOMETRY[name])
    res = compare(
        model,
        kw,
        lambda m: di.inject_optimized_kernels(m, verbose=False),
        lambda m: di.remove_optimized_kernels(m, verbose=False),
    )
    stock, injected = res["stock"], res["injected"]
    assert stock.cyclic == injected.cyclic == 0, "a reference cycle held tensors: the peaks would depend on gc"
    return stock.peak, injected.peak, model, kw


@pytest.mark.parametrize("name", ["ltx2", "flux2", "qwen_image", "z_image", "cogvideox"])
def test_injected_forward_peaks_no_higher_than_stock(name):
    """bf16, torch.no_grad() (the carried values and the per-forward tables in use): the injected forward's peak
    is at most the stock forward's, no tolerance (the kernels allocate nothing but their outputs)."""
    stock, injected, _, _ = _peaks(name)
    assert injected <= stock, f"{name}: injected forward peaks at {injected:,} bytes, stock at {stock:,}"


def test_hunyuan_video15_peak_is_stocks_less_one_mask():
    """HunyuanVideo 1.5: the attention's [B, 1, S, S] mask sets the peak. The fused processor builds it in one
    broadcast op, where diffusers' repeats the text mask to [B, 1, S, S] first and holds that copy through the
    attention: the injected peak is the stock peak less those S * S bytes. The only thing the injected forward
    holds there that diffusers' does not are the joint RoPE tables the kernel reads (fp32 [S, head dim] cos and
    sin, the text rows the identity): nothing else (not the q/k/v projections, not a copy of the input rows)."""
    stock, injected, model, kw = _peaks("hunyuan_video15")
    batch = kw["hidden_states"].shape[0]
    seq = model.x_embedder.proj(kw["hidden_states"][:1]).flatten(2).shape[-1]  # image tokens
    seq += sum(kw[k].shape[1] for k in ("encoder_hidden_states", "encoder_hidden_states_2", "image_embeds"))
    mask = batch * seq * seq  # bool
    head_dim = model.config.attention_head_dim
    tables = 2 * seq * head_dim * 4  # fp32 cos and sin
    assert injected <= stock - mask + tables, (
        f"injected peak {injected:,} bytes, stock {stock:,}: expected at most stock - {mask:,} (one mask) + "
        f"{tables:,} (the joint tables)"
    )

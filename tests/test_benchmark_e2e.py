# SPDX-License-Identifier: Apache-2.0
"""scripts/benchmark_e2e.py without a GPU: the command line, the parity rule that decides the exit
status, the kernel classification of the profile, and one tiny end-to-end run through the interpreter
(timings mean nothing there; the run checks that every part of the script works)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import benchmark_e2e as be
import model_zoo as mz
from forked_python import HEAVY, run_python_forked
from kernel_testing import DEVICE, with_interpreter_speedup

ROOT = Path(__file__).resolve().parents[1]
TINY_CPU_RUN = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the tiny CPU run; on a GPU the script measures the real model"
)


def _run_tiny(*args):
    """benchmark_e2e.py with args through Triton's interpreter: it must exit 0; its result and JSON summary. Run
    as python runs it, forked from a process that has imported torch, triton, diffusers and transformers."""
    script = ROOT / "scripts" / "benchmark_e2e.py"
    env = with_interpreter_speedup({**os.environ, "TRITON_INTERPRET": "1"})
    r = run_python_forked([script, *args], preload=HEAVY, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, json.loads(r.stdout)


def test_modes_and_bad_command_lines():
    assert be.parse_args([]).modes == be.MODES
    assert be.parse_args(["--mode", "triton,compile"]).modes == ("triton", "compile")
    assert be.parse_args(["--model", "flux"]).transformer_only  # SD3 / FLUX: one transformer forward
    wan = be.parse_args(["--model", "wan"])
    assert wan.transformer_only and wan.variant == "2.1-t2v-1.3b"
    assert be.parse_args(["--model", "sd3"]).variant == "sd3.5-medium"
    for argv in (
        ["--mode", "fast"],
        ["--num-frames", "24"],
        ["--height", "500"],
        ["--repeats", "0"],
        ["--model", "sd3", "--height", "1000"],
        ["--model", "wan", "--num-frames", "80"],
        ["--model", "wan", "--height", "488"],
        ["--model", "sd3", "--variant", "2.1-t2v-1.3b"],
        ["--model", "wan", "--variant", "sd3-medium"],
        ["--model", "ltx", "--variant", "sd3-medium"],
        ["--heat-seconds", "-1"],
        ["--rounds", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            be.parse_args(argv)
        assert exc.value.code == 2


def test_parity_rule_flags_a_diverging_mode():
    g = torch.Generator().manual_seed(0)  # fixed: made-up outputs placed against the rule's limits (1.2x vs 1.5x)
    ref32 = {"output": torch.randn(4, 64, generator=g, dtype=torch.float64)}
    base = {"output": ref32["output"] + 1e-3 * torch.randn(4, 64, generator=g, dtype=torch.float64)}
    close = {"output": ref32["output"] + 1.2e-3 * torch.randn(4, 64, generator=g, dtype=torch.float64)}
    far = {"output": ref32["output"] + 1e-2 * torch.randn(4, 64, generator=g, dtype=torch.float64)}
    nan = {"output": close["output"].clone()}
    nan["output"][0, 0] = float("nan")
    v = be.judge({"baseline": base, "triton": close, "compile": far, "triton+compile": nan}, ref32, 30.0)
    assert v["baseline"]["ok"] and v["triton"]["ok"]
    assert not v["compile"]["ok"] and not v["triton+compile"]["ok"]
    # without the fp32 reference: PSNR against the baseline
    v = be.judge({"baseline": base, "triton": base, "compile": far}, None, 60.0)
    assert v["triton"]["ok"] and not v["compile"]["ok"]


def test_kernel_classification():
    assert be.classify_kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert be.classify_kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "gemm"
    assert be.classify_kernel("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert be.classify_kernel("Cijk_Ailk_Bljk_BBS_BH_MT128x128x64") == "gemm"  # hipBLASLt
    # inductor kernels are named after the ops they fuse: not attention
    assert be.classify_kernel("triton_red_fused__scaled_dot_product_cudnn_attention__to_copy_9") == "other"
    assert be.classify_kernel("_rms_norm_kernel") == "other"


@pytest.mark.slow
@TINY_CPU_RUN
def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "e2e.json"
    r, summary = _run_tiny("--mode", "baseline,triton", "--output-json", str(out))
    assert summary == json.loads(out.read_text())
    assert summary["ok"] and set(summary["results"]) == {"baseline", "triton"}
    tri = summary["results"]["triton"]
    assert tri["injected"]["adaln_fused_blocks"] == 2 and tri["injected"]["qk_norm_rope_fused"] == 2
    assert tri["parity"]["vs_baseline"]["latents"]["rel_l2"] < 1e-5
    assert len(tri["step_ms_all"]) == 2


@TINY_CPU_RUN
@pytest.mark.parametrize("model,kind", [("sd3", "mmdit_qk_norm_fused"), ("flux", "mmdit_qk_norm_rope_fused")])
def test_tiny_mmdit_run(model, kind):
    r, summary = _run_tiny("--model", model, "--mode", "baseline,triton", "--heat-seconds", "0.1")
    assert summary["ok"] and summary["transformer_only"] and summary["config"]["model"] == model
    assert summary["config"]["heat_seconds"] == 0.1 and "heating the GPU" in r.stderr
    tri = summary["results"]["triton"]
    assert tri["injected"][kind] > 0 and tri["injected"]["mmdit_fused_blocks"] > 0
    assert tri["parity"]["vs_baseline"]["output"]["rel_l2"] < 1e-5


@TINY_CPU_RUN
def test_tiny_wan_run():
    r, summary = _run_tiny("--model", "wan", "--mode", "baseline,triton", "--heat-seconds", "0")
    assert summary["ok"] and summary["transformer_only"] and summary["config"]["model"] == "wan"
    tri = summary["results"]["triton"]
    assert tri["injected"]["wan_blocks"] == 2 and tri["injected"]["wan_rmsnorm_weighted"] == 8
    assert tri["parity"]["vs_baseline"]["output"]["rel_l2"] < 1e-5
    assert summary["config"]["tokens"] == 3 * 4 * 4


def test_rounds_pool_the_timings():
    """--rounds: per-mode timings of every round pooled, per-round medians and clocks kept, the highest
    peak memory, the first round's warm-up overhead."""

    def res(times, peak, clock, warm):
        return {
            "forward_ms_all": times,
            "forward_ms": be.stats(times),
            "peak_memory_gb": peak,
            "sm_clock_mhz_after": clock,
            "warmup_overhead_s": warm,
            "warmup_wall_s": [warm],
        }

    a, b, c = res([3.0, 1.0], 2.0, 1980, 60.0), res([2.0, 4.0], 2.5, 1800, 0.5), res([5.0], 1.0, 1700, 0.4)
    m = be.merge_rounds(be.merge_rounds(a, b, True), c, True)
    assert m["forward_ms_all"] == [3.0, 1.0, 2.0, 4.0, 5.0] and m["forward_ms"]["median"] == 3.0
    assert m["forward_ms_round_medians"] == [2.0, 3.0, 5.0]
    assert m["sm_clock_mhz_after_rounds"] == [1980, 1800, 1700]
    assert m["peak_memory_gb"] == 2.5 and m["warmup_overhead_s"] == 60.0


@pytest.mark.slow
@TINY_CPU_RUN
def test_tiny_run_in_two_rounds():
    r, summary = _run_tiny(
        "--model", "sd3", "--mode", "baseline,triton", "--rounds", "2", "--repeats", "2", "--heat-seconds", "0"
    )
    assert summary["ok"] and summary["config"]["rounds"] == 2
    for mode in ("baseline", "triton"):
        res = summary["results"][mode]
        assert len(res["forward_ms_all"]) == 4 and len(res["forward_ms_round_medians"]) == 2


def test_torchao_mode_puts_the_very_same_weights_back(monkeypatch):
    """The torchao modes change the model's weights in place; the undo torchao_fp8 returns must put the
    original parameters back, values and all. torchao's FP8 needs a GPU, so a stand-in quantize_ that
    replaces each selected weight the way torchao does (a new Parameter) checks the mechanics here."""
    import types

    import diffusers_injection as di  # before the stand-in: importing diffusers looks torchao up by its spec

    calls = []

    def fake_quantize_(model, config, filter_fn=None):
        for fqn, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and filter_fn(m, fqn):
                calls.append(fqn)
                m.weight = torch.nn.Parameter(torch.zeros_like(m.weight), requires_grad=False)

    fake = types.ModuleType("torchao.quantization")
    fake.quantize_ = fake_quantize_
    fake.PerRow = lambda: "per-row"
    fake.Float8DynamicActivationFloat8WeightConfig = lambda granularity: ("fp8", granularity)
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", fake)

    class AdaLayerNormZero(torch.nn.Module):  # an AdaLN norm's linear layer stays bf16 in the FP8 modes
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 96)

    model = torch.nn.Module()
    model.transformer_blocks = torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16), AdaLayerNormZero())]
    ).to(DEVICE, torch.bfloat16)
    model.proj_out = torch.nn.Linear(16, 8).to(DEVICE, torch.bfloat16)
    hooked = torch.nn.Linear(16, 16).to(DEVICE, torch.bfloat16)  # the FP8 mode leaves hooked layers in bf16
    hooked.register_forward_hook(lambda *a: None)
    model.transformer_blocks[0].append(hooked)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    undo = be.torchao_fp8(model, di)
    assert calls == ["transformer_blocks.0.0", "transformer_blocks.0.2"], "the layers the FP8 mode replaces"
    assert float(model.transformer_blocks[0][0].weight.abs().sum()) == 0.0
    undo()
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n


def test_parity_line_with_non_finite_output_or_an_exact_baseline():
    """An infinite output is judged (not a crash in the PSNR) and its line says non-finite; a baseline at
    distance 0 from the float32 run gives no ratio (it would be a division by zero)."""
    g = torch.Generator().manual_seed(1)
    ref32 = {"out": torch.randn(64, generator=g)}
    base = {"out": ref32["out"] + 1e-3 * torch.randn(64, generator=g)}
    inf = {"out": base["out"].clone()}
    inf["out"][3] = float("inf")
    v = be.judge({"baseline": base, "triton-fp8": inf}, ref32, 30.0)
    assert not v["triton-fp8"]["ok"] and not v["triton-fp8"]["finite"]
    results = {m: {"parity": p} for m, p in v.items()}
    assert be._parity_text("triton-fp8", results["triton-fp8"], results) == "FAILED (non-finite output)"
    v = be.judge({"baseline": ref32, "triton": base}, ref32, 30.0)
    results = {m: {"parity": p} for m, p in v.items()}
    assert be._parity_text("triton", results["triton"], results) == "FAILED"
    v = be.judge({"baseline": base, "triton": base}, ref32, 30.0)
    results = {m: {"parity": p} for m, p in v.items()}
    assert be._parity_text("triton", results["triton"], results).startswith("ok (1.00x")


@TINY_CPU_RUN
def test_tiny_zoo_run_with_list_inputs():
    """Z-Image takes its latents as a list of per-sample tensors: the summary's batch is the list's length."""
    r, summary = _run_tiny("--model", "z_image", "--mode", "baseline,triton", "--heat-seconds", "0")
    assert summary["ok"] and summary["config"]["model"] == "z_image" and summary["config"]["batch"] == 1
    assert summary["results"]["triton"]["parity"]["vs_baseline"]["output"]["rel_l2"] < 1e-5
    streams = mz.token_counts("z_image", "tiny")
    assert summary["config"]["tokens_per_stream"] == streams and summary["config"]["tokens"] == sum(streams.values())


@TINY_CPU_RUN
def test_graph_modes_capture_in_the_warm_up():
    """Graph mode captures at a signature's second call: with single forwards the warm-up makes two calls, so
    that no timed forward is the capture (the eager forward, watched, then the capture: 2-4x a replay)."""
    _, summary = _run_tiny("--model", "sd3", "--mode", "triton,triton+graphs", "--repeats", "1", "--heat-seconds", "0")
    res = summary["results"]
    assert len(res["triton"]["warmup_wall_s"]) == 1 and len(res["triton+graphs"]["warmup_wall_s"]) == 2

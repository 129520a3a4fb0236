# SPDX-License-Identifier: Apache-2.0
"""scripts/benchmark_kernels.py's LLM-decode suite without a GPU: the command line selects the cases, and every
case's bundle and eager providers run (through the interpreter here) and pass the script's own correctness
check. Timing needs a GPU and is not exercised."""

import pytest
import torch

import benchmark_kernels as bk
from kernel_testing import DEVICE


def test_suite_selection():
    ltx = bk.parse_args([])
    assert ltx.suite == "ltx" and len(bk.work_items(ltx)) == len(bk.CASES) * len(bk.LTX_SHAPES)
    dec = bk.parse_args(["--suite", "decode", "--rows", "1,32", "--widths", "4096"])
    items = bk.work_items(dec)
    n_gemm = len(bk.GEMM_CASES) * len(bk.GEMM_SHAPES) * len(bk.GEMM_ROWS)
    assert len(items) == len(bk.DECODE_CASES) * 2 + n_gemm
    fusions = [it for it in items if "gemm" not in it[2]]
    assert {it[3] for it in fusions} == {"M=1 H=4096", "M=32 H=4096"}
    assert all(it[2]["suite"] == "decode" and it[2]["width"] == 4096 for it in fusions)
    gemm = bk.parse_args(["--suite", "decode", "--kernel", "skinny", "--gemm-rows", "1,32", "--gemm-shapes", "8B_o"])
    assert {it[3] for it in bk.work_items(gemm)} == {"8B_o M=1", "8B_o M=32"}
    full = bk.parse_args(["--suite", "all"])
    n_decode = len(bk.DECODE_CASES) * len(bk.DECODE_ROWS) * len(bk.DECODE_WIDTHS)
    n_mmdit = len(bk.MMDIT_CASES) * len(bk.MMDIT_SHAPES)
    assert len(bk.work_items(full)) == len(bk.CASES) * 2 + n_mmdit + n_decode + n_gemm
    mm = bk.parse_args(["--suite", "mmdit"])
    assert {it[3] for it in bk.work_items(mm)} == {"sd3 B=2 S=4096", "flux B=1 S=4096"}
    only = bk.parse_args(["--suite", "decode", "--kernel", "swiglu_fp8"])
    assert {it[0] for it in bk.work_items(only)} == {"swiglu_fp8_per_token", "swiglu_fp8_per_tensor"}


@pytest.mark.parametrize(
    "argv",
    [
        ["--suite", "decode", "--rows", "0"],
        ["--suite", "decode", "--widths", "4k"],
        ["--suite", "decode", "--kernel", "gelu"],  # an ltx kernel: nothing of the decode suite matches
        ["--suite", "prefill"],
        ["--shapes", "999"],
        ["--suite", "decode", "--gemm-rows", "33"],
        ["--suite", "decode", "--gemm-shapes", "8B_lm_head"],
    ],
)
def test_bad_command_lines(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bk.parse_args(argv)
    assert exc.value.code == 2


@pytest.mark.parametrize("name", list(bk.DECODE_CASES))
def test_decode_case_providers_run(name, monkeypatch, gen):
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    torch.manual_seed(gen.seed_value)  # the cases draw their inputs from torch's global generator
    case = bk.DECODE_CASES[name](3, 160, torch.bfloat16)
    assert case["bytes"] > 0 and {"triton", "eager", "compile"} <= set(case["providers"])
    # torch.compile takes tens of seconds on a CPU: check the bundle's kernel and the eager sequence
    case["providers"] = {
        k: v for k, v in case["providers"].items() if k in ("triton", "triton(no evict hint)", "eager")
    }
    errs, failures = bk.check_case(name, "M=3 H=160", case, torch.bfloat16)
    assert not failures, failures
    tol = case.get("max_err", bk.MAX_ERR[torch.bfloat16])
    assert all(e <= tol for e in errs.values()), errs


def _check_cold_providers(build, monkeypatch, seed):
    """The cold-L2 providers cycle through distinct input sets in step with each other; the set after the
    last is the case's own inputs (checked against the float64 reference) and on the others the bundle's
    kernel agrees with the eager sequence. Inputs smaller than COLD_SPAN / COLD_MAX_SETS get no cold timing."""
    torch.manual_seed(seed)
    small = build()
    assert small["cold_providers"] is None
    monkeypatch.setattr(bk, "COLD_SPAN", 3 * small["bytes"])  # three sets of these inputs
    torch.manual_seed(seed)
    case = build()
    cold = case["cold_providers"]
    assert cold is not None and set(cold) == set(case["providers"])
    post = case.get("post", lambda out: out)
    tol = case.get("max_err", bk.MAX_ERR[torch.bfloat16])
    ours_name = next(p for p in cold if p.startswith("triton"))
    firsts = []
    for i in range(3):
        ours, eager = post(cold[ours_name]()), post(cold["eager"]())
        ours_t = ours if isinstance(ours, tuple) else (ours,)
        firsts.append(ours_t[0])
        ref = case["ref"] if i == 2 else eager
        assert bk.max_err(ours, ref) <= tol, (i, bk.max_err(ours, ref))
    assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])


@pytest.mark.parametrize("name", list(bk.DECODE_CASES))
def test_decode_case_cold_inputs(name, monkeypatch, gen):
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    _check_cold_providers(lambda: bk.DECODE_CASES[name](3, 160, torch.bfloat16), monkeypatch, gen.seed_value)


# the LTX RoPE cases build their coordinates on "cuda" and are left to the GPU run
@pytest.mark.parametrize("name", [n for n in bk.CASES if "rope" not in n])
def test_ltx_case_cold_inputs(name, monkeypatch, gen):
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    monkeypatch.setattr(bk, "HIDDEN", 96)
    monkeypatch.setattr(bk, "FF", 64)
    _check_cold_providers(lambda: bk.CASES[name](2, 5, torch.bfloat16), monkeypatch, gen.seed_value)


@pytest.mark.parametrize("name", list(bk.MMDIT_CASES))
def test_mmdit_case_cold_inputs(name, monkeypatch, gen):
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    monkeypatch.setattr(bk, "MMDIT_SHAPES", {"flux": dict(B=1, S=5, T=3, D=128, H=2)})
    _check_cold_providers(lambda: bk.MMDIT_CASES[name]("flux", torch.bfloat16), monkeypatch, gen.seed_value)


@pytest.mark.parametrize("name", list(bk.GEMM_CASES))
def test_gemm_case_providers_run(name, monkeypatch, gen):
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    torch.manual_seed(gen.seed_value)
    case = bk.GEMM_CASES[name](3, 96, 320, torch.bfloat16)
    assert case["bytes"] > case["weight_bytes"] > 0
    assert {"triton", "triton_kernel"} <= set(case["providers"])
    case["providers"] = {k: v for k, v in case["providers"].items() if k.startswith("triton") or k == "torch.matmul"}
    errs, failures = bk.check_case(name, "M=3 N=96 K=320", case, torch.bfloat16)
    assert not failures, failures
    assert all(e <= bk.MAX_ERR[torch.bfloat16] for e in errs.values()), errs


@pytest.mark.parametrize("model", ["sd3", "flux"])
@pytest.mark.parametrize(
    "name",
    ["layernorm_modulate", "residual_layernorm_modulate", "residual_layernorm_modulate_dual", "head_qk_rmsnorm_rope"],
)
def test_mmdit_case_providers_run(name, model, monkeypatch, gen):
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    tiny = {"sd3": dict(B=2, S=6, T=3, D=96, H=3), "flux": dict(B=1, S=5, T=3, D=128, H=2)}
    monkeypatch.setattr(bk, "MMDIT_SHAPES", tiny)
    torch.manual_seed(gen.seed_value)
    case = bk.MMDIT_CASES[name](model, torch.bfloat16)
    assert case["bytes"] > 0 and {"triton", "eager", "compile"} <= set(case["providers"])
    case["providers"] = {k: v for k, v in case["providers"].items() if k in ("triton", "eager")}
    errs, failures = bk.check_case(name, model, case, torch.bfloat16)
    assert not failures, failures
    assert all(e <= bk.MAX_ERR[torch.bfloat16] for e in errs.values()), errs


@pytest.mark.parametrize("name", ["gated_residual", "gated_residual_rmsnorm_modulate"])
def test_gated_residual_case_runs(name, monkeypatch, gen):
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    monkeypatch.setattr(bk, "HIDDEN", 96)
    torch.manual_seed(gen.seed_value)
    case = bk.CASES[name](2, 5, torch.bfloat16)
    case["providers"] = {k: v for k, v in case["providers"].items() if k != "compile"}
    errs, failures = bk.check_case(name, "tiny", case, torch.bfloat16)
    assert not failures and all(e <= bk.MAX_ERR[torch.bfloat16] for e in errs.values()), errs


def test_provider_wrappers_pass_inputs_and_restore():
    """_integer_fp8 and _no_evict_hint call the wrapped provider with its inputs, with the module's switch
    flipped during the call only."""
    import types

    mod = types.SimpleNamespace(_native_fp8=lambda d, f: True, _input_evict=lambda *a: "evict_first")
    seen = []

    def fn(a, b):
        seen.append((a, b, mod._native_fp8(None, None), mod._input_evict(True, True, 1)))
        return a + b

    assert bk._integer_fp8(mod, fn)(1, 2) == 3 and bk._no_evict_hint(mod, fn)(3, 4) == 7
    assert seen == [(1, 2, False, "evict_first"), (3, 4, True, "")]
    assert mod._native_fp8(None, None) is True and mod._input_evict() == "evict_first"


def test_chart_draws_every_shape(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [
        dict(kernel=k, provider=p, shape=shape, dtype="bfloat16", GBps=1.0, GBps_graph=g, GBps_cold_graph=c)
        for shape in ("M=1024 H=4096", "M=4096 H=4096")
        for k in ("fused_add_rmsnorm", "swiglu")
        for p, g, c in (("triton", 5000.0, 3900.0), ("compile", 4000.0, None))
    ]
    result = {"device": {"gpu": "GPU", "arch": "sm_90", "copy_bandwidth_GBps": 4100.0}, "records": recs}
    path = tmp_path / "chart.png"
    bk.chart(result, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("n_in,n_out", [(1, 1), (2, 1), (2, 2), (2, 3)])
@pytest.mark.parametrize("cold", [False, True])
def test_same_pattern_moves_its_streams(n_in, n_out, cold, monkeypatch):
    """The access-pattern reference reads n_in and writes n_out streams of equal size, every element of them
    (3000 per stream: a full and a masked program), and splits the bytes given among them."""
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    n = 3000
    nbytes = 2 * (n_in + n_out) * n
    monkeypatch.setattr(bk, "COLD_SPAN", 3 * nbytes)
    call = bk.same_pattern(nbytes, n_in, n_out, cold=cold)
    assert len(call.streams) == (3 if cold else 1)
    for _ in call.streams:
        call()  # warm-up of the cycle; the checks below run each set once more after poisoning
    for k in range(len(call.streams)):
        ins = call.streams[(k + 1) % len(call.streams)][:n_in]  # _cycling steps to the next set first
        outs = call.streams[(k + 1) % len(call.streams)][2 : 2 + n_out]
        assert all(t.numel() == n for t in ins + outs)
        for o in outs:
            o.fill_(float("nan"))
        call()
        a = sum(t.double() for t in ins)
        for o, e in zip(outs, (a, -a, 0.5 * a)):
            assert torch.allclose(o.double(), e, rtol=2e-2, atol=2e-2), (n_in, n_out, k)


def test_same_pattern_rejects_unsupported_counts():
    with pytest.raises(ValueError, match="1-2 inputs and 1-3 outputs"):
        bk.same_pattern(1 << 20, 3, 1)
    with pytest.raises(ValueError, match="1-2 inputs and 1-3 outputs"):
        bk.same_pattern(1 << 20, 1, 0)


@pytest.mark.parametrize(
    "name,pattern", [("residual_layernorm_modulate", (2, 2)), ("residual_layernorm_modulate_dual", (2, 3))]
)
def test_mmdit_cases_declare_their_streams(name, pattern, monkeypatch):
    """The declared pattern accounts for the case's bytes: its streams are the [B, S, D] tensors moved, and
    the rest (gate, scale, shift) is the per-sample [B, D] modulation."""
    monkeypatch.setattr(bk, "DEVICE", DEVICE.type)
    c = dict(B=1, S=64, T=3, D=128, H=2)
    monkeypatch.setattr(bk, "MMDIT_SHAPES", {"flux": c})
    case = bk.MMDIT_CASES[name]("flux", torch.bfloat16)
    assert case["pattern"] == pattern
    full = c["B"] * c["S"] * c["D"] * 2
    n_mod = 3 if pattern[1] == 2 else 5
    assert case["bytes"] == sum(pattern) * full + n_mod * c["B"] * c["D"] * 2

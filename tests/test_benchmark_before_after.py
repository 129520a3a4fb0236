# SPDX-License-Identifier: Apache-2.0
"""benchmark_before_after.py's joining of the two trees' rows and its ok rule (no GPU needed)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import benchmark_before_after as bba  # noqa: E402


def _host(us, rms):
    return {
        "suite": "ltx",
        "case": "rmsnorm",
        "provider": "triton",
        "shape": "S",
        "bundle_us": us,
        "vs_F_rms_norm": us / rms,
    }


def _gpu(graph, cold, fail=None):
    row = {"kernel": "rmsnorm", "shape": "S", "ms": 0.02, "graph_ms": graph, "cold_graph_ms": cold}
    return {"kernel": "rmsnorm", "shape": "S", "failures": fail} if fail else row


@pytest.mark.parametrize(
    "after_us, after_rms, graph, expect_ok",
    [
        (20.0, 16.0, 0.0100, True),  # same cost
        (22.0, 17.6, 0.0100, True),  # host 10 % slower in us, but F.rms_norm too: the host, not the code
        (22.0, 16.0, 0.0100, False),  # 10 % more host time against the same yardstick
        (20.0, 16.0, 0.0110, False),  # 10 % more GPU time
    ],
)
def test_ratios_and_ok(after_us, after_rms, graph, expect_ok):
    runs = {
        "host": {"before": [[_host(20.0, 16.0)], [_host(20.0, 16.0)]], "after": [[_host(after_us, after_rms)]] * 2},
        "gpu": {"before": [[_gpu(0.0100, 0.0200)]], "after": [[_gpu(graph, 0.0200)]]},
    }
    out = bba.compare(runs, 0.05)
    assert out["ok"] is expect_ok
    (h,) = out["host"]
    assert h["ratio"] == pytest.approx((after_us / after_rms) / (20.0 / 16.0), rel=1e-2)
    (g,) = out["gpu"]
    assert g["ratio_graph_ms"] == pytest.approx(graph / 0.0100, rel=1e-3)


def test_a_failed_case_is_not_ok():
    runs = {"gpu": {"before": [[_gpu(0.01, 0.02)]], "after": [[_gpu(0, 0, fail=["rmsnorm S triton: max error"])]]}}
    out = bba.compare(runs, 0.05)
    assert out["summary"]["gpu"]["failures"] == 1 and out["ok"] is False


def test_nothing_measured_is_not_ok():
    assert bba.compare({}, 0.05)["ok"] is False


def test_before_must_be_a_scripts_folder(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bba.parse_args(["--before", str(tmp_path)])
    assert "no rmsnorm.py" in capsys.readouterr().err


def test_a_run_cut_short_joins_what_both_trees_have():
    """The record is written after every measurement: with only the earlier tree's GPU run there is no GPU
    comparison yet (and no crash), and the host rows already measured for both trees are joined."""
    runs = {
        "host": {"before": [[_host(20.0, 16.0)]], "after": [[_host(20.0, 16.0)]]},
        "gpu": {"before": [[_gpu(0.01, 0.02)]], "after": []},
    }
    out = bba.compare(runs, 0.05)
    assert "gpu" not in out and len(out["host"]) == 1 and out["ok"] is True


def test_named_triton_providers_are_compared_each():
    """Cases whose kernel comes in named forms ("triton(cos/sin read)") are joined per provider."""
    row = dict(_gpu(0.01, 0.02), provider="triton(cos/sin read)")
    other = dict(_gpu(0.02, 0.04), provider="triton(in-kernel cos/sin)")
    out = bba.compare({"gpu": {"before": [[row, other]], "after": [[row, dict(other, graph_ms=0.03)]]}}, 0.05)
    ratios = {r["provider"]: r["ratio_graph_ms"] for r in out["gpu"]}
    assert ratios == {"triton(cos/sin read)": 1.0, "triton(in-kernel cos/sin)": 1.5} and out["ok"] is False

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


def test_one_rows_yardstick_outlier_does_not_make_a_ratio():
    """The host yardstick is the process's median F.rms_norm time: one row whose own F.rms_norm figure came out
    slow (a moment of a busy host) does not turn equal microseconds into a regression."""
    rows = [dict(_host(12.0, 9.5), case=c) for c in ("a", "b", "c")]
    outlier = [dict(_host(12.0, 16.5), case="a")] + rows[1:]
    runs = {"host": {"before": [outlier, rows], "after": [rows, rows]}}
    out = bba.compare(runs, 0.05)
    assert out["ok"] is True
    assert {r["case"]: r["ratio"] for r in out["host"]} == {"a": 1.0, "b": 1.0, "c": 1.0}


def test_module_setting_variants_are_not_compared():
    """benchmark_kernels' variants that change a module setting for the call (its _with_attr) are marked, so that
    the GPU comparison leaves them out: an earlier tree's plans may replay the default setting for them."""
    import types

    import benchmark_kernels as bk

    module = types.SimpleNamespace(_native_fp8=lambda device, fp8_dtype: True)
    variant = bk._integer_fp8(module, lambda: module._native_fp8("cuda", None))
    assert variant.module_setting == "_native_fp8" and variant() is False and module._native_fp8("cuda", None) is True


def test_the_scratch_tree_serves_the_harness_a_module_split_since(tmp_path):
    """An earlier tree that kept qk_norm_rope's functions in rope.py: the scratch copy gets a qk_norm_rope module
    that hands them over, so this tree's harness (which imports qk_norm_rope) measures that tree too; a tree that
    has the module keeps its own."""
    import subprocess

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "rope.py").write_text(
        "__all__ = ['ltx_rope_freqs']\ndef ltx_rope_freqs(dim):\n    return 'rope.py', dim\n"
    )
    tree = bba.scratch_tree(earlier, tmp_path / "scratch")
    assert all((tree / name).exists() for name in bba.HARNESS)
    code = "import qk_norm_rope; print(qk_norm_rope.ltx_rope_freqs(8))"
    r = subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "('rope.py', 8)", r.stderr
    (earlier / "qk_norm_rope.py").write_text("X = 1\n")
    tree = bba.scratch_tree(earlier, tmp_path / "scratch2")
    assert (tree / "qk_norm_rope.py").read_text() == "X = 1\n"

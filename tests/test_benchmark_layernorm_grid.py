# SPDX-License-Identifier: Apache-2.0
"""scripts/benchmark_layernorm_grid.py without a GPU: the command line, and a run of both measurements
through the interpreter (timing replaced by a stand-in) whose every configuration passes the script's
float64 check, and which reports a wrong kernel as a failure."""

import pytest
import torch

import benchmark_layernorm_grid as blg
import layernorm
from kernel_testing import DEVICE, poisoned_outputs


def test_command_line():
    a = blg._parse([])
    assert [t for t, _ in a.shapes] == ["sd3", "flux", "ltx"] and a.only is None
    a = blg._parse(["--shapes", "2x40x192", "flux", "--only", "sweep", "--warps", "1,2", "--per-sm", "8"])
    assert a.shapes == [("2x40x192", (2, 40, 192)), ("flux", (1, 4096, 3072))]
    assert a.warps == [1, 2] and a.per_sm == [8]


@pytest.mark.parametrize(
    "argv",
    [
        ["--shapes", "2x40"],
        ["--shapes", "0x4x8"],
        ["--warps", "0"],
        ["--per-sm", "a"],
        ["--only", "both"],
        ["--rep", "0"],
        ["--warps", "3"],
        ["--warps", "64"],
    ],
)
def test_bad_command_lines(argv):
    with pytest.raises(SystemExit) as exc:
        blg._parse(argv)
    assert exc.value.code == 2


def _run(argv, monkeypatch):
    args = blg._parse(argv)
    # one "SM" for the launcher and the script alike: the rule's grid is 32 / warps programs, fewer than
    # the 20 row blocks of 2x80x192
    monkeypatch.setattr(layernorm, "_num_sms", lambda device: 1)
    warp_size = 32 if DEVICE.type == "cpu" else layernorm._device_target(DEVICE)[2]
    with poisoned_outputs():  # every output the kernels leave unwritten is NaN: the check would fail
        return blg.run(args, DEVICE, lambda fn: (fn(), 1.0)[1], 1, warp_size, 1000.0)


@pytest.mark.slow
def test_every_configuration_checked_against_float64(monkeypatch, gen):
    torch.manual_seed(gen.seed_value)  # the script draws its inputs from torch's global generator
    records, failures = _run(["--shapes", "2x80x192", "--warps", "1,2", "--per-sm", "1,2"], monkeypatch)
    assert not failures, failures
    ab = [r for r in records if not r["config"].startswith(("sweep", "launcher"))]
    assert {r["variant"] for r in ab} == set(blg._PASSES)
    assert any(r["config"].startswith("persistent, rule") for r in ab)  # the persistent grid ran
    assert len([r for r in ab if r["variant"] == "gres_mod"]) == 5
    sweep = [r for r in records if r["config"].startswith("sweep")]
    assert {(r["warps"], r["programs_per_sm"]) for r in sweep} == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(0 < r["max_err_bf16_steps"] <= 2.0 for r in records)
    assert layernorm._PERSISTENT and layernorm._persistent_variant(True, True, False) is False  # restored


def test_wrong_kernel_is_a_failure(monkeypatch):
    real = layernorm.layer_norm_modulate
    monkeypatch.setattr(layernorm, "layer_norm_modulate", lambda x, sc, sh: real(x, sh, sc))  # swapped
    _, failures = _run(["--shapes", "2x80x192", "--only", "sweep", "--warps", "1", "--per-sm", "1"], monkeypatch)
    assert failures and all("ln_mod" in f for f in failures)


def test_unwritten_output_is_a_failure(monkeypatch):
    """An output the kernel never writes (NaN under poisoned_outputs) fails the check."""
    monkeypatch.setattr(layernorm, "layer_norm_modulate", lambda x, sc, sh: torch.empty_like(x))
    _, failures = _run(["--shapes", "2x80x192", "--only", "sweep", "--warps", "1", "--per-sm", "1"], monkeypatch)
    assert failures and all("inf bf16 steps" in f for f in failures)

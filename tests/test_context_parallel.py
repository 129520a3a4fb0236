# SPDX-License-Identifier: Apache-2.0
"""The kernels under diffusers context parallelism (Ulysses, 2 ranks): scripts/benchmark_context_parallel.py
end to end, the opposite order (inject, then enable_parallelism, then remove), and the hook-aware
forward patching both rely on.

Without a GPU the 2 ranks are CPU processes (gloo) and the kernels run through the interpreter; with
2 or more GPUs they run natively (NCCL). One GPU cannot hold 2 NCCL ranks: skipped there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import benchmark_context_parallel as bcp
import injection_common as ic
from forked_python import HEAVY, run_python_forked
from kernel_testing import with_interpreter_speedup

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_two_ranks = pytest.mark.skipif(GPUS == 1, reason="2 NCCL ranks need 2 GPUs; this machine has 1")


def _torchrun(*argv, timeout=600):
    env = with_interpreter_speedup({**os.environ, "OMP_NUM_THREADS": "1"})
    env.pop("TRITON_INTERPRET", None)  # the script / worker decides (interpreter only without a GPU)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_command_line_and_layout_checks():
    a = bcp.parse_args([])
    assert a.modes == bcp.MODES and (a.num_frames, a.height, a.width) == (121, 512, 768)
    assert bcp.parse_args(["--tiny"]).num_frames == 9
    # without a GPU the script switches to --tiny: the sizes not given become --tiny's
    a = bcp.parse_args([])
    bcp._use_tiny(a)
    assert a.tiny and (a.num_frames, a.height, a.width) == (9, 32, 32)
    a = bcp.parse_args(["--num-frames", "17"])
    bcp._use_tiny(a)
    assert (a.num_frames, a.height, a.width) == (17, 32, 32)
    for argv in (
        ["--mode", "compile"],
        ["--num-frames", "24"],
        ["--width", "700"],
        ["--repeats", "0"],
        ["--rounds", "0"],
        ["--ulysses-degree", "0"],
    ):
        with pytest.raises(SystemExit) as exc:
            bcp.parse_args(argv)
        assert exc.value.code == 2
    assert bcp.check_layout(2, 2, 1, 32, 6144, 128) is None
    assert bcp.check_layout(4, 2, 2, 32, 6144, 128) is None
    assert "world size" in bcp.check_layout(2, 1, 1, 32, 6144, 128)
    assert "at least 2" in bcp.check_layout(1, 1, 1, 32, 6144, 128)
    assert "heads" in bcp.check_layout(3, 3, 1, 32, 6144, 126)
    assert "latent tokens" in bcp.check_layout(2, 2, 1, 32, 6145, 128)
    assert "text tokens" in bcp.check_layout(2, 2, 1, 32, 6144, 127)
    s = bcp.scaling(100.0, 62.5, 2)
    assert s["speedup_vs_1gpu"] == pytest.approx(1.6) and s["efficiency"] == pytest.approx(0.8)
    t = bcp._median_slowest([[1.0, 5.0, 3.0], [2.0, 4.0, 3.5]])
    assert t["median"] == 3.5 and t["max"] == 5.0 and t["per_rank_median"] == [3.0, 3.5]


def test_needs_torchrun():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    # as python runs the script, forked from a process that has imported torch, triton, diffusers, transformers
    script = "scripts/benchmark_context_parallel.py"
    r = run_python_forked([script, "--tiny"], preload=HEAVY, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 2 and "torchrun" in r.stderr
    r = run_python_forked([script, "--help"], preload=HEAVY, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and "Ulysses" in r.stdout


@pytest.mark.slow
@needs_two_ranks
@pytest.mark.parametrize("mask", ["padded prompt", "no mask"])
def test_script_two_ranks(tmp_path, mask):
    out = tmp_path / "cp.json"
    # the padded prompt runs the untimed warm-up forwards and two timing rounds; without the mask one round and
    # no warm-up (each a forward through the interpreter; their loops run the same code either way)
    rounds, warmup = ("2", "1") if mask == "padded prompt" else ("1", "0")
    argv = [
        "scripts/benchmark_context_parallel.py",
        "--tiny",
        "--repeats",
        "1",
        "--rounds",
        rounds,
        "--warmup",
        warmup,
        "--output-json",
        str(out),
    ] + (["--no-text-mask", "--profile"] if mask == "no mask" else [])
    r = _torchrun(*argv)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads(out.read_text())
    assert s["ok"] and s["config"]["world_size"] == 2 and s["config"]["ulysses_degree"] == 2
    assert (s["config"]["rounds"], s["config"]["warmup"]) == (int(rounds), int(warmup))
    tri = s["results"]["triton"]
    assert tri["injected"]["qk_norm_rope_fused"] == 2 and tri["injected"]["cross_attn"] == 2
    cp = tri["context_parallel"]
    assert cp["parity"]["ok"] and cp["parity"]["finite"] and len(cp["round_medians_ms"]) == int(rounds)
    if GPUS == 0:  # the interpreter's times are not speed: no speed-up or efficiency is claimed
        assert cp["speedup_vs_1gpu"] is None and cp["efficiency"] is None
        assert s.get("triton_speedup_vs_baseline_context_parallel") is None
    # per-token kernels and Ulysses attention: the split run computes what one rank computes
    tol = 1e-6 if GPUS == 0 else 2e-2
    assert cp["parity"]["vs_one_gpu_same_mode"]["rel_l2"] <= tol
    base = s["results"]["baseline"]["context_parallel"]
    if mask == "no mask":
        assert base["parity"]["ok"] and base["parity"]["vs_one_gpu_same_mode"]["rel_l2"] <= tol
        assert "device_ms" in cp["profile_rank0"] and "device_ms" in base["profile_rank0"]
    else:  # diffusers 0.42.1's own processor cannot run a padded prompt under Ulysses (see the script)
        assert "error" in base and base["note"], base


@needs_two_ranks
def test_inject_before_enable_parallelism_then_remove():
    r = _torchrun("tests/cp_order_worker.py")
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    tol = 1e-6 if GPUS == 0 else 2e-2
    assert res["processors_parallel_after_enable"] and res["processors_parallel_after_removal"]
    assert res["triton_cp_vs_triton_one_process"] <= tol
    assert res["baseline_cp_after_removal_vs_one_process"] <= tol  # restored processors still parallel
    assert res["restored"]["rope_coords"] == 1 and not res["rope_forward_patched_after_removal"]


class _Scale(torch.nn.Module):
    def forward(self, x):
        return 2 * x


def _plus_one(self, x):
    return type(self).forward(self, x) + 1


def test_patching_under_a_diffusers_hook_both_orders():
    from diffusers.hooks import HookRegistry, ModelHook

    class AddTen(ModelHook):  # stands in for a context-parallel split: changes the input
        def pre_forward(self, module, x):
            return (x + 10,), {}

    x = torch.arange(4.0)
    # hook first, then patch: the hook keeps running around the patched forward
    m = _Scale()
    HookRegistry.check_if_exists_or_initialize(m).register_hook(AddTen(), "add_ten")
    assert torch.equal(m(x), 2 * (x + 10))
    assert ic.patch_forward(m, _plus_one, "k", "_state")
    assert torch.equal(m(x), 2 * (x + 10) + 1)
    ic.restore_forward(m, ic.pop_state(m, "_state"))
    assert torch.equal(m(x), 2 * (x + 10))
    m._diffusers_hook.remove_hook("add_ten")
    assert torch.equal(m(x), 2 * x)
    # patch first, then hook, then restore: the hook now wraps the class forward again
    m = _Scale()
    ic.patch_forward(m, _plus_one, "k", "_state")
    HookRegistry.check_if_exists_or_initialize(m).register_hook(AddTen(), "add_ten")
    assert torch.equal(m(x), 2 * (x + 10) + 1)
    ic.restore_forward(m, ic.pop_state(m, "_state"))
    assert torch.equal(m(x), 2 * (x + 10))
    # patch, hook, remove the hook (diffusers puts the patched forward back), restore
    m = _Scale()
    ic.patch_forward(m, _plus_one, "k", "_state")
    HookRegistry.check_if_exists_or_initialize(m).register_hook(AddTen(), "add_ten")
    m._diffusers_hook.remove_hook("add_ten")
    assert torch.equal(m(x), 2 * x + 1)
    ic.restore_forward(m, ic.pop_state(m, "_state"))
    assert torch.equal(m(x), 2 * x) and "forward" not in m.__dict__


def test_processor_settings_follow_the_processor():
    class P:
        _attention_backend = None
        _parallel_config = None

    a, b = P(), P()
    a._parallel_config, a._attention_backend = "cfg", "native"
    ic.carry_processor_settings(a, b)
    assert (b._parallel_config, b._attention_backend) == ("cfg", "native")
    c = P()
    ic.carry_processor_settings(P(), c)  # class defaults only: nothing copied onto the instance
    assert "_parallel_config" not in c.__dict__

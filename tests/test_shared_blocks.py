# SPDX-License-Identifier: Apache-2.0
"""The helpers the kernel files share are copied into each file (so that each file stays copyable alone)
as marked blocks; scripts/sync_shared_blocks.py copies them from their source and --check compares them.
These tests run the check for every block (the launch block included), show that the check fails when a
copy differs, and pin the shared helpers whose copies used to disagree."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys

import pytest
import torch
import triton

import sync_shared_blocks as ssb
from conftest import KERNEL_MODULES, SCRIPTS

KERNEL_FILES = KERNEL_MODULES + ("xcd_remap",)
# block -> the kernel files that hold it; a file holds the blocks it needs
EXPECTED = {
    "launch": KERNEL_MODULES,
    "device": KERNEL_FILES,
    "checks": KERNEL_MODULES,
    "ops": KERNEL_MODULES,
    "registration": ("rmsnorm", "layernorm", "rope", "activations", "head_norm_rope"),
    "sizes": ("rmsnorm", "layernorm", "rope", "activations", "head_norm_rope"),
    "strides": ("rmsnorm", "layernorm", "activations"),
    "rows": ("rmsnorm", "layernorm"),
    "row_kernels": ("rmsnorm", "layernorm"),
    "fp8_kernels": ("rmsnorm", "activations"),
    "fp8": ("rmsnorm", "activations"),
    "fp8_ref": ("rmsnorm", "activations"),
}
SCRIPT = SCRIPTS / "sync_shared_blocks.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_markers_are_sound():
    _, problems = ssb.survey()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_block_copies_are_identical(name):
    copies, _ = ssb.survey()
    held = {b.path.stem for b in copies.get(name, [])}
    assert held >= set(EXPECTED[name]), f"block {name!r} is missing from {sorted(set(EXPECTED[name]) - held)}"
    assert copies[name][0].path.name == "rmsnorm.py", "rmsnorm.py is the source of every shared block"
    diffs = ssb.differences(copies, [name])
    assert not diffs, "\n".join(diffs) + "\nrun: python scripts/sync_shared_blocks.py"


def test_every_block_is_known():
    """A new block (or a misspelt marker) is added to EXPECTED here, with the files that hold it."""
    copies, _ = ssb.survey()
    assert set(copies) == set(EXPECTED)


def test_check_mode_passes_on_the_scripts():
    r = _run("--check")
    assert r.returncode == 0, r.stdout + r.stderr


def _copy_scripts(tmp_path):
    for name in KERNEL_FILES:
        shutil.copy(SCRIPTS / f"{name}.py", tmp_path / f"{name}.py")
    return tmp_path


def test_check_fails_when_a_copy_differs_and_sync_repairs_it(tmp_path):
    d = _copy_scripts(tmp_path)
    originals = {p.name: p.read_text() for p in d.glob("*.py")}
    rope, sg = d / "rope.py", d / "skinny_gemm.py"
    old = '    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")\n'
    assert originals["rope.py"].count(old) == 1
    rope.write_text(originals["rope.py"].replace(old, old.replace('"0")', '"0", "false")')))
    old = "_PLAN_CACHE_SIZE = 4096"
    assert originals["skinny_gemm.py"].count(old) == 1
    sg.write_text(originals["skinny_gemm.py"].replace(old, "_PLAN_CACHE_SIZE = 1024"))

    r = _run("--check", "--dir", str(d))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "rope.py: block 'device' differs from rmsnorm.py's" in r.stderr
    assert "skinny_gemm.py: block 'launch' differs from rmsnorm.py's" in r.stderr
    assert "2 copies differ" in r.stderr
    assert _run("--check", "--dir", str(d), "--block", "checks").returncode == 0  # the other blocks still agree

    r = _run("--dir", str(d))  # default mode: copy the sources
    assert r.returncode == 0, r.stdout + r.stderr
    assert {p.name: p.read_text() for p in d.glob("*.py")} == originals
    assert _run("--check", "--dir", str(d)).returncode == 0


def test_source_option_copies_from_another_file(tmp_path):
    d = _copy_scripts(tmp_path)
    text = (d / "rope.py").read_text()
    old = "_dtype_name(d: torch.dtype) -> str:\n"
    (d / "rope.py").write_text(text.replace(old, old + "    # one more line\n"))
    assert _run("--check", "--dir", str(d)).returncode == 1
    assert _run("--dir", str(d), "--source", "rope.py", "--block", "checks").returncode == 0
    assert "# one more line" in (d / "skinny_gemm.py").read_text()
    assert _run("--check", "--dir", str(d)).returncode == 0


def test_broken_markers_are_reported(tmp_path):
    d = _copy_scripts(tmp_path)
    text = (d / "layernorm.py").read_text()
    end = "# ---- shared block rows end ----\n"
    assert text.count(end) == 1
    (d / "layernorm.py").write_text(text.replace(end, ""))
    r = _run("--check", "--dir", str(d))
    assert r.returncode == 1 and "block 'rows' has no end line" in r.stderr, r.stderr
    r = _run("--dir", str(d))  # nothing is written while markers are broken
    assert r.returncode == 1 and (d / "layernorm.py").read_text() == text.replace(end, "")


def _modules_with(attr):
    mods = [importlib.import_module(name) for name in KERNEL_FILES]
    return [m for m in mods if hasattr(m, attr)]


@pytest.mark.parametrize("mod", _modules_with("_next_pow2"), ids=lambda m: m.__name__)
def test_next_pow2(mod):
    assert [mod._next_pow2(n) for n in (-3, 0, 1, 2, 3, 4, 5, 7, 8, 9)] == [1, 1, 1, 2, 4, 4, 8, 8, 8, 16]
    for n in range(1, 5000):
        assert mod._next_pow2(n) == triton.next_power_of_2(n)


@pytest.mark.parametrize("mod", _modules_with("_cdiv"), ids=lambda m: m.__name__)
def test_cdiv(mod):
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 64, 128):
            assert mod._cdiv(a, b) == (a + b - 1) // b == triton.cdiv(a, b)


@pytest.mark.parametrize("mod", _modules_with("_check_tensor"), ids=lambda m: m.__name__)
def test_check_tensor_messages(mod):
    t = torch.zeros(4, dtype=torch.float32)
    with pytest.raises(TypeError, match="w must be a torch.Tensor, got list"):
        mod._check_tensor("w", [1.0], (torch.float32,))
    with pytest.raises(TypeError, match="w has dtype float32; expected one of float16, bfloat16"):
        mod._check_tensor("w", t, (torch.float16, torch.bfloat16))
    with pytest.raises(ValueError, match="w is on cpu but q is on meta; move them to one device"):
        mod._check_tensor("w", t, (torch.float32,), torch.device("meta"), ref="q")
    with pytest.raises(ValueError, match="w is on cpu but x is on meta"):
        mod._check_tensor("w", t, (torch.float32,), torch.device("meta"))
    with pytest.raises(ValueError, match="w must be contiguous in its last dimension \\(stride 2\\)"):
        mod._check_last_contiguous("w", torch.zeros(3, 4)[:, ::2])
    mod._check_last_contiguous("w", torch.zeros(3, 4)[:, :1])  # one element per row: any stride
    mod._check_last_contiguous("w", torch.zeros(0, 4)[:, ::2])  # empty

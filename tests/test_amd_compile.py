# SPDX-License-Identifier: Apache-2.0
"""Ahead-of-time compile check (scripts/check_amd_compile.py): every kernel compiles for gfx942, gfx950,
gfx1201 and sm90 at the launchers' real configurations, without spills or scratch on AMD; the checker
compiles exactly what Triton's JIT would compile for the same launch; and the spill detector does flag
a kernel that spills.

The compiles run in a subprocess without TRITON_INTERPRET (this process has it set by conftest.py when
there is no GPU, and kernels decorated under the interpreter cannot be compiled).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import amd_compile_tables as tables
import check_amd_compile as cac
from forked_python import TORCH_TRITON, run_python_forked
from kernel_testing import TargetOnlyDriver, env_without_interpreter, once_per_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_amd_compile.py"
WAVE = {name: warp for name, (_, _, warp) in cac.TARGETS.items()}


def _run(args, env, timeout=600):
    """python args in ROOT, as python runs them, forked from a process that has imported torch and triton."""
    t0 = time.perf_counter()
    res = run_python_forked(args, preload=TORCH_TRITON, env=env, cwd=ROOT, timeout=timeout)
    return res, time.perf_counter() - t0


def _run_code(body: str, label: str):
    """Python code (after `import json, sys` and scripts/ and tests/ put on sys.path) run in a process without
    the interpreter, which must exit 0; its CompletedProcess. label: the name its time is printed under."""
    code = f"import json, sys\nsys.path[:0] = [{str(ROOT / 'scripts')!r}, {str(ROOT / 'tests')!r}]\n" + body
    res, secs = _run(["-c", code], env_without_interpreter())
    print(f"{label}: {secs:.1f} s")
    assert res.returncode == 0, res.stderr[-4000:]
    return res


# --------------------------------------------------------------------------------------------
# A kernel that spills when its register budget is capped, used to prove the detector works.
# One warp holds a block of 64 fp32 values per lane and two of them (x and exp(x)) stay live across
# two reductions. Uncapped, it fits in registers on every target; capped (AMD: waves_per_eu makes the
# compiler keep 8 waves (wave64) or 16 (wave32) per SIMD, i.e. at most 64 or 96 VGPRs; NVIDIA:
# maxnreg=32), it spills. Each compile takes well under a second.
# --------------------------------------------------------------------------------------------
@triton.jit
def _huge_block_kernel(X, OUT, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + cols, mask=cols < N, other=0.0)
    e = tl.exp(x)
    y = x * tl.sum(e, axis=0) + e * tl.sum(x * x, axis=0)
    tl.store(OUT + cols, y, mask=cols < N)


def _device_target(device):
    """Replaced by the checker with the (backend, arch, warp size) being compiled for."""
    return ("interpreter", None, 32)


def launch_huge_block(cap_registers: bool) -> torch.Tensor:
    backend, _, warp_size = _device_target(torch.device("cpu"))
    n = 64 * warp_size
    x = torch.empty(n, dtype=torch.float32)
    out = torch.empty_like(x)
    extra = {}
    if cap_registers:
        extra = {"waves_per_eu": 64 * 8 // warp_size} if backend == "hip" else {"maxnreg": 32}
    _huge_block_kernel[(1,)](x, out, n, BLOCK=n, num_warps=1, **extra)
    return out


def jit_parity_report(targets=None) -> dict:
    """Compile every captured launch both ways and compare: the checker's ASTSource built from its own
    specialisation, and Triton's JIT itself (``run(warmup=True)``) under a stand-in driver that reports
    the target. Equal kernel hashes mean the checker compiled exactly what a real launch would.
    Run in a process without TRITON_INTERPRET."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime import driver as driver_config

    compared, mismatches = 0, []
    for tname in targets or cac.TARGETS:
        target = GPUTarget(*cac.TARGETS[tname])
        for case, (module_name, build) in cac.CASES.items():
            module = cac._import_leaf(module_name)
            with cac.capture_launches(module, cac.TARGETS[tname]) as launches:
                build(module)
            for ln in launches:
                spec = cac.specialize(ln, target)
                src = ASTSource(ln.kernel, spec["signature"], spec["constexprs"], spec["attrs"])
                ours = triton.compile(src, target=target, options=spec["options"].__dict__)
                driver_config.set_active(TargetOnlyDriver(target))
                try:
                    ln.kernel.device_caches.clear()  # re-create the binder for this target
                    jit = ln.kernel.run(*ln.args, grid=ln.grid, warmup=True, **ln.kwargs)
                finally:
                    driver_config._active = None
                    ln.kernel.device_caches.clear()
                compared += 1
                if jit.hash != ours.hash:
                    mismatches.append([case, tname, ln.name])
    return {"compared": compared, "mismatches": mismatches}


# --------------------------------------------------------------------------------------------
# The real check
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_report(tmp_path_factory):
    def compute():
        out = tmp_path_factory.mktemp("amd_compile") / "report.json"
        res, secs = _run([SCRIPT, "--output-json", out], env_without_interpreter())
        print(f"\ncheck_amd_compile.py: {secs:.1f} s wall, exit {res.returncode}")
        print(res.stderr[-6000:])
        assert out.exists(), f"no report written; exit {res.returncode}\n{res.stderr[-4000:]}"
        report = json.loads(out.read_text())
        assert json.loads(res.stdout) == report, "stdout JSON and --output-json differ"
        return res.returncode, report

    return once_per_run(tmp_path_factory, "amd_compile_full_report", compute)


@pytest.mark.slow  # full_report: check_amd_compile.py over every case, 10-20 s
def test_every_case_compiles_for_every_target_without_spills(full_report):
    rc, report = full_report
    records = report["records"]
    failed = [(r["case"], r["target"], r["problems"]) for r in records if not r["ok"]]
    assert not failed, f"kernels failing the compile check: {failed}"
    assert rc == 0 and report["ok"] is True
    seen = {(r["case"], r["target"]) for r in records}
    missing = [(c, t) for c in cac.CASES for t in cac.TARGETS if (c, t) not in seen]
    assert not missing, f"no compiled kernel for {missing}"
    assert report["tools"]["triton"] == triton.__version__


@pytest.mark.slow
def test_records_are_sane(full_report):
    _, report = full_report
    for r in report["records"]:
        where = f"{r['case']} / {r['kernel']} / {r['target']}"
        assert r["kernel"], where
        assert r["warp_size"] == WAVE[r["target"]], where
        assert r["num_warps"] >= 1 and r["compile_s"] >= 0, where
        assert r["grid"] and all(g >= 1 for g in r["grid"]), where
        assert isinstance(r["lds_bytes"], int) and 0 <= r["lds_bytes"] <= r["lds_limit_bytes"], where
        if r["backend"] == "hip":
            assert r["wavefront_size"] == WAVE[r["target"]], where
            assert r["vgpr_count"] > 0 and r["sgpr_count"] > 0, where
            assert r["vgpr_spill_count"] == 0 and r["sgpr_spill_count"] == 0, where
            assert r["scratch_bytes"] == 0 and r["private_segment_bytes"] == 0, where
            assert 1 <= r["occupancy_waves_per_simd"] <= (8 if WAVE[r["target"]] == 64 else 16), where
            # the launcher saw the target: pointers get the JIT's 16-byte alignment assumption
            assert any("tt.divisibility=16" in a for a in r["arg_attrs"].values()), where
        else:
            if report["tools"]["cuobjdump"] is None and report["tools"]["ptxas"] is None:
                pytest.skip("no CUDA tool in this triton wheel: NVIDIA registers are not reported")
            assert r["registers"] > 0, where
            assert r.get("spill_store_bytes", 0) == 0 and r.get("spill_load_bytes", 0) == 0, where


@pytest.mark.slow
def test_fp8_kernels_use_the_conversion_instruction_where_chosen(full_report):
    """The FP8 cases take Triton's cast on gfx942 (e4m3fnuz), gfx950 (e4m3fn, Triton >= 3.9) and sm90
    (e4m3fn), and the compiled code then holds the hardware conversion; elsewhere the integer encoder
    leaves none."""
    _, report = full_report
    expect = {
        "gfx942": "v_cvt_pk_fp8_f32",
        "gfx950": "v_cvt_scalef32_pk_fp8_f32",
        "sm90": "cvt.rn.satfinite.e4m3x2.f32",
    }
    tv = tuple(int(p) for p in triton.__version__.split(".")[:2])
    checked = 0
    for r in report["records"]:
        if not r["constexprs"].get("FP8_MODE"):
            continue
        fnuz = r["constexprs"]["FP8_MAX"] == 240.0
        native_expected = (
            (r["target"] == "gfx942" and fnuz)
            or (r["target"] == "sm90" and not fnuz)
            or (r["target"] == "gfx950" and not fnuz and tv >= (3, 9))
        )
        where = f"{r['case']} / {r['target']}"
        assert r["constexprs"]["NATIVE_FP8"] is native_expected, where
        if native_expected:
            assert expect[r["target"]] in r["fp8_conversions"], (where, r["fp8_conversions"])
        checked += 1
    assert checked >= 40


# --------------------------------------------------------------------------------------------
# The per-GPU guides' tables (scripts/amd_compile_tables.py)
# --------------------------------------------------------------------------------------------
def _hand_edited(table: str, row_prefix: str, col: int, value: str) -> str:
    """``table`` with cell ``col`` of the row starting with ``row_prefix`` set to ``value``."""
    lines = table.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(row_prefix))
    cells = lines[i].split("|")
    assert cells[col].strip() != value
    cells[col] = f" {value} "
    lines[i] = "|".join(cells)
    return "\n".join(lines)


def _guide_copies(tmp_path, tables_by_target: dict) -> dict:
    """Copies of the guides whose tables are replaced by ``tables_by_target``: {target: path}."""
    out = {}
    for t, guide in tables.GUIDES.items():
        text = guide.read_text()
        if t in tables_by_target:
            text = tables.replace_table(text, t, tables_by_target[t])
        out[t] = tmp_path / guide.name
        out[t].write_text(text)
    return out


@pytest.mark.slow  # full_report (shared with the tests above); the comparison itself takes no time
def test_guide_tables_match_a_fresh_check(full_report, tmp_path, monkeypatch):
    """The compile tables in the per-GPU guides are what amd_compile_tables.py makes of a fresh check (figures
    compared when the installed Triton is the one a table names; rows and compile count always), and a table
    edited by hand is caught."""
    _, report = full_report
    targets = list(tables.GUIDES)
    assert tables.compare(report, targets) == [], "rerun: python scripts/amd_compile_tables.py"
    # hand edits of a table that agrees with this Triton: a figure, a row's compile count, the total
    version = report["tools"]["triton"]
    fresh = {t: tables.render_table(report["records"], t, version) for t in targets}
    monkeypatch.setattr(tables, "GUIDES", _guide_copies(tmp_path, fresh))
    assert tables.compare(report, targets) == []
    edits = [
        _hand_edited(fresh["gfx942"], "| `ltx_qk_rmsnorm_rope_coords`", 4, "77"),  # VGPRs
        _hand_edited(fresh["gfx942"], "| `wan_14B_layer_norm_modulate`", 8, "7"),  # occupancy
        fresh["gfx942"].replace("| `rms_norm` (4)", "| `rms_norm` (3)"),
        fresh["gfx942"].replace(" compiles, 0 failed", "0 compiles, 0 failed"),
    ]
    for edited in edits:
        assert edited != fresh["gfx942"]
        monkeypatch.setattr(tables, "GUIDES", _guide_copies(tmp_path, {**fresh, "gfx942": edited}))
        problems = tables.compare(report, targets)
        assert len(problems) == 1 and "mi300x-optimization-guide.md" in problems[0], problems


def _quick_table_check(tmp: str) -> dict:
    """Run in a process without the interpreter: compile two case families for the three AMD targets and
    compare the committed tables (those families' rows, every row's structure, the compile count), then copies
    of the guides edited by hand. {name: problems}."""
    targets, only = list(tables.GUIDES), ["ltx_rope", "xcd_remap_demo"]
    report = tables.run_check(targets, only)
    out = {"committed": tables.compare(report, targets, only)}
    # a copy whose ltx_rope / xcd_remap_demo rows and Triton version are this Triton's, so figures are compared
    version = report["tools"]["triton"]
    fresh_rows = {
        (t, tables._row_key(r)): r
        for t in targets
        for r in tables.render_rows([x for x in report["records"] if x["target"] == t])
    }
    base = {}
    for t, guide in tables.GUIDES.items():
        table = tables.read_table(guide.read_text(), t)
        v = tables.table_triton_version(table)
        lines = [fresh_rows.get((t, tables._row_key(x)), x) if x.startswith("| `") else x for x in table.splitlines()]
        base[t] = "\n".join(lines).replace(f"(Triton {v};", f"(Triton {version};")
    variants = {
        "fresh": base,
        "value": {**base, "gfx1201": _hand_edited(base["gfx1201"], "| `ltx_rope`", 4, "26")},
        "count": {**base, "gfx950": base["gfx950"].replace(" compiles, 0 failed", "0 compiles, 0 failed")},
        "row": {**base, "gfx942": "\n".join(x for x in base["gfx942"].splitlines() if "`wan_14B_gelu_tanh`" not in x)},
        "warps": {
            **base,
            "gfx942": base["gfx942"].replace(
                "| `gelu` (2) | `_gelu_flat_kernel` | 4 x 64", "| `gelu` (2) | `_gelu_flat_kernel` | 8 x 64"
            ),
        },
    }
    real = dict(tables.GUIDES)
    for name, by_target in variants.items():
        d = Path(tmp) / name
        d.mkdir()
        tables.GUIDES = {t: d / real[t].name for t in targets}
        for t in targets:
            tables.GUIDES[t].write_text(tables.replace_table(real[t].read_text(), t, by_target[t]))
        out[name] = tables.compare(report, targets, only)
    return out


def test_guide_tables_quick_check(tmp_path):
    """Without the full check (cheap enough for every run): the committed tables name this Triton or another,
    their rows and compile counts match the case list, and the rows of two families match a fresh compile;
    a hand edit of a figure, a count, a row or a warp count is caught."""
    body = f"import test_amd_compile as t\nprint(json.dumps(t._quick_table_check({str(tmp_path)!r})))\n"
    res = _run_code(body, "quick table check")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out.pop("committed") == [], "rerun: python scripts/amd_compile_tables.py"
    assert out.pop("fresh") == []
    for name, problems in out.items():
        assert len(problems) == 1, (name, problems)
    assert "r9700" in out["value"][0] and "mi355x" in out["count"][0] and "mi300x" in out["row"][0]
    for t, guide in tables.GUIDES.items():
        table = tables.read_table(guide.read_text(), t)
        assert tables.table_triton_version(table), f"{guide.name}: the table must name the Triton that made it"


def test_table_script_command_line(capsys):
    with pytest.raises(SystemExit) as exc:
        tables.main(["--only", "ltx_rope"])
    assert exc.value.code == 2 and "--only needs --check" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        tables.main(["--check", "--only", "no_such_family"])
    assert exc.value.code == 2 and "unknown families" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        tables.main(["--targets", "sm90"])
    assert exc.value.code == 2


# --------------------------------------------------------------------------------------------
# The detector
# --------------------------------------------------------------------------------------------
def test_spill_detector_flags_a_spilling_kernel():
    body = (
        "import check_amd_compile as c\n"
        "cases = {'capped': ('test_amd_compile', lambda m: m.launch_huge_block(True)),\n"
        "         'uncapped': ('test_amd_compile', lambda m: m.launch_huge_block(False))}\n"
        "print(json.dumps(c.compile_cases(cases, list(c.TARGETS))))\n"
    )
    res = _run_code(body, "spill probe")
    records = {(r["case"], r["target"]): r for r in json.loads(res.stdout)}
    assert len(records) == 2 * len(cac.TARGETS), sorted(records)
    for t, (backend, _, warp) in cac.TARGETS.items():
        capped, free = records[("capped", t)], records[("uncapped", t)]
        assert free["ok"], (t, free["problems"])
        assert not any("did not compile" in p for p in capped["problems"]), (t, capped["problems"])
        # the launcher saw the target's warp size through _device_target
        assert capped["constexprs"]["BLOCK"] == free["constexprs"]["BLOCK"] == 64 * warp
        if backend == "hip":
            assert capped["waves_per_eu"] == 64 * 8 // warp
            assert capped["vgpr_spill_count"] > 0 and capped["scratch_bytes"] > 0, (t, capped)
            assert not capped["ok"], t
            assert any("spills" in p and "VGPR" in p for p in capped["problems"]), capped["problems"]
            assert any("scratch" in p for p in capped["problems"]), capped["problems"]
            assert free["vgpr_spill_count"] == 0 and free["scratch_bytes"] == 0
        else:  # NVIDIA spills are warnings, not failures
            if capped.get("spill_store_bytes") is None:
                pytest.skip("ptxas not available: NVIDIA spill bytes are not reported")
            assert capped["registers"] <= 32 and capped["spill_store_bytes"] > 0, capped
            assert capped["ok"] and any("spills" in w for w in capped["warnings"]), capped
            assert free.get("spill_store_bytes") == 0 and not free["warnings"], free


def _report_in_subprocess(function: str):
    """Run this module's `function()` in a process without the interpreter; its JSON result."""
    res = _run_code(f"import test_amd_compile as t\nprint(json.dumps(t.{function}()))\n", function)
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_checker_compiles_what_the_jit_compiles():
    report = _report_in_subprocess("jit_parity_report")
    assert report["compared"] >= len(cac.CASES) * len(cac.TARGETS)
    assert report["mismatches"] == [], report["mismatches"]


def eviction_hint_report() -> dict:
    """For the fused add + RMSNorm (plain and per-token FP8), the compiled code with and without its L2
    eviction hint (INPUT_EVICT) on every target: {target/variant: changed lines outside debug locations}."""
    import difflib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import rmsnorm

    report = {}
    for tname, (backend, arch, warp) in cac.TARGETS.items():
        target = GPUTarget(backend, arch, warp)
        for variant, kw in (("plain", {}), ("per_token", {"fp8": "per_token"})):
            with cac.capture_launches(rmsnorm, (backend, arch, warp)) as launches:
                rmsnorm.fused_add_rms_norm(cac._bf16(64, 4096), cac._bf16(64, 4096), cac._bf16(4096), 1e-5, **kw)
            launch = launches[0]
            assert launch.kwargs["INPUT_EVICT"] == "evict_first", launch.kwargs["INPUT_EVICT"]
            texts = []
            for hint in ("", "evict_first"):
                launch.kwargs["INPUT_EVICT"] = hint
                sp = cac.specialize(launch, target)
                src = ASTSource(
                    fn=launch.kernel, signature=sp["signature"], constexprs=sp["constexprs"], attrs=sp["attrs"]
                )
                asm = triton.compile(src, target=target, options=sp["options"].__dict__).asm
                texts.append(asm["amdgcn"] if backend == "hip" else asm["ptx"])
            diff = [
                ln
                for ln in difflib.unified_diff(texts[0].splitlines(), texts[1].splitlines(), lineterm="", n=0)
                if ln[:1] in "+-" and not ln.startswith(("+++", "---")) and ".loc" not in ln
            ]
            report[f"{tname}/{variant}"] = diff
    return report


def test_eviction_hint_changes_only_nvidia_code():
    """rmsnorm's comment on _EVICT_FIRST_MAX_BYTES says the hint leaves AMD code unchanged: the amdgcn of
    the fused add is the same with and without it (debug locations aside), while the sm90 PTX gains
    evict_first loads, so the comparison does see a hint where one is emitted."""
    report = _report_in_subprocess("eviction_hint_report")
    assert len(report) == 2 * len(cac.TARGETS)
    for key, diff in report.items():
        if cac.TARGETS[key.split("/")[0]][0] == "hip":
            assert diff == [], (key, diff[:6])
        else:
            assert any("evict_first" in ln for ln in diff if ln.startswith("+")), (key, diff[:6])


_AMDGCN_SPILLING = """
; -- End function
    .amdhsa_kernel _k
; Kernel info:
; NumVgprs: 256
; ScratchSize: 1132
; Occupancy: 1
amdhsa.kernels:
  - .agpr_count:     0
    .private_segment_fixed_size: 1132
    .sgpr_count:     22
    .sgpr_spill_count: 3
    .vgpr_count:     512
    .vgpr_spill_count: 282
    .wavefront_size: 64
"""


def test_amdgcn_parser_on_canned_text():
    stats = cac.parse_amdgcn(_AMDGCN_SPILLING)
    assert stats["vgpr_count"] == 512 and stats["sgpr_count"] == 22 and stats["agpr_count"] == 0
    assert stats["vgpr_spill_count"] == 282 and stats["sgpr_spill_count"] == 3
    assert stats["scratch_bytes"] == 1132 and stats["occupancy_waves_per_simd"] == 1
    assert stats["wavefront_size"] == 64
    problems = cac.amd_problems(stats, lds_bytes=70000, lds_limit=65536)
    assert any("282 VGPRs" in p for p in problems) and any("3 SGPRs" in p for p in problems)
    assert any("1132 bytes of scratch" in p for p in problems) and any("LDS" in p for p in problems)
    clean = _AMDGCN_SPILLING.replace("282", "0").replace("1132", "0").replace("spill_count: 3", "spill_count: 0")
    assert cac.amd_problems(cac.parse_amdgcn(clean), 1024, 65536) == []
    # a text without the fields cannot pass
    assert cac.amd_problems(cac.parse_amdgcn("; nothing here"), 0, 65536)


def test_nvidia_parsers_on_canned_text():
    cuobj = " Function _k:\n  REG:40 STACK:16 SHARED:0 LOCAL:8 CONSTANT[0]:600 TEXTURE:0\n"
    assert cac.parse_cuobjdump_resource_usage(cuobj) == {
        "registers": 40,
        "stack_bytes": 16,
        "static_shared_bytes": 0,
        "local_bytes": 8,
    }
    ptxas = (
        "ptxas info    : Function properties for _k\n"
        "    304 bytes stack frame, 272 bytes spill stores, 332 bytes spill loads\n"
        "ptxas info    : Used 32 registers, used 1 barriers\n"
    )
    assert cac.parse_ptxas_verbose(ptxas) == {
        "stack_bytes": 304,
        "spill_store_bytes": 272,
        "spill_load_bytes": 332,
        "registers": 32,
    }


# --------------------------------------------------------------------------------------------
# Interpreter handling and the command line
# --------------------------------------------------------------------------------------------
def test_compile_all_refuses_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET is set"):
        cac.compile_all(["gfx942"], "rms_norm")


def test_script_restarts_itself_without_the_interpreter():
    env = dict(env_without_interpreter(), TRITON_INTERPRET="1")
    case = next(iter(cac.CASES))
    res, _ = _run([SCRIPT, "--targets", "gfx1201", "--kernel", case], env)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "restarting without it" in res.stderr
    report = json.loads(res.stdout)
    assert report["n_records"] >= 1 and report["ok"]
    assert {r["target"] for r in report["records"]} == {"gfx1201"}


def test_command_line(capsys):
    # argument errors and --help are handled before anything is compiled (in this process)
    with pytest.raises(SystemExit) as exc:
        cac.main(["--targets", "gfx942,gfx900"])
    assert exc.value.code == 2 and "unknown target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cac.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and all(opt in out for opt in ("--targets", "--kernel", "--output-json"))
    # a filter that matches nothing is a failure (nothing was checked)
    res, _ = _run([SCRIPT, "--kernel", "no-such-kernel", "--targets", "gfx942"], env_without_interpreter())
    assert res.returncode == 1 and json.loads(res.stdout)["n_records"] == 0


def test_what_if_overrides():
    """--num-warps and --waves-per-eu reach the compiled kernel and are recorded; bad values are refused."""
    res, _ = _run(
        [
            SCRIPT,
            "--kernel",
            "rms_norm[2x6144",
            "--targets",
            "gfx942,gfx1201",
            "--num-warps",
            "8",
            "--waves-per-eu",
            "2",
        ],
        env_without_interpreter(),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    report = json.loads(res.stdout)
    assert report["num_warps_override"] == 8 and report["waves_per_eu_override"] == 2
    assert report["n_records"] == 2
    for r in report["records"]:
        assert r["num_warps"] == 8 and r["num_warps_override"] == 8
        assert r["waves_per_eu"] == 2 and r["waves_per_eu_override"] == 2
    # on CDNA the hint caps the reported occupancy at 2 waves per SIMD (without it: 8)
    assert [r["occupancy_waves_per_simd"] for r in report["records"] if r["target"] == "gfx942"] == [2]
    for bad in (["--num-warps", "3"], ["--num-warps", "64"], ["--waves-per-eu", "0"]):
        with pytest.raises(SystemExit) as exc:
            cac.main(bad)
        assert exc.value.code == 2

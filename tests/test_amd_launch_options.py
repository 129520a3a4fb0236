# SPDX-License-Identifier: Apache-2.0
"""AMD launch options (``waves_per_eu``, ``matrix_instr_nonkdim``, ``kpack``) in eager and under torch.compile.

Checks section 1 of references/amd-compiler-options.md (per-kernel options under torch.compile), on the CPU:

* what the options change when they reach the AMD backend: an ahead-of-time compile of a small ``tl.dot``
  kernel for gfx942 with and without them (metadata, the ``amdgpu-waves-per-eu`` LLVM attribute, the MFMA
  instruction, the register-based occupancy);
* what a ``torch.library.triton_op`` whose body launches ``wrap_triton(kernel)[grid](..., num_warps=4,
  waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2)`` does with them: the traced graph keeps them as kernel
  keyword arguments, the graph's eager fallback and the eager op pass them to Triton's launcher, and
  Inductor's generated code for the user-defined kernel has no trace of them; put in a ``triton.Config`` of a
  ``@triton.autotune`` kernel instead, they reach Inductor's configs and, for a HIP device, the options
  Inductor's runtime gives ``triton.compile``.

Triton reports a HIP gfx942 target through a stand-in driver (nothing is launched: launches are recorded,
Inductor's code is generated without being compiled). Everything runs in one subprocess without
TRITON_INTERPRET (kernels decorated under the interpreter cannot be compiled).
"""

from __future__ import annotations

import ast
import json
import re
import time
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernel_testing import TargetOnlyDriver, env_without_interpreter, once_per_run, run_python

ROOT = Path(__file__).resolve().parents[1]
OPTS = {"waves_per_eu": 2, "matrix_instr_nonkdim": 16, "kpack": 2}
TORCH_MINOR = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2])
pytestmark = pytest.mark.slow  # every test reads one report, made in a subprocess of 10-20 s


@triton.jit
def _add_one_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, tl.load(X + offs, mask=mask) + 1.0, mask=mask)


@triton.autotune(configs=[triton.Config(dict(OPTS), num_warps=4, num_stages=2)], key=[])
@triton.jit
def _add_one_tuned_kernel(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, tl.load(X + offs, mask=mask) + 1.0, mask=mask)


@triton.jit
def _dot_kernel(A, B, C, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm, rn, rk = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    a = tl.load(A + rm[:, None] * BK + rk[None, :])
    b = tl.load(B + rk[:, None] * BN + rn[None, :])
    tl.store(C + rm[:, None] * BN + rn[None, :], tl.dot(a, b))


def _compiled_facts(kernel) -> dict:
    md, llir, gcn = kernel.metadata, kernel.asm["llir"], kernel.asm["amdgcn"]
    occ = re.search(r";\s*Occupancy:\s*(\d+)", gcn)
    return {
        "waves_per_eu": md.waves_per_eu,
        "matrix_instr_nonkdim": md.matrix_instr_nonkdim,
        "kpack": md.kpack,
        "num_stages": md.num_stages,
        # Triton 3.9 omits the attribute when the option is 0; Triton 3.6 writes "0, 0"
        "llvm_waves_per_eu": re.findall(r'"amdgpu-waves-per-eu"="([^"]*)"', llir),
        "mfma": sorted(set(re.findall(r"\bv_mfma_\w+", gcn))),
        "occupancy": int(occ.group(1)) if occ else None,
    }


def aot_report() -> dict:
    """The dot kernel compiled for gfx942, with the launcher's defaults and with OPTS."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = {}
    for name, extra in (("default", {}), ("options", OPTS)):
        src = ASTSource(
            fn=_dot_kernel,
            signature={
                "A": "*fp16",
                "B": "*fp16",
                "C": "*fp32",
                "BM": "constexpr",
                "BN": "constexpr",
                "BK": "constexpr",
            },
            constexprs={"BM": 64, "BN": 64, "BK": 64},
            attrs={(i,): [["tt.divisibility", 16]] for i in range(3)},
        )
        try:
            k = triton.compile(src, target=GPUTarget("hip", "gfx942", 64), options={"num_warps": 4, **extra})
        except Exception as exc:  # a Triton build without the AMD backend
            return {"skip": f"no gfx942 compile here: {type(exc).__name__}: {exc}"}
        out[name] = _compiled_facts(k)
    return out


def traced_report() -> dict:
    """The triton_op paths with launch kwargs (``kw``) and with a triton.Config (``cfg``)."""
    if not (hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")):
        return {"skip": "this torch has no torch.library.triton_op / wrap_triton"}
    import torch._inductor.config as inductor_config
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._inductor.utils import get_code
    from torch.library import triton_op, wrap_triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as driver_config
    from triton.runtime.jit import JITFunction

    inductor_config.force_disable_caches = True  # generate the code, do not load it from a cache
    # Triton's target queries answered with gfx942; launches never reach the driver (they are recorded); this
    # subprocess ends after the report
    driver_config.set_active(TargetOnlyDriver(GPUTarget("hip", "gfx942", 64)))

    @triton_op("rtk_launch_options::kw", mutates_args=())
    def kw_op(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        n = x.numel()
        wrap_triton(_add_one_kernel)[(triton.cdiv(n, 128),)](x, y, n, BLOCK=128, num_warps=4, **OPTS)
        return y

    @triton_op("rtk_launch_options::cfg", mutates_args=())
    def cfg_op(x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        n = x.numel()
        wrap_triton(_add_one_tuned_kernel)[(triton.cdiv(n, 128),)](x, y, n, BLOCK=128)
        return y

    x = torch.randn(256)
    report = {"torch": torch.__version__, "triton": triton.__version__}
    for name, op in (("kw", kw_op), ("cfg", cfg_op)):
        rec = {}
        # 1. Inductor's generated code (not compiled, not run)
        torch._dynamo.reset()
        with torch.no_grad():
            code = "\n".join(get_code(torch.compile(lambda t: op(t) * 2, fullgraph=True), x))
        m = re.search(r"user_autotune\(\s*configs=(\[.*?\]),\s*inductor_meta", code, re.S)
        rec["inductor_configs"] = m.group(1) if m else None
        rec["inductor_signature"] = re.findall(r"'signature': \{([^}]*)\}", code)
        rec["inductor_run_lines"] = re.findall(r"\w+\.run\([^\n]*\)", code)
        rec["option_names_in_inductor_code"] = [k for k in OPTS if k in code]
        # 2. the traced graph (AOTAutograd), run eagerly = the graph's fallback, then the op in eager
        nodes, launches = [], []

        def fw(gm, example_inputs):
            nodes.extend(n.kwargs for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target))
            return gm

        def record(self, *args, grid, warmup=False, **kwargs):
            launches.append({k: v for k, v in kwargs.items() if isinstance(v, (int, float, str, bool))})

        orig_run = JITFunction.run
        JITFunction.run = record
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                torch.compile(lambda t: op(t) * 2, backend=aot_autograd(fw_compiler=fw), fullgraph=True)(x)
                op(x)
        finally:
            JITFunction.run = orig_run
        rec["hop_kwargs"] = [{k: v for k, v in n["kwargs"].items() if not isinstance(v, torch.fx.Node)} for n in nodes]
        rec["hop_configs"] = [
            [c.all_kwargs() for c in getattr(kernel_side_table.get_kernel(n["kernel_idx"]), "configs", [])]
            for n in nodes
        ]
        rec["launches"] = launches  # [graph fallback, eager op]
        report[name] = rec

    # 3. what Inductor's runtime hands triton.compile for each generated config on a HIP device
    try:
        from torch._inductor.runtime import triton_heuristics as th
        from torch._inductor.runtime.hints import DeviceProperties

        dev = DeviceProperties(type="hip", index=0, multi_processor_count=304, cc="gfx942", warp_size=64)
        meta = {
            "signature": {"X": "*fp32", "Y": "*fp32", "N": "i32", "BLOCK": "constexpr"},
            "device": dev,
            "constants": {"BLOCK": 128},
            "configs": [{(0,): [["tt.divisibility", 16]]}],
        }
        runtime = {}
        for name in ("kw", "cfg"):
            configs = ast.literal_eval(report[name]["inductor_configs"])  # a list of dicts, as generated
            tuner = th.user_autotune(
                configs=configs,
                triton_meta=meta,
                inductor_meta={"kernel_name": name},
                filename=__file__,
                custom_kernel=True,
            )(_add_one_kernel)
            cfg = tuner.configs[0]
            options = tuner._create_compile_options(cfg, tuner._create_compile_meta(cfg))
            runtime[name] = {k: v for k, v in options.items() if isinstance(v, (int, bool))}
        # and what those options do to the kernel compiled for gfx942
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        src = ASTSource(fn=_add_one_kernel, signature=meta["signature"], constexprs={"BLOCK": 128})
        runtime["cfg_compiled"] = _compiled_facts(
            triton.compile(src, target=GPUTarget("hip", "gfx942", 64), options=runtime["cfg"])
        )
        report["runtime"] = runtime
    except (ImportError, AttributeError, TypeError) as exc:  # Inductor's private runtime API moved
        report["runtime"] = {"skip": f"{type(exc).__name__}: {exc}"}
    return report


# --------------------------------------------------------------------------------------------
# The tests: one subprocess computes both reports
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return once_per_run(tmp_path_factory, "amd_launch_options_report", lambda: _report(tmp_path_factory))


def _report(tmp_path_factory):
    env = env_without_interpreter()
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor_cache"))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    code = (
        "import json, sys\n"
        f"sys.path[:0] = [{str(ROOT / 'tests')!r}]\n"
        "import test_amd_launch_options as t\n"
        "print('REPORT ' + json.dumps({'aot': t.aot_report(), 'traced': t.traced_report()}))\n"
    )
    t0 = time.perf_counter()
    res = run_python(["-c", code], env=env, cwd=ROOT, timeout=300)
    print(f"launch-options probe: {time.perf_counter() - t0:.1f} s")
    assert res.returncode == 0, res.stderr[-4000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("REPORT ")][-1]
    return json.loads(line[len("REPORT ") :])


def test_options_change_the_gfx942_code(report):
    aot = report["aot"]
    if "skip" in aot:
        pytest.skip(aot["skip"])
    d, o = aot["default"], aot["options"]
    assert (d["waves_per_eu"], d["matrix_instr_nonkdim"], d["kpack"]) == (0, 0, 1), d
    assert (o["waves_per_eu"], o["matrix_instr_nonkdim"], o["kpack"]) == (2, 16, 2), o
    norm = [v.replace(" ", "") for v in o["llvm_waves_per_eu"]]
    assert norm == ["2,2"], o["llvm_waves_per_eu"]
    assert all(v.replace(" ", "") == "0,0" for v in d["llvm_waves_per_eu"]), d["llvm_waves_per_eu"]
    # matrix_instr_nonkdim=16 picks the 16x16 MFMA where the default is 32x32 for this tile
    assert d["mfma"] and all("32x32" in i for i in d["mfma"]), d["mfma"]
    assert o["mfma"] and all("16x16" in i for i in o["mfma"]), o["mfma"]
    # the hint caps the compiler's occupancy figure at 2 waves per SIMD
    assert o["occupancy"] == 2 and d["occupancy"] > 2, (d["occupancy"], o["occupancy"])


def test_traced_graph_keeps_the_options_as_kernel_kwargs(report):
    tr = report["traced"]
    if "skip" in tr:
        pytest.skip(tr["skip"])
    kw = tr["kw"]
    assert len(kw["hop_kwargs"]) == 1, kw["hop_kwargs"]
    hop = kw["hop_kwargs"][0]
    # beside the kernel's own arguments, not moved into a config like num_warps
    assert {k: hop.get(k) for k in OPTS} == OPTS, hop
    assert {"N", "BLOCK"} <= set(hop) and "num_warps" not in hop, hop
    assert len(kw["hop_configs"][0]) == 1 and kw["hop_configs"][0][0]["num_warps"] == 4, kw["hop_configs"]
    assert not set(OPTS) & set(kw["hop_configs"][0][0]), kw["hop_configs"]


def test_eager_fallback_and_eager_op_pass_the_options_to_triton(report):
    tr = report["traced"]
    if "skip" in tr:
        pytest.skip(tr["skip"])
    for name in ("kw", "cfg"):
        launches = tr[name]["launches"]
        assert len(launches) == 2, (name, launches)  # the traced graph run eagerly, then the eager op
        for ln in launches:
            assert {k: ln.get(k) for k in OPTS} == OPTS, (name, ln)
            assert ln["num_warps"] == 4, (name, ln)
    # the graph's fallback launches through a one-config autotuner: num_stages comes from triton.Config's
    # default (3), not from the backend's (2 for HIP) as in the eager call without num_stages
    assert tr["kw"]["launches"][0]["num_stages"] == 3 and "num_stages" not in tr["kw"]["launches"][1]


def test_inductor_drops_launch_kwargs_and_keeps_config_kwargs(report):
    tr = report["traced"]
    if "skip" in tr:
        pytest.skip(tr["skip"])
    kw, cfg = tr["kw"], tr["cfg"]
    # launch kwargs: silently absent from the generated kernel, its configs and its call
    assert kw["inductor_configs"] is not None, "no user_autotune(...) in Inductor's generated code"
    assert ast.literal_eval(kw["inductor_configs"]) == [{"num_warps": 4, "num_stages": 3}], kw["inductor_configs"]
    assert kw["option_names_in_inductor_code"] == [], kw["option_names_in_inductor_code"]
    assert all(not any(k in s for k in OPTS) for s in kw["inductor_signature"]), kw["inductor_signature"]
    assert len(kw["inductor_run_lines"]) == 1, kw["inductor_run_lines"]
    call = kw["inductor_run_lines"][0]
    positional = [a.strip() for a in call[call.index("(") + 1 : -1].split(",") if "=" not in a]
    assert positional[2:] == ["256", "2", "1", "1"], call  # X, Y, then N and the grid (2, 1, 1): nothing else
    # triton.Config kwargs: carried into the generated configs
    assert ast.literal_eval(cfg["inductor_configs"]) == [{**OPTS, "num_warps": 4, "num_stages": 2}], cfg[
        "inductor_configs"
    ]


def test_inductor_runtime_turns_config_kwargs_into_hip_options(report):
    tr = report["traced"]
    if "skip" in tr:
        pytest.skip(tr["skip"])
    rt = tr["runtime"]
    if "skip" in rt:
        pytest.skip("Inductor's runtime API is not the one read: " + rt["skip"])
    assert not set(OPTS) & set(rt["kw"]), rt["kw"]
    assert rt["cfg"]["waves_per_eu"] == 2 and rt["cfg"]["matrix_instr_nonkdim"] == 16, rt["cfg"]
    if TORCH_MINOR >= (2, 13):  # every config kwarg outside the signature becomes a HIP option
        assert rt["cfg"]["kpack"] == 2, rt["cfg"]
    elif TORCH_MINOR == (2, 11):  # only waves_per_eu and matrix_instr_nonkdim are forwarded
        assert "kpack" not in rt["cfg"], rt["cfg"]
    assert rt["cfg"]["num_stages"] == 2 and rt["cfg"]["num_warps"] == 4, rt["cfg"]
    compiled = rt["cfg_compiled"]
    assert compiled["waves_per_eu"] == 2 and compiled["matrix_instr_nonkdim"] == 16, compiled
    assert [v.replace(" ", "") for v in compiled["llvm_waves_per_eu"]] == ["2,2"], compiled

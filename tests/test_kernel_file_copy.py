# SPDX-License-Identifier: Apache-2.0
"""A kernel file copied into another project and edited computes what the copy says, in eager mode and under
torch.compile, beside the original: each file's torch.library ops live in a namespace named after its module
(rtk_<module name>). The same module name holding other code raises instead of running the ops registered
first; importing the very same file again keeps its ops."""

import importlib
import importlib.util
import sys

import pytest
import torch

import kernel_testing as kt
import rmsnorm

EDIT = (
    "tl.store(OUT + out_row[:, None] + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)",
    "tl.store(OUT + out_row[:, None] + cols[None, :], (2 * y).to(OUT.dtype.element_ty), mask=mask)",
)


def _load(path, name):
    """The module in path, imported under name without entering sys.modules (the original stays importable)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _edited_copy(tmp_path, name):
    src = open(rmsnorm.__file__).read()
    assert src.count(EDIT[0]) == 1, "the line this test edits moved: update EDIT"
    path = tmp_path / f"{name}.py"
    path.write_text(src.replace(*EDIT))
    return path


def test_edited_copy_runs_its_own_kernel_eager_and_compiled(tmp_path, gen, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # the copy is a module of the project it was copied into
    _edited_copy(tmp_path, "my_rmsnorm")
    copy = importlib.import_module("my_rmsnorm")
    monkeypatch.delitem(sys.modules, "my_rmsnorm")
    assert copy._NS == "rtk_my_rmsnorm" and rmsnorm._NS == "rtk_rmsnorm"
    x = torch.randn(5, 64, generator=gen).to(kt.DEVICE)
    w = torch.randn(64, generator=gen).to(kt.DEVICE)
    want = rmsnorm.rms_norm_ref(x.double(), w.double(), 1e-6).float()
    with torch.no_grad():
        for module, factor in ((rmsnorm, 1), (copy, 2), (rmsnorm, 1)):  # the original before and after the copy
            eager = module.rms_norm(x, w, 1e-6)
            compiled = kt.compile_aot_eager(lambda a, b, m=module: m.rms_norm(a, b, 1e-6))(x, w)
            for name, got in (("eager", eager), ("compiled", compiled)):
                err = float((got.double() - factor * want.double()).abs().max())
                assert err <= 1e-5, f"{module.__name__} {name}: {err:.3e} off {factor} x the reference"


def test_other_code_under_the_same_module_name_raises(tmp_path):
    path = _edited_copy(tmp_path, "rmsnorm")  # an edited file imported as `rmsnorm` beside the original
    with pytest.raises(RuntimeError, match=r"rtk_rmsnorm::\w+ is registered already.*rename this file"):
        _load(path, "rmsnorm")


def test_the_same_file_imported_again_keeps_its_ops(gen):
    again = _load(rmsnorm.__file__, "rmsnorm")  # as importlib.reload would run it
    x = torch.randn(3, 32, generator=gen).to(kt.DEVICE)
    with torch.no_grad():
        assert torch.equal(again.rms_norm(x, None, 1e-6), rmsnorm.rms_norm(x, None, 1e-6))


# A kernel file copied alone (no kernel_runtime.py beside it) into an empty folder, imported by a fresh Python
# whose only path is that folder: its plain launcher runs and matches the float64 reference, eagerly (on the
# CPU under the Triton interpreter, as this process runs) and on a GPU also under torch.compile (Dynamo traces
# the launcher and records its user-defined Triton kernel; Dynamo cannot trace the interpreter). Fails if the
# file needs anything beside torch and triton (kernel_runtime included).
_ALONE = {
    "rmsnorm": "m.rms_norm(x, w), m.rms_norm_ref(x.double(), w.double())",
    "layernorm": "m.layer_norm(x, w, w), m.layer_norm_ref(x.double(), w.double(), w.double())",
    "rope": "m.ltx_rope(x[None], c[None], s[None]), m.ltx_rope_ref(x[None].double(), c[None].double(), s[None].double())",
    "qk_norm_rope": (
        "m.ltx_qk_rmsnorm_rope(x[None], x[None], w, w, 1e-6, c, s)[0], m.ltx_qk_rmsnorm_rope_ref(x[None].double(), "
        "x[None].double(), w.double(), w.double(), 1e-6, c.double(), s.double())[0]"
    ),
    "activations": "m.gelu(x), m.gelu_ref(x.double())",
    "head_norm_rope": (
        "m.head_rms_norm_rope(q, q, w, w, 1e-6)[0], m.head_rms_norm_rope_ref(q.double(), q.double(), w.double(), "
        "w.double(), 1e-6)[0]"
    ),
    "skinny_gemm": "m.skinny_gemm(x, wm), m.skinny_gemm_ref(x, wm)",
    "moe_experts": (  # 3 tokens, 2 experts of H 64, I 8: gate_up from wm, down from wm's first rows
        "m.moe_swiglu_experts(x, i2, w[:6].view(3, 2), wm.view(2, 16, 64), wm[:16].reshape(2, 64, 8)), "
        "m.moe_swiglu_experts_ref(x.double(), i2, w[:6].view(3, 2).double(), wm.view(2, 16, 64).double(), "
        "wm[:16].reshape(2, 64, 8).double())"
    ),
}
_ALONE_SCRIPT = """
import importlib, json, sys
import torch
m = importlib.import_module(sys.argv[1])
dev = sys.argv[2]
g = torch.Generator().manual_seed(0)
x = torch.randn(3, 64, generator=g).to(dev)
w = (1 + 0.1 * torch.randn(64, generator=g)).to(dev)
ang = torch.randn(3, 64, generator=g).to(dev)
c, s = ang.cos(), ang.sin()
q = torch.randn(1, 3, 2, 64, generator=g).to(dev)
wm = torch.randn(32, 64, generator=g).to(dev)
i2 = torch.tensor([[0, 1], [1, 0], [1, 1]], device=dev)
if sys.argv[1] == "skinny_gemm":
    x, wm = x.bfloat16(), wm.bfloat16()

def f(x, w, c, s, q, wm):
    return {expr}

with torch.no_grad():
    got, ref = f(x, w, c, s, q, wm)
    outs = [got]
    if dev == "cuda":
        outs.append(torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, c, s, q, wm)[0])
errs = [float((o.double() - ref.double()).abs().max() / (1 + ref.double().abs().max())) for o in outs]
print("RESULT " + json.dumps({{"runtime": "kernel_runtime" in sys.modules, "errs": errs}}))
"""


@pytest.mark.parametrize("name", sorted(_ALONE))
def test_kernel_file_copied_alone_runs_its_plain_launcher(tmp_path, name):
    import json
    import os
    import shutil

    from conftest import SCRIPTS
    from forked_python import TORCH_TRITON, run_python_forked

    shutil.copy(SCRIPTS / f"{name}.py", tmp_path / f"{name}.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(tmp_path), PYTHONWARNINGS="ignore")
    script = _ALONE_SCRIPT.format(expr=_ALONE[name])
    dev = "cpu" if kt.INTERPRET else "cuda"
    # forked from a process that has imported torch and triton (their import is most of a run's time), which
    # the copy may use; nothing else is imported there
    r = run_python_forked(["-c", script, name, dev], preload=TORCH_TRITON, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT ") :])
    assert result["runtime"] is False, "the copy imported kernel_runtime: it must run alone"
    tol = 3e-2 if name == "skinny_gemm" else 1e-5  # skinny_gemm: bf16 inputs and output
    assert max(result["errs"]) <= tol, result

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

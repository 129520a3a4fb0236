# SPDX-License-Identifier: Apache-2.0
"""Run by Python at start-up in the processes the tests start with this folder on PYTHONPATH
(kernel_testing.with_interpreter_speedup): once triton.runtime.interpreter is imported (when a kernel is decorated
under TRITON_INTERPRET=1, whenever the script sets it), tests/interpreter_speedup.py's install() runs, as
conftest.py runs it in the test processes. Nothing is imported before the process imports it itself."""

import importlib.abc
import importlib.util
import os
import sys

_TARGET = "triton.runtime.interpreter"
_SPEEDUP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "interpreter_speedup.py")


def _install():
    spec = importlib.util.spec_from_file_location("_tests_interpreter_speedup", _SPEEDUP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install()


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds triton.runtime.interpreter with the other finders, runs its module as they would, then _install()."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                self.inner = spec.loader
                spec.loader = self
                return spec
        return None

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        _install()


if _TARGET in sys.modules:
    _install()
else:
    sys.meta_path.insert(0, _AfterImport())


def _run_the_sitecustomize_this_one_hides():
    """Python imports one sitecustomize at start-up, the first on sys.path: this one, first on PYTHONPATH. One
    further on (a distribution's, a virtual environment's) runs too, as it would have without this folder."""
    here = os.path.dirname(os.path.abspath(__file__))
    me = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me
    finally:
        sys.path[:] = saved


_run_the_sitecustomize_this_one_hides()

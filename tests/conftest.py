# SPDX-License-Identifier: Apache-2.0
"""Test set-up: run the kernels natively on a GPU, else through Triton's interpreter on the CPU.

TRITON_INTERPRET must be set before any @triton.jit function is decorated, so it is decided here,
before the kernel modules under scripts/ are imported by the tests.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch import failure is reported by the tests themselves
        return False


if os.environ.get("TRITON_INTERPRET") is None and not _has_gpu():
    os.environ["TRITON_INTERPRET"] = "1"


def _share_the_cores_between_workers():
    """Under pytest-xdist (-n N), each worker takes its share of the cores for torch's own threads (and passes it
    on to the processes it starts) instead of all of them: N workers that each ran as many threads as there are
    cores would keep 2N threads spinning on N cores (20 % longer on 2 cores). An OMP_NUM_THREADS set by the user
    is kept. Only the speed changes: each test runs all it runs in one process, at one thread count."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


_share_the_cores_between_workers()

for p in (str(SCRIPTS), str(Path(__file__).resolve().parent)):
    if p not in sys.path:
        sys.path.insert(0, p)


import interpreter_speedup  # noqa: E402 (tests/ is on sys.path from here)

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    interpreter_speedup.install()  # over an interpreter it was not checked against: a test fails, saying why


def pytest_report_header(config):
    mode = "Triton interpreter (CPU)" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "native GPU"
    if interpreter_speedup.NOT_INSTALLED:
        mode += " without tests/interpreter_speedup.py: " + interpreter_speedup.NOT_INSTALLED
    return f"kernels run on: {mode}"


import pytest  # noqa: E402

from kernel_testing import FRESH_SEEDS, SeededGenerator, make_generator  # noqa: E402


@pytest.fixture
def gen():
    """A CPU generator with a fresh seed (KERNEL_TEST_SEED replays one); a failing test reports it."""
    return make_generator()


def pytest_runtest_setup(item):
    FRESH_SEEDS.clear()  # from here on, the seeds this test draws (fixtures included)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that drew a fresh seed (the gen fixture, or make_generator() in its body) says how to
    replay it: in a section of its failure report and at the end of its short summary line."""
    report = yield
    if report.failed:
        seeds = [g.seed_value for g in getattr(item, "funcargs", {}).values() if isinstance(g, SeededGenerator)]
        seeds += [s for s in FRESH_SEEDS if s not in seeds]
        if seeds:
            line = f"replay with KERNEL_TEST_SEED={seeds[0]}"
            if len(seeds) > 1:
                line += f" (seeds drawn: {', '.join(map(str, seeds))}; the variable gives every generator that one)"
            report.sections.append(("kernel test seed", line))
            crash = getattr(report.longrepr, "reprcrash", None)
            if crash is not None:  # the short summary shows the message's first line
                first, nl, rest = crash.message.partition("\n")
                crash.message = f"{first} [replay with KERNEL_TEST_SEED={seeds[0]}]{nl}{rest}"
    return report


KERNEL_MODULES = ("rmsnorm", "layernorm", "rope", "qk_norm_rope", "activations", "head_norm_rope", "skinny_gemm")


def clear_launch_plans():
    """Forget every kernel file's launch plans (built from the module's settings when first seen), so a
    setting a test changes applies to the next call."""
    runtime = sys.modules.get("kernel_runtime")
    if runtime is not None:
        runtime.clear_plans()


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    clear_launch_plans()
    yield
    clear_launch_plans()


@pytest.fixture(autouse=True)
def _diffusers_attention_backend_restored():
    """diffusers' ModelMixin.set_attention_backend also sets the process-wide active backend, and
    reset_attention_backend leaves that as it is: a test that sets one would turn the fused attentions of every
    later test in its process off (they run SDPA themselves only under the native backend)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry as reg

    saved = reg._active_backend, reg._checks_enabled
    yield
    reg._active_backend, reg._checks_enabled = saved


@pytest.fixture(autouse=True, scope="session")
def _plans_verified():
    """Under the interpreter a plan never launches (there is no compiled kernel): every call that has a plan
    records the plain launcher again instead and checks that the plan would have handed each kernel exactly
    what it did (kernel_runtime.VERIFY_PLANS). A plan that differs fails the test whose call made it, on any
    machine."""
    import kernel_runtime

    old = kernel_runtime.VERIFY_PLANS
    kernel_runtime.VERIFY_PLANS = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    yield
    kernel_runtime.VERIFY_PLANS = old

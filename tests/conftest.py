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

for p in (str(SCRIPTS), str(Path(__file__).resolve().parent)):
    if p not in sys.path:
        sys.path.insert(0, p)


def pytest_report_header(config):
    mode = "Triton interpreter (CPU)" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "native GPU"
    return f"kernels run on: {mode}"


import pytest  # noqa: E402

KERNEL_MODULES = ("rmsnorm", "layernorm", "rope", "activations", "head_norm_rope", "skinny_gemm")


def clear_launch_plans():
    """Forget every kernel file's launch plans (built from the module's settings when first seen), so a
    setting a test changes applies to the next call."""
    for name in KERNEL_MODULES:
        plans = getattr(sys.modules.get(name), "_PLANS", None)
        if plans is not None:
            plans.clear()


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    clear_launch_plans()
    yield
    clear_launch_plans()

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

# SPDX-License-Identifier: Apache-2.0
"""The test helpers themselves: poisoning must poison, and must not leak into torch's state."""

import subprocess
import sys
from pathlib import Path

import torch

from kernel_testing import poisoned_outputs


def test_poisoned_outputs_fill_nan_and_restore():
    originals = (torch.empty, torch.empty_like, torch.Tensor.new_empty)
    with poisoned_outputs():
        a = torch.empty(4)
        b = torch.empty_like(a)
        c = a.new_empty(3)
        i = torch.empty(2, dtype=torch.int32)
    assert torch.isnan(a).all() and torch.isnan(b).all() and torch.isnan(c).all()
    assert (i == torch.iinfo(torch.int32).max).all()
    assert (torch.empty, torch.empty_like, torch.Tensor.new_empty) == originals


def test_poisoned_outputs_keep_meta_device_working():
    """Inside the patch, `with torch.device(...)` fills torch's cached set of factory functions; it must
    be filled with the real functions, or later `with torch.device("meta")` allocates real memory."""
    code = (
        "import torch\n"
        "from kernel_testing import poisoned_outputs\n"
        "with poisoned_outputs():\n"
        "    with torch.device('meta'):\n"
        "        torch.zeros(1)\n"
        "with torch.device('meta'):\n"
        "    t = torch.empty(10)\n"
        "assert t.device.type == 'meta', t.device\n"
    )
    tests_dir = str(Path(__file__).resolve().parent)
    r = subprocess.run([sys.executable, "-c", code], cwd=tests_dir, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]

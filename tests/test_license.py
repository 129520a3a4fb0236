# SPDX-License-Identifier: Apache-2.0
"""The project's license: LICENSE at the root holds the Apache License 2.0 text, and every Python file
under scripts/ and tests/ (files meant to be copied into other projects on their own) carries an SPDX
line within its first two lines (the second when the first is a shebang)."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LICENSE = ROOT / "LICENSE"
SPDX = "# SPDX-License-Identifier: Apache-2.0"
PY_FILES = sorted((ROOT / "scripts").glob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
APACHE_PHRASES = [
    "Apache License",
    "Version 2.0, January 2004",
    "http://www.apache.org/licenses/",
    "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION",
    "Grant of Patent License",
    '"Derivative Works" shall mean',
    'on an "AS IS" BASIS',
    "END OF TERMS AND CONDITIONS",
]


def test_license_file_is_apache_2():
    assert LICENSE.is_file(), "LICENSE is missing at the repository root"
    text = " ".join(LICENSE.read_text().split())
    missing = [p for p in APACHE_PHRASES if p not in text]
    assert not missing, f"LICENSE is not the Apache License 2.0 text; missing: {missing}"


def test_there_are_files_to_check():
    assert any(p.parent.name == "scripts" for p in PY_FILES) and any(p.parent.name == "tests" for p in PY_FILES)


@pytest.mark.parametrize("path", PY_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_spdx_line(path):
    head = path.read_text().splitlines()[:2]
    assert SPDX in (line.strip() for line in head), f"{path.relative_to(ROOT)} lacks '{SPDX}' in its first two lines"

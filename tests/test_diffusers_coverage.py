# SPDX-License-Identifier: Apache-2.0
"""The coverage command (scripts/diffusers_coverage.py): every transformer class of the installed diffusers,
built on the meta device, gets kernels for its norm / tanh-GELU sites and loses them on removal; the table in
references/diffusers-coverage.md is what a fresh run prints (with the diffusers it names), and coverage never
drops below it. A failure names the diffusers and torch versions it ran with."""

import re
from pathlib import Path

import pytest

import diffusers_coverage as dc
from kernel_testing import once_per_run

TABLE = Path(__file__).resolve().parents[1] / "references" / "diffusers-coverage.md"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    return once_per_run(tmp_path_factory, "diffusers_coverage_report", dc.report)


def _committed():
    text = TABLE.read_text()
    m = re.search(
        r"with diffusers (\S+): (\d+) of (\d+) classes that build from their defaults get kernels .*?"
        r"(\d+) of (\d+) norm / tanh-GELU sites",
        text,
    )
    assert m, f"{TABLE} has no generated summary line"
    version, with_kernels, built, covered, sites = m.groups()
    return version, int(with_kernels), int(built), int(covered), int(sites)


@pytest.mark.slow
def test_every_class_gets_kernels_and_loses_them_on_removal(fresh):
    versions = f"diffusers {fresh['diffusers']}, torch {fresh['torch']}"
    assert not fresh["removal_left_something"], f"{versions}: removal left patches in {fresh['removal_left_something']}"
    assert fresh["classes_with_kernels"] >= 0.9 * fresh["classes_built"], (
        f"{versions}: {fresh['classes_with_kernels']} of {fresh['classes_built']} classes get kernels"
    )
    assert fresh["sites_covered"] >= 0.8 * fresh["sites"], (
        f"{versions}: {fresh['sites_covered']} of {fresh['sites']} sites covered"
    )
    nothing = [r["class"] for r in fresh["rows"] if r["status"] == "nothing"]
    assert len(nothing) <= fresh["classes_built"] - fresh["classes_with_kernels"], nothing


@pytest.mark.slow
def test_committed_table_is_current_and_coverage_does_not_drop(fresh):
    version, with_kernels, built, covered, sites = _committed()
    versions = f"diffusers {fresh['diffusers']} (table: {version}), torch {fresh['torch']}"
    if fresh["diffusers"] == version:  # the same diffusers: the table is exactly a fresh run
        assert dc.markdown(fresh) in TABLE.read_text(), (
            f"{versions}: {TABLE.name} is stale; run python scripts/diffusers_coverage.py --write {TABLE}"
        )
    # any diffusers (CI installs the newest): no class and no share of sites lost against the table
    assert fresh["classes_with_kernels"] / fresh["classes_built"] >= with_kernels / built, (
        f"{versions}: {fresh['classes_with_kernels']} of {fresh['classes_built']} classes get kernels, the table "
        f"{with_kernels} of {built}: {[r['class'] for r in fresh['rows'] if r['status'] == 'nothing']}"
    )
    assert fresh["sites_covered"] / fresh["sites"] >= covered / sites - 1e-9, (
        f"{versions}: {fresh['sites_covered']} of {fresh['sites']} sites covered, the table {covered} of {sites}"
    )


def test_command_line(capsys):
    assert dc.main(["--classes", "ZImageTransformer2DModel", "--markdown"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| ZImageTransformer2DModel |"))
    taken_by, share = row.split("|")[2:4]
    covered, sites = (int(n) for n in share.split("/"))
    assert taken_by.strip() == "generic" and covered == sites > 0, row
    with pytest.raises(SystemExit):
        dc.main(["--classes", "NotAModel"])
    assert "not transformer classes" in capsys.readouterr().err

# SPDX-License-Identifier: Apache-2.0
"""The index of examples/ (scripts/examples_index.py): examples/README.md is exactly what a fresh --write gives,
every record has its line, a record without a date or a command says why in its notes, and records of kinds the
script does not know, or that do not parse, still get a line instead of an error."""

import json
from pathlib import Path

import examples_index as ei

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def test_readme_is_a_fresh_write():
    fresh = ei.render(EXAMPLES)
    assert (EXAMPLES / "README.md").read_text() == fresh, (
        "examples/README.md differs from the records; run python scripts/examples_index.py --write"
    )


def test_every_record_has_one_line_and_every_file_is_accounted_for():
    text = (EXAMPLES / "README.md").read_text()
    for p in sorted(EXAMPLES.glob("*.json")):
        assert text.count(f"| [{p.name}]({p.name})") == 1, p.name
    assert ei.other_files(EXAMPLES) == [], "examples/ holds files that are neither a record nor the plot of one"


def test_records_without_date_or_command_explain_it_in_notes():
    for name, what in ei.missing(ei.entries(EXAMPLES)):
        d = json.loads((EXAMPLES / name).read_text())
        assert d.get("notes"), f"{name} has no {what} and no notes saying why"


def _write(folder, name, obj):
    (folder / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


def test_headlines_per_kind_and_robust_to_unknown_layouts(tmp_path):
    e2e = {
        "benchmark": "benchmark_e2e.py",
        "date": "2026-01-02T03:04:05+00:00",
        "command": "python scripts/benchmark_e2e.py --model sd3 --output-json /tmp/x.json",
        "device": "GPU X",
        "versions": {"torch": "9.9", "triton": "9.8"},
        "config": {"model": "sd3", "variant": "sd3.5-medium", "tokens": 4096, "batch": 2, "rounds": 1},
        "results": {"baseline": {"forward_ms": {"median": 80.0}}, "triton": {"forward_ms": {"median": 40.0}}},
    }
    kernels = {
        "device": {"gpu": "GPU X", "arch": "sm_90", "date": "2026-01-02 03:04 UTC"},
        "command": "scripts/benchmark_kernels.py --suite ltx",
        "records": [
            {"kernel": "a", "shape": "S=1", "provider": "triton", "suite": "ltx", "pct_copy_graph": 90.0},
            {"kernel": "b", "shape": "S=1", "provider": "triton", "suite": "ltx", "pct_copy_graph": 80.0},
            {"kernel": "a", "shape": "S=1", "provider": "eager", "suite": "ltx", "pct_copy_graph": 10.0},
        ],
    }
    _write(tmp_path, "e2e.json", e2e)
    _write(tmp_path, "k.json", kernels)
    _write(tmp_path, "k.png", "not really a png")
    _write(tmp_path, "odd.json", {"speed": {"x": 1}, "score": 3, "date": "2026-01-02"})
    _write(tmp_path, "odd_e2e.json", {"benchmark": "benchmark_e2e.py", "results": "not a dict", "command": "c"})
    _write(tmp_path, "list.json", [1, 2])
    _write(tmp_path, "broken.json", "{not json")
    _write(tmp_path, "stray.log", "x")
    rows = {e["file"]: e for e in ei.entries(tmp_path)}
    assert set(rows) == {"e2e.json", "k.json", "odd.json", "odd_e2e.json", "list.json", "broken.json"}
    assert rows["e2e.json"]["headline"] == "median forward: baseline 80.0, triton 40.0; baseline / triton 2.00x"
    assert (
        rows["e2e.json"]["when"] == "2026-01-02 03:04" and rows["e2e.json"]["where"] == "GPU X, torch 9.9, triton 9.8"
    )
    assert rows["k.json"]["headline"] == "2 cases of the bundle's kernels; median 85.0 % of copy (CUDA graphs)"
    assert rows["k.json"]["plot"] == "k.png"
    assert rows["odd.json"]["headline"] == "top-level keys: speed, score" and rows["odd.json"]["group"] == "other"
    assert rows["odd_e2e.json"]["headline"] == "median forward: no timed mode"
    assert rows["broken.json"]["what"] == "does not parse as JSON"
    assert ei.other_files(tmp_path) == ["stray.log"]
    assert ei.missing(list(rows.values())) == [
        ("broken.json", "date and command"),
        ("list.json", "date and command"),
        ("odd.json", "command"),
        ("odd_e2e.json", "date"),
    ]
    text = ei.render(tmp_path)
    assert "`python scripts/benchmark_e2e.py --model sd3 --output-json ...`" in text  # output paths hidden
    assert "[stray.log](stray.log): not a record" in text


def test_write_then_check(tmp_path, capsys):
    _write(tmp_path, "r.json", {"benchmark": "x", "date": "2026-01-01", "command": "c", "results": {"a": 1}})
    assert ei.main(["--examples", str(tmp_path), "--check"]) == 1  # no README yet
    assert ei.main(["--examples", str(tmp_path), "--write"]) == 0
    assert ei.main(["--examples", str(tmp_path), "--check"]) == 0
    _write(tmp_path, "s.json", {"benchmark": "y", "date": "2026-01-01", "command": "c"})
    assert ei.main(["--examples", str(tmp_path), "--check"]) == 1  # a new record makes the index stale
    assert "rerun python scripts/examples_index.py --write" in capsys.readouterr().err

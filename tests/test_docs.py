# SPDX-License-Identifier: Apache-2.0
"""Keep the guidance honest: SKILL.md's frontmatter, links and paths that resolve, Python blocks that
parse (and SKILL.md's usage example that runs), and every script's --help."""

import ast
import os
import re
from pathlib import Path

import pytest
import yaml

from forked_python import HEAVY, run_python_forked

ROOT = Path(__file__).resolve().parents[1]
SKILL = ROOT / "SKILL.md"
SKILL_NAME = "rocm-triton-kernels"
MARKDOWN = sorted(
    p
    for p in ROOT.rglob("*.md")
    if not any(part.startswith(".") or part in ("node_modules",) for part in p.relative_to(ROOT).parts)
)
SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
KEYWORDS = [
    "ROCm",
    "AMD",
    "MI355X",
    "MI300X",
    "R9700",
    "gfx950",
    "gfx942",
    "gfx1201",
    "Triton",
    "RMSNorm",
    "RoPE",
    "GEGLU",
    "AdaLN",
    "FP8",
    "diffusers",
    "LTX-Video",
    "transformers",
]


def _frontmatter(text):
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m, "SKILL.md must start with a YAML frontmatter block between --- lines"
    return yaml.safe_load(m.group(1))


def test_skill_frontmatter():
    meta = _frontmatter(SKILL.read_text())
    assert set(meta) >= {"name", "description"}
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", meta["name"]), "name must be kebab-case"
    assert meta["name"] == SKILL_NAME, "name must match the folder the README tells users to install into"
    desc = meta["description"]
    assert isinstance(desc, str) and 50 < len(desc) <= 1024
    first = desc.split()[0].lower()
    assert first not in ("i", "you", "we", "use"), "description must be written in the third person"
    missing = [k for k in KEYWORDS if k.lower() not in desc.lower()]
    assert not missing, f"description lacks the words an agent will see in a task: {missing}"


def test_skill_is_a_router():
    assert len(SKILL.read_text().splitlines()) < 500


def test_readme_names_the_install_folder():
    assert SKILL_NAME in (ROOT / "README.md").read_text()


_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
_PATH = re.compile(r"`((?:scripts|references|examples|tests)/[A-Za-z0-9_./-]+)`")


@pytest.mark.parametrize("md", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_resolve(md):
    text = md.read_text()
    bad = []
    for target in _LINK.findall(text):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (md.parent / target).exists():
            bad.append(target)
    for path in _PATH.findall(text):
        path = path.rstrip(".")
        if "<" in path or "*" in path:
            continue
        if not (ROOT / path).exists():
            bad.append(path)
    assert not bad, f"{md.relative_to(ROOT)} names files that do not exist: {sorted(set(bad))}"


_ANCHOR_LINK = re.compile(r"\]\(([^)\s#]*\.md)?#([^)\s]+)\)")


def _anchors(md):
    """The anchors GitHub gives md's headings: lower case, punctuation dropped, spaces as hyphens, -N for repeats."""
    seen, out = {}, set()
    for line in re.sub(r"```.*?```", "", md.read_text(), flags=re.S).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("md", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_link_anchors_resolve(md):
    """A link to a section names a heading that exists (sections move between pages; links must follow)."""
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)
    bad = []
    for target, anchor in _ANCHOR_LINK.findall(text):
        page = (md.parent / target) if target else md
        if page.exists() and anchor not in _anchors(page):
            bad.append(f"{target}#{anchor}")
    assert not bad, f"{md.relative_to(ROOT)} links to sections that do not exist: {sorted(set(bad))}"


REFERENCES = sorted((ROOT / "references").glob("*.md"))
REFERENCE_MAX_BYTES = 30_000
NO_CONTENTS = {"diffusers-coverage.md": "one generated table, short enough to read whole"}


@pytest.mark.parametrize("md", REFERENCES, ids=lambda p: p.name)
def test_references_are_skimmable(md):
    """A guide an agent reads is at most 30 KB and opens with a short list of its sections."""
    size = md.stat().st_size
    assert size <= REFERENCE_MAX_BYTES, f"{md.name} is {size:,} bytes; split it (at most {REFERENCE_MAX_BYTES:,})"
    if md.name in NO_CONTENTS:
        return
    lines = md.read_text().splitlines()
    first_section = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    contents = [i for i, line in enumerate(lines) if line.strip() in ("## Contents", "Contents")]
    assert contents and contents[0] <= first_section, f"{md.name} must list its sections (Contents) before the first"


def _python_blocks(text):
    return re.findall(r"```python\n(.*?)```", text, re.S)


@pytest.mark.parametrize("md", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_parse(md):
    for i, block in enumerate(_python_blocks(md.read_text())):
        try:
            ast.parse(block)
        except SyntaxError as e:
            raise AssertionError(f"{md.relative_to(ROOT)} python block {i}: {e}") from None


def test_skill_usage_example_runs():
    """The RMSNorm/AdaLN snippet in SKILL.md runs as written (on the CPU through the interpreter, over 13 of its
    1320 tokens a sample: every row is a program of its own either way, at a hundredth of the interpreter's
    time)."""
    blocks = [b for b in _python_blocks(SKILL.read_text()) if "import rmsnorm" in b]
    assert blocks, "SKILL.md should show how to call a kernel"
    code = blocks[0]
    from kernel_testing import DEVICE

    if DEVICE.type == "cpu":
        code = code.replace('device="cuda"', 'device="cpu"')
        assert "torch.randn(2, 1320, 2048," in code, "the snippet's shape changed: update the line below"
        code = code.replace("torch.randn(2, 1320, 2048,", "torch.randn(2, 13, 2048,")
    exec(compile(code, "SKILL.md", "exec"), {})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_help(script):
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    # as `python <script> --help` runs, in a process of its own forked from one that has imported torch, triton,
    # diffusers and transformers already (their import is most of a run's time)
    r = run_python_forked([script, "--help"], preload=HEAVY, env=env, timeout=300)
    assert r.returncode == 0, f"{script.name} --help exited {r.returncode}:\n{r.stderr[-2000:]}"
    assert "usage" in r.stdout.lower()


@pytest.mark.parametrize(
    "script, option",
    [
        ("rmsnorm.py", "--width"),
        ("layernorm.py", "--rows"),
        ("activations.py", "--rows"),
        ("head_norm_rope.py", "--head-dim"),
        ("fp8_linear.py", "--in-features"),
        ("xcd_remap.py", "--num-pids"),
    ],
)
def test_self_check_refuses_a_size_below_one(script, option):
    """A size of 0 is a usage error (exit 2, the option named), not a traceback from inside the check."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = run_python_forked([ROOT / "scripts" / script, option, "0"], preload=HEAVY, env=env, timeout=300)
    assert r.returncode == 2 and f"{option} must be at least 1, got 0" in r.stderr, (r.returncode, r.stderr[-1500:])

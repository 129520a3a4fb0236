# SPDX-License-Identifier: Apache-2.0
"""Keep the blocks of code that the kernel files share identical in every file that holds them.

Each kernel file under scripts/ depends on torch and triton only, so that it can be copied into another
project on its own; the helpers several files need are therefore copied into each of them. A copy is
marked as a block, from its begin line to its end line (both part of the block):

    # ---- shared block NAME begin: ... ----
    ...
    # ---- shared block NAME end ----

and the launch block, marked ``# ---- launch block begin: ...`` / ``# ---- launch block end ----``
(named "launch" here). A file holds the blocks it needs, each at most once. The source of a block is
rmsnorm.py where it holds the block, else the first file (by name) that does.

    python scripts/sync_shared_blocks.py           # copy every block from its source into the other files
    python scripts/sync_shared_blocks.py --check   # exit 1, listing the copies that differ from their source
    python scripts/sync_shared_blocks.py --list    # the blocks, the files holding them and their lengths

To change shared code, edit the block in its source file and run the script (or edit a copy and run it
with --source naming that file). Broken markers (a begin line without its end line, a block held twice
by one file or by one file only) make every mode exit 1 without writing anything.
tests/test_shared_blocks.py runs the check.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
PREFERRED_SOURCE = "rmsnorm.py"
_BEGIN = re.compile(r"^# ---- (?:shared block (?P<name>[A-Za-z0-9_]+)|(?P<launch>launch) block) begin\b.*$")
_END = re.compile(r"^# ---- (?:shared block (?P<name>[A-Za-z0-9_]+)|(?P<launch>launch) block) end ----$")


class Block:
    """One copy of a block: its name, file, 1-based first and last line, and its text (lines with their
    line ends, the marker lines included)."""

    def __init__(self, name: str, path: Path, first: int, last: int, text: str):
        self.name, self.path, self.first, self.last, self.text = name, path, first, last, text

    def __repr__(self):
        return f"Block({self.name!r}, {self.path.name}:{self.first}-{self.last})"


def find_blocks(path: Path, text: str | None = None):
    """The blocks of one file: (dict name -> Block, list of problems with its markers)."""
    lines = (path.read_text() if text is None else text).splitlines(keepends=True)
    blocks, problems, open_name, open_at = {}, [], None, 0
    for i, line in enumerate(lines, 1):
        stripped = line.rstrip("\r\n")
        begin, end = _BEGIN.match(stripped), _END.match(stripped)
        if begin:
            name = begin["name"] or begin["launch"]
            if open_name is not None:
                problems.append(
                    f"{path.name}:{open_at}: block {open_name!r} has no end line before block "
                    f"{name!r} begins (line {i})"
                )
            open_name, open_at = name, i
        elif end:
            name = end["name"] or end["launch"]
            if open_name != name:
                problems.append(
                    f"{path.name}:{i}: end of block {name!r} without its begin line"
                    + (f" (block {open_name!r} is open)" if open_name else "")
                )
                continue
            if name in blocks:
                problems.append(f"{path.name}:{open_at}: block {name!r} held twice (also at line {blocks[name].first})")
            else:
                blocks[name] = Block(name, path, open_at, i, "".join(lines[open_at - 1 : i]))
            open_name = None
    if open_name is not None:
        problems.append(f"{path.name}:{open_at}: block {open_name!r} has no end line")
    return blocks, problems


def block_files(directory: Path = SCRIPTS):
    """The Python files of directory that may hold blocks (this script excepted), sources first."""
    own = Path(__file__).name
    files = [p for p in directory.glob("*.py") if p.name != own]
    return sorted(files, key=lambda p: (p.name != PREFERRED_SOURCE, p.name))


def survey(directory: Path = SCRIPTS, source: str | None = None):
    """(dict name -> [Block, ...] with the source's copy first, problems with markers)."""
    copies, problems = {}, []
    files = block_files(directory)
    if source is not None:
        files.sort(key=lambda p: p.name != source)
    for path in files:
        blocks, file_problems = find_blocks(path)
        problems += file_problems
        for name, block in blocks.items():
            copies.setdefault(name, []).append(block)
    for name, held in copies.items():
        if len(held) == 1:
            problems.append(
                f"{held[0].path.name}:{held[0].first}: block {name!r} is held by this file only (a misspelt marker?)"
            )
    return copies, problems


def differences(copies, names=None):
    """One message (with a short diff) per copy that differs from its source's."""
    out = []
    for name in sorted(copies) if names is None else names:
        if name not in copies:
            out.append(f"block {name!r} is held by no file")
            continue
        source, *others = copies[name]
        for block in others:
            if block.text != source.text:
                diff = difflib.unified_diff(
                    source.text.splitlines(),
                    block.text.splitlines(),
                    f"{source.path.name} (lines {source.first}-{source.last})",
                    f"{block.path.name} (lines {block.first}-{block.last})",
                    lineterm="",
                    n=1,
                )
                shown = list(diff)
                more = len(shown) - 24
                out.append(
                    f"{block.path.name}: block {name!r} differs from {source.path.name}'s\n  "
                    + "\n  ".join(shown[:24])
                    + (f"\n  ... ({more} more diff lines)" if more > 0 else "")
                )
    return out


def sync(copies):
    """Write the source's text of every block into the files whose copy differs; returns the files written."""
    new_text = {}
    for name, (source, *others) in copies.items():
        for block in others:
            if block.text != source.text:
                text = new_text.get(block.path, block.path.read_text())
                # blocks of one file are replaced by text search: each block text occurs in its file once
                assert text.count(block.text) == 1, (block, "occurs more than once")
                new_text[block.path] = text.replace(block.text, source.text)
    for path, text in new_text.items():
        path.write_text(text)
    return sorted(new_text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="write nothing; exit 1 if a copy differs from its source")
    mode.add_argument("--list", action="store_true", help="list the blocks and the files holding them")
    p.add_argument("--dir", type=Path, default=SCRIPTS, help="the folder of the kernel files (default: %(default)s)")
    p.add_argument(
        "--source",
        help="file name (e.g. rope.py) to copy every block it holds from, instead of the "
        f"default ({PREFERRED_SOURCE}, else the first file by name)",
    )
    p.add_argument("--block", action="append", help="only this block (repeatable; default: every block)")
    args = p.parse_args(argv)

    copies, problems = survey(args.dir, args.source)
    if args.block:
        unknown = [b for b in args.block if b not in copies]
        if unknown:
            print(f"no file holds block(s) {unknown}; blocks: {sorted(copies)}", file=sys.stderr)
            return 2
        copies = {name: copies[name] for name in args.block}
    if problems:
        print("markers are broken:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    if args.list:
        for name in sorted(copies):
            held = copies[name]
            print(
                f"{name}: {held[0].last - held[0].first + 1} lines, source {held[0].path.name}; held by "
                + ", ".join(f"{b.path.name}:{b.first}-{b.last}" for b in held)
            )
        return 0
    diffs = differences(copies)
    if args.check:
        if diffs:
            print("\n".join(diffs), file=sys.stderr)
            print(
                f"{len(diffs)} cop{'y differs' if len(diffs) == 1 else 'ies differ'}; "
                "run python scripts/sync_shared_blocks.py to copy the sources",
                file=sys.stderr,
            )
            return 1
        print(f"{len(copies)} blocks, every copy identical")
        return 0
    written = sync(copies)
    print("\n".join(f"wrote {p}" for p in written) if written else "every copy was already identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""What the kernels replace in every transformer model class of the installed diffusers.

Each class diffusers exports whose name contains "Transformer" and ends in "Model" is built from its
default arguments on the meta device (no memory, no weights: seconds for all of them) and handed to
diffusers_injection.inject_optimized_kernels. Its sites are its norm and tanh-GELU modules, counted per
kind by class alone (generic_injection.sites: RMSNorm, LayerNorm / FP32LayerNorm, AdaLayerNorm*, tanh
GELU); a site is covered when it, or a module above it, runs the bundle's forward or attention processor
(generic_injection.covered). Then the kernels are removed, and the class fails if anything is left.

    python scripts/diffusers_coverage.py                     # JSON on stdout: per class and in total
    python scripts/diffusers_coverage.py --markdown          # the table, as references/ holds it
    python scripts/diffusers_coverage.py --write FILE.md     # rewrite the table between FILE's markers
    python scripts/diffusers_coverage.py --check FILE.md     # exit 1 if FILE's table differs from a fresh run
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import re
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402

BEGIN, END = "<!-- diffusers-coverage begin -->", "<!-- diffusers-coverage end -->"
KINDS = ("rmsnorm", "layernorm", "adaln", "gelu_tanh")


def transformer_classes() -> list:
    """Names of the transformer model classes the installed diffusers exports, sorted."""
    import diffusers

    return sorted(n for n in dir(diffusers) if n.endswith("Model") and "Transformer" in n)


def _build(cls):
    from accelerate import init_empty_weights

    with torch.device("meta"), init_empty_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls()


def class_report(name: str) -> dict:
    """Build, inject, count and remove for one class; its row of the report."""
    import diffusers

    import diffusers_injection as di
    import generic_injection as gi
    import injection_common as ic

    try:
        model = _build(getattr(diffusers, name))
    except Exception as e:  # a class that needs arguments: reported as such
        return {"class": name, "status": "does not build from defaults", "error": f"{type(e).__name__}: {e}"[:200]}
    counts = di.inject_optimized_kernels(model, verbose=False)
    site_kinds = gi.sites(model)
    done = gi.covered(model)
    sites, covered = collections.Counter(site_kinds.values()), collections.Counter()
    for m, kind in site_kinds.items():
        covered[kind] += m in done
    families = [name for name, found in _family_finders(di) if any(m is model for m in found(model))]
    di.remove_optimized_kernels(model, verbose=False)
    left = [type(m).__name__ for m in model.modules() if ic.bundle_state(m) is not None or "forward" in m.__dict__]
    n_sites, n_covered = sum(sites.values()), sum(covered.values())
    return {
        "class": name,
        "status": "kernels" if n_covered or any(counts.values()) else "nothing",
        "taken_by": ", ".join(families) if families else ("generic" if any(counts.values()) else ""),
        "sites": n_sites,
        "covered": n_covered,
        "sites_by_kind": {k: sites[k] for k in KINDS if sites[k]},
        "uncovered_by_kind": {k: sites[k] - covered[k] for k in KINDS if sites[k] - covered[k]},
        "counts": {k: v for k, v in counts.items() if v},
        "left_after_removal": left,
    }


def _family_finders(di):
    """(name, find_models) of LTX-Video's family and of every registered family plug-in."""
    yield "ltx", lambda p: di._ltx_models(p)[0]
    for family in di._families():
        yield family.__name__.removesuffix("_injection"), family.find_models


def report(names=None) -> dict:
    """The whole report: versions, one row per class, totals."""
    import diffusers

    logging.disable(logging.WARNING)  # the injections' log lines
    try:
        rows = [class_report(n) for n in (names or transformer_classes())]
    finally:
        logging.disable(logging.NOTSET)
    built = [r for r in rows if r["status"] != "does not build from defaults"]
    return {
        "diffusers": diffusers.__version__,
        "torch": torch.__version__,
        "classes": len(rows),
        "classes_built": len(built),
        "classes_with_kernels": sum(r["status"] == "kernels" for r in built),
        "sites": sum(r["sites"] for r in built),
        "sites_covered": sum(r["covered"] for r in built),
        "removal_left_something": [r["class"] for r in built if r["left_after_removal"]],
        "rows": rows,
    }


def markdown(rep: dict) -> str:
    """The report as the markdown table references/ holds (generated: never edit it by hand)."""
    share = rep["sites_covered"] / max(rep["sites"], 1)
    lines = [
        BEGIN,
        f"Generated by `python scripts/diffusers_coverage.py --write` with diffusers {rep['diffusers']}: "
        f"{rep['classes_with_kernels']} of {rep['classes_built']} classes that build from their defaults get "
        f"kernels ({rep['classes']} exported); {rep['sites_covered']} of {rep['sites']} norm / tanh-GELU sites "
        f"({share:.1%}) run the bundle's code.",
        "",
        "| class | taken by | sites covered | not covered |",
        "|---|---|---|---|",
    ]
    for r in rep["rows"]:
        if r["status"] == "does not build from defaults":
            lines.append(f"| {r['class']} | (does not build from its defaults) | | |")
            continue
        missing = ", ".join(f"{k} {n}" for k, n in r["uncovered_by_kind"].items())
        lines.append(f"| {r['class']} | {r['taken_by'] or 'nothing'} | {r['covered']} / {r['sites']} | {missing} |")
    lines.append(END)
    return "\n".join(lines)


def _replace_table(text: str, table: str, path: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers")
    return pattern.sub(lambda _: table, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Build every transformer model class of the installed diffusers on the meta device, inject the "
        "kernels (diffusers_injection.inject_optimized_kernels), and report per class and in total how many norm / "
        "tanh-GELU sites run the bundle's code; remove the kernels and check that nothing is left. JSON on stdout.",
    )
    p.add_argument("--classes", help="comma-separated class names (default: every transformer class)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--markdown", action="store_true", help="print the markdown table instead of JSON")
    out.add_argument("--write", metavar="FILE", help="rewrite the table between the coverage markers of FILE")
    out.add_argument("--check", metavar="FILE", help="exit 1 if FILE's table differs from a fresh run")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.classes.split(",")] if args.classes else None
    if names:
        unknown = sorted(set(names) - set(transformer_classes()))
        if unknown:
            p.error(f"not transformer classes of this diffusers: {', '.join(unknown)}")
    rep = report(names)
    if args.markdown or args.write or args.check:
        table = markdown(rep)
        if args.markdown:
            print(table)
        else:
            path = args.write or args.check
            text = open(path).read()
            new = _replace_table(text, table, path)
            if args.check:
                if new != text:
                    print(f"{path}: the coverage table differs from a fresh run; rerun with --write", file=sys.stderr)
                    return 1
                print(f"{path}: the coverage table matches")
            else:
                with open(path, "w") as f:
                    f.write(new)
    else:
        print(json.dumps(rep, indent=1))
    return 1 if rep["removal_left_something"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

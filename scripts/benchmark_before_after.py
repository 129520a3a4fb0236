#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Host cost and GPU time of this tree's kernels against an earlier tree's, in one run on one GPU.

For a change to the kernel files or their launch path: is any call slower on the host, or on the GPU?
Both trees are measured by the same harness, this tree's benchmark_kernels.py and
benchmark_launch_overhead.py, copied into a scratch copy of the earlier tree's scripts/ folder: only the
kernel files and what they import differ between the two. Each measurement runs in its own process, in the
order before, after, after, before (host), before, after (GPU), so a drift of the host's speed falls on both.

  host    benchmark_launch_overhead.py per kernel (every case of benchmark_kernels.py at LTX-Video,
          SD3.5 / FLUX.1 and LLM decode shapes): host microseconds of one eager call while the GPU sleeps,
          and the same divided by the process's median F.rms_norm time over all its rows (vs_F_rms_norm, the
          figure compared: it cancels a host that runs faster or slower from one process to the next).
  gpu     every case of benchmark_kernels.py --suite all at the shapes below, provider "triton" and its
          named forms (not the variants that change a module setting: an earlier tree may ignore them):
          checked against its float64 reference, then CUDA-graph replay time (graph_ms: the kernels alone,
          no host) and cold-cache replay time (cold_graph_ms), median of --gpu-rounds rounds.

A row's ratio is after / before (1.0 = the same; above 1 = slower now). ok: every host ratio and every GPU
ratio at most 1 + --tolerance (default 0.05). JSON on stdout (or --output-json), a table on stderr.

    git archive b43c6e3 scripts | tar -x -C /tmp/before
    python scripts/benchmark_before_after.py --before /tmp/before/scripts --output-json examples/benchmark_before_after_h100.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
HARNESS = ("benchmark_kernels.py", "benchmark_launch_overhead.py")
# GPU-time shapes: every LTX and MM-DiT case; decode at one sequence and at a prefill-sized block
GPU_ARGS = ["--suite", "all", "--rows", "1,1024", "--widths", "4096,8192", "--gemm-rows", "1,16"]
GPU_ARGS += ["--gemm-shapes", "8B_o,8B_gate_up"]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="the earlier tree's scripts/ folder (e.g. from git archive)")
    p.add_argument("--host-repeats", type=int, default=15, help="host: timed rounds per case (default 15)")
    p.add_argument("--host-calls", type=int, default=50, help="host: calls per round (default 50)")
    p.add_argument("--gpu-rounds", type=int, default=3, help="gpu: timing rounds per case (default 3)")
    p.add_argument("--tolerance", type=float, default=0.05, help="largest ratio - 1 that is ok (default 0.05)")
    p.add_argument("--only", choices=["host", "gpu"], help="run one of the two comparisons")
    p.add_argument("--output-json", help="write the JSON here (default: stdout)")
    p.add_argument("--gpu-worker", help=argparse.SUPPRESS)  # internal: time the GPU cases of this folder
    args = p.parse_args(argv)
    for name in ("host_repeats", "host_calls", "gpu_rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not args.gpu_worker and not (Path(args.before) / "rmsnorm.py").is_file():
        p.error(f"--before {args.before}: no rmsnorm.py there (give the earlier tree's scripts/ folder)")
    return args


def gpu_worker(folder: str, rounds: int) -> None:
    """In a process of its own: every GPU case's "triton" provider of the harness in `folder` (its kernel
    files are imported from there), JSON rows on stdout."""
    sys.path.insert(0, folder)
    import torch

    import benchmark_kernels as bk

    args = bk.parse_args(GPU_ARGS)
    rows = []
    for name, build, fields, label, graph in bk.work_items(args):
        torch.manual_seed(0)
        case = build()
        # this bundle's providers: "triton" and its named forms, e.g. "triton(cos/sin read)"; not the variants that
        # change a module setting for the call (benchmark_kernels._with_attr): the earlier tree's launch plans may
        # be keyed by the call alone and replay the default setting, which would compare two different things
        case["providers"] = {
            p: f
            for p, f in case["providers"].items()
            if (p == "triton" or p.startswith("triton(")) and not getattr(f, "module_setting", None)
        }
        errs, failures = bk.check_case(name, label, case, args.torch_dtype)
        if not case["providers"] or failures:
            rows.append({"kernel": name, "shape": label, "failures": failures or ["no triton provider"]})
            continue
        for prov, fn in case["providers"].items():
            cold = (case.get("cold_providers") or {}).get(prov)
            recs = [bk.time_provider(fn, True, cold) for _ in range(rounds)]
            row = {"kernel": name, "provider": prov, "shape": label, "max_err_vs_fp64": errs[prov]}
            for key in ("ms", "graph_ms", "cold_graph_ms"):
                vals = [r[key] for r in recs if r.get(key)]
                row[key] = statistics.median(vals) if vals else None
            rows.append(row)
        del case
        torch.cuda.empty_cache()
    print(json.dumps(rows))


# Kernel modules split out of another since earlier trees: module -> the file that held its functions then
MOVED = {"qk_norm_rope": "rope"}


def scratch_tree(earlier: Path, dest: Path) -> Path:
    """A copy of the earlier tree's scripts/ at dest with this tree's harness in it, and a module for each one
    the harness imports that the earlier tree kept in another file (MOVED: it imports that file's names)."""
    shutil.copytree(earlier, dest)
    for name in HARNESS:  # the same harness measures both trees
        shutil.copy(HERE / name, dest / name)
    for name, home in MOVED.items():
        if not (dest / f"{name}.py").exists() and (dest / f"{home}.py").exists():
            (dest / f"{name}.py").write_text(f"from {home} import *  # noqa: F403 (in {home}.py in this tree)\n")
    return dest


def _host(folder: Path, args) -> list:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(folder / "benchmark_launch_overhead.py"), "--repeats", str(args.host_repeats)]
        # its JSON goes to the file; its stdout copy is not wanted here
        subprocess.run(cmd + ["--calls", str(args.host_calls), "--output-json", f.name], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        return json.loads(Path(f.name).read_text())["rows"]


def _gpu(folder: Path, args) -> list:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--before", str(folder)]
    out = subprocess.run(cmd + ["--gpu-worker", str(folder), "--gpu-rounds", str(args.gpu_rounds)], check=True,
                         stdout=subprocess.PIPE, text=True).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def _ratio(a, b):
    return round(b / a, 4) if a and b else None


def compare(runs: dict, tol: float) -> dict:
    """Rows of both trees joined by case, with the after / before ratios."""
    out = {}
    if "host" in runs:
        by = {}
        for tree, lists in runs["host"].items():
            for rows in lists:
                # the process's yardstick: the median of F.rms_norm's time over all its rows (one row's own
                # F.rms_norm figure swings with that moment's host: up to 1.7x in one process on an H100)
                yardstick = statistics.median(
                    r["bundle_us"] / r["vs_F_rms_norm"] for r in rows if r.get("vs_F_rms_norm")
                )
                for r in rows:
                    key = (r["suite"], r["case"], r["provider"], r["shape"])
                    by.setdefault(key, {}).setdefault(tree, []).append(
                        dict(r, vs_F_rms_norm=r["bundle_us"] / yardstick)
                    )
        host = []
        for (suite, case, prov, shape), t in by.items():
            if set(t) != {"before", "after"}:
                continue
            row = {"suite": suite, "case": case, "provider": prov, "shape": shape}
            for tree in ("before", "after"):
                row[f"{tree}_us"] = round(statistics.median(r["bundle_us"] for r in t[tree]), 2)
                row[f"{tree}_vs_F_rms_norm"] = round(statistics.median(r["vs_F_rms_norm"] for r in t[tree]), 3)
            row["ratio"] = _ratio(row["before_vs_F_rms_norm"], row["after_vs_F_rms_norm"])
            row["ratio_us"] = _ratio(row["before_us"], row["after_us"])
            host.append(row)
        out["host"] = host
    if "gpu" in runs and runs["gpu"]["before"] and runs["gpu"]["after"]:

        def ident(r):
            return r["kernel"], r.get("provider", "triton"), r["shape"]

        before = {ident(r): r for r in runs["gpu"]["before"][0]}
        gpu = []
        for r in runs["gpu"]["after"][0]:
            b = before.get(ident(r))
            if b is None:
                continue
            row = {"kernel": r["kernel"], "provider": r.get("provider", "triton"), "shape": r["shape"]}
            if r.get("failures") or b.get("failures"):
                row["failures"] = {"before": b.get("failures"), "after": r.get("failures")}
                gpu.append(row)
                continue
            for key in ("graph_ms", "cold_graph_ms", "ms"):
                row[f"before_{key}"], row[f"after_{key}"] = b[key], r[key]
                row[f"ratio_{key}"] = _ratio(b[key], r[key])
            gpu.append(row)
        out["gpu"] = gpu
    summary = {}
    for part, keys in (("host", ("ratio",)), ("gpu", ("ratio_graph_ms", "ratio_cold_graph_ms"))):
        rows = out.get(part, [])
        vals = [r[k] for r in rows for k in keys if r.get(k) is not None]
        if rows:
            summary[part] = {
                "rows": len(rows),
                "worst_ratio": max(vals, default=None),
                "geomean_ratio": round(statistics.geometric_mean(vals), 4) if vals else None,
                "over_tolerance": sum(v > 1 + tol for v in vals),
                "failures": sum(bool(r.get("failures")) for r in rows),
            }
    out["summary"] = summary
    out["ok"] = bool(summary) and all(s["over_tolerance"] == 0 and s["failures"] == 0 for s in summary.values())
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.gpu_worker:
        gpu_worker(args.gpu_worker, args.gpu_rounds)
        return 0
    import torch
    import triton

    if not torch.cuda.is_available():
        log("no GPU (CUDA or ROCm) found: the comparison needs one")
        return 2

    def document(runs, complete):
        """The record so far; with --output-json also written after every measurement, so that a run cut
        short (a time limit) leaves what it measured, marked "complete": false."""
        doc = {
            "benchmark": "before_after",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python scripts/benchmark_before_after.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name(),
            "versions": {"torch": torch.__version__, "triton": triton.__version__},
            "before": str(args.before),
            "gpu_shapes": " ".join(GPU_ARGS),
            "tolerance": args.tolerance,
            "complete": complete,
            "runs": runs,
            **compare(runs, args.tolerance),
        }
        if args.output_json:
            Path(args.output_json).write_text(json.dumps(doc, indent=1))
        return doc

    with tempfile.TemporaryDirectory() as tmp:
        before = scratch_tree(Path(args.before), Path(tmp) / "scripts")
        trees = {"before": before, "after": HERE}
        runs = {}
        if args.only in (None, "host"):
            runs["host"] = {"before": [], "after": []}
            for tree in ("before", "after", "after", "before"):
                log(f"host: {tree}")
                runs["host"][tree].append(_host(trees[tree], args))
                document(runs, False)
        if args.only in (None, "gpu"):
            runs["gpu"] = {"before": [], "after": []}
            for tree in ("before", "after"):
                log(f"gpu: {tree}")
                runs["gpu"][tree].append(_gpu(trees[tree], args))
                document(runs, False)
    doc = document(runs, True)
    for r in doc.get("host", []):
        log(f"host {r['suite']:6s} {r['case'] + ' ' + r['shape']:60s} {r['before_us']:7.2f} -> {r['after_us']:7.2f} us"
            f"  x{r['ratio']}")  # fmt: skip
    for r in doc.get("gpu", []):
        log(
            f"gpu  {r['kernel'] + ' ' + r['shape']:60s} graph x{r.get('ratio_graph_ms')} cold x{r.get('ratio_cold_graph_ms')}"
        )
    log(json.dumps(doc["summary"]), "ok" if doc["ok"] else "NOT ok")
    if not args.output_json:
        print(json.dumps(doc, indent=1))
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

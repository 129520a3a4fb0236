#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Host cost of launching the kernels: per public kernel (default), or a launch-bound chain.

Per kernel (default): for every kernel case of scripts/benchmark_kernels.py at LTX-Video (25 frames
480x704: [2, 1320, 2048]), SD3.5-medium / FLUX.1-dev (1024x1024) and LLM decode (1 row, width 4096;
skinny GEMM 1 x 4096 x 4096) shapes, the host time of one eager call of this bundle's function and of
the PyTorch op sequence it replaces (the case's "eager" provider, or torch.matmul / torch._scaled_mm),
all in one process, with three yardsticks measured in the same run: F.rms_norm, torch.mul, and an
empty four-argument Triton kernel launched through its JIT. Host time: the GPU is first given a long
torch.cuda._sleep, so the calls only queue work and the host clock measures issuing them; median over
--repeats rounds of --calls calls (a round whose sleep ended before the host finished is rerun with a
longer sleep). The ratios that matter are within one run: host speed differs between machines, and drifts
during a run, so each row times its three calls (the bundle's, the PyTorch ops', F.rms_norm) round by
round in rotating order and divides their medians.

Chain (--chain): one LTX-Video-like residual stream at a small size (default [2, 1320, 2048] bf16):
--chain-calls times the fused gated residual + AdaLN RMSNorm, each call's output feeding the next,
timed with CUDA events (mostly host time at this size), eager and under torch.compile:
  eager                 the public function, which calls the Python launcher directly
  compile custom_op     torch.compile with the ops registered by torch.library.custom_op: the compiled
                        graph calls back into the Python launcher through the dispatcher
  compile triton_op     torch.compile with the torch.library.triton_op twins (the default on GPUs):
                        Inductor launches the Triton kernel from its own generated code
  ... reduce-overhead   the same compiled graphs replayed as CUDA graphs (mode="reduce-overhead")
The outputs are compared with the eager chain's (the same kernel and configuration: they must be equal).

JSON on stdout (or --output-json), a table on stderr; exit 1 if a chain variant's output differs.

    python scripts/benchmark_launch_overhead.py --output-json examples/benchmark_host_cost_h200.json
    python scripts/benchmark_launch_overhead.py --chain --output-json examples/benchmark_launch_overhead_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chain", action="store_true", help="time the launch-bound chain instead of each kernel")
    p.add_argument("--cases", help="per kernel: comma-separated case names to time (default all)")
    p.add_argument("--calls", type=int, default=100, help="per kernel: calls per timed round (default 100)")
    p.add_argument(
        "--repeats",
        type=int,
        default=25,
        help="timed rounds per kernel (default 25) or chain calls per variant with --chain (default 50)",
    )
    p.add_argument("--tokens", type=int, default=1320, help="--chain: tokens per sample (default 1320)")
    p.add_argument("--batch", type=int, default=2, help="--chain: batch (default 2)")
    p.add_argument("--hidden", type=int, default=2048, help="--chain: hidden size (default 2048)")
    p.add_argument(
        "--chain-calls", type=int, default=28, help="--chain: fused norm calls in the chain (default 28: LTX's blocks)"
    )
    p.add_argument("--output-json", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.chain and "--repeats" not in (argv if argv is not None else sys.argv[1:]):
        args.repeats = 50
    for name in ("tokens", "batch", "hidden", "calls", "repeats", "chain_calls"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def _command(argv):
    return "python scripts/benchmark_launch_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])


# --------------------------------------------------------------------------------------------
# Host time per call
# --------------------------------------------------------------------------------------------
def host_us(fn, calls: int, repeats: int):
    """(median host time of one fn() call in microseconds, whether it was measured with the GPU busy).

    The GPU is given a sleep kernel first, so that the calls only queue work and the host clock times
    issuing them: median over `repeats` rounds of `calls` back-to-back calls. A round in which the GPU ran
    dry is rerun with a longer sleep; if it still runs dry after a few doublings (fn waits for the GPU
    itself, e.g. reads a result back), the rounds are kept and the second value is False."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    cycles, times, doublings = 20_000_000, [], 0
    while len(times) < repeats:
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        busy = not torch.cuda.current_stream().query()  # the sleep (and the queued calls) still running
        torch.cuda.synchronize()
        if busy or doublings >= 4:
            times.append((t1 - t0) / calls * 1e6)
        else:
            cycles *= 2  # the GPU ran dry during the round: the host may have waited; sleep longer
            doublings += 1
    return statistics.median(times), doublings < 4


@triton.jit
def _empty_kernel(a, b, c, n):
    pass


def _yardsticks(calls, repeats):
    x = torch.randn(2, 1320, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    fns = {
        "F.rms_norm": lambda: torch.nn.functional.rms_norm(x, (2048,), w, 1e-6),
        "torch.mul": lambda: torch.mul(x, x),
        "empty Triton kernel, 4 arguments, JIT launch": lambda: _empty_kernel[(1,)](x, x, w, 7),
    }
    return {name: round(host_us(fn, calls, repeats)[0], 2) for name, fn in fns.items()}


def _kernel_cases():
    """(suite, case name, shape note, builder) for every kernel case timed per call."""
    import benchmark_kernels as bk

    out = []
    for name, build in bk.CASES.items():
        out.append(("ltx", name, "B=2 S=1320 D=2048", lambda build=build: build(2, 1320, torch.bfloat16)))
    for model in ("sd3", "flux"):
        for name, build in bk.MMDIT_CASES.items():
            out.append((model, name, str(bk.MMDIT_SHAPES[model]), lambda b=build, m=model: b(m, torch.bfloat16)))
    for name, build in bk.DECODE_CASES.items():
        out.append(("decode", name, "M=1 H=4096", lambda build=build: build(1, 4096, torch.bfloat16)))
    n, k = bk.GEMM_SHAPES["8B_o"]
    for name, build in bk.GEMM_CASES.items():
        out.append(("decode", name, f"M=1 N={n} K={k}", lambda build=build: build(1, n, k, torch.bfloat16)))
    return out


TORCH_PROVIDERS = ("eager", "torch.matmul", "torch._scaled_mm")
SKIP_PROVIDERS = ("triton(no evict hint)", "triton(integer FP8)", "triton_kernel")  # benchmark-only variants


def _interleaved(fns: dict, calls: int, repeats: int) -> dict:
    """{name: (median host us per call, GPU kept busy in every round)}, the fns measured round by round in
    rotating order (one round of each, then the next), so that a drift of the host's speed during the run
    reaches all of them alike and their ratios hold."""
    times = {name: [] for name in fns}
    busy = {name: True for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            us, ok = host_us(fns[name], calls, 1)
            times[name].append(us)
            busy[name] &= ok
    return {name: (statistics.median(t), busy[name]) for name, t in times.items()}


def per_kernel(args, argv) -> int:
    import benchmark_kernels as bk

    wanted = set(args.cases.split(",")) if args.cases else None
    bk.COLD_MAX_SETS = 1  # one input set: no copies for cold-cache timing
    yard = _yardsticks(args.calls, args.repeats)
    for name, us in yard.items():
        log(f"{name:60s} {us:8.2f} us")
    xr = torch.randn(2, 1320, 2048, device="cuda", dtype=torch.bfloat16)
    wr = torch.randn(2048, device="cuda", dtype=torch.bfloat16)

    def rms():
        return torch.nn.functional.rms_norm(xr, (2048,), wr, 1e-6)

    rows = []
    for suite, name, shape, build in _kernel_cases():
        if wanted is not None and name not in wanted:
            continue
        case = build()
        providers = case["providers"]
        torch_name = next((p for p in TORCH_PROVIDERS if p in providers), None)
        for prov, fn in providers.items():
            if not prov.startswith("triton") or prov in SKIP_PROVIDERS:
                continue
            fns = {"bundle": fn, "F.rms_norm": rms}
            if torch_name:
                fns["torch"] = providers[torch_name]
            m = _interleaved(fns, args.calls, args.repeats)
            us, busy = round(m["bundle"][0], 2), m["bundle"][1]
            rms_us = round(m["F.rms_norm"][0], 2)
            torch_us, torch_busy = (round(m["torch"][0], 2), m["torch"][1]) if torch_name else (None, None)
            row = {
                "suite": suite,
                "case": name,
                "provider": prov,
                "shape": shape,
                "bundle_us": us,
                "gpu_kept_busy": busy,
                "torch_ops": torch_name,
                "torch_us": torch_us,
                "torch_gpu_kept_busy": torch_busy,
                "F_rms_norm_us": rms_us,
                "vs_torch_ops": round(us / torch_us, 3) if torch_us else None,
                "vs_F_rms_norm": round(us / rms_us, 3),
            }
            rows.append(row)
            log(
                f"{suite:6s} {name + ' ' + prov:52s} {us:8.2f} us   {torch_name or '-'} "
                f"{torch_us if torch_us is not None else float('nan'):8.2f} us   F.rms_norm {rms_us:6.2f} us   "
                f"x{row['vs_F_rms_norm']:.2f}"
            )
        del case
    doc = {
        "benchmark": "host_cost_per_call",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(argv),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
        "timing": "host clock over --calls back-to-back eager calls while the GPU sleeps (no call waits for it); "
        "median of --repeats rounds; microseconds per call. Per row, the bundle's call, the PyTorch ops it "
        "replaces and F.rms_norm are timed round by round in rotating order, and the row's ratios are "
        "of those medians (a drift of host speed during the run cancels out of them)",
        "calls": args.calls,
        "repeats": args.repeats,
        "dtype": "bfloat16",
        "yardsticks_us": yard,
        "rows": rows,
        "worst_vs_F_rms_norm": max((r["vs_F_rms_norm"] for r in rows), default=None),
        "worst_vs_torch_ops": max((r["vs_torch_ops"] for r in rows if r["vs_torch_ops"] is not None), default=None),
    }
    _emit(doc, args.output_json)
    return 0


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Launch-bound chain
# --------------------------------------------------------------------------------------------
# name, torch.library.triton_op (None: eager), torch.compile mode
CHAIN_VARIANTS = (
    ("eager", None, None),
    ("compile custom_op", False, "default"),
    ("compile triton_op", True, "default"),
    ("compile custom_op reduce-overhead", False, "reduce-overhead"),
    ("compile triton_op reduce-overhead", True, "reduce-overhead"),
)


def launch_chain(args, argv) -> int:
    """--chain: the chain of fused norm calls, eager and compiled (CHAIN_VARIANTS), each timed and its output
    compared with the eager chain's."""
    import kernel_runtime
    import rmsnorm

    if not kernel_runtime.TRITON_OP:
        print("error: this PyTorch has no torch.library.triton_op / wrap_triton", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.tokens, args.hidden)
    h = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    emb = torch.randn(args.batch, 1, 3 * args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
    gate, scale, shift = emb.chunk(3, dim=-1)
    chain = _make_chain(rmsnorm, args, gate, scale, shift)

    reference = chain(h, y).clone()
    results, ok = {}, True
    for name, use_triton_op, mode in CHAIN_VARIANTS:
        fn = _variant_fn(rmsnorm, chain, h, y, use_triton_op, mode)
        try:
            out = fn()
            same = torch.equal(out, reference)
            ok &= same
            ms = _cuda_ms(fn, args.repeats)
        finally:
            kernel_runtime.use_triton_op(rmsnorm, True)
            torch._dynamo.reset()
        results[name] = {
            "chain_ms": round(ms, 4),
            "us_per_call": round(ms * 1000 / args.chain_calls, 2),
            "output_equals_eager": same,
        }
        print(
            f"{name:36s} {ms:8.3f} ms per chain  {ms * 1000 / args.chain_calls:7.2f} us per call"
            f"{'' if same else '  OUTPUT DIFFERS'}",
            file=sys.stderr,
            flush=True,
        )
    _emit(_chain_doc(args, argv, shape, h, results, ok), args.output_json)
    return 0 if ok else 1


def _make_chain(rmsnorm, args, gate, scale, shift):
    """chain(h, y): --chain-calls fused gated residual + AdaLN RMSNorm calls, each call's output feeding the next."""

    def chain(h, y):
        for _ in range(args.chain_calls):
            h, y = rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, scale, shift)
        return h

    return chain


def _variant_fn(rmsnorm, chain, h, y, use_triton_op, mode):
    """A call of the chain as the variant runs it: eager (use_triton_op None) or compiled with mode."""
    if use_triton_op is None:

        def fn():
            return chain(h, y)

        return fn
    # which op torch.compile records is read while it traces; the compiled code guards on the
    # flag, so it stays set until this variant is timed (else every call would recompile)
    import kernel_runtime

    kernel_runtime.use_triton_op(rmsnorm, use_triton_op)
    torch._dynamo.reset()
    compiled = torch.compile(chain, mode=mode, dynamic=False)

    def fn(compiled=compiled):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(h, y).clone()  # a CUDA-graph output is overwritten by the next replay

    return fn


def _cuda_ms(fn, repeats: int) -> float:
    """Median time of one fn() call in ms (CUDA events), after 5 untimed calls."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _chain_doc(args, argv, shape, h, results, ok) -> dict:
    """The --chain JSON."""
    # read h, y; write h, out (gate, scale, shift: one row per sample)
    bytes_per_call = 4 * h.numel() * h.element_size()
    return {
        "benchmark": "launch_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": _command(argv),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
        "shape": list(shape),
        "dtype": "bfloat16",
        "calls": args.chain_calls,
        "repeats": args.repeats,
        "bytes_per_call": bytes_per_call,
        "results": results,
        "ok": ok,
    }


def _emit(doc: dict, output_json) -> None:
    """The JSON on stdout, and in output_json when given."""
    text = json.dumps(doc, indent=1)
    print(text)
    if output_json:
        Path(output_json).write_text(text + "\n")


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a GPU (CUDA or ROCm build of PyTorch)", file=sys.stderr)
        return 2
    if not args.chain:
        return per_kernel(args, argv)
    return launch_chain(args, argv)


if __name__ == "__main__":
    sys.exit(main())

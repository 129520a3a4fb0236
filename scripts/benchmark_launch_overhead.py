#!/usr/bin/env python3
"""Host cost of launching the kernels: a launch-bound chain, eager and under torch.compile.

The chain is one LTX-Video-like residual stream at a small size (default [2, 1320, 2048] bf16, the
25-frame 480x704 case): --calls times the fused gated residual + AdaLN RMSNorm
(rmsnorm.gated_residual_rms_norm_modulate), each call's output feeding the next. Each call moves
about 30 MB, a few microseconds of GPU time, so the wall time of the chain is mostly host time:
Python, the dispatcher, Triton's launcher.

Variants:
  eager                 the public function, which calls the Python launcher directly
  compile custom_op     torch.compile with the ops registered by torch.library.custom_op: the compiled
                        graph calls back into the Python launcher through the dispatcher
  compile triton_op     torch.compile with the torch.library.triton_op twins (the default on GPUs):
                        Inductor launches the Triton kernel from its own generated code
  ... reduce-overhead   the same compiled graphs replayed as CUDA graphs (mode="reduce-overhead")

Timing: CUDA events around one chain call, median of --repeats; the outputs are compared with the
eager chain's (all variants run the same kernel with the same configuration, so they must be equal).

JSON on stdout (or --output-json), a table on stderr; exit 1 if a variant's output differs.

    python scripts/benchmark_launch_overhead.py --output-json examples/benchmark_launch_overhead_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1320, help="tokens per sample (default 1320)")
    p.add_argument("--batch", type=int, default=2, help="batch (default 2)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument("--calls", type=int, default=28, help="fused norm calls in the chain (default 28: LTX's blocks)")
    p.add_argument("--repeats", type=int, default=50, help="timed chain calls per variant (default 50)")
    p.add_argument("--output-json", help="also write the JSON here")
    args = p.parse_args(argv)
    for name in ("tokens", "batch", "hidden", "calls", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("error: this benchmark needs a GPU (CUDA or ROCm build of PyTorch)", file=sys.stderr)
        return 2
    import rmsnorm

    if not rmsnorm._TRITON_OP:
        print("error: this PyTorch has no torch.library.triton_op / wrap_triton", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.batch, args.tokens, args.hidden)
    h = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    emb = torch.randn(args.batch, 1, 3 * args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.3
    gate, scale, shift = emb.chunk(3, dim=-1)

    def chain(h, y):
        for _ in range(args.calls):
            h, y = rmsnorm.gated_residual_rms_norm_modulate(h, y, gate, scale, shift)
        return h

    def timed(fn):
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    reference = chain(h, y).clone()
    results, ok = {}, True
    variants = [("eager", None, None), ("compile custom_op", False, "default"), ("compile triton_op", True, "default"),
                ("compile custom_op reduce-overhead", False, "reduce-overhead"),
                ("compile triton_op reduce-overhead", True, "reduce-overhead")]
    for name, use_triton_op, mode in variants:
        if use_triton_op is None:
            def fn():
                return chain(h, y)
        else:
            # which op torch.compile records is read while it traces; the compiled code guards on the
            # flag, so it stays set until this variant is timed (else every call would recompile)
            rmsnorm._TRITON_OP = use_triton_op
            torch._dynamo.reset()
            compiled = torch.compile(chain, mode=mode, dynamic=False)

            def fn(compiled=compiled):
                torch.compiler.cudagraph_mark_step_begin()
                return compiled(h, y).clone()  # a CUDA-graph output is overwritten by the next replay

        try:
            out = fn()
            same = torch.equal(out, reference)
            ok &= same
            ms = timed(fn)
        finally:
            rmsnorm._TRITON_OP = True
            torch._dynamo.reset()
        results[name] = {"chain_ms": round(ms, 4), "us_per_call": round(ms * 1000 / args.calls, 2),
                         "output_equals_eager": same}
        print(f"{name:36s} {ms:8.3f} ms per chain  {ms * 1000 / args.calls:7.2f} us per call"
              f"{'' if same else '  OUTPUT DIFFERS'}", file=sys.stderr, flush=True)
    bytes_per_call = 4 * h.numel() * h.element_size()  # read h, y; write h, out (gate, scale, shift: one row per sample)
    doc = {
        "benchmark": "launch_overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/benchmark_launch_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": __import__("triton").__version__},
        "shape": list(shape), "dtype": "bfloat16", "calls": args.calls, "repeats": args.repeats,
        "bytes_per_call": bytes_per_call,
        "results": results,
        "ok": ok,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Linear + tanh-GELU at a feed-forward's up-projection: the GEMM then this bundle's GELU kernel, against
one torch._addmm_activation call with GELU in the BLAS epilogue (cuBLASLt / hipBLASLt), plus the GEMM
alone, PyTorch's GELU, and torch.compile of both forms. Also prints the injection's check of which GELU
form the library computes (injection_common.probe_gemm_gelu_tanh).

Shapes: [M, 2048] x [2048, 8192] + bias (LTX-Video's feed-forward), M = 12288 (B=2 x 6,144 tokens) and
2640 (B=2 x 1,320 tokens) by default. Timing: triton.testing.do_bench_cudagraph (CUDA/HIP graph replay,
median). Error: largest absolute difference to a float64 GELU-tanh of the float64 GEMM of the same inputs.

JSON on stdout (or --output-json), a table on stderr. Needs a GPU; exits 2 without one, 1 if a fused
result is further from the float64 reference than the two-step result plus one bf16 step.

    python scripts/benchmark_gemm_gelu.py --output-json examples/benchmark_gemm_gelu_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmark_kernels import positive_ints  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _rows(text: str):
    return positive_ints(text, f"expected comma-separated integers, got {text!r}", "rows must be positive")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=_rows, default=[12288, 2640], help="M values (default 12288,2640)")
    ap.add_argument("--in-features", type=int, default=2048, help="K (default 2048)")
    ap.add_argument("--out-features", type=int, default=8192, help="N (default 8192)")
    ap.add_argument("--rep", type=int, default=200, help="do_bench_cudagraph rep in ms (default 200)")
    ap.add_argument("--output-json", help="write the JSON here instead of stdout")
    args = ap.parse_args(argv)
    if args.in_features < 2 or args.out_features < 2:
        ap.error("--in-features and --out-features must be at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        log("needs a GPU (and TRITON_INTERPRET unset)")
        return 2
    import triton
    from triton.testing import do_bench_cudagraph

    import activations
    import injection_common as ic

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    result = {
        "benchmark": "benchmark_gemm_gelu.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/benchmark_gemm_gelu.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(dev),
        "arch": getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}",
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "timing": "do_bench_cudagraph median (us)",
        "form_check": {},
        "results": [],
    }
    for dt in (torch.float16, torch.bfloat16):
        y, z = ic._gemm_gelu_outputs(dev, dt)
        tanh_m, erf_m = ic.gelu_forms_matched(y, z, dt)
        result["form_check"][str(dt).replace("torch.", "")] = {
            "matches_tanh": tanh_m,
            "matches_erf": erf_m,
            "max_abs_diff_tanh": float((y - F.gelu(z, approximate="tanh")).abs().max()),
            "max_abs_diff_erf": float((y - F.gelu(z)).abs().max()),
        }
        log(f"{dt}: matches (tanh, erf) = ({tanh_m}, {erf_m})")
    result["lt_path_expected"] = ic.gemm_gelu_lt_expected(dev)
    result["probe_bf16"] = ic.probe_gemm_gelu_tanh(dev, torch.bfloat16)
    log(f"Lt path expected: {result['lt_path_expected']}; probe (bf16): {result['probe_bf16']}")

    torch.manual_seed(0)
    failed = False
    K, N = args.in_features, args.out_features
    for M in args.rows:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K**-0.5
        b = torch.randn(N, device=dev, dtype=torch.bfloat16) * 0.1
        ref = F.gelu(x.double() @ W.double().t() + b.double(), approximate="tanh")
        eager = lambda: F.gelu(F.linear(x, W, b), approximate="tanh")  # noqa: E731
        fused = lambda: torch._addmm_activation(b, x, W.t(), use_gelu=True)  # noqa: E731
        providers = {
            "linear + F.gelu": eager,
            "linear + triton GELU": lambda: activations.gelu_tanh(F.linear(x, W, b)),
            "linear only": lambda: F.linear(x, W, b),
            "_addmm_activation": fused,
            "compile(linear + F.gelu)": torch.compile(eager),
            "compile(_addmm_activation)": torch.compile(fused),
        }
        errs = {}
        for name, fn in providers.items():
            out = fn()
            err = None if name == "linear only" else float((out.double() - ref).abs().max())
            us = do_bench_cudagraph(fn, rep=args.rep) * 1e3
            errs[name] = err
            result["results"].append(dict(M=M, K=K, N=N, provider=name, us=us, max_abs_err=err))
            log(f"M={M:6d} {name:28s} {us:8.1f} us  max err {err if err is None else f'{err:.3e}'}")
        step = 2.0 ** (torch.log2(ref.abs().max()).floor().item() - 7)  # one bf16 step at the largest output
        if not errs["_addmm_activation"] <= errs["linear + triton GELU"] + step:  # NaN fails too
            log(f"M={M}: the fused result is further from float64 than the two-step one")
            failed = True
        providers = None
        torch.cuda.empty_cache()
    result["ok"] = not failed
    text = json.dumps(result, indent=1)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
        log(f"json: {args.output_json}")
    else:
        print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

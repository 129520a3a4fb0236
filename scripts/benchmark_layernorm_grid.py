#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The grid behind scripts/layernorm.py's persistent form: one program per row block against a fixed
grid of programs that loop over row blocks and prefetch the next one (layernorm._persistent_config).

Two measurements, at SD3.5-medium [2, 4096, 1536], FLUX.1-dev [1, 4096, 3072] and LTX-Video-width
[2, 6144, 2048] rows by default (bf16, one [B, D] scale/shift row per sample, as diffusers' AdaLN
modules produce them):

* ``ab``: every LayerNorm variant (plain, + modulation, + two modulations, gated residual + modulation,
  gated residual + two modulations) with one program per row block, and on the persistent grid with the
  launcher's rule; for the variants that hold more tiles per row also with twice the warps (half the
  programs), twice the programs and half the programs. The launcher uses the grid only where it won
  (layernorm._persistent_variant); this forces it on the others to show why.
* ``sweep``: LayerNorm + modulation over warps x programs per SM, and the launcher's own choice.

Each time is a CUDA/HIP-graph replay median (triton.testing.do_bench_cudagraph). Percentages: of the
copy bandwidth of a 512 MiB buffer (a plain copy_, timed outside a graph), and of an elementwise kernel
(torch.neg) moving the variant's own bytes, timed in the same run. Every configuration's outputs are
checked against a float64 reference first (exit 1 if one is off by more than bf16 rounding allows).

JSON on stdout (or --output-json), a table on stderr. Needs a GPU (exits 2 without one). Use it to
tune _persistent_config on another GPU, e.g. an AMD one, where the rule is untuned.

    python scripts/benchmark_layernorm_grid.py --output-json layernorm_grid.json
    python scripts/benchmark_layernorm_grid.py --only sweep --shapes 2x4096x1536 --warps 1,2,4 --per-sm 8,16,32
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

import kernel_runtime  # noqa: E402
import layernorm  # noqa: E402
from benchmark_kernels import positive_ints  # noqa: E402

_NAMED = {"sd3": (2, 4096, 1536), "flux": (1, 4096, 3072), "ltx": (2, 6144, 2048)}
# tensors of the row shape each variant reads or writes (modulation rows are per sample: negligible)
_PASSES = {"ln": 2, "ln_mod": 2, "dual": 3, "gres_mod": 4, "gres_dual": 5}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _shape(text: str):
    if text in _NAMED:
        return text, _NAMED[text]
    try:
        b, s, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected one of {sorted(_NAMED)} or BxSxD, e.g. 2x4096x1536")
    if min(b, s, d) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: B, S and D must be positive")
    return text, (b, s, d)


def _ints(text: str):
    msg = f"{text!r}: expected comma-separated positive integers"
    return positive_ints(text, msg, msg)


def _parse(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument(
        "--shapes",
        type=_shape,
        nargs="+",
        default=[_shape(k) for k in _NAMED],
        help="row shapes: sd3, flux, ltx or BxSxD (default: sd3 flux ltx)",
    )
    p.add_argument("--only", choices=("ab", "sweep"), help="run one of the two measurements (default: both)")
    p.add_argument("--warps", type=_ints, default=[1, 2, 4, 8], help="sweep: warps per program (default 1,2,4,8)")
    p.add_argument(
        "--per-sm",
        type=_ints,
        default=[4, 8, 12, 16, 24, 32],
        help="sweep: programs per SM / compute unit (default 4,8,12,16,24,32)",
    )
    p.add_argument("--rep", type=int, default=40, help="do_bench_cudagraph rep in ms (default 40)")
    p.add_argument("--output-json", help="also write the JSON to this path")
    args = p.parse_args(argv)
    if args.rep < 1:
        p.error("--rep must be positive")
    bad = [w for w in args.warps if w & (w - 1) or w > 32]
    if bad:
        p.error(f"--warps: {bad} are not powers of two up to 32 (Triton's num_warps)")
    return args


class _Grid:
    """Temporarily replace the launcher's grid choice: None = one program per row block; "rule" = the
    launcher's rule, forced on every variant; or a function (n_blocks, block_m, n, warp_size, sms) ->
    (programs, warps)."""

    def __init__(self, how):
        self.how = how

    def __enter__(self):
        self.saved = (layernorm._PERSISTENT, layernorm._persistent_variant, layernorm._persistent_config)
        layernorm._PERSISTENT = self.how is not None
        layernorm._persistent_variant = lambda *a: True
        if callable(self.how):
            layernorm._persistent_config = self.how
        kernel_runtime.clear_plans(layernorm)  # plans are kept per call signature: plan this variant's calls afresh
        return self

    def __exit__(self, *exc):
        layernorm._PERSISTENT, layernorm._persistent_variant, layernorm._persistent_config = self.saved
        kernel_runtime.clear_plans(layernorm)


def _inputs(b, s, d, device, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g) * scale + offset).to(device=device, dtype=torch.bfloat16)

    x = rnd(b, s, d, scale=2.0, offset=1.0)
    y = rnd(b, s, d)
    c = rnd(b, 6 * d, scale=0.3).chunk(6, dim=1)  # [B, D] views with row stride 6 * D
    return x, y, c


def _variants(x, y, c):
    """name -> (call, refs): refs(outputs) gives the float64 reference of each output. The norm of a
    gated-residual variant is checked against the norm of the h it returned (rounded to bf16, as the
    unfused model normalises it); h itself against x + gate * y in float64."""
    xd, yd = x.double(), y.double()
    cd = [t.double()[:, None] for t in c]

    def ln(t):
        return torch.nn.functional.layer_norm(t, t.shape[-1:], eps=1e-6)

    def mod(t, i):
        return ln(t) * (1 + cd[i]) + cd[i + 1]

    return {
        "ln": (lambda: layernorm.layer_norm(x, eps=1e-6), lambda o: [ln(xd)]),
        "ln_mod": (lambda: layernorm.layer_norm_modulate(x, c[0], c[1]), lambda o: [mod(xd, 0)]),
        "dual": (
            lambda: layernorm.layer_norm_modulate_dual(x, c[0], c[1], c[3], c[4]),
            lambda o: [mod(xd, 0), mod(xd, 3)],
        ),
        "gres_mod": (
            lambda: layernorm.gated_residual_layer_norm_modulate(x, y, c[2], c[0], c[1]),
            lambda o: [xd + cd[2] * yd, mod(o[0].double(), 0)],
        ),
        "gres_dual": (
            lambda: layernorm.gated_residual_layer_norm_modulate_dual(x, y, c[2], c[0], c[1], c[3], c[4]),
            lambda o: [xd + cd[2] * yd, mod(o[0].double(), 0), mod(o[0].double(), 3)],
        ),
    }


def _check(outs, refs) -> float:
    """Largest error in bf16 steps at each reference value (floored at 2**-6): fp32 math and one
    rounding of each output stay within one step; 2 are allowed."""
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    refs = refs(outs)
    if len(outs) != len(refs):
        return float("inf")
    worst = 0.0
    for o, r in zip(outs, refs):
        if o.shape != r.shape:
            return float("inf")
        step = torch.clamp(r.abs(), min=2.0**-6) * 2.0**-7
        err = (o.double() - r).abs() / step
        if not torch.isfinite(err).all():  # NaN or inf: an unwritten or overflowed element
            return float("inf")
        worst = max(worst, err.max().item())
    return worst


def run(args, dev, bench, sms: int, warp_size: int, copy_gbps: float):
    """The measurements on device dev; bench(fn) -> microseconds. Returns (records, failures)."""
    records, failures = [], []

    def record(tag, b, s, d, variant, config, fn, refs, copy_us, extra=None):
        err = _check(fn(), refs)
        if not err <= 2.0:
            failures.append(f"{tag} {variant} {config}: error {err:.2f} bf16 steps")
        us = bench(fn)
        nbytes = _PASSES[variant] * b * s * d * 2
        rec = dict(
            shape=tag,
            B=b,
            S=s,
            D=d,
            variant=variant,
            config=config,
            us=us,
            bytes=nbytes,
            pct_copy=nbytes / (us * 1e3) / copy_gbps * 100,
            pct_same_size_copy=copy_us * _PASSES[variant] / 2 / us * 100,
            max_err_bf16_steps=err,
        )
        rec.update(extra or {})
        records.append(rec)
        log(
            f"{tag:>14} {variant:<10} {config:<34} {us:8.1f} us  {rec['pct_copy']:5.1f} % of copy  "
            f"{rec['pct_same_size_copy']:5.1f} % of same-size copy  err {err:.2f} steps"
        )

    for tag, (b, s, d) in args.shapes:
        x, y, c = _inputs(b, s, d, dev, seed=b * 1_000_003 + s * 7 + d)
        out = torch.empty_like(x)
        copy_us = bench(lambda: torch.neg(x, out=out))  # reads x, writes out: 2 passes
        variants = _variants(x, y, c)
        m = b * s
        block_m = layernorm._launch_config(d, m, warp_size)[0]
        n_blocks = -(-m // block_m)
        rule = layernorm._persistent_config(n_blocks, block_m, d, warp_size, sms)
        if args.only in (None, "ab"):
            for name, (fn, refs) in variants.items():
                configs = [
                    ("one program per row block", None),
                    (
                        f"persistent, rule {rule[0]} x {rule[1]} warps"
                        if rule[0]
                        else "persistent rule: one program per row block",
                        "rule",
                    ),
                ]
                if name in ("dual", "gres_mod", "gres_dual") and rule[0] >= 2:
                    p, w = rule
                    configs += [
                        (f"persistent {p // 2} x {2 * w} warps", lambda *a, p=p, w=w: (p // 2, 2 * w)),
                        (f"persistent {2 * p} x {w} warps", lambda *a, p=p, w=w: (2 * p, w)),
                        (f"persistent {p // 2} x {w} warps", lambda *a, p=p, w=w: (p // 2, w)),
                    ]
                for label, how in configs:
                    with _Grid(how):
                        record(tag, b, s, d, name, label, fn, refs, copy_us)
        if args.only in (None, "sweep"):
            fn, refs = variants["ln_mod"]
            for w in args.warps:
                for per_sm in args.per_sm:
                    with _Grid(lambda *a, p=per_sm * max(sms, 1), w=w: (p, w)):
                        record(
                            tag,
                            b,
                            s,
                            d,
                            "ln_mod",
                            f"sweep {w} warps x {per_sm}/SM",
                            fn,
                            refs,
                            copy_us,
                            dict(warps=w, programs_per_sm=per_sm),
                        )
            record(tag, b, s, d, "ln_mod", "launcher", fn, refs, copy_us)
    return records, failures


def _copy_bandwidth(dev) -> float:
    """GB/s of a 512 MiB bf16 device-to-device copy (read + write counted), timed with plain do_bench as
    benchmark_kernels.py does: inside a CUDA graph the same copy_ became a memcpy node that measured a
    third slower on an H200 (2.77 against 4.14 TB/s), which would put kernels above 100 % of "copy"."""
    from triton.testing import do_bench

    src = torch.randn(256 << 20, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=200, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e6)


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        log("benchmark_layernorm_grid.py needs a GPU (CUDA or ROCm); none is visible")
        return 2
    import triton
    from triton.testing import do_bench_cudagraph

    def bench(fn):
        return do_bench_cudagraph(fn, rep=args.rep, return_mode="median") * 1e3  # us

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sms = layernorm._num_sms(dev)
    warp_size = layernorm._device_target(dev)[2]
    copy_gbps = _copy_bandwidth(dev)
    log(f"{props.name}: {sms} SMs / CUs, warp size {warp_size}, copy {copy_gbps:.0f} GB/s")
    records, failures = run(args, dev, bench, sms, warp_size, copy_gbps)
    result = dict(
        benchmark="benchmark_layernorm_grid.py",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="python scripts/benchmark_layernorm_grid.py " + " ".join(sys.argv[1:] if argv is None else argv),
        device=props.name,
        sms=sms,
        warp_size=warp_size,
        versions=dict(torch=torch.__version__, triton=triton.__version__),
        copy_bandwidth_GBps=copy_gbps,
        timing="do_bench_cudagraph median (us)",
        records=records,
        failures=failures,
        ok=not failures,
    )
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    for f in failures:
        log("FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""LTX-Video with the Triton kernels injected: what is replaced, how fast a denoising step is, and
how close the result stays to the unpatched pipeline.

With a GPU: the LTX-Video checkpoint from the local Hugging Face cache if it is there (offline, no
download), else the real-size transformer (LTXVideoTransformer3DModel() defaults) with random
weights, a small random T5 and a small VAE with the released compression. Defaults: 25 frames
480x704, 8 steps, bf16. Step times are measured with CUDA events. At that size an eager step
waits on the CPU issuing kernels (Python), so the patched pipeline runs in graph mode by default
(inject_optimized_kernels(pipe, graphs=True): the transformer's forward replayed from CUDA graphs;
--no-graphs for eager kernels), and the set-up it costs (inject, first run: compiles and capture) is
reported; one transformer call is also timed replayed from a CUDA graph on each side: the GPU time of
the kernels themselves. The host's speed drifts (on a shared machine
by tens of percent between runs minutes apart), so the timed runs alternate,
--rounds times: unpatched, patched; then patched, unpatched; ...; the speed-up is the ratio of the
pooled medians, with each round's own ratio listed beside it.
Without a GPU (or with --device-free): a tiny random pipeline on the CPU through Triton's
interpreter, 9 frames 32x32, 2 steps, fp32 (a correctness run; its times mean nothing).

Parity (exit status 1 when it fails):
* fp32: max |patched - unpatched| <= 1e-4 * max |unpatched| on the final latents. The kernels do
  the same math in fp32 with a different summation order and one rounding per fused step, which
  moves fp32 results by a few ulps; 1e-4 leaves room for that to grow over the steps.
* fp16/bf16: the unpatched pipeline itself differs from its fp32 run by rounding. The patched
  result must be no further from the fp32 run than 1.5x that distance (relative L2), i.e. the
  kernels may not make the result measurably less accurate than stock half precision.
* After remove_optimized_kernels the pipeline must reproduce the unpatched latents bit for bit.
The JSON summary goes to stdout, diagnostics to stderr.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


SPEEDUP_MEANS = (
    "median denoising-step time of the unpatched pipeline (eager) over the patched one (the kernels, in graph mode "
    "unless --no-graphs: the transformer's forward replayed from CUDA graphs), as a user runs them, pooled over the "
    "alternating rounds: the time from one step's end to the next's on the GPU's clock (transformer call, "
    "guidance, scheduler step), including any time the GPU waits for the host to issue kernels. The CUDA-graph "
    "figures below are one transformer call's GPU time alone (no host time) on each side."
)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-frames", type=int, help="video frames, 8k+1 (GPU default 25, CPU 9)")
    p.add_argument("--height", type=int, help="multiple of 32 (GPU default 480, CPU 32)")
    p.add_argument("--width", type=int, help="multiple of 32 (GPU default 704, CPU 32)")
    p.add_argument("--steps", type=int, help="denoising steps (GPU default 8, CPU 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="GPU default bf16, CPU fp32")
    p.add_argument(
        "--rounds",
        type=int,
        help="timed runs of each pipeline, alternating which goes first (GPU default 3, CPU 1)",
    )
    p.add_argument(
        "--no-graphs",
        action="store_true",
        help="inject without graph mode (default on a GPU: the transformer's forward replayed from CUDA graphs, "
        "scripts/graph_mode.py); the unpatched pipeline is always eager",
    )
    p.add_argument(
        "--device-free",
        action="store_true",
        help="run the tiny CPU pipeline through Triton's interpreter even if a GPU is present",
    )
    args = p.parse_args()
    if args.num_frames is not None and (args.num_frames < 1 or (args.num_frames - 1) % 8):
        p.error(f"--num-frames must be 8k+1 (LTX-Video's temporal compression), got {args.num_frames}")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and (v < 32 or v % 32):
            p.error(f"--{name} must be a positive multiple of 32 (LTX-Video's spatial compression), got {v}")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.steps is not None and args.steps < 2:
        p.error(f"--steps must be at least 2 (diffusers' LTX scheduler fails with fewer), got {args.steps}")
    return args


def load_pipeline(gpu: bool, seed: int):
    """(pipeline in fp32, what its weights are)."""
    import diffusers_injection as di

    if not gpu:
        return di.build_tiny_ltx_pipeline(seed=seed), "tiny random (CPU)"
    return di.load_ltx_pipeline(device="cuda", seed=seed, log=log)


def generate(pipe, args, device, timed=False, record_call=False):
    """Final latents, per-step times in ms (CUDA events on a GPU, host clock on the CPU: the time from one
    step's end to the next's, so the first step, which also holds the pipeline's set-up, is not counted) and,
    with record_call, the keyword arguments of the first transformer call (a hook on the transformer sees them:
    that run's transformer runs eager in graph mode, so it is not a timed run)."""
    ends, first_call = [], {}

    def now():
        if device == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def on_step_end(_pipe, i, t, kw):
        ends.append(now())
        return {}

    def on_call(_module, _args, kwargs):
        first_call.setdefault("kwargs", kwargs)

    hook = pipe.transformer.register_forward_pre_hook(on_call, with_kwargs=True) if record_call else None
    try:
        out = pipe(
            prompt="a red fox runs through a snowy forest, camera follows",
            num_frames=args.num_frames,
            height=args.height,
            width=args.width,
            num_inference_steps=args.steps,
            generator=torch.Generator(device).manual_seed(args.seed),
            output_type="latent",
            callback_on_step_end=on_step_end if timed else None,
            max_sequence_length=min(128, pipe.tokenizer.model_max_length),
        ).frames
    finally:
        if hook is not None:
            hook.remove()
    if device == "cuda":
        torch.cuda.synchronize()
    steps = [(b.elapsed_time(e) if device == "cuda" else 1e3 * (e - b)) for b, e in zip(ends, ends[1:])]
    return out.float(), steps, first_call.get("kwargs")


def cuda_graph_ms(model, kwargs, reps=10):
    """Median GPU time of one transformer call replayed from a CUDA graph: what the kernels cost
    without the CPU time spent issuing them (at ~1.3k tokens an eager step waits on that CPU time)."""
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up outside the graph, as capture requires
                for _ in range(2):
                    model(**kwargs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(**kwargs)
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    except Exception as exc:  # report, do not fail the run: the eager numbers stand on their own
        log(f"CUDA-graph timing failed: {type(exc).__name__}: {exc}")
        return None


def compare(a, b):
    """max abs diff, relative max diff, relative L2 and PSNR (dB, peak = max |b|) of a against b."""
    d = (a - b).double()
    mse = d.pow(2).mean().item()
    peak = b.abs().max().item()
    return {
        "max_abs_diff": d.abs().max().item(),
        "rel_max_diff": d.abs().max().item() / max(peak, 1e-30),
        "rel_l2": (d.norm() / b.double().norm().clamp_min(1e-30)).item(),
        "psnr_db": "inf" if mse == 0 else 10 * math.log10(peak**2 / mse),
    }


def main() -> int:
    args = parse_args()
    gpu = torch.cuda.is_available() and not args.device_free
    if not gpu:
        log("no GPU in use: tiny LTX-Video pipeline on the CPU through Triton's interpreter")
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before the kernel modules are imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
    _fill_defaults(args, gpu)
    sys.path.insert(0, HERE)
    from diffusers.utils import logging as diffusers_logging

    import diffusers_injection as di
    import injection_common as ic

    diffusers_logging.set_verbosity_error()  # no dtype-cast advice in the output

    device = "cuda" if gpu else "cpu"
    dtype = DTYPES[args.dtype]
    pipe, weights = load_pipeline(gpu, args.seed)
    pipe.set_progress_bar_config(disable=True)
    log(f"{weights}; {args.num_frames} frames {args.height}x{args.width}, {args.steps} steps, {args.dtype}")

    ref32 = None
    if dtype != torch.float32:  # the yardstick for half-precision parity
        ref32 = generate(pipe, args, device)[0]
        pipe.to(dtype)
    stock, stock_ms, call, stock_graph_ms, _ = _timed_run(pipe, args, device, gpu)  # warm-up: cuBLAS, allocator

    graphs = gpu and not args.no_graphs
    t0 = time.perf_counter()
    counts = di.inject_optimized_kernels(pipe, graphs=graphs)
    inject_s = time.perf_counter() - t0
    # warm-up: Triton compiles each kernel once (and graph mode captures); the CUDA-graph timing of one call takes
    # the unpatched run's first-call inputs
    patched, patched_ms, _, patched_graph_ms, warm_s = _timed_run(pipe, args, device, gpu, call)
    # whether the timed run's transformer calls were replays (graph mode), and why any ran eager
    replayed = dict(_TIMED_GRAPHS) if graphs else None
    rounds = [(stock_ms, patched_ms)]
    for r in range(1, args.rounds):  # patched first in odd rounds: the kernels stay in across a round's turn
        times = {}
        for side in ("patched", "unpatched") if r % 2 else ("unpatched", "patched"):
            if side == "patched":
                di.inject_optimized_kernels(pipe, verbose=False, graphs=graphs)
            else:
                di.remove_optimized_kernels(pipe, verbose=False)
            if gpu:  # after each switch, as before the first round's timed runs
                _warm_up(pipe, args, device)
            times[side] = generate(pipe, args, device, timed=True)[1]
        rounds.append((times["unpatched"], times["patched"]))

    di.remove_optimized_kernels(pipe, verbose=False)
    restored = generate(pipe, args, device)[0]

    summary = {
        **ic.summary_header(gpu, weights, "diffusers"),
        "dtype": args.dtype,
        "num_frames": args.num_frames,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "seed": args.seed,
        "latent_shape": list(stock.shape),
        "replaced": counts,
        "graph_mode": graphs,
        "graph_stats": replayed,
        "setup_s": {
            "inject": inject_s,
            "first_run": warm_s,
            "what": "wall time of inject_optimized_kernels, and of the patched pipeline's first (2-step) run after it: "
            "Triton compiles, launch plans and, in graph mode, the capture of the transformer's forward",
        },
        "rounds": args.rounds,
        "step_ms": _step_ms(gpu, rounds),
        "transformer_call_cuda_graph_ms": _graph_ms(stock_graph_ms, patched_graph_ms),
        **_verdict(stock, patched, restored, ref32),
    }
    if graphs and not replayed["replays"]:  # graph mode asked for, and no call replayed: the times are eager's
        log(f"FAIL: graph mode replayed no transformer call ({replayed['eager']})")
        summary["ok"] = False
    _report(summary, gpu)
    return 0 if summary["ok"] else 1


def _fill_defaults(args, gpu: bool) -> None:
    """The size, steps and dtype not given on the command line: GPU or CPU defaults."""
    for name, g, c in (
        ("num_frames", 25, 9),
        ("height", 480, 32),
        ("width", 704, 32),
        ("steps", 8, 2),
        ("rounds", 3, 1),
        ("dtype", "bf16", "fp32"),
    ):
        if getattr(args, name) is None:
            setattr(args, name, g if gpu else c)


def _warm_up(pipe, args, device) -> None:
    """A 2-step run: compiles what the next run would, and warms cuBLAS and the allocator."""
    generate(pipe, argparse.Namespace(**{**vars(args), "steps": 2}), device)


_TIMED_GRAPHS: dict = {}  # graph mode's counts over the last timed run (_timed_run)


def _graph_counts(model, before=None):
    """Graph mode's replays and eager calls of model so far (None where it is off), or since `before`."""
    import graph_mode

    if not graph_mode.enabled(model):
        return None
    st = graph_mode.graph_stats(model)
    now = {"graphs": st["graphs"], "replays": st["replays"], "eager": dict(st["eager"])}
    if before is None:
        return now
    eager = {k: v - before["eager"].get(k, 0) for k, v in now["eager"].items()}
    return {**now, "replays": now["replays"] - before["replays"], "eager": {k: v for k, v in eager.items() if v}}


def _timed_run(pipe, args, device, gpu: bool, call=None):
    """On a GPU a 2-step warm-up run first (its wall time is returned: compiles, plans, captures); then a timed
    run. Returns (final latents, step times in ms, the keyword arguments of one transformer call: `call` if
    given, else recorded in an extra untimed run, that call's time replayed from a CUDA graph in ms or None on
    the CPU, the warm-up's seconds or None)."""
    warm_s = None
    if gpu:
        t0 = time.perf_counter()
        _warm_up(pipe, args, device)
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
    before = _graph_counts(pipe.transformer)
    latents, step_ms, _ = generate(pipe, args, device, timed=True)
    _TIMED_GRAPHS.update(_graph_counts(pipe.transformer, before) or {})
    if call is None:
        call = generate(pipe, argparse.Namespace(**{**vars(args), "steps": 2}), device, record_call=True)[2]
    graph_ms = cuda_graph_ms(pipe.transformer, call) if gpu else None
    return latents, step_ms, call, graph_ms, warm_s


def _step_ms(gpu: bool, rounds) -> dict:
    """The summary's "step_ms": median denoising-step times pooled over the rounds ([(unpatched step times,
    patched step times)] per round) and the eager speed-up, overall and per round."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    stock_ms = [t for s, _ in rounds for t in s]
    patched_ms = [t for _, p in rounds for t in p]
    return {
        "clock": "CUDA events, transformer call + guidance + scheduler step"
        if gpu
        else "host clock (interpreter: not a speed measurement)",
        "unpatched_median": med(stock_ms),
        "patched_median": med(patched_ms),
        "speedup": (med(stock_ms) / med(patched_ms)) if gpu and stock_ms and patched_ms else None,
        "speedup_per_round": [med(s) / med(p) for s, p in rounds] if gpu and all(s and p for s, p in rounds) else None,
        "what_speedup_means": SPEEDUP_MEANS if gpu else "nothing: the interpreter's times are not speed",
        "unpatched": stock_ms,
        "patched": patched_ms,
    }


def _graph_ms(stock_graph_ms, patched_graph_ms) -> dict:
    """The summary's "transformer_call_cuda_graph_ms"."""
    return {
        "what": "one transformer call (CFG batch) replayed from a CUDA graph: GPU time without kernel-issue overhead",
        "unpatched": stock_graph_ms,
        "patched": patched_graph_ms,
        "speedup": (stock_graph_ms / patched_graph_ms) if stock_graph_ms and patched_graph_ms else None,
    }


def _verdict(stock, patched, restored, ref32) -> dict:
    """parity, parity_threshold, restored_bit_identical and ok (see the module docstring for the rules)."""
    parity = {"patched_vs_unpatched": compare(patched, stock)}
    if ref32 is None:
        threshold = "rel_max_diff <= 1e-4"
        ok = parity["patched_vs_unpatched"]["rel_max_diff"] <= 1e-4
    else:
        parity["unpatched_vs_fp32"] = compare(stock, ref32)
        parity["patched_vs_fp32"] = compare(patched, ref32)
        threshold = "rel_l2(patched, fp32) <= 1.5 * rel_l2(unpatched, fp32)"
        ok = parity["patched_vs_fp32"]["rel_l2"] <= 1.5 * parity["unpatched_vs_fp32"]["rel_l2"] + 1e-7
    bit_identical = bool(torch.equal(restored, stock))
    ok = bool(ok and bit_identical and torch.isfinite(patched).all())
    return {"parity": parity, "parity_threshold": threshold, "restored_bit_identical": bit_identical, "ok": ok}


def _report(summary: dict, gpu: bool) -> None:
    """The results on stderr, the JSON summary on stdout."""
    graph = summary["transformer_call_cuda_graph_ms"]
    log(
        f"step ms (median): unpatched {summary['step_ms']['unpatched_median']}, patched {summary['step_ms']['patched_median']}"
    )
    if gpu:
        per_round = ", ".join(f"{x:.2f}x" for x in summary["step_ms"]["speedup_per_round"] or [])
        log(f"speedup {summary['step_ms']['speedup']:.2f}x (rounds: {per_round}): {SPEEDUP_MEANS}")
        log(f"transformer call from a CUDA graph, ms: unpatched {graph['unpatched']}, patched {graph['patched']}")
    log(
        f"parity vs unpatched: {summary['parity']['patched_vs_unpatched']}; threshold {summary['parity_threshold']}; "
        f"restored bit-identical: {summary['restored_bit_identical']}"
    )
    print(json.dumps(summary, indent=2))
    if not summary["ok"]:
        log("FAILED: parity or restoration check did not pass")


if __name__ == "__main__":
    sys.exit(main())

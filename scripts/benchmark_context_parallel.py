# SPDX-License-Identifier: Apache-2.0
"""The injected kernels under diffusers context parallelism: the LTX-Video transformer split along
the sequence over several GPUs (Ulysses or ring attention), with and without the kernels.

Launch one process per GPU with torchrun:

    torchrun --nproc-per-node 2 scripts/benchmark_context_parallel.py                  # Ulysses, degree 2
    torchrun --nproc-per-node 2 scripts/benchmark_context_parallel.py --ring-degree 2  # ring attention

What it does, on every rank with the same seed (weights are broadcast from rank 0 as well):
  1. builds the real-size LTX-Video transformer with random weights (--tiny: a 2-block toy model),
     and the inputs of one forward at the latent size of the requested video (B = 2, the guidance
     batch, 128 text tokens);
  2. one float32 forward on one GPU: the accuracy yardstick;
  3. per mode (baseline = diffusers as shipped, triton = inject_optimized_kernels), one GPU: warm-up,
     then --repeats timed forwards (CUDA events) -> the single-GPU time and output;
  4. model.enable_parallelism(ContextParallelConfig(...)), then the same on all ranks, --rounds
     times with the modes interleaved: diffusers splits the tokens (and the RoPE module's outputs)
     over the ranks and gathers the output of proj_out. Each repeat's time is the slowest rank's;
     the median over all rounds is reported, with each round's median (the spread between rounds
     shows how steady the machine was).

Parity: a mode's context-parallel output passes when it is finite and its relative L2 distance to
the float32 output is at most 1.5x the single-GPU baseline's (the rule of benchmark_e2e.py); its
distance to the single-GPU output of the same mode is reported too. Scaling efficiency is
t(1 GPU) / (world size x t(context parallel)).

NCCL's NVLink multicast (NVLS) stays off: this script sets NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 before it starts NCCL.

JSON on rank 0's stdout (and --output-json); progress on stderr; exit status 1 if a parity check
fails on any rank, 2 on bad arguments or launch. Needs one GPU per rank (diffusers 0.42 maps rank
r to accelerator r % device_count and rejects a degree of 1). Without a GPU the ranks run on the CPU
(gloo, --tiny, kernels through Triton's interpreter): a check of the code path, not a measurement.

With a padded prompt (the default inputs), diffusers 0.42.1's own LTX attention processor fails
under Ulysses (huggingface/diffusers#14316): the baseline's error is recorded, and does not change
the exit status; --no-text-mask times the baseline. The injected processors broadcast the mask over
the heads and run either way.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("baseline", "triton")
KNOWN_BASELINE_FAILURE = (
    "diffusers 0.42.1's LTXVideoAttnProcessor copies the prompt mask once per head, and its Ulysses attention "
    "gathers the mask over the tokens but does not shard its head axis, so a padded prompt fails to broadcast "
    "(huggingface/diffusers#14316; fix proposed in #14317). Run with --no-text-mask to time the baseline."
)
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def log(*a, all_ranks: bool = False):
    if all_ranks or _rank() == 0:
        print(f"[rank {_rank()}]", *a, file=sys.stderr, flush=True)


_TINY_SIZES = dict(num_frames=9, height=32, width=32)
_FULL_SIZES = dict(num_frames=121, height=512, width=768)


def _use_tiny(args) -> None:
    """Switch parsed arguments to --tiny (no GPU): the sizes not given on the command line become --tiny's."""
    if not args.tiny:
        args.tiny = True
        for k, v in _TINY_SIZES.items():
            if k not in args.sizes_given:
                setattr(args, k, v)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ulysses-degree",
        type=int,
        help="Ulysses (all-to-all over heads) degree; default: the world size unless --ring-degree is given",
    )
    p.add_argument("--ring-degree", type=int, default=1, help="ring-attention degree (default 1)")
    p.add_argument(
        "--attention-backend",
        help="diffusers attention backend for every attention (model.set_attention_backend), "
        "e.g. _native_cudnn or flash; default: diffusers' default (native SDPA, which supports Ulysses but not ring)",
    )
    p.add_argument("--mode", default="all", help="baseline, triton, a comma-separated list, or all (default)")
    p.add_argument("--num-frames", type=int, default=None, help="video frames, 8k+1 (default 121; --tiny 9)")
    p.add_argument("--height", type=int, default=None, help="multiple of 32 (default 512; --tiny 32)")
    p.add_argument("--width", type=int, default=None, help="multiple of 32 (default 768; --tiny 32)")
    p.add_argument("--repeats", type=int, default=10, help="timed forwards per mode and layout (default 10)")
    p.add_argument(
        "--rounds", type=int, default=3, help="context-parallel timing rounds, modes interleaved (default 3)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed forwards before timing (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="after timing, profile one split forward per mode (rank 0's device time: GEMM / attention / other, "
        "with the NCCL kernels among 'other': their time includes waiting for the other ranks)",
    )
    p.add_argument(
        "--no-text-mask",
        action="store_true",
        help="pass no prompt mask (default: a mask with padding in one sample, as the pipeline passes)",
    )
    p.add_argument(
        "--tiny",
        action="store_true",
        help="2-block toy transformer (a check that the code path works; not a measurement)",
    )
    p.add_argument("--output-json", help="also write rank 0's JSON summary here")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.modes = MODES if args.mode == "all" else tuple(m.strip() for m in args.mode.split(","))
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {list(MODES)} or all")
    for name in ("repeats", "ring_degree", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.ulysses_degree is not None and args.ulysses_degree < 1:
        p.error("--ulysses-degree must be >= 1")
    args.sizes_given = tuple(k for k in _TINY_SIZES if getattr(args, k) is not None)
    defaults = _TINY_SIZES if args.tiny else _FULL_SIZES
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if (args.num_frames - 1) % 8:
        p.error(f"--num-frames must be 8k+1 (LTX-Video's temporal compression), got {args.num_frames}")
    for name in ("height", "width"):
        if getattr(args, name) % 32:
            p.error(f"--{name} must be a multiple of 32 (LTX-Video's spatial compression), got {getattr(args, name)}")
    return args


def check_layout(world: int, ulysses: int, ring: int, heads: int, tokens: int, text_tokens: int) -> str | None:
    """Why this split cannot run (None if it can): diffusers needs ulysses x ring == world size,
    a degree above 1, the heads divisible by the Ulysses degree and every split dim by the world size."""
    if ulysses * ring != world:
        return f"ulysses degree {ulysses} x ring degree {ring} != world size {world}"
    if world < 2:
        return "context parallelism needs at least 2 ranks (launch with torchrun --nproc-per-node N, N >= 2)"
    if heads % ulysses:
        return f"{heads} attention heads are not divisible by the Ulysses degree {ulysses}"
    for what, n in (("latent tokens", tokens), ("text tokens", text_tokens)):
        if n % world:
            return f"{n} {what} are not divisible by the world size {world}: change --num-frames/--height/--width"
    return None


def scaling(t1: float, tcp: float, world: int) -> dict:
    """Speed-up over one GPU and parallel efficiency (1.0 = perfect)."""
    return {"speedup_vs_1gpu": t1 / tcp, "efficiency": t1 / (world * tcp)}


def _median_slowest(per_rank: list[list[float]]) -> dict:
    """Per repeat, the slowest rank's time; then the median and spread of those."""
    slowest = [max(ts) for ts in zip(*per_rank)]
    return {
        "median": statistics.median(slowest),
        "min": min(slowest),
        "max": max(slowest),
        "n": len(slowest),
        "per_rank_median": [statistics.median(ts) for ts in per_rank],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    for k, v in _NO_MULTICAST.items():  # keep NVLink multicast off, whatever the caller's environment says
        if os.environ.get(k, v) != v:
            log(f"overriding {k}={os.environ[k]} with {v} (NVLink multicast stays off)", all_ranks=True)
        os.environ[k] = v
    if "WORLD_SIZE" not in os.environ:
        print(
            "error: launch with torchrun, e.g. torchrun --nproc-per-node 2 scripts/benchmark_context_parallel.py",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # CPU (a test): the kernels through Triton's interpreter
        _use_tiny(args)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if gpu:
        if torch.cuda.device_count() < 1:
            log("error: no GPU visible", all_ranks=True)
            return 2
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
        if torch.accelerator.device_count() == 0:
            # diffusers 0.42.1 places rank r on accelerator r % device_count(): with none it divides by
            # zero. On a CPU-only machine every rank's "accelerator" is the CPU: count it as one.
            torch.accelerator.device_count = lambda: 1
    dist.init_process_group("nccl" if gpu else "gloo")
    try:
        return _run(args, torch, dist, device, gpu, rank, world)
    finally:
        gc.collect()  # drop collective work objects while their process group still exists
        dist.destroy_process_group()


def _run(args, torch, dist, device, gpu, rank, world) -> int:
    sys.path.insert(0, HERE)
    from diffusers import ContextParallelConfig
    from diffusers.utils import logging as diffusers_logging

    import benchmark_e2e as be
    import diffusers_injection as di

    diffusers_logging.set_verbosity_error()
    ulysses = args.ulysses_degree if args.ulysses_degree is not None else max(world // args.ring_degree, 1)
    ring = args.ring_degree

    model, what = _build_model(args, torch, dist, device, di)
    inputs = be.transformer_inputs(model, args, device, torch.float32)
    if args.no_text_mask:
        inputs["encoder_attention_mask"] = None
    tokens, text_tokens = inputs["hidden_states"].shape[1], inputs["encoder_hidden_states"].shape[1]
    why = check_layout(world, ulysses, ring, model.config.num_attention_heads, tokens, text_tokens)
    if why:
        log(f"error: {why}")
        return 2
    log(
        f"{what}; {args.num_frames} frames {args.height}x{args.width} -> {tokens} tokens, B=2; "
        f"world {world}: ulysses {ulysses} x ring {ring}; modes {list(args.modes)}"
    )

    bench = _Bench(args, torch, dist, gpu, be, di, model, inputs)
    dtype = torch.float32 if not gpu else torch.bfloat16
    ref32 = bench.forward()[0]
    bench.cast(dtype)

    results = {m: {} for m in args.modes}
    single = _time_one_gpu(bench, results)
    di.remove_optimized_kernels(model, verbose=False)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    runs = _time_context_parallel(bench, world)
    profiles = _profile_modes(bench, runs)
    failed = _report_context_parallel(bench, runs, results, single, ref32, profiles, world)
    di.remove_optimized_kernels(model, verbose=False)

    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    dist.all_reduce(flag)  # every rank exits with the same status
    ok = flag.item() == 0
    if rank == 0:
        layout = {"world_size": world, "ulysses_degree": ulysses, "ring_degree": ring}
        config = _config(args, tokens, text_tokens, dtype, layout)
        _write_summary(_summary(args, torch, be, gpu, world, what, config, results, ok), args.output_json)
    if not ok:
        log("FAILED: a context-parallel mode failed or diverged (see results.<mode>.context_parallel)")
    return 0 if ok else 1


def _build_model(args, torch, dist, device, di):
    """(the LTX-Video transformer in fp32 with the same random weights on every rank, what it is)."""
    if args.tiny:
        model = di.build_tiny_ltx_pipeline(seed=args.seed).transformer.to(device)
        what = "tiny random LTX-Video transformer (2 blocks, width 32)"
    else:
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = di.LTXVideoTransformer3DModel().float().eval()
        what = "real-size LTX-Video transformer, random weights (no checkpoint)"
    if args.attention_backend:
        model.set_attention_backend(args.attention_backend)  # before injection: the processors carry it over
    with torch.no_grad():  # identical weights on every rank, whatever the device's generator does
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    return model, what


class _Bench:
    """The model and its inputs on this rank: one forward, the switch between modes, and a mode's
    warm-up and timed forwards."""

    def __init__(self, args, torch, dist, gpu, be, di, model, inputs):
        self.args, self.torch, self.dist, self.gpu, self.be, self.di = args, torch, dist, gpu, be, di
        self.model, self.inputs = model, inputs
        self.clock = be.Clock(gpu)

    def forward(self):
        """(output in fp32, time in ms) of one forward."""
        model, inputs, clock = self.model, self.inputs, self.clock
        with self.torch.no_grad():
            a = clock.mark()
            y = model(**inputs)[0]
            b = clock.mark()
        clock.sync()
        return y.float(), clock.ms(a, b)

    def cast(self, dtype):
        """The model and its floating-point inputs but the timestep to dtype."""
        torch = self.torch
        self.model.to(dtype)
        self.inputs = {
            k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v)
            for k, v in self.inputs.items()
        }

    def set_mode(self, mode):
        self.di.remove_optimized_kernels(self.model, verbose=False)
        return self.di.inject_optimized_kernels(self.model, verbose=False) if mode == "triton" else None

    def timed(self, mode, parallel: bool):
        """(injected counts, last output, per-forward times in ms, peak memory in GB or None)."""
        torch = self.torch
        counts = self.set_mode(mode)
        for _ in range(self.args.warmup):
            self.forward()
        if self.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, out = [], None
        for _ in range(self.args.repeats):
            if parallel:
                self.dist.barrier()
            out, ms = self.forward()
            times.append(ms)
        peak = torch.cuda.max_memory_allocated() / 1e9 if self.gpu else None
        return counts, out, times, peak


def _time_one_gpu(bench, results) -> dict:
    """Each mode on this rank alone, into results[mode]; returns each mode's output, the baseline's always."""
    single = {}
    for mode in bench.args.modes:
        counts, out, times, peak = bench.timed(mode, parallel=False)
        single[mode] = out
        results[mode]["injected"] = counts
        results[mode]["one_gpu"] = {"forward_ms": bench.be.stats(times), "peak_memory_gb": peak}
        log(f"1 GPU  {mode:>8}: {statistics.median(times):.2f} ms")
    if "baseline" not in single:  # the parity yardstick is the stock model's distance to float32
        bench.set_mode("baseline")
        single["baseline"] = bench.forward()[0]
    return single


def _time_context_parallel(bench, world) -> dict:
    """Per mode, the split model's per-rank times over all rounds, each round's median, the last output and
    peak memory, or the error that stopped the mode."""
    dist = bench.dist
    runs = {m: {"times": [], "round_medians": []} for m in bench.args.modes}  # per mode: per-rank times over rounds
    for rnd in range(bench.args.rounds):  # modes interleaved, so drifts (clocks, host jitter) hit each alike
        for mode in bench.args.modes:
            if "error" in runs[mode]:
                continue
            try:
                counts, out, times, peak = bench.timed(mode, parallel=True)
            except Exception as exc:  # every rank runs the same shapes, so every rank fails at the same place
                runs[mode]["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                del exc
                # the failed forward may leave collective work objects referenced from its frames:
                # free them now and resynchronise, rather than at interpreter exit after the
                # process group is gone (seen once as an abort of a gloo rank at exit)
                gc.collect()
                dist.barrier()
                continue
            gathered = [None] * world
            dist.all_gather_object(gathered, times)
            runs[mode]["times"] = (
                [a + b for a, b in zip(runs[mode]["times"], gathered)] if runs[mode]["times"] else gathered
            )
            runs[mode]["round_medians"].append(_median_slowest(gathered)["median"])
            runs[mode].update(out=out, peak=peak)
    return runs


def _profile_modes(bench, runs) -> dict:
    """--profile: one split forward per mode that ran; every rank runs it (the collectives need them all)
    and rank 0's numbers are kept."""
    profiles = {}
    if bench.args.profile:
        for mode in bench.args.modes:
            if "error" not in runs[mode]:
                bench.set_mode(mode)
                profiles[mode] = bench.be.profile_forward(bench.model, bench.inputs, bench.gpu)
    return profiles


def _report_context_parallel(bench, runs, results, single, ref32, profiles, world) -> bool:
    """Each mode's context-parallel result into results[mode]["context_parallel"], logged; returns whether
    a mode of this bundle failed or diverged (a baseline failure does not count)."""
    failed = False
    for mode in bench.args.modes:
        run = runs[mode]
        if "error" in run:
            err = run["error"]
            results[mode]["context_parallel"] = {"error": err}
            if mode == "baseline":  # diffusers as shipped: reported, not this script's failure
                results[mode]["context_parallel"]["note"] = (
                    KNOWN_BASELINE_FAILURE if bench.inputs.get("encoder_attention_mask") is not None else None
                )
                log(f"CP x{world} baseline (diffusers as shipped) failed: {err}")
            else:
                failed = True
                log(f"CP x{world} {mode} FAILED: {err}", all_ranks=True)
            continue
        cp = _context_parallel_result(bench, mode, run, results, single, ref32, profiles, world)
        results[mode]["context_parallel"] = cp
        ok = cp["parity"]["ok"]
        failed |= not ok
        log(
            f"CP x{world} {mode:>8}: {cp['forward_ms']['median']:.2f} ms (slowest rank; rounds "
            f"{', '.join(f'{t:.1f}' for t in run['round_medians'])}), efficiency "
            f"{'-' if cp['efficiency'] is None else format(cp['efficiency'], '.2f')}, "
            f"rel-L2 vs 1 GPU {cp['parity']['vs_one_gpu_same_mode']['rel_l2']:.2e}, "
            f"parity {'ok' if ok else 'FAILED'}",
            all_ranks=not ok,
        )
    return failed


def _context_parallel_result(bench, mode, run, results, single, ref32, profiles, world) -> dict:
    """One mode's context-parallel timing, memory per rank, parity and scaling."""
    be = bench.be
    out = run["out"]
    peaks = [None] * world
    bench.dist.all_gather_object(peaks, run["peak"])
    cp = {
        "forward_ms": _median_slowest(run["times"]),
        "round_medians_ms": run["round_medians"],
        "peak_memory_gb_per_rank": peaks,
    }
    finite = bool(bench.torch.isfinite(out).all())
    vs32 = be.distance(out, ref32)
    base32 = be.distance(single["baseline"], ref32)
    ok = finite and vs32["rel_l2"] <= 1.5 * base32["rel_l2"] + 1e-6
    cp["parity"] = {
        "finite": finite,
        "vs_fp32": vs32,
        "vs_one_gpu_same_mode": be.distance(out, single[mode]),
        "one_gpu_baseline_vs_fp32": base32,
        "rule": "finite and rel_l2(cp output, fp32 one-GPU output) <= 1.5 * rel_l2(one-GPU baseline, fp32) + 1e-6",
        "ok": bool(ok),
    }
    if bench.gpu:
        cp.update(scaling(results[mode]["one_gpu"]["forward_ms"]["median"], cp["forward_ms"]["median"], world))
    else:  # the interpreter's times are not speed
        cp.update(speedup_vs_1gpu=None, efficiency=None)
    if mode in profiles:
        cp["profile_rank0"] = profiles[mode]
    return cp


def _config(args, tokens, text_tokens, dtype, layout) -> dict:
    """The summary's "config": sizes, dtype, the split (layout: world_size, ulysses_degree, ring_degree)
    and the timing settings."""
    return {
        "num_frames": args.num_frames,
        "height": args.height,
        "width": args.width,
        "tokens": tokens,
        "text_tokens": text_tokens,
        "text_mask": not args.no_text_mask,
        "batch": 2,
        "dtype": str(dtype).replace("torch.", ""),
        **layout,
        "attention_backend": args.attention_backend or "diffusers default",
        "repeats": args.repeats,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "seed": args.seed,
    }


def _summary(args, torch, be, gpu, world, what, config, results, ok) -> dict:
    """Rank 0's JSON summary."""
    summary = {
        "benchmark": "benchmark_context_parallel.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": f"torchrun --nproc-per-node {world} scripts/benchmark_context_parallel.py " + " ".join(args.argv),
        "device": (
            f"{world} x {torch.cuda.get_device_name()}"
            if gpu
            else f"{world} CPU processes (gloo, Triton interpreter; not a measurement)"
        ),
        "versions": be.versions(),
        "weights": what,
        "config": config,
        "timing": (
            "CUDA events around each forward, after a barrier; per repeat the slowest rank; one GPU: "
            "--repeats forwards; context parallel: --rounds x --repeats, modes interleaved"
        )
        if gpu
        else "host clock",
        "results": results,
        "ok": ok,
    }
    cp_ms = {
        m: r["context_parallel"]["forward_ms"]["median"]
        for m, r in results.items()
        if "forward_ms" in r.get("context_parallel", {})
    }
    if "baseline" in cp_ms and "triton" in cp_ms:
        summary["triton_speedup_vs_baseline_context_parallel"] = cp_ms["baseline"] / cp_ms["triton"] if gpu else None
    return summary


def _write_summary(summary: dict, output_json) -> None:
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if output_json:
        with open(output_json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""End-to-end benchmark: does injecting the kernels make LTX-Video generation faster, against eager
diffusers and against torch.compile, and do the outputs stay the same?

Modes (same prompt, seed, size, frames and steps for each):
  baseline        eager diffusers, as shipped
  triton          eager + inject_optimized_kernels (scripts/diffusers_injection.py)
  compile         torch.compile(transformer)
  triton+compile  the kernels injected, then torch.compile (Inductor launches them: torch.library.triton_op)
  triton+graphs   the kernels injected with graphs=True: the transformer's forward replayed from CUDA graphs
                  (scripts/graph_mode.py; captured at a signature's second call, so its warm-up time is
                  reported like compile's); not part of "all": ask for it with --mode
  triton-fp8      the kernels injected with fp8=True: the transformer blocks' linear layers in FP8
                  (fp8_linear.Fp8Linear: per-channel weight scales, per-token input scales, torch._scaled_mm;
                  diffusers_injection.fp8_parents says which); not part of "all": ask for it with --mode
  triton-fp8+compile  the same, then torch.compile
  torchao-fp8     what a diffusers user picks today: torchao's Float8DynamicActivationFloat8WeightConfig
                  (per-row scales) on the same linear layers, no kernels of this bundle; needs torchao
  torchao-fp8+compile  the same, then torch.compile (torchao's recommended use)

Pipeline mode (default): the LTX-Video pipeline from the local Hugging Face cache when present
(offline), else the real-size transformer with random weights, a small random T5 of the real
width and a small VAE with the released compression (said in the output and the JSON). The
denoising loop is timed per step with device events (transformer call with the guidance batch,
guidance, scheduler step), separately from text encoding and VAE decoding. Each mode runs
--warmup pipeline calls first (their wall time, minus a steady call's, is reported as compile /
warm-up time), then --repeats timed calls; step medians with 20th/80th percentiles.
--transformer-only: one transformer forward (B = 2, the guidance batch) at the latent size of the
requested video, timed --repeats times: for fast iteration.
--rounds R: the whole sequence of modes R times, in alternating order (as given, then reversed, ...),
each round with its own warm-up; the timings of all rounds are pooled per mode (per-round medians and
clocks are listed too). A GPU's clocks drift during a run (in one recorded LTX-Video run they fell
from 1,980 to 1,770-1,815 MHz between the first mode and the later ones), so a mode timed only after
another pays for it; alternating the order spreads that over all modes.
--profile: one transformer forward per mode under torch.profiler (in the last round); device time split into GEMM,
attention and everything else, with the largest "everything else" kernels listed. With a timed
forward (LTX-Video with --transformer-only; SD3, FLUX and Wan always time a forward) also gpu_busy_share: that
device time over the median forward time; well below 1 means the GPU waited on the host for launches.

Parity: a float32 run of the same model (--no-fp32-reference to skip) is the yardstick. A mode
passes when its final latents (and decoded frames) are no further from the float32 result than
1.5x the baseline's distance (relative L2), i.e. not measurably less accurate than stock half
precision; an FP8 mode within 1.25x (what FP8 may cost). Each mode's line on stderr gives its ratio
and limit; PSNR against the baseline is reported too. A mode that fails, or produces non-finite values,
is flagged and the exit status is 1. Tiny random models (--tiny) miss the FP8 limit (ratios of 1.3-2.1x
seen on the CPU), so there a run with an FP8 mode exits 1: it checks that FP8 runs, not its accuracy.
Without the float32 reference the rule is PSNR against the baseline >= --min-psnr dB.

Peak device memory per mode is torch.cuda.max_memory_allocated over the timed calls.
JSON on stdout (and --output-json), progress and diagnostics on stderr, --png for a chart.
Without a GPU (or with --tiny) a tiny random pipeline runs on the CPU through Triton's
interpreter: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# --model wan --variant: diffusers' WanTransformer3DModel configs of released checkpoints (wan_injection.WAN_CONFIGS)
WAN_VARIANTS = ("2.1-t2v-1.3b", "2.1-t2v-14b", "2.2-ti2v-5b")
# --model NAME of scripts/model_zoo.py: released architectures with random weights and their pipelines' inputs
# (tests/test_benchmark_e2e.py checks this list against model_zoo.NAMES)
ZOO_MODELS = ("flux2", "qwen_image", "ltx2", "hunyuan_video15", "z_image", "cogvideox", "sana", "wan_vace")
MODES = ("baseline", "triton", "compile", "triton+compile")
FP8_MODES = ("triton-fp8", "triton-fp8+compile", "torchao-fp8", "torchao-fp8+compile")  # not in "all"
EXTRA_MODES = ("triton+graphs", "triton-fp8+graphs")  # not in "all" either
# What FP8 may cost: an FP8 mode passes when its outputs are no further from the float32 run than this
# times the (bf16) baseline's distance; the kernels' bf16 modes keep 1.5x.
FP8_PARITY_FACTOR = 1.25
PROMPT = "a red fox runs through a snowy forest, camera follows"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_workload_arguments(p)
    _add_timing_arguments(p)
    _add_parity_and_output_arguments(p)
    args = p.parse_args(argv)
    _check_common_args(p, args)
    _check_model_args(p, args)
    return args


def _add_workload_arguments(p):
    """What runs: the model, its variant, the modes and the video size."""
    p.add_argument(
        "--model",
        choices=("ltx", "sd3", "flux", "wan") + ZOO_MODELS,
        default="ltx",
        help="ltx (default); sd3 or flux: one transformer forward at --height x --width (default "
        "1024x1024; SD3 B=2 with guidance, FLUX B=1), real architecture with random weights; wan: one "
        "Wan transformer forward (B=1, as WanPipeline calls it per guidance branch; 512 text tokens) "
        "at --num-frames x --height x --width (default 81 x 480 x 832: 32,760 tokens), random weights "
        "with the fp32 modules from_pretrained keeps; " + ", ".join(ZOO_MODELS) + ": one transformer forward of "
        "the released architecture (scripts/model_zoo.py: its pipeline's inputs at the size it names; --height, "
        "--width and --num-frames do not apply), random weights",
    )
    p.add_argument(
        "--blocks",
        type=int,
        help="model_zoo models: keep this many blocks of each block list (a model whose float32 copy does not fit; "
        "the JSON says so); default all",
    )
    p.add_argument(
        "--variant",
        choices=("sd3.5-medium", "sd3-medium") + WAN_VARIANTS,
        help="--model sd3: sd3.5-medium (default) or sd3-medium; --model wan: "
        + ", ".join(WAN_VARIANTS)
        + f" (default {WAN_VARIANTS[0]})",
    )
    p.add_argument(
        "--mode",
        default="all",
        help="one of %s, or of the FP8 modes %s or the graph modes %s (not in all); a comma-separated list; or all "
        "(default)" % (", ".join(MODES), ", ".join(FP8_MODES), ", ".join(EXTRA_MODES)),
    )
    p.add_argument("--num-frames", type=int, help="video frames, 8k+1 (default 121; CPU 9)")
    p.add_argument("--height", type=int, help="multiple of 32 (default 512; CPU 32)")
    p.add_argument("--width", type=int, help="multiple of 32 (default 768; CPU 32)")
    p.add_argument("--steps", type=int, help="denoising steps per pipeline call (default 4; CPU 2)")


def _add_timing_arguments(p):
    """How it is timed: repeats, warm-up, rounds, seed, dtype, what is timed, profiling, compile, heating."""
    p.add_argument(
        "--repeats", type=int, help="timed pipeline calls, or forwards with --transformer-only (default 3 / 10; CPU 1)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per mode before timing (default 1)")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the modes this many times in alternating order and pool the timings (default 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 (CPU fp32, or bf16 with an FP8 mode)")
    p.add_argument(
        "--transformer-only", action="store_true", help="time one transformer forward instead of the pipeline"
    )
    p.add_argument(
        "--profile", action="store_true", help="split one forward's device time into GEMM / attention / other"
    )
    p.add_argument("--compile-mode", default="default", help="torch.compile mode (default 'default')")
    p.add_argument(
        "--fp8-accumulation",
        choices=["fast", "default"],
        default="fast",
        help="the FP8 modes' GEMM accumulation (fp8_linear.FAST_ACCUMULATION): fast (the bundle's default) or the "
        "BLAS's default, to compare the two (default fast)",
    )
    p.add_argument(
        "--heat-seconds",
        type=float,
        help="untimed baseline calls for this long before the first mode, so every mode runs on a GPU "
        "at its working temperature and clocks (default 20 on a GPU, 0 on the CPU)",
    )


def _add_parity_and_output_arguments(p):
    """The parity rule, the tiny pipeline, and where the results go."""
    p.add_argument("--no-fp32-reference", action="store_true", help="skip the float32 run; parity by PSNR vs baseline")
    p.add_argument(
        "--min-psnr", type=float, default=30.0, help="PSNR floor vs baseline without the fp32 reference (dB)"
    )
    p.add_argument(
        "--tiny", action="store_true", help="tiny random pipeline (on the CPU through the interpreter if no GPU)"
    )
    p.add_argument("--output-json", help="also write the JSON summary here")
    p.add_argument("--png", help="chart of per-step (or per-forward) time per mode, if matplotlib is installed")


def _check_common_args(p, args):
    """Sets args.modes; rejects unknown modes and counts out of range."""
    modes = MODES if args.mode == "all" else tuple(m.strip() for m in args.mode.split(","))
    bad = [m for m in modes if m not in MODES + FP8_MODES + EXTRA_MODES]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {list(MODES + FP8_MODES + EXTRA_MODES)} or all")
    if any(m in FP8_MODES for m in modes) and args.dtype not in (None, "bf16"):
        p.error(f"the FP8 modes replace bf16 linear layers: run them with --dtype bf16, not {args.dtype}")
    if any(m.startswith("torchao") for m in modes):
        try:
            import torchao.quantization  # noqa: F401
        except ImportError as exc:
            p.error(f"the torchao modes need torchao installed (pip install torchao): {exc}")
    args.modes = modes
    if args.heat_seconds is not None and not args.heat_seconds >= 0:
        p.error(f"--heat-seconds must be >= 0, got {args.heat_seconds}")
    for name in ("num_frames", "height", "width", "steps", "repeats", "warmup", "rounds"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "warmup" else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {v}")


def _check_model_args(p, args):
    """Sets the default --variant and, for the models timed by their transformer alone, --transformer-only;
    rejects a variant of another model and sizes the model's compression does not divide."""
    defaults = {"sd3": "sd3.5-medium", "wan": WAN_VARIANTS[0]}
    if args.variant is None:
        args.variant = defaults.get(args.model)
    elif args.model not in defaults or (args.model == "wan") != (args.variant in WAN_VARIANTS):
        p.error(f"--variant {args.variant} does not apply to --model {args.model}")
    if args.blocks is not None and (args.model not in ZOO_MODELS or args.blocks < 1):
        p.error(f"--blocks applies to the model_zoo models ({', '.join(ZOO_MODELS)}) and must be >= 1")
    if args.model in ZOO_MODELS:
        args.transformer_only = True  # time the transformer at the size model_zoo gives its pipeline's inputs
        given = [n for n in ("num_frames", "height", "width") if getattr(args, n) is not None]
        if given:
            p.error(f"--{given[0].replace('_', '-')} does not apply to --model {args.model}: model_zoo fixes its size")
        return
    if args.model == "wan":
        args.transformer_only = True  # the Wan pipeline needs its UMT5 encoder and VAE: time the transformer
        if args.num_frames is not None and (args.num_frames - 1) % 4:
            p.error(f"--num-frames must be 4k+1 (Wan's temporal compression), got {args.num_frames}")
        mult = 32 if args.variant == "2.2-ti2v-5b" else 16  # VAE 16x (Wan 2.2) or 8x, then 2x2 patches
        for name in ("height", "width"):
            v = getattr(args, name)
            if v is not None and v % mult:
                p.error(f"--{name} must be a multiple of {mult} for Wan {args.variant}, got {v}")
        return
    if args.model != "ltx":
        args.transformer_only = True  # the SD3 / FLUX pipelines need CLIP/T5 encoders: time the transformer
        for name in ("height", "width"):
            v = getattr(args, name)
            if v is not None and v % 16:
                p.error(f"--{name} must be a multiple of 16 (VAE 8x, then 2x2 patches), got {v}")
        return
    if args.num_frames is not None and (args.num_frames - 1) % 8:
        p.error(f"--num-frames must be 8k+1 (LTX-Video's temporal compression), got {args.num_frames}")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v is not None and v % 32:
            p.error(f"--{name} must be a multiple of 32 (LTX-Video's spatial compression), got {v}")


# --------------------------------------------------------------------------------------------
# Building the model and its inputs
# --------------------------------------------------------------------------------------------
def load_pipeline(device: str, tiny: bool, seed: int):
    """(pipeline in fp32 on `device`, description of its weights)."""
    import diffusers_injection as di

    if tiny:
        return di.build_tiny_ltx_pipeline(seed=seed).to(device), "tiny random pipeline (2 blocks, width 32)"
    return di.load_ltx_pipeline(device=device, seed=seed, log=log)


def load_wan(args, device):
    """(Wan transformer in fp32 with random weights, its forward's inputs in fp32, description)."""
    import wan_injection as wi

    config = "tiny" if args.tiny else args.variant
    model = wi.build_wan_transformer(config, dtype=torch.float32, device=device, seed=args.seed)
    vae_t, vae_s = 4, (16 if config == "2.2-ti2v-5b" else 8)
    frames, height, width = (args.num_frames - 1) // vae_t + 1, args.height // vae_s, args.width // vae_s
    if args.tiny:
        frames, height, width = 3, 8, 8
    inputs = wi.make_wan_inputs(
        model,
        batch=1,
        frames=frames,
        height=height,
        width=width,
        text_len=7 if args.tiny else 512,
        per_token_timestep=config == "2.2-ti2v-5b",
        dtype=torch.float32,
        device=device,
        seed=args.seed,
    )
    what = f"Wan {config} architecture" if not args.tiny else "tiny Wan"
    return (
        model.eval(),
        inputs,
        f"{what}, random weights (no checkpoint), batch 1, fp32 modules kept as from_pretrained does",
    )


def load_mmdit(args, device):
    """(SD3 or FLUX transformer in fp32 with random weights, its forward's inputs in fp32, description)."""
    import mmdit_injection as mi

    size = "tiny" if args.tiny else "real"
    if args.model == "sd3":
        model = mi.build_sd3_transformer(size, torch.float32, device, variant=args.variant, seed=args.seed)
        what, batch = f"{args.variant} architecture" if size == "real" else "tiny SD3", 2
    else:
        model = mi.build_flux_transformer(size, torch.float32, device, seed=args.seed)
        what, batch = "FLUX.1-dev architecture" if size == "real" else "tiny FLUX", 1
    text_len = None if size == "real" else 8
    inputs = mi.make_mmdit_inputs(model, batch, args.height, args.width, text_len, torch.float32, device, args.seed)
    return model.eval(), inputs, f"{what}, random weights (no checkpoint), batch {batch}"


def load_zoo(args, device):
    """(a model_zoo transformer in fp32 with random weights, its forward's inputs in fp32, description)."""
    import model_zoo as mz

    size = "tiny" if args.tiny else "real"
    model = mz.build(args.model, size, dtype=torch.float32, device=device, seed=args.seed, blocks=args.blocks)
    inputs = mz.inputs(args.model, model, size, dtype=torch.float32, device=device, seed=args.seed)
    what = mz.describe(args.model, size) + (f"; only {args.blocks} blocks of each block list" if args.blocks else "")
    return model.eval(), inputs, f"{what}; random weights (no checkpoint), fp32 modules kept as from_pretrained does"


def cast_like_from_pretrained(model, dtype):
    """model.to(dtype), except the modules named in the class's _keep_in_fp32_modules, which stay fp32: the
    layout from_pretrained(torch_dtype=dtype) gives. Returns model."""
    model.to(dtype)
    keep = set(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    for name, module in model.named_modules():
        if keep.intersection(name.split(".")):
            module.to(torch.float32)
    return model


def transformer_inputs(model, args, device, dtype):
    """Keyword arguments of one LTX transformer forward at the latent size of the requested video,
    B = 2 (the classifier-free-guidance batch), 128 text tokens."""
    cfg = model.config
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    lf, lh, lw = (args.num_frames - 1) // 8 + 1, args.height // 32, args.width // 32
    if args.tiny:
        lf, lh, lw = (args.num_frames - 1) // 4 + 1, args.height // 4, args.width // 4
    tokens = lf * lh * lw
    text = 128 if not args.tiny else 16
    hidden = torch.randn(2, tokens, cfg.in_channels, generator=g)
    enc = torch.randn(2, text, cfg.caption_channels, generator=g) * 0.1
    mask = torch.ones(2, text)
    mask[1, text // 2 :] = 0  # padding in one sample, as a real prompt batch has
    return dict(
        hidden_states=hidden.to(device, dtype),
        encoder_hidden_states=enc.to(device, dtype),
        timestep=torch.tensor([500.0, 500.0], device=device),
        encoder_attention_mask=mask.to(device),
        num_frames=lf,
        height=lh,
        width=lw,
        rope_interpolation_scale=(8 / 25, 32, 32) if not args.tiny else (4 / 25, 4, 4),
        return_dict=False,
    )


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
class Clock:
    """Device events on a GPU; the host clock on the CPU (then the numbers mean nothing)."""

    def __init__(self, gpu: bool):
        self.gpu = gpu

    def mark(self):
        if self.gpu:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.gpu else 1e3 * (b - a)

    def sync(self):
        if self.gpu:
            torch.cuda.synchronize()


def run_pipeline(pipe, transformer, args, clock, capture=None):
    """One pipeline call. Returns (final latents fp32, decoded frames fp32, {text_ms, step_ms[], decode_ms})."""
    marks = {"start": None, "calls": [], "steps": [], "latents": None}

    def pre_hook(_m, _a, kwargs):
        marks["calls"].append(clock.mark())
        if capture is not None and "kwargs" not in capture:
            capture["kwargs"] = kwargs

    def on_step_end(_pipe, i, t, kw):
        marks["steps"].append(clock.mark())
        marks["latents"] = kw["latents"]
        return {}

    hook = transformer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        marks["start"] = clock.mark()
        frames = pipe(
            prompt=PROMPT,
            num_frames=args.num_frames,
            height=args.height,
            width=args.width,
            num_inference_steps=args.steps,
            generator=torch.Generator("cpu").manual_seed(args.seed),
            output_type="pt",
            callback_on_step_end=on_step_end,
            max_sequence_length=min(128, pipe.tokenizer.model_max_length),
        ).frames
        end = clock.mark()
    finally:
        hook.remove()
    clock.sync()
    calls, steps = marks["calls"], marks["steps"]
    times = {
        "text_ms": clock.ms(marks["start"], calls[0]),
        "step_ms": [clock.ms(calls[i], steps[i]) for i in range(len(steps))],
        "decode_ms": clock.ms(steps[-1], end),
    }
    return marks["latents"].float(), frames.float(), times


def run_forward(model, inputs, clock):
    a = clock.mark()
    with torch.no_grad():
        out = model(**inputs)
    b = clock.mark()
    clock.sync()
    out = out if isinstance(out, torch.Tensor) else out[0]  # (sample, ...) or a ModelOutput
    out = torch.stack(out) if isinstance(out, (list, tuple)) else out  # Z-Image: one tensor per sample
    return out.float(), clock.ms(a, b)


def classify_kernel(name: str) -> str:
    n = name.lower()
    if n.startswith(("triton_poi", "triton_red", "triton_per")):
        return "other"  # inductor's pointwise/reduction kernels (named after the ops they fuse, e.g. "..._sdpa_...")
    if any(k in n for k in ("flash", "fmha", "attention", "attn", "sdpa", "mha_")):
        return "attention"
    if any(
        k in n
        for k in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul", "cijk", "_mm_", "tem_fused_mm", "wgmma")
    ):
        return "gemm"
    return "other"


def profile_forward(model, inputs, gpu: bool, top_n: int = 12):
    """Device time of one forward split by kernel class; the biggest 'other' kernels by name."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with torch.no_grad():
        model(**inputs)  # the profiled call is not the first one
        if gpu:
            torch.cuda.synchronize()
        with profile(activities=acts) as prof:
            model(**inputs)
            if gpu:
                torch.cuda.synchronize()
    split = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    by_class, launches = {"gemm": {}, "attention": {}, "other": {}}, 0
    for evt in prof.key_averages():
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = float(getattr(evt, "self_device_time_total", 0.0) or 0.0)
        if us <= 0 or evt.key.startswith("nccl:"):
            continue  # "nccl:all_to_all" etc. annotate the NCCL kernels' span: counting both would count it twice
        cls = classify_kernel(evt.key)
        split[cls] += us / 1e3
        launches += evt.count
        by_class[cls][evt.key] = by_class[cls].get(evt.key, 0.0) + us / 1e3
    total = sum(split.values())

    def top(d, n):
        return {k[:120]: round(v, 3) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]}

    return {
        "device_ms": {k: round(v, 3) for k, v in split.items()},
        "total_device_ms": round(total, 3),
        "share": {k: (round(v / total, 3) if total else None) for k, v in split.items()},
        "kernel_launches": launches,
        "top_other_kernels_ms": top(by_class["other"], top_n),
        "top_gemm_kernels_ms": top(by_class["gemm"], 4),
        "top_attention_kernels_ms": top(by_class["attention"], 4),
    }


# --------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------
def distance(a, b):
    """rel L2 and PSNR (dB, peak = max |b|) of a against b."""
    d = a.double() - b.double()
    mse = d.pow(2).mean().item()
    peak = b.double().abs().max().item()
    return {
        "rel_l2": (d.norm() / b.double().norm().clamp_min(1e-30)).item(),
        "psnr_db": float("inf")
        if mse == 0
        else (10 * math.log10(max(peak, 1e-30) ** 2 / mse) if math.isfinite(mse) else float("-inf")),
    }


def _parity_factor(mode: str) -> float:
    """How much further from the float32 run than the baseline a mode's outputs may be."""
    return FP8_PARITY_FACTOR if "fp8" in mode else 1.5


def _parity_text(mode: str, r: dict, results: dict) -> str:
    """ok / FAILED, with the mode's distance from the float32 run as a multiple of the baseline's."""
    p = r["parity"]
    text = "ok" if p["ok"] else "FAILED"
    base = results.get("baseline", {}).get("parity", {}).get("vs_fp32")
    if not p.get("finite", True):
        return text + " (non-finite output)"
    if mode != "baseline" and base and "vs_fp32" in p and all(base[k]["rel_l2"] > 0 for k in p["vs_fp32"]):
        ratio = max(p["vs_fp32"][k]["rel_l2"] / base[k]["rel_l2"] for k in p["vs_fp32"])
        text += f" ({ratio:.2f}x the baseline's distance from float32; limit {_parity_factor(mode)}x)"
    return text


def judge(outputs: dict, ref32: dict | None, min_psnr: float) -> dict:
    """Per mode: distances to baseline (and fp32), and whether the mode passes."""
    base = outputs.get("baseline")
    verdicts = {}
    for mode, outs in outputs.items():
        v = {"finite": all(bool(torch.isfinite(t).all()) for t in outs.values())}
        if base is not None:
            v["vs_baseline"] = {k: distance(outs[k], base[k]) for k in outs}
        if ref32 is not None:
            v["vs_fp32"] = {k: distance(outs[k], ref32[k]) for k in outs}
        verdicts[mode] = v
    for mode, v in verdicts.items():
        ok = v["finite"]
        if ref32 is not None and base is not None:
            factor = _parity_factor(mode)
            limits = {k: factor * verdicts["baseline"]["vs_fp32"][k]["rel_l2"] + 1e-6 for k in v["vs_fp32"]}
            v["rule"] = f"rel_l2(mode, fp32) <= {factor} * rel_l2(baseline, fp32) + 1e-6, per output"
            ok = ok and all(v["vs_fp32"][k]["rel_l2"] <= limits[k] for k in limits)
        elif base is not None and mode != "baseline":
            v["rule"] = f"PSNR(mode, baseline) >= {min_psnr} dB, per output"
            ok = ok and all(d["psnr_db"] >= min_psnr for d in v["vs_baseline"].values())
        v["ok"] = bool(ok)
    return verdicts


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------
def torchao_fp8(model, di):
    """torchao's FP8 recipe (dynamic per-row activation scales, per-row weight scales) on the bf16 linear
    layers of model's transformer blocks, the layers the bundle's FP8 mode replaces. The original weights
    wait on the CPU meanwhile; returns the function that puts them back (the very same parameters)."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    import fp8_linear

    targets = fp8_linear.eligible_layers(di.fp8_parents(model))
    saved = [(m, m.weight, m.weight.device) for m in targets]
    ids = {id(m) for m in targets}
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    quantize_(model, config, filter_fn=lambda mod, fqn: id(mod) in ids)
    for m, p, _ in saved:
        if m.weight is p:
            raise RuntimeError("torchao's quantize_ left a linear layer's weight as it was")
        p.data = p.data.to("cpu")

    def undo():
        for m, p, device in saved:
            p.data = p.data.to(device)
            m.weight = p

    return undo


_UNDO = []  # how to take the model out of a mode that changed its weights (torchao), run by the next set_mode


def set_mode(mode, holder, base_model, args, di):
    """Put the model in `mode`; returns (callable model, counts of injected kernels)."""
    import torch._dynamo

    while _UNDO:
        _UNDO.pop()()
    di.remove_optimized_kernels(base_model, verbose=False)
    torch._dynamo.reset()
    counts = None
    if mode.startswith("torchao"):
        _UNDO.append(torchao_fp8(base_model, di))
    if "triton" in mode:
        counts = di.inject_optimized_kernels(base_model, verbose=False, fp8="fp8" in mode, graphs="graphs" in mode)
    model = base_model
    if "compile" in mode:
        model = torch.compile(base_model, mode=args.compile_mode, dynamic=False)
    holder(model)
    return model, counts


def _sm_clock():
    """The GPU's current SM clock in MHz right after a mode's timed calls (NVML / AMD SMI through torch),
    or None where torch cannot ask: a drop between modes shows clock drift, not a kernel difference."""
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # no pynvml / amdsmi in this environment
        return None


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def stats(xs):
    return (
        {"median": statistics.median(xs), "p20": percentile(xs, 0.2), "p80": percentile(xs, 0.8), "n": len(xs)}
        if xs
        else None
    )


def bench_mode(mode, args, gpu, clock, pipe, base_model, inputs, di, progress, profile=None):
    """Warm up, time, measure peak memory; returns (result dict, outputs dict, model used)."""

    def holder(m):
        if pipe is not None:
            object.__setattr__(pipe, "transformer", m)  # plain attribute: keep the pipeline's config as is

    model, counts = set_mode(mode, holder, base_model, args, di)
    res = {"injected": counts}
    warm_wall = []
    # graph mode captures at a signature's second transformer call: with single forwards that is the second
    # warm-up call, so that no timed call is the capture (a pipeline call makes a call per step)
    warmup = max(args.warmup, 2) if "graphs" in mode and pipe is None else args.warmup
    for _ in range(warmup):
        t0 = time.perf_counter()
        if pipe is not None:
            run_pipeline(pipe, model, args, clock)
        else:
            run_forward(model, inputs, clock)
        warm_wall.append(time.perf_counter() - t0)
        progress.update(1)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    capture = {}
    steps, texts, decodes, walls, outs = [], [], [], [], None
    replays_before = None
    if "graphs" in mode:
        import graph_mode

        replays_before = graph_mode.graph_stats(base_model)["replays"]
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        if pipe is not None:
            lat, frames, t = run_pipeline(pipe, model, args, clock, capture)
            steps += t["step_ms"]
            texts.append(t["text_ms"])
            decodes.append(t["decode_ms"])
            outs = {"latents": lat, "frames": frames}
        else:
            y, ms = run_forward(model, inputs, clock)
            steps.append(ms)
            outs = {"output": y}
        walls.append(time.perf_counter() - t0)
        progress.update(1)
    if gpu:
        res["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
        res["sm_clock_mhz_after"] = _sm_clock()
    if "graphs" in mode:  # whether the timed calls were replays, and why any ran eager
        import graph_mode

        res["graph_stats"] = graph_mode.graph_stats(base_model)  # (since the mode was set: warm-up included)
        res["graph_stats"]["replays_timed"] = res["graph_stats"]["replays"] - replays_before
    key = "step_ms" if pipe is not None else "forward_ms"
    res[key] = stats(steps)
    res[key + "_all"] = [round(s, 4) for s in steps]
    if pipe is not None:
        res["text_encode_ms"] = stats(texts)
        res["vae_decode_ms"] = stats(decodes)
    steady = statistics.median(walls)
    res["warmup_wall_s"] = [round(w, 3) for w in warm_wall]
    res["warmup_overhead_s"] = round(max(warm_wall) - steady, 3) if warm_wall else None
    res["what_warmup_overhead_is"] = (
        "first call's wall time minus a timed call's: torch.compile / Triton compilation, autotuning, allocator"
    )
    if args.profile if profile is None else profile:
        fwd_inputs = inputs if pipe is None else capture.get("kwargs")
        if fwd_inputs is not None:
            res["profile"] = profile_forward(model, fwd_inputs, gpu)
            if gpu and key == "forward_ms" and res[key]["median"] > 0:
                # well below 1: the GPU idles inside the forward, waiting for the host to launch work
                res["gpu_busy_share"] = round(res["profile"]["total_device_ms"] / res[key]["median"], 3)
                res["what_gpu_busy_share_is"] = (
                    "device time of the profiled forward / median timed forward; "
                    "well below 1 means the forward waits on the host (launches)"
                )
    return res, outs


def merge_rounds(prev: dict, new: dict, transformer_only: bool) -> dict:
    """One mode's results of an earlier round (prev) and of the next (new), pooled: all timings, the
    median of each round, the clock after each round, the highest peak memory; the first round's warm-up
    overhead (compilation happens there); the newer round's everything else (e.g. its profile)."""
    key = "forward_ms" if transformer_only else "step_ms"
    merged = dict(new)
    merged[key + "_all"] = prev[key + "_all"] + new[key + "_all"]
    merged[key] = stats(merged[key + "_all"])
    merged[key + "_round_medians"] = prev.get(key + "_round_medians", [prev[key]["median"]]) + [new[key]["median"]]
    merged["sm_clock_mhz_after_rounds"] = prev.get("sm_clock_mhz_after_rounds", [prev.get("sm_clock_mhz_after")]) + [
        new.get("sm_clock_mhz_after")
    ]
    peaks = [m for m in (prev.get("peak_memory_gb"), new.get("peak_memory_gb")) if m is not None]
    if peaks:
        merged["peak_memory_gb"] = max(peaks)
    merged["warmup_overhead_s"] = prev.get("warmup_overhead_s")
    merged["warmup_wall_s"] = prev.get("warmup_wall_s", []) + new.get("warmup_wall_s", [])
    if "profile" not in merged and "profile" in prev:
        merged["profile"] = prev["profile"]
    if "profile" in merged and transformer_only and merged[key]["median"] > 0 and "gpu_busy_share" in merged:
        merged["gpu_busy_share"] = round(merged["profile"]["total_device_ms"] / merged[key]["median"], 3)
    return merged


def targets(results: dict, transformer_only: bool) -> dict:
    key = "forward_ms" if transformer_only else "step_ms"
    t = {m: r[key]["median"] for m, r in results.items() if r.get(key)}
    out = {}
    if "baseline" in t and "triton" in t:
        out["triton_speedup_vs_baseline"] = t["baseline"] / t["triton"]
        out["triton_at_least_1.5x_baseline"] = out["triton_speedup_vs_baseline"] >= 1.5
    if "compile" in t and "triton" in t:
        out["triton_vs_compile"] = t["compile"] / t["triton"]
        out["triton_at_least_as_fast_as_compile"] = t["triton"] <= t["compile"]
    if "compile" in t and "triton+compile" in t:
        out["triton+compile_speedup_vs_compile"] = t["compile"] / t["triton+compile"]
        out["triton+compile_at_least_1.15x_compile"] = out["triton+compile_speedup_vs_compile"] >= 1.15
    if "baseline" in t and "compile" in t:
        out["compile_speedup_vs_baseline"] = t["baseline"] / t["compile"]
    for mode, other in (
        ("triton-fp8", "triton"),
        ("triton-fp8+compile", "triton+compile"),
        ("triton-fp8+compile", "compile"),
        ("triton+graphs", "triton"),
        ("triton+graphs", "triton+compile"),
        ("triton+graphs", "baseline"),
    ):
        if mode in t and other in t:
            out[f"{mode}_speedup_vs_{other}"] = t[other] / t[mode]
    mem = {m: r.get("peak_memory_gb") for m, r in results.items()}
    if mem.get("baseline") and mem.get("triton"):
        out["triton_peak_memory_not_above_baseline"] = mem["triton"] <= mem["baseline"] * 1.001
    for fp8 in FP8_MODES:
        if mem.get("baseline") and mem.get(fp8):
            out[f"{fp8}_peak_memory_below_baseline"] = mem[fp8] < mem["baseline"]
    return out


def chart(summary, path):
    from benchmark_kernels import pyplot

    plt = pyplot()
    if plt is None:
        return
    key = "forward_ms" if summary["transformer_only"] else "step_ms"
    modes = [m for m in summary["results"] if summary["results"][m].get(key)]
    med = [summary["results"][m][key]["median"] for m in modes]
    lo = [med[i] - summary["results"][m][key]["p20"] for i, m in enumerate(modes)]
    hi = [summary["results"][m][key]["p80"] - med[i] for i, m in enumerate(modes)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(modes, med, yerr=[lo, hi], capsize=4, color=["#888", "#d62728", "#1f77b4", "#9467bd"][: len(modes)])
    for i, v in enumerate(med):
        ax.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    c = summary["config"]
    what = "transformer forward" if summary["transformer_only"] else "denoising step"
    ax.set_ylabel(f"ms per {what} (median, p20-p80)")
    name = {
        "ltx": f"LTX-Video {c['num_frames']}f",
        "sd3": "SD3",
        "flux": "FLUX",
        "wan": f"Wan {c['variant']} {c['num_frames']}f",
    }[c["model"]]
    ax.set_title(f"{name} {c['height']}x{c['width']}, {c['dtype']}, {summary['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"chart written to {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu:
        args.tiny = True
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
        log("no GPU: tiny random pipeline on the CPU through Triton's interpreter (not a measurement)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _fill_defaults(args, gpu)
    sys.path.insert(0, HERE)
    from diffusers.utils import logging as diffusers_logging

    import diffusers_injection as di
    import fp8_linear

    fp8_linear.FAST_ACCUMULATION = args.fp8_accumulation == "fast"
    diffusers_logging.set_verbosity_error()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is optional
        tqdm = None

    device = "cuda" if gpu else "cpu"
    dtype = DTYPES[args.dtype]
    clock = Clock(gpu)
    pipe, base_model, inputs, weights = _load(args, device, dtype)
    ref32 = _fp32_reference(args, pipe, base_model, inputs, clock, dtype)
    inputs = _to_dtype(args, pipe, base_model, inputs, dtype, gpu)
    if args.heat_seconds > 0:
        _heat(args, pipe, base_model, inputs, clock)

    per_mode = (args.warmup + args.repeats) * args.rounds
    progress = tqdm(total=per_mode * len(args.modes), file=sys.stderr, desc="benchmark") if tqdm else _NoBar()
    results, outputs = _run_rounds(args, gpu, clock, pipe, base_model, inputs, di, progress)
    parity = judge(outputs, ref32, args.min_psnr)
    for mode in results:
        results[mode]["parity"] = parity[mode]
    ok = all(v["ok"] for v in parity.values())
    for mode, res in results.items():  # a graph mode that replayed nothing timed the eager kernels: say so
        if gpu and "graph_stats" in res:
            res["graphs_replayed"] = bool(res["graph_stats"].get("replays_timed", res["graph_stats"]["replays"]))
            if not res["graphs_replayed"]:
                why = res["graph_stats"]["eager"]
                print(
                    f"{mode}: no call was replayed from a graph ({why}): its times are the eager kernels'",
                    file=sys.stderr,
                )

    summary = _summary(args, argv, gpu, weights, _config(args, base_model, inputs), results, ok)
    if any("fp8" in m for m in args.modes) and args.transformer_only:
        summary["fp8_layer_errors"] = fp8_layer_errors(base_model, inputs, di)
    _report(args, summary, results, ok)
    return 0 if ok else 1


def fp8_layer_errors(base_model, inputs, di) -> dict:
    """What FP8 costs each linear layer the FP8 modes replace: on one bf16 forward of these inputs, each
    layer's output against its FP8 twin's on the same input (fp8_linear.layer_errors), summarised."""
    import fp8_linear

    errs = fp8_linear.layer_errors(base_model, lambda: base_model(**inputs), parents=di.fp8_parents(base_model))
    vals = sorted(errs.values())
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    return {
        "what": "rel. L2 of each block linear layer's FP8 output against its bf16 output, same input",
        "layers": len(vals),
        "median": vals[len(vals) // 2],
        "max": vals[-1],
        "worst": [{"layer": n, "rel_l2": e} for n, e in worst],
    }


def _fill_defaults(args, gpu: bool) -> None:
    """The sizes, counts, dtype and heating time not given on the command line: the model's defaults on a
    GPU, small ones on the CPU."""
    cpu_defaults = dict(num_frames=9, height=32, width=32, steps=2, repeats=1, dtype="fp32", heat_seconds=0.0)
    gpu_defaults = dict(
        num_frames=121,
        height=512,
        width=768,
        steps=4,
        repeats=10 if args.transformer_only else 3,
        dtype="bf16",
        heat_seconds=20.0,
    )
    if args.model in ZOO_MODELS:  # model_zoo fixes the size
        cpu_defaults.update(num_frames=None, height=None, width=None)
        gpu_defaults.update(num_frames=None, height=None, width=None)
    elif args.model == "wan":
        cpu_defaults.update(num_frames=9, height=64, width=64)
        gpu_defaults.update(num_frames=81, height=480, width=832)
    elif args.model != "ltx":
        cpu_defaults.update(num_frames=1, height=64, width=64)
        gpu_defaults.update(num_frames=1, height=1024, width=1024)
    if any(m in FP8_MODES for m in args.modes):
        cpu_defaults.update(dtype="bf16")  # the FP8 modes replace bf16 linear layers
    for k, v in (cpu_defaults if not gpu else gpu_defaults).items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def _load(args, device, dtype):
    """(LTX pipeline or None, the transformer in fp32, its forward's inputs or None for a pipeline run,
    description of the weights). The inputs are in fp32, but LTX-Video's (--transformer-only) in dtype."""
    if args.model == "ltx":
        pipe, weights = load_pipeline(device, args.tiny, args.seed)
        pipe.set_progress_bar_config(disable=True)
        base_model = pipe.transformer
        inputs = transformer_inputs(base_model, args, device, dtype) if args.transformer_only else None
        log(f"{weights}; {args.num_frames} frames {args.height}x{args.width}; modes {list(args.modes)}")
    else:
        pipe = None
        load = load_zoo if args.model in ZOO_MODELS else load_wan if args.model == "wan" else load_mmdit
        base_model, inputs, weights = load(args, device)
        log(f"{weights}; modes {list(args.modes)}")
    return pipe, base_model, inputs, weights


def _fp32_reference(args, pipe, base_model, inputs, clock, dtype):
    """The float32 run's outputs (the parity yardstick), or None when skipped or already fp32."""
    if args.no_fp32_reference or dtype == torch.float32:
        return None
    log("float32 reference run")
    if args.transformer_only:
        inputs32 = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
        return {"output": run_forward(base_model, inputs32, clock)[0]}
    lat, frames, _ = run_pipeline(pipe, base_model, args, clock)
    return {"latents": lat, "frames": frames}


def _to_dtype(args, pipe, base_model, inputs, dtype, gpu: bool):
    """The model in dtype (Wan's fp32 modules kept) and the inputs in dtype but the timestep; returns the
    inputs."""
    if pipe is not None:
        pipe.to(dtype)
        if args.transformer_only and gpu:  # not needed: frees device memory
            pipe.text_encoder.to("cpu")
            pipe.vae.to("cpu")
    elif args.model == "wan" or args.model in ZOO_MODELS:
        cast_like_from_pretrained(base_model, dtype)  # the class's _keep_in_fp32_modules stay fp32
    if args.model in ZOO_MODELS and inputs is not None:  # the same values, in the dtypes the pipeline gives them
        import model_zoo as mz

        device = next(base_model.parameters()).device
        size = "tiny" if args.tiny else "real"
        return mz.inputs(args.model, base_model, size, dtype=dtype, device=device, seed=args.seed)
    else:
        base_model.to(dtype)
    if inputs is not None:
        inputs = {
            k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k != "timestep" else v)
            for k, v in inputs.items()
        }
    return inputs


def _heat(args, pipe, base_model, inputs, clock) -> None:
    """Untimed baseline calls for --heat-seconds, so that the first mode does not run on a cool GPU. Clocks
    can still fall later in the run (in the recorded LTX-Video run, after 20 s of this, the same GEMM and
    attention kernels took 6-15 % longer in the modes timed after the baseline); --rounds alternates the
    order."""
    log(f"heating the GPU with baseline calls for {args.heat_seconds:.0f} s")
    heat_calls, t_end = 0, time.perf_counter() + args.heat_seconds
    while time.perf_counter() < t_end:
        if pipe is not None and not args.transformer_only:
            run_pipeline(pipe, base_model, args, clock)
        else:
            run_forward(base_model, inputs, clock)
        heat_calls += 1
    log(f"  {heat_calls} calls")


def _run_rounds(args, gpu, clock, pipe, base_model, inputs, di, progress):
    """Every mode in every round, the order alternating between rounds; returns (results per mode, pooled
    over the rounds; outputs per mode, of the last round). Leaves the model as it was."""
    results, outputs = {}, {}
    orders = [args.modes if r % 2 == 0 else tuple(reversed(args.modes)) for r in range(args.rounds)]
    try:
        for r, order in enumerate(orders):
            for mode in order:
                progress.set_description(mode if args.rounds == 1 else f"{mode} (round {r + 1})")
                res, outs = bench_mode(
                    mode,
                    args,
                    gpu,
                    clock,
                    None if args.transformer_only else pipe,
                    base_model,
                    inputs,
                    di,
                    progress,
                    profile=args.profile and r == len(orders) - 1,
                )
                results[mode] = res if mode not in results else merge_rounds(results[mode], res, args.transformer_only)
                outputs[mode] = outs
                label = mode if args.rounds == 1 else f"{mode} (round {r + 1})"
                progress.write(_mode_line(label, res), file=sys.stderr)  # a run cut short still tells what it measured
    finally:
        progress.close()
        while _UNDO:
            _UNDO.pop()()
        di.remove_optimized_kernels(base_model, verbose=False)
        if pipe is not None:
            object.__setattr__(pipe, "transformer", base_model)
    return results, outputs


def _mode_line(mode, res) -> str:
    """One line of a finished mode for stderr: median time, warm-up overhead and peak memory."""
    key = "forward_ms" if "forward_ms" in res else "step_ms"
    peak = f", peak {res['peak_memory_gb']:.2f} GB" if "peak_memory_gb" in res else ""
    warm = res.get("warmup_overhead_s")
    return (
        f"  {mode}: {key.removesuffix('_ms')} median {res[key]['median']:.2f} ms"
        + (f", warm-up overhead {warm:.1f} s" if warm is not None else "")
        + peak
    )


def _token_count(base_model, inputs):
    """Tokens of one sample in the timed forward, or None for a pipeline run."""
    if inputs is None:
        return None
    hs = inputs.get("hidden_states")
    if not isinstance(hs, torch.Tensor):
        return None
    p = getattr(base_model.config, "patch_size", 1) or 1
    if hs.dim() == 5:  # video latents [B, C, F, H, W], patch (t, h, w) (Wan) or h = w with patch_size_t
        if isinstance(p, int):
            p = (getattr(base_model.config, "patch_size_t", 1) or 1, p, p)
        return math.prod(n // q for n, q in zip(hs.shape[2:], p))
    return hs.shape[1] if hs.dim() == 3 else (hs.shape[-2] // p) * (hs.shape[-1] // p)


def _tokens(args, base_model, inputs) -> dict:
    """{"tokens": all of one sample's tokens} (None for a pipeline run); a model_zoo model adds them per stream,
    as its pipeline makes them (model_zoo.token_counts), since its latents' layout varies by model."""
    if args.model in ZOO_MODELS:
        import model_zoo as mz

        streams = mz.token_counts(args.model, "tiny" if args.tiny else "real")
        return {"tokens": sum(streams.values()), "tokens_per_stream": streams}
    return {"tokens": _token_count(base_model, inputs)}


def _batch(inputs):
    """The batch of the timed forward (2 for an LTX-Video pipeline run: the guidance batch)."""
    if inputs is None:
        return 2
    hidden = inputs.get("hidden_states", inputs.get("x"))
    if isinstance(hidden, (list, tuple)) and hidden and isinstance(hidden[0], torch.Tensor):
        return len(hidden)  # a list of per-sample latents (Z-Image's x): one entry a sample
    leaves = torch.utils._pytree.tree_leaves(inputs)
    first = next((v for v in leaves if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    if isinstance(hidden, torch.Tensor):
        return hidden.shape[0]
    return first.shape[0] if first is not None else 1


def _config(args, base_model, inputs) -> dict:
    """The summary's "config"."""
    return {
        "model": args.model,
        "variant": args.variant,
        "blocks": args.blocks,
        "num_frames": args.num_frames,
        "height": args.height,
        "width": args.width,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "dtype": args.dtype,
        "seed": args.seed,
        "batch": _batch(inputs),
        **_tokens(args, base_model, inputs),
        "compile_mode": args.compile_mode,
        "fp8_accumulation": args.fp8_accumulation,
        "heat_seconds": args.heat_seconds,
        "rounds": args.rounds,
    }


def versions() -> dict:
    """The torch, Triton, diffusers and Python versions a summary records (also benchmark_context_parallel's)."""
    return {
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "diffusers": __import__("diffusers").__version__,
        "python": platform.python_version(),
    }


def _summary(args, argv, gpu, weights, config, results, ok) -> dict:
    """The JSON summary."""
    return {
        "benchmark": "benchmark_e2e.py",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python scripts/benchmark_e2e.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": torch.cuda.get_device_name() if gpu else "cpu (Triton interpreter; not a measurement)",
        "arch": _arch() if gpu else None,
        "versions": versions(),
        "weights": weights,
        "transformer_only": args.transformer_only,
        "config": config,
        "timing": (
            "CUDA events around each transformer forward"
            if args.transformer_only
            else "CUDA events per denoising step: transformer call (guidance batch 2) + guidance + scheduler step"
        )
        if gpu
        else "host clock (interpreter)",
        "results": results,
        "targets": targets(results, args.transformer_only) if gpu else None,
        "ok": ok,
    }


def _report(args, summary, results, ok) -> None:
    """One line per mode on stderr, the JSON on stdout (and --output-json), the chart (--png)."""
    key = "forward_ms" if args.transformer_only else "step_ms"
    for mode, r in results.items():
        log(
            f"{mode:>15}: {key} median {r[key]['median']:.2f} (p20 {r[key]['p20']:.2f}, p80 {r[key]['p80']:.2f})"
            + (f", peak {r['peak_memory_gb']:.2f} GB" if "peak_memory_gb" in r else "")
            + (f", GPU busy {100 * r['gpu_busy_share']:.0f} %" if "gpu_busy_share" in r else "")
            + f", parity {_parity_text(mode, r, results)}"
        )
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if args.output_json:
        with open(args.output_json, "w") as f:
            f.write(text + "\n")
    if args.png:
        chart(summary, args.png)
    if not ok:
        log("FAILED: a mode's output diverged (see results.<mode>.parity)")


class _NoBar:
    def update(self, n):
        pass

    def write(self, s, file=None):
        log(s)

    def set_description(self, s):
        pass

    def close(self):
        pass


def _arch():
    props = torch.cuda.get_device_properties(0)
    return getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""A decoder LLM of transformers with the Triton kernels injected: what is replaced, how close logits and
greedy tokens stay to the unpatched model, and decode tokens/s before and after.

Pick the family with --arch: a released architecture whose config.json numbers are written in
transformers_families.py (random weights: nothing is downloaded). The weights of the GPU run in bf16, and
the fp32 check's copy (it casts the same model to fp32 first, the half-precision runs follow), per --arch:

    --arch            class                  bf16      fp32 check
    llama3-8b         LlamaForCausalLM       15 GiB    30 GiB     (default)
    mistral-7b        MistralForCausalLM     13.5 GiB  27 GiB
    qwen2.5-7b        Qwen2ForCausalLM       14.2 GiB  28 GiB
    qwen3-8b          Qwen3ForCausalLM       15.3 GiB  31 GiB
    gemma2-9b         Gemma2ForCausalLM      17.2 GiB  34 GiB
    gemma3-12b        Gemma3ForCausalLM      21.9 GiB  44 GiB
    phi3-mini         Phi3ForCausalLM        7.1 GiB   14 GiB
    mixtral-8x7b      MixtralForCausalLM     87 GiB    174 GiB    (use --num-layers, e.g. 8: 22 / 44 GiB)
    qwen3-30b-a3b     Qwen3MoeForCausalLM    57 GiB    114 GiB    (use --num-layers, e.g. 16 on an H100)
    olmo2-7b          Olmo2ForCausalLM       13.6 GiB  27 GiB

--num-layers N keeps the first N decoder layers (same layer shapes: per-layer timings stay comparable;
say so when reporting). A model whose fp32 copy would not fit in 85% of the GPU's memory is refused with
the largest N that fits.

With a GPU: --arch's architecture with random weights, built in bf16 on the GPU; for llama3-8b a Llama
checkpoint from the local Hugging Face cache is used if one is there (offline, no download; --model picks
any cached or local checkpoint of --arch's class, --random-weights skips the cache). Batch 1, a 128-token
prompt, then 128 decode steps timed with CUDA events around the whole decode loop (no host
synchronisation inside it): decode tokens/s of the unpatched and the patched model, median of 3 runs,
after a warm-up (cuBLAS, Triton compilation). Default dtype bf16.
Eager batch-1 decoding waits on the host, and every launch costs host time: --capture graph | compile times
what a server runs instead. Both models then decode through transformers' StaticCache (fixed shapes), the
step captured the same way for each: one CUDA graph per model (warmed up on a side stream, then captured;
the step reads its token and position from static tensors and writes the next ones back, so a decode is a
sequence of replays; a step that synchronises with the host is reported, not captured), or
torch.compile(mode="reduce-overhead"). Reported per model: prefill tokens/s (CUDA events around the prefill of
the prompt) and decode tokens/s (around --decode-steps captured steps), medians of --reps runs, and the captured
steps' logits against the same model's uncaptured steps (teacher-forced). The issue's setting, decode at a
2,048-token context: --prompt-len 2048 --capture graph. The graph capture gives sliding-window layers (Gemma,
Mistral, Phi-3) full-length static layers, their window kept by the model's sliding-window mask: transformers'
static sliding-window layer makes a host tensor at every step once full, which a CUDA graph cannot hold.
Without a GPU (or with --device-free): the tiny random model of --arch's family (hidden 64, 2 layers,
vocabulary 256) on the CPU through Triton's interpreter, fp32, an 8-token prompt and 8 new tokens: a
correctness run (no timing), seconds.

Injected: every kind transformers_injection.inject_optimized_kernels finds in the model (RMSNorms, residual
add + the following RMSNorm fused, SwiGLU / GeGLU / MoE experts' SwiGLU, RoPE); --skinny-gemm also
sends the decode-time linear layers (at most 32 rows) to the skinny GEMM. Sites with no kernel for their
function (kernel_gaps) are reported and keep PyTorch's code.

Parity (exit status 1 when a check fails). The logits compared are those of the prompt (prefill) and of
N decode steps teacher-forced with the fp32 unpatched model's greedy tokens, so every run sees the same
inputs, through the KV cache as in generation.
* fp32, always run first (also on the GPU, with TF32 off): max |patched - unpatched| <= 1e-4 * max
  |unpatched| over those logits, and model.generate's greedy tokens identical for the N new tokens. The
  kernels do the unpatched math in fp32 with other summation orders and one rounding per fused step:
  a few fp32 ulps (~1e-7 relative) per operation, ~3e-7 measured at the logits of the tiny model. 1e-4
  leaves room for that to grow through 32 layers and stays far below what a wrong formula or layout
  does (order 1e-2 and more). With errors that small a greedy token flips only on an exact tie.
* fp32, MoE models (Mixtral, Qwen3-MoE): a router's top-k choice taken on a margin of a few fp32 ulps flips
  under any other rounding of the same math, the kernels' or stock's own (the RMSNorm computed in float64
  moves Qwen3-30B-A3B's router logits as much as the kernels do: 5e-7 on average, 3e-6 at most), and one
  flipped expert moves that token's logits by ~1e-2 of the largest logit, and those of the tokens
  attending to it. Measured on Qwen3-30B-A3B's shapes (CPU, fp32; router logits of std 0.9): about 17
  decisions in 1,000 have a margin under 1e-3, so ~5e-6 of the decisions flip, ~0.15 expected in a
  16-layer, 2,048-token run (stock against stock with the float64 RMSNorm: 1 flip in 295k decisions, its
  token's logits 2e-3 off; an H100 run of the kernels had one token's logits off by 1.1e-2, before this
  rule). The patched runs therefore take the unpatched runs' routing where theirs
  differs (the scores recomputed from their own router logits), and the 1e-4 rule above applies to those
  logits; the flips are judged apart: each on a near tie (the unpatched margin <= 1e-4 of the token's
  largest |router logit|), at most max(2, 1e-4 of the decisions), every router call forced. The logits
  with the patched model's own routing are reported (patched_vs_unpatched_free_routing), not required.
* bf16/fp16 (GPU default): the unpatched model is itself away from its fp32 run by rounding. The patched
  logits must be no further from the fp32 run than 1.5x that distance (relative L2): the kernels may not
  make the model measurably less accurate than stock half precision. Under Triton's interpreter (CPU,
  --dtype bf16) the factor is 2.5: the interpreter truncates fp32 -> bf16 where a GPU rounds to nearest,
  a biased error of up to one ulp at every kernel output (measured: 1.2x without and 1.9x with
  --skinny-gemm on the tiny model, whose every linear layer then rounds that way). Greedy tokens are compared and
  reported (length of the common prefix), not required: with random weights the top two logits are
  often closer than bf16 rounding, and either model's choice is then as good as the other's.
* The kernels must actually have run (calls counted per kernel), and after remove_optimized_kernels the
  model must reproduce the unpatched logits bit for bit (cuDNN's attention is switched off on the GPU: its bf16
  results varied from run to run of the unpatched model at a 2,048-token context).
* With --capture: each model's captured decode steps, teacher-forced with the uncaptured decode's tokens, give
  logits within rel_l2(unpatched half, fp32) of its uncaptured steps' (a capture replaying a stale position or
  cache slot is off by order 1; measured on an H100: bit-identical). Greedy tokens of the captured decode are
  reported, not required, as above.
The JSON summary goes to stdout, diagnostics to stderr.
"""

import argparse
import inspect
import json
import os
import statistics
import sys

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import transformers_families  # noqa: E402  (configs only: imports no kernel, so TRITON_INTERPRET can still be set)

ARCH_NAMES = tuple(transformers_families.ARCHS)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CAPTURES = ("none", "graph", "compile")
WARMUP_STEPS = 3  # decode steps before a capture (Triton compiles, cuBLAS picks its kernels, Dynamo traces)
FP32_REL_MAX = 1e-4
HALF_FACTOR = 1.5  # on a GPU
HALF_FACTOR_INTERPRETER = 2.5  # the interpreter truncates fp32 -> bf16 (see the docstring)
MIN_AUTO_PARAMS = 1e9
# Checkpoints looked for first in the local cache for llama3-8b (any other cached LlamaForCausalLM otherwise).
PREFERRED = (
    "meta-llama/Meta-Llama-3-8B",
    "meta-llama/Meta-Llama-3-8B-Instruct",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-8B-Instruct",
)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--arch",
        default="llama3-8b",
        choices=sorted(ARCH_NAMES),
        help="the architecture (family) to run, random weights from its config (default llama3-8b; see above)",
    )
    p.add_argument("--num-layers", type=int, help="GPU: keep the first N decoder layers (default: all)")
    p.add_argument(
        "--model",
        help="a cached model id or a local directory of --arch's class (GPU only; default for llama3-8b: a "
        "Llama-3-8B-like checkpoint from the local cache, else random weights)",
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="GPU: use random weights even if a llama3-8b checkpoint is cached",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), help="GPU default bf16, CPU fp32 (fp32 is always checked first)")
    p.add_argument("--prompt-len", type=int, help="prompt tokens (GPU default 128, CPU 8)")
    p.add_argument("--new-tokens", type=int, help="greedy tokens compared (GPU default 32, CPU 8)")
    p.add_argument("--decode-steps", type=int, default=128, help="timed decode steps per run (GPU)")
    p.add_argument("--reps", type=int, default=3, help="timed runs per model (GPU); the median is reported")
    p.add_argument(
        "--skinny-gemm",
        action="store_true",
        help="also route decode-time linear layers (<= 32 rows, fp16/bf16) to the skinny GEMM",
    )
    p.add_argument(
        "--capture",
        choices=CAPTURES,
        default="none",
        help="GPU: also time prefill and decode with transformers' StaticCache, the decode step captured the same "
        "way for the unpatched and the patched model: 'graph' (one CUDA graph per model), 'compile' "
        "(torch.compile mode='reduce-overhead'), 'none' (no static-cache timing; the default). Needs a GPU",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device-free",
        action="store_true",
        help="run the tiny CPU model through Triton's interpreter even if a GPU is present",
    )
    args = p.parse_args(argv)
    if args.num_layers is not None and args.num_layers < 1:
        p.error(f"--num-layers must be at least 1, got {args.num_layers}")
    return args


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
def param_count(config) -> int:
    """Parameters of the causal LM of config, counted on the meta device (no memory); tied input and output
    embeddings once."""
    import transformers_families as tf

    model = tf.build_meta(config)
    n = sum(p.numel() for p in model.parameters())
    head, emb = getattr(model, "lm_head", None), model.get_input_embeddings()
    if getattr(config, "tie_word_embeddings", False) and head is not None and head.weight is not emb.weight:
        n -= head.weight.numel()  # built untied on the meta device; tied when built for real
    return n


def fp32_fits(config) -> bool:
    """Whether the fp32 copy of config's weights (the fp32 check) fits in 85% of the GPU's memory."""
    return 4 * param_count(config) <= 0.85 * torch.cuda.get_device_properties(0).total_memory


def find_cached(model_class: str, requested=None):
    """(repo id or path, snapshot directory) of a model_class checkpoint in the local cache whose fp32 copy
    fits in the GPU memory (and, unless requested by name, of at least 1B parameters), or None. Nothing is
    downloaded."""
    from transformers import AutoConfig

    if requested and os.path.isdir(requested):
        return requested, requested
    try:
        from huggingface_hub import scan_cache_dir

        repos = scan_cache_dir().repos
    except Exception as exc:  # no cache directory, unreadable cache
        log(f"no usable Hugging Face cache ({type(exc).__name__}: {exc})")
        return None
    found = {}
    for repo in repos:
        if repo.repo_type != "model" or (requested and repo.repo_id != requested):
            continue
        for rev in repo.revisions:
            try:
                cfg = json.loads((rev.snapshot_path / "config.json").read_text())
            except (OSError, ValueError):
                continue
            if model_class not in (cfg.get("architectures") or []):
                continue
            if not any(f.file_name.endswith(".safetensors") for f in rev.files):
                continue
            try:
                config = AutoConfig.from_pretrained(rev.snapshot_path, local_files_only=True)
                params = param_count(config)
            except Exception:  # a config this transformers cannot build
                continue
            if 4 * params > 0.85 * torch.cuda.get_device_properties(0).total_memory:
                log(f"{repo.repo_id}: too large for the fp32 check on this GPU, skipped")
                continue
            if params < MIN_AUTO_PARAMS and not requested:
                continue  # a tiny test checkpoint says nothing about decode speed: only on request
            found[repo.repo_id] = str(rev.snapshot_path)
    preferred = list(PREFERRED) if model_class == "LlamaForCausalLM" else []
    for rid in ([requested] if requested else []) + preferred + sorted(found):
        if rid in found:
            return rid, found[rid]
    return None


def _from_cache(model_class: str, args, dtype):
    """(model, description, tokenizer) of a cached checkpoint of model_class, or None (said why)."""
    hit = find_cached(model_class, args.model)
    if hit is None:
        log(f"no {model_class} checkpoint in the local Hugging Face cache: random weights")
        return None
    rid, path = hit
    try:
        import transformers
        from transformers import AutoTokenizer

        cls = getattr(transformers, model_class)
        model = cls.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True)
        model = model.to("cuda").eval()
        model.requires_grad_(False)
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception:
            tok = None
        return model, f"{rid} from the local cache", tok
    except Exception as exc:  # partial download, unreadable files: say why and go on
        log(f"could not load {rid} from the local cache ({type(exc).__name__}: {exc}); using random weights")
        return None


def load_model(gpu: bool, args):
    """(model, description, tokenizer or None). GPU: half precision (args.dtype) on the GPU; CPU: fp32."""
    import transformers_families as tf

    arch = tf.ARCHS[args.arch]
    family = tf.FAMILIES[arch.family]
    if not gpu:
        model = tf.build(tf.tiny_config(arch.family), device="cpu", seed=args.seed)
        return model, f"tiny random {family.model_class} (CPU)", None
    dtype = DTYPES[args.dtype]
    if args.model or (args.arch == "llama3-8b" and not args.random_weights):
        hit = _from_cache(family.model_class, args, dtype)
        if hit is not None:
            return hit
    config = tf.release_config(args.arch, num_layers=args.num_layers)
    if not fp32_fits(config):
        layers = config.num_hidden_layers
        fit = max((n for n in range(1, layers) if fp32_fits(tf.release_config(args.arch, num_layers=n))), default=0)
        raise SystemExit(
            f"{arch.title} with {layers} layers does not fit the fp32 check on this GPU; "
            + (f"run with --num-layers {fit} (or fewer)" if fit else "no layer count fits")
        )
    model = tf.build(config, device="cuda", dtype=dtype, seed=args.seed)
    layers = f"{config.num_hidden_layers} of {arch.release['num_hidden_layers']} layers"
    return model, f"{arch.title} architecture ({layers}), random weights", None


def make_prompt(model, tok, n: int, seed: int, device):
    if tok is not None:
        text = (
            "The history of the printing press begins in the fifteenth century, when movable type "
            "changed how books were made and read across Europe. "
        )
        ids = tok(text * (1 + n // 16), return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] == n:
            return ids.to(device)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, n), generator=g).to(device)


def cast_parameters(model, dtype):
    """Parameters to dtype in place (buffers such as RoPE's inv_freq keep their fp32). bf16/fp16 ->
    fp32 -> bf16/fp16 is lossless, so one model serves the fp32 reference and the half-precision runs."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


# --------------------------------------------------------------------------------------------
# MoE routing in the fp32 check
# --------------------------------------------------------------------------------------------
# A routing flip is accepted as a near tie when the unpatched router's margin between its k-th and (k+1)-th
# logit was at most this much of the token's largest |router logit| (the logits' own tolerance, FP32_REL_MAX).
ROUTING_TIE_REL = FP32_REL_MAX
# At most this share of the routing decisions (tokens x MoE layers) may flip (but 2 always may): ~5e-6 expected
# per decision on Qwen3-30B-A3B's shapes (CPU, fp32), a 20th of this.
ROUTING_MAX_FLIP_SHARE = 1e-4
ROUTING_MIN_FLIPS = 2
ROUTING_FLIPS_LISTED = 16


def _router_output(out):
    """(logits [N, E], scores [N, K], indices [N, K]) if out is what transformers' top-k routers return
    (Mixtral's, Qwen3-MoE's: router_logits, router_scores, router_indices), else None."""
    if not isinstance(out, (tuple, list)) or len(out) != 3 or not all(isinstance(t, torch.Tensor) for t in out):
        return None
    logits, scores, idx = out
    ok = (
        logits.dim() == 2
        and logits.is_floating_point()
        and scores.is_floating_point()
        and not idx.is_floating_point()
        and scores.shape == idx.shape
        and idx.dim() == 2
        and idx.shape[0] == logits.shape[0]
        and 0 < idx.shape[1] < logits.shape[1]
    )
    return (logits, scores, idx) if ok else None


def _router_scores(logits, idx, scores):
    """The scores transformers' top-k routers give the experts idx of these logits (softmax over all experts,
    taken at idx, renormalised over them or not), if that is what `scores` (the router's own scores for idx)
    holds; None for a router that computes something else (sigmoid, biased or grouped routing)."""
    probs = torch.softmax(logits.float(), dim=-1)
    tol = 1e-5 if scores.dtype == torch.float32 else 1e-2
    got = probs.gather(-1, idx)
    for w in (got / got.sum(-1, keepdim=True), got):
        if torch.allclose(w.to(scores.dtype).float(), scores.float(), rtol=tol, atol=tol * 1e-2):
            return lambda ref_idx, renorm=w is not got: _scores_of(probs, ref_idx, renorm, scores.dtype)
    return None


def _scores_of(probs, idx, renorm: bool, dtype):
    w = probs.gather(-1, idx)
    return (w / w.sum(-1, keepdim=True) if renorm else w).to(dtype)


class Routing:
    """The routers of an MoE model (the modules beside an experts module in its MoE block: Mixtral's and
    Qwen3-MoE's `gate`), recorded and forced through forward hooks, only inside record() / force().

    record(): per router and call, the experts chosen per token, the margin between the k-th and the
    (k+1)-th router logit and the largest |router logit| (the token's scale). force(rec): where a token's
    router chose other experts than rec's call did (a flip, kept with rec's margin), it gets rec's experts,
    their scores computed from this run's own router logits as the router computes them; the other tokens
    keep the router's own output. A
    routing decision taken on a margin of a few fp32 ulps flips under any other rounding of the same math;
    one flipped expert of 8 changes that token's MoE output by order 1/8, and the tokens that attend to it
    after, so the fp32 parity of an MoE model is measured with the unpatched model's routing forced on the
    patched one, and the flips are counted and judged apart (routing_verdict)."""

    def __init__(self, model, ti):
        self.routers = {}
        for name, m in model.named_modules():
            kids = dict(m.named_children())
            if any(ti._experts_structure(c) is not None for c in kids.values()):
                for cname, c in kids.items():
                    if ti._experts_structure(c) is None and next(c.parameters(), None) is not None:
                        self.routers[f"{name}.{cname}" if name else cname] = c

    def _hooked(self, fn):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            handles = [m.register_forward_hook(lambda mod, a, out, n=n: fn(n, out)) for n, m in self.routers.items()]
            try:
                yield
            finally:
                for h in handles:
                    h.remove()

        return ctx()

    def record(self):
        """Context: records every router call into the returned dict {router name: [call, ...]}."""
        import contextlib

        rec = {n: [] for n in self.routers}

        def fn(name, out):
            r = _router_output(out)
            if r is None:
                return None
            logits, _, idx = r
            top = logits.detach().double().topk(idx.shape[1] + 1, dim=-1).values
            rec[name].append(
                {
                    "idx": idx.detach().clone(),
                    "gap": (top[:, -2] - top[:, -1]).cpu(),
                    "scale": logits.detach().double().abs().amax(-1).cpu(),
                }
            )
            return None

        @contextlib.contextmanager
        def ctx():
            with self._hooked(fn):
                yield rec

        return ctx()

    def force(self, rec):
        """Context: each router call takes the experts of rec's call of the same router and order. Yields
        {"calls", "flips": [...], "unforced": [reasons]}; a call that cannot be forced (another shape, a
        router whose scores are not softmax-top-k's, more calls than recorded) keeps its own routing and is
        named in "unforced". "calls": {(router, call): tokens routed}."""
        import contextlib

        stats = {"calls": {}, "flips": [], "unforced": []}
        pos = {n: 0 for n in self.routers}

        def fn(name, out):
            r = _router_output(out)
            if r is None:
                return None
            logits, scores, idx = r
            i = pos[name]
            pos[name] += 1
            if i >= len(rec.get(name, ())):
                stats["unforced"].append(f"{name} call {i}: not recorded")
                return None
            ref = rec[name][i]
            ref_idx = ref["idx"].to(idx.device)
            if ref_idx.shape != idx.shape:
                stats["unforced"].append(f"{name} call {i}: {tuple(idx.shape)} routed, {tuple(ref_idx.shape)} recorded")
                return None
            score = _router_scores(logits.detach(), idx, scores)
            if score is None:
                stats["unforced"].append(f"{name}: scores are not softmax top-k's")
                return None
            stats["calls"][(name, i)] = idx.shape[0]
            own_gap = logits.detach().double().topk(idx.shape[1] + 1, dim=-1).values
            flipped = (idx.sort(-1).values != ref_idx.sort(-1).values).any(-1)
            for row in flipped.nonzero().flatten().tolist():
                gap, scale = ref["gap"][row].item(), ref["scale"][row].item()
                stats["flips"].append(
                    {
                        "router": name,
                        "call": i,
                        "token": row,
                        "gap": gap,
                        "rel_gap": gap / max(scale, 1e-30),
                        "patched_gap": (own_gap[row, -2] - own_gap[row, -1]).item(),
                    }
                )
            if not flipped.any():
                return None  # the same experts (maybe in another order): the router's own output stands
            keep = flipped[:, None]
            return type(out)((logits, torch.where(keep, score(ref_idx), scores), torch.where(keep, ref_idx, idx)))

        @contextlib.contextmanager
        def ctx():
            with self._hooked(fn):
                yield stats
            for n, calls in rec.items():
                if pos[n] < len(calls):
                    stats["unforced"].append(f"{n}: {len(calls)} calls recorded, {pos[n]} made")

        return ctx()


def routing_verdict(*stats) -> dict:
    """The "routing" result of force() runs: decisions, flips (the first ROUTING_FLIPS_LISTED, largest margin
    first), and ok: every call forced, at most max(ROUTING_MIN_FLIPS, ROUTING_MAX_FLIP_SHARE * decisions)
    flips, each on a near tie (the unpatched margin <= ROUTING_TIE_REL of the token's largest |router
    logit|). A kernel that moves the router's input by more than rounding flips decisions with wider
    margins, or many: it fails here even though the forced logits may agree. Decisions and flips are
    counted once per (router, call, token): the greedy run and the teacher-forced run repeat the same
    prefill (and, with the same tokens, the same decode steps)."""
    calls = {}
    for s in stats:
        calls.update(s["calls"])
    decisions = sum(calls.values())
    unique = {}
    for s in stats:
        for f in s["flips"]:
            unique.setdefault((f["router"], f["call"], f["token"]), f)
    flips = sorted(unique.values(), key=lambda f: -f["rel_gap"])
    unforced = [u for s in stats for u in s["unforced"]]
    allowed = max(ROUTING_MIN_FLIPS, int(ROUTING_MAX_FLIP_SHARE * decisions))
    worst = flips[0]["rel_gap"] if flips else None
    return {
        "decisions": decisions,
        "flips": len(flips),
        "flips_allowed": allowed,
        "max_flip_rel_gap": worst,
        "tie_rel_gap": ROUTING_TIE_REL,
        "flip_details": flips[:ROUTING_FLIPS_LISTED],
        "unforced": unforced[:ROUTING_FLIPS_LISTED],
        "ok": bool(not unforced and len(flips) <= allowed and (worst is None or worst <= ROUTING_TIE_REL)),
    }


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------
def _cache_kwarg(model) -> str:
    # transformers 5.24 calls it `cache` (and still accepts `past_key_values`); 5.17 `past_key_values`
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


def greedy_tokens(model, prompt, n: int):
    """model.generate's greedy continuation, exactly n tokens (EOS suppressed until then), [1, n]."""
    from transformers import GenerationConfig

    eos = model.config.eos_token_id
    pad = model.config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else (eos if eos is not None else 0)
    gc = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=eos, pad_token_id=pad)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gc)
    return out[:, prompt.shape[1] :]


def forced_logits(model, prompt, forced):
    """fp32 logits [S + N - 1, V]: the prompt's (one prefill call), then one decode step per forced token
    but the last, through a KV cache, as generation runs them."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    kw = {_cache_kwarg(model): cache, "use_cache": True}
    with torch.no_grad():
        out = model(input_ids=prompt, **kw)
        rows = [out.logits[0].float()]
        for i in range(forced.shape[1] - 1):
            out = model(input_ids=forced[:, i : i + 1], **kw)
            rows.append(out.logits[0].float())
    return torch.cat(rows)


def decode_tokens_per_s(model, prompt, steps: int, reps: int):
    """Batch-1 greedy decode speed: tokens/s of `steps` decode calls after a prefill, timed with CUDA
    events recorded before and after the loop (argmax stays on the GPU: no synchronisation inside);
    median over reps runs, with each run's value."""
    from transformers import DynamicCache

    runs = []
    for _ in range(reps):
        cache = DynamicCache(config=model.config)
        kw = {_cache_kwarg(model): cache, "use_cache": True}
        with torch.no_grad():
            out = model(input_ids=prompt, logits_to_keep=1, **kw)
            tok = out.logits[:, -1:].argmax(-1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                out = model(input_ids=tok, **kw)
                tok = out.logits[:, -1:].argmax(-1)
            end.record()
            end.synchronize()
        runs.append(steps * 1000.0 / start.elapsed_time(end))
    return statistics.median(runs), runs


def static_cache(model, max_len: int, *, full_layers: bool):
    """transformers' StaticCache for batch 1 and max_len tokens. full_layers: every layer keeps max_len positions,
    sliding-window layers too (the model's sliding-window mask keeps their attention what it is): when full,
    transformers' static sliding-window layer makes a host tensor (an index) at every decode step, which a CUDA
    graph cannot capture."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    if full_layers and any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
        from transformers.cache_utils import StaticLayer

        cache.layers = [
            StaticLayer(max_cache_len=max_len) if getattr(layer, "is_sliding", False) else layer
            for layer in cache.layers
        ]
    return cache


class StaticDecoder:
    """Batch-1 greedy decoding through transformers' StaticCache: a prefill of the prompt, then decode steps of
    one token with fixed shapes, run as they are (capture "none"), replayed from one CUDA graph ("graph": warmed
    up on a side stream, then captured), or through torch.compile(mode="reduce-overhead") ("compile", which
    captures CUDA graphs of its own). A step reads the token and its position from static tensors and writes
    the next greedy token and position back into them, so the steps chain on the GPU with no host work but the
    launches (one replay for a graph) and no synchronisation."""

    def __init__(self, model, max_len: int, capture: str = "none", *, full_layers=None):
        self.model, self.capture, self.max_len = model, capture, max_len
        device = model.get_input_embeddings().weight.device
        full = capture == "graph" if full_layers is None else full_layers
        self.cache = static_cache(model, max_len, full_layers=full)
        self.kw = {_cache_kwarg(model): self.cache, "use_cache": True}
        # transformers 5.17 takes cache_position; 5.24+ keeps the position in the cache (a device tensor)
        self.cache_position = "cache_position" in inspect.signature(type(model.base_model).forward).parameters
        self.tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph = self.logits = self.compiled = None

    def _call(self, ids, pos, **extra):
        kw = dict(self.kw, position_ids=pos.view(1, -1), **extra)
        if self.cache_position:
            kw["cache_position"] = pos
        return self.model(input_ids=ids, **kw).logits[:, -1]

    def _body(self):
        logits = self._call(self.tok, self.pos)
        self.tok.copy_(logits.argmax(-1, keepdim=True))
        self.pos.add_(1)
        return logits

    def _compiled_body(self, tok, pos):
        return self._call(tok, pos)

    def prefill(self, prompt, reset: bool = True):
        """The prompt's forward into the emptied cache; the first greedy token goes into the step's input."""
        n = prompt.shape[1]
        if n + 1 > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} tokens, the prompt has {n}")
        if reset:
            self.cache.reset()
        with torch.no_grad():
            logits = self._call(prompt, torch.arange(n, device=prompt.device), logits_to_keep=1)
        self.tok.copy_(logits.argmax(-1, keepdim=True))
        self.pos.fill_(n)
        return logits

    def step(self, eager: bool = False):
        """One decode step: logits [1, V] (with a capture, a buffer the next step overwrites); the next greedy
        token and position are written into the step's input. eager: the step's own forward, uncaptured."""
        with torch.no_grad():
            if eager or self.capture == "none":
                return self._body()
            if self.capture == "graph":
                self.graph.replay()
                return self.logits
            torch.compiler.cudagraph_mark_step_begin()
            logits = self.compiled(self.tok, self.pos)
            self.tok.copy_(logits.argmax(-1, keepdim=True))
            self.pos.add_(1)
            return logits

    def prepare(self, prompt, warmup: int = WARMUP_STEPS):
        """Warm-up steps after a prefill (Triton compiles, cuBLAS picks its kernels, Dynamo traces), then the
        capture. The cache is refilled by the next prefill. A step that synchronises with the host (a value
        read back) cannot be captured: found before the capture by a step run in torch.cuda's sync debug mode
        "error", and reported."""
        if self.capture != "none" and not torch.cuda.is_available():
            raise RuntimeError(f"capture {self.capture!r} needs a GPU")
        self.prefill(prompt)
        if self.capture == "compile":
            self.compiled = torch.compile(self._compiled_body, mode="reduce-overhead")
        if self.capture != "graph":
            for _ in range(warmup):
                self.step()
            return self
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(warmup):
                self._body()
            torch.cuda.set_sync_debug_mode("error")
            try:
                self._body()
            except RuntimeError as exc:
                raise RuntimeError(f"the decode step synchronises with the host, no CUDA graph can hold it: {exc}")
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(self.graph):
            self.logits = self._body()
        torch.cuda.synchronize()
        return self

    def greedy(self, prompt, n: int, eager: bool = False):
        """n greedy tokens [1, n]: the prefill's, then n - 1 decode steps'."""
        self.prefill(prompt)
        out = [self.tok.clone()]
        for _ in range(n - 1):
            self.step(eager=eager)
            out.append(self.tok.clone())
        return torch.cat(out, dim=1)

    def forced_logits(self, prompt, tokens, eager: bool = False):
        """fp32 logits [N - 1, V] of decode steps fed tokens[:, :-1] (teacher-forced), after a prefill."""
        self.prefill(prompt)
        rows = []
        for i in range(tokens.shape[1] - 1):
            self.tok.copy_(tokens[:, i : i + 1])
            rows.append(self.step(eager=eager).float().clone())
        return torch.cat(rows)

    def release(self):
        self.graph = self.logits = self.compiled = None
        self.cache = self.kw = None


def static_speed(model, prompt, steps: int, reps: int, capture: str, check_tokens: int) -> dict:
    """Batch-1 prefill and decode tokens/s through a StaticCache with the decode step captured as `capture`
    says: per run, CUDA events around the prefill of the prompt and around `steps` decode steps (no host
    synchronisation inside); medians of reps runs. Also the captured decode's first check_tokens greedy tokens
    against the same model's uncaptured static-cache decode (the capture must not change them)."""
    dec = StaticDecoder(model, prompt.shape[1] + max(steps, check_tokens) + WARMUP_STEPS + 2, capture)
    dec.prepare(prompt)
    eager_tokens = dec.greedy(prompt, check_tokens, eager=True)
    captured_tokens = dec.greedy(prompt, check_tokens)
    forced_diff = compare(dec.forced_logits(prompt, eager_tokens), dec.forced_logits(prompt, eager_tokens, eager=True))
    prefill, decode = [], []
    for _ in range(reps):
        dec.cache.reset()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        torch.cuda.synchronize()
        ev[0].record()
        dec.prefill(prompt, reset=False)
        ev[1].record()
        for _ in range(steps):
            dec.step()
        ev[2].record()
        ev[2].synchronize()
        prefill.append(prompt.shape[1] * 1000.0 / ev[0].elapsed_time(ev[1]))
        decode.append(steps * 1000.0 / ev[1].elapsed_time(ev[2]))
    dec.release()
    del dec
    torch.cuda.empty_cache()
    return {
        "prefill_tokens_per_s": statistics.median(prefill),
        "decode_tokens_per_s": statistics.median(decode),
        "prefill_runs": prefill,
        "decode_runs": decode,
        "captured_tokens_identical_to_uncaptured": bool(torch.equal(eager_tokens, captured_tokens)),
        "captured_common_prefix": common_prefix(eager_tokens, captured_tokens),
        "captured_vs_uncaptured_logits": forced_diff,
    }


def compare(a, b) -> dict:
    """max abs diff, max diff relative to max |b|, relative L2 of a against b."""
    d = a.double() - b.double()
    peak = b.double().abs().max().item()
    return {
        "max_abs_diff": d.abs().max().item(),
        "rel_max_diff": d.abs().max().item() / max(peak, 1e-30),
        "rel_l2": (d.norm() / b.double().norm().clamp_min(1e-30)).item(),
    }


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a.flatten().tolist(), b.flatten().tolist()):
        if x != y:
            break
        n += 1
    return n


def kernels_ran(counts: dict, calls, half: bool) -> list:
    """Kinds injected whose kernel was never called (empty when every injected kind ran)."""
    need = {
        "rmsnorm": "rms_norm",
        "fused_add_rmsnorm": "fused_add_rms_norm",
        "swiglu": "swiglu",
        "geglu": ("geglu", "gelu_mul"),  # a fused [up | gate] projection, or two (Gemma's)
        "moe_swiglu": "swiglu",
        "rope": "rope_rotate_half",
    }
    if half:
        need["skinny_gemm"] = "skinny_gemm"  # the skinny GEMM takes fp16/bf16 only
    return [
        kind
        for kind, fns in need.items()
        if counts.get(kind) and not any(calls.get(fn) for fn in (fns if isinstance(fns, tuple) else (fns,)))
    ]


def main(argv=None) -> int:
    args = parse_args(argv)
    gpu = torch.cuda.is_available() and not args.device_free
    if not gpu and args.capture != "none":
        log(
            f"--capture {args.capture} needs a GPU (CUDA graphs; torch.compile's reduce-overhead mode captures them "
            "too); run without --capture on a CPU"
        )
        return 2
    if not gpu:
        log(f"no GPU in use: the tiny random model of {args.arch}'s family on the CPU through Triton's interpreter")
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before the kernel modules are imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the network
    for name, g, c in (("dtype", "bf16", "fp32"), ("prompt_len", 128, 8), ("new_tokens", 32, 8)):
        if getattr(args, name) is None:
            setattr(args, name, g if gpu else c)
    if gpu:  # the fp32 reference must be fp32, not TF32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # cuDNN's attention (an SDPA backend of torch 2.11 on Hopper) gave other bf16 bits from run to run of the
        # same unpatched model at a 2,048-token context (decode steps past 2,052 tokens, H100): the bit-for-bit
        # restoration check cannot tell that from a restore failure. Flash / memory-efficient attention serve
        # both models instead (deterministic there).
        torch.backends.cuda.enable_cudnn_sdp(False)
    from transformers.utils import logging as hf_logging

    import transformers_injection as ti

    hf_logging.set_verbosity_error()
    device = "cuda" if gpu else "cpu"
    dtype = DTYPES[args.dtype]
    factor = HALF_FACTOR if gpu else HALF_FACTOR_INTERPRETER
    model, weights, tok = load_model(gpu, args)
    prompt = make_prompt(model, tok, args.prompt_len, args.seed, device)
    opts = dict(skinny_gemm=args.skinny_gemm, verbose=False)
    log(f"{weights}; prompt {prompt.shape[1]} tokens, {args.new_tokens} new tokens, dtype {args.dtype}")

    counts, ref_tokens, ref32, fp32, ok = _check_fp32(model, prompt, args, opts, ti)
    missing_kinds = fp32.pop("missing_kinds")
    kernel_gaps = fp32.pop("kernel_gaps")
    if missing_kinds:
        log(f"kinds the model has but none of which was replaced: {missing_kinds}")
    if kernel_gaps:
        log(f"sites with no kernel for their function (PyTorch's code runs): {kernel_gaps}")
    missing = kernels_ran(counts, fp32["kernel_calls"], half=False)
    half = None
    speed = None
    if dtype != torch.float32:
        half, half_ok, speed = _check_half(model, prompt, ref_tokens, ref32, args, opts, gpu, factor, ti)
        missing += [k for k in kernels_ran(counts, half["kernel_calls"], half=True) if k not in missing]
        ok = ok and half_ok
    if missing:
        log(f"these injected kinds never ran their kernel: {missing}")
    ok = bool(ok and not missing and not missing_kinds)

    checks = {"fp32": fp32, "half": half, "decode": speed, "missing_kinds": missing_kinds, "kernel_gaps": kernel_gaps}
    print(json.dumps(_summary(model, prompt, args, gpu, weights, counts, checks, missing, factor, ok), indent=2))
    if not ok:
        log("FAILED: a parity, restoration or kernel-call check did not pass")
    return 0 if ok else 1


def _check_fp32(model, prompt, args, opts, ti):
    """In fp32: the unpatched model, the patched model, and the model after removal. Returns (counts
    injected, the unpatched greedy tokens, the unpatched logits, the "fp32" result, whether it passes). An MoE
    model's patched runs take the unpatched runs' routing where theirs flips (Routing), the flips judged apart
    (routing_verdict); its logits with its own routing are reported too (patched_vs_unpatched_free_routing)."""
    cast_parameters(model, torch.float32)
    routing = Routing(model, ti)
    with routing.record() as rec_tokens:
        ref_tokens = greedy_tokens(model, prompt, args.new_tokens)
    with routing.record() as rec_logits:
        ref32 = forced_logits(model, prompt, ref_tokens)
    counts = ti.inject_optimized_kernels(model, **opts)
    missing_kinds = ti.missing_kinds(model)
    kernel_gaps = ti.kernel_gaps(model)
    log("replaced: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    with ti.count_kernel_calls() as calls32:
        with routing.force(rec_tokens) as forced_tokens:
            patched32_tokens = greedy_tokens(model, prompt, args.new_tokens)
        with routing.force(rec_logits) as forced_logits_:
            patched32 = forced_logits(model, prompt, ref_tokens)
        free32 = forced_logits(model, prompt, ref_tokens) if routing.routers else None
    ti.remove_optimized_kernels(model, verbose=False)
    restored32 = forced_logits(model, prompt, ref_tokens)
    fp32 = {
        "missing_kinds": missing_kinds,
        "kernel_gaps": kernel_gaps,
        "patched_vs_unpatched": compare(patched32, ref32),
        **_tokens_restoration_calls(patched32_tokens, ref_tokens, restored32, ref32, calls32),
    }
    routed_ok = True
    if routing.routers:
        fp32["routing"] = {"routers": len(routing.routers), **routing_verdict(forced_tokens, forced_logits_)}
        fp32["patched_vs_unpatched_free_routing"] = compare(free32, ref32)
        routed_ok = fp32["routing"]["ok"]
        r = fp32["routing"]
        log(
            f"fp32 routing (MoE routers: {r['routers']}): {r['flips']} of {r['decisions']} decisions flipped "
            f"(allowed {r['flips_allowed']}), largest margin of a flip {r['max_flip_rel_gap']} of the token's "
            f"largest router logit (near tie: <= {ROUTING_TIE_REL:g}); unforced calls {r['unforced']}; logits "
            f"with the patched model's own routing: {fp32['patched_vs_unpatched_free_routing']}"
        )
    ok = (
        fp32["patched_vs_unpatched"]["rel_max_diff"] <= FP32_REL_MAX
        and fp32["greedy_tokens_identical"]
        and fp32["restored_bit_identical"]
        and routed_ok
        and bool(torch.isfinite(patched32).all())
    )
    log(
        f"fp32: {fp32['patched_vs_unpatched']}, greedy identical {fp32['greedy_tokens_identical']}, "
        f"restored bit-identical {fp32['restored_bit_identical']}, kernel calls {fp32['kernel_calls']}"
    )
    return counts, ref_tokens, ref32, fp32, ok


def _check_half(model, prompt, ref_tokens, ref32, args, opts, gpu: bool, factor: float, ti):
    """In args.dtype: parity of the unpatched and the patched model against the fp32 logits, and decode
    speed on a GPU. Returns (the "half" result, whether it passes, the "decode" result or None)."""
    cast_parameters(model, DTYPES[args.dtype])
    stock_h = forced_logits(model, prompt, ref_tokens)
    stock_tokens = greedy_tokens(model, prompt, args.new_tokens)
    static = {}
    if gpu and args.capture == "none":
        decode_tokens_per_s(model, prompt, 8, 1)  # warm-up
        stock_tps, stock_runs = decode_tokens_per_s(model, prompt, args.decode_steps, args.reps)
    ti.inject_optimized_kernels(model, **opts)
    with ti.count_kernel_calls() as calls_h:
        patched_h = forced_logits(model, prompt, ref_tokens)
        patched_tokens = greedy_tokens(model, prompt, args.new_tokens)
    if gpu and args.capture == "none":
        decode_tokens_per_s(model, prompt, 8, 1)  # warm-up: Triton compiles each kernel once
        patched_tps, patched_runs = decode_tokens_per_s(model, prompt, args.decode_steps, args.reps)
    ti.remove_optimized_kernels(model, verbose=False)
    restored_h = forced_logits(model, prompt, ref_tokens)
    if gpu and args.capture != "none":  # after the parity checks: captures hold memory and streams of their own
        static["unpatched"] = static_speed(model, prompt, args.decode_steps, args.reps, args.capture, args.new_tokens)
        ti.inject_optimized_kernels(model, **opts)
        # no count_kernel_calls here: its counting wrappers would break torch.compile's graph at every kernel call
        static["patched"] = static_speed(model, prompt, args.decode_steps, args.reps, args.capture, args.new_tokens)
        ti.remove_optimized_kernels(model, verbose=False)
    half = {
        "unpatched_vs_fp32": compare(stock_h, ref32),
        "patched_vs_fp32": compare(patched_h, ref32),
        "patched_vs_unpatched": compare(patched_h, stock_h),
        **_tokens_restoration_calls(patched_tokens, stock_tokens, restored_h, stock_h, calls_h),
    }
    ok = (
        half["patched_vs_fp32"]["rel_l2"] <= factor * half["unpatched_vs_fp32"]["rel_l2"] + 1e-7
        and half["restored_bit_identical"]
        and bool(torch.isfinite(patched_h).all())
    )
    log(
        f"{args.dtype}: patched vs fp32 rel L2 {half['patched_vs_fp32']['rel_l2']:.3e}, unpatched vs fp32 "
        f"{half['unpatched_vs_fp32']['rel_l2']:.3e}; greedy tokens identical {half['greedy_tokens_identical']} "
        f"(common prefix {half['greedy_common_prefix']}/{args.new_tokens}); kernel calls {half['kernel_calls']}"
    )
    speed = None
    if gpu and args.capture == "none":
        speed = _decode_speed(args, stock_tps, stock_runs, patched_tps, patched_runs)
    elif gpu:
        speed = _static_speed_summary(args, prompt, static, half["unpatched_vs_fp32"]["rel_l2"])
        ok = ok and speed["capture_ok"]
    return half, ok, speed


def _tokens_restoration_calls(tokens, ref_tokens, restored, ref, calls) -> dict:
    """The entries of a result that compare the patched model's greedy tokens with ref_tokens, the
    logits after removal with ref (bit for bit), and count the kernel calls."""
    return {
        "greedy_tokens_identical": bool(torch.equal(tokens, ref_tokens)),
        "greedy_common_prefix": common_prefix(tokens, ref_tokens),
        "restored_bit_identical": bool(torch.equal(restored, ref)),
        "kernel_calls": dict(calls),
    }


def _decode_speed(args, stock_tps, stock_runs, patched_tps, patched_runs) -> dict:
    """The "decode" result (and its log line): tokens/s of the unpatched and the patched model."""
    speed = {
        "clock": "CUDA events around the decode loop, batch 1, after a prefill of the prompt",
        "decode_steps": args.decode_steps,
        "reps": args.reps,
        "unpatched_tokens_per_s": stock_tps,
        "patched_tokens_per_s": patched_tps,
        "speedup": patched_tps / stock_tps,
        "unpatched_runs": stock_runs,
        "patched_runs": patched_runs,
    }
    log(f"decode tokens/s: unpatched {stock_tps:.1f}, patched {patched_tps:.1f} (x{patched_tps / stock_tps:.3f})")
    return speed


def _static_speed_summary(args, prompt, static, half_rel_l2: float) -> dict:
    """The "decode" result of a --capture run (and its log line): prefill and decode tokens/s through a StaticCache,
    the decode step captured the same way for the unpatched and the patched model. capture_ok: for each model,
    the captured steps' teacher-forced logits are within half_rel_l2 (relative L2; the unpatched half-precision
    model's distance from its fp32 run) of its uncaptured steps'. A capture replaying stale inputs (a position,
    a cache slot) is off by order 1. Measured on an H100 with cuDNN's attention off: bit-identical (with it on,
    2e-3 to 3e-2: its results vary from run to run); greedy tokens of random weights, whose top logits are
    often closer than bf16 rounding, are reported, not required."""
    stock, patched = static["unpatched"], static["patched"]
    same = stock["captured_tokens_identical_to_uncaptured"] and patched["captured_tokens_identical_to_uncaptured"]
    worst = max(r["captured_vs_uncaptured_logits"]["rel_l2"] for r in (stock, patched))
    speed = {
        "clock": "CUDA events around the prefill and around the decode loop, batch 1, StaticCache",
        "capture": args.capture,
        "context": f"prompt {prompt.shape[1]} tokens, then {args.decode_steps} decode steps",
        "decode_steps": args.decode_steps,
        "reps": args.reps,
        "unpatched": stock,
        "patched": patched,
        "prefill_speedup": patched["prefill_tokens_per_s"] / stock["prefill_tokens_per_s"],
        "decode_speedup": patched["decode_tokens_per_s"] / stock["decode_tokens_per_s"],
        "captured_tokens_identical_to_uncaptured": same,
        "capture_ok": worst <= half_rel_l2,
    }
    log(
        f"StaticCache, decode captured as {args.capture!r}: prefill tokens/s unpatched "
        f"{stock['prefill_tokens_per_s']:.0f}, patched {patched['prefill_tokens_per_s']:.0f} "
        f"(x{speed['prefill_speedup']:.3f}); decode tokens/s unpatched {stock['decode_tokens_per_s']:.1f}, patched "
        f"{patched['decode_tokens_per_s']:.1f} (x{speed['decode_speedup']:.3f}); captured greedy tokens identical to "
        f"the uncaptured static-cache decode: {same}"
    )
    if not speed["capture_ok"]:
        log(
            f"FAILED: the captured decode's logits are {worst:.3e} (relative L2) from the uncaptured decode's, more "
            f"than the half-precision model's own distance from fp32 ({half_rel_l2:.3e})"
        )
    return speed


def _summary(model, prompt, args, gpu, weights, counts, checks, missing, factor, ok) -> dict:
    """The JSON summary; checks: the "fp32", "half" and "decode" results."""
    import injection_common as ic

    return {
        **ic.summary_header(gpu, weights, "transformers"),
        "arch": args.arch,
        "model_class": type(model).__name__,
        "config": {
            k: getattr(model.config, k, None)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "num_local_experts",
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
            )
            if getattr(model.config, k, None) is not None
        },
        "dtype": args.dtype,
        "prompt_len": prompt.shape[1],
        "new_tokens": args.new_tokens,
        "seed": args.seed,
        "skinny_gemm": args.skinny_gemm,
        "capture": args.capture if gpu else "none",
        "sdpa_cudnn": torch.backends.cuda.cudnn_sdp_enabled() if gpu else None,
        "replaced": counts,
        "not_fused": "the MLP residual add with the next layer's first norm (crosses the model's layer loop); a norm "
        "followed by a residual add (Gemma's post-norms, OLMo 2's); per-head q/k norm + RoPE in one launch",
        **checks,
        "thresholds": {
            "fp32": f"rel_max_diff(patched, unpatched) <= {FP32_REL_MAX:g}; greedy tokens identical; restored bit-identical",
            "fp32_moe_routing": "MoE models: the unpatched routing forced where the patched router's differs; each flip "
            f"on a margin <= {ROUTING_TIE_REL:g} of the token's largest |router logit|, at most max({ROUTING_MIN_FLIPS}, "
            f"{ROUTING_MAX_FLIP_SHARE:g} * decisions) flips, every router call forced",
            "half": f"rel_l2(patched, fp32) <= {factor} * rel_l2(unpatched, fp32); restored bit-identical; greedy reported",
            "capture": "with --capture: each model's captured decode steps' logits (teacher-forced) within "
            "rel_l2(unpatched half, fp32) of its uncaptured steps'; greedy tokens reported",
            "kernels": "every injected kind called its kernel; every kind the model has sites of is injected "
            "(missing_kinds empty); sites with no kernel for their function are reported (kernel_gaps), not failed",
        },
        "kinds_without_kernel_calls": missing,
        "ok": ok,
    }


if __name__ == "__main__":
    sys.exit(main())

# SPDX-License-Identifier: Apache-2.0
"""Decoder-LLM families of transformers for transformers_injection.py: tiny test configs, the configs of
released architectures (their config.json numbers, written here: nothing is downloaded), random-weight
builders, and the coverage command (sites per kind found / replaced, on the meta device).

    python transformers_families.py --list                      # the architectures and their families
    python transformers_families.py --coverage                  # JSON: per architecture, per kind
    python transformers_families.py --coverage --markdown       # the table of references/transformers-integration.md
    python transformers_families.py --coverage --write FILE.md  # rewrite the table between FILE's markers
    python transformers_families.py --coverage --check FILE.md  # exit 1 if FILE's table differs from a fresh run

(``python transformers_injection.py --coverage ...`` runs the same.) A family is a transformers model class
(LlamaForCausalLM, Gemma3ForCausalLM, ...); an architecture is a released model of one (Llama-3-8B,
Gemma-3-12B, ...). Random weights follow transformers' initialisation, then every RMSNorm weight is
moved by 0.1 * N(0, 1) (Gemma initialises its norm offsets to 0, which would hide what ``1 + weight``
does), so a wrong norm formula shows in the outputs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import sys
import warnings

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402

import injection_common as ic  # noqa: E402

__all__ = ["FAMILIES", "ARCHS", "tiny_config", "release_config", "build", "build_meta", "coverage_report"]

BEGIN, END = "<!-- transformers-coverage begin -->", "<!-- transformers-coverage end -->"


@dataclasses.dataclass(frozen=True)
class Family:
    model_class: str  # transformers class of the causal LM
    config_class: str
    tiny: dict  # what the tiny test model sets beyond TINY


@dataclasses.dataclass(frozen=True)
class Arch:
    family: str
    title: str
    release: dict  # config.json numbers of the release


# The tiny test model of every family: 2 layers, hidden 64, 4 query heads and 2 key/value heads of 16, MLP
# width 160 (not a power of two), vocabulary 256; the family's own settings on top (FAMILIES[...].tiny).
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)


def _rope(theta: float, **more) -> dict:
    return {"rope_type": "default", "rope_theta": theta, **more}


FAMILIES = {
    "llama": Family("LlamaForCausalLM", "LlamaConfig", dict(rope_parameters=_rope(500000.0))),
    "mistral": Family("MistralForCausalLM", "MistralConfig", dict(rope_parameters=_rope(10000.0))),
    "qwen2": Family("Qwen2ForCausalLM", "Qwen2Config", dict(rope_parameters=_rope(1000000.0))),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3Config", dict(head_dim=16, rope_parameters=_rope(1000000.0))),
    # sliding window 8: the tests' prompts of 9+ tokens reach past it
    "gemma2": Family(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, rope_parameters=_rope(10000.0)),
    ),
    "gemma3": Family(
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "phi3": Family("Phi3ForCausalLM", "Phi3Config", dict(rope_parameters=_rope(10000.0))),
    "mixtral": Family(
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, rope_parameters=_rope(1000000.0)),
    ),
    # layer 1 dense (mlp_only_layers): both MLP forms in one tiny model
    "qwen3_moe": Family(
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            mlp_only_layers=[1],
            rope_parameters=_rope(1000000.0),
        ),
    ),
    "olmo2": Family("Olmo2ForCausalLM", "Olmo2Config", dict(rope_parameters=_rope(500000.0))),
}

# Released architectures: the numbers of their config.json (text model only; Gemma 3's of the text config of
# gemma-3-12b-it, served by Gemma3ForCausalLM). _RELEASES holds what every release sets, one row each (the
# columns: family, title, then _RELEASE_KEYS); _RELEASE_MORE what only some set.
_RELEASE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
)
_GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
# fmt: off
_RELEASES = {
    #                 family       title              vocab   hidden MLP    layers heads kv  positions eps   rope_parameters   bos     eos     tied
    "llama3-8b":     ("llama",     "Llama-3-8B",      128256, 4096,  14336, 32,    32,   8,  8192,     1e-5, _rope(500000.0),  128000, 128001, False),
    "mistral-7b":    ("mistral",   "Mistral-7B-v0.1", 32000,  4096,  14336, 32,    32,   8,  32768,    1e-5, _rope(10000.0),   1,      2,      False),
    "qwen2.5-7b":    ("qwen2",     "Qwen2.5-7B",      152064, 3584,  18944, 28,    28,   4,  131072,   1e-6, _rope(1000000.0), 151643, 151643, False),
    "qwen3-8b":      ("qwen3",     "Qwen3-8B",        151936, 4096,  12288, 36,    32,   8,  40960,    1e-6, _rope(1000000.0), 151643, 151645, False),
    "gemma2-9b":     ("gemma2",    "Gemma-2-9B",      256000, 3584,  14336, 42,    16,   8,  8192,     1e-6, _rope(10000.0),   2,      1,      True),
    "gemma3-12b":    ("gemma3",    "Gemma-3-12B",     262208, 3840,  15360, 48,    16,   8,  131072,   1e-6, _GEMMA3_ROPE,     2,      1,      True),
    "phi3-mini":     ("phi3",      "Phi-3-mini-4k",   32064,  3072,  8192,  32,    32,   32, 4096,     1e-5, _rope(10000.0),   1,      32000,  False),
    "mixtral-8x7b":  ("mixtral",   "Mixtral-8x7B",    32000,  4096,  14336, 32,    32,   8,  32768,    1e-5, _rope(1000000.0), 1,      2,      False),
    "qwen3-30b-a3b": ("qwen3_moe", "Qwen3-30B-A3B",   151936, 2048,  6144,  48,    32,   4,  40960,    1e-6, _rope(1000000.0), 151643, 151645, False),
    "olmo2-7b":      ("olmo2",     "OLMo-2-1124-7B",  100352, 4096,  11008, 32,    32,   32, 4096,     1e-6, _rope(500000.0),  None,   100257, False),
}
# fmt: on
# what the Gemma 2 and Gemma 3 releases set alike
_GEMMA = dict(head_dim=256, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", pad_token_id=0)
_RELEASE_MORE = {
    "llama3-8b": dict(hidden_act="silu"),
    "mistral-7b": dict(sliding_window=4096),
    "qwen3-8b": dict(head_dim=128),
    "gemma2-9b": dict(_GEMMA, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3-12b": dict(_GEMMA, sliding_window=1024, sliding_window_pattern=6),
    "phi3-mini": dict(original_max_position_embeddings=4096, sliding_window=2047, pad_token_id=32000),
    "mixtral-8x7b": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen3-30b-a3b": dict(
        moe_intermediate_size=768,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
    ),
    "olmo2-7b": dict(pad_token_id=100277),
}
ARCHS = {
    name: Arch(family, title, {**dict(zip(_RELEASE_KEYS, row, strict=True)), **_RELEASE_MORE.get(name, {})})
    for name, (family, title, *row) in _RELEASES.items()
}


def _config(family: str, kwargs: dict):
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, FAMILIES[family].config_class)(**kwargs)


def tiny_config(family: str, **overrides):
    """The tiny test config of a family (TINY, the family's own settings, then overrides)."""
    return _config(family, {**TINY, **FAMILIES[family].tiny, **overrides})


def release_config(arch: str, *, num_layers=None, **overrides):
    """The config of a released architecture (ARCHS), optionally with fewer decoder layers."""
    kw = {**ARCHS[arch].release, **overrides}
    if num_layers is not None:
        kw["num_hidden_layers"] = num_layers
    return _config(ARCHS[arch].family, kw)


def family_of(config) -> str:
    """The family whose config class config is."""
    for name, fam in FAMILIES.items():
        if type(config).__name__ == fam.config_class:
            return name
    raise ValueError(f"no family has the config class {type(config).__name__}")


def _model_class(config):
    import transformers

    return getattr(transformers, FAMILIES[family_of(config)].model_class)


def random_model(model_class, config, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """model_class(config) with transformers' random initialisation from `seed`, built directly on `device` in
    `dtype` (an 8B architecture in bf16 takes ~16 GB and never exists in fp32)."""
    torch.manual_seed(seed)
    with ic.default_dtype(dtype), torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_class(config)


def meta_model(model_class, config):
    """model_class(config) with its parameters on the meta device (no memory, no weights), e.g. to count what
    injection replaces in a large architecture. accelerate's init_empty_weights backs up the
    torch.device("meta") context: torch caches the set of factory functions that context redirects, and if
    that cache was filled while torch.empty was wrapped (a test harness, a profiler), the context silently
    allocates real memory instead."""
    from accelerate import init_empty_weights

    with torch.device("meta"), init_empty_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_class(config)


def build(config, *, device="cpu", dtype=torch.float32, seed: int = 0):
    """The family's causal LM with random weights, built directly on `device` in `dtype`, in eval mode,
    parameters without gradients; every RMSNorm weight moved by 0.1 * N(0, 1) (seeded)."""
    import transformers_injection as ti

    model = random_model(_model_class(config), config, device=device, dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if ti._norm_structure(m):
                m.weight.add_((0.1 * torch.randn(m.weight.shape, generator=g)).to(m.weight))
    model.requires_grad_(False)
    return model.eval()


def build_meta(arch_or_config, *, num_layers=None):
    """The causal LM of an architecture (a name of ARCHS, or a config) with its parameters on the meta
    device (meta_model)."""
    config = (
        release_config(arch_or_config, num_layers=num_layers) if isinstance(arch_or_config, str) else arch_or_config
    )
    return meta_model(_model_class(config), config)


# --------------------------------------------------------------------------------------------
# Coverage: per architecture, the sites per kind found and replaced
# --------------------------------------------------------------------------------------------
def _qk_norms(model, ti) -> dict:
    """The norms inside attention layers (q/k norms): how many, how many replaced, and whether they
    normalise per head (weight of head_dim) or across heads."""
    found, replaced, per_head = 0, 0, set()
    for m in model.modules():
        if ti._rope_globals(type(m)) is None:
            continue
        for c in m.children():
            if ti._norm_structure(c):
                found += 1
                replaced += ti._STATE in c.__dict__
                per_head.add(c.weight.shape[0] == getattr(m, "head_dim", None))
    return {"sites": found, "replaced": replaced, "per_head": sorted(per_head)}


def arch_report(arch: str) -> dict:
    """Build an architecture on the meta device, inject every kind (skinny_gemm too), count, remove."""
    import transformers_injection as ti

    model = build_meta(arch)
    counts = ti.inject_optimized_kernels(model, skinny_gemm=True, verbose=False)
    cov = ti.coverage(model)
    forms = collections.Counter(ti.layer_form(m) for m in model.modules() if ti._layer_structure(m) is not None)
    qk = _qk_norms(model, ti)
    gaps, missing = ti.kernel_gaps(model), ti.missing_kinds(model)
    restored = ti.remove_optimized_kernels(model, verbose=False)
    left = {k: v for k, v in ti.injected_counts(model).items() if v}
    return {
        "arch": arch,
        "title": ARCHS[arch].title,
        "model_class": FAMILIES[ARCHS[arch].family].model_class,
        "layers": model.config.num_hidden_layers,
        "injected": counts,
        "coverage": {k: {"sites": r["sites"], "replaced": r["replaced"], "left": r["left"]} for k, r in cov.items()},
        "layer_forms": dict(forms),
        "qk_norms": qk,
        "kernel_gaps": gaps,
        "missing_kinds": missing,
        "restored_all": restored == counts and not left,
    }


def coverage_report(archs=None) -> dict:
    import transformers

    rows = [arch_report(a) for a in (archs or ARCHS)]
    return {"transformers": transformers.__version__, "torch": torch.__version__, "rows": rows}


_COLUMNS = ("rmsnorm", "fused_add_rmsnorm", "swiglu", "geglu", "moe_swiglu", "rope", "skinny_gemm")


def _cell(row, kind) -> str:
    c = row["coverage"][kind]
    if not c["sites"]:
        return "-"
    cell = f"{c['replaced']}/{c['sites']}"
    if kind == "rmsnorm" and row["qk_norms"]["sites"]:
        qk = row["qk_norms"]
        cell += f" ({qk['replaced']}/{qk['sites']} q/k)"
    return cell


def _left_note(row) -> str:
    """What the row's model keeps in PyTorch, by kind of gap (generated from the report)."""
    notes = []
    for kind, why in row["kernel_gaps"].items():
        n = row["coverage"][kind]["sites"] - row["coverage"][kind]["replaced"]
        what = "GeGLU from a fused projection with the gate first" if kind == "geglu" else why
        notes.append(f"{kind} x{n}: {what} (no kernel)")
    forms = row["layer_forms"]
    if forms.get("sandwich"):
        notes.append("post-attention / post-MLP norm + residual add (no kernel)")
    if forms.get("post-norm"):
        notes.append("norm + residual add, twice per layer (no kernel)")
    if True in row["qk_norms"]["per_head"]:
        notes.append("per-head q/k norm and RoPE: separate launches (no rotate-half fused kernel)")
    for kind, why in row["missing_kinds"].items():
        notes.append(f"MISSING {kind}: {why}")
    return "; ".join(notes) or "-"


def markdown(rep: dict) -> str:
    """The coverage table (with its markers), as references/transformers-integration.md holds it."""
    head = ["architecture (class)", "layers", *_COLUMNS, "decoder layer", "left to PyTorch"]
    lines = [
        BEGIN,
        "",
        f"Generated with transformers {rep['transformers']}, torch {rep['torch']} on the meta device by "
        "`python scripts/transformers_injection.py --coverage --write references/transformers-integration.md`. "
        "Cells: sites replaced / sites found (skinny_gemm: with `skinny_gemm=True`); `-`: the model has none.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in rep["rows"]:
        forms = ", ".join(f"{f} x{n}" for f, n in sorted(row["layer_forms"].items(), key=lambda kv: str(kv[0])))
        cells = [f"{row['title']} (`{row['model_class']}`)", str(row["layers"])]
        cells += [_cell(row, k) for k in _COLUMNS] + [forms or "-", _left_note(row)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", END]
    return "\n".join(lines)


def _replace_table(text: str, table: str, path: str) -> str:
    pattern = re.compile(re.escape(BEGIN) + ".*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {BEGIN} ... {END} markers")
    return pattern.sub(lambda _: table, text, count=1)


def coverage_main(as_markdown=False, write=None, check=None, rep=None) -> int:
    """The coverage command: JSON (default), the markdown table, rewrite FILE's table, or check it (rep: a
    coverage_report() already made). Exit status 1 when removal left something, a kind is missing, or
    (check) the file's table differs."""
    rep = rep if rep is not None else coverage_report()
    bad = [r["arch"] for r in rep["rows"] if not r["restored_all"] or r["missing_kinds"]]
    table = markdown(rep)
    if write:
        with open(write) as f:
            text = f.read()
        with open(write, "w") as f:
            f.write(_replace_table(text, table, write))
        print(f"wrote the coverage table of {len(rep['rows'])} architectures to {write}", file=sys.stderr)
    elif check:
        with open(check) as f:
            text = f.read()
        if table not in text:
            print(
                f"{check}: the coverage table differs from a fresh run (transformers {rep['transformers']}); "
                f"run python scripts/transformers_injection.py --coverage --write {check}",
                file=sys.stderr,
            )
            return 1
        print(f"{check}: the coverage table is current", file=sys.stderr)
    elif as_markdown:
        print(table)
    else:
        print(json.dumps(rep, indent=1))
    if bad:
        print(f"removal left patches or a kind is missing in: {bad}", file=sys.stderr)
    return 1 if bad else 0


def add_coverage_options(p: argparse.ArgumentParser) -> None:
    """The coverage command's options (--coverage, --markdown, --write FILE, --check FILE) on the parser p: this
    file's and transformers_injection.py's."""
    p.add_argument("--coverage", action="store_true", help="sites per kind found / replaced, per architecture (JSON)")
    p.add_argument("--markdown", action="store_true", help="with --coverage: the markdown table")
    p.add_argument("--write", metavar="FILE", help="with --coverage: rewrite the table between FILE's markers")
    p.add_argument("--check", metavar="FILE", help="with --coverage: exit 1 if FILE's table differs from a fresh run")


def coverage_requested(args) -> bool:
    """Whether the parsed options (add_coverage_options) ask for the coverage command."""
    return bool(args.coverage or args.markdown or args.write or args.check)


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the architectures (name, family, class, layers)")
    add_coverage_options(p)
    args = p.parse_args(argv)
    if coverage_requested(args):
        return coverage_main(args.markdown, args.write, args.check)
    for name, a in ARCHS.items():
        print(f"{name:16s} {a.title:18s} {FAMILIES[a.family].model_class:22s} {a.release['num_hidden_layers']} layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

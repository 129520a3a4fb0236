# SPDX-License-Identifier: Apache-2.0
"""Random-weight diffusers transformers of released architectures, and the inputs of one forward, as their
pipelines build them (no hub access: the architecture comes from the class, the weights from a seed).

    import model_zoo as mz
    model = mz.build("flux2", "tiny")                # or "real"; dtype=, device=, seed=, blocks=
    kw = mz.inputs("flux2", model, "tiny")           # model(**kw): one denoiser forward
    out = mz.run(model, kw)                          # the main output tensor, without autograd
    print(mz.describe("flux2", "real"))

Models (NAMES): FLUX.2-dev, Qwen-Image, LTX-2 (video + audio), HunyuanVideo-1.5 480p, Z-Image(-Turbo),
CogVideoX-5B, SANA 1600M 1024px, Wan2.1-VACE-1.3B. size "tiny": one or two blocks of each kind, 32 wide, head dims of 8 or
more with RoPE axes that add up to them: a forward takes seconds on the CPU through Triton's interpreter.
size "real": the released architecture (the sources of the numbers are named at each table), at the
resolution and frame count of the pipeline's defaults (``describe``). ``blocks`` keeps that many blocks of
each block list (a real model that does not fit in memory, or a quick timing).

Weights: the class constructor's random initialisation on ``device`` in ``dtype`` (a fixed seed), norm weights
drawn around 1 and biases around 0 (a trained checkpoint has no unit norm weights to hide a swapped weight),
parameters the constructor leaves at zero drawn small (zero-initialised projections would cut paths out of
the output); the modules a class lists in ``_keep_in_fp32_modules`` stay fp32, as
``from_pretrained(torch_dtype=dtype)`` leaves them; eval mode, no gradients.

Inputs: as each pipeline's ``__call__`` hands them to the transformer (the pipelines' own packing and position
helpers where they have them): packed latents, text embeddings of the pipeline's default length with its
attention mask (a prompt filling 3/4 of it, each further prompt of a batch half as long as the one before),
timesteps in the pipeline's scale and dtype (one per sample, each drawn: a batch of requests at different
steps), guidance, RoPE ids / image shapes / coordinates, ``return_dict=False``. Run ``python model_zoo.py
--list`` for the real architectures' parameter counts and token counts (meta device, no memory).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import injection_common as ic  # noqa: E402

__all__ = ["NAMES", "build", "inputs", "describe", "run", "token_counts"]

NAMES = ("flux2", "qwen_image", "ltx2", "hunyuan_video15", "z_image", "cogvideox", "sana", "wan_vace")
SIZES = ("tiny", "real")


@dataclass(frozen=True)
class _Model:
    cls: str  # "<diffusers.models.transformers module>:<class>"
    title: str
    real: dict  # constructor arguments over the class defaults: the release
    tiny: dict
    blocks: tuple  # the config keys of the block lists' lengths
    geometry: dict  # size -> pixels / frames / text tokens of one forward
    arch: Callable  # config -> "N blocks, H x D = W wide"
    tokens: Callable  # (geometry, config) -> {stream: tokens}
    make: Callable  # (model, config, geometry, batch, _Draw) -> forward kwargs


def _pipe(path: str):
    """A class of diffusers.pipelines ("flux2.pipeline_flux2:Flux2Pipeline"): its packing / position helpers."""
    module, name = path.split(":")
    return getattr(importlib.import_module(f"diffusers.pipelines.{module}"), name)


class _Draw:
    """Random inputs from one CPU generator (reproducible on any device); on the meta device, shapes only."""

    def __init__(self, seed: int, dtype: torch.dtype, device):
        self.g = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, torch.device(device)
        self.meta = self.device.type == "meta"

    def randn(self, *shape, dtype=None):
        dtype = dtype or self.dtype
        if self.meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        return torch.randn(shape, generator=self.g).to(self.device, dtype)

    def zeros(self, *shape, dtype=None):
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    def put(self, t: torch.Tensor, dtype=None) -> torch.Tensor:
        """A tensor made on the CPU (ids, coordinates, RoPE tables) on the device."""
        return t.to(self.device, dtype or t.dtype)

    def timestep(self, batch: int, scale: float = 1000.0, dtype=torch.float32) -> torch.Tensor:
        """One timestep per sample in (0.05, 0.95) * scale (integers for an integer dtype)."""
        t = (0.05 + 0.9 * torch.rand(batch, generator=self.g)) * scale
        return self.put(t.round() if not dtype.is_floating_point else t, dtype)

    def mask(self, batch: int, length: int, full: bool = False) -> torch.Tensor:
        """A tokenizer's attention mask [B, L] (int64, right padding): prompt 0 fills 3/4 of the length (all of it
        with full=True), each further prompt half as many tokens as the one before (at least one)."""
        return self.put(
            (torch.arange(length)[None] < torch.tensor(_prompt_lengths(batch, length, full))[:, None]).long()
        )


def _prompt_lengths(batch: int, length: int, full: bool = False) -> list:
    first = length if full else max(1, 3 * length // 4)
    return [max(1, first >> i) for i in range(batch)]


# --------------------------------------------------------------------------------------------
# Inputs of one forward, per model (each mirrors its pipeline's __call__; geometry g: pixels, frames, tokens)
# --------------------------------------------------------------------------------------------
def _flux2_inputs(model, cfg, g, batch, d):
    # Flux2Pipeline: VAE 8x, 2x2 patches packed into channels (in_channels = 4 x 32 latent channels); Mistral
    # features of every one of the 512 positions, no mask; guidance_scale 4.0; the timestep as sigma (t / 1000)
    p = _pipe("flux2.pipeline_flux2:Flux2Pipeline")
    latents = d.randn(batch, cfg.in_channels, g["height"] // 16, g["width"] // 16)
    text = d.randn(batch, g["text"], cfg.joint_attention_dim)
    return dict(
        hidden_states=p._pack_latents(latents),  # [B, H*W, C], a transposed view as the pipeline passes it
        encoder_hidden_states=text,
        timestep=d.timestep(batch, 1.0, d.dtype),
        img_ids=d.put(p._prepare_latent_ids(latents)),
        txt_ids=d.put(p._prepare_text_ids(text)),
        guidance=d.put(torch.full((batch,), 4.0)) if cfg.guidance_embeds else None,
        return_dict=False,
    )


def _qwen_image_inputs(model, cfg, g, batch, d):
    # QwenImagePipeline: latents [B, 1, 16, H/8, W/8] packed 2x2; prompts padded to the longest one of the batch
    # (no mask when none is padded), at most max_sequence_length 512; the timestep as sigma (t / 1000)
    p = _pipe("qwenimage.pipeline_qwenimage:QwenImagePipeline")
    channels, h, w = cfg.in_channels // 4, 2 * (g["height"] // 16), 2 * (g["width"] // 16)
    latents = d.randn(batch, 1, channels, h, w)
    mask = d.mask(batch, g["text"], full=True)
    return dict(
        hidden_states=p._pack_latents(latents, batch, channels, h, w),
        encoder_hidden_states=d.randn(batch, g["text"], cfg.joint_attention_dim),
        encoder_hidden_states_mask=None if batch == 1 else mask,
        timestep=d.timestep(batch, 1.0, d.dtype),
        img_shapes=[[(1, h // 2, w // 2)]] * batch,
        return_dict=False,
    )


def _ltx2_frames(g) -> tuple:
    # LTX2Pipeline: VAE 32x spatial / 8x temporal; audio: 16 kHz, hop 160, 4x temporal compression, 24 fps
    video = ((g["frames"] - 1) // 8 + 1, g["height"] // 32, g["width"] // 32)
    return video, round(g["frames"] / 24.0 * 16000 / 160 / 4)


def _ltx2_inputs(model, cfg, g, batch, d):
    # LTX2Pipeline: packed latents (patch 1), audio latents [B, 8, L, mel / 4] packed to [B, L, 8 * mel / 4]; the
    # text connectors' outputs for video and audio (1024 tokens: their registers take the padding's place, so the
    # mask they return is all ones); timestep t and sigma t in [0, 1000]; RoPE coordinates precomputed at 24 fps
    p = _pipe("ltx2.pipeline_ltx2:LTX2Pipeline")
    (frames, h, w), audio_frames = _ltx2_frames(g)
    latents = d.randn(batch, cfg.in_channels, frames, h, w)
    audio = d.randn(batch, 8, audio_frames, cfg.audio_in_channels // 8)
    mask = d.mask(batch, g["text"], full=True)
    t = d.timestep(batch)
    fps = 24.0
    return dict(
        hidden_states=p._pack_latents(latents, cfg.patch_size, cfg.patch_size_t),
        audio_hidden_states=p._pack_audio_latents(audio),
        encoder_hidden_states=d.randn(batch, g["text"], cfg.caption_channels),
        audio_encoder_hidden_states=d.randn(batch, g["text"], cfg.caption_channels),
        timestep=t,
        sigma=t,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=frames,
        height=h,
        width=w,
        fps=fps,
        audio_num_frames=audio_frames,
        video_coords=d.put(model.rope.prepare_video_coords(batch, frames, h, w, "cpu", fps=fps)),
        audio_coords=d.put(model.audio_rope.prepare_audio_coords(batch, audio_frames, "cpu")),
        isolate_modalities=False,
        use_cross_timestep=True,
        return_dict=False,
    )


def _hunyuan_video15_inputs(model, cfg, g, batch, d):
    # HunyuanVideo15Pipeline (text to video): VAE 16x spatial / 4x temporal; latents, zero condition latents and
    # a zero mask channel concatenated (in_channels = 2 x 32 + 1); Qwen2.5-VL features padded to 1000 tokens,
    # ByT5 glyph features padded to 256, SigLIP image embeddings all zero (729 tokens); timestep in [0, 1000]
    p = _pipe("hunyuan_video1_5.pipeline_hunyuan_video1_5:HunyuanVideo15Pipeline")
    shape = (batch, cfg.out_channels, (g["frames"] - 1) // 4 + 1, g["height"] // 16, g["width"] // 16)
    latents = d.randn(*shape)
    cond, cond_mask = p.prepare_cond_latents_and_mask(None, latents, d.dtype, d.device)
    return dict(
        hidden_states=torch.cat([latents, cond, cond_mask], dim=1),
        timestep=d.timestep(batch, dtype=d.dtype),
        encoder_hidden_states=d.randn(batch, g["text"], cfg.text_embed_dim),
        encoder_attention_mask=d.mask(batch, g["text"]),
        encoder_hidden_states_2=d.randn(batch, g["glyph"], cfg.text_embed_2_dim),
        encoder_attention_mask_2=d.mask(batch, g["glyph"]),  # a prompt with quoted text to render
        image_embeds=d.zeros(batch, g["image"], cfg.image_embed_dim),
        return_dict=False,
    )


def _z_image_inputs(model, cfg, g, batch, d):
    # ZImagePipeline: a list of latents [16, 1, H/8, W/8], one per sample; the prompts' valid tokens only (Qwen3
    # features; max_sequence_length 512), one list entry each; t = (1000 - timestep) / 1000 in fp32
    latents = d.randn(batch, cfg.in_channels, 2 * (g["height"] // 16), 2 * (g["width"] // 16))
    return dict(
        x=list(latents.unsqueeze(2).unbind(dim=0)),
        t=d.timestep(batch, 1.0),
        cap_feats=[d.randn(n, cfg.cap_feat_dim) for n in _prompt_lengths(batch, g["text"], full=True)],
        return_dict=False,
    )


def _cogvideox_inputs(model, cfg, g, batch, d):
    # CogVideoXPipeline: latents [B, F, C, H/8, W/8] (VAE 8x spatial / 4x temporal); T5 features of 226 tokens, no
    # mask; integer DDIM timesteps; the 3D RoPE tables of the pipeline (fp32)
    p = _pipe("cogvideo.pipeline_cogvideox:CogVideoXPipeline")
    frames = (g["frames"] - 1) // 4 + 1
    host = SimpleNamespace(vae_scale_factor_spatial=8, transformer=model)
    cos, sin = p._prepare_rotary_positional_embeddings(host, g["height"], g["width"], frames, torch.device("cpu"))
    return dict(
        hidden_states=d.randn(batch, frames, cfg.in_channels, g["height"] // 8, g["width"] // 8),
        encoder_hidden_states=d.randn(batch, g["text"], cfg.text_embed_dim),
        timestep=d.timestep(batch, dtype=torch.int64),
        image_rotary_emb=(d.put(cos), d.put(sin)),
        return_dict=False,
    )


def _sana_inputs(model, cfg, g, batch, d):
    # SanaPipeline: latents [B, 32, H/32, W/32] (DC-AE); Gemma-2 features of 300 tokens with the tokenizer's mask;
    # timestep in [0, 1000] x timestep_scale
    return dict(
        hidden_states=d.randn(batch, cfg.in_channels, g["height"] // 32, g["width"] // 32),
        encoder_hidden_states=d.randn(batch, g["text"], cfg.caption_channels),
        encoder_attention_mask=d.mask(batch, g["text"]),
        timestep=d.timestep(batch, 1000.0 * cfg.timestep_scale),
        return_dict=False,
    )


def _wan_vace_inputs(model, cfg, g, batch, d):
    # WanVACEPipeline (control video, no reference images): VAE 8x spatial / 4x temporal; the control stream is the
    # control video's latents and its mask packed into vace_in_channels (96: 2 x 16 + 64), drawn at random here;
    # UMT5 features of 512 positions, zero past each prompt's length; UniPC's integer timesteps; one
    # conditioning scale per VACE block (the default 1.0)
    shape = (batch, cfg.in_channels, (g["frames"] - 1) // 4 + 1, g["height"] // 8, g["width"] // 8)
    text = d.randn(batch, g["text"], cfg.text_dim)
    return dict(
        hidden_states=d.randn(*shape),
        timestep=d.timestep(batch, dtype=torch.int64),
        encoder_hidden_states=text * d.mask(batch, g["text"])[..., None].to(text.dtype),
        control_hidden_states=d.randn(batch, cfg.vace_in_channels, *shape[2:]),
        control_hidden_states_scale=d.put(torch.ones(len(cfg.vace_layers)), d.dtype),
        return_dict=False,
    )


def _image(factor):
    return lambda g, cfg: {"image": (g["height"] // factor) * (g["width"] // factor), "text": g["text"]}


def _video(g, temporal: int, spatial: int) -> int:
    return ((g["frames"] - 1) // temporal + 1) * (g["height"] // spatial) * (g["width"] // spatial)


def _heads(cfg, heads="num_attention_heads", dim="attention_head_dim"):
    return f"{cfg[heads]} x {cfg[dim]} = {cfg[heads] * cfg[dim]} wide"


def _px(height, width, text, **more):
    return dict(height=height, width=width, text=text, **more)


# --------------------------------------------------------------------------------------------
# The models: the release's constructor arguments (with where they come from), a tiny one, the geometry
# --------------------------------------------------------------------------------------------
_TINY = dict(num_attention_heads=2, attention_head_dim=16)  # 32 wide, head dim 16 (RoPE axes adding up to 16)
_MODELS = {
    "flux2": _Model(
        "transformer_flux2:Flux2Transformer2DModel",
        "FLUX.2-dev",
        # class defaults = black-forest-labs/FLUX.2-dev (diffusers' scripts/convert_flux2_to_diffusers.py,
        # "flux2-dev"): 8 double + 48 single blocks, 48 x 128 = 6144 wide, text 3 x 5120 = 15360 (Mistral layers
        # 10, 20, 30), RoPE axes 4 x 32, guidance embedding
        real=dict(),
        tiny=dict(
            _TINY, in_channels=16, num_layers=1, num_single_layers=1, joint_attention_dim=24, axes_dims_rope=(4,) * 4
        ),
        blocks=("num_layers", "num_single_layers"),
        # pipeline defaults: 1024 x 1024 (128 x the VAE's 8), max_sequence_length 512
        geometry={"real": _px(1024, 1024, 512), "tiny": _px(64, 64, 8)},
        arch=lambda c: f"{c['num_layers']} double + {c['num_single_layers']} single blocks, {_heads(c)}",
        tokens=_image(16),
        make=_flux2_inputs,
    ),
    "qwen_image": _Model(
        "transformer_qwenimage:QwenImageTransformer2DModel",
        "Qwen-Image",
        # class defaults = Qwen/Qwen-Image transformer/config.json: 60 blocks, 24 x 128 = 3072 wide, text 3584
        # (Qwen2.5-VL-7B), 64 = 16 x 2 x 2 input channels, RoPE axes 16 + 56 + 56
        real=dict(),
        tiny=dict(
            _TINY, in_channels=16, out_channels=4, num_layers=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6)
        ),
        blocks=("num_layers",),
        # pipeline defaults: 1024 x 1024 (default_sample_size 128 x 8), max_sequence_length 512
        geometry={"real": _px(1024, 1024, 512), "tiny": _px(64, 64, 8)},
        arch=lambda c: f"{c['num_layers']} dual-stream blocks, {_heads(c)}",
        tokens=_image(16),
        make=_qwen_image_inputs,
    ),
    "ltx2": _Model(
        "transformer_ltx2:LTX2VideoTransformer3DModel",
        "LTX-2",
        # class defaults = Lightricks/LTX-2 (19B audio-video): 48 blocks, video 32 x 128 = 4096, audio 32 x 64 =
        # 2048, Gemma-3 12B text 3840; except rope_type "split", the release's (diffusers'
        # scripts/convert_ltx2_to_diffusers.py, version 2.0, and the checkpoint's metadata); the class default
        # is "interleaved"
        real=dict(rope_type="split"),
        tiny=dict(
            _TINY,
            in_channels=8,
            out_channels=8,
            cross_attention_dim=32,
            num_layers=2,
            caption_channels=24,
            audio_in_channels=16,
            audio_out_channels=16,
            audio_num_attention_heads=2,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
            rope_type="split",
        ),
        blocks=("num_layers",),
        # pipeline defaults: 121 frames of 512 x 768 at 24 fps, max_sequence_length 1024
        geometry={"real": _px(512, 768, 1024, frames=121), "tiny": _px(64, 64, 8, frames=9)},
        arch=lambda c: (
            f"{c['num_layers']} audio-video blocks, video {_heads(c)}, audio "
            + _heads(c, "audio_num_attention_heads", "audio_attention_head_dim")
        ),
        tokens=lambda g, c: {"video": _video(g, 8, 32), "audio": _ltx2_frames(g)[1], "text": g["text"]},
        make=_ltx2_inputs,
    ),
    "hunyuan_video15": _Model(
        "transformer_hunyuan_video15:HunyuanVideo15Transformer3DModel",
        "HunyuanVideo-1.5 480p T2V",
        # class defaults = hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v transformer/config.json
        # (54 blocks, 16 x 128 = 2048 wide, 65 = 2 x 32 + 1 input channels, target_size 640: the 480p buckets),
        # except task_type "t2v" (a label: the class default "i2v" builds the same modules)
        real=dict(task_type="t2v"),
        tiny=dict(
            _TINY,
            in_channels=9,
            out_channels=4,
            num_layers=2,
            num_refiner_layers=1,
            text_embed_dim=24,
            text_embed_2_dim=20,
            image_embed_dim=12,
            rope_axes_dim=(4, 6, 6),
            task_type="t2v",
        ),
        blocks=("num_layers",),
        # pipeline defaults: 121 frames, 480 x 848 (the 16:9 bucket of target_size 640); text 1000 (Qwen2.5-VL),
        # glyph text 256 (ByT5), 729 image tokens (SigLIP)
        geometry={
            "real": _px(480, 848, 1000, frames=121, glyph=256, image=729),
            "tiny": _px(64, 64, 8, frames=5, glyph=4, image=4),
        },
        arch=lambda c: (
            f"{c['num_layers']} dual-stream blocks + a {c['num_refiner_layers']}-block text refiner, " + _heads(c)
        ),
        tokens=lambda g, c: {"video": _video(g, 4, 16), "text": g["text"], "glyph": g["glyph"], "image": g["image"]},
        make=_hunyuan_video15_inputs,
    ),
    "z_image": _Model(
        "transformer_z_image:ZImageTransformer2DModel",
        "Z-Image-Turbo",
        # class defaults = Tongyi-MAI/Z-Image-Turbo transformer/config.json: 30 blocks + 2 + 2 refiner blocks,
        # 30 x 128 = 3840 wide, Qwen3-4B text 2560, RoPE axes 32 + 48 + 48; except axes_lens (1536, 512, 512), as
        # public copies of the Turbo config give it (class default (1024, 512, 512): RoPE table lengths, no weights)
        real=dict(axes_lens=(1536, 512, 512)),
        tiny=dict(
            in_channels=4,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            cap_feat_dim=24,
            axes_dims=(4, 6, 6),
        ),
        blocks=("n_layers", "n_refiner_layers"),
        # pipeline defaults: 1024 x 1024, max_sequence_length 512 (a prompt that long)
        geometry={"real": _px(1024, 1024, 512), "tiny": _px(64, 64, 8)},
        arch=lambda c: (
            f"{c['n_layers']} blocks + {c['n_refiner_layers']} noise / {c['n_refiner_layers']} context "
            f"refiner blocks, {c['n_heads']} x {c['dim'] // c['n_heads']} = {c['dim']} wide"
        ),
        tokens=_image(16),
        make=_z_image_inputs,
    ),
    "cogvideox": _Model(
        "cogvideox_transformer_3d:CogVideoXTransformer3DModel",
        "CogVideoX-5B",
        # THUDM/CogVideoX-5b transformer/config.json (the class defaults are CogVideoX-2B's): 42 blocks, 48 x 64 =
        # 3072 wide, 3D RoPE instead of the sincos position embedding
        real=dict(num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True),
        tiny=dict(
            _TINY,
            in_channels=4,
            out_channels=4,
            time_embed_dim=16,
            text_embed_dim=24,
            num_layers=2,
            sample_width=4,
            sample_height=4,
            sample_frames=5,
            max_text_seq_length=8,
            use_rotary_positional_embeddings=True,
        ),
        blocks=("num_layers",),
        # pipeline defaults: 49 frames of 480 x 720 (sample size x 8), max_sequence_length 226
        geometry={"real": _px(480, 720, 226, frames=49), "tiny": _px(32, 32, 8, frames=5)},
        arch=lambda c: f"{c['num_layers']} blocks, {_heads(c)}",
        tokens=lambda g, c: {"video": _video(g, 4, 16), "text": g["text"]},
        make=_cogvideox_inputs,
    ),
    "sana": _Model(
        "sana_transformer:SanaTransformer2DModel",
        "SANA 1600M 1024px",
        # class defaults = Efficient-Large-Model/Sana_1600M_1024px_diffusers (diffusers'
        # scripts/convert_sana_to_diffusers.py, SanaMS_1600M_P1_D20): 20 blocks, 70 x 32 = 2240 wide linear
        # attention, cross-attention 20 x 112, Gemma-2-2B text 2304, sample size 32 (1024 px / DC-AE's 32)
        real=dict(),
        tiny=dict(
            _TINY,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            num_cross_attention_heads=2,
            cross_attention_head_dim=16,
            cross_attention_dim=32,
            caption_channels=24,
            sample_size=4,
        ),
        blocks=("num_layers",),
        # pipeline defaults: 1024 x 1024 (sample size 32 x the DC-AE's 32), max_sequence_length 300
        geometry={"real": _px(1024, 1024, 300), "tiny": _px(128, 128, 8)},
        arch=lambda c: f"{c['num_layers']} blocks, {_heads(c)}",
        tokens=_image(32),
        make=_sana_inputs,
    ),
    "wan_vace": _Model(
        "transformer_wan_vace:WanVACETransformer3DModel",
        "Wan2.1-VACE-1.3B",
        # Wan-AI/Wan2.1-VACE-1.3B-diffusers (diffusers' scripts/convert_wan_to_diffusers.py, "Wan-VACE-1.3B"): the
        # Wan 2.1 T2V 1.3B blocks (30, 12 x 128 = 1536 wide, ffn 8960, UMT5 text 4096) and 15 VACE blocks after
        # blocks 0, 2, ..., 28, control input of 96 channels (the class defaults are the 14B's)
        real=dict(
            num_attention_heads=12, ffn_dim=8960, num_layers=30, vace_layers=list(range(0, 30, 2)), vace_in_channels=96
        ),
        tiny=dict(
            _TINY,
            in_channels=4,
            out_channels=4,
            text_dim=24,
            freq_dim=32,
            ffn_dim=64,
            num_layers=3,
            vace_layers=[0, 2],
            vace_in_channels=8,
            rope_max_seq_len=64,
        ),
        blocks=("num_layers",),  # (and the VACE blocks after the blocks kept)
        # pipeline defaults: 81 frames of 480 x 832, max_sequence_length 512
        geometry={"real": _px(480, 832, 512, frames=81), "tiny": _px(64, 64, 8, frames=9)},
        arch=lambda c: f"{c['num_layers']} blocks + {len(c['vace_layers'])} VACE blocks, {_heads(c)}",
        tokens=lambda g, c: {"video": _video(g, 4, 16), "text": g["text"]},
        make=_wan_vace_inputs,
    ),
}


def _spec(name: str, size: str = "tiny") -> _Model:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(NAMES)}")
    if size not in SIZES:
        raise ValueError(f"size must be 'tiny' or 'real', got {size!r}")
    return _MODELS[name]


def _class(spec: _Model):
    module, name = spec.cls.split(":")
    return getattr(importlib.import_module(f"diffusers.models.transformers.{module}"), name)


def _config(name: str, size: str, blocks: Optional[int] = None) -> dict:
    """The constructor arguments of name at size: the class defaults, then the table's, then blocks."""
    spec = _spec(name, size)
    params = inspect.signature(_class(spec).__init__).parameters
    cfg = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    cfg.update(spec.real if size == "real" else spec.tiny)
    if blocks is not None:
        if blocks < 1:
            raise ValueError(f"blocks must be at least 1, got {blocks}")
        cfg.update({k: min(blocks, cfg[k]) for k in spec.blocks})
        if "vace_layers" in cfg:  # (VACE blocks attach to blocks: those of the blocks kept)
            cfg["vace_layers"] = [i for i in cfg["vace_layers"] if i < cfg["num_layers"]]
    return cfg


_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _is_norm(m: nn.Module) -> bool:
    return isinstance(m, _NORMS) or type(m).__name__ in ("RMSNorm", "FP32LayerNorm", "LayerNorm")


@torch.no_grad()
def _trained_looking_(model: nn.Module) -> None:
    """Norm weights ~ N(1, 0.1) and biases ~ N(0, 0.1); parameters the constructor left all zero ~ N(0, 0.02)."""
    for m in model.modules():
        if _is_norm(m):
            for name, p in m.named_parameters(recurse=False):
                p.normal_(1.0 if name == "weight" else 0.0, 0.1)
    for p in model.parameters():
        if p.is_floating_point() and not p.any():
            p.normal_(0.0, 0.02)


def build(name: str, size: str = "tiny", *, dtype=torch.float32, device="cpu", seed: int = 0, blocks=None):
    """The diffusers transformer `name` (NAMES) of `size` ("tiny" or "real"; see the module docstring) with random
    weights from `seed`, built directly on `device` in `dtype` (device "meta": no memory, for counting), laid out
    as from_pretrained(torch_dtype=dtype) leaves a checkpoint; eval mode, requires_grad False. blocks: keep at
    most this many blocks of each block list (None: all)."""
    spec = _spec(name, size)
    cfg = _config(name, size, blocks)
    device = torch.device(device)
    if device.type != "meta":
        torch.manual_seed(seed)
    with ic.default_dtype(dtype), device:
        model = _class(spec)(**cfg)
    if device.type != "meta":
        _trained_looking_(model)
    ic.keep_in_fp32_(model)
    return model.eval().requires_grad_(False)


def _geometry(spec: _Model, size: str, geometry=None) -> dict:
    """size's geometry of spec, with the entries of geometry (height, width, frames, text, ...) in place of its own."""
    g = dict(spec.geometry[size])
    unknown = set(geometry or ()) - set(g)
    if unknown:
        raise ValueError(f"geometry keys {sorted(unknown)} are not among this model's {sorted(g)}")
    g.update(geometry or {})
    return g


def inputs(
    name: str, model, size: str = "tiny", *, batch: int = 1, dtype=None, device=None, seed: int = 0, geometry=None
) -> dict:
    """The keyword arguments of one model(**kw) forward of `name` at `size`'s resolution, frames and text length
    (describe), as the model's pipeline builds them (module docstring). dtype / device: the model's by default.
    geometry: entries that replace the size's (e.g. {"frames": 25, "height": 160}: more tokens for a tiny model)."""
    spec = _spec(name, size)
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    dtype = dtype or model.dtype
    device = device or next(model.parameters()).device
    return spec.make(model, model.config, _geometry(spec, size, geometry), batch, _Draw(seed, dtype, device))


def token_counts(name: str, size: str = "real", geometry=None) -> dict:
    """{stream: tokens} of one sample's forward at `size` (before any padding the model adds)."""
    spec = _spec(name, size)
    return spec.tokens(_geometry(spec, size, geometry), _config(name, size))


def describe(name: str, size: str = "real", batch: int = 1, geometry=None) -> str:
    """One line: the architecture, resolution / frames, token counts and batch of `name` at `size`."""
    spec = _spec(name, size)
    g, cfg = _geometry(spec, size, geometry), _config(name, size)
    res = f"{g['frames']} frames of " if "frames" in g else ""
    toks = " + ".join(f"{v} {k}" for k, v in token_counts(name, size, geometry).items())
    title = spec.title if size == "real" else f"tiny {spec.title}-like"
    return f"{title} ({spec.cls.split(':')[1]}: {spec.arch(cfg)}), {res}{g['height']}x{g['width']}: {toks} tokens, batch {batch}"


def run(model, kw: dict) -> torch.Tensor:
    """model(**kw) without autograd; its main output tensor (the first output; a per-sample list stacked)."""
    with torch.no_grad():
        out = model(**kw)
    out = out if isinstance(out, torch.Tensor) else out[0]  # (sample, ...) or a ModelOutput
    return torch.stack(out) if isinstance(out, (list, tuple)) else out  # Z-Image: one tensor per sample


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        description="Random-weight diffusers transformers of released architectures (FLUX.2-dev, Qwen-Image, LTX-2, "
        "HunyuanVideo-1.5 480p, Z-Image-Turbo, CogVideoX-5B, SANA 1600M, Wan2.1-VACE-1.3B) and the inputs of one forward as their "
        "pipelines build them. Library use: model_zoo.build(name, size), inputs(name, model, size), run(model, kw).",
        epilog="Models: " + ", ".join(NAMES) + ".",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print, as JSON, each model's parameter count at size real "
        "(built on the meta device: no memory), its token counts and describe()",
    )
    args = p.parse_args(argv)
    if not args.list:
        p.print_help()
        return 0
    out = []
    for name in NAMES:
        model = build(name, "real", dtype=torch.bfloat16, device="meta")
        params = sum(t.numel() for t in model.parameters())
        out.append(dict(name=name, params=params, tokens=token_counts(name), describe=describe(name)))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

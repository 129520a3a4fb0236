# SPDX-License-Identifier: Apache-2.0
"""FP8 linear layers for diffusion transformers: an FP8 weight with one scale per output channel, inputs
quantised per token, the product by the platform's scaled FP8 GEMM (``torch._scaled_mm``: hipBLASLt on
ROCm; on NVIDIA cuBLASLt for sm_90 with cuBLAS 12.9 or later, else PyTorch's CUTLASS kernel) with both
scales applied in its epilogue.

    y = (x_fp8 * x_scale[:, None]) @ (w_fp8 * w_scale[:, None])^T + bias                         (bf16 out)

The GEMM asks for fast accumulation (``FAST_ACCUMULATION = True``, passed as ``use_fast_accum``): on NVIDIA
the BLAS then promotes its partial sums to fp32 less often than its default does; in eager mode on ROCm
PyTorch does not pass the flag to hipBLASLt. Set ``fp8_linear.FAST_ACCUMULATION = False`` for the BLAS's
default accumulation.

* ``quantize_weight(w)``: (w_fp8 [N, K], w_scale [N] float32), w_scale = max|w[n]| / fp8_max per row.
* ``fp8_linear(x_fp8, x_scale, w_fp8, w_scale, bias=None)``: the GEMM for inputs already in FP8, e.g. from
  ``rmsnorm.rms_norm_modulate(..., fp8="per_token")`` or ``activations.gelu(..., fp8="per_token")``, which
  write FP8 and the per-token scales in the pass that produces them.
* ``Fp8Linear``: an ``nn.Linear`` replacement holding the FP8 weight; ``forward(x)`` quantises x per token
  (``activations.fp8_quantize``, one pass) and calls ``fp8_linear``; ``forward_fp8(x_fp8, x_scale)`` skips
  the quantisation. ``Fp8Linear.from_linear(linear)`` quantises a linear layer's weight.
* ``project(x, *layers)``: several layers on one input (q, k, v), the input quantised once for them all.
* ``swap_in_fp8(root, parents)`` / ``restore_from_fp8(root)``: replace a model's bf16 linear layers with
  Fp8Linear twins, the originals kept on the CPU, and put the very same originals back.
* ``layer_errors(root, forward)``: per layer, the relative error FP8 adds to its output on the inputs a
  real forward gives it (the check to run on your own weights).

The scale layout is the row-wise recipe of ``torch._scaled_mm`` (scale_a [M, 1], scale_b [1, N], both
float32), which PyTorch's source accepts on gfx942 (weight float8_e4m3fnuz), gfx950 and gfx1201 (weight
float8_e4m3fn, from PyTorch builds against ROCm 6.5) with bf16 output, and on NVIDIA sm_89+
(references/fp8.md, "FP8 GEMMs"); the
FP8 format is the device's (``activations._fp8_dtype_for``). K and N must be multiples of 16 (a
``torch._scaled_mm`` requirement on every GPU): ``from_linear`` refuses other shapes, which stay in bf16.
Not measured on AMD hardware. Inference only: no backward.

This file imports activations.py (the quantisation kernel) and injection_common.py; copy them with it. Run ``python fp8_linear.py --help``.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

import activations
import injection_common as ic

__all__ = [
    "quantize_weight",
    "fp8_linear",
    "Fp8Linear",
    "fp8_linear_ref",
    "project",
    "direct_fp8_format",
    "swap_in_fp8",
    "restore_from_fp8",
    "fp8_linear_count",
    "eligible_layers",
    "layer_errors",
]

# torch._scaled_mm's use_fast_accum for every FP8 GEMM here, read at each call: on the H200 it made LTX-Video's
# FP8 forward 5 % faster at an unchanged output error (references/fp8.md, fast accumulation)
FAST_ACCUMULATION = True

# the formats and the floor of the scales the kernels use (a zero row quantises to zeros, never to NaN)
_FP8_MAX = {dtype: fmt[0] for dtype, fmt in activations._FP8_FORMATS.items()}
_MIN_SCALE = activations._MIN_DYNAMIC_SCALE


def _fp8_dtype(device: torch.device, fp8_dtype: Optional[torch.dtype]) -> torch.dtype:
    if fp8_dtype is None:
        return activations._fp8_dtype_for(device)
    if fp8_dtype not in _FP8_MAX:
        raise TypeError(f"fp8_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, got {fp8_dtype}")
    return fp8_dtype


def quantize_weight(weight: torch.Tensor, fp8_dtype: Optional[torch.dtype] = None):
    """(w_fp8, w_scale) of a [N, K] weight: one float32 scale per output channel (row), max|w[n]| / fp8_max
    (at least 1e-12), and w_fp8 = w / w_scale[:, None] rounded to nearest even in fp8_dtype (default: the
    device's format). Computed in float32."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight must be a floating-point [N, K] tensor, got {getattr(weight, 'shape', weight)!r}")
    fp8_dtype = _fp8_dtype(weight.device, fp8_dtype)
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / _FP8_MAX[fp8_dtype]).clamp_min(_MIN_SCALE)
    q = (w / scale[:, None]).clamp(-_FP8_MAX[fp8_dtype], _FP8_MAX[fp8_dtype]).to(fp8_dtype)
    return q, scale


def _check_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype):
    if x_fp8.dtype not in _FP8_MAX or w_fp8.dtype != x_fp8.dtype:
        raise TypeError(f"x_fp8 and w_fp8 must share one FP8 dtype, got {x_fp8.dtype} and {w_fp8.dtype}")
    if (
        x_fp8.device.type != "cpu"
        and not torch.compiler.is_compiling()  # the driver query cannot be traced; the eager call checks
        and x_fp8.dtype != activations._fp8_dtype_for(x_fp8.device)
    ):
        # the GPU's BLAS takes only its matrix cores' format (cuBLASLt has no e4m3fnuz and fails with an
        # internal assert; gfx942's hipBLASLt takes e4m3fnuz only)
        raise TypeError(
            f"{x_fp8.dtype} is not this GPU's FP8 format ({activations._fp8_dtype_for(x_fp8.device)}): quantise "
            "with fp8_dtype=None (the device's format)"
        )
    n, k = w_fp8.shape
    if x_fp8.shape[-1] != k:
        raise ValueError(f"x_fp8 has K = {x_fp8.shape[-1]} but w_fp8 [N, K] has K = {k}")
    if k % 16 or n % 16:
        raise ValueError(f"torch._scaled_mm needs K and N multiples of 16, got K = {k}, N = {n}")
    if w_scale.dtype != torch.float32 or w_scale.shape != (n,):
        raise ValueError(f"w_scale must be float32 of shape [{n}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    if x_scale.dtype != torch.float32 or x_scale.shape not in (tuple(x_fp8.shape[:-1]), (1,), ()):
        raise ValueError(
            f"x_scale must be float32 of shape {tuple(x_fp8.shape[:-1])} (per token) or one value, got "
            f"{x_scale.dtype} {tuple(x_scale.shape)}"
        )
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape [{n}], got {tuple(bias.shape)}")


def fp8_linear(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(x_fp8 * x_scale) @ (w_fp8 * w_scale[:, None])^T + bias by torch._scaled_mm, x_fp8 [..., K] with
    x_scale per token (shape x_fp8.shape[:-1]) or one value; w_fp8 [N, K] with w_scale [N]. Returns
    [..., N] in out_dtype. The bias is added in the GEMM's epilogue when it has out_dtype and out_dtype
    is 16-bit (what torch._scaled_mm takes), else after it in fp32."""
    _check_gemm(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)
    return _gemm(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype)


def _gemm(x_fp8, x_scale, w_fp8, w_scale, bias, out_dtype):
    """fp8_linear without its checks (Fp8Linear's calls: its own state was checked when it was made, and its
    inputs come from its own quantisation). Each torch call costs host time on every layer of a model."""
    k = x_fp8.shape[-1]
    x2 = x_fp8.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) != k:
        x2 = x2.contiguous()  # torch._scaled_mm takes a row-major A
    m = x2.shape[0]
    sa = x_scale.reshape(-1, 1)
    if sa.shape[0] != m:
        sa = sa.expand(m, 1).contiguous()  # one value: the row-wise recipe with equal rows
    fused_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32
    y = torch._scaled_mm(
        x2,
        w_fp8.t(),
        scale_a=sa,
        scale_b=w_scale.reshape(1, -1),
        bias=bias if fused_bias else None,
        out_dtype=out_dtype,
        use_fast_accum=FAST_ACCUMULATION,
    )
    if bias is not None and not fused_bias:
        y = (y.float() + bias.float()).to(out_dtype)
    return y if x_fp8.dim() == 2 else y.reshape(*x_fp8.shape[:-1], w_fp8.shape[0])


def fp8_linear_ref(x_fp8, x_scale, w_fp8, w_scale, bias=None) -> torch.Tensor:
    """float64 value of fp8_linear (dequantised inputs, exact products and sums up to float64 rounding)."""
    xs = x_scale.double()
    x = x_fp8.double() * (xs[..., None] if xs.dim() == x_fp8.dim() - 1 and xs.numel() > 1 else xs.reshape(()))
    y = x @ (w_fp8.double() * w_scale.double()[:, None]).T
    return y if bias is None else y + bias.double()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal has no FP8 kernel on every device)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


_NO_WEIGHT = (
    "to fuse projections or read or change weights, remove_optimized_kernels(model) first (the bf16 layers come "
    "back), then inject again"
)
_NO_NEW_WEIGHTS = (
    "an FP8 layer cannot take new weights (its FP8 values and scales come from the weight it was made "
    "from): remove_optimized_kernels(model) first (the bf16 layers come back), change the weights, then "
    "inject again"
)


class Fp8Linear(torch.nn.Module):
    """nn.Linear with an FP8 weight (one scale per output channel) and per-token FP8 inputs; see the
    module docstring. Build with ``Fp8Linear.from_linear(linear)``; inference only.

    Its state: ``weight_fp8`` (FP8 [N, K]), ``weight_scale`` (float32 [N]) and ``bias`` (kept as given).
    It has no ``weight``: reading it raises AttributeError (code that builds layers from weights, such as
    diffusers' ``fuse_qkv_projections``, would otherwise take FP8 values without their scales), and setting
    it too.
    What would make the layer compute something other than the layer it replaces fails loudly: a state
    dict with a ``weight`` (a bf16 checkpoint) or with other values than the layer's is refused; values
    written in place after quantisation (``copy_``, ``mul_``) make the next eager call raise (not checked
    inside torch.compile, nor for tensors made under torch.inference_mode, which have no version counter).
    Casting the model keeps the FP8 values and scales as they are (a cast would destroy them); a model cast
    to anything but the layer's output dtype makes the call raise until it is cast back. Moved out of the
    meta device with ``to_empty``, the layer raises until its own state dict is loaded."""

    _GUARDED = ("weight_fp8", "weight_scale", "bias")  # the state that must stay what it was made from

    def __init__(self, w_fp8: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], out_dtype):
        super().__init__()
        self.out_features, self.in_features = w_fp8.shape
        self.register_buffer("weight_fp8", w_fp8)
        self.register_buffer("weight_scale", w_scale)
        self.register_buffer("bias", bias)
        self.out_dtype = out_dtype
        self.model_dtype = out_dtype  # the dtype the model was last cast to (see _apply)
        self._written = False  # the guarded state changed in place since quantisation
        self._undefined = False  # moved out of the meta device: values not set yet
        self._seal()

    def __getattr__(self, name):
        if name == "weight":  # no bf16 weight to read: code that builds layers from .weight (diffusers'
            # fuse_projections, say) would take FP8 values without their scales
            raise AttributeError(f"Fp8Linear has no weight (it holds weight_fp8 and weight_scale): {_NO_WEIGHT}")
        return super().__getattr__(name)

    def __setattr__(self, name, value):
        if name == "weight":  # read-only; nn.Module.__setattr__ would register a Parameter before a property setter
            raise AttributeError(f"Fp8Linear.weight cannot be set: {_NO_NEW_WEIGHTS}")
        super().__setattr__(name, value)

    def _versions(self):
        """The guarded tensors' version counters (bumped by every in-place write), or None for inference
        tensors (made under torch.inference_mode: they have none, and cannot be written outside it)."""
        ts = [self._buffers[n] for n in self._GUARDED if self._buffers[n] is not None]
        if any(t.is_inference() for t in ts):
            return None
        return tuple(t._version for t in ts)

    def _seal(self) -> None:
        """Take the current guarded state as the layer's (after quantisation, a move, or a load of itself)."""
        self._sealed = self._versions()
        # the tensors sealed, held weakly (a strong reference would keep an offloaded copy alive): a buffer
        # put in their place (module._buffers[name] = t, as accelerate's offloading does) is checked anew
        guarded = [self._buffers.get(n) for n in self._GUARDED]
        self._refs = tuple(None if t is None else weakref.ref(t) for t in guarded)
        self._sealed_each = tuple(None if t is None or t.is_inference() else t._version for t in guarded)
        w = self._buffers["weight_fp8"]
        # a GPU's BLAS takes only its matrix cores' FP8 format (cuBLASLt has no e4m3fnuz and fails with an
        # internal assert; gfx942's hipBLASLt takes e4m3fnuz only): checked here, once per move
        device_format = activations._fp8_dtype_for(w.device) if w.device.type == "cuda" else w.dtype
        self._wrong_format = None if device_format == w.dtype else (w.dtype, device_format)

    def _replaced(self) -> bool:
        """Whether a guarded buffer is another tensor than the one sealed (or None where one was sealed).
        Written out for the three buffers: it runs on every eager call."""
        b, (rw, rs, rb) = self._buffers, self._refs
        bias = b["bias"]
        return (
            rw() is not b["weight_fp8"]
            or rs() is not b["weight_scale"]
            or (bias is not None if rb is None else (bias is None or rb() is not bias))
        )

    def _adopt_replaced(self) -> None:
        """Check buffers put in place of the sealed ones as the layer's constructor would (shapes, dtypes,
        the GPU's format), then seal them: replacing is a move (accelerate's offloading) or new state the
        caller chose; writing in place after quantisation stays refused."""
        b, n, k = self._buffers, self.out_features, self.in_features
        w, s, bias = b["weight_fp8"], b["weight_scale"], b["bias"]
        problems = []
        if not isinstance(w, torch.Tensor) or w.dtype not in _FP8_MAX or tuple(w.shape) != (n, k):
            problems.append(f"weight_fp8 must be FP8 of shape [{n}, {k}]")
        if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != (n,):
            problems.append(f"weight_scale must be float32 of shape [{n}]")
        elif isinstance(w, torch.Tensor) and s.device != w.device:
            problems.append("weight_scale must be on weight_fp8's device")
        if bias is not None and (not bias.is_floating_point() or tuple(bias.shape) != (n,)):
            problems.append(f"bias must be a floating-point tensor of shape [{n}] or None")
        if problems:
            raise ValueError(f"a buffer of this FP8 layer was replaced by one it cannot use: {'; '.join(problems)}")
        # a buffer kept in place keeps its record: written since the seal, it stays refused
        for name, r, version in zip(self._GUARDED, self._refs, self._sealed_each):
            t = b[name]
            if t is not None and r is not None and r() is t and version is not None and t._version != version:
                self._written = True
        self._seal()

    def _was_written(self) -> bool:
        """Whether the guarded state changed in place since it was sealed (now or earlier)."""
        if self._replaced():
            self._adopt_replaced()
        return self._written or self._versions() != self._sealed

    def _check_state(self) -> None:
        if self._replaced():
            self._adopt_replaced()
        b, sealed = self._buffers, self._sealed
        if (
            self._written
            or self._undefined
            or (
                sealed is not None
                and (
                    b["weight_fp8"]._version,
                    b["weight_scale"]._version,
                    *(() if b["bias"] is None else (b["bias"]._version,)),
                )
                != sealed
            )
        ):
            self._written = not self._undefined
            raise RuntimeError(
                "the FP8 values of this layer were never set (it was moved out of the meta device): load its "
                "state dict or remove_optimized_kernels(model) and inject again"
                if self._undefined
                else f"the FP8 weight, scales or bias of this layer were written after quantisation: {_NO_NEW_WEIGHTS}"
            )
        if self._wrong_format is not None:
            raise TypeError(
                f"this layer's FP8 values are {self._wrong_format[0]}, which this GPU's BLAS does not take (its "
                f"format is {self._wrong_format[1]}): build the layer on this device, or with fp8_dtype=None"
            )
        if self.model_dtype is not self.out_dtype:
            raise RuntimeError(
                f"the model was cast to {self.model_dtype} after its linear layers became FP8; these compute in "
                f"{self.out_dtype}: cast the model back to {self.out_dtype}, or remove_optimized_kernels(model) first"
            )

    def __getstate__(self):  # copies (deepcopy, pickle, torch.save) carry whether the state was written
        state = self.__dict__.copy()
        state["_written"] = self._was_written()
        state.pop("_refs", None)  # weak references do not pickle; __setstate__ seals anew
        return state

    def __setstate__(self, state):
        buffers = state.get("_buffers", {})
        if "weight" in buffers and "weight_fp8" not in buffers:  # saved by a version that named it weight
            state["_buffers"] = {("weight_fp8" if k == "weight" else k): v for k, v in buffers.items()}
        for k, v in (("model_dtype", state.get("out_dtype")), ("_written", False), ("_undefined", False)):
            state.setdefault(k, v)
        super().__setstate__(state)
        self._seal()  # the copy's tensors have version counters of their own

    def _apply(self, fn, recurse=True):
        # nn.Module casts treat FP8 as floating point: a model.to(dtype) would turn the FP8 values and the
        # scales into that dtype. They follow device moves only; the cast asked for is remembered (the bias
        # follows it, as in the layer replaced).
        self._written = self._was_written()
        self.model_dtype = fn(torch.empty(0, dtype=self.out_dtype, device=self.weight_fp8.device)).dtype
        for name in ("weight_fp8", "weight_scale"):
            t = self._buffers[name]
            target = fn(t.new_empty(0))  # where fn sends a tensor of this dtype, and as what (no copy made)
            moved = fn(t) if target.dtype == t.dtype else t.to(target.device)  # a cast: the device only
            if t.is_meta and not moved.is_meta:  # to_empty(): memory, no values
                self._undefined = True
            self._buffers[name] = moved
        if self.bias is not None:
            self._buffers["bias"] = fn(self.bias)
        self._seal()
        return self

    def _refusal(self, state_dict, prefix) -> Optional[str]:
        """Why this layer refuses its part of state_dict (None: it takes it). A state dict may hold this layer's
        own state (a round trip); anything else would make it compute what no weight of the model says, and
        remove_optimized_kernels would drop it. A layer whose values are undefined (meta device, then
        to_empty) takes a whole FP8 state."""
        if prefix + "weight" in state_dict:
            return f"{prefix}weight: {_NO_NEW_WEIGHTS}"
        given = {n: state_dict.get(prefix + n) for n in self._GUARDED}
        if self._undefined:
            if given["weight_fp8"] is None or given["weight_scale"] is None:
                return f"{prefix}weight_fp8, weight_scale: this layer's values are undefined; load both"
            return None
        for name, t in given.items():
            mine = self._buffers[name]
            if t is not None and not (
                mine is not None
                and t.shape == mine.shape
                and t.dtype == mine.dtype
                and _same_bits(t.to(mine.device), mine)
            ):
                return f"{prefix}{name}: differs from this layer's; {_NO_NEW_WEIGHTS}"
        return None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        refused = self._refusal(state_dict, prefix)
        if refused is not None:
            errors.append(refused)
            return
        stale = self._was_written()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        if self._undefined:
            self._undefined = stale = False
        if not stale:  # the same values copied in place, or an undefined layer's values set
            self._seal()

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, fp8_dtype: Optional[torch.dtype] = None) -> "Fp8Linear":
        """The FP8 twin of linear (its weight quantised per output channel, its bias kept in its dtype; the
        output dtype is the weight's). ValueError where torch._scaled_mm cannot serve it (K or N not a
        multiple of 16, a weight dtype other than fp16/bf16/fp32). On ROCm the row-wise FP8 GEMM returns
        bf16 only: there an fp16 or fp32 layer's twin fails when called (swap_in_fp8 takes bf16 layers only)."""
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear, got {type(linear).__name__}")
        w = linear.weight
        if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{type(linear).__name__} has a {w.dtype} weight; expected fp16, bf16 or fp32")
        n, k = w.shape
        if k % 16 or n % 16:
            raise ValueError(f"in_features {k} and out_features {n} must be multiples of 16 for torch._scaled_mm")
        q, s = quantize_weight(w, fp8_dtype)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(q, s, bias, w.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8={self.weight_fp8.dtype}"

    # forward and forward_fp8 read the buffers from _buffers (attribute access would pass through two
    # __getattr__ calls each) and call _gemm: the layer's own state is checked by _check_state, and its
    # operands' shapes and dtypes were fixed when it was made (a load or a move keeps them).
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self._buffers
        w = b["weight_fp8"]
        if not torch.compiler.is_compiling():
            self._check_state()
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x has {x.shape[-1]} features, this layer takes {self.in_features}")
        x_fp8, x_scale = activations.fp8_quantize(x, fp8_dtype=w.dtype)
        return _gemm(x_fp8, x_scale, w, b["weight_scale"], b["bias"], self.out_dtype)

    def forward_fp8(self, x_fp8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The layer on an input quantised already (x_fp8 in the layer's format, x_scale float32 per token
        or one value), e.g. by a norm kernel's FP8 output; the same values as forward on the input."""
        b = self._buffers
        w = b["weight_fp8"]
        if not torch.compiler.is_compiling():
            self._check_state()
        if x_fp8.dtype != w.dtype or x_scale.dtype != torch.float32:
            raise TypeError(
                f"forward_fp8 takes {w.dtype} inputs and float32 scales, got {x_fp8.dtype} and {x_scale.dtype}"
            )
        if x_fp8.shape[-1] != self.in_features or x_scale.shape not in (x_fp8.shape[:-1], (1,), ()):
            raise ValueError(
                f"forward_fp8 takes [..., {self.in_features}] inputs with scales of shape [...] (per token) or one "
                f"value, got {tuple(x_fp8.shape)} with {tuple(x_scale.shape)}"
            )
        return _gemm(x_fp8, x_scale, w, b["weight_scale"], b["bias"], self.out_dtype)


def direct_fp8_format(layers) -> Optional[torch.dtype]:
    """The FP8 format of layers where code may hand them inputs it quantised itself (forward_fp8) instead
    of calling them: each an Fp8Linear running its own forward (no hooks, no forward of its own) and all
    in one format. None otherwise (then each layer must be called)."""
    if not all(type(m) is Fp8Linear and ic.unwrapped(m) for m in layers):
        return None
    formats = {m.weight_fp8.dtype for m in layers}
    return formats.pop() if len(formats) == 1 else None


def project(x: torch.Tensor, *layers) -> list:
    """[layer(x) for layer in layers], with x quantised once for all of them where direct_fp8_format
    allows (an attention's q, k and v projections); otherwise each layer is called as usual. The same
    values either way: Fp8Linear.forward is fp8_quantize, then forward_fp8."""
    fmt = direct_fp8_format(layers) if len(layers) > 1 else None
    if fmt is not None:
        x_fp8, x_scale = activations.fp8_quantize(x, fp8_dtype=fmt)
        return [m.forward_fp8(x_fp8, x_scale) for m in layers]
    return [ic.call(m, x) for m in layers]


# --------------------------------------------------------------------------------------------
# Swapping a model's linear layers in and out, reversibly
# --------------------------------------------------------------------------------------------
_SKIPPED = "named in fp8_skip"  # a layer the caller asked to leave as it is
_ORIGINAL = "_rtk_bf16_layer"  # on each twin swap_in_fp8 put in place: the bf16 layer it replaced
_SWAPPED = "_rtk_fp8_linears"  # the record an earlier version kept on the root (a model it pickled)
_LOAD_CHECK = "_rtk_fp8_load_check"  # on the root: the handle of its load_state_dict pre-hook (_check_load)


def _eligible(lin: torch.nn.Module) -> Optional[str]:
    """Why lin stays in bf16 (None: it can become an Fp8Linear)."""
    if type(lin) is not torch.nn.Linear:
        return f"{type(lin).__name__} (not a plain nn.Linear)"
    if not ic.unwrapped(lin):  # a torch, accelerate or diffusers hook, or a forward of its own, would be lost
        return "nn.Linear with hooks or a forward of its own"
    w = lin.weight
    if type(w) is not torch.nn.Parameter or w.dtype != torch.bfloat16:
        return f"nn.Linear with a {w.dtype} weight (FP8 GEMMs here give bf16, the output ROCm's row-wise takes)"
    if not (w.device.type == "cuda" or (w.device.type == "cpu" and activations._interpreting())):
        return f"nn.Linear on {w.device} (FP8 layers run on a GPU; on the CPU only through Triton's interpreter, TRITON_INTERPRET=1)"
    if w.shape[0] % 16 or w.shape[1] % 16:
        return f"nn.Linear {w.shape[1]} -> {w.shape[0]} (not multiples of 16)"
    return None


def _is_adapter(m: torch.nn.Module) -> bool:
    """A peft layer wrapping a base layer (LoRA and the other tuners, diffusers' LoRA loading included): peft
    marks them with the class attribute adapter_layer_names."""
    return hasattr(type(m), "adapter_layer_names")


_ADAPTED = (
    "a layer under a LoRA or other adapter (its base layer is read and unloaded by peft; fuse and unload the "
    "adapter first to quantise it)"
)


def _inside_adapters(modules) -> set:
    """ids of the modules inside adapter layers among modules (and of those layers' own modules)."""
    return {id(x) for m in modules if _is_adapter(m) for x in m.modules()}


def _linear_children(parents):
    """(parent, name, child, why) for each nn.Linear child of parents and each adapter layer among their
    children (parents inside an adapter skipped): why is None where swap_in_fp8 replaces the child, else the
    reason it stays bf16."""
    parents = list(parents)
    adapted = _inside_adapters(parents)
    for parent in parents:
        if id(parent) in adapted:
            continue
        for name, child in list(parent._modules.items()):
            if _is_adapter(child):
                yield parent, name, child, _ADAPTED
            elif isinstance(child, torch.nn.Linear):
                yield parent, name, child, _eligible(child)


def eligible_layers(parents) -> list:
    """The nn.Linear children of parents that swap_in_fp8 would replace, each once (for a comparison that
    quantises the very same layers another way)."""
    return list({id(c): c for _, _, c, why in _linear_children(parents) if why is None}.values())


# FP8 layers made inside torch.inference_mode() would hold inference tensors, which have no version counter (an
# in-place write would go unnoticed) and take no load_state_dict outside it
_INFERENCE_MODE_REFUSAL = (
    "fp8=True (swap_in_fp8) inside torch.inference_mode(): the FP8 layers would hold inference tensors, whose "
    "in-place writes go unnoticed and which load_state_dict cannot write outside inference mode. Inject outside "
    "torch.inference_mode() (torch.no_grad() is fine); running the model inside it afterwards is fine"
)


def swap_in_fp8(root: torch.nn.Module, parents, *, fp8_dtype=None, offload: bool = True, left_layers=None, skip=()):
    """Replace the plain bf16 nn.Linear children of each module in parents with their Fp8Linear twins.
    Layers under a LoRA or other peft adapter stay as they are (peft reads, merges and unloads base layers).

    Each twin holds the original it replaces, on the CPU when offload (its GPU memory freed: the point of FP8
    weights), so that restore_from_fp8 puts back the very same modules with their exact weights on their
    devices. Returns (layers swapped, the reasons of those left as they are); left_layers, a list, receives
    (layer, reason) for each of those. skip: ids of layers to leave as they are. While root holds twins (made
    by this call or by one on another model sharing its modules), its save_pretrained raises, and its
    load_state_dict refuses what an FP8 layer would refuse before it writes anything (_check_load). Raises
    ValueError inside torch.inference_mode(), before changing anything (_INFERENCE_MODE_REFUSAL)."""
    if torch.is_inference_mode_enabled():
        raise ValueError(_INFERENCE_MODE_REFUSAL)
    twins = {}  # one twin for a layer reachable through several parents (tied modules)
    done, left = 0, []
    for parent, name, child, why in _linear_children(parents):
        if why is None and id(child) in skip:
            why = _SKIPPED
        if why is not None:
            left.append(why)
            if left_layers is not None:
                left_layers.append((child, why))
            continue
        twin = twins.get(id(child))
        if twin is None:
            with torch.no_grad():
                twin = Fp8Linear.from_linear(child, fp8_dtype)
            twin.__dict__[_ORIGINAL] = child  # not a submodule: outside the model's modules and state dict
            twins[id(child)] = twin
        parent._modules[name] = twin
        done += 1
    if offload:
        for twin in twins.values():
            twin.__dict__[_ORIGINAL].to("cpu")
    if fp8_linear_count(root):
        if callable(getattr(root, "save_pretrained", None)) and "save_pretrained" not in root.__dict__:
            root.__dict__["save_pretrained"] = ic.BoundForward(_refuse_save_pretrained, root)
        if _LOAD_CHECK not in root.__dict__:
            root.__dict__[_LOAD_CHECK] = root.register_load_state_dict_pre_hook(_check_load)
    return done, left


def _check_load(root, state_dict, prefix, *args):
    """A load_state_dict pre-hook on a model holding FP8 layers. torch copies module by module, root's own
    tensors first, and raises the layers' refusals only at the end; this runs before anything is copied and
    raises if an FP8 layer would refuse its part, so a refused state dict writes nothing."""
    refused = []
    for name, m in root.named_modules(remove_duplicate=False):  # a layer in several places: each place's keys
        if isinstance(m, Fp8Linear):
            why = m._refusal(state_dict, f"{prefix}{name}." if name else prefix)
            if why is not None:
                refused.append(why)
    if refused:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(root).__name__} (nothing was loaded):\n\t" + "\n\t".join(refused)
        )


def _swapped_slots(*roots):
    """(parent, name, twin) for each child slot under roots that holds a twin swap_in_fp8 put in: each parent
    once (blocks two roots share count once), a twin in several slots (tied layers) once per slot."""
    for root in roots:  # a record an earlier version kept on the root: its twins hold their originals now
        for _, _, original, twin in root.__dict__.pop(_SWAPPED, ()):
            twin.__dict__.setdefault(_ORIGINAL, original)
    for parent in ic.modules_once(roots):
        for name, child in parent._modules.items():
            if child is not None and _ORIGINAL in child.__dict__:
                yield parent, name, child


def _refuse_save_pretrained(root, *args, **kwargs):
    """A model's save_pretrained while FP8 layers are in: the checkpoint would hold FP8 values and scales
    under names a bf16 model does not have, and from_pretrained would initialise those layers at random
    (with only a warning). Once root holds none (removed through another model sharing them), it saves."""
    if not fp8_linear_count(root):
        del root.__dict__["save_pretrained"]
        return root.save_pretrained(*args, **kwargs)
    raise RuntimeError(
        "save_pretrained with FP8 layers in place would write a checkpoint whose block linear layers "
        "from_pretrained cannot load (they would come back randomly initialised): remove_optimized_kernels(model) "
        "first (the bf16 layers come back), save, then inject again"
    )


def restore_from_fp8(root: torch.nn.Module, *, keep=()) -> int:
    """Undo swap_in_fp8 under root: in each slot of root's modules that holds a twin, the original module
    back, on the device of the twin (where the model is now), and in the dtype the model was cast to since if
    it was. A slot that holds something else (put there since) keeps it. Modules root shares with another
    model (blocks two transformers hold) are the very same modules: restored here, they are restored in both.
    Slots are restored one at a time, so a failure (out of memory, say) leaves the rest to a second call.
    keep: twins to leave in place (an earlier call's). Returns how many slots were restored."""
    keep = {id(t) for t in keep}
    n = 0
    for parent, name, twin in list(_swapped_slots(root)):
        if id(twin) in keep:
            continue
        original = twin.__dict__[_ORIGINAL]
        if twin.model_dtype is twin.out_dtype:
            original.to(twin.weight_fp8.device)
        else:  # the model was cast meanwhile
            original.to(twin.weight_fp8.device, twin.model_dtype)
        parent._modules[name] = original
        n += 1
    if not fp8_linear_count(root):
        own = root.__dict__.get("save_pretrained")
        if isinstance(own, ic.BoundForward) and own.func is _refuse_save_pretrained:
            del root.__dict__["save_pretrained"]
        handle = root.__dict__.pop(_LOAD_CHECK, None)
        if handle is not None:
            handle.remove()
    return n


def fp8_linear_count(*roots: torch.nn.Module) -> int:
    """How many slots under roots hold a twin swap_in_fp8 put in (by whichever model's call: blocks shared by
    two models count for both, and once where both are given)."""
    return sum(1 for _ in _swapped_slots(*roots))


def layer_errors(root: torch.nn.Module, forward, fp8_dtype=None, parents=None) -> dict:
    """Per layer, what FP8 costs it: runs forward() once with a hook on every plain bf16 nn.Linear under
    root that swap_in_fp8 would replace (only the children of parents, if given), and compares, on the very
    input each layer receives, its output with its Fp8Linear twin's (relative L2, float64). Returns
    {qualified name: rel. L2}, worst first; nothing is kept and root is left as it was (hooks removed,
    also on failure). Run it on the bf16 model, not an FP8 one: ValueError, with the reasons, where no
    layer qualifies (an FP8 model, an fp32 one, one on the CPU), and where forward() reached none."""
    if any(isinstance(m, Fp8Linear) for m in root.modules()):
        raise ValueError(
            "layer_errors measures a bf16 model: this one holds FP8 layers already (remove_optimized_kernels(model) "
            "first); its other linear layers are ones FP8 leaves as they are"
        )
    children = list(_linear_children(root.modules() if parents is None else parents))
    among = {id(c) for _, _, c, why in children if why is None}
    if not among:
        raise ValueError(
            "layer_errors found no layer FP8 would replace: "
            + ("; ".join(sorted({why for *_, why in children})) or "no nn.Linear among the parents")
        )
    errors, handles = {}, []

    def hook(name):
        def fn(module, args, out):
            with torch.no_grad():
                twin = Fp8Linear.from_linear(module, fp8_dtype)
                y8 = twin(args[0]).double()
                ref = out.double()
                err = float((y8 - ref).norm() / ref.norm().clamp_min(1e-30))
            errors[name] = max(err, errors.get(name, 0.0))

        return fn

    try:
        for name, m in root.named_modules():
            if id(m) in among:
                handles.append(m.register_forward_hook(hook(name)))
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    if not errors:
        raise ValueError(f"forward() ran none of the {len(among)} layers FP8 would replace under this root")
    return dict(sorted(errors.items(), key=lambda kv: -kv[1]))


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(
        description="Check Fp8Linear against nn.Linear on random inputs: the FP8 GEMM against its float64 value "
        "(exactness) and against the bf16 layer (the cost of FP8). JSON on stdout."
    )
    p.add_argument("--tokens", type=int, default=256, help="rows of x (default 256)")
    p.add_argument("--in-features", type=int, default=2048)
    p.add_argument("--out-features", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("tokens", "in_features", "out_features"):  # sizes: at least 1
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    device = torch.device("cuda" if torch.cuda.is_available() and not activations._interpreting() else "cpu")
    if device.type == "cpu" and not activations._interpreting():
        print(json.dumps({"ok": False, "error": "no GPU: set TRITON_INTERPRET=1 to run on the CPU"}))
        return 2
    g = torch.Generator().manual_seed(args.seed)
    lin = torch.nn.Linear(args.in_features, args.out_features).to(device, torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / args.in_features**0.5)
        x = torch.randn(args.tokens, args.in_features, generator=g).to(device, torch.bfloat16)
        f8 = Fp8Linear.from_linear(lin)
        y8 = f8(x)
        y = lin(x)
        xq, xs = activations.fp8_quantize(x, fp8_dtype=f8.weight_fp8.dtype)
        ref = fp8_linear_ref(xq, xs, f8.weight_fp8, f8.weight_scale, f8.bias)
    gemm_err = float(((y8.double() - ref).norm() / ref.norm()).item())
    fp8_cost = float(((y8.double() - y.double()).norm() / y.double().norm()).item())
    ok = gemm_err < 1e-2 and fp8_cost < 0.1
    print(json.dumps({"device": str(device), "fp8_dtype": str(f8.weight_fp8.dtype), "gemm_rel_l2_vs_float64": gemm_err,
                      "rel_l2_vs_bf16_linear": fp8_cost, "ok": ok}))  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(_main())

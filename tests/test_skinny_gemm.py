# SPDX-License-Identifier: Apache-2.0
"""Skinny GEMM (y = x @ W^T for M <= 32): bf16/fp16 and FP8 weights against a float64 reference and against
torch (F.linear, torch._scaled_mm), split-K determinism, the XCD remap through the kernel, error paths."""

import json

import pytest
import torch
import triton
import triton.language as tl

import skinny_gemm as sg
from kernel_testing import DEVICE, INTERPRET, assert_close, poisoned_outputs, randn

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]


@pytest.fixture(autouse=True)
def _kernel_for_every_m(monkeypatch):
    """Test the kernel itself at every M: the per-arch dispatch table would otherwise send some M to torch."""
    monkeypatch.setattr(sg, "_KERNEL_MAX_M", {})


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
def _quantize(w32, f8, per_channel):
    """Symmetric FP8 quantization: (W / scale).to(f8) with scale = amax / fp8 max (per row or per tensor)."""
    fmax = torch.finfo(f8).max
    amax = w32.abs().amax(dim=1) if per_channel else w32.abs().amax().reshape(1)
    scale = (amax / fmax).clamp_min(1e-12).float()
    wq = (w32 / (scale[:, None] if per_channel else scale)).to(f8)
    return wq.to(DEVICE), scale.to(DEVICE)


def _quantized_x(m, k, f8, gen):
    """FP8 x [m, k] with its per-tensor scale (amax / fp8 max): the torch._scaled_mm convention."""
    x32 = torch.randn((m, k), generator=gen)
    xs = (x32.abs().max() / torch.finfo(f8).max).reshape(1).float()
    xq = (x32 / xs).to(f8).to(DEVICE)
    return xq, xs.to(DEVICE)


def _check(out, x, w, bias=None, weight_scale=None, x_scale=None, seed=None, name="y"):
    """|out - ref| <= output rounding * |ref| + fp32 accumulation bound.

    Tolerance: the one rounding to the output dtype is at most 1 ulp relative (the interpreter truncates
    fp32 -> bf16: 2^-7 for bf16; fp16 rounds: half an ulp, 2^-11, taken as 2^-10; fp32: 2^-22 to cover the
    scale/bias multiply-adds); the fp32 sum of K products (each exact: bf16 x bf16 and widened FP8 fit in
    fp32) in any order is off by at most ~K * 2^-24 * sum_k |x w| (the classic gamma_K bound), doubled for
    the scale multiplications and the split-K sum.
    """
    ref = sg.skinny_gemm_ref(x, w, bias, weight_scale=weight_scale, x_scale=x_scale)
    mag = sg.skinny_gemm_ref(
        x.double().abs(),
        w.double().abs(),
        weight_scale=None if weight_scale is None else weight_scale.abs(),
        x_scale=None if x_scale is None else x_scale.abs(),
    )
    k = x.shape[-1]
    rtol = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-22}[out.dtype]
    atol = 2 * k * 2.0**-24 * float(mag.max()) + 1e-30
    assert_close(out, ref, out.dtype, rtol=rtol, atol=atol, name=name, seed=seed)
    return ref


# --------------------------------------------------------------------------------------------
# 16-bit weights against float64
# --------------------------------------------------------------------------------------------
# (N, K): a block multiple, both dims off the block (333 rows, K not a multiple of BLOCK_K), a prime N and
# a Llama-like projection scaled down (hidden 512, kv heads 128 wide; MLP 1376 = 43 * 32).
SHAPES = [(64, 256), (333, 1000), (127, 520), (1376, 512)]


@pytest.mark.parametrize("m", [1, 2, 7, 16, 32])
@pytest.mark.parametrize("n,k", SHAPES)
def test_bf16_matches_float64(m, n, k, gen):
    x = randn((m, k), torch.bfloat16, gen)
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    _check(y, x, w, seed=gen.seed_value)


@pytest.mark.parametrize("m", [1, 3, 20])
def test_fp16_with_bias_matches_float64(m, gen):
    n, k = 333, 1000
    x = randn((m, k), torch.float16, gen)
    w = randn((n, k), torch.float16, gen, scale=k**-0.5)
    b = randn((n,), torch.float16, gen)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w, b)
    assert y.dtype == torch.float16
    _check(y, x, w, b, seed=gen.seed_value)


@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 9])
def test_bias_and_fp32_output(m, bias_dtype, gen):
    n, k = 200, 384
    x = randn((m, k), torch.bfloat16, gen)
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    b = randn((n,), bias_dtype, gen)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w, b, out_dtype=torch.float32)
    assert y.dtype == torch.float32
    _check(y, x, w, b, seed=gen.seed_value)


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("bias_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_torch_dispatch_with_a_bias_of_any_dtype(bias_dtype, out_dtype, gen, monkeypatch):
    """Above the per-arch M limit skinny_gemm hands 16-bit GEMMs to torch (F.linear), which takes one
    dtype for x, W and bias; the documented bias of any float dtype must still work there (it raised
    "self and mat2 must have the same dtype" for a float32 bias on a GPU). Two roundings on this path:
    the product to x's dtype, then the sum with the bias."""
    monkeypatch.setattr(sg, "_torch_max_m", lambda x, weight, split_k: 0)  # every M goes to torch
    m, n, k = 5, 96, 200
    x = randn((m, k), torch.bfloat16, gen)
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    b = randn((n,), bias_dtype, gen)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w, b, out_dtype=out_dtype)
    assert y.dtype == (out_dtype or torch.bfloat16)
    ref = sg.skinny_gemm_ref(x, w, b)
    tol = 2 * 2.0**-7 if out_dtype is None else 2.0**-7  # the product rounded to bf16 (+ the output rounding)
    scale = float(sg.skinny_gemm_ref(x, w).abs().max() + b.abs().max())  # rounding the product is relative to it
    assert_close(y, ref, y.dtype, rtol=tol, atol=tol * scale, name="y", seed=gen.seed_value)


def test_matches_torch_linear(gen):
    """Against torch's own bf16 linear: both are within one bf16 rounding of the exact value."""
    for m in (1, 5, 32):
        x = randn((m, 1000), torch.bfloat16, gen)
        w = randn((333, 1000), torch.bfloat16, gen, scale=1000**-0.5)
        b = randn((333,), torch.bfloat16, gen)
        with poisoned_outputs():
            y = sg.skinny_gemm(x, w, b)
        ref = torch.nn.functional.linear(x, w, b)
        assert_close(
            y,
            ref.double(),
            torch.bfloat16,
            rtol=2 * 2.0**-7,
            atol=2 * 2.0**-7,
            name=f"vs F.linear M={m}",
            seed=gen.seed_value,
        )


# --------------------------------------------------------------------------------------------
# Strided and batched inputs
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 6, 32])
def test_strided_x_rows_and_weight_rows(m, gen):
    """x rows read in place from a wider buffer; W rows from a column slice of a wider weight."""
    k, n = 520, 150
    xbig = randn((m, k + 40), torch.bfloat16, gen)
    wbig = randn((n, k + 24), torch.bfloat16, gen, scale=k**-0.5)
    x, w = xbig[:, 8 : 8 + k], wbig[:, :k]
    assert x.stride(0) == k + 40 and w.stride(0) == k + 24
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w)
    _check(y, x, w, seed=gen.seed_value)


def test_batched_leading_dims_last_token(gen):
    """Decode in a [B, S, K] batch: the last token of each sequence, x[:, -1:, :] (strided rows)."""
    k, n = 256, 96
    h = randn((4, 5, k), torch.bfloat16, gen)
    x = h[:, -1:, :]
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w)
    assert y.shape == (4, 1, n)
    _check(y.reshape(4, n), x.reshape(4, k), w, seed=gen.seed_value)
    # a 1-D x is one row
    y1 = sg.skinny_gemm(h[0, 0], w)
    assert y1.shape == (n,)
    _check(y1[None], h[0, 0][None], w, seed=gen.seed_value)


# --------------------------------------------------------------------------------------------
# FP8 weights (and FP8 x)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("f8", FP8, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
@pytest.mark.parametrize("m", [1, 4, 7, 32])
def test_fp8_weight_matches_float64(f8, per_channel, m, gen):
    """Compared with the float64 product of x and the dequantized weight (FP8 value x scale)."""
    n, k = 333, 1000
    x = randn((m, k), torch.bfloat16, gen)
    wq, scale = _quantize(torch.randn((n, k), generator=gen), f8, per_channel)
    b = randn((n,), torch.bfloat16, gen)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, wq, b, weight_scale=scale)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    _check(y, x, wq, b, weight_scale=scale, seed=gen.seed_value)


@pytest.mark.parametrize("f8", FP8, ids=["e4m3fn", "e4m3fnuz"])
def test_fp8_weight_fp16_x_scale_shapes(f8, gen):
    """fp16 activations; the scale may be given as [N], [N, 1], a 0-d tensor or [1, 1]."""
    n, k = 130, 384
    x = randn((3, k), torch.float16, gen)
    wq, scale = _quantize(torch.randn((n, k), generator=gen), f8, per_channel=True)
    for s in (scale, scale[:, None]):
        with poisoned_outputs():
            y = sg.skinny_gemm(x, wq, weight_scale=s)
        _check(y, x, wq, weight_scale=scale, seed=gen.seed_value)
    wq, scale = _quantize(torch.randn((n, k), generator=gen), f8, per_channel=False)
    for s in (scale.reshape(()), scale.reshape(1, 1)):
        with poisoned_outputs():
            y = sg.skinny_gemm(x, wq, weight_scale=s)
        _check(y, x, wq, weight_scale=scale, seed=gen.seed_value)


@pytest.mark.parametrize("f8", FP8, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_x_and_weight_against_scaled_mm(f8, m, gen):
    """FP8 x with a per-tensor scale: the torch._scaled_mm convention, and its result."""
    n, k = 96, 512
    xq, xs = _quantized_x(m, k, f8, gen)
    wq, ws = _quantize(torch.randn((n, k), generator=gen), f8, per_channel=False)
    b = randn((n,), torch.bfloat16, gen)
    with poisoned_outputs():
        y = sg.skinny_gemm(xq, wq, b, weight_scale=ws, x_scale=xs)
    assert y.dtype == torch.bfloat16  # default output dtype for FP8 x
    _check(y, xq, wq, b, weight_scale=ws, x_scale=xs, seed=gen.seed_value)
    try:
        ref = torch._scaled_mm(
            xq.cpu(),
            wq.cpu().t(),
            scale_a=xs.cpu().reshape(()),
            scale_b=ws.cpu().reshape(()),
            bias=b.cpu(),
            out_dtype=torch.bfloat16,
        )
    except (RuntimeError, NotImplementedError) as exc:  # a torch build without CPU FP8 GEMMs
        pytest.skip(f"torch._scaled_mm unavailable here: {exc}")
    assert_close(
        y, ref.double(), torch.bfloat16, rtol=2 * 2.0**-7, atol=2 * 2.0**-7, name="vs _scaled_mm", seed=gen.seed_value
    )


class _LaunchSpy:
    """Stands in for a kernel object: records each launch's keyword arguments, then runs the kernel."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            self.launches.append(kwargs)
            return launch(*args, **kwargs)

        return call


def _expects_fp8_dot(f8) -> bool:
    """Where FP8 x and W should reach tl.dot as FP8: the interpreter, gfx94x (e4m3fnuz), gfx95x (e4m3fn);
    never on NVIDIA (widened there)."""
    backend, arch, _ = sg._device_target(torch.device(DEVICE))
    fnuz = f8 == torch.float8_e4m3fnuz
    if backend == "interpreter":
        return True
    if backend == "cuda":
        return False
    return str(arch).startswith("gfx94") if fnuz else str(arch).startswith("gfx95")


@pytest.mark.parametrize("f8", FP8, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("m", [1, 5, 32])
def test_fp8_x_and_weight_take_the_fp8_dot_path(f8, m, gen, monkeypatch):
    """FP8 x and W of the device's matrix format go to tl.dot unwidened on the matrix path (M > 4), and
    the result still matches float64; the multiply-add path (M <= 4) never sets the flag."""
    spy = _LaunchSpy(sg._skinny_gemm_kernel)
    monkeypatch.setattr(sg, "_skinny_gemm_kernel", spy)
    monkeypatch.setattr(sg, "_KERNEL_MAX_M", {})  # always the kernel, whatever was measured on this GPU
    n, k = 80, 384
    xq, xs = _quantized_x(m, k, f8, gen)
    wq, ws = _quantize(torch.randn((n, k), generator=gen), f8, per_channel=True)
    with poisoned_outputs():
        y = sg.skinny_gemm(xq, wq, weight_scale=ws, x_scale=xs, out_dtype=torch.float32)
    _check(y, xq, wq, weight_scale=ws, x_scale=xs, seed=gen.seed_value)
    assert len(spy.launches) == 1
    assert spy.launches[0]["USE_DOT"] == (m > sg._FMA_MAX_M)
    assert spy.launches[0]["FP8_DOT"] == (m > sg._FMA_MAX_M and _expects_fp8_dot(f8))


@pytest.mark.parametrize("f8", FP8, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("m", [1, 16])
def test_fp8_decoded_from_bits_every_code(f8, m, monkeypatch):
    """The bit-decoding path (used where the GPU lacks the format's conversion) maps all 256 codes exactly:
    one-hot x picks single weights, so the output is the decoded value itself. NaN codes give NaN."""
    monkeypatch.setattr(sg, "_decode_fp8_bits", lambda target, fnuz: True)
    codes = torch.arange(256, dtype=torch.uint8).view(f8)
    finite = codes[~codes.float().isnan()]
    w = finite[: finite.numel() // 16 * 16].reshape(-1, 16).to(DEVICE)  # [N, 16]
    x = torch.eye(16, dtype=torch.bfloat16, device=DEVICE)[:m]
    one = torch.ones(1, device=DEVICE)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w, weight_scale=one, out_dtype=torch.float32)
    assert torch.equal(y.cpu(), w.cpu().float()[:, :m].T)
    nan_rows = codes[codes.float().isnan()].reshape(-1, 1).expand(-1, 16).contiguous().to(DEVICE)
    y = sg.skinny_gemm(torch.ones(1, 16, dtype=torch.bfloat16, device=DEVICE), nan_rows, weight_scale=one)
    assert y.isnan().all()
    # FP8 x decoded the same way
    xq = torch.eye(16, device=DEVICE)[:m].to(f8)
    y = sg.skinny_gemm(xq, w, weight_scale=one, x_scale=one, out_dtype=torch.float32)
    assert torch.equal(y.cpu(), w.cpu().float()[:, :m].T)


# --------------------------------------------------------------------------------------------
# Split-K: determinism, agreement, odd splits and the XCD remap through the kernel
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [1, 12])
def test_deterministic_and_split_invariant(m, gen):
    n, k = 333, 2048
    x = randn((m, k), torch.bfloat16, gen)
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    outs = {}
    for split in (None, 1, 4):
        with poisoned_outputs():
            a = sg.skinny_gemm(x, w, split_k=split, out_dtype=torch.float32)
            b = sg.skinny_gemm(x, w, split_k=split, out_dtype=torch.float32)
        assert torch.equal(a, b), f"split_k={split}: two runs differ"
        outs[split] = a
    # the default really splits here, and the split results agree within fp32 accumulation error
    target = sg._device_target(x.device)
    cfg = sg._launch_config(m, n, k, 2, target, sg._compute_units(x.device, target))
    assert cfg.split_k > 1
    _check(outs[4], x, w, seed=gen.seed_value, name="split_k=4")
    _check(outs[1], x, w, seed=gen.seed_value, name="split_k=1")
    # both are within the fp32 accumulation bound of the exact value, hence within twice it of each other
    mag = float(sg.skinny_gemm_ref(x.double().abs(), w.double().abs()).max())
    assert_close(
        outs[4],
        outs[1].double(),
        torch.float32,
        rtol=0,
        atol=2 * (2 * k * 2.0**-24 * mag),
        name="split 4 vs 1",
        seed=gen.seed_value,
    )


@pytest.mark.parametrize("m,k", [(1, 1500), (3, 1500), (9, 1000), (32, 1000)])
def test_odd_split_and_program_count_not_multiple_of_8(m, k, gen):
    """split_k = 3 over 21 or 6 N tiles: 63 or 18 programs, remapped over 8 XCDs where the launcher remaps
    (the interpreter, CDNA3/CDNA4); every output written."""
    n = 333
    target = sg._device_target(DEVICE)
    cus = sg._compute_units(DEVICE, target)
    cfg = sg._launch_config(m, n, k, 2, target, cus, 3)
    programs = -(-n // cfg.block_n) * cfg.split_k
    assert cfg.split_k == 3 and programs % 8 != 0
    remaps = target[0] == "interpreter" or (
        target[0] == "hip" and str(target[1]).startswith(("gfx94", "gfx95")) and cus % 8 == 0
    )
    if remaps:  # elsewhere (NVIDIA, RDNA, a partitioned MI300X) the launcher does not remap: num_xcds is 1
        assert cfg.num_xcds == 8, cfg
    x = randn((m, k), torch.bfloat16, gen)
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    b = randn((n,), torch.bfloat16, gen)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w, b, split_k=3)
    _check(y, x, w, b, seed=gen.seed_value)


class _DiesOnce:
    """Stands in for the kernel: the first launch stops part-way, as an exception, an interrupt or a killed
    kernel would leave it (every N tile's arrival counter advanced, no partial sum written, nothing reset);
    later launches run the kernel, each recording the counters it was handed, as they were on entry."""

    def __init__(self, kernel):
        self.kernel, self.slot, self.entry_counters = kernel, kernel.arg_names.index("COUNTERS"), []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            counters = args[self.slot]
            if not self.entry_counters:
                counters.fill_(1)
                self.entry_counters.append(None)
                raise RuntimeError("launch killed part-way")
            self.entry_counters.append(counters.clone())
            return launch(*args, **kwargs)

        return call


@pytest.mark.parametrize("m", [1, 12])
def test_split_k_after_a_launch_that_did_not_finish(m, gen, monkeypatch):
    """A split-K launch that does not finish leaves its arrival counters non-zero. The next split-K calls
    (same stream, same and other shapes) must still be right: stale counters would make a program that is
    not the last of its tile reduce partials not yet written (NaN in a poisoned workspace), silently."""
    spy = _DiesOnce(sg._skinny_gemm_kernel)
    monkeypatch.setattr(sg, "_skinny_gemm_kernel", spy)
    n, k = 200, 2048
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    with pytest.raises(RuntimeError, match="killed part-way"):
        sg.skinny_gemm(randn((m, k), torch.bfloat16, gen), w, split_k=4)
    for split, n_ in ((4, n), (3, n), (4, 72)):  # the same signature again, another split, another N
        x = randn((m, k), torch.bfloat16, gen)
        w_ = w[:n_]
        with poisoned_outputs():
            y = sg.skinny_gemm(x, w_, split_k=split, out_dtype=torch.float32)
        _check(y, x, w_, seed=gen.seed_value, name=f"split_k={split} N={n_} after an unfinished launch")
    # every launch found its counters at zero
    assert len(spy.entry_counters) == 4
    assert all(int(c.count_nonzero()) == 0 for c in spy.entry_counters[1:])


@triton.jit
def _ws_offset_probe(OUT, split, N, WS_SPLIT_STRIDE, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[BLOCK_M, BLOCK_N] = the kernel's workspace offsets of split `split`, rows 0.., the last BLOCK_N columns."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = (N - BLOCK_N) + tl.arange(0, BLOCK_N)
    off = sg._ws_offset(split, offs_m, offs_n, N, WS_SPLIT_STRIDE)
    tl.store(OUT + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], off)


def test_workspace_offsets_are_int64():
    """The split-K workspace [SPLIT_K, M, N] holds 2**31 or more elements when split_k * M * N >= 2**31
    (e.g. M = 32, N = 2**21, split_k = 32: 8 GiB, too big to run here): the kernel's workspace offsets
    must not wrap in int32. Checked on the kernel's own offset helper, at offsets past 2**31 and 2**32
    (and rows padded past M, whose offsets are computed though masked)."""
    bm, bn = 32, 16
    for m, n, split in ((32, 2**21, 32), (32, 2**21, 63), (17, 2**27 - 3, 2), (32, 12345, 5)):
        out = torch.zeros((bm, bn), dtype=torch.int64, device=DEVICE)
        _ws_offset_probe[(1,)](out, split, n, m * n, BLOCK_M=bm, BLOCK_N=bn)
        rows = torch.arange(bm, dtype=torch.int64)[:, None]
        cols = torch.arange(n - bn, n, dtype=torch.int64)[None, :]
        assert torch.equal(out.cpu(), split * (m * n) + rows * n + cols), (m, n, split)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRET, reason="a real launch of this size needs a GPU")
def test_split_k_workspace_past_2_pow_31_elements(gen):
    """A real split-K launch whose workspace holds more than 2**31 elements (9 GiB of fp32 partials):
    the splits from 31 on sit past int32 offsets. W is a Hankel matrix (row n = buf[n : n + K], row stride
    1), distinct rows in a few MiB."""
    m, n, k, split = 32, 2**21 + 2**16, 4096, 32
    if torch.cuda.mem_get_info(DEVICE)[0] < 24 * 2**30:
        pytest.skip("needs about 20 GiB of free GPU memory")
    assert split * m * n > 2**31
    x = randn((m, k), torch.bfloat16, gen)
    buf = randn((n + k,), torch.bfloat16, gen, scale=k**-0.5)
    w = buf.as_strided((n, k), (1, 1))
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w, split_k=split, out_dtype=torch.float32)
    for c0 in range(0, n, 2**17):  # the float64 reference a slice of N at a time
        wc = w[c0 : c0 + 2**17]
        _check(y[:, c0 : c0 + 2**17], x, wc, seed=gen.seed_value, name=f"columns {c0}..")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="CUDA/HIP graphs need a GPU")
def test_split_k_in_cuda_graphs(gen):
    """Split-K calls captured in two graphs on one stream, replayed in turn and on two streams at once:
    each replay is right (each graph owns its arrival counters)."""
    n, k = 333, 2048
    xs = [randn((3, k), torch.bfloat16, gen) for _ in range(2)]
    ws = [randn((n, k), torch.bfloat16, gen, scale=k**-0.5) for _ in range(2)]
    for x, w in zip(xs, ws):  # compile outside the capture
        sg.skinny_gemm(x, w, split_k=4)
    side = torch.cuda.Stream()
    graphs, outs = [], []
    with torch.cuda.stream(side):
        for x, w in zip(xs, ws):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=side):
                outs.append(sg.skinny_gemm(x, w, split_k=4))
            graphs.append(g)
    torch.cuda.current_stream().wait_stream(side)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(3):
        for x in xs:
            x.copy_(randn(x.shape, torch.bfloat16, gen))
        for g, s in zip(graphs, streams):
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                g.replay()
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for y, x, w in zip(outs, xs, ws):
            _check(y, x, w, seed=gen.seed_value, name="graph replay")


def test_split_k_larger_than_k_blocks_is_clamped(gen):
    x = randn((2, 300), torch.bfloat16, gen)
    w = randn((40, 300), torch.bfloat16, gen, scale=300**-0.5)
    with poisoned_outputs():
        y = sg.skinny_gemm(x, w, split_k=64)
    _check(y, x, w, seed=gen.seed_value)


def test_xcd_remap_is_a_bijection():
    for x in (1, 3, 8):
        for count in list(range(0, 70)) + [303, 304, 305, 1000, 1003]:
            table = [sg.xcd_remap_ref(p, count, x) for p in range(count)]
            assert sorted(table) == list(range(count)), (count, x)
            # each XCD's programs get one contiguous run of logical ids, in dispatch order
            start = 0
            for xcd in range(x):
                run = [table[p] for p in range(xcd, count, x)]
                assert run == list(range(start, start + len(run)))
                start += len(run)


def test_xcd_remap_matches_the_shared_helper():
    """Same map as scripts/xcd_remap.py (kept as a copy: a leaf file imports nothing of the project)."""
    xr = pytest.importorskip("xcd_remap")
    for x in (1, 8):
        for count in (1, 7, 8, 9, 63, 100):
            assert [sg.xcd_remap_ref(p, count, x) for p in range(count)] == [
                xr.xcd_remap_ref(p, count, x) for p in range(count)
            ]


# --------------------------------------------------------------------------------------------
# Launch heuristics
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "target,cus",
    [(("hip", "gfx942", 64), 304), (("hip", "gfx950", 64), 256), (("hip", "gfx1201", 32), 64), (("cuda", 90, 32), 132)],
)
def test_launch_config_fills_the_gpu_for_llama_shapes(target, cus):
    """Llama-3 8B / 70B projections at M = 1..32: at least one program per CU unless the split count is at
    its cap, no empty split, 16-byte W vectors per lane, the XCD remap only on 8-XCD parts."""
    for n, k in [(4096, 4096), (14336, 4096), (1024, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]:
        for m in (1, 2, 4, 8, 32):
            for wb in (2, 1):
                c = sg._launch_config(m, n, k, wb, target, cus)
                tiles = -(-n // c.block_n)
                cap = sg._split_cap(m, k, wb, -(-k // c.block_k))
                assert tiles * c.split_k >= cus or c.split_k == cap, (n, k, m, wb, c)
                if n >= 4096:  # every projection but the small GQA k/v one fills the GPU outright
                    assert tiles * c.split_k >= cus, (n, k, m, wb, c)
                assert (c.split_k - 1) * c.k_per_split < k <= c.split_k * c.k_per_split
                assert c.k_per_split % c.block_k == 0
                assert (c.block_k * wb) % 16 == 0
                assert c.use_dot == (m > sg._FMA_MAX_M)
                assert c.num_xcds == (8 if target[1] in ("gfx942", "gfx950") else 1)


# --------------------------------------------------------------------------------------------
# Empty inputs
# --------------------------------------------------------------------------------------------
def test_empty_m_n_and_k(gen):
    w = randn((33, 64), torch.bfloat16, gen)
    y = sg.skinny_gemm(torch.empty((0, 64), dtype=torch.bfloat16, device=DEVICE), w)
    assert y.shape == (0, 33)
    y = sg.skinny_gemm(torch.empty((2, 0, 64), dtype=torch.bfloat16, device=DEVICE), w)
    assert y.shape == (2, 0, 33)
    x = randn((3, 64), torch.bfloat16, gen)
    y = sg.skinny_gemm(x, torch.empty((0, 64), dtype=torch.bfloat16, device=DEVICE))
    assert y.shape == (3, 0)
    # K = 0: an empty sum, y = bias (or zeros)
    b = randn((5,), torch.bfloat16, gen)
    x0 = torch.empty((3, 0), dtype=torch.bfloat16, device=DEVICE)
    w0 = torch.empty((5, 0), dtype=torch.bfloat16, device=DEVICE)
    with poisoned_outputs():
        assert torch.equal(sg.skinny_gemm(x0, w0, b), b.expand(3, 5))
        assert torch.equal(sg.skinny_gemm(x0, w0), torch.zeros(3, 5, dtype=torch.bfloat16, device=DEVICE))


# --------------------------------------------------------------------------------------------
# Error paths
# --------------------------------------------------------------------------------------------
def _xw(m=2, n=8, k=32, dtype=torch.bfloat16):
    return torch.randn(m, k).to(DEVICE, dtype), torch.randn(n, k).to(DEVICE, dtype)


def test_more_than_32_rows_raises():
    x, w = _xw(m=33)
    with pytest.raises(ValueError, match=r"33 rows.*at most 32.*torch.matmul"):
        sg.skinny_gemm(x, w)
    with pytest.raises(ValueError, match="at most 32"):
        sg.skinny_gemm(torch.randn(3, 11, 32).to(DEVICE, torch.bfloat16), w)


def test_shape_errors():
    x, w = _xw()
    with pytest.raises(ValueError, match=r"x has K = 32.*K = 31"):
        sg.skinny_gemm(x, w[:, :31].contiguous())
    with pytest.raises(ValueError, match=r"weight must be 2-D"):
        sg.skinny_gemm(x, w[None])
    with pytest.raises(ValueError, match=r"bias has shape \(7,\); expected \[N\] = \[8\]"):
        sg.skinny_gemm(x, w, torch.zeros(7, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        sg.skinny_gemm(torch.randn(32, 2).to(DEVICE, torch.bfloat16).t(), w)
    with pytest.raises(ValueError, match="weight must be contiguous in its last dimension"):
        sg.skinny_gemm(x, torch.randn(32, 8).to(DEVICE, torch.bfloat16).t())
    with pytest.raises(ValueError, match="cannot be flattened"):
        sg.skinny_gemm(torch.randn(4, 3, 32).to(DEVICE, torch.bfloat16).transpose(0, 1), w)
    with pytest.raises(ValueError, match="split_k must be a positive int"):
        sg.skinny_gemm(x, w, split_k=0)


def test_dtype_errors():
    x, w = _xw()
    with pytest.raises(TypeError, match="x is float16 but weight is bfloat16"):
        sg.skinny_gemm(x.half(), w)
    with pytest.raises(TypeError, match="x has dtype float32; expected one of"):
        sg.skinny_gemm(x.float(), w)
    with pytest.raises(TypeError, match="weight has dtype float32"):
        sg.skinny_gemm(x, w.float())
    f8 = torch.float8_e4m3fn
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(TypeError, match="FP8 x needs FP8 weights"):
        sg.skinny_gemm(x.to(f8), w, x_scale=one)
    with pytest.raises(TypeError, match="FP8 x must have the weight's FP8 dtype"):
        sg.skinny_gemm(x.to(f8), w.to(torch.float8_e4m3fnuz), weight_scale=one, x_scale=one)
    with pytest.raises(TypeError, match="out_dtype must be one of"):
        sg.skinny_gemm(x, w, out_dtype=torch.float64)
    with pytest.raises(TypeError, match="bias has dtype int32"):
        sg.skinny_gemm(x, w, torch.zeros(8, dtype=torch.int32, device=DEVICE))


def test_scale_errors():
    x, w = _xw()
    w8 = w.to(torch.float8_e4m3fn)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="weight_scale .* is required"):
        sg.skinny_gemm(x, w8)
    with pytest.raises(ValueError, match="weight_scale is only for FP8 weights"):
        sg.skinny_gemm(x, w, weight_scale=one)
    with pytest.raises(ValueError, match=r"weight_scale has shape \(7,\); expected 1 value .* or \[N\] = \[8\]"):
        sg.skinny_gemm(x, w8, weight_scale=torch.ones(7, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight_scale has shape \(2, 4\)"):
        sg.skinny_gemm(x, w8, weight_scale=torch.ones(2, 4, device=DEVICE))
    with pytest.raises(TypeError, match="weight_scale has dtype bfloat16; expected float32"):
        sg.skinny_gemm(x, w8, weight_scale=one.bfloat16())
    with pytest.raises(TypeError, match="weight_scale must be a float32 torch.Tensor"):
        sg.skinny_gemm(x, w8, weight_scale=1.0)
    with pytest.raises(ValueError, match="x_scale .* is required"):
        sg.skinny_gemm(x.to(torch.float8_e4m3fn), w8, weight_scale=one)
    with pytest.raises(ValueError, match="x_scale is only for FP8 x"):
        sg.skinny_gemm(x, w8, weight_scale=one, x_scale=one)
    with pytest.raises(ValueError, match=r"x_scale has shape \(2,\); expected 1 value"):
        sg.skinny_gemm(x.to(torch.float8_e4m3fn), w8, weight_scale=one, x_scale=torch.ones(2, device=DEVICE))


def test_cpu_tensor_without_interpreter_raises(monkeypatch):
    if DEVICE.type != "cpu":
        pytest.skip("the check concerns CPU tensors")
    import kernel_runtime

    monkeypatch.setattr(kernel_runtime, "_interpreting", lambda: False)  # the runtime's device check
    x, w = _xw()
    with pytest.raises(ValueError, match="x is a CPU tensor: Triton kernels run on a GPU"):
        sg.skinny_gemm(x, w)


@pytest.mark.gpu
def test_tensors_on_different_devices_raise():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU next to the CPU")
    x, w = _xw()
    with pytest.raises(ValueError, match="weight is on cpu but x is on"):
        sg.skinny_gemm(x, w.cpu())


# --------------------------------------------------------------------------------------------
# torch.library op and the self-check
# --------------------------------------------------------------------------------------------
def test_custom_op_and_fake(gen):
    x = randn((3, 256), torch.bfloat16, gen)
    w8, s = _quantize(torch.randn((50, 256), generator=gen), torch.float8_e4m3fn, per_channel=True)
    y = getattr(torch.ops, sg._NS).skinny_gemm(x, w8, None, s, None, None, None)
    _check(y, x, w8, weight_scale=s, seed=gen.seed_value)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w8)
        out = getattr(torch.ops, sg._NS).skinny_gemm(fx, fw, None, mode.from_tensor(s), None, torch.float32, None)
        assert out.shape == (3, 50) and out.dtype == torch.float32


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a GPU or the interpreter")
def test_main_self_check(capsys):
    assert sg._main(["--m", "3", "--n", "70", "--k", "300", "--bias"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert sg._main(["--m", "1", "--n", "70", "--k", "300", "--weight", "fp8", "--fp8-x", "--split-k", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    with pytest.raises(SystemExit) as e:
        sg._main(["--help"])
    assert e.value.code == 0


# --------------------------------------------------------------------------------------------
# Dispatch back to torch where measured faster
# --------------------------------------------------------------------------------------------
def test_dispatch_back_to_torch_above_the_measured_bound(gen, monkeypatch):
    target = sg._device_target(DEVICE)
    monkeypatch.setattr(sg, "_KERNEL_MAX_M", {(target[0], target[1], "16-bit"): 8, (target[0], target[1], "fp8"): 8})
    calls = []
    real = sg._torch_linear

    def spy(*a):
        y = real(*a)
        calls.append((a[0].shape[0], y is not None))  # rows, and whether torch took the call
        return y

    monkeypatch.setattr(sg, "_torch_linear", spy)
    n, k = 96, 512
    x = randn((16, k), torch.bfloat16, gen)
    w = randn((n, k), torch.bfloat16, gen, scale=k**-0.5)
    b = randn((n,), torch.bfloat16, gen)
    _check(sg.skinny_gemm(x, w, b), x, w, b, seed=gen.seed_value)  # 16 rows > 8: torch
    _check(sg.skinny_gemm(x[:8], w, b), x[:8], w, b, seed=gen.seed_value)  # 8 rows: the kernel
    _check(sg.skinny_gemm(x, w, b, split_k=2), x, w, b, seed=gen.seed_value)  # forced split: the kernel
    assert calls == [(16, True)]
    # FP8 weights with bf16 x: no torch equivalent, the kernel runs
    wq, ws = _quantize(torch.randn((n, k), generator=gen), torch.float8_e4m3fn, per_channel=True)
    _check(sg.skinny_gemm(x, wq, weight_scale=ws), x, wq, weight_scale=ws, seed=gen.seed_value)
    assert calls == [(16, True)]
    # FP8 x and W, per-tensor and per-channel weight scales: torch._scaled_mm
    xs = (x.float().abs().max() / 448.0).reshape(1)
    xq = (x.float() / xs).to(torch.float8_e4m3fn)
    for scale_w, wq_ in ((ws, wq), _quantize(torch.randn((n, k), generator=gen), torch.float8_e4m3fn, False)[::-1]):
        y = sg.skinny_gemm(xq, wq_, b, weight_scale=scale_w, x_scale=xs)
        _check(y, xq, wq_, b, weight_scale=scale_w, x_scale=xs, seed=gen.seed_value)
    assert calls == [(16, True)] * 3

# SPDX-License-Identifier: Apache-2.0
"""Peak tensor memory of a forward without a GPU: the bytes of the tensors that torch allocates while a
``PeakMemory`` mode is active, counted from their allocation to the death of their storage.

    from cpu_peak_memory import PeakMemory
    with torch.no_grad(), PeakMemory() as mem:
        model(**kw)
    print(mem.peak, mem.live)          # bytes above the start: the highest point, and what is still held

    python scripts/cpu_peak_memory.py --model hunyuan_video15 --frames 25 --height 160 --width 176

What it counts: every tensor storage an op creates while the mode is active (torch.empty in a kernel's
launcher, a matmul's output, a ``torch.cat``...), each storage once however many views share it, from the
op that created it until the storage is freed (a weakref finalizer on the storage: torch keeps one Python
object per storage for as long as the storage lives). Storages that existed before (weights, inputs, a
cache filled earlier) count nothing, also when an op returns a view of them. A storage resized by an op is
counted at its new size. The peak is the highest sum of live bytes right after an op has made its outputs
(its inputs still alive), as a GPU's allocator counts max_memory_allocated; ``by_op`` names what was live
at that moment.

What it does not count: scratch that a C++ kernel allocates and frees inside one op (an attention kernel's
workspace), memory that is not a torch tensor (Triton's interpreter works on NumPy copies: on a GPU they do
not exist), and allocator rounding and caching. On a GPU, SDPA picks a kernel by device, dtype and mask; its
internal buffers differ from the CPU's. So the numbers compare two ways of running one model on the CPU (stock
against injected kernels): the difference at the peak, and which tensors make it, carries over to the GPU.

Run the command line with TRITON_INTERPRET=1 set (it sets it itself when no GPU is found) so the injected
kernels run through Triton's interpreter; without it an injected forward on CPU tensors runs stock code.
"""

from __future__ import annotations

import gc
import os
import sys
import traceback
import weakref
from collections import Counter

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

__all__ = ["PeakMemory", "forward_peak", "compare"]


def _storage(x):
    """The untyped storage behind a tensor leaf (or the storage itself), or None (no storage: sparse, nested)."""
    if isinstance(x, torch.UntypedStorage):
        return x
    if isinstance(x, torch.Tensor):
        try:
            return x.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
    return None


class PeakMemory(TorchDispatchMode):
    """A TorchDispatchMode that follows the bytes of the tensor storages created while it is active.

    live: bytes of those storages still alive; peak: the highest value live reached (both from 0 at entry);
    allocated: all bytes created; allocations: how many storages. With record=True, peak_tensors lists what
    was live at the peak: (bytes, op, shape, dtype, where) with the allocating line of the first Python frame
    outside torch (slow: a stack walk per allocation; for finding out which tensors make a peak)."""

    def __init__(self, record: bool = False):
        super().__init__()
        self.record = record
        self.live = self.peak = self.allocated = self.allocations = 0
        self.cyclic = 0  # bytes freed by a garbage collection that the model's own code left (see _launched)
        self.peak_tensors: list = []
        self.peak_at = None  # (op, where) of the op that set the peak, with record
        self._sizes: dict = {}  # storage key -> counted bytes
        self._info: dict = {}  # storage key -> (op, shape, dtype, where), with record
        self._saved = None

    def __enter__(self):
        # Triton's interpreter keeps each launch's tensors in a reference cycle (a recursive closure over a dict of
        # their storages) that only the garbage collector frees; on a GPU nothing holds them. So, while measuring,
        # automatic collection is off (the numbers repeat) and a collection follows each interpreted launch,
        # which frees exactly that; gc.freeze() first, so each collection walks only the objects made since.
        # Anything else a collection frees (a cycle the model's code made: on a GPU it would live until a
        # collection too) is counted in `cyclic`, as is what a last collection frees at exit.
        gc.collect()
        self._saved = (gc.isenabled(), _patch_interpreter(self))
        gc.disable()
        gc.freeze()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        enabled, unpatch = self._saved
        try:
            before = self.live
            gc.collect()
            self.cyclic += before - self.live
        finally:
            gc.unfreeze()
            if unpatch is not None:
                unpatch()
            if enabled:
                gc.enable()
        return out

    def _launched(self, tensors) -> None:
        """After an interpreted launch: collect the interpreter's cycle. Storages it frees other than the launch's
        own tensors belong to a cycle of someone else's: counted in cyclic."""
        own = {s._cdata for s in (_storage(t) for t in tensors) if s is not None}
        before = dict(self._sizes)
        gc.collect()
        self.cyclic += sum(n for k, n in before.items() if k not in self._sizes and k not in own)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _free(self, key) -> None:
        self.live -= self._sizes.pop(key, 0)
        self._info.pop(key, None)

    def _add(self, s: torch.UntypedStorage, func, t) -> None:
        key, n = s._cdata, s.nbytes()
        self._sizes[key] = n
        self.live += n
        self.allocated += n
        self.allocations += 1
        weakref.finalize(s, self._free, key)
        if self.record:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else (n,)
            dtype = t.dtype if isinstance(t, torch.Tensor) else None
            self._info[key] = (str(func), shape, dtype, _caller())

    def _resized(self, s: torch.UntypedStorage) -> None:
        key = s._cdata
        old = self._sizes.get(key)
        if old is not None and s.nbytes() != old:
            self.live += s.nbytes() - old
            self.allocated += max(0, s.nbytes() - old)
            self._sizes[key] = s.nbytes()

    def _check_peak(self, func) -> None:
        if self.live > self.peak:
            self.peak = self.live
            if self.record:
                self.peak_at = (str(func), _caller())
                self.peak_tensors = sorted(
                    ((self._sizes[k], *self._info[k]) for k in self._sizes if k in self._info),
                    key=lambda r: -r[0],
                )

    # ---- the dispatcher ------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before = {}
        for x in tree_leaves((args, kwargs)):
            s = _storage(x)
            if s is not None:
                before[s._cdata] = s
        out = func(*args, **kwargs)
        for s in before.values():  # an out= or resize_ op may have resized a storage counted here
            self._resized(s)
        seen = set()
        for x in tree_leaves(out):
            s = _storage(x)
            if s is None:
                continue
            key = s._cdata
            if key in seen or key in before:
                continue  # counted once; a view of an input (or the input itself) is no new storage
            seen.add(key)
            if key in self._sizes:
                self._resized(s)
            else:
                self._add(s, func, x)
        self._check_peak(func)
        return out

    def by_op(self, top: int = 12) -> list:
        """The largest groups of what was live at the peak (record=True): (bytes, count, op, where)."""
        groups: Counter = Counter()
        counts: Counter = Counter()
        for n, op, _shape, _dtype, where in self.peak_tensors:
            groups[(op, where)] += n
            counts[(op, where)] += 1
        return [(n, counts[k], *k) for k, n in groups.most_common(top)]


def _patch_interpreter(mem: PeakMemory):
    """Wrap the launch of Triton's interpreter (when it is in use) so that mem._launched follows each launch;
    returns the function that undoes it, or None."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:
        return None
    call = GridExecutor.__call__

    def launched(executor, *args, **kwargs):
        try:
            return call(executor, *args, **kwargs)
        finally:
            mem._launched(tree_leaves((args, kwargs)))

    GridExecutor.__call__ = launched

    def undo():
        GridExecutor.__call__ = call

    return undo


_TORCH_DIR = os.path.dirname(torch.__file__)


def _caller() -> str:
    """file:line function of the innermost Python frame outside torch (where the allocation was asked for)."""
    for frame in reversed(traceback.extract_stack(limit=40)[:-3]):
        if not frame.filename.startswith(_TORCH_DIR) and frame.filename != __file__:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def forward_peak(model, kw: dict, *, warmup: int = 1, inference_mode: bool = False, record: bool = False):
    """The PeakMemory of one model(**kw) forward under torch.no_grad() (torch.inference_mode() with
    inference_mode), after `warmup` forwards that build whatever the first call builds (launch plans,
    probes), as a benchmark measures after its warm-up. The output is dropped inside the measurement (its bytes
    are in the peak; ``live`` after is what the model keeps)."""
    ctx = torch.inference_mode if inference_mode else torch.no_grad
    with ctx():
        for _ in range(warmup):
            model(**kw)
        mem = PeakMemory(record=record)
        with mem:
            out = model(**kw)
            del out
    return mem


def compare(model, kw: dict, inject, remove=None, **opts) -> dict:
    """{"stock": PeakMemory, "injected": PeakMemory}: forward_peak of model before and after inject(model)
    (remove(model) afterwards, if given)."""
    stock = forward_peak(model, kw, **opts)
    inject(model)
    try:
        injected = forward_peak(model, kw, **opts)
    finally:
        if remove is not None:
            remove(model)
    return {"stock": stock, "injected": injected}


def _main(argv=None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(
        description="Peak tensor memory of one forward of a model_zoo model on the CPU, stock against injected "
        "(diffusers_injection.inject_optimized_kernels), through Triton's interpreter: the bytes of the tensors "
        "torch allocates during the forward (a TorchDispatchMode; see the module docstring). Use larger token "
        "counts than the tiny default (--frames / --height / --width / --text) so that activations, not "
        "weights, set the proportions, as at a real model's token count.",
    )
    p.add_argument("--model", default="hunyuan_video15", help="a model_zoo name (default hunyuan_video15)")
    p.add_argument("--blocks", type=int, help="keep this many blocks of each block list (default: the tiny model's)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights and inputs (default fp32)")
    p.add_argument("--height", type=int, help="pixels (default: the tiny geometry)")
    p.add_argument("--width", type=int, help="pixels (default: the tiny geometry)")
    p.add_argument("--frames", type=int, help="video frames (video models)")
    p.add_argument("--text", type=int, help="text tokens")
    p.add_argument("--inference-mode", action="store_true", help="torch.inference_mode() instead of torch.no_grad()")
    p.add_argument("--top", type=int, default=0, help="also list the N largest groups of tensors live at each peak")
    args = p.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET") is None and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported
    import diffusers_injection as di
    import model_zoo as mz

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    geometry = dict(height=args.height, width=args.width, frames=args.frames, text=args.text)
    geometry = {k: v for k, v in geometry.items() if v is not None}
    model = mz.build(args.model, "tiny", dtype=dtype, blocks=args.blocks)
    kw = mz.inputs(args.model, model, "tiny", geometry=geometry)
    res = compare(
        model,
        kw,
        lambda m: di.inject_optimized_kernels(m, verbose=False),
        lambda m: di.remove_optimized_kernels(m, verbose=False),
        inference_mode=args.inference_mode,
        record=bool(args.top),
    )
    report = {
        "model": mz.describe(args.model, "tiny", geometry=geometry),
        "dtype": args.dtype,
        "grad_mode": "inference_mode" if args.inference_mode else "no_grad",
    }
    for name, mem in res.items():
        report[name] = {
            "peak_bytes": mem.peak,
            "allocated_bytes": mem.allocated,
            "allocations": mem.allocations,
            "cyclic_bytes": mem.cyclic,
        }
        if args.top:
            report[name]["peak_set_by"] = " at ".join(mem.peak_at or ())
            report[name]["at_peak"] = [
                {"bytes": n, "tensors": c, "op": op, "where": where} for n, c, op, where in mem.by_op(args.top)
            ]
    report["injected_minus_stock_bytes"] = res["injected"].peak - res["stock"].peak
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

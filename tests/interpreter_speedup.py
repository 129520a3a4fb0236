# SPDX-License-Identifier: Apache-2.0
"""A faster Triton interpreter for the tests, computing the same: install() once Triton is importable (conftest.py
does it in the test processes; subprocess_site/sitecustomize.py in the Python processes the tests start with
kernel_testing.with_interpreter_speedup(env)). Nothing here changes what a kernel computes.

Triton's interpreter swaps triton.language's builtins for interpreted ones when a kernel launches
(GridExecutor.__call__ -> _patch_lang, undone after the grid), and again at every call of a @triton.jit function
inside the kernel (its own helpers, tl.sum, ...), in every program: the modules that function sees walked member by
member, builtins already swapped left alone, range, reduce, tensor.__bool__, ... set anew to the same code; never
undone. That walk is about a third of the interpreter's time. Here such a call skips it where, within the same
launch, the modules it sees were swapped already and nothing has swapped or restored anything since
(tl.core.associative_scan, set anew by every swap and every restore, is still the one this launch's last swap set);
otherwise it runs as before.

This leans on code inside Triton, so it is installed only over the interpreter it was checked against: the source
of every function it relies on must hash to one of KNOWN_INTERPRETERS. Any other Triton runs its interpreter as it
is (correct, slower), and test_kernel_testing.py's speed-up tests are skipped with the reason (to take the speed-up
to a new Triton: review the functions in _relied_on there, then add its hash);
test_interpreter_swaps_the_language_once_a_launch checks the skip and that the results are those of Triton's own
swap, bit for bit."""

import hashlib
import inspect

# sha256 (first 16 hex digits) of the source of _RELIED_ON -> the Triton release it was checked in
KNOWN_INTERPRETERS = {"2502124159355f20": "3.9.0"}

# Why install() left the interpreter as it is (None: installed, or not tried yet); the tests' report header shows it
NOT_INSTALLED = None


def _relied_on(ti):
    return (
        ti._patch_lang,
        ti._patch_builtin,
        ti._patch_attr,
        ti._patch_lang_tensor,
        ti._patch_lang_core,
        ti._patch_reduce_scan,
        ti._LangPatchScope,
        ti.GridExecutor.__call__,
        ti.InterpretedFunction.__call__,
        ti.InterpretedFunction.run,
    )


def interpreter_fingerprint() -> str:
    """The hash of the source of the interpreter functions install() relies on (AttributeError if one is gone)."""
    from triton.runtime import interpreter as ti

    h = hashlib.sha256()
    for obj in _relied_on(ti):
        h.update(inspect.getsource(getattr(obj, "original", obj)).encode())
    return h.hexdigest()[:16]


def install() -> bool:
    """Put the wrappers in place over a known interpreter; returns whether they are. Otherwise NOT_INSTALLED says
    why (the speed-up's tests skip with it)."""
    global NOT_INSTALLED
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as ti

    if hasattr(ti._patch_lang, "original"):  # installed already
        return True
    try:
        fingerprint = interpreter_fingerprint()
    except (AttributeError, OSError, TypeError) as e:
        fingerprint = f"unreadable ({e!r})"
    if fingerprint not in KNOWN_INTERPRETERS:
        NOT_INSTALLED = (
            f"Triton {triton.__version__}'s interpreter (fingerprint {fingerprint}) is not one tests/interpreter_"
            f"speedup.py was checked against ({KNOWN_INTERPRETERS}): review its wrappers against the functions in "
            "_relied_on, then add the fingerprint to KNOWN_INTERPRETERS. The kernels ran through Triton's own "
            "interpreter, unchanged (and slower)."
        )
        return False
    patch_lang, grid_call = ti._patch_lang, ti.GridExecutor.__call__

    import threading

    launches = threading.local()  # per thread: a stack of [modules swapped, tl.core.associative_scan] a launch
    seen = {}  # function -> ids of the language modules among its globals (what _patch_lang swaps for it)

    def langs(fn):
        key = (fn, len(fn.__globals__))
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[key]

    class _Kept:
        def restore(self):
            pass

    def patched_lang(fn):
        stack = getattr(launches, "stack", None)
        state = stack[-1] if stack else None
        intact = state is not None and state[0] is not None and tl.core.associative_scan is state[1]
        if intact and langs(fn) <= state[0]:
            patched_lang.skipped += 1
            return _Kept()
        scope = patch_lang(fn)
        if state is not None:
            state[0] = langs(fn) | state[0] if intact else langs(fn)
            state[1] = tl.core.associative_scan
        return scope

    patched_lang.skipped, patched_lang.original = 0, patch_lang

    def grid_executor_call(self, *args, **kwargs):
        if not hasattr(launches, "stack"):
            launches.stack = []
        launches.stack.append([None, None])
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.stack.pop()

    grid_executor_call.original = grid_call
    ti._patch_lang, ti.GridExecutor.__call__ = patched_lang, grid_executor_call
    NOT_INSTALLED = None
    return True

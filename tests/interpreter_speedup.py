# SPDX-License-Identifier: Apache-2.0
"""A faster Triton interpreter for the tests, computing the same: install() once Triton is importable (conftest.py
does it in the test processes; subprocess_site/sitecustomize.py in the Python processes the tests start with
kernel_testing.with_interpreter_speedup(env)). Nothing here changes what a kernel computes."""


def install() -> bool:
    """Triton's interpreter swaps triton.language's builtins for interpreted ones when a kernel launches
    (GridExecutor.__call__ -> _patch_lang, undone after the grid), and again at every call of a @triton.jit
    function inside the kernel (its own helpers, tl.sum, ...), in every program: the modules that function sees
    walked member by member, builtins already swapped left alone, range, reduce, tensor.__bool__, ... set anew to
    the same code; never undone. That walk is about a third of the interpreter's time. Here such a call skips it
    where, within the same launch, the modules it sees were swapped already and nothing has swapped or restored
    anything since (tl.core.associative_scan, set anew by every swap and every restore, is still the one this
    launch's last swap set); otherwise it runs as before. What the kernels compute is unchanged:
    test_kernel_testing.py's test_interpreter_swaps_the_language_once_a_launch checks the skip and its results.
    Returns whether the wrappers are in place (not with a Triton whose interpreter differs: left as it is)."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter as ti

        patch_lang, grid_call = ti._patch_lang, ti.GridExecutor.__call__
        tl.core.associative_scan  # noqa: B018 (the attribute every swap sets)
    except (ImportError, AttributeError):  # another Triton: left as it is
        return False
    if hasattr(patch_lang, "original"):  # installed already
        return True
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
    return True

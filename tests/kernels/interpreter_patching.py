"""A pytest plugin (and module) for the processes that run Triton kernels under the
interpreter (TRITON_INTERPRET=1; `-p tests.kernels.interpreter_patching`, or imported).

Under the interpreter a kernel launch patches the triton.language modules that the kernel sees
(`_patch_lang`: every builtin of tl or tl.core, tl.math and tl.tensor replaced, found with
`inspect.getmembers`) and restores them when it returns. Every call of a device function from
the kernel (its own `@triton.jit` helpers, and triton's: tl.sum, tl.zeros, tl.cumsum,
tl.randint...) patches the modules that function sees again, ~2 ms each, and never restores
them, so they stay patched until the launch's end. Here that call is skipped where the launch
has already patched every module the function sees: the replacements are stateless and the
same each time, so the kernels compute exactly as before. The skipped calls were about a
quarter of the interpreted kernels' time (the head loss's row selection: a few hundred device
calls per launch; AdamW's Philox rounding)."""

from __future__ import annotations

import functools
import inspect
import os


class _Unpatched:
    """The scope of a skipped patch: nothing to restore."""

    @staticmethod
    def restore() -> None:
        pass


class _Tracked:
    """A patch's scope that, once restored, no longer counts its modules as patched."""

    def __init__(self, scope, active: list, modules: set[int]) -> None:
        self._scope, self._active, self._entry = scope, active, (modules,)
        active.append(self._entry)

    def restore(self) -> None:
        self._active[:] = [entry for entry in self._active if entry is not self._entry]
        self._scope.restore()

    def __getattr__(self, name: str):
        return getattr(self._scope, name)


def install() -> None:
    """Wraps the interpreter's `_patch_lang` and launch (`GridExecutor.__call__`); once. Does
    nothing on a triton without them."""
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_mtprun_patch_once", False):
        return
    if not hasattr(interpreter, "_patch_lang") or not hasattr(interpreter, "GridExecutor"):
        return
    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    launches: list[list] = []  # per running launch: the (modules,) of its unrestored patches

    def modules(fn) -> set[int]:
        return {
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
        }

    def patch_once(fn):
        seen = modules(fn)
        if not launches:
            return patch_lang(fn)
        active = launches[-1]
        if seen and seen <= set().union(*(patched for (patched,) in active)):
            return _Unpatched
        return _Tracked(patch_lang(fn), active, seen)

    @functools.wraps(launch)
    def run_launch(self, *args, **kwargs):
        launches.append([])
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = run_launch
    interpreter._mtprun_patch_once = True


if os.environ.get("TRITON_INTERPRET") == "1":
    install()

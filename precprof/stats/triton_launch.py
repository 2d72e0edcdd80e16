"""Launching compiled Triton kernels without Triton's per-call binding: the row kernels' (``triton_engine``)
and the block what-if's (``triton_block``).

Triton's ``kernel[grid](...)`` binds and specialises every argument in Python on every call (tens of
microseconds). Once a kernel is compiled for a variant, ``_DirectLaunch`` calls its launcher with the
arguments in the kernel's order, as ``JITFunction.run`` does after binding; ``adopt_direct`` keeps a direct
launcher only after a small launch shows it writes what Triton's own launch writes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch


@functools.cache
def _takes_maxnreg() -> bool:
    """Whether this Triton's CUDA compile takes ``maxnreg``."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "maxnreg" in CUDAOptions.__dataclass_fields__


def register_bound(max_registers: int | None) -> dict[str, Any]:
    """The compile option that bounds a thread's registers to ``max_registers`` (ptxas's ``.maxnreg``: fewer
    registers, more programs resident on a multiprocessor), where this Triton takes one; {} for None, in the
    interpreter, which has no registers, and under a ROCm build of torch (its compile has no such option)."""
    if max_registers is None or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return {}
    if getattr(torch.version, "hip", None):
        return {}
    return {"maxnreg": max_registers} if _takes_maxnreg() else {}


def load_kernels(kernels: Iterable[Any]) -> int:
    """Load compiled kernels onto their device now, not at their first launch (inside a hook); returns how many
    (none in the interpreter, which compiles nothing)."""
    n = 0
    for kernel in kernels:
        if hasattr(kernel, "result"):  # a compile of parallel_compile's, done by now
            kernel = kernel.result()
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            init()
            n += 1
    return n


def adopt_direct(
    into: dict[Any, Any],
    pending: Iterable[tuple[Any, Any]],
    make: Callable[[Any, Any], Any],
    check: Callable[[Any, Any], bool],
    differ: str,
) -> list[str]:
    """For each (key, compiled) of ``pending``: its direct launcher ``make(key, compiled)``, kept in ``into``
    when ``check(key, launcher)`` finds it writes what Triton's own launch writes. Returns why the others keep
    Triton's launch (``differ`` when the check failed; the error when making it did: a Triton whose launcher
    takes other arguments)."""
    why = []
    for key, compiled in pending:
        try:
            launcher = make(key, compiled)
            if check(key, launcher):
                into[key] = launcher
            else:
                why.append(f"{key}: {differ}")
        except Exception as e:
            why.append(f"{key}: {type(e).__name__}: {e}")
    return why


def direct_status(n: int, what: str, why: Sequence[str]) -> str:
    """How a kernel set is launched, in words (``adopt_direct``'s count and reasons)."""
    return f"direct launch of {n} compiled {what}" + (
        f"; Triton's launch for the others ({'; '.join(why)})" if why else ""
    )


class _DirectLaunch:
    """A compiled variant of ``_rows`` launched straight through its launcher, as Triton's own
    ``JITFunction.run`` does once it has bound and specialised the arguments (Triton 3.3 and later: every
    argument, constexprs included, in the kernel's order); launch hooks (a profiler's) are honoured."""

    def __init__(self, kernel: Any, compiled: Any, constexprs: dict[str, Any]) -> None:
        import triton

        self._runtime = triton.knobs.runtime
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        self._compiled = compiled
        self._run = compiled.run
        self._function = compiled.function
        self._packed = compiled.packed_metadata
        names = list(kernel.arg_names)
        self._n_args = len(names) - len(constexprs)
        assert names[self._n_args :] == list(constexprs), "the constexprs come last, in this order"
        self._constexprs = tuple(constexprs.values())

    def __call__(self, programs: int, stream: int, args: tuple[Any, ...], tensors: int = 1) -> None:
        """Launch a grid of (``programs``, ``tensors``) on the raw CUDA ``stream``."""
        assert len(args) == self._n_args
        full = (*args, *self._constexprs)
        rt = self._runtime
        enter, leave = _hook(rt.launch_enter_hook), _hook(rt.launch_exit_hook)
        # the launch's metadata is for the launch hooks (a profiler's, such as proton's) only
        meta = (
            None if enter is None else self._compiled.launch_metadata((programs, tensors, 1), stream, *full)
        )
        self._run(programs, tensors, 1, stream, self._function, self._packed, meta, enter, leave, *full)


def _hook(hook: Any) -> Any:
    """A launch hook, or None when there is none to call: Triton 3.4 and later keep an empty chain of hooks
    (``knobs.HookChain``), which its own launch asks for the launch's metadata (a dictionary made in Python)
    and calls twice a launch, to do nothing; its launcher takes None for no hook."""
    return None if hook is None or getattr(hook, "calls", True) == [] else hook

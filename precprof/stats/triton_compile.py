"""Compiling the Triton kernels beside the training: the compiler's lazy imports done first, in the calling
thread, and the compiles of a warm-up run side by side on a pool of threads (``stats/buffer.py`` and
``stats/triton_ahead.py`` use them)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from precprof.stats.triton_engine import interpreting, triton_missing

# what a first compile imports lazily: on threads beside the training these imports held the interpreter lock
# while the training thread waited (bench/compile_contention.py)
_COMPILER_MODULES = (
    "triton.compiler.compiler",
    "triton.compiler.code_generator",
    "triton.backends.nvidia.compiler",
    "triton.backends.nvidia.driver",
)


def preload_compiler() -> list[str]:
    """Import, in the calling thread, the modules a Triton compile imports at its first use; returns those
    imported. The Profiler's attach calls it before compiling beside the training, so that the compile threads
    do not take the interpreter lock from the training thread for their imports. Nothing in the interpreter
    (no compile) or without Triton; a module this Triton lacks is passed over."""
    if interpreting() or triton_missing() is not None:
        return []
    import importlib
    import sys

    done = []
    for name in _COMPILER_MODULES:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:  # another Triton's layout: its compile imports what it needs
            continue
        done.append(name)
    return done


@contextlib.contextmanager
def parallel_compile(tasks: int, workers: int | None = None) -> Iterator[None]:
    """Compile the Triton kernels asked for inside the block on a pool of threads (Triton's own
    ``AsyncCompileMode``: a ``warmup`` returns a future; all are done when the block exits). Serial where this
    Triton has no such mode, in the interpreter, or for one task. Compiling the 15 kernels of three dtypes
    one after another took 130 s on an H100 machine's first run (8-14 s each). ``workers``: at most this many
    threads (default: one per task, up to the CPUs and 16)."""
    if interpreting() or triton_missing() is not None:
        yield
        return
    import triton

    mode = getattr(triton, "AsyncCompileMode", None)
    active = getattr(getattr(getattr(triton, "runtime", None), "_async_compile", None), "active_mode", None)
    workers = min(tasks, os.cpu_count() or 1, 16, workers or tasks)
    if mode is None or workers < 2 or (active is not None and active.get() is not None):  # one at a time
        yield
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers, thread_name_prefix="precprof-triton-compile") as pool, mode(pool):
        yield

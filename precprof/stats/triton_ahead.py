"""Compile a StatsBuffer's Triton kernels in another process, before the training's own process loads them.

Why: a compile beside the training on threads holds the interpreter lock through the Python part of every
compile (Triton's frontend walks the kernel's AST in Python). With an empty cache on an H200 the first sampled
gpt2-small step took 2.38 s against 0.48 s without precprof while 34 s of compiles ran beside it
(``bench/results/README_h200_2026-11-27c.md``). A process has its own interpreter lock.

How: another Python process runs ``main``, which reads a pickled ``Ahead`` on stdin and compiles, for the GPU's
target, exactly the variants the training's process would (``TritonRows.warm``, ``triton_block``'s), into
Triton's on-disk cache. It never touches CUDA: no context, no GPU memory. Triton's JIT runs there with a driver
that only names the target (``_TargetDriver``), and CPU tensors stand in for the GPU's: Triton specialises a
kernel on its arguments' dtypes and 16-byte alignment, which they share, not on their device. The training's
process then compiles the same kernels, and each is a hit in the cache (the compile lock of
``stats/buffer.py`` is held throughout). Where the other process fails or its keys differ (another Triton),
that compile is the former one, on threads: nothing is lost but the other process's time, and
``warm_phases``' "compile" says which happened (a hit takes about half a second, a compile tens).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from precprof._priority import LOWEST, lower_own_priority
from precprof.stats import triton_block, triton_compile, triton_engine, triton_updates
from precprof.stats.layout import RowLayout

# the other process's limit: a compile of every variant took 34 s on an H200 machine's 16 cores
TIMEOUT_S = 600.0
# the other process's scheduling priority (and its ptxas processes'): the lowest, so that its compiles take the
# CPUs the training leaves. At the default, its compiles on every core made an unsampled first gpt2-small step
# on an H200 take 2.07 s against 0.58 s with the kernels already in the cache (gpu_validate's first_step,
# bench/results/gpu_validate_nvidia-h200_2026-11-27e.json)
NICENESS = LOWEST


@dataclass(frozen=True)
class Ahead:
    """What the other process compiles: for a GPU of ``capability`` (major, minor), the row kernels of
    ``layout`` for ``dtypes`` (TritonRows' ``block``, ``num_warps``, ``rare_after``, ``stages``, ``planes``), and
    the block kernels for ``block_dtypes`` and ``recipes``."""

    capability: tuple[int, int]
    layout: RowLayout
    dtypes: tuple[torch.dtype, ...]
    block: int
    num_warps: int
    rare_after: bool
    block_dtypes: tuple[torch.dtype, ...] = ()
    recipes: tuple[Any, ...] = ()
    stages: int = triton_engine.STAGES
    planes: bool = triton_engine.PLANES


class _TargetDriver:
    """The part of a Triton driver its JIT asks for while it compiles without launching (``warmup``): the
    target, a device index and a stream, none of which touches a GPU."""

    def __init__(self, capability: tuple[int, int]) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def compile_here(spec: Ahead) -> int:
    """Compile ``spec``'s kernels in this process for its target, into Triton's cache; how many kernels."""
    from triton.runtime import driver

    driver.set_active(_TargetDriver(spec.capability))
    cpu = torch.device("cpu")
    rows = triton_engine.TritonRows(
        cpu,
        spec.layout,
        block=spec.block,
        num_warps=spec.num_warps,
        rare_after=spec.rare_after,
        stages=spec.stages,
        planes=spec.planes,
    )
    tasks = 6 * len(spec.dtypes) + 2 * len(spec.block_dtypes)
    with triton_compile.parallel_compile(tasks):
        kernels = rows.warm(spec.dtypes, load=False)
        if spec.block_dtypes:
            kernels += triton_block.compile_kernels(cpu, spec.block_dtypes, spec.recipes)
        updates = triton_updates.warm(cpu, spec.dtypes) or []  # (the weight-update samples')
    done = [k.result() if hasattr(k, "result") else k for k in kernels]
    # a failure of theirs is theirs alone: the others are in the cache, and the training's warm says why
    with contextlib.suppress(Exception):
        done += [k.result() if hasattr(k, "result") else k for k in updates]
    return len(done)


def done_marker(spec: Ahead) -> Path | None:
    """The file that says ``spec``'s kernels were compiled into Triton's cache by an earlier run: in that cache
    (wiped with it), named by a hash of the spec, this Triton, the kernels' sources and the block kernel's
    compile options (``triton_block``'s module: its registers bound). None where this Triton does not say
    where its cache is."""
    try:
        import triton

        cache = triton.knobs.cache.dir
        h = hashlib.sha256(pickle.dumps(spec) + triton.__version__.encode())
    except (
        Exception
    ):  # an older Triton (no knobs), none, or a spec that does not pickle (compile_ahead says so)
        return None
    if not cache:
        return None
    for name in (
        "triton_kernels.py",
        "triton_planes.py",
        "triton_finish.py",
        "triton_block_kernels.py",
        "triton_block_math.py",
        "triton_block.py",
        "triton_update_kernels.py",
    ):
        h.update(Path(__file__).with_name(name).read_bytes())
    return Path(cache) / "precprof-ahead" / f"{h.hexdigest()[:32]}.done"


def compile_ahead(spec: Ahead, timeout_s: float = TIMEOUT_S) -> str | None:
    """Run ``compile_here(spec)`` in another Python process (this one waits without the interpreter lock);
    None when it compiled, else why not, in one line. ``cancel_all`` ends it (the training's process exiting).
    Where an earlier run compiled the same spec into the same cache (``done_marker``), no process starts: its
    start and imports took 7 s of an H200 machine's warm-cache run, 66 steps unsampled, a 3-step run's whole
    length."""
    marker = done_marker(spec)
    if marker is not None and marker.is_file():
        return None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # the package as this process imports it (a source tree on sys.path, not installed, included)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-c", "import sys, precprof.stats.triton_ahead as t; sys.exit(t.main())"]
    try:  # whatever goes wrong here (a layout that does not pickle, no interpreter to start) is reported
        with _RUNNING_LOCK:
            if _CANCELLED.is_set():
                return CANCELLED
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
            )
            _RUNNING.add(proc)
        try:
            _out, err = proc.communicate(pickle.dumps(spec), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return f"TimeoutExpired: no compile in {timeout_s:.0f} s"
        finally:
            with _RUNNING_LOCK:
                _RUNNING.discard(proc)
    except Exception as e:
        return f"{type(e).__name__}: {e}".splitlines()[0]
    if _CANCELLED.is_set():
        return CANCELLED
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()
        return f"exit {proc.returncode}: {tail[-1] if tail else 'no message'}"
    if marker is not None:
        with contextlib.suppress(OSError):  # (a read-only cache: the next run starts the process again)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
    return None


# the other processes compiling now, ended by ``cancel_all``
_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.Lock()
_CANCELLED = threading.Event()
CANCELLED = "cancelled: the process exited before the kernels compiled"


def cancel_all() -> int:
    """End every compile in another process, now and from now on (the training's process is exiting: the other
    process would compile for nobody, and its waiting thread must end before the interpreter does); how many
    were running."""
    with _RUNNING_LOCK:
        _CANCELLED.set()
        running = list(_RUNNING)
    for proc in running:
        proc.kill()  # (nothing when it ended meanwhile)
    return len(running)


def spec_of(
    rows: Any,
    capability: tuple[int, int],
    dtypes: Sequence[torch.dtype],
    block_dtypes: Sequence[torch.dtype],
    recipes: Sequence[Any],
) -> Ahead:
    """The ``Ahead`` that compiles what ``rows`` (a ``TritonRows``) and the block kernels will compile."""
    return Ahead(
        capability=capability,
        layout=rows.layout,
        dtypes=tuple(dtypes),
        block=rows.block,
        num_warps=rows.num_warps,
        rare_after=rows.rare_after,
        block_dtypes=tuple(block_dtypes),
        recipes=tuple(recipes),
        stages=rows.stages,
        planes=rows.planes,
    )


def main() -> int:
    """The other process: an ``Ahead`` pickled on stdin (``compile_ahead`` runs it)."""
    spec = pickle.loads(sys.stdin.buffer.read())
    assert isinstance(spec, Ahead)
    # NICENESS, or PRECPROF_HELPER_NICENESS's (a sandbox that forbids it: the priority given)
    niceness = lower_own_priority()
    print(f"{compile_here(spec)} kernels at niceness {niceness if niceness is not None else 'unknown'}")
    return 0

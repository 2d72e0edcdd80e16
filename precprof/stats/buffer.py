"""On-device statistics of one tensor: exponent histogram and exact cast counts, without host syncs.

A call of :meth:`StatsBuffer.accumulate` (or of a device's ``Rows.add``, the hooks' direct path) reads a tensor
once and adds into one row of a preallocated int64 buffer on the tensor's device:

- an exponent histogram, bin = floor(log2|x|), over fp32's whole exponent range (-149..127; subnormals in
  their true bins: every fp32/bf16/fp16/fp8 value is normal as an fp64, so the fp64 exponent field *is*
  floor(log2|x|)); fp64 tensors with exponents outside that range fold into the end bins;
- beside each bin, how many values in it are exact powers of two (mantissa 0). With those, the number of
  values ``<= 2^j`` is exact for every j, so every underflow count at every power-of-two scale — and fp8
  per-tensor current scaling — is an exact host-side sum, also for values sitting exactly on a rounding tie;
- zeros, nan and inf (from the same key: fp64 exponent field 0 is only an exact zero; 0x7ff with mantissa 0 is
  inf, with mantissa != 0 nan);
- the counts of finite values that overflow fp16, bf16, fp8_e4m3 and fp8_e5m2 (one compare each: these
  thresholds are not powers of two);
- the largest finite |x| and the smallest nonzero finite |x| (as fp64 bit patterns, which order like the
  values for non-negative numbers).

The rows of each device are a ``stats.rows.Rows``: the CPU's (``rows_host.HostRows``: the C kernel, or torch
ops) and a device's (``rows_device.DeviceRows``: Triton, or torch ops), none of which ever synchronises.
:meth:`StatsBuffer.to_host` is the one copy per sampled step.

Counts are of the values as given: for a gradient seen under a loss scale s these are the scaled values
x*s, which is exactly what "x underflows at scale s" means (docs/design.md). ``stats.decode`` turns a row into
the unscaled histogram (a shift of bins by log2 s, exact for power-of-two scales) and the per-format counts.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from precprof import _compat
from precprof.stats import blocks as _blocks
from precprof.stats import triton_ahead, triton_compile, triton_engine, triton_launch, triton_updates
from precprof.stats.engine import resolve_engine
from precprof.stats.layout import LAYOUT, RowLayout, merge_rows
from precprof.stats.rows import Rows
from precprof.stats.rows_device import DeviceRows
from precprof.stats.rows_host import HostRows
from precprof.stats.timing import WorkTimer


def make_rows(
    rows: int,
    device: torch.device,
    chunk: int | None,
    *,
    engine: str,
    layout: RowLayout = LAYOUT,
    host_rows: bool | None = None,
    block_slot: np.ndarray | None = None,
) -> Rows:
    """The rows of ``device`` for ``engine``: the CPU's (numpy counts, the C kernel or torch ops) unless the
    engine is Triton or ``host_rows=False`` (tests run the device code path on the CPU), else dense rows."""
    on_cpu = (device.type == "cpu" and engine != "triton") if host_rows is None else host_rows
    kind = HostRows if on_cpu else DeviceRows
    return kind(rows, device, chunk, engine=engine, layout=layout, block_slot=block_slot)


# compile threads beside the training: each holds the interpreter lock through the Python part of a compile, so
# the training thread's share of it shrinks with every thread (at attach, with nothing to share it with, as many
# as there are kernels)
BESIDE_WORKERS = 2

# one compile of a kernel set at a time in a process: a Profiler attached while another's compile of the same
# kernels is in flight waits for it, then loads them from Triton's cache (a second of work), instead of
# compiling them again beside it (on an H200, five Profilers attached in a row, each compiling for 28 s beside
# the others, slowed the training thread's steps up to 11x)
_COMPILING: dict[tuple[str, tuple[str, ...], bool], threading.Lock] = {}
_COMPILING_LOCK = threading.Lock()

# The compiles beside the training still running end before the interpreter does. Left to run, a daemon thread
# inside Triton's C++ (a compile, a module load) that takes the interpreter lock back during finalisation is
# ended by pthread_exit, whose unwinding through C++ aborts the process ("terminate called without an active
# exception", exit status -6: a 3-step `precprof train` on an H200, gpu_validate 2026-12-04), and the other
# process would compile on for nobody. At exit: the other process is killed, a thread that has not begun its
# in-process compile skips it, and each thread is waited for (at most EXIT_WAIT_S; a compile from Triton's
# cache takes about a second)
EXIT_WAIT_S = 60.0
_BESIDE: set[threading.Thread] = set()
_BESIDE_LOCK = threading.Lock()
_EXITING = threading.Event()
_AT_EXIT: list[bool] = []  # [True] once ``_end_beside_at_exit`` is registered


def _start_beside(target: Any, *args: Any) -> threading.Thread:
    """Start a compile beside the training on a daemon thread that the interpreter's exit waits for."""
    thread = threading.Thread(target=target, args=args, name="precprof-triton-warm", daemon=True)
    with _BESIDE_LOCK:
        if not _AT_EXIT:
            atexit.register(_end_beside_at_exit)
            _AT_EXIT.append(True)
        _BESIDE.add(thread)
    thread.start()
    return thread


def _end_beside_at_exit(wait_s: float = EXIT_WAIT_S) -> int:
    """The interpreter's exit (``atexit``, after its other threads are joined and before it finalises): end the
    compiles beside the training; how many threads were still running."""
    _EXITING.set()
    triton_ahead.cancel_all()
    with _BESIDE_LOCK:
        threads = [t for t in _BESIDE if t.is_alive()]
    deadline = time.monotonic() + wait_s
    said = False
    for t in threads:
        t.join(min(1.0, max(0.0, deadline - time.monotonic())))
        if (
            t.is_alive() and not said
        ):  # inside a compile of its own: a wait the user should not mistake for a hang
            print(
                f"precprof: finishing its statistics kernels' compile before the exit (at most {wait_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            said = True
        t.join(max(0.0, deadline - time.monotonic()))
    return len(threads)


def _compile_lock(device: torch.device, dtypes: Sequence[torch.dtype], blocks: bool) -> threading.Lock:
    key = (str(device), tuple(str(d) for d in dtypes), blocks)
    with _COMPILING_LOCK:
        return _COMPILING.setdefault(key, threading.Lock())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def unreadable(x: torch.Tensor) -> str | None:
    """Why no engine reads ``x``'s values, in words; None when they can. A ``meta`` tensor has no data; a sparse
    one (``nn.Embedding(sparse=True)``'s gradient) holds its values apart from its zeros, and adding duplicate
    indices (``coalesce``) would synchronise with a GPU; a complex one (an SSM's parameters) has two floats a
    value, which the formats' what-if does not model; a wrapper subclass (torchao's NF4 weights) has no data
    pointer of its own (``data_ptr()`` is 0: a kernel reading it faulted); a ``torch.func`` transform's wrapper
    (the model run under ``grad`` or ``vmap``: per-sample gradients, a functional training loop) has none at
    all."""
    if x.device.type == "meta":
        return "on the meta device, which holds no data (a module not materialised, or offloaded without its values)"
    if x.is_nested:  # (``capture.records._readable`` reads its elements; this one's could not be gathered)
        return "a nested tensor whose elements precprof could not gather into one tensor"
    if x.layout is not torch.strided:
        layout = str(x.layout).removeprefix("torch.")
        why = " (summing its duplicates would sync a GPU)" if layout == "sparse_coo" else ""
        return f"a {layout} tensor, whose values precprof does not read{why}"
    if x.is_complex():
        return f"a complex tensor ({str(x.dtype).removeprefix('torch.')}): precprof reads real floating-point values"
    if type(x) not in _PLAIN and hasattr(x, "__tensor_flatten__"):
        return f"a {type(x).__name__}, a tensor subclass whose values are not in a storage of its own"
    if _compat.is_functorch_wrapped(x):
        return "a tensor inside a torch.func transform (grad, vmap, jacrev): a wrapper without a storage of its own"
    return None


class StatsBuffer:
    """Per-step statistics of ``rows`` tensor slots, on every device the tensors live on.

    Each tensor is read on its own device, by that device's engine (``precprof.stats.engine``), into that
    device's rows (:class:`DeviceRows`, made at the first tensor seen there); no engine ever receives another
    device's pointer. ``to_host``/``dense`` merge the devices' rows with :func:`~precprof.stats.layout.merge_rows`
    at the flush. A tensor no engine can read in place (``unreadable``: on the ``meta`` device, sparse, complex,
    a wrapper subclass) is skipped and counted in ``skipped``, and why in ``skipped_why``.

    ``device`` is where the rows are merged (the model's device); ``engine`` forces an engine (default:
    ``PRECPROF_STATS_ENGINE``, else "auto"); ``host_rows=False`` runs the device code path on the CPU (tests).
    ``background=True`` compiles the model device's Triton kernels on a thread beside the training (``ready``
    says when they are loaded; ``warm_s`` how long it took, ``warm_error`` what went wrong) instead of in the
    constructor: with an empty kernel cache that takes seconds (16 s on an H200), which no step should wait.
    """

    def __init__(
        self,
        rows: int,
        device: torch.device | str,
        chunk: int | None = None,
        *,
        host_rows: bool | None = None,
        engine: str | None = None,
        layout: RowLayout = LAYOUT,
        block_rows: Sequence[int] | None = None,
        dtypes: Sequence[torch.dtype] | None = None,
        background: bool = False,
    ) -> None:
        self.device = _compat.indexed_device(device)
        self._background = background
        self._warming: list[threading.Thread] = []
        self.warm_s: float | None = None
        self.warm_error: str | None = None
        self.ahead_error: str | None = None  # why the compile in another process failed, when it did
        # when each part of the compile beside the training began and ended (seconds from its start: "wait"
        # for another buffer's compile of the same kernels, "ahead" in another process, "compile", "load",
        # "check"), to tell which one a slow training step overlapped
        self.warm_phases: dict[str, tuple[float, float]] = {}
        self.warm_t0: float | None = None
        # the dtypes whose Triton kernels are compiled at attach (``_triton_warm``): the common three and any
        # others given (the model's parameters' dtypes)
        self.dtypes = tuple(
            dict.fromkeys([*triton_engine.DEFAULT_DTYPES, *(dtypes or ())])
        )  # "cuda" keys its rows as the tensors' "cuda:0"
        self.rows = rows
        # the rows that can hold block-format statistics (default: all), each with a slot of the accumulator
        self.block_rows = (
            np.arange(rows, dtype=np.int64)
            if block_rows is None
            else np.unique(np.asarray(block_rows, dtype=np.int64))
        )
        self._block_slot = np.full(rows, -1, dtype=np.int64)
        self._block_slot[self.block_rows] = np.arange(len(self.block_rows))
        self.chunk = chunk
        self.layout = layout
        self.requested = engine
        self._host_rows = host_rows
        self._parts: dict[torch.device, Rows] = {}
        self.skipped = np.zeros(rows, dtype=np.int64)  # unreadable tensors per row since the last reset
        self.skipped_total = np.zeros(rows, dtype=np.int64)  # over the whole run
        self.skipped_why: dict[int, str] = {}  # row -> why its last skipped tensor was (``unreadable``)
        # rows whose block-format statistics were evaluated since the last reset (host-side flags)
        self.blocks_seen = np.zeros(rows, dtype=bool)
        # time spent in the block-format what-if (capture's block budget reads it after each sampled step)
        self.block_timer = WorkTimer()
        if self.device.type != "meta":
            self._part(self.device)  # the model's device: its engine is chosen (and built) at attach

    def _part(self, device: torch.device) -> Rows:
        device = _compat.indexed_device(device)
        part = self._parts.get(device)
        if part is None:
            name = resolve_engine(self.requested, device)
            part = make_rows(
                self.rows,
                device,
                self.chunk,
                host_rows=self._host_rows,
                engine=name,
                layout=self.layout,
                block_slot=self._block_slot,
            )
            if name == "triton":
                assert isinstance(part, DeviceRows)
                if self._background and device == self.device:
                    triton_compile.preload_compiler()  # here, not on the compile's threads
                    ahead = device.type == "cuda"
                    self._warming.append(_start_beside(self._warm_beside, part, ahead))
                else:
                    self._triton_warm(part)
            self._parts[device] = part
        return part

    def _warm_beside(self, part: DeviceRows, ahead: bool) -> None:
        t0 = self.warm_t0 = time.perf_counter()
        try:
            self._triton_warm(part, workers=BESIDE_WORKERS, ahead=ahead)
        except Exception as e:  # the kernels then compile at their first launch; the run goes on
            self.warm_error = f"{type(e).__name__}: {e}"
        finally:
            with _BESIDE_LOCK:
                _BESIDE.discard(threading.current_thread())
        self.warm_s = time.perf_counter() - t0

    @property
    def ready(self) -> bool:
        """Whether every kernel compiled in the background is loaded (a tensor can be read without a compile)."""
        if not self._warming:
            return True
        if any(t.is_alive() for t in self._warming):
            return False
        self._warming.clear()
        return True

    def wait_ready(self) -> None:
        """Block until the background compile is done."""
        for t in self._warming:
            t.join()
        self._warming.clear()

    def rows_of(self, device: torch.device) -> Rows:
        """The rows of ``device`` (made, with its engine, at the first call): the hooks add into them directly."""
        return self._parts.get(device) or self._part(device)

    def _triton_warm(self, part: DeviceRows, workers: int | None = None, ahead: bool = False) -> None:
        """Compile, when the rows are made (the Profiler's attach), every Triton kernel variant a tensor of
        ``self.dtypes`` can launch (the row statistics; the block kernels when rows hold block statistics),
        so that nothing compiles inside a hook (an H100's first sampled step stalled 18.8 s compiling). Launches
        nothing, never syncs; Triton keeps the kernels in its on-disk cache for the next run. ``ahead``:
        another process compiles them first (``triton_ahead``: beside the training, threads would take the
        interpreter lock from it), and this one loads them from the cache; ``ahead_error`` says why not, when
        it could not."""
        assert part._triton is not None
        block_dtypes = [d for d in self.dtypes if d in _BLOCK_DTYPES] if len(self.block_rows) else []
        tasks = 6 * len(self.dtypes) + 2 * len(block_dtypes)  # (2 a dtype: the weight-update samples')
        tw = time.perf_counter()
        with _compile_lock(part.device, self.dtypes, bool(block_dtypes)):
            ta = time.perf_counter()
            if ahead:
                capability = torch.cuda.get_device_capability(part.device)
                spec = triton_ahead.spec_of(
                    part._triton, capability, self.dtypes, block_dtypes, _blocks.RECIPES
                )
                self.ahead_error = triton_ahead.compile_ahead(spec)
            if _EXITING.is_set():  # the process is exiting: nothing will launch these kernels
                raise RuntimeError(triton_ahead.CANCELLED)
            t0 = time.perf_counter()
            # the compiles run side by side, all done at the block's exit
            with triton_compile.parallel_compile(tasks, workers):
                kernels = part._triton.warm(self.dtypes, load=False)
                if block_dtypes and part._triton_blocks is not None:
                    kernels += part._triton_blocks.warm(block_dtypes, load=False)
                updates = triton_updates.warm(part.device, self.dtypes)  # (the weight-update samples')
            t1 = time.perf_counter()
        triton_launch.load_kernels(kernels)
        triton_updates.load(part.device, self.dtypes, updates)
        t2 = time.perf_counter()
        part._triton.adopt_compiled()  # the row kernels launched directly from now on
        if part._triton_blocks is not None:
            part._triton_blocks.adopt_compiled()  # ... and the block kernels
        t3 = time.perf_counter()
        start = self.warm_t0 if self.warm_t0 is not None else tw
        self.warm_phases = {
            name: (round(a - start, 3), round(b - start, 3))
            for name, a, b in (
                ("wait", tw, ta),
                *((("ahead", ta, t0),) if ahead else ()),
                ("compile", t0, t1),
                ("load", t1, t2),
                ("check", t2, t3),
            )
        }

    @property
    def primary(self) -> Rows | None:
        """The rows of the model's device (else the first device seen)."""
        return self._parts.get(self.device) or next(iter(self._parts.values()), None)

    @property
    def engines(self) -> dict[str, str]:
        """Which engine filled which device's rows."""
        return {str(d): p.engine for d, p in self._parts.items()}

    @property
    def launches(self) -> dict[str, str]:
        """How the Triton kernels are launched on each device that runs them (directly, or by Triton)."""
        return {
            str(d): p._triton.direct_status
            + (f"; block what-if: {p._triton_blocks.direct_status}" if p._triton_blocks is not None else "")
            + f"; weight-update samples: {triton_updates.status(d)}"
            for d, p in self._parts.items()
            if isinstance(p, DeviceRows) and p._triton is not None
        }

    # the primary rows' switches (tests compare engines through them)
    @property
    def use_kernel(self) -> bool:
        return bool(self.primary and self.primary.use_kernel)

    @use_kernel.setter
    def use_kernel(self, value: bool) -> None:
        for p in self._parts.values():
            p.use_kernel = value and p.engine == "c"

    @property
    def kernel_threads(self) -> int | None:
        return self.primary.kernel_threads if self.primary else None

    @kernel_threads.setter
    def kernel_threads(self, value: int | None) -> None:
        for p in self._parts.values():
            p.kernel_threads = value

    def _threads(self) -> int:
        return self.primary._threads() if self.primary else 1

    @property
    def on_cpu(self) -> bool:
        return bool(self.primary and self.primary.on_cpu)

    # -- sizes
    @property
    def buffer_bytes(self) -> int:
        return sum(p.buffer_bytes for p in self._parts.values())

    @property
    def scratch_bytes(self) -> int:
        return sum(p.scratch_bytes for p in self._parts.values())

    @property
    def data(self) -> torch.Tensor:
        return self.dense()

    def dense(self) -> torch.Tensor:
        """All devices' rows merged, as one [rows, width] int64 tensor on the model's device (syncs when
        the devices differ)."""
        parts = list(self._parts.values())
        primary = self.primary
        if primary is None:
            return self.layout.empty_rows(self.rows)
        out = primary.dense()
        for p in parts:
            if p is not primary:
                out = merge_rows(out, p.dense().to(out.device), self.layout)
        return out

    def to_host(self) -> np.ndarray:
        """All devices' rows merged, on the host: one copy per device, per sampled step."""
        out: np.ndarray | None = None
        for p in self._parts.values():
            rows = p.to_host()
            out = rows if out is None else merge_rows(out, rows, self.layout)
        return out if out is not None else self.layout.empty_rows(self.rows).numpy()

    def reset(self, rows: slice | None = None) -> None:
        """Zero the counts of all rows (or ``rows``) on every device; device ops, no sync."""
        for p in self._parts.values():
            p.reset(rows)
        self.skipped[rows if rows is not None else slice(None)] = 0
        self.blocks_seen[rows if rows is not None else slice(None)] = False

    def snapshot(self) -> tuple[Any, ...]:
        """Every device's rows and the skip counts as they are now, for :meth:`restore`: the point a sampled step's
        attempt that raised goes back to (``capture/attempts.py``). Device copies, no sync."""
        parts = {dev: p.snapshot() for dev, p in self._parts.items()}
        return parts, self.skipped.copy(), self.blocks_seen.copy()

    def restore(self, held: tuple[Any, ...] | None) -> None:
        """The rows as :meth:`snapshot` held them (None: as :meth:`reset` leaves them), the tensors skipped since
        taken out of the run's count too. Device copies, no sync."""
        parts, skipped, seen = held if held is not None else ({}, np.zeros_like(self.skipped), None)
        for dev, p in self._parts.items():
            if dev in parts:
                p.restore(parts[dev])
            else:  # (a device first seen since)
                p.reset()
        self.skipped_total -= self.skipped - skipped
        self.skipped[:] = skipped
        self.blocks_seen[:] = seen if seen is not None else False

    def blocks_dense(self) -> torch.Tensor:
        """All devices' block accumulators added, float64 [len(block_rows), 2, n_recipes, 5] on the model's
        device, one slot per row of ``block_rows`` (``expand_blocks`` puts them back in rows; syncs when the
        devices differ). Rows not in ``blocks_seen`` hold zeros."""
        primary = self.primary
        if primary is None:
            return torch.zeros(
                (len(self.block_rows), _blocks.N_ORIENTATIONS, _blocks.N_RECIPES, _blocks.N_STATS)
            )
        out = primary.blocks_dense()
        for p in self._parts.values():
            if p is not primary:
                out = out + p.blocks_dense().to(out.device)
        return out

    def blocks_to_host(self) -> np.ndarray:
        """All devices' block accumulators added, on the host (one copy per device), per row: float64 [rows, 2,
        n_recipes, 5], zeros in the rows without a slot."""
        out: np.ndarray | None = None
        for p in self._parts.values():
            b = p.blocks_dense().cpu().numpy()
            out = b if out is None else out + b
        return self.expand_blocks(out)

    def expand_blocks(self, slots: np.ndarray | None) -> np.ndarray:
        """The block accumulator's slots (``blocks_dense`` on the host, reduced over ranks, say) per row."""
        out = np.zeros((self.rows, _blocks.N_ORIENTATIONS, _blocks.N_RECIPES, _blocks.N_STATS))
        if slots is not None:
            out[self.block_rows] = slots
        return out

    def accumulate(self, x: torch.Tensor, row: int, *, assign: bool = False, blocks: bool = False) -> bool:
        """Add the statistics of ``x`` (any floating dtype, any shape, any device) into ``row``. Never syncs.

        ``assign=True`` first clears the row (used for accumulated weight gradients, whose last value wins).
        Each call is one tensor for the fp8 current-scaling counts (its own amax and scale). ``blocks=True``
        also adds the block-format what-if of ``x`` (``stats.blocks``; fp32, bf16 or fp16 with ndim >= 2 and
        data; others are not evaluated) and marks the row in ``blocks_seen``. Returns False when ``x`` was
        skipped (``unreadable``), True when it was read.
        """
        why = unreadable(x)
        if why is not None:
            self.skip(row, why)
            return False
        part = self._parts.get(x.device) or self._part(x.device)
        if assign:
            for p in self._parts.values():
                if p is not part:
                    p.reset(slice(row, row + 1))
        part.add(x, row, assign)
        if blocks:
            self.accumulate_blocks(x, row, read=True)
        return True

    def skip(self, row: int, why: str) -> None:
        """Count a tensor of ``row`` that was not read, and why (a reason of the caller's, not ``unreadable``)."""
        self.skipped[row] += 1
        self.skipped_total[row] += 1
        self.skipped_why[row] = why

    def accumulate_blocks(self, x: torch.Tensor, row: int, read: bool = False) -> None:
        """Add only the block-format what-if of ``x`` into ``row`` (a tensor whose other statistics were
        accumulated already, e.g. a module's output that a linear layer then reads). Never syncs; a tensor
        that is not fp32/bf16/fp16 with ndim >= 2 and data, or on ``meta``, is not evaluated. ``read``: the
        caller's engine just read ``x`` (``unreadable`` said None), not asked again (a hook's, per tensor).

        ``block_timer`` takes what the call costs: on a CUDA device the kernels' time, elsewhere the whole
        call's (its checks and lookups too: for small tensors they cost as much as the kernel)."""
        t0 = time.perf_counter()
        dev = x.device
        if not (x.dim() >= 2 and x.numel() > 0 and x.dtype in _BLOCK_DTYPES) or (not read and unreadable(x)):
            return
        if self._block_slot[row] < 0:  # a row without a slot holds no block statistics
            return
        part = self._parts.get(dev) or self._part(dev)
        if dev.type == "cuda":
            self.block_timer.call(dev, part.accumulate_blocks, x, row)
        else:
            part.accumulate_blocks(x, row)
            self.block_timer.add_host_s(time.perf_counter() - t0)
        self.blocks_seen[row] = True

    def accumulate_blocks_many(self, tensors: Sequence[torch.Tensor], rows: Sequence[int]) -> None:
        """:meth:`accumulate_blocks` of each tensor into its row, per device in one call of its rows (one C call
        for the CPU's: a sampled step's weights)."""
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[int]]] = {}
        slots = self._block_slot
        for x, row in zip(tensors, rows, strict=True):
            if slots[row] < 0 or x.dtype not in _BLOCK_DTYPES or x.dim() < 2 or unreadable(x) is not None:
                continue
            ts, rs = by_device.setdefault(x.device, ([], []))
            ts.append(x)
            rs.append(row)
        for dev, (ts, rs) in by_device.items():
            part = self._parts.get(dev) or self._part(dev)
            self.block_timer.call(dev, part.accumulate_blocks_many, ts, rs)
            self.blocks_seen[rs] = True

    def device_tensors(self) -> list[torch.Tensor]:
        """Each device's rows and block accumulator (``[rows, width]`` int64, ``[slots, 2, recipes, 5]``
        float64), on their devices, not copied: what a sampled step copies to the host together with the rest
        of its data (``stats.transfer.to_host``: one transfer per device). :meth:`from_host` merges the copies."""
        out: list[torch.Tensor] = []
        for p in self._parts.values():
            out += [p.dense(), p.blocks_dense()]
        return out

    def from_host(self, arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The merged rows (as :meth:`to_host`) and the block accumulator's slots (as :meth:`blocks_dense`, on the
        host; ``block_slot`` says each row's) from the host copies of :meth:`device_tensors`, in its order."""
        rows: np.ndarray | None = None
        blocks: np.ndarray | None = None
        for r, b in zip(arrays[0::2], arrays[1::2], strict=True):
            rows = r if rows is None else merge_rows(rows, r, self.layout)
            blocks = b if blocks is None else blocks + b
        if rows is None:
            rows = self.layout.empty_rows(self.rows).numpy()
        if blocks is None:
            blocks = np.zeros(
                (len(self.block_rows), _blocks.N_ORIENTATIONS, _blocks.N_RECIPES, _blocks.N_STATS)
            )
        return rows, blocks

    def host_windowed(self) -> tuple[np.ndarray, np.ndarray, int, torch.Tensor] | None:
        """Where the CPU's rows are all there is: their counts, their histogram window (as held: the caller
        copies what it keeps before the rows are reset) and the window's first bin (``HostRows.windowed``), and
        the block accumulator's slots (a tensor, for the step's one ``transfer.to_host``). A sampled step's copy
        then moves what the rows use, not a dense [rows, width] array built and copied again (0.8 ms of a
        sampled step of 800 small tensors). None where another device holds rows (``device_tensors``)."""
        if len(self._parts) != 1:
            return None
        (part,) = self._parts.values()
        windowed = getattr(part, "windowed", None)
        if windowed is None:
            return None
        counts, window, wlo = windowed()
        return counts, window, wlo, part.blocks_dense()

    @property
    def block_slot(self) -> np.ndarray:
        """Each row's slot of the block accumulator (-1: none)."""
        return self._block_slot


_BLOCK_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

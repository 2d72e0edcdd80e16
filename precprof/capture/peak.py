"""What was allocated at the peak of a sampled step, every byte in one part, and the peak of each phase.

A step's peak is a moment: the allocation that brought the allocator's count of allocated bytes to its highest
value. Which tensors were alive then decides what the peak is made of, and the moment falls between any two
hooks (inside the op that allocated it). So the peak is found from the allocator's own events, replayed on the
host after the step:

- **CUDA**: the caching allocator's history (``torch.cuda.memory._record_memory_history(context=None)``), on
  for the sampled step only and read with one ``torch.cuda.memory._snapshot()`` at its end. It records every
  block the allocator hands out or takes back (address, size) and every segment it reserves or releases, under
  the allocator's own lock; without stack traces (``context=None``) an entry costs tens of nanoseconds. Turning
  it on and off and reading it are host calls: nothing waits for the device. Phase boundaries are placed in
  the history by the allocator's cumulative counts of allocations and frees (``memory_stats()``, a host read)
  taken at each boundary. A program that records the history itself (``torch._C._cuda_isHistoryEnabled()``)
  is left alone: that step gets no peak rows, and the reason is kept.
- **CPU** (no caching allocator, no counters): torch.profiler's memory events, which report every allocation
  and free of the CPU allocator with its address (``profile_memory=True``, CPU activity only, no shapes or
  stacks); phase boundaries are zero-length ``record_function`` markers. Only one torch.profiler can run in a
  thread, so this source is off unless asked for (``MemoryTracker(peak=True)``, which the built-in loop does):
  a program that starts its own torch.profiler during a sampled step would get an error. On the CPU the step's
  peak counts the model's and optimizer's tensors alive when the step began plus everything the step
  allocated; memory the program held before the step for other purposes is not seen.

``replay`` then walks the events once to find each phase's peak and the moment of the step's peak, and once
more up to that moment for the blocks alive then. Each block is named by the tensors the tracker saw at the
address (``Label``), with the phase that saw it so that an address reused by another allocation is not
misnamed: a block alive at the peak is the tensor seen at its address only if it was allocated no later than
the end of the phase the tensor was seen in, and not freed between the peak and that end. Blocks the step
allocated that no label names are ``temporaries`` of the phase that allocated them (gradients of activations in
flight during backward, an op's workspace, the loss); blocks allocated before the step that no label names are
``other``.

Why not the alternatives: ``reset_peak_memory_stats`` at phase boundaries (what this replaced) resets the
process's own peak counters, so a program's ``max_memory_allocated()`` read 2.9 GB instead of 11.3 GB on an
H100; the counters cannot be set back, and ``memory_stats()`` deltas give no peak. Reading
``memory_allocated()`` at hook points misses what an op allocates between two hooks: exactly the temporaries
that make a peak. torch.profiler's ``MemoryProfile`` replays the same events on CUDA too, and found 99% of an
H100 peak, but named most of it "unknown" or "autograd detail"; its categories come from a data-flow graph
built from every op's inputs and outputs (shapes recorded: a costly profile), while the tracker already knows
which tensors are parameters, gradients, states and saved activations by their addresses. On CUDA the
allocator's history is cheaper than the profiler and cannot collide with a program's own torch.profiler.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from precprof import _compat
from precprof import tables as T

ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE = 0, 1, 2, 3

# Which name a block takes when several tensors seen at its address qualify (lower wins): a parameter that an
# optimizer also lists, a saved tensor that is also the model's output.
PRECEDENCE: dict[str, int] = {
    c: i
    for i, c in enumerate(
        (
            T.PARAMETERS,
            T.BUFFERS,
            T.MASTER_WEIGHTS,
            T.OPTIMIZER_STATES,
            T.GRADIENTS,
            T.PROFILER_BUFFERS,
            T.AUTOCAST_WEIGHT_COPIES,
            T.ACTIVATIONS,
            T.INPUTS,
            T.OUTPUTS,
        )
    )
}
_SAVED = frozenset({T.ACTIVATIONS, T.AUTOCAST_WEIGHT_COPIES})  # labels from the saved-tensor hooks
# CUDA: a step with more allocator events than this gets no peak rows (the history keeps only the newest)
MAX_HISTORY_ENTRIES = 2_000_000
_MARK = "precprof::phase"


@dataclass
class Events:
    """One sampled step's allocator events on one device, in the order they happened.

    ``kinds``/``ptrs``/``sizes`` are parallel lists (``ALLOC``, ``FREE``, ``SEGMENT_ALLOC``, ``SEGMENT_FREE``;
    block or segment address; bytes > 0). ``start``: address -> bytes of the blocks allocated when the step
    began (on the CPU: those of the tensors known to be alive then; a free of any other address is ignored).
    ``reserved_start``: bytes the allocator reserved when the step began, None where there is no cache.
    ``marks[i]``: the index of the first event after the i-th phase boundary.
    """

    kinds: list[int] = field(default_factory=list)
    ptrs: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    start: dict[int, int] = field(default_factory=dict)
    reserved_start: int | None = None
    marks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Label:
    """A tensor the tracker saw at an address: its component, module (activations), dtype, the index of the
    phase segment it was seen in (``END`` for what is read when the step has ended) and its storage's bytes."""

    component: str
    module: str
    dtype: str
    segment: int
    nbytes: int = 0


END = 1 << 30  # Label.segment of tensors read at the end of the step (parameters, states)


# ----------------------------------------------------------------------------------------------- sources
class CudaHistory:
    """The CUDA caching allocator's history of one device for one sampled step (host calls only, no sync).

    ``start()`` turns the history on (returns a reason instead when it cannot), ``mark()`` notes a phase
    boundary, ``stop()`` reads the history, turns it off and returns the ``Events``; ``abort()`` turns it off.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._on = False
        self._counts: list[tuple[int, int]] = []  # cumulative (allocations, frees) at start and each mark

    def _counters(self) -> tuple[int, int]:
        stats = _compat.cuda_memory_counters(self.index)
        return stats.get("allocation.all.allocated", 0), stats.get("allocation.all.freed", 0)

    def start(self) -> str | None:
        if _compat.cuda_history_enabled():
            return "the program records the CUDA allocator's history itself; precprof leaves it alone"
        _compat.cuda_record_history(True, MAX_HISTORY_ENTRIES)
        self._on = True
        self._counts = [self._counters()]
        return None

    def mark(self) -> None:
        if self._on:
            self._counts.append(self._counters())

    def abort(self) -> None:
        if self._on:
            self._on = False
            _compat.cuda_record_history(False, MAX_HISTORY_ENTRIES)

    def stop(self) -> tuple[Events | None, str]:
        if not self._on:
            return None, ""
        # the snapshot is a dict per event, made, read and let go here: the collector waits (_compat.gc_paused)
        # until every one of them is gone
        with _compat.gc_paused():
            try:
                snap = _compat.cuda_snapshot()
            finally:
                self.abort()
            out = self._events(snap)
            del snap
        return out

    def _events(self, snap: dict[str, Any]) -> tuple[Events | None, str]:
        """The step's ``Events`` from the allocator's snapshot at its end."""
        traces = snap.get("device_traces") or []
        trace = traces[self.index] if self.index < len(traces) else []
        if len(trace) >= MAX_HISTORY_ENTRIES:
            return None, f"more than {MAX_HISTORY_ENTRIES} allocator events in the step"
        ev = Events()
        kinds, ptrs, sizes = ev.kinds, ev.ptrs, ev.sizes
        action_of = _CUDA_ACTIONS.get
        for e in trace:
            kind = action_of(e.get("action"))
            if kind is not None:
                kinds.append(kind)
                ptrs.append(int(e.get("addr", 0)))
                size = int(e.get("size", 0))
                sizes.append(size if kind >= SEGMENT_ALLOC else block_bytes(size))
        # the blocks and segments held now, walked back through the history: those held when the step began
        live: dict[int, int] = {}
        reserved = 0
        for seg in snap.get("segments") or []:
            if int(seg.get("device", self.index)) != self.index:
                continue
            reserved += int(seg.get("total_size", 0))
            for b in seg.get("blocks") or []:
                if b.get("state") == "active_allocated":
                    live[int(b["address"])] = int(b["size"])
        for kind, ptr, size in zip(reversed(kinds), reversed(ptrs), reversed(sizes), strict=True):
            if kind == ALLOC:
                live.pop(ptr, None)
            elif kind == FREE:
                live[ptr] = size
            elif kind == SEGMENT_ALLOC:
                reserved -= size
            else:
                reserved += size
        ev.start, ev.reserved_start = live, max(reserved, 0)
        ev.marks = _marks_from_counts(ev.kinds, self._counts)
        return ev, ""


def block_bytes(requested: int) -> int:
    """The bytes the CUDA caching allocator counts (``allocated_bytes``) for a request of ``requested`` bytes:
    its history records the size asked for, its counters the block's, rounded up to a multiple of 512 (at
    least 512). A cached block it hands out without splitting may hold up to 1 MiB more (a large block whose
    remainder would be under 1 MiB); the history cannot show that, so a replayed peak can be below the
    counter by that much per such block, never above it."""
    return max(512, -(-requested // 512) * 512)


_CUDA_ACTIONS = {
    "alloc": ALLOC,
    "free_requested": FREE,  # allocated_bytes drops here; free_completed follows when the streams are done
    "free": FREE,  # older torch
    "segment_alloc": SEGMENT_ALLOC,
    "segment_map": SEGMENT_ALLOC,  # expandable segments
    "segment_free": SEGMENT_FREE,
    "segment_unmap": SEGMENT_FREE,
}


def _marks_from_counts(kinds: list[int], counts: list[tuple[int, int]]) -> list[int]:
    """Event index of each phase boundary, from the cumulative (allocations, frees) read there."""
    if not counts:
        return []
    a0, f0 = counts[0]
    marks = []
    i = n_alloc = n_free = 0
    for a, f in counts[1:]:
        while i < len(kinds) and (n_alloc < a - a0 or n_free < f - f0):
            n_alloc += kinds[i] == ALLOC
            n_free += kinds[i] == FREE
            i += 1
        marks.append(i)
    return marks


# why a step has no peak on the CPU, when the program profiled it itself
TAKEN_OVER = "a torch.profiler of the program's started during the step; precprof left its session to it"


class ProfilerMemory:
    """torch.profiler's memory events of the CPU allocator for one sampled step (CPU activity only).

    Same interface as ``CudaHistory``. ``start`` takes the addresses and sizes of the storages known to be
    allocated when the step begins (the CPU allocator keeps no count of them).
    """

    def __init__(self) -> None:
        self._on = False
        self._start: dict[int, int] = {}
        self._stopped: tuple[list[tuple[int, int, int, str]], list[int]] | None = None
        self._why = ""  # why the step has no events ("": it has them, or none was asked for)

    def start(self, known: dict[int, int] | None = None) -> str | None:
        if _compat.profiler_running() or _compat.program_profiler_running():
            return "a torch.profiler is running; the peak needs one of its own"
        try:
            _compat.profiler_memory_start()
        except RuntimeError as e:  # another profiler took the thread in between, or no Kineto
            return f"torch.profiler could not start ({e})"
        self._on = True
        self._start = dict(known or {})
        self._stopped, self._why = None, ""
        return None

    def mark(self) -> None:
        if self._on:
            with torch.profiler.record_function(_MARK):
                pass

    def abort(self) -> None:
        if self._on:
            self._on = False
            if _compat.program_profiler_running() or not _compat.profiler_running():
                # the program started a torch.profiler of its own during the step, in this session: left to it
                # (stopping it ended the program's profiler, whose events came back empty)
                self._stopped, self._why = None, TAKEN_OVER
                return
            try:
                self._stopped = _compat.profiler_memory_stop(_MARK)
            except RuntimeError:
                self._stopped = None

    def stop(self) -> tuple[Events | None, str]:
        # the profiler's events, a tuple each, made and let go here: the collector waits (as in CudaHistory)
        with _compat.gc_paused():
            self.abort()
            got, self._stopped = self._stopped, None
            if got is None:
                return None, self._why
            allocs = sorted((a for a in got[0] if a[3] == "cpu"), key=lambda a: a[0])
            ev = Events(start=self._start)
            for _, ptr, size, _dev in allocs:
                ev.kinds.append(ALLOC if size > 0 else FREE)
                ev.ptrs.append(ptr)
                ev.sizes.append(abs(size))
            times = [a[0] for a in allocs]
            ev.marks = [bisect.bisect_right(times, t) for t in sorted(got[1])]
            del got, allocs, times
        return ev, ""


# -------------------------------------------------------------------------------------------- recorder
class PeakRecorder:
    """The memory tracker's peak: one source of allocator events, the phase segments of the step, and the
    tensors seen at each address. ``begin`` (sampled steps), ``phase`` at each boundary, ``label`` from hooks,
    ``stop`` when the step ends (or the tracker detaches), then ``finish`` replays. Host only; without a
    source every call does nothing."""

    def __init__(self, source: CudaHistory | ProfilerMemory | None) -> None:
        self.source = source
        self.measuring = False
        self.note = ""  # why the last sampled step has no peak ("" when it has one)
        self.segments: list[str] = [T.PHASE_OTHER]
        self.labels: dict[int, list[Label]] = {}
        self.backward_ran: set[int] = set()  # segments in which autograd read saved tensors back
        self._stopped: tuple[Events | None, str] | None = None

    def begin(self, known: Callable[[], dict[int, Label]]) -> None:
        """Start reading the events of a sampled step (``known``: the storages alive now, for the CPU)."""
        self.abort()
        self.segments, self.labels, self.backward_ran, self._stopped = [T.PHASE_OTHER], {}, set(), None
        if self.source is None:
            return
        try:
            if isinstance(self.source, ProfilerMemory):
                reason = self.source.start({k: lab.nbytes for k, lab in known().items()})
            else:
                reason = self.source.start()
        except Exception as e:  # the peak is optional: never let it end training
            self.source.abort()
            reason = f"{type(e).__name__}: {e}"
        self.measuring = reason is None
        self.note = reason or ""

    def phase(self, name: str) -> None:
        """A phase boundary: a new segment, placed in the events."""
        if name != self.segments[-1]:
            self.segments.append(name)
            if self.measuring and self.source is not None:
                self.source.mark()

    def label(self, key: int, component: str, module: str, dtype: str, nbytes: int) -> None:
        """The storage at ``key`` holds ``component`` now."""
        if self.measuring:
            self.labels.setdefault(key, []).append(
                Label(component, module, dtype, len(self.segments) - 1, nbytes)
            )

    def unpacked(self) -> None:
        """Autograd read a saved tensor back: backward runs in the current segment."""
        if self.measuring:
            self.backward_ran.add(len(self.segments) - 1)

    def stop(self) -> None:
        """Stop reading events (once); ``finish`` replays them."""
        if self._stopped is None and self.measuring and self.source is not None:
            self.measuring = False
            try:
                self._stopped = self.source.stop()
            except Exception as e:  # the peak is optional: never let it end training
                self.source.abort()
                self._stopped = (None, f"{type(e).__name__}: {e}")

    def abort(self) -> None:
        if self.measuring and self.source is not None:
            self.source.abort()
        self.measuring = False

    def finish(self, persistent: Callable[[], dict[int, Label]]) -> Peak | None:
        """Replay the step's events (``persistent``: the storages alive now, read at the end). None without
        events; ``note`` says why."""
        self.stop()
        events, note = self._stopped if self._stopped is not None else (None, self.note)
        self.note = note
        peak = None
        if events is not None:
            end = persistent()
            peak = replay(
                events,
                self.segments,
                lambda k: self.labels.get(k, []) + ([end[k]] if k in end else []),
                self.backward_ran,
            )
        self.labels, self._stopped = {}, None
        return peak


# ------------------------------------------------------------------------------------------------ replay
@dataclass
class Peak:
    """What ``replay`` found. ``phase_peaks``: phase -> (highest allocated, highest reserved or None) over the
    phase's segments; ``phase``: the phase of the step's peak; ``parts``: (component, module, dtype) -> bytes at
    that moment (``allocator_cache`` included where there is a cache), adding up to ``allocated`` (+ cache)."""

    phase_peaks: dict[str, tuple[int, int | None]]
    phase: str
    allocated: int
    reserved: int | None
    parts: dict[tuple[str, str, str], int]


def replay(
    ev: Events,
    segments: list[str],
    labels: Callable[[int], list[Label]],
    backward_ran: frozenset[int] | set[int] = frozenset(),
) -> Peak:
    """Replay ``ev`` (phase of each segment in ``segments``: one more than ``ev.marks``) and name the blocks
    alive at the step's peak with ``labels(address)``. ``backward_ran``: the segments in which autograd read
    saved tensors back; a tensor saved for backward is an activation until the end of the first such segment
    after it was saved (later the graph has let it go, and whatever still holds it names it). Pure host
    computation, linear in the events."""
    n = len(ev.kinds)
    # event index where each segment ends (exclusive), non-decreasing
    bounds = [min(max(m, 0), n) for m in ev.marks[: len(segments) - 1]]
    bounds += [n] * (len(segments) - len(bounds))
    for s in range(1, len(bounds)):
        bounds[s] = max(bounds[s], bounds[s - 1])

    def segment_of(i: int) -> int:  # the segment event i happened in (-1: before the step)
        return -1 if i < 0 else bisect.bisect_right(bounds, i)

    live = dict(ev.start)
    total = sum(live.values())
    reserved = ev.reserved_start
    seg_alloc = [0] * len(segments)
    seg_res: list[int | None] = [None] * len(segments)
    best, best_i = total, -1
    i = 0
    for s, end in enumerate(bounds):
        hi, hi_res = total, reserved
        while i < end:
            kind, ptr, size = ev.kinds[i], ev.ptrs[i], ev.sizes[i]
            if kind == ALLOC:
                total += size - live.get(ptr, 0)
                live[ptr] = size
                if total > hi:
                    hi = total
                    if total > best and segments[s] != T.PHASE_OUTSIDE:  # (an evaluation's: not the step's)
                        best, best_i = total, i
            elif kind == FREE:
                total -= live.pop(ptr, 0)  # a block from before the step that the source did not know of: 0
            elif reserved is not None:
                reserved += size if kind == SEGMENT_ALLOC else -size
                if hi_res is None or reserved > hi_res:
                    hi_res = reserved
            i += 1
        seg_alloc[s], seg_res[s] = hi, hi_res

    # second pass: the blocks alive at the peak (address -> (bytes, index of the event that allocated them)),
    # then the first free of each after it
    alive: dict[int, tuple[int, int]] = {p: (b, -1) for p, b in ev.start.items()}
    res_at = ev.reserved_start
    for i in range(best_i + 1):
        kind, ptr, size = ev.kinds[i], ev.ptrs[i], ev.sizes[i]
        if kind == ALLOC:
            alive[ptr] = (size, i)
        elif kind == FREE:
            alive.pop(ptr, None)
        elif res_at is not None:
            res_at += size if kind == SEGMENT_ALLOC else -size
    freed_after: dict[int, int] = {}
    for i in range(best_i + 1, n):
        if ev.kinds[i] == FREE and ev.ptrs[i] in alive and ev.ptrs[i] not in freed_after:
            freed_after[ev.ptrs[i]] = i

    parts: dict[tuple[str, str, str], int] = {}

    def add(key: tuple[str, str, str], b: int) -> None:
        parts[key] = parts.get(key, 0) + b

    peak_seg = max(segment_of(best_i), 0)
    ran = sorted(backward_ran)

    def released(seg: int) -> int:  # the segment after which what ``seg`` saved is no longer the graph's
        i = bisect.bisect_right(ran, seg)
        return ran[i] if i < len(ran) else END

    for ptr, (size, at) in alive.items():
        cands = [
            lab for lab in labels(ptr) if lab.component not in _SAVED or peak_seg <= released(lab.segment)
        ]
        label = _pick(cands, at, freed_after.get(ptr), bounds)
        if label is not None:
            add((label.component, label.module, label.dtype), size)
        elif at < 0:
            add((T.OTHER_MEMORY, "", ""), size)
        else:
            add((T.TEMPORARIES, segments[segment_of(at)], ""), size)
    if res_at is not None:
        add((T.ALLOCATOR_CACHE, "", ""), max(res_at - best, 0))

    phase_peaks: dict[str, tuple[int, int | None]] = {}
    for s, name in enumerate(segments):
        a, r = phase_peaks.get(name, (0, None))
        rs = seg_res[s]
        phase_peaks[name] = (max(a, seg_alloc[s]), r if rs is None else max(r or 0, rs))
    return Peak(
        phase_peaks=phase_peaks,
        phase=segments[peak_seg],
        allocated=best,
        reserved=res_at,
        parts=parts,
    )


def _pick(candidates: list[Label], at: int, freed: int | None, bounds: list[int]) -> Label | None:
    """The label of the block allocated at event ``at`` (-1: before the step) and freed at ``freed`` (None: not
    after the peak): the highest-precedence tensor seen at its address while this block held it."""
    best: Label | None = None
    for lab in candidates:
        end = bounds[lab.segment] if 0 <= lab.segment < len(bounds) else END  # exclusive
        if at >= end or (freed is not None and freed < end):
            continue  # seen at the address before this block was allocated there, or after it was freed
        if best is None or PRECEDENCE.get(lab.component, 99) < PRECEDENCE.get(best.component, 99):
            best = lab
    return best

"""A sampled step's data brought to the host, and the rows made of it: the Profiler's one synchronisation.

``Collector.copy`` takes the pending steps' scalars (loss, loss scale, found-inf, gradient norm) and, after a
sampled step, its statistics (every device's rows and block accumulator, the weight-update counts; reduced over
ranks first under torch.distributed), copies them in one transfer per device (``stats.transfer.to_host``), and
hands the steps, layer, histogram and memory rows to the recording (``capture/recorded.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from precprof import flush
from precprof import stats as st
from precprof import tables as T
from precprof.capture import update_sizes
from precprof.capture.plan import CapturePlan
from precprof.capture.recorded import Recorded
from precprof.capture.records import _PendingStep, name_bit
from precprof.capture.updates import UpdateSampler
from precprof.stats import transfer


class Collector:
    """The host side of the sampled steps of one attachment (see the module docstring)."""

    def __init__(
        self,
        plan: CapturePlan,
        buffer: st.StatsBuffer,
        updates: UpdateSampler | None,
        reducer: Any,
        tracker: Any,
        own_bytes: Any,
    ) -> None:
        self.plan = plan
        self.buffer = buffer
        self.updates = updates
        self.reducer = reducer
        self.tracker = tracker
        self._own_bytes = own_bytes  # () -> bytes precprof holds on the device (buffers and scratch)
        self.memory_error: str | None = None

    def copy(self, recorded: Recorded, pending: list[_PendingStep], layers: bool, step: int) -> None:
        """The sync: ``pending``'s scalars and, with ``layers`` (a sampled step just ended), its statistics
        and memory rows, into ``recorded``."""
        floats = Recorded.step_floats(pending)
        tensors = [floats.device] if floats.device is not None else []
        order = self.plan.order()
        n_stats = 0
        windowed = None
        # the memory rows first: the tracker reads the host's allocator and its record of the step, none of
        # which waits for the device, so that this host work runs while the device still runs the step's
        # queued kernels rather than after the sync, with the device idle (20 ms of a gpt2-small step that
        # measures memory on an H200)
        memory = self._end_memory(step) if layers else None
        if layers:
            if self.reducer is not None:
                order, stats_part, counts_part = self._reduce_sampled(step, order)
            else:
                windowed = self.buffer.host_windowed()  # the CPU's rows alone: copied as they are held
                stats_part = self.buffer.device_tensors() if windowed is None else [windowed[3]]
                counts_part = self.updates.device_counts() if self.updates else []
            n_stats = len(stats_part)
            tensors += stats_part + counts_part
        host = transfer.to_host(tensors)  # the sync
        step_scale = recorded.add_steps(
            pending, floats.values(host.pop(0) if floats.device is not None else None)
        )
        if not layers:
            return
        self._collect_layers(recorded, step, step_scale, order, host[:n_stats], host[n_stats:], windowed)
        self._collect_memory(recorded, step, memory)

    def _reduce_sampled(
        self, step: int, order: dict[str, int]
    ) -> tuple[dict[str, int], list[torch.Tensor], list[torch.Tensor]]:
        """Under a process group: the rows, block sums and update counts reduced over ranks (collectives:
        every rank reaches this on the same sampled step), with the rows' host metadata and the order."""
        reducer, rows = self.reducer, self.plan.rows
        device_rows = reducer.reduce_rows(self.buffer.dense())
        block_sums = reducer.reduce_sum(self.buffer.blocks_dense())  # counts and sums add
        skipped, why = self.buffer.skipped, self.buffer.skipped_why
        meta = reducer.reduce_meta(
            [
                {
                    "calls": rows.calls[r.index],
                    "dtypes": rows.dtypes(r.index),
                    "numel_gcd": rows.numel_gcd[r.index],
                    "module": r.module,
                    "tensor": r.tensor,
                    "param": r.param,
                    # tensors skipped this step (unreadable, or unscaled before read): counted over every rank,
                    # as a rank may hold a shard no other holds (FSDP1 under a loss scaler)
                    **(
                        {"skipped": int(skipped[r.index]), "why": why.get(r.index, "")}
                        if skipped[r.index]
                        else {}
                    ),
                }
                for r in rows.info
            ],
            order,
            step=step,
        )
        for r, m in zip(rows.info, meta["rows"], strict=True):
            if m.get("skipped", 0) > skipped[r.index]:  # others' skips: the run's total, and why
                self.buffer.skipped_total[r.index] += int(m["skipped"]) - int(skipped[r.index])
                why.setdefault(r.index, str(m.get("why") or "not readable"))
            rows.calls[r.index] = int(m["calls"])
            rows.numel_gcd[r.index] = int(m.get("numel_gcd", 0))
            bits = 0
            for name in m["dtypes"]:
                bits |= name_bit(name)
            rows.dtype_bits[r.index] = bits
        counts = []
        if self.updates is not None:
            update_counts, sizes = self.updates.combined()
            sums, extremes = update_sizes.for_ranks(sizes)
            counts = [
                reducer.reduce_sum(update_counts),
                reducer.reduce_sum(sums),
                reducer.reduce_max(extremes),
            ]
        return meta["order"], [device_rows, block_sums], counts

    def _collect_layers(
        self,
        recorded: Recorded,
        step: int,
        scale: float,
        order: dict[str, int],
        stats_host: list[np.ndarray],
        counts_host: list[np.ndarray],
        windowed: tuple[np.ndarray, np.ndarray, int, torch.Tensor] | None = None,
    ) -> None:
        """Layer, histogram and weight-update rows of a sampled step from the host copies of its tensors (the
        CPU's rows as they are held: ``windowed``, from ``StatsBuffer.host_windowed``)."""
        buffer, rows = self.buffer, self.plan.rows
        counts: tuple[np.ndarray, np.ndarray] | None = None
        if windowed is not None:
            held = flush.HeldRows(*windowed[:3], stats_host[0])
        else:
            data, slots = (
                (stats_host[0], stats_host[1]) if self.reducer is not None else buffer.from_host(stats_host)
            )
            held = flush.HeldRows(data[:, : st.COL_HIST], data[:, st.COL_HIST :], 0, slots)
        if self.reducer is not None:
            if counts_host:
                counts = (counts_host[0], update_sizes.from_ranks(*counts_host[1:]))
        elif self.updates is not None:
            counts = self.updates.host_counts(counts_host)
        active = np.flatnonzero(np.asarray(rows.calls, dtype=np.int64) > 0)
        if len(active):
            seen, slot_of = buffer.blocks_seen, buffer.block_slot
            recorded.add_layers(step, flush.StepRows(step, rows, active, held, scale, order, slot_of, seen))
        if self.updates is not None and counts is not None:
            updates = self.updates.columns(*counts, step, order, self.plan.module_types())
            if updates is not None:
                recorded.add_layers(step, updates)

    def _end_memory(self, step: int) -> list[dict[str, Any]] | None:
        """The tracker's rows of the sampled step that just ended (None without a tracker)."""
        if self.tracker is None:
            return None
        try:
            mem: list[dict[str, Any]] = self.tracker.end_step(step)
        except Exception as e:  # memory accounting must never take training down
            mem = []
            self.memory_error = f"{type(e).__name__}: {e}"
        self.memory_error = getattr(self.tracker, "arm_error", None) or self.memory_error
        return mem

    def _collect_memory(self, recorded: Recorded, step: int, mem: list[dict[str, Any]] | None) -> None:
        if (
            self.tracker is None
        ):  # Profiler(memory=False): no memory table, not one of precprof's buffers alone
            return
        if mem is not None:
            if self.reducer is not None and hasattr(self.reducer, "reduce_memory"):
                mem = self.reducer.reduce_memory(mem)  # collective: every rank, every sampled step
            recorded.add_memory(mem)
            if not getattr(getattr(self.tracker, "schedule", None), "measuring", True):
                return  # a sampled step that does not measure memory: no memory rows at all
        recorded.add_memory(
            [
                {
                    T.STEP: step,
                    T.COMPONENT: T.PROFILER_BUFFERS,
                    T.MODULE: "",
                    T.DTYPE: "int64",
                    T.BYTES: self._own_bytes(),
                    T.PHASE: "",  # held through the whole step, as the other components' own sizes
                    T.MOMENT: "",
                }
            ]
        )

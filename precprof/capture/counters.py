"""The CUDA allocator's counters around a sampled step's phases, and NVML's view of the device: what the memory
tracker reports where a step has no replay of the allocator's events (``capture/memory_tracker.py``).

``torch.cuda.max_memory_allocated`` only grows, so when it grew during a phase its new value is that phase's
exact peak (``allocator_peak``); when it did not, the most memory allocated that the hooks saw in the phase is
a lower bound of its peak (``allocator_seen_max``). The process's peak counters belong to the program (its own
logs, Lightning's, the Trainer's): they are reset only with ``reset_peaks`` (the built-in loop, which owns
the process). Every read is a host call, no device sync."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from precprof import _compat
from precprof import tables as T


class PhaseCounters:
    """Phase peaks from the allocator's counters of ``cuda`` (None: nothing to read, every call returns at
    once), and NVML's used/total memory of that device."""

    def __init__(self, cuda: torch.device | None, reset_peaks: bool) -> None:
        self.cuda = cuda
        self.reset_peaks = reset_peaks
        self.phase = T.PHASE_OTHER
        self.peaks: dict[tuple[str, str], int] = {}  # (component, phase) -> bytes
        self._seen_max = (0, 0)  # the process's max allocated / reserved when the current phase began
        self._phase_live = (0, 0)  # the most allocated / reserved read at the hooks in the current phase
        self._nvml: Any = None  # pynvml handle, or False once NVML turned out unavailable

    def _counters(self) -> dict[str, int]:
        assert self.cuda is not None
        index = self.cuda.index if self.cuda.index is not None else torch.cuda.current_device()
        return _compat.cuda_memory_counters(index)

    def _max(self) -> tuple[int, int]:
        c = self._counters()
        return c.get("allocated_bytes.all.peak", 0), c.get("reserved_bytes.all.peak", 0)

    def _live(self) -> tuple[int, int]:
        c = self._counters()
        return c.get("allocated_bytes.all.current", 0), c.get("reserved_bytes.all.current", 0)

    def begin(self) -> None:
        """A sampled step begins (phase "other")."""
        self.phase, self.peaks = T.PHASE_OTHER, {}
        if self.cuda is not None:
            if self.reset_peaks:
                torch.cuda.reset_peak_memory_stats(self.cuda)
            self._seen_max = self._max()
            self._phase_live = self._live()

    def sample_live(self) -> None:
        """Note the memory allocated now (a hook point of a sampled step): the lower bound of the phase's peak
        when the process's peak did not grow in it."""
        if self.cuda is not None:
            live = self._live()
            self._phase_live = (max(self._phase_live[0], live[0]), max(self._phase_live[1], live[1]))

    def mark(self, new_phase: str) -> None:
        """A phase boundary: the ending phase's counter peaks."""
        if self.cuda is not None:
            c = self._counters()  # one read of the allocator's statistics (a dict of ~100 entries)
            maxima = c.get("allocated_bytes.all.peak", 0), c.get("reserved_bytes.all.peak", 0)
            live = c.get("allocated_bytes.all.current", 0), c.get("reserved_bytes.all.current", 0)
            self._phase_live = (max(self._phase_live[0], live[0]), max(self._phase_live[1], live[1]))
            for i, (comp, value) in enumerate(
                zip((T.ALLOCATOR_PEAK, T.ALLOCATOR_RESERVED_PEAK), maxima, strict=True)
            ):
                if self.reset_peaks or value > self._seen_max[i]:
                    key = (comp, self.phase)  # the counter grew in this phase: its value is the phase's peak
                    self.peaks[key] = max(self.peaks.get(key, 0), value)
                elif i == 0:  # a lower bound: what the hooks saw
                    key = (T.ALLOCATOR_SEEN_MAX, self.phase)
                    self.peaks[key] = max(self.peaks.get(key, 0), self._phase_live[0])
            if self.reset_peaks:
                torch.cuda.reset_peak_memory_stats(self.cuda)
                self._seen_max = self._max()
                self._phase_live = self._live()
            else:  # nothing changed since the read above
                self._seen_max, self._phase_live = maxima, live
        self.phase = new_phase

    def relabel(self, name: str) -> None:
        """The sampled step's time so far was not its own (an evaluation before its training): the phase peaks
        noted in it, and the phase running now, become ``name``'s."""
        peaks: dict[tuple[str, str], int] = {}
        for (comp, _), b in self.peaks.items():
            peaks[(comp, name)] = max(peaks.get((comp, name), 0), b)
        self.peaks, self.phase = peaks, name

    def device_memory(self) -> dict[str, int]:
        """NVML used/total of the device; {} on CPU or without a driver (a driver query, no sync)."""
        if self.cuda is None or self._nvml is False:
            return {}
        try:
            import pynvml

            if self._nvml is None:
                pynvml.nvmlInit()
                index = self.cuda.index if self.cuda.index is not None else torch.cuda.current_device()
                # NVML numbers GPUs physically; CUDA_VISIBLE_DEVICES renumbers them for torch.
                to_nvml = getattr(torch.cuda, "_get_nvml_device_index", None)
                nvml_index = to_nvml(index) if to_nvml is not None else index
                self._nvml = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
            info = pynvml.nvmlDeviceGetMemoryInfo(self._nvml)
            return {T.DEVICE_USED: int(info.used), T.DEVICE_TOTAL: int(info.total)}
        except Exception:  # no nvidia-ml-py, no driver, NVML error: the rows are simply absent
            self._nvml = False
            return {}

    def close(self) -> None:
        if self._nvml not in (None, False):
            with contextlib.suppress(Exception):
                import pynvml

                pynvml.nvmlShutdown()
        self._nvml = None

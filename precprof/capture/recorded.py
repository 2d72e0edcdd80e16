"""What the Profiler has copied to the host: the step rows, and per sampled step the layer, histogram and memory
rows, kept as columns (arrays and lists) and joined into the four tables only when they are read."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from precprof import tables as T
from precprof.capture.records import HostFloats, _join_columns, _PendingStep


class Recorded:
    """The host side of a recording: it receives host copies (the Profiler makes the one transfer of a
    sampled step) and touches no device."""

    def __init__(self) -> None:
        self.layer_parts: list[dict[str, Any]] = []
        self.hist_parts: list[dict[str, Any]] = []
        self.step_rows: list[dict[str, Any]] = []
        self.memory_rows: list[dict[str, Any]] = []
        self.sampled_steps: set[int] = set()

    @staticmethod
    def step_floats(pending: list[_PendingStep]) -> HostFloats:
        """The pending steps' loss, scale, found-inf and grad norm, stacked on the device for the copy."""
        return HostFloats([v for p in pending for v in (p.loss, p.scale, p.found_inf, p.grad_norm)])

    def add_steps(self, pending: list[_PendingStep], values: list[float]) -> float:
        """Steps table rows for ``pending``, ``values`` being :meth:`step_floats`'s on the host. Returns the
        loss scale of the last one (1.0 when there is none)."""
        if not pending:
            return 1.0
        for i, p in enumerate(pending):
            loss, scale, found, grad_norm = values[4 * i : 4 * i + 4]
            found = 0.0 if p.found_inf is None else found
            self.step_rows.append(
                {
                    T.STEP: p.step,
                    T.LOSS: loss,
                    T.LOSS_SCALE: scale,
                    T.SKIPPED: bool(found > 0 or math.isnan(found)),
                    T.GRAD_NORM: grad_norm,
                    T.TIME_S: p.time_s,
                    T.SAMPLED: p.sampled,
                    T.TOKENS: float(p.tokens) if p.tokens is not None else math.nan,
                }
            )
        return values[-3]

    def add_layers(self, step: int, cols: dict[str, Any], hist: dict[str, Any] | None = None) -> None:
        """Layer rows of a sampled step (columns), and their histogram rows."""
        self.layer_parts.append(cols)
        self.sampled_steps.add(step)
        if hist is not None:
            self.hist_parts.append(hist)

    def add_memory(self, rows: list[dict[str, Any]]) -> None:
        self.memory_rows.extend(rows)

    def tables(self) -> dict[str, pd.DataFrame]:
        """The four tables (see precprof/tables.py for the schema)."""
        hist = _join_columns(self.hist_parts) if self.hist_parts else T.empty("histograms")
        return {
            "layers": T.frame("layers", _join_columns(self.layer_parts))
            if self.layer_parts
            else T.empty("layers"),
            "histograms": T.frame("histograms", hist),
            "steps": T.frame("steps", self.step_rows) if self.step_rows else T.empty("steps"),
            "memory": T.frame("memory", self.memory_rows) if self.memory_rows else T.empty("memory"),
        }

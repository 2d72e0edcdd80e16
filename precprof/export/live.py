"""The live writer the Profiler calls after each flush: the rows copied to the host since its last call, as
dashboard events, into every sink.

It is handed each flush's new rows (``precprof.flush.Flush``: ``step_rows``, ``layer_parts``,
``hist_parts``), so each row is written once. It never touches
a device: it runs after the Profiler's one sync point, on data already on the host. A sink that fails (a full
disk, a closed wandb run) is reported once as a warning and dropped: dashboards never take training down.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from precprof import tables as T
from precprof._notice import notice
from precprof.errors import UserError
from precprof.export.events import EventStream, LayerSelection, check_layers
from precprof.export.tensorboard import TensorBoardSink
from precprof.export.wandb import WandbSink


class LiveDashboards:
    """Sinks for ``Profiler(tensorboard=..., wandb=...)``; see precprof.export.events for the tags."""

    def __init__(self, tensorboard: Any = None, wandb: Any = None, layers: LayerSelection = "auto") -> None:
        self.sinks: list[Any] = []
        if tensorboard is not None:
            self.sinks.append(TensorBoardSink(tensorboard))
        if wandb is not None and wandb is not False:
            self.sinks.append(WandbSink(wandb))
        self.stream = EventStream(layers)

    @classmethod
    def create(
        cls, tensorboard: Any = None, wandb: Any = None, layers: Any = "auto"
    ) -> LiveDashboards | None:
        """The live writer, or None when neither dashboard is asked for. Checks the packages and ``layers``
        (``Profiler(dashboard_layers=...)``: which layers get per-layer tags) now (UserError)."""
        layers = check_layers(layers, "dashboard_layers")
        if tensorboard is None and (wandb is None or wandb is False):
            return None
        return cls(tensorboard, wandb, layers)

    def resumed(self, kept: pd.DataFrame, first_step: int) -> None:
        """A run resumed at ``first_step``, ``kept`` its steps rows before it: the running skipped count goes on
        from theirs, and TensorBoard drops the killed job's points from ``first_step`` on."""
        self.stream.resume(kept)
        for sink in self.sinks:
            if isinstance(sink, TensorBoardSink):
                sink.restart(first_step)

    def write(self, flush: Any) -> None:
        """Write the rows of one flush (a ``Flush``: rows copied to the host since the previous one)."""
        steps, (layer_parts, hist_parts) = flush.step_rows, flush.decoded()
        if not (steps or layer_parts or hist_parts) or not self.sinks:
            return
        events = self.stream.feed(
            T.frame("steps", steps) if steps else None,
            _frame("layers", layer_parts),
            _frame("histograms", hist_parts),
        )
        for sink in list(self.sinks):
            try:
                sink.write(events)
            except Exception as e:  # a dashboard must never take training down
                self._drop(sink, e)

    def tick(self) -> None:
        """A step ended without a flush: a wandb row that waits for wandb's next step goes there."""
        for sink in list(self.sinks):
            try:
                if isinstance(sink, WandbSink):
                    sink.tick()
            except Exception as e:
                self._drop(sink, e)

    def close(self) -> None:
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as e:
                self._drop(sink, e)

    def _drop(self, sink: Any, e: Exception) -> None:
        self.sinks.remove(sink)
        name = "TensorBoard" if isinstance(sink, TensorBoardSink) else "wandb"
        why = str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}"  # ours say what to do
        notice(f"precprof: stopped writing to {name}: {why}")


def _frame(name: str, parts: list[dict[str, Any]]) -> pd.DataFrame | None:
    """One table from column dicts of equal length (a sampled step's layer or histogram columns)."""
    if not parts:
        return None
    return T.frame(name, pd.concat([pd.DataFrame(p) for p in parts], ignore_index=True))

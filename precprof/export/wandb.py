"""Dashboard events into Weights & Biases, through ``run.log`` (one dict per step, steps ascending).

Scalars are logged under their tags; exponent histograms as ``wandb.Histogram`` with bin edges in log2 units
(bin [e, e+1) holds the values with floor(log2|x|) == e).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from precprof.errors import UserError
from precprof.export.events import Event, Histogram, by_step


def wandb_module(option: str = "wandb=...") -> Any:
    """The wandb package, or a one-line UserError when it is missing."""
    try:
        import wandb
    except ImportError:
        raise UserError(f"{option} needs the wandb package: pip install wandb") from None
    return wandb


class WandbSink:
    """Logs events to a wandb run: ``target`` True for the current ``wandb.run`` (looked up at the first write,
    so ``wandb.init`` may come after the Profiler is built) or a run object. ``finish`` runs the run's
    ``finish`` (only for a run precprof started, as ``precprof export`` does)."""

    def __init__(self, target: Any, option: str = "wandb=...", finish: bool = False) -> None:
        self._wandb = wandb_module(option)
        if target is not True and not hasattr(target, "log"):
            raise UserError(f"{option}: expected True (the current wandb.run) or a wandb run object")
        self._target = target
        self._option = option
        self._finish = finish

    @property
    def run(self) -> Any:
        if self._target is not True:
            return self._target
        run = self._wandb.run
        if run is None:
            raise UserError(f"{self._option}=True logs to the current wandb run: call wandb.init() first")
        return run

    def write(self, events: Iterable[Event]) -> None:
        grouped = by_step(events)
        if not grouped:
            return
        run = self.run
        for step, evs in grouped.items():
            data: dict[str, Any] = {}
            for e in evs:
                if isinstance(e, Histogram):
                    data[e.tag] = self._wandb.Histogram(np_histogram=(e.counts.tolist(), e.edges.tolist()))
                else:
                    data[e.tag] = e.value
            run.log(data, step=step)

    def close(self) -> None:
        if self._finish:
            self.run.finish()

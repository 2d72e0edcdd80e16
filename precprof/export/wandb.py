"""Dashboard events into Weights & Biases, through ``run.log`` (one dict per step, steps ascending).

Scalars are logged under their tags; exponent histograms as ``wandb.Histogram`` with bin edges in log2 units
(bin [e, e+1) holds the values with floor(log2|x|) == e).
"""

from __future__ import annotations

import warnings
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


STEP_TAG = "precprof/step"  # precprof's step, logged in each row beside a trainer (``BesideTrainer``)
_FINISHED_EARLY = (
    " before precprof logged its last steps: call wandb.finish() after the Profiler closes (after its with block, "
    "or after prof.report() or prof.detach()); the run directory keeps every step, and precprof export RUN_DIR "
    "--wandb-project P logs the whole run"
)


class BesideTrainer:
    """A wandb target (True: the current ``wandb.run``, or a run object) whose run a trainer also logs to without
    ``step=`` (the Hugging Face Trainer's ``WandbCallback``: one wandb step per log call, evaluations included),
    so wandb's step runs ahead of precprof's and would drop every row logged at precprof's. Logged without
    ``step=``, each row carrying ``precprof/step``, the x-axis its series are defined against: none dropped."""

    def __init__(self, target: Any) -> None:
        self.target = target


class WandbSink:
    """Logs events to a wandb run: ``target`` True for the current ``wandb.run`` (looked up at the first write,
    so ``wandb.init`` may come after the Profiler is built) or a run object. ``finish`` runs the run's
    ``finish`` (only for a run precprof started, as ``precprof export`` does)."""

    def __init__(self, target: Any, option: str = "wandb=...", finish: bool = False) -> None:
        self._wandb = wandb_module(option)
        # beside a trainer that logs without step=: rows logged without step=, against precprof/step
        self._beside = isinstance(target, BesideTrainer)
        self._axis_defined = False
        if isinstance(target, BesideTrainer):
            target = target.target
        if target is not True and not hasattr(target, "log"):
            raise UserError(f"{option}: expected True (the current wandb.run) or a wandb run object")
        self._target = target
        self._option = option
        self._finish = finish
        self._told = False  # whether the steps wandb would drop were warned of
        self._logged = False  # whether a step reached the run: a run gone since then was finished

    @property
    def run(self) -> Any:
        if self._target is not True:
            return self._target
        run = self._wandb.run
        if run is None:
            if self._logged:  # wandb.finish() inside the with block, before the Profiler's last flush
                raise UserError("the current wandb run was finished" + _FINISHED_EARLY)
            raise UserError("wandb=True logs to the current wandb run: call wandb.init() first")
        return run

    def write(self, events: Iterable[Event]) -> None:
        grouped = by_step(events)
        if not grouped:
            return
        run = self.run
        if getattr(run, "_is_finished", False):  # a run object that was handed in and finished since
            raise UserError("the wandb run was finished" + _FINISHED_EARLY)
        if self._beside and not self._axis_defined:
            run.define_metric(STEP_TAG)
            run.define_metric("precprof/*", step_metric=STEP_TAG)
            self._axis_defined = True
        for step, evs in grouped.items():
            at = getattr(run, "step", None)
            if isinstance(at, int) and step < at and not self._beside:
                # wandb drops what is logged to a step below its own, which a loop's own wandb.log without
                # step= moves on (one a call): say so once, where it drops it with a warning of its own or none
                if not self._told:
                    self._told = True
                    warnings.warn(
                        f"precprof: wandb is at step {at}, ahead of precprof's step {step}, and drops what is "
                        "logged below its own step: precprof's series are lost from here on while the loop logs "
                        "to wandb without step=. Log with step=prof.current_step (precprof's step), or watch "
                        "this run with tensorboard=... (precprof export RUN_DIR --wandb-project P logs it whole "
                        "after the run)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                continue
            data: dict[str, Any] = {}
            for e in evs:
                if isinstance(e, Histogram):
                    data[e.tag] = self._wandb.Histogram(np_histogram=(e.counts.tolist(), e.edges.tolist()))
                else:
                    data[e.tag] = e.value
            if self._beside:
                run.log({**data, STEP_TAG: step})
            else:
                run.log(data, step=step)
            self._logged = True

    def close(self) -> None:
        if self._finish:
            self.run.finish()

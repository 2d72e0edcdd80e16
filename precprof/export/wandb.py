"""Dashboard events into Weights & Biases, through ``run.log`` (one dict per step, steps ascending).

Scalars are logged under their tags; exponent histograms as ``wandb.Histogram`` with bin edges in log2 units
(bin [e, e+1) holds the values with floor(log2|x|) == e).
"""

from __future__ import annotations

import warnings
from collections import deque
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


STEP_TAG = "precprof/step"  # precprof's step, logged in each row: the x-axis of precprof's series
MAX_WAITING = 1024  # rows kept waiting for a wandb step of their own; older ones are dropped (and said)
_FINISHED_EARLY = (
    " before precprof logged its last steps: call wandb.finish() after the Profiler closes (after its with block, "
    "or after prof.report() or prof.detach()); the run directory keeps every step, and precprof export RUN_DIR "
    "--wandb-project P logs the whole run"
)


class BesideTrainer:
    """A wandb target (True: the current ``wandb.run``, or a run object) whose run a trainer also logs to without
    ``step=`` (the Hugging Face Trainer's ``WandbCallback``: one wandb step per log call, evaluations included).
    Rows are logged without ``step=`` too, each a wandb step of its own, which the trainer's next log, without
    ``step=``, goes past: no row waits for a wandb step (``WandbSink``), and none is left out at the end."""

    def __init__(self, target: Any) -> None:
        self.target = target


def beside_trainer(target: Any) -> BesideTrainer:
    """``target`` as a ``BesideTrainer``: itself when it is one already (a user's ``wandb=BesideTrainer(run)``
    wrapped again was refused: the inner ``BesideTrainer`` is no run)."""
    return target if isinstance(target, BesideTrainer) else BesideTrainer(target)


class WandbSink:
    """Logs events to a wandb run: ``target`` True for the current ``wandb.run`` (looked up at the first write,
    so ``wandb.init`` may come after the Profiler is built) or a run object. ``finish`` runs the run's
    ``finish`` (only for a run precprof started, as ``precprof export`` does).

    Each row carries ``precprof/step``, the x-axis precprof's series are defined against, and goes to wandb's
    step of the same number where wandb has not passed it. wandb drops a row logged below its own step, which
    the loop's own ``wandb.log`` moves on: one a call without ``step=``, or to the loop's step with ``step=``,
    ahead of the rows of unsampled steps, copied at the next sampled step. Such a row waits and goes to the
    step wandb is at (beside the loop's own values there), one row a wandb step: a second row would overwrite
    the first's values, and a row logged past wandb's step would make wandb drop the loop's next
    ``wandb.log(step=...)`` below it. ``tick`` (each Profiler step) places the next waiting row."""

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
        self._waiting: deque[tuple[int, dict[str, Any]]] = deque()  # rows not logged yet, oldest first
        self._last = -1  # the wandb step precprof's latest row went to
        self._dropped: list[int] = []  # precprof steps never logged (too many waiting rows, or left at close)
        self._named: set[str] = set()  # the keys given a define_metric of their own (``_name_keys``)
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
        run = self._open_run()
        for step, evs in grouped.items():
            data: dict[str, Any] = {STEP_TAG: step}
            for e in evs:
                if isinstance(e, Histogram):
                    data[e.tag] = self._wandb.Histogram(np_histogram=(e.counts.tolist(), e.edges.tolist()))
                else:
                    data[e.tag] = e.value
            self._name_keys(run, data)
            if self._beside:
                run.log(data)
                self._logged = True
            else:
                self._waiting.append((step, data))
        self._place(run)
        while len(self._waiting) > MAX_WAITING:  # the loop moves wandb's step on more slowly than precprof's
            self._dropped.append(self._waiting.popleft()[0])

    def tick(self) -> None:
        """A Profiler step ended: a waiting row goes to the wandb step the loop has moved to since."""
        if self._waiting:
            self._place(self._open_run())

    def _open_run(self) -> Any:
        """The run, its precprof/* series defined against precprof/step (once; each key by name too, as it comes:
        ``_name_keys``)."""
        run = self.run
        if getattr(run, "_is_finished", False):  # a run object that was handed in and finished since
            raise UserError("the wandb run was finished" + _FINISHED_EARLY)
        if not self._axis_defined:
            run.define_metric(STEP_TAG)
            run.define_metric("precprof/*", step_metric=STEP_TAG)
            self._axis_defined = True
        return run

    def _name_keys(self, run: Any, data: dict[str, Any]) -> None:
        """Define each key of ``data`` not named yet against precprof/step, by its name. wandb gives a key that
        no definition names the step metric of a glob that matches it, any one of them (wandb-core tries its
        globs in a Go map's random order): beside a trainer's "*" glob (the HF Trainer's against
        train/global_step, Lightning's against trainer/global_step) most of precprof's series went against the
        trainer's step (170 keys of 200 in a check), whose value wandb copied into precprof's rows. A name
        comes before every glob. A histogram is logged as the keys of its dict, each a key of its own to wandb
        (``<tag>.bins``, ...): each is named too. One define_metric a key, at its first row (some 0.05 ms)."""
        for tag, value in data.items():
            if tag == STEP_TAG or tag in self._named:
                continue
            self._named.add(tag)
            keys = [tag]
            if isinstance(value, self._wandb.Histogram):
                keys += [f"{tag}.{part}" for part in value.to_json()]
            for key in keys:
                run.define_metric(key, step_metric=STEP_TAG)

    def _place(self, run: Any) -> None:
        """Log the waiting rows, oldest first: each at its own step where neither wandb nor an earlier row has
        passed it, else at the step wandb is at, if no row went there yet; the others wait."""
        at = run.step
        at = at if isinstance(at, int) else -1  # not an int: a stand-in for a run, which drops nothing
        while self._waiting:
            step, data = self._waiting[0]
            to = max(step, self._last + 1, at)
            if to != step and to > at:
                return
            run.log(data, step=to)
            self._waiting.popleft()
            self._last, at, self._logged = to, max(at, to), True

    def close(self) -> None:
        if self._waiting:
            self._place(self._open_run())
        self._dropped += [step for step, _ in self._waiting]
        self._waiting.clear()
        if self._dropped:
            first, last = self._dropped[0], self._dropped[-1]
            which = f"step {first}" if first == last else f"{len(self._dropped)} steps ({first}..{last})"
            warnings.warn(
                f"precprof: wandb has no row of {which}: the loop's own wandb.log had moved wandb's step past "
                "them, and a row logged past it would make wandb drop the loop's next wandb.log(step=...) below "
                "it. The run directory keeps every step (precprof export RUN_DIR --wandb-project P logs the "
                "whole run)",
                RuntimeWarning,
                stacklevel=2,
            )
        if self._finish:
            self.run.finish()

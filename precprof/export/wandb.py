"""Dashboard events into Weights & Biases, through ``run.log`` (one dict per step, steps ascending).

Scalars are logged under their tags; exponent histograms as ``wandb.Histogram`` with bin edges in log2 units
(bin [e, e+1) holds the values with floor(log2|x|) == e).
"""

from __future__ import annotations

import atexit
import functools
import weakref
from collections import deque
from collections.abc import Iterable
from typing import Any

from precprof._notice import notice
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
    ``wandb.log(step=...)`` below it. ``tick`` (each Profiler step) places the next waiting row.

    The loop is over when its wandb run finishes: the rows still waiting then (those of the last host copies,
    of a Profiler detached and not attached again) go past the loop's last step, just before the run's last
    records (``wandb.finish()``, the run's ``with`` block, or the process's exit): none is dropped, and none
    moves wandb's step while the loop may still log. A detach (around an evaluation) keeps them waiting: they
    go on after the next attach, with no gap. Where this wandb has no hook on its run's finish, they are logged
    at the Profiler's close instead."""

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
        self._dropped: list[int] = []  # precprof steps never logged (too many waiting rows), not said yet
        self._hooked: Any = None  # the run whose finish logs the rows still waiting (``_log_at_finish``)
        self._no_hook = False  # this wandb has no hook on a run's finish: the rows still waiting go at close
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
        if self._waiting:
            self._log_at_finish(run)
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

    def _place(self, run: Any, past: bool = False) -> None:
        """Log the waiting rows, oldest first: each at its own step where neither wandb nor an earlier row has
        passed it, else at the step wandb is at, if no row went there yet; the others wait. ``past``: the loop
        is over, every row goes, each at the next step past wandb's."""
        at = run.step
        at = at if isinstance(at, int) else -1  # not an int: a stand-in for a run, which drops nothing
        while self._waiting:
            step, data = self._waiting[0]
            to = max(step, self._last + 1, at)
            if to != step and to > at and not past:
                return
            run.log(data, step=to)
            self._waiting.popleft()
            self._last, at, self._logged = to, max(at, to), True

    def _log_at_finish(self, run: Any) -> None:
        """Have the rows still waiting when ``run`` finishes logged then (once a run): by wandb's own hook on its
        run's finish, and at the process's exit for a run never finished (wandb's service finishes it then,
        after Python's exit handlers, precprof's among them)."""
        if self._hooked is run or self._no_hook:
            return
        if not on_finish(run, functools.partial(self._at_finish, run)):
            self._no_hook = True
            return
        self._hooked = run
        _wait_for_exit(self)

    def _at_finish(self, finishing: Any) -> None:
        """wandb finishes the run (its hook, before the run's last records): the loop is over."""
        if finishing is not self._hooked:  # a run this sink logs to no longer: its rows are the next run's
            return
        run, self._hooked = self._hooked, None
        if self._waiting and run is not None:
            try:
                self._place(run, past=True)
            except Exception as e:  # wandb.finish() must go on
                notice(f"precprof: could not log its last wandb rows: {type(e).__name__}: {e}")

    def _at_exit(self) -> None:
        """The process exits: rows still waiting for a run not finished yet go now."""
        if self._waiting and self._hooked is not None and not getattr(self._hooked, "_is_finished", False):
            self._at_finish(self._hooked)

    def close(self) -> None:
        """A detach: rows still waiting keep waiting for the loop's next wandb steps (after the next attach) or for
        the run's finish (see the class); only a wandb with no hook on its run's finish gets them now, past its
        step. The steps dropped since the last close (``MAX_WAITING``) are named in a warning."""
        if self._waiting:
            run = self._open_run()
            self._place(run)
            if self._waiting and self._hooked is not run:  # no hook on this run's finish: now, past its step
                self._place(run, past=True)
        if self._dropped:
            notice(
                f"precprof: wandb has no row of {_steps(self._dropped)}: the loop's own wandb.log had moved "
                f"wandb's step past them while more than {MAX_WAITING} rows waited for wandb steps of their own "
                "(its wandb.log(step=...) moves wandb's step on more slowly than precprof's steps). The run "
                "directory keeps every step (precprof export RUN_DIR --wandb-project P logs the whole run); a "
                "loop that logs without step= gets every row at once with "
                "Profiler(wandb=precprof.export.wandb.BesideTrainer(True))",
                RuntimeWarning,
            )
            self._dropped = []
        if self._finish:
            if self._waiting:
                self._place(self.run, past=True)
            self.run.finish()


# the sinks with rows waiting for a run's finish: a process that exits without finishing its run has them logged
# (one handler for all, holding none of them alive: a sweep makes a Profiler, and a sink, per trial), registered
# at the first such run's hook, after wandb.init registered wandb's own: exit handlers run last registered first,
# so it logs before wandb's service finishes the run
_waiting_at_exit: weakref.WeakSet[WandbSink] = weakref.WeakSet()
_exit_handler: list[bool] = []


def _log_waiting_at_exit() -> None:
    for sink in list(_waiting_at_exit):
        sink._at_exit()


def _wait_for_exit(sink: WandbSink) -> None:
    _waiting_at_exit.add(sink)
    if not _exit_handler:
        atexit.register(_log_waiting_at_exit)
        _exit_handler.append(True)


def on_finish(run: Any, call: Any) -> bool:
    """Have wandb call ``call`` when ``run`` finishes, before its last records (while it still logs): True, or
    False where this wandb has no such hook. wandb has no public one: this is its own list of teardown hooks
    (``Run._teardown_hooks``, stage EARLY, the one its Jupyter support uses; wandb 0.31), checked for."""
    hooks = getattr(run, "_teardown_hooks", None)
    if not isinstance(hooks, list):
        return False
    try:
        from wandb.sdk.wandb_run import TeardownHook, TeardownStage
    except ImportError:
        return False
    hooks.append(TeardownHook(call, TeardownStage.EARLY))
    return True


def _steps(steps: list[int]) -> str:
    """``steps`` (ascending) in words, each run of consecutive steps as a range: "step 4", "5 steps (5..7,
    13..14)"."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    spans = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in runs)
    return f"{len(steps)} steps ({spans})"

"""What the Hugging Face and Lightning callbacks share: one profiled session from train start to a run directory.

A ``Session`` owns the Profiler, the summary it will write, and the end of the run: ``finish()`` detaches the
hooks, writes the run directory (rank 0 under torch.distributed) and renders ``report.html`` when the report
renderer is installed. A session that was started but never finished (a crash the framework gives no hook for)
is finished as "incomplete" at interpreter exit (``atexit``) or when the next session of the same callback, or
of another callback on the same ``out``, starts, whichever comes first. (The HF Trainer has no hook for an
exception: a notebook cell whose ``train()`` raised or was interrupted, run again with a new model, Trainer and
callback on the same ``out``, was refused every time, "a Profiler in this process is still writing this run
directory (it is attached) ... call that Profiler's detach() first", of a Profiler out of the user's reach, and
the run said "running" until the kernel restarted.)
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from precprof import tables as T
from precprof import taxonomy
from precprof._notice import notice
from precprof.analysis.final import final_block
from precprof.capture import Profiler, arguments, unsaved
from precprof.capture.model_facts import model_info as model_info  # (its home before)
from precprof.capture.reducer import RankReducer, is_distributed
from precprof.errors import did_you_mean
from precprof.hardware import software_versions
from precprof.taxonomy import LIGHTNING_PRECISIONS as LIGHTNING_PRECISIONS  # (its home before)

# Profiler arguments a callback gives the Profiler itself (``Session.start``): among its keyword arguments they
# clashed with the callback's own when training started ("got multiple values for keyword argument")
_GIVEN_BY_CALLBACK = {
    "model": "the Trainer's model",
    "optimizer": "the Trainer's optimizer",
    "scaler": "the Trainer's GradScaler",
    "first_step": "the Trainer's step (a checkpoint's, when training resumes)",
}


def checked_profiler_kwargs(caller: str, sample_every: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A callback's ``sample_every`` and further ``Profiler`` arguments checked at its construction, as
    ``Profiler.__init__`` checks them (``capture.arguments``), without a model: a name that is no Profiler
    argument (``sample_evry=1``) or a value it refuses (``update_sample=0``) is a one-line TypeError or ValueError
    there, not an error from deep in the Trainer's first step. Returns them as the Profiler takes them."""
    params = inspect.signature(Profiler.__init__).parameters
    names = [
        n
        for n, p in params.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "out" and n not in _GIVEN_BY_CALLBACK
    ]
    for name in kwargs:
        if name in _GIVEN_BY_CALLBACK:
            raise TypeError(
                f"{caller}({name}=...): the callback gives the Profiler {_GIVEN_BY_CALLBACK[name]} itself; "
                "leave it out"
            )
        if name not in names:
            raise TypeError(
                f"{caller}({name}=...) is not a precprof.Profiler argument{did_you_mean(name, names)}; "
                f"they are: {', '.join(names)}"
            )
    return arguments.checked({"sample_every": sample_every, **kwargs}, caller)


def checked_own(caller: str, out: Any, report: Any) -> tuple[Path | None, bool]:
    """A callback's own ``out`` and ``report``, checked at its construction as the Profiler's arguments are:
    ``out=123`` was pathlib's TypeError naming no argument, ``report="yes"`` was taken."""
    out = arguments.run_dir(caller, "out", out)
    return (Path(out) if out is not None else None), arguments.flag(caller, "report", report)


# the session of this process that runs on each run directory (weak: a session no callback holds is nobody's)
_running: weakref.WeakValueDictionary[Path, Session] = weakref.WeakValueDictionary()
# why an earlier session on the same out is finished when a new one starts
_NOT_ENDED = (
    "its train() did not end (an exception or Ctrl-C in the Trainer's loop, which gives the callback no hook): "
    "a new training started on the same out"
)


class Session:
    """One profiled training run driven by a framework's callbacks.

    Args:
        out: the run directory; the Profiler streams into it from the start (``Profiler(out=...)``).
        profiler_kwargs: passed to ``precprof.Profiler`` (``sample_every``, ``modules``, ``memory``, ...).
            ``resume=True`` continues the run in ``out`` from the framework's step when training resumes from a
            checkpoint; ``resume=False`` replaces a run there; left out (or None), a training that starts past
            step 0 (restored from a checkpoint) continues a run ``out`` holds, with a warning, and one that
            starts at step 0 is refused with a RunDirError, unless ``overwrite=True`` (replace it).
        report: render report.html at the end.
    """

    def __init__(self, out: str | Path, profiler_kwargs: Mapping[str, Any], report: bool = True) -> None:
        self.out = Path(out)
        self.profiler_kwargs = dict(profiler_kwargs)
        self.report = report
        self.prof: Any = None
        self.summary: dict[str, Any] = {}
        self.run_dir: Path | None = None
        self.report_path: Path | None = None
        self._t0 = 0.0
        self._atexit_registered = False
        # the callback's own hooks, removed when the session finishes (another session on its ``out`` finishes
        # it where its train() never ended)
        self.on_finish: Callable[[], None] | None = None

    @property
    def _key(self) -> Path:
        return self.out.absolute()

    @property
    def active(self) -> bool:
        return self.prof is not None

    def start(
        self,
        model: nn.Module,
        optimizer: Any,
        scaler: Any,
        summary: dict[str, Any],
        first_step: int = 0,
        wrapped: nn.Module | None = None,
    ) -> Any:
        """Attach a Profiler to ``model`` (the module whose forward runs: the inner one under DDP/FSDP1)."""
        if self.active:
            self.finish(T.STATUS_INCOMPLETE, "a new training run started before this one ended")
        earlier = _running.get(self._key)
        if earlier is not None and earlier is not self and earlier.active:
            # the callback of a train() that raised (a notebook cell run again): its Profiler, attached to the
            # old model and out of the user's reach, held the run directory; its run is saved as stopped, and
            # this one takes the directory by the usual rules (overwrite=True, resume=True, else refused)
            notice(f"precprof: the run in {self.out} is saved as incomplete: {_NOT_ENDED}")
            earlier.finish(T.STATUS_INCOMPLETE, _NOT_ENDED)
        kwargs = dict(self.profiler_kwargs)
        if "reducer" not in kwargs and is_distributed():
            kwargs["reducer"] = RankReducer(wrapped=wrapped)
        # streamed into the run directory while training runs (rank 0). A run already there is continued when
        # training resumed from a checkpoint, and replaced only when asked (overwrite=True, or resume=False):
        # else refused, as Profiler(out=...) and precprof train refuse it (a notebook cell run again replaced a
        # complete run without a word)
        asked = kwargs.get("resume")
        if asked is None:
            kwargs["resume"] = self._continues(first_step)
        kwargs.setdefault("overwrite", asked is False)
        prof = Profiler(
            model, optimizer=optimizer, scaler=scaler, first_step=first_step, out=self.out, **kwargs
        )
        # attached first: a refused directory leaves no session to finish (its finish saved over that run)
        prof.attach()
        self.prof, self.run_dir, self.report_path = prof, None, None
        _running[self._key] = self
        self.summary = dict(summary)
        self.summary.setdefault(T.SUMMARY_VERSIONS, software_versions())
        self._t0 = time.perf_counter()
        if not self._atexit_registered:
            atexit.register(self._at_exit)
            self._atexit_registered = True
        return self.prof

    def _continues(self, first_step: int) -> bool:
        """With ``resume`` left out: whether this session continues the run in ``out``. A training restored
        from a checkpoint (``first_step`` > 0) into the directory of a run is the same training going on, as a
        rule (a job restarted, a second fit on from the first's checkpoint): replacing the run lost every step
        before the checkpoint without a word. Continued, and said in one line, which names both choices."""
        if first_step <= 0 or not T.is_run_dir(self.out):
            return False
        notice(
            f"precprof: training resumed at step {first_step} and {self.out} holds a run: continuing it "
            f"(its steps from {first_step} on are replaced); pass resume=True to continue without this "
            "warning, or resume=False to replace the run",
        )
        return True

    def step(self, loss: Any = None, grad_norm: Any = None, tokens: int | None = None) -> None:
        if self.prof is not None and self.prof.attached:
            self.prof.step(loss=loss, grad_norm=grad_norm, tokens=tokens)

    def not_training(self) -> contextlib.AbstractContextManager[None]:
        """The Profiler's ``not_training`` (an evaluation between steps: not the step's time); nothing when no
        Profiler is attached."""
        if self.prof is not None and self.prof.attached:
            return cast(contextlib.AbstractContextManager[None], self.prof.not_training())
        return contextlib.nullcontext()

    def finish(self, status: str = T.STATUS_COMPLETE, reason: str | None = None) -> Path | None:
        """Detach, write the run directory (the writer rank) and the report; returns it, None when no run was in
        progress (already finished, or never started). Never raises for a failure to save (it warns): the
        training's own outcome matters more."""
        prof, self.prof = self.prof, None
        if prof is None:
            return None
        if _running.get(self._key) is self:
            del _running[self._key]
        if self.on_finish is not None:
            self.on_finish()
        if self._atexit_registered:
            atexit.unregister(self._at_exit)
            self._atexit_registered = False
        wall_s = time.perf_counter() - self._t0
        try:
            if status != T.STATUS_COMPLETE:
                prof.mark_incomplete(reason or "training stopped")
            prof.detach()
            tables = prof.tables()
            summary = dict(self.summary)
            summary[T.SUMMARY_FINAL] = final_block(tables["steps"], wall_s, prof.compiled_steps)
            capture = dict(summary.get(T.SUMMARY_CAPTURE) or {})
            requested = str(capture.get("mixed_precision_requested") or "")
            capture.update(taxonomy.mixed_precision_check(requested, tables["layers"]))
            summary[T.SUMMARY_CAPTURE] = capture
            render = self.report and prof.is_writer
            self.run_dir = prof.save(self.out, summary=summary, status=status, reason=reason, render=render)
            report = self.run_dir / T.REPORT_FILE
            self.report_path = report if render and report.exists() else None
        except Exception as e:
            notice(f"precprof: could not save the run to {self.out}: {type(e).__name__}: {e}")
        return self.run_dir

    def _at_exit(self) -> None:
        """Interpreter exit with the session still open: training never reached its end hook (a crash)."""
        if self.prof is None:
            return
        reducer: Any = getattr(self.prof, "_reducer", None)
        if reducer is not None and hasattr(reducer, "local_only"):
            reducer.local_only("saved at interpreter exit; other ranks may be gone")
        exc = unsaved.uncaught()  # the exception that ends the script, when one does: the cause
        ended = "the process exited before training ended"
        self.finish(
            T.STATUS_INCOMPLETE, f"{unsaved.cause(exc)}; {ended}" if exc else f"{ended} (crash or interrupt)"
        )


def first_token_count(batch: Any) -> int | None:
    """Tokens in a batch: the element count of its token ids, else None. Token ids are ``input_ids`` in a
    mapping (a mapping without them has none: a ViT's ``pixel_values`` and ``labels`` are no tokens), and the
    first element of a sequence when it is integer (``(ids, targets)``; ``(images, labels)`` has none: labels
    are never tokens)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.numel()) if not batch.is_floating_point() and batch.dtype != torch.bool else None
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        return first_token_count(ids) if isinstance(ids, torch.Tensor) else None
    if isinstance(batch, (list, tuple)) and batch:
        return first_token_count(batch[0])
    return None

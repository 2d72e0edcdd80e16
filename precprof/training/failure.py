"""What stopped a run of the built-in loop, said where the user reads it: summary.json's cause in a line
(``reason``), the run directory's ``traceback.txt`` and, for the terminal, one line (``keep``).

An error in the user's own model (``--model file.py:factory``) is the user's to fix; its traceback, torch's
module calls around one line of the model's, goes into ``traceback.txt``, and ``precprof train`` prints one
line naming the error, its step, the model's line (the innermost of the user's own files: not torch's
``linear.py`` that refused a layer of the wrong width) and the file; under ``torch.compile``, the model's
error that Dynamo's wraps, and the line Dynamo was tracing. An error raised in precprof's own code (its
hooks, its statistics, the loop), or in a built-in or Hugging Face model (whose failure is precprof's or the
library's bug, as ``contract.check_forward`` holds), keeps its traceback on the terminal, for the bug's
report, and in the file. Which it is, the traceback says: the model's when the innermost of its frames that
is precprof's or the model's (the user's own files, and those of the model's module classes: a torch
``nn.Linear`` of an ``nn.Sequential``, an installed package's layers) is the model's; also when no frame of
precprof's lies below the loop's and the step was in the model's forward or backward pass (torch refusing
what the model did: an in-place change to a tensor saved for backward, the device's memory).

sys.exit() in training is named as the call and the line that made it ("sys.exit(0) in forward (model.py,
line 12)"), where its type's name ("SystemExit: 0") said nothing of it in the report and in ``precprof
compare``'s lines ("stopped after 3 of 8 steps: SystemExit").
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from precprof import _compat, rundir
from precprof import tables as T
from precprof.errors import PEER_BLAME, ModelError, UserError
from precprof.models.factory import is_precprof, is_users

# the parts of a step the loop names (``phase``); torch's own error in the first two is the model's doing
FORWARD = "forward pass"
BACKWARD = "backward pass"
OPTIMIZER = "optimizer step"
START = "start of training"
END = "end of training"
_THROUGH_THE_MODEL = (FORWARD, BACKWARD)
# torch's own files: never the user's line, wherever torch is installed
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# ``Failure.blame`` of a rank's error that another rank's failure caused (a collective's lost peer): said in the
# line of the run's cause ("rank 1 failed first: ...; rank 0 then lost its connection to it (...)")
PEER = PEER_BLAME


@dataclass(frozen=True)
class Failure:
    """The exception that stopped a run, as ``precprof train`` says it: ``text`` in one line ("the model
    raised RuntimeError in the forward pass of step 4 (at model.py:16, in forward): ..."); ``blame``: "model"
    for the user's own model's error (a factory's), said in that line alone, ``PEER`` for the consequence of
    another rank's failure (said in that line alone too: the line names that rank's error), "precprof" for one
    raised in precprof's own code (a bug), "" otherwise (a built-in or Hugging Face model's, torch's); ``traceback``:
    its file (None when it could not be written, or on a rank that writes no run directory, unless rank 0 writes
    it there: ``told_rank_0``); ``trace``: the text written into it; ``said``: how the terminal's line says where
    the traceback is (``where``), "{path}" the file."""

    text: str
    blame: str
    traceback: Path | None
    trace: str = ""
    said: str = "its traceback is in {path}"

    def where(self) -> str:
        """Where the traceback is, as the terminal's line ends: "its traceback is in runs/x/traceback.txt"."""
        return self.said.format(path=self.traceback)

    def note(self) -> str:
        """The line a traceback on the terminal ends with: where its copy is, and whose bug it is."""
        if self.traceback is None:
            return ""
        if self.blame == "precprof":
            return (
                "precprof: the error was raised in precprof's own code, a bug: please report it with "
                f"{self.traceback}"
            )
        if self.said != Failure.said:
            return f"precprof: {self.where()}"
        return f"precprof: the traceback is in {self.traceback} too"


def told_rank_0(kept: Failure, run_dir: Path) -> Failure:
    """``kept``, of a rank that writes no run directory, once its error and traceback are in the group's store
    (``distributed.record_failure``), which rank 0 writes into ``run_dir``'s traceback.txt: its terminal line says
    so (a model's error printed torch's 60-line traceback there, every line prefixed ``[rank1]:``)."""
    return dataclasses.replace(
        kept, traceback=run_dir / T.TRACEBACK_FILE, said="rank 0 writes its traceback into {path}"
    )


def caused_by_peer(kept: Failure, cause: str, rank: int, peer: tuple[int, str] | None) -> Failure:
    """Rank ``rank``'s ``kept`` once its error is found the consequence of another rank's failure: said as the run's
    ``cause`` (which names that rank's error; blame ``PEER``). Where that rank left its traceback in the store
    (``peer``: that rank and its traceback), traceback.txt holds it, then this rank's own; else the line says
    whose traceback the file holds (it said "its traceback is in" of rank 0's gloo "Connection closed by peer"
    alone, after "rank 1 failed first: ...")."""
    kept = dataclasses.replace(kept, text=cause, blame=PEER, said=f"rank {rank}'s traceback is in {{path}}")
    if kept.traceback is None or peer is None:
        return kept
    other, theirs = peer
    text = (
        f"# rank {other}'s, which failed first:\n{theirs.rstrip()}\n\n"
        f"# rank {rank}'s, after rank {other} failed:\n{kept.trace}"
    )
    path = rundir.write_traceback(kept.traceback.parent, text)
    if path is None:  # (a full disk) the file holds this rank's alone
        return kept
    return dataclasses.replace(
        kept, traceback=path, trace=text, said=f"rank {other}'s traceback is in {{path}} (then rank {rank}'s)"
    )


def peers_too(kept: Failure | None, run_dir: Path, rank: int, peer: tuple[int, str] | None) -> Failure | None:
    """The writing rank's ``kept`` (None: it was interrupted, torchrun's SIGTERM after another rank failed) where
    another rank left its traceback in the store (``peer``) and this rank's error is not that rank's consequence:
    traceback.txt holds that rank's too, after this rank's own where it has one (a failing rank said "rank 0 writes
    its traceback into ..." of a file that then held rank 0's alone, or was never written: reviewer r1)."""
    if peer is None:
        return kept
    other, theirs = peer
    if kept is None:
        rundir.write_traceback(run_dir, f"# rank {other}'s, which failed first:\n{theirs.rstrip()}\n")
        return kept
    if kept.traceback is None:  # (a full disk: the terminal shows this rank's)
        return kept
    text = (
        f"# rank {rank}'s:\n{kept.trace.rstrip()}\n\n# rank {other}'s, which failed too:\n{theirs.rstrip()}\n"
    )
    path = rundir.write_traceback(kept.traceback.parent, text)
    if path is None:
        return kept
    return dataclasses.replace(kept, traceback=path, trace=text, said=f"{kept.said} (then rank {other}'s)")


def exit_call(code: object) -> str:
    """sys.exit()'s call as the user wrote it, its text left out: "sys.exit()", "sys.exit(3)", "sys.exit"."""
    return "sys.exit()" if code is None else f"sys.exit({code})" if isinstance(code, int) else "sys.exit"


def reason(e: BaseException, model: Any) -> str:
    """summary.json's cause for a run stopped by ``e`` (an exception, not a signal): "RuntimeError: text", or
    for sys.exit() the call and the line that made it, its text after a colon ("sys.exit in forward (model.py,
    line 12): diverged"; ``precprof compare`` reads the cause up to its first colon); a model's error raised
    while torch.compile traced it, "RuntimeError under torch.compile: ..." (was Dynamo's "TorchRuntimeError:
    RuntimeError when making fake tensor call" and a page of explanation)."""
    if not isinstance(e, SystemExit):
        said, _ = _compat.traced_error(
            e
        )  # under torch.compile: the model's error, not Dynamo's fake-tensor call
        return (
            f"{type(e).__name__}: {e}" if said is e else f"{type(said).__name__} under torch.compile: {said}"
        )
    try:
        frame = _innermost(traceback.extract_tb(e.__traceback__), _model_files(model))
    except Exception:  # saying where must not hide that it stopped
        frame = None
    where = f" in {frame.name} ({Path(frame.filename).name}, line {frame.lineno})" if frame else ""
    text = f": {e.code}" if e.code is not None and not isinstance(e.code, int) else ""
    return f"{exit_call(e.code)}{where}{text}"


def keep(
    e: Exception, model: Any, kind: str, run_dir: Path | None, step: int, phase: str, logged: str = ""
) -> Failure:
    """Write ``e``'s traceback (frames from the loop down, causes included) into ``run_dir``'s traceback.txt
    (None: a rank that writes none), and describe ``e`` for the terminal (``Failure``). ``model``: the module
    the loop trains, unwrapped; ``kind``: its BuiltModel kind; ``step``, ``phase``: where the run was;
    ``logged``: what torch logged in the step that failed (``torch_log.Held``), written after the traceback."""
    frames = traceback.extract_tb(e.__traceback__)
    files = _model_files(model)
    text = "".join(traceback.format_exception(e))
    if logged:
        text += f"\n# what torch logged in the step that failed (held off the terminal):\n{logged}\n"
    # None (a full disk, a file of the user's of that name): the terminal shows the traceback
    path = rundir.write_traceback(run_dir, text) if run_dir else None
    # torch.compile's error while it traced the model: the model's own error and line, not Dynamo's
    said, traced = _compat.traced_error(e)
    at = _innermost([*frames, *traced], files, model_only=True)
    place = f" (at {at.filename}:{at.lineno}, in {at.name})" if at else ""
    when = f"in the {phase} of step {step}" if phase in (FORWARD, BACKWARD, OPTIMIZER) else f"at the {phase}"
    when = f"under torch.compile {when}" if said is not e else when
    first = _first_line(said)
    blame = _blame(e, frames, files, kind, phase)
    raised = f"{'the model raised ' if blame == 'model' else ''}{type(said).__name__} {when}{place}"
    return Failure(raised + (f": {first}" if first else ""), blame, path, text)


@contextlib.contextmanager
def preparing(model: Any, kind: str, name: str) -> Iterator[None]:
    """Around what precprof does with the user's built model before training (moving it to the device, casting
    it, training mode, the measuring passes, the optimizer): an exception the model's own code raised there
    (an override of ``train()`` or ``_apply``, a forward that fails) becomes a one-line ``ModelError``
    naming it and the user's line, with the exception as its cause; there is no run directory yet for a
    traceback.txt. Precprof's own errors (``_blame``), a built-in or Hugging Face model's and UserErrors pass
    unchanged. ``kind``, ``name``: the BuiltModel's."""
    try:
        yield
    except UserError:
        raise
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        files = _model_files(model)
        if kind != "factory" or _blame(e, frames, files, kind, START) != "model":
            raise
        at = _innermost(frames, files, model_only=True)
        place = f" (at {at.filename}:{at.lineno}, in {at.name})" if at else ""
        first = _first_line(e)
        raise ModelError(
            f"{name}: the model raised {type(e).__name__} while precprof prepared it for training{place}"
            + (f": {first}" if first else "")
        ) from e


def _first_line(e: BaseException) -> str:
    """The first line of ``e``'s message, at most about 300 characters, its final full stop left out (the
    terminal's line goes on after it: "...]; its traceback is in")."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    first = first if len(first) <= 300 else f"{first[:300].rsplit(' ', 1)[0]}..."
    return first[:-1] if first.endswith(".") and not first.endswith("..") else first


def _model_files(model: Any) -> set[str]:
    """The files of the classes of ``model``'s modules (their own and those they inherit from, torch's Module
    left out), absolute: the code a forward pass runs."""
    files: set[str] = set()
    modules: Iterable[Any] = model.modules() if hasattr(model, "modules") else ()
    for cls in {type(m) for m in modules}:
        for base in cls.__mro__:
            if base.__module__ in ("torch.nn.modules.module", "builtins"):
                continue
            filename = getattr(sys.modules.get(base.__module__), "__file__", None)
            if filename:
                files.add(os.path.abspath(filename))
    return files


def _is_models(frame: traceback.FrameSummary, files: set[str]) -> bool:
    name = frame.filename
    return not is_precprof(name) and (is_users(name) or os.path.abspath(name) in files)


def _is_users(frame: traceback.FrameSummary) -> bool:
    """Whether ``frame`` is of the user's own files (``is_users``), torch's left out wherever it lies (a torch
    built from source, installed editable)."""
    return is_users(frame.filename) and not os.path.abspath(frame.filename).startswith(_TORCH)


def _innermost(
    frames: Sequence[traceback.FrameSummary], files: set[str], model_only: bool = False
) -> traceback.FrameSummary | None:
    """Where the model's code raised: the innermost frame of the user's own files (``_is_users``: the line
    that called a torch layer of the wrong width, not the line of torch's ``linear.py`` that refused it); else
    the innermost of the model's module classes (``_is_models``: a built-in or an installed package's model);
    else, unless ``model_only``, the innermost."""
    for own in ([f for f in frames if _is_users(f)], [f for f in frames if _is_models(f, files)]):
        if own:
            return own[-1]
    return frames[-1] if frames and not model_only else None


def _blame(e: Exception, frames: traceback.StackSummary, files: set[str], kind: str, phase: str) -> str:
    """Whose error ``e`` is (``Failure.blame``; the module docstring): ``frames`` start at the loop's."""
    ours = [i for i, f in enumerate(frames) if is_precprof(f.filename)]
    models = [i for i, f in enumerate(frames) if _is_models(f, files)]
    deepest_ours = ours[-1] if ours else -1
    through_model = (models and models[-1] > deepest_ours) or (
        deepest_ours <= 0 and phase in _THROUGH_THE_MODEL
    )
    if through_model:
        return "model" if kind == "factory" else ""
    # the device's memory is no bug, wherever it ran out (a built-in model's line)
    return "" if isinstance(e, torch.OutOfMemoryError) else "precprof"

"""What the run directory of a Profiler that an exception stopped before it saved says: the exception, not a kill.

``Profiler(out=...)`` writes its first summary.json when it claims the run (``rundir.claim``): "running (pid ...);
if it still says this, the process ended before it could save: killed ...", and streams every flush into the run.
After a kill that text stays, rightly. After an exception it stayed too, unless the loop saved the run: a ``with
Profiler(...)`` block that raised, or a script whose loop died without ``detach()``, read as killed, out of
memory, though the Profiler knew the cause. The summary says it instead (still ``incomplete``): the exception in
one line (``cause``), the last step ``prof.step()`` ended, and that the steps recorded up to it are kept, which
``precprof report RUN_DIR`` renders:

- ``with`` block: at ``__exit__`` (``say``), once ``detach()`` wrote every step to the stream;
- no ``with``: at the interpreter's exit, from the exception it printed (``sys.last_value``, through the
  script's top level), for every Profiler that still holds its run (``watch``). An interactive session's last traceback (a REPL, IPython) need not be
  what ended it: left alone there. ``sys.exit`` leaves no exception: the first text stays, as after a kill;
- no ``with``, ``prof.detach()`` in the loop's ``finally:`` or ``except:`` (``in_flight``): at ``detach()``, as
  at ``__exit__``; the run is then incomplete with that cause (a save in that ``finally:`` had said "complete").

Only a summary that still says "running" in this process is replaced: a save's, another process's and a kill's are
left as they are. A Profiler attached again (the next cell of a notebook) says "running" again (``watch``).

A Profiler that holds its run unsaved when it is garbage-collected (the cell that made it run again, its name bound
to the new one) releases the run directory then (``hold``): kept, its lock had refused the new Profiler until the
kernel restarted. Its summary, if it still says "running", says that (``COLLECTED``). Detached and alive, it lets
a Profiler given ``overwrite=True`` or ``resume=True`` take its run over (``rundir``), and no longer owns it then: a
save or an attach of its own is refused (``refuse_taken``): its steps are the new run's, or were replaced.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import os
import sys
import weakref
from pathlib import Path
from typing import Any

from precprof import _signals, rundir
from precprof import tables as T
from precprof.errors import UserError

# an exception's message in a run's cause, at most (a torch error can carry a page of context)
MAX_MESSAGE = 300

_watched: weakref.WeakSet[Any] = weakref.WeakSet()  # Profilers holding a run they claimed (``out``), unsaved
# run directory -> (the "running" text replaced, the cause written)
_replaced: dict[Path, tuple[str, str]] = {}
_at_exit_registered = False
# the one line of ``save()`` / ``report()`` on a Profiler that attached, or tried to, and recorded no step
RECORDED_NONE = (
    "nothing recorded: this Profiler recorded no step (its attach was refused, or no step ended while it was "
    "attached); attach it (`with prof:` or prof.attach()) and call prof.step() after each optimizer step first"
)
# the cause a run gets whose Profiler was garbage-collected unsaved (``_collected``)
COLLECTED = (
    "not saved: its Profiler {who} was garbage-collected before prof.save() or prof.report() (a notebook cell run "
    "again, say: its name bound to a new Profiler), which released the run directory; the steps it wrote to its stream "
    "are kept, and `precprof report {run}` renders them"
)


def cause(exc: BaseException) -> str:
    """``exc`` as a run's cause, in one line: ``ValueError: its message`` (its white space, newlines among it,
    made single spaces; at most ``MAX_MESSAGE`` characters), ``interrupted (KeyboardInterrupt)`` for Ctrl-C in a
    script (``interrupted (Ctrl-C, SIGINT)`` where precprof's handler turned the signal into it), as the
    callbacks and ``precprof train`` say them."""
    if isinstance(exc, _signals.Interrupted):
        return exc.reason
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (KeyboardInterrupt)"
    text = " ".join(str(exc).split())
    if len(text) > MAX_MESSAGE:
        text = text[: MAX_MESSAGE - 1] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def in_flight() -> BaseException | None:
    """The exception being raised or handled where this is called (``prof.detach()`` in the loop's ``finally:``
    or ``except:``), None when none is; a ``StopIteration`` (a data iterator run out: a loop's natural end) is
    none."""
    raised = sys.exc_info()[1]
    return None if raised is None or isinstance(raised, StopIteration) else raised


def _reason(prof: Any, exc: BaseException | str, at_exit: bool) -> str:
    """The cause summary.json gives for ``prof``'s run, which ``exc`` stopped before it was saved (a text: why
    it was detached unsaved, ``say_detached``)."""
    last = prof.current_step - 1
    ended = f"after step {last} (the last step prof.step() ended)" if last >= prof._first_step else None
    when = ended or "before prof.step() ended a step"
    how = f"not caught, it ended the script {when}" if at_exit else f"raised {when}"
    if isinstance(exc, str):
        return _kept(prof, f"detached {when}: {exc}", at_exit)
    return _kept(prof, f"{cause(exc)}; {how}, before the run was saved", at_exit)


def _kept(prof: Any, head: str, at_exit: bool) -> str:
    sink = prof._recorded.sink
    error = getattr(sink, "error", None)
    kept = "the steps flushed to its stream up to it" if at_exit else "the steps recorded up to it"
    if error:  # (a full disk)
        kept = f"the steps its stream wrote before it stopped writing ({' '.join(str(error).split())})"
    run = rundir.shown(prof._owned_run.path)
    return f"{head}: {kept} are kept, and `precprof report {run}` renders them"


def _running_text(summary: dict[str, Any]) -> str | None:
    """The summary's cause when it is the first summary's "running" of this process (``rundir.claim``)."""
    reason = summary.get(T.SUMMARY_INCOMPLETE_REASON)
    if summary.get(T.SUMMARY_STATUS) != T.STATUS_INCOMPLETE or not isinstance(reason, str):
        return None
    return reason if reason.startswith(f"running (pid {os.getpid()},") else None


def _rewrite(path: Path, old: str, new: str) -> bool:
    """Replace the cause in ``path``'s summary.json when it is still ``old``; never raises (a full disk, a
    damaged summary: the exception that stopped the run matters more)."""
    try:
        summary = T.read_summary(path)
        if summary.get(T.SUMMARY_INCOMPLETE_REASON) != old:
            return False
        summary[T.SUMMARY_INCOMPLETE_REASON] = new
        T.write_summary(path, summary)
    except (OSError, UserError):
        return False
    return True


def say_detached(prof: Any, why: str) -> None:
    """``prof`` was detached unsaved, for ``why`` (another Profiler attached to its model; a callback's new
    training on its run directory while its ``train()`` never ended): its summary.json says so where it still
    says "running", so the run reads as stopped (``rundir.stopped_note``), not as still being written."""
    say(prof, why)


def say(prof: Any, exc: BaseException | str, at_exit: bool = False) -> None:
    """Write why ``prof``'s run stopped (``exc``) into its summary.json, where it still says "running" (a run
    it claimed, ``out``, that it never saved); nothing for another run."""
    run = getattr(prof, "_owned_run", None)
    if run is None or run.taken_over or not prof.is_writer:
        return
    try:
        running = _running_text(T.read_summary(run.path))
    except (OSError, UserError):
        return
    if running is None:
        return
    written = _reason(prof, exc, at_exit)
    if _rewrite(run.path, running, written):
        _replaced[run.path] = (running, written)


def watch(prof: Any) -> None:
    """``prof`` attached and holds a run it claimed: an uncaught exception that ends the interpreter before it
    saves says so (``_at_exit``). Attached again after a ``with`` block raised, its summary says "running"
    again."""
    global _at_exit_registered
    run = getattr(prof, "_owned_run", None)
    if run is None or not prof.is_writer:
        return
    _watched.add(prof)
    if run.path in _replaced:
        running, written = _replaced.pop(run.path)
        _rewrite(run.path, written, running)
    if (
        not _at_exit_registered
    ):  # after the stream's (``capture.stream``): run before its drain, which may wait
        atexit.register(_at_exit)
        _at_exit_registered = True


def uncaught() -> BaseException | None:
    """The exception that ends this interpreter: the one it printed (``sys.last_value``) when it came up through
    the script's own top level (``__main__``'s module code; pytest sets it for a failed test too). None when the
    interpreter ends otherwise, or is interactive (its last traceback need not be what ends it)."""
    if hasattr(sys, "ps1") or sys.flags.interactive or getattr(builtins, "get_ipython", None) is not None:
        return None
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if not isinstance(exc, BaseException):
        return None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            return exc
        tb = tb.tb_next
    return None


def _at_exit() -> None:
    exc = uncaught()
    if exc is None:
        return
    for prof in list(_watched):
        with contextlib.suppress(Exception):  # an exit handler that raises prints a second traceback
            say(prof, exc, at_exit=True)


def hold(prof: Any, run: rundir.RunDir) -> None:
    """``prof`` claimed ``run`` (``out``): it writes it while attached (``RunDir.writing``: detached, another
    Profiler's overwrite or resume takes it over, and its stream's writer process goes back), and its collection
    releases it (``_collected``; not at the interpreter's exit, which releases every lock)."""
    ref = weakref.ref(prof)
    run.writing = lambda: (p := ref()) is not None and bool(p.attached)
    run.on_taken = lambda: _let_go(ref())
    weakref.finalize(prof, _collected, run).atexit = False


def _let_go(prof: Any) -> None:
    sink = getattr(getattr(prof, "_recorded", None), "sink", None)
    if sink is not None:
        sink.end()


def _collected(run: rundir.RunDir) -> None:
    """``run``'s Profiler was garbage-collected: its summary says so where it still says "running" (``COLLECTED``),
    and the directory is released. Nothing for a run saved or taken over since (released already)."""
    if run._fd is None:
        return
    with contextlib.suppress(Exception):  # (a finalizer that raises prints a traceback at a random moment)
        running = _running_text(T.read_summary(run.path))
        if running is not None:
            who = running[len("running ") : running.index(")") + 1]
            _rewrite(run.path, running, COLLECTED.format(who=who, run=rundir.shown(run.path)))
    _replaced.pop(run.path, None)
    run.release()


def refuse_taken(prof: Any) -> None:
    """Refuse, in one line, a save or an attach of ``prof`` once another Profiler took its run over (``hold``)."""
    run = getattr(prof, "_owned_run", None)
    if run is not None and run.taken_over:
        raise rundir.RunDirError(
            f"{rundir.shown(run.path)} was taken over by another Profiler (overwrite=True replaced this Profiler's "
            "run, resume=True continues it): this Profiler no longer owns it, and what it recorded there is the "
            "new run's or gone; nothing of it is left to save, report or attach again"
        )

"""Ctrl-C, SIGTERM and SIGHUP for the command line: stop training at once, save what was recorded, never lose it.

``handling()`` (used by the CLI around ``train`` and ``compare``) turns SIGINT, SIGTERM and SIGHUP (the
terminal closed, an ssh session dropped) into ``Interrupted``, a KeyboardInterrupt that remembers its signal,
so that every ``except KeyboardInterrupt`` already in the code saves the run and the CLI exits with 128 + the
signal number (130, 143, 129). A signal the process was started ignoring (``nohup``, a background job) stays
ignored.

Two ways a signal gets lost are closed here:

- Python runs a signal handler between bytecodes wherever the main thread is, also inside a weakref callback
  or a C extension's callback, which swallow the exception and carry on. The handler therefore also records
  the signal, and ``check()`` raises it again at the next step boundary; Python's "Exception ignored in ..."
  traceback of the swallowed one is left off the terminal.
- A second Ctrl-C while the run directory is being written would leave half a directory. Inside
  ``deferred()`` a signal is only recorded; the writing finishes first.

Outside ``handling()`` (a user's own script, the tests) nothing is installed and ``check()`` does nothing.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

HANDLED: tuple[int, ...] = (
    signal.SIGINT,
    signal.SIGTERM,
    *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()),  # POSIX
)
_WHAT: dict[int, str] = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "terminated"}
if hasattr(signal, "SIGHUP"):
    _WHAT[signal.SIGHUP] = "hangup: the terminal closed"


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (what Slurm and Kubernetes send before a kill) during a run."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum

    @property
    def reason(self) -> str:
        """What the run directory's ``incomplete_reason`` says."""
        what = _WHAT.get(self.signum, "signal")
        return f"interrupted ({what}, {signal.Signals(self.signum).name})"


class _State:
    installed = False
    pending: int | None = None  # a signal received and not yet turned into a handled exception
    defer_depth = 0
    defer_note: str | None = None  # printed when a signal arrives while deferred


_state = _State()


def _handler(signum: int, frame: FrameType | None) -> None:
    _state.pending = signum
    if _state.defer_depth == 0:
        raise Interrupted(signum)
    if _state.defer_note:
        print(f"\nprecprof: {signal.Signals(signum).name} received; {_state.defer_note}", file=sys.stderr)


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Install the SIGINT/SIGTERM handlers for the duration (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread() or _state.installed:
        yield
        return
    previous = {s: signal.getsignal(s) for s in HANDLED}
    previous = {s: h for s, h in previous.items() if h is not signal.SIG_IGN}  # nohup: the user's choice
    for s in previous:
        signal.signal(s, _handler)
    _state.installed, _state.pending = True, None
    unraisable = sys.unraisablehook
    sys.unraisablehook = _quiet_when_swallowed(unraisable)
    try:
        yield
    finally:
        sys.unraisablehook = unraisable
        for s, h in previous.items():
            signal.signal(s, h)
        _state.installed, _state.pending = False, None


def _quiet_when_swallowed(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``hook`` (``sys.unraisablehook``) that prints nothing for an ``Interrupted`` a callback swallowed: the
    signal is recorded and raised again (``check()``); its traceback, beside the one-line message the command
    prints, read as a crash in the middle of the report's rendering."""

    def quiet(unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, Interrupted):
            hook(unraisable)

    return quiet


def check() -> None:
    """Raise ``Interrupted`` if a signal arrived whose exception was swallowed on the way. Cheap: call it at
    every step boundary."""
    if _state.pending is not None and _state.defer_depth == 0:
        raise Interrupted(_state.pending)


def consume() -> int | None:
    """Forget the pending signal (the caller is handling it now) and return it."""
    signum, _state.pending = _state.pending, None
    return signum


def as_interrupted(exc: BaseException) -> Interrupted | None:
    """``exc`` as an ``Interrupted`` when it is one, or a plain KeyboardInterrupt (SIGINT); else None."""
    if isinstance(exc, Interrupted):
        return exc
    if isinstance(exc, KeyboardInterrupt):
        return Interrupted(signal.SIGINT)
    return None


@contextlib.contextmanager
def deferred(note: str | None = "finishing the run directory first") -> Iterator[None]:
    """Signals arriving inside are recorded, not raised (``check()`` raises them afterwards): for writing a
    run directory to its end, or for bookkeeping that must not be cut in half. ``note`` is printed when one
    arrives (None: silently)."""
    saved = _state.defer_note
    _state.defer_depth += 1
    _state.defer_note = note
    try:
        yield
    finally:
        _state.defer_depth -= 1
        _state.defer_note = saved


def holding(note: str | None = "finishing the run directory first") -> contextlib.ExitStack[bool | None]:
    """``deferred(note)``, entered now and left by the returned stack's ``close()`` (or at the end of a ``with``
    block around it, whichever comes first): a hold that ends before the block it guards does."""
    stack = contextlib.ExitStack()
    stack.enter_context(deferred(note))
    return stack

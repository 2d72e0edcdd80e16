"""Warnings precprof says in the middle of something it must finish: a fallback (the kernel built in a private
folder), a step being armed or ended, a detach, a save, a hook or a framework's callback inside training.

``warnings.warn`` there obeys the user's filters, and ``python -W error`` (``PYTHONWARNINGS=error``, pytest's
``filterwarnings = error``) made the warning an exception at precprof's line: the fallback never happened, the
attach or the step stopped half done, a training's own error was replaced by it, a callback ended training.
``notice`` says the warning as the filters want it (shown, once, or not at all), except that an "error" filter
shows it instead of raising it (through ``warnings.showwarning``: pytest records it as a warning).

The warning is attributed to the user's line: the first frame outside precprof and the libraries that call into it
(torch's module calls and hooks, Lightning's and Transformers' trainers, typer's command), not to precprof's own.
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

# the top-level packages whose frames lie between a precprof warning and the user's line that led to it
_SKIPPED = frozenset(
    {
        "precprof",
        "torch",
        "lightning",
        "lightning_fabric",
        "pytorch_lightning",
        "transformers",
        "accelerate",
        "typer",
        "click",
        "contextlib",
        "functools",
    }
)


def _user_frame(frame: FrameType | None) -> FrameType | None:
    """The first frame from ``frame`` outward whose module is not one of ``_SKIPPED`` (None: every one is)."""
    while frame is not None:
        name = str(frame.f_globals.get("__name__") or "")
        if name.partition(".")[0] not in _SKIPPED:
            return frame
        frame = frame.f_back
    return None


def notice(message: str | Warning, category: type[Warning] = UserWarning) -> None:
    """Warn ``message`` (a ``category``, or the class of a Warning given), attributed to the user's line; never
    raises it, whatever the warning filters say (see the module docstring)."""
    caller = sys._getframe(1)
    frame = _user_frame(caller) or caller
    module_globals = frame.f_globals
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    if isinstance(message, Warning):
        category = type(message)
    registry = module_globals.setdefault("__warningregistry__", {})
    try:
        warnings.warn_explicit(
            message,
            category,
            filename,
            lineno,
            module=str(module_globals.get("__name__") or "<string>"),
            registry=registry,
        )  # (no module_globals: as warnings.warn, the source line is read from the file, not its loader)
    except (
        Warning
    ) as raised:  # an "error" filter: said, never raised (see the module docstring); once per place,
        # as "default" says it (the filter raised before it marked the place: a loop said it on every call)
        key = (str(raised), type(raised), lineno)
        if registry.get(key):
            return
        registry[key] = True
        warnings.showwarning(raised, type(raised), filename, lineno)

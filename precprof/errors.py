"""Errors that are the user's to fix. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable

# ``training.failure.Failure.blame`` of a rank's error that another rank's failure caused (a collective's lost
# peer): here, where the CLI reads it without importing torch (``precprof report`` and ``compare RUN RUN`` never do)
PEER_BLAME = "peer"
# set to 1 (or anything but "" and "0"), the CLI prints the traceback of an error it says in one line: a
# UserError's (a ModelError's, the user's own model's exception among its causes), and that of the user's model
# raised in training, whose copy is in the run directory's traceback.txt
TRACEBACK_ENV = "PRECPROF_TRACEBACK"


def traceback_wanted() -> bool:
    """Whether the environment asks for the tracebacks of errors said in one line (``TRACEBACK_ENV``)."""
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """ " (did you mean X?)" naming the one choice close to a mistyped ``word`` (n_layr, gpt-nan), "" when none is
    close: the cut-off keeps a different word (depth for width) from being offered."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.7)
    return f" (did you mean {close[0]}?)" if close else ""


class UserError(Exception):
    """A mistake in the user's input (unknown model, unsupported format on this device, missing extra).

    The message is one line naming the problem and the fix; the CLI prints it without a traceback.
    """


class ModelError(UserError):
    """The user's own model (``--model file.py:factory``) raised before training: its file as it was imported,
    its factory, or its code while precprof prepared it (moved it to the device, set training mode, ran its
    forward pass on a batch). The message names the exception and the line of the user's file it came from;
    ``__cause__`` is the exception. There is no run directory yet for a traceback.txt: the CLI says that
    ``PRECPROF_TRACEBACK=1`` prints the traceback (the run failed in seconds, before training)."""


class MissingDependencyError(UserError, ImportError):
    """An optional dependency is not installed; the message names the pip extra that provides it.

    Also an ImportError: ``from precprof.integrations.lightning import PrecprofCallback`` raises it where
    lightning is not installed, and the usual ``try: ... except ImportError:`` of an optional import catches it.
    ``name`` is the missing package, as ImportError's is the module that did not import."""

    def __init__(self, package: str, extra: str | None = None, purpose: str = "") -> None:
        # the package itself, then precprof's extra, installed (a wheel) or from its source tree
        hint = f"pip install {package}" + (
            f" (or precprof's extra: pip install 'precprof[{extra}]', or pip install -e '.[{extra}]' in "
            "precprof's checkout)"
            if extra
            else ""
        )
        what = f" (needed for {purpose})" if purpose else ""
        super().__init__(f"{package} is not installed{what}; install it with: {hint}", name=package)
        self.package = package
        self.extra = extra


class DamagedRunDirError(UserError):
    """A file of a run directory cannot be read (truncated, not JSON or Parquet, wrong structure).

    The message names the file and what is wrong with it.
    """


class RunNotSavedWarning(UserWarning):
    """A run directory could not be written whole (a full disk, a read-only file system): the message says what
    was not saved and what was. ``precprof train`` prints it as its own error line and exits with code 1."""

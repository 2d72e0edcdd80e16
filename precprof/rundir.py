"""Owning a run directory: checked before training starts, one writer at a time, never overwritten silently.

``check_target(path)`` is cheap and leaves nothing behind (where the directory is to be made, it makes and
removes an empty folder beside it): it refuses a path that is a file, that cannot be created, or that already
holds a run (unless ``overwrite``). ``claim(path)`` then creates the directory,
takes an exclusive lock on ``.precprof.lock`` (``fcntl.flock``: released by the kernel when the process dies,
so a killed run never leaves a stale lock), checks again under the lock, and writes a first summary.json with
status "incomplete": a run killed with SIGKILL, or whose final save fails, still says what it is. The writer
replaces that summary last (``precprof.pipeline``). ``release()`` removes the lock file while it still holds
it (a finished run leaves none); a claimer that locked the file just removed notices that it is no longer
the one in the directory and locks the new one. ``live_writer(path)`` names the process writing a run.

A claim of this process whose holder no longer writes it (``RunDir.writing``: a Profiler detached without saving,
the cell that made it run again) is taken over by a claim with ``overwrite`` or ``resume`` (``_take_over``); its
holder's claim ends there. Without either it is refused in one line saying so; a holder garbage-collected since
released it (``capture.unsaved.hold``). A holder still writing (a Profiler attached) is always refused.

``claim(path, resume=True)`` accepts a directory that holds a run and continues it: a run that streamed
(``precprof.parts``) keeps its stream, one that saved its tables has them adopted as the stream's first segment,
and the Profiler then records into a new segment.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import gc
import os
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from precprof import _atomic, parts
from precprof import tables as T
from precprof._version import __version__
from precprof.errors import UserError

try:  # POSIX; elsewhere a run directory is not locked (the other checks still hold)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".precprof.lock"
RUN_FILES: tuple[str, ...] = (T.SUMMARY_FILE, T.REPORT_FILE, *T.TABLE_FILES.values())
# the pages `precprof report RUN --target T` writes beside the run (report-<target>.html) render that run: they
# go when it is replaced; precprof's are told from a user's own page by the generator tag in their head
_TARGET_REPORT_GLOB = "report-*.html"
_GENERATOR = b'<meta name="generator" content="precprof '
_RUNNING_PREFIX = "running ("
RUNNING_REASON = (
    _RUNNING_PREFIX
    + "pid {pid}, started {started}); if it still says this, the process ended before it could save: "
    "killed (SIGKILL, out of memory; SIGTERM, as torchrun sends when another rank fails), or a script that "
    "never called prof.save() or prof.report()"
)


def _release(version: str) -> tuple[int, ...]:
    """The release numbers a version string starts with ("0.10.2rc1" -> (0, 10, 2)); () for none."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def _against_ours(summary: dict[str, Any]) -> int | None:
    """How the precprof that wrote ``summary`` compares with this one, by release numbers: -1 older, 0 the
    same, 1 newer; None when the summary names no version this can read."""
    theirs = summary.get(T.SUMMARY_VERSION)
    if not isinstance(theirs, str) or not _release(theirs):
        return None
    a, b = _release(theirs), _release(__version__)
    width = max(len(a), len(b))
    a, b = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (a > b) - (a < b)


def newer_version_note(run_dir: str | os.PathLike[str], summary: dict[str, Any]) -> str | None:
    """One line when ``summary`` (run_dir's) was written by a newer precprof than this one, else None: what
    that version recorded and this one does not know is not in the report this one renders."""
    if _against_ours(summary) != 1:
        return None
    return (
        f"{run_dir} was written by precprof {summary[T.SUMMARY_VERSION]} and this is precprof {__version__}: the "
        "report leaves out what the newer version recorded and this one does not know; upgrade precprof to see "
        "all of it"
    )


def older_advice_note(run_dir: str | os.PathLike[str], summary: dict[str, Any]) -> str | None:
    """One line when ``summary`` (run_dir's) holds a recommendation an older precprof made, else None: its
    advisor may have been wrong where this one is right, so the report advises again (``pipeline.rerender``),
    for the machine the run recorded."""
    if not summary.get(T.SUMMARY_RECOMMENDATION) or _against_ours(summary) != -1:
        return None
    return (
        f"{run_dir} was advised by precprof {summary[T.SUMMARY_VERSION]}; the report shows the advice of this "
        f"precprof ({__version__}), given now from the run's tables for the machine it recorded (summary.json "
        "keeps the old)"
    )


class RunDirError(UserError):
    """The run directory cannot be used: a file, not writable, holding a run, or in use by another process."""


def _holds_run(path: Path) -> list[str]:
    return [f for f in (*RUN_FILES, parts.STREAM_DIR) if (path / f).exists()]


def _target_reports(path: Path) -> list[Path]:
    """The pages of the run in ``path`` that ``precprof report --target`` wrote (``_TARGET_REPORT_GLOB``)."""
    found = []
    for page in path.glob(_TARGET_REPORT_GLOB):
        try:
            with open(page, "rb") as f:
                head = f.read(1024)
        except OSError:  # a folder of that name, or unreadable: not one precprof wrote
            continue
        if _GENERATOR in head:
            found.append(page)
    return found


def _own_traceback(path: Path) -> list[Path]:
    """The traceback.txt a run of the built-in loop left in ``path`` (``write_traceback``), told by its first
    line from a user's own file of that name; [] for none."""
    kept = path / T.TRACEBACK_FILE
    try:
        with open(kept, encoding="utf-8", errors="replace") as f:
            return [kept] if f.read(len(T.TRACEBACK_HEAD)) == T.TRACEBACK_HEAD else []
    except OSError:  # none, a folder of that name, unreadable
        return []


def write_traceback(path: str | os.PathLike[str], text: str) -> Path | None:
    """Write ``text``, the traceback of the error that stopped the run in ``path``, into its traceback.txt; None
    when it could not be written (a full disk) or a file of the user's has the name."""
    kept = Path(path) / T.TRACEBACK_FILE
    if kept.exists() and not _own_traceback(Path(path)):
        return None
    try:
        return _atomic.write_text(kept, T.TRACEBACK_HEAD + text)
    except OSError:
        return None


def _describe_existing(path: Path) -> str:
    """What ``path`` holds that a run would write over: a precprof run (its status), or, without a summary or a
    stream, files of someone else's under a run's names (a user's own layers.parquet is no precprof run)."""
    found = _holds_run(path)
    if T.SUMMARY_FILE not in found and parts.STREAM_DIR not in found:
        return f"{path} holds {', '.join(found)}, which a run writes over, but no precprof run (no {T.SUMMARY_FILE})"
    try:
        status = T.read_summary(path).get(T.SUMMARY_STATUS) or "no summary"
    except UserError:
        status = "damaged summary"
    return f"{path} already holds a precprof run ({status})"


def shown(path: str | os.PathLike[str]) -> str:
    """``path`` as one line shows it: bytes that are not UTF-8 as ``\\xff``, a very long name shortened."""
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return text if len(text) <= 100 else f"{text[:60]}...{text[-30:]}"


def check_name(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """Refuse, with a one-line RunDirError, a name no run directory should have: empty (it would be the
    current directory), blank, not UTF-8 (Arrow cannot open such a path, and the name goes into the summary and
    the report), or not ASCII where Python's file names are not UTF-8 (``LC_ALL=C PYTHONUTF8=0``: Arrow cannot
    open it either). Returns it as a Path; touches nothing."""
    raw = os.fsdecode(os.fspath(path))
    if raw == "":
        example = f"{option} runs/mine" if option.startswith("--") else f'{option}="runs/mine"'
        raise RunDirError(f"{option} is empty; give the directory to write the run to (e.g. {example})")
    if not raw.strip():
        raise RunDirError(f"{option} {raw!r} is blank; give the directory to write the run to")
    try:
        encoded = os.fsencode(raw)
    except (
        UnicodeEncodeError
    ):  # "runs/résumé" given as a str where file names are ASCII: Python cannot make it
        raise RunDirError(_not_ascii(raw, option)) from None
    try:
        encoded.decode("utf-8")
    except UnicodeDecodeError:
        raise RunDirError(
            f"{option} {shown(raw)!r}: the name is not valid UTF-8 (the tables cannot be written under it); "
            f"choose another {option}"
        ) from None
    try:
        raw.encode("utf-8")
    except (
        UnicodeEncodeError
    ):  # UTF-8 bytes read as surrogates (--out in an ASCII locale): Arrow refuses those
        raise RunDirError(_not_ascii(encoded.decode("utf-8"), option)) from None
    return Path(raw)


def _not_ascii(name: str, option: str) -> str:
    """The one line refusing a non-ASCII name where Python's file names are not UTF-8 (a C or POSIX locale with
    UTF-8 mode off, ``LC_ALL=C PYTHONUTF8=0``): Arrow, which writes the tables, cannot open it (training ran,
    then the save failed and nothing of the run was kept)."""
    return (  # (the name as ascii() writes it: the message prints where the locale is ASCII)
        f"{option} {name!a}: the name is not ASCII, and this Python's file names are "
        f"{sys.getfilesystemencoding()} (an ASCII locale with UTF-8 mode off), so the tables cannot be written "
        f"under it; choose an ASCII name, or run with PYTHONUTF8=1 (Python's UTF-8 mode)"
    )


def check_target(
    path: str | os.PathLike[str], *, overwrite: bool = False, option: str = "--out", resume: bool = False
) -> Path:
    """Refuse, with a one-line RunDirError, a run directory that cannot be used; leaves nothing behind. With
    ``resume`` a run already there is accepted (it is continued)."""
    p = check_name(path, option)
    try:
        return _check_target(p, overwrite=overwrite, option=option, resume=resume)
    except OSError as e:  # a name too long, a loop of symbolic links, a disk error while looking
        hint = (
            " (a name in it is longer than the file system allows, usually 255 bytes)"
            if e.errno == errno.ENAMETOOLONG
            else ""
        )
        raise RunDirError(f"{option} {shown(p)}: {e.strerror or e}{hint}; choose another {option}") from None


def _check_target(p: Path, *, overwrite: bool, option: str, resume: bool) -> Path:
    if p.exists() and not p.is_dir():
        raise RunDirError(f"{option} {p}: is a file, not a directory; choose another {option}")
    if p.is_dir():
        owner = live_writer(p)
        if owner == os.getpid() and _stale(p) is not None:  # a holder of this process that no longer writes
            if overwrite or resume:
                owner = None  # ``claim`` takes it over
            else:
                gc.collect()  # one in a reference cycle, out of reach: collected, it lets go (``unsaved.hold``)
                if _stale(p) is not None:
                    raise _stale_refusal(p, option)
                owner = live_writer(p)
        if owner is not None:  # first: replacing it would be refused too (it had said "add --overwrite")
            raise _busy(p, option, str(owner or "?"))
        if _holds_run(p) and not (overwrite or resume):
            held = _describe_existing(p)
            # (a Profiler's out: continued too, as a notebook cell run again after its first run stopped may mean)
            go_on = (
                f" ({_continue_it(p)})" if option == "out" and "already holds a precprof run" in held else ""
            )
            raise RunDirError(
                f"{option} {p}: {held}; choose another {option}, or {_replace_it(option)} to replace it{go_on}"
            )
        if not os.access(p, os.W_OK | os.X_OK):
            raise RunDirError(f"{option} {p}: the directory is not writable; choose another {option}")
        return p
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise RunDirError(f"{option} {p}: {parent} is a file, not a directory; choose another {option}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunDirError(
            f"{option} {p}: cannot create it, {parent} is not writable; choose another {option}"
        )
    _try_creating_in(parent, p, option)
    return p


def _try_creating_in(parent: Path, p: Path, option: str) -> None:
    """Make and remove an empty folder in ``parent``, where ``p`` would be created: permissions can say yes where
    the file system says no (root under /proc), and ``claim`` found it only after the model was built."""
    try:
        probe = tempfile.mkdtemp(prefix=".precprof-", suffix=_atomic.TMP_SUFFIX, dir=parent)
    except OSError as e:
        raise RunDirError(f"{option} {p}: cannot create it ({e.strerror}); choose another {option}") from None
    with contextlib.suppress(OSError):
        os.rmdir(probe)


def _always() -> bool:
    return True


@dataclass
class RunDir:
    """A claimed run directory. ``release()`` (or leaving the ``with`` block) drops the lock."""

    path: Path
    _fd: int | None = field(default=None, repr=False)
    created: bool = field(default=False, repr=False)  # the claim made the directory
    # whether its holder still writes the run (a Profiler attached: ``capture.unsaved.hold``); a claim of this
    # process whose holder does not is taken over by a claim with overwrite or resume (``_take_over``)
    writing: Callable[[], bool] = field(default=_always, repr=False)
    on_taken: Callable[[], None] | None = field(default=None, repr=False)  # told when it is taken over
    taken_over: bool = field(default=False, repr=False)

    def release(self) -> None:
        if self._fd is not None:
            if _held.get(_key(self.path)) is self:
                del _held[_key(self.path)]
            with contextlib.suppress(OSError):
                if _same_file(self._fd, self.path / LOCK_FILE):  # removed while held: no one else has it
                    (self.path / LOCK_FILE).unlink()
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def abandon(self) -> None:
        """Release a claim under which nothing was recorded (a Profiler's attach that failed before its first
        step), removing what the claim wrote: its first summary.json, the stream, the lock, and the directory
        when the claim made it and nothing else is in it. Left there, they read as a run (incomplete, "running
        ... killed") that the same code run again was refused over."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            (self.path / T.SUMMARY_FILE).unlink()
        parts.remove(self.path)
        self.release()
        if self.created:
            with contextlib.suppress(OSError):
                self.path.rmdir()  # only when empty: another claim may have come meanwhile

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


# this process's claims, by the directory's real path (``_key``): the one a claim over a holder of this process
# that no longer writes finds (``_stale``)
_held: dict[str, RunDir] = {}


def _key(path: Path) -> str:
    return os.path.realpath(path)


def _stale(path: Path) -> RunDir | None:
    """This process's claim of ``path`` when its holder no longer writes it (``RunDir.writing``), else None."""
    run = _held.get(_key(path))
    if run is None or run._fd is None:
        return None
    try:
        writing = run.writing()
    except Exception:  # (a holder that cannot say: taken as writing, never stolen from)
        writing = True
    return None if writing else run


def _take_over(run: RunDir) -> None:
    """End ``run``, a claim of this process whose holder no longer writes it, for a claim with overwrite or
    resume: its holder no longer owns the directory (a save of its own is refused: ``capture.unsaved``)."""
    run.taken_over = True
    run.release()
    if run.on_taken is not None:
        with contextlib.suppress(Exception):  # (its stream's writer process given back)
            run.on_taken()


def _stale_refusal(path: Path, option: str) -> RunDirError:
    """The refusal of ``path``, held by a claim of this process whose holder no longer writes it, without
    overwrite or resume: what each does, and the holder's own save."""
    resume = f", {_continue_it(path)}" if option == "out" else ""
    return RunDirError(
        f"{option} {path}: a Profiler of this process that is no longer attached (a cell run again, a loop that "
        f"stopped) holds this run directory's run, not saved; {_replace_it(option)} to replace that run{resume}, "
        f"or choose another {option} (that Profiler's save(), if you still have it, saves the run first)"
    )


def _recorded_steps(run_dir: Path) -> list[int]:
    """The steps the run in ``run_dir`` recorded (its stream's, else its steps table's); [] when none or unread."""
    steps: list[int] = []
    with contextlib.suppress(Exception):  # (said in words, never at the cost of the refusal or the attach)
        read = parts.read_stream(run_dir, ("steps",), T.STEP)
        table = parts.concat(read.tables.get("steps") or [])
        steps = table.column(T.STEP).to_pylist() if table is not None and table.num_rows else []
        whole = run_dir / T.TABLE_FILES["steps"]
        if not steps and whole.exists():
            steps = pd.read_parquet(whole, columns=[T.STEP])[T.STEP].tolist()
    return [int(s) for s in steps]


def _continue_it(run_dir: Path | None) -> str:
    """How a Profiler's ``out`` continues the run in ``run_dir``: from the step after its last recorded one
    (``first_step`` left at 0, the new attempt's steps had replaced the run's); in words where that step is not
    known (None: a run still being written)."""
    steps = _recorded_steps(run_dir) if run_dir is not None else []
    first = str(max(steps) + 1) if steps else " the step after its last,"
    return f"resume=True, first_step={first} to continue it"


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd`` (not removed, not replaced by another)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lock(path: Path, option: str) -> int:
    lock = path / LOCK_FILE
    for _ in range(100):  # each retry means another process released the directory meanwhile
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(
                f"{option} {path}: not writable ({e.strerror}); choose another {option}"
            ) from None
        if fcntl is None:
            break
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise RunDirError(f"{option} {path}: cannot lock it ({e.strerror})") from None
            try:
                owner = os.read(fd, 64).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise _busy(path, option, owner) from None
        if _same_file(fd, lock):
            break
        os.close(fd)  # the holder removed it between our open and our lock: lock the one there now
    else:
        raise RunDirError(f"{option} {path}: cannot lock it (its lock file keeps changing); try again")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _busy(path: Path, option: str, owner: str) -> RunDirError:
    """The refusal of a run directory whose lock ``owner`` (a pid, "?" when the lock does not say) holds."""
    if owner == str(os.getpid()):  # a Profiler of this process attached to it (``_stale``: one that is not)
        # (a save while attached is a snapshot: the directory stays the Profiler's. Once detached, saved or not,
        # another claim replaces or continues its run when told to: "save it first" alone led to a second
        # refusal, then a third; and "prof.detach()" named the Profiler just refused, where the cell bound it)
        resume = f" ({_continue_it(None)})" if option == "out" else ""
        return RunDirError(
            f"{option} {path}: a Profiler in this process is still writing this run directory (it is attached); "
            f"choose another {option}, or call that Profiler's detach() first, then {_replace_it(option)} to "
            f"replace its run{resume}"
        )
    return RunDirError(
        f"{option} {path}: another precprof process (pid {owner}) is writing this run directory; "
        f"wait for it or choose another {option}"
    )


def _replace_it(option: str) -> str:
    """How to replace a run, said in the words of where ``option`` came from: the CLI's flag, or the keyword."""
    return "add --overwrite" if option.startswith("--") else "pass overwrite=True"


def live_writer(path: str | os.PathLike[str]) -> int | None:
    """The process id of the precprof process writing run directory ``path`` now (0 when its lock does not
    say), None when none is: a run still training, or a Profiler that streams into it and has not saved.
    Reads the lock and takes none (creates nothing)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(Path(path) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            text = os.read(fd, 64).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        return None  # no one holds it: the process ended (a killed run leaves its lock file, unheld)
    finally:
        os.close(fd)


def says_running(summary: Mapping[str, Any]) -> bool:
    """Whether ``summary`` is a claim's first one, "running (pid ...)" (``RUNNING_REASON``), not a cause written
    since (an exception that stopped the Profiler before it saved: ``capture.unsaved``; a save that failed)."""
    reason = summary.get(T.SUMMARY_INCOMPLETE_REASON)
    return isinstance(reason, str) and reason.startswith(_RUNNING_PREFIX)


def ended_unsaved(summary: Mapping[str, Any]) -> str:
    """The cause a report gives for a run whose summary.json still says "running (pid ...)" (``says_running``)
    when no process holds its directory (``live_writer``: its lock is free): the process that recorded it ended
    before it saved. summary.json stays as written (a report never rewrites it); its page said "running (pid
    18707, ...)" of a process that was gone (tester t1: a ``precprof train`` killed with SIGKILL)."""
    reason = str(summary.get(T.SUMMARY_INCOMPLETE_REASON) or "")
    m = re.match(re.escape(_RUNNING_PREFIX) + r"(pid \d+, started [^)]*)\)", reason)
    return (
        f"The process that recorded it{f' ({m.group(1)})' if m else ''} ended before it could save, and no process "
        "holds the run directory now: killed (SIGKILL, out of memory; SIGTERM, as torchrun sends when another rank "
        "fails), or a script that never called prof.save() or prof.report()"
    )


def stopped_note(path: str | os.PathLike[str]) -> str | None:
    """One line when run directory ``path`` is held by a live process (``live_writer``) whose Profiler stopped
    before it saved the run: its summary.json gives the cause (an exception in a ``with Profiler(...)`` block,
    in a notebook or a script that goes on) in place of "running". Nothing more is written to it: a report of
    it is of a stopped run, not of one "still in progress" that "writes its own report when it ends" (it never
    does unless ``prof.save()`` is called). None otherwise."""
    try:
        summary = T.read_summary(Path(path))
    except (OSError, UserError):
        return None
    if summary.get(T.SUMMARY_STATUS) != T.STATUS_INCOMPLETE or says_running(summary):
        return None
    pid = live_writer(path)
    if pid is None:
        return None
    who = f"process {pid}" if pid else "another process"
    return (
        f"{path} is held by {who}, whose Profiler stopped before saving it: nothing more is written to it; "
        "prof.save() in that process saves the steps recorded as the run, and the process's end releases it"
    )


def live_note(
    path: str | os.PathLike[str], last_step: int | None = None, recording: bool = False, streamed: bool = True
) -> str | None:
    """One line when run directory ``path`` is still being written (``live_writer``), else None. ``recording``:
    by the Profiler whose own report this is (``Profiler.report`` while attached), which the line speaks to;
    ``streamed=False``: a Profiler without ``out``, whose snapshot in ``path`` is all of the run there until
    it saves again. A run held by a Profiler that stopped before saving it gets ``stopped_note``'s line."""
    if recording:
        upto = f"as of step {last_step}" if last_step is not None else "before its first step"
        if not streamed:
            return (
                f"{path} is still recording: this run is a snapshot {upto}, saved while the Profiler was attached; "
                "its later steps are in memory only: save or report again after prof.detach() for the finished run"
            )
        return (
            f"{path} is still recording: this report is a snapshot {upto}, and the Profiler goes on streaming "
            "into the run; call prof.report() again for more, and after prof.detach() for the finished run"
        )
    stopped = stopped_note(path)
    if stopped is not None:
        return stopped
    pid = live_writer(path)
    if pid is None:
        return None
    who = f"process {pid}" if pid else "another process"
    upto = f", up to step {last_step}" if last_step is not None else ""
    return (
        f"{path} is still being written by {who}: this report shows the steps streamed so far{upto}; "
        f"run precprof report again for more (the run writes its own report when it ends)"
    )


def claim(
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    summary: dict[str, Any] | None = None,
    option: str = "--out",
    resume: bool = False,
) -> RunDir:
    """Create and lock ``path`` for this process and write its first summary.json (status incomplete).

    With ``overwrite`` the files of a previous run (summary, tables, report, the reports for other machines,
    its traceback, stream, temporary files) are removed first; other files in the directory are never
    touched. With ``resume`` a previous run is kept and continued (the module docstring), but not the
    traceback.txt of the error that stopped it: it is not the resumed attempt's. Raises RunDirError with a
    one-line reason.
    """
    p = check_target(path, overwrite=overwrite, option=option, resume=resume)
    created = not p.exists()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{option} {p}: cannot create it ({e.strerror}); choose another {option}") from None
    idle = _stale(p)
    if idle is not None and (overwrite or resume):  # (``check_target`` refused it without either)
        _take_over(idle)
    fd = _lock(p, option)
    run = RunDir(p, fd, created)
    _held[_key(p)] = run
    try:
        for stale in p.iterdir():
            if _atomic.is_tmp(stale):
                with contextlib.suppress(OSError):
                    shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
        if resume:
            _adopt_saved_tables(p)
        elif _holds_run(p):  # again under the lock: another process may have finished a run here meanwhile
            if not overwrite:
                raise RunDirError(
                    f"{option} {p}: {_describe_existing(p)}; choose another {option}, or {_replace_it(option)}"
                )
            for path in (*(p / name for name in RUN_FILES), *_target_reports(p), *_own_traceback(p)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            parts.remove(p)
        # the traceback of an error that stopped an earlier attempt (a run resumed after a crash, a run's files
        # removed by hand) is not this one's: a resumed run that completed kept it beside its complete summary
        for path in _own_traceback(p):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        first = dict(summary or {})
        first[T.SUMMARY_STATUS] = T.STATUS_INCOMPLETE
        first[T.SUMMARY_INCOMPLETE_REASON] = RUNNING_REASON.format(
            pid=os.getpid(), started=datetime.datetime.now().isoformat(timespec="seconds")
        )
        try:
            T.write_summary(p, first)
        except OSError as e:
            raise RunDirError(
                f"{option} {p}: cannot write to it ({e.strerror}); choose another {option}"
            ) from None
    except BaseException:
        run.release()
        raise
    return run


def _adopt_saved_tables(p: Path) -> None:
    """A run being resumed that saved its tables (stopped by SIGTERM, say) gets them as its stream's first
    segment, from the sampling origin its summary recorded; a run that streamed keeps its stream."""
    files = {n: p / f for n, f in T.TABLE_FILES.items() if (p / f).exists()}
    if parts.has_stream(p) or not files:
        return
    try:
        capture = T.read_summary(p).get(T.SUMMARY_CAPTURE) or {}
    except UserError:
        capture = {}
    origin = capture.get("sample_origin")
    start = int(origin) if isinstance(origin, int) else 0
    parts.adopt_tables(p, files, start, T.to_arrow("steps", T.empty("steps")))
    for path in files.values():  # in the stream now: a table file beside a stream is read in its place
        path.unlink()


def warn_replaced(run_dir: Path) -> None:
    """``resume=True`` at step 0 (``first_step`` left out) replaces every step the run recorded: said, with
    the fix, when it recorded some (a job restarted from a checkpoint means to keep the steps before it)."""
    steps = _recorded_steps(run_dir)
    if steps:
        warnings.warn(
            f"precprof: resume=True with first_step=0 replaces the {len(steps):,} steps {run_dir} recorded "
            f"({min(steps)}-{max(steps)}): pass first_step=<the step of the checkpoint the run resumes from> "
            "to keep the steps before it",
            stacklevel=5,
        )


def claim_new(base: str | os.PathLike[str], *, summary: dict[str, Any] | None = None) -> RunDir:
    """Claim ``base``, or ``base-2``, ``base-3``... whichever does not exist yet (for default run names:
    two runs started in the same second get two directories)."""
    base = Path(base)
    for i in range(1, 1000):
        candidate = base if i == 1 else base.with_name(f"{base.name}-{i}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            continue
        except OSError as e:
            raise RunDirError(
                f"cannot create the run directory {candidate} ({e.strerror}); use --out"
            ) from None
        run = claim(candidate, summary=summary)
        run.created = True  # made here: abandon() removes it
        return run
    raise RunDirError(f"cannot find a free run directory name next to {base}; use --out")

"""Where the compiled CPU kernel lives, and why a library found there can be trusted to load.

A shared library loaded with ``ctypes`` runs inside the training process, so the cache follows these rules:

- the folder is per user: ``PRECPROF_CACHE_DIR``, else ``$XDG_CACHE_HOME/precprof`` or ``~/.cache/precprof``
  (``~/Library/Caches/precprof`` on macOS), created with mode 0700 and checked before every use: a real
  directory (``lstat``: not a symlink), owned by this user, writable by nobody else, in a parent folder that
  no other user can rename it out of (owned by this user or root, and not writable by others unless sticky,
  as /tmp is). A folder that fails is not used: the build goes to a fresh private ``tempfile.mkdtemp()``
  folder for this process instead (removed at exit), with a warning naming the folder and the problem;
- the key names everything the build depends on (``precprof.stats.kernel.cache_key``);
- a build happens in a fresh temporary folder inside the cache folder (same file system) and is moved into
  place with ``os.replace``, under an exclusive lock on the key's lock file (``flock``; ``msvcrt.locking``
  where there is no fcntl): torchrun ranks starting together build once, the others wait and load the result;
- a library is loaded only when it is a regular file owned by this user, writable by nobody else, and its
  SHA-256 equals the one this user recorded when building it (``<name>.sha256`` beside it, moved into place
  the same way and held to the same checks). Both are opened with ``O_NOFOLLOW`` and checked with ``fstat``
  on the descriptor that is hashed, so the checks and the hash see the same file. Anything else is rebuilt,
  never loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from precprof._notice import notice

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]
try:
    import msvcrt
except ImportError:
    msvcrt = None  # type: ignore[assignment]

_ENV_DIR = "PRECPROF_CACHE_DIR"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# O_NONBLOCK: a FIFO planted under a checked name must not block the open (fstat then refuses it)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_fallback: Path | None = None
_refused: str | None = None


def default_dir() -> Path:
    """The platform's per-user cache folder for precprof (not created here)."""
    if os.environ.get(_ENV_DIR):
        return Path(os.environ[_ENV_DIR])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "precprof"
    base = os.environ.get("XDG_CACHE_HOME", "")
    # unset, or relative (the XDG spec says to ignore it: it made a cache, and a build, per working folder)
    if not os.path.isabs(base):
        base = str(Path.home() / ".cache")
    return Path(base) / "precprof"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else -1


def _stat_reason(st: os.stat_result, *, directory: bool) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if not hasattr(os, "getuid"):  # pragma: no cover - Windows: ACLs, not mode bits, say who may write
        return None
    if st.st_uid != _uid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def unsafe_reason(path: Path, *, directory: bool) -> str | None:
    """Why ``path`` cannot be trusted (None when it can): not there, a symlink, the wrong kind, another
    owner, writable by group or others. Reads ``lstat``: a symlink is never followed."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    return _stat_reason(st, directory=directory)


def _parent_reason(path: Path) -> str | None:
    """Why the folder holding ``path`` would let another user swap ``path`` for a folder of theirs (None when
    it would not): owned by someone other than this user or root, or writable by group or others without
    the sticky bit. The parent itself may be a symlink (a cache on another disk): its target is judged."""
    if not hasattr(os, "getuid"):  # pragma: no cover - Windows
        return None
    parent = Path(os.path.abspath(path)).parent
    try:
        st = os.stat(parent)
    except OSError as e:
        return f"is in {parent}, which cannot be examined ({e.strerror})"
    if st.st_uid not in (_uid(), 0):
        return f"is in {parent}, owned by uid {st.st_uid}, who could replace it"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        return f"is in {parent}, which other users can write (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def cache_dir() -> Path:
    """The checked per-user cache folder, created 0700; a private temporary folder when it fails the checks.

    Invariant: the folder returned is a real directory owned by this user that no other user can write or
    rename, so nothing in it was put there by someone else.
    """
    global _fallback, _refused
    d = default_dir()
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:  # a file there "is not a directory", as precprof env says, not "File exists"
        there = os.path.lexists(d) and unsafe_reason(d, directory=True)
        why: str | None = there or f"cannot be created ({e.strerror})"
    else:
        why = unsafe_reason(d, directory=True) or _parent_reason(d)
    if why is None:
        _refused = None
        return d
    _refused = f"{d} {why}"
    if _fallback is None:
        _fallback = Path(tempfile.mkdtemp(prefix="precprof-kernel-"))
        # private to this process: nothing in it is worth keeping, and a loaded library stays mapped
        atexit.register(shutil.rmtree, _fallback, ignore_errors=True)
        # (after the fallback is in place, and never raised: python -W error must not stop the attach here)
        notice(
            f"precprof: the kernel cache {d} {why}; building in the private folder {_fallback} instead "
            f"(set {_ENV_DIR} to a folder only you can write)",
            RuntimeWarning,
        )
    return _fallback


def refusal() -> str | None:
    """Why the last ``cache_dir()`` call refused the per-user folder (None when it used it, or was not called)."""
    return _refused


def describe() -> tuple[Path, str]:
    """The per-user cache folder and its state in words, for ``precprof env``; creates nothing."""
    d = default_dir()
    if not os.path.lexists(d):
        return d, "not created yet: made on first use, mode 0700"
    why = unsafe_reason(d, directory=True) or _parent_reason(d)
    if why is not None:
        return d, f"not used: it {why}; the kernel is built in a private temporary folder instead"
    return d, "private to this user"


def compiler_identity(cc: str) -> str:
    """The compiler's resolved path and the first line of its ``--version`` (part of the cache key)."""
    path = shutil.which(cc) or cc
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
        first = (out.stdout or out.stderr).strip().splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        first = []
    return f"{os.path.realpath(path)} {first[0] if first else '?'}"


def _open_private(path: Path) -> BinaryIO | None:
    """``path`` opened for reading when it is a regular file of this user that only this user can write, else
    None. The checks run on the opened descriptor (``O_NOFOLLOW``, ``fstat``): what is read is what passed."""
    if unsafe_reason(path, directory=False) is not None:  # refuses a FIFO or device before opening it
        return None
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | getattr(os, "O_BINARY", 0))
    except OSError:
        return None
    f = os.fdopen(fd, "rb")
    if _stat_reason(os.fstat(fd), directory=False) is not None:
        f.close()
        return None
    return f


def _sha256(f: BinaryIO) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def trusted(lib: Path) -> bool:
    """Whether ``lib`` is a library this user built here: both it and its record ``<name>.sha256`` pass the
    checks of ``_open_private``, and its SHA-256 equals the recorded one."""
    record = _open_private(lib.with_suffix(".sha256"))
    if record is None:
        return False
    with record:
        recorded = record.read(256).decode("ascii", errors="replace").strip()
    f = _open_private(lib)
    if f is None:
        return False
    with f:
        return _sha256(f) == recorded


def _lock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)  # waits for a build in progress in another process
    elif msvcrt is not None:  # pragma: no cover - Windows
        for _ in range(60):  # LK_LOCK retries for about 10 s before it raises: wait up to 10 minutes
            try:
                msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
                return
            except OSError:
                continue
        # still held: build without it; the atomic rename keeps every library whole, at worst built twice


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    try:
        _lock(fd)
        yield
    finally:
        if fcntl is None and msvcrt is not None:  # pragma: no cover - Windows: unlock before closing
            with contextlib.suppress(OSError):
                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        os.close(fd)  # releases a flock


def build(name: str, key: str, compile_to: Callable[[Path], None]) -> Path:
    """The path of a trusted library ``<name>_<key>.so`` in the cache, building it with ``compile_to(path)``
    when there is none (or the one there fails ``trusted``). Raises what ``compile_to`` raises.

    Invariant: the path returned passed ``trusted`` after the build lock was released; a library that
    fails it is replaced by a fresh build, never returned.
    """
    d = cache_dir()
    lib = d / f"{name}_{key}.so"
    with _locked(d / f"{name}_{key}.lock"):
        if trusted(lib):
            return lib
        work = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=d))
        try:
            tmp = work / lib.name
            compile_to(tmp)
            with open(tmp, "rb") as f:
                digest = _sha256(f)
            os.chmod(tmp, 0o700)
            record = work / "record"
            record.write_text(digest + "\n")
            os.chmod(record, 0o600)
            for stale in (lib, lib.with_suffix(".sha256")):  # a planted file is replaced, never loaded
                with contextlib.suppress(FileNotFoundError):
                    if stale.is_dir() and not stale.is_symlink():
                        shutil.rmtree(stale)
                    else:
                        stale.unlink()
            os.replace(record, lib.with_suffix(".sha256"))
            os.replace(tmp, lib)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if not trusted(lib):  # cannot happen in a folder only this user writes; never load it if it does
        raise OSError(f"{lib} changed while it was being built")
    return lib

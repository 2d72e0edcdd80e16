"""Where the compiled CPU kernel lives, and why a library found there can be trusted to load.

A shared library loaded with ``ctypes`` runs inside the training process, so the cache follows these rules:

- the folder is per user: ``PRECPROF_CACHE_DIR``, else ``$XDG_CACHE_HOME/precprof`` or ``~/.cache/precprof``
  (``~/Library/Caches/precprof`` on macOS), created with mode 0700 and checked before every use: a real
  directory (not a symlink), owned by this user, writable by nobody else. A folder that fails is not used: the
  build goes to a fresh private ``tempfile.mkdtemp()`` folder for this process instead, with a warning;
- the key names everything the build depends on: the source, the compiler's resolved path and the first
  line of its ``--version``, the flags, the CPU's instruction set;
- a build happens in a fresh temporary folder inside the cache folder (same file system) and is moved into
  place with ``os.replace``, under an exclusive ``flock`` on the key's lock file: torchrun ranks starting
  together build once, the others wait and load the result;
- a library is loaded only when it is a regular file owned by this user, writable by nobody else, and its
  SHA-256 equals the one this user recorded when building it (``<name>.sha256`` beside it, written the same
  way). Anything else is rebuilt, never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock, the atomic rename alone keeps builds whole
    fcntl = None  # type: ignore[assignment]

_ENV_DIR = "PRECPROF_CACHE_DIR"
_fallback: Path | None = None


def default_dir() -> Path:
    """The platform's per-user cache folder for precprof (not created here)."""
    if os.environ.get(_ENV_DIR):
        return Path(os.environ[_ENV_DIR])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "precprof"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "precprof"


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else -1


def unsafe_reason(path: Path, *, directory: bool) -> str | None:
    """Why ``path`` cannot be trusted (None when it can): not there, a symlink, the wrong kind, another
    owner, writable by group or others."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be examined ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if hasattr(os, "getuid") and st.st_uid != _uid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def cache_dir() -> Path:
    """The checked per-user cache folder, created 0700; a private temporary folder when it fails the checks."""
    global _fallback
    d = default_dir()
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        why: str | None = f"cannot be created ({e.strerror})"
    else:
        why = unsafe_reason(d, directory=True)
    if why is None:
        return d
    if _fallback is None:
        _fallback = Path(tempfile.mkdtemp(prefix="precprof-kernel-"))
        warnings.warn(
            f"precprof: the kernel cache {d} {why}; building in the private folder {_fallback} instead "
            f"(set {_ENV_DIR} to a folder only you can write)",
            RuntimeWarning,
            stacklevel=3,
        )
    return _fallback


def compiler_identity(cc: str) -> str:
    """The compiler's resolved path and the first line of its ``--version`` (part of the cache key)."""
    path = shutil.which(cc) or cc
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
        first = (out.stdout or out.stderr).strip().splitlines()[:1]
    except (OSError, subprocess.SubprocessError):
        first = []
    return f"{os.path.realpath(path)} {first[0] if first else '?'}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def trusted(lib: Path) -> bool:
    """Whether ``lib`` is a library this user built here: see the module docstring."""
    record = lib.with_suffix(".sha256")
    if unsafe_reason(lib, directory=False) or unsafe_reason(record, directory=False):
        return False
    try:
        return record.read_text().strip() == _sha256(lib)
    except OSError:
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits for a build in progress in another process
        yield
    finally:
        os.close(fd)  # releases the lock


def build(name: str, key: str, compile_to: Callable[[Path], None]) -> Path:
    """The path of a trusted library ``<name>_<key>.so`` in the cache, building it with ``compile_to(path)``
    when there is none (or the one there fails ``trusted``). Raises what ``compile_to`` raises."""
    d = cache_dir()
    lib = d / f"{name}_{key}.so"
    with _locked(d / f"{name}_{key}.lock"):
        if trusted(lib):
            return lib
        work = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=d))
        try:
            tmp = work / lib.name
            compile_to(tmp)
            digest = _sha256(tmp)
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

"""Atomic file writes: a reader (or a crash, or a full disk) never sees half a file.

Each file is written to a temporary name in its own folder (so the rename stays on one file system), flushed
to disk, and renamed over the target with ``os.replace``. On any failure the temporary file is removed and
the target is left as it was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

TMP_SUFFIX = ".tmp"


def tmp_name(path: Path) -> Path:
    """The temporary name for ``path``: hidden, per process, recognisable by ``is_tmp``."""
    return path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")


def is_tmp(path: Path) -> bool:
    """True for a temporary file left by ``tmp_name`` (a crash between write and rename)."""
    return path.name.startswith(".") and path.name.endswith(TMP_SUFFIX)


@contextlib.contextmanager
def replacing(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path``, on failure it is removed."""
    target = Path(path)
    tmp = tmp_name(target)
    try:
        yield tmp
        with open(tmp, "rb+") as f:  # the data on disk before the rename makes it visible
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically."""
    with replacing(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def utf8(text: str) -> bytes:
    """``text`` as UTF-8. A name read from the file system that is not UTF-8 holds lone surrogates
    (``os.fsdecode``'s escapes of its bytes), which UTF-8 cannot encode: each such byte becomes U+FFFD."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that is no escaped byte
            raw = text.encode("utf-8", "replace")
        return raw.decode("utf-8", "replace").encode("utf-8")


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` (UTF-8, see ``utf8``) to ``path`` atomically."""
    return write_bytes(path, utf8(text))


def write_with(path: str | os.PathLike[str], writer: Callable[[Path], object]) -> Path:
    """Call ``writer(tmp_path)`` (e.g. ``df.to_parquet``) and move the result to ``path`` atomically."""
    with replacing(path) as tmp:
        writer(tmp)
    return Path(path)

"""The libraries precprof imports for the user (transformers for ``hf:`` models, torchao for ``--precision fp8``),
imported without the log lines their imports print about themselves.

transformers' modeling code imports torchao (``transformers.quantizers``), and torchao's import logs a warning
per compiled extension this torch cannot load (``Failed to load .../torchao/_C_mxfp8...so``) and registers two
enums as pytree constants, which torch logs as deprecated (``torch/utils/_pytree.py:630] <enum
'KernelPreference'> is an Enum subclass ...``). Neither is about the user's run, nor anything the user can
change. Only those loggers are quietened, only while precprof imports, and their levels are restored after: a
warning they log later, and every other logger and Python warning, shows as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

# the loggers of the import-time lines above; a logger's children (torchao.float8, ...) follow its level
IMPORT_NOISE = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Drop what the ``IMPORT_NOISE`` loggers log below ERROR while the block runs, then restore their levels."""
    loggers = [logging.getLogger(name) for name in IMPORT_NOISE]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)

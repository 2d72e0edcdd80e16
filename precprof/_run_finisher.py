"""The function ``Profiler.save`` hands a finished (or crashed) run to: ``precprof.pipeline.finish_run``, which
registers itself here when it is imported (``import precprof`` imports it).

A module of its own, without torch: the recorder (``precprof.capture``) depends on nothing downstream of it, and
the pipeline, which `precprof report` loads, never imports the recorder (nor torch) to register."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RunFinisher = Callable[..., dict[str, Any]]
_finisher: RunFinisher | None = None


def set_run_finisher(finisher: RunFinisher) -> None:
    """Register the function ``Profiler.save`` hands a finished (or crashed) run to."""
    global _finisher
    _finisher = finisher


def run_finisher() -> RunFinisher | None:
    """The registered function, None before ``precprof.pipeline`` is imported."""
    return _finisher

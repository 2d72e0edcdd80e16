"""The two functions the recorder hands run directories to, registered here by ``precprof.pipeline`` when it is
imported (the first time a run needs one of them, if nothing imported it before):

- the run finisher, ``precprof.pipeline.finish_run``: what ``Profiler.save`` hands a finished (or crashed) run to;
- the machine describer: the ``hardware`` block a streamed run directory's first summary records, so that a run
  killed before it finished is still planned for the machine it ran on, not for the one that reads it;
- the run renderer, ``precprof.pipeline.rerender``: what ``Profiler.report`` hands a run it still records into
  (``out``) to, for a page of the steps streamed so far (the stream goes on; the run is not finished).

A module of its own, without torch: the recorder (``precprof.capture``) depends on nothing downstream of it, and
the pipeline, which `precprof report` loads, never imports the recorder (nor torch) to register."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

RunFinisher = Callable[..., dict[str, Any]]
MachineDescriber = Callable[[str | None], dict[str, Any]]
RunRenderer = Callable[..., Path]
_finisher: RunFinisher | None = None
_describer: MachineDescriber | None = None
_renderer: RunRenderer | None = None


def set_run_finisher(finisher: RunFinisher) -> None:
    """Register the function ``Profiler.save`` hands a finished (or crashed) run to."""
    global _finisher
    _finisher = finisher


def _load_pipeline() -> None:
    """Import ``precprof.pipeline``, which registers the three functions: ``import precprof`` leaves it (pandas, Arrow,
    the report, the advisor) to the first run that ends or streams, so that the command line can load it under
    its own Ctrl-C handler (``precprof.__main__``)."""
    if _finisher is None or _describer is None or _renderer is None:
        import precprof.pipeline  # noqa: F401


def run_finisher() -> RunFinisher | None:
    """The registered function (``precprof.pipeline`` is imported for it when nothing did before)."""
    _load_pipeline()
    return _finisher


def set_machine_describer(describer: MachineDescriber) -> None:
    """Register the function that gives a run's first summary its machine (device string -> summary entries)."""
    global _describer
    _describer = describer


def machine_describer() -> MachineDescriber | None:
    """The registered function (``precprof.pipeline`` is imported for it when nothing did before)."""
    _load_pipeline()
    return _describer


def set_run_renderer(renderer: RunRenderer) -> None:
    """Register the function that renders a run still being recorded from its stream (run directory -> page)."""
    global _renderer
    _renderer = renderer


def run_renderer() -> RunRenderer | None:
    """The registered function (``precprof.pipeline`` is imported for it when nothing did before)."""
    _load_pipeline()
    return _renderer

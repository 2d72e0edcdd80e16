"""precprof: a precision profiler for mixed-precision training of PyTorch models.

Public API::

    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=10)
    with prof:
        ...
        prof.step(loss=loss)
    prof.tables()            # dict of pandas DataFrames: layers, histograms, steps, memory
    prof.save("runs/x")      # run directory; prof.report("runs/x/report.html")
    precprof.recommend("runs/x")

Each name is loaded when first used: ``precprof.Profiler`` imports torch, which reading run directories
(`precprof report`, ``recommend``) never needs; ``recommend`` and ``Recommendation`` import pandas, Arrow and
the report. ``import precprof`` itself loads nothing else, so that the command line loads
its modules under its own Ctrl-C handler (``precprof.__main__``); in a process that loaded torch before it, it
loads ``precprof.clipwatch`` (torch's ``clip_grad_norm_`` wrapped, a pass-through while no Profiler is
attached), so that a function compiled after ``import precprof`` and before the first Profiler never sees the
function change.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from precprof._version import __version__

if "torch" in sys.modules:  # cheap then: torch.nn.utils is loaded
    from precprof import clipwatch as _clipwatch  # noqa: F401

if TYPE_CHECKING:
    from precprof.analysis.advisor import Recommendation, recommend
    from precprof.capture import Profiler

__all__ = ["Profiler", "Recommendation", "__version__", "recommend"]

_FROM_PIPELINE = ("Recommendation", "recommend")


def __getattr__(name: str) -> Any:
    if name == "Profiler":
        from precprof.capture import Profiler  # imports torch

        globals()["Profiler"] = Profiler
        return Profiler
    if name in _FROM_PIPELINE:
        from precprof import pipeline  # registers itself as the way Profiler.save ends a run

        found = {
            "Recommendation": pipeline.advisor.Recommendation,
            "recommend": pipeline.advisor.recommend,
        }
        globals().update(found)
        return found[name]
    raise AttributeError(f"module 'precprof' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

"""precprof: a precision profiler for mixed-precision training of PyTorch models.

Public API::

    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=10)
    with prof:
        ...
        prof.step(loss=loss)
    prof.tables()            # dict of pandas DataFrames: layers, histograms, steps, memory
    prof.save("runs/x")      # run directory; prof.report("runs/x/report.html")
    precprof.recommend("runs/x")

``precprof.Profiler`` is loaded when first used: reading run directories (`precprof report`, ``recommend``)
never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from precprof._version import __version__
from precprof.analysis.advisor import Recommendation, recommend
from precprof.pipeline import finish_run  # registers itself as the way Profiler.save ends a run

if TYPE_CHECKING:
    from precprof.capture import Profiler

__all__ = ["Profiler", "Recommendation", "__version__", "finish_run", "recommend"]


def __getattr__(name: str) -> Any:
    if name == "Profiler":
        from precprof.capture import Profiler  # imports torch

        globals()["Profiler"] = Profiler
        return Profiler
    raise AttributeError(f"module 'precprof' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

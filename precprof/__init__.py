"""precprof: a precision profiler for mixed-precision training of PyTorch models.

Public API::

    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=10)
    with prof:
        ...
        prof.step(loss=loss)
    prof.tables()            # dict of pandas DataFrames: layers, histograms, steps, memory
    prof.save("runs/x")      # run directory; prof.report("runs/x/report.html")
    precprof.recommend("runs/x")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Profiler", "Recommendation", "__version__", "recommend"]

if TYPE_CHECKING:
    from precprof.advisor import Recommendation, recommend
    from precprof.capture import Profiler


def __getattr__(name: str) -> Any:
    # Lazy so that `import precprof` stays cheap and the CLI can print errors before heavy imports.
    if name == "Profiler":
        from precprof.capture import Profiler

        return Profiler
    if name in ("recommend", "Recommendation"):
        from precprof import advisor

        return getattr(advisor, name)
    raise AttributeError(f"module 'precprof' has no attribute {name!r}")

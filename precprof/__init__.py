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

from precprof._version import __version__
from precprof.analysis.advisor import Recommendation, recommend
from precprof.capture import Profiler
from precprof.pipeline import finish_run  # registers itself as the way Profiler.save ends a run

__all__ = ["Profiler", "Recommendation", "__version__", "finish_run", "recommend"]

"""Capture: the Profiler and what it records with (hooks, weight-update samples, the scaler wrapper, memory per
component, the rank reducer). It records and returns tables and a summary; writing a run directory is the
pipeline's (``set_run_finisher``)."""

from precprof._run_finisher import set_run_finisher
from precprof.capture.plan import iter_module_names
from precprof.capture.profiler import ModuleFilter, Profiler

__all__ = ["ModuleFilter", "Profiler", "iter_module_names", "set_run_finisher"]

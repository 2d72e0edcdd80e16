"""Dashboards: the recorded tables as TensorBoard events and wandb logs, live (``Profiler(tensorboard=...,
wandb=...)``) or from a run directory (``precprof export``). The tags are described in
precprof.export.events."""

from __future__ import annotations

from precprof.export.events import EventStream, Histogram, Scalar, table_events
from precprof.export.live import LiveDashboards
from precprof.export.run import export_run
from precprof.export.tensorboard import TensorBoardSink
from precprof.export.wandb import WandbSink

__all__ = [
    "EventStream",
    "Histogram",
    "LiveDashboards",
    "Scalar",
    "TensorBoardSink",
    "WandbSink",
    "export_run",
    "table_events",
]

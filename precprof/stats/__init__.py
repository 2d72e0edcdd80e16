"""One tensor's statistics in one pass, on its device: the row layout and its merge rule (``layout``), the
engines (the C kernel ``kernel`` with its private cache ``kernel_cache`` on the CPU, the Triton kernel
``triton_engine`` on CUDA, torch ops anywhere, chosen by ``engine``), the per-step, per-device buffer
(``buffer``) and the decoding of rows into numbers (``decode``; many rows at once: ``precprof.rowlayout``)."""

from precprof.rowlayout import decode_rows
from precprof.stats.buffer import StatsBuffer
from precprof.stats.decode import RowStats, decode, is_power_of_two, tensor_stats
from precprof.stats.engine import engine_status
from precprof.stats.layout import (
    COL_ABSMAX_BITS,
    COL_ABSMIN_BITS,
    COL_HIST,
    COL_INF,
    COL_NAN,
    COL_NUMEL,
    COL_OVERFLOW,
    COL_POW2_AT,
    COL_UNDERFLOW_CS,
    COL_ZEROS,
    DEFAULT_CHUNK,
    EXP_MAX,
    EXP_MIN,
    LAYOUT,
    MERGE_MAX,
    MERGE_MIN,
    MERGE_SUM,
    N_BINS,
    N_FP8,
    N_WHATIF,
    ROW_WIDTH,
    RowLayout,
    merge_rows,
)

__all__ = [
    "COL_ABSMAX_BITS",
    "COL_ABSMIN_BITS",
    "COL_HIST",
    "COL_INF",
    "COL_NAN",
    "COL_NUMEL",
    "COL_OVERFLOW",
    "COL_POW2_AT",
    "COL_UNDERFLOW_CS",
    "COL_ZEROS",
    "DEFAULT_CHUNK",
    "EXP_MAX",
    "EXP_MIN",
    "LAYOUT",
    "MERGE_MAX",
    "MERGE_MIN",
    "MERGE_SUM",
    "N_BINS",
    "N_FP8",
    "N_WHATIF",
    "ROW_WIDTH",
    "RowLayout",
    "RowStats",
    "StatsBuffer",
    "decode",
    "decode_rows",
    "engine_status",
    "is_power_of_two",
    "merge_rows",
    "tensor_stats",
]

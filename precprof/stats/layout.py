"""The statistics row for the engines: its layout (``precprof.rowlayout``, free of torch, re-exported here), the
one function that merges rows (sum; max for absmax; min for absmin; :attr:`RowLayout.merge_ops` is the same rule
as data for the C kernel) and the dtypes the C kernel reads."""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

from precprof.rowlayout import (  # the row itself, free of torch (re-exported: the engines import it here)
    _F64_BIAS,
    _F64_EXP_ALL,
    _F64_MANT_MASK,
    _HI,
    _INF_BITS,
    _LO,
    _N_KEYS,
    _NO_MIN_BITS,
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
    f32_bits,
    f64_bits,
    f64_value,
)

Rows = TypeVar("Rows", np.ndarray, torch.Tensor)


def merge_rows(a: Rows, b: Rows, layout: RowLayout | None = None) -> Rows:
    """The merge of two rows (or two ``[rows, width]`` arrays) of the same slots: counts and histograms add,
    absmax takes the larger bit pattern, absmin the smaller (fp64 bits of non-negative numbers order like
    the values). numpy arrays or tensors; returns a new one."""
    lay = layout or LAYOUT
    mx, mn = lay.absmax_bits, lay.absmin_bits
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        out = a + b
        out[..., mx] = torch.maximum(a[..., mx], b[..., mx])
        out[..., mn] = torch.minimum(a[..., mn], b[..., mn])
        return out
    out_np = np.asarray(a) + np.asarray(b)
    out_np[..., mx] = np.maximum(a[..., mx], b[..., mx])
    out_np[..., mn] = np.minimum(a[..., mn], b[..., mn])
    return out_np


# dtypes the C kernel reads (fp8 and others take the torch-op path)
_KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}

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
    "_F64_BIAS",
    "_F64_EXP_ALL",
    "_F64_MANT_MASK",
    "_HI",
    "_INF_BITS",
    "_KERNEL_DTYPES",
    "_LO",
    "_NO_MIN_BITS",
    "_N_KEYS",
    "RowLayout",
    "f32_bits",
    "f64_bits",
    "f64_value",
    "merge_rows",
]

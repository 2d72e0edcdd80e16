"""The statistics row: what each int64 column holds, and the constants the engines (torch ops, the C kernel)
share. A row holds counts (numel, zeros, nan, inf, overflow per what-if format, values on each underflow
boundary, fp8 current-scaling underflow), the largest and smallest nonzero |x| as fp64 bits, and the exponent
histogram over fp32's range."""

from __future__ import annotations

import math

import numpy as np
import torch

from precprof import formats

EXP_MIN = formats.FP32_MIN_EXPONENT  # -149
EXP_MAX = formats.FP32_MAX_EXPONENT  # 127
N_BINS = EXP_MAX - EXP_MIN + 1  # 277

_F64_BIAS = 1023
_F64_MANT_MASK = (1 << 52) - 1
_F64_EXP_ALL = 2047
# key = 2 * fp64_exponent_field + (mantissa == 0): 4096 keys
_N_KEYS = 4096

# overflow thresholds, in the order of formats.WHATIF_FORMATS; e4m3 is strict (> 464)
_OVERFLOW = [(formats.get(f).overflow_min, formats.get(f).overflow_inclusive) for f in formats.WHATIF_FORMATS]

# row layout (int64 columns)
COL_NUMEL = 0
COL_ZEROS = 1
COL_NAN = 2
COL_INF = 3
COL_OVERFLOW = 4  # 4 columns, WHATIF_FORMATS order; counts of v >= T (or > T) including inf
COL_ABSMAX_BITS = 8
COL_ABSMIN_BITS = 9  # smallest nonzero |x| bits minus 1; _NO_MIN_BITS when none
COL_UNDERFLOW_CS = 10  # 2 columns, FP8_FORMATS order: underflow under per-call current scaling
COL_POW2_AT = 12  # 4 columns, WHATIF_FORMATS order: values exactly equal to the format's underflow_max
COL_HIST = 16  # N_BINS columns: finite nonzero values per exponent bin
ROW_WIDTH = COL_HIST + N_BINS

_INF_BITS = 0x7FF0000000000000
_NO_MIN_BITS = 0x7FFFFFFFFFFFFFFF  # sentinel "no nonzero finite value yet"

DEFAULT_CHUNK = 1 << 18
_LO = _F64_BIAS + EXP_MIN  # fp64 exponent field of fp32's smallest subnormal
_HI = _F64_BIAS + EXP_MAX
# raw exponents j with underflow_max = 2^j, WHATIF_FORMATS order
_UNDERFLOW_EXP = [int(math.log2(formats.get(f).underflow_max)) for f in formats.WHATIF_FORMATS]
_FP8 = [formats.get(f) for f in formats.FP8_FORMATS]
_OVERFLOW_T = np.array([t for t, _ in _OVERFLOW], dtype=np.float64)
_OVERFLOW_INC = np.array([1 if inc else 0 for _, inc in _OVERFLOW], dtype=np.int32)
# dtypes the C kernel reads (fp8 and others take the torch-op path)
_KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
# the C kernel's constants, and the row layout it was written for (checked once against its pp_layout)
_UNDERFLOW_EXP_I32 = np.array(_UNDERFLOW_EXP, dtype=np.int32)
_FP8_MAX = np.array([f.max for f in _FP8], dtype=np.float64)
_FP8_UF_EXP_I32 = np.array([int(math.log2(f.underflow_max)) for f in _FP8], dtype=np.int32)
# their addresses, taken once (each ``.ctypes`` access builds an object)
_KERNEL_CONSTANTS = tuple(
    a.ctypes.data for a in (_OVERFLOW_T, _OVERFLOW_INC, _UNDERFLOW_EXP_I32, _FP8_MAX, _FP8_UF_EXP_I32)
)
_CALL_LEN = ROW_WIDTH + 2  # a kernel call row: a row, then its first and last nonzero histogram bin
_KERNEL_LAYOUT = (
    COL_NUMEL,
    COL_ZEROS,
    COL_NAN,
    COL_INF,
    COL_OVERFLOW,
    COL_ABSMAX_BITS,
    COL_ABSMIN_BITS,
    COL_UNDERFLOW_CS,
    COL_POW2_AT,
    COL_HIST,
    EXP_MIN,
    EXP_MAX,
    ROW_WIDTH,
    _CALL_LEN,
)

"""The torch-op engine's keys: built from each value's own bits by integer operations, always in range.

On an H100 the torch-op engine (``PRECPROF_STATS_ENGINE=torch``, or the fallback without triton) ended the
process's CUDA context: ``index_add_`` got an index past the key histogram for fp32, bf16, fp8 and fp64 inputs.
The keys came from ``abs`` of the values widened to fp64, and PTX leaves the sign of ``abs(nan)`` unspecified:
a negative nan kept its sign bit and made a negative key. These checks run on the CPU with the inputs the GPU
tests use, plus every sign and payload of nan, -0.0 and the subnormals of every dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precprof.stats import StatsBuffer
from precprof.stats.layout import _N_KEYS
from precprof.stats.magnitude import SOURCES, abs_bits

try:
    import test_stats as ts
except ImportError:  # tests/ imported as a package
    from tests import test_stats as ts

DTYPES = list(ts.INPUT_DTYPES.values())
IDS = list(ts.INPUT_DTYPES)
_BITS = {
    torch.float32: 32,
    torch.bfloat16: 16,
    torch.float16: 16,
    torch.float8_e4m3fn: 8,
    torch.float8_e5m2: 8,
}
_INT = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


def every_pattern(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern of an 8- or 16-bit dtype."""
    n = _BITS[dtype]
    return torch.arange(1 << n, dtype=torch.int64).to(torch.int32).to(_INT[n]).view(dtype)


def nans_and_zeros(dtype: torch.dtype) -> torch.Tensor:
    """Negative and positive nans with every mantissa pattern of a few kinds, -0.0 and +0.0, as raw bits."""
    if dtype == torch.float64:
        pats = [0x7FF8000000000000, 0x7FF0000000000001, 0x7FFFFFFFFFFFFFFF, 0x7FF4000000000000, 0]
        signed = pats + [p | (1 << 63) for p in pats]
        return torch.tensor([p - (1 << 64) if p >= 1 << 63 else p for p in signed], dtype=torch.int64).view(
            dtype
        )
    n = _BITS[dtype]
    src = SOURCES[dtype]
    exp_all = src.exp_all << src.mant_bits
    mants = {1, (1 << src.mant_bits) - 1, 1 << (src.mant_bits - 1)}
    pats = [exp_all | m for m in mants] + [0]
    signed = pats + [p | (1 << (n - 1)) for p in pats]
    signed = [p - (1 << n) if (n < 8 or n > 8) and p >= 1 << (n - 1) else p for p in signed]
    return torch.tensor(signed, dtype=torch.int64).to(_INT[n]).view(dtype)


def gpu_test_inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    """The inputs of tests/test_stats_gpu.py::test_triton_and_torch_equal_the_c_kernel_bit_for_bit."""
    cases = [ts.hand_built().to(dtype), ts.random_values(300_001, 3, -140.0, 127.99).to(dtype)]
    cases += [x for x in ts._shapes(dtype) if x.numel()]
    return cases


def reference_bits(x: torch.Tensor) -> np.ndarray:
    """fp64 bits of |x| by numpy (a different route: widen, then clear the sign with numpy's abs)."""
    return np.abs(x.double().numpy().reshape(-1)).view(np.int64)


def assert_magnitudes(x: torch.Tensor) -> None:
    flat = x.reshape(-1)
    got = abs_bits(flat, torch.empty(flat.numel(), dtype=torch.int64)).numpy()
    want = reference_bits(flat)
    nan = np.isnan(x.double().numpy().reshape(-1))
    assert (got >= 0).all()
    assert np.array_equal(got[~nan], want[~nan])
    assert ((got[nan] >> 52) == 0x7FF).all() and ((got[nan] & ((1 << 52) - 1)) != 0).all()


def keys_of(x: torch.Tensor) -> np.ndarray:
    """Every key the torch-op device path would hand to ``index_add_`` for x."""
    buf = StatsBuffer(1, "cpu", host_rows=False, engine="torch")
    rows = buf._parts[torch.device("cpu")]
    _, _, key = rows._keys_of(x.reshape(-1))
    return key.numpy().copy()


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in _BITS and _BITS[d] <= 16], ids=str)
def test_every_bit_pattern_of_the_narrow_dtypes(dtype: torch.dtype) -> None:
    x = every_pattern(dtype)
    assert_magnitudes(x)
    k = keys_of(x)
    assert k.min() >= 0 and k.max() < _N_KEYS


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_keys_are_in_range_for_the_gpu_tests_inputs_and_every_nan(dtype: torch.dtype) -> None:
    cases = [*gpu_test_inputs(dtype), nans_and_zeros(dtype)]
    for x in cases:
        assert_magnitudes(x)
        k = keys_of(x)
        assert k.min() >= 0 and k.max() < _N_KEYS, (dtype, int(k.min()), int(k.max()))


def test_fp32_subnormals_and_boundaries() -> None:
    raw = torch.tensor(
        [1, 2, 3, 0x7FFFFF, 0x400000, 0x800000, 0x7F7FFFFF, 0x7F800000, 0x00000001 | (1 << 31)],
        dtype=torch.int64,
    )
    x = (raw - ((raw >> 31) << 32)).to(torch.int32).view(torch.float32)
    assert_magnitudes(x)
    got = abs_bits(x, torch.empty(x.numel(), dtype=torch.int64)).view(torch.float64)
    assert got[0].item() == 2.0**-149 and got[3].item() == (2**23 - 1) * 2.0**-149


def test_keys_do_not_depend_on_float_abs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device whose ``abs`` keeps a nan's sign (as PTX allows) gives the same keys and rows: nothing reads
    the sign through float arithmetic any more."""
    real_abs = torch.Tensor.abs

    def keeps_nan_sign(t: torch.Tensor) -> torch.Tensor:
        out = real_abs(t)
        return torch.where(torch.isnan(t), t, out)

    def keeps_nan_sign_(t: torch.Tensor) -> torch.Tensor:
        return t.copy_(keeps_nan_sign(t))

    for dtype in DTYPES:
        x = torch.cat([ts.hand_built().to(dtype).reshape(-1), nans_and_zeros(dtype)])
        want_keys = keys_of(x)
        want = StatsBuffer(1, "cpu", host_rows=False, engine="torch")
        want.accumulate(x, 0)
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "abs", keeps_nan_sign)
            m.setattr(torch.Tensor, "abs_", keeps_nan_sign_)
            got_keys = keys_of(x)
            got = StatsBuffer(1, "cpu", host_rows=False, engine="torch")
            got.accumulate(x, 0)
        assert np.array_equal(got_keys, want_keys) and got_keys.min() >= 0, dtype
        assert np.array_equal(got.to_host(), want.to_host()), dtype
        c = StatsBuffer(1, "cpu", engine="c")
        c.accumulate(x, 0)
        assert np.array_equal(got.to_host(), c.to_host()), dtype  # and the C kernel agrees

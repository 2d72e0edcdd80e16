"""The exactness checks of test_stats.py on a CUDA device, and proof that accumulate never syncs.

On CUDA the buffer histograms with ``index_add_`` instead of ``bincount`` (which asks the host for the max)
and processes whole tensors unless ``chunk`` is given: both paths are compared with the CPU references.
Skipped as a whole without CUDA.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

try:
    import test_stats as ts
except ImportError:  # tests/ imported as a package
    from tests import test_stats as ts

from precprof.stats import StatsBuffer, decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
DTYPES = list(ts.INPUT_DTYPES.values())
IDS = list(ts.INPUT_DTYPES)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_hand_built_cuda(dtype: torch.dtype) -> None:
    ts.check_exact(ts.hand_built().to(dtype), DEV)


def test_hand_built_fp64_neighbours_cuda() -> None:
    t = torch.tensor(ts.boundary_values() + [2.0**e for e in range(-140, 128)], dtype=torch.float64)
    x = torch.cat(
        [t, torch.nextafter(t, torch.full_like(t, math.inf)), torch.nextafter(t, torch.zeros_like(t))]
    )
    ts.check_exact(torch.cat([x, -x]), DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_random_cuda(dtype: torch.dtype) -> None:
    hi = 127.99 if dtype == torch.float64 else 130.0
    ts.check_exact(ts.random_values(100_003, 0, -140.0, hi).to(dtype), DEV)
    lo, hi = ts.dtype_range(dtype)
    ts.check_exact(ts.random_values(20_001, 7, lo, hi).to(dtype), DEV)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_shapes_cuda(dtype: torch.dtype) -> None:
    for x in ts._shapes(dtype):
        ts.check_exact(x, DEV)


@pytest.mark.parametrize("chunk", [7, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_chunked_cuda_equals_whole_and_cpu(dtype: torch.dtype, chunk: int) -> None:
    lo, hi = ts.dtype_range(dtype)
    x = ts.random_values(277 * 73, 11, lo, hi, special=0.02).to(dtype).view(277, 73).t()
    rows = []
    for device, c in ((DEV, 0), (DEV, chunk), ("cpu", 0), ("cpu", chunk)):
        buf = StatsBuffer(1, device, chunk=c)
        buf.accumulate(x.to(device), 0)
        rows.append(buf.to_host())
    for r in rows[1:]:
        assert np.array_equal(r, rows[0])
    assert ts.observed(decode(rows[0][0])) == ts.reference(x)


@pytest.mark.parametrize("k", [0, 8, 24, -5])
def test_scale_cuda(k: int) -> None:
    g = ts.random_values(5000, 5, -115.0, 100.0).float()
    raw = g * 2.0**k
    torch.testing.assert_close(raw / 2.0**k, g, rtol=0, atol=0, equal_nan=True)
    obs = ts.observed(ts.stats_of(raw, DEV, scale=2.0**k))
    ref_raw, ref_g = ts.reference(raw), ts.reference(g)
    assert obs["hist"] == ref_g["hist"]
    assert obs["absmax"] == ref_g["absmax"] and obs["absmin"] == ref_g["absmin"]
    for key in ref_raw:
        if key.startswith(("underflow_", "overflow_")) or key in ("numel", "zeros", "nan", "inf"):
            assert obs[key] == ref_raw[key], key


def test_current_scaling_ties_cuda() -> None:
    for values in (
        [448.0, 2.0**-10, -(2.0**-10), 1.5 * 2.0**-10, 2.0**-9, 2.0**-11],
        [200.0, 2.0**-11, 2.0**-12, 1.25 * 2.0**-11],
        [57344.0 / 4, 2.0**-19, 1.5 * 2.0**-19, 2.0**-20],
        [1e6, 2.0**-3, 1e-5, math.inf, math.nan, 0.0],
    ):
        ts.check_exact(torch.tensor(values), DEV)


def test_accumulate_never_syncs() -> None:
    """Every accumulate (all dtypes, non-contiguous, empty, 0-dim, chunked, assign, requires_grad) and reset
    under ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises."""
    inputs = []
    for i, dtype in enumerate(DTYPES):
        x = ts.random_values(50_000, i, -140.0, 127.99).to(dtype).to(DEV)
        inputs += [x, x.view(250, 200).t(), x[::3], x[:0], x[7]]
    w = torch.randn(1000, device=DEV, requires_grad=True)
    inputs += [w, w * 2]
    whole = StatsBuffer(4, DEV)
    chunked = StatsBuffer(4, DEV, chunk=4096)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, x in enumerate(inputs):
            whole.accumulate(x, i % 4)
            chunked.accumulate(x, i % 4)
        whole.accumulate(inputs[0], 3, assign=True)
        whole.reset(slice(1, 2))
        chunked.reset()
        chunked.accumulate(inputs[1], 0)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    host = whole.to_host()  # the one sync, outside the hooks
    assert ts.observed(decode(host[3])) == ts.reference(inputs[0])
    assert ts.observed(decode(chunked.to_host()[0])) == ts.reference(inputs[1])
    assert decode(host[1]).numel == 0
    assert w.grad is None and w.requires_grad

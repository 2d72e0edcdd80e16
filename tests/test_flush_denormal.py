"""The statistics under the caller's flush-to-zero mode: ``torch.set_flush_denormal(True)`` sets x86's MXCSR FTZ
and DAZ on the calling thread (ARM: FPCR.FZ), under which a float conversion or compare reads a subnormal as 0.
Every count comes from the values' bits whatever the mode: the same rows as without it, and the real casts'
numbers (computed with the mode off), for every dtype the C kernel and the torch-op path read, subnormals and
each format's underflow boundaries included; the C kernel's block-format and weight-update what-ifs compute in
IEEE mode on every thread; the user's mode is left as it was. Every tensor is built before the mode is set
(a cast under it would flush the values themselves)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from test_block_engines import RECIPES
from test_stats import INPUT_DTYPES, boundary_values, hand_built, observed, random_values, reference
from torch import nn

from precprof.capture.records import _ParamSlot
from precprof.capture.updates import UpdateSampler
from precprof.stats import LAYOUT, StatsBuffer, decode
from precprof.stats import kernel as cpu_kernel

needs_c = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler: the torch path runs alone")


@contextmanager
def flush_denormal() -> Iterator[None]:
    """The calling thread in flush-to-zero mode, checked by its effect on a subnormal, and switched off after."""
    sub = torch.tensor([1e-40])
    if not torch.set_flush_denormal(True):
        pytest.skip("torch cannot set a flush-to-zero mode on this CPU")
    try:
        assert float(sub * 1.0) == 0.0
        yield
        assert float(sub * 1.0) == 0.0, "the statistics changed the caller's flush-to-zero mode"
    finally:
        torch.set_flush_denormal(False)
    assert float(sub * 1.0) == float(sub)


def _row(x: torch.Tensor, engine: str) -> np.ndarray:
    buf = StatsBuffer(1, "cpu", engine=engine)
    buf.accumulate(x, 0)
    return buf.to_host()[0]


def _cases(dtype: torch.dtype) -> list[torch.Tensor]:
    """Hand-built values (every fp32 subnormal binade, each format's underflow boundary and its neighbours)
    whole, strided and past the C kernel's small-tensor path; for fp64 its own subnormals (last: beyond what
    the real-cast reference covers, the engines' rows without the mode are their reference)."""
    x = hand_built().to(dtype)
    tiny = torch.tensor(boundary_values() + [2.0**e for e in range(-149, -120)], dtype=torch.float64)
    many = torch.cat([random_values(5000, 1, -149.0, -100.0), tiny, -tiny]).to(dtype)  # run_f32's blocks
    cases = [x, x[::3], many]
    if dtype == torch.float64:
        sub = torch.tensor([5e-324, 1e-310, 2.0**-1030, -(2.0**-1074), 0.0], dtype=torch.float64)
        cases += [sub, sub[:2].repeat(3000)]
    return cases


@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
@pytest.mark.parametrize("engine", ["c", "torch"])
def test_rows_are_the_same_under_flush_to_zero(engine: str, dtype: torch.dtype) -> None:
    if engine == "c" and cpu_kernel.load() is None:
        pytest.skip("no C compiler")
    cases = _cases(dtype)
    want = [_row(x, engine) for x in cases]
    refs = [reference(x) for x in cases[:3]]
    with flush_denormal():
        lib = cpu_kernel.load()
        mode = lib.pp_fpmode() if lib is not None else None
        if lib is not None:
            lib.pp_init()  # its tables built under the mode, as a Profiler attached under it loads the kernel
        got = [_row(x, engine) for x in cases]
        if lib is not None:
            assert lib.pp_fpmode() == mode  # the kernel left the caller's mode (FTZ/DAZ on) as it was
    for x, g, w in zip(cases, got, want, strict=True):
        diff = np.flatnonzero(g != w).tolist()
        assert not diff, f"{engine} {dtype} ({x.numel()} values): columns {diff} differ under flush-to-zero"
    for g, ref in zip(got, refs, strict=False):
        assert observed(decode(g)) == ref


def _flushing(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Subnormals of ``dtype`` (random bit patterns) with a 1.0 in every block of 32 along either axis: each
    block's scale is set by the 1.0, and its subnormals flush in every element format (the counts read each
    one as nonzero)."""
    g = torch.Generator().manual_seed(seed)
    mbits = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    ints = torch.randint(1, 2**mbits, shape, generator=g, dtype=torch.int32)
    x = ints.view(torch.float32) if dtype == torch.float32 else ints.to(torch.int16).view(dtype)
    x = x.clone()
    x[:, ::32] = 1.0
    x[::32, :] = -1.0
    return x


def _in_thread(fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    out: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_c_block_formats_compute_in_ieee_mode(dtype: torch.dtype) -> None:
    """Subnormals that flush in the recipes: the same counts and sums as without the mode, on the calling
    thread (a small tensor) and on OpenMP workers that have the mode: those of a thread started while it was
    set (a thread inherits its creator's mode), started by its first parallel region (libgomp keeps a pool of
    workers per thread that asks for them), the statistics' (which leave the mode alone)."""
    small, large = _flushing((40, 96), dtype, 0), _flushing((160, 384), dtype, 1)
    lib = cpu_kernel.load()

    def block(x: torch.Tensor, threads: int) -> torch.Tensor:
        return cpu_kernel.block_stats_2d(x, RECIPES, 3, threads=threads)

    def workers_in_the_mode_then_block() -> torch.Tensor:
        assert lib.pp_fpmode() == mode
        zeros, call = torch.zeros(1 << 17), np.zeros(LAYOUT.call_len, dtype=np.int64)
        lib.pp_call(zeros.data_ptr(), zeros.numel(), 1, 0, 4, LAYOUT.c_config().ctypes.data, call.ctypes.data)
        return block(large, 4)

    with flush_denormal():
        mode = lib.pp_fpmode()
        got = [block(small, 1), _in_thread(workers_in_the_mode_then_block)]
    want = [block(small, 1), block(large, 1)]
    assert int(want[1][:, :, 0].sum()) > 0  # the recipes flushed values
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_c_update_counts_compute_in_ieee_mode(dtype: torch.dtype) -> None:
    """Updates of subnormal size (fp32's, bf16's, fp16's), subnormal gradients and weights: the C kernel counts
    them as without the mode."""
    before = [1e-40, 2.0**-126, 3e-39, 1.0, 2.0**-20, 2.0**-14, 1e-39, 6e-8, 2.0**-24, 0.0]
    after = [2e-40, 2.0**-126 + 2.0**-149, 3e-39, 1.0 + 2.0**-30, 2.0**-20 + 2.0**-24, 2.0**-14 + 2.0**-24]
    after += [1e-39 + 1e-45, 1.2e-7, 2.0**-25, 1e-41]
    grads = [1e-40, 1e-41, 1.0, 1.0, 1.0, 1.0, 1e-44, 6e-8, 2.0**-24, 1e-42]

    def counts(ftz: bool) -> torch.Tensor:
        def t(v: float) -> torch.Tensor:
            return torch.tensor([v], dtype=torch.float64).to(dtype)

        params = [nn.Parameter(t(b)) for b in before]
        news = [t(a) for a in after]
        for p, g in zip(params, grads, strict=True):
            p.grad = t(g)
        slots = [_ParamSlot("m", f"p{i}", p, -1, -1) for i, p in enumerate(params)]
        sampler = UpdateSampler(slots, 4, torch.device("cpu"))
        (group,) = sampler._groups
        with flush_denormal() if ftz else _nothing():
            sampler.before_step()
            assert group._reader_read
            with torch.no_grad():
                for p, a in zip(params, news, strict=True):
                    p.copy_(a)  # a copy of the same dtype: bits, never flushed
            assert sampler.after_step()
        return group.counts.clone()

    plain = counts(False)
    assert int(plain[:, 1:4].sum()) > 0  # the cases reach the counts
    assert torch.equal(counts(True), plain)


@contextmanager
def _nothing() -> Iterator[None]:
    yield

"""The exactness checks of test_stats.py on a CUDA device, and proof that accumulate never syncs.

On CUDA the default engine is the Triton kernel; the torch-op path (``index_add_`` instead of ``bincount``,
which asks the host for the max, in chunks of bounded scratch) is the fallback. Both are compared with the
CPU references and with the C kernel bit for bit. Skipped as a whole without CUDA.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("engine", ["triton", "torch"])
def test_accumulate_never_syncs(engine: str) -> None:
    """Every accumulate (all dtypes, non-contiguous, empty, 0-dim, chunked, assign, requires_grad) and reset
    under ``torch.cuda.set_sync_debug_mode("error")``: any host sync raises."""
    inputs = []
    for i, dtype in enumerate(DTYPES):
        x = ts.random_values(50_000, i, -140.0, 127.99).to(dtype).to(DEV)
        inputs += [x, x.view(250, 200).t(), x[::3], x[:0], x[7]]
    w = torch.randn(1000, device=DEV, requires_grad=True)
    inputs += [w, w * 2]
    whole = StatsBuffer(4, DEV, engine=engine)
    chunked = StatsBuffer(4, DEV, chunk=4096, engine=engine)
    assert whole.engines == {"cuda:0": engine}
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


def _c_row(x: torch.Tensor) -> np.ndarray:
    buf = StatsBuffer(1, "cpu", engine="c")
    buf.accumulate(x.cpu(), 0)
    return buf.to_host()[0]


def _cuda_row(x: torch.Tensor, engine: str, **kw: object) -> np.ndarray:
    buf = StatsBuffer(1, DEV, engine=engine, **kw)
    buf.accumulate(x.to(DEV), 0)
    return buf.to_host()[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_triton_and_torch_equal_the_c_kernel_bit_for_bit(dtype: torch.dtype) -> None:
    cases = [ts.hand_built().to(dtype), ts.random_values(300_001, 3, -140.0, 127.99).to(dtype)]
    cases += [x for x in ts._shapes(dtype) if x.numel()]
    for x in cases:
        want = _c_row(x)
        assert (_cuda_row(x, "triton") == want).all()
        assert (_cuda_row(x, "torch") == want).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_bit_planes_and_tl_histogram_give_the_c_kernels_row_over_many_flushes(dtype: torch.dtype) -> None:
    """A tensor large enough that each program's bit planes are flushed several times (more than 30 iterations
    of 1,024 values a program at four programs a multiprocessor), spread over the window, with rare values
    here and there (subnormals, inf, nan, one past the overflow shortcut, a tail far below) and a partial last
    block: the planes (the default) and ``tl.histogram``'s kernel give the C kernel's row."""
    pytest.importorskip("triton")
    from precprof.stats import triton_engine
    from precprof.stats.layout import LAYOUT

    dev = torch.device(DEV)
    planes = triton_engine.TritonRows(dev, LAYOUT)
    votes = triton_engine.TritonRows(dev, LAYOUT, block=512, planes=False)
    assert planes.planes and not votes.planes
    n = 40 * planes.max_programs * planes.block + 777
    g = torch.Generator(device="cpu").manual_seed(11)
    x = torch.randn(n, generator=g) * 2.0 ** torch.randint(-14, 14, (n,), generator=g).float()
    x[1_000_003::4_000_037] = 2.0**-130
    x[2_000_001] = float("inf")
    x[3_000_017] = float("nan")
    x[4_000_037] = 3e38
    x[n - 5] = 2.0**-60
    x = x.to(dtype)
    want = _c_row(x)
    xd = x.to(dev)
    for rows in (planes, votes):
        got = LAYOUT.empty_rows(1, dev)
        assert rows.add(xd, got, 0)
        assert (got.cpu().numpy()[0] == want).all(), rows.planes


def test_side_stream_work_is_ordered() -> None:
    """Hooks on two streams (FSDP2 gradients on its reduce-scatter stream) write the same rows and scratch."""
    xs = [ts.random_values(200_000, i, -60.0, 60.0).float().to(DEV) for i in range(6)]
    side = torch.cuda.Stream()
    for engine in ("triton", "torch"):
        buf = StatsBuffer(1, DEV, engine=engine)
        for i, x in enumerate(xs):
            if i % 2:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    buf.accumulate(x, 0)
            else:
                buf.accumulate(x, 0)
        ref = StatsBuffer(1, "cpu", engine="c")
        for x in xs:
            ref.accumulate(x.cpu(), 0)
        assert (buf.to_host() == ref.to_host()).all(), engine


def test_memory_is_bounded_for_a_large_tensor() -> None:
    """No tensor size makes precprof's memory grow past the fixed scratch."""
    x = torch.randn(150_000_000, device=DEV)
    for engine in ("triton", "torch"):
        buf = StatsBuffer(1, DEV, engine=engine)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        buf.accumulate(x, 0)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() - base < 64 << 20, engine
        assert buf.scratch_bytes < 64 << 20
        assert buf.to_host()[0][0] == x.numel()


def test_deterministic_mode_no_sync() -> None:
    x = ts.random_values(100_000, 9, -140.0, 127.99).float().to(DEV)
    want = _c_row(x)
    torch.use_deterministic_algorithms(True)
    try:
        for engine in ("triton", "torch"):
            buf = StatsBuffer(1, DEV, engine=engine)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                buf.accumulate(x, 0)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert (buf.to_host()[0] == want).all(), engine
    finally:
        torch.use_deterministic_algorithms(False)


def test_tensors_on_other_devices_are_read_there() -> None:
    """A CUDA model with a CPU-offloaded tensor and a meta one: each read on its own device, merged."""
    buf = StatsBuffer(1, DEV)
    a = ts.random_values(5000, 1, -30.0, 30.0).float()
    b = ts.random_values(7000, 2, -30.0, 30.0).float()
    buf.accumulate(a.to(DEV), 0)
    buf.accumulate(b, 0)  # on the CPU
    assert buf.accumulate(torch.empty(3, device="meta"), 0) is False
    assert set(buf.engines) == {"cuda:0", "cpu"}
    ref = StatsBuffer(1, "cpu")
    ref.accumulate(a, 0)
    ref.accumulate(b, 0)
    assert (buf.to_host() == ref.to_host()).all()
    assert (buf.dense().cpu().numpy() == ref.to_host()).all()


def _compiled(kernels: list) -> int:
    """Kernels Triton holds compiled for the current device (its in-memory JIT cache)."""
    dev = torch.cuda.current_device()
    return sum(len(k.device_caches[dev][0]) for k in kernels)


def test_nothing_compiles_in_a_hook() -> None:
    """Once the rows are made (the Profiler's attach), accumulating tensors of every dtype they were made
    for, in every layout (aligned, offset, strided, transposed, expanded, 0-dim, large), with block
    statistics, in deterministic mode and under sync-debug "error", compiles no Triton kernel and never
    syncs: the warm-up compiled every variant (the first sampled step of gpt2-small stalled 18.8 s before)."""
    from precprof.stats import triton_block_kernels as tbk
    from precprof.stats import triton_kernels as tk

    kernels = [tk._rows, tk._rows_strided, tk._rows_many, tbk._amax, tbk._blocks]
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = StatsBuffer(4, dev, engine="triton", dtypes=DTYPES)
    torch.cuda.synchronize()
    before = _compiled(kernels)
    assert before > 0
    inputs = []
    for i, dtype in enumerate(DTYPES):
        x = ts.random_values(50_000, i, -140.0, 127.99).to(dtype).to(dev)
        inputs += [
            x,
            x[1:],
            x[::3],
            x.view(250, 200).t(),
            x.view(250, 200)[:, 1:],
            x[7],
            x[:10].expand(4, 10),
        ]
    inputs += [torch.randn(3000, 4096, device=dev).bfloat16()]
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i, x in enumerate(inputs):
            buf.accumulate(x, i % 4, blocks=x.dim() >= 2)
        assert buf.primary is not None
        buf.primary.add_many(inputs, [i % 4 for i in range(len(inputs))])  # many a launch
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.use_deterministic_algorithms(False)
    assert _compiled(kernels) == before
    assert buf.blocks_seen.any()


@pytest.mark.gpu
def test_the_direct_launch_writes_the_rows_tritons_own_launch_writes() -> None:
    """Every row variant compiled at attach is launched straight through its launcher; the rows equal those of
    Triton's own launch (the self-check at attach), and a tensor read both ways gives the same row."""
    pytest.importorskip("triton")
    from precprof.stats import triton_engine

    direct = StatsBuffer(2, "cuda", engine="triton")
    part = direct.primary
    assert part is not None and part._triton is not None
    assert part._triton._direct, part._triton.direct_status
    plain = StatsBuffer(2, "cuda", engine="triton")
    assert plain.primary is not None and plain.primary._triton is not None
    plain.primary._triton._direct.clear()  # Triton's launch only
    g = torch.Generator(device="cpu").manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(70_007, generator=g) * 30).to(dtype).cuda()
        for buf in (direct, plain):
            buf.accumulate(x, 0)
            buf.accumulate(x.view(7, -1)[:, ::3], 1)  # strided
    assert torch.equal(direct.dense(), plain.dense())
    assert triton_engine.variant(x) in part._triton._direct


@pytest.mark.gpu
def test_many_tensors_in_one_direct_launch_write_the_rows_of_one_launch_each() -> None:
    """``add_many``: 40 tensors of three dtypes (one value to a million, a strided and an unaligned view among
    them) in launches of up to 16, through the direct launcher and through Triton's, give the rows of one
    launch each, bit for bit."""
    pytest.importorskip("triton")
    from precprof.stats import triton_engine

    g = torch.Generator(device="cpu").manual_seed(4)
    tensors = []
    for i in range(36):
        n = int(2 ** (i % 21))
        tensors.append((torch.randn(n, generator=g) * 2.0 ** (i % 40 - 20)).to(DTYPES[i % 3]).cuda())
    base = torch.randn(9000, generator=g).cuda()
    tensors += [base[1:], base.view(90, 100)[:, ::7], torch.zeros(0, device="cuda"), base.bfloat16()]
    rows = [i % 13 for i in range(len(tensors))]
    bufs = [StatsBuffer(13, "cuda", engine="triton") for _ in range(3)]
    assert all(b.primary is not None and b.primary._triton is not None for b in bufs)
    many, plain, one = (b.primary for b in bufs)
    assert many is not None and plain is not None and one is not None
    assert triton_engine.Variant(0, False, True, True) in many._triton._direct, many._triton.direct_status
    plain._triton._direct.clear()  # Triton's launch only
    many.add_many(tensors, rows)
    plain.add_many(tensors, rows)
    for t, r in zip(tensors, rows, strict=True):
        one.add(t, r)
    assert torch.equal(many.dense(), one.dense()) and torch.equal(plain.dense(), one.dense())


@pytest.mark.gpu
def test_the_block_kernels_direct_launch_adds_what_tritons_launch_adds() -> None:
    """The block what-if's kernels compiled at attach are launched straight through their launchers (both
    orientations of a tensor into its slot); they add what Triton's own launch adds, bit for bit, and what the
    torch-op reference computes (counts exactly, sums to 1e-12), for each dtype, a transposed view included."""
    pytest.importorskip("triton")
    from precprof.stats import blocks

    direct = StatsBuffer(2, "cuda", engine="triton")
    part = direct.primary
    assert part is not None and part._triton_blocks is not None
    assert len(part._triton_blocks._direct) == 3, part._triton_blocks.direct_status
    plain = StatsBuffer(2, "cuda", engine="triton")
    assert plain.primary is not None and plain.primary._triton_blocks is not None
    plain.primary._triton_blocks._direct.clear()  # Triton's launch only
    g = torch.Generator(device="cpu").manual_seed(5)
    want = torch.zeros(2, 2, blocks.N_RECIPES, blocks.N_STATS, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        scale = torch.exp2(torch.randint(-12, 12, (700, 1), generator=g).float())
        x = (torch.randn(700, 1000, generator=g) * scale).to(dtype).cuda()
        for buf in (direct, plain):
            buf.accumulate_blocks(x, 0)
            buf.accumulate_blocks(x.t(), 1)
        for row, t in ((0, x), (1, x.t())):
            want[row] += blocks.tensor_block_stats(t, engine="torch").cpu()
    got = direct.blocks_to_host()
    np.testing.assert_array_equal(got, plain.blocks_to_host())
    np.testing.assert_array_equal(got[..., :3], want[..., :3].numpy())
    np.testing.assert_allclose(got[..., 3:], want[..., 3:].numpy(), rtol=1e-12, atol=0)


@pytest.mark.gpu
def test_the_block_kernels_counts_hold_a_program_of_max_iters_tiles() -> None:
    """A thread counts a recipe's kept and saturated values in an int32 each. One program reads ``MAX_ITERS``
    tiles along 128 lines of 65,504 values, each line a thread's: 64 lines of 1.9 (all saturate in MXFP8 E4M3
    with floor scales: 1.9 x 2^8 = 486.4, past 464), 65,504 saturated a thread; 64 whose blocks are 1.9 and 31
    values of 1.9 x 2^-24 (they flush), 63,457 flushed a thread: the counts the C kernel gives, with one
    program and with two."""
    pytest.importorskip("triton")
    from precprof.stats import blocks
    from precprof.stats import triton_block as tb

    n_along = 32 * tb.MAX_ITERS
    x = torch.full((128, n_along), 1.9)
    x[64:] *= 2.0**-24
    x[64:, ::32] = 1.9
    (*_, tiles, iters), programs = tb._geometry(n_along, 128, 1, n_along, 128, 1)
    assert (tiles, iters, programs) == (tb.MAX_ITERS, tb.MAX_ITERS, 1)
    want = blocks.tensor_block_stats(x, engine="c")
    flushed, saturated = want[0, 0, 0].item(), want[0, 0, 1].item()  # "row", MXFP8 E4M3 (floor)
    assert (flushed, saturated) == (64 * 31 * tb.MAX_ITERS, 64 * n_along + 64 * tb.MAX_ITERS)
    for most in (1, 2):
        eng = tb.TritonBlocks(torch.device("cuda"), blocks.RECIPES, max_programs=most)
        got = torch.zeros(2, blocks.N_RECIPES, blocks.N_STATS, dtype=torch.float64, device="cuda")
        assert eng.add(x.cuda(), got)
        got = got.cpu()
        assert torch.equal(got[..., :3], want[..., :3]), most
        torch.testing.assert_close(got[..., 3:], want[..., 3:], rtol=1e-12, atol=0.0)


_AHEAD_THEN_HERE = r"""
import json, pathlib, sys, torch
from precprof.stats import StatsBuffer, triton_ahead
root = pathlib.Path(sys.argv[1])
cubins = lambda: sorted(str(p) for p in root.rglob("*.cubin"))
seen = {}
real = triton_ahead.compile_ahead
def ahead(spec, *a, **k):
    why = real(spec, *a, **k)
    seen.update(why=why, ahead=cubins())
    return why
triton_ahead.compile_ahead = ahead
buf = StatsBuffer(2, "cuda", background=True)  # the other process, then this one with the real driver
buf.wait_ready()
buf.accumulate(torch.randn(1000, device="cuda"), 0)
phases = buf.warm_phases
print(json.dumps({**seen, "after": cubins(), "error": buf.ahead_error, "phases": phases}))
"""


def test_the_training_process_finds_the_other_processs_kernels(tmp_path: Path) -> None:
    """A fresh process's background warm on the GPU: the other process compiles for this GPU with CPU tensors
    and no driver, then this one compiles the same variants with the real driver and CUDA tensors and writes
    no kernel the other did not (every one a hit in the cache: the keys agree)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _AHEAD_THEN_HERE, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["why"] is None and got["error"] is None
    assert "ahead" in got["phases"] and len(got["ahead"]) >= 9 and got["after"] == got["ahead"], got


@pytest.mark.parametrize("engine", ["triton", "torch"])
def test_a_tensor_read_again_into_an_empty_row_is_a_device_copy(engine: str) -> None:
    """On CUDA as in the interpreter (test_stats_engines): a tensor read alone into an empty row and given
    again, unchanged, for another empty row is that row's copy, one read fewer, the rows bit for bit those of
    reading each call (and the C kernel's)."""
    a = ts.random_values(300_000, 3, -30.0, 30.0).bfloat16()
    b = ts.random_values(70_000, 4, -140.0, 120.0).float()

    def run(again: bool) -> np.ndarray:
        buf = StatsBuffer(3, DEV, engine=engine)
        rows = buf.primary
        assert rows is not None
        x, y = a.to(DEV), b.to(DEV)
        rows.add(x, 0)
        rows.add(x if again else x.clone(), 1)
        rows.add(y, 2)
        rows.add(y if again else y.clone(), 0)  # row 0 holds a read: read into it
        return buf.to_host()

    copied, read = run(True), run(False)
    assert np.array_equal(copied, read)
    c = StatsBuffer(1, "cpu", engine="c")
    c.accumulate(a, 0)
    assert (copied[1] == c.to_host()[0]).all()

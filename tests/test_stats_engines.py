"""The statistics engines agree bit for bit, with real casts and with each other: the Triton kernel (run on CPU
tensors by Triton's interpreter, exactly the code that runs on CUDA), the C kernel, the torch-op path on host
rows and on device rows (chunked, and in deterministic mode). Also: one row layout derived from the formats
(a test-only format with a maximum of 6 moves the overflow shortcut), one merge rule, bounded scratch, and
tensors on other devices or on ``meta``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import kernel_required
from test_stats import INPUT_DTYPES, _shapes, dtype_range, hand_built, observed, random_values, reference

from precprof import formats, stats
from precprof.errors import UserError
from precprof.stats import LAYOUT, RowLayout, StatsBuffer, decode, merge_rows, triton_engine, triton_launch
from precprof.stats import engine as engine_mod

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
    if kernel_required():  # CI must run the Triton kernel, never skip it (the test extra declares triton)
        raise

# conftest sets TRITON_INTERPRET=1 on machines without CUDA; with CUDA the GPU tests run the kernels for real
needs_interpreter = pytest.mark.skipif(
    not HAVE_TRITON or not triton_engine.interpreting(),
    reason="needs triton with TRITON_INTERPRET=1 (pip install triton; conftest sets it without CUDA)",
)
ENGINES = ("c", "torch-host", "torch-device", "triton")


def rows_of(x: torch.Tensor, engine: str, layout: RowLayout = LAYOUT, chunk: int | None = None) -> np.ndarray:
    if engine == "triton":
        buf = StatsBuffer(1, "cpu", engine="triton", layout=layout)
    elif engine == "torch-device":
        buf = StatsBuffer(1, "cpu", engine="torch", host_rows=False, layout=layout, chunk=chunk)
    elif engine == "torch-host":
        buf = StatsBuffer(1, "cpu", engine="torch", layout=layout, chunk=chunk)
    else:
        buf = StatsBuffer(1, "cpu", engine="c", layout=layout)
    buf.accumulate(x, 0)
    return buf.to_host()[0]


def all_engines_agree(
    x: torch.Tensor, layout: RowLayout = LAYOUT, engines: tuple[str, ...] = ENGINES
) -> np.ndarray:
    """The row of ``x`` from every engine (of ``engines``, the C kernel first); asserts they are identical and
    returns it."""
    out = {e: rows_of(x, e, layout) for e in engines}
    for e in engines[1:]:
        diff = np.flatnonzero(out[e] != out["c"])
        assert not len(diff), f"{e} differs from the C kernel in columns {diff.tolist()} for {x.dtype}"
    return out["c"]


# ------------------------------------------------------------------------------------ bit for bit
@needs_interpreter
@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_hand_built_values_every_engine_and_real_casts(dtype: torch.dtype) -> None:
    """Powers of two over fp32's range, subnormals, every format's rounding ties and their neighbours, inf,
    nan, -0.0: every engine gives the same row, and it decodes to the real-cast reference."""
    x = hand_built().to(dtype)
    row = all_engines_agree(x)
    assert observed(decode(row)) == reference(x)


@needs_interpreter
@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_random_odd_sizes_every_engine(dtype: torch.dtype) -> None:
    """Sizes on both sides of the C kernel's small-tensor path (at most 4096 values: straight into the keys),
    with specials and subnormals, and values of few mantissa bits (powers of two among them). Triton's
    interpreter (some 10 ms a block of 512) reads the sizes on its own boundaries: within one block, a partial
    last block, a whole number of blocks, and more blocks than its four programs (each loops); its reads of the
    coarse values, two of them."""
    for n, seed in ((1, 0), (7, 1), (1023, 2), (1025, 3), (4096, 5), (4097, 6), (5000, 4)):
        x = random_values(n, seed, -140.0, 127.99).to(dtype)
        row = all_engines_agree(x, engines=ENGINES if n in (1, 7, 1025, 4096, 4097) else ENGINES[:3])
        assert observed(decode(row)) == reference(x)
        coarse = random_values(n, seed + 10, -30.0, 30.0, special=0.0).to(torch.bfloat16).to(dtype)
        row = all_engines_agree(coarse, engines=ENGINES if n in (7, 4097) else ENGINES[:3])
        assert observed(decode(row)) == reference(coarse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_kernel_16_bit_blocks_with_and_without_subnormals(dtype: torch.dtype) -> None:
    """The C kernel's 16-bit path over several blocks of 2,048 values (four interleaved counts each): the first
    blocks with no subnormal and an inf, a nan, -0 and powers of two (one in each of the four counts, at fp8
    e4m3's underflow bound), the last with subnormals, equals the torch ops' row and a reference count, whole
    and cut at other places."""
    x = random_values(3 * 2048 + 5, 3, -12.0, 12.0, special=0.0).to(dtype)
    x[100], x[200], x[300], x[400], x[401] = math.inf, math.nan, -0.0, 2.0**-3, -(2.0**14)
    # fp8 e4m3 underflows up to 2^-10
    x[404:408] = torch.tensor([2.0**-10, 2.0**-9, 2.0**-11, 2.0**-10]).to(dtype)
    x[5000] = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    x[6000] = -3 * x[5000]
    for t in (x, x[:4097], x[2048:]):
        c, host = rows_of(t, "c"), rows_of(t, "torch-host")
        assert not len(np.flatnonzero(c != host)), np.flatnonzero(c != host)
        assert observed(decode(c)) == reference(t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_c_kernel_16_bit_magnitude_bins_on_both_sides_of_their_size(dtype: torch.dtype) -> None:
    """From 65,536 values on, the C kernel counts 16-bit values in bins of their magnitudes' bits and makes the
    keys from the bins touched (0, and the smallest nonzero to the largest magnitude) at the end: sizes on both
    sides of that, values over every binade with subnormals, powers of two, inf, nan and -0; a tensor of zeros;
    one whose only nonzero values are the largest magnitude (the touched range one bin); one whose later block
    holds a value one bin below the smallest so far; and tensors read one after the other into the same rows
    and apart (the bins are empty again between calls).
    Each row equals the torch ops' and the real-cast reference."""
    tiny = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal
    wide = random_values(70_000, 21, *dtype_range(dtype)).to(dtype)
    wide[::997] = 2.0**-5
    narrow = random_values(65_536, 22, -3.0, 3.0, special=0.0).to(dtype)
    top = torch.zeros(65_537, dtype=dtype)
    top[[0, 4096, 65_536]] = torch.finfo(dtype).max
    low = torch.zeros(65_536, dtype=dtype)
    low[[5, 70]] = 2 * tiny
    low[65_000] = tiny  # a later block's smallest one bin below the smallest so far
    for t in (wide, wide[:65_535], wide[1:65_537], narrow, top, low, torch.zeros(65_536, dtype=dtype)):
        c, host = rows_of(t, "c"), rows_of(t, "torch-host")
        assert not len(np.flatnonzero(c != host)), np.flatnonzero(c != host)
        assert observed(decode(c)) == reference(t)
    # one after the other on the same thread: a call's bins must not reach the next call's row
    kernel = StatsBuffer(2, "cpu", engine="c")
    ops = StatsBuffer(2, "cpu", engine="torch")
    for row, t in enumerate((wide, narrow, top, low)):
        kernel.accumulate(t, row % 2)
        ops.accumulate(t, row % 2)
    assert np.array_equal(kernel.to_host(), ops.to_host())


@needs_interpreter
@pytest.mark.parametrize("dtype", list(INPUT_DTYPES.values()), ids=list(INPUT_DTYPES))
def test_views_empty_and_specials_every_engine(dtype: torch.dtype) -> None:
    """Empty, 0-dim, transposed, strided, permuted and expanded (stride 0) views, read in place by Triton;
    all-nan and all-inf tensors."""
    cases = _shapes(dtype)
    cases += [torch.full((33,), math.nan).to(dtype), torch.full((9, 2), -math.inf).to(dtype)]
    cases += [random_values(4 * 5 * 6 * 7, 9, -20.0, 20.0).to(dtype).view(4, 5, 6, 7)[:, ::2, 1:, ::3]]
    for x in cases:
        if dtype == torch.float8_e4m3fn and x.numel() and bool(torch.isinf(x.double()).all()):
            continue  # e4m3fn has no inf
        row = all_engines_agree(x)
        assert observed(decode(row)) == reference(x)


@needs_interpreter
def test_fp64_beyond_fp32_range_every_engine() -> None:
    """fp64 values outside fp32's exponents (and fp64 subnormals) fold into the end bins the same way, and a
    tiny amax moves the current-scaling bound below fp32's range."""
    x = torch.tensor(
        [5e-324, 1e-310, 1e-300, 1e-46, 1e39, 1e300, 1.7e308, -(2.0**-1074), 0.0], dtype=torch.float64
    )
    all_engines_agree(x)
    all_engines_agree(torch.tensor([1e-300, 2e-300, 3e-310], dtype=torch.float64))
    all_engines_agree(torch.tensor([1e300, 1.5e308, 1.0], dtype=torch.float64))


@needs_interpreter
def test_triton_grid_of_many_programs() -> None:
    """More blocks than programs: each program loops; the per-program partial sums, maxima and minima merge
    through the atomics into the same row."""
    x = random_values(10_000, 11, -140.0, 127.99).float()  # 20 blocks of 512: up to 7 programs loop 3 times
    buf = StatsBuffer(1, "cpu", engine="triton")
    part = buf.primary
    assert part is not None and part._triton is not None
    for programs in (1, 3, 7):
        part._triton.max_programs = programs
        buf.reset()
        buf.accumulate(x, 0)
        assert (buf.to_host()[0] == rows_of(x, "c")).all()


@needs_interpreter
def test_triton_accumulates_and_assigns_like_the_c_kernel() -> None:
    a = random_values(300, 1, -30.0, 30.0).bfloat16()
    b = random_values(200, 2, -140.0, 120.0).float()
    for engine in ("triton", "c"):
        buf = StatsBuffer(2, "cpu", engine=engine)
        buf.accumulate(a, 0)
        buf.accumulate(b, 0)
        buf.accumulate(b, 1)
        buf.accumulate(a, 1, assign=True)
        got = buf.to_host()
        if engine == "triton":
            tri = got
    assert (tri == got).all()
    # two calls are two tensors for the fp8 current-scaling counts: the merge of their rows
    assert (tri[0] == merge_rows(rows_of(a, "c"), rows_of(b, "c"))).all()
    assert (tri[1] == rows_of(a, "c")).all()


# ------------------------------------------------------------------------------------ one layout
FP4_TEST = replace(
    formats._make("fp4_test", 2, 1, 6.0, None, label="FP4 (test)", color="#000000"),
)


def test_layout_is_derived_from_the_formats() -> None:
    lay = LAYOUT
    assert lay.n_whatif == len(formats.WHATIF_FORMATS) and lay.n_fp8 == len(formats.FP8_FORMATS)
    assert lay.overflow_shortcut == 256.0  # e4m3's 464 is the smallest threshold
    assert stats.ROW_WIDTH == lay.width == lay.hist + stats.N_BINS
    wider = RowLayout((*LAYOUT.whatif, FP4_TEST), LAYOUT.fp8)
    assert wider.overflow_shortcut == 4.0 and FP4_TEST.overflow_min == 7.0
    assert wider.width == lay.width + 2  # one overflow and one boundary column more
    assert wider.overflow_f32_lo_bits[-1] == np.array(7.0, np.float32).view(np.int32)
    # e4m3 is strict (> 464): its smallest overflowing fp32 is the next one above 464
    e4m3 = formats.WHATIF_FORMATS.index("fp8_e4m3")
    assert float(np.array(lay.overflow_f32_lo_bits[e4m3], np.int32).view(np.float32)) == float(
        np.nextafter(np.float32(464), np.float32(1e9))
    )


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2]
)
def test_small_maximum_format_counts_every_overflow(dtype: torch.dtype) -> None:
    """A format with maximum 6 (threshold 7): values between 7 and 256 overflow it. Every engine counts them,
    against an independent count, because the shortcut is derived from the thresholds."""
    lay = RowLayout((*LAYOUT.whatif, FP4_TEST), LAYOUT.fp8)
    vals = [
        6.0,
        6.5,
        6.99,
        7.0,
        7.5,
        8.0,
        100.0,
        255.0,
        256.0,
        300.0,
        math.inf,
        -9.0,
        -6.0,
        0.25,
        0.125,
        math.nan,
    ]
    x = torch.tensor(vals, dtype=torch.float64).to(dtype)
    xd = x.double()
    expected = int(((xd.abs() >= 7.0) & ~torch.isnan(xd)).sum())
    engines = [e for e in ENGINES if e != "triton" or (HAVE_TRITON and triton_engine.interpreting())]
    got = {e: rows_of(x, e, lay) for e in engines}
    for e in engines:
        assert int(got[e][lay.overflow + lay.n_whatif - 1]) == expected, e
        # values exactly on the format's underflow boundary (0.25)
        assert int(got[e][lay.pow2_at + lay.n_whatif - 1]) == int((xd.abs() == 0.25).sum()), e
        assert (got[e] == got["c"]).all(), e
    # the standard columns are where the standard layout puts them... after the wider overflow block
    std = rows_of(x, "c")
    assert (got["c"][lay.hist :] == std[LAYOUT.hist :]).all()


def test_merge_rule_is_one() -> None:
    a = rows_of(random_values(500, 1, -30.0, 30.0).float(), "c")
    b = rows_of(random_values(700, 2, -100.0, 100.0).float(), "c")
    empty = LAYOUT.empty_rows(1).numpy()[0]
    m = merge_rows(a, b)
    assert (merge_rows(torch.from_numpy(a), torch.from_numpy(b)).numpy() == m).all()
    assert (merge_rows(a, empty) == a).all() and (merge_rows(empty, b) == b).all()
    assert m[LAYOUT.absmax_bits] == max(a[LAYOUT.absmax_bits], b[LAYOUT.absmax_bits])
    assert m[LAYOUT.absmin_bits] == min(a[LAYOUT.absmin_bits], b[LAYOUT.absmin_bits])
    ops = LAYOUT.merge_ops
    assert (ops == stats.MERGE_SUM).sum() == LAYOUT.width - 2


def test_c_kernel_rejects_a_layout_it_cannot_hold() -> None:
    with pytest.raises(ValueError, match="what-if formats"):
        RowLayout((formats.FP16,) * 17, ())


# ------------------------------------------------------------------------------------ read once
@pytest.mark.parametrize("engine", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_a_tensor_read_again_into_an_empty_row_is_copied_not_read(engine: str) -> None:
    """On the device rows (``DeviceRows``: CUDA's, run on the CPU here) the tensor just read alone into an empty
    row and given again, unchanged, for another empty row (``nn.Dropout(p=0)`` and ``nn.Identity`` return their
    input; their gradients are that same tensor) is copied from the first row, not read again. Anything else
    is read: a tensor changed in place since, a row already holding a read, a first row that held one before.
    Every row equals what reading every call gives, bit for bit."""
    a = random_values(3000, 3, -30.0, 30.0).bfloat16()
    b = random_values(500, 4, -140.0, 120.0).float()
    c = random_values(700, 5, -9.0, 9.0).half()
    d = random_values(300, 6, -20.0, 20.0).float()

    def run(again: Callable[[torch.Tensor], torch.Tensor]) -> tuple[np.ndarray, int]:
        """The calls, each later call of a tensor given as ``again(t)``; returns the rows and the reads."""
        buf = StatsBuffer(9, "cpu", engine=engine, host_rows=False)
        rows = buf.primary
        assert rows is not None and not rows.on_cpu
        reads = [0]
        if engine == "triton":
            assert rows._triton is not None
            launch = rows._triton.add

            def counted(*args: Any) -> bool:
                reads[0] += 1
                return launch(*args)

            rows._triton.add = counted  # type: ignore[method-assign]
        else:
            torch_ops = rows._by_torch_ops

            def counted_ops(x: torch.Tensor, row: int) -> None:
                reads[0] += 1
                torch_ops(x, row)

            rows._by_torch_ops = counted_ops  # type: ignore[method-assign]
        rows.add(a, 0)
        rows.add(again(a), 1)  # copied
        rows.add(again(a), 2)  # copied again (a third module returning it)
        rows.add(b, 3)
        rows.add(again(b), 0)  # row 0 holds a read: read into it
        rows.add(c, 4)
        c.mul_(1.0)  # changed in place (the same values, a new version): read
        rows.add(again(c), 5)
        rows.add(d, 6)
        rows.add(d, 6)  # the same row again: read, and its row now holds two reads
        rows.add(again(d), 7)  # (so this is read)
        rows.add(b, 8, assign=True)  # read (the last read was d's)
        rows.add(again(b), 1, assign=True)  # an assign empties row 1 (a copy of a's): b copied from row 8
        return buf.to_host(), reads[0]

    same, reads = run(lambda t: t)
    every, reads_every = run(lambda t: t.clone())  # another tensor of the same values: always read
    assert reads_every == 12 and reads == 12 - 3
    assert np.array_equal(same, every)
    assert (same[1] == rows_of(b, "c")).all() and (same[2] == rows_of(a, "c")).all()
    assert (same[0] == merge_rows(rows_of(a, "c"), rows_of(b, "c"))).all()


# ------------------------------------------------------------------------------------ memory
def test_device_scratch_is_bounded_for_a_large_tensor() -> None:
    """50M values through the torch-op device path: the scratch is a chunk's, under 64 MiB."""
    x = torch.randn(50_000_000)
    x[123] = math.inf
    buf = StatsBuffer(1, "cpu", engine="torch", host_rows=False)
    buf.accumulate(x, 0)
    assert buf.scratch_bytes < 64 << 20
    row = buf.to_host()[0]
    assert row[LAYOUT.numel] == 50_000_000 and row[LAYOUT.inf] == 1


@needs_interpreter
def test_triton_scratch_is_fixed() -> None:
    buf = StatsBuffer(1, "cpu", engine="triton")
    before = buf.scratch_bytes
    buf.accumulate(torch.randn(300_000), 0)
    assert buf.scratch_bytes == before < 1 << 20


def test_deterministic_mode_counts_the_same_without_index_add() -> None:
    x = random_values(20_000, 5, -140.0, 127.99).float()
    plain = rows_of(x, "torch-device", chunk=4096)
    torch.use_deterministic_algorithms(True)
    try:
        det = rows_of(x, "torch-device", chunk=4096)
    finally:
        torch.use_deterministic_algorithms(False)
    assert (plain == det).all() and (plain == rows_of(x, "c")).all()


# ------------------------------------------------------------------------------------ devices
def test_meta_tensor_is_skipped_and_counted() -> None:
    buf = StatsBuffer(2, "cpu")
    assert buf.accumulate(torch.empty(10, device="meta"), 1) is False
    assert buf.accumulate(torch.ones(3), 0) is True
    rows = buf.to_host()
    assert rows[1, LAYOUT.numel] == 0 and rows[0, LAYOUT.numel] == 3
    assert buf.skipped.tolist() == [0, 1] and buf.skipped_total.tolist() == [0, 1]
    buf.reset()
    assert buf.skipped.tolist() == [0, 0] and buf.skipped_total.tolist() == [0, 1]


def test_rows_on_a_device_other_than_the_buffers() -> None:
    """A buffer made for a model whose first parameter is on ``meta`` still reads CPU tensors, on the CPU."""
    buf = StatsBuffer(1, "meta")
    assert buf.engines == {}
    buf.accumulate(torch.tensor([1.0, 2.0, 0.0]), 0)
    assert buf.engines == {"cpu": engine_mod.resolve_engine(None, torch.device("cpu"))}
    row = buf.to_host()[0]
    assert row[LAYOUT.numel] == 3 and row[LAYOUT.zeros] == 1


# ------------------------------------------------------------------------------------ engine choice
def test_engine_choice_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", "torch")
    assert engine_mod.resolve_engine(None, cpu) == "torch"
    assert StatsBuffer(1, "cpu").engines == {"cpu": "torch"}
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", "cuda-magic")
    with pytest.raises(UserError, match="not an engine; use one of auto, triton, c, torch"):
        engine_mod.resolve_engine(None, cpu)
    assert "error" in engine_mod.engine_status()
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", "c")
    with pytest.raises(UserError, match="CPU only"):
        engine_mod.resolve_engine(None, torch.device("cuda"))
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(UserError, match="TRITON_INTERPRET=1") as said:
        engine_mod.resolve_engine(None, cpu)
    assert "pip install" not in str(said.value)  # (triton is there: the interpreter is the one fix)
    # without triton: both fixes in one line (it said TRITON_INTERPRET=1, and then that triton does not import)
    monkeypatch.setattr(engine_mod, "_triton_there", lambda: False)
    with pytest.raises(UserError) as said:
        engine_mod.resolve_engine(None, cpu)
    assert "triton is not installed (pip install triton), and Triton runs on CPU tensors only in its " in str(
        said.value
    )
    assert str(said.value).endswith("interpreter (TRITON_INTERPRET=1); use auto or torch")
    monkeypatch.setenv("PRECPROF_STATS_ENGINE", "auto")
    status = engine_mod.engine_status()
    assert status["requested"] == "auto" and status["cpu"] in ("c", "torch")
    assert "cuda" in status


# ------------------------------------------------------------------------------------ a real model
class _Split(torch.nn.Module):
    """The first parameter sits on ``meta`` (an auxiliary head never materialised); the rest trains on CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = torch.nn.Linear(16, 4, device="meta")
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux(x.to("meta"))  # runs, holds no data: its tensors are skipped
        return self.body(x)


def test_model_with_a_meta_submodule_trains_and_reports_the_skipped(tmp_path: Path) -> None:
    import precprof

    torch.manual_seed(0)
    model = _Split()
    opt = torch.optim.SGD(model.body.parameters(), lr=0.1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    losses = []
    with precprof.Profiler(model, optimizer=opt, sample_every=1) as prof:
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            prof.step(loss=loss)
            losses.append(loss.item())
    summary = prof.summary()
    skipped = {(s["module"], s["tensor"], s["param"]) for s in summary["skipped_tensors"]}
    assert ("aux", "weight", "weight") in skipped and ("aux", "activation", "") in skipped
    assert all(s["count"] == 3 for s in summary["skipped_tensors"])
    assert summary["device"] == "cpu" and set(summary["stats_engine"]["used"]) == {"cpu"}
    layers = prof.tables()["layers"]
    assert "aux" not in set(layers["module"]) and "body.0" in set(layers["module"])
    prof.save(tmp_path / "run", render=True)
    html = (tmp_path / "run" / "report.html").read_text()
    assert 'id="skipped-tensors"' in html and "<code>aux</code>" in html
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------------------------ nothing compiles in a hook
def _triton_keys(kernel: object, calls: list[tuple[tuple, dict]]) -> set[str]:
    """Triton's own cache key (the specialisation its launcher computes, for an sm_90 target: no GPU needed)
    of each recorded call of ``kernel``, rebuilt as the JITFunction CUDA would run."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    from precprof.stats import triton_kernels as tk

    kw = {tk._rows_strided: tk.JIT_KW_STRIDED, tk._rows_many: tk.JIT_KW_MANY}.get(kernel, tk.JIT_KW)
    jf = JITFunction(kernel.fn, **kw)  # type: ignore[attr-defined]
    binder = create_function_from_signature(jf.signature, jf.params, make_backend(GPUTarget("cuda", 90, 32)))
    return {str(binder(*args, **kwargs)[1:]) for args, kwargs in calls}


@needs_interpreter
def test_warm_up_compiles_every_variant_a_tensor_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm-up at attach hands Triton every specialisation ``accumulate`` later launches: tensors of every
    dtype read by the engine, contiguous (aligned or not, any size, including past 2^31-element strides'
    int32 range in their arguments' values), strided, transposed, expanded, 0-dim, in any row, one a launch
    or many (``add_many``). Checked on
    Triton's own keys (its binder for an sm_90 target), so a specialisation the engine does not model (an
    integer's value, a pointer's alignment) would show."""
    from precprof.stats import triton_kernels as tk

    calls: dict[str, list[tuple[tuple, dict]]] = {"warm": [], "launch": []}
    for kernel in (tk._rows, tk._rows_strided, tk._rows_many):
        run = kernel.run

        def spy(*args: object, grid: object, warmup: bool, _run=run, _k=kernel, **kwargs: object) -> object:
            calls["warm" if warmup else "launch"].append((_k, args, kwargs))
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", spy)
    dtypes = list(triton_engine.KINDS)
    buf = StatsBuffer(7, "cpu", engine="triton", dtypes=dtypes)
    part = buf.primary
    assert part is not None and part._triton is not None
    assert len(calls["warm"]) == 4 * len(dtypes) and not calls["launch"]
    for i, dtype in enumerate(dtypes):
        # 1000 values, a fifth of the interpreter's blocks of the 5000 this test read before: every size and
        # stride below falls where it fell then among what Triton specialises on (1, a multiple of 16, neither)
        x = random_values(1000, i, -20.0, 20.0).to(dtype)
        cases = [x, x[1:], x[3:515], x[::2], x.view(10, 100).t(), x.view(10, 100)[:, 1:], x[7], x[:1]]
        cases += [x[:10].view(2, 5).expand(3, 2, 5), x.view(2, 5, 100)[:, ::2, 1::3]]
        for j, t in enumerate(cases):
            buf.accumulate(t, j % 7)
        part.add_many([x[:64], x[:1], x[::2][:64]], [0, 1, 2])  # two aligned (one launch), one strided
    assert calls["launch"]
    for kernel in (tk._rows, tk._rows_strided, tk._rows_many):
        warm = _triton_keys(kernel, [(a, k) for kk, a, k in calls["warm"] if kk is kernel])
        launched = _triton_keys(kernel, [(a, k) for kk, a, k in calls["launch"] if kk is kernel])
        assert launched and launched <= warm, launched - warm
    # the engine's own account of the variants agrees: what it warms is what it launches
    seen = {triton_engine.variant(t) for t in (x, x[1:], x.view(10, 100).t())}
    assert seen <= set(triton_engine.variants_of([x.dtype]))


@needs_interpreter
def test_one_launch_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row statistics take one kernel launch per tensor (the last program writes the row), whatever its size,
    dtype or layout; none when it is empty."""
    from precprof.stats import triton_kernels as tk

    launches = []
    for kernel in (tk._rows, tk._rows_strided):
        run = kernel.run

        def spy(*args: object, grid: object, warmup: bool, _run=run, **kwargs: object) -> object:
            if not warmup:
                launches.append(grid)
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", spy)
    buf = StatsBuffer(1, "cpu", engine="triton")
    cases = [random_values(20_000, 1, -30.0, 30.0).float(), torch.ones(3).bfloat16(), torch.zeros(0)]
    cases += [
        random_values(6000, 2, -9.0, 9.0).half().view(60, 100).t(),
        torch.tensor(2.0, dtype=torch.float64),
    ]
    for x in cases:
        before = len(launches)
        buf.accumulate(x, 0)
        assert len(launches) - before == (1 if x.numel() else 0)
    want = np.zeros(LAYOUT.width, dtype=np.int64)
    for x in cases:
        want = merge_rows(want, rows_of(x, "c")) if x.numel() else want
    want[LAYOUT.absmin_bits] = min(rows_of(x, "c")[LAYOUT.absmin_bits] for x in cases if x.numel())
    assert (buf.to_host()[0] == want).all()


def test_a_failed_triton_import_is_cached_only_when_triton_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transient error while importing triton (a CUDA error, a sync under sync-debug mode) is reported for
    that call and tried again on the next: it never disables the engine for the run as "triton missing". An
    ImportError is remembered."""
    monkeypatch.setattr(triton_engine, "_state", {})
    failures = [RuntimeError("called a synchronizing CUDA operation")] * 2

    def flaky() -> None:
        if failures:
            raise failures.pop()

    monkeypatch.setattr(triton_engine, "_import_triton", flaky)
    why = triton_engine.triton_missing()
    assert why is not None and "synchronizing" in why and "pip install" not in why
    assert triton_engine._kernels() == why and "kernels" not in triton_engine._state
    if HAVE_TRITON:
        assert triton_engine.triton_missing() is None
        assert not isinstance(triton_engine._kernels(), str)
    monkeypatch.setattr(triton_engine, "_state", {})

    def missing() -> None:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(triton_engine, "_import_triton", missing)
    assert "pip install triton" in (triton_engine.triton_missing() or "")
    monkeypatch.setattr(triton_engine, "_import_triton", lambda: None)
    assert "pip install triton" in (triton_engine.triton_missing() or "")  # remembered
    assert isinstance(triton_engine._kernels(), str)


@needs_interpreter
@pytest.mark.parametrize(
    ("dtype", "rare_after", "stages"),
    [
        *(
            (dt, after, 1)
            for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
            for after in (False, True)
        ),
        (torch.float32, True, 3),  # (the interpreter runs the pipelined loop as written: one dtype is enough)
    ],
)
def test_triton_window_and_rare_values(
    dtype: torch.dtype, rare_after: bool, stages: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton kernel's two paths give the C kernel's row: values in the program's window of binades, and
    the rare ones (subnormals, far below or above the window, past the overflow shortcut, inf, nan), which a
    block with few of them counts by one atomic each and a block with many by a histogram. Blocks of 512 (the
    default): a few rare values in a block, blocks made of them, an all-nan tensor, and first blocks of zeros
    (the window then sits around 1). ``rare_after``: the rare values in a second loop over the program's blocks
    (``triton_engine.RARE_AFTER``), with the last, partial block's among them. ``stages``: the main loop
    pipelined (``triton_engine.STAGES``; the interpreter runs it as written, a GPU with asynchronous copies)."""
    monkeypatch.setattr(triton_engine, "RARE_AFTER", rare_after)
    monkeypatch.setattr(triton_engine, "STAGES", stages)
    g = torch.Generator().manual_seed(3)
    calm = torch.randn(3 * 2048, generator=g) * 0.01  # 12 blocks: three a program
    few = calm.clone()
    few[[5, 900, 3000, 5000]] = torch.tensor([1e-41, 3e5, math.inf, 2.0**-60])
    wild = torch.exp2(torch.randint(-149, 128, (2 * 2048,), generator=g).float()) * torch.rand(
        2 * 2048, generator=g
    )
    zeros_first = torch.cat([torch.zeros(4096), calm[:5000] * 1e-3])
    rare_last = torch.cat([calm[:4100], torch.tensor([math.inf, 2.0**-60, 1e-41])])  # in the partial block
    cases = [few, wild, torch.full((5000,), math.nan), zeros_first, torch.cat([calm, wild]), rare_last]
    for x in cases:
        x = x.to(dtype)
        got, want = rows_of(x, "triton"), rows_of(x, "c")
        assert (got == want).all(), np.flatnonzero(got != want)
        assert observed(decode(got)) == reference(x)


def test_block_formats_off_the_c_engine_never_touch_the_c_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block statistics read by another engine (Triton on CUDA; here the torch ops) never ask for the C
    kernel's threads: that loads the kernel, and on a machine's first run builds it with the C compiler. On an
    H100 that ran inside the first sampled step's first block-format hook (7 subprocesses, 1.4 s)."""
    import precprof.stats.rows as rows_mod
    import precprof.stats.rows_host as rows_host_mod

    def no(*a: object) -> int:
        raise AssertionError("the C kernel was asked for")

    monkeypatch.setattr(rows_mod, "_default_kernel_threads", no)
    monkeypatch.setattr(rows_host_mod, "_kernel", no)
    buf = StatsBuffer(2, "cpu", engine="torch")
    assert buf.accumulate(torch.randn(8, 64), 0, blocks=True)
    assert buf.blocks_seen[0] and buf.blocks_to_host()[0].any()


def test_a_direct_launch_is_kept_only_where_its_check_passes() -> None:
    """``triton_launch.adopt_direct``: a launcher whose check passes is kept; one whose check fails, or whose
    making raises (a Triton whose launcher takes other arguments), leaves its key to Triton's launch, and the
    status says which and why."""

    def make(key: str, compiled: int) -> int:
        if compiled < 0:
            raise TypeError("launcher takes other arguments")
        return compiled * 10

    into: dict[str, int] = {}
    why = triton_launch.adopt_direct(
        into, [("a", 1), ("b", 2), ("c", -1)], make, lambda key, launcher: launcher != 20, "rows differ"
    )
    assert into == {"a": 10}
    assert why == ["b: rows differ", "c: TypeError: launcher takes other arguments"]
    status = triton_launch.direct_status(len(into), "variants", why)
    assert status == (
        "direct launch of 1 compiled variants; Triton's launch for the others "
        "(b: rows differ; c: TypeError: launcher takes other arguments)"
    )
    assert triton_launch.direct_status(3, "dtypes", []) == "direct launch of 3 compiled dtypes"


def test_a_register_bound_is_a_compile_option_where_triton_takes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """``triton_launch.register_bound``: ptxas's ``maxnreg`` where a GPU compiles and this Triton takes it
    (its CUDA options name it), nothing for no bound or in the interpreter, which has no registers."""
    pytest.importorskip("triton")
    from triton.backends.nvidia.compiler import CUDAOptions

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    takes = "maxnreg" in CUDAOptions.__dataclass_fields__
    assert triton_launch.register_bound(80) == ({"maxnreg": 80} if takes else {})
    assert triton_launch.register_bound(None) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_launch.register_bound(80) == {}

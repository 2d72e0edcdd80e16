"""Many tensors in one launch of the Triton row kernel (``triton_kernels._rows_many``, ``TritonRows.add_many``):
a sampled step's parameters, then its gradients, read up to 16 a launch. Run in Triton's interpreter on CPU
tensors (conftest sets ``TRITON_INTERPRET=1`` without CUDA); the rows are checked against the C kernel, an
independent implementation, and against one launch per tensor, bit for bit."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from precprof.stats import StatsBuffer, triton_engine

pytestmark = pytest.mark.skipif(
    triton_engine.unavailable(torch.device("cpu")) is not None or not triton_engine.interpreting(),
    reason="needs triton with TRITON_INTERPRET=1 (pip install triton; conftest sets it without CUDA)",
)


def _hand_built(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` values of ``dtype`` holding what the kernel treats apart: zeros, powers of two (on the what-if
    formats' underflow boundaries among them), fp32 and fp16 subnormals, values far above and below the
    program's window, inf and nan (where the dtype has them), the rest spread over 2^-30..2^30."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * 60 - 30)
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    special = [
        0.0,
        2.0**-24,
        2.0**-133,
        2.0**-149,
        2.0**-126,
        2.0**-14,
        2.0**-9,
        2.0**-6,
        2.0**100,
        2.0**-100,
    ]
    special += [65504.0, 448.0, 3e38, 1.5 * 2.0**-140, math.inf, -math.inf, math.nan]
    for i, v in enumerate(special):
        if 3 * i < n:
            x[3 * i] = v
    return x.to(dtype)


def _c_rows(tensors: list[torch.Tensor], rows: list[int], n_rows: int) -> np.ndarray:
    c = StatsBuffer(n_rows, "cpu", engine="c")
    for t, r in zip(tensors, rows, strict=True):
        c.accumulate(t.contiguous(), r)
    return c.to_host()


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every launch (not compile) of the three row kernels: (kernel, grid)."""
    from precprof.stats import triton_kernels as tk

    launches: list[tuple[str, Any]] = []
    for name in ("_rows", "_rows_strided", "_rows_many"):
        kernel = getattr(tk, name)

        def spy(*args: object, grid: object, warmup: bool, _run=kernel.run, _n=name, **kw: object) -> object:
            if not warmup:
                launches.append((_n, grid))
            return _run(*args, grid=grid, warmup=warmup, **kw)

        monkeypatch.setattr(kernel, "run", spy)
    return launches


def test_a_dtypes_tensors_go_sixteen_a_launch_with_the_c_kernels_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """20 fp32 tensors (from one value to several blocks a program, each with rare values) in two launches,
    bf16, fp16, fp8 and fp64 ones in one each; a strided view, a view off a 16-byte boundary, a view of four
    strided dimensions (the torch-op path) and an empty tensor beside them take their own path. Every row equals the C kernel's, bit for bit."""
    launches = _spy(monkeypatch)
    # (the interpreter runs 4 programs: from 1,537 values up, a program reads more than one block)
    sizes = [1, 2, 7, 33, 511, 512, 513, 700, 1024, 1500, 2048, 2049, 2600, 3, 17, 9, 64, 100, 257, 1100]
    tensors = [_hand_built(n, i, torch.float32) for i, n in enumerate(sizes)]
    for j, dtype in enumerate((torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float64)):
        tensors += [_hand_built(n, 100 + 10 * j + k, dtype) for k, n in enumerate((5, 600, 2100))]
    odd = [
        _hand_built(900, 7, torch.float32).view(30, 30)[:, :17],
        _hand_built(901, 8, torch.float32)[1:],
        torch.zeros(0),
        _hand_built(4096, 9, torch.float32).view(8, 8, 8, 8)[::2, 1::2, ::2, 1::2],  # 4 strides: torch ops
    ]
    tensors += odd
    rows = list(range(len(tensors)))[::-1]  # any row for any tensor
    buf = StatsBuffer(len(tensors), "cpu", engine="triton", dtypes=list(triton_engine.KINDS))
    part = buf.primary
    assert part is not None and part._triton is not None
    launches.clear()
    part.add_many(tensors, rows)
    many = [grid for name, grid in launches if name == "_rows_many"]
    assert sorted(g[1] for g in many) == [3, 3, 3, 3, 4, 16]  # 20 fp32 in 16 + 4, three of each other dtype
    # a launch's programs are those of its largest tensor (the engine sorts a dtype's tensors by size)
    assert all(g[0] <= part._triton.max_programs for g in many)
    assert sorted(name for name, _ in launches if name != "_rows_many") == ["_rows", "_rows_strided"]
    # the C kernel's rows (those of one launch a tensor too: test_triton_reads.py)
    assert np.array_equal(buf.to_host(), _c_rows(tensors, rows, len(tensors)))
    # the scratch of every slot is left zeroed (its absmin word at the "none yet" sentinel) for the next launch
    scratch = part._triton.scratch.view(triton_engine.SLOTS, triton_engine.SCRATCH_WORDS)
    assert not scratch[:, : triton_engine._MN].any() and not scratch[:, triton_engine._DONE].any()


def test_assign_clears_rows_written_before_and_a_row_given_twice_keeps_the_last() -> None:
    """``add_many(..., assign=True)`` (the gradients of a step) replaces what the rows held; a row named twice
    with ``assign`` keeps the last tensor, as one ``add`` each does."""
    a, b = _hand_built(3000, 1, torch.float32), _hand_built(40, 2, torch.float32)
    c, d = _hand_built(700, 3, torch.bfloat16), _hand_built(9, 4, torch.float32)
    buf = StatsBuffer(3, "cpu", engine="triton")
    part = buf.primary
    assert part is not None
    part.add_many([d, d, d], [0, 1, 2])
    part.add_many([a, b, c], [0, 1, 2], assign=True)
    assert np.array_equal(buf.to_host(), _c_rows([a, b, c], [0, 1, 2], 3))
    part.add_many([a, b, c], [1, 1, 2], assign=True)
    assert np.array_equal(buf.to_host()[1:], _c_rows([b, c], [0, 1], 2))


def test_each_tensor_of_a_launch_is_read_once_but_a_window_probe(interpreter_loads: Counter[int]) -> None:
    """One pass per tensor in a shared launch too: each element of each tensor is loaded at least once, and
    the only second reads are each program's first block (its exponent window's probe); no program reads
    another slot's tensor."""
    reads = interpreter_loads
    # values inside every program's window (no rare value: a program that meets one reads its blocks again)
    tensors = [torch.linspace(-3, 3, n).bfloat16() for n in (3, 512, 1100, 2600)]
    buf = StatsBuffer(4, "cpu", engine="triton")
    part = buf.primary
    assert part is not None and part._triton is not None
    part.add_many(tensors, [0, 1, 2, 3])
    most_extra = part._triton.max_programs * triton_engine.BLOCK
    for x in tensors:
        lo = x.data_ptr()
        mine = Counter({a: k for a, k in reads.items() if lo <= a < lo + x.numel() * x.element_size()})
        want = {lo + 2 * i for i in range(x.numel())}
        assert set(mine) == want
        assert 0 <= sum(mine.values()) - len(want) <= most_extra


def test_the_direct_launcher_calls_the_compiled_launcher_as_tritons_launch_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``_DirectLaunch``: the grid (programs, tensors, 1), the stream, the kernel's arguments then its
    constexprs in order; no launch metadata and no hook when there is no hook to call (Triton's default, an
    empty chain of hooks), and Triton's own metadata with the hook when a profiler set one."""
    import triton

    from precprof.stats import triton_kernels as tk
    from precprof.stats.triton_launch import _DirectLaunch

    calls: list[tuple[Any, ...]] = []

    class Compiled:
        function, packed_metadata = "fn", "packed"

        def run(self, *a: Any) -> None:
            calls.append(a)

        def launch_metadata(self, grid: Any, stream: int, *args: Any) -> Any:
            return ("meta", grid, stream, len(args))

    consts = {name: i for i, name in enumerate(tk._rows_many.arg_names[55:])}
    assert tk._rows_many.arg_names[:2] == ["x0", "x1"] and next(iter(consts)) == "KIND"
    launch = _DirectLaunch(tk._rows_many, Compiled(), consts)
    args = tuple(range(55))
    launch(7, 123, args, 3)
    assert calls[-1] == (7, 3, 1, 123, "fn", "packed", None, None, None, *args, *consts.values())
    # Triton's own default: empty chains of hooks (none to call), or no hook at all
    chain_type = type(triton.knobs.runtime.launch_enter_hook)
    for nothing in (chain_type(), None):
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", nothing)
        monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", nothing)
        launch(7, 123, args, 3)
        assert calls[-1] == (7, 3, 1, 123, "fn", "packed", None, None, None, *args, *consts.values())
    seen: list[Any] = []
    chain = chain_type()
    chain.add(seen.append)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", chain)
    launch(2, 5, args)
    meta = ("meta", (2, 1, 1), 5, 55 + len(consts))
    assert calls[-1] == (2, 1, 1, 5, "fn", "packed", meta, chain, None, *args, *consts.values())


def test_the_row_launch_bench_reads_gpt2_smalls_parameters_in_ten_launches(tmp_path: Any) -> None:
    """``bench/row_launch_host.py`` (precprof's Python up to the launcher, the launcher a no-op): GPT-2 small's
    148 parameters take 148 launches one by one and 10 with ``add_many`` (9 of 16, one of 4), each tensor in
    exactly one."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "row_launch_host.py"
    spec = importlib.util.spec_from_file_location("_row_launch_host", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(["--rounds", "1", "--reps", "2", "--out", str(tmp_path / "r.json")])
    assert out["one_each"]["launches"] == 148 and out["one_each"]["tensors_launched"] == 148
    assert out["many"]["launches"] == 10 and out["many"]["tensors_launched"] == 148
    assert json.loads((tmp_path / "r.json").read_text())["tensors"] == 148


def test_the_direct_launch_passes_what_tritons_launch_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct launch (a GPU's) and Triton's own (the interpreter's) get the same arguments in the same
    order, tensors as their data pointers, for one tensor (``_rows``) and for many (``_rows_many``): what the
    attach's self-check then confirms on the device, checked here without one."""
    from precprof.stats import triton_kernels as tk
    from precprof.stats.layout import LAYOUT

    tensors = [_hand_built(n, n, torch.bfloat16) for n in (3, 700, 5000)]
    engine = triton_engine.TritonRows(torch.device("cpu"), LAYOUT)
    rows = LAYOUT.empty_rows(9, torch.device("cpu"))
    direct: list[tuple[int, tuple[Any, ...], int]] = []
    for v in triton_engine.variants_of([torch.bfloat16]):
        engine._direct[v] = lambda programs, stream, args, tensors=1: direct.append((programs, args, tensors))
    bound: list[tuple[Any, tuple[Any, ...]]] = []
    for kernel in (tk._rows, tk._rows_many):

        def spy(*args: Any, grid: Any, warmup: bool, **kw: Any) -> None:
            bound.append((grid, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)))

        monkeypatch.setattr(kernel, "run", spy)
    engine.add_many(tensors, rows, [4, 8, 2], stream=0)
    engine.add(tensors[1], rows, 5, stream=0)
    engine._direct.clear()
    engine.add_many(tensors, rows, [4, 8, 2], stream=0)
    engine.add(tensors[1], rows, 5, stream=0)
    assert len(direct) == len(bound) == 2
    for (programs, args, count), (grid, targs) in zip(direct, bound, strict=True):
        assert args == targs
        assert (programs, count) == ((grid[0], grid[1]) if len(grid) == 2 else (grid[0], 1))
    assert bound[0][0] == (4, 3)  # 5,000 values: 4 programs (the interpreter's most); three tensors

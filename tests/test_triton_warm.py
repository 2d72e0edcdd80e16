"""Nothing compiles inside a hook: the Triton kernels' variants compile when the Profiler attaches.

A Triton kernel compiles once per specialisation (its constexprs, and for a pointer whether its address is a
multiple of 16). On an H100 the first sampled step stalled 18.8 s compiling inside the hooks, and in
deterministic mode the first tensor compiled inside a hook under ``set_sync_debug_mode("error")``. These tests
run the kernels in Triton's interpreter on CPU tensors (conftest sets ``TRITON_INTERPRET=1`` without CUDA).
"""

from __future__ import annotations

import builtins
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import precprof
from precprof.stats import StatsBuffer, triton_engine
from precprof.stats.engine import ENGINE_ENV

pytestmark = pytest.mark.skipif(
    triton_engine.unavailable(torch.device("cpu")) is not None,
    reason=str(triton_engine.unavailable(torch.device("cpu"))),
)

ALL_DTYPES = list(triton_engine.KINDS)


def layouts(dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors of every layout a hook may hand over: contiguous, off a 16-byte boundary, sliced, transposed,
    expanded, 2-D and 3-D views, a scalar."""
    base = torch.linspace(-3, 3, 4096 + 64).to(dtype)
    m = base[:4096].view(64, 64)
    cube = base[:4096].view(16, 16, 16)
    return [
        base,
        base[1:],
        base[3:1000],
        base[::3],
        m.t(),
        m[:, :17],
        m[::2, 1::2],
        cube.permute(2, 0, 1),
        cube[:, ::2, 1:],
        base[:8].view(8, 1).expand(8, 16),
        base[5:6].reshape(()),
    ]


def test_every_layout_launches_a_variant_the_warm_up_compiled() -> None:
    buf = StatsBuffer(2, "cpu", engine="triton", warm_dtypes=ALL_DTYPES)
    assert buf.warmed  # compiled when the device's rows were made
    for dtype in ALL_DTYPES:
        for x in layouts(dtype):
            v = triton_engine.launch_variant(x)
            assert v is None or v in buf.warmed, (dtype, tuple(x.shape), x.stride(), x.storage_offset(), v)


def test_both_kernels_give_the_c_kernels_rows() -> None:
    """``_pass`` (aligned contiguous) and ``_pass_any`` (everything else) are one kernel body."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        for x in layouts(dtype)[:4]:
            tri = StatsBuffer(1, "cpu", engine="triton")
            tri.accumulate(x, 0)
            c = StatsBuffer(1, "cpu", engine="c")
            c.accumulate(x.contiguous(), 0)
            assert np.array_equal(tri.to_host(), c.to_host()), (dtype, triton_engine.launch_variant(x))


def test_a_transient_import_failure_is_not_remembered_as_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under ``set_sync_debug_mode("error")`` importing triton raised on an H100, and that text was kept as
    "triton does not import" for the rest of the process."""
    monkeypatch.setattr(triton_engine, "_state", {})
    real_import = builtins.__import__
    fail = {"once": True}

    def flaky(name: str, *args: object, **kw: object) -> object:
        if name == "triton" and fail["once"]:
            fail["once"] = False
            raise RuntimeError("called a synchronizing CUDA operation")
        return real_import(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", flaky)
    why = triton_engine.triton_missing()
    assert why is not None and "synchronizing" in why and "pip install" not in why
    assert triton_engine.triton_missing() is None  # tried again: it imports
    assert not isinstance(triton_engine._kernels(), str)


def test_a_profiled_step_launches_only_what_attach_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_ENV, "triton")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    launched: list[tuple[str, int, int, bool] | None] = []
    real_add = triton_engine.TritonRows.add

    def spy(self: triton_engine.TritonRows, x: torch.Tensor, rows: torch.Tensor, row: int) -> bool:
        launched.append(triton_engine.launch_variant(x))
        return real_add(self, x, rows, row)

    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, block_formats=False)
    with prof:
        assert prof._buffer is not None
        warmed = set(prof._buffer.warmed)
        monkeypatch.setattr(triton_engine.TritonRows, "add", spy)
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(torch.randn(4, 16))
            y.float().square().mean().backward()
            opt.step()
            prof.step()
    assert prof.summary()["stats_engine"]["used"] == {"cpu": "triton"}
    assert launched and all(v in warmed for v in launched), set(launched) - warmed


class _Counted:
    """A jitted kernel whose launches are counted."""

    def __init__(self, kernel: object, log: list[str], name: str) -> None:
        self.kernel, self.log, self.name = kernel, log, name

    def __getitem__(self, grid: object) -> object:
        launch = self.kernel[grid]  # type: ignore[index]

        def run(*args: object, **kw: object) -> object:
            self.log.append(self.name)
            return launch(*args, **kw)

        return run


def test_one_launch_per_tensor() -> None:
    """Row statistics take one kernel launch per inspected tensor (the last program writes the row; a second
    kernel did that before, 486 more launches in a sampled gpt2-small step), in every layout, and the rows
    still equal the C kernel's."""
    buf = StatsBuffer(1, "cpu", engine="triton", warm_dtypes=ALL_DTYPES)
    rows = buf._parts[torch.device("cpu")]._triton
    assert rows is not None
    log: list[str] = []
    rows._pass = _Counted(rows._pass, log, "pass")
    rows._pass_any = _Counted(rows._pass_any, log, "pass_any")
    ref = StatsBuffer(1, "cpu", engine="c")
    tensors = [x for dtype in (torch.float32, torch.bfloat16, torch.float64) for x in layouts(dtype)]
    for x in tensors:
        buf.accumulate(x, 0)
        ref.accumulate(x.contiguous(), 0)
    assert len(log) == len(tensors)
    assert set(log) == {"pass", "pass_any"}
    assert np.array_equal(buf.to_host(), ref.to_host())


def _element_addresses(x: torch.Tensor) -> list[int]:
    """The byte address of every logical element of x (a stride-0 dimension repeats addresses)."""
    offsets = torch.zeros(x.shape, dtype=torch.int64)
    for d, (size, stride) in enumerate(zip(x.shape, x.stride(), strict=True)):
        shape = [1] * x.dim()
        shape[d] = size
        offsets = offsets + torch.arange(size).view(shape) * stride
    return (x.data_ptr() + offsets.reshape(-1) * x.element_size()).tolist()


def test_each_element_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass per tensor: every load of the tensor's storage that the interpreter executes is counted, and
    each logical element is read exactly once (no second pass, in any layout)."""
    from collections import Counter

    from triton.runtime import interpreter

    reads: Counter[int] = Counter()
    real = interpreter.InterpreterBuilder.create_masked_load

    def counted(self: object, ptrs: Any, mask: Any, *args: object) -> object:
        reads.update(ptrs.data[mask.data].tolist())
        return real(self, ptrs, mask, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counted)
    buf = StatsBuffer(1, "cpu", engine="triton", warm_dtypes=ALL_DTYPES)
    for dtype in (torch.bfloat16, torch.float64):  # a 2-byte and an 8-byte element: every address counts
        for x in layouts(dtype):
            reads.clear()
            buf.accumulate(x, 0)
            lo = x.untyped_storage().data_ptr()
            hi = lo + x.untyped_storage().nbytes()
            of_x = Counter({a: n for a, n in reads.items() if lo <= a < hi})
            assert of_x == Counter(_element_addresses(x)), (dtype, tuple(x.shape), x.stride())

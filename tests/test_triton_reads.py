"""The Triton row-statistics kernels in every layout a hook hands over: the C kernel's rows, and one read of
each element (issue 26's "reads per tensor"). They run in Triton's interpreter on CPU tensors (conftest sets
``TRITON_INTERPRET=1`` without CUDA); the warm-up and launch counts are tested in test_stats_engines.py.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from _s129a_interpreter import skip_nested_patching

from precprof.stats import StatsBuffer, triton_compile, triton_engine

pytestmark = pytest.mark.skipif(
    triton_engine.unavailable(torch.device("cpu")) is not None,
    reason=str(triton_engine.unavailable(torch.device("cpu"))),
)

ALL_DTYPES = list(triton_engine.KINDS)


@pytest.fixture(scope="module", autouse=True)
def _interpreter_patches_once_a_launch() -> Iterator[None]:
    """In the interpreter, a launch patches triton.language once, not again at each call of a kernel's helper
    (tests/_s129a_interpreter.py: the same arithmetic, less CPU time)."""
    with skip_nested_patching():
        yield


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


def test_every_layout_gives_the_c_kernels_rows() -> None:
    """The contiguous and the strided kernels, in every layout a hook hands over, equal the C kernel."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        for x in layouts(dtype):
            tri = StatsBuffer(1, "cpu", engine="triton")
            tri.accumulate(x, 0)
            c = StatsBuffer(1, "cpu", engine="c")
            c.accumulate(x.contiguous(), 0)
            assert np.array_equal(tri.to_host(), c.to_host()), (dtype, tuple(x.shape), x.stride())


def _element_addresses(x: torch.Tensor) -> list[int]:
    """The byte address of every logical element of x (a stride-0 dimension repeats addresses)."""
    offsets = torch.zeros(x.shape, dtype=torch.int64)
    for d, (size, stride) in enumerate(zip(x.shape, x.stride(), strict=True)):
        shape = [1] * x.dim()
        shape[d] = size
        offsets = offsets + torch.arange(size).view(shape) * stride
    return (x.data_ptr() + offsets.reshape(-1) * x.element_size()).tolist()


def test_each_element_is_read_once_but_a_window_probe(interpreter_loads: Counter[int]) -> None:
    """One pass per tensor: every load of the tensor's storage that the interpreter executes is counted. Each
    logical element is read at least once, and the only second reads are each program's first block, which it
    reads once more to place its exponent window: at most ``max_programs x BLOCK`` elements, whatever the size
    (a 256M-element tensor on an H100: 528 x 4,096 = 0.8% more)."""
    reads = interpreter_loads
    buf = StatsBuffer(1, "cpu", engine="triton", dtypes=ALL_DTYPES)
    part = buf.primary
    assert part is not None and part._triton is not None
    most_extra = part._triton.max_programs * triton_engine.BLOCK
    for dtype in (torch.bfloat16, torch.float64):  # a 2-byte and an 8-byte element: every address counts
        for x in layouts(dtype):
            reads.clear()
            buf.accumulate(x, 0)
            lo = x.untyped_storage().data_ptr()
            hi = lo + x.untyped_storage().nbytes()
            of_x = Counter({a: n for a, n in reads.items() if lo <= a < hi})
            want = Counter(_element_addresses(x))
            where = (dtype, tuple(x.shape), x.stride())
            assert set(of_x) == set(want), where  # every element, nothing else of the storage
            assert all(of_x[a] >= n for a, n in want.items()), where
            assert 0 <= sum(of_x.values()) - sum(want.values()) <= most_extra, where


def test_kernels_compiled_beside_the_training_are_ready_and_say_how_long() -> None:
    """``background=True``: the compile runs on a thread; ``ready`` turns true once it is done, with its time and
    its parts (compile, load, check) in order, and the rows then read what the constructor's compile reads."""
    beside = StatsBuffer(2, "cpu", engine="triton", host_rows=False, background=True)
    beside.wait_ready()
    assert beside.ready and beside.warm_error is None and beside.warm_s is not None
    phases = beside.warm_phases
    assert list(phases) == ["wait", "compile", "load", "check"]
    ends = [b for _, b in phases.values()]
    assert all(a <= b for a, b in phases.values()) and ends == sorted(ends)
    assert (
        ends[-1] <= beside.warm_s + 0.0005
    )  # the phases are rounded to the millisecond (a cached compile: <1 ms)
    at_once = StatsBuffer(2, "cpu", engine="triton", host_rows=False)
    assert at_once.ready and at_once.warm_s is None  # compiled in the constructor, nothing beside
    x = torch.linspace(-3, 3, 999)
    for buf in (beside, at_once):
        buf.accumulate(x, 1)
    assert torch.equal(beside.dense(), at_once.dense())


def test_a_second_compile_of_the_same_kernels_waits_for_the_one_in_flight() -> None:
    """Profilers attached back to back compile one at a time in a process: a buffer whose kernels another
    buffer is compiling waits (its "wait" phase) and then loads them from the cache, rather than compiling
    beside it (on an H200, five such compiles at once slowed the training thread's steps up to 11x)."""
    from precprof.stats import buffer as B

    first = StatsBuffer(2, "cpu", engine="triton", host_rows=False)  # its kernels: those the next one needs
    blocks = bool(len(first.block_rows))
    lock = B._compile_lock(torch.device("cpu"), first.dtypes, blocks)
    assert lock is B._compile_lock(torch.device("cpu"), first.dtypes, blocks)  # one per kernel set
    with lock:  # a compile of these kernels in flight
        waiting = StatsBuffer(2, "cpu", engine="triton", host_rows=False, background=True)
        time.sleep(0.3)
        assert not waiting.ready and waiting.warm_s is None
    waiting.wait_ready()
    assert waiting.warm_error is None
    wait0, wait1 = waiting.warm_phases["wait"]
    assert wait0 == 0.0 and wait1 >= 0.25
    assert waiting.warm_phases["compile"][0] >= wait1
    x = torch.linspace(-3, 3, 999)
    for buf in (first, waiting):
        buf.accumulate(x, 1)
    assert torch.equal(first.dense(), waiting.dense())


def test_the_compiler_is_imported_before_the_compile_threads_start() -> None:
    """``preload_compiler`` imports, in the calling thread (the Profiler's attach), what a first compile would
    import on the compile threads, where it held the interpreter lock from the training thread
    (bench/compile_contention.py). Run without the interpreter (nothing compiles under it: it imports nothing)."""
    import os
    import subprocess
    import sys

    assert triton_compile.preload_compiler() == []  # the suite runs under TRITON_INTERPRET=1
    code = (
        "import sys, json\n"
        "from precprof.stats import triton_compile as tc\n"
        "done = tc.preload_compiler()\n"
        "print(json.dumps([done, [m for m in tc._COMPILER_MODULES if m in sys.modules], tc.preload_compiler()]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    import json

    done, present, again = json.loads(out.stdout.strip().splitlines()[-1])
    assert "triton.compiler.code_generator" in done and set(done) <= set(present)
    assert again == []  # once imported, nothing more to do


def test_another_block_and_warps_write_the_same_rows() -> None:
    """``TritonRows(block=, num_warps=, rare_after=, planes=)`` (the shapes gpu_validate sweeps on a GPU for the
    kernel's registers and occupancy): the full blocks, the partial last one and the programs follow the block,
    and every layout gives the C kernel's rows (the default block's, by the test above)."""
    from precprof.stats.layout import LAYOUT

    default = triton_engine.TritonRows(torch.device("cpu"), LAYOUT)
    cpu = torch.device("cpu")
    shapes = (
        (1024, 8, False, False),
        (2048, 4, False, False),
        (8192, 16, False, False),
    )
    for block, warps, after, planes in (*shapes, (2048, 8, True, True)):  # (tl.histogram's, then the planes')
        other = triton_engine.TritonRows(
            torch.device("cpu"), LAYOUT, block=block, num_warps=warps, rare_after=after, planes=planes
        )
        assert (other.block, other.num_warps, other.rare_after, other.planes) == (block, warps, after, planes)
        # a chosen few variants compile alone (gpu_validate's sweep: the aligned contiguous one per dtype)
        one = [triton_engine.Variant(triton_engine.KINDS[torch.float32][0], False, True)]
        assert len(other.warm(variants=one)) == 1 and len(default.warm([torch.float32])) > 1
        for dtype in (torch.float32, torch.bfloat16):
            for x in [*layouts(dtype), torch.linspace(-5, 5, 3 * block + 17).to(dtype)]:
                got = LAYOUT.empty_rows(1, cpu)
                assert other.add(x, got, 0)
                want = StatsBuffer(1, "cpu", engine="c")
                want.accumulate(x.contiguous(), 0)
                assert np.array_equal(got.numpy(), want.to_host()), (block, dtype, tuple(x.shape), x.stride())


def test_a_rows_hint_places_the_next_tensors_window_and_every_count_stays_exact() -> None:
    """A logits' gradient (softmax minus one-hot over N tokens: most values near 2^-27, each target's -1/N
    16 binades above): a program's first block holds no target, so its window (from that block) misses the
    targets of its later blocks and every program reads its blocks twice (97% of gpt2-small's, measured by
    bench/window_reread.py). The kernel leaves the tensor's span in the row's hint; the next tensor read into
    that row gets a window over that span, and no program reads twice. A span wider than the window (28
    binades) gets its top at the largest value: only the program that holds the smallest values' tail reads
    twice. A hint from another tensor (a stale one) only moves the window: the rows equal the C kernel's every
    time."""
    g = torch.Generator().manual_seed(0)
    n = 32 * triton_engine.BLOCK  # eight blocks a program
    x = (1 + torch.rand(n, generator=g)) * 2.0**-27
    x[2 * 4 * triton_engine.BLOCK :: 997] = (
        -(1 + torch.rand(1, generator=g)) * 2.0**-11
    )  # no target in a first block
    x = x.to(torch.bfloat16)
    wide = (1 + torch.rand(n, generator=g)) * 2.0**-10
    wide[2 * 4 * triton_engine.BLOCK :: 1001] = 0.75  # larger than any first block's
    wide[4 * triton_engine.BLOCK + 7] = 2.0**-40  # a tail 39 binades below, in program 0's second block
    wide = wide.to(torch.bfloat16)
    far = torch.full((n,), 2.0**5, dtype=torch.bfloat16)  # another tensor's span: x is far below it

    tri = StatsBuffer(3, "cpu", engine="triton")
    engine = tri.primary._triton  # type: ignore[union-attr]
    assert engine is not None and engine.max_programs == 4
    c = StatsBuffer(3, "cpu", engine="c")

    def read(t: torch.Tensor, row: int) -> int:
        before = engine.rereads()
        tri.accumulate(t, row)
        c.accumulate(t, row)
        assert np.array_equal(tri.to_host(), c.to_host()), row
        return engine.rereads() - before

    assert read(x, 0) == 4  # no hint yet: every program met a target outside its window
    assert read(x, 0) == 0  # the row's hint: the window holds the whole span
    assert read(x, 0) == 0
    assert read(wide, 1) == 4  # every program met a value above its first block's window
    assert (
        read(wide, 1) == 1
    )  # too wide for the window: its top at the largest, the tail's program reads twice
    read(far, 2)
    assert read(x, 2) == 4  # a stale hint (x is 32 binades below it): read twice, counted exactly
    assert read(x, 2) == 0

"""The row kernel's histogram in bit planes (``precprof.stats.triton_planes``), counted by register logic alone:
its helpers against ``torch.bincount`` on slots built by hand (every slot, the sign bit's slot 63, counts that
fill a plane's eight bits between flushes, masked lanes), and the kernel with it against the C kernel and
against ``tl.histogram``'s kernel on tensors that take many flushes and meet rare values. Triton's interpreter
runs them on CPU tensors (conftest sets ``TRITON_INTERPRET=1`` without CUDA)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from _s129a_interpreter import skip_nested_patching

from precprof.stats import StatsBuffer, triton_engine
from precprof.stats.layout import LAYOUT

pytestmark = pytest.mark.skipif(
    triton_engine.unavailable(torch.device("cpu")) is not None,
    reason=str(triton_engine.unavailable(torch.device("cpu"))),
)

if triton_engine.unavailable(torch.device("cpu")) is None:
    import triton
    import triton.language as tl

    from precprof.stats.triton_planes import F as PLANE_ITERS
    from precprof.stats.triton_planes import add8, counts, flush

    ITERS = int(PLANE_ITERS.value)  # iterations between flushes

    @triton.jit
    def _count_slots(slots_ptr, n, nfull, out_ptr, BLOCK: tl.constexpr):
        # one program: ``slots`` (int32, 0..63) as the kernel's main loop reads values (``_sweep``): the partial
        # last block masked into the first chunk's planes, then chunks of PLANE_ITERS iterations of BLOCK values
        # in two halves, each flushed
        H: tl.constexpr = BLOCK // 2
        T: tl.constexpr = BLOCK // 8
        half = tl.arange(0, H)
        z = tl.zeros([T], tl.int64)
        lo = tl.zeros([16], tl.int64)
        hi = lo
        i = nfull * BLOCK + half
        ia = i < n
        ib = i + H < n
        ka = tl.load(slots_ptr + i, mask=ia, other=0)
        kb = tl.load(slots_ptr + i + H, mask=ib, other=0)
        p0, p1, p2, p3, p4, p5, p6, p7 = add8(ka, kb, ia, ib, z, z, z, z, z, z, z, z, T, True)
        for c in range(0, tl.maximum(nfull, 1), PLANE_ITERS):
            for blk in range(c, tl.minimum(c + PLANE_ITERS, nfull)):
                ka = tl.load(slots_ptr + blk * BLOCK + half)
                kb = tl.load(slots_ptr + blk * BLOCK + H + half)
                p0, p1, p2, p3, p4, p5, p6, p7 = add8(
                    ka, kb, ka, kb, p0, p1, p2, p3, p4, p5, p6, p7, T, False
                )
            lo, hi = flush(p0, p1, p2, p3, p4, p5, p6, p7, lo, hi)
            p0, p1, p2, p3, p4, p5, p6, p7 = z, z, z, z, z, z, z, z
        tl.store(out_ptr + tl.arange(0, 64), counts(lo, hi))


@pytest.fixture(scope="module", autouse=True)
def _interpreter_patches_once_a_launch() -> Iterator[None]:
    with skip_nested_patching():
        yield


def _planes_count(slots: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.full((64,), -1, dtype=torch.int32)
    n = slots.numel()
    _count_slots[(1,)](slots, n, n // block, out, BLOCK=block)
    return out


@pytest.mark.parametrize("block", [1024, 64])
def test_the_planes_count_every_slot_as_bincount(block: int) -> None:
    """Every slot 0..63 (63: the word's sign bit), 8 values a lane an iteration; the same slot in every lane
    for 2 * ITERS iterations and a partial block (a count reaches 8 * (ITERS + 1) = 248 of a plane's 255 in
    the first chunk, which holds the partial block, and the flushes add up); a partial last block whose lanes
    past the end count nothing."""
    g = torch.Generator().manual_seed(block)
    cases = {
        "random": torch.randint(0, 64, (37 * block + block // 2 + 3,), generator=g, dtype=torch.int32),
        "slot 63, full": torch.full((2 * ITERS * block + block - 1,), 63, dtype=torch.int32),
        "slot 0, full": torch.zeros(((ITERS + 1) * block,), dtype=torch.int32),
        "one per slot": torch.arange(64, dtype=torch.int32).repeat_interleave(3),
        "under one block": torch.tensor([5, 63, 0, 5, 62, 1, 5], dtype=torch.int32),
    }
    # every lane a different slot, and every slot in a different lane, many times over
    cases["rotating"] = (
        torch.arange(40 * block, dtype=torch.int32) % 63 + torch.arange(40 * block) // block
    ) % 64
    for name, slots in cases.items():
        slots = slots.to(torch.int32).contiguous()
        want = torch.bincount(slots.long(), minlength=64).to(torch.int32)
        assert torch.equal(_planes_count(slots, block), want), name


def _row(rows: triton_engine.TritonRows, x: torch.Tensor) -> np.ndarray:
    got = LAYOUT.empty_rows(1, torch.device("cpu"))
    assert rows.add(x, got, 0)
    return got.numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_planes_and_tl_histogram_write_the_c_kernels_rows(dtype: torch.dtype) -> None:
    """Tensors whose program reads more than ITERS iterations (several flushes): all in one binade, or
    spread over the window with rare values (subnormals, values above the window, past the overflow shortcut,
    inf, nan) that send a program back over its blocks, where the planes' extremes of every value are
    replaced by the window's and the rare ones'; and tensors whose only nonzero values are not finite. The
    bit planes (the default) and ``tl.histogram`` (512 values an iteration) give the C kernel's rows."""
    cpu = torch.device("cpu")
    planes = triton_engine.TritonRows(cpu, LAYOUT, max_programs=1)
    votes = triton_engine.TritonRows(cpu, LAYOUT, max_programs=1, block=512, planes=False)
    assert planes.planes and not votes.planes
    n = (ITERS + 4) * planes.block + 333
    g = torch.Generator().manual_seed(7)
    rare = torch.randn(n, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(-12, 12, (n,), generator=g)
    rare[5 * 1024 + 17 :: 9001] = 2.0**-1070 if dtype == torch.float64 else 1e-40
    rare[20_000] = float("inf")
    rare[21_000] = float("nan")
    rare[22_000] = 3e4 if dtype == torch.float16 else 1e30
    rare[n - 3] = -(2.0**-20)  # below the window of a program whose blocks sit near 2^12
    tensors = {  # (tl.histogram's kernel on those its own tests do not hold)
        "one binade": (torch.full((n,), 1.25, dtype=torch.float64), False),
        "rare": (rare, True),
        "zero and inf": (
            torch.tensor([0.0, float("inf"), 0.0, -float("inf")] * 300, dtype=torch.float64),
            True,
        ),
        "nan and zeros": (torch.tensor([0.0] * 1500 + [float("nan")], dtype=torch.float64), True),
    }
    for name, (x, both) in tensors.items():
        x = x.to(dtype)
        want = StatsBuffer(1, "cpu", engine="c")
        want.accumulate(x, 0)
        assert np.array_equal(_row(planes, x), want.to_host()), (dtype, name, "planes")
        assert not both or np.array_equal(_row(votes, x), want.to_host()), (dtype, name, "tl.histogram")


def test_planes_need_the_rare_values_after_and_blocks_in_eights() -> None:
    """The planes count no block's rare values (so the rare values come after), and split an iteration's
    values in eights (and sum a lane's counts in 16 bits): other shapes are refused in one line."""
    cpu = torch.device("cpu")
    assert not triton_engine.TritonRows(cpu, LAYOUT, rare_after=False).planes  # tl.histogram's then
    with pytest.raises(ValueError, match="needs rare_after=True"):
        triton_engine.TritonRows(cpu, LAYOUT, rare_after=False, planes=True)
    with pytest.raises(ValueError, match=r"power of two from 8 to 2048"):
        triton_engine.TritonRows(cpu, LAYOUT, block=4096)
    with pytest.raises(ValueError, match=r"power of two from 8 to 2048"):
        triton_engine.TritonRows(cpu, LAYOUT, block=768)

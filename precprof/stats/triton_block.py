"""The block-scaled what-if in Triton: ``block_formats.block_stats`` for many recipes in one read of the tensor.

``block_stats_triton(x, recipes, axis)`` gives, per recipe, the five ``T.BLOCK_STATS`` (flushed, saturated,
poisoned, sum_x2, sum_err2) as float64 on x's device, equal to ``block_formats.block_stats``: the counts
exactly, the sums to float64 rounding (they are added in another order). Nothing syncs with the host.

How it reads the tensor. x is viewed 2-D as [prod(leading dims), last] (a view when the leading dimensions
merge into one stride, else ``reshape`` copies); orientation "row" (axis -1) puts blocks along the last
dimension, "col" (axis -2) along the first of that view (``tables.py``: the leading dimensions flattened),
read in place through the strides: no transposed copy. A tile is ``TA`` lines across the block axis (128 on
CUDA: a line per thread of the 4 warps), 32 positions along each: one MX block (32) or two NVFP4 blocks (16)
per line. A thread reads its block twice, a position at a time (the interpreter, which pays per operation,
takes all 32 at once: the same code), in x's dtype through an integer view (fp32, bf16: magnitudes become
fp32 bit patterns by integer arithmetic; fp16 through the conversion instruction, exact for subnormals too):
first for the block's amax (and its halves', NVFP4's), then, the block's scales taken, every requested recipe
on each value: the element rounding, the counts and the error, added into the thread's own accumulators. They
are added across the program's threads once, when it ends: no barrier, no shuffle inside the loop.

Exactness. The arithmetic is the C kernel's (``stats/kernel.c``), IEEE fp32 operations in the torch-op
reference's order, each exact or rounded once as the reference rounds it: MX scales are powers of two (floor:
floor(log2 amax) - emax from amax's bits; rceil: the smallest k with 2^k >= fl32(amax / max), a correctly
rounded division, fl32 == 0 giving E8M0's smallest, k = -127); an element |x| / 2^k (exact; in rceil at
k = -127, |x| itself, as Transformer Engine's exp2f_rcp gives 1 there) is rounded to its format by the
magic-number sum, exact round-to-nearest-even. NVFP4 repeats torchao's fp32 steps one by one,
each an IEEE fp32 division or product (subnormals, inf and nan included): p = fl(amax_tensor / 2688) (at least
the smallest fp32 whose reciprocal is finite, ``block_formats.NVFP4_TENSOR_SCALE_MIN``), r = fl(1 / p),
s = E4M3(clamp(fl(fl(amax_block / 6) / p), 2^-6, 448)), element fl(|x| * fl(r / s)) rounded to E2M1 with
saturation, dequantised fl(q * fl(p * s)). Errors are (|x| - |q|)^2 in float64 from exact values. That holds
as compiled only without fused multiply-adds (``LAUNCH_OPTIONS``) and with subnormals kept, which Triton's
fp32 instructions do (no ``.ftz``): a test reads the PTX compiled for sm_90. (The element's rounding is one
magic-number sum whose power of two comes from the value's exponent bits, ``triton_block_kernels._round_value``,
tested equal to the general rounding on every tie and binade edge; the squared errors are fused multiply-adds
of float64, exact products.)

Cost, compiled for sm_90 by triton 3.6 (the GPU machine's), fp32, the seven recipes of the layers table:
the first kernel emulated every rounding in int64 arithmetic, 3,222 instructions per value, 255 registers and
spills (6 GB/s on an H200); the second took [32 along, 32 lines] tiles and added each statistic across the tile
at every step (three reductions per recipe through shared memory and barriers): 567 instructions per value,
168 registers, 45 GB/s on an H200 for both orientations; the third 212 per value (192 in the second read's
loop, 20 in the first's), 80 registers, no reduction in the loop: 178 GB/s fp32 and 87 bf16 on an H200 for
both orientations in one launch at 16M values, against 151 and 157 fp32 for one orientation alone, whose
launch had half the programs (4 a multiprocessor, 16 warps): the kernel waits on its instructions' latency
more than it issues them, and more warps hide it. So the fourth took fewer registers and fewer instructions:
each recipe's flushed and saturated counts shared an int32, the element's rounding is one magic-number sum,
the poisoned counts and NVFP4's sum of squares come from each tile's geometry and the MX sums, not from each
value; 145 instructions per value in the second read's loop (17 in the rest of a tile's), 62 registers under
a bound of 64 (``MAX_REGISTERS``; 71 unbound): eight programs a multiprocessor, both orientations of
``TritonBlocks.add``'s default grid in one wave; 208 GB/s fp32 and 100 bf16 on an H200 (2026-12-04). This one
(compiled by triton 3.9, bench/kernel_sass.py) carries each MX scale to per-block bounds where a tile allows
it (``triton_block_math``: no product by 2^-k or 2^k a value, the counts integer comparisons of the value's
bits with constants), keeps the counts in an int32 each, reads NVFP4's two 16-blocks of a line apart (their
scales chosen once, not a value) and ``UNROLL`` positions an iteration: 130 instructions a value in all (108
in the second read's loop, 22 in the rest of a tile's, both paths' setup included), against 162 for the fourth
compiled the same way; a tile with a block amax outside [2^-90, 2^101) runs the reference's arithmetic (161). Its speed is the GPU's
to say (``gpu_validate``'s kernels stage: ``block_tiles`` sweeps the bound and the programs).

NVFP4 needs the tensor's amax before its blocks: a first kernel (``_amax``) reduces it with an integer atomic
max into a 4-byte scratch (a second read of x, only when NVFP4 is requested). Sums are deterministic: each
program accumulates its tiles in a fixed order and writes a [16, 8] float64 partial; the last program to
finish (a counter in the scratch) adds the programs' partials, in program order and in chunks of ``CHUNK``,
into the accumulator and zeroes the scratch for the next launch; no float atomics.

The hot path is ``TritonBlocks.add`` (a sampled step's hooks, through ``rows_device.DeviceRows``): both
orientations of a tensor in one launch (its programs split between them) adding straight into the tensor's
slot of the block accumulator, launched directly through the compiled kernel (``triton_launch._DirectLaunch``)
with the scratch allocated once per device. The former path cost, per tensor, four launches through Triton's
argument binding (its amax kernel and its blocks kernel per orientation) and about 20 small torch ops
(scratch, the partials' sum, one index per recipe, the stacks, the addition): the 19 ms of forward host time
the block what-if added to a sampled gpt2-small step on an H200 (bench/results/README_h200_2026-11-27c.md).
``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (how the tests check them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from precprof import block_formats as bf
from precprof import tables as T
from precprof.errors import UserError
from precprof.stats.triton_engine import device_unsupported, interpreting, triton_missing
from precprof.stats.triton_launch import (
    _DirectLaunch,
    adopt_direct,
    direct_status,
    load_kernels,
    register_bound,
)

# dtype -> (kind code, the integer dtype of the same width the kernel reads)
KINDS: dict[torch.dtype, tuple[int, torch.dtype]] = {
    torch.float32: (0, torch.int32),
    torch.bfloat16: (1, torch.int16),
    torch.float16: (2, torch.int16),
}
# the kernel's element-format slots (its MB*/EMIN*/FMAX* constants), in this order
ELEMENTS: tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2", "fp6_e2m3", "fp6_e3m2", "fp4_e2m1")
NVFP4_SLOT = 10
SLOTS = 16  # rows of a program's partial: 10 MX (format x scale mode) + NVFP4, padded
STATS_PAD = 8  # columns of a program's partial: the five statistics, padded

_state: dict[str, Any] = {}
# how the block kernel is compiled: no product and sum contracted into a fused multiply-add, whose single
# rounding would not be the reference's two (its fp32 arithmetic is exact only as written)
LAUNCH_OPTIONS: dict[str, Any] = {"enable_fp_fusion": False}
# Registers a thread may take (ptxas's .maxnreg; None: as many as ptxas likes). At 64, eight programs of 4 warps
# fit a multiprocessor (65,536 registers), the programs of both orientations of TritonBlocks.add's default grid
# (4 a multiprocessor each) in one wave; compiled for sm_90 by triton 3.6 the kernel takes 71 without the
# bound and 62 with it, with no spill and 2 more instructions a value in its loop.
MAX_REGISTERS: int | None = 64
# Tiles a program reads at most (a tensor that needs more gets more programs, and the partials' scratch grows):
# a thread counts at most 32 values a tile in each of its int32 counts
MAX_ITERS = 2047
# Positions a thread reads in one iteration of the second read's loop on a GPU (one at a time, unrolled): the
# loop's own instructions (its counter, the branch) spread over them. Compiled for sm_90 by triton 3.9: 108
# instructions a value in that loop at 2, 110 at 4 (more registers: spills under the bound), 118 at 8
UNROLL = 2


def _kernels() -> Any:
    """The jitted (_amax, _blocks) kernels (built on first use), or why they are not there."""
    if "kernels" in _state:
        return _state["kernels"]
    missing = triton_missing()  # remembers a missing triton itself, and only that
    if missing is not None:
        return missing
    # the one precprof import inside a function (tests/test_architecture.py): the kernels' module imports
    # triton, which takes a second or two, only when this engine runs
    from precprof.stats import triton_block_kernels as k

    _state["kernels"] = (k._amax, k._blocks)
    return _state["kernels"]


def unavailable(device: torch.device) -> str | None:
    """Why the block kernels cannot run on ``device`` here; None when they can."""
    why = device_unsupported(device)
    if why is not None:
        return why
    kernels = _kernels()
    return kernels if isinstance(kernels, str) else None


def _f32_bits(v: float) -> int:
    return int(torch.tensor(v, dtype=torch.float32).view(torch.int32))


def _constants() -> dict[str, int]:
    """The kernel's format constants, from ``block_formats``: mantissa bits, smallest normal exponent and the
    max's fp32 bits of each element format and its saturation bound's (``block_formats.saturation_bound``); NVFP4's per-tensor divisor (448 * 6) and smallest block scale."""
    if "constants" not in _state:
        c: dict[str, int] = {}
        for i, name in enumerate(ELEMENTS):
            fmt = bf.ELEMENT_FORMATS[name]
            c[f"MB{i}"], c[f"EMIN{i}"], c[f"FMAX{i}"], c[f"SAT{i}"] = (
                fmt.mantissa_bits,
                fmt.normal_min_exponent,
                _f32_bits(fmt.max),
                _f32_bits(bf.saturation_bound(fmt)),
            )
        c["NV_DIV"] = _f32_bits(bf.formats.FP8_E4M3.max * bf.FP4_E2M1.max)
        c["NV_SMIN"] = _f32_bits(bf.NVFP4_SCALE_MIN)
        c["NV_PMIN"] = bf.NVFP4_TENSOR_SCALE_BITS
        _state["constants"] = c
    return dict(_state["constants"])


def slot(recipe: bf.BlockRecipe) -> int:
    """The kernel's slot for ``recipe``: 2 * element index + (1 for rceil) for MX, 10 for NVFP4; UserError
    for a recipe these kernels do not compute."""
    if not isinstance(recipe, bf.BlockRecipe):
        raise UserError(f"recipe must be a BlockRecipe (one of: {', '.join(bf.RECIPES)}), got {recipe!r}")
    nv = bf.NVFP4
    if (recipe.element, recipe.block_size, recipe.scale_format, recipe.per_tensor_scale) == (
        nv.element,
        nv.block_size,
        nv.scale_format,
        nv.per_tensor_scale,
    ):
        return NVFP4_SLOT
    if (
        recipe.scale_format == "e8m0"
        and recipe.block_size == 32
        and recipe.element.name in ELEMENTS
        and recipe.element == bf.ELEMENT_FORMATS[recipe.element.name]
        and not recipe.per_tensor_scale
    ):
        return 2 * ELEMENTS.index(recipe.element.name) + (recipe.scale_mode == bf.ScaleMode.RCEIL)
    raise UserError(
        f"the Triton block kernels compute MX (block 32, E8M0 scale, element one of {', '.join(ELEMENTS)}) "
        f"and NVFP4 recipes, not {recipe.name!r}"
    )


def _most_programs(device: torch.device) -> int:
    # the interpreter runs programs one after another: one is enough there
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _tile_default() -> int:
    # a line of the tile is a thread's (num_warps 4: 128 threads); the interpreter pays per operation
    return 1024 if interpreting() else 128


def _geometry(
    n_along: int, n_across: int, st_along: int, st_across: int, ta: int, most: int
) -> tuple[tuple[int, ...], int]:
    """(n_along, n_across, st_along, st_across, tiles, iters) of one orientation, and its programs: at most
    ``most``, unless a program would then read more than ``MAX_ITERS`` tiles."""
    tiles = -(-n_along // 32) * -(-n_across // ta)
    programs = max(1, min(most, tiles), -(-tiles // MAX_ITERS))
    return (n_along, n_across, st_along, st_across, tiles, -(-tiles // programs)), programs


def _orientations(x2: torch.Tensor, ta: int, most: int) -> tuple[tuple[int, ...], int, tuple[int, ...], int]:
    """Both orientations of a 2-D view: blocks along its last dimension ("row"), then down its columns."""
    (rows, cols), (st_r, st_c) = x2.shape, x2.stride()
    g0, p0 = _geometry(cols, rows, st_c, st_r, ta, most)
    g1, p1 = _geometry(rows, cols, st_r, st_c, ta, most)
    return g0, p0, g1, p1


def block_stats_triton(
    x: torch.Tensor,
    recipes: Sequence[bf.BlockRecipe],
    axis: int = -1,
    *,
    tile: int | None = None,
    max_programs: int | None = None,
) -> torch.Tensor:
    """Per recipe, what quantising ``x`` along ``axis`` loses: float64 [len(recipes), 5] in ``T.BLOCK_STATS``
    order (flushed, saturated, poisoned, sum_x2, sum_err2; counts as exact float64), on x's device.

    ``x``: float32, bfloat16 or float16, CUDA (or CPU under ``TRITON_INTERPRET=1``). ``axis``: -1 ("row":
    blocks along the last dimension) or -2 ("col": along the leading dimensions flattened, i.e. axis -2 of
    ``x.reshape(-1, x.shape[-1])``; needs x.dim() >= 2). ``tile`` (lines per tile, a power of two; default 128
    on CUDA, a line per thread, 1024 in the interpreter, whose cost is per operation) and ``max_programs``
    (default 4 per SM on CUDA, 1 in the interpreter) change no count, and the sums only by float64 rounding.
    One launch (one more when NVFP4 is asked for), no host sync. UserError for a dtype, axis or recipe these
    kernels do not take; RuntimeError when Triton cannot run here (``unavailable`` says why). The hot path is
    ``TritonBlocks.add``: both orientations into an accumulator, in the same launches.
    """
    if not isinstance(x, torch.Tensor):
        raise UserError(f"block statistics need a torch.Tensor, got {type(x).__name__}")
    kind = KINDS.get(x.dtype)
    if kind is None:
        raise UserError(f"the Triton block kernels read float32, bfloat16 or float16, got {x.dtype}")
    if axis not in (-1, -2) and not (x.dim() == 2 and axis in (0, 1)):
        raise UserError(f"axis must be -1 (row) or -2 (col), got {axis}")
    if x.dim() == 0 or (axis in (-2, 0) and x.dim() < 2):
        raise UserError(f"axis {axis} needs a tensor of at least {2 if axis in (-2, 0) else 1} dimensions")
    slots = _slots(recipes)
    ta = tile if tile is not None else _tile_default()
    if ta < 1 or ta & (ta - 1):
        raise UserError(f"tile must be a power of two, got {ta}")
    if x.numel() == 0 or not slots:
        return torch.zeros(len(slots), len(T.BLOCK_STATS), dtype=torch.float64, device=x.device)
    why = unavailable(x.device)
    if why is not None:
        raise RuntimeError(why)
    code, int_dtype = kind
    xi = x.reshape(-1, x.shape[-1]).view(int_dtype)  # (lines, last): a view when the leading dims merge
    most = max_programs if max_programs is not None else _most_programs(x.device)
    g0, p0, g1, p1 = _orientations(xi, ta, most)
    if axis in (-2, 0):
        g0, p0 = g1, p1
    scratch = torch.zeros(2, dtype=torch.int32, device=x.device)
    part = torch.empty(p0, SLOTS, STATS_PAD, dtype=torch.float64, device=x.device)
    out = []
    for i in range(0, len(slots), MAX_RECIPES):  # a launch writes at most MAX_RECIPES recipes
        group = slots[i : i + MAX_RECIPES]
        acc = torch.zeros(2, len(group), len(T.BLOCK_STATS), dtype=torch.float64, device=x.device)
        consts = _consts(code, ta, group)
        _launch(consts, xi, scratch, part, acc, g0, p0, g0, 0, options=_options(MAX_REGISTERS))
        out.append(acc[0])
    return torch.cat(out)


_SLOTS_BY_ID: dict[int, tuple[Any, Any]] = {}
MAX_RECIPES = 15  # recipes a launch adds into its accumulator (4 bits of SLOTMAP each, in an int64)
CHUNK = 32  # partials the last program adds per step


def _slots(recipes: Sequence[bf.BlockRecipe]) -> tuple[int, ...]:
    """``slot`` of each recipe, found by the identity of ``recipes`` (``block_formats.per_recipes``): per call
    and orientation, comparing seven recipes cost 11 us."""
    slots: tuple[int, ...] = bf.per_recipes(_SLOTS_BY_ID, recipes, lambda: tuple(slot(r) for r in recipes))
    return slots


def _mask(slots: Sequence[int]) -> int:
    mask = 0
    for s in slots:
        mask |= 1 << s
    return mask


def _consts(code: int, ta: int, slots: Sequence[int], positions: int | None = None) -> dict[str, Any]:
    """The constexprs of ``_blocks`` for a dtype's kind, a tile and the accumulator's recipes (their slots), in
    the kernel's order."""
    assert 0 < len(slots) <= MAX_RECIPES
    jv = positions if positions is not None else (32 if interpreting() else 1)
    assert jv in (1, 2, 4, 8, 16, 32)
    slotmap = 0
    for i, s in enumerate(slots):
        slotmap |= s << (4 * i)
    nrp = 1 << max(0, (len(slots) - 1).bit_length())
    return dict(
        KIND=code,
        TA=ta,
        MASK=_mask(slots),
        SLOTMAP=slotmap,
        NR=len(slots),
        NRP=nrp,
        CH=CHUNK,
        **_constants(),
        # positions a thread reads at a time: 1 on a GPU, all 32 in the interpreter (which pays per operation);
        # NVFP4's two halves apart unless one read takes all 32; UNROLL reads of one position an iteration
        JV=jv,
        HALVES=1 if jv == 32 else 2,
        UNROLL=UNROLL if jv == 1 else 1,
    )


def _options(max_registers: int | None) -> dict[str, Any]:
    """The block kernel's compile options: ``LAUNCH_OPTIONS``, and ``max_registers`` as ptxas's bound where
    this Triton takes one (``triton_launch.register_bound``)."""
    return {**LAUNCH_OPTIONS, **register_bound(max_registers)}


def _nv(consts: dict[str, Any]) -> bool:
    return bool(consts["MASK"] >> NVFP4_SLOT & 1)


def _launch(
    consts: dict[str, Any],
    xi: Any,
    scratch: Any,
    part: Any,
    out: Any,
    g0: tuple[int, ...],
    p0: int,
    g1: tuple[int, ...],
    p1: int,
    *,
    options: dict[str, Any],
    warm: bool = False,
) -> list[Any]:
    """Launch by Triton (or with ``warm``, only compile: no GPU work) the kernels of one tensor: the tensor's
    amax when NVFP4 is asked for (``_amax``, over orientation 0's tiles), then ``_blocks`` compiled with
    ``options`` (``_options``), ``p0`` programs of orientation 0 and ``p1`` of orientation 1, adding into
    ``out``; returns the compiled kernels."""
    amax_kernel, blocks_kernel = _kernels()
    calls: list[tuple[Any, tuple[int], tuple[Any, ...], dict[str, Any]]] = []
    if _nv(consts):
        calls.append((amax_kernel, (p0,), (xi, scratch, *g0), dict(KIND=consts["KIND"], TA=consts["TA"])))
    args = (xi, scratch, part, out, *g0, p0, *g1)
    calls.append((blocks_kernel, (p0 + p1,), args, {**consts, **options}))
    if warm:
        return [k.run(*a, grid=grid, warmup=True, **kw) for k, grid, a, kw in calls]
    for k, grid, a, kw in calls:
        k[grid](*a, **kw)
    return []


class TritonBlocks:
    """The block what-if of a device's tensors, both orientations, added into an accumulator: ``add`` is one
    launch (two with NVFP4's amax), no host sync, no temporary tensor. Its scratch: the tensor's amax and a
    count of programs finished (int32 [2], zeroed by each launch's last program), the programs' partials
    (float64 [2 * programs, 16, 8]). ``warm`` compiles the variants (one per dtype), ``adopt_compiled`` takes
    them for a direct launch (``triton_launch._DirectLaunch``) once a small tensor shows it writes what
    Triton's own launch writes. ``tile``, ``max_programs``: as ``block_stats_triton``'s; ``positions``: of a
    block, read by a thread at a time (1 on a GPU, 32 in the interpreter; a power of two up to 32);
    ``max_registers``: a thread's, bound at compile time (``MAX_REGISTERS`` by default; None: no bound). A
    tensor that needs more programs than ``2 * max_programs`` (``MAX_ITERS``) grows the partials' scratch."""

    def __init__(
        self,
        device: torch.device,
        recipes: Sequence[bf.BlockRecipe],
        *,
        tile: int | None = None,
        max_programs: int | None = None,
        positions: int | None = None,
        max_registers: int | None = MAX_REGISTERS,
    ) -> None:
        why = unavailable(device)
        if why is not None:
            raise RuntimeError(why)
        if device.type == "cuda" and device.index is None:  # the raw stream and the launch need an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.slots = tuple(slot(r) for r in recipes)
        if not 0 < len(self.slots) <= MAX_RECIPES:
            raise UserError(f"TritonBlocks adds 1 to {MAX_RECIPES} recipes, got {len(self.slots)}")
        self.tile = tile if tile is not None else _tile_default()
        if self.tile < 1 or self.tile & (self.tile - 1):
            raise UserError(f"tile must be a power of two, got {self.tile}")
        if positions is not None and positions not in (1, 2, 4, 8, 16, 32):
            raise UserError(f"positions must be a power of two from 1 to 32, got {positions}")
        self.most = max_programs if max_programs is not None else _most_programs(device)
        self.scratch = torch.zeros(2, dtype=torch.int32, device=device)
        self.part = torch.empty(2 * self.most, SLOTS, STATS_PAD, dtype=torch.float64, device=device)
        self._ptrs = (self.scratch.data_ptr(), self.part.data_ptr())
        self._consts = {code: _consts(code, self.tile, self.slots, positions) for code, _ in KINDS.values()}
        self._options = _options(max_registers)
        self._direct: dict[int, tuple[Any, Any]] = {}
        self._pending: list[tuple[int, list[Any]]] = []
        self.direct_status = "not compiled yet"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.scratch, self.part))

    def _args(self, x: torch.Tensor) -> tuple[int, Any, tuple[int, ...], int, tuple[int, ...], int]:
        code, int_dtype = KINDS[x.dtype]
        xi = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).view(int_dtype)
        return (code, xi, *_orientations(xi, self.tile, self.most))

    def add(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """``out += `` the statistics of ``x`` (ndim >= 2, data on this device), "row" then "col": ``out`` a
        contiguous float64 [2, len(recipes), 5] tensor on this device (a slot of the block accumulator). No
        sync. False when ``x`` is not a tensor these kernels read (the caller takes another engine)."""
        if x.dtype not in KINDS or x.dim() < 2 or x.numel() == 0:
            return False
        code, xi, g0, p0, g1, p1 = self._args(x)
        if p0 + p1 > self.part.shape[0]:  # (a tensor of more than 4G values on an H100: MAX_ITERS)
            self.part = torch.empty(p0 + p1, SLOTS, STATS_PAD, dtype=torch.float64, device=self.device)
            self._ptrs = (self.scratch.data_ptr(), self.part.data_ptr())
        direct = self._direct.get(code)
        if direct is None:
            _launch(
                self._consts[code], xi, self.scratch, self.part, out, g0, p0, g1, p1, options=self._options
            )
            return True
        amax, blocks = direct
        stream = int(torch._C._cuda_getCurrentRawStream(self.device.index))
        scratch, part = self._ptrs
        ptr = xi.data_ptr()
        if amax is not None:
            amax(p0, stream, (ptr, scratch, *g0))
        blocks(p0 + p1, stream, (ptr, scratch, part, out.data_ptr(), *g0, p0, *g1))
        return True

    def warm(self, dtypes: Sequence[torch.dtype], *, load: bool = True) -> list[Any]:
        """Compile (no GPU work, no sync) the kernels ``add`` launches for tensors of ``dtypes``; returns them
        (Triton's futures under ``triton_compile.parallel_compile``), kept for ``adopt_compiled``, and loaded
        onto the device unless ``load=False``. Nothing in the interpreter."""
        if interpreting():
            self.direct_status = "Triton's launch (no compiled kernel in the interpreter)"
            return []
        out: list[Any] = []
        self._pending = []
        for dt in dict.fromkeys(dtypes):
            if dt not in KINDS:
                continue
            kernels = _compile(self._consts[KINDS[dt][0]], dt, self.device, self._options)
            self._pending.append((KINDS[dt][0], kernels))
            out += kernels
        if load:
            load_kernels(out)
            self.adopt_compiled()
        return out

    def adopt_compiled(self) -> None:
        """Take the kernels ``warm`` compiled (done by now) for the direct launch, each dtype's after a check
        (a sync, at attach) that it adds what Triton's launch adds for a small tensor; a dtype that fails keeps
        Triton's launch, and ``direct_status`` says why."""
        pending, self._pending = self._pending, []
        if interpreting() or self.device.type != "cuda":
            self.direct_status = "Triton's launch (no compiled kernel in the interpreter)"
            return
        amax_kernel, blocks_kernel = _kernels()

        def make(code: int, kernels: list[Any]) -> tuple[Any, Any]:
            compiled = [k.result() if hasattr(k, "result") else k for k in kernels]
            consts = self._consts[code]
            amax = None
            if _nv(consts):
                amax = _DirectLaunch(amax_kernel, compiled[0], dict(KIND=code, TA=consts["TA"]))
            return amax, _DirectLaunch(blocks_kernel, compiled[-1], consts)

        why = adopt_direct(self._direct, pending, make, self._self_check, "sums differ")
        self.direct_status = direct_status(len(self._direct), "dtypes", why)

    def _self_check(self, code: int, direct: tuple[Any, Any]) -> bool:
        dtype = next(d for d, (c, _) in KINDS.items() if c == code)
        g = torch.Generator(device="cpu").manual_seed(code)
        # values over 16 binades (each line its own: blocks with different scales; finite in fp16 too)
        x = (torch.randn(40, 72, generator=g) * 2.0 ** torch.randint(-8, 8, (40, 1), generator=g)).to(dtype)
        x = x.to(self.device)
        n = len(self.slots)
        want = torch.zeros(2, n, len(T.BLOCK_STATS), dtype=torch.float64, device=self.device)
        got = torch.zeros_like(want)
        self.add(x, want)
        self._direct[code] = direct
        try:
            self.add(x, got)
        finally:
            del self._direct[code]
        return bool(torch.equal(got, want))


def _compile(
    consts: dict[str, Any], dtype: torch.dtype, device: torch.device, options: dict[str, Any]
) -> list[Any]:
    """Compile ``_launch``'s kernels for tensors of ``dtype`` with ``options`` and example tensors on
    ``device`` (only their dtypes count: no argument is specialised on its value or alignment)."""
    xi = torch.zeros(32, 32, dtype=KINDS[dtype][1], device=device)
    scratch = torch.zeros(2, dtype=torch.int32, device=device)
    part = torch.empty(2, SLOTS, STATS_PAD, dtype=torch.float64, device=device)
    out = torch.zeros(2, consts["NR"], len(T.BLOCK_STATS), dtype=torch.float64, device=device)
    g = (32, 32, 1, 32, 1, 1)
    return _launch(consts, xi, scratch, part, out, g, 1, g, 1, options=options, warm=True)


def warm(
    device: torch.device,
    dtypes: Sequence[torch.dtype],
    recipes: Sequence[bf.BlockRecipe],
    *,
    load: bool = True,
) -> list[Any]:
    """Compile, before any hook runs, the block kernels ``TritonBlocks(device, recipes).add`` launches on
    ``device`` for tensors of ``dtypes`` (one variant per dtype and recipe list), and load them onto the
    device. No GPU work, no sync; Triton's on-disk cache makes a second run's warm-up a lookup. Returns the
    compiled kernels (none in the interpreter or where the kernels cannot run), loaded onto the device unless
    ``load=False`` (as ``triton_engine.TritonRows.warm``)."""
    if interpreting() or unavailable(device) is not None:
        return []
    kernels = compile_kernels(device, dtypes, recipes)
    if load:
        load_kernels(kernels)
    return kernels


def compile_kernels(
    device: torch.device, dtypes: Sequence[torch.dtype], recipes: Sequence[bf.BlockRecipe]
) -> list[Any]:
    """``warm``'s compiles, for Triton's active target, with example tensors on ``device`` (only their dtypes
    count: ``triton_ahead`` compiles for a GPU with CPU tensors, in another process)."""
    slots = [slot(r) for r in recipes]
    if not slots:
        return []
    ta = _tile_default()
    kernels: list[Any] = []
    for dt in dict.fromkeys(dtypes):
        if dt in KINDS:
            kernels += _compile(_consts(KINDS[dt][0], ta, slots), dt, device, _options(MAX_REGISTERS))
    return kernels

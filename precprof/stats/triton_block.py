"""The block-scaled what-if in Triton: ``block_formats.block_stats`` for many recipes in one read of the tensor.

``block_stats_triton(x, recipes, axis)`` gives, per recipe, the five ``T.BLOCK_STATS`` (flushed, saturated,
poisoned, sum_x2, sum_err2) as float64 on x's device, equal to ``block_formats.block_stats``: the counts
exactly, the sums to float64 rounding (they are added in another order). Nothing syncs with the host.

How it reads the tensor. x is viewed 2-D as [prod(leading dims), last] (a view when the leading dimensions
merge into one stride, else ``reshape`` copies); orientation "row" (axis -1) puts blocks along the last
dimension, "col" (axis -2) along the first of that view (``tables.py``: the leading dimensions flattened),
read in place through the strides: no transposed copy. A tile is 32 positions along the block axis times
``TA`` lines across it: one MX block (32) or two NVFP4 blocks (16) per line. Each program loads a tile once,
in x's dtype through an integer view (fp32, bf16: magnitudes become fp32 bit patterns by integer arithmetic;
fp16 through the conversion instruction, exact for subnormals too), takes each block's amax once and then runs
every requested recipe on it: the scale, the element rounding, the counts and the error.

Exactness. The arithmetic is the C kernel's (``stats/kernel.c``), IEEE fp32 operations in the torch-op
reference's order, each exact or rounded once as the reference rounds it: MX scales are powers of two (floor:
floor(log2 amax) - emax from amax's bits; rceil: the smallest k with 2^k >= fl32(amax / max), a correctly
rounded division, fl32 == 0 giving k = 0 as frexp does); an element |x| / 2^k (exact) is rounded to its
format by the magic-number sum, exact round-to-nearest-even. NVFP4 repeats torchao's fp32 steps one by one,
each an IEEE fp32 division or product (subnormals, inf and nan included): p = fl(amax_tensor / 2688) (at least
the smallest fp32 whose reciprocal is finite, ``block_formats.NVFP4_TENSOR_SCALE_MIN``), r = fl(1 / p),
s = E4M3(clamp(fl(fl(amax_block / 6) / p), 2^-6, 448)), element fl(|x| * fl(r / s)) rounded to E2M1 with
saturation, dequantised fl(q * fl(p * s)). Errors are (|x| - |q|)^2 in float64 from exact values. That holds
as compiled only without fused multiply-adds (``LAUNCH_OPTIONS``) and with subnormals kept, which Triton's
fp32 instructions do (no ``.ftz``): a test reads the PTX compiled for sm_90. The former kernel emulated
every rounding in int64 integer arithmetic: compiled for sm_90 by triton 3.6 at a 32-line tile, 3,222
instructions per value, 255 registers and spills (6 GB/s on an H200); this one 567 instructions per value
and 168 registers without spilling (triton 3.9: 388 and 80). Which of the tile's orientations Triton lays out
best depends on its version: a [lines, 32] tile took 401 per value by triton 3.6 but 557 by 3.9.

NVFP4 needs the tensor's amax before its blocks: a first kernel (``_amax``) reduces it with an integer atomic
max into a 4-byte scratch (a second read of x, only when NVFP4 is requested). Sums are deterministic: each
program accumulates its tiles in a fixed order and writes a [16, 8] float64 partial; ``sum(0)`` over the
programs (a fixed number for a given device and shape) adds them in a fixed order; no float atomics.
``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (how the tests check them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from precprof import block_formats as bf
from precprof import tables as T
from precprof.errors import UserError
from precprof.stats.triton_engine import device_unsupported, interpreting, load_kernels, triton_missing

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
    max's fp32 bits of each element format; NVFP4's per-tensor divisor (448 * 6) and smallest block scale."""
    if "constants" not in _state:
        c: dict[str, int] = {}
        for i, name in enumerate(ELEMENTS):
            fmt = bf.ELEMENT_FORMATS[name]
            c[f"MB{i}"], c[f"EMIN{i}"], c[f"FMAX{i}"] = (
                fmt.mantissa_bits,
                fmt.normal_min_exponent,
                _f32_bits(fmt.max),
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


def _programs(device: torch.device, tiles: int, most: int | None) -> int:
    if most is None:
        # the interpreter runs programs one after another: one is enough there
        most = (
            4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        )
    return max(1, min(most, tiles))


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
    ``x.reshape(-1, x.shape[-1])``; needs x.dim() >= 2). ``tile`` (lines per tile, a power of two; default 32
    on CUDA, 1024 in the interpreter, whose cost is per operation) and ``max_programs`` (default 4 per SM on
    CUDA, 1 in the interpreter) change no count, and the sums only by float64 rounding. Two launches (one more when NVFP4 is asked for),
    no host sync. UserError for a dtype, axis or recipe these kernels do not take; RuntimeError when Triton
    cannot run here (``unavailable`` says why).
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
    if x.numel() == 0 or not slots:
        return torch.zeros(len(slots), len(T.BLOCK_STATS), dtype=torch.float64, device=x.device)
    why = unavailable(x.device)
    if why is not None:
        raise RuntimeError(why)
    code, int_dtype = kind
    x2 = x.reshape(-1, x.shape[-1])  # (lines, last): a view when the leading dims merge, else a copy
    (rows, cols), (st_r, st_c) = x2.shape, x2.stride()
    if axis in (-1, 1):
        n_along, n_across, st_along, st_across = cols, rows, st_c, st_r
    else:
        n_along, n_across, st_along, st_across = rows, cols, st_r, st_c
    ta = tile if tile is not None else (1024 if interpreting() else 32)
    if ta < 1 or ta & (ta - 1):
        raise UserError(f"tile must be a power of two, got {ta}")
    tiles = -(-n_along // 32) * -(-n_across // ta)
    programs = _programs(x.device, tiles, max_programs)
    iters = -(-tiles // programs)
    xi = x2.view(int_dtype)
    geometry = (n_along, n_across, st_along, st_across, tiles, iters)
    tmax = torch.zeros(1, dtype=torch.int32, device=x.device)
    part = torch.empty(programs, SLOTS, STATS_PAD, dtype=torch.float64, device=x.device)
    _launch(xi, tmax, part, geometry, code, ta, _mask(slots), (programs,), warm=False)
    total = part.sum(0)[:, : len(T.BLOCK_STATS)]  # fixed order: programs in index order
    return torch.stack([total[s] for s in slots])


_SLOTS_BY_ID: dict[int, tuple[Any, Any]] = {}


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


def _launch(
    xi: torch.Tensor,
    tmax: torch.Tensor,
    part: torch.Tensor,
    geometry: tuple[int, ...],
    code: int,
    ta: int,
    mask: int,
    grid: tuple[int],
    *,
    warm: bool,
) -> list[Any]:
    """Launch (or with ``warm``, only compile: no GPU work) the kernels of one call; the compiled kernels."""
    amax_kernel, blocks_kernel = _kernels()
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    if mask >> NVFP4_SLOT & 1:
        calls.append((amax_kernel, (xi, tmax, *geometry), dict(KIND=code, TA=ta)))
    consts = dict(KIND=code, TA=ta, MASK=mask, **LAUNCH_OPTIONS, **_constants())
    calls.append((blocks_kernel, (xi, tmax, part, *geometry), consts))
    if warm:
        return [k.run(*args, grid=grid, warmup=True, **kw) for k, args, kw in calls]
    for k, args, kw in calls:
        k[grid](*args, **kw)
    return []


def warm(
    device: torch.device,
    dtypes: Sequence[torch.dtype],
    recipes: Sequence[bf.BlockRecipe],
    *,
    load: bool = True,
) -> list[Any]:
    """Compile, before any hook runs, the block kernels ``block_stats_triton(x, recipes, axis)`` launches on
    ``device`` for tensors of ``dtypes`` (their integer arguments are int64, unspecialised, the pointer's
    alignment too: one variant per dtype and recipe set), and load them onto the device. No GPU work, no
    sync; Triton's on-disk cache makes a second run's warm-up a lookup. Returns the compiled kernels (none in
    the interpreter or where the kernels cannot run), loaded onto the device unless ``load=False`` (as
    ``triton_engine.TritonRows.warm``)."""
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
    and alignment count: ``triton_ahead`` compiles for a GPU with CPU tensors, in another process)."""
    mask = _mask([slot(r) for r in recipes])
    tmax = torch.zeros(1, dtype=torch.int32, device=device)
    part = torch.empty(1, SLOTS, STATS_PAD, dtype=torch.float64, device=device)
    kernels: list[Any] = []
    for dt in dict.fromkeys(dtypes):
        if dt not in KINDS or not mask:
            continue
        code, int_dtype = KINDS[dt]
        xi = torch.zeros(32, 32, dtype=int_dtype, device=device)
        kernels += _launch(xi, tmax, part, (32, 32, 32, 1, 1, 1), code, 32, mask, (1,), warm=True)
    return kernels

"""Block-format statistics of one tensor (``precprof.block_formats``), in both orientations, on its device.

For a tensor viewed as 2-D [prod(leading dims), last], every recipe of the layers table
(``block_formats.column_recipes()``, ``tables.BLOCK_RECIPES`` order) is evaluated with blocks along the last
dimension ("row") and down the columns ("col"); the result is a float64 [2, n_recipes, 5] tensor on the
tensor's device (``tables.BLOCK_STATS`` order: flushed, saturated, poisoned, sum_x2, sum_err2).

Which engine computes it follows the statistics engine of the device (``precprof.stats.engine``):

- "c" (the CPU): the C kernel's ``pp_block`` (``kernel.block_stats_2d``), both orientations from one call;
- "triton" (CUDA): ``precprof.stats.triton_block.block_stats_triton`` when that module imports, else torch ops
  (a sampled step's hooks take ``triton_block.TritonBlocks`` instead, through ``rows_device.DeviceRows``: both
  orientations into the accumulator in one launch);
- "torch" (and wherever the others cannot run): the reference itself, ``block_formats.block_stats``, whose
  0-d device tensors are stacked: no host sync.

Every engine gives the reference's counts exactly and its sums up to the order of summation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from precprof import block_formats
from precprof import tables as T
from precprof.block_formats import BlockRecipe
from precprof.stats import kernel as _cpu_kernel

# the Triton block kernel on CUDA, block_stats_triton(x, recipes, axis) -> float64 [len(recipes), 5] on x's
# device; where it does not import, torch ops run on CUDA
triton_block_stats: Callable[..., torch.Tensor] | None
try:
    from precprof.stats import triton_block as _triton_block

    triton_block_stats = _triton_block.block_stats_triton
except ImportError:
    triton_block_stats = None

RECIPES: tuple[BlockRecipe, ...] = block_formats.column_recipes()
N_RECIPES = len(RECIPES)
N_STATS = len(T.BLOCK_STATS)
N_ORIENTATIONS = len(T.BLOCK_ORIENTATIONS)
AXES = (-1, -2)  # per orientation, the axis of the 2-D view its blocks run along
assert T.BLOCK_ORIENTATIONS == ("row", "col")
assert tuple(r.name for r in RECIPES) == T.BLOCK_RECIPES


def reference_stats(x: torch.Tensor, recipes: Sequence[BlockRecipe], axis: int) -> torch.Tensor:
    """``block_formats.block_stats`` of every recipe as one float64 [len(recipes), 5] tensor on x's device
    (the torch-op engine; no host sync)."""
    rows = []
    for r in recipes:
        d = block_formats.block_stats(x, r, axis)
        rows.append(torch.stack([d[s].to(torch.float64) for s in T.BLOCK_STATS]))
    return torch.stack(rows)


def as_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` viewed as [prod(leading dims), last] (a 1-D tensor as one row)."""
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def block_stats(
    x: torch.Tensor,
    recipes: Sequence[BlockRecipe] = RECIPES,
    axis: int = -1,
    *,
    engine: str = "torch",
    threads: int = 0,
) -> torch.Tensor:
    """Float64 [len(recipes), 5] statistics of ``x`` along ``axis`` (-1, or -2 of a 2-D tensor) by ``engine``
    ("c", "triton" or "torch"; an engine that cannot read ``x`` leaves it to torch ops). Never syncs."""
    if engine == "triton" and x.device.type == "cuda" and triton_block_stats is not None:
        return triton_block_stats(x, recipes, axis)
    if engine == "c" and _c_reads(x):
        return _cpu_kernel.block_stats_c(x, recipes, axis, threads)
    return reference_stats(x, recipes, axis)


def tensor_block_stats(
    x: torch.Tensor, recipes: Sequence[BlockRecipe] = RECIPES, *, engine: str = "torch", threads: int = 0
) -> torch.Tensor:
    """Float64 [2, len(recipes), 5] statistics of ``x`` (ndim >= 2) viewed as 2-D, "row" then "col", on x's
    device. The C kernel reads both orientations in one call. Never syncs."""
    x2 = as_2d(x.detach())
    if engine == "c" and _c_reads(x2):
        return _cpu_kernel.block_stats_2d(x2, recipes, 3, threads)
    return torch.stack([block_stats(x2, recipes, a, engine=engine, threads=threads) for a in AXES])


def add_tensor_block_stats(
    x: torch.Tensor, into: torch.Tensor, *, engine: str = "torch", threads: int = 0
) -> None:
    """``into += tensor_block_stats(x, engine=engine, threads=threads)`` (the recipes of the layers table); the
    C kernel adds into ``into`` itself (the same sums: one float64 addition per value), with no tensor in
    between, when it reads ``x`` and ``into`` is a contiguous float64 CPU tensor."""
    x2 = as_2d(x.detach())
    if engine == "c" and into.is_cpu and into.is_contiguous() and _c_reads(x2):
        _cpu_kernel.block_stats_2d(x2, RECIPES, 3, threads, into=into)
        return
    into += tensor_block_stats(x2, engine=engine, threads=threads)


def _c_reads(x: torch.Tensor) -> bool:
    return (
        x.is_cpu
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and _cpu_kernel.load() is not None
    )

"""The size of the sampled weight updates (``capture/updates.py``): per parameter and sampled step, over its
strided sample, the sum of the squared updates, the sum of the squared weights before the step, and the largest
and the smallest nonzero |update|, and how many updates were nan and how many inf. They give the
``weight_update`` rows' ``update_rms`` and ``weight_rms`` (their ratio is ||dw|| / ||w|| on the sample, the
per-layer diagnostic of a learning rate too high or too low), their ``absmax`` / ``absmin`` and their ``nan`` /
``inf``.

Kept per device group as one float64 tensor ``[members, WIDTH]`` beside the counts, added to on the device in the
optimizer's post-hook (no sync) and copied with the rest of the sampled step. The squares are summed in
float64 from the fp32 samples: an update of 1e-20 squares to 1e-40, below fp32's range. A non-finite update or
weight counts for nothing in the sums and extremes; ``absmax`` is the largest finite |update| as on every other
row. The non-finite updates are counted instead (a weight that became nan, or was nan already, has a nan
update): without the count, a layer whose every update was nan read as one whose update was 0, "barely
training".

The sums add over the optimizer steps of a sampled step and over ranks (a DDP rank's copy adds to numel as
much as to the sums, so the RMS is the same); the extremes take the max and the min.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from precprof import tables as T

# columns of a group's sizes: the sums (added over ranks), then the extremes
SQ_UPDATE, SQ_WEIGHT, NAN_UPDATES, INF_UPDATES, UPDATE_MAX, UPDATE_MIN = range(6)
WIDTH = 6


def empty(rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``rows`` sizes with nothing added: zero sums and extremes, no smallest update yet (inf)."""
    out = torch.zeros((rows, WIDTH), dtype=torch.float64, device=device)
    out[:, UPDATE_MIN] = math.inf
    return out


def empty_host(rows: int) -> np.ndarray:
    """``empty(rows)`` on the host, as numpy (no tensor read back)."""
    out = np.zeros((rows, WIDTH), dtype=np.float64)
    out[:, UPDATE_MIN] = math.inf
    return out


def reset(sizes: torch.Tensor) -> None:
    sizes[:, :UPDATE_MIN].zero_()
    sizes[:, UPDATE_MIN].fill_(math.inf)


def padded_slots(lens: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Where each concatenated sampled element goes in a ``[members, width]`` array, one member a row (``width``
    the longest sample, the rest padding): one row reduction per member, exact, where sums over segments of a
    running sum would lose a small update's squares beside a large one's."""
    width = max(lens)
    slots = torch.cat([torch.arange(n, dtype=torch.int64) + i * width for i, n in enumerate(lens)])
    return slots.to(device), width


@torch.no_grad()
def add(
    sizes: torch.Tensor, slots: torch.Tensor, width: int, before: torch.Tensor, delta: torch.Tensor
) -> None:
    """Add one optimizer step's updates ``delta`` of the weights ``before`` (fp32, the members' samples
    concatenated) into ``sizes``: device ops, no sync."""
    d = torch.where(torch.isfinite(delta), delta, 0).abs().double()
    w = torch.where(torch.isfinite(before), before, 0).double()
    nan, inf = torch.isnan(delta).double(), torch.isinf(delta).double()
    vals = torch.stack((d * d, w * w, nan, inf, d, torch.where(d > 0, d, math.inf)))
    pad = torch.zeros((WIDTH, len(sizes) * width), dtype=torch.float64, device=delta.device)
    pad[UPDATE_MIN].fill_(math.inf)  # (the padding is no update: 0 in the sums and the max, inf in the min)
    pad.index_copy_(1, slots, vals)
    pad = pad.view(WIDTH, len(sizes), width)
    sizes[:, :UPDATE_MAX] += pad[:UPDATE_MAX].sum(2).t()
    torch.maximum(sizes[:, UPDATE_MAX], pad[UPDATE_MAX].amax(1), out=sizes[:, UPDATE_MAX])
    torch.minimum(sizes[:, UPDATE_MIN], pad[UPDATE_MIN].amin(1), out=sizes[:, UPDATE_MIN])


def add_host(sizes: torch.Tensor, starts: np.ndarray, before: np.ndarray, after: np.ndarray) -> None:
    """:func:`add` for a CPU group read by the C kernel: ``before`` and ``after`` its samples (fp32 arrays),
    ``starts`` where each member's begin."""
    with np.errstate(invalid="ignore", over="ignore"):
        delta = after - before  # (fp32, as the torch path's)
    d = np.abs(np.where(np.isfinite(delta), delta, 0)).astype(np.float64)
    w = np.where(np.isfinite(before), before, 0).astype(np.float64)
    s = sizes.numpy()
    s[:, SQ_UPDATE] += np.add.reduceat(d * d, starts)
    s[:, SQ_WEIGHT] += np.add.reduceat(w * w, starts)
    s[:, NAN_UPDATES] += np.add.reduceat(np.isnan(delta), starts, dtype=np.float64)
    s[:, INF_UPDATES] += np.add.reduceat(np.isinf(delta), starts, dtype=np.float64)
    np.maximum(s[:, UPDATE_MAX], np.maximum.reduceat(d, starts), out=s[:, UPDATE_MAX])
    np.minimum(
        s[:, UPDATE_MIN], np.minimum.reduceat(np.where(d > 0, d, math.inf), starts), out=s[:, UPDATE_MIN]
    )


def for_ranks(sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sizes`` as (sums, extremes) for the collectives: the sums add over ranks, the extremes take the max
    (the smallest update negated)."""
    ext = torch.stack((sizes[:, UPDATE_MAX], -sizes[:, UPDATE_MIN]), dim=1)
    return sizes[:, :UPDATE_MAX].contiguous(), ext


def from_ranks(sums: np.ndarray, extremes: np.ndarray) -> np.ndarray:
    """The sizes from the host copies of :func:`for_ranks`'s tensors reduced over ranks."""
    return np.column_stack((sums, extremes[:, 0], -extremes[:, 1]))


def columns(sizes: np.ndarray, numel: np.ndarray) -> dict[str, Any]:
    """The ``weight_update`` rows' size columns from their ``sizes`` and sampled elements ``numel``: the RMS of
    the update and of the weight over the sample, the largest finite |update| (0 when none moved; NaN when not
    one was finite: a weight gone nan moved by nan, not by 0), the smallest nonzero one (NaN when none), and how
    many updates were nan and how many inf."""
    numel = np.asarray(numel, dtype=np.float64)
    n = np.maximum(numel, 1.0)
    low = sizes[:, UPDATE_MIN]
    finite = numel - sizes[:, NAN_UPDATES] - sizes[:, INF_UPDATES] > 0.5
    return {
        T.UPDATE_RMS: np.sqrt(sizes[:, SQ_UPDATE] / n),
        T.WEIGHT_RMS: np.sqrt(sizes[:, SQ_WEIGHT] / n),
        T.ABSMAX: np.where(finite, sizes[:, UPDATE_MAX], math.nan),
        T.ABSMIN: np.where(np.isfinite(low), low, math.nan),
        T.NAN: np.rint(sizes[:, NAN_UPDATES]).astype(np.int64),
        T.INF: np.rint(sizes[:, INF_UPDATES]).astype(np.int64),
    }

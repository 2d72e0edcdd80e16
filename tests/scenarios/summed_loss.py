"""Gradients larger than GradScaler's default start can hold: a loss summed instead of averaged.

``reduction="sum"`` over a batch of 256 makes every gradient 256 times what the mean would give; the largest
reach a few units, and at GradScaler's default init_scale of 2^16 they overflow fp16's 65504. The dynamic
scaler then skips optimizer steps while it halves its way down. Started at the advisor's scale instead, it
skips none.
"""

from __future__ import annotations

import torch
from torch import nn

from .benign import N_IN, BenignNet
from .loop import ProfiledRun, regression_batches, train_profiled

BATCH = 256


def summed_mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred[:, :1].float(), y, reduction="sum")


def run(precision: str = "fp32", loss_scale: float | None = None, steps: int = 12) -> ProfiledRun:
    torch.manual_seed(0)
    return train_profiled(
        BenignNet(),
        regression_batches(N_IN, batch=BATCH),
        summed_mse,
        precision=precision,
        loss_scale=loss_scale,
        steps=steps,
        lr=1e-3,
    )

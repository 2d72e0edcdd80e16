"""Activation gradients below fp16's smallest subnormal (2^-24).

A regression MLP whose loss is weighted by 2^-16, as an auxiliary loss or a loss summed over few elements and
divided by a large constant would be: every activation gradient is about 65000 times smaller than usual,
most of them below 2^-24, and an fp16 backward at loss scale 1 flushes them to zero. This is the situation of
the 2018 Mixed Precision Training paper's SSD experiment, where scaling the loss recovered fp32 accuracy.
"""

from __future__ import annotations

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

LOSS_WEIGHT = 2.0**-16
N_IN = 16


class TinyGradNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.act1 = nn.Tanh()
        self.fc2 = nn.Linear(width, width)
        self.act2 = nn.Tanh()
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x)))))


def weighted_mse(pred: torch.Tensor, y: torch.Tensor, weight: float = LOSS_WEIGHT) -> torch.Tensor:
    return weight * nn.functional.mse_loss(pred.float(), y)


def run(
    precision: str = "fp32", loss_scale: float | None = None, steps: int = 4, weight: float = LOSS_WEIGHT
) -> ProfiledRun:
    """Train TinyGradNet for a few steps (always from the same initial weights and batches), its loss weighted
    by ``weight``."""
    torch.manual_seed(0)
    return train_profiled(
        TinyGradNet(),
        regression_batches(N_IN),
        lambda pred, y: weighted_mse(pred, y, weight),
        precision=precision,
        loss_scale=loss_scale,
        steps=steps,
    )

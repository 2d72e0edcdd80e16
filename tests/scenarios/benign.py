"""Nothing wrong: a small MLP with unit-scale activations and ordinary gradients.

On bf16 hardware the advisor should say bf16 (fp32's range, no loss scale, no layer kept in fp32) and raise
nothing critical.
"""

from __future__ import annotations

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 16


class BenignNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.fc2(self.act(self.fc1(x)))))


def mse_first(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred[:, :1].float(), y)


def run(precision: str = "fp32", steps: int = 4) -> ProfiledRun:
    torch.manual_seed(0)
    return train_profiled(BenignNet(), regression_batches(N_IN), mse_first, precision=precision, steps=steps)

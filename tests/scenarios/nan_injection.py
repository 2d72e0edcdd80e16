"""A module that emits nan on one step, as a log of a negative number or 0/0 in a custom layer would.

``Inject`` sits between ``fc2`` and ``fc3``; on step ``NAN_STEP`` it turns one element of its output into nan.
The nan then flows through every later module, into the loss, the gradients and (AdamW has no guard) the
weights, so from the next step on every module is nan. The advisor must name the module where it started.
"""

from __future__ import annotations

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 16
NAN_STEP = 2


class Inject(nn.Module):
    """Identity, except on armed steps: one output element becomes nan."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask.view(-1)[0] = True
        return torch.where(mask, torch.full_like(x, float("nan")), x)


class NanNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.fc2 = nn.Linear(width, width)
        self.inject = Inject()
        self.fc3 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.inject(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


def arm(model: nn.Module, step: int) -> None:
    model.get_submodule("inject").armed = step == NAN_STEP  # type: ignore[assignment]


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred.float(), y)


def run(precision: str = "fp32", steps: int = 4) -> ProfiledRun:
    torch.manual_seed(0)
    return train_profiled(
        NanNet(), regression_batches(N_IN), mse, precision=precision, steps=steps, on_step=arm
    )

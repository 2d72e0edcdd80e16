"""A nan that appears only in the backward pass, under fp16 autocast with dynamic loss scaling.

``Inject`` is the identity in the forward pass; on armed steps it puts a nan into one element of the gradient
that flows back through it (as a sqrt or log near 0 in a custom backward would). GradScaler sees a
non-finite gradient on every armed step, skips it and halves the scale: 20 armed steps from 2^16 take the
scale down to 2^-4, far below any scale an overflow would need. The advisor must say the nan came from the
backward pass at ``inject`` from the first armed step, and that those steps were skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 16
FIRST, LAST = 20, 39  # armed steps
STEPS = 50


class Inject(nn.Module):
    """Identity; on armed steps one element of the gradient through it becomes nan."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and x.requires_grad:
            x = x * 1.0  # a new node, so that the hook below sits on this module's own output

            def poison(g: torch.Tensor) -> torch.Tensor:
                g = g.clone()
                g.view(-1)[0] = float("nan")
                return g

            x.register_hook(poison)
        return x


class BackwardNanNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.fc2 = nn.Linear(width, width)
        self.inject = Inject()
        self.fc3 = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.inject(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))))


def arm(model: nn.Module, step: int) -> None:
    model.get_submodule("inject").armed = FIRST <= step <= LAST  # type: ignore[assignment]


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred.float(), y)


def run(sample_every: int = 1) -> ProfiledRun:
    torch.manual_seed(0)
    return train_profiled(
        BackwardNanNet(),
        regression_batches(N_IN),
        mse,
        precision="fp16",
        loss_scale=2.0**16,
        steps=STEPS,
        sample_every=sample_every,
        on_step=arm,
    )

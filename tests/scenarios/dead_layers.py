"""Layers that receive no gradient at all in fp16, though the run has a GradScaler at its default 2^16.

fc2's weights are 4e4 times the usual, so its outputs reach 4e4 and the LayerNorm after it divides the gradient
flowing back by about that much; the LayerNorm's output is then scaled by 1e-7 (as a badly set residual or
temperature factor would), and so is the gradient flowing back through it. The gradients of fc2's, the GELU's
and fc1's outputs are around 1e-15 unscaled, below fp16's floor even at 2^16. In fp32 they are small but there;
in fp16 every one of them is zero.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 32


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class DeadNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)
        self.ln = nn.LayerNorm(width)
        self.tiny = Scale(1e-7)
        self.fc3 = nn.Linear(width, width)
        self.act3 = nn.ReLU()
        self.head = nn.Linear(width, 1)
        with torch.no_grad():
            self.fc2.weight.mul_(4e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tiny(self.ln(self.fc2(self.act(self.fc1(x)))))
        return self.head(self.act3(self.fc3(h)))


def fc1_output_gradients(model: DeadNet) -> list[torch.Tensor]:
    """The gradients of fc1's output, as the backward passes produce them (the test's own hook)."""
    seen: list[torch.Tensor] = []

    def keep(mod: nn.Module, args: object, y: torch.Tensor) -> None:
        y.register_hook(lambda g: seen.append(g.detach().clone()))

    model.fc1.register_forward_hook(keep)
    return seen


def run(
    precision: str = "fp16", loss_scale: float | None = 2.0**16, steps: int = 4, keep_fp32: Sequence[str] = ()
) -> tuple[ProfiledRun, list[torch.Tensor]]:
    """Train DeadNet (always from the same weights) on a regression, ``keep_fp32`` run outside autocast; returns
    the run and fc1's output gradients (scaled, as the backward held them)."""
    torch.manual_seed(0)
    model = DeadNet()
    seen = fc1_output_gradients(model)
    mse = lambda out, y: nn.functional.mse_loss(out.float(), y)  # noqa: E731
    profiled = train_profiled(
        model,
        regression_batches(N_IN),
        mse,
        precision=precision,
        loss_scale=loss_scale,
        steps=steps,
        keep_fp32=keep_fp32,
    )
    return profiled, seen

"""A regression MLP whose loss is multiplied by a constant far from 1, which moves every gradient by that factor.

A loss summed over a large batch of unnormalised targets (prices, counts) makes gradients billions of times the
usual; a loss multiplied by a tiny constant (a badly set auxiliary weight) makes them vanish. ``weight`` stands
for either: 2^40 puts the largest gradients near 1e10, past what fp16 holds at any loss scale GradScaler is
advised to start at; 1e-38 puts them among fp32's subnormals, below bf16's smallest value and below what any
fp16 loss scale lifts into range.
"""

from __future__ import annotations

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 16


class WeightedNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.act = nn.Tanh()
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc1(x)))


def gradients(model: nn.Module) -> list[torch.Tensor]:
    """Every gradient of a backward pass, as it produces them (the test's own hooks, independent of precprof):
    of each module's output and of each parameter, scaled by the loss scale where there is one."""
    seen: list[torch.Tensor] = []

    def keep(grad: torch.Tensor) -> None:
        seen.append(grad.detach().clone())

    def hook(mod: nn.Module, args: object, y: torch.Tensor) -> None:
        if y.requires_grad:
            y.register_hook(keep)

    for m in model.children():
        m.register_forward_hook(hook)
    for p in model.parameters():
        p.register_hook(keep)
    return seen


def run(
    weight: float,
    precision: str = "fp32",
    loss_scale: float | None = None,
    steps: int = 3,
    static: bool = False,
) -> tuple[ProfiledRun, list[torch.Tensor]]:
    """Train WeightedNet (always from the same weights) with its MSE multiplied by ``weight``; returns the run
    and every gradient its backward passes produced."""
    torch.manual_seed(0)
    model = WeightedNet()
    seen = gradients(model)
    profiled = train_profiled(
        model,
        regression_batches(N_IN),
        lambda out, y: weight * nn.functional.mse_loss(out.float(), y),
        precision=precision,
        loss_scale=loss_scale,
        static=static,
        steps=steps,
    )
    return profiled, seen

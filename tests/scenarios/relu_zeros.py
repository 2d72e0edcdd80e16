"""A ReLU classifier whose activation gradients are a third exact zeros, in fp32 as in fp16.

ReLU's backward writes an exact zero wherever its unit was off, so the gradient of each Linear's output is
zero there in any format. Its gradients are small (a cross-entropy averaged over 128 samples): trained in fp16
without a loss scaler, many sit among fp16's subnormals and a few reach its smallest one, 2^-24, yet next to
none of them flush. Weighting the loss by 2^-20 pushes them below fp16's floor: then most of them flush.
"""

from __future__ import annotations

import torch
from torch import nn

from .loop import Batch, ProfiledRun, train_profiled

N_IN, N_CLASSES = 32, 8


class ReluNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        self.act2 = nn.ReLU()
        self.fc3 = nn.Linear(width, width)
        self.act3 = nn.ReLU()
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act2(self.fc2(self.act1(self.fc1(x))))
        return self.head(self.act3(self.fc3(h)))


def batches(step: int) -> Batch:
    """The same 128 samples every step, their class the argmax of a fixed random projection."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, N_IN, generator=g)
    return x, (x @ torch.randn(N_IN, N_CLASSES, generator=g)).argmax(-1)


def output_gradients(model: nn.Module, hooked: type[nn.Module] = nn.Linear) -> list[torch.Tensor]:
    """The gradients of the ``hooked`` layers' outputs (the Linear layers', or the ReLUs', which no mask has
    touched), as the backward passes produce them (the test's own hooks, independent of precprof)."""
    seen: list[torch.Tensor] = []

    def keep(mod: nn.Module, args: object, y: torch.Tensor) -> None:
        if y.requires_grad:
            y.register_hook(lambda g: seen.append(g.detach().clone()))

    for m in model.modules():
        if isinstance(m, hooked):
            m.register_forward_hook(keep)
    return seen


def run(
    precision: str = "fp16",
    weight: float = 1.0,
    loss_scale: float | None = None,
    steps: int = 8,
    hooked: type[nn.Module] = nn.Linear,
) -> tuple[ProfiledRun, list[torch.Tensor]]:
    """Train ReluNet (always from the same weights) with its cross-entropy weighted by ``weight``; returns the
    run and the ``hooked`` layers' output gradients the test's hooks saw."""
    torch.manual_seed(0)
    model = ReluNet()
    seen = output_gradients(model, hooked)
    profiled = train_profiled(
        model,
        batches,
        lambda out, y: weight * nn.functional.cross_entropy(out.float(), y),
        precision=precision,
        loss_scale=loss_scale,
        steps=steps,
        lr=3e-3,
    )
    return profiled, seen

"""A regression on raw, unnormalised input features: four columns in physical units reach a few times 1e4.

The model's input is fp32 and holds them fine; fp16 autocast casts it to fp16 at the first Linear, where every
value beyond 65504 becomes inf, and the Linear's outputs of those rows are inf (and the backward's nan: the
scaler skips every step). Nothing inside the Linear overflows: its input did, in the cast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .loop import Batch, ProfiledRun, regression_batches, train_profiled

N_IN = 32
RAW = 3e4  # the raw columns' scale: about 3% of their values lie beyond fp16's 65504


class RawFeatureNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(N_IN, width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(self.act(self.fc1(x)))))


def batches(step: int, scale: float = RAW) -> Batch:
    """The regression's batches with their first four columns multiplied by ``scale`` (raw units)."""
    x, y = regression_batches(N_IN)(step)
    x[:, :4] *= scale
    return x, y


def fc1_outputs(model: RawFeatureNet) -> list[torch.Tensor]:
    """fc1's outputs, as the forward passes produce them (the test's own hook)."""
    seen: list[torch.Tensor] = []
    model.fc1.register_forward_hook(lambda mod, args, y: seen.append(y.detach().clone()))
    return seen


def run(
    precision: str = "fp32",
    loss_scale: float | None = None,
    keep_fp32: Sequence[str] = (),
    scale: float = RAW,
    steps: int = 4,
) -> tuple[ProfiledRun, list[torch.Tensor]]:
    """Train RawFeatureNet (always from the same weights) on features whose raw columns are ``scale`` large;
    returns the run and fc1's outputs."""
    torch.manual_seed(0)
    model = RawFeatureNet()
    seen = fc1_outputs(model)
    profiled = train_profiled(
        model,
        lambda step: batches(step, scale),
        lambda out, y: nn.functional.mse_loss(out.float(), y),
        precision=precision,
        loss_scale=loss_scale,
        keep_fp32=keep_fp32,
        steps=steps,
    )
    return profiled, seen

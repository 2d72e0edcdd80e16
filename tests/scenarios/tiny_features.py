"""Input features in tiny units: a conversion module scales the model's input by 1e-7 before the first Linear.

The conversion's output is fp32 (it multiplies the fp32 input), and under fp16 autocast the Linear that reads it
casts it to fp16, where a value at or below 2^-25 (about 3e-8) becomes 0: about a quarter of them. Keeping the
conversion in fp32 changes nothing, it already is; keeping the Linear that reads it in fp32 skips the cast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .dead_layers import Scale
from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 32
UNITS = 1e-7


class TinyFeatureNet(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.units = Scale(UNITS)
        self.fc1 = nn.Linear(N_IN, width)
        self.act = nn.Tanh()
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc1(self.units(x))))


def fc1_calls(model: TinyFeatureNet) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """fc1's (input, output) of each forward pass, as its caller hands the input over (the test's own hook)."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    model.fc1.register_forward_hook(lambda mod, args, y: seen.append((args[0].detach().clone(), y.detach())))
    return seen


def run(
    precision: str = "fp32",
    loss_scale: float | None = None,
    keep_fp32: Sequence[str] = (),
    steps: int = 3,
    width: int = 32,
) -> tuple[ProfiledRun, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Train TinyFeatureNet of fc1's ``width`` (always from the same weights); returns the run and fc1's inputs
    and outputs."""
    torch.manual_seed(0)
    model = TinyFeatureNet(width)
    seen = fc1_calls(model)
    profiled = train_profiled(
        model,
        regression_batches(N_IN),
        lambda out, y: nn.functional.mse_loss(out.float(), y),
        precision=precision,
        loss_scale=loss_scale,
        keep_fp32=keep_fp32,
        steps=steps,
    )
    return profiled, seen

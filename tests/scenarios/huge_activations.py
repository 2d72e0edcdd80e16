"""A layer whose outputs exceed fp16's largest value, 65504.

``amplify`` is a Linear with large weights (think of an un-normalised feature projection, or the outlier
features of large language models): its outputs reach a few hundred thousand, which is inf in fp16. A
LayerNorm brings them back to unit scale before the next layer. In fp16 autocast the Linear's output is
computed in fp16 and overflows; kept in fp32 (outside autocast) it does not, and the LayerNorm, which keeps
its input's dtype under CPU autocast, normalises it in fp32 before ``head`` casts it to fp16 again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 16
GAIN = 1e5  # amplify's weights are GAIN times a usual init: outputs up to ~1e5


class HugeActivationNet(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(N_IN, width)
        self.amplify = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 1)
        with torch.no_grad():
            self.amplify.weight.mul_(GAIN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.amplify(torch.relu(self.embed(x)))))


def mse(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(pred.float(), y)


def run(
    precision: str = "fp32", loss_scale: float | None = None, keep_fp32: Sequence[str] = (), steps: int = 4
) -> ProfiledRun:
    """Train HugeActivationNet for a few steps (always from the same initial weights and batches)."""
    torch.manual_seed(0)
    return train_profiled(
        HugeActivationNet(),
        regression_batches(N_IN),
        mse,
        precision=precision,
        loss_scale=loss_scale,
        keep_fp32=keep_fp32,
        steps=steps,
    )

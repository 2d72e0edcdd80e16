"""A nan that appears only in the backward pass, under fp16 autocast with dynamic loss scaling.

``Inject`` is the identity in the forward pass; on armed steps it puts a nan into one element of the gradient
that flows back through it (as a sqrt or log near 0 in a custom backward would). GradScaler sees a
non-finite gradient on every armed step, skips it and halves the scale: 20 armed steps from 2^16 take the
scale down to 2^-4, far below any scale an overflow would need. The advisor must say the nan came from the
backward pass at ``inject`` from the first armed step, and that those steps were skipped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from . import nan_injection
from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = nan_injection.N_IN
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


def armed_between(first: int, last: int) -> Callable[[nn.Module, int], None]:
    """An ``on_step`` that arms ``inject`` on steps ``first`` to ``last`` (inclusive) and disarms it otherwise."""

    def arm(model: nn.Module, step: int) -> None:
        model.get_submodule("inject").armed = first <= step <= last  # type: ignore[assignment]

    return arm


def backward_nan_net() -> nn.Module:
    """The model of ``nan_injection`` with the nan moved from the forward into the backward pass."""
    model = nan_injection.NanNet()
    model.inject = Inject()
    return model


def run(sample_every: int = 1, first: int = FIRST, last: int = LAST, static: bool = False) -> ProfiledRun:
    """Train ``STEPS`` steps with the nan armed on steps ``first`` to ``last``, layers sampled every
    ``sample_every`` steps; ``static``: the scale stays at 2^16 (no back-off)."""
    torch.manual_seed(0)
    return train_profiled(
        backward_nan_net(),
        regression_batches(N_IN),
        nan_injection.mse,
        precision="fp16",
        loss_scale=2.0**16,
        steps=STEPS,
        sample_every=sample_every,
        on_step=armed_between(first, last),
        static=static,
    )

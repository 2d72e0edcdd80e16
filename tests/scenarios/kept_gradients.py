"""Layers fp16 must keep in fp32, whose gradients are far larger, or smaller, than the rest.

``ResidualStream``: an un-normalised residual stream. After two blocks, ``big`` writes about 1e5 into it (beyond fp16's 65504), and
``post`` and ``head`` read the sum, so fp16 keeps all three in fp32. ``head``'s weight gradient is the stream
(1e5) times the loss's gradient: far above every gradient fp16 computes, which are those of ``embed`` and the blocks
(fp16 under autocast: ``big``, kept, sends its input's gradient back to them through a cast). Kept in fp32, ``head`` computes its weight
gradient in fp32, and the stream's gradients are fp32: the loss scale fits the others.

``NearReader``: ``near`` makes values within 2x of 65504, so fp16 keeps it in fp32; ``reader``, a Linear run in
fp16, reads its output directly. autocast casts that output to fp16 for ``reader``, whose backward computes the
gradient of the copy in fp16: ``near``'s output gradient, fp32 as its output is, holds values computed in fp16.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .loop import ProfiledRun, regression_batches, train_profiled

N_IN = 16


class ResidualStream(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(N_IN, width)
        self.block1 = nn.Linear(width, width)
        self.block2 = nn.Linear(width, width)
        self.big = nn.Linear(width, width)
        self.post = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        with torch.no_grad():
            self.big.weight.mul_(1e5)
            self.post.weight.mul_(1e-5)
            self.head.weight.mul_(1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = h + torch.tanh(self.block1(h))
        h = h + torch.tanh(self.block2(h))
        h = h + self.big(h)
        h = h + self.post(h)
        return self.head(h)


class NearReader(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.near = nn.Linear(N_IN, width)
        self.reader = nn.Linear(width, width)
        self.head = nn.Linear(width, 1)
        with torch.no_grad():
            self.near.weight.mul_(2e4)
            self.reader.weight.mul_(1e-4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.reader(self.near(x))))


def output_gradients(model: nn.Module, names: Sequence[str]) -> dict[str, list[torch.Tensor]]:
    """The gradients of the named modules' outputs, as backward produces them (the test's own hooks)."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def hook(name: str) -> object:
        def on_output(mod: nn.Module, args: object, y: torch.Tensor) -> None:
            if y.requires_grad:
                y.register_hook(lambda g: seen[name].append(g.detach().clone()))

        return on_output

    for n in names:
        model.get_submodule(n).register_forward_hook(hook(n))  # type: ignore[arg-type]
    return seen


def run(
    model: type[nn.Module],
    precision: str = "fp32",
    loss_scale: float | None = None,
    keep_fp32: Sequence[str] = (),
    steps: int = 4,
    lr: float = 1e-4,
) -> tuple[ProfiledRun, dict[str, list[torch.Tensor]]]:
    """Train ``model`` (always from the same weights and batches); with the output gradients of its modules."""
    torch.manual_seed(0)
    net = model()
    seen = output_gradients(net, [n for n, _ in net.named_children()])
    return train_profiled(
        net,
        regression_batches(N_IN),
        lambda out, y: nn.functional.mse_loss(out.float(), y),
        precision=precision,
        loss_scale=loss_scale,
        static=loss_scale is not None,
        keep_fp32=keep_fp32,
        steps=steps,
        lr=lr,
    ), seen

"""Weight updates lost in bf16-held weights: a user's own loop trains an MLP whose parameters are bf16 (what
``precprof train -p bf16-pure`` does) at a learning rate whose updates are far below half a bf16 ulp of the
weights. The updates arrive as zero deltas: the optimizer meant to move the weights, and they did not move.

Independent hooks count, over every element of every parameter, the updates that were intended (a nonzero
gradient, or a weight that moved) and those that did not land, to compare with what precprof recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import precprof
from precprof import tables as T

from .loop import ProfiledRun, regression_batches


@dataclass
class Truth:
    intended: int  # elements with a nonzero gradient or a moved weight
    stuck: int  # intended, but the weight did not change
    moved_any: bool  # whether any weight changed at all


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def run(dtype: torch.dtype, lr: float, steps: int = 6) -> tuple[ProfiledRun, Truth]:
    """Train in ``dtype`` weights (bf16: pure bf16; fp32: fp32 weights) with AdamW at ``lr``; every step is
    sampled, and the update sample covers every element (the largest parameter has 4,096)."""
    model = mlp().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = regression_batches(16, seed=3)
    losses: list[float] = []
    truth = Truth(0, 0, False)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, update_sample=1 << 16)
    with prof:
        for step in range(steps):
            x, y = batches(step)
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            loss.backward()
            before = [(p.detach().clone(), p.grad.detach().clone()) for p in model.parameters()]
            opt.step()
            for p, (w0, g) in zip(model.parameters(), before, strict=True):
                moved = p.detach() != w0
                intended = (g != 0) | moved
                truth.intended += int(intended.sum())
                truth.stuck += int((intended & ~moved).sum())
                truth.moved_any |= bool(moved.any())
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    summary = {
        T.SUMMARY_MODEL: {"n_params": sum(p.numel() for p in model.parameters())},
        T.SUMMARY_CAPTURE: prof.summary(),
    }
    return ProfiledRun(prof.tables(), summary, losses), truth

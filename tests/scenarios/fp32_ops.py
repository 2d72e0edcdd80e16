"""What the guide keeps in fp32, cast to bf16 with the rest of a model (``model.to(torch.bfloat16)``, what
``precprof train -p bf16-pure`` does): LayerNorm, softmax and BatchNorm outputs in bf16, BatchNorm's running
statistics in bf16, AdamW's states in bf16. The same model under bf16 autocast keeps its weights, buffers and
optimizer states in fp32."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import precprof
from precprof import tables as T

from .loop import ProfiledRun, regression_batches


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.bn = nn.BatchNorm1d(32)
        self.ln = nn.LayerNorm(32)
        self.attn = nn.Softmax(dim=-1)
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.bn(self.inp(x)))
        return self.out(h * self.attn(h))


def run(pure: bool, steps: int = 3) -> ProfiledRun:
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16) if pure else Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = regression_batches(8, seed=4)
    losses: list[float] = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
    with prof:
        for step in range(steps):
            x, y = batches(step)
            ctx = contextlib.nullcontext() if pure else torch.autocast("cpu", dtype=torch.bfloat16)
            with ctx:
                out = model(x.to(torch.bfloat16) if pure else x)
            loss = nn.functional.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    return ProfiledRun(prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}, losses)

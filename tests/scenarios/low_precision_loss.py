"""A next-token model cast to bf16 (``model.to(torch.bfloat16)``) whose loss is ``F.cross_entropy`` on its bf16
logits: no module computes the loss, so only the loss tensor's dtype tells. The same model with
``F.cross_entropy(logits.float(), ...)`` is the remedy. Each run also computes, from the very same logits, the
loss in fp32, so the test can measure what the bf16 loss rounded away."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import precprof
from precprof import tables as T

from .loop import ProfiledRun

VOCAB = 64


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


@dataclass
class LossRun(ProfiledRun):
    fp32_losses: list[float]  # the same logits' loss computed in fp32, step by step


def run(fp32_loss: bool, steps: int = 12) -> LossRun:
    torch.manual_seed(0)
    model = TinyLM().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    exact: list[float] = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=4)
    with prof:
        for _ in range(steps):
            seq = torch.randint(0, VOCAB // 4, (8, 17), generator=g) * 4 % VOCAB  # a learnable pattern
            x, y = seq[:, :-1], (seq[:, 1:] + 1) % VOCAB
            logits = model(x).flatten(0, 1)
            loss = F.cross_entropy(logits.float() if fp32_loss else logits, y.flatten())
            exact.append(F.cross_entropy(logits.detach().float(), y.flatten()).item())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    return LossRun(prof.tables(), {T.SUMMARY_CAPTURE: prof.summary()}, losses, exact)

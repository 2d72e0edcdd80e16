"""A tiny LM whose embedding (std 300) feeds a hand-written RMSNorm, for the built-in loop as a model factory
(``path/to/norm_overflow.py:factory``): in fp16 its x.pow(2) overflows for |x| >= 256, the mean of every row is
inf and x * rsqrt(inf) zeroes the norm's whole output; ``fp32_norm=True`` computes the norm on x.float() and
casts back, as Llama's RMSNorm does, which makes no zeros."""

from __future__ import annotations

import torch
from torch import nn


class NaiveRMSNorm(nn.Module):
    def __init__(self, d: int, fp32: bool = False) -> None:
        super().__init__()
        self.weight, self.fp32 = nn.Parameter(torch.ones(d)), fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            h = x.float()
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LM(nn.Module):
    def __init__(self, vocab_size: int, d: int, fp32_norm: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab_size, d)
        nn.init.normal_(self.emb.weight, std=300.0)
        self.norm = NaiveRMSNorm(d, fp32_norm)
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(self.act(self.up(self.norm(self.emb(x))))))


def factory(vocab_size: int = 256, d: int = 64, fp32_norm: bool = False) -> nn.Module:
    return LM(vocab_size, d, fp32_norm)

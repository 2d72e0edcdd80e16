"""A tiny pre-norm LM (``x = x + mlp(norm(x))`` per block, a final norm, a head) whose residual stream grows past
256 over its blocks, with a hand-written RMSNorm, for the built-in loop as a model factory
(``path/to/prenorm_overflow.py:factory``) and for tests' own loops. Fp16-pure, the norms' inputs are residual
sums, no module's output: each block's MLP adds less than 256 (its ``down`` never outputs a value that large),
the sum reaches it a few blocks in, and a norm's x.pow(2) of a value |x| >= 256 is inf in fp16: the mean of its
row is inf and x * rsqrt(inf) zeroes the row. ``fp32_norm=True`` computes each norm on x.float() and casts back,
as Llama's RMSNorm does, which makes no zeros; ``torch_norm=True`` uses torch's nn.RMSNorm, which computes in fp32
inside."""

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


class Block(nn.Module):
    def __init__(self, d: int, fp32_norm: bool, down_std: float = 5.0, torch_norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6) if torch_norm else NaiveRMSNorm(d, fp32_norm)
        self.up, self.act, self.down = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        nn.init.normal_(self.down.weight, std=down_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class LM(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        d: int,
        n_layer: int,
        fp32_norm: bool,
        emb_std: float,
        down_std: float,
        torch_norm: bool = False,
    ) -> None:
        super().__init__()
        self.fp32_stream = False  # the embedding's output upcast (h.float()): the residual sums stay fp32
        self.emb = nn.Embedding(vocab_size, d)
        nn.init.normal_(self.emb.weight, std=emb_std)
        self.blocks = nn.ModuleList(Block(d, fp32_norm, down_std, torch_norm) for _ in range(n_layer))
        self.norm = nn.RMSNorm(d, eps=1e-6) if torch_norm else NaiveRMSNorm(d, fp32_norm)
        self.head = nn.Linear(d, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.fp32_stream:
            h = h.float()
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def factory(
    vocab_size: int = 256,
    d: int = 64,
    n_layer: int = 6,
    fp32_norm: bool = False,
    emb_std: float = 60.0,
    down_std: float = 5.0,
    torch_norm: bool = False,
) -> nn.Module:
    """The LM; ``emb_std`` and ``down_std`` (its embedding's and each MLP's ``down`` weights' spread) set how
    large the residual stream grows: with ``fp32_norm=True``, ``emb_std=12000, down_std=400`` take it near fp16's
    65504 (no module outputs a value that large but the embedding), ``down_std=1500`` beyond it."""
    torch.manual_seed(0)
    return LM(vocab_size, d, n_layer, fp32_norm, emb_std, down_std, torch_norm)

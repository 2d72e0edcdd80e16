"""A tiny causal language model whose attention mask comes from a module of its own.

``CausalMask`` has no parameters and returns ``torch.full((t, t), -inf).triu(1)``, the additive mask that
nn.MultiheadAttention adds to its scores, as many hand-written GPTs build it. Its output holds -inf by design:
the softmax turns it into zero weights, and the loss and every gradient stay finite. ``gain`` multiplies
``fc``'s weights: at 1e5 its output goes beyond fp16's 65504 and is inf under fp16 autocast, which the norm
after it turns into nan; ``clamp`` clamps ``fc``'s output back into fp16's range first, as HF's T5 does with
the inf of an fp16 overflow, so that the loss stays finite.
"""

from __future__ import annotations

import torch
from torch import nn

from .loop import ProfiledRun, train_profiled

VOCAB, WIDTH, SEQ = 32, 16, 8
CLAMP = 60000.0  # below fp16's 65504 (T5 clamps at its largest value less 1000)


class CausalMask(nn.Module):
    """The additive causal mask of a (batch, seq, width) input: 0 on and below the diagonal, -inf above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        return torch.full((t, t), float("-inf"), device=x.device).triu(1)  # (T, T)


class MaskedLM(nn.Module):
    def __init__(self, gain: float = 1.0, clamp: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mask = CausalMask()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.clamp = clamp
        with torch.no_grad():
            self.fc.weight.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.emb(x)  # (B, T, C)
        a, _ = self.attn(e, e, e, attn_mask=self.mask(e), need_weights=False)
        h = self.fc(e + a)
        if self.clamp:
            h = h.clamp(-CLAMP, CLAMP)
        return self.head(self.norm(h))  # (B, T, VOCAB)


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, the next token as the target."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


def run(model: MaskedLM, precision: str = "fp32", steps: int = 3) -> ProfiledRun:
    """Train ``model`` a few steps without a loss scaler (always the same batches)."""
    return train_profiled(model, batches, lm_loss, precision=precision, steps=steps)

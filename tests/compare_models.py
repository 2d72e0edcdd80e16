"""A model factory for tests/test_compare.py (``--model tests/compare_models.py:tiny_gradient_lm``).

``tiny_gradient_lm`` is a small language model whose forward pass and loss are ordinary while every gradient is
2^-20 as large as it would be: the gradient leaving the logits is multiplied by ``grad_scale`` on its way back.
That is the situation of the 2018 "Mixed Precision Training" paper's SSD: unscaled fp16 gradients vanish below
2^-24, and loss scaling brings them back. Trained with SGD at a learning rate 2^20 times larger, fp32 learns as
a normal model would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

GRAD_SCALE = 2.0**-20


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``c`` in the gradient's own dtype (fp16 under
    autocast: values below 2^-24 become 0, as a real fp16 cast does)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, c: float) -> torch.Tensor:
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.c, None


class ScaleGrad(nn.Module):
    """A module (so that the profiler sees the gradient on both sides of it): identity forward, gradient times
    ``c`` backward."""

    def __init__(self, c: float) -> None:
        super().__init__()
        self.c = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(x, self.c)


class TinyGradientLM(nn.Module):
    """Embedding -> Linear -> GELU -> Linear head, gradients scaled by ``grad_scale`` at the logits."""

    def __init__(self, vocab_size: int, n_embd: int = 32, grad_scale: float = GRAD_SCALE) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.fc = nn.Linear(n_embd, 2 * n_embd)
        self.act = nn.GELU()
        self.head = nn.Linear(2 * n_embd, vocab_size)
        self.scale_grad = ScaleGrad(grad_scale)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(self.wte(idx)))  # (B, T, 2C)
        return self.scale_grad(
            self.head(h)
        )  # (B, T, V); the logits' gradient reaches the head 2^-20 as large


def tiny_gradient_lm(
    vocab_size: int = 256, seq_len: int = 64, n_embd: int = 32, grad_scale_log2: int = -20
) -> TinyGradientLM:
    """Factory in precprof's model contract (``vocab_size`` and ``seq_len`` are passed by the training loop);
    ``grad_scale_log2`` sets the gradients' factor (``-a grad_scale_log2=-60``: below what fp16 holds at any loss
    scale the advice allows)."""
    return TinyGradientLM(vocab_size, n_embd, 2.0**grad_scale_log2)

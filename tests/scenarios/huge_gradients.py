"""Gradients 2^30 larger than usual (the gradient at the logits multiplied on its way back, as in
tests/compare_models.py, the other way round): in fp16 they overflow at scale 1, and the scale that keeps
them finite flushes the small ones. No fp16 loss scale fits; the advisor must not propose one."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from .loop import ProfiledRun, train_profiled

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from compare_models import TinyGradientLM


def _batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (8, 16), generator=g)
    return x, torch.roll(x, -1, 1)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1))


def run(steps: int = 4) -> ProfiledRun:
    torch.manual_seed(0)
    return train_profiled(TinyGradientLM(256, 32, grad_scale=2.0**30), _batches, _loss, steps=steps, lr=1e-3)

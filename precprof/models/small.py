"""Token models that are not transformers: an MLP and a causal CNN with BatchNorm."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MLPConfig:
    """Per-token MLP (embedding -> Linear/ReLU stack -> head): enough to learn a first-order Markov chain."""

    n_embd: int = 128
    hidden: int = 512
    n_layer: int = 2
    vocab_size: int = 0


class TokenMLP(nn.Module):
    """Embedding, ``n_layer`` Linear + in-place ReLU layers, a linear head. The in-place ReLUs are deliberate:
    hooks that rely on ``register_full_backward_hook`` break on them, and precprof's capture must not."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        layers: list[nn.Module] = []
        width = cfg.n_embd
        for _ in range(cfg.n_layer):
            layers += [nn.Linear(width, cfg.hidden), nn.ReLU(inplace=True)]
            width = cfg.hidden
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(width, cfg.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size)."""
        return self.head(self.layers(self.embed(idx)))


@dataclass
class CNNConfig:
    """Causal 1-D convolutions with BatchNorm over token embeddings (residual blocks)."""

    channels: int = 128
    n_layer: int = 3
    kernel_size: int = 3
    vocab_size: int = 0


class ConvBNBlock(nn.Module):
    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.pad = cfg.kernel_size - 1  # left padding only: position t sees tokens <= t
        self.conv = nn.Conv1d(cfg.channels, cfg.channels, cfg.kernel_size)
        self.bn = nn.BatchNorm1d(cfg.channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.bn(self.conv(F.pad(x, (self.pad, 0)))))  # (B, C, T)


class TokenCNN(nn.Module):
    """Embedding -> residual (causal Conv1d, BatchNorm1d, ReLU) blocks -> linear head.

    BatchNorm is the layer mixed-precision guides say must keep fp32 statistics; in the pure modes it runs
    in low precision like everything else, which is what the profiler is there to show.
    """

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.channels)
        self.blocks = nn.Sequential(*[ConvBNBlock(cfg) for _ in range(cfg.n_layer)])
        self.head = nn.Linear(cfg.channels, cfg.vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size)."""
        x = self.embed(idx).transpose(1, 2)  # (B, C, T)
        x = self.blocks(x).transpose(1, 2)  # (B, T, C)
        return self.head(x)

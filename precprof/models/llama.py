"""A small Llama: RMSNorm, SwiGLU and rotary embeddings (the built-in llama-mini)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from precprof.errors import UserError
from precprof.models.gpt import _init_normal


@dataclass
class LlamaConfig:
    """A Llama-style decoder: RMSNorm, SwiGLU MLP, rotary position embeddings, no biases, untied head."""

    n_layer: int = 4
    n_head: int = 8
    n_embd: int = 256
    intermediate_size: int = 0  # 0: 8/3 * n_embd rounded up to a multiple of 64 (Llama's rule)
    block_size: int = 256
    vocab_size: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


def llama_intermediate_size(n_embd: int) -> int:
    """Llama's SwiGLU width: 8/3 of the model width, rounded up to a multiple of 64."""
    return 64 * math.ceil(8 * n_embd / 3 / 64)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
            raise UserError(f"n_embd={cfg.n_embd} must be n_head={cfg.n_head} times an even head size")
        self.n_head = cfg.n_head
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.o_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hs = c // self.n_head
        q = self.q_proj(x).view(b, t, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(b, t, self.n_head, hs).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_head, hs).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = cfg.intermediate_size or llama_intermediate_size(cfg.n_embd)
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=False)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleList([LlamaBlock(cfg) for _ in range(cfg.n_layer)])
        self.norm = nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)


class Llama(nn.Module):
    """Llama-style decoder with Hugging Face's module names (``model.layers.0.self_attn.q_proj``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(_init_normal)

    def _rope(self, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # computed in fp32 on every call (cheap: T x hs/2), so that pure-bf16/fp16 modes, which cast every
        # floating buffer of the model, never hold rotary angles in low precision
        hs = self.config.n_embd // self.config.n_head
        inv_freq = self.config.rope_theta ** (
            -torch.arange(0, hs, 2, device=device, dtype=torch.float32) / hs
        )
        angles = torch.outer(torch.arange(t, device=device, dtype=torch.float32), inv_freq)  # (T, hs/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, hs)
        return angles.cos(), angles.sin()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size)."""
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        cos, sin = self._rope(t, idx.device)
        x = self.model.embed_tokens(idx)  # (B, T, C)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

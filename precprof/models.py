"""Built-in models, Hugging Face models built offline from a config, and the user's own model factories.

``build_model(name, model_args, vocab_size=..., seq_len=...)`` resolves ``--model``:

- built-in: ``gpt-nano`` (≈0.5M parameters, the default), ``gpt-mini`` (≈10M), ``gpt2-small`` (the GPT-2
  124M configuration), ``gpt2-medium`` (350M), ``llama-mini`` (RMSNorm, SwiGLU, rotary embeddings), ``mlp``
  and ``cnn-bn`` (causal 1-D convolutions with BatchNorm). Sizes are overridable with ``--model-arg k=v``
  (the fields of the model's config dataclass, e.g. ``n_layer=2``).
- ``hf:<model_type>`` (``hf:gpt2``, ``hf:llama``, ...): ``AutoModelForCausalLM.from_config`` with random
  weights, no download; ``--model-arg`` sets fields of the model's ``PretrainedConfig``.
- ``path/to/file.py:factory`` or ``package.module:factory``: the user's own model.

The model contract (all three kinds): ``forward(x)`` takes ``x``, an int64 tensor (batch_size, seq_len) of token
ids in [0, 256) on the training device, and returns either next-token logits of shape (batch_size, seq_len,
vocab_size) — the loop computes the cross-entropy in fp32 — or a scalar loss. Objects with ``.loss`` or
``.logits`` (Hugging Face outputs) and dicts with those keys are accepted. If ``forward`` has a ``targets``
parameter, the loop calls ``forward(x, targets=y)`` with y (batch_size, seq_len), already shifted:
``y[:, t]`` is the token after ``x[:, t]``. A factory is called with the ``--model-arg`` values as keyword
arguments (numbers and booleans converted) plus ``vocab_size`` and ``seq_len`` when its signature accepts
them (or has ``**kwargs``), and must return an ``nn.Module``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from precprof.errors import MissingDependencyError, UserError
from precprof.footprint import available_bytes, size_text

GPT2_VOCAB_SIZE = 50257


# ----------------------------------------------------------------------------------------------- GPT
@dataclass
class GPTConfig:
    """A nanoGPT-style decoder. ``vocab_size=0`` means "the data's vocabulary" (256)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 96
    block_size: int = 256  # the longest sequence the position embedding covers
    vocab_size: int = 0
    bias: bool = True
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise UserError(f"n_embd={cfg.n_embd} is not a multiple of n_head={cfg.n_head}")
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTTransformer(nn.Module):
    """The trunk of GPT: token and position embeddings, blocks, final LayerNorm (named as in GPT-2)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList([GPTBlock(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)


class GPT(nn.Module):
    """GPT-2 style decoder (pre-LayerNorm, GELU MLP, learned positions, tied input/output embeddings).

    Module names follow nanoGPT and Hugging Face GPT-2 (``transformer.h.0.attn.c_attn``, ``lm_head``).
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = GPTTransformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(_init_normal)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, vocab_size)."""
        _, t = idx.shape
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # (B, T, V)


def _init_normal(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)


# ------------------------------------------------------------------------------------------ Llama
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


# ------------------------------------------------------------------------------------- MLP and CNN
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


# ------------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class _Builtin:
    description: str
    config: Callable[[], Any]
    build: Callable[[Any], nn.Module]


BUILTIN_MODELS: dict[str, _Builtin] = {
    "gpt-nano": _Builtin("GPT, 4 layers, n_embd 96 (≈0.5M parameters)", GPTConfig, GPT),
    "gpt-mini": _Builtin(
        "GPT, 6 layers, n_embd 384 (≈10M parameters)",
        lambda: GPTConfig(n_layer=6, n_head=6, n_embd=384),
        GPT,
    ),
    "gpt2-small": _Builtin(
        "the GPT-2 124M configuration (12 layers, n_embd 768, vocab 50257, 1024 positions)",
        lambda: GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=GPT2_VOCAB_SIZE),
        GPT,
    ),
    "gpt2-medium": _Builtin(
        "the GPT-2 350M configuration (24 layers, n_embd 1024, vocab 50257, 1024 positions)",
        lambda: GPTConfig(n_layer=24, n_head=16, n_embd=1024, block_size=1024, vocab_size=GPT2_VOCAB_SIZE),
        GPT,
    ),
    "llama-mini": _Builtin(
        "Llama-style, 4 layers, n_embd 256, RMSNorm, SwiGLU, rotary (≈3.3M parameters)", LlamaConfig, Llama
    ),
    "mlp": _Builtin("per-token MLP, 2 hidden layers of 512 (≈0.5M parameters)", MLPConfig, TokenMLP),
    "cnn-bn": _Builtin(
        "causal Conv1d + BatchNorm1d, 3 residual blocks (≈0.2M parameters)", CNNConfig, TokenCNN
    ),
}
DEFAULT_MODEL = "gpt-nano"
MODEL_KINDS_HELP = "hf:<model_type> (e.g. hf:gpt2, hf:llama), path/to/file.py:factory, package.module:factory"


@dataclass
class BuiltModel:
    """A model ready to train, and what summary.json records about it.

    ``kind`` is "builtin", "hf" or "factory". ``max_seq_len`` is the longest sequence the model accepts
    (None when unknown). ``pass_targets``: forward takes ``targets=`` (see the module docstring).
    """

    module: nn.Module
    name: str
    kind: str
    vocab_size: int | None
    max_seq_len: int | None
    pass_targets: bool = False
    dims: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        """The "model" part of summary.json: name, class, parameter count, dims (for alignment checks)."""
        return {
            "name": self.name,
            "kind": self.kind,
            "class": f"{type(self.module).__module__}.{type(self.module).__qualname__}",
            "n_params": count_params(self.module),
            "vocab_size": self.vocab_size,
            "max_seq_len": self.max_seq_len,
            **self.dims,
        }


def count_params(module: nn.Module) -> int:
    """Number of distinct parameter elements (tied weights counted once)."""
    return sum(p.numel() for p in module.parameters())


def known_models() -> list[str]:
    """Built-in model names, in the order of the help text."""
    return list(BUILTIN_MODELS)


def parse_model_args(items: Sequence[str]) -> dict[str, str]:
    """``["k=v", ...]`` (repeated ``--model-arg``) -> {k: v}; a malformed item raises UserError."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UserError(f"--model-arg {item!r}: expected KEY=VALUE, e.g. --model-arg n_layer=2")
        out[key] = value.strip()
    return out


def coerce_value(value: Any) -> Any:
    """A command-line string as the int, float, bool or None it spells; other strings and non-strings as is."""
    if not isinstance(value, str):
        return value
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(value)
        except ValueError:
            pass
    return value


def _coerce_to(name: str, value: Any, like: Any, where: str) -> Any:
    """``value`` converted to the type of the default ``like``; UserError when it does not fit."""
    if isinstance(like, str) and isinstance(value, str):
        return value  # a string setting keeps "1" as "1"
    v = coerce_value(value)
    if like is None or v is None:
        return v
    is_number = isinstance(v, (int, float)) and not isinstance(v, bool)
    if isinstance(like, bool):
        ok = isinstance(v, bool)
    elif isinstance(like, int):
        ok = is_number and isinstance(v, int)
    elif isinstance(like, float):
        ok = is_number
        v = float(v) if ok else v
    else:
        ok = True
    if not ok:
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(
            type(like), type(like).__name__
        )
        raise UserError(f"--model-arg {name}={value}: {where} expects {kind} for {name}")
    return v


def _build_builtin(
    name: str, args: Mapping[str, Any], vocab_size: int, seq_len: int
) -> tuple[nn.Module, Any]:
    spec = BUILTIN_MODELS[name]
    cfg = spec.config()
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    updates: dict[str, Any] = {}
    for k, v in args.items():
        if k not in fields:
            raise UserError(f"--model-arg {k}: {name} has no such setting; known: {', '.join(fields)}")
        updates[k] = _coerce_to(k, v, getattr(cfg, k), name)
    cfg = dataclasses.replace(cfg, **updates)
    if cfg.vocab_size == 0:
        cfg.vocab_size = vocab_size
    if isinstance(cfg, LlamaConfig) and not cfg.intermediate_size:
        cfg.intermediate_size = llama_intermediate_size(cfg.n_embd)
    if hasattr(cfg, "block_size") and seq_len > cfg.block_size:
        raise UserError(
            f"--seq-len {seq_len} exceeds {name}'s block_size {cfg.block_size}; "
            f"use --model-arg block_size={seq_len} or a shorter --seq-len"
        )
    for k, v in dataclasses.asdict(cfg).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            raise UserError(f"--model-arg {k}={v}: must not be negative")
    # before allocating anything: a meta-device build would be exact but imports torch._dynamo (seconds)
    _check_size(name, approx_params(cfg))
    try:
        module = spec.build(cfg)
    except UserError:
        raise
    except (ValueError, RuntimeError) as e:
        raise UserError(f"cannot build {name} with {dict(args)}: {e}") from None
    return module, cfg


def _build_hf(model_type: str, args: Mapping[str, Any], seq_len: int) -> BuiltModel:
    try:
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise MissingDependencyError("transformers", extra="hf", purpose=f"--model hf:{model_type}") from None
    try:
        default = AutoConfig.for_model(model_type)
    except (ValueError, KeyError):
        known = sorted(transformers.CONFIG_MAPPING.keys())
        examples = ", ".join(
            k for k in ("gpt2", "llama", "mistral", "qwen2", "gpt_neox", "opt") if k in known
        )
        raise UserError(
            f"unknown Hugging Face model type {model_type!r}; use a model_type such as {examples}"
        ) from None
    kwargs: dict[str, Any] = {}
    for k, v in args.items():
        if not hasattr(default, k):
            raise UserError(
                f"--model-arg {k}: the {model_type} config has no field {k!r} "
                f"(see transformers' {type(default).__name__})"
            )
        kwargs[k] = _coerce_to(k, v, getattr(default, k), f"hf:{model_type}")
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
        # meta device first: a default config can be billions of parameters (hf:llama is 7B)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        n_params = count_params(meta)
        del meta
        _check_size(f"hf:{model_type}", n_params)
        module = AutoModelForCausalLM.from_config(config)
    except UserError:
        raise
    except (ValueError, TypeError, RuntimeError, AttributeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot build hf:{model_type} from its config: {msg}") from None
    max_len = next(
        (
            int(getattr(config, a))
            for a in ("n_positions", "max_position_embeddings")
            if isinstance(getattr(config, a, None), int)
        ),
        None,
    )
    if max_len is not None and seq_len > max_len:
        raise UserError(
            f"--seq-len {seq_len} exceeds hf:{model_type}'s {max_len} positions; use a shorter --seq-len"
        )
    dims = {
        k: getattr(config, k)
        for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
        if isinstance(getattr(config, k, None), int)
    }
    return BuiltModel(
        module=module,
        name=f"hf:{model_type}",
        kind="hf",
        vocab_size=int(config.vocab_size),
        max_seq_len=max_len,
        dims=dims,
    )


# The least any precision mode of the built-in loop needs per parameter to train: bf16/fp16-pure weights and
# gradients (2 + 2 bytes) and SGD's fp32 momentum (4). fp32 with AdamW needs 16; the exact, mode-aware check
# (precprof.footprint, activations included) runs once the model is built. This one only keeps a model that can
# never train here from being allocated at all, so it must not refuse what some mode could train.
_MIN_BYTES_PER_PARAM_TRAINING = 8


def approx_params(cfg: Any) -> int:
    """Parameter count of a built-in model config from its dimensions (exact up to norms and biases)."""
    if isinstance(cfg, GPTConfig):
        c = cfg.n_embd
        return 12 * cfg.n_layer * c * c + (cfg.vocab_size + cfg.block_size) * c
    if isinstance(cfg, LlamaConfig):
        c, i = cfg.n_embd, cfg.intermediate_size or llama_intermediate_size(cfg.n_embd)
        return cfg.n_layer * (4 * c * c + 3 * c * i) + 2 * cfg.vocab_size * c
    if isinstance(cfg, MLPConfig):
        v, e, h = cfg.vocab_size, cfg.n_embd, cfg.hidden
        return v * e + (e * h + (cfg.n_layer - 1) * h * h + h * v if cfg.n_layer else e * v)
    if isinstance(cfg, CNNConfig):
        return cfg.n_layer * cfg.kernel_size * cfg.channels**2 + 2 * cfg.vocab_size * cfg.channels
    return 0


def _check_size(name: str, n_params: int) -> None:
    """UserError when training ``n_params`` parameters cannot fit in this machine's RAM in any precision mode
    (``_MIN_BYTES_PER_PARAM_TRAINING`` bytes each against the memory available, cgroup limit included)."""
    avail = _available_ram()
    need = n_params * _MIN_BYTES_PER_PARAM_TRAINING
    if avail is not None and need > avail:
        raise UserError(
            f"{name} has {n_params / 1e6:,.0f}M parameters: even the leanest precision mode needs at least "
            f"{size_text(need)} to train them (16-bit weights and gradients, one fp32 optimizer state), more "
            f"than the {size_text(avail)} of memory available; pass smaller sizes with --model-arg"
        )


def _available_ram() -> int | None:
    """Bytes of RAM this process can still take (``MemAvailable`` bounded by the cgroup); None: unknown."""
    return available_bytes(torch.device("cpu"))


def _load_factory(spec: str) -> Callable[..., Any]:
    target, _, attr = spec.rpartition(":")
    if not target or not attr.isidentifier():
        raise UserError(f"--model {spec!r}: expected path/to/file.py:factory or package.module:factory")
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"--model {spec!r}: no such file {str(path)!r}")
        mod_name = f"precprof_user_model_{abs(hash(str(path.resolve())))}"
        file_spec = importlib.util.spec_from_file_location(mod_name, path)
        if file_spec is None or file_spec.loader is None:
            raise UserError(f"--model {spec!r}: cannot import {str(path)!r} as Python")
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look modules up here
        try:
            file_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(mod_name, None)
            raise UserError(
                f"--model {spec!r}: importing {str(path)!r} failed: {type(e).__name__}: {e}"
            ) from None
    else:
        try:
            module = importlib.import_module(target)
        except Exception as e:
            raise UserError(f"--model {spec!r}: cannot import {target!r}: {type(e).__name__}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"--model {spec!r}: {target!r} has no callable {attr!r}")
    return factory


def _build_factory(spec: str, args: Mapping[str, Any], vocab_size: int, seq_len: int) -> BuiltModel:
    factory = _load_factory(spec)
    kwargs = {k: coerce_value(v) for k, v in args.items()}
    try:
        params = inspect.signature(factory).parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        for k, v in (("vocab_size", vocab_size), ("seq_len", seq_len)):
            if (k in params or var_kw) and k not in kwargs:
                kwargs[k] = v
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        pass
    try:
        module = factory(**kwargs)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"model factory {spec!r} raised {type(e).__name__}: {msg}") from None
    if not isinstance(module, nn.Module):
        raise UserError(f"model factory {spec!r} returned {type(module).__name__}, not a torch.nn.Module")
    return BuiltModel(
        module=module,
        name=spec,
        kind="factory",
        vocab_size=_guess_vocab(module),
        max_seq_len=None,
        pass_targets=accepts_targets(module),
    )


def accepts_targets(module: nn.Module) -> bool:
    """Whether ``module.forward`` has a ``targets`` parameter (then the loop passes the next-token targets)."""
    try:
        return "targets" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _guess_vocab(module: nn.Module) -> int | None:
    """The size of the first embedding table, a good guess of a user model's vocabulary."""
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            return int(m.num_embeddings)
    return None


def build_model(
    name: str, model_args: Mapping[str, Any] | None = None, *, vocab_size: int, seq_len: int
) -> BuiltModel:
    """Build ``--model name`` on the CPU (seed torch first for reproducible weights).

    ``vocab_size`` is the data's vocabulary (models default to it, except the GPT-2 configurations and
    Hugging Face configs, which keep their own and must be at least as large); ``seq_len`` is checked against
    the model's positions. Raises UserError naming the known models for an unknown name, a bad
    ``--model-arg``, or a factory that fails.
    """
    args = dict(model_args or {})
    if name.startswith("hf:"):
        model_type = name[3:].strip()
        if not model_type:
            raise UserError("--model hf: needs a model type, e.g. hf:gpt2 or hf:llama")
        built = _build_hf(model_type, args, seq_len)
    elif name in BUILTIN_MODELS:
        module, cfg = _build_builtin(name, args, vocab_size, seq_len)
        dims = {
            k: v
            for k, v in dataclasses.asdict(cfg).items()
            if k not in ("vocab_size", "block_size") and isinstance(v, int) and not isinstance(v, bool)
        }
        built = BuiltModel(
            module=module,
            name=name,
            kind="builtin",
            vocab_size=int(cfg.vocab_size),
            max_seq_len=getattr(cfg, "block_size", None),
            dims=dims,
        )
    elif ":" in name:
        built = _build_factory(name, args, vocab_size, seq_len)
    else:
        raise UserError(
            f"unknown model {name!r}; built-in models: {', '.join(BUILTIN_MODELS)}; or {MODEL_KINDS_HELP}"
        )
    if built.vocab_size is not None and built.vocab_size < vocab_size:
        raise UserError(
            f"{built.name} has a vocabulary of {built.vocab_size} tokens but the data uses {vocab_size}; "
            f"use --model-arg vocab_size={vocab_size}"
        )
    return built

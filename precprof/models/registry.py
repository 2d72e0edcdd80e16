"""The built-in models by name, and ``build_model``: the one way ``--model`` becomes a module."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from precprof.errors import UserError, did_you_mean
from precprof.models.base import BuiltModel, _check_size, _coerce_to
from precprof.models.factory import _build_factory
from precprof.models.gpt import GPT, GPT2_VOCAB_SIZE, GPTConfig
from precprof.models.hf import _build_hf
from precprof.models.llama import Llama, LlamaConfig, llama_intermediate_size
from precprof.models.small import CNNConfig, MLPConfig, TokenCNN, TokenMLP


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

# the sizes of a built-in model that cannot be 0: n_head=0 divides by zero, n_embd=0 or kernel_size=0 fail in the
# first forward, llama-mini's n_embd=0 has no parameter to train (n_layer=0 is a model of the embedding and the
# head alone; vocab_size=0 and intermediate_size=0 mean a default; block_size=0 is below any --seq-len)
_WIDTHS = frozenset({"n_embd", "n_head", "hidden", "channels", "kernel_size"})

# Hugging Face causal language models a user may type without hf: (--model gpt2), answered without importing
# transformers (not an encoder's or encoder-decoder's, bert, t5: hf: refuses those too)
_COMMON_HF_TYPES = frozenset(
    {
        "gpt2",
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "phi",
        "phi3",
        "gpt_neox",
        "opt",
    }
    | {"bloom", "falcon", "gptj", "gpt_neo", "olmo", "starcoder2", "stablelm", "mamba"}
)

MODEL_KINDS_HELP = "hf:<model_type> (e.g. hf:gpt2, hf:llama), path/to/file.py:factory, package.module:factory"


def _closest_model(name: str) -> str:
    """ " (did you mean X?)" for an unknown --model: a built-in name mistyped, or a Hugging Face model type
    given without its hf: prefix."""
    if name.lower() in _COMMON_HF_TYPES:
        builtin = [b for b in BUILTIN_MODELS if b.startswith(f"{name.lower()}-")]  # gpt2: gpt2-small
        return f" (did you mean {builtin[0] + ' or ' if builtin else ''}hf:{name.lower()}?)"
    return did_you_mean(name, BUILTIN_MODELS)


def known_models() -> list[str]:
    """Built-in model names, in the order of the help text."""
    return list(BUILTIN_MODELS)


def _build_builtin(
    name: str, args: Mapping[str, Any], vocab_size: int, seq_len: int
) -> tuple[nn.Module, Any]:
    spec = BUILTIN_MODELS[name]
    cfg = spec.config()
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    updates: dict[str, Any] = {}
    for k, v in args.items():
        if k not in fields:
            raise UserError(
                f"--model-arg {k}: {name} has no such setting{did_you_mean(k, fields)}; known: {', '.join(fields)}"
            )
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
        if k in _WIDTHS and v == 0:
            raise UserError(f"--model-arg {k}=0: must be at least 1")
    # before allocating anything: a meta-device build would be exact but imports torch._dynamo (seconds)
    _check_size(name, approx_params(cfg))
    try:
        module = spec.build(cfg)
    except UserError:
        raise
    except (ValueError, RuntimeError) as e:
        raise UserError(f"cannot build {name} with {dict(args)}: {e}") from None
    return module, cfg


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
            f"unknown model {name!r}{_closest_model(name)}; built-in models: {', '.join(BUILTIN_MODELS)}; or {MODEL_KINDS_HELP}"
        )
    if built.vocab_size is not None and built.vocab_size < vocab_size:
        raise UserError(
            f"{built.name} has a vocabulary of {built.vocab_size} tokens but the data uses {vocab_size}; "
            f"use --model-arg vocab_size={vocab_size}"
        )
    return built


def vocabulary_note(built: BuiltModel, model_args: Mapping[str, Any] | None, vocab_size: int) -> str:
    """A line for the terminal when a built-in or Hugging Face config keeps a vocabulary larger than the data's
    ``vocab_size`` that no ``--model-arg vocab_size`` chose ("" otherwise): the model trains, but its loss
    starts near ln of its own vocabulary (hf:llama's 32,000 tokens: 10.37, where the data's 256 give 5.55), and
    its embedding and output are sized for tokens the data never has."""
    own = built.vocab_size
    if (
        built.kind not in ("builtin", "hf")
        or own is None
        or own <= vocab_size
        or "vocab_size" in (model_args or {})
    ):
        return ""
    return (
        f"{built.name} keeps its config's vocabulary of {own:,} tokens, and the data's has {vocab_size:,}: its "
        f"loss starts near ln {own} = {math.log(own):.2f} rather than ln {vocab_size} = {math.log(vocab_size):.2f} "
        f"(-a vocab_size={vocab_size} sizes the model to the data)"
    )

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

from precprof.models.base import BuiltModel, coerce_value, count_params
from precprof.models.gpt import GPT, GPTConfig
from precprof.models.llama import Llama, LlamaConfig
from precprof.models.registry import (
    BUILTIN_MODELS,
    MODEL_KINDS_HELP,
    approx_params,
    build_model,
    known_models,
    vocabulary_note,
)
from precprof.models.small import CNNConfig, MLPConfig, TokenCNN, TokenMLP
from precprof.modes import DEFAULT_MODEL, parse_model_args

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "GPT",
    "MODEL_KINDS_HELP",
    "BuiltModel",
    "CNNConfig",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "MLPConfig",
    "TokenCNN",
    "TokenMLP",
    "approx_params",
    "build_model",
    "coerce_value",
    "count_params",
    "known_models",
    "parse_model_args",
    "vocabulary_note",
]

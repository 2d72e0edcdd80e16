"""Hugging Face models built offline from their config (random weights, no download): ``hf:<model_type>``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from precprof.errors import MissingDependencyError, UserError
from precprof.models.base import BuiltModel, _check_size, _coerce_to, count_params


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

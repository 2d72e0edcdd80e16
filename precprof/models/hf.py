"""Hugging Face models built offline from their config (random weights, no download): ``hf:<model_type>``."""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from precprof._quiet_imports import quiet_imports
from precprof.errors import MissingDependencyError, ModelError, UserError, did_you_mean
from precprof.models.base import BuiltModel, _check_size, _coerce_to, count_params


def _config_field(config: Any, name: str) -> str | None:
    """The attribute of ``config`` that the config argument ``name`` sets, None when there is none. A config
    keeps some arguments under a private name: ``attn_implementation`` and ``experts_implementation`` (what
    the experts_fp32 finding's remedy sets) are held as ``_attn_implementation``, ``_experts_implementation``."""
    if hasattr(config, name):
        return name
    private = f"_{name}"
    return private if not name.startswith("_") and hasattr(config, private) else None


# what an encoder's causal-LM head (BertLMHeadModel, RobertaForCausalLM, ...) logs when built without is_decoder,
# once per build (the size check's build on the meta device, then the model): precprof's own check says it, as the
# option to pass (-a is_decoder=true), in its one line (``_from_config``)
SAID_BY_PRECPROF = "as a standalone, add `is_decoder=True"
# what a config logs of a special token id outside its vocabulary (``validate_token_ids``): GPT-2's bos and eos,
# 50256, under ``-a vocab_size=256``, and starcoder2's own defaults (50256 in a vocabulary of 49,152) on every
# run. The built-in loop feeds the data's tokens, never a special one, and generates nothing: not about the run
# (a pad id outside the vocabulary that an embedding would use fails the build, and precprof's line says which
# -a to pass)
SPECIAL_TOKEN_ID_OUTSIDE = "_token_id must be `None` or an integer within the vocabulary"
DROPPED_WHILE_BUILDING = (SAID_BY_PRECPROF, SPECIAL_TOKEN_ID_OUTSIDE)


class _DropSaid(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(line in message for line in DROPPED_WHILE_BUILDING)


@contextlib.contextmanager
def _without_lines_precprof_says() -> Iterator[None]:
    """transformers' handlers (and the root's, for a user who made its loggers propagate) drop the lines of
    ``DROPPED_WHILE_BUILDING`` while precprof builds the model; every other line shows as before."""
    try:  # transformers sets its handler up at its first logger's creation (here, if none was yet)
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger("transformers")
    except ImportError:  # (the build's own import says it)
        pass
    drop = _DropSaid()
    handlers = [*logging.getLogger("transformers").handlers, *logging.getLogger().handlers]
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


def _build_hf(model_type: str, args: Mapping[str, Any], seq_len: int) -> BuiltModel:
    """``hf:<model_type>`` built from its config with ``args``; the first build imports transformers' modeling
    code, and with it torchao, whose import logs lines about itself (``precprof._quiet_imports``)."""
    with quiet_imports(), _without_lines_precprof_says():
        return _from_config(model_type, args, seq_len)


def _from_config(model_type: str, args: Mapping[str, Any], seq_len: int) -> BuiltModel:
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
            f"unknown Hugging Face model type {model_type!r}{did_you_mean(model_type, known)}; "
            f"use a model_type such as {examples}"
        ) from None
    _check_causal(model_type, default)
    kwargs: dict[str, Any] = {}
    for k, v in args.items():
        field = _config_field(default, k)
        if field is None:
            raise UserError(
                f"--model-arg {k}: the {model_type} config has no field {k!r}"
                f"{did_you_mean(k, default.to_dict())} (see transformers' {type(default).__name__})"
            )
        kwargs[k] = _coerce_to(k, v, getattr(default, field), f"hf:{model_type}")
    refused: tuple[type[Exception], ...] = (
        ValueError,
        TypeError,
        RuntimeError,
        AttributeError,
        AssertionError,
    )
    refused += _strict_errors()
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
        n_params = _params_on_meta(config)  # a default config can be billions of parameters (hf:llama is 7B)
        _check_size(f"hf:{model_type}", n_params, lambda: _small_example(model_type, config))
        module = AutoModelForCausalLM.from_config(config)
    except UserError:
        raise
    except refused as e:
        # a strict config's error says which validator refused it; its cause says why
        said = e.__cause__ if isinstance(e, _strict_errors()) and isinstance(e.__cause__, Exception) else e
        msg = str(said).strip().splitlines()[0] if str(said).strip() else type(said).__name__
        pad = kwargs.get("pad_token_id", getattr(default, "pad_token_id", None))
        if "padding_idx" in msg.lower() and isinstance(pad, int):
            msg += f" (its pad_token_id {pad} is outside the vocabulary: set -a pad_token_id=0)"
        raise UserError(f"cannot build hf:{model_type} from its config: {msg}") from None
    max_len = next(
        (
            int(getattr(config, a))
            for a in ("n_positions", "max_position_embeddings")
            if isinstance(getattr(config, a, None), int)
        ),
        None,
    )
    if _probe(model_type, module, config, kwargs, seq_len):
        decoder = " (-a is_decoder=true makes it causal)" if hasattr(config, "is_decoder") else ""
        raise UserError(
            f"hf:{model_type} builds {type(module).__name__}, which attends to later tokens{decoder}: trained on "
            "next-token prediction it would see each token it predicts; use a causal model (hf:gpt2, hf:llama, "
            "...), or profile it in your own loop with precprof.Profiler"
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
        smaller=lambda: _small_example(model_type, config, below=n_params),
    )


def _strict_errors() -> tuple[type[Exception], ...]:
    """The errors of huggingface_hub's strict dataclasses, which transformers' configs are from version 5 on:
    a config's validator that refuses the values (RoPE's odd head_dim) raises one, its cause the reason."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: the configs raise ValueError
        return ()
    return (StrictDataclassError,)


def _check_causal(model_type: str, config: Any) -> None:
    """A UserError naming the fix when transformers has no causal language model for ``model_type`` (an
    encoder-decoder such as T5, a vision model such as ViT): ``precprof train`` trains next-token prediction."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    except ImportError:  # another transformers layout: from_config's own error says it
        return
    if model_type not in causal:
        raise UserError(
            f"hf:{model_type} ({type(config).__name__}) is not a causal language model, and precprof train trains "
            "next-token prediction (hf:gpt2, hf:llama, ...); profile it in your own training loop with "
            "precprof.Profiler, or under the Hugging Face Trainer with precprof.integrations.hf.PrecprofCallback"
        )


def _sees_ahead(module: torch.nn.Module, vocab_size: int, tokens: int = 4) -> bool:
    """Whether a causal LM's logits at a position depend on a later token: an encoder's causal-LM head
    (``BertLMHeadModel``) attends both ways unless its config says ``is_decoder``. Two forward passes of
    ``tokens`` tokens in eval mode, the last one changed; the RNG and the training mode are left as they were.
    Raises what the forward pass raises."""
    ids = torch.arange(1, tokens + 1).remainder(vocab_size).unsqueeze(0)
    other = ids.clone()
    other[0, -1] = (int(ids[0, -1]) + 1) % vocab_size
    was = module.training
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            module.eval()
            a, b = (module(input_ids=x).logits[:, :-1].float() for x in (ids, other))
    finally:
        module.train(was)
    return not torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _probe(
    model_type: str, module: torch.nn.Module, config: Any, given: Mapping[str, Any], seq_len: int
) -> bool:
    """``_sees_ahead`` on 4 tokens, else on the training's ``seq_len`` (a model whose forward pass needs more
    tokens is not refused for the probe's length). A model that fails both, built from its config before precprof touched it, fails its config: a
    ``ModelError`` naming the exception, transformers' line and what to change (the config's other fields keep
    their defaults: hf:qwen2 with -a num_attention_heads=4 keeps 32 key-value heads). Out of memory is left to
    the training to say (False)."""
    vocab = int(config.vocab_size)
    try:
        return _sees_ahead(module, vocab)
    except Exception:
        pass
    try:
        return _sees_ahead(module, vocab, max(seq_len, 2))
    except (torch.OutOfMemoryError, MemoryError):
        return False
    except Exception as e:
        frames = [
            f for f in traceback.extract_tb(e.__traceback__) if f"{os.sep}transformers{os.sep}" in f.filename
        ]
        models = [f for f in frames if f"{os.sep}transformers{os.sep}models{os.sep}" in f.filename]
        # the model's own line (modeling_qwen2.py), not an integration's
        at = (models or frames)[-1] if frames else None
        place = f" at {os.path.basename(at.filename)}:{at.lineno}" if at else ""
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelError(
            f"hf:{model_type} as configured fails its forward pass, {type(e).__name__}{place}"
            f"{': ' + first if first else ''}; {_config_fix(config, given)}"
        ) from e


def _config_fix(config: Any, given: Mapping[str, Any]) -> str:
    """What to change in a config whose model fails its forward pass: the attention heads where they do not
    divide, else the settings given to check against the config's others."""
    heads, kv = (getattr(config, k, None) for k in ("num_attention_heads", "num_key_value_heads"))
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        which = "" if "num_key_value_heads" in given else ", the config's default"
        return (
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}{which}: "
            f"add -a num_key_value_heads={heads} (or a divisor of {heads})"
        )
    settings = ", ".join(f"{k}={v}" for k, v in given.items())
    return (
        f"check the --model-arg settings ({settings}) against the fields they leave at their defaults "
        f"(transformers' {type(config).__name__})"
        if settings
        else f"its default config does not run here (transformers' {type(config).__name__})"
    )


def _params_on_meta(config: Any) -> int:
    """The parameters of ``config``'s causal LM, built on the meta device (no memory, whatever its size)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return count_params(AutoModelForCausalLM.from_config(config))


# a small model's sizes, under the first name a config has for each (GPT-2's n_layer is num_hidden_layers too)
_SMALL = (
    (("num_hidden_layers", "n_layer", "num_layers"), 2),
    (("hidden_size", "n_embd", "d_model"), 256),
    (("intermediate_size", "n_inner", "ffn_dim"), 1024),
    (("num_attention_heads", "n_head"), 4),
    (("num_key_value_heads",), 4),
)


def _small_example(model_type: str, config: Any, below: int | None = None) -> str | None:
    """--model-arg settings that make ``model_type`` small (2 layers of width 256 where its config has those
    fields), as typed on the command line with the parameter count; checked by building it on the meta device;
    None when that fails, or when it would not have fewer than ``below`` parameters (a model already that small)."""
    from transformers import AutoConfig

    sizes: dict[str, int] = {}
    for names, value in _SMALL:
        name = next((n for n in names if isinstance(getattr(config, n, None), int)), None)
        if name is not None:
            sizes[name] = value
    if not sizes:
        return None
    try:
        n = _params_on_meta(AutoConfig.for_model(model_type, **sizes))
    except Exception:  # only a suggestion: the error stands without it
        return None
    if below is not None and n >= below:
        return None
    return " ".join(f"-a {k}={v}" for k, v in sizes.items()) + f" ({n / 1e6:,.1f}M parameters)"


def cast_as_loaded(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast a transformers model built in fp32 to ``dtype`` (the pure modes), leaving it as
    ``from_pretrained(..., dtype=dtype)`` would have built it: parameters and buffers in ``dtype``, except those
    transformers keeps in a dtype of their own: the floating buffers it creates in one (a rotary embedding's
    ``inv_freq`` is fp32) and the modules a model keeps in fp32 (``_keep_in_fp32_modules_strict``: DeepSeek-V3's
    router), found by building the model in ``dtype`` on the meta device. ``module.to(dtype)`` alone rounds those
    too (the advisor's ``low_precision_rope``). Weights are the fp32 initialisation rounded, as every mode starts
    from."""
    import copy

    try:
        with torch.device("meta"):
            ref = type(module)._from_config(copy.deepcopy(module.config), dtype=dtype)  # type: ignore[attr-defined]
        keep_buffers = {n for n, b in ref.named_buffers() if b.is_floating_point() and b.dtype != dtype}
        keep_params = {n for n, p in ref.named_parameters() if p.is_floating_point() and p.dtype != dtype}
    except Exception:  # a model transformers cannot build that way again: cast as .to() does
        keep_buffers, keep_params = set(), set()
    buffers = {n: b for n, b in module.named_buffers() if n in keep_buffers}  # .to() replaces buffer tensors
    params = {
        n: p.detach().clone() for n, p in module.named_parameters() if n in keep_params
    }  # it casts p.data
    module.to(dtype)
    for name, buf in buffers.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._buffers[leaf] = buf
    for name, data in params.items():
        module.get_parameter(name).data = data
    return module

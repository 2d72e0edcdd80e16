"""What every model kind shares: the built model and its facts, ``--model-arg`` parsing, the size check."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from precprof._compat import global_numel
from precprof.errors import UserError
from precprof.footprint import available_bytes, size_text


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
    # a factory's model of several embeddings, none known to embed the tokens: ``vocab_size`` is the classes of
    # the logits the loop reads (``with_logits_vocab``), unknown (None) before or without them
    vocab_from_logits: bool = False
    # --model-arg settings that make the model small, as typed on the command line (None: none known), asked only
    # when a run of it is refused for its size (``footprint.ModelDoesNotFit``)
    smaller: Callable[[], str | None] | None = field(default=None, repr=False, compare=False)

    def with_logits_vocab(self, logits_shape: tuple[int, ...] | None) -> BuiltModel:
        """This model with ``vocab_size`` the last dimension of the logits the loop read, where the model's
        embeddings left it unknown (``vocab_from_logits``); itself otherwise."""
        if not self.vocab_from_logits or not logits_shape:
            return self
        return dataclasses.replace(self, vocab_size=int(logits_shape[-1]), vocab_from_logits=False)

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
    """Number of distinct parameter elements (tied weights counted once), over every rank: a module FSDP1 wrapped
    in place (``precprof train --distributed fsdp1``) holds this rank's shard of each flat parameter, half the
    model on 2 ranks."""
    return sum(global_numel(p) for p in module.parameters())


# an integer written with leading zeros ("007"): an id or a code more often than a number, kept as written
_PADDED_INT = re.compile(r"[+-]?0[0-9]+")


def coerce_value(value: Any) -> Any:
    """A command-line string as the int, float, bool or None it spells; other strings and non-strings as is.

    Two ways keep a string that reads as a number: leading zeros ("007" stays "007", where int() made it 7),
    and quotes around it ('"12"' is "12", the quotes removed)."""
    if isinstance(value, np.generic):  # a numpy scalar from a config (np.int64(1)): the Python number it is
        return value.item()
    if not isinstance(value, str):
        return value
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    if _PADDED_INT.fullmatch(value):
        return value
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
    if isinstance(v, str) and _PADDED_INT.fullmatch(v) and type(like) in (int, float):
        v = int(v)  # a setting that is a number takes 007 as 7
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


# The least any precision mode of the built-in loop needs per parameter to train: bf16/fp16-pure weights and
# gradients (2 + 2 bytes) and SGD's fp32 momentum (4). fp32 with AdamW needs 16; the exact, mode-aware check
# (precprof.footprint, activations included) runs once the model is built. This one only keeps a model that can
# never train here from being allocated at all, so it must not refuse what some mode could train.
_MIN_BYTES_PER_PARAM_TRAINING = 8


def _check_size(name: str, n_params: int, example: Callable[[], str | None] | None = None) -> None:
    """UserError when training ``n_params`` parameters cannot fit in this machine's RAM in any precision mode
    (``_MIN_BYTES_PER_PARAM_TRAINING`` bytes each against the memory available, cgroup limit included).
    ``example``, asked only then: --model-arg settings that make the model small, or None."""
    avail = _available_ram()
    need = n_params * _MIN_BYTES_PER_PARAM_TRAINING
    if avail is not None and need > avail:
        e = example() if example is not None else None
        raise UserError(
            f"{name} has {n_params / 1e6:,.0f}M parameters: even the leanest precision mode needs at least "
            f"{size_text(need)} to train them (16-bit weights and gradients, one fp32 optimizer state), more "
            f"than the {size_text(avail)} of memory available; pass smaller sizes with --model-arg"
            + (f", e.g. {e}" if e else "")
        )


def _available_ram() -> int | None:
    """Bytes of RAM this process can still take (``MemAvailable`` bounded by the cgroup); None: unknown."""
    return available_bytes(torch.device("cpu"))


def accepts_targets(module: nn.Module) -> bool:
    """Whether ``module.forward`` has a ``targets`` parameter (then the loop passes the next-token targets)."""
    try:
        return "targets" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def check_forward_contract(module: nn.Module, name: str) -> None:
    """UserError when ``module.forward`` has a required parameter the loop does not pass. The loop calls
    ``forward(x)``, or ``forward(x, targets=y)`` when forward has a ``targets`` parameter: ``forward(x, y)``
    failed on the first step with a TypeError, a traceback and a run directory of no steps."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the first step tells
        return
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    fed = {"targets"}
    if named and named[0].kind is not inspect.Parameter.KEYWORD_ONLY:
        fed.add(named[0].name)  # the token ids, passed by position
    missing = [p.name for p in named if p.default is inspect.Parameter.empty and p.name not in fed]
    if missing:
        m = missing[0]
        raise UserError(
            f"{name}: forward({', '.join(p.name for p in named)}) has a required parameter {m!r} that precprof "
            f"train does not pass (it calls forward(x), or forward(x, targets=y) with y the next-token ids when "
            f"forward has a targets parameter): rename {m!r} to targets if it takes the targets, or give it a "
            "default"
        )


@dataclass(frozen=True)
class VocabGuess:
    """Which ``nn.Embedding`` of a user's model embeds its tokens, as read from the built model.

    ``size``: its rows (None: no embedding). ``name``: its module name. ``sure``: it is the embedding whose weight
    an ``nn.Linear`` shares (a tied output head), the one of exactly the ``vocab_size`` the factory was given, or
    the model's only one; otherwise it is the largest of several, which only bounds the vocabulary from above (a
    position table declared first, of --seq-len rows, was taken as the vocabulary: refused at a --seq-len below
    the data's vocabulary, recorded as it above)."""

    size: int | None
    name: str = ""
    sure: bool = True


def guess_vocab(module: nn.Module, given: int | None = None) -> VocabGuess:
    """The token embedding of a user's model (see ``VocabGuess``); ``given``: the vocab_size its factory was
    passed, None when it took none. Static: reads the modules, runs nothing."""
    tables: dict[int, tuple[str, nn.Embedding]] = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Embedding):
            tables.setdefault(id(m), (name, m))
    if not tables:
        return VocabGuess(None)
    found = list(tables.values())
    heads = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    tied = [(n, e) for n, e in found if id(e.weight) in heads]
    exact = [(n, e) for n, e in found if given is not None and e.num_embeddings == given]
    for picked in (tied, exact, found if len(found) == 1 else []):
        if picked:
            name, e = max(picked, key=lambda t: t[1].num_embeddings)
            return VocabGuess(int(e.num_embeddings), name, sure=True)
    name, e = max(found, key=lambda t: t[1].num_embeddings)
    return VocabGuess(int(e.num_embeddings), name, sure=False)

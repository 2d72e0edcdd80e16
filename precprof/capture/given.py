"""What a ``Profiler`` is given, checked at its construction: the model, the optimizers (unwrapped to the ones
whose hooks fire) and the GradScaler the loss is scaled with (``Profiler(model, optimizer, scaler=...)``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from precprof import _compat

NOT_HELD = (
    "precprof: the optimizer given to the Profiler holds none of the model's parameters, so no weight update is "
    "sampled; give it the optimizer (or the list of optimizers) that steps this model"
)


def checked_model(model: Any) -> nn.Module:
    """``model``, a TypeError naming it when it is not a module."""
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"Profiler(model): expected a torch.nn.Module, got {type(model).__name__} {model!r:.60}"
        )
    return model


def given_scaler(scaler: Any, loss_scale: Any, model: Any, optimizer: Any) -> tuple[Any, str | None]:
    """``Profiler(scaler=...)``; where neither it nor a manual ``loss_scale`` is given, the GradScaler that the
    framework wrapping the model or optimizer scales the loss with (Fabric's and accelerate's fp16 do), and where
    it was found (the summary's ``scaler_from``): the gradients are read at its scale either way."""
    if scaler is not None or loss_scale is not None:
        return scaler, None
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return _compat.wrapper_scaler(model, *given)


def given_optimizers(optimizer: Any) -> list[Any]:
    """``Profiler(optimizer=...)`` as a list: none, one or several, each unwrapped to the optimizer whose hooks
    fire (``_compat.unwrapped_optimizer``: Fabric's, Lightning's and accelerate's wrappers hold the real one; a
    GradScaler keys what it found by the real one, too). Anything else is a TypeError naming it."""
    given = (
        list(optimizer) if isinstance(optimizer, (list, tuple)) else [] if optimizer is None else [optimizer]
    )
    out = []
    for opt in map(_compat.unwrapped_optimizer, given):
        if not (hasattr(opt, "param_groups") and hasattr(opt, "register_step_pre_hook")):
            raise TypeError(
                "Profiler(optimizer=...): expected a torch.optim.Optimizer or a list of them, got "
                f"{type(opt).__name__} {opt!r:.60}"
            )
        out.append(opt)
    return out

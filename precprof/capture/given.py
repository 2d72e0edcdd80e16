"""What a ``Profiler`` is given, checked at its construction: the model, the optimizers (unwrapped to the ones
whose hooks fire) and the GradScaler the loss is scaled with (``Profiler(model, optimizer, scaler=...)``)."""

from __future__ import annotations

from typing import Any

from torch import nn

from precprof import _compat, taxonomy

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


def from_wrappers(scaler: Any, loss_scale: Any, model: Any, optimizer: Any) -> tuple[Any, dict[str, Any]]:
    """``Profiler(scaler=...)``, or the GradScaler of the framework wrapping the model or optimizer
    (``given_scaler``), and what the summary's ``capture`` says of the wrappers: ``scaler_from`` (where that
    scaler was found) and the precision a wrapper asked for (``asked_precision``)."""
    scaler, scaler_from = given_scaler(scaler, loss_scale, model, optimizer)
    return scaler, {"scaler_from": scaler_from, **asked_precision(model, optimizer)}


def given_scaler(scaler: Any, loss_scale: Any, model: Any, optimizer: Any) -> tuple[Any, str | None]:
    """``Profiler(scaler=...)``; where neither it nor a manual ``loss_scale`` is given, the GradScaler that the
    framework wrapping the model or optimizer scales the loss with (Fabric's and accelerate's fp16 do), and where
    it was found (the summary's ``scaler_from``): the gradients are read at its scale either way."""
    if scaler is not None or loss_scale is not None:
        return scaler, None
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return _compat.wrapper_scaler(model, *given)


# the modes a wrapper's request is recorded for: those whose matmuls compute in 16 bits, which the run's layers
# confirm or not (a full-precision setting is the frameworks' default, no request: a loop of its own under it may
# turn autocast on itself; an FP8 one runs layers the report's FP8 check may not know, Transformer Engine's)
_ASKED_MODES = frozenset({"fp16", "bf16", "fp16-pure", "bf16-pure"})


def asked_precision(model: Any, optimizer: Any) -> dict[str, str]:
    """The 16-bit precision the framework wrapping the model or optimizer was asked to train in, for the
    summary's ``capture``: ``mixed_precision_requested`` (precprof's mode, "fp16"), ``mixed_precision_asked_as``
    (the framework's words: accelerate's mixed_precision="fp16") and ``mixed_precision_from`` (where it was read).
    What the integrations record of a Trainer's request, for a loop of the user's own: accelerate ignores fp16 on
    a CPU without a word, and the run trains in fp32. {} where no wrapper asks for one."""
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    found = _compat.wrapper_precision(model, *given)
    if found is None:
        return {}
    framework, setting, where = found
    mode = taxonomy.FRAMEWORK_PRECISIONS.get(framework, {}).get(setting, "")
    if mode not in _ASKED_MODES:
        return {}
    key = "mixed_precision" if framework == "accelerate" else "precision"
    return {
        "mixed_precision_requested": mode,
        "mixed_precision_asked_as": f'{framework}\'s {key}="{setting}"',
        "mixed_precision_from": where,
    }


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

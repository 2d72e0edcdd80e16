"""Reading a GradScaler without a sync: its ``update`` is wrapped for the duration of the attachment, so that
the scale in effect during the step and the found-inf flags (what ``step()`` skipped on) are kept as device
tensors just before ``update()`` changes or clears them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from precprof import _compat
from precprof import stats as st

# the scaler's attributes ``ScalerWatch.patch`` sets on the instance
_PATCHED = ("update", "unscale_", "scale", "__getstate__")


class _Layer:
    """One ``ScalerWatch``'s wrapper of a scaler method, set on the instance over ``inner``, the method it shadowed
    (the class's, or the layer of another Profiler given the same scaler: a GAN's two, one per model): calls
    ``around(inner, *args)``, or ``inner`` alone once its watch is gone. Each watch takes out its own layer and
    no other (``_unlayer``)."""

    __slots__ = ("around", "inner", "over_own")

    def __init__(self, inner: Any, around: Callable[..., Any], over_own: bool) -> None:
        self.inner = inner
        self.around: Callable[..., Any] | None = around
        self.over_own = over_own  # ``inner`` was an instance attribute (then put back, not deleted)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        around = self.around
        return self.inner(*args, **kwargs) if around is None else around(self.inner, *args, **kwargs)


def _layer(obj: Any, name: str, around: Callable[..., Any]) -> _Layer:
    """``around`` set over ``obj.name`` as a layer of its own."""
    layer = _Layer(getattr(obj, name), around, name in vars(obj))
    setattr(obj, name, layer)
    return layer


def _unlayer(obj: Any, name: str, layer: _Layer) -> None:
    """``layer`` taken out of ``obj.name``: what it shadowed put back where it is on top, spliced out from under
    another watch's layer, and left to pass calls through (its watch let go) under a wrapper not precprof's."""
    layer.around = None
    top = vars(obj).get(name)
    if top is layer:
        if layer.over_own:
            setattr(obj, name, layer.inner)
        else:  # the instance attribute shadowed the class's method
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        return
    while isinstance(top, _Layer):
        if top.inner is layer:
            top.inner, top.over_own = layer.inner, layer.over_own
            return
        top = top.inner


class ScalerWatch:
    """Wraps ``scaler.update``; ``take()`` returns (scale, found_inf) captured at the last update of this Profiler's
    optimizers, or the scaler's current scale when none has run this step.

    ``optimizers``: the Profiler's; a scaler shared by several (a GAN's generator and discriminator, one Profiler
    each) skips each optimizer's step on its own gradients' found-inf, so only theirs count, and an update after
    the other optimizers' steps alone is not this Profiler's. Without any, every optimizer the scaler holds."""

    def __init__(
        self,
        scaler: Any,
        device: torch.device,
        active: Callable[[], bool],
        optimizers: Sequence[Any] = (),
        unscaling: Callable[[Any], None] | None = None,
        scaling: Callable[[Any], None] | None = None,
    ) -> None:
        self.scaler = scaler
        self._unscaling = unscaling  # told of each ``unscale_(optimizer)`` before it divides the gradients
        self._scaling = scaling  # told of what each ``scale(loss)`` returns (``capture/scaled_passes.py``)
        self._device = device
        self._active = active
        self._optimizers = list(optimizers) or None
        self._scale: torch.Tensor | None = None
        self._found: torch.Tensor | None = None
        self._each: torch.Tensor | None = None
        self._layers: list[tuple[str, _Layer]] = []
        # a histogram shift by log2(scale) is exact only for powers of two
        self.non_pow2 = any(
            getattr(scaler, a, None) is not None and not st.is_power_of_two(float(getattr(scaler, a)))
            for a in ("_init_scale", "_growth_factor", "_backoff_factor")
        )

    def use_optimizers(self, optimizers: Sequence[Any]) -> None:
        """Read the found-inf flags of ``optimizers`` from now on (``Profiler.use_optimizer``)."""
        self._optimizers = list(optimizers) or None

    def patch(self) -> None:
        if self._layers:
            return
        self._layers.append(("update", _layer(self.scaler, "update", self._update)))
        if self._unscaling is not None and callable(getattr(self.scaler, "unscale_", None)):
            self._layers.append(("unscale_", _layer(self.scaler, "unscale_", self._unscale)))
        if self._scaling is not None and callable(getattr(self.scaler, "scale", None)):
            self._layers.append(("scale", _layer(self.scaler, "scale", self._scale_loss)))
        if getattr(self.scaler, "__getstate__", None) is not None:
            # a copy or a pickle of the scaler (copy.deepcopy, torch.save(scaler)) leaves the wrappers behind and
            # has the class's own update: a wrapper's watch does not pickle, and a deep copy's update ran the
            # original scaler's
            self._layers.append(("__getstate__", _layer(self.scaler, "__getstate__", _state)))

    def unpatch(self) -> None:
        for name, layer in reversed(self._layers):
            _unlayer(self.scaler, name, layer)
        self._layers.clear()

    def _update(self, original: Callable[..., Any], new_scale: Any = None) -> Any:
        self._before_update()
        return original(new_scale)

    def _unscale(self, original: Callable[..., Any], optimizer: Any) -> Any:
        if self._unscaling is not None and self._active() and _compat.scaler_enabled(self.scaler):
            self._unscaling(optimizer)
        return original(optimizer)

    def _scale_loss(self, original: Callable[..., Any], outputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(outputs, *args, **kwargs)
        if self._scaling is not None and self._active() and _compat.scaler_enabled(self.scaler):
            self._scaling(out)
        return out

    def _before_update(self) -> None:
        if not self._active() or not _compat.scaler_enabled(self.scaler):
            return
        flags = _compat.scaler_found_inf(self.scaler, self._optimizers)
        if flags is None:  # none of this Profiler's optimizers stepped since the last update: not its update
            return
        scale = _compat.scaler_scale_tensor(self.scaler)
        if scale is not None:
            self._scale = scale.detach().clone()
        found = [t.detach().reshape(()).to(self._device, non_blocking=True) for t in flags]
        if found:
            self._found = torch.stack(found).sum()
        mine = self._optimizers
        if mine is not None and len(mine) > 1:  # which of them it skipped (each one's flags, one per device)
            each = _compat.scaler_found_inf_each(self.scaler, mine)
            bits = [
                (
                    torch.stack(
                        [t.detach().reshape(()).to(self._device, non_blocking=True) for t in ts]
                    ).sum()
                    > 0
                )
                * float(2**k)
                for k, ts in enumerate(each)
                if ts
            ]
            self._each = torch.stack(bits).sum().double() if bits else None

    def take(self) -> tuple[torch.Tensor | float, torch.Tensor | None, torch.Tensor | None]:
        """The (scale, found_inf, skipped_each) of the step that just ended, as device tensors; resets for the next
        step. ``skipped_each``: with several optimizers, those the scaler skipped, as the sum of 2^k over their
        places k in the Profiler's list (None with one, or when it unscaled none of them)."""
        scale: torch.Tensor | float = 1.0
        if self._scale is not None:
            scale = self._scale
        else:
            current = _compat.scaler_scale_tensor(self.scaler)
            if current is not None:
                scale = current.detach().clone()
        found, each = self._found, self._each
        self._scale = self._found = self._each = None
        return scale, found, each


def taken(watch: ScalerWatch | None, loss_scale: float | None) -> tuple[Any, Any, Any]:
    """``watch.take()``; without a watch, the manual loss scale (1.0 without one), nothing found, none skipped."""
    return watch.take() if watch is not None else (loss_scale or 1.0, None, None)


def _state(getstate: Callable[[], Any]) -> Any:
    """The scaler's state without precprof's layers (``update`` and ``__getstate__`` as instance attributes)."""
    out = getstate()
    if isinstance(out, dict):
        out = {k: v for k, v in out.items() if k not in _PATCHED}
    return out


def scaler_enabled(scaler: Any) -> bool:
    """Whether a GradScaler (or a scaler like it) scales at all: ``GradScaler(enabled=False)`` is a no-op."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else True


def norm_type_said(clips: Any) -> str | None:
    """The norm type of the gradient clips noted (``precprof.clipwatch``) ("inf", "1", ...), None for the 2-norm or no clip."""
    p = getattr(clips, "norm_type", None)
    if not isinstance(p, (int, float)) or p == 2.0:
        return None
    return "inf" if p == float("inf") else f"{p:g}"

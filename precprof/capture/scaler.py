"""Reading a GradScaler without a sync: its ``update`` is wrapped for the duration of the attachment, so that
the scale in effect during the step and the found-inf flags (what ``step()`` skipped on) are kept as device
tensors just before ``update()`` changes or clears them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from precprof import _compat
from precprof import stats as st

# the scaler's attributes ``ScalerWatch.patch`` sets on the instance
_PATCHED = ("update", "__getstate__")


class ScalerWatch:
    """Wraps ``scaler.update``; ``take()`` returns (scale, found_inf) captured at the last update, or the
    scaler's current scale when update has not run this step."""

    def __init__(self, scaler: Any, device: torch.device, active: Callable[[], bool]) -> None:
        self.scaler = scaler
        self._device = device
        self._active = active
        self._scale: torch.Tensor | None = None
        self._found: torch.Tensor | None = None
        self._patched = False
        # a histogram shift by log2(scale) is exact only for powers of two
        self.non_pow2 = any(
            getattr(scaler, a, None) is not None and not st.is_power_of_two(float(getattr(scaler, a)))
            for a in ("_init_scale", "_growth_factor", "_backoff_factor")
        )

    def patch(self) -> None:
        original = self.scaler.update
        watch = self

        def update(new_scale: Any = None) -> Any:
            watch._before_update()
            return original(new_scale)

        self.scaler.update = update
        getstate = getattr(self.scaler, "__getstate__", None)
        if getstate is not None:
            # a copy or a pickle of the scaler (copy.deepcopy, torch.save(scaler)) leaves the wrapper behind and
            # has the class's own update: the wrapper's closure did not pickle, and a deep copy's update ran the
            # original scaler's
            def state() -> Any:
                out = getstate()
                if isinstance(out, dict):
                    out = {k: v for k, v in out.items() if k not in _PATCHED}
                return out

            self.scaler.__getstate__ = state
        self._patched = True

    def unpatch(self) -> None:
        if self._patched:
            for name in _PATCHED:  # the instance attributes shadowed the class's methods
                with contextlib.suppress(AttributeError):
                    delattr(self.scaler, name)
            self._patched = False

    def _before_update(self) -> None:
        if not self._active() or not _compat.scaler_enabled(self.scaler):
            return
        scale = _compat.scaler_scale_tensor(self.scaler)
        if scale is not None:
            self._scale = scale.detach().clone()
        found = [
            t.detach().reshape(()).to(self._device, non_blocking=True)
            for t in _compat.scaler_found_inf(self.scaler)
        ]
        if found:
            self._found = torch.stack(found).sum()

    def take(self) -> tuple[torch.Tensor | float, torch.Tensor | None]:
        """The (scale, found_inf) of the step that just ended, as device tensors; resets for the next step."""
        scale: torch.Tensor | float = 1.0
        if self._scale is not None:
            scale = self._scale
        else:
            current = _compat.scaler_scale_tensor(self.scaler)
            if current is not None:
                scale = current.detach().clone()
        found = self._found
        self._scale = self._found = None
        return scale, found

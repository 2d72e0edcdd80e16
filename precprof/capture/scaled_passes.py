"""Which backward passes of a sampled step carry the loss scale. Under a GradScaler every gradient row is read at
the scale in effect and stored divided by it; a backward pass that did not begin at a loss the scaler scaled
(a MAML inner loop's ``torch.autograd.grad(inner_loss, params, create_graph=True)`` in the forward, an auxiliary
loss's own backward) carries gradients at scale 1, which were stored 2^k (the scale) too small (tester t3).

The scaler's ``scale()`` is wrapped (``ScalerWatch``): on a sampled step each loss it returns gets a pre-hook on
its gradient node, the root of any pass that begins from it, which notes that pass (autograd's graph task) as a
scaled one for as long as it runs (a reentrant checkpoint's pass nested inside it is scaled too). A module output's
gradient hook that fires in any other pass reads its gradient multiplied by the scale in effect (in fp32, where
it cannot overflow), so that the row, divided by that scale, holds its true values: the histogram and the
extremes exact, the counts those of the true values at the step's scale, as every other value of the row.
With a manual ``loss_scale`` there is no ``scale()`` call to tell passes apart: every gradient is taken as scaled.
A parameter's ``.grad`` that an unscaled ``backward()`` added to is one sum of both: it is read as scaled."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from precprof import _compat

_WIDE = (torch.float32, torch.float64)


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors ``GradScaler.scale`` returned: a tensor, or an iterable (list, tuple) of them, nested."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)) and depth < 4:
        for o in obj:
            yield from _tensors(o, depth + 1)


class ScaledPasses:
    """The backward passes of this sampled step that began at a loss ``scaler`` scaled (``scaled``, told by the
    scaler's wrapped ``scale()``), and ``as_read``: a gradient as the rows read it, at the step's scale.
    ``active``: whether a sampled step is in progress (its hooks installed)."""

    def __init__(self, scaler: Any, active: Callable[[], bool]) -> None:
        self._scaler = scaler
        self._active = active
        self._tasks: set[int] = set()  # the step's passes that began at a scaled loss
        self._running = 0  # how many of them are running now

    def begin_step(self) -> None:
        self._tasks.clear()
        self._running = 0  # (a pass that raised never ran its end callback)

    def scaled(self, outputs: Any) -> None:
        """``scaler.scale`` returned ``outputs``: a pass that begins at one of them is a scaled one."""
        if not self._active():
            return
        for t in _tensors(outputs):
            node = t.grad_fn
            if node is not None:
                node.register_prehook(self._began)

    def _began(self, grad_outputs: Any) -> None:
        task = _compat.backward_pass_id()
        if task is not None and task not in self._tasks:
            self._tasks.add(task)
            self._running += 1
            if not _compat.queue_backward_callback(self._ended):
                self._running -= 1
        return None

    def _ended(self) -> None:
        self._running = max(0, self._running - 1)

    def as_read(self, x: torch.Tensor) -> torch.Tensor:
        """``x``, a module output's gradient, as the rows read it: itself in a scaled pass (or one nested in a
        scaled pass, or outside any pass), else multiplied by the scale in effect, in fp32 at least."""
        if self._running:
            return x
        task = _compat.backward_pass_id()
        if task is None or task in self._tasks or not _compat.scaler_enabled(self._scaler):
            return x
        scale = _compat.scaler_scale_now(self._scaler)
        if scale is None:
            return x
        wide = x if x.dtype in _WIDE else x.float()
        if isinstance(scale, torch.Tensor):
            scale = scale.to(wide.device, non_blocking=True)
        return wide * scale

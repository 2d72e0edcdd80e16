"""The gradient norm of a loop that clips: ``torch.nn.utils.clip_grad_norm_``'s return value, recorded.

Most training loops compute the gradient norm anyway, to clip it (nanoGPT's ``train.py``, the Trainer, Lightning's
``gradient_clip_val``), and rarely pass it to ``Profiler.step``. While a profiler is attached,
``torch.nn.utils.clip_grad_norm_`` (and ``torch.nn.utils.clip_grad.clip_grad_norm_``) is wrapped: the call and
its return value are unchanged, and the returned norm — a device scalar, no sync — is noted for every attached
profiler whose model owns the clipped parameters. ``Profiler.step()`` without ``grad_norm`` takes it.

What is noted:

- Only parameters of the profiler's model count; a call on another model's parameters is not noted.
- Several calls in one step on disjoint parameter sets (clipping groups separately) combine into the norm of
  all of them, ``sqrt(sum n_i^2)`` (for the default 2-norm; other norms keep the last call's); a second call
  on the same parameters replaces the first (the clipped norm is what was measured last).
- A distributed tensor (FSDP2) norm is noted only when it is replicated (its local value is the norm).
- ``clip_grads_with_norm_(parameters, max_norm, total_norm)`` (torch >= 2.6), after ``get_total_norm``: its
  ``total_norm`` is noted the same way.
- A name bound before ``attach()`` (``from torch.nn.utils import clip_grad_norm_`` at import time) still
  points at torch's own function and is not seen: pass ``grad_norm=`` there.

The wrapper is installed by the first attached profiler and removed with the last one, unless someone else
wrapped the function after it (then it stays, and stops noting).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.utils as nn_utils
from torch.nn.utils import clip_grad as _clip_grad_mod

_lock = threading.Lock()
_watchers: weakref.WeakSet[ClipNorms] = weakref.WeakSet()
# per wrapped function's name: (torch's own, the wrapper installed in its place)
_installed: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}


class ClipNorms:
    """Gradient norms noted from ``clip_grad_norm_`` calls on one model's parameters, within one step."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._ids = {id(p) for p in params}
        self._norms: dict[frozenset[int], torch.Tensor] = {}
        self._p: float = 2.0
        self.norm_type: float | None = None  # of the last norm noted (None: the loop never clipped)

    def note(self, ids: frozenset[int], norm: torch.Tensor, norm_type: float) -> None:
        mine = ids & self._ids
        if not mine:
            return
        if norm_type != self._p:
            self._norms.clear()
            self._p = norm_type
        self._norms[frozenset(mine)] = norm.detach().reshape(()).float()
        self.norm_type = norm_type

    def take(self) -> torch.Tensor | None:
        """The step's norm (a device scalar), None when the loop did not clip; clears it for the next step."""
        if not self._norms:
            return None
        norms = list(self._norms.values())
        self._norms.clear()
        if len(norms) == 1 or self._p != 2.0:
            return norms[-1]
        return torch.stack(norms).square().sum().sqrt()


def _local_norm(norm: Any) -> torch.Tensor | None:
    if not isinstance(norm, torch.Tensor):
        return None
    placements = getattr(norm, "placements", None)
    if placements is not None:  # a DTensor: only a replicated one holds the norm locally
        if not all(type(p).__name__ == "Replicate" for p in placements):
            return None
        local: torch.Tensor = norm.to_local()  # type: ignore[attr-defined]
        return local
    return norm


def _note(params: list[torch.Tensor], norm: Any, norm_type: float) -> None:
    """Tell every watcher the norm a clip of ``params`` used (a device scalar: no sync)."""
    local = _local_norm(norm)
    if local is not None and _watchers:
        ids = frozenset(id(p) for p in params)
        for w in list(_watchers):
            w.note(ids, local, norm_type)


def _make_wrapper(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def clip_grad_norm_(
        parameters: Any, max_norm: float, norm_type: float = 2.0, *args: Any, **kwargs: Any
    ) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        norm = original(params, max_norm, norm_type, *args, **kwargs)
        p = float(norm_type)
        _note(params, norm, p if math.isfinite(p) else math.inf)
        return norm

    clip_grad_norm_.__doc__ = original.__doc__
    clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    return clip_grad_norm_


def _make_with_norm_wrapper(original: Callable[..., None]) -> Callable[..., None]:
    """``clip_grads_with_norm_(parameters, max_norm, total_norm)`` (torch >= 2.6): the second half of a clip
    split in two, after ``get_total_norm`` of the gradients (torchtitan's ``clip_grad_norm_`` is built so):
    ``total_norm`` is the norm the loop clipped with, noted as ``clip_grad_norm_``'s return is (a 2-norm
    unless the loop asked for another, which this call does not say)."""

    def clip_grads_with_norm_(
        parameters: Any, max_norm: float, total_norm: Any, *args: Any, **kwargs: Any
    ) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        original(params, max_norm, total_norm, *args, **kwargs)
        _note(params, total_norm, 2.0)

    clip_grads_with_norm_.__doc__ = original.__doc__
    clip_grads_with_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    return clip_grads_with_norm_


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "clip_grad_norm_": _make_wrapper,
    "clip_grads_with_norm_": _make_with_norm_wrapper,
}


def watch(norms: ClipNorms) -> None:
    """Start noting clip_grad_norm_ (and clip_grads_with_norm_) calls for ``norms`` (installs the wrappers on
    the first watcher)."""
    with _lock:
        if not _installed:
            for name, make in _WRAPPERS.items():
                original = getattr(nn_utils, name, None)
                if original is None:  # a torch without it
                    continue
                wrapper = make(original)
                _installed[name] = (original, wrapper)
                setattr(nn_utils, name, wrapper)
                if hasattr(_clip_grad_mod, name):
                    setattr(_clip_grad_mod, name, wrapper)
        _watchers.add(norms)


def unwatch(norms: ClipNorms) -> None:
    """Stop noting for ``norms``; the last watcher puts torch's functions back (where the wrappers are still
    there: one someone else wrapped after precprof stays, and stops noting)."""
    with _lock:
        _watchers.discard(norms)
        if _watchers:
            return
        for name, (original, wrapper) in list(_installed.items()):
            if getattr(nn_utils, name, None) is wrapper:
                setattr(nn_utils, name, original)
            if getattr(_clip_grad_mod, name, None) is wrapper:
                setattr(_clip_grad_mod, name, original)
            if getattr(nn_utils, name, None) is not wrapper:
                del _installed[name]

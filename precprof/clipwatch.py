"""The gradient norm of a loop that clips: ``torch.nn.utils.clip_grad_norm_``'s return value, recorded.

Most training loops compute the gradient norm anyway, to clip it (nanoGPT's ``train.py``, the Trainer, Lightning's
``gradient_clip_val``), and rarely pass it to ``Profiler.step``. ``torch.nn.utils.clip_grad_norm_`` (and
``torch.nn.utils.clip_grad.clip_grad_norm_``) is wrapped: the call and its return value are unchanged, and while
a profiler is attached the returned norm — a device scalar, no sync — is noted for every attached profiler whose
model owns the clipped parameters. ``Profiler.step()`` without ``grad_norm`` takes it.

What is noted:

- Only parameters of the profiler's model count; a call on another model's parameters is not noted.
- Several calls in one step on disjoint parameter sets (clipping groups separately) combine into the norm of
  all of them, ``sqrt(sum n_i^2)`` (for the default 2-norm; other norms keep the last call's); a second call
  on the same parameters replaces the first (the clipped norm is what was measured last).
- A distributed tensor (FSDP2) norm is noted only when it is replicated (its local value is the norm).
- ``clip_grads_with_norm_(parameters, max_norm, total_norm)`` (torch >= 2.6), after ``get_total_norm``: its
  ``total_norm`` is noted the same way.
- A name bound before precprof wrapped torch's function (``from torch.nn.utils import clip_grad_norm_`` run
  before this module was imported) still points at torch's own and is not seen: pass ``grad_norm=`` there.
- A clip inside a ``torch.compile``d function is noted on the sampled steps only (they run compiled code
  eagerly); on the other steps the wrapper calls torch's function and notes nothing, so a loop that compiles its
  clip passes ``grad_norm=`` for the steps not sampled (its compiled function's returned norm).

The wrappers are installed once, when this module is first imported: by ``import precprof`` when torch is loaded
already, else with ``precprof.Profiler``. They are never removed, so that compiled code never sees them change:
Dynamo guards on the function (its ``__code__``), and a swap at ``attach()`` and back at ``detach()`` made every
compiled function that clips recompile at both, which ``torch.compiler.set_stance("fail_on_recompile")`` refused.
Under ``torch.compile`` (``torch.compiler.is_compiling()``) a wrapper only calls torch's function and reads
nothing of precprof's, so the graph is torch's and nothing guards on whether a Profiler is attached. With no
Profiler attached it is a pass-through: the same call, return value and exceptions. A function compiled and run
before the wrappers were installed (``import precprof`` before ``import torch``, and the first
``precprof.Profiler`` after the compile) recompiles once, when they are.
"""

from __future__ import annotations

import functools
import math
import threading
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.utils as nn_utils
from torch.nn.utils import clip_grad as _clip_grad_mod

from precprof import _compat

_lock = threading.Lock()
# (kept by a reload: the wrappers installed read this module's globals, and an empty set had stopped the noting)
_watchers: weakref.WeakSet[ClipNorms] = globals().get("_watchers") or weakref.WeakSet()
# whether Dynamo held compiled code when the wrappers went in: a compiled clip recompiles once (stance.explain)
wrapped_after_compile: bool = globals().get("wrapped_after_compile", False)


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


def _params(parameters: Any) -> tuple[Any, list[torch.Tensor]]:
    """What to hand torch's function in place of ``parameters``, and the parameters as a list: a generator is
    read once here and handed on as a generator of the same tensors (torch warns of an empty one)."""
    if isinstance(parameters, torch.Tensor):
        return parameters, [parameters]
    params = list(parameters)
    return ((p for p in params) if isinstance(parameters, types.GeneratorType) else params), params


def _make_wrapper(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def clip_grad_norm_(
        parameters: Any, max_norm: float, norm_type: float = 2.0, *args: Any, **kwargs: Any
    ) -> Any:
        # is_compiling() first: Dynamo reads it as a constant and never reaches _watchers (no guard on it)
        if torch.compiler.is_compiling() or not _watchers:
            return original(parameters, max_norm, norm_type, *args, **kwargs)
        handed, params = _params(parameters)
        norm = original(handed, max_norm, norm_type, *args, **kwargs)
        p = float(norm_type)
        _note(params, norm, p if math.isfinite(p) else math.inf)
        return norm

    clip_grad_norm_._precprof_original = original  # type: ignore[attr-defined]
    return clip_grad_norm_


def _make_with_norm_wrapper(original: Callable[..., None]) -> Callable[..., None]:
    """``clip_grads_with_norm_(parameters, max_norm, total_norm)`` (torch >= 2.6): the second half of a clip
    split in two, after ``get_total_norm`` of the gradients (torchtitan's ``clip_grad_norm_`` is built so):
    ``total_norm`` is the norm the loop clipped with, noted as ``clip_grad_norm_``'s return is (a 2-norm
    unless the loop asked for another, which this call does not say)."""

    @functools.wraps(original)
    def clip_grads_with_norm_(
        parameters: Any, max_norm: float, total_norm: Any, *args: Any, **kwargs: Any
    ) -> None:
        if torch.compiler.is_compiling() or not _watchers:
            return original(parameters, max_norm, total_norm, *args, **kwargs)
        handed, params = _params(parameters)
        original(handed, max_norm, total_norm, *args, **kwargs)
        _note(params, total_norm, 2.0)
        return None

    clip_grads_with_norm_._precprof_original = original  # type: ignore[attr-defined]
    return clip_grads_with_norm_


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "clip_grad_norm_": _make_wrapper,
    "clip_grads_with_norm_": _make_with_norm_wrapper,
}


def _install() -> None:
    """Wrap torch's functions, once per process (a second import of this module, a reload, wraps nothing
    again); where ``torch.nn.utils.clip_grad`` holds the same function, it gets the same wrapper."""
    global wrapped_after_compile
    for name, make in _WRAPPERS.items():
        original = getattr(nn_utils, name, None)
        if original is None or hasattr(original, "_precprof_original"):  # a torch without it; wrapped already
            continue
        wrapper = make(original)
        wrapped_after_compile = wrapped_after_compile or _compat.compiled_code()
        setattr(nn_utils, name, wrapper)
        if getattr(_clip_grad_mod, name, None) is original:
            setattr(_clip_grad_mod, name, wrapper)


def watch(norms: ClipNorms) -> None:
    """Start noting clip_grad_norm_ (and clip_grads_with_norm_) calls for ``norms``."""
    with _lock:
        _watchers.add(norms)


def unwatch(norms: ClipNorms) -> None:
    """Stop noting for ``norms`` (the wrappers stay: with no watcher they only call torch's functions)."""
    with _lock:
        _watchers.discard(norms)


_install()

"""The gradients' bytes of a sampled step that measures memory (``capture/memory_tracker.py``), measured while
they exist: users often call ``zero_grad(set_to_none=True)`` before ``Profiler.step()``.

- At the optimizer's step pre-hook, every gradient the optimizer and the model hold (``at_optimizer``): the
  step's figure whenever the optimizer runs.
- Where it does not (a step GradScaler skipped, no optimizer), what the backward passes left: read once when
  each backward ends (``read_at_backward_end``, queued by the first post-accumulate-grad hook of the pass), or
  where the tracker needs each gradient at its hook (a peak replay labels its storage, CUDA's counters sample
  the memory), one at a time (``add``). Reading each gradient in its own hook cost about 3 us a gradient on the
  CPU (its storage's address and size), and the optimizer's pre-hook read them all again.

The optimizer's pre-hook reuses the storages read when the last backward ended when it finds the same gradient
tensors on the same memory (``_pointers``). Holds no tensor: storage addresses, sizes and ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from precprof import _compat
from precprof.capture.storage import StorageKey, _by_dtype, _leaves, _storage, dtype_name


class GradientBytes:
    """What a sampled step's gradients take, per dtype (see the module docstring)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, int] | None = None  # per dtype, at the optimizer's step
        self.seen: dict[StorageKey, tuple[str, int]] = {}  # storage -> (dtype, bytes), over the step's passes
        self._due = False  # a read is queued for the end of the backward pass now running
        # the gradients read when the last backward pass ended (id -> data pointer) and their storages
        self._last: tuple[dict[int, tuple[int, int]], dict[StorageKey, tuple[str, int]]] | None = None

    def reset(self) -> None:
        self.snapshot, self.seen, self._due, self._last = None, {}, False, None

    def read_at_backward_end(self, params: Callable[[], Sequence[torch.Tensor]]) -> bool:
        """Read the gradients of ``params()`` when the backward pass now running ends, once however many hooks
        ask; False when no read can be queued (then the caller reads its gradient itself)."""
        if not self._due:
            self._due = _compat.queue_backward_callback(lambda: self._read(params()))
        return self._due

    def forward_began(self) -> None:
        """A forward outside any backward pass: a read still due was queued by a pass that raised, whose end never
        came (autograd runs the queue only when a pass ends well); the next pass queues its own."""
        if self._due and _compat.backward_pass_id() is None:
            self._due = False

    def _read(self, params: Sequence[torch.Tensor]) -> None:
        self._due = False
        grads = [g for g in (p.grad for p in params) if g is not None]
        storages = _storages(grads)
        self.seen.update(storages)
        pointers = _pointers(grads)
        self._last = (pointers, storages) if pointers is not None else None

    def add(self, g: torch.Tensor) -> None:
        """One gradient, in its post-accumulate-grad hook."""
        self.seen.update(_storages((g,)))

    def at_optimizer(self, grads: list[torch.Tensor]) -> None:
        """Every gradient that exists at the optimizer's step (``grads``, each tensor once)."""
        last = self._last
        if last is not None and _pointers(grads) == last[0]:  # the ones the last backward left, as they were
            self.snapshot = _per_dtype(last[1])
        else:
            self.snapshot = _by_dtype(grads)

    def bytes(self, params: Iterable[torch.Tensor]) -> dict[str, int]:
        """Per dtype: at the optimizer's step; else what the backward passes left; else ``.grad`` now."""
        if self.snapshot is not None:
            return self.snapshot
        if self.seen:
            return _per_dtype(self.seen)
        return _by_dtype(p.grad for p in params if p.grad is not None)


def _per_dtype(storages: dict[StorageKey, tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for dt, nbytes in storages.values():
        out[dt] = out.get(dt, 0) + nbytes
    return out


def _storages(grads: Iterable[torch.Tensor]) -> dict[StorageKey, tuple[str, int]]:
    out: dict[StorageKey, tuple[str, int]] = {}
    for g in grads:
        for leaf in _leaves(g):
            st = _storage(leaf)
            if st is not None:
                out[st[0]] = (dtype_name(leaf.dtype), st[1])
    return out


def _pointers(grads: Sequence[torch.Tensor]) -> dict[int, tuple[int, int]] | None:
    """Each gradient tensor (by id) and the memory it points at (address, bytes); None for a wrapper without
    storage."""
    try:
        return {id(g): (g.data_ptr(), g.nbytes) for g in grads}
    except (RuntimeError, NotImplementedError, TypeError):
        return None

"""Which sampled steps measure memory: what a step keeps in memory changes only when its shapes do.

Measuring memory per component (``capture/memory_tracker.py``) hooks every module, every saved tensor and every
parameter of a step: on a model of tiny layers it is about a quarter of what a sampled step adds
(``bench/host_cost.py``). What it measures (the parameters, gradients, optimizer states, the activations each
module keeps for backward, the allocator's peak) is the same on every step that runs the same shapes, and the
report reads the last measured step. So memory is measured on the first two sampled steps (the first one
creates the optimizer's states and fills the allocator's cache), on every ``every``-th sampled step after them,
and on any sampled step whose forward has model inputs of shapes or dtypes that no measured step had (a longer
sequence, a last smaller batch). ``every=1`` measures every sampled step.

By default (``every=None``) the cadence also spaces out while it finds nothing new: it starts at every 4th
sampled step, and each step measured by the cadence that held exactly what the last measured step of the same
input shapes held (every row: each part, module, dtype and peak) doubles the spacing, up to every 32nd. A
measured step that differs (a loop keeping each step's loss, layers unfrozen, a cache that grows) brings the
spacing back to 4. A run of steady shapes then measures about 6 of its first 64 sampled steps instead of 17; what
the report reads (the measured step that held the most) is the same. Layers frozen or unfrozen (a parameter's
``requires_grad``) change what a step holds without changing its shapes: the sampled step after the one that first
trains a number of parameters no measured step trained is measured, whatever the spacing (``trains``: a loop
that alternates two sets, as a GAN's, has both measured once, not every step). Under torch.distributed (no watch: every
rank must measure the same steps) the cadence stays fixed, and it alone decides.

The inputs' shapes are read by a forward pre-hook on the model's root, installed for sampled steps only (a
compiled model's other steps run without it, as they run without the tracker's hooks). When it sees shapes no
measured step had, it arms the tracker there, before any submodule ran (``arm``): the step is measured from its
forward on. Under torch.distributed every rank must measure the same steps (their rows are reduced together),
so there the shapes are not watched: the cadence alone decides, the same on every rank.

The watch reads the step's training forward only, by the rule the rest of the capture leaves evaluations
out by (``is_evaluation`` and ``evaluated_before`` of ``capture/training_forward.py``): a forward under
``no_grad``, or with grad on in eval mode after the step's forward in train mode (a validation loss after
``opt.step()``, ``model.eval()`` without ``no_grad``), is not read. Its batch of other shapes had armed the
tracker, and the step's memory rows were the evaluation's (its activations, no gradients), listed as
measured for new shapes. A forward in eval mode that begins the step may be either (a validation at the
step's start, or a loop that trains in eval mode): it is watched, and when a forward in train mode follows
before any backward it was an evaluation after all. Its shapes are then forgotten (a training step of those
shapes is measured for them), and a step that was measured from the evaluation's forward on for them alone
keeps no memory rows and is not counted as measured, unless its training's own shapes are new.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from precprof import _compat
from precprof import tables as T
from precprof.capture.storage import _tensors_in
from precprof.capture.training_forward import evaluated_before, is_evaluation

FIRST = 2  # the first sampled steps, always measured
DEFAULT_EVERY = 4  # the default cadence's spacing at its start, and where a change brings it back
MAX_EVERY = 32  # the widest the default cadence spaces out to
MAX_SIGNATURES = 4096  # input signatures remembered; past this many the set starts again


def signature(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], ...]:
    """The shapes and dtypes of a forward's tensor inputs (positional and keyword, nested a few levels)."""
    return tuple((_compat.shape_of(t), t.dtype) for t in (*_tensors_in(args), *_tensors_in(kwargs)))


def check_every(every: Any) -> int:
    """``every`` as given, or a one-line ValueError saying what it must be."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"memory_every must be an integer >= 1 (1: every sampled step), got {every!r}")
    return every


class MemorySchedule:
    """Decides per step whether memory is measured (``begin``) and watches the model's inputs on sampled steps.

    ``every``: after the first two sampled steps, every ``every``-th sampled step is measured (1: all); None: from
    every ``DEFAULT_EVERY``-th, spacing out to every ``MAX_EVERY``-th while the measured steps agree (``result``).
    ``watch_shapes``: also measure a sampled step whose inputs have shapes no measured step had.
    """

    def __init__(self, every: int | None = 1, watch_shapes: bool = True) -> None:
        self.adaptive = every is None
        self.every = DEFAULT_EVERY if every is None else check_every(every)
        self.watch_shapes = watch_shapes
        self.spacing = self.every  # the cadence's spacing now (it widens only where ``adaptive``)
        self._next_due = 1 + self.every  # the index of the next sampled step the cadence measures
        self._sig: tuple[Any, ...] | None = None  # the step's training inputs' signature (the watch's)
        self._prints: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # per signature: its last measured rows
        self.widened: list[tuple[int, int]] = []  # (step, spacing) where the spacing changed
        self.sampled = 0  # sampled steps that ended (``done``)
        self.measured: list[int] = []  # the steps that ended measured
        self.new_shapes: list[int] = []  # ... of them, measured for their new shapes (not due by the cadence)
        self.measuring = False  # the step in progress is measured
        self._for_shapes = False  # ... because its inputs had new shapes
        self._due = False  # ... because the cadence says so
        self._for_evaluation = False  # ... only because of an evaluation's shapes (its rows are not kept)
        self._begun = 0  # sampled steps begun (the cadence counts them)
        self._arm: Callable[[nn.Module, Any, Any], None] | None = None
        # whether a backward read what the step's forwards saved (the tracker's, while it measures)
        self._trained: Callable[[], bool] | None = None
        self._mode: bool | None = None  # the mode of the step's first forward with grad (``is_evaluation``)
        self._known: set[tuple[Any, ...]] = set()
        self._new: list[tuple[Any, ...]] = []  # the signatures first seen in the step in progress
        self._handle: Any = None
        self._watched: nn.Module | None = None  # the model the watch is on (``_handle``)
        self._armed = False
        self._step = -1
        self._trains: int | None = None  # the trainable elements of the step in progress (``trains``)
        self._trains_known: set[int] = set()  # ... of the steps measured

    def begin(
        self,
        step: int,
        sampled: bool,
        model: nn.Module | None = None,
        arm: Callable[[nn.Module, Any, Any], None] | None = None,
        trained: Callable[[], bool] | None = None,
    ) -> bool:
        """Start ``step``: True when it is sampled and due to measure memory. On sampled steps the input watch
        goes onto ``model``'s root (active until :meth:`pause`); on the others it comes off.
        ``arm(root, args, kwargs)`` starts measuring mid-step, from the root's forward pre-hook, when the inputs'
        shapes are new; ``trained()``, asked while the step is measured, says whether a backward read what its
        forwards saved (``evaluated_before``)."""
        again = sampled and step == self._step >= 0  # (a re-plan arms the step in progress once more)
        self._step = step if sampled else -1  # the sampled step in progress
        if not sampled:
            self.measuring = False
            self.unwatch()
            return False
        if not again:
            self._begun += 1
            self._trains = None
        k = self._begun - 1
        self.measuring = self._due = self.every == 1 or k < FIRST or k >= self._next_due
        self._for_shapes = self._for_evaluation = False
        self._sig = None
        self._mode, self._new = None, []
        self._arm, self._trained = arm, trained
        if self.watch_shapes and self.every > 1 and model is not None:
            if self._handle is None:
                self._watch(model)
            self._armed = True
        return self.measuring

    def _watch(self, model: nn.Module) -> None:
        self._handle = _compat.register_uncopied(model, self._hook, pre=True, with_kwargs=True)
        self._watched = model

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The watch off the model meanwhile (``Profiler.not_training``: an evaluation, whose shapes are not the
        training's, runs the model as without precprof), and back after unless the step's end took it off."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.remove()
        try:
            yield
        finally:
            if handle is not None and self._handle is None and self._watched is not None:
                self._watch(self._watched)

    def pause(self) -> None:
        """The sampled step's forward and backward are over: the watch stays in place, doing nothing."""
        self._armed = False

    def unwatch(self) -> None:
        """The watch comes off, and the schedule lets go of ``arm`` (a tracker's bound method: no cycle)."""
        self._armed = False
        self._arm = self._trained = None
        self._watched = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if not self._armed or not torch.is_grad_enabled():
            return None
        training = module.training
        if self._mode is None:
            self._mode = training
        elif evaluated_before(self._mode, training, self._read_back):
            self._evaluated()
        if is_evaluation(self._mode, training):
            return None  # an evaluation with grad on: its shapes are not the training's
        sig = signature(args, kwargs)
        if self._sig is None:
            self._sig = sig
        if sig in self._known:
            return None
        if len(self._known) >= MAX_SIGNATURES:
            self._known.clear()
            self._new.clear()
        self._known.add(sig)  # measured in this step: known from here on
        self._new.append(sig)
        if not self._due and self._arm is not None:
            self._for_shapes, self._for_evaluation = True, False
            if not self.measuring:
                self.measuring = True
                self._arm(module, args, kwargs)
        return None

    def _read_back(self) -> bool:
        """Whether a backward read what the step's forwards saved, as far as the schedule can tell: the
        tracker says while it measures the step; a step not measured is taken as not (only its shapes' watch
        hangs on it)."""
        return self.measuring and self._trained is not None and self._trained()

    def _evaluated(self) -> None:
        """The step's forwards so far (in eval mode) were an evaluation before its training
        (``evaluated_before``): the shapes they ran are forgotten, and the step is not measured for them. When
        they armed the tracker it measures on to the step's end (no hook comes off inside the model's
        forward), and its rows are not kept (``done``), unless the training's own shapes turn out new."""
        self._mode = True
        self._sig = None
        self._known.difference_update(self._new)
        self._new.clear()
        self._for_evaluation = self.measuring and not self._due
        self._for_shapes = False

    def done(self, step: int) -> bool:
        """The sampled ``step`` ended (its rows are being collected): count it (a step begun but never run is
        not). Whether its memory rows are kept: not when only an evaluation's shapes had it measured (it is
        then not measured, as the step would have been without the evaluation)."""
        if step != self._step or step < 0:
            return True
        self.sampled += 1
        if self._for_evaluation:
            self.measuring = False
        if self.measuring:
            self.measured.append(step)
            if self._for_shapes:
                self.new_shapes.append(step)
            if self._due and self._begun - 1 >= FIRST:
                self._next_due = self._begun - 1 + self.spacing
            if self._trains is not None and len(self._trains_known) < MAX_SIGNATURES:
                self._trains_known.add(self._trains)
        elif self._trains is not None and self.watch_shapes and self._trains not in self._trains_known:
            # the next sampled step: it holds other gradients than any measured step
            self._next_due = min(self._next_due, self._begun)
        self._trains = None
        self._step = -1
        return not self._for_evaluation

    def trains(self, n: int) -> None:
        """The sampled step in progress trains ``n`` elements (``capture/trainable.py``, at its end, before
        :meth:`done`). Where no measured step trained as many (layers frozen or unfrozen) and this one is not
        measured, the next sampled step is, whatever the cadence's spacing (its rows, other than the last
        measured step's, then bring the spacing back to ``every``). Not under torch.distributed (no watch): every
        rank must measure the same steps."""
        self._trains = n

    def result(self, step: int, rows: list[dict[str, Any]]) -> None:
        """The memory ``rows`` the measured ``step`` kept (after :meth:`done`): where the cadence adapts, the same
        rows as the last measured step of its input shapes double its spacing (a step the cadence measured; up
        to ``MAX_EVERY``), and different ones bring it back to ``every``."""
        sig = self._sig
        if not self.adaptive or sig is None or not rows or not self.measured or self.measured[-1] != step:
            return
        held = tuple(sorted(tuple((k, v) for k, v in r.items() if k != T.STEP) for r in rows))
        last = self._prints.get(sig)
        if len(self._prints) >= MAX_SIGNATURES:
            self._prints.clear()
        self._prints[sig] = held
        if last is None:
            return
        k = self._begun - 1
        spacing = min(self.spacing * 2, MAX_EVERY) if last == held and self._due else self.spacing
        if last != held:
            spacing = self.every
        if spacing != self.spacing:
            self.spacing = spacing
            self.widened.append((step, spacing))
            self._next_due = k + spacing

    def describe(self) -> dict[str, Any]:
        """The ``memory_steps`` entry of the capture summary."""
        return {
            "every": self.every,
            "adaptive": self.adaptive,
            "every_now": self.spacing,
            "max_every": MAX_EVERY if self.adaptive else self.every,
            "spacing_changes": [{"step": s, "every": e} for s, e in self.widened[-20:]],
            "shapes_watched": self.watch_shapes and self.every > 1,
            "sampled_steps": self.sampled,
            "measured_steps": len(self.measured),
            "last_measured": self.measured[-1] if self.measured else None,
            "measured_for_new_shapes": list(self.new_shapes[-20:]),
        }

"""The Profilers attached in this process, for ``Profiler.attach()``: one left attached by a loop that stopped is
detached before another attaches over it.

``prof = Profiler(model, ...).attach()`` ... ``prof.detach()`` is the form for a loop at a notebook's top level.
When the loop raises (a bug) and the user fixes it and runs the cell again, the first Profiler is never detached:
its hooks stay on the model and keep firing, its memory hooks wrap every forward (the new Profiler measured no
activations, and blamed saved-tensor hooks of the user's own), ``scaler.update`` and ``clip_grad_norm_`` stay
wrapped, and a sampled step's ``force_eager`` compiler stance stays in force in the whole process (no
``torch.compile``d model compiled again). Nothing collects it: autograd holds its hooks on the model's tensors,
out of the garbage collector's sight.

So when a Profiler attaches, another one still attached is detached first, with a warning, when

- it watches the same model (the same module, or one inside the other: a ``torch.compile``d or DDP wrapper and
  the module it wraps): two Profilers on one model would each record beside the other's hooks; or
- its loop stopped inside a sampled step: its hooks saw its model run in a step that no ``prof.step()`` ended
  (a running loop does not attach a Profiler in the middle of another's step).

Detached rather than refused: in a notebook the stale Profiler is often out of reach (a local of the function
that raised, or a name the cell binds again), and a refusal would leave nothing to do but restart the kernel.
Its run is marked incomplete, saying why. Two Profilers on two models (a GAN's generator and discriminator) stay
attached together. One that stepped since it attached and holds the ``force_eager`` stance for a sampled step
its model has not run in yet is said in a warning: a loop that stopped there looks the same as one about to run
it. (One attached just before, at its first step, is the second of two attached together: not said.)
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

from precprof.capture.model_facts import model_class_name

if TYPE_CHECKING:
    from precprof.capture.profiler import Profiler

# every Profiler that attached, and the step it attached at (weak: never what keeps one alive); those detached
# since are passed over
_attached: weakref.WeakKeyDictionary[Profiler, int] = weakref.WeakKeyDictionary()


def claim(prof: Profiler) -> None:
    """Before ``prof`` attaches: detach each other attached Profiler that watches the same model or whose loop
    stopped inside a sampled step, and say so; warn of one that stepped and holds the compiler stance (see the
    module docstring)."""
    for other in [p for p in list(_attached) if p is not prof and p.attached]:
        named = f"a Profiler still attached to {_name(other)} (in its step {other.current_step})"
        why = _left_over(other, prof)
        if why:
            other.mark_incomplete(f"detached when another Profiler attached: {why}")
            other.detach()
            warnings.warn(
                f"precprof: {named} was detached: {why}. Call prof.detach() when a loop stops early, or run "
                "it inside `with prof:`",
                stacklevel=3,  # (the line that attaches)
            )
        elif other.current_step > _attached[other] and (stance := other._stance.holding()) is not None:
            warnings.warn(
                f"precprof: {named} holds torch.compile's stance at '{stance}' for its sampled step: compiled "
                "models run eagerly until its prof.step(). If its loop stopped, call its detach()",
                stacklevel=3,
            )
    _attached[prof] = prof.current_step


def _left_over(other: Profiler, prof: Profiler) -> str | None:
    """Why ``other`` is left over from a loop that stopped, or None."""
    if other.model in set(prof.model.modules()) or prof.model in set(other.model.modules()):
        return "it watches the same model, and two Profilers on one model would record each other's hooks"
    hooks = other._hooks
    if other.sampling and hooks is not None and hooks.has_data:
        return "its model ran in that step, which no prof.step() ended: its loop stopped inside it"
    return None


def _name(prof: Profiler) -> str:
    return model_class_name(getattr(prof.model, "_orig_mod", prof.model))

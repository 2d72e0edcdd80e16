"""The Profilers attached in this process, for ``Profiler.attach()``: one left attached by a loop that stopped is
detached before another attaches over it.

``prof = Profiler(model, ...).attach()`` ... ``prof.detach()`` is the form for a loop at a notebook's top level.
When the loop raises (a bug) and the user fixes it and runs the cell again, the first Profiler is never detached:
its hooks stay on the model and keep firing, its memory hooks wrap every forward (the new Profiler measured no
activations, and blamed saved-tensor hooks of the user's own), ``scaler.update`` stays wrapped and
``clip_grad_norm_`` keeps noting for it, and a sampled step's ``force_eager`` compiler stance stays in force in
the whole process (no ``torch.compile``d model compiled again). Nothing collects it: autograd holds its hooks on the model's tensors,
out of the garbage collector's sight.

So when a Profiler attaches, another one still attached is detached, with a warning, when

- it watches the same model (the same module, or one inside the other: a ``torch.compile``d or DDP wrapper and
  the module it wraps): two Profilers on one model would each record beside the other's hooks; detached first;
- its loop stopped inside a sampled step: its hooks saw its model run in a step that no ``prof.step()`` ended,
  and no ``prof.step()`` of its comes while the new one ends two steps (``settle``). Not at once: a running loop
  can attach a Profiler in the middle of another's step (a GAN whose discriminator is built from the
  generator's first output; a probe trained inside the main step), and that one steps on.

Detached rather than refused: in a notebook the stale Profiler is often out of reach (a local of the function
that raised, or a name the cell binds again), and a refusal would leave nothing to do but restart the kernel.
Its run is marked incomplete, saying why, and its summary.json says it in place of "running" (``unsaved.say_detached``:
the run reads as stopped, not as still being written). Two Profilers on two models (a GAN's generator and discriminator) stay
attached together. One that stepped since it attached and holds the ``force_eager`` stance for a sampled step
its model has not run in yet is said in a warning, where that stance changes how anything runs (something is
compiled, or either model is): a loop that stopped there looks the same as one about to run it. (One attached
just before, at its first step, is the second of two attached together: not said.)
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from precprof import _compat
from precprof._notice import notice
from precprof.capture import unsaved
from precprof.capture.compiled_facts import compiled_parts
from precprof.capture.model_facts import model_class_name

if TYPE_CHECKING:
    from precprof.capture.profiler import Profiler

# every Profiler that attached, and the step it attached at (weak: never what keeps one alive); those detached
# since are passed over
_attached: weakref.WeakKeyDictionary[Profiler, int] = weakref.WeakKeyDictionary()
# per Profiler attached over others whose loops may have stopped inside a sampled step: those others, and the
# step each was in then (``settle`` detaches the ones whose step has not moved on)
_suspects: weakref.WeakKeyDictionary[Profiler, list[tuple[Profiler, int]]] = weakref.WeakKeyDictionary()
# the new Profiler's steps to wait: a loop that attached it inside another's step ends that step after the new
# one's first step at the latest
_WAIT_STEPS = 2
# why each Profiler detached here was (its ``step()`` says it, not "use `with prof:`" inside `with prof:`)
_detached_why: weakref.WeakKeyDictionary[Profiler, str] = weakref.WeakKeyDictionary()
# the one line of ``save()`` / ``report()`` on a Profiler that never attached (it wrote a "complete" run of no step)
NOTHING_RECORDED = (
    "nothing recorded: this Profiler was never attached; attach it (`with prof:` or prof.attach()) and call "
    "prof.step() after each optimizer step first"
)
# a second Profiler on a model that has one: why the first is detached
_SAME_MODEL = (
    "another Profiler attached to the same model, and one model takes one Profiler at a time (each would record "
    "the other's hooks)"
)


def claim(prof: Profiler) -> None:
    """Before ``prof`` attaches: detach each other attached Profiler that watches the same model, and say so; keep
    for ``settle`` those whose model ran in a sampled step no ``prof.step()`` has ended; warn of one that stepped
    and holds the compiler stance (see the module docstring)."""
    _detached_why.pop(prof, None)
    for other in [p for p in list(_attached) if p is not prof and p.attached]:
        named = _named(other, other.current_step)
        # not a stopped loop's sign: two Profilers on one model (`with p: with q:`), both live
        if _same_model(other, prof):
            _detach(
                other,
                named,
                _SAME_MODEL,
                "Detach one before attaching the next (`with` blocks one after the other, not nested; "
                "prof.detach() in a `finally:` where a loop may stop early)",
            )
        elif _stopped_in_step(other):
            _suspects.setdefault(prof, []).append((other, other.current_step))
        elif (
            other.current_step > _attached[other]
            and (stance := other._stance.holding()) is not None
            and _stance_matters(other, prof)
        ):
            notice(
                f"precprof: {named} holds torch.compile's stance at '{stance}' for its sampled step: compiled "
                "models run eagerly until its prof.step(). If its loop stopped, call its detach()",
            )
    _attached[prof] = prof.current_step


def settle(prof: Profiler) -> None:
    """After ``prof.step()``: once ``prof`` has ended ``_WAIT_STEPS`` steps since it attached, detach each
    Profiler it attached over inside a sampled step (``claim``) whose ``step()`` never came since: its loop
    stopped there."""
    suspects = _suspects.get(prof)
    if not suspects or prof.current_step - _attached.get(prof, prof.current_step) < _WAIT_STEPS:
        return
    del _suspects[prof]
    for other, at in suspects:
        if other.attached and other.current_step == at:
            named = _named(other, at)
            why = (
                f"its model ran in that step, which no prof.step() ended while another Profiler took "
                f"{_WAIT_STEPS} steps: its loop stopped inside it"
            )
            _detach(other, named, why)


def _detach(
    other: Profiler,
    named: str,
    why: str,
    fix: str = "Call prof.detach() when a loop stops early, or run it inside `with prof:`",
) -> None:
    other.mark_incomplete(f"detached when another Profiler attached: {why}")
    other.detach()
    # its summary says why, not "running": the run reads as stopped (every step it recorded is on disk now)
    unsaved.say_detached(other, why)
    _detached_why[other] = f"it was detached at its step {other.current_step}: {why}. {fix}"
    notice(f"precprof: {named} was detached: {why}. {fix}")


def not_attached(prof: Profiler) -> str:
    """The one line of ``prof.step()`` called while ``prof`` is not attached: why, where another Profiler's
    attach detached it (inside its own `with prof:`, "use `with prof:`" sent the user in circles)."""
    why = _detached_why.get(prof)
    if why is not None:
        return f"Profiler.step() called while the profiler is not attached: {why}"
    return "Profiler.step() called while the profiler is not attached (use `with prof:`)"


def _stance_matters(other: Profiler, prof: Profiler) -> bool:
    """Whether a ``force_eager`` stance left in force changes how anything runs: Dynamo holds compiled code (a
    model or function compiled and run), or either model has parts ``torch.compile`` compiles (the new one's,
    not compiled yet, would never compile). With nothing compiled, two models trained alternately (the first's
    sampled step begun as the second attaches) are no stale loop's sign worth a warning."""
    return _compat.compiled_code() or any(compiled_parts(p.model) is not None for p in (other, prof))


def _same_model(other: Profiler, prof: Profiler) -> bool:
    return other.model in set(prof.model.modules()) or prof.model in set(other.model.modules())


def _stopped_in_step(other: Profiler) -> bool:
    """Whether ``other``'s model ran in a sampled step no ``prof.step()`` has ended yet."""
    hooks = other._hooks
    return bool(other.sampling and hooks is not None and hooks.has_data)


def _named(prof: Profiler, step: int) -> str:
    """ "a Profiler still attached to Sequential (676 parameters, in its step 1)": the model's class and parameter
    count tell two models of one class apart (a GAN's two ``nn.Sequential``)."""
    n = sum(p.numel() for p in prof.model.parameters())
    name = model_class_name(getattr(prof.model, "_orig_mod", prof.model))
    return f"a Profiler still attached to {name} ({n:,} parameters, in its step {step})"

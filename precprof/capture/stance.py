"""The compiler stance around the sampled steps, for ``Profiler`` (``capture/profiler.py``): a sampled step runs
``torch.compile``d code eagerly (``torch.compiler.set_stance("force_eager")``), so that every hook fires, and
the stance before it is put back at its end.

A loop may set a stance of its own (``torch.compiler.set_stance("fail_on_recompile")`` once the model is warm,
to make sure nothing recompiles). precprof puts back only the stance it set, and only while it is still in force:
one the loop set during a sampled step stays the loop's, and that step is noted when its forward began under it,
since the compiled model then ran compiled, without the hooks (its activations are missing from the step's rows);
one set after the forward (just before ``prof.step()``) lost nothing.

``fail_on_recompile`` refuses a first compile too. Because the sampled steps run eagerly, a compiled model first
compiles at the first steps that are not sampled: a loop that forbade recompiles after its first step (warm,
without precprof) would see those compiles refused as "recompiles". So, when nothing had compiled before precprof
attached, the steps not sampled run under the stance ``default`` in its place until one of them compiles nothing
(the code its paths run is warm then: a train and an eval forward each compiled once), and ``fail_on_recompile``
stands from the next step on. When anything had compiled before (a model compiled and run before the Profiler
attached), the loop's stance always stands: a compile then may be a real recompile, which it must refuse.
"""

from __future__ import annotations

import weakref
from typing import Any

from precprof import _compat, clipwatch

_FAIL = "fail_on_recompile"
# the sampled steps in progress that found force_eager set by another Profiler's (two models, one Profiler each):
# the one that set it hands it on to them when its own step ends, rather than putting the stance back under them
_waiting: weakref.WeakSet[SampledStance] = weakref.WeakSet()


class SampledStance:
    """The stance precprof set, the sampled steps the loop set its own in, and the steps its
    ``fail_on_recompile`` was held off for."""

    def __init__(self) -> None:
        self._token: Any = None  # what precprof set and what it replaced (``_compat.restore_stance``)
        self._at_start: Any = self  # the loop's stance at the first step (not yet: self)
        self._compiled_before = False  # whether Dynamo held compiled code when the first step began
        # its code objects then, with their compiled entries (``_compat.compiled_entries``; None: unreadable)
        self.entries_before: dict[Any, int] | None = None
        self._unsampled_seen = False
        self._warm = False  # a step not sampled compiled nothing: fail_on_recompile stands from then on
        self._counted: tuple[int, int | None] | None = None  # (step, Dynamo's compiles at its start)
        self.loop_set: list[dict[str, Any]] = []  # {"step", "stance"}: set by the loop in a sampled step
        self.held_off: list[int] = []  # the steps run under "default" in place of fail_on_recompile

    def begin(self, step: int, sampled: bool) -> None:
        """A step begins: force eager for a sampled one; let a step not sampled compile while the code warms."""
        self.end(step - 1, False)  # (the step before, if it was held off)
        if self._at_start is self:
            self._at_start = _compat.stance()
            self.entries_before = (
                _compat.compiled_entries()
            )  # read once: the summary's ``compiled_elsewhere`` too
            self._compiled_before = _compat.compiled_code(self.entries_before)
        if sampled:
            self._token = _compat.force_eager()
            if self._token is None and _compat.stance() is not None:
                _waiting.add(self)
        elif not self._warm:
            self._unsampled_seen = True
            self._counted = (step, _compat.compiles())
            # a fail_on_recompile in force since the run's start found the model compiled already
            if not self._compiled_before and _compat.stance() is not self._at_start:
                self._token = _compat.let_compile()
                if self._token is not None:
                    self.held_off.append(step)

    def end(self, step: int, sampled: bool, stance_at_forward: Any = None) -> None:
        """Put back the stance precprof set for ``step``, unless the loop set one since: noted for a sampled
        step whose forward began under the loop's (``stance_at_forward``, None when no hooked forward ran), as
        that forward ran compiled; one set after the forward lost nothing. A step not sampled that compiled
        nothing ends the warm-up."""
        if self._counted is not None and self._counted[0] == step:
            self._warm = _compat.compiles() == self._counted[1]
            self._counted = None
        _waiting.discard(self)
        if self._token is None:
            return
        heir = next(iter(_waiting), None)
        if heir is not None and self.holding() is not None:
            heir._token, self._token = self._token, None  # its sampled step runs eagerly on
            _waiting.discard(heir)
            return
        changed = _compat.restore_stance(self._token)
        ours = self._token[1]
        self._token = None
        if changed is not None and sampled and stance_at_forward is not ours:
            self.loop_set.append({"step": step, "stance": changed})

    def holding(self) -> str | None:
        """The stance precprof set that is in force now (``"force_eager"`` during a sampled step), or None."""
        ours = self._token[1] if self._token is not None else None
        return str(ours.stance) if ours is not None and _compat.stance() is ours else None

    def explain(self, exc: BaseException | None, step: int) -> None:
        """A ``fail_on_recompile`` error raised before any step ran compiled code compiled: say that it is the
        model's first compile, moved there by precprof's eager sampled steps, and what to do. One whose guard is
        on torch's clip function, wrapped after the function compiled (``precprof.clipwatch``): say that."""
        if exc is None or _FAIL not in str(exc) or not hasattr(exc, "add_note"):
            return
        if clipwatch.wrapped_after_compile and "clip_grad" in str(exc):  # a guard on torch's clip function
            exc.add_note(
                "precprof: torch.nn.utils.clip_grad_norm_ was wrapped (to note its norm) when the first Profiler "
                "was made, after this function had compiled, and Dynamo guards on it: import precprof after "
                "torch, or `from precprof import Profiler`, before compiling"
            )
            return
        if self._unsampled_seen:
            return
        exc.add_note(
            f"precprof: steps before {step} were sampled and ran compiled code eagerly (force_eager), so nothing "
            f"had compiled when the loop set '{_FAIL}' in step {step}: this is the model's first compile, not a "
            "recompile. Set the stance between steps (before prof.step()): precprof lets the steps that are not "
            f"sampled compile until one compiles nothing, and puts '{_FAIL}' back after it."
        )

    def summary(self) -> dict[str, Any]:
        """For summary.json's ``capture.loop_stance``."""
        return {
            "set_in_sampled_steps": [dict(s) for s in self.loop_set],
            "fail_on_recompile_held_off": list(self.held_off),
        }

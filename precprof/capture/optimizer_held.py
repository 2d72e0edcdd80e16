"""Which trainable parameters no optimizer the Profiler follows holds: a head (an adapter, a bias) added to the
model after the optimizer was built, or ``param_groups`` that leave a submodule out. Its ``requires_grad`` is set
throughout, its gradient is computed on every step, and it never moves; the rows did not say why (a parameter
without ``weight_update`` rows is no evidence: a run that samples no updates has none of any).

At the end of every sampled step in which an optimizer the Profiler follows stepped (``LoopOrder.judge``), each
captured parameter that can have a gradient is looked up by object among those optimizers' param groups as they
are then (a group added mid-run, an optimizer given by ``prof.use_optimizer``): host attributes only, nothing on a
step that is not sampled, no sync. Which parameters the groups hold is found again only when the plan, the
optimizers or their groups' lengths changed; otherwise a step reads ``requires_grad`` of those not held, most
often none. A step whose optimizers hold none of the captured parameters tells nothing (an optimizer that is not
the model's: ``given.NOT_HELD`` warns of it). A tied weight is one Parameter object, held under whichever name.

The summary's ``capture.trainable_not_in_optimizer`` (``HeldSeen.summary``): per module, as the layer rows name it,
its parameters that had ``requires_grad`` set on some such step and were held on none; absent where there are
none. A parameter that an optimizer the Profiler was not given held as it stepped in that step (a loop of two
optimizers, the matrices' and the vectors', that handed one over) is in an optimizer, one the Profiler does not
follow: it is said apart, in ``capture.trainable_in_optimizer_not_given``, never as in no optimizer."""

from __future__ import annotations

from typing import Any

NOT_IN_OPTIMIZER = "trainable_not_in_optimizer"  # the summary's key (``capture``)
NOT_GIVEN = "trainable_in_optimizer_not_given"  # the summary's key of those an optimizer not given stepped


class HeldSeen:
    """Per captured parameter (by module and parameter name), whether an optimizer the Profiler follows held it on
    a sampled step one of them stepped in, and whether it was trainable on one where none held it."""

    def __init__(self) -> None:
        self._held: set[tuple[str, str]] = set()
        self._loose: set[tuple[str, str]] = set()  # trainable and not held on some step
        # not held, and stepped by an optimizer not given on some step
        self._beside: set[tuple[str, str]] = set()
        self._order: dict[tuple[str, str], int] = {}  # each parameter's place in the model, as first planned
        self.steps = 0  # the sampled steps checked
        # what the last look found: (the plan, the groups' key, whether they held any of its parameters, the
        # groups' lists, kept so that no id in the key is reused: not the optimizers, whose states a loop that
        # dropped one frees), and the plan's parameters they left out
        self._seen: tuple[Any, tuple[Any, ...], bool, list[Any]] | None = None
        self._out: list[Any] = []

    def note(self, hooks: Any, beside: set[int] | frozenset[int] = frozenset()) -> None:
        """A sampled step in which an optimizer the Profiler follows stepped ends: the optimizers and the plan of
        ``hooks`` (``capture.hooks.StepHooks``), as they are now; ``beside``: the ids of the parameters held by the
        optimizers the Profiler was not given that stepped the model's parameters in the step."""
        plan = getattr(hooks, "plan", None)
        optimizers = list(getattr(hooks, "optimizers", None) or ())
        if plan is None or not optimizers:
            return
        lists = [g["params"] for o in optimizers for g in getattr(o, "param_groups", ())]
        key = (*map(id, optimizers), *((id(group), len(group)) for group in lists))
        if self._seen is None or self._seen[0] is not plan or self._seen[1] != key:
            ids = {id(p) for group in lists for p in group}
            slots = [ps for ps in plan.params if ps.grad_row >= 0]
            for ps in slots:
                self._order.setdefault((ps.module, ps.param), len(self._order))
            held = [ps for ps in slots if id(ps.tensor) in ids]
            self._held.update((ps.module, ps.param) for ps in held)
            # none held: the optimizers are not this model's (or not of the parameters captured), no evidence
            self._seen = (plan, key, bool(held), lists)
            self._out = [ps for ps in slots if id(ps.tensor) not in ids] if held else []
        if not self._seen[2]:
            return
        self.steps += 1
        for ps in self._out:
            if ps.tensor.requires_grad:
                (self._beside if id(ps.tensor) in beside else self._loose).add((ps.module, ps.param))

    def summary(self) -> dict[str, Any]:
        """summary.json's ``capture.trainable_not_in_optimizer``: {module: [param, ...]} of the parameters that
        were trainable on a checked step and held on none, in model order; and ``trainable_in_optimizer_not_given``,
        of those among them that an optimizer the Profiler was not given held as it stepped; {} where there are
        none."""
        said: dict[str, Any] = {}
        beside = self._beside - self._held
        for key, params in ((NOT_IN_OPTIMIZER, self._loose - self._held - beside), (NOT_GIVEN, beside)):
            out: dict[str, list[str]] = {}
            for m, p in sorted(params, key=self._order.__getitem__):
                out.setdefault(m, []).append(p)
            if out:
                said[key] = out
        return said

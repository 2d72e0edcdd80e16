"""Which parameters trained over the run, as the sampled steps saw them: a loop that changes ``requires_grad`` while
it runs (gradual unfreezing: a layer frozen at first, unfrozen at step 4 and frozen again at step 12).

summary.json's ``capture.modules[].frozen`` was read from ``requires_grad`` when the summary was written: a layer
trained on steps 4 to 11 and frozen again at the end was called frozen ("no gradient and no update") beside its own
gradient and update rows, and the model's count of the parameters that train was the end state's.

At the end of every sampled step (``LoopOrder.judge``: the loop set ``requires_grad`` for the step before it
ends) each captured parameter's ``requires_grad`` is read, with whether its gradient row was read in that step,
and the model's trainable elements are counted: host attributes only, one pass over the parameters, nothing on a
step that is not sampled. Kept as runs of consecutive sampled steps in one state (``[first, last, requires_grad,
had_gradient]``), so a long run holds a few entries. A resumed run begins with its earlier attempts' sampled steps,
read from its layers table (``resumed``): whether each parameter had a gradient there, its ``requires_grad`` not
known where it had none (a layer trained before the restart and frozen after it was called frozen throughout, the
summary's word being the last attempt's alone). The model's trainable elements are the last attempt's.

What the summary says (``module_entry``, ``TrainedSeen.summary``):

- ``modules[].frozen``: the parameters frozen throughout: ``requires_grad`` False on every sampled step and when
  the summary is written, and no gradient read on any sampled step;
- ``modules[].trainable_changed``: per parameter whose ``requires_grad`` changed between sampled steps (or after
  the last of them), its runs (``runs``) and its ``requires_grad`` when the summary was written (``end``);
- ``capture.trainable_changes``: where some parameter's did, the model's trainable elements per run of sampled
  steps (``numel``: ``[first, last, elements]``) and the end's (``end``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch

from precprof import tables as T
from precprof.capture.storage import _storage

# [first sampled step, last sampled step, requires_grad (None: not known, a resumed run's earlier attempt's), had a
# gradient]
Run = list[Any]


def distinct(params: Any) -> list[tuple[torch.Tensor, int]]:
    """(parameter, its elements) of ``params``, a storage shared by several parameters once (as
    ``storage.model_sizes`` counts ``n_trainable``)."""
    seen: set[int] = set()
    out = []
    for p in params:
        st = _storage(p)
        key = st[0] if st is not None else id(p)
        if key not in seen:
            seen.add(key)
            out.append((p, p.numel()))
    return out


def trainable_numel(params: Any) -> int:
    """Elements of ``params`` whose ``requires_grad`` is set, a shared storage once (``distinct``)."""
    return sum(n for p, n in distinct(params) if p.requires_grad)


class TrainedSeen:
    """Per captured parameter (by module and parameter name), its ``requires_grad`` and whether it had a gradient
    on each sampled step, as runs; the model's trainable elements likewise."""

    def __init__(self) -> None:
        self._runs: dict[tuple[str, str], list[Run]] = {}
        self._numel: list[list[int]] = []
        self._last: int | None = None  # the last sampled step seen: a run goes on only over consecutive looks
        # the plan's parameters, a shared storage once, found once per plan (their storages looked up on every
        # sampled step took 175 us of a 100-block model's)
        self._distinct: tuple[Any, list[tuple[torch.Tensor, int]]] | None = None
        # the sampled steps since the last change, in one state per parameter: [plan, states (per parameter of the
        # plan, ``(requires_grad, had a gradient)``), first step, last step, the sampled step before the first],
        # added to ``_runs`` when the states change or the runs are read (``_settle``): a step in the states of
        # the one before costs a comparison, not a run's update per parameter
        self._segment: list[Any] | None = None
        # told each sampled step's trainable elements (the memory schedule's: a step that trains a number no
        # measured step trained has the next one measured, ``MemorySchedule.trains``)
        self.on_trainable: Callable[[int], None] | None = None

    def note(self, step: int, hooks: Any) -> None:
        """The sampled step ``step`` ends: its parameters as ``hooks`` (``capture.hooks.StepHooks``) read them."""
        plan = getattr(hooks, "plan", None)
        if plan is None:
            return
        calls, skipped = hooks.rows.calls, hooks.buffer.skipped
        last = self._last
        states = tuple(
            (bool(ps.tensor.requires_grad), bool(g >= 0 and (calls[g] or skipped[g])))
            for ps in plan.params
            for g in (ps.grad_row,)
        )
        seg = self._segment
        if seg is not None and seg[0] is plan and seg[1] == states and seg[3] == last:
            seg[3] = (
                step  # (the same states as the sampled step before: the segment goes on, nothing per parameter)
            )
        else:
            self._settle()
            self._segment = [plan, states, step, step, last]
        if self._distinct is None or self._distinct[0] is not plan:
            self._distinct = (plan, distinct(plan.held))
        n = sum(numel for p, numel in self._distinct[1] if p.requires_grad)
        if self.on_trainable is not None:
            self.on_trainable(n)
        if self._numel and self._numel[-1][2] == n and self._numel[-1][1] == last:
            self._numel[-1][1] = step
        else:
            self._numel.append([step, step, n])
        self._last = step

    def _settle(self) -> None:
        """The pending segment of sampled steps (``_segment``) added to each parameter's runs."""
        seg, self._segment = self._segment, None
        if seg is None:
            return
        plan, states, first, last, before = seg
        for ps, state in zip(plan.params, states, strict=True):
            runs = self._runs.setdefault((ps.module, ps.param), [])
            _extend(runs, first, before, state)
            runs[-1][1] = last

    def resumed(self, layers: pd.DataFrame) -> None:
        """The sampled steps of a resumed run's earlier attempts (``layers``: their rows, before the step it
        resumed at), before any of its own: per parameter with a weight row on a step, whether a gradient was
        read there (a ``weight_grad`` row with calls). Its ``requires_grad`` there was not recorded: True where
        it had a gradient, else None (not known), from which no change is read (``runs``, ``frozen``)."""
        self._settle()
        if layers.empty or T.CALLS not in layers:
            return
        step = pd.to_numeric(layers[T.STEP], errors="coerce").to_numpy()
        tensor = T.texts(layers[T.TENSOR])
        calls = pd.to_numeric(layers[T.CALLS], errors="coerce").to_numpy()
        ok = np.isfinite(step)
        weights = (tensor == T.WEIGHT).to_numpy() & ok
        grads = (tensor == T.WEIGHT_GRAD).to_numpy() & (calls > 0) & ok
        if not weights.any():
            return
        # by arrays (a long run's resume reads a few hundred thousand weight rows): a parameter's code k, its
        # rows' (step, k) as one integer, each weight row's whether a gradient row of it was read on that step
        mcode, modules = pd.factorize(layers[T.MODULE])
        pcode, params = pd.factorize(layers[T.PARAM])
        codes = mcode.astype(np.int64) * len(params) + pcode
        n = max(len(modules) * len(params), 1)
        s = step.astype(np.int64)
        row = np.unique(s[weights] * n + codes[weights])
        had = np.isin(row, s[grads] * n + codes[grads])
        sampled = np.unique(row // n)  # the sampled steps, in order
        k, at = row % n, row // n
        order = np.lexsort((at, k))
        k, at, had = k[order], at[order], had[order]
        pos = np.searchsorted(sampled, at)
        # a run goes on over a parameter's rows at consecutive sampled steps in one state
        new = np.ones(len(k), dtype=bool)
        new[1:] = (k[1:] != k[:-1]) | (pos[1:] != pos[:-1] + 1) | (had[1:] != had[:-1])
        starts = np.flatnonzero(new)
        for a, b in zip(starts, np.r_[starts[1:], len(k)] - 1, strict=True):
            m, p = modules[k[a] // len(params)], params[k[a] % len(params)]
            self._runs.setdefault((str(m), str(p)), []).append(
                [int(at[a]), int(at[b]), True if had[a] else None, bool(had[a])]
            )
        self._last = int(sampled[-1])

    def runs(self, module: str, param: str, tensor: torch.Tensor) -> dict[str, Any] | None:
        """Where ``module``'s ``param``'s ``requires_grad`` changed over the sampled steps or after the last of
        them (``tensor``: the parameter, read now): its runs (``runs``) and its ``requires_grad`` now (``end``);
        None where it did not."""
        self._settle()
        runs = self._runs.get((module, param))
        end = bool(tensor.requires_grad)
        if not runs or {r[2] for r in runs} - {None} <= {end}:  # (None: an earlier attempt's, not known)
            return None
        return {"runs": [list(r) for r in runs], "end": end}

    def frozen(self, module: str, param: str, tensor: torch.Tensor) -> bool:
        """Whether ``module``'s ``param`` was frozen throughout: ``requires_grad`` False now and on every sampled
        step, and no gradient read on any (with no sampled step seen: False now)."""
        if tensor.requires_grad:
            return False
        self._settle()
        return not any(r[2] or r[3] for r in self._runs.get((module, param), ()))

    def summary(self, model: Any) -> dict[str, Any]:
        """summary.json's ``capture.trainable_changes`` where the model's trainable elements changed over the
        sampled steps or after the last of them: per run of sampled steps (``numel``: ``[first, last,
        elements]``), the most at once (``most``) and at the end (``end``); {} where they did not."""
        end = trainable_numel(model.parameters())
        if not self._numel or {n for _, _, n in self._numel} == {end}:
            return {}
        most = max(n for _, _, n in self._numel)
        return {"trainable_changes": {"numel": [list(r) for r in self._numel], "most": most, "end": end}}


def _extend(runs: list[Run], step: int, last: int | None, state: tuple[bool | None, bool]) -> None:
    """``state`` at sampled step ``step`` added to ``runs``: the last run goes on where it is the same state and
    was seen at the sampled step before (``last``)."""
    if runs and runs[-1][1] == last and (runs[-1][2], runs[-1][3]) == state:
        runs[-1][1] = step
    else:
        runs.append([step, step, *state])

"""Layers whose weights got no gradient: every value of their weight gradient exactly zero on every sampled step,
also after the optimizer stepped with a nonzero learning rate, and what stopped the gradient where the run tells.

A weight gradient is the layer's output gradient times its input, summed over the tokens: it is zero everywhere
when no gradient reached the layer's output (a module after it passed back zeros: a ReLU whose units were all
off, a torchao Float8Linear whose FP8 cast flushed its output gradient, a path the loss multiplies by zero), or
when its input was zero everywhere (a dead ReLU before it), or when a layer after it held a weight of zeros
(zero-initialised, as LoRA's B: it passes back zeros until that weight moves), or when a module around it held a
parameter of its own of zeros that multiplies the branch it sits in (ReZero's gate ``x + self.alpha * f(x)``, alpha
initialised to 0: f's layers get zeros until alpha moves). A frozen weight, or one the loss
does not reach at all, gets no gradient tensor (None) and no weight_grad row: it is not among them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import pandas as pd

from precprof import formats, taxonomy
from precprof import tables as T
from precprof.analysis.advisor.evidence import (
    _ancestors,
    _captured_modules,
    _dtype_has,
    _innermost,
    _Plan,
    _Run,
    _skipped_steps,
)
from precprof.analysis.advisor.model import CRITICAL, WARNING, Finding
from precprof.analysis.advisor.rules.fp8 import gemm_inputs
from precprof.analysis.advisor.text import _g, _listing, _name
from precprof.formats import FP8_E5M2, FP16, NumberFormat


@dataclass(frozen=True)
class _Dead:
    """The layers whose weight gradient was zero everywhere on every sampled step it was recorded on."""

    layers: list[str]  # in forward order
    checked: int  # the layers with a weight gradient recorded
    steps: int  # the sampled steps with weight gradients
    recorded: dict[str, int]  # per one of ``layers``, the sampled steps that recorded its weight gradient
    optimizer_steps: int  # the sampled steps the optimizer stepped on with a nonzero learning rate
    # the sampled steps the loss scaler skipped on which one of ``layers`` held nan or inf beside its zeros
    skipped_nonfinite: int = 0

    @property
    def fewest(self) -> int:
        """The fewest sampled steps one of ``layers`` had its gradient on."""
        return min(self.recorded[m] for m in self.layers)

    def without(self, layers: list[str]) -> _Dead | None:
        """These layers but ``layers``; None where none is left."""
        left = [m for m in self.layers if m not in layers]
        return replace(self, layers=left) if left else None


def _calls(wu: pd.DataFrame) -> pd.Series:
    """Per ``weight_update`` row, the optimizer steps with a nonzero learning rate that its update adds up (0
    where its group's learning rate was 0, a warmup from 0; a run recorded before wrote 1)."""
    return pd.to_numeric(wu[T.CALLS], errors="coerce").fillna(1) if T.CALLS in wu else pd.Series(1, wu.index)


def _stepped(run: _Run) -> list[int]:
    """The sampled steps whose optimizer stepped with a nonzero learning rate, in order."""
    wu = run.kind(T.WEIGHT_UPDATE)
    return sorted(int(s) for s in wu.loc[_calls(wu) > 0, T.STEP].unique())


def _dead_layers(run: _Run) -> _Dead | None:
    """The layers whose every weight-gradient value was an exact zero on each sampled step that recorded it, one
    of those steps after a sampled optimizer step with a nonzero learning rate; None where there is none.

    A gradient zero only before the weights first moved says nothing of a layer that learns: behind a weight
    that starts at zero (LoRA's B, a zero-initialised head or gate) every layer's gradient is zero until that
    weight moves, and a warmup from 0 makes the first optimizer step move nothing."""
    wg = run.kind(T.WEIGHT_GRAD)
    wg = wg[T.texts(wg[T.PARAM]) == T.WEIGHT]
    stepped = _stepped(run)
    if wg.empty or not stepped:
        return None
    rows = wg.assign(**{T.MODULE: T.texts(wg[T.MODULE]).astype(object)})
    per = rows.groupby([T.MODULE, T.STEP])[[T.NUMEL, T.ZEROS, T.NAN, T.INF]].sum()
    # on a step the loss scaler skipped, the gradients went inf or nan and were thrown away: a layer whose gradient
    # held no finite nonzero value there got none either (a zero gradient times an inf is a nan: an embedding
    # behind a norm whose fp16 square overflowed read 'not dead' for the nan of the one step skipped)
    skipped = per.index.get_level_values(T.STEP).isin(sorted(_skipped_steps(run.steps)))
    held = per[T.ZEROS] + ((per[T.NAN] + per[T.INF]) * skipped)
    zero = ((per[T.NUMEL] > 0) & (held >= per[T.NUMEL])).groupby(level=0)
    every, steps = zero.all(), zero.size()
    # (zero on a step after the weights moved: the gradient did not come back once they had)
    every &= rows.groupby(T.MODULE)[T.STEP].max()[every.index] > stepped[0]
    dead = run.sort(str(m) for m in every.index[every.to_numpy()])
    if not dead:
        return None
    recorded = {m: int(steps[m]) for m in dead}
    nonfinite = per[skipped & (per[T.NAN] + per[T.INF] > 0).to_numpy()]
    odd = nonfinite[nonfinite.index.get_level_values(0).isin(dead)].index.get_level_values(T.STEP).nunique()
    return _Dead(dead, len(every), int(rows[T.STEP].nunique()), recorded, len(stepped), int(odd))


def _moved(run: _Run, layers: list[str]) -> dict[str, tuple[str, int]]:
    """Per layer of ``layers``, what its weight's sampled updates (``weight_update`` rows) show, and on how many
    sampled steps: "moved" (an update changed a sampled element: weight decay or momentum, the gradient being
    zero), "lost" (updates were intended, none changed the weight as it is held), "still" (every sampled
    element's update was zero on every sampled step: AdamW with weight_decay=0 on a gradient that was always
    zero applies exactly 0), or "unrecorded" (no update row: weight updates not recorded, or a parameter the
    optimizer the Profiler follows does not hold)."""
    wu = run.kind(T.WEIGHT_UPDATE)
    wu = wu[T.texts(wu[T.PARAM]) == T.WEIGHT]
    names = T.texts(wu[T.MODULE])
    out: dict[str, tuple[str, int]] = {}
    for m in layers:
        rows = wu[(names == m).to_numpy()]
        if rows.empty:
            out[m] = ("unrecorded", 0)
            continue
        held = (
            pd.to_numeric(rows[T.LOST_UPDATE_HELD], errors="coerce").fillna(0.0)
            if T.LOST_UPDATE_HELD in rows
            else 0.0
        )
        intended = rows[T.NUMEL] - rows[T.ZEROS]
        landed = intended - held
        if (landed > 0).any():
            out[m] = ("moved", int(rows.loc[landed > 0, T.STEP].nunique()))
        elif (intended > 0).any():
            out[m] = ("lost", int(rows.loc[intended > 0, T.STEP].nunique()))
        else:
            out[m] = ("still", int(rows[T.STEP].nunique()))
    return out


def _moved_said(run: _Run, layers: list[str]) -> str:
    """Whether the weights of ``layers`` moved all the same, as their sampled updates show (``_moved``), in words
    that follow "these weights did not learn"; hedged only for those the run recorded no update of."""
    moved = _moved(run, layers)
    by: dict[str, list[str]] = {}
    for m in layers:
        by.setdefault(moved[m][0], []).append(m)
    lim = run.cfg.max_listed_modules

    def whom(state: str) -> tuple[str, str]:
        ms = by[state]
        if len(ms) == len(layers):
            return "they", "them"
        listed = _listing(ms, lim)
        return listed, listed

    def steps(state: str) -> int:
        return max(moved[m][1] for m in by[state])

    parts = []
    if "still" in by:
        who, _ = whom("still")
        parts.append(
            f"{who} did not move either: every sampled element's update was zero on each of the "
            f"{steps('still')} sampled step(s) that recorded one"
        )
    if "moved" in by:
        _, them = whom("moved")
        parts.append(
            f"weight decay or momentum alone moved {them} (a sampled update changed {them} on "
            f"{steps('moved')} sampled step(s))"
        )
    if "lost" in by:
        _, them = whom("lost")
        parts.append(
            f"weight decay or momentum alone made updates to {them} (on {steps('lost')} sampled step(s)), none "
            f"of which changed {them} as held (lost_update_held)"
        )
    if "unrecorded" in by:
        _, them = whom("unrecorded")
        parts.append(
            f"the run recorded no update of {them} (weight updates off, or not in the optimizer the Profiler "
            f"follows): weight decay or momentum may have moved {them}"
        )
    return "; ".join(parts)


def _grad_casts(run: _Run) -> dict[str, tuple[NumberFormat, bool]]:
    """Per torchao Float8Linear of the run (``capture.fp8_recipe``), the FP8 format its backward casts the output
    gradient to and whether its recipe rounds scales to powers of two; {} for a run without any."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    recipes = capture.get("fp8_recipe") if isinstance(capture, Mapping) else None
    out: dict[str, tuple[NumberFormat, bool]] = {}
    for r in recipes if isinstance(recipes, list) else []:
        if not isinstance(r, Mapping):
            continue
        cast = ((r.get("casts") or {}).get("grad_output") or {}).get("dtype", "")
        fmt = formats.FP8_E4M3 if "e4m3" in str(cast) else FP8_E5M2
        out.update({str(m): (fmt, bool(r.get("round_scales_to_power_of_2"))) for m in r.get("layers") or []})
    return out


def _flush_limit(fmt: NumberFormat, pow2: bool) -> float:
    """The largest output-gradient value torchao's cast to ``fmt`` flushes to zero in a tensor whose largest value
    is under its floor on amax (1e-12): the scale stops at fmax / 1e-12 (2^floor(log2) of it with ``pow2``), so
    a tensor no larger than this loses every value."""
    k = formats.current_scaling_exponent(fmt, formats.FP8_AMAX_FLOOR)
    scale = 2.0**k if pow2 else fmt.max / formats.FP8_AMAX_FLOOR
    return fmt.underflow_max / scale


def _fp8_flushed(run: _Run, grads: pd.DataFrame) -> dict[str, float]:
    """The torchao Float8Linear layers whose output gradient held nonzero values, every one of them flushed by the
    FP8 cast of the layer's backward (its largest at most ``_flush_limit``), with that largest value."""
    casts = _grad_casts(run)
    out: dict[str, float] = {}
    for m, (fmt, pow2) in casts.items():
        if (
            m in grads.index
            and grads.at[m, "nonzero"] > 0
            and grads.at[m, T.ABSMAX] <= _flush_limit(fmt, pow2)
        ):
            out[m] = float(grads.at[m, T.ABSMAX])
    return out


def _output_grads(run: _Run) -> pd.DataFrame:
    """Per module, over the sampled steps: its output gradient's finite nonzero values and its largest value."""
    ag = run.kind(T.ACTIVATION_GRAD)
    rows = pd.DataFrame(
        {
            T.MODULE: T.texts(ag[T.MODULE]).astype(object),
            "nonzero": (ag[T.NUMEL] - ag[T.ZEROS] - ag[T.NAN] - ag[T.INF]).clip(lower=0),
            T.ABSMAX: pd.to_numeric(ag[T.ABSMAX], errors="coerce"),
        }
    )
    return rows.groupby(T.MODULE).agg({"nonzero": "sum", T.ABSMAX: "max"})


def _stop(m: str, seq: list[str], grads: pd.DataFrame) -> str | None:
    """The module where the gradient flowing back to ``m`` stopped: the first one after it in forward order
    (``seq``: the modules with an output gradient) whose output gradient held a nonzero value, while ``m``'s held
    none; None where no later one did."""
    after = seq[seq.index(m) + 1 :] if m in seq else []
    return next((s for s in after if grads.at[s, "nonzero"] > 0), None)


def _zero_inputs(
    run: _Run, layers: list[str], dims: dict[str, dict[str, int]]
) -> tuple[dict[str, list[str]], set[str]]:
    """The layers among ``layers`` whose input was zero everywhere on every sampled step, with the modules whose
    output it was (the capture's ``gemm_inputs``, or the layer's own input row); and those of ``layers`` whose
    input the run recorded at all (an embedding's, integer ids, it never does)."""
    acts = run.kind(T.ACTIVATION)
    per = acts.groupby(T.texts(acts[T.MODULE]).astype(object))[[T.NUMEL, T.ZEROS]].sum()
    out: dict[str, list[str]] = {}
    recorded: set[str] = set()
    for m, sources in gemm_inputs(run, layers, dims).items():
        read = [s for s in sources if s in per.index]
        if read:
            recorded.add(m)
        if read and all(0 < per.at[s, T.NUMEL] <= per.at[s, T.ZEROS] for s in read):
            out[m] = read
    return out, recorded


def _padding_indices(run: _Run) -> dict[str, int]:
    """Per embedding of the run that has a ``padding_idx`` (summary capture.modules; a run recorded before the
    capture recorded it has none), that index: torch passes its row no gradient."""
    return {
        m: int(e["padding_idx"])
        for m, e in _captured_modules(run).items()
        if isinstance(e.get("padding_idx"), int) and not isinstance(e.get("padding_idx"), bool)
    }


def _fp16_only(run: _Run) -> set[str]:
    """The modules whose output gradient was fp16 on every row: a value fp16 flushed is a zero there."""
    ag = run.kind(T.ACTIVATION_GRAD)
    names = T.texts(ag[T.MODULE])
    is16 = _dtype_has(ag, "float16").to_numpy()
    return set(names[is16]) - set(names[~is16])


def _fp16_gemm_bound(run: _Run, m: str, sources: list[str]) -> float | None:
    """The bound, over the sampled steps, on every entry of ``m``'s weight gradient, where it lies below fp16's
    smallest subnormal (2^-24) on every step: an entry sums the products of its output gradient (as held, at the
    loss scale) and its input, at most as many nonzero ones as its output gradient held nonzero values, each at
    most the product of their largest values. Its weight-gradient GEMM under fp16 autocast computes in fp16, which
    holds such an entry as 0 (below 2^-25) or 2^-24 and cannot hold the gradient. None where a step's bound
    reaches 2^-24, or a step with a nonzero output gradient recorded no input."""
    ag = run.kind(T.ACTIVATION_GRAD)
    acts = run.kind(T.ACTIVATION)
    grad = ag[T.texts(ag[T.MODULE]) == m]
    read = acts[T.texts(acts[T.MODULE]).isin(sources)]
    if grad.empty or read.empty:
        return None
    held = pd.to_numeric(grad[T.ABSMAX], errors="coerce") * pd.to_numeric(
        grad[T.SCALE], errors="coerce"
    ).fillna(1.0)
    nonzero = (grad[T.NUMEL] - grad[T.ZEROS] - grad[T.NAN] - grad[T.INF]).clip(lower=0)
    per = (
        pd.DataFrame({T.STEP: grad[T.STEP], "held": held, "nonzero": nonzero})
        .groupby(T.STEP)
        .agg({"held": "max", "nonzero": "sum"})
    )
    x = pd.to_numeric(read[T.ABSMAX], errors="coerce").groupby(read[T.STEP]).max()
    worst = 0.0
    for step, row in per.iterrows():
        if row["nonzero"] <= 0:
            continue
        if step not in x.index or not x[step] >= 0 or not row["held"] >= 0:
            return None
        worst = max(worst, float(row["nonzero"] * row["held"] * x[step]))
    return worst if 0 < worst < FP16.smallest_subnormal else None


def _dead_mask(run: _Run, m: str) -> bool:
    """Whether ``m`` writes zeros in backward where its forward dropped a value (a ReLU, a dropout) and its output
    was zero everywhere on every sampled step: every unit off, so it passed back nothing."""
    if not taxonomy.writes_backward_zeros(run.types.get(m, "")):
        return False
    return _zero_output(run, m)


def _zero_output(run: _Run, m: str) -> bool:
    """Whether ``m``'s output was zero everywhere on every sampled step."""
    acts = run.kind(T.ACTIVATION)
    mine = acts[T.texts(acts[T.MODULE]) == m]
    return not mine.empty and 0 < float(mine[T.NUMEL].sum()) <= float(mine[T.ZEROS].sum())


def _weight_rows(run: _Run, kind: str, m: str, param: str = T.WEIGHT) -> pd.DataFrame:
    """The rows of ``kind`` of ``m``'s parameter named ``param`` (weight)."""
    rows = run.kind(kind)
    return rows[(T.texts(rows[T.MODULE]) == m) & (T.texts(rows[T.PARAM]) == param)]


def _zero_weight(run: _Run, m: str, param: str = T.WEIGHT) -> str | None:
    """What became of ``m``'s weight where it was exactly zero on every sampled step (zero-initialised, as LoRA's
    B or a zero-initialised head: the gradient ``m`` passes back is its output gradient times that weight, zero);
    None where it was not. "moved": a sampled update moved it, so the layers behind it get a gradient from the
    next step on; "idle": its learning rate was 0 on every sampled step (a warmup of its own that starts
    later); "frozen": it has no gradient of its own; "unfollowed": it has one and no update row (it is not in
    the optimizer the Profiler follows); "unmoved": steps with a nonzero learning rate did not move it (its own
    gradient was zero too). ``param``: another parameter of ``m`` (a gate it holds itself)."""
    w = _weight_rows(run, T.WEIGHT, m, param)
    if not 0 < float(w[T.NUMEL].sum()) <= float(w[T.ZEROS].sum()):
        return None
    if _weight_rows(run, T.WEIGHT_GRAD, m, param).empty:
        return "frozen"
    wu = _weight_rows(run, T.WEIGHT_UPDATE, m, param)
    if wu.empty:
        return "unfollowed"
    if (wu[T.NUMEL] > wu[T.ZEROS]).any():
        return "moved"
    return "unmoved" if (_calls(wu) > 0).any() else "idle"


def _gate_name(module: str, param: str) -> str:
    """A parameter's full name, as ``model.named_parameters()`` gives it: "block.alpha", "alpha" of the root."""
    return f"{module}.{param}" if module else param


def _zero_params(run: _Run) -> dict[str, list[str]]:
    """Per module, its parameters that were exactly zero on every sampled step (their names, as recorded)."""
    w = run.kind(T.WEIGHT)
    rows = pd.DataFrame(
        {
            T.MODULE: T.texts(w[T.MODULE]).astype(object),
            T.PARAM: T.texts(w[T.PARAM]).astype(object),
            T.NUMEL: w[T.NUMEL].to_numpy(),
            T.ZEROS: w[T.ZEROS].to_numpy(),
        }
    )
    per = rows.groupby([T.MODULE, T.PARAM])[[T.NUMEL, T.ZEROS]].sum()
    out: dict[str, list[str]] = {}
    for module, param in per.index[(per[T.NUMEL] > 0) & (per[T.ZEROS] >= per[T.NUMEL])]:
        out.setdefault(str(module), []).append(str(param))
    return out


def _gates(run: _Run, m: str, holder: str, param: str, state: str) -> bool:
    """Whether the run shows ``holder``'s parameter ``param`` of zeros (what became of it: ``state``, of
    ``_zero_weight``) multiplying the branch ``m`` sits in. A gate in ``x + alpha * f(x)`` gets the gradient
    ``sum(dy * f(x))``, nonzero, while it passes ``alpha * dy``, zero, back to f: its own gradient held a nonzero
    value on a sampled step that recorded ``m``'s weight gradient. A vector added to the features (an offset, a
    mask or cls token) multiplies nothing: added on ``m``'s branch, its gradient is that branch's, zero; added
    before ``m``, it does not stop ``m``'s gradient at all, and the run does not tell it from a gate that way. A
    frozen parameter has no gradient to tell by: only a scalar is taken for a gate (ReZero's alpha), a vector of
    zeros is as likely an offset or a token the model adds."""
    if state == "frozen":
        w = _weight_rows(run, T.WEIGHT, holder, param)
        return int(w.groupby(T.STEP)[T.NUMEL].sum().max()) == 1
    g = _weight_rows(run, T.WEIGHT_GRAD, holder, param)
    g = g[g[T.STEP].isin(set(_weight_rows(run, T.WEIGHT_GRAD, m)[T.STEP]))]
    return bool((g[T.NUMEL] - g[T.ZEROS] - g[T.NAN] - g[T.INF] > 0).any())


def _zero_gate(
    run: _Run, m: str, grads: pd.DataFrame, zeros: dict[str, list[str]]
) -> tuple[str, str, str] | None:
    """A parameter that a module around ``m`` holds itself (not one of a child's) and that was exactly zero on
    every sampled step (``zeros``: ``_zero_params``), where the gradient reached that module's output and the
    run shows it multiplying the branch ``m`` sits in (``_gates``): a gate (ReZero's ``x + self.alpha * f(x)``,
    alpha initialised to 0), so the branch gets zeros until it moves. (its full name, the module holding it,
    what became of it: ``_zero_weight``), the closest module first; None where none holds one."""
    for holder in reversed(_ancestors(m)):
        if holder in grads.index and grads.at[holder, "nonzero"] <= 0:
            continue  # no gradient reached it either: the zeros came from further on
        for param in zeros.get(holder, []):
            state = _zero_weight(run, holder, param)
            if state is not None and _gates(run, m, holder, param, state):
                return _gate_name(holder, param), holder, state
    return None


@dataclass
class _Causes:
    """The dead layers grouped by what stopped their gradient (``_causes``)."""

    # torchao layers whose FP8 cast flushed their output gradient whole -> its largest value
    fp8: dict[str, float]
    behind_fp8: list[str]  # layers whose gradient those layers' backward passed back as zeros
    fp16: list[str]  # layers whose output gradient fp16 held, and flushed whole
    stopped: dict[str, list[str]]  # a later module whose backward passed back zeros -> the layers behind it
    # (a later module whose weight was zero on every sampled step, what became of it: ``_zero_weight``) -> the
    # layers behind it; those behind one that moved are no layers without a gradient (``waiting``). A gate a
    # module around them holds itself (``_zero_gate``) is keyed by its full parameter name, in ``gates``
    zero_weight: dict[tuple[str, str], list[str]]
    waiting: list[str]
    zero_input: dict[tuple[str, ...], list[str]]  # the modules whose all-zero output they read -> the layers
    unreached: list[str]  # no later module received a nonzero gradient
    no_tokens: list[str]  # called with no token on every sampled step (an expert the router sent none to)
    unknown: list[str]  # their output gradient and input both held nonzero values
    # their output gradient (fp16) and input held nonzero values too small for any entry of the weight gradient
    # to reach fp16's smallest subnormal, which the fp16 GEMM rounds to 0 -> the bound on those entries
    fp16_gemm: dict[str, float] = field(default_factory=dict)
    # their output gradient held nonzero values, and the run does not record their input (an embedding's ids)
    unread: list[str] = field(default_factory=list)
    # embeddings that looked up only their padding_idx (their output zero everywhere, their output gradient not)
    # -> that index
    padding: dict[str, int] = field(default_factory=dict)
    # a gate's full parameter name -> the module holding it
    gates: dict[str, str] = field(default_factory=dict)
    # a norm whose fp16 x.pow(2) overflowed (fp16_norm_overflow) -> the layers its zeroed output starved: itself
    # (its weight gradient is its output gradient times its normalised input, 0), those that read that output,
    # and those before it whose output gradient came back through it as 0 (``_Plan.fp16_norm_starved``)
    norm: dict[str, list[str]] = field(default_factory=dict)


def _norm_cause(plan: _Plan, m: str, inputs: Mapping[str, list[str]], grads: pd.DataFrame) -> str | None:
    """The norm whose fp16 overflow (``plan.fp16_norm_overflow``) starved the dead layer ``m``, or None: ``m`` is
    that norm, reads its all-zero output (``inputs``), or ran before it and got no nonzero output gradient back
    through it (``plan.fp16_norm_starved``)."""
    if m in plan.fp16_norm_overflow:
        return m
    read = [src for src in inputs.get(m, []) if src in plan.fp16_norm_overflow]
    if read:
        return read[0]
    norm = plan.fp16_norm_starved.get(m)
    if norm is not None and m in grads.index and grads.at[m, "nonzero"] <= 0:
        return norm
    return None


def _causes(run: _Run, dead: list[str], dims: dict[str, dict[str, int]], plan: _Plan) -> _Causes:
    grads = _output_grads(run)
    flushed = _fp8_flushed(run, grads)
    inputs, read = _zero_inputs(run, dead, dims)
    sources = gemm_inputs(run, dead, dims)
    padding = _padding_indices(run)
    in16 = _fp16_only(run)
    zeros = _zero_params(run)
    seq = run.sort(_innermost(str(x) for x in grads.index))
    acts = run.kind(T.ACTIVATION)
    elements = acts.groupby(T.texts(acts[T.MODULE]).astype(object))[T.NUMEL].sum()
    c = _Causes({m: a for m, a in flushed.items() if m in dead}, [], [], {}, {}, [], {}, [], [], [])
    for m in dead:
        if m in c.fp8:
            continue
        norm = _norm_cause(plan, m, inputs, grads)
        if norm is not None:
            c.norm.setdefault(norm, []).append(m)
        elif m in elements.index and elements[m] <= 0:
            c.no_tokens.append(m)
        elif m in grads.index and grads.at[m, "nonzero"] <= 0:
            stop = _stop(m, seq, grads)
            zero = _zero_weight(run, stop) if stop is not None else None
            # (a gate of zeros around m, where a later module received a nonzero gradient that did not come
            # back to m, and neither FP8, a later module's weight of zeros, fp16 nor a dead ReLU stopped it: with
            # no later module's gradient nonzero, the loss does not depend on m, whatever the model holds)
            gate = (
                _zero_gate(run, m, grads, zeros)
                if stop is not None
                and stop not in flushed
                and zero is None
                and m not in in16
                and not _dead_mask(run, stop)
                else None
            )
            if gate is not None:
                c.gates[gate[0]] = gate[1]
                stop, zero = gate[0], gate[2]
            if stop in flushed:
                c.behind_fp8.append(m)
            elif stop is not None and zero is not None:
                (c.waiting if zero == "moved" else c.zero_weight.setdefault((stop, zero), [])).append(m)
            elif m in in16 and not (stop is not None and _dead_mask(run, stop)):
                c.fp16.append(m)
            elif stop is not None:
                c.stopped.setdefault(stop, []).append(m)
            else:
                c.unreached.append(m)
        elif m in inputs:
            c.zero_input.setdefault(tuple(inputs[m]), []).append(m)
        elif m in padding and _zero_output(run, m):
            c.padding[m] = padding[m]
        elif m in read and m in in16 and (bound := _fp16_gemm_bound(run, m, sources.get(m, []))) is not None:
            c.fp16_gemm[m] = bound
        elif m in read:
            c.unknown.append(m)
        else:
            c.unread.append(m)
    return c


def _quantized(run: _Run) -> set[str]:
    """The FP8 layers of the run that are nn.Linear layers whose weight torchao's ``quantize_`` made an FP8
    training weight (``capture.fp8_recipe``'s recipes naming a ``weight_type``), not Float8Linear layers."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    recipes = capture.get("fp8_recipe") if isinstance(capture, Mapping) else None
    return {
        str(m)
        for r in (recipes if isinstance(recipes, list) else [])
        if isinstance(r, Mapping) and r.get("weight_type")
        for m in r.get("layers") or []
    }


def _fp8_kind(run: _Run, layers: list[str]) -> str:
    """What torchao FP8 layers ``layers`` are, in words: "torchao Float8Linear", "nn.Linear with torchao's FP8
    training weight (quantize_)", or both."""
    quantized = _quantized(run)
    kinds = [
        *(["torchao Float8Linear"] if any(m not in quantized for m in layers) else []),
        *(
            ["nn.Linear with torchao's FP8 training weight (quantize_)"]
            if any(m in quantized for m in layers)
            else []
        ),
    ]
    return " or ".join(kinds)


def _fp8_said(run: _Run, c: _Causes) -> str:
    """How torchao's FP8 flushed the gradients of ``c.fp8`` and of the layers behind them, in words."""
    lim = run.cfg.max_listed_modules
    src = run.sort(c.fp8)
    fmt, pow2 = _grad_casts(run)[src[0]]
    behind = (
        f", and the gradient it passed back was zero too, which left {_listing(c.behind_fp8, lim)} without one"
        if c.behind_fp8
        else ""
    )
    return (
        f"FP8 flushed them: the output gradient of {_listing(src, lim)} ({_fp8_kind(run, src)}) never exceeded "
        f"{max(c.fp8.values()):.3g}, under torchao's floor on amax ({formats.FP8_AMAX_FLOOR:g}), where the "
        f"{fmt.label} cast of its backward scales by fmax/{formats.FP8_AMAX_FLOOR:g} at most and flushes every "
        f"value up to {_flush_limit(fmt, pow2):.2g}: its weight-gradient GEMM read only zeros{behind}"
    )


def _around(m: str, stop: str) -> tuple[str, bool] | None:
    """The module whose own forward runs between ``m`` and ``stop`` where they are not called by the same one:
    the outermost ancestor of ``m`` that is not one of ``stop`` (an MoE module calling its experts, its own code
    masking their outputs before they reach ``stop``), else that of ``stop`` (a block calling ``stop``), and
    whether it is ``m``'s; None where the two have one parent (the code between them is that parent's, as in a
    Sequential)."""
    mine, theirs = _ancestors(m), _ancestors(stop)
    own = [a for a in mine if a not in set(theirs)]
    if own:
        return own[0], True
    other = [a for a in theirs if a not in set(mine)]
    return (other[0], False) if other else None


def _fed_too(m: str, stop: str, seq: list[str], grads: pd.DataFrame) -> str | None:
    """Another module called by ``m``'s parent, before ``stop`` in forward order, whose output gradient held a
    nonzero value while every module recorded between it and ``stop`` held none: the gradient that reached it
    came back through ``stop`` as ``m``'s would (two experts whose outputs are summed before ``stop``), so what
    ``stop``'s backward passed back was not zero, and the zero ``m`` got was made between them (a mask); None
    where there is none."""
    if stop not in seq:
        return None
    parent = _ancestors(m)[-1:]
    end = seq.index(stop)
    for i, other in enumerate(seq[:end]):
        if other == m or _ancestors(other)[-1:] != parent or grads.at[other, "nonzero"] <= 0:
            continue
        if all(grads.at[s, "nonzero"] <= 0 for s in seq[i + 1 : end]):
            return other
    return None


def _apart_said(run: _Run, stop: str, layers: list[str]) -> str:
    """Why the run does not tell that ``stop``'s backward passed back the zeros ``layers`` got, where it does
    not: a module's own code runs between them (``_around``), or another module of their parent got a nonzero
    gradient back through ``stop`` (``_fed_too``); "" where neither."""
    grads = _output_grads(run)
    seq = run.sort(_innermost(str(x) for x in grads.index))
    listed = _listing(layers, run.cfg.max_listed_modules)
    for m in layers:
        around = _around(m, stop)
        if around is not None:
            holder, own = around
            kind = run.types.get(holder, "")
            named = _name(holder) + (f" ({kind})" if kind else "")
            if own:
                return (
                    f"{named}, which calls {_name(m)}, runs code of its own between {_name(m)} and {_name(stop)}, "
                    "which the run does not record"
                )
            return (
                f"{_name(stop)} is called by {named}, which runs code of its own between {listed} and "
                f"{_name(stop)}, which the run does not record"
            )
    for m in layers:
        other = _fed_too(m, stop, _innermost(seq), grads)
        if other is not None:
            return (
                f"{_name(other)}, called by the same module as {_name(m)} and before {_name(stop)}, got a nonzero "
                f"gradient while no module recorded between {_name(other)} and {_name(stop)} did, so what "
                f"{_name(stop)}'s backward passed back was not zero everywhere"
            )
    return ""


def _stop_said(run: _Run, stop: str, layers: list[str]) -> str:
    """Where the gradient flowing back to ``layers`` stopped, in words, with a dead ReLU named as such. ``stop``
    is only the first module after them in forward order whose output gradient held a nonzero value: where it is
    a matmul (a Linear, a convolution), whose backward passes back zeros only through a weight of zeros (no
    ``_zero_weight``), the run does not tell that it reads their output at all (a parallel head called after
    them: aux(x), then head(x)), and the sentence says only what it shows."""
    kind = run.types.get(stop, "")
    if taxonomy.kind_of_type(kind) == taxonomy.MATMUL:
        listed = _listing(layers, run.cfg.max_listed_modules)
        it, its = ("them", "their") if len(layers) > 1 else ("it", "its")
        return (
            f"the output gradient{'s' if len(layers) > 1 else ''} of {listed} held no nonzero value, while that of "
            f"{_name(stop)} ({kind}), recorded after {listed} in forward order, did: no module passed {listed} a "
            f"nonzero gradient, and the run does not tell whether {_name(stop)} reads {its} output (a {kind} "
            "passes back zeros only through a weight of zeros: then a function between them zeroed the gradient, "
            f"a multiplication by zero or a mask) or sits beside {it} (a parallel branch: then the loss does not "
            f"depend on {it}, a loss term weighted 0, every output masked out)"
        )
    listed = _listing(layers, run.cfg.max_listed_modules)
    said = (
        f"the gradient stopped at {_name(stop)} ({kind}): its output gradient held nonzero values, and what its "
        f"backward passed back to {listed} was zero everywhere"
    )
    if _dead_mask(run, stop):
        return said + f" (its output was zero on every sampled step: every unit was off, a dead {kind})"
    apart = _apart_said(run, stop, layers)
    if apart:
        return (
            f"the output gradient{'s' if len(layers) > 1 else ''} of {listed} held no nonzero value, while that "
            f"of {_name(stop)} ({kind}), the next module recorded after {listed} in forward order, did; the run "
            f"does not tell that {_name(stop)}'s backward zeroed it: {apart}, and a function between them may "
            "have zeroed the gradient (a mask, a routing weight or a gate at zero, a multiplication by zero)"
        )
    return said + " (a mask, a gate at zero, or an op whose backward is zero there)"


_ZERO_WEIGHT_SAID = {
    "idle": "its learning rate was 0 on every sampled step: the layers behind it get a gradient once a learning "
    "rate above 0 has moved it",
    "frozen": "it is frozen (it has no gradient of its own), so it does not move and the layers behind it get no "
    "gradient",
    "unfollowed": "no sampled step updated it: it has a gradient, but is not in the optimizer the Profiler follows",
    "unmoved": "optimizer steps with a nonzero learning rate did not move it: its own gradient was zero too",
}


def _zero_weight_said(run: _Run, c: _Causes, stop: str, state: str, layers: list[str]) -> str:
    """Where the gradient flowing back to ``layers`` stopped at a weight of zeros, or a gate of zeros (``stop``
    one of ``c.gates``), in words, and why it did not move (``state``, of ``_zero_weight``)."""
    if stop in c.gates:
        holder = c.gates[stop]
        return (
            f"the gradient stopped at {stop}, a parameter held by {_name(holder)} ({run.types.get(holder, '')}) "
            "itself, which was exactly zero on every sampled step (zero-initialised, as ReZero's gate in "
            "x + alpha * f(x)): "
            f"the branch it multiplies passes back zeros to {_listing(layers, run.cfg.max_listed_modules)} until "
            "it moves, and " + _ZERO_WEIGHT_SAID[state]
        )
    return (
        f"the gradient stopped at {_name(stop)} ({run.types.get(stop, '')}), whose weight was exactly zero on "
        "every sampled step (zero-initialised, as LoRA's B or a zero-initialised output layer): it passes back "
        f"zeros to {_listing(layers, run.cfg.max_listed_modules)} until that weight moves, and "
        + _ZERO_WEIGHT_SAID[state]
    )


def _norm_said(run: _Run, norm: str, layers: list[str]) -> str:
    """How ``norm``'s fp16 overflow (fp16_norm_overflow) starved ``layers`` of their weight gradients, in words."""
    lim = run.cfg.max_listed_modules
    readers = [m for m in layers if m != norm and run.order.get(m, 0) > run.order.get(norm, 0)]
    before = [m for m in layers if m != norm and m not in readers]
    parts = []
    if norm in layers:
        parts.append(
            f"{_name(norm)}'s own weight gradient, its output gradient times the normalised input x * rsqrt(inf) = 0, "
            "was 0"
        )
    if readers:
        parts.append(
            f"{_listing(readers, lim)} read{'s' if len(readers) == 1 else ''} that output, zero everywhere, and a "
            "weight gradient is the output gradient times the input"
        )
    if before:
        parts.append(
            f"the output gradient{'s' if len(before) > 1 else ''} of {_listing(before, lim)} came back through "
            f"{_name(norm)}, whose backward passes 0 back through a row it zeroed"
        )
    return (
        f"the x.pow(2) of {_name(norm)} overflowed fp16 and zeroed its output (fp16_norm_overflow): "
        + "; ".join(parts)
        + ": no loss scale changes that"
    )


def _causes_said(run: _Run, c: _Causes) -> list[str]:
    """A sentence per cause, the FP8 one first."""
    lim = run.cfg.max_listed_modules
    said = [_fp8_said(run, c)] if c.fp8 else []
    said += [_norm_said(run, norm, ms) for norm, ms in c.norm.items()]
    if c.fp16:
        said.append(
            f"the output gradients of {_listing(c.fp16, lim)} were held in fp16 and were zero everywhere: fp16 "
            "flushes a gradient below 2^-25 (at the run's loss scale) to zero, and none of theirs reached its range "
            "(fp16_gradient_underflow)"
        )
    said += [_zero_weight_said(run, c, s, state, ms) for (s, state), ms in c.zero_weight.items()]
    said += [_stop_said(run, s, ms) for s, ms in c.stopped.items()]
    said += [
        f"the input of {_listing(ms, lim)} was zero everywhere on every sampled step (the output of "
        f"{_listing(list(src), lim)}), and a weight gradient is the output gradient times the input"
        for src, ms in c.zero_input.items()
    ]
    if c.unreached:
        said.append(
            f"no module recorded after {_listing(c.unreached, lim)} received a nonzero gradient either: the loss "
            "does not depend on them (a path multiplied by zero, a loss term weighted 0, every output masked out)"
        )
    if c.no_tokens:
        said.append(
            f"no token reached {_listing(c.no_tokens, lim)} on any sampled step (an expert the router sent none "
            "to), and a weight gradient sums over the tokens a layer read"
        )
    if c.padding:
        pads = run.sort(c.padding)
        its = "their" if len(pads) > 1 else "its"
        named = [f"{_name(m)} (padding_idx={c.padding[m]})" for m in pads]
        said.append(
            f"the embedding{'s' if len(pads) > 1 else ''} {_listing(named, lim)} looked up only {its} padding_idx: "
            f"{its} output was zero everywhere on every sampled step (the padding row, zero as torch initialises "
            f"it) while {its} output gradient held nonzero values, and torch passes the padding_idx row no "
            "gradient by construction"
        )
    if c.fp16_gemm:
        worst = max(c.fp16_gemm.values())
        said.append(
            f"the output gradient and the input of {_listing(run.sort(c.fp16_gemm), lim)} held nonzero values, but "
            f"every entry of their weight gradient is at most {_g(worst)} (on a step, the output gradient's count of "
            "nonzero values times its largest value, at the run's loss scale, times the input's largest), below "
            f"fp16's smallest subnormal, 2^-24 ({_g(FP16.smallest_subnormal)}): the weight-gradient GEMM, which fp16 "
            "autocast runs in fp16, holds such an entry as zero or 2^-24, and held every one of theirs as zero"
        )
    if c.unknown:
        said.append(
            f"the output gradient and the input of {_listing(c.unknown, lim)} held nonzero values: what zeroed "
            "their weight gradients the run does not tell (a custom backward, a hook that zeroed them)"
        )
    if c.unread:
        embeddings = [
            m for m in c.unread if taxonomy.kind_of_type(run.types.get(m, "")) == taxonomy.EMBEDDING
        ]
        said.append(
            f"the output gradient of {_listing(c.unread, lim)} held nonzero values, and the run does not record "
            f"{'its' if len(c.unread) == 1 else 'their'} input"
            + (" (an embedding's are integer ids)" if embeddings else "")
            + ": what zeroed their weight gradients the run does not tell (a custom backward, a hook that zeroed "
            "them"
            + (
                ", or ids that were all an embedding's padding_idx, whose row torch passes no gradient"
                if embeddings
                else ""
            )
            + ")"
        )
    return [s[0].upper() + s[1:] for s in said]


def _remedy(run: _Run, c: _Causes) -> str:
    """What to do, the FP8 cause first."""
    parts = []
    if c.norm:
        parts.append(
            f"compute {_listing(run.sort(c.norm), run.cfg.max_listed_modules)} in fp32 as fp16_norm_overflow says "
            "(x.float() before the square, as Llama's RMSNorm does), or train in bf16: the zeros of its overflow "
            "stopped these gradients"
        )
    if c.fp8:
        layers = run.sort([*c.fp8, *c.behind_fp8])
        quantized = _quantized(run)
        # how the run made them FP8: the call that leaves them out (an nn.Linear behind one is neither)
        outs = [
            *(
                ["convert_to_float8_training with module_filter_fn"]
                if any(m not in quantized for m in c.fp8)
                else []
            ),
            *(["quantize_ with filter_fn"] if any(m in quantized for m in c.fp8) else []),
        ]
        parts.append(
            "weight the loss more, or scale it statically (multiply it by 2^k before backward, divide the "
            f"gradients by 2^k before the optimizer steps), so that the output gradient of every "
            f"{_fp8_kind(run, list(c.fp8))} exceeds torchao's floor ({formats.FP8_AMAX_FLOOR:g}); or train "
            f"{_listing(layers, run.cfg.max_listed_modules)} in bf16 (leave them out of {' or '.join(outs)})"
        )
    if c.fp16 or c.fp16_gemm:
        parts.append("scale the loss more, or train in bf16, as fp16_gradient_underflow sizes it")
    idle = [s for s, state in c.zero_weight if state == "idle"]
    # (gates in the order of the first layer behind each, as ``c.zero_weight`` has them)
    idle = run.sort(s for s in idle if s not in c.gates) + [s for s in idle if s in c.gates]
    if idle:
        parts.append(
            f"nothing, if the learning rate of {_listing(idle, run.cfg.max_listed_modules)} is meant to start "
            "later (the layers behind it learn once it has moved); else give its param group a learning "
            "rate above 0"
        )
    fixed = run.sort(s for s, state in c.zero_weight if state != "idle" and s not in c.gates)
    gates = [s for s, state in c.zero_weight if state != "idle" and s in c.gates]
    if gates:
        parts.append(
            f"let {_listing(gates, run.cfg.max_listed_modules)} train (requires_grad_(True), in the optimizer, a "
            "learning rate above 0): a gate of zeros passes no gradient to the branch it multiplies until it moves"
        )
    if fixed:
        parts.append(
            f"let the weight of {_listing(fixed, run.cfg.max_listed_modules)} train (requires_grad_(True), in the "
            "optimizer, a learning rate above 0), or initialise it with small nonzero values: a weight of zeros "
            "passes no gradient back until it moves"
        )
    if c.no_tokens:
        parts.append("balance the router's load (an auxiliary load-balancing loss, a capacity factor)")
    if c.padding:
        pads = run.sort(c.padding)
        it, its = ("them", "their") if len(pads) > 1 else ("it", "its")
        parts.append(
            f"feed {_listing(pads, run.cfg.max_listed_modules)} the ids meant for {it} ({its} padding_idx row, the "
            f"only one looked up, never trains), or remove or freeze {it} (requires_grad_(False)) if {it} is "
            "meant to add nothing"
        )
    if c.stopped or c.zero_input or c.unreached or c.unknown or c.unread:
        parts.append(
            "find what zeroes the gradient between the loss and these layers (a ReLU whose units are all off: a "
            "lower learning rate, another initialisation or LeakyReLU; a mask, a gate or a loss weight at zero) "
            "and profile again; a layer meant to stay fixed is better frozen with requires_grad_(False), which "
            "spares its weight-gradient GEMM"
        )
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def _rule_no_gradient(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    """Layers whose weight gradient was zero everywhere on every sampled step, also after the optimizer had stepped
    with a nonzero learning rate: they did not learn (whether weight decay or momentum moved them all the same,
    their sampled updates say: ``_moved``). Critical:
    nothing else says so, and a verdict on the other numbers reads as a healthy run. Layers behind a weight of
    zeros that a sampled update moved are left out (they get a gradient from the next step on: LoRA's B under a
    learning rate that starts later); a warning where every layer is behind one whose learning rate was 0 on
    every sampled step (it may be meant to start later)."""
    dead = _dead_layers(run)
    if dead is None:
        return
    c = _causes(run, dead.layers, dims, plan)
    dead = dead.without(c.waiting)
    if dead is None:
        return
    behind_idle = sum(len(ms) for (_, state), ms in c.zero_weight.items() if state == "idle")
    n, lim = len(dead.layers), run.cfg.max_listed_modules
    steps = (
        f"all {dead.steps} sampled step(s) with weight gradients"
        if dead.fewest == dead.steps
        else f"every sampled step that recorded it (at least {dead.fewest} of the {dead.steps} with weight "
        "gradients)"
    ) + (
        f" (but for nan or inf beside the zeros on the {dead.skipped_nonfinite} sampled step(s) the loss scaler skipped, whose "
        "gradients it threw away: no finite nonzero value)"
        if dead.skipped_nonfinite
        else ""
    )
    fp8 = len(c.fp8) + len(c.behind_fp8)
    by_norm = sum(len(ms) for ms in c.norm.values())
    plan.add(
        Finding(
            "no_gradient",
            WARNING if behind_idle == n else CRITICAL,
            f"No gradient reached the weights of {n} of {dead.checked} layers"
            + (": FP8 flushed it" if fp8 else "")
            + (f": {_listing(run.sort(c.norm), lim)}'s x.pow(2) overflowed fp16" if by_norm == n else "")
            + (": a weight of zeros stopped it" if behind_idle == n else ""),
            f"Every weight-gradient value of {n} layer(s) ({_listing(dead.layers, lim)}) was an exact zero on "
            f"{steps}, while the optimizer stepped on {dead.optimizer_steps} sampled step(s) with a nonzero learning "
            f"rate: these weights did not learn; {_moved_said(run, dead.layers)}. "
            + ". ".join(_causes_said(run, c))
            + ".",
            _remedy(run, c),
            modules=dead.layers,
            numbers={
                "no_gradient_layers": n,
                "weight_gradient_layers": dead.checked,
                "sampled_steps_with_grads": dead.steps,
                **({"no_gradient_steps_min": dead.fewest} if dead.fewest < dead.steps else {}),
                "optimizer_steps_sampled": dead.optimizer_steps,
                "fp8_flushed_layers": fp8,
                "fp8_output_gradient_max": max(c.fp8.values()) if c.fp8 else None,
                "fp16_norm_overflow_layers": by_norm,
                # the norms whose overflow starved them, for the verdict box
                **({"fp16_norm_overflow_norms": _listing(run.sort(c.norm), lim)} if c.norm else {}),
            },
        )
    )

"""An fp16 norm whose x.pow(2) overflows: a norm that computes its statistics in fp16 squares its input, and
any |x| >= 256 squares to inf, which zeroes the row it normalises. Found from the norm's input (its own input row,
or the output of the module that made it as it is) and the exact zeros of its output."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import _dtype_has, _norm_inputs_from, _Plan, _Run
from precprof.analysis.advisor.model import CRITICAL, Finding, Number
from precprof.analysis.advisor.rules.fp16 import _leaf_outputs
from precprof.analysis.advisor.text import _g, _listing, _name, _pct

# a norm's output share of exact zeros above which zeros its input did not hold are its own doing
_NORM_ZEROS_SHARE = 0.01
# the smallest |x| whose square overflows fp16: 256^2 = 65536 is inf, fp16's next value down 255.875^2 = 65472 fits
_FP16_SQUARE_OVERFLOW_EXPONENT = 8


def _rule_fp16_norm_square(run: _Run, plan: _Plan) -> None:
    """fp16_norm_overflow: a norm that computes its statistics in fp16 (x.pow(2).mean(-1) with no upcast, a
    hand-written RMSNorm), whose fp16 input (``_norm_input``: its own input row or its maker's; in a run without
    them, the output of the leaf module just before it that made as many values), holds values of |x| >= 256: their square is
    inf in fp16, the mean of their row inf, and x * rsqrt(inf) = 0, the whole row. Told by the norm's output:
    more than ``_NORM_ZEROS_SHARE`` of its values exact zeros that its input did not hold. A norm that computes in
    fp32 inside (torch's LayerNorm and RMSNorm, Llama's) makes no such zeros, whatever its input."""
    acts = run.kind(T.ACTIVATION)
    if acts.empty:
        return
    names = T.texts(acts[T.MODULE])
    kinds = acts[T.MODULE_TYPE].map(taxonomy.kind_of_type)
    norms = run.sort({str(m) for m in names[(kinds == taxonomy.NORM).to_numpy()]})
    if not norms:
        return
    calls, numel, leaves = run.memo("passed_on", lambda: _leaf_outputs(run))
    found: list[_Overflowed] = []
    for m in norms:
        fed_by = _norm_input(run, m, acts, names, numel, leaves, calls)
        if fed_by is None:
            continue
        fed, input_said = fed_by.rows, fed_by.said
        rows = acts[(names == m).to_numpy()]
        if not bool(_dtype_has(fed, "float16").all()):
            continue
        # (a step whose input held nan/inf aside: x * rsqrt(inf) of a row holding inf is 0 whatever the norm
        # computes in, and the run is breaking down there, not squaring large finite values)
        broken = set(fed.loc[(fed[T.NAN] + fed[T.INF] > 0).to_numpy(), T.STEP])
        if broken:
            fed, rows = fed[~fed[T.STEP].isin(broken)], rows[~rows[T.STEP].isin(broken)]
        h = fed_by.hist(set(fed[T.STEP]) if broken else None)
        n = int(rows[T.NUMEL].sum())
        zeros, input_zeros = int(rows[T.ZEROS].sum()), int(fed[T.ZEROS].sum())
        if n <= 0 or (zeros - input_zeros) / n <= _NORM_ZEROS_SHARE:
            continue
        big = int(h.loc[h[T.EXPONENT] >= _FP16_SQUARE_OVERFLOW_EXPONENT, T.COUNT].sum())
        if not big:
            continue
        share = zeros / n
        plan.fp16_norm_overflow[m] = share
        for s in _starved(run, m, share):
            plan.fp16_norm_starved.setdefault(s, m)
        found.append(_Overflowed(m, zeros, n, input_zeros, big, float(fed[T.ABSMAX].max()), input_said))
    if found:
        plan.add(_norm_overflow_finding(run, found))


@dataclass(frozen=True)
class _Overflowed:
    """A norm whose fp16 x.pow(2) overflowed: its output's exact zeros and values, its input's zeros, values of
    |x| >= 256 and largest magnitude, and that input in words (``_Fed.said``)."""

    norm: str
    zeros: int
    values: int
    input_zeros: int
    big: int
    top: float
    input_said: str


_FIX = (
    "upcast {its} input before the square (x = x.float(); variance = x.pow(2).mean(-1, keepdim=True); "
    "x * torch.rsqrt(variance + eps), cast back to the input's dtype before the weight), as Llama's RMSNorm does; "
    "or use torch.nn.RMSNorm or LayerNorm, which compute in fp32 inside; or use bf16, whose range is fp32's. "
    "torch.autocast(enabled=False) around {it} alone changes nothing: {its} input stays fp16 (call {it} on "
    "x.float())."
)
_OWN_INPUT = "the fp16 tensor its forward received"  # (``_fed``: its own input row)
_SQUARE = (
    "whose square is beyond 65504, inf in fp16; the mean of a row holding one is inf and x * rsqrt(inf) is 0, "
    "the whole row"
)


def _norm_overflow_finding(run: _Run, found: list[_Overflowed]) -> Finding:
    """One finding for the norms of ``found`` (forward order): a pre-norm model's norms overflow together, the
    residual stream growing past 256 from a block on."""
    zeros, values = sum(o.zeros for o in found), sum(o.values for o in found)
    numbers: dict[str, Number] = {
        "zeros": zeros,
        "values": values,
        "share": zeros / values,
        "input_zeros": sum(o.input_zeros for o in found),
        "input_values_at_least_256": sum(o.big for o in found),
    }
    modules = [o.norm for o in found]
    if len(found) == 1:
        (o,) = found
        m = o.norm
        return Finding(
            "fp16_norm_overflow",
            CRITICAL,
            f"{_name(m)}'s x.pow(2) overflows fp16: {_pct(o.zeros / o.values)} of its output is 0",
            f"{_name(m)} ({run.types.get(m, '?')}) computes its statistics in fp16: its input, {o.input_said}, "
            f"holds {o.big:,} values of |x| >= 256 (max {_g(o.top)}), {_SQUARE}: {o.zeros:,} of its {o.values:,} "
            f"output values ({_pct(o.zeros / o.values)}) were exact zeros, against {o.input_zeros:,} in its input. "
            "The layers after it train on those zeros.",
            f"Compute the norm in fp32 inside {_name(m)}: " + _FIX.format(its="its", it="it"),
            modules=modules,
            numbers=numbers,
        )
    types = sorted({run.types.get(o.norm, "?") for o in found})
    own = all(o.input_said == _OWN_INPUT for o in found)
    each = ", ".join(
        f"{_name(o.norm)} {_pct(o.zeros / o.values)} ({_g(o.top)}{'' if own else ', ' + o.input_said})"
        for o in found[:8]
    )
    worst = max(found, key=lambda o: o.zeros / o.values)
    return Finding(
        "fp16_norm_overflow",
        CRITICAL,
        f"x.pow(2) overflows fp16 in {len(found)} norms: up to {_pct(worst.zeros / worst.values)} of a norm's "
        "output is 0",
        f"{_listing([_name(m) for m in modules], 8)} ({', '.join(types)}) compute their statistics in fp16: their "
        f"inputs{', the fp16 tensors their forwards received,' if own else ''} hold "
        f"{numbers['input_values_at_least_256']:,} values of |x| >= 256 (max {_g(max(o.top for o in found))}), "
        f"{_SQUARE}: {zeros:,} of their {values:,} output values ({_pct(zeros / values)}) were exact zeros, against "
        f"{numbers['input_zeros']:,} in their inputs. Per norm, the share of its output that is 0 and its input's "
        f"largest |x|{'' if own else ' (and that input)'}: {each}{f' and {len(found) - 8} more' if len(found) > 8 else ''}. "
        + (
            "In a pre-norm model each norm's input is the residual stream, which grows from block to block. "
            if own
            else ""
        )
        + "The layers after them train on those zeros.",
        f"Compute the norms in fp32 inside {_listing(types, 4)}: " + _FIX.format(its="their", it="them"),
        modules=modules,
        numbers={**numbers, "norms": len(found)},
    )


def _norm_input(
    run: _Run,
    m: str,
    acts: pd.DataFrame,
    names: pd.Series,
    numel: pd.Series,
    leaves: list[str],
    calls: pd.Series,
) -> _Fed | None:
    """What the norm ``m`` read (``_Fed``), or None where the run does not tell (a norm holding modules, one fed
    several ways, rows that do not add up to as many values as its output). Its own input row or its maker's
    (``_fed``); else, called once a step, the output of the leaf just before it that made as many values on every
    step (a run recorded before norms' inputs were read, or a norm filtered out of them)."""
    if m not in leaves:  # (a "PreNorm" wrapper's output is its sublayer's: its zeros are not the norm's)
        return None
    mine = numel.xs(m, level="m")
    fed = _fed(run, m, acts, names)
    if fed is None:
        if _norm_inputs_from(run).get(m) or calls.get(m, 1) != 1:
            return None
        before = [p for p in leaves[: leaves.index(m)] if not p.endswith(T.INPUT_SUFFIX)]
        if not before:
            return None
        feeder = before[-1]
        rows = acts[(names == feeder).to_numpy()]
        fed = _Fed(feeder, rows, run.hist_totals(), run.hist, f"the fp16 output of {_name(feeder)}")
    if fed.rows.empty or not fed.rows.groupby(T.STEP)[T.NUMEL].sum().reindex(mine.index).eq(mine).all():
        return None
    return fed


@dataclass(frozen=True)
class _Fed:
    """What a norm received: the activation rows of ``module`` that hold it (the norm's own input row, or the
    output row of the module that made it), that module's histogram totals and per-step rows, and it in words."""

    module: str
    rows: pd.DataFrame
    totals: pd.DataFrame
    per_step: pd.DataFrame
    said: str

    def hist(self, steps: set[int] | None = None) -> pd.DataFrame:
        """Its activation histogram rows: summed over every step (None), or those of ``steps``."""
        h = self.totals if steps is None else self.per_step[self.per_step[T.STEP].isin(steps)]
        return h[(T.texts(h[T.MODULE]) == self.module).to_numpy() & (h[T.TENSOR] == T.ACTIVATION).to_numpy()]


def _fed(run: _Run, m: str, acts: pd.DataFrame, names: pd.Series) -> _Fed | None:
    """The norm ``m``'s input as the run recorded it: its own input row (``capture.plan.reads_norm_input``,
    ``_Run.norm_inputs``: a sum no module returns, a pre-norm residual stream), or the output row of the one
    module that made it as it was (summary ``capture.norm_inputs_from``); None for neither, or both (fed several
    ways: no rows add up to what it read)."""
    own = run.norm_inputs
    rows = own[(own[T.MODULE] == T.input_module(m)).to_numpy()] if not own.empty else own
    made = _norm_inputs_from(run).get(m, [])
    if made and (len(made) > 1 or not rows.empty):
        return None
    if made:
        maker = acts[(names == made[0]).to_numpy()]
        return _Fed(made[0], maker, run.hist_totals(), run.hist, f"the fp16 output of {_name(made[0])}")
    if rows.empty:
        return None
    return _Fed(T.input_module(m), rows, run.norm_input_totals(), run.norm_input_hist, _OWN_INPUT)


def _starved(run: _Run, norm: str, share: float) -> list[str]:
    """The modules recorded before ``norm`` (forward order) whose fp16 activation gradients held no nonzero value,
    with no larger a share of zeros than the ``share`` of ``norm``'s output its overflow zeroed: the backward of a
    row x * rsqrt(inf) = 0 is 0 (rsqrt's backward is -0.5 * rsqrt(v)^3 = 0), so what flows back to them through
    ``norm`` is 0 there, whatever the loss scale. A module that held nonzero values got a gradient by another
    path (a residual), and a zero share above the norm's is more than its zeros account for: neither is said to
    be the norm's."""
    ag = run.kind(T.ACTIVATION_GRAD)
    if ag.empty or norm not in run.order:
        return []
    names = T.texts(ag[T.MODULE]).astype(object)
    fp16 = _dtype_has(ag, "float16").groupby(names.to_numpy()).all()
    per = ag.groupby(names.to_numpy())[[T.ZEROS, T.NUMEL, T.NAN, T.INF]].sum()
    nonzero = per[T.NUMEL] - per[T.ZEROS] - per[T.NAN] - per[T.INF]
    at = run.order[norm]
    return run.sort(
        str(m)
        for m in per.index
        if run.order.get(str(m), at) < at
        and bool(fp16.get(m, False))
        and per.at[m, T.ZEROS] > 0
        and nonzero[m] <= 0
        and per.at[m, T.ZEROS] <= share * per.at[m, T.NUMEL]
    )

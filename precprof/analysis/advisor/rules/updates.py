"""Weight updates lost in 16-bit weights, and gradients beyond bf16's range."""

from __future__ import annotations

import pandas as pd

from precprof import formats
from precprof import tables as T
from precprof.analysis import carried_updates, lost_updates, update_ratio
from precprof.analysis.advisor.evidence import (
    _dtype_has,
    _innermost,
    _Plan,
    _Run,
    _share,
    _shifted_underflow,
    _steps_without_update,
    _unfollowed_steps,
    _updated_steps,
)
from precprof.analysis.advisor.model import CRITICAL, INFO, WARNING, Finding, Number
from precprof.analysis.advisor.text import _listed, _listing, _name, _pct
from precprof.formats import BF16


def _zero_gradient(run: _Run, wu: pd.DataFrame) -> pd.Series:
    """Per ``weight_update`` row, whether its weight had no training gradient on that step: a gradient zero
    everywhere (an expert no token reached, called with none), or none from the step's backward (a layer the step
    skipped, whose ``.grad`` ``zero_grad(set_to_none=False)`` left a zero tensor): weight decay or momentum alone
    moved the weight (``lost_updates.zero_gradient``)."""
    if wu is not run.kind(T.WEIGHT_UPDATE):
        return lost_updates.zero_gradient(run.kind(T.WEIGHT_GRAD), wu)
    return run.memo(
        "zero_gradient",
        lambda: lost_updates.zero_gradient(run.kind(T.WEIGHT_GRAD), run.kind(T.WEIGHT_UPDATE)),
    )


def _nonzero_updates(rows: pd.DataFrame) -> pd.Series:
    """Per ``weight_update`` row, its intended updates that were finite: a nan or inf update (a weight that
    became or was non-finite) is neither kept nor lost by a format."""
    return (rows[T.NUMEL] - rows[T.ZEROS] - _nonfinite_updates(rows)).clip(lower=0)


def _nonfinite_updates(rows: pd.DataFrame) -> pd.Series:
    return rows[T.NAN].fillna(0) + rows[T.INF].fillna(0)


def _sample_weights(run: _Run) -> pd.Series:
    """Per ``weight_update`` row of the run, how many of its parameter's elements each sampled element stands
    for (``tables.sample_weights``): the update sample holds at most ``update_sample`` strided elements of a
    parameter and every element of a smaller one, so a share summed over parameters by their samples weighs a
    16-element bias as much as a 65,536-element weight."""
    return run.memo("sample_weights", lambda: T.sample_weights(run.kind(T.WEIGHT, T.WEIGHT_UPDATE)))


def _estimated(rows: pd.DataFrame, lost: pd.Series, weights: pd.Series) -> tuple[float, float, float | None]:
    """(lost, intended, share lost) of ``rows`` (``weight_update`` rows; ``lost`` their updates lost), each row
    counted at its parameter's size (``weights``, ``_sample_weights``): an estimate of the model's updates, not
    of the sample's."""
    w = weights.reindex(rows.index).fillna(1.0)
    est_lost = float((lost * w).sum())
    est_nz = float((_nonzero_updates(rows) * w).sum())
    return est_lost, est_nz, _share(est_lost, est_nz)


def _by_module(rows: pd.DataFrame, lost: pd.Series, weights: pd.Series) -> pd.Series:
    """Per module of ``rows``, its share of updates lost, its parameters each counted at its size (a weight's
    sample and its bias's alike would weigh the bias as much as the weight); modules with no intended update
    left out."""
    w = weights.reindex(rows.index).fillna(1.0)
    frame = pd.DataFrame({T.MODULE: rows[T.MODULE], "_lost": lost * w, "_nz": _nonzero_updates(rows) * w})
    by = frame.groupby(T.MODULE, observed=True)[["_lost", "_nz"]].sum()
    by = by[by["_nz"] > 0]
    return (by["_lost"] / by["_nz"]).sort_values(ascending=False)


def _stuck_params(
    run: _Run, rows: pd.DataFrame, lost: pd.Series, above: float
) -> list[tuple[str, str, float]]:
    """(module, parameter, share) of the parameters of ``rows`` that lost more than ``above`` of their own
    sampled updates (``lost``), largest share first, ties in model order."""
    frame = pd.DataFrame(
        {T.MODULE: rows[T.MODULE], T.PARAM: rows[T.PARAM], "_lost": lost, "_nz": _nonzero_updates(rows)}
    )
    by = frame.groupby([T.MODULE, T.PARAM], observed=True)[["_lost", "_nz"]].sum()
    by = by[by["_nz"] > 0]
    share = by["_lost"] / by["_nz"]
    over = share[share > above]
    rank = {m: i for i, m in enumerate(run.sort({m for m, _ in over.index}))}
    return sorted(
        ((str(m), str(p), float(v)) for (m, p), v in over.items()), key=lambda t: (-t[2], rank[t[0]], t[1])
    )


def _stuck_said(stuck: list[tuple[str, str, float]], fmt: str, resolution: str, limit: int) -> str:
    """The sentence on the parameters that hardly train (``_stuck_params``), "" for none."""
    if not stuck:
        return ""
    listed = ", ".join(f"{_name(m)}.{p} {_pct(v)}" for m, p, v in stuck[:limit])
    more = f" and {len(stuck) - limit} more" if len(stuck) > limit else ""
    return (
        f". Most of the updates of {len(stuck)} parameter{'s' if len(stuck) > 1 else ''} vanish, so "
        f"{'they hardly train' if len(stuck) > 1 else 'it hardly trains'}: {listed}{more} (their steps are below "
        f"half a {fmt} ulp of their weights; a norm's weight near 1 has an ulp of {resolution})"
    )


def _worst(run: _Run, by_share: pd.Series, above: float, limit: int) -> list[str]:
    """The modules of ``by_share`` (``_by_module``) whose share is above ``above``, largest first, ties in model
    order, at most ``limit``: a finding's "worst:" list (it was in model order, the largest share in the middle)."""
    over = by_share[by_share > above]
    rank = {m: i for i, m in enumerate(run.sort(over.index))}
    return sorted(rank, key=lambda m: (-float(over[m]), rank[m]))[:limit]


def _sampled_words(
    run: _Run, rows: pd.DataFrame, lost: float, nz: float, weights: pd.Series, verb: str = "are lost"
) -> tuple[str, str, dict[str, float]]:
    """Where the update sample left elements of some parameter out: the message's words on the share being an
    estimate, the method's on how (with the sample's own counts), and their numbers; "" where every element of
    every parameter was sampled (the counts are the model's)."""
    w = weights.reindex(rows.index).fillna(1.0)
    if not bool((w > 1).any()):
        return "", "", {}
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    per = capture.get("weight_update_sample") if isinstance(capture, dict) else None
    sample = (
        f"at most {int(per):,} strided elements of each parameter, spread across its columns"
        if per
        else "strided elements of each parameter"
    )
    raw = _share(lost, nz)
    return (
        " (an estimate from a sample of each parameter's elements)",
        f"The share is estimated from a sample of {sample}, every element of a smaller one: each sampled "
        "element stands for its parameter's elements over its sampled ones, so that each parameter counts at its "
        "size. An intended update is a sampled element with a nonzero gradient or a moved weight, of the weights "
        "whose gradient on that step was not zero everywhere (a weight moved by weight decay or momentum alone is "
        f"counted apart). The sampled elements counted alike: {int(lost):,} of the {int(nz):,} {verb} "
        f"({_pct(raw)}).",
        {
            "sampled_share": float(raw) if raw is not None else float("nan"),
            **({"update_sample": int(per)} if per else {}),
        },
    )


def _nonfinite_words(rows: pd.DataFrame, run: _Run) -> tuple[str, dict[str, int]]:
    """The sentence on the updates left out for being nan or inf, and its numbers; "" when there are none."""
    bad = _nonfinite_updates(rows)
    n = int(bad.sum())
    if not n:
        return "", {}
    mods = run.sort(rows.loc[bad > 0, T.MODULE].unique())
    return (
        f" Left out: {n:,} update elements that were nan or inf, of {len(mods)} module(s) "
        f"({_listing(mods, run.cfg.max_listed_modules)}: their weights became non-finite, or already were).",
        {"nonfinite_updates": n},
    )


def _zero_gradient_words(
    run: _Run, idle: pd.DataFrame, col: str, fmt: str, measured: bool
) -> tuple[str, dict[str, int]]:
    """The sentence on the updates left out, those of weights whose gradient was zero on their step, and its
    numbers; "" when there are none. ``measured``: the run holds these weights in ``fmt``, where a momentum
    update that did not land is not seen (nothing intended it), so none is counted lost."""
    nz = int(_nonzero_updates(idle).sum())
    if not nz:
        return "", {}
    lost = int(idle[col].sum())
    mods = run.sort(idle.loc[_nonzero_updates(idle) > 0, T.MODULE].unique())
    return (
        f" Left out: {nz:,} update elements of {len(mods)} module(s) whose weight gradient was zero on their "
        f"step ({_listing(mods, run.cfg.max_listed_modules)}: weight decay or momentum alone moved them, no "
        + (
            "training signal; one that did not land reads as no update)."
            if measured
            else f"training signal), {lost:,} of which vanish in {fmt} too."
        ),
        {"zero_gradient_updates": nz}
        if measured
        else {"zero_gradient_updates": nz, "zero_gradient_lost": lost},
    )


def _held_apart(rows: pd.DataFrame, held: str | None) -> pd.Series:
    """Per ``weight_update`` row of a run that holds its weights in ``held`` (a dtype name), whether its weight is
    held in another dtype (a layer kept in fp32 in a bf16 model: an MoE router, HF's
    ``_keep_in_fp32_modules``); none when no row is held in ``held``, and no row without a dtype."""
    dtypes = T.texts(rows[T.DTYPE]).astype(str)
    if not (dtypes == held).any():
        return pd.Series(False, index=rows.index)
    return (dtypes != held) & (dtypes != "")


def _held_from(rows: pd.DataFrame, held: str | None) -> int | None:
    """The step from which ``rows`` (``weight_update`` rows) hold their weights in ``held`` (a dtype name), where
    the same weights' earlier rows held them in another dtype (a ``model.to(torch.bfloat16)`` mid-run); None
    else. A weight whose first row is in ``held`` changed no dtype: a layer loaded in bf16 and frozen, that
    joins the optimizer mid-run (gradual unfreezing), is no switch of the run's weights."""
    dtypes = T.texts(rows[T.DTYPE]).astype(str)
    if not (dtypes == held).any() or not ((dtypes != held) & (dtypes != "")).any():
        return None  # no weight held in ``held``, or none in another dtype: none switched
    weights = pd.DataFrame(
        {
            "key": (
                T.texts(rows[T.MODULE]).astype(str) + "." + T.texts(rows[T.PARAM]).astype(str)
            ).to_numpy(),
            T.STEP: rows[T.STEP].to_numpy(),
            "held": (dtypes == held).to_numpy(),
            "other": ((dtypes != held) & (dtypes != "")).to_numpy(),
        }
    )
    first = weights[weights["held"]].groupby("key")[T.STEP].min()
    before = weights[weights["other"]].groupby("key")[T.STEP].min()
    switched = first[first > before.reindex(first.index)]
    return int(switched.min()) if not switched.empty else None


def _held_modules(run: _Run, rows: pd.DataFrame, held: str | None) -> list[str]:
    """The modules whose ``rows`` (``weight_update`` rows) hold their weights in ``held`` (a dtype name)."""
    return run.sort(
        T.texts(rows.loc[T.texts(rows[T.DTYPE]).astype(str) == held, T.MODULE]).astype(str).unique()
    )


def _since_words(rows: pd.DataFrame, since: int | None, fmt: str, held: str | None) -> str:
    """Where a run's weights became ``fmt`` mid-run (``_held_from``): from which step, and what they were."""
    if since is None:
        return ""
    dtypes = T.texts(rows.loc[rows[T.STEP] < since, T.DTYPE]).astype(str)
    before = ", ".join(sorted(set(dtypes) - {held, ""}))
    return (
        f" from step {since} on, where they became {fmt} ({before} before: a model.to(torch.{held}) mid-run, "
        "measured from there)"
    )


def _held_apart_words(
    run: _Run, apart: pd.DataFrame, col: str, fmt: str, since: int | None
) -> tuple[str, dict[str, int]]:
    """The sentence on the updates left out of a pure run's share, those of weights held in another dtype (what
    ``fmt`` would lose of them is a what-if; ``since``: the step the weights became ``fmt``, where those rows are
    of the steps before), and its numbers; "" when there are none."""
    nz = int(_nonzero_updates(apart).sum())
    if not nz:
        return "", {}
    lost = int(apart[col].sum())
    mods = run.sort(apart.loc[_nonzero_updates(apart) > 0, T.MODULE].unique())
    dtypes = ", ".join(sorted(set(T.texts(apart[T.DTYPE]).astype(str))))
    held = (
        f"were held in {dtypes} before step {since}"
        if since is not None and (apart[T.STEP] < since).all()
        else f"are held in {dtypes}"
    )
    return (
        f" Left out: {nz:,} update elements of {len(mods)} module(s) whose weights {held} "
        f"({_listing(mods, run.cfg.max_listed_modules)}), {lost:,} of which would vanish in {fmt} weights.",
        {"held_apart_updates": nz, "held_apart_lost": lost},
    )


def _fp32_stuck_words(
    run: _Run, rows: pd.DataFrame, sampled: bool, weights: pd.Series
) -> tuple[str, dict[str, int]]:
    """For a what-if over fp32 weights: the sentence on those of its updates that did not land in the run's own
    fp32 weights either, and its number (of the sampled updates where ``sampled``: the share is an estimate from a
    sample); "" when there are none. ``fp32_lost_updates`` is named where it fires (its share above
    ``lost_update_warn``): a text names no finding the report does not hold."""
    if T.LOST_UPDATE_HELD not in rows:
        return "", {}
    n = int(rows.loc[T.texts(rows[T.DTYPE]).astype(str) == "float32", T.LOST_UPDATE_HELD].sum())
    if not n:
        return "", {}
    fp32_share = _fp32_lost(run, weights)[3]
    fires = fp32_share is not None and fp32_share > run.cfg.lost_update_warn
    return (
        f" {n:,} of {'the sampled ones' if sampled else 'them'} did not land in the run's own fp32 weights either"
        + (
            " (fp32_lost_updates)."
            if fires
            else "."
            if fp32_share is None
            else f" ({_pct(fp32_share)} of the updates, each parameter at its size: below the "
            f"{_pct(run.cfg.lost_update_warn)} at which precprof warns that fp32 weights do not train)."
        ),
        {"lost_in_fp32": n},
    )


def _fp32_lost(run: _Run, weights: pd.Series) -> tuple[pd.DataFrame, float, float, float | None]:
    """The updates that did not land in weights the run holds in fp32 (``lost_update_held`` of the float32 rows,
    the weights with no training gradient on their step left out): (the rows, lost and intended in the sample,
    the share lost, each parameter at its size, ``_estimated``; None where none is measured).
    ``fp32_lost_updates`` fires where the share is above ``lost_update_warn``. Computed once per run for its
    ``_sample_weights`` (the rule and the bf16 what-if's remedy read it)."""
    if weights is not _sample_weights(run):
        return _fp32_lost_rows(run, weights)
    return run.memo("fp32_lost", lambda: _fp32_lost_rows(run, weights))


def _fp32_lost_rows(run: _Run, weights: pd.Series) -> tuple[pd.DataFrame, float, float, float | None]:
    wu = run.kind(T.WEIGHT_UPDATE)
    if wu.empty or T.LOST_UPDATE_HELD not in wu:
        return wu.iloc[:0], 0.0, 0.0, None
    rows = wu[wu[T.LOST_UPDATE_HELD].notna() & (T.texts(wu[T.DTYPE]).astype(str) == "float32")]
    rows = rows[~_zero_gradient(run, wu)[rows.index]]
    nz = float(_nonzero_updates(rows).sum())
    lost = float(rows[T.LOST_UPDATE_HELD].sum())
    return rows, lost, nz, _estimated(rows, rows[T.LOST_UPDATE_HELD], weights)[2]


def _what_if_remedy(run: _Run, fmt: str, pure: str, weights: pd.Series) -> str:
    """The remedy of a what-if on weights the run holds in fp32: keep them so, unless the updates did not land
    in those fp32 weights either (``fp32_lost_updates`` fires), where fp32 master weights keep nothing: the
    update scale is the cause, as that finding's remedy says."""
    fp32_share = _fp32_lost(run, weights)[3]
    if fp32_share is None or fp32_share <= run.cfg.lost_update_warn:
        return f"Keep fp32 master weights ({fmt} autocast does); do not train {pure}."
    return (
        "Raise the learning rate, or loosen a gradient clip whose max_norm is far below the gradient norm: the "
        f"updates are far too small for the weights, and the fp32 weights this run holds lost {_pct(fp32_share)} "
        "of them too (fp32_lost_updates), so fp32 master weights are no remedy; where updates this small are "
        "meant, Kahan summation or stochastic rounding of the weight update keeps them."
    )


def _intended_said(counts: tuple[float, float, float], sampled_words: str, what: str) -> str:
    """The lost-update findings' first words: how many of the intended weight-update elements (``counts``: lost,
    intended, their share) did ``what`` ("left their bf16 weight unchanged"), estimated over the parameters' sizes
    where ``sampled_words`` says how (``_sampled_words``), else counted."""
    lost, nz, share = counts
    if sampled_words:
        return (
            f"On sampled steps, an estimated {_pct(share)} of the intended weight-update elements (a nonzero "
            f"gradient or a moved weight) {what}{sampled_words}"
        )
    return (
        f"On sampled steps, {int(lost):,} of {int(nz):,} intended weight-update elements ({_pct(share)}; a "
        f"nonzero gradient or a moved weight) {what}"
    )


def _worst_said(worst: list[str], by_share: pd.Series) -> str:
    """ "; worst: fc1 12.5%, ..." of the layers ``_worst`` listed ("" for none)."""
    return "; worst: " + ", ".join(f"{_name(m)} {_pct(float(by_share[m]))}" for m in worst) if worst else ""


def _unfollowed_words(run: _Run) -> tuple[str, dict[str, int]]:
    """Where an optimizer the Profiler was not given stepped the model's parameters on some sampled steps (a new
    optimizer made mid-run without ``prof.use_optimizer``): the words that the updates counted are those of the
    other sampled steps, and their number; ("", {}) where none did."""
    at, classes, count = _unfollowed_steps(run)
    if not at:
        return "", {}
    # the steps listed are the first ``AT_MAX`` of ``count``: the count is exact, the list says how many more
    more = count - min(len(at), 6)
    listed = ", ".join(str(s) for s in at[:6]) + (f" and {more} more" if more else "")
    return (
        f" The updates counted are those of the optimizer the Profiler was given: on {count} sampled steps "
        f"({listed}) an optimizer it was not given ({', '.join(classes) or 'another'}) stepped the model's "
        "parameters, and its updates were not read.",
        {"steps_other_optimizer": count},
    )


def _rule_lost_updates(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    wu = run.kind(T.WEIGHT_UPDATE)
    if wu.empty:
        return
    # a weight whose gradient was zero on the step loses no training update: counted apart
    zero_grad = _zero_gradient(run, wu)
    weights = _sample_weights(run)
    for fmt, col, pure in (
        ("bf16", T.LOST_UPDATE_BF16, "bf16-pure"),
        ("fp16", T.LOST_UPDATE_FP16, "fp16-pure"),
    ):
        held_rows = wu[wu[col].notna()]
        # a pure run: asked for by name, or (the user's own loop) its weights are held in the format
        held = formats.get(fmt).dtype_name
        # (a weight held in the format loses its updates there, whatever the others: a model made bf16 mid-run
        # is measured from that step, ``since``; a few weights held in it, ``few``, are measured apart from the
        # others: a bf16 embedding in an fp32 model)
        since = _held_from(held_rows, held)
        is_pure = (
            run.precision == pure or bool((held_rows[T.DTYPE] == held).mean() > 0.5) or since is not None
        )
        few = [] if is_pure else _held_modules(run, held_rows, held)
        is_pure = is_pure or bool(few)
        # a pure run's share is measured, over the weights it holds in the format: a layer it keeps in fp32
        # moved, and its count is a what-if, said apart
        apart = _held_apart(held_rows, held) if is_pure else pd.Series(False, index=held_rows.index)
        idle = zero_grad[held_rows.index] & ~apart
        rows = held_rows[~idle & ~apart]
        idle_words, idle_nums = _zero_gradient_words(run, held_rows[idle], col, fmt, is_pure)
        apart_words, apart_nums = _held_apart_words(run, held_rows[apart], col, fmt, since)
        if rows.empty:
            continue
        nz = float(_nonzero_updates(rows).sum())
        lost = float(rows[col].sum())
        # the model's share, each parameter's sample counted at the parameter's size
        share = _estimated(rows, rows[col], weights)[2]
        if share is None:
            continue
        sampled_words, sampled_method, sampled_nums = _sampled_words(run, rows, lost, nz, weights)
        nonfinite_words, nonfinite_nums = _nonfinite_words(held_rows, run)
        fp32_words, fp32_nums = (
            _fp32_stuck_words(run, rows, bool(sampled_words), weights) if not is_pure else ("", {})
        )
        unfollowed_words, unfollowed_nums = _unfollowed_words(run)
        by_share = _by_module(rows, rows[col], weights)
        worst = _worst(run, by_share, cfg.lost_update_warn, cfg.max_listed_modules)
        resolution = "2^-8" if fmt == "bf16" else "2^-11"
        # weights held in the format in a loop that is not the pure mode by name: a model loaded in bf16 and
        # trained under bf16 autocast (the HF Trainer's bf16=True on from_pretrained(..., dtype=torch.bfloat16))
        held_under_autocast = (
            is_pure and not few and run.precision != pure and bool(run.autocast.get("enabled"))
        )
        # the parameters of a run holding its weights in the format that lose most of their own updates: they
        # hardly train, a warning where the model's share is under the line (an fp16-pure model's LayerNorm
        # weights at lr 5e-5); above it, named where their layer's share hides them (a norm's weight 100%, its
        # bias 0%: "ln_1 50.2%", gpt-nano fp16-pure at lr 5e-5)
        under = share <= cfg.lost_update_warn
        stuck = _stuck_params(run, rows, rows[col], cfg.lost_update_param_warn) if is_pure else []
        if not under:
            stuck = [t for t in stuck if t[2] - float(by_share.get(t[0], t[2])) >= 0.2]
        # With fp32 master weights (autocast, fp32) this is a what-if: it only hurts a run that holds its
        # weights in the format, and it is the reason to keep fp32 master weights.
        if share > cfg.lost_update_warn and is_pure:
            severity = CRITICAL
        elif fmt == "fp16" and share <= cfg.lost_update_warn and not is_pure:
            # fp16 master weights are rare: the what-if is only worth a line when it loses updates; a run that
            # holds its weights in fp16 is told what it loses (an fp16-pure GPT-NeoX lost 0.1-1% a step, unsaid)
            continue
        else:
            severity = WARNING if stuck else INFO
        if stuck:
            worst = list(dict.fromkeys([*(m for m, _, _ in stuck), *worst]))[: cfg.max_listed_modules]
        # an optimizer that carries what a step could not add (Kahan summation, stochastic rounding) loses none
        carry = carried_updates.carriers(run.summary.get(T.SUMMARY_CAPTURE) or {}, held or "")
        if is_pure and carry.all_carried:
            _add_carried(run, plan, fmt, rows, held_rows, weights, (lost, nz, share), carry, since)
            continue
        if fmt == "bf16" and severity == CRITICAL:
            plan.bf16_held_lost = (few, share)
        plan.add(
            Finding(
                f"{fmt}_lost_updates",
                severity,
                f"{_pct(share)} of {'the finite ' if nonfinite_nums else ''}weight updates vanish with {fmt} master "
                "weights",
                (
                    _intended_said((lost, nz, share), sampled_words, f"left their {fmt} weight unchanged")
                    + f": the update is smaller than half a {fmt} ulp of the weight (relative resolution "
                    f"{resolution}) and this "
                    + (
                        f"run holds its weights in {fmt} under {fmt} autocast, which casts the inputs of ops and keeps no "
                        f"fp32 copy of a {fmt} weight"
                        if held_under_autocast
                        else f"run holds these weights in {fmt} ({_listing(few, cfg.max_listed_modules)})"
                        if few
                        else f"{pure + ' ' if since is None else ''}run holds its weights in {fmt}"
                    )
                    + _since_words(held_rows, since, fmt, held)
                    if is_pure
                    else (
                        f"On sampled steps, an estimated {_pct(share)} of the intended weight-update elements"
                        f"{sampled_words}"
                        if sampled_words
                        else f"On sampled steps, {int(lost):,} of {int(nz):,} intended weight-update elements "
                        f"({_pct(share)})"
                    )
                    + f" are smaller than half a {fmt} ulp of their weight (relative resolution "
                    f"{resolution}) and would be lost if the weights were held in {fmt}"
                )
                + _worst_said([m for m in worst if m in by_share.index], by_share)
                + _stuck_said(stuck, fmt, resolution, cfg.max_listed_modules)
                + ". Mixed Precision Training (2018) keeps an fp32 master copy for this reason."
                + (_carry_caveat(carry) if is_pure else "")
                + fp32_words
                + nonfinite_words
                + idle_words
                + apart_words
                + unfollowed_words,
                (
                    f"Hold the weights in fp32 and let {fmt} autocast cast the matmuls: a model built or loaded in "
                    f"{fmt} (from_pretrained(..., dtype=torch.{held})) has no fp32 copy of its weights, under "
                    "autocast too."
                    if held_under_autocast
                    else f"Hold {_listing(few, cfg.max_listed_modules)} in fp32 too (.float() before the optimizer "
                    f"is made; {fmt} autocast still casts its matmuls): a weight held in {fmt} has no fp32 copy."
                    if few
                    else f"Keep fp32 master weights ({fmt} autocast does); do not train {pure}."
                    if is_pure
                    else _what_if_remedy(run, fmt, pure, weights)
                ),
                modules=worst,
                numbers={
                    "lost": int(lost),
                    "nonzero_updates": int(nz),
                    "share": share,
                    **sampled_nums,
                    **nonfinite_nums,
                    **fp32_nums,
                    **idle_nums,
                    **apart_nums,
                    **unfollowed_nums,
                    **({"held_from_step": since} if since is not None and is_pure else {}),
                    **(
                        {"params_hardly_trained": len(stuck), "param_share_max": stuck[0][2]} if stuck else {}
                    ),
                },
                method=sampled_method,
            )
        )


def _carry_caveat(carry: carried_updates.Carriers) -> str:
    """Where some of the optimizers holding the weights carry what a step could not add and others do not, or one
    keeps a state that may (an unknown entry of each weight's shape, not measured): the sentences that say so; ""
    else."""
    said = ""
    if carry.carried:
        said += (
            " Of the optimizers holding these weights, "
            + "; ".join(f"{cls} {how}" for cls, how in carry.carried)
            + f" (its updates are carried, not lost); {', '.join(dict.fromkeys(carry.plain))} does not, and the "
            "share counts both."
        )
    for cls, key, measured in carry.suspects:
        said += (
            f" {cls} keeps a per-parameter state of each weight's shape that is none of torch's optimizer moments "
            f"('{key}'): if it holds the remainder of each update (Kahan summation), these updates are carried to "
            f"later steps, not lost; precprof could not measure it ({measured})."
        )
    for cls, key, measured in carry.lookalikes:
        said += (
            f" {cls} keeps a per-parameter state '{key}' that behaves as the remainder of each update would (Kahan "
            f"summation: {measured}): if it is one, these updates are carried to later steps, not lost; its name "
            "does not say so, and an optimizer's first moment of gradients far below half an ulp of their weights "
            "behaves so too (a name with 'comp', 'kahan', 'carry', 'remainder', 'residual' or 'error' tells "
            "precprof it is a remainder)."
        )
    return said


def _add_carried(
    run: _Run,
    plan: _Plan,
    fmt: str,
    rows: pd.DataFrame,
    held_rows: pd.DataFrame,
    weights: pd.Series,
    counts: tuple[float, float, float],
    carry: carried_updates.Carriers,
    since: int | None,
) -> None:
    """``{fmt}_updates_carried``: a run that holds its weights in ``fmt`` with optimizers that all carry what a step
    could not add (``carried_updates``): the share of intended updates that did not move their weight on their step
    is said, as waiting, not lost, with how each optimizer carries them; no fp32 master weights to add."""
    cfg = run.cfg
    lost, nz, share = counts
    sampled_words, sampled_method, sampled_nums = _sampled_words(
        run, rows, lost, nz, weights, verb="did not move their weight on their step"
    )
    nonfinite_words, nonfinite_nums = _nonfinite_words(held_rows, run)
    by_share = _by_module(rows, rows[T.LOST_UPDATE_BF16 if fmt == "bf16" else T.LOST_UPDATE_FP16], weights)
    worst = _worst(run, by_share, cfg.lost_update_warn, cfg.max_listed_modules)
    classes = ", ".join(dict.fromkeys(cls for cls, _ in carry.carried))
    held = formats.get(fmt).dtype_name
    plan.add(
        Finding(
            f"{fmt}_updates_carried",
            INFO,
            f"{_pct(share)} of weight updates did not move their {fmt} weight on their step ({classes} carries "
            "them)",
            _intended_said(counts, sampled_words, f"left their {fmt} weight unchanged on their step")
            + f": the update is smaller than half a {fmt} ulp of the weight (relative resolution "
            f"{'2^-8' if fmt == 'bf16' else '2^-11'}) and this run holds its weights in {fmt}"
            + _since_words(held_rows, since, fmt, held)
            + _worst_said(worst, by_share)
            + ". They are not lost: "
            + "; ".join(f"{cls} {how}" for cls, how in carry.carried)
            + ". The share counts the steps on which an update did not move its weight, not updates lost."
            + nonfinite_words,
            f"None needed for these updates: {classes} carries them to later steps (fp32 master weights would land "
            "each one on its own step).",
            modules=worst,
            numbers={
                "waiting": int(lost),
                "nonzero_updates": int(nz),
                "carried_share": share,
                **sampled_nums,
                **nonfinite_nums,
                **({"held_from_step": since} if since is not None else {}),
            },
            method=sampled_method,
        )
    )


def _adam_like(run: _Run) -> bool:
    """Whether the run's optimizers are Adams (the capture summary's optimizer class: "AdamW", "Muon + AdamW" counts
    only where every one is)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    settings = capture.get("optimizer") if isinstance(capture, dict) else None
    cls = settings.get("class") if isinstance(settings, dict) else None
    return isinstance(cls, str) and all("Adam" in part for part in cls.split(" + "))


def _rule_fp32_lost_updates(run: _Run, plan: _Plan) -> None:
    """Intended updates that did not land in weights the run holds in fp32 (``lost_update_held`` of the float32
    rows: measured, where ``bf16_lost_updates`` of these weights is a what-if): updates below half an fp32 ulp
    of their weight, from a learning rate or a gradient clip far too small for the weights. The weights with no
    training gradient on their step are left out, as in ``_rule_lost_updates``."""
    cfg = run.cfg
    weights = _sample_weights(run)
    rows, lost, nz, share = _fp32_lost(run, weights)
    if share is None or share <= cfg.lost_update_warn:
        return
    by_share = _by_module(rows, rows[T.LOST_UPDATE_HELD], weights)
    sampled_words, sampled_method, sampled_nums = _sampled_words(run, rows, lost, nz, weights)
    worst = _worst(run, by_share, cfg.lost_update_warn, cfg.max_listed_modules)
    ratios = update_ratio.summary(run.layers) or {}
    median = ratios.get("ratio_median")
    plan.add(
        Finding(
            "fp32_lost_updates",
            WARNING,
            f"{_pct(share)} of weight updates do not change the run's fp32 weights",
            _intended_said((lost, nz, share), sampled_words, "left their fp32 weight unchanged")
            + ", measured in the weights this run holds: the update is smaller than half an fp32 ulp of the weight "
            "(relative resolution 2^-24), so "
            "these weights do not train"
            + _worst_said(worst, by_share)
            + (
                f". The update-to-weight ratio ||dw|| / ||w|| has a median of {median:.2g} over the layers"
                # Adam's yardstick, for a run that trains with an Adam (an SGD run's ratio follows its learning rate)
                + (", where about 1e-3 is usual for Adam-like optimizers." if _adam_like(run) else ".")
                if median is not None
                else "."
            ),
            "The updates are far too small for the weights: raise the learning rate, or loosen a gradient clip "
            "whose max_norm is far below the gradient norm (the steps' grad_norm is the norm before the clip). "
            "Weights much larger than their updates (an initialization's scale, a loss scaled down) do the same.",
            modules=worst,
            numbers={
                "lost": int(lost),
                "nonzero_updates": int(nz),
                "share": share,
                **sampled_nums,
                **({"ratio_median": float(median)} if median is not None else {}),
            },
            method=sampled_method,
        )
    )


def bf16_gradient_underflow(run: _Run) -> tuple[float, float, float | None]:
    """(values, nonzero values, their share) of the run's gradients that surely underflow bf16, which has no loss
    scale: whole binades below 2^-133."""
    counts = run.exponent_counts(*T.GRADIENT_KINDS)
    total = float(counts.sum())
    sure, _ = _shifted_underflow(counts, BF16, 0)
    return sure, total, _share(sure, total)


def _rule_bf16_range(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    sure, total, share = bf16_gradient_underflow(run)
    acts = run.kind(T.ACTIVATION)
    over = acts[(acts[T.overflow_col("bf16")] > 0) & ~_dtype_has(acts, "bfloat16")]
    if share is not None and share > cfg.bf16_underflow_block:
        plan.bf16_block.append(f"{_pct(share)} of gradient values underflow bf16 (below 2^-133)")
        plan.add(
            Finding(
                "bf16_gradient_underflow",
                CRITICAL,
                f"{_pct(share)} of gradients underflow bf16",
                f"{int(sure):,} of {int(total):,} nonzero gradient values are below 2^-134 and would become "
                "0 in bf16 (it has no loss scaling).",
                # the fp16 rules ran first: where they rule fp16 out too, only fp32 is left
                "Use fp32 for this model; fp16 is ruled out too: " + "; ".join(plan.fp16_block) + "."
                if plan.fp16_block
                else "Use fp16 with a loss scale or fp32 for this model.",
                numbers={"underflow_values": int(sure), "nonzero_values": int(total), "share": share},
            )
        )
    if not over.empty:
        mods = run.sort(_innermost(over[T.MODULE]))
        plan.keep_bf16 = mods
        plan.bf16_block.append(f"activations of {_listing(mods, 4)} overflow bf16")
        plan.add(
            Finding(
                "bf16_activation_overflow",
                CRITICAL,
                "Activations overflow bf16",
                f"{int(over[T.overflow_col('bf16')].sum()):,} activation values in "
                f"{_listing(mods, cfg.max_listed_modules)} exceed bf16's largest value (3.39e38).",
                "Find the module producing these values: they are near fp32's limit too.",
                modules=mods,
                numbers={"values": int(over[T.overflow_col("bf16")].sum())},
            )
        )


def _rule_steps_without_update(run: _Run, plan: _Plan) -> None:
    """Sampled steps with weight gradients and no step of the optimizer the Profiler follows, in a run whose
    optimizer steps were seen (``weight_update`` rows on other sampled steps). Where an optimizer it was not given
    stepped the model's parameters in them (the capture's ``loop_order``: a new optimizer made mid-run, after
    unfreezing layers, without ``prof.use_optimizer``), that is the cause, said with its remedy. Else
    ``prof.step()`` called more often than the optimizer steps, once per micro-batch under gradient accumulation:
    fires when it is most of the sampled steps that could tell (a loop that steps its optimizer every other step
    is the same mistake). A step the loss scaler skipped (no optimizer step by design) and a step a crash cut off
    are left out."""
    idle, told = _steps_without_update(run)
    at, classes, count = _unfollowed_steps(run)
    cut = count > len(at)
    listed = set(at)
    other = [s for s in idle if s in listed]
    # past the steps the capture listed (the first AT_MAX), a step's cause is not known: neither is said of it
    unknown = [s for s in idle if cut and at and s > at[-1]]
    rest = [s for s in idle if s not in listed and s not in unknown]
    could_tell = [s for s in told if s not in listed and s not in unknown]
    accumulation = len(rest) >= 2 and len(rest) * 2 >= len(could_tell)
    if not other and not accumulation:
        if at:  # (another optimizer stepped beside the one given: two optimizers, one handed over)
            plan.add(_beside_given(run, at, classes, count))
        return
    accumulation_said = (
        f"On {len(rest)} of {len(could_tell)} sampled steps with weight gradients "
        f"({_listed([str(s) for s in rest], 6)}) the optimizer did not step, and the loss scaler skipped none of "
        "them. precprof's step is the optimizer's: called once per micro-batch (gradient accumulation), each of "
        "its steps is a micro-batch, the weight gradients of those steps are partial sums, and the step counts, "
        "the loss curve and the sampling budget are per micro-batch."
        + (
            " The optimizer stepped on none of the sampled steps, so no weight update was read: the lost-update "
            "shares and the update-to-weight ratios are not measured (not zero), whatever the weights' format (a "
            "sampling interval that is a multiple of the micro-batches per optimizer step samples the same "
            "micro-batch of each)."
            if not _updated_steps(run)
            else ""
        )
    )
    accumulation_fix = (
        "Call prof.step() once per optimizer step, after optimizer.step() (pass the mean loss of its "
        "micro-batches)."
    )
    numbers: dict[str, Number] = {"steps_without_update": len(idle), "sampled_steps_with_grads": len(told)}
    if not other:
        plan.add(
            Finding(
                "steps_without_update",
                WARNING,
                "prof.step() is called more often than the optimizer steps",
                accumulation_said,
                accumulation_fix,
                numbers=numbers,
            )
        )
        return
    given = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("optimizer") or {}
    name = given.get("class") if isinstance(given, dict) else None
    # (the new optimizer is often of the old one's class: "another AdamW")
    others = f"another {name}" if name and classes == [name] else ", ".join(classes) or "another optimizer"
    plan.add(
        Finding(
            "steps_without_update",
            WARNING,
            "An optimizer the Profiler was not given stepped the model's parameters",
            f"On {len(other)} of {len(told)} sampled steps with weight gradients ({_listed([str(s) for s in other], 6)})"
            f" the optimizer the Profiler was given{f' ({name})' if name else ''} did not step, and an optimizer it "
            f"was not given ({others}) stepped the model's parameters, as a new optimizer made mid-run (after "
            "unfreezing layers, say) and not handed to the Profiler does. Its updates were not read: the weight-update rows, "
            "the lost-update shares and the update-to-weight ratios are of the sampled steps the optimizer it was "
            "given stepped, and the memory table counts the states of the optimizer the Profiler was given, not the other's."
            + (f" {accumulation_said}" if accumulation else "")
            + (
                f" Past sampled step {at[-1]} the capture lists no more steps: {len(unknown)} sampled "
                + (
                    "step after it without an update is"
                    if len(unknown) == 1
                    else "steps after it without an update are"
                )
                + " not judged."
                if unknown
                else ""
            ),
            "Call prof.use_optimizer(new_opt) once the new optimizer is made, before its first step()."
            + (f" {accumulation_fix}" if accumulation else ""),
            numbers={**numbers, "steps_other_optimizer": len(other)},
        )
    )


def _weights_seen(
    layers: pd.DataFrame, hist: pd.DataFrame, candidates: set[tuple[str, str]]
) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """Of the ``candidates`` (module, param): those whose weights changed between the sampled steps that read them
    (their largest or smallest nonzero magnitude, exact, or their exponent histogram): something moved them, an
    optimizer the Profiler does not follow, a hand-written update (``p.data -= lr * p.grad``), an average;
    whatever holds them, they learn (an embedding stepped by hand moves only the batch's rows: its extremes stay,
    its binades do not). And those whose weights two sampled steps or more read."""
    if not candidates:
        return set(), set()
    modules = {
        m for m, _ in candidates
    }  # (a large run's histograms hold millions of rows: the candidates' only)
    w = layers[(layers[T.TENSOR] == T.WEIGHT) & layers[T.MODULE].isin(modules)]
    w = pd.DataFrame(
        {
            "key": list(zip(T.texts(w[T.MODULE]), T.texts(w[T.PARAM]), strict=True)),
            T.STEP: w[T.STEP].to_numpy(),
            T.ABSMAX: pd.to_numeric(w[T.ABSMAX], errors="coerce").to_numpy(),
            T.ABSMIN: pd.to_numeric(w[T.ABSMIN], errors="coerce").to_numpy(),
        }
    )
    w = w[w["key"].isin(candidates)]
    n = w.groupby("key")[[T.ABSMAX, T.ABSMIN]].nunique(dropna=False)
    moved = set(n.index[(n > 1).any(axis=1)])
    steps = w.groupby("key")[T.STEP].nunique()
    h = hist[(hist[T.TENSOR] == T.WEIGHT) & hist[T.MODULE].isin(modules)] if T.TENSOR in hist else hist
    if not h.empty:
        binades = pd.DataFrame(
            {
                "key": list(zip(T.texts(h[T.MODULE]), T.texts(h[T.PARAM]), strict=True)),
                T.STEP: h[T.STEP].to_numpy(),
                T.EXPONENT: h[T.EXPONENT].to_numpy(),
                T.COUNT: h[T.COUNT].to_numpy(),
            }
        ).sort_values(T.EXPONENT, kind="stable")
        # each step's histogram as one value; a parameter whose steps hold more than one moved
        each = binades.groupby(["key", T.STEP])[[T.EXPONENT, T.COUNT]].apply(
            lambda g: tuple(map(tuple, g.to_numpy()))
        )
        kinds = each.groupby(level=0).nunique()
        moved |= set(kinds.index[kinds > 1])
    return moved & candidates, set(steps.index[steps > 1])


def _beside_given(run: _Run, at: list[int], classes: list[str], count: int) -> Finding:
    """An optimizer the Profiler was not given stepped the model's parameters on sampled steps the one it was
    given stepped too (a loop of two optimizers, the matrices' and the vectors', that handed one over): no
    finding said so, and the page's remedy was for a new optimizer made mid-run (tester t2)."""
    given = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("optimizer") or {}
    name = given.get("class") if isinstance(given, dict) else None
    others = f"another {name}" if name and classes == [name] else ", ".join(classes) or "another optimizer"
    more = count - min(len(at), 6)
    listed = ", ".join(str(s) for s in at[:6]) + (f" and {more} more" if more else "")
    return Finding(
        "steps_without_update",
        WARNING,
        "An optimizer the Profiler was not given stepped the model's parameters",
        f"On {count} sampled step{'s' if count != 1 else ''} ({listed}) an optimizer the Profiler was not given "
        f"({others}) stepped the model's parameters beside the one it was given{f' ({name})' if name else ''}. "
        "Its updates were not read: the weight-update rows, the lost-update shares and the update-to-weight ratios "
        "leave out the parameters it steps, and the memory table counts the states of the optimizer the Profiler "
        "was given alone.",
        "Give the Profiler every optimizer the loop steps: Profiler(model, optimizer=[opt1, opt2]) "
        "(prof.use_optimizer([...]) for one made later).",
        numbers={"steps_other_optimizer": count},
    )


def _rule_gradients_not_applied(run: _Run, plan: _Plan) -> None:
    """Parameters with a gradient on sampled steps the optimizer the Profiler follows stepped, whose update no
    sampled step read (no ``weight_update`` row of theirs in the run, the update sample not having skipped them),
    and that no optimizer it follows holds, so that they never move: those the capture found trainable and in no
    param group of the optimizers it follows on any sampled step they stepped (``capture.trainable_not_in_optimizer``:
    a head or an adapter added to the model after the optimizer was built, param groups that leave a submodule
    out), and those unfrozen during the run (``capture.modules[].trainable_changed``) with no update read, for a
    run recorded before the capture said which it held. A layer unfrozen after the optimizer was built from the
    trainable parameters (the HF Trainer's ``create_optimizer``, ``filter(lambda p: p.requires_grad, ...)``) gets
    gradients and no update: it was said to have trained (tester t3). Left to ``steps_without_update`` where an
    optimizer the Profiler was not given stepped the model's parameters (they may be its)."""
    layers = run.layers
    updated = _updated_steps(run)
    if layers.empty or not updated or _unfollowed_steps(run)[0]:
        return
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    since = (capture.get("updates_from") or {}).get("step")
    skipped = {
        (str(s.get("module")), str(s.get("param")))
        for s in capture.get("skipped_tensors") or []
        if isinstance(s, dict) and s.get("tensor") == T.WEIGHT_UPDATE
    }
    upd = layers[layers[T.TENSOR] == T.WEIGHT_UPDATE]
    held = set(zip(T.texts(upd[T.MODULE]), T.texts(upd[T.PARAM]), strict=True)) | skipped
    grads = layers[
        (layers[T.TENSOR] == T.WEIGHT_GRAD) & (pd.to_numeric(layers[T.CALLS], errors="coerce") > 0)
    ]
    steps = grads[T.STEP].astype(int)
    grads = grads[steps.isin(updated) & (steps >= since if isinstance(since, int) else True)]
    # those the capture found in no param group of the optimizers it follows (a head added after the optimizer
    # was built), and those whose requires_grad changed during the run, as the capture saw it (the unfrozen ones)
    never = T.not_in_optimizer(run.summary)
    changed = {(m, str(p)) for m, ps in T.trainable_changed(run.summary).items() for p in ps}
    keys = list(zip(T.texts(grads[T.MODULE]), T.texts(grads[T.PARAM]), strict=True))
    candidates = {k for k in keys if (k in never or k in changed) and k not in held}
    moved, still = _weights_seen(layers, run.hist, candidates)
    loose = grads[[k in candidates and k not in moved for k in keys]]
    if loose.empty:
        return
    modules = run.sort(dict.fromkeys(T.texts(loose[T.MODULE])))
    params = sorted(
        {(str(m), str(p)) for m, p in zip(T.texts(loose[T.MODULE]), T.texts(loose[T.PARAM]), strict=True)}
    )
    at = sorted(set(loose[T.STEP].astype(int)))
    lim = run.cfg.max_listed_modules
    # (one whose requires_grad changed is said unfrozen, the capture's word or not)
    unfrozen = run.sort(dict.fromkeys(m for m, p in params if (m, p) in changed))
    added = run.sort(dict.fromkeys(m for m, p in params if (m, p) not in changed))
    both = bool(added and unfrozen)
    added_said = (
        (f"Those of {_listing(added, lim)} were" if both else "They were")
        + " trainable, and in none of the optimizer's param groups on any sampled step it stepped: a "
        "module added to the model after the optimizer was built (a new head, an adapter), param groups that "
        "leave a submodule out (the Hugging Face Trainer builds its optimizer when train() begins), or layers "
        "meant to stay fixed but not frozen (a backbone under linear probing) do this."
    )
    unfrozen_said = (
        (f"Those of {_listing(unfrozen, lim)} were unfrozen during the run: a" if both else "A")
        + " layer unfrozen after the optimizer was built from the trainable parameters does this (the Hugging "
        "Face Trainer's create_optimizer keeps those with requires_grad at the start; so does "
        "filter(lambda p: p.requires_grad, model.parameters()))."
    )
    plan.add(
        Finding(
            "gradients_not_applied",
            WARNING,
            f"{len(params)} parameter(s) got gradients and no update: no optimizer the Profiler follows holds them",
            f"On {len(at)} sampled step(s) the optimizer stepped ({_listed([str(s) for s in at], 6)}), the "
            f"parameters of {_listing(modules, lim)} had a gradient, and no sampled step updated them: no "
            "optimizer the Profiler was given holds them"
            + (
                ", and their weights' extremes and exponent histogram were the same on every sampled step that "
                "read them"
                if all(k in still for k in params)
                else ""
            )
            + ", so they do not learn whatever their gradient. "
            + " ".join(s for s, cause in ((added_said, added), (unfrozen_said, unfrozen)) if cause),
            "If they are meant to learn, add them to the optimizer (optimizer.add_param_group({'params': [...]})) "
            "when you "
            + ("add the module or unfreeze them" if both else "add the module" if added else "unfreeze them")
            + ", or build the optimizer once the model is complete, over all its parameters (frozen ones get no "
            "gradient and no update); if they are meant to stay fixed, freeze them (requires_grad_(False)): their "
            "gradients cost time and memory and are never used; if another optimizer steps them, give it to the "
            "Profiler too (prof.use_optimizer).",
            modules=modules,
            numbers={"parameters": len(params), "steps": len(at)},
        )
    )

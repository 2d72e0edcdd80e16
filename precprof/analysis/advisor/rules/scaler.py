"""The dynamic loss scaler: skipped steps and thrashing."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof.analysis.advisor.evidence import (
    _optimizer_named,
    _Plan,
    _Run,
    _skipped_optimizers,
    _static_scale,
    _steps_without_update,
)
from precprof.analysis.advisor.model import CRITICAL, INFO, WARNING, Finding
from precprof.analysis.advisor.text import _g, _listed, _pow2, _scale
from precprof.modes import FP64


def _said(x: float) -> str:
    """A loss scale in words: "2^16 (65536)" for a power of two, the number otherwise."""
    e = math.log2(x) if x > 0 and math.isfinite(x) else math.nan
    return _pow2(int(e)) if e == e and e == int(e) else _g(x)


# the floating-point dtypes a gradient is held in, by the largest finite value they hold (the first to overflow
# among a run's gradients is the narrowest), with the names the advisor's sentences use
_GRADIENT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


def _gradient_dtype(run: _Run, mode: str) -> str:
    """The dtype a scaler's scaled gradients overflow first: the narrowest of the recorded weight gradients'
    dtypes (the parameters' ``.grad``, what ``scaler.unscale_`` checks), fp64 in an fp64 run and fp32 otherwise
    when no weight gradient was recorded (bf16-pure's are bf16)."""
    grads = run.kind(T.WEIGHT_GRAD)
    seen = (
        {d for v in grads[T.DTYPE].dropna().unique() for d in str(v).split("|")} if not grads.empty else set()
    )
    known = [name for dtype, name in _GRADIENT_DTYPES.items() if dtype in seen]
    if known:
        return known[0]
    return {FP64: "fp64", "bf16-pure": "bf16"}.get(mode, "fp32")


def _rule_scaler_unneeded(run: _Run, plan: _Plan) -> None:
    """A loss scale in a run that did not train in fp16 (bf16, fp8 or fp32, as asked for or as the profiler saw
    it train): those formats have fp32's exponent range, so the gradients need no scaling. The scaler's scale
    only grows (by growth_factor every growth_interval steps without an inf) until the gradients' own dtype
    overflows (fp32, bf16 in a bf16-pure run, fp64 in an fp64 one: ``_gradient_dtype``); each step pays its inf
    check's host sync."""
    mode = run.precision_trained
    if not mode or mode.startswith("fp16") or run.steps.empty or T.LOSS_SCALE not in run.steps:
        return
    scale = run.steps.sort_values(T.STEP)[T.LOSS_SCALE].astype(float)
    scale = scale[scale.map(math.isfinite) & (scale > 0)]
    if scale.empty or (scale == 1.0).all():
        return
    first, last = float(scale.iloc[0]), float(scale.iloc[-1])
    how = (
        f": the scale started at {_said(first)} and grew to {_said(last)} over {len(scale):,} steps"
        if last > first
        else f" by {_said(first)}" + (f" at first, {_said(last)} at the end" if last != first else "")
    )
    plan.add(
        Finding(
            "scaler_unneeded",
            INFO,
            f"A loss scaler in a {mode} run: it has nothing to do",
            f"This run trained in {mode} and scaled its loss{how}. {mode} has "
            + ("a wider exponent range than fp32's" if mode == FP64 else "fp32's exponent range")
            + ": its "
            "gradients neither underflow nor overflow the way fp16's do. A dynamic scaler's scale only grows "
            f"while no gradient overflows, until the scaled gradients overflow {_gradient_dtype(run, mode)} "
            "itself and steps are skipped; each step pays the scaler's inf check, a host sync.",
            "Drop the GradScaler (or GradScaler(enabled=False)): scaler.scale(loss) becomes loss, "
            "scaler.step(opt) becomes opt.step().",
            numbers={"start_scale": first, "last_scale": last},
        )
    )


def _went_through(n: int, spikes: int, rec: str) -> str:
    """Where ``n`` skips that were neither the start's fault nor growth probes happened: at or below the recommended
    scale ``rec``, or (``spikes`` of them) above it but at or below a scale earlier steps had gone through at (the
    scaler had not grown past every scale that worked: no probe, and no fault of the start)."""
    below = "at or below a scale earlier steps had gone through at"
    where = (
        f"at or below {rec}"
        if not spikes
        else f"above {rec} but {below}"
        if spikes == n
        else f"at or below {rec} ({n - spikes}) or above it, {below} ({spikes})"
    )
    return f"happened {where} (gradient spikes, or non-finite values that no scale fixes)"


def _probes(n: int, settled: float | None) -> str:
    """The words for skips a dynamic scaler grew into after its first step that went through."""
    return (
        f"{n} came after the scaler grew past {settled:g}, where its first step went through: growth probing "
        "its ceiling, which a lower start does not avoid (the scale grows back)"
    )


def _growths(st: pd.DataFrame) -> tuple[int, int]:
    """How often the scale grew over ``st``'s steps, and how many of those growths cost a step: a step was skipped
    at the grown scale before it changed again (a growth the next growth followed, or the run's end, cost none;
    a skip before any growth is not one's)."""
    scale = st[T.LOSS_SCALE].reset_index(drop=True)
    skipped = st[T.SKIPPED].astype(bool).reset_index(drop=True)
    run = (scale != scale.shift()).cumsum()  # one number per stretch of steps at one scale
    grown = scale.diff() > 0
    grown_runs = set(run[grown])
    costly = {r for r in run[skipped] if r in grown_runs}
    return len(grown_runs), len(costly)


def _scale_resets(st: pd.DataFrame) -> list[tuple[int, float, float]]:
    """(step, scale of the step before, scale at it) for each step a resumed run restarted at (``T.RESUMED``)
    whose loss scale went back to the run's first one, only where the steps table shows it plainly: up from
    the step before by more than the scaler moves it (a skip lowers it, a growth at most doubles it). A
    checkpoint without the GradScaler's state restarts the scaler at its init_scale, and the steps it had
    backed off through overflow again."""
    if len(st) < 2 or not T.flags(st[T.RESUMED]).any():
        return []
    scale = pd.to_numeric(st[T.LOSS_SCALE], errors="coerce").to_numpy(dtype=float)
    skipped = T.flags(st[T.SKIPPED]).to_numpy()
    out = []
    for i in np.flatnonzero(T.flags(st[T.RESUMED]).to_numpy()):
        before, after = scale[i - 1] if i else math.nan, scale[i]
        most = before if i and skipped[i - 1] else 2 * before
        if i and math.isfinite(after) and after == scale[0] and after > most:
            out.append((int(st[T.STEP].iloc[i]), float(before), float(after)))
    return out


def _resets_said(resets: list[tuple[int, float, float]], st: pd.DataFrame) -> str:
    """The sentence saying where a resumed run's loss scale went back to its initial one (``_scale_resets``)."""
    first = resets[0]
    at = (
        f"the resume at step {first[0]}"
        if len(resets) == 1
        else f"the resumes at steps {', '.join(str(r[0]) for r in resets)}"
    )
    # the skips from there at a scale above the one it had backed off to: backing off again from where it started
    later = st[(st[T.STEP] >= first[0]) & T.flags(st[T.SKIPPED])]
    again = int((pd.to_numeric(later[T.LOSS_SCALE], errors="coerce") > first[1]).sum())
    return (
        f" At {at} the loss scale went back to its initial {_said(first[2])}, from {_said(first[1])} on the "
        "step before: the checkpoint held no GradScaler state, so the scaler started over"
        + (
            f", and {again} step{'s were' if again != 1 else ' was'} skipped again at scales it had already "
            "backed off from"
            if again
            else ""
        )
        + "."
    )


def _never_stepped(st: pd.DataFrame, n: int, model: int, rec: float, bound: bool, gmax: float | None) -> str:
    """The words for a run none of whose ``n`` optimizer steps went through: that it did not train, and why by
    its numbers: the model's own nan/inf (``model`` of the skips: no scale fixes them), or a scale still above
    the recommended one ``rec`` (the most a start can be, with ``bound``) on the last step it reached."""
    scale = pd.to_numeric(st[T.LOSS_SCALE], errors="coerce")
    start, lowest = float(scale.iloc[0]), float(scale.min())
    head = (
        f" Not one optimizer step of the {n:,} went through: the weights never changed, the model did not "
        "train, and every gradient measured is of its initial weights."
    )
    if model == n:
        return (
            head + " Every skip came with nan/inf from the model itself: the gradients are nan at any scale."
        )
    largest = (
        f" for the largest gradient the run saw ({'at least ' if bound else ''}{_g(gmax)})" if gmax else ""
    )
    limit = (
        f"{_said(rec)}, {'the most a start can be' if bound else 'the recommended initial scale'}{largest}"
    )
    if lowest > rec:
        how = (
            f"a static scale of {_said(start)} never backs off"
            if _static_scale(st)
            else f"the scaler halved it on each skip, from {_said(start)} down to {_said(lowest)}"
        )
        cause = f" The loss scale started too high: {how}, still above {limit}."
    else:
        cause = (
            f" The gradients overflowed at every scale the run tried, down to {_said(lowest)}, at or below "
            f"{limit}: profile a few steps at --loss-scale static:1 to see whether they are finite at "
            "any scale."
        )
    if model:
        cause += f" {model} of the skips came with nan/inf from the model itself, which no scale avoids."
    return head + cause


def _nonfinite_losses(st: pd.DataFrame) -> dict[int, float]:
    """The steps of ``st`` whose loss the loop passed and was nan or inf, with their loss. Only a steps table that
    marks the steps without a loss (``NO_LOSS``) tells a nan loss, written as a null, from no loss at all."""
    if st.empty or T.NO_LOSS not in st or T.LOSS not in st:
        return {}
    given = T.given_losses(T.finished_steps(st))
    loss = pd.to_numeric(given[T.LOSS], errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(loss)
    return {int(s): float(v) for s, v in zip(given[T.STEP][bad], loss[bad], strict=True)}


def _loss_said(losses: list[float]) -> str:
    """What non-finite ``losses`` were: "nan", "inf" or "nan or inf"."""
    kinds = {"inf" if math.isinf(v) else "nan" for v in losses}
    return kinds.pop() if len(kinds) == 1 else "nan or inf"


def _which_skipped(run: _Run) -> str:
    """With several optimizers under the scaler: whose steps it skipped, each one's count ("" with one). A
    step is counted as skipped when any of them was (the steps table's ``skipped``)."""
    each, partial = _skipped_optimizers(run)
    if not partial:
        return ""
    counts = [sum(k in places for places in partial.values()) for k in range(len(each))]
    return "of " + " and of ".join(
        f"{_optimizer_named(each, k)} on {f'{c:,}' if c else 'none'}" for k, c in enumerate(counts)
    )


def _rule_scaler(run: _Run, plan: _Plan) -> None:
    _rule_scaler_unneeded(run, plan)
    cfg = run.cfg
    st = run.steps
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    # the run's configuration (the built-in loop, the callbacks), else the scaler the Profiler was given
    run_gi = run.run_config.get("growth_interval") or capture.get("scaler_growth_interval")
    run_gi = int(run_gi) if isinstance(run_gi, (int, float)) and run_gi > 0 else cfg.default_growth_interval
    plan.growth_interval = cfg.default_growth_interval
    if plan.diverged is not None:
        # the steps from the divergence on were skipped because the loss was already non-finite: counted apart
        st = st[st[T.STEP] < plan.diverged[0]].reset_index(drop=True)
    # micro-batches (prof.step() called per micro-batch) are no optimizer steps: neither skipped nor gone through
    st = st[~st[T.STEP].isin(_steps_without_update(run)[0])].reset_index(drop=True)
    if st.empty or st[T.LOSS_SCALE].isna().all():
        return
    skipped = st[T.SKIPPED]
    n = int(skipped.sum())
    after = plan.skipped_after_divergence if plan.diverged is not None else 0
    k = plan.loss_scale_log2
    rec = 2.0**k
    scale = st[T.LOSS_SCALE]
    if n:
        sk = st[skipped]
        # Skips that came with nan/inf from the model (the non-finite rule's verdict) are not the scale's
        # fault: no init_scale avoids them, whatever scale they happened at.
        from_model = sk[T.STEP].isin(plan.model_skips)
        model = int(from_model.sum())
        # ... nor are those of a step whose loss was already nan/inf (a bad batch, the model's forward on it):
        # the steps table has every step's loss, where the non-finite rule reads the sampled steps alone
        losses = _nonfinite_losses(st)
        bad_loss = sk[T.STEP].isin(losses) & ~from_model
        lost = sorted(int(s) for s in sk[bad_loss][T.STEP])
        nl = len(lost)
        no_scale = from_model | bad_loss  # skips no loss scale avoids
        others = n - model - nl
        first_ok = st.index[~skipped]
        start = float(scale.iloc[0])
        settled = float(scale[~skipped].iloc[0]) if len(first_ok) else None
        # above the recommended scale: before the first step that went through, the start's fault (a lower
        # start avoids them); after it, a dynamic scaler's growth probing its ceiling, which a lower start grows
        # back into after as many growth intervals (a static scale never grows: all the start's)
        above = sk[~no_scale][T.LOSS_SCALE] > rec
        backed_off = bool(len(first_ok)) and not _static_scale(st)  # a dynamic scaler: a step went through
        later = sk[~no_scale][T.STEP] > st.loc[first_ok[0], T.STEP] if backed_off else above & False
        # a probe is a skip at a scale the scaler grew to, above every scale a step had gone through at before;
        # a skip at a scale steps went through at is a gradient spike (a lower start grows back to it too)
        # (cummax leaves a skipped step's NaN as NaN: the highest scale so far is carried over it, or a skip at a
        # lower scale after a backoff read as grown past nothing)
        went_through = scale.where(~skipped).cummax().ffill().shift(1)
        grown = later & (sk[~no_scale][T.LOSS_SCALE] > went_through[sk[~no_scale].index].fillna(0.0))
        avoid, probes = int((above & ~later).sum()), int((above & grown).sum())
        # the recommended scale rests on a lower bound of the largest gradient: the most a start can be, not a scale
        # known to fit, so the skips above it are not counted as ones a start there avoids
        unsure = avoid if plan.grad_absmax_bound else 0
        avoid -= unsure
        spikes = int(
            (above & later & ~grown).sum()
        )  # above the recommendation, at a scale steps went through
        parts = []
        if model:
            parts.append(
                f"{model} of those skips came with nan/inf from the model itself (see the non-finite "
                "finding), which no loss scale avoids"
            )
        if nl:
            kind = _loss_said([losses[s] for s in lost])
            at = f"step{'s' if nl > 1 else ''} {_listed([str(s) for s in lost], 5)}"
            who_nl = "It" if n == 1 else f"All {n}" if nl == n else f"{nl} of those skips"
            parts.append(
                f"{who_nl} came on {'a step' if nl == 1 else 'steps'} whose loss was {kind} ({at}): the batch, or "
                "the model's forward on it, made the loss non-finite before any scaling, which no loss scale avoids"
            )
        if others:
            head = unsure or avoid
            lead = f"Of the other {others}, {head}" if model or nl else f"{head} of those skips"
            if unsure:
                part = (
                    f"{lead} happened at a scale above {_pow2(k)}, the most a start can be; whether a start "
                    f"there avoids them the run cannot tell: it measured the largest gradient only as a lower "
                    f"bound (fp16_loss_scale)"
                )
            elif avoid:
                # a dynamic scaler's skips before its first step went through, not merely those above the
                # recommended scale: a spike after it may be above it too
                when = "came before the first step that went through, each" if backed_off else "happened"
                part = (
                    f"{lead} {when} at a scale above the recommended {_pow2(k)}: starting GradScaler at "
                    f"{_scale(k)} avoids them"
                )
            elif probes:
                part = (
                    f"{'Of the other ' + str(others) + ', ' if model or nl else ''}{_probes(probes, settled)}"
                )
                if others - probes:
                    rest = others - probes
                    part += f"; the other {rest} {_went_through(rest, spikes, f'the recommended {_pow2(k)}')}"
            else:
                part = (
                    f"{'The other' if model or nl else 'All'} {others} "
                    f"{_went_through(others, spikes, f'the recommended {_pow2(k)}')}"
                )
            if head:
                if probes:
                    part += f"; {_probes(probes, settled)}"
                rest = others - head - probes
                if rest:
                    part += f"; the other {rest} {_went_through(rest, spikes, 'it')}"
            parts.append(part)
        who = (
            "The loss scaler, static (it never backs off),"
            if _static_scale(st)
            else "The dynamic loss scaler"
        )
        if plan.diverged is not None:
            first = plan.diverged[0]
            lead = (
                f"{who} skipped {n + after:,} optimizer steps in all: {after:,} from step {first} "
                f"on, where the run diverged (its loss non-finite), which no loss scale avoids, and {n:,} of the "
                f"{len(st):,} steps before it (scale started at {start:g}"
            )
        else:
            lead = (
                f"{who} skipped {n:,} of {len(st):,} optimizer steps (scale started at {start:g}"
                if not (which := _which_skipped(run))
                else f"{who} skipped optimizer steps on {n:,} of {len(st):,} steps, {which} (scale started at "
                f"{start:g}"
            )
        resets = _scale_resets(st)
        # not one optimizer step went through: the model never trained (a warning among others read as normal)
        never = n == len(st)
        msg = (
            lead
            + (f", first successful step at scale {settled:g}" if settled is not None else "")
            + "). "
            + ". ".join(parts)
            + "."
            + (
                _never_stepped(st, n, model + nl, rec, plan.grad_absmax_bound, plan.grad_absmax)
                if never
                else ""
            )
            + (_resets_said(resets, st) if resets else "")
        )
        # a step whose loss was nan/inf: its batch, or the model's forward on it, is what to look at
        batch_fix = (
            f"Find the batch{'es' if nl > 1 else ''} at {at}, whose loss was {kind}: check "
            f"{'its' if nl == 1 else 'their'} inputs and labels, and the model's forward on "
            f"{'it' if nl == 1 else 'them'} (a log or division of 0, an fp16 overflow); no loss scale fixes a "
            "non-finite loss."
            if nl
            else ""
        )
        remedy = (
            f"Use a dynamic GradScaler (it backs off until steps go through) at init_scale={_scale(k)} at the "
            "most, or profile a few steps at a low scale (--loss-scale static:1) to measure the gradients and "
            "size it."
            if unsure
            else f"Use GradScaler(init_scale={_scale(k)})" + (" or lower." if plan.grad_absmax_bound else ".")
            if avoid
            else "Remove the source of the nan/inf (see the non-finite finding); the loss scale is not the cause."
            if model
            else ""  # only skips of a non-finite loss: what to do is the batch's (batch_fix)
            if not others
            else "Nothing to change at the start: the scaler backed off from a gradient spike at a scale earlier "
            "steps had gone through at, as it is made to."
            if spikes == others and not probes
            else "Nothing to change at the start: a dynamic scaler finds its ceiling by overflowing there now and "
            "then; a longer growth_interval makes those skips rarer."
            if probes
            else "Profile a few steps at a low scale (--loss-scale static:1) to see whether the gradients are "
            "finite at any scale: no step went through at the scales this run tried, at or below the recommended one."
            if never
            else f"Nothing to change at the start: no initial scale avoids these skips, each at or below the "
            f"recommended {_pow2(k)} or at a scale steps had gone through at; the scaler skipped those steps as it "
            "is made to."
        )
        remedy = " ".join(r for r in (remedy, batch_fix) if r)
        if resets:
            remedy += (
                " Save scaler.state_dict() in the checkpoint beside the model's and the optimizer's, and "
                "scaler.load_state_dict() it when resuming: the scale then goes on from where it was."
            )
        title = f"{n} optimizer steps skipped by the loss scaler"
        if never:
            title = f"No optimizer step was taken: the loss scaler skipped all {n} steps"
            plan.never_stepped = n
            plan.never_stepped_from_model = model
        if plan.diverged is not None:
            title += f" before the run diverged at step {plan.diverged[0]} ({n + after:,} in all)"
        plan.add(
            Finding(
                "scaler_skipped_steps",
                CRITICAL if never else WARNING,
                title,
                msg,
                remedy,
                numbers={
                    "skipped": n,
                    **(
                        {"skipped_after_divergence": after, "steps_before_divergence": len(st)}
                        if plan.diverged is not None
                        else {"steps": len(st)}
                    ),
                    # not known where the scale is the most a start can be: those skips are counted apart
                    "avoidable": None if unsure else avoid,
                    "above_start_limit": unsure if plan.grad_absmax_bound else None,
                    "growth_probes": probes,
                    "spikes": spikes,
                    "from_model": model,
                    "start_scale": start,
                    "first_ok_scale": settled,
                    # a scale from a lower bound of the largest gradient is the most a start can be, no recommendation
                    "recommended_scale": None if plan.grad_absmax_bound else rec,
                    "start_scale_limit": rec if plan.grad_absmax_bound else None,
                    # the lowest scale a run without a step that went through reached; the resumes that put
                    # the scale back to its start (only where there were such: the numbers of other runs as they were)
                    **({"lowest_scale": float(scale.min())} if never else {}),
                    **({"scale_resets": len(resets)} if resets else {}),
                    # the skips of steps whose loss was nan/inf (only where there were such), the first of them
                    **({"nonfinite_loss": nl, "nonfinite_loss_step": lost[0]} if nl else {}),
                },
            )
        )
    # Thrashing: after the first successful step, the scaler grows, overflows, backs off, again and again.
    ok_idx = st.index[~skipped]
    if len(ok_idx):
        after = st.loc[ok_idx[0] :]
        later_skips = int(skipped.loc[ok_idx[0] :].sum())
        grows, costly = _growths(after)
        if costly >= cfg.thrash_min_skips:
            new_gi = max(cfg.default_growth_interval, 2 * run_gi)
            plan.growth_interval = new_gi
            every = len(after) / later_skips
            plan.add(
                Finding(
                    "scaler_thrashing",
                    WARNING,
                    "The loss scaler thrashes: it grows, overflows and backs off repeatedly",
                    f"After its first successful step the scaler grew {grows} time(s) with growth_interval "
                    f"{run_gi}; {costly} of those growths overflowed at the grown scale, each costing a skipped "
                    f"step ({later_skips} of {len(after)} steps skipped in all, one every {every:.0f}).",
                    f"Start at {_scale(k)} and raise growth_interval to {new_gi}.",
                    numbers={
                        "growths": grows,
                        "costly_growths": costly,
                        "later_skips": later_skips,
                        "steps_after": len(after),
                        "growth_interval": run_gi,
                        "recommended_growth_interval": new_gi,
                    },
                )
            )

"""fp16: activations beyond its range, the loss scale, gradients that underflow or overflow at it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.config import AdvisorConfig
from precprof.analysis.advisor.evidence import (
    _ancestors,
    _dtype_has,
    _exponent_counts,
    _grad_absmax,
    _innermost,
    _lost_norm_share,
    _mask_rows,
    _model_inputs,
    _modules_to_keep,
    _n_modules,
    _no_forward,
    _nonzero,
    _normalise_remedy,
    _num,
    _optimizer_named,
    _Plan,
    _row_index,
    _rows_of_kinds,
    _Run,
    _share,
    _shifted_overflow,
    _shifted_underflow,
    _skipped_optimizers,
    _skipped_rows,
    _skipped_steps,
    _static_scale,
    _under_any,
)
from precprof.analysis.advisor.model import CRITICAL, INFO, WARNING, Finding
from precprof.analysis.advisor.rules.kept import (
    _cast_flush,
    _gemm_inputs,
    _outside_autocast,
    _rule_kept_fp32,
    fp16_pure,
    kept_how,
)
from precprof.analysis.advisor.rules.kept_gradients import (
    KeptGradients,
    autocast_fp32_gradients,
    kept_gradients,
)
from precprof.analysis.advisor.rules.nonfinite import _first_origin
from precprof.analysis.advisor.rules.scaler import _rule_scaler
from precprof.analysis.advisor.rules.updates import bf16_gradient_underflow
from precprof.analysis.advisor.text import (
    _g,
    _listed,
    _listing,
    _log2i,
    _loss_scale_said,
    _name,
    _pct,
    _pow2,
    _scale,
    _scales,
)
from precprof.formats import FP16, FP32_MAX_EXPONENT


def _none_why(run: _Run) -> str:
    """How a run came to record no per-layer statistics at all (``_Run.unsampled_cause``), to follow those
    words."""
    cause = run.unsampled_cause
    if cause == "interval 0":
        return f", as {T.sample_every_setting(run.run_config, '0')} does"
    return f": {cause or 'no step was sampled'}"


def _rule_fp16_activations(run: _Run, plan: _Plan) -> None:
    cfg = run.cfg
    acts = run.kind(T.ACTIVATION)
    if acts.empty:
        return
    began = _divergence_overflow(run, plan)
    if not began.empty:
        acts = pd.concat([acts, began])
    # What-if: exact fp16 overflow counts of tensors that were not fp16 (scale is 1 in the forward pass); under
    # autocast, of those fp16 autocast would hold in fp16 (an fp32 tensor it leaves alone overflows nothing); in an
    # fp16-pure run, of those an fp16 matmul reads (an fp32 layer's output, kept so, is cast by nothing)
    cast = _cast_under_fp16_autocast(run, acts) if run.autocast.get("enabled") or fp16_pure(run) else None
    if cast is not None:
        acts = acts[_dtype_has(acts, "float16") | cast]
    whatif = acts[~_dtype_has(acts, "float16") & (acts[T.overflow_col("fp16")] > 0)]
    beyond = set(whatif[T.MODULE])
    # an element-wise module after a layer whose values go beyond 65504 (a dropout) holds those values again:
    # said beside that layer, not counted a second time
    copies = {m: p for m, p in _passed_on(run, run.sort(beyond)).items() if p is not None and p in beyond}
    over = beyond - set(copies)
    # Observed: fp16 tensors already holding inf (a mask's -inf is no overflow). The inf propagates
    # downstream, so only the first module of each step is the cause.
    seen = acts[_dtype_has(acts, "float16") & (acts[T.INF] > 0)]
    seen = seen[~_mask_rows(run, seen)]
    observed: set[str] = set()
    for _, at in seen.groupby(T.STEP):
        observed.add(run.sort(_innermost(at[T.MODULE]))[0])
    limit = FP16.max / 2.0**cfg.fp16_activation_headroom_log2
    per_mod = acts.groupby(T.MODULE).agg(
        absmax=(T.ABSMAX, "max"),
        overflow=(T.overflow_col("fp16"), "sum"),
        numel=(T.NUMEL, "sum"),
        inf=(T.INF, "sum"),
    )
    near = _near_overflow(run, per_mod, limit, beyond | observed, set(seen[T.MODULE]))
    overflow_mods = run.sort(_innermost(over | observed))
    near_mods = run.sort(_innermost(near))
    # a layer's own input row (a function's output) is kept in fp32 through the module that ran the function; an
    # element-wise module (a dropout) through the layer that feeds it
    # an fp32 output (a norm autocast leaves in fp32) goes to fp16 only in the cast its matmul readers make: they
    # are kept, not the module that made it, which is fp32 already
    cast_by = _cast_by_readers(run, plan, overflow_mods)
    cast_near = _cast_by_readers(run, plan, near_mods)  # (one within 2x of 65504 alike)
    kept_for = [r for m in overflow_mods for r in cast_by.get(m, [m])]
    near_for = [r for m in near_mods for r in cast_near.get(m, [m])]
    plan.fp16_cast_kept = run.sort({r for m, rs in cast_by.items() for r in rs if r != m})
    plan.fp16_cast_near_kept = run.sort(
        {r for m, rs in cast_near.items() for r in rs if r != m} - set(plan.fp16_cast_kept)
    )
    keep = _modules_to_keep([*kept_for, *near_for], _model_inputs(run), _no_forward(run))
    plan.fp16_passed_on = passed = _passed_on(run, keep)
    plan.keep_fp16 = run.sort(p for m in keep if (p := passed.get(m, m)))
    if overflow_mods:
        causes = _inf_causes(run, plan, observed, beyond | set(seen[T.MODULE]), per_mod, limit)
        counted = whatif[~whatif[T.MODULE].isin(set(copies))]
        real = _overflowed_in_the_cast(run, counted)
        _add_overflow_finding(
            run, plan, per_mod, counted, overflow_mods, observed, causes, copies, real, cast_by
        )
        if not began.empty:
            _said_began(plan, began)
    if near_mods:
        plan.add(
            Finding(
                "fp16_activation_near_overflow",
                WARNING,
                f"Activations within {2**cfg.fp16_activation_headroom_log2}x of fp16's limit",
                f"{_n_modules(near_mods)} module(s) reach |x| >= {_g(limit)} (65504 / "
                f"{2**cfg.fp16_activation_headroom_log2}): "
                + "; ".join(
                    f"{_name(m)}: {_g(per_mod.loc[m, 'absmax'])}"
                    + (", besides the inf of an overflow before it" if per_mod.loc[m, "inf"] > 0 else "")
                    for m in near_mods[: cfg.max_listed_modules]
                )
                + ". Steps that were not sampled may overflow.",
                _near_remedy(plan, near_mods, cast_near),
                modules=near_mods,
                numbers={
                    "modules": _n_modules(near_mods),
                    "absmax": _num(per_mod.loc[near_mods, "absmax"].max()),
                    "limit": limit,
                },
            )
        )
    _forward_underflow(run, plan, acts)  # its layers join the list before the share of them is judged
    _rule_kept_fp32(run, plan)  # and the layers the run kept in fp32 that fp16 still needs there
    if plan.matmul_layers:
        held = set(plan.keep_fp16)
        kept = [m for m in plan.matmul_layers if m in held or _under_any(m, held)]
        share = len(kept) / len(plan.matmul_layers)
        if share > cfg.fp16_keep_share_max:
            plan.fp16_block.append(
                f"fp16 would have to leave {len(kept)} of {len(plan.matmul_layers)} matmul layers "
                f"({_pct(share)}) in fp32 because their activations overflow"
                + (" or flush to zero" if plan.fp16_flush_kept else "")
            )


def _cast_by_readers(run: _Run, plan: _Plan, modules: list[str]) -> dict[str, list[str]]:
    """Of ``modules``, those whose every output was fp32 in this autocast run (autocast left them in fp32: a norm,
    code that upcasts; or the run kept a matmul outside autocast), each with the matmul layers under autocast that
    read that output (capture.gemm_inputs) and so cast it to fp16, and the module itself where it is a matmul
    layer (under autocast its own output would be fp16). Such an output goes to fp16 only in its readers' casts:
    keeping the module that made it in fp32 changes nothing, keeping its readers does. Empty without autocast or
    without the record of what the matmuls read; a module no matmul under autocast reads is not among them."""
    inputs = _gemm_inputs(run)
    if not run.autocast.get("enabled") or not inputs:
        return {}
    outside = _outside_autocast(run.kind(T.ACTIVATION))
    matmuls = set(plan.matmul_layers)
    found: dict[str, list[str]] = {}
    for m in modules:
        if m.endswith(T.INPUT_SUFFIX) or m not in outside:
            continue
        readers = [c for c, v in inputs.items() if m in v and c not in outside]
        if readers:
            found[m] = run.sort({*readers, *([m] if m in matmuls else [])})
    return found


def _divergence_overflow(run: _Run, plan: _Plan) -> pd.DataFrame:
    """The activation row of the module whose fp16 overflow began the divergence (``plan.diverged_forward``: the
    first divergent step's rows, which the format rules do not read), empty when none did. That is the first
    module in forward order to hold nan/inf on that step (a mask's inf left out), where it is fp16 and holds
    inf, and every weight of the step was finite: the overflow made the loss non-finite, and the rows after it
    hold what it spread. A step whose weights were already non-finite began before its forward pass."""
    rows = plan.diverged_forward
    none = run.kind(T.ACTIVATION).iloc[:0]
    if rows is None or rows.empty:
        return none
    weights = rows[rows[T.TENSOR] == T.WEIGHT]
    if int((weights[T.NAN] + weights[T.INF]).sum()):
        return none
    acts = rows[rows[T.TENSOR] == T.ACTIVATION]
    bad = acts[(acts[T.NAN] + acts[T.INF]) > 0]
    bad = bad[~_mask_rows(run, bad)]
    if bad.empty:
        return none
    first, _ = _first_origin(run, bad)
    row = bad[bad[T.MODULE] == first]
    held = row[_dtype_has(row, "float16") & (row[T.INF] > 0)]
    return held[none.columns] if not held.empty else none


def _said_began(plan: _Plan, began: pd.DataFrame) -> None:
    """Tell, in fp16_activation_overflow, that the overflow of ``began`` (``_divergence_overflow``) began the
    divergence, at which step."""
    step, module = int(began[T.STEP].iloc[0]), str(began[T.MODULE].iloc[0])
    inf = int(began[T.INF].sum())
    for f in plan.findings:
        if f.code == "fp16_activation_overflow":
            f.message += (
                f" At step {step}, where the run diverged, the {inf:,} inf of {_name(module)} {'was' if inf == 1 else 'were'} the "
                "first non-finite value of the forward pass: that overflow made the loss non-finite."
            )
            f.numbers["diverged_step"] = step


def _near_overflow(
    run: _Run, per_mod: pd.DataFrame, limit: float, overflowed: set[str], held_inf: set[str]
) -> set[str]:
    """The modules whose largest finite activation |x| (``per_mod``) is at least ``limit`` without overflowing:
    none of the ``overflowed`` ones, nor an element-wise module passing on the values of one of those or of one
    that held inf in fp16 (``held_inf``): a dropout after a layer that overflowed holds that layer's overflow,
    not a near one of its own."""
    near = set(per_mod.index[(per_mod["absmax"] >= limit) & (per_mod["absmax"] < FP16.overflow_min)])
    spilled = overflowed | held_inf
    passing = {m for m, p in _passed_on(run, run.sort(near)).items() if p in spilled}
    return near - overflowed - passing


def _forward_underflow(run: _Run, plan: _Plan, acts: pd.DataFrame) -> None:
    """fp16_activation_underflow: activations flushing to zero in fp16 (no loss scale applies to the forward
    pass), of the activation rows ``acts`` fp16 would hold in fp16 (under autocast, those it would cast). The
    layers whose casts flush the values join fp16's keep list (``_underflow_remedy``)."""
    cfg = run.cfg
    lo = acts[~_dtype_has(acts, "float16")]
    nz = _nonzero(lo)
    uf = float(lo[T.underflow_col("fp16")].sum())
    uf_share = _share(uf, nz)
    if uf_share is None or uf_share <= cfg.fp16_activation_underflow_warn:
        return
    by = lo.groupby(T.MODULE)[[T.underflow_col("fp16"), T.NUMEL]].sum()
    worst = by[by[T.underflow_col("fp16")] > 0].sort_values(T.underflow_col("fp16"), ascending=False)
    mods = run.sort(worst.index[: cfg.max_listed_modules])
    remedy, keep = _underflow_remedy(run, plan, mods, lo)
    plan.fp16_flush_kept = [m for m in keep if m not in plan.keep_fp16]
    plan.keep_fp16 = run.sort([*plan.keep_fp16, *plan.fp16_flush_kept])
    plan.add(
        Finding(
            "fp16_activation_underflow",
            WARNING,
            f"{_pct(uf_share)} of activation values flush to zero in fp16",
            f"{int(uf):,} of {int(nz):,} nonzero activation values ({_pct(uf_share)}) are at or below 2^-25 "
            f"and would become 0 in fp16; most in {_listing(mods, cfg.max_listed_modules)}.",
            remedy,
            modules=mods,
            numbers={"underflow_values": int(uf), "nonzero_values": int(nz), "share": uf_share},
        )
    )


def _passed_on(run: _Run, modules: list[str]) -> dict[str, str | None]:
    """The element-wise modules among ``modules`` (a dropout, an activation function: taxonomy's), each with the
    layer that feeds it, None where the run does not tell. Such a module computes in its input's dtype: it passes
    on an overflow its input brought (keeping it in fp32 changes nothing then: its input overflowed first), or
    scales up what its input held in fp16 (a dropout's 1/(1-p)); keeping the layer that feeds it in fp32 covers
    both (its output, and so the element-wise module, are fp32 then). That layer is the leaf module that started
    just before it on a step, and made as many values: a module called more than once was fed by several."""
    if not modules:
        return {}
    calls, numel, leaves = run.memo("passed_on", lambda: _leaf_outputs(run))
    passed: dict[str, str | None] = {}
    for m in modules:
        if taxonomy.kind_of_type(run.types.get(m, "")) != taxonomy.ELEMENTWISE or m not in leaves:
            continue
        before = [
            p
            for p in leaves[: leaves.index(m)]
            if taxonomy.kind_of_type(run.types.get(p, "")) != taxonomy.ELEMENTWISE
        ]
        feeder = before[-1] if before and calls.get(m, 1) == 1 else None
        mine = numel.xs(m, level="m") if feeder is not None else None
        same = mine is not None and numel.xs(feeder, level="m").reindex(mine.index).eq(mine).all()
        passed[m] = feeder if same else None
    return passed


def _leaf_outputs(run: _Run) -> tuple[pd.Series, pd.Series, list[str]]:
    """What ``_passed_on`` reads of the run's activations: each module's largest calls on a step, its output
    elements per (step, module), and the leaf modules in forward order (a layer's own input rows left out)."""
    acts = run.kind(T.ACTIVATION)
    names = T.texts(acts[T.MODULE])
    calls = pd.to_numeric(acts[T.CALLS], errors="coerce").groupby(names.to_numpy()).max()
    numel = acts.groupby([T.STEP, names.rename("m")], observed=True)[T.NUMEL].sum()
    recorded = [m for m in run.sort(set(names)) if not m.endswith(T.INPUT_SUFFIX)]
    containers = {a for m in recorded for a in _ancestors(m)}
    return calls, numel, [m for m in recorded if m not in containers]


def _passed_said(plan: _Plan, modules: list[str]) -> str:
    """What keeps the element-wise ones among ``modules`` (``plan.fp16_passed_on``) in fp32: the layer that feeds
    each, kept in its place ("" when none is among them)."""
    passed = {m: p for m, p in plan.fp16_passed_on.items() if m in modules}
    if not passed:
        return ""
    one = len(passed) == 1
    said = (
        f"; {_listing(list(passed), 4)} {'computes in its' if one else 'compute in their'} input's dtype, and an "
        "overflow of that input comes before " + ("it" if one else "them")
    )
    fed = ", ".join(f"{_name(p)} for {_name(m)}" for m, p in passed.items() if p)
    unknown = [m for m, p in passed.items() if not p]
    if fed:
        said += f": the layer that feeds {'it' if one else 'each'} is kept instead ({fed}), which makes that input fp32"
    if unknown:
        said += (
            f"{'; ' if fed else ': '}keep the layer that feeds {_listing(unknown, 4)} in fp32 (the run does not "
            "tell which: it ran more than once a step, or after no module that made as many values)"
        )
    return said


@dataclass(frozen=True)
class _InfCauses:
    """Why modules that first held inf in fp16 on a step did, where their own values stayed within range."""

    fed: dict[str, list[str]]  # module -> its inputs that overflowed (``_fed_overflow``)
    matmul: set[str]  # matmul layers whose input was not recorded: it, or one of their sums, overflowed
    inside: set[str]  # any other module: an intermediate inside it (an exp, a log or a division)


@dataclass
class _CastInf:
    """What an fp32 row's overflow did where fp16 autocast cast it for a matmul: the layers that read it and held
    nan/inf in their fp16 output on a step it overflowed (``readers``), the row's values beyond fp16 on those
    steps (``values``), and the nan and inf of those outputs there."""

    readers: list[str] = field(default_factory=list)
    values: int = 0
    nan: int = 0
    inf: int = 0


def _overflowed_in_the_cast(run: _Run, whatif: pd.DataFrame) -> dict[str, _CastInf]:
    """The what-if rows (fp32 or bf16 values beyond 65504) whose overflow happened in this run: the row is the
    input of a matmul layer (its own input row, or a module's output it read, capture.gemm_inputs) that ran under
    fp16 autocast, which cast it to fp16 for the matmul, and on a step the row overflowed, holding no nan/inf
    itself, that layer's fp16 output held nan or inf (an inf input to a matmul makes inf, and nan beside an inf of
    the other sign). Each with what it did (``_CastInf``); the others are a what-if, as in a bf16 or fp32 run."""
    if whatif.empty:
        return {}
    inputs = _gemm_inputs(run) or {}
    acts = run.kind(T.ACTIVATION)
    out16 = acts[_dtype_has(acts, "float16") & ((acts[T.NAN] + acts[T.INF]) > 0)]
    bad = out16.groupby([out16[T.STEP].astype(int), T.texts(out16[T.MODULE]).rename("m")], observed=True)[
        [T.NAN, T.INF]
    ].sum()
    if bad.empty:
        return {}
    rows = whatif[(whatif[T.NAN] + whatif[T.INF]) == 0]
    over = rows.groupby([rows[T.STEP].astype(int), T.texts(rows[T.MODULE]).rename("m")], observed=True)[
        T.overflow_col("fp16")
    ].sum()
    found: dict[str, _CastInf] = {}
    for (step, m), n in over.items():
        readers = (
            [m.removesuffix(T.INPUT_SUFFIX)]
            if m.endswith(T.INPUT_SUFFIX)
            else [c for c, v in inputs.items() if m in v]
        )
        hit = [c for c in readers if (step, c) in bad.index]
        if not hit or not n:
            continue
        cast = found.setdefault(m, _CastInf())
        cast.values += int(n)
        cast.readers = run.sort({*cast.readers, *hit})
        cast.nan += int(sum(bad.loc[(step, c), T.NAN] for c in hit))
        cast.inf += int(sum(bad.loc[(step, c), T.INF] for c in hit))
    return found


def _inf_causes(
    run: _Run, plan: _Plan, observed: set[str], overflowed: set[str], per_mod: pd.DataFrame, limit: float
) -> _InfCauses:
    """Sort the ``observed`` modules whose finite values stay far below 65504 and none of whose values was over
    it: not their output beyond fp16's range. One whose input is among the ``overflowed`` rows made inf of it
    (a Linear reading raw features beyond 65504 makes inf rows, nothing inside it does). Else a matmul layer's
    input or sums overflowed (its intermediates are its products); any other module's intermediate did (an exp
    that overflowed, a log or a division of a value that underflowed to zero: log(softmax(x)) gives -inf where
    softmax flushed)."""
    fed = _fed_overflow(run, observed, overflowed)
    within = {
        m
        for m in observed
        if m not in fed
        and int(per_mod.loc[m, "overflow"]) == 0
        and (not math.isfinite(float(per_mod.loc[m, "absmax"])) or float(per_mod.loc[m, "absmax"]) < limit)
    }
    matmul = within & set(plan.matmul_layers)
    return _InfCauses(fed, matmul, within - matmul)


def _add_overflow_finding(
    run: _Run,
    plan: _Plan,
    per_mod: pd.DataFrame,
    whatif: pd.DataFrame,
    overflow_mods: list[str],
    observed: set[str],
    causes: _InfCauses,
    copies: Mapping[str, str],
    real: Mapping[str, _CastInf],
    cast_by: Mapping[str, list[str]],
) -> None:
    """fp16_activation_overflow: the modules whose activations go beyond fp16's range (``whatif``: rows that
    were not fp16, counted at 65504), the ``observed`` ones that held inf in fp16, and why (``causes``). The
    element-wise modules that pass on a listed module's values (``copies``: each with that module) are said
    beside it, their values not counted again. ``real``: the rows among them whose overflow happened, in the
    cast fp16 autocast made for the matmul that read them (``_overflowed_in_the_cast``): critical, and said as
    what happened, not as a what-if. ``cast_by``: the modules among them whose fp32 output goes to fp16 only in
    the casts of the matmul layers that read it (``_cast_by_readers``): the remedy names those layers."""
    cfg = run.cfg
    inside, fed, matmul = causes.inside, causes.fed, causes.matmul
    n_over = int(whatif[T.overflow_col("fp16")].sum())
    amax = float(per_mod.loc[overflow_mods, "absmax"].max())

    def said(m: str) -> str:
        inf = f"{int(per_mod.loc[m, 'inf']):,} inf in fp16"
        top = float(per_mod.loc[m, "absmax"])
        # (NaN: not one finite value on any sampled step, where "its largest finite value is n/a" was said)
        finite = (
            f"though its largest finite value is {_g(top)}" if math.isfinite(top) else "and no finite value"
        )
        if m in inside:
            return (
                f"{_name(m)}: {inf} {finite}: an intermediate inside it went out of range (an exp that "
                "overflowed, or a log or a division of a value that underflowed to zero)"
            )
        if m in fed:
            return f"{_name(m)}: {inf} from its input, which overflowed fp16 ({_listing(fed[m], 4)})"
        if m in matmul:
            return (
                f"{_name(m)}: {inf} {finite}: its input held a value beyond 65504 that the cast to fp16 made inf, "
                "or one of its sums overflowed (precprof did not record its input)"
            )
        if m in real:
            cast = real[m]
            # (a reader listed as fed by it says its output's inf itself)
            held = (
                ""
                if all(c in fed for c in cast.readers)
                else f", and {'its' if len(cast.readers) == 1 else 'their'} fp16 output held {cast.nan:,} nan and "
                f"{cast.inf:,} inf on those steps"
            )
            return (
                f"{_name(m)}: max |x| {_g(per_mod.loc[m, 'absmax'])}, {int(per_mod.loc[m, 'overflow']):,} values "
                f"beyond 65504; fp16 autocast cast them to fp16 for the matmul of {_listing(cast.readers, 4)}, "
                f"where they became inf{held}"
                + _copies_said(per_mod, m, [c for c, p in copies.items() if p == m])
            )
        return (
            f"{_name(m)}: max |x| {_g(per_mod.loc[m, 'absmax'])}, "
            f"{int(per_mod.loc[m, 'overflow']):,} values an fp16 cast makes inf"
            + (f", {inf}" if m in observed else "")
            + _copies_said(per_mod, m, [c for c, p in copies.items() if p == m])
        )

    detail = "; ".join(said(m) for m in overflow_mods[: cfg.max_listed_modules])
    beyond = [m for m in overflow_mods if m not in inside]
    made = [m for m in beyond if m not in fed and m not in matmul]  # their own values went beyond 65504
    # the layers the model's own input feeds are told so by ``_normalise_remedy``, once
    told = {m.removesuffix(T.INPUT_SUFFIX) for m in made if m in _model_inputs(run)}
    readers = run.sort([m for m in [*fed, *matmul] if m not in told])
    plan.add(
        Finding(
            "fp16_activation_overflow",
            CRITICAL if observed or real else WARNING,
            f"Activations overflow fp16 in {_n_modules(overflow_mods)} module(s)"
            if beyond
            else f"fp16 activations turn inf inside {_n_modules(overflow_mods)} module(s)",
            _overflow_counts(
                made, observed, n_over, causes, sum(c.values for m, c in real.items() if m in made)
            )
            + f": {detail}. No loss scale helps the forward pass.",
            "Use bf16, or "
            + _kept_remedy(run, overflow_mods, made, cast_by)
            + _passed_said(plan, overflow_mods)
            + (
                f"; a layer whose {'input or sums overflow' if matmul else 'input overflows'} fp16 "
                f"({_listing(readers, 4)}) needs that input scaled down (normalise the features) or the layer kept "
                "in fp32"
                if readers
                else ""
            )
            + (
                "; a fused op keeps the intermediates in range where there is one (F.log_softmax rather than "
                "log(softmax(x)))"
                if inside
                else ""
            )
            + ".",
            modules=overflow_mods,
            numbers={
                "modules": _n_modules(overflow_mods),
                "overflow_values": n_over,
                "absmax": amax if math.isfinite(amax) else None,
                "observed_inf_modules": len(observed),
                **({"passed_on_modules": len(copies)} if copies else {}),
                **({"cast_inf_values": sum(c.values for c in real.values())} if real else {}),
            },
        )
    )


def _kept_remedy(
    run: _Run, overflow_mods: list[str], made: list[str], cast_by: Mapping[str, list[str]]
) -> str:
    """What to keep in fp32 for the modules whose values went beyond fp16 (``made``, of ``overflow_mods``): the
    modules themselves, with their output normalised; for one whose fp32 output goes to fp16 only in the casts its
    matmul readers make (``cast_by``), those readers, or that output scaled down before them."""
    said = []
    if any(m not in cast_by for m in overflow_mods):
        said.append(
            "keep "
            + (
                "these modules"
                if not cast_by
                else _listing([m for m in overflow_mods if m not in cast_by], 4)
            )
            + f" in fp32 {kept_how(run, plural=not cast_by or len(overflow_mods) - len(cast_by) > 1)}"
            + _normalise_remedy([m for m in made if m not in cast_by], _model_inputs(run))
        )
    said += [_readers_remedy(m, cast_by[m], "goes beyond 65504") for m in overflow_mods if m in cast_by][:4]
    return "; ".join(said)


def _near_remedy(plan: _Plan, near_mods: list[str], cast_near: Mapping[str, list[str]]) -> str:
    """fp16_activation_near_overflow's remedy: keep the modules in fp32, or, for one whose fp32 output comes near
    65504 only in the casts its matmul readers make (``cast_near``, ``_cast_by_readers``), those readers (an fp32
    norm's output before lm_head was said as "keep model.norm in fp32", which it is)."""
    plain = [m for m in near_mods if m not in cast_near]
    said = []
    if plain:
        said.append(
            f"Keep {'these modules' if not cast_near else _listing(plain, 4)} in fp32 under fp16"
            + _passed_said(plan, plain)
        )
    said += [
        _readers_remedy(m, cast_near[m], "comes within 2x of 65504") for m in near_mods if m in cast_near
    ][:4]
    text = "; ".join(said)
    return text[:1].upper() + text[1:] + ", or use bf16."


def _readers_remedy(m: str, cast_by: list[str], how: str) -> str:
    """Keep the matmul layers that read ``m``'s fp32 output under autocast (``cast_by``: ``_cast_by_readers``'
    entry of ``m``) in fp32, where that output ``how`` ("goes beyond 65504") only in their cast to fp16; or scale it
    down before them."""
    readers = [c for c in cast_by if c != m]
    one = len(readers) == 1
    kept = m in cast_by  # a matmul layer the run kept outside autocast
    return (
        f"keep {_listing(readers, 4)} in fp32 (outside autocast): {_name(m)}'s output is fp32 "
        f"({'this run keeps it outside autocast' if kept else 'autocast leaves it in fp32'}) and {how} "
        f"only in the cast to fp16 that {_listing(readers, 4)} {'makes' if one else 'make'} of it for "
        f"{'its' if one else 'their'} matmul, so kept in fp32 {'it reads' if one else 'they read'} it unrounded; "
        f"or scale {_name(m)}'s output down before {'it' if one else 'them'}"
        + (
            f" ({_name(m)} stays in fp32 too: under autocast its own output would be fp16)"
            if kept
            else f" (keeping {_name(m)} in fp32 changes nothing: it is fp32 already)"
        )
    )


def _copies_said(per_mod: pd.DataFrame, m: str, copies: list[str]) -> str:
    """The element-wise modules that pass on the values of ``m``, in words, with the values an fp16 cast makes inf each
    holds, not counted again ("" for none); more than ``m`` holds are its values scaled up (a dropout's
    1/(1-p))."""
    if not copies:
        return ""
    one = len(copies) == 1
    over = [int(per_mod.loc[c, "overflow"]) for c in copies[:4]]
    scaled = max(over) > int(per_mod.loc[m, "overflow"])
    return (
        f" ({_listing(copies, 4)}, after it, {'passes' if one else 'pass'} them on"
        + (", scaled up by a dropout's 1/(1-p)" if scaled else "")
        + f": {', '.join(f'{n:,}' for n in over)} an fp16 cast makes inf there, not counted again)"
    )


def _overflow_counts(
    made: list[str], observed: set[str], n_over: int, causes: _InfCauses, n_cast: int = 0
) -> str:
    """How many modules went out of fp16's range in each way: their own values beyond 65504 (``made``,
    ``n_over`` values of them that were not fp16, ``n_cast`` of them made inf by fp16 autocast's cast for the
    matmul that read them, in this run), or inf from within its range (``causes``)."""
    became = (
        f" ({n_over:,} values in fp32/bf16 tensors became inf where fp16 autocast cast them to fp16 for a matmul"
        if n_cast >= n_over
        else f" ({n_over:,} values in fp32/bf16 tensors would become inf, {n_cast:,} of them did: fp16 autocast "
        "cast them to fp16 for a matmul"
        if n_cast
        else f" ({n_over:,} values in fp32/bf16 tensors would become inf"
    )
    parts = (
        [
            _beyond_words(made)
            + became
            + (
                f"; {_n_modules(observed & set(made))} module(s) already produced inf in fp16"
                if observed & set(made)
                else ""
            )
            + ")"
        ]
        if made
        else []
    )
    if causes.fed:
        parts.append(f"{_n_modules(causes.fed)} module(s) made inf of an input that overflowed")
    if causes.matmul:
        parts.append(f"{len(causes.matmul)} matmul layer(s) made inf of an input or a sum beyond 65504")
    if causes.inside:
        parts.append(
            f"{len(causes.inside)} turned inf inside"
            if parts
            else f"{len(causes.inside)} module(s) produced inf in fp16 from values within its range"
        )
    return ", and ".join(parts)


def _beyond_words(made: list[str]) -> str:
    """Which rows went beyond fp16's 65504 (``made``), in modules: those whose output did, and the layers whose
    own input row did (a layer's input row is counted with that layer, not as a module of its own)."""
    outputs = [m for m in made if not m.endswith(T.INPUT_SUFFIX)]
    inputs = _n_modules(m for m in made if m.endswith(T.INPUT_SUFFIX))
    said = [f"{len(outputs)} module(s) produce activations beyond fp16's 65504"] if outputs else []
    if inputs:
        said.append(f"{inputs} layer(s) read an input beyond " + ("it" if outputs else "fp16's 65504"))
    return " and ".join(said)


def _fed_overflow(run: _Run, observed: set[str], overflowed: set[str]) -> dict[str, list[str]]:
    """Of the ``observed`` modules (the first to hold inf in fp16 on a step), those whose input is among the
    ``overflowed`` rows, with those inputs: the module's own input row (a tensor no module made: the model's
    input, a function's output) or a module whose output it read (capture.gemm_inputs)."""
    reads = _gemm_inputs(run) or {}
    fed = {m: [i for i in (m + T.INPUT_SUFFIX, *reads.get(m, [])) if i in overflowed] for m in observed}
    return {m: run.sort(i) for m, i in fed.items() if i}


def _underflow_remedy(run: _Run, plan: _Plan, mods: list[str], lo: pd.DataFrame) -> tuple[str, list[str]]:
    """What keeps the tiny activations of ``mods`` out of fp16, and the layers it keeps in fp32: those that cast
    them to fp16 and flush more than ``fp16_activation_underflow_warn`` of the nonzero values of their input as
    they cast it, or of their output as they compute it in fp16 (``_cast_flush``, from the rows ``lo`` fp16 would
    hold). Under autocast a matmul layer casts its input (and weight) to fp16 and computes its output there, and
    any matmul reading a value casts it (capture.gemm_inputs says which reads which; a layer's own input row is its
    input): keeping the module that made a value in fp32 leaves the cast where it was."""
    reads, matmuls = _gemm_inputs(run), set(plan.matmul_layers)
    casts: dict[str, list[str]] = {}  # the layer that casts -> the modules whose values it casts
    unread: list[str] = []
    for m in mods:
        stem = m.removesuffix(T.INPUT_SUFFIX)
        readers = [c for c, made in (reads or {}).items() if m in made]
        at = [stem] if m.endswith(T.INPUT_SUFFIX) or m in matmuls else []
        for c in run.sort({*at, *readers}):
            casts.setdefault(c, []).append(m)
        if not at and not readers:
            unread.append(m)
    bf16 = "or use bf16 (its range reaches 2^-133)."
    # a module no matmul reads is named apart, after those that cast (where the run recorded which reads which)
    if not casts or (unread and reads is None):
        return (
            "Keep the layers that read these values in fp32 (outside autocast): a matmul casts its input to fp16"
            + (" (this run did not record which layer reads which module's output)" if reads is None else "")
            + f"; {bf16}"
        ), []
    flush = {c: _cast_flush(lo, c, (reads or {}).get(c, [])) for c in casts}
    cast = run.sort(c for c in casts if flush[c].worst > run.cfg.fp16_activation_underflow_warn)
    if not cast:
        return (
            f"Use bf16 (its range reaches 2^-133) where these values matter: no layer that casts them to fp16 "
            f"flushes more than {_pct(run.cfg.fp16_activation_underflow_warn)} of the nonzero values of its input "
            "as it casts it, or of its output as it computes it there ("
            + ", ".join(
                f"{_name(c)}: input {_pct(flush[c].input)}, output {_pct(flush[c].output)}"
                for c in run.sort(casts)[:4]
            )
            + "), so keeping one in fp32 saves little."
        ), []
    made = [m for m in mods if m not in matmuls and not m.endswith(T.INPUT_SUFFIX)]

    def how(c: str) -> str:
        others = [m for m in casts[c] if m != c]
        said = []
        if others or (flush[c].input or 0.0) > 0:
            said.append(
                f"casts its input{_input_said(others)} to fp16, flushing {_pct(flush[c].input)} of that input's "
                "nonzero values"
            )
        if c in casts[c] or (flush[c].output or 0.0) > 0:
            said.append(
                f"computes its output in fp16, where {_pct(flush[c].output)} of its nonzero values flush"
            )
        return f"{_name(c)} " + " and ".join(said)

    return (
        f"Keep {_listing(cast, run.cfg.max_listed_modules)} in fp32 (outside autocast): "
        + "; ".join(how(c) for c in cast[:4])
        + (
            f" (keeping {_listing(made, 4)} in fp32 instead changes nothing: the cast stays where it is)"
            if made
            else ""
        )
        + _unread_said(unread)
        + f"; {bf16}"
    ), cast


def _unread_said(unread: list[str]) -> str:
    """The modules among those whose values flush that no matmul layer reads (a norm without a weight, read by the
    activation after it), in words: no layer casts their output as it reads it; a layer that reads what the
    modules after them make does, if any ("" for none)."""
    if not unread:
        return ""
    return (
        f"; no matmul layer reads the output of {_listing(unread, 4)} directly: it is cast to fp16, if at all, by a "
        "layer that reads what the modules after it make"
    )


def _input_said(tiny: list[str]) -> str:
    """The tiny values a layer's input holds, in words: its own input row by name, the modules it reads by their
    output (" (fc1:input)", " (the output of units)"; "" for none)."""
    rows = [_name(m) for m in tiny if m.endswith(T.INPUT_SUFFIX)]
    made = [m for m in tiny if not m.endswith(T.INPUT_SUFFIX)]
    if made:
        rows.append(f"the output{'s' if len(made) > 1 else ''} of {_listing(made, 4)}")
    return f" ({', '.join(rows)})" if rows else ""


def _cast_under_fp16_autocast(run: _Run, acts: pd.DataFrame) -> pd.Series | None:
    """The activation rows of an autocast run that fp16 autocast would hold in fp16: those this run's autocast
    produced in bf16, and fp32 ones a matmul reads as its input (capture.gemm_inputs, and a layer's own input
    row: autocast casts them there). Any other fp32 tensor stays fp32 under fp16 autocast as it did here (a
    layer scale's fp32 parameter promotes its product; a residual sum before its norm), and neither overflows
    nor flushes. The matmuls are linear layers and convolutions. None when the capture did not record which
    tensors the matmuls read (a run recorded by an older precprof, or before it with block formats off): every
    tensor counts then, as in a run without autocast. A matmul that ran outside autocast (its output fp32: the
    run keeps it in fp32, as keep_fp32 advises) casts nothing: what it reads stays fp32. An fp16-pure run is read
    alike: its fp32 tensors (a layer it holds in fp32, as transformers' ``_keep_in_fp32_modules`` holds T5's wo,
    and what passes its output on) reach fp16 only where an fp16 matmul reads them; a cast by code between
    modules makes a new tensor, read as that matmul's own input row, fp16 and counted as observed."""
    inputs = _gemm_inputs(run)
    if inputs is None:
        return None
    names = T.texts(acts[T.MODULE])
    outside = _outside_autocast(acts)  # modules (matmuls among them) whose every output was fp32
    read = {p for c, v in inputs.items() if c not in outside for p in v}
    own_input = names.str.endswith(T.INPUT_SUFFIX) & ~names.str.removesuffix(T.INPUT_SUFFIX).isin(outside)
    return _dtype_has(acts, "bfloat16") | acts[T.MODULE].isin(read) | own_input


def _all_flushed(run: _Run) -> bool:
    """Whether every gradient value recorded was an exact zero (no nan or inf among them), activation gradients
    in fp16 at loss scale 1: an unscaled fp16 run that flushed all of them (the weights' gradients, fp32 under
    autocast, are zeros computed from them, and so is an fp32 activation gradient: a GPT's embedding output,
    whose gradient is the fp32 residual sum's)."""
    g = run.kind(*T.GRADIENT_KINDS)
    ag = g[g[T.TENSOR] == T.ACTIVATION_GRAD]
    if ag.empty or not _dtype_has(ag, "float16").any():
        return False
    unscaled = bool((pd.to_numeric(ag[T.SCALE], errors="coerce").fillna(1.0) == 1.0).all())
    return unscaled and int(g[T.ZEROS].sum()) == int(g[T.NUMEL].sum()) > 0


def _rule_loss_scale(run: _Run, plan: _Plan, fwd_bad_steps: set[int]) -> None:
    cfg = run.cfg
    # Gradients of a step whose forward pass was already non-finite are nan/inf garbage: size the scale on
    # the other steps.
    excluded = len(fwd_bad_steps)
    if excluded:
        run = replace(
            run,
            layers=run.layers[~run.layers[T.STEP].isin(fwd_bad_steps)],
            hist=run.hist[~run.hist[T.STEP].isin(fwd_bad_steps)],
        )
    # the gradients of the layers fp16's keep list runs outside autocast stay fp32 there: the scale is sized, and
    # the underflow judged, on those an fp16 run following the advice computes in fp16
    kept = kept_gradients(run, plan.keep_fp16)
    # ... and those autocast computes in fp32 on its own (a LayerNorm's weight gradient): no scale overflows them
    own32 = autocast_fp32_gradients(run, kept)
    sized = own32.layers_without(kept.layers_without(run))
    amax, bound, clean = _grad_absmax(sized)
    gmax = max([x for x in (amax, bound) if x is not None], default=None)
    plan.grad_absmax = gmax
    # no step measured it: it comes from a step where some gradient was inf or nan, above every step without
    plan.grad_absmax_bound = gmax is not None and (clean is None or gmax > clean)
    plan.grad_absmax_clean = clean
    plan.grad_absmax_kept_left_out = kept.left_out
    plan.grad_absmax_fp32_left_out = own32.left_out
    limit = FP16.max / 2.0**cfg.fp16_margin_log2
    if (gmax is None or gmax <= 0) and _all_flushed(sized):
        k = cfg.flushed_loss_scale_log2
        plan.loss_scale_log2 = k
        plan.add(
            Finding(
                "fp16_loss_scale",
                INFO,
                f"fp16 loss scale {_pow2(k)}: every gradient flushed, how far to scale is not measured",
                "Every gradient value the run recorded was fp16 at loss scale 1 and an exact zero: each lay at or "
                "below 2^-25, where fp16 rounds to zero, and how far below is not known. "
                f"{_pow2(k)} lifts a gradient at that point to 0.5.",
                f"Start GradScaler at init_scale={_scale(k)} and let it back off where a gradient overflows (each "
                "halving skips a step); profile again to size the scale on measured gradients.",
                numbers={
                    "loss_scale_log2": k,
                    "loss_scale": 2.0**k,
                    "grad_absmax": None,
                    "steps_excluded": excluded,
                },
            )
        )
    elif gmax is None or gmax <= 0:
        k = cfg.default_loss_scale_log2
        plan.loss_scale_log2 = k
        plan.add(
            Finding(
                "fp16_loss_scale",
                INFO,
                f"fp16 loss scale {_pow2(k)}: no gradient statistics",
                (
                    f"All {excluded} sampled step(s) had a non-finite forward pass, so their gradients say "
                    "nothing about the loss scale"
                    if excluded
                    else "The run recorded no finite nonzero gradient"
                    if plan.gradients_measured
                    else "The run recorded no gradient (no sampled step with a backward pass"
                    + (
                        ")"
                        if plan.measured
                        else f"; it recorded no per-layer statistics at all{_none_why(run)})"
                    )
                )
                + f"; the loss scale falls back to GradScaler's default start of {_pow2(k)}.",
                "Profile at least one sampled step with a backward pass to size the loss scale.",
                numbers={
                    "loss_scale_log2": k,
                    "loss_scale": 2.0**k,
                    "grad_absmax": None,
                    "steps_excluded": excluded,
                },
            )
        )
    else:
        raw = _fitting_scale_log2(gmax, limit)
        k = min(max(raw, cfg.min_loss_scale_log2), cfg.max_loss_scale_log2)
        plan.loss_scale_log2 = k
        out = (
            f" (leaving out {excluded} sampled step(s) whose forward pass was already non-finite)"
            if excluded
            else ""
        )
        totals = run.hist_totals()
        counted = totals[~kept.rows(totals) & ~own32.rows(totals)]
        over = _shifted_overflow(_exponent_counts(counted, T.GRADIENT_KINDS), FP16, k)
        left = f", leaving out {kept.said(cfg.max_listed_modules)}" if kept.left_out else ""
        left += _own32_said(run, own32, bool(left))
        keeps = _scale_said(cfg, gmax, raw, k, over)
        overflows = math.ldexp(gmax, k) >= FP16.overflow_min
        if overflows:
            plan.fp16_block.append(
                f"no loss scale the advice allows keeps the gradients in fp16's range (at {_pow2(k)}, the smallest, "
                + (f"at least {int(over):,} gradient values overflow)" if over else "the largest overflows)")
            )
        if plan.grad_absmax_bound:
            src = (
                f"fp16 gradients became inf at scale {_g(FP16.overflow_min / bound)}"
                if bound is not None and bound >= (amax or 0)
                else "a step on which other gradients became inf or nan held it"
            )
            measured = (
                f"the largest on a step with no inf or nan gradient was {_g(clean)}"
                if clean is not None
                else "every sampled step had inf or nan gradients"
            )
            message = (
                f"The largest gradient magnitude is at least {_g(gmax)}: {src}, so no step measured it "
                f"({measured}){out}{left}. {keeps}; the true largest gradient may need a lower start."
            )
            remedy = (
                f"Start GradScaler at init_scale={_scale(k)} at the most. To size it, profile a few steps at a "
                "lower scale, or in bf16 or fp32, where the gradients do not overflow."
            )
        else:
            message = (
                f"The largest gradient magnitude seen is {_g(gmax)}{_whose(sized, gmax)}{out}{left}; {keeps}."
            )
            remedy = f"Start GradScaler at init_scale={_scale(k)}."
        if overflows:
            remedy = _too_large_remedy(run, raw, k)
        plan.add(
            Finding(
                "fp16_loss_scale",
                INFO,
                f"fp16 loss scale {_pow2(k)}" + (" at the most" if plan.grad_absmax_bound else ""),
                message,
                remedy,
                numbers={
                    "loss_scale_log2": k,
                    "loss_scale": 2.0**k,
                    "grad_absmax": gmax,
                    "margin": 2.0**cfg.fp16_margin_log2,
                    "scaled_absmax": math.ldexp(gmax, k),
                    "steps_excluded": excluded,
                    # clamped to the range the advice allows: the scale the gradients allow, and what overflows
                    **({"fitting_scale_log2": raw} if raw != k else {}),
                    **({"overflow_values": int(over)} if over else {}),
                    **({"kept_fp32_left_out": len(kept.modules)} if kept.left_out else {}),
                    **({"autocast_fp32_left_out": len(own32.modules)} if own32.left_out else {}),
                },
            )
        )
    _rule_fp16_underflow(run, plan, kept)
    if plan.fp16_scale_raises_underflow:
        for f in plan.findings:
            if f.code == "fp16_loss_scale":
                f.severity = INFO
                f.remedy = (
                    f"Do not lower GradScaler to {_scale(plan.loss_scale_log2)}: it raises gradient underflow "
                    f"over what the run had (fp16_gradient_underflow); use {_wider_than_fp16(run)}."
                )
    _rule_fp16_gradient_overflow(run, plan, kept)
    _no_scale_where_ruled_out(run, plan)
    _rule_fp16_no_loss_scaling(run, plan)
    _rule_scaler(run, plan)


def _own32_said(run: _Run, own32: KeptGradients, after: bool) -> str:
    """The gradients of the modules autocast computed in fp32 (``autocast_fp32_gradients``) that the scale leaves
    out, in words ("" where none is): to follow "leaving out" (``after``: another list came before)."""
    if not own32.left_out:
        return ""
    listed = run.cfg.max_listed_modules
    output = (
        f"the output gradients of {_listing(run.sort(own32.output), listed)}, which no matmul run in fp16 reads"
        if own32.output
        else ""
    )
    elsewhere = _autocast_elsewhere(run, own32.modules)
    if not own32.weight:  # (modules without weights: a dropout on an fp32 sum)
        return f"{'; and' if after else ', leaving out'} {output}, which autocast computed in fp32{elsewhere}"
    return (
        f"{'; and' if after else ', leaving out'} the weight gradients of {_listing(run.sort(own32.weight), listed)}, "
        "which autocast computed in fp32 (their outputs fp32 on every sampled step)"
        + (f", and {output}" if output else "")
        + elsewhere
    )


# module types whose whole forward CUDA autocast runs in fp16 (cuDNN's RNNs) and CPU autocast may leave in fp32
# (nn.GRU)
_RECURRENT_TYPES = ("LSTM", "GRU", "RNN")


def _autocast_elsewhere(run: _Run, modules: Iterable[str]) -> str:
    """Where the run's autocast device is not the target's (a CPU run advised for an H100), the words saying that
    the gradients ``modules`` held in fp32 are what autocast did on the recording device, and, of the recurrent
    layers among them, that autocast on a CUDA target runs them in fp16 ("" where the devices agree). A GRU LM
    recorded on a CPU, whose autocast leaves nn.GRU in fp32, read "left out: emb, rnn, drop, whose gradients an
    fp16 run holds in fp32" in its advice for an H100, where autocast runs the GRU in fp16 (reviewer t3)."""
    recorded = str(run.autocast.get("device_type") or "")
    target = str(run.hw.device or "")
    if not recorded or not target or recorded == target:
        return ""
    rnn = [m for m in run.sort(list(modules)) if run.types.get(m, "") in _RECURRENT_TYPES]
    where = f"the {run.hw.name}" if run.hw.preset else target
    return f" (autocast on this run's {recorded}; on {where} " + (
        f"autocast runs the recurrent layers ({_listing(rnn, run.cfg.max_listed_modules)}) in fp16, and the "
        "gradients through them with them, which this count leaves out)"
        if rnn and target == "cuda"
        else "the advice is for, autocast's lists of fp32 ops may differ)"
    )


def _whose(run: _Run, gmax: float) -> str:
    """Whose gradient the largest finite one ``gmax`` is among ``run``'s gradient rows, in words, by the parameter
    of a weight_grad row (" (blocks.0.v's weight gradient)", " (blocks.0.v's bias gradient)", " (attn.in_proj_weight's
    gradient)": a bias row read "weight gradient"); "" where no row holds it."""
    g = run.kind(*T.GRADIENT_KINDS)
    at = g[pd.to_numeric(g[T.ABSMAX], errors="coerce") == gmax]
    if at.empty:
        return ""
    row = at.iloc[0]
    name, param = _name(str(row[T.MODULE])), row.get(T.PARAM)
    param = param if isinstance(param, str) else ""
    if row[T.TENSOR] != T.WEIGHT_GRAD:
        whose = f"{name}'s output gradient"
    elif param in ("", "weight", "bias"):
        whose = f"{name}'s {param or 'weight'} gradient"
    else:  # a parameter of another name (MultiheadAttention's in_proj_weight), its dotted name as it is
        whose = f"{T.module_label(str(row[T.MODULE]))}.{param}'s gradient"
    return f" ({whose}, step {int(row[T.STEP])})"


def _no_scale_where_ruled_out(run: _Run, plan: _Plan) -> None:
    """Where the measurements rule fp16 out (``plan.fp16_block``, every fp16 rule having run), fp16_loss_scale
    gives no scale to start fp16 at: "Start GradScaler at init_scale=2^32" beside a finding that rules fp16 out
    at that very scale read as a plan that works. The scale stays in its title and numbers, as what the largest
    gradient allows."""
    if not plan.fp16_block:
        return
    for f in plan.findings:
        if f.code == "fp16_loss_scale" and f.remedy.startswith("Start GradScaler"):
            f.remedy = (
                f"No loss scale to start fp16 at: fp16 is ruled out ({'; '.join(plan.fp16_block)}), so "
                f"{_pow2(plan.loss_scale_log2)}, the scale sized on the largest gradient, is no plan. Use "
                f"{_wider_than_fp16(run)}."
            )


def _fitting_scale_log2(gmax: float, limit: float) -> int:
    """The largest k with ``gmax`` * 2^k < ``limit``, unclamped."""
    k = math.floor(math.log2(limit / gmax))
    # log2 is rounded: settle the strict inequality max|g| * 2^k < limit exactly.
    while math.ldexp(gmax, k) >= limit:
        k -= 1
    while math.ldexp(gmax, k + 1) < limit:
        k += 1
    return k


def _scale_said(cfg: AdvisorConfig, gmax: float, raw: int, k: int, over: float) -> str:
    """Why 2^k is the loss scale, for the largest gradient ``gmax``: the largest power of two keeping it below the
    margin under fp16's 65504 (2^``raw``), or the end of the range the advice allows (``cfg``'s loss-scale
    bounds) that it was clamped to: at the bottom the gradients do not fit (``over`` values, whole binades, a
    lower bound, overflow there), at the top they would allow more."""
    limit = FP16.max / 2.0**cfg.fp16_margin_log2
    below = f"65504 / {2**cfg.fp16_margin_log2} = {_g(limit)}"
    scaled = f"max|g| x 2^{k} = {_g(math.ldexp(gmax, k))}"
    if raw == k:
        return f"{_pow2(k)} is the largest power of two that keeps it below {below} ({scaled})"
    clamp = f"clamped to the configured range 2^{cfg.min_loss_scale_log2}..2^{cfg.max_loss_scale_log2}"
    if raw > k:
        return (
            f"{_pow2(k)} is the largest loss scale the advice allows and keeps it below {below} ({scaled}); the "
            f"gradients would allow up to 2^{raw}, {clamp} (AdvisorConfig.max_loss_scale_log2)"
        )
    fits = (
        f"at least {int(over):,} gradient values overflow fp16 there"
        if over
        else "the largest overflows fp16 there"
        if math.ldexp(gmax, k) >= FP16.overflow_min
        else "within fp16's 65504, without the headroom"
    )
    return (
        f"no loss scale the advice allows keeps it below {below}: it needs 2^{raw}, {clamp} "
        f"(AdvisorConfig.min_loss_scale_log2); at {_pow2(k)}, the smallest, {scaled}: {fits}"
    )


def _capped_scale(run: _Run, plan: _Plan, counts: pd.Series) -> tuple[int, float | None] | None:
    """Where the loss scale was held down to the largest the advice allows (AdvisorConfig.max_loss_scale_log2)
    and the scale the gradients allow, 2^raw, would hold all but a negligible share (``fp16_underflow_block``)
    of the activation-gradient values (``counts``, per binade): (raw, the share that flushes there). None where
    the cap is not what stops fp16: the gradients span more binades than it holds."""
    gmax, cfg = plan.grad_absmax, run.cfg
    if gmax is None or gmax <= 0 or plan.loss_scale_log2 < cfg.max_loss_scale_log2:
        return None
    raw = _fitting_scale_log2(gmax, FP16.max / 2.0**cfg.fp16_margin_log2)
    at_raw = _share(_shifted_underflow(counts, FP16, raw)[0], float(counts.sum()))
    if raw <= plan.loss_scale_log2 or (at_raw or 0.0) > cfg.fp16_underflow_block:
        return None
    return raw, at_raw


def _rule_out_for_underflow(
    run: _Run, plan: _Plan, counts: pd.Series, atk: float, norm_k: float | None, norm_mod: str | None
) -> str:
    """Rule fp16 out for activation gradients (``counts``, per binade) of which ``atk`` still underflow at the
    recommended scale, carrying ``norm_k`` of ``norm_mod``'s gradient norm, and return the remedy: the cap on
    the loss scale is what stops fp16 where the scale the gradients allow would hold them, else their span."""
    k = plan.loss_scale_log2

    def lost(scale: str) -> str:
        return (
            f"{_pct(atk)} of activation-gradient values still underflow fp16 at {_pow2(k)}, the largest {scale}, "
            f"taking {_pct(norm_k)} of {_name(norm_mod or '')}'s gradient norm with them"
        )

    capped = _capped_scale(run, plan, counts)
    if capped is None:
        plan.fp16_block.append(
            lost("safe loss scale") + " (the model's gradients span more binades than fp16 holds)"
        )
        return f"Use {_wider_than_fp16(run)}: no single fp16 loss scale covers these gradients' range."
    raw, at_raw = capped
    plan.fp16_block.append(
        lost("loss scale the advice allows")
        + f" (the gradients are so small that fp16 needs a loss scale of 2^{raw} to hold them)"
    )
    return (
        f"Use {_wider_than_fp16(run)}: fp16 needs a loss scale of 2^{raw} to lift these gradients into its range "
        f"({_pct(at_raw)} of them would flush there), above the {_pow2(k)} the advice allows "
        "(AdvisorConfig.max_loss_scale_log2)"
        + (
            f" and beyond what GradScaler can hold (it keeps its scale in fp32, at most 2^{FP32_MAX_EXPONENT})"
            if raw > FP32_MAX_EXPONENT
            else ""
        )
        + "."
    )


def _wider_than_fp16(run: _Run) -> str:
    """The formats a remedy sends gradients that fp16 cannot hold to: bf16 or fp32, or fp32 alone where bf16
    flushes them too (bf16_gradient_underflow's threshold)."""
    _, _, share = bf16_gradient_underflow(run)
    if share is not None and share > run.cfg.bf16_underflow_block:
        return f"fp32 (bf16, without a loss scale, flushes {_pct(share)} of them to zero: bf16_gradient_underflow)"
    return "bf16 or fp32"


def _too_large_remedy(run: _Run, raw: int, k: int) -> str:
    """What to do with gradients too large for fp16 at the smallest loss scale the advice allows (2^k)."""
    return (
        f"Use {_wider_than_fp16(run)}, or make the gradients smaller where they arise (a loss summed rather than "
        f"averaged over a large batch, unnormalised targets): fp16 needs a loss scale of 2^{raw} for them, below "
        f"the {_pow2(k)} the advice goes down to."
    )


@dataclass(frozen=True)
class _Flush:
    """The modules whose zeros among fp16 activation gradients are judged flushes (``_flushed_modules``)."""

    modules: list[str]  # in the run's order
    empty: list[str]  # those of them whose every value is an exact zero: no gradient reached fp16's range
    masked: list[str]  # those of them whose zeros are not counted: a mask after them may have written them
    zeros: float  # the exact zeros of those counted
    all_zeros: float  # the exact zeros of every row read, theirs and the true zeros of the others
    values: float  # every value of the rows whose zeros count (``_masks_none``), the share's denominator
    floor_share: float | None  # the share of their nonzero values fp16 held at its smallest subnormal, 2^-24
    smallest: float  # their smallest nonzero value as fp16 held it (at its loss scale); nan without one
    scales: list[float]  # the loss scales their rows were held at
    counted: list[str]  # the modules whose zeros count (``_masks_none``), flushed or not
    counted_all: bool  # every module's zeros count (no record of which module's output a matmul read)
    masked_share: (
        float | None
    )  # the share of zeros among every value of ``masked``: the most that flushed there
    masks: list[str] = field(
        default_factory=list
    )  # the modules that may have written them (``_masks_after``)

    @property
    def share(self) -> float | None:
        return _share(self.zeros, self.values)

    @property
    def masked_only(self) -> bool:
        """Only modules whose zeros are not counted run into the floor: flushed, by how many the run cannot tell
        (the share of counted zeros, 0, says nothing of them)."""
        return bool(self.modules) and len(self.masked) == len(self.modules)


def _masks_none(run: _Run, per: pd.DataFrame) -> set[str]:
    """The modules among the fp16 activation-gradient rows ``per`` whose zeros can only be flushes: those whose
    output a matmul read (capture.gemm_inputs), whose gradient that matmul's backward computed in fp16 straight
    from its own (a flushed value, no true zero), and those whose every value is an exact zero. Any other module's
    gradient may have passed a mask on its way: ReLU's backward writes an exact zero wherever its unit was off,
    into the gradient of the layer before it (fc1's), while the gradient it received (act1's) holds only the
    flushes. Every module where the run did not record which output a matmul read."""
    inputs = _gemm_inputs(run)
    if inputs is None:
        return {str(m) for m in per.index}
    read = {p for made in inputs.values() for p in made}
    return {str(m) for m in per.index if m in read or per.loc[m, T.ZEROS] == per.loc[m, T.NUMEL]}


def _masks_after(run: _Run, modules: list[str]) -> list[str]:
    """The recorded modules whose backward writes exact zeros (taxonomy.writes_backward_zeros: a ReLU, a dropout,
    a max-pool) that ran after one of ``modules`` in the forward pass, before the next matmul layer: a zero in
    their gradients may be one of theirs. A matmul's backward sums over its values, which leaves no mask's zero
    behind it. Any other mask is a function the forward calls (torch.relu, F.dropout, masked_fill), which precprof
    does not see."""
    seq = run.sort(run.types)  # forward order
    masks: set[str] = set()
    for m in modules:
        for n in seq[seq.index(m) + 1 :] if m in seq else []:
            kind = run.types.get(n, "")
            if taxonomy.is_matmul_type(kind):
                break
            if taxonomy.writes_backward_zeros(kind):
                masks.add(n)
    return run.sort(masks)


def _flushed_modules(run: _Run, rows: pd.DataFrame) -> _Flush:
    """Which modules' zeros among the fp16 activation-gradient ``rows`` are flushes. An exact zero in an fp16
    tensor is a value that underflowed or a true zero (ReLU's backward writes one wherever its unit was off, a
    saturated GELU's where its slope is 0), and no count tells them apart. A module's gradient is read as flushed
    when its nonzero values run into the floor (more than ``fp16_flushed_floor_share`` of them at fp16's
    smallest subnormal, at the scale held) or when every value of it is an exact zero (one holding inf or nan
    besides its zeros received a gradient, which overflowed). Its zeros are counted as flushes where no mask can
    have written them (``_masks_none``), out of every value of such modules."""
    if rows.empty:
        return _Flush([], [], [], 0.0, 0.0, 0.0, None, math.nan, [], [], True, None)
    per = rows.groupby(T.MODULE)[[T.ZEROS, T.NUMEL, T.NAN, T.INF]].sum()
    nonzero = (per[T.NUMEL] - per[T.ZEROS] - per[T.NAN] - per[T.INF]).clip(lower=0)
    at_floor = _at_fp16_floor(run, rows).reindex(per.index, fill_value=0.0)
    dense = at_floor > run.cfg.fp16_flushed_floor_share * nonzero
    zeros_only = per[T.ZEROS] == per[T.NUMEL]
    mods = run.sort(str(m) for m in per.index[(per[T.ZEROS] > 0) & (dense | zeros_only)])
    counted = _masks_none(run, per)
    masked = [m for m in mods if m not in counted]
    held = rows[rows[T.MODULE].isin(mods)]
    smallest = pd.to_numeric(held[T.ABSMIN], errors="coerce") * held[T.SCALE]
    return _Flush(
        mods,
        [m for m in mods if zeros_only[m]],
        masked,
        float(per.loc[[m for m in mods if m in counted], T.ZEROS].sum()),
        float(per[T.ZEROS].sum()),
        float(per.loc[sorted(counted), T.NUMEL].sum()),
        _share(float(at_floor[mods].sum()), float(nonzero[mods].sum())),
        float(smallest[smallest > 0].min()) if (smallest > 0).any() else math.nan,
        sorted({float(s) for s in held[T.SCALE].unique()}),
        run.sort(counted),
        len(counted) == len(per),
        _share(float(per.loc[masked, T.ZEROS].sum()), float(per.loc[masked, T.NUMEL].sum())),
        _masks_after(run, masked),
    )


def _held_bins(exponent: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The binades of histogram rows' values as the backward held them, at each row's loss scale ``scale``: the
    capture counted the held values' binades and moved them by the rounded log2 of the scale (``stats.decode``), a
    whole number of binades, which this moves back (exact at any scale; moved by the scale's own log2, a row at
    1000, 2^9.97, read a binade below the one it held its values in)."""
    ok = (scale > 0) & np.isfinite(scale)
    return exponent + np.round(np.log2(np.where(ok, scale, 1.0)))


def _at_fp16_floor(run: _Run, rows: pd.DataFrame, below: int = FP16.min_exponent + 1) -> pd.Series:
    """Per module of the fp16 activation-gradient ``rows``, the nonzero values fp16 held below 2^``below`` (by
    default at its smallest subnormal, 2^-24): from the rows' histograms, as held at each row's loss scale
    (``_held_bins``)."""
    hist = run.hist[_rows_of_kinds(run.hist[T.TENSOR], (T.ACTIVATION_GRAD,))]
    at = _row_index(hist, rows)
    ok = at >= 0
    held = _held_bins(hist[T.EXPONENT].to_numpy(dtype=float)[ok], rows[T.SCALE].to_numpy(dtype=float)[at[ok]])
    floor = held < below
    modules = T.texts(rows[T.MODULE]).to_numpy()[at[ok]][floor]
    return pd.Series(hist[T.COUNT].to_numpy(dtype=float)[ok][floor]).groupby(modules).sum()


def _subnormal_share(run: _Run, rows: pd.DataFrame, modules: list[str]) -> float | None:
    """The share of the nonzero values of ``modules`` among the fp16 activation-gradient ``rows`` that fp16 held
    among its subnormals, below 2^-14, at each row's loss scale: values with fewer than its 11 significant bits."""
    mine = rows[rows[T.MODULE].isin(modules)]
    return _share(float(_at_fp16_floor(run, mine, FP16.normal_min_exponent).sum()), _nonzero(mine))


def _fp32_under_autocast(run: _Run, ag: pd.DataFrame) -> set[str]:
    """The modules of an autocast run whose activation gradients were fp32 on every row: a gradient has its
    tensor's dtype, and a tensor autocast left in fp32 (a layer run outside autocast, as keep_fp32 advises, and
    the ops after it) stays fp32 under fp16 autocast too, so fp16 flushes none of it; an fp16-pure run's fp32
    gradients alike (a layer it holds in fp32, and what passes its output on: the run is what fp16 holds). Empty
    without autocast (an fp32 run), where every gradient is what fp16 would hold."""
    if not (run.autocast.get("enabled") or fp16_pure(run)) or ag.empty:
        return set()
    names = T.texts(ag[T.MODULE])
    low = (_dtype_has(ag, "float16") | _dtype_has(ag, "bfloat16")).to_numpy()
    return set(names[~low]) - set(names[low])


def _had_loss_scale(run: _Run, ag: pd.DataFrame) -> bool:
    """Whether the run scaled its loss on any step: a scale other than 1 in its steps or its activation-gradient
    rows (a dynamic GradScaler that backed off through 1 still had one)."""
    scales = pd.to_numeric(run.steps[T.LOSS_SCALE], errors="coerce").dropna()
    return bool((scales != 1.0).any() or (ag[T.SCALE] != 1.0).any())


def _scaler_at_1(run: _Run, ag: pd.DataFrame) -> tuple[str, str] | None:
    """(the loss scaler's name, what it did, in words) of a run that had one and scaled nothing with it: its
    capture says an enabled GradScaler was given (or its configuration a loss scaling other than none) and no
    step or gradient row holds a scale other than 1 (a dynamic GradScaler started at init_scale=1 that never grew).
    None where it had none or is not known to, and where it scaled. Such a run is told to start its scaler higher,
    never that it trained without one (fp16_no_loss_scaling does not fire for it)."""
    if _had_loss_scale(run, ag):
        return None
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    said = run.run_config.get("loss_scaling")
    if isinstance(capture, Mapping) and capture.get("scaler_enabled"):
        name, growth = str(capture.get("scaler") or "GradScaler"), capture.get("scaler_growth_interval")
    elif said and said != "none":
        name, growth = "loss scaler", None
    else:
        return None
    n = int(run.steps[T.STEP].nunique()) if not run.steps.empty else 0
    why = (
        f" (it started there, and grows only after {growth:,} steps without an overflow"
        + (f", more than this run's {n:,}" if 0 < n < growth else "")
        + ")"
        if isinstance(growth, int) and growth > 0
        else ""
    )
    return name, f"{name} held a loss scale of 1 on every step{why}"


def _mask_said(run: _Run, masks: list[str]) -> str:
    """The zeros the modules ``masks`` (``_masks_after``) may have written, in words, with their types."""
    types = ", ".join(sorted({run.types.get(m, "") for m in masks} - {""}))
    return (
        f"the zeros {_listing(masks, run.cfg.max_listed_modules)} ({types}) write in backward wherever their forward "
        "dropped or clipped a value (a ReLU's where its unit was off, a dropout's where it dropped one)"
    )


def _no_mask_said() -> str:
    """Where a mask's zeros can come from in a run whose recorded modules write none after the gradients: a
    function the forward calls, which precprof does not see."""
    return (
        "a function their output passes through before the next layer wrote some in backward (torch.relu, "
        "F.dropout or masked_fill: no module recorded there writes zeros in backward, and precprof does not see "
        "functions)"
    )


# what the flushed evidence rests on, the method of a finding that opens with it: the counts cannot see a flush
_FLUSH_IS_A_ZERO = (
    "A value fp16 flushed is an exact zero in the tensor precprof reads, so no count of values below fp16's floor "
    "sees it: the zeros of the gradients that run into the floor are the evidence of what was lost."
)


def _flushed_said(
    run: _Run, fl: _Flush, every: bool, scaled: bool, at_1: tuple[str, str] | None
) -> tuple[str, str]:
    """(the flushed evidence in words, which opens the finding; how it is judged, for the finding's method): a
    value that underflowed is a zero, so the counts that follow it cannot see what was lost. ``at_1``: the
    scaler of a run that had one at 1 all along (``_scaler_at_1``), which it did not train without."""
    cfg = run.cfg
    where = (
        f"This fp16 run scaled its loss ({_scales(fl.scales)} where these gradients flushed)"
        if scaled
        else f"This fp16 run's {at_1[1]}"
        if at_1 is not None
        else "This fp16 run trained without loss scaling"
    )
    if every:
        return (
            f"{where}, and every one of its fp16 activation-gradient values is an exact zero: no gradient reached "
            "fp16's range, all of them were flushed to zero",
            _FLUSH_IS_A_ZERO,
        )
    dense = [m for m in fl.modules if m not in fl.empty]
    if fl.masked_only:
        why = (
            f"mix flushes with {_mask_said(run, fl.masks)}"
            if fl.masks
            else f"are flushes unless {_no_mask_said()}"
        )
        return (
            f"{where}: {_pct(fl.floor_share)} of the nonzero values of {_listing(dense, cfg.max_listed_modules)} sit "
            "at its smallest subnormal, 2^-24: their gradients run into fp16's floor, and what lies below it was "
            f"flushed to zero. At most {_pct(fl.masked_share)} of their values were flushed: their zeros, "
            + ("some of them a mask's" if fl.masks else "unless a function wrote some in backward"),
            f"{_FLUSH_IS_A_ZERO} Why at most: these zeros {why}; the gradients where a zero can only be a flush "
            "(those a matmul's backward computed) do not run into the floor to tell.",
        )
    parts = [f"{_listing(fl.empty, cfg.max_listed_modules)} held no nonzero value"] if fl.empty else []
    if dense:
        parts.append(
            f"{_pct(fl.floor_share)} of the nonzero values of {_listing(dense, cfg.max_listed_modules)} sit at its "
            "smallest subnormal, 2^-24"
        )
    counted = [m for m in fl.modules if m not in fl.masked]
    whose = (
        "its fp16 activation-gradient values"
        if fl.counted_all
        else f"the fp16 activation-gradient values of {_listing(fl.counted, cfg.max_listed_modules)}"
    )
    method = _FLUSH_IS_A_ZERO + (
        ""
        if fl.counted_all
        else f" The zeros counted are those of {_listing(fl.counted, cfg.max_listed_modules)}: a matmul's backward "
        "computed their gradients from the gradient it received, or none held a nonzero value, so a zero there can "
        "only be a flush."
    )
    said = (
        f"{where}: {_pct(fl.share)} of {whose} are exact zeros, in {len(counted)} module(s) whose gradients run "
        f"into fp16's floor ({'; '.join(parts)}): what lies below it was flushed to zero"
    )
    if fl.masked:
        masked = _listing(fl.masked, cfg.max_listed_modules)
        return (
            said + f"; {masked} run into the floor too, but their zeros are not counted",
            method
            + f" The zeros of {masked} are not counted: "
            + (
                f"they may hold {_mask_said(run, fl.masks)}."
                if fl.masks
                else f"some may not be flushes, if {_no_mask_said()}."
            ),
        )
    others = _share(fl.all_zeros - fl.zeros, fl.values) or 0.0
    return said + (
        f"; the other {_pct(others)} zeros, in modules whose gradients thin out before the floor, are not "
        "counted (ReLU's backward writes an exact zero wherever its unit was off)"
        if others > cfg.fp16_underflow_ok and fl.counted_all
        else ""
    ), method


def _flushed_of(run: _Run, fl: _Flush) -> str:
    """Whose values the flushed share (``fl.share``) is of, for a title: the modules whose zeros count
    (``fl.counted``), as the message names them; nothing where every fp16 activation gradient's zeros count."""
    return "" if fl.counted_all else f" of the values of {_listing(fl.counted, run.cfg.max_listed_modules)}"


def _flushed_remedy(
    fl: _Flush, every: bool, k: int, run_scale: float | None, scaler: str | None = None
) -> str:
    """What to do about gradients flushed at the scale the run had (``run_scale``; None without a loss scaler): a
    larger scale where the measured gradients allow one (2^k), else a format with more range. ``scaler``: the
    name of the scaler a run had at 1 all along (``_scaler_at_1``): it is told to start that one higher."""
    lead = f"Start your {scaler} higher than 1" if scaler is not None else "Scale the loss"
    make = "start it at init_scale=" if scaler is not None else "start GradScaler(init_scale="
    shut = "" if scaler is not None else ")"
    if run_scale is not None and 2.0**k <= run_scale:
        return (
            f"No larger loss scale fits: the largest the measured gradients allow, {_pow2(k)}, is not above the "
            f"run's {_loss_scale_said(run_scale)}, where these gradients flushed. Train in bf16 (its range reaches 2^-133) or "
            "fp32, or keep the layers these gradients pass through in fp32."
        )
    if every or fl.empty:
        lift = (
            f"which lifts every gradient {_binades_above(k, run_scale)} binade(s) above the run's "
            f"{_loss_scale_said(run_scale)}"
            if run_scale is not None
            else f"which lifts a gradient at fp16's flush point (2^-25) to {_scale(k - 25)}"
        )
        return (
            f"{lead}: {'no gradient' if every else _listing(fl.empty, 6) + ' received no gradient that'} "
            f"reached fp16's range, so how far is not measured; {make}{_scale(k)}{shut}, {lift}, "
            "let it back off where one overflows, and profile again to size it; or train in bf16."
        )
    return (
        f"{lead}: {'init_scale=' if scaler is not None else 'GradScaler(init_scale='}{_scale(k)}{shut}, the largest "
        "scale the measured gradients allow, lifts "
        "them off fp16's floor"
        + (
            f" ({_binades_above(k, run_scale)} binade(s) above the run's {_loss_scale_said(run_scale)})"
            if run_scale is not None
            else ""
        )
        + "; or train in bf16."
    )


def _run_scale(ag: pd.DataFrame) -> float:
    """The loss scale the run trained at: the median of the scales of the activation-gradient rows ``ag``, those
    of the steps the optimizer took (a skipped step's scale is one the scaler left), the higher middle one of an
    even count, so that it is a scale the run had (their mean, or a log2 rounded to a power of two, may be none
    it had: GradScaler(init_scale=1e12) backed off to 953674.3, read as 2^20); 1 without any. The median of the
    distinct scales was read: a scaler that backed off from 2^16 through 2^12 to the 2^11 it then trained at read
    as 2^14."""
    scales = np.sort(pd.to_numeric(ag[T.SCALE], errors="coerce").to_numpy(dtype=float))
    scales = scales[np.isfinite(scales) & (scales > 0)]
    return float(scales[len(scales) // 2]) if len(scales) else 1.0


def _flushed_at_scale(hist: pd.DataFrame, rows: pd.DataFrame, target: float) -> tuple[float, float]:
    """(values that fp16 surely flushes at loss scale ``target``, those it may) of the activation-gradient
    histogram rows ``hist``, each as held at its layer row's scale in ``rows`` (``_held_bins``), then moved to
    ``target``: by a whole number of binades where ``target`` is a power of two times that scale (every row of a
    scaler whose factors are powers of two: GradScaler's defaults), where the count is exact (the values lying
    exactly on 2^-25, which round to 0, left out as ``_shifted_underflow`` leaves them); by a fraction of one
    otherwise, where the binade across fp16's flush point may flush in part, so the count is bounded by it."""
    if hist.empty:
        return 0.0, 0.0
    at = _row_index(hist, rows)
    held = rows[T.SCALE].to_numpy(dtype=float)
    scale = np.where(at >= 0, held[np.clip(at, 0, None)] if len(held) else 1.0, 1.0)
    scale = np.where((scale > 0) & np.isfinite(scale), scale, 1.0)
    b = _held_bins(hist[T.EXPONENT].to_numpy(dtype=float), scale)
    d = np.log2(target / scale)  # exact where the ratio is a power of two
    lim = _log2i(FP16.underflow_max)
    count = hist[T.COUNT].to_numpy(dtype=float)
    sure = b + 1 + d <= lim
    maybe = ~sure & (d != np.round(d)) & (b + d < lim)
    return float(count[sure].sum()), float(count[maybe].sum())


def _at_run_said(lo: float | None, hi: float | None) -> str:
    """The share lost at the run's scale, exact (``lo`` == ``hi``) or as the bound it is."""
    return _pct(lo) if hi is None or lo == hi else f"between {_pct(lo)} and {_pct(hi)}"


def _binades_above(k: int, run_scale: float) -> str:
    """How many binades 2^k is above ``run_scale``: a whole number for a power of two, else to two places."""
    d = k - math.log2(run_scale)
    return f"{round(d)}" if d == round(d) else f"{d:.2f}"


def _sampled_steps(run: _Run) -> set[int]:
    """The sampled steps with activation-gradient rows."""
    return {int(s) for s in pd.to_numeric(run.kind(T.ACTIVATION_GRAD)[T.STEP], errors="coerce").dropna()}


def _went_through(run: _Run) -> tuple[_Run, int]:
    """``run`` without the rows of the steps the loss scaler skipped, and how many sampled steps that leaves out.
    A skipped step is no evidence of what fp16 flushes: its gradients went inf or nan at the scale, a mask's
    backward wrote zeros over them (ReLU's over nan: a module "held no nonzero value"), and its finite values
    were held at a scale that overflowed. With several optimizers under the scaler, a step it skipped some of
    them on keeps the rows of the others (their gradients trained: ``_skipped_rows``)."""
    skipped = _skipped_steps(run.steps)
    left_out = len(_sampled_steps(run) & skipped)
    if not left_out:
        return run, 0
    return replace(
        run,
        layers=run.layers[~_skipped_rows(run, run.layers)],
        hist=run.hist[~_skipped_rows(run, run.hist)],
    ), left_out


def _left_out_said(left_out: int, run: _Run) -> str:
    """The sentence on the sampled steps the scaler skipped, which no count of the finding holds ("" when none);
    ``run`` is the run without them (``_went_through``)."""
    if not left_out:
        return ""
    each, partial = _skipped_optimizers(run)
    some = sorted(s for s in partial if len(partial[s]) < len(each))
    if some:  # several optimizers, some of which stepped on a step the scaler skipped others on
        which = sorted({k for s in partial for k in partial[s]})
        names = ", ".join(_optimizer_named(each, k) for k in which)
        return (
            f" On {left_out} sampled step(s) the loss scaler skipped the step of {names}: the gradients of "
            f"{'those optimizers' if len(which) > 1 else 'that optimizer'} on them are left out (they overflowed "
            "at its scale: their finite values say nothing of what fp16 flushes on a step that trains), those of "
            "the optimizers that stepped are counted."
        )
    return (
        f" Every gradient counted here is of the {len(_sampled_steps(run))} sampled step(s) the optimizer took; "
        f"the {left_out} the loss scaler skipped are left out (their gradients overflowed at its scale: their "
        "finite values say nothing of what fp16 flushes on a step that trains)."
    )


def _rule_fp16_underflow(run: _Run, plan: _Plan, kept: KeptGradients) -> None:
    """fp16_gradient_underflow: what fp16 flushes of the gradients at the recommended scale, of those an fp16
    run following the advice computes in fp16 (``kept``: the keep list's gradients that stay fp32 are left
    out), against what this run lost."""
    cfg = run.cfg
    k = plan.loss_scale_log2
    # Every count is read on the steps that went through (``_went_through``); where none did, nothing is said
    # (the overflow findings say why).
    run, left_out = _went_through(run)
    ag = run.kind(T.ACTIVATION_GRAD)
    if left_out and ag.empty:
        return
    stay32 = _fp32_under_autocast(run, ag)
    ag = ag[~ag[T.MODULE].isin(stay32)]
    # what the run held in fp16 and lost (its flushed zeros) is told of every gradient it held there; what fp16
    # would flush (the exact counts of the others, the histograms' shares at a scale), of the gradients an fp16
    # run following the advice computes in fp16 (``kept``: those of the layers kept in fp32 stay fp32)
    held = run.hist_totals()
    every = held[~kept.rows(held)]
    totals = every[(every[T.TENSOR] == T.ACTIVATION_GRAD) & ~every[T.MODULE].isin(stay32)]
    counts = _exponent_counts(totals, (T.ACTIVATION_GRAD,))
    total = float(counts.sum())
    if ag.empty and total == 0:
        return
    # the modules whose activation gradients the totals leave out for staying fp32 under fp16 autocast, named
    # (those of the keep list are named apart, below), so that a sum of the run's histograms checks the figure
    held_ag = set(T.texts(held.loc[held[T.TENSOR] == T.ACTIVATION_GRAD, T.MODULE]))
    left = run.sort((held_ag & set(stay32)) - set(kept.output))
    left_said = (
        f"; left out: {_listing(left, cfg.max_listed_modules)}, whose gradients "
        + (
            f"this run held in fp32{elsewhere}"
            if (elsewhere := _autocast_elsewhere(run, left))
            else "an fp16 run holds in fp32"
        )
        if left
        else ""
    )
    # Now: exact counts at the scale in effect, on tensors that were not already fp16 (in an fp16 tensor the
    # flushed values are zeros already and cannot be told from true zeros).
    not16 = ag[~_dtype_has(ag, "float16") & ~kept.rows(ag)]
    nz_now = _nonzero(not16)
    now = _share(float(not16[T.underflow_col("fp16")].sum()), nz_now)
    is16 = ag[_dtype_has(ag, "float16")]
    # the fp16 activation gradients a norm's overflow zeroed (fp16_norm_overflow: the backward of a row it zeroed
    # passes back 0 to the modules before it) are no underflow, and no loss scale changes them: their zeros are
    # left out of the flushed evidence and of the share of zeros, and said apart
    starved = [m for m in run.sort(plan.fp16_norm_starved) if m in set(T.texts(is16[T.MODULE]))]
    own16 = is16[~T.texts(is16[T.MODULE]).isin(starved).to_numpy()]
    zero16 = _share(float(own16[T.ZEROS].sum()), float(own16[T.NUMEL].sum()))
    scales = sorted({float(s) for s in not16[T.SCALE].unique()})
    sure1, _ = _shifted_underflow(counts, FP16, 0)
    sure_k, boundary_k = _shifted_underflow(counts, FP16, k)
    over_k = _shifted_overflow(counts, FP16, k)
    at1 = _share(sure1, total)
    atk = _share(sure_k, total)
    # The scale the run had (1 without a scaler), from every activation-gradient row: a run whose activation
    # gradients are all fp16 (CPU autocast keeps its norms in fp16) was read as unscaled and told to scale its
    # loss. A recommended scale below it that loses more of the gradients' values than the run did is no
    # remedy when those values carry some of a module's gradient norm: the gradients span more than fp16 holds.
    # Its share there is that of each row's values as held (``_flushed_at_scale``): exact at a scale no power of
    # two too (953674.3 was read as 2^20), bounded where rows were held a fraction of a binade away from it.
    run_scale = _run_scale(ag)
    unscaled = run_scale == 1.0
    ag_hist = run.hist[_rows_of_kinds(run.hist[T.TENSOR], (T.ACTIVATION_GRAD,))]
    ag_hist = ag_hist[~kept.rows(ag_hist).to_numpy() & ~T.texts(ag_hist[T.MODULE]).isin(stay32).to_numpy()]
    run_sure, run_maybe = _flushed_at_scale(ag_hist, ag, run_scale)
    at_run, at_run_hi = _share(run_sure, total), _share(run_sure + run_maybe, total)
    # Held in fp16 at scale 1, a gradient below 2^-25 was a zero before precprof read it: the histograms of those
    # tensors hold nothing fp16 flushed, and their share at scale 1 is unknown, not 0% (an unscaled fp16 llm.c
    # run read '0% at scale 1 ... Nothing to fix' where the same run in fp32 had 0.48% below fp16's floor). The
    # share at scale 1 is that of the tensors that were not fp16, or none.
    blind = unscaled and not is16.empty
    if blind:
        seen = _exponent_counts(totals[~totals[T.MODULE].isin(set(is16[T.MODULE]))], (T.ACTIVATION_GRAD,))
        at1 = at_run = at_run_hi = _share(_shifted_underflow(seen, FP16, 0)[0], float(seen.sum()))
    at_run_said = _at_run_said(at_run, at_run_hi)
    run_said = _loss_scale_said(run_scale)
    norm = _lost_norm_share(totals, FP16, k)
    norm_k = float(norm.max()) if not norm.empty else None
    norm_mod = str(norm.idxmax()) if not norm.empty else None
    residual_matters = norm_k is None or norm_k > cfg.fp16_underflow_norm_ok
    worse_than_run = (
        2.0**k < run_scale
        and atk is not None
        and (atk - (at_run_hi or 0.0)) > cfg.fp16_underflow_ok
        and residual_matters
    )
    if worse_than_run:
        plan.fp16_scale_raises_underflow = True
        plan.fp16_block.append(
            f"the largest fp16 loss scale the gradients allow, {_pow2(k)}, is below the {run_said} this run "
            f"had and raises activation-gradient underflow from {at_run_said} to {_pct(atk)}"
        )
    plan.underflow_now, plan.underflow_at_1, plan.underflow_at_rec = now, at1, atk
    wg = _exponent_counts(every, (T.WEIGHT_GRAD,))
    wg_sure, _ = _shifted_underflow(wg, FP16, k)
    wg_share = _share(wg_sure, float(wg.sum()))
    now_txt = (
        f"{_pct(now)} of {int(nz_now):,} nonzero activation-gradient values"
        + (" that were not fp16" if not is16.empty else "")
        + f" flush to zero in fp16 at the run's {_scales(scales)} (exact counts)"
        if now is not None
        else "the activation gradients were already fp16, so their flushed values are indistinguishable from zeros"
    )
    if zero16 is not None:
        now_txt += f"; fp16 activation gradients in this run are {_pct(zero16)} zeros" + (
            f" (those of {_listing(starved, cfg.max_listed_modules)} left out)" if starved else ""
        )
    msg = (
        f"{now_txt[0].upper()}{now_txt[1:]}. From the exponent histograms ({int(total):,} nonzero values"
        + (
            f", those fp16 kept{left_said}): "
            + (f"{_pct(at1)} at scale 1 of the gradients that were not fp16, and " if at1 is not None else "")
            + f"{_pct(atk)} would flush at the recommended scale {_pow2(k)}"
            if blind
            else f"{left_said}): {_pct(at1)} at scale 1 and {_pct(atk)} at the recommended scale {_pow2(k)}"
            if unscaled
            # a scaled run's own share comes first: scale 1 is only what it would lose without its scaler (a
            # GradScaler run at 2^16 read '0.191% at scale 1', taken for what the run lost, which was 0%)
            else f"{left_said}): {at_run_said} at the run's loss scale {run_said}"
            + (
                " (bounded: the values of the rows held at scales a fraction of a binade away from it fall across "
                "a binade's edge there)"
                if at_run != at_run_hi
                else ""
            )
            + f", {_pct(at1)} at scale 1 had it scaled no loss, and {_pct(atk)} at the recommended scale {_pow2(k)}"
        )
        + (
            f" (plus at most {int(boundary_k):,} values lying exactly on 2^-25, which round to 0)"
            if boundary_k
            else ""
        )
        + (f"; {int(over_k):,} values would overflow at that scale" if over_k else "")
        + "."
        + _left_out_said(left_out, run)
        + (
            f" The counts of what fp16 would flush leave out {kept.said(cfg.max_listed_modules)}."
            if kept.left_out
            else ""
        )
    )
    # Already flushed: in an fp16 tensor, at whatever loss scale it was held, a value that underflowed is a
    # zero. Many zeros in modules whose gradients run into the floor (``_flushed_modules``), or a module that
    # received no nonzero gradient at all, are the evidence.
    # every value zero: nothing reached fp16's range at all (the worst case, with no smallest value to show)
    all_zero16 = not own16.empty and float(own16[T.ZEROS].sum()) == float(own16[T.NUMEL].sum()) > 0
    fl = _flushed_modules(run, own16)
    flushed = (fl.share or 0) > cfg.fp16_flushed_zero_share or bool(fl.empty) or fl.masked_only
    plan.fp16_masks = fl.masks
    scaled = _had_loss_scale(run, ag)
    at_1 = _scaler_at_1(run, ag)  # a scaler the run had, held at 1: not a run without one
    lead = f"Start your {at_1[0]} higher than 1" if at_1 is not None else "Scale the loss"
    # Fewer flushes than that, in a run that scaled its loss: gradients that run into the floor at the run's scale,
    # with more than a negligible share of zeros where a zero can only be a flush, sit among fp16's subnormals and
    # lose a few percent there (an unscaled run's are fp16_no_loss_scaling's): a warning, not "Nothing to fix"
    thin = not flushed and scaled and bool(fl.modules) and (fl.share or 0) > cfg.fp16_underflow_ok
    sub = _subnormal_share(run, own16, fl.modules) if thin else None
    loss_change = _loss_change(run)
    stalled = _stalled(run, loss_change)
    method = ""
    if flushed or thin:  # what the run lost comes first: the exact counts above see none of it
        flushed_said, method = _flushed_said(run, fl, all_zero16, scaled, at_1)
        msg = (
            flushed_said
            + (
                f"; at that scale {_pct(sub)} of the nonzero values of {_listing(fl.modules, cfg.max_listed_modules)} "
                "sit among fp16's subnormals, below 2^-14, where fewer than its 11 significant bits are left"
                if thin
                else ""
            )
            + (
                (
                    f"; the loss did not move (it changed by {_pct(abs(loss_change))} over the run): training "
                    "stalled"
                    if stalled
                    else f"; the loss {'rose' if loss_change > 0 else 'fell'} by {_pct(abs(loss_change))} over "
                    "the run" + _why_not_stalled(run, loss_change)
                )
                if loss_change is not None
                else ""
            )
            + ". "
            + msg
        )
    if (atk or 0) > cfg.fp16_underflow_ok and norm_k is not None and norm_mod is not None:
        msg += (
            f" The values still lost at {_pow2(k)} (all below 2^{_log2i(FP16.underflow_max) - k}) carry at most "
            f"{_pct(norm_k)} of a module's activation-gradient L2 norm ({_name(norm_mod)}; an upper bound from the "
            "histogram)"
            + (
                f": above the {_pct(cfg.fp16_underflow_norm_ok)} the advice accepts as a negligible tail."
                if residual_matters
                else ": a negligible tail."
            )
        )
    # the paper's loss scale recovered its run; said where a loss scale recovers this one too, never beside a
    # finding that no fp16 scale fits these gradients (one that needed 2^71 ended "recovered fp32 accuracy with a
    # loss scale of 8")
    scale_recovers = not worse_than_run and not ((atk or 0) > cfg.fp16_underflow_ok and residual_matters)
    if (at1 or 0) > cfg.fp16_underflow_ok and scale_recovers:
        msg += (
            " The 2018 Mixed Precision Training paper saw the same for SSD and recovered fp32 accuracy with a "
            "loss scale of 8."
        )
    if worse_than_run:
        severity = CRITICAL if (atk or 0) > cfg.fp16_underflow_block else WARNING
        remedy = (
            f"Use {_wider_than_fp16(run)}: no fp16 loss scale fits these gradients (the scale that avoids "
            f"overflow, {_pow2(k)}, flushes {_pct(atk)} of them, against {at_run_said} at the run's "
            f"{run_said})."
        )
    elif atk is not None and atk > cfg.fp16_underflow_block and residual_matters:
        severity = CRITICAL
        remedy = _rule_out_for_underflow(run, plan, counts, atk, norm_k, norm_mod)
    elif atk is not None and atk > cfg.fp16_underflow_ok and residual_matters:
        severity = WARNING
        remedy = f"Start GradScaler at {_scale(k)}, and consider bf16: {_pct(atk)} still underflows there."
    elif flushed or thin:
        # a stalled run, or one in which a module received no gradient at all, lost its gradients, not a tail
        severity = CRITICAL if (stalled or fl.empty) and not thin else WARNING
        remedy = _flushed_remedy(
            fl, all_zero16, k, run_scale if scaled else None, at_1[0] if at_1 is not None else None
        )
    elif (
        (at1 or 0) > cfg.fp16_underflow_ok
        and run_scale > 1.0
        and (at_run_hi or 0) <= cfg.fp16_underflow_ok
        and (now or 0) <= cfg.fp16_underflow_ok
    ):
        severity = INFO  # lost at scale 1, but the run scales its loss, and enough
        remedy = (
            f"Nothing to fix: at the run's loss scale {run_said}, {at_run_said} of the values recorded flush"
            + (
                f"; at the recommended {_pow2(k)}, {_pct(atk)}, carrying at most {_pct(norm_k)} of a module's "
                "gradient norm: a negligible tail."
                if (atk or 0) > cfg.fp16_underflow_ok
                else "."
            )
        )
        if zero16 is not None and zero16 > cfg.fp16_underflow_ok:
            # an fp16 tensor's flushed values are zeros, which no count tells from true ones: said, not hidden
            # behind "0% flush" (5.2% zeros at a static 1024 that a rerun at 2^32 had none of)
            remedy += (
                f" Of the activation gradients that were already fp16, {_pct(zero16)} are zeros, which may hold "
                "values flushed before precprof read them: a rerun at a larger scale tells."
            )
    elif (at1 or 0) > cfg.fp16_underflow_ok or (now or 0) > cfg.fp16_underflow_ok:
        severity = WARNING
        remedy = f"{lead}: GradScaler(init_scale={_scale(k)}) brings the underflow to {_pct(atk)}" + (
            ", a negligible tail." if (atk or 0) > cfg.fp16_underflow_ok else "."
        )
    elif blind:  # nothing counted at scale 1 is no "nothing to fix": fp16 flushed before precprof read them
        severity = INFO
        remedy = (
            "Not countable in this run: fp16 held these gradients at scale 1, where a value at or below 2^-25 became a "
            f"zero before precprof read it ({_pct(zero16)} of them are zeros, flushed values and true zeros alike). "
            f"{lead}, GradScaler(init_scale={_scale(k)}); to count what fp16 flushes, profile a few steps "
            "in fp32 or bf16, where precprof counts each gradient against fp16's floor exactly."
        )
    elif over_k:  # the scale was clamped where the gradients overflow: not one to start at
        severity = INFO
        remedy = (
            f"No underflow to fix: {_pct(atk)} at {_pow2(k)}, where {int(over_k):,} activation-gradient values "
            "overflow instead (fp16_loss_scale, fp16_gradient_overflow)."
        )
    else:
        severity = INFO
        remedy = f"Nothing to fix; GradScaler(init_scale={_scale(k)}) keeps it at {_pct(atk)}."
    if starved:
        norms = run.sort({plan.fp16_norm_starved[m] for m in starved})
        msg = _starved_said(run, own16, is16, starved, norms) + msg
        remedy += (
            f" The zeros of {_listing(starved, cfg.max_listed_modules)} are no underflow: computing "
            f"{_listing(norms, cfg.max_listed_modules)} in fp32 (fp16_norm_overflow) removes them."
        )
    by_mod = totals
    worst: list[str] = []
    if not by_mod.empty and atk:
        lim = _log2i(FP16.underflow_max)
        sel = by_mod[(by_mod[T.EXPONENT] + k + 1) <= lim]
        worst = run.sort(sel.groupby(T.MODULE)[T.COUNT].sum().nlargest(cfg.max_listed_modules).index)
    plan.add(
        Finding(
            "fp16_gradient_underflow",
            severity,
            f"fp16 gradients flushed to zero at {_scales(fl.scales)}: up to {_pct(fl.masked_share)}"
            + (", a mask's zeros among them" if fl.masks else "")
            if fl.masked_only
            # the share is of the modules whose zeros count (``fl.counted``), named as the message names them: a
            # bare "4.77% zeros" read as the share of the ten modules the message listed at the floor
            else f"fp16 gradients run into fp16's floor at {_scales(fl.scales)}: {_pct(fl.share)}"
            + _flushed_of(run, fl)
            + " flushed to zero"
            if thin
            else f"fp16 gradients flushed to zero: {_pct(fl.share)}"
            + (_flushed_of(run, fl) + " are zeros" if not fl.counted_all else " zeros")
            + f" at {_scales(fl.scales)}"
            if flushed
            # (at the run's scale 1, the exact count, which the report shows: the histograms' is a lower bound)
            else _underflow_title(
                now if unscaled and now is not None else at1, atk, k, blind, (at_run_said, run_scale)
            ),
            msg,
            remedy,
            modules=worst,
            method=method.strip(),
            numbers={
                "share_now": now,
                "share_at_scale_1": at1,
                "share_at_recommended": atk,
                "loss_scale_log2": k,
                "nonzero_values": int(total),
                "underflow_at_recommended": int(sure_k),
                "boundary_values_at_recommended": int(boundary_k),
                "overflow_at_recommended": int(over_k),
                "fp16_zero_share": zero16,
                "fp16_flushed": flushed or thin,
                "fp16_flushed_zero_share": fl.share if (flushed or thin) and not fl.masked_only else None,
                # whose values that share is of, where not every fp16 activation gradient's (``_flushed_of``)
                **(
                    {"fp16_flushed_share_of": _listing(fl.counted, cfg.max_listed_modules)}
                    if (flushed or thin) and not fl.masked_only and not fl.counted_all
                    else {}
                ),
                "fp16_flushed_at_most": fl.masked_share if fl.masked_only else None,
                "fp16_smallest_nonzero": fl.smallest if (flushed or thin) and fl.smallest > 0 else None,
                **({"fp16_subnormal_share": sub} if thin else {}),
                **({"skipped_steps_left_out": left_out} if left_out else {}),
                **({"kept_fp32_left_out": len(kept.modules)} if kept.left_out else {}),
                **(
                    {
                        "norm_overflow_left_out": len(starved),
                        "norm_overflow_zeros": int(is16.loc[~is16.index.isin(own16.index), T.ZEROS].sum()),
                    }
                    if starved
                    else {}
                ),
                "loss_change": loss_change,
                # exact at the run's scale, or bounded (``_flushed_at_scale``): then the bounds, not one share
                "share_at_run_scale": at_run if at_run == at_run_hi else None,
                **(
                    {"share_at_run_scale_at_least": at_run, "share_at_run_scale_at_most": at_run_hi}
                    if at_run != at_run_hi
                    else {}
                ),
                "run_scale": run_scale,
                # a whole number for a power of two, as before; the exact log2 of any other scale
                "run_scale_log2": _log2i(run_scale)
                if math.frexp(run_scale)[0] == 0.5
                else math.log2(run_scale),
                "weight_grad_share_at_recommended": wg_share,
                "max_module_norm_share_at_recommended": norm_k,
                "max_norm_share_module": norm_mod,
            },
        )
    )


def _starved_said(
    run: _Run, own16: pd.DataFrame, is16: pd.DataFrame, starved: list[str], norms: list[str]
) -> str:
    """The sentence that opens fp16_gradient_underflow where a norm's overflow zeroed the fp16 activation gradients
    of ``starved`` (``_Plan.fp16_norm_starved``; ``is16`` the fp16 rows, ``own16`` those without theirs): their
    zeros are left out of what fp16 flushed, and why."""
    lim = run.cfg.max_listed_modules
    theirs = is16[~is16.index.isin(own16.index)]
    it = "its" if len(norms) == 1 else "their"
    return (
        f"The activation gradients of {_listing(starved, lim)} held no nonzero value "
        f"({int(theirs[T.ZEROS].sum()):,} exact zeros), and not for underflow: {_listing(norms, lim)}'s x.pow(2) "
        f"overflowed fp16 (fp16_norm_overflow) and zeroed {it} output, x * rsqrt(inf) = 0, whose backward passes "
        "back 0 to the modules before it at any loss scale; they are left out of what follows. "
    )


def _underflow_title(
    at1: float | None, atk: float | None, k: int, blind: bool, run_scale: tuple[str, float]
) -> str:
    """fp16_gradient_underflow's title where nothing was flushed: the shares at scale 1 and at 2^k; with
    ``blind`` (fp16 gradients held at scale 1), the share at scale 1 is of the other gradients, or not given.
    A run that scaled its loss (``run_scale``: the share at its scale, in words, and that scale, not 1) has its
    own share in place of scale 1's, which the message gives as a what-if: '0.191% at scale 1' was read as
    what a GradScaler run at 2^16 lost, which was 0%."""
    at_run, scale = run_scale
    if scale != 1.0:
        rec = "the recommended scale too" if 2.0**k == scale else f"{_pct(atk)} at {_pow2(k)}"
        return f"fp16 gradient underflow: {at_run} at the run's scale {_loss_scale_said(scale)}, {rec}"
    if not blind:
        return f"fp16 gradient underflow: {_pct(at1)} at scale 1, {_pct(atk)} at {_pow2(k)}"
    if at1 is None:
        return "fp16 gradient underflow at scale 1 not countable: the gradients were fp16 already"
    return f"fp16 gradient underflow: {_pct(at1)} at scale 1 of the gradients that were not fp16"


def _unscaled(run: _Run, ag: pd.DataFrame) -> str | None:
    """How the run is known to have scaled no loss, in words, or None where it did or may have: its configuration
    says "none" (the built-in loop, the HF and Lightning callbacks), or, in a user's own loop, the Profiler was
    given no enabled GradScaler and no ``loss_scale``; and no step or gradient row holds a scale other than 1."""
    if _had_loss_scale(run, ag):
        return None
    said = run.run_config.get("loss_scaling")
    if said:
        return "its configuration says loss scaling: none" if said == "none" else None
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    if not isinstance(capture, Mapping) or capture.get("scaler_enabled"):
        return None
    if capture.get("static_loss_scale") not in (None, 1, 1.0):
        return None
    return "precprof was given no GradScaler and no loss_scale, and every step's scale is 1"


def _rule_fp16_no_loss_scaling(run: _Run, plan: _Plan) -> None:
    """An fp16 run that scaled no loss: its fp16 activation gradients lost every value below 2^-25 as they were
    computed, and no count of an fp16 tensor says how many (a flushed value is a zero like a true one), so
    fp16_gradient_underflow cannot. A warning where a module's gradients run into fp16's floor (more than
    ``fp16_flushed_floor_share`` of its nonzero values at the smallest subnormal, 2^-24): the values below it were
    lost, not a tail of nothing."""
    cfg = run.cfg
    ag = run.kind(T.ACTIVATION_GRAD)
    is16 = ag[_dtype_has(ag, "float16")]
    how = _unscaled(run, ag) if not is16.empty else None
    if how is None:
        return
    per = is16.groupby(T.MODULE)[[T.ZEROS, T.NUMEL, T.NAN, T.INF]].sum()
    nonzero = (per[T.NUMEL] - per[T.ZEROS] - per[T.NAN] - per[T.INF]).clip(lower=0)
    floor = (_at_fp16_floor(run, is16).reindex(per.index, fill_value=0.0) / nonzero[nonzero > 0]).dropna()
    dense = floor[floor > cfg.fp16_flushed_floor_share].sort_values(ascending=False)
    mods = [str(m) for m in dense.index]
    # the zeros of the modules a norm's fp16 overflow starved are its (fp16_norm_overflow), none of them flushed
    starved = [m for m in run.sort(plan.fp16_norm_starved) if m in per.index]
    own = per.drop(index=starved)
    zeros = _share(float(own[T.ZEROS].sum()), float(own[T.NUMEL].sum()))
    left_out = (
        f"; those of {_listing(starved, cfg.max_listed_modules)}, zero for the overflow of "
        f"{_listing(run.sort({plan.fp16_norm_starved[m] for m in starved}), cfg.max_listed_modules)}'s x.pow(2) "
        "(fp16_norm_overflow), left out"
        if starved
        else ""
    )
    plan.add(
        Finding(
            "fp16_no_loss_scaling",
            WARNING if mods else INFO,
            "fp16 without loss scaling: gradients run into fp16's floor, and what fell below it was flushed"
            if mods
            else "fp16 without loss scaling",
            f"This run trained in fp16 and scaled no loss ({how}). Its activation gradients were computed in fp16 "
            "at scale 1, where every value at or below 2^-25 becomes a zero as it is computed, before precprof reads "
            f"it; a flushed value is a zero like a true one, so no count says how many ({_pct(zeros)} of these "
            f"values are zeros, the flushed ones among them{left_out}). {_floor_said(cfg, dense, floor)}",
            _no_scaling_remedy(run, plan, own_loop=how.startswith("precprof")),
            modules=run.sort(mods),
            numbers={
                "fp16_zero_share": zeros,
                "modules_at_floor": len(mods),
                "max_floor_share": float(floor.max()) if len(floor) else None,
                "loss_scale_log2": plan.loss_scale_log2,
            },
        )
    )


def _floor_said(cfg: AdvisorConfig, dense: pd.Series, floor: pd.Series) -> str:
    """The modules whose nonzero fp16 activation gradients run into fp16's floor (``dense``: their shares at
    2^-24, largest first), or the largest share of any module (``floor``) where none does, in words."""
    if dense.empty:
        return (
            "No module's gradients run into fp16's floor on the sampled steps (at most "
            f"{_pct(float(floor.max()) if len(floor) else None)} of a module's nonzero values at its smallest "
            "subnormal, 2^-24): what it flushed is likely a thin tail."
        )
    return (
        f"In {len(dense)} module(s) more than {_pct(cfg.fp16_flushed_floor_share)} of the nonzero values sit at "
        "fp16's smallest subnormal, 2^-24: their gradients run into its floor, and the values below it are lost ("
        + "; ".join(
            f"{_name(str(m))}: {_pct(float(v))}" for m, v in dense.head(cfg.max_listed_modules).items()
        )
        + ")."
    )


def _no_scaling_remedy(run: _Run, plan: _Plan, own_loop: bool) -> str:
    """fp16_no_loss_scaling's remedy: a GradScaler at the recommended scale, given to the Profiler too; a format
    with more range where fp16 is ruled out. ``own_loop``: the Profiler knew of no scaler, which the loop may have."""
    if plan.fp16_block:
        return f"Train in {_wider_than_fp16(run)}: a loss scale does not make fp16 fit ({'; '.join(plan.fp16_block)})."
    return (
        f"Scale the loss: scaler = torch.amp.GradScaler(init_scale={_scale(plan.loss_scale_log2)}), then "
        "scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update(); give it to the Profiler "
        "(Profiler(model, optimizer=optimizer, scaler=scaler)), which reads its scale. Or train in bf16, which "
        "needs none."
        + (" If your loop scales its loss already, give that GradScaler to the Profiler." if own_loop else "")
    )


def _rule_fp16_gradient_overflow(run: _Run, plan: _Plan, kept: KeptGradients) -> None:
    g = run.kind(*T.GRADIENT_KINDS)
    # What overflowed: an inf in an fp16 gradient, and in an fp16 run an inf in an fp32 one too (autocast's fp16
    # matmul computed a weight's gradient, it overflowed, and the inf was cast into the fp32 .grad: the step the
    # scaler skipped for it). A finite value beyond 65504 in an fp32 gradient overflowed nothing: it is what fp16
    # would do at that scale (bf16 autocast with a GradScaler, fp32, or a weight's gradient summed over
    # micro-batches in an fp16 run).
    inf_is_overflow = _dtype_has(g, "float16") | run.precision_trained.startswith("fp16")
    overflowed = g[inf_is_overflow & (g[T.INF] > 0)]
    # what fp16 would overflow, of the gradients it computes in fp16: the keep list's stay fp32 (``kept``), and so
    # do those autocast computes in fp32 on its own (a LayerNorm's weight gradient: GradScaler finds it finite)
    own32 = autocast_fp32_gradients(run, kept)
    would = g[(g[T.overflow_col("fp16")] > 0) & ~kept.rows(g) & ~own32.rows(g)]
    real = not overflowed.empty or (run.precision_trained == "" and not would.empty)
    g = overflowed if not overflowed.empty else would
    if g.empty:
        return
    mods = run.sort(g[T.MODULE])
    steps = sorted(int(s) for s in g[T.STEP].unique())
    n = int(g[T.INF].sum() if not overflowed.empty else g[T.overflow_col("fp16")].sum())
    scales = sorted({float(s) for s in g[T.SCALE].unique()})
    static = _static_scale(run.steps)
    # the advised scale was clamped at the smallest the advice allows, where the largest gradient still overflows
    gmax, limit = plan.grad_absmax or 0.0, FP16.max / 2.0**run.cfg.fp16_margin_log2
    too_large = gmax > 0 and math.ldexp(gmax, plan.loss_scale_log2) >= FP16.overflow_min
    what = (
        "GradScaler skips those steps"
        + (" (its static scale never lowers)" if static else " (and lowers its scale)")
        + ", loss scaling without an inf check would apply the inf/nan updates."
        if real
        else (
            "these gradients are fp32 in this fp16 run (a weight's gradient summed over micro-batches, or one "
            "computed in fp32), so nothing overflowed here; held in fp16, GradScaler would skip those steps."
            if run.precision_trained.startswith("fp16")
            else f"this {run.precision_trained} run's gradients are not fp16, so nothing overflowed here; in fp16 "
            "GradScaler would skip those steps and lower its scale."
        )
    )
    plan.add(
        Finding(
            "fp16_gradient_overflow",
            WARNING if real else INFO,
            f"Gradients overflow fp16 at the scale in effect in {len(mods)} module(s)"
            if real
            else f"Gradients would overflow fp16 at this run's loss scale in {len(mods)} module(s)",
            f"On {len(steps)} sampled step(s) ({_steps_at_scales(g, steps, scales)}), {n:,} gradient values in "
            f"{_listing(mods, run.cfg.max_listed_modules)} "
            f"{'overflow' if real else 'would overflow'} fp16 at "
            + (_scales(scales) if len(scales) == 1 else "the loss scale in effect on each")
            + f"; {what}",
            (
                _too_large_remedy(run, _fitting_scale_log2(gmax, limit), plan.loss_scale_log2)
                if too_large
                else f"Use {_wider_than_fp16(run)}: the loss scale that keeps these gradients finite in fp16 "
                f"({_pow2(plan.loss_scale_log2)}) flushes more of the small ones than this run lost."
                if plan.fp16_scale_raises_underflow
                else f"Start at {_pow2(plan.loss_scale_log2)} at the most: {_bound_from(run, plan, steps)}, and a "
                "start there may overflow too. A dynamic GradScaler (init_scale=65536, its default) backs off until "
                "steps go through, or a few steps at a low scale (--loss-scale static:1) measure the gradients to "
                "size it."
                if plan.grad_absmax_bound
                else f"Start at the recommended loss scale {_pow2(plan.loss_scale_log2)}, which keeps the largest "
                + (
                    "gradient below fp16's 65504 but not below the headroom the advice keeps (fp16_loss_scale)."
                    if gmax > 0 and math.ldexp(gmax, plan.loss_scale_log2) >= limit
                    else "gradient below the limit."
                )
            ),
            modules=mods,
            numbers={"values": n, "steps": len(steps), "max_scale": max(scales)},
        )
    )


def _steps_at_scales(g: pd.DataFrame, steps: list[int], scales: list[float], limit: int = 6) -> str:
    """The sampled ``steps`` of the gradient rows ``g``, each with its loss scale where they had more than one
    (``scales``): "0 at loss scale 1e+12, 3 at 1.25e+11", at most ``limit`` of them, the last always (a backing-off
    scaler's smallest). The steps listed beside the scales in ascending order read as step 0 at the smallest."""
    if len(scales) <= 1:
        return _listed([str(s) for s in steps], limit)
    held = {
        int(s): sorted({float(x) for x in v})
        for s, v in pd.to_numeric(g[T.SCALE], errors="coerce")
        .groupby(pd.to_numeric(g[T.STEP]))
        .unique()
        .items()
    }
    items = [f"{s} at " + " and ".join(f"{x:g}" for x in held.get(s, [])) for s in steps]
    items[0] = items[0].replace(" at ", " at loss scale ", 1)
    if len(items) <= limit:
        return ", ".join(items)
    return ", ".join(items[: limit - 1]) + f", {len(items) - limit} more and {items[-1]}"


def _bound_from(run: _Run, plan: _Plan, steps: list[int]) -> str:
    """Why the largest gradient is a lower bound: every sampled step overflowed, or the few that did (``steps``)
    had larger gradients than the others' measured largest, and the advice rests on them alone."""
    if plan.grad_absmax_clean is None:
        return "every sampled step overflowed, so the run measured the largest gradient only as a lower bound"
    sampled = int(run.kind(*T.GRADIENT_KINDS)[T.STEP].nunique())
    return (
        f"this rests on the {len(steps)} of {sampled} sampled step(s) that overflowed "
        f"({_listed([str(s) for s in steps], 6)}), where the largest gradient was measured only as a lower "
        f"bound; the {sampled - len(steps)} others' largest gradient was {plan.grad_absmax_clean:.3g}"
    )


def _loss_change(run: _Run) -> float | None:
    """The relative change of the loss from the first to the last recorded step (None with fewer than two, or
    where the first is not finite: no change can be told from it)."""
    loss = run.steps[T.LOSS].dropna() if T.LOSS in run.steps else None
    if loss is None or len(loss) < 2 or not loss.iloc[0] or not math.isfinite(loss.iloc[0]):
        return None
    return float((loss.iloc[-1] - loss.iloc[0]) / abs(loss.iloc[0]))


def _losses(run: _Run) -> pd.Series:
    """The finite recorded losses, in step order."""
    loss = (
        pd.to_numeric(run.steps[T.LOSS], errors="coerce") if T.LOSS in run.steps else pd.Series(dtype=float)
    )
    return loss[np.isfinite(loss)]


def _trend_t(loss: pd.Series) -> float:
    """The least-squares slope of ``loss`` over its steps in standard errors (inf for a loss that moves without
    noise, 0 for a constant one): how clearly the loss moves against its own step-to-step noise."""
    y = loss.to_numpy(dtype=float)
    x = np.arange(len(y), dtype=float)
    x -= x.mean()
    slope = float((x * (y - y.mean())).sum() / (x * x).sum())
    resid = y - y.mean() - slope * x
    se = math.sqrt(float((resid * resid).sum()) / max(len(y) - 2, 1) / float((x * x).sum()))
    if se == 0:
        return math.inf if slope != 0 else 0.0
    return abs(slope) / se


def _stalled(run: _Run, loss_change: float | None) -> bool:
    """Whether the loss stalled: it moved less than ``stalled_loss_change`` over at least ``stalled_min_steps``
    recorded losses, with no trend its noise resolves. A loss that changed little over a few steps has not stalled
    (a 4-step fp16 run whose loss fell as its fp32 run's did was told 'training stalled')."""
    cfg = run.cfg
    if loss_change is None or abs(loss_change) >= cfg.stalled_loss_change:
        return False
    loss = _losses(run)
    return len(loss) >= cfg.stalled_min_steps and _trend_t(loss) <= cfg.stalled_trend_t


def _why_not_stalled(run: _Run, loss_change: float) -> str:
    """Why a loss that changed by less than ``stalled_loss_change`` is not called stalled ("" for one that
    changed more)."""
    cfg = run.cfg
    if abs(loss_change) >= cfg.stalled_loss_change:
        return ""
    n = len(_losses(run))
    if n < cfg.stalled_min_steps:
        return f", {n} recorded steps, too few to call it stalled"
    return ", steadily against its step-to-step noise: not stalled"

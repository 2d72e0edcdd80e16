"""Matmul layers an autocast run kept in fp32 (outside autocast, as keep_fp32 advises), or an fp16-pure run held
in fp32 (their weights fp32, as transformers' ``_keep_in_fp32_modules`` holds T5's ``wo``): whether fp16 still
needs them there, judged on their own values. Such a layer casts nothing to fp16, so the forward rules see no
fp16 trouble in it, and a keep list built from them alone would drop it: the user pasting it loses the fp32
wrapper that kept the run finite."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from precprof import tables as T
from precprof.analysis.advisor.evidence import _dtype_has, _model_inputs, _nonzero, _Plan, _Run, _share
from precprof.analysis.advisor.model import INFO, Finding
from precprof.analysis.advisor.text import _g, _listed, _listing, _name, _pct
from precprof.formats import FP16


def _gemm_inputs(run: _Run) -> dict[str, list[str]] | None:
    """Which modules' outputs each matmul layer read (capture.gemm_inputs); None where the capture did not record
    it (a run recorded by an older precprof, or before it with block formats off)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    inputs = capture.get("gemm_inputs") if isinstance(capture, Mapping) else None
    if not isinstance(inputs, Mapping):
        return None
    return {str(c): [str(p) for p in v] for c, v in inputs.items() if isinstance(v, list)}


def fp16_pure(run: _Run) -> bool:
    """Whether the run trained in fp16-pure: the model's parameters fp16, no autocast. An fp32 tensor there is one
    the model kept in fp32 (a layer whose weights it holds in fp32, code that upcasts); it reaches fp16 only
    where code casts it, which the row of what read it shows as fp16."""
    return not run.autocast.get("enabled") and run.precision_trained == "fp16-pure"


def kept_how(run: _Run, plural: bool = False) -> str:
    """How a layer is kept in fp32 under fp16, in words, for the run's mode: outside autocast, or, in an fp16-pure
    run (no autocast to leave), its weights in fp32 and its input cast to them."""
    if fp16_pure(run):
        return (
            "(their weights in fp32, .float(), and their input cast to fp32 where the model does not cast it)"
            if plural
            else "(its weights in fp32, .float(), and its input cast to fp32 where the model does not cast it)"
        )
    return "(outside autocast)"


def _outside_autocast(acts: pd.DataFrame) -> set[str]:
    """The modules (and input rows) of an autocast run whose every activation row was fp32: a matmul among them
    ran outside autocast, where it casts nothing. A float64 row is no sign of that: autocast leaves float64 ops
    alone (a model.double() model: float64_layers says so)."""
    names = T.texts(acts[T.MODULE])
    low = (
        _dtype_has(acts, "float16") | _dtype_has(acts, "bfloat16") | _dtype_has(acts, "float64")
    ).to_numpy()
    return set(names[~low]) - set(names[low])


def _made_between(run: _Run, acts: pd.DataFrame) -> pd.Series:
    """The activation rows made between modules: a matmul layer's own input row (no module the capture watches
    made it: code in the forward such as a residual add) that is not the model's own input."""
    names = acts[T.MODULE].astype(str)
    return names.str.endswith(T.INPUT_SUFFIX) & ~names.isin(_model_inputs(run))


@dataclass(frozen=True)
class _CastFlush:
    """What a matmul layer flushes to zero in fp16 under autocast, of the rows fp16 would hold. Autocast casts
    the layer's input and weight to fp16 and the layer computes its output there: ``input`` is the share of the
    nonzero values of its input (its input row and the outputs it reads) that the cast flushes, ``output`` the
    share of its output's that flush as it is computed (None where there is no nonzero value). Each is judged on
    its own: a wide output's many values would hide a flushed input in one share of both. The weight, cast too,
    is not counted here: these rules judge activations."""

    input: float | None
    output: float | None

    @property
    def worst(self) -> float:
        return max(self.input or 0.0, self.output or 0.0)


def _cast_flush(rows: pd.DataFrame, layer: str, read: list[str]) -> _CastFlush:
    """``_CastFlush`` of ``layer`` from the activation ``rows`` fp16 would hold: its input is its input row and
    the outputs it reads (``read``, capture.gemm_inputs), its output its own rows."""

    def share(of: pd.DataFrame) -> float | None:
        return _share(float(of[T.underflow_col("fp16")].sum()), _nonzero(of))

    names = rows[T.MODULE]
    return _CastFlush(share(rows[names.isin([layer + T.INPUT_SUFFIX, *read])]), share(rows[names == layer]))


@dataclass(frozen=True)
class _Kept:
    """The matmul layers the run kept in fp32, by what their values say of fp16."""

    needed: dict[str, str]  # layer -> why fp16 still needs it in fp32, in words
    released: dict[str, str]  # layer -> its values, which fit fp16
    between: list[str]  # the kept layers' input rows made between modules that held inf in fp16


def _judge(
    run: _Run, layer: str, rows: pd.DataFrame, input_known: bool, stream: pd.DataFrame, later: pd.DataFrame
) -> tuple[bool, str]:
    """Whether fp16 needs ``layer`` in fp32, and why in words, from the ``rows`` it would cast or compute in fp16
    under autocast, or in an fp16-pure model (its input and output, fp32 here): a value beyond 65504 or within the headroom of it, or more
    than ``fp16_activation_underflow_warn`` of the nonzero values of its input or of its output flushed
    (``_cast_flush``), as the forward rules judge them. ``stream``: its own input row where code between modules
    made it in fp16 and it holds inf (the layer, kept, reads an input fp16 overflowed before it); ``later``: the
    input rows made between modules after the layer, in fp32, beyond fp16's range. Never released on values
    not measured: nan/inf in its rows, or no largest value; nor while ``later`` is not empty, as an fp32 output
    is what hands that code fp32, and released, the layer could hand it fp16."""
    cfg = run.cfg
    limit = FP16.max / 2.0**cfg.fp16_activation_headroom_log2
    over = int(rows[T.overflow_col("fp16")].sum())
    amax = float(pd.to_numeric(rows[T.ABSMAX], errors="coerce").max()) if not rows.empty else 0.0
    nan, inf = int(rows[T.NAN].sum()), int(rows[T.INF].sum())
    flushed = _cast_flush(rows, layer, [m for m in set(rows[T.MODULE]) if m != layer])
    which = _rows_said(run, layer, [str(m) for m in set(rows[T.MODULE])])
    if not stream.empty:
        return True, (
            f"{_name(layer)}: its input, made between modules (by code in the forward, such as a residual add, that "
            "keeping a module in fp32 does not cover), held "
            f"{int(stream[T.INF].sum()):,} inf in fp16 before {_name(layer)} read it: keeping {_name(layer)} in fp32 "
            "cannot make that input finite"
        )
    if over:
        return True, f"{_name(layer)}: {over:,} values an fp16 cast makes inf in {which} (max |x| {_g(amax)})"
    if nan or inf:
        return True, (
            f"{_name(layer)}: {nan:,} nan and {inf:,} inf in {which}: what fp16 would make of its values is not "
            "measured"
        )
    if rows.empty or math.isnan(amax):
        return (
            True,
            f"{_name(layer)}: no largest value recorded in {which or 'its rows'}: whether it fits fp16 is not known",
        )
    if amax >= limit:
        return (
            True,
            f"{_name(layer)}: max |x| {_g(amax)} in {which}, within {2**cfg.fp16_activation_headroom_log2}x of 65504",
        )
    if flushed.worst > cfg.fp16_activation_underflow_warn:
        return True, f"{_name(layer)}: " + _cast_flush_said(flushed)
    if not input_known:
        return True, (
            f"{_name(layer)}: its input was not recorded (no captured module made it, and block formats were "
            "off), so whether it fits fp16 is not known"
        )
    if not later.empty:
        far = float(pd.to_numeric(later[T.ABSMAX], errors="coerce").max())
        return True, (
            f"{_name(layer)}: its own values fit fp16 (max |x| {_g(amax)} in {which}), but "
            f"{_listed([_row_said(m) for m in run.sort(set(later[T.MODULE]))], 4)}, made after it between modules "
            "(by code in the forward, "
            f"such as a residual add), held values beyond fp16 (max |x| {_g(far)}) in fp32: that code runs in fp32 "
            "only while the layers kept in fp32 before it hand it fp32, and released, this one could hand it fp16"
        )
    if not flushed.worst:
        return False, f"{_name(layer)}: max |x| {_g(amax)} in {which}, none flushed: it fits fp16"
    # (flushes within the rules' bound: said as counted, "none flushed" was said of up to that bound)
    return False, (
        f"{_name(layer)}: max |x| {_g(amax)} in {which}; {_cast_flush_said(flushed)}, within the "
        f"{_pct(cfg.fp16_activation_underflow_warn)} the forward rules allow: it fits fp16"
    )


def _row_said(row: str) -> str:
    """An activation row named for a sentence: a layer's input row (``wo:input``, made by code in the forward or
    the model's own input) as that layer's input, so that it does not read as a module of its own (one the run
    kept in fp32); a module's row as the module."""
    return (
        f"{_name(row.removesuffix(T.INPUT_SUFFIX))}'s input" if row.endswith(T.INPUT_SUFFIX) else _name(row)
    )


def _rows_said(run: _Run, layer: str, rows: list[str]) -> str:
    """Where a kept ``layer``'s ``rows`` were read, in words: its input (its own input row, and the outputs of the
    modules it read, capture.gemm_inputs) and its output."""
    read = run.sort(r for r in rows if r != layer and not r.endswith(T.INPUT_SUFFIX))
    parts = [f"{_name(layer)}'s input"] if layer + T.INPUT_SUFFIX in rows else []
    if read:
        parts.append(
            f"the output of {_listing(read, 4)} ({_name(layer)} reads {'it' if len(read) == 1 else 'them'})"
        )
    if layer in rows:
        parts.append(f"{_name(layer)}'s output")
    return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else "".join(parts)


def _cast_flush_said(flushed: _CastFlush) -> str:
    """What ``flushed`` says, in words: the share of each tensor that flushes, named."""
    return (
        f"the cast of its input to fp16 would flush {_pct(flushed.input)} of that input's nonzero values, and "
        f"{_pct(flushed.output)} of its output's would flush as it computes it in fp16"
    )


def kept_in_fp32(run: _Run, plan: _Plan) -> _Kept | None:
    """The matmul layers this autocast run kept in fp32 (or this fp16-pure run held in fp32), each judged on its own
    rows: its input (its input row and the outputs it read, capture.gemm_inputs) and its output, which fp16 would
    cast or compute in fp16 were the layer released. None without autocast (or fp16-pure) or without the record
    of what the matmuls read."""
    inputs = _gemm_inputs(run)
    acts = run.kind(T.ACTIVATION)
    if not (run.autocast.get("enabled") or fp16_pure(run)) or inputs is None or acts.empty:
        return None
    outside = _outside_autocast(acts)
    names = set(T.texts(acts[T.MODULE]))
    half = _dtype_has(acts, "float16")
    made = _made_between(run, acts)
    fp16_inf = made & half & (acts[T.INF] > 0)
    limit = FP16.max / 2.0**run.cfg.fp16_activation_headroom_log2
    absmax = pd.to_numeric(acts[T.ABSMAX], errors="coerce")
    beyond = made & ~half & ((acts[T.overflow_col("fp16")] > 0) | (absmax >= limit))
    rank = acts[T.MODULE].astype(str).map(lambda m: run.order.get(m, -1))
    needed: dict[str, str] = {}
    released: dict[str, str] = {}
    between: list[str] = []
    for layer in [m for m in plan.matmul_layers if m in outside]:
        read = [layer + T.INPUT_SUFFIX, *inputs.get(layer, [])]
        rows = acts[acts[T.MODULE].isin([layer, *read]) & ~half]
        stream = acts[fp16_inf & (acts[T.MODULE] == layer + T.INPUT_SUFFIX)]
        later = acts[beyond & (rank > run.order.get(layer, 1 << 30))]
        need, why = _judge(run, layer, rows, any(r in names for r in read), stream, later)
        (needed if need else released)[layer] = why
        between += [str(m) for m in set(stream[T.MODULE])]
    return _Kept(needed, released, run.sort(between)) if needed or released else None


def _rule_kept_fp32(run: _Run, plan: _Plan) -> None:
    """fp16_kept_fp32: the layers the run kept in fp32 that fp16 still needs there join the keep list; those whose
    values fit fp16 are said to be free to run under autocast again (never dropped from the list in silence)."""
    kept = kept_in_fp32(run, plan)
    if kept is None:
        return
    need, free = run.sort(kept.needed), run.sort(kept.released)
    plan.kept_fp32 = need
    plan.released_fp32 = free
    plan.kept_fp32_pure = fp16_pure(run)
    plan.keep_fp16 = run.sort(dict.fromkeys([*plan.keep_fp16, *need]))
    listed = run.cfg.max_listed_modules
    pure = fp16_pure(run)
    remedy = []
    if need:
        remedy.append(
            f"Keep {_listing(need, listed)} in fp32 {kept_how(run, len(need) > 1)} under fp16, as this run does: the "
            f"recommendation's fp16_keep_fp32 lists {'it' if len(need) == 1 else 'them'}"
        )
    if free:
        remedy.append(
            f"{_listing(free, listed)} may run {'in fp16' if pure else 'under fp16 autocast'} again: "
            f"{'its' if len(free) == 1 else 'their'} values fit fp16"
        )
    if kept.between:
        remedy.append(
            f"the inf in {_listed([_row_said(m) for m in kept.between], listed)} is made between modules, by code in "
            "the forward that ran in fp16 (a residual add or scale): keeping a module in fp32 does not cover that "
            "code, which runs in fp32 only "
            "where a layer kept in fp32 before it hands it fp32; use bf16, whose range is fp32's, or run that code "
            "in fp32"
        )
    one = len(need) + len(free) == 1
    remedy.append(
        f"under bf16 {'it needs no' if one else 'none of them needs'} fp32 for range (bf16 has fp32's exponent range)"
    )
    plan.add(
        Finding(
            "fp16_kept_fp32",
            INFO,
            f"{len(need) + len(free)} matmul layer(s) ran in fp32 "
            + ("in an fp16 model" if pure else "outside autocast"),
            f"{_listing(need + free, listed)} ran "
            + ("in fp32 in this fp16-pure run" if pure else "outside autocast in this run")
            + " (every output fp32): "
            f"{'it casts' if one else 'they cast'} nothing to fp16, so the forward findings see no fp16 trouble "
            f"in {'it' if one else 'them'}. Judged on what fp16 {'' if pure else 'autocast '}would cast or compute "
            "there (the input and the output): "
            + "; ".join(
                [*(kept.needed[m] for m in need[:listed]), *(kept.released[m] for m in free[:listed])]
            )
            + ".",
            "; ".join(remedy) + ".",
            modules=need + free,
            numbers={"modules": len(need) + len(free), "still_needed": len(need), "released": len(free)},
        )
    )

"""The advisor: findings from a run's tables, and one recommended format and loss scale.

``recommend(run)`` reads the four tables (``precprof.tables``) and ``summary.json`` of a run and returns a
``Recommendation``: a number format (fp32, tf32, bf16, fp16, fp8), the GradScaler ``init_scale`` as a power of
two, a growth interval, the modules to keep in fp32, the FP8-eligible layers, and the ``Finding`` objects
behind them, each with the numbers it rests on and a one-sentence remedy. Every threshold is a field of
``AdvisorConfig``.

Facts the rules rely on (see ``precprof/tables.py``):

- gradient ``underflow_<fmt>``/``overflow_<fmt>`` counts are exact at the loss scale in effect (``scale``);
  ``absmax``/``absmin`` and histograms are unscaled;
- histogram exponent e = floor(log2|x|), so "what if the scale were 2^k" moves every bin to e + k. A bin then
  underflows fp16 entirely when 2^(e+k+1) <= 2^-25 (half fp16's smallest subnormal, where round-to-nearest-even
  gives 0); in the bin just above, only values sitting exactly on 2^-25 vanish, which a histogram cannot tell
  apart: shares computed by shifting are exact up to those boundary values and are reported as such.

The decision (issue 5): FP8 for the eligible layers on FP8 hardware (bf16 elsewhere), else bf16 where the
target runs it natively and no bf16 finding blocks it, else fp16 with the recommended loss scale and keep list
on hardware with fp16 tensor cores, else tf32 on Ampere+ or fp32.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from precprof import hardware as hw_mod
from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.config import AdvisorConfig
from precprof.analysis.advisor.decide import _decide
from precprof.analysis.advisor.evidence import (
    _layer_dims,
    _matmul_leaves,
    _num,
    _Plan,
    _prepare,
    _Run,
    norm_inputs_aside,
)
from precprof.analysis.advisor.model import (
    _SEVERITY_RANK,
    CRITICAL,
    FORMATS,
    INFO,
    SEVERITIES,
    WARNING,
    Finding,
    Recommendation,
)
from precprof.analysis.advisor.rules.active import _rule_experts_fp32, _rule_mixed_precision_active
from precprof.analysis.advisor.rules.biases import _rule_dropped_biases
from precprof.analysis.advisor.rules.blocks import _rule_block_formats
from precprof.analysis.advisor.rules.clipping import _rule_scaled_clipping
from precprof.analysis.advisor.rules.float64 import _rule_float64
from precprof.analysis.advisor.rules.fp8 import _rule_fp8
from precprof.analysis.advisor.rules.fp16 import _rule_fp16_activations, _rule_loss_scale
from precprof.analysis.advisor.rules.fp32_ops import _rule_fp32_ops
from precprof.analysis.advisor.rules.hardware import _rule_hardware, _rule_small_model
from precprof.analysis.advisor.rules.no_gradient import _rule_no_gradient
from precprof.analysis.advisor.rules.nonfinite import _rule_diverged, _rule_nonfinite
from precprof.analysis.advisor.rules.norm_square import _rule_fp16_norm_square
from precprof.analysis.advisor.rules.residual import _rule_fp16_residual
from precprof.analysis.advisor.rules.shapes import _rule_alignment
from precprof.analysis.advisor.rules.unused import _rule_unused_modules
from precprof.analysis.advisor.rules.updates import (
    _rule_bf16_range,
    _rule_fp32_lost_updates,
    _rule_gradients_not_applied,
    _rule_lost_updates,
    _rule_steps_without_update,
)
from precprof.hardware import HardwareInfo

__all__ = [
    "CRITICAL",
    "FORMATS",
    "INFO",
    "SEVERITIES",
    "WARNING",
    "AdvisorConfig",
    "Finding",
    "Recommendation",
    "recommend",
]


def _load(
    source: Any, summary: Mapping[str, Any] | None
) -> tuple[Mapping[str, pd.DataFrame], dict[str, Any]]:
    if isinstance(source, (str, Path)):
        path = Path(source)
        if why := T.not_a_run_dir(path):  # (a folder of no run was planned for as a run that sampled nothing)
            raise FileNotFoundError(why)
        tables = T.read_run(path, categorical=True).tables
        # a run killed before it saved names no precision in its first summary: its layers' dtypes do
        return tables, taxonomy.with_precision_seen(
            summary if summary is not None else T.read_summary(path), tables["layers"]
        )
    if isinstance(source, Mapping):
        return source, dict(summary or {})
    if callable(getattr(source, "tables", None)):
        # a Profiler: its summary() is the "capture" part of summary.json (module shapes, autocast seen)
        s = dict(summary or {})
        if T.SUMMARY_CAPTURE not in s and callable(getattr(source, "summary", None)):
            s[T.SUMMARY_CAPTURE] = source.summary()
        return source.tables(), s
    raise TypeError(
        f"recommend() takes a run directory, a dict of tables or a Profiler, not {type(source)!r}"
    )


def _hardware(hardware: str | HardwareInfo | None, summary: Mapping[str, Any]) -> tuple[HardwareInfo, bool]:
    if isinstance(hardware, HardwareInfo):
        return hardware, hardware.preset is not None
    if isinstance(hardware, str):
        return hw_mod.preset(hardware), True
    if hardware is not None:  # (planned for the recording machine, as if none was given)
        raise TypeError(
            f"hardware= takes a preset name ({', '.join(hw_mod.PRESET_NAMES)}), a HardwareInfo or None (the "
            f"machine the run was recorded on), not {type(hardware).__name__} {hardware!r}"
        )
    recorded = summary.get(T.SUMMARY_HARDWARE)
    if isinstance(recorded, Mapping) and recorded.get("device"):
        return HardwareInfo.from_dict(dict(recorded)), False
    return hw_mod.detect(), False


def recommend(
    tables_or_run_dir: Any,
    hardware: str | HardwareInfo | None = None,
    config: AdvisorConfig | None = None,
    summary: Mapping[str, Any] | None = None,
) -> Recommendation:
    """Recommend a number format, a loss scale and the layers to keep in fp32, with the findings behind them.

    ``tables_or_run_dir``: a run directory, a dict of the four tables (``Profiler.tables()``), or a Profiler.
    ``hardware``: None plans for the machine the run was recorded on (summary["hardware"], else this one); a
    preset name ("v100", "t4", "a100", "l4", "h100", "b200", "gb200", "cpu") or a ``HardwareInfo`` plans for that target.
    ``config``: an ``AdvisorConfig`` (its thresholds; None: the defaults). ``summary``: summary.json's content
    (read from the run directory when omitted). Pure host-side pandas work.
    """
    if config is not None and not isinstance(config, AdvisorConfig):
        fix = f"AdvisorConfig(**{config!r:.60})" if isinstance(config, Mapping) else "AdvisorConfig(...)"
        raise TypeError(
            f"recommend(config=...) takes a precprof.analysis.advisor.AdvisorConfig or None (the defaults), not "
            f"{type(config).__name__}: pass config={fix}"
        )
    cfg = config or AdvisorConfig()
    tables, summ = _load(tables_or_run_dir, summary)
    layers, hist, steps = _prepare(tables)
    layers, hist, norm_inputs, norm_hist = norm_inputs_aside(layers, hist)
    hw, is_preset = _hardware(hardware, summ)
    run = _Run(layers, hist, steps, summ, hw, is_preset, cfg)
    run.norm_inputs, run.norm_input_hist = norm_inputs, norm_hist
    memory = tables.get("memory")
    if isinstance(memory, pd.DataFrame):
        run.memory = T.memory_at(memory)  # each component's own size; the peak's parts would count it twice
    if not layers.empty:
        run.order = T.module_order(layers, T.shared_params(summ)).fillna(1 << 30).astype(int).to_dict()
        run.types = layers.groupby(T.MODULE)[T.MODULE_TYPE].first().to_dict()
    plan = _Plan(loss_scale_log2=cfg.default_loss_scale_log2, growth_interval=cfg.default_growth_interval)
    plan.matmul_layers = _matmul_leaves(run)
    grads = run.kind(*T.GRADIENT_KINDS)
    plan.gradients_measured = not grads.empty
    finite_nonzero = (
        grads[T.NUMEL].sum() - grads[[T.ZEROS, T.NAN, T.INF]].sum().sum() if not grads.empty else 0
    )
    plan.gradients_valueless = plan.gradients_measured and float(finite_nonzero) <= 0
    # a layer's output or a gradient: the model's input (the data a first layer read) and weights alone are
    # what a run whose first forward pass failed records
    outputs = run.kind(T.ACTIVATION)[T.MODULE]
    plan.measured = plan.gradients_measured or not T.texts(outputs).str.endswith(T.INPUT_SUFFIX).all()
    plan.weights_only = not plan.measured and not run.layers.empty
    dims = _layer_dims(run)

    _rule_hardware(run, plan)
    fwd_bad = _rule_nonfinite(run, plan)
    sampled = {int(s) for s in run.layers[T.STEP].unique()} if not run.layers.empty else set()
    plan.forward_broken = bool(sampled) and sampled <= {int(s) for s in fwd_bad}
    _rule_diverged(run, plan)
    if plan.diverged is not None:
        after = run.steps[T.STEP] >= plan.diverged[0]
        plan.skipped_after_divergence = int(run.steps[T.SKIPPED][after].sum())
        # what was recorded from the divergence on is of a broken run: the format rules read the steps before
        before = run.layers[T.STEP] < plan.diverged[0]
        if before.any():
            # ... but for the forward pass of the first divergent step, where an fp16 overflow that made the loss
            # non-finite shows (the fp16 overflow rule reads it: rules/fp16._divergence_overflow)
            at = run.kind(T.ACTIVATION, T.WEIGHT)
            plan.diverged_forward = at[at[T.STEP] == plan.diverged[0]]
            run.layers = run.layers[before]
            run._kinds.clear()
            run._memo.clear()
            run.hist = run.hist[run.hist[T.STEP] < plan.diverged[0]]
            run.norm_inputs = run.norm_inputs[run.norm_inputs[T.STEP] < plan.diverged[0]]
            run.norm_input_hist = run.norm_input_hist[run.norm_input_hist[T.STEP] < plan.diverged[0]]
            run.steps = run.steps[run.steps[T.STEP] < plan.diverged[0]]
            plan.diverged_sampled_before = int(run.layers[T.STEP].nunique())
    _rule_mixed_precision_active(run, plan)
    _rule_float64(run, plan)
    _rule_experts_fp32(run, plan)
    # the norm whose fp16 square overflowed first: its zeros are what the gradient findings after it read, and the
    # finding of their cause leads theirs (fp16_gradient_underflow leaves its zeros out, no_gradient names it)
    _rule_fp16_norm_square(run, plan)
    _rule_fp16_activations(run, plan)
    _rule_fp16_residual(run, plan)  # (what no module's output holds: a pre-norm model's residual stream)
    _rule_loss_scale(run, plan, fwd_bad)
    _rule_scaled_clipping(run, plan)
    _rule_fp32_ops(run, plan)
    _rule_lost_updates(run, plan)
    _rule_fp32_lost_updates(run, plan)
    _rule_steps_without_update(run, plan)
    _rule_gradients_not_applied(run, plan)
    _rule_no_gradient(run, plan, dims)
    _rule_unused_modules(run, plan)
    _rule_dropped_biases(run, plan)
    _rule_bf16_range(run, plan)
    _rule_fp8(run, plan, dims)
    _rule_alignment(run, plan, dims)
    _rule_small_model(run, plan)
    blocks = _rule_block_formats(run, plan, dims)

    rec = _decide(run, plan)
    rec.running_formats = run.running_formats
    rec.wrapped_weight_layers = run.wrapped_weight_layers
    if blocks is not None:
        rec.block_plan = blocks.plan
        rec.block_what_if = blocks.what_if
        if blocks.reason:
            rec.reasons.append(blocks.reason)
    rec.findings = sorted(plan.findings, key=lambda f: _SEVERITY_RANK.get(f.severity, 9))
    for f in rec.findings:
        f.numbers = {k: _num(v) for k, v in f.numbers.items()}
    return rec

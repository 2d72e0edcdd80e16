"""``precprof compare``: train the same model on the same data from the same seed once per precision, then
check the runs against each other and against what the advisor said.

``compare(base, ["fp32", "bf16", "fp16", "fp16:none"])`` runs ``precprof.training.train`` once per variant (a
precision mode, optionally with a loss scaling spec after a colon: ``fp16:none``, ``fp16:static:8192``, or
``fp16:advised`` — dynamic scaling from the init_scale the advisor recommends on the reference run, which
therefore trains first), each in its own run directory with its own report, each compiled or not as its mode
is run for speed (``precprof.training.compiling``: fp8 compiled, the others eager, unless ``TrainConfig.compile``
says), then writes ``compare.json`` and ``compare.html`` next to them (``precprof.analysis.comparison`` reads and checks the runs, ``precprof.report.compare_page``
draws the page).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from precprof import _atomic, _signals, hardware, rundir, training
from precprof import tables as T
from precprof.analysis.comparison import (
    ADVISED,
    DEFAULT_TOLERANCE,
    Comparison,
    Variant,
    analyse,
    parse_precisions,
    reference_index,
)
from precprof.errors import UserError
from precprof.report import compare_page
from precprof.training import compiling

COMPARE_JSON = "compare.json"
COMPARE_HTML = "compare.html"


def _variants(precisions: str | Sequence[str] | Sequence[Variant]) -> list[Variant]:
    if not isinstance(precisions, str) and precisions and all(isinstance(p, Variant) for p in precisions):
        variants = [p for p in precisions if isinstance(p, Variant)]
        if len(variants) < 2:
            raise UserError("give at least two precisions to compare")
        return variants
    return parse_precisions([str(p) for p in precisions] if not isinstance(precisions, str) else precisions)


def compare(
    base: Any,
    precisions: str | Sequence[str] | Sequence[Variant],
    out: str | Path | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    on_run: Callable[[Variant, Path], None] | None = None,
) -> Comparison:
    """Train ``base`` (a ``precprof.training.TrainConfig``) once per precision and write the comparison.

    Every variant is checked before anything trains (unknown mode, a mode this device cannot run: UserError).
    A run that raises is recorded as failed and the others still run; Ctrl-C writes the comparison of the
    runs so far and re-raises. Returns the ``Comparison``; ``compare.html`` and ``compare.json`` are in ``out``
    (default ``runs/compare-<model>-<timestamp>``), each run in ``out/<label>/``.
    """
    variants = _variants(precisions)
    if out is not None:
        out = rundir.check_name(out, "--out")
    base.validate()
    device = training.resolve_device(base.device)
    hw = hardware.detect(device)
    for v in variants:
        training.plan_precision(v.precision, device, hw)
        if compiling.should_compile(base.compile, v.precision):
            compiling.check_can_compile(device)
    if out is None:
        stem = training.default_out_dir(base).name.replace(f"-{base.precision}-", "-")
        out = Path("runs") / f"compare-{stem}"
    out = Path(out)
    for v in variants:  # every run directory is usable before the first run trains
        rundir.check_target(out / v.label, overwrite=base.overwrite, option="--out")
    out.mkdir(parents=True, exist_ok=True)
    sample_every = (
        base.sample_every if base.sample_every is not None else training.default_sample_every(base.steps)
    )
    done: list[tuple[Variant, Path]] = []
    t0 = time.perf_counter()
    shared = {
        k: v
        for k, v in base.to_dict().items()
        if k not in ("precision", "loss_scale", "out", "progress", "report", "refresh_every", "compile")
    }
    # each run compiles as its mode is run for speed unless --compile/--no-compile said: the runs record how
    # (summary.json's config "compiled"), the comparison says it
    shared["compile_requested"] = base.compile
    shared["sample_every"] = sample_every
    shared["device"] = str(device)
    shared["precisions"] = [v.label for v in variants]
    ref_i = reference_index(variants)
    # the reference trains first: "advised" variants take their loss scale from its recommendation
    run_order = [ref_i] + [i for i in range(len(variants)) if i != ref_i]
    try:
        for i in run_order:
            v = variants[i]
            run_dir = out / v.label
            cfg = dataclasses.replace(
                base, precision=v.precision, loss_scale=v.loss_scale, out=run_dir, sample_every=sample_every
            )
            if v.loss_scale == ADVISED:
                cfg = _advised_config(cfg, out / variants[ref_i].label)
            try:
                training.train(cfg)
            except UserError:
                raise
            except Exception as e:  # keep going: a failed precision is a result too
                if not T.is_run_dir(run_dir):
                    T.write_summary(
                        run_dir,
                        {
                            T.SUMMARY_STATUS: T.STATUS_INCOMPLETE,
                            T.SUMMARY_INCOMPLETE_REASON: f"{type(e).__name__}: {e}",
                        },
                    )
            done.append((v, run_dir))
            if on_run is not None:
                on_run(v, run_dir)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the run in progress saved itself; compare the rest
        with _signals.deferred():  # a second Ctrl-C does not cut compare.html short
            _signals.consume()
            if done:
                _finish(done, variants, tolerance, shared, t0, out)
                with contextlib.suppress(AttributeError):  # for the CLI's message
                    e.precprof_compare_html = out / COMPARE_HTML  # type: ignore[attr-defined]
        raise
    if not done:
        raise UserError("no run finished: nothing to compare")
    return _finish(done, variants, tolerance, shared, t0, out)


def _finish(
    done: list[tuple[Variant, Path]],
    variants: Sequence[Variant],
    tolerance: float,
    shared: dict[str, Any],
    t0: float,
    out: Path,
) -> Comparison:
    """Analyse the runs in ``done`` (in the order of ``variants``) and write compare.json and compare.html."""
    done = sorted(done, key=lambda d: variants.index(d[0]))
    comparison = analyse(done, tolerance, shared)
    comparison.wall_s = time.perf_counter() - t0
    write(comparison, out)
    return comparison


def _advised_config(cfg: Any, ref_dir: Path) -> Any:
    """``cfg`` with dynamic loss scaling starting at the init_scale (and growth interval) the advisor recommends
    on the reference run; the defaults when the reference has no recommendation."""
    rec = T.read_summary(ref_dir).get(T.SUMMARY_RECOMMENDATION) or {}
    scale = rec.get("fp16_loss_scale")
    interval = rec.get("growth_interval")
    return dataclasses.replace(
        cfg,
        loss_scale="dynamic",
        init_scale=float(scale) if isinstance(scale, (int, float)) and scale > 0 else cfg.init_scale,
        growth_interval=int(interval) if isinstance(interval, int) and interval > 0 else cfg.growth_interval,
    )


def write(comparison: Comparison, out: str | Path) -> Path:
    """Write ``compare.json`` and ``compare.html`` into ``out``; returns the HTML path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic.write_text(
        out / COMPARE_JSON, json.dumps(comparison.to_dict(), indent=2, default=str, allow_nan=True) + "\n"
    )
    return _atomic.write_text(out / COMPARE_HTML, compare_page.render(comparison, base_dir=out))

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
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from precprof import _atomic, _signals, hardware, rundir, taxonomy, training
from precprof import tables as T
from precprof.analysis.comparison import (
    ADVISED,
    DEFAULT_TOLERANCE,
    PRECISION_UNKNOWN,
    Comparison,
    Variant,
    analyse,
    parse_precisions,
    reference_index,
    setup_differences,
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
    A run that raises is recorded as failed, said in a line on stderr with where its traceback is, and the
    others still run; Ctrl-C writes the comparison of the runs so far and re-raises. Returns the ``Comparison``; ``compare.html`` and ``compare.json`` are in ``out``
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
    # (one interval for every run, every second step at least where one compiles: its sampled steps run eager)
    compiles = any(compiling.should_compile(base.compile, v.precision) for v in variants)
    sample_every = (
        base.sample_every
        if base.sample_every is not None
        else training.default_sample_every(base.steps, compiled=compiles)
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
    current: tuple[Variant, Path] | None = None  # the run training, for sys.exit() in it
    with training.notes_once():  # a note on how the runs run is said once, not once a precision
        try:
            for i in run_order:
                v = variants[i]
                run_dir = out / v.label
                current = (v, run_dir)
                cfg = dataclasses.replace(
                    base,
                    precision=v.precision,
                    loss_scale=v.loss_scale,
                    out=run_dir,
                    sample_every=sample_every,
                )
                if v.loss_scale == ADVISED:
                    cfg = _advised_config(cfg, out / variants[ref_i].label)
                try:
                    # named as its run directory is: fp16, fp16:none and fp16:advised all said "gpt-nano fp16"
                    training.train(cfg, label=v.label)
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
                    _say_failed(v.label, run_dir, e)
                done.append((v, run_dir))
                current = None
                if on_run is not None:
                    on_run(v, run_dir)
        except (
            KeyboardInterrupt
        ) as e:  # Ctrl-C or SIGTERM: the run in progress saved itself; compare the rest
            with _signals.deferred():  # a second Ctrl-C does not cut compare.html short
                _signals.consume()
                if done:
                    finished = _finish(done, variants, tolerance, shared, t0, out)
                    with contextlib.suppress(AttributeError):  # for the CLI's check lines and message
                        e.precprof_comparison = finished  # type: ignore[attr-defined]
                        e.precprof_compare_html = out / COMPARE_HTML  # type: ignore[attr-defined]
            raise
        except (
            SystemExit
        ) as e:  # sys.exit() in a run's code: the process ends, as it asks, once the runs so far
            with _signals.deferred():  # (the stopped one too: it saved itself) are compared
                if current is not None and T.is_run_dir(current[1]):
                    done.append(current)
                ran = {variant.label for variant, _ in done}
                not_run = [v.label for v in variants if v.label not in ran]
                with contextlib.suppress(AttributeError):  # for the CLI's check lines and message
                    e.precprof_not_run = not_run  # type: ignore[attr-defined]
                    e.precprof_stopped_run = current[0].label if current else None  # type: ignore[attr-defined]
                if done:
                    finished = _finish(done, variants, tolerance, shared, t0, out)
                    with contextlib.suppress(AttributeError):
                        e.precprof_comparison = finished  # type: ignore[attr-defined]
                        e.precprof_compare_html = out / COMPARE_HTML  # type: ignore[attr-defined]
            raise
    if not done:
        raise UserError("no run finished: nothing to compare")
    return _finish(done, variants, tolerance, shared, t0, out)


def _say_failed(label: str, run_dir: Path, e: Exception) -> None:
    """One line on stderr for a run that raised, as ``precprof train`` says it (its error, the model's line) and
    where its traceback is: the comparison goes on, and a run's failure showed only in the check lines at its
    end, as "bf16 stopped after 2 of 4 steps: RuntimeError", its traceback.txt named nowhere. A run that failed
    before its directory was made (the loop wrote no traceback.txt) gets one beside the summary written above."""
    failed = getattr(e, "precprof_failure", None)
    text = getattr(failed, "text", None) or f"{type(e).__name__}: {_first_line(e)}"
    kept = getattr(failed, "traceback", None)
    if kept is None:
        with contextlib.suppress(Exception):  # saying it must not stop the other runs
            kept = rundir.write_traceback(run_dir, "".join(traceback.format_exception(e)))
    if kept is None:
        where = ""
    elif getattr(failed, "blame", None) == "precprof":
        where = f"; it was raised in precprof's own code, a bug: please report it with {kept}"
    else:
        where = f"; its traceback is in {kept}"
    with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
        print(f"precprof: {label} failed: {text}{where}", file=sys.stderr, flush=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


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


def compare_runs(
    run_dirs: Sequence[str | Path],
    out: str | Path | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    overwrite: bool = False,
) -> tuple[Comparison, Path]:
    """Compare runs already recorded (a user's own loop, the callbacks, ``precprof train``): each named by its
    precision (the run's configuration, else what the Profiler saw it train in), or by its folder where two
    share one; fp32 (then tf32) is the reference, else the first, and of those the first that trained. Writes
    compare.json and compare.html into ``out`` (default: the folder holding the runs); a comparison already
    there is refused (UserError) unless ``overwrite``. Returns the comparison and the page's path."""
    dirs = [Path(d) for d in run_dirs]
    if len(dirs) < 2:
        raise UserError("give at least two run directories to compare")
    for d in dirs:
        if not T.is_run_dir(d):
            raise UserError(T.not_a_run_dir(d))
    if len({d.resolve() for d in dirs}) < len(dirs):
        raise UserError("a run directory is given twice")
    where = Path(out) if out is not None else Path(os.path.commonpath([str(d.resolve()) for d in dirs]))
    if where in {d.resolve() for d in dirs}:  # one run directory holds the others: the page goes beside it
        where = where.parent
    if out is None and where == Path(where.anchor):  # runs in unrelated places: not the filesystem's root
        where = Path.cwd()
    if not overwrite:
        _refuse_a_comparison_in(where, default=out is None)
    summaries = [T.read_summary(d) for d in dirs]
    # a run without summary.json records no model: it is not "a model" other than the rest (the note says)
    models = [_model_of(s) for s in summaries if s]
    if _different_models(models):
        raise UserError(
            "these runs trained different models ("
            + "; ".join(dict.fromkeys(models))
            + "): compare runs of one model, in the precisions to choose between"
        )
    precisions = [_precision_of(s, d) for s, d in zip(summaries, dirs, strict=True)]
    # a run goes by its precision; runs of one precision by their folders (a callback's is "precprof": its
    # parent's name with it)
    names = [
        p
        if precisions.count(p) == 1 and s and p != PRECISION_UNKNOWN
        else (d.name if d.name != "precprof" else f"{d.parent.name}/{d.name}")
        for p, d, s in zip(precisions, dirs, summaries, strict=True)
    ]
    names = [n if names.count(n) == 1 else f"{n}-{i + 1}" for i, n in enumerate(names)]
    variants = [Variant(p, name=n) for p, n in zip(precisions, names, strict=True)]
    # the settings every run had alike (the page's setup); the model by name where no run's settings say it
    configs = [dict(s.get(T.SUMMARY_CONFIG) or {}) for s in summaries if s] or [{}]
    shared = {k: v for k, v in configs[0].items() if all(k in c and c[k] == v for c in configs[1:])}
    shared.pop("precision", None)
    if models:
        shared.setdefault("model", models[0].split(" of ")[0])
    comparison = analyse(list(zip(variants, dirs, strict=True)), tolerance, shared, common_steps=True)
    comparison.recorded = True
    ranks = _ranks_note(summaries, names)
    if ranks:
        comparison.notes.insert(0, ranks)
    no_summary = _no_summary_notes([n for n, s in zip(names, summaries, strict=True) if not s])
    comparison.notes[:0] = [note for _, note in no_summary]
    # the check lines of such a run say it has no summary.json, and what that leaves unchecked
    comparison.page_only += [note for said, note in no_summary if comparison.said_by_checks(said)]
    differ = "; ".join(f"{what}: {values}" for what, values in setup_differences(comparison.runs))
    if differ:
        comparison.notes.insert(
            0,
            f"These runs differ in more than their precision: {differ}. Their losses, speeds and memory are not "
            "of one setup, so a difference between them is not the precision's alone, and the verdict check does "
            "not judge the advisor by a run set up otherwise than the reference.",
        )
    return comparison, write(comparison, where)


def _refuse_a_comparison_in(where: Path, default: bool) -> None:
    """A UserError when ``where`` holds a comparison already: comparing runs again wrote over it without a word
    (the comparison of three trained runs replaced by one of two of them), where a run in --out is refused."""
    found = [f for f in (COMPARE_JSON, COMPARE_HTML) if (where / f).exists()]
    if found:
        said = " (compare's default --out: the folder holding the runs)" if default else ""
        raise UserError(
            f"{where} already holds a comparison ({', '.join(found)}){said}; choose another --out, or add "
            "--overwrite to replace it"
        )


def _no_summary_notes(names: Sequence[str]) -> list[tuple[str, str]]:
    """A note for each run without summary.json: its model, precision and settings are not recorded, so nothing
    says it trained what the others did (compare had said "these runs trained different models"). Each with its
    opening words, which a check line about the run says too."""
    said = [f"{name} has no {T.SUMMARY_FILE}" for name in names]
    return [
        (
            s,
            f"{s}: its model, precision and settings are not recorded, so this comparison cannot check that it "
            "trained the same model and setup as the others; it goes by its folder's name, and its loss and "
            "memory are read from its tables.",
        )
        for s in said
    ]


def _ranks_note(summaries: Sequence[Mapping[str, Any]], names: Sequence[str]) -> str:
    """A note when a run trained on several processes (torch.distributed): its steps table holds rank 0's
    loss, of rank 0's share of the batch, and its memory is one rank's; "" when every run was one process."""
    many = []
    for name, s in zip(names, summaries, strict=True):
        dist = (s.get(T.SUMMARY_CAPTURE) or {}).get("distributed") or {}
        n = dist.get("world_size") if isinstance(dist, Mapping) else None
        if not isinstance(n, int):
            n = (s.get(T.SUMMARY_CONFIG) or {}).get("world_size")
        if isinstance(n, int) and n > 1:
            wrapper = dist.get("wrapper") if isinstance(dist, Mapping) else None
            many.append(
                f"{name} on {n} processes" + (f" ({wrapper})" if wrapper and wrapper != "none" else "")
            )
    if not many:
        return ""
    return (
        f"Trained on several processes: {', '.join(many)}. Such a run's loss is rank 0's, of its share of the "
        "batch, not the mean over ranks, so a gap to a one-process run is partly rank 0's batch; its memory is "
        "one rank's."
    )


def _precision_of(summary: dict[str, Any], run_dir: Path) -> str:
    """The precision a run goes by: its configuration's, or the one its capture saw; a run still recording, or
    killed before it saved (its first summary, written before any forward pass, names none), by its layers'
    dtypes as its report reads them (it went by "run": "the run run has no recommendation to check"); else
    ``PRECISION_UNKNOWN`` (a run that sampled no step), which goes by its folder."""
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    said = cfg.get("precision") or capture.get("precision_seen")
    if not said and T.is_run_dir(run_dir):
        said = taxonomy.precision_in_layers(T.read_run(run_dir).tables["layers"])
    return str(said or PRECISION_UNKNOWN).lower()


def _different_models(models: Sequence[str]) -> bool:
    """Whether runs' models (``_model_of``) differ: in class, or in size where two runs record it (a run cut off
    before it saved may record its model's class alone: not another model for that)."""
    names = {m.split(" of ")[0] for m in models}
    sizes = {m for m in models if " of " in m}
    return len(names) > 1 or len(sizes) > 1


def _model_of(summary: dict[str, Any]) -> str:
    """A run's model in words, to tell runs of different models apart: its class and size."""
    model = summary.get(T.SUMMARY_MODEL) or {}
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    name = model.get("name") or capture.get("model_class") or "a model"
    n = model.get("n_params") or capture.get("n_params")
    return f"{name} of {int(n):,} parameters" if isinstance(n, (int, float)) else str(name)


def write(comparison: Comparison, out: str | Path) -> Path:
    """Write ``compare.json`` and ``compare.html`` into ``out``; returns the HTML path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _atomic.write_text(out / COMPARE_JSON, T.json_text(comparison.to_dict()))
    return _atomic.write_text(out / COMPARE_HTML, compare_page.render(comparison, base_dir=out))

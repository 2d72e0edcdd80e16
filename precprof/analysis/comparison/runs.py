"""The runs of a comparison: the variants (precision mode and loss scaling), each run's figures read back from its
run directory, and its outcome against the reference run.

Outcome of a run against the reference: ``no loss recorded`` (its loop passed none to ``prof.step``),
``diverged`` (non-finite final loss), ``stalled`` (it removed less
than a quarter of the loss the reference removed), ``matched`` (final loss within ``tolerance``, relative),
else ``behind`` or ``ahead``; ``not compared`` when the reference has no final loss to compare with. A scaled
run's loss scale is the one its steps table records, with the times it grew and backed off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from precprof import rundir
from precprof import tables as T
from precprof.analysis.memory_projection import measured_components
from precprof.analysis.throughput import compiled_steps, throughput
from precprof.errors import UserError
from precprof.modes import PRECISIONS, parse_loss_scale

REFERENCE_PREFERENCE = ("fp32", "tf32")
DEFAULT_TOLERANCE = 0.02  # relative final-loss gap within which a run "matched" the reference
STALL_PROGRESS = 0.25  # a run that removed less than this share of the reference's loss decrease "stalled"
ADVISED = "advised"  # loss scaling spec: dynamic, from the init_scale the advisor gave on the reference run

# outcomes
REFERENCE, MATCHED, BEHIND, AHEAD, STALLED, DIVERGED, FAILED = (
    "reference",
    "matched",
    "behind",
    "ahead",
    "stalled",
    "diverged",
    "failed",
)
UNRECORDED = "unknown"  # the status of a run without summary.json: what it trained is not recorded
# the precision of a recorded run that names none (``Profiler(sample_every=0)``: no sampled step saw one)
PRECISION_UNKNOWN = "unknown"
PRECISION_UNKNOWN_WHY = "no sampled step recorded it"
UNCOMPARED = "not compared"  # a finished run against a reference without a final loss (it diverged)
NO_LOSS = "no loss recorded"  # a run whose loop passed no loss (``prof.step()`` without ``loss=``)
NO_LOSS_WHY = "its loop called prof.step() without loss="
BAD_OUTCOMES = frozenset({BEHIND, STALLED, DIVERGED})

# the settings besides precision that decide what a run's loss, speed and memory are, as summary.json's config
# names them (the built-in loop; the transformers and Lightning callbacks), in words
SETUP_SETTINGS = {
    "model_args": "model settings",
    "optimizer_class": "optimizer",
    "lr": "learning rate",
    "learning_rate": "learning rate",
    "weight_decay": "weight decay",
    "grad_clip": "gradient clipping",
    "seed": "seed",
    "data": "data",
    "batch_size": "batch size",
    "seq_len": "sequence length",
    "gradient_accumulation_steps": "gradient accumulation",
    "accumulate_grad_batches": "gradient accumulation",
    "max_steps": "planned steps",  # a learning-rate schedule's length
    "steps": "steps",
}
# a setting runs may differ in and still be compared: runs of different lengths are compared on the steps all of
# them finished (``analyse`` says so), and the built-in loop's learning rate does not follow its number of steps
COMPARED_ANYWAY = frozenset({"steps"})


@dataclass(frozen=True)
class Variant:
    """One run of a comparison: a precision mode and its loss scaling spec ("auto", "dynamic", "none",
    "static:N", or "advised": dynamic scaling starting at the init_scale the advisor recommends on the
    reference run's profile, so that the recommendation itself is trained and checked)."""

    precision: str
    loss_scale: str = "auto"
    name: str = ""  # a run read from its directory (``precprof compare RUN_DIR ...``) goes by this name

    @property
    def label(self) -> str:
        """Display name and run-directory name: ``fp16``, ``fp16-none``, ``fp16-static-8192``."""
        if self.name:
            return self.name
        if self.loss_scale == "auto":
            return self.precision
        spec = self.loss_scale.replace(":", "-")
        if spec.startswith("static-"):
            with contextlib.suppress(ValueError):  # static:8192.0 -> static-8192, every digit (:g made 2^40
                value = float(spec[7:])  # and 2^40 + 1 both "1.09951e+12": one run directory)
                spec = f"static-{int(value) if value.is_integer() else value!r}"
        return f"{self.precision}-{spec}"


def parse_precisions(spec: str | Sequence[str]) -> list[Variant]:
    """``"fp32,bf16,fp16,fp16:none"`` -> variants; UserError for an unknown mode, a bad scaling spec or a
    duplicate."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[Variant] = []
    for raw in items:
        item = raw.strip().lower()
        if not item:
            continue
        precision, _, scale = item.partition(":")
        if precision not in PRECISIONS:
            raise UserError(
                f"--precisions: unknown precision {precision!r}; choose from {', '.join(PRECISIONS)} "
                "(optionally with a loss scaling spec, e.g. fp16:none or fp16:static:8192)"
            )
        scale = scale or "auto"
        if scale == ADVISED:
            if not precision.startswith("fp16"):
                raise UserError(
                    f"--precisions {item!r}: 'advised' is a loss scale, for fp16 and fp16-pure only"
                )
        else:
            parse_loss_scale(scale)
        v = Variant(precision, scale)
        if v.label in [o.label for o in out]:  # (static:8192 and static:8192.0: one run, one directory)
            raise UserError(f"--precisions: {v.label} is listed twice")
        out.append(v)
    if len(out) < 2:
        raise UserError("--precisions: give at least two precisions to compare, e.g. fp32,bf16,fp16")
    return out


def reference_candidates(variants: Sequence[Variant]) -> list[int]:
    """The runs the rule for choosing the reference allows, best first: those in fp32, else those in tf32,
    else every run in the order given."""
    for name in REFERENCE_PREFERENCE:
        allowed = [i for i, v in enumerate(variants) if v.precision == name]
        if allowed:
            return allowed
    return list(range(len(variants)))


def reference_index(variants: Sequence[Variant]) -> int:
    """The run the others are compared with before any trained: fp32 (then tf32), else the first."""
    return reference_candidates(variants)[0]


@dataclass
class RunResult:
    """What one run of the comparison did, read back from its run directory."""

    label: str
    precision: str
    loss_scale: str
    run_dir: str
    status: str
    reason: str | None
    steps: int
    initial_loss: float
    final_loss: float  # mean over the final window
    final_window: int
    gap: float | None  # (final - reference final) / reference final; None for the reference itself
    outcome: str
    tokens_per_s: float
    speedup: float | None
    skipped_steps: int
    first_nonfinite_step: int | None
    loss_scaling: str  # resolved: dynamic | static | none
    final_scale: float | None  # loss scale in effect on the last step with a finite one (scaled runs)
    init_scale: float | None  # the scaler's initial scale (scaled runs)
    scale_growths: int  # steps whose loss scale is above the previous step's
    scale_backoffs: int  # steps whose loss scale is below the previous step's
    last_scale_change_step: int | None  # the first step at the final scale, when the scale ever changed
    steps_at_final_scale: int  # steps (rows with a finite scale) from the last change to the end
    machine: str  # where the run trained: "cpu: AMD EPYC", "cuda: NVIDIA H100 80GB HBM3"
    target: str | None  # hardware name the run's summary records (what the advisor plans for by default)
    memory: dict[str, int]
    memory_total: int
    recommendation: dict[str, Any] | None
    wall_s: float
    report: str | None
    curve_steps: list[int] = field(default_factory=list)
    curve_loss: list[float] = field(default_factory=list)
    # the steps of the curve whose update the loss scaler skipped (an overflow: the loss of such a step may be
    # far off the others')
    skipped_at: list[int] = field(default_factory=list)
    # the compared steps whose loss the loop passed (``steps`` counts them all: a loop's ``prof.step()`` without
    # ``loss=`` records a step without one); None where not counted (a result not read from a run directory)
    loss_steps: int | None = None
    # how the loop ran the model ("compiled (torch.compile), the default for fp8", "eager, --no-compile"); None
    # for a run recorded before the loop said
    compiled: str | None = None
    # the steps tokens_per_s comes from: those without per-layer capture, else every step (a short run samples
    # every step): ``analysis.throughput``'s basis and how many steps count
    tokens_per_s_basis: str = ""
    tokens_per_s_steps: int = 0
    step_time_spread: float = math.nan  # the counted steps' interquartile range over their median
    # cores busy with other work on average while its steps were timed, and the machine's logical CPUs (its
    # summary.json's ``final.other_cpu_cores`` and ``final.cpu_count``); None where not measured (no /proc/stat,
    # a run recorded before precprof measured it)
    other_cpu_cores: float | None = None
    cpu_count: int | None = None
    # why no speed-up against the reference was taken ("" when one was, or nothing was timed)
    speed_not_taken: str = ""
    # why its throughput says nothing of its format's speed: the machine it trained on emulates the format (fp16 on
    # a CPU without fp16 arithmetic); "" when it does not. Its speed-up is kept (the page draws it, beside the
    # note), but confirms or contradicts no check
    emulated: str = ""
    # whether the machine it trained on computes fp16 in hardware, as its summary.json records it (every CUDA GPU;
    # a CPU with AVX512-FP16 or AMX-FP16); None for a run recorded before precprof recorded it
    fp16_native: bool | None = None
    # the run's ``SETUP_SETTINGS`` as its summary.json's config records them
    settings: dict[str, Any] = field(default_factory=dict)
    # the settings (in words) other than ``COMPARED_ANYWAY`` in which this run differs from the reference
    setup_differs: list[str] = field(default_factory=list)
    # the finished steps it recorded, all of them (``steps``: those compared, up to the step every run finished)
    steps_run: int = 0
    # how a run whose training did not finish stopped: "stopped after 5 of 20 steps (interrupted (Ctrl-C,
    # SIGINT))"; "" for one whose training ran to its end and only saving fell short (a full disk)
    stopped: str = ""
    # the last step compared when runs of different lengths are compared on the steps all of them finished
    compared_until: int | None = None
    # the runs whose loss went non-finite before that step, which do not set it (a diverged run is compared on
    # the steps it ran: an fp16 run that died at step 5 cut fp32's and bf16's 34 steps to 5)
    until_leaves_out: list[str] = field(default_factory=list)
    # the table files absent from its run directory (``tables.missing_tables``), named as its report names them
    missing: list[str] = field(default_factory=list)
    # the reference only: why it did not train itself ("" when it did: ``did_not_train``)
    did_not_train: str = ""
    # an "advised" fp16 run whose reference profile rules fp16 out: its init_scale is the one the advisor sized on
    # the largest gradient, not one it advised
    ruled_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def smoothing_window(n: int) -> int:
    return max(5, n // 10) if n else 0


def finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def _number(value: Any) -> float | None:
    """A finite number of summary.json, or None (absent, null, not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _memory(memory: pd.DataFrame) -> dict[str, int]:
    """Bytes per component on the run's largest measured step, from its memory table as the report reads it
    (summary.json of a killed run has none: compare showed it as 0 B), precprof's own buffers left out."""
    return {k: v for k, v in measured_components(memory).items() if k != T.PROFILER_BUFFERS}


def read_tables(run_dir: Path) -> tuple[T.RunTables, bool]:
    """A run directory's tables as ``precprof report`` reads them (``tables.read_run``: from the parts it
    streamed when it never saved them), and whether a process still writes it, asked first as the report asks."""
    # (a run whose Profiler stopped before it saved is held, not written: its cause, not "running")
    live = rundir.live_writer(run_dir) is not None and rundir.stopped_note(run_dir) is None
    return T.read_run(run_dir, histogram_totals=True), live


# what ``capture.unsaved`` writes after an exception's one line: "; raised after step 3 (...), before the run was
# saved: ..." or "; not caught, it ended the script after step 3 ..."
_UNSAVED_TAIL = re.compile(
    r"; (?:raised|not caught, it ended the script) (?:after step|before prof\.step\(\)).*$"
)


def _status(summary: Mapping[str, Any], read: T.RunTables, live: bool) -> tuple[str, str | None]:
    """A run's status and why it did not complete, as its report says them: a run that never saved its tables
    was cut off after the last step it flushed, whatever its first summary.json still says ("running (pid
    ...)"); one that a process still writes is running."""
    if read.streamed and live:
        return "running", f"still being written; read up to step {read.last_step}"
    if read.streamed:
        where = (
            f"after step {read.last_step}" if read.last_step is not None else "before any step was flushed"
        )
        said = summary.get(T.SUMMARY_INCOMPLETE_REASON) if summary else None
        if isinstance(said, str) and said and not rundir.says_running(summary):
            # the cause the process wrote before it ended (an exception in a with block, one that ended the
            # script: ``capture.unsaved``), not a kill
            # (the cause without what capture.unsaved adds after it: after which step, and a report command for
            # the run's own folder; the exception's own "; " kept)
            cause = _UNSAVED_TAIL.sub("", said).strip()
            return T.STATUS_INCOMPLETE, f"cut off {where}: {cause}"
        # killed: what it ran after the last step on disk is not known (a step reaches the disk at the next
        # sampled step or within seconds), so its record ends there, not necessarily the run
        ends = f"record ends {where}" if read.last_step is not None else f"cut off {where}"
        return T.STATUS_INCOMPLETE, (
            f"{ends}: killed before it saved its tables, which are read from the parts it wrote while training"
        )
    if not summary:
        return UNRECORDED, f"no {T.SUMMARY_FILE} in its run directory"
    return str(summary.get(T.SUMMARY_STATUS) or "missing"), summary.get(T.SUMMARY_INCOMPLETE_REASON)


@dataclass(frozen=True)
class _ScaleHistory:
    final: float | None
    growths: int
    backoffs: int
    last_change_step: int | None
    steps_at_final: int


def _scale_history(steps: pd.DataFrame) -> _ScaleHistory:
    """The loss scale a run ended at and how it moved, from the steps table (each row: the scale in effect
    during that step). Rows without a finite scale are left out."""
    if steps.empty:
        return _ScaleHistory(None, 0, 0, None, 0)
    scales = steps[T.LOSS_SCALE].astype(float).to_numpy()
    ok = np.isfinite(scales)
    s, step = scales[ok], steps[T.STEP].to_numpy()[ok]
    if not len(s):
        return _ScaleHistory(None, 0, 0, None, 0)
    d = np.diff(s)
    changes = np.nonzero(d != 0)[0]
    last = int(changes[-1]) + 1 if len(changes) else None  # index of the first row at the final scale
    return _ScaleHistory(
        final=float(s[-1]),
        growths=int((d > 0).sum()),
        backoffs=int((d < 0).sum()),
        last_change_step=int(step[last]) if last is not None else None,
        steps_at_final=len(s) - (last or 0),
    )


def _without_block_layers(rec: Any) -> Any:
    """A run's recommendation as a comparison keeps it (compare.json's ``runs[].recommendation``): the block-format
    what-if's figures per linear layer (``block_what_if.layers``, about 12 KB a layer: 4 MB of a 48-layer model's,
    each run's copy in compare.json) are left in the run's own summary.json, which the comparison does not read
    them from; ``block_what_if.layers_in_summary`` counts them."""
    if not isinstance(rec, dict):
        return rec
    block = rec.get("block_what_if")
    if not isinstance(block, dict) or not isinstance(block.get("layers"), list):
        return rec
    kept = {k: v for k, v in block.items() if k != "layers"}
    return {**rec, "block_what_if": {**kept, "layers_in_summary": len(block["layers"])}}


def read_run(
    variant: Variant,
    run_dir: Path,
    until: int | None = None,
    read: tuple[T.RunTables, bool] | None = None,
) -> RunResult:
    """A run's facts from its run directory (outcome and gap are filled in by ``analyse``), from its steps up
    to ``until`` (all of them when None); ``read``: its ``read_tables`` when the caller read them already."""
    summary = T.read_summary(run_dir)
    tables, live = read if read is not None else read_tables(run_dir)
    steps = T.finished_steps(tables.tables["steps"]).sort_values(T.STEP)
    steps_run = len(steps)
    if until is not None and not steps.empty:
        steps = steps[pd.to_numeric(steps[T.STEP]) <= until]
    # the steps whose loss the loop passed: a step of ``prof.step()`` without ``loss=`` has none, not a nan one
    given = T.given_losses(steps) if not steps.empty else steps
    loss = given[T.LOSS].astype(float).to_numpy() if not given.empty else np.array([])
    win = smoothing_window(len(loss))
    tail = finite(loss[-win:]) if win else np.array([])
    bad = np.nonzero(~np.isfinite(loss))[0]
    # a run that went non-finite at its end has no meaningful final loss
    final = float(tail.mean()) if len(tail) and np.isfinite(loss[-1]) else math.nan
    first = finite(loss[:1])
    cfg = summary.get(T.SUMMARY_CONFIG) or {}
    capture = summary.get(T.SUMMARY_CAPTURE) or {}
    # a run of a user's own loop says its scaling by what the Profiler was given: a GradScaler, a static scale
    seen = (
        "dynamic" if capture.get("scaler_enabled") else "static" if capture.get("static_loss_scale") else None
    )
    kind = str(
        cfg.get("loss_scaling")
        or seen
        or ("none" if variant.loss_scale in ("auto", "none") else variant.loss_scale)
    )
    scale = _scale_history(steps) if kind != "none" else _ScaleHistory(None, 0, 0, None, 0)
    hw = summary.get(T.SUMMARY_HARDWARE) or {}
    device, name = hw.get("device"), hw.get("name")
    machine = ": ".join(str(x) for x in (device, name) if x) or "unknown"
    fp16_native = hw.get("fp16_native")
    mem = _memory(tables.tables["memory"])
    status, reason = _status(summary, tables, live)
    init_scale = (
        cfg.get("static_scale") if kind == "static" else cfg.get("init_scale") if kind == "dynamic" else None
    )
    report = run_dir / T.REPORT_FILE
    final_block = summary.get(T.SUMMARY_FINAL) or {}
    # tokens per second of the steps without per-layer capture, where there are some, torch.compile's left out
    tp = throughput(steps, compiled_steps(summary))
    return RunResult(
        label=variant.label,
        precision=variant.precision,
        loss_scale=variant.loss_scale,
        run_dir=str(run_dir),
        status=status,
        reason=reason,
        steps=len(steps),
        initial_loss=float(first[0]) if len(first) else math.nan,
        final_loss=final,
        final_window=win,
        gap=None,
        outcome=FAILED if steps.empty else REFERENCE,
        tokens_per_s=float(tp["tokens_per_s"]),
        tokens_per_s_basis=str(tp["tokens_per_s_basis"]),
        tokens_per_s_steps=int(tp["tokens_per_s_steps"]),
        step_time_spread=float(tp["step_time_spread"]),
        other_cpu_cores=_number(final_block.get("other_cpu_cores")),
        cpu_count=int(n) if (n := _number(final_block.get("cpu_count"))) else None,
        speedup=None,
        skipped_steps=int(steps[T.SKIPPED].astype(bool).sum()) if not steps.empty else 0,
        first_nonfinite_step=int(given[T.STEP].iloc[bad[0]]) if len(bad) else None,
        loss_scaling=kind,
        final_scale=scale.final,
        init_scale=float(init_scale) if isinstance(init_scale, (int, float)) else None,
        scale_growths=scale.growths,
        scale_backoffs=scale.backoffs,
        last_scale_change_step=scale.last_change_step,
        steps_at_final_scale=scale.steps_at_final,
        machine=machine,
        fp16_native=fp16_native if isinstance(fp16_native, bool) else None,
        target=str(name) if name else None,
        memory=mem,
        memory_total=sum(v for k, v in mem.items() if k not in T.MEMORY_PEAK_COMPONENTS),
        recommendation=_without_block_layers(summary.get(T.SUMMARY_RECOMMENDATION)),
        wall_s=float(final_block.get("wall_s", math.nan) or math.nan),
        report=str(report) if report.exists() else None,
        curve_steps=[int(s) for s in given[T.STEP]] if not given.empty else [],
        loss_steps=len(loss),
        curve_loss=[float(v) for v in loss],
        skipped_at=[int(s) for s in steps.loc[steps[T.SKIPPED].astype(bool), T.STEP]]
        if not steps.empty
        else [],
        compiled=_compiled(cfg, T.finished_steps(tables.tables["steps"]), tables.streamed),
        settings={k: cfg[k] for k in SETUP_SETTINGS if cfg.get(k) is not None},
        missing=[T.TABLE_FILES[name] for name in T.missing_tables(run_dir)],
        steps_run=steps_run,
        stopped=_stopped(status, reason, tables, steps_run, cfg.get("steps"), summary),
        compared_until=until,
    )


def _compiled(cfg: Mapping[str, Any], steps: pd.DataFrame, streamed: bool) -> str | None:
    """How the loop ran the model, as the run's config says it; for a compiled run that never saved (killed), whose
    config is the one written before training, with the steps that ran compiled counted from its steps table
    (a sampled step runs the model eagerly): it read "compiled (torch.compile)" of a run that ran none."""
    said = str(cfg["compiled"]) if isinstance(cfg.get("compiled"), str) else None
    # (the first summary holds steps_run_compiled null: counted when the run saves)
    if not (said and streamed and cfg.get("compile") is True and cfg.get("steps_run_compiled") is None):
        return said
    if steps.empty or T.SAMPLED not in steps:
        return said
    n, total = int((~T.flags(steps[T.SAMPLED])).sum()), len(steps)
    counted = "counted from the steps table of a run that never saved"
    if n == 0:
        return f"ran no step compiled: every step was sampled, and a sampled step runs the model eagerly ({counted})"
    return f"{said}: {n} of {total} steps ran compiled, the sampled ones eagerly ({counted})"


def _stopped(
    status: str, reason: str | None, read: T.RunTables, done: int, planned: Any, summary: Mapping[str, Any]
) -> str:
    """How a run that did not finish stopped, in a few words ("" for one that did): after how many of its
    planned steps, and why (its summary's cause up to its first colon, "killed" for a run that never saved and
    whose process wrote no cause: "stopped (its record ends after 11 of 5,000 steps): killed", the steps that
    reached its disk).
    A run whose training ran to its end and only lost files (a full disk: its report.html was not written) did
    not stop: its loss is the loss it ends at."""
    finished = summary.get(T.SUMMARY_TRAINING_FINISHED) is True and not read.streamed
    if status not in (T.STATUS_INCOMPLETE, "running") or finished:
        return ""
    if read.streamed and status != "running":  # never saved: killed, unless the process wrote why it stopped
        said = summary.get(T.SUMMARY_INCOMPLETE_REASON)
        cause = said if isinstance(said, str) and said and not rundir.says_running(summary) else None
        why = re.split(r"[:;]", _UNSAVED_TAIL.sub("", cause))[0].strip() if cause else "killed"
    else:
        why = re.split(r"[:;]", reason or "")[0].strip()
    of = f" of {planned:,}" if isinstance(planned, int) and planned > done else ""
    many = planned if of else done  # "after 1 of 3 steps", "after 1 step"
    after = f"after {done:,}{of} step{'s' if many != 1 else ''}"
    if read.streamed and why == "killed":
        # what reached the disk: the run may have gone further (a step reaches it at the next sampled step or
        # within seconds), as its page says
        return f"stopped (its record ends {after}): killed"
    return f"stopped {after}" + (f": {why}" if why else "")


def cut_short(run: RunResult, ref: RunResult) -> str:
    """Why ``run``'s loss against ``ref``'s is not that of whole runs, in words ("" when it is): either stopped
    early (interrupted, killed, crashed), or runs of different lengths are compared on the steps all of them
    finished, short of the end of one. A loss over a run's first steps is not the loss it ends at."""
    said = _both_stopped(run, ref) or [f"{x.label} {x.stopped}" for x in (run, ref) if x.stopped]
    cut = any(x.compared_until is not None and x.steps_run > x.steps for x in (run, ref))
    if not said and not cut:
        return ""
    if not said and run.steps_run != ref.steps_run:
        said = [f"{run.label} ran {run.steps_run:,} steps and {ref.label} {ref.steps_run:,}"]
    if cut:
        said.append(compared_up_to(run.compared_until, run.until_leaves_out))
    return "; ".join(said)


def _both_stopped(run: RunResult, ref: RunResult) -> list[str]:
    """How both runs stopped, where they stopped for one reason, in one phrase that says the reason once ("bf16
    stopped after 11 of 5,000 steps and fp32 after 27 of 5,000 steps, both interrupted (Ctrl-C, SIGINT)"); two runs
    cut by Ctrl-C said "interrupted (Ctrl-C, SIGINT)" twice in a line. [] otherwise. The reason follows the only
    colon of a ``_stopped`` text."""
    (far, why), (ref_far, ref_why) = (x.stopped.partition(": ")[::2] for x in (run, ref))
    if not (far and why and why == ref_why):
        return []
    return [f"{run.label} {far} and {ref.label} {ref_far.removeprefix('stopped ')}, both {why}"]


def compared_up_to(step: int | None, diverged: Sequence[str] = ()) -> str:
    """Where runs of different lengths are compared, in the words of the check lines (``cut_short``);
    ``diverged``: the runs whose loss went non-finite earlier, which do not set that step."""
    if diverged:
        but = ", ".join(diverged)
        return f"compared up to step {step}, the last step every run but {but} (diverged) finished"
    return f"compared up to step {step}, the last step every run finished"


def _key(v: Any) -> str:
    return json.dumps(v, sort_keys=True, default=str)


def setup_differs(run: RunResult, ref: RunResult) -> list[str]:
    """The settings (in words, each once) in which ``run`` trained otherwise than ``ref``, of those both
    record, leaving out ``COMPARED_ANYWAY``: a user's own loop records none, and differs in none."""
    keys = [k for k in run.settings if k in ref.settings and k not in COMPARED_ANYWAY]
    return list(
        dict.fromkeys(SETUP_SETTINGS[k] for k in keys if _key(run.settings[k]) != _key(ref.settings[k]))
    )


def setup_differences(runs: Sequence[RunResult], keys: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """The settings of ``keys`` (default: ``SETUP_SETTINGS`` but ``COMPARED_ANYWAY``) that the runs recording
    them differ in, each as (the setting in words, each run's value: "fp32 0.003, diverge 20"); [] when every
    run that says agrees (a user's own loop records none of them)."""
    out = []
    for key in keys if keys is not None else [k for k in SETUP_SETTINGS if k not in COMPARED_ANYWAY]:
        said = [(r.label, _setting_of(r, key)) for r in runs if key in r.settings]
        if len({_key(v) for _, v in said}) > 1:
            out.append((SETUP_SETTINGS[key], ", ".join(f"{n} {setting_text(key, v)}" for n, v in said)))
    return out


def _setting_of(run: RunResult, key: str) -> Any:
    """``run``'s setting ``key``; its steps, of a run that stopped short of those planned, both: "37 of 200
    planned" (the Setup said "bf16 200" of a run the note beside it said trained 37)."""
    v = run.settings[key]
    if key == "steps" and isinstance(v, int) and 0 < run.steps_run < v:
        return f"{run.steps_run:,} of {v:,} planned"
    return v


def setting_text(key: str, v: Any) -> str:
    """A setting's value in a few words: model settings as ``name=value``, the built-in loop's data by where it
    came from."""
    if isinstance(v, Mapping) and key == "model_args":
        return ", ".join(f"{k}={x}" for k, x in v.items()) or "none"
    if isinstance(v, float):  # 20, not 20.0
        return f"{v:g}"
    if isinstance(v, Mapping):
        return str(v.get("path") or v.get("name") or v.get("kind") or _key(v))
    return str(v)


def _progress(run: RunResult) -> float:
    """The share of its first loss a run removed by its end (nan when not known): a share, not an amount, so
    that runs whose model settings scale the loss compare."""
    if not (math.isfinite(run.initial_loss) and math.isfinite(run.final_loss)) or run.initial_loss == 0:
        return math.nan
    return (run.initial_loss - run.final_loss) / abs(run.initial_loss)


STEPS_FILE = T.TABLE_FILES["steps"]


def no_steps_file(run: RunResult) -> bool:
    """Whether ``run``'s steps table is missing from its run directory: it has no loss to compare, which says
    nothing of how it trained (a file deleted or never copied), and no verdict of it is given."""
    return STEPS_FILE in run.missing


def recorded_no_loss(run: RunResult) -> bool:
    """Whether ``run`` finished steps but passed a loss on none of them (``prof.step()`` without ``loss=``): it has
    no loss to compare, which says nothing of how it trained (its final loss is nan, as a diverged run's is)."""
    return bool(run.steps) and run.loss_steps == 0 and not no_steps_file(run)


def unusable(run: RunResult) -> str:
    """What a reference that ``did_not_train`` gives says of it: that it did not train, or, one that recorded no
    loss, that it has none to compare with (it may have trained well)."""
    return "has no loss to compare with" if recorded_no_loss(run) else "did not train"


def did_not_train(run: RunResult, others: Sequence[RunResult]) -> str:
    """Why ``run`` did not train, in words ("" when it did): it recorded no step, its loss ended non-finite or
    above 1.5 times its first (``classify``'s divergence), or it removed less than ``STALL_PROGRESS`` of the
    share of its first loss that another run removed (fp16 whose every gradient flushed to zero)."""
    if no_steps_file(run):
        return f"its {STEPS_FILE} is missing from its run directory"
    if not run.steps:
        return "it recorded no finished step"
    if recorded_no_loss(run):
        return NO_LOSS_WHY
    if not math.isfinite(run.final_loss):
        at = f" at step {run.first_nonfinite_step}" if run.first_nonfinite_step is not None else ""
        return f"its loss became non-finite{at}"
    if run.initial_loss > 0 and run.final_loss > 1.5 * run.initial_loss:
        return f"its loss rose from {run.initial_loss:.3g} to {run.final_loss:.3g}"
    mine = _progress(run)
    best = max(
        (o for o in others if o is not run and math.isfinite(_progress(o))), key=_progress, default=None
    )
    # another run that removed nothing is no measure of what this one should have removed
    if (
        best is None
        or _progress(best) <= 0
        or not math.isfinite(mine)
        or mine >= STALL_PROGRESS * _progress(best)
    ):
        return ""
    removed = f"{mine:.1%}" if mine > 0 else "none"
    return (
        f"its loss went {run.initial_loss:.3g} → {run.final_loss:.3g} and removed {removed} of its first loss, "
        f"while {best.label} removed {_progress(best):.1%} of its own"
    )


def classify(run: RunResult, ref: RunResult, tolerance: float) -> tuple[str, float | None]:
    """(outcome, relative gap) of ``run`` against the reference run."""
    if no_steps_file(run):
        return UNCOMPARED, None
    if run.status == "missing" or not run.steps:
        return FAILED, None
    if recorded_no_loss(run):
        return NO_LOSS, None
    if not math.isfinite(run.final_loss):
        return DIVERGED, None
    if not math.isfinite(ref.final_loss) or ref.final_loss == 0:
        return UNCOMPARED, None
    gap = (run.final_loss - ref.final_loss) / abs(ref.final_loss)
    if run.initial_loss > 0 and run.final_loss > 1.5 * run.initial_loss:
        return DIVERGED, gap
    ref_drop = ref.initial_loss - ref.final_loss
    if ref_drop > 0 and (run.initial_loss - run.final_loss) < STALL_PROGRESS * ref_drop:
        return STALLED, gap
    if abs(gap) <= tolerance:
        return MATCHED, gap
    return (BEHIND if gap > 0 else AHEAD), gap

"""The ``precprof`` command: wiring only. The work happens in precprof.training, precprof.hardware and
precprof.report.

Every user mistake (UserError, or a usage error of the command line) is printed as one line on stderr and
exits with code 2; Ctrl-C exits with 130, SIGTERM with 143 and SIGHUP with 129, after the training loop has
saved the partial run; sys.exit() in the model's code exits with its code (1 for sys.exit(0): the run did not
finish), after the same.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import shlex
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # typer >= 0.2x carries its own copy of click; older versions use click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _cx  # type: ignore[no-redef]

from precprof import _cli_options as O
from precprof import _signals, hardware, pipeline, rundir, training
from precprof import compare as comparing
from precprof import export as exporting
from precprof import tables as T
from precprof._version import __version__
from precprof.analysis.advisor import Recommendation
from precprof.errors import (
    PEER_BLAME,
    TRACEBACK_ENV,
    ModelError,
    RunNotSavedWarning,
    UserError,
    traceback_wanted,
)
from precprof.modes import Precision

EXIT_NOT_SAVED = 1  # the run trained but its directory could not be written whole (a full disk)
EXIT_MODEL_ERROR = 1  # the user's model raised: as Python exits on an exception it prints
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM exits with 143


# the arguments main() is parsing: the process's own, or those a caller passed (tests, a wrapper script)
_argv: list[str] = []


def _command_line() -> str:
    return shlex.join(["precprof", *_argv])


def _exit_code(e: KeyboardInterrupt) -> int:
    interrupted = _signals.as_interrupted(e)
    return interrupted.exit_code if interrupted is not None else EXIT_INTERRUPTED


def _stopped(e: KeyboardInterrupt) -> str:
    interrupted = _signals.as_interrupted(e)
    return interrupted.reason if interrupted is not None else "interrupted"


def _saved(run_dir: str | Path) -> str:
    """Where an interrupted run is, after "interrupted (Ctrl-C, SIGINT)", as its summary says it: the partial run,
    one whose training had finished (Ctrl-C while it was saved), or one saved whole before the signal was
    raised; its finished steps; its report, or how to render it (Ctrl-C while it rendered printed no directory)."""
    try:
        summary = T.read_summary(run_dir)
    except (OSError, ValueError):  # the interrupt came before a summary was written
        summary = {}
    done = (summary.get(T.SUMMARY_FINAL) or {}).get("steps_done")
    steps = f" ({done} finished step{'s' if done != 1 else ''})" if isinstance(done, int) else ""
    if summary.get(T.SUMMARY_STATUS) == T.STATUS_COMPLETE:
        said = f" once the run was saved whole: the run is in {run_dir}{steps}"
    elif summary.get(T.SUMMARY_TRAINING_FINISHED) is True:
        said = f" after training finished: the run is in {run_dir}{steps}"
    else:
        said = f": the partial run is in {run_dir}{steps}"
    html = Path(run_dir) / T.REPORT_FILE
    return said + (
        f"\nreport: {html}"
        if html.exists()
        else f"\nreport: not rendered; `precprof report {run_dir}` renders it"
    )


def _exited(e: SystemExit, run_dir: str | Path | None, run: str | None = None) -> int:
    """sys.exit() called in training (the model's code, a callback): the partial run is saved, which Python says
    nowhere (a note shows in a traceback, and SystemExit prints none), and sys.exit(0) exited 0 with nothing on
    the terminal. Prints what Python prints for ``sys.exit("text")``, then where the run is, as after Ctrl-C
    (``run``: its name among compare's runs; ``run_dir`` None: it stopped before its directory was made);
    returns the exit code: the one given, or 1 (the run did not finish) for sys.exit(0) and sys.exit()."""
    code = e.code
    if code is not None and not isinstance(code, int):
        _tell(str(code))  # its text, said once
    how = "sys.exit()" if code is None else f"sys.exit({code})" if isinstance(code, int) else "sys.exit"
    where = _saved(run_dir) if run_dir is not None else " before it began: nothing of it was saved"
    _tell(f"precprof: training{f' of {run}' if run else ''} stopped by {how}{where}")
    return code if isinstance(code, int) and code != 0 else 1


def _models_error(e: Exception) -> bool:
    """Whether ``e``, which stopped training, is the user's own model's (a factory's) error, or under torchrun
    the consequence of another rank's failure (its line names that rank's error, as the run's cause does), its
    traceback written into the run directory (``precprof.training.failure``): said in one line, with where the
    traceback is, where a 40-line traceback of torch's module calls around one line of the user's (or of gloo's
    "Connection closed by peer") buried the partial run's place."""
    failed = getattr(e, "precprof_failure", None)
    return (
        getattr(failed, "blame", None) in ("model", PEER_BLAME)
        and getattr(failed, "traceback", None) is not None
        and getattr(e, "precprof_run_dir", None) is not None
    )


def _tell(text: str) -> None:
    """One message on stderr after a signal; after SIGHUP the terminal may be gone (EIO): the run is saved, and
    its summary says why it stopped."""
    with contextlib.suppress(OSError):
        typer.echo(text, err=True)


@contextlib.contextmanager
def _not_saved() -> Iterator[list[str]]:
    """Collect the RunNotSavedWarnings of what runs inside (what a full disk kept and lost), for the command to
    print as its own error lines instead of Python's warning lines; precprof's other warnings show as the
    command's warning lines (``_own_warning_lines``), others as usual. The warning filters apply as ever."""
    notes: list[str] = []
    with warnings.catch_warnings(), _own_warning_lines():
        shown = warnings.showwarning

        def show(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
            if issubclass(category, RunNotSavedWarning):
                notes.append(str(message).removeprefix("precprof: "))
            else:
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        warnings.simplefilter("always", RunNotSavedWarning)
        yield notes


@contextlib.contextmanager
def _own_warning_lines() -> Iterator[None]:
    """precprof's own warnings (their text begins "precprof: ") printed as the command's own line, "precprof:
    warning: ...", as it prints its notes and errors, inside: Python's format made two lines of each, attributed
    to the command's entry point (``precprof/__main__.py:20: UserWarning`` and its ``run()``), which is no line of
    the user's (tester t4: the stream's writer killed mid-run). Other warnings (torch's, a model's) keep their
    source line, and the warning filters apply as ever (``catch_warnings`` does not restore ``formatwarning``)."""
    before = warnings.formatwarning

    def one_line(message: Any, category: type[Warning], filename: str, lineno: int, line: Any = None) -> str:
        text = str(message)
        if text.startswith("precprof: "):
            return f"precprof: warning: {text.removeprefix('precprof: ')}\n"
        return before(message, category, filename, lineno, line)

    warnings.formatwarning = one_line
    try:
        yield
    finally:
        warnings.formatwarning = before


def _tidy_params(params: list[Any]) -> list[Any]:
    """No value placeholder for a flag (typer >= 0.2x shows ``<bool>`` after ``--overwrite`` and ``--help``)."""
    for param in params:
        if getattr(param, "is_flag", False) and getattr(param, "metavar", "") is None:
            param.metavar = ""
    return params


def _usage_pieces(command: Any, ctx: Any) -> list[str]:
    """The usage line with arguments as ``RUN_DIR`` (``[RUN_DIR]`` when optional), not typer's ``{run_dir}``."""
    pieces = [command.options_metavar] if command.options_metavar else []
    for param in command.get_params(ctx):
        if getattr(param, "param_type_name", "") != "argument":
            pieces.extend(param.get_usage_pieces(ctx))
            continue
        name = param.metavar or (param.name or "").upper()
        name += "..." if param.nargs != 1 else ""
        pieces.append(name if param.required else f"[{name}]")
    return pieces


class _Command(typer.core.TyperCommand):
    def get_params(self, ctx: Any) -> list[Any]:
        return _tidy_params(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return _usage_pieces(self, ctx)


class _Group(typer.core.TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _tidy_params(super().get_params(ctx))


app = typer.Typer(
    name="precprof",
    cls=_Group,
    help="Precision profiler for mixed-precision PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"precprof {__version__}")
        raise typer.Exit()


# the commands' descriptions are help= texts, not docstrings: python -OO strips docstrings
@app.callback(help="Precision profiler for mixed-precision PyTorch training.")
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    del version  # (its eager callback printed it)


@app.command(
    cls=_Command,
    help="Train a model with the profiler attached and write a run directory (tables, summary.json, report).",
)
@O.training_options()
def train(
    precision: Annotated[
        Precision,
        typer.Option("--precision", "-p", metavar="MODE", help=f"{', '.join(p.value for p in Precision)}."),
    ] = Precision.FP32,
    loss_scale: Annotated[
        str,
        typer.Option(
            metavar="MODE",
            help="dynamic, static:N or none (auto: dynamic for fp16 and fp16-pure, none otherwise).",
        ),
    ] = "auto",
    out: Annotated[
        str | None,  # as typed: typer's Path would turn "" into "." (the current directory)
        typer.Option(
            metavar="DIR",
            help="Run directory (default: a new one in runs/, named after the model, the precision and the "
            "time). An existing run there is refused unless --overwrite.",
        ),
    ] = None,
    **options: Any,
) -> None:
    config = training.TrainConfig.from_options(
        {**options, "precision": precision, "loss_scale": loss_scale, "out": out},
        model_args=options["model_arg"],
        command_line=_command_line(),
    )
    config.validate()
    for note in config.unused_options() if training.writes_run_dir() else []:
        typer.echo(f"precprof: note: {note}", err=True)
    not_saved: list[str] = []  # bound even when a signal comes before the block below is entered
    try:
        with _signals.handling(), _not_saved() as not_saved:
            run = training.train  # (PEP 562: loads torch and the training loop)
            _imports_frozen()
            result = run(config)
    except KeyboardInterrupt as e:
        where = getattr(e, "precprof_run_dir", None)
        _tell(f"\n{_stopped(e)}" + (_saved(where) if where else ""))
        for note in not_saved:
            _tell(f"precprof: error: {note}")
        raise typer.Exit(_exit_code(e)) from None
    except SystemExit as e:
        if getattr(e, "precprof_run_dir", None) is None:
            raise
        code = _exited(e, e.precprof_run_dir)  # type: ignore[attr-defined]
        for note in not_saved:
            _tell(f"precprof: error: {note}")
        raise typer.Exit(code) from None
    except UserError as e:
        if (
            getattr(e, "precprof_run_dir", None) is None
            or not training.writes_run_dir()
            or traceback_wanted()
        ):
            raise  # before training (or a rank that writes no run): one line, and nothing of the run to name
        # a mistake met in training (a factory's output that breaks the contract at step 2): its line, then the
        # partial run, which its one line alone left unsaid
        _tell(f"precprof: error: {_one_line(str(e))}")
        _tell(f"precprof: training stopped{_saved(e.precprof_run_dir)}")  # type: ignore[attr-defined]
        for note in not_saved:
            _tell(f"precprof: error: {note}")
        raise typer.Exit(EXIT_USAGE) from None
    except Exception as e:
        if not _models_error(e) or traceback_wanted():
            raise  # precprof's own error, a built-in or Hugging Face model's: its traceback, to report
        failed = e.precprof_failure  # type: ignore[attr-defined]
        _tell(f"precprof: error: {failed.text}; {failed.where()}")
        if training.writes_run_dir():
            _tell(f"precprof: training stopped{_saved(e.precprof_run_dir)}")  # type: ignore[attr-defined]
        else:  # under torchrun, a rank whose model raised: rank 0 saves the run
            _tell(
                "precprof: this rank writes no run directory; rank 0 saves what it recorded to "
                f"{e.precprof_run_dir}"  # type: ignore[attr-defined]
            )
        for note in not_saved:
            _tell(f"precprof: error: {note}")
        raise typer.Exit(EXIT_MODEL_ERROR) from None
    if not training.writes_run_dir():
        return  # under torchrun rank 0 wrote the run and prints it
    final = result.summary.get("final", {})
    try:
        typer.echo(
            f"final loss {result.final_loss:.4f}{_loss_reference(result.summary)}; "
            f"skipped steps: {final.get('skipped_steps', 0)}"
        )
        rec = result.summary.get(T.SUMMARY_RECOMMENDATION)
        if rec:
            typer.echo(Recommendation.from_dict(rec).describe())
        html = result.run_dir / "report.html"
        typer.echo(f"run directory: {result.run_dir}" + (f"\nreport: {html}" if html.exists() else ""))
    except BrokenPipeError:  # stdout's reader left (`| head`): a run not saved whole still says so and fails
        _stdout_to_devnull()
    if result.summary.get(T.SUMMARY_STATUS) != T.STATUS_COMPLETE:  # it trained; the disk did not take it all
        for note in not_saved or [
            f"{result.run_dir} was not saved whole: {result.summary.get(T.SUMMARY_INCOMPLETE_REASON)}"
        ]:
            typer.echo(f"precprof: error: {note}", err=True)
        raise typer.Exit(EXIT_NOT_SAVED)


def _loss_reference(summary: dict[str, Any]) -> str:
    """What the final loss reads against: the synthetic chain's floor (the best loss possible), or a text file's
    byte entropy (the loss of a model that ignores context: below it, the model learned from context)."""
    floor = (summary.get(T.SUMMARY_FINAL) or {}).get("loss_floor_nats")
    if isinstance(floor, float):
        return f" (the data's floor: {floor:.4f})"
    entropy = ((summary.get(T.SUMMARY_CONFIG) or {}).get("data") or {}).get("unigram_entropy_nats")
    if isinstance(entropy, float):
        return f" (the file's byte entropy, the loss without context: {entropy:.4f})"
    return ""


@app.command(
    cls=_Command,
    help="Versions, device capabilities, TF32 flags, NVML, and the format the usual decision tree picks here.",
)
def env(
    json_output: Annotated[bool, typer.Option("--json", help="Print the capabilities as JSON.")] = False,
) -> None:
    from precprof import stats as st  # imports torch, which no other command but train and compare needs

    info = hardware.detect()
    if json_output:
        import json

        doc = {
            "hardware": info.to_dict(),
            "versions": hardware.software_versions(),
            "stats_engine": st.engine_status(),
        }
        fmt, why = hardware.usual_format(info)
        doc["usual_format"] = {"format": fmt, "reason": why}
        typer.echo(json.dumps(doc, indent=2, default=str))
    else:
        # first: it builds the kernel, and the report's cache line then says the state after the build
        engine = st.engine_status()
        typer.echo(hardware.env_report(info))
        if "error" in engine:
            typer.echo(f"statistics engine: {engine['error']}")
            return
        names = {"c": "C kernel", "torch": "torch ops", "triton": "Triton kernel"}
        cpu = engine["cpu"]
        detail = {
            "c": f" ({engine.get('path')}, threads: {engine.get('threads')})",
            "torch": " (forced)" if engine["requested"] == "torch" else f" (C kernel: {engine['reason']})",
        }.get(cpu, "")
        typer.echo(f"statistics engine (PRECPROF_STATS_ENGINE={engine['requested']}):")
        typer.echo(f"  CPU: {names.get(cpu, cpu)}{detail}")
        cuda = engine["cuda"]
        why = f" ({engine['triton']})" if engine.get("triton") else ""
        typer.echo(f"  CUDA: {names.get(cuda, cuda)}{why}")


@app.command(cls=_Command, help="Render (or re-render) report.html of a run directory.")
def report(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A run directory written by precprof.")],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Output HTML file (default: RUN_DIR/report.html, or RUN_DIR/report-TARGET.html with --target)."
        ),
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            help="Plan for another machine: v100, t4, a100, l4, h100, b200, gb200, or cpu (a CPU without "
            "AVX512-BF16 or AMX; the recording CPU's own features are read without --target)."
        ),
    ] = None,
) -> None:
    if not T.is_run_dir(run_dir):
        raise UserError(T.not_a_run_dir(run_dir))
    if target is not None and target.lower().strip() not in hardware.PRESET_NAMES:
        raise UserError(
            f"--target {target!r}: unknown machine; known targets: {', '.join(hardware.PRESET_NAMES)}"
        )
    summary = T.read_summary(run_dir)
    newer = rundir.newer_version_note(run_dir, summary) or rundir.older_advice_note(run_dir, summary)
    try:
        path = pipeline.rerender(run_dir, out=out, target=target)
    except OSError as e:
        dest = out if out is not None else run_dir / "report.html"
        raise UserError(f"cannot write {dest}: {e.strerror or e}; choose another --out") from None
    missing = T.missing_summary(run_dir)
    for note in (
        newer,
        f"{run_dir} has no {T.SUMMARY_FILE}: {missing}" if missing else None,
        rundir.live_note(run_dir),  # live: still, after rendering
    ):
        if note:
            typer.echo(f"precprof: note: {note}", err=True)
    typer.echo(str(path))


@app.command(
    cls=_Command,
    help="Train the same model, data and seed once per precision and compare the runs (compare.html); or compare run directories already recorded.",
)
@O.training_options(steps=200)
def compare(
    runs: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="RUN_DIR",
            help="Run directories already recorded (your own loop, the HF or Lightning callback, precprof "
            "train) to compare instead of training: nothing trains, and the training options are not used "
            "(--overwrite replaces a comparison already in --out).",
            show_default=False,
        ),
    ] = None,
    precisions: Annotated[
        str,
        typer.Option(
            "--precisions",
            "-p",
            metavar="LIST",
            help="Comma-separated precision modes, each optionally with a loss scaling spec, e.g. "
            "fp32,bf16,fp16 or fp16:none, fp16:static:8192 and fp16:advised. The reference is fp32 when "
            "listed.",
        ),
    ] = "fp32,bf16,fp16",
    out: Annotated[
        str | None,  # as typed (see train's --out)
        typer.Option(
            metavar="DIR",
            help="Folder for the runs and compare.html (default: a new one in runs/, named after the model "
            "and the time; comparing RUN_DIRs: the folder holding them).",
        ),
    ] = None,
    tolerance: Annotated[
        float, typer.Option(help="Relative final-loss gap within which a run matches the reference.")
    ] = 0.02,
    **options: Any,
) -> None:
    if not 0 < tolerance < 1:
        raise UserError(f"--tolerance must be in (0, 1), got {tolerance}")
    if runs:
        try:
            recorded, page = comparing.compare_runs(
                runs, out=out, tolerance=tolerance, overwrite=bool(options["overwrite"])
            )
        except OSError as e:
            raise UserError(
                f"the comparison could not be written ({e.strerror or e}); choose another --out"
            ) from None
        _print_comparison(recorded, page)
        return
    variants = comparing.parse_precisions(precisions)
    # each run's own directory is out/<label>; compare's --out is the folder that holds them
    config = training.TrainConfig.from_options(
        options, model_args=options["model_arg"], command_line=_command_line()
    )
    not_saved: list[str] = []
    try:
        with _signals.handling(), _not_saved() as not_saved:
            training.train  # noqa: B018 (PEP 562: loads torch and the training loop, as each run will)
            _imports_frozen()
            result = comparing.compare(config, variants, out=out, tolerance=tolerance)
    except OSError as e:  # compare.json or compare.html (a full disk): the runs themselves are saved
        for note in not_saved:
            typer.echo(f"precprof: error: {note}", err=True)
        where = f" in {out}" if out is not None else ""
        typer.echo(
            f"precprof: error: the comparison could not be written{where} ([Errno {e.errno}] "
            f"{os.strerror(e.errno) if e.errno else e}); the runs are saved beside it",
            err=True,
        )
        raise typer.Exit(EXIT_NOT_SAVED) from None
    except SystemExit as e:
        if not hasattr(e, "precprof_not_run"):  # not from a run's training (comparing.compare says it)
            raise
        _compare_exited(e)
    except KeyboardInterrupt as e:
        html = getattr(e, "precprof_compare_html", None)
        finished = getattr(e, "precprof_comparison", None)
        if (
            finished is not None
        ):  # the page's check lines, as a whole comparison prints them (it printed none)
            with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
                _print_checks(finished)
        done = f": the runs that finished are compared in {html}" if html else ": no run finished to compare"
        _tell(f"\n{_stopped(e)}{done}")
        for note in not_saved:
            _tell(f"precprof: error: {note}")
        raise typer.Exit(_exit_code(e)) from None
    _print_comparison(result, Path(result.runs[0].run_dir).parent / comparing.COMPARE_HTML)
    for note in not_saved:  # a run that trained and could not be saved whole (a full disk)
        typer.echo(f"precprof: error: {note}", err=True)
    if not_saved:
        raise typer.Exit(EXIT_NOT_SAVED)


def _compare_exited(e: SystemExit) -> None:
    """sys.exit() in one of compare's runs: the process ends as asked, after the runs so far, the stopped one
    with them, were compared (``comparing.compare``). It ended with nothing on the terminal, exit code 0 for
    sys.exit() and sys.exit(0), compare.html not written: the check lines, the stopped run as ``precprof
    train`` says it, the page and the runs not trained."""
    finished = getattr(e, "precprof_comparison", None)
    if finished is not None:
        with contextlib.suppress(OSError):
            _print_checks(finished)
    code = _exited(e, getattr(e, "precprof_run_dir", None), getattr(e, "precprof_stopped_run", None))
    html = getattr(e, "precprof_compare_html", None)
    not_run = getattr(e, "precprof_not_run", None) or []
    _tell(
        (f"comparison: {html}" if html else "no run to compare")
        + (f"\nnot run: {', '.join(not_run)}" if not_run else "")
    )
    raise typer.Exit(code) from None


def _print_comparison(comparison: comparing.Comparison, page: Path) -> None:
    """The check lines and notes (``_print_checks``), then where the page is."""
    _print_checks(comparison)
    typer.echo(f"comparison: {page}")


def _print_checks(comparison: comparing.Comparison) -> None:
    """The check lines, then the page's notes they do not say (a run stopped early, a missing file, runs set up
    otherwise...): a terminal without a browser learns what the page says matters."""
    for check in comparison.checks:
        typer.echo(f"[{check.status}] {check.text}")
    for note in comparison.terminal_notes():
        typer.echo(f"note: {note}")


@app.command(
    cls=_Command,
    help="Write a run's loss, loss scale, skipped steps, exponent histograms and underflow/overflow shares to TensorBoard and/or wandb.",
)
def export(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A run directory written by precprof.")],
    tensorboard: Annotated[
        Path | None,
        typer.Option(metavar="DIR", help="TensorBoard log directory to write the run's events to."),
    ] = None,
    wandb_project: Annotated[
        str | None, typer.Option(metavar="NAME", help="Log the run to a new wandb run in this project.")
    ] = None,
    wandb_mode: Annotated[
        str | None, typer.Option(metavar="MODE", help="wandb mode: online or offline (default: wandb's).")
    ] = None,
    layers: Annotated[
        str,
        typer.Option(
            metavar="WHICH",
            help="Per-layer tags: auto (at most 32 layers), all, none, or comma-separated name patterns.",
        ),
    ] = "auto",
) -> None:
    which: Any = layers if layers in ("auto", "all", "none") else [p.strip() for p in layers.split(",")]
    n = exporting.export_run(
        run_dir, tensorboard=tensorboard, wandb_project=wandb_project, wandb_mode=wandb_mode, layers=which
    )
    where = [f"TensorBoard: {tensorboard}"] if tensorboard is not None else []
    where += [f"wandb project: {wandb_project}"] if wandb_project is not None else []
    typer.echo(f"{n} events written ({'; '.join(where)})")


# click >= 8.2 raises this for `precprof` without arguments; older versions print the help themselves
_NO_ARGS_IS_HELP: type[Exception] = getattr(_cx, "NoArgsIsHelpError", type("_Never", (Exception,), {}))


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _arrow_memory_pool() -> None:
    """This process is precprof's own: Arrow allocates from the C library's allocator unless the environment
    chose a pool (``ARROW_DEFAULT_MEMORY_POOL``). Reading a run of a thousand sampled steps (gigabytes of
    columns) spent 5.9 s of system time in page faults with Arrow's default mimalloc pool, 1.9 s with the
    system's (gpt2-medium x 1,000: the tables read in 1.3 s instead of 3.3 s on 2 cores)."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL"):
        return
    try:
        import pyarrow as pa

        pa.set_memory_pool(pa.system_memory_pool())
    except Exception:  # an Arrow without it: its default pool
        pass


def _imports_frozen() -> None:
    """This process is precprof's own: the objects of what it has imported so far (torch's alone some 300,000)
    are moved out of the garbage collector's reach, where each full collection read them all again (a tenth of a
    large report's rendering; pauses inside training steps). They live as long as the process anyway; what the
    run makes is collected as before, and so is the user's model file, imported later. They are given back at
    exit only where Triton is loaded: its bindings (nanobind) print each of their objects still alive as the
    interpreter ends as leaked; elsewhere the exit would read them all again (1 s of a short run). Only when
    ``main`` is the process's entry point (no ``argv`` given): a Python that calls ``main([...])`` itself (a
    test's, a user's) keeps its collector as it was, where each call would have frozen its garbage too."""
    if not _entry_point:
        return
    gc.freeze()
    if "triton" in sys.modules and not _unfrozen_at_exit:
        _unfrozen_at_exit.append(atexit.register(gc.unfreeze))


_unfrozen_at_exit: list[object] = []  # (registered once a process)
_entry_point: list[bool] = []  # [True] while ``main`` runs as the process's entry point (``argv`` not given)


def _quiet_torch() -> None:
    """This process is precprof's own, and torch is not loaded yet (``precprof.__main__``): its C++ side's
    messages about precprof's own measuring stay off the terminal, unless the environment asks for them.
    Kineto, which the loop's torch.profiler reads the CPU allocator's events through, prints two lines per
    sampled step (``USDT ... profiler_start``, ``profiler_stop``); c10 warns on the first sampled step that a
    block allocated before the profiler started was freed (``CPUAllocator.cpp:245``), which the peak's replay
    already accounts for. ``TORCH_CPP_LOG_LEVEL=WARNING`` brings torch's C++ warnings back."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


class _PipeClosed(Exception):
    """stdout's reader went away: not an OSError, which click would turn into a silent exit 1."""


def _quiet_on_closed_pipe(invoke: Any) -> Any:
    """``invoke`` raising _PipeClosed where a write to a closed pipe raised BrokenPipeError (`precprof train ...
    | true` exited 1 with no message, though its run was saved whole); stdout then points at os.devnull, so that
    Python's flush at exit raises nothing more."""

    def run(ctx: Any) -> Any:
        try:
            return invoke(ctx)
        except BrokenPipeError:
            _stdout_to_devnull()
            raise _PipeClosed from None

    return run


def _stdout_to_devnull() -> None:
    """Point stdout at os.devnull once its reader has gone, so that later writes and Python's flush at exit raise
    nothing more."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``precprof`` console script and ``python -m precprof``."""
    _arrow_memory_pool()
    _quiet_torch()
    _entry_point[:] = [True] if argv is None else []
    _imports_frozen()
    command = typer.main.get_command(app)
    args = list(sys.argv[1:] if argv is None else argv)
    _argv[:] = args
    command.invoke = _quiet_on_closed_pipe(command.invoke)  # type: ignore[method-assign]
    try:
        rc: Any = command.main(args=args, prog_name="precprof", standalone_mode=False)
    except _PipeClosed:
        rc = 0  # the reader left (`precprof train ... | head`): the command's work is done, nothing to say
    except _NO_ARGS_IS_HELP as e:
        # `precprof` alone: the help text, as a request for help rather than a mistake
        ctx = getattr(e, "ctx", None)
        typer.echo(ctx.get_help() if ctx is not None else str(e))
        rc = 0
    except _cx.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "precprof"
        msg = _one_line(e.format_message()).replace("Value error, ", "")
        typer.echo(f"{where}: error: {msg} (see {where} --help)", err=True)
        rc = EXIT_USAGE
    except _cx.ClickException as e:
        typer.echo(f"precprof: error: {_one_line(e.format_message())}", err=True)
        rc = e.exit_code
    except UserError as e:
        # PRECPROF_TRACEBACK=1: where it was raised, the model's exception among its causes, then the line
        shown = traceback_wanted()
        if shown:
            traceback.print_exception(e)
        hint = f"; {TRACEBACK_ENV}=1 prints its traceback" if isinstance(e, ModelError) and not shown else ""
        typer.echo(f"precprof: error: {_one_line(str(e))}{hint}", err=True)
        rc = EXIT_USAGE
    except typer.Abort:
        # click turns Ctrl-C outside a command's own handler into Abort
        typer.echo("precprof: interrupted", err=True)
        rc = EXIT_INTERRUPTED
    except KeyboardInterrupt:
        typer.echo("precprof: interrupted", err=True)
        rc = EXIT_INTERRUPTED
    sys.exit(rc if isinstance(rc, int) else 0)

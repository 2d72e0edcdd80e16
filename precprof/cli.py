"""The ``precprof`` command: wiring only. The work happens in precprof.training, precprof.hardware and
precprof.report.

Every user mistake (UserError, or a usage error of the command line) is printed as one line on stderr and
exits with code 2; Ctrl-C exits with 130 and SIGTERM with 143, after the training loop has saved the partial
run.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

try:  # typer >= 0.2x carries its own copy of click; older versions use click itself
    from typer._click import exceptions as _cx
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as _cx  # type: ignore[no-redef]

from precprof import _signals
from precprof.errors import UserError
from precprof.modes import Device, OptimizerName, Precision

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM exits with 143


def _exit_code(e: KeyboardInterrupt) -> int:
    interrupted = _signals.as_interrupted(e)
    return interrupted.exit_code if interrupted is not None else EXIT_INTERRUPTED


def _stopped(e: KeyboardInterrupt) -> str:
    interrupted = _signals.as_interrupted(e)
    return interrupted.reason if interrupted is not None else "interrupted"


app = typer.Typer(
    name="precprof",
    help="Precision profiler for mixed-precision PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from precprof import __version__

        typer.echo(f"precprof {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Precision profiler for mixed-precision PyTorch training."""


@app.command()
def train(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            metavar="NAME",
            help="gpt-nano (default), gpt-mini, gpt2-small, gpt2-medium, llama-mini, mlp, cnn-bn, "
            "hf:<model_type>, path/to/file.py:factory or package.module:factory.",
        ),
    ] = "gpt-nano",
    model_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--model-arg",
            "-a",
            metavar="KEY=VALUE",
            help="A setting of the model's config or factory, e.g. n_layer=2 (repeatable).",
        ),
    ] = None,
    precision: Annotated[
        Precision, typer.Option("--precision", "-p", help="Precision mode.")
    ] = Precision.FP32,
    loss_scale: Annotated[
        str,
        typer.Option(
            metavar="MODE",
            help="dynamic, static:N or none (auto: dynamic for fp16 and fp16-pure, none otherwise).",
        ),
    ] = "auto",
    init_scale: Annotated[float, typer.Option(help="Initial loss scale of dynamic scaling.")] = 2.0**16,
    growth_factor: Annotated[float, typer.Option(help="Dynamic scaling: growth factor.")] = 2.0,
    backoff_factor: Annotated[float, typer.Option(help="Dynamic scaling: backoff factor on inf/nan.")] = 0.5,
    growth_interval: Annotated[
        int, typer.Option(help="Dynamic scaling: steps without inf/nan before the scale grows.")
    ] = 2000,
    optimizer: Annotated[OptimizerName, typer.Option(help="Optimizer.")] = OptimizerName.ADAMW,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 3e-3,
    weight_decay: Annotated[float, typer.Option(help="Weight decay.")] = 0.0,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 500,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    grad_clip: Annotated[
        float, typer.Option(help="Max gradient norm (unscaled); 0 disables clipping.")
    ] = 1.0,
    seed: Annotated[int, typer.Option(help="Random seed (weights and data sampling).")] = 0,
    device: Annotated[Device, typer.Option(help="auto: cuda when available.")] = Device.AUTO,
    data: Annotated[
        str, typer.Option(help="synthetic, or the path of a text file (read as bytes).")
    ] = "synthetic",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Run directory (default: runs/<model>-<precision>-<timestamp>). An existing run there is "
            "refused unless --overwrite."
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace the run already in --out (its other files stay).")
    ] = False,
    sample_every: Annotated[
        int | None, typer.Option(help="Profile layers every N steps (default: about 100 sampled steps).")
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show the progress bar.")] = True,
    report: Annotated[bool, typer.Option(help="Write report.html at the end.")] = True,
    distributed: Annotated[
        str,
        typer.Option(
            metavar="STRATEGY",
            help="Under torchrun: ddp (DistributedDataParallel), fsdp2 (fully_shard) or fsdp1; rank 0 writes.",
        ),
    ] = "ddp",
) -> None:
    """Train a model with the profiler attached and write a run directory (tables, summary.json, report)."""
    from precprof import training
    from precprof.models import parse_model_args

    config = training.TrainConfig(
        model=model,
        model_args=parse_model_args(model_arg or []),
        precision=precision.value,
        loss_scale=loss_scale,
        init_scale=init_scale,
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        optimizer=optimizer.value,
        lr=lr,
        weight_decay=weight_decay,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        grad_clip=grad_clip,
        seed=seed,
        device=device.value,
        data=data,
        out=out,
        sample_every=sample_every,
        progress=progress,
        report=report,
        command_line=shlex.join(["precprof", *sys.argv[1:]]),
        distributed=distributed,
        overwrite=overwrite,
    )
    config.validate()
    try:
        with _signals.handling():
            result = training.train(config)
    except KeyboardInterrupt as e:
        where = getattr(e, "precprof_run_dir", None)
        typer.echo(f"\n{_stopped(e)}" + (f": the partial run is in {where}" if where else ""), err=True)
        raise typer.Exit(_exit_code(e)) from None
    if os.environ.get("RANK", "0") not in ("", "0"):
        return  # under torchrun rank 0 wrote the run and prints it
    final = result.summary.get("final", {})
    floor = final.get("loss_floor_nats")
    floor_txt = f" (the data's floor: {floor:.4f})" if isinstance(floor, float) else ""
    typer.echo(
        f"final loss {result.final_loss:.4f}{floor_txt}; skipped steps: {final.get('skipped_steps', 0)}"
    )
    from precprof import tables

    rec = result.summary.get(tables.SUMMARY_RECOMMENDATION)
    if rec:
        from precprof.advisor import Recommendation

        typer.echo(Recommendation.from_dict(rec).describe())
    html = result.run_dir / "report.html"
    typer.echo(f"run directory: {result.run_dir}" + (f"\nreport: {html}" if html.exists() else ""))


@app.command()
def env(
    json_output: Annotated[bool, typer.Option("--json", help="Print the capabilities as JSON.")] = False,
) -> None:
    """Versions, device capabilities, TF32 flags, NVML, and the format the usual decision tree picks here."""
    from precprof import hardware

    info = hardware.detect()
    if json_output:
        import json

        doc = {"hardware": info.to_dict(), "versions": hardware.software_versions()}
        fmt, why = hardware.usual_format(info)
        doc["usual_format"] = {"format": fmt, "reason": why}
        typer.echo(json.dumps(doc, indent=2, default=str))
    else:
        typer.echo(hardware.env_report(info))


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by precprof.")],
    out: Annotated[Path | None, typer.Option(help="Output HTML file (default: RUN_DIR/report.html).")] = None,
    target: Annotated[
        str | None,
        typer.Option(help="Plan for another machine: v100, t4, a100, l4, h100 or cpu."),
    ] = None,
) -> None:
    """Render (or re-render) report.html of a run directory."""
    from precprof import tables

    if not tables.is_run_dir(run_dir):
        raise UserError(f"{str(run_dir)!r} is not a precprof run directory (no summary.json or tables in it)")
    if target is not None:
        from precprof.hardware import PRESET_NAMES

        if target.lower().strip() not in PRESET_NAMES:
            raise UserError(f"--target {target!r}: unknown machine; known targets: {', '.join(PRESET_NAMES)}")
    try:
        from precprof.report.render import render_run_dir
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("precprof"):
            raise UserError(
                "this precprof installation has no report renderer (precprof.report.render)"
            ) from None
        raise
    try:
        path = render_run_dir(run_dir, out=out, target=target)
    except OSError as e:
        dest = out if out is not None else run_dir / "report.html"
        raise UserError(f"cannot write {dest}: {e.strerror or e}; choose another --out") from None
    typer.echo(str(path))


@app.command()
def compare(
    model: Annotated[
        str,
        typer.Option(
            "--model", "-m", metavar="NAME", help="Any model `precprof train` takes (default gpt-nano)."
        ),
    ] = "gpt-nano",
    model_arg: Annotated[
        list[str] | None,
        typer.Option("--model-arg", "-a", metavar="KEY=VALUE", help="A setting of the model (repeatable)."),
    ] = None,
    precisions: Annotated[
        str,
        typer.Option(
            "--precisions",
            "-p",
            metavar="LIST",
            help="Comma-separated precision modes, each optionally with a loss scaling spec: "
            "fp32,bf16,fp16,fp16:none,fp16:static:8192. The reference is fp32 when listed.",
        ),
    ] = "fp32,bf16,fp16",
    steps: Annotated[int, typer.Option(help="Optimizer steps of each run.")] = 200,
    batch_size: Annotated[int, typer.Option(help="Sequences per step.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 64,
    optimizer: Annotated[OptimizerName, typer.Option(help="Optimizer.")] = OptimizerName.ADAMW,
    lr: Annotated[float, typer.Option(help="Learning rate.")] = 3e-3,
    weight_decay: Annotated[float, typer.Option(help="Weight decay.")] = 0.0,
    grad_clip: Annotated[
        float, typer.Option(help="Max gradient norm (unscaled); 0 disables clipping.")
    ] = 1.0,
    init_scale: Annotated[float, typer.Option(help="Initial loss scale of dynamic scaling.")] = 2.0**16,
    growth_interval: Annotated[
        int, typer.Option(help="Dynamic scaling: steps without inf/nan before the scale grows.")
    ] = 2000,
    seed: Annotated[int, typer.Option(help="Random seed: the same weights and data for every run.")] = 0,
    device: Annotated[Device, typer.Option(help="auto: cuda when available.")] = Device.AUTO,
    data: Annotated[
        str, typer.Option(help="synthetic, or the path of a text file (read as bytes).")
    ] = "synthetic",
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for the runs and compare.html (default: runs/compare-<model>-<timestamp>)."
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace runs already in --out (their other files stay).")
    ] = False,
    sample_every: Annotated[
        int | None, typer.Option(help="Profile layers every N steps (default: 10 sampled steps per run).")
    ] = None,
    tolerance: Annotated[
        float, typer.Option(help="Relative final-loss gap within which a run matches the reference.")
    ] = 0.02,
    progress: Annotated[bool, typer.Option(help="Show the progress bars.")] = True,
    report: Annotated[bool, typer.Option(help="Write each run's report.html.")] = True,
) -> None:
    """Train the same model, data and seed once per precision and compare the runs (compare.html)."""
    from precprof import compare as comparing
    from precprof import training
    from precprof.models import parse_model_args

    variants = comparing.parse_precisions(precisions)
    if not 0 < tolerance < 1:
        raise UserError(f"--tolerance must be in (0, 1), got {tolerance}")
    config = training.TrainConfig(
        model=model,
        model_args=parse_model_args(model_arg or []),
        init_scale=init_scale,
        growth_interval=growth_interval,
        optimizer=optimizer.value,
        lr=lr,
        weight_decay=weight_decay,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        grad_clip=grad_clip,
        seed=seed,
        device=device.value,
        data=data,
        sample_every=sample_every,
        progress=progress,
        report=report,
        command_line=shlex.join(["precprof", *sys.argv[1:]]),
        overwrite=overwrite,
    )
    try:
        with _signals.handling():
            result = comparing.compare(config, variants, out=out, tolerance=tolerance)
    except KeyboardInterrupt as e:
        html = getattr(e, "precprof_compare_html", None)
        done = f": the runs that finished are compared in {html}" if html else ": no run finished to compare"
        typer.echo(f"\n{_stopped(e)}{done}", err=True)
        raise typer.Exit(_exit_code(e)) from None
    for check in result.checks:
        typer.echo(f"[{check.status}] {check.text}")
    typer.echo(f"comparison: {Path(result.runs[0].run_dir).parent / comparing.COMPARE_HTML}")


# click >= 8.2 raises this for `precprof` without arguments; older versions print the help themselves
_NO_ARGS_IS_HELP: type[Exception] = getattr(_cx, "NoArgsIsHelpError", type("_Never", (Exception,), {}))


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``precprof`` console script and ``python -m precprof``."""
    command = typer.main.get_command(app)
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rc: Any = command.main(args=args, prog_name="precprof", standalone_mode=False)
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
        typer.echo(f"precprof: error: {_one_line(str(e))}", err=True)
        rc = EXIT_USAGE
    except typer.Abort:
        # click turns Ctrl-C outside a command's own handler into Abort
        typer.echo("precprof: interrupted", err=True)
        rc = EXIT_INTERRUPTED
    except KeyboardInterrupt:
        typer.echo("precprof: interrupted", err=True)
        rc = EXIT_INTERRUPTED
    sys.exit(rc if isinstance(rc, int) else 0)

"""The training options that ``precprof train`` and ``precprof compare`` share, written once.

``@training_options()`` adds them, with ``TrainConfig``'s defaults, to a command's signature (typer reads
``__signature__``); the command receives them as ``**options`` and hands them to ``TrainConfig.from_options``,
so a training option cannot exist in one command and be dropped by the other (a test checks both).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from precprof.modes import Device, OptimizerName
from precprof.training import TrainConfig

Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        metavar="NAME",
        help="gpt-nano (default), gpt-mini, gpt2-small, gpt2-medium, llama-mini, mlp, cnn-bn, "
        "hf:<model_type>, or a factory of your own: path/to/FILE.py:FACTORY or MODULE:FACTORY, called with "
        "the -a values (and vocab_size, seq_len when it takes them) and returning an nn.Module whose forward(x) "
        "gets int64 token ids (batch, seq-len) and returns logits (batch, seq-len, vocab) or a scalar loss "
        "(forward(x, targets=y) when it takes targets); README: Your own model.",
    ),
]
ModelArgs = Annotated[
    list[str] | None,
    typer.Option(
        "--model-arg",
        "-a",
        metavar="KEY=VALUE",
        help="A setting of the model's config or factory, e.g. n_layer=2 (repeatable).",
    ),
]
InitScale = Annotated[float, typer.Option(help="Initial loss scale of dynamic scaling.")]
GrowthFactor = Annotated[float, typer.Option(help="Dynamic scaling: growth factor.")]
BackoffFactor = Annotated[float, typer.Option(help="Dynamic scaling: backoff factor on inf/nan.")]
GrowthInterval = Annotated[
    int, typer.Option(help="Dynamic scaling: steps without inf/nan before the scale grows.")
]
Optimizer = Annotated[OptimizerName, typer.Option(help="Optimizer.")]
Lr = Annotated[float, typer.Option(help="Learning rate.")]
WeightDecay = Annotated[float, typer.Option(help="Weight decay.")]
Steps = Annotated[int, typer.Option(help="Optimizer steps (of each run).")]
BatchSize = Annotated[int, typer.Option(help="Sequences per step.")]
SeqLen = Annotated[int, typer.Option(help="Tokens per sequence.")]
GradClip = Annotated[float, typer.Option(help="Max gradient norm (unscaled); 0 disables clipping.")]
Seed = Annotated[int, typer.Option(help="Random seed (weights and data sampling; the same for every run).")]
DeviceOpt = Annotated[
    Device, typer.Option("--device", metavar="DEVICE", help="auto (cuda when available), cpu or cuda.")
]
Data = Annotated[str, typer.Option(help="synthetic, or the path of a text file (read as bytes).")]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace the run(s) already in --out (other files there stay).")
]
SampleEvery = Annotated[
    int | None,
    typer.Option(
        help="Profile layers every N steps; 0 records the steps only (loss, time): no step is sampled, no layer "
        "statistics (default: about 100 sampled steps per run; every second step at least when the model is "
        "compiled, as a sampled step runs it eagerly)."
    ),
]
Progress = Annotated[bool, typer.Option(help="Show the progress bar.")]
Report = Annotated[bool, typer.Option(help="Write report.html for each run.")]
Compile = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="torch.compile the model (default: only for fp8, which torchao makes fast only compiled).",
    ),
]
Distributed = Annotated[
    str,
    typer.Option(
        metavar="STRATEGY",
        help="Under torchrun: ddp (data parallel), fsdp2 (fully_shard) or fsdp1; rank 0 writes.",
    ),
]

# (parameter name, type with its typer option): the shared options in --help order; the parameter name is the
# TrainConfig field it sets (model_arg -> model_args, parsed by from_options)
SHARED: tuple[tuple[str, Any], ...] = (
    ("model", Model),
    ("model_arg", ModelArgs),
    ("init_scale", InitScale),
    ("growth_factor", GrowthFactor),
    ("backoff_factor", BackoffFactor),
    ("growth_interval", GrowthInterval),
    ("optimizer", Optimizer),
    ("lr", Lr),
    ("weight_decay", WeightDecay),
    ("steps", Steps),
    ("batch_size", BatchSize),
    ("seq_len", SeqLen),
    ("grad_clip", GradClip),
    ("seed", Seed),
    ("device", DeviceOpt),
    ("data", Data),
    ("overwrite", Overwrite),
    ("sample_every", SampleEvery),
    ("progress", Progress),
    ("report", Report),
    ("distributed", Distributed),
    ("compile", Compile),
)
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
_DEFAULTS.update(
    model_arg=None, optimizer=OptimizerName(_DEFAULTS["optimizer"]), device=Device(_DEFAULTS["device"])
)

F = TypeVar("F", bound=Callable[..., Any])


def training_options(**defaults: Any) -> Callable[[F], F]:
    """Add the shared training options to a command (``defaults`` overrides TrainConfig's, e.g. steps=200);
    the command takes them as ``**options``."""

    def add(fn: F) -> F:
        sig = inspect.signature(fn, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        shared = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(name, _DEFAULTS[name]),
                annotation=annotation,
            )
            for name, annotation in SHARED
        ]
        fn.__signature__ = sig.replace(parameters=[*own, *shared])  # type: ignore[attr-defined]
        return fn

    return add

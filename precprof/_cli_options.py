"""The training options that ``precprof train`` and ``precprof compare`` share, written once.

Each is an ``Annotated`` type for a typer parameter; both commands hand their parameters to
``TrainConfig.from_options``, so a training option cannot exist in one command and be dropped by the other
(a test checks that both accept the same ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from precprof.modes import Device, OptimizerName

Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        metavar="NAME",
        help="gpt-nano (default), gpt-mini, gpt2-small, gpt2-medium, llama-mini, mlp, cnn-bn, "
        "hf:<model_type>, path/to/file.py:factory or package.module:factory.",
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
DeviceOpt = Annotated[Device, typer.Option("--device", help="auto: cuda when available.")]
Data = Annotated[str, typer.Option(help="synthetic, or the path of a text file (read as bytes).")]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace the run(s) already in --out (other files there stay).")
]
SampleEvery = Annotated[
    int | None, typer.Option(help="Profile layers every N steps (default: about 100 sampled steps per run).")
]
Progress = Annotated[bool, typer.Option(help="Show the progress bar.")]
Report = Annotated[bool, typer.Option(help="Write report.html for each run.")]
Distributed = Annotated[
    str,
    typer.Option(
        metavar="STRATEGY",
        help="Under torchrun: ddp (DistributedDataParallel), fsdp2 (fully_shard) or fsdp1; rank 0 writes.",
    ),
]
OutDir = Path | None

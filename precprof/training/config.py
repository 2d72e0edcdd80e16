"""What a run of the built-in loop is: ``TrainConfig``, its checks, and the defaults derived from it.

``TrainConfig.from_options`` is the one way the command line (``precprof train`` and ``precprof compare``)
turns options into a configuration.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from precprof import rundir
from precprof.errors import UserError
from precprof.modes import (
    DEFAULT_MODEL,
    DEVICES,
    MAX_LOSS_SCALE,
    PRECISIONS,
    STRATEGIES,
    OptimizerName,
    parse_loss_scale,
    parse_model_args,
    resolve_loss_scale,
    valid_loss_scale,
)

# the seeds torch's generators take (``torch.manual_seed``, ``torch.Generator().manual_seed``): any 64-bit integer,
# signed or not, read modulo 2**64 (-1 seeds as 2**64-1); one outside raised "Overflow when unpacking long long"
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

# GradScaler's settings of dynamic loss scaling: a run that scales no loss, or holds a static scale, uses none of
# them (summary.json records them only where they were used)
DYNAMIC_SCALER_OPTIONS: tuple[str, ...] = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")


# the options that count something: an integer (a Python int or a NumPy one), never a float or a string
INTEGER_OPTIONS = (
    "steps",
    "batch_size",
    "seq_len",
    "growth_interval",
    "seed",
    "refresh_every",
    "sample_every",
)


def _is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer (``operator.index`` takes it: int, a NumPy integer; not bool's words)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def writes_run_dir() -> bool:
    """Whether this process writes the run directory: any but a rank other than 0 under torchrun (its ``RANK``,
    read before the process group exists), which trains beside rank 0. Such a rank checking ``--out`` itself
    raced rank 0: started a moment later, it found the run rank 0 had just claimed ("already holds a precprof
    run (incomplete)"), and rank 0 waited for it in a collective until torchrun's timeout."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return world <= 1 or int(os.environ.get("RANK", "0") or 0) == 0


@dataclass
class TrainConfig:
    """Everything ``precprof train`` takes. Defaults train gpt-nano on synthetic data in about a minute on CPU.

    ``loss_scale``: "auto" (dynamic for fp16 and fp16-pure, none otherwise), "dynamic", "static:N" or "none".
    ``grad_clip``: max global L2 norm of the (unscaled) gradients; 0 disables clipping.
    ``sample_every``: profile layers every N steps; None picks N so that about 100 steps are sampled.
    ``out``: run directory; None means ``runs/<model>-<precision>-<timestamp>``.
    ``refresh_every``: steps between progress-bar refreshes (each refresh syncs with the device).
    ``compile``: ``torch.compile`` the model (True), not (False), or as the mode is run for speed (None: fp8
    only, see ``precprof.training.compiling``).
    """

    model: str = DEFAULT_MODEL
    model_args: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"
    loss_scale: str = "auto"
    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.0
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 64
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    data: str = "synthetic"
    out: str | Path | None = None
    sample_every: int | None = None
    progress: bool = True
    refresh_every: int = 10
    report: bool = True
    command_line: str | None = None
    distributed: str = "ddp"  # under torchrun: ddp | fsdp2 | fsdp1 (precprof.training.distributed.wrap_model)
    overwrite: bool = False  # replace the run already in ``out`` (else an existing run is refused)
    # torch.compile the model: True, False, or None for the mode's default (only fp8 compiles:
    # precprof.training.compiling)
    compile: bool | None = None

    def validate(self) -> None:
        """Raise UserError for a value no run can use (checked before anything is built)."""
        if self.precision not in PRECISIONS:
            raise UserError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.optimizer not in {o.value for o in OptimizerName}:
            raise UserError(f"unknown optimizer {self.optimizer!r}; choose adamw or sgd")
        parse_loss_scale(self.loss_scale)
        for name in INTEGER_OPTIONS:  # (steps=2.5 trained, then failed in the loop: range() takes no float)
            value = getattr(self, name)
            if not (value is None and name == "sample_every") and not _is_integer(value):
                raise UserError(f"--{name.replace('_', '-')} must be an integer, got {value!r}")
        checks = [
            (self.steps >= 1, f"--steps must be at least 1, got {self.steps}"),
            (self.batch_size >= 1, f"--batch-size must be at least 1, got {self.batch_size}"),
            (self.seq_len >= 1, f"--seq-len must be at least 1, got {self.seq_len}"),
            (self.lr > 0 and math.isfinite(self.lr), f"--lr must be a positive number, got {self.lr}"),
            (
                0 <= self.weight_decay < math.inf,
                f"--weight-decay must be a finite number >= 0, got {self.weight_decay}",
            ),
            (self.grad_clip >= 0, f"--grad-clip must be >= 0 (0 disables clipping), got {self.grad_clip}"),
            (
                valid_loss_scale(self.init_scale),
                f"--init-scale must be a positive number at most {MAX_LOSS_SCALE:.1e} (the scaler holds it in "
                f"fp32), got {self.init_scale}; e.g. 65536",
            ),
            (
                1 < self.growth_factor < math.inf,
                f"--growth-factor must be a finite number > 1, got {self.growth_factor}",
            ),
            (0 < self.backoff_factor < 1, f"--backoff-factor must be in (0, 1), got {self.backoff_factor}"),
            (self.growth_interval >= 1, f"--growth-interval must be at least 1, got {self.growth_interval}"),
            (
                SEED_MIN <= self.seed <= SEED_MAX,
                f"--seed must be an integer in [-2**63, 2**64-1] (torch's 64-bit seeds), got {self.seed}",
            ),
            (self.refresh_every >= 1, f"refresh_every must be at least 1, got {self.refresh_every}"),
            (
                self.sample_every is None or self.sample_every >= 0,
                f"--sample-every must be >= 0 (0 records steps only), got {self.sample_every}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)
        if self.distributed not in STRATEGIES:
            raise UserError(
                f"unknown --distributed {self.distributed!r}; choose one of {', '.join(STRATEGIES)}"
            )
        if not (self.device in DEVICES or self.device.startswith("cuda:")):
            raise UserError(f"unknown device {self.device!r}; choose auto, cpu or cuda")
        if self.out is not None and writes_run_dir():
            rundir.check_target(self.out, overwrite=self.overwrite)

    def unused_options(self) -> list[str]:
        """One line for each kind of option given that this run will not use (``precprof train`` prints them):
        dynamic loss scaling's settings in a run without it, and ``--distributed`` outside torchrun, where the
        run is one plain process."""
        notes = []
        kind, _ = resolve_loss_scale(self.loss_scale, self.precision)
        default = TrainConfig()
        given = [
            f"--{k.replace('_', '-')} {getattr(self, k):g}"
            for k in DYNAMIC_SCALER_OPTIONS
            if getattr(self, k) != getattr(default, k)
        ]
        if given and kind != "dynamic":
            why = (
                f"-p {self.precision} scales no loss; --loss-scale dynamic would"
                if kind == "none"
                else f"--loss-scale {self.loss_scale} holds the scale fixed"
            )
            notes.append(
                f"{', '.join(given)} {'sets' if len(given) == 1 else 'set'} dynamic loss scaling, which this run "
                f"does not use ({why}): ignored, and not recorded in summary.json"
            )
        if self.distributed != default.distributed and int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
            notes.append(
                f"--distributed {self.distributed} applies under torchrun (torchrun --nproc_per_node N -m precprof "
                "train ...); this is one process, trained without it"
            )
        return notes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out) if self.out is not None else None
        return d

    @classmethod
    def from_options(cls, options: Mapping[str, Any], **overrides: Any) -> TrainConfig:
        """A configuration from command-line options: every key that names a field is taken (enum values
        unwrapped, ``model_args`` parsed from KEY=VALUE strings), the rest ignored; ``overrides`` win."""
        names = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in {**options, **overrides}.items():
            if key not in names:
                continue
            if isinstance(value, Enum):
                value = value.value
            if key == "model_args" and not isinstance(value, dict):
                value = parse_model_args(list(value or []))
            values[key] = value
        return cls(**values)


def data_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s data under torchrun, ``seed + rank``, kept in torch's range as torch reads it
    (modulo 2**64): --seed 2**64-1 seeds rank 1 with 0, which its generator overflowed at."""
    s = seed + rank
    return s - 2**64 if s > SEED_MAX else s


def default_sample_every(steps: int, compiled: bool = False) -> int:
    """Sampling interval that records about 100 steps of layer statistics; every second step at least where the
    model is compiled: a sampled step runs it eagerly (for the hooks), and a run of fewer than 150 steps sampled
    each one, so it never ran compiled (fp8, compiled by default, was timed eager)."""
    return max(2 if compiled else 1, round(steps / 100))


def default_out_dir(config: TrainConfig, root: str | Path = "runs") -> Path:
    """``runs/<model>-<precision>-<YYYYmmdd-HHMMSS>`` (with -2, -3... if that directory exists); a factory
    ``path/to/my_model.py:build`` or ``package.my_model:build`` is named ``my_model-build`` (``my_model``
    alone when the factory is named like its file)."""
    name = config.model
    if ":" in name and not name.startswith("hf:"):
        target, _, factory = name.rpartition(":")
        if target.endswith(".py") or "/" in target or "\\" in target:
            stem = target.replace("\\", "/").rsplit("/", 1)[-1].removesuffix(".py")
        else:
            stem = target.rsplit(".", 1)[-1]  # package.module: the module
        name = stem if factory in ("", stem) else f"{stem}-{factory}"
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.") or "model"
    base = Path(root) / f"{name}-{config.precision}-{time.strftime('%Y%m%d-%H%M%S')}"
    out, i = base, 2
    while out.exists():
        out, i = base.with_name(f"{base.name}-{i}"), i + 1
    return out

"""``precprof export RUN_DIR``: a finished (or crashed) run directory's tables into TensorBoard and/or wandb."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from precprof import tables as T
from precprof.errors import UserError
from precprof.export.events import LayerSelection, table_events
from precprof.export.tensorboard import TensorBoardSink
from precprof.export.wandb import WandbSink, wandb_module


def export_run(
    run_dir: str | Path,
    *,
    tensorboard: Any = None,
    wandb_project: str | None = None,
    wandb_mode: str | None = None,
    wandb_dir: str | Path | None = None,
    layers: LayerSelection = "auto",
) -> int:
    """Write the run's events to a TensorBoard log directory (or SummaryWriter) and/or a new wandb run in
    ``wandb_project`` (named after the run directory; ``wandb_mode`` "online" or "offline"). Returns how many
    events were written to each sink.

    The wandb run is finished before this returns, but wandb's service writes the end of an offline run's
    ``.wandb`` file when it closes the run, a moment later: a reader in the same process waits for
    ``wandb.teardown()`` (the process's exit does it for ``precprof export``)."""
    run_dir = Path(run_dir)
    if not T.is_run_dir(run_dir):
        raise UserError(T.not_a_run_dir(run_dir))
    if tensorboard is None and wandb_project is None:
        raise UserError("precprof export needs a destination: --tensorboard DIR and/or --wandb-project NAME")
    if wandb_mode is not None and wandb_mode not in ("online", "offline"):
        raise UserError(f"--wandb-mode {wandb_mode!r}: expected online or offline")
    sinks: list[Any] = []
    if isinstance(tensorboard, (str, Path)) and any(Path(tensorboard).glob("events.out.tfevents.*")):
        # TensorBoard reads every event file of a folder: a second export, or one into the live run's folder,
        # would draw every series twice
        raise UserError(
            f"--tensorboard {tensorboard}: the folder already holds TensorBoard event files, and TensorBoard "
            "would show every series twice; export into an empty or new folder"
        )
    if tensorboard is not None:
        sinks.append(TensorBoardSink(tensorboard, option="--tensorboard"))
    if wandb_project is not None:
        wandb = wandb_module("--wandb-project")
        summary = T.read_summary(run_dir)
        run = wandb.init(
            project=wandb_project,
            name=run_dir.resolve().name,
            mode=wandb_mode,
            dir=str(wandb_dir) if wandb_dir is not None else None,
            config=summary.get(T.SUMMARY_CONFIG) or {},
        )
        sinks.append(WandbSink(run, option="--wandb-project", finish=True))
    events = table_events(T.read_tables(run_dir), layers)
    for sink in sinks:
        try:
            sink.write(events)
        finally:
            sink.close()
    return len(events)

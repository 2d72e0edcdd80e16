"""A Lightning fit stopped between a batch's optimizer step and PrecprofCallback's on_train_batch_end (a callback
listed before it raising KeyboardInterrupt there, Ctrl-C), or by sys.exit() in training_step: which steps the
run keeps, and where the user is told it was saved (tester h90)."""

from __future__ import annotations

import math
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

L = pytest.importorskip("lightning")

from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from precprof import tables as T  # noqa: E402
from precprof.integrations.lightning import PrecprofCallback  # noqa: E402

VOCAB, SEQ, BATCH, HID = 32, 8, 4, 16


class TinyLM(L.LightningModule):
    """Embedding -> Linear -> GELU -> Linear over tokens; remembers the losses training_step returned."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Embedding(VOCAB, HID), nn.Linear(HID, 2 * HID), nn.GELU(), nn.Linear(2 * HID, VOCAB)
        )
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).reshape(-1, VOCAB).float(), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class ManualExitLM(TinyLM):
    """Manual optimization that calls sys.exit(3) at batch 2 after its optimizer stepped."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        if batch_idx == 2:
            sys.exit(3)
        return loss


class InterruptAt(L.Callback):  # type: ignore[misc]
    """Raises KeyboardInterrupt in on_train_batch_end once ``trainer.global_step`` is ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            raise KeyboardInterrupt


def loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (32, SEQ), generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=BATCH
    )


@pytest.fixture(autouse=True)
def _sigint_as_it_was() -> Iterator[None]:
    """Lightning ignores SIGINT from its KeyboardInterrupt's shutdown on (a second Ctrl-C): not the suite's."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


def fit(tmp_path: Path, module: TinyLM, *before: Any, **kw: Any) -> tuple[Path, Any]:
    """Fit ``module`` with ``before`` callbacks ahead of a PrecprofCallback; the run directory and the
    SystemExit the fit ended with."""
    run = tmp_path / "run"
    cb = PrecprofCallback(out=run, sample_every=1, report=False, memory=False)
    trainer = L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        callbacks=[*before, cb],
        max_steps=6,
        **kw,
    )
    with pytest.raises(SystemExit) as stopped:
        trainer.fit(module, loader())
    assert T.read_summary(run)[T.SUMMARY_STATUS] == T.STATUS_INCOMPLETE
    return run, stopped.value


def test_a_keyboard_interrupt_after_the_optimizer_step_keeps_that_step_and_says_where_the_run_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The interrupt comes when step 1 (batches 2 and 3) has stepped AdamW: step 1 is finished, its loss the
    mean of the two batches' (the second never reached precprof's on_train_batch_end), where it was cut off with
    no loss. Lightning exits with sys.exit(1) and shows no note on the KeyboardInterrupt: the run's place is
    said on stderr."""
    module = TinyLM()
    run, stopped = fit(tmp_path, module, InterruptAt(2), accumulate_grad_batches=2)
    assert stopped.code == 1
    steps = T.read_tables(run)["steps"]
    assert steps[T.STEP].tolist() == [0, 1] and not T.flags(steps[T.CUT_OFF]).any()
    pairs = [(module.losses[2 * i] + module.losses[2 * i + 1]) / 2 for i in range(2)]
    assert steps[T.LOSS].tolist() == pytest.approx(pairs, rel=1e-6)
    assert (steps[T.TOKENS] == 2 * BATCH * SEQ).all()
    assert T.read_summary(run)[T.SUMMARY_INCOMPLETE_REASON] == "interrupted (KeyboardInterrupt)"
    assert f"precprof: the partial run was saved to {run}\n" in capsys.readouterr().err


def test_under_a_grad_scaler_that_steps_loss_is_not_known(tmp_path: Path) -> None:
    """The loss Lightning's on_before_backward hands over is scaled by the GradScaler: the finished step keeps
    no loss rather than the scaled one."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    module = TinyLM()
    run, _ = fit(tmp_path, module, InterruptAt(2), plugins=[plugin])
    steps = T.read_tables(run)["steps"]
    assert steps[T.STEP].tolist() == [0, 1] and not T.flags(steps[T.CUT_OFF]).any()
    assert steps[T.LOSS][0] == pytest.approx(module.losses[0], rel=1e-6) and math.isnan(steps[T.LOSS][1])
    assert (steps[T.TOKENS] == BATCH * SEQ).all()


def test_sys_exit_in_a_manual_training_step_after_its_optimizer_stepped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """training_step did not return: the batch is cut off, though its optimizer stepped (global_step moved).
    Python prints no traceback for a SystemExit: the run's place is said on stderr."""
    run, stopped = fit(tmp_path, ManualExitLM())
    assert stopped.code == 3
    steps = T.read_tables(run)["steps"]
    assert steps[T.STEP].tolist() == [0, 1, 2] and T.flags(steps[T.CUT_OFF]).tolist() == [False, False, True]
    assert T.read_summary(run)[T.SUMMARY_INCOMPLETE_REASON] == "SystemExit: 3"
    assert f"precprof: the partial run was saved to {run}\n" in capsys.readouterr().err

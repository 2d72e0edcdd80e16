"""precprof for Lightning: a ``lightning.pytorch.Callback``.

::

    from precprof.integrations.lightning import PrecprofCallback

    trainer = L.Trainer(precision="bf16-mixed", callbacks=[PrecprofCallback(out="runs/pl")])
    trainer.fit(module, loader)              # runs/pl/report.html at the end of fit

What the callback does:

- ``on_train_start``: attaches a ``precprof.Profiler`` to the LightningModule, its optimizers and the
  precision plugin's GradScaler (``16-mixed`` on a GPU), starting at ``trainer.global_step``;
- ``on_train_batch_end``: keeps the loss ``training_step`` returned (a device tensor: no sync; Lightning hands it
  over divided by ``accumulate_grad_batches``, which is undone) and the tokens fed to the model (see below); when ``trainer.global_step`` has moved (an optimizer step happened, after gradient accumulation),
  ``Profiler.step(mean loss of the micro-batches, tokens)``. A batch that automatic optimization skipped
  (``training_step`` returned None) adds neither a loss nor tokens: the mean is over the micro-batches that
  returned a loss. Optimizers set on the trainer during the fit (a callback switching to SGD at an epoch) are
  followed from the batch that steps them on (``Profiler.use_optimizer``), the change said in the summary;
- ``on_train_end``: writes the run directory and report.html; ``on_exception``: the same, marked incomplete with
  the exception (Lightning calls it before re-raising). A batch whose optimizer step ran before the exception
  (a KeyboardInterrupt in a callback's ``on_train_batch_end`` listed before this one, or a Ctrl-C there) is a
  finished step, its loss the one ``on_before_backward`` saw (not known under a GradScaler, which hands it over
  scaled, or in manual optimization). Where the run was saved is a note on the exception, or, after a
  KeyboardInterrupt (Lightning exits with ``sys.exit(1)``) or a ``SystemExit`` (whose traceback Python never
  shows), one line on stderr.

Tokens: the token ids the model looked up, i.e. the input of its token embedding (the ``nn.Embedding`` tied to
its head, else the one with the most rows not named as a position table: ``fed_tokens.token_embedding``) at its first call in the micro-batch: what ``training_step`` fed the model,
not the batch, which often holds the targets as well (a ``(B, T + 1)`` block of ids sliced into inputs and
targets in ``training_step`` holds ``B`` ids more than were fed). A model without an embedding: the batch's first
integer tensor. Under torch.compile, a graph compiled before the callback's hook was added runs without it: such
steps count the input outside the graph that the embedding looked up on an eager step, or, where there is none,
their tokens are not known (said once, and in the summary's ``capture.tokens_unknown``), never the batch's
(``precprof.integrations.fed_tokens``).

Resuming (``trainer.fit(..., ckpt_path=...)``): the callback keeps the step it goes on from in the checkpoints
Lightning saves (``checkpoint["precprof"]``), so that a resumed fit numbers its steps on from the checkpoint's,
whatever a batch stepped; a checkpoint saved without it: Lightning's count of the batches that stepped. A fit
from a checkpoint into an ``out`` that holds a run continues that run (``resume=True`` says so; ``resume=False``
replaces it). A fit from step 0 into an ``out`` that holds a run is refused at its first batch unless
``overwrite=True``.

Precision plugins: Lightning's setting is recorded (``config.lightning_precision``) and mapped to precprof's
modes (``config.precision``): ``16-mixed`` -> fp16 (autocast + GradScaler), ``bf16-mixed`` -> bf16 (autocast),
``bf16-true`` / ``16-true`` -> bf16-pure / fp16-pure (parameters in that dtype), ``32-true`` -> fp32,
``transformer-engine`` -> fp8. Lightning itself turns ``16-mixed`` on a CPU into ``bf16-mixed`` (with a warning),
so such a run is recorded as bf16. Under DDP/FSDP strategies the Profiler reduces across ranks and rank 0
writes (``precprof.capture.reducer``); the wrapper is described from ``trainer.strategy.model``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import torch

from precprof import _compat
from precprof import tables as T
from precprof._notice import notice
from precprof.capture import unsaved
from precprof.errors import MissingDependencyError
from precprof.export.wandb import beside_trainer, wandb_module
from precprof.integrations._common import (
    LIGHTNING_PRECISIONS,
    Session,
    checked_own,
    checked_profiler_kwargs,
    model_info,
)
from precprof.integrations.fed_tokens import UNKNOWN, FedTokens
from precprof.integrations.fed_tokens import token_embedding as token_embedding  # (its home before)

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import WandbLogger
except ImportError:  # the standalone package name
    try:
        from pytorch_lightning import Callback  # type: ignore[assignment]
        from pytorch_lightning.loggers import WandbLogger  # type: ignore[assignment]
    except ImportError as _e:
        raise MissingDependencyError("lightning", extra="lightning", purpose="the Lightning callback") from _e


CHECKPOINT_KEY = "precprof"  # the checkpoint's entry for the callback's step count
# why a step's tokens are not known (``fed_tokens``), as the warning, the summary and the report say it
TOKENS_UNKNOWN = (
    "the model's token embedding ran inside a graph torch.compile made before precprof's hook was on it (a model "
    "compiled earlier in the process), and the ids it looked up are no input seen outside that graph; such steps "
    "are left out of tokens/s (call torch.compiler.reset() before trainer.fit to count them)"
)


def precprof_precision(lightning_precision: Any) -> str:
    """precprof's precision mode for a Lightning precision setting ("bf16-mixed" -> "bf16"; unknown: as given)."""
    key = str(lightning_precision)
    return LIGHTNING_PRECISIONS.get(key, key)


class PrecprofCallback(Callback):  # type: ignore[misc]
    """Profile a Lightning ``Trainer.fit`` with precprof.

    Args:
        out: the run directory (default: ``<trainer.default_root_dir>/precprof``).
        sample_every: record per-layer statistics every N optimizer steps (step 0 included); None (the default):
            as many steps as keep the overhead within ``overhead_budget`` (``precprof.Profiler``'s default).
        report: render report.html at the end of fit.
        **profiler_kwargs: further ``precprof.Profiler`` arguments. ``resume``: True continues the run in
            ``out`` when training resumes from a checkpoint, False replaces it; left out, a training that
            resumes from a checkpoint continues the run ``out`` holds, with a warning that resume=True
            silences. ``overwrite=True`` replaces a run in ``out`` that training from step 0 would write over
            (refused without it, as by ``Profiler(out=...)``: a RunDirError when training starts). ``wandb``:
            beside a ``WandbLogger`` of the same run, which logs without ``step=``, precprof's rows are logged
            without ``step=`` too, against ``precprof/step`` (``precprof.export.wandb.BesideTrainer``). Others:
            ``modules``, ``memory``, ...

    After fit, ``run_dir`` is the run directory and ``report_path`` the report (None when not rendered).
    """

    def __init__(
        self,
        out: str | Path | None = None,
        sample_every: int | None = None,
        report: bool = True,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__()
        # checked now, as the Profiler checks them: a typo or a bad value is refused here, not in the first step
        self.out, self.report = checked_own("PrecprofCallback", out, report)
        checked = checked_profiler_kwargs("PrecprofCallback", sample_every, profiler_kwargs)
        self.sample_every = checked.pop("sample_every")
        self.profiler_kwargs = checked
        self._session: Session | None = None
        self._last_global_step = 0
        self._loss_sum: torch.Tensor | None = None
        self._loss_batches = 0  # micro-batches of the step that returned a loss
        self._tokens: int | None = 0  # None: a micro-batch's fed ids are not known (``fed_tokens.UNKNOWN``)
        self._fed = FedTokens()  # the ids each micro-batch fed the model's token embedding
        self._tokens_unknown: dict[str, Any] | None = (
            None  # the steps whose tokens are not known, for the summary
        )
        # the micro-batch in progress, for a step on_exception closes: its batch, and the loss its backward got
        # (automatic optimization: what on_train_batch_end is handed; scaled under an enabled GradScaler)
        self._batch: Any = None
        self._backward_loss: torch.Tensor | None = None
        self._scaled = False  # the precision plugin's GradScaler scales the loss before backward
        self._start: tuple[Any, ...] | None = None  # the session's start, made at the first batch
        self._next_step: int | None = None  # the next optimizer step's number (saved in checkpoints)
        self._restored_step: int | None = None  # that step, as the checkpoint this fit resumes from saved it
        self._optimizers: list[Any] = []  # the trainer's optimizers the Profiler follows
        # a validation loop between two training batches: its time is not the next step's (``not_training``)
        self._outside = contextlib.ExitStack()

    @property
    def run_dir(self) -> Path | None:
        return self._session.run_dir if self._session is not None else None

    @property
    def report_path(self) -> Path | None:
        return self._session.report_path if self._session is not None else None

    @property
    def profiler(self) -> Any:
        """The Profiler of the fit in progress (None outside training)."""
        return self._session.prof if self._session is not None else None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._restored_step = None  # a checkpoint restores after setup: only this fit's own is used

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Keep the step precprof goes on from in the checkpoint: Lightning's own counts say where a resumed fit
        stands in batches and in optimizer steps, neither of which is a precprof step in every loop (manual
        optimization stepping every k-th batch, or two optimizers a batch)."""
        if self._next_step is not None:
            checkpoint[CHECKPOINT_KEY] = {"next_step": self._next_step}

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        step = state.get("next_step") if isinstance(state, dict) else None
        self._restored_step = step if isinstance(step, int) and step >= 0 else None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        optimizer = optimizers[0] if optimizers else None
        plugin = getattr(trainer, "precision_plugin", None) or getattr(
            trainer.strategy, "precision_plugin", None
        )
        scaler = getattr(plugin, "scaler", None)
        enabled = scaler is not None and _compat.scaler_enabled(
            scaler
        )  # GradScaler(enabled=False) scales nothing
        lightning_precision = str(getattr(trainer, "precision", ""))
        requested = precprof_precision(lightning_precision)
        summary: dict[str, Any] = {
            T.SUMMARY_CONFIG: {
                "source": T.SOURCE_LIGHTNING,
                "precision": requested,
                "lightning_precision": lightning_precision,
                "precision_plugin": type(plugin).__name__ if plugin is not None else None,
                "loss_scaling": "dynamic" if enabled else "none",
                "init_scale": float(scaler.get_scale()) if enabled and scaler is not None else None,
                "growth_interval": _compat.scaler_growth_interval(scaler),
                "strategy": type(trainer.strategy).__name__,
                "accumulate_grad_batches": getattr(trainer, "accumulate_grad_batches", None),
                "max_steps": getattr(trainer, "max_steps", None),
                "optimizers": len(optimizers),
                "optimizer_class": " + ".join(dict.fromkeys(type(o).__name__ for o in optimizers)) or None,
                "sample_every": self.sample_every,
                "device": str(pl_module.device),
            },
            T.SUMMARY_MODEL: model_info(pl_module),
            T.SUMMARY_CAPTURE: {"integration": "lightning", "mixed_precision_requested": requested},
        }
        out = self.out
        if out is None:
            out = Path(getattr(trainer, "default_root_dir", None) or "runs") / "precprof"
        if self._session is None:
            kwargs = {"sample_every": self.sample_every, **self.profiler_kwargs}
            if kwargs.get("wandb") not in (None, False) and _logs_to_wandb_run(trainer, kwargs["wandb"]):
                # Lightning's WandbLogger logs without step=: precprof's rows beside it, against their own axis
                kwargs["wandb"] = beside_trainer(kwargs["wandb"])
            self._session = Session(out, kwargs, self.report)
        self._session.out = out
        self._fed.attach(pl_module)
        self._tokens_unknown = None
        self._scaled = enabled
        wrapped = getattr(trainer.strategy, "model", None)
        self._last_global_step = int(trainer.global_step)
        self._next_step = None
        self._reset_step()
        # started at the first batch: Lightning restores its count of the batches that stepped (which numbers
        # the steps after a checkpoint without precprof's) only by then (on_train_start reads it one short)
        self._start = (
            pl_module,
            optimizers if len(optimizers) > 1 else optimizer,  # each samples the parameters it steps
            scaler,
            summary,
            wrapped if wrapped is not None and wrapped is not pl_module else None,
        )

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._fed.begin(batch)
        self._batch, self._backward_loss = batch, None
        start, self._start = self._start, None
        if start is not None and self._session is not None:
            module, optimizers, scaler, summary, wrapped = start
            first, self._restored_step = self._restored_step, None
            if first is None:  # a checkpoint saved without this callback, or an older precprof
                first = _batches_that_stepped(trainer)
            self._session.start(module, optimizers, scaler, summary, first_step=first, wrapped=wrapped)
            self._next_step = first
            self._optimizers = list(getattr(trainer, "optimizers", []) or [])
        self._follow_optimizers(trainer)

    def _follow_optimizers(self, trainer: Any) -> None:
        """New optimizers set on the trainer during the fit (a callback's ``trainer.optimizers = [SGD(...)]`` at
        an epoch, or ``trainer.strategy.setup_optimizers(trainer)`` after unfreezing layers): the Profiler's hooks
        stayed on the old ones' steps. It follows them now (``Profiler.use_optimizer``): before the batch when
        they were set before it, else at its end (that step's updates are not sampled; set once the batch's old
        optimizers stepped, from the next step on, that step keeping their updates and states)."""
        prof = self.profiler
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        if prof is None or list(map(id, optimizers)) == list(map(id, self._optimizers)):
            return
        self._optimizers = optimizers
        prof.use_optimizer(optimizers)

    def _reset_step(self) -> None:
        self._loss_sum = None
        self._loss_batches = 0
        self._tokens = 0

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        """Automatic optimization: the micro-batch's loss, for a step that on_exception closes (its
        on_train_batch_end never came): the closure's loss, which on_train_batch_end is handed too, or that loss
        scaled by the GradScaler. A detach: no copy, no sync."""
        if bool(getattr(pl_module, "automatic_optimization", True)) and isinstance(loss, torch.Tensor):
            self._backward_loss = loss.detach()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch, self._backward_loss = None, None
        if self._session is None or not self._session.active:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        automatic = bool(getattr(pl_module, "automatic_optimization", True))
        has_loss = self._add_loss(loss)
        fed = self._fed.take(batch)
        # automatic optimization skips a batch whose training_step returned None (no backward): none of its
        # tokens were trained on. Manual optimization often returns nothing after its own backward.
        if has_loss or not automatic:
            self._add_tokens(fed)
        self._follow_optimizers(trainer)
        if int(trainer.global_step) == self._last_global_step:
            return  # gradient accumulation: no optimizer step yet
        self._close_step(trainer, automatic)

    def _add_loss(self, loss: Any) -> bool:
        """Add a micro-batch's loss (as on_train_batch_end is handed it) to the step's; whether it had one."""
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            return False
        d = loss.detach().float().reshape(())
        self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
        self._loss_batches += 1
        return True

    def _add_tokens(self, fed: int | None) -> None:
        """Add the ids a micro-batch fed the model (``FedTokens.take``) to the step's tokens."""
        if self._tokens is not None:
            self._tokens = None if fed == UNKNOWN else self._tokens + (fed or 0)

    def _close_step(self, trainer: Any, automatic: bool, loss_known: bool = True) -> None:
        """The batch stepped (``trainer.global_step`` moved): ``Profiler.step`` with the mean loss of its
        micro-batches (None where ``loss_known`` is False: one of them is not known) and their tokens."""
        # one Profiler step per batch that stepped: manual optimization with several optimizers advances
        # global_step once per optimizer, and a step per optimizer made phantom steps with no forward, loss or
        # tokens, sampled empty, timed at nothing
        self._last_global_step = int(trainer.global_step)
        if self._session is None:
            return
        mean = None
        if self._loss_sum is not None and loss_known:
            # automatic optimization hands on_train_batch_end the loss divided by accumulate_grad_batches
            norm = int(getattr(trainer, "accumulate_grad_batches", 1) or 1) if automatic else 1
            # the mean over the micro-batches that returned a loss: a skipped one added nothing to the gradient
            mean = self._loss_sum * (norm / self._loss_batches)
        if self._tokens is None:
            self._said_tokens_unknown()
        self._session.step(loss=mean, tokens=self._tokens or None)
        if self._next_step is not None:
            self._next_step += 1
        self._reset_step()

    def _said_tokens_unknown(self) -> None:
        """The step ending has a micro-batch whose fed ids are not known (``fed_tokens``): counted for the
        summary's ``capture.tokens_unknown``, and said once a fit."""
        step = self._next_step if self._next_step is not None else self._last_global_step
        if self._tokens_unknown is not None:
            self._tokens_unknown["steps"] += 1
            return
        self._tokens_unknown = {"first_step": step, "steps": 1, "why": TOKENS_UNKNOWN}
        notice(f"precprof: the tokens of step {step} are not known: {TOKENS_UNKNOWN}")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._session is not None:
            self._outside.enter_context(self._session.not_training())

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._outside.close()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.finish()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        reason = unsaved.cause(exception)  # one line, as a with block's Profiler says it
        try:
            self._close_stepped_batch(trainer, pl_module)
        except Exception as e:  # the training's own exception matters more: it is raised on, the run saved
            notice(f"precprof: could not close the step that ran: {type(e).__name__}: {e}")
        prof = self.profiler
        writer = prof is not None and bool(prof.is_writer)
        run_dir = self.finish(T.STATUS_INCOMPLETE, reason)
        if run_dir is None:
            return
        said = f"precprof: the partial run was saved to {run_dir}"
        if isinstance(exception, (KeyboardInterrupt, SystemExit)):
            # a note on either is never shown: Lightning turns a KeyboardInterrupt into sys.exit(1) after this
            # hook ("Detected KeyboardInterrupt, attempting graceful shutdown"), and Python prints no traceback
            # for a SystemExit
            if writer:
                print(said, file=sys.stderr, flush=True)
        elif hasattr(exception, "add_note"):
            exception.add_note(said)

    def _close_stepped_batch(self, trainer: Any, pl_module: Any) -> None:
        """The exception came after the batch's optimizer step ran (``trainer.global_step`` moved) and before
        on_train_batch_end closed its step here (a callback listed before this one raised there, or Ctrl-C):
        a finished step, not one cut off. Its last micro-batch's loss is the one its backward got (automatic
        optimization without a GradScaler); else the step's loss is not known. Manual optimization: only once
        training_step returned (an exception between two optimizers' steps cut the batch off)."""
        batch, self._batch = self._batch, None
        backward_loss, self._backward_loss = self._backward_loss, None
        if self._session is None or not self._session.active:
            return
        if int(trainer.global_step) == self._last_global_step:
            return  # no optimizer step since the last step closed: the batch in progress was cut off
        automatic = bool(getattr(pl_module, "automatic_optimization", True))
        if not automatic and not _training_step_returned(trainer):
            return
        fed = self._fed.take(batch)
        if not automatic:  # what training_step returned was not seen
            self._add_tokens(fed)
            known = False
        elif (
            backward_loss is None
        ):  # training_step returned None: a skipped batch, as on_train_batch_end counts it
            known = True
        else:
            self._add_tokens(fed)
            known = not self._scaled  # a scaled loss is not the loss
            if known:
                self._add_loss(backward_loss)
        self._close_step(trainer, automatic, loss_known=known)

    def finish(self, status: str = T.STATUS_COMPLETE, reason: str | None = None) -> Path | None:
        """End the run: remove the hooks and write the run directory and the report."""
        self._fed.remove()
        self._start = None
        if self._session is None:
            return None
        if self._tokens_unknown is not None:
            self._session.summary.setdefault(T.SUMMARY_CAPTURE, {})["tokens_unknown"] = self._tokens_unknown
        return self._session.finish(status, reason)


def _batches_that_stepped(trainer: Any) -> int:
    """The batches that stepped so far (the callback's step count on resume from a checkpoint without
    precprof's step, right from the first batch on): Lightning's count of them, which its loggers use, where
    ``global_step`` counts one per optimizer (twice a batch with two optimizers in manual optimization);
    ``global_step`` where a Lightning has no such count. Manual optimization counts every batch there, also
    one that did not step (an optimizer stepped every k-th batch): only precprof's own count is right then."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    n = getattr(loop, "_batches_that_stepped", None)
    return int(n) if isinstance(n, int) else int(trainer.global_step)


def _training_step_returned(trainer: Any) -> bool:
    """Whether the batch in progress got past its training step (Lightning's progress counts it processed) but
    not to the end of its on_train_batch_end (completed); False where a Lightning keeps no such counts."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    total = getattr(getattr(loop, "batch_progress", None), "total", None)
    processed, completed = getattr(total, "processed", None), getattr(total, "completed", None)
    return isinstance(processed, int) and isinstance(completed, int) and processed > completed


def _logs_to_wandb_run(trainer: Any, target: Any) -> bool:
    """Whether one of the trainer's loggers is a ``WandbLogger`` logging to the run precprof logs to (``target``:
    True for the current ``wandb.run``, or a run object). It logs without ``step=`` (one wandb step per call, a
    validation's too, ``trainer/global_step`` in the dict), which moves wandb's step past precprof's."""
    for logger in getattr(trainer, "loggers", None) or []:
        if isinstance(logger, WandbLogger):
            run = wandb_module("wandb=True").run if target is True else target
            if run is not None and logger.experiment is run:
                return True
    return False

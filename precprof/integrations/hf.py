"""precprof for ``transformers.Trainer``: a ``TrainerCallback`` and ``profile_trainer``.

::

    from precprof.integrations.hf import PrecprofCallback, profile_trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PrecprofCallback(out="runs/hf")])
    trainer.train()                          # runs/hf/report.html at the end of training

    # or, instead (a Trainer made without the callback), so that a crash also leaves a run directory marked
    # incomplete, with its cause:
    profile_trainer(trainer, out="runs/hf")

What the callback does:

- ``on_train_begin``: attaches a ``precprof.Profiler`` to the Trainer's model, its optimizer (the torch optimizer
  inside accelerate's ``AcceleratedOptimizer``, whose hook registry the Profiler needs) and accelerate's
  GradScaler (``AcceleratedOptimizer.scaler``, the one ``trainer.accelerator.scaler`` holds), starting at
  ``state.global_step``. A forward hook on the model counts the tokens (``input_ids``) of the micro-batches;
- ``on_step_end`` (once per optimizer step, after gradient accumulation): ``Profiler.step(loss, grad_norm,
  tokens)`` with the loss and the gradient norm the Trainer logs for that step (see "Loss" below);
- ``on_train_end``: writes the run directory and report.html.

Loss and gradient norm: the Trainer logs, per optimizer step, the sum of what ``Trainer.training_step`` returned
for the micro-batches of the step, and that return value has changed meaning across versions. transformers < 4.46
returns the micro-batch's mean loss / ``gradient_accumulation_steps``; 4.46+ passes ``num_items_in_batch`` (the
label count of the whole accumulation window) to a model whose forward takes loss kwargs (``**kwargs``, e.g.
GPT-2 in 5.x), whose ``outputs.loss`` is then already normalised over the window and returned as is; otherwise
(4.5x and 5.x) the micro-batch mean / the window's micro-batch count, a shorter window when an epoch ends
mid-window included; ``compute_loss_func``, label smoothing, ``loss_is_scaled_for_ga`` (5.x) and subclasses
change it again. So the callback does not re-derive the rule: it records the Trainer's own numbers, summing the
return values of ``training_step`` over the step (as the Trainer does) and keeping the value of the
``accelerator.clip_grad_norm_`` call the Trainer made for the step (its ``grad_norm``: with ``max_grad_norm`` > 0,
and in 5.x always). Callbacks are not handed the trainer: it is ``self.trainer`` under ``profile_trainer``, else the
``Trainer`` whose ``train()`` called ``on_train_begin`` (found on the call stack); both taps are removed when the run
ends. Differences left: a NaN/inf step loss is recorded as such (the Trainer, with ``logging_nan_inf_filter``, logs
the running average instead) and 4.x rounds its log to 4 decimals. Without a trainer (callbacks driven by another
loop) the loss comes from the model's ``outputs.loss`` by the 4.5x/5.x rule: summed over the step's micro-batches
when they were given ``num_items_in_batch`` (already window-normalised), else their mean; no gradient norm.

Crashes: ``TrainerCallback`` has no exception hook. ``profile_trainer(trainer, ...)`` wraps ``trainer.train()``
in try/except and writes the run as "incomplete" with the exception before re-raising it — the reliable way.
With the bare callback, an unfinished run is written as incomplete at interpreter exit (``atexit``: a script
that dies with a traceback) or when the same callback's next ``train()`` starts, or a new callback's on the same
``out`` (a notebook cell run again: ``Session``).

Resuming (``trainer.train(resume_from_checkpoint=...)``): the run starts at the checkpoint's ``global_step``,
and continues the run ``out`` holds (``resume=True`` says so; ``resume=False`` replaces it). A training from step
0 into an ``out`` that holds a run (a notebook cell run again) is refused unless ``overwrite=True``.

Mixed precision that is asked for but not active: ``TrainingArguments(fp16=True)`` on a CPU makes accelerate
report ``mixed_precision="fp16"`` and train in fp32 (no autocast, no scaler). The summary's config holds the
requested precision (``fp16`` / ``bf16``, from ``args.fp16`` / ``args.bf16``) and ``capture`` what the matmul layers
(Linear, GPT-2's Conv1D) actually produced, so the advisor reports "fp16 was requested but is not active".

Under torch.distributed (``torchrun``/``accelerate launch``) the Profiler reduces statistics across ranks
(``precprof.capture.reducer.RankReducer``) and rank 0 writes; the wrapper (DDP/FSDP) is described from
``trainer.model_wrapped`` when the callback knows the trainer (``profile_trainer``).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from precprof import _compat
from precprof import tables as T
from precprof.capture import unsaved
from precprof.errors import MissingDependencyError, UserError
from precprof.export.wandb import beside_trainer
from precprof.integrations._common import (
    Session,
    checked_own,
    checked_profiler_kwargs,
    first_token_count,
    model_info,
)

try:
    from transformers import TrainerCallback
except ImportError as _e:  # keep `import precprof.integrations.hf` failing with the extra to install
    raise MissingDependencyError(
        "transformers", extra="hf", purpose="the Hugging Face Trainer callback"
    ) from _e


def requested_precision(args: Any) -> str:
    """precprof's name of the precision ``TrainingArguments`` asks for: fp16, bf16, tf32 or fp32."""
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "tf32", False):
        return "tf32"
    return "fp32"


def _calling_trainer() -> Any:
    """The ``transformers.Trainer`` up the call stack (whose ``train()`` is running the callbacks), or None.

    ``TrainerCallback`` events are given the model and the optimizer but not the trainer; the events are always
    called from the trainer's own methods (``CallbackHandler.call_event`` a few frames down), where it is ``self``.
    """
    try:
        from transformers import Trainer
    except ImportError:  # pragma: no cover - transformers is imported above
        return None
    frame: types.FrameType | None = sys._getframe(1)
    try:
        for _ in range(32):
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, Trainer):
                return owner
            frame = frame.f_back
        return None
    finally:
        del frame


def _unwrap_optimizer(optimizer: Any) -> tuple[Any, Any]:
    """(torch optimizer, GradScaler or None) from what the Trainer hands callbacks (an AcceleratedOptimizer).

    Unwrapped as the Profiler unwraps what it is given (``_compat.unwrapped_optimizer``): accelerate's wrapper
    subclasses torch.optim.Optimizer without its hook registry, so the optimizer inside it is the one whose steps
    fire hooks. A user's optimizer that has a hook registry of its own is kept, even with an attribute named
    ``optimizer`` (a warm-up or averaging optimizer that holds another one): going down that attribute hooked an
    optimizer that never stepped the model's weights, and the run had no weight_update rows."""
    scaler = getattr(optimizer, "scaler", None)
    inner = _compat.unwrapped_optimizer(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        inner = None  # an optimizer precprof cannot hook (DeepSpeed's): no weight_update rows
    return inner, scaler


_MISSING = object()


class PrecprofCallback(TrainerCallback):  # type: ignore[misc]
    """Profile a ``transformers.Trainer`` run with precprof.

    Args:
        out: the run directory (default: ``<args.output_dir>/precprof``).
        sample_every: record per-layer statistics every N optimizer steps (step 0 included); None (the default):
            as many steps as keep the overhead within ``overhead_budget`` (``precprof.Profiler``'s default).
        report: render report.html at the end of training.
        **profiler_kwargs: further ``precprof.Profiler`` arguments. ``resume``: True continues the run in
            ``out`` when training resumes from a checkpoint, False replaces it; left out, a training that
            resumes from a checkpoint continues the run ``out`` holds, with a warning that resume=True
            silences. ``overwrite=True`` replaces a run in ``out`` that training from step 0 would write over
            (refused without it, as by ``Profiler(out=...)``: a RunDirError when training starts). Others:
            ``modules``, ``memory``, ``update_sample``, ...

    After training, ``run_dir`` is the run directory and ``report_path`` the report (None when not rendered).
    """

    def __init__(
        self,
        out: str | Path | None = None,
        sample_every: int | None = None,
        report: bool = True,
        **profiler_kwargs: Any,
    ) -> None:
        # checked now, as the Profiler checks them: a typo or a bad value is refused here, not in the first step
        self.out, self.report = checked_own("PrecprofCallback", out, report)
        checked = checked_profiler_kwargs("PrecprofCallback", sample_every, profiler_kwargs)
        self.sample_every = checked.pop("sample_every")
        self.profiler_kwargs = checked
        self.trainer: Any = None  # set by profile_trainer: gives the wrapped model and the accelerator
        self._session: Session | None = None
        self._hook: Any = None
        # taps on the Trainer: (object, attribute, the instance attribute it replaced or _MISSING, the wrapper)
        self._taps: list[tuple[Any, str, Any, Any]] = []
        self._tapped = False  # the Trainer's loss (and grad norm) are captured: the model's loss is not used
        self._step_loss: torch.Tensor | None = None  # sum of training_step's returns over the step
        self._step_grad_norm: Any = None  # the Trainer's last accelerator.clip_grad_norm_ of the step
        self._loss_sum: torch.Tensor | None = None  # without taps: the model's outputs.loss, summed
        self._window_normalised = False  # without taps: the model was given num_items_in_batch
        self._micro_batches = 0
        self._tokens = 0

    # ------------------------------------------------------------------------------------ results
    @property
    def run_dir(self) -> Path | None:
        return self._session.run_dir if self._session is not None else None

    @property
    def report_path(self) -> Path | None:
        return self._session.report_path if self._session is not None else None

    @property
    def profiler(self) -> Any:
        """The Profiler of the run in progress (None outside training)."""
        return self._session.prof if self._session is not None else None

    # ------------------------------------------------------------------------------------ forward hook
    def _forward_hook(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return None  # evaluation
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if (
            loss is None
            and isinstance(output, (tuple, list))
            and output
            and isinstance(output[0], torch.Tensor)
        ):
            loss = output[0] if output[0].dim() == 0 else None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and not self._tapped:
            d = loss.detach().float().reshape(())
            self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
            if kwargs and kwargs.get("num_items_in_batch") is not None:
                self._window_normalised = True
        self._micro_batches += 1
        n = first_token_count(kwargs) if kwargs else None
        if n is None and args:
            n = first_token_count(args[0])
        self._tokens += n or 0
        return None

    # ------------------------------------------------------------------------------------ taps on the Trainer
    def _on_training_step(self, loss: Any) -> None:
        """One micro-batch's ``training_step`` return: what the Trainer adds to the loss it logs."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            # float32 and the Trainer's order of addition: the same sum as its tr_loss accumulator
            d = loss.detach().to(torch.float32).reshape(())
            self._step_loss = d if self._step_loss is None else self._step_loss + d

    def _on_grad_norm(self, norm: Any) -> None:
        self._step_grad_norm = norm

    def _not_training(self) -> contextlib.AbstractContextManager[None]:
        return self._session.not_training() if self._session is not None else contextlib.nullcontext()

    def _tap(
        self,
        obj: Any,
        name: str,
        record: Callable[[Any], None] = lambda result: None,
        around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        """Wrap ``obj.name`` (a method) with an instance attribute that runs it inside ``around()`` and hands its
        return value to ``record``."""
        original = getattr(obj, name, None)
        if not callable(original):
            return

        @functools.wraps(original)
        def tapped(*args: Any, **kwargs: Any) -> Any:
            with around():
                result = original(*args, **kwargs)
            record(result)
            return result

        previous = vars(obj).get(name, _MISSING) if hasattr(obj, "__dict__") else _MISSING
        try:
            setattr(obj, name, tapped)
        except (AttributeError, TypeError):
            return
        self._taps.append((obj, name, previous, tapped))

    def _tap_trainer(self, trainer: Any) -> None:
        self._untap()
        self._tap(trainer, "training_step", self._on_training_step)
        self._tapped = bool(self._taps)
        # the Trainer evaluates between prof.step() and the next step's begin: not the next step's time
        self._tap(trainer, "evaluate", around=self._not_training)
        accelerator = getattr(trainer, "accelerator", None)
        if accelerator is not None:
            self._tap(accelerator, "clip_grad_norm_", self._on_grad_norm)

    def _untap(self) -> None:
        for obj, name, previous, tapped in reversed(self._taps):
            if vars(obj).get(name) is not tapped:
                continue  # wrapped again by someone else since: leave theirs in place
            if previous is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)
        self._taps = []
        self._tapped = False

    # ------------------------------------------------------------------------------------ events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            return
        optimizer, scaler = _unwrap_optimizer(kwargs.get("optimizer"))
        trainer = self.trainer
        if scaler is None and trainer is not None:
            scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        enabled = scaler is not None and _compat.scaler_enabled(
            scaler
        )  # GradScaler(enabled=False) scales nothing
        requested = requested_precision(args)
        accel = getattr(trainer if trainer is not None else _calling_trainer(), "accelerator", None)
        summary: dict[str, Any] = {
            T.SUMMARY_CONFIG: {
                "source": T.SOURCE_TRANSFORMERS,
                "precision": requested,
                "fp16": bool(getattr(args, "fp16", False)),
                "bf16": bool(getattr(args, "bf16", False)),
                "tf32": getattr(args, "tf32", None),
                "accelerate_mixed_precision": str(getattr(accel, "mixed_precision", "")) or None,
                "loss_scaling": "dynamic" if enabled else "none",
                "init_scale": float(scaler.get_scale()) if enabled and scaler is not None else None,
                "growth_interval": _compat.scaler_growth_interval(scaler),
                "device": str(getattr(args, "device", "")),
                "batch_size": getattr(args, "per_device_train_batch_size", None),
                "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
                "learning_rate": getattr(args, "learning_rate", None),
                "max_steps": getattr(state, "max_steps", None),
                "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
                "sample_every": self.sample_every,
            },
            T.SUMMARY_MODEL: model_info(model),
            T.SUMMARY_CAPTURE: {
                "integration": "transformers",
                "mixed_precision_requested": requested,
                "compiled": _trainer_compiles(args),
            },
        }
        out = (
            self.out
            if self.out is not None
            else Path(getattr(args, "output_dir", None) or "runs") / "precprof"
        )
        if self._session is None:
            kwargs = {"sample_every": self.sample_every, **self.profiler_kwargs}
            if kwargs.get("wandb") not in (None, False) and _reports_to_wandb(args):
                # the Trainer's WandbCallback logs without step=: precprof's rows beside it, against their own axis
                kwargs["wandb"] = beside_trainer(kwargs["wandb"])
            self._session = Session(out, kwargs, report=self.report)
            self._session.on_finish = self._unhook
        self._session.out = out
        wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        self._session.start(
            model,
            optimizer,
            scaler,
            summary,
            first_step=int(getattr(state, "global_step", 0) or 0),
            wrapped=wrapped if wrapped is not model else None,
        )
        self._reset_step()
        self._tap_trainer(trainer if trainer is not None else _calling_trainer())
        self._hook = _compat.register_uncopied(model, self._forward_hook, pre=False, with_kwargs=True)

    def _reset_step(self) -> None:
        self._step_loss = None
        self._step_grad_norm = None
        self._loss_sum = None
        self._window_normalised = False
        self._micro_batches = 0
        self._tokens = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is None or not self._session.active:
            return
        loss = self._step_loss
        if not self._tapped and self._loss_sum is not None and self._micro_batches:
            # no trainer to read: the rule of transformers 4.5x/5.x. A model given num_items_in_batch divided its
            # loss by the label count of the whole window: the step's loss is the sum; else each loss is its
            # micro-batch's mean and the step's loss their mean (over the micro-batches this window really had)
            loss = self._loss_sum if self._window_normalised else self._loss_sum / self._micro_batches
        self._session.step(loss=loss, grad_norm=self._step_grad_norm, tokens=self._tokens or None)
        self._reset_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.finish()

    def _unhook(self) -> None:
        """Remove the callback's taps on the Trainer and its hook on the model (also when another callback's
        session on the same ``out`` finishes this one's: ``Session.on_finish``)."""
        self._untap()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def finish(self, status: str = T.STATUS_COMPLETE, reason: str | None = None) -> Path | None:
        """End the run: remove the hooks and write the run directory and the report."""
        self._unhook()
        if self._session is None:
            return None
        return self._session.finish(status, reason)


def profile_trainer(
    trainer: Any,
    out: str | Path | None = None,
    sample_every: int | None = None,
    report: bool = True,
    train_kwargs: dict[str, Any] | None = None,
    **profiler_kwargs: Any,
) -> Any:
    """Run ``trainer.train(**train_kwargs)`` with a ``PrecprofCallback``; returns what ``train`` returns.

    If training raises (or is interrupted), the run directory is still written, marked incomplete with the
    exception, and the exception is re-raised with a note naming the directory. The callback (with
    ``run_dir`` and ``report_path``) stays on the trainer as ``trainer.precprof_callback``. A trainer that already
    has a PrecprofCallback is refused (UserError) before anything runs: two on one training claim the same run.
    """
    _refuse_a_second_callback(trainer)
    cb = PrecprofCallback(out=out, sample_every=sample_every, report=report, **profiler_kwargs)
    cb.trainer = trainer
    trainer.add_callback(cb)
    trainer.precprof_callback = cb
    try:
        result = trainer.train(**(train_kwargs or {}))
    except BaseException as e:
        reason = unsaved.cause(e)  # one line, as a with block's Profiler says it
        run_dir = cb.finish(T.STATUS_INCOMPLETE, reason)
        if run_dir is not None and hasattr(e, "add_note"):
            e.add_note(f"precprof: the partial run was saved to {run_dir}")
        raise
    finally:
        trainer.remove_callback(cb)
    cb.finish()  # no-op when on_train_end already finished it
    return result


def _refuse_a_second_callback(trainer: Any) -> None:
    """A UserError when ``trainer`` already has a PrecprofCallback (given to ``Trainer(callbacks=[...])``): a
    second one profiled the same training, and into the same ``out`` it wiped the first's run (left incomplete,
    with no step, when the second failed to claim the directory the first held)."""
    handler = getattr(trainer, "callback_handler", None)
    for cb in getattr(handler, "callbacks", None) or []:
        if isinstance(cb, PrecprofCallback):
            where = cb.out if cb.out is not None else "<output_dir>/precprof"
            raise UserError(
                f"profile_trainer: this Trainer already has a PrecprofCallback (out {where}); call "
                "trainer.train() to profile with it, or remove it first: "
                "trainer.remove_callback(PrecprofCallback)"
            )


def _trainer_compiles(args: Any) -> str | None:
    """``TrainingArguments(torch_compile=True)`` in words: the Trainer compiles the model it wraps, which the
    callback is not given (the Profiler holds the module itself and cannot tell)."""
    if not getattr(args, "torch_compile", False):
        return None
    backend = getattr(args, "torch_compile_backend", None) or "inductor"
    mode = getattr(args, "torch_compile_mode", None)
    return f"the whole model (the Trainer's torch_compile, backend {backend}" + (
        f", mode {mode})" if mode else ")"
    )


def _reports_to_wandb(args: Any) -> bool:
    """Whether the Trainer logs to wandb itself (``report_to`` names it, or "all")."""
    report_to = getattr(args, "report_to", None)
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return any(str(n).lower() in ("wandb", "all") for n in names)

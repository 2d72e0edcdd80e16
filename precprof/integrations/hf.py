"""precprof for ``transformers.Trainer``: a ``TrainerCallback`` and ``profile_trainer``.

::

    from precprof.integrations.hf import PrecprofCallback, profile_trainer

    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[PrecprofCallback(out="runs/hf")])
    trainer.train()                          # runs/hf/report.html at the end of training
    # or, so that a crash also leaves a run directory marked incomplete, with its cause:
    profile_trainer(trainer, out="runs/hf", sample_every=10)

What the callback does:

- ``on_train_begin``: attaches a ``precprof.Profiler`` to the Trainer's model, its optimizer (the torch optimizer
  inside accelerate's ``AcceleratedOptimizer``, whose hook registry the Profiler needs) and accelerate's
  GradScaler (``AcceleratedOptimizer.scaler``, the one ``trainer.accelerator.scaler`` holds), starting at
  ``state.global_step``. A forward hook on the model keeps the loss the model returns (``outputs.loss``, as a
  device tensor: no sync) and the token count of ``input_ids``, averaged over the micro-batches of a step;
- ``on_step_end`` (once per optimizer step, after gradient accumulation): ``Profiler.step(loss, tokens)``;
- ``on_train_end``: writes the run directory and report.html.

Crashes: ``TrainerCallback`` has no exception hook. ``profile_trainer(trainer, ...)`` wraps ``trainer.train()``
in try/except and writes the run as "incomplete" with the exception before re-raising it — the reliable way.
With the bare callback, an unfinished run is written as incomplete at interpreter exit (``atexit``: a script
that dies with a traceback) or when the same callback's next ``train()`` starts (a notebook).

Mixed precision that is asked for but not active: ``TrainingArguments(fp16=True)`` on a CPU makes accelerate
report ``mixed_precision="fp16"`` and train in fp32 (no autocast, no scaler). The summary's config holds the
requested precision (``fp16`` / ``bf16``, from ``args.fp16`` / ``args.bf16``) and ``capture`` what the matmul layers
(Linear, GPT-2's Conv1D) actually produced, so the advisor reports "fp16 was requested but is not active".

Under torch.distributed (``torchrun``/``accelerate launch``) the Profiler reduces statistics across ranks
(``precprof.capture.reducer.RankReducer``) and rank 0 writes; the wrapper (DDP/FSDP) is described from
``trainer.model_wrapped`` when the callback knows the trainer (``profile_trainer``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from precprof import tables as T
from precprof.errors import MissingDependencyError
from precprof.integrations._common import Session, first_token_count, model_info

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


def _unwrap_optimizer(optimizer: Any) -> tuple[Any, Any]:
    """(torch optimizer, GradScaler or None) from what the Trainer hands callbacks (an AcceleratedOptimizer)."""
    scaler = getattr(optimizer, "scaler", None)
    inner = optimizer
    # AcceleratedOptimizer subclasses torch.optim.Optimizer without its hook registry: go to the wrapped one
    for _ in range(4):
        nested = getattr(inner, "optimizer", None)
        if nested is None or nested is inner:
            break
        inner = nested
    if not isinstance(inner, torch.optim.Optimizer):
        inner = None  # an optimizer precprof cannot hook (DeepSpeed's): no weight_update rows
    return inner, scaler


class PrecprofCallback(TrainerCallback):  # type: ignore[misc]
    """Profile a ``transformers.Trainer`` run with precprof.

    Args:
        out: the run directory (default: ``<args.output_dir>/precprof``).
        sample_every: record per-layer statistics every N optimizer steps (step 0 included).
        report: render report.html at the end of training.
        **profiler_kwargs: further ``precprof.Profiler`` arguments (``modules``, ``memory``, ``update_sample``, ...).

    After training, ``run_dir`` is the run directory and ``report_path`` the report (None when not rendered).
    """

    def __init__(
        self,
        out: str | Path | None = None,
        sample_every: int = 10,
        report: bool = True,
        **profiler_kwargs: Any,
    ) -> None:
        self.out = Path(out) if out is not None else None
        self.sample_every = sample_every
        self.report = report
        self.profiler_kwargs = profiler_kwargs
        self.trainer: Any = None  # set by profile_trainer: gives the wrapped model and the accelerator
        self._session: Session | None = None
        self._hook: Any = None
        self._loss_sum: torch.Tensor | None = None
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
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            d = loss.detach().float().reshape(())
            self._loss_sum = d if self._loss_sum is None else self._loss_sum + d
        self._micro_batches += 1
        n = first_token_count(kwargs) if kwargs else None
        if n is None and args:
            n = first_token_count(args[0])
        self._tokens += n or 0
        return None

    # ------------------------------------------------------------------------------------ events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        if model is None:
            return
        optimizer, scaler = _unwrap_optimizer(kwargs.get("optimizer"))
        trainer = self.trainer
        if scaler is None and trainer is not None:
            scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)
        requested = requested_precision(args)
        accel = getattr(trainer, "accelerator", None) if trainer is not None else None
        summary: dict[str, Any] = {
            T.SUMMARY_CONFIG: {
                "source": "transformers.Trainer",
                "precision": requested,
                "fp16": bool(getattr(args, "fp16", False)),
                "bf16": bool(getattr(args, "bf16", False)),
                "tf32": getattr(args, "tf32", None),
                "accelerate_mixed_precision": str(getattr(accel, "mixed_precision", "")) or None,
                "loss_scaling": "dynamic" if scaler is not None else "none",
                "init_scale": float(scaler.get_scale()) if scaler is not None else None,
                "growth_interval": int(scaler.get_growth_interval()) if scaler is not None else None,
                "device": str(getattr(args, "device", "")),
                "batch_size": getattr(args, "per_device_train_batch_size", None),
                "gradient_accumulation_steps": getattr(args, "gradient_accumulation_steps", None),
                "learning_rate": getattr(args, "learning_rate", None),
                "max_steps": getattr(state, "max_steps", None),
                "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
                "sample_every": self.sample_every,
            },
            T.SUMMARY_MODEL: model_info(model),
            T.SUMMARY_CAPTURE: {"integration": "transformers", "mixed_precision_requested": requested},
        }
        out = (
            self.out
            if self.out is not None
            else Path(getattr(args, "output_dir", None) or "runs") / "precprof"
        )
        if self._session is None:
            self._session = Session(
                out, {"sample_every": self.sample_every, **self.profiler_kwargs}, report=self.report
            )
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
        self._hook = model.register_forward_hook(self._forward_hook, with_kwargs=True)

    def _reset_step(self) -> None:
        self._loss_sum = None
        self._micro_batches = 0
        self._tokens = 0

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session is None or not self._session.active:
            return
        loss = None
        if self._loss_sum is not None and self._micro_batches:
            loss = self._loss_sum / self._micro_batches  # the mean over micro-batches, as the Trainer logs it
        self._session.step(loss=loss, tokens=self._tokens or None)
        self._reset_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.finish()

    def finish(self, status: str = T.STATUS_COMPLETE, reason: str | None = None) -> Path | None:
        """End the run: remove the hooks and write the run directory and the report."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._session is None:
            return None
        return self._session.finish(status, reason)


def profile_trainer(
    trainer: Any,
    out: str | Path | None = None,
    sample_every: int = 10,
    report: bool = True,
    train_kwargs: dict[str, Any] | None = None,
    **profiler_kwargs: Any,
) -> Any:
    """Run ``trainer.train(**train_kwargs)`` with a ``PrecprofCallback``; returns what ``train`` returns.

    If training raises (or is interrupted), the run directory is still written, marked incomplete with the
    exception, and the exception is re-raised with a note naming the directory. The callback (with
    ``run_dir`` and ``report_path``) stays on the trainer as ``trainer.precprof_callback``.
    """
    cb = PrecprofCallback(out=out, sample_every=sample_every, report=report, **profiler_kwargs)
    cb.trainer = trainer
    trainer.add_callback(cb)
    trainer.precprof_callback = cb
    try:
        result = trainer.train(**(train_kwargs or {}))
    except BaseException as e:
        reason = (
            "interrupted (KeyboardInterrupt)"
            if isinstance(e, KeyboardInterrupt)
            else f"{type(e).__name__}: {e}"
        )
        run_dir = cb.finish(T.STATUS_INCOMPLETE, reason)
        if run_dir is not None and hasattr(e, "add_note"):
            e.add_note(f"precprof: the partial run was saved to {run_dir}")
        raise
    finally:
        trainer.remove_callback(cb)
    cb.finish()  # no-op when on_train_end already finished it
    return result

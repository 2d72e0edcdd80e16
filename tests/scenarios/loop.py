"""A user's own training loop with precprof attached: fp32, bf16 or fp16 autocast, an optional GradScaler,
and an optional list of modules kept in fp32 (the advisor's ``keep_fp32``)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn

import precprof
from precprof import tables as T
from precprof.analysis.advisor import AdvisorConfig

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class ProfiledRun:
    """What a scenario run leaves: the four tables, the summary for the advisor, and the losses."""

    tables: dict[str, pd.DataFrame]
    summary: dict[str, Any]
    losses: list[float]

    def recommend(
        self,
        hardware: str | precprof.hardware.HardwareInfo | None = None,
        config: AdvisorConfig | None = None,
    ) -> precprof.Recommendation:
        """The advisor on this run. The scenarios' tiny models stand in for large ones: by default the
        small-model rule (fp32 under 100M parameters) is off, so the decision the scenario is about shows;
        pass ``AdvisorConfig()`` for the advisor as users get it."""
        cfg = config if config is not None else AdvisorConfig(small_model_params=0)
        return precprof.recommend(self.tables, hardware=hardware, config=cfg, summary=self.summary)


def keep_in_fp32(model: nn.Module, names: Sequence[str]) -> None:
    """Run the named submodules outside autocast, on fp32 inputs (the remedy for fp16 overflow).

    The module's forward is wrapped on the instance, so hooks (the Profiler's included) still see it.
    """
    for name in names:
        module = model.get_submodule(name)
        forward = module.forward

        def fp32_forward(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            with torch.autocast("cpu", enabled=False):
                args = tuple(
                    a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
                )
                return _forward(*args, **kwargs)

        module.forward = fp32_forward  # type: ignore[method-assign]


def backward_and_step(loss: torch.Tensor, opt: Any, scaler: Any = None) -> None:
    """The backward pass and the optimizer step of a loop, through ``scaler`` (a GradScaler) when there is one."""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()


def train_profiled(
    model: nn.Module,
    batches: Callable[[int], Batch],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    precision: str = "fp32",
    loss_scale: float | None = None,
    growth_interval: int = 2000,
    static: bool = False,
    keep_fp32: Sequence[str] = (),
    steps: int = 6,
    lr: float = 1e-3,
    sample_every: int = 1,
    on_step: Callable[[nn.Module, int], None] | None = None,
) -> ProfiledRun:
    """Train ``model`` for ``steps`` steps with the Profiler attached and return its tables.

    ``precision``: "fp32", "bf16" or "fp16" (CPU autocast). ``loss_scale``: GradScaler init_scale (dynamic,
    ``growth_interval``; ``static``: growth and back-off factors 1, as ``--loss-scale static:N`` makes it);
    None trains without a scaler (scale 1). ``batches(step)`` returns (x, y).
    ``on_step(model, step)`` runs before each forward (to inject faults).
    """
    keep_in_fp32(model, keep_fp32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=loss_scale, growth_interval=growth_interval)
        if loss_scale is not None
        else None
    )
    if scaler is not None and static:
        scaler.set_growth_factor(1.0)
        scaler.set_backoff_factor(1.0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    losses: list[float] = []
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=sample_every, memory=False)
    with prof:
        for step in range(steps):
            if on_step is not None:
                on_step(model, step)
            x, y = batches(step)
            ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                loss = loss_fn(model(x), y)
            backward_and_step(loss, opt, scaler)
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    x, _ = batches(0)
    summary = {
        T.SUMMARY_CONFIG: {
            "precision": precision,
            "loss_scaling": "dynamic" if scaler is not None else "none",
            "init_scale": loss_scale,
            "growth_interval": growth_interval,
            "batch_size": int(x.shape[0]),
            "seq_len": int(x.shape[1]) if x.ndim > 2 else None,
        },
        T.SUMMARY_MODEL: {"n_params": sum(p.numel() for p in model.parameters())},
        T.SUMMARY_CAPTURE: prof.summary(),
    }
    return ProfiledRun(prof.tables(), summary, losses)


def square_mean(out: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    """A loss of the output alone (``train_profiled``'s ``loss_fn`` for a model without a target)."""
    return out.float().square().mean()


def regression_batches(n_in: int, batch: int = 64, seed: int = 0) -> Callable[[int], Batch]:
    """Deterministic (x, y) batches for a smooth regression target, one per step."""

    def make(step: int) -> Batch:
        g = torch.Generator().manual_seed(seed * 10_007 + step)
        x = torch.randn(batch, n_in, generator=g)
        y = torch.sin(x[:, :1] + 0.5 * x[:, 1:2]) + 0.1 * x[:, 2:3]
        return x, y

    return make


def activations(tables: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The activation rows of a run."""
    layers = tables["layers"]
    return layers[layers[T.TENSOR] == T.ACTIVATION]


def iter_rows(tables: dict[str, pd.DataFrame], kind: str) -> Iterator[dict[str, Any]]:
    layers = tables["layers"]
    yield from layers[layers[T.TENSOR] == kind].to_dict("records")

"""Pitfalls of a user's own loop that only the loop's shape reveals: a GradScaler with no autocast (fp16
asked for, never active), clipping before ``scaler.unscale_`` (the norm is the loss scale times too large),
and manual static loss scaling declared with ``Profiler(loss_scale=...)``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import precprof
from precprof import tables as T

from .loop import ProfiledRun, regression_batches


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def _result(prof: precprof.Profiler, losses: list[float]) -> ProfiledRun:
    summary: dict[str, Any] = {T.SUMMARY_CAPTURE: prof.summary()}
    return ProfiledRun(prof.tables(), summary, losses)


def scaler_loop(
    *,
    autocast: bool,
    unscale_first: bool = True,
    clip: bool = False,
    steps: int = 4,
    init_scale: float = 2.0**12,
) -> ProfiledRun:
    """fp32 model with a GradScaler (init ``init_scale``, 2^12); bf16 autocast around the forward when
    ``autocast``; with ``clip``, the gradient norm is clipped (before or after ``scaler.unscale_``) and handed to
    ``prof.step``."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    batches = regression_batches(8, seed=1)
    losses: list[float] = []
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, memory=False)
    with prof:
        for step in range(steps):
            x, y = batches(step)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = nn.functional.mse_loss(model(x).float(), y)
            scaler.scale(loss).backward()
            norm = None
            if clip:
                if unscale_first:
                    scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # measure, do not clip
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach(), grad_norm=norm)
            losses.append(loss.item())
    return _result(prof, losses)


def manual_scaling(scale: float | None, steps: int = 3) -> ProfiledRun:
    """fp32 training; with ``scale``, the loss is multiplied by it before backward and the gradients divided
    by it after, the scale declared to the Profiler."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batches = regression_batches(8, seed=2)
    losses: list[float] = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, loss_scale=scale)
    with prof:
        for step in range(steps):
            x, y = batches(step)
            loss = nn.functional.mse_loss(model(x), y)
            (loss * (scale or 1.0)).backward()
            if scale:
                for p in model.parameters():
                    p.grad.div_(scale)
            opt.step()
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    return _result(prof, losses)

"""Mixed precision asked for but not active: accelerate's ``mixed_precision="fp16"`` on a CPU.

accelerate accepts the setting, reports ``accelerator.mixed_precision == "fp16"``, and then runs everything in
fp32 on the CPU (no autocast, no GradScaler). Nothing fails, and the user believes they trained in fp16. The
Profiler sees float32 outputs from every Linear; the advisor must say that fp16 was requested but not active.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import precprof
from precprof import tables as T

from .loop import ProfiledRun, regression_batches

N_IN = 16


def run(steps: int = 3) -> tuple[ProfiledRun, Any]:
    """Train a small MLP through accelerate with mixed_precision="fp16" on the CPU; returns (run, accelerator)."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    model = nn.Sequential(nn.Linear(N_IN, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    batches = regression_batches(N_IN)
    # AcceleratedOptimizer wraps the torch optimizer without its hook registry: hand the Profiler the inner one
    prof = precprof.Profiler(model, optimizer=opt.optimizer, sample_every=1, memory=False)
    losses = []
    with prof:
        for step in range(steps):
            x, y = batches(step)
            with accelerator.autocast():
                loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    summary = {
        # what the user asked for, as accelerate reports it
        T.SUMMARY_CONFIG: {"precision": str(accelerator.mixed_precision), "batch_size": 64},
        T.SUMMARY_CAPTURE: prof.summary(),
    }
    return ProfiledRun(prof.tables(), summary, losses), accelerator

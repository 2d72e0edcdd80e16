"""After ``detach()`` nothing of the Profiler's keeps the model, the optimizer or the Profiler alive: a loop that
still holds its last loss (a module-level loop, a notebook, ``return loss``, a traceback) keeps its graph, and
with it every hook autograd holds there: the gradient hooks on the sampled step's module outputs, and, where no
backward ran through it (a step cut off after its forward), the saved-tensor hooks of a step that measured
memory. Without precprof that graph keeps only the parameters."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import precprof


@pytest.mark.parametrize(
    ("cut_off", "memory"),
    [(False, {"memory": False}), (True, {"memory_every": 1})],
    ids=["grad_hooks", "saved_hooks_without_backward"],
)
def test_the_last_loss_keeps_only_the_parameters(cut_off: bool, memory: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1, **memory).attach()
    x = torch.randn(4, 8)
    for _ in range(2):
        loss = model(x).square().mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        prof.step(loss=loss.detach())
    if cut_off:
        loss = model(x).square().mean()  # a sampled step's forward, then the loop stops
    prof.detach()
    layer = model[0]  # (held too, as is the scaler: neither keeps anything of the Profiler's)
    refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(prof)]
    del model, opt, prof
    gc.collect()
    assert loss.grad_fn is not None  # the graph, and the hooks on it, are still there
    alive = [r() is not None for r in refs]
    assert alive == [False, False, False], "model, optimizer, Profiler alive: " + str(alive)
    assert layer.weight.grad is None and scaler.get_scale() > 0

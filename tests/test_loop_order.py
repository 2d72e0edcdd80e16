"""A loop that calls the Profiler out of order trains as it should, but its rows are not its steps.

Every loop here is a real tiny training loop on CPU; what precprof says of it is checked against the loop's own
count of its steps.
"""

from __future__ import annotations

import torch
from torch import nn

import precprof
from precprof import tables as T


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def test_an_optimizer_step_alone_after_the_last_prof_step_makes_no_step_at_detach() -> None:
    """``loss.backward(); prof.step(); opt.step()``, 6 iterations, every 2nd step sampled: the last iteration's
    optimizer step comes after its ``prof.step()``, and detach made of it a step 6 of that update alone (sampled,
    no loss, not cut off, only weight-update rows). The run has the 6 steps the loop took."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with precprof.Profiler(model, optimizer=opt, sample_every=2, memory=False, block_formats=False) as prof:
        for _ in range(6):
            model(torch.randn(4, 8)).square().mean().backward()
            prof.step()
            opt.step()
            opt.zero_grad()
    assert prof.tables()["steps"][T.STEP].tolist() == list(range(6))
    assert prof.tables()["layers"][T.STEP].max() == 4

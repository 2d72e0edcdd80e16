"""What ``prof.step()`` does on a step precprof does not sample, its only cost there (issue 33: an overhead small
enough to leave on; bench/step_call.py times it). Counted, never timed:

- outside compiled code the call is a plain call: Dynamo's frame callback is left as it is (its disable
  wrapper, for calls from compiled code, set and restored it around every call).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import precprof


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def test_outside_compiled_code_the_call_leaves_dynamos_frame_callback_alone(monkeypatch: Any) -> None:
    """Dynamo's disable wrapper sets the frame callback to None and back around each call (28 us of an
    unsampled step after a training step, against 3 us for a plain call); outside compiled code there is no
    callback to turn off. Inside a compiled train step the call still breaks the graph and runs eagerly
    (tests/test_hot_path.py)."""
    import torch._dynamo.eval_frame as ef

    real, calls, inside = ef.set_eval_frame, [], [False]
    monkeypatch.setattr(ef, "set_eval_frame", lambda cb: (inside[0] and calls.append(cb)) or real(cb))
    model = _model()
    # (the optimizer's step and zero_grad are Dynamo-disabled too: not counted)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with precprof.Profiler(model, optimizer=opt, sample_every=4, memory=False) as prof:
        for _ in range(8):
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            inside[0] = True
            prof.step()
            inside[0] = False
    assert calls == []

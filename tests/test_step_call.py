"""What ``prof.step()`` does on a step precprof does not sample, its only cost there (issue 33: an overhead small
enough to leave on; bench/step_call.py times it). Counted, never timed:

- outside compiled code the call is a plain call: Dynamo's frame callback is left as it is (its disable
  wrapper, for calls from compiled code, set and restored it around every call);
- a CPU loss is read with one torch op (four made a copy of it, and the budget's loss watch a fifth), and every
  step's loss is recorded as it was, a bf16 one too;
- between two unsampled steps nothing is undone: the step hooks and the memory tracker, idle since the step
  after the last sampled one, are not called; after a sampled step they are, and no hook stays.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import precprof
from precprof import tables as T
from precprof.capture.hooks import StepHooks
from precprof.capture.memory_tracker import MemoryTracker


class _Ops(TorchDispatchMode):
    """The torch ops run inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))


def _train(prof: precprof.Profiler, model: nn.Module, opt: Any, steps: int, dtype: torch.dtype) -> list[Any]:
    """``steps`` steps; per step (the loss as the test reads it, the ops of the call if neither the step it ends
    nor the one it begins is sampled)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        given = loss.to(dtype)
        ended = prof.sampling
        ops = _Ops()
        with ops:
            prof.step(loss=given)
        out.append((given.item(), None if ended or prof.sampling else ops.names))
    return out


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


@pytest.mark.parametrize("sample_every", [4, None], ids=["every 4", "budget"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_loss_is_read_with_one_op_and_every_steps_is_recorded(
    sample_every: int | None, dtype: torch.dtype
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with precprof.Profiler(model, optimizer=opt, sample_every=sample_every) as prof:
        seen = _train(prof, model, opt, 40, dtype)
    unsampled = [ops for _, ops in seen if ops is not None]
    assert len(unsampled) >= 4
    assert all(ops == ["aten._local_scalar_dense.default"] for ops in unsampled)
    steps = prof.tables()["steps"]
    assert steps[T.LOSS].tolist() == [loss for loss, _ in seen]  # the given dtype's values, exactly
    assert prof.summary()["loss_dtypes"] == {str(dtype).removeprefix("torch."): 40}


def test_between_unsampled_steps_nothing_is_undone(monkeypatch: Any) -> None:
    """The step hooks come off, and the memory tracker ends its step, at the first unsampled step after a
    sampled one; the next unsampled steps have nothing of theirs to undo (25 + 14 us a step)."""
    calls: list[tuple[str, int]] = []
    for cls, name in ((StepHooks, "remove"), (MemoryTracker, "begin_step")):
        real = getattr(cls, name)

        def counted(self: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls.append((_name, prof.current_step))
            return _real(self, *args, **kw)

        monkeypatch.setattr(cls, name, counted)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=4)
    with prof:
        _train(prof, model, opt, 9, torch.float32)
        during = list(calls)
    # steps 0, 4 and 8 sampled; each call counted under the step it begins: a sampled step begins (at the
    # attach, and by the calls ending steps 3 and 7), and so does the unsampled step after it, whose call
    # removes the hooks; the calls beginning steps 2, 3, 6 and 7 have nothing to undo
    want: list[tuple[str, int]] = []
    for step in range(10):
        if step % 4 == 0:
            want.append(("begin_step", step))
        elif step % 4 == 1:
            want += [("begin_step", step), ("remove", step)]
    assert during == want
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    assert sorted(set(prof.tables()["layers"][T.STEP])) == [0, 4, 8]

"""precprof reads a module after the user's own hooks on it, whether they were registered before ``attach()`` or
after it: what the next layer is fed and the gradient that reaches it, on every sampled step alike.

Registered after attach, a user's hooks ran after precprof's on the first sampled step (its hooks were put there at
attach) and before them on later ones (put back at the end of each dictionary): a forward hook returning ``out * 2``
doubled the layer's activation absmax between sampled steps of one run and halved its gradient's."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import precprof
from precprof import tables as T
from precprof.capture import hooks

# the row figures compared (those of the block what-if depend on the step's block group)
_FIGURES = [T.CALLS, T.NUMEL, T.ZEROS, T.NAN, T.INF, T.ABSMAX, T.ABSMIN]


def _users_hooks(model: nn.Sequential) -> None:
    """Hooks that change what the model computes: a forward hook that replaces layer 0's output (x2) and halves its
    gradient (a tensor hook), a forward pre-hook that replaces layer 2's input (x3), a full backward hook that
    replaces layer 2's input gradient (x0.25), and a post-accumulate-grad hook that halves layer 4's weight
    gradient in place. The last two were read after in either order (a module's backward hooks act on the gradient
    before it reaches the tensor hook precprof puts on its output; weight gradients are read when the backward
    pass ends), and are checked all the same."""

    def doubled(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if out.requires_grad:
            out.register_hook(lambda g: g * 0.5)
        return out * 2.0

    model[0].register_forward_hook(doubled)
    model[2].register_forward_pre_hook(lambda mod, args: (args[0] * 3.0,))
    model[2].register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 0.25,))

    def halved(p: torch.Tensor) -> None:
        assert p.grad is not None
        p.grad.mul_(0.5)

    model[4].weight.register_post_accumulate_grad_hook(halved)


def _run(
    *, hooks_after_attach: bool, sample_every: int, evaluate: bool = False
) -> tuple[Any, dict[str, list]]:
    """Five identical steps (lr 0, one batch); precprof's layer rows (the block what-if on: layer 2's input has a
    row of its own once the user's pre-hook replaced it), and what the test's probes saw per step: layer 0's output
    as layer 1 is fed it and that tensor's gradient, and layer 2's input as its forward is given it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    fed: dict[str, list] = {"activation": [], "grad": [], "input": [], "weight_grad": []}

    def probe(mod: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            fed["activation"].append(float(args[0].detach().abs().max()))
            args[0].register_hook(lambda g: fed["grad"].append(float(g.abs().max())))

    model[1].register_forward_pre_hook(probe)
    model[2].register_forward_hook(
        lambda mod, args, out: (
            fed["input"].append(float(args[0].detach().abs().max())) if out.requires_grad else None
        )
    )
    if not hooks_after_attach:
        _users_hooks(model)
    prof = precprof.Profiler(
        model, optimizer=opt, sample_every=sample_every, memory=False, block_formats=True
    ).attach()
    if hooks_after_attach:
        _users_hooks(model)
    x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        assert model[4].weight.grad is not None
        fed["weight_grad"].append(float(model[4].weight.grad.abs().max()))  # (what the optimizer is given)
        opt.step()
        if evaluate:  # (precprof's hooks step aside for it, and come back after)
            with torch.no_grad():
                model(x)
        prof.step(loss=loss.detach())
    prof.detach()
    layers = prof.tables()["layers"]
    layers = layers[layers[T.TENSOR] != T.WEIGHT_UPDATE]
    return layers.set_index([T.STEP, T.MODULE, T.TENSOR, T.PARAM], drop=False), fed


@functools.cache
def _hooks_before_attach() -> Any:
    """The first sampled step's rows with the user's hooks registered before attach: what every run reads."""
    return _by_step(_run(hooks_after_attach=False, sample_every=2)[0])[0]


def _by_step(layers: Any) -> dict[int, Any]:
    return {
        int(step): rows.reset_index(drop=True)[[T.MODULE, T.TENSOR, T.PARAM, *_FIGURES]]
        for step, rows in layers.reset_index(drop=True).groupby(T.STEP)
    }


@pytest.mark.parametrize("sample_every", [1, 2])
def test_users_hooks_registered_after_attach_are_read_after(sample_every: int) -> None:
    """Every sampled step reads layer 0 as layer 1 is fed it (the user's x2 applied) and its gradient as it
    reaches layer 1's input, and layer 2's input as the user's pre-hook replaced it (x3); every sampled step's
    rows are the same (identical steps), and the same as with the user's hooks registered before attach. With
    ``sample_every=1`` an evaluation under no_grad after each step takes precprof's hooks aside and back."""
    after, fed = _run(hooks_after_attach=True, sample_every=sample_every, evaluate=sample_every == 1)
    steps = sorted(after[T.STEP].unique())
    assert steps == ([0, 1, 2, 3, 4] if sample_every == 1 else [0, 2, 4])
    for step in steps:
        assert after.loc[(step, "0", T.ACTIVATION, ""), T.ABSMAX] == fed["activation"][step]
        assert after.loc[(step, "0", T.ACTIVATION_GRAD, ""), T.ABSMAX] == fed["grad"][step]
        assert after.loc[(step, T.input_module("2"), T.ACTIVATION, ""), T.ABSMAX] == fed["input"][step]
        assert after.loc[(step, "4", T.WEIGHT_GRAD, "weight"), T.ABSMAX] == fed["weight_grad"][step]
    rows = _by_step(after)
    reference = _hooks_before_attach()
    for step in steps:
        assert rows[step].equals(reference), step


def test_a_gradient_read_in_its_own_hook_is_read_after_the_users_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under torch.distributed each weight gradient is read in precprof's post-accumulate-grad hook: registered
    after attach, the user's hook that halves layer 4's weight gradient in place ran after that read on the first
    sampled step and before it on the next ones. Read after it on every step, as the optimizer is given it."""
    monkeypatch.setattr(hooks, "_distributed", lambda: True)  # (each gradient read in its own hook)
    after, fed = _run(hooks_after_attach=True, sample_every=2)
    for step in (0, 2, 4):
        assert after.loc[(step, "4", T.WEIGHT_GRAD, "weight"), T.ABSMAX] == fed["weight_grad"][step]

"""Under a GradScaler, gradients of a backward pass that did not begin at a scaled loss (a MAML inner loop's
``torch.autograd.grad(inner_loss, params, create_graph=True)``) are at scale 1: their rows hold their true values,
as those of the scaled passes do (tester t3)."""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import precprof
from precprof import tables as T

SCALE = 2.0**12
STEPS = 2


def _maml(
    profile: bool, scaled_inner: bool
) -> tuple[Any, list[tuple[int, str, torch.Tensor]], list[torch.Tensor]]:
    """Two MAML steps under fp16 autocast and GradScaler(init_scale=2^12): the inner gradients taken with
    ``torch.autograd.grad`` in the forward, of the inner loss as it is (``scaled_inner`` False) or of
    ``scaler.scale(inner_loss)`` divided by the scale after (torch's gradient-penalty recipe); the outer loss
    scaled and backward'd through them. Without the Profiler, every module output's gradient as autograd gave
    it, divided by the scale where its pass began at a scaled loss: (step, module, true gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=10**9)
    data = [torch.randn(8, 8), torch.randn(8, 4), torch.randn(8, 8), torch.randn(8, 4)]
    seen: list[tuple[int, str, torch.Tensor]] = []
    now = {"step": 0, "scaled": False}

    def note(name: str) -> Any:
        def hook(m: nn.Module, a: Any, out: torch.Tensor) -> None:
            out.register_hook(  # (in the pass now running: scaled or not)
                lambda g: seen.append(
                    (now["step"], name, g.detach().float() / (SCALE if now["scaled"] else 1.0))
                )
            )

        return hook

    handles = [] if profile else [m.register_forward_hook(note(n)) for n, m in model.named_modules() if n]
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=1) if profile else None
    losses = []
    with prof if prof is not None else contextlib.nullcontext():
        for step in range(STEPS):
            now["step"], now["scaled"] = step, scaled_inner
            params = dict(model.named_parameters())
            with torch.autocast("cpu", dtype=torch.float16):
                inner = nn.functional.mse_loss(model(data[0]).float(), data[1])
                grads = torch.autograd.grad(
                    scaler.scale(inner) if scaled_inner else inner, list(params.values()), create_graph=True
                )
                if scaled_inner:
                    grads = tuple(g / SCALE for g in grads)
                fast = {k: p - 0.1 * g for (k, p), g in zip(params.items(), grads, strict=True)}
                outer = nn.functional.mse_loss(functional_call(model, fast, (data[2],)).float(), data[3])
            now["scaled"] = True  # (it reaches the inner forward's outputs too, through the inner gradients)
            scaler.scale(outer).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(outer.detach())
            if prof is not None:
                prof.step(loss=outer.detach())
    for h in handles:
        h.remove()
    return prof, seen, [*losses, *(p.detach().clone() for p in model.parameters())]


@pytest.mark.parametrize("scaled_inner", [False, True], ids=["inner-unscaled", "inner-scaled"])
def test_inner_loop_gradients_of_an_unscaled_loss_are_stored_at_their_true_values(scaled_inner: bool) -> None:
    prof, _, trained = _maml(True, scaled_inner)
    _, seen, untouched = _maml(False, scaled_inner)
    assert all(torch.equal(a, b) for a, b in zip(trained, untouched, strict=True))  # training unchanged
    tables = prof.tables()
    layers, hist = tables["layers"], tables["histograms"]
    for step in range(STEPS):
        for module in ("0", "1", "2"):
            true = torch.cat([g.flatten() for s, m, g in seen if s == step and m == module])
            row = layers[
                (layers[T.STEP] == step)
                & (layers[T.MODULE] == module)
                & (layers[T.TENSOR] == T.ACTIVATION_GRAD)
            ].iloc[0]
            assert row[T.SCALE] == SCALE
            assert row[T.ABSMAX] == float(true.abs().max())
            assert row[T.ZEROS] == int((true == 0).sum())
            nz = true[true != 0]
            want = Counter((torch.frexp(nz)[1] - 1).tolist())
            got = hist[
                (hist[T.STEP] == step) & (hist[T.MODULE] == module) & (hist[T.TENSOR] == T.ACTIVATION_GRAD)
            ]
            assert dict(zip(got[T.EXPONENT], got[T.COUNT], strict=True)) == dict(want)

"""Training loops that run the model in unusual ways (through torch.func transforms, ...): precprof records what
it can read of them exactly, skips and counts what it cannot, and never ends the training."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from cast_counts import counts
from torch import nn
from torch.func import functional_call, grad, vmap

import precprof
from precprof import tables as T


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _transformed_step(model: nn.Module, transform: str, x: torch.Tensor, y: torch.Tensor) -> None:
    """One step's gradients into ``.grad`` through ``transform``: ``grad`` (a torch.func training loop, meta-
    learning), ``vmap`` (a batched forward, then an ordinary backward), ``vmap_grad`` (DP-SGD's per-sample
    gradients, averaged)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, p, (xi,)), yi)

    if transform == "vmap":
        F.cross_entropy(vmap(model)(x), y).backward()
        return
    if transform == "grad":
        g = grad(loss)(params, x, y)
    else:
        per_sample = vmap(grad(lambda p, xi, yi: loss(p, xi[None], yi[None])), in_dims=(None, 0, 0))(
            params, x, y
        )
        g = {k: v.mean(0) for k, v in per_sample.items()}
    for k, p in model.named_parameters():
        p.grad = g[k]


@pytest.mark.parametrize("transform", ["grad", "vmap", "vmap_grad"])
def test_a_model_run_under_torch_func_transforms_is_skipped_and_counted_not_a_crash(transform: str) -> None:
    """Inside ``torch.func.grad`` or ``vmap`` the hooks see functorch's wrappers, plain ``torch.Tensor``s to every
    other test but without a storage: the first sampled step raised ``Cannot access data pointer of Tensor that
    doesn't have storage`` from the forward pre-hook. Those reads are skipped and counted, with why; the weights
    and the gradients the optimizer applied are read as in any loop (checked against real casts), and training
    is bitwise that of the loop without precprof."""
    steps = 3
    data = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(steps)]

    def train(profiled: bool) -> tuple[list[torch.Tensor], dict[tuple[int, str], dict[str, float]], Any]:
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        applied: dict[tuple[int, str], dict[str, float]] = {}
        names = {id(p): n for n, p in model.named_parameters()}
        at = [0]

        def read(o: Any, args: Any, kwargs: Any) -> None:
            for p in o.param_groups[0]["params"]:
                applied[(at[0], names[id(p)])] = counts(p.grad)

        opt.register_step_pre_hook(read)
        prof = (
            precprof.Profiler(model, optimizer=opt, sample_every=1, block_formats=True) if profiled else None
        )
        if prof is not None:
            prof.attach()
        for i, (x, y) in enumerate(data):
            at[0] = i
            _transformed_step(model, transform, x, y)
            opt.step()
            opt.zero_grad()
            if prof is not None:
                prof.step()
        if prof is not None:
            prof.detach()
        return [p.detach().clone() for p in model.parameters()], applied, prof

    plain, _, _ = train(False)
    weights, applied, prof = train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, weights, strict=True))
    layers = prof.tables()["layers"]
    grads = layers[layers[T.TENSOR] == T.WEIGHT_GRAD]
    assert len(grads) == steps * 4
    for row in grads.itertuples(index=False):
        want = applied[(row.step, f"{row.module}.{row.param}")]
        got = row._asdict()
        assert {k: got[k] for k in want} == want, (row.step, row.module, row.param)
    # every module output and linear input (a row of its own with block formats on) ran inside the transform:
    # one wrapper each per step
    skipped = {(s["module"], s["tensor"]): s["count"] for s in prof.skipped_tensors()}
    assert skipped == {(m, T.ACTIVATION): steps for m in ("0", "0:input", "1", "2", "2:input")}
    assert {s["reason"] for s in prof.skipped_tensors()} == {
        "a tensor inside a torch.func transform (grad, vmap, jacrev): a wrapper without a storage of its own"
    }
    assert not (layers[T.TENSOR].isin([T.ACTIVATION, T.ACTIVATION_GRAD])).any()

"""Weight updates lost in bf16-held weights: a user's own loop trains an MLP whose parameters are bf16 (what
``precprof train -p bf16-pure`` does) at a learning rate whose updates are far below half a bf16 ulp of the
weights. The updates arrive as zero deltas: the optimizer meant to move the weights, and they did not move.

Independent hooks count, over every element of every parameter, the updates that were intended (a nonzero
gradient, or a weight that moved) and those that did not land, to compare with what precprof recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

import precprof
from precprof import tables as T

from .loop import ProfiledRun, regression_batches


@dataclass
class Truth:
    intended: int  # elements with a nonzero gradient or a moved weight
    stuck: int  # intended, but the weight did not change
    moved_any: bool  # whether any weight changed at all


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))


def run(dtype: torch.dtype, lr: float, steps: int = 6) -> tuple[ProfiledRun, Truth]:
    """Train in ``dtype`` weights (bf16: pure bf16; fp32: fp32 weights) with AdamW at ``lr``; every step is
    sampled, and the update sample covers every element (the largest parameter has 4,096)."""
    model = mlp().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = regression_batches(16, seed=3)
    losses: list[float] = []
    truth = Truth(0, 0, False)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, update_sample=1 << 16)
    with prof:
        for step in range(steps):
            x, y = batches(step)
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), y)
            loss.backward()
            before = [(p.detach().clone(), p.grad.detach().clone()) for p in model.parameters()]
            opt.step()
            for p, (w0, g) in zip(model.parameters(), before, strict=True):
                moved = p.detach() != w0
                intended = (g != 0) | moved
                truth.intended += int(intended.sum())
                truth.stuck += int((intended & ~moved).sum())
                truth.moved_any |= bool(moved.any())
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    summary = {
        T.SUMMARY_MODEL: {"n_params": sum(p.numel() for p in model.parameters())},
        T.SUMMARY_CAPTURE: prof.summary(),
    }
    return ProfiledRun(prof.tables(), summary, losses), truth


def run_layers(
    dtype: torch.dtype,
    lr: float,
    steps: int = 6,
    *,
    skip: str = "",
    fp32: tuple[str, ...] = (),
    eps: float = 1e-8,
    sgd: bool = False,
    clip: float | None = None,
    bf16_from: int | None = None,
    frozen: tuple[str, ...] = (),
    warmup: int = 0,
    bf16: tuple[str, ...] = (),
    joins: int | None = None,
) -> tuple[ProfiledRun, pd.DataFrame]:
    """Train the MLP in ``dtype`` weights with AdamW at ``lr`` (``eps``: fp16 weights need a larger one; ``sgd``:
    plain SGD instead), the modules named in ``fp32`` kept in fp32 (HF's ``_keep_in_fp32_modules``, an MoE
    router), the module ``skip`` left out of the forward on odd steps (LayerDrop: under
    ``zero_grad(set_to_none=False)``, which this loop calls, its ``.grad`` is a zero tensor, and AdamW moves it
    by momentum alone). ``clip``: the gradients clipped to that norm; ``bf16_from``: the model made bf16
    (``model.to(torch.bfloat16)``) before that step; ``frozen``: modules in a param group of learning rate 0;
    ``warmup``: a linear warmup from 0 over that many steps (LambdaLR: step 0's learning rate is 0); ``bf16``:
    modules held in bf16 (a pretrained table loaded so), frozen until step ``joins`` where given, which adds them
    to the optimizer (gradual unfreezing, ULMFiT's). Every step is sampled, and the update sample covers every
    element.

    The truth, one row per (step, module, param), read around ``optimizer.step()`` over every element:
    ``intended`` (a nonzero gradient or a moved weight), ``stuck`` (intended, did not move), ``whatif_bf16``
    (moved, but the weight cast to bf16 plus the update rounds back to itself in bf16), ``trained`` (the
    gradient is nonzero somewhere), ``dtype``, ``lr`` (its group's learning rate on the step) and ``du`` /
    ``dw`` (the squared norms of the update and of the weight before it)."""
    model = mlp().to(dtype)
    for name in fp32:
        model.get_submodule(name).float()
    held16 = [p for name in bf16 for p in model.get_submodule(name).bfloat16().parameters()]
    later = held16 if joins is not None else []
    for p in later:
        p.requires_grad_(False)
    still = [p for n, p in model.named_parameters() if n.rsplit(".", 1)[0] in frozen]
    groups = [
        {"params": [p for p in model.parameters() if all(p is not q for q in [*still, *later])]},
        *([{"params": still, "lr": 0.0}] if still else []),
    ]
    opt = torch.optim.SGD(groups, lr=lr) if sgd else torch.optim.AdamW(groups, lr=lr, eps=eps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup)) if warmup else None
    batches = regression_batches(16, seed=3)
    losses: list[float] = []
    truth: list[dict[str, object]] = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False, update_sample=1 << 16)
    with prof:
        for step in range(steps):
            if step == bf16_from:
                model.to(torch.bfloat16)
            if step == joins:
                opt.add_param_group({"params": [p.requires_grad_(True) for p in later]})
            x, y = batches(step)
            h = x.to(dtype)
            for name, layer in model.named_children():
                if name == skip and step % 2:
                    continue
                w = next(layer.parameters(), None)
                h = layer(h if w is None else h.to(w.dtype))  # (a layer kept in fp32 takes fp32 inputs)
            loss = nn.functional.mse_loss(h.float(), y)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=clip)
            before = {
                n: (p.detach().clone(), p.grad.detach().clone())
                for n, p in model.named_parameters()
                if p.grad is not None  # (a frozen one has none, and no update)
            }
            lrs = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
            opt.step()
            if sched is not None:
                sched.step()
            for n, p in model.named_parameters():
                if n not in before:
                    continue
                w0, g = before[n]
                delta = p.detach().float() - w0.float()
                moved = delta != 0
                intended = (g != 0) | moved
                w16 = w0.bfloat16()
                module, param = n.rsplit(".", 1)
                truth.append(
                    {
                        T.STEP: step,
                        T.MODULE: module,
                        T.PARAM: param,
                        T.DTYPE: str(p.dtype).removeprefix("torch."),
                        "intended": int(intended.sum()),
                        "stuck": int((intended & ~moved).sum()),
                        "whatif_bf16": int((moved & ((w16.float() + delta).bfloat16() == w16)).sum()),
                        "trained": bool((g != 0).any()),
                        "lr": float(lrs[id(p)]),
                        # ||dw||^2 and ||w||^2 over every element: the update-to-weight ratio's sums
                        "du": float((delta.double() ** 2).sum()),
                        "dw": float((w0.double() ** 2).sum()),
                    }
                )
            opt.zero_grad(set_to_none=False)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    summary = {
        T.SUMMARY_MODEL: {"n_params": sum(p.numel() for p in model.parameters())},
        T.SUMMARY_CAPTURE: prof.summary(),
    }
    return ProfiledRun(prof.tables(), summary, losses), pd.DataFrame(truth)


class _WideAndShifts(nn.Module):
    """A 64x64 layer whose weights are all in [1, 2), where an update of 3e-4 is below half a bf16 ulp (2^-8), so
    every one is lost, its bias and 8 shifts of 64 elements zero-initialised, where
    every update lands."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wide = nn.Linear(64, 64)
        with torch.no_grad():
            self.wide.weight.uniform_(1.0, 2.0)
            self.wide.bias.zero_()
        self.shifts = nn.ParameterList(nn.Parameter(torch.zeros(64)) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wide(x) / 64
        for s in self.shifts:
            h = h + s
        return h


def run_sampled(dtype: torch.dtype, steps: int = 2) -> tuple[ProfiledRun, pd.DataFrame]:
    """Train ``_WideAndShifts`` in ``dtype`` weights with AdamW at 3e-4, every step sampled, at the default update
    sample (256 strided elements of each parameter: 256 of the layer's 4,096 weights, every element of the bias
    and of each shift). The truth, one row per (step, module, param), over every element: ``intended`` (a
    nonzero gradient or a moved weight), ``stuck`` (intended, did not move) and ``whatif_bf16`` (intended, lost
    in a bf16 copy of the weight)."""
    model = _WideAndShifts().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    batches = regression_batches(64, batch=16, seed=5)
    losses: list[float] = []
    truth: list[dict[str, object]] = []
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        for step in range(steps):
            x, _ = batches(step)
            loss = nn.functional.mse_loss(model(x.to(dtype)).float(), torch.ones(16, 64))
            loss.backward()
            before = {n: (p.detach().clone(), p.grad.detach().clone()) for n, p in model.named_parameters()}
            opt.step()
            for n, p in model.named_parameters():
                w0, g = before[n]
                delta = p.detach().float() - w0.float()
                moved = delta != 0
                intended = (g != 0) | moved
                w16 = w0.bfloat16()
                module, param = n.rsplit(".", 1)
                truth.append(
                    {
                        T.STEP: step,
                        T.MODULE: module,
                        T.PARAM: param,
                        "intended": int(intended.sum()),
                        "stuck": int((intended & ~moved).sum()),
                        "whatif_bf16": int((intended & ((w16.float() + delta).bfloat16() == w16)).sum()),
                    }
                )
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach())
            losses.append(loss.item())
    summary = {
        T.SUMMARY_MODEL: {"n_params": sum(p.numel() for p in model.parameters())},
        T.SUMMARY_CAPTURE: prof.summary(),
    }
    return ProfiledRun(prof.tables(), summary, losses), pd.DataFrame(truth)

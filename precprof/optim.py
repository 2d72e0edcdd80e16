"""Optimizers for the "pure" precision modes: parameters stored in bf16/fp16, optimizer states in fp32.

There is no fp32 master copy of the weights: each step upcasts a parameter to fp32, applies the update there
with fp32 states, and rounds the result back to the parameter's dtype once. An update smaller than half a
unit in the last place of the stored weight is lost, which is exactly the effect the profiler's
``lost_update_*`` columns measure. With fp32 parameters these optimizers compute the same update as
``torch.optim.AdamW`` / ``torch.optim.SGD`` (single-tensor implementation); an fp64 parameter is updated in
fp64, with fp64 states (fp32 ones would round its update coarser than its storage). Complex parameters are
refused (their update in fp32 would drop the imaginary part): torch's own optimizers take them.

They are ordinary ``torch.optim.Optimizer`` subclasses: step hooks, ``state_dict`` and ``GradScaler`` (which
skips ``step()`` when it finds inf/nan gradients) work as with the built-in optimizers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer


def _working(p: torch.Tensor) -> torch.dtype:
    """The dtype a parameter's update and states are computed in: fp32, or the parameter's own if wider."""
    return torch.promote_types(p.dtype, torch.float32)


def _fp32_view(p: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(working copy of p in ``_working``'s dtype, whether it is a copy). An fp32 (fp64) parameter is updated
    in place."""
    if p.dtype == _working(p):
        return p, False
    return p.to(_working(p)), True


class _RealFloating(Optimizer):
    """An optimizer that takes real floating parameters only: checked in ``add_param_group``, which torch's
    ``Optimizer.__init__`` calls for each group too, so a complex parameter handed over later (a layer unfrozen
    mid-run, added to the existing optimizer) is refused as at construction (it was taken, and updated with real
    arithmetic: ``exp_avg_sq`` summed ``grad*grad``, not ``|grad|^2``)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then a ValueError in one line, the group left out, for a parameter that is not a real
        floating tensor (checked after torch made the group's ``params`` a list: a generator is read once)."""
        super().add_param_group(param_group)
        i, group = len(self.param_groups) - 1, self.param_groups[-1]
        for j, p in enumerate(group["params"]):
            if not p.is_floating_point():
                self.param_groups.pop()
                raise ValueError(
                    f"{type(self).__name__} takes real floating parameters; parameter {j} of group {i} is "
                    f"{str(p.dtype).removeprefix('torch.')} (its update in fp32 would drop the imaginary part): "
                    "use torch.optim's optimizer for it"
                )


class FP32StateAdamW(_RealFloating):
    """AdamW with fp32 moment estimates for parameters of any floating dtype (no master weights).

    Same arguments and update rule as ``torch.optim.AdamW`` without amsgrad: decoupled weight decay
    ``p *= 1 - lr * weight_decay``, then ``p -= lr / (1 - β1^t) * m / (sqrt(v) / sqrt(1 - β2^t) + eps)``,
    computed in fp32 and rounded to the parameter's dtype once. Runs on the parameters' device; no host sync.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid AdamW hyper-parameters: lr={lr}, betas={betas}, eps={eps}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FP32StateAdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    # the step count lives on the CPU, as in torch's AdamW: reading it never syncs
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=_working(p))
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=_working(p))
                grad = p.grad.to(_working(p))
                w, copied = _fp32_view(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                state["step"] += 1
                step = float(state["step"])
                if wd != 0:
                    w.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias_correction1 = 1 - beta1**step
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                w.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
                if copied:
                    p.copy_(w)  # the one rounding to the storage dtype
        return loss


class FP32StateSGD(_RealFloating):
    """SGD with an fp32 momentum buffer for parameters of any floating dtype (no master weights).

    Same update as ``torch.optim.SGD`` (no dampening, no Nesterov): ``g += weight_decay * p``,
    ``buf = momentum * buf + g`` (``buf = g`` on the first step), ``p -= lr * buf``; computed in fp32 and
    rounded to the parameter's dtype once. No host sync.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"invalid SGD hyper-parameters: lr={lr}, momentum={momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad.to(_working(p))
                w, copied = _fp32_view(p)
                if wd != 0:
                    grad = grad.add(w, alpha=wd)
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = grad.detach().clone()
                        state["momentum_buffer"] = buf
                    else:
                        buf.mul_(momentum).add_(grad)
                    grad = buf
                w.add_(grad, alpha=-lr)
                if copied:
                    p.copy_(w)
        return loss

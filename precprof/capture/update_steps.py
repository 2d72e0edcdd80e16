"""Which of a sampled step's optimizer steps updated each tracked parameter: a step whose param group's learning
rate was 0 (a warmup from 0, a group frozen by ``lr=0``) moves none of its parameters and intends nothing, and
torch's optimizers skip a parameter that has no gradient at their step (a batch the loop skipped: Lightning's
``training_step`` returning None steps the optimizer after a ``zero_grad`` and no backward; a layer the step's
forward did not reach under ``zero_grad(set_to_none=True)``).

The ``weight_update`` rows' ``calls`` are these counts: the optimizer steps with a nonzero learning rate and a
gradient that the row's update adds up, summed over the ranks as every row's ``calls`` are (``updates.combined``;
0: the row's parameter was idle on every one of them, and its update-to-weight ratio of 0 says nothing of how the
layer trains). Read on the host from the param groups (the
learning rate in the optimizer's pre-hook, the gradients in its post-hook, once a closure has made them) of a
sampled step: nothing on an unsampled step, no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def idle_params(optimizer: Any) -> set[int]:
    """The ids of ``optimizer``'s parameters whose group's learning rate is 0 now (a warmup from 0 starts
    there): its step moves none of them, and an update that is not made is not lost to any format. A learning
    rate the host cannot read without a sync (a device tensor) counts as not 0."""
    idle: set[int] = set()
    for group in getattr(optimizer, "param_groups", ()):
        lr = group.get("lr") if isinstance(group, dict) else None
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu" or lr.numel() != 1:
                continue
            lr = float(lr)
        if isinstance(lr, (int, float)) and lr == 0:
            idle.update(id(p) for p in group["params"])
    return idle


def without_gradient(optimizer: Any) -> set[int]:
    """The ids of ``optimizer``'s parameters that have no gradient now (``p.grad is None``; host only): read after
    its step, those it skipped."""
    return {
        id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"] if p.grad is None
    }


class OptimizerSteps:
    """Per tracked parameter (in the sampler's order), the sampled step's optimizer steps that updated it."""

    def __init__(self, tensors: Sequence[torch.Tensor], owners: Sequence[int]) -> None:
        self._owners = np.asarray(owners, dtype=np.int64)
        self._at = {id(t): i for i, t in enumerate(tensors)}
        self.counts = np.zeros(len(self._owners), dtype=np.int64)

    def reset(self) -> None:
        self.counts[:] = 0

    def step(self, k: int, idle: set[int]) -> None:
        """Optimizer ``k`` stepped, its parameters in ``idle`` (ids) not updated (a learning rate of 0, no
        gradient)."""
        self.counts[self._owners == k] += 1
        for pid in idle:
            i = self._at.get(pid)
            if i is not None and self._owners[i] == k:
                self.counts[i] -= 1

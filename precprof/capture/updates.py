"""Weight-update samples: what the optimizer meant to change in a strided sample of each parameter, what
landed, and how much a weight held in bf16 or fp16 loses.

On a sampled step the samples (and their gradients) are read before ``optimizer.step()`` (its pre-hook) and
the samples again after it (its post-hook), all parameters in one concatenated fp32 tensor. An element's
update was *intended* when its gradient is nonzero or its weight moved (weight decay, momentum); it *landed*
when the weight moved. Per sampled element, without a sync:

- no update: nothing intended and nothing moved (the ``zeros`` column);
- lost in bf16: an update that landed in an fp32 weight but would round away in bf16 (the weight held in
  bf16, plus the same delta, rounds back to itself), or an intended update that did not land at all: in a
  ``bf16-pure`` run that is the update bf16 really lost (a lost update arrives as a zero delta, so counting
  zero deltas as "no update" would hide every one of them);
- lost in fp16: the same for fp16 (an intended update that did not land in a bf16 weight says nothing about
  fp16, which is finer, so it counts only for fp32 and fp16 weights).

The counts go into a small int64 buffer with one ``index_add_``. The gradient is a lower bound of intent: an
element with a zero gradient whose momentum update did not land is not seen.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from precprof import tables as T
from precprof.capture.records import _local, _ParamSlot


class UpdateSampler:
    """Samples ``per_param`` elements (strided) of each parameter in ``tracked`` on ``device``."""

    def __init__(self, tracked: list[_ParamSlot], per_param: int, device: torch.device) -> None:
        for i, ps in enumerate(tracked):
            n = _local(ps.tensor.detach()).numel()
            ps.sample_stride = max(1, -(-n // per_param))
            ps.sample_len = len(range(0, n, ps.sample_stride))
            ps.update_index = i
        self.tracked = tracked
        # columns: sampled elements, zero updates, lost in bf16, lost in fp16
        self.counts = torch.zeros((max(len(tracked), 1), 4), dtype=torch.int64, device=device)
        lens = torch.tensor([ps.sample_len for ps in tracked], dtype=torch.int64)
        self._seg = torch.repeat_interleave(torch.arange(len(tracked)), lens).to(device)  # parameter of each
        self._lens = lens.to(device)
        self._before: torch.Tensor | None = None
        self._intended: torch.Tensor | None = None
        # per sampled element: whether its weight is held in bf16 (a stuck update then says nothing of fp16)
        self._held_bf16 = torch.repeat_interleave(
            torch.tensor([ps.tensor.dtype == torch.bfloat16 for ps in tracked], dtype=torch.bool), lens
        ).to(device)

    @property
    def nbytes(self) -> int:
        """Device bytes held for the whole run: the counts and the index of every sampled element."""
        return self.counts.numel() * self.counts.element_size() + sum(
            ps.sample_len * 4 for ps in self.tracked
        )

    def reset(self) -> None:
        self.counts.zero_()

    def _samples(self) -> torch.Tensor:
        return torch.cat(
            [
                _local(ps.tensor.detach()).reshape(-1)[:: ps.sample_stride][: ps.sample_len].float()
                for ps in self.tracked
            ]
        )

    def _grad_nonzero(self, like: torch.Tensor) -> torch.Tensor:
        """Per sampled element, whether its gradient is nonzero (False where a parameter has no gradient)."""
        parts = []
        for ps in self.tracked:
            g = ps.tensor.grad
            if g is None:
                parts.append(torch.zeros(ps.sample_len, dtype=torch.bool, device=like.device))
            else:
                parts.append(_local(g.detach()).reshape(-1)[:: ps.sample_stride][: ps.sample_len] != 0)
        return torch.cat(parts)

    def before_step(self) -> None:
        """Read the samples before the optimizer step."""
        if self.tracked:
            self._before = self._samples()
            if self._before.device != self.counts.device:
                # the model moved after attach() (``.cuda()`` after the Profiler): the counts follow, once
                self.counts = self.counts.to(self._before.device)
                self._seg = self._seg.to(self._before.device)
                self._lens = self._lens.to(self._before.device)
                self._held_bf16 = self._held_bf16.to(self._before.device)
            self._intended = self._grad_nonzero(self._before)

    @torch.no_grad()
    def after_step(self) -> bool:
        """Classify the updates of the step just taken; False when ``before_step`` did not run."""
        before, self._before = self._before, None
        intended, self._intended = self._intended, None
        if before is None or intended is None:
            return False
        delta = self._samples() - before
        nonzero = delta != 0
        stuck = intended & ~nonzero  # meant to move, did not
        flags = torch.empty((len(before), 3), dtype=torch.int64, device=before.device)
        flags[:, 0] = ~(nonzero | intended)
        for col, dtype in ((1, torch.bfloat16), (2, torch.float16)):
            held = before.to(dtype)
            landed_but_lost = ((held.float() + delta).to(dtype) == held) & nonzero
            flags[:, col] = landed_but_lost | (stuck if dtype == torch.bfloat16 else stuck & ~self._held_bf16)
        self.counts[:, 0] += self._lens
        self.counts[:, 1:].index_add_(0, self._seg, flags)
        return True

    def rows(
        self, counts: Any, step: int, order: dict[str, int], module_type: dict[str, str]
    ) -> list[dict[str, Any]]:
        """``weight_update`` rows of the layers table from ``counts`` (``self.counts`` on the host, reduced
        over ranks when distributed); parameters with no sampled element are left out."""
        out: list[dict[str, Any]] = []
        for ps in self.tracked:
            n, zeros, lost_bf16, lost_fp16 = (int(v) for v in counts[ps.update_index])
            if n == 0:
                continue
            rec: dict[str, Any] = {c: 0 for c in T.COUNT_COLUMNS}
            rec.update(
                {
                    T.STEP: step,
                    T.ORDER: order.get(ps.module, -1),
                    T.MODULE: ps.module,
                    T.MODULE_TYPE: module_type.get(ps.module, ""),
                    T.TENSOR: T.WEIGHT_UPDATE,
                    T.PARAM: ps.param,
                    T.DTYPE: str(ps.tensor.dtype).removeprefix("torch."),
                    T.CALLS: 1,
                    T.NUMEL: n,
                    T.ZEROS: zeros,
                    T.ABSMAX: math.nan,
                    T.ABSMIN: math.nan,
                    T.SCALE: 1.0,
                    T.LOST_UPDATE_BF16: lost_bf16,
                    T.LOST_UPDATE_FP16: lost_fp16,
                }
            )
            out.append(rec)
        return out

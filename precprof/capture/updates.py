"""Weight-update samples: what the optimizer changed in a strided sample of each parameter, and how much of it
a weight held in bf16 or fp16 would have lost.

On a sampled step the samples are read before ``optimizer.step()`` (its pre-hook) and after it (its
post-hook), all parameters in one concatenated fp32 tensor. Per sampled element the delta is classified
without a sync: zero update, lost in bf16 (the weight held in bf16, plus the same delta in fp32, rounds back to
itself), lost in fp16; the counts go into a small int64 buffer with one ``index_add_``.
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

    def before_step(self) -> None:
        """Read the samples before the optimizer step."""
        if self.tracked:
            self._before = self._samples()
            if self._before.device != self.counts.device:
                # the model moved after attach() (``.cuda()`` after the Profiler): the counts follow, once
                self.counts = self.counts.to(self._before.device)
                self._seg = self._seg.to(self._before.device)
                self._lens = self._lens.to(self._before.device)

    @torch.no_grad()
    def after_step(self) -> bool:
        """Classify the updates of the step just taken; False when ``before_step`` did not run."""
        before, self._before = self._before, None
        if before is None:
            return False
        delta = self._samples() - before
        nonzero = delta != 0
        flags = torch.empty((len(before), 3), dtype=torch.int64, device=before.device)
        flags[:, 0] = ~nonzero
        for col, dtype in ((1, torch.bfloat16), (2, torch.float16)):
            held = before.to(dtype)
            flags[:, col] = ((held.float() + delta).to(dtype) == held) & nonzero
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

"""Counting what precprof counts, independently: forward and tensor hooks that only read, and real casts.

``CastCounts(model, types, step, sample_every)`` registers a forward hook on every module of ``types``; on the
steps ``step()`` says are sampled (``step() % sample_every == 0``, grad enabled: evaluation passes are not
training), it counts the module's output and, through a tensor hook, the gradient of that output: elements,
zeros, values that a cast to fp16 or bf16 turns to 0 or to inf, the largest finite magnitude. ``seen`` maps
(step, module, tensor kind) to those counts, keyed by precprof's column names, for comparison with its layers
table (``compare``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
import torch

from precprof import tables as T


def counts(x: torch.Tensor) -> dict[str, float]:
    x = x.detach().float()
    finite = torch.isfinite(x)
    nz = (x != 0) & finite
    half, b16 = x.to(torch.float16), x.to(torch.bfloat16)
    return {
        T.NUMEL: x.numel(),
        T.ZEROS: int((x == 0).sum()),
        T.underflow_col("fp16"): int((nz & (half == 0)).sum()),
        T.overflow_col("fp16"): int((finite & torch.isinf(half)).sum()),
        T.underflow_col("bf16"): int((nz & (b16 == 0)).sum()),
        T.overflow_col("bf16"): int((finite & torch.isinf(b16)).sum()),
        T.ABSMAX: float(x[finite].abs().max()) if bool(finite.any()) else float("nan"),
    }


class CastCounts:
    def __init__(
        self, model: torch.nn.Module, types: tuple[type, ...], step: Callable[[], int], sample_every: int
    ) -> None:
        self.seen: dict[tuple[int, str, str], dict[str, float]] = {}
        self.step, self.sample_every = step, sample_every
        for name, mod in model.named_modules():
            if isinstance(mod, types):
                mod.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(mod: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            step = self.step()
            if not torch.is_grad_enabled() or step % self.sample_every:
                return
            self.seen[(step, name, T.ACTIVATION)] = counts(out)

            def grad_hook(g: torch.Tensor) -> None:  # reads the gradient; returns None: changes nothing
                self.seen[(step, name, T.ACTIVATION_GRAD)] = counts(g)

            out.register_hook(grad_hook)

        return hook

    def compare(self, layers: pd.DataFrame) -> int:
        """Assert precprof's row of every (step, module, kind) seen has the same counts; returns how many values
        a cast to fp16 flushed among them (a comparison that covers more than zeros)."""
        flushed = 0
        for (step, module, tensor), want in self.seen.items():
            row = layers[
                (layers[T.STEP] == step) & (layers[T.MODULE] == module) & (layers[T.TENSOR] == tensor)
            ]
            assert len(row) == 1, (step, module, tensor)
            got = {c: float(row.iloc[0][c]) for c in want}
            assert got == {c: float(v) for c, v in want.items()}, (step, module, tensor)
            flushed += int(want[T.underflow_col("fp16")])
        return flushed

"""What the Profiler keeps per buffer row, module, parameter and pending step, and the small helpers its hooks
and flush share."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

MAX_PENDING_STEPS = 256  # steps kept on the device between flushes when sampling is rare or off


@dataclass
class _Row:
    """Host-side description of one buffer row."""

    index: int
    module: str
    module_type: str
    tensor: str
    param: str = ""
    calls: int = 0
    dtypes: list[str] = field(default_factory=list)

    def seen(self, dtype: torch.dtype) -> None:
        self.calls += 1
        name = str(dtype).removeprefix("torch.")
        if name not in self.dtypes:
            self.dtypes.append(name)


@dataclass
class _ModuleSlot:
    name: str
    module: nn.Module
    activation: _Row
    activation_grad: _Row
    weights: list[tuple[str, nn.Parameter, _Row]]
    order: int = -1
    called: bool = False
    block_group: int = (
        0  # the sampled steps whose block-format what-if reads this module's operands (hooks.py)
    )
    # a linear layer's input when no captured module produced it (T.input_module), with block formats on
    input: _Row | None = None
    input_order: int = -1  # its place in forward order: just before the layer's own


@dataclass
class _ParamSlot:
    module: str
    param: str
    tensor: nn.Parameter
    grad_row: _Row | None
    update_index: int  # row in the weight-update buffer (-1: not tracked)
    sample_stride: int = 1
    sample_len: int = 0


@dataclass
class _PendingStep:
    step: int
    loss: torch.Tensor | float | None
    scale: torch.Tensor | float
    found_inf: torch.Tensor | None
    grad_norm: torch.Tensor | float | None
    time_s: float
    sampled: bool
    tokens: int | None


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2, tensor parallel); any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _iter_tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Floating tensors inside a module output (tensor, tuple/list, dict, ModelOutput), depth-limited."""
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            yield obj
        return
    if depth > 3:
        return
    if isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _iter_tensors(o, depth + 1)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _iter_tensors(o, depth + 1)


class HostFloats:
    """Python floats of a mix of None, numbers and 0-dim device tensors: the tensors are stacked (as float64,
    on the first one's device) into :attr:`device`, which the caller copies to the host with the rest of
    its data, then hands to :meth:`values`."""

    def __init__(self, values: list[Any]) -> None:
        self._out = [
            math.nan if v is None else (math.nan if isinstance(v, torch.Tensor) else float(v)) for v in values
        ]
        self._idx = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        self.device: torch.Tensor | None = None
        if self._idx:
            dev = values[self._idx[0]].device
            self.device = torch.stack(
                [values[i].detach().reshape(()).to(dev, torch.float64) for i in self._idx]
            )

    def values(self, host: np.ndarray | None) -> list[float]:
        """The floats, ``host`` being the host copy of :attr:`device` (None when that is None)."""
        out = list(self._out)
        if host is not None:
            for i, v in zip(self._idx, host.tolist(), strict=True):
                out[i] = float(v)
        return out


def _join_columns(parts: list[dict[str, Any]]) -> pd.DataFrame:
    """One frame from column dicts (arrays or lists, equal keys within a part), in order; a column missing
    from a part is NaN there."""
    names: list[str] = []
    for part in parts:
        names.extend(c for c in part if c not in names)
    out: dict[str, Any] = {}
    for c in names:
        pieces = []
        for part in parts:
            n = len(next(iter(part.values())))
            v = part.get(c)
            pieces.append(np.full(n, math.nan) if v is None else np.asarray(v))
        out[c] = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
    return pd.DataFrame(out)

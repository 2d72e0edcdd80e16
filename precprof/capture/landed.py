"""A step's loss and GradScaler skip flag on their way to the host without a sync, for the budgeted sampler's
triggers (a non-finite loss, a skipped step, a loss spike: ``capture/sampling.py``)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any


class LandedValues:
    """A step's loss and skip flag on their way to the host without a sync: CPU values are read at once; a
    device's are copied into pinned memory by a non-blocking copy behind an event, and handed out once the
    event has completed (``event.query()``, which never waits). At most ``capacity`` copies in flight (older
    ones are dropped: a trigger is a hint, never a count)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._flight: deque[tuple[Any, Any]] = deque()

    def put(self, loss: Any, found_inf: Any) -> list[tuple[float, bool]]:
        """Send one step's values; returns every step's values that have landed, oldest first."""
        if found_inf is None and not self._flight and (loss is None or isinstance(loss, float)):
            return [] if loss is None else [(loss, False)]  # a CPU loss, read already (no import, no tensor)
        import torch

        values = [v for v in (loss, found_inf) if isinstance(v, torch.Tensor)]
        landed = self.take()
        if not values:
            if loss is not None:
                landed.append((float(loss), False))
            return landed
        dev = values[0].device
        if dev.type != "cuda":
            loss_v = (
                float(loss) if isinstance(loss, torch.Tensor) else (math.nan if loss is None else float(loss))
            )
            skipped = bool(found_inf is not None and float(found_inf) > 0)
            landed.append((loss_v, skipped))
            return landed
        pair = torch.stack(
            [
                (loss.detach().reshape(()).to(dev, torch.float64) if isinstance(loss, torch.Tensor)
                 else torch.full((), math.nan if loss is None else float(loss), dtype=torch.float64, device=dev)),
                (found_inf.detach().reshape(()).to(dev, torch.float64) if isinstance(found_inf, torch.Tensor)
                 else torch.zeros((), dtype=torch.float64, device=dev)),
            ]
        )  # fmt: skip
        host = torch.empty(2, dtype=torch.float64, pin_memory=True)
        host.copy_(pair, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        if len(self._flight) >= self.capacity:
            self._flight.popleft()
        self._flight.append((event, host))
        return landed

    def take(self) -> list[tuple[float, bool]]:
        """The values whose copy has completed, oldest first (never waits)."""
        out = []
        while self._flight and self._flight[0][0].query():
            _, host = self._flight.popleft()
            loss, found = host.tolist()
            out.append((loss, found > 0 or math.isnan(found)))
        return out

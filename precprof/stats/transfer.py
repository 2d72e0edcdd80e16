"""Device-to-host copies, one per device.

A sampled step's data (the statistics rows and block accumulator of every device, the weight-update counts,
the pending steps' loss, scale and norm scalars) lives in several small device tensors. Copying each on its
own costs one host synchronisation apiece; :func:`to_host` packs the tensors of each device as raw bytes into
one buffer (one kernel on the device), copies that once, and views the bytes back on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# the dtypes a packed copy can carry: their numpy twins have the same byte layout
_NUMPY = {
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.float64: np.float64,
    torch.float32: np.float32,
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
}

copies = 0  # device-to-host transfers made so far (the tests count them)


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The raw bytes of ``tensors`` (one device), one after another in one uint8 tensor (one kernel)."""
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _unpack(host: np.ndarray, tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Arrays shaped and typed like ``tensors`` from ``host``, the host copy of their ``_pack``."""
    out: list[np.ndarray] = []
    at = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append(host[at : at + n].view(_NUMPY[t.dtype]).reshape(tuple(t.shape)))
        at += n
    return out


def to_host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Host copies of ``tensors`` (shapes and dtypes kept), with one device-to-host transfer per device.

    This is the synchronising call of a sampled step: it waits for the device work that produced the tensors.
    CPU tensors are copied on the host (the arrays never alias a buffer that is reset later). Each tensor's
    dtype must be one of int64, int32, float64, float32, bool or uint8.
    """
    global copies
    out: list[np.ndarray | None] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.dtype not in _NUMPY:
            raise TypeError(f"precprof: cannot copy a {t.dtype} tensor in a packed transfer")
        by_device.setdefault(t.device, []).append(i)
    for device, idx in by_device.items():
        group = [tensors[i] for i in idx]
        if device.type == "cpu":
            arrays = [t.detach().numpy().copy() for t in group]
        else:
            host = _pack(group).cpu().numpy()  # the sync: one transfer for everything on this device
            copies += 1
            arrays = _unpack(host, group)
        for i, a in zip(idx, arrays, strict=True):
            out[i] = a
    return [a for a in out if a is not None]

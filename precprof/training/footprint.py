"""Will this run fit in memory? An estimate made before the first step, so that a run too large for the
machine is refused with the sizes to change instead of being killed by the out-of-memory killer.

The estimate adds what training holds at its peak:

- parameters and gradients, as they are stored (their dtype: fp32, or 16-bit in the pure modes);
- optimizer states: AdamW keeps two fp32 tensors per trainable parameter, SGD with momentum one (precprof's
  optimizers for the pure modes keep theirs in fp32 too);
- saved activations, *measured*: one forward pass and loss at batch size 1 and the run's sequence length,
  in the run's precision (autocast included), counting every tensor autograd saves for backward once per
  storage (``saved_tensors_hooks``), parameters excluded; then times the batch size, plus a quarter for the
  backward pass's temporaries (``BACKWARD_TEMPORARIES``). This works for any model,
  a user's own factory included. The measuring pass runs with the random state forked and the module buffers
  restored, so training is exactly what it would have been without it.

The total is a lower bound (the allocator's fragmentation and the backward pass's temporaries come on top), so a
refusal is never wrong; the run is refused when it exceeds 90% of the memory available: on CUDA what
``torch.cuda.mem_get_info`` says is free, on the CPU ``MemAvailable`` (bounded by a cgroup limit when one is
set). Where neither can be read, nothing is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from precprof.errors import UserError

HEADROOM = 0.9  # refuse above this share of the available memory
# The backward pass allocates the gradients of the activations while the saved ones are alive: measured on
# gpt-mini (CPU, fp32, batch 16 and 64 x 256) a step's resident memory above the fixed parts was 1.4-1.6x the
# saved activations. A quarter keeps the estimate below what a run really takes.
BACKWARD_TEMPORARIES = 0.25
GiB = 2.0**30


@dataclass(frozen=True)
class Footprint:
    """Bytes a training run needs at least, by part; ``activations_per_sample`` is measured at batch 1."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations_per_sample: int
    batch_size: int

    @property
    def activations(self) -> int:
        """Saved activations of the whole batch and the backward pass's temporaries beside them."""
        return int(self.activations_per_sample * (1 + BACKWARD_TEMPORARIES)) * self.batch_size

    @property
    def fixed(self) -> int:
        """What does not grow with the batch."""
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> int:
        return self.fixed + self.activations

    def largest_batch(self, available: int) -> int:
        """The largest batch size whose estimate stays under ``HEADROOM`` of ``available`` (0: none)."""
        room = HEADROOM * available - self.fixed
        if room <= 0:
            return 0
        return int(room // max(self.activations_per_sample * (1 + BACKWARD_TEMPORARIES), 1))


def _sizes(n: float) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= 0.1 * GiB else f"{n / 2**20:,.0f} MiB"


def available_bytes(device: torch.device) -> int | None:
    """Memory this process can still take on ``device``; None when it cannot be read here."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < (1 << 60):
                left = int(limit) - int(Path(usage_file).read_text().strip())
                avail = left if avail is None else min(avail, left)
                break
    return avail


def saved_activation_bytes(model: nn.Module, forward_loss: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward while ``forward_loss()`` runs (each storage once,
    the model's parameters excluded). The graph is dropped afterwards; nothing is trained."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        with contextlib.suppress(RuntimeError):  # tensors without storage (meta, some subclasses)
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in params and key not in seen:
                seen.add(key)
                total += st.nbytes()
        return t

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    devices = [d for d in {p.device for p in model.parameters()} if d.type == "cuda"]
    try:
        with (
            torch.random.fork_rng(devices=devices),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            loss = forward_loss()
        del loss
    finally:
        with torch.no_grad():  # BatchNorm's running statistics as they were
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
    return total


def estimate(
    model: nn.Module,
    *,
    batch_size: int,
    optimizer: str,
    forward_loss_one: Callable[[], torch.Tensor],
) -> Footprint:
    """The footprint of training ``model`` at ``batch_size``; ``forward_loss_one()`` runs the forward pass and
    the loss on one sample, in the run's precision."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in trainable)
    states_per_param = 2 if optimizer == "adamw" else 1
    state_bytes = states_per_param * 4 * sum(p.numel() for p in trainable)
    per_sample = saved_activation_bytes(model, forward_loss_one)
    return Footprint(param_bytes, grad_bytes, state_bytes, per_sample, batch_size)


def check_fits(fp: Footprint, available: int | None, *, what: str, where: str) -> None:
    """UserError, one line, when ``fp`` exceeds ``HEADROOM`` of ``available`` (None: nothing to check)."""
    if available is None or fp.total <= HEADROOM * available:
        return
    fits = fp.largest_batch(available)
    fix = (
        f"use --batch-size {fits} or less, or a shorter --seq-len"
        if fits >= 1
        else "the model alone does not fit: choose a smaller model (--model-arg) or a machine with more memory"
    )
    raise UserError(
        f"{what} needs at least {_sizes(fp.total)} to train (parameters {_sizes(fp.parameters)}, gradients "
        f"{_sizes(fp.gradients)}, optimizer states {_sizes(fp.optimizer_states)}, activations "
        f"{_sizes(fp.activations)}) but {where} has {_sizes(available)} available: {fix}"
    )


def describe(fp: Footprint) -> dict[str, Any]:
    """The estimate for summary.json's configuration block."""
    return {
        "parameters": fp.parameters,
        "gradients": fp.gradients,
        "optimizer_states": fp.optimizer_states,
        "activations": fp.activations,
        "total": fp.total,
        "note": "a lower bound measured before training: saved activations at batch 1 times the batch, plus "
        f"{BACKWARD_TEMPORARIES:.0%} for backward's temporaries",
    }

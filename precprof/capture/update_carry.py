"""Optimizers that carry the remainder of an update their weight could not take: Kahan summation of the weight
update (a compensation buffer per parameter, Lv et al.'s "Kahan summation" for bf16 weights, optimi's
``kahan_sum``) and stochastic rounding of the updated weight (torchao's ``_AdamW(..., bf16_stochastic_round=
True)``). With such an optimizer an update smaller than half an ulp of a bf16 weight leaves the weight unchanged
on its step (the ``weight_update`` rows count it so, as they should), but it is not lost: the buffer keeps it
until the sum lands, and stochastic rounding lands it in expectation.

What tells such an optimizer, recorded in the capture summary's ``optimizer.carries`` (``describe``):

- a setting that says so: ``bf16_stochastic_round`` (torchao's low-bit and plain AdamW keep it on the optimizer
  itself, not in its param groups; a param group's or the defaults' is read too);
- per-parameter state entries of the parameter's shape that are none of the moments torch's own optimizers keep
  (``TORCH_STATE_KEYS``), by key: a Kahan compensation buffer is one (named as its author likes: ``comp``,
  ``kahan_comp``, ``compensation``);
- measured (``CarryProbe``), for such an entry: on sampled steps, a strided sample of the weight and of the entry
  read before and after the optimizer step (in its hooks, which precprof installs on sampled steps only): how many
  of the entry's elements are within half an ulp of their weight in the weight's dtype (a remainder always is), of
  each sign, and, where the weight did not move, whether the entry changed (it kept the update). Counted on the
  device, read when the summary is made; ``analysis/carried_updates.py`` judges the counts.

Which entries an optimizer keeps is read once per optimizer (its first step with a state), on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Per-parameter state entries of a parameter's shape that torch's own optimizers keep (torch/optim/*.py, torch
# 2.13: every optimizer stepped twice on a 2-D and a 1-D parameter, tests/test_lost_updates_carried.py): moments,
# accumulators and step sizes, none a remainder of the weight's update. torchao's low-bit Adams use the same names.
TORCH_STATE_KEYS = frozenset(
    {
        "exp_avg",  # Adam, AdamW, Adamax, NAdam, RAdam, SparseAdam
        "exp_avg_sq",  # Adam, AdamW, NAdam, RAdam, SparseAdam
        "max_exp_avg_sq",  # Adam, AdamW (amsgrad)
        "exp_inf",  # Adamax
        "square_avg",  # Adadelta, RMSprop
        "acc_delta",  # Adadelta
        "grad_avg",  # RMSprop (centered)
        "momentum_buffer",  # SGD, RMSprop, Muon
        "sum",  # Adagrad
        "prev",  # Rprop
        "step_size",  # Rprop
        "ax",  # ASGD
        "variance",  # Adafactor (a 1-D parameter)
        "d",  # LBFGS (flat over every parameter: of one 1-D parameter's shape)
        "prev_flat_grad",  # LBFGS
    }
)
# bitsandbytes' optimizers (transformers' "paged_adamw_32bit", "adamw_bnb_8bit") keep their moments as ``state1`` and
# ``state2``: moments too, none a remainder
OTHER_MOMENT_KEYS = frozenset({"state1", "state2"})
STOCHASTIC_ROUND = (
    "bf16_stochastic_round"  # torchao.optim's setting (adam.py: ``self.bf16_stochastic_round``)
)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PER_PARAM = 256  # sampled elements of each probed parameter
_MAX_PARAMS = 32  # probed parameters of each optimizer and state entry


def stochastic_round(optimizer: Any) -> bool:
    """Whether ``optimizer`` rounds its bf16 weights stochastically (torchao's ``bf16_stochastic_round``, on the
    optimizer, in a param group or in its defaults). Host only."""
    places = [optimizer, *getattr(optimizer, "param_groups", ()), getattr(optimizer, "defaults", None)]
    for place in places:
        value = (
            place.get(STOCHASTIC_ROUND) if isinstance(place, dict) else getattr(place, STOCHASTIC_ROUND, None)
        )
        if value is True:
            return True
    return False


def _params(optimizer: Any) -> list[Any]:
    return [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"]]


def _plain(t: Any) -> bool:
    return type(t) in _PLAIN and t.is_contiguous()


def unknown_state(optimizer: Any) -> dict[str, list[Any]]:
    """Per state key beyond ``TORCH_STATE_KEYS``, the parameters of ``optimizer`` whose state holds a tensor of their
    shape under it (host only: keys and shapes, one walk over the parameters)."""
    state = getattr(optimizer, "state", None)
    if not isinstance(state, dict) or not state:
        return {}
    found: dict[str, list[Any]] = {}
    for p in _params(optimizer):
        entries = state.get(p)
        if not isinstance(entries, dict):
            continue
        for key, value in entries.items():
            if (
                isinstance(key, str)
                and key not in TORCH_STATE_KEYS
                and key not in OTHER_MOMENT_KEYS
                and isinstance(value, torch.Tensor)
                # (torch's "step" of a 0-dim parameter is of its shape, NAdam's "mu_product" too)
                and value.dim() > 0
                and value.shape == p.shape
                and value.is_floating_point()
            ):
                found.setdefault(key, []).append(p)
    return found


_PRECISION = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24, torch.float64: 53}  # significand bits
COUNTS = ("elements", "within_half_ulp", "positive", "negative", "held", "held_changed")


class _Probed:
    """One optimizer's entries under probe: per key, the parameters read (plain, contiguous, on ``device``, of a
    float dtype), each sampled element's significand bits (of its weight's dtype), and the counts ([keys, 6] int64
    on ``device``, in ``COUNTS``' order)."""

    def __init__(self, keys: dict[str, list[Any]]) -> None:
        self.keys = sorted(keys)
        plain = {
            k: [p for p in ps if _plain(p) and p.numel() and p.dtype in _PRECISION] for k, ps in keys.items()
        }
        first = next((ps[0] for ps in plain.values() if ps), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.params = {k: [p for p in plain[k] if p.device == self.device][:_MAX_PARAMS] for k in self.keys}
        self.bits = {
            k: torch.cat(
                [torch.full((len(_sample(p)),), _PRECISION[p.dtype], dtype=torch.int32) for p in ps]
            ).to(self.device)
            if ps
            else None
            for k, ps in self.params.items()
        }
        self.counts = torch.zeros((len(self.keys), len(COUNTS)), dtype=torch.int64, device=self.device)
        self.before: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None


def _sample(t: torch.Tensor) -> torch.Tensor:
    """A strided sample of ``t``'s elements, a view (``t`` plain and contiguous)."""
    stride = max(1, t.numel() // _PER_PARAM)
    return t.detach().reshape(-1)[::stride][:_PER_PARAM]


class CarryProbe:
    """Measures, on sampled steps, whether an optimizer's unknown same-shape state entries hold the remainder of the
    updates its weights could not take (see the module docstring). ``before`` and ``after`` run in the optimizer's
    pre- and post-hook: a few small ops on the device per probed entry, no sync; nothing for an optimizer whose state
    holds no unknown entry (torch's own)."""

    def __init__(self) -> None:
        self._probed: dict[int, _Probed | None] = {}  # id(optimizer) -> its probe (None: nothing to probe)

    def _read(self, optimizer: Any, probed: _Probed) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per key, the sampled weights and state entries now, in fp32 (new tensors); None where a parameter's entry
        is missing or no longer of its shape."""
        state = optimizer.state
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for key in probed.keys:
            params = probed.params[key]
            entries = [state.get(p, {}).get(key) for p in params]
            if not params or not all(
                isinstance(e, torch.Tensor) and _plain(e) and e.shape == p.shape and e.device == p.device
                for e, p in zip(entries, params, strict=True)
            ):
                out.append(None)
                continue
            out.append(
                (
                    torch.cat([_sample(p).float() for p in params]),
                    torch.cat([_sample(e).float() for e in entries]),
                )
            )
        return out

    def before(self, optimizer: Any) -> None:
        probed = self._probed.get(id(optimizer))
        if probed is not None:
            probed.before = self._read(optimizer, probed)

    @torch.no_grad()
    def after(self, optimizer: Any) -> None:
        """Count the step's entries (found at the first step with a state: probed from the next sampled step on):
        per sampled element, whether the entry is within half an ulp of its weight in the weight's dtype (a
        remainder the weight could not take is), its sign, and, where the weight did not move, whether the entry
        changed (it kept the update)."""
        key = id(optimizer)
        if key not in self._probed:
            if getattr(optimizer, "state", None):
                found = unknown_state(optimizer)
                self._probed[key] = _Probed(found) if found else None
            return
        probed = self._probed[key]
        if probed is None or probed.before is None:
            return
        before, probed.before = probed.before, None
        for i, (was, now) in enumerate(zip(before, self._read(optimizer, probed), strict=True)):
            bits = probed.bits[probed.keys[i]]
            if was is None or now is None or bits is None or len(bits) != len(now[0]):
                continue
            w, c = now
            # half an ulp of w: w = m * 2^e with 0.5 <= |m| < 1, an ulp 2^(e - bits)
            half = torch.exp2((torch.frexp(w).exponent - bits - 1).float())
            held = w == was[0]
            counts = [
                c.isfinite(),
                c.abs() <= half * 1.001,
                c > 0,
                c < 0,
                held,
                held & (c != was[1]),
            ]
            probed.counts[i] += torch.stack([x.sum() for x in counts])

    def measured(self, optimizer: Any) -> dict[str, dict[str, int]]:
        """Per probed key of ``optimizer``, its counts over the sampled steps (``COUNTS``; a sync: read when the
        summary is made, never in a hook)."""
        probed = self._probed.get(id(optimizer))
        if probed is None:
            return {}
        rows = probed.counts.tolist()
        return {
            k: dict(zip(COUNTS, map(int, row), strict=True)) for k, row in zip(probed.keys, rows, strict=True)
        }


def describe(optimizers: Sequence[Any], probe: CarryProbe | None = None) -> list[dict[str, Any]]:
    """The capture summary's ``optimizer.carries``, where an optimizer rounds stochastically or keeps a state entry
    beyond torch's moments (empty else): every optimizer, in order, with its ``class``, the ``dtypes`` of the
    parameters it holds, ``bf16_stochastic_round`` (where set), ``state_keys`` (the unknown entries, by key) and
    ``measured`` (``CarryProbe``'s counts per key, where it probed them). Every one, so that the advisor tells the
    optimizers that carry from those that hold the same weights and do not."""
    out: list[dict[str, Any]] = []
    for optimizer in optimizers:
        entry: dict[str, Any] = {
            "class": type(optimizer).__name__,
            "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in _params(optimizer)}),
        }
        if stochastic_round(optimizer):
            entry[STOCHASTIC_ROUND] = True
        keys = sorted(unknown_state(optimizer))
        if keys:
            entry["state_keys"] = keys
            measured = probe.measured(optimizer) if probe is not None else {}
            if measured:
                entry["measured"] = measured
        out.append(entry)
    return out if any(STOCHASTIC_ROUND in e or "state_keys" in e for e in out) else []

"""Whether the optimizers that hold a run's 16-bit weights carry the remainder of an update the weight could not
take (the capture summary's ``optimizer.carries``, ``capture/update_carry.py``), for the ``*_lost_updates``
findings: with such an optimizer an update below half an ulp of its weight leaves the weight unchanged on its
step, yet it is not lost (a Kahan compensation buffer lands it once the sum reaches the weight's resolution;
stochastic rounding lands it in expectation).

How precprof knows, per optimizer: torchao's ``bf16_stochastic_round`` setting (bf16 weights only, as torchao
applies it), or a state entry beyond torch's moments measured to hold what a remainder is: on sampled steps, a
signed value within half an ulp of its weight in the weight's dtype in all but ``BOUNDED_SHARE`` of its sampled
elements, of both signs, and changed where the weight did not move, and named as a compensation buffer is
(``REMAINDER_NAMES``; one that is not is said as a caveat). An unknown entry that was not measured (no
sampled step read it) is a suspicion only: said as a caveat, naming its key; one measured that does not pass is
no remainder (a moment of the optimizer's own: never negative, or beyond half an ulp of the weight).

Pure dict reading; nothing here reads torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

BOUNDED_SHARE = 0.999  # a remainder is always within half an ulp (an fp32 buffer's own rounding: the slack)
SIGNED_SHARE = 0.05  # each sign's least share of the nonzero elements (a second moment is never negative)
MIN_ELEMENTS = 256  # sampled reads of an entry, over the run, before its measure counts
STOCHASTIC_ROUND = "bf16_stochastic_round"
# what a compensation buffer is named (optimi's "kahan_comp", "comp", "compensation", "carry", "remainder",
# "residual", "error"): an entry measured as a remainder that is named none of them leaves the finding as it is,
# with a caveat naming it: the measure alone does not tell it from a custom optimizer's first moment ("m") of
# gradients far below half an ulp of their weights, which passes it too
REMAINDER_NAMES = ("comp", "kahan", "carry", "remainder", "residual", "error")


@dataclass
class Carriers:
    """Of the optimizers holding weights of one dtype: ``carried``, (class, how it carries, in words) of each one
    that does; ``plain``, the classes of those that do not; ``suspects``, (class, key, why it was not measured) of
    the unknown entries that may be a remainder, unmeasured; ``lookalikes``, (class, key, what was measured) of the
    entries measured as a remainder whose name does not say they are one (``REMAINDER_NAMES``)."""

    carried: list[tuple[str, str]] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)
    suspects: list[tuple[str, str, str]] = field(default_factory=list)
    lookalikes: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def all_carried(self) -> bool:
        return bool(self.carried) and not self.plain


def _remainder(counts: Mapping[str, Any]) -> str | None:
    """The words on a measured entry that holds a remainder (``counts``: ``update_carry.COUNTS``), None where it
    does not show one."""
    n, within = int(counts.get("elements", 0)), int(counts.get("within_half_ulp", 0))
    pos, neg = int(counts.get("positive", 0)), int(counts.get("negative", 0))
    held, changed = int(counts.get("held", 0)), int(counts.get("held_changed", 0))
    if n < MIN_ELEMENTS or within < BOUNDED_SHARE * n or min(pos, neg) < SIGNED_SHARE * max(pos + neg, 1):
        return None
    if held and changed < 0.5 * held:
        return None
    return (
        f"on sampled steps {within:,} of its {n:,} sampled elements were within half an ulp of their weight, of "
        f"both signs ({pos:,} positive, {neg:,} negative), and it changed in {changed:,} of the {held:,} where the "
        "weight did not move"
    )


def _unmeasured(counts: Mapping[str, Any] | None) -> str | None:
    """Why an entry's measure says nothing (None where it does: one that does not show a remainder is none, a
    moment of the optimizer's own)."""
    n = int((counts or {}).get("elements", 0))
    if n >= MIN_ELEMENTS:
        return None
    return f"only {n:,} sampled elements of it were read" if n else "no sampled step read it"


def carriers(capture: Mapping[str, Any], dtype: str) -> Carriers:
    """What the capture summary says of the optimizers holding ``dtype`` weights (a dtype name: "bfloat16")."""
    settings = capture.get("optimizer")
    entries = settings.get("carries") if isinstance(settings, Mapping) else None
    out = Carriers()
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, Mapping) or dtype not in (entry.get("dtypes") or []):
            continue
        cls = str(entry.get("class", "the optimizer"))
        measured: Mapping[str, Any] = entry["measured"] if isinstance(entry.get("measured"), Mapping) else {}
        how = None
        if entry.get(STOCHASTIC_ROUND) is True and dtype == "bfloat16":
            how = (
                "rounds its bf16 weights stochastically (bf16_stochastic_round=True): an update below half an ulp "
                "moves its weight by an ulp with a probability in proportion to its size, so it lands in "
                "expectation over the steps"
            )
        keys = [str(k) for k in entry.get("state_keys") or []]
        lookalikes = []
        for key in keys:
            said = _remainder(measured.get(key) or {}) if how is None else None
            if said is not None and not any(name in key.lower() for name in REMAINDER_NAMES):
                lookalikes.append((cls, key, said))
            elif said is not None:
                how = (
                    f"keeps the remainder of each update in its state '{key}' and adds it to the next one (Kahan "
                    f"summation), which lands once the sum reaches the weight's resolution: {said}"
                )
        if how is not None:
            out.carried.append((cls, how))
            continue
        out.plain.append(cls)
        out.lookalikes.extend(lookalikes)
        out.suspects.extend(
            (cls, key, why) for key in keys if (why := _unmeasured(measured.get(key))) is not None
        )
    return out

"""The format windows drawn over the heatmaps: where each format's representable range starts and ends, in unscaled
log2 units, at the loss scale in effect (FP16 for gradients), at scale 1 (BF16), and for FP8 E4M3 and E5M2 under
per-tensor current scaling (each row of a heatmap its own window)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from precprof import formats
from precprof import tables as T
from precprof.report.plots.common import pow2_text


@dataclass(frozen=True)
class Window:
    """A format's representable window in unscaled log2 units: values at or below 2^lo vanish, at or above 2^hi
    overflow; between lo and normal_lo they are subnormal (fewer significant bits)."""

    key: str
    label: str
    lo: float
    normal_lo: float
    hi: float
    color: str
    style: str


def format_window(fmt: str, scale: float = 1.0, label: str | None = None, style: str = "-") -> Window:
    """Window of ``fmt`` for values multiplied by ``scale`` before the cast, in unscaled log2 |value|."""
    f = formats.get(fmt)
    ls = math.log2(scale) if scale > 0 else 0.0
    return Window(
        key=fmt,
        label=label or formats.label(fmt),
        lo=math.log2(f.underflow_max) - ls,
        normal_lo=math.log2(f.smallest_normal) - ls,
        hi=math.log2(f.overflow_min) - ls,
        color=formats.get(fmt).color,
        style=style,
    )


def heatmap_windows(
    kind: str, scale: float, recommended_scale: float | None = None, fp8_amax: float | None = None
) -> list[Window]:
    """Windows drawn over a heatmap of ``kind``: fp16 at the scale in effect (and at the recommended scale when
    that differs), bf16 at scale 1, e4m3 and e5m2 under per-tensor current scaling, the recipe the FP8 advice
    assumes: at the largest magnitude of the rows, ``fp8_amax`` (each row gets its own on the heatmap,
    ``analysis.current_scaling.row_windows``); at scale 1 when it is unknown."""
    scaled = kind in T.GRADIENT_KINDS
    s = scale if scaled else 1.0
    wins = [format_window("fp16", s, f"FP16 at scale {pow2_text(s)}" if scaled else "FP16")]
    if scaled and recommended_scale and recommended_scale > 0 and recommended_scale != s:
        rec = format_window("fp16", recommended_scale)
        wins.append(
            replace(
                rec, label=f"FP16 at recommended {pow2_text(recommended_scale)}", color="#7f0000", style=":"
            )
        )
    fp8 = {"fp8_e4m3": "--", "fp8_e5m2": (0, (5, 1, 1, 1))}
    wins.append(format_window("bf16", 1.0, style="-."))
    for fmt, style in fp8.items():
        ok = fp8_amax is not None and math.isfinite(fp8_amax) and fp8_amax > 0
        k = formats.current_scaling_exponent(formats.get(fmt), fp8_amax) if ok else 0  # type: ignore[arg-type]
        what = "current scaling, per row" if ok else "scale 1"
        wins.append(format_window(fmt, 2.0**k, f"{formats.label(fmt)} ({what})", style=style))  # type: ignore[arg-type]
    return wins

"""The advisor and the report never crash, whatever the tables hold: scales below 1 and above 2^64, inf and nan
extremes, all-NaN columns, zero numel, empty tables, summaries with keys missing.

Hypothesis builds the tables from the schema; each example must give a Recommendation that serialises to JSON
and a page that renders.
"""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from report_fixtures import gpt_layers, synthetic_run

from precprof import tables as T
from precprof.analysis import advisor
from precprof.analysis.advisor import text
from precprof.formats import FP8_FORMATS, WHATIF_FORMATS
from precprof.report import render_html

EXTREMES = [0.0, 2.0**-149, 2.0**-30, 1e-8, 1.0, 3.0, 65504.0, 1e30, 3.4e38, math.inf, math.nan]
SCALES = [2.0**-24, 2.0**-3, 0.75, 1.0, 3.0, 2.0**16, 2.0**40, 2.0**70]
MODULES = [("a", "Linear"), ("b", "LayerNorm"), ("c", "Conv1D"), ("d", "Embedding"), ("<x>", "Softmax")]
extreme = st.sampled_from(EXTREMES)


@st.composite
def layer_rows(draw: st.DrawFn) -> list[dict[str, object]]:
    rows = []
    for step in draw(st.lists(st.integers(0, 40), min_size=0, max_size=3, unique=True)):
        for order, (module, mtype) in enumerate(
            draw(st.lists(st.sampled_from(MODULES), max_size=4, unique=True))
        ):
            for tensor in draw(
                st.lists(st.sampled_from(T.TENSOR_KINDS), min_size=1, max_size=3, unique=True)
            ):
                numel = draw(st.sampled_from([0, 1, 7, 4096]))
                count = st.integers(0, numel)
                row: dict[str, object] = {
                    T.STEP: step,
                    T.ORDER: order,
                    T.MODULE: module,
                    T.MODULE_TYPE: mtype,
                    T.TENSOR: tensor,
                    T.PARAM: "" if tensor in (T.ACTIVATION, T.ACTIVATION_GRAD) else "weight",
                    T.DTYPE: draw(st.sampled_from(["float32", "bfloat16", "float16", "float8_e4m3fn"])),
                    T.CALLS: draw(st.integers(0, 3)),
                    T.NUMEL: numel,
                    T.ZEROS: draw(count),
                    T.NAN: draw(count),
                    T.INF: draw(count),
                    T.ABSMAX: draw(extreme),
                    T.ABSMIN: draw(extreme),
                    T.SCALE: draw(st.sampled_from(SCALES)) if tensor in T.GRADIENT_KINDS else 1.0,
                }
                for fmt in WHATIF_FORMATS:
                    row[T.underflow_col(fmt)] = draw(count)
                    row[T.overflow_col(fmt)] = draw(count)
                for fmt in FP8_FORMATS:
                    row[T.underflow_cs_col(fmt)] = draw(count)
                if tensor == T.WEIGHT_UPDATE:
                    row[T.LOST_UPDATE_BF16] = draw(count)
                    row[T.LOST_UPDATE_FP16] = draw(count)
                rows.append(row)
    return rows


@st.composite
def step_rows(draw: st.DrawFn) -> list[dict[str, object]]:
    n = draw(st.integers(0, 30))
    return [
        {
            T.STEP: i,
            T.LOSS: draw(st.sampled_from([5.5, 2.0, 0.0, math.nan, math.inf, -math.inf, 1e30])),
            T.LOSS_SCALE: draw(st.sampled_from([*SCALES, math.nan])),
            T.SKIPPED: draw(st.booleans()),
            T.GRAD_NORM: draw(extreme),
            T.TIME_S: draw(st.sampled_from([0.01, 0.0, math.nan])),
            T.SAMPLED: draw(st.booleans()),
            T.TOKENS: draw(st.sampled_from([512.0, math.nan])),
        }
        for i in range(n)
    ]


@st.composite
def summaries(draw: st.DrawFn) -> dict[str, object]:
    base: dict[str, object] = {}
    if draw(st.booleans()):
        base[T.SUMMARY_CONFIG] = {
            "precision": draw(st.sampled_from(["fp32", "bf16", "fp16", "fp16-pure", "fp8", "nonsense"])),
            "loss_scaling": draw(st.sampled_from(["dynamic", "none", "static"])),
        }
    if draw(st.booleans()):
        base[T.SUMMARY_MODEL] = {"n_params": draw(st.sampled_from([0, 1000, 10**9])), "dims": {"n_embd": 100}}
    if draw(st.booleans()):
        base[T.SUMMARY_STATUS] = draw(st.sampled_from([T.STATUS_COMPLETE, T.STATUS_INCOMPLETE]))
    return base


def tables_from(layers: list[dict[str, object]], steps: list[dict[str, object]]) -> dict[str, pd.DataFrame]:
    hist = [
        {
            T.STEP: r[T.STEP],
            T.MODULE: r[T.MODULE],
            T.TENSOR: r[T.TENSOR],
            T.PARAM: r[T.PARAM],
            T.EXPONENT: e,
            T.COUNT: 3,
        }
        for r in layers[:6]
        for e in (-140, -20, 0, 15, 127)
    ]
    return {
        "layers": T.frame("layers", pd.DataFrame(layers)) if layers else T.empty("layers"),
        "histograms": T.frame("histograms", pd.DataFrame(hist)) if hist else T.empty("histograms"),
        "steps": T.frame("steps", pd.DataFrame(steps)) if steps else T.empty("steps"),
        "memory": T.empty("memory"),
    }


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    layers=layer_rows(),
    steps=step_rows(),
    summary=summaries(),
    target=st.sampled_from([None, "t4", "h100", "cpu"]),
)
def test_the_advisor_and_the_report_never_crash(
    layers: list[dict[str, object]],
    steps: list[dict[str, object]],
    summary: dict[str, object],
    target: str | None,
) -> None:
    tabs = tables_from(layers, steps)
    rec = advisor.recommend(tabs, hardware=target, summary=summary)
    doc = rec.to_dict()
    json.dumps(doc, default=str)  # what summary.json stores
    assert isinstance(rec.describe(), str)
    assert isinstance(advisor.Recommendation.from_dict(doc).describe(), str)
    page = render_html(tabs, summary, rec)
    assert 'id="verdict"' in page


@pytest.mark.parametrize("k", [-1, -3, -16, -40])
def test_scales_below_one_are_written_out(k: int) -> None:
    """A run whose gradients are so large that the fp16 scale would go below 1 (the advisor used to recurse
    forever on it): the scale is written as the exact decimal GradScaler takes."""
    written = text._scale(k)
    assert float(written) == 2.0**k and text._pow2(k).startswith(f"2^{k} (")


def test_a_synthetic_run_with_a_nan_and_huge_gradients() -> None:
    tabs, summary = synthetic_run("fp16", layers=gpt_layers(n_layer=1), steps=6, sample_every=1, nan_at=4)
    grads = tabs["layers"][T.TENSOR].isin(T.GRADIENT_KINDS)
    tabs["layers"].loc[grads, T.ABSMAX] = 1e30  # the fp16 scale that avoids overflow would be 2^-86
    rec = advisor.recommend(tabs, summary=summary)
    json.dumps(rec.to_dict(), default=str)
    assert 'id="verdict"' in render_html(tabs, summary, rec)

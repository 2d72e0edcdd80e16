"""The advisor and the report never crash, whatever the tables hold: scales below 1 and above 2^64, inf and nan
extremes, all-NaN columns, zero numel, empty tables, summaries with keys missing.

Hypothesis builds the tables from the schema; each example must give a Recommendation that serialises to JSON
and a page that renders.
"""

from __future__ import annotations

import json
import math
import warnings

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
    """summary.json as the advisor may get it: sections missing, keys missing, values None or nonsense."""
    base: dict[str, object] = {}
    if draw(st.booleans()):
        base[T.SUMMARY_CONFIG] = {
            "precision": draw(
                st.sampled_from(["fp32", "bf16", "fp16", "fp16-pure", "fp8", "nonsense", None])
            ),
            "loss_scaling": draw(st.sampled_from(["dynamic", "none", "static", None])),
            **draw(
                st.dictionaries(
                    st.sampled_from(["growth_interval", "init_scale", "batch_size", "seq_len"]),
                    st.sampled_from([None, 0, -3, 1, 64, 2000, math.nan, "x"]),
                )
            ),
        }
    if draw(st.booleans()):
        base[T.SUMMARY_MODEL] = {
            "n_params": draw(st.sampled_from([0, 1000, 10**9, None, -1])),
            "dims": draw(st.sampled_from([{"n_embd": 100}, {}, None, {"n_embd": None, "n_head": 0}])),
        }
    if draw(st.booleans()):
        base[T.SUMMARY_CAPTURE] = draw(
            st.sampled_from(
                [
                    {},
                    {"autocast": None, "mixed_precision_requested": None, "modules": None},
                    {"autocast": {"enabled": False}, "mixed_precision_requested": "fp16"},
                    {"modules": [{"name": "a", "type": "Linear", "params": {"weight": [3, 5]}}, None]},
                ]
            )
        )
    if draw(st.booleans()):
        base[T.SUMMARY_STATUS] = draw(st.sampled_from([T.STATUS_COMPLETE, T.STATUS_INCOMPLETE]))
    return base


def drop(rows: list[dict[str, object]], columns: list[str]) -> list[dict[str, object]]:
    """``rows`` without ``columns``: ``tables.frame`` then fills them with NaN, as for an older run's table."""
    return [{k: v for k, v in r.items() if k not in columns} for r in rows]


def tables_from(layers: list[dict[str, object]], steps: list[dict[str, object]]) -> dict[str, pd.DataFrame]:
    keyed = [r for r in layers if all(k in r for k in (T.STEP, T.MODULE, T.TENSOR, T.PARAM))]
    hist = [
        {
            T.STEP: r[T.STEP],
            T.MODULE: r[T.MODULE],
            T.TENSOR: r[T.TENSOR],
            T.PARAM: r[T.PARAM],
            T.EXPONENT: e,
            T.COUNT: 3,
        }
        for r in keyed[:6]
        for e in (-140, -20, 0, 15, 127)
    ]
    return {
        "layers": T.frame("layers", pd.DataFrame(layers)) if layers else T.empty("layers"),
        "histograms": T.frame("histograms", pd.DataFrame(hist)) if hist else T.empty("histograms"),
        "steps": T.frame("steps", pd.DataFrame(steps)) if steps else T.empty("steps"),
        "memory": T.empty("memory"),
    }


def check(
    tabs: dict[str, pd.DataFrame], summary: dict[str, object], target: str | None
) -> advisor.Recommendation:
    """The invariants: a Recommendation whose dict is strict JSON (no NaN, no numpy scalars: what
    summary.json stores), which reads back, whose text is a string, and a report page that renders."""
    rec = advisor.recommend(tabs, hardware=target, summary=summary)
    assert isinstance(rec, advisor.Recommendation) and rec.format in advisor.FORMATS
    doc = rec.to_dict()
    json.dumps(doc, allow_nan=False)
    assert isinstance(rec.describe(), str)
    assert isinstance(advisor.Recommendation.from_dict(doc).describe(), str)
    page = render_html(tabs, summary, rec)
    assert 'id="verdict"' in page
    return rec


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    layers=layer_rows(),
    steps=step_rows(),
    summary=summaries(),
    target=st.sampled_from([None, "t4", "v100", "h100", "cpu"]),
    dropped_layers=st.lists(st.sampled_from(T.LAYERS_COLUMNS), max_size=3, unique=True),
    dropped_steps=st.lists(st.sampled_from(T.STEPS_COLUMNS), max_size=3, unique=True),
    no_finite_loss=st.booleans(),
)
def test_the_advisor_and_the_report_never_crash(
    layers: list[dict[str, object]],
    steps: list[dict[str, object]],
    summary: dict[str, object],
    target: str | None,
    dropped_layers: list[str],
    dropped_steps: list[str],
    no_finite_loss: bool,
) -> None:
    if no_finite_loss:
        steps = [{**r, T.LOSS: math.nan} for r in steps]
    check(tables_from(drop(layers, dropped_layers), drop(steps, dropped_steps)), summary, target)


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
    check(tabs, summary, None)


# Minimal examples of what the property test found (each crashed the advisor before it was fixed).
NAN_GRAD = {
    T.STEP: 14,
    T.ORDER: 0,
    T.MODULE: "a",
    T.MODULE_TYPE: "Linear",
    T.TENSOR: T.ACTIVATION_GRAD,
    T.PARAM: "",
    T.DTYPE: "float32",
    T.NUMEL: 1,
    T.NAN: 1,
    T.SCALE: 2.0**-24,
}


def test_a_steps_table_without_a_step_column() -> None:
    """Skipped steps without step numbers (an older or damaged steps table): int(NaN) in the non-finite rule.
    A row that cannot be dated is left out."""
    steps = [{T.LOSS: 5.5, T.LOSS_SCALE: 2.0**-24, T.SKIPPED: True}]
    rec = check(tables_from([NAN_GRAD], steps), {}, "v100")
    f = rec.finding("nonfinite_backward")
    assert f is not None and f.numbers["step"] == 14 and f.numbers["skipped"] is None
    assert "has no row for step 14" in f.message


def test_a_layers_table_without_a_step_column() -> None:
    """A nan gradient in a row without a step number: int(NaN) again. It cannot be dated, so no finding
    dates it."""
    row = {k: v for k, v in NAN_GRAD.items() if k != T.STEP}
    rec = check(tables_from([row], [{T.STEP: 0, T.LOSS: 1.0, T.SKIPPED: False}]), {}, "v100")
    assert rec.finding("nonfinite_backward") is None


def test_a_steps_table_without_skipped_or_loss_values() -> None:
    """No skipped column and no finite loss: steps count as not skipped, and the advisor warns about
    nothing it cannot know (pandas 3 deprecates filling a float column with False, which the advisor did)."""
    steps = [{T.STEP: s, T.LOSS: math.nan, T.LOSS_SCALE: 2.0**16} for s in range(5)]
    tabs = tables_from([NAN_GRAD], steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rec = advisor.recommend(tabs, hardware="v100", summary={})
    f = rec.finding("nonfinite_backward")
    assert f is not None and f.numbers["skipped"] is None  # step 14 is not in the steps table
    assert rec.finding("scaler_skipped_steps") is None
    check(tabs, {}, "v100")


@pytest.mark.parametrize("scale", [0.0, 3.0, math.nan, math.inf, "65536"])
def test_a_recommendation_read_back_with_any_loss_scale_describes_itself(scale: object) -> None:
    """summary.json may have been edited: describe() writes 2^k only for a positive power of two."""
    rec = advisor.Recommendation("fp16", scale, 2.0**16, 2000)  # type: ignore[arg-type]
    assert f"init_scale={scale!r}" in rec.describe()
    assert "init_scale=0.125 (2^-3)" in advisor.Recommendation("fp16", 0.125, 0.125, 2000).describe()


# module names of a model's tree: the root "", dotted paths, and layers' own input rows ("a.b:input")
_segment = st.sampled_from(["a", "b", "h", "0", "1", "mlp", "mlp_1", "experts"])
_module = st.one_of(
    st.just(""),
    st.builds(
        lambda parts, inp: ".".join(parts) + (T.INPUT_SUFFIX if inp else ""),
        st.lists(_segment, min_size=1, max_size=4),
        st.booleans(),
    ),
)


def _descends(child: str, parent: str) -> bool:
    """What "descendant" means, pair by pair (the advisor once compared every pair: quadratic in modules)."""
    return child != parent and (parent == "" or child.startswith(parent + "."))


@given(st.lists(_module, max_size=30), st.lists(_module, max_size=5))
@settings(max_examples=300, deadline=None)
def test_innermost_and_kept_modules_equal_the_pairwise_definition(ms: list[str], parents: list[str]) -> None:
    """``_innermost``, ``_under_any`` and ``_modules_to_keep`` look ancestors up in sets (linear in modules, for
    an MoE with tens of thousands): the same answers as comparing every pair."""
    from precprof.analysis.advisor import evidence as E

    uniq = list(dict.fromkeys(ms))
    assert E._innermost(ms) == [m for m in uniq if not any(_descends(o, m) for o in uniq)]
    for m in ms:
        assert E._under_any(m, set(parents)) == any(_descends(m, p) for p in parents)
    owners = list(dict.fromkeys(E._owner(m) for m in uniq if m.endswith(T.INPUT_SUFFIX)))
    real = [m for m in uniq if not m.endswith(T.INPUT_SUFFIX)]
    real = [m for m in real if not any(_descends(o, m) for o in real)]
    expected = list(dict.fromkeys([*owners, *(m for m in real if not any(_descends(m, o) for o in owners))]))
    assert E._modules_to_keep(ms) == expected

"""Tensor-core alignment and FP8 eligibility from the layers' shapes."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import (
    _model_dims,
    _Plan,
    _Run,
    _share,
    _tokens_per_call,
)
from precprof.analysis.advisor.model import INFO, WARNING, Finding, Number
from precprof.analysis.advisor.text import _listing, _name, _pct
from precprof.formats import FP8_E4M3, FP8_E5M2


def _rule_alignment(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    a = cfg.alignment
    bad: dict[str, str] = {}
    for m, d in dims.items():
        off = [f"{lbl}={v}" for lbl, v in d.items() if v % a]
        if off:
            bad[m] = ", ".join(off)
    model_off = {k: v for k, v in _model_dims(run).items() if v % a}
    tokens = _tokens_per_call(run)
    tok_off = tokens is not None and tokens % a != 0
    if not (bad or model_off or tok_off):
        return
    parts = []
    if model_off:
        parts.append("model dims " + ", ".join(f"{k}={v}" for k, v in model_off.items()))
    if bad:
        parts.append(
            "layers "
            + "; ".join(f"{_name(m)} ({bad[m]})" for m in run.sort(bad)[: cfg.max_listed_modules])
            + (f" and {len(bad) - cfg.max_listed_modules} more" if len(bad) > cfg.max_listed_modules else "")
        )
    if tok_off:
        parts.append(f"batch x sequence = {tokens}")
    numbers: dict[str, Number] = {"alignment": a, "layers": len(bad), "tokens": tokens}
    numbers.update({f"dim_{k}": v for k, v in model_off.items()})
    plan.add(
        Finding(
            "tensor_core_alignment",
            WARNING if run.hw.device == "cuda" else INFO,
            f"Dimensions not a multiple of {a}",
            f"Tensor cores run fp16/bf16 matmuls at full speed when every dimension is a multiple of {a} "
            f"({cfg.fp8_alignment} for FP8); these are not: {'; '.join(parts)}.",
            f"Pad them to a multiple of {a} or 64 (nanoGPT pads GPT-2's vocabulary from 50257 to 50304).",
            modules=run.sort(bad),
            numbers=numbers,
        )
    )


@dataclass
class _Fp8Shape:
    """What the FP8 predicate needs about one linear layer, as far as the run tells."""

    in_features: int | None = None
    out_features: int | None = None
    tied_to: str | None = None  # the embedding whose weight it shares
    shared: bool = False  # its weight is recorded under another module (capture records a weight once)
    tokens: int | None = None  # rows per call: the leading dimensions of its input (batch x sequence)
    calls: int = 1

    @property
    def flops_per_token(self) -> int | None:
        """Matmul FLOPs per token and step: 2 x in x out per call (forward; backward scales all layers alike)."""
        if self.in_features is None or self.out_features is None:
            return None
        return 2 * self.in_features * self.out_features * max(self.calls, 1)


def _own_weights(run: _Run) -> tuple[dict[str, bool], list[str]]:
    """(module -> whether its weight is its own, the capture order of summary["capture"]["modules"]).

    The Profiler records a shared Parameter once, under the first module in ``named_modules`` order that owns
    it (in the modules list's params and in the layers table's weight rows): a tied output head has no weight
    of its own there. Without a modules list, a module with no weight rows in a table that has some counts as
    sharing; modules the run says nothing about are not in the map.
    """
    own: dict[str, bool] = {}
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    mods = capture.get("modules") if isinstance(capture, Mapping) else None
    for entry in mods if isinstance(mods, list) else []:
        if isinstance(entry, Mapping) and isinstance(entry.get("params"), Mapping):
            own[str(entry.get("name", ""))] = "weight" in entry["params"]
    order = list(own)
    w = run.layers[(run.layers[T.TENSOR] == T.WEIGHT) & (run.layers[T.PARAM] == "weight")]
    for m in w[T.MODULE].unique():
        own[str(m)] = True
    if not w.empty:
        for m in run.layers[T.MODULE].unique():
            own.setdefault(str(m), False)
    return own, order


def _fp8_shapes(run: _Run, linear: list[str], dims: dict[str, dict[str, int]]) -> dict[str, _Fp8Shape]:
    """Shape, tie and tokens per call of each linear layer, for ``taxonomy.fp8_ineligible_reason``.

    A layer without a weight of its own shares one: when an embedding with its own (num, dim) weight fits its
    output (num columns), it is tied to that embedding and has its shape (in=dim, out=num); otherwise its
    shape is unknown. An embedding without a weight of its own shares the weight of a module listed before it
    (a head registered before the embedding): the linear layers listed before it whose in_features equal its
    dim are taken as tied to it.
    """
    own, order = _own_weights(run)
    config_tokens = _tokens_per_call(run)
    first = run.layers[run.layers[T.STEP] == run.layers[T.STEP].min()]
    acts = first[first[T.TENSOR] == T.ACTIVATION].groupby(T.MODULE)[[T.NUMEL, T.CALLS]].sum()

    def act(m: str) -> tuple[int, int] | None:
        """(output elements, calls) at the first sampled step."""
        if m not in acts.index:
            return None
        numel, calls = float(acts.loc[m, T.NUMEL]), float(acts.loc[m, T.CALLS])
        if not (math.isfinite(numel) and numel > 0):
            return None
        return int(numel), int(calls) if math.isfinite(calls) and calls >= 1 else 1

    def rows(m: str, last: int | None) -> int | None:
        """Rows per call of a module whose output's last dimension is ``last`` (batch x sequence)."""
        a = act(m)
        if a is None or not last or a[0] % (a[1] * last):
            return config_tokens
        return a[0] // (a[1] * last)

    embeddings = [m for m in run.sort(dims) if "num_embeddings" in dims[m] and own.get(m, True)]
    out: dict[str, _Fp8Shape] = {}
    for m in linear:
        a = act(m)
        s = _Fp8Shape(calls=a[1] if a else 1)
        if not own.get(m, True):
            s.shared = True
            for e in embeddings:
                num, dim = dims[e]["num_embeddings"], dims[e]["dim"]
                per = a[0] // (a[1] * num) if a is not None and a[0] % (a[1] * num) == 0 else None
                if per is not None and config_tokens in (None, per):
                    s.tied_to, s.in_features, s.out_features = e, dim, num
                    break
        elif m in dims:
            s.in_features, s.out_features = dims[m]["in"], dims[m]["out"]
        s.tokens = rows(m, s.out_features)
        out[m] = s
    for i, e in enumerate(order):
        if own[e] or taxonomy.kind_of_type(run.types.get(e, "")) != taxonomy.EMBEDDING:
            continue
        a = act(e)
        if a is None or not config_tokens or a[0] % (a[1] * config_tokens):
            continue
        dim = a[0] // (a[1] * config_tokens)
        for m in order[:i]:
            if m in out and not out[m].shared and out[m].in_features == dim:
                out[m].tied_to = e
    return out


def _rule_fp8(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    linear = [m for m in plan.matmul_layers if taxonomy.is_linear_type(run.types.get(m, ""))]
    if not linear:
        return
    shapes = _fp8_shapes(run, linear, dims)
    e4, e5 = T.underflow_cs_col(FP8_E4M3.name), T.underflow_cs_col(FP8_E5M2.name)
    cols = [T.MODULE, T.TENSOR, T.NUMEL, T.ZEROS, T.NAN, T.INF, e4, e5]
    lay = run.layers.loc[run.layers[T.MODULE].isin(linear), cols]  # the columns read: a narrow copy
    # per (module, tensor kind): the sums the shares need, in one groupby (a filter per layer took seconds on
    # a thousand sampled steps); a row's nonzero count is clipped at 0 row by row, as _nonzero does
    sums = (
        pd.DataFrame(
            {
                T.MODULE: T.texts(lay[T.MODULE]).astype(object),
                T.TENSOR: T.texts(lay[T.TENSOR]).astype(object),
                "nonzero": (lay[T.NUMEL] - lay[T.ZEROS] - lay[T.NAN] - lay[T.INF]).clip(lower=0),
                "nonfinite": lay[T.NAN] + lay[T.INF],
                e4: lay[e4],
                e5: lay[e5],
            }
        )
        .groupby([T.MODULE, T.TENSOR], sort=False)
        .sum()
    )

    def summed(m: str, kinds: tuple[str, ...], col: str) -> float:
        return float(sum(sums.at[(m, k), col] for k in kinds if (m, k) in sums.index))

    nonfinite = sums["nonfinite"].groupby(level=0).sum()  # per module, every tensor kind
    rows: list[tuple[str, float | None, float | None, str]] = []
    for m in linear:
        fwd = (T.ACTIVATION, T.WEIGHT)
        f_share = _share(summed(m, fwd, e4), summed(m, fwd, "nonzero"))
        b_share = _share(summed(m, (T.ACTIVATION_GRAD,), e5), summed(m, (T.ACTIVATION_GRAD,), "nonzero"))
        sh = shapes[m]
        # the shape rule is taxonomy's, the one --precision fp8 (convert_fp8) applies to the live model
        why = taxonomy.fp8_ineligible_reason(
            sh.in_features, sh.out_features, sh.tied_to is not None, sh.tokens
        )
        if not taxonomy.fp8_convertible_type(run.types.get(m, "")):
            why = f"a {run.types.get(m, '')}, not an nn.Linear: float8 conversion does not swap it"
        elif sh.tied_to is not None:
            why = f"tied to the embedding {_name(sh.tied_to)}: the shared weight is a gather's too"
        elif sh.in_features is None:
            why += (
                ": its weight is recorded under another module (shared, maybe tied to an embedding)"
                if sh.shared
                else ": none was recorded for it"
            )
        elif why:
            pass
        elif nonfinite.get(m, 0) > 0:
            why = "non-finite values"
        elif f_share is None or b_share is None:
            why = "no forward or backward statistics"
        elif f_share > cfg.fp8_underflow_max:
            why = f"e4m3 forward underflow {_pct(f_share)}"
        elif b_share > cfg.fp8_underflow_max:
            why = f"e5m2 gradient underflow {_pct(b_share)}"
        rows.append((m, f_share, b_share, why))
    plan.fp8_checked = len(rows)
    plan.fp8_eligible = [m for m, _, _, why in rows if not why]
    plan.fp8_why_not = {m: why for m, _, _, why in rows if why}
    known = {m: f for m in linear if (f := shapes[m].flops_per_token) is not None}
    total = sum(known.values())
    plan.fp8_flops_share = sum(known.get(m, 0) for m in plan.fp8_eligible) / total if total > 0 else None
    unknown = [m for m in linear if m not in known]
    tied = [m for m in linear if shapes[m].tied_to is not None]
    # tied layers first: the cause a shape table does not show
    bad = sorted(((m, why) for m, _, _, why in rows if why), key=lambda mw: mw[0] not in tied)
    fmax = max((f for _, f, _, _ in rows if f is not None), default=None)
    bmax = max((b for _, _, b, _ in rows if b is not None), default=None)
    plan.add(
        Finding(
            "fp8_eligibility",
            WARNING if run.hw.fp8_supported and not plan.fp8_eligible else INFO,
            f"{len(plan.fp8_eligible)} of {len(rows)} linear layers are FP8-eligible",
            "A linear layer is FP8-eligible when --precision fp8 would convert it (an nn.Linear not tied to an "
            f"embedding, both dimensions and the tokens per call multiples of {taxonomy.FP8_DIM_MULTIPLE}) and, "
            f"under per-tensor current scaling (scale 2^floor(log2(fmax/amax)), Transformer Engine's "
            f"current-scaling recipe), at most {_pct(cfg.fp8_underflow_max)} of its "
            "nonzero weight and output values underflow e4m3 and of its output gradients underflow e5m2 "
            "(its input is the previous module's output, checked there). "
            f"{len(plan.fp8_eligible)} of {len(rows)} qualify, carrying {_pct(plan.fp8_flops_share)} of the "
            "linear layers' matmul FLOPs (2 x in x out per token"
            + (f"; {len(unknown)} layer(s) of unknown shape not counted" if unknown else "")
            + f"); worst shares: e4m3 {_pct(fmax)}, e5m2 {_pct(bmax)}"
            + (
                ". Not eligible: "
                + "; ".join(f"{_name(m)} ({w})" for m, w in bad[: cfg.max_listed_modules])
                + (
                    f" and {len(bad) - cfg.max_listed_modules} more"
                    if len(bad) > cfg.max_listed_modules
                    else ""
                )
                if bad
                else ""
            )
            + ".",
            ("Convert" if run.hw.fp8_supported else "On FP8 hardware (compute capability 8.9+), convert")
            + " the eligible layers to FP8 (torchao convert_to_float8_training with a module filter) and keep "
            "the others in bf16"
            + (
                f" ({_listing(tied, cfg.max_listed_modules)}: tied to an embedding, "
                f"{'it stays' if len(tied) == 1 else 'they stay'} in bf16)."
                if tied
                else "."
            ),
            modules=plan.fp8_eligible,
            numbers={
                "eligible": len(plan.fp8_eligible),
                "checked": len(rows),
                "tied": len(tied),
                "unknown_shape": len(unknown),
                "eligible_flops_share": plan.fp8_flops_share,
                "max_e4m3_share": fmax,
                "max_e5m2_share": bmax,
                "threshold": cfg.fp8_underflow_max,
            },
        )
    )

"""Tensor-core alignment, and what the FP8 rules need of each linear layer's shape (rules/fp8.py, rules/blocks.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import (
    _captured_modules,
    _first_activations,
    _model_dims,
    _Plan,
    _Run,
    _tokens_per_call,
)
from precprof.analysis.advisor.model import INFO, WARNING, Finding, Number
from precprof.analysis.advisor.text import _listing, _name, _pct


def _rule_alignment(run: _Run, plan: _Plan, dims: dict[str, dict[str, int]]) -> None:
    cfg = run.cfg
    a = cfg.alignment
    # an embedding is a gather: its shape matters only where a linear layer shares its weight (a tied head)
    linear = [m for m in plan.matmul_layers if taxonomy.is_linear_type(run.types.get(m, ""))]
    shapes = _fp8_shapes(run, linear, dims)
    tied = {sh.tied_to for sh in shapes.values() if sh.tied_to is not None}
    # each layer's matmul FLOPs per token, at the tokens its calls had (a tied head's are its embedding's): a
    # layer carrying a negligible share of them is not worth padding
    tokens = _tokens_per_call(run)
    flops = {m: f for m, sh in shapes.items() if (f := sh.flops_per_token(tokens)) is not None}
    for m, sh in shapes.items():
        if sh.tied_to is not None and m in flops:
            flops[sh.tied_to] = flops.get(sh.tied_to, 0) + flops.pop(m)
    total = sum(flops.values())

    def negligible(m: str) -> bool:
        return total > 0 and flops.get(m, total) < cfg.alignment_min_flops_share * total

    bad: dict[str, str] = {}
    small: set[str] = set()
    for m, d in dims.items():
        if "num_embeddings" in d and m not in tied:
            continue
        off = [f"{lbl}={v}" for lbl, v in d.items() if v % a]
        if off and negligible(m):
            small.add(m)
        elif off:
            bad[m] = ", ".join(off)
    # the rows each linear layer's GEMM runs on a call (its input's leading dimensions): the batch's tokens for a
    # layer that reads every token, fewer for one that reads pooled features (a classifier, a UNet's time MLP)
    rows = _alignment_rows(shapes, tokens)
    sequence = _rows_are_tokens(run, dims, tokens)
    tok_off = sequence and tokens is not None and tokens % a != 0 and tokens in rows.values()
    odd_rows: dict[int, list[str]] = {}
    for m in run.sort(rows):
        r = rows[m]
        if (r == tokens and sequence) or not r % a:
            continue
        if negligible(shapes[m].tied_to or m):
            small.add(m)
        else:
            odd_rows.setdefault(r, []).append(m)
    model_off = {k: v for k, v in _model_dims(run).items() if v % a}
    if not (bad or model_off or tok_off or odd_rows):
        return
    lim = cfg.max_listed_modules
    parts = []
    if model_off:
        parts.append("model dims " + ", ".join(f"{k}={v}" for k, v in model_off.items()))
    if bad:
        parts.append(
            "layers "
            + "; ".join(f"{_name(m)} ({bad[m]})" for m in run.sort(bad)[:lim])
            + (f" and {len(bad) - lim} more" if len(bad) > lim else "")
        )
    if tok_off:
        parts.append(f"batch x sequence = {tokens}")
    batch = run.run_config.get("batch_size")
    for r, ms in odd_rows.items():
        said = (
            f"where batch x sequence is {tokens}" if sequence and tokens is not None and not tok_off else ""
        )
        parts.append(
            f"the GEMM rows of {_listing(ms, lim)}: {r} a call"
            + (
                f" (the batch size{', ' + said if said else ''})"
                if r == batch
                else f" ({said})"
                if said
                else ""
            )
        )
    numbers: dict[str, Number] = {"alignment": a, "layers": len(bad)}
    if (
        sequence and tokens is not None and tokens in rows.values()
    ):  # (the batch's tokens, where a layer read them)
        numbers["tokens"] = tokens
    if odd_rows:
        numbers["row_layers"] = sum(len(ms) for ms in odd_rows.values())
    if small:
        numbers["small_layers_left_out"] = len(small)
    numbers.update({f"dim_{k}": v for k, v in model_off.items()})
    remedy = []
    if bad or model_off:
        remedy.append(
            f"Pad them to a multiple of {a} or 64 (nanoGPT pads GPT-2's vocabulary from 50257 to 50304)."
        )
    if tok_off:
        remedy.append(
            f"For the tokens: a batch size or sequence length that makes batch x sequence a multiple of {a}, or "
            f"pad_to_multiple_of={a} in a Hugging Face data collator."
        )
    for r, ms in odd_rows.items():
        remedy.append(
            f"For {_listing(ms, lim)}: "
            + (
                f"a batch size that is a multiple of {a} (their rows are the batch's, {r}: the sequence length does "
                "not set them)."
                if r == batch
                else f"an input whose leading dimensions (all but the last) multiply to a multiple of {a} a call "
                "(the batch size, the sequence length, or the model's own reshaping before "
                f"{'it' if len(ms) == 1 else 'them'} set them)."
            )
        )
    plan.add(
        Finding(
            "tensor_core_alignment",
            WARNING if run.hw.device == "cuda" else INFO,
            f"Dimensions not a multiple of {a}",
            f"Tensor cores run fp16/bf16 matmuls at full speed when every dimension is a multiple of {a} "
            f"({cfg.fp8_alignment} for FP8); these are not: {'; '.join(parts)}"
            + (
                f" ({len(small)} misaligned layer(s) carrying under {_pct(cfg.alignment_min_flops_share)} of the "
                "linear layers' matmul FLOPs each left out: too small to pad)"
                if small
                else ""
            )
            + ".",
            " ".join(remedy),
            modules=run.sort({*bad, *(m for ms in odd_rows.values() for m in ms)}),
            numbers=numbers,
        )
    )


def _rows_are_tokens(run: _Run, dims: Mapping[str, Mapping[str, int]], tokens: int | None) -> bool:
    """Whether ``tokens``, the rows a linear layer's GEMM runs on a call (``_tokens_per_call``), are the batch's
    tokens, batch x sequence: the configuration says the sequence's length, or the token embedding (the embedding
    with the most rows) looked up that many ids a call at the first sampled step, or it is not recorded on that
    step; with no embedding recorded (features, not ids), a multiple of the configuration's batch size. Not where
    the embedding's ids a call were others (the sequence pooled before the linear layers), nor for features the run
    does not tell apart from a batch (an MLP of a loop of the user's own on 4 rows): their rows are said as rows."""
    if tokens is None:
        return False
    seq = run.run_config.get("seq_len")
    if isinstance(seq, int) and seq > 0:
        return True
    embeddings = {m: d for m, d in dims.items() if "num_embeddings" in d and d.get("dim")}
    if (
        not embeddings
    ):  # (features, not ids: a multiple of the batch size the configuration says is its sequences)
        batch = run.run_config.get("batch_size")
        return isinstance(batch, int) and batch > 0 and tokens != batch and tokens % batch == 0
    token = max(embeddings, key=lambda m: (embeddings[m]["num_embeddings"], m))
    first = _first_activations(run).get(token)
    if first is None:
        return True
    numel, calls = first
    return not (math.isfinite(numel) and math.isfinite(calls) and calls >= 1) or (
        numel == tokens * calls * embeddings[token]["dim"]
    )


def _alignment_rows(shapes: Mapping[str, _Fp8Shape], tokens: int | None) -> dict[str, int]:
    """The rows each linear layer's GEMM ran on a call at the first sampled step it recorded, where the run tells
    them: the largest number dividing each call's (``_Fp8Shape.step_calls``), else its tokens per call (the
    configuration's batch x sequence where its output does not tell them). A mixture of experts' routed experts
    (``taxonomy.routed_expert``) whose rows differ from the batch's ``tokens`` are left out: each sees the tokens
    routed to it, which no batch size sets."""
    out: dict[str, int] = {}
    for m, sh in shapes.items():
        r = sh.step_calls[0][1] if sh.step_calls else sh.tokens
        if r is None or r <= 0 or (r != tokens and taxonomy.routed_expert(m)):
            continue
        out[m] = r
    return out


@dataclass
class _Fp8Shape:
    """What the FP8 predicate needs about one linear layer, as far as the run tells."""

    in_features: int | None = None
    out_features: int | None = None
    tied_to: str | None = None  # the embedding whose weight it shares
    shared: bool = False  # its weight is recorded under another module (capture records a weight once)
    tokens: int | None = None  # rows per call: the leading dimensions of its input (batch x sequence)
    odd_tokens: tuple[int, int] | None = None  # (step, rows per call) of a later step not a multiple of FP8's
    uneven_calls: bool = (
        False  # ... of that step's calls, whose tokens differed: the largest dividing them all
    )
    call_tokens: tuple[int, int] | None = (
        None  # (calls, their tokens in all) of that step, where they differed
    )
    calls: int = 1
    rows: int | None = None  # the tokens of all its calls at the first sampled step (output elements / out)
    # every sampled step's (step, the largest number dividing each call's tokens, calls, their tokens in all),
    # in step order: a block format judges its own block size on each (calls of 16 and 48 tokens are
    # multiples of FP8's 16, and average 32, but the 16 fill no 32-value block)
    step_calls: list[tuple[int, int, int, int]] = field(default_factory=list)

    def flops_per_token(self, tokens: int | None) -> float | None:
        """Matmul FLOPs of its forward per token of a call (``tokens``: batch x sequence; the backward scales all
        layers alike): 2 x in x out x the tokens its calls had in all, over ``tokens``. Two calls on 12 and 20
        of a step's 32 tokens are one pass over them, not two. Where the run does not tell the rows or the
        tokens: 2 x in x out per call, each call taken to read every token."""
        if self.in_features is None or self.out_features is None:
            return None
        if self.rows is None or not tokens:
            return 2 * self.in_features * self.out_features * max(self.calls, 1)
        return 2 * self.in_features * self.out_features * self.rows / tokens


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


def _output_of(acts: Mapping[str, tuple[float, float]], m: str) -> tuple[int, int] | None:
    """(output elements, calls) of module ``m`` at the first sampled step (``_first_activations``)."""
    if m not in acts:
        return None
    numel, calls = acts[m]
    if not (math.isfinite(numel) and numel > 0):
        return None
    return int(numel), int(calls) if math.isfinite(calls) and calls >= 1 else 1


def _rows_per_call(
    acts: Mapping[str, tuple[float, float]], m: str, last: int | None, config_tokens: int | None
) -> int | None:
    """Rows per call of a module whose output's last dimension is ``last`` (batch x sequence); the
    configuration's tokens per call where that does not divide."""
    a = _output_of(acts, m)
    if a is None or not last or a[0] % (a[1] * last):
        return config_tokens
    return a[0] // (a[1] * last)


def _all_rows(output: tuple[int, int] | None, last: int | None) -> int | None:
    """The rows (tokens) of all the calls of a module whose output (elements, calls: ``_output_of``) has ``last``
    as its last dimension; None where that does not divide."""
    if output is None or not last or output[0] % last:
        return None
    return output[0] // last


def _shared_weights(run: _Run) -> dict[str, str] | None:
    """Module -> the module its weight is recorded under (a tied or shared weight), as the capture recorded it
    (summary["capture"]["shared_params"]); None for a run recorded before it did."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    shared = capture.get("shared_params") if isinstance(capture, Mapping) else None
    if not isinstance(shared, Mapping):
        return None
    return {
        str(m): str(params["weight"])
        for m, params in shared.items()
        if isinstance(params, Mapping) and isinstance(params.get("weight"), str)
    }


def _fp8_shapes(run: _Run, linear: list[str], dims: dict[str, dict[str, int]]) -> dict[str, _Fp8Shape]:
    """Shape, tie and tokens per call of each linear layer, for ``taxonomy.fp8_ineligible_reason``
    (``_read_shapes``), and the first sampled step whose calls' tokens are not all multiples of FP8's where the
    first step's mean is (``_Fp8Shape.odd_tokens``): a later step's (padding each batch to its longest
    sequence varies them), or a step whose calls had different tokens (8 and 24 average 16: an MoE expert, a
    model called on two batch sizes), judged on the largest number dividing each call's (``uneven_calls``).
    Computed once per run, layers and dims (the alignment, FP8 and block-format rules read them alike)."""
    key = ("fp8_shapes", tuple(linear), tuple((m, tuple(d.items())) for m, d in dims.items()))
    return run.memo(key, lambda: _measured_shapes(run, linear, dims))


def _measured_shapes(run: _Run, linear: list[str], dims: dict[str, dict[str, int]]) -> dict[str, _Fp8Shape]:
    shapes = _read_shapes(run, linear, dims)
    acts = run.kind(T.ACTIVATION)
    acts = acts[acts[T.MODULE].isin([m for m, sh in shapes.items() if sh.out_features])]
    if acts.empty:
        return shapes
    common = pd.to_numeric(acts[T.NUMEL_GCD], errors="coerce") if T.NUMEL_GCD in acts else math.nan
    acts = acts.assign(**{T.NUMEL_GCD: common})
    per = acts.groupby([T.MODULE, T.STEP], observed=True).agg(
        {T.NUMEL: "sum", T.CALLS: "sum", T.NUMEL_GCD: "max"}
    )
    m16 = taxonomy.FP8_DIM_MULTIPLE
    for (m, step), (numel, calls, gcd) in zip(per.index, per.to_numpy().tolist(), strict=True):
        sh = shapes[str(m)]
        got = _call_rows(numel, calls, gcd, sh.out_features)
        if got is not None and sh.out_features:
            sh.step_calls.append((int(step), got[0], int(calls), int(numel) // sh.out_features))
        if sh.odd_tokens is not None:
            continue
        if got is None or not got[0] % m16 or not (got[1] or sh.tokens is None or sh.tokens % m16 == 0):
            continue  # (an odd mean of even calls at the first step: ``tokens`` says it)
        sh.odd_tokens, sh.uneven_calls = (int(step), got[0]), got[1]
        if got[1] and sh.out_features:
            sh.call_tokens = (int(calls), int(numel) // sh.out_features)
    return shapes


def uneven_calls_text(step: int, calls: int, tokens: int, divisor: int, multiple: str) -> str:
    """Why the tokens of a layer whose ``calls`` at ``step`` had different tokens (``tokens`` in all) are not a
    multiple of what a GEMM needs (``multiple``, in words: "16", "the 32-value blocks ..."): the largest number
    dividing each call's, ``divisor``, is not one, so one call's tokens is not. That number may be no call's
    count (calls of 12 and 20 tokens: 4), and is not said as if it were."""
    return (
        f"its {calls} calls at step {step} had different tokens, {tokens} in all, whose largest common divisor, "
        f"{divisor}, is not a multiple of {multiple}, so at least one call's tokens are not"
    )


def _call_rows(numel: float, calls: float, gcd: float, out: int | None) -> tuple[int, bool] | None:
    """The rows per call (tokens) of a step's calls of a layer with ``out`` output features that FP8's rule
    judges, and whether its calls had different ones: the largest number dividing each call's, where the capture
    recorded it (``gcd``: ``T.NUMEL_GCD``); else (a run recorded before it did) their mean. None where neither
    divides."""
    if not out or not calls >= 1 or not numel > 0:
        return None
    if gcd == gcd and gcd > 0 and int(gcd) % out == 0:
        rows = int(gcd) // out
        return rows, int(numel) != rows * out * int(calls)
    per = int(calls) * out
    return (int(numel) // per, False) if int(numel) % per == 0 else None


def _read_shapes(run: _Run, linear: list[str], dims: dict[str, dict[str, int]]) -> dict[str, _Fp8Shape]:
    """Shape, tie and tokens per call (at the first sampled step) of each linear layer.

    Which weights are shared the capture says (``_shared_weights``): a layer whose weight is an embedding's is
    tied to it and has its shape (in=dim, out=num), and so is a layer whose weight an embedding listed after
    it shares (a head registered before its embedding). A run recorded before the capture said so is read from
    shapes: a layer without a weight of its own shares one, and when an embedding with its own (num, dim)
    weight fits its output (num columns), it is tied to that embedding; an embedding without a weight of its
    own shares the weight of a module listed before it: the linear layers listed before it whose in_features
    equal its dim are taken as tied to it.
    """
    shared = _shared_weights(run)
    if shared is not None:
        return _recorded_ties(run, linear, dims, shared)
    own, order = _own_weights(run)
    config_tokens = _tokens_per_call(run)
    acts = _first_activations(run)

    embeddings = [m for m in run.sort(dims) if "num_embeddings" in dims[m] and own.get(m, True)]
    out: dict[str, _Fp8Shape] = {}
    for m in linear:
        a = _output_of(acts, m)
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
        s.tokens = _rows_per_call(acts, m, s.out_features, config_tokens)
        s.rows = _all_rows(a, s.out_features)
        out[m] = s
    for i, e in enumerate(order):
        if own[e] or taxonomy.kind_of_type(run.types.get(e, "")) != taxonomy.EMBEDDING:
            continue
        a = _output_of(acts, e)
        if a is None or not config_tokens or a[0] % (a[1] * config_tokens):
            continue
        dim = a[0] // (a[1] * config_tokens)
        for m in order[:i]:
            if m in out and not out[m].shared and out[m].in_features == dim:
                out[m].tied_to = e
    return out


def _recorded_ties(
    run: _Run, linear: list[str], dims: dict[str, dict[str, int]], shared: dict[str, str]
) -> dict[str, _Fp8Shape]:
    """``_fp8_shapes`` of a run whose capture recorded which weights are shared (``shared``)."""
    config_tokens = _tokens_per_call(run)
    acts = _first_activations(run)
    out: dict[str, _Fp8Shape] = {}
    for m in linear:
        a = _output_of(acts, m)
        s = _Fp8Shape(calls=a[1] if a else 1)
        owner = shared.get(m)
        if owner is not None:
            s.shared = True
            d = dims.get(owner, {})
            if "num_embeddings" in d:  # an output head tied to its embedding
                s.tied_to, s.in_features, s.out_features = owner, d["dim"], d["num_embeddings"]
            elif "in" in d:  # a layer sharing another layer's weight
                s.in_features, s.out_features = d["in"], d["out"]
        elif m in dims and "in" in dims[m]:
            s.in_features, s.out_features = dims[m]["in"], dims[m]["out"]
        s.tokens = _rows_per_call(acts, m, s.out_features, config_tokens)
        s.rows = _all_rows(a, s.out_features)
        out[m] = s
    for e, owner in shared.items():  # an embedding sharing the weight of a head registered before it
        if owner in out and taxonomy.kind_of_type(run.types.get(e, "")) == taxonomy.EMBEDDING:
            out[owner].tied_to = e
    for m, (e, etype) in _tied_outside(run).items():  # tied to an embedding the capture left out
        if m in out and taxonomy.kind_of_type(etype) == taxonomy.EMBEDDING:
            out[m].tied_to = e
    return out


def _tied_outside(run: _Run) -> dict[str, tuple[str, str]]:
    """Module -> (name, type) of the module its weight belongs to first, where that one was not captured (a
    module filter that keeps a tied head and leaves out its embedding: summary["capture"]["shared_outside"])."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    outside = capture.get("shared_outside") if isinstance(capture, Mapping) else None
    if not isinstance(outside, Mapping):
        return {}
    out: dict[str, tuple[str, str]] = {}
    for m, params in outside.items():
        w = params.get("weight") if isinstance(params, Mapping) else None
        if isinstance(w, Mapping) and isinstance(w.get("module"), str):
            out[str(m)] = (str(w["module"]), str(w.get("type", "")))
    return out


# the matmuls float8 conversion does not swap, as it swaps nn.Linear modules alone, by the module doing them
ATTENTION, RECURRENT, CONVOLUTION = "attention", "recurrent", "convolution"
_RECURRENT_WEIGHT = re.compile(r"^weight_(ih|hh|hr)_l\d+(_reverse)?$")  # nn.LSTM's, nn.GRU's, nn.RNN's
_CONVOLUTION = re.compile(r"^Conv[123]d$")
_TRANSPOSED = re.compile(r"^ConvTranspose[123]d$")


@dataclass
class _Unconverted:
    """A module whose matmuls no float8 conversion reaches: ``kind`` (``ATTENTION``: nn.MultiheadAttention's
    projections, which it computes from its own in_proj_weight and out_proj.weight, never calling out_proj;
    ``RECURRENT``: an LSTM's, GRU's or RNN's gates; ``CONVOLUTION``), its forward GEMMs of the first sampled step
    as (rows, in, out) each (rows: the tokens of all its calls), and their FLOPs per token of a call (the linear
    layers' ``flops_per_token``, 2 x rows x in x out over the tokens per call)."""

    kind: str
    gemms: list[tuple[int, int, int]]
    # an nn.MultiheadAttention's score matmuls of the first sampled step's calls, as GEMMs of its FLOPs over the
    # batch's query tokens: Q K^T (batch x query length, embed dim, key length) and the weights x V (batch x query
    # length, key length, embed dim) a call, 2 x 2 x batch x query length x key length x embed dim FLOPs ([]: not
    # counted)
    scores: list[tuple[int, int, int]] = field(default_factory=list)

    def flops_per_token(self, tokens: int) -> float:
        return sum(2 * rows * k * n for rows, k, n in self.gemms + self.scores) / tokens


def _attention_gemms(
    params: Mapping[str, list[int]], out_proj: list[int] | None, calls: int, recorded: object
) -> _Unconverted | None:
    """The projections and score matmuls of an nn.MultiheadAttention (its ``params``' shapes, its out_proj's
    weight's) at the first sampled step, from its
    calls as the capture recorded them (``recorded``: [batch, query length, key length] each): the query and the
    output projections at the query's tokens, the key and value projections at the key's (a cross-attention's
    memory, of another length than the query). None where the run does not record them, or records another
    number of calls than its output row (``calls``)."""
    if not isinstance(recorded, list) or len(recorded) != calls:
        return None
    shapes = [
        c for c in recorded if isinstance(c, list) and len(c) == 3 and all(isinstance(d, int) for d in c)
    ]
    if len(shapes) != calls or any(min(c) <= 0 for c in shapes):
        return None
    q_rows, kv_rows = sum(b * lq for b, lq, _ in shapes), sum(b * lk for b, _, lk in shapes)
    packed = params.get("in_proj_weight")
    if packed is not None and len(packed) == 2:
        e, d_in = packed[0] // 3, packed[1]
        # as torch computes them: one GEMM when the query and the key have one length, else the query's and
        # the key's and value's packed
        same = all(lq == lk for _, lq, lk in shapes)
        gemms = [(q_rows, d_in, 3 * e)] if same else [(q_rows, d_in, e), (kv_rows, d_in, 2 * e)]
    else:
        sep = [params.get(f"{p}_proj_weight") for p in "qkv"]
        if any(s is None or len(s) != 2 for s in sep):
            return None
        (e, d_q), (_, d_k), (_, d_v) = sep  # type: ignore[misc]
        gemms = [(q_rows, d_q, e), (kv_rows, d_k, e), (kv_rows, d_v, e)]
    gemms += [(q_rows, out_proj[1], out_proj[0])] if out_proj is not None else []
    scores = [g for b, lq, lk in shapes for g in ((b * lq, e, lk), (b * lq, lk, e))]
    return _Unconverted(ATTENTION, gemms, scores=scores)


def _convolution_gemm(
    t: str, weight: list[int], output: tuple[int, int], inputs: object
) -> tuple[int, int, int] | None:
    """The GEMM of a convolution's calls at the first sampled step, as (rows, in, out) of FlopCounterMode's FLOPs:
    a convolution's over its output positions, (positions, in/groups x kernel, out channels), read from its
    output (``output``: elements, calls); a transposed convolution's over its input positions, (positions, in
    channels, out/groups x kernel), read from the shapes of its inputs the capture recorded (``inputs``: summary
    capture.modules' "input_shapes", capture.records' ``INPUT_SHAPES``). None where the run does not tell them."""
    if _CONVOLUTION.match(t):
        cout = weight[0]
        return None if output[0] % cout else (output[0] // cout, math.prod(weight[1:]), cout)
    if not _TRANSPOSED.match(t) or not isinstance(inputs, list) or len(inputs) != output[1]:
        return None
    cin = weight[0]  # a transposed convolution's weight: (in, out/groups, kernel...)
    sizes = [math.prod(s) for s in inputs if isinstance(s, list) and s and all(isinstance(d, int) for d in s)]
    if len(sizes) != len(inputs) or any(n <= 0 or n % cin for n in sizes):
        return None
    return sum(sizes) // cin, cin, math.prod(weight[1:])


def _recurrent_rows(inputs: object, calls: int) -> int | None:
    """The tokens a recurrent layer's gates read over its calls at the first sampled step, from the shapes of
    its inputs the capture recorded (``inputs``: (batch, seq, features) either way round, (seq, features)
    unbatched, a packed sequence's (tokens, features)): every one of its weights multiplies each of them (its
    output, holding the final states too, does not tell them: a classifier's head reading the last state alone
    counted the gates at its own few rows). None where the run does not tell them."""
    if not isinstance(inputs, list) or len(inputs) != calls:
        return None
    rows = [math.prod(s[:-1]) for s in inputs if isinstance(s, list) and len(s) >= 2]
    return sum(rows) if len(rows) == len(inputs) and all(r > 0 for r in rows) else None


def _unconverted_matmuls(run: _Run) -> tuple[dict[str, _Unconverted], list[str]]:
    """The modules doing matmuls that float8 conversion leaves in bf16, from the weight shapes the capture
    recorded (``_captured_modules``) and each one's calls at the first sampled step, and those of them whose rows
    the run does not tell (no tokens per call, no output recorded; a transposed convolution of a run that did
    not record its inputs' shapes): (module -> ``_Unconverted``, the modules not counted). Attention and
    recurrent layers read every token of the batch, as the linear layers; a convolution's rows are its output
    positions (``_convolution_gemm``), a transposed one's its input positions."""
    tokens = _tokens_per_call(run)
    acts = _first_activations(run)
    mods = _captured_modules(run)
    out: dict[str, _Unconverted] = {}
    uncounted: list[str] = []
    for name, entry in mods.items():
        t, params = str(entry.get("type", "")), entry.get("params") or {}
        weights = [s for s in params.values() if isinstance(s, list) and all(isinstance(d, int) for d in s)]
        if "MultiheadAttention" in t:
            proj = [s for p, s in params.items() if p.endswith("proj_weight") and len(s) == 2]
            own = (mods.get(f"{name}.out_proj") or {}).get("params") or {}
            kind, shapes = ATTENTION, proj + [own["weight"]] * ("weight" in own)
        elif any(_RECURRENT_WEIGHT.match(p) for p in params):
            kind, shapes = (
                RECURRENT,
                [s for p, s in params.items() if _RECURRENT_WEIGHT.match(p) and len(s) == 2],
            )
        elif taxonomy.is_matmul_type(t) and "Conv" in t and not taxonomy.is_linear_type(t):
            kind, shapes = CONVOLUTION, [s for s in weights if len(s) >= 3]
        else:
            continue
        a = _output_of(acts, name)
        if not shapes or a is None:
            continue
        if kind == CONVOLUTION:
            gemm = (
                _convolution_gemm(t, shapes[0], a, entry.get("input_shapes")) if tokens is not None else None
            )
            if gemm is None:
                uncounted.append(name)
                continue
            out[name] = _Unconverted(kind, [gemm])
        elif kind == ATTENTION and (
            got := _attention_gemms(params, own.get("weight"), a[1], entry.get("attention_calls"))
        ):
            out[name] = got
        elif kind == RECURRENT and (rows := _recurrent_rows(entry.get("input_shapes"), a[1])):
            out[name] = _Unconverted(kind, [(rows, s[1], s[0]) for s in shapes])
        elif tokens is None:
            uncounted.append(name)
        else:  # a run recorded before the capture recorded these calls' shapes: at the linear layers' tokens
            out[name] = _Unconverted(kind, [(tokens * a[1], s[1], s[0]) for s in shapes])
    return out, run.sort(uncounted)


def _unseen_weights(run: _Run, counted: Mapping[str, object]) -> dict[str, list[str]]:
    """Modules of no matmul kind holding a matrix parameter, outside those ``_unconverted_matmuls`` counts and a
    parametrized layer's ``parametrizations`` (the root holding one that its forward uses with F.linear), with
    the names of those parameters: a matmul their own code may compute with them no count of matmuls sees. The
    run does not show whether it does: Mamba's mixer holds A_log (d_inner x d_state), used element-wise."""
    out: dict[str, list[str]] = {}
    for name, entry in _captured_modules(run).items():
        t, params = str(entry.get("type", "")), entry.get("params") or {}
        if (
            name in counted
            or ".parametrizations." in f"{name}."
            or taxonomy.kind_of_type(t) != taxonomy.OTHER
        ):
            continue
        matrices = [p for p, s in params.items() if isinstance(s, list) and len(s) == 2 and min(s) > 1]
        if matrices:
            out[name] = matrices
    return {m: out[m] for m in run.sort(out)}


def _multiplied_outside(run: _Run) -> list[str]:
    """Matmul layers (an nn.Linear, a convolution) that ran no forward of their own on any sampled step, yet whose
    weight got a gradient: the code around them computes with their weight itself (Mamba's mixer does
    ``dt_proj.weight @ x`` and F.conv1d on ``conv1d.weight``). Float8 conversion swaps the module, whose forward
    is never called, so that matmul stays in bf16, and no count of matmuls sees it (a layer's is read from its
    own output). An nn.MultiheadAttention's out_proj is one, counted with its attention
    (``_unconverted_matmuls``); a layer whose output the capture could not read (``skipped_tensors``) is none.
    Empty in a run that recorded no forward."""
    ran = set(T.texts(run.kind(T.ACTIVATION, T.ACTIVATION_GRAD)[T.MODULE]))
    if not ran:
        return []
    grads = run.kind(T.WEIGHT_GRAD)
    trained = set(T.texts(grads.loc[grads[T.PARAM] == "weight", T.MODULE]))
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    skipped = capture.get("skipped_tensors") if isinstance(capture, Mapping) else None
    seen = ran | {str(e.get("module")) for e in skipped or [] if isinstance(e, Mapping)}
    mods = _captured_modules(run)
    out = []
    for name, entry in mods.items():
        parent = str((mods.get(name.rpartition(".")[0]) or {}).get("type", ""))
        if (
            name in trained
            and name not in seen
            and taxonomy.is_matmul_type(str(entry.get("type", "")))
            and "MultiheadAttention" not in parent
        ):
            out.append(name)
    return run.sort(out)

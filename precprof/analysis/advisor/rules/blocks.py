"""Block-scaled formats (MXFP8, NVFP4, MXFP4) per linear layer, from the layers table's block columns.

A block-scaled GEMM quantises every operand it reads along its reduction dimension, one scale per block of 32
(MX) or 16 (NVFP4) values. For a linear layer y = x W^T (x: its input, the previous module's output; W: its
weight, (out, in); dy: its output gradient) the three GEMMs read:

- forward, y = x W^T: x and W along in_features, the tables' "row" orientation (their last dimension);
- input gradient, dx = dy W: dy along out_features ("row") and W along out_features ("col");
- weight gradient, dW = dy^T x: dy and x along the tokens ("col").

GPT-2's Conv1D holds its weight as (in, out): its weight's orientations are the other way round. Each operand's
columns are summed over the sampled steps (the stats are counts and float64 sums, so they add up); shares are of
the operand's nonzero finite values, SQNR is 10 log10(sum x^2 / sum (x - q)^2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from precprof import hardware as hw_mod
from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.config import AdvisorConfig
from precprof.analysis.advisor.evidence import (
    _computed_weights,
    _innermost,
    _layer_dims,
    _matmul_leaves,
    _numel_calls,
    _Plan,
    _prepare,
    _Run,
    _skipped_steps,
)
from precprof.analysis.advisor.model import INFO, Finding, Number
from precprof.analysis.advisor.rules.block_losses import (
    Columns,
    LayerBlocks,
    OperandLoss,
    RecipeSummary,
    Rows,
    db_text,
    losses,
)
from precprof.analysis.advisor.rules.shapes import _fp8_shapes, uneven_calls_text
from precprof.analysis.advisor.text import _listing, _name, _pct

__all__ = ["LayerBlocks", "OperandLoss", "RecipeSummary", "block_table", "db_text", "decide", "fails"]

INPUT, WEIGHT, GRAD = "input", "weight", "output gradient"
# (operand, orientation along the GEMM's reduction dimension for an nn.Linear, the GEMM that reads it)
OPERANDS: tuple[tuple[str, str, str], ...] = (
    (INPUT, "row", "forward"),
    (WEIGHT, "row", "forward"),
    (GRAD, "row", "input gradient"),
    (WEIGHT, "col", "input gradient"),
    (GRAD, "col", "weight gradient"),
    (INPUT, "col", "weight gradient"),
)
# the dimension each GEMM reduces over, along which its operands' blocks run
GEMM_AXIS: dict[str, str] = {
    "forward": "in_features",
    "input gradient": "out_features",
    "weight gradient": "tokens",
}
# The plan's formats, best first (fewest bits), each as the block column recipe it is judged by and the
# HardwareInfo.block_formats entry a target needs to run it. MXFP8 is judged with E4M3 elements for every
# operand, gradients included (Transformer Engine's MXFP8BlockScaling and torchao's MX training default), and
# with scales rounded up ("rceil": cuBLAS's and TE's E8M0 scale, torchao's ScaleCalculationMode.RCEIL): the
# OCP "floor" scale clamps a block's largest value whenever its mantissa exceeds E4M3's 1.75.
PLAN_RECIPES: dict[str, str] = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp8": "mxfp8_e4m3_rceil"}
PLAN_NATIVE: dict[str, str] = {"nvfp4": "nvfp4", "mxfp4": "mxfp4", "mxfp8": "mxfp8_e4m3"}
# the values a scale covers, along the axis a GEMM reduces: 32 for MX (OCP), 16 for NVFP4 (block_formats' recipes,
# which import torch: the advisor reads a run without it; tests/test_block_advice.py checks they agree)
BLOCK_SIZE: dict[str, int] = {"nvfp4": 16, "mxfp4": 32, "mxfp8": 32}
PLAN_LABELS: dict[str, str] = {"nvfp4": "NVFP4", "mxfp4": "MXFP4", "mxfp8": "MXFP8", "bf16": "BF16"}
RECIPE_LABELS: dict[str, str] = {
    "mxfp8_e4m3": "MXFP8 E4M3 (floor scale)",
    "mxfp8_e4m3_rceil": "MXFP8 E4M3",
    "mxfp8_e5m2": "MXFP8 E5M2",
    "mxfp6_e2m3": "MXFP6 E2M3",
    "mxfp6_e3m2": "MXFP6 E3M2",
    "mxfp4": "MXFP4",
    "nvfp4": "NVFP4",
}
WHAT_IF_TARGET = "b200"  # the preset a run planned elsewhere is told about
FP8_RUNNING = (
    "fp8"  # what a layer of torchao's float8 training runs, beside the block formats (_Run.running_formats)
)


def _input_of(
    run: _Run,
    m: str,
    leaves: list[str],
    dims: Mapping[str, Mapping[str, int]],
    first: tuple[set[str], dict[str, tuple[float, float]]] | None = None,
) -> str | None:
    """The module whose output is ``m``'s input (``inputs_of``); None when it read more than one, or none was
    recorded."""
    sources = inputs_of(run, m, leaves, dims, first)
    return sources[0] if len(sources) == 1 else None


def inputs_of(
    run: _Run,
    m: str,
    leaves: list[str],
    dims: Mapping[str, Mapping[str, int]],
    first: tuple[set[str], dict[str, tuple[float, float]]] | None = None,
) -> list[str]:
    """The modules whose outputs ``m``'s GEMM read as its input, as the capture found them (summary
    capture.gemm_inputs: the outputs it read, and its own input row ``T.input_module`` when no captured module
    produced one), those with activation rows; [] when none was recorded. A run recorded before the capture said so: its own input
    row when it has one, else the leaf that started just before it in forward order, when its output has the
    size ``m`` reads (tokens x in_features, from ``m``'s own output and shape) — which a layer reading the same
    input as the one before it fails (a Llama's k_proj after q_proj, whose output has k_proj's input size).
    ``first``: ``_first_activations(run)``, when the caller asks for many layers."""
    modules, first_step = first if first is not None else _first_activations(run)
    own = T.input_module(m)
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    recorded = capture.get("gemm_inputs") if isinstance(capture, Mapping) else None
    if (
        isinstance(recorded, Mapping) and m in recorded
    ):  # every matmul layer (an older run: with block formats on)
        found = recorded.get(m)
        sources = [str(s) for s in found if str(s) in modules] if isinstance(found, list) else []
        return sources + ([own] if own in modules else [])
    if own in modules:
        return [own]
    order = run.order.get(m)
    d = dims.get(m)
    if order is None or not d or "in" not in d:
        return []
    before = [o for o in leaves if run.order.get(o, 1 << 30) < order]
    if not before:
        return []
    prev = max(before, key=lambda o: run.order[o])
    if m not in first_step or prev not in first_step:
        return []
    per_call = first_step[m][0] / max(first_step[m][1], 1.0)
    prev_per_call = first_step[prev][0] / max(first_step[prev][1], 1.0)
    return [prev] if per_call * d["in"] == prev_per_call * d["out"] else []


def _first_activations(run: _Run) -> tuple[set[str], dict[str, tuple[float, float]]]:
    """The modules with activation rows, and per module the activation elements and calls of the first
    sampled step, ``(numel, calls)``. Computed once per run."""

    def make() -> tuple[set[str], dict[str, tuple[float, float]]]:
        acts = run.kind(T.ACTIVATION)
        return {str(m) for m in acts[T.MODULE].unique()}, _numel_calls(
            acts[acts[T.STEP] == acts[T.STEP].min()]
        )

    return run.memo("first_activations", make)


def _judged_on(run: _Run, modules: list[str], sampled: int) -> str:
    """On how many sampled steps the layers' blocks were evaluated, in words: all of them, or, where the layers
    took turns (the capture's groups), each layer's fewest to most (a run read "over 30 sampled steps" where each
    layer was evaluated on 2 to 10 of them)."""
    cols = [c for c in T.BLOCK_COLUMNS if c in run.layers]
    rows = run.layers[run.layers[T.MODULE].isin(modules) & run.layers[cols].notna().any(axis=1)]
    per = rows.groupby(T.MODULE)[T.STEP].nunique()
    lo, hi = (int(per.min()), int(per.max())) if not per.empty else (sampled, sampled)
    if lo == hi == sampled:
        return f"over {sampled} sampled step(s)"
    span = f"{lo}" if lo == hi else f"{lo} to {hi}"
    return f"each over {span} of the {sampled} sampled steps (the layers took turns)"


def layer_blocks(run: _Run, dims: Mapping[str, Mapping[str, int]] | None = None) -> list[LayerBlocks]:
    """Per linear layer (forward order), each block recipe's losses on the operands the layer's GEMMs read.
    Layers whose own weight and output gradient have no block statistics are left out (an older run, the
    what-if was off, or the groups' turns did not reach them: ``_turn_came``), but for those
    whose weight is computed (weight_norm, spectral_norm) and a head tied to an embedding, which no conversion
    swaps: no run length or block budget changes their place in the plan."""
    if run.layers.empty or not any(c in run.layers for c in T.BLOCK_COLUMNS):
        return []
    dims = dims if dims is not None else _layer_dims(run)
    matmuls = _matmul_leaves(run)
    linear = [m for m in matmuls if taxonomy.is_linear_type(run.types.get(m, ""))]
    if not linear:
        return []
    head = _head_of(run, linear)
    act_modules = [str(m) for m in run.kind(T.ACTIVATION)[T.MODULE].unique()]
    # a layer's own input row is never another layer's input
    leaves = [m for m in _innermost(act_modules) if not m.endswith(T.INPUT_SUFFIX)]
    shapes = _fp8_shapes(run, linear, {k: dict(v) for k, v in dims.items()})
    # a head tied to an embedding has no weight of its own in the tables: its shape comes from the embedding's
    dims = {
        **{
            m: {"in": sh.in_features, "out": sh.out_features}
            for m, sh in shapes.items()
            if sh.in_features and sh.out_features
        },
        **dims,
    }
    # the numeric columns _losses reads (as arrays, each once), and each (module, tensor, param)'s rows found in
    # one groupby: a filter of the whole table per layer and operand took seconds on a thousand sampled steps,
    # and row selections of text columns are slow too
    columns = Columns(run.layers, run.hist)
    where: dict[tuple[str, str], list[tuple[str, np.ndarray]]] = {}
    for (m, t, p), i in run.layers.groupby([T.MODULE, T.TENSOR, T.PARAM], sort=False).indices.items():
        where.setdefault((str(m), str(t)), []).append((str(p), i))

    # the output gradients of a step a loss scaler skipped overflowed at its scale: block formats, like
    # per-tensor FP8, train with no loss scale, so their nan/inf say nothing of the formats (one skipped step
    # had sent every layer to bf16)
    skipped = np.array(sorted(_skipped_steps(run.steps, scaled=True)), dtype=float)
    steps = columns.get(T.STEP)

    def rows_of(module: str, tensor: str, param: str | None = None, scaled_out: bool = False) -> Rows:
        idx = [i for p, i in where.get((module, tensor), []) if param in (None, p)]
        at = np.sort(np.concatenate(idx)) if idx else np.zeros(0, dtype=np.int64)
        if scaled_out and len(skipped) and steps is not None:
            at = at[~np.isin(steps[at], skipped)]
        return Rows(columns, at)

    first = _first_activations(run)
    computed = _computed_weights(run)
    # the modules whose weight trains: a weight-gradient row of it (a run that recorded none: every layer)
    trained = {m for (m, t), found in where.items() if t == T.WEIGHT_GRAD for p, _ in found if p == T.WEIGHT}
    any_trained = any(t == T.WEIGHT_GRAD for _, t in where)
    out: list[LayerBlocks] = []
    for m in linear:
        t = run.types.get(m, "")
        src = _input_of(run, m, leaves, dims, first)
        w_owner = shapes[m].tied_to if shapes[m].shared and shapes[m].tied_to else m
        grad = rows_of(m, T.ACTIVATION_GRAD)
        rows = {
            INPUT: rows_of(src, T.ACTIVATION) if src is not None else None,
            WEIGHT: rows_of(w_owner or m, T.WEIGHT, "weight"),
            GRAD: rows_of(m, T.ACTIVATION_GRAD, scaled_out=True),
        }
        # the GEMMs the layer runs, the only ones judged: its forward; with an output gradient on a sampled step,
        # its input gradient (a layer without one, frozen with nothing trainable before it, runs no backward GEMM:
        # it had listed them, with numbers of the weight alone); and its weight gradient only where its weight
        # trains, as its weight-gradient rows say (in a run that recorded some): a frozen layer (LoRA's base
        # layers, a frozen head) computes none, and had failed MXFP4 on that GEMM's operands
        ran_gemms = {"forward"} | (
            {"input gradient"}
            | ({"weight gradient"} if not any_trained or (w_owner or m) in trained else set())
            if grad.n
            else set()
        )
        sh = shapes[m]
        tokens = sh.odd_tokens[1] if sh.odd_tokens is not None else sh.tokens
        lb = LayerBlocks(
            m,
            t,
            src,
            axes={"in_features": sh.in_features, "out_features": sh.out_features, "tokens": tokens},
            uneven_calls=(
                (sh.odd_tokens[0], *sh.call_tokens)
                if sh.uneven_calls and sh.odd_tokens is not None and sh.call_tokens is not None
                else None
            ),
            tied_to=sh.tied_to,
            computed_weight=computed.get(m, ""),
            step_calls=tuple(sh.step_calls),
        )
        for recipe in T.BLOCK_RECIPES:
            ops = []
            for operand, orientation, gemm in OPERANDS:
                df = rows[operand]
                if df is None or gemm not in ran_gemms:
                    continue
                o = orientation
                if (
                    operand == WEIGHT and t == "Conv1D"
                ):  # (in, out); a tied embedding's (num, dim) is (out, in)
                    o = {"row": "col", "col": "row"}[o]
                loss = losses(df, operand, o, gemm, recipe)
                if loss is not None:
                    ops.append(loss)
            if ops:
                lb.losses[recipe] = ops
        lb.head = m == head
        judged = any(o.operand == GRAD for ops in lb.losses.values() for o in ops)
        lb.gradient_skipped = (
            not judged and losses(grad, GRAD, "row", "input gradient", T.BLOCK_RECIPES[0]) is not None
        )
        lb.evaluated = bool(lb.losses) and _turn_came(rows_of(m, T.WEIGHT, "weight"), grad)
        # a layer whose weight is computed, and a head tied to an embedding, stay in bf16 whatever their numbers:
        # in the plan, evaluated or not
        if lb.evaluated or lb.computed_weight or lb.tied_to is not None:
            out.append(lb)
    return out


def recorded_head(run: _Run) -> tuple[str, str] | None:
    """The matmul the capture found making the model's output (summary ``capture.output_head``, walked back
    from the model's output on a sampled step): (the linear layer, "") where one made it, (the module owning
    the parameter it read, that parameter's name) where a function of the model's forward did (a head tied to
    the embedding, ``F.linear(x, self.wte.weight)``); None where the capture found none or a run recorded before
    it looked."""
    found = _output_head(run)
    if not isinstance(found, Mapping) or not isinstance(found.get("module"), str):
        return None
    param = found.get("param") if found.get("by") == "weight" else ""
    return str(found["module"]), str(param or "")


def _output_head(run: _Run) -> Any:
    """The summary's ``capture.output_head`` as recorded (None where absent)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    return capture.get("output_head") if isinstance(capture, Mapping) else None


def head_unnamed(run: _Run) -> bool:
    """Whether the capture's walk met, on its way back from the model's output, a matmul on an operand with no
    gradient before any linear layer's output or trained weight (``capture.output_head`` ``{"by": "unnamed"}``):
    a frozen weight that autograd's graph does not name (a frozen head tied to the embedding, a frozen head the
    module filter left out), so which module makes the output is not known."""
    found = _output_head(run)
    return isinstance(found, Mapping) and found.get("by") == "unnamed"


def _head_of(run: _Run, linear: list[str]) -> str | None:
    """The output head among the linear layers ``linear`` (forward order), None when it is none of them: the one
    the capture found making the model's output (``recorded_head``: a head computed by a function on the
    embedding's weight is no linear layer; nor is one the module filter left out); else the last linear layer
    in forward order of those that ran (a routed expert no token went to on any sampled step has no place in
    it, and sorts after every other), which names the wrong layer when the head is a function's or another
    linear layer runs after it."""
    found = recorded_head(run)
    if found is not None:
        return found[0] if found[0] in linear else None
    if head_unnamed(run):  # (the last linear layer would be a guess the capture's walk has just refuted)
        return None
    ran = [m for m in linear if run.order.get(m, 1 << 30) < 1 << 30]
    return (ran or linear)[-1]


def _head_said(run: _Run, table: list[LayerBlocks]) -> str:
    """The plan's sentence on an output head that is none of its linear layers ("" when one is, or the capture
    found none): a head tied to the embedding computed by a function of the forward (it had named the last
    block's MLP layer the head and kept it from FP4), another module's parameter in a matmul."""
    found = recorded_head(run)
    if found is None and head_unnamed(run):
        return (
            " Which matmul makes the model's output is not known: the first on the way back from it reads an "
            "operand that trains no gradient (a frozen weight of no captured linear layer, or a constant), which "
            "autograd's graph does not name, so none of these linear layers is kept from FP4 as the head: keep "
            "the output head out of FP4 yourself."
        )
    if found is None or found[1] == "" or any(lb.module == found[0] for lb in table):
        return ""
    owner, param = found
    what = f"{owner}.{param}" if owner else param  # (a dotted name reads as one: "0.weight")
    if "Embedding" in run.types.get(owner, ""):
        return (
            f" The output head is a matmul of the model's forward on the weight of the embedding "
            f"{_name(owner)} (tied to it, no linear layer of its own, which no conversion to a block-scaled "
            "Linear swaps): none of these linear layers is kept from FP4 as the head."
        )
    return (
        f" The output head is a matmul of the model's forward on {what}, no linear layer of this plan: none of "
        "them is kept from FP4 as the head."
    )


def _turn_came(weight: Rows, grad: Rows) -> bool:
    """Whether the layer's own operands were evaluated: its weight (where it holds one: a tied head's is the
    embedding's) and its output gradient (where it ran a backward), which the capture evaluates on the layer's
    own turn alone. Its input may be another module's output that a sibling's turn evaluated (a Llama's
    gate_proj and up_proj, or q, k and v, read one norm's output): on that alone, a layer none of whose own
    operands was evaluated had entered the plan, "NVFP4 (2): gate_proj, up_proj" where the what-if reached
    gate_proj only."""
    return all(_evaluated(rows) for rows in (weight, grad) if rows.n)


def _evaluated(rows: Rows) -> bool:
    """Whether any of ``rows`` holds block statistics (the recipes are evaluated together)."""
    return any(
        not np.isnan(rows.col(T.block_col(recipe, "flushed", orientation))).all()
        for recipe in T.BLOCK_RECIPES
        for orientation in T.BLOCK_ORIENTATIONS
    )


def fails(lb: LayerBlocks, name: str, cfg: AdvisorConfig) -> str:
    """Why plan format ``name`` does not qualify for the layer ("" when it does), naming the first operand that
    fails. Every format by what it does to the operand's L2 norm: its SQNR (the norm of the whole error:
    rounding, flushing and saturation) at least the format's minimum, and for MXFP8 the share of the norm lost
    to flushing and saturation (``block_losses``: the median over sampled steps of an upper bound) at most
    ``cfg.lost_norm_max``, the bound per-tensor FP8 and fp16 are held to. FP4 flushes by design (E2M1 keeps
    nothing below a quarter of a block's scale): its SQNR bound covers what it flushes. An SQNR below the bound
    names the operand of the lowest SQNR, the one the what-if table's cell shows."""
    ops = lb.losses.get(PLAN_RECIPES[name]) or []
    if not ops:
        return "not evaluated"
    size = BLOCK_SIZE[name]
    blocks = f"the {size}-value blocks its GEMMs read along them"
    # calls of different tokens: their largest common divisor is no call's count, and is not said as tokens
    uneven, tokens = lb.uneven_calls, lb.axes.get("tokens")
    # the first sampled step whose calls' tokens do not all fill this size's blocks (FP8's rule of 16 had
    # picked the step: calls of 16 and 48 tokens passed the 32-value blocks on their mean)
    odd_step = next((c for c in lb.step_calls if c[1] % size), None)
    if lb.step_calls:
        uneven = None
        tokens = lb.step_calls[0][1] if odd_step is None else odd_step[1]
        if odd_step is not None and odd_step[1] * odd_step[2] != odd_step[3]:
            uneven = (odd_step[0], odd_step[2], odd_step[3])
    axes = {**lb.axes, "tokens": tokens}
    odd = [f"{axis} {n}" for axis, n in axes.items() if n and n % size and not (axis == "tokens" and uneven)]
    calls = uneven_calls_text(*uneven, tokens, blocks) if uneven and tokens and tokens % size else ""
    if odd or calls:
        dims = f"its {' and '.join(odd)} {'is' if len(odd) == 1 else 'are'} not a multiple of {blocks}"
        return (
            (dims if odd else "")
            + (", and " if odd and calls else "")
            + calls
            + " (the kernels refuse it unpadded)"
        )
    fp4 = name != "mxfp8"
    for o in ops:
        if o.poisoned:
            return f"nan/inf in the blocks of its {o.label}"
        if math.isnan(o.sqnr_db):
            return f"its {o.label} cannot be quantised (the error sum is not finite)"
        if not fp4 and o.lost_norm > cfg.lost_norm_max:
            return f"up to {_pct(o.lost_norm)} of its {o.label}'s norm lost to flushing or saturation"
        least = cfg.block_fp4_sqnr_min_db if fp4 else cfg.block_mxfp8_sqnr_min_db
        if o.sqnr_db < least:
            # the operand of the lowest SQNR, the one the table's cell shows (the first that failed had been
            # named: a cell of 15.9 dB beside "SQNR 17.99 dB on its input (forward)")
            worst = min(
                (w for w in ops if not w.poisoned and not math.isnan(w.sqnr_db)), key=lambda w: w.sqnr_db
            )
            return f"SQNR {db_text(worst.sqnr_db, least)} on its {worst.label}"
    return ""


HEAD_WHY = (
    "FP4: not for the output head (FP4 training recipes keep the last layers in higher precision; NVIDIA's "
    "NVFP4 recipe trains them in BF16)"
)


def computed_why(how: str) -> str:
    """Why a layer whose weight is computed (``taxonomy.computed_weight_of``: ``how``) stays in bf16."""
    return (
        f"its weight is computed by {how}: a conversion to a block-scaled Linear (torchao's, as its float8 one) "
        "fails on it"
    )


def tied_why(embedding: str) -> str:
    """Why a head tied to ``embedding`` stays in bf16: the reason FP8 gives (the fp8_eligibility finding), which
    holds for the block formats too, whose recipes also swap the layer."""
    return (
        f"tied to the embedding {_name(embedding)}: the shared weight is a gather's too, and a conversion that "
        "swaps the head for a block-scaled Linear (Transformer Engine's, as its float8 one) would untie it"
    )


def zero_operand(lb: LayerBlocks) -> str:
    """The first operand of the layer whose every evaluated value was an exact zero, with no nan/inf ("" when
    none): an output gradient fp16 flushed, a dead ReLU's output. Its SQNR of inf (nothing lost) measures nothing
    of what a format does to the values the layer trains on, as FP8's eligibility says of such a gradient."""
    for ops in lb.losses.values():
        for o in ops:
            if o.values > 0 and o.nonzero == 0 and o.sum_x2 == 0 and o.poisoned == 0:
                return o.operand
    return ""


def decide(lb: LayerBlocks, cfg: AdvisorConfig, allowed: tuple[str, ...]) -> None:
    """Choose the layer's format among ``allowed`` plan names: NVFP4, else MXFP4, where FP4's bound holds on
    every operand (never for the output head); else MXFP8 where it loses nothing measurable; else bf16. Sets
    ``choice`` and ``why``. A head tied to an embedding stays in bf16, as it is not FP8-eligible either."""
    if lb.computed_weight:
        lb.choice, lb.why = "bf16", computed_why(lb.computed_weight)
        return
    if lb.tied_to is not None:
        lb.choice, lb.why = "bf16", tied_why(lb.tied_to)
        return
    zero = zero_operand(lb)
    if zero:
        lb.choice, lb.why = (
            "bf16",
            (
                f"every value of its {zero} the what-if evaluated was zero: what the block formats do to it is not measured"
            ),
        )
        return
    why: list[str] = []
    if lb.head and any(n in allowed for n in ("nvfp4", "mxfp4")):
        why.append(HEAD_WHY)
    for name in ("nvfp4", "mxfp4", "mxfp8"):
        if name not in allowed or (lb.head and name != "mxfp8"):
            continue
        fail = fails(lb, name, cfg)
        if not fail:
            lb.choice, lb.why = name, "; ".join(why)
            return
        why.append(f"{PLAN_LABELS[name]}: {fail}")
    lb.choice, lb.why = "bf16", "; ".join(why)


def block_table(
    layers: pd.DataFrame,
    summary: Mapping[str, Any] | None = None,
    cfg: AdvisorConfig | None = None,
    histograms: pd.DataFrame | None = None,
) -> list[LayerBlocks]:
    """Per linear layer, the block recipes' losses and the plan a Blackwell GPU would get, from a layers table,
    summary.json's content (for the layers' shapes) and the histograms (for the norm bounds; without them the
    recorded error sums bound the norm lost): what the report's what-if section shows."""
    tables = {"layers": layers} if histograms is None else {"layers": layers, "histograms": histograms}
    lay, hist, steps = _prepare(tables)
    run = _Run(
        lay, hist, steps, dict(summary or {}), hw_mod.preset(WHAT_IF_TARGET), True, cfg or AdvisorConfig()
    )
    if not lay.empty:
        run.order = T.module_order(lay, T.shared_params(summary)).fillna(1 << 30).astype(int).to_dict()
        run.types = lay.groupby(T.MODULE)[T.MODULE_TYPE].first().to_dict()
    out = layer_blocks(run)
    for lb in out:
        decide(lb, run.cfg, tuple(PLAN_RECIPES))
    return out


def _scaler_overflow_steps(run: _Run, modules: list[str]) -> int:
    """How many steps a loss scaler skipped held nan/inf in the output gradient of one of ``modules``."""
    skipped = _skipped_steps(run.steps, scaled=True)
    if not skipped:
        return 0
    lay = run.layers
    grads = lay[
        lay[T.STEP].isin(skipped)
        & (lay[T.TENSOR] == T.ACTIVATION_GRAD)
        & T.texts(lay[T.MODULE]).isin(modules)
    ]
    return int(grads[(grads[T.NAN] + grads[T.INF]) > 0][T.STEP].nunique())


def _kept_unevaluated_said(lbs: list[LayerBlocks]) -> str:
    """The plan's sentence on the layers it keeps in bf16 whatever their numbers (a head tied to an embedding, a
    computed weight) that no sampled step evaluated ("" when none): in the plan all the same, no run length or
    block budget changes their place. Those some of whose operands were read (a tied head's weight, read on the
    embedding's turn) say which: their operand rows show them, their layer row nothing."""
    if not lbs:
        return ""
    one = len(lbs) == 1
    read = {lb.module: ops for lb in lbs if (ops := _operands_read(lb))}
    if one and read:
        said = f" (only its {_joined(read[lbs[0].module])} was read)"
    elif read:
        each = "; ".join(f"{_name(m)}'s {_joined(o)}" for m, o in read.items())
        said = f" (of their operands, only {each} was read)"
    else:
        said = ""
    return (
        f" No sampled step evaluated {_listing([lb.module for lb in lbs], 4)}{said}: "
        f"{'it stays' if one else 'they stay'} in bf16 whatever {'its' if one else 'their'} numbers."
    )


def _joined(words: list[str]) -> str:
    """The words joined as a list is said: "a", "a and b", "a, b and c"."""
    return " and ".join(filter(None, [", ".join(words[:-1]), words[-1]]))


def _operands_read(lb: LayerBlocks) -> list[str]:
    """The operands of ``lb`` some recipe has losses for, in ``OPERANDS``' order, each once."""
    read = {o.operand for ops in lb.losses.values() for o in ops}
    return [op for op in dict.fromkeys(operand for operand, _, _ in OPERANDS) if op in read]


def _skipped_note(overflowed: int, grad_unjudged: list[str]) -> str:
    """The plan's sentence on the output gradients left out for the loss scaler's overflow ("" when none)."""
    if not overflowed:
        return ""
    alone = ""
    if len(grad_unjudged) == 1:
        alone = (
            f"; the output gradient of {_name(grad_unjudged[0])} was evaluated on those steps alone and is not "
            "judged"
        )
    elif grad_unjudged:
        alone = (
            f"; the output gradients of {_listing(grad_unjudged, 4)} were evaluated on those steps alone and are "
            "not judged"
        )
    return (
        f" The output gradients of {overflowed} step(s) the loss scaler skipped held nan/inf at its scale and are "
        f"left out: block formats scale no loss{alone}."
    )


@dataclass
class BlockPlan:
    """The rule's answer: layer -> format on a target that runs block formats (empty elsewhere), the verdict's
    sentence ("" elsewhere), and the evidence as data for the report (``what_if_data``)."""

    plan: dict[str, str]
    reason: str
    what_if: dict[str, Any]


def _cell(
    sqnr: float,
    flushed: float,
    saturated: float,
    worst: str,
    fails: str = "",
    lost_norm: float = math.nan,
    poisoned: float = 0.0,
    measured: bool = True,
) -> dict[str, Any]:
    return {
        "sqnr_db": sqnr,
        "flushed_share": flushed,
        "saturated_share": saturated,
        "lost_norm": None if math.isnan(lost_norm) else lost_norm,
        "worst": worst,
        "fails": fails,
        "poisoned_share": poisoned,  # of the values, in blocks holding nan/inf, left out of the other numbers
        "measured": measured,  # False: every block held nan/inf, and the SQNR of inf says nothing
    }


def rule_text(cfg: AdvisorConfig) -> str:
    """The plan's rule in one sentence, as the finding and the report state it."""
    return (
        f"NVFP4, else MXFP4, where every operand keeps an SQNR of at least {cfg.block_fp4_sqnr_min_db:g} dB (the "
        "norm of the whole error: FP4 flushes what lies below a quarter of a block's scale by design, and that "
        "is part of it); else MXFP8 (E4M3 elements for every operand, scales rounded up as cuBLAS and "
        f"Transformer Engine compute them) where flushing and saturation lose at most {_pct(cfg.lost_norm_max)} of "
        "each operand's L2 norm (the median over the sampled steps of an upper bound from its histogram and the "
        "exact counts, the bound per-tensor FP8 and fp16 are held to) and the SQNR is at least "
        f"{cfg.block_mxfp8_sqnr_min_db:g} dB; else bf16. The count of values flushed is shown, not judged."
    )


def what_if_data(
    table: list[LayerBlocks], cfg: AdvisorConfig, target: str, on_target: bool
) -> dict[str, Any]:
    """The block-scaled what-if as plain data (stored in ``Recommendation.block_what_if``; the report renders
    it and computes nothing): per layer the plan's choice and why, per recipe the worst operand's SQNR and the
    largest shares with the plan rule's verdict, and per operand and recipe the same. JSON-safe but for the
    float infinities (lossless SQNR), which summary.json writes as Infinity."""
    layers = []
    for lb in table:
        recipes: dict[str, Any] = {}
        # a layer not evaluated (a tied head kept in bf16 whose own turn never came) has no worst operand: the
        # few of its operands read (the shared weight) are in its operand rows; its row had shown their SQNR as
        # if it were the layer's
        for r in (*lb.losses,) if lb.evaluated else ():
            sm = lb.summary(r)
            if sm is None:
                continue
            plan_name = next((n for n, pr in PLAN_RECIPES.items() if pr == r), None)
            fail = fails(lb, plan_name, cfg) if plan_name is not None else ""
            recipes[r] = _cell(
                sm.sqnr_db,
                sm.flushed_share,
                sm.saturated_share,
                sm.worst,
                fail,
                sm.lost_norm,
                sm.poisoned_share,
                sm.measured,
            )
        operands = []
        for operand, _, gemm in OPERANDS:
            cells = {}
            for r, ops in lb.losses.items():
                o = next((o for o in ops if (o.operand, o.gemm) == (operand, gemm)), None)
                if o is not None:
                    cells[r] = _cell(
                        o.sqnr_db,
                        o.flushed_share,
                        o.saturated_share,
                        o.label,
                        lost_norm=o.lost_norm,
                        poisoned=o.poisoned_share,
                        measured=o.poisoned_share < 1.0,
                    )
            if cells:
                operands.append({"operand": operand, "gemm": gemm, "axis": GEMM_AXIS[gemm], "recipes": cells})
        layers.append(
            {
                "module": lb.module,
                "module_type": lb.module_type,
                "input_from": lb.input_from,
                "choice": lb.choice,
                "why": lb.why,
                "evaluated": lb.evaluated,
                "recipes": recipes,
                "operands": operands,
            }
        )
    return {
        "target": target,
        "on_target": on_target,
        "labels": {r: RECIPE_LABELS.get(r, r) for r in T.BLOCK_RECIPES},
        "plan_labels": dict(PLAN_LABELS),
        "rules": {
            "fp4_sqnr_min_db": cfg.block_fp4_sqnr_min_db,
            "lost_norm_max": cfg.lost_norm_max,
            "mxfp8_sqnr_min_db": cfg.block_mxfp8_sqnr_min_db,
            "text": rule_text(cfg),
        },
        "layers": layers,
    }


def _grouped(lbs: list[LayerBlocks], limit: int) -> str:
    """The layers of ``lbs`` with their reasons, those with the same reason together, the reason said once after
    them (every layer whose weight a parametrization computes has the same: said once a layer, it filled the
    plan); at most ``limit`` layers named, in the order of their reasons' first layers."""
    by_why: dict[str, list[str]] = {}
    for lb in lbs:
        by_why.setdefault(lb.why, []).append(lb.module)
    parts: list[str] = []
    named = 0
    for why, modules in by_why.items():
        if named >= limit:
            break
        shown = modules[: limit - named]
        named += len(shown)
        parts.append(", ".join(_name(m) for m in shown) + (f" ({why})" if why else ""))
    return "; ".join(parts) + (f" and {len(lbs) - named} more" if len(lbs) > named else "")


def _of_all(planned: int, unreached: list[str], kept: list[str]) -> str:
    """The title's count of the linear layers beside the plan's, when the what-if did not evaluate some ("" when it
    evaluated every one): "2 NVFP4" of a run that evaluated 2 of its 9 linear layers read as the whole model.
    ``unreached``: the layers it did not reach (no place in the plan); ``kept``: those in the plan, in bf16
    whatever their numbers, that it did not evaluate (a tied head), which the count of those not evaluated holds
    too: it had said "5 not evaluated" beside a key's "did not reach 6" and a text's "no sampled step evaluated
    lm_head"."""
    if not unreached and not kept:
        return ""
    n = len(unreached) + len(kept)
    said = f" of {planned + len(unreached)} linear layers, {n} not evaluated"
    if kept:
        one = len(kept) == 1
        among = " among them" if unreached else ""
        said += f" ({_listing(kept, 2)}{among}, kept in BF16 whatever {'its' if one else 'their'} numbers)"
    return said


def _unreached_said(unreached: list[str]) -> str:
    """The verdict's words on the linear layers the what-if did not reach ("" when none), named: "2 NVFP4 of the
    2 linear layers ...; the rest of the model follows the format above" of a run that reached 2 of 9 put the 7
    others, never evaluated, among "the rest" as if their numbers had kept them there."""
    if not unreached:
        return ""
    one = len(unreached) == 1
    return (
        f"; the what-if did not reach the other {len(unreached)} ({_listing(unreached, 4)}), "
        f"which {'has' if one else 'have'} no block format in this plan until a run evaluates "
        f"{'it' if one else 'them'}"
    )


def _moves(table: list[LayerBlocks], running: Mapping[str, str]) -> dict[tuple[str, str], list[str]]:
    """The plan's layers that already run a low-precision format (``running``: torchao's MX and NVFP4 layers by
    their block format, its float8 training layers as "fp8"), by (the format they run, the one the plan gives
    them)."""
    out: dict[tuple[str, str], list[str]] = {}
    for lb in table:
        if lb.module in running:
            out.setdefault((running[lb.module], lb.choice), []).append(lb.module)
    return out


def _running_of(table: list[LayerBlocks], running: Mapping[str, str]) -> dict[str, str]:
    """The format each layer of the table runs in this run (layer -> "mxfp8", or "fp8" for torchao's float8
    training), for the report."""
    return {lb.module: running[lb.module] for lb in table if lb.module in running}


def _label(fmt: str) -> str:
    return PLAN_LABELS.get(fmt, fmt.upper())


def _fp8_whose(how: Mapping[str, str], modules: list[str]) -> str:
    """torchao's float8 training as the run applied it to ``modules`` (``_Run.fp8_running``), in words."""
    kinds = {how.get(m, "Float8Linear") for m in modules}
    said = [
        *(["Float8Linear layers"] * ("Float8Linear" in kinds)),
        *(["nn.Linear layers whose weights quantize_ made FP8 training weights"] * ("quantize_" in kinds)),
    ]
    return f"torchao's float8 training: {' and '.join(said)}"


def _running_said(
    moves: Mapping[tuple[str, str], list[str]], limit: int, fp8_how: Mapping[str, str] | None = None
) -> str:
    """What the plan does to the layers this run already runs in a block format or in FP8, against what they run
    ("" for a run with none): a plan proposing NVFP4 for layers that already ran MXFP8 had not said they did, nor
    for layers that ran FP8, whose plan read as if they ran bf16."""
    block = {k: v for k, v in moves.items() if k[0] != FP8_RUNNING}
    fp8 = {to: v for (was, to), v in moves.items() if was == FP8_RUNNING}
    out = ""
    if block:
        now: dict[str, int] = {}
        for (was, _), modules in block.items():
            now[was] = now.get(was, 0) + len(modules)
        parts = [
            f"keeps {len(modules)} in {_label(was)} ({_listing(modules, limit)})"
            if was == to
            else f"moves {len(modules)} from {_label(was)} to {_label(to)} ({_listing(modules, limit)})"
            for (was, to), modules in block.items()
        ]
        runs = ", ".join(f"{_label(f)} on {n}" for f, n in now.items())
        whose = " and ".join(["MX"] * any(f != "nvfp4" for f in now) + ["NVFP4"] * ("nvfp4" in now))
        out += f" This run already runs {runs} of these layers (torchao's {whose} layers); the plan {'; '.join(parts)}."
    if fp8:
        every = [m for modules in fp8.values() for m in modules]
        parts = [
            f"moves {len(modules)} from FP8 to {_label(to)} ({_listing(modules, limit)})"
            for to, modules in fp8.items()
            if to != "bf16"
        ]
        if "bf16" in fp8:
            kept = fp8["bf16"]
            parts.append(
                f"gives {len(kept)} no block format ({_listing(kept, limit)}: the plan's BF16 is where no block "
                "format passes its rule, which does not judge the FP8 they run now; the FP8 eligibility finding "
                "does)"
            )
        out += (
            f" This run already runs FP8 on {len(every)} of these layers ({_fp8_whose(fp8_how or {}, every)}): "
            "for them a block format is a what-if against the FP8 they run, not against bf16, judged on the "
            f"same high-precision operands their FP8 casts read; the plan {'; '.join(parts)}."
        )
    return out


def _running_title(moves: Mapping[tuple[str, str], list[str]]) -> str:
    """The title's words on the layers the run already runs in a block format or in FP8 ("" for none)."""
    now: dict[str, int] = {}
    for (was, _), modules in moves.items():
        now[was] = now.get(was, 0) + len(modules)
    return "".join(f"; {n} run {_label(f)} now" for f, n in now.items())


def _block_setting(run: _Run) -> Mapping[str, Any]:
    """The capture summary's ``block_formats`` entry ({} when the run has none)."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    setting = capture.get("block_formats") if isinstance(capture, Mapping) else None
    return setting if isinstance(setting, Mapping) else {}


def _short_of_estimates(setting: Mapping[str, Any]) -> bool:
    """Whether the block budget measured the what-if's cost too few times to put more layers in a group
    (``capture.block_budget.MIN_ESTIMATES_TO_WIDEN``): then the groups were never chosen from the budget."""
    done, needed = setting.get("estimates"), setting.get("estimates_to_widen")
    return (
        bool(setting.get("adaptive")) and isinstance(done, int) and isinstance(needed, int) and done < needed
    )


def _reach_remedy(setting: Mapping[str, Any]) -> str:
    """What covers the layers the sampled steps did not reach, for this run's ``block_formats`` setting. A larger
    block budget only where it chose the groups: the budget starts with one layer a group and puts more in one
    only after a few estimates, which a run of a few sampled steps never makes (block_budget=10, 100 times the
    default, still evaluated 1 of 15 layers where the finding had said a larger one covers them)."""
    turns = "Profiler(block_groups=1) evaluates every layer on every sampled step"
    more = "more sampled steps (a longer run, a small sample_every, a larger overhead_budget) give every group its turn"
    if _short_of_estimates(setting):
        return (
            "a larger Profiler(block_budget=...) does not: the budget puts more than one layer in a group only once "
            "several sampled steps have measured what the what-if costs, more than this run had; "
            f"{turns}, and {more}"
        )
    if setting.get("adaptive"):
        return f"a larger Profiler(block_budget=...) puts more layers in a group; {turns}, and {more}"
    return f"{more}, and {turns}"


def _recipe_hint(planned: Mapping[str, int]) -> str:
    """The recipes to run the plan's layers with, naming only the formats it plans some layer in (``planned``:
    the count of layers each format of ``PLAN_RECIPES`` and "bf16" got); a plan of bf16 alone converts nothing.
    A plan of BF16 for every layer said "Run the NVFP4 and MXFP4 layers with NVIDIA's NVFP4 training recipe ...
    and the MXFP8 layers with ..." of layers it had none of."""
    fp4 = [PLAN_LABELS[k] for k in ("nvfp4", "mxfp4") if planned.get(k)]
    parts = (
        [
            f"the {' and '.join(fp4)} layer{'s' if sum(planned.get(k, 0) for k in ('nvfp4', 'mxfp4')) != 1 else ''} "
            "with NVIDIA's NVFP4 training recipe (random Hadamard transform on the weight-gradient inputs, "
            "stochastic rounding of gradients, the last layers in bf16)"
        ]
        if fp4
        else []
    ) + (
        [
            f"the MXFP8 layer{'s' if planned['mxfp8'] != 1 else ''} with Transformer Engine's MXFP8BlockScaling "
            "(or torchao's MX training)"
        ]
        if planned.get("mxfp8")
        else []
    )
    if not parts:
        return "Nothing converts: the plan keeps every layer it evaluated in bf16."
    return "Run " + " and ".join(parts) + ("; keep the bf16 layers in bf16." if planned.get("bf16") else ".")


def _rule_block_formats(
    run: _Run, plan: _Plan, dims: Mapping[str, Mapping[str, int]] | None = None
) -> BlockPlan | None:
    cfg = run.cfg
    native = run.hw.block_formats
    here = tuple(n for n, hw_name in PLAN_NATIVE.items() if hw_name in native)
    target = run.hw if here else hw_mod.preset(WHAT_IF_TARGET)
    allowed = here or tuple(n for n, hw_name in PLAN_NATIVE.items() if hw_name in target.block_formats)
    table = layer_blocks(run, dims)
    if not table:
        return None
    for lb in table:
        decide(lb, cfg, allowed)
    by: dict[str, list[LayerBlocks]] = {k: [] for k in (*PLAN_RECIPES, "bf16")}
    for lb in table:
        by[lb.choice].append(lb)
    lim = cfg.max_listed_modules

    def worst(name: str, attr: str) -> float | None:
        """The worst value of a summary attribute over the layers planned in ``name``."""
        vals = [getattr(s, attr) for lb in by[name] if (s := lb.summary(PLAN_RECIPES[name])) is not None]
        vals = [v for v in vals if not math.isnan(v)]
        if not vals:
            return None
        return min(vals) if attr == "sqnr_db" else max(vals)

    def listed(name: str) -> str:
        lbs = by[name]
        if not lbs:
            return ""
        head = f"{PLAN_LABELS[name]} for {len(lbs)}: "
        if name == "bf16" or any(lb.why for lb in lbs):
            return head + _grouped(lbs, lim)
        return head + _listing([lb.module for lb in lbs], lim)

    counts = ", ".join(f"{len(by[k])} {PLAN_LABELS[k]}" for k in (*PLAN_RECIPES, "bf16") if by[k])
    evaluated = [lb.module for lb in table if lb.evaluated]
    partial = [lb for lb in table if lb.input_from is None and lb.evaluated]
    overflowed = _scaler_overflow_steps(run, [lb.module for lb in table])
    sampled = int(run.layers[T.STEP].nunique())
    where = f"{target.name} (compute capability {'.'.join(map(str, target.compute_capability or ()))})"
    rule = (
        f"Each of the {len(evaluated)} linear layers was judged on every operand its three GEMMs would quantise, "
        f"{_judged_on(run, evaluated, sampled)}."
        if evaluated
        else "No linear layer was evaluated: none has block statistics to judge."  # (only an embedding had a turn)
    )
    method = (
        "A linear layer's operands: forward, its input and weight along in_features; input gradient, its output "
        "gradient and weight along out_features; weight gradient, its output gradient and input along the "
        f"tokens. The plan: {rule_text(cfg)}"
    )
    result = ". ".join(s for s in (listed(k) for k in (*PLAN_RECIPES, "bf16")) if s)
    judged = {lb.module for lb in table}
    unjudged = [
        m for m in plan.matmul_layers if taxonomy.is_linear_type(run.types.get(m, "")) and m not in judged
    ]
    note = (
        f" The input of {_listing([lb.module for lb in partial], 4)} is not a module's output it can be matched "
        "to, so its input operand is not judged."
        if partial
        else ""
    ) + (
        f" The what-if evaluated {len(evaluated)} of the {len(table) + len(unjudged)} linear layers: the capture "
        "deals them into groups that take turns over the sampled steps, and this run's sampled steps did not "
        f"reach {_listing(unjudged, 4)}, which have no block statistics and no place in this plan "
        f"({_reach_remedy(_block_setting(run))})."
        if unjudged
        else ""
    )
    kept = [lb for lb in table if not lb.evaluated]
    note += _kept_unevaluated_said(kept)
    note += _head_said(run, table)
    running = _running_of(table, run.running_formats)
    moves = _moves(table, running)
    note += _running_said(moves, lim, run.fp8_running)
    note += _skipped_note(overflowed, [lb.module for lb in table if lb.gradient_skipped])
    numbers: dict[str, Number] = {
        "checked": len(evaluated),
        "not_evaluated": len(table) - len(evaluated) + len(unjudged),
        "kept_unevaluated": len(kept) or None,
        "layers_nvfp4": len(by["nvfp4"]),
        "layers_mxfp4": len(by["mxfp4"]),
        "layers_mxfp8": len(by["mxfp8"]),
        "layers_bf16": len(by["bf16"]),
        "running_block_format": sum(len(m) for (was, _), m in moves.items() if was != FP8_RUNNING),
        "moved_block_format": sum(len(m) for (was, to), m in moves.items() if was not in (to, FP8_RUNNING)),
        "running_fp8": sum(len(m) for (was, _), m in moves.items() if was == FP8_RUNNING),
        "nvfp4_worst_sqnr_db": worst("nvfp4", "sqnr_db"),
        "nvfp4_max_flushed_share": worst("nvfp4", "flushed_share"),
        "mxfp4_worst_sqnr_db": worst("mxfp4", "sqnr_db"),
        "mxfp4_max_flushed_share": worst("mxfp4", "flushed_share"),
        "mxfp8_worst_sqnr_db": worst("mxfp8", "sqnr_db"),
        "mxfp8_max_lost_norm": worst("mxfp8", "lost_norm"),
        "mxfp8_max_flushed_share": worst("mxfp8", "flushed_share"),
        "mxfp8_max_saturated_share": worst("mxfp8", "saturated_share"),
        "fp4_sqnr_min_db": cfg.block_fp4_sqnr_min_db,
        "lost_norm_max": cfg.lost_norm_max,
        "mxfp8_sqnr_min_db": cfg.block_mxfp8_sqnr_min_db,
    }
    recipe_hint = _recipe_hint({k: len(v) for k, v in by.items()})
    if here:
        plan.add(
            Finding(
                "block_format_plan",
                INFO,
                f"Block formats on {target.preset or target.name}: {counts}{_of_all(len(table), unjudged, [lb.module for lb in kept])}"
                f"{_running_title(moves)}",
                f"{where} runs MX and NVFP4 block formats in hardware. {rule} {result}.{note}",
                recipe_hint,
                modules=[lb.module for lb in table if lb.choice != "bf16"],
                numbers=numbers,
                method=method,
            )
        )
        reason = (
            f"Block formats on {where}: {counts} of the {len(table) + len(unjudged)} linear layers"
            f"{_unreached_said(unjudged)} (see the finding “Block formats” for the numbers); the rest of the "
            f"model follows the format above.{_running_said(moves, 4, run.fp8_running)}"
        )
        what_if = what_if_data(table, cfg, str(target.preset or target.name), True)
        return BlockPlan(
            {lb.module: lb.choice for lb in table},
            reason,
            {**what_if, "not_evaluated": unjudged, "running": running},
        )
    plan.add(
        Finding(
            "block_format_what_if",
            INFO,
            f"On a {target.name} the block formats would give: {counts}{_of_all(len(table), unjudged, [lb.module for lb in kept])}"
            f"{_running_title(moves)}",
            f"{run.hw.name} runs no block-scaled format in hardware; on a {where}, which runs MX and NVFP4 "
            f"formats natively, the plan would be: {result}. {rule}{note}",
            f"Plan for Blackwell with precprof report RUN_DIR --target {WHAT_IF_TARGET}; there: {recipe_hint}"
            if any(by[k] for k in PLAN_RECIPES)
            else f"Nothing to plan for Blackwell: on a {target.name} the plan keeps every layer it evaluated in bf16.",
            modules=[],
            numbers=numbers,
            method=method,
        )
    )
    what_if = what_if_data(table, cfg, str(target.preset or target.name), False)
    return BlockPlan({}, "", {**what_if, "not_evaluated": unjudged, "running": running})

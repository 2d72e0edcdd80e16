"""What the mixed-precision guide keeps in fp32, found running in fp16 or bf16: softmax, normalisation layers
and losses (their outputs' dtypes), normalisation buffers such as BatchNorm's running statistics, and optimizer
states (the memory table's dtypes)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import pandas as pd

from precprof import formats, taxonomy
from precprof import tables as T
from precprof.analysis.advisor.evidence import _dtype_has, _norm_inputs_from, _Plan, _Run
from precprof.analysis.advisor.model import INFO, WARNING, Finding, Number
from precprof.analysis.advisor.rules.norm_square import _FP16_SQUARE_OVERFLOW_EXPONENT
from precprof.analysis.advisor.text import _listing

_LOW = ("float16", "bfloat16")
_WHY = {
    taxonomy.NORM: "normalisation (a mean and a variance over many values)",
    taxonomy.SOFTMAX: "softmax (exponentials and a sum)",
    taxonomy.LOSS: "the loss (log-probabilities and a mean)",
}


def _lose(what: list[str]) -> str:
    """The verb after ``_WHY``'s nouns: "normalisation (...) loses", "softmax (...), the loss (...) lose"."""
    return "loses" if len(what) == 1 else "lose"


def _rule_fp32_ops(run: _Run, plan: _Plan) -> None:
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    autocast = bool(run.autocast.get("enabled"))
    device = str(run.autocast.get("device_type") or "")
    acts = run.kind(T.ACTIVATION)
    if not acts.empty:
        kinds = acts[T.MODULE_TYPE].map(taxonomy.kind_of_type)
        sensitive = acts[kinds.isin(list(_WHY))]
        for dtype in _LOW:
            rows = sensitive[_dtype_has(sensitive, dtype)]
            if rows.empty:
                continue
            mods = run.sort(list(dict.fromkeys(rows[T.MODULE])))
            fmt = "fp16" if dtype == "float16" else "bf16"
            if autocast:
                _under_autocast(run, plan, rows, dtype, device)
                continue
            # the guide keeps these reductions in fp32 whatever the format: a hand cast (a model cast whole, or
            # these modules cast alone inside an fp32 run) is a warning in bf16 as in fp16, unless the module
            # computed in fp32 inside (it kept fp32 tensors for its backward, as transformers' RMSNorm does)
            saved = _saved_activation_dtypes(run)
            types = dict(zip(rows[T.MODULE], rows[T.MODULE_TYPE], strict=True))
            in_fp32, alike = _computed_in_fp32(mods, types, saved)
            torchs = [m for m in _torchs(capture, mods) if m not in in_fp32]
            unknown = [m for m in mods if m not in saved and m not in alike and m not in torchs]
            wide = _squared_wide(run, unknown) if dtype == "float16" else []
            mods = [
                m for m in mods if m not in in_fp32 and m not in alike and m not in wide and m not in torchs
            ]
            if not mods:
                continue
            what = sorted(
                {
                    _WHY[taxonomy.kind_of_type(t)]
                    for m, t in zip(rows[T.MODULE], rows[T.MODULE_TYPE], strict=True)
                    if m in mods
                }
            )
            how = _what_autocast_does(
                [t for m, t in zip(rows[T.MODULE], rows[T.MODULE_TYPE], strict=True) if m in mods], dtype
            )
            if all(m in saved for m in mods):
                how += f" They kept no fp32 tensor for their backward: they computed in {fmt}."
            else:
                how += (
                    f" (Whether they computed in {fmt} inside is not known: no sampled step measured what they kept "
                    f"for their backward{_checkpointed(capture)}.)"
                )
            how += _cleared(in_fp32, alike, types, dtype, run.cfg.max_listed_modules, torchs)
            if wide:
                how += (
                    f" ({_listing(wide, run.cfg.max_listed_modules)} also produced float16 outputs, and their fp16 "
                    "inputs held values of |x| >= 256, whose fp16 square is inf, without the zeros a norm squaring "
                    "in fp16 makes of such a row: they computed their statistics in fp32 inside.)"
                )
            remedy = (
                f"Keep them in fp32: cast {_listing(mods, run.cfg.max_listed_modules)} back with .float(), "
                f"their inputs with them (x.float()) and their outputs back to {dtype} for the layers that read them "
                f"(a {dtype} Linear refuses an fp32 input), or compute the statistics in fp32 inside the module (upcast "
                "its input before the reduction and cast the result back, as transformers' RMSNorm does), or train "
                "under torch.autocast with fp32 weights, which casts op by op."
            )
            plan.keep_fp32_ops += [m for m in mods if m not in plan.keep_fp32_ops]
            plan.add(
                Finding(
                    f"{fmt}_fp32_ops",
                    WARNING,
                    f"{len(mods)} module(s) the guide keeps in fp32 ran in {fmt}",
                    f"{_listing(mods, run.cfg.max_listed_modules)} produced {dtype} outputs: "
                    f"{', '.join(what)} {_lose(what)} accuracy in {fmt}"
                    + (", and fp16's range overflows or underflows there" if fmt == "fp16" else "")
                    + "."
                    + how,
                    remedy,
                    modules=mods,
                    numbers={"modules": len(mods), "autocast": 0},
                )
            )
    _rule_low_precision_loss(run, plan, capture)
    _rule_low_precision_buffers(run, plan, capture)
    opt = _optimizer_state_dtypes(run)
    low = {d: b for d, b in opt.items() if d in _LOW}
    if low:
        total = sum(opt.values())
        plan.add(
            Finding(
                "low_precision_optimizer_states",
                WARNING,
                "Optimizer states held in 16-bit",
                f"{sum(low.values()):,} of {total:,} optimizer-state bytes are "
                + " and ".join(sorted(low))
                + ": Adam's second moment (the square of the gradient) underflows fp16 for gradients below "
                "2^-12 and loses bits in bf16, and the first moment rounds away small gradients.",
                "Keep optimizer states in fp32 (fp32 master weights with autocast do), or use an optimizer "
                "built for 16-bit states (Kahan summation, stochastic rounding).",
                numbers={"low_precision_bytes": sum(low.values()), "bytes": total},
            )
        )


def _what_autocast_does(types: list[str], dtype: str) -> str:
    """What training under autocast (fp32 weights, ops cast one by one) would change for these module types, a
    model cast whole to ``dtype`` aside: the ops of its fp32 list run in fp32 (``CUDA_AUTOCAST_FP32``'s modules);
    BatchNorm and InstanceNorm it leaves in their input's dtype, with their weights and running statistics in
    fp32, as the kernels take them; a module of the model's own code computes what its code says."""
    kinds = set(types)
    listed = sorted(t for t in kinds if t in CUDA_AUTOCAST_FP32)
    batch = sorted(t for t in kinds if _BATCH_NORMS.match(t))
    own = sorted(kinds - set(listed) - set(batch))
    said = []
    if listed:
        said.append(f"Autocast runs {', '.join(listed)} in fp32 (CUDA autocast's fp32 ops)")
    if batch:
        said.append(
            f"autocast leaves {', '.join(batch)} in its input's dtype, its weights and running statistics in fp32"
        )
    if own:
        said.append(
            f"{', '.join(own)} computes in autocast what its own code does (only the ops autocast lists run in fp32)"
        )
    text = "; ".join(said)
    return f" {text[0].upper()}{text[1:]}; a model cast with .to({dtype}) or .half(), or a module cast by hand, keeps none of this."


_BATCH_NORMS = re.compile(r"(Lazy)?(Sync)?(BatchNorm|InstanceNorm)\dd$|SyncBatchNorm$")

_FREQUENCIES = re.compile(r"freq|theta", re.IGNORECASE)  # inv_freq, original_inv_freq, freqs, theta


# torch's own modules whose op CUDA autocast runs in fp32 (its AutocastCUDA kernel: tests check this table
# against the dispatcher); BatchNorm and InstanceNorm are not among them, on any device
CUDA_AUTOCAST_FP32 = {
    "LayerNorm": "aten::layer_norm",
    "GroupNorm": "aten::group_norm",
    "RMSNorm": "aten::rms_norm",
    "Softmax": "aten::softmax.int",
    "Softmin": "aten::softmax.int",
    "LogSoftmax": "aten::log_softmax.int",
    "CrossEntropyLoss": "aten::log_softmax.int",
    "NLLLoss": "aten::nll_loss",
    "MSELoss": "aten::mse_loss",
    "L1Loss": "aten::l1_loss",
    "SmoothL1Loss": "aten::smooth_l1_loss",
    "HuberLoss": "aten::huber_loss",
    "KLDivLoss": "aten::kl_div",
    "BCEWithLogitsLoss": "aten::binary_cross_entropy_with_logits",
    "PoissonNLLLoss": "aten::poisson_nll_loss",
    "CosineEmbeddingLoss": "aten::cosine_embedding_loss",
    "MarginRankingLoss": "aten::margin_ranking_loss",
    "HingeEmbeddingLoss": "aten::hinge_embedding_loss",
    "SoftMarginLoss": "aten::soft_margin_loss",
    "TripletMarginLoss": "aten::triplet_margin_loss",
    "MultiLabelMarginLoss": "aten::multilabel_margin_loss",
    "MultiMarginLoss": "aten::multi_margin_loss",
}


def _under_autocast(run: _Run, plan: _Plan, rows: pd.DataFrame, dtype: str, device: str) -> None:
    """Norms, softmax and losses that produced 16-bit outputs under autocast, which casts the inputs of the ops
    it lists, not modules. Torch's own modules whose op CUDA autocast runs in fp32 (``CUDA_AUTOCAST_FP32``): this
    device's autocast chose 16-bit (CPU autocast lists no norm or softmax), information. Any other module (the
    model's own code, as transformers' RMSNorm, or BatchNorm) produces what its code computes on every device:
    one that kept fp32 tensors for its backward (the memory table) computed in fp32 and rounded only its output,
    no finding; the others are information, with how to compute their statistics in fp32. torch's LayerNorm,
    GroupNorm and RMSNorm (``_torchs``) compute in fp32 inside whatever dtype CPU autocast leaves them: none."""
    fmt = "fp16" if dtype == "float16" else "bf16"
    types = dict(zip(rows[T.MODULE], rows[T.MODULE_TYPE], strict=True))
    mods = run.sort(list(types))
    torchs = _torchs(run.summary.get(T.SUMMARY_CAPTURE) or {}, mods)
    mods = [m for m in mods if m not in torchs]
    cast_there = [m for m in mods if types[m] in CUDA_AUTOCAST_FP32] if device != "cuda" else []
    saved = _saved_activation_dtypes(run)
    in_fp32, alike = _computed_in_fp32([m for m in mods if m not in cast_there], types, saved)
    own = [m for m in mods if m not in cast_there and m not in in_fp32 and m not in alike]
    if not cast_there and not own:
        return
    listed = run.cfg.max_listed_modules
    what = sorted({_WHY[taxonomy.kind_of_type(types[m])] for m in cast_there + own})
    parts, remedies = [], []
    if cast_there:
        parts.append(
            f"{_listing(cast_there, listed)} produced {dtype} outputs: autocast on {device or 'this device'} runs "
            f"them in their input's dtype ({fmt} here), and CUDA autocast runs them in fp32."
        )
        remedies.append(
            "Nothing to do on a GPU; on this device, call them on an fp32 input (x.float()): the next layer's "
            "autocast casts their fp32 output back, and torch.autocast(enabled=False) around them alone changes "
            f"nothing, as their input stays {fmt}."
        )
    if own:
        measured = all(m in saved for m in own)
        parts.append(
            f"{_listing(own, listed)} produced {dtype} outputs by their own code: autocast casts the inputs of the "
            "ops it lists, not modules, so on any device they compute what their code says"
            + (
                f", and they kept no fp32 tensor for their backward: they computed in {fmt}."
                if measured
                else f" (whether that is {fmt} inside is not known: no sampled step measured what they kept for "
                f"their backward{_checkpointed(run.summary.get(T.SUMMARY_CAPTURE) or {})})."
            )
        )
        remedies.append(
            f"{'For ' + _listing(own, listed) + ': c' if cast_there else 'C'}ompute the statistics in fp32 inside the "
            "module: upcast its input (x.float()) before the reduction and cast the result back to x's dtype, as "
            "transformers' RMSNorm does."
        )
    rest = _cleared(in_fp32, alike, types, dtype, listed, torchs)
    plan.add(
        Finding(
            f"{fmt}_fp32_ops",
            INFO,
            f"{len(cast_there) + len(own)} module(s) the guide keeps in fp32 ran in {fmt}",
            " ".join(parts)
            + f" {', '.join(what)[0].upper()}{', '.join(what)[1:]} {_lose(what)} accuracy in {fmt}"
            + (", and fp16's range overflows or underflows there" if fmt == "fp16" else "")
            + "."
            + rest,
            " ".join(remedies),
            modules=cast_there + own,
            numbers={"modules": len(cast_there) + len(own), "autocast": 1},
        )
    )


def _computed_in_fp32(
    mods: list[str], types: Mapping[str, str], saved: Mapping[str, set[str]]
) -> tuple[list[str], list[str]]:
    """Of ``mods`` (16-bit outputs), those that kept fp32 tensors for their backward (they computed in fp32), and
    those that kept nothing measured (inside an activation checkpoint: its first forward keeps nothing of theirs)
    whose class is one that computed in fp32 wherever it was measured: the same code, taken to compute alike
    (transformers' RMSNorm in every checkpointed block, its final norm outside them measured)."""
    in_fp32 = [m for m in mods if "float32" in saved.get(m, ())]
    low = {types[m] for m in mods if m in saved and m not in in_fp32}
    fp32_types = {types[m] for m in in_fp32} - low
    alike = [m for m in mods if m not in saved and types[m] in fp32_types]
    return in_fp32, alike


def _squared_wide(run: _Run, mods: list[str]) -> list[str]:
    """Of ``mods`` (norms with fp16 outputs whose saved tensors tell nothing), those whose fp16 input held values
    of |x| >= 256 on a step whose output held fewer exact zeros beyond its input's than one row (its weight's size,
    the normalised dimension), that input finite: a norm squaring in fp16 makes inf of such a value and 0 of its
    whole row (fp16_norm_overflow), so these squared in a wider format (T5LayerNorm's variance in fp32). One such
    step tells. A step's input is the norm's own input row, or the output row of the module that made it where
    that row holds as many values as the norm's output on the step (T5's dropout runs again after the blocks: its
    row then holds both calls, and the norm reads its own input from the next sampled step on)."""
    if not mods:
        return []
    weights = run.kind(T.WEIGHT)
    acts = run.kind(T.ACTIVATION)
    names = T.texts(acts[T.MODULE])
    makers = _norm_inputs_from(run)
    big: dict[
        int, pd.Series
    ] = {}  # per table of per-step histograms: values of |x| >= 256 per (module, step)
    out = []
    for m in mods:
        row = weights.loc[
            (weights[T.MODULE] == m).to_numpy() & (weights[T.PARAM] == "weight").to_numpy(), T.NUMEL
        ]
        if row.empty:
            continue
        mine = acts[(names == m).to_numpy()].groupby(T.STEP)[[T.ZEROS, T.NUMEL]].sum()
        own = run.norm_inputs
        sources = [
            (T.input_module(m), own[(own[T.MODULE] == T.input_module(m)).to_numpy()], run.norm_input_hist)
        ]
        if len(makers.get(m, [])) == 1:
            sources.append((makers[m][0], acts[(names == makers[m][0]).to_numpy()], run.hist))
        if any(_wide_step(module, rows, hist, mine, int(row.max()), big) for module, rows, hist in sources):
            out.append(m)
    return out


def _wide_step(
    module: str,
    rows: pd.DataFrame,
    hist: pd.DataFrame,
    mine: pd.DataFrame,
    row: int,
    big: dict[int, pd.Series],
) -> bool:
    """Whether on a step the fp16 rows of ``module`` (a norm's input) held as many values as the norm's output
    (``mine``: its zeros and values per step), all finite, some of |x| >= 256 (``hist``), and the output fewer
    zeros beyond theirs than one ``row``: ``_squared_wide``'s evidence."""
    if rows.empty:
        return False
    if id(hist) not in big:
        h = hist[
            (hist[T.EXPONENT] >= _FP16_SQUARE_OVERFLOW_EXPONENT).to_numpy()
            & (hist[T.TENSOR] == T.ACTIVATION).to_numpy()
        ]
        big[id(hist)] = h.groupby([T.texts(h[T.MODULE]).to_numpy(), h[T.STEP].to_numpy()])[T.COUNT].sum()
    for step, at in rows[_dtype_has(rows, "float16").to_numpy()].groupby(T.STEP):
        if step not in mine.index or int(at[T.NUMEL].sum()) != int(mine.at[step, T.NUMEL]):
            continue
        finite = int((at[T.NAN] + at[T.INF]).sum()) == 0
        held = int(big[id(hist)].get((module, step), 0))
        if finite and held and int(mine.at[step, T.ZEROS]) - int(at[T.ZEROS].sum()) < row:
            return True
    return False


def _torchs(capture: Mapping[str, Any], mods: list[str]) -> list[str]:
    """Of ``mods``, torch's LayerNorm, GroupNorm and RMSNorm (summary capture.norms_fp32_inside): they compute in
    fp32 inside by their code on every device, whatever they kept for their backward (16-bit on the CPU), and
    under CPU autocast, which leaves their output in their input's dtype, they still do."""
    known = set(capture.get("norms_fp32_inside") or ())
    return [m for m in mods if m in known]


def _cleared(
    in_fp32: list[str],
    alike: list[str],
    types: Mapping[str, str],
    dtype: str,
    listed: int,
    torchs: list[str] | None = None,
) -> str:
    """The sentences on the modules ``_computed_in_fp32`` found computing in fp32, and on torch's norms that do
    (``_torchs``): no finding of theirs."""
    said = ""
    if torchs:
        classes = ", ".join(sorted({types[m] for m in torchs}))
        said += (
            f" ({_listing(torchs, listed)} also produced {dtype} outputs, but torch's {classes} computes its "
            "statistics in fp32 inside and rounds only its output.)"
        )
    if in_fp32:
        said += (
            f" ({_listing(in_fp32, listed)} also produced {dtype} outputs and kept fp32 tensors for their backward: "
            "they computed in fp32 and rounded only their outputs.)"
        )
    if alike:
        classes = ", ".join(sorted({types[m] for m in alike}))
        said += (
            f" ({_listing(alike, listed)} produced {dtype} outputs and kept nothing measured for their backward, but "
            f"are of a class ({classes}) that computed in fp32 wherever it was measured: the same code, taken to "
            "compute alike.)"
        )
    return said


def _checkpointed(capture: Mapping[str, Any]) -> str:
    """Why a module kept nothing measured, when the run checkpointed activations: what its first forward keeps
    of a checkpointed block's modules is nothing at all."""
    if not capture.get("checkpointed_forwards"):
        return ""
    return (
        ", and under activation checkpointing a checkpointed block keeps nothing of its modules' on the first "
        "forward"
    )


def _saved_activation_dtypes(run: _Run) -> dict[str, set[str]]:
    """Per module, the dtypes of the activations it kept for its backward on the steps that measured memory
    (the memory table; empty without one)."""
    mem = run.memory
    if mem.empty or T.COMPONENT not in mem:
        return {}
    acts = mem[(mem[T.COMPONENT] == T.ACTIVATIONS) & (mem[T.BYTES] > 0)]
    out: dict[str, set[str]] = {}
    for module, dtype in zip(acts[T.MODULE], acts[T.DTYPE], strict=True):
        out.setdefault(str(module), set()).add(str(dtype))
    return out


def _rule_low_precision_buffers(run: _Run, plan: _Plan, capture: Mapping[str, Any]) -> None:
    """Floating buffers held in 16-bit (``capture.low_precision_buffers``), by what they hold: a normalisation's
    running statistics (small updates accumulate in them: keep the module in fp32); a rotary embedding's
    frequencies (a cast rounded them, and the angle's error grows with the position); other constants a cast
    rounded (information). Buffers whose values a cast cannot have changed (0/1 masks, small integers, powers of
    two: ``exact``) are no finding, nor are a parametrization's (spectral_norm's power-iteration vectors)."""
    bufs = [b for b in capture.get("low_precision_buffers") or [] if isinstance(b, Mapping)]
    if not bufs:
        return
    acts = run.kind(T.ACTIVATION)
    types = dict(zip(acts[T.MODULE], acts[T.MODULE_TYPE], strict=True)) if not acts.empty else {}

    def named(group: list[Mapping[str, Any]]) -> str:
        return _listing(
            [f"{_buffer_name(b)} ({b.get('dtype')})" for b in group],
            run.cfg.max_listed_modules,
        )

    stats, freqs, consts = [], [], []
    for b in bufs:
        mtype = str(b.get("module_type") or types.get(str(b.get("module", "")), ""))
        if taxonomy.is_parametrization_type(mtype):
            # spectral_norm's power-iteration vectors (_u, _v): each training forward iterates them again from the
            # weight, so what a 16-bit value rounds is iterated away, neither accumulated nor kept as a constant
            continue
        if taxonomy.kind_of_type(mtype) == taxonomy.NORM or str(b.get("buffer", "")).startswith("running_"):
            stats.append(b)
        elif b.get("exact") is True:
            continue
        elif _FREQUENCIES.search(str(b.get("buffer", ""))):
            freqs.append(b)
        else:
            consts.append(b)
    if stats:
        mods = run.sort(list(dict.fromkeys(str(b.get("module", "")) for b in stats)))
        plan.keep_fp32_ops += [m for m in mods if m not in plan.keep_fp32_ops]
        # the same modules named for computing in 16-bit (a BatchNorm of a model cast with .half()): one cast
        # back keeps both in fp32, said once rather than read as two problems
        ops = [
            f
            for f in plan.findings
            if f.code in ("fp16_fp32_ops", "bf16_fp32_ops") and any(m in f.modules for m in mods)
        ]
        both = [m for m in mods if any(m in f.modules for f in ops)]
        plan.add(
            Finding(
                "low_precision_buffers",
                WARNING,
                f"{len(stats)} normalisation buffer(s) held in 16-bit",
                f"{named(stats)}: running statistics accumulate small updates (momentum 0.1 of a batch statistic) "
                "that a 16-bit value rounds away, and fp16's range clips a running variance."
                + (
                    f" {_listing(both, run.cfg.max_listed_modules)} also computed in 16-bit "
                    f"({' and '.join(f.code for f in ops)}): one .float() of each keeps both its computation and "
                    "its statistics in fp32."
                    if both
                    else ""
                ),
                "Keep normalisation modules and their buffers in fp32 (module.float()).",
                modules=mods,
                numbers={"buffers": len(stats)},
            )
        )
    cast = "a cast of the whole model (model.to(torch.bfloat16), model.half()) casts its buffers with its parameters"
    if freqs:
        rounding = [float(b["rounding"]) for b in freqs if isinstance(b.get("rounding"), (int, float))]
        worst = max(rounding) if rounding else None
        dtypes = sorted({str(b.get("dtype")) for b in freqs})
        bits = min(formats.get("bf16" if d == "bfloat16" else "fp16").mantissa_bits + 1 for d in dtypes)
        how_far = (
            f"each may lie up to {worst:.3g} from its value before the cast (half a unit in the last place), which "
            f"turns the angle at position 1,024 by up to {1024 * worst:.3g} rad and at position 4,096 by up to "
            f"{4096 * worst:.3g} rad (3.14 rad is half a turn)"
            if worst is not None
            else "the error of each grows with the position it turns"
        )
        plan.add(
            Finding(
                "low_precision_rope",
                WARNING,
                f"Rotary position frequencies held in {' and '.join(dtypes)}",
                f"{named(freqs)}: a rotary position embedding turns the vectors at position p by p times each "
                f"frequency. Held in {bits} significant bits, {how_far}. A model pretrained with fp32 frequencies, "
                "or evaluated or served with them, attends by other angles than these; a model trained from scratch "
                f"in this run learns with other constants. {cast[0].upper()}{cast[1:]}.",
                _rope_remedy(run),
                modules=run.sort(list(dict.fromkeys(str(b.get("module", "")) for b in freqs))),
                numbers={
                    "buffers": len(freqs),
                    "frequency_error": worst,
                    "angle_error_at_4096": (4096 * worst if worst is not None else None),
                },
            )
        )
    if consts:
        rounding = [float(b["rounding"]) for b in consts if isinstance(b.get("rounding"), (int, float))]
        plan.add(
            Finding(
                "low_precision_constants",
                INFO,
                f"{len(consts)} constant buffer(s) rounded to 16-bit",
                f"{named(consts)}: buffers the forward reads that are not normalisation statistics (nothing "
                "accumulates in them), holding values 16-bit rounds"
                + (
                    f" (each may lie up to {max(rounding):.3g} from its value before a cast)"
                    if rounding
                    else ""
                )
                + f". Where {cast}, the model computes with other constants than it was built or pretrained with.",
                "If a cast rounded them, build or load the model in 16-bit rather than casting it, or recompute "
                "them in fp32 after the cast.",
                modules=run.sort(list(dict.fromkeys(str(b.get("module", "")) for b in consts))),
                numbers={"buffers": len(consts), "buffer_error": max(rounding) if rounding else None},
            )
        )


def _buffer_name(b: Mapping[str, Any]) -> str:
    """A buffer's qualified name: module.buffer, a root module's buffer by its own name."""
    module = str(b.get("module") or "")
    return f"{module}.{b.get('buffer')}" if module else str(b.get("buffer"))


def _rope_remedy(run: _Run) -> str:
    """How to keep rotary frequencies in fp32: load the model in 16-bit rather than cast it, or recompute them
    after the cast; under Lightning's "-true" precisions the cast is Lightning's (``HalfPrecision.convert_module``
    casts the whole module with .to() before ``on_fit_start``, however the model was loaded)."""
    config = run.run_config
    after = ".float() restores their dtype, not the bits the cast rounded away."
    if config.get("source") == T.SOURCE_LIGHTNING and str(config.get("lightning_precision", "")).endswith(
        "-true"
    ):
        return (
            f'Lightning\'s precision="{config["lightning_precision"]}" casts the whole module with .to() before '
            "on_fit_start, buffers included, however the model was loaded: recompute them in fp32 in the "
            "LightningModule's on_fit_start (a transformers rotary embedding m: replace it with type(m)(m.config), "
            f"built again, on m's device). {after}"
        )
    return (
        "Build or load the model in 16-bit rather than casting it (transformers' from_pretrained(..., "
        f"dtype=torch.bfloat16) keeps these buffers in fp32), or recompute them in fp32 after the cast: {after}"
    )


def _rule_low_precision_loss(run: _Run, plan: _Plan, capture: Mapping[str, Any]) -> None:
    """The loss tensor handed to ``Profiler.step`` was fp16 or bf16 (``F.cross_entropy`` on the logits of a model
    cast to 16-bit: autocast computes it in fp32, a cast model does not). A loss module whose output was 16-bit
    is already the fp32-ops finding; this catches the loss computed by a function."""
    dtypes = capture.get("loss_dtypes") if isinstance(capture, Mapping) else None
    if not isinstance(dtypes, Mapping) or not dtypes:
        return
    total = sum(int(v) for v in dtypes.values())
    reported = {f.code for f in plan.findings}
    losses = run.steps[T.LOSS].dropna() if T.LOSS in run.steps else run.steps.iloc[0:0]
    losses = losses[losses.map(math.isfinite)] if len(losses) else losses
    final = float(losses.iloc[-1]) if len(losses) and float(losses.iloc[-1]) != 0.0 else None
    for dtype in _LOW:
        n = int(dtypes.get(dtype, 0))
        fmt = "fp16" if dtype == "float16" else "bf16"
        if not n or (f"{fmt}_fp32_ops" in reported and _loss_module_in(run, dtype)):
            continue
        bits = formats.get(fmt).mantissa_bits
        numbers: dict[str, Number] = {"steps": n, "steps_with_loss_tensor": total}
        grid = ""
        if final is not None:
            spacing = 2.0 ** (math.floor(math.log2(abs(final))) - bits)
            numbers["final_loss"], numbers["spacing"] = final, spacing
            grid = (
                f" At the final loss {final:.4g}, {fmt} values are {spacing:.3g} apart: a change of the loss "
                "smaller than that does not show, and runs compared by their loss differ by steps of it."
            )
        plan.add(
            Finding(
                f"{fmt}_loss",
                WARNING,
                f"The loss was computed in {fmt}",
                f"The loss tensor handed to precprof was {dtype} on {n:,} of {total:,} steps: the log-probabilities "
                f"and their mean were rounded to {fmt} ({bits + 1} significant bits), and the logits' gradient "
                f"(softmax minus one-hot) starts from {fmt} values.{grid}",
                "Compute the loss from fp32 logits: F.cross_entropy(logits.float(), targets). Autocast does "
                "this for F.cross_entropy; a model cast with .to(torch.bfloat16) or .half() does not.",
                numbers=numbers,
            )
        )


def _loss_module_in(run: _Run, dtype: str) -> bool:
    """Whether a loss module's activation rows hold ``dtype`` outputs (the fp32-ops finding lists it)."""
    acts = run.kind(T.ACTIVATION)
    if acts.empty:
        return False
    loss = acts[acts[T.MODULE_TYPE].map(taxonomy.kind_of_type) == taxonomy.LOSS]
    return bool(_dtype_has(loss, dtype).any()) if not loss.empty else False


def _optimizer_state_dtypes(run: _Run) -> dict[str, int]:
    """Optimizer-state bytes by dtype at the last sampled step of the memory table (empty without one)."""
    mem = run.memory
    if mem.empty or T.COMPONENT not in mem:
        return {}
    rows = mem[mem[T.COMPONENT] == T.OPTIMIZER_STATES]
    if rows.empty:
        return {}
    rows = rows[rows[T.STEP] == rows[T.STEP].max()]
    return {str(d): int(b) for d, b in rows.groupby(T.DTYPE)[T.BYTES].sum().items()}

"""What a finding's numbers are called on the page, and how each one is written.

A finding carries its numbers under short machine names (``share_at_recommended``, ``loss_scale_log2``) for
``recommendation.json`` and scripts. The page shows each under a label a reader understands, formatted by what
it is, and leaves out what was not measured (None) and what only repeats another number. Every name a rule can
emit has an entry here (``tests/test_report.py`` collects the names from the rules' source); a name a later
rule adds without one is still shown, under its machine name, and fails that test.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from precprof.tables import module_in_prose

from .filters import count, log2mag, nbytes, num, pct, plain, pow2

# kind -> formatter
_KINDS = {
    "share": pct,
    "count": count,
    "scale": pow2,
    "scale_log2": lambda v: pow2(2.0 ** float(v)),
    "magnitude": log2mag,
    "bytes": nbytes,
    "number": num,
    "text": plain,
    "module": module_in_prose,  # a value among numbers: "0", an nn.Sequential's child, is a name, not a count
    "yes_no": lambda v: "yes" if v else "no",
    "change": lambda v: ("+" if float(v) > 0 else "") + pct(v),
    "step": lambda v: f"step {int(v)}",
    "db": lambda v: f"{float(v):.1f} dB",
}

HIDDEN = None  # in recommendation.json only: it repeats a number the page already shows

# name -> (label, kind); a (code, name) entry wins over the name's own
LABELS: dict[Any, tuple[str, str] | None] = {
    # fp16 gradient underflow
    "share_now": ("lost in FP16 at this run's loss scale (exact count)", "share"),
    "share_at_scale_1": ("lost in FP16 without loss scaling", "share"),
    "share_at_recommended": ("lost in FP16 at the recommended loss scale", "share"),
    "share_at_run_scale": ("lost in FP16 at this run's loss scale (from the histograms)", "share"),
    # a share at a scale some rows were held a fraction of a binade away from: bounded
    "share_at_run_scale_at_least": (
        "lost in FP16 at this run's loss scale, at least (from the histograms)",
        "share",
    ),
    "share_at_run_scale_at_most": (
        "lost in FP16 at this run's loss scale, at most (from the histograms)",
        "share",
    ),
    "run_scale": ("this run's loss scale", "scale"),
    "loss_scale_log2": ("recommended loss scale", "scale_log2"),
    "run_scale_log2": ("this run's loss scale", "scale_log2"),
    "nonzero_values": ("nonzero values counted", "count"),
    "underflow_values": ("values that underflow", "count"),
    "underflow_at_recommended": ("values lost at the recommended loss scale", "count"),
    "boundary_values_at_recommended": ("values exactly on the rounding boundary there (round to 0)", "count"),
    "overflow_at_recommended": ("values that overflow at the recommended loss scale", "count"),
    "overflow_values": ("values that overflow", "count"),
    "fp16_zero_share": ("zeros among the FP16 activation gradients", "share"),
    "fp16_flushed": ("gradients pressed against FP16's floor", "yes_no"),
    "fp16_flushed_zero_share": (
        "flushed zeros among the FP16 activation gradients no mask wrote into",
        "share",
    ),
    "fp16_flushed_share_of": ("modules whose zeros that share counts", "text"),
    "fp16_flushed_at_most": (
        "FP16 activation gradients flushed at most (their share of zeros, flushed or not)",
        "share",
    ),
    "fp16_smallest_nonzero": ("smallest nonzero FP16 activation gradient", "magnitude"),
    "fp16_subnormal_share": ("FP16 subnormals among those gradients' nonzero values (below 2^-14)", "share"),
    "skipped_steps_left_out": ("sampled steps left out (the loss scaler skipped them)", "count"),
    "kept_fp32_left_out": ("layers kept in FP32 whose FP32 gradients are left out", "count"),
    "autocast_fp32_left_out": ("modules autocast ran in FP32 whose FP32 gradients are left out", "count"),
    # fp16 without loss scaling
    "modules_at_floor": ("modules whose gradients run into FP16's floor", "count"),
    "max_floor_share": (
        "most of a module's nonzero gradient values at FP16's smallest subnormal (2^-24)",
        "share",
    ),
    "loss_change": ("loss change over the run", "change"),
    "weight_grad_share_at_recommended": (
        "weight-gradient values lost at the recommended loss scale",
        "share",
    ),
    "max_module_norm_share_at_recommended": (
        "largest share of one module's gradient norm lost at the recommended loss scale",
        "share",
    ),
    "max_norm_share_module": ("that module", "module"),
    # loss scale and overflow
    "grad_absmax": ("largest gradient magnitude", "magnitude"),
    "scaled_absmax": ("largest gradient times the loss scale", "magnitude"),
    "fitting_scale_log2": (
        "largest loss scale that keeps the largest gradient below the headroom",
        "scale_log2",
    ),
    "margin": ("headroom kept below FP16's maximum", "number"),
    "loss_scale": ("loss scale", "scale"),
    "max_scale": ("largest loss scale in effect", "scale"),
    "steps_excluded": ("steps left out (non-finite gradients)", "count"),
    "absmax": ("largest magnitude", "magnitude"),
    "limit": ("FP16 limit checked against", "magnitude"),
    "observed_inf_modules": ("modules that produced inf", "count"),
    "passed_on_modules": ("element-wise modules passing those values on, not counted again", "count"),
    "cast_inf_values": ("values fp16 autocast's cast for a matmul made inf", "count"),
    "modules": ("modules", "count"),
    "still_needed": ("layers kept in FP32 that FP16 still needs there", "count"),
    "released": ("layers kept in FP32 free to run in FP16 again", "count"),
    "values": ("values", "count"),
    "steps": ("sampled steps", "count"),
    ("bf16_loss", "steps"): ("steps whose loss tensor was BF16", "count"),
    "parameters": ("parameters", "count"),
    ("gradients_not_applied", "parameters"): ("parameters with a gradient and no update", "count"),
    ("gradients_not_applied", "steps"): ("sampled steps the optimizer stepped without them", "count"),
    ("fp16_loss", "steps"): ("steps whose loss tensor was FP16", "count"),
    "steps_with_loss_tensor": ("steps that handed precprof a loss tensor", "count"),
    "final_loss": ("final loss", "number"),
    "spacing": ("spacing of the format's values at the final loss", "number"),
    ("fp16_gradient_overflow", "values"): ("gradient values that overflow FP16", "count"),
    ("fp16_norm_overflow", "zeros"): ("exact zeros in the norms' outputs", "count"),
    ("fp16_norm_overflow", "values"): ("the norms' output values", "count"),
    ("fp16_norm_overflow", "share"): ("share of the norms' outputs that is zeros", "share"),
    ("fp16_norm_overflow", "norms"): ("norms whose x.pow(2) overflowed FP16", "count"),
    ("fp16_norm_overflow", "input_zeros"): ("exact zeros in the norms' inputs", "count"),
    "zeros": ("exact zeros", "count"),
    "norms": ("norms", "count"),
    "input_zeros": ("exact zeros in its input", "count"),
    "input_values_at_least_256": ("input values of |x| >= 256 (their square beyond FP16's 65504)", "count"),
    ("fp16_gradient_overflow", "steps"): ("sampled steps with overflow", "count"),
    ("bf16_activation_overflow", "values"): ("values that overflow BF16", "count"),
    # the scaler
    "skipped": ("steps skipped", "count"),
    "avoidable": ("skips a better initial scale avoids", "count"),
    "growth_probes": ("skips the scaler grew into after its first step that went through", "count"),
    "spikes": (
        "skips above the recommended scale, at or below one earlier steps had gone through at",
        "count",
    ),
    "from_model": ("skips from non-finite values in the model itself", "count"),
    "nonfinite_loss": ("skips on steps whose loss was nan/inf (no loss scale avoids them)", "count"),
    "nonfinite_loss_step": ("first step skipped with a nan/inf loss", "step"),
    "start_scale": ("initial loss scale", "scale"),
    "last_scale": ("loss scale at the end", "scale"),
    "steps_without_update": ("sampled steps without an optimizer step", "count"),
    "sampled_steps_with_grads": ("sampled steps with weight gradients", "count"),
    "steps_other_optimizer": ("sampled steps an optimizer the Profiler was not given stepped", "count"),
    # layers whose weights got no gradient (rules/no_gradient.py)
    "no_gradient_layers": ("layers whose weight gradient was zero on every sampled step", "count"),
    "weight_gradient_layers": ("layers with a weight gradient recorded", "count"),
    "no_gradient_steps_min": ("fewest sampled steps one of them recorded its weight gradient on", "count"),
    "optimizer_steps_sampled": (
        "sampled steps the optimizer stepped on with a nonzero learning rate",
        "count",
    ),
    "fp8_flushed_layers": ("of them, layers FP8 left without a gradient", "count"),
    # modules that never ran (rules/unused.py)
    "unused_modules": ("modules with parameters that never ran", "count"),
    "unused_param_elements": ("their parameters", "count"),
    "param_elements": ("the model's parameters", "count"),
    "unused_param_share": ("share of the model's parameters", "share"),
    # biases a torchao training weight's F.linear leaves out (rules/biases.py)
    "bias_dropped_layers": ("linear layers whose bias is never added", "count"),
    "bias_dropped_values": ("values in those biases", "count"),
    "bias_dropped_absmax": ("largest |bias| among them", "number"),
    "bias_dropped_own_forward": ("of them, with a forward of their own (not run)", "count"),
    "fp8_output_gradient_max": ("largest output gradient the FP8 cast flushed whole", "magnitude"),
    # what a norm's fp16 overflow (fp16_norm_overflow) did to the gradients
    "fp16_norm_overflow_layers": ("of them, starved by a norm's fp16 overflow", "count"),
    "fp16_norm_overflow_norms": ("the norms whose fp16 x.pow(2) overflowed", "text"),
    "norm_overflow_left_out": ("modules left out: a norm's fp16 overflow zeroed their gradients", "count"),
    "norm_overflow_zeros": ("their zeros, left out (the norm's, not underflow)", "count"),
    "first_ok_scale": ("scale of the first step that went through", "scale"),
    "recommended_scale": ("recommended initial loss scale", "scale"),
    "start_scale_limit": (
        "the most an initial loss scale can be (the largest gradient is known only as a lower bound)",
        "scale",
    ),
    "above_start_limit": (
        "skips above the most a start can be (whether a start there avoids them is unknown)",
        "count",
    ),
    ("scaler_skipped_steps", "steps"): ("steps in the run", "count"),
    "lowest_scale": ("lowest loss scale the run reached", "scale"),
    "scale_resets": ("resumes that put the loss scale back to its initial value", "count"),
    "skipped_after_divergence": ("steps skipped from the divergence on (loss non-finite)", "count"),
    "steps_before_divergence": ("steps before the divergence", "count"),
    "growths": ("times the scale grew", "count"),
    "costly_growths": ("growths that overflowed at the grown scale (a step skipped)", "count"),
    "later_skips": ("skips after the first good step", "count"),
    "steps_after": ("steps after the first good step", "count"),
    "growth_interval": ("this run's growth_interval", "count"),
    "recommended_growth_interval": ("recommended growth_interval", "count"),
    # clipping
    ("grad_norm_scaled", "steps"): ("sampled steps with a gradient norm", "count"),
    "scaled_steps": ("steps whose norm was still scaled", "count"),
    "median_ratio": ("median ratio of that norm to the weight gradients' norm", "number"),
    # weight updates
    "lost": ("sampled updates lost", "count"),
    "nonzero_updates": ("sampled nonzero updates counted", "count"),
    "sampled_share": ("share of the sampled updates lost, each parameter's sample counted alike", "share"),
    # a cap: a 32x32 weight's sample holds 205 (capture/records.py, sample_stride)
    "update_sample": ("elements sampled per parameter, at most", "count"),
    "nonfinite_updates": ("updates that were nan or inf, left out", "count"),
    "zero_gradient_updates": ("updates of weights with a zero gradient, left out", "count"),
    "zero_gradient_lost": ("of those, lost", "count"),
    "held_apart_updates": ("updates of weights held in another dtype, left out", "count"),
    "held_apart_lost": ("of those, lost if held in the format", "count"),
    "held_from_step": ("step from which the weights are held in the format", "step"),
    "lost_in_fp32": ("of those, lost in the run's fp32 weights already", "count"),
    "params_hardly_trained": ("parameters that lost most of their own updates", "count"),
    "param_share_max": ("the most one parameter lost of its updates", "share"),
    "share": ("share", "share"),
    ("bf16_lost_updates", "share"): ("share of updates lost (each parameter at its size)", "share"),
    "waiting": ("updates that did not move their weight on their step (carried to a later one)", "count"),
    "carried_share": ("share of updates carried to a later step (each parameter at its size)", "share"),
    ("fp16_lost_updates", "share"): ("share of updates lost (each parameter at its size)", "share"),
    ("fp32_lost_updates", "share"): ("share of updates lost (each parameter at its size)", "share"),
    ("fp32_lost_updates", "ratio_median"): ("median update-to-weight ratio over the layers", "number"),
    ("bf16_gradient_underflow", "share"): ("share of nonzero values lost", "share"),
    ("fp16_activation_underflow", "share"): ("share of nonzero values lost", "share"),
    ("mixed_precision_inactive", "share"): ("share of matmul layers in FP32", "share"),
    ("mixed_precision_partial", "share"): ("share of matmul layers in FP32", "share"),
    # non-finite values
    "step": ("first step", "step"),
    "nan": ("nan values", "count"),
    "inf": ("inf values", "count"),
    "steps_affected": ("sampled steps affected", "count"),
    "sampled_before": ("last sampled step before it", "step"),
    "sampled_after": ("first sampled step after it", "step"),
    "optimizer_step": ("the next step the optimizer stepped at (or skipped)", "step"),
    "weight_grad_modules_nonfinite": ("modules whose weight gradient holds nan/inf", "count"),
    "grad_peak": ("largest gradient magnitude in those steps", "magnitude"),
    "weights_step": ("last step with finite weights", "step"),
    # (rules/nonfinite._skips: whether the step's optimizer step was skipped, a flag, not the scaler's count)
    ("nonfinite_forward", "skipped"): ("its optimizer step skipped", "yes_no"),
    ("nonfinite_backward", "skipped"): ("its optimizer step skipped", "yes_no"),
    "skipped_from": ("first of the consecutive skipped steps around it", "step"),
    "skipped_to": ("last of the consecutive skipped steps around it", "step"),
    "skipped_steps": ("consecutive steps skipped", "count"),
    "weight_modules": ("modules with non-finite weights", "count"),
    "finite_modules": ("modules recorded, all finite", "count"),
    "eps": ("optimizer eps", "magnitude"),
    "beta2": ("optimizer beta2", "number"),
    "gradient_bound": ("gradient below which (1 - beta2) g² rounds to 0 in fp16", "magnitude"),
    "gradients_below": ("weight-gradient values below it (at least)", "count"),
    "gradients": ("nonzero weight-gradient values", "count"),
    ("run_diverged", "step"): ("first step with a non-finite loss", "step"),
    ("run_diverged", "steps"): ("recorded steps with a non-finite loss", "count"),
    "diverged_step": ("step the run diverged at", "step"),
    "last_step": ("last recorded step", "step"),
    "last_finite_loss": ("last finite loss", "number"),
    # requested precision not active
    "requested": ("requested precision", "text"),
    "fp32_layers": ("matmul layers in FP32", "count"),
    "float64_layers": ("matmul layers in float64", "count"),
    "float64_param_share": ("share of parameter elements in float64", "share"),
    "matmul_layers": ("matmul layers", "count"),
    "autocast_enabled": ("autocast on during the forward pass", "yes_no"),
    # expert weights multiplied in float32 (rules/active.py)
    "banks": ("mixture-of-experts modules in FP32", "count"),
    "experts_uncounted": ("mixture-of-experts modules whose FLOPs are not counted", "count"),
    "unconverted_uncounted": ("other modules whose matmul FLOPs are not counted", "count"),
    "multiplied_outside": (
        "layers whose weight the code around them multiplies, their forward never run",
        "count",
    ),
    "expert_params": ("their expert parameters", "count"),
    "share_of_params": ("share of the model's parameters", "share"),
    # keep-in-fp32 modules, buffers, optimizer states
    "autocast": ("under autocast", "yes_no"),
    "buffers": ("buffers", "count"),
    "frequency_error": ("largest error a cast may have put in a frequency", "number"),
    "angle_error_at_4096": ("angle error at position 4,096 (rad)", "number"),
    "buffer_error": ("largest error a cast may have put in a value", "number"),
    "low_precision_bytes": ("in 16-bit", "bytes"),
    "bytes": ("in all", "bytes"),
    # hardware
    "device": ("device", "text"),
    "name": ("name", "text"),
    "compute_capability": ("compute capability", "text"),
    "fp8_library": ("FP8 library", "text"),
    "float32_matmul_precision": ("torch.get_float32_matmul_precision()", "text"),
    "n_params": ("parameters", "count"),
    "threshold": ("threshold", "number"),
    ("small_model", "threshold"): ("below", "count"),
    # shapes and fp8
    "alignment": ("multiple required", "count"),
    "layers": ("layers off it", "count"),
    "tokens": ("tokens per call", "count"),
    "row_layers": ("linear layers whose GEMM rows a call (not batch x sequence) are off it", "count"),
    "checked": ("linear layers checked", "count"),
    "not_evaluated": ("layers not evaluated", "count"),
    "eligible": ("FP8-eligible", "count"),
    "block_running": (
        "linear layers left out: they already train in an MX format (torchao's MX training)",
        "count",
    ),
    "eligible_flops_share": (
        "their share of the matmul FLOPs of the model's layers (linear layers, experts, nn.MultiheadAttention's "
        "projections and scores, recurrent gates, convolutions; matmuls in forward code, einsum, bmm, @, "
        "attention scores, left out)",
        "share",
    ),
    "experts_flops_share": ("share of the FLOPs in experts float8 conversion leaves in bf16", "share"),
    "unconverted_flops_share": (
        "share of the FLOPs in attention projections and scores, recurrent layers and convolutions (left in bf16)",
        "share",
    ),
    "max_e4m3_share": ("most E4M3 values flushed (inputs, weights; not judged)", "share"),
    "max_e5m2_share": ("most E5M2 values flushed (output gradients; not judged)", "share"),
    "max_e4m3_lost_norm": (
        "up to this share of the norm E4M3 loses, in the input or weight that loses the most (an upper bound)",
        "share",
    ),
    "max_e5m2_lost_norm": (
        "up to this share of the norm E5M2 loses, in the output gradient that loses the most (an upper bound)",
        "share",
    ),
    "max_pushed_subnormal": (
        "most values a judged tensor's largest 0.1% push below FP8's smallest normal (a weight, or a tensor read "
        "in one call a step)",
        "share",
    ),
    "max_pushed_pooled": (
        "most values a tensor's largest 0.1% push below FP8's smallest normal, several calls a step read at the "
        "largest call's scale (not judged)",
        "share",
    ),
    "max_below_normal": (
        "at most this share of a tensor's values below FP8's smallest normal at the power-of-two scale its "
        "largest sets (not judged)",
        "share",
    ),
    "below_normal_tensors": (
        "tensors with more of their values below FP8's smallest normal than the outlier check allows (not judged)",
        "count",
    ),
    "amax_floor_layers": (
        "layers a tensor of which had its largest value under torchao's amax floor, 1e-12 (scaled by fmax/1e-12)",
        "count",
    ),
    "pushed_subnormal_max": ("share of values pushed below FP8's smallest normal allowed", "share"),
    "sampled_steps": ("sampled steps", "count"),
    ("fp8_speed", "layers"): ("GEMMs FP8 would convert (a call of an FP8-eligible layer each)", "count"),
    "frozen_layers": ("converted layers that are frozen (no weight gradient)", "count"),
    ("fp8_speed", "layers_bf16"): (
        "GEMMs left in bf16, each call's (the other linear layers, experts, attention projections and score "
        "matmuls, gates, convolutions)",
        "count",
    ),
    "estimated_speedup": ("estimated FP8 speedup of a training step", "number"),
    "layers_speedup": ("estimated FP8 speedup of the eligible layers' GEMMs and casts", "number"),
    "gemm_share": ("their GEMMs' estimated share of a bf16 step", "share"),
    "flops_share": ("their share of the FLOPs of the GEMMs the estimate counts", "share"),
    "intensity": ("GEMM intensity M K N / (M K + K N + M N), summed over them", "number"),
    "speedup_min": ("speedup FP8 must exceed", "number"),
    "tied": ("tied to an embedding", "count"),
    "forward_only": ("judged on the forward alone (no output gradient)", "count"),
    "fp16_overflow_steps": ("sampled steps whose nan/inf came from an fp16 overflow, left out", "count"),
    "unknown_shape": ("shape unknown", "count"),
    "small_layers_left_out": ("misaligned layers too small to matter, left out", "count"),
    # block-scaled formats (rules/blocks.py)
    "layers_nvfp4": ("layers planned in NVFP4", "count"),
    "layers_mxfp4": ("layers planned in MXFP4", "count"),
    "layers_mxfp8": ("layers planned in MXFP8", "count"),
    "layers_bf16": ("layers kept in BF16", "count"),
    "running_block_format": ("layers this run already runs in a block format (torchao's MX layers)", "count"),
    "moved_block_format": ("of those, layers the plan gives another format", "count"),
    "running_fp8": ("layers this run already runs in FP8 (torchao's float8 training)", "count"),
    "nvfp4_worst_sqnr_db": ("lowest SQNR of an NVFP4 layer's operand", "db"),
    "nvfp4_max_flushed_share": ("largest share flushed in an NVFP4 layer's operand", "share"),
    "mxfp4_worst_sqnr_db": ("lowest SQNR of an MXFP4 layer's operand", "db"),
    "mxfp4_max_flushed_share": ("largest share flushed in an MXFP4 layer's operand", "share"),
    "mxfp8_worst_sqnr_db": ("lowest SQNR of an MXFP8 layer's operand", "db"),
    "mxfp8_max_flushed_share": ("largest share flushed in an MXFP8 layer's operand", "share"),
    "mxfp8_max_saturated_share": ("largest share saturated in an MXFP8 layer's operand", "share"),
    "fp4_sqnr_min_db": ("FP4: lowest SQNR allowed", "db"),
    "mxfp8_max_lost_norm": ("largest share of an MXFP8 layer's operand norm lost", "share"),
    "lost_norm_max": ("largest share of a tensor's norm allowed to be lost", "share"),
    "mxfp8_sqnr_min_db": ("MXFP8: lowest SQNR allowed", "db"),
    ("block_format_plan", "checked"): ("linear layers evaluated", "count"),
    ("block_format_what_if", "checked"): ("linear layers evaluated", "count"),
    # the layers the what-if did not reach, and those it keeps in bf16 unevaluated (a tied head whose turn did not
    # come): the title's count ("did not reach 6" beside a title's "5 not evaluated" and a tied head not reached)
    ("block_format_plan", "not_evaluated"): ("linear layers not evaluated", "count"),
    ("block_format_what_if", "not_evaluated"): ("linear layers not evaluated", "count"),
    "kept_unevaluated": (
        "of those, kept in BF16 whatever their numbers (a tied head, a computed weight)",
        "count",
    ),
    # the decision
    "demoted_from": ("the advisor's severity for an fp16 run", "text"),
}


def label(code: str, name: str) -> tuple[str, str] | None:
    """(label, kind) for a finding's number, None when the page leaves it out; unknown names as they are."""
    if (code, name) in LABELS:
        return LABELS[(code, name)]
    if name in LABELS:
        return LABELS[name]
    if name.startswith("dim_"):  # tensor_core_alignment: one per model dimension off the multiple
        return (name[4:].replace("_", " "), "count")
    return (name, "number")


def _measured(value: Any) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def _repeats(name: str, numbers: Mapping[str, Any]) -> bool:
    """Whether ``name`` only repeats another of the finding's numbers: at a run's loss scale of 1, the share lost
    in FP16 without loss scaling (the histograms' lower bound) is what the exact count ``share_now`` shows, which
    also counts the values lying exactly on 2^-25 that round to 0 (a bf16 run showed 0.316% beside 0.318%). The
    histograms' share at the run's loss scale is that count's estimate, and at scale 1 the share without loss
    scaling: shown only where neither is (a GradScaler run whose activation gradients were all fp16, which no
    exact count reads, showed its share at scale 1 alone)."""
    unscaled = numbers.get("run_scale_log2") == 0
    if (
        name == "run_scale_log2"
    ):  # the scale itself, where the finding gives it (an older one gives its log2 alone)
        return _measured(numbers.get("run_scale"))
    if name in ("share_at_run_scale", "share_at_run_scale_at_least", "share_at_run_scale_at_most"):
        return unscaled or _measured(numbers.get("share_now"))
    return name == "share_at_scale_1" and unscaled and _measured(numbers.get("share_now"))


def shown(code: str, numbers: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """The (label, text) pairs the page shows for a finding, in the rule's order."""
    out: list[tuple[str, str]] = []
    for name, value in (numbers or {}).items():
        if not _measured(value):
            continue  # not measured: the message says why
        entry = label(code, name)
        if entry is None or _repeats(name, numbers or {}):
            continue
        text, kind = entry
        # (a string as it is, but a module's name: the root's is "")
        out.append((text, value if isinstance(value, str) and kind != "module" else _KINDS[kind](value)))
    return out

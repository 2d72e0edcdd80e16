"""The decision: from the findings and the target machine to one format, loss scale and keep list."""

from __future__ import annotations

from collections.abc import Mapping

from precprof import tables as T
from precprof.analysis.advisor.config import AdvisorConfig
from precprof.analysis.advisor.evidence import _Plan, _Run
from precprof.analysis.advisor.model import CRITICAL, INFO, WARNING, Recommendation
from precprof.analysis.advisor.rules.fp8 import (
    FORWARD_CODE_UNCOUNTED,
    _and,
    held_back_remedy,
    speed_keep_remedy,
    token_counts,
)
from precprof.analysis.advisor.text import _g, _listing, _loss_scale_said, _name, _pct, _pow2, _scale
from precprof.taxonomy import FP8_DIM_MULTIPLE


def _not_measured(run: _Run, plan: _Plan) -> str:
    """What a reason says of a figure no sampled step recorded."""
    if plan.weights_only:
        return (
            "not measured: this run recorded weights and inputs but no layer's output or gradient (no "
            "forward pass finished a layer on a sampled step)"
        )
    if not plan.measured:
        return f"not measured: this run recorded no per-layer statistics {_why_unsampled(run)}"
    if plan.forward_broken and plan.gradients_measured:
        return "not measured: every sampled step's forward pass was already non-finite, and its gradients with it"
    if plan.gradients_valueless:
        return (
            "not measured: every gradient value the sampled steps recorded was zero, inf or nan, none a finite "
            "nonzero value to place against a format's range"
        )
    return "not measured: no gradient was recorded on a sampled step (no backward pass was seen)"


def _why_unsampled(run: _Run) -> str:
    """Why a run recorded no per-layer statistics, in parentheses (``_Run.unsampled_cause``), and how to record
    them."""
    cause = run.unsampled_cause
    if cause == "interval 0":
        return (
            f"({T.sample_every_setting(run.run_config, '0')} records none); profile with "
            f"{T.sample_every_setting(run.run_config)} to measure it"
        )
    if cause is not None:
        return (
            f"({cause}); Triton keeps them in its cache, so a longer run, or the same run again, measures it"
        )
    return f"(no step was sampled); profile with {T.sample_every_setting(run.run_config, '1')} to measure it"


def _fp8_numbers_why_not(plan: _Plan, cfg: AdvisorConfig) -> str:
    """Why what FP8 would do to the numbers rules it out ("" when it allows it): no eligible layer, or too small
    a share of the matmul FLOPs in the eligible layers (below ``cfg.fp8_flops_share_min`` the bf16 rest does
    most of the work anyway)."""
    if not plan.fp8_checked and plan.fp8_block_running:
        return (
            f"every one of its {len(plan.fp8_block_running)} linear layers already trains in a block-scaled "
            "format (torchao's MX or NVFP4 training), none is left for per-tensor FP8"
        )
    if not plan.fp8_checked:
        return "no linear layer was recorded, so none can be shown to be FP8-eligible"
    why = plan.fp8_why_not
    tied = [m for m, w in why.items() if w.startswith("tied")]
    causes = (
        f" ({_listing(tied, 4)} {'is' if len(tied) == 1 else 'are'} tied to an embedding)" if tied else ""
    )
    if plan.fp8_tokens:
        n = len(plan.fp8_tokens)
        causes += (
            f" (the tokens per call of {_name(next(iter(plan.fp8_tokens))) if n == 1 else f'{n} of them'}, "
            f"{token_counts(plan)}, {'is' if len(set(plan.fp8_tokens.values())) == 1 else 'are'} not a multiple "
            f"of {FP8_DIM_MULTIPLE})"
        )
    causes += _uneven_causes(plan)
    if plan.fp8_expert_tokens:
        causes += (
            f" ({len(plan.fp8_expert_tokens)} of them are routed experts whose tokens per call follow the routing, "
            f"not a multiple of {FP8_DIM_MULTIPLE})"
        )
    if not plan.fp8_eligible:
        return f"none of its {plan.fp8_checked} linear layers is FP8-eligible{causes}"
    share = plan.fp8_flops_share
    if share is None or share <= cfg.fp8_flops_share_min:
        return (
            f"the {len(plan.fp8_eligible)} FP8-eligible of {plan.fp8_checked} linear layers carry "
            f"{_pct(share)} of {_flops_whose(plan)}, not more than {_pct(cfg.fp8_flops_share_min)}{causes}: the rest "
            "would run in bf16 anyway"
        )
    return ""


def _uneven_causes(plan: _Plan) -> str:
    """The layers whose calls had different tokens on a step, as a cause that holds them back from FP8 ("" for
    none): " (the calls of fc had different tokens on a step, and the largest number dividing each call's tokens,
    4, is not a multiple of 16)"; of several, " (the calls of each of 2 of them ...: 4 and 8, are not ...)"."""
    if not plan.fp8_uneven:
        return ""
    n = len(plan.fp8_uneven)
    divisors = sorted({u[3] for u in plan.fp8_uneven.values()})
    shown = _and([str(d) for d in divisors])
    return (
        f" (the calls of {_name(next(iter(plan.fp8_uneven))) if n == 1 else f'each of {n} of them'} had different "
        "tokens on a step, and the largest number dividing "
        + ("each call's tokens" if n == 1 else "a layer's calls' tokens")
        + f", {shown}, "
        + (
            f"is not a multiple of {FP8_DIM_MULTIPLE})"
            if len(divisors) == 1
            else f"are not multiples of {FP8_DIM_MULTIPLE})"
        )
    )


def _fp8_speed_text(plan: _Plan) -> str:
    est = plan.fp8_speed
    if est is None:
        return ""
    return (
        f"at these GEMM shapes FP8 would run a training step at an estimated {est.speedup_launch_bound:.2f}x of "
        f"bf16's speed with launches as timed call by call, {est.speedup_gpu_bound:.2f}x if the host keeps ahead "
        "of the GPU (from each layer shape's times measured alone and whole steps measured in FP8 and bf16, not "
        "from this run: see the finding on FP8's speed)"
    )


def _flops_whose(plan: _Plan) -> str:
    """Whose matmul FLOPs the eligible layers' share is of: the linear layers', or the step's with the matmuls
    float8 conversion leaves in bf16 counted (a mixture of experts' expert GEMMs, nn.MultiheadAttention's
    projections, recurrent layers, convolutions)."""
    missing = (
        f" (the experts of {_listing(plan.fp8_experts_uncounted, 4)} not counted: they stay in bf16)"
        if plan.fp8_experts_uncounted
        else ""
    )
    left = [
        f"{what} {_pct(share)}"
        for what, share in (
            ("the experts'", plan.fp8_experts_share),
            (plan.fp8_others_whose, plan.fp8_others_share),
        )
        if share is not None
    ]
    if not left:
        return f"the matmul FLOPs of the model's linear layers ({FORWARD_CODE_UNCOUNTED}){missing}"
    # the share is of all of them: those left in bf16 are part of the whole, not of the eligible layers' share;
    # of the layers' matmuls, not of the forward code's (``FORWARD_CODE_UNCOUNTED``)
    return (
        f"the matmul FLOPs of the model's layers, {' and '.join(left)} (which stay in bf16) among them "
        f"({FORWARD_CODE_UNCOUNTED}){missing}"
    )


def _fp8_why_not(plan: _Plan, cfg: AdvisorConfig) -> str:
    """Why FP8 is not advised on FP8 hardware, saying what decided it ("" when it is advised): what FP8 would do
    to the numbers (``_fp8_numbers_why_not``), or, where the numbers allow it, its speed: the conservative end of
    FP8's estimated speedup of a training step at these GEMM shapes (``analysis.fp8_speed``: the lower of the
    host-bound and the GPU-bound estimate) not above ``cfg.fp8_speedup_min``. Where the other end is above it,
    the text says FP8 may pay on such a step, to be measured."""
    if plan.fp8_unjudged:
        return f"FP8 eligibility was not judged: {plan.fp8_unjudged}"
    numbers = _fp8_numbers_why_not(plan, cfg)
    speed = _fp8_speed_text(plan)
    if numbers:
        # (every layer eligible, and too small a share of the FLOPs in them: the modules that float8 conversion
        # does not swap decided, by their type)
        shapes = plan.fp8_checked and set(plan.fp8_why_not) <= plan.fp8_shape_blocked
        return (
            f"the layers themselves decided (their type, shape, tie or tokens per call), not what FP8 would do to "
            f"the numbers: {numbers}"
            if shapes
            else f"what FP8 would do to the numbers decided: {numbers}"
        ) + (f"; besides, {speed}" if speed else "")
    est = plan.fp8_speed
    if est is None:
        return (
            "the speed decided: it cannot be estimated (the eligible layers' tokens per call are unknown), so FP8 "
            "cannot be shown to pay"
        )
    cut = cfg.fp8_speedup_min
    if est.speedup <= cut:
        if est.speedup_gpu_bound > cut:
            why = f", only the latter above {cut:g}x: FP8 may pay on a GPU-bound step; measure it"
        elif est.speedup_launch_bound > cut:
            why = f", only the former above {cut:g}x: FP8 may pay on a step its host's launches bound; measure it"
        else:
            why = f", neither above {cut:g}x: " + (
                "its casts and extra kernels cost more than its faster matmuls save"
                if max(est.speedup_launch_bound, est.speedup_gpu_bound) < 1
                else "too small a gain to promise one on another model or stack"
            )
        return (
            f"the speed decided: what FP8 does to the numbers allows it ({len(plan.fp8_eligible)} of "
            f"{plan.fp8_checked} linear layers are FP8-eligible, carrying {_pct(plan.fp8_flops_share)} of "
            f"{_flops_whose(plan)}), but {speed}{why}"
        )
    return ""


def _with_the_rest(cfg: AdvisorConfig, fmt: str, measured: str) -> str:
    """Where the linear layers FP8 is not advised for run, in words the FP8 findings share: with the rest of the
    model, in the verdict's format, and for a small model's fp32 verdict the format the measurements allow too.
    "Keep them in fp32" under the eligible layers read as if being eligible kept them in fp32, beside the speed
    finding's "in bf16" and the verdict's "the measurements allow bf16"."""
    if measured and measured != fmt:
        return (
            f"with the rest of the model, in {fmt} (the default under {T.params_text(cfg.small_model_params)} "
            f"parameters) or the {measured} the measurements allow"
        )
    return f"in {fmt} with the rest of the model"


def _fp8_story(run: _Run, plan: _Plan, fmt: str, measured: str, why: str) -> None:
    """One story on the page: when the verdict is not fp8, no finding tells the user to convert layers to FP8;
    the FP8 findings say why not instead, and name one format for the layers it would have converted."""
    if fmt == "fp8":
        return
    hw = run.hw
    rest = _with_the_rest(run.cfg, fmt, measured)
    if why:
        keep = f"Keep them {rest}: FP8 is not advised here ({why})."
    elif not hw.fp8_supported:
        keep = (
            f"Nothing to convert on {hw.preset or hw.name}: it has no FP8 tensor cores (compute capability 8.9+); "
            "these are the layers FP8 would not harm where it runs."
        )
    elif measured == "fp8":
        keep = (
            f"Nothing to convert under the {fmt} verdict; should a measured gain make fp8 the choice "
            "(precprof compare --precisions fp32,fp8), these are its layers."
        )
    else:
        keep = f"Nothing to convert under the {fmt} verdict: FP8 is advised only beside bf16, which is ruled out."
    if hw.fp8_supported:
        keep += held_back_remedy(plan)
    for f in plan.findings:
        if f.code == "fp8_eligibility":
            f.remedy = keep
        elif f.code == "fp8_supported":
            f.remedy = f"Train in {fmt}: FP8 is not advised for this model" + (f" ({why})." if why else ".")
        elif f.code == "fp8_speed" and f.remedy == speed_keep_remedy():
            f.remedy = speed_keep_remedy(rest)


def _decide(run: _Run, plan: _Plan) -> Recommendation:
    hw, cfg = run.hw, run.cfg
    target = hw.preset or hw.name
    k = plan.loss_scale_log2
    reasons: list[str] = []
    bf16_ok = hw.bf16_native
    where = f"{hw.name}" + (
        f" (compute capability {'.'.join(map(str, hw.compute_capability))})" if hw.compute_capability else ""
    )
    fmt: str
    fp8_why_not = _fp8_why_not(plan, cfg) if hw.fp8_supported and hw.fp8_library else ""
    if hw.fp8_supported and hw.fp8_library and not fp8_why_not and bf16_ok and not plan.bf16_block:
        fmt = "fp8"
        reasons.append(
            f"{where} has FP8 tensor cores and {hw.fp8_library}: {len(plan.fp8_eligible)} of "
            f"{plan.fp8_checked} linear layers, carrying {_pct(plan.fp8_flops_share)} of {_flops_whose(plan)}, "
            "are FP8-eligible (convertible, dims and tokens per call multiples of 16, per-tensor current scaling "
            f"losing at most {_pct(cfg.lost_norm_max)} of each tensor's norm to underflow), and "
            f"{_fp8_speed_text(plan)}, each above {cfg.fp8_speedup_min:g}x: both the numbers and the speed allow "
            "FP8; the rest runs in bf16 autocast. Their share is of the layers' matmuls, more than half of them: a "
            "model whose forward code does matmuls of its own (a selective scan, attention over long sequences) "
            "has less of its step in them, which precprof compare --precisions bf16,fp8 measures."
        )
        reasons += _master_weights_said(plan, run.cfg)
    elif bf16_ok and not plan.bf16_block:
        fmt = "bf16"
        reasons.append(
            f"{where} runs bf16 natively; bf16 has fp32's exponent range, so no loss scale is needed"
            + (
                " and the measured gradients do not underflow it."
                if plan.gradients_usable
                else f"; whether this model's gradients underflow it was {_not_measured(run, plan)}."
            )
            + (
                " Its speed against fp32 on this CPU is not measured by one run: precprof compare "
                "--precisions fp32,bf16 times both."
                if hw.device == "cpu"
                else ""
            )
        )
        reasons += _master_weights_said(plan, run.cfg)
        if fp8_why_not:
            reasons.append(f"Not FP8: {fp8_why_not}.")
    elif hw.fp16_tensor_cores and not plan.fp16_block:
        fmt = "fp16"
        if not bf16_ok:
            reasons.append(f"{where} has fp16 tensor cores but no native bf16.")
        else:
            reasons.append("bf16 is ruled out: " + "; ".join(plan.bf16_block) + ".")
    elif hw.tf32_supported:
        fmt = "tf32"
    else:
        fmt = "fp32"
    if fmt in ("tf32", "fp32"):
        blocks = []
        if not bf16_ok:
            blocks.append(f"{where} has no native bf16")
        elif plan.bf16_block:
            blocks.append("bf16 is ruled out: " + "; ".join(plan.bf16_block))
        if not hw.fp16_tensor_cores:
            blocks.append("it has no fp16 tensor cores")
        elif plan.fp16_block:
            blocks.append("fp16 is ruled out: " + "; ".join(plan.fp16_block))
        reasons.append(
            "; ".join(blocks)
            + (
                ". TF32 keeps fp32's range and speeds up its matmuls (set_float32_matmul_precision('high'))."
                if fmt == "tf32"
                else ", so fp32 is the safe choice."
            )
        )
    if fmt == "fp16" and plan.fp16_norm_overflow:
        # the root cause first: until the norm computes in fp32, the gradients the scale below is sized on are not
        # those of a model that trains (the layers its zeros starved learned nothing)
        norms = run.sort(plan.fp16_norm_overflow)
        reasons.append(
            f"First compute {_listing(norms, cfg.max_listed_modules)} in fp32 (x.float() before the square): "
            + "; ".join(
                f"{_name(m)}'s x.pow(2) overflowed fp16 and zeroed {_pct(plan.fp16_norm_overflow[m])} of its output"
                for m in norms[: cfg.max_listed_modules]
            )
            + " (fp16_norm_overflow), and the layers those zeros starved did not learn; profile again after."
        )
    if fmt == "fp16":
        gm = plan.grad_absmax
        reasons.append(
            _scale_at_most_said(plan, k)
            if plan.grad_absmax_bound
            else f"Start GradScaler at init_scale={_scale(k)} (2^{k}): the largest gradient seen, {_g(gm)}"
            + (
                " (of those fp16 computes: the layers kept in fp32"
                + (", and what autocast computes in fp32," if plan.grad_absmax_fp32_left_out else "")
                + " left out)"
                if plan.grad_absmax_kept_left_out
                else " (of those fp16 computes: what autocast computes in fp32 left out)"
                if plan.grad_absmax_fp32_left_out
                else ""
            )
            + f", times 2^{k} stays below 65504 / {2**cfg.fp16_margin_log2}; "
            + _underflow_said(plan)
            if plan.gradients_usable and plan.grad_absmax is not None
            else f"Start GradScaler at {'its default ' if k == cfg.default_loss_scale_log2 else ''}init_scale="
            f"{_scale(k)} (2^{k}): the loss scale that keeps this model's gradients in fp16's range was "
            f"{_not_measured(run, plan)}"
            + (
                f"; {_pow2(k)} lifts a gradient at fp16's flush point (2^-25) to 0.5, and GradScaler backs off "
                "from it where one overflows."
                if k == cfg.flushed_loss_scale_log2 and plan.gradients_valueless
                else "."
            )
        )
        reasons += _fp16_keep_said(plan, cfg)
        reasons += _kept_said(plan, cfg, fmt, _keep_list(plan, fmt))
        reasons.append("Keep fp32 master weights and optimizer states (autocast with an fp32 model does).")
    if fmt != "fp16":  # (fp16's come before its master-weights reason)
        reasons += _kept_said(plan, cfg, fmt, _keep_list(plan, fmt))
    measured = fmt
    if plan.n_params is not None and plan.n_params < cfg.small_model_params and fmt not in ("fp32", "tf32"):
        # The guide's decision matrix: under 100M parameters the default is fp32 (mixed precision saves little
        # time or memory there, and its pitfalls stay); the measurements say what the evidence would allow.
        allow = (
            f"The measurements allow {measured} on {target}: train it when a run measures a speed or memory gain "
            f"(precprof compare --precisions fp32,{measured} measures both); what {measured} needs follows."
            if plan.measured and not plan.forward_broken
            else f"On {target} the decision tree alone would give {measured}; whether this model's values fit it "
            f"was {_not_measured(run, plan)}."
        )
        reasons = [
            f"The model has {T.params_text(plan.n_params)} parameters, under {T.params_text(cfg.small_model_params)}: the "
            f"guide's default is fp32, where mixed precision saves little time or memory and keeps its pitfalls. "
            + allow
        ] + [f"{measured}: {r}" for r in reasons]
        fmt = "fp32"
    if measured in ("bf16", "fp8") and plan.fp16_block:
        # the verdict box ("the measurements rule FP16 out: see Why") and the fp16 snippet point here for why fp16
        # will not do, on any device and under the small model's fp32 default too (its reasons had none)
        reasons.append("Not FP16: fp16 is ruled out: " + "; ".join(plan.fp16_block) + ".")
    if not plan.measured:
        measured = ""  # nothing was measured: no format is "what the measurements allow"
    if plan.diverged is not None:
        first, last = plan.diverged
        reasons.insert(
            0,
            f"This run diverged: its loss was non-finite from step {first} to its last step, {last}. "
            + (
                f"The recommendation rests on the {plan.diverged_sampled_before} sampled step(s) before it"
                if plan.diverged_sampled_before
                else "No step was sampled before it, so the recommendation rests on a broken run"
            )
            + "; fix the divergence (see the critical findings) and profile again before trusting it.",
        )
    if plan.never_stepped:
        # the verdict read as a normal run's beside a model that never trained
        n, model = plan.never_stepped, plan.never_stepped_from_model
        # what to fix is what the scaler finding found skipped the steps: the model's nan/inf, which no loss scale
        # avoids (its remedy: "the loss scale is not the cause"), the loss scale, or both
        fix = (
            "remove the source of the nan/inf (see the non-finite finding; the loss scale is not the cause)"
            if model == n
            else f"remove the source of the nan/inf behind {model:,} of the skips (see the non-finite finding) "
            "and fix the loss scale (see the critical finding)"
            if model
            else "fix the loss scale (see the critical finding)"
        )
        reasons.insert(
            0,
            f"This run never trained: the loss scaler skipped all {n:,} of its optimizer steps"
            + (", each for nan/inf from the model itself" if model == n else "")
            + ", so its weights never changed and what it measured is the initial weights' gradients; "
            + f"{fix} and profile again before trusting the recommendation.",
        )
    _demote_what_ifs(run, plan, fmt, measured or fmt)
    _fp8_story(run, plan, fmt, measured, fp8_why_not)
    if plan.forward_broken and measured != fmt:
        # a small model's fp32 beside the format the tree gives: every sampled step's forward pass was non-finite,
        # so the verdict box may not say "the measurements allow" it (the reasons say it was not measured)
        measured = ""
    keep = _keep_list(plan, fmt)
    # what fp16 needs kept in fp32 beside a verdict of another format (the box's "if you use FP16")
    fp16_keep = _keep_list(plan, "fp16")
    return Recommendation(
        format=fmt,
        loss_scale=2.0**k if fmt == "fp16" else None,
        fp16_loss_scale=2.0**k,
        growth_interval=plan.growth_interval if fmt == "fp16" else None,
        keep_fp32=list(keep),
        fp8_layers=list(plan.fp8_eligible) if fmt == "fp8" else [],
        reasons=reasons,
        target=target,
        measured_format=measured,
        device=hw.device,
        fp16_ruled_out=bool(plan.fp16_block),
        fp16_loss_scale_at_most=plan.grad_absmax_bound,
        fp16_keep_fp32=fp16_keep,
        measured_keep_fp32=_keep_list(plan, measured or fmt),
        measured_fp8_layers=list(plan.fp8_eligible) if (measured or fmt) == "fp8" else [],
    )


def _master_weights_said(plan: _Plan, cfg: AdvisorConfig) -> list[str]:
    """The bf16 (or fp8) verdict's condition where the run holds weights in bf16 that lose their updates there
    (the critical bf16_lost_updates): bf16 for compute, fp32 for the master weights. Without it the verdict
    read "the measurements allow bf16" beside the critical finding, as if the run's bf16 weights were fine."""
    if plan.bf16_held_lost is None:
        return []
    few, share = plan.bf16_held_lost
    if not few:
        return [
            "bf16 for compute, fp32 for the master weights: this run holds its weights in bf16, where "
            f"{_pct(share)} of their updates vanish (bf16_lost_updates); train with fp32 weights under bf16 "
            "autocast, which casts the matmuls' inputs (a model built or loaded in bf16 has no fp32 copy of its "
            "weights)."
        ]
    one = len(few) == 1
    return [
        f"bf16 for compute, fp32 for the master weights: this run holds {_listing(few, cfg.max_listed_modules)} in "
        f"bf16, where {_pct(share)} of {'its' if one else 'their'} updates vanish (bf16_lost_updates); hold "
        f"{'it' if one else 'them'} in fp32 too (.float() before the optimizer is made) and let bf16 autocast cast "
        f"{'its' if one else 'their'} matmuls."
    ]


def _fp16_keep_said(plan: _Plan, cfg: AdvisorConfig) -> list[str]:
    """The fp16 verdict's reasons for the layers its keep list adds to what the run kept in fp32: for their
    activations beyond fp16's range, and for the activations they cast to fp16 and flush there."""
    new = [m for m in plan.keep_fp16 if m not in plan.kept_fp32]
    flush = [m for m in new if m in plan.fp16_flush_kept]
    cast = [m for m in new if m in plan.fp16_cast_kept and m not in flush]
    near = [m for m in new if m in plan.fp16_cast_near_kept and m not in flush and m not in cast]
    over = [m for m in new if m not in flush and m not in cast and m not in near]
    said = []
    if cast:
        said.append(
            f"Keep {_listing(cast, cfg.max_listed_modules)} in fp32: autocast would cast an fp32 input beyond 65504 "
            "to fp16 there, which makes it inf (fp16_activation_overflow)."
        )
    if near:
        said.append(
            f"Keep {_listing(near, cfg.max_listed_modules)} in fp32: autocast would cast an fp32 input within 2x of "
            "65504 to fp16 there (fp16_activation_near_overflow)."
        )
    if over:
        said.append(
            f"Keep {_listing(over, cfg.max_listed_modules)} in fp32: their activations "
            + (
                "(or those of the element-wise module they feed) "
                if set(plan.fp16_passed_on.values()) & set(over)
                else ""
            )
            + "overflow, turn inf inside them or come within 2x of fp16's 65504."
        )
    if flush:
        said.append(
            f"Keep {_listing(flush, cfg.max_listed_modules)} in fp32: autocast would cast activations to fp16 there "
            "that flush to zero (fp16_activation_underflow)."
        )
    return said


def _keep_list(plan: _Plan, fmt: str) -> list[str]:
    """The modules a verdict of ``fmt`` keeps in fp32: its format's (fp16's overflow, bf16's, which fp8's rest
    runs in), and the norms, softmax and losses found running in 16-bit, fp32 whatever the format
    (rules/fp32_ops)."""
    keep = list({"fp16": plan.keep_fp16, "bf16": plan.keep_bf16, "fp8": plan.keep_bf16}.get(fmt, []))
    if fmt not in ("fp32", "tf32"):
        keep += [m for m in plan.keep_fp32_ops if m not in keep]
    return keep


def _kept_said(plan: _Plan, cfg: AdvisorConfig, fmt: str, keep: list[str]) -> list[str]:
    """The verdict's reasons on the matmul layers the run kept in fp32 (fp16_kept_fp32): under fp16 those still
    needed there stay in the keep list, said to be kept already, and those whose values fit fp16 are said to be
    free; under bf16 or fp8 those the keep list leaves out are said to be free. None is left out in silence."""
    listed = cfg.max_listed_modules
    # an fp16-pure run held them in fp32 (their weights fp32): no autocast to leave
    pure = plan.kept_fp32_pure
    said = []
    if fmt == "fp16" and plan.kept_fp32:
        n = len(plan.kept_fp32)
        said.append(
            f"Keep {_listing(plan.kept_fp32, listed)} in fp32 as this run already does "
            f"({'its weights in fp32' if pure and n == 1 else 'their weights in fp32' if pure else 'outside autocast'}): "
            f"{'its' if n == 1 else 'their'} own values still need it (fp16_kept_fp32)."
        )
    free = (
        plan.released_fp32
        if fmt == "fp16"
        else [m for m in plan.kept_fp32 + plan.released_fp32 if m not in keep]
    )
    if fmt in ("fp16", "bf16", "fp8") and free:
        said.append(
            f"{_listing(free, listed)} ran in fp32 {'in an fp16-pure model' if pure else 'outside autocast'} and may "
            f"run {'in fp16' if pure and fmt == 'fp16' else 'under ' + ('fp16' if fmt == 'fp16' else 'bf16') + ' autocast'} "
            f"again: {'its' if len(free) == 1 else 'their'} values fit "
            + ("fp16" if fmt == "fp16" else "bf16's range, which is fp32's")
            + ", and keep_fp32 leaves "
            + ("it" if len(free) == 1 else "them")
            + " out (fp16_kept_fp32)."
        )
    return said


def _runs_fp16(run: _Run) -> bool:
    """Whether the run itself trained in fp16: asked for by name and seen (``precision_trained``: accelerate's fp16 on a
    CPU trains in fp32); for a loop that names no precision (the user's own), the fp16 mode the profiler saw (autocast, or a model cast to fp16: "fp16-pure"), fp16 autocast seen or
    an enabled scaler. A run that asked for another precision did not, whatever scaler it kept (``--precision
    fp32 --loss-scale dynamic`` scales fp32 gradients)."""
    if run.precision_trained:
        if run.precision_trained.startswith("fp16"):
            return True
        if run.precision:
            return False
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    if not isinstance(capture, Mapping):
        return False
    seen = capture.get("autocast")
    if isinstance(seen, Mapping) and seen.get("dtype") == "float16":
        return True
    return bool(capture.get("scaler") and capture.get("scaler_enabled"))


def _demote_what_ifs(run: _Run, plan: _Plan, fmt: str, measured: str) -> None:
    """A warning (or a critical finding) about what fp16 would do, in a run that did not train in fp16 and whose
    measurements allow bf16 (or fp8), is information: nothing in the run or the plan suffers from it. The title
    names the verdict, and what the measurements allow when the verdict is another (fp32 for a small model). Its
    ``numbers["demoted_from"]`` keeps the severity for ``precprof compare``, which checks it against a real fp16
    run."""
    if measured not in ("bf16", "fp8") or _runs_fp16(run):
        return
    for f in plan.findings:
        if f.code.startswith("fp16_") and f.severity in (WARNING, CRITICAL):
            # (a critical one too: a bf16 run that diverged drew a critical fp16 underflow from its blown-up
            # gradients, beside the same run's other fp16 findings shown as information)
            f.numbers["demoted_from"] = f.severity
            f.severity = INFO
            verdict = f"the verdict is {fmt}" if fmt == measured else f"{measured} fits, the verdict is {fmt}"
            f.title += f" (what fp16 would do; {verdict})"


def _scale_at_most_said(plan: _Plan, k: int) -> str:
    """The fp16 verdict's loss-scale reason where the run's largest gradients came with inf or nan: 2^k comes
    from a lower bound of the largest gradient (fp16_loss_scale), so it is the most a start can be."""
    return (
        f"Start a dynamic GradScaler at init_scale={_scale(k)} (2^{k}) at the most: the run's largest gradients "
        f"came with inf or nan, so it measured the largest only as a lower bound (at least "
        f"{_g(plan.grad_absmax or 0.0)}) and a start there may overflow too; the scaler backs off until steps go "
        "through" + (f"; {_underflow_said(plan)}" if plan.gradients_usable else ".")
    )


def _underflow_said(plan: _Plan) -> str:
    """How much of the activation gradients fp16 loses, for the loss-scale reason: the histograms' shares at
    scale 1 and at the recommended scale, or, where the run's fp16 gradients were flushed already, the share of
    exact zeros that says so (the histograms cannot see a value that became a zero: "falls from 0% at scale 1 to
    0%" on a run that had flushed 98.5% of them)."""
    nums = next((f.numbers for f in plan.findings if f.code == "fp16_gradient_underflow"), {})
    flushed, k_run = nums.get("fp16_flushed_zero_share"), nums.get("run_scale_log2")
    # the scale the run had (an older finding gives only its log2, a whole number)
    run_scale = nums.get("run_scale")
    if not isinstance(run_scale, float):
        run_scale = 2.0**k_run if isinstance(k_run, int) else 1.0
    at = f"the run's loss scale {_loss_scale_said(run_scale)}" if run_scale != 1.0 else "loss scale 1"
    at_most = nums.get("fp16_flushed_at_most")
    if nums.get("fp16_flushed") and isinstance(at_most, float):
        return (
            f"this run's fp16 activation gradients ran into fp16's floor at {at} and were flushed to zero (up to "
            f"{_pct(at_most)} of those values"
            + (", a mask's zeros among them" if plan.fp16_masks else "")
            + ", which the exponent histograms cannot see; fp16_gradient_underflow)."
        )
    if nums.get("fp16_flushed") and isinstance(flushed, float):
        return (
            f"this run's fp16 activation gradients were flushed to zero ({_pct(flushed)} exact zeros"
            + (
                f" among the values of {of}"
                if isinstance(of := nums.get("fp16_flushed_share_of"), str)
                else ""
            )
            + f" at {at}, which the exponent histograms cannot see; fp16_gradient_underflow)."
        )
    if (
        plan.underflow_at_1 is None and plan.underflow_at_rec is not None
    ):  # fp16 gradients held at scale 1: what fp16 flushed was a zero already
        return (
            f"{_pct(plan.underflow_at_rec)} of the activation-gradient values recorded underflow there; at scale 1 "
            "this run's fp16 gradients cannot show how many fp16 flushed (fp16_gradient_underflow)."
        )
    return (
        f"activation-gradient underflow falls from {_pct(plan.underflow_at_1)} at scale 1 to "
        f"{_pct(plan.underflow_at_rec)}."
    )

"""What the target machine runs natively, and whether the model is small enough for fp32 to be as fast."""

from __future__ import annotations

from collections.abc import Mapping

from precprof import tables as T
from precprof.analysis.advisor.evidence import _Plan, _Run
from precprof.analysis.advisor.model import INFO, WARNING, Finding, Number


def _rule_hardware(run: _Run, plan: _Plan) -> None:
    hw = run.hw
    label = hw.preset or hw.name
    cc = ".".join(map(str, hw.compute_capability)) if hw.compute_capability else None
    nums: dict[str, Number] = {"device": hw.device, "name": hw.name, "compute_capability": cc}
    if hw.device == "cpu":
        if hw.bf16_native:
            plan.add(
                Finding(
                    "bf16_native",
                    INFO,
                    f"bf16 is native on {label}",
                    f"This CPU ({hw.name}) has AVX512-BF16 or AMX: bf16 matmuls run in hardware. Whether bf16 "
                    "autocast trains this model faster than fp32 is not something one run measures: the casts, "
                    "and the ops autocast keeps in fp32, cost time too.",
                    "Time both on this CPU before switching: precprof compare --precisions fp32,bf16 measures "
                    "their speed and memory.",
                    numbers=nums,
                )
            )
        else:
            plan.add(
                Finding(
                    "bf16_emulated",
                    WARNING,
                    f"bf16 is emulated on {label}",
                    (
                        "The cpu preset is a CPU with neither AVX512-BF16 nor AMX (plan for the CPU a run was "
                        "recorded on without --target: its own features are read)"
                        if hw.preset
                        else f"This CPU ({hw.name}) has neither AVX512-BF16 nor AMX"
                    )
                    + ": bf16 autocast runs, but through conversions to fp32, usually slower than plain fp32.",
                    f"Train in fp32 on {'such a CPU' if hw.preset else 'this CPU'}, or plan for a GPU with compute "
                    "capability 8.0+ for bf16.",
                    numbers=nums,
                )
            )
    elif hw.bf16_native:
        plan.add(
            Finding(
                "bf16_native",
                INFO,
                f"bf16 is native on {label}",
                f"{hw.name} has compute capability {cc} (8.0+ has bf16 tensor cores).",
                "Prefer bf16 autocast: fp32's range, no loss scaling.",
                numbers=nums,
            )
        )
    else:
        plan.add(
            Finding(
                "bf16_unsupported",
                WARNING,
                f"No bf16 tensor cores on {label}",
                f"{hw.name} has compute capability {cc}; bf16 tensor cores need 8.0+ (Ampere), so bf16 "
                "would be emulated or refused.",
                "Use fp16 with a loss scale on this GPU.",
                numbers=nums,
            )
        )
    if hw.fp8_supported and hw.fp8_library:
        plan.add(
            Finding(
                "fp8_supported",
                INFO,
                f"FP8 tensor cores on {label}",
                f"{hw.name} has compute capability {cc} (8.9+ has FP8 tensor cores) and {hw.fp8_library} "
                "is available for FP8 training.",
                f"Convert the FP8-eligible linear layers with {hw.fp8_library}; keep the rest in bf16.",
                numbers={**nums, "fp8_library": hw.fp8_library},
            )
        )
    elif hw.fp8_supported:
        plan.add(
            Finding(
                "fp8_library_missing",
                WARNING,
                "FP8 hardware without an FP8 library",
                f"{hw.name} has compute capability {cc} (FP8 tensor cores) but neither torchao nor "
                "Transformer Engine is importable.",
                "Install torchao (pip install torchao) to train the eligible layers in FP8.",
                numbers=nums,
            )
        )
    if (
        not run.hw_is_target_preset
        and hw.tf32_supported
        and not hw.tf32_matmul_enabled
        and run.precision in ("fp32", "")
    ):
        plan.add(
            Finding(
                "tf32_off",
                WARNING,
                "TF32 is off on an Ampere+ GPU",
                f"{hw.name} (compute capability {cc}) runs fp32 matmuls on TF32 tensor cores only when "
                "allowed, and torch.backends.cuda.matmul.allow_tf32 is False "
                f"(float32_matmul_precision={hw.float32_matmul_precision!r}).",
                "Call torch.set_float32_matmul_precision('high') to run fp32 matmuls in TF32.",
                numbers={**nums, "float32_matmul_precision": hw.float32_matmul_precision},
            )
        )


def _model_params(run: _Run) -> int | None:
    """The model's parameter count: the one summary.json records (the built-in loop's model, else the
    Profiler's count of every rank's), else the first step's weight rows (a run cut off before its summary),
    which under DDP hold every rank's replica: world_size times the model."""
    for part in (T.SUMMARY_MODEL, T.SUMMARY_CAPTURE):
        facts = run.summary.get(part) or {}
        n = facts.get("n_params") if isinstance(facts, Mapping) else None
        if isinstance(n, int):
            return n
    w = run.kind(T.WEIGHT)
    if w.empty:
        return None
    first = w[w[T.STEP] == w[T.STEP].min()]
    return int(first.drop_duplicates([T.MODULE, T.PARAM])[T.NUMEL].sum()) // replicas(run)


def replicas(run: _Run) -> int:
    """How many replicas of each parameter a weight row's count holds: DDP's world size (every rank's replica,
    summed), else 1."""
    dist = (run.summary.get(T.SUMMARY_CAPTURE) or {}).get("distributed") or {}
    world = dist.get("world_size") if isinstance(dist, Mapping) else None
    if isinstance(dist, Mapping) and dist.get("wrapper") == "DDP" and isinstance(world, int) and world > 1:
        return world
    return 1


def _rule_small_model(run: _Run, plan: _Plan) -> None:
    n = _model_params(run)
    if n is None:
        return
    plan.n_params = n
    if n >= run.cfg.small_model_params:
        return
    plan.add(
        Finding(
            "small_model",
            INFO,
            f"Small model: {T.params_text(n)} parameters",
            f"The model has {T.params_text(n)} parameters, below {T.params_text(run.cfg.small_model_params)}: its "
            "matmuls are small, so the step time is often bound by kernel launches and memory traffic rather than math, "
            "and mixed precision may not speed it up.",
            "Time a few steps in fp32 and in the recommended format; keep fp32 if it is not faster.",
            numbers={"n_params": n, "threshold": run.cfg.small_model_params},
        )
    )

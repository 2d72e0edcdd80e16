"""Prove the FP8 verdict on a GPU (issue 34): bf16 against fp8 training, both compiled, long enough to compare
the loss curves, for gpt2-small and for a model the project's benches never used, and the advisor's verdict
checked against the outcome.

Per model:

1. profile: the built-in loop in bf16 (eager: the numbers do not depend on compiling), a few dozen steps with
   per-layer statistics every 10 steps; the advisor's recommendation for this machine: its format, FP8's
   estimated speedup, and whether the numbers or the speed decided;
2. train bf16 and fp8 for ``--steps`` steps each (500 by default), both ``torch.compile``d, same seed, data and
   batches, the Profiler recording steps only (``sample_every=0``: no per-layer hooks run, the compiled model
   stays one graph); the loss curves, and the median step time after the first ``WARMUP`` steps;
3. the outcome: fp8 *matches* when its mean loss over the last tenth of the steps is within ``--tolerance``
   (2%) of bf16's, and *pays* when it also runs faster than bf16 (median step time); the verdict is *right*
   when the advisor recommended fp8 exactly when fp8 matched and paid.

Models: ``gpt2-small`` (the built-in GPT-2 124M at 8 x 1024 tokens: 768-wide GEMMs, where the issue measured
FP8 slower) and ``hf:qwen2`` built from a config (hidden 2048, intermediate 8192, 4 layers, 8 x 1024 tokens:
GEMMs where FP8 should pay). Each run's figures are written to the JSON as soon as it ends, so a command stopped
at its time limit keeps what it measured; ``--budget-s`` skips a model whose runs would not fit.

On an H100 or H200 (torch 2.11, triton 3.6, transformers; torchao 0.17 carried as a wheel), from the repository
root, in one device call of about 8 minutes:

    pip install --no-deps torchao-0.17.0-*.whl && \\
    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/fp8_vs_bf16.py --budget-s 480 --out $OUT/fp8_vs_bf16.json

then commit the JSON as ``bench/results/fp8_vs_bf16_<device>_<date>.json``. ``--dry-run`` runs the same
plumbing on the CPU at toy sizes, with bf16 standing in for fp8 (which needs a GPU), in well under a minute
(tests/test_bench_fp8.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from precprof import hardware  # noqa: E402
from precprof import tables as T  # noqa: E402
from precprof.training import TrainConfig, train  # noqa: E402

WARMUP = 20  # steps left out of the step time: compiling, autotuning, the allocator settling


@dataclass(frozen=True)
class ModelSpec:
    """One model of the proof: the built-in loop's --model and --model-arg, batch and sequence length."""

    name: str
    model: str
    model_args: Mapping[str, Any] = field(default_factory=dict)
    batch_size: int = 8
    seq_len: int = 1024


GPU_MODELS: tuple[ModelSpec, ...] = (
    ModelSpec("gpt2-small", "gpt2-small"),
    ModelSpec(
        "qwen2-2048",
        "hf:qwen2",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 32768,
            "max_position_embeddings": 1024,
            "tie_word_embeddings": False,
        },
    ),
)
DRY_MODELS: tuple[ModelSpec, ...] = (
    ModelSpec("gpt-nano", "gpt-nano", {"n_layer": 1}, batch_size=2, seq_len=32),
)


def _tail_mean(losses: list[float]) -> float:
    """Mean of the finite losses of the last tenth of the steps (at least 5): less noisy than one batch."""
    n = max(5, len(losses) // 10)
    tail = [v for v in losses[-n:] if math.isfinite(v)]
    return sum(tail) / len(tail) if tail else math.nan


def _median(values: list[float]) -> float:
    v = sorted(x for x in values if math.isfinite(x))
    if not v:
        return math.nan
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def run_training(
    spec: ModelSpec, precision: str, steps: int, out: Path, *, compile: bool, device: str
) -> dict:
    """One training run of the built-in loop, the Profiler recording steps only; its curve and timing."""
    t0 = time.perf_counter()
    result = train(
        TrainConfig(
            model=spec.model,
            model_args=dict(spec.model_args),
            precision=precision,
            steps=steps,
            batch_size=spec.batch_size,
            seq_len=spec.seq_len,
            device=device,
            out=out,
            sample_every=0,
            progress=False,
            report=False,
            compile=compile,
            overwrite=True,
        )
    )
    steps_table = result.steps.sort_values(T.STEP)
    losses = [float(v) for v in steps_table[T.LOSS]]
    times = [float(v) for v in steps_table[T.TIME_S]]
    cfg = result.summary.get(T.SUMMARY_CONFIG) or {}
    return {
        "precision": precision,
        "compiled": cfg.get("compiled"),
        "fp8_layers": cfg.get("fp8_layers"),
        "steps": len(losses),
        "loss": losses,
        "final_loss": _tail_mean(losses),
        "step_time_median_s": _median(times[WARMUP:] if len(times) > WARMUP + 5 else times[1:]),
        "first_step_s": times[0] if times else math.nan,
        "wall_s": time.perf_counter() - t0,
        "run_dir": str(out),
    }


def run_profile(spec: ModelSpec, steps: int, out: Path, *, device: str) -> dict:
    """bf16 with per-layer statistics every 10 steps (eager); what the advisor recommends for this machine."""
    result = train(
        TrainConfig(
            model=spec.model,
            model_args=dict(spec.model_args),
            precision="bf16",
            steps=steps,
            batch_size=spec.batch_size,
            seq_len=spec.seq_len,
            device=device,
            out=out,
            sample_every=max(1, min(10, steps // 3)),
            progress=False,
            report=True,
            compile=False,
            overwrite=True,
        )
    )
    rec = result.summary.get(T.SUMMARY_RECOMMENDATION) or {}
    findings = {f.get("code"): f for f in rec.get("findings") or []}
    elig = findings.get("fp8_eligibility") or {}
    speed = findings.get("fp8_speed") or {}
    reasons = rec.get("reasons") or []
    return {
        "format": rec.get("format"),
        "measured_format": rec.get("measured_format"),
        "target": rec.get("target"),
        "reasons": reasons,
        "not_fp8_decided_by": decided_by(reasons),
        "fp8_eligible": (elig.get("numbers") or {}).get("eligible"),
        "fp8_checked": (elig.get("numbers") or {}).get("checked"),
        "fp8_eligible_flops_share": (elig.get("numbers") or {}).get("eligible_flops_share"),
        "fp8_max_e5m2_lost_norm": (elig.get("numbers") or {}).get("max_e5m2_lost_norm"),
        "fp8_max_e5m2_value_share": (elig.get("numbers") or {}).get("max_e5m2_share"),
        "fp8_estimated_speedup": (speed.get("numbers") or {}).get("estimated_speedup"),
        "run_dir": str(out),
    }


def decided_by(reasons: list[str]) -> str | None:
    """What ruled FP8 out, as the advisor's reasons say: "numbers", "speed", or None (FP8 not ruled out here,
    or not considered on this machine)."""
    for r in reasons:
        if "Not FP8: the speed decided" in r:
            return "speed"
        if "Not FP8: what FP8 would do to the numbers decided" in r:
            return "numbers"
    return None


def judge(
    profile: Mapping[str, Any], bf16: Mapping[str, Any], fp8: Mapping[str, Any], tolerance: float
) -> dict:
    """The outcome of the two runs and whether the advisor's verdict agrees with it: fp8 matches (final loss
    within ``tolerance`` of bf16's, relative), pays (matches and a shorter median step), and the verdict is
    right when it recommended fp8 exactly when fp8 paid."""
    b, f = bf16.get("final_loss", math.nan), fp8.get("final_loss", math.nan)
    gap = (f - b) / b if math.isfinite(b) and math.isfinite(f) and b != 0 else math.nan
    matches = math.isfinite(gap) and gap <= tolerance
    tb, tf = bf16.get("step_time_median_s", math.nan), fp8.get("step_time_median_s", math.nan)
    speedup = tb / tf if math.isfinite(tb) and math.isfinite(tf) and tf > 0 else math.nan
    pays = matches and math.isfinite(speedup) and speedup > 1.0
    recommended = profile.get("measured_format") == "fp8"
    return {
        "final_loss_gap": gap,
        "fp8_matches_bf16": matches,
        "measured_speedup": speedup,
        "fp8_pays": pays,
        "advisor_recommended_fp8": recommended,
        "verdict_right": recommended == pays,
        "estimated_speedup": profile.get("fp8_estimated_speedup"),
    }


def _write(out: Path, data: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, default=str, allow_nan=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--steps", type=int, default=500, help="steps of each bf16 and fp8 run (500)")
    ap.add_argument("--profile-steps", type=int, default=30, help="steps of the profiled bf16 run (30)")
    ap.add_argument("--tolerance", type=float, default=0.02, help="fp8's final loss within this of bf16's")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip a model that would not fit (480)")
    ap.add_argument("--models", default="", help="comma-separated names to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, bf16 standing in for fp8")
    ap.add_argument("--work", type=Path, default=None, help="where the run directories go (a temporary one)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on the CPU", file=sys.stderr)
            return 2
        if importlib.util.find_spec("torchao") is None:
            print(
                "torchao is not installed: pip install its wheel first (0.17 matches torch 2.11)",
                file=sys.stderr,
            )
            return 2
    device = "cpu" if dry else "cuda"
    models = DRY_MODELS if dry else GPU_MODELS
    if args.models:
        wanted = set(args.models.split(","))
        models = tuple(m for m in models if m.name in wanted)
    steps = args.steps if not dry else min(args.steps, 12)
    profile_steps = args.profile_steps if not dry else min(args.profile_steps, 4)
    stand_in = "bf16" if dry else "fp8"
    hw = hardware.detect(torch.device(device))
    work = args.work or Path(tempfile.mkdtemp(prefix="fp8_vs_bf16_"))
    data: dict[str, Any] = {
        "what": "bf16 against fp8 training, both compiled, and the advisor's FP8 verdict against the outcome",
        "device": hw.name,
        "compute_capability": hw.compute_capability,
        "torch": torch.__version__,
        "torchao": _version("torchao"),
        "transformers": _version("transformers"),
        "dry_run": dry,
        "fp8_stand_in": None if not dry else "bf16 (fp8 needs a GPU with compute capability 8.9+)",
        "steps": steps,
        "tolerance": args.tolerance,
        "models": {},
    }
    t_start = time.perf_counter()
    for spec in models:
        left = args.budget_s - (time.perf_counter() - t_start)
        rec: dict[str, Any] = {
            "spec": {
                "model": spec.model,
                "model_args": dict(spec.model_args),
                "batch_size": spec.batch_size,
                "seq_len": spec.seq_len,
            }
        }
        data["models"][spec.name] = rec
        if left < 60:
            rec["skipped"] = f"{left:.0f} s of the budget left"
            _write(args.out, data)
            continue
        base = work / spec.name
        stages = (
            ("profile", "bf16", False),  # (stage, precision, compiled); the profile is run_profile's
            ("bf16", "bf16", True),
            ("fp8", stand_in, True),
        )
        for stage, precision, compiled in stages:
            try:
                if stage == "profile":
                    rec[stage] = run_profile(spec, profile_steps, base / stage, device=device)
                else:
                    rec[stage] = run_training(
                        spec, precision, steps, base / stage, compile=compiled, device=device
                    )
            except Exception as e:  # recorded; the next stage and model still run
                rec[stage] = {"error": f"{type(e).__name__}: {e}"}
            _write(args.out, data)
        if all("error" not in rec[s] for s in ("profile", "bf16", "fp8")):
            rec["outcome"] = judge(rec["profile"], rec["bf16"], rec["fp8"], args.tolerance)
        _write(args.out, data)
    data["wall_s"] = time.perf_counter() - t_start
    _write(args.out, data)
    for name, rec in data["models"].items():
        o = rec.get("outcome") or {}
        print(f"{name}: {json.dumps(o) if o else rec.get('skipped') or 'failed: see the JSON'}")
    return 0


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


if __name__ == "__main__":
    raise SystemExit(main())

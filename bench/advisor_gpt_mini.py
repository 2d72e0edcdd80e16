"""Does the advisor's fp16 loss scale hold up in training? (issue 5's end-to-end check)

Three runs of the built-in loop, same seed, same model, same batches:

  fp32          the reference; its tables give the recommendation (``precprof.recommend(run, hardware=TARGET)``)
  fp16_default  fp16 autocast + GradScaler at its default start, init_scale 2^16
  fp16_advised  fp16 autocast + GradScaler at the recommended init_scale (and growth interval)

The claim checked: fp16_advised skips no more optimizer steps than fp16_default (fewer when the default start
overflows), and its final loss (mean of the last 10 steps) is within 2% of fp32's.

Usage: python bench/advisor_gpt_mini.py [--model gpt-mini] [--steps 300] [--batch-size 16] [--seq-len 64]
           [--device auto] [--target v100] [--out bench/results/advisor_gpt_mini_<device>.json]
On CPU, fp16 autocast is emulated and slow (about 35 s a step for gpt-mini at the default batch on a loaded
2-core machine): use a GPU, or a smaller batch.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precprof  # noqa: E402
from precprof import tables as T  # noqa: E402
from precprof.training import TrainConfig, train  # noqa: E402

LOSS_TOLERANCE = 0.02


def _run(name: str, cfg: TrainConfig) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = train(cfg)
    wall = time.perf_counter() - t0
    steps = res.steps
    skipped = steps[T.SKIPPED].astype(bool)
    final = res.summary.get(T.SUMMARY_FINAL, {})
    ok = steps.index[~skipped]
    out = {
        "name": name,
        "precision": cfg.precision,
        "init_scale": cfg.init_scale if cfg.precision == "fp16" else None,
        "growth_interval": cfg.growth_interval if cfg.precision == "fp16" else None,
        "final_loss": float(res.final_loss),
        "final_loss_avg10": float(final.get("final_loss_avg10", math.nan)),
        "skipped_steps": int(skipped.sum()),
        "skipped_at": [int(s) for s in steps[skipped][T.STEP]],
        "first_ok_step": int(steps.loc[ok[0], T.STEP]) if len(ok) else None,
        "final_loss_scale": float(steps[T.LOSS_SCALE].iloc[-1]),
        "wall_s": wall,
        "s_per_step": wall / max(len(steps), 1),
        "run_dir": str(res.run_dir),
    }
    print(
        f"{name:13s} loss {out['final_loss']:.4f} (avg10 {out['final_loss_avg10']:.4f}) "
        f"skipped {out['skipped_steps']} scale {out['final_loss_scale']:g} {wall:.0f}s",
        flush=True,
    )
    return out


def run_benchmark(
    model: str = "gpt-mini",
    steps: int = 300,
    batch_size: int = 16,
    seq_len: int = 64,
    device: str = "auto",
    target: str = "v100",
    seed: int = 0,
    sample_every: int = 10,
    workdir: str | Path | None = None,
) -> dict[str, Any]:
    """Run the three trainings and return the measurements and the verdict (see the module docstring)."""
    work = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="precprof-advisor-bench-"))
    common = dict(
        model=model,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        device=device,
        seed=seed,
        progress=False,
        report=False,
    )
    fp32 = _run(
        "fp32",
        TrainConfig(precision="fp32", sample_every=sample_every, out=work / "fp32", **common),  # type: ignore[arg-type]
    )
    rec = precprof.recommend(fp32["run_dir"], hardware=target)
    print(rec.describe(), flush=True)
    # the fp16 runs only need their steps table: sample rarely, the profiler's cost is not what is measured
    rare = max(steps, 1)
    default = _run(
        "fp16_default",
        TrainConfig(
            precision="fp16", init_scale=2.0**16, sample_every=rare, out=work / "fp16_default", **common
        ),  # type: ignore[arg-type]
    )
    advised = _run(
        "fp16_advised",
        TrainConfig(
            precision="fp16",
            init_scale=rec.fp16_loss_scale,
            growth_interval=rec.growth_interval or 2000,
            sample_every=rare,
            out=work / "fp16_advised",
            **common,  # type: ignore[arg-type]
        ),
    )
    rel = abs(advised["final_loss_avg10"] - fp32["final_loss_avg10"]) / fp32["final_loss_avg10"]
    under = rec.finding("fp16_gradient_underflow")
    scale = rec.finding("fp16_loss_scale")
    return {
        "config": {
            "model": model,
            "steps": steps,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "device": device,
            "target": target,
            "seed": seed,
            "sample_every_fp32": sample_every,
        },
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "torch": _torch_version(),
        },
        "recommendation": {
            "format": rec.format,
            "fp16_loss_scale": rec.fp16_loss_scale,
            "growth_interval": rec.growth_interval,
            "grad_absmax": scale.numbers.get("grad_absmax") if scale else None,
            "underflow_share_at_scale_1": under.numbers.get("share_at_scale_1") if under else None,
            "underflow_share_at_recommended": under.numbers.get("share_at_recommended") if under else None,
        },
        "runs": {"fp32": fp32, "fp16_default": default, "fp16_advised": advised},
        "verdict": {
            "skipped_default": default["skipped_steps"],
            "skipped_advised": advised["skipped_steps"],
            "advised_skips_fewer": advised["skipped_steps"] < default["skipped_steps"],
            "advised_skips_no_more": advised["skipped_steps"] <= default["skipped_steps"],
            "final_loss_rel_diff_vs_fp32": rel,
            "within_2_percent": rel < LOSS_TOLERANCE,
        },
    }


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.add_argument("--target", default="v100")
    p.add_argument("--sample-every", type=int, default=10)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    result = run_benchmark(
        a.model, a.steps, a.batch_size, a.seq_len, a.device, a.target, sample_every=a.sample_every
    )
    dev = "cuda" if _is_cuda(a.device) else "cpu"
    out = (
        Path(a.out)
        if a.out
        else ROOT / "bench" / "results" / f"advisor_{a.model.replace('-', '_')}_{dev}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["verdict"], indent=2))
    print(f"wrote {out}")
    return 0


def _is_cuda(device: str) -> bool:
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


if __name__ == "__main__":
    raise SystemExit(main())

"""What one ``prof.step(loss=loss)`` costs on a step precprof does not sample, after a step that did real work.

On a step it does not sample, precprof has no hook on the model: its only cost there is the ``Profiler.step()``
call that ends the step (issue 33). After a toy step that call finds its code and data in the CPU's caches;
after a training step of a few milliseconds it does not (a user measured 90-190 us after a 4-15 ms CPU step,
against 20-30 us after a toy one). So each step here does real work between two calls: a small MLP's forward,
backward and AdamW step, then ``--matmul-ms`` (3) of 256 x 256 matmuls and a sweep over ``--sweep-mib`` (32 MiB,
larger than the last-level cache of the machines this ran on), then the call, timed alone
(``time.perf_counter`` around it). ``--matmul-ms 0 --sweep-mib 0``: a toy step.

Only the calls that end an unsampled step and begin another unsampled one are timed (a call that begins a
sampled step installs its hooks: that is the sampled step's cost). Configurations, each its own Profiler and
copy of the model, their steps interleaved in one process:

  budget      the default sampling (``sample_every=None``: a share of the run's time)
  every 50    ``sample_every=50``

Both with the Profiler's other defaults (memory tracking, the block what-if on sampled steps), streaming into a
temporary run directory as ``precprof train`` and the callbacks do.

Reported per configuration: the median and the 90th percentile of the timed calls, pooled over the runs, and
each run's median. One torch thread; wall clock (the call's cost is host time, and nothing waits on a device).

``--ab OLD_ROOT``: compare the precprof of another tree (a worktree of the code before a change) with this
one's: ``--runs`` processes of each, alternating (old, new, new, old, ...), each with ``PYTHONPATH`` at its
own tree, so that the machine's drift and neighbours hit both alike. Writes both, and each tree's commit.

2026-11-30, a 2-core AMD EPYC shared with other work (bench/results/step_call_cpu_2026-11-30.json, 6 processes
of each): budget 277 -> 77 us median (p90 401 -> 122), every 50: 117 -> 57 us (p90 181 -> 99); after a toy
step (step_call_cpu_toy_2026-11-30.json) budget 107 -> 31 us, every 50: 41 -> 19 us.

Usage: python bench/step_call.py [--steps 400] [--runs 6] [--ab ../main] [--out bench/results/step_call_cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS: dict[str, dict[str, Any]] = {"budget": {}, "every 50": {"sample_every": 50}}


def quantile(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (linear between the two nearest)."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def cpu_name() -> str:
    """The CPU's model name (Linux), else the platform's."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def one_process(steps: int, warmup: int, matmul_ms: float, sweep_mib: int) -> dict[str, list[float]]:
    """The timed calls of each configuration, in seconds, from this process's precprof (``sys.path``)."""
    import torch
    from torch import nn

    import precprof

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    a = torch.randn(256, 256)
    sweep = torch.zeros(sweep_mib * 2**18)  # float32
    # matmuls per step: as many as take ``matmul_ms`` here
    t0 = time.perf_counter()
    for _ in range(20):
        a @ a
    per = (time.perf_counter() - t0) / 20
    reps = max(1, round(matmul_ms / 1e3 / per))
    state = {}
    for name, kw in CONFIGS.items():
        model = nn.Sequential(
            nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 1)
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        out = tempfile.mkdtemp(prefix="precprof-step-call-")
        prof = precprof.Profiler(model, optimizer=opt, compile_beside=False, out=out, **kw).attach()
        state[name] = (model, opt, prof, out, [])
    try:
        for i in range(warmup + steps):
            for model, opt, prof, _, times in state.values():
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                for _ in range(reps):
                    a @ a
                sweep.add_(1.0)
                ended = prof.sampling
                t = time.perf_counter()
                prof.step(loss=loss)
                t = time.perf_counter() - t
                if i >= warmup and not ended and not prof.sampling:
                    times.append(t)
    finally:
        for _, _, prof, out, _ in state.values():
            prof.detach()
            shutil.rmtree(out, ignore_errors=True)
    return {name: s[4] for name, s in state.items()}


def describe(runs: list[dict[str, list[float]]]) -> dict[str, Any]:
    """Median and p90 per configuration, pooled over the runs, in microseconds; and each run's median."""
    out: dict[str, Any] = {}
    for name in CONFIGS:
        pooled = [t for r in runs for t in r[name]]
        out[name] = {
            "calls": len(pooled),
            "median_us": round(statistics.median(pooled) * 1e6, 1),
            "p90_us": round(quantile(pooled, 0.9) * 1e6, 1),
            "run_medians_us": [round(statistics.median(r[name]) * 1e6, 1) for r in runs],
        }
    return out


def commit(root: Path) -> str:
    """The tree's commit, with a + when it has changes of its own."""
    head = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "precprof"], capture_output=True, text=True
    )
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def run_in(root: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """One process of this bench with ``root``'s precprof first on the path."""
    cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--matmul-ms", str(args.matmul_ms), "--sweep-mib", str(args.sweep_mib)]
    env = dict(os.environ, PYTHONPATH=str(root))
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="steps per configuration and process")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    ap.add_argument("--runs", type=int, default=6, help="processes (of each tree with --ab)")
    ap.add_argument("--matmul-ms", type=float, default=3.0, help="matmul work per step, between two calls")
    ap.add_argument("--sweep-mib", type=int, default=32, help="a buffer swept each step (0: a toy step)")
    ap.add_argument("--ab", default=None, help="another tree's root: its precprof against this one's")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(args.steps, args.warmup, args.matmul_ms, args.sweep_mib)))
        return {}
    trees = {"new": ROOT} if args.ab is None else {"old": Path(args.ab).resolve(), "new": ROOT}
    runs: dict[str, list[dict[str, list[float]]]] = {k: [] for k in trees}
    order = list(trees)
    for r in range(args.runs):
        for k in order if r % 2 == 0 else order[::-1]:
            runs[k].append(run_in(trees[k], args))
            print(f"run {r} {k}: " + json.dumps(describe(runs[k][-1:])), flush=True)
    result: dict[str, Any] = {
        "what": "Profiler.step(loss=...) on unsampled steps (bench/step_call.py)",
        "date": time.strftime("%Y-%m-%d"),
        "machine": cpu_name(),
        "cpus": os.cpu_count(),
        "steps": args.steps,
        "runs": args.runs,
        "matmul_ms": args.matmul_ms,
        "sweep_mib": args.sweep_mib,
        "trees": {k: f"{commit(v)} ({v})" for k, v in trees.items()},
        "results": {k: describe(v) for k, v in runs.items()},
    }
    print(json.dumps(result["results"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

"""What Python's garbage collector costs a sampled step: collections by generation and their time, per step.

A sampled step makes Python objects the collector tracks around each inspected tensor (the gradient hook's
dictionary on each module output and its ``grad_fn``'s Python object, weak references, tuples), which
an unprofiled loop does not. Each young collection they set off costs little; those that survive into the older
generations eventually set off a full collection, which walks every object of the process (torch's alone are
~400,000) and pauses one step for 0.1-0.4 s. This measures both on ``bench/host_cost.py``'s stack (Linear +
GELU blocks), with the collector as the process has it (no ``gc.freeze``, thresholds untouched):

  baseline    no profiler
  every       every step sampled (``sample_every=1``)
  1 in 10     ``sample_every=10``

per configuration, in a fresh process each (a full collection depends on what the process holds): the tracked
objects one step leaves allocated at its end of the forward pass (``gc.get_count()[0]``, collector off for that
one step), and over ``--steps`` steps the collections of each generation, their time, and the longest.

Usage: python bench/gc_cost.py [--blocks 100] [--steps 1000]
Writes bench/results/gc_cost_cpu.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {"baseline": None, "every": 1, "1 in 10": 10}


def _one(config: str, blocks: int, steps: int) -> dict[str, Any]:
    """Run ``config`` in this process and return what the collector did."""
    import torch

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from host_cost import tiny_stack

    from precprof.capture import Profiler

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_stack(blocks, 8)
    x = torch.randn(4, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    every = CONFIGS[config]
    prof = None
    if every is not None:
        prof = Profiler(
            model, optimizer=opt, compile_beside=False, out=tempfile.mkdtemp(), sample_every=every
        ).attach()

    def step(forward_done: Any = None) -> None:
        loss = model(x).square().mean()
        if forward_done is not None:
            forward_done()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if prof is not None:
            prof.step(loss=loss.detach())

    for _ in range(30):
        step()
    # one sampled step's tracked allocations by the end of its forward pass, the collector off for it
    gc.collect()
    gc.disable()
    before = gc.get_count()[0]
    at_forward: list[int] = []
    step(lambda: at_forward.append(gc.get_count()[0] - before))
    gc.enable()

    events: list[tuple[int, float]] = []
    started: dict[str, float] = {}

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            events.append((int(info["generation"]), time.perf_counter() - started["t"]))

    gc.callbacks.append(callback)
    t0 = time.thread_time()
    for _ in range(steps):
        step()
    run_s = time.thread_time() - t0
    gc.callbacks.remove(callback)
    if prof is not None:
        prof.detach()
    gens: dict[str, Any] = {}
    for g in (0, 1, 2):
        times = [d for gen, d in events if gen == g]
        gens[str(g)] = {
            "collections": len(times),
            "per_step": len(times) / steps,
            "s": sum(times),
            "ms_per_step": 1e3 * sum(times) / steps,
            "longest_ms": 1e3 * max(times) if times else 0.0,
        }
    total = sum(d for _, d in events)
    return {
        "tracked_allocations_by_forward_end": at_forward[0],
        "steps": steps,
        "step_ms": 1e3 * run_s / steps,
        "collector_ms_per_step": 1e3 * total / steps,
        "collector_share_of_step": total / run_s if run_s else None,
        "generations": gens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gc_cost_cpu.json")
    ap.add_argument("--one", choices=list(CONFIGS), help=argparse.SUPPRESS)  # (the child's)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(_one(args.one, args.blocks, args.steps)))
        return
    results = {}
    for name in CONFIGS:
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--one",
                name,
                "--blocks",
                str(args.blocks),
                "--steps",
                str(args.steps),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[name]
        print(
            f"{name:9s} tracked objects by the forward's end +{r['tracked_allocations_by_forward_end']:,}; "
            f"collections per step {[round(r['generations'][g]['per_step'], 3) for g in '012']}; "
            f"collector {r['collector_ms_per_step']:.3f} ms of a {r['step_ms']:.2f} ms step; "
            f"longest full collection {r['generations']['2']['longest_ms']:.0f} ms"
        )
    import torch

    out = {
        "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "blocks": args.blocks,
        "inspected_tensors_per_sampled_step": 8 * args.blocks + 1,
        "results": results,
    }
    every, base = results["every"], results["baseline"]
    out["collector_us_per_inspected_tensor"] = (
        1e3
        * (every["collector_ms_per_step"] - base["collector_ms_per_step"])
        / out["inspected_tensors_per_sampled_step"]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(
        f"collector per inspected tensor (every step sampled): {out['collector_us_per_inspected_tensor']:.3f} us"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

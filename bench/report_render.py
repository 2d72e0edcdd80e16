"""Benchmark: time to render the HTML report of a gpt2-small-sized run with 100 sampled steps.

The tables are synthetic (tests/report_fixtures.py) but shaped by GPT-2 small's real module list: the model is
built from transformers' GPT2Config on the meta device (no weights, no download), and every leaf module gets
activation, activation-gradient, weight, weight-gradient and weight-update rows on each of the 100 sampled steps.
Target: under 10 s on a 2-core CPU machine. Writes bench/results/report_render_cpu.json. ``--n-layer 96``:
the same blocks 96 deep (1,160 modules: a module count of the largest dense LLMs, or of an MoE whose experts
are Linear modules), into report_render_cpu_96_layers.json.

    python bench/report_render.py [--steps 100] [--repeat 3] [--n-layer 12]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from report_fixtures import layers_from_module, recommendation_dict, synthetic_run  # noqa: E402

import precprof  # noqa: E402
from precprof import hardware  # noqa: E402
from precprof.report import render_report  # noqa: E402


def gpt2_small_layers(n_layer: int = 12) -> list:
    """GPT-2 small's leaf modules in forward order, from the real transformers class on the meta device
    (``n_layer`` blocks)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer))
    return layers_from_module(model, tokens=8 * 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="sampled steps in the run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=12, help="GPT-2 blocks (12: gpt2-small)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    name = "report_render_cpu" + (f"_{args.n_layer}_layers" if args.n_layer != 12 else "")
    args.out = args.out or str(ROOT / "bench" / "results" / f"{name}.json")

    layers = gpt2_small_layers(args.n_layer)
    t0 = time.perf_counter()
    tables, summary = synthetic_run("fp16", layers=layers, steps=args.steps, sample_every=1, seed=0)
    t_build = time.perf_counter() - t0
    sizes = {k: len(v) for k, v in tables.items()}
    print(f"{len(layers)} modules; tables built in {t_build:.1f} s: {sizes}")

    times, cpu = [], []
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "report.html"
        for i in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            render_report(tables, summary, out, recommendation=recommendation_dict())
            times.append(time.perf_counter() - t0)
            # CPU time of this process: on a shared machine wall time also counts other people's work
            cpu.append(time.process_time() - c0)
            print(f"render {i + 1}/{args.repeat}: {times[-1]:.2f} s wall, {cpu[-1]:.2f} s CPU")
        html_bytes = out.stat().st_size
    result = {
        "benchmark": "report_render",
        "what": "render_report() of a gpt2-small-sized run (synthetic tables at GPT-2 small's module list)",
        "n_layer": args.n_layer,
        "sampled_steps": args.steps,
        "modules": len(layers),
        "table_rows": sizes,
        "render_s": times,
        "render_s_median": statistics.median(times),
        "render_s_max": max(times),
        "render_cpu_s": cpu,
        "load_average_1min": os.getloadavg()[0],
        "html_bytes": html_bytes,
        "target_s": 10.0,
        "ok": max(times) < 10.0,
        "machine": {
            "cpu": hardware.detect("cpu").name,  # the model name (platform.processor() is "" on Linux)
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "precprof": precprof.__version__,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"median {result['render_s_median']:.2f} s, max {result['render_s_max']:.2f} s "
        f"(target < 10 s), {html_bytes / 2**20:.1f} MiB -> {args.out}"
    )


if __name__ == "__main__":
    main()

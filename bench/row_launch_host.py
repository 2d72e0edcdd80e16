"""precprof's own host work to launch the row kernels of a sampled step's parameters, without a GPU.

GPT-2 small's 148 parameter shapes (fp32, empty tensors: nothing is read) go through ``TritonRows.add`` one by
one and through ``TritonRows.add_many`` (up to 16 a launch), with every compiled variant's direct launcher
replaced by one that records the launch and does nothing. What is timed is precprof's Python up to the launcher:
the lookups, the grouping by dtype and size, the arguments. What a launch costs beyond it (Triton's launcher,
the driver: about 20 us a launch on an H200 machine, 2026-11-27) is saved once per launch that ``add_many``
does not make; ``gpu_validate``'s kernels stage (``param_launches``) times both ways on a GPU, launches
included.

    python bench/row_launch_host.py [--out bench/results/row_launch_host_cpu.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels are defined (never run) without a GPU
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from precprof.stats import triton_engine as te  # noqa: E402
from precprof.stats.layout import LAYOUT  # noqa: E402


def _gpt2_small_params() -> list[tuple[int, ...]]:
    spec = importlib.util.spec_from_file_location("_gpu_validate", ROOT / "bench" / "gpu_validate.py")
    assert spec is not None and spec.loader is not None
    gv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gv)
    shapes: list[tuple[int, ...]] = gv._gpt2_small_params()
    return shapes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="best of this many medians")
    ap.add_argument("--reps", type=int, default=50, help="calls per median")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if te.unavailable(torch.device("cpu")) is not None:
        raise SystemExit(f"row_launch_host: {te.unavailable(torch.device('cpu'))}")
    xs = [torch.empty(s) for s in _gpt2_small_params()]
    at = list(range(len(xs)))
    launches: list[int] = []

    def launcher(programs: int, stream: int, args: tuple[Any, ...], tensors: int = 1) -> None:
        launches.append(tensors)

    rows_engine = te.TritonRows(torch.device("cpu"), LAYOUT)
    for v in te.variants_of([torch.float32]):
        rows_engine._direct[v] = launcher
    rows = LAYOUT.empty_rows(len(xs), torch.device("cpu"))

    def one_each() -> None:
        for x, r in zip(xs, at, strict=True):
            rows_engine.add(x, rows, r, 0)

    def many() -> None:
        rows_engine.add_many(xs, rows, at, 0)

    out: dict[str, Any] = {"tensors": len(xs), "python": sys.version.split()[0], "torch": torch.__version__}
    best: dict[str, list[float]] = {"one_each": [], "many": []}
    for _ in range(args.rounds):  # alternating, so that the machine's drift hits both alike
        for name, fn in (("one_each", one_each), ("many", many)):
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            best[name].append(statistics.median(times))
    for name, fn in (("one_each", one_each), ("many", many)):
        launches.clear()
        fn()
        out[name] = {
            "us_per_tensor": min(best[name]) / len(xs) * 1e6,
            "launches": len(launches),
            "tensors_launched": sum(launches),
        }
        print(f"{name:9s} {out[name]['us_per_tensor']:.2f} us a tensor, {len(launches)} launches")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()

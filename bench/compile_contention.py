"""How much of the interpreter a Triton compile on threads takes from the training thread (issue 33, goal 6).

On an H200 with an empty Triton cache, precprof's first training step took 1.71 s against 0.40 s without it,
while its kernels compiled on two threads beside the training (``bench/results/README_h200_2026-11-27b.md``);
the 282 steps after it ran at the unprofiled speed. A compile holds the interpreter lock through its Python
parts (imports, the code generator) and some of its C++ ones, and the training thread's host work waits.

This bench needs no GPU: it compiles the block kernel for an sm_90 target (``triton.compile``, as
``tests/test_triton_block.py`` does) on ``--workers`` threads, ``--variants`` variants, while the main thread
repeats a unit of host work (a loop of small torch ops), and reports the main thread's rate in each quarter
second against its rate alone. The preloaded configurations first import in the main thread what the compile
imports lazily (``triton_compile.preload_compiler``, as the Profiler's attach does: 0.12-0.18 s here).

On this project's 2-core machine (``bench/results/compile_contention_cpu.json``, triton 3.9 and 3.6, 2 repeats):
importing ``triton`` itself on the compile's thread left the main thread 2% of its rate for a quarter second
(precprof imports it at attach, in the main thread); with the rest preloaded, the worst quarter second of the
main thread went from 0.00-0.39 of its rate to 0.12-0.52 in 7 of 8 pairs. The compile's code generation still
takes the lock in bursts, and with 2 compile threads and the main thread on 2 cores the CPUs are shared too:
a GPU machine's 16 cores must say what is left (``gpu_validate.py``'s first_step stage).

    python bench/compile_contention.py --out bench/results/compile_contention_cpu.json

``--where process`` runs the same compiles in another process (as ``stats/triton_ahead.py`` does since
2026-11-27c), the main thread measured here. On the 2-core machine, 2 workers, 2 repeats
(``bench/results/compile_contention_process_cpu.json``): the main thread ran at 0.95-0.96 of its rate in the
first second against 0.24-0.47 with threads, its worst quarter second at 0.33-0.39 against 0.02-0.17, its mean
at 0.62-0.81 against 0.48-0.53; the compile took 9.3 s against 5.3-6.6 (the other process imports torch and
triton first). What is left of the main thread's loss there is the two cores shared with the compile.

Each configuration runs in a fresh process with an empty Triton cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_UNIT_OPS = 200


def _work_unit() -> None:
    import torch

    x = torch.ones(8)
    for _ in range(_UNIT_OPS):
        x = x * 1.0001 + 0.0


def _rate(seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        _work_unit()
        n += 1
    return n / (time.perf_counter() - t0)


def _compile(kind: int, tile: int) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from precprof.stats import blocks
    from precprof.stats import triton_block as tb
    from precprof.stats import triton_block_kernels as k

    signature = {"x_ptr": "*i32" if kind == 0 else "*i16", "tmax_ptr": "*i32", "part_ptr": "*fp64"}
    signature.update(dict.fromkeys(["n_along", "n_across", "st_along", "st_across", "tiles", "iters"], "i64"))
    consts = dict(KIND=kind, TA=tile, MASK=tb._mask([tb.slot(r) for r in blocks.RECIPES]), **tb._constants())
    signature.update(dict.fromkeys(consts, "constexpr"))
    source = ASTSource(k._blocks, signature=signature, constexprs=consts)
    compile(source, target=GPUTarget("cuda", 90, 32), options=dict(tb.LAUNCH_OPTIONS))


def _todo(variants: int) -> list[tuple[int, int]]:
    return [(kind, tile) for kind in (0, 2) for tile in (32, 16, 8, 4, 64)][:variants]


def compile_only(workers: int, variants: int) -> None:
    """The compiles alone, on ``workers`` threads (the other process of ``child(..., process=True)``)."""
    sys.path.insert(0, str(ROOT))
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(lambda kt: _compile(*kt), _todo(variants)))


def child(workers: int, variants: int, preload: bool, process: bool = False) -> dict[str, Any]:
    """One configuration, in this (fresh) process; ``process``: the compiles in another process (as
    ``stats/triton_ahead.py`` runs them), the main thread here."""
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    # what precprof imports by attach in the main thread: triton and its kernels' modules (``_kernels()``)
    t0 = time.perf_counter()
    import triton

    from precprof.stats import triton_block_kernels, triton_compile, triton_engine, triton_kernels  # noqa: F401

    imported_s = time.perf_counter() - t0
    preload_s = None
    if preload:
        t0 = time.perf_counter()
        triton_compile.preload_compiler()
        preload_s = time.perf_counter() - t0
    alone = _rate(2.0)
    todo = _todo(variants)
    spans: list[tuple[float, float]] = []
    t_start = time.perf_counter()

    def one(kind: int, tile: int) -> None:
        a = time.perf_counter()
        _compile(kind, tile)
        spans.append((a - t_start, time.perf_counter() - t_start))

    def run() -> None:
        if process:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            cmd = [sys.executable, __file__, "--compile-only", f"{workers},{variants}"]
            subprocess.run(cmd, env=env, check=True)
            spans.append((0.0, time.perf_counter() - t_start))
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda kt: one(*kt), todo))

    thread = threading.Thread(target=run)
    thread.start()
    samples = []
    while thread.is_alive():
        a, n = time.perf_counter(), 0
        while time.perf_counter() - a < 0.25:
            _work_unit()
            n += 1
        samples.append((round(a - t_start, 3), n / (time.perf_counter() - a) / alone))
    thread.join()
    worst = min(r for _, r in samples) if samples else None
    first = samples[:4]
    return {
        "workers": workers,
        "variants": variants,
        "preload": preload,
        "where": "process" if process else "threads",
        "triton": triton.__version__,
        "imported_at_attach_s": imported_s,
        "preload_s": preload_s,
        "compile_wall_s": time.perf_counter() - t_start,
        "rate_alone_units_per_s": alone,
        "rate_share_samples": samples,
        "worst_quarter_second_share": worst,
        "first_second_share": sum(r for _, r in first) / len(first) if first else None,
        "mean_share": sum(r for _, r in samples) / len(samples) if samples else None,
        "compile_spans_s": sorted(spans),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workers", default="1,2", help="compile threads to try (1,2)")
    ap.add_argument("--variants", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--where", default="threads,process", help="where the compiles run (threads,process)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--compile-only", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compile_only:
        w, v = args.compile_only.split(",")
        compile_only(int(w), int(v))
        return 0
    if args.child:
        w, v, p, where = args.child.split(",")
        print(json.dumps(child(int(w), int(v), p == "1", where == "process")))
        return 0
    results = []
    for rep in range(args.repeats):
        for workers in (int(w) for w in args.workers.split(",")):
            for where, preload in [(w, p) for w in args.where.split(",") for p in (False, True)]:
                if where == "process" and not preload:
                    continue  # the main thread imports nothing of the compile's then
                env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="pp-contention-")
                spec = f"{workers},{args.variants},{int(preload)},{where}"
                cmd = [sys.executable, __file__, "--child", spec]
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                rec = json.loads(out.strip().splitlines()[-1])
                rec["repeat"] = rep
                results.append(rec)
                print(
                    f"{where:8s} workers {workers} preload {'yes' if preload else 'no '}: main thread at "
                    f"{rec['first_second_share']:.2f} of its rate in the first second, worst quarter second "
                    f"{rec['worst_quarter_second_share']:.2f}, mean {rec['mean_share']:.2f} over "
                    f"{rec['compile_wall_s']:.1f} s of compile"
                    + (f" (preload {rec['preload_s']:.2f} s)" if preload else ""),
                    flush=True,
                )
    data = {
        "what": __doc__.split("\n\n")[0],
        "cpu": os.cpu_count(),
        "python": sys.version.split()[0],
        "results": results,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

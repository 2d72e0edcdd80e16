"""Streaming a whole training run to disk (Profiler(out=...)): host memory of the recording, size of the run
directory, `precprof report` time on many sampled steps, and the cost of a flush on the training step.

What is real and what is replayed (a 2-core CPU cannot train gpt2-small for 1,000 sampled steps, nor
gpt2-medium for one in a reasonable time):

- step times: real gpt-mini training steps (batch 4 x seq 64, fp32, AdamW, every step sampled, block formats
  off), with the recording kept in memory and streamed, configurations interleaved; and the time of
  ``prof.step()`` (where a sampled step's rows are handed to the writer thread) on real gpt2-small steps;
- every figure at 1,000 sampled steps: the rows of a real sampled step of the model (what the Profiler copied
  to the host) handed 1,000 times, renumbered, to the same recording and stream writer the Profiler uses
  (``Recorded`` + ``StreamWriter``), so memory and bytes on disk are the real code's on the real row shapes;
- `precprof report`: a subprocess (`python -m precprof report RUN`, imports included) on that run directory as a
  kill leaves it (the parts) and after it was saved (the four tables).

Usage: python bench/stream.py [--steps 1000] [--medium-steps 1000]
Writes bench/results/stream_cpu.json.
"""

from __future__ import annotations

import argparse
import copy
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

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from precprof import parts, pipeline, rundir  # noqa: E402
from precprof import tables as T  # noqa: E402
from precprof.capture import Profiler  # noqa: E402
from precprof.capture.recorded import Recorded  # noqa: E402
from precprof.capture.stream import StreamWriter  # noqa: E402
from precprof.flush import Flush  # noqa: E402
from precprof.models import build_model  # noqa: E402

SEQ = 64


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def dir_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def train(
    model_name: str, steps: int, out: Path | None, batch: int = 1
) -> tuple[list[float], list[float], list[Flush]]:
    """Real training steps, every one sampled: their times, the times of their ``prof.step()`` (the flush, on
    the training thread), and the last flush with layer rows the Profiler handed on."""
    torch.manual_seed(0)
    model = build_model(model_name, vocab_size=50257, seq_len=SEQ).module
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prof = Profiler(model, opt, sample_every=1, block_formats=False, out=out)
    flushes: list[Flush] = []
    times, step_calls = [], []
    g = torch.Generator().manual_seed(0)
    with prof:
        handed_on = prof._recorded.take  # the recording of this attachment (out= gives it a stream at attach)

        def take() -> Flush:
            f = handed_on()
            if f.layer_parts:  # the last sampled one only: holding them all would be the in-memory recording
                flushes[:] = [f]
            return f

        prof._recorded.take = take  # type: ignore[method-assign]
        for _ in range(steps):
            seq = torch.randint(0, 50257, (batch, SEQ + 1), generator=g)
            t0 = time.perf_counter()
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            prof.step(loss=loss.detach())
            now = time.perf_counter()
            times.append(now - t0)
            step_calls.append(now - t1)
    return times, step_calls, flushes


def renumbered(flush: Flush, step: int) -> Flush:
    """The rows of ``flush`` as step ``step``, their numbers varied as a real step's would be (each count and
    statistic times a random factor in [0.5, 1.5), step by step): identical steps would compress far better on
    disk than real ones, once parts are merged. The loss scale stays: a real run has a few, each a power of two
    (varied, it gave the advisor 173,000 distinct scales to read)."""
    rng = np.random.default_rng(step)

    def part(p: dict[str, Any]) -> dict[str, Any]:
        out = {k: (v.copy() if isinstance(v, np.ndarray) else list(v)) for k, v in p.items()}
        n = len(next(iter(p.values())))
        for k, v in out.items():
            if k in (T.STEP, T.ORDER, T.EXPONENT, T.CALLS, T.SCALE) or not isinstance(v, np.ndarray):
                continue
            if v.dtype.kind in "iu":
                out[k] = np.rint(v * rng.uniform(0.5, 1.5, n)).astype(v.dtype)
            elif v.dtype.kind == "f":
                out[k] = v * rng.uniform(0.5, 1.5, n).astype(v.dtype)
        out[T.STEP] = np.full(n, step, dtype=np.int64)
        return out

    return Flush(
        step_rows=[{**r, T.STEP: step} for r in flush.step_rows[-1:]],
        layer_parts=[part(p) for p in flush.layer_parts],
        hist_parts=[part(p) for p in flush.hist_parts],
        memory_rows=[{**r, T.STEP: step} for r in flush.memory_rows],
    )


def replay(flush: Flush, run_dir: Path, n: int, checkpoints: tuple[int, ...]) -> dict[str, Any]:
    """Hand ``n`` renumbered copies of ``flush`` to a streaming recording; memory at ``checkpoints``."""
    # the first summary a Profiler streaming on this machine writes: its config and hardware
    first = {T.SUMMARY_CONFIG: {"bench": "stream replay"}, **pipeline.describe_machine("cpu")}
    run = rundir.claim(run_dir, summary=first, option="out")
    rec = Recorded(StreamWriter(run.path, parts.new_segment(run.path, 0)))
    base = rss_mb()
    out: dict[str, Any] = {"rss_mb_before": base}
    t0 = time.perf_counter()
    for i in range(n):
        rec.new = renumbered(flush, i)
        rec.take()
        if i + 1 in checkpoints:
            rec.sink.drain()
            out[f"at_{i + 1}"] = {
                "recording_host_bytes": rec.host_bytes,
                "rss_mb_growth": rss_mb() - base,
                "run_dir_mb": dir_mb(run.path),
            }
    rec.sink.close()
    # the queue is bounded, so this is the writer thread's pace: seconds of writing per sampled step
    out["writer_s_per_sampled_step"] = (time.perf_counter() - t0) / n
    out["stream_files"] = sum(1 for _ in (run.path / parts.STREAM_DIR).rglob("*.parquet"))
    run.release()
    return out


def merge_cost(flush: Flush, tmp: Path) -> dict[str, Any]:
    """Seconds the writer thread spends merging ``COMPACT_EVERY`` flushes of these rows (every 64 sampled
    steps, on the writer thread), beside the seconds it spends writing them one by one."""
    seg = parts.new_segment(tmp, 0)
    rec = Recorded(StreamWriter(tmp, seg))
    old, parts.COMPACT_EVERY = parts.COMPACT_EVERY, 1 << 30  # write singles only, merge by hand below
    try:
        t0 = time.perf_counter()
        for i in range(old):
            rec.new = renumbered(flush, i)
            rec.take()
        rec.sink.close()
        write_s = time.perf_counter() - t0
    finally:
        parts.COMPACT_EVERY = old
    t0 = time.perf_counter()
    merged = parts.compact(seg.path, 0, old - 1, T.TABLES)
    merge_s = time.perf_counter() - t0
    return {
        "flushes": merged,
        "merge_s": merge_s,
        "write_s": write_s,
        "merge_over_writing": merge_s / write_s,
    }


def report_time(run_dir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "precprof", "report", str(run_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    return {"wall_s": time.perf_counter() - t0, "rc": res.returncode, "stderr_tail": res.stderr[-300:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000, help="sampled steps replayed for gpt2-small")
    ap.add_argument("--medium-steps", type=int, default=1000, help="sampled steps replayed for gpt2-medium")
    ap.add_argument(
        "--timed-steps", type=int, default=8, help="real gpt-mini steps per configuration and round"
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp(prefix="precprof-bench-stream-"))
    result: dict[str, Any] = {
        "machine": {
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "setup": f"gpt2-small / gpt2-medium, batch 1 x seq {SEQ}, fp32, AdamW, every step sampled, no block formats",
    }
    try:
        # 1. the step: kept in memory vs streamed, interleaved (first step of each left out: warm-up); gpt-mini,
        # whose steps a 2-core CPU runs in seconds (a sampled gpt2-small step takes tens of seconds here)
        times: dict[str, list[float]] = {"memory": [], "stream": []}
        calls: dict[str, list[float]] = {"memory": [], "stream": []}
        for rnd in range(2):
            for how in ("memory", "stream"):
                out = tmp / f"steps-{how}-{rnd}" if how == "stream" else None
                t, c, _ = train("gpt-mini", args.timed_steps + 1, out, batch=4)
                times[how] += t[1:]
                calls[how] += c[1:]
        mean = {k: statistics.mean(v) for k, v in times.items()}
        result["step_time"] = {
            "model": "gpt-mini, batch 4 x seq 64, every step sampled",
            "sampled_step_mean_s": mean,
            "sampled_step_median_s": {k: statistics.median(v) for k, v in times.items()},
            "prof_step_call_mean_s": {k: statistics.mean(v) for k, v in calls.items()},
            "streamed_over_in_memory": mean["stream"] / mean["memory"],
            "steps_each": len(times["memory"]),
        }
        print(json.dumps(result["step_time"], indent=1), flush=True)
        # the rows of a real gpt2-small sampled step, streamed: what the training thread pays to hand them on
        _, small_calls, small_flushes = train("gpt2-small", 2, tmp / "small-real")
        flush_small = small_flushes[-1]
        result["step_time"]["gpt2_small_prof_step_call_s"] = small_calls
        rows = {
            "layer_rows": sum(len(next(iter(p.values()))) for p in flush_small.layer_parts),
            "histogram_rows": sum(len(next(iter(p.values()))) for p in flush_small.hist_parts),
            "flush_host_bytes": flush_small.nbytes,
        }
        # 2. memory and bytes on disk over 1,000 sampled steps
        small = replay(flush_small, tmp / "small", args.steps, (10, 100, args.steps))
        small["rows_per_sampled_step"] = rows
        small["in_memory_recording_bytes_extrapolated"] = rows["flush_host_bytes"] * args.steps
        result["gpt2_small"] = small
        print(json.dumps(small, indent=1), flush=True)
        r = report_time(tmp / "small")
        result["gpt2_small"]["report_killed_run"] = r
        result["gpt2_small"]["merge"] = merge_cost(flush_small, tmp / "merge-small")
        # 3. gpt2-medium: report time over 1,000 sampled steps, as killed and as saved
        _, _, med = train("gpt2-medium", 1, None)
        medium = replay(med[-1], tmp / "medium", args.medium_steps, (args.medium_steps,))
        medium["report_killed_run"] = report_time(tmp / "medium")
        medium["report_killed_run_again"] = report_time(tmp / "medium")  # warm file cache
        print(json.dumps(medium, indent=1), flush=True)
        t0 = time.perf_counter()
        tables = T.read_tables(tmp / "medium")
        read_s = time.perf_counter() - t0
        summary = {**T.read_summary(tmp / "medium"), T.SUMMARY_STATUS: T.STATUS_COMPLETE}
        t0 = time.perf_counter()
        pipeline.finish_run(tmp / "medium", tables, summary, render=False)
        medium["save_s"] = {"read_stream": read_s, "finish_run_without_render": time.perf_counter() - t0}
        del tables
        medium["run_dir_mb_saved"] = dir_mb(tmp / "medium")
        medium["report_saved_run"] = report_time(tmp / "medium")
        medium["report_saved_run_again"] = report_time(tmp / "medium")
        # the report of the same model over 10 sampled steps: what does not grow with the run
        ten = replay(med[-1], tmp / "medium10", 10, (10,))
        medium["report_10_sampled_steps_killed_run"] = report_time(tmp / "medium10")
        medium["run_dir_mb_10"] = ten["at_10"]["run_dir_mb"]
        result["gpt2_medium"] = copy.deepcopy(medium)
        print(json.dumps(medium, indent=1), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    dest = ROOT / "bench" / "results" / "stream_cpu.json"
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(dest)


if __name__ == "__main__":
    main()

"""Host cost of a sampled step per inspected tensor, and what each part of a sampled step costs.

A stack of ``--blocks`` tiny blocks (Linear(d, d) + GELU, d = 8, batch 4): the statistics of tensors this
small cost next to nothing, so what a sampled step adds is precprof's host work around each tensor (hooks,
lookups, launches, bookkeeping) and its per-step work (flush, memory tracking, weight-update sample). On a
CUDA device the same stack measures the host side of each launch.

Configurations, each its own copy of the model, in interleaved rounds inside one process (machine noise hits
all alike); means of the timed steps:

  baseline     no profiler
  unsampled    attached, no step sampled (``sample_every`` larger than the run)
  sampled      every step sampled, the Profiler's defaults (memory measured on the first 2 sampled steps, then
               on every 4th, spacing out to every 32nd while the measured steps agree, ``memory_every``; the block
               what-if's groups adapted to its budget)
  -blocks      ... without the block-format what-if (``block_formats=False``)
  fixed deal   every step sampled, the layers dealt into ``FIXED`` (3) block groups, as in each of:
  memory each  ... with memory measured on every sampled step (``memory_every=1``): what a sampled step
               that measures memory costs
  -memory      ... without memory tracking (``memory=False``)
  -updates     ... without the weight-update sample (``weight_updates=False``)
  -rows        ... with the row statistics replaced by a no-op (the hooks, lookups and bookkeeping stay)
  -stream      ... with the rows kept in memory (no ``out=``): every other configuration streams them into a
               run directory (a temporary folder) as ``precprof train`` and the callbacks do, its writer
               drained after each round, untimed (``--no-stream``: none streams)
  thread writer ... streaming with the writer thread writing the parts itself (``stream.USE_PROCESS`` off,
               as where the writer process cannot start, and as every stream before 2026-11-28c)
  hooks only   every part above off at once: the hooks and the per-step bookkeeping alone
  empty hooks  no profiler: the hooks a sampled step installs, doing nothing (two forward pre-hooks and two
               forward hooks on every module: the statistics' and the memory tracker's; a gradient hook on
               every output; two post-accumulate-grad hooks on every parameter; saved-tensor hooks around
               the forward): what hooking a step from Python costs at the least, the floor under "sampled"

A configuration's step time is the median of its steps, taken apart for the steps that measure memory and
those that do not where a configuration has both, weighted by how many of each it ran (the mean of a
schedule's cycle, robust to the garbage collections that land in one window or another). Per part: its cost is
``fixed deal - (fixed deal without it)`` (with each configuration's budget adapting, each would settle on its
own number of groups from its own noisy steps, moving a part by a millisecond), the block what-if's
``sampled - -blocks``; "copy and flush" is timed inside ``Profiler.step()`` of the sampled configuration. The
headline is ``(sampled - baseline) / inspected tensors``; beside it, the same from the differences within each
round (a trimmed mean over rounds), which this machine's drift over minutes moves less.

Clock: on the CPU the thread's own CPU time (``time.thread_time``, one torch thread): host work is what is
measured, and a machine shared with other work (CI, a laptop) barely moves it, where wall time moved by 2x.
``--clock wall`` (the default on CUDA, where the device's time counts) measures wall time.

Many short rounds (32 of 2 steps) rather than a few long ones: this machine's speed drifts over seconds, and
short rounds spread the drift over every configuration alike; each round starts one configuration later than the
one before, so that none always runs last.

Per configuration the JSON also gives the collections of Python's garbage collector during its timed steps, by
generation, and their time (``gc``): a full collection walks every object of the process.

``--cprofile CONFIG`` (after the rounds): cProfile's view of ``--cprofile-steps`` more steps of that configuration
(``"memory each"``: steps that measure memory, whose replay of the allocator's history on a GPU took 73 ms of host
time on an H200 on 2026-12-04 against 1.3 ms for the CPU path), the functions by their own time and by
cumulative time, in the JSON (``cprofile``).

Usage: python bench/host_cost.py [--device cpu|cuda] [--blocks 100] [--rounds 32] [--steps 2] [--cprofile CONFIG]
Writes bench/results/host_cost_<device>.json.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import gc
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precprof  # noqa: E402
from precprof import tables as T  # noqa: E402
from precprof.capture import Profiler, stream  # noqa: E402

# the unprofiled step of the default stack (100 blocks, d = 8, batch 4, one thread) on the machine where goal 1
# (<= 15 us per tensor) was first measured, an AMD EPYC (bench/results/host_cost_cpu.json, 2026-11-27): host
# work scales with the machine's speed as the step does, and this machine's CPU changes between sessions (an
# Intel Xeon ran the same step in 20-24 ms on 2026-11-29), so each run also says its figure at that speed
REFERENCE_BASELINE_S = 0.01338

# the parts other than the block what-if are measured with the layers dealt into this many groups in each of
# their configurations (about what the budget settles on here): adapting, each configuration's budget would
# settle on its own number of groups from its own noisy steps, and the what-if's cost would move the parts
FIXED = 3
CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "unsampled": {"sample_every": 10**9},
    "sampled": {"sample_every": 1},
    "fixed deal": {"sample_every": 1, "block_groups": FIXED},
    "memory each": {"sample_every": 1, "memory_every": 1, "block_groups": FIXED},
    "-blocks": {"sample_every": 1, "block_formats": False},
    "-memory": {"sample_every": 1, "memory": False, "block_groups": FIXED},
    "-updates": {"sample_every": 1, "weight_updates": False, "block_groups": FIXED},
    "-rows": {"sample_every": 1, "_rows_off": True, "block_groups": FIXED},
    "-stream": {"sample_every": 1, "_no_stream": True, "block_groups": FIXED},
    "thread writer": {"sample_every": 1, "_thread_writer": True, "block_groups": FIXED},
    "hooks only": {
        "sample_every": 1,
        "block_formats": False,
        "memory": False,
        "weight_updates": False,
        "_rows_off": True,
        "_no_stream": True,
    },
    "empty hooks": {"_empty_hooks": True},
}
PARTS = {  # part: (the configuration with it, the one without)
    "row statistics": ("fixed deal", "-rows"),
    "block what-if": ("sampled", "-blocks"),
    "memory tracking (the default cadence, every 4th sampled step spacing out to every 32nd)": (
        "fixed deal",
        "-memory",
    ),
    "weight-update sample": ("fixed deal", "-updates"),
    "stream (the flush pickled in Profiler.step, the writer process beside the steps)": (
        "fixed deal",
        "-stream",
    ),
    "the writer thread's own writes instead of the process (the tables made in Profiler.step)": (
        "thread writer",
        "fixed deal",
    ),
}


def tiny_stack(blocks: int, width: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers)


def empty_hooks(model: nn.Module) -> None:
    """The hooks a sampled step installs, doing nothing (the ``empty hooks`` configuration)."""

    def on_grad(g: torch.Tensor) -> None:
        return None

    def on_output(module: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(on_grad)

    for m in model.modules():
        for _ in range(2):  # the statistics' and the memory tracker's
            m.register_forward_pre_hook(lambda module, args: None)
        m.register_forward_hook(on_output)
        m.register_forward_hook(lambda module, args, out: None)
    for prm in model.parameters():
        for _ in range(2):
            prm.register_post_accumulate_grad_hook(lambda p: None)


def typical_step(times: list[float], measured: list[bool]) -> float:
    """A configuration's step: the median step of each kind (memory measured or not), weighted by their
    counts; the plain median where every step is alike."""
    kinds = [[t for t, m in zip(times, measured, strict=True) if m == k] for k in (True, False)]
    kinds = [k for k in kinds if k]
    return sum(len(k) * statistics.median(k) for k in kinds) / len(times)


def paired_added(with_it: list[float], without: list[float], trim: float = 0.1) -> float:
    """The mean over rounds of ``with_it[r] - without[r]`` (each round's mean step of two configurations), the
    ``trim`` share of the highest and of the lowest differences left out."""
    diffs = sorted(a - b for a, b in zip(with_it, without, strict=True))
    if not diffs:
        return float("nan")
    k = int(len(diffs) * trim)
    kept = diffs[k : len(diffs) - k] or diffs
    return statistics.fmean(kept)


@contextlib.contextmanager
def rows_off(prof: Profiler) -> Iterator[None]:
    """The row statistics replaced by a no-op for this configuration's steps (bench only): every tensor still
    goes through the hooks and the engine's entry, which returns before reading it."""
    from precprof.stats import rows as stats_rows

    saved = stats_rows.NO_READ
    stats_rows.NO_READ = True
    try:
        yield
    finally:
        stats_rows.NO_READ = saved


def profile_steps(run: Callable[[str, int, bool], None], config: str, steps: int) -> dict[str, Any]:
    """cProfile's view of ``steps`` steps of ``config`` (untimed by the rounds): the functions by their own time
    and by cumulative time, and the wall time of the profiled steps."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    run(config, steps, False)
    pr.disable()
    wall = time.perf_counter() - t
    views = {}
    for key, top in (("tottime", 35), ("cumulative", 50)):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(top)
        views[key] = buf.getvalue()[-12000:]
    return {"config": config, "steps": steps, "wall_s_profiled": wall, **views}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=32, help="interleaved rounds per configuration")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--clock", choices=["thread", "wall"], default=None, help="thread on CPU, wall on CUDA")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--cprofile", default=None, help="a configuration whose steps cProfile views after the rounds"
    )
    ap.add_argument("--cprofile-steps", type=int, default=2)
    ap.add_argument(
        "--no-stream",
        action="store_true",
        help="the Profilers keep their rows in memory (no run directory; before 2026-11-28 every run did)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    clock_name = args.clock or ("wall" if dev.type == "cuda" else "thread")
    clock = time.perf_counter if clock_name == "wall" else time.thread_time
    torch.manual_seed(0)
    base = tiny_stack(args.blocks, args.width).to(dev)
    x = torch.randn(args.batch, args.width, device=dev)
    names = [c for c in args.configs.split(",") if c]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    if args.cprofile is not None and args.cprofile not in names:
        ap.error(
            f"--cprofile {args.cprofile!r} is not among --configs ({', '.join(names)}); profile one of them"
        )

    state: dict[str, dict[str, Any]] = {}
    for n in names:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        kw = {k: v for k, v in CONFIGS[n].items() if not k.startswith("_")}
        if not CONFIGS[n].get("_no_stream") and not args.no_stream:  # a run directory, as users get one
            kw["out"] = tempfile.mkdtemp(prefix="precprof-host-cost-")
            atexit.register(shutil.rmtree, kw["out"], True)
        # compile_beside=False: on a GPU the kernels compile at attach, before any timed step (as in overhead.py)
        stream.USE_PROCESS = not CONFIGS[n].get("_thread_writer")  # read when the stream opens, at attach
        prof = (
            Profiler(model, optimizer=opt, compile_beside=False, **kw).attach()
            if n not in ("baseline", "empty hooks")
            else None
        )
        stream.USE_PROCESS = True
        if CONFIGS[n].get("_empty_hooks"):
            empty_hooks(model)
        state[n] = {"model": model, "opt": opt, "prof": prof, "times": [], "flush": [], "memory": []}

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # Python's collector, per configuration: the collections of each generation that ran during its timed steps
    # and their time (a full one walks every object of the process: the ten configurations' models and
    # Profilers among them)
    gc_now: dict[str, Any] = {"config": None, "t": 0.0}

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        n = gc_now["config"]
        if n is None:
            return
        if phase == "start":
            gc_now["t"] = time.perf_counter()
        else:
            rec = state[n].setdefault("gc", {}).setdefault(str(info.get("generation")), [0, 0.0])
            rec[0] += 1
            rec[1] += time.perf_counter() - gc_now["t"]

    gc.callbacks.append(on_gc)

    def one_step(n: str, record: bool) -> None:
        s = state[n]
        model, opt, prof = s["model"], s["opt"], s["prof"]
        sync()
        if prof is not None:
            # the Profiler times its steps from one step() to the next: here the other configurations' steps run
            # in between, which it would take for its own (its block budget and its sampler read those times);
            # its step starts now, as in a loop of its own
            prof._t_last = time.perf_counter()
        gc_now["config"] = n if record else None
        t0 = clock()
        if CONFIGS[n].get("_empty_hooks"):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = model(x)
            loss = out.square().mean()
        else:
            loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = clock()
        tracker = getattr(prof, "_tracker", None)  # (a Profiler before memory_every measured every step)
        measured = tracker is not None and getattr(getattr(tracker, "schedule", None), "measuring", True)
        if prof is not None:
            prof.step(loss=loss.detach())
        sync()
        t2 = clock()
        gc_now["config"] = None
        if record:
            s["times"].append(t2 - t0)
            s["flush"].append(t2 - t1)
            s["memory"].append(measured)

    def run(n: str, steps: int, record: bool) -> None:
        ctx = rows_off(state[n]["prof"]) if CONFIGS[n].get("_rows_off") else contextlib.nullcontext()
        with ctx:
            for _ in range(steps):
                one_step(n, record)
        if record:  # this round's mean step, for the paired estimate
            state[n].setdefault("rounds", []).append(statistics.fmean(state[n]["times"][-steps:]))
        sink = getattr(getattr(state[n]["prof"], "_recorded", None), "sink", None)
        if sink is not None:  # its writer thread done before the next configuration's steps, untimed
            sink.drain()

    for n in names:  # warm-up: the first sampled steps build what they reuse
        run(n, 3, record=False)
    for r in range(args.rounds):
        for n in names[r % len(names) :] + names[: r % len(names)]:  # each round starts one later
            run(n, args.steps, record=True)

    profiled = profile_steps(run, args.cprofile, args.cprofile_steps) if args.cprofile in state else None

    tensors = 0
    sampled = state.get("sampled", {}).get("prof")
    if sampled is not None:
        layers = sampled.tables()["layers"]
        last = layers[layers[T.STEP] == layers[T.STEP].max()]
        tensors = int(last.loc[last[T.TENSOR] != T.WEIGHT_UPDATE, T.CALLS].sum())
    mean = {n: typical_step(state[n]["times"], state[n]["memory"]) for n in names}
    base_s = mean.get("baseline", float("nan"))
    results: dict[str, Any] = {}
    for n in names:
        kinds = state[n]["memory"]
        results[n] = {
            "memory_measured_share": sum(kinds) / len(kinds) if kinds else 0.0,
            "mean_s": statistics.fmean(state[n]["times"]),
            "median_s": mean[n],
            "added_s": mean[n] - base_s,
            "ratio": mean[n] / base_s,
            "step_call_s": statistics.fmean(state[n]["flush"]) if n != "baseline" else 0.0,
            # generation -> [collections, seconds] over the timed steps
            "gc": {g: [c, round(t, 6)] for g, (c, t) in sorted(state[n].get("gc", {}).items())},
        }
    parts: dict[str, Any] = {}
    if "sampled" in mean:
        added = mean["sampled"] - base_s
        for part, (with_it, without) in PARTS.items():
            if with_it in mean and without in mean:
                parts[part] = mean[with_it] - mean[without]
        parts["copy and flush (inside Profiler.step)"] = results["sampled"]["step_call_s"]
        if "memory each" in mean and "-memory" in mean:
            parts["memory tracking on a step that measures it"] = mean["memory each"] - mean["-memory"]
        if "hooks only" in mean:
            parts["hooks, lookups and per-step bookkeeping (all parts off)"] = mean["hooks only"] - base_s
        if "empty hooks" in mean:
            parts["of which hooks that do nothing would cost (no profiler)"] = mean["empty hooks"] - base_s
        parts = {
            k: {"s": v, "share_of_added": v / added if added else float("nan")} for k, v in parts.items()
        }
    sampled_capture = sampled.summary() if sampled is not None else {}
    for p in (s["prof"] for s in state.values()):
        if p is not None:
            p.detach()
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    if dev.type == "cpu":
        with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
            device_name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    out = {
        "device": dev.type,
        "device_name": device_name,
        "threads": args.threads,
        "clock": clock_name,
        "blocks": args.blocks,
        "width": args.width,
        "batch": args.batch,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "stream": not args.no_stream,
        "torch": torch.__version__,
        "precprof": precprof.__version__,
        "inspected_tensors_per_sampled_step": tensors,
        "host_us_per_tensor": (
            (mean["sampled"] - base_s) / tensors * 1e6 if tensors and "sampled" in mean else None
        ),
        # the same from each round's own pair (its sampled steps less its baseline steps, run within the same
        # second), a trimmed mean over the rounds: this machine's speed drifts by half over minutes, which moves
        # each configuration's median, not a difference taken within a round
        # the headline scaled to the reference machine's speed (REFERENCE_BASELINE_S), for the default stack alone
        "reference_baseline_s": REFERENCE_BASELINE_S,
        "host_us_per_tensor_at_reference_speed": (
            (mean["sampled"] - base_s) / tensors * 1e6 * REFERENCE_BASELINE_S / base_s
            if tensors
            and "sampled" in mean
            and (args.device, args.threads, args.blocks, args.width, args.batch) == ("cpu", 1, 100, 8, 4)
            else None
        ),
        "host_us_per_tensor_paired": (
            paired_added(state["sampled"].get("rounds", []), state["baseline"].get("rounds", []))
            / tensors
            * 1e6
            if tensors and "sampled" in mean and "baseline" in mean
            else None
        ),
        "unsampled_us_per_tensor": (
            (mean["unsampled"] - base_s) / tensors * 1e6 if tensors and "unsampled" in mean else None
        ),
        "results": results,
        "parts": parts,
        # how the sampled configuration's block budget dealt the layers, and which steps measured memory
        "sampled_block_formats": sampled_capture.get("block_formats"),
        "sampled_memory_steps": sampled_capture.get("memory_steps"),
    }
    if profiled is not None:
        out["cprofile"] = profiled
    print(
        f"{args.blocks} x (Linear({args.width}) + GELU) on {device_name}, {tensors} tensors per sampled step, "
        f"{clock_name} clock"
    )
    print(f"{'config':<12}{'median ms':>10}{'added ms':>10}{'x':>8}{'mean ms':>10}")
    for n, r in results.items():
        print(
            f"{n:<12}{r['median_s'] * 1e3:>10.2f}{r['added_s'] * 1e3:>10.2f}{r['ratio']:>8.2f}"
            f"{r['mean_s'] * 1e3:>10.2f}"
        )
    if out["host_us_per_tensor"] is not None:
        print(
            f"sampled step: {out['host_us_per_tensor']:.1f} us of host work per inspected tensor "
            f"({out['host_us_per_tensor_paired']:.1f} us paired within rounds; the baseline step "
            f"{base_s * 1e3:.2f} ms)"
        )
    if out["host_us_per_tensor_at_reference_speed"] is not None:
        print(
            f"  at the speed of the machine goal 1 was set on (its baseline step {REFERENCE_BASELINE_S * 1e3:.2f} "
            f"ms): {out['host_us_per_tensor_at_reference_speed']:.1f} us"
        )
    if out["unsampled_us_per_tensor"] is not None:
        print(f"unsampled step: {out['unsampled_us_per_tensor']:.2f} us per tensor it would inspect")
    for part, v in parts.items():
        print(f"  {part:<58}{v['s'] * 1e3:>8.2f} ms {v['share_of_added']:>7.1%}")
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"host_cost_{dev.type}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

"""Profiling overhead of precprof against an un-profiled loop, the floor, and peer monitors.

Every configuration trains its own copy of the same model on the same batches; configurations run in
interleaved blocks inside one process, each block starting one configuration later than the one before (no
configuration always runs last), so that machine noise hits all of them alike. Per configuration it
reports the median and the mean step time (the mean amortises sampled steps, which the median hides), their
ratios to the un-profiled loop of the same run, precprof's own memory, and how many tensors and elements a
sampled step inspects.

Configurations:
  baseline        no monitoring
  floor           one read (a sum) of every tensor precprof inspects, from the same hooks: the cost of
                  touching the data at all
  precprof_1      precprof.Profiler, every step sampled
  precprof_10     precprof.Profiler(sample_every=10)
  precprof_auto   precprof.Profiler() as users get it: sampling within its overhead budget (3% of the run)
  precprof_0      attached, no step sampled (sample_every=0): what an unsampled step costs
  baseline_b      a second un-profiled copy: how far two identical configurations differ in the same run
  precprof_1_noblocks  every step sampled, without the block-format what-if (block_formats=False): what the
                  block formats cost (precprof_1 evaluates them for as many of the linear layers per
                  sampled step as fit the default block budget: block_groups=None, capture/block_budget.py)
  precprof_1_allblocks every step sampled, every linear layer's block formats on each (block_groups=1)
  precprof_1_memory    every step sampled, its rows kept in memory (no run directory): what the stream costs,
                  and the setting of every result before 2026-11-28
  precprof_1_thread    every step sampled, streaming with the writer thread writing the parts itself
                  (``stream.USE_PROCESS`` off, as before the writer process, 2026-11-28c): what the process saves
  debug_uo        transformers' DebugUnderflowOverflow (when transformers is installed)
  naive_item      a home-made per-module monitor calling .item() for absmax / nan / inf of every output and
                  gradient (what people write by hand)

Every precprof configuration streams its rows into a run directory (a temporary folder), as ``precprof
train``, the Hugging Face callback and the Lightning callback do: the stream writer's thread shares the
interpreter lock with the training. ``--no-stream`` keeps the rows in memory instead (``Profiler()`` without
``out=``), which is what every run of this bench measured before 2026-11-28.

Usage: python bench/overhead.py [--model gpt-mini] [-a n_layer=4 ...] [--device auto] [--precision bf16] [--blocks 6]
Writes bench/results/overhead_<device>_<model>[_<key><value>...].json.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import gc
import json
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precprof  # noqa: E402
from precprof import tables as T  # noqa: E402
from precprof.capture import Profiler, stream  # noqa: E402
from precprof.capture.plan import selected  # noqa: E402
from precprof.capture.records import _iter_tensors  # noqa: E402
from precprof.models import build_model  # noqa: E402


class Monitor:
    """A configuration: attach() before a block of steps, after_step() at each step's end, detach()."""

    name = "baseline"

    def attach(self, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> None:
        pass

    def after_step(self, loss: torch.Tensor) -> None:
        pass

    def detach(self) -> None:
        pass

    def info(self) -> dict[str, Any]:
        return {}


class Floor(Monitor):
    """Reads every tensor precprof would read, once, into a device accumulator (no sync)."""

    name = "floor"

    def attach(self, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> None:
        dev = next(model.parameters()).device
        self.acc = torch.zeros((), device=dev, dtype=torch.float32)
        self.handles: list[Any] = []
        mods = [m for n, m in model.named_modules() if selected(n, m, None)]

        def read(t: torch.Tensor) -> None:
            self.acc += t.detach().sum(dtype=torch.float32)

        def fwd(module: nn.Module, args: Any, out: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for p in module.parameters(recurse=False):
                read(p)
            for t in _iter_tensors(out):
                read(t)
                if t.requires_grad:
                    t.register_hook(lambda g: read(g))

        for m in mods:
            self.handles.append(m.register_forward_hook(fwd))
        for p in model.parameters():
            if p.requires_grad:
                self.handles.append(p.register_post_accumulate_grad_hook(lambda q: read(q.grad)))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()


STREAM = True  # ``--no-stream`` turns it off: the Profiler keeps its rows in memory (no ``out=``)


def _run_dir(name: str) -> str:
    path = tempfile.mkdtemp(prefix=f"precprof-bench-{name}-")
    atexit.register(shutil.rmtree, path, True)
    return path


class Precprof(Monitor):
    def __init__(
        self,
        sample_every: int | None,
        block_formats: bool = True,
        block_groups: int | None = None,
        stream: bool | None = None,  # None: the bench's setting (``--no-stream``)
        thread_writer: bool = False,  # the stream written by the writer thread, not its process
    ) -> None:
        self.sample_every = sample_every
        self.block_formats = block_formats
        self.block_groups = block_groups
        self.stream = stream
        self.thread_writer = thread_writer
        suffix = "_noblocks" if not block_formats else ("_allblocks" if block_groups == 1 else "")
        suffix += "_memory" if stream is False else ("_thread" if thread_writer else "")
        self.name = f"precprof_{sample_every if sample_every is not None else 'auto'}{suffix}"
        self.prof: Profiler | None = None
        self.last_info: dict[str, Any] = {}

    def attach(self, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> None:
        if self.prof is not None:  # one Profiler for the whole run, attached for each block of steps
            self.prof.attach()
            return
        stream.USE_PROCESS = not self.thread_writer  # read when the stream opens, at attach
        self.prof = Profiler(
            model,
            optimizer=opt,
            scaler=scaler,
            sample_every=self.sample_every,
            block_formats=self.block_formats,
            block_groups=self.block_groups,
            # the kernels compiled at attach, before any timed step: with an empty Triton cache a compile beside
            # the training outlasted every configuration's steps on an H200 (28 s), none of them sampled, and
            # the timings measured the compile's contention (the first_step stage of gpu_validate measures that)
            compile_beside=False,
            # a run directory, as every user-facing entry point gives one (removed when the bench ends)
            out=_run_dir(self.name) if (STREAM if self.stream is None else self.stream) else None,
        )
        self.prof.attach()
        stream.USE_PROCESS = True

    def after_step(self, loss: torch.Tensor) -> None:
        assert self.prof is not None
        self.prof.step(loss=loss)

    def detach(self) -> None:
        assert self.prof is not None
        self.prof.detach()
        layers = self.prof.tables()["layers"]
        if not layers.empty:
            first = layers[layers[T.STEP] == layers[T.STEP].min()]
            first = first[first[T.TENSOR] != T.WEIGHT_UPDATE]
            self.last_info = {
                "tensor_slots_per_sampled_step": len(first),
                "tensor_calls_per_sampled_step": int(first[T.CALLS].sum()),
                "elements_per_sampled_step": int(first[T.NUMEL].sum()),
            }
        summary = self.prof.summary()
        self.last_info.update(
            {
                "profiler_buffer_bytes": self.prof.buffer_bytes,
                "profiler_scratch_bytes": self.prof.scratch_bytes,
                # how the block what-if was dealt (the groups the budget settled on, its changes, its timer's
                # calibration), which steps were sampled and which of them measured memory
                "block_formats": summary["block_formats"],
                "sampling": summary["sampling"],
                "memory_steps": summary["memory_steps"],
            }
        )

    def info(self) -> dict[str, Any]:
        return self.last_info


class DebugUO(Monitor):
    name = "debug_uo"

    def attach(self, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> None:
        from transformers.debug_utils import DebugUnderflowOverflow

        self.model = model
        self.dbg = DebugUnderflowOverflow(model)

    def detach(self) -> None:
        for m in self.model.modules():
            m._forward_hooks.clear()  # DebugUnderflowOverflow has no removal API


class NaiveItem(Monitor):
    """absmax / nan / inf of every module output and output gradient, read with .item() each time."""

    name = "naive_item"

    def attach(self, model: nn.Module, opt: torch.optim.Optimizer, scaler: Any) -> None:
        self.handles: list[Any] = []
        self.log: list[tuple[float, bool, bool]] = []

        def check(t: torch.Tensor) -> None:
            t = t.detach()
            self.log.append(
                (t.abs().max().item(), bool(t.isnan().any().item()), bool(t.isinf().any().item()))
            )

        def fwd(module: nn.Module, args: Any, out: Any) -> None:
            if not torch.is_grad_enabled():
                return
            for t in _iter_tensors(out):
                check(t)
                if t.requires_grad:
                    t.register_hook(lambda g: check(g))

        for m in model.modules():
            self.handles.append(m.register_forward_hook(fwd))

    def after_step(self, loss: torch.Tensor) -> None:
        self.log.clear()

    def detach(self) -> None:
        for h in self.handles:
            h.remove()


PHASES = ("forward", "backward", "optimizer", "profiler_step")


class Marks:
    """Host times (and on CUDA device times, by events: no sync) at the phase boundaries of one step:
    forward and loss, backward, optimizer step and zero_grad, the monitor's step (precprof's copy)."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.host = [time.perf_counter()]
        self.events = [self._event()] if self.cuda else []

    def _event(self) -> Any:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def mark(self) -> None:
        self.host.append(time.perf_counter())
        if self.cuda:
            self.events.append(self._event())

    def total_s(self) -> float:
        return time.perf_counter() - self.host[0]

    def phases(self) -> dict[str, dict[str, float]]:
        """Per phase: host seconds, and device seconds between the events around it (after the step's sync)."""
        out = {p: {"host_s": b - a} for p, a, b in zip(PHASES, self.host, self.host[1:], strict=False)}
        for p, a, b in zip(PHASES, self.events, self.events[1:], strict=False):
            out[p]["device_s"] = a.elapsed_time(b) / 1e3
        return out


def phase_means(steps: list[tuple[str, dict[str, dict[str, float]]]]) -> dict[str, Any]:
    """Mean host (and device) seconds per phase of the sampled and the unsampled steps: where a sampled step's
    extra time goes (every step sampled against one in ten, say). ``steps``: (kind, phases) with kind
    "unsampled", "memory" (sampled, memory measured) or "sampled" (the other sampled steps); the sampled steps
    are also split by whether they measured memory."""
    out: dict[str, Any] = {}
    for label, want in (
        ("sampled", ("sampled", "memory")),
        ("unsampled", ("unsampled",)),
        ("sampled_memory_measured", ("memory",)),
        ("sampled_memory_not_measured", ("sampled",)),
    ):
        chosen = [ph for kind, ph in steps if kind in want]
        if not chosen:
            continue
        out[label] = {"steps": len(chosen)}
        for p in PHASES:
            for k in ("host_s", "device_s"):
                vals = [ph[p][k] for ph in chosen if p in ph and k in ph[p]]
                if vals:
                    out[label][f"{p}_{k}"] = statistics.fmean(vals)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="built-in model (default: gpt-mini on CPU, gpt2-small on CUDA)"
    )
    ap.add_argument(
        "--model-arg",
        "-a",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the model's config, repeatable (-a n_layer=4 -a n_embd=256 -a n_head=4)",
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument(
        "--seq", type=int, default=None, help="sequence length (default 128 on CPU, 1024 on CUDA)"
    )
    ap.add_argument("--blocks", type=int, default=6, help="interleaved blocks per configuration")
    ap.add_argument("--steps", type=int, default=10, help="steps per block (a multiple of 10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--configs",
        default="baseline,floor,precprof_1,precprof_1_noblocks,precprof_1_allblocks,precprof_10,precprof_auto,"
        "debug_uo,naive_item",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--no-stream",
        action="store_true",
        help="precprof keeps its rows in memory (no run directory) instead of streaming them to one",
    )
    args = ap.parse_args(argv)
    global STREAM
    STREAM = not args.no_stream

    makers: dict[str, Callable[[], Monitor]] = {
        "baseline": Monitor,
        # a second un-profiled copy: how far two identical configurations differ
        "baseline_b": lambda: Monitor(),
        "floor": Floor,
        "precprof_1": lambda: Precprof(1),
        "precprof_10": lambda: Precprof(10),
        "precprof_auto": lambda: Precprof(None),
        "precprof_0": lambda: Precprof(0),
        "precprof_1_noblocks": lambda: Precprof(1, block_formats=False),
        "precprof_1_allblocks": lambda: Precprof(1, block_groups=1),
        "precprof_1_memory": lambda: Precprof(1, stream=False),
        "precprof_1_thread": lambda: Precprof(1, thread_writer=True),
        "debug_uo": DebugUO,
        "naive_item": NaiveItem,
    }
    names = [c for c in args.configs.split(",") if c]
    unknown = [n for n in names if n not in makers]
    if unknown:
        ap.error(f"unknown configuration {', '.join(unknown)}; choose from {', '.join(makers)}")

    if args.device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(args.device)
    torch.set_num_threads(args.threads)
    model_name = args.model or ("gpt2-small" if dev.type == "cuda" else "gpt-mini")
    seq = args.seq or (1024 if dev.type == "cuda" else 128)
    torch.manual_seed(0)
    model_args = {k: int(v) for k, v in (a.split("=", 1) for a in args.model_arg)}
    base_model = build_model(model_name, model_args, vocab_size=256, seq_len=seq).module.to(dev)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps):
        s = torch.randint(0, 256, (args.batch, seq + 1), generator=g)
        batches.append((s[:, :-1].to(dev), s[:, 1:].to(dev)))

    if "debug_uo" in names:
        try:
            import transformers  # noqa: F401
        except ImportError:
            names.remove("debug_uo")
    state: dict[str, Any] = {}
    for n in names:
        m = copy.deepcopy(base_model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        scaler = torch.amp.GradScaler(dev.type, enabled=args.precision == "fp16")
        state[n] = {
            "model": m,
            "opt": opt,
            "scaler": scaler,
            "monitor": makers[n](),
            "times": [],
            "phases": [],
            "full_gc": 0,  # timed steps in which Python's collector ran a full collection
            "sampled_s": [],  # the times of the timed sampled steps, in order
        }

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run_block(n: str, steps: int, record: bool) -> None:
        s = state[n]
        model, opt, scaler, mon = s["model"], s["opt"], s["scaler"], s["monitor"]
        mon.attach(model, opt, scaler)
        try:
            for i in range(steps):
                x, y = batches[i % len(batches)]
                prof = getattr(mon, "prof", None)
                sampled = bool(prof is not None and prof.sampling)
                sync()
                full = gc.get_stats()[-1]["collections"]
                marks = Marks(dev)
                with torch.autocast(dev.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    out = model(x)
                logits = getattr(out, "logits", out)  # a Hugging Face model returns a ModelOutput
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
                marks.mark()
                scaler.scale(loss).backward()
                marks.mark()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                marks.mark()
                tracker = getattr(prof, "_tracker", None)
                measured = sampled and bool(tracker is not None and tracker.schedule.measuring)
                mon.after_step(loss.detach())
                marks.mark()
                sync()
                if record:
                    s["times"].append(marks.total_s())
                    kind = "memory" if measured else "sampled" if sampled else "unsampled"
                    s["phases"].append((kind, marks.phases()))
                    s["full_gc"] += gc.get_stats()[-1]["collections"] != full
                    if sampled:
                        s["sampled_s"].append(s["times"][-1])
        finally:
            mon.detach()

    for n in names:
        run_block(n, args.warmup, record=False)
    for b in range(args.blocks):
        # each block starts one configuration later: a slowdown within a block (the machine's, or what the
        # configurations before leave behind) falls on every configuration alike, not on the last ones
        for n in names[b % len(names) :] + names[: b % len(names)]:
            run_block(n, args.steps, record=True)

    base_med = statistics.median(state["baseline"]["times"]) if "baseline" in state else float("nan")
    base_mean = statistics.fmean(state["baseline"]["times"]) if "baseline" in state else float("nan")
    results: dict[str, Any] = {}
    for n in names:
        t = state[n]["times"]
        med, mean = statistics.median(t), statistics.fmean(t)
        results[n] = {
            "median_s": med,
            "mean_s": mean,
            "ratio_median": med / base_med,
            "ratio_mean": mean / base_mean,
            "steps_timed": len(t),
            "phases": phase_means(state[n]["phases"]),
            # a one-off in a few sampled steps (a full collection walks every object of the process: 70-220
            # ms with torch and transformers loaded) moves a mean of three
            "steps_with_full_gc": state[n]["full_gc"],
            "sampled_steps_s": [round(t, 4) for t in state[n]["sampled_s"]],
            **state[n]["monitor"].info(),
        }
        if dev.type == "cuda":
            results[n]["note"] = "peak memory per configuration is not separated; see profiler_buffer_bytes"
    param_bytes = sum(p.numel() * p.element_size() for p in base_model.parameters())
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    if dev.type == "cpu":
        try:
            with open("/proc/cpuinfo") as f:
                device_name = next(
                    line.split(":", 1)[1].strip() for line in f if line.startswith("model name")
                )
        except (OSError, StopIteration):
            pass
    out = {
        "device": dev.type,
        "device_name": device_name,
        "threads": args.threads,
        "model": model_name,
        "model_args": model_args,
        "param_bytes": param_bytes,
        "precision": args.precision,
        "batch": args.batch,
        "seq": seq,
        "blocks": args.blocks,
        "steps_per_block": args.steps,
        "stream": STREAM,
        "torch": torch.__version__,
        "precprof": precprof.__version__,
        "results": results,
    }
    if dev.type == "cpu":
        from precprof import stats
        from precprof.stats import engine
        from precprof.stats import kernel as _cpu_kernel

        lib = engine._kernel()
        out["cpu_kernel"] = {
            "compiled": lib is not None,
            "threads": stats.StatsBuffer(1, "cpu")._threads() if lib is not None else 0,
            "runs_in_torch_openmp_pool": bool(lib is not None and _cpu_kernel.shares_torch_threads(lib)),
        }
    from precprof.stats import engine as _engine

    out["stats_engine"] = _engine.engine_status([dev])
    pp = results.get("precprof_1", {})
    if pp.get("profiler_buffer_bytes"):
        out["profiler_buffer_share_of_params"] = pp["profiler_buffer_bytes"] / param_bytes
    print(
        f"{model_name} {args.precision} on {device_name} ({dev.type}, {args.threads} threads), "
        f"batch {args.batch}x{seq}, {args.blocks} blocks x {args.steps} steps"
    )
    print(f"{'config':<14}{'median ms':>11}{'mean ms':>10}{'x median':>10}{'x mean':>9}")
    for n, r in results.items():
        print(
            f"{n:<14}{r['median_s'] * 1e3:>11.1f}{r['mean_s'] * 1e3:>10.1f}"
            f"{r['ratio_median']:>10.3f}{r['ratio_mean']:>9.3f}"
        )
    if "profiler_buffer_share_of_params" in out:
        print(
            f"precprof buffers: {pp['profiler_buffer_bytes']} bytes = "
            f"{out['profiler_buffer_share_of_params']:.3%} of parameter bytes; scratch "
            f"{pp.get('profiler_scratch_bytes', 0)} bytes; {pp.get('elements_per_sampled_step', 0):,} elements "
            f"in {pp.get('tensor_calls_per_sampled_step', 0)} tensors per sampled step"
        )
    path = (
        Path(args.out)
        if args.out
        else ROOT
        / "bench"
        / "results"
        / f"overhead_{dev.type}_{model_name}{''.join(f'_{k}{v}' for k, v in model_args.items())}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()

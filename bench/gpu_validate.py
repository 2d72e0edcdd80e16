"""Everything a GPU session must measure, in one command that fits one device call (issue 26).

Stages, each wrapped (a failure is recorded and the next stage runs), the JSON rewritten after each one so a
command stopped at its time limit still leaves what it measured:

  env         torch, triton, driver, device, capability, a hash of precprof's source files
  host        bench/host_cost.py on the device: host work per inspected tensor (launches included), a sampled
              step's added time by part
  tests       the GPU tests, one process per test file (a device-side assert cannot take the others down), 4 at once
  kernels     throughput of the row statistics (Triton and torch-op engines) and the block-format what-if, fp32
              and bf16, 1M-256M elements, in GB/s of the tensor's bytes, against x.sum() of the same tensor
  compile     each Triton kernel's compile time in a fresh process with an empty cache (what attach() costs on
              a machine's first run), row kernels and block kernels per dtype
  first_step  attach and the steps while the kernels compile beside the training, in a fresh process with an
              empty Triton cache (cold) and again with the cache it left (warm): goal worst step / a later
              sampled step <= 1.5
  profile     where a sampled step's time goes: torch.profiler's CUDA kernels and CPU ops of one sampled step
              of gpt2-small bf16 8x1024 (top 25 each, launches counted), the kernels' device time beside the
              same step without precprof (what it adds, kernel by kernel), and cProfile's Python functions
  syncs       a sampled step's hooks under set_sync_debug_mode("error"), the device-to-host copies in
              prof.step() (goal 1), and the user's max_memory_allocated() with and without precprof (equal)
  overhead    bench/overhead.py: gpt2-small bf16 8x1024, every configuration interleaved (the default sampling
              included), each phase's host and device time of sampled and unsampled steps
  memory      the memory table's components against the allocator's peak (bf16 and fp32)
  memory_cost where the host time of a sampled step that measures memory goes: whole steps with and without
              each part of the memory tracking (gpt2-small bf16 8x1024 and the host stage's tiny blocks),
              precprof's own calls timed from outside (allocator history on/off, snapshot, conversion, replay),
              and cheaper ways to read the allocator's history

On the H100 (one command of at most 10 minutes, 30 device-minutes a session), from the repository root:

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/gpu_validate.py --budget-s 540 --out $OUT/gpu_validate.json

then commit the JSON that comes back as ``bench/results/gpu_validate_<device>.json``. ``--stages`` runs a
subset (e.g. ``--stages tests`` in one call, the rest in another; ``--stages env,memory_cost --budget-s 60``
alone takes about a minute). ``--dry-run`` runs every stage on the CPU at
toy sizes (the tests collected, not run; the CUDA-only checks skipped with a reason), in under a minute, so
that the plumbing is tested where no GPU is (tests/test_gpu_validate.py).
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precprof  # noqa: E402
from precprof import tables as T  # noqa: E402
from precprof.stats import StatsBuffer, blocks, transfer  # noqa: E402

STAGES = (
    "env",
    "host",
    "overhead",
    "first_step",
    "kernels",
    "profile",
    "syncs",
    "memory",
    "memory_cost",
    "compile",
    "tests",
)
MIB = 1 << 20


class Run:
    """The JSON being built, the time budget, and the device."""

    def __init__(self, out: Path, budget_s: float, dry: bool) -> None:
        self.out = out
        self.dry = dry
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.cuda = torch.cuda.is_available() and not dry
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.data: dict[str, Any] = {"dry_run": dry, "device": self.device.type, "stages": {}}
        self.compile_serial = False

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=2, default=str) + "\n")

    def stage(self, name: str, fn: Callable[[Run], dict[str, Any]], need_s: float) -> None:
        t = time.perf_counter()
        if self.left() < need_s:
            rec: dict[str, Any] = {
                "status": "skipped",
                "reason": f"budget: {self.left():.0f} s left, needs {need_s:.0f}",
            }
        else:
            # what an earlier stage left (a model held by a reference cycle of its hooks) must not count as
            # this stage's memory: on an H100 it was 13-19% of the memory stage's peak, named "other"
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()
            try:
                rec = {"status": "ok", **fn(self)}
            except _Skip as e:
                rec = {"status": "skipped", "reason": str(e)}
            except Exception as e:  # a stage's failure is a result; the next stage runs
                rec = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        rec["seconds"] = round(time.perf_counter() - t, 2)
        self.data["stages"][name] = rec
        self.save()
        print(
            f"[{name}] {rec['status']} in {rec['seconds']} s"
            + (f": {rec.get('reason') or rec.get('error')}" if rec["status"] != "ok" else "")
        )


class _Skip(Exception):
    """A stage that cannot run here, with the reason."""


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time_s(fn: Callable[[], Any], dev: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` after one warm-up call (CUDA events on a GPU)."""
    fn()
    _sync(dev)
    times = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------------- stages
def stage_env(run: Run) -> dict[str, Any]:
    h = hashlib.sha256()
    for p in sorted((ROOT / "precprof").rglob("*.py")) + sorted((ROOT / "precprof").rglob("*.c")):
        h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes())
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "precprof": precprof.__version__,
        "python": sys.version.split()[0],
        "source_sha256": h.hexdigest(),
    }
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        out["git_commit"] = commit.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = None
    if run.cuda:
        props = torch.cuda.get_device_properties(0)
        out.update(
            device_name=torch.cuda.get_device_name(0),
            capability=f"{props.major}.{props.minor}",
            memory_bytes=props.total_memory,
            sms=props.multi_processor_count,
        )
        try:
            import pynvml

            pynvml.nvmlInit()
            out["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as e:  # no NVML here: the rest still counts
            out["driver"] = f"unknown ({type(e).__name__})"
    return out


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected|xfailed|xpassed)")


def gpu_test_files() -> list[Path]:
    """Test files with GPU tests (the ``gpu`` marker), and the test files that run Triton kernels on a GPU."""
    out = []
    for p in sorted((ROOT / "tests").glob("test_*.py")):
        text = p.read_text()
        # gpu-marked tests, and files that run on CUDA where there is CUDA (DEV = torch.device("cuda" ...))
        if "pytest.mark.gpu" in text or re.search(r'^DEV = torch\.device\("cuda"', text, re.M):
            out.append(p)
    return out


def _run_test_file(p: Path, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(p)]
    if "pytest.mark.gpu" in p.read_text():
        cmd += ["-m", "gpu"]  # that file's GPU tests; its CPU tests run in CI
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        return {"status": "timeout", "timeout_s": timeout_s, "tail": str(e.stdout or "")[-2000:]}
    text = r.stdout + r.stderr
    counts = {k: int(n) for n, k in _SUMMARY.findall(text.splitlines()[-1] if text.strip() else "")}
    rec: dict[str, Any] = {"rc": r.returncode, "seconds": round(time.perf_counter() - t, 1), **counts}
    if r.returncode not in (0, 5):
        rec["tail"] = text[-3000:]
    return rec


def stage_tests(run: Run) -> dict[str, Any]:
    """Each GPU test file in its own process (a device-side assert cannot take the others down), four at once:
    the GPU has room for them, and the stage's minutes are the session's device time."""
    from concurrent.futures import ThreadPoolExecutor

    files = gpu_test_files()
    timeout_s = max(30.0, min(240.0, run.left() - 60))
    if run.dry:  # the plumbing: every file collected in one process, not one a file
        results = _collect_files(files, timeout_s)
    else:
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = {p.name: pool.submit(_run_test_file, p, timeout_s) for p in files}
            results = {name: f.result() for name, f in futures.items()}
    failed = [n for n, r in results.items() if r.get("rc") not in (0, 5)]
    return {"files": results, "failed_files": failed, "collected_only": run.dry}


def _collect_files(files: list[Path], timeout_s: float) -> dict[str, dict[str, Any]]:
    """``pytest --collect-only`` of ``files`` in one process: per file, the process's return code and the
    tests collected (all of a file's tests, the GPU-marked ones among them)."""
    if not files:
        return {}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--collect-only"]
    cmd += [str(p) for p in files]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    seconds = round(time.perf_counter() - t, 1)
    out: dict[str, dict[str, Any]] = {}
    for p in files:
        rec: dict[str, Any] = {"rc": r.returncode, "seconds": seconds}
        rec["collected"] = len(re.findall(rf"^tests/{re.escape(p.name)}::", r.stdout, re.M))
        if r.returncode not in (0, 5):
            rec["tail"] = (r.stdout + r.stderr)[-3000:]
        out[p.name] = rec
    return out


def stage_kernels(run: Run) -> dict[str, Any]:
    dev = run.device
    sizes = [1 << 16] if run.dry else [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]
    row_engines = ["c", "torch"] if dev.type == "cpu" else ["triton", "torch"]
    block_engine = "c" if dev.type == "cpu" else "triton"
    reps = 3 if run.dry else 10
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            if run.left() < 45:
                rows.append({"dtype": str(dtype), "numel": n, "status": "skipped", "reason": "budget"})
                continue
            x = torch.randn(n, device=dev).to(dtype)
            nbytes = x.numel() * x.element_size()
            rec: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "numel": n, "bytes": nbytes}
            t_sum = _time_s(lambda x=x: x.sum(), dev, reps)
            rec["sum_gbps"] = nbytes / t_sum / 1e9
            for engine in row_engines:
                if engine == "torch" and n > (1 << 26):
                    continue  # the fallback at 256M takes long and proves nothing more
                buf = StatsBuffer(1, dev, engine=engine)
                t = _time_s(lambda buf=buf, x=x: buf.accumulate(x, 0), dev, reps)
                rec[f"rows_{engine}_gbps"] = nbytes / t / 1e9
                rec[f"rows_{engine}_vs_sum"] = t_sum / t
            if n <= (1 << 26):
                x2 = x.view(-1, 1024)
                t = _time_s(lambda x2=x2: _block_what_if(x2, block_engine), dev, max(1, reps // 3))
                rec[f"blocks_{block_engine}_gbps"] = nbytes / t / 1e9
                rec[f"blocks_{block_engine}_vs_sum"] = t_sum / t
            rows.append(rec)
            del x
    from precprof.stats import triton_engine as te

    return {
        # the default row kernel that ``rows`` timed (StatsBuffer's Triton engine on CUDA)
        "row_kernel": {
            "planes": te.PLANES,
            "block": te.BLOCK,
            "num_warps": te.NUM_WARPS,
            "stages": te.STAGES,
        },
        "rows": rows,
        "block_tiles": _block_tiles(run),
        "row_shapes": _row_shapes(run),
        "param_launches": _param_launches(run),
        "launch_costs": _launch_costs(run),
        "goals": {"rows_gbps_64M": 1000, "blocks_gbps_16M": 300},
    }


def _launch_costs(run: Run) -> dict[str, Any]:
    """Host time of one launch, layer by layer, on a 1,024-value fp32 tensor (no sync inside the timed loop):
    a PyTorch kernel (``torch.add(..., out=)``) for reference; ``TritonRows.add`` (precprof's Python, then the
    launcher); the direct launcher alone (``_DirectLaunch``: the launch metadata and hooks, then Triton's
    launcher); Triton's launcher alone (its Python wrapper and the C launch into the driver). On an H200 a row
    launch cost about 30 us of host time in a sampled step, 6-8 us of it precprof's Python on a CPU: this says
    where the rest goes. The Python threads alive are listed: one holding the interpreter lock when the C
    launch gives it up makes the launch wait for it."""
    import threading

    from precprof.stats import triton_engine as te

    if (run.device.type != "cuda" and not run.dry) or te.unavailable(run.device) is not None:
        return {}
    dev, reps = run.device, (3 if run.dry else 2000)
    x = torch.randn(1024, device=dev)
    y = torch.empty_like(x)
    buf = StatsBuffer(1, dev, engine="triton", dtypes=[torch.float32])
    part = buf.primary
    assert part is not None and part._triton is not None
    rows_engine, data = part._triton, part.dense()
    stream = rows_engine._stream() if run.cuda else 0

    def per_call_us(fn: Callable[[], Any]) -> float:
        fn()
        _sync(dev)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        host = time.perf_counter() - t
        _sync(dev)
        return host / reps * 1e6

    out: dict[str, Any] = {
        "threads": [t.name for t in threading.enumerate()],
        "launch": rows_engine.direct_status,
    }
    out["torch_add_us"] = per_call_us(lambda: torch.add(x, 1.0, out=y))
    out["rows_add_us"] = per_call_us(lambda: rows_engine.add(x, data, 0, stream))
    direct = rows_engine._direct.get(te.Variant(0, False, x.data_ptr() % 16 == 0))
    if direct is not None:
        lo, scratch, uf, fp8 = rows_engine._ptrs[0]
        geometry = rows_engine._geometry(x)
        hint = rows_engine._fit_hint(data)
        args = (x.data_ptr(), *geometry, data.data_ptr(), 0, scratch, lo, uf, fp8, hint, *te._GRID_PID)
        out["direct_launcher_us"] = per_call_us(lambda: direct(1, stream, args))
        full = (*args, *direct._constexprs)
        run_ = direct._run
        fn, packed = direct._function, direct._packed
        out["triton_launcher_us"] = per_call_us(
            lambda: run_(1, 1, 1, stream, fn, packed, None, None, None, *full)
        )
    return out


def _gpt2_small_params() -> list[tuple[int, ...]]:
    """The 148 parameter shapes of GPT-2 small (12 layers, width 768, 50,257 tokens, 1,024 positions)."""
    e = 768
    layer = [
        (e,),
        (e,),
        (e, 3 * e),
        (3 * e,),
        (e, e),
        (e,),
        (e,),
        (e,),
        (e, 4 * e),
        (4 * e,),
        (4 * e, e),
        (e,),
    ]
    return [(50257, e), (1024, e), *layer * 12, (e,), (e,)]


def _param_launches(run: Run) -> list[dict[str, Any]]:
    """A sampled step's parameters (GPT-2 small's 148, fp32 and bf16) read one launch each (``add``) and 16 a
    launch (``add_many``, what the hooks call): the host time to enqueue them (no sync), the device time, and
    whether both write the same rows. A dry run: six of the shapes divided by 256, in Triton's interpreter."""
    from precprof.stats import triton_engine as te

    if (run.device.type != "cuda" and not run.dry) or te.unavailable(run.device) is not None:
        return []
    dev, reps = run.device, (1 if run.dry else 20)
    shapes = _gpt2_small_params()
    if run.dry:  # the plumbing: a few shapes, small, in the interpreter (a launch there takes tens of ms)
        shapes = [tuple(max(1, d // 256) for d in s) for s in shapes[:6]]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        if run.left() < 30:
            break
        g = torch.Generator(device="cpu").manual_seed(0)
        xs = [(torch.randn(s, generator=g) * 0.02).to(dtype).to(dev) for s in shapes]
        at = list(range(len(xs)))
        rec: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "tensors": len(xs)}
        rec["values"] = sum(x.numel() for x in xs)
        written = []
        for how in ("one_each", "many"):
            buf = StatsBuffer(len(xs), dev, engine="triton", dtypes=[dtype])
            part = buf.primary
            assert part is not None
            host, device = [], []
            for _ in range(reps):
                part.reset()
                _sync(dev)
                start = torch.cuda.Event(enable_timing=True) if run.cuda else None
                end = torch.cuda.Event(enable_timing=True) if run.cuda else None
                if start is not None:
                    start.record()
                t = time.perf_counter()
                if how == "many":
                    part.add_many(xs, at)
                else:
                    for x, r in zip(xs, at, strict=True):
                        part.add(x, r)
                host.append(time.perf_counter() - t)
                if end is not None:
                    end.record()
                _sync(dev)
                if start is not None and end is not None:
                    device.append(start.elapsed_time(end) / 1e3)
            written.append(buf.to_host())
            rec[f"{how}_host_us_per_tensor"] = statistics.median(host) / len(xs) * 1e6
            if device:
                rec[f"{how}_device_ms"] = statistics.median(device) * 1e3
            if buf.primary is not None and buf.primary._triton is not None:
                rec[f"{how}_launch"] = buf.primary._triton.direct_status
        rec["same_rows"] = bool((written[0] == written[1]).all())
        out.append(rec)
    return out


_BLOCK_ENGINES: dict[str, Any] = {}


def _block_what_if(x2: torch.Tensor, engine: str) -> None:
    """Both orientations of a tensor's block what-if as a sampled step computes them: on CUDA one launch of
    ``TritonBlocks.add`` (two with NVFP4's amax) into an accumulator, on the CPU the C kernel's one call."""
    if engine != "triton":
        blocks.tensor_block_stats(x2, engine=engine)
        return
    from precprof.stats import triton_block

    key = str(x2.device)
    if key not in _BLOCK_ENGINES:
        eng = triton_block.TritonBlocks(x2.device, blocks.RECIPES)
        eng.warm([torch.float32, torch.bfloat16, torch.float16])
        acc = torch.zeros(2, blocks.N_RECIPES, blocks.N_STATS, dtype=torch.float64, device=x2.device)
        _BLOCK_ENGINES[key] = (eng, acc)
    eng, acc = _BLOCK_ENGINES[key]
    eng.add(x2, acc)


# (registers bound, programs a multiprocessor per orientation) of the block kernel's sweep, the default first:
# on an H200 (2026-12-04) the kernel at 80 registers read 178 GB/s fp32 for both orientations in one launch
# (8 programs a multiprocessor requested, 6 resident) and 151-157 for one alone (4): more warps, more speed.
# With 64 registers 8 programs fit; None: ptxas's own count (71), 7 fit.
BLOCK_SHAPES = ((64, 4), (None, 4), (64, 2), (64, 8))


def _block_tiles(run: Run) -> list[dict[str, Any]]:
    """The Triton block kernel's throughput at 16M elements by ``BLOCK_SHAPES`` (a thread's registers bound,
    programs a multiprocessor per orientation): both orientations in one launch (``TritonBlocks.add``, the hot
    path), the same with one recipe (MXFP8 E4M3) instead of seven, the same tensor times 2^110 (every block's
    amax past 2^101: the reference's arithmetic, ``triton_block_math``, instead of the scales carried to the
    bounds), then each orientation alone at the default (``block_stats_triton``: half the programs). The
    kernel of 2026-12-04 (145 instructions a value in its second read's loop, 17 in the rest of a tile's, by
    triton 3.9) read 208 GB/s fp32 and 100 bf16 for both orientations on an H200; this one, 108 and 22 with
    the scales carried to the bounds (``bench/kernel_sass.py``)."""
    from precprof.stats import triton_block

    out: list[dict[str, Any]] = []
    if run.device.type != "cuda" or triton_block.unavailable(run.device) is not None:
        return out  # (Triton's interpreter takes minutes for these calls: a dry run leaves them out)
    recipes = list(blocks.RECIPES)
    sms = torch.cuda.get_device_properties(run.device).multi_processor_count
    n = 1 << 24
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, device=run.device).to(dtype).view(-1, 1024)
        nbytes = x.numel() * x.element_size()
        base = {"dtype": str(dtype).removeprefix("torch."), "tile": 128}
        for bound, per_sm in BLOCK_SHAPES:
            if run.left() < 30:
                return out
            eng = triton_block.TritonBlocks(
                run.device, blocks.RECIPES, max_programs=per_sm * sms, max_registers=bound
            )
            kernels = eng.warm([dtype])
            acc = torch.zeros(2, blocks.N_RECIPES, blocks.N_STATS, dtype=torch.float64, device=run.device)
            t = _time_s(lambda x=x, eng=eng, acc=acc: eng.add(x, acc), run.device, 3)
            rec = {**base, "axis": "both", "max_registers": bound, "programs_per_sm": per_sm}
            compiled = kernels[-1].result() if hasattr(kernels[-1], "result") else kernels[-1]
            rec["registers"] = getattr(compiled, "n_regs", None)
            out.append({**rec, "launch": eng.direct_status, "gbps": nbytes / t / 1e9})
        if run.left() >= 30:
            # one recipe instead of seven: how much of the time is the recipes' arithmetic, how much the reads
            one = triton_block.TritonBlocks(run.device, blocks.RECIPES[:1])
            one.warm([dtype])
            acc = torch.zeros(2, 1, blocks.N_STATS, dtype=torch.float64, device=run.device)
            t = _time_s(lambda x=x, one=one, acc=acc: one.add(x, acc), run.device, 3)
            out.append(
                {**base, "axis": "both", "recipes": [blocks.RECIPES[0].name], "gbps": nbytes / t / 1e9}
            )
        if run.left() >= 30:
            # every tile outside the range whose scales carry to the bounds: the reference's arithmetic
            far = x * 2.0**110
            eng = triton_block.TritonBlocks(run.device, blocks.RECIPES)
            eng.warm([dtype])
            acc = torch.zeros(2, blocks.N_RECIPES, blocks.N_STATS, dtype=torch.float64, device=run.device)
            t = _time_s(lambda far=far, eng=eng, acc=acc: eng.add(far, acc), run.device, 3)
            out.append({**base, "axis": "both", "path": "reference", "gbps": nbytes / t / 1e9})
            del far
        for axis in (-1, -2):
            if run.left() < 30:
                return out
            t = _time_s(
                lambda x=x, axis=axis: triton_block.block_stats_triton(x, recipes, axis), run.device, 3
            )
            out.append({**base, "axis": axis, "gbps": nbytes / t / 1e9})
        del x
    return out


# (values a program reads per iteration, warps, rare values in a second loop) of the row kernel, compiled for
# sm_90 by triton 3.6 (the GPU machine's; it lowers the 64-slot histogram to ballots, 3.9 to shared-memory
# atomics). The H200 of 2026-11-27c read 570-713 GB/s fp32 with every block x warps of the former kernel, whose
# rare path's 1,024-slot histogram held 214-255 registers a thread. With it in two levels of 64 slots,
# registers a thread (fp32, bf16): 4096 x 4 255 (spilling); 1024 x 4 162, 183; with the rare values after the
# loop: 1024 x 4 165, 183; 1024 x 8 107, 118; 2048 x 4 194, 181; 512 x 4 105, 110 (that loop holds them: the
# main loop alone takes 64). The H200 then read 868 GB/s fp32 with 512 x 4 after the loop (randn), 928 with
# 1024 x 4, 633 with the former 4096 x 4 in the loop; 412, 332 and 373 when 1 value in 1,000 is rare
# (bench/results/README_h200_2026-11-27c.md). The fourth number: the main loop's software pipelining
# (``triton_engine.STAGES``; 3 stages compile, by triton 3.6 for sm_90, to asynchronous copies into shared memory,
# 106 registers at 512 x 4); on an H200 3 stages read 1014 GB/s fp32 and 510 bf16 against 879 and 442 with none
# (bench/results/README_h200_2026-11-27e.md). The third is the default.
# (block, warps, rare after, stages, planes, programs a multiprocessor, registers bound): the default first
# (the reference row), then tl.histogram's best of 2026-11-27c (the default before the planes), then the planes'
# alternatives. The planes take 128 registers a thread (4 programs of 4 warps a multiprocessor); compiled for
# sm_90 by triton 3.6 under a bound of 96 or 80 they keep the main loop free of spills, with 3 more instructions
# there (24.1 a value), and spill around it (9 and 23 stores, 9 and 25 loads of the stack in the loop of its
# flushes, once every 30 iterations): 5 or 6 programs fit. The block kernel read 2.3 times as many values a
# second with more warps.
ROW_SHAPES = (
    (1024, 4, True, 3, True, 4, None),
    (512, 4, True, 3, False, 4, None),
    (1024, 4, True, 1, True, 4, None),
    (1024, 4, True, 2, True, 4, None),
    (1024, 4, True, 3, True, 2, None),
    (1024, 4, True, 3, True, 5, 96),
    (1024, 4, True, 3, True, 6, 80),
    (2048, 4, True, 3, True, 4, None),
    (1024, 4, True, 3, False, 4, None),
)


def _row_shapes(run: Run) -> list[dict[str, Any]]:
    """The Triton row kernel's throughput at 64M elements by ``ROW_SHAPES``, fp32 and bf16, beside ``x.sum()``
    (a dry run: 256 elements and the first two shapes in Triton's interpreter, where the engine is
    available: a launch there takes a second)."""
    from precprof.stats import triton_compile, triton_launch
    from precprof.stats import triton_engine as te
    from precprof.stats.layout import LAYOUT

    out: list[dict[str, Any]] = []
    if (run.device.type != "cuda" and not run.dry) or te.unavailable(run.device) is not None:
        return out
    n = 1 << 26 if run.device.type == "cuda" else 1 << 8  # a dry run: the plumbing, in the interpreter
    dtypes = [torch.float32, torch.bfloat16]
    # the aligned contiguous variant of each dtype (what a 64M tensor launches), every shape's compiled side by
    # side, then loaded and checked against Triton's own launch
    variants = [te.Variant(te.KINDS[d][0], False, True) for d in dtypes]
    sms = (
        torch.cuda.get_device_properties(run.device).multi_processor_count if run.device.type == "cuda" else 1
    )
    shapes = {
        bw: te.TritonRows(
            run.device,
            LAYOUT,
            block=bw[0],
            num_warps=bw[1],
            rare_after=bw[2],
            stages=bw[3],
            planes=bw[4],
            max_programs=bw[5] * sms,
            max_registers=bw[6],
        )
        for bw in (ROW_SHAPES[:2] if run.dry else ROW_SHAPES)
    }
    t0 = time.perf_counter()
    with triton_compile.parallel_compile(len(shapes) * len(variants)):
        compiled = [rows.warm(load=False, variants=variants) for rows in shapes.values()]
    registers: dict[int, list[Any]] = {}  # per shape, each variant's registers a thread (as compiled)
    for rows, kernels in zip(shapes.values(), compiled, strict=True):
        triton_launch.load_kernels(kernels)
        rows.adopt_compiled()
        done = [k.result() if hasattr(k, "result") else k for k in kernels]
        registers[id(rows)] = [getattr(k, "n_regs", None) for k in done]
    compile_s = time.perf_counter() - t0
    # randn (no value outside a program's window of 31 binades), then one value in 1,000 scaled by 2^-40: every
    # program meets rare values (a second read of its blocks with rare_after). The same values for every shape
    g = torch.Generator(device=run.device).manual_seed(0)
    plain = torch.randn(n, device=run.device, generator=g)
    rare = plain.clone()
    rare[::1000] *= 2.0**-40
    inputs = {(dt, data): x.to(dt) for dt in dtypes for data, x in (("randn", plain), ("rare 1e-3", rare))}
    del plain, rare
    reference: dict[tuple[torch.dtype, str], torch.Tensor] = {}
    for (block, warps, after, stages, planes, _per_sm, bound), rows in shapes.items():
        if run.left() < 30:
            break
        target = LAYOUT.empty_rows(1, run.device)
        for (dtype, data), x in inputs.items():
            # one row from a cleared target: the default shape's is the reference of the others'
            got = LAYOUT.empty_rows(1, run.device)
            rows.add(x, got, 0)
            ref = reference.setdefault((dtype, data), got)
            nbytes = x.numel() * x.element_size()
            reps = 10 if run.device.type == "cuda" else 1
            t_sum = _time_s(lambda x=x: x.sum(), run.device, reps)
            t = _time_s(lambda x=x, rows=rows, target=target: rows.add(x, target, 0), run.device, reps)
            out.append(
                {
                    "block": block,
                    "num_warps": warps,
                    "rare_after": after,
                    "stages": stages,
                    "planes": planes,
                    "programs": rows.max_programs,
                    "max_registers": bound,
                    "registers": registers.get(id(rows)),
                    "dtype": str(dtype).removeprefix("torch."),
                    "data": data,
                    "gbps": nbytes / t / 1e9,
                    "vs_sum": t_sum / t,
                    "same_row_as_default": bool(torch.equal(got, ref)),
                    "compile_all_s": compile_s,
                    "launch": rows.direct_status,
                }
            )
    del inputs
    return out


_FIRST_STEP = r"""
import json, sys, time, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import precprof
from precprof.models import build_model
dev = torch.device(sys.argv[2]); name = sys.argv[3]; batch, seq = int(sys.argv[4]), int(sys.argv[5])
torch.manual_seed(0)
model = build_model(name, vocab_size=256, seq_len=seq).module.to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, 256, (batch, seq), device=dev); y = torch.randint(0, 256, (batch, seq), device=dev)
def sync():
    if dev.type == "cuda": torch.cuda.synchronize()
profiled = sys.argv[6] == "profiled"
sync(); t = time.perf_counter()
# the kernels compile beside the training: steps run unsampled until they are loaded, then every other step
import tempfile
run_dir = tempfile.TemporaryDirectory()  # a run directory, as users get one: the rows stream into it
prof = precprof.Profiler(model, optimizer=opt, sample_every=2, out=run_dir.name).attach() if profiled else None
sync(); out = {"attach_s": time.perf_counter() - t, "steps_s": [], "sampled": [], "step_starts_s": []}
t_attach = t
t_end = time.perf_counter() + float(sys.argv[7])
while len(out["steps_s"]) < 6 or (profiled and sum(out["sampled"]) < 3 and time.perf_counter() < t_end):
    out["sampled"].append(bool(prof is not None and prof.sampling))
    sync(); t = time.perf_counter(); out["step_starts_s"].append(t - t_attach)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        logits = model(x)
    F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
    opt.step(); opt.zero_grad(set_to_none=True)
    if prof is not None: prof.step()
    sync(); out["steps_s"].append(time.perf_counter() - t)
if prof is not None:
    prof.detach()
    s = prof.summary()
    out["sampling"] = s["sampling"]; out["compiled_beside_training_s"] = s["stats_engine"].get("compiled_beside_training_s")
    out["launch"] = s["stats_engine"].get("launch")
    # the compile's phases, in seconds from attach's start like the steps' starts
    t0 = prof._buffer.warm_t0 if prof._buffer is not None else None
    out["compile_phases_s"] = {
        k: [round(a + t0 - t_attach, 3), round(b + t0 - t_attach, 3)]
        for k, (a, b) in (s["stats_engine"].get("compile_phases_s") or {}).items()
    } if t0 is not None else {}
print("RESULT " + json.dumps(out))
"""


def _overlapping(res: dict[str, Any], i: int) -> list[str]:
    """The parts of the compile beside the training (compile, load, check) that step ``i`` overlapped."""
    starts = res.get("step_starts_s") or []
    if i >= len(starts):
        return []
    a, b = starts[i], starts[i] + res["steps_s"][i]
    return [k for k, (p0, p1) in (res.get("compile_phases_s") or {}).items() if p0 < b and a < p1]


def stage_first_step(run: Run) -> dict[str, Any]:
    """No step waits for a compile: with an empty Triton cache the kernels compile beside the training, the
    steps meanwhile are not sampled, and no step is slower than 1.5x a later sampled step (goal)."""
    name, batch, seq = ("gpt-nano", 2, 32) if run.dry or not run.cuda else ("gpt2-small", 8, 1024)
    out: dict[str, Any] = {"model": name, "batch": batch, "seq": seq}
    with tempfile.TemporaryDirectory(prefix="precprof-triton-cache-") as cache:
        # the same empty cache, then the one the first run left; then no profiler (a first step is slow anyway)
        for label in ("cold", "warm", "plain"):
            # without CUDA the kernel is the C one, compiled once: a "warm" run would repeat "cold"
            if label == "warm" and not run.cuda:
                out[label] = {"status": "skipped", "reason": "no CUDA: no Triton cache to warm"}
                continue
            if run.left() < 60:
                out[label] = {"status": "skipped", "reason": "budget"}
                continue
            env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
            limit = min(300.0, run.left() - 30)
            cmd = [sys.executable, "-c", _FIRST_STEP, str(ROOT), run.device.type, name, str(batch), str(seq)]
            cmd += ["plain" if label == "plain" else "profiled", str(max(10.0, limit - 60))]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                out[label] = {"status": "failed", "rc": r.returncode, "tail": (r.stdout + r.stderr)[-2000:]}
                continue
            res = json.loads(line[len("RESULT ") :])
            steps, sampled = res["steps_s"], res["sampled"]
            later_sampled = [t for t, s in zip(steps, sampled, strict=True) if s][1:]
            later_plain = [t for t, s in zip(steps[1:], sampled[1:], strict=True) if not s]
            if later_sampled:
                res["worst_step_over_later_sampled"] = max(steps) / statistics.median(later_sampled)
            res["worst_step_during"] = _overlapping(res, steps.index(max(steps))) if steps else []
            if later_sampled and later_plain:
                res["sampled_over_unsampled"] = statistics.median(later_sampled) / statistics.median(
                    later_plain
                )
            out[label] = res
    # what precprof adds to each of the first steps: against the same step without it (a first step is slow
    # anyway: on an H200 gpt2-small's took 0.40 s unprofiled, 4x a later sampled step)
    plain = out.get("plain", {}).get("steps_s") or []
    for label in ("cold", "warm"):
        steps = out.get(label, {}).get("steps_s") or []
        ratios = [t / p for t, p in zip(steps, plain, strict=False) if p > 0]  # the plain run has fewer steps
        if ratios:
            out[label]["first_steps_over_plain"] = ratios
            out[label]["worst_first_step_over_plain"] = max(ratios)
    out["goal_worst_step_over_later_sampled"] = 1.5
    return out


def stage_host(run: Run) -> dict[str, Any]:
    """bench/host_cost.py on the device: host work per inspected tensor of a sampled step (launches included)
    on a stack of 100 tiny blocks, and a sampled step's added time by part (goal: <= 15 us per tensor)."""
    out = Path(tempfile.mkdtemp(prefix="precprof-host-")) / "host_cost.json"
    args = (
        ["--device", "cpu", "--rounds", "1", "--steps", "2", "--blocks", "5"]
        if run.dry
        else ["--device", "cuda"]
    )
    args += ["--cprofile", "memory each"]  # where a step that measures memory spends its host time
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "host_cost.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=max(30.0, run.left() - 20),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench/host_cost.py exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    return {"host_cost": json.loads(out.read_text()), "table": r.stdout[-2500:], "goal_us_per_tensor": 15}


_COMPILE = r"""
import json, os, sys, time, torch
sys.path.insert(0, sys.argv[1])
from precprof.stats import StatsBuffer, triton_engine as te, triton_block as tb, triton_launch
from precprof.stats import blocks as _blocks
from precprof.stats.layout import LAYOUT
dev = torch.device("cuda", 0)
torch.zeros(1, device=dev); torch.cuda.synchronize()
te._kernels(); tb._kernels()
out = {"cpus": os.cpu_count(), "async_compile_mode": hasattr(__import__("triton"), "AsyncCompileMode")}
if sys.argv[2] == "serial":  # each kernel alone, one after another: what each costs
    rows = te.TritonRows(dev, LAYOUT)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dt).removeprefix("torch.")
        for v in te.variants_of([dt]):
            t = time.perf_counter()
            triton_launch.load_kernels([rows._warm_one(v, rows.layout.empty_rows(1, dev))])
            kind = "many" if v.many else "strided" if v.strided else "aligned" if v.aligned else "unaligned"
            out[f"rows_{name}_{kind}_s"] = time.perf_counter() - t
        t = time.perf_counter()
        out[f"blocks_{name}_kernels"] = len(tb.warm(dev, [dt], _blocks.RECIPES))
        out[f"blocks_{name}_s"] = time.perf_counter() - t
else:  # what attach() does: every kernel of the three dtypes, compiled side by side
    t = time.perf_counter()
    StatsBuffer(8, dev, engine="triton")
    out["attach_buffer_s"] = time.perf_counter() - t
print("RESULT " + json.dumps(out))
"""


def stage_compile(run: Run) -> dict[str, Any]:
    """attach()'s compiles with an empty Triton cache (a machine's first run) and again with the cache they
    left; ``--compile-serial`` also times each kernel alone (another 130 s on an H100 machine)."""
    if not run.cuda:
        raise _Skip("needs CUDA: the kernels compile for the device's target")
    out: dict[str, Any] = {}
    modes = [("cold", "attach", True), ("warm", "attach", False)]
    if run.compile_serial:
        modes.append(("serial", "serial", True))
    cache = tempfile.mkdtemp(prefix="precprof-triton-cache-")
    for label, mode, fresh in modes:
        if fresh:
            cache = tempfile.mkdtemp(prefix="precprof-triton-cache-")
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        r = subprocess.run(
            [sys.executable, "-c", _COMPILE, str(ROOT), mode],
            capture_output=True,
            text=True,
            timeout=max(30.0, min(300.0, run.left() - 30)),
            env=env,
        )
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            out[label] = {"status": "failed", "rc": r.returncode, "tail": (r.stdout + r.stderr)[-1500:]}
            continue
        out[label] = json.loads(line[len("RESULT ") :])
    return out


def stage_profile(run: Run) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    import torch.nn.functional as F

    from precprof.models import build_model

    name, batch, seq = ("gpt-nano", 2, 32) if not run.cuda else ("gpt2-small", 8, 1024)
    torch.manual_seed(0)
    model = build_model(name, vocab_size=256, seq_len=seq).module.to(run.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (batch, seq), device=run.device)
    prof: precprof.Profiler | None = None

    def step() -> None:
        with torch.autocast(run.device.type, dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if prof is not None:
            prof.step()
        _sync(run.device)

    acts = [torch.profiler.ProfilerActivity.CPU]
    if run.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)

    launched: list[
        tuple[int, str, tuple[int, ...]]
    ] = []  # (elements, dtype, shape) of each row kernel launched
    events: list[Any] = []
    chunks: list[tuple[int, int]] = []  # (tensors, elements) of each launch of _rows_many

    rereads: list[int] = []  # programs of the row kernels that read their blocks twice, in the profiled step

    def engine() -> Any:
        part = prof._buffer.primary if prof is not None and prof._buffer is not None else None
        return getattr(part, "_triton", None)

    def profiled() -> Any:
        for _ in range(1 if run.dry else 3):  # (a dry run: the plumbing)
            step()
        launched.clear()
        chunks.clear()
        rows = engine()
        before = rows.rereads() if rows is not None else 0  # (a sync, outside the profiled step)
        with torch.profiler.profile(activities=acts) as tp:
            step()
        if rows is not None:
            rereads[:] = [rows.rereads() - before]
        events[:] = list(tp.events())
        return tp.key_averages()

    # the same step without precprof first: what a sampled step adds, kernel by kernel
    plain = profiled()
    plain_split = _device_split(events)
    # streaming into a run directory, as users' runs do (the stream's thread is part of what a step costs)
    run_dir = tempfile.TemporaryDirectory()
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, out=run_dir.name).attach()
    if prof._buffer is not None:
        prof._buffer.wait_ready()  # the kernels precprof launches once its compile is done, not a first compile
    from precprof.stats import triton_engine

    te_block = triton_engine.BLOCK
    add = triton_engine.TritonRows.add

    def counted_add(self: Any, x: torch.Tensor, rows: torch.Tensor, row: int, *rest: Any) -> bool:
        done = add(self, x, rows, row, *rest)  # (rest: the stream, when the caller passes it)
        if done:
            launched.append((x.numel(), str(x.dtype).removeprefix("torch."), tuple(x.shape)))
        return done

    add_chunk = triton_engine.TritonRows._add_chunk

    def counted_chunk(self: Any, v: Any, chunk: list[Any], rows: torch.Tensor, stream: Any) -> None:
        if len(chunk) > 1:
            chunks.append((len(chunk), sum(c[0] for c in chunk)))
        add_chunk(self, v, chunk, rows, stream)

    triton_engine.TritonRows.add = counted_add  # type: ignore[method-assign]
    triton_engine.TritonRows._add_chunk = counted_chunk  # type: ignore[method-assign]
    try:
        ka = profiled()
    finally:
        triton_engine.TritonRows.add = add  # type: ignore[method-assign]
        triton_engine.TritonRows._add_chunk = add_chunk  # type: ignore[method-assign]
    dev_key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    out: dict[str, Any] = {"model": name, "batch": batch, "seq": seq}
    if run.cuda:

        def kernels(avg: Any) -> dict[str, tuple[int, float]]:
            return {
                e.key[:120]: (e.count, getattr(e, dev_key) / 1e3) for e in avg if getattr(e, dev_key, 0) > 0
            }

        sampled, before = kernels(ka), kernels(plain)
        out["device_ms_total"] = sum(ms for _, ms in sampled.values())
        out["plain_device_ms_total"] = sum(ms for _, ms in before.values())
        out["device_top"] = [
            {"name": k, "calls": c, "ms": ms}
            for k, (c, ms) in sorted(sampled.items(), key=lambda kv: -kv[1][1])[:25]
        ]
        added = {
            k: (c - before.get(k, (0, 0.0))[0], ms - before.get(k, (0, 0.0))[1])
            for k, (c, ms) in sampled.items()
        }
        out["device_added_top"] = [
            {"name": k, "calls": c, "ms": ms}
            for k, (c, ms) in sorted(added.items(), key=lambda kv: -kv[1][1])[:30]
        ]
        out["row_kernels"] = _row_kernel_fit(events, launched)
        # the same from the device's own events only, each kernel once: a CPU range's self device time holds
        # the kernels launched inside it that no op of their own wraps (the row kernels of a gradient hook under
        # autograd's node), which device_added_top may count a second time under the range (in 2026-11-27g it
        # showed 6.3 ms more under Optimizer.step and 5.5 under ViewBackward0 beside the row kernels' own 23.4)
        try:
            split = _device_split(events)
            out["device_kernels_ms"] = sum(split["by_kernel"].values())
            out["plain_device_kernels_ms"] = sum(plain_split["by_kernel"].values())
            for key in ("by_kernel", "by_range"):
                added = {k: v - plain_split[key].get(k, 0.0) for k, v in split[key].items()}
                out[f"device_added_{key}"] = [
                    {"name": f"{k[1]} in {k[0]}" if isinstance(k, tuple) else k, "ms": ms}
                    for k, ms in sorted(added.items(), key=lambda kv: -kv[1])[:20]
                ]
        except Exception as e:  # the rest of the stage's record stands
            out["device_split_error"] = f"{type(e).__name__}: {e}"
        many = [
            float(e.time_range.end - e.time_range.start)
            for e in events
            if e.name == "_rows_many" and str(getattr(e, "device_type", "")).endswith("CUDA")
        ]
        out["row_kernels_many"] = {  # the parameters, then the gradients, up to 16 a launch
            "kernels": len(many),
            "launches": len(chunks),
            "tensors": sum(c[0] for c in chunks),
            "elements": sum(c[1] for c in chunks),
            "device_ms": sum(many) / 1e3,
            "us_per_kernel": [round(u, 1) for u in many],
        }
        launches = [e for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")]
        out["kernel_launches"] = sum(e.count for e in launches)
    # programs that met a value outside their window and read their blocks again (the rows' hints place
    # the windows from the warm-up steps' tensors), against the programs of the one-tensor launches
    maxp = engine().max_programs if engine() is not None else 0
    out["row_programs_read_twice"] = {
        "programs": rereads[0] if rereads else None,
        "programs_of_one_tensor_launches": sum(min(maxp, -(-n // te_block)) for n, _, _ in launched),
    }
    out["cpu_top"] = [
        {"name": e.key[:120], "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3}
        for e in sorted(ka, key=lambda e: -e.self_cpu_time_total)[:25]
    ]
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    step()
    pr.disable()
    out["cprofile_step_s"] = time.perf_counter() - t
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45)
    out["cprofile_cumulative"] = buf.getvalue()[-9000:]
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    out["cprofile_tottime"] = buf.getvalue()[-7000:]
    out["memory_step"] = _profile_memory_step(prof, step)
    prof.detach()
    prof.tables()  # the stream written, then its folder removed
    run_dir.cleanup()
    return out  # the model and optimizer go with this frame; the next stage empties the cache


def _profile_memory_step(prof: Any, step: Callable[[], None]) -> dict[str, Any]:
    """cProfile's view of a sampled step that measures memory (the tracker told to measure the next one), and
    how many events the allocator's history held: on the H200 on 2026-12-04 a memory step of the host bench's
    tiny stack took 73 ms more host time than one that did not, where the CPU path took 1.3 ms."""
    import cProfile
    import io
    import pstats

    from precprof import _compat

    tracker = getattr(prof, "_tracker", None)
    if tracker is None:
        return {"note": "no memory tracker"}
    snapshot = _compat.cuda_snapshot
    seen: dict[str, Any] = {}

    def counted() -> dict[str, Any]:
        t = time.perf_counter()
        snap = snapshot()
        seen["snapshot_s"] = time.perf_counter() - t
        seen["trace_entries"] = [len(tr) for tr in snap.get("device_traces") or []]
        seen["segments"] = len(snap.get("segments") or [])
        seen["blocks"] = sum(len(sg.get("blocks") or []) for sg in snap.get("segments") or [])
        actions: dict[str, int] = {}
        for tr in snap.get("device_traces") or []:
            for e in tr:
                a = str(e.get("action"))
                actions[a] = actions.get(a, 0) + 1
        seen["actions"] = actions
        return snap

    every = tracker.schedule.every
    tracker.schedule.every = 1  # the step after this one measures memory (a step's end begins the next)
    try:
        step()
    finally:
        tracker.schedule.every = every
    _compat.cuda_snapshot = counted
    before = len(tracker.schedule.measured)
    pr = cProfile.Profile()
    try:
        t = time.perf_counter()
        pr.enable()
        step()
        pr.disable()
        wall = time.perf_counter() - t
    finally:
        _compat.cuda_snapshot = snapshot
    out: dict[str, Any] = {
        "step_s": wall,
        "measured": len(tracker.schedule.measured) > before,
        "snapshot": seen,
        "peak_note": tracker.peak_note,
    }
    for key, top in (("tottime", 35), ("cumulative", 50)):
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(top)
        out[f"cprofile_{key}"] = buf.getvalue()[-9000:]
    return out


def _device_split(events: list[Any]) -> dict[str, dict[Any, float]]:
    """Device time in ms from the device's own events, by kernel name (each kernel once), and by (CPU range,
    kernel) for the kernels each range launched itself."""
    by_kernel: dict[str, float] = {}
    by_range: dict[tuple[str, str], float] = {}
    for e in events:
        if str(getattr(e, "device_type", "")).endswith("CUDA"):
            name = e.name[:100]
            by_kernel[name] = by_kernel.get(name, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
        else:
            for k in getattr(e, "kernels", None) or []:
                key = (e.name[:60], k.name[:60])
                by_range[key] = by_range.get(key, 0.0) + k.duration / 1e3
    return {"by_kernel": by_kernel, "by_range": by_range}


def _row_kernel_fit(events: list[Any], launched: list[tuple[int, str, tuple[int, ...]]]) -> dict[str, Any]:
    """Each row kernel's device time in a sampled step, matched in order to the tensor it read: per dtype a fit
    ``us = fixed + elements / rate`` (what a launch costs the device whatever its size, and the real data's
    rate, against randn's in the kernels stage), and the launches far above the fit (a second read, when a
    program meets values outside its window)."""
    import numpy as np

    kernels = sorted(
        (e for e in events if e.name == "_rows" and str(getattr(e, "device_type", "")).endswith("CUDA")),
        key=lambda e: e.time_range.start,
    )
    us = [float(e.time_range.end - e.time_range.start) for e in kernels]
    out: dict[str, Any] = {"kernels": len(us), "launches": len(launched), "device_ms": sum(us) / 1e3}
    if not us or len(us) != len(launched):
        out["note"] = "kernels and launches do not pair up"
        return out
    for dtype in sorted({d for _, d, _ in launched}):
        pick = [i for i, (_, d, _) in enumerate(launched) if d == dtype]
        n = np.array([launched[i][0] for i in pick], dtype=np.float64)
        t = np.array([us[i] for i in pick])
        rec: dict[str, Any] = {
            "launches": len(pick),
            "elements": int(n.sum()),
            "device_ms": float(t.sum() / 1e3),
        }
        if len(pick) >= 3 and np.ptp(n) > 0:
            slope, fixed = np.polyfit(n, t, 1)
            fit = fixed + slope * n
            rec["fixed_us"] = float(fixed)
            rec["gelem_per_s"] = float(1e-3 / slope) if slope > 0 else None
            rec["fixed_share"] = float(fixed * len(pick) / t.sum())
            rec["over_2x_fit"] = int((t > 2 * fit).sum())
            rec["over_2x_fit_shapes"] = [
                {"shape": list(launched[pick[j]][2]), "us": float(t[j]), "fit_us": float(fit[j])}
                for j in np.flatnonzero(t > 2 * fit)[:20]
            ]
        rec["smallest"] = {"elements": int(n.min()), "us": float(t[int(n.argmin())])}
        out[dtype] = rec
    return out


def stage_syncs(run: Run) -> dict[str, Any]:
    if not run.cuda:
        raise _Skip("needs CUDA: set_sync_debug_mode and the allocator's counters are CUDA's")
    import torch.nn.functional as F

    from precprof.models import build_model

    def loop(profiled: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = build_model("gpt2-small", vocab_size=256, seq_len=512).module.cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, 256, (4, 512), device="cuda")
        prof = precprof.Profiler(model, optimizer=opt, sample_every=1) if profiled else None
        rec: dict[str, Any] = {"hook_sync_errors": 0, "copies_per_step": []}
        if prof is not None:
            prof.attach()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            torch.cuda.set_sync_debug_mode("error")
            try:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = model(x)
                F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
                opt.step()
            except RuntimeError as e:
                if "synchroniz" not in str(e):
                    raise
                rec["hook_sync_errors"] += 1
            finally:
                torch.cuda.set_sync_debug_mode(0)
            opt.zero_grad(set_to_none=True)
            if prof is not None:
                before = transfer.copies
                prof.step()
                rec["copies_per_step"].append(transfer.copies - before)
        torch.cuda.synchronize()
        rec["max_memory_allocated"] = torch.cuda.max_memory_allocated()
        if prof is not None:
            prof.detach()
        del model, opt, prof
        gc.collect()
        torch.cuda.empty_cache()
        return rec

    loop(False)  # warm-up: cuBLAS's workspaces and the allocator's cache, as a running job has them
    gc.collect()
    plain, profiled = loop(False), loop(True)
    # the profiled loop also holds precprof's buffers: its peak may be that much higher, never lower (a reset of
    # the process's counters would make it lower)
    ratio = profiled["max_memory_allocated"] / plain["max_memory_allocated"]
    return {
        "profiled": profiled,
        "unprofiled_max_memory_allocated": plain["max_memory_allocated"],
        "user_peak_ratio": ratio,
        "user_peak_unchanged": 1.0 <= ratio <= 1.02,
        "goal_copies_per_sampled_step": 1,
    }


def stage_overhead(run: Run) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="precprof-overhead-")) / "overhead.json"
    if run.dry:
        args = [
            "--device",
            "cpu",
            "--model",
            "gpt-nano",
            "--seq",
            "32",
            "--batch",
            "2",
            "--blocks",
            "1",
            "--steps",
            "10",
            "--warmup",
            "1",
            # one thread, as the other stages' CPU work: two spinning OpenMP threads on a busy 2-core machine
            # made each gpt-nano step 15x slower (4x the CPU time of this stage)
            "--threads",
            "1",
            "--configs",
            "baseline,precprof_1,precprof_10,precprof_auto",
        ]
    else:
        blocks_n = 3 if run.left() > 300 else 2
        args = ["--device", "cuda", "--blocks", str(blocks_n), "--steps", "10"]
        args += [
            "--configs",
            "baseline,floor,precprof_1,precprof_1_memory,precprof_1_thread,precprof_1_noblocks,precprof_10,"
            "precprof_auto,debug_uo",
        ]
    data, table = _overhead(run, args, out)
    result: dict[str, Any] = {"overhead": data, "table": table}
    # the default overhead budget over a run long enough for it to sample by budget (a sampled step costs a few
    # unsampled ones, so at 3% it samples about one step in a hundred): blocks of 80 steps against the baseline
    budget_args = list(args)
    i = budget_args.index("--configs")
    budget_args[i + 1] = "baseline,precprof_auto"
    budget_args[budget_args.index("--blocks") + 1] = "4"
    budget_args[budget_args.index("--steps") + 1] = "80"
    if run.dry:  # the same call with other numbers: the first call ran precprof_auto already
        result["budget"] = {"status": "skipped", "reason": "dry run", "args": budget_args}
    elif run.left() > 120:
        data, table = _overhead(run, budget_args, out.with_name("budget.json"))
        result["budget"] = {"overhead": data, "table": table}
    else:
        result["budget"] = {"status": "skipped", "reason": f"budget: {run.left():.0f} s left"}
    return result


def _overhead(run: Run, args: list[str], out: Path) -> tuple[dict[str, Any], str]:
    """bench/overhead.py with ``args``: its JSON and the end of its table."""
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "overhead.py"), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=max(30.0, run.left() - 20),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench/overhead.py exited {r.returncode}: {(r.stdout + r.stderr)[-1500:]}")
    return json.loads(out.read_text()), r.stdout[-3000:]


def stage_memory(run: Run) -> dict[str, Any]:
    import torch.nn.functional as F

    from precprof.models import build_model

    name, batch, seq = ("gpt-nano", 2, 32) if not run.cuda else ("gpt2-small", 8, 1024)
    out: dict[str, Any] = {"model": name}
    for precision in ("bf16", "fp32"):
        torch.manual_seed(0)
        model = build_model(name, vocab_size=256, seq_len=seq).module.to(run.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, 256, (batch, seq), device=run.device)
        prof = precprof.Profiler(
            model,
            optimizer=opt,
            sample_every=1,
            reset_peak_memory=True,
            block_formats=False,
            memory_peak=True,
        )
        with prof:
            for _ in range(2):
                with torch.autocast(run.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                    logits = model(x)
                F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                prof.step()
        mem = prof.tables()["memory"]
        last = mem[mem[T.STEP] == mem[T.STEP].max()]
        # what was allocated at the step's peak moment, part by part (the allocator's cache beside it)
        at_peak = last[last[T.MOMENT] == T.MOMENT_PEAK]
        per = at_peak.groupby(T.COMPONENT)[T.BYTES].sum()
        parts = {str(c): int(v) for c, v in per.items() if c != T.ALLOCATOR_CACHE}
        peaks = last[last[T.COMPONENT] == T.ALLOCATOR_PEAK]
        peak = int(peaks[T.BYTES].max()) if len(peaks) else None
        other = parts.get(T.OTHER_MEMORY, 0)
        out[precision] = {
            "parts_at_peak": parts,
            "allocator_cache_at_peak": int(per.get(T.ALLOCATOR_CACHE, 0)),
            "parts_bytes": sum(parts.values()),
            "allocator_peak": peak,
            "phase_of_peak": str(at_peak[T.PHASE].iloc[0]) if len(at_peak) else None,
            "parts_over_peak": sum(parts.values()) / peak if peak else None,
            "other_share_of_peak": other / peak if peak else None,
            "temporaries_by_phase": {
                str(m): int(b)
                for m, b in at_peak[at_peak[T.COMPONENT] == T.TEMPORARIES]
                .groupby(T.MODULE)[T.BYTES]
                .sum()
                .items()
            },
        }
        del model, opt, prof
        gc.collect()  # the hooks hold the model in a cycle: without this the fp32 run's "other" held the bf16 model
        if run.cuda:
            torch.cuda.empty_cache()
    out["goal"] = "parts_over_peak == 1, other_share_of_peak <= 0.10"
    return out


# ------------------------------------------------------------------------------------------- memory_cost
# A sampled step (every step sampled, no block what-if, memory_peak=True) in each configuration; what a part of a
# step that measures memory costs is the difference of two of them (MEMORY_COST_DIFFS). Keys starting with "_"
# are applied to the tracker after attach (bench only: the product code is unchanged).
MEMORY_COST_CONFIGS: dict[str, dict[str, Any]] = {
    "baseline": {},  # no profiler
    "no_memory": {"memory": False},
    # the tracker attached, its hooks armed on sampled steps; after the first two, no step measured
    "memory_unmeasured": {"memory_every": 10**6},
    "measured": {"memory_every": 1},
    "measured_no_peak": {"memory_every": 1, "memory_peak": False},
    "measured_no_saved_record": {"memory_every": 1, "_no_saved_record": True},
    "measured_root_hooks_only": {"memory_every": 1, "_root_hooks_only": True},
}
MEMORY_COST_DIFFS = {  # part: (the configuration with it, the one without)
    "memory_measured": ("measured", "memory_unmeasured"),
    "peak_source": ("measured", "measured_no_peak"),  # history on/off, snapshot, conversion, labels, replay
    "tracker_hooks_and_rows": ("measured_no_peak", "memory_unmeasured"),
    "saved_tensor_recording": ("measured", "measured_no_saved_record"),
    "per_module_hooks": ("measured", "measured_root_hooks_only"),
    "tracker_attached_unmeasured": ("memory_unmeasured", "no_memory"),
    "sampled_without_memory": ("no_memory", "baseline"),
}
_BOGUS_POOL = (1 << 62, 1 << 62)  # a mempool id no pool has: a snapshot of it holds no segment
_MISSING = object()


class _Timer:
    """Host seconds of wrapped calls, summed per key (the device synchronised before and after each call)."""

    def __init__(self, dev: torch.device) -> None:
        self.dev = dev
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.seen: dict[str, Any] = {}  # what a call returned or was given, read after the step (sizes)
        self.active: list[str] = []  # the wrapped calls under way, outermost first

    def add(self, key: str, seconds: float) -> None:
        self.s[key] = self.s.get(key, 0.0) + seconds
        self.n[key] = self.n.get(key, 0) + 1

    def wrap(
        self, key: str | Callable[..., str], fn: Callable[..., Any], keep: bool = False
    ) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            name = key(*args, **kwargs) if callable(key) else key
            self.active.append(name)
            _sync(self.dev)
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                _sync(self.dev)
                self.add(name, time.perf_counter() - t)
                self.active.pop()
            if keep:
                self.seen[name] = (args, out)
            return out

        return timed


class _Patched:
    """Attributes replaced for a while (module functions, instance attributes); put back on exit."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        self._saved.append((obj, name, vars(obj).get(name, _MISSING)))
        setattr(obj, name, value)

    def __enter__(self) -> _Patched:
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name, old in reversed(self._saved):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._saved.clear()


def _cost_workload(
    run: Run, kind: str
) -> tuple[dict[str, Any], Callable[[], torch.nn.Module], Callable[[torch.nn.Module], torch.Tensor]]:
    """(what it is, a fresh copy of the model on the device, its loss): the transformer of the other stages
    (gpt2-small bf16 8x1024 on CUDA, gpt-nano 2x32 on the CPU) or the host stage's 100 tiny blocks (a dry run:
    5, as the host stage's dry run)."""
    import copy

    import torch.nn.functional as F

    dev = run.device
    torch.manual_seed(0)
    if kind == "transformer":
        from precprof.models import build_model

        name, batch, seq = ("gpt2-small", 8, 1024) if run.cuda else ("gpt-nano", 2, 32)
        base = build_model(name, vocab_size=256, seq_len=seq).module
        x = torch.randint(0, 256, (batch, seq), device=dev)

        def loss_fn(model: torch.nn.Module) -> torch.Tensor:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                logits = model(x)
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x.reshape(-1))

        info: dict[str, Any] = {"model": name, "batch": batch, "seq": seq, "precision": "bf16 autocast"}
    else:
        n_blocks, width, batch = (100 if run.cuda else 5), 8, 4  # a dry run: the host stage's dry size
        layers: list[torch.nn.Module] = []
        for _ in range(n_blocks):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        base = torch.nn.Sequential(*layers)
        xt = torch.randn(batch, width, device=dev)

        def loss_fn(model: torch.nn.Module) -> torch.Tensor:
            return model(xt).square().mean()

        info = {"model": f"{n_blocks} x (Linear({width}) + GELU)", "batch": batch, "precision": "fp32"}
    return info, lambda: copy.deepcopy(base).to(dev), loss_fn


def _cost_step(
    run: Run, model: torch.nn.Module, opt: torch.optim.Optimizer, prof: Any, loss_fn: Callable[..., Any]
) -> dict[str, Any]:
    """One training step: ``step_s`` whole (synchronised at both ends and before ``prof.step()``), ``host_s``
    from its start until the host returned from zero_grad (no sync: the host's own time unless the launch
    queue filled), ``step_call_s`` of ``prof.step()`` (synchronised before and after)."""
    dev = run.device
    _sync(dev)
    t0 = time.perf_counter()
    loss_fn(model).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    tracker = getattr(prof, "_tracker", None)
    measured = bool(tracker is not None and tracker.schedule.measuring)
    _sync(dev)
    t2 = time.perf_counter()
    if prof is not None:
        prof.step()
    _sync(dev)
    t3 = time.perf_counter()
    return {"step_s": t3 - t0, "host_s": t1 - t0, "step_call_s": t3 - t2, "measured": measured}


def _root_hooks_only(tracker: Any) -> None:
    """The tracker's per-module hooks off, its root's kept (the module stack then holds the root alone): built
    again, without them, at the next sampled step."""
    tracker._uninstall()
    tracker._hookset = None
    tracker._module_hooks = [h for h in tracker._module_hooks if h[0] is tracker.model]


def _snapshot_sizes(snap: Any, index: int) -> dict[str, Any]:
    """Trace entries (of device ``index``, by action), segments and blocks of a ``_snapshot()``."""
    if not isinstance(snap, dict):
        return {}
    traces = snap.get("device_traces") or []
    trace = traces[index] if index < len(traces) else []
    actions: dict[str, int] = {}
    for e in trace:
        a = str(e.get("action"))
        actions[a] = actions.get(a, 0) + 1
    segments = snap.get("segments") or []
    return {
        "trace_entries": len(trace),
        "trace_entries_all_devices": sum(len(t) for t in traces),
        "actions": actions,
        "keys_per_entry": len(trace[0]) if trace else 0,
        "segments": len(segments),
        "blocks": sum(len(s.get("blocks") or []) for s in segments),
    }


def _instrumented_steps(
    run: Run, model: torch.nn.Module, opt: Any, prof: Any, loss_fn: Callable[..., Any], n: int
) -> dict[str, Any]:
    """Steps of the ``measured`` configuration with precprof's own calls timed from outside (module functions
    and the tracker's methods wrapped, the device synchronised around each): per step (its body and its
    ``prof.step()``, which ends it and begins the next), median seconds of each part, and what the last one
    read."""
    from precprof import _compat
    from precprof.capture import peak as peak_mod

    tracker = prof._tracker
    source = tracker._peak.source
    timer = _Timer(run.device)
    per_step: list[dict[str, float]] = []
    calls: dict[str, int] = {}
    n_saved = [0]
    record_saved = tracker._record_saved

    def counting_record_saved(t: torch.Tensor) -> None:
        n_saved[0] += 1
        record_saved(t)

    def persistent_key() -> str:  # read when the step begins (the CPU's source), and when it ends
        return "persistent_labels_end" if "peak_finish" in timer.active else "persistent_labels_begin"

    with _Patched() as p:
        w = timer.wrap
        p.set(
            _compat,
            "cuda_record_history",
            w(lambda on, n: "history_on" if on else "history_off", _compat.cuda_record_history),
        )
        p.set(_compat, "cuda_snapshot", w("snapshot", _compat.cuda_snapshot, keep=True))
        p.set(_compat, "cuda_memory_counters", w("memory_counters", _compat.cuda_memory_counters))
        p.set(_compat, "profiler_memory_start", w("profiler_memory_start", _compat.profiler_memory_start))
        p.set(_compat, "profiler_memory_stop", w("profiler_memory_stop", _compat.profiler_memory_stop))
        p.set(peak_mod, "replay", w("replay", peak_mod.replay, keep=True))
        p.set(tracker, "begin_step", w("tracker_begin_step", tracker.begin_step))
        p.set(tracker, "end_step", w("tracker_end_step", tracker.end_step))
        p.set(tracker, "_persistent", w(persistent_key, tracker._persistent))
        p.set(tracker, "_record_saved", counting_record_saved)
        p.set(tracker._peak, "finish", w("peak_finish", tracker._peak.finish))
        p.set(tracker._counts, "device_memory", w("nvml_device_memory", tracker._counts.device_memory))
        if source is not None:
            p.set(source, "start", w("source_start", source.start))
            p.set(source, "stop", w("source_stop", source.stop))
        steps = []
        for _ in range(n):
            timer.s, timer.n, n_saved[0] = {}, {}, 0
            steps.append(_cost_step(run, model, opt, prof, loss_fn))
            per_step.append(dict(timer.s))
            calls = dict(timer.n)
    keys = sorted({k for s in per_step for k in s})
    parts = {f"{k}_s": statistics.median(s.get(k, 0.0) for s in per_step) for k in keys}

    def part(k: str) -> float:
        return parts.get(f"{k}_s", 0.0)

    # what the wrapped calls leave over: precprof's own Python around them
    if "source_stop_s" in parts:
        inner = part("snapshot") + part("history_off") + part("profiler_memory_stop")
        parts["conversion_s"] = (
            part("source_stop") - inner
        )  # CudaHistory.stop / ProfilerMemory.stop beyond them
    if "peak_finish_s" in parts:
        parts["finish_other_s"] = (
            part("peak_finish") - part("source_stop") - part("persistent_labels_end") - part("replay")
        )
    if "tracker_end_step_s" in parts:
        parts["end_step_rows_s"] = part("tracker_end_step") - part("peak_finish") - part("nvml_device_memory")
    if "tracker_begin_step_s" in parts:
        # (the CPU's source reads the storages alive when the step begins)
        parts["begin_step_other_s"] = (
            part("tracker_begin_step") - part("source_start") - part("persistent_labels_begin")
        )
    out: dict[str, Any] = {
        "steps": n,
        "source": type(source).__name__ if source is not None else None,
        "parts": parts,
        "calls_per_step": calls,
        "saved_tensors_recorded": n_saved[0],
        "step_s": statistics.median(s["step_s"] for s in steps),
        "step_call_s": statistics.median(s["step_call_s"] for s in steps),
    }
    if "snapshot" in timer.seen:
        index = getattr(source, "index", 0)
        out["snapshot"] = _snapshot_sizes(timer.seen["snapshot"][1], index)
    if "replay" in timer.seen:
        ev = timer.seen["replay"][0][0]
        out["replayed_events"] = len(ev.kinds)
        out["replayed_segments"] = len(timer.seen["replay"][0][1])
    return out


def _history_calls(run: Run, model: torch.nn.Module, opt: Any, loss_fn: Callable[..., Any]) -> dict[str, Any]:
    """The CUDA allocator's history calls alone, on the unprofiled model's allocator state: turning it on and
    off (median of 5), ``_snapshot()`` with it off (the segments alone), then one training step recorded with
    precprof's ``CudaHistory``: its snapshot, the conversion of ``stop()`` beyond the snapshot (given the
    snapshot already taken), turning off a history that holds a step, the replay (no labels); and cheaper
    reads: the segments without the trace, the trace without segments (a mempool id of no pool), and a
    history that skips the actions precprof ignores."""
    import inspect

    from precprof import _compat
    from precprof.capture import peak as P

    if not run.cuda:
        return {"status": "skipped: no CUDA"}
    if _compat.cuda_history_enabled():
        return {"status": "skipped: the allocator's history is on already"}
    dev = run.device
    index = torch.cuda.current_device()
    out: dict[str, Any] = {"status": "ok"}

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        _sync(dev)
        t = time.perf_counter()
        r = fn()
        _sync(dev)
        return time.perf_counter() - t, r

    on, off = [], []
    for _ in range(5):
        on.append(timed(lambda: _compat.cuda_record_history(True, P.MAX_HISTORY_ENTRIES))[0])
        off.append(timed(lambda: _compat.cuda_record_history(False, P.MAX_HISTORY_ENTRIES))[0])
    out["history_on_s"] = statistics.median(on)
    out["history_off_empty_s"] = statistics.median(off)
    snaps = [timed(_compat.cuda_snapshot) for _ in range(3)]
    out["snapshot_history_off_s"] = statistics.median(t for t, _ in snaps)
    out["snapshot_history_off"] = _snapshot_sizes(snaps[-1][1], index)
    del snaps

    def body() -> None:
        loss_fn(model).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # one step recorded by precprof's own source, phase marks where the tracker places them
    h = P.CudaHistory(dev)
    out["source_start_s"], reason = timed(h.start)
    if reason:
        return {**out, "status": f"skipped: {reason}"}
    _sync(dev)
    t = time.perf_counter()
    loss = loss_fn(model)
    h.mark()
    loss.backward()
    h.mark()
    opt.step()
    h.mark()
    opt.zero_grad(set_to_none=True)
    out["recorded_step_host_s"] = time.perf_counter() - t
    _sync(dev)
    snap_times = []
    snap: Any = None
    for _ in range(2):
        t_snap, snap = timed(_compat.cuda_snapshot)
        snap_times.append(t_snap)
    out["snapshot_s"] = statistics.median(snap_times)
    out["snapshot"] = _snapshot_sizes(snap, index)
    # cheaper reads of the same history
    variants: dict[str, Any] = {}
    # torch 2.11+ takes (pool id, pool id, include_traces), older ones the pool id alone
    tries: dict[str, list[tuple[Any, ...]]] = {
        "segments_only": [(0, 0, False)],
        "traces_only": [(*_BOGUS_POOL, True), _BOGUS_POOL],
    }
    for label, args in tries.items():
        errors = []
        for arg in args:
            try:
                t_v, got = timed(functools.partial(torch._C._cuda_memorySnapshot, arg))
            except Exception as e:  # not this torch's argument: say so, try the next
                errors.append(f"{list(arg)}: {type(e).__name__}: {e}")
                continue
            variants[label] = {"s": t_v, "arg": list(arg), **_snapshot_sizes(got, index)}
            del got
            break
        if errors:
            variants.setdefault(label, {})["errors"] = errors
    # CudaHistory.stop()'s conversion alone: the snapshot it would take handed to it, the history left on
    with _Patched() as p:
        p.set(_compat, "cuda_snapshot", lambda: snap)
        p.set(_compat, "cuda_record_history", lambda on, n: None)
        out["conversion_s"], (ev, note) = timed(h.stop)
    out["history_off_after_step_s"] = timed(
        lambda: _compat.cuda_record_history(False, P.MAX_HISTORY_ENTRIES)
    )[0]
    snap = None  # (the history and its snapshot are freed)
    if ev is not None:
        segments = [T.PHASE_OTHER, T.PHASE_FORWARD, T.PHASE_BACKWARD, T.PHASE_OPTIMIZER]
        out["replay_no_labels_s"] = timed(lambda: P.replay(ev, segments, lambda k: []))[0]
        out["events"] = len(ev.kinds)
    else:
        out["conversion_note"] = note
    # a history that skips what precprof ignores (free_completed, snapshot): fewer entries to build and read
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    if "skip_actions" in params:
        skip = ["free_completed", "snapshot"]
        torch.cuda.memory._record_memory_history(
            "all", context=None, stacks="python", max_entries=P.MAX_HISTORY_ENTRIES, skip_actions=skip
        )
        try:
            body()
            t_skip, snap_skip = timed(_compat.cuda_snapshot)
            variants["skip_free_completed"] = {
                "s": t_skip,
                "skip_actions": skip,
                **_snapshot_sizes(snap_skip, index),
            }
            del snap_skip
        finally:
            _compat.cuda_record_history(False, P.MAX_HISTORY_ENTRIES)
    else:
        variants["skip_free_completed"] = {"error": "this torch's _record_memory_history has no skip_actions"}
    out["variants"] = variants
    return out


def _history_api() -> dict[str, Any]:
    """What this torch offers for the history (parameter names) and what precprof passes it (recorded by
    calling ``_compat.cuda_record_history`` with torch's function replaced: nothing runs)."""
    import inspect

    from precprof import _compat

    out: dict[str, Any] = {"torch": torch.__version__}
    mem = torch.cuda.memory
    for name in ("_record_memory_history", "memory_snapshot", "_snapshot"):
        fn = getattr(mem, name, None)
        try:
            out[name] = list(inspect.signature(fn).parameters) if fn is not None else None
        except (TypeError, ValueError):
            out[name] = None
    got: list[Any] = []
    with _Patched() as p:
        p.set(mem, "_record_memory_history", lambda *a, **k: got.append({"args": list(a), "kwargs": k}))
        _compat.cuda_record_history(True, 2_000_000)
    out["precprof_enable_call"] = got[0] if got else None
    return out


def _failure(e: BaseException) -> dict[str, Any]:
    return {"status": "failed", "error": f"{type(e).__name__}: {e}"}


def _cost_config(
    run: Run,
    name: str,
    build: Callable[[], torch.nn.Module],
    loss_fn: Callable[..., Any],
    counts: tuple[int, int, int],
    extra: dict[str, Any],
) -> dict[str, Any]:
    """One configuration on a fresh copy of the model: warm-up, then timed steps (medians and every value);
    the ``measured`` one then its instrumented steps, the ``baseline`` one the history's calls alone (into
    ``extra``). A failure of those is recorded beside what was measured."""
    warmup, steps, instrumented = counts
    spec = MEMORY_COST_CONFIGS[name]
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prof = None
    try:
        t = time.perf_counter()
        if name != "baseline":
            kw: dict[str, Any] = {"sample_every": 1, "block_formats": False, "compile_beside": False}
            kw["memory_peak"] = True  # CUDA: the allocator's history (its default); CPU: torch.profiler's
            kw.update({k: v for k, v in spec.items() if not k.startswith("_")})
            prof = precprof.Profiler(model, optimizer=opt, **kw).attach()
            tracker = prof._tracker
            if spec.get("_no_saved_record"):  # saved tensors still go through the hook, unrecorded
                vars(tracker)["_record_saved"] = lambda t: None
            if spec.get("_root_hooks_only"):
                _root_hooks_only(tracker)
        rec: dict[str, Any] = {"status": "ok", "attach_s": time.perf_counter() - t}
        got = [_cost_step(run, model, opt, prof, loss_fn) for _ in range(warmup + steps)][warmup:]
        for k in ("step_s", "host_s", "step_call_s"):
            rec[k] = statistics.median(g[k] for g in got)
            rec[f"{k}_all"] = [round(g[k], 6) for g in got]
        rec["measured_share"] = sum(g["measured"] for g in got) / len(got)
        if name == "measured" and instrumented:
            try:
                rec["instrumented"] = _instrumented_steps(run, model, opt, prof, loss_fn, instrumented)
            except Exception as e:  # what the timed steps measured stays
                rec["instrumented"] = _failure(e)
        if name == "baseline":
            try:
                extra["history_calls"] = _history_calls(run, model, opt, loss_fn)
            except Exception as e:
                extra["history_calls"] = _failure(e)
        return rec
    finally:
        if prof is not None:
            prof.detach()
        del model, opt, prof
        gc.collect()  # the hooks hold the model in a cycle
        if run.cuda:
            torch.cuda.empty_cache()


def _cost_model(run: Run, kind: str, counts: tuple[int, int, int]) -> dict[str, Any]:
    info, build, loss_fn = _cost_workload(run, kind)
    out: dict[str, Any] = {**info, "warmup": counts[0], "timed_steps": counts[1], "configs": {}}
    medians: dict[str, dict[str, float]] = {}
    for name in MEMORY_COST_CONFIGS:
        if run.left() < (8 if run.cuda else 2):
            out["configs"][name] = {"status": "skipped", "reason": f"budget: {run.left():.0f} s left"}
            continue
        try:
            rec = _cost_config(run, name, build, loss_fn, counts, out)
        except Exception as e:  # the next configuration runs
            rec = _failure(e)
        out["configs"][name] = rec
        if rec["status"] == "ok":
            medians[name] = {k: rec[k] for k in ("step_s", "host_s", "step_call_s")}
    out["added_s"] = {
        part: {k: medians[a][k] - medians[b][k] for k in ("step_s", "host_s", "step_call_s")}
        for part, (a, b) in MEMORY_COST_DIFFS.items()
        if a in medians and b in medians
    }
    return out


def stage_memory_cost(run: Run) -> dict[str, Any]:
    """Where the host time of a sampled step that measures memory goes (on an H200 92-100 ms against ~45 ms for
    a whole unprofiled gpt2-small step): on the transformer of the other stages and on the host stage's 100
    tiny blocks, every configuration of ``MEMORY_COST_CONFIGS`` in turn, each a fresh copy of the model (the
    allocator then holds one model's blocks, as in a real run), warm-up steps, then timed steps; ``added_s``:
    the differences of their medians (``MEMORY_COST_DIFFS``). The ``measured`` configuration then runs steps
    with precprof's own calls timed from outside (``instrumented``: history on/off, snapshot, conversion,
    labels, replay, counters, NVML, the tracker's begin/end), and the unprofiled one times the history's calls
    alone and cheaper ways to read it (``history_calls``: CUDA only). ``api``: what this torch's history
    functions take and what precprof passes them."""
    # warm-up, timed and instrumented steps (a dry run: the plumbing; memory_unmeasured measures its first two,
    # the warm-up's)
    counts = (3, 6, 3) if run.cuda else (2, 1, 1)
    out: dict[str, Any] = {"api": _history_api(), "device": run.device.type, "diffs": MEMORY_COST_DIFFS}
    threads = torch.get_num_threads()
    if not run.cuda:
        torch.set_num_threads(1)  # host work is what is measured: other work on the machine moves it less
    out["torch_threads"] = torch.get_num_threads()
    try:
        for kind in ("transformer", "tiny"):
            if run.left() < (12 if run.cuda else 3):
                out[kind] = {"status": "skipped", "reason": f"budget: {run.left():.0f} s left"}
                continue
            out[kind] = _cost_model(run, kind, counts)
    finally:
        torch.set_num_threads(threads)
    return out


def _device_slug(run: Run) -> str:
    name = torch.cuda.get_device_name(0) if run.cuda else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--budget-s", type=float, default=540.0, help="stop starting stages after this many seconds"
    )
    ap.add_argument("--out", default=None, help="the JSON (default bench/results/gpu_validate_<device>.json)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"a subset of {','.join(STAGES)}")
    ap.add_argument("--dry-run", action="store_true", help="every stage on the CPU at toy sizes")
    ap.add_argument(
        "--compile-serial", action="store_true", help="the compile stage also times each kernel alone"
    )
    args = ap.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device here: run with --dry-run to exercise the stages on the CPU")
    if args.dry_run and args.out is None:
        args.out = str(Path(tempfile.mkdtemp(prefix="precprof-gpu-validate-")) / "gpu_validate.json")
    run = Run(Path(args.out) if args.out else Path("/dev/null"), args.budget_s, args.dry_run)
    run.compile_serial = args.compile_serial
    if args.out is None:
        run.out = ROOT / "bench" / "results" / f"gpu_validate_{_device_slug(run)}.json"
    needs = {
        "env": 1,
        "host": 30,
        "tests": 60,
        "kernels": 20,
        "compile": 30,
        "first_step": 40,
        "profile": 30,
        "syncs": 20,
        "overhead": 60,
        "memory": 20,
        "memory_cost": 45,
    }
    fns = {
        "env": stage_env,
        "host": stage_host,
        "tests": stage_tests,
        "kernels": stage_kernels,
        "compile": stage_compile,
        "first_step": stage_first_step,
        "profile": stage_profile,
        "syncs": stage_syncs,
        "overhead": stage_overhead,
        "memory": stage_memory,
        "memory_cost": stage_memory_cost,
    }
    # what the imports made (torch's, precprof's: 390,000 objects) is never garbage: left out of the stages'
    # collections (gc.collect() read it all, 0.2-0.4 s each, 27 times a run), and handed back before the exit
    gc.freeze()
    try:
        for name in stages:
            run.stage(name, fns[name], needs[name] if not args.dry_run else 1)
    finally:
        gc.unfreeze()  # (frozen objects are not collected at exit: nanobind then reports Triton's as leaked)
    run.data["seconds"] = round(time.perf_counter() - run.t0, 1)
    run.save()
    print(f"wrote {run.out}")
    return run.data


if __name__ == "__main__":
    main()

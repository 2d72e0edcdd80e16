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
              of gpt2-small bf16 8x1024 (top 25 each, launches counted), and cProfile's Python functions
  syncs       a sampled step's hooks under set_sync_debug_mode("error"), the device-to-host copies in
              prof.step() (goal 1), and the user's max_memory_allocated() with and without precprof (equal)
  overhead    bench/overhead.py: gpt2-small bf16 8x1024, every configuration interleaved (the default sampling
              included), each phase's host and device time of sampled and unsampled steps
  memory      the memory table's components against the allocator's peak (bf16 and fp32)

On the H100 (one command of at most 10 minutes, 30 device-minutes a session), from the repository root:

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 bench/gpu_validate.py --budget-s 540 --out $OUT/gpu_validate.json

then commit the JSON that comes back as ``bench/results/gpu_validate_<device>.json``. ``--stages`` runs a
subset (e.g. ``--stages tests`` in one call, the rest in another). ``--dry-run`` runs every stage on the CPU at
toy sizes (the tests collected, not run; the CUDA-only checks skipped with a reason), in under a minute, so
that the plumbing is tested where no GPU is (tests/test_gpu_validate.py).
"""

from __future__ import annotations

import argparse
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


def _run_test_file(run: Run, p: Path, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(p)]
    if "pytest.mark.gpu" in p.read_text():
        cmd += ["-m", "gpu"]  # that file's GPU tests; its CPU tests run in CI
    if run.dry:
        cmd.append("--collect-only")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        return {"status": "timeout", "timeout_s": timeout_s, "tail": str(e.stdout or "")[-2000:]}
    text = r.stdout + r.stderr
    counts = {k: int(n) for n, k in _SUMMARY.findall(text.splitlines()[-1] if text.strip() else "")}
    if run.dry:
        counts = {"collected": len(re.findall(r"::", r.stdout))}
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
    with ThreadPoolExecutor(max_workers=1 if run.dry else 4) as pool:
        futures = {p.name: pool.submit(_run_test_file, run, p, timeout_s) for p in files}
        results = {name: f.result() for name, f in futures.items()}
    failed = [n for n, r in results.items() if r.get("rc") not in (0, 5)]
    return {"files": results, "failed_files": failed, "collected_only": run.dry}


def stage_kernels(run: Run) -> dict[str, Any]:
    dev = run.device
    sizes = [1 << 20] if run.dry else [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28]
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
                t = _time_s(
                    lambda x2=x2: blocks.tensor_block_stats(x2, engine=block_engine), dev, max(1, reps // 3)
                )
                rec[f"blocks_{block_engine}_gbps"] = nbytes / t / 1e9
                rec[f"blocks_{block_engine}_vs_sum"] = t_sum / t
            rows.append(rec)
            del x
    return {
        "rows": rows,
        "block_tiles": _block_tiles(run),
        "row_shapes": _row_shapes(run),
        "goals": {"rows_gbps_64M": 1000, "blocks_gbps_16M": 300},
    }


def _block_tiles(run: Run) -> list[dict[str, Any]]:
    """The Triton block kernel's throughput by tile (lines per tile) at 16M elements, each orientation: compiled
    for sm_90 by triton 3.6 (the GPU machine's), a 32-line tile takes 168 registers and 567 instructions per
    value, a 16-line tile 114 and 688, an 8-line tile 96 and 916 (the tile's reductions are shared by fewer
    values); which wins is the GPU's to say."""
    from precprof.stats import triton_block

    out: list[dict[str, Any]] = []
    if run.device.type != "cuda" or triton_block.unavailable(run.device) is not None:
        return out  # (Triton's interpreter takes minutes for these calls: a dry run leaves them out)
    recipes = list(blocks.RECIPES)
    n = 1 << 24
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, device=run.device).to(dtype).view(-1, 1024)
        nbytes = x.numel() * x.element_size()
        for axis in (-1, -2):
            for ta in (4, 8, 16, 32):
                if run.left() < 30:
                    return out
                t = _time_s(
                    lambda x=x, axis=axis, ta=ta: triton_block.block_stats_triton(x, recipes, axis, tile=ta),
                    run.device,
                    3,
                )
                out.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "axis": axis,
                        "tile": ta,
                        "gbps": nbytes / t / 1e9,
                    }
                )
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
# (bench/results/README_h200_2026-11-27c.md). The first is the default.
ROW_SHAPES = (
    (512, 4, True),
    (4096, 4, False),
    (1024, 4, True),
    (256, 4, True),
    (512, 8, True),
    (512, 2, True),
)


def _row_shapes(run: Run) -> list[dict[str, Any]]:
    """The Triton row kernel's throughput at 64M elements by ``ROW_SHAPES``, fp32 and bf16, beside ``x.sum()``
    (a dry run: 4,096 elements in Triton's interpreter, where the engine is available)."""
    from precprof.stats import triton_engine as te
    from precprof.stats.layout import LAYOUT

    out: list[dict[str, Any]] = []
    if (run.device.type != "cuda" and not run.dry) or te.unavailable(run.device) is not None:
        return out
    n = 1 << 26 if run.device.type == "cuda" else 1 << 12  # a dry run: the plumbing, in the interpreter
    dtypes = [torch.float32, torch.bfloat16]
    # the aligned contiguous variant of each dtype (what a 64M tensor launches), every shape's compiled side by
    # side, then loaded and checked against Triton's own launch
    variants = [te.Variant(te.KINDS[d][0], False, True) for d in dtypes]
    shapes = {
        bw: te.TritonRows(run.device, LAYOUT, block=bw[0], num_warps=bw[1], rare_after=bw[2])
        for bw in ROW_SHAPES
    }
    t0 = time.perf_counter()
    with te.parallel_compile(len(shapes) * len(variants)):
        compiled = [rows.warm(load=False, variants=variants) for rows in shapes.values()]
    for rows, kernels in zip(shapes.values(), compiled, strict=True):
        te.load_kernels(kernels)
        rows.adopt_compiled()
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
    for (block, warps, after), rows in shapes.items():
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
prof = precprof.Profiler(model, optimizer=opt, sample_every=2).attach() if profiled else None
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
    args = ["--device", "cpu", "--rounds", "1", "--steps", "2"] if run.dry else ["--device", "cuda"]
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
from precprof.stats import StatsBuffer, triton_engine as te, triton_block as tb
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
            te.load_kernels([rows._launch(v, (1,), te._example(v, dev), (1, 0, 1, 1, 1, 1, 1), rows.layout.empty_rows(1, dev), 0, True)])
            kind = "strided" if v.strided else "aligned" if v.aligned else "unaligned"
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
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1).attach()

    def step() -> None:
        with torch.autocast(run.device.type, dtype=torch.bfloat16):
            logits = model(x)
        F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), x.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        prof.step()
        _sync(run.device)

    for _ in range(3):
        step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if run.cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as tp:
        step()
    ka = tp.key_averages()
    dev_key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    out: dict[str, Any] = {"model": name, "batch": batch, "seq": seq}
    if run.cuda:
        kernels = [e for e in ka if getattr(e, dev_key, 0) > 0]
        out["device_ms_total"] = sum(getattr(e, dev_key) for e in kernels) / 1e3
        out["device_top"] = [
            {"name": e.key[:120], "calls": e.count, "ms": getattr(e, dev_key) / 1e3}
            for e in sorted(kernels, key=lambda e: -getattr(e, dev_key))[:25]
        ]
        launches = [e for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")]
        out["kernel_launches"] = sum(e.count for e in launches)
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
    prof.detach()
    return out  # the model and optimizer go with this frame; the next stage empties the cache


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
            "--configs",
            "baseline,precprof_1,precprof_10,precprof_auto",
        ]
    else:
        blocks_n = 3 if run.left() > 300 else 2
        args = ["--device", "cuda", "--blocks", str(blocks_n), "--steps", "10"]
        args += [
            "--configs",
            "baseline,floor,precprof_1,precprof_1_noblocks,precprof_10,precprof_auto,debug_uo",
        ]
    data, table = _overhead(run, args, out)
    result: dict[str, Any] = {"overhead": data, "table": table}
    # the default overhead budget over a run long enough for it to sample by budget (a sampled step costs a few
    # unsampled ones, so at 3% it samples about one step in a hundred): blocks of 80 steps against the baseline
    budget_args = list(args)
    i = budget_args.index("--configs")
    budget_args[i + 1] = "baseline,precprof_auto"
    if run.dry:
        budget_args[budget_args.index("--steps") + 1] = "20"
    else:
        budget_args[budget_args.index("--blocks") + 1] = "4"
        budget_args[budget_args.index("--steps") + 1] = "80"
    if run.left() > (30 if run.dry else 120):
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
    }
    for name in stages:
        run.stage(name, fns[name], needs[name] if not args.dry_run else 1)
    run.data["seconds"] = round(time.perf_counter() - run.t0, 1)
    run.save()
    print(f"wrote {run.out}")
    return run.data


if __name__ == "__main__":
    main()

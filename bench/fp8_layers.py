"""FP8's speed layer by layer (issue 34): one linear layer's forward and backward, bf16 autocast against
torchao's ``Float8Linear`` (tensorwise), both ``torch.compile``d, at the GEMM shapes of the models
``bench/fp8_vs_bf16.py`` trains and a grid around them.

Why: ``analysis/fp8_speed.py`` estimated a whole step's FP8 speed from two constants fitted on two steps
(gpt2-small 0.75x, qwen2-2048 0.86x on an H200), and the third model, qwen2 with Llama3-8B's block shapes,
refuted it: estimated 1.01x, measured 1.25x. A per-shape table says what each layer's GEMMs and casts cost in
each format, measured, so that only the rest of the step (attention, norms, the optimizer) is left to a model.

Each shape: fp32 weights (as the built-in loop keeps them), a bf16 input of M x K that needs its gradient,
``y = layer(x)`` under bf16 autocast, ``y.backward(dy)``: three GEMMs, and in FP8 the casts of input, weight and
output gradient. The function is compiled once per shape and format (its compile time is recorded) and timed two
ways, each the median of ``--repeats`` runs of ``--iters`` calls timed with CUDA events, after ``--warmup`` calls:

- ``graph_s`` (the table's ``time_s``): the compiled call captured in a CUDA graph (``torch.cuda.graph``, after
  warmup on a side stream, grads cleared so the backward allocates them in the graph's pool) and replayed. A
  replay is one launch, so this is the GPU's time for the layer's kernels, as in a training step whose host
  keeps ahead of its GPU (a compiled step of a model of some size: qwen2-3072's 29 layers ran at 1.19x in FP8
  while the layers timed alone, launched call by call, said its small shapes lose).
- ``eager_launch_s``: the compiled call launched call after call from Python, as the 2026-11-27 table was
  timed. Below about 0.5 ms (bf16) and 0.95 ms (FP8, whose casts launch more kernels) that is the host's launch
  rate, not the GPU's: 2048 x 2048 came out at 0.47x. Kept to compare, and for steps the host does bound.

A shape whose capture fails keeps its eager time as ``time_s`` and says so in ``timing``. Why graphs rather
than a longer queue: a single layer's calls cannot run ahead of a host that takes longer to launch one than
the GPU takes to run it, however many are queued; a graph replays the whole call from one launch.

The JSON is rewritten after each shape, so a command stopped at its time limit keeps what it measured;
``--budget-s`` stops starting shapes; ``--shapes 3072x3072,3072x1024`` times only those (K x N).

On an H100 or H200 (torch 2.11, triton 3.6; torchao 0.17 carried as a wheel), from the repository root:

    PYTHONPATH=/tmp/site:. python3 bench/fp8_layers.py --budget-s 150 --out $OUT/fp8_layers.json

``--dry-run`` runs the plumbing on the CPU at toy sizes with bf16 standing in for FP8; the CPU has no CUDA
graphs, so there ``graph_s`` is the host's wall time of the same calls, labelled ``cpu_fallback`` in ``timing``
(tests/test_bench_fp8.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from precprof import hardware  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_vs_bf16 import refuse_without_gpu  # noqa: E402

TOKENS = 8 * 1024
# (K, N) of the layers the models of bench/fp8_vs_bf16.py convert, then a grid around them: the model shapes
# first, so a stopped run has those
MODEL_SHAPES: tuple[tuple[int, int], ...] = (
    # gpt2-small: c_attn, c_proj, c_fc, mlp.c_proj
    (768, 2304),
    (768, 768),
    (768, 3072),
    (3072, 768),
    # qwen2-2048: q/k/v/o, gate/up, down, head
    (2048, 2048),
    (2048, 8192),
    (8192, 2048),
    (2048, 32768),
    # qwen2-4096 (Llama3-8B's blocks): q/o, k/v, gate/up, down, head
    (4096, 4096),
    (4096, 1024),
    (4096, 14336),
    (14336, 4096),
    (4096, 32768),
    # qwen2-3072 (Llama-3.2-3B's blocks: 24 heads, 8 key-value heads of 128), the out-of-sample check of
    # analysis/fp8_speed.py, none of whose shapes the 2026-11-27 table timed: q/o, k/v, gate/up, down, head
    (3072, 3072),
    (3072, 1024),
    (3072, 8192),
    (8192, 3072),
    (3072, 32768),
)
GRID: tuple[tuple[int, int], ...] = tuple(
    (k, n) for k in (1024, 2048, 4096, 8192) for n in (1024, 4096, 16384) if (k, n) not in MODEL_SHAPES
)
DRY_SHAPES: tuple[tuple[int, int], ...] = ((64, 96), (128, 32))
CPU_FALLBACK = "cpu_fallback: no CUDA graphs on the CPU, the host's wall time of the same compiled calls"


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"3072x3072,3072x1024"`` -> ((3072, 3072), (3072, 1024)): K x N, in_features x out_features."""
    out = []
    for part in text.split(","):
        k, sep, n = part.strip().lower().partition("x")
        if not sep or not k.isdigit() or not n.isdigit() or int(k) <= 0 or int(n) <= 0:
            raise argparse.ArgumentTypeError(f"not K x N: {part!r} (e.g. 3072x1024)")
        out.append((int(k), int(n)))
    return tuple(out)


def _layer(k: int, n: int, fp8: bool, device: torch.device) -> nn.Module:
    model = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
    if fp8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
    return model


def _median_time(call: Any, iters: int, repeats: int, cuda: bool) -> float:
    """The median over ``repeats`` of the mean time of ``iters`` calls of ``call()``, in s: CUDA events on the
    GPU, the host's clock on the CPU."""
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                call()
            times.append((time.perf_counter() - t) / iters)
    return statistics.median(times)


def _graph(fn: Any, x: torch.Tensor, dy: torch.Tensor, params: list[nn.Parameter], warmup: int) -> Any:
    """``fn(x, dy)`` captured in a CUDA graph, returned as its replay: warmed up on a side stream (as
    torch.cuda.graph asks), then the grads cleared so that the captured backward allocates them in the graph's
    memory pool and each replay rewrites them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 2)):
            fn(x, dy)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    x.grad = None
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(x, dy)
    torch.cuda.synchronize()
    return graph.replay


def measure(
    k: int, n: int, m: int, fp8: bool, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """One format at one shape: compile and first call, the eager-launch time, then the graph-replay time
    (``time_s`` is the latter, else the former, as ``timing`` says)."""
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    layer = _layer(k, n, fp8, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step(x: torch.Tensor, dy: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False):
            y = layer(x)
        y.backward(dy)

    fn = torch.compile(step) if not args.eager else step
    t0 = time.perf_counter()
    fn(x, dy)
    if cuda:
        torch.cuda.synchronize()
    rec: dict[str, Any] = {"first_call_s": time.perf_counter() - t0}
    for _ in range(args.warmup):
        fn(x, dy)
    rec["eager_launch_s"] = _median_time(lambda: fn(x, dy), args.iters, args.repeats, cuda)
    if not cuda:
        rec["timing"] = CPU_FALLBACK
        rec["graph_s"] = _median_time(lambda: fn(x, dy), args.iters, args.repeats, cuda)
    else:
        try:
            replay = _graph(fn, x, dy, list(layer.parameters()), args.warmup)
            for _ in range(args.warmup):
                replay()
            rec["graph_s"] = _median_time(replay, args.iters, args.repeats, cuda)
            rec["timing"] = "cuda_graph"
        except Exception as exc:  # the eager time stands, said so
            rec["timing"] = f"eager_launch: graph capture failed: {type(exc).__name__}: {exc}"[:400]
    rec["time_s"] = rec.get("graph_s", rec["eager_launch_s"])
    rec["tflops"] = 6 * m * k * n / rec["time_s"] / 1e12
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting shapes after this (150)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help=f"M, tokens per call ({TOKENS})")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", type=parse_shapes, help="only these, K x N: 3072x3072,3072x1024")
    ap.add_argument("--no-grid", action="store_true", help="the models' shapes only")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (FP8 is slow eager: a control)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, bf16 standing in for fp8")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if refuse_without_gpu(dry):
        return 2
    device = torch.device("cpu" if dry else "cuda")
    m = 64 if dry else args.tokens
    shapes = args.shapes or (DRY_SHAPES if dry else MODEL_SHAPES + (() if args.no_grid else GRID))
    if dry:
        args.warmup, args.iters, args.repeats = 1, 2, 2
    hw = hardware.detect(device)
    data: dict[str, Any] = {
        "what": "one linear layer's forward and backward, bf16 autocast against torchao Float8Linear "
        "(tensorwise), fp32 weights, both torch.compile'd; median over repeats of the mean of iters calls: "
        "time_s is graph_s (CUDA graph replays, the GPU's time) where timing says cuda_graph, else "
        "eager_launch_s (the calls launched one by one from Python, the host's rate for small shapes)",
        "device": hw.name,
        "torch": torch.__version__,
        "torchao": hardware.software_versions().get("torchao"),
        "dry_run": dry,
        "fp8_stand_in": None if not dry else "bf16 (fp8 needs a GPU with compute capability 8.9+)",
        "graph_stand_in": None if not dry else CPU_FALLBACK,
        "compiled": not args.eager,
        "tokens": m,
        "warmup": args.warmup,
        "iters": args.iters,
        "repeats": args.repeats,
        "shapes": [],
    }
    t_start = time.perf_counter()
    for k, n in shapes:
        if time.perf_counter() - t_start > args.budget_s:
            data["stopped"] = f"budget: {len(data['shapes'])} of {len(shapes)} shapes measured"
            break
        rec: dict[str, Any] = {"m": m, "k": k, "n": n}
        try:
            rec["bf16"] = measure(k, n, m, False, device, args)
            rec["fp8"] = measure(k, n, m, not dry, device, args)
            rec["speedup"] = rec["bf16"]["time_s"] / rec["fp8"]["time_s"]
            rec["speedup_eager_launch"] = rec["bf16"]["eager_launch_s"] / rec["fp8"]["eager_launch_s"]
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        data["shapes"].append(rec)
        print(json.dumps(rec), flush=True)
        args.out.write_text(json.dumps(data, indent=1))
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    data["wall_s"] = time.perf_counter() - t_start
    args.out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

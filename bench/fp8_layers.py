"""FP8's speed layer by layer (issue 34): one linear layer's forward and backward, bf16 autocast against
torchao's ``Float8Linear`` (tensorwise), both ``torch.compile``d, at the GEMM shapes of the models
``bench/fp8_vs_bf16.py`` trains and a grid around them.

Why: ``analysis/fp8_speed.py`` estimated a whole step's FP8 speed from two constants fitted on two steps
(gpt2-small 0.75x, qwen2-2048 0.86x on an H200), and the third model, qwen2 with Llama3-8B's block shapes,
refuted it: estimated 1.01x, measured 1.25x. A per-shape table says what each layer's GEMMs and casts cost in
each format, measured, so that only the rest of the step (attention, norms, the optimizer) is left to a model.

Each shape: fp32 weights (as the built-in loop keeps them), a bf16 input of M x K that needs its gradient,
``y = layer(x)`` under bf16 autocast, ``y.backward(dy)``: three GEMMs, and in FP8 the casts of input, weight and
output gradient. The timed function is compiled once per shape and format (its compile time is recorded), run
``--warmup`` times, then timed with CUDA events over ``--iters`` calls, ``--repeats`` times; the median of the
repeats is kept. The JSON is rewritten after each shape, so a command stopped at its time limit keeps what it
measured; ``--budget-s`` stops starting shapes.

On an H100 or H200 (torch 2.11, triton 3.6; torchao 0.17 carried as a wheel), from the repository root:

    PYTHONPATH=/tmp/site:. python3 bench/fp8_layers.py --budget-s 150 --out $OUT/fp8_layers.json

``--dry-run`` runs the plumbing on the CPU at toy sizes with bf16 standing in for FP8 (tests/test_bench_fp8.py).
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
)
GRID: tuple[tuple[int, int], ...] = tuple(
    (k, n) for k in (1024, 2048, 4096, 8192) for n in (1024, 4096, 16384) if (k, n) not in MODEL_SHAPES
)
DRY_SHAPES: tuple[tuple[int, int], ...] = ((64, 96), (128, 32))


def _layer(k: int, n: int, fp8: bool, device: torch.device) -> nn.Module:
    model = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
    if fp8:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
    return model


def _time(
    fn: Any, x: torch.Tensor, dy: torch.Tensor, warmup: int, iters: int, repeats: int, cuda: bool
) -> tuple[float, float]:
    """(compile and first call in s, median time of one call in s)."""
    t0 = time.perf_counter()
    fn(x, dy)
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fn(x, dy)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn(x, dy)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn(x, dy)
            times.append((time.perf_counter() - t) / iters)
    return first, statistics.median(times)


def measure(
    k: int, n: int, m: int, fp8: bool, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    torch.manual_seed(0)
    layer = _layer(k, n, fp8, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step(x: torch.Tensor, dy: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)

    fn = torch.compile(step) if not args.eager else step
    first, t = _time(fn, x, dy, args.warmup, args.iters, args.repeats, device.type == "cuda")
    return {"first_call_s": first, "time_s": t, "tflops": 6 * m * k * n / t / 1e12}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting shapes after this (150)")
    ap.add_argument("--tokens", type=int, default=TOKENS, help=f"M, tokens per call ({TOKENS})")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-grid", action="store_true", help="the models' shapes only")
    ap.add_argument("--eager", action="store_true", help="no torch.compile (FP8 is slow eager: a control)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy sizes, bf16 standing in for fp8")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if refuse_without_gpu(dry):
        return 2
    device = torch.device("cpu" if dry else "cuda")
    m = 64 if dry else args.tokens
    shapes = DRY_SHAPES if dry else MODEL_SHAPES + (() if args.no_grid else GRID)
    if dry:
        args.warmup, args.iters, args.repeats = 1, 2, 2
    hw = hardware.detect(device)
    data: dict[str, Any] = {
        "what": "one linear layer's forward and backward, bf16 autocast against torchao Float8Linear "
        "(tensorwise), fp32 weights, both torch.compile'd; median over repeats of the mean of iters calls",
        "device": hw.name,
        "torch": torch.__version__,
        "torchao": hardware.software_versions().get("torchao"),
        "dry_run": dry,
        "fp8_stand_in": None if not dry else "bf16 (fp8 needs a GPU with compute capability 8.9+)",
        "compiled": not args.eager,
        "tokens": m,
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
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:500]
        data["shapes"].append(rec)
        print(json.dumps(rec), flush=True)
        args.out.write_text(json.dumps(data, indent=1))
        torch._dynamo.reset()
    data["wall_s"] = time.perf_counter() - t_start
    args.out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which programs of the Triton row kernel read their blocks twice, measured on a real step's tensors on the CPU.

The row kernel (``stats/triton_kernels._rows``) histograms each value into a 64-slot window of 31 binades, placed
from the largest value of the program's first block (``2 * top - 58``: two binades of room above it). A program
that meets any value outside its window (or at the overflow shortcut, 2^8 and up) reads all of its blocks again
for their exact keys (``RARE_AFTER``): on an H200, 12 launches on gpt2-small's attention outputs took 2.7x their
fit (``bench/results/README_h200_2026-12-04.md``). This replays the kernel's placement in numpy, program by
program (a grid of 4 programs per SM, 132 SMs, blocks of ``--block`` values (the kernel's), block ``b`` read by program ``b % programs``), on
the bf16 outputs and output gradients of one step of the built-in gpt2-small under bf16 autocast, for a window
placed ``--heads`` binades above the first block's largest value, and with the row's hint (``hint``: the window
over the span of the tensor read into the row before, here taken to be this one's), and writes the share of
values read twice.

    python bench/window_reread.py [--batch 2] [--seq 1024] [--heads 2,4,6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from precprof.models.gpt import GPT, GPTConfig  # noqa: E402
from precprof.stats.layout import LAYOUT  # noqa: E402

BLOCK = 512  # the row kernel's (``--block``; triton_engine.BLOCK by default)
PROGRAMS = 4 * 132  # TritonRows' max_programs on an H100 or H200
BF16_BIAS, BF16_FIELD_ALL = 127, 255


def step_tensors(batch: int, seq: int) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, module, tensor) of every bf16 output and output gradient of a leaf module in one step."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=seq))
    got: list[tuple[str, str, torch.Tensor]] = []

    def hook(name: str) -> Any:
        def fwd(_mod: torch.nn.Module, _inp: object, out: object) -> None:
            if isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16:
                got.append(("output", name, out.detach()))
                if out.requires_grad:
                    out.register_hook(lambda g: got.append(("gradient", name, g.detach())))

        return fwd

    for name, mod in model.named_modules():
        if not list(mod.children()):
            mod.register_forward_hook(hook(name))
    x = torch.randint(0, 50304, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()).backward()
    return got


def reread_share(x: torch.Tensor, head: int, kcap: int, hinted: bool = False) -> float:
    """The share of ``x``'s values that the programs meeting a rare value read a second time. ``hinted``: with the
    row's hint (``triton_kernels._window``) left by a tensor of the same span (this one: the step before's
    tensor of a module, taken to span what this step's does), ``head`` then unused."""
    u = x.contiguous().view(-1).view(torch.int16).numpy().astype(np.int32) & 0x7FFF
    nblocks = u.size // BLOCK
    if nblocks == 0:
        return 0.0
    nprog = min(PROGRAMS, nblocks)
    ub = u[: nblocks * BLOCK].reshape(nblocks, BLOCK)
    fld = ub >> 7
    kn = 2 * fld + ((ub & 0x7F) == 0)
    first = np.where((2 * fld[:nprog] < kcap) & (ub[:nprog] != 0), fld[:nprog], 0).max(axis=1)
    top = np.where(first == 0, BF16_BIAS, first)
    base = np.maximum(2 * top - (62 - 2 * head), 0)
    finite = (u != 0) & ((u >> 7) < BF16_FIELD_ALL)
    if hinted and finite.any() and (u[finite] >> 7).min() >= 1:  # (bf16 subnormals: no hint, as the kernel)
        hi = min(int((u[finite] >> 7).max()), kcap // 2 - 1)
        lo = int((u[finite] >> 7).min())
        top_h = (hi + lo + 26) // 2 if hi - lo <= 28 else hi  # (wider: the window's top at the largest)
        base = np.full(nprog, max(2 * top_h - 58, 0))
    prog = np.arange(nblocks) % nprog
    w = kn - base[prog][:, None]
    rare = (ub != 0) & ~((w >= 2) & (w < 64) & (kn < kcap))
    met = np.zeros(nprog, dtype=bool)
    np.logical_or.at(met, prog, rare.any(axis=1))
    return float(met[prog].sum() * BLOCK / u.size)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", default="2,4,6", help="binades of room above the first block's largest value")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "window_reread_cpu.json"))
    ap.add_argument("--block", type=int, default=None, help="values a block (default: triton_engine.BLOCK)")
    args = ap.parse_args(argv)
    global BLOCK
    from precprof.stats import triton_engine

    BLOCK = args.block or triton_engine.BLOCK
    kcap = 2 * min(LAYOUT.overflow_shortcut_exp + BF16_BIAS, BF16_FIELD_ALL)
    t0 = time.perf_counter()
    tensors = step_tensors(args.batch, args.seq)
    out: dict = {
        "model": "gpt2-small (built-in, random init), bf16 autocast",
        "batch": args.batch,
        "seq": args.seq,
        "block": BLOCK,
        "programs": PROGRAMS,
        "tensors": len(tensors),
        "values": sum(t.numel() for _, _, t in tensors),
        "step_s": round(time.perf_counter() - t0, 1),
        "heads": {},
    }
    for head in [*(int(h) for h in args.heads.split(",")), "hint"]:
        shares = [
            (reread_share(t, 2 if head == "hint" else int(head), kcap, head == "hint"), kind, name, t.numel())
            for kind, name, t in tensors
        ]
        twice = sum(s * n for s, _, _, n in shares)
        worst = sorted(shares, reverse=True)[:5]
        out["heads"][str(head)] = {
            "values_read_twice_share": twice / out["values"],
            "worst": [{"share": round(s, 3), "kind": k, "module": m, "values": n} for s, k, m, n in worst],
        }
        print(f"window {head}: {twice / out['values']:.3f} of the values read twice; worst {worst[:2]}")
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()

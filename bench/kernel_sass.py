"""What the statistics kernels compile to for a GPU, without a GPU: registers, spills and each loop's SASS.

Between GPU sessions the instructions a kernel's loops execute per value are the guide to its speed. This
compiles the row kernels (``triton_kernels._rows``, and ``_rows_many``: up to 16 tensors a launch), the block
kernel (``triton_block_kernels._blocks``) and the weight-update samples' two (``triton_update_kernels``)
exactly as the Profiler's warm-up does (``TritonRows.warm``, ``triton_block._compile``,
``triton_updates.compile_kernels``), for sm_90 by default,
through the driver ``triton_ahead`` uses to compile for a GPU it does not have, and reads the binaries with the
disassembler Triton ships. Per kernel: registers, local memory (spills), shared memory, the instructions of
the whole kernel, and per loop (a backward branch and what it jumps over, innermost first) its instructions
and those that tell most: barriers, shuffles, votes, float64 operations and conversions, loads.

Which loop is the hot one, and how many values a thread handles in one of its iterations, is each kernel's:
the row kernel's main loop reads ``block / (32 * num_warps)`` values a thread per iteration; the block
kernel's loop of its second read, one (a position of the thread's line), and its first read is unrolled into
the loop around it. Run with another Triton on ``PYTHONPATH`` (the GPU machine's) to see what it compiles.

    python bench/kernel_sass.py --out bench/results/kernel_sass_sm90_triton3.9.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the interpreter
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from precprof.stats import blocks, triton_ahead, triton_block, triton_engine, triton_updates  # noqa: E402
from precprof.stats.layout import LAYOUT  # noqa: E402

TELLING = (
    "BAR",
    "SHFL",
    "VOTE",
    "POPC",
    "ATOMS",
    "ATOMG",
    "DADD",
    "DMUL",
    "DFMA",
    "F2F",
    "LDG",
    "LDGSTS",
    "LDS",
)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _run(cubin: bytes, tool: str, *args: str) -> str:
    """What one of Triton's CUDA tools prints for ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool(tool), *args, f.name], capture_output=True, text=True, check=True).stdout


def _sass(cubin: bytes) -> tuple[list[str], dict[str, int]]:
    """The kernel's instructions, in order (predicates kept), and the index each branch label stands at."""
    text = _run(cubin, "nvdisasm", "-c")
    out: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(out)
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            out.append(m.group(1).strip())
    return out, labels


def _resources(cubin: bytes) -> dict[str, int]:
    text = _run(cubin, "cuobjdump", "--dump-resource-usage")
    found = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in found.items()}


def _opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0]


def analyse(cubin: bytes) -> dict[str, Any]:
    """Registers, spills and the loops' instruction counts of one compiled kernel."""
    ins, labels = _sass(cubin)
    loops = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", text)
        if m and labels.get(m.group(1), len(ins)) < i:
            start = labels[m.group(1)]
            ops = collections.Counter(_opcode(t) for t in ins[start : i + 1])
            loops.append(
                {
                    "instructions": i + 1 - start,
                    "span": [start, i],
                    **{op.lower(): ops.get(op, 0) for op in TELLING if ops.get(op, 0)},
                }
            )
    loops.sort(key=lambda lp: lp["span"][0])
    return {**_resources(cubin), "instructions": len(ins), "loops": loops}


def _block_per_value(loops: list[dict[str, Any]], unroll: int, halves: int) -> dict[str, float]:
    """Instructions a value of the block kernel's tile loop executes, per path of its second read: the loop
    over tiles (the first read, unrolled, and the scales: its instructions outside its inner loops, both
    paths' setup included, over a line's 32 positions) plus the second read's loops of that path (``halves``
    of them, first the path that carries the scales to the bounds, then the reference's; ``unroll`` values a
    thread an iteration)."""
    outer = max(loops, key=lambda lp: lp["instructions"])
    lo, hi = outer["span"]
    inner = [lp for lp in loops if lp is not outer and lo <= lp["span"][0] and lp["span"][1] <= hi]
    straight = (outer["instructions"] - sum(lp["instructions"] for lp in inner)) / 32
    fast, ref = inner[:halves], inner[halves : 2 * halves]
    return {
        "per_value_tile_loop": round(straight, 1),
        "per_value_fast": round(straight + sum(lp["instructions"] for lp in fast) / halves / unroll, 1),
        "per_value_reference": round(straight + sum(lp["instructions"] for lp in ref) / halves / unroll, 1),
    }


def _cubin(kernel: Any) -> bytes:
    compiled = kernel.result() if hasattr(kernel, "result") else kernel
    return bytes(compiled.asm["cubin"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--capability", default="9.0", help="the GPU's compute capability (default 9.0: H100, H200)"
    )
    ap.add_argument("--out", default=None, help="write the JSON here too")
    args = ap.parse_args(argv)
    import triton
    from triton.runtime import driver

    major, minor = (int(v) for v in args.capability.split("."))
    driver.set_active(triton_ahead._TargetDriver((major, minor)))
    cpu = torch.device("cpu")
    out: dict[str, Any] = {
        "triton": triton.__version__,
        "capability": args.capability,
        "rows": [],
        "blocks": [],
        "updates": [],
    }
    # (block, warps, rare after, stages, planes, registers bound): tl.histogram's shapes, then the bit planes'
    # (the default), and the planes under a bound (more programs a multiprocessor: gpu_validate's ROW_SHAPES)
    shapes = (
        (512, 4, True, 1, False, None),
        (512, 4, True, 3, False, None),
        (1024, 4, True, 1, True, None),
        (1024, 4, True, 3, True, None),
        (1024, 4, True, 3, True, 80),
    )
    for block, warps, after, stages, planes, bound in shapes:
        # the row engine's settings, which the record repeats under the same names
        shape = {
            "block": block,
            "num_warps": warps,
            "rare_after": after,
            "stages": stages,
            "planes": planes,
            "max_registers": bound,
        }
        rows = triton_engine.TritonRows(cpu, LAYOUT, **shape)
        for dtype in (torch.float32, torch.bfloat16):
            for many in (False, True):  # one tensor a launch (_rows), or up to 16 (_rows_many)
                variant = triton_engine.Variant(triton_engine.KINDS[dtype][0], False, True, many)
                (kernel,) = rows.warm([dtype], load=False, variants=[variant])
                rec = analyse(_cubin(kernel))
                rec.update(
                    kernel="_rows_many" if many else "_rows",
                    **shape,
                    dtype=str(dtype).removeprefix("torch."),
                    values_per_thread_per_iteration=block // (32 * warps),
                )
                # the main loop: the smallest loop that loads from global memory (the planes' flush is in the
                # loop around it)
                hot = min(
                    (lp for lp in rec["loops"] if lp.get("ldg") or lp.get("ldgsts")),
                    key=lambda lp: lp["instructions"],
                )
                rec["main_loop_per_value"] = round(
                    hot["instructions"] / rec["values_per_thread_per_iteration"], 1
                )
                out["rows"].append(rec)
                print(
                    f"{rec['kernel']} {block}x{warps} stages {stages} {'planes' if planes else 'tl.histogram'} "
                    f"bound {bound} "
                    f"{dtype}: {rec['reg']} registers, loops {[lp['instructions'] for lp in rec['loops']]}, "
                    f"main loop {rec['main_loop_per_value']} a value"
                )
    slots = [triton_block.slot(r) for r in blocks.RECIPES]
    for dtype in (torch.float32, torch.bfloat16):
        code = triton_block.KINDS[dtype][0]
        consts = triton_block._consts(code, 128, slots)
        for bound in dict.fromkeys((triton_block.MAX_REGISTERS, None)):
            options = triton_block._options(bound)
            kernel = triton_block._compile(consts, dtype, cpu, options)[-1]  # (the first: the amax kernel)
            rec = analyse(_cubin(kernel))
            rec.update(
                tile=128,
                dtype=str(dtype).removeprefix("torch."),
                recipes=[r.name for r in blocks.RECIPES],
                max_registers=options.get("maxnreg"),
                **_block_per_value(rec["loops"], consts["UNROLL"], consts["HALVES"]),
            )
            out["blocks"].append(rec)
            print(
                f"blocks {dtype} (registers bound {rec['max_registers']}): {rec['reg']} registers, "
                f"loops {[lp['instructions'] for lp in rec['loops']]}, a value: "
                f"{rec['per_value_fast']} with the scales carried to the bounds, "
                f"{rec['per_value_reference']} as the reference computes"
            )
    # the weight-update samples' two kernels (one program a parameter, its 256 samples one block), per dtype
    for dtype in triton_updates.DTYPES:
        read, classify = triton_updates.compile_kernels(cpu, [dtype])
        for name, kernel in (("_read", read), ("_classify", classify)):
            rec = analyse(_cubin(kernel))
            rec.update(kernel=name, dtype=str(dtype).removeprefix("torch."), block=triton_updates.BLOCK)
            out["updates"].append(rec)
            print(
                f"updates {name} {dtype}: {rec['reg']} registers, {rec['instructions']} instructions, "
                f"loops {[lp['instructions'] for lp in rec['loops']]}"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()

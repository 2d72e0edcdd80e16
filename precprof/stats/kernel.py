"""A one-pass C kernel for the CPU statistics, compiled on first use; None when no C compiler is there.

The torch-op path of ``precprof.stats`` reads each tensor about ten times (widening, shifts, the key
histogram, the extremes). This kernel reads it from memory once, in blocks of 2048 values that stay in L1:

- a few vectorised single-reduction passes over the block give the largest and the smallest nonzero
  magnitude and tell whether the block holds anything rare (|x| >= 256, inf, nan, subnormals, exact powers of
  two in fp32);
- one histogram pass counts the key of every value (2 * fp64 exponent field + mantissa-is-zero, the key of
  the torch path) into four interleaved sub-histograms: for fp32 the exponent field alone when the block
  has nothing rare, for bf16/fp16 a 32768-entry table from the 15-bit magnitude to its key; rare blocks take
  an exact per-element path. A thread's share of 65536 bf16/fp16 values or more is counted by the 15-bit
  magnitude itself (a bin for each, four interleaved, 512 KiB a thread allocated at its first such share and
  kept), without the table read a value; the bins it touched (0, and the smallest nonzero magnitude to the
  largest) become keys through the table at the end: 4.2-5.5 G bf16 values/s instead of 3.0-3.7 on a 2-core
  Xeon (2 threads, 1M-16M values, each tensor read anew; 3.2-3.3 against 2.5-2.6 at 128K);
- the 4096 keys then fold into a statistics row (counts, the 277-bin histogram, fp8 current scaling with the
  exact frexp/ldexp search of ``formats.current_scaling_exponent``) in C, and merge into the buffer row in
  the same call: ``pp_add`` (``pp_call``, the statistics of one tensor into a call row, then ``pp_merge``,
  the call row added into a buffer row and its histogram window; ``pp_add_at`` takes its arguments from the
  context array, one ctypes argument instead of seven); ``pp_add_many`` does it for a list of tensors (a
  sampled step's parameters) in one call. A tensor of fewer than 65536 values is read on the calling thread
  with static per-thread scratch: no allocation per call; one of at most 4096 is counted straight into the
  keys.

Tensors of 65536 values and more are split over OpenMP threads. The kernel links ``libgomp.so.1``; where
torch runs on that same runtime (the PyPI CPU wheels ship ``torch/lib/libgomp.so.1``) the loader reuses it,
so the kernel's parallel regions run on torch's own worker threads, which are spinning, ready, right after
torch's ops. Where the runtime would be a second one, competing with torch's spinning workers for the cores,
the kernel stays on one thread (``shares_torch_threads``; ``PRECPROF_CPU_KERNEL_THREADS`` overrides). Results
are identical to the torch-op path's (tests compare both on hand-built and random tensors, large ones and
several thread counts included); when the compiler or the shared library is missing, ``load()`` returns None
and the torch path runs.

The statistics use no float arithmetic: each value is classified from its bits (fp32, bf16 and fp16 widened to
fp64 bits by integer operations), so the caller's flush-to-zero mode (``torch.set_flush_denormal(True)``: x86's
FTZ and DAZ, which read a subnormal as 0 in a float conversion or compare) changes no count. The block-format and
weight-update what-ifs, float arithmetic by definition, run in IEEE mode, set and restored on every thread that
computes them, OpenMP workers included; the caller's mode is left as it was.

The library is plain C with no torch headers, so it compiles in well under a second with ``cc``; it is
built for this CPU (``-march=native``, falling back to generic code) and cached in the per-user folder of
``precprof.stats.kernel_cache`` (checked before use, built once across processes, never loaded unless this user
built it), keyed by everything the build depends on (``cache_key``). ``Profiler.attach()`` builds or loads
it (through ``precprof.stats``), so no compiler runs inside a training step.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from precprof import formats
from precprof.block_formats import NVFP4_SCALE_MIN, BlockRecipe, ScaleMode, per_recipes, saturation_bound
from precprof.errors import UserError
from precprof.stats import kernel_cache as _kernel_cache

# the C source ships beside this module (package data); read once, it is also part of the cache key
_SOURCE = (Path(__file__).parent / "kernel.c").read_text()

_lib: ctypes.CDLL | None = None
_tried = False
_status: dict[str, object] = {"in_use": False, "reason": "not loaded yet"}


def _cpu_signature() -> str:
    """What identifies this CPU's instruction set (a cached -march=native build must not run elsewhere)."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += line
    except OSError:
        sig += platform.processor()
    return sig


def openmp_runtimes() -> set[str]:
    """Paths of the OpenMP runtimes mapped into this process (Linux; empty where /proc is not there)."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return set()
    return set(re.findall(r"(/\S*lib(?:gomp|iomp5|omp)[-.\w]*\.so[.\d]*)", maps))


def shares_torch_threads(lib: ctypes.CDLL) -> bool:
    """True when the kernel runs its threads in torch's own OpenMP pool.

    The kernel links ``libgomp.so.1``; a torch built with that same runtime (the PyPI CPU wheels ship
    ``torch/lib/libgomp.so.1``) has already loaded it, so the loader reuses it and the kernel's parallel
    regions run on torch's worker threads, which are spinning, ready, right after torch's own ops. With a
    second runtime beside torch's (a renamed bundled copy, Intel's), the kernel's threads would compete with
    torch's spinning workers for the cores, so it stays single-threaded.
    """
    return bool(lib.pp_openmp()) and len(openmp_runtimes()) == 1


_FLAG_SETS: tuple[list[str], ...] = (["-march=native", "-fopenmp"], ["-fopenmp"], ["-march=native"], [])


def _compile(cc: str, src: Path, out: Path) -> None:
    base = [cc, "-O3", "-fPIC", "-shared", "-fno-fast-math", str(src), "-o", str(out), "-lm"]
    # the fastest build this compiler and CPU allow: native instructions, OpenMP; then without each
    for extra in _FLAG_SETS:
        try:
            subprocess.run(base[:2] + extra + base[2:], check=True, capture_output=True, timeout=120)
            return
        except subprocess.SubprocessError:
            continue
    raise subprocess.SubprocessError(f"{cc} could not build the statistics kernel")


def find_compiler() -> str | None:
    """The C compiler the kernel is built with: ``$CC``, else cc, gcc or clang on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _openmp_identity(cc: str) -> str:
    """The OpenMP runtimes ``-fopenmp`` can link (``libgomp.so`` for gcc, ``libomp.so`` for clang) as this
    compiler finds them: resolved path, size and modification time, so that a runtime upgraded under the
    same compiler version changes the key. "-" for one it does not find."""
    found = []
    for name in ("libgomp.so", "libomp.so"):
        try:
            out = subprocess.run(
                [cc, f"-print-file-name={name}"], capture_output=True, text=True, timeout=30, check=False
            ).stdout.strip()
            # a runtime it does not find comes back as the bare name, relative: never looked up here
            path = os.path.realpath(out) if os.path.isabs(out) else None
            st = os.stat(path) if path else None
        except (OSError, subprocess.SubprocessError):
            path, st = None, None
        found.append(f"{path} {st.st_size} {st.st_mtime_ns}" if path and st else "-")
    return " ".join(found)


def cache_key(cc: str) -> str:
    """What the build depends on: the source, the compiler (resolved path and version line), the OpenMP
    runtime it links, the flags and the CPU's instruction set. Nothing of torch: the kernel has no torch
    headers and links no torch library; which OpenMP pool it runs in is decided when it loads
    (``shares_torch_threads``), not when it is built."""
    material = "\0".join(
        [
            _SOURCE,
            _kernel_cache.compiler_identity(cc),
            _openmp_identity(cc),
            repr(_FLAG_SETS),
            _cpu_signature(),
        ]
    )
    return hashlib.sha256(material.encode()).hexdigest()[:20]


def status() -> dict[str, object]:
    """Whether the kernel is in use, and why not: for ``precprof env`` and summary.json. Once ``load()`` tried
    to build, ``cache`` names the per-user folder, and ``cache_refused`` says why it was not used (the
    kernel then lives in a private temporary folder) when it was not."""
    return dict(_status)


def _cache_status() -> dict[str, object]:
    refused = _kernel_cache.refusal()
    return {"cache": str(_kernel_cache.default_dir()), **({"cache_refused": refused} if refused else {})}


def load() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use into the per-user cache (``precprof.stats.kernel_cache``); None
    when it cannot be built or loaded here (``status()`` says why).

    Set ``PRECPROF_CPU_KERNEL=0`` to always use the torch-op path.
    """
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PRECPROF_CPU_KERNEL", "1") == "0":
        _status.update(in_use=False, reason="disabled by PRECPROF_CPU_KERNEL=0")
        return None
    cc = find_compiler()
    if cc is None:
        _status.update(in_use=False, reason="no C compiler (cc, gcc or clang) on the PATH")
        return None

    def compile_to(out: Path) -> None:
        src = out.parent / "stats.c"  # beside the output, in the build's private folder
        src.write_text(_SOURCE)
        _compile(cc, src, out)

    try:
        path = _kernel_cache.build("stats", cache_key(cc), compile_to)
        lib = ctypes.CDLL(str(path))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.pp_init.restype = None
        lib.pp_init.argtypes = []
        lib.pp_call.restype = None
        lib.pp_call.argtypes = [p, i64, i64, i32, i32, p, p]
        lib.pp_merge.restype = i32
        lib.pp_merge.argtypes = [p, p, p, i64, i64, p, p]
        lib.pp_add.restype = i32
        lib.pp_add.argtypes = [p, p, i64, i64, i32, i64, i32]
        lib.pp_add_at.restype = i32
        lib.pp_add_at.argtypes = [p]
        lib.pp_add_many.restype = i64
        lib.pp_add_many.argtypes = [p, i64, p, p, p, p, p, i64, i64]
        lib.pp_openmp.restype = ctypes.c_int
        lib.pp_openmp.argtypes = []
        lib.pp_block.restype = i32
        lib.pp_block.argtypes = [p, i64, i64, i32, i32, i32, p, i32, p]
        lib.pp_block_at.restype = i32
        lib.pp_block_at.argtypes = [p]
        lib.pp_block_many.restype = i64
        lib.pp_block_many.argtypes = [p, i64, p, p, p, p, p]
        lib.pp_upd_gather.restype = i64
        lib.pp_upd_gather.argtypes = [i64, p, p, p, p, p]
        lib.pp_upd_nonzero.restype = i64
        lib.pp_upd_nonzero.argtypes = [i64, p, p, p, p, p]
        lib.pp_upd_classify.restype = i64
        lib.pp_upd_classify.argtypes = [i64, p, p, p, p, p, p, i32, p]
        lib.pp_fpmode.restype = i64
        lib.pp_fpmode.argtypes = []
        lib.pp_init()
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        _status.update(in_use=False, reason=f"could not be built or loaded: {e}", **_cache_status())
        return None
    _status.update(
        in_use=True,
        reason="compiled and loaded",
        path=str(path),
        compiler=cc,
        openmp=bool(lib.pp_openmp()),
        **_cache_status(),
    )
    _lib = lib
    return _lib


# ------------------------------------------------------------------------------------- block formats
# the C kernel's limits for pp_block (kernel.c BT, MAXR, REC_LEN)
BLOCK_TILE = 32
_MAX_RECIPES = 16
_REC_LEN = 10
_BLOCK_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
N_BLOCK_STATS = 5  # flushed, saturated, poisoned, sum_x2, sum_err2 (precprof.tables.BLOCK_STATS)


def _f32_bits(value: float) -> int:
    a = np.array(value, dtype=np.float32)
    assert float(a) == value, f"{value!r} is not an fp32 value"
    return int(a.view(np.uint32))


_RECIPE_CONFIGS: dict[tuple[BlockRecipe, ...], np.ndarray] = {}


def recipe_config(recipes: Sequence[BlockRecipe]) -> np.ndarray:
    """:func:`make_recipe_config`, made once per set of recipes (a sampled step asks for it per tensor)."""
    return _recipe_config(recipes)[0]


def _recipe_config(recipes: Sequence[BlockRecipe]) -> tuple[np.ndarray, int]:
    """The config and its address, found by the identity of ``recipes`` first (``block_formats.per_recipes``),
    by their value else."""

    def compute() -> tuple[np.ndarray, int]:
        key = tuple(recipes)
        cfg = _RECIPE_CONFIGS.get(key)
        if cfg is None:
            cfg = _RECIPE_CONFIGS[key] = make_recipe_config(key)
            cfg.setflags(write=False)
        return cfg, cfg.ctypes.data

    held: tuple[np.ndarray, int] = per_recipes(_RECIPE_BY_ID, recipes, compute)
    return held


_RECIPE_BY_ID: dict[int, tuple[Any, Any]] = {}


def make_recipe_config(recipes: Sequence[BlockRecipe]) -> np.ndarray:
    """The recipes as pp_block reads them: per recipe kind (0 MX floor, 1 MX rceil, 2 NVFP4), the element's
    mantissa bits, smallest normal exponent, largest exponent and max (fp32 bits), then NVFP4's E4M3 block
    scale (mantissa bits, smallest normal exponent, max and the clamp's minimum as fp32 bits), then the element's
    ``block_formats.saturation_bound`` (fp32 bits)."""
    if not 0 < len(recipes) <= _MAX_RECIPES:
        raise UserError(f"the C kernel evaluates 1..{_MAX_RECIPES} block recipes at once, got {len(recipes)}")
    rows = []
    e4m3 = formats.FP8_E4M3
    for r in recipes:
        if BLOCK_TILE % r.block_size:
            raise UserError(
                f"{r.name}: the C kernel reads blocks that divide {BLOCK_TILE}, not {r.block_size}"
            )
        if r.scale_format == "e8m0":
            kind = 1 if r.scale_mode == ScaleMode.RCEIL else 0
            if r.block_size != BLOCK_TILE:
                raise UserError(f"{r.name}: the C kernel's MX blocks are {BLOCK_TILE} long")
        elif r.scale_format == "e4m3" and r.per_tensor_scale and r.block_size == BLOCK_TILE // 2:
            kind = 2
        else:
            raise UserError(f"{r.name}: the C kernel has no rule for this block scale")
        el = r.element
        rows.append(
            [
                kind,
                el.mantissa_bits,
                el.normal_min_exponent,
                el.max_exponent,
                _f32_bits(el.max),
                e4m3.mantissa_bits,
                e4m3.normal_min_exponent,
                _f32_bits(e4m3.max),
                _f32_bits(NVFP4_SCALE_MIN),
                _f32_bits(saturation_bound(el)),
            ]
        )
    return np.array(rows, dtype=np.int64)


def block_stats_2d(
    x: torch.Tensor,
    recipes: Sequence[BlockRecipe],
    orients: int = 3,
    threads: int = 0,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Block statistics of ``x`` viewed as 2-D [prod(leading), last] in the orientations of the bit mask
    ``orients`` (1: "row", blocks along the last dimension; 2: "col", blocks down the columns): a float64
    [2, len(recipes), 5] CPU tensor (flushed, saturated, poisoned, sum_x2, sum_err2; an orientation not asked
    for is NaN). One read of the tensor per orientation, plus one max pass when an NVFP4 recipe is asked for.
    ``threads``: OpenMP threads (0: ``torch.get_num_threads()``). ``into``: a contiguous float64 CPU tensor of
    that shape (a slot of the block accumulator) that the statistics are added into, and returned: each value
    added as ``into += block_stats_2d(...)`` adds it, without the tensor in between. Raises UserError when the
    kernel cannot read ``x`` (not a CPU tensor of fp32, bf16 or fp16, or 0-d) or is not built."""
    lib = load()
    if lib is None:
        raise UserError(f"the C kernel is not available here ({_status['reason']})")
    code = _BLOCK_DTYPES.get(x.dtype)
    if code is None or not x.is_cpu or x.dim() == 0:
        raise UserError(
            f"the C block kernel reads CPU tensors of fp32, bf16 or fp16 with 1 dimension or more, "
            f"got a {x.dim()}-d {x.dtype} tensor on {x.device}"
        )
    _, cfg_ptr = _recipe_config(recipes)
    if into is None:
        out = torch.full((2, len(recipes), N_BLOCK_STATS), math.nan, dtype=torch.float64)
    elif into.is_contiguous() and into.dtype == torch.float64 and into.is_cpu:
        out, orients = into, orients | 4  # bit 4: pp_block adds into out
    else:
        raise ValueError("block_stats_2d adds into a contiguous float64 CPU tensor")
    x = x.detach()
    last = x.shape[-1]
    flat = x.contiguous()
    rows = flat.numel() // last if last else 0
    if flat.numel() == 0:
        if into is None:
            out[[o for o in (0, 1) if orients >> o & 1]] = 0.0
        return out
    rc = lib.pp_block(
        flat.data_ptr(),
        rows,
        last,
        code,
        orients,
        len(recipes),
        cfg_ptr,
        threads or torch.get_num_threads(),
        out.data_ptr(),
    )
    if rc != 0:
        raise MemoryError("precprof: the C block kernel could not allocate its scratch")
    return out


def block_stats_c(
    x: torch.Tensor, recipes: Sequence[BlockRecipe], axis: int, threads: int = 0
) -> torch.Tensor:
    """``block_formats.block_stats`` of every recipe, by the C kernel: float64 [len(recipes), 5] in
    ``tables.BLOCK_STATS`` order (flushed, saturated, poisoned, sum_x2, sum_err2), on the CPU.

    ``axis``: -1 (or the last dimension) for blocks along the last dimension, any ndim; -2 (or 0) of a 2-D
    tensor for blocks down its columns. Counts equal the reference's exactly; the sums are the same terms
    added in another (fixed) order."""
    nd = x.dim()
    if nd >= 1 and axis in (-1, nd - 1):
        return block_stats_2d(x, recipes, 1, threads)[0]
    if nd == 2 and axis in (-2, 0):
        return block_stats_2d(x, recipes, 2, threads)[1]
    raise UserError(
        f"the C block kernel reads the last axis of a tensor or the columns of a 2-D one; got axis {axis} "
        f"of a {nd}-d tensor (reshape it to 2-D first)"
    )

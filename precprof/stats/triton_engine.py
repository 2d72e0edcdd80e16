"""The Triton engine: one tensor's statistics in one read and one launch, on the tensor's own (CUDA) device.

``TritonRows.add`` launches ``triton_kernels._rows`` once per tensor, on the current stream; it never
synchronises with the host. A grid of at most ``max_programs`` programs loops over the tensor in blocks of
``BLOCK`` values, read once in their own dtype (through an integer view: fp32, bf16, fp16, fp8 e4m3fn and
e5m2, fp64; contiguous tensors with vector loads, views of up to three strided dimensions in place). Values
are never converted by float arithmetic (no flush-to-zero can touch a subnormal). Each program:

- histograms the native key (2 * exponent field + (mantissa == 0)) of the values inside its window of 31
  binades (all of fp16's and fp8's; for fp32, bf16 and fp64 the binades around its first block's largest
  value, or over the span of the tensor last read into the row where that fits: the row's hint, left by the
  kernel) in 64 slots, counted in bit planes by each thread (``triton_planes``; or by ``tl.histogram``,
  ``planes=False``), and keeps the largest and smallest of those values per lane (with the planes, of every
  value: a program that met a rare value takes them from its second read, below);
- counts every other value ("rare": subnormals, values outside the window, at or above the layout's overflow
  shortcut, inf, nan) in a slot of their own; a program that met any reads its blocks a second time, and
  only a block holding one gives each its exact fp64 key by a relaxed integer atomic into the scratch (a
  histogram in two levels of 64 slots when it holds many), and makes the overflow compares and extremes for
  them (``RARE_AFTER``: the main loop then carries no rare path);
- adds its window into the scratch (one atomic per nonzero slot), its overflow counts and extremes.

The last program to finish (an atomic counter in the scratch) turns the scratch into the row (the exponent
histogram, zeros, nan, inf, the values on each underflow boundary, the fp8 current-scaling counts of this
tensor from its amax), adds it into ``rows[row]`` with the layout's merge rule (relaxed atomics: the kernel's
end orders them), and zeroes the scratch as it reads it. The scratch is ``SCRATCH_WORDS`` int64 (33 KiB) per
tensor of a launch, whatever the tensor's size. Integer atomics give the same sums in any order, so results are
bitwise deterministic, also under ``torch.use_deterministic_algorithms(True)``.

``TritonRows.add_many`` (a sampled step's parameters, then its gradients) launches ``triton_kernels._rows_many``
for up to ``SLOTS`` (16) contiguous, 16-byte aligned tensors of one dtype: a grid of (programs, tensors), each
column ``_rows``' programs on its tensor, with its own scratch (GPT-2 small's 148 parameters: 10 launches).

Nothing compiles in a hook: ``TritonRows.warm`` compiles, when the rows are made (the Profiler's attach),
every variant ``add`` can launch for the dtypes it is given (``variant`` is the one function both use: the
dtype, contiguous or strided, and for contiguous tensors whether the pointer is 16-byte aligned, which Triton
specialises on); integer arguments are typed int64 and not specialised on their values. Triton keeps what it
compiled in its on-disk cache (``~/.triton/cache``), so a second run loads it in milliseconds.

Cost: the main loop's SASS for sm_90 (bench/kernel_sass.py) is 24-25 instructions per value with the bit
planes by triton 3.6 (torch 2.11's) or 3.9, against 58-60 with ``tl.histogram`` by triton 3.6 (warp votes);
triton 3.9 lowers ``tl.histogram`` to shared-memory atomics, 23-25 (one a value, serialised where a warp's
values share a slot). On an H200 with triton 3.6 and ``tl.histogram``
(bench/results/README_h200_2026-12-04.md) 64M randn values read 1,038 GB/s fp32 and 520 bf16 (30% and 18% of
``x.sum()``: the same values a second, the loop's instructions bound it), and a launch costs the device about
7 us whatever its size; the planes have not run on a GPU yet.
``TRITON_INTERPRET=1`` runs the same kernel on CPU tensors: that is how the suite tests it bit for bit
against the C kernel, the torch-op path and real casts.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from precprof.stats.layout import _N_KEYS, _NO_MIN_BITS, EXP_MAX, EXP_MIN, N_BINS, RowLayout, f64_bits
from precprof.stats.triton_launch import (
    _DirectLaunch,
    adopt_direct,
    direct_status,
    load_kernels,
    register_bound,
)

# dtype -> (kind code, the integer dtype of the same width the kernel reads)
KINDS: dict[torch.dtype, tuple[int, torch.dtype]] = {
    torch.float32: (0, torch.int32),
    torch.bfloat16: (1, torch.int16),
    torch.float16: (2, torch.int16),
    torch.float8_e4m3fn: (3, torch.uint8),
    torch.float8_e5m2: (4, torch.uint8),
    torch.float64: (5, torch.int64),
}
# kind code -> the integer dtype the kernel reads
KIND_INT = {code: int_dtype for code, int_dtype in KINDS.values()}
# per kind: exponent bias and all-ones exponent field of the format the kernel reads natively
_BIAS = {0: 127, 1: 127, 2: 15, 3: 7, 4: 15, 5: 1023}
_FIELD_ALL = {0: 255, 1: 255, 2: 31, 3: 15, 4: 31, 5: 2047}
# values a program reads per iteration, its warps, and the rare values in a second loop over the blocks of a
# program that met any (triton_kernels' RARE_AFTER): the fastest of gpu_validate's row sweep on an H200, on
# data with and without rare values (2026-11-27c), was 512 x 4 with ``tl.histogram``; with the bit planes an
# iteration is two loads of four values a thread (1024 x 4), which their split in registers needs
BLOCK = 1024
NUM_WARPS = 4  # Triton's default
RARE_AFTER = True
# the window's histogram in bit planes (triton_planes) rather than ``tl.histogram`` (which needs BLOCK = 512 to
# read four values a thread): 24 instructions a bf16 value in the main loop's SASS for sm_90 by triton 3.6,
# against 59 (bench/results/kernel_sass_sm90_*.json)
PLANES = True
# the main loop's software pipelining (1: none): 3 stages load two blocks ahead (LDGSTS on sm_90); an H200 read
# 1014 GB/s fp32 and 510 bf16 with 3 against 879 and 442 with none (README_h200_2026-11-27e.md)
STAGES = 3
# scratch: keys[4096], overflow[16], absmax bits, absmin bits, programs finished (triton_kernels' _OV.._DONE)
_OV = _N_KEYS
_MX = _OV + 16
_MN = _MX + 1
_DONE = _MN + 1
SCRATCH_WORDS = _DONE + 1
# tensors a launch of ``_rows_many`` reads (``TritonRows.add_many``), each with its own SCRATCH_WORDS
SLOTS = 16
_GRID_PID = (0, 0)  # ``_rows``' pid and nprog arguments where its own grid gives them (GRID): unread
# the dtypes whose kernels are compiled when no list is given: those of mixed-precision training
DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_state: dict[str, Any] = {}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def device_unsupported(device: torch.device) -> str | None:
    """Why no Triton kernel can run on ``device`` here (the kernels aside); None when one can."""
    if device.type == "cpu" and not interpreting():
        return "Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1)"
    if device.type not in ("cpu", "cuda"):
        return f"Triton does not run on {device.type} tensors"
    return None


def _import_triton() -> None:
    import triton
    import triton.language  # noqa: F401


def triton_missing() -> str | None:
    """Why triton does not import here (with the fix); None when it does.

    Only an ImportError is remembered: another exception (a transient CUDA error, a synchronising call made
    under ``torch.cuda.set_sync_debug_mode("error")``) is reported for this call and the import is tried
    again on the next."""
    if "import" in _state:
        missing: str | None = _state["import"]
        return missing
    try:
        _import_triton()
    except ImportError as e:
        _state["import"] = f"triton does not import ({type(e).__name__}: {e}); pip install triton"
        return str(_state["import"])
    except Exception as e:  # not a missing triton: not cached
        return f"importing triton failed ({type(e).__name__}: {e})"
    _state["import"] = None
    return None


def unavailable(device: torch.device) -> str | None:
    """Why the Triton engine cannot run on ``device`` here; None when it can."""
    why = device_unsupported(device)
    if why is not None:
        return why
    kernels = _kernels()
    if isinstance(kernels, str):
        return kernels
    return None


def _kernels() -> Any:
    """The jitted kernels (contiguous, strided), or why they are not there. Cached only once they are
    defined or triton is known missing (``triton_missing``)."""
    if "kernels" in _state:
        return _state["kernels"]
    missing = triton_missing()
    if missing is not None:
        if "import" in _state:
            _state["kernels"] = missing
        return missing
    _state["kernels"] = _define()
    return _state["kernels"]


def _define() -> tuple[Any, Any, Any]:
    # the one precprof import inside a function (tests/test_architecture.py): the kernels' module imports
    # triton, which takes a second or two, only when the Triton engine runs
    from precprof.stats import triton_kernels

    return triton_kernels._rows, triton_kernels._rows_strided, triton_kernels._rows_many


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dims(x: torch.Tensor) -> tuple[int, list[tuple[int, int]]] | None:
    """The tensor as at most three (size, stride) dimensions, in element units, in an order that reads every
    element once (statistics do not depend on the order); None when it needs more."""
    if x.is_contiguous():  # most tensors: one dimension, without sorting strides in Python (2 us a call)
        return 1, [(x.numel(), 1)]
    dims = sorted(((s, st) for s, st in zip(x.shape, x.stride(), strict=True) if s != 1), key=lambda d: -d[1])
    merged: list[tuple[int, int]] = []
    for s, st in dims:
        if merged and merged[-1][1] == st * s:
            merged[-1] = (merged[-1][0] * s, st)
        else:
            merged.append((s, st))
    if not merged:
        merged = [(1, 1)]
    if len(merged) > 3:
        return None
    return len(merged), merged


def _geometry_of(n: int, ndim: int, dims: list[tuple[int, int]], block: int = BLOCK) -> tuple[int, ...]:
    """(n, full blocks of ``block`` values, size1, size2, stride0, stride1, stride2) from ``_dims``'
    dimensions."""
    (_, st0), (s1, st1), (s2, st2) = dims + [(1, 0)] * (3 - ndim)
    return (n, n // block, s1, s2, st0, st1, st2)


class Variant(NamedTuple):
    """What makes Triton compile a row kernel anew: the dtype's kind, strided or contiguous, and (contiguous
    only) whether the data pointer is 16-byte aligned; ``many``: ``_rows_many`` (contiguous and aligned
    tensors, up to ``SLOTS`` a launch) rather than ``_rows``. Every other argument is a constant of the layout
    or an int64 that is not specialised."""

    kind: int
    strided: bool
    aligned: bool
    many: bool = False


def variant(x: torch.Tensor) -> Variant | None:
    """The variant ``TritonRows.add`` launches for ``x``; None when it takes the torch-op path."""
    kind = KINDS.get(x.dtype)
    shape = _dims(x) if kind is not None else None
    if kind is None or shape is None:
        return None
    ndim, dims = shape
    strided = not (ndim == 1 and dims[0][1] == 1)
    return Variant(kind[0], strided, not strided and x.data_ptr() % 16 == 0)


def variants_of(dtypes: Iterable[torch.dtype]) -> list[Variant]:
    """Every variant ``add`` can launch for tensors of ``dtypes`` (those the engine reads)."""
    out = []
    for dt in dict.fromkeys(dtypes):
        if dt in KINDS:
            code = KINDS[dt][0]
            out += [Variant(code, False, True), Variant(code, False, False), Variant(code, True, False)]
            out.append(Variant(code, False, True, True))
    return out


def _example(v: Variant, device: torch.device) -> torch.Tensor:
    """A small tensor of variant ``v``, integer-viewed as the kernel reads it (a fresh allocation is aligned;
    one element in, it is not; a transposed view is strided)."""
    t = torch.zeros(64, dtype=KIND_INT[v.kind], device=device)
    if v.strided:
        return t.view(8, 8).t()
    return t if v.aligned else t[1:]


def _device_const(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device`` without a host sync (a pinned, asynchronous copy on CUDA;
    ``torch.tensor(..., device="cuda")`` copies from pageable memory, which synchronises)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


class TritonRows:
    """The Triton engine's scratch and launch parameters on one device, for one row layout. Making one
    compiles nothing and never synchronises; ``warm`` compiles."""

    def __init__(
        self,
        device: torch.device,
        layout: RowLayout,
        max_programs: int | None = None,
        block: int = BLOCK,
        num_warps: int = NUM_WARPS,
        rare_after: bool | None = None,
        stages: int | None = None,
        planes: bool | None = None,
        max_registers: int | None = None,
    ) -> None:
        kernels = _kernels()
        if isinstance(kernels, str):
            raise RuntimeError(kernels)
        self._contig, self._strided, self._many = kernels
        if device.type == "cuda" and device.index is None:  # the raw stream and the launch need an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.layout = layout
        # one scratch per tensor of a ``_rows_many`` launch; a one-tensor launch takes the first
        self.scratch = torch.zeros(SLOTS * SCRATCH_WORDS, dtype=torch.int64, device=device)
        self.scratch.view(SLOTS, SCRATCH_WORDS)[:, _MN].fill_(_NO_MIN_BITS)  # a fill kernel: no copy
        self.lo32 = _device_const(list(layout.overflow_f32_lo_bits), device)
        self.lo64 = _device_const(list(layout.overflow_f64_lo_bits), device)
        self.uf = _device_const(list(layout.underflow_exps), device)
        fp8 = [
            v
            for f, j, cap in zip(layout.fp8, layout.fp8_underflow_exps, layout.fp8_exponent_caps, strict=True)
            for v in (f64_bits(f.max), j, cap)
        ]
        self.fp8 = _device_const(fp8 or [0, 0, 0], device)
        # word 0: how many programs read their blocks twice (``rereads``); word 1 + r: row r's hint, the span of
        # the tensor last read into it, from which the next one's window is placed (triton_kernels._window).
        # Grown with the largest rows tensor seen (``_fit_hint``)
        self.hint = torch.zeros(1 + 64, dtype=torch.int32, device=device)
        self._hint_for: torch.Tensor | None = None  # the rows tensor the hint was last checked against
        self._hint_ptr = self.hint.data_ptr()
        # the direct launch passes pointers as integers: Triton's launcher then neither calls data_ptr() nor
        # asks the driver whether each pointer is a device one (cuPointerGetAttribute), six times a launch
        self._ptrs = {
            k: (t.data_ptr(), self.scratch.data_ptr(), self.uf.data_ptr(), self.fp8.data_ptr())
            for k, t in ((5, self.lo64), (0, self.lo32))
        }
        if max_programs is None:
            if device.type == "cuda":
                max_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
            else:
                max_programs = 4  # the interpreter runs programs one after another
        self.max_programs = max_programs
        # values a program reads per iteration, and its warps: the kernel's registers and occupancy follow
        # them (gpu_validate's kernels stage sweeps them on a GPU)
        self.block, self.num_warps = block, num_warps
        self._bound = register_bound(max_registers)  # a thread's registers bound at compile time; {}: none
        # the rare values in a second loop over a program's blocks, only when it met any (triton_kernels)
        self.rare_after = RARE_AFTER if rare_after is None else rare_after
        self.stages = STAGES if stages is None else stages  # the main loop's software pipelining
        # the histogram in bit planes (the default, where the rare values come after: it counts no block's
        # rare values) or by ``tl.histogram``
        self.planes = (PLANES and self.rare_after) if planes is None else planes
        if self.planes and not self.rare_after:
            raise ValueError(
                "TritonRows: planes=True needs rare_after=True (the planes count no block's rare values)"
            )
        if self.planes and (block & (block - 1) or not 8 <= block <= 2048):
            raise ValueError(
                f"TritonRows: planes=True reads blocks of a power of two from 8 to 2048 values, not {block}"
            )
        self._direct: dict[Variant, _DirectLaunch] = {}
        self._pending_compiled: list[tuple[Variant, Any]] = []
        self.direct_status = "not compiled yet"
        lay = layout
        self._common = dict(
            WIDTH=lay.width,
            C_NUMEL=lay.numel,
            C_ZEROS=lay.zeros,
            C_NAN=lay.nan,
            C_INF=lay.inf,
            C_OV=lay.overflow,
            C_MX=lay.absmax_bits,
            C_MN=lay.absmin_bits,
            C_CS=lay.underflow_cs,
            C_POW2=lay.pow2_at,
            C_HIST=lay.hist,
            NW=lay.n_whatif,
            NWP=_pow2(lay.n_whatif),
            NF=lay.n_fp8,
            NFP=_pow2(max(lay.n_fp8, 1)),
            NBINS=N_BINS,
            LO=1023 + EXP_MIN,
            HI=1023 + EXP_MAX,
            BLOCK=block,
            RARE_AFTER=self.rare_after,
            STAGES=self.stages,
            PLANES=self.planes,
        )

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.scratch, self.lo32, self.lo64, self.uf, self.fp8, self.hint)
        )

    def _fit_hint(self, rows: torch.Tensor) -> int:
        """The hint's data pointer, the hint grown (zeroed: no hint yet) to hold a word for every row of
        ``rows``."""
        if rows is not self._hint_for:
            if self.hint.numel() < 1 + rows.shape[0]:
                self.hint = torch.zeros(1 + 2 * rows.shape[0], dtype=torch.int32, device=self.device)
            self._hint_for, self._hint_ptr = rows, self.hint.data_ptr()
        return self._hint_ptr

    def rereads(self) -> int:
        """How many programs have read their blocks twice (met a value outside their window) since this engine
        was made (a sync: for benchmarks and tests)."""
        return int(self.hint[0])

    def _constexprs(self, v: Variant) -> dict[str, Any]:
        se = self.layout.overflow_shortcut_exp
        # native keys from the field of the overflow shortcut up (and inf/nan) are never in the window
        kcap = 2 * min(se + _BIAS[v.kind], _FIELD_ALL[v.kind])
        out = dict(KIND=v.kind, STRIDED=v.strided, KCAP=kcap, BIAS=_BIAS[v.kind], **self._common)
        return out if v.many else {**out, "GRID": True}  # (a launch of ``_rows``' own: pid from its grid)

    def _launch(
        self,
        v: Variant,
        grid: tuple[int, ...],
        xi: Any,
        geometry: Sequence[int],
        rows: Any,
        row: Any,
        warm: bool,
    ) -> Any:
        """Triton's own launch (or with ``warm``, compile) of variant ``v``. ``_rows_many``: ``xi``, ``geometry``
        and ``row`` are lists of up to ``SLOTS`` tensors, sizes and rows (padded here with the first's, never
        read: the grid's second dimension is their count)."""
        lo = self.lo64 if v.kind == 5 else self.lo32
        if v.many:
            pad = SLOTS - len(xi)
            head = (*xi, *[xi[0]] * pad, *geometry, *[0] * pad, *row, *[0] * pad, self.max_programs, rows)
            self._fit_hint(rows)
            args: tuple[Any, ...] = (*head, self.scratch, lo, self.uf, self.fp8, self.hint)
            kernel = self._many
        else:
            self._fit_hint(rows)
            args = (xi, *geometry, rows, row, self.scratch, lo, self.uf, self.fp8, self.hint, *_GRID_PID)
            kernel = self._strided if v.strided else self._contig
        if warm:
            return kernel.run(
                *args, grid=grid, warmup=True, num_warps=self.num_warps, **self._bound, **self._constexprs(v)
            )
        kernel[grid](*args, num_warps=self.num_warps, **self._bound, **self._constexprs(v))
        return None

    def _warm_one(self, v: Variant, rows: torch.Tensor) -> Any:
        """Compile variant ``v`` (without launching) on a small example tensor."""
        x = _example(v, self.device)
        if v.many:
            return self._launch(v, (1, 1), [x], [1], rows, [0], True)
        return self._launch(v, (1,), x, (1, 0, 1, 1, 1, 1, 1), rows, 0, True)

    def warm(
        self,
        dtypes: Iterable[torch.dtype] = DEFAULT_DTYPES,
        *,
        load: bool = True,
        variants: Sequence[Variant] | None = None,
    ) -> list[Any]:
        """Compile (without launching: no GPU work, no sync) every variant ``add`` can launch for tensors of
        ``dtypes`` (or just ``variants``); returns the compiled kernels (Triton's futures under
        :func:`parallel_compile`), loaded onto the device unless ``load=False`` (then :func:`load` them once the
        compiles are done). Nothing to compile in the interpreter. The compiled kernels are kept for ``add``'s
        direct launch."""
        rows = self.layout.empty_rows(1, self.device)
        variants = list(variants) if variants is not None else variants_of(dtypes)
        kernels = [self._warm_one(v, rows) for v in variants]
        self._pending_compiled = list(zip(variants, kernels, strict=True))
        if load:
            load_kernels(kernels)
            self.adopt_compiled()
        return kernels

    def adopt_compiled(self) -> None:
        """Take the kernels ``warm`` compiled (their compiles done) for the direct launch, after checking
        once, on small tensors of each variant, that the direct launch writes the very rows Triton's own
        launch writes (a sync, at attach); a variant that fails the check keeps Triton's launch, and
        ``direct_status`` says why."""
        pending, self._pending_compiled = self._pending_compiled, []
        if interpreting() or self.device.type != "cuda":
            self.direct_status = "Triton's launch (no compiled kernel in the interpreter)"
            return

        def make(v: Variant, kernel: Any) -> _DirectLaunch:
            compiled = kernel.result() if hasattr(kernel, "result") else kernel
            jit = self._many if v.many else self._strided if v.strided else self._contig
            return _DirectLaunch(jit, compiled, self._constexprs(v))

        why = adopt_direct(self._direct, pending, make, self._self_check, "rows differ")
        self.direct_status = direct_status(len(self._direct), "variants", why)

    def _self_check(self, v: Variant, launcher: _DirectLaunch) -> bool:
        """The direct launch and Triton's write the same rows for small tensors of variant ``v`` (three of
        different sizes for ``_rows_many``)."""
        g = torch.Generator(device="cpu").manual_seed(v.kind)
        xs = []
        for n in (64, 700, 3000) if v.many else (0,):
            x = (
                _example(v, self.device)
                if not n
                else torch.empty(n, dtype=KIND_INT[v.kind], device=self.device)
            )
            bits = torch.randint(-(2**15), 2**15, x.shape, generator=g, dtype=torch.int64)
            x.copy_((bits if x.dtype != torch.uint8 else bits % 256).to(x.dtype).to(self.device))
            xs.append(x)
        got = self.layout.empty_rows(len(xs), self.device)
        want = self.layout.empty_rows(len(xs), self.device)
        lo, scratch, uf, fp8 = self._ptrs[5 if v.kind == 5 else 0]
        if v.many:
            ns, at = [x.numel() for x in xs], list(range(len(xs)))
            grid = (max(1, min(self.max_programs, -(-max(ns) // self.block))), len(xs))
            self._launch(v, grid, xs, ns, want, at, False)
            hint = self._fit_hint(got)
            launcher(
                grid[0], self._stream(), self._many_args(xs, ns, got, at, scratch, lo, uf, fp8, hint), len(xs)
            )
        else:
            geometry = self._geometry(xs[0])
            self._launch(v, (1,), xs[0], geometry, want, 0, False)
            hint = self._fit_hint(got)
            args = (xs[0].data_ptr(), *geometry, got.data_ptr(), 0, scratch, lo, uf, fp8, hint, *_GRID_PID)
            launcher(1, self._stream(), args)
        return bool(torch.equal(got, want))

    def _many_args(
        self, xs: Sequence[Any], ns: Sequence[int], rows: torch.Tensor, at: Sequence[int], *tail: int
    ) -> tuple[int, ...]:
        """``_rows_many``'s arguments for a direct launch: ``xs`` (tensors or data pointers) padded to ``SLOTS``
        with the first's, their sizes and rows (zeros past them), then the rows' pointer and ``tail``."""
        ptrs = [x if isinstance(x, int) else x.data_ptr() for x in xs]
        pad = SLOTS - len(ptrs)
        ptrs += [ptrs[0]] * pad
        return (*ptrs, *ns, *[0] * pad, *at, *[0] * pad, self.max_programs, rows.data_ptr(), *tail)

    def _stream(self) -> int:
        return int(torch._C._cuda_getCurrentRawStream(self.device.index))

    def _geometry(self, xi: torch.Tensor) -> tuple[int, ...]:
        """(n, full blocks, size1, size2, stride0, stride1, stride2) of a tensor the kernel reads."""
        shape = _dims(xi)
        assert shape is not None
        return _geometry_of(xi.numel(), *shape, self.block)

    def add(self, x: torch.Tensor, rows: torch.Tensor, row: int, stream: int | None = None) -> bool:
        """Add the statistics of ``x`` into ``rows[row]`` (``rows``: a contiguous [n, layout.width] int64
        tensor on this device): one launch, no sync. False when the dtype or layout is not one this engine
        reads (the caller takes the torch-op path). The launch goes straight to the compiled kernel when
        ``warm`` compiled its variant (``_DirectLaunch``: a few microseconds of host work instead of Triton's
        argument binding and specialisation on every call). ``stream``: the current raw CUDA stream, when the
        caller has just read it."""
        kind = KINDS.get(x.dtype)
        shape = _dims(x) if kind is not None else None
        if kind is None or shape is None:
            return False
        ndim, dims = shape
        ptr = x.data_ptr()  # the integer view's (the kernel reads the bits), without making the view
        strided = not (ndim == 1 and dims[0][1] == 1)
        v = Variant(kind[0], strided, not strided and ptr % 16 == 0)  # what variant(x) says
        geometry = _geometry_of(x.numel(), ndim, dims, self.block)
        programs = max(1, min(self.max_programs, -(-geometry[0] // self.block)))
        direct = self._direct.get(v)
        if direct is not None:
            lo, scratch, uf, fp8 = self._ptrs[5 if v.kind == 5 else 0]
            raw = self._stream() if stream is None else stream
            hint = self._fit_hint(rows)
            direct(
                programs, raw, (ptr, *geometry, rows.data_ptr(), row, scratch, lo, uf, fp8, hint, *_GRID_PID)
            )
            return True
        self._launch(v, (programs,), x.detach().view(kind[1]), geometry, rows, row, False)
        return True

    def add_many(
        self, xs: Sequence[torch.Tensor], rows: torch.Tensor, at: Sequence[int], stream: int | None = None
    ) -> list[int]:
        """Add the statistics of each ``xs[i]`` (none empty) into ``rows[at[i]]``: the contiguous, 16-byte
        aligned tensors of each dtype up to ``SLOTS`` a launch of ``_rows_many`` (by size, so that a launch's
        tensors take about as many programs), the others one ``add`` each. Returns the indices of the tensors
        this engine does not read (the caller's torch-op path). Rows add, so the order does not matter."""
        left: list[int] = []
        by_kind: dict[int, list[tuple[int, int, int, torch.Tensor]]] = {}
        for i, x in enumerate(xs):
            kind = KINDS.get(x.dtype)
            if kind is not None and x.is_contiguous():
                ptr = x.data_ptr()
                if ptr % 16 == 0:
                    by_kind.setdefault(kind[0], []).append((x.numel(), ptr, at[i], x))
                    continue
            if not self.add(x, rows, at[i], stream):
                left.append(i)
        for code, items in by_kind.items():
            items.sort(key=lambda item: item[0])
            for s in range(0, len(items), SLOTS):
                self._add_chunk(Variant(code, False, True, True), items[s : s + SLOTS], rows, stream)
        return left

    def _add_chunk(
        self,
        v: Variant,
        chunk: list[tuple[int, int, int, torch.Tensor]],
        rows: torch.Tensor,
        stream: int | None,
    ) -> None:
        """One launch of ``_rows_many`` for ``chunk``'s (size, pointer, row, tensor), sorted by size."""
        if len(chunk) == 1:
            self.add(chunk[0][3], rows, chunk[0][2], stream)
            return
        ns, at = [c[0] for c in chunk], [c[2] for c in chunk]
        programs = max(1, min(self.max_programs, -(-ns[-1] // self.block)))
        direct = self._direct.get(v)
        if direct is not None:
            lo, scratch, uf, fp8 = self._ptrs[5 if v.kind == 5 else 0]
            raw = self._stream() if stream is None else stream
            hint = self._fit_hint(rows)
            direct(programs, raw, self._many_args([c[1] for c in chunk], ns, rows, at, scratch, lo, uf, fp8, hint),
                   len(chunk))  # fmt: skip
            return
        int_dtype = KIND_INT[v.kind]
        xs = [c[3].detach().view(int_dtype) for c in chunk]
        self._launch(v, (programs, len(chunk)), xs, ns, rows, at, False)

"""The Triton engine: one tensor's statistics in one read, on the tensor's own (CUDA) device.

One launch per tensor, on the current stream, never synchronising with the host: ``_pass``, a grid of at most
``max_programs`` programs, each looping over its share of the tensor in blocks of ``BLOCK`` values, read once
in their own dtype (through an integer view: fp32, bf16, fp16, fp8 e4m3fn and e5m2, fp64; up to three strided
dimensions, so transposed, sliced and expanded views are read in place). Each value's magnitude becomes its
fp32 bit pattern by integer arithmetic only (no float conversion whose handling of subnormals a compiler could
flush), then its key (the fp64 exponent field and whether the mantissa is zero, as in the C kernel and the
torch-op path). A program keeps a private key histogram, the overflow counts per format and its largest and
smallest nonzero finite magnitude in registers, and adds them to the scratch once at the end: one atomic per
nonzero bin per program. Then it counts itself in the scratch's arrival counter; the last program to arrive
(its acquire-release atomic orders every other program's atomics before its reads) turns the scratch into the
row (the exponent histogram, zeros, nan, inf, values on each underflow boundary, the fp8 current-scaling
counts of this call from its amax), adds it into the tensor's row with the layout's merge rule, and zeroes the
scratch and the counter for the next call. (A second one-program kernel did that before: 486 more launches in
a sampled gpt2-small step.)

The scratch is ``SCRATCH_WORDS`` int64 (33 KiB) per device, whatever the tensor's size. Integer atomics give
the same sums in any order, so results are bitwise deterministic, also under
``torch.use_deterministic_algorithms(True)``. ``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors:
that is how the suite tests them bit for bit against the C kernel, the torch-op path and real casts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from precprof.stats.layout import _N_KEYS, _NO_MIN_BITS, EXP_MAX, EXP_MIN, N_BINS, RowLayout, f64_bits

# dtype -> (kind code, the integer dtype of the same width the kernel reads)
KINDS: dict[torch.dtype, tuple[int, torch.dtype]] = {
    torch.float32: (0, torch.int32),
    torch.bfloat16: (1, torch.int16),
    torch.float16: (2, torch.int16),
    torch.float8_e4m3fn: (3, torch.uint8),
    torch.float8_e5m2: (4, torch.uint8),
    torch.float64: (5, torch.int64),
}
BLOCK = 1024
# scratch: keys[4096], overflow[16], absmax bits, absmin bits, the programs that finished their share
_OV = _N_KEYS
_MX = _OV + 16
_MN = _MX + 1
_ARRIVED = _MN + 1
SCRATCH_WORDS = _ARRIVED + 1

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


def triton_missing() -> str | None:
    """Why triton does not import here (with the fix); None when it does. An ImportError is remembered; any
    other failure (a transient one: under ``torch.cuda.set_sync_debug_mode("error")`` importing triton raised
    "called a synchronizing CUDA operation" on an H100) is reported but tried again at the next call, never
    remembered as a missing package."""
    if "import" not in _state:
        try:
            import triton
            import triton.language  # noqa: F401
        except ImportError as e:
            _state["import"] = f"triton does not import ({type(e).__name__}: {e}); pip install triton"
        except Exception as e:  # not a missing package: say so now, try again next time
            return f"triton failed to import ({type(e).__name__}: {e})"
        else:
            _state["import"] = None
    missing: str | None = _state["import"]
    return missing


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
    """The jitted kernels (defined on first use), or why they are not there (a reason that may pass, such as
    a failed import that was no ImportError, is not remembered)."""
    if "kernels" in _state:
        return _state["kernels"]
    missing = triton_missing()
    if missing is not None:
        if _state.get("import") is not None:
            _state["kernels"] = missing
        return missing
    _state["kernels"] = _define()
    return _state["kernels"]


def _define() -> tuple[Any, Any]:
    # the one precprof import inside a function (tests/test_architecture.py): the kernels' module imports
    # triton, which takes a second or two, only when the Triton engine runs
    from precprof.stats import triton_kernels

    return triton_kernels._pass, triton_kernels._pass_any


# A Triton kernel compiles once per specialisation: its constexprs and, for pointers it may specialise on,
# whether the address is a multiple of 16. ``launch_variant`` names the one a tensor's launch uses and
# ``warm`` compiles them all at attach, so nothing compiles inside a hook (an H100's first sampled step
# stalled 18.8 s compiling).
ALIGN = 16


def launch_variant(x: torch.Tensor) -> tuple[str, int, int, bool] | None:
    """(kernel, KIND, NDIM, CONTIG) of the launch that reads ``x``; None when this engine does not read it.
    Contiguous tensors on a 16-byte boundary take ``_pass`` (aligned loads vectorise); every other tensor
    ``_pass_any``, compiled without specialising on the address."""
    kind = KINDS.get(x.dtype)
    shape = _dims(x) if kind is not None else None
    if kind is None or shape is None:
        return None
    ndim, dims = shape
    return _variant(kind[0], ndim, dims[0][1], x.data_ptr())


def _variant(code: int, ndim: int, st0: int, ptr: int) -> tuple[str, int, int, bool]:
    contig = ndim == 1 and st0 == 1
    return ("pass" if contig and ptr % ALIGN == 0 else "pass_any", code, 1 if ndim == 1 else 3, contig)


def variant_probes(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One small tensor per launch variant of ``dtype``: contiguous (on and off a 16-byte boundary), 1-D
    strided, and 2/3-D strided."""
    base = torch.zeros(4096 + 16, dtype=dtype, device=device)
    off = next(i for i in range(1, 17) if base[i:].data_ptr() % ALIGN)
    return [
        base[:2048],
        base[off : off + 2048],
        base[:4096:2],
        base[:512].view(8, 64)[:, :17],  # two dimensions that do not merge
    ]


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dims(x: torch.Tensor) -> tuple[int, list[tuple[int, int]]] | None:
    """The tensor as at most three (size, stride) dimensions, in element units, in an order that reads every
    element once (statistics do not depend on the order); None when it needs more."""
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


class TritonRows:
    """The Triton engine's scratch and launch parameters on one device, for one row layout."""

    def __init__(self, device: torch.device, layout: RowLayout, max_programs: int | None = None) -> None:
        kernels = _kernels()
        if isinstance(kernels, str):
            raise RuntimeError(kernels)
        self._pass, self._pass_any = kernels
        self.device = device
        self.layout = layout
        self.scratch = torch.zeros(SCRATCH_WORDS, dtype=torch.int64, device=device)
        self.scratch[_MN] = _NO_MIN_BITS
        self.lo32 = torch.tensor(layout.overflow_f32_lo_bits, dtype=torch.int64, device=device)
        self.lo64 = torch.tensor(layout.overflow_f64_lo_bits, dtype=torch.int64, device=device)
        self.uf = torch.tensor(layout.underflow_exps, dtype=torch.int64, device=device)
        fp8 = [
            v
            for f, j in zip(layout.fp8, layout.fp8_underflow_exps, strict=True)
            for v in (f64_bits(f.max), j)
        ]
        self.fp8 = torch.tensor(fp8 or [0, 0], dtype=torch.int64, device=device)
        if max_programs is None:
            if device.type == "cuda":
                max_programs = 4 * torch.cuda.get_device_properties(device).multi_processor_count
            else:
                max_programs = 4  # the interpreter runs programs one after another
        self.max_programs = max_programs

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.scratch, self.lo32, self.lo64, self.uf, self.fp8)
        )

    def warm(self, dtypes: Sequence[torch.dtype]) -> set[tuple[str, int, int, bool]]:
        """Compile (or load from Triton's on-disk cache) every launch variant of ``dtypes`` now, at attach:
        one launch of each ``variant_probes`` tensor into a scratch row. Returns the variants compiled."""
        probe = self.layout.empty_rows(2, self.device)
        done: set[tuple[str, int, int, bool]] = set()
        for dtype in dtypes:
            if dtype not in KINDS:
                continue
            for i, x in enumerate(variant_probes(dtype, self.device)):
                v = launch_variant(x)
                if v is not None and v not in done:
                    self.add(x, probe, i % 2)  # both rows: the row pointer's alignment varies too
                    done.add(v)
        return done

    def add(self, x: torch.Tensor, rows: torch.Tensor, row: int) -> bool:
        """Add the statistics of ``x`` into ``rows[row]``. False when the dtype or layout is not one this
        engine reads (the caller takes the torch-op path)."""
        kind = KINDS.get(x.dtype)
        n = x.numel()
        shape = _dims(x) if kind is not None else None
        if kind is None or shape is None:
            return False
        code, int_dtype = kind
        ndim, dims = shape
        variant = _variant(code, ndim, dims[0][1], x.data_ptr())
        kernel = self._pass if variant[0] == "pass" else self._pass_any
        dims = dims + [(1, 0)] * (3 - ndim)
        (_, st0), (s1, st1), (s2, st2) = dims
        lay = self.layout
        programs = max(1, min(self.max_programs, -(-n // BLOCK)))
        iters = -(-n // (programs * BLOCK))
        kernel[(programs,)](
            x.view(int_dtype),
            n,
            iters,
            s1,
            s2,
            st0,
            st1,
            st2,
            self.lo64 if code == 5 else self.lo32,
            self.scratch,
            rows[row],
            self.uf,
            self.fp8,
            KIND=code,
            NDIM=1 if ndim == 1 else 3,
            CONTIG=ndim == 1 and st0 == 1,
            NW=lay.n_whatif,
            NWP=_pow2(lay.n_whatif),
            BLOCK=BLOCK,
            NB=4096 if code == 5 else 1024,
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
            NF=lay.n_fp8,
            NFP=_pow2(max(lay.n_fp8, 1)),
            NBINS=N_BINS,
            LO=1023 + EXP_MIN,
            HI=1023 + EXP_MAX,
        )
        return True

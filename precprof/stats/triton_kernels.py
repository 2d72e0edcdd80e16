"""The Triton kernels of the statistics engine (``precprof.stats.triton_engine`` explains them). Imported only
when the Triton engine is used: this module imports ``triton`` at the top."""

import inspect

import triton
import triton.language as tl

# a pointer whose alignment Triton must not specialise on (the row written by _finish: any row of the buffer),
# where this Triton can be told so (3.2+); elsewhere each alignment compiles once, at the warm-up
_ANY_ALIGNMENT = "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters


@triton.jit
def _f32_to_f64_bits(b):
    # b: fp32 bit pattern of a finite non-negative value (int64); its fp64 bit pattern
    e = b >> 23
    m = b & 0x7FFFFF
    p = ((m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127).to(tl.int64)  # floor(log2 m), m > 0
    normal = ((e + 896) << 52) | (m << 29)
    sub = ((p + 874) << 52) | ((m << (52 - p)) & 0xFFFFFFFFFFFFF)
    return tl.where(b == 0, 0, tl.where(e == 0, sub, normal))


@triton.jit
def _small_to_f32_bits(h, MB: tl.constexpr, BIAS: tl.constexpr, EALL: tl.constexpr, FN: tl.constexpr):
    # h: magnitude bits (sign cleared, int32) of a float with MB mantissa bits and exponent bias BIAS;
    # EALL: its all-ones exponent field; FN: the e4m3fn convention (no inf, only all-ones is nan)
    e = h >> MB
    m = h & ((1 << MB) - 1)
    normal = ((e + (127 - BIAS)) << 23) | (m << (23 - MB))
    p = (m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2 m) for m > 0
    sub = ((p + (128 - BIAS - MB)) << 23) | ((m << (23 - p)) & 0x7FFFFF)
    mag = tl.where(e == 0, tl.where(m == 0, 0, sub), normal)
    if FN:
        mag = tl.where(h == (EALL << MB) | ((1 << MB) - 1), 0x7FC00000, mag)
    else:
        mag = tl.where(e == EALL, 0x7F800000 | (m << (23 - MB)), mag)
    return mag


_INTS = ["n", "iters", "size1", "size2", "st0", "st1", "st2"]


@triton.jit(
    do_not_specialize=_INTS, **({"do_not_specialize_on_alignment": ["row_ptr"]} if _ANY_ALIGNMENT else {})
)
def _pass(
    x_ptr,
    n,
    iters,
    size1,
    size2,
    st0,
    st1,
    st2,
    lo_ptr,
    scratch_ptr,
    row_ptr,
    uf_ptr,
    fp8_ptr,
    KIND: tl.constexpr,
    NDIM: tl.constexpr,
    CONTIG: tl.constexpr,
    NW: tl.constexpr,
    NWP: tl.constexpr,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    C_NUMEL: tl.constexpr,
    C_ZEROS: tl.constexpr,
    C_NAN: tl.constexpr,
    C_INF: tl.constexpr,
    C_OV: tl.constexpr,
    C_MX: tl.constexpr,
    C_MN: tl.constexpr,
    C_CS: tl.constexpr,
    C_POW2: tl.constexpr,
    C_HIST: tl.constexpr,
    NF: tl.constexpr,
    NFP: tl.constexpr,
    NBINS: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wide: tl.constexpr = KIND == 5
    fmt = tl.arange(0, NWP)
    if wide:
        lo = tl.load(lo_ptr + fmt, mask=fmt < NW, other=0x7FFFFFFFFFFFFFFF)
    else:
        lo = tl.load(lo_ptr + fmt, mask=fmt < NW, other=0x7FFFFFFF).to(tl.int32)
    hist = tl.zeros([NB], dtype=tl.int32)
    ov = tl.zeros([NWP], dtype=tl.int32)
    if wide:
        mx = tl.zeros([BLOCK], dtype=tl.int64)
        mn = tl.full([BLOCK], 0x7FFFFFFFFFFFFFFF, dtype=tl.int64)
    else:
        mx = tl.zeros([BLOCK], dtype=tl.int32)
        mn = tl.full([BLOCK], 0x7FFFFFFF, dtype=tl.int32)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    for it in range(0, iters):
        i = (pid + it * nprog).to(tl.int64) * BLOCK + lane
        inside = i < n
        if CONTIG:
            off = i
        elif NDIM == 1:
            off = i * st0
        else:
            inner = size1 * size2
            i0 = i // inner
            r = i - i0 * inner
            i1 = r // size2
            off = i0 * st0 + i1 * st1 + (r - i1 * size2) * st2
        u = tl.load(x_ptr + off, mask=inside, other=0)
        if wide:
            mag = u & 0x7FFFFFFFFFFFFFFF
            key = ((mag >> 52) << 1) | ((mag & 0xFFFFFFFFFFFFF) == 0).to(tl.int64)
            finite = mag < 0x7FF0000000000000
            notnan = mag <= 0x7FF0000000000000
        else:
            if KIND == 0:
                mag = u & 0x7FFFFFFF
            elif KIND == 1:
                mag = (u.to(tl.int32) & 0x7FFF) << 16
            elif KIND == 2:
                mag = _small_to_f32_bits(u.to(tl.int32) & 0x7FFF, 10, 15, 31, False)
            elif KIND == 3:
                mag = _small_to_f32_bits(u.to(tl.int32) & 0x7F, 3, 7, 15, True)
            else:
                mag = _small_to_f32_bits(u.to(tl.int32) & 0x7F, 2, 15, 31, False)
            e32 = mag >> 23
            m32 = mag & 0x7FFFFF
            p = (m32.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
            expo = tl.where(e32 == 0, p - 149, e32 - 127)
            pow2 = tl.where(e32 == 0, (m32 & (m32 - 1)) == 0, m32 == 0).to(tl.int32)
            # compact key: 0 zero, 2 + 2 * (exponent + 149) + pow2 for finite nonzero, 1022 nan, 1023 inf
            key = 2 + 2 * (expo + 149) + pow2
            key = tl.where(mag == 0, 0, tl.where(e32 == 255, tl.where(m32 == 0, 1023, 1022), key))
            finite = mag < 0x7F800000
            notnan = mag <= 0x7F800000
        hist += tl.histogram(key.to(tl.int32), NB, mask=inside)
        over = (mag[:, None] >= lo[None, :]) & (notnan & inside)[:, None]
        ov += tl.sum(over.to(tl.int32), axis=0)
        ok = inside & finite
        mx = tl.maximum(mx, tl.where(ok, mag, 0))
        mn = tl.minimum(mn, tl.where(ok & (mag != 0), mag, mn))
    bins = tl.arange(0, NB)
    if wide:
        full = bins
        amax = tl.max(mx, axis=0)
        amin = tl.min(mn, axis=0)
    else:
        full = tl.where(bins == 0, 1, tl.where(bins >= 1022, bins + 3072, bins + 1746))
        big = tl.max(mx, axis=0).to(tl.int64)
        small = tl.min(mn, axis=0).to(tl.int64)
        amax = _f32_to_f64_bits(big)
        amin = tl.where(small == 0x7FFFFFFF, 0x7FFFFFFFFFFFFFFF, _f32_to_f64_bits(small))
    tl.atomic_add(scratch_ptr + full, hist.to(tl.int64), mask=hist != 0)
    tl.atomic_add(scratch_ptr + 4096 + fmt, ov.to(tl.int64), mask=(fmt < NW) & (ov != 0))
    tl.atomic_max(scratch_ptr + 4112, amax)
    tl.atomic_min(scratch_ptr + 4113, amin)
    # the last program to get here turns the scratch into the row: the counter's atomic (acquire-release, like
    # the ones above) orders every program's scratch atomics before its read, so one launch does the whole call
    arrived = tl.atomic_add(scratch_ptr + 4114, 1)
    if arrived == nprog - 1:
        _finish(
            scratch_ptr,
            row_ptr,
            n,
            uf_ptr,
            fp8_ptr,
            C_NUMEL,
            C_ZEROS,
            C_NAN,
            C_INF,
            C_OV,
            C_MX,
            C_MN,
            C_CS,
            C_POW2,
            C_HIST,
            NW,
            NWP,
            NF,
            NFP,
            NBINS,
            LO,
            HI,
        )


@triton.jit
def _finish(
    scratch_ptr,
    row_ptr,
    n,
    uf_ptr,
    fp8_ptr,
    C_NUMEL: tl.constexpr,
    C_ZEROS: tl.constexpr,
    C_NAN: tl.constexpr,
    C_INF: tl.constexpr,
    C_OV: tl.constexpr,
    C_MX: tl.constexpr,
    C_MN: tl.constexpr,
    C_CS: tl.constexpr,
    C_POW2: tl.constexpr,
    C_HIST: tl.constexpr,
    NW: tl.constexpr,
    NWP: tl.constexpr,
    NF: tl.constexpr,
    NFP: tl.constexpr,
    NBINS: tl.constexpr,
    LO: tl.constexpr,
    HI: tl.constexpr,
):
    # Every update of the row is an atomic with the layout's merge rule (add; max for absmax; min for absmin):
    # Triton replicates small tensors over the program's threads, and a plain load-add-store could then add
    # twice when one warp reads after another wrote.
    # volatile loads: the other programs' atomics are in L2, never in this SM's L1
    idx = tl.arange(0, 4096)
    keys = tl.load(scratch_ptr + idx, volatile=True)
    field = idx >> 1
    fmt = tl.arange(0, NWP)
    wmask = fmt < NW
    ov = tl.load(scratch_ptr + 4096 + fmt, mask=wmask, other=0, volatile=True)
    amax = tl.load(scratch_ptr + 4112, volatile=True)
    amin = tl.load(scratch_ptr + 4113, volatile=True)
    zeros = tl.load(scratch_ptr + 1, volatile=True)
    tl.atomic_add(row_ptr + C_NUMEL, n.to(tl.int64))
    tl.atomic_add(row_ptr + C_ZEROS, zeros)
    tl.atomic_add(row_ptr + C_NAN, tl.load(scratch_ptr + 4094, volatile=True))
    tl.atomic_add(row_ptr + C_INF, tl.load(scratch_ptr + 4095, volatile=True))
    tl.atomic_add(row_ptr + C_OV + fmt, ov, mask=wmask)
    # values exactly on each format's underflow boundary 2^j: key 2 * (j + 1023) + 1
    uf = tl.load(uf_ptr + fmt, mask=wmask, other=0).to(tl.int64)
    tl.atomic_add(
        row_ptr + C_POW2 + fmt,
        tl.load(scratch_ptr + 2 * (uf + 1023) + 1, mask=wmask, other=0, volatile=True),
        mask=wmask,
    )
    tl.atomic_max(row_ptr + C_MX, amax)
    tl.atomic_min(row_ptr + C_MN, tl.where(amin == 0x7FFFFFFFFFFFFFFF, amin, amin - 1))
    # fp8 current scaling of this call: k = floor(log2(fmax / amax)) from the exponents and mantissas of
    # fmax and amax; x * 2^k underflows iff |x| <= 2^(j - k): the finite nonzero keys up to that bound
    if NF > 0:
        f8 = tl.arange(0, NFP)
        fmask = f8 < NF
        fmax = tl.load(fp8_ptr + 2 * f8, mask=fmask, other=0)
        fj = tl.load(fp8_ptr + 2 * f8 + 1, mask=fmask, other=0)
        k = (fmax >> 52) - (amax >> 52) - ((amax & 0xFFFFFFFFFFFFF) > (fmax & 0xFFFFFFFFFFFFF)).to(tl.int64)
        f = fj - k + 1023
        fc = tl.minimum(f, 2047)
        below = tl.sum(tl.where(idx[None, :] < (2 * fc)[:, None], keys[None, :], 0), axis=1) - zeros
        inside = fmask & (f > 0) & (f < 2047)
        on = tl.load(scratch_ptr + 2 * f + 1, mask=inside, other=0, volatile=True)
        cs = tl.where(f <= 0, 0, below + on)
        cs = tl.where(amax > 0, cs, 0)
        tl.atomic_add(row_ptr + C_CS + f8, cs, mask=fmask)
    # the exponent histogram: fp64 exponent fields LO..HI; below LO (and fp64 subnormals) folds into the
    # first bin, above HI into the last
    b = tl.arange(0, 512)
    bmask = b < NBINS
    in_bin = tl.load(scratch_ptr + 2 * (LO + b), mask=bmask, other=0, volatile=True) + tl.load(
        scratch_ptr + 2 * (LO + b) + 1, mask=bmask, other=0, volatile=True
    )
    low = tl.sum(tl.where(field < LO, keys, 0), axis=0) - zeros
    high = tl.sum(tl.where((field > HI) & (field < 2047), keys, 0), axis=0)
    in_bin += tl.where(b == 0, low, 0) + tl.where(b == NBINS - 1, high, 0)
    tl.atomic_add(row_ptr + C_HIST + b, in_bin, mask=bmask & (in_bin != 0))
    # ready for the next call, once every thread of the program has read the scratch
    tl.debug_barrier()
    tl.store(scratch_ptr + idx, tl.zeros([4096], dtype=tl.int64))
    tl.store(scratch_ptr + 4096 + tl.arange(0, 16), tl.zeros([16], dtype=tl.int64))
    tl.store(scratch_ptr + 4112, 0)
    tl.store(scratch_ptr + 4113, 0x7FFFFFFFFFFFFFFF)
    tl.store(scratch_ptr + 4114, 0)  # the arrival counter


# the same pass for the tensors whose address Triton should not specialise on: strided views and contiguous
# ones off a 16-byte boundary (``_pass`` itself keeps the alignment, so aligned contiguous loads vectorise)
_pass_any = triton.jit(
    _pass.fn,
    do_not_specialize=_INTS,
    **({"do_not_specialize_on_alignment": ["x_ptr", "row_ptr"]} if _ANY_ALIGNMENT else {}),
)

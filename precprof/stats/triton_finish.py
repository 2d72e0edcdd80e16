"""The end of the row kernel (``triton_kernels._rows``): the scratch's layout, and ``_finish``, with which the last
program to finish turns the scratch (every program's counts) into the tensor's row."""

import triton
import triton.language as tl

# scratch words (int64): keys[4096] (2 * fp64 field + (mantissa == 0)), overflow[16], largest, smallest, done
_OV = tl.constexpr(4096)
_MX = tl.constexpr(4112)
_MN = tl.constexpr(4113)
_DONE = tl.constexpr(4114)
_NO_MIN = tl.constexpr(0x7FFFFFFFFFFFFFFF)
_M52 = tl.constexpr(0xFFFFFFFFFFFFF)


@triton.jit
def _take(ptr, mask):
    # read and zero scratch words (coherent at L2: integer atomics), 0 where masked
    return tl.where(mask, tl.atomic_xchg(ptr, tl.zeros(ptr.shape, tl.int64), mask=mask, sem="relaxed"), 0)


@triton.jit
def _finish(
    scratch_ptr,
    rp,
    n,
    uf_ptr,
    fp8_ptr,
    hp,
    WIDE: tl.constexpr,
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
    # The scratch (every program's counts) into the row, with the layout's merge rule (add; max for absmax; min
    # for absmin), each update an atomic, relaxed (the row is read after the kernel ends, which orders them; an
    # acq_rel one took a fence, ten in a row). The scratch is zeroed as it is read, for the next tensor. The
    # format tables are loaded first, one load each (one scalar at a time between reductions, they were a chain
    # of round trips: a 768-value tensor's launch took 12.8 us on an H200)
    fmt = tl.arange(0, NWP)
    wmask = fmt < NW
    uf = tl.load(uf_ptr + fmt, mask=wmask, other=0)
    if NF > 0:
        f8 = tl.arange(0, NFP)
        fp8_max = tl.load(fp8_ptr + 3 * f8, mask=f8 < NF, other=0)
        fp8_uf = tl.load(fp8_ptr + 3 * f8 + 1, mask=f8 < NF, other=0)
        fp8_cap = tl.load(fp8_ptr + 3 * f8 + 2, mask=f8 < NF, other=0)
    # the single words in one exchange (fp64 subnormals: key 0, zeros, nan, inf, the largest and smallest)
    w = tl.arange(0, 8)
    at = tl.where(w == 0, 0, tl.where(w == 1, 1, tl.where(w == 2, 4094, tl.where(w == 3, 4095, _MX + w - 4))))
    words = tl.atomic_xchg(
        scratch_ptr + at, tl.where(w == 5, _NO_MIN, 0).to(tl.int64), mask=w < 6, sem="relaxed"
    )
    ov = _take(scratch_ptr + _OV + fmt, wmask)
    # fp64 exponent fields LO .. LO + 511 (fp32's fields are LO..HI), counts with a zero mantissa and all
    f = LO + tl.arange(0, 512)
    fm = f < 2047
    c1 = _take(scratch_ptr + 2 * f + 1, fm)
    cnt = _take(scratch_ptr + 2 * f, fm) + c1
    sub64 = tl.sum(tl.where(w == 0, words, 0))
    zeros = tl.sum(tl.where(w == 1, words, 0))
    nan = tl.sum(tl.where(w == 2, words, 0))
    inf = tl.sum(tl.where(w == 3, words, 0))
    amax = tl.sum(tl.where(w == 4, words, 0))
    amin = tl.sum(tl.where(w == 5, words, 0))
    below_lo = sub64
    if WIDE:  # fp64: the fields below LO and above LO + 511
        fl = 1 + tl.arange(0, 1024)
        flm = fl < LO
        l1 = _take(scratch_ptr + 2 * fl + 1, flm)
        lcnt = _take(scratch_ptr + 2 * fl, flm) + l1
        fh = LO + 512 + tl.arange(0, 1024)
        fhm = fh < 2047
        h1 = _take(scratch_ptr + 2 * fh + 1, fhm)
        hcnt = _take(scratch_ptr + 2 * fh, fhm) + h1
        below_lo += tl.sum(lcnt)
    tl.atomic_add(rp + C_NUMEL, n, sem="relaxed")
    tl.atomic_add(rp + C_ZEROS, zeros, sem="relaxed")
    tl.atomic_add(rp + C_NAN, nan, sem="relaxed")
    tl.atomic_add(rp + C_INF, inf, sem="relaxed")
    tl.atomic_add(rp + C_OV + fmt, ov, mask=wmask, sem="relaxed")
    # values exactly on each format's underflow boundary 2^j: zero mantissa at field j + 1023
    pw = tl.zeros([NWP], tl.int64)
    for j in tl.static_range(NW):
        fj = tl.sum(tl.where(fmt == j, uf, 0)) + 1023
        on = tl.sum(tl.where(f == fj, c1, 0))
        if WIDE:
            on += tl.sum(tl.where(fl == fj, l1, 0)) + tl.sum(tl.where(fh == fj, h1, 0))
        pw += tl.where(fmt == j, on, 0)
    tl.atomic_add(rp + C_POW2 + fmt, pw, mask=wmask, sem="relaxed")
    tl.atomic_max(rp + C_MX, amax, sem="relaxed")
    tl.atomic_min(rp + C_MN, tl.where(amin == _NO_MIN, amin, amin - 1), sem="relaxed")
    # fp8 current scaling of this tensor: k = floor(log2(fmax / amax)) from the exponents and mantissas of
    # fmax and amax; x * 2^k underflows iff |x| <= 2^(j - k): the finite nonzero values below field
    # j - k + 1023, and those exactly on it
    if NF > 0:
        cs = tl.zeros([NFP], tl.int64)
        for i in tl.static_range(NF):
            fmax = tl.sum(tl.where(f8 == i, fp8_max, 0))
            k = (fmax >> 52) - (amax >> 52) - ((amax & _M52) > (fmax & _M52)).to(tl.int64)
            k = tl.minimum(k, tl.sum(tl.where(f8 == i, fp8_cap, 0)))  # torchao's amax floor caps the scale
            ff = tl.sum(tl.where(f8 == i, fp8_uf, 0)) - k + 1023
            below = sub64 + tl.sum(tl.where(f < ff, cnt, 0))
            on = tl.sum(tl.where(f == ff, c1, 0))
            if WIDE:
                below += tl.sum(tl.where(fl < ff, lcnt, 0)) + tl.sum(tl.where(fh < ff, hcnt, 0))
                on += tl.sum(tl.where(fl == ff, l1, 0)) + tl.sum(tl.where(fh == ff, h1, 0))
            v = tl.where(ff <= 0, 0, below + on)
            cs += tl.where(f8 == i, tl.where(amax > 0, v, 0), 0)
        tl.atomic_add(rp + C_CS + f8, cs, mask=f8 < NF, sem="relaxed")
    # the exponent histogram: bin b is field LO + b; below LO (and fp64 subnormals) folds into bin 0, above HI
    # into the last
    b = tl.arange(0, 512)
    high = tl.sum(tl.where(f > HI, cnt, 0))
    if WIDE:
        high += tl.sum(hcnt)
    hist = tl.where(b < NBINS, cnt, 0) + tl.where(b == 0, below_lo, 0) + tl.where(b == NBINS - 1, high, 0)
    tl.atomic_add(rp + C_HIST + b, hist, mask=(b < NBINS) & (hist != 0), sem="relaxed")
    # the row's hint for its next tensor (``_window``): the fp64 fields of this one's largest and smallest finite
    # nonzero magnitudes, (hi << 16) | lo; 0 where it has none, or has values below LO (the smallest not known)
    lo_f = tl.min(tl.where(cnt > 0, f, 4096))
    hint = tl.where((amax > 0) & (lo_f < 4096) & (below_lo == 0), ((amax >> 52) << 16) | lo_f, 0)
    tl.store(hp, hint.to(tl.int32))

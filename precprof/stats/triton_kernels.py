"""The Triton kernels of the statistics engine (``precprof.stats.triton_engine`` explains them). Imported only
when the Triton engine is used: this module imports ``triton`` at the top.

``_rows`` reads one tensor once, and its last program to finish writes the row; ``_rows_many`` does the same
for up to 16 contiguous tensors of one dtype in one launch (a sampled step's parameters, then its gradients).

The window's histogram is counted in bit planes (``triton_planes``, ``PLANES``: no vote, atomic or barrier a
value) or by ``tl.histogram``. Instructions per value in the main loop (its SASS for sm_90,
bench/kernel_sass.py): with the planes 24-25 by triton 3.6 (bf16 and fp32), plus about 820 a program for
each flush; with ``tl.histogram`` 58-60 by triton 3.6 (warp votes, whose count grows with the slots: 64 here)
and 23-25 by triton 3.9 (one shared-memory atomic a value). ``RARE_AFTER`` keeps the rare path (and its large
histogram, which held the registers: 255 a thread with spills in one loop) out of the main loop, in a second
loop over the program's blocks run only when it met a rare value; ``_window`` places a program's window where
the row's last tensor lay, so that fewer programs meet one. ``TritonRows(block=, num_warps=, rare_after=,
planes=)`` and gpu_validate's ``row_shapes`` measure the alternatives.
"""

import triton
import triton.language as tl

from precprof.stats.triton_finish import _DONE, _M52, _MN, _MX, _NO_MIN, _OV, _finish
from precprof.stats.triton_planes import F as PLANE_ITERS
from precprof.stats.triton_planes import add8, counts, flush

# the window: 64 histogram slots, slots 0..61 31 binades (with mantissa == 0), slot 62 zero, slot 63 "rare"
_WIN = tl.constexpr(64)
_ZERO = tl.constexpr(62)
_RARE = tl.constexpr(63)


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


@triton.jit
def _native(u, KIND: tl.constexpr):
    # the magnitude's bits in the input's own format (int32; int64 for fp64), its exponent field, mantissa == 0
    if KIND == 0:
        mag = u & 0x7FFFFFFF
        fld = mag >> 23
        mz = (mag & 0x7FFFFF) == 0
    elif KIND == 1:
        mag = u.to(tl.int32) & 0x7FFF
        fld = mag >> 7
        mz = (mag & 0x7F) == 0
    elif KIND == 2:
        mag = u.to(tl.int32) & 0x7FFF
        fld = mag >> 10
        mz = (mag & 0x3FF) == 0
    elif KIND == 3:
        mag = u.to(tl.int32) & 0x7F
        fld = mag >> 3
        mz = (mag & 0x7) == 0
    elif KIND == 4:
        mag = u.to(tl.int32) & 0x7F
        fld = mag >> 2
        mz = (mag & 0x3) == 0
    else:
        mag = u & 0x7FFFFFFFFFFFFFFF
        fld = (mag >> 52).to(tl.int32)
        mz = (mag & _M52) == 0
    return mag, fld, mz


@triton.jit
def _f32_of(mag, KIND: tl.constexpr):
    # fp32 bits of a native magnitude (KIND 0..4), by integer arithmetic only
    if KIND == 0:
        b = mag
    elif KIND == 1:
        b = mag << 16
    elif KIND == 2:
        b = _small_to_f32_bits(mag, 10, 15, 31, False)
    elif KIND == 3:
        b = _small_to_f32_bits(mag, 3, 7, 15, True)
    else:
        b = _small_to_f32_bits(mag, 2, 15, 31, False)
    return b


@triton.jit
def _key_of_f32(b):
    # the fp64 key (2 * fp64 exponent field + (mantissa == 0)) of an fp32 magnitude's bits, subnormals exact
    e32 = b >> 23
    m = b & 0x7FFFFF
    p = (m.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    expo = tl.where(e32 == 0, p - 149, e32 - 127)
    pow2 = tl.where(e32 == 0, (m & (m - 1)) == 0, m == 0).to(tl.int32)
    key = 2 * (expo + 1023) + pow2
    return tl.where(b == 0, 1, tl.where(e32 == 255, tl.where(m == 0, 4095, 4094), key))


@triton.jit
def _offsets(i, size1, size2, st0, st1, st2, STRIDED: tl.constexpr):
    # element offsets of flat indices i in a view of up to three (size, stride) dimensions
    if STRIDED:
        inner = size1 * size2
        i0 = i // inner
        r = i - i0 * inner
        i1 = r // size2
        off = i0 * st0 + i1 * st1 + (r - i1 * size2) * st2
    else:
        off = i
    return off


@triton.jit
def _window_key(u, base, lim, KIND: tl.constexpr):
    # Every value's native key kn = 2 * exponent field + (mantissa == 0), and its slot: those in the program's
    # window (kn - base in 0 .. lim - 1: ``_limit``) take kn - base, zeros _ZERO, the rest _RARE (subnormals,
    # values below or above the window, at or above the overflow shortcut, inf, nan). One unsigned compare
    mag, fld, mz = _native(u, KIND)
    kn = 2 * fld + mz.to(tl.int32)
    w = kn - base
    key = tl.where(w.to(tl.uint32, bitcast=True) < lim, w, _RARE - (mag == 0).to(tl.int32))
    return mag, kn, key


@triton.jit
def _limit(base, KCAP: tl.constexpr):
    # the window's slots (from native key base) below the overflow shortcut KCAP (a native key), at most 62
    return tl.minimum(tl.maximum(KCAP - base, 0), _ZERO).to(tl.uint32)


@triton.jit
def _window(top, hint, KCAP: tl.constexpr, BIAS: tl.constexpr):
    # The window's top binade (native field; the window holds top - 28 .. top + 2): from the program's first
    # block (``top``), a program whose later blocks go past it reads all its blocks again (97% of an LLM's logits
    # gradient, whose targets' -1/N sit 16 binades above the rest). From the span of the tensor last read into
    # the row (``hint``, from ``_finish``): centred on it, or where it is wider, from its largest value down
    # (only the smallest values' tail is then outside). Counts are exact whichever window
    hi = (hint >> 16) - 1023 + BIAS
    lo = (hint & 0xFFFF) - 1023 + BIAS
    hi = tl.minimum(hi, KCAP // 2 - 1)
    return tl.where((hint != 0) & (lo >= 1), tl.where(hi - lo <= 28, (hi + lo + 26) // 2, hi), top)


@triton.jit
def _block(u, inside, base, lim, acc, mx, mn, KIND: tl.constexpr, MASKED: tl.constexpr):
    # One block of values (``PLANES`` off): the window's slots into a 64-slot tl.histogram, the finite extremes
    # of the values in the window; the block's histogram (slot _RARE: its rare values) for _rare
    mag, kn, key = _window_key(u, base, lim, KIND)
    if MASKED:  # noqa: SIM108 (a constexpr branch of the kernel)
        h = tl.histogram(key, _WIN, mask=inside)
    else:
        h = tl.histogram(key, _WIN)
    acc += h
    fast = key < _ZERO
    mx = tl.maximum(mx, tl.where(fast, mag, 0))
    mn = tl.minimum(mn, tl.where(fast, mag, mn))
    return acc, mx, mn, h, mag, kn, key


@triton.jit
def _halves(x_ptr, i, n, size1, size2, st0, st1, st2, base, lim, KIND: tl.constexpr, STRIDED: tl.constexpr,
            H: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    # one iteration's two loads of H values (i: the first's indices), their magnitudes and slots
    if MASKED:
        ia = i < n
        ib = i + H < n
        ua = tl.load(x_ptr + _offsets(i, size1, size2, st0, st1, st2, STRIDED), mask=ia, other=0)
        ub = tl.load(x_ptr + _offsets(i + H, size1, size2, st0, st1, st2, STRIDED), mask=ib, other=0)
    else:
        ia = i >= 0
        ib = ia
        ua = tl.load(x_ptr + _offsets(i, size1, size2, st0, st1, st2, STRIDED))
        ub = tl.load(x_ptr + _offsets(i + H, size1, size2, st0, st1, st2, STRIDED))
    ma, _ka, ka = _window_key(ua, base, lim, KIND)
    mb, _kb, kb = _window_key(ub, base, lim, KIND)
    return ma, ka, ia, mb, kb, ib


@triton.jit
def _extremes(ma, mb, mx, mn, U: tl.constexpr):
    # the largest magnitude, and the smallest nonzero one as (magnitude - 1) unsigned: zeros wrap to the top
    mx = tl.maximum(mx, tl.maximum(ma, mb))
    mn = tl.minimum(mn, tl.minimum((ma - 1).to(U, bitcast=True), (mb - 1).to(U, bitcast=True)))
    return mx, mn


@triton.jit
def _sweep(x_ptr, n, nfull, size1, size2, st0, st1, st2, base, lim, pid, nprog, last, KIND: tl.constexpr,
           STRIDED: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    # The main loop with ``PLANES``: the window's histogram in bit planes (triton_planes: no tl.histogram),
    # each iteration's BLOCK values in two loads of BLOCK // 2, the planes flushed every PLANE_ITERS
    # iterations (the first chunk holds the last, partial block too). The 64 slots' counts, and the extremes
    # of every value read: those of the window's when the program met no rare value (slot _RARE), else
    # ``_rows`` reads them again
    H: tl.constexpr = BLOCK // 2
    T: tl.constexpr = BLOCK // 8
    tl.static_assert(BLOCK <= 2048)  # (a flush's sums over the program's lanes in 16-bit fields)
    half = tl.arange(0, H).to(tl.int64)
    z = tl.zeros([T], tl.int64)
    lo = tl.zeros([16], tl.int64)
    hi = lo
    S: tl.constexpr = tl.int64 if KIND == 5 else tl.int32
    U: tl.constexpr = tl.uint64 if KIND == 5 else tl.uint32
    mx = tl.zeros([H], dtype=S)
    mn = tl.full([H], -1, dtype=S).to(U, bitcast=True)
    p0, p1, p2, p3, p4, p5, p6, p7 = z, z, z, z, z, z, z, z
    # the last, partial block first, into the first chunk's planes (lanes past the end read 0: no count, and
    # neither extreme moves)
    if last:
        ma, ka, ia, mb, kb, ib = _halves(
            x_ptr, nfull * BLOCK + half, n, size1, size2, st0, st1, st2, base, lim, KIND, STRIDED, H, True
        )
        mx, mn = _extremes(ma, mb, mx, mn, U)
        p0, p1, p2, p3, p4, p5, p6, p7 = add8(ka, kb, ia, ib, z, z, z, z, z, z, z, z, T, True)
    # chunks of PLANE_ITERS iterations, each flushed; at least one (a program with no full block flushes its
    # partial one): the flush's code once
    step = nprog * PLANE_ITERS
    for c in range(pid, tl.maximum(nfull, pid + 1), step):
        # STAGES > 1: Triton pipelines the loop's loads (asynchronous copies into shared memory, STAGES - 1
        # iterations ahead), so that a program has more than one iteration's values in flight
        for blk in tl.range(c, tl.minimum(c + step, nfull), nprog, num_stages=STAGES):
            ma, ka, ia, mb, kb, ib = _halves(
                x_ptr, blk * BLOCK + half, n, size1, size2, st0, st1, st2, base, lim, KIND, STRIDED, H, False
            )
            mx, mn = _extremes(ma, mb, mx, mn, U)
            p0, p1, p2, p3, p4, p5, p6, p7 = add8(ka, kb, ia, ib, p0, p1, p2, p3, p4, p5, p6, p7, T, False)
        lo, hi = flush(p0, p1, p2, p3, p4, p5, p6, p7, lo, hi)
        p0, p1, p2, p3, p4, p5, p6, p7 = z, z, z, z, z, z, z, z
    small = (tl.min(mn, axis=0) + 1).to(mx.dtype, bitcast=True)  # 0: no nonzero value
    return counts(lo, hi), tl.max(mx, axis=0), small


@triton.jit
def _rare(
    rare,
    mag,
    kn,
    key,
    mx,
    mn,
    ov,
    scratch_ptr,
    lo_ptr,
    KIND: tl.constexpr,
    NW: tl.constexpr,
    NWP: tl.constexpr,
    MANY: tl.constexpr,
):
    # A block's rare values (``rare`` of them; nothing when none): each gets its exact fp64 key by one relaxed
    # integer atomic into the scratch, and the overflow compares and finite extremes are made for them
    if rare > 0:
        r = key == _RARE  # lanes outside the tensor read 0: key _ZERO
        if KIND == 5:
            big = mag
            key64 = kn
            finite = mag < 0x7FF0000000000000
            notnan = mag <= 0x7FF0000000000000
        else:
            big = _f32_of(mag, KIND)
            key64 = _key_of_f32(big)
            finite = big < 0x7F800000
            notnan = big <= 0x7F800000
        if rare > MANY:
            # many rare values (an all-nan tensor, values far past the window): a histogram of their keys
            # (fp32's compact: 2 * fp64 field + (mantissa == 0) from fp32's smallest subnormal up, then nan
            # and inf), one atomic per nonzero key, so that no address takes one atomic per value. In two levels
            # of 64 slots (which groups of 64 keys the block holds, then each of those): one histogram of 1,024
            # or 4,096 slots held the kernel's registers (1024 x 4, triton 3.6, sm_90: 214 a thread, now 162)
            NGROUP: tl.constexpr = 64 if KIND == 5 else 16
            if KIND == 5:  # noqa: SIM108 (a constexpr branch of the kernel)
                compact = key64
            else:
                compact = tl.where(key64 >= 4094, key64 - 3072, key64 - 1748)
            group = compact >> 6
            groups = tl.histogram(group, NGROUP, mask=r)
            gslot = tl.arange(0, NGROUP)
            idx = tl.arange(0, 64)
            for g in range(0, NGROUP):
                if tl.sum(tl.where(gslot == g, groups, 0)) > 0:
                    hr = tl.histogram(compact & 63, 64, mask=r & (group == g))
                    k = g * 64 + idx
                    if KIND != 5:
                        k = tl.where(k >= 1022, k + 3072, k + 1748)
                    tl.atomic_add(scratch_ptr + k, hr.to(tl.int64), mask=hr != 0, sem="relaxed")
        else:
            tl.atomic_add(scratch_ptr + key64, tl.full(key64.shape, 1, tl.int64), mask=r, sem="relaxed")
        fmt = tl.arange(0, NWP)
        for j in tl.static_range(NW):
            lo = tl.load(lo_ptr + j)
            ov += tl.where(fmt == j, tl.sum((r & notnan & (big >= lo)).to(tl.int32)), 0)
        ok = r & finite
        mx = tl.maximum(mx, tl.where(ok, mag, 0))
        mn = tl.minimum(mn, tl.where(ok, mag, mn))
    return mx, mn, ov


@triton.jit
def _again(u, base, lim, mx, mn, ov, scratch_ptr, lo_ptr, KIND: tl.constexpr, NW: tl.constexpr, NWP: tl.constexpr,
           MANY: tl.constexpr):  # fmt: skip
    # the second read of a program that met rare values: the extremes of the window's values, and _rare's work
    mag, kn, key = _window_key(u, base, lim, KIND)
    mx = tl.maximum(mx, tl.where(key < _ZERO, mag, 0))
    mn = tl.minimum(mn, tl.where(key < _ZERO, mag, mn))
    rare = tl.sum((key == _RARE).to(tl.int32))
    return _rare(rare, mag, kn, key, mx, mn, ov, scratch_ptr, lo_ptr, KIND, NW, NWP, MANY)


# how the kernels are jitted (tests rebuild them with these to read Triton's own specialisation keys): the
# integers are typed int64 and not specialised on their values; the strided variant's pointer is not
# specialised on its alignment either (its gathers gain nothing from it)
JIT_KW: dict = {
    "do_not_specialize": ["n", "nfull", "size1", "size2", "st0", "st1", "st2", "row", "pid", "nprog"]
}
JIT_KW_STRIDED: dict = {**JIT_KW, "do_not_specialize_on_alignment": ["x_ptr"]}


@triton.jit(**JIT_KW)
def _rows(
    x_ptr,
    n: tl.int64,
    nfull: tl.int64,
    size1: tl.int64,
    size2: tl.int64,
    st0: tl.int64,
    st1: tl.int64,
    st2: tl.int64,
    rows_ptr,
    row: tl.int64,
    scratch_ptr,
    lo_ptr,
    uf_ptr,
    fp8_ptr,
    hint_ptr,
    pid: tl.int64,
    nprog: tl.int64,
    KIND: tl.constexpr,
    STRIDED: tl.constexpr,
    KCAP: tl.constexpr,
    BIAS: tl.constexpr,
    WIDTH: tl.constexpr,
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
    BLOCK: tl.constexpr,
    RARE_AFTER: tl.constexpr,
    STAGES: tl.constexpr,
    PLANES: tl.constexpr,
    GRID: tl.constexpr,
):
    # One tensor's statistics by program ``pid`` of the ``nprog`` that read it, into ``row``. GRID: a launch of
    # its own (one tensor), whose grid gives ``pid`` and ``nprog`` (passed as 0); else inlined in
    # ``_rows_many``, which gives them
    if GRID:
        pid = tl.program_id(0).to(tl.int64)
        nprog = tl.num_programs(0).to(tl.int64)
    MANY: tl.constexpr = BLOCK // 64
    lane = tl.arange(0, BLOCK).to(tl.int64)
    wide: tl.constexpr = KIND == 5
    NONE: tl.constexpr = 0x7FFFFFFFFFFFFFFF if wide else 0x7FFFFFFF  # no smallest value (native bits)
    tl.static_assert(RARE_AFTER or not PLANES)  # (the planes give no block's rare count)
    ov = tl.zeros([NWP], dtype=tl.int32)
    # The window of binades this program histograms: fp16 and fp8 have few enough to hold them all; fp32,
    # bf16 and fp64 place 31 binades around the largest value below the shortcut in the program's first
    # block (two binades of room above it), or around 1 when that block holds none.
    if (KIND == 0) | (KIND == 1) | (KIND == 5):
        i0 = pid * BLOCK + lane
        u0 = tl.load(x_ptr + _offsets(i0, size1, size2, st0, st1, st2, STRIDED), mask=i0 < n, other=0)
        m0, f0, _z = _native(u0, KIND)
        top = tl.max(tl.where((2 * f0 < KCAP) & (m0 != 0), f0, 0), axis=0)
        top = tl.where(top == 0, BIAS, top)
        top = _window(top, tl.load(hint_ptr + 1 + row), KCAP, BIAS)
        base = tl.maximum(2 * top - 58, 0) + 2  # the native key of slot 0
    else:
        base = pid.to(tl.int32) * 0 + 2  # (keys 0 and 1: subnormals and zeros)
    lim = _limit(base, KCAP)
    slot = tl.arange(0, _WIN)
    last = pid == nfull % nprog
    if PLANES:
        acc, big, small = _sweep(
            x_ptr,
            n,
            nfull,
            size1,
            size2,
            st0,
            st1,
            st2,
            base,
            lim,
            pid,
            nprog,
            last,
            KIND,
            STRIDED,
            BLOCK,
            STAGES,
        )
        small = tl.where(small == 0, NONE, small)
    else:
        mx = tl.zeros([BLOCK], dtype=tl.int64 if wide else tl.int32)
        mn = tl.full([BLOCK], NONE, dtype=tl.int64 if wide else tl.int32)
        acc = tl.zeros([_WIN], dtype=tl.int32)
        for blk in tl.range(pid, nfull, nprog, num_stages=STAGES):  # (STAGES: as in _sweep)
            i = blk * BLOCK + lane
            u = tl.load(x_ptr + _offsets(i, size1, size2, st0, st1, st2, STRIDED))
            acc, mx, mn, h, mag, kn, key = _block(u, lane >= 0, base, lim, acc, mx, mn, KIND, False)
            if not RARE_AFTER:
                rare = tl.sum(tl.where(slot == _RARE, h, 0))
                mx, mn, ov = _rare(rare, mag, kn, key, mx, mn, ov, scratch_ptr, lo_ptr, KIND, NW, NWP, MANY)
        if last:  # the last, partial block
            i = nfull * BLOCK + lane
            inside = i < n
            u = tl.load(x_ptr + _offsets(i, size1, size2, st0, st1, st2, STRIDED), mask=inside, other=0)
            acc, mx, mn, h, mag, kn, key = _block(u, inside, base, lim, acc, mx, mn, KIND, True)
            if not RARE_AFTER:
                rare = tl.sum(tl.where(slot == _RARE, h, 0))
                mx, mn, ov = _rare(rare, mag, kn, key, mx, mn, ov, scratch_ptr, lo_ptr, KIND, NW, NWP, MANY)
        big = tl.max(mx, axis=0)
        small = tl.min(mn, axis=0)
    if RARE_AFTER:  # noqa: SIM102 (a constexpr branch, then a runtime one)
        # The loop above only counted the rare values (slot _RARE). When this program met any, it reads its
        # blocks again and makes their exact keys, overflow compares and the finite extremes of all its values:
        # the main loop carries no rare path, so it holds fewer registers and no per-block reduction
        if tl.sum(tl.where(slot == _RARE, acc, 0)) > 0:
            tl.atomic_add(hint_ptr, 1, sem="relaxed")  # programs that read their blocks twice (word 0)
            # in parts of at most 512 values (the rare path's registers, as with tl.histogram's BLOCK)
            R: tl.constexpr = BLOCK if BLOCK <= 512 else 512
            part = tl.arange(0, R).to(tl.int64)
            mx = tl.zeros([R], dtype=tl.int64 if wide else tl.int32)
            mn = tl.full([R], NONE, dtype=tl.int64 if wide else tl.int32)
            # every block of the program's, the last program's partial one included (its lanes past the end
            # read 0: no rare value, no extreme), in one loop of masked loads: the rare path's code once
            for blk in range(pid, nfull + 1, nprog):
                for j in range(BLOCK // R):
                    i = blk * BLOCK + j * R + part
                    u = tl.load(
                        x_ptr + _offsets(i, size1, size2, st0, st1, st2, STRIDED), mask=i < n, other=0
                    )
                    mx, mn, ov = _again(u, base, lim, mx, mn, ov, scratch_ptr, lo_ptr, KIND, NW, NWP, R // 64)
            big = tl.max(mx, axis=0)
            small = tl.min(mn, axis=0)
    # this program's window into the scratch: one atomic per nonzero slot
    s = tl.arange(0, _WIN)
    kn = s + base
    key64 = tl.where(s == _ZERO, 1, 2 * ((kn >> 1) - BIAS + 1023) + (kn & 1))
    tl.atomic_add(scratch_ptr + key64, acc.to(tl.int64), mask=(s != _RARE) & (acc != 0), sem="relaxed")
    fmt = tl.arange(0, NWP)
    tl.atomic_add(scratch_ptr + _OV + fmt, ov.to(tl.int64), mask=(fmt < NW) & (ov != 0), sem="relaxed")
    if wide:
        amax = big
        amin = small
    else:
        amax = _f32_to_f64_bits(_f32_of(big, KIND).to(tl.int64))
        amin = tl.where(small == 0x7FFFFFFF, _NO_MIN, _f32_to_f64_bits(_f32_of(small, KIND).to(tl.int64)))
    tl.atomic_max(scratch_ptr + _MX, amax, sem="relaxed")
    tl.atomic_min(scratch_ptr + _MN, amin, sem="relaxed")
    # The last program to finish (an acq_rel counter after a barrier: every thread's atomics are ordered
    # before it) writes the row: no second launch.
    tl.debug_barrier()
    done = tl.atomic_add(scratch_ptr + _DONE, 1, sem="acq_rel")
    if done == nprog - 1:
        _finish(
            scratch_ptr,
            rows_ptr + row * WIDTH,
            n,
            uf_ptr,
            fp8_ptr,
            hint_ptr + 1 + row,
            wide,
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
        tl.atomic_xchg(scratch_ptr + _DONE, 0, sem="relaxed")


# the tensors one launch of ``_rows_many`` reads (each its own pointer, size and row argument)
SLOTS = 16
# scratch words per tensor (triton_engine's SCRATCH_WORDS): ``_rows_many``'s slot t has its own
_SCRATCH = tl.constexpr(4115)


@triton.jit
def _pick(t, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15):
    # argument t of sixteen (scalars: a select each; no indexing of arguments in Triton)
    lo = tl.where(t == 0, a0, tl.where(t == 1, a1, tl.where(t == 2, a2, tl.where(t == 3, a3, a4))))
    lo = tl.where(t < 5, lo, tl.where(t == 5, a5, tl.where(t == 6, a6, tl.where(t == 7, a7, a8))))
    hi = tl.where(t == 9, a9, tl.where(t == 10, a10, tl.where(t == 11, a11, tl.where(t == 12, a12, a13))))
    hi = tl.where(t < 14, hi, tl.where(t == 14, a14, a15))
    return tl.where(t < 9, lo, hi)


# every size and row is an int64 not specialised on its value; the pointers are all 16-byte aligned (the
# engine batches only those), so that the main loop's loads stay vector loads through the select
JIT_KW_MANY: dict = {"do_not_specialize": [f"{c}{i}" for c in "nr" for i in range(SLOTS)] + ["programs"]}


@triton.jit(**JIT_KW_MANY)
def _rows_many(
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15,
    n0: tl.int64, n1: tl.int64, n2: tl.int64, n3: tl.int64, n4: tl.int64, n5: tl.int64, n6: tl.int64, n7: tl.int64,
    n8: tl.int64, n9: tl.int64, n10: tl.int64, n11: tl.int64, n12: tl.int64, n13: tl.int64, n14: tl.int64, n15: tl.int64,
    r0: tl.int64, r1: tl.int64, r2: tl.int64, r3: tl.int64, r4: tl.int64, r5: tl.int64, r6: tl.int64, r7: tl.int64,
    r8: tl.int64, r9: tl.int64, r10: tl.int64, r11: tl.int64, r12: tl.int64, r13: tl.int64, r14: tl.int64, r15: tl.int64,
    programs: tl.int64,
    rows_ptr,
    scratch_ptr,
    lo_ptr,
    uf_ptr,
    fp8_ptr,
    hint_ptr,
    KIND: tl.constexpr, STRIDED: tl.constexpr, KCAP: tl.constexpr, BIAS: tl.constexpr, WIDTH: tl.constexpr,
    C_NUMEL: tl.constexpr, C_ZEROS: tl.constexpr, C_NAN: tl.constexpr, C_INF: tl.constexpr,
    C_OV: tl.constexpr, C_MX: tl.constexpr, C_MN: tl.constexpr, C_CS: tl.constexpr, C_POW2: tl.constexpr,
    C_HIST: tl.constexpr, NW: tl.constexpr, NWP: tl.constexpr, NF: tl.constexpr, NFP: tl.constexpr,
    NBINS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, BLOCK: tl.constexpr, RARE_AFTER: tl.constexpr,
    STAGES: tl.constexpr, PLANES: tl.constexpr,
):  # fmt: skip
    # Up to 16 contiguous tensors of one dtype in one launch: grid (programs, tensors). Tensor t (x_t, n_t
    # values, into row r_t) is read by the first min(programs, its blocks) programs of column t, with slot t of
    # the scratch: ``_rows``' programs on each, and one launch's host work and fixed device cost for all
    t = tl.program_id(1)
    x_ptr = _pick(t, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
    n = _pick(t, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15)
    row = _pick(t, r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15)
    pid = tl.program_id(0).to(tl.int64)
    nprog = tl.minimum(programs, tl.maximum((n + BLOCK - 1) // BLOCK, 1))
    if pid < nprog:
        _rows(
            x_ptr, n, n // BLOCK, 1, 1, 1, 1, 1, rows_ptr, row, scratch_ptr + t * _SCRATCH, lo_ptr, uf_ptr,
            fp8_ptr, hint_ptr, pid, nprog, KIND, STRIDED, KCAP, BIAS, WIDTH, C_NUMEL, C_ZEROS, C_NAN, C_INF, C_OV, C_MX, C_MN,
            C_CS, C_POW2, C_HIST, NW, NWP, NF, NFP, NBINS, LO, HI, BLOCK, RARE_AFTER, STAGES, PLANES, False,
        )  # fmt: skip


def _strided_variant() -> triton.runtime.JITFunction:
    # the same kernel, one compiled variant per dtype for strided views instead of two
    try:
        return triton.jit(_rows.fn, **JIT_KW_STRIDED)
    except TypeError:  # a triton without do_not_specialize_on_alignment
        return triton.jit(_rows.fn, **JIT_KW)


_rows_strided = _strided_variant()

"""The Triton kernels of the block-scaled what-if (``precprof.stats.triton_block`` explains them). Imported only
when that engine runs: this module imports ``triton`` at the top.

Every rounding is integer arithmetic on fp32 bit patterns of magnitudes (int64 lanes): no float operation that
a compiler could flush, fuse or approximate decides a count. Values are ``m * 2^e`` with an integer ``m``;
``_round_pack`` rounds such a value to nearest-even on a grid (fp32's, with subnormals and overflow to inf, or
an element format's). Float64 appears only in the error sums, on values built exactly from their bits.
"""

from typing import Any

import triton
import triton.language as tl

_INF = tl.constexpr(0x7F800000)  # fp32 bits of +inf; every larger magnitude pattern is a nan
_FMAX = tl.constexpr(0x7F7FFFFF)  # fp32 bits of the largest finite float
_NAN = tl.constexpr(0x7FC00000)
_ONE = tl.constexpr(0x3F800000)
_INF64 = tl.constexpr(0x7FF0000000000000)  # float64 bits of +inf
_NAN64 = tl.constexpr(0x7FF8000000000000)


@triton.jit
def _ilog2(m):
    # floor(log2 m) for integers 0 < m < 2^53 (exact through fp64's exponent field); -1023 for m == 0
    return (m.to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023


@triton.jit
def _pow2_f64(n):
    # 2^n as float64 for integer n (clamped to fp64's normal range; callers stay far inside it)
    n = tl.minimum(tl.maximum(n, -1022), 1023)
    return ((n + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _unpack(b):
    # fp32 bits of a finite magnitude -> (m, e) with value m * 2^e, m < 2^24 (0 for zero)
    ex = b >> 23
    frac = b & 0x7FFFFF
    m = tl.where(ex == 0, frac, frac | 0x800000)
    e = tl.where(ex == 0, -149, ex - 150)
    return m, e


@triton.jit
def _unpack_norm(b):
    # as _unpack, with m shifted to [2^23, 2^24) (m = 0 for zero)
    m, e = _unpack(b)
    sh = tl.minimum(tl.maximum(23 - _ilog2(m), 0), 23)
    return m << sh, e - sh


@triton.jit
def _rne_shift(m, sh, sticky):
    # round-to-nearest-even of (m + sticky·eps) / 2^sh for m >= 0; exact m << -sh when sh <= 0 (the callers'
    # sh is then at least -23). ``sticky``: nonzero bits below m's last one (a division's remainder)
    s = tl.minimum(tl.maximum(sh, 0), 62)
    q = m >> s
    rem = m - (q << s)
    half = (rem * 0 + 1 << s) >> 1
    up = (s > 0) & ((rem > half) | ((rem == half) & (sticky | ((q & 1) == 1))))
    return tl.where(sh <= 0, m << tl.minimum(tl.maximum(-sh, 0), 40), q + up.to(tl.int64))


@triton.jit
def _to_bits(mr, lsb):
    # fp32 bits of mr * 2^lsb for 0 <= mr <= 2^24 on fp32's grid (lsb >= -149); inf from 2^128 up
    lg = _ilog2(mr)
    ex = lg + lsb
    up = tl.minimum(tl.maximum(23 - lg, 0), 23)
    down = tl.minimum(tl.maximum(lg - 23, 0), 23)
    normal = ((ex + 127) << 23) | (((mr << up) >> down) & 0x7FFFFF)
    sub = mr << tl.minimum(tl.maximum(lsb + 149, 0), 23)
    bits = tl.where(ex >= -126, normal, sub)
    return tl.where(mr == 0, 0, tl.where(ex >= 128, _INF, bits))


@triton.jit
def _round_pack(m, e, sticky, P: tl.constexpr, LSB_MIN: tl.constexpr):
    # fp32 bits of m * 2^e (m < 2^53, plus a sticky remainder) rounded to nearest-even to P significant bits
    # and no finer than 2^LSB_MIN: fp32 itself is P = 24, LSB_MIN = -149
    lsb = tl.maximum(_ilog2(m) + e - (P - 1), LSB_MIN)
    return _to_bits(_rne_shift(m, lsb - e, sticky), lsb)


@triton.jit
def _fdiv(a, b):
    # fl32(a / b) of two non-negative fp32 bit patterns (int64), IEEE: nan, inf, subnormals, overflow
    nan = (a > _INF) | (b > _INF) | ((a == 0) & (b == 0)) | ((a == _INF) & (b == _INF))
    inf = (a == _INF) | (b == 0)
    zero = (a == 0) | (b == _INF)
    ma, ea = _unpack_norm(a)
    mb, eb = _unpack_norm(b)
    mb = tl.where(mb == 0, 0x800000, mb)
    num = ma << 26
    q = num // mb  # in (2^25, 2^27): 24 bits, a guard bit and more; the remainder is the sticky bit
    bits = _round_pack(q, ea - eb - 26, (num - q * mb) != 0, 24, -149)
    return tl.where(nan, _NAN, tl.where(inf, _INF, tl.where(zero, 0, bits)))


@triton.jit
def _fmul(a, b):
    # fl32(a * b) of two non-negative fp32 bit patterns (int64), IEEE
    nan = (a > _INF) | (b > _INF) | ((a == 0) & (b == _INF)) | ((a == _INF) & (b == 0))
    inf = (a == _INF) | (b == _INF)
    ma, ea = _unpack(a)
    mb, eb = _unpack(b)
    bits = _round_pack(ma * mb, ea + eb, ma < 0, 24, -149)
    return tl.where(nan, _NAN, tl.where(inf, _INF, bits))


@triton.jit
def _round_elem(b, MB: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    # an element format's round-to-nearest-even with saturation, on a non-negative fp32 bit pattern: clamp to
    # FMAX (its bits), round to MB mantissa bits (subnormals below 2^EMIN); nan stays nan
    c = tl.minimum(b, FMAX)
    m, e = _unpack(c)
    bits = _round_pack(m, e, m < 0, MB + 1, EMIN - MB)
    return tl.where(b > _INF, _NAN, bits)


@triton.jit
def _bits_f64(b):
    # float64 of a non-negative fp32 bit pattern, exactly (inf and nan too)
    m, e = _unpack(b)
    v = (m.to(tl.float64) * _pow2_f64(e)).to(tl.int64, bitcast=True)
    return tl.where(b == _INF, _INF64, tl.where(b > _INF, _NAN64, v)).to(tl.float64, bitcast=True)


@triton.jit
def _mx(
    m,
    e,
    lg,
    frac,
    x64,
    nonzero,
    ok,
    amax,
    bad,
    MB: tl.constexpr,
    EMIN: tl.constexpr,
    FMAX: tl.constexpr,
    RCEIL: tl.constexpr,
):
    # One MX recipe on a tile [32 along, TA across] (one block per column): (flushed, saturated, sum of err^2)
    # m, e: |x| = m * 2^e; lg: floor(log2 |x|); frac: |x|'s 23 fraction bits, normalised; ok: inside the
    # tensor and in a finite block; amax: the block's largest magnitude (fp32 bits) [TA]; bad: block not finite
    EMAX: tl.constexpr = (FMAX >> 23) - 127
    FFRAC: tl.constexpr = FMAX & 0x7FFFFF
    if RCEIL:
        # the smallest k with 2^k >= fl32(amax / max); fl32(.) == 0 gives k = 0, as frexp(0) does
        t = _fdiv(amax, amax * 0 + FMAX)
        tm, te = _unpack(t)
        tl2 = _ilog2(tm)
        k = tl.where(t == 0, 0, tl2 + te + ((tm & (tm - 1)) != 0).to(tl.int64))
    else:
        am, ae = _unpack(amax)
        k = _ilog2(am) + ae - EMAX
    k = tl.where((amax > 0) & ~bad, k, -127)
    k = tl.minimum(tl.maximum(k, -127), 127)[None, :]
    # v = |x| / 2^k exactly; its element rounding, and whether it is above the element max
    lv = lg - k
    sat = ((lv > EMAX) | ((lv == EMAX) & (frac > FFRAC))) & nonzero & ok
    lsb = tl.maximum(lv, EMIN) - MB
    mr = _rne_shift(m, lsb - (e - k), m < 0)
    deq = tl.where(sat, FFRAC | 0x800000, mr).to(tl.float64) * _pow2_f64(tl.where(sat, EMAX - 23, lsb) + k)
    # the fp32 product q * 2^k overflows to inf from 2^128 up (rceil, a block near fp32's max)
    top = tl.where(sat, EMAX, _ilog2(mr) + lsb) + k
    deq = tl.where(top >= 128, (top * 0 + _INF64).to(tl.float64, bitcast=True), deq)
    flushed = tl.sum((nonzero & ok & (deq == 0)).to(tl.int64))
    err = x64 - deq
    return flushed, tl.sum(sat.to(tl.int64)), tl.sum(tl.where(ok, err * err, 0.0))


@triton.jit
def _nv_scales(
    amax,
    p,
    r,
    SMIN: tl.constexpr,
    S_MB: tl.constexpr,
    S_EMIN: tl.constexpr,
    S_MAX: tl.constexpr,
    ELEM_MAX: tl.constexpr,
):
    # NVFP4 block scale of a 16-block with largest magnitude amax (bits): s = E4M3(clamp(fl(fl(amax / 6) / p),
    # 2^-6, 448)) (nan stays nan); the element factor fl(r / s) with r = fl(1 / p), and the dequantisation
    # factor fl(p * s); an element factor that overflows is the fp32 max (nan stays nan)
    t = _fdiv(_fdiv(amax, amax * 0 + ELEM_MAX), p)
    t = tl.where(t > _INF, t, tl.minimum(tl.maximum(t, SMIN), S_MAX))
    s = _round_elem(t, S_MB, S_EMIN, S_MAX)
    f = _fdiv(r, s)
    return tl.where(f > _INF, f, tl.minimum(f, _FMAX)), _fmul(p, s)


@triton.jit
def _put(acc, S: tl.constexpr, fl, sa, po, x2, e2):
    # add one tile's five statistics (T.BLOCK_STATS order) to row S of a program's [16, 8] accumulator;
    # counts travel as float64, exact below 2^53
    slot = tl.arange(0, 16)[:, None]
    stat = tl.arange(0, 8)[None, :]
    v = tl.where(stat == 0, fl.to(tl.float64), tl.where(stat == 1, sa.to(tl.float64), po.to(tl.float64)))
    v = tl.where(stat == 3, x2, tl.where(stat == 4, e2, tl.where(stat < 3, v, 0.0)))
    return tl.where(slot == S, acc + v, acc)


@triton.jit
def _tile_bits(x_ptr, t, n_along, n_across, st_along, st_across, tiles, KIND: tl.constexpr, TA: tl.constexpr):
    # tile t of [32 along, TA across]: the fp32 bit patterns of the magnitudes (int64, 0 outside the tensor)
    nba = (n_along + 31) // 32
    along = (t % nba) * 32 + tl.arange(0, 32).to(tl.int64)
    across = (t // nba) * TA + tl.arange(0, TA).to(tl.int64)
    lim = tl.where(
        t < tiles, n_along, 0
    )  # (an integer bound: the interpreter mis-types bool scalar & tensor)
    inside = (along < lim)[:, None] & (across < n_across)[None, :]
    u = tl.load(x_ptr + along[:, None] * st_along + across[None, :] * st_across, mask=inside, other=0)
    if KIND == 0:
        mag = u & 0x7FFFFFFF
    elif KIND == 1:
        mag = (u.to(tl.int32) & 0x7FFF) << 16
    else:  # fp16: 5 exponent bits (bias 15), 10 mantissa bits
        h = u.to(tl.int32) & 0x7FFF
        ex = h >> 10
        fm = h & 0x3FF
        lg = _ilog2(fm.to(tl.int64)).to(tl.int32)
        sub = ((lg + 103) << 23) | ((fm << tl.minimum(tl.maximum(23 - lg, 0), 23)) & 0x7FFFFF)
        mag = tl.where(ex == 0, tl.where(fm == 0, 0, sub), ((ex + 112) << 23) | (fm << 13))
        mag = tl.where(ex == 31, _INF | (fm << 13), mag)
    return mag.to(tl.int64), inside


def _jit(fn: Any) -> Any:
    # Integer arguments are int64 and not specialised on their values, nor the tensor's pointer on its
    # alignment (the tiles are gathers through runtime strides): one compiled variant per dtype and recipe
    # set, which ``triton_block.warm`` compiles before any hook runs.
    kw: dict[str, Any] = {
        "do_not_specialize": ["n_along", "n_across", "st_along", "st_across", "tiles", "iters"]
    }
    try:
        return triton.jit(fn, do_not_specialize_on_alignment=["x_ptr"], **kw)
    except TypeError:  # a triton without do_not_specialize_on_alignment
        return triton.jit(fn, **kw)


@_jit
def _amax(
    x_ptr,
    out_ptr,
    n_along: tl.int64,
    n_across: tl.int64,
    st_along: tl.int64,
    st_across: tl.int64,
    tiles: tl.int64,
    iters: tl.int64,
    KIND: tl.constexpr,
    TA: tl.constexpr,
):
    # the tensor's largest magnitude as fp32 bits (a nan pattern when it holds a nan), by integer atomic max
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    best = tl.zeros([32, TA], dtype=tl.int64)
    for it in range(0, iters):
        t = pid + it * nprog
        mag, _ = _tile_bits(x_ptr, t, n_along, n_across, st_along, st_across, tiles, KIND, TA)
        best = tl.maximum(best, mag)
    tl.atomic_max(out_ptr, tl.max(tl.max(best, axis=1), axis=0).to(tl.int32))


@_jit
def _blocks(
    x_ptr,
    tmax_ptr,
    part_ptr,
    n_along: tl.int64,
    n_across: tl.int64,
    st_along: tl.int64,
    st_across: tl.int64,
    tiles: tl.int64,
    iters: tl.int64,
    KIND: tl.constexpr,
    TA: tl.constexpr,
    MASK: tl.constexpr,
    MB0: tl.constexpr,
    EMIN0: tl.constexpr,
    FMAX0: tl.constexpr,
    MB1: tl.constexpr,
    EMIN1: tl.constexpr,
    FMAX1: tl.constexpr,
    MB2: tl.constexpr,
    EMIN2: tl.constexpr,
    FMAX2: tl.constexpr,
    MB3: tl.constexpr,
    EMIN3: tl.constexpr,
    FMAX3: tl.constexpr,
    MB4: tl.constexpr,
    EMIN4: tl.constexpr,
    FMAX4: tl.constexpr,
    NV_DIV: tl.constexpr,
    NV_SMIN: tl.constexpr,
    NV_PMIN: tl.constexpr,
):
    # Slots: MX element format f (0..4, the MB/EMIN/FMAX constants) in scale mode floor (2f) or rceil
    # (2f + 1); NVFP4 is slot 10 (element format 4, block scale in format 0). MASK: the slots to compute.
    # Writes this program's partial sums to part_ptr[pid, slot, stat] ([programs, 16, 8] float64).
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([16, 8], dtype=tl.float64)
    lane = tl.arange(0, 32)[:, None]
    NV: tl.constexpr = (MASK >> 10) & 1
    if NV:
        # the per-tensor scale p = fl(amax / (448 * 6)) (1 for an all-zero tensor), at least NV_PMIN (the
        # smallest fp32 whose reciprocal is finite; positive fp32 bits order as their values), and r = fl(1 / p)
        tmax = tl.load(tmax_ptr).to(tl.int64)
        p = tl.maximum(tl.where(tmax > 0, _fdiv(tmax, tmax * 0 + NV_DIV), _ONE), NV_PMIN)
        r = _fdiv(p * 0 + _ONE, p)
    for it in range(0, iters):
        t = pid + it * nprog
        mag, inside = _tile_bits(x_ptr, t, n_along, n_across, st_along, st_across, tiles, KIND, TA)
        m, e = _unpack(mag)
        lg = _ilog2(m) + e
        frac = ((m << tl.minimum(tl.maximum(23 - _ilog2(m), 0), 23)) & 0x7FFFFF).to(tl.int64)
        x64 = m.to(tl.float64) * _pow2_f64(e)
        nonzero = mag != 0
        if (MASK & 0x3FF) != 0:
            amax = tl.max(mag, axis=0)  # [TA]: each column of the tile is one block of 32
            bad = amax >= _INF
            ok = inside & ~bad[None, :]
            x2 = tl.sum(tl.where(ok, x64 * x64, 0.0))
            po = tl.sum((inside & bad[None, :]).to(tl.int64))
            if MASK & 1:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB0, EMIN0, FMAX0, False)
                acc = _put(acc, 0, f, s, po, x2, q)
            if MASK & 2:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB0, EMIN0, FMAX0, True)
                acc = _put(acc, 1, f, s, po, x2, q)
            if MASK & 4:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB1, EMIN1, FMAX1, False)
                acc = _put(acc, 2, f, s, po, x2, q)
            if MASK & 8:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB1, EMIN1, FMAX1, True)
                acc = _put(acc, 3, f, s, po, x2, q)
            if MASK & 16:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB2, EMIN2, FMAX2, False)
                acc = _put(acc, 4, f, s, po, x2, q)
            if MASK & 32:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB2, EMIN2, FMAX2, True)
                acc = _put(acc, 5, f, s, po, x2, q)
            if MASK & 64:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB3, EMIN3, FMAX3, False)
                acc = _put(acc, 6, f, s, po, x2, q)
            if MASK & 128:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB3, EMIN3, FMAX3, True)
                acc = _put(acc, 7, f, s, po, x2, q)
            if MASK & 256:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB4, EMIN4, FMAX4, False)
                acc = _put(acc, 8, f, s, po, x2, q)
            if MASK & 512:
                f, s, q = _mx(m, e, lg, frac, x64, nonzero, ok, amax, bad, MB4, EMIN4, FMAX4, True)
                acc = _put(acc, 9, f, s, po, x2, q)
        if NV:
            # two 16-blocks per column: lanes 0..15 and 16..31
            first = lane < 16
            amax_a = tl.max(tl.where(first, mag, 0), axis=0)
            amax_b = tl.max(tl.where(first, 0, mag), axis=0)
            fs, ds = _nv_scales(tl.join(amax_a, amax_b), p, r, NV_SMIN, MB0, EMIN0, FMAX0, FMAX4)  # [TA, 2]
            fa, fb = tl.split(fs)
            da, db = tl.split(ds)
            factor = tl.where(first, fa[None, :], fb[None, :])
            dq = tl.where(first, da[None, :], db[None, :])
            scaled = _fmul(mag, factor)
            ok = inside & ((mag * 0 + tmax) < _INF)
            sat = (scaled > FMAX4) & (scaled <= _INF) & ok
            deq = _fmul(_round_elem(scaled, MB4, EMIN4, FMAX4), dq)
            flushed = nonzero & ok & (deq == 0)
            err = x64 - _bits_f64(deq)
            f = tl.sum(flushed.to(tl.int64))
            s = tl.sum(sat.to(tl.int64))
            po = tl.sum((inside & ~ok).to(tl.int64))
            x2 = tl.sum(tl.where(ok, x64 * x64, 0.0))
            acc = _put(acc, 10, f, s, po, x2, tl.sum(tl.where(ok, err * err, 0.0)))
    rows = tl.arange(0, 16)[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(part_ptr + pid.to(tl.int64) * 128 + rows, acc)

"""The Triton kernels of the block-scaled what-if (``precprof.stats.triton_block`` explains them; their
arithmetic is ``triton_block_math``'s). Imported only when that engine runs: this module imports ``triton``
at the top.
"""

from typing import Any

import triton
import triton.language as tl

from precprof.stats.triton_block_math import (
    _INF,
    _amax_binade,
    _cf,
    _f32,
    _mx_bounds,
    _mx_elem,
    _mx_fast,
    _mx_k,
    _mx_scale,
    _nv_elem,
    _nv_scale,
    _safe,
)


@triton.jit
def _put(acc, S: tl.constexpr, fl, sa, po, x2, e2):
    # add one recipe's five statistics (T.BLOCK_STATS order) to row S of a program's [16, 8] accumulator;
    # counts travel as float64, exact below 2^53
    slot = tl.arange(0, 16)[:, None]
    stat = tl.arange(0, 8)[None, :]
    v = tl.where(stat == 0, fl.to(tl.float64), tl.where(stat == 1, sa.to(tl.float64), po.to(tl.float64)))
    v = tl.where(stat == 3, x2, tl.where(stat == 4, e2, tl.where(stat < 3, v, 0.0)))
    return tl.where(slot == S, acc + v, acc)


@triton.jit
def _value(base, j, jv, st_along, n_in, bad, nz, x2, KIND: tl.constexpr):
    # positions j + jv of each line: |x| as fp32 (0 outside the tensor and in a poisoned block), its bits, as
    # float64; the nonzero count and the sum of squares with it added
    m = _mag(_load(base, j, jv, st_along, n_in), KIND)
    ai = tl.where(bad[:, None], 0, m)
    a = _f32(ai)
    a64 = a.to(tl.float64)
    return a, ai, a64, nz + (ai != 0).to(tl.int32), tl.fma(a64, a64, x2)


@triton.jit
def _load(base, j, jv, st_along, n_in):
    # positions j + jv of each line, as integers of x's width (0 outside the tensor: n_in, the line's positions
    # inside it, is 0 for a line outside)
    inside = j + jv < n_in[:, None]
    return tl.load(base[:, None] + (j + jv) * st_along, mask=inside, other=0)


@triton.jit
def _nv_half(fa, da, fb, db, h, jv, HALVES: tl.constexpr):
    # NVFP4's factor and dequantisation for the positions of half h (HALVES 2), or for every position (1)
    if HALVES == 2:
        if h == 0:
            f, d = fa, da
        else:
            f, d = fb, db
    else:
        f = tl.where(jv < 16, fa, fb)
        d = tl.where(jv < 16, da, db)
    return f, d


@triton.jit
def _mag(u, KIND: tl.constexpr):
    # the fp32 bit patterns (int32) of the magnitudes of values loaded as integers of their width
    if KIND == 0:
        mag = u & 0x7FFFFFFF
    elif KIND == 1:
        mag = (u.to(tl.int32) & 0x7FFF) << 16
    else:  # fp16 to fp32 by the conversion instruction: exact, subnormals, inf and nan included
        h = (u & 0x7FFF).to(tl.int16).to(tl.float16, bitcast=True)
        mag = h.to(tl.float32).to(tl.int32, bitcast=True)
    return mag.to(tl.int32)


@triton.jit
def _tile_bits(x_ptr, t, n_along, n_across, st_along, st_across, tiles, KIND: tl.constexpr, TA: tl.constexpr):
    # tile t of [32 along, TA across]: the fp32 bit patterns of the magnitudes (int32, 0 outside the tensor)
    nba = (n_along + 31) // 32
    along = (t % nba) * 32 + tl.arange(0, 32).to(tl.int64)
    across = (t // nba) * TA + tl.arange(0, TA).to(tl.int64)
    # (an integer bound: the interpreter mis-types a bool scalar & a tensor)
    lim = tl.where(t < tiles, n_along, 0)
    inside = (along < lim)[:, None] & (across < n_across)[None, :]
    u = tl.load(x_ptr + along[:, None] * st_along + across[None, :] * st_across, mask=inside, other=0)
    return _mag(u, KIND), inside


def _jit(fn: Any) -> Any:
    # Integer arguments are int64 and not specialised on their values, nor the pointers on their alignment
    # (the tiles are gathers through runtime strides; the accumulator's slot is wherever it is): one compiled
    # variant per dtype and recipe set, which ``triton_block.warm`` compiles before any hook runs.
    ints = [a for a in fn.__code__.co_varnames[: fn.__code__.co_argcount] if not a.isupper()]
    kw: dict[str, Any] = {"do_not_specialize": [a for a in ints if not a.endswith("_ptr")]}
    try:
        return triton.jit(fn, do_not_specialize_on_alignment=[a for a in ints if a.endswith("_ptr")], **kw)
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
    best = tl.zeros([32, TA], dtype=tl.int32)
    for it in range(0, iters):
        t = pid + it * nprog
        mag, _ = _tile_bits(x_ptr, t, n_along, n_across, st_along, st_across, tiles, KIND, TA)
        best = tl.maximum(best, mag)
    tl.atomic_max(out_ptr, tl.max(tl.max(best, axis=1), axis=0), sem="relaxed")  # read by the next launch


@_jit
def _blocks(
    x_ptr,
    scr_ptr,
    part_ptr,
    out_ptr,
    n_along0: tl.int64,
    n_across0: tl.int64,
    st_along0: tl.int64,
    st_across0: tl.int64,
    tiles0: tl.int64,
    iters0: tl.int64,
    progs0: tl.int64,
    n_along1: tl.int64,
    n_across1: tl.int64,
    st_along1: tl.int64,
    st_across1: tl.int64,
    tiles1: tl.int64,
    iters1: tl.int64,
    KIND: tl.constexpr,
    TA: tl.constexpr,
    MASK: tl.constexpr,
    SLOTMAP: tl.constexpr,
    NR: tl.constexpr,
    NRP: tl.constexpr,
    CH: tl.constexpr,
    MB0: tl.constexpr,
    EMIN0: tl.constexpr,
    FMAX0: tl.constexpr,
    SAT0: tl.constexpr,
    MB1: tl.constexpr,
    EMIN1: tl.constexpr,
    FMAX1: tl.constexpr,
    SAT1: tl.constexpr,
    MB2: tl.constexpr,
    EMIN2: tl.constexpr,
    FMAX2: tl.constexpr,
    SAT2: tl.constexpr,
    MB3: tl.constexpr,
    EMIN3: tl.constexpr,
    FMAX3: tl.constexpr,
    SAT3: tl.constexpr,
    MB4: tl.constexpr,
    EMIN4: tl.constexpr,
    FMAX4: tl.constexpr,
    SAT4: tl.constexpr,
    NV_DIV: tl.constexpr,
    NV_SMIN: tl.constexpr,
    NV_PMIN: tl.constexpr,
    JV: tl.constexpr,
    HALVES: tl.constexpr,
    UNROLL: tl.constexpr,
):
    # Slots: MX element format f (0..4, the MB/EMIN/FMAX/SAT constants) in scale mode floor (2f) or rceil
    # (2f + 1); NVFP4 is slot 10 (element format 4, block scale in format 0). MASK: the slots to compute.
    # Both orientations of one tensor in one launch: programs [0, progs0) read it with geometry 0 (its blocks
    # along the 2-D view's last dimension), the others with geometry 1 (down its columns). Each writes its
    # partial sums to part_ptr[pid] ([programs, 16, 8] float64); the last program to finish adds, per
    # orientation o, recipe r (kernel slot (SLOTMAP >> 4r) & 15, r < NR) and statistic s < 5, the programs'
    # partials in program order into out_ptr[o, r, s] (float64 [2, NR, 5]), and zeroes the scratch (scr_ptr:
    # the tensor's amax bits, the count of programs finished) for the next launch.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    second = pid >= progs0
    t0 = tl.where(second, pid - progs0, pid)  # this program's first tile and the stride between its tiles
    nstep = tl.where(second, nprog - progs0, progs0)
    n_along = tl.where(second, n_along1, n_along0)
    n_across = tl.where(second, n_across1, n_across0)
    st_along = tl.where(second, st_along1, st_along0)
    st_across = tl.where(second, st_across1, st_across0)
    tiles = tl.where(second, tiles1, tiles0)
    iters = tl.where(second, iters1, iters0)
    NV: tl.constexpr = (MASK >> 10) & 1
    if NV:
        # the per-tensor scale p = fl(amax / (448 * 6)) (1 for an all-zero tensor), at least NV_PMIN (the
        # smallest fp32 whose reciprocal is finite; positive fp32 bits order as their values), and r = fl(1 / p)
        tmax = tl.load(scr_ptr)
        p = tl.where(tmax > 0, tl.div_rn(_f32(tmax), _cf(NV_DIV)), 1.0)
        p = tl.where(p < _cf(NV_PMIN), _cf(NV_PMIN), p)
        r = tl.div_rn(p * 0 + 1.0, p)
        tensor_ok = tmax < _INF
    # Each thread reads whole blocks: a line of the tile (TA lines, one block of 32 positions along each) is
    # one thread's, so a block's amax, each value's rounding and the statistics stay in its registers; the
    # statistics are added across threads once, when the program ends (no barrier inside the loop).
    # Positions are read JV at a time, in HALVES (NVFP4's two blocks of 16, each with its own scale: apart on
    # a GPU, where UNROLL positions of a thread make one iteration, 1 position each; at once in the
    # interpreter, which pays per operation and takes all 32 in one: the same arithmetic either way).
    HW: tl.constexpr = 32 // HALVES
    lines = tl.arange(0, TA).to(tl.int64)
    jv = tl.arange(0, JV)[None, :]
    zi = tl.zeros([TA, JV], dtype=tl.int32)
    zf = tl.zeros([TA, JV], dtype=tl.float64)
    zb = tl.zeros([TA], dtype=tl.int32)
    # The sum of squares, the nonzero values (after poisoning) and, per line, the values of poisoned blocks
    # (the same for every MX recipe) and the values inside the tensor; per recipe slot the values it keeps
    # (nonzero and not flushed: flushed = nonzero - kept), those it saturates and the squared errors; NVFP4's
    # own (nn, ns, ne). NVFP4's sum of squares is x2 and its poisoned count 0, or, in a tensor that is not
    # finite, every value poisoned and nothing else counted: set when the program ends.
    x2 = zf
    nz = zi
    po = zb
    seen = zb
    n0, s0, e0 = zi, zi, zf
    n1, s1, e1 = zi, zi, zf
    n2, s2, e2 = zi, zi, zf
    n3, s3, e3 = zi, zi, zf
    n4, s4, e4 = zi, zi, zf
    n5, s5, e5 = zi, zi, zf
    n6, s6, e6 = zi, zi, zf
    n7, s7, e7 = zi, zi, zf
    n8, s8, e8 = zi, zi, zf
    n9, s9, e9 = zi, zi, zf
    nn, ns, ne = zi, zi, zf
    for it in range(0, iters):
        t = t0 + it * nstep
        nba = (n_along + 31) // 32
        along0 = (t % nba) * 32
        across = (t // nba) * TA + lines
        # the tile's positions inside the tensor, [0, nj) of each line inside (none past the last tile)
        nj = tl.minimum(tl.maximum(tl.where(t < tiles, n_along, 0) - along0, 0), 32).to(tl.int32)
        line_in = across < n_across
        n_in = tl.where(line_in, nj, 0)
        seen += n_in
        base = x_ptr + across * st_across + along0 * st_along
        # first read: each block's amax bits, its halves' (NVFP4's blocks of 16) apart
        amax_a = zb
        amax_b = zb
        for h in tl.static_range(HALVES):
            for j0 in range(h * HW, h * HW + HW, JV * UNROLL):
                for u in tl.static_range(UNROLL):
                    m = _mag(_load(base, j0 + u * JV, jv, st_along, n_in), KIND)
                    if HALVES == 2:
                        if h == 0:
                            amax_a = tl.maximum(amax_a, tl.max(m, axis=1))
                        else:
                            amax_b = tl.maximum(amax_b, tl.max(m, axis=1))
                    else:
                        first = jv < 16
                        amax_a = tl.maximum(amax_a, tl.max(tl.where(first, m, 0), axis=1))
                        amax_b = tl.maximum(amax_b, tl.max(tl.where(first, 0, m), axis=1))
        ab = tl.maximum(amax_a, amax_b)
        bad = ab >= _INF  # a nan or inf: the block has no finite scale, its values are poisoned
        ab = tl.where(bad, 0, ab)
        po += tl.where(bad, n_in, 0)
        if MASK & 1:
            k0 = _mx_k(ab, FMAX0, False)
        if MASK & 2:
            k1 = _mx_k(ab, FMAX0, True)
        if MASK & 4:
            k2 = _mx_k(ab, FMAX1, False)
        if MASK & 8:
            k3 = _mx_k(ab, FMAX1, True)
        if MASK & 16:
            k4 = _mx_k(ab, FMAX2, False)
        if MASK & 32:
            k5 = _mx_k(ab, FMAX2, True)
        if MASK & 64:
            k6 = _mx_k(ab, FMAX3, False)
        if MASK & 128:
            k7 = _mx_k(ab, FMAX3, True)
        if MASK & 256:
            k8 = _mx_k(ab, FMAX4, False)
        if MASK & 512:
            k9 = _mx_k(ab, FMAX4, True)
        if NV:
            # (a tensor that is not finite is poisoned whole: its NVFP4 statistics are set when the program
            # ends, whatever these scales are)
            fa, da = _nv_scale(amax_a, p, r, MB0, EMIN0, FMAX0, FMAX4, NV_SMIN)
            fb, db = _nv_scale(amax_b, p, r, MB0, EMIN0, FMAX0, FMAX4, NV_SMIN)
        # second read (the tile is in L1 by now): every recipe on each value; with the scales carried to the
        # bounds where every line of the tile allows it (``_safe``: amax from 2^-90 to 2^101, or 0), else as
        # the reference computes (the same statistics)
        if tl.min(_safe(ab).to(tl.int32)) == 1:
            eb = _amax_binade(ab)
            if MASK & 1:
                w0, cap0, z0 = _mx_bounds(k0, ab, MB0, EMIN0, FMAX0)
            if MASK & 2:
                w1, cap1, z1 = _mx_bounds(k1, ab, MB0, EMIN0, FMAX0)
            if MASK & 4:
                w2, cap2, z2 = _mx_bounds(k2, ab, MB1, EMIN1, FMAX1)
            if MASK & 8:
                w3, cap3, z3 = _mx_bounds(k3, ab, MB1, EMIN1, FMAX1)
            if MASK & 16:
                w4, cap4, z4 = _mx_bounds(k4, ab, MB2, EMIN2, FMAX2)
            if MASK & 32:
                w5, cap5, z5 = _mx_bounds(k5, ab, MB2, EMIN2, FMAX2)
            if MASK & 64:
                w6, cap6, z6 = _mx_bounds(k6, ab, MB3, EMIN3, FMAX3)
            if MASK & 128:
                w7, cap7, z7 = _mx_bounds(k7, ab, MB3, EMIN3, FMAX3)
            if MASK & 256:
                w8, cap8, z8 = _mx_bounds(k8, ab, MB4, EMIN4, FMAX4)
            if MASK & 512:
                w9, cap9, z9 = _mx_bounds(k9, ab, MB4, EMIN4, FMAX4)
            for h in tl.static_range(HALVES):
                if NV:  # each position's NVFP4 block factor and dequantisation
                    fh, dh = _nv_half(fa, da, fb, db, h, jv, HALVES)
                for j0 in range(h * HW, h * HW + HW, JV * UNROLL):
                    for u in tl.static_range(UNROLL):
                        a, ai, a64, nz, x2 = _value(base, j0 + u * JV, jv, st_along, n_in, bad, nz, x2, KIND)
                        if MASK & 1:
                            n0, s0, e0 = _mx_fast(
                                a, ai, ai - eb, w0, cap0, z0, n0, s0, e0, MB0, EMIN0, FMAX0, SAT0, False
                            )
                        if MASK & 2:
                            n1, s1, e1 = _mx_fast(
                                a, ai, ai - eb, w1, cap1, z1, n1, s1, e1, MB0, EMIN0, FMAX0, SAT0, True
                            )
                        if MASK & 4:
                            n2, s2, e2 = _mx_fast(
                                a, ai, ai - eb, w2, cap2, z2, n2, s2, e2, MB1, EMIN1, FMAX1, SAT1, False
                            )
                        if MASK & 8:
                            n3, s3, e3 = _mx_fast(
                                a, ai, ai - eb, w3, cap3, z3, n3, s3, e3, MB1, EMIN1, FMAX1, SAT1, True
                            )
                        if MASK & 16:
                            n4, s4, e4 = _mx_fast(
                                a, ai, ai - eb, w4, cap4, z4, n4, s4, e4, MB2, EMIN2, FMAX2, SAT2, False
                            )
                        if MASK & 32:
                            n5, s5, e5 = _mx_fast(
                                a, ai, ai - eb, w5, cap5, z5, n5, s5, e5, MB2, EMIN2, FMAX2, SAT2, True
                            )
                        if MASK & 64:
                            n6, s6, e6 = _mx_fast(
                                a, ai, ai - eb, w6, cap6, z6, n6, s6, e6, MB3, EMIN3, FMAX3, SAT3, False
                            )
                        if MASK & 128:
                            n7, s7, e7 = _mx_fast(
                                a, ai, ai - eb, w7, cap7, z7, n7, s7, e7, MB3, EMIN3, FMAX3, SAT3, True
                            )
                        if MASK & 256:
                            n8, s8, e8 = _mx_fast(
                                a, ai, ai - eb, w8, cap8, z8, n8, s8, e8, MB4, EMIN4, FMAX4, SAT4, False
                            )
                        if MASK & 512:
                            n9, s9, e9 = _mx_fast(
                                a, ai, ai - eb, w9, cap9, z9, n9, s9, e9, MB4, EMIN4, FMAX4, SAT4, True
                            )
                        if NV:
                            nn, ns, ne = _nv_elem(a, a64, fh, dh, nn, ns, ne, MB4, EMIN4, FMAX4, SAT4)
        else:
            if MASK & 1:
                d0, u0 = _mx_scale(k0, False)
            if MASK & 2:
                d1, u1 = _mx_scale(k1, True)
            if MASK & 4:
                d2, u2 = _mx_scale(k2, False)
            if MASK & 8:
                d3, u3 = _mx_scale(k3, True)
            if MASK & 16:
                d4, u4 = _mx_scale(k4, False)
            if MASK & 32:
                d5, u5 = _mx_scale(k5, True)
            if MASK & 64:
                d6, u6 = _mx_scale(k6, False)
            if MASK & 128:
                d7, u7 = _mx_scale(k7, True)
            if MASK & 256:
                d8, u8 = _mx_scale(k8, False)
            if MASK & 512:
                d9, u9 = _mx_scale(k9, True)
            for h in tl.static_range(HALVES):
                if NV:  # each position's NVFP4 block factor and dequantisation
                    fh, dh = _nv_half(fa, da, fb, db, h, jv, HALVES)
                for j0 in range(h * HW, h * HW + HW, JV * UNROLL):
                    for u in tl.static_range(UNROLL):
                        a, ai, a64, nz, x2 = _value(base, j0 + u * JV, jv, st_along, n_in, bad, nz, x2, KIND)
                        if MASK & 1:
                            n0, s0, e0 = _mx_elem(a, d0, u0, n0, s0, e0, MB0, EMIN0, FMAX0, SAT0)
                        if MASK & 2:
                            n1, s1, e1 = _mx_elem(a, d1, u1, n1, s1, e1, MB0, EMIN0, FMAX0, SAT0)
                        if MASK & 4:
                            n2, s2, e2 = _mx_elem(a, d2, u2, n2, s2, e2, MB1, EMIN1, FMAX1, SAT1)
                        if MASK & 8:
                            n3, s3, e3 = _mx_elem(a, d3, u3, n3, s3, e3, MB1, EMIN1, FMAX1, SAT1)
                        if MASK & 16:
                            n4, s4, e4 = _mx_elem(a, d4, u4, n4, s4, e4, MB2, EMIN2, FMAX2, SAT2)
                        if MASK & 32:
                            n5, s5, e5 = _mx_elem(a, d5, u5, n5, s5, e5, MB2, EMIN2, FMAX2, SAT2)
                        if MASK & 64:
                            n6, s6, e6 = _mx_elem(a, d6, u6, n6, s6, e6, MB3, EMIN3, FMAX3, SAT3)
                        if MASK & 128:
                            n7, s7, e7 = _mx_elem(a, d7, u7, n7, s7, e7, MB3, EMIN3, FMAX3, SAT3)
                        if MASK & 256:
                            n8, s8, e8 = _mx_elem(a, d8, u8, n8, s8, e8, MB4, EMIN4, FMAX4, SAT4)
                        if MASK & 512:
                            n9, s9, e9 = _mx_elem(a, d9, u9, n9, s9, e9, MB4, EMIN4, FMAX4, SAT4)
                        if NV:
                            nn, ns, ne = _nv_elem(a, a64, fh, dh, nn, ns, ne, MB4, EMIN4, FMAX4, SAT4)
    acc = tl.zeros([16, 8], dtype=tl.float64)
    x2_all = tl.sum(x2)
    nz_all = tl.sum(nz)
    if (MASK & 0x3FF) != 0:
        po_all = tl.sum(po)
        if MASK & 1:
            acc = _put(acc, 0, nz_all - tl.sum(n0), tl.sum(s0), po_all, x2_all, tl.sum(e0))
        if MASK & 2:
            acc = _put(acc, 1, nz_all - tl.sum(n1), tl.sum(s1), po_all, x2_all, tl.sum(e1))
        if MASK & 4:
            acc = _put(acc, 2, nz_all - tl.sum(n2), tl.sum(s2), po_all, x2_all, tl.sum(e2))
        if MASK & 8:
            acc = _put(acc, 3, nz_all - tl.sum(n3), tl.sum(s3), po_all, x2_all, tl.sum(e3))
        if MASK & 16:
            acc = _put(acc, 4, nz_all - tl.sum(n4), tl.sum(s4), po_all, x2_all, tl.sum(e4))
        if MASK & 32:
            acc = _put(acc, 5, nz_all - tl.sum(n5), tl.sum(s5), po_all, x2_all, tl.sum(e5))
        if MASK & 64:
            acc = _put(acc, 6, nz_all - tl.sum(n6), tl.sum(s6), po_all, x2_all, tl.sum(e6))
        if MASK & 128:
            acc = _put(acc, 7, nz_all - tl.sum(n7), tl.sum(s7), po_all, x2_all, tl.sum(e7))
        if MASK & 256:
            acc = _put(acc, 8, nz_all - tl.sum(n8), tl.sum(s8), po_all, x2_all, tl.sum(e8))
        if MASK & 512:
            acc = _put(acc, 9, nz_all - tl.sum(n9), tl.sum(s9), po_all, x2_all, tl.sum(e9))
    if NV:
        # a tensor with a nan or inf: every value poisoned, nothing else counted. Else no block is poisoned,
        # and x2 is the sum of squares of every value
        nv_po = tl.where(tensor_ok, 0, tl.sum(seen))
        nv_x2 = tl.where(tensor_ok, x2_all, 0.0)
        nv_fl = tl.where(tensor_ok, nz_all - tl.sum(nn), 0)
        nv_sa = tl.where(tensor_ok, tl.sum(ns), 0)
        acc = _put(acc, 10, nv_fl, nv_sa, nv_po, nv_x2, tl.where(tensor_ok, tl.sum(ne), 0.0))
    rows = tl.arange(0, 16)[:, None] * 8 + tl.arange(0, 8)[None, :]
    # (an L2 store, read back by whichever program finishes last: an L1 line of another SM is never stale)
    tl.store(part_ptr + pid.to(tl.int64) * 128 + rows, acc, cache_modifier=".cg")
    # the last program to finish (an acq_rel counter after a barrier: every thread's stores are ordered before
    # it) adds the partials into the accumulator: no second launch, no host work
    tl.debug_barrier()
    done = tl.atomic_add(scr_ptr + 1, 1, sem="acq_rel")
    if done == nprog - 1:
        rec = tl.arange(0, NRP)
        slot = (tl.full([NRP], SLOTMAP, tl.int64) >> (4 * rec).to(tl.int64)) & 15
        col = slot[:, None] * 8 + tl.arange(0, 8)[None, :]  # [NRP, 8]: recipe r's statistics in a partial
        want = (rec < NR)[:, None] & (tl.arange(0, 8) < 5)[None, :]
        dst = rec[:, None] * 5 + tl.arange(0, 8)[None, :]
        chunk = tl.arange(0, CH).to(tl.int64)[:, None, None]
        for o in tl.static_range(2):
            lo = progs0 * o  # orientation o's programs: [0, progs0) or [progs0, nprog)
            hi = progs0 + (nprog - progs0) * o
            total = tl.zeros([NRP, 8], dtype=tl.float64)
            for c in range(lo, hi, CH):
                q = c + chunk
                ptrs = part_ptr + q * 128 + col[None, :, :]
                part = tl.load(ptrs, mask=(q < hi) & want[None, :, :], other=0.0, cache_modifier=".cg")
                total += tl.sum(part, axis=0)
            if hi > lo:
                o_ptr = out_ptr + o * NR * 5 + dst
                tl.store(o_ptr, tl.load(o_ptr, mask=want, other=0.0) + total, mask=want)
        tl.atomic_xchg(scr_ptr, 0, sem="relaxed")
        tl.atomic_xchg(scr_ptr + 1, 0, sem="relaxed")

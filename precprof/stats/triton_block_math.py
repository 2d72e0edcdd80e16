"""The arithmetic of the block-scaled what-if's Triton kernels (``triton_block_kernels``; ``triton_block``
explains them): Triton functions on the values of a tile. Imported only when that engine runs: this module
imports ``triton`` at the top.

The arithmetic is the C kernel's (``stats/kernel.c``, ``run_tiles``): IEEE fp32 operations in the reference's
order, each exact or rounded once as the reference rounds it, on magnitudes (rounding to nearest-even is
symmetric, so |q| of |x| is |q| of x). Scaling by a power of two is exact; an element is rounded to its
format by the magic-number sum with a power of two whose binade's spacing is the format's at the value
(``_round_value``; ``_round_elem``, which NVFP4's block scales take, scales to the integers and back), exact
round-to-nearest-even either way; divisions are ``tl.div_rn`` (IEEE, correctly rounded). That holds only as
written: the launch turns off the contraction of a product and a sum into one fused multiply-add
(``enable_fp_fusion=False``), and Triton's fp32 instructions keep subnormals (no ``.ftz`` in its PTX for
sm_90). Exponents and scales are built from bit patterns in int32. Float64 appears only in the error sums and
the sums of squares.

An MX recipe is computed one of two ways, with the same results: as the reference does (``_mx_elem``: the
value times 2^-k, rounded, times 2^k), or, in a tile whose blocks' amaxes all lie in ``_safe``'s range, with
the scale carried to per-block bounds once (``_mx_bounds``, ``_mx_fast``): a power-of-two scale only moves
the format's grid, its largest value, the largest value that rounds to zero and the saturation bound, so each
value needs no product, and its counts are integer comparisons of its bits with the bounds'.
"""

import triton
import triton.language as tl

_INF = tl.constexpr(0x7F800000)  # fp32 bits of +inf; every larger magnitude pattern is a nan
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (t + magic) - magic rounds t to an integer, to nearest-even


@triton.jit
def _f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cf(BITS: tl.constexpr):
    # the fp32 whose bits are the constant BITS
    return tl.full([], BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(k):
    # 2^k as fp32 for integers k in [-149, 127] (int32)
    normal = (tl.minimum(tl.maximum(k, -126), 127) + 127) << 23
    sub = 1 << tl.minimum(tl.maximum(k + 149, 0), 22)
    return _f32(tl.where(k >= -126, normal, sub))


@triton.jit
def _floor_log2(a):
    # floor(log2 v) of a positive finite fp32 v given by its bits a (int32); a subnormal's from its integer
    # significand, converted to fp32 exactly (it is below 2^23)
    sub = ((a.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127) - 149
    return tl.where(a >= 0x800000, (a >> 23) - 127, sub)


@triton.jit
def _round_elem(a, MB: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    # an element format's rounding of a magnitude a (fp32, >= 0): clamped to its max (bits FMAX), rounded to
    # nearest-even at the spacing of a's binade (MB mantissa bits; subnormals share the binade of 2^EMIN)
    c = tl.where(a > _cf(FMAX), _cf(FMAX), a)
    e = tl.maximum(((c.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    t = c * _pow2(MB - e)
    r = (t + _MAGIC) - _MAGIC
    return r * _pow2(e - MB)


@triton.jit
def _round_value(a, MB: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    # ``_round_elem`` for the element of a block (the same result, fewer instructions): a magnitude c clamped
    # to the format's max and rounded to nearest-even by the magic-number sum with big = 2^(E + 23 - MB), E the
    # exponent of c's binade in the format (max(floor(log2 c), EMIN), from c's exponent bits): big's binade
    # holds c + big (c < 2^(E + 1)) and its spacing, 2^(E - MB), is the format's at c; its significand is 0,
    # so a tie goes to the even multiple; and (c + big) - big is exact
    c = tl.where(a > _cf(FMAX), _cf(FMAX), a)
    e = tl.maximum(c.to(tl.int32, bitcast=True) & _INF, (EMIN + 127) << 23)
    big = _f32(e + ((23 - MB) << 23))
    return (c + big) - big


@triton.jit
def _mx_k(ab, FMAX: tl.constexpr, RCEIL: tl.constexpr):
    # An MX recipe's block scale exponent k (int32, [TA]) from each block's amax bits ab (0 for a block of
    # zeros or a poisoned one: k = -127)
    EMAX: tl.constexpr = (FMAX >> 23) - 127
    if RCEIL:
        # the smallest k with 2^k >= fl32(amax / max); fl32(.) == 0 takes E8M0's smallest (block_formats)
        u = tl.div_rn(_f32(ab), _cf(FMAX)).to(tl.int32, bitcast=True)
        frac = tl.where(u >= 0x800000, u & 0x7FFFFF, u & (u - 1))
        k = tl.where(u == 0, -127, _floor_log2(tl.maximum(u, 1)) + (frac != 0).to(tl.int32))
    else:
        k = _floor_log2(tl.maximum(ab, 1)) - EMAX
    return tl.where(ab == 0, -127, tl.minimum(tl.maximum(k, -127), 127))


@triton.jit
def _mx_scale(k, RCEIL: tl.constexpr):
    # the factors (2^-k, 2^k) of an MX block scale 2^k; rceil at k = -127: (1, 2^-127)
    down = _pow2(-k)
    if RCEIL:  # E8M0's smallest scale multiplies by 1, as Transformer Engine's exp2f_rcp (block_formats)
        down = tl.where(k == -127, _cf(0x3F800000), down)
    return down[:, None], _pow2(k)[:, None]


@triton.jit
def _mx_bounds(k, ab, MB: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr):
    # An MX recipe's block scale 2^k carried to the values themselves (``_mx_fast``; a tile in ``_safe`` range,
    # where every bound below is a normal fp32 and no sum overflows), as fp32 bit patterns: the magic number of
    # the format's lowest binade (2^(EMIN + k + 23 - MB)), the largest magnitude (FMAX * 2^k) and the largest
    # that rounds to 0 (half the smallest subnormal, 2^(EMIN - MB - 1 + k): a tie goes to the even 0). A block
    # of zeros takes k = 0 (its values are all 0 whatever the scale)
    kb = tl.where(ab == 0, 0, k) << 23
    low = ((EMIN + 150 - MB) << 23) + kb
    zero = ((EMIN - MB + 126) << 23) + kb
    return low[:, None], _f32(FMAX + kb)[:, None], zero[:, None]


@triton.jit
def _amax_binade(ab):
    # the bits of 2^floor(log2 amax) of each line's block (2^0 for a block of zeros): the floor scales' bounds
    # are these bits plus a constant each (``_mx_fast``)
    return tl.where(ab == 0, 127 << 23, ab & _INF)[:, None]


@triton.jit
def _safe(ab):
    # the lines whose block scales ``_mx_bounds`` carries to the values: amax in [2^-90, 2^101), or 0
    e = ab & _INF
    return (ab == 0) | ((e >= (127 - 90) << 23) & (e <= (127 + 100) << 23))


@triton.jit
def _above(ab, bound):
    # 1 where ab exceeds bound (int32 whose difference does not overflow): the sign of their difference
    return ((bound - ab).to(tl.uint32, bitcast=True) >> 31).to(tl.int32)


@triton.jit
def _mx_elem(
    a, down, up, n, s, e, MB: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr, SAT: tl.constexpr
):
    # One MX recipe on one value of each block ([TA, JV]), as the reference computes it: the values it keeps
    # (nonzero and not flushed) added to n, those it saturates to s, the squared error to e. a: |x| (fp32; 0
    # outside the tensor and in blocks that are not finite, where every statistic below is then 0 by itself:
    # sc = q = d = 0); down, up: the block's 2^-k and 2^k; saturated: sc above SAT (the bits of
    # block_formats.saturation_bound)
    sc = a * down
    q = _round_value(sc, MB, EMIN, FMAX) * up
    n += (q != 0).to(tl.int32)
    s += (sc > _cf(SAT)).to(tl.int32)
    # d is exact in fp32 (q is 0 or within a factor of two of a, or inf past fp32's max), d * d in float64 (48
    # significant bits): the fused multiply-add rounds once, as the product and the sum do
    d = (a - q).to(tl.float64)
    e = tl.fma(d, d, e)
    return n, s, e


@triton.jit
def _mx_fast(a, ab, x, low, top, zero, n, s, e, MB: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr,
             SAT: tl.constexpr, RCEIL: tl.constexpr):  # fmt: skip
    # ``_mx_elem`` with the scale carried to the bounds (``_mx_bounds``): the same q, counts and error in
    # fewer instructions, no product by 2^-k or 2^k. The magic number's binade is the value's or the format's
    # lowest (an integer max of exponent bits; ``ab & _INF`` is shared by every recipe), so q = RNE of a at
    # the format's spacing; clamping after the rounding gives the reference's clamp before it (rounding is
    # monotonic and the max is on the grid). Kept: a above the largest that rounds to 0; saturated: a above
    # the saturation bound, SAT * 2^k (k's scaling is exact in a ``_safe`` tile). A floor scale's bounds are
    # the block's amax binade (``_amax_binade``) plus a constant, so x = ab minus those bits (shared by every
    # floor recipe) is compared with constants, with no register a bound. An rceil scale saturates nothing:
    # 2^k >= fl32(amax / max) puts amax / 2^k within a rounding of fp32 (2^-24) of the max at most, below the
    # saturation bound (half a step of the format's grid past it)
    EMAX: tl.constexpr = (FMAX >> 23) - 127
    big = _f32(tl.maximum((ab & _INF) + ((23 - MB) << 23), low))
    q = tl.minimum((a + big) - big, top)
    if RCEIL:
        n += _above(ab, zero)
    else:
        n += _above(x, (EMIN - MB - 1 - EMAX) << 23)
        s += _above(x, SAT - ((127 + EMAX) << 23))
    d = (a - q).to(tl.float64)
    e = tl.fma(d, d, e)
    return n, s, e


@triton.jit
def _nv_scale(
    amax_bits,
    p,
    r,
    MB0: tl.constexpr,
    EMIN0: tl.constexpr,
    FMAX0: tl.constexpr,
    FMAX4: tl.constexpr,
    NV_SMIN: tl.constexpr,
):
    # NVFP4's 16-blocks ([TA], amax bits each): the factor an element is multiplied by, fl(r / s), and the
    # dequantisation fl(p * s), for the E4M3 block scale s = E4M3(clamp(fl(fl(amax / 6) / p), 2^-6, 448))
    v = tl.div_rn(tl.div_rn(_f32(amax_bits), _cf(FMAX4)), p)
    v = tl.where(v < _cf(NV_SMIN), _cf(NV_SMIN), tl.where(v > _cf(FMAX0), _cf(FMAX0), v))
    s = _round_elem(v, MB0, EMIN0, FMAX0)
    fs = tl.div_rn(r, s)
    fs = tl.where(fs > _FLT_MAX, _FLT_MAX, fs)  # an overflowing factor is the fp32 max
    return fs[:, None], (p * s)[:, None]


@triton.jit
def _nv_elem(
    a, a64, f, dq, n, s, e, MB: tl.constexpr, EMIN: tl.constexpr, FMAX: tl.constexpr, SAT: tl.constexpr
):
    # NVFP4 on one value of each line (f, dq: its block's factor and dequantisation): the values it keeps,
    # those it saturates, the squared error (q is fl(q' * fl(p * s)), not exact against a: the difference in
    # float64)
    sc = a * f
    q = _round_value(sc, MB, EMIN, FMAX) * dq
    d = a64 - q.to(tl.float64)
    return n + (q != 0).to(tl.int32), s + (sc > _cf(SAT)).to(tl.int32), tl.fma(d, d, e)

"""The row kernel's 64-slot histogram in bit planes: counting by register logic alone (``triton_kernels._rows``).

``tl.histogram`` compiles to warp votes in triton 3.6 (torch 2.11's): a main loop of 58-60 instructions a value
with three barriers an iteration, of which the histogram is two thirds (bench/kernel_sass.py); triton 3.9
issues one shared-memory atomic a value, which serialises where a warp's values share a slot (a tensor's
values crowd into a few binades). Here each thread counts its own values, with no vote, atomic or barrier:

- a value of slot s (0..63) is the 64-bit word ``1 << s``; each of a thread's lanes keeps its counts as eight
  bit planes p0..p7 (bit s of p_j is bit j of slot s's count), so that adding a value is word logic on every
  slot at once. One iteration's eight values a lane (two loads of BLOCK / 2, four values a thread each, split
  in the thread) go in through a tree of carry-save adders and a carry rippled through the upper planes;
- after at most ``F`` iterations and a partial block (8 * (F + 1) <= 255: no count passes eight bits)
  ``flush`` turns the planes into counts: a transpose of each byte's 8 x 8 bits (three rounds of delta swaps)
  gives every slot's count as a byte, spread to 16-bit fields (a lane's sum over the program's threads stays
  under 2^16), and one sum over the program's lanes of the sixteen words that hold them; ``lo``/``hi`` keep
  the sums in 32-bit fields;
- ``counts`` reads the 64 counts out of them at the program's end.

SASS for sm_90 (triton 3.6): 24 instructions a bf16 value in the main loop against 59 with ``tl.histogram``,
and about 820 a flush (once a program for most tensors); counts exact whatever the values
(``TRITON_INTERPRET=1`` runs the same code).
"""

import triton
import triton.language as tl

# the delta swaps' masks: the low 4, 2 and 1 bits of each group of 8, 4 and 2 (the transpose of each byte's
# 8 x 8 bits in ``flush``)
_X4 = tl.constexpr(0x0F0F0F0F0F0F0F0F)
_X2 = tl.constexpr(0x3333333333333333)
_X1 = tl.constexpr(0x5555555555555555)
# even bytes of a word, as 16-bit fields
_F16 = tl.constexpr(0x00FF00FF00FF00FF)
# even 16-bit fields, as 32-bit fields
_F32 = tl.constexpr(0x0000FFFF0000FFFF)
# iterations between flushes (and a partial block: the kernel's first chunk holds it): eight values a lane an
# iteration, at most 255 a count of eight bits
F = tl.constexpr(30)


@triton.jit
def _csa(a, b, c):
    # a carry-save adder: the sum bits and the carry bits of three words, bit by bit
    u = a ^ b
    return u ^ c, (a & b) | (u & c)


@triton.jit
def _quarters(v, T: tl.constexpr):
    # a [4 T] tensor as four [T] tensors of the elements 4t, 4t + 1, 4t + 2, 4t + 3 (each thread's four
    # consecutive elements: a split in registers, no data moves)
    a, b = tl.split(tl.reshape(v, [T, 2, 2]))
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _words(k, inside, T: tl.constexpr, MASKED: tl.constexpr):
    # the words of a [4 T] tensor of slots (none where not ``inside``, when MASKED), as four [T] tensors
    w = tl.full(k.shape, 1, tl.int64) << k.to(tl.int64)
    if MASKED:
        w = tl.where(inside, w, 0)
    return _quarters(w, T)


@triton.jit
def add8(ka, kb, ia, ib, p0, p1, p2, p3, p4, p5, p6, p7, T: tl.constexpr, MASKED: tl.constexpr):
    """The slots ``ka`` and ``kb`` (two [4 T] tensors of 0..63; ``ia``/``ib``: which count, when MASKED) into
    the planes ([T] int64 each)."""
    x0, x1, x2, x3 = _words(ka, ia, T, MASKED)
    x4, x5, x6, x7 = _words(kb, ib, T, MASKED)
    p0, c1 = _csa(p0, x0, x1)
    p0, c2 = _csa(p0, x2, x3)
    p1, d1 = _csa(p1, c1, c2)
    p0, c3 = _csa(p0, x4, x5)
    p0, c4 = _csa(p0, x6, x7)
    p1, d2 = _csa(p1, c3, c4)
    p2, e = _csa(p2, d1, d2)
    # the eights ripple up (no count passes 255 between flushes, so nothing carries out of p7)
    t = p3 & e
    p3 ^= e
    e = t
    t = p4 & e
    p4 ^= e
    e = t
    t = p5 & e
    p5 ^= e
    e = t
    t = p6 & e
    p6 ^= e
    p7 ^= t
    return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _swap(a, b, M: tl.constexpr, S: tl.constexpr):
    # exchange a's bits under M << S with b's under M (a delta swap between two words)
    t = ((a >> S) ^ b) & M
    return a ^ (t << S), b ^ t


@triton.jit
def _swapped(w, M: tl.constexpr, S: tl.constexpr):
    # the delta swap between the two halves of w's last dimension
    a, b = tl.split(w)
    a, b = _swap(a, b, M, S)
    return tl.join(a, b)


@triton.jit
def flush(p0, p1, p2, p3, p4, p5, p6, p7, lo, hi):
    """The planes' counts, summed over the program's lanes, into ``lo`` and ``hi`` ([16] int64 of 32-bit
    fields: ``counts`` reads them)."""
    # the planes as one [T, 2, 2, 2] tensor, plane a + 2 b + 4 c at [t, a, b, c] (the stacked dimensions are
    # each thread's registers); each byte's 8 x 8 bits transposed by swapping halves of planes 4, 2 and 1
    # apart: afterwards byte q of word r = a + 2 b + 4 c is the count of slot 8 q + r
    w = tl.join(tl.join(tl.join(p0, p1), tl.join(p2, p3)), tl.join(tl.join(p4, p5), tl.join(p6, p7)))
    w = _swapped(w, _X4, 4)  # [t, a, b, c]
    w = _swapped(tl.permute(w, (0, 1, 3, 2)), _X2, 2)  # [t, a, c, b]
    w = _swapped(tl.permute(w, (0, 3, 2, 1)), _X1, 1)  # [t, b, c, a]
    # even and odd bytes as 16-bit fields: [t, b, c, a, e], field k of which is slot 16 k + 8 e + r; one sum
    # over the lanes for all, in the order [c, b, a, e] (column 2 r + e)
    w = tl.permute(tl.join(w & _F16, (w >> 8) & _F16), (0, 2, 1, 3, 4))
    s = tl.reshape(tl.sum(w, axis=0), [16])
    return lo + (s & _F32), hi + ((s >> 16) & _F32)


@triton.jit
def counts(lo, hi):
    """The 64 slots' counts (int32) from ``flush``'s sums."""
    slot = tl.arange(0, 64)
    q = slot >> 4
    col = 2 * (slot & 7) + ((slot >> 3) & 1)
    word = tl.where((q & 1) == 0, tl.gather(lo, col, 0), tl.gather(hi, col, 0))
    return ((word >> (32 * (q >> 1))) & 0xFFFFFFFF).to(tl.int32)

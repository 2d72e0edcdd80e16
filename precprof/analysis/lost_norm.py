"""What a cast loses of a tensor's L2 norm, bounded from its exponent histogram: the one measure by which every
what-if (fp16 at a loss scale, per-tensor FP8 under current scaling, the block formats) is judged.

The histogram holds, per binade e, the count of nonzero finite values with 2^e <= |x| < 2^(e+1). A cast loses
the values at or below a limit 2^t (t per tensor: fp16's 2^-25 shifted by the loss scale, FP8's by the current
scale, a block format's largest flushing threshold). The share of the L2 norm they carry, sqrt(L / (L + K)) for
lost energy L = sum x^2 over the lost values and kept energy K, grows with L and falls with K, so

    share <= sqrt(L_up / (L_up + K_low))

with L_up every lost value taken at its binade's upper edge (4^(e+1); capped at the limit itself, 4^t, since a
lost value is at most 2^t) and K_low every kept value at its binade's lower edge (4^e). Exact counts of the lost
values, where the tables have them (``underflow_<fmt>_cs``, a block format's ``flushed``), make the bound
tighter: the lost values are then the ``lost`` largest candidates at most, and, when the tensor was one call
(``exact``), the values lost in the limit's own binade are known to sit exactly on 2^t (round-to-nearest-even
sends a tie at half the smallest subnormal to 0), whose energy is exact. Upper bound, never an estimate: a
share under a threshold here is under it in truth.

Pure numpy over the histogram rows; nothing here reads torch.
"""

from __future__ import annotations

import numpy as np


def _rows(
    exponent: np.ndarray, count: np.ndarray, group: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The histogram rows as float binades, float counts and int groups, without the rows left out (a negative
    group) or empty."""
    e = np.asarray(exponent, dtype=float)
    c = np.asarray(count, dtype=float)
    g = np.asarray(group, dtype=np.int64)
    keep = (g >= 0) & (c > 0)
    return e[keep], c[keep], g[keep]


def lost_share_bound(
    exponent: np.ndarray,
    count: np.ndarray,
    group: np.ndarray,
    limit_log2: np.ndarray,
    lost: np.ndarray | None = None,
    exact: np.ndarray | None = None,
) -> np.ndarray:
    """Per group: an upper bound of the share of the L2 norm the cast loses, sqrt(L_up / (L_up + K_low)) from
    ``lost_energy_bound`` (same arguments); 0 where nothing is lost, nan where the group has no values."""
    l_up, k_low, values = lost_energy_bound(exponent, count, group, limit_log2, lost, exact)
    tot = l_up + k_low
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.sqrt(np.where(tot > 0, l_up / tot, 0.0))
    return np.where(values > 0, share, np.nan)


def lost_energy_bound(
    exponent: np.ndarray,
    count: np.ndarray,
    group: np.ndarray,
    limit_log2: np.ndarray,
    lost: np.ndarray | None = None,
    exact: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per group (a tensor, or a module's tensors summed over steps): an upper bound of the share of the L2 norm
    held by the values at or below 2^limit_log2[g] that a cast loses.

    ``exponent``, ``count``, ``group``: the histogram rows (binade e, its count, the group's index in
    [0, len(limit_log2)); a negative index leaves the row out). ``limit_log2``: per group, log2 of the largest
    magnitude that can be lost (any real number; nan: nothing is lost). ``lost``: per group, the exact count of
    values lost (None: every value of the binades that lie wholly at or below the limit, e + 1 <= limit, and
    none of the binade holding the limit, whose values on the limit itself a histogram cannot tell apart: the
    caller says so). ``exact``: per group, whether every value at or below the limit was lost (one tensor, one
    scale), so that ``lost`` minus the values of the binades below the limit are values exactly on 2^limit.
    Returns per group (L_up: an upper bound of the energy lost, K_low: a lower bound of the energy kept, the
    count of values), float64 arrays.
    """
    n = len(limit_log2)
    e, c, g = _rows(exponent, count, group)
    t = np.asarray(limit_log2, dtype=float)[g]
    has_limit = ~np.isnan(t)
    sure = has_limit & (e + 1 <= t)  # the whole binade is at or below the limit
    edge = has_limit & ~sure & (e <= t)  # the binade holding the limit: only values <= 2^t are lost
    low_energy = 4.0**e  # every value at least 2^e
    if lost is None:
        l_up = np.where(sure, c * 4.0 ** (e + 1), 0.0)
        k_low = np.where(sure, 0.0, c * low_energy)
        return np.bincount(g, l_up, n), np.bincount(g, k_low, n), np.bincount(g, c, n)
    lost_g = np.asarray(lost, dtype=float)
    exact_g = np.zeros(n, dtype=bool) if exact is None else np.asarray(exact, dtype=bool)
    # candidates, largest first: the limit's own binade (its lost values are at most 2^t), then the binades
    # below it from the top; the ``lost`` largest candidate values bound the lost energy
    cap_log2 = np.where(edge, 2 * t, np.where(sure, 2 * (e + 1), -np.inf))
    cand = sure | edge
    order = np.lexsort((-cap_log2, g))
    gs, cs, caps, cands = g[order], c[order], cap_log2[order], cand[order]
    cand_c = np.where(cands, cs, 0.0)
    before = np.cumsum(cand_c) - cand_c  # candidate values ranked above this row in the whole array
    start = np.zeros(n)
    firsts = np.flatnonzero(np.r_[len(gs) > 0, gs[1:] != gs[:-1]])
    start[gs[firsts]] = before[firsts]
    above = before - start[gs]  # ... within its group
    take = np.clip(lost_g[gs] - above, 0.0, cand_c)
    l_up = np.bincount(gs, take * np.exp2(np.where(cands, caps, 0.0)), n)
    # kept energy: values above the limit's binade are all kept; in the limit's binade, all but those lost
    # there (exactly lost minus the binades below when ``exact``, else at most all that were lost)
    below_limit = np.bincount(g, np.where(sure, c, 0.0), n)
    lost_at_edge = np.where(exact_g, np.clip(lost_g - below_limit, 0.0, None), lost_g)
    edge_c = np.where(edge, c, 0.0)
    edge_kept = np.clip(edge_c - lost_at_edge[g], 0.0, None)
    k_low = np.where(sure, 0.0, np.where(edge, edge_kept, c) * low_energy)
    exact_edge = exact_g & np.isfinite(np.asarray(limit_log2, dtype=float))
    if exact_edge.any():
        # one tensor, one scale: every value of the binades below was lost (their upper edges bound them) and
        # those lost in the limit's binade are exactly 2^t (exact energy 4^t)
        sure_up = np.bincount(g, np.where(sure, c * 4.0 ** (e + 1), 0.0), n)
        t_g = np.asarray(limit_log2, dtype=float)
        at_edge = np.clip(lost_g - below_limit, 0.0, None)
        l_exact = sure_up + at_edge * np.exp2(2 * np.nan_to_num(t_g))
        l_up = np.where(exact_edge, np.minimum(l_up, l_exact), l_up)
    return l_up, np.bincount(g, k_low, n), np.bincount(g, c, n)


def top_energy_bound(
    exponent: np.ndarray, count: np.ndarray, group: np.ndarray, n: int, top: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per group: (an upper bound of the energy, sum x^2, of its ``top[g]`` largest values, a lower bound of the
    energy of all its values), from the histogram (the top values at their binades' upper edges, all values at
    their lower edges). What saturation can touch: it clamps a block's largest values."""
    e, c, g = _rows(exponent, count, group)
    order = np.lexsort((-e, g))
    gs, es, cs = g[order], e[order], c[order]
    before = np.cumsum(cs) - cs
    start = np.zeros(n)
    firsts = np.flatnonzero(np.r_[len(gs) > 0, gs[1:] != gs[:-1]])
    start[gs[firsts]] = before[firsts]
    take = np.clip(np.asarray(top, dtype=float)[gs] - (before - start[gs]), 0.0, cs)
    return np.bincount(gs, take * 4.0 ** (es + 1), n), np.bincount(g, c * 4.0**e, n)


def count_below(
    exponent: np.ndarray, count: np.ndarray, group: np.ndarray, limit_log2: np.ndarray
) -> np.ndarray:
    """Per group: the count of values in the binades wholly below 2^limit_log2[g] (e + 1 <= limit), from the
    histogram rows (as ``lost_energy_bound``'s; nan limit: none). For an integer limit, as FP8's smallest normal
    under a power-of-two scale, the binades meet the limit exactly: the count of the values below it."""
    n = len(limit_log2)
    e, c, g = _rows(exponent, count, group)
    t = np.asarray(limit_log2, dtype=float)[g]
    return np.bincount(g, np.where(~np.isnan(t) & (e + 1 <= t), c, 0.0), n)


def rank_edge_log2(
    exponent: np.ndarray, count: np.ndarray, group: np.ndarray, n: int, rank: np.ndarray
) -> np.ndarray:
    """Per group: log2 of the upper edge of the binade holding its ``rank[g]``-th largest value (1: the largest),
    from the histogram rows (as ``top_energy_bound``'s): an upper bound of that value. nan where the group has
    fewer values than that."""
    e, c, g = _rows(exponent, count, group)
    order = np.lexsort((-e, g))
    gs, es, cs = g[order], e[order], c[order]
    upto = np.cumsum(cs)
    start = np.zeros(n)
    firsts = np.flatnonzero(np.r_[len(gs) > 0, gs[1:] != gs[:-1]])
    start[gs[firsts]] = (upto - cs)[firsts]
    # the first binade, from the top, whose values reach the rank
    reached = upto - start[gs] >= np.asarray(rank, dtype=float)[gs]
    out = np.full(n, -np.inf)
    np.maximum.at(out, gs[reached], es[reached] + 1)
    return np.where(np.isfinite(out), out, np.nan)

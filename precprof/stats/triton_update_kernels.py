"""The two Triton kernels of the weight-update samples (``triton_updates``); imported only when a group runs
them: this module imports ``triton`` at the top."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

# the table's rows (``triton_updates``): parameter address, gradient address (0: none), stride, sample length,
# where the member's samples begin in ``before`` and ``intended``
PARAM: tl.constexpr = tl.constexpr(0)
GRAD: tl.constexpr = tl.constexpr(1)
STRIDE: tl.constexpr = tl.constexpr(2)
LEN: tl.constexpr = tl.constexpr(3)
START: tl.constexpr = tl.constexpr(4)


def tl_dtype(dtype: torch.dtype) -> Any:
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


@triton.jit
def _bf16_rne(x):
    """fp32 ``x`` rounded to bf16, to nearest even (as fp32); nan stays nan."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit(do_not_specialize=["k"])
def _read(table, k, before, intended, DT: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    p = tl.load(table + PARAM * k + m).to(tl.pointer_type(DT))
    g_at = tl.load(table + GRAD * k + m)
    g = g_at.to(tl.pointer_type(DT))
    stride = tl.load(table + STRIDE * k + m)
    n = tl.load(table + LEN * k + m)
    start = tl.load(table + START * k + m)
    g_n = tl.where(g_at != 0, n, 0)  # (a member without gradient reads none)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        x = tl.load(p + offs * stride, mask=mask, other=0).to(tl.float32)
        gx = tl.load(g + offs * stride, mask=offs < g_n, other=0).to(tl.float32)  # (-0 is 0)
        tl.store(before + start + offs, x, mask=mask)
        tl.store(intended + start + offs, (gx != 0).to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=["k"])
def _classify(table, k, before, intended, counts, sizes, DT: tl.constexpr, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    p = tl.load(table + PARAM * k + m).to(tl.pointer_type(DT))
    stride = tl.load(table + STRIDE * k + m)
    n = tl.load(table + LEN * k + m)
    start = tl.load(table + START * k + m)
    zero = tl.zeros([BLOCK], dtype=tl.int64)
    n_none, n_bf16, n_fp16, n_stuck = zero, zero, zero, zero
    sq_u = tl.zeros([BLOCK], dtype=tl.float64)
    sq_w, nans, infs, hi = sq_u, sq_u, sq_u, sq_u
    lo = tl.full([BLOCK], float("inf"), dtype=tl.float64)
    for s in range(0, n, BLOCK):
        offs = s + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        after = tl.load(p + offs * stride, mask=mask, other=0).to(tl.float32)
        b = tl.load(before + start + offs, mask=mask, other=0)
        meant = tl.load(intended + start + offs, mask=mask, other=0) != 0
        delta = after - b
        moved = delta != 0
        stuck = meant & (moved == 0)  # meant to move, did not
        held = _bf16_rne(b)
        lost_bf16 = (_bf16_rne(held + delta) == held) & moved
        held16 = b.to(tl.float16, fp_downcast_rounding="rtne")
        lost_fp16 = (
            (held16.to(tl.float32) + delta).to(tl.float16, fp_downcast_rounding="rtne") == held16
        ) & moved
        n_none += (mask & (moved == 0) & (meant == 0)).to(tl.int64)
        n_bf16 += (mask & (lost_bf16 | stuck)).to(tl.int64)
        # a stuck update in a bf16 weight says nothing of fp16, which is finer
        if DT == tl.bfloat16:  # noqa: SIM300 (a constexpr dtype)
            n_fp16 += (mask & lost_fp16).to(tl.int64)
        else:
            n_fp16 += (mask & (lost_fp16 | stuck)).to(tl.int64)
        n_stuck += (mask & stuck).to(tl.int64)
        finite = (delta == delta) & (tl.abs(delta) != float("inf"))
        d = tl.where(finite & mask, tl.abs(delta), 0).to(tl.float64)
        w = tl.where((b == b) & (tl.abs(b) != float("inf")), b, 0).to(tl.float64)
        sq_u += d * d
        sq_w += w * w
        nans += (mask & (delta != delta)).to(tl.float64)
        infs += (mask & (tl.abs(delta) == float("inf"))).to(tl.float64)
        hi = tl.maximum(hi, d)
        lo = tl.minimum(lo, tl.where(d > 0, d, float("inf")))
    row = counts + m * 5
    tl.store(row, tl.load(row) + n)
    tl.store(row + 1, tl.load(row + 1) + tl.sum(n_none, 0))
    tl.store(row + 2, tl.load(row + 2) + tl.sum(n_bf16, 0))
    tl.store(row + 3, tl.load(row + 3) + tl.sum(n_fp16, 0))
    tl.store(row + 4, tl.load(row + 4) + tl.sum(n_stuck, 0))
    size = sizes + m * 6  # update_sizes' columns
    tl.store(size, tl.load(size) + tl.sum(sq_u, 0))
    tl.store(size + 1, tl.load(size + 1) + tl.sum(sq_w, 0))
    tl.store(size + 2, tl.load(size + 2) + tl.sum(nans, 0))
    tl.store(size + 3, tl.load(size + 3) + tl.sum(infs, 0))
    tl.store(size + 4, tl.maximum(tl.load(size + 4), tl.max(hi, 0)))
    tl.store(size + 5, tl.minimum(tl.load(size + 5), tl.min(lo, 0)))

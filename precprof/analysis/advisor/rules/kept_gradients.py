"""The gradients fp16's keep list holds in fp32: the fp16 loss scale and gradient underflow are judged on the
gradients an fp16 run that follows the advice computes in fp16, not on those of the layers it runs outside
autocast. An fp32 run whose head's weight gradient reached 1.8e6 was told 2^-7, and that underflow at 2^-7 of
the gradients of ``big`` (kept in fp32 too) ruled fp16 out; trained at 2^-7 with those layers kept, fp16 matched
fp32."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import pandas as pd

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import _ancestors, _dtype_has, _rows_of_kinds, _Run, _under_any
from precprof.analysis.advisor.rules.kept import _gemm_inputs
from precprof.analysis.advisor.text import _listing


@dataclass(frozen=True)
class KeptGradients:
    """Which gradient rows a run that keeps ``keep`` in fp32 under fp16 autocast holds in fp32.

    A module kept in fp32 (or under one kept: its forward runs outside autocast too) computes its weight
    gradients in fp32 from fp32 tensors: those rows are left out (``weight``). Its output is fp32, and so is the
    gradient of its output, but what fills it is what its readers send back: an fp32 op's (the kept layer after
    it, a residual sum with an fp32 operand) stays fp32, while a matmul autocast runs in fp16 casts the output to
    fp16 as it reads it, and its backward computes the gradient of that copy in fp16 and casts it back: values
    fp16 flushed or overflowed. Those output gradients count (``read``); the others are left out (``output``).
    Where the run did not record which matmul layer read which module's output (capture.gemm_inputs) every
    output gradient counts. The gradient a kept layer sends into an input an fp16 module made is cast to fp16 on
    its way there: that is the fp16 module's own row, and counts. A function that reads the kept layer's output
    and multiplies it in fp16 (an attention's q @ k^T under autocast) is no module: precprof does not see it, and
    leaves that output gradient out too."""

    keep: list[str]  # the keep list (fp16_keep_fp32 as the advisor computed it)
    weight: frozenset[str]  # modules whose weight-gradient rows are left out
    output: frozenset[str]  # modules whose activation-gradient (output) rows are left out
    read: dict[str, list[str]]  # kept module -> the fp16 matmul layers reading its output: its output counts
    readers_known: bool  # the run recorded which matmul layer read which module's output

    @property
    def left_out(self) -> bool:
        return bool(self.weight or self.output)

    @property
    def modules(self) -> frozenset[str]:
        """The modules some of whose gradient rows are left out (a weight's, an output's, or both)."""
        return self.weight | self.output

    def rows(self, df: pd.DataFrame) -> pd.Series:
        """Which rows of ``df`` (layer rows, or histogram rows and their totals) stay fp32: left out."""
        names = T.texts(df[T.MODULE])
        weight = _rows_of_kinds(df[T.TENSOR], (T.WEIGHT_GRAD,)) & names.isin(self.weight).to_numpy()
        output = _rows_of_kinds(df[T.TENSOR], (T.ACTIVATION_GRAD,)) & names.isin(self.output).to_numpy()
        return pd.Series(weight | output, index=df.index)

    def layers_without(self, run: _Run) -> _Run:
        """``run`` without the layer rows left out (``run`` itself where none is): for the rules that read its
        layer rows alone (its histograms are the run's, whole; their totals are filtered with ``rows``)."""
        if not self.left_out:
            return run
        return replace(run, layers=run.layers[~self.rows(run.layers)])

    def said(self, listed: int) -> str:
        """The rows left out, in words ("" where none is), to follow "leaving out": the layers and why."""
        if not self.left_out:
            return ""
        kept = f"the layers kept in fp32 (fp16_keep_fp32: {_listing(self.keep, listed)})"
        if not self.readers_known:
            return (
                f"the weight gradients of {kept}, computed in fp32 outside autocast (their output gradients count: "
                "the run did not record which layers read them, and a matmul run in fp16 computes the gradient of "
                "what it reads in fp16)"
            )
        if not self.read:
            return f"{kept}, whose gradients stay fp32 (a layer kept in fp32 computes them in fp32)"
        readers = list(dict.fromkeys(r for rs in self.read.values() for r in rs))
        one = len(self.read) == 1
        return (
            f"{kept}, whose gradients stay fp32 (a layer kept in fp32 computes them in fp32), but for the output gradient{'' if one else 's'} "
            f"of {_listing(list(self.read), listed)}, which {_listing(readers, listed)} "
            f"read{'s' if len(readers) == 1 else ''} in fp16: a matmul run in fp16 computes the gradient of what it "
            "reads in fp16"
        )


def kept_gradients(run: _Run, keep: Iterable[str]) -> KeptGradients:
    """``KeptGradients`` of the modules ``keep`` holds in fp32 and those under them, among the run's gradient
    rows. None is left out where every gradient row would be: with nothing computed in fp16, the fp16 rules read
    the run as it is."""
    keep = list(keep)
    held = set(keep)
    grads = run.kind(*T.GRADIENT_KINDS)
    names = T.texts(grads[T.MODULE])
    kept = {m for m in set(names) if m in held or _under_any(m, held)}
    if not kept or kept >= set(names):
        return KeptGradients(keep, frozenset(), frozenset(), {}, True)
    reads = _gemm_inputs(run)
    read: dict[str, list[str]] = {}
    if reads is not None:
        for reader, made in reads.items():
            if reader in held or _under_any(reader, held):
                continue  # a kept matmul reads in fp32
            for m in made:
                if m in kept:
                    read.setdefault(m, []).append(reader)
    order = run.sort(read)
    output = frozenset(kept - set(read)) if reads is not None else frozenset()
    # (a dropout, an Identity has no weight gradient to leave out: "the weight gradients of drop" named none)
    weighted = set(T.texts(grads.loc[grads[T.TENSOR] == T.WEIGHT_GRAD, T.MODULE]))
    return KeptGradients(
        keep, frozenset(kept & weighted), output, {m: run.sort(read[m]) for m in order}, reads is not None
    )


def autocast_fp32_gradients(run: _Run, kept: KeptGradients) -> KeptGradients:
    """``KeptGradients`` of the modules an autocast run computed in fp32 on its own (every activation row fp32:
    a LayerNorm, an embedding; not a matmul layer), besides those ``kept`` leaves out already:
    a module that ran in fp32 computes its weight gradient in fp32 from fp32 tensors, and an fp16 run following
    the advice does too, so fp16 neither overflows nor flushes it at any loss scale (a LayerNorm's weight
    gradient, summed over every token, was the largest of a run, and sized its loss scale 2^2 below what its fp16
    gradients allowed). Their output gradients count where a matmul run in fp16 reads that output (it computes
    the gradient of what it reads in fp16), as ``kept_gradients`` says. None is left out without autocast."""
    none = KeptGradients([], frozenset(), frozenset(), {}, True)
    if not run.autocast.get("enabled"):
        return none
    acts = run.kind(T.ACTIVATION)
    names = T.texts(acts[T.MODULE])
    low = (_dtype_has(acts, "float16") | _dtype_has(acts, "bfloat16")).to_numpy()
    # leaves alone: a container's output (a block's residual sum) may be fp32 while its layers ran in fp16
    containers = {a for m in set(names) for a in _ancestors(m)}
    held = set(kept.keep)
    fp32 = {
        m for m in set(names[~low]) - set(names[low]) - containers if not (m in held or _under_any(m, held))
    }
    grads = run.kind(*T.GRADIENT_KINDS)
    fp32 &= set(T.texts(grads[T.MODULE]))
    # a matmul layer in fp32 under autocast is one the run kept there: fp16's keep list (``kept``) holds it where
    # fp16 needs it so, and an fp16 run following the advice computes the others in fp16
    fp32 = {m for m in fp32 if not taxonomy.is_matmul_type(run.types.get(m, ""))}
    if not fp32:
        return none
    return kept_gradients(run, run.sort(fp32))

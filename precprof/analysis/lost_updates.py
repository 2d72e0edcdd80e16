"""Which ``weight_update`` rows a share of lost updates counts, for the advisor's ``*_lost_updates`` findings and
the report's per-layer table and timeline alike: the updates a training gradient asked for.

A weight whose gradient was zero on its step (an expert no token reached, called with none), or that got no
gradient from the step's backward at all (a layer the step skipped: LayerDrop, an expert skipped in Python), is
moved by weight decay or momentum alone when the optimizer steps it: under ``zero_grad(set_to_none=False)`` its
``.grad`` is a zero tensor, and torch's optimizers step it. Such an update carries no training signal, and one
that rounds away is no training update lost: it is counted apart.

Pure pandas over the layers table; nothing here reads torch.
"""

from __future__ import annotations

import pandas as pd

from precprof import tables as T

_KEYS = [T.STEP, T.MODULE, T.PARAM]


def zero_gradient(grads: pd.DataFrame, updates: pd.DataFrame) -> pd.Series:
    """Per row of ``updates`` (``weight_update`` rows), whether its weight had no training gradient on that step
    (``grads``: the ``weight_grad`` rows): its gradient row is zero everywhere, or it has none on a step whose
    backward left other weights theirs while its own gradient is read on other steps. A weight whose gradient
    is never read (none of its rows in ``grads``) is not among them, nor is a step without gradient rows (its
    backward was not read)."""
    if updates.empty or grads.empty:
        return pd.Series(False, index=updates.index)
    zero = (grads[T.NUMEL] > 0) & (grads[T.ZEROS] == grads[T.NUMEL])
    on_step = grads[_KEYS].assign(_zero=zero.to_numpy()).drop_duplicates(_KEYS)
    ever = grads[_KEYS[1:]].drop_duplicates().assign(_read=True)
    hit = updates[_KEYS].merge(on_step, on=_KEYS, how="left").merge(ever, on=_KEYS[1:], how="left")
    backward = updates[T.STEP].isin(grads[T.STEP].unique()).to_numpy()
    unread = hit["_zero"].isna().to_numpy() & hit["_read"].notna().to_numpy() & backward
    return pd.Series(hit["_zero"].eq(True).to_numpy() | unread, index=updates.index)

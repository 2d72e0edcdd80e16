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

import numpy as np
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
    zero = ((grads[T.NUMEL] > 0) & (grads[T.ZEROS] == grads[T.NUMEL])).to_numpy(dtype=bool)
    # each row's (step, module, param) and (module, param) as integers, coded over both tables alike (as the
    # merges on them did: a missing key matches a missing one): merges of text columns took a tenth of the
    # advisor's lost-update rule
    g_key, u_key = T.joint_codes((grads[k], updates[k]) for k in _KEYS)
    g_mp, u_mp = T.joint_codes((grads[k], updates[k]) for k in _KEYS[1:])
    # the gradient row of the update's step (the first of a repeated key), and whether its weight has any
    keys, first = np.unique(g_key, return_index=True)
    at = np.clip(np.searchsorted(keys, u_key), 0, len(keys) - 1)
    found = keys[at] == u_key
    read = np.isin(u_mp, g_mp)
    backward = updates[T.STEP].isin(grads[T.STEP].unique()).to_numpy()
    return pd.Series((found & zero[first[at]]) | (~found & read & backward), index=updates.index)

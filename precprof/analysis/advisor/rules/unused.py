"""Modules holding parameters that never ran: no forward pass of their own and no gradient on any sampled step of
a run whose backward read weight gradients.

A decoder-only ``BartForCausalLM`` never calls its decoder's cross-attention (``encoder_attn``: a quarter of the
parameters of a small one) without encoder states; a layer built in ``__init__`` and left out of ``forward``; an
expert no token reached on any sampled step. Their parameters still take memory (and, where the optimizer holds
them, their optimizer states), DDP refuses them unless ``find_unused_parameters=True``, and a user who meant them
to train learns it nowhere else. A module whose weight its parent multiplies itself (``nn.MultiheadAttention``'s
``out_proj``, Mamba's ``dt_proj``) gets a gradient, and one the model calls under ``no_grad`` has activation
rows: neither is among them.
"""

from __future__ import annotations

import pandas as pd

from precprof import tables as T
from precprof.analysis.advisor.evidence import _Plan, _Run
from precprof.analysis.advisor.model import INFO, Finding
from precprof.analysis.advisor.rules.hardware import replicas
from precprof.analysis.advisor.text import _listing


def _params_per_module(run: _Run) -> pd.Series:
    """Per module, the elements of its parameters (the weight rows of the first sampled step, a DDP run's
    replicas counted once)."""
    w = run.kind(T.WEIGHT)
    if w.empty:
        return pd.Series(dtype=float)
    first = w[w[T.STEP] == w[T.STEP].min()].drop_duplicates([T.MODULE, T.PARAM])
    return first.groupby(T.texts(first[T.MODULE]).astype(object))[T.NUMEL].sum() // replicas(run)


def _rule_unused_modules(run: _Run, plan: _Plan) -> None:
    """Modules with parameters and neither an activation nor a weight-gradient row on any sampled step, in a run
    whose backward read weight gradients (a run without them says nothing of which modules trained)."""
    grads = run.kind(T.WEIGHT_GRAD)
    if grads.empty:
        return
    params = _params_per_module(run)
    ran = set(T.texts(run.kind(T.ACTIVATION, T.ACTIVATION_GRAD)[T.MODULE]))
    unused = run.sort(m for m in params.index if m not in ran and m not in set(T.texts(grads[T.MODULE])))
    if not unused:
        return
    n_unused, total = int(params[unused].sum()), int(params.sum())
    share = n_unused / total if total else 0.0
    steps = int(grads[T.STEP].nunique())
    plan.add(
        Finding(
            "unused_modules",
            INFO,
            f"{len(unused)} module(s) holding {100 * share:.3g}% of the parameters ran on no sampled step",
            f"{len(unused)} module(s) holding parameters ({_listing(unused, run.cfg.max_listed_modules)}) ran no "
            f"forward pass of their own and got no gradient on any of the {steps} sampled step(s) with weight "
            f"gradients: {n_unused:,} of the model's {total:,} parameters ({100 * share:.3g}%). Their "
            "weights still take memory, and so do their optimizer states where the optimizer holds them.",
            "If they should train, the forward pass never calls them nor uses their weights (a branch it skips: an "
            "encoder-decoder's cross-attention without encoder states, a layer built in __init__ and left out of "
            "forward, an expert no token reached); if they are meant to be idle in this training, freeze them "
            "(requires_grad_(False)) or leave them out of the model and the optimizer to save their memory. Under "
            "DDP, parameters that get no gradient need find_unused_parameters=True.",
            modules=unused,
            numbers={
                "unused_modules": len(unused),
                "unused_param_elements": n_unused,
                "param_elements": total,
                "unused_param_share": share,
                "sampled_steps_with_grads": steps,
            },
        )
    )

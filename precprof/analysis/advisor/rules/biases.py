"""Linear layers that train without their bias: ``quantize_`` made their weights torchao training weights whose
``F.linear`` leaves the bias out (``capture.bias_dropped``, ``capture.model_facts.dropped_biases``).

torchao 0.18's MX training weight (``MXFP8TrainingWeightWrapperTensor``, which ``quantize_(model,
MXFP8TrainingOpConfig(...))`` puts in an nn.Linear, every recipe alike) computes ``F.linear(input, weight, bias)``
as the MXFP8 matmul of input and weight alone: a bias of 5.0 gave outputs of mean 0.015, its gradient stayed None
and its values their initial ones, and no finding said it. Its FP8 training weight and its MXFP8Linear and
NVFP4Linear modules add their biases, and are no such layers: the capture tries each weight type's F.linear rather
than trusting its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from precprof import tables as T
from precprof import taxonomy
from precprof.analysis.advisor.evidence import _Plan, _Run
from precprof.analysis.advisor.model import WARNING, Finding
from precprof.analysis.advisor.text import _listing


def _rule_dropped_biases(run: _Run, plan: _Plan) -> None:
    """The layers whose bias their torchao training weight's F.linear left out, by the function at fault: what
    they lose (the bias in every output, its training), how large the biases are, and what keeps them."""
    capture = run.summary.get(T.SUMMARY_CAPTURE) or {}
    dropped = capture.get("bias_dropped") if isinstance(capture, Mapping) else None
    rows = [r for r in dropped or [] if isinstance(r, Mapping) and r.get("layer") is not None]
    if not rows:
        return
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        key = (str(r.get("weight_type", "")), str(r.get("config", "")), str(r.get("function", "")))
        groups.setdefault(key, []).append(r)
    layers = run.sort(str(r["layer"]) for r in rows)
    # subclasses of nn.Linear with a forward of their own: they lose the bias only where that forward passes it
    # to F.linear (nn.Linear's way), which the capture did not run to see
    own = run.sort(str(r["layer"]) for r in rows if r.get("own_forward"))
    values = sum(int(r.get("values") or 0) for r in rows)
    maxima = [float(r["absmax"]) for r in rows if isinstance(r.get("absmax"), (int, float))]
    lim = run.cfg.max_listed_modules
    said = []
    for (weight_type, config, function), group in groups.items():
        them = run.sort(str(r["layer"]) for r in group)
        n_values = sum(int(r.get("values") or 0) for r in group)
        top = [float(r["absmax"]) for r in group if isinstance(r.get("absmax"), (int, float))]
        largest = f", the largest |bias| {max(top):.3g}" if top else ""
        said.append(
            f"quantize_ with {config} made the weights of {len(them)} nn.Linear layer(s) ({_listing(them, lim)}) "
            f"torchao's {weight_type}, whose {function} computes F.linear(input, weight, bias) as the matmul of "
            f"input and weight alone: their biases ({n_values:,} values{largest}) are never added to the outputs "
            "and never train (their gradient stays None, so the optimizer leaves them at their initial values)"
        )
    mx = all(t in taxonomy.BLOCK_WEIGHT_TYPES for t, _, _ in groups)
    module = (
        "torchao's MXFP8Linear (torchao.prototype.moe_training.mxfp8_linear), which adds its bias, with each "
        "layer's weight and bias copied in"
        if mx
        else "torchao's module form of the same training (convert_to_float8_training's Float8Linear, "
        "MXFP8Linear), which adds its bias"
    )
    plan.add(
        Finding(
            "bias_dropped",
            WARNING,
            f"{len(layers)} linear layer(s) train without their bias: torchao's quantize_ weight leaves it out",
            "; ".join(said)
            + (
                f". {_listing(own, lim)} {'has a forward' if len(own) == 1 else 'have forwards'} of {'its' if len(own) == 1 else 'their'} own: "
                "such a layer loses its bias where that forward passes it to F.linear, as nn.Linear's does, and keeps "
                "it where the forward adds it itself (precprof did not run it to see)"
                if own
                else ""
            )
            + ". A model that later runs these layers without the conversion (its checkpoint "
            "loaded into plain nn.Linear layers) adds those untrained biases back. precprof found it by running "
            "F.linear with such a weight and a bias of ones at save: the output held no bias.",
            f"Build these layers as {module}, or leave them out of quantize_'s filter_fn; if they need no bias, "
            "make them with bias=False, so that the model says what it computes.",
            modules=layers,
            numbers={
                "bias_dropped_layers": len(layers),
                **({"bias_dropped_own_forward": len(own)} if own else {}),
                "bias_dropped_values": values,
                "bias_dropped_absmax": max(maxima) if maxima else None,
            },
        )
    )

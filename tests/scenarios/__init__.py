"""Small, readable training scenarios that exercise the advisor end to end on CPU (seconds each).

Each module builds a tiny model with one property the advisor must notice, trains it for a few steps in the
user's own loop with ``precprof.Profiler`` attached (``loop.train_profiled``), and is checked by
``tests/test_scenarios.py``:

- ``tiny_gradients``: activation gradients below fp16's 2^-24 (a loss weighted 2^-16): fp16 needs a large
  loss scale, and an fp16 run started at the recommended scale flushes fewer gradients than one at scale 1;
- ``huge_activations``: a layer whose outputs exceed fp16's 65504: fp16 only with that layer kept in fp32;
- ``benign``: nothing wrong: bf16 on bf16 hardware;
- ``nan_injection``: a module that emits nan on one step: the finding names it;
- ``accelerate_cpu_fp16``: accelerate's mixed_precision="fp16" on a CPU, silently fp32: flagged as not active;
- ``relu_zeros``: a ReLU classifier whose activation gradients are a third exact zeros in any format: fp16
  without a scaler flushes next to none of them, and the advisor must not read ReLU's zeros as flushes;
- ``dead_layers``: three layers whose gradients are all zero in fp16 under a GradScaler at 2^16 (in fp32 none
  is): the advisor must say so, not "nothing to fix";
- ``summed_loss``: gradients that overflow fp16 at GradScaler's default 2^16: the advised start skips none;
- ``weighted_loss``: a loss multiplied by a constant far from 1: gradients too large for any loss scale the
  advice allows, or too small for the largest (and for bf16);
- ``raw_features``: input features beyond 65504 that fp16 autocast's cast of a Linear's input makes inf: the
  inf comes from the input, not from inside the Linear;
- ``tiny_features``: input features scaled by 1e-7 that the Linear reading them casts to fp16: the layer to keep
  in fp32 is that Linear, not the module that made them;
- ``kept_gradients``: layers fp16 keeps in fp32 whose gradients are far from the rest: they stay fp32, and the
  loss scale fits the others; a kept layer's output gradient an fp16 Linear computes, which still counts.

They double as examples of the API: ``Profiler(model, optimizer=..., scaler=...)``, ``prof.step(loss=...)``,
``prof.tables()`` and ``precprof.recommend(tables, hardware=..., summary=...)``.
"""

"""precprof on a compiled model it did not write: nanoGPT's ``model.py`` (unmodified) under ``torch.compile``
(inductor; its C++ backend on the CPU), bf16 autocast, nanoGPT's own AdamW set-up (issue 34).

Given a nanoGPT checkout (``fetch github:karpathy/nanoGPT``; the script never downloads), it checks:

- **the same graph**: Dynamo's counters of a run without precprof and of a run with it (the default overhead
  budget, or ``--sample-every``): compiled graphs, graph breaks, recompiles (goal: 1, 0, 0 both);
- **determinism first**: the run without precprof, repeated, is bitwise the same (inductor's CPU kernels are
  deterministic only with one thread: with two, the baseline differs from itself, so nothing can be compared
  bitwise; the script runs with ``torch.set_num_threads(--threads)``, 1 by default);
- **never sampled, nothing changed**: a run with precprof attached that never samples (``sample_every=0``) is
  bitwise the run without it (losses and final weights);
- **unsampled steps unchanged**: with precprof sampling, each unsampled step, run from the same state (weights
  and optimizer state copied into a second compiled model), gives bitwise the same loss and weights as that
  model's step without precprof. (A sampled step runs eagerly, ``torch.compiler.set_stance("force_eager")``: its
  numerics are eager's, so the runs part after the first sampled step; the README says so.)
- **what a sampled step records**: the tensor kinds of the layers table, and the linear layers with activation
  gradients (the hooks fire under compile).

Usage: python bench/nanogpt_compile.py --nanogpt PATH [--steps 13] [--threads 1]
Writes bench/results/nanogpt_compile_cpu.json and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import precprof  # noqa: E402


def counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "compiled_graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "recompiles": int(counters["recompiles"].get("total", 0)) if "recompiles" in counters else 0,
    }


def reset_dynamo() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


class Setup:
    def __init__(self, model_py: Any, device: str) -> None:
        self.mod, self.device = model_py, device

    def model(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        cfg = self.mod.GPTConfig(
            n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=256, dropout=0.0, bias=False
        )
        m = self.mod.GPT(cfg).to(self.device)
        opt = m.configure_optimizers(0.0, 1e-3, (0.9, 0.95), self.device)
        return m, opt


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (8, 65), generator=g) for _ in range(n)]


def train_step(compiled: Any, opt: torch.optim.Optimizer, b: torch.Tensor) -> torch.Tensor:
    x, y = b[:, :-1].contiguous(), b[:, 1:].contiguous()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = compiled(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def whole_run(setup: Setup, bs: list[torch.Tensor], profiler: dict[str, Any] | None) -> dict[str, Any]:
    reset_dynamo()
    m, opt = setup.model()
    c = torch.compile(m)
    prof = (
        precprof.Profiler(m, optimizer=opt, memory=False, **profiler).attach()
        if profiler is not None
        else None
    )
    losses, sampled = [], []
    t0 = time.perf_counter()
    try:
        for b in bs:
            sampled.append(bool(prof is not None and prof.sampling))
            loss = train_step(c, opt, b)
            losses.append(loss)
            if prof is not None:
                prof.step(loss=loss)
    finally:
        if prof is not None:
            prof.detach()
    return {
        "losses": losses,
        "weights": [p.detach().clone() for p in m.parameters()],
        "sampled": sampled,
        "counts": counts(),
        "s": time.perf_counter() - t0,
    }


def bitwise(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["losses"], b["losses"], strict=True)) and all(
        torch.equal(x, y) for x, y in zip(a["weights"], b["weights"], strict=True)
    )


def same_state_steps(setup: Setup, bs: list[torch.Tensor], profiler: dict[str, Any]) -> dict[str, Any]:
    """Each unsampled step with precprof against the same step of a second compiled model from the same state."""
    reset_dynamo()
    m, opt = setup.model()
    c = torch.compile(m)
    ref, ref_opt = setup.model()
    ref_c = torch.compile(ref)
    equal: list[bool] = []
    sampled: list[int] = []
    with precprof.Profiler(m, optimizer=opt, memory=False, **profiler) as prof:
        for i, b in enumerate(bs):
            is_sampled = prof.sampling
            if is_sampled:
                sampled.append(i)
            else:
                ref.load_state_dict(m.state_dict())
                ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
            loss = train_step(c, opt, b)
            if not is_sampled:
                ref_loss = train_step(ref_c, ref_opt, b)
                equal.append(
                    bool(torch.equal(loss, ref_loss))
                    and all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters(), strict=True))
                )
            prof.step(loss=loss)
    layers = prof.tables()["layers"]
    linear_grads = layers[(layers.tensor == "activation_grad") & (layers.module_type == "Linear")]
    return {
        "counts": counts(),
        "sampled_steps": sampled,
        "unsampled_steps_bitwise_equal": equal,
        "tensor_kinds": sorted(set(layers.tensor)),
        "linear_layers_with_activation_grads": int(linear_grads.module.nunique()),
        "linear_layers": int(layers[layers.module_type == "Linear"].module.nunique()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    ap.add_argument("--steps", type=int, default=13)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (inductor's CPU kernels: 1 is deterministic)"
    )
    ap.add_argument("--sample-every", type=int, default=4, help="for the same-state check (default 4)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "nanogpt_compile_cpu.json")
    args = ap.parse_args()
    sys.path.insert(0, str(args.nanogpt))
    import model as model_py  # nanoGPT's model.py

    torch.set_num_threads(args.threads)
    setup = Setup(model_py, "cpu")
    bs = batches(args.steps)
    base = whole_run(setup, bs, None)
    again = whole_run(setup, bs, None)
    never = whole_run(setup, bs, {"sample_every": 0})
    default = whole_run(setup, bs, {})
    steps = same_state_steps(setup, bs, {"sample_every": args.sample_every})
    out = {
        "nanogpt_model_py": str(args.nanogpt / "model.py"),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "steps": args.steps,
        "without_precprof": base["counts"],
        "baseline_repeats_bitwise": bitwise(base, again),
        "never_sampled": {**never["counts"], "bitwise_equal_to_without": bitwise(base, never)},
        "default_budget": {
            **default["counts"],
            "sampled": [i for i, s in enumerate(default["sampled"]) if s],
        },
        "same_state": steps,
    }
    checks = {
        "one_graph_no_break_no_recompile": all(
            c == {"compiled_graphs": 1, "graph_breaks": 0, "recompiles": 0}
            for c in (base["counts"], never["counts"], default["counts"], steps["counts"])
        ),
        "baseline_deterministic": out["baseline_repeats_bitwise"],
        "never_sampled_bitwise": out["never_sampled"]["bitwise_equal_to_without"],
        "unsampled_steps_bitwise": bool(steps["unsampled_steps_bitwise_equal"])
        and all(steps["unsampled_steps_bitwise_equal"]),
        "hooks_fire_under_compile": steps["linear_layers_with_activation_grads"]
        == steps["linear_layers"]
        > 0,
    }
    out["checks"] = checks
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

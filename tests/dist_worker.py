"""Two-process gloo runs for tests/test_distributed.py, launched once by torchrun (``python -m
torch.distributed.run --standalone --nproc_per_node 2 dist_worker.py OUT``).

Each scenario trains the same tiny model on per-rank batches under a wrapper (DDP, FSDP2 ``fully_shard`` in
fp32 and with ``MixedPrecisionPolicy(bfloat16, float32)``, FSDP1), with a Profiler on every rank; rank 0 writes
``OUT/<scenario>/``. Every rank also dumps what the test needs to check the reduction: its losses and, under
FSDP, the full (all-gathered) parameters after training. The model, the batches and the step schedule live
here so that the test rebuilds them for its single-process reference.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from scenarios.loop import backward_and_step
from torch import nn

WORLD = 2
STEPS = 3
SAMPLE_EVERY = 2  # sampled steps 0 and 2; step 1 runs the hooks' fast path under collectives
NAN_STEP = 2  # DDP: rank 1's batch holds a nan at this step
NAN_RANK = 1
N_IN, N_HID, N_OUT = 8, 16, 5  # N_OUT = 5: FSDP shards the last layer unevenly (3 + 2 rows)
BATCH = 4
LR = 1e-2


def build_model() -> nn.Sequential:
    """The model every scenario and the reference start from (seeded)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(N_IN, N_HID), nn.GELU(), nn.Linear(N_HID, N_OUT))


def batch(step: int, rank: int, nan: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s micro-batch of step ``step``; with ``nan`` the NAN_RANK batch of NAN_STEP holds a nan."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, N_IN, generator=g) * 4.0
    y = torch.randn(BATCH, N_OUT, generator=g)
    if nan and step == NAN_STEP and rank == NAN_RANK:
        x[1, 3] = float("nan")
    return x, y


def make_optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR)  # type: ignore[arg-type]


def _wrap(model: nn.Module, scenario: str) -> nn.Module:
    from precprof.training.distributed import wrap_model

    if scenario == "fsdp2-bf16":
        return wrap_model(model, "fsdp2", param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if scenario.startswith(
        "fsdp1-orig"
    ):  # as accelerate and torch.compile wrap it: FSDP sets the shards' .grad
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, use_orig_params=True, device_id=torch.device("cpu"))
    return wrap_model(model, {"ddp": "ddp", "zero": "ddp", "fsdp2": "fsdp2", "fsdp1": "fsdp1"}[scenario])


def run_scenario(scenario: str, rank: int, out: Path) -> None:
    import precprof
    from precprof.capture.reducer import RankReducer

    model = _wrap(build_model(), scenario)
    opt = make_optimizer(model.parameters())
    if scenario == "zero":  # DDP, each rank holding its shard of Adam's states
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    # "-scaled": a loss scaler, which unscales the shards in place before the optimizer's hook reads them
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scenario.endswith("-scaled") else None
    prof = precprof.Profiler(model, optimizer=opt, scaler=scaler, sample_every=SAMPLE_EVERY)
    losses: list[float] = []
    # the gradients each optimizer step applied, as it got them (the test sums every rank's)
    applied: list[dict[str, list[float] | None]] = []
    if scenario == "fsdp1-orig":
        opt.register_step_pre_hook(
            lambda o, a, k: applied.append(
                {
                    n: None if p.grad is None else p.grad.flatten().tolist()
                    for n, p in model.named_parameters()
                }
            )
        )
    # FSDP1: this rank's FlatParameter shard on each step, sharded before the forward gathers it (padding in)
    flat_shards: list[list[float]] = []
    with prof:
        assert isinstance(prof._reducer, RankReducer), "the Profiler picks RankReducer under torchrun"
        for step in range(STEPS):
            if scenario == "fsdp1":
                flat_shards.append(next(model.parameters()).detach().tolist())
            x, y = batch(step, rank, nan=scenario == "ddp")
            loss = nn.functional.mse_loss(model(x), y)
            backward_and_step(loss, opt, scaler)
            opt.zero_grad(set_to_none=True)
            prof.step(loss=loss.detach(), tokens=BATCH)
            losses.append(loss.item())
    run_dir = out / scenario
    # every rank asks; only rank 0 writes (rank 1 would write elsewhere if it wrote at all)
    prof.save(
        run_dir if rank == 0 else out / f"{scenario}-rank{rank}", summary={"config": {"scenario": scenario}}
    )
    dump: dict[str, object] = {"losses": losses, "applied": applied, "flat_shards": flat_shards}
    if scenario == "zero":  # the bytes of this rank's optimizer states, each storage once
        states = {t.untyped_storage().data_ptr(): t for s in opt.optim.state.values() for t in s.values()}
        dump["state_bytes"] = sum(t.untyped_storage().nbytes() for t in states.values())
    if scenario == "fsdp1":  # the model's facts as precprof train records them, of the module FSDP1 wrapped
        from precprof.models.base import BuiltModel

        dump["n_params"] = BuiltModel(model, "fsdp1", "factory", None, None).info()["n_params"]
    if scenario.startswith("fsdp2"):
        # the full parameters after training, gathered from the shards (the reference must match them)
        dump["params"] = {n: p.full_tensor().tolist() for n, p in model.named_parameters()}
        dump["local_numel"] = {n: p.to_local().numel() for n, p in model.named_parameters()}
    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps(dump))


def run_shard_scale(scenario: str, rank: int, out: Path) -> None:
    """FSDP2 over a Linear(16, 32) whose rows 16..31, rank 1's shard, are 1e-6 of rank 0's (tester t6): at the
    whole tensor's current scale they flush, at the shard's own they do not. One sampled step, lr 0; dumps the
    full weight."""
    from torch.distributed.fsdp import fully_shard

    import precprof

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 4, bias=False))
    with torch.no_grad():
        model[0].weight[16:] *= 1e-6
    full = model[0].weight.detach().clone()
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1, memory=False)
    with prof:
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        prof.step(loss=torch.tensor(0.0))
    prof.save(out / scenario if rank == 0 else out / f"{scenario}-rank{rank}")
    (out / f"{scenario}-rank{rank}.json").write_text(json.dumps({"weight": full.tolist()}))


def run_join(rank: int, out: Path) -> None:
    """DDP's ``model.join()`` with uneven inputs: rank 0 has STEPS batches, rank 1 one fewer. Every step is
    sampled, so the last falls after rank 1 joined, when it runs only DDP's join hook."""
    import precprof

    model = _wrap(build_model(), "ddp")
    opt = make_optimizer(model.parameters())
    prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
    with prof, model.join():  # type: ignore[operator]
        for step in range(STEPS - rank):
            x, y = batch(step, rank)
            backward_and_step(nn.functional.mse_loss(model(x), y), opt, None)
            opt.zero_grad(set_to_none=True)
            prof.step(tokens=BATCH)
    prof.save(out / "ddp-join" if rank == 0 else out / f"ddp-join-rank{rank}")


TRAIN_STEPS = 4


# "rank0-only": how long an attaching rank waits before it warns (60 s in a real run), and the process group's
# timeout, as rank 0's store says it while it attaches alone (gloo's 30 minutes by default)
ALONE_WAIT_S = 0.5
ALONE_LIMIT_S = 3.0


def run_rank0_only(scenario: str, rank: int, out: Path) -> None:
    """A Profiler attached on rank 0 alone (``if rank == 0: prof = Profiler(...)``, a script's "log on rank 0"
    habit) under DDP: after ``ALONE_WAIT_S`` a warning names rank 1 and the fix, and past the group's timeout the
    attach is refused, its fix in the line (it left rank 0 in precprof's all-reduce and rank 1 in DDP's until the
    group's timeout); its warnings and message in ``OUT/rank0-only-rank0.said``. Then a Profiler on every rank,
    attached twice (two ``with`` blocks, one sampled step each), rank 1 the first time ``3 * ALONE_WAIT_S`` after
    rank 0 (rank 0 evaluating alone first, say): valid usage, met after rank 0's warning (a fixed wait had refused
    both ranks, each blaming the other: reviewer r1); the refused attach counted as none; the steps it recorded in
    ``OUT/rank0-only-rank<rank>.steps``, rank 0's warnings in ``OUT/rank0-only-late.said``."""
    import datetime
    import time
    import warnings

    import precprof
    from precprof import _compat
    from precprof.capture import every_rank
    from precprof.errors import UserError

    model = _wrap(build_model(), "ddp")
    opt = make_optimizer(model.parameters())
    store = _compat.default_store()
    wait, every_rank.ATTACH_WAIT_S = every_rank.ATTACH_WAIT_S, ALONE_WAIT_S
    try:
        if rank == 0:
            limit = store.timeout
            store.set_timeout(datetime.timedelta(seconds=ALONE_LIMIT_S))
            said: list[str] = []
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    alone = precprof.Profiler(model, optimizer=opt, out=out / scenario)
                    alone.attach()
                    alone.detach()
            except UserError as e:
                said.append(str(e))
            finally:
                store.set_timeout(limit)
            warned = [str(w.message) for w in seen if "attached a Profiler" in str(w.message)]
            (out / f"{scenario}-rank0.said").write_text("\n".join(warned + said))
        dist.barrier()  # (rank 1 attaches nothing before rank 0 was refused)
        prof = precprof.Profiler(model, optimizer=opt, sample_every=1)
        for step in range(2):
            if rank == 1 and step == 0:
                time.sleep(3 * ALONE_WAIT_S)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with prof:
                    x, y = batch(step, rank)
                    backward_and_step(nn.functional.mse_loss(model(x), y), opt, None)
                    opt.zero_grad(set_to_none=True)
                    prof.step(tokens=BATCH)
            if rank == 0 and step == 0:
                warned = [str(w.message) for w in seen if "attached a Profiler" in str(w.message)]
                (out / f"{scenario}-late.said").write_text("\n".join(warned))
    finally:
        every_rank.ATTACH_WAIT_S = wait
    (out / f"{scenario}-rank{rank}.steps").write_text(str(prof.current_step))


def run_train(
    scenario: str, rank: int, out: Path, model: list[str] | None = None, default_out: bool = False
) -> None:
    """``precprof train`` under torchrun (the command line as ``torchrun -m precprof train`` runs it); ``model``:
    the model, steps and batch size arguments instead of a one-layer gpt-nano's. ``default_out``: without
    ``--out``, in the working directory ``OUT/<scenario>``, each rank's clock a minute from the other's (the
    default name's timestamp: ranks start their runs seconds apart), the terminal in
    ``OUT/<scenario>-rank<rank>.stderr``."""
    from precprof.cli import main as cli_main

    strategy = "ddp" if model else scenario.removeprefix("train-")
    args = ["train", *(model or ["-m", "gpt-nano", "-a", "n_layer=1", "-a", "n_embd=32"])]
    args += [] if model else ["--steps", str(TRAIN_STEPS), "--batch-size", "2"]
    args += [
        "--seq-len",
        "16",
        "--sample-every",
        "2",
        "--no-progress",
        "--no-report",
        "--distributed",
        strategy,
    ]
    if not default_out:
        _cli(cli_main, [*args, "--out", str(out / scenario)])
        return
    with (
        _elsewhere(out / scenario, rank),
        (out / f"{scenario}-rank{rank}.stderr").open("w") as err,
        contextlib.redirect_stderr(err),
    ):
        _cli(cli_main, args)


def _cli(cli_main: Callable[[list[str]], None], args: list[str]) -> None:
    try:
        cli_main(args)
    except SystemExit as e:
        if e.code not in (0, None):
            raise RuntimeError(f"precprof train exited with {e.code}") from None


@contextlib.contextmanager
def _elsewhere(cwd: Path, rank: int) -> Iterator[None]:
    """In the working directory ``cwd``, rank ``rank``'s clock ``60 * rank`` seconds on (as precprof's default
    run name reads it)."""
    from precprof.training import config

    cwd.mkdir(parents=True, exist_ok=True)
    here, clock = Path.cwd(), config.time
    config.time = types.SimpleNamespace(  # type: ignore[assignment]
        strftime=lambda fmt: time.strftime(fmt, time.localtime(time.time() + 60 * rank))
    )
    os.chdir(cwd)
    try:
        yield
    finally:
        config.time = clock
        os.chdir(here)


# "train-fail": rank 1's model raises in the forward of this step, rank 0 goes on into DDP's all-reduce; its batch
# size tells the training steps' forwards (precprof train measures batches of 1 and 2 first)
FAIL_STEP, FAIL_BATCH = 1, 3


class FailingLM(nn.Module):
    """A language model for ``precprof train --model dist_worker.py:failing_lm``: rank 1's forward raises at
    FAIL_STEP, as a crash on one rank does (rank 0 then waits in the backward's all-reduce)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.emb, self.out, self.calls = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled() and x.shape[0] == FAIL_BATCH:
            if dist.get_rank() == 1 and self.calls == FAIL_STEP:
                raise RuntimeError(f"injected failure on rank 1 at step {FAIL_STEP}")
            self.calls += 1
        return self.out(self.emb(x))


def failing_lm(vocab_size: int) -> nn.Module:
    return FailingLM(vocab_size)


def run_fail(scenario: str, rank: int, out: Path) -> None:
    """``precprof train --distributed ddp`` whose rank 1 fails (``FailingLM``); rank 1 then leaves the group, as the
    command line's rank does when it owns it, which closes rank 0's connections in its all-reduce. The last
    scenario: the group is broken after it."""
    try:
        run_train(
            scenario,
            rank,
            out,
            ["--model", f"{__file__}:failing_lm", "--steps", "3", "--batch-size", str(FAIL_BATCH)],
            default_out=True,
        )
    finally:
        if rank == 1:
            dist.destroy_process_group()


def run_claim_fail(scenario: str, rank: int, out: Path) -> None:
    """``precprof train --distributed ddp`` without ``--out`` where rank 0 cannot create its run directory
    (``runs`` is a file there): every rank stops before the first step, none left waiting in a collective."""
    (out / scenario).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        (out / scenario / "runs").write_text("a file, not a folder")
    nano = ["-m", "gpt-nano", "-a", "n_layer=1", "-a", "n_embd=32", "--steps", "2", "--batch-size", "2"]
    run_train(scenario, rank, out, nano, default_out=True)


CUT_STEP = 2  # "cut": every rank raises after this step's forward, a sampled step, as a crash cuts a run off


def run_cut(scenario: str, rank: int, out: Path) -> None:
    """DDP, every rank raising mid-step (no rank left waiting in a collective): the run directory is what a run
    cut off before it saved leaves, its first summary.json and the steps it streamed."""
    import precprof

    model = _wrap(build_model(), "ddp")
    opt = make_optimizer(model.parameters())
    prof = precprof.Profiler(model, optimizer=opt, sample_every=SAMPLE_EVERY, out=out / scenario)
    try:
        with prof:
            for step in range(STEPS):
                x, y = batch(step, rank)
                loss = nn.functional.mse_loss(model(x), y)
                if step == CUT_STEP:
                    raise RuntimeError("cut off")
                backward_and_step(loss, opt, None)
                opt.zero_grad(set_to_none=True)
                prof.step(loss=loss.detach(), tokens=BATCH)
    except RuntimeError:
        pass
    if prof._owned_run is not None:
        prof._owned_run.release()  # as a killed job leaves it: its lock gone with it


def torchrun_env(rank: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank ``rank`` of a one-node world of WORLD (``--standalone``), but that rank 0
    holds the group's store (no launcher holds it for the ranks)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(WORLD),
        "LOCAL_WORLD_SIZE": str(WORLD),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(WORLD),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"precprof-tests-{port}",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def main(argv: list[str]) -> None:
    """Run under torchrun: ``python -m torch.distributed.run --standalone --nproc_per_node 2 dist_worker.py OUT``;
    or as each rank on its own, ``dist_worker.py OUT SCENARIOS RANK PORT`` (the test's fixture starts the ranks
    as forks of its preloaded Python, tests/forks.py: torchrun's launcher and two fresh interpreters cost some
    10 s of CPU in importing torch), which sets torchrun's variables for its rank (``torchrun_env``) first."""
    from precprof.training.distributed import init_from_env, shutdown

    if len(argv) == 4:
        os.environ.update(torchrun_env(int(argv[2]), int(argv[3])))
    out = Path(argv[0]).resolve()
    scenarios = (
        argv[1].split(",") if len(argv) > 1 else ["ddp", "fsdp2", "fsdp2-bf16", "train-ddp", "train-fsdp2"]
    )
    torch.set_num_threads(1)
    info = init_from_env()
    assert info is not None and info.world_size == WORLD, "run me under torchrun with 2 processes"
    out.mkdir(parents=True, exist_ok=True)
    broken = False  # the group, after "train-fail" (the last scenario)
    try:
        for scenario in scenarios:
            try:
                if scenario == "train-fail":
                    broken = True
                    run_fail(scenario, info.rank, out)
                elif scenario == "train-claim-fail":
                    run_claim_fail(scenario, info.rank, out)
                elif scenario.startswith("train-"):
                    run_train(scenario, info.rank, out)
                elif scenario == "ddp-join":
                    run_join(info.rank, out)
                elif scenario == "rank0-only":
                    run_rank0_only(scenario, info.rank, out)
                elif scenario == "cut":
                    run_cut(scenario, info.rank, out)
                elif scenario == "fsdp2-shard-scale":
                    run_shard_scale(scenario, info.rank, out)
                else:
                    run_scenario(scenario, info.rank, out)
            except Exception:  # the same failure on every rank (no rank left waiting in a collective)
                import traceback

                (out / f"{scenario}-rank{info.rank}.error").write_text(traceback.format_exc())
            if not broken:
                dist.barrier()
    finally:
        shutdown(barrier=not broken)


if __name__ == "__main__":
    main(sys.argv[1:])
    # Everything is written. Gloo's worker threads may still drop the last collective of a scenario, which the
    # barriers after it kept: where its tensors' Python objects died (DDP's, ZeroRedundancyOptimizer's), the drop
    # asks for the interpreter lock, and one asked while the interpreter finishes aborts the rank ("terminate
    # called without an active exception"; PyTorch's race, not the test's: precprof holds its own collectives'
    # tensors, test_the_reducers_tensors_outlive_their_collectives). Ending here, the interpreter does not finish.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

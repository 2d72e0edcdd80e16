"""Under torchrun: join the process group, wrap the model for data-parallel training (DDP, FSDP2 ``fully_shard``,
FSDP1), and leave the group once rank 0 has written the run. What the Profiler does with several ranks is
``precprof.capture.reducer.RankReducer``'s business."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from precprof import _compat
from precprof.errors import UserError
from precprof.modes import STRATEGIES


@dataclass(frozen=True)
class DistInfo:
    """This process's place under torchrun: global rank, world size, local rank and the device it trains on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool = False  # init_from_env created the process group (so the caller ends it: shutdown)

    @property
    def is_writer(self) -> bool:
        return self.rank == 0


def init_from_env(backend: str | None = None) -> DistInfo | None:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``...).

    Returns None outside torchrun (or with a world of one). Backend: NCCL with CUDA (each rank on
    ``cuda:LOCAL_RANK``), gloo on CPU. An already initialised group is reused.
    """
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1 and not (dist.is_available() and dist.is_initialized()):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    if dist.get_world_size() <= 1:
        return None
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


def shutdown(barrier: bool = True) -> None:
    """Leave the process group (after the run is written); a no-op without one. ``barrier=False`` after a
    failure, when the other ranks may never arrive."""
    if dist.is_available() and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()


# A collective that failed because another rank left: gloo's "Connection closed by peer" (or reset), NCCL's
# aborted communicator or its remote process's exit, torch's DistNetworkError. The consequence of another rank's
# failure, not this rank's own.
_PEER_LOST = re.compile(
    r"(connection (closed|reset) by peer|remote (worker|process)|communicator was aborted|broken pipe)", re.I
)


def lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective's failure because another rank left (``_PEER_LOST``)."""
    network = getattr(dist, "DistNetworkError", None)
    return (isinstance(network, type) and isinstance(e, network)) or bool(_PEER_LOST.search(str(e)))


def _failure_key(rank: int) -> str:
    """Where ``rank`` keeps its failure in the store, per attempt of an elastic job (its restarts share it)."""
    return f"precprof/failed/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _traceback_key(rank: int) -> str:
    """Where ``rank`` keeps its failure's traceback in the store (beside ``_failure_key``)."""
    return f"{_failure_key(rank)}/traceback"


# the most of a rank's traceback kept in the store (its end: the innermost frames and the error)
_TRACEBACK_CHARS = 64_000


def _one_line(e: BaseException, peer: bool = False) -> str:
    """``e`` in one line: its type and its message's first line, without gloo's "[file.cc:553] " prefix; ``peer``:
    its first sentence alone (gloo's goes on "This is typically caused by a remote worker crashing...")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    if peer:
        text = text.split(". ")[0]
    return f"{type(e).__name__}: {text[:300]}".rstrip(": ")


def record_failure(info: DistInfo, e: BaseException, said: str = "", trace: str = "") -> bool:
    """Keep this rank's own exception, in one line, in the process group's store (torchrun's rendezvous store),
    where the writing rank finds it when its collectives fail because this rank left (``failure_cause``): the run
    rank 0 saved gave rank 0's "Connection closed by peer" as its cause, the real error only on the terminal.
    ``said``: the line (the model's error as ``precprof train`` says it, with the model's file and line; default
    "Type: message"); ``trace``: its traceback, for rank 0's traceback.txt (``peer_traceback``; its last
    ``_TRACEBACK_CHARS`` characters). Call it before leaving the group. Not for a lost peer's error (another rank's
    consequence). Best effort, no collective: a store that cannot be reached is passed over. Whether it was kept."""
    store = _compat.default_store()
    if store is None or lost_peer(e):
        return False
    if len(trace) > _TRACEBACK_CHARS:
        trace = f"... ({len(trace) - _TRACEBACK_CHARS} characters left out)\n{trace[-_TRACEBACK_CHARS:]}"
    try:
        if trace:  # (first: a rank whose failure is there has its traceback there)
            store.set(_traceback_key(info.rank), trace)
        store.set(_failure_key(info.rank), said or _one_line(e))
    except Exception:
        return False
    return True


def _failed_first(info: DistInfo, key: Callable[[int], str] = _failure_key) -> tuple[int, str] | None:
    """The first other rank that recorded its failure (``record_failure``) and what it recorded under ``key``
    (its line; ``_traceback_key``: its traceback, None where it left none); None where no rank did."""
    store = _compat.default_store()
    for rank in range(info.world_size) if store is not None else ():
        if rank == info.rank:
            continue
        try:
            if not store.check([_failure_key(rank)]):
                continue
            if not store.check([key(rank)]):
                return None
            return rank, store.get(key(rank)).decode(errors="replace")
        except Exception:  # the store gone with the group: what this rank saw is all there is
            return None
    return None


def peer_traceback(info: DistInfo) -> tuple[int, str] | None:
    """The rank whose failure ``failure_cause`` names and the traceback it left in the store; None where it left
    none (killed, or a precprof that kept no traceback)."""
    return _failed_first(info, _traceback_key)


def failure_cause(info: DistInfo, e: BaseException, reason: str, interrupted: bool) -> str:
    """The cause the writing rank's run directory gives for ``e`` (``reason``: its own words for it): where ``e``
    is the consequence of another rank's failure (a lost peer, or a SIGTERM, as torchrun sends the other ranks
    when one fails), that rank's own error as it recorded it (``record_failure``), or that another rank stopped
    first and its error is in its own output. ``reason`` as it was for any other failure."""
    peer = not interrupted and lost_peer(e)
    if not (peer or interrupted):
        return reason
    then = f"lost its connection to it ({_one_line(e, peer=True)})" if peer else f"was {reason}"
    found = _failed_first(info)
    if found is not None:
        rank, said = found
        return f"rank {rank} failed first: {said}; rank {info.rank} then {then}"
    if not peer:
        return reason
    return (
        f"another rank stopped first: rank {info.rank} {then}; that rank's error is in its own output (torchrun "
        "prefixes its lines with [rankN])"
    )


def share_run_dir(info: DistInfo, path: Path | None, failed: BaseException | None = None) -> Path:
    """The run directory rank 0 claimed, on every rank. Each rank made its own default name
    (``runs/<model>-<precision>-<timestamp>``) at its own second, and only rank 0 claims one (``-2`` when it
    exists): another rank's "rank 0 saves what it recorded to ..." and its ``TrainResult`` named a directory no
    rank wrote. One ``broadcast_object_list`` from rank 0 on the default group, once, before the first step (no
    hook is attached yet). ``path``: on rank 0, the directory it claimed; ``failed``: rank 0's failure to claim
    one, which the other ranks raise, in one line, instead of training on into a collective rank 0 never
    joins."""
    said: list[object] = [None if path is None else str(path), None if failed is None else _said(failed)]
    dist.broadcast_object_list(said, src=0)
    if said[1] is not None:
        if failed is not None:  # rank 0's own
            raise failed
        raise UserError(f"rank 0 could not claim the run directory, so no rank trains: {said[1]}")
    return Path(str(said[0]))


def _said(e: BaseException) -> str:
    """``e`` in one line, as the other ranks repeat it: a UserError's own line (it names the fix), else its type
    too."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return text if isinstance(e, UserError) and text else _one_line(e)


def _shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards as units: the blocks of every ``nn.ModuleList`` (a transformer's layers), else
    every leaf module that owns parameters; a module holding a parameter that a module outside it holds too (a
    head tied to its embedding) is no unit, its parameters left to the root's (FSDP2 refuses a parameter two
    groups manage: "Parameter 'head.weight' is shared with a parameter already managed by another FSDP
    group")."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1

    def alone(unit: nn.Module) -> bool:
        inside: dict[int, int] = {}
        for m in unit.modules():
            for p in m.parameters(recurse=False):
                inside[id(p)] = inside.get(id(p), 0) + 1
        return all(owners[key] == n for key, n in inside.items())

    blocks = [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]
    if blocks:
        return [m for m in blocks if alone(m)]
    return [
        m
        for m in model.modules()
        if m is not model
        and next(m.children(), None) is None
        and next(m.parameters(recurse=False), None) is not None
        and alone(m)
    ]


def gathered_unit_bytes(model: nn.Module, strategy: str) -> int:
    """Bytes an FSDP rank holds whole at the peak of the largest unit ``wrap_model`` shards ``model`` into: its
    parameters, all-gathered for its forward and backward, and their gradients before the reduce-scatter (as the
    model is now: its dtypes, each tied parameter once). FSDP2's units are the blocks (``_shard_units``) and the
    root with the parameters left to it; FSDP1's one unit is the whole model; DDP gathers nothing (0)."""
    if strategy.lower() not in ("fsdp1", "fsdp2"):
        return 0

    def held(params: list[nn.Parameter]) -> int:
        return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in params)

    every = {id(p): p for p in model.parameters()}
    if strategy.lower() == "fsdp1":
        return held(list(every.values()))
    units = [{id(p): p for p in unit.parameters()} for unit in _shard_units(model)]
    in_units = {key for unit in units for key in unit}
    root = [p for key, p in every.items() if key not in in_units]
    return max([held(root), *(held(list(unit.values())) for unit in units)])


def wrap_model(
    model: nn.Module,
    strategy: str = "ddp",
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> nn.Module:
    """Wrap ``model`` for data parallel training under an initialised process group.

    ``ddp``: ``DistributedDataParallel``; ``fsdp2``: ``fully_shard`` on each block (``_shard_units``) and on the
    root, with ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``; ``fsdp1``: ``FullyShardedDataParallel`` with
    ``MixedPrecision(param_dtype, reduce_dtype)`` (on the CPU, gloo, when no accelerator is there and no
    ``device`` is given). Returns the module to train (FSDP2 shards in place and returns ``model`` itself). DDP
    has no parameter or reduction dtype: asking it for one is a UserError (16-bit compute under DDP is
    ``torch.autocast``'s), where it trained in fp32 without a word.
    """
    strategy = strategy.lower()
    cuda_ids = [device.index] if device is not None and device.type == "cuda" else None
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        if param_dtype is not None or reduce_dtype is not None:
            raise UserError(
                "wrap_model(..., 'ddp'): DDP has no param_dtype or reduce_dtype (it keeps the model's dtypes); "
                "compute in 16-bit under torch.autocast, or use 'fsdp2' with its MixedPrecisionPolicy"
            )
        return DistributedDataParallel(model, device_ids=cuda_ids)
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for unit in _shard_units(model):
            fully_shard(unit, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model
    if strategy == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

        mp = (
            MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            if param_dtype or reduce_dtype
            else None
        )
        if device is None and not torch.cuda.is_available():  # FSDP1 asks for a device; on gloo, the CPU
            device = torch.device("cpu")
        return FullyShardedDataParallel(model, mixed_precision=mp, device_id=device)
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")

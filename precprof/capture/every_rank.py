"""Every rank attaches: a Profiler that combines the ranks' statistics (``RankReducer``) checks at attach that the
Profiler of every other rank of its group attaches too, and refuses, in one line that says the fix, a Profiler
attached on some ranks only.

``if rank == 0: prof = Profiler(...)`` (a script's "log on rank 0" habit) left rank 0 in precprof's all-reduce of
its first sampled step while rank 1 waited in DDP's next collective: both hung until the process group's timeout
(gloo's default: 30 minutes), then failed with gloo's "Timed out waiting 20000ms for recv" and nothing of the fix;
a mismatched pair of collectives could as well have matched precprof's all-reduce with one of DDP's and mixed
their buffers. At attach each rank sets its key in the default group's store (no collective, nothing on a step)
and waits for every other rank's of the same attach: the ranks' n-th attaches of a process meet (a Profiler
attached again after ``detach()``, a resumed run's in the same process: every rank counts alike). A rank still
alone after ``ATTACH_WAIT_S`` warns, naming the ranks it waits for and the fix, and waits on, as long as the
process group's own timeout (its store's: what DDP's next collective would wait): ranks that attach minutes
apart (rank 0 evaluating or saving a checkpoint alone first) are valid usage, refused by a fixed 60 s on every
rank, each blaming the other. Past the group's timeout the attach is refused in one line that says the fix, and
is none (its key goes, its number is the next attach's).
"""

from __future__ import annotations

import contextlib
import time
import zlib
from typing import Any

import torch.distributed as dist

from precprof import _compat
from precprof._notice import notice
from precprof.errors import UserError

# how long an attaching rank waits for the others' Profilers to attach before it warns (ranks of one script attach
# within seconds of each other); it waits on for the process group's timeout
ATTACH_WAIT_S = 60.0
_MAX_PAUSE_S = 0.05  # the longest pause between two looks at the store
_attaches: dict[str, int] = {}  # attaches of this process that met, per group (its global ranks' crc)


def _ranks(group: Any) -> list[int]:
    """The global ranks of ``group`` (None: the default group), by group rank."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _listed(ranks: list[int]) -> str:
    """ "rank 1", "ranks 1 and 2", "ranks 1, 2, 3 and 60 more"."""
    said = [str(r) for r in ranks[:3]]
    if len(ranks) > 3:
        return f"ranks {', '.join(said)} and {len(ranks) - 3} more"
    return "rank " + said[0] if len(said) == 1 else f"ranks {', '.join(said[:-1])} and {said[-1]}"


def _group_timeout_s(store: Any) -> float:
    """The process group's timeout, as its store keeps it (``init_process_group(timeout=...)``; gloo's 30 minutes
    by default): how long the ranks' collectives wait for each other."""
    with contextlib.suppress(Exception):
        return float(store.timeout.total_seconds())
    return 1800.0


def meet(reducer: Any) -> None:
    """Wait until every rank of ``reducer``'s group (a ``RankReducer``) attached its Profiler too: a warning after
    ``ATTACH_WAIT_S`` that names the ranks it waits for, and a UserError once the process group's timeout passed.
    Nothing to wait for in a world of one rank, or where no store can be reached (the first sampled step's
    collectives are then the check, as before)."""
    world, rank = int(reducer.world_size), int(reducer.rank)
    store = _compat.default_store()
    if world <= 1 or store is None:
        return
    ranks = _ranks(reducer.group)
    group = f"{zlib.crc32(','.join(map(str, ranks)).encode()):08x}"
    n = _attaches.get(group, 0)

    def key(r: int) -> str:
        return f"precprof/attached/{group}/{n}/{r}"

    def missing() -> list[int]:
        return [ranks[r] for r in range(world) if r != rank and not store.check([key(r)])]

    others = [key(r) for r in range(world) if r != rank]
    try:
        store.set(key(rank), "1")
    except Exception:  # a store this torch cannot write to: no check
        return
    limit = _group_timeout_s(store)
    start, pause, warned = time.monotonic(), 0.001, False
    while not store.check(others):
        waited = time.monotonic() - start
        if waited >= limit:
            absent = missing()
            if absent:
                with contextlib.suppress(Exception):  # refused: this attach is none (the next one is n again)
                    store.delete_key(key(rank))
                raise UserError(
                    f"rank {ranks[rank]} attached a Profiler but {_listed(absent)} did not within the process "
                    f"group's timeout ({limit:g} s): attach it on every rank (or pass reducer=None to profile "
                    "this rank alone)"
                )
            break
        if not warned and waited >= ATTACH_WAIT_S:
            warned = True
            notice(
                f"precprof: rank {ranks[rank]} attached a Profiler {ATTACH_WAIT_S:g} s ago and waits for "
                f"{_listed(missing())} to attach theirs, up to the process group's timeout ({limit:g} s): every "
                "rank attaches a Profiler (or passes reducer=None to profile itself alone)"
            )
        time.sleep(pause)
        pause = min(2 * pause, _MAX_PAUSE_S)
    _attaches[group] = n + 1

"""A user's own training loop that streams into a run directory, for tests/test_stream.py to kill and resume
(``python stream_worker.py MODE OUT [CHECKPOINT]``).

Modes:

- ``forever``: trains until it is killed, every step sampled, and prints "streaming PID" (its writer process) once its first flush is on
  disk (the test kills it at a random moment after that);
- ``peek``: ``forever`` with a ``prof.report()`` after step PEEK_AT, a look at the run so far as a notebook takes
  one, and "streaming PID" once the steps up to PEEK_AT + 2 are on disk;
- ``full``: steps 0..STEPS-1 uninterrupted, then ``prof.save()``;
- ``crash``: steps 0..CRASH_AT, writing the checkpoint (model, optimizer) when step CHECKPOINT_AT begins, then
  kills itself with SIGKILL: the steps it recorded after the checkpoint are in the stream;
- ``resume``: loads the checkpoint and runs steps CHECKPOINT_AT..STEPS-1 with ``Profiler(out, resume=True,
  first_step=CHECKPOINT_AT)``, then ``prof.save()``.

Batches depend on the step alone and every run uses one thread, so the resumed run trains exactly as the
uninterrupted one.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

import precprof

STEPS = 14
SAMPLE_EVERY = 3
CHECKPOINT_AT = 6  # the checkpoint holds the state before this step
CRASH_AT = 10  # the crashing run dies after this step: steps 6..10 were recorded and are recorded again
PEEK_AT = 2  # the peeking run reports after this step, and goes on training


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, prof: precprof.Profiler, step: int) -> None:
    loss = model(batch(step)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    prof.step(loss=loss.detach())


def main(mode: str, out: Path, checkpoint: Path | None) -> None:
    torch.set_num_threads(1)
    model, opt = build()
    if mode in ("forever", "peek"):
        prof = precprof.Profiler(model, opt, sample_every=1, out=out)
        with prof:
            step = 0
            while True:
                train_step(model, opt, prof, step)
                if mode == "peek" and step == PEEK_AT:
                    prof.report()  # the run so far; the Profiler stays attached and the loop trains on
                if step == (1 if mode == "forever" else PEEK_AT + 2):
                    prof.tables()  # waits for the writer: the first flushes are on disk
                    sink = prof._recorded.sink
                    writer = sink._proc.proc.pid if sink is not None and sink._proc is not None else 0
                    print(f"streaming {writer}", flush=True)  # the writer process's pid (0: a thread)
                step += 1
    assert checkpoint is not None or mode == "full"
    first = 0
    if mode == "resume":
        assert checkpoint is not None
        state = torch.load(checkpoint)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        first = CHECKPOINT_AT
    # memory on every sampled step: a resumed process measures its own first sampled steps, so only then do
    # the memory tables of the resumed and the uninterrupted run compare row for row
    prof = precprof.Profiler(
        model,
        opt,
        sample_every=SAMPLE_EVERY,
        out=out,
        resume=mode == "resume",
        first_step=first,
        memory_every=1,
    )
    with prof:
        for step in range(first, STEPS):
            if mode == "crash" and step == CHECKPOINT_AT:
                assert checkpoint is not None
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
            train_step(model, opt, prof, step)
            if mode == "crash" and step == CRASH_AT:
                # what was flushed is on disk, as a writer thread would have it a moment later; step 10 waits on
                # the device, and dies with the process (``prof.tables()`` would copy it first)
                sink = prof._recorded.sink
                assert sink is not None
                sink.drain()
                os.kill(os.getpid(), signal.SIGKILL)
    prof.save()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]) if len(sys.argv) > 3 else None)

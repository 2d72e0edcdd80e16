"""torch's own log lines while a compiled model trains, held until its step ends.

When a ``torch.compile``d model fails, Dynamo and its fake tensors log the error with its traceback
(``E1201 ... torch/_subclasses/fake_tensor.py:3090] failed while attempting to run meta for aten.mm.default``
and 20 lines of torch's frames) before raising it: they printed above ``precprof train``'s one line, which says
that error already, in the model's words. ``Held`` keeps what torch's own terminal handlers
(``_compat.torch_log_handlers``) are given during a step: a step that ends releases it to them, as it was
logged (a warning about a graph break or a recompile is printed, one step late at most); the step that failed
puts it into the run's traceback.txt (``text``, then ``drop``). Nothing is held outside the steps, nor from any
other handler (a ``TORCH_LOGS_OUT`` file, the user's own), and ``close`` takes the filters off: the logging
configuration is as it was after the run.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from precprof import _compat

# set on a record being released, so that the handler's filter (ours) lets it through
_RELEASED = "_precprof_released"


class Held:
    """The records ``handlers`` were given since the last ``release``, in order, held back from them while
    ``Held`` is open (each handler gets a filter of its own). Records may come from other threads (inductor's
    compile threads)."""

    def __init__(self, handlers: Sequence[logging.Handler]) -> None:
        self._lock = threading.Lock()
        self._records: list[tuple[logging.Handler, logging.LogRecord]] = []
        self._filters = [(h, self._filter_for(h)) for h in handlers]
        for handler, f in self._filters:
            handler.addFilter(f)

    @classmethod
    def of_torch(cls, active: bool) -> Held:
        """Holding what torch's terminal handlers print (``active``: the model is compiled), or nothing: nothing
        either where the user asked torch for its logs (``TORCH_LOGS`` set): those print as they come, a compile
        that hangs included."""
        asked = bool(os.environ.get("TORCH_LOGS"))
        return cls(_compat.torch_log_handlers() if active and not asked else [])

    def _filter_for(self, handler: logging.Handler) -> logging.Filter:
        held = self

        class _Hold(logging.Filter):
            def filter(self, record: logging.LogRecord) -> bool:
                if getattr(record, _RELEASED, False):
                    return True
                with held._lock:
                    held._records.append((handler, record))
                return False

        return _Hold()

    def _take(self) -> list[tuple[logging.Handler, logging.LogRecord]]:
        with self._lock:
            taken, self._records = self._records, []
        return taken

    def release(self) -> None:
        """Hand what is held to the handlers it was meant for (the step ended: it is no failure's)."""
        for handler, record in self._take():
            setattr(record, _RELEASED, True)
            try:
                handler.handle(record)
            except Exception:  # a handler's failure is the logging's, never the training's
                handler.handleError(record)

    def text(self) -> str:
        """What is held, each record once, as its handler formats it ("" for nothing)."""
        with self._lock:
            records = list(self._records)
        seen: set[int] = set()
        lines = []
        for handler, record in records:
            if id(record) in seen:
                continue
            seen.add(id(record))
            try:
                lines.append(handler.format(record))
            except Exception:  # a record that cannot be formatted: its message as given
                lines.append(str(record.msg))
        return "\n".join(lines)

    def drop(self) -> None:
        """Forget what is held (it was written into the run's traceback.txt)."""
        self._take()

    def close(self) -> None:
        """Release what is still held and take the filters off the handlers."""
        for handler, f in self._filters:
            handler.removeFilter(f)
        self._filters = []
        self.release()

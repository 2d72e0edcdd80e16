"""The ``precprof`` command and ``python -m precprof`` (also what ``torchrun -m precprof train ...`` runs).

The command line's modules (typer, pandas, Arrow, the report: about a second) load inside ``main``, where a
Ctrl-C is one line and exit code 130 like a Ctrl-C at any later moment, never a KeyboardInterrupt traceback
(``import precprof`` itself loads nothing heavy).
"""

from __future__ import annotations

import sys

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as precprof.cli exits after a Ctrl-C


def main() -> None:
    """Entry point of the ``precprof`` console script."""
    try:
        from precprof.cli import main as run

        run()  # handles a Ctrl-C itself once its command runs; one before that (building it) ends here
    except KeyboardInterrupt as e:
        print("precprof: interrupted", file=sys.stderr)
        code = getattr(e, "exit_code", EXIT_INTERRUPTED)  # a SIGTERM's Interrupted: 143
        sys.exit(code if isinstance(code, int) else EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()

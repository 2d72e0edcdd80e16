"""``python tests/forked_children.py SCRIPT ARGS...`` runs ``python SCRIPT ARGS...`` with the Pythons the
script starts through ``subprocess.run`` (``sys.executable`` with a script, ``-m`` or ``-c``) started as forks of
one Python that has imported torch and precprof (tests/forks.py), not each a fresh interpreter that spends 3-4 s
of CPU importing them.

For a bench script's dry run (bench/gpu_validate.py: host_cost.py, overhead.py, the first-step scripts, pytest's
collection), whose test checks what the children compute and that the script exits 0, not how a fresh Python
starts. Each child is still a process of its own (pid, exit code, pipes, environment, working directory, argv);
a command tests/forks.py cannot fork (``git``, an interpreter option, another import environment) is a real
process, as the script asked."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import forks

_real_run = subprocess.run


def _run(args: Any, *posargs: Any, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    if posargs or not isinstance(args, list) or not args or args[0] != sys.executable:
        return _real_run(args, *posargs, **kwargs)
    return forks.run(args, **kwargs)


def main() -> None:
    # read when Triton compiles (triton.knobs reads the environment then), not when torch or precprof load: the
    # first-step runs' own empty cache folder is no other import environment (no second preloaded Python)
    runtime_env = getattr(forks, "_RUNTIME_ENV", None)
    if isinstance(runtime_env, set):
        runtime_env.add("TRITON_CACHE_DIR")
    subprocess.run = _run  # type: ignore[assignment]  # (the script calls subprocess.run)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()

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


def _serve_from_here() -> dict[str, Any] | None:
    """Where this process is a fork of tests/forks.py's server (torch and precprof imported before this script
    ran: it imports neither), the script's children are forks of this process as it starts, not of a fresh
    Python that imports torch and precprof again (3-4 s of CPU a dry run): None here, a request in each child.
    The folder precprof was imported from is on their ``sys.path``, as their PYTHONPATH says (bench scripts
    set PYTHONPATH=ROOT, where the precprof already imported is)."""
    if not {"torch", "precprof"} <= set(sys.modules):
        return None
    root = Path(sys.modules["precprof"].__file__ or "").resolve().parents[1]
    return forks.serve_from_here([str(root)])


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
    request = _serve_from_here()
    if request is not None:  # a child of the server forked above: the command it asked for, then its end
        forks._become(request)
    else:
        main()

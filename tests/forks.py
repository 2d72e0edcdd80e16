"""Python processes for the tests, started as forks of a Python that has already imported torch and precprof.

Each ``python -m precprof train``, ``python -c SCRIPT`` or ``python worker.py`` a test starts spent 3-4 s of CPU
before its first step (importing torch, then torch._dynamo, which torch's optimizers import when made): most of
what the process-level tests of test_stream.py and test_faults.py cost. Here a server process (one per pytest
worker and import environment, started at the first use) imports them once and forks a child per process asked
for. The child is a process of its own, as a fresh Python is: its own pid, signals sent to it and its exit code
(``sys.exit``'s, 1 after an uncaught exception, -SIGNUM when a signal ended it, -2 after an uncaught
KeyboardInterrupt), its own stdin/stdout/stderr (pipes, as ``subprocess.PIPE`` makes), environment, working
directory, ``sys.argv`` and ``sys.path[0]``; the interpreter's own end (atexit, the wait for its threads). What
differs from a fresh Python: torch, precprof's package and the modules of ``_PRELOAD`` (pandas, Arrow, precprof's
commands) are imported before the command runs (a test of what happens while they load starts a real Python),
Arrow's allocator runs without its background thread, the random seeds of hash() and numpy are the server's, and
torch's C++ log level (``TORCH_CPP_LOG_LEVEL``, read as torch loads) is ERROR where the child's environment names
none, as ``python -m precprof`` sets it before it loads torch: one server serves the commands and the scripts of a
worker (a second cost 3-4 s of CPU), and a script's child prints none of c10's C++ warnings (Python's warnings it
does).

``popen`` and ``run`` take ``subprocess.Popen``'s and ``subprocess.run``'s arguments; a command they cannot start
as a fork (not ``sys.executable`` with ``-m``, ``-c`` or a script, an interpreter option, or an environment that
differs from the server's in a variable read at import) is started as a real process, so a test never depends on
the server to be right."""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import locale
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import processes

# variables read when the program runs (not when torch or precprof are imported): a child's may differ from the
# server's; any other difference starts a real process
_RUNTIME_ENV = {
    "PYTHONUNBUFFERED",
    "PYTHONFAULTHANDLER",
    "EXIT_WITH",
    "FORWARDS",
    "PRECPROF_HELPER_NICENESS",
    "PRECPROF_BLOCK_FORMATS",
    "KINETO_LOG_LEVEL",  # (read when the first profiler starts: precprof's commands set it, _compat quiets it)
    "WANDB_SILENT",  # (wandb's: the server does not import wandb)
    "WANDB_MODE",
    "WANDB_DIR",
    "TORCHINDUCTOR_CACHE_DIR",  # (set in this process by its first torch.compile; read when compiling)
    # set in this process by inductor before it loads each compiled library, read by the library as it loads
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "PYTORCH_NVML_BASED_CUDA_CHECK",  # (set by lightning's import; read by torch.cuda.is_available())
}
_MAX_MESSAGE = 1 << 20
# a file to say why a command was not forked (a check of this module)
_LOG = os.environ.get("PRECPROF_TEST_FORKS_LOG")


def _log(text: str) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {text}\n")


# read as torch loads; a server loads it with this value where the child's environment has none (see above)
_CPP_LOG = ("TORCH_CPP_LOG_LEVEL", "ERROR")


def _import_env(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """What a server's environment must share with its children's (PYTHONPATH: see ``_Server.path``)."""
    skip = {*_RUNTIME_ENV, "PYTHONPATH"}
    env = dict([_CPP_LOG, *env.items()])
    return tuple(sorted((k, v) for k, v in env.items() if k not in skip and not k.startswith("PYTEST_")))


# ------------------------------------------------------------------------------------------------ the server
# Imported by the server after torch and precprof: the libraries of precprof's commands and pages and precprof's
# own modules that import them (0.6-0.7 s of CPU less in each child that trains, reports or runs a command). Each
# reads its settings from the environment (a server's own: see ``_import_env``) or when used, except matplotlib,
# which reads a ``matplotlibrc`` in the working directory as it loads: the server's, never a child's (no test writes
# one). None starts a thread but Arrow's allocator (jemalloc, loaded with pandas), whose background thread a fork
# may leave behind (``_threads``): jemalloc's own fork handlers take its locks around the fork, and a child runs with
# its background threads off, as ``JE_ARROW_MALLOC_CONF=background_thread:false`` would (unused memory is handed
# back as the allocator works, not by a thread of its own).
_PRELOAD = (
    "matplotlib",
    "matplotlib.pyplot",
    "matplotlib.backends.backend_agg",
    "jinja2",
    "typer",
    "rich.console",
    "PIL.Image",
    "tqdm",
    "pandas",
    "pyarrow.parquet",
    "precprof.cli",
    "precprof.capture",
    "precprof.training",
    "precprof.pipeline",
    "precprof.report.render",
    "precprof.stream_child",
)
# threads a fork may leave behind: their library's fork handlers make the child whole without them
_FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def _threads() -> int:
    """This process's native threads, less those of ``_FORK_SAFE_THREADS``."""
    try:
        names = []
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        return sum(name not in _FORK_SAFE_THREADS for name in names)
    except OSError:
        return 0  # cannot tell: no fork


def _serve(sock: socket.socket) -> dict[str, Any]:
    """Fork a child per request until the client goes; in a child, return its request (the parent never returns)."""
    import torch

    import precprof  # noqa: F401

    for name in _PRELOAD:  # what every command and report imports next
        with contextlib.suppress(ImportError):
            __import__(name)
    # the imports' objects (some 300,000) out of the collector's reach in every child, as in the tests' own
    # process (conftest.py): each full collection read them all again, a fifth of a report's time. Before
    # torch._dynamo loads Triton: its bindings (nanobind) print each of their objects still alive as a child's
    # interpreter ends (a frozen one never is) as leaked
    gc.collect()
    gc.freeze()
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # (imports torch._dynamo)
    # (Python 3.12 on warns of a fork beside any other thread; jemalloc's is safe: see _PRELOAD)
    warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
    # woken by a child's end (SIGCHLD, through the wakeup pipe) or a request, never polling
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake)
    sock.send(json.dumps(sys.path).encode())
    while True:
        while True:  # the children that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())
        ready = select.select([sock, woken], [], [], 5)[0]
        if woken in ready:
            os.read(woken, 4096)
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 3)
        if not data:  # the client ended
            os._exit(0)
        if _threads() != 1:  # a fork keeps only this thread: refuse, never hang
            for fd in fds:
                os.close(fd)
            sock.send(b"refused")
            continue
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (woken, wake):
                os.close(fd)
            sock.close()
            for i, fd in enumerate(fds):
                os.dup2(fd, i)
                os.close(fd)
            return json.loads(data)  # type: ignore[no-any-return]
        for fd in fds:
            os.close(fd)
        sock.send(f"started {pid}".encode())


def _become(request: dict[str, Any]) -> None:
    """Run the request's command in this (forked) process, as ``python ARGS`` runs it."""
    import faulthandler
    import runpy
    import types

    env: dict[str, str] = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    buffered = not env.get("PYTHONUNBUFFERED")
    sys.stdout.reconfigure(write_through=not buffered)  # type: ignore[union-attr]
    sys.stderr.reconfigure(write_through=not buffered)  # type: ignore[union-attr]
    if env.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    args: list[str] = request["args"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]  # (runpy puts the module's file first)
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(args)
        sys.path[0] = str(Path(args[0]).resolve().parent)
        runpy.run_path(args[0], run_name="__main__")


# ------------------------------------------------------------------------------------------------ the client
class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.lock = threading.Lock()
        self.ended: dict[int, int] = {}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env={_CPP_LOG[0]: _CPP_LOG[1], **env, "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=False,
        )
        theirs.close()
        said = self._recv(timeout=300)
        self.path: list[str] = json.loads(said) if said else []  # the server's sys.path
        self.ready = bool(self.path)

    def _recv(self, timeout: float | None) -> str | None:
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        data = self.sock.recv(_MAX_MESSAGE)
        if not data:
            raise RuntimeError("the fork server ended")
        return data.decode()

    def pump(self, timeout: float | None) -> None:
        """Take the exit statuses the server sent, waiting up to ``timeout`` for the first."""
        with self.lock:
            msg = self._recv(timeout)
            while msg is not None:
                _, pid, code = msg.split()
                self.ended[int(pid)] = int(code)
                msg = self._recv(0)

    def start(self, request: dict[str, Any], fds: list[int]) -> int | None:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            while True:
                msg = self._recv(60)
                if msg is None or msg == "refused":
                    return None
                word, pid, *code = msg.split()
                if word == "started":
                    return int(pid)
                self.ended[int(pid)] = int(code[0])


_SERVERS: dict[tuple[tuple[str, str], ...], list[_Server | None]] = {}


@atexit.register
def _end_servers() -> None:
    """Each server ends when its socket closes; waited for, its time counts in this process's children's."""
    for servers in _SERVERS.values():
        for server in servers:
            if server is not None:
                server.sock.close()
                try:
                    server.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.proc.kill()


def _server(env: dict[str, str]) -> _Server | None:
    """The server for a child of this environment: one whose ``sys.path`` (its children's) holds every folder
    of the child's PYTHONPATH, started with the child's environment where there is none yet."""
    key = _import_env(env)
    wanted = {str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p}
    for server in _SERVERS.get(key, []):
        if server is None or wanted <= {str(Path(p).resolve()) for p in server.path if p}:
            return server
    for other in _SERVERS:
        _log(f"another server: {sorted(set(key) ^ set(other))} {env.get('PYTHONPATH')}")
    try:
        server = _Server(env)
    except (OSError, RuntimeError, ValueError):
        server = None
    server = server if server is not None and server.ready else None
    _SERVERS.setdefault(key, []).append(server)
    return server


class _Pid:
    """A server forked from this process (``serve_from_here``), waited for as ``subprocess.Popen``'s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["fork server"], timeout or 0.0)
            time.sleep(0.05)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def serve_from_here(folders: list[str]) -> dict[str, Any] | None:
    """In a process that is itself a fork of a server (torch, precprof and ``_PRELOAD`` imported, one thread),
    fork this process into the server of its children, not a fresh Python that imports them all again (3-4 s of
    CPU): the server of this process's own environment, whose children's ``sys.path`` holds ``folders`` too (a
    child whose PYTHONPATH names them: the caller says they hold nothing imported that a fresh child would find
    elsewhere). Returns None in this process (or where it cannot fork: one thread only), and in each child the
    server forks, its request (``_become`` it, then end as that command's Python ends)."""
    if _threads() != 1:
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for f in (sys.stdout, sys.stderr):
        f.flush()
    pid = os.fork()
    if pid == 0:  # the server: stdin and stdout its own, as ``_Server`` starts one (stderr shared)
        ours.close()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1):
            os.dup2(null, fd)
        os.close(null)
        _SERVERS.clear()
        sys.path[1:1] = [f for f in folders if f not in sys.path]
        return _serve(theirs)
    theirs.close()
    server = _Server.__new__(_Server)
    server.sock, server.lock, server.ended = ours, threading.Lock(), {}
    server.proc = _Pid(pid)  # type: ignore[assignment]
    said = server._recv(timeout=300)
    server.path = json.loads(said) if said else []
    server.ready = bool(server.path)
    _SERVERS.setdefault(_import_env(dict(os.environ)), []).append(server if server.ready else None)
    return None


class Forked:
    """A forked child, as ``subprocess.Popen`` gives it (pid, pipes, poll, wait, communicate, signals)."""

    def __init__(self, server: _Server, pid: int, args: list[str], pipes: dict[str, Any]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.stdin, self.stdout, self.stderr = (pipes.get(k) for k in ("stdin", "stdout", "stderr"))
        self.returncode: int | None = None
        self._read: dict[str, list[Any]] = {}

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump(0)
            self.returncode = self._server.ended.pop(self.pid, None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            self._server.pump(0.2 if left is None else min(left, 0.2))
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in ("stdout", "stderr"):
            f = getattr(self, name)
            if f is not None and name not in self._read:
                got: list[Any] = []
                t = threading.Thread(target=lambda f=f, got=got: got.append(f.read()), daemon=True)
                t.start()
                self._read[name] = [t, got]
        for t, _ in self._read.values():
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
        self.wait(None if deadline is None else max(0.01, deadline - time.monotonic()))
        out = [self._read[n][1][0] if n in self._read else None for n in ("stdout", "stderr")]
        for f in (self.stdout, self.stderr):
            if f is not None:
                f.close()
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forkable(args: list[str], kwargs: dict[str, Any]) -> bool:
    known = {"stdin", "stdout", "stderr", "text", "env", "cwd"}
    if set(kwargs) - known or len(args) < 2 or args[0] != sys.executable:
        return False
    if args[1] in ("-m", "-c"):
        return len(args) >= 3
    return not args[1].startswith("-") and args[1].endswith(".py")


def popen(args: list[str], **kwargs: Any) -> Any:
    """``processes.popen(args, **kwargs)``: a forked child where it can be (killed at the end of the test too)."""
    env = dict(kwargs.get("env") or os.environ)
    # (``python -m precprof`` sets TORCH_CPP_LOG_LEVEL=ERROR before it loads torch, precprof.cli's _quiet_torch:
    # the server of an environment without one loaded torch so, and the command sets it again as it starts)
    server = _server(env) if _forkable(args, kwargs) else None
    if server is None:
        _log(f"real process: {args[:3]}")
        return processes.popen(args, **kwargs)
    text = bool(kwargs.get("text"))
    fds, ours, pipes = [], [], {}
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        how = kwargs.get(name)
        if how == subprocess.PIPE:
            r, w = os.pipe()
            child, mine = (r, w) if i == 0 else (w, r)
            mode = ("w" if i == 0 else "r") + ("" if text else "b")
            enc = {"encoding": locale.getpreferredencoding(False)} if text else {}
            pipes[name] = open(mine, mode, **enc)  # noqa: SIM115
            fds.append(child)
            ours.append(child)
        elif how == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            fds.append(fd)
            ours.append(fd)
        elif how is None:
            fds.append(i)
        elif how == subprocess.STDOUT and i == 2:  # stderr into whatever stdout is
            fds.append(fds[1])
        else:
            fds.append(how if isinstance(how, int) else how.fileno())
    cwd = str(kwargs.get("cwd") or os.getcwd())
    try:
        pid = server.start({"args": list(args[1:]), "env": env, "cwd": cwd}, fds)
    finally:
        for fd in ours:
            os.close(fd)
    if pid is None:
        _log(f"refused: {args[:3]}")
        for f in pipes.values():
            f.close()
        return processes.popen(args, **kwargs)
    proc = Forked(server, pid, list(args), pipes)
    processes._STARTED.append(proc)  # type: ignore[arg-type]  # (killed at the test's end, as processes.popen's)
    return proc


def run(
    args: list[str],
    *,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run``, through ``popen``."""
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    proc = popen(args, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _become(_serve(socket.socket(fileno=int(sys.argv[1]))))

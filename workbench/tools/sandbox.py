"""Run model-written Python in a jail: the policy's Python tool, and every grader of its code.

Boundary: the code can harm nothing outside its own jail, which holds the OS's `/usr` read-only and
one empty work folder deleted afterwards. It assumes of the host: `bwrap` on PATH, unprivileged
user namespaces on, a Python 3 under `/usr`, and a kernel without an exploit reachable from an
unprivileged process (workbench/tools/jail.py has the jail's command line).
Invariant: whatever the code does, the caller gets a `SandboxResult` back within the timeout (plus
jail start-up) and is never crashed, blocked or flooded by it.

Two isolations (`sandbox.isolation`, set with `use_isolation`):
- `jail` (the default): bubblewrap, as an unprivileged uid, with no network, no other process in
  view, a cleared environment and a size-capped tmpfs for a disk; where the host cannot set it up,
  running code raises `SandboxUnavailable` (and a recipe running model code is refused at start-up).
- `process`: a fresh `python -I` process in an empty temporary directory, in an empty network
  namespace where `unshare --net` works; the file system stays readable and writable as the
  caller's user and, as root, the process limit is not enforced. Not a boundary against hostile
  code: for hosts without bubblewrap, chosen knowingly.
Both set, before the code runs: wall clock (the whole jail or process group is killed), CPU seconds,
address space (a large allocation raises MemoryError), size of any file written (stdout and stderr
go to files, so this caps them too), open files, and in the jail the number of processes and
threads; both replace the `socket` module's constructors by one that raises `OSError`.
"""

import contextlib
import functools
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import IO

from workbench.tools import jail

# bytes of stdout (and of stderr) kept; a tool reply longer than this is useless to a policy
OUTPUT_LIMIT = 16_384
# processes and threads the code may have at once, in the jail (a fork or thread bomb stops here;
# memory is capped per process, so at most this many times memory_mb in all)
PROCESS_LIMIT = 16
# open files per process
FILE_LIMIT = 64
# MiB of the jail's tmpfs (its work folder): a disk bomb fills this
DISK_MB = 64
ISOLATIONS = ("jail", "process")

# Runs in the child before the code (so no preexec_fn, unsafe in a threaded caller): read the
# request (a line of `RLIMIT_NAME=value` limits, then the code) from stdin, write the code to
# main.py, set the limits, block sockets, run main.py, report an exception as a traceback without
# this prelude's own frame. With `python -S` (no site module) `exit` and `quit` come from here.
PRELUDE = r"""
import builtins, os, resource, socket, sys, traceback
_limits, _source = sys.stdin.buffer.read().decode("utf-8").split("\n", 1)
os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
with open("main.py", "w", encoding="utf-8") as _file:
    _file.write(_source)
for _pair in _limits.split():
    _limit, _value = _pair.split("=")
    resource.setrlimit(getattr(resource, _limit), (int(_value), int(_value)))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
_guarded = ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo")
for _name in _guarded:
    setattr(socket, _name, _no_network)
builtins.exit = builtins.quit = sys.exit
_globals = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(_source, "main.py", "exec"), _globals)
except BaseException as _error:
    if isinstance(_error, SystemExit):
        raise
    sys.stdout.flush()
    traceback.print_exception(type(_error), _error, _error.__traceback__.tb_next)
    sys.exit(1)
"""


class SandboxUnavailable(RuntimeError):
    """The jail cannot be set up on this host; the message names the fix."""


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    # None when the code ran to the end; else its last traceback line or why it was stopped
    error: str | None
    timed_out: bool
    # negative: killed by that signal (SIGKILL after a timeout)
    exit_code: int

    def tool_text(self) -> str:
        """The tool response a policy sees: its stdout, then `Error: ...` if it failed."""
        if self.error is None:
            return self.stdout or "(no output)"
        error_line = f"Error: {self.error}"
        if not self.stdout.strip():
            return error_line
        return self.stdout.rstrip("\n") + "\n" + error_line


# what run_python uses when not told: the run's sandbox.isolation and sandbox.warm, in each process
_settings = {"isolation": "jail", "warm": 2}
# this process's pool of warm jails (a forked child starts its own); the lock makes one pool of
# the step threads' first calls
_pools: dict[int, jail.Pool] = {}
_pools_lock = threading.Lock()


def use_isolation(name: str, warm: int = 2) -> None:
    """Make `name` (jail or process) the isolation of every later run_python in this process, with
    `warm` jails started ahead (0 = each call starts its own)."""
    if name not in ISOLATIONS:
        raise ValueError(f"sandbox.isolation={name} is unknown: use jail or process.")
    _settings["isolation"] = name
    _settings["warm"] = warm


def isolation_in_use() -> str:
    """The isolation run_python uses when not told (jail unless use_isolation said otherwise)."""
    return _settings["isolation"]


def _jail_argv() -> list[str]:
    """What each jail runs: the OS's Python, isolated, without the site module, the prelude."""
    return [jail.interpreter(), "-I", "-S", "-c", PRELUDE]


def _take_jail() -> jail.Started:
    """A started jail: from this process's pool of warm ones, or started now."""
    if not _settings["warm"]:
        return jail.start(_jail_argv(), DISK_MB)
    with _pools_lock:
        pool = _pools.get(os.getpid())
        if pool is None or pool.size != _settings["warm"]:
            # a new size: the old pool's jails end
            if pool is not None:
                pool.close()
            pool = jail.Pool(_jail_argv(), DISK_MB, _settings["warm"])
            _pools[os.getpid()] = pool
    return pool.take()


def _start_process() -> jail.Started:
    """The process isolation: `python -I` in a new temporary directory, in an empty network
    namespace where unshare works, with an environment of PATH, HOME and LC_ALL only."""
    workdir = tempfile.mkdtemp(prefix="molt-wb-sandbox-")
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [*_netns_prefix(), sys.executable, "-I", "-c", PRELUDE],
        cwd=workdir,
        env={"PATH": os.defpath, "HOME": workdir, "LC_ALL": "C.UTF-8"},
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=err,
        start_new_session=True,
    )
    return jail.Started(process, out, err, workdir)


def runs_model_code(plugin: ModuleType) -> bool:
    """Whether a plugin runs model-written code: its RUNS_MODEL_CODE, else whether it imports
    run_python, itself or through a plugin it loaded (chat_geo3k through geo3k): every shipped
    plugin that does runs the policy's code with it."""
    declared = getattr(plugin, "RUNS_MODEL_CODE", None)
    if declared is not None:
        return bool(declared)
    loaded = [v for v in vars(plugin).values() if isinstance(v, ModuleType) and v is not plugin]
    namespaces = [vars(plugin)] + [
        vars(module) for module in loaded if "plugins" in module.__name__
    ]
    for names in namespaces:
        if any(value is run_python for value in names.values()):
            return True
    return False


@functools.cache
def _netns_prefix() -> tuple[str, ...]:
    """`unshare` arguments for an empty network namespace, or () where user namespaces are
    unavailable (the process isolation only)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--net", "--map-root-user")
    probe = subprocess.run(
        [*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30
    )
    return prefix if probe.returncode == 0 else ()


def _read(handle: IO[bytes], limit: int) -> tuple[str, bool]:
    """The first `limit` bytes of an output file as text, and whether it held more."""
    handle.seek(0)
    data = handle.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) >= limit


def _exited(pid: int, timeout_s: float) -> bool:
    """Wait up to timeout_s for the process to exit, without reaping it (so its pid, the group id,
    stays ours): a pidfd becomes readable the moment it exits."""
    pidfd = os.pidfd_open(pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        # poll again if a signal interrupted it early
        while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if time.monotonic() >= deadline:
                return False
        return True
    finally:
        os.close(pidfd)


def _limits(timeout_s: float, memory_mb: int, output_limit: int, jailed: bool) -> list[str]:
    """The prelude's `RLIMIT_NAME=value` arguments. The process limit only in the jail: outside
    it the kernel counts all of the caller's processes (and as root none)."""
    limits = {
        "RLIMIT_CPU": math.ceil(timeout_s) + 1,
        "RLIMIT_AS": memory_mb << 20,
        "RLIMIT_FSIZE": output_limit,
        "RLIMIT_CORE": 0,
        "RLIMIT_NOFILE": FILE_LIMIT,
    }
    if jailed:
        limits["RLIMIT_NPROC"] = PROCESS_LIMIT
    return [f"{name}={value}" for name, value in limits.items()]


def run_python(
    code: str,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    output_limit: int = OUTPUT_LIMIT,
    isolation: str | None = None,
) -> SandboxResult:
    """Run `code` as a script in a fresh jail, or process (see the module docstring), and collect
    what it printed. `isolation` defaults to `isolation_in_use()`."""
    isolation = isolation or isolation_in_use()
    jailed = isolation == "jail"
    if jailed and jail.unavailable():
        raise SandboxUnavailable(f"Cannot run model code: {jail.unavailable()}")
    limits = " ".join(_limits(timeout_s, memory_mb, output_limit, jailed))
    started = _take_jail() if jailed else _start_process()
    process = started.process
    try:
        # a program that died before reading its request is reported as it died
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(f"{limits}\n{code}".encode("utf-8"))
            process.stdin.close()
        timed_out = not _exited(process.pid, timeout_s)
        # the group: whatever the code started too, finished or not (in the jail, bwrap's death
        # kills the jail's PID 1 and with it every process in there)
        os.killpg(process.pid, signal.SIGKILL)
        status = process.wait()
        stdout, stdout_full = _read(started.out, output_limit)
        stderr, stderr_full = _read(started.err, output_limit)
    finally:
        process.kill()
        started.close()
    exit_code = jail.exit_code(status) if jailed else status
    flooded = stdout_full or stderr_full
    error = _error(exit_code, stderr, timed_out, flooded, timeout_s, output_limit)
    return SandboxResult(stdout, stderr, error, timed_out, exit_code)


def _error(
    exit_code: int, stderr: str, timed_out: bool, flooded: bool, timeout_s: float, output_limit: int
) -> str | None:
    """Why the code failed, in one line (None when it ran to the end)."""
    if timed_out:
        return f"timed out after {timeout_s:g} s"
    if flooded:
        return f"output exceeded the limit of {output_limit} bytes"
    if exit_code == -signal.SIGXCPU:
        return "CPU time limit exceeded"
    if exit_code < 0:
        return f"killed by {signal.Signals(-exit_code).name}"
    if exit_code != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        return lines[-1].strip() if lines else f"exited with status {exit_code}"
    return None

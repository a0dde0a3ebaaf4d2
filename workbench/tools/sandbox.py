"""Run model-written Python in a separate, limited process: the policy's Python tool.

Invariant: whatever the code does, the caller gets a `SandboxResult` back within the timeout (plus
process start-up) and is never crashed, blocked or flooded by it.

What the isolation is:
- a fresh `python -I` process (no user site, no PYTHON* variables) in a new session (process group),
  in an empty temporary working directory deleted afterwards, with an environment holding only
  PATH, HOME (the temporary directory) and LC_ALL, so none of the caller's variables leak in;
- limits: wall clock (the whole process group is killed), CPU seconds (RLIMIT_CPU), address space
  (RLIMIT_AS, so a large allocation raises MemoryError) and size of any file it writes
  (RLIMIT_FSIZE, which also caps stdout and stderr, written to files rather than pipes);
- no network: where `unshare --net --map-root-user` works without root (Linux user namespaces), the
  process runs in an empty network namespace (no interface but a downed loopback), so no connection
  can be made even through `_socket` or a subprocess; on top of that, and alone where namespaces are
  unavailable, the `socket` module's constructors are replaced before the code runs by a function
  that raises `OSError`.
What it is not: a security boundary against hostile code. The file system is readable and writable
as the caller's user (outside the temporary directory too), the number of processes is not limited,
and without a network namespace the socket guard can be bypassed (`import _socket`, ctypes).
"""

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# bytes of stdout (and of stderr) kept; a tool reply longer than this is useless to a policy
OUTPUT_LIMIT = 16_384

# Runs in the child before the code (so no preexec_fn, unsafe in a threaded caller): set the limits,
# block sockets, run main.py, report an exception as a traceback without this prelude's own frame.
PRELUDE = r"""
import resource, socket, sys, traceback
_limits = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_CORE")
for _limit, _value in zip(_limits, map(int, sys.argv[1:])):
    resource.setrlimit(getattr(resource, _limit), (_value, _value))
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
_guarded = ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo")
for _name in _guarded:
    setattr(socket, _name, _no_network)
_source = open("main.py", encoding="utf-8").read()
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


@functools.cache
def _netns_prefix():
    """`unshare` arguments for an empty network namespace, or () where user namespaces are
    unavailable."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    prefix = (unshare, "--net", "--map-root-user")
    probe = subprocess.run(
        [*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30
    )
    return prefix if probe.returncode == 0 else ()


def _read(handle, limit):
    handle.seek(0)
    data = handle.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) >= limit


def _exited(pid, timeout_s):
    """Wait up to timeout_s for the process to exit, without reaping it (so its pid, the group id,
    stays ours)."""
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def run_python(
    code: str, timeout_s: float = 5.0, memory_mb: int = 256, output_limit: int = OUTPUT_LIMIT
) -> SandboxResult:
    """Run `code` as a script in a fresh limited process (see the module docstring) and collect
    what it printed."""
    # CPU seconds, address space, file size, core
    limits = [math.ceil(timeout_s) + 1, memory_mb << 20, output_limit, 0]
    # output goes to unnamed files: the code cannot delete them, and a flood costs disk (capped),
    # not memory
    with (
        tempfile.TemporaryDirectory(
            prefix="molt-wb-sandbox-", ignore_cleanup_errors=True
        ) as workdir,
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
    ):
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        process = subprocess.Popen(
            [*_netns_prefix(), sys.executable, "-I", "-c", PRELUDE, *map(str, limits)],
            cwd=workdir,
            env={"PATH": os.defpath, "HOME": workdir, "LC_ALL": "C.UTF-8"},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            timed_out = not _exited(process.pid, timeout_s)
        finally:
            # the group: whatever the code started too, finished or not
            os.killpg(process.pid, signal.SIGKILL)
            exit_code = process.wait()
        stdout, stdout_full = _read(out, output_limit)
        stderr, stderr_full = _read(err, output_limit)
    if timed_out:
        error = f"timed out after {timeout_s:g} s"
    elif stdout_full or stderr_full:
        error = f"output exceeded the limit of {output_limit} bytes"
    elif exit_code == -signal.SIGXCPU:
        error = "CPU time limit exceeded"
    elif exit_code < 0:
        error = f"killed by {signal.Signals(-exit_code).name}"
    elif exit_code != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        error = lines[-1].strip() if lines else f"exited with status {exit_code}"
    else:
        error = None
    return SandboxResult(stdout, stderr, error, timed_out, exit_code)

"""The bubblewrap jail that model-written code runs in: its command line and whether this host can
set it up.

Boundary: a jailed program sees the OS's `/usr` read-only, a fresh `/proc` of its own processes, a
minimal `/dev` and an empty size-capped tmpfs `/tmp` holding its work folder, and nothing else of
the host (no checkout, run folder, model cache, home, `/etc` or caller environment); it has no
network (a new network namespace), no other process in view (a new PID namespace in which it is
PID 1, so whatever it starts dies with it), no capability, and runs as an unprivileged uid (nobody,
65534, when the caller is root), so RLIMIT_NPROC holds. It assumes of the host: `bwrap` on PATH,
unprivileged user namespaces on, and a Python 3 under `/usr` (`/usr/bin/python3`).
"""

import collections
import functools
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from typing import IO

# the unprivileged uid and gid a root caller drops to before bwrap starts (Debian's nobody/nogroup)
NOBODY = 65534
# the jail's working directory: on the tmpfs, gone when the jail's mount namespace is
WORKDIR = "/tmp/work"
# where interpreters are looked for: only a Python under /usr is visible inside the jail
SYSTEM_PATH = "/usr/local/bin:/usr/bin"
# exit statuses above this are bwrap's report of a child killed by signal (status - 128)
SIGNALLED = 128

INSTALL_HINT = (
    "install bubblewrap (`apt-get install -y bubblewrap`), or set sandbox.isolation=process to "
    "accept process limits only (model code can then read and write the host's files)"
)


@functools.cache
def interpreter() -> str | None:
    """The Python the jail runs: the OS's python3 under /usr (the caller's own interpreter may live
    where the jail cannot see, a virtual environment or a home directory)."""
    found = shutil.which("python3", path=SYSTEM_PATH)
    if found is None:
        return None
    real = os.path.realpath(found)
    return real if real.startswith("/usr/") else None


def credentials() -> dict:
    """Popen arguments that drop a root caller to nobody before bwrap starts: as root the kernel
    does not enforce RLIMIT_NPROC, so a fork bomb would run free. An ordinary user stays itself."""
    if os.geteuid() != 0:
        return {}
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def command(argv: list[str], work_mb: int) -> list[str]:
    """The bwrap command line that runs `argv` (an absolute path first) in the jail, with an empty
    work folder on a tmpfs of `work_mb` MiB."""
    return [
        "bwrap",
        # user, IPC, PID, network, UTS and cgroup namespaces; no user namespace again inside
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        # the jail dies with the caller; no terminal to inject input into (TIOCSTI)
        "--die-with-parent",
        "--new-session",
        # the program is PID 1: its orphans die with it, and no bwrap helper's environment is at
        # /proc/1/environ
        "--as-pid-1",
        "--clearenv",
        "--hostname",
        "sandbox",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        # a disk bomb fills this, not the host's disk
        "--size",
        str(work_mb << 20),
        "--tmpfs",
        "/tmp",
        "--dir",
        WORKDIR,
        "--chdir",
        WORKDIR,
        "--setenv",
        "PATH",
        "/usr/bin",
        "--setenv",
        "HOME",
        WORKDIR,
        "--setenv",
        "LC_ALL",
        "C.UTF-8",
        "--",
        *argv,
    ]


def exit_code(status: int) -> int:
    """The program's exit code from bwrap's status: negative when a signal killed it (bwrap reports
    128 + the signal, so a program that itself exits with 129..192 reads as signalled too)."""
    if SIGNALLED < status <= SIGNALLED + 64:
        return SIGNALLED - status
    return status


@functools.cache
def unavailable() -> str | None:
    """None when this host can set up the jail; else why not and what to do, as a clause that
    continues a sentence (`Cannot run model code: ...`)."""
    if shutil.which("bwrap") is None:
        return f"the sandbox's jail needs bwrap (bubblewrap), which is not on PATH: {INSTALL_HINT}."
    python = interpreter()
    if python is None:
        return (
            "the sandbox's jail runs the OS's Python 3 (/usr/bin/python3), which is missing: "
            "install python3 with the OS's package manager, or set sandbox.isolation=process."
        )
    probe = subprocess.run(
        command([python, "-I", "-S", "-c", "print('jailed')"], 1),
        env={},
        capture_output=True,
        timeout=60,
        **credentials(),
    )
    if probe.stdout == b"jailed\n":
        return None
    lines = probe.stderr.decode(errors="replace").strip().splitlines() or ["no output"]
    return (
        f"bwrap cannot set up the sandbox's jail here ({lines[-1]}; user namespaces may be off: "
        f"sysctl kernel.unprivileged_userns_clone=1): fix that, or set sandbox.isolation=process "
        f"to accept process limits only."
    )


@dataclass
class Started:
    """A started program waiting for its request on stdin; its output goes to unnamed files (the
    program cannot delete them, and a flood costs capped disk, not memory)."""

    process: subprocess.Popen
    out: IO[bytes]
    err: IO[bytes]
    # the process isolation's temporary working directory; None in the jail (its tmpfs)
    workdir: str | None = None

    def close(self) -> None:
        """Delete the output files (and the working directory)."""
        self.out.close()
        self.err.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start(argv: list[str], work_mb: int) -> Started:
    """Start `argv` in a fresh jail, in a new session (so a timeout kills the whole group)."""
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    process = subprocess.Popen(
        command(argv, work_mb),
        env={},
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=err,
        start_new_session=True,
        **credentials(),
    )
    return Started(process, out, err)


class Pool:
    """Up to `size` jails started ahead, each waiting to run one program and then replaced: a call
    skips the jail's start-up. Each runs one program only, so none sees another's files. Started
    from one long-lived thread: bwrap's --die-with-parent follows the thread that started it."""

    def __init__(self, argv: list[str], work_mb: int, size: int) -> None:
        self.argv = argv
        self.work_mb = work_mb
        self.size = size
        self.ready: collections.deque[Started] = collections.deque()
        self.wanted = threading.Condition()
        threading.Thread(target=self._fill, daemon=True, name="molt-wb-jail-pool").start()

    def _fill(self) -> None:
        """Keep `size` jails ready, forever (a daemon thread)."""
        while True:
            with self.wanted:
                while len(self.ready) >= self.size:
                    self.wanted.wait()
            started = start(self.argv, self.work_mb)
            with self.wanted:
                full = len(self.ready) >= self.size
                self.ready.append(started)
            # closed meanwhile: this one is not wanted either
            if full:
                self.close()

    def close(self) -> None:
        """Stop refilling, and end the jails still waiting."""
        with self.wanted:
            self.size = 0
            waiting = list(self.ready)
            self.ready.clear()
        for started in waiting:
            started.process.kill()
            started.process.wait()
            started.close()

    def take(self) -> Started:
        """A ready jail, or one started now when none is (or the ready one has died)."""
        with self.wanted:
            started = self.ready.popleft() if self.ready else None
            self.wanted.notify()
        if started is not None and started.process.poll() is None:
            return started
        if started is not None:
            started.close()
        return start(self.argv, self.work_mb)


def describe() -> str:
    """What `molt-wb doctor` says of how this host isolates model-written code."""
    reason = unavailable()
    if reason:
        return f"process limits only: {reason}"
    version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout
    who = "nobody" if os.geteuid() == 0 else "this user"
    return f"jail ({version.strip()}; model code runs as {who}, no network, sees /usr only)"

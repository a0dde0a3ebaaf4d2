"""The Python tool's sandbox: results always come back, limits hold, no network, no leaked
environment; in the jail (the default) and in the process isolation; a host without the jail is
told so. Hostile programs are in test_sandbox_hostile.py."""

import os
import socket
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from workbench.api import load_plugin
from workbench.cli import app
from workbench.config import ConfigError, compose_config
from workbench.tools import jail
from workbench.tools.sandbox import (
    SandboxResult,
    SandboxUnavailable,
    _netns_prefix,
    isolation_in_use,
    run_python,
    runs_model_code,
    use_isolation,
)

needs_jail = pytest.mark.skipif(jail.unavailable() is not None, reason=f"{jail.unavailable()}")
BOTH = pytest.mark.parametrize("isolation", [pytest.param("jail", marks=needs_jail), "process"])


@BOTH
def test_prints_come_back_as_stdout_and_the_tool_text(isolation):
    result = run_python("print(6 * 7)\nprint('done')", isolation=isolation)
    assert result == SandboxResult(
        stdout="42\ndone\n", stderr="", error=None, timed_out=False, exit_code=0
    )
    assert result.tool_text() == "42\ndone\n"
    assert run_python("x = 1", isolation=isolation).tool_text() == "(no output)"


@BOTH
def test_an_exception_becomes_the_last_traceback_line_after_what_was_printed(isolation):
    result = run_python("print('before')\nvalues = [1, 2]\nprint(values[5])", isolation=isolation)
    assert result.error == "IndexError: list index out of range"
    assert result.exit_code == 1 and not result.timed_out
    # the code's own frame only
    assert 'File "main.py", line 3' in result.stderr and "print(values[5])" in result.stderr
    assert "_source" not in result.stderr  # not the prelude's
    assert result.tool_text() == "before\nError: IndexError: list index out of range"


@BOTH
def test_syntax_errors_and_nonzero_exits_are_errors_too(isolation):
    assert run_python("def f(:\n  pass", isolation=isolation).error.startswith("SyntaxError")
    assert run_python("import sys; sys.exit(3)", isolation=isolation).error == (
        "exited with status 3"
    )
    assert run_python("raise SystemExit(0)", isolation=isolation).error is None
    # exit() and quit() work without the site module
    assert run_python("exit(4)", isolation=isolation).exit_code == 4


@BOTH
def test_an_infinite_loop_is_killed_at_the_timeout_with_its_children(isolation):
    marker = f"molt-wb-test-child-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "print('started', flush=True)\n"
        "while True: pass"
    )
    result = run_python(code, timeout_s=1.5, isolation=isolation)
    assert result.timed_out and result.error == "timed out after 1.5 s" and result.exit_code == -9
    assert result.tool_text() == "started\nError: timed out after 1.5 s"
    # the child died with the code; it may linger a moment as a zombie until it is reaped
    for _ in range(100):
        if not _running_with(marker):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the code's child outlived the timeout: {_running_with(marker)}")


def _running_with(marker: str) -> list[int]:
    """Host pids of live (not zombie) processes whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            alive = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if alive and marker in (entry / "cmdline").read_text(errors="replace"):
                found.append(int(entry.name))
        except (OSError, IndexError):
            pass
    return found


@BOTH
def test_an_allocation_bomb_hits_the_memory_limit(isolation):
    bomb = "blocks = []\nwhile True: blocks.append(bytearray(50 << 20))"
    result = run_python(bomb, memory_mb=200, isolation=isolation)
    assert result.error == "MemoryError" and not result.timed_out
    fits = run_python("x = bytearray(100 << 20); print(len(x))", isolation=isolation)
    assert fits.stdout == f"{100 << 20}\n"


@BOTH
def test_the_limits_are_set_in_the_process_that_runs_the_code(isolation):
    names = ["RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_FSIZE", "RLIMIT_CORE", "RLIMIT_NOFILE"]
    code = f"import resource\nfor name in {names + ['RLIMIT_NPROC']}:\n"
    code += "    print(*resource.getrlimit(getattr(resource, name)))"
    result = run_python(code, timeout_s=2.5, memory_mb=300, output_limit=5000, isolation=isolation)
    lines = result.stdout.splitlines()
    # CPU = ceil(timeout) + 1 seconds
    assert lines[:5] == ["4 4", f"{300 << 20} {300 << 20}", "5000 5000", "0 0", "64 64"]
    # processes and threads: limited in the jail only (outside, the kernel counts all the
    # caller's processes, and none of root's)
    if isolation == "jail":
        assert lines[5] == "16 16"


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    yield server
    server.close()


@BOTH
def test_a_socket_connection_to_a_listening_port_is_refused(listener, isolation):
    port = listener.getsockname()[1]
    result = run_python(
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "print('connected')",
        isolation=isolation,
    )
    assert result.error == "OSError: network access is disabled in the sandbox"
    assert "connected" not in result.stdout
    with pytest.raises(socket.timeout):
        # nothing ever reached the port
        listener.accept()


@pytest.mark.parametrize(
    "isolation",
    [
        pytest.param("jail", marks=needs_jail),
        pytest.param(
            "process",
            marks=pytest.mark.skipif(not _netns_prefix(), reason="no user namespaces here"),
        ),
    ],
)
def test_the_network_namespace_stops_code_that_bypasses_the_socket_guard(listener, isolation):
    port = listener.getsockname()[1]
    result = run_python(
        f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n"
        "print('connected')",
        isolation=isolation,
    )
    assert result.error.startswith(("OSError", "ConnectionRefusedError"))
    assert "connected" not in result.stdout
    with pytest.raises(socket.timeout):
        listener.accept()


@BOTH
def test_output_is_capped(isolation):
    result = run_python("while True: print('x' * 1000)", output_limit=4096, isolation=isolation)
    assert len(result.stdout) == 4096 and set(result.stdout) <= {"x", "\n"}
    assert result.error == "output exceeded the limit of 4096 bytes" and not result.timed_out
    assert run_python("print('y' * 100)", output_limit=4096, isolation=isolation).error is None


@BOTH
def test_the_callers_environment_variables_do_not_leak(monkeypatch, isolation):
    monkeypatch.setenv("MOLT_WB_SECRET_TOKEN", "hunter2")
    result = run_python(
        "import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(os.listdir('.'))",
        isolation=isolation,
    )
    assert "hunter2" not in result.stdout and "MOLT_WB_SECRET_TOKEN" not in result.stdout
    names, cwd, listing = result.stdout.splitlines()
    assert set(eval(names)) <= {"PATH", "HOME", "LC_ALL", "PWD"}
    # the work folder is gone afterwards (the jail's is on its own tmpfs)
    assert cwd != os.getcwd() and (cwd == jail.WORKDIR or not os.path.exists(cwd))
    # the code alone; its output goes to unnamed files
    assert eval(listing) == ["main.py"]


@needs_jail
def test_the_jail_shows_the_code_nothing_of_the_host_but_usr():
    code = (
        "import os\nprint(os.getuid(), os.getpid())\nprint(sorted(os.listdir('/')))\n"
        "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))"
    )
    uid_pid, top, pids = run_python(code).stdout.splitlines()
    # nobody when the caller is root, else the caller's uid; PID 1 of its own namespace
    assert uid_pid == f"{jail.NOBODY if os.geteuid() == 0 else os.geteuid()} 1"
    assert eval(top) == ["bin", "dev", "lib", "lib64", "proc", "tmp", "usr"]
    assert eval(pids) == ["1"]


@BOTH
def test_non_ascii_output_round_trips(isolation):
    assert run_python("print('70° √3 π')", isolation=isolation).stdout == "70° √3 π\n"


@BOTH
def test_code_that_deletes_its_own_directory_still_reports_back(isolation):
    result = run_python(
        "import os, shutil\nshutil.rmtree(os.getcwd())\nprint('gone')", isolation=isolation
    )
    assert result.stdout == "gone\n" and result.error is None


@needs_jail
def test_without_a_warm_pool_each_call_starts_its_own_jail():
    try:
        use_isolation("jail", warm=0)
        assert run_python("print(1)").stdout == "1\n"
    finally:
        use_isolation("jail")
    assert isolation_in_use() == "jail"


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
    """A PATH without bwrap: the jail cannot be set up."""
    monkeypatch.setenv("PATH", str(tmp_path))
    jail.unavailable.cache_clear()
    yield
    monkeypatch.undo()
    jail.unavailable.cache_clear()


def test_a_host_without_bwrap_is_refused_with_the_fix(no_bwrap):
    # nothing runs in the jail's place
    with pytest.raises(SandboxUnavailable, match="apt-get install -y bubblewrap"):
        run_python("print(1)", isolation="jail")
    with pytest.raises(SandboxUnavailable, match="sandbox.isolation=process"):
        run_python("print(1)", isolation="jail")
    with pytest.raises(ValueError, match="sandbox.isolation=vm is unknown: use jail or process."):
        use_isolation("vm")


def test_a_recipe_running_model_code_is_refused_at_start_up_without_the_jail(no_bwrap):
    refusal = "Plugin code runs model-written code, but the sandbox's jail needs bwrap"
    with pytest.raises(ConfigError, match=refusal):
        compose_config(["+recipe=code"])
    # accepted knowingly, and a recipe that runs no model code needs no jail
    assert compose_config(["+recipe=code", "sandbox.isolation=process"]).sandbox.warm == 2
    assert compose_config(["+recipe=math"]).sandbox.isolation == "jail"
    with pytest.raises(ConfigError, match="sandbox.isolation=vm is unknown: use jail or process."):
        compose_config(["sandbox.isolation=vm"])
    doctor = CliRunner().invoke(app, ["doctor"])
    assert "isolation    process limits only: the sandbox's jail needs bwrap" in doctor.output


@needs_jail
def test_doctor_says_the_jail_is_in_use():
    doctor = CliRunner().invoke(app, ["doctor"])
    assert "isolation    jail (bubblewrap" in doctor.output, doctor.output


def test_the_plugins_that_run_model_code_are_known():
    assert runs_model_code(load_plugin("code")) and runs_model_code(load_plugin("geo3k"))
    assert runs_model_code(load_plugin("chat_geo3k"))
    assert not runs_model_code(load_plugin("arith")) and not runs_model_code(load_plugin("math"))

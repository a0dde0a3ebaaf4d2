"""The Python tool's sandbox: results always come back, limits hold, no network, no leaked
environment."""

import os
import socket
import time

import pytest

from workbench.tools.sandbox import SandboxResult, _netns_prefix, run_python


def test_prints_come_back_as_stdout_and_the_tool_text():
    result = run_python("print(6 * 7)\nprint('done')")
    assert result == SandboxResult(
        stdout="42\ndone\n", stderr="", error=None, timed_out=False, exit_code=0
    )
    assert result.tool_text() == "42\ndone\n"
    assert run_python("x = 1").tool_text() == "(no output)"


def test_an_exception_becomes_the_last_traceback_line_after_what_was_printed():
    result = run_python("print('before')\nvalues = [1, 2]\nprint(values[5])")
    assert result.error == "IndexError: list index out of range"
    assert result.exit_code == 1 and not result.timed_out
    # the code's own frame only
    assert 'File "main.py", line 3' in result.stderr and "print(values[5])" in result.stderr
    assert "_source" not in result.stderr  # not the prelude's
    assert result.tool_text() == "before\nError: IndexError: list index out of range"


def test_syntax_errors_and_nonzero_exits_are_errors_too():
    assert run_python("def f(:\n  pass").error.startswith("SyntaxError")
    assert run_python("import sys; sys.exit(3)").error == "exited with status 3"
    assert run_python("raise SystemExit(0)").error is None


def test_an_infinite_loop_is_killed_at_the_timeout_with_its_children():
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "while True: pass"
    )
    result = run_python(code, timeout_s=1.5)
    assert result.timed_out and result.error == "timed out after 1.5 s" and result.exit_code == -9
    assert result.tool_text() == result.stdout.rstrip("\n") + "\nError: timed out after 1.5 s"
    child = int(result.stdout.split()[0])
    # killed with its group; it may linger a moment as a zombie until init reaps it
    for _ in range(100):
        try:
            state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the code's child {child} outlived the timeout (state {state})")


def test_an_allocation_bomb_hits_the_memory_limit():
    result = run_python(
        "blocks = []\nwhile True: blocks.append(bytearray(50 << 20))", memory_mb=200
    )
    assert result.error == "MemoryError" and not result.timed_out
    assert (
        run_python("x = bytearray(100 << 20); print(len(x))", memory_mb=256).stdout
        == f"{100 << 20}\n"
    )


def test_the_limits_are_set_in_the_process_that_runs_the_code():
    code = (
        "import resource\n"
        "for name in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_FSIZE', 'RLIMIT_CORE'):\n"
        "    print(*resource.getrlimit(getattr(resource, name)))"
    )
    lines = run_python(code, timeout_s=2.5, memory_mb=300, output_limit=5000).stdout.splitlines()
    # CPU = ceil(timeout) + 1 seconds
    assert lines == ["4 4", f"{300 << 20} {300 << 20}", "5000 5000", "0 0"]


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    yield server
    server.close()


def test_a_socket_connection_to_a_listening_port_is_refused(listener):
    port = listener.getsockname()[1]
    result = run_python(
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
        "print('connected')"
    )
    assert result.error == "OSError: network access is disabled in the sandbox"
    assert "connected" not in result.stdout
    with pytest.raises(socket.timeout):
        # nothing ever reached the port
        listener.accept()


@pytest.mark.skipif(
    not _netns_prefix(), reason="user namespaces (unshare --net) are unavailable here"
)
def test_the_network_namespace_stops_code_that_bypasses_the_socket_guard(listener):
    port = listener.getsockname()[1]
    result = run_python(
        f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n"
        "print('connected')"
    )
    assert (
        result.error is not None
        and result.error.startswith("OSError")
        and "connected" not in result.stdout
    )
    with pytest.raises(socket.timeout):
        listener.accept()


def test_output_is_capped():
    result = run_python("while True: print('x' * 1000)", output_limit=4096)
    assert len(result.stdout) == 4096 and set(result.stdout) <= {"x", "\n"}
    assert result.error == "output exceeded the limit of 4096 bytes" and not result.timed_out
    assert run_python("print('y' * 100)", output_limit=4096).error is None


def test_the_callers_environment_variables_do_not_leak(monkeypatch):
    monkeypatch.setenv("MOLT_WB_SECRET_TOKEN", "hunter2")
    result = run_python(
        "import os\nprint(sorted(os.environ))\nprint(os.getcwd())\nprint(os.listdir('.'))"
    )
    assert "hunter2" not in result.stdout and "MOLT_WB_SECRET_TOKEN" not in result.stdout
    names, cwd, listing = result.stdout.splitlines()
    assert set(eval(names)) <= {"PATH", "HOME", "LC_ALL"}
    assert "molt-wb-sandbox-" in cwd and cwd != os.getcwd()
    # the temporary directory is gone
    assert not os.path.exists(cwd)
    # the code alone; its output goes to unnamed files
    assert eval(listing) == ["main.py"]


def test_non_ascii_output_round_trips():
    assert run_python("print('70° √3 π')").stdout == "70° √3 π\n"


def test_code_that_deletes_its_own_directory_still_reports_back():
    result = run_python("import os, shutil\nshutil.rmtree(os.getcwd())\nprint('gone')")
    assert result.stdout == "gone\n" and result.error is None

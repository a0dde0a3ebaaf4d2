"""Hostile programs against the jail: none does its harm, each gets its SandboxResult back in time.

The programs, their arena (canaries in a run folder, the checkout, $HOME and /tmp; secrets in the
caller's environment, /etc/shadow and a key file; a listening socket; a process of the caller's) and
the harm checks are in tests/fixtures/hostile/programs.py, run by its driver several at once: as
this process's user (root in CI), and as nobody where this process is root. While bombs run, the
machine still starts and runs processes.
"""

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from workbench.api import load_plugin
from workbench.tools import jail
from workbench.tools.sandbox import PROCESS_LIMIT, SandboxResult, run_python

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "fixtures" / "hostile" / "programs.py"
sys.path.insert(0, str(DRIVER.parent))
import programs  # noqa: E402

pytestmark = pytest.mark.skipif(
    jail.unavailable() is not None, reason=f"no jail here: {jail.unavailable()}"
)


def _drive(python: str, base: Path, checkout: Path, env: dict, **user) -> dict:
    """Run every hostile program through the jail in the driver; its outcomes by name."""
    secret = f"molt-wb-secret-{secrets.token_hex(6)}"
    completed = subprocess.run(
        [python, str(DRIVER), "--base", str(base), "--checkout", str(checkout)],
        env={**env, "MOLT_WB_HOSTILE_SECRET": secret, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
        **user,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout)


@pytest.fixture(scope="module")
def outcomes() -> dict:
    """The programs run as this process's user, in the real run root and checkout."""
    checkout = REPO / ".pytest_cache"
    checkout.mkdir(exist_ok=True)
    return _drive(sys.executable, REPO / "runs", checkout, dict(os.environ))


@pytest.mark.parametrize("name", list(programs.PROGRAMS))
def test_a_hostile_program_does_no_harm_and_its_result_comes_back_in_time(outcomes, name):
    outcome = outcomes[name]
    assert outcome["returned"] and outcome["in_time"], outcome
    assert outcome["harm"] is None, outcome


def test_the_bombs_and_floods_stop_at_their_limits(outcomes):
    # a fork or thread bomb stops below the process limit, a disk bomb at the tmpfs (64 MiB)
    for bomb in ("fork_bomb", "thread_bomb"):
        count = int(outcomes[bomb]["stdout"].split()[-1])
        assert 0 < count < PROCESS_LIMIT
    assert "No space left on device" in outcomes["disk_bomb"]["stdout"]
    assert outcomes["infinite_output"]["error"] == "output exceeded the limit of 16384 bytes"
    assert outcomes["sleep_past_timeout"]["error"] == f"timed out after {programs.TIMEOUT_S:g} s"
    assert outcomes["busy_loop"]["error"] == f"timed out after {programs.TIMEOUT_S:g} s"


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists(),
    reason="already unprivileged (the run above is a user's), or no /usr/bin/python3 to run as one",
)
def test_as_an_unprivileged_user_no_hostile_program_does_harm():
    # nobody's own arena: a user can harm only what it owns, so the canaries are its own
    base = Path(tempfile.mkdtemp(prefix="molt-wb-hostile-user-"))
    try:
        for folder in ("runs", "checkout", "home"):
            (base / folder).mkdir()
        for path in [base, *base.iterdir()]:
            os.chown(path, jail.NOBODY, jail.NOBODY)
        env = {"PATH": os.environ["PATH"], "HOME": str(base / "home")}
        user = {"user": jail.NOBODY, "group": jail.NOBODY, "extra_groups": []}
        # nobody must be able to read this checkout (a clone under /root is not readable)
        probe = subprocess.run(
            ["/usr/bin/python3", "-c", f"import workbench.tools.sandbox; open({str(DRIVER)!r})"],
            env={**env, "PYTHONPATH": str(REPO)},
            capture_output=True,
            **user,
        )
        if probe.returncode != 0:
            pytest.skip(f"nobody cannot read this checkout at {REPO}")
        found = _drive("/usr/bin/python3", base / "runs", base / "checkout", env, **user)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    harmed = {name: outcome for name, outcome in found.items() if outcome["harm"]}
    late = {name: outcome for name, outcome in found.items() if not outcome["in_time"]}
    assert set(found) == set(programs.PROGRAMS) and not harmed and not late


def test_concurrent_programs_do_not_see_each_others_files():
    secret = secrets.token_hex(8)
    writer = f"open('note', 'w').write('{secret}')\nimport time\ntime.sleep(2)"
    # where another program's work folder would be: under /tmp, or through /proc
    places = ["/tmp/*/note", "/tmp/*/*/note", "/proc/*/cwd/note", "/proc/*/root/tmp/*/note"]
    reader = (
        f"import glob, time\ntime.sleep(0.5)\nfor place in {places!r}:\n"
        "    for path in glob.glob(place):\n"
        "        try:\n            print(open(path).read())\n        except OSError:\n"
        "            pass"
    )
    results = {}
    threads = [
        threading.Thread(target=lambda: results.update(writer=run_python(writer))),
        threading.Thread(target=lambda: results.update(reader=run_python(reader))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results["writer"].error is None and results["reader"].error is None
    assert secret not in results["reader"].stdout
    # and a later program's work folder is empty but for its own code
    assert run_python("import os\nprint(os.listdir('.'))").stdout == "['main.py']\n"


def test_the_machine_stays_responsive_while_bombs_run():
    bombs = [programs.PROGRAMS["fork_bomb_uncapped"], "while True:\n    pass"] * 2
    results = []
    runners = [
        threading.Thread(target=lambda code=code: results.append(run_python(code, timeout_s=4)))
        for code in bombs
    ]
    for runner in runners:
        runner.start()
    # a process started and finished by the caller while the bombs run, and a loop in the caller
    latencies = []
    while any(runner.is_alive() for runner in runners):
        started = time.monotonic()
        subprocess.run(["true"], check=True)
        sum(range(100_000))
        latencies.append(time.monotonic() - started)
    for runner in runners:
        runner.join()
    assert all(isinstance(result, SandboxResult) and result.timed_out for result in results)
    # generous: on 2 shared cores an unbounded fork bomb stalls this for far longer, or forever
    assert latencies and max(latencies) < 20, latencies
    print(f"caller's process start + loop while bombs ran: max {max(latencies):.3f} s")


# programs that go for the code recipe's reward without solving its task: print the grader's
# success marker, patch the grader's eval, return an always-equal object, rewrite the harness's
# count through its frame or its file, print a forged report at exit
NONCE = "import re\nnonce = re.findall(r\"print\\('([0-9a-f]{16})'\", open('main.py').read())[0]\n"
EXIT = "import os\nos._exit(0)"
TAMPERING = {
    "success_marker": NONCE + f"print(nonce, 3, flush=True)\n{EXIT}",
    "forged_report": NONCE
    + f"import json\nprint(nonce, json.dumps(['true'] * 3), flush=True)\n{EXIT}",
    "patched_eval": "import builtins\nbuiltins.eval = lambda *args, **kwargs: True",
    "always_equal": "class Equal:\n    def __eq__(self, other):\n        return True\n"
    "def f(x):\n    return Equal()",
    "frame_count": "import sys\nsys._getframe(1).f_globals['passed'] = 3",
    "rewritten_tests": "open('main.py', 'w').write('print(3)')\n"
    "import json\njson.dumps = lambda value: '3'",
    "report_at_exit": NONCE + "import atexit\natexit.register(lambda: print(nonce, 3))",
}


@pytest.mark.parametrize("tampering", list(TAMPERING))
def test_a_program_cannot_forge_the_code_recipes_grade(tampering):
    code = load_plugin("code")
    sample = code.make_dataset(1, 0)[0]
    assert code.tests_passed(TAMPERING[tampering], sample["tests"]) == 0
    env = code.AgentRunner()
    env.reset(sample)
    assert env.step(f"```python\n{TAMPERING[tampering]}\n```").reward == 0.0

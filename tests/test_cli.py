"""The CLI end to end, in subprocesses: train, read the store live and after, runs, doctor, bad
input."""

import json
import os
import signal
import subprocess
import sys
import time

import anthropic
import openai
import pytest

from workbench.store import list_runs, open_run

# the runs of this module join one Ray (conftest.one_ray)
pytestmark = pytest.mark.usefixtures("one_ray")

FAST = [
    "+recipe=arith",
    "trainer.steps=4",
    "model.warm_start_steps=0",
    "tracking=none",
    "run.progress=false",
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
]


def molt_wb(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "workbench.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        **kwargs,
    )


@pytest.mark.slow
def test_train_writes_a_run_that_duckdb_reads_live_and_after(tmp_path):
    root = tmp_path / "runs"
    command = [
        sys.executable,
        "-m",
        "workbench.cli",
        "train",
        *FAST,
        "trainer.steps=12",
        f"run.root={root}",
        "run.id=live",
        "run.flush_seconds=0",
        "tracking.wandb.mode=offline",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    live_counts = []
    try:
        deadline = time.time() + 300
        while process.poll() is None and time.time() < deadline:
            if (root / "live" / "run.json").exists():
                row = json.loads((root / "live" / "run.json").read_text())
                count = (
                    open_run("live", str(root)).execute("select count(*) from tokens").fetchone()[0]
                )
                if row["status"] == "running" and count:
                    live_counts.append(count)
            time.sleep(0.2)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, err[-2000:]
    assert live_counts, "no token rows were readable while the run was going"
    db = open_run("live", str(root))
    total = db.execute("select count(*) from tokens").fetchone()[0]
    assert live_counts[0] < total
    # the real token count: every segment's length, and every step's rollout batch
    assert total == db.execute("select sum(num_tokens) from segments").fetchone()[0]
    assert db.execute("select count(*), count(distinct step) from segments").fetchone() == (
        12 * 16,
        12,
    )
    assert (
        db.execute(
            "select count(*) from tokens where loss_mask = 1 and behavior_version <> step"
        ).fetchone()[0]
        == 0
    )
    assert (
        db.execute(
            "select max(abs(train_logprob - behavior_logprob)) from tokens where loss_mask = 1"
        ).fetchone()[0]
        < 1e-3
    )
    keys = {k for (k,) in db.execute("select distinct key from metrics").fetchall()}
    assert {
        "reward/mean",
        "loss/policy",
        "rollout/tokens",
        "perf/tokens_per_s",
        "mismatch/kl",
    } <= keys
    # the store actor's CPU per step: every step costs it something, and never more than the whole
    # run took
    store_cpu = [
        v
        for (v,) in db.execute(
            "select value from metrics where key = 'perf/store_cpu_s' and step > 0"
        ).fetchall()
    ]
    assert len(store_cpu) == 11 and all(v > 0 for v in store_cpu)
    assert (
        sum(store_cpu)
        < db.execute("select sum(value) from metrics where key = 'perf/step_s'").fetchone()[0] * 2
    )
    row = db.execute("select status, steps_done, recipe from runs").fetchone()
    assert row == ("finished", 12, "arith")
    config = (root / "live" / "config.yaml").read_text()
    assert "steps: 12" in config and "plugin: arith" in config
    assert list((root / "live" / "wandb").glob("offline-run-*live"))
    listing = molt_wb("runs", "--root", str(root))
    assert "live" in listing.stdout and "finished" in listing.stdout and "12/12" in listing.stdout


@pytest.mark.slow
def test_multirun_runs_every_job_under_one_sweep_id(tmp_path):
    result = molt_wb("train", *FAST, "trainer.steps=2", f"run.root={tmp_path}", "-m", "seed=0,1")
    assert result.returncode == 0, result.stderr[-2000:]
    runs = list_runs(str(tmp_path))
    assert len(runs) == 2 and len({r["sweep_id"] for r in runs}) == 1 and runs[0]["sweep_id"]
    assert sorted(r["config"]["seed"] for r in runs) == [0, 1] and {r["status"] for r in runs} == {
        "finished"
    }


@pytest.mark.parametrize(
    "args, words",
    [
        (["trainer.stepz=3"], "Bad config override"),
        (["agent.plugin=nowhere"], "agent.plugin"),
        (["data.path=/no/such.parquet"], "data.path=/no/such.parquet does not exist"),
        (["model=hf", "model.path=/no/ckpt"], "model.path=/no/ckpt"),
    ],
)
def test_bad_input_is_one_clear_sentence_not_a_traceback(tmp_path, args, words):
    result = molt_wb("train", *FAST, f"run.root={tmp_path}", *args)
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["train"],
        ["sft", "conversations.jsonl"],
        ["serve"],
        ["tune", "trainer.lr=interval(1e-4,1e-2)", "--trials", "1"],
    ],
)
def test_every_command_that_composes_a_config_finds_a_recipe_through_config_dir(tmp_path, command):
    # the user's recipe names an estimator that does not exist: the command reaches validation
    # (and refuses it) only where it found the recipe
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    recipe = "# @package _global_\nalgo:\n  advantage: my_own_estimator\n"
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text(recipe)
    args = [*command, "+recipe=mine", f"run.root={tmp_path / 'runs'}"]
    found = molt_wb(*args, "--config-dir", str(tmp_path / "conf"), cwd=tmp_path)
    assert found.returncode == 2, found.stderr
    assert "algo.advantage=my_own_estimator is unknown" in found.stderr
    lost = molt_wb(*args, cwd=tmp_path)
    assert lost.returncode == 2, lost.stderr
    assert "give its folder with --config-dir" in lost.stderr


def test_doctor_reports_versions_gpu_and_run_folder():
    result = molt_wb("doctor")
    assert result.returncode == 0
    for word in ("torch", "ray", "vllm", "gpu", "runs"):
        assert word in result.stdout


def test_importing_the_core_loads_no_heavy_framework():
    code = (
        "import sys, workbench, workbench.config, workbench.api, workbench.run.loop, "
        "workbench.learner.learner, workbench.store, workbench.invariants.token_identity, "
        "workbench.tracking;"
        "heavy = [m for m in ('ray', 'vllm', 'textual', 'wandb', 'mlflow') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_command_line_and_the_store_actor_start_without_torch():
    # `molt-wb --help`, `runs`, `compare` import workbench.cli; the store actor unpickles a config
    code = (
        "import sys, workbench.cli, workbench.config, workbench.store.actor;"
        "heavy = [m for m in ('torch', 'transformers') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("plugin", ["chat_minimal", "chat_anthropic", "tool_env"])
def test_chat_agents_and_the_tool_env_train_end_to_end(tmp_path, plugin):
    result = molt_wb(
        "train",
        *FAST,
        "trainer.steps=2",
        f"run.root={tmp_path}",
        "run.id=agent",
        f"agent.plugin={plugin}",
        "agent.max_turns=3",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    db = open_run("agent", str(tmp_path))
    assert db.execute("select count(distinct rollout_id) from segments").fetchone()[0] == 2 * 16
    assert (
        db.execute("select max(value) from metrics where key = 'identity/violations'").fetchone()[0]
        == 0
    )
    wires = dict(db.execute("select wire, count(*) from requests group by wire").fetchall())
    expected = {
        "chat_minimal": {"openai": 32},
        "chat_anthropic": {"anthropic": 64},
        "tool_env": {},
    }[plugin]
    # Env episodes do not go through the server
    assert wires == expected
    # the second turn extended the first: its prompt reused turn one's ids
    if plugin == "chat_anthropic":
        assert (
            db.execute(
                "select min(prompt_tokens_reused) from requests where action = 'extend'"
            ).fetchone()[0]
            > 0
        )


def test_serve_prints_sessions_and_records_them_on_sigterm(tmp_path):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            "--json",
            "--sessions",
            "2",
            f"run.root={tmp_path}",
            "run.id=served",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        infos = [json.loads(process.stdout.readline()) for _ in range(2)]
        assert {"session", "openai_base_url", "anthropic_base_url", "api_key", "run_id"} <= set(
            infos[0]
        )
        client = openai.OpenAI(
            base_url=infos[0]["openai_base_url"], api_key=infos[0]["api_key"], max_retries=0
        )
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        aclient = anthropic.Anthropic(
            base_url=infos[1]["anthropic_base_url"], api_key=infos[1]["api_key"], max_retries=0
        )
        aclient.messages.create(
            model="policy", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()
    db = open_run("served", str(tmp_path))
    assert db.execute("select count(*) from segments").fetchone()[0] == 2
    assert sorted(db.execute("select wire from requests").fetchall()) == [
        ("anthropic",),
        ("openai",),
    ]
    assert db.execute("select status from runs").fetchone()[0] == "finished"
    assert db.execute("select count(*) from tokens where loss_mask = 1").fetchone()[0] >= 2


def test_a_run_killed_with_sigkill_is_marked_crashed_by_the_next_command(tmp_path):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workbench.cli",
            "serve",
            "--json",
            f"run.root={tmp_path}",
            "run.id=killed",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # serving: the run exists and is running
        json.loads(process.stdout.readline())
        assert json.loads((tmp_path / "killed" / "run.json").read_text())["status"] == "running"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        process.kill()
    listing = molt_wb("runs", "--root", str(tmp_path))
    assert "crashed" in listing.stdout
    assert json.loads((tmp_path / "killed" / "run.json").read_text())["status"] == "crashed"


@pytest.fixture
def broken_torchcodec(tmp_path) -> dict:
    """An installed torchcodec that fails to load, as the CUDA build pip pulls in with vLLM does on
    a CPU torch."""
    site = tmp_path / "site"
    (site / "torchcodec").mkdir(parents=True)
    (site / "torchcodec" / "__init__.py").write_text(
        "raise OSError('libnvrtc.so.12: cannot open shared object file')\n"
    )
    (site / "torchcodec-0.9.0.dist-info").mkdir()
    (site / "torchcodec-0.9.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchcodec\nVersion: 0.9.0\n"
    )
    return dict(os.environ, PYTHONPATH=str(site))


def test_doctor_and_engine_vllm_name_the_command_that_removes_a_broken_companion(
    broken_torchcodec, tmp_path
):
    doctor = molt_wb("doctor", env=broken_torchcodec)
    assert doctor.returncode == 0
    assert "torchcodec" in doctor.stdout
    assert "pip uninstall -y torchvision torchaudio torchcodec" in doctor.stdout
    train = molt_wb("train", *FAST, f"run.root={tmp_path}", "engine=vllm", env=broken_torchcodec)
    assert train.returncode == 2
    assert "torchcodec do not import" in train.stderr
    assert "pip uninstall -y torchvision torchaudio torchcodec" in train.stderr
    assert "Traceback" not in train.stderr


def test_doctor_names_nothing_broken_where_nothing_is():
    doctor = molt_wb("doctor")
    assert "broken" not in doctor.stdout

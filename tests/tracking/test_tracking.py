"""Every logged metric reaches each enabled backend at its step; tested against real wandb and
mlflow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from workbench.config import ConfigError, compose_config
from workbench.tracking import make_sinks

REPO = Path(__file__).resolve().parents[2]
STEPS = [
    {"reward/mean": 0.25, "loss/policy": -1.5},
    {"reward/mean": 0.5, "loss/policy": -1.0},
    {"reward/mean": 0.75, "loss/policy": -0.5},
]
# the wandb command of this environment, whether or not its bin folder is on PATH
WANDB = str(Path(sys.executable).parent / "wandb")
CONFIG = {"lr": 3e-6, "model": {"name": "tiny-qwen", "layers": 2}, "notes": "x" * 10_000}


def tracking(wandb_mode="disabled", mlflow_uri=None):
    return OmegaConf.create(
        {
            "wandb": {"mode": wandb_mode, "project": "molt-wb", "entity": None},
            "mlflow": {
                "enabled": mlflow_uri is not None,
                "tracking_uri": mlflow_uri,
                "experiment": "molt-wb",
            },
        }
    )


def log_steps(sinks, status="finished"):
    for step, metrics in enumerate(STEPS):
        for sink in sinks:
            sink.log(metrics, step=step)
    for sink in sinks:
        sink.close(status)


def run_python(code):
    env = os.environ | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_import_pulls_in_neither_wandb_nor_mlflow():
    result = run_python(
        "import sys, workbench.tracking; "
        "assert not {'wandb', 'mlflow'} & set(sys.modules), sys.modules.keys()"
    )
    assert result.returncode == 0, result.stderr


def test_unknown_wandb_mode_names_the_key():
    with pytest.raises(ConfigError, match=r"tracking\.wandb\.mode must be offline, online or"):
        compose_config(["tracking.wandb.mode=offlin"])


def test_disabled_wandb_and_mlflow_give_no_sinks(tmp_path):
    assert make_sinks(tracking("disabled"), str(tmp_path / "run"), "r0", {}) == []
    assert not (tmp_path / "run").exists()


def wandb_records(run_file) -> list[dict]:
    """The records of an offline run's transaction log, read by `wandb leet inspect --json` (wandb's
    own reader of the binary log)."""
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_ERROR_REPORTING": "false"}
    inspect = subprocess.run(
        [WANDB, "leet", "inspect", "--json", str(run_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return [json.loads(line) for line in inspect.stdout.splitlines()]


def test_wandb_offline_run_records_every_step(tmp_path):
    run_dir = tmp_path / "runs" / "run-7"
    [sink] = make_sinks(tracking("offline"), str(run_dir), "run-7", CONFIG, group="sweep-a")
    log_steps([sink])

    [run_file] = run_dir.glob("wandb/offline-run-*-run-7/run-run-7.wandb")
    records = wandb_records(run_file)
    history = [record["history"] for record in records if record["type"] == "history"]
    assert [entry["step"].get("num", 0) for entry in history] == [0, 1, 2]
    for entry, metrics in zip(history, STEPS, strict=True):
        assert {key: entry["item"][key] for key in metrics} == metrics
    [run] = [record["run"] for record in records if record["type"] == "run"]
    assert (run["run_id"], run["display_name"], run["run_group"]) == ("run-7", "run-7", "sweep-a")
    assert run["config"]["update"]["model"] == CONFIG["model"]
    assert [
        record["exit"].get("exit_code", 0) for record in records if record["type"] == "exit"
    ] == [0]


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def mlflow_uri(runs_root):
    # one store per module: its migrations take seconds
    return f"sqlite:///{runs_root / 'mlflow.db'}"


def test_mlflow_run_in_the_default_store_records_every_step_and_the_params(runs_root, mlflow_uri):
    tracking_config = tracking()
    # tracking_uri None: the store beside the run folders
    tracking_config.mlflow.enabled = True
    [sink] = make_sinks(tracking_config, str(runs_root / "run-8"), "run-8", CONFIG)
    log_steps([sink])

    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    for key in STEPS[0]:
        history = client.get_metric_history(sink.run_id, key)
        assert [(point.step, point.value) for point in history] == [
            (step, metrics[key]) for step, metrics in enumerate(STEPS)
        ]
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run-8"
    assert run.data.params["model.name"] == "tiny-qwen" and run.data.params["model.layers"] == "2"
    assert run.data.params["lr"] == str(3e-6)
    # mlflow's value limit
    assert run.data.params["notes"] == "x" * 6000


@pytest.mark.parametrize(
    ("status", "mlflow_status"), [("failed", "FAILED"), ("interrupted", "KILLED")]
)
def test_mlflow_run_status_follows_close(tmp_path, mlflow_uri, status, mlflow_status):
    [sink] = make_sinks(tracking(mlflow_uri=mlflow_uri), str(tmp_path / "run-9"), "run-9", {})
    sink.close(status)

    from mlflow.tracking import MlflowClient

    assert MlflowClient(mlflow_uri).get_run(sink.run_id).info.status == mlflow_status


def test_enabled_mlflow_without_mlflow_installed_says_how_to_fix():
    code = (
        # makes `import mlflow` fail as if uninstalled
        "import sys; sys.modules['mlflow'] = None\n"
        "from types import SimpleNamespace as NS\n"
        "from workbench.tracking import make_sinks\n"
        "make_sinks(NS(wandb=NS(mode='disabled'), mlflow=NS(enabled=True)), '/tmp/run', 'r', {})"
    )
    result = run_python(code)
    sentence = "tracking.mlflow.enabled=true needs the mlflow extra: pip install -e '.[mlflow]'."
    assert f"RuntimeError: {sentence}" in result.stderr


def test_mlflow_runs_of_one_sweep_share_a_parent_run(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    sinks = [
        make_sinks(
            tracking(mlflow_uri=mlflow_uri),
            str(tmp_path / f"job-{i}"),
            f"job-{i}",
            {},
            group="sweep-x",
        )[0]
        for i in range(2)
    ]
    log_steps(sinks)
    client = MlflowClient(mlflow_uri)
    parents = {client.get_run(s.run_id).data.tags["mlflow.parentRunId"] for s in sinks}
    assert len(parents) == 1
    assert client.get_run(parents.pop()).info.run_name == "sweep-x"


def test_a_resumed_run_continues_its_mlflow_run(tmp_path, mlflow_uri):
    from mlflow.tracking import MlflowClient

    [first] = make_sinks(tracking(mlflow_uri=mlflow_uri), str(tmp_path / "run-r"), "run-r", CONFIG)
    first.log({"train/loss": 1.0}, step=0)
    first.close("interrupted")
    # the resume: same run id, a changed config value (mlflow never changes a param)
    changed = dict(CONFIG, lr=1.0)
    [again] = make_sinks(tracking(mlflow_uri=mlflow_uri), str(tmp_path / "run-r"), "run-r", changed)
    again.log({"train/loss": 0.5}, step=1)
    again.close()
    client = MlflowClient(mlflow_uri)
    assert again.run_id == first.run_id
    history = client.get_metric_history(again.run_id, "train/loss")
    assert [(point.step, point.value) for point in history] == [(0, 1.0), (1, 0.5)]
    assert client.get_run(again.run_id).info.status == "FINISHED"
    named = client.search_runs(
        [client.get_run(again.run_id).info.experiment_id], "attributes.run_name = 'run-r'"
    )
    assert len(named) == 1


def test_a_resumed_run_continues_its_wandb_run(tmp_path):
    run_dir = tmp_path / "runs" / "run-w"
    for step in range(2):
        [sink] = make_sinks(tracking("offline"), str(run_dir), "run-w", CONFIG)
        sink.log({"train/loss": 1.0 - step}, step=step)
        sink.close("interrupted" if step == 0 else "finished")
    # one folder per start (`...-run-w-1` for a second start within the same second)
    files = sorted(run_dir.glob("wandb/offline-run-*-run-w*/run-run-w.wandb"))
    runs = []
    for run_file in files:
        runs += [record["run"] for record in wandb_records(run_file) if record["type"] == "run"]
    # both halves are the one wandb run `run-w`, opened to resume (what `wandb sync` merges)
    assert [(run["run_id"], run.get("resume")) for run in runs] == [("run-w", True)] * 2

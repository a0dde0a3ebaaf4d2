"""Scale-out: a run joins an existing two-node Ray cluster and its rollout workers land where
their resource is.

Both nodes run on loopback as `ray start --block` processes with their own temp folder; the test
ends them by process id (a plain `ray stop` would stop every Ray of this user on the machine).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import free_port

from workbench.config import ConfigError, compose_config
from workbench.models.tiny import cache_root
from workbench.run.cluster import actor_env, init_ray, joined, placement, ray_cpus


@pytest.fixture(scope="module")
def cluster():
    """(address, processes) of a head (1 CPU) and a second node (1 CPU, resource rollout_node=2)."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    common = ["--node-ip-address=127.0.0.1", "--num-cpus=1", "--block", "--disable-usage-stats"]
    nodes = [
        subprocess.Popen(
            [
                ray_cli,
                "start",
                "--head",
                f"--port={port}",
                "--include-dashboard=false",
                f"--temp-dir={temp}",
                *common,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]
    address = f"127.0.0.1:{port}"
    try:
        wait = (
            f"import ray, time; ray.init(address='{address}', logging_level='ERROR'); print('up')"
        )
        subprocess.run(
            [sys.executable, "-c", wait], env=env, check=True, capture_output=True, timeout=120
        )
        nodes.append(
            subprocess.Popen(
                [
                    ray_cli,
                    "start",
                    f"--address={address}",
                    '--resources={"rollout_node": 2}',
                    *common,
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        yield address, env
    finally:
        # always: each node's process group (raylet, GCS, workers) by its id
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGTERM)
        for node in reversed(nodes):
            try:
                node.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_rollout_workers_run_on_the_node_that_offers_their_resource(cluster, tmp_path):
    address, env = cluster
    # the run names no ray.address: it joins the cluster RAY_ADDRESS names, as Ray's own tools do
    train = [
        sys.executable,
        "-m",
        "workbench.cli",
        "train",
        "trainer.steps=2",
        "trainer.prompts_per_step=2",
        "trainer.group_size=2",
        "ray.rollout_workers=2",
        "ray.rollout_cpus=0.5",
        "+ray.rollout_resources.rollout_node=1",
        f"run.root={tmp_path}",
        "run.id=two-nodes",
        "tracking.wandb.mode=disabled",
        "run.progress=false",
    ]
    joining = dict(env, RAY_ADDRESS=address)
    result = subprocess.run(train, env=joining, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    run = json.loads((tmp_path / "two-nodes" / "run.json").read_text())
    assert run["status"] == "finished" and run["steps_done"] == 2
    nodes = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import ray, json; ray.init(address='{address}', logging_level='ERROR'); "
            "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    resources = json.loads(nodes.stdout.strip().splitlines()[-1])
    assert len(resources) == 2
    placement = run["placement"]
    assert len(placement["rollout_workers"]) == 2
    assert all(resources[node].get("rollout_node") == 2 for node in placement["rollout_workers"])
    assert "rollout_node" not in resources[placement["learner"]]  # the learner stayed on the head


@pytest.mark.slow
def test_colocated_placement_packs_learner_and_workers_onto_one_node(cluster):
    import ray

    address, _ = cluster
    cfg = compose_config(
        [
            f"ray.address={address}",
            "ray.colocate=true",
            "ray.rollout_workers=2",
            "ray.learner_cpus=0.5",
            "ray.rollout_cpus=0.25",
            "run.id=packed",
        ]
    )
    ray.init(address=address, logging_level="ERROR")
    try:
        learner, *workers = placement(cfg)
        group = learner["scheduling_strategy"].placement_group
        assert [w["scheduling_strategy"].placement_group_bundle_index for w in workers] == [1, 2]
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK" and table["bundles"][0] == {"CPU": 0.5}
        assert len(set(table["bundles_to_node_id"].values())) == 1  # all three bundles on one node
        ray.util.remove_placement_group(group)
    finally:
        ray.shutdown()


def test_ray_address_names_the_ray_a_run_joins_before_the_environment_does(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert joined(compose_config([])) == "127.0.0.1:6379"
    assert joined(compose_config(["ray.address=auto"])) == "auto"
    monkeypatch.delenv("RAY_ADDRESS")
    # neither: the run starts a local Ray of its own
    assert joined(compose_config([])) == ""


@pytest.mark.parametrize("value", [None, ""])
def test_an_unset_or_empty_model_cache_is_the_home_cache_never_the_working_directory(
    monkeypatch, tmp_path, value
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOLT_WB_CACHE", raising=False)
    if value is not None:
        monkeypatch.setenv("MOLT_WB_CACHE", value)
    home_cache = Path.home() / ".cache" / "molt-wb"
    assert cache_root() == home_cache
    assert actor_env()["MOLT_WB_CACHE"] == str(home_cache)


def test_actors_get_the_drivers_model_cache_as_an_absolute_path(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOLT_WB_CACHE", "relative-cache")
    assert actor_env()["MOLT_WB_CACHE"] == str(tmp_path / "relative-cache")


def test_a_sweep_sizes_ray_for_its_largest_job_times_its_parallel_runs():
    small = compose_config(["ray.rollout_workers=1", "sweep.parallel=2"])
    large = compose_config(["ray.rollout_workers=40", "sweep.parallel=2"])
    assert ray_cpus([small, large]) == max(os.cpu_count(), (1 + 40) * 2)
    assert ray_cpus([small]) == max(os.cpu_count(), 4)


def test_a_run_larger_than_the_running_ray_is_refused_in_one_sentence():
    import ray

    init_ray(compose_config(["ray.num_cpus=2"]))
    try:
        with pytest.raises(ConfigError) as error:
            init_ray(compose_config(["ray.rollout_workers=3"]))
        message = str(error.value)
        assert "4 CPUs" in message and "has 2" in message and "\n" not in message
        # one that fits still starts
        init_ray(compose_config(["ray.rollout_workers=1"]))
    finally:
        ray.shutdown()

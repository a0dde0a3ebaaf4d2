"""window.Trailing: the learner gets the next batch before the driver logs a step, unless that
batch is not there yet; a step that checkpoints is logged at once. Real Ray tasks stand for the
learner's metrics and a rollout worker's answer."""

import time
from dataclasses import dataclass

import pytest
import ray

from workbench.config import compose_config
from workbench.run.run_folder import plain
from workbench.run.window import Trailing


@ray.remote(num_cpus=0)
class Gate:
    """Holds `held` tasks until opened: a learner step or a rollout that has not ended yet."""

    def __init__(self):
        self.opened = False

    def open(self):
        self.opened = True

    def is_open(self):
        return self.opened


@ray.remote(num_cpus=0)
def held(gate, value):
    while not ray.get(gate.is_open.remote()):
        time.sleep(0.01)
    return value


@dataclass
class Batch:
    """A batch in flight (faults.InFlight) as `Trailing.before` reads it."""

    failure_refs: list


@pytest.fixture(scope="module")
def local_ray():
    # the Ray an earlier test's run started in this process, else a small one, shut down after
    # (a later run sizes its own)
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


def trailing(logged: list, *overrides):
    # a wait that should not happen fails in a minute (not seconds: a loaded machine's Ray task
    # can take seconds to schedule, and no passing test waits for it)
    defaults = ["+recipe=arith", "trainer.checkpoint_every=0", "trainer.timeout_s=60"]
    cfg = plain(compose_config([*defaults, *overrides]))
    return Trailing(cfg, lambda step, metrics, sent: logged.append((step, metrics["loss"])))


def test_a_step_whose_metrics_come_first_is_logged_while_the_batch_is_drawn(local_ray):
    logged = []
    steps = trailing(logged)
    steps.after(0, ray.put({"loss": 0.5}), None, [], None)
    assert logged == []
    gate = Gate.remote()
    batch = Batch([held.remote(gate, [])])
    steps.before(batch)
    # logged before the batch came
    assert logged == [(0, 0.5)]
    assert ray.wait(batch.failure_refs, timeout=0)[1] == batch.failure_refs
    gate.open.remote()


def test_the_next_batch_goes_to_the_learner_before_a_slow_step_is_logged(local_ray):
    logged = []
    steps = trailing(logged)
    gate = Gate.remote()
    steps.after(0, held.remote(gate, {"loss": 0.5}), None, [], None)
    steps.before(Batch([ray.put([])]))
    assert logged == []
    # the learner's step ends
    gate.open.remote()
    steps.after(1, ray.put({"loss": 0.25}), None, [], None)
    assert logged == [(0, 0.5)]
    steps.flush()
    assert logged == [(0, 0.5), (1, 0.25)]
    assert steps.pending is None


def test_a_step_that_checkpoints_or_evaluates_is_logged_at_once(local_ray):
    logged = []
    steps = trailing(logged, "trainer.checkpoint_every=2", "eval.every=3")
    for step in range(5):
        steps.after(step, ray.put({"loss": float(step)}), None, [], None)
    # steps 1 and 3 (checkpoints) and 2 (an evaluation) at once, 0 behind 1; 4 trails
    assert [step for step, _ in logged] == [0, 1, 2, 3]
    steps.flush()
    assert [step for step, _ in logged] == [0, 1, 2, 3, 4]

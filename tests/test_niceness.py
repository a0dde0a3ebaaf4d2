"""A run's actors compete for the cores at the driver's priority: Ray alone would start its workers
at nice 15, and any other busy process on the machine would starve the learner and the rollout
workers."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import os

    import ray

    from workbench.config import compose_config
    from workbench.run.cluster import init_ray

    init_ray(compose_config(["+recipe=arith"]))

    @ray.remote
    def niceness():
        return os.nice(0)

    print(os.nice(0), ray.get(niceness.remote()))
    ray.shutdown()
    """
)


def test_the_runs_ray_workers_run_at_the_drivers_niceness():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    driver, worker = result.stdout.split()
    assert worker == driver

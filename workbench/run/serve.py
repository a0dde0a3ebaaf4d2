"""`molt-wb serve`: the loopback server standalone, with every session recorded as a run."""

import numpy as np

from workbench.rollout.worker import Job, RolloutWorker
from workbench.run.model_paths import policy_path
from workbench.run.run_folder import start_run
from workbench.store.schema import step_tables
from workbench.store.writer import RunWriter


class Recorder:
    """A rollout worker's server and engine, a run folder, and `sessions` open sessions."""

    def __init__(self, cfg, sessions: int):
        run_dir, row = start_run(cfg)
        self.run_id = cfg.run.id
        self.writer = RunWriter(
            str(run_dir),
            dict(row, recipe=row["recipe"] or "serve"),
            cfg.run.flush_rows,
            cfg.run.flush_seconds,
        )
        self.worker = RolloutWorker(cfg, policy_path(cfg))
        server = self.worker.server()
        self.infos = [
            dict(server.open_session(rollout_id), run_id=self.run_id)
            for rollout_id in range(sessions)
        ]

    def close(self):
        """Seal every session, store its segments and requests, mark the run finished."""
        segments = []
        for rollout_id, info in enumerate(self.infos):
            pieces, requests = self.worker.server().close_session(info["session"])
            episode = self.worker._segments(
                Job({}, rollout_id, rollout_id), pieces, 0.0, pieces[-1].finish if pieces else ""
            )
            if episode:
                episode[0].requests = requests
            segments += episode
        if segments:
            learner = {
                "train_logprob": [np.full(len(s.token_ids), np.nan, np.float32) for s in segments],
                "is_weight": [np.ones(len(s.token_ids), np.float32) for s in segments],
                "advantage": [0.0] * len(segments),
            }
            for name, table in step_tables(self.run_id, 0, 0, segments, learner).items():
                self.writer.append(name, table)
        self.writer.close("finished")
        self.worker.server().stop()

"""A wandb sink: a run whose id and name are the workbench run id; offline by default, its files
under the run folder."""

import os

import wandb

# wandb has no "interrupted" state: any non-zero exit code shows as failed; 130 is SIGINT's.
EXIT_CODES = {"finished": 0, "failed": 1, "interrupted": 130}


class WandbSink:
    def __init__(self, wandb_config, run_dir, run_id, config, group):
        offline = wandb_config.mode == "offline"
        # else wandb warns "git root ... does not exist"
        os.makedirs(run_dir, exist_ok=True)
        if offline:
            # wandb-core's error reporting is switched off only by this variable, not by Settings.
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        self.run = wandb.init(
            project=wandb_config.project,
            entity=wandb_config.entity,
            id=run_id,
            name=run_id,
            # a resumed run (same id) continues its wandb run
            resume="allow",
            group=group,
            config=config,
            dir=run_dir,
            mode=wandb_config.mode,
            # never finish a run someone else in this process started
            reinit="create_new",
            settings=wandb.Settings(
                silent=True,
                console="off",
                # the system monitor may query a cloud metadata server
                x_disable_stats=offline,
                x_disable_machine_info=offline,
            ),
        )

    def log(self, metrics, step):
        self.run.log(metrics, step=step)

    def close(self, status="finished"):
        self.run.finish(exit_code=EXIT_CODES[status])

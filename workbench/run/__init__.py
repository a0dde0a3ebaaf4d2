"""The driver: the RL loop and its window, the Ray cluster, faults and recovery, checkpoints,
the run folder, data order, progress and the summary, evaluation, sweeps, SFT. What a run does
between steps changes here; nothing outside run/ and the CLI imports it."""

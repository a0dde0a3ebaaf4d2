"""The learner actor: batches of Segments collated, π_old, the gate, the loss and the optimizer
step, sharded over ranks, and the weights sent to the rollout workers. How a step trains
changes here."""

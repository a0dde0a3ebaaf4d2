"""The learner's own state in a checkpoint: what each learner rank writes and reads back.

Every rank writes its shards of the model and optimizer state into `state/`
(torch.distributed.checkpoint, loadable into any number of ranks); rank 0 writes the whole policy
with its tokenizer and processor files into `policy/`, and `trainer.pt` (version, RNG states and
the driver's loop state). The driver (run/checkpoint.py) names the folder, commits and prunes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from workbench.learner.sharding import Ranks

# while this file lies in a run's checkpoints/, each checkpoint write waits halfway (its state
# written, its policy and trainer.pt not): the recovery tests and the chaos soak kill a learner
# inside a write this way
HOLD = "hold"


class LearnerState(Protocol):
    """What a checkpoint holds of a learner rank (`learner.Learner`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    ranks: Ranks
    version: int
    # the tokenizer, chat template and image processor files: `side_files`
    side_files: dict[str, bytes]


def side_files(model_path: str | Path) -> dict[str, bytes]:
    """The tokenizer, chat template and image processor files beside a policy's weights, read
    once: a resumed run's `model_path` is a checkpoint that `keep_checkpoints` later deletes."""
    return {
        file.name: file.read_bytes()
        for file in Path(model_path).iterdir()
        if file.is_file()
        and not file.name.endswith((".safetensors", ".bin", ".pt", ".pth", ".index.json"))
    }


def _sharded_state(learner: LearnerState) -> dict[str, dict[str, Any]]:
    """This rank's shards of the trainable parameters and the optimizer state, as `state/` holds
    them. Frozen parameters stay out: a LoRA policy's base (the run builds it again from where it
    started) would make each checkpoint the model's size, not the adapter's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=True)
    model, optimizer = get_state_dict(learner.model, learner.optimizer, options=options)
    return {"model": model, "optimizer": optimizer}


def save_learner(learner: LearnerState, folder: str | Path, driver_state: dict[str, Any]) -> int:
    """Runs in every learner rank: its shards of the model and optimizer into `state/`; rank 0
    the whole policy (with its tokenizer files) and trainer.pt."""
    import torch
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(learner), checkpoint_id=Path(folder, "state"))
    wait_while_held(folder)
    full = learner.ranks.full_state_dict(learner.model)
    if learner.ranks.rank:
        return learner.version
    save_policy(learner, Path(folder, "policy"), full)
    torch.save(
        dict(driver_state, version=learner.version, torch_rng=torch.get_rng_state()),
        Path(folder, "trainer.pt"),
    )
    return learner.version


def wait_while_held(folder: str | Path) -> None:
    """Wait while a `HOLD` file lies beside the checkpoint being written into `folder`."""
    hold = Path(folder).parent / HOLD
    while hold.exists():
        time.sleep(0.05)


def save_policy(
    learner: LearnerState, folder: Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """The learner's policy as `save_pretrained` writes it (`state_dict`: its whole weights, when
    sharded), its tokenizer and processor files beside it."""
    learner.model.save_pretrained(folder, state_dict=state_dict)
    for name, content in learner.side_files.items():
        if not (folder / name).exists():
            (folder / name).write_bytes(content)


def load_learner(learner: LearnerState, folder: str | Path) -> int:
    """Runs in every learner rank (built from the checkpoint's policy/): model and optimizer
    state resharded to this run's ranks, version, torch RNG."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = torch.load(Path(folder, "trainer.pt"), weights_only=False)
    loaded = _sharded_state(learner)
    # dcp.load fails on any trainable key the checkpoint lacks; the frozen ones it never held
    dcp.load(loaded, checkpoint_id=Path(folder, "state"))
    set_state_dict(
        learner.model,
        learner.optimizer,
        model_state_dict=loaded["model"],
        optim_state_dict=loaded["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    learner.version = state["version"]
    torch.set_rng_state(state["torch_rng"])
    return learner.version

"""The learner's ranks: one torch.distributed process group, the policy sharded with FSDP2, each
rank's slice of a batch's rows, and the collectives that put the slices back together.

With `ray.learner_workers=N` the loop talks to N learner actors as to one
(`cluster.LearnerRanks`): every call goes to every rank, they run it together, rank 0 answers.
Each rank receives the whole batch, computes the forwards and backwards of its own rows only, and
gathers the others' log-probs, so the gate, the advantages and the loss are computed on the whole
batch by every rank, with the same values. A token-mean is over the batch's tokens: the loss each
rank backpropagates is the whole batch's loss with the other ranks' rows held constant, so the
gradients of the ranks sum to the one-rank gradient. N = 1 builds none of this: `Ranks` then
answers as the identity.
"""

from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from workbench.config import Config


class Ranks:
    """This learner's place among `ray.learner_workers` ranks, and the collectives they share."""

    def __init__(self, cfg: Config, rank: int = 0, address: tuple[str, int] | None = None) -> None:
        self.rank = rank
        self.world = cfg.ray.learner_workers
        self.device = torch.device("cpu")
        if cfg.ray.learner_gpus > 0 and torch.cuda.is_available():
            # Ray shows each learner actor its own GPUs
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        if self.world == 1:
            return
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            init_method=f"tcp://{address[0]}:{address[1]}",
            rank=rank,
            world_size=self.world,
            timeout=timedelta(seconds=cfg.trainer.timeout_s),
        )

    def shard(self, model: torch.nn.Module, dtype: str) -> None:
        """FSDP2 on every decoder layer (the model's `_no_split_modules`) and at the root; the
        parameters stay float32, forwards and backwards run in `dtype`, gradients reduce in
        float32."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.world == 1:
            return
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)
        layers = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():
            if type(module).__name__ in layers:
                fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)

    def mine(self, rows: int) -> slice:
        """This rank's contiguous slice of `rows` rows (sizes differ by at most one)."""
        bounds = np.linspace(0, rows, self.world + 1).round().astype(int)
        return slice(int(bounds[self.rank]), int(bounds[self.rank + 1]))

    def count(self, rows: int) -> int:
        """How many of `rows` rows are this rank's."""
        own = self.mine(rows)
        return own.stop - own.start

    def most(self, count: int) -> int:
        """The largest of every rank's `count`."""
        if self.world == 1:
            return count
        value = torch.tensor([count], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value)

    def gather(self, local: torch.Tensor, rows: int) -> torch.Tensor:
        """Every rank's `local` rows ([its slice of `rows`, ...], detached) put together in rank
        order: [rows, ...], the same on every rank."""
        if self.world == 1:
            return local.detach()
        width = -(-rows // self.world)
        # NCCL moves GPU tensors only; gloo no bools
        padded = torch.zeros((width, *local.shape[1:]), dtype=torch.float64, device=self.device)
        padded[: len(local)] = local.detach()
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        bounds = np.linspace(0, rows, self.world + 1).round().astype(int)
        pieces = [part[: bounds[r + 1] - bounds[r]] for r, part in enumerate(parts)]
        return torch.cat(pieces).to("cpu", local.dtype)

    def spliced(self, local: torch.Tensor, rows: int) -> torch.Tensor:
        """The whole batch's [rows, ...] values: this rank's own rows live (they carry the
        gradient), every other rank's gathered and held constant."""
        if self.world == 1:
            return local
        own = self.mine(rows)
        live = local[: own.stop - own.start]
        everyone = self.gather(live, rows)
        whole = torch.cat([everyone[: own.start], live, everyone[own.stop :]])
        if not len(live):
            # a rank without rows: its stand-in row's graph joins the backward with weight 0
            whole = whole + 0 * local.sum()
        return whole

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The policy's full parameters, gathered one tensor at a time: on rank 0 (others: None),
        which never holds more than one full copy."""
        if self.world == 1:
            return model.state_dict()
        full = {}
        for name, tensor in model.state_dict().items():
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            if self.rank == 0:
                full[name] = tensor.detach().cpu()
        return full if self.rank == 0 else None

    def grad_norm(self, norm: torch.Tensor) -> float:
        """A gradient norm as a float; a sharded model's is a DTensor, reduced first."""
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

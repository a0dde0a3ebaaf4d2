"""The collective weight transport (`ray.weight_transport=collective`): learner rank 0 broadcasts
each step's weights to every rollout worker over a gloo group of their own, in buckets.

The group (rank 0: the learner's rank 0; rank i: rollout worker i - 1) has its own TCP store, so it
lives beside the learner ranks' FSDP process group. Its members learn the weights' layout (names,
dtypes, shapes: fixed for a run) once when they join; each push is then a version and the weights'
bytes, bucket by bucket of at most `ray.weight_bucket_mb`, with nothing through the object store.
The loop's step returns a small handle instead of the weights; the window asks every worker to
receive while the learner sends (window.py), and a worker hands what it received to its engine as
a push from the object store would be handed (`load_weights`: same versions, same partial swaps).
A rollout worker that Ray restarts is in no group: every member then joins a new one
(faults.collect), before the next push. One that dies during a push (beside the learner's step, with
`trainer.async_depth` > 0) fails it: a member whose broadcast fails drops its end of the group, so
the others' broadcasts fail at once rather than after the group's timeout (trainer.timeout_s: the
receivers wait through the learner's step), and that push goes through the object store
(window.sync).
"""

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from workbench.config import Config

if TYPE_CHECKING:
    from ray.actor import ActorHandle

# each tensor's name, dtype and shape, in order
Layout = list[tuple[str, torch.dtype, tuple[int, ...]]]


def layout_of(state_dict: dict[str, torch.Tensor]) -> Layout:
    """Each tensor's name, dtype and shape, in order."""
    return [(name, t.dtype, tuple(t.shape)) for name, t in state_dict.items()]


def buckets(layout: Layout, bucket_bytes: int) -> list[list[int]]:
    """The layout's tensors in consecutive buckets of at most `bucket_bytes` (a larger tensor goes
    alone); sender and receivers compute the same ones."""
    out = [[]]
    size = 0
    for index, (_, dtype, shape) in enumerate(layout):
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(index)
        size += nbytes
    return out


class WeightGroup:
    """One member of the transport's gloo group."""

    def __init__(self, address: tuple[str, int], rank: int, world: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(address[0], address[1], world, rank == 0, timeout)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address[0])]
        self.group = dist.ProcessGroupGloo(store, rank, world, options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` from rank 0; where that fails (a member is gone), this member drops
        its end: closing its connections fails the others' broadcasts at once."""
        try:
            self.group.broadcast(tensor, 0).wait()
        except RuntimeError:
            self.group = None
            raise

    def send(self, state_dict: dict[str, torch.Tensor], version: int, bucket_bytes: int) -> int:
        """Broadcast `version` and then `state_dict`'s bytes bucket by bucket; the bytes sent."""
        self.broadcast(torch.tensor([version]))
        tensors = list(state_dict.values())
        sent = 0
        for bucket in buckets(layout_of(state_dict), bucket_bytes):
            payload = torch.cat([tensors[i].cpu().reshape(-1).view(torch.uint8) for i in bucket])
            self.broadcast(payload)
            sent += payload.numel()
        return sent

    def receive(self, layout: Layout, bucket_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
        """The (state dict, version) the learner broadcasts next."""
        version = torch.zeros(1, dtype=torch.int64)
        self.broadcast(version)
        state_dict = {}
        for bucket in buckets(layout, bucket_bytes):
            sizes = [torch.Size(layout[i][2]).numel() * layout[i][1].itemsize for i in bucket]
            payload = torch.empty(sum(sizes), dtype=torch.uint8)
            self.broadcast(payload)
            for index, part in zip(bucket, payload.split(sizes), strict=True):
                name, dtype, shape = layout[index]
                # a fresh storage: a view at an odd offset cannot change dtype
                state_dict[name] = part.clone().view(dtype).reshape(shape)
        return state_dict, int(version)


def free_address() -> tuple[str, int]:
    """This node's address and a free TCP port on it: where rank 0 hosts the process group's
    rendezvous (a Ray task placed in rank 0's bundle)."""
    import ray

    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def join_weight_group(cfg: Config, learner: "ActorHandle", workers: list["ActorHandle"]) -> None:
    """Learner rank 0 and every rollout worker join the collective weight transport's group at
    a free port of rank 0's node (`learner`: its actor, or `cluster.LearnerRanks` standing for
    its ranks); the workers learn the weights' layout."""
    import ray

    layout = learner.weight_layout.remote()
    address = ray.get(learner.__ray_call__.remote(lambda _: free_address()))
    world = len(workers) + 1
    joins = [learner.join_weight_group.remote(address, world)]
    joins += [worker.join_weight_group.remote(address, world, layout, cfg) for worker in workers]
    ray.get(joins, timeout=cfg.trainer.timeout_s)

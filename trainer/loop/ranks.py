"""Several trainer processes (``make train NPROC=2``: torchrun, gloo on CPU, NCCL on GPUs).

TRL's AsyncGRPOTrainer runs the rollout worker and the weight transfer on rank 0 only and hands
it full tensors (``DTensor.full_tensor()`` on every rank under FSDP2, plain parameters under DDP),
so rank 0 alone publishes, with the ordinary ``DeltaPublisher``, one version per optimizer step.
Rank 0 also owns the children, the fleet and the summary; the other ranks wait until rank 0 has
the model folder, build the same trainer and train.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger("trainer.loop.ranks")


def rank() -> int:
    """This process's rank (torchrun's ``RANK``; 0 when run alone)."""
    return int(os.environ.get("RANK", "0"))


def world() -> int:
    """The number of trainer processes (torchrun's ``WORLD_SIZE``; 1 when run alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _group():
    """The default process group, started here (gloo on CPU, NCCL on GPUs) so that the ranks can
    meet before the trainer exists; accelerate uses the group it finds."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if has_cuda() else "gloo")
    return dist


def share_model_path(model_path: str) -> None:
    """Rank 0: tell the other ranks which model folder to load (nothing when run alone)."""
    if world() > 1:
        _group().broadcast_object_list([model_path], src=0)


def run_other_rank(build: Callable[[str], object]) -> dict:
    """A rank other than 0: wait for rank 0's model folder, ``build(model_path)`` the trainer
    and train. Returns an empty summary (rank 0 writes the run's)."""
    got = [None]
    _group().broadcast_object_list(got, src=0)
    log.info("rank %d of %d: training %s", rank(), world(), got[0])
    build(got[0]).train()
    return {}

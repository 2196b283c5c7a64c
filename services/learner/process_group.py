"""The torch.distributed group a learner process trains in (DeepSpeed needs one, even
for a single process).

torch's TCP store (the rendezvous of `tcp://` and `env://`, torchrun's) listens on every
interface with no authentication (`*:port`), so the groups this project makes itself use
none: a group of one process meets in an in-process store, the ranks of one host that
ranks.RankGroup starts meet in a file in the group's private folder. Only a group an
operator launches across hosts (torchrun, DeepSpeed's launcher) rendezvouses over TCP,
on the network they chose for it.
"""

from __future__ import annotations

import os

import torch

# a file the ranks of one host meet in (a file store; ranks.RankGroup sets it per rank)
STORE_ENV = "OPENTINKER_RANK_STORE"


def _one_process_env() -> None:
    """The rank variables of a group of this one process, where none are set (DeepSpeed
    asserts LOCAL_RANK at each engine; something may have unset them since the group
    was made, such as a test's environment restored)."""
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def init_distributed(device: str) -> tuple[int, int]:
    """The torch.distributed group DeepSpeed needs, once per process; returns (rank,
    world size). Data parallel across the ranks, gloo on CPU, nccl on CUDA (one GPU per
    local rank):
    - the learner's own rank group (ranks.py: RANK, LOCAL_RANK, WORLD_SIZE and
      STORE_ENV set): the ranks meet in a file store in the group's private folder;
    - under DeepSpeed's launcher or torchrun (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
      MASTER_PORT set): their group, through their TCP store;
    - otherwise a group of this one process, on an in-process store (no socket)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() == 1:  # this process's own group: DeepSpeed still reads LOCAL_RANK
            _one_process_env()
        return dist.get_rank(), dist.get_world_size()
    backend = "nccl" if device == "cuda" else "gloo"
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    if launched or (STORE_ENV in os.environ and all(k in os.environ for k in ("RANK", "WORLD_SIZE"))):
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if STORE_ENV in os.environ:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.FileStore(os.environ[STORE_ENV], world_size)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
        else:
            dist.init_process_group(backend=backend)  # env:// from the launcher
        return dist.get_rank(), dist.get_world_size()
    _one_process_env()
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return 0, 1

"""Several processes: split the trajectories, reduce the statistics exactly.

Each process replays its own share of the trajectories (`shard`, round-robin by index) into
its own `KVStats`; `reduce_stats` then combines them with one `torch.distributed` all-reduce
per tensor, using the tensor's merge rule (`calibrate.stats.MERGE`): SUM for counts, sums,
histograms and Gram matrices, MIN / MAX for min, max and absmax. Counts stay int64 and sums
float64 through the collective (gloo and NCCL both reduce these dtypes), so the result equals
the single-process summary of all the data: bit for bit for integers and min/max, up to
summation order for float sums. Afterwards every rank holds the same summary; rank 0 writes.

How to start the processes (DESIGN section 8):

    accelerate launch --num_processes N -m calibrate task=stats ...          # GPUs (NCCL)
    torchrun --nproc_per_node N -m calibrate task=stats device=cpu ...        # CPU (gloo)

On CPU the state must be `accelerate.PartialState(cpu=True)`: `accelerate launch --cpu`
starts a single process unless MPI is set up, while torchrun + `PartialState(cpu=True)`
gives a gloo group whose collectives work. `state` may also be None (one process).
Every process calls `finish` before it exits: a gloo group still alive at interpreter exit can
abort the process (SIGABRT, "terminate called without an active exception").
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

from calibrate.sample import QuerySample, merge_queries
from calibrate.stats import KVStats, merge_rule

T = TypeVar("T")

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def shard_indices(n: int, rank: int, world: int) -> list[int]:
    """Indices of n items that process `rank` of `world` handles: rank, rank + world, ...

    Every index goes to exactly one rank, and the shares differ in size by at most one.
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) with world >= 1, got rank={rank}, world={world}")
    return list(range(rank, n, world))


def rank_and_world(state: Any) -> tuple[int, int]:
    """(this process's rank, number of processes); (0, 1) without a distributed state."""
    if state is None:
        return 0, 1
    return state.process_index, state.num_processes


def shard(items: Sequence[T], state: Any) -> list[T]:
    """The items this process handles (all of them for state None or one process)."""
    rank, world = rank_and_world(state)
    return [items[i] for i in shard_indices(len(items), rank, world)]


def finish(state: Any, ok: bool = True) -> None:
    """Tear down the process group of `state` (no-op for None or one process).

    After a successful run every rank waits for the others first, so no rank leaves while
    another still talks to it; after a failure it only tears down its own end (the other
    ranks may never arrive at a barrier).
    """
    if state is None or not dist.is_initialized():
        return
    if ok:
        dist.barrier()
    dist.destroy_process_group()


def _comm_device(state: Any) -> torch.device:
    """NCCL reduces tensors on this process's GPU, gloo on the CPU."""
    return torch.device(state.device) if dist.get_backend() == "nccl" else torch.device("cpu")


def _check_group(state: Any) -> bool:
    """True when there is more than one process to reduce over."""
    _, world = rank_and_world(state)
    if world == 1:
        return False
    if not dist.is_initialized():
        raise RuntimeError(
            f"{world} processes but no torch.distributed process group (create accelerate's state first)")
    return True


def reduce_stats(stats: KVStats, state: Any) -> KVStats:
    """Combine every rank's `stats` in place by each tensor's merge rule; returns `stats`."""
    if not _check_group(state):
        return stats
    device = _comm_device(state)
    for name in sorted(stats.tensors):  # the same order on every rank
        t = stats.tensors[name].to(device)
        dist.all_reduce(t, op=_OPS[merge_rule(name)])
        stats.tensors[name] = t.to(stats.device)
    return stats


def reduce_queries(sample: QuerySample, state: Any) -> QuerySample:
    """Gather every rank's reservoir and fold them with `merge_queries` in rank order.

    Every rank computes the same fold, so all ranks return the same sample.
    """
    if not _check_group(state):
        return sample
    _, world = rank_and_world(state)
    device = _comm_device(state)
    gathered = {}
    for name, t in sample.to_tensors().items():
        t = t.to(device)
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)
        gathered[name] = [p.cpu() for p in parts]
    samples = [
        QuerySample.from_tensors(sample.settings(), {n: gathered[n][r] for n in gathered}, sample.device)
        for r in range(world)
    ]
    out = samples[0]
    for other in samples[1:]:
        out = merge_queries(out, other)
    return out

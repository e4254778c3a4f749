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


# ---- the fit, sharded by layer -------------------------------------------------------------------
class Shard:
    """Which layers this process fits, and how the owners share what they fitted.

    Layer l belongs to rank l mod W (`owner`). The owner of a layer holds its trace and does its
    objective work; `share` (JSON-able results, e.g. a layer's chosen steps and scores) and
    `share_rows` (tensors, in place) broadcast from the owner, so every rank ends up with the same
    choices and makes the same later decisions. With one process everything is owned and sharing
    is the identity.
    """

    def __init__(self, state: Any = None):
        self.state = state
        self.rank, self.world = rank_and_world(state)
        self.active = _check_group(state)

    def owner(self, layer: int) -> int:
        return layer % self.world

    def owns(self, layer: int) -> bool:
        return self.owner(layer) == self.rank

    def share(self, layer: int, obj: Any) -> Any:
        """`obj` as the owner of `layer` has it (JSON round trip: no pickle crosses processes)."""
        if not self.active:
            return obj
        import json

        device = _comm_device(self.state)
        data = json.dumps(obj if self.owns(layer) else None).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        dist.broadcast(size, src=self.owner(layer))
        buf = torch.zeros(int(size), dtype=torch.uint8, device=device)
        if self.owns(layer):
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=self.owner(layer))
        return json.loads(bytes(buf.cpu().tolist()).decode())

    def share_rows(self, layer: int, *tensors: torch.Tensor) -> None:
        """Overwrite `tensors` with the owner of `layer`'s values (exact: broadcast as they are)."""
        if not self.active:
            return
        device = _comm_device(self.state)
        for t in tensors:
            buf = t.to(device).contiguous()
            dist.broadcast(buf, src=self.owner(layer))
            t.copy_(buf.to(t.device))

    def done(self) -> None:
        """Wait until every rank has finished the sharded work (then the main process goes on alone)."""
        if self.active:
            dist.barrier()


def gather_trace(local, plan, state: Any, shard: Shard):
    """The calibration trace of the whole first batch, each layer on its owner (`Shard`).

    Rank r replayed trajectories r, r + W, ... and traced those among the first `plan.trajectories`
    (global index i lives on rank i mod W at row i // W). Per layer every rank contributes its
    rows (padded to the same count) to one all-gather, and the owner puts them back in global
    order: the trace a single process would have recorded. Angles go to every rank.
    """
    from calibrate.trace import Trace

    if not shard.active:
        return local
    W, n = shard.world, plan.trajectories
    per = -(-n // W)
    device = _comm_device(state)
    frames = torch.tensor([local.num_frames if local is not None and local.q else plan.frames], device=device)
    dist.all_reduce(frames, op=dist.ReduceOp.MIN)
    coords = torch.tensor([local.rotary_coords if local is not None else 0], device=device)
    dist.all_reduce(coords, op=dist.ReduceOp.MAX)
    out = Trace(plan, local.device if local is not None else "cpu")
    out.num_frames, out.rotary_coords = int(frames), int(coords)
    H, S, D, F = plan.num_heads, plan.num_slots, plan.head_dim, plan.frames

    def gathered(x, shape, dtype, keep: bool):
        buf = torch.zeros((per, *shape), dtype=dtype, device=device)
        if x is not None:
            buf[: x.shape[0]] = x.to(device)
        parts = [torch.empty_like(buf) for _ in range(W)]
        dist.all_gather(parts, buf)
        return torch.stack([parts[i % W][i // W] for i in range(n)]).to(out.device) if keep else None

    have = local is not None and bool(local.q)
    A = D // 2
    out.angles = gathered(local.angles if have else None, (F, S, A), torch.float32, True)
    for layer in range(plan.num_layers):
        keep = shard.owns(layer)
        for store, name in ((out.q, "q"), (out.k_pre, "k_pre"), (out.v, "v")):
            x = getattr(local, name)[layer] if have else None
            store.append(gathered(x, (H, F, S, D), plan.dtype, keep))
    return out

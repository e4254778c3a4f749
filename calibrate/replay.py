"""Drive a world model over trajectories through a cache, and record what the cache sees.

`RecordingCache` is the full-precision cache plus an observer (`KVCache.observe`): for every
attended frame it feeds each layer's K and V (post-rotary) to the streaming `KVStats`, offers
Q/K/V tokens to bounded reservoirs, adds the attention mass per cached frame (for sink/anchor
detection, from the very logits `attend` used, a block of query rows at a time) and,
optionally, keeps a bounded *trace* (trace.py: a token sample of the first frames of the first
trajectories, per layer) that the fitters replay teacher-forced. It does not touch `attend`, so
recording never changes a rollout (a test checks bitwise equality).

Non-finite K/V stop the replay with the layer, head and frame where they appeared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
from torch import Tensor
from tqdm import tqdm

from calibrate.adapters.base import WorldAdapter
from calibrate.cache import Attended, KVCache
from calibrate.sample import QuerySample
from calibrate.stats import KVStats, KVStatsConfig, frame_mass, load_stats
from calibrate.trace import Trace, TracePlan
from calibrate.types import ModelInfo, Trajectory


class NonFiniteError(ValueError):
    """K or V with NaN/Inf during replay (a broken model or weights file)."""


@dataclass
class Recorder:
    """What a recording cache writes into (shared across trajectories and batches)."""

    stats: KVStats
    q: QuerySample
    k: QuerySample
    v: QuerySample
    trace: TracePlan | None = None  # what traced batches keep (None: nothing)
    traces: list[Trace] = field(default_factory=list)

    @staticmethod
    def create(info: ModelInfo, sample_tokens: int = 4096, trace: TracePlan | None = None, seed: int = 0,
               device: torch.device | str = "cpu") -> "Recorder":
        """Statistics and reservoirs on `device` (the model's: a GPU replay then never waits on
        the host for its float64 sums; `on_cpu` brings them back for the fit)."""
        cfg = KVStatsConfig(num_layers=info.num_layers, num_heads=info.num_kv_heads, head_dim=info.head_dim)
        sample = lambda s: QuerySample(num_layers=info.num_layers, num_heads=info.num_kv_heads,
                                       head_dim=info.head_dim, capacity=sample_tokens, seed=seed * 3 + s, device=device)
        return Recorder(KVStats(cfg, device), sample(0), sample(1), sample(2), trace)

    def on_cpu(self) -> "Recorder":
        """The statistics and reservoirs moved to the host (the trace stays where it is)."""
        if self.stats.device.type == "cpu":
            return self
        cpu = lambda s: QuerySample.from_tensors(s.settings(), {k: t.cpu() for k, t in s.to_tensors().items()}, "cpu")
        stats = KVStats.from_tensors(self.stats.config, {k: t.cpu() for k, t in self.stats.tensors.items()}, "cpu")
        return Recorder(stats, cpu(self.q), cpu(self.k), cpu(self.v), self.trace, self.traces)

    def save(self, path, model: dict, extra: dict[str, str] | None = None) -> None:
        self.stats.save(path, model=model, samples={"q": self.q, "k": self.k, "v": self.v}, extra=extra)

    @staticmethod
    def load(path, trace: TracePlan | None = None) -> tuple["Recorder", dict[str, str]]:
        loaded = load_stats(path)
        missing = {"q", "k", "v"} - set(loaded.samples)
        if missing:
            raise ValueError(f"{path}: token samples {sorted(missing)} are missing")
        s = loaded.samples
        return Recorder(loaded.stats, s["q"], s["k"], s["v"], trace), loaded.extra


class RecordingCache(KVCache):
    """The full-precision cache, observed: every attended frame feeds the recorder (and the trace)."""

    def __init__(self, num_layers: int, window: int, sink_frames: int, recorder: Recorder, trace: Trace | None = None,
                 trace_row: int = 0):
        super().__init__(num_layers, window, sink_frames)
        self.recorder = recorder
        self.trace, self.trace_row = trace, trace_row  # the trace's row of this batch's first trajectory
        self._previous: list[tuple[Tensor, Tensor, Tensor] | None] = [None] * num_layers  # (k, k_pre, v) of the last frame

    def observe(self, seen: Attended) -> None:
        layer, index, rec = seen.layer, seen.index, self.recorder
        _check_finite(layer, index, seen.k_BHTD, "K")
        _check_finite(layer, index, seen.v_BHTD, "V")
        rec.stats.update(layer, seen.k_rot_BHTD, seen.v_BHTD, index)
        rec.stats.update_keys_before_rotation(layer, seen.k_BHTD)
        current = (seen.k_rot_BHTD, seen.k_BHTD, seen.v_BHTD)
        if index < self.sink_frames:
            for kind, x in zip(("k", "kpre", "v"), current):
                rec.stats.update_sink(kind, layer, x)
        if self._previous[layer] is not None:
            for kind, x, prev in zip(("k", "kpre", "v"), current, self._previous[layer]):
                rec.stats.update_change(kind, layer, x, prev)
        self._previous[layer] = current
        rec.stats.update_attention(layer, attention_mass(seen), seen.frames, index)
        rec.q.update(layer, seen.q_BHTD)
        rec.k.update(layer, seen.k_rot_BHTD)
        rec.v.update(layer, seen.v_BHTD)
        if self.trace is not None:
            self.trace.put(layer, index, seen.q_BHTD, seen.k_BHTD, seen.v_BHTD, seen.key_rope, self.trace_row)


def attention_mass(seen: Attended) -> Tensor:
    """Attention mass per cached frame [B, H, F] (`stats.frame_mass`), from the logits a block of
    query rows at a time: the mean over the frame's queries of each block, weighted by its rows."""
    T = seen.q_BHTD.shape[2]
    total = None
    for rows, logits in seen.logit_blocks():
        part = frame_mass(logits.softmax(-1), T)  # mean over the block's rows
        if rows.stop - rows.start != T:
            part.mul_((rows.stop - rows.start) / T)
        total = part if total is None else total + part
    return total


def _check_finite(layer: int, frame: int, x_BHTD: Tensor, what: str) -> None:
    bad = ~torch.isfinite(x_BHTD)
    if bad.any():
        b, h, t, d = (int(i) for i in bad.nonzero()[0])
        raise NonFiniteError(f"non-finite {what} during replay at layer {layer}, head {h}, frame {frame} (trajectory {b} of the batch)")


def batches(trajs: list[Trajectory], batch_size: int) -> list[list[Trajectory]]:
    """Group trajectories of equal length into batches, order kept within a length."""
    by_len: dict[int, list[Trajectory]] = {}
    for t in trajs:
        by_len.setdefault(t.num_frames, []).append(t)
    return [group[i : i + batch_size] for group in by_len.values() for i in range(0, len(group), batch_size)]


def rollout_batch(world: WorldAdapter, trajs: list[Trajectory], cache: KVCache, device: torch.device,
                  truth: Tensor | None = None, desc: str | None = None,
                  keep_frames: bool = True, on_frames=None) -> tuple[Tensor, Tensor | None]:
    """Free rollout of a batch through `cache`: (generated frames, true frames or None), [B, N, C, H, W].

    With `keep_frames=False` only the last generated frame is returned and no ground truth is
    made, so memory does not grow with the rollout length (statistics replay). `on_frames()` runs
    each time the model has finished more frames (e.g. to measure the cache's bytes).
    """
    if truth is None and keep_frames:
        truth = world.ground_truth(trajs, device)
    bar = tqdm(total=trajs[0].num_frames, desc=desc, leave=False, disable=desc is None)

    def progress(n: int) -> None:
        bar.update(n)
        if on_frames is not None:
            on_frames()

    frames = world.rollout(trajs, cache, device, truth=truth, keep_frames=keep_frames, progress=progress)
    bar.close()
    return frames, truth


def record(world: WorldAdapter, trajs: list[Trajectory], recorder: Recorder, window: int, sink_frames: int,
           device: torch.device, batch_size: int = 8, on_batch=None, skip_batches: int = 0) -> Recorder:
    """Replay `trajs` with the fp model, recording into `recorder`; returns it. With a trace plan
    (`recorder.trace`), the first trajectories, whichever batches they replay in, fill one trace.

    `skip_batches` batches are taken as already recorded (a resumed run); `on_batch(i, group)`
    runs after each batch (checkpointing). The reservoirs are reseeded at every batch start, so
    a run resumed from a checkpoint draws exactly what an uninterrupted one would.
    """
    layers = world.info.num_layers
    groups = batches(trajs, batch_size)
    trace = None if recorder.trace is None else Trace(recorder.trace, device)
    if trace is not None and skip_batches:
        raise ValueError("a resumed replay cannot trace: its first trajectories were replayed before")
    rows = [0, *accumulate(len(g) for g in groups)]  # each batch's first trajectory: its row in the trace
    for i, group in enumerate(tqdm(groups, desc="replay", unit="batch", initial=skip_batches, total=len(groups))):
        if i < skip_batches:
            continue
        for sample in (recorder.q, recorder.k, recorder.v):
            sample.reseed()
        cache = RecordingCache(layers, window, sink_frames, recorder, trace, rows[i])
        rollout_batch(world, group, cache, device, desc=f"replay {group[0].family}..", keep_frames=False)
        if on_batch is not None:
            on_batch(i, group)
    if trace is not None and trace.q:
        recorder.traces.append(trace)
    return recorder

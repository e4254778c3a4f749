"""Typed configuration of memory: byte counts (`parse_bytes`, `byte_count`), the memory-plan search (`memory.*`)
and `task=capacity` (`capacity.*`); and `positive`, the field check every config group shares.
Part of `config.py`'s schema, which imports these.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field


_BYTE_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2, "gb": 1000**3, "gib": 1024**3,
               "tb": 1000**4, "tib": 1024**4}


def parse_bytes(text, key: str) -> int:
    """A byte count with an optional unit (`835584`, `816KiB`, `0.8MB`, `8GiB`) as bytes > 0; a
    ValueError naming `key` otherwise."""
    t = str(text).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", t)
    if m is None or m.group(2) not in _BYTE_UNITS:
        raise ValueError(f"config: {key}={text!r} is not a byte count (e.g. 835584, 816KiB, 0.8MB, 8GiB)")
    value = int(float(m.group(1)) * _BYTE_UNITS[m.group(2)])
    if value <= 0:
        raise ValueError(f"config: {key}={text!r} must be > 0 bytes")
    return value


def byte_count(text: str) -> int | None:
    """`memory.device_budget` without the model: its bytes, or None for `fp16`; ValueError if malformed."""
    if str(text).strip().lower() == "fp16":
        return None
    return parse_bytes(text, "memory.device_budget")


def positive(name: str, value, allow_zero: bool = False) -> None:
    """A ValueError naming config key `name` unless `value` > 0 (>= 0 with `allow_zero`)."""
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"config: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass
class MemoryConfig:
    """The memory plan search (fit/plan_search.py): `device_budget` set = choose a plan under it."""

    device_budget: str | None = None  # bytes per trajectory (835584, 816KiB, 0.8MB) or fp16 (= the fp16 cache of model.cache.window + sinks); null = no plan
    schemes: list[str] = field(default_factory=lambda: ["fitted", "fp16"])  # fitted = this run's recipe; or presets
    windows: list[int] = field(default_factory=lambda: [4, 8, 16, 64])  # device window candidates (frames)
    recall_slots: list[int] = field(default_factory=lambda: [0, 8, 32])  # recall-slot candidates (0 = no recall)
    host_frames: int = 1024  # host-tier capacity (frames) of plans with recall
    yaw_radius: float = 1.0  # room units one radian of yaw counts as in the recall distance
    search_trajectories: int = 4  # calibration long_revisit trajectories each plan rolls out on
    search_frames: int = 384  # their length (returns come after 64-512 frames away)

    def check(self) -> None:
        if not self.schemes or not self.windows or not self.recall_slots:
            raise ValueError("config: memory.schemes, memory.windows and memory.recall_slots must be non-empty")
        if any(w < 1 for w in self.windows):
            raise ValueError(f"config: memory.windows must be >= 1 frame each, got {self.windows}")
        if any(r < 0 for r in self.recall_slots):
            raise ValueError(f"config: memory.recall_slots must be >= 0 each, got {self.recall_slots}")
        positive("memory.host_frames", self.host_frames)
        positive("memory.search_trajectories", self.search_trajectories)
        positive("memory.search_frames", self.search_frames)
        if not (math.isfinite(self.yaw_radius) and self.yaw_radius >= 0):
            raise ValueError(f"config: memory.yaw_radius must be a finite number >= 0, got {self.yaw_radius}")
        if any(r > self.host_frames for r in self.recall_slots):
            raise ValueError(f"config: memory.recall_slots {self.recall_slots} exceed memory.host_frames={self.host_frames}")
        # checked here, before any replay or fit, rather than where the plan search uses them
        from calibrate.schemes import BUILDERS
        from calibrate.world.trajectories import LONG_AWAY_FRAMES

        if self.device_budget is not None:
            byte_count(self.device_budget)
        unknown = [s for s in self.schemes if s != "fitted" and s not in BUILDERS]
        if unknown:
            raise ValueError(f"config: memory.schemes {unknown} unknown; use 'fitted' or presets: {', '.join(BUILDERS)}")
        if self.search_frames <= LONG_AWAY_FRAMES[0]:
            raise ValueError(f"config: memory.search_frames={self.search_frames} leaves no return after "
                             f">= {LONG_AWAY_FRAMES[0]} frames away; use more")


@dataclass
class CapacityConfig:
    """task=capacity (capacity.py): the frames of cache that fit beside the weights in memory.device_budget."""

    rollout_frames: int = 1200  # latent frames of the rollout (5 min of 16 fps video with Wan's VAE); the rest goes to a host tier
    reserve: str = "0"  # device bytes kept for what is not counted (text encoder, VAE, activations), e.g. 4GiB
    # an explicit shape instead of model='s (num_layers set: give every field below, chunk_frames defaults to 1)
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    tokens_per_latent_frame: int | None = None
    chunk_frames: int | None = None  # latent frames per cache frame
    num_params: int | None = None  # weights counted at 2 bytes (bf16) each

    SHAPE = ("num_layers", "num_kv_heads", "head_dim", "tokens_per_latent_frame", "num_params")

    def reserve_bytes(self) -> int:
        return 0 if str(self.reserve).strip() in ("0", "") else byte_count(self.reserve)

    def check(self) -> None:
        positive("capacity.rollout_frames", self.rollout_frames)
        try:
            self.reserve_bytes()
        except ValueError:
            raise ValueError(f"config: capacity.reserve={self.reserve!r} is not a byte count (e.g. 0, 4GiB)") from None
        given = [n for n in (*self.SHAPE, "chunk_frames") if getattr(self, n) is not None]
        if self.num_layers is None and given:
            raise ValueError(f"config: capacity.{given[0]} is part of an explicit shape: also set capacity.num_layers "
                             f"and the rest of {', '.join(self.SHAPE)}")
        if self.num_layers is not None:
            missing = [n for n in self.SHAPE if getattr(self, n) is None]
            if missing:
                raise ValueError(f"config: an explicit shape (capacity.num_layers) needs capacity.{missing[0]} too")
            for n in self.SHAPE:
                positive(f"capacity.{n}", getattr(self, n))
            if self.chunk_frames is not None:
                positive("capacity.chunk_frames", self.chunk_frames)

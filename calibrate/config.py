"""Typed configuration: one dataclass per Hydra config group, each checking its own fields.

Hydra composes `conf/` (config groups mirror the independent choices: model, trajectories,
quant, fit, eval, check, train); `to_config` merges the result into these dataclasses, which
rejects unknown keys and wrong types, then `validate` runs every group's `check()` (next to the
fields it checks) and the few rules that tie groups together. Every problem raises `ValueError`
with one line that names the key, the value and what is allowed.

Fields with a fixed set of values are plain strings checked against a tuple beside them
(`TASKS`, `MODELS`, `SPLITS`, ...): OmegaConf's structured configs accept no `Literal`, and an
`Enum` would change the resolved config that runs write and recipes record.

Models own their settings (`WanSettings`, `TrainConfig`, `WanTrainConfig`); this module only names them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from calibrate.adapters.wan_diffusers import WanSettings
from calibrate.config_memory import CapacityConfig, MemoryConfig, byte_count, parse_bytes, positive
from calibrate.types import ALL_FAMILIES, FAMILIES
from calibrate.wanworld.train_config import WanTrainConfig
from calibrate.world.train_config import TrainConfig

# the top-level conf/ of a source checkout, else the copy a regular install places in the package
_SOURCE_CONF = Path(__file__).resolve().parent.parent / "conf"
CONF_DIR = _SOURCE_CONF if (_SOURCE_CONF / "config.yaml").exists() else Path(__file__).resolve().parent / "conf"

TASKS = ("calibrate", "stats", "evaluate", "compare", "check", "train_world", "capacity")
MODELS = ("tinyworld", "wan_diffusers", "wanworld")
WAN_MODELS = ("wan_diffusers", "wanworld")  # rolled out by adapters/wan_diffusers.py (model.wan)
TRAINABLE = ("tinyworld", "wanworld")  # task=train_world
DEVICES = "auto, cpu or cuda[:N]"
SPLITS = ("auto", "train", "calibration", "evaluation")
ROTATIONS = ("none", "hadamard", "learned")
CODES = ("predictive", "scalar")
BASES = ("pca", "change", "identity")
ALLOCATIONS = ("waterfill", "waterfill_variance", "uniform")


@dataclass
class CacheConfig:
    window: int = 16  # frames kept besides the sinks (the newest frame counts)
    sink_frames: int = 1  # first frames kept forever

    def check(self) -> None:
        positive("model.cache.window", self.window)
        positive("model.cache.sink_frames", self.sink_frames, allow_zero=True)


@dataclass
class ModelConfig:
    name: str = "tinyworld"  # one of MODELS
    weights: str | None = None  # tinyworld, wanworld: weights file (None = shipped); wan_diffusers: diffusers model dir or checkpoint file (None = tiny random)
    cache: CacheConfig = field(default_factory=CacheConfig)
    wan: WanSettings = field(default_factory=WanSettings)  # model=wan_diffusers or wanworld (adapters/wan_diffusers.py)

    def check(self) -> None:
        if self.name not in MODELS:
            raise ValueError(f"config: unknown model '{self.name}'; choose one of {', '.join(MODELS)}")
        self.cache.check()
        self.wan.check()


@dataclass
class TrajectoriesConfig:
    name: str = "calibration"
    split: str = "auto"  # one of SPLITS; auto: calibration seeds for stats/calibrate, evaluation seeds otherwise
    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    num_trajectories: int = 7
    num_frames: int = 256
    seed: int = 0  # offset into the split's seed range
    file: str | None = None  # load trajectories from this file instead of generating them
    batch_size: int = 8  # trajectories rolled out together

    def check(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"config: trajectories.split must be auto, train, calibration or evaluation, got '{self.split}'")
        unknown = [f for f in self.families if f not in ALL_FAMILIES]
        if unknown:
            raise ValueError(f"config: unknown trajectory family {unknown[0]!r}; families are {', '.join(ALL_FAMILIES)}")
        if not self.families:
            raise ValueError("config: trajectories.families is empty")
        positive("trajectories.num_trajectories", self.num_trajectories)
        positive("trajectories.num_frames", self.num_frames)
        positive("trajectories.batch_size", self.batch_size)
        positive("trajectories.seed", self.seed, allow_zero=True)


@dataclass
class QuantConfig:
    preset: str = "ours"  # a baseline name (fp16, naive2, kivi2, ...) or "ours" (fitted)
    budget_bits: float | None = None  # a preset must fit in this (bits/element); set by fit.budget_bits given with a preset


@dataclass
class FitConfig:
    budget_bits: float = 2.5  # average effective bits per cached element, every overhead counted
    code: str = "predictive"  # predictive (codes across frames, fit/predictive_search.py) | scalar (per-frame codes, fit/search.py)
    # code=predictive (the default):
    temporal: bool = True  # tokens may be coded against the previous frame (false: every frame intra-coded)
    pre_rotary: bool = True  # keys coded before the rotary encoding when the model gives rotary coordinates
    basis: str = "change"  # change: each head's principal axes of its covariance plus its frame-to-frame change's | pca: of its covariance | identity: the model's channels
    bit_allocation: str = "waterfill"  # waterfill: an uncoded component priced at its weight | waterfill_variance: at its variance | uniform
    intra_mults: list[float] = field(default_factory=lambda: [1.0, 1.3, 1.7])  # intra step / Gaussian-optimal step
    intra_mult_max: float = 8.0  # the intra grid grows past its top (x1.3) while a head chooses the top, up to this
    inter_mults: list[float] = field(default_factory=lambda: [0.7, 1.0, 1.4])  # inter step / Gaussian-optimal step
    inter_mult_max: float = 1.4  # the same for the inter grid; 1.4, its top: it does not grow
    bits_step: float = 0.25  # mixed precision: bits per component added to one head per upgrade
    base_bits_max: float = 1.25  # every head starts at the widest base width up to this (bits per component, 1-2)
    anchor_sd: float = 6.0  # an anchor holds a state up to this many standard deviations of its component
    anchor_peak_mult: float = 2.0  # ... and up to this multiple of the largest deviation the fit's trace shows (0: off)
    sink_bits: float = 6.0  # the sink frame's own code: average bits per component (0 = the sink is the chain's first frame)
    sink_sd: float = 8.0  # the sink code's reach in standard deviations of each component
    sink_hold: bool = True  # with a sink code: one bit per token lets its uncoded components take the sink's (format 1.4)
    sink_refresh: int = 8  # with a sink hold: its reference is refreshed every this many frames (format 1.5; 0: the sink's)
    # inter-step scales tried in calibration rollouts (fit/select.py); [1.0], the default, is no
    # selection: it cost 0.8 dB held-out on WanWorld and earned 0.06 on TinyWorld (docs/results.md, "Fitting and ablations")
    closed_loop_scales: list[float] = field(default_factory=lambda: [1.0])
    # both codes:
    lambda_temporal: float = 1.0  # weight of the frame-to-frame change of the attention-output error
    closed_loop_frames: int = 96  # horizon of the closed-loop rollouts that select among candidates
    closed_loop_trajectories: int = 3
    clip_grid: list[float] = field(default_factory=lambda: [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    rotations: list[str] = field(default_factory=lambda: list(ROTATIONS))  # a subset of ROTATIONS
    outlier_channels: int = 2  # per head, kept in float16 (0 = off)
    sparse_fraction: float = 0.01  # dense-and-sparse upgrade: share of entries kept in float16 (0 = off)
    anchors: bool = True  # detect sink/anchor frames from attention mass and keep them at high precision
    mixed_precision: bool = True
    refine_steps: bool = True  # after mixed precision, search each head's steps again at its final width
    sample_tokens: int = 4096  # K/V/Q tokens per layer and head kept for fitting
    trace_frames: int = 48  # cache frames of the traced trajectories the objective replays (calibrate/trace.py)
    trace_trajectories: int = 7  # first calibration trajectories the objective replays (7: every family)
    trace_tokens: int = 512  # token slots per frame the trace keeps at most (the same slots in every frame)
    trace_bytes: str = "8GiB"  # the trace's byte budget (fewer slots when needed; logged): 8GiB, 512MiB, ...
    comp_rank: int = 0  # low-rank residual compensator rank (0 = off; at most the model's head_dim)
    logit_correction: bool = True  # fit the key-noise logit correction (per-head strength on the objective)
    keyframes: bool = False  # let the allocator offer key frames (every N-th frame at 4 or 8 bits)
    keyframe_intervals: list[int] = field(default_factory=lambda: [4, 8, 16])  # candidate N (frames, >= 1)

    def check(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"config: fit.code must be one of {', '.join(CODES)}, got '{self.code}'")
        if self.basis not in BASES:
            raise ValueError(f"config: fit.basis must be one of {', '.join(BASES)}, got '{self.basis}'")
        if self.bit_allocation not in ALLOCATIONS:
            raise ValueError(f"config: fit.bit_allocation must be one of {', '.join(ALLOCATIONS)}, got '{self.bit_allocation}'")
        for name in ("intra_mults", "inter_mults", "closed_loop_scales"):
            values = getattr(self, name)
            if not values or any(not (math.isfinite(v) and v > 0) for v in values):
                raise ValueError(f"config: fit.{name} must be a non-empty list of positive numbers, got {values}")
        for name in ("intra_mult_max", "inter_mult_max"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"config: fit.{name} must be a positive number, got {getattr(self, name)}")
        if not 1 <= self.base_bits_max <= 2:  # nan fails too
            raise ValueError(f"config: fit.base_bits_max must lie in [1, 2] bits per component, got {self.base_bits_max}")
        if not (math.isfinite(self.bits_step) and 0 < self.bits_step <= 4):
            raise ValueError(f"config: fit.bits_step must lie in (0, 4], got {self.bits_step}")
        if not math.isfinite(self.budget_bits):
            raise ValueError(f"config: fit.budget_bits must be a finite number, got {self.budget_bits}")
        if self.code == "scalar" and self.budget_bits < 2:
            raise ValueError(f"config: fit.budget_bits={self.budget_bits} is below the 2 bits per element that 2-bit "
                             f"codes alone need")
        positive("fit.lambda_temporal", self.lambda_temporal, allow_zero=True)
        positive("fit.closed_loop_frames", self.closed_loop_frames)
        if not (math.isfinite(self.anchor_sd) and self.anchor_sd > 0):
            raise ValueError(f"config: fit.anchor_sd must be a finite number > 0, got {self.anchor_sd}")
        if not (math.isfinite(self.anchor_peak_mult) and self.anchor_peak_mult >= 0):
            raise ValueError(f"config: fit.anchor_peak_mult must be a finite number >= 0 (0: off), got {self.anchor_peak_mult}")
        if not (0 <= self.sink_bits <= 16):  # nan fails too
            raise ValueError(f"config: fit.sink_bits must lie in [0, 16] bits per component, got {self.sink_bits}")
        if not (math.isfinite(self.sink_sd) and self.sink_sd > 0):
            raise ValueError(f"config: fit.sink_sd must be a finite number > 0, got {self.sink_sd}")
        if self.sink_refresh < 0:
            raise ValueError(f"config: fit.sink_refresh must be >= 0 frames (0: no refresh), got {self.sink_refresh}")
        positive("fit.sample_tokens", self.sample_tokens)
        positive("fit.trace_frames", self.trace_frames)
        positive("fit.trace_trajectories", self.trace_trajectories)
        positive("fit.trace_tokens", self.trace_tokens)
        parse_bytes(self.trace_bytes, "fit.trace_bytes")
        positive("fit.outlier_channels", self.outlier_channels, allow_zero=True)
        positive("fit.comp_rank", self.comp_rank, allow_zero=True)
        if any(n < 1 for n in self.keyframe_intervals):
            raise ValueError(f"config: fit.keyframe_intervals must be >= 1 frame each (a key frame every N frames), "
                             f"got {self.keyframe_intervals}")
        if self.keyframes and not self.keyframe_intervals:
            raise ValueError("config: fit.keyframes=true needs a non-empty fit.keyframe_intervals")
        if not 0 <= self.sparse_fraction < 0.5:
            raise ValueError(f"config: fit.sparse_fraction must lie in [0, 0.5), got {self.sparse_fraction}")
        if not self.clip_grid or any(not 0 < c <= 1 for c in self.clip_grid):
            raise ValueError(f"config: fit.clip_grid values must lie in (0, 1], got {self.clip_grid}")
        bad = [r for r in self.rotations if r not in ROTATIONS]
        if bad or not self.rotations:
            raise ValueError(f"config: fit.rotations must be a non-empty subset of none, hadamard, learned, "
                             f"got {self.rotations}")


@dataclass
class EvalConfig:
    save_frames: bool = False  # also write frames.safetensors (reference, quantized, ground truth)
    psnr_threshold_db: float = 30.0  # drift: first frame whose psnr_ref falls below this
    strips: bool = True  # GIF strips of each scheme's worst trajectory and the players of report.html
    attention: bool = True  # per-layer attention KL / top-frame agreement (costs a second pass)
    noise_twin: bool = True  # roll out each scheme's noise twin too (evaluate/twin.py: one fp rollout more per scheme)


@dataclass
class CheckConfig:
    tolerance_db: float = 1.0  # allowed psnr drop vs the recipe's recorded metrics
    flicker_tolerance: float = 0.25  # allowed relative flicker increase
    min_psnr_db: float | None = None  # absolute floors override the recorded metrics
    max_flicker: float | None = None
    # the check set (conf/trajectories/check.yaml: 4 trajectories of 128 frames) that task=calibrate
    # measures and records and task=check replays; null = the recipe's recorded set, else check.yaml's
    num_trajectories: int | None = None
    num_frames: int | None = None  # a multiple of model.wan.chunk_frames for Wan

    def check(self) -> None:
        for name in ("num_trajectories", "num_frames"):
            if getattr(self, name) is not None:
                positive(f"check.{name}", getattr(self, name))


def check_set(cfg: "Config", recorded: dict | None = None) -> "TrajectoriesConfig":
    """The CI gate's trajectory set: conf/trajectories/check.yaml (evaluation seeds), its count and
    length taken from `check.num_trajectories` / `check.num_frames` when set, else from `recorded`
    (the set a recipe recorded its check metrics on), else the file's, cut to whole steps of the
    model (Wan in chunks of 3 latent frames: 126 of its 128 frames). A length given explicitly is
    taken as it is (`check_chunking` refuses one that is not whole chunks)."""
    loaded = OmegaConf.merge(OmegaConf.structured(TrajectoriesConfig), OmegaConf.load(CONF_DIR / "trajectories" / "check.yaml"))
    out: TrajectoriesConfig = OmegaConf.to_object(loaded)
    out.num_frames -= out.num_frames % frames_per_step(cfg)
    for name in ("num_trajectories", "num_frames"):
        value = getattr(cfg.check, name)
        if value is None and recorded:
            value = recorded.get(name)
        if value is not None:
            setattr(out, name, int(value))
    return out


@dataclass
class Config:
    task: str = "calibrate"  # one of TASKS
    device: str = "auto"  # auto (cuda if present, else cpu), cpu, cuda, cuda:N
    seed: int = 0
    recipe: str | None = None
    schemes: list[str] = field(default_factory=lambda: ["fp16", "naive2", "kivi2", "kivi4", "quarot2", "kvquant2", "qvg2",
                                                        "qvg2_lowmem"])
    model: ModelConfig = field(default_factory=ModelConfig)
    trajectories: TrajectoriesConfig = field(default_factory=TrajectoriesConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    train_wan: WanTrainConfig = field(default_factory=WanTrainConfig)  # task=train_world model=wanworld
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)


def to_config(cfg: DictConfig | dict) -> Config:
    """Merge a composed Hydra config into the typed schema and validate it."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
        plain = {k: v for k, v in plain.items() if k != "hydra"}
        merged = OmegaConf.merge(OmegaConf.structured(Config), plain)
        out: Any = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        first = str(e).splitlines()[0]
        key = getattr(e, "full_key", None)
        raise ValueError(f"config: {first}" + (f" (key: {key})" if key and key not in first else "")) from None
    validate(out)
    return out


def validate(cfg: Config) -> None:
    """Every group's own `check()`, then the rules that tie groups together."""
    if cfg.task not in TASKS:
        raise ValueError(f"config: unknown task '{cfg.task}'; choose one of {', '.join(TASKS)}")
    if cfg.device != "auto" and cfg.device != "cpu" and not cfg.device.startswith("cuda"):
        raise ValueError(f"config: device must be {DEVICES}, got '{cfg.device}'")
    cfg.model.check()
    cfg.trajectories.check()
    cfg.check.check()
    if cfg.task != "capacity":
        check_chunking(cfg)
    cfg.fit.check()
    cfg.train.check()
    cfg.train_wan.check()
    cfg.memory.check()
    cfg.capacity.check()
    if cfg.task == "capacity":
        if cfg.memory.device_budget is None or byte_count(cfg.memory.device_budget) is None:
            raise ValueError(f"config: task=capacity needs the device's memory as memory.device_budget=BYTES (e.g. 24GiB), "
                             f"got {cfg.memory.device_budget}")
    if cfg.task == "train_world" and cfg.model.name not in TRAINABLE:
        raise ValueError(f"config: task=train_world trains model=tinyworld or model=wanworld, not model={cfg.model.name}")
    if cfg.task in ("evaluate", "check") and not cfg.recipe:
        raise ValueError(f"config: task={cfg.task} needs recipe=PATH")
    if cfg.task == "compare" and not cfg.schemes:
        raise ValueError("config: task=compare needs a non-empty schemes=[...]")


def frames_per_step(cfg: Config) -> int:
    """Frames the model generates per step (one cache frame): Wan's chunk of latent frames, else 1.
    A trajectory's length must be a multiple of it."""
    return cfg.model.wan.chunk_frames if cfg.model.name in WAN_MODELS else 1


def closed_loop_runs(fit: FitConfig) -> bool:
    """Whether calibration can roll out closed-loop candidates: the predictive code with a scale
    besides 1 in `fit.closed_loop_scales`, or the scalar code (whose mixed precision competes with
    its base recipe)."""
    return fit.code != "predictive" or any(s != 1.0 for s in fit.closed_loop_scales)


def check_chunking(cfg: Config) -> None:
    """Every frame count the task will roll out is whole chunks of `model.wan.chunk_frames`: found
    here, in the first seconds, not after a replay and a fit (with Self-Forcing's chunks of 3, a
    check set of 128 frames used to fail when the recipe was about to be written)."""
    chunk = frames_per_step(cfg)
    counts = {}
    # task=check's default set is the check set (cut to whole chunks: check_set)
    if not cfg.trajectories.file and not (cfg.task == "check" and cfg.trajectories.name == "calibration"):
        counts["trajectories.num_frames"] = cfg.trajectories.num_frames
    if cfg.task == "calibrate":
        if cfg.quant.preset == "ours" and closed_loop_runs(cfg.fit):
            counts["fit.closed_loop_frames"] = cfg.fit.closed_loop_frames
        if cfg.memory.device_budget is not None:
            counts["memory.search_frames"] = cfg.memory.search_frames
    if cfg.task in ("calibrate", "check") and cfg.check.num_frames is not None:
        counts["check.num_frames"] = cfg.check.num_frames
    for key, n in counts.items():
        if n % chunk:
            raise ValueError(f"config: model.wan.chunk_frames={chunk} does not divide {key}={n}; set {key} to a "
                             f"multiple of {chunk} (e.g. {key}={max(n - n % chunk, chunk)})")


def resolve_split(cfg: Config) -> str:
    if cfg.trajectories.split != "auto":
        return cfg.trajectories.split
    return "calibration" if cfg.task in ("stats", "calibrate") else "evaluation"

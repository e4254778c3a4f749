"""Typed configuration: one dataclass per Hydra config group, validated with actionable errors.

Hydra composes `conf/` (config groups mirror the independent choices: model, trajectories,
quant, fit, eval, check, train); `to_config` merges the result into these dataclasses, which
rejects unknown keys and wrong types, then `validate` checks values. Every problem raises
`ValueError` with one line that names the key, the value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from calibrate.world.train import TrainConfig
from calibrate.world.trajectories import FAMILIES

TASKS = ("calibrate", "stats", "evaluate", "compare", "check", "train_world")
MODELS = ("tinyworld", "wan_diffusers")


@dataclass
class CacheConfig:
    window: int = 16  # frames kept besides the sinks (the newest frame counts)
    sink_frames: int = 1  # first frames kept forever


@dataclass
class WanConfig:
    """model=wan_diffusers: diffusers' WanTransformer3DModel rolled out chunk by chunk (adapters/wan_diffusers.py)."""

    chunk_frames: int = 1  # latent frames per generated chunk = one cache frame (Self-Forcing: 3)
    latent_height: int = 16  # latent grid (480x832 video with Wan's VAE: 60 x 104)
    latent_width: int = 16
    denoise_timesteps: list[int] = field(default_factory=lambda: [1000, 750, 500, 250])  # few-step sampler
    shift: float = 5.0  # flow-matching timestep shift (sigma' = shift*s / (1 + (shift-1)*s))
    text_embedding: str | None = None  # .safetensors with `text_embedding` [L, text_dim]; None = seeded random
    dtype: str = "float32"  # float32 | bfloat16


@dataclass
class ModelConfig:
    name: str = "tinyworld"  # tinyworld | wan_diffusers
    weights: str | None = None  # tinyworld: weights file (None = shipped); wan_diffusers: diffusers model dir (None = tiny random)
    cache: CacheConfig = field(default_factory=CacheConfig)
    wan: WanConfig = field(default_factory=WanConfig)


@dataclass
class TrajectoriesConfig:
    name: str = "calibration"
    split: str = "auto"  # auto: calibration seeds for stats/calibrate, evaluation seeds for evaluate/compare/check
    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    num_trajectories: int = 7
    num_frames: int = 256
    seed: int = 0  # offset into the split's seed range
    file: str | None = None  # load trajectories from this file instead of generating them
    batch_size: int = 8  # trajectories rolled out together


@dataclass
class QuantConfig:
    preset: str = "ours"  # a baseline name (fp16, naive2, kivi2, ...) or "ours" (fitted)


@dataclass
class FitConfig:
    budget_bits: float = 2.5  # average effective bits per cached element, every overhead counted
    lambda_temporal: float = 1.0  # weight of the frame-to-frame change of the attention-output error
    closed_loop_frames: int = 96  # horizon of the closed-loop rollouts that select among candidates
    closed_loop_trajectories: int = 3
    clip_grid: list[float] = field(default_factory=lambda: [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    rotations: list[str] = field(default_factory=lambda: ["none", "hadamard", "learned"])
    outlier_channels: int = 2  # per head, kept in float16 (0 = off)
    sparse_fraction: float = 0.01  # dense-and-sparse upgrade: share of entries kept in float16 (0 = off)
    anchors: bool = True  # detect sink/anchor frames from attention mass and keep them at high precision
    mixed_precision: bool = True
    sample_tokens: int = 4096  # K/V/Q tokens per layer and head kept for fitting
    trace_frames: int = 48  # whole frames of the first calibration batch replayed by the objective
    trace_trajectories: int = 4  # trajectories of that batch the objective replays
    comp_rank: int = 0  # low-rank residual compensator rank (0 = off; at most the model's head_dim)
    logit_correction: bool = True  # fit the key-noise logit correction (per-head strength on the objective)
    keyframes: bool = False  # let the allocator offer key frames (every N-th frame at 4 or 8 bits)
    keyframe_intervals: list[int] = field(default_factory=lambda: [4, 8, 16])  # candidate N (frames, >= 1)


@dataclass
class EvalConfig:
    save_frames: bool = False  # also write frames.safetensors (reference, quantized, ground truth)
    psnr_threshold_db: float = 30.0  # drift: first frame whose psnr_ref falls below this
    strips: bool = True  # GIF strips of each scheme's worst trajectory and the players of report.html
    attention: bool = True  # per-layer attention KL / top-frame agreement (costs a second pass)


@dataclass
class CheckConfig:
    tolerance_db: float = 1.0  # allowed psnr drop vs the recipe's recorded metrics
    flicker_tolerance: float = 0.25  # allowed relative flicker increase
    min_psnr_db: float | None = None  # absolute floors override the recorded metrics
    max_flicker: float | None = None


@dataclass
class Config:
    task: str = "calibrate"
    device: str = "auto"  # auto (cuda if present, else cpu), cpu, cuda, cuda:N
    seed: int = 0
    recipe: str | None = None
    schemes: list[str] = field(default_factory=lambda: ["fp16", "naive2", "kivi2", "kivi4", "quarot2", "kvquant2", "qvg2"])
    model: ModelConfig = field(default_factory=ModelConfig)
    trajectories: TrajectoriesConfig = field(default_factory=TrajectoriesConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    fit: FitConfig = field(default_factory=FitConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


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


def _positive(name: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"config: {name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")


def validate(cfg: Config) -> None:
    if cfg.task not in TASKS:
        raise ValueError(f"config: unknown task '{cfg.task}'; choose one of {', '.join(TASKS)}")
    if cfg.device != "auto" and cfg.device != "cpu" and not cfg.device.startswith("cuda"):
        raise ValueError(f"config: device must be auto, cpu or cuda[:N], got '{cfg.device}'")
    if cfg.model.name not in MODELS:
        raise ValueError(f"config: unknown model '{cfg.model.name}'; choose one of {', '.join(MODELS)}")
    _positive("model.cache.window", cfg.model.cache.window)
    w = cfg.model.wan
    _positive("model.wan.chunk_frames", w.chunk_frames)
    _positive("model.wan.latent_height", w.latent_height)
    _positive("model.wan.latent_width", w.latent_width)
    if not w.denoise_timesteps or any(not 0 < t <= 1000 for t in w.denoise_timesteps):
        raise ValueError(f"config: model.wan.denoise_timesteps must be a non-empty list in (0, 1000], got {w.denoise_timesteps}")
    _positive("model.wan.shift", w.shift)
    if w.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"config: model.wan.dtype must be float32 or bfloat16, got '{w.dtype}'")
    if cfg.model.name == "wan_diffusers" and cfg.trajectories.num_frames % w.chunk_frames and not cfg.trajectories.file:
        raise ValueError(f"config: model.wan.chunk_frames={w.chunk_frames} does not divide trajectories.num_frames={cfg.trajectories.num_frames}")
    _positive("model.cache.sink_frames", cfg.model.cache.sink_frames, allow_zero=True)
    t = cfg.trajectories
    if t.split not in ("auto", "train", "calibration", "evaluation"):
        raise ValueError(f"config: trajectories.split must be auto, train, calibration or evaluation, got '{t.split}'")
    unknown = [f for f in t.families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"config: unknown trajectory family {unknown[0]!r}; families are {', '.join(FAMILIES)}")
    if not t.families:
        raise ValueError("config: trajectories.families is empty")
    _positive("trajectories.num_trajectories", t.num_trajectories)
    _positive("trajectories.num_frames", t.num_frames)
    _positive("trajectories.batch_size", t.batch_size)
    _positive("trajectories.seed", t.seed, allow_zero=True)
    f = cfg.fit
    if f.budget_bits < 2:
        raise ValueError(f"config: fit.budget_bits={f.budget_bits} is below the 2 bits per element that 2-bit codes alone need")
    _positive("fit.lambda_temporal", f.lambda_temporal, allow_zero=True)
    _positive("fit.closed_loop_frames", f.closed_loop_frames)
    _positive("fit.sample_tokens", f.sample_tokens)
    _positive("fit.trace_frames", f.trace_frames)
    _positive("fit.trace_trajectories", f.trace_trajectories)
    _positive("fit.outlier_channels", f.outlier_channels, allow_zero=True)
    _positive("fit.comp_rank", f.comp_rank, allow_zero=True)
    if any(n < 1 for n in f.keyframe_intervals):
        raise ValueError(f"config: fit.keyframe_intervals must be >= 1 frame each (a key frame every N frames), "
                         f"got {f.keyframe_intervals}")
    if f.keyframes and not f.keyframe_intervals:
        raise ValueError("config: fit.keyframes=true needs a non-empty fit.keyframe_intervals")
    if not 0 <= f.sparse_fraction < 0.5:
        raise ValueError(f"config: fit.sparse_fraction must lie in [0, 0.5), got {f.sparse_fraction}")
    if not f.clip_grid or any(not 0 < c <= 1 for c in f.clip_grid):
        raise ValueError(f"config: fit.clip_grid values must lie in (0, 1], got {f.clip_grid}")
    bad = [r for r in f.rotations if r not in ("none", "hadamard", "learned")]
    if bad or not f.rotations:
        raise ValueError(f"config: fit.rotations must be a non-empty subset of none, hadamard, learned, got {f.rotations}")
    _positive("train.steps", cfg.train.steps)
    _positive("train.batch_size", cfg.train.batch_size)
    _positive("train.new_per_step", cfg.train.new_per_step)
    _positive("train.checkpoint_every", cfg.train.checkpoint_every)
    bad = [f for f in cfg.train.motion_families if f not in FAMILIES]
    if bad or not cfg.train.motion_families:
        raise ValueError(f"config: train.motion_families must be a non-empty list of families ({', '.join(FAMILIES)}), "
                         f"got {cfg.train.motion_families}")
    if cfg.train.clip_frames < 2:
        raise ValueError(f"config: train.clip_frames must be >= 2, got {cfg.train.clip_frames}")
    if cfg.train.loss not in ("mse", "log_mse"):
        raise ValueError(f"config: train.loss must be mse or log_mse, got '{cfg.train.loss}'")
    _positive("train.log_mse_eps", cfg.train.log_mse_eps)
    if cfg.task == "train_world" and cfg.model.name != "tinyworld":
        raise ValueError(f"config: task=train_world trains TinyWorld only, not model={cfg.model.name}")
    if cfg.task in ("evaluate", "check") and not cfg.recipe:
        raise ValueError(f"config: task={cfg.task} needs recipe=PATH")
    if cfg.task == "compare" and not cfg.schemes:
        raise ValueError("config: task=compare needs a non-empty schemes=[...]")


def resolve_split(cfg: Config) -> str:
    if cfg.trajectories.split != "auto":
        return cfg.trajectories.split
    return "calibration" if cfg.task in ("stats", "calibrate") else "evaluation"

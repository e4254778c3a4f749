"""The training schedule of WanWorld (`task=train_world model=wanworld`, the `train_wan` group).

Plain settings with their own checks, apart from the training loop (wanworld/train.py), so the
config schema can name them without importing the trainer (or diffusers).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from calibrate.types import FAMILIES

MOTION_FAMILIES = ("orbit", "dolly", "pan", "random_walk", "stress", "static")


@dataclass
class WanTrainConfig:
    """Training schedule of WanWorld (`task=train_world model=wanworld`)."""

    steps: int = 1400  # optimizer steps in total (a resumed run continues up to this)
    batch_size: int = 6  # clips per step
    clip_frames: int = 12  # frames per clip: a given first (sink) frame + clip_frames - 1 predicted
    lr: float = 5e-4
    weight_decay: float = 0.01
    warmup_steps: int = 30  # linear lr warmup, then cosine to 10% at `steps`
    revisit_share: float = 0.4  # share of clips from the `revisit` family
    motion_families: list[str] = field(default_factory=lambda: list(MOTION_FAMILIES))  # the other clips, drawn
    # uniformly from this list (name a family twice to double its share)
    offset_share: float = 0.3  # share of clips whose frames after the first start later in the trajectory:
    max_offset: int = 1024  # the first (sink) frame stays frame 0, the rest start at frame 1 + U[1, max_offset]
    window: int = 16  # cache window the model trains under (frames)
    sink_frames: int = 1
    self_forcing_start: int = 300  # first step that may replace a clip's frames by the model's own rollout
    self_forcing_max: float = 0.5  # share of self-forced steps once ramped up (0 = teacher forcing only)
    self_forcing_ramp: int = 300  # steps from start to max
    checkpoint_every: int = 25
    seed: int = 0  # offset into the training seed range
    num_threads: int = 0  # torch threads (0 = torch default)
    model: dict = field(default_factory=dict)  # overrides of the WanTransformer3DModel arguments (wanworld/model.py)
    camera: dict = field(default_factory=dict)  # overrides of CameraConfig (wanworld/camera.py)
    latents: str = "whitened"  # the transformer's latents: whitened | normalized (wanworld/latents.py)
    denoise_timesteps: list[int] = field(default_factory=lambda: [1000, 750, 500, 250])  # trained at exactly these,
    shift: float = 5.0  # shifted like the sampler's (model.wan.denoise_timesteps, model.wan.shift)
    init_weights: str | None = None  # start from this weights file (fresh optimizer and schedule); a checkpoint
    # in the run dir takes precedence

    def check(self, where: str = "train_wan") -> None:
        """One-line ValueError naming the first field out of range."""
        for name in ("steps", "batch_size", "checkpoint_every", "window", "shift"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {where}.{name} must be > 0, got {getattr(self, name)}")
        if self.clip_frames < 3:
            raise ValueError(f"config: {where}.clip_frames must be >= 3, got {self.clip_frames}")
        bad = [f for f in self.motion_families if f not in FAMILIES]
        if bad or not self.motion_families:
            raise ValueError(f"config: {where}.motion_families must be a non-empty list of families "
                             f"({', '.join(FAMILIES)}), got {self.motion_families}")
        for name in ("revisit_share", "offset_share", "self_forcing_max"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"config: {where}.{name} must lie in [0, 1], got {getattr(self, name)}")
        if self.latents not in ("whitened", "normalized"):
            raise ValueError(f"config: {where}.latents must be whitened or normalized, got '{self.latents}'")
        if self.max_offset < 1:
            raise ValueError(f"config: {where}.max_offset must be >= 1, got {self.max_offset}")
        if self.sink_frames < 0:
            raise ValueError(f"config: {where}.sink_frames must be >= 0, got {self.sink_frames}")
        if not self.denoise_timesteps or any(not 0 < t <= 1000 for t in self.denoise_timesteps):
            raise ValueError(f"config: {where}.denoise_timesteps must be a non-empty list in (0, 1000], "
                             f"got {self.denoise_timesteps}")

"""The training schedule of TinyWorld (`task=train_world`, the `train` group of the Hydra config).

Plain settings with their own checks, apart from the training loop (world/train.py), so that the
config schema can name them without importing the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from calibrate.types import FAMILIES

MOTION_FAMILIES = ("orbit", "dolly", "pan", "random_walk", "stress")


@dataclass
class TrainConfig:
    """Training schedule of TinyWorld (`task=train_world`)."""

    steps: int = 3500  # optimizer steps in total (a resumed run continues up to this)
    batch_size: int = 12  # clips per step
    clip_frames: int = 24  # frames per clip (clip_frames - 1 predictions)
    lr: float = 6e-4
    weight_decay: float = 0.01
    warmup_steps: int = 100  # linear lr warmup
    self_forcing_start: int = 400  # first step that may use own rollouts as inputs
    self_forcing_max: float = 0.5  # share of self-forced batches once ramped up
    self_forcing_ramp: int = 600  # steps from start to max
    revisit_share: float = 0.5  # share of clips from the `revisit` family
    motion_families: list[str] = field(default_factory=lambda: list(MOTION_FAMILIES))  # the other clips, drawn
    # uniformly from this list (name a family twice to double its share)
    window: int = 16  # cache window the model trains under (frames)
    sink_frames: int = 1
    new_per_step: int = 4  # freshly rendered clips per step (the rest are replayed)
    replay_steps: int = 100  # replayed clips come from this many previous steps
    checkpoint_every: int = 50
    seed: int = 0  # offset into the training seed range
    num_threads: int = 0  # torch threads (0 = torch default)
    model: dict = field(default_factory=dict)  # TinyWorldConfig overrides
    loss: str = "mse"  # mse: pixel MSE of the batch; log_mse: mean over frames of 10 log10(MSE + log_mse_eps),
    log_mse_eps: float = 1e-4  # i.e. minus the mean per-frame PSNR, so near-exact frames (a still camera)
    # weigh like the rest instead of vanishing next to moving ones; eps caps that weight (1e-4 = 40 dB)
    init_weights: str | None = None  # start from this weights file (a new stage: fresh optimizer and
    # schedule; tensors it lacks keep their init); a checkpoint in the run dir takes precedence

    def check(self, where: str = "train") -> None:
        """One-line ValueError naming the first field out of range."""
        for name in ("steps", "batch_size", "new_per_step", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config: {where}.{name} must be > 0, got {getattr(self, name)}")
        bad = [f for f in self.motion_families if f not in FAMILIES]
        if bad or not self.motion_families:
            raise ValueError(f"config: {where}.motion_families must be a non-empty list of families "
                             f"({', '.join(FAMILIES)}), got {self.motion_families}")
        if self.clip_frames < 2:
            raise ValueError(f"config: {where}.clip_frames must be >= 2, got {self.clip_frames}")
        if self.loss not in ("mse", "log_mse"):
            raise ValueError(f"config: {where}.loss must be mse or log_mse, got '{self.loss}'")
        if self.log_mse_eps <= 0:
            raise ValueError(f"config: {where}.log_mse_eps must be > 0, got {self.log_mse_eps}")

"""WanWorld's architecture and what it hands the `wan_diffusers` adapter.

`WanWorld` holds diffusers' `WanTransformer3DModel` (a small configuration, `ARCHITECTURE`),
the camera module (`camera.py`) and the latent whitening (`latents.py`); one module, so one
state dict, one optimizer and one fingerprint cover them. `WanWorldInputs` is the adapter's `WorldInputs`: per-chunk camera
tokens, the true latent frames from the renderer (the first chunk starts every rollout), the
latents' range and an RGB preview.

How a rollout runs (adapters/wan_diffusers.py, `WanAdapter.rollout`), one latent frame per chunk:

1. chunk 0 is the true first frame, encoded and whitened (`latents.py`) and written to the
   cache by a clean pass at timestep 0, as an image-conditioned world model is given its first frame;
2. every later chunk starts from seeded noise and runs the few-step flow-matching sampler of
   Self-Forcing (timesteps 1000, 750, 500, 250 shifted by 5: sigma 1, 0.94, 0.83, 0.63), reading
   the cache without writing; the result is mapped back to pixels and clamped to [0, 1] (the
   frame the rollout returns), and a clean pass of it, whitened again, writes its K/V.

The model is trained at exactly those sigmas (`teacher.py`, `train.py`), so the sampler needs
no schedule it has not seen.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

from calibrate.types import Trajectory
from calibrate.wanworld import latents
from calibrate.wanworld.camera import CameraConfig, CameraTokens
from calibrate.world.render import FRAME_SIZE, make_scene, render_batch

# diffusers' WanTransformer3DModel arguments: 4 layers x 2 heads x head_dim 128 (Wan 2.1's head_dim,
# so its RoPE splits each head into 44 time + 42 height + 42 width channels), 12 latent channels
# (latents.py), patch (1, 2, 2): a 16 x 16 latent frame is 64 tokens.
ARCHITECTURE = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=128,
                    in_channels=latents.CHANNELS, out_channels=latents.CHANNELS, text_dim=64, freq_dim=64,
                    ffn_dim=768, num_layers=4, rope_max_seq_len=1024)
LATENT_SIZE = FRAME_SIZE // latents.FACTOR  # 16


@dataclass(frozen=True)
class WanWorldConfig:
    """Architecture of WanWorld (stored in the weights file's metadata)."""

    transformer: dict = field(default_factory=lambda: dict(ARCHITECTURE))  # WanTransformer3DModel(**transformer)
    camera: CameraConfig = field(default_factory=CameraConfig)
    latents: str = "whitened"  # the transformer's latents: latents.KINDS

    def to_dict(self) -> dict:
        return {"transformer": dict(self.transformer), "camera": asdict(self.camera), "latents": self.latents}

    @classmethod
    def from_dict(cls, d: dict) -> "WanWorldConfig":
        return cls(transformer={**ARCHITECTURE, **d.get("transformer", {})}, camera=CameraConfig(**d.get("camera", {})),
                   latents=d.get("latents", "whitened"))


class WanWorld(nn.Module):
    """diffusers' Wan + the camera module whose tokens it reads through cross-attention + the fixed
    map between latents and the transformer's latents (fitted once before training)."""

    def __init__(self, cfg: WanWorldConfig):
        super().__init__()
        from diffusers import WanTransformer3DModel

        self.cfg = cfg
        self.transformer = WanTransformer3DModel(**cfg.transformer)
        self.camera = CameraTokens(cfg.camera, self.transformer.config.text_dim)
        self.latents = latents.LatentWhitening(cfg.latents)

    @property
    def chunk_frames(self) -> int:
        return self.cfg.camera.chunk_frames


def true_latents(trajs: list[Trajectory], num_frames: int | None = None) -> Tensor:
    """The renderer's frames of `trajs` (each in its own room), encoded: [B, N, C, 16, 16]."""
    poses = torch.stack([t.poses[:num_frames] for t in trajs])
    return latents.encode(render_batch([make_scene(t.seed) for t in trajs], poses))


class WanWorldInputs:
    """The adapter's `WorldInputs` for a WanWorld (adapters/wan_diffusers.py)."""

    bounds = latents.BOUNDS

    def __init__(self, model: WanWorld):
        self.weights = model
        self.camera = model.camera
        self.whitening = model.latents

    @torch.no_grad()
    def context(self, trajs: list[Trajectory], device: torch.device) -> Tensor:
        poses = torch.stack([t.poses for t in trajs]).to(device)
        actions = torch.stack([t.actions for t in trajs]).to(device)
        return self.camera(poses, actions)

    def ground_truth(self, trajs: list[Trajectory], device: torch.device, num_frames: int | None = None) -> Tensor:
        return true_latents(trajs, num_frames).to(device)

    def normalize(self, frames: Tensor) -> Tensor:
        return self.whitening.normalize(frames)

    def denormalize(self, x: Tensor) -> Tensor:
        return self.whitening.denormalize(x)

    def preview(self, frames: Tensor) -> Tensor:
        return latents.decode(frames.float()).clamp(0, 1)

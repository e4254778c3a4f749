"""The camera as Wan's cross-attention input: each chunk's pose and action -> `encoder_hidden_states`.

Wan reads its condition through cross-attention over `encoder_hidden_states` [B, L, text_dim]
(a UMT5 text embedding in the released models). WanWorld keeps that input and that code path,
and only changes what fills it: per chunk, a small MLP turns the chunk's camera into L tokens
of width text_dim, which Wan's own text projection and cross-attention then read. Nothing of
diffusers is forked; the module's weights ship in the weights file next to the transformer's.

Features of one frame (pose p = (x, y, yaw) in the room of world/render.py, action a = the
motion from the previous frame in its camera frame, world/trajectories.py):

- position (x, y) centred on the room and scaled to about [-1, 1], and Fourier features
  sin/cos(2^k pi x') for k < `pose_octaves` (the view changes quickly with position);
- yaw as sin/cos(k yaw) for k = 1, 2, 4, ... (periodic: a yaw and yaw + 2 pi look the same);
- the action: tanh(forward / 0.1), tanh(strafe / 0.1) (units per frame, typical 0.05-0.12),
  and the turn as 5 sin(dyaw), 5 (1 - cos(dyaw)) (bounded even for a snap of pi).

A chunk of several latent frames concatenates its frames' features.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from calibrate.world.render import CAMERA_RADIUS, CENTER


@dataclass(frozen=True)
class CameraConfig:
    """The conditioning module's shape (stored in the weights file's metadata)."""

    tokens: int = 4  # cross-attention tokens per chunk (L)
    hidden: int = 128  # MLP width
    pose_octaves: int = 4  # Fourier octaves of x and y
    yaw_octaves: int = 4  # sin/cos of 1, 2, 4, ... times the yaw
    chunk_frames: int = 1  # latent frames per chunk (their features are concatenated)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def features_per_frame(self) -> int:
        return 2 + 2 * 2 * self.pose_octaves + 2 * self.yaw_octaves + 4


def frame_features(poses_BN3: Tensor, actions_BN3: Tensor, cfg: CameraConfig) -> Tensor:
    """Camera features of every frame: [B, N, features_per_frame] (see the module docstring)."""
    xy = (poses_BN3[..., :2] - torch.tensor(CENTER, dtype=poses_BN3.dtype, device=poses_BN3.device)) / CAMERA_RADIUS
    octaves = 2.0 ** torch.arange(cfg.pose_octaves, dtype=poses_BN3.dtype, device=poses_BN3.device)
    xy_k = (xy.unsqueeze(-1) * octaves * math.pi).flatten(-2)
    yaw_k = poses_BN3[..., 2:3] * 2.0 ** torch.arange(cfg.yaw_octaves, dtype=poses_BN3.dtype, device=poses_BN3.device)
    forward, strafe, dyaw = actions_BN3.unbind(-1)
    action = torch.stack((torch.tanh(forward / 0.1), torch.tanh(strafe / 0.1), 5 * torch.sin(dyaw),
                          5 * (1 - torch.cos(dyaw))), dim=-1)
    return torch.cat((xy, xy_k.sin(), xy_k.cos(), yaw_k.sin(), yaw_k.cos(), action), dim=-1)


class CameraTokens(nn.Module):
    """Per chunk, L tokens of width `text_dim` from the chunk's camera features (a two-layer MLP)."""

    def __init__(self, cfg: CameraConfig, text_dim: int):
        super().__init__()
        self.cfg = cfg
        self.text_dim = text_dim
        self.mlp = nn.Sequential(nn.Linear(cfg.features_per_frame * cfg.chunk_frames, cfg.hidden), nn.SiLU(),
                                 nn.Linear(cfg.hidden, cfg.tokens * text_dim))

    def forward(self, poses_BN3: Tensor, actions_BN3: Tensor) -> Tensor:
        """Tokens of every chunk: [B, N / chunk_frames, L, text_dim] (N frames, whole chunks)."""
        B, N = poses_BN3.shape[:2]
        cf = self.cfg.chunk_frames
        if N % cf:
            raise ValueError(f"{N} frames are not whole chunks of {cf}")
        feats = frame_features(poses_BN3.float(), actions_BN3.float(), self.cfg).reshape(B, N // cf, -1)
        return self.mlp(feats).unflatten(-1, (self.cfg.tokens, self.text_dim))

"""TinyWorld: a small block-causal transformer that predicts the next camera view.

One step of the model turns the newest frame into the next one:

    frame_{t-1} (at pose p_{t-1})  +  action_t (camera motion p_{t-1} -> p_t)  ->  frame_t

The newest frame is cut into P x P patches (16 tokens for 32x32 frames and 8x8 patches).
Each token carries the content of frame t-1 and is asked to produce the patch of frame t at
the same place, in two parts: a *flow* (where each pixel of frame t comes from in frame t-1,
predicted every `flow_stride` pixels and interpolated) that warps frame t-1, plus a
*residual* added to the warped frame. Camera motion mostly moves pixels - a dolly zooms them
by a depth-dependent sub-pixel amount, a pan shifts them - which a warp does exactly and an
8x8-patch linear readout can hardly do; what no warp of frame t-1 can give (views that left
the frame and come back) is the residual's job, and comes from the cache. Every layer hands
its queries, keys and values to the `KVCache`
(`calibrate.cache`), which stores the frame's K/V and returns attention over all kept
frames. K/V are written once per frame, so the cache grows by one frame per step.

Memory through the cache comes from *pose-aware rotary encoding*: the angles that rotate q
and k are functions of the camera position (x, y) and of each token's ray bearing (camera yaw
plus the patch column's angle). Keys are rotated at the pose of the frame whose content they
carry (p_{t-1}); queries at the pose being generated (p_t). So q.k compares "where I look now"
with "where that cached token looked", and a head can fetch the cached token that saw the
same direction from the same place - the view it must reproduce after turning back.
There is no time index anywhere, so a 1024-frame rollout with a rolling window sees the same
kind of positions as a 24-frame training clip.

Training runs all steps of a clip in parallel with a block-causal mask that mirrors the
cache's sink+window policy (`block_mask`), and a test checks it equals the cached rollout.

Shape legend: B batch, S steps (frames generated), T tokens per frame, C model dim,
H heads, D head_dim, A rotary angles per head (D/2); frames are [B, 3, H, W] (H, W pixels).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from calibrate.cache import KVCache, Rope, block_mask, softmax_attention
from calibrate.world.render import column_bearings


@dataclass(frozen=True)
class TinyWorldConfig:
    """Architecture of TinyWorld (stored in the weights file's metadata)."""

    frame_size: int = 32  # frames are frame_size x frame_size RGB
    patch_size: int = 8  # tokens per frame = (frame_size / patch_size) ** 2
    dim: int = 192  # model width C
    num_layers: int = 4
    num_heads: int = 3  # head_dim = dim / num_heads (64: group sizes behave as in real models)
    mlp_ratio: int = 4
    # rotary angle pairs per head: x position, y position, ray bearing; the rest stay unrotated
    rope_xy_pairs: int = 8
    rope_bearing_pairs: int = 12
    flow_stride: int = 2  # the warp's flow is predicted every flow_stride pixels (divides patch_size)

    def __post_init__(self):
        if self.frame_size % self.patch_size:
            raise ValueError(f"frame_size {self.frame_size} is not a multiple of patch_size {self.patch_size}")
        if self.flow_stride < 1 or self.patch_size % self.flow_stride:
            raise ValueError(f"flow_stride {self.flow_stride} does not divide patch_size {self.patch_size}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if 2 * self.rope_xy_pairs + self.rope_bearing_pairs > self.head_dim // 2:
            raise ValueError("rotary pairs exceed head_dim / 2")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.frame_size // self.patch_size

    @property
    def tokens_per_frame(self) -> int:
        return self.patches_per_side**2

    def to_dict(self) -> dict:
        return asdict(self)


class PoseRotary(nn.Module):
    """Rotary angles from a camera pose (x, y, yaw) for each token of a frame."""

    def __init__(self, cfg: TinyWorldConfig):
        super().__init__()
        self.cfg = cfg
        # x/y: wavelengths from 0.5 to 16 room units; bearing: integer frequencies (periodic in 2 pi)
        xy_freqs = 2 * math.pi / torch.logspace(math.log10(0.5), math.log10(16.0), cfg.rope_xy_pairs)
        bearing_freqs = torch.arange(1, cfg.rope_bearing_pairs + 1, dtype=torch.float32)
        num_free = cfg.head_dim // 2 - 2 * cfg.rope_xy_pairs - cfg.rope_bearing_pairs
        self.register_buffer("xy_freqs", xy_freqs, persistent=False)
        self.register_buffer("bearing_freqs", bearing_freqs, persistent=False)
        self.num_free = num_free
        # bearing offset of each token: mean ray angle of its patch column
        p = cfg.patch_size
        cols = column_bearings(cfg.frame_size).reshape(cfg.patches_per_side, p).mean(dim=1)
        self.register_buffer("token_bearing_T", cols.repeat(cfg.patches_per_side), persistent=False)

    def forward(self, pose_B3: Tensor) -> Rope:
        """The rotary of frames at these poses; its coordinates are the poses (a cache may store
        keys before the rotation and rebuild it from the pose: `Rope.at`)."""
        x, y, yaw = pose_B3[:, 0:1], pose_B3[:, 1:2], pose_B3[:, 2:3]
        bearing_BT = yaw + self.token_bearing_T  # [B, T]
        T = self.token_bearing_T.shape[0]
        angles = [
            (x * self.xy_freqs).unsqueeze(1).expand(-1, T, -1),
            (y * self.xy_freqs).unsqueeze(1).expand(-1, T, -1),
            bearing_BT.unsqueeze(-1) * self.bearing_freqs,
            pose_B3.new_zeros(pose_B3.shape[0], T, self.num_free),
        ]
        return Rope(torch.cat(angles, dim=-1), coords_BP=pose_B3, at=self.forward)


class Block(nn.Module):
    def __init__(self, cfg: TinyWorldConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim), nn.GELU(), nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)
        )

    def _heads(self, x_BNC: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, N, _ = x_BNC.shape
        qkv = self.qkv(self.norm1(x_BNC)).view(B, N, 3, self.cfg.num_heads, self.cfg.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [B, H, N, D]
        return q, k, v

    def _merge(self, x_BNC: Tensor, o_BHND: Tensor) -> Tensor:
        B, _, N, _ = o_BHND.shape
        x_BNC = x_BNC + self.proj(o_BHND.transpose(1, 2).reshape(B, N, self.cfg.dim))
        return x_BNC + self.mlp(self.norm2(x_BNC))

    def step(self, x_BTC: Tensor, layer: int, cache: KVCache, q_rope: Rope, k_rope: Rope) -> Tensor:
        """One frame through the cache."""
        q, k, v = self._heads(x_BTC)
        return self._merge(x_BTC, cache.attend(layer, q_rope.apply(q), k, v, k_rope))

    def parallel(self, x_BNC: Tensor, q_rope: Rope, k_rope: Rope, mask_NN: Tensor) -> Tensor:
        """All steps at once under the block-causal mask (training)."""
        q, k, v = self._heads(x_BNC)
        o = F.scaled_dot_product_attention(q_rope.apply(q), k_rope.apply(k), v, attn_mask=mask_NN)
        return self._merge(x_BNC, o)


class TinyWorld(nn.Module):
    def __init__(self, cfg: TinyWorldConfig = TinyWorldConfig()):
        super().__init__()
        self.cfg = cfg
        patch_dim = 3 * cfg.patch_size**2
        self.patch_in = nn.Linear(patch_dim, cfg.dim)
        self.token_pos = nn.Parameter(torch.randn(cfg.tokens_per_frame, cfg.dim) * 0.02)
        # action: camera-frame motion (forward, strafe, sin/cos of dyaw) -> one vector per frame
        self.action_in = nn.Sequential(nn.Linear(4, cfg.dim), nn.GELU(), nn.Linear(cfg.dim, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm_out = nn.LayerNorm(cfg.dim)
        self.patch_out = nn.Linear(cfg.dim, patch_dim)
        self.flow_out = nn.Linear(cfg.dim, 2 * (cfg.patch_size // cfg.flow_stride) ** 2)
        # Both heads start at zero: an untrained model copies the newest frame (zero flow is
        # the identity warp), and weights trained before the flow head existed load unchanged.
        for head in (self.patch_out, self.flow_out):
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
        self.rotary = PoseRotary(cfg)

    # ---- patches <-> frames ------------------------------------------------------------
    def patchify(self, frames_B3HW: Tensor) -> Tensor:
        p, n = self.cfg.patch_size, self.cfg.patches_per_side
        x = frames_B3HW.reshape(-1, 3, n, p, n, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(-1, n * n, 3 * p * p)

    def unpatchify(self, patches_BTP: Tensor, channels: int = 3, patch: int | None = None) -> Tensor:
        """[B, T, channels * patch**2] -> [B, channels, n * patch, n * patch] (n patches per side)."""
        p, n = patch or self.cfg.patch_size, self.cfg.patches_per_side
        x = patches_BTP.reshape(-1, n, n, channels, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(-1, channels, n * p, n * p)

    def _embed(self, frames_B3HW: Tensor, actions_B3: Tensor) -> Tensor:
        a = torch.stack(
            (actions_B3[:, 0], actions_B3[:, 1], actions_B3[:, 2].sin(), actions_B3[:, 2].cos() - 1), dim=-1
        )
        x = self.patch_in(self.patchify(frames_B3HW)) + self.token_pos
        return x + self.action_in(a * 4.0).unsqueeze(1)

    def _readout(self, x_BTC: Tensor, frames_B3HW: Tensor) -> Tensor:
        """Next frame = warp(newest frame, flow) + residual, both read from the last tokens."""
        h = self.norm_out(x_BTC)
        flow_B2hw = self.unpatchify(self.flow_out(h), channels=2, patch=self.cfg.patch_size // self.cfg.flow_stride)
        return warp(frames_B3HW, flow_B2hw) + self.unpatchify(self.patch_out(h))

    # ---- one step through the cache (rollouts) -----------------------------------------
    def step(
        self, cache: KVCache, frame_B3HW: Tensor, pose_prev_B3: Tensor, pose_B3: Tensor, action_B3: Tensor
    ) -> Tensor:
        """Predict the frame at `pose_B3` from the newest frame (at `pose_prev_B3`)."""
        x = self._embed(frame_B3HW, action_B3)
        q_rope, k_rope = self.rotary(pose_B3), self.rotary(pose_prev_B3)
        cache.expect(pose_B3)  # the pose being generated: a tiered cache recalls the frames seen nearest it
        for layer, block in enumerate(self.blocks):
            x = block.step(x, layer, cache, q_rope, k_rope)
        return self._readout(x, frame_B3HW)

    # ---- all steps of a clip in parallel (training) ----------------------------------
    def forward(self, frames_BS3HW: Tensor, poses_BS3: Tensor, actions_BS3: Tensor, window: int, sink_frames: int):
        """Teacher-forced prediction of frames 1..S from frames 0..S-1 of a clip of S+1 frames.

        Returns predictions [B, S, 3, H, W] for targets frames_BS3HW[:, 1:].
        """
        B, S1 = frames_BS3HW.shape[:2]
        S, T = S1 - 1, self.cfg.tokens_per_frame
        inputs = frames_BS3HW[:, :-1].reshape(B * S, *frames_BS3HW.shape[2:])
        x = self._embed(inputs, actions_BS3[:, 1:].reshape(B * S, 3)).reshape(B, S * T, -1)
        q_rope = self._rope_seq(poses_BS3[:, 1:])
        k_rope = self._rope_seq(poses_BS3[:, :-1])
        mask = block_mask(S, T, window, sink_frames).to(x.device)
        for block in self.blocks:
            x = block.parallel(x, q_rope, k_rope, mask)
        out = self._readout(x.reshape(B * S, T, -1), inputs)
        return out.reshape(B, S, *frames_BS3HW.shape[2:])

    def _rope_seq(self, poses_BS3: Tensor) -> Rope:
        B, S = poses_BS3.shape[:2]
        angles = self.rotary(poses_BS3.reshape(B * S, 3)).angles_BTA
        return Rope(angles.reshape(B, S * angles.shape[1], -1))


def warp(frames_B3HW: Tensor, flow_B2hw: Tensor) -> Tensor:
    """Backward warp: output pixel (i, j) samples frames at (i, j) + flow, flow in pixels.

    `flow_B2hw` (channel 0: x = columns, 1: y = rows) may be coarser than the frame; it is
    interpolated bilinearly to full resolution first. Sampling is bilinear at pixel centers
    (align_corners=False) with border padding, so zero flow returns the frames exactly.
    """
    H, W = frames_B3HW.shape[-2:]
    flow_B2HW = F.interpolate(flow_B2hw, size=(H, W), mode="bilinear", align_corners=False)
    # pixel centers in grid_sample's normalized coordinates: (2 * i + 1) / size - 1
    ys = (2 * torch.arange(H, dtype=frames_B3HW.dtype, device=frames_B3HW.device) + 1) / H - 1
    xs = (2 * torch.arange(W, dtype=frames_B3HW.dtype, device=frames_B3HW.device) + 1) / W - 1
    grid_BHW2 = torch.stack(
        (xs.view(1, 1, W) + flow_B2HW[:, 0] * (2.0 / W), ys.view(1, H, 1) + flow_B2HW[:, 1] * (2.0 / H)), dim=-1
    )
    return F.grid_sample(frames_B3HW, grid_BHW2, mode="bilinear", padding_mode="border", align_corners=False)


__all__ = ["TinyWorld", "TinyWorldConfig", "block_mask", "softmax_attention", "warp"]

"""Teacher forcing: one diffusers forward over a whole clip that computes what the cached rollout does.

The rollout (adapters/wan_diffusers.py) runs, per chunk c, denoising passes that read the cache
without writing, then a clean pass at timestep 0 that writes chunk c's K/V. Training runs all
of a clip's passes in one forward (as CausVid's and diffusion forcing's teacher forcing do):
the sequence holds the N clean frames (timestep 0) followed by M noisy frames, each a noisy
copy of one target frame i at its own timestep, and two masks mirror the cache:

- self-attention: clean frame i sees clean frames j <= i the cache keeps once i is appended
  (j > i - window, or j < sink_frames: `cache.block_mask`); a noisy copy of frame i sees the
  clean frames a denoising pass of i sees (the same, without i itself) and its own tokens;
- cross-attention: every token reads only its own frame's camera tokens (the rollout passes
  each chunk its own `encoder_hidden_states`).

Both are diffusers' own `WanAttnProcessor` given a mask; the self-attention one also gets the
rotary code of each frame's *position* (a noisy copy sits at its target's position; a clip may
start later in a trajectory than its first, sink frame: `positions`). Per-token timesteps are
diffusers' Wan 2.2 input form (timestep [B, tokens]). A test checks that this forward equals the
cached rollout's passes, chunk by chunk. `processors` is a context manager: the model's own
processors (the adapter's cache hook) are back when it exits.

Shape legend: B clips, N clean frames, M noisy frames, T tokens per frame, S = (N + M) T,
L camera tokens per frame, C latent channels, h x w latent grid, D head_dim.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch import Tensor

from calibrate.adapters.wan_diffusers import rope_angles


def frame_masks(num_frames: int, targets: list[int], window: int, sink_frames: int) -> Tensor:
    """Which frame sees which, [(N + M), (N + M)] bool: clean frames first, then the noisy copies."""
    i = torch.arange(num_frames).unsqueeze(1)
    j = torch.arange(num_frames).unsqueeze(0)
    kept = (j > i - window) | (j < sink_frames)
    clean_NN = (j <= i) & kept
    t = torch.tensor(targets).unsqueeze(1)
    noisy_MN = (j < t) & ((j > t - window) | (j < sink_frames))
    m = len(targets)
    top = torch.cat((clean_NN, torch.zeros(num_frames, m, dtype=torch.bool)), dim=1)
    bottom = torch.cat((noisy_MN, torch.eye(m, dtype=torch.bool)), dim=1)
    return torch.cat((top, bottom), dim=0)


class _Masked:
    """diffusers' Wan attention processor with a fixed mask (and, for self-attention, fixed rotary)."""

    def __init__(self, mask: Tensor, rotary: tuple[Tensor, Tensor] | None = None):
        self.inner, self.mask, self.rotary = WanAttnProcessor(), mask, rotary

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        return self.inner(attn, hidden_states, encoder_hidden_states, self.mask,
                          self.rotary if self.rotary is not None else rotary_emb)


@contextmanager
def processors(transformer, self_mask: Tensor, rotary: tuple[Tensor, Tensor], cross_mask: Tensor):
    saved = transformer.attn_processors
    masked = {name: _Masked(self_mask, rotary) if ".attn1." in name else _Masked(cross_mask) for name in saved}
    transformer.set_attn_processor(masked)
    try:
        yield
    finally:
        transformer.set_attn_processor(saved)


def rotary(head_dim: int, positions_BF: Tensor, height: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(cos, sin) [B, F*h*w, 1, D] in diffusers' layout (each angle twice) for frames at `positions_BF`."""
    angles = torch.stack([rope_angles(head_dim, p.tolist(), height, width) for p in positions_BF.cpu()])
    cos, sin = (f(angles).repeat_interleave(2, dim=-1).unsqueeze(2).to(device, torch.float32) for f in (torch.cos, torch.sin))
    return cos, sin


def clip_forward(transformer, clean_BNCHW: Tensor, noisy_BMCHW: Tensor, targets: list[int], timesteps_BM: Tensor,
                 positions_BN: Tensor, context_BNLD: Tensor, window: int, sink_frames: int) -> tuple[Tensor, Tensor]:
    """Flow predictions of every clean frame [B, N, C, h, w] (timestep 0) and noisy copy [B, M, C, h, w].

    `targets[m]` is the frame (0..N-1) whose noisy copy is noisy m, at timestep `timesteps_BM[:, m]`
    (0-1000); `positions_BN` the temporal rotary position of each frame; `context_BNLD` each
    frame's cross-attention tokens.
    """
    B, N, C, H, W = clean_BNCHW.shape
    p = transformer.config.patch_size
    h, w = H // p[1], W // p[2]
    T = h * w
    masks = frame_masks(N, targets, window, sink_frames)
    self_mask = masks.repeat_interleave(T, 0).repeat_interleave(T, 1).to(clean_BNCHW.device)
    L = context_BNLD.shape[2]
    frame_of = torch.cat((torch.arange(N), torch.tensor(targets, dtype=torch.long)))  # frame each slot shows
    cross_mask = (frame_of.unsqueeze(1) == torch.arange(N).unsqueeze(0))  # [(N+M), N]
    cross_mask = cross_mask.repeat_interleave(T, 0).repeat_interleave(L, 1).to(clean_BNCHW.device)
    slot_positions = torch.cat((positions_BN, positions_BN[:, targets]), dim=1)
    rot = rotary(transformer.config.attention_head_dim, slot_positions, h, w, clean_BNCHW.device)
    timestep_BS = torch.cat((torch.zeros(B, N, device=timesteps_BM.device), timesteps_BM), dim=1).repeat_interleave(T, 1)
    x = torch.cat((clean_BNCHW, noisy_BMCHW), dim=1).permute(0, 2, 1, 3, 4)  # [B, C, N + M, H, W]
    with processors(transformer, self_mask, rot, cross_mask):
        out = transformer(x, timestep_BS, context_BNLD.flatten(1, 2), return_dict=False)[0]
    out = out.permute(0, 2, 1, 3, 4)
    return out[:, :N], out[:, N:]

"""WanWorld's latents: a fixed space-to-depth of the renderer's RGB frames (no VAE).

A 32x32 RGB frame in [0, 1] becomes a 12 x 16 x 16 latent: every 2x2 block of pixels is
stacked into the channel axis (channel = 4 * rgb + 2 * row-in-block + column-in-block,
`torch.nn.functional.pixel_unshuffle`). Nothing is scaled, so the encoding is a permutation of
the pixels: a latent frame's PSNR (data range 1) is exactly its RGB frame's, and the project's
metrics read the same on WanWorld as on TinyWorld. With Wan's patch (1, 2, 2) a latent frame
is 8 x 8 = 64 tokens of 4 x 4 pixels each.

Why no scaling to unit variance, as Wan's VAE latents have: the metrics above, and a world
model's next frame is nearly determined by its context, so the low signal-to-noise ratio of
[0, 1] data under unit noise only shifts the sampler's work toward the context it reads anyway.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

FACTOR = 2  # pixels per latent cell along each axis
RGB = 3
CHANNELS = RGB * FACTOR * FACTOR
BOUNDS = (0.0, 1.0)  # latents are pixels: a generated frame is clamped to them, as a decoder's output would be


def encode(frames: Tensor) -> Tensor:
    """RGB frames [..., 3, H, W] -> latents [..., 12, H/2, W/2]."""
    lead = frames.shape[:-3]
    return F.pixel_unshuffle(frames.reshape(-1, *frames.shape[-3:]), FACTOR).reshape(*lead, CHANNELS,
                                                                                     frames.shape[-2] // FACTOR,
                                                                                     frames.shape[-1] // FACTOR)


def decode(latents: Tensor) -> Tensor:
    """Latents [..., 12, h, w] -> RGB frames [..., 3, 2h, 2w] (the exact inverse of `encode`)."""
    lead = latents.shape[:-3]
    return F.pixel_shuffle(latents.reshape(-1, *latents.shape[-3:]), FACTOR).reshape(*lead, RGB,
                                                                                     latents.shape[-2] * FACTOR,
                                                                                     latents.shape[-1] * FACTOR)

"""WanWorld's latents: a fixed space-to-depth of the renderer's RGB frames (no VAE).

A 32x32 RGB frame in [0, 1] becomes a 12 x 16 x 16 latent: every 2x2 block of pixels is
stacked into the channel axis (channel = 4 * rgb + 2 * row-in-block + column-in-block,
`torch.nn.functional.pixel_unshuffle`). The encoding is a permutation of the pixels, so a latent
frame's PSNR (data range 1) is exactly its RGB frame's: these are the frames the adapter returns
and the metrics read, the same on WanWorld as on TinyWorld. With Wan's patch (1, 2, 2) a latent
frame is 8 x 8 = 64 tokens of 4 x 4 pixels each.

The transformer works on *normalized* latents, (latent - MEAN) / STD, about zero mean and unit
variance (the constants were measured on training clips: mean 0.222, std 0.133 in every RGB
channel), as Wan's pipelines normalize VAE latents with `latents_mean` / `latents_std`. Without
it the data would sit 18 dB below the sampler's unit noise: a pilot (150 steps) learned slowly,
the flow output having to pass the noise through with ~1% precision to leave the frame visible.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

FACTOR = 2  # pixels per latent cell along each axis
RGB = 3
CHANNELS = RGB * FACTOR * FACTOR
BOUNDS = (0.0, 1.0)  # latents are pixels: a generated frame is clamped to them, as a decoder's output would be
MEAN, STD = 0.22, 0.13  # the transformer's latents are (latent - MEAN) / STD


def encode(frames: Tensor) -> Tensor:
    """RGB frames [..., 3, H, W] -> latents [..., 12, H/2, W/2]."""
    lead = frames.shape[:-3]
    return F.pixel_unshuffle(frames.reshape(-1, *frames.shape[-3:]), FACTOR).reshape(*lead, CHANNELS,
                                                                                     frames.shape[-2] // FACTOR,
                                                                                     frames.shape[-1] // FACTOR)


def normalize(latents: Tensor) -> Tensor:
    """Latents as the transformer reads and writes them: (latent - MEAN) / STD."""
    return (latents - MEAN) / STD


def denormalize(x: Tensor) -> Tensor:
    """The transformer's latents back to pixel latents (the inverse of `normalize`)."""
    return x * STD + MEAN


def decode(latents: Tensor) -> Tensor:
    """Latents [..., 12, h, w] -> RGB frames [..., 3, 2h, 2w] (the exact inverse of `encode`)."""
    lead = latents.shape[:-3]
    return F.pixel_shuffle(latents.reshape(-1, *latents.shape[-3:]), FACTOR).reshape(*lead, RGB,
                                                                                     latents.shape[-2] * FACTOR,
                                                                                     latents.shape[-1] * FACTOR)

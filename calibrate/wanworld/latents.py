"""WanWorld's latents: a fixed space-to-depth of the renderer's RGB frames (no VAE).

A 32x32 RGB frame in [0, 1] becomes a 12 x 16 x 16 latent: every 2x2 block of pixels is
stacked into the channel axis (channel = 4 * rgb + 2 * row-in-block + column-in-block,
`torch.nn.functional.pixel_unshuffle`). The encoding is a permutation of the pixels, so a latent
frame's PSNR (data range 1) is exactly its RGB frame's: these are the frames the adapter returns
and the metrics read, the same on WanWorld as on TinyWorld. With Wan's patch (1, 2, 2) a latent
frame is 8 x 8 = 64 tokens of 4 x 4 pixels each.

The transformer reads and writes *whitened* latents, as Wan's pipelines normalize VAE latents:
each 12-channel latent cell (2 x 2 pixels x RGB) is centred and rotated into its principal axes,
each scaled to unit variance (`LatentWhitening`, fitted once on training clips; its mean and
matrices ship in the weights file, like a VAE's weights). A VAE's latents are decorrelated
features of unit variance; raw pixels are not: a cell's first principal axis (mean brightness)
has 12x the standard deviation of its last, and the 48 pixels of a token need 6-7 components for
80% of their variance on orbit and pan (20-22 once whitened). `kind="normalized"` only centres
and scales every channel alike (mean 0.22, std 0.13); the pilots compare the two (model card).
Either way the data sits at the sampler's unit noise level: on raw [0, 1] pixels it sat 18 dB
below, and a pilot learned slowly, the flow output having to pass the noise through with ~1%
precision to leave the frame visible.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FACTOR = 2  # pixels per latent cell along each axis
RGB = 3
CHANNELS = RGB * FACTOR * FACTOR
BOUNDS = (0.0, 1.0)  # latents are pixels: a generated frame is clamped to them, as a decoder's output would be
MEAN, STD = 0.22, 0.13  # kind="normalized": the transformer's latents are (latent - MEAN) / STD
KINDS = ("whitened", "normalized")


def encode(frames: Tensor) -> Tensor:
    """RGB frames [..., 3, H, W] -> latents [..., 12, H/2, W/2]."""
    lead = frames.shape[:-3]
    return F.pixel_unshuffle(frames.reshape(-1, *frames.shape[-3:]), FACTOR).reshape(*lead, CHANNELS,
                                                                                     frames.shape[-2] // FACTOR,
                                                                                     frames.shape[-1] // FACTOR)


class LatentWhitening(nn.Module):
    """The fixed map between latents (pixels) and the transformer's latents, per latent cell.

    normalize(z) = (z - mean) @ forward over the channel axis, denormalize its exact inverse.
    `whitened`: forward = U diag(1 / sqrt(eigenvalues)) of the cells' covariance (`fit`);
    `normalized`: mean MEAN, forward = I / STD. The buffers are part of the state dict.
    """

    def __init__(self, kind: str = "whitened"):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"latent kind must be one of {', '.join(KINDS)}, got '{kind}'")
        self.kind = kind
        self.register_buffer("mean_C", torch.full((CHANNELS,), MEAN))
        self.register_buffer("forward_CC", torch.eye(CHANNELS) / STD)
        self.register_buffer("inverse_CC", torch.eye(CHANNELS) * STD)

    @torch.no_grad()
    def fit(self, latents: Tensor) -> None:
        """Whitening of the cells of `latents` [..., 12, h, w] (float64 statistics); `normalized` keeps its constants."""
        if self.kind != "whitened":
            return
        cells = latents.movedim(-3, -1).reshape(-1, CHANNELS).double()
        mean = cells.mean(0)
        eigenvalues, axes = torch.linalg.eigh(torch.cov((cells - mean).T))
        eigenvalues, axes = eigenvalues.flip(0), axes.flip(1)  # largest first
        self.mean_C.copy_(mean)
        self.forward_CC.copy_(axes / eigenvalues.sqrt())
        self.inverse_CC.copy_(eigenvalues.sqrt().unsqueeze(1) * axes.T)

    def normalize(self, latents: Tensor) -> Tensor:
        """Latents [..., 12, h, w] -> the transformer's latents."""
        return ((latents.movedim(-3, -1) - self.mean_C) @ self.forward_CC).movedim(-1, -3)

    def denormalize(self, x: Tensor) -> Tensor:
        """The transformer's latents -> latents (the inverse of `normalize`)."""
        return (x.movedim(-3, -1) @ self.inverse_CC + self.mean_C).movedim(-1, -3)


def decode(latents: Tensor) -> Tensor:
    """Latents [..., 12, h, w] -> RGB frames [..., 3, 2h, 2w] (the exact inverse of `encode`)."""
    lead = latents.shape[:-3]
    return F.pixel_shuffle(latents.reshape(-1, *latents.shape[-3:]), FACTOR).reshape(*lead, RGB,
                                                                                     latents.shape[-2] * FACTOR,
                                                                                     latents.shape[-1] * FACTOR)

"""Side-by-side strips: reference | quantized | amplified error, as an animated GIF or a still.

The error panel shows ``clamp(|q - r| * gain, 0, 1)`` per colour channel: black where the
quantized rollout matches the reference, bright where it does not. Flicker shows up as an
error panel that changes from frame to frame, drift as one that brightens over time, blur as
edges lighting up. Panels are upscaled by an integer ``scale`` with nearest-neighbour (no
smoothing that would hide pixel-level error). Labels use Pillow's built-in default font, so
no font files are needed. Files are written atomically (temporary file + rename).

Frames are ``[N, 3, H, W]`` float in [0, 1], one rollout.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from calibrate.io import write_atomic

LABELS = ("reference", "quantized", "error")
LABEL_BAND = 12
"""Height in pixels of the label band above the panels (when labels are on)."""


def _check(ref: Tensor, quant: Tensor, scale: int) -> None:
    if ref.shape != quant.shape or ref.dim() != 4 or ref.shape[1] != 3:
        raise ValueError(
            f"expected ref and quant of the same shape [N, 3, H, W], got {tuple(ref.shape)} and {tuple(quant.shape)}"
        )
    if ref.shape[0] == 0:
        raise ValueError("no frames to draw")
    if int(scale) != scale or scale < 1:
        raise ValueError(f"scale must be a positive integer, got {scale!r}")


def _panels_uint8(ref: Tensor, quant: Tensor, gain: float, scale: int) -> Tensor:
    """``[N, 3, H, W]`` x 2 -> ``[N, H*scale, 3*W*scale, 3]`` uint8: ref | quant | error."""
    r, q = ref.detach().float().cpu().clamp(0, 1), quant.detach().float().cpu().clamp(0, 1)
    err = ((q - r).abs() * gain).clamp(0, 1)
    row = torch.cat([r, q, err], dim=-1)  # [N, 3, H, 3W]
    row = row.repeat_interleave(scale, dim=-2).repeat_interleave(scale, dim=-1)
    return (row * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous()


def _label_band(width: int, panel_width: int):
    """A black band with each panel's name in Pillow's built-in font."""
    from PIL import Image, ImageDraw

    band = Image.new("RGB", (width, LABEL_BAND), (0, 0, 0))
    draw = ImageDraw.Draw(band)
    for i, text in enumerate(LABELS):
        draw.text((i * panel_width + 2, 0), text, fill=(255, 255, 255))
    return band


def _to_image(pixels_HW3: Tensor, labels: bool, panel_width: int):
    from PIL import Image

    image = Image.fromarray(pixels_HW3.numpy())
    if not labels:
        return image
    framed = Image.new("RGB", (image.width, image.height + LABEL_BAND), (0, 0, 0))
    framed.paste(_label_band(image.width, panel_width), (0, 0))
    framed.paste(image, (0, LABEL_BAND))
    return framed


def _even_indices(num_frames: int, count: int) -> list[int]:
    """``count`` frame indices spread evenly over the rollout, first and last included."""
    if count >= num_frames:
        return list(range(num_frames))
    if count == 1:
        return [0]
    return [round(i * (num_frames - 1) / (count - 1)) for i in range(count)]


def write_strip(
    ref: Tensor,
    quant: Tensor,
    path: str | os.PathLike,
    gain: float = 4.0,
    scale: int = 4,
    fps: float = 8.0,
    max_frames: int | None = None,
    labels: bool = True,
) -> Path:
    """Animated GIF of reference | quantized | error, ``3 * W * scale`` pixels wide.

    ``max_frames`` keeps that many frames spread evenly over the whole rollout (first and last
    included), so late drift stays in the strip; None keeps all. With labels the image is
    ``LABEL_BAND`` pixels taller than ``H * scale``. Note that the GIF encoder merges
    consecutive identical frames (adding up their durations), so a perfectly static strip may
    hold fewer frames than requested while playing for the same time.
    """
    _check(ref, quant, scale)
    if max_frames is not None and max_frames < 1:
        raise ValueError(f"max_frames must be >= 1 or None, got {max_frames}")
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    keep = _even_indices(ref.shape[0], max_frames or ref.shape[0])
    pixels = _panels_uint8(ref[keep], quant[keep], gain, scale)
    images = [_to_image(p, labels, ref.shape[-1] * scale) for p in pixels]
    duration_ms = max(20, round(1000 / fps))

    def write(f):
        images[0].save(f, format="GIF", save_all=True, append_images=images[1:], duration=duration_ms, loop=0)

    return write_atomic(path, write)


def write_triptych_png(
    ref: Tensor,
    quant: Tensor,
    path: str | os.PathLike,
    frames: Sequence[int] | None = None,
    num_frames: int = 4,
    gain: float = 4.0,
    scale: int = 4,
    labels: bool = True,
) -> Path:
    """A still PNG: one row per chosen frame (``frames``, or ``num_frames`` spread evenly over
    the rollout), columns reference | quantized | error. A 2-pixel gap separates the rows."""
    from PIL import Image

    _check(ref, quant, scale)
    n = ref.shape[0]
    chosen = list(frames) if frames is not None else _even_indices(n, num_frames)
    if not chosen or any(not -n <= i < n for i in chosen):
        raise ValueError(f"frames must be indices into a {n}-frame rollout, got {chosen}")
    pixels = _panels_uint8(ref[chosen], quant[chosen], gain, scale)
    rows = [Image.fromarray(p.numpy()) for p in pixels]
    gap, top = 2, LABEL_BAND if labels else 0
    sheet = Image.new("RGB", (rows[0].width, top + len(rows) * (rows[0].height + gap) - gap), (0, 0, 0))
    if labels:
        sheet.paste(_label_band(rows[0].width, ref.shape[-1] * scale), (0, 0))
    for i, row in enumerate(rows):
        sheet.paste(row, (0, top + i * (row.height + gap)))
    return write_atomic(path, lambda f: sheet.save(f, format="PNG"))

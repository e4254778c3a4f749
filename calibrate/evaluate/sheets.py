"""Frame sheets: rollouts as a few small lossless WebP images, for the players of report.html.

report.html plays every scheme's rollout of every trajectory next to the fp reference, from one
self-contained file, and shows the quantization error amplified, so the frames it embeds must
be exact (a lossy codec's artefacts would be amplified into fake error) and small. A *sheet*
holds up to `SHEET_FRAMES` consecutive frames of one stream of one trajectory, 8-bit RGB, with
the rows of its F frames interleaved by time:

    image row  y * F + t   =   row y of frame t        (0 <= t < F, 0 <= y < H; width W)

so the pixel above each pixel is the same pixel one frame earlier, and WebP's lossless
predictors ("top", "average of top and left", ...) become temporal predictors. Streams:

* ``reference``: the full-precision rollout;
* ``ground_truth``: the true frames, only for models with a renderer;
* ``quantized/<scheme>``: a scheme's rollout stored as its difference to the reference,
  ``(q - r + 128) mod 256`` per channel, which is exact (``q = (d + r + 128) mod 256``), almost
  flat where a scheme stays close to fp, and no larger than the plain frames where it does not.

Measured on the default compare (TinyWorld, 7 trajectories x 256 frames of 32x32 RGB), sheet
bytes per raw RGB byte: reference 0.30, ground truth 0.29; quantized, as differences: fp16
0.007, kivi4 0.16, kivi2 0.28, kvquant2 0.31, qvg2 0.33, naive2 0.37 (0.37 as plain frames
too), quarot2 0.41. Frames stacked one under another instead would cost ~1.4x (PNG: 0.46 vs
0.34 interleaved); WebP rather than PNG is 25-30% smaller at a similar encode time (~0.4 s per
128-frame sheet here, ~50 s of a 7-8 minute default compare) and is decoded by every current
browser; Pillow writes it with its bundled libwebp. Sheets are files under the run dir as soon
as their batch is done, so an evaluation holds no frames beyond its current batch for the
report, and a resumed run finds the sheets of the batches it does not redo.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from calibrate.io import write_bytes_atomic

SHEET_FRAMES = 128
"""Frames per sheet (the last sheet of a rollout holds the rest)."""
MAX_SHEET_ROWS = 16383
"""WebP's largest image side: a sheet is `SHEET_FRAMES * H` rows tall."""
MAX_HEIGHT = MAX_SHEET_ROWS // SHEET_FRAMES
"""Tallest frame (pixels) a sheet can hold: 127 (TinyWorld: 32; Wan 480p latents: 60)."""
REFERENCE, GROUND_TRUTH = "reference", "ground_truth"


class SheetError(ValueError):
    """A sheet file is missing, unreadable or of the wrong geometry (the message names the file)."""


def quantized_stream(scheme: str) -> str:
    return f"quantized/{scheme}"


def num_sheets(num_frames: int) -> int:
    return math.ceil(num_frames / SHEET_FRAMES)


def sheet_frames(num_frames: int, sheet: int) -> int:
    """Frames in sheet `sheet` of a rollout of `num_frames` frames."""
    return min(SHEET_FRAMES, num_frames - sheet * SHEET_FRAMES)


def sheet_path(directory: str | os.PathLike, stream: str, trajectory: int, sheet: int) -> Path:
    """`<directory>/<stream>/<trajectory>.<sheet>.webp`; `trajectory` indexes `SchemeRun.trajs`."""
    return Path(directory) / stream / f"{trajectory}.{sheet}.webp"


# ---- pixels ------------------------------------------------------------------------------------
def to_uint8(frames: Tensor) -> Tensor:
    """RGB frames ``[..., 3, H, W]`` float in [0, 1] -> ``[..., H, W, 3]`` uint8 (rounded)."""
    if frames.shape[-3] != 3:
        raise ValueError(f"expected RGB frames [..., 3, H, W], got shape {tuple(frames.shape)}")
    return (frames.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8).movedim(-3, -1).contiguous()


def difference(quant_NHW3: Tensor, ref_NHW3: Tensor) -> Tensor:
    """``(q - r + 128) mod 256`` per channel, uint8: what a quantized stream stores."""
    return (quant_NHW3.to(torch.int16) - ref_NHW3.to(torch.int16) + 128).remainder(256).to(torch.uint8)


def undo_difference(diff_NHW3: Tensor, ref_NHW3: Tensor) -> Tensor:
    """Inverse of :func:`difference` (the page does the same in JavaScript)."""
    return (diff_NHW3.to(torch.int16) + ref_NHW3.to(torch.int16) + 128).remainder(256).to(torch.uint8)


def encode_sheet(frames_FHW3: Tensor) -> bytes:
    """Up to `SHEET_FRAMES` uint8 frames -> lossless WebP bytes (rows interleaved by time)."""
    from PIL import Image

    f, h, w, c = frames_FHW3.shape
    if not 1 <= f <= SHEET_FRAMES or c != 3 or h > MAX_HEIGHT or frames_FHW3.dtype != torch.uint8:
        raise ValueError(f"a sheet holds 1-{SHEET_FRAMES} uint8 RGB frames of height <= {MAX_HEIGHT}, "
                         f"got {tuple(frames_FHW3.shape)} {frames_FHW3.dtype}")
    rows = frames_FHW3.permute(1, 0, 2, 3).reshape(h * f, w, 3)  # row y of frame t -> y * f + t
    buf = io.BytesIO()
    # method 4 / quality 50: lossless effort where size stops shrinking (method 6 costs 20x the time for <1%)
    Image.fromarray(rows.numpy()).save(buf, format="WEBP", lossless=True, method=4, quality=50)
    return buf.getvalue()


def decode_sheet(data: bytes, num_frames: int, where: str = "sheet") -> Tensor:
    """WebP bytes of a sheet of `num_frames` frames -> ``[F, H, W, 3]`` uint8; `SheetError` if
    the bytes are no RGB WebP image or its height is not a multiple of `num_frames`."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if im.format != "WEBP" or im.mode != "RGB":
                raise SheetError(f"{where}: expected an RGB WebP image, got {im.format} {im.mode}")
            pixels = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8)
            w, rows = im.size
    except (OSError, UnidentifiedImageError, SyntaxError) as e:
        raise SheetError(f"{where}: not a readable WebP image ({e})") from None
    if rows % num_frames:
        raise SheetError(f"{where}: {rows} rows do not hold {num_frames} frames")
    h = rows // num_frames
    return pixels.reshape(h, num_frames, w, 3).permute(1, 0, 2, 3).contiguous()


def read_stream(directory: str | os.PathLike, stream: str, trajectory: int, num_frames: int,
                size: tuple[int, int] | None = None) -> tuple[list[bytes], tuple[int, int]]:
    """The sheets of one stream, checked: (WebP bytes per sheet, frame (H, W)).

    Every sheet is decoded once to check it (cheap: a few KB each); a missing or damaged file,
    or frames of another size than `size`, raise `SheetError` with one line naming the file.
    """
    sheets = []
    for k in range(num_sheets(num_frames)):
        path = sheet_path(directory, stream, trajectory, k)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise SheetError(f"{path}: {'missing' if isinstance(e, FileNotFoundError) else e.strerror or e}") from None
        frames = decode_sheet(data, sheet_frames(num_frames, k), str(path))
        hw = (frames.shape[1], frames.shape[2])
        if size is not None and hw != tuple(size):
            raise SheetError(f"{path}: frames are {hw[0]}x{hw[1]}, the other streams' are {size[0]}x{size[1]}")
        size = hw
        sheets.append(data)
    return sheets, size


# ---- writing while the evaluation runs ---------------------------------------------------------
class FrameSheets:
    """Writes the sheets of each batch as soon as it is done: `evaluate(..., on_rollout=sheets)`.

    `preview` maps the model's frames to RGB in [0, 1] (the adapter's; identity for TinyWorld).
    The reference and ground truth of a trajectory are written with its first scheme, each
    scheme's differences with its own rollout. `note` says why no sheets were written, if so.
    """

    def __init__(self, directory: str | os.PathLike, preview: Callable[[Tensor], Tensor] = lambda frames: frames):
        self.directory = Path(directory)
        self.preview = preview
        self.note: str | None = None
        self._written: set[int] = set()

    def __call__(self, scheme: str, first: int, ref_BNCHW: Tensor, quant_BNCHW: Tensor, truth_BNCHW: Tensor | None) -> None:
        ref = to_uint8(self.preview(ref_BNCHW))
        if ref.shape[-3] > MAX_HEIGHT:
            self.note = f"frames are {ref.shape[-3]} pixels tall; the players hold at most {MAX_HEIGHT}"
            return
        quant = to_uint8(self.preview(quant_BNCHW))
        truth = to_uint8(self.preview(truth_BNCHW)) if truth_BNCHW is not None else None
        for b in range(ref.shape[0]):
            i = first + b
            if i not in self._written:
                self._write(REFERENCE, i, ref[b])
                if truth is not None:
                    self._write(GROUND_TRUTH, i, truth[b])
                self._written.add(i)
            self._write(quantized_stream(scheme), i, difference(quant[b], ref[b]))

    def _write(self, stream: str, trajectory: int, frames_NHW3: Tensor) -> None:
        for k in range(num_sheets(frames_NHW3.shape[0])):
            chunk = frames_NHW3[k * SHEET_FRAMES:(k + 1) * SHEET_FRAMES]
            write_bytes_atomic(sheet_path(self.directory, stream, trajectory, k), encode_sheet(chunk))

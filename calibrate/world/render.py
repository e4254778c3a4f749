"""A procedural room and a Wolfenstein-style raycaster, vectorized in torch.

The world is a square room ``[0, ROOM_SIZE] x [0, ROOM_SIZE]`` seen from above, with
``x`` to the right and ``y`` up. A camera pose is ``(x, y, yaw)``: yaw is in radians and
increases counter-clockwise, so yaw 0 looks along +x and yaw pi/2 along +y. Cameras stay
within ``CAMERA_RADIUS`` of ``CENTER``; pillars ("landmarks") are placed so that this disk
never intersects them.

Geometry of one frame (a pinhole camera with horizontal field of view ``FOV_DEG`` and square
pixels, so the focal length in pixels is ``f = (W / 2) / tan(FOV / 2)``):

1. Columns. Column ``i`` (0 = left edge of the image) looks along the bearing
   ``b_i = atan(((W / 2) - (i + 0.5)) / f)`` relative to the yaw: the left column has a
   *positive* bearing (it looks counter-clockwise of the view direction), the right column
   a negative one, and the bearings are antisymmetric about the image center
   (``column_bearings``). The world angle of the column's ray is ``yaw + b_i``.
2. Rays. Each column casts one ray in the floor plane and intersects it with the four walls
   (the nearest positive crossing of ``x = 0``, ``x = ROOM_SIZE``, ``y = 0``,
   ``y = ROOM_SIZE``) and with every pillar box (slab method: the ray is inside the box for
   ``t`` in ``[max(t_x_near, t_y_near), min(t_x_far, t_y_far)]``). The nearest hit wins.
3. Height. Walls and pillars run from the floor (height 0) to ``WALL_HEIGHT``; the eye is at
   ``CAMERA_HEIGHT``. A point at height ``h`` on a surface at *perpendicular* distance
   ``p = t * cos(b_i)`` (the depth along the optical axis, not the ray length ``t``, which
   would bend straight walls: the fisheye effect) appears ``f * (h - CAMERA_HEIGHT) / p``
   pixels above the horizon row (the image center). Rows inside ``[0, WALL_HEIGHT]`` show
   the surface with texture coordinates ``u`` (along the wall or face) and ``v = h``.
4. Floor and ceiling. A row ``y_img`` pixels below the horizon sees the floor at
   perpendicular distance ``f * CAMERA_HEIGHT / y_img``; that point's ``(x, y)`` picks the
   floor tile color. Rows above the wall see the ceiling, a plain vertical gradient.

Shading: everything darkens with ray distance (``1 / (1 + FOG * t)``) as a depth cue; walls
facing +-y are a little darker than walls facing +-x, and each pillar face has its own
brightness, so orientation reads even where colors repeat. Textures lose contrast as their
projected frequency approaches the pixel grid (a cheap mip-map), and every frame is rendered
at ``SUPERSAMPLE`` times the resolution and box-filtered down, so small camera motions give
small image changes instead of aliasing flicker.

Tensor-name legend: B scenes, T frames per scene, F = B * T frames, H rows, W columns,
S wall segments (4 walls x 8), P pillar slots (``MAX_PILLARS``; unused ones are masked).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

ROOM_SIZE = 8.0
CENTER = (4.0, 4.0)
CAMERA_RADIUS = 2.0
FOV_DEG = 90.0
# Tall walls and a low eye: at the typical wall distance of 4 a wall then fills ~12 of 32
# rows (with height 1 and eye 0.5 it would be a 4-row band between floor and ceiling, and
# directions would hardly differ); pillars near the camera fill whole columns.
WALL_HEIGHT = 3.0
CAMERA_HEIGHT = 1.0
FRAME_SIZE = 32

SEGMENTS_PER_WALL = 8
NUM_WALL_SEGMENTS = 4 * SEGMENTS_PER_WALL
MIN_PILLARS, MAX_PILLARS = 3, 5
PILLAR_MIN_CENTER_DISTANCE = 2.7  # nearest point of a pillar to CENTER
PILLAR_MIN_WALL_DISTANCE = 0.4
PILLAR_SIZE_RANGE = (0.4, 0.7)
SUPERSAMPLE = 2
FOG = 0.1

# Wall ids, in the order used by segment indices (segment = wall * 8 + floor(u)).
# u runs along +x on the y-walls and along +y on the x-walls.
WALL_SOUTH, WALL_EAST, WALL_NORTH, WALL_WEST = 0, 1, 2, 3
_WALL_SHADE = (0.8, 1.0, 0.8, 1.0)
# Brightness of a pillar face by the direction its normal points: -x, +x, -y, +y.
_PILLAR_FACE_SHADE = (1.0, 0.6, 0.85, 0.5)


@dataclass(frozen=True)
class Scene:
    """Everything that makes one room look the way it does (build with ``make_scene``).

    Colors are RGB in [0, 1]. Wall texture of segment s at local coordinates (u, v):
    stripes ``sin(2 pi freq (dir_u u + dir_v v) + phase)`` or, where ``wall_checker`` is 1,
    a checker ``sin(2 pi freq u + phase) sin(2 pi freq v)``, blended from color b (dark) to
    color a. Pillar boxes are ``(x0, y0, x1, y1)``; slots with ``pillar_valid`` False are
    padding so scenes with different pillar counts stack.
    """

    seed: int
    wall_color_a_S3: Tensor
    wall_color_b_S3: Tensor
    wall_dir_S2: Tensor
    wall_freq_S: Tensor
    wall_phase_S: Tensor
    wall_checker_S: Tensor
    floor_color_a_3: Tensor
    floor_color_b_3: Tensor
    floor_tile: Tensor  # side length of one floor tile
    floor_offset_2: Tensor
    ceiling_horizon_3: Tensor
    ceiling_top_3: Tensor
    pillar_box_P4: Tensor
    pillar_color_P3: Tensor
    pillar_valid_P: Tensor

    @property
    def num_pillars(self) -> int:
        return int(self.pillar_valid_P.sum())


def _hsv_to_rgb(h: Tensor, s: Tensor, v: Tensor) -> Tensor:
    """HSV in [0, 1] -> RGB [..., 3] (the standard piecewise-linear formula)."""
    k = (torch.tensor([5.0, 3.0, 1.0], dtype=h.dtype) + h[..., None] * 6.0) % 6.0
    ramp = torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0)
    return v[..., None] - v[..., None] * s[..., None] * ramp


def _box_center_distance(box: Sequence[float]) -> float:
    """Distance from CENTER to the nearest point of an axis-aligned box."""
    x0, y0, x1, y1 = box
    dx = max(x0 - CENTER[0], 0.0, CENTER[0] - x1)
    dy = max(y0 - CENTER[1], 0.0, CENTER[1] - y1)
    return math.hypot(dx, dy)


def _place_pillars(g: torch.Generator, num: int) -> list[tuple[float, float, float, float]]:
    """Rejection-sample non-overlapping boxes outside the camera disk and off the walls."""
    boxes: list[tuple[float, float, float, float]] = []
    lo_size, hi_size = PILLAR_SIZE_RANGE
    # 200 draws of 4 numbers; the feasible region is large, so this never runs out in
    # practice, and a fixed-size draw keeps the generator stream independent of luck.
    draws = torch.rand(200, 4, generator=g, dtype=torch.float64).tolist()
    for sx, sy, cx, cy in draws:
        if len(boxes) == num:
            break
        w = lo_size + (hi_size - lo_size) * sx
        d = lo_size + (hi_size - lo_size) * sy
        lo_x, hi_x = PILLAR_MIN_WALL_DISTANCE + w / 2, ROOM_SIZE - PILLAR_MIN_WALL_DISTANCE - w / 2
        lo_y, hi_y = PILLAR_MIN_WALL_DISTANCE + d / 2, ROOM_SIZE - PILLAR_MIN_WALL_DISTANCE - d / 2
        px, py = lo_x + (hi_x - lo_x) * cx, lo_y + (hi_y - lo_y) * cy
        box = (px - w / 2, py - d / 2, px + w / 2, py + d / 2)
        if _box_center_distance(box) < PILLAR_MIN_CENTER_DISTANCE:
            continue
        gap = 0.3  # keep pillars apart so each one reads as its own landmark
        if any(box[0] < b[2] + gap and b[0] < box[2] + gap and box[1] < b[3] + gap and b[1] < box[3] + gap
               for b in boxes):
            continue
        boxes.append(box)
    assert len(boxes) == num, "pillar placement ran out of draws"
    return boxes


def make_scene(seed: int) -> Scene:
    """Build the room for ``seed`` (deterministic; uses its own generator, never the global one)."""
    g = torch.Generator().manual_seed(int(seed))

    def rand(*shape: int) -> Tensor:
        return torch.rand(shape, generator=g, dtype=torch.float64)

    s = NUM_WALL_SEGMENTS
    hue = rand(s)
    color_a = _hsv_to_rgb(hue, 0.55 + 0.45 * rand(s), 0.65 + 0.35 * rand(s))
    # The dark color is the same hue or its complement, so segments differ in pattern too.
    hue_b = (hue + 0.5 * (rand(s) < 0.5) + 0.1 * (rand(s) - 0.5)) % 1.0
    color_b = _hsv_to_rgb(hue_b, 0.4 + 0.6 * rand(s), 0.1 + 0.25 * rand(s))
    angle = math.pi * rand(s)
    wall_dir = torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1)
    freq = 0.75 + 1.25 * rand(s)  # cycles per unit length
    phase = 2 * math.pi * rand(s)
    checker = (rand(s) < 0.3).to(torch.float64)

    floor_hue = rand(1)
    floor_a = _hsv_to_rgb(floor_hue, 0.2 + 0.3 * rand(1), 0.45 + 0.2 * rand(1))[0]
    floor_b = _hsv_to_rgb((floor_hue + 0.15 * rand(1)) % 1.0, 0.2 + 0.4 * rand(1), 0.15 + 0.15 * rand(1))[0]
    floor_tile = 0.5 + 0.5 * rand()
    floor_offset = rand(2)
    ceil_hue = rand(1)
    ceil_sat = 0.1 + 0.3 * rand(1)
    ceiling_horizon = _hsv_to_rgb(ceil_hue, ceil_sat, 0.25 + 0.1 * rand(1))[0]
    ceiling_top = _hsv_to_rgb(ceil_hue, ceil_sat, 0.08 + 0.07 * rand(1))[0]

    num_pillars = MIN_PILLARS + int(torch.randint(MAX_PILLARS - MIN_PILLARS + 1, (), generator=g))
    boxes = _place_pillars(g, num_pillars)
    pillar_box = torch.zeros(MAX_PILLARS, 4, dtype=torch.float64)
    pillar_box[:num_pillars] = torch.tensor(boxes, dtype=torch.float64)
    # Evenly spaced hues (random rotation) keep the landmarks distinct from each other.
    pillar_hue = (rand(1) + torch.arange(MAX_PILLARS) / num_pillars + 0.05 * rand(MAX_PILLARS)) % 1.0
    pillar_color = _hsv_to_rgb(pillar_hue, 0.8 + 0.2 * rand(MAX_PILLARS), torch.ones(MAX_PILLARS, dtype=torch.float64))
    pillar_valid = torch.arange(MAX_PILLARS) < num_pillars

    f32 = torch.float32
    return Scene(
        seed=int(seed),
        wall_color_a_S3=color_a.to(f32),
        wall_color_b_S3=color_b.to(f32),
        wall_dir_S2=wall_dir.to(f32),
        wall_freq_S=freq.to(f32),
        wall_phase_S=phase.to(f32),
        wall_checker_S=checker.to(f32),
        floor_color_a_3=floor_a.to(f32),
        floor_color_b_3=floor_b.to(f32),
        floor_tile=floor_tile.to(f32),
        floor_offset_2=floor_offset.to(f32),
        ceiling_horizon_3=ceiling_horizon.to(f32),
        ceiling_top_3=ceiling_top.to(f32),
        pillar_box_P4=pillar_box.to(f32),
        pillar_color_P3=pillar_color.to(f32),
        pillar_valid_P=pillar_valid,
    )


def column_bearings(width: int = FRAME_SIZE) -> Tensor:
    """Ray angle of each pixel column relative to the camera yaw, in radians, shape [W].

    Column 0 (left) is positive (counter-clockwise of the view direction), the last column
    negative; values are antisymmetric and lie strictly inside ``+-FOV_DEG / 2``.
    """
    if width <= 0:
        raise ValueError(f"width must be a positive integer, got {width}")
    half_tan = math.tan(math.radians(FOV_DEG) / 2)
    centers = torch.arange(width, dtype=torch.float64) + 0.5
    return torch.atan((1.0 - 2.0 * centers / width) * half_tan).to(torch.float32)


def _check_poses(poses: Tensor, leading: int) -> None:
    shape = "[T, 3]" if leading == 1 else "[B, T, 3]"
    if not isinstance(poses, Tensor) or poses.ndim != leading + 1 or poses.shape[-1] != 3:
        got = tuple(poses.shape) if isinstance(poses, Tensor) else type(poses).__name__
        raise ValueError(f"poses must be a tensor of shape {shape} holding (x, y, yaw), got {got}")
    if poses.is_complex() or poses.dtype == torch.bool:
        raise ValueError(f"poses must be real numbers, got dtype {poses.dtype}")
    if not bool(torch.isfinite(poses).all()):
        raise ValueError("poses contain non-finite values (nan or inf)")
    xy = poses[..., :2].double()
    if bool(((xy <= 0) | (xy >= ROOM_SIZE)).any()):
        raise ValueError(f"pose positions must lie strictly inside the room (0, {ROOM_SIZE})^2")


def _stack_scenes(scenes: Sequence[Scene]) -> dict[str, Tensor]:
    """Scene fields stacked with a leading scene axis B."""
    return {
        fld.name: torch.stack([getattr(s, fld.name) for s in scenes])
        for fld in dataclasses.fields(Scene)
        if fld.name != "seed"
    }


def _safe_inverse(d: Tensor) -> Tensor:
    """1 / d with d kept away from 0 (keeping its sign), so axis-parallel rays stay finite."""
    return 1.0 / torch.where(d >= 0, d.clamp(min=1e-9), d.clamp(max=-1e-9))


def _cast_columns(st: dict[str, Tensor], scene_F: Tensor, pose_F3: Tensor, width: int):
    """Per-column nearest hit. Returns (t_FW, dir_x_FW, dir_y_FW, is_pillar_FW, index_FW, u_FW, face_FW).

    ``t`` is the ray length to the hit; ``index`` is the wall segment (0..S-1) or the pillar
    slot; ``u`` the coordinate along the surface; ``face`` the wall id or pillar face id.
    """
    bearing_W = column_bearings(width)
    x_F1 = pose_F3[:, 0:1]
    y_F1 = pose_F3[:, 1:2]
    yaw_F1 = pose_F3[:, 2:3]
    angle_FW = yaw_F1 + bearing_W
    dx_FW, dy_FW = torch.cos(angle_FW), torch.sin(angle_FW)
    inv_dx, inv_dy = _safe_inverse(dx_FW), _safe_inverse(dy_FW)

    # Walls: the camera is inside the room, so each axis has exactly one wall ahead.
    # ">= 0" matches _safe_inverse, which treats an exact 0 as a tiny positive component.
    tx = torch.where(dx_FW >= 0, ROOM_SIZE - x_F1, -x_F1) * inv_dx
    ty = torch.where(dy_FW >= 0, ROOM_SIZE - y_F1, -y_F1) * inv_dy
    hits_x_wall = tx < ty
    t_wall = torch.minimum(tx, ty)
    wall = torch.where(hits_x_wall, torch.where(dx_FW >= 0, WALL_EAST, WALL_WEST),
                       torch.where(dy_FW >= 0, WALL_NORTH, WALL_SOUTH))
    u_wall = torch.where(hits_x_wall, y_F1 + t_wall * dy_FW, x_F1 + t_wall * dx_FW)
    seg = torch.floor(u_wall).clamp(0, SEGMENTS_PER_WALL - 1)
    u_wall = u_wall - seg
    seg_index = wall * SEGMENTS_PER_WALL + seg.long()

    # Pillars: slab method, boxes [F, P, 1] against rays [F, 1, W].
    box_FP4 = st["pillar_box_P4"][scene_F]
    valid_FP1 = st["pillar_valid_P"][scene_F][:, :, None]
    x0, y0, x1, y1 = (box_FP4[:, :, k:k + 1] for k in range(4))
    xr, yr = x_F1[:, :, None], y_F1[:, :, None]
    idx, idy = inv_dx[:, None, :], inv_dy[:, None, :]
    tx0, tx1 = (x0 - xr) * idx, (x1 - xr) * idx
    ty0, ty1 = (y0 - yr) * idy, (y1 - yr) * idy
    tx_near, tx_far = torch.minimum(tx0, tx1), torch.maximum(tx0, tx1)
    ty_near, ty_far = torch.minimum(ty0, ty1), torch.maximum(ty0, ty1)
    t_near = torch.maximum(tx_near, ty_near)
    hit = valid_FP1 & (t_near <= torch.minimum(tx_far, ty_far)) & (t_near > 0)
    t_pillar_FPW = torch.where(hit, t_near, torch.full_like(t_near, math.inf))
    t_pillar, slot = t_pillar_FPW.min(dim=1)
    x_face = torch.gather(tx_near >= ty_near, 1, slot[:, None, :])[:, 0]
    # Face hit: entering through x = x0 when moving +x means the face whose normal is -x.
    face = torch.where(x_face, torch.where(dx_FW >= 0, 0, 1), torch.where(dy_FW >= 0, 2, 3))
    hit_x = x_F1 + t_pillar.clamp(max=2 * ROOM_SIZE) * dx_FW
    hit_y = y_F1 + t_pillar.clamp(max=2 * ROOM_SIZE) * dy_FW
    box_FW4 = torch.gather(box_FP4, 1, slot[:, :, None].expand(-1, -1, 4))
    u_pillar = torch.where(x_face, hit_y - box_FW4[..., 1], hit_x - box_FW4[..., 0])

    is_pillar = t_pillar < t_wall
    t = torch.where(is_pillar, t_pillar, t_wall)
    index = torch.where(is_pillar, slot, seg_index)
    u = torch.where(is_pillar, u_pillar, u_wall)
    face = torch.where(is_pillar, face, wall)
    return t, dx_FW, dy_FW, is_pillar, index, u, face


def _contrast_fade(cycles_per_pixel: Tensor) -> Tensor:
    """1 below a quarter cycle per pixel, 0 at half a cycle (Nyquist): a cheap mip-map."""
    return (2.0 - 4.0 * cycles_per_pixel).clamp(0.0, 1.0)


def _sharpen(wave: Tensor) -> Tensor:
    """Map a wave in [-1, 1] to a crisper pattern in [0, 1]."""
    return 0.5 + 0.5 * torch.tanh(2.5 * wave) / math.tanh(2.5)


def _render_frames(st: dict[str, Tensor], scene_F: Tensor, pose_F3: Tensor, size: int) -> Tensor:
    n = size * SUPERSAMPLE
    focal = (n / 2) / math.tan(math.radians(FOV_DEG) / 2)
    out_focal = focal / SUPERSAMPLE  # focal length in output pixels, for the mip fade
    # Reduce yaw in float64 first: unwrapped yaws can be large and float32 would lose bits.
    pose_F3 = pose_F3.double()
    pose_F3 = torch.stack([pose_F3[:, 0], pose_F3[:, 1], torch.remainder(pose_F3[:, 2], 2 * math.pi)], -1)
    pose_F3 = pose_F3.float()
    t_FW, dx_FW, dy_FW, is_pillar, index, u_FW, face = _cast_columns(st, scene_F, pose_F3, n)
    cos_b_W = torch.cos(column_bearings(n))
    perp_FW = t_FW * cos_b_W

    # Surface parameters per column: walls by segment, pillars as plain colored faces.
    flat = scene_F[:, None] * NUM_WALL_SEGMENTS + index.clamp(max=NUM_WALL_SEGMENTS - 1)
    pillar_flat = scene_F[:, None] * MAX_PILLARS + index.clamp(max=MAX_PILLARS - 1)
    pillar_color = st["pillar_color_P3"].reshape(-1, 3)[pillar_flat]
    wall_shade = torch.tensor(_WALL_SHADE)[face.clamp(max=3)]
    pillar_shade = torch.tensor(_PILLAR_FACE_SHADE)[face.clamp(max=3)]
    pil = is_pillar[..., None]
    color_a = torch.where(pil, pillar_color, st["wall_color_a_S3"].reshape(-1, 3)[flat])
    color_b = torch.where(pil, 0.5 * pillar_color, st["wall_color_b_S3"].reshape(-1, 3)[flat])
    zero = torch.zeros_like(perp_FW)
    freq = torch.where(is_pillar, zero, st["wall_freq_S"].reshape(-1)[flat])
    phase = torch.where(is_pillar, zero + math.pi / 2, st["wall_phase_S"].reshape(-1)[flat])
    checker = torch.where(is_pillar, zero, st["wall_checker_S"].reshape(-1)[flat])
    wdir = st["wall_dir_S2"].reshape(-1, 2)[flat]
    shade = torch.where(is_pillar, pillar_shade, wall_shade) / (1.0 + FOG * t_FW)

    # Rows: y_img is the height above the horizon in pixels (positive up), [H].
    y_H = n / 2 - (torch.arange(n, dtype=torch.float32) + 0.5)
    y_1H1 = y_H[None, :, None]
    perp_F1W = perp_FW[:, None, :]
    top = (WALL_HEIGHT - CAMERA_HEIGHT) * focal / perp_F1W
    bottom = -CAMERA_HEIGHT * focal / perp_F1W
    on_surface = (y_1H1 >= bottom) & (y_1H1 <= top)
    v = CAMERA_HEIGHT + y_1H1 * perp_F1W / focal  # height of the seen point, [F, H, W]
    u = u_FW[:, None, :]
    two_pi_f = 2 * math.pi * freq[:, None, :]
    stripes = torch.sin(two_pi_f * (wdir[:, None, :, 0] * u + wdir[:, None, :, 1] * v) + phase[:, None, :])
    checks = torch.sin(two_pi_f * u + phase[:, None, :]) * torch.sin(two_pi_f * v)
    pattern = torch.where(checker[:, None, :] > 0.5, checks, stripes)
    fade = _contrast_fade(freq * perp_FW / out_focal)[:, None, :]
    mix = 0.5 + (_sharpen(pattern) - 0.5) * fade
    surface_rgb = torch.lerp(color_b[:, None], color_a[:, None], mix[..., None]) * shade[:, None, :, None]

    # Floor: bottom half rows. Perpendicular distance from the row, then the ray length.
    half = n // 2
    y_low = y_H[half:]
    floor_perp_H = CAMERA_HEIGHT * focal / (-y_low)
    floor_t_HW = floor_perp_H[:, None] / cos_b_W[None, :]
    fx = pose_F3[:, 0, None, None] + floor_t_HW * dx_FW[:, None, :]
    fy = pose_F3[:, 1, None, None] + floor_t_HW * dy_FW[:, None, :]
    tile = st["floor_tile"][scene_F][:, None, None]
    offset = st["floor_offset_2"][scene_F]
    wave = (torch.sin(math.pi * (fx - offset[:, 0, None, None]) / tile)
            * torch.sin(math.pi * (fy - offset[:, 1, None, None]) / tile))
    # Grazing view squeezes the checker vertically by t / CAMERA_HEIGHT.
    squeeze = (floor_t_HW / CAMERA_HEIGHT).clamp(min=1.0)
    floor_fade = _contrast_fade(floor_t_HW * squeeze / (2 * tile * out_focal))
    floor_mix = 0.5 + (_sharpen(wave) - 0.5) * floor_fade
    floor_rgb = torch.lerp(st["floor_color_b_3"][scene_F][:, None, None], st["floor_color_a_3"][scene_F][:, None, None],
                           floor_mix[..., None]) / (1.0 + FOG * floor_t_HW)[None, :, :, None]

    # Ceiling: top half rows, a gradient from the horizon color to the top color.
    ramp_H1 = (y_H[:half] / (n / 2))[:, None]
    ceil_h = st["ceiling_horizon_3"][scene_F][:, None, None]
    ceil_t = st["ceiling_top_3"][scene_F][:, None, None]
    ceiling_rgb = torch.lerp(ceil_h, ceil_t, ramp_H1[None, :, :, None]).expand(-1, -1, n, -1)

    background = torch.cat([ceiling_rgb, floor_rgb], dim=1)
    image_FHW3 = torch.where(on_surface[..., None], surface_rgb, background)
    image_F3HW = image_FHW3.permute(0, 3, 1, 2)
    if SUPERSAMPLE > 1:
        image_F3HW = torch.nn.functional.avg_pool2d(image_F3HW, SUPERSAMPLE)
    return image_F3HW.clamp(0.0, 1.0).contiguous()


def render_batch(scenes: Sequence[Scene], poses: Tensor, size: int = FRAME_SIZE) -> Tensor:
    """Render clip b of ``poses`` [B, T, 3] in ``scenes[b]``; returns float32 [B, T, 3, size, size]."""
    _check_poses(poses, leading=2)
    if len(scenes) != poses.shape[0]:
        raise ValueError(f"got {len(scenes)} scenes for {poses.shape[0]} pose sequences")
    if size <= 0:
        raise ValueError(f"size must be a positive integer, got {size}")
    num_scenes, num_frames = poses.shape[0], poses.shape[1]
    if num_scenes == 0 or num_frames == 0:
        return torch.zeros(num_scenes, num_frames, 3, size, size)
    st = _stack_scenes(scenes)
    scene_F = torch.arange(num_scenes).repeat_interleave(num_frames)
    frames = _render_frames(st, scene_F, poses.reshape(-1, 3), size)
    return frames.reshape(num_scenes, num_frames, 3, size, size)


def render(scene: Scene, poses: Tensor, size: int = FRAME_SIZE) -> Tensor:
    """Render ``poses`` [T, 3] of (x, y, yaw radians) in ``scene``; float32 [T, 3, size, size] in [0, 1]."""
    _check_poses(poses, leading=1)
    return render_batch([scene], poses[None], size)[0]


def render_scenes(seeds: Sequence[int], poses: Tensor, size: int = FRAME_SIZE) -> Tensor:
    """``render_batch`` with the scenes built from ``seeds`` (one per clip)."""
    return render_batch([make_scene(s) for s in seeds], poses, size)


def column_depths(scene: Scene, poses: Tensor, width: int = FRAME_SIZE) -> Tensor:
    """Perpendicular depth of the nearest wall or pillar for each column, float32 [T, W].

    The geometry ``render`` draws (no supersampling): useful for debugging and for tests.
    """
    _check_poses(poses, leading=1)
    st = _stack_scenes([scene])
    scene_F = torch.zeros(poses.shape[0], dtype=torch.long)
    pose = poses.double()
    pose = torch.stack([pose[:, 0], pose[:, 1], torch.remainder(pose[:, 2], 2 * math.pi)], -1).float()
    t_FW = _cast_columns(st, scene_F, pose, width)[0]
    return t_FW * torch.cos(column_bearings(width))

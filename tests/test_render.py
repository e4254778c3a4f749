"""Renderer: determinism, pose dependence, conventions, and geometry against a scalar reference."""

import dataclasses
import math

import pytest
import torch

from calibrate.world.render import (
    CAMERA_RADIUS,
    CENTER,
    FOV_DEG,
    FRAME_SIZE,
    MAX_PILLARS,
    MIN_PILLARS,
    PILLAR_MIN_CENTER_DISTANCE,
    PILLAR_MIN_WALL_DISTANCE,
    PILLAR_SIZE_RANGE,
    ROOM_SIZE,
    Scene,
    column_bearings,
    column_depths,
    make_scene,
    render,
    render_batch,
    render_scenes,
)


def _random_poses(num: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = CAMERA_RADIUS * torch.rand(num, generator=g).sqrt()
    a = 2 * math.pi * torch.rand(num, generator=g)
    yaw = 20 * (torch.rand(num, generator=g) - 0.5)  # unwrapped yaws well beyond 2 pi
    return torch.stack([CENTER[0] + r * torch.cos(a), CENTER[1] + r * torch.sin(a), yaw], dim=-1)


def test_render_shape_range_dtype():
    frames = render(make_scene(0), _random_poses(5, 0))
    assert frames.shape == (5, 3, FRAME_SIZE, FRAME_SIZE)
    assert frames.dtype == torch.float32
    assert float(frames.min()) >= 0.0 and float(frames.max()) <= 1.0
    assert render(make_scene(0), _random_poses(2, 0), size=16).shape == (2, 3, 16, 16)


def test_render_is_deterministic():
    poses = _random_poses(6, 1)
    a = render(make_scene(3), poses)
    b = render(make_scene(3), poses.clone())
    assert torch.equal(a, b)
    for field in dataclasses.fields(Scene):
        x, y = getattr(make_scene(3), field.name), getattr(make_scene(3), field.name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_make_scene_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_scene(5)
    assert torch.equal(torch.rand(3), expected)


def test_turning_changes_view_a_lot_moving_a_little():
    scene = make_scene(11)
    base = torch.tensor([[4.2, 3.7, 0.3]])
    variants = torch.tensor([
        [4.2, 3.7, 0.3 + math.pi / 2],  # turn 90 deg
        [4.25, 3.7, 0.3],  # move 0.05
        [4.2, 3.7, 0.3 + 2 * math.pi],  # same view, one full turn later
    ])
    frames = render(scene, torch.cat([base, variants]))
    diff = (frames[1:] - frames[:1]).abs().mean(dim=(1, 2, 3))
    assert diff[0] > 0.05 and diff[0] > 5 * diff[1], diff
    assert 0.0 < diff[1] < 0.02, diff
    assert diff[2] < 1e-5, diff


def test_image_change_grows_with_motion():
    scene = make_scene(2)
    steps = torch.tensor([0.02, 0.05, 0.2, 0.5])
    poses = torch.stack([4.0 + torch.cat([torch.zeros(1), steps]), torch.full((5,), 3.8), torch.full((5,), 1.0)], -1)
    frames = render(scene, poses)
    diff = (frames[1:] - frames[:1]).abs().mean(dim=(1, 2, 3))
    assert torch.all(diff[1:] > diff[:-1]), diff


def test_seeds_give_different_scenes():
    poses = _random_poses(8, 2)
    frames = render_scenes([0, 1, 2], poses.expand(3, -1, -1))
    for a, b in [(0, 1), (0, 2), (1, 2)]:
        assert (frames[a] - frames[b]).abs().mean() > 0.05


def test_render_batch_matches_per_scene_render():
    poses = _random_poses(8, 3).reshape(2, 4, 3)
    scenes = [make_scene(7), make_scene(8)]
    batched = render_batch(scenes, poses)
    for b in range(2):
        torch.testing.assert_close(batched[b], render(scenes[b], poses[b]), atol=1e-5, rtol=0)


def test_column_bearings_convention():
    for width in (1, 7, 32, 64):
        b = column_bearings(width)
        assert b.shape == (width,)
        torch.testing.assert_close(b, -b.flip(0), atol=1e-7, rtol=0)
        assert float(b.abs().max()) < math.radians(FOV_DEG) / 2
    b = column_bearings(32)
    assert b[0] > 0 > b[-1]  # left column looks counter-clockwise of the yaw
    assert torch.all(b[1:] < b[:-1])
    # Pinhole: tan(bearing) is linear in the column center.
    torch.testing.assert_close(torch.tan(b[1:]) - torch.tan(b[:-1]), torch.full((31,), -2 / 32), atol=1e-6, rtol=0)


def test_left_columns_look_counter_clockwise():
    scene = dataclasses.replace(make_scene(0), pillar_valid_P=torch.zeros(MAX_PILLARS, dtype=torch.bool))
    # Looking along +x near the north wall: left (counter-clockwise) rays hit the north wall early.
    depth = column_depths(scene, torch.tensor([[6.0, 7.0, 0.0]]))[0]
    assert depth[0] < 1.5 and abs(float(depth[-1]) - 2.0) < 1e-5


def _reference_depth(scene: Scene, x: float, y: float, yaw: float, bearing: float) -> float:
    """Scalar ray-segment intersection against every wall and box edge (no slab method)."""
    segments = [((0, 0), (ROOM_SIZE, 0)), ((ROOM_SIZE, 0), (ROOM_SIZE, ROOM_SIZE)),
                ((ROOM_SIZE, ROOM_SIZE), (0, ROOM_SIZE)), ((0, ROOM_SIZE), (0, 0))]
    for (x0, y0, x1, y1), valid in zip(scene.pillar_box_P4.tolist(), scene.pillar_valid_P.tolist()):
        if valid:
            segments += [((x0, y0), (x1, y0)), ((x1, y0), (x1, y1)), ((x1, y1), (x0, y1)), ((x0, y1), (x0, y0))]
    dx, dy = math.cos(yaw + bearing), math.sin(yaw + bearing)
    best = math.inf
    for (ax, ay), (bx, by) in segments:
        ex, ey = bx - ax, by - ay
        denom = dx * ey - dy * ex
        if abs(denom) < 1e-12:
            continue
        t = ((ax - x) * ey - (ay - y) * ex) / denom
        s = ((ax - x) * dy - (ay - y) * dx) / denom
        if t > 0 and -1e-9 <= s <= 1 + 1e-9:
            best = min(best, t)
    return best * math.cos(bearing)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_column_depths_match_scalar_reference(seed):
    scene = make_scene(seed)
    poses = _random_poses(6, 10 + seed)
    width = 24
    half_tan = math.tan(math.radians(FOV_DEG) / 2)
    bearings = [math.atan((1 - 2 * (i + 0.5) / width) * half_tan) for i in range(width)]
    depth = column_depths(scene, poses, width)
    for t, (x, y, yaw) in enumerate(poses.tolist()):
        expected = torch.tensor([_reference_depth(scene, x, y, yaw, b) for b in bearings])
        torch.testing.assert_close(depth[t].double(), expected.double(), rtol=1e-4, atol=1e-4)


def test_pillars_respect_placement_rules():
    lo, hi = PILLAR_SIZE_RANGE
    for seed in range(60):
        scene = make_scene(seed)
        assert MIN_PILLARS <= scene.num_pillars <= MAX_PILLARS
        for x0, y0, x1, y1 in scene.pillar_box_P4[: scene.num_pillars].tolist():
            assert lo - 1e-6 <= x1 - x0 <= hi + 1e-6 and lo - 1e-6 <= y1 - y0 <= hi + 1e-6
            assert min(x0, y0) >= PILLAR_MIN_WALL_DISTANCE - 1e-5
            assert max(x1, y1) <= ROOM_SIZE - PILLAR_MIN_WALL_DISTANCE + 1e-5
            nearest = math.hypot(max(x0 - CENTER[0], 0, CENTER[0] - x1), max(y0 - CENTER[1], 0, CENTER[1] - y1))
            assert nearest >= PILLAR_MIN_CENTER_DISTANCE - 1e-5


@pytest.mark.parametrize(
    "poses, match",
    [
        (torch.zeros(4, 2), "shape"),
        (torch.zeros(2, 4, 3), "shape"),
        (torch.tensor([[4.0, 4.0, float("nan")]]), "non-finite"),
        (torch.tensor([[4.0, float("inf"), 0.0]]), "non-finite"),
        (torch.tensor([[-1.0, 4.0, 0.0]]), "inside the room"),
    ],
)
def test_render_rejects_bad_poses(poses, match):
    with pytest.raises(ValueError, match=match):
        render(make_scene(0), poses)


def test_render_batch_rejects_scene_count_mismatch():
    with pytest.raises(ValueError, match="scenes"):
        render_batch([make_scene(0)], torch.full((2, 3, 3), 4.0))

"""Trajectory families: invariants every family promises, revisit pairs, file round trip."""

import json
import math
import os

import pytest
import torch
from safetensors.torch import save_file

from calibrate.world.render import CAMERA_RADIUS, CENTER
from calibrate.world.trajectories import (
    FAMILIES,
    FORMAT,
    FORMAT_VERSION,
    MAX_EPISODE_FRAMES,
    SEED_RANGES,
    STEP_LIMITS,
    Trajectory,
    actions_from_poses,
    apply_action,
    leg_labels,
    load_trajectories,
    make_trajectories,
    make_trajectory,
    revisit_pairs,
    save_trajectories,
    split_of,
    wrap_angle,
)

NUM_FRAMES = 200


def _steps(poses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step move (units) and |dyaw| (degrees), [T - 1] each."""
    p = poses.double()
    move = (p[1:, :2] - p[:-1, :2]).norm(dim=-1)
    turn = torch.rad2deg(wrap_angle(p[1:, 2] - p[:-1, 2]).abs())
    return move, turn


@pytest.mark.parametrize("family", FAMILIES)
def test_family_shapes_determinism_and_seed_dependence(family):
    traj = make_trajectory(family, 17, NUM_FRAMES)
    assert traj.family == family and traj.seed == 17 and traj.num_frames == NUM_FRAMES
    assert traj.poses.shape == traj.actions.shape == (NUM_FRAMES, 3)
    assert traj.poses.dtype == traj.actions.dtype == torch.float32
    again = make_trajectory(family, 17, NUM_FRAMES)
    assert torch.equal(traj.poses, again.poses) and torch.equal(traj.actions, again.actions)
    assert not torch.equal(traj.poses, make_trajectory(family, 18, NUM_FRAMES).poses)
    # A shorter trajectory is not required to be a prefix, but it must be valid on its own.
    assert make_trajectory(family, 17, 1).poses.shape == (1, 3)


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_stay_in_camera_disk(family):
    for seed in range(8):
        p = make_trajectory(family, seed, NUM_FRAMES).poses.double()
        radius = (p[:, :2] - torch.tensor(CENTER, dtype=torch.float64)).norm(dim=-1)
        assert float(radius.max()) <= CAMERA_RADIUS + 1e-6


@pytest.mark.parametrize("family", FAMILIES)
def test_steps_bounded_except_snaps(family):
    max_move, max_turn = STEP_LIMITS[family]
    for seed in range(8):
        traj = make_trajectory(family, seed, NUM_FRAMES)
        move, turn = _steps(traj.poses)
        over = (move > max_move + 1e-5) | (turn > max_turn + 1e-3)
        snap_frames = {int(i) + 1 for i in torch.nonzero(over).flatten()}
        if family == "revisit":  # a snap is always an exact return to an earlier pose
            assert snap_frames <= {t for t, _ in revisit_pairs(traj)}
        elif family == "stress":
            assert len(snap_frames) <= 0.1 * NUM_FRAMES
        else:
            assert not snap_frames, (seed, sorted(snap_frames))


@pytest.mark.parametrize("family", FAMILIES)
def test_actions_reproduce_poses(family):
    for seed in range(4):
        traj = make_trajectory(family, seed, NUM_FRAMES)
        assert torch.equal(traj.actions[0], torch.zeros(3))
        dyaw = traj.actions[:, 2]
        assert float(dyaw.min()) > -math.pi - 1e-6 and float(dyaw.max()) <= math.pi + 1e-6
        stepped = apply_action(traj.poses[:-1].double(), traj.actions[1:].double())
        expected = traj.poses[1:].double()
        torch.testing.assert_close(stepped[:, :2], expected[:, :2], atol=1e-4, rtol=0)
        assert float(wrap_angle(stepped[:, 2] - expected[:, 2]).abs().max()) < 1e-4


def test_actions_from_poses_inverts_apply_action():
    g = torch.Generator().manual_seed(0)
    pose = torch.rand(50, 3, generator=g, dtype=torch.float64) * torch.tensor([2.0, 2.0, 20.0])
    action = (torch.rand(50, 3, generator=g, dtype=torch.float64) - 0.5) * torch.tensor([0.4, 0.4, 2.0])
    moved = apply_action(pose, action)
    recovered = actions_from_poses(torch.stack([pose, moved], dim=1).reshape(-1, 3)).reshape(50, 2, 3)[:, 1]
    torch.testing.assert_close(recovered, action, atol=1e-12, rtol=0)


def test_continuous_families_keep_yaw_unwrapped():
    for family in ("orbit", "dolly", "pan", "random_walk"):
        p = make_trajectory(family, 3, 400).poses.double()
        assert float((p[1:, 2] - p[:-1, 2]).abs().max()) <= math.radians(STEP_LIMITS[family][1]) + 1e-4


def test_orbit_turns_at_least_two_degrees_per_frame():
    p = make_trajectory("orbit", 4, 50).poses.double()
    angle = torch.atan2(p[:, 1] - CENTER[1], p[:, 0] - CENTER[0])
    step = torch.rad2deg(wrap_angle(angle[1:] - angle[:-1]).abs())
    assert float(step.min()) >= 2.0 - 1e-3 and float(step.max()) <= 5.0 + 1e-3


def test_static_and_pan_keep_position():
    for family in ("static", "pan"):
        p = make_trajectory(family, 9, 64).poses
        assert torch.equal(p[:, :2], p[:1, :2].expand(64, -1))
    p = make_trajectory("static", 9, 64).poses
    assert torch.equal(p, p[:1].expand(64, -1))


def test_revisit_pairs_on_64_frames():
    kinds = set()
    for seed in range(10):
        traj = make_trajectory("revisit", seed, 64)
        pairs = revisit_pairs(traj)
        assert pairs, seed
        p = traj.poses.double()
        move, turn = _steps(traj.poses)
        for t, s in pairs:
            assert 0 <= s < t - 1 and t - s <= MAX_EPISODE_FRAMES
            assert float((p[t] - p[s]).abs().max()) <= 1e-6
            between = p[s + 1:t]
            away = (torch.rad2deg(wrap_angle(between[:, 2] - p[s, 2]).abs()) > 60) | \
                   ((between[:, :2] - p[s, :2]).norm(dim=-1) > 0.4)
            assert bool(away.any())
            kinds.add("snap" if float(turn[t - 1]) > 60 or float(move[t - 1]) > 0.4 else "retrace")
        labels = leg_labels(traj)
        assert len(labels) == 64 and {"outbound", "return"} <= set(labels)
        assert labels[pairs[0][0]] == "return"
    assert kinds == {"snap", "retrace"}


def test_revisit_pairs_empty_without_returns():
    assert revisit_pairs(make_trajectory("static", 1, 64)) == []  # never away
    assert revisit_pairs(make_trajectory("dolly", 1, 64)) == []
    assert set(leg_labels(make_trajectory("static", 1, 64))) == {"other"}


def test_seed_splits_and_make_trajectories():
    assert list(SEED_RANGES) == ["train", "calibration", "evaluation"]
    assert split_of(0) == "train" and split_of(999_999) == "train"
    assert split_of(1_000_000) == "calibration" and split_of(2_500_000) == "evaluation"
    with pytest.raises(ValueError, match="outside"):
        split_of(3_000_000)
    trajs = make_trajectories(["orbit", "revisit"], "calibration", 5, 16, base_seed=10)
    assert [t.family for t in trajs] == ["orbit", "revisit", "orbit", "revisit", "orbit"]
    assert [t.seed for t in trajs] == [1_000_010 + i for i in range(5)]
    assert all(split_of(t.seed) == "calibration" and t.num_frames == 16 for t in trajs)
    assert torch.equal(trajs[1].poses, make_trajectory("revisit", 1_000_011, 16).poses)
    assert [t.family for t in make_trajectories("pan", "train", 2, 4)] == ["pan", "pan"]
    with pytest.raises(ValueError, match="split"):
        make_trajectories("pan", "test", 1, 4)
    with pytest.raises(ValueError, match="overflow"):
        make_trajectories("pan", "evaluation", 2, 4, base_seed=999_999)


@pytest.mark.parametrize(
    "family, num_frames, match",
    [("spiral", 10, "spiral.*allowed: orbit"), ("orbit", 0, "num_frames.*0"), ("orbit", -3, "-3")],
)
def test_bad_arguments(family, num_frames, match):
    with pytest.raises(ValueError, match=match):
        make_trajectory(family, 0, num_frames)


def test_trajectory_rejects_mismatched_tensors():
    with pytest.raises(ValueError, match="actions shape"):
        Trajectory("orbit", 0, torch.zeros(4, 3), torch.zeros(3, 3))


def test_save_load_round_trip(tmp_path):
    trajs = [make_trajectory(f, 100 + i, 8 + i) for i, f in enumerate(FAMILIES)]
    path = tmp_path / "trajs.safetensors"
    save_trajectories(path, trajs)
    assert os.listdir(tmp_path) == ["trajs.safetensors"]  # no temp file left behind
    loaded = load_trajectories(path)
    assert len(loaded) == len(trajs)
    for a, b in zip(trajs, loaded):
        assert (a.family, a.seed, a.num_frames) == (b.family, b.seed, b.num_frames)
        assert torch.equal(a.poses, b.poses) and torch.equal(a.actions, b.actions)
    save_trajectories(path, [])  # overwrite in place
    assert load_trajectories(path) == []


def _write(path, tensors, meta):
    save_file(tensors, str(path), metadata=meta)


def _valid_file_parts():
    traj = make_trajectory("orbit", 1, 4)
    tensors = {"0.poses": traj.poses, "0.actions": traj.actions}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "num_trajectories": "1",
            "0.meta": json.dumps({"family": "orbit", "seed": 1, "num_frames": 4})}
    return tensors, meta


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda t, m: m.update(format="something-else"), "format"),
        (lambda t, m: m.update(format_version="2.0"), "format_version"),
        (lambda t, m: t.pop("0.actions"), "missing.*0.actions"),
        (lambda t, m: t.update({"0.poses": torch.zeros(5, 3)}), "0.poses"),
        (lambda t, m: t.update({"0.actions": torch.full((4, 3), float("nan"))}), "0.actions.*non-finite"),
        (lambda t, m: m.update({"0.meta": json.dumps({"family": "spiral", "seed": 1, "num_frames": 4})}), "spiral"),
        (lambda t, m: m.pop("0.meta"), "0.meta"),
    ],
)
def test_load_rejects_bad_files(tmp_path, mutate, match):
    tensors, meta = _valid_file_parts()
    mutate(tensors, meta)
    path = tmp_path / "bad.safetensors"
    _write(path, tensors, meta)
    with pytest.raises(ValueError, match=match) as info:
        load_trajectories(path)
    assert str(path) in str(info.value)


def test_load_rejects_non_safetensors_and_truncated(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="junk.safetensors"):
        load_trajectories(junk)
    good = tmp_path / "good.safetensors"
    save_trajectories(good, [make_trajectory("orbit", 1, 64)])
    data = good.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="truncated.safetensors"):
        load_trajectories(truncated)


def test_long_revisit_returns_after_long_wanders():
    """long_revisit: every return is to a pose seen >= 64 frames before, snaps are returns, steps
    stay within limits elsewhere, positions stay in the disk; it is not in the default FAMILIES."""
    from calibrate.types import ALL_FAMILIES
    from calibrate.world.trajectories import LONG_AWAY_FRAMES

    assert "long_revisit" not in FAMILIES and "long_revisit" in ALL_FAMILIES
    max_move, max_turn = STEP_LIMITS["long_revisit"]
    kinds = set()
    for seed in range(6):
        traj = make_trajectory("long_revisit", 2_000_000 + seed, 600)
        p = traj.poses.double()
        radius = (p[:, :2] - torch.tensor(CENTER, dtype=torch.float64)).norm(dim=-1)
        assert float(radius.max()) <= CAMERA_RADIUS + 1e-6
        pairs = revisit_pairs(traj)
        assert pairs and all(t - s >= LONG_AWAY_FRAMES[0] for t, s in pairs), seed
        move, turn = _steps(traj.poses)
        over = {int(i) + 1 for i in torch.nonzero((move > max_move + 1e-5) | (turn > max_turn + 1e-3)).flatten()}
        assert over <= {t for t, _ in pairs}
        for t, _ in pairs:
            if t - 1 not in {u for u, _ in pairs}:  # the frame the camera comes back at
                kinds.add("snap" if t in over else "gradual")
    assert kinds == {"snap", "gradual"}
    assert torch.equal(make_trajectory("long_revisit", 5, 300).poses, make_trajectory("long_revisit", 5, 300).poses)

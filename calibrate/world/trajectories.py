"""Camera trajectory families for TinyWorld, deterministic from (family, seed, num_frames).

A trajectory is a sequence of camera poses ``(x, y, yaw)`` in the room of ``render.py``
(x right, y up, yaw in radians, counter-clockwise, *unwrapped*: it never jumps by 2 pi)
plus the actions that connect them. The action of frame t is the motion from frame t - 1
to frame t expressed in the camera frame of t - 1::

    forward     =  dx cos(yaw_prev) + dy sin(yaw_prev)
    strafe_left = -dx sin(yaw_prev) + dy cos(yaw_prev)
    dyaw        =  yaw - yaw_prev wrapped to (-pi, pi]

and row 0 is zeros. ``apply_action`` is the exact inverse (up to float rounding and, for
yaw, a multiple of 2 pi), so actions are always consistent with poses, including snaps.

The scene of a trajectory is ``make_scene(seed)``: the seed picks both the room and the
path. Seeds are partitioned so that fitting never sees evaluation rooms::

    train        [0, 1_000_000)          training TinyWorld
    calibration  [1_000_000, 2_000_000)  statistics and fitting of quantization parameters
    evaluation   [2_000_000, 3_000_000)  held-out reports

Families (every position stays within ``CAMERA_RADIUS`` of ``CENTER``; per-frame motion
stays within ``STEP_LIMITS[family]`` except at snaps):

- ``orbit``: circle of radius 0.8-1.8 around the center at 2-5 deg/frame, either direction,
  looking inward or along the motion, with a fixed offset of up to 20 deg.
- ``dolly``: move along the view direction at 0.05-0.12 units/frame, reversing at the
  boundary, with a slowly wandering yaw drift (< 1 deg/frame).
- ``pan``: fixed position; yaw sweeps back and forth at 3-8 deg/frame (triangle or sine).
- ``revisit``: the memory test. From a home pose, an episode turns away by 90-180 deg or
  walks out 0.5-1.5 units over 2-8 frames, dwells 0-3 frames, and comes back to *exactly*
  the home pose, either retracing its path or in one snap. An episode spans at most
  ``MAX_EPISODE_FRAMES`` frames, so the home frame is still in a 16-frame cache window when
  it is revisited. Between episodes the camera may rest and the home pose may drift. Snaps
  (the only steps beyond the limits) are return frames of ``revisit_pairs``.
- ``random_walk``: a sticky Markov chain over {forward, back, turn_left, turn_right, strafe,
  idle} with magnitudes 0.05-0.1 units or 3-8 deg, integrated with ``apply_action``; at the
  boundary the position is projected back inside and the chain switches to a turn.
- ``stress``: 10-25 deg/frame turns and up to 0.29 units/frame moves that reverse abruptly
  every 3-12 frames, plus occasional snaps (3% of frames) to a random pose.
- ``static``: one pose held for every frame.
- ``long_revisit`` (made on request only: not in ``FAMILIES``, the default sets): memory far beyond
  a 16-frame window. The camera looks around at a place (a yaw sweep of 30-75 deg each side of
  its heading, <= 8 deg/frame), then wanders away for 64-512 frames (log-uniform; smooth motion
  at 0.03-0.08 units/frame, turning <= 8 deg/frame, turning toward the center at the boundary), sometimes looks around at where it ended up
  (a new place), then returns to a place looked around at least ``LONG_AWAY_FRAMES[0]`` frames
  earlier - in one snap, or gradually along a straight line (<= 0.08 units and 8 deg per frame)
  - and replays that look-around's poses exactly, so every replayed frame is a return. Yaw is
  unwrapped except where a return lands on the earlier pose's value (a multiple of 2 pi away;
  actions are wrapped, so the model sees the small turn).

``revisit_pairs`` finds (return_frame, earlier_frame) pairs for any trajectory and
``leg_labels`` derives per-frame outbound/return labels from them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from calibrate.io import read_versioned, safetensors_bytes, write_bytes_atomic
from calibrate.types import ALL_FAMILIES, FAMILIES, Trajectory, check_family  # noqa: F401 (FAMILIES: re-exported)
from calibrate.world.render import CAMERA_RADIUS, CENTER

SEED_RANGES = {
    "train": (0, 1_000_000),
    "calibration": (1_000_000, 2_000_000),
    "evaluation": (2_000_000, 3_000_000),
}
# Largest per-frame (move in units, |dyaw| in degrees) of each family away from snaps.
STEP_LIMITS = {
    "orbit": (0.16, 5.0),
    "dolly": (0.12, 1.0),
    "pan": (0.0, 8.0),
    "revisit": (0.3, 90.0),
    "random_walk": (0.1, 8.0),
    "stress": (0.3, 25.0),
    "static": (0.0, 0.0),
    "long_revisit": (0.1, 10.0),
}
MAX_EPISODE_FRAMES = 14  # frames from leaving home to being back, inclusive of the return
REVISIT_AWAY_YAW_DEG = 60.0
REVISIT_AWAY_DISTANCE = 0.4
POSE_MATCH_TOL = 1e-6
LONG_AWAY_FRAMES = (64, 512)  # long_revisit: frames of one wander (log-uniform), the least gap of a return
FORMAT = "tinyworld-trajectories"
FORMAT_VERSION = "1.0"

# Generation keeps this margin inside CAMERA_RADIUS so float32 rounding never leaves it.
_RADIUS = CAMERA_RADIUS - 1e-3
_Pose = tuple[float, float, float]


def split_of(seed: int) -> str:
    """Name of the seed range holding ``seed`` (see the module docstring)."""
    for name, (lo, hi) in SEED_RANGES.items():
        if lo <= seed < hi:
            return name
    raise ValueError(f"seed {seed} is outside every seed range {SEED_RANGES}")


def wrap_angle(angle: Tensor) -> Tensor:
    """Wrap radians to (-pi, pi]."""
    return angle - 2 * math.pi * torch.ceil((angle - math.pi) / (2 * math.pi))


def actions_from_poses(poses: Tensor) -> Tensor:
    """Camera-frame motion into each frame from the previous one, [T, 3]; row 0 is zeros."""
    p = poses.double()
    prev, cur = p[:-1], p[1:]
    c, s = torch.cos(prev[:, 2]), torch.sin(prev[:, 2])
    dx, dy = cur[:, 0] - prev[:, 0], cur[:, 1] - prev[:, 1]
    steps = torch.stack([dx * c + dy * s, -dx * s + dy * c, wrap_angle(cur[:, 2] - prev[:, 2])], dim=-1)
    return torch.cat([torch.zeros(1, 3, dtype=torch.float64), steps]).to(poses.dtype)


def apply_action(pose: Tensor, action: Tensor) -> Tensor:
    """Move ``pose`` [..., 3] by ``action`` [..., 3] (the inverse of ``actions_from_poses``)."""
    yaw = pose[..., 2]
    c, s = torch.cos(yaw), torch.sin(yaw)
    fwd, left, dyaw = action.unbind(-1)
    return torch.stack([pose[..., 0] + fwd * c - left * s, pose[..., 1] + fwd * s + left * c, yaw + dyaw], dim=-1)


class _Draws:
    """Uniform numbers from a local generator, fetched in blocks so Python loops stay fast."""

    def __init__(self, seed: int) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._buffer: list[float] = []

    def uniform(self, lo: float = 0.0, hi: float = 1.0) -> float:
        if not self._buffer:
            self._buffer = torch.rand(256, generator=self._gen, dtype=torch.float64).tolist()[::-1]
        return lo + (hi - lo) * self._buffer.pop()

    def integer(self, lo: int, hi: int) -> int:
        """Uniform integer in [lo, hi]."""
        return lo + min(int(self.uniform() * (hi - lo + 1)), hi - lo)

    def sign(self) -> float:
        return 1.0 if self.uniform() < 0.5 else -1.0

    def chance(self, p: float) -> bool:
        return self.uniform() < p

    def point_in_disk(self, radius: float) -> tuple[float, float]:
        r, a = radius * math.sqrt(self.uniform()), self.uniform(0.0, 2 * math.pi)
        return CENTER[0] + r * math.cos(a), CENTER[1] + r * math.sin(a)


def _inside(x: float, y: float) -> bool:
    return math.hypot(x - CENTER[0], y - CENTER[1]) <= _RADIUS


def _project_inside(x: float, y: float) -> tuple[float, float]:
    """Nearest point of the camera disk (non-expansive, so steps never grow)."""
    r = math.hypot(x - CENTER[0], y - CENTER[1])
    if r <= _RADIUS:
        return x, y
    return CENTER[0] + (x - CENTER[0]) * _RADIUS / r, CENTER[1] + (y - CENTER[1]) * _RADIUS / r


def _step(pose: _Pose, forward: float, left: float, dyaw: float) -> _Pose:
    x, y, yaw = pose
    c, s = math.cos(yaw), math.sin(yaw)
    return x + forward * c - left * s, y + forward * s + left * c, yaw + dyaw


def _orbit(rng: _Draws, num_frames: int) -> list[_Pose]:
    radius = rng.uniform(0.8, 1.8)
    speed = math.radians(rng.uniform(2.0, 5.0)) * rng.sign()
    phi0 = rng.uniform(0.0, 2 * math.pi)
    # Inward looks at the center; tangential looks along the direction of motion.
    facing = math.pi if rng.chance(0.5) else math.copysign(math.pi / 2, speed)
    offset = math.radians(rng.uniform(-20.0, 20.0))
    poses = []
    for t in range(num_frames):
        phi = phi0 + speed * t
        poses.append((CENTER[0] + radius * math.cos(phi), CENTER[1] + radius * math.sin(phi), phi + facing + offset))
    return poses


def _dolly(rng: _Draws, num_frames: int) -> list[_Pose]:
    x, y = rng.point_in_disk(0.8 * _RADIUS)
    yaw = rng.uniform(-math.pi, math.pi)
    speed = rng.uniform(0.05, 0.12) * rng.sign()
    drift = math.radians(rng.uniform(-0.8, 0.8))
    poses = [(x, y, yaw)]
    for _ in range(1, num_frames):
        drift = max(-math.radians(0.9), min(math.radians(0.9), drift + math.radians(rng.uniform(-0.1, 0.1))))
        yaw += drift
        if not _inside(x + speed * math.cos(yaw), y + speed * math.sin(yaw)):
            speed = -speed  # reverse at the boundary
        x, y = _project_inside(x + speed * math.cos(yaw), y + speed * math.sin(yaw))
        poses.append((x, y, yaw))
    return poses


def _pan(rng: _Draws, num_frames: int) -> list[_Pose]:
    x, y = rng.point_in_disk(_RADIUS)
    yaw0 = rng.uniform(-math.pi, math.pi)
    speed = math.radians(rng.uniform(3.0, 8.0))
    half_sweep = math.radians(rng.uniform(20.0, 90.0))
    if rng.chance(0.5):  # sine: peak angular speed is `speed`
        return [(x, y, yaw0 + half_sweep * math.sin(speed * t / half_sweep)) for t in range(num_frames)]
    offset, velocity = 0.0, speed * rng.sign()  # triangle wave between +-half_sweep
    poses = []
    for _ in range(num_frames):
        poses.append((x, y, yaw0 + offset))
        if abs(offset + velocity) > half_sweep:
            velocity = -velocity
        offset += velocity
    return poses


def _revisit_episode(rng: _Draws, home: _Pose) -> list[_Pose]:
    """Frames after ``home`` up to and including the exact return to it."""
    snap = rng.chance(0.5)
    dwell = rng.integer(0, 3)
    max_out = MAX_EPISODE_FRAMES - dwell - 1 if snap else (MAX_EPISODE_FRAMES - dwell) // 2
    if rng.chance(0.6):  # turn away in place
        move, turn, min_out = 0.0, math.radians(rng.uniform(90.0, 180.0)) * rng.sign(), 2
        heading = 0.0
    else:  # walk out, turning a little
        move, turn = rng.uniform(0.5, 1.5), math.radians(rng.uniform(-30.0, 30.0))
        min_out = max(2, math.ceil(move / STEP_LIMITS["revisit"][0]))
        heading = rng.uniform(0.0, 2 * math.pi)
        for _ in range(16):
            if _inside(home[0] + move * math.cos(heading), home[1] + move * math.sin(heading)):
                break
            heading = rng.uniform(0.0, 2 * math.pi)
        else:  # toward the center always fits: move <= 1.5 < CAMERA_RADIUS
            heading = math.atan2(CENTER[1] - home[1], CENTER[0] - home[0])
    num_out = rng.integer(min_out, min(8, max_out))
    out = []
    for k in range(1, num_out + 1):
        frac = k / num_out
        out.append((home[0] + frac * move * math.cos(heading), home[1] + frac * move * math.sin(heading),
                    home[2] + frac * turn))
    back = [home] if snap else out[-2::-1] + [home]
    return out + [out[-1]] * dwell + back


def _revisit(rng: _Draws, num_frames: int) -> list[_Pose]:
    x, y = rng.point_in_disk(0.75 * _RADIUS)
    home = (x, y, rng.uniform(-math.pi, math.pi))
    poses = [home]
    while len(poses) < num_frames:
        poses.extend(_revisit_episode(rng, home))
        poses.extend([home] * rng.integer(0, 2))
        dyaw = math.radians(rng.uniform(-3.0, 3.0))
        dist, heading = rng.uniform(0.0, 0.04), rng.uniform(0.0, 2 * math.pi)
        for _ in range(rng.integer(0, 4)):  # slow drift of the home pose
            hx, hy = _project_inside(home[0] + dist * math.cos(heading), home[1] + dist * math.sin(heading))
            home = (hx, hy, home[2] + dyaw)
            poses.append(home)
    return poses[:num_frames]


_WALK_STATES = ("forward", "back", "turn_left", "turn_right", "strafe", "idle")


def _random_walk(rng: _Draws, num_frames: int) -> list[_Pose]:
    x, y = rng.point_in_disk(_RADIUS)
    pose = (x, y, rng.uniform(-math.pi, math.pi))
    stay = rng.uniform(0.75, 0.92)

    def enter(state: str) -> tuple[float, float, float]:
        move, turn = rng.uniform(0.05, 0.1), math.radians(rng.uniform(3.0, 8.0))
        return {
            "forward": (move, 0.0, 0.0),
            "back": (-move, 0.0, 0.0),
            "turn_left": (0.0, 0.0, turn),
            "turn_right": (0.0, 0.0, -turn),
            "strafe": (0.0, move * rng.sign(), 0.0),
            "idle": (0.0, 0.0, 0.0),
        }[state]

    state = _WALK_STATES[rng.integer(0, len(_WALK_STATES) - 1)]
    action = enter(state)
    poses = [pose]
    for _ in range(1, num_frames):
        if not rng.chance(stay):
            others = [s for s in _WALK_STATES if s != state]
            state = others[rng.integer(0, len(others) - 1)]
            action = enter(state)
        x, y, yaw = _step(pose, *action)
        if not _inside(x, y):  # bounce: stop at the boundary and turn away
            x, y = _project_inside(x, y)
            state = "turn_left" if rng.chance(0.5) else "turn_right"
            action = enter(state)
        pose = (x, y, yaw)
        poses.append(pose)
    return poses


def _stress(rng: _Draws, num_frames: int) -> list[_Pose]:
    x, y = rng.point_in_disk(_RADIUS)
    pose = (x, y, rng.uniform(-math.pi, math.pi))
    turn, forward, left, countdown = rng.sign(), rng.sign(), 0.0, 0
    poses = [pose]
    for _ in range(1, num_frames):
        if countdown == 0:  # abrupt reversal of turn and motion
            turn = -math.copysign(math.radians(rng.uniform(10.0, 25.0)), turn)
            forward = -math.copysign(rng.uniform(0.05, 0.25), forward)
            left = rng.uniform(-0.15, 0.15)
            countdown = rng.integer(3, 12)
        countdown -= 1
        if rng.chance(0.03):  # snap to an unrelated pose
            x, y = rng.point_in_disk(_RADIUS)
            pose = (x, y, pose[2] + rng.uniform(-math.pi, math.pi))
        else:
            x, y, yaw = _step(pose, forward, left, turn)
            if not _inside(x, y):
                x, y = _project_inside(x, y)
                forward = -forward
            pose = (x, y, yaw)
        poses.append(pose)
    return poses


def _static(rng: _Draws, num_frames: int) -> list[_Pose]:
    x, y = rng.point_in_disk(_RADIUS)
    return [(x, y, rng.uniform(-math.pi, math.pi))] * num_frames


def _look_around(rng: _Draws, pose: _Pose) -> list[_Pose]:
    """A yaw sweep at one place, starting at ``pose``: 2a (a = 30-75 deg) in steps <= 8 deg."""
    sweep = 2 * math.radians(rng.uniform(30.0, 75.0)) * rng.sign()
    n = max(6, math.ceil(abs(sweep) / math.radians(8.0)) + 1)
    return [(pose[0], pose[1], pose[2] + sweep * k / (n - 1)) for k in range(n)]


def _wander(rng: _Draws, pose: _Pose, num_frames: int) -> list[_Pose]:
    """``num_frames`` frames of smooth motion along the view direction after ``pose``: speed and
    turn rate redrawn every 8-24 frames; at the disk boundary it stops and turns toward the
    center at 8 deg/frame until it faces within 45 deg of it."""
    poses, countdown, speed, rate, turning = [], 0, 0.0, 0.0, False
    for _ in range(num_frames):
        if turning:
            to_center = math.atan2(CENTER[1] - pose[1], CENTER[0] - pose[0])
            off = math.remainder(to_center - pose[2], 2 * math.pi)
            turning = abs(off) > math.radians(45.0)
            if turning:
                pose = (pose[0], pose[1], pose[2] + math.copysign(math.radians(8.0), off))
                poses.append(pose)
                continue
            countdown = 0
        if countdown == 0:
            speed, rate = rng.uniform(0.03, 0.08), math.radians(rng.uniform(-6.0, 6.0))
            countdown = rng.integer(8, 24)
        countdown -= 1
        x, y, yaw = _step(pose, speed, 0.0, rate)
        if not _inside(x, y):
            x, y = _project_inside(x, y)
            turning = True
        pose = (x, y, yaw)
        poses.append(pose)
    return poses


def _return_to(rng: _Draws, pose: _Pose, target: _Pose) -> list[_Pose]:
    """Frames after ``pose`` up to exactly ``target``: one snap, or a straight walk (the yaw the
    short way round) in steps <= 0.08 units and 8 deg whose last frame is ``target`` itself."""
    if rng.chance(0.5):
        return [target]
    dx, dy = target[0] - pose[0], target[1] - pose[1]
    dyaw = math.remainder(target[2] - pose[2], 2 * math.pi)
    n = max(4, math.ceil(math.hypot(dx, dy) / 0.08), math.ceil(abs(dyaw) / math.radians(8.0)))
    return [(pose[0] + dx * k / n, pose[1] + dy * k / n, pose[2] + dyaw * k / n) for k in range(1, n)] + [target]


def _long_revisit(rng: _Draws, num_frames: int) -> list[_Pose]:
    x, y = rng.point_in_disk(0.75 * _RADIUS)
    poses = [(x, y, rng.uniform(-math.pi, math.pi))]
    places: list[tuple[int, int]] = []  # [first, stop) frames of each look-around

    def look_around() -> None:
        first = len(poses) - 1
        poses.extend(_look_around(rng, poses[-1])[1:])
        places.append((first, len(poses)))

    look_around()
    lo, hi = LONG_AWAY_FRAMES
    while len(poses) < num_frames:
        poses.extend(_wander(rng, poses[-1], round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
        if rng.chance(0.5):
            look_around()  # a new place to come back to later
        eligible = [p for p in places if p[1] <= len(poses) - lo]
        first, stop = eligible[rng.integer(0, len(eligible) - 1)]
        poses.extend(_return_to(rng, poses[-1], poses[first]))
        poses.extend(poses[first + 1:stop])
    return poses[:num_frames]


_GENERATORS: dict[str, Callable[[_Draws, int], list[_Pose]]] = {
    "orbit": _orbit,
    "dolly": _dolly,
    "pan": _pan,
    "revisit": _revisit,
    "random_walk": _random_walk,
    "stress": _stress,
    "static": _static,
    "long_revisit": _long_revisit,
}


def make_trajectory(family: str, seed: int, num_frames: int) -> Trajectory:
    """The ``family`` trajectory of ``num_frames`` frames for ``seed`` (deterministic)."""
    check_family(family)
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames <= 0:
        raise ValueError(f"num_frames must be a positive integer, got {num_frames!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    # One stream per (seed, family); the family index keeps families of one seed independent.
    rng = _Draws(seed * 16 + ALL_FAMILIES.index(family))
    poses = torch.tensor(_GENERATORS[family](rng, num_frames), dtype=torch.float64).to(torch.float32)
    # Actions from the rounded float32 poses, so apply_action reproduces the stored poses.
    actions = actions_from_poses(poses.double()).to(torch.float32)
    return Trajectory(family=family, seed=seed, poses=poses, actions=actions)


def make_trajectories(
    families: str | Sequence[str], split: str, num_trajectories: int, num_frames: int, base_seed: int = 0
) -> list[Trajectory]:
    """``num_trajectories`` trajectories cycling through ``families``, seeds drawn from ``split``.

    Trajectory i has family ``families[i % len(families)]`` and seed
    ``SEED_RANGES[split][0] + base_seed + i``, so every trajectory has its own room.
    """
    if split not in SEED_RANGES:
        raise ValueError(f"unknown seed split {split!r}; allowed: {', '.join(SEED_RANGES)}")
    names = (families,) if isinstance(families, str) else tuple(families)
    if not names:
        raise ValueError("families must name at least one family")
    for name in names:
        check_family(name)
    if num_trajectories < 0 or base_seed < 0:
        raise ValueError(f"num_trajectories and base_seed must be >= 0, got {num_trajectories}, {base_seed}")
    lo, hi = SEED_RANGES[split]
    if lo + base_seed + num_trajectories > hi:
        raise ValueError(
            f"base_seed {base_seed} + {num_trajectories} trajectories overflow the {split} range [{lo}, {hi})"
        )
    return [make_trajectory(names[i % len(names)], lo + base_seed + i, num_frames) for i in range(num_trajectories)]


def revisit_pairs(traj: Trajectory) -> list[tuple[int, int]]:
    """(return_frame, earlier_frame) pairs: equal poses with the camera away in between.

    For each frame t, take the latest earlier frame s whose pose matches within
    ``POSE_MATCH_TOL`` (position, and yaw modulo 2 pi); keep (t, s) if some frame strictly
    between them looked more than ``REVISIT_AWAY_YAW_DEG`` away or stood more than
    ``REVISIT_AWAY_DISTANCE`` away from that pose.
    """
    p = traj.poses.double()
    num = p.shape[0]
    dist_TT = torch.cdist(p[:, :2], p[:, :2])
    yaw_TT = wrap_angle(p[:, None, 2] - p[None, :, 2]).abs()
    same_TT = (dist_TT <= POSE_MATCH_TOL) & (yaw_TT <= POSE_MATCH_TOL)
    away_TT = (yaw_TT > math.radians(REVISIT_AWAY_YAW_DEG)) | (dist_TT > REVISIT_AWAY_DISTANCE)
    # away_before[k, s]: number of frames in 0..k that were away from frame s's pose.
    away_before = away_TT.long().cumsum(dim=0)
    earlier = torch.tril(same_TT, diagonal=-1)
    pairs = []
    for t in torch.nonzero(earlier.any(dim=1)).flatten().tolist():
        s = int(torch.nonzero(earlier[t]).max())
        if away_before[t - 1, s] - away_before[s, s] > 0:
            pairs.append((t, s))
    assert all(0 <= s < t < num for t, s in pairs)
    return pairs


def leg_labels(traj: Trajectory) -> list[str]:
    """Per-frame "outbound" / "return" / "other" labels derived from ``revisit_pairs``.

    For a pair (t, s), the frames after s up to the first frame farthest from pose s
    (distance in units of the away thresholds) are "outbound", the rest up to t "return".
    Nested pairs (a retraced path matches itself frame by frame) keep the outer labels.
    """
    p = traj.poses.double()
    labels = ["other"] * traj.num_frames
    for t, s in sorted(revisit_pairs(traj), key=lambda ts: (ts[1], -ts[0])):
        if labels[s + 1] != "other":
            continue
        legs = p[s + 1:t]
        yaw = wrap_angle(legs[:, 2] - p[s, 2]).abs() / math.radians(REVISIT_AWAY_YAW_DEG)
        dist = (legs[:, :2] - p[s, :2]).norm(dim=-1) / REVISIT_AWAY_DISTANCE
        turn_point = s + 1 + int(torch.argmax(torch.maximum(yaw, dist)))
        for k in range(s + 1, t + 1):
            labels[k] = "outbound" if k <= turn_point else "return"
    return labels


def save_trajectories(path: str | os.PathLike, trajs: Sequence[Trajectory]) -> None:
    """Write ``trajs`` to one safetensors file, atomically (temp file + rename)."""
    tensors, metadata = {}, {"format": FORMAT, "format_version": FORMAT_VERSION, "num_trajectories": str(len(trajs))}
    for i, traj in enumerate(trajs):
        tensors[f"{i}.poses"] = traj.poses.to(torch.float32).contiguous()
        tensors[f"{i}.actions"] = traj.actions.to(torch.float32).contiguous()
        metadata[f"{i}.meta"] = json.dumps({"family": traj.family, "seed": traj.seed, "num_frames": traj.num_frames})
    write_bytes_atomic(path, safetensors_bytes(tensors, metadata))


def load_trajectories(path: str | os.PathLike) -> list[Trajectory]:
    """Read a file written by ``save_trajectories``; ``ValueError`` naming the bad field."""
    metadata, tensors = read_versioned(path, FORMAT, FORMAT_VERSION, "trajectories")
    try:
        count = int(metadata["num_trajectories"])
    except (KeyError, ValueError) as err:
        raise ValueError(f"{path}: num_trajectories missing or not an integer") from err
    expected = {f"{i}.{kind}" for i in range(count) for kind in ("poses", "actions")}
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(
            f"{path}: tensors do not match num_trajectories={count}: missing {missing}, unexpected {extra}"
        )
    trajs = []
    for i in range(count):
        try:
            meta = json.loads(metadata[f"{i}.meta"])
            family, seed, num_frames = meta["family"], meta["seed"], meta["num_frames"]
        except (KeyError, TypeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: metadata {i}.meta missing or malformed ({err!r})") from err
        if family not in ALL_FAMILIES:
            raise ValueError(f"{path}: {i}.meta family {family!r} unknown; allowed: {', '.join(ALL_FAMILIES)}")
        if not isinstance(seed, int) or not isinstance(num_frames, int) or num_frames <= 0:
            raise ValueError(f"{path}: {i}.meta seed/num_frames must be integers, got {seed!r}, {num_frames!r}")
        for kind in ("poses", "actions"):
            tensor = tensors[f"{i}.{kind}"]
            if tuple(tensor.shape) != (num_frames, 3) or not tensor.is_floating_point():
                raise ValueError(
                    f"{path}: {i}.{kind} must be float [{num_frames}, 3], got {tensor.dtype} {tuple(tensor.shape)}"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"{path}: {i}.{kind} contains non-finite values")
        trajs.append(Trajectory(family=family, seed=seed, poses=tensors[f"{i}.poses"].float(),
                                actions=tensors[f"{i}.actions"].float()))
    return trajs

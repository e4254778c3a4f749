"""Train TinyWorld: teacher forcing, then self-forcing, on a revisit-heavy curriculum.

Three facts from feasibility probes shape this loop:
- one-step training alone gives rollouts that blur after ~16 frames, so after `warmup_steps`
  a growing share of batches (up to `self_forcing_max`) is trained on the model's *own*
  rollout: frames 1..S-1 of the clip are replaced by a no-grad rollout through the cache and
  the model learns to predict the true next frame from them (self-forcing, one step of grad);
- recall through the cache does not emerge from ordinary motion: half of the clips
  (`revisit_share`) turn 90-180 degrees away and come back, gradually or in one snap, so the
  returning view can only come from a cached frame;
- pose-aware rotary encoding (see model.py) lets attention find that frame.

Every batch is rendered on the fly from fresh training-range seeds (a new scene per clip);
the seeds of step s are a pure function of s, so a resumed run sees the same data.

Checkpoints (world/checkpoint.py: model, AdamW moments, step and loss log in one safetensors file) are written
atomically every `checkpoint_every` steps; `train(..., resume=True)` continues from one.
A new stage can also start from a weights file (`init_weights`) with a fresh optimizer and
schedule: tensors the file lacks (a head added since it was trained) keep their initialization.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import OrderedDict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from calibrate.cache import KVCache
from calibrate.world.checkpoint import load_checkpoint, optimizer_step, save_checkpoint, self_forcing_share
from calibrate.world.model import TinyWorld, TinyWorldConfig
from calibrate.world.render import make_scene, render
from calibrate.world.rollout import rollout
from calibrate.world.train_config import TrainConfig
from calibrate.world.trajectories import SEED_RANGES, make_trajectory
from calibrate.world.weights import check_tensors, read_weights_file

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = "tinyworld-checkpoint"

def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


class ClipSource:
    """Training clips: clip `c` is a pure function of c (its family, seed and scene).

    Step s trains on the `new_per_step` newest clips (ids s*k ... s*k+k-1) plus clips drawn
    from the previous `replay_steps` steps' ids, so each clip is rendered once and seen
    about B/k times. Rendered clips live in a bounded cache; a resumed run re-renders on
    demand and sees exactly the same batches.
    """

    def __init__(self, cfg: "TrainConfig"):
        self.cfg = cfg
        self._cache: OrderedDict[int, tuple[torch.Tensor, ...]] = OrderedDict()
        self._capacity = cfg.new_per_step * (cfg.replay_steps + 1)

    def clip(self, clip_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if clip_id in self._cache:
            self._cache.move_to_end(clip_id)
            return self._cache[clip_id]
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + clip_id)
        if torch.rand((), generator=gen).item() < cfg.revisit_share:
            family = "revisit"
        else:
            family = cfg.motion_families[int(torch.randint(len(cfg.motion_families), (), generator=gen))]
        lo, hi = SEED_RANGES["train"]
        seed = lo + (cfg.seed + clip_id) % (hi - lo)
        traj = make_trajectory(family, seed, cfg.clip_frames)
        item = (render(make_scene(seed), traj.poses), traj.poses, traj.actions)
        self._cache[clip_id] = item
        while len(self._cache) > self._capacity:
            self._cache.popitem(last=False)
        return item

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Frames [B, N, 3, H, W], poses and actions [B, N, 3] for training step `step`."""
        cfg = self.cfg
        k = min(cfg.new_per_step, cfg.batch_size)
        ids = list(range(step * k, step * k + k))
        gen = torch.Generator().manual_seed(cfg.seed * 3_000_017 + step)
        lo, hi = max(0, step - cfg.replay_steps) * k, max(step, 1) * k  # step 0 replays its own clips
        ids += torch.randint(lo, hi, (cfg.batch_size - k,), generator=gen).tolist()
        frames, poses, actions = zip(*(self.clip(c) for c in ids))
        return torch.stack(frames), torch.stack(poses), torch.stack(actions)


def frame_loss(pred_BS3HW: torch.Tensor, target_BS3HW: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    if cfg.loss == "mse":
        return F.mse_loss(pred_BS3HW, target_BS3HW)
    mse_BS = (pred_BS3HW - target_BS3HW).pow(2).flatten(2).mean(dim=-1)
    return 10.0 * torch.log10(mse_BS + cfg.log_mse_eps).mean()


def train_step(model, opt, step: int, cfg: TrainConfig, source: ClipSource) -> float:
    frames, poses, actions = source.batch(step)
    inputs = frames
    gen = torch.Generator().manual_seed(cfg.seed * 7_000_003 + step)
    if torch.rand((), generator=gen).item() < self_forcing_share(step, cfg):
        model.eval()
        cache = KVCache(model.cfg.num_layers, cfg.window, cfg.sink_frames)
        own = rollout(model, cache, frames[:, 0], poses, actions)
        inputs = torch.cat([frames[:, :1], own[:, 1:]], dim=1)
        model.train()
    pred = model(inputs, poses, actions, cfg.window, cfg.sink_frames)
    return optimizer_step(model, opt, frame_loss(pred, frames[:, 1:], cfg), lr_at(step, cfg))


def load_init_weights(model: TinyWorld, path: str | Path) -> list[str]:
    """Load a weights file into `model`; returns the names of the tensors it did not have.

    Every tensor in the file must be one of the model's, with its shape (one-line ValueError
    naming the file otherwise); the model's other tensors keep their initialization.
    """
    p = Path(path)
    own = model.state_dict()
    try:
        _, tensors = read_weights_file(p)
        check_tensors(p, tensors, own)
    except ValueError as e:
        raise ValueError(f"train.init_weights: {e}") from None
    model.load_state_dict(tensors, strict=False)
    return sorted(set(own) - set(tensors))


def train(cfg: TrainConfig, out_dir: Path, resume: bool = True) -> TinyWorld:
    """Train (or continue training) TinyWorld; checkpoints and the loss log go to `out_dir`."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = TinyWorld(TinyWorldConfig(**cfg.model))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = out_dir / "checkpoint.safetensors"
    start, losses = 0, []
    if resume and ckpt.exists():
        start, losses = load_checkpoint(ckpt, model, opt)
        log.info("resumed from %s at step %d", ckpt, start)
    elif cfg.init_weights:
        new = load_init_weights(model, cfg.init_weights)
        log.info("initialized from %s; new tensors: %s", cfg.init_weights, ", ".join(new) or "none")
    model.train()
    source = ClipSource(cfg)
    t0 = time.time()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train_world")
    with open(out_dir / "loss.jsonl", "a") as loss_log:
        for step in bar:
            loss = train_step(model, opt, step, cfg, source)
            losses.append(round(loss, 6))
            loss_log.write(json.dumps({"step": step, "loss": loss, "lr": lr_at(step, cfg)}) + "\n")
            bar.set_postfix(loss=f"{loss:.5f}", sf=f"{self_forcing_share(step, cfg):.2f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                loss_log.flush()
                save_checkpoint(ckpt, model, opt, step + 1, losses, cfg, CHECKPOINT_FORMAT)
    log.info("trained %d steps in %.0f s", cfg.steps - start, time.time() - t0)
    model.eval()
    return model

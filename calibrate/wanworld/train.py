"""Train WanWorld: teacher forcing over whole clips, at the sampler's own noise levels.

One step draws `batch_size` fresh clips (a new room each, training seeds only) and runs them
through `teacher.clip_forward` in one forward: the clean frames 0..N-1 at timestep 0 and, for
every frame i >= 1, a noisy copy x_s = (1 - s) x_i + s * noise at a noise level s drawn from the
sampler's (`denoise_timesteps` shifted by `shift`: the few-step generator of Self-Forcing is
trained at its own steps the same way). The loss is the MSE of the predicted clean frame
x_s - s * flow against x_i, over the noisy copies, mapped back to pixels: the pixel MSE (flow
matching's velocity loss weighted by s^2 and by the whitening's inverse; any fixed positive
weighting has the same minimizer, the posterior mean, and this one is what the metrics score). The block-causal masks make each noisy copy see exactly what the rollout's denoising
pass of frame i sees, so the loss trains the computation the rollout runs.

Clips: a share `revisit_share` from `revisit` (turn away and come back: the returning view can
only come from a cached frame), the rest from `motion_families`. A share `offset_share` of
clips keep their first frame (the sink, position 0) but take the rest from later in the
trajectory (frames o+1 .. o+N-1, o up to `max_offset`) at their true positions: a long rollout
keeps frame 0 in the cache as its sink, so the model must read it from up to ~1000 frames away.
The first of those later frames is given, not scored (its predecessor is not in the clip).

Optionally (`self_forcing_*`) a share of steps replaces the clean frames 1..N-1 of the clips that
start at frame 0 by the model's own no-grad rollout through the adapter and the cache, while
the targets stay the true frames (the exposure-bias fix TinyWorld needed).

Everything a step draws is a pure function of (seed, step), and checkpoints (safetensors:
model, AdamW moments, step and loss log in the metadata) are written atomically every
`checkpoint_every` steps, so a resumed run ends with the same weights as an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from calibrate.adapters.wan_diffusers import WanAdapter, WanSettings, shifted_sigmas
from calibrate.cache import KVCache
from calibrate.types import Trajectory
from calibrate.wanworld import latents
from calibrate.wanworld.camera import CameraConfig
from calibrate.wanworld.model import ARCHITECTURE, LATENT_SIZE, WanWorld, WanWorldConfig, WanWorldInputs
from calibrate.wanworld.teacher import clip_forward
from calibrate.wanworld.train_config import WanTrainConfig
from calibrate.wanworld.weights import load_weights
from calibrate.world.checkpoint import (checkpoint_metadata, load_checkpoint, optimizer_step, save_checkpoint,
                                        self_forcing_share)
from calibrate.world.render import make_scene, render
from calibrate.world.train import lr_at
from calibrate.world.trajectories import SEED_RANGES, make_trajectory

log = logging.getLogger(__name__)
CHECKPOINT_FORMAT = "wanworld-checkpoint"


WHITENING_CLIPS = 64  # training clips (of the default schedule) the latent whitening is fitted on


def model_config(cfg: WanTrainConfig) -> WanWorldConfig:
    return WanWorldConfig(transformer={**ARCHITECTURE, **cfg.model}, camera=CameraConfig(**cfg.camera), latents=cfg.latents)


def fit_whitening(model: WanWorld) -> None:
    """Fit the latent whitening on the first `WHITENING_CLIPS` clips of the default schedule (a
    fixed set of training rooms, whatever the run's own seed and mix)."""
    default = WanTrainConfig()
    model.latents.fit(torch.stack([clip(default, c)["latents"] for c in range(WHITENING_CLIPS)]))


def sampler(cfg: WanTrainConfig, model: WanWorld) -> dict:
    """What the weights were trained for (the weights file's `sampler` metadata)."""
    return {"denoise_timesteps": list(cfg.denoise_timesteps), "shift": cfg.shift, "chunk_frames": model.chunk_frames}


# ---- clips ------------------------------------------------------------------------------------
def clip(cfg: WanTrainConfig, clip_id: int) -> dict:
    """Training clip `clip_id` (a pure function of it): latents [N, C, h, w], poses, actions [N, 3],
    rotary positions [N], loss weights [N], and the trajectory's family and seed."""
    n = cfg.clip_frames
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + clip_id)
    if torch.rand((), generator=gen).item() < cfg.revisit_share:
        family = "revisit"
    else:
        family = cfg.motion_families[int(torch.randint(len(cfg.motion_families), (), generator=gen))]
    offset = 0
    if torch.rand((), generator=gen).item() < cfg.offset_share:
        offset = int(torch.randint(1, cfg.max_offset + 1, (), generator=gen))
    lo, hi = SEED_RANGES["train"]
    seed = lo + (cfg.seed + clip_id) % (hi - lo)
    traj = make_trajectory(family, seed, offset + n)
    frames = torch.tensor([0] + list(range(offset + 1, offset + n)))
    weight = torch.ones(n)
    if offset:
        weight[1] = 0.0  # its predecessor is not in the clip: a view from frame 0 alone, not scored
    rgb = render(make_scene(seed), traj.poses[frames])
    return {"latents": latents.encode(rgb), "poses": traj.poses[frames], "actions": traj.actions[frames],
            "positions": frames, "weight": weight, "family": family, "seed": seed, "offset": offset}


def batch(cfg: WanTrainConfig, step: int) -> dict:
    clips = [clip(cfg, step * cfg.batch_size + b) for b in range(cfg.batch_size)]
    out = {k: torch.stack([c[k] for c in clips]) for k in ("latents", "poses", "actions", "positions", "weight")}
    out.update({k: [c[k] for c in clips] for k in ("family", "seed", "offset")})
    return out


def own_rollout(adapter: WanAdapter, b: dict, cfg: WanTrainConfig) -> torch.Tensor:
    """The clean frames with those of clips that start at frame 0 replaced by the model's own rollout."""
    clean = b["latents"].clone()
    rows = [i for i, o in enumerate(b["offset"]) if o == 0]
    if rows:
        trajs = [Trajectory(b["family"][i], b["seed"][i], b["poses"][i], b["actions"][i]) for i in rows]
        cache = KVCache(adapter.info.num_layers, cfg.window, cfg.sink_frames)
        clean[rows] = adapter.rollout(trajs, cache, torch.device("cpu"), truth=b["latents"][rows])
    return clean


# ---- one step ---------------------------------------------------------------------------------
def loss_of(model: WanWorld, b: dict, clean: torch.Tensor, cfg: WanTrainConfig, step: int) -> torch.Tensor:
    """The teacher-forced loss of one batch (`clean`: the frames the cache would hold, pixel latents)."""
    B, N = clean.shape[:2]
    sig = torch.tensor(shifted_sigmas(cfg.denoise_timesteps, cfg.shift))
    gen = torch.Generator().manual_seed(cfg.seed * 7_000_003 + step)
    s_BM = sig[torch.randint(len(sig), (B, N - 1), generator=gen)]
    noise = torch.randn(clean[:, 1:].shape, generator=gen)
    clean = model.latents.normalize(clean)
    x0 = model.latents.normalize(b["latents"][:, 1:])
    s = s_BM[..., None, None, None]
    noisy = (1 - s) * x0 + s * noise
    context = model.camera(b["poses"], b["actions"])
    _, flow = clip_forward(model.transformer, clean, noisy, list(range(1, N)), s_BM * 1000, b["positions"], context,
                           cfg.window, cfg.sink_frames)
    # the error of the predicted clean frame, in pixels (the metrics' own; the whitened latents would
    # weigh the faintest detail 140x the mean brightness)
    err_BM = (model.latents.denormalize(noisy - s * flow) - b["latents"][:, 1:]).pow(2).mean(dim=(2, 3, 4))
    w = b["weight"][:, 1:]
    return (err_BM * w).sum() / w.sum()


def train_step(model: WanWorld, opt, step: int, cfg: WanTrainConfig, adapter: WanAdapter | None) -> float:
    b = batch(cfg, step)
    clean = b["latents"]
    gen = torch.Generator().manual_seed(cfg.seed * 5_000_011 + step)
    if adapter is not None and torch.rand((), generator=gen).item() < self_forcing_share(step, cfg):
        clean = own_rollout(adapter, b, cfg)
    model.train()
    return optimizer_step(model, opt, loss_of(model, b, clean, cfg, step), lr_at(step, cfg))


def load_wan_checkpoint(path: Path, model: WanWorld, opt) -> tuple[int, list]:
    meta = checkpoint_metadata(path)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a WanWorld checkpoint (format {meta.get('format')!r})")
    if json.loads(meta["model_config"]) != json.loads(json.dumps(model.cfg.to_dict())):
        raise ValueError(f"{path}: checkpoint of another architecture than train_wan.model/camera ask for")
    return load_checkpoint(path, model, opt)


def train(cfg: WanTrainConfig, out_dir: Path, resume: bool = True) -> WanWorld:
    """Train (or continue training) WanWorld; checkpoints and the loss log go to `out_dir`."""
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = WanWorld(model_config(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    ckpt = out_dir / "checkpoint.safetensors"
    start, losses = 0, []
    if resume and ckpt.exists():
        start, losses = load_wan_checkpoint(ckpt, model, opt)
        log.info("resumed from %s at step %d", ckpt, start)
    elif cfg.init_weights:
        init, _ = load_weights(cfg.init_weights)
        if init.cfg.to_dict() != model.cfg.to_dict():
            raise ValueError(f"train_wan.init_weights: {cfg.init_weights} has another architecture than train_wan.model/camera")
        model.load_state_dict(init.state_dict())
        log.info("initialized from %s", cfg.init_weights)
    else:
        fit_whitening(model)
    adapter = None
    if cfg.self_forcing_max > 0:
        settings = WanSettings(chunk_frames=model.chunk_frames, latent_height=LATENT_SIZE, latent_width=LATENT_SIZE,
                               denoise_timesteps=list(cfg.denoise_timesteps), shift=cfg.shift)
        adapter = WanAdapter(model.transformer, settings, None, name="wanworld", world=WanWorldInputs(model))
    t0, c0 = time.time(), time.process_time()  # wall and CPU seconds of this process (the log's wall_s, cpu_s)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="train_world wanworld")
    with open(out_dir / "loss.jsonl", "a") as loss_log:
        for step in bar:
            loss = train_step(model, opt, step, cfg, adapter)
            losses.append(round(loss, 6))
            loss_log.write(json.dumps({"step": step, "loss": loss, "lr": lr_at(step, cfg), "wall_s": round(time.time() - t0, 1),
                                       "cpu_s": round(time.process_time() - c0, 1)}) + "\n")
            bar.set_postfix(loss=f"{loss:.5f}")
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                loss_log.flush()
                save_checkpoint(ckpt, model, opt, step + 1, losses, cfg, CHECKPOINT_FORMAT)
    log.info("trained %d steps in %.0f s", cfg.steps - start, time.time() - t0)
    return model.eval()

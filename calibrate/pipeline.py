"""The stages behind `python -m calibrate task=...`: plain functions of a typed `Config`.

Each `run_<task>(cfg, out_dir)` reads what it needs, writes its outputs under `out_dir` with
fixed names (atomically) and returns a JSON-able summary. `__main__` only dispatches here, and
tests call these functions directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from calibrate import distributed
from calibrate.config import Config, resolve_split
from calibrate.io import write_text_atomic
from calibrate.replay import Recorder, batches, model_info, record
from calibrate.stats import load_stats, plot_report, report
from calibrate.world.model import TinyWorld
from calibrate.world.trajectories import Trajectory, load_trajectories, make_trajectories
from calibrate.world.weights import load_weights

log = logging.getLogger(__name__)


# ---- shared pieces --------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"config: device={name} but no CUDA device is available (use device=auto or cpu)")
    return device


def load_world(cfg: Config, device: torch.device) -> TinyWorld:
    if cfg.model.name != "tinyworld":
        raise ValueError(f"config: unknown model '{cfg.model.name}' (available: tinyworld)")
    model = load_weights(cfg.model.weights).to(device)
    return model


def trajectory_set(cfg: Config, split: str | None = None) -> list[Trajectory]:
    t = cfg.trajectories
    if t.file:
        trajs = load_trajectories(t.file)
    else:
        trajs = make_trajectories(t.families, split or resolve_split(cfg), t.num_trajectories, t.num_frames, t.seed)
    if not trajs:
        raise ValueError("config: the trajectory set is empty")
    return trajs


def distributed_state(device: torch.device):
    """accelerate's state when launched with several processes (torchrun/accelerate), else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from accelerate import PartialState

    return PartialState(cpu=device.type == "cpu")


def config_hash(cfg: Config) -> str:
    return hashlib.sha256(json.dumps(asdict(cfg), sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n")


# ---- task=stats -----------------------------------------------------------------------------
def collect(cfg: Config, model: TinyWorld, device: torch.device, trace_batches: int = 0, trace_frames: int = 0,
            state=None) -> Recorder:
    """Replay the calibration trajectories (this process's shard) and reduce across processes."""
    info = model_info(model)
    trajs = distributed.shard(trajectory_set(cfg), state)
    recorder = Recorder.create(info, cfg.fit.sample_tokens, trace_frames, cfg.seed)
    record(model, trajs, recorder, cfg.model.cache.window, cfg.model.cache.sink_frames, device,
           cfg.trajectories.batch_size, trace_batches)
    distributed.reduce_stats(recorder.stats, state)
    recorder.q = distributed.reduce_queries(recorder.q, state)
    recorder.k = distributed.reduce_queries(recorder.k, state)
    recorder.v = distributed.reduce_queries(recorder.v, state)
    return recorder


def run_stats(cfg: Config, out_dir: Path) -> dict:
    device = resolve_device(cfg.device)
    state = distributed_state(device)
    model = load_world(cfg, device)
    info = model_info(model)
    recorder = collect(cfg, model, device, state=state)
    summary = report(recorder.stats)
    if state is None or state.is_main_process:
        recorder.stats.save(out_dir / "stats.safetensors", model=asdict(info), queries=recorder.q)
        write_json(out_dir / "stats.json", summary)
        plot_report(recorder.stats, out_dir / "stats.png")
    return {"stats": str(out_dir / "stats.safetensors"), "anchor_frames": summary.get("anchor_frames")}

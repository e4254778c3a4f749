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
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import save

from calibrate import distributed
from calibrate.config import Config, resolve_split
from calibrate.evaluate import plots
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.run import evaluate
from calibrate.evaluate.strips import write_strip
from calibrate.io import write_bytes_atomic, write_text_atomic
from calibrate.recipe import Recipe, load_recipe
from calibrate.schemes import BASELINES, KVSample, build_baseline
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
        recorder.stats.save(out_dir / "stats.safetensors", model=asdict(info),
                             samples={"q": recorder.q, "k": recorder.k, "v": recorder.v})
        write_json(out_dir / "stats.json", summary)
        plot_report(recorder.stats, out_dir / "stats.png")
    return {"stats": str(out_dir / "stats.safetensors"), "anchor_frames": summary["attention"]["anchor_frames"]}


# ---- schemes: presets or recipe files ----------------------------------------------------------
SHIPPED_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
OURS = "tinyworld-ours-2bit.safetensors"


def kv_sample(recorder: Recorder) -> KVSample:
    """Reservoir K/V token samples as [L, H, N, D] (the calibrated baselines fit on these)."""
    stack = lambda s: torch.stack([s.samples(l).permute(1, 0, 2) for l in range(s.num_layers)])
    return KVSample(stack(recorder.k), stack(recorder.v))


def calibration_sample(cfg: Config, model: TinyWorld, device: torch.device) -> KVSample:
    """A short replay of calibration-split trajectories, for baselines that calibrate."""
    calib_cfg = replace(cfg, trajectories=replace(cfg.trajectories, split="calibration", file=None,
                                                   num_frames=min(cfg.trajectories.num_frames, 128)))
    return kv_sample(collect(calib_cfg, model, device))


def resolve_schemes(cfg: Config, names: list[str], model: TinyWorld, device: torch.device) -> dict[str, Recipe]:
    info = model_info(model)
    recipes: dict[str, Recipe] = {}
    sample = None
    for name in names:
        if name in BASELINES:
            if name in ("kvquant2", "qvg2") and sample is None:
                sample = calibration_sample(cfg, model, device)
            recipes[name] = build_baseline(name, info, sample)
        elif name == "ours":
            recipes[name] = load_recipe(SHIPPED_RECIPES / OURS, info)
        elif name.endswith(".safetensors") or Path(name).exists():
            recipes[Path(name).stem] = load_recipe(name, info)
        else:
            raise ValueError(f"unknown scheme '{name}': use a preset ({', '.join(BASELINES)}, ours) or a recipe path")
    return recipes


# ---- task=evaluate / task=compare ----------------------------------------------------------------
def evaluate_and_report(cfg: Config, out_dir: Path, recipes: dict[str, Recipe], model: TinyWorld,
                        device: torch.device, command: str) -> dict:
    trajs = trajectory_set(cfg)
    partial = out_dir / "partial"
    partial.mkdir(parents=True, exist_ok=True)
    runs = evaluate(model, recipes, trajs, cfg.model.cache.window, cfg.model.cache.sink_frames, device,
                    cfg.trajectories.batch_size, cfg.eval.attention, partial, keep_frames=cfg.eval.save_frames)
    rep = report_mod.build(runs, [{"family": t.family, "seed": t.seed, "num_frames": t.num_frames} for t in trajs],
                           asdict(cfg), cfg.eval.psnr_threshold_db)
    images = write_figures(rep, runs, out_dir, cfg.eval.strips)
    write_json(out_dir / "report.json", rep)
    write_text_atomic(out_dir / "report.md", report_mod.markdown(rep, command, images))
    if cfg.eval.save_frames:
        save_frames(out_dir / "frames.safetensors", runs)
    print(report_mod.blind_spot_markdown(rep))
    return rep


def write_figures(rep: dict, runs: dict, out_dir: Path, strips: bool) -> dict[str, str]:
    schemes = rep["schemes"]
    images = {
        "PSNR vs the fp rollout per frame": plots.plot_psnr_curves(
            {n: s["per_frame"]["psnr_ref"] for n, s in schemes.items()}, out_dir / "psnr_ref.png").name,
        "Flicker per window": plots.plot_window_bars(
            {n: {w: v["mean"] for w, v in s["metrics"]["flicker"]["windows"].items()} for n, s in schemes.items()},
            out_dir / "flicker.png", "flicker (mean |e_t - e_t-1|)").name,
    }
    kl = {n: s["metrics"]["attention"]["kl"] for n, s in schemes.items() if s["metrics"]["attention"]}
    if kl:
        images["Attention KL(fp || quant) per layer"] = plots.plot_layer_heatmap(kl, out_dir / "attention_kl.png").name
    if strips:
        for name, run in runs.items():
            if run.worst is not None:
                path = write_strip(run.worst[1], run.worst[2], out_dir / f"strip_{name}.gif", max_frames=96)
                images[f"Worst trajectory, {name} (reference | quantized | error x4)"] = path.name
    return images


def save_frames(path: Path, runs: dict) -> None:
    tensors = {f"{name}.{kind}": t.contiguous() for name, run in runs.items() if run.frames
               for kind, t in run.frames.items()}
    write_bytes_atomic(path, save(tensors, metadata={"format": "kv-eval-frames", "layout": "[B, N, 3, H, W] float32 in [0,1]"}))


def _command(cfg: Config) -> str:
    import sys

    return "python -m calibrate " + " ".join(sys.argv[1:])


def run_evaluate(cfg: Config, out_dir: Path) -> dict:
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipes = {Path(cfg.recipe).stem: load_recipe(cfg.recipe, model_info(model))}
    rep = evaluate_and_report(cfg, out_dir, recipes, model, device, _command(cfg))
    return {"report": str(out_dir / "report.json")}


def run_compare(cfg: Config, out_dir: Path) -> dict:
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipes = resolve_schemes(cfg, list(cfg.schemes), model, device)
    evaluate_and_report(cfg, out_dir, recipes, model, device, _command(cfg))
    return {"report": str(out_dir / "report.json")}

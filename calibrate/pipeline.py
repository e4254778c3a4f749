"""The stages behind `python -m calibrate task=...`: plain functions of a typed `Config`.

Each `run_<task>(cfg, out_dir)` reads what it needs, writes its outputs under `out_dir` with
fixed names (atomically) and returns a JSON-able summary. `__main__` only dispatches here (and
to `calibration.run_calibrate`, the default task, built on these stages), and tests call these
functions directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from calibrate import distributed
from calibrate import gate
from calibrate.adapters import AdapterError, TinyWorldAdapter, WorldAdapter, as_world
from calibrate.config import Config, ModelConfig, resolve_split
from calibrate.evaluate import plots
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.html import TRAP_SENTENCE, write_report_html
from calibrate.evaluate.report import summary_metrics
from calibrate.evaluate.run import evaluate, setting_key
from calibrate.evaluate.sheets import (REFERENCE, FrameSheets, SheetError, decode_sheet, quantized_stream, read_stream,
                                       sheet_frames, undo_difference)
from calibrate.evaluate.strips import write_strip
from calibrate.io import safetensors_bytes, write_bytes_atomic, write_text_atomic
from calibrate.recipe import Recipe, load_recipe
from calibrate.replay import Recorder, record
from calibrate.schemes import BASELINES, CALIBRATED, KVSample, build_baseline
from calibrate.shipped import RECIPE_DIR, is_shipped_name, resolve_recipe, shipped_recipes
from calibrate.stats_report import plot_report, report
from calibrate.trace import TracePlan
from calibrate.types import Trajectory
from calibrate.world.model import TinyWorld
from calibrate.world.trajectories import load_trajectories, make_trajectories

log = logging.getLogger(__name__)


# ---- shared pieces --------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"config: device={name} but no CUDA device is available (use device=auto or cpu)")
    return device


World = TinyWorld | WorldAdapter  # what a stage accepts: a bare TinyWorld is taken as its adapter


def load_world(cfg: Config, device: torch.device) -> WorldAdapter:
    """The configured model (`model.name`) behind its adapter (calibrate/adapters/), weights on `device`."""
    return load_adapter(cfg.model, device)


def load_adapter(cfg: ModelConfig, device: torch.device) -> WorldAdapter:
    if cfg.name == "tinyworld":
        from calibrate.world.weights import load_weights

        return TinyWorldAdapter(load_weights(cfg.weights).to(device))
    if cfg.name == "wan_diffusers":
        from calibrate.adapters import wan_diffusers

        return wan_diffusers.load(cfg.weights, cfg.wan, device)
    if cfg.name == "wanworld":
        from calibrate.wanworld.weights import load_adapter as load_wanworld

        return load_wanworld(cfg.weights, cfg.wan, device)
    raise AdapterError(f"config: unknown model '{cfg.name}' (available: tinyworld, wan_diffusers, wanworld)")


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
def collect(cfg: Config, model: World, device: torch.device, trace: TracePlan | None = None, state=None,
            checkpoint: Path | None = None) -> Recorder:
    """Replay the calibration trajectories (this process's shard) and reduce across processes.

    With `checkpoint`, the recorder is saved there after every batch, and a run that finds a
    checkpoint of the same config, model and shard continues after its last finished batch
    (the statistics come out identical to an uninterrupted run).
    """
    info = as_world(model).info
    trajs = distributed.shard(trajectory_set(cfg), state)
    recorder = Recorder.create(info, cfg.fit.sample_tokens, trace, cfg.seed, device)
    rank, world = distributed.rank_and_world(state)
    key = f"{config_hash(cfg)}/{info.fingerprint}/{rank}/{world}"
    done = 0
    if checkpoint is not None and checkpoint.exists():
        try:
            saved, extra = Recorder.load(checkpoint, trace)
        except ValueError as e:  # only a cache of finished work: start over
            log.warning("ignoring unreadable resume checkpoint (%s)", e)
            saved, extra = None, {}
        if extra.get("resume_key") == key:
            recorder, done = saved, int(extra["batches_done"])
            log.info("resuming statistics from %s after %d batches", checkpoint, done)
    save = None
    if checkpoint is not None:
        save = lambda i, group: recorder.save(checkpoint, asdict(info), {"resume_key": key, "batches_done": str(i + 1)})
    record(as_world(model), trajs, recorder, cfg.model.cache.window, cfg.model.cache.sink_frames, device,
           cfg.trajectories.batch_size, on_batch=save, skip_batches=done)
    distributed.reduce_stats(recorder.stats, state)
    recorder.q = distributed.reduce_queries(recorder.q, state)
    recorder.k = distributed.reduce_queries(recorder.k, state)
    recorder.v = distributed.reduce_queries(recorder.v, state)
    return recorder.on_cpu()


def run_stats(cfg: Config, out_dir: Path) -> dict:
    device = resolve_device(cfg.device)
    state = distributed_state(device)
    if state is not None:
        device = state.device  # each process on its own GPU (cuda:<local rank>), or the CPU
    ok = False
    try:
        model = load_world(cfg, device)
        info = as_world(model).info
        rank, _ = distributed.rank_and_world(state)
        checkpoint = out_dir / f"stats.partial.rank{rank}.safetensors"
        recorder = collect(cfg, model, device, state=state, checkpoint=checkpoint)
        summary = report(recorder.stats)
        if state is None or state.is_main_process:
            recorder.save(out_dir / "stats.safetensors", asdict(info))
            write_json(out_dir / "stats.json", summary)
            plot_report(recorder.stats, out_dir / "stats.png")
        checkpoint.unlink(missing_ok=True)
        ok = True
    finally:
        distributed.finish(state, ok)
    return {"stats": str(out_dir / "stats.safetensors"), "anchor_frames": summary["attention"]["anchor_frames"]}


# ---- schemes: presets or recipe files ----------------------------------------------------------
SHIPPED_RECIPES = RECIPE_DIR  # shipped.py: recipes/ of a checkout, or calibrate/recipes of an install


def ours_recipe(info) -> Path:
    """The shipped recipe `ours` names for the model `info`: recipes/<model>-ours-2bit.safetensors."""
    path = SHIPPED_RECIPES / f"{info.name}-ours-2bit.safetensors"
    if not path.is_file():
        raise ValueError(f"scheme 'ours': no shipped recipe for model '{info.name}' ({path.name}); fit one with "
                         f"task=calibrate model={info.name} and pass its path")
    return path


def kv_sample(recorder: Recorder) -> KVSample:
    """Reservoir K/V token samples as [L, H, N, D] (the calibrated baselines fit on these)."""
    stack = lambda s: torch.stack([s.samples(l).permute(1, 0, 2) for l in range(s.num_layers)])
    return KVSample(stack(recorder.k), stack(recorder.v))


def calibration_sample(cfg: Config, model: World, device: torch.device) -> KVSample:
    """K/V samples from the calibration split (same trajectory settings, calibration seeds)."""
    calib_cfg = replace(cfg, trajectories=replace(cfg.trajectories, split="calibration", file=None))
    return kv_sample(collect(calib_cfg, model, device))


def resolve_schemes(cfg: Config, names: list[str], model: World, device: torch.device,
                    sample: KVSample | None = None) -> dict[str, Recipe]:
    """Recipes for preset names (baselines, `ours` = the model's shipped recipe), shipped recipe names or recipe paths.

    Calibrated baselines fit on `sample`, or on a calibration replay made here when not given.
    """
    info = as_world(model).info
    recipes: dict[str, Recipe] = {}
    for name in names:
        if name in BASELINES:
            if name in CALIBRATED and sample is None:
                sample = calibration_sample(cfg, model, device)
            recipes[name] = build_baseline(name, info, sample)
        elif name == "ours":
            recipes[name] = load_recipe(ours_recipe(info), info)
        elif is_shipped_name(name) or name.endswith(".safetensors") or Path(name).exists():
            path = resolve_recipe(name)
            recipes[path.stem] = load_recipe(path, info)
        else:
            raise ValueError(f"unknown scheme '{name}': use a preset ({', '.join(BASELINES)}, ours), a shipped recipe "
                             f"({', '.join(shipped_recipes())}) or a recipe path")
    return recipes


# ---- task=evaluate / task=compare ----------------------------------------------------------------
@dataclass
class Evaluation:
    """What `evaluate_schemes` measured, for `write_report`."""

    runs: dict
    report: dict
    sheets: FrameSheets | None  # wrote the frames of report.html's players (None: eval.strips=false)


def frame_sheets(cfg: Config, out_dir: Path, model: World, trajs: list[Trajectory], device: torch.device) -> FrameSheets | None:
    """report.html's frame sheets, under a directory keyed like the partial results they go with
    (`evaluate.run.setting_key`), so sheets of another model, trajectory set or cache never mix in."""
    if not cfg.eval.strips:
        return None
    key = setting_key(as_world(model).info, trajs, cfg.model.cache.window, cfg.model.cache.sink_frames,
                      cfg.trajectories.batch_size, device)
    return FrameSheets(out_dir / "partial" / "frames" / key, as_world(model).preview)


def evaluate_schemes(cfg: Config, out_dir: Path, recipes: dict[str, Recipe], model: World,
                     device: torch.device) -> Evaluation:
    """Roll every recipe out on the configured trajectories (finished batches of an earlier run into
    the same `out_dir` are reused when their key matches: evaluate/run.py) and build the report."""
    trajs = trajectory_set(cfg)
    partial = out_dir / "partial"
    partial.mkdir(parents=True, exist_ok=True)
    sheets = frame_sheets(cfg, out_dir, model, trajs, device)
    runs = evaluate(as_world(model), recipes, trajs, cfg.model.cache.window, cfg.model.cache.sink_frames, device,
                    cfg.trajectories.batch_size, cfg.eval.attention, partial, keep_frames=cfg.eval.save_frames,
                    on_rollout=sheets, twin=cfg.eval.noise_twin)
    rep = report_mod.build(runs, [{"family": t.family, "seed": t.seed, "num_frames": t.num_frames} for t in trajs],
                           asdict(cfg), cfg.eval.psnr_threshold_db)
    return Evaluation(runs, rep, sheets)


def write_report(cfg: Config, out_dir: Path, ev: Evaluation, model: World, command: str) -> dict:
    """report.json, report.md, report.html, plots and strips (and frames.safetensors); prints the
    blind-spot table and where the report is."""
    images = write_figures(ev.report, ev.runs, out_dir, cfg.eval.strips, as_world(model).preview, ev.sheets)
    write_json(out_dir / "report.json", ev.report)
    write_text_atomic(out_dir / "report.md", report_mod.markdown(ev.report, command, images))
    write_report_html(out_dir / "report.html", ev.report, ev.runs, ev.sheets, command)
    if cfg.eval.save_frames:
        save_frames(out_dir / "frames.safetensors", ev.runs)
    print(report_mod.blind_spot_markdown(ev.report))
    print_report_paths(out_dir)
    return ev.report


def print_report_paths(out_dir: Path) -> None:
    print(f"report: {out_dir / 'report.md'} and {out_dir / 'report.html'} (open in a browser)")
    print(TRAP_SENTENCE)


def evaluate_and_report(cfg: Config, out_dir: Path, recipes: dict[str, Recipe], model: World,
                        device: torch.device, command: str) -> dict:
    return write_report(cfg, out_dir, evaluate_schemes(cfg, out_dir, recipes, model, device), model, command)


def write_figures(rep: dict, runs: dict, out_dir: Path, strips: bool, preview=lambda frames: frames,
                  sheets: FrameSheets | None = None) -> dict[str, str]:
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
            frames = worst_rollout(name, run, sheets, preview)
            if frames is not None:
                path = write_strip(*frames, out_dir / f"strip_{name}.gif", max_frames=96)
                images[f"Worst trajectory, {name} (reference | quantized | error x4)"] = path.name
    return images


def worst_rollout(name: str, run, sheets: FrameSheets | None, preview) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(reference, quantized) RGB frames [N, 3, H, W] in [0, 1] of the scheme's worst trajectory
    (lowest mean PSNR vs fp), for its strip. From the frame sheets when the run has them: the
    frames report.html plays, there for every trajectory also when a resumed run reused batches
    it did not roll out again; else the worst rollout this run kept (`SchemeRun.worst`)."""
    if sheets is not None and not sheets.note and run.trajs:
        i = min(range(len(run.trajs)), key=lambda j: float(run.trajs[j].series["psnr_ref"].mean()))
        n = len(run.trajs[i].series["psnr_ref"])
        try:
            ref, quant = (torch.cat([decode_sheet(data, sheet_frames(n, k)) for k, data in
                                     enumerate(read_stream(sheets.directory, stream, i, n)[0])])
                          for stream in (REFERENCE, quantized_stream(name)))
        except SheetError as e:  # report.html names the damaged sheet too
            log.warning("strip of %s: %s", name, e)
            return None
        as_float = lambda frames_NHW3: frames_NHW3.permute(0, 3, 1, 2).float() / 255
        return as_float(ref), as_float(undo_difference(quant, ref))
    if run.worst is None:
        return None
    return preview(run.worst[1]), preview(run.worst[2])


def save_frames(path: Path, runs: dict) -> None:
    """frames.safetensors: the fp reference and ground truth once per batch, each scheme's rollout."""
    tensors = {}
    for name, run in runs.items():
        for b, batch in enumerate(run.frames or []):
            tensors[f"reference.batch{b}"] = batch["reference"]
            tensors[f"ground_truth.batch{b}"] = batch["ground_truth"]
            tensors[f"{name}.batch{b}.quantized"] = batch["quantized"]
    layout = ("reference.batch<i>, ground_truth.batch<i>, <scheme>.batch<i>.quantized: "
              "[B, N, C, H, W] float32 as the model makes them (TinyWorld: RGB in [0, 1]; Wan: latents); "
              "without a renderer ground_truth is the fp rollout")
    write_bytes_atomic(path, safetensors_bytes({k: t.contiguous() for k, t in tensors.items()},
                                               {"format": "kv-eval-frames", "layout": layout}))


def command_line() -> str:
    """The command this process was started with, as the report records it."""
    import sys

    return "python -m calibrate " + " ".join(sys.argv[1:])


def run_evaluate(cfg: Config, out_dir: Path) -> dict:
    path = resolve_recipe(cfg.recipe)
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipes = {path.stem: load_recipe(path, as_world(model).info)}
    evaluate_and_report(cfg, out_dir, recipes, model, device, command_line())
    return {"report": str(out_dir / "report.json")}


def run_compare(cfg: Config, out_dir: Path) -> dict:
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipes = resolve_schemes(cfg, list(cfg.schemes), model, device)
    evaluate_and_report(cfg, out_dir, recipes, model, device, command_line())
    return {"report": str(out_dir / "report.json")}


# ---- task=check: the CI gate (gate.py) ----------------------------------------------------------
def run_check(cfg: Config, out_dir: Path) -> dict:
    """Replay the check set with the recipe and compare against thresholds (exit 0 pass / 1 fail / 2 bad input)."""
    path = resolve_recipe(cfg.recipe)
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipe = load_recipe(path, as_world(model).info)
    recorded = json.loads(recipe.metadata.get("metrics", "{}")).get("check")
    if cfg.trajectories.name == "calibration" and not cfg.trajectories.file:
        # the default set of a check is the check set, as long as the recipe measured it
        cfg = gate.check_trajectories(cfg, (recorded or {}).get("trajectories"))
    gate.check_comparable(cfg, recorded)
    trajs = trajectory_set(cfg)
    sheets = frame_sheets(cfg, out_dir, model, trajs, device)
    runs = evaluate(as_world(model), {"recipe": recipe}, trajs, cfg.model.cache.window,
                    cfg.model.cache.sink_frames, device, cfg.trajectories.batch_size, attention=False, on_rollout=sheets)
    rep = report_mod.build(runs, [], {}, cfg.eval.psnr_threshold_db)
    measured = summary_metrics(rep)
    result = gate.verdict(cfg.recipe, measured, gate.check_criteria(measured, recorded, cfg.check))
    write_report_html(out_dir / "report.html", rep, runs, sheets, command_line(), check=result)
    write_text_atomic(out_dir / "check.xml", gate.junit_xml(result["criteria"], str(cfg.recipe)))
    write_json(out_dir / "check.json", {k: v for k, v in result.items() if k != "summary"})  # the verdict last
    print(gate.markdown_table(result["criteria"]))
    print(f"report: {out_dir / 'report.html'} (open in a browser); {out_dir / 'check.json'}, {out_dir / 'check.xml'}")
    return result

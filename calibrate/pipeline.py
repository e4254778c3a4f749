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
from calibrate.fit.objective import LayerTrace
from calibrate.fit.predictive_search import BudgetError, budget_floor, fit_predictive, rescaled
from calibrate.fit.search import check_fit_config, fit_recipe
from calibrate.fit.select import choose, closed_loop_scores, record_choice
from calibrate.io import safetensors_bytes, write_bytes_atomic, write_text_atomic
from calibrate.memory import bits_per_element, memory_section
from calibrate.recipe import Recipe, load_recipe, save_recipe
from calibrate.replay import Recorder, record
from calibrate.schemes import BASELINES, CALIBRATED, KVSample, build_baseline, preset_scheme
from calibrate.stats_report import plot_report, report
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
    raise AdapterError(f"config: unknown model '{cfg.name}' (available: tinyworld, wan_diffusers)")


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
def collect(cfg: Config, model: World, device: torch.device, trace_batches: int = 0, trace_frames: int = 0,
            state=None, checkpoint: Path | None = None) -> Recorder:
    """Replay the calibration trajectories (this process's shard) and reduce across processes.

    With `checkpoint`, the recorder is saved there after every batch, and a run that finds a
    checkpoint of the same config, model and shard continues after its last finished batch
    (the statistics come out identical to an uninterrupted run).
    """
    info = as_world(model).info
    trajs = distributed.shard(trajectory_set(cfg), state)
    recorder = Recorder.create(info, cfg.fit.sample_tokens, trace_frames, cfg.seed)
    rank, world = distributed.rank_and_world(state)
    key = f"{config_hash(cfg)}/{info.fingerprint}/{rank}/{world}"
    done = 0
    if checkpoint is not None and checkpoint.exists():
        try:
            saved, extra = Recorder.load(checkpoint, trace_frames)
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
           cfg.trajectories.batch_size, trace_batches, on_batch=save, skip_batches=done)
    distributed.reduce_stats(recorder.stats, state)
    recorder.q = distributed.reduce_queries(recorder.q, state)
    recorder.k = distributed.reduce_queries(recorder.k, state)
    recorder.v = distributed.reduce_queries(recorder.v, state)
    return recorder


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
_SOURCE_RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED_RECIPES = _SOURCE_RECIPES if _SOURCE_RECIPES.is_dir() else Path(__file__).resolve().parent / "recipes"
OURS = "tinyworld-ours-2bit.safetensors"


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
    """Recipes for preset names (baselines, `ours` = the shipped recipe) or recipe paths.

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
            recipes[name] = load_recipe(SHIPPED_RECIPES / OURS, info)
        elif name.endswith(".safetensors") or Path(name).exists():
            recipes[Path(name).stem] = load_recipe(name, info)
        else:
            raise ValueError(f"unknown scheme '{name}': use a preset ({', '.join(BASELINES)}, ours) or a recipe path")
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
                    on_rollout=sheets, runtime=cfg.eval.runtime)
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


def _command() -> str:
    import sys

    return "python -m calibrate " + " ".join(sys.argv[1:])


def run_evaluate(cfg: Config, out_dir: Path) -> dict:
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipes = {Path(cfg.recipe).stem: load_recipe(cfg.recipe, as_world(model).info)}
    evaluate_and_report(cfg, out_dir, recipes, model, device, _command())
    return {"report": str(out_dir / "report.json")}


def run_compare(cfg: Config, out_dir: Path) -> dict:
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipes = resolve_schemes(cfg, list(cfg.schemes), model, device)
    evaluate_and_report(cfg, out_dir, recipes, model, device, _command())
    return {"report": str(out_dir / "report.json")}


# ---- task=calibrate (the default): replay -> stats -> fit -> recipe -> evaluate -> report --------
def layer_traces(recorder: Recorder, window: int, sink_frames: int, num_trajectories: int) -> list[LayerTrace]:
    """The objective's data: the first `num_trajectories` traced trajectories, per layer."""
    if not recorder.traces:
        raise ValueError("calibration recorded no frames to fit on (empty calibration set?)")
    trace = recorder.traces[0]
    out = []
    for layer in range(len(trace.q)):
        k_pre, angles = trace.keys_before_rotation(layer)
        out.append(LayerTrace(*(x[:num_trajectories] for x in trace.stacked(layer)), window=window,
                              sink_frames=sink_frames, k_pre=k_pre[:num_trajectories], angles=angles[:num_trajectories]))
    return out


def closed_loop_trajectories(cfg: Config) -> list[Trajectory]:
    """Calibration trajectories for the closed-loop selection, after those the fit replayed."""
    t = cfg.trajectories
    return make_trajectories(t.families, "calibration", max(cfg.fit.closed_loop_trajectories, 1),
                             cfg.fit.closed_loop_frames, t.seed + t.num_trajectories)


def calibration_recording(cfg: Config, model: World, device: torch.device) -> Recorder:
    """Replay the calibration set with the fp model: statistics, token samples, traced frames."""
    return collect(cfg, model, device, trace_batches=1, trace_frames=cfg.fit.trace_frames)


def check_budget(cfg: Config, info) -> None:
    """fit.budget_bits against the least the configured code can store for this model and cache,
    from the memory model before any replay: a budget no recipe can meet fails in seconds.

    Predictive codes: `budget_floor` (no statistics needed; the fit checks the exact base width
    on the fitted statistics as the backstop). Scalar codes: `FitConfig.check` refuses budgets
    under the 2 bits of their codes; what their parameters add depends on the fitted choices.
    """
    if cfg.fit.code != "predictive":
        return
    window, sink = cfg.model.cache.window, cfg.model.cache.sink_frames
    floor = budget_floor(info, cfg.fit, window, sink)
    if cfg.fit.budget_bits < floor - 1e-9:
        raise BudgetError(f"config: fit.budget_bits={cfg.fit.budget_bits} is below {floor:.3f} bits per element, the "
                          f"least a predictive code stores for this model with model.cache.window={window} and "
                          f"sink_frames={sink} (1 bit per component, a mode bit per token, an anchor frame per window)")


def fit(cfg: Config, model: World, device: torch.device, recorder: Recorder | None = None) -> tuple[Recipe, dict]:
    """Fit on the calibration set (replayed unless `recorder` is given), select by closed loop."""
    window, sink = cfg.model.cache.window, cfg.model.cache.sink_frames
    info = as_world(model).info
    trajs = trajectory_set(cfg)
    check_fit_config(cfg.fit, info)  # before the replay, not after it
    check_budget(cfg, info)
    recorder = recorder or calibration_recording(cfg, model, device)
    traces = layer_traces(recorder, window, sink, cfg.fit.trace_trajectories)
    if cfg.fit.code == "predictive":
        coords = recorder.traces[0].rotary_coords
        recipe, record, fits = fit_predictive(info, traces, recorder.stats, cfg.fit, window, sink, coords)
        candidates = {"fitted": recipe}
        for scale in cfg.fit.closed_loop_scales:  # the same widths; finer steps may widen the anchors
            cand = rescaled(info, fits, cfg.fit, coords, scale, recipe.scheme.name)
            if scale != 1.0 and bits_per_element(info, cand.scheme, window, sink) <= cfg.fit.budget_bits + 1e-9:
                candidates[f"inter_x{scale:g}"] = cand
    else:
        sample = kv_sample(recorder)
        recipe, record, base = fit_recipe(info, traces, recorder.stats, sample.k_LHND, sample.v_LHND, cfg.fit, window,
                                          sink)
        candidates = {"fitted": recipe}
        if record["upgrades"]:
            candidates["no_mixed_precision"] = base
    scores = closed_loop_scores(as_world(model), candidates, closed_loop_trajectories(cfg), window, sink, device,
                                cfg.trajectories.batch_size, cfg.eval.runtime)
    chosen = choose(scores)
    recipe = candidates[chosen]
    record_choice(record, scores, chosen, recipe)
    recipe.metadata.update(
        calibration=json.dumps({"config": asdict(cfg), "config_hash": config_hash(cfg),
                                "trajectories": [[t.family, t.seed, t.num_frames] for t in trajs]}, sort_keys=True),
        fit=json.dumps(record, sort_keys=True),
        memory=json.dumps(memory_section(recipe, window, sink), sort_keys=True),
    )
    return recipe, record


def check_preset_budget(cfg: Config, info) -> None:
    """A preset run with a budget (`quant.budget_bits`, set by `fit.budget_bits` on the command
    line) must fit in it at steady state; else a ValueError naming the preset, its bits and the
    presets that do fit."""
    budget = cfg.quant.budget_bits
    if budget is None or cfg.quant.preset == "ours":
        return
    window, sink = cfg.model.cache.window, cfg.model.cache.sink_frames
    bits = {name: bits_per_element(info, preset_scheme(name, info), window, sink) for name in BASELINES}
    name = cfg.quant.preset
    if name not in bits:
        build_baseline(name, info)  # raises: unknown preset, listing the known ones
    if bits[name] > budget + 1e-9:
        fits = ", ".join(f"{n} ({b:.2f})" for n, b in bits.items() if b <= budget + 1e-9) or "none"
        raise ValueError(f"preset '{name}' needs {bits[name]:.3f} bits/element at steady state (window {window} + "
                         f"{sink} sink), above the requested budget fit.budget_bits={budget}; presets within it: {fits}")


def choose_plan(cfg: Config, model: World, device: torch.device, recipe: Recipe) -> Recipe:
    """`memory.device_budget`: the best memory plan under the budget (fit/plan_search.py), searched over
    this run's recipe (`fitted`) and the `memory.schemes` presets; the search goes into the fit record."""
    from calibrate.fit import plan_search

    m, window, sink = cfg.memory, cfg.model.cache.window, cfg.model.cache.sink_frames
    info = as_world(model).info
    budget = plan_search.parse_budget(m.device_budget, info, window, sink)
    recipes = {"fitted": recipe, **resolve_schemes(cfg, [s for s in m.schemes if s != "fitted"], model, device)}
    t = cfg.trajectories
    trajs = make_trajectories("long_revisit", "calibration", m.search_trajectories, m.search_frames,
                              t.seed + t.num_trajectories + cfg.fit.closed_loop_trajectories)
    name, chosen, record = plan_search.search(
        as_world(model), recipes, build_baseline("fp16", info), budget, trajs, device, windows=list(m.windows),
        recall_slots=list(m.recall_slots), sink_frames=sink, host_frames=m.host_frames, yaw_radius=m.yaw_radius,
        reference_window=window, batch_size=t.batch_size)
    fit_record = json.loads(recipe.metadata.get("fit", "{}"))
    fit_record["plan_search"] = record
    if "calibration" in recipe.metadata:  # the run's calibration record, whichever code the plan chose
        chosen.metadata["calibration"] = recipe.metadata["calibration"]
    chosen.metadata.update(fit=json.dumps(fit_record, sort_keys=True),
                           memory=json.dumps(plan_search.plan_memory_section(chosen), sort_keys=True))
    print(f"memory plan: {name} ({record['candidates'][0]['plan']['device_budget_bytes']} bytes budget per trajectory)")
    return chosen


def run_calibrate(cfg: Config, out_dir: Path) -> dict:
    """Fit (or build a preset), evaluate on held-out and check trajectories, write the recipe, then
    the report: a report in the run dir always goes with the recipe next to it."""
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    check_preset_budget(cfg, as_world(model).info)
    if cfg.quant.preset != "ours":
        recipe = resolve_schemes(cfg, [cfg.quant.preset], model, device)[cfg.quant.preset]
    else:
        recipe, _ = fit(cfg, model, device)
    if cfg.memory.device_budget is not None:
        recipe = choose_plan(cfg, model, device, recipe)
    recipe.path = None
    eval_cfg = replace(cfg, trajectories=replace(cfg.trajectories, split="evaluation"))
    ev = evaluate_schemes(eval_cfg, out_dir, {cfg.quant.preset: recipe}, model, device)
    metrics = {"evaluation": summary_metrics(ev.report)}
    check_cfg = gate.check_trajectories(cfg)
    check_rep = report_mod.build(
        evaluate(as_world(model), {cfg.quant.preset: recipe}, trajectory_set(check_cfg), cfg.model.cache.window,
                 cfg.model.cache.sink_frames, device, cfg.trajectories.batch_size, attention=False,
                 runtime=cfg.eval.runtime),
        [], {}, cfg.eval.psnr_threshold_db)
    metrics["check"] = summary_metrics(check_rep)
    recipe.metadata["metrics"] = json.dumps(metrics, sort_keys=True)
    for name in ("report.json", "report.md", "report.html"):  # an earlier run's report must not outlive its recipe
        (out_dir / name).unlink(missing_ok=True)
    path = out_dir / "recipe.safetensors"
    save_recipe(recipe, path)
    print(f"recipe: {path}  ({metrics['evaluation']['bits_per_element']:.3f} bits/element, "
          f"held-out psnr_ref {metrics['evaluation']['psnr_ref_all']:.2f} dB)")
    write_report(eval_cfg, out_dir, ev, model, _command())
    return {"recipe": str(path), "metrics": metrics}


# ---- task=check: the CI gate (gate.py) ----------------------------------------------------------
def run_check(cfg: Config, out_dir: Path) -> dict:
    """Replay the check set with the recipe and compare against thresholds (exit 0 pass / 1 fail / 2 bad input)."""
    device = resolve_device(cfg.device)
    model = load_world(cfg, device)
    recipe = load_recipe(cfg.recipe, as_world(model).info)
    if cfg.trajectories.name == "calibration" and not cfg.trajectories.file:
        cfg = gate.check_trajectories(cfg)  # the default set of a check is the check set
    trajs = trajectory_set(cfg)
    sheets = frame_sheets(cfg, out_dir, model, trajs, device)
    runs = evaluate(as_world(model), {"recipe": recipe}, trajs, cfg.model.cache.window,
                    cfg.model.cache.sink_frames, device, cfg.trajectories.batch_size, attention=False, on_rollout=sheets,
                    runtime=cfg.eval.runtime)
    rep = report_mod.build(runs, [], {}, cfg.eval.psnr_threshold_db)
    measured = summary_metrics(rep)
    recorded = json.loads(recipe.metadata.get("metrics", "{}")).get("check")
    result = gate.verdict(cfg.recipe, measured, gate.check_criteria(measured, recorded, cfg.check))
    write_json(out_dir / "check.json", {k: v for k, v in result.items() if k != "summary"})
    write_text_atomic(out_dir / "check.xml", gate.junit_xml(result["criteria"], str(cfg.recipe)))
    write_report_html(out_dir / "report.html", rep, runs, sheets, _command(), check=result)
    print(gate.markdown_table(result["criteria"]))
    print(f"report: {out_dir / 'report.html'} (open in a browser); {out_dir / 'check.json'}, {out_dir / 'check.xml'}")
    return result


# ---- task=train_world ----------------------------------------------------------------------------
def run_train_world(cfg: Config, out_dir: Path) -> dict:
    """Train TinyWorld into `out_dir` (resumes from its checkpoint when one is there)."""
    from calibrate.world.train import train
    from calibrate.world.weights import save_weights

    model = train(cfg.train, out_dir, resume=True)
    path = out_dir / "tinyworld.safetensors"
    save_weights(model, path, {"train_config": asdict(cfg.train)})
    print(f"weights: {path} (copy to artifacts/models/tinyworld.safetensors to ship them)")
    return {"weights": str(path)}

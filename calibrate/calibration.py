"""task=calibrate, the default: replay -> statistics -> fit -> recipe -> evaluate -> report.

`run_calibrate(cfg, out_dir)` fits the recipe (or builds a preset) on the calibration
trajectories, optionally searches a memory plan under `memory.device_budget`, evaluates it on
held-out and check trajectories and writes `recipe.safetensors` with its report. The shared
stages (loading the model, trajectory sets, evaluation and reports) are `pipeline.py`'s.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch

from calibrate import distributed, gate
from calibrate.adapters import as_world
from calibrate.config import Config, frames_per_step, parse_bytes
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.report import summary_metrics
from calibrate.evaluate.run import evaluate
from calibrate.fit.predictive_search import BudgetError, budget_floor, fit_predictive, rescaled
from calibrate.fit.search import check_fit_config, fit_recipe
from calibrate.fit.select import choose, closed_loop_scores, record_choice
from calibrate.memory import bits_per_element, memory_section
from calibrate.pipeline import (World, collect, command_line, config_hash, distributed_state, evaluate_schemes, kv_sample,
                                load_world, resolve_device, resolve_schemes, trajectory_set, write_report)
from calibrate.recipe import Recipe, save_recipe
from calibrate.replay import Recorder
from calibrate.schemes import BASELINES, build_baseline, preset_scheme
from calibrate.trace import LayerTraces, TracePlan, plan_trace
from calibrate.types import Trajectory
from calibrate.world.trajectories import make_trajectories

log = logging.getLogger(__name__)


def trace_plan(cfg: Config, info) -> TracePlan:
    """What the calibration replay traces for the objective (trace.py): the first
    `fit.trace_trajectories` calibration trajectories (whatever the batch size) and `fit.trace_frames` cache
    frames, or the calibration trajectories' cache frames when they are fewer, under
    `fit.trace_tokens` and `fit.trace_bytes`; refused here, before any replay, when not one token
    slot fits. A bf16 Wan's K/V are exact in bfloat16, so its trace keeps them so (half the bytes)."""
    f = cfg.fit
    bf16 = cfg.model.name == "wan_diffusers" and cfg.model.wan.dtype == "bfloat16"
    trajs = trajectory_set(cfg)
    frames = min(f.trace_frames, max(t.num_frames for t in trajs) // frames_per_step(cfg))
    return plan_trace(info, min(f.trace_trajectories, len(trajs)), frames, f.trace_tokens,
                      parse_bytes(f.trace_bytes, "fit.trace_bytes"), torch.bfloat16 if bf16 else torch.float32,
                      cfg.seed)


def closed_loop_trajectories(cfg: Config) -> list[Trajectory]:
    """Calibration trajectories for the closed-loop selection, after those the fit replayed."""
    t = cfg.trajectories
    return make_trajectories(t.families, "calibration", max(cfg.fit.closed_loop_trajectories, 1),
                             cfg.fit.closed_loop_frames, t.seed + t.num_trajectories)


def calibration_recording(cfg: Config, model: World, device: torch.device) -> Recorder:
    """Replay the calibration set with the fp model: statistics, token samples, traced frames."""
    return collect(cfg, model, device, trace=trace_plan(cfg, as_world(model).info))


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


@contextmanager
def phase(name: str):
    """Log a phase of the run with its wall time (records carry `phase` and `event`: start / end,
    which `benchmarks/scale.py` hooks to measure each phase's peak memory)."""
    start = time.perf_counter()
    log.info("%s ...", name, extra={"phase": name, "event": "start"})
    yield
    log.info("%s: %.1f s", name, time.perf_counter() - start, extra={"phase": name, "event": "end"})


def fit(cfg: Config, model: World, device: torch.device, recorder: Recorder | None = None,
        state=None) -> tuple[Recipe | None, dict | None]:
    """Fit on the calibration set (replayed unless `recorder` is given), select by closed loop.

    With several processes (`state`), the replay shards trajectories, the trace goes to the owner
    of each layer and the predictive fit shards layers (distributed.Shard); the closed-loop
    selection runs on the main process, which alone gets the recipe (the others get None).
    """
    window, sink = cfg.model.cache.window, cfg.model.cache.sink_frames
    info = as_world(model).info
    trajs = trajectory_set(cfg)
    check_fit_config(cfg.fit, info)  # before the replay, not after it
    check_budget(cfg, info)
    shard = distributed.Shard(state)
    if shard.active and cfg.fit.code != "predictive":
        raise ValueError("config: fit.code=scalar fits in one process; several processes shard the predictive fit "
                         "(fit.code=predictive) or task=stats")
    plan = trace_plan(cfg, info)
    if recorder is None:
        with phase("replay"):
            local = replace(plan, trajectories=len(range(shard.rank, plan.trajectories, shard.world)))
            recorder = collect(cfg, model, device, trace=local if local.trajectories else None,
                               state=state)
    trace = distributed.gather_trace(recorder.traces[0] if recorder.traces else None, plan, state, shard)
    if trace is None or not trace.q:
        raise ValueError("calibration recorded no frames to fit on (empty calibration set?)")
    traces = LayerTraces(trace, window, sink)
    coords = trace.rotary_coords
    with phase("fit"):
        if cfg.fit.code == "predictive":
            recipe, record, fits = fit_predictive(info, traces, recorder.stats, cfg.fit, window, sink, coords, shard)
        else:
            sample = kv_sample(recorder)
            recipe, record, base = fit_recipe(info, traces, recorder.stats, sample.k_LHND, sample.v_LHND, cfg.fit,
                                              window, sink)
    shard.done()
    if shard.rank != 0:
        return None, None
    if cfg.fit.code == "predictive":
        candidates = {"fitted": recipe}
        for scale in cfg.fit.closed_loop_scales:  # the same widths; finer steps may widen the anchors
            fit_cfg = replace(cfg.fit, sink_bits=record["sink_bits"])  # the fit may have dropped the sink code
            cand = rescaled(info, fits, fit_cfg, coords, scale, recipe.scheme.name)
            if scale != 1.0 and bits_per_element(info, cand.scheme, window, sink) <= cfg.fit.budget_bits + 1e-9:
                candidates[f"inter_x{scale:g}"] = cand
    else:
        candidates = {"fitted": recipe}
        if record["upgrades"]:
            candidates["no_mixed_precision"] = base
    if len(candidates) > 1:  # one candidate (the default): nothing to choose, no rollouts
        with phase("closed loop"):
            scores = closed_loop_scores(as_world(model), candidates, closed_loop_trajectories(cfg), window, sink,
                                        device, cfg.trajectories.batch_size)
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
    the report: a report in the run dir always goes with the recipe next to it.

    Launched as several processes (torchrun / accelerate launch), they replay and fit together
    (`fit`), then every rank leaves the process group and the main process alone goes on to
    the evaluation and writes the run directory."""
    device = resolve_device(cfg.device)
    state = distributed_state(device)
    if state is not None:
        device = state.device
    rank, _ = distributed.rank_and_world(state)
    ok = False
    try:
        model = load_world(cfg, device)
        check_preset_budget(cfg, as_world(model).info)
        if cfg.quant.preset != "ours":
            recipe = resolve_schemes(cfg, [cfg.quant.preset], model, device)[cfg.quant.preset] if rank == 0 else None
        else:
            recipe, _ = fit(cfg, model, device, state=state)
        ok = True
    finally:
        distributed.finish(state, ok)
    if rank != 0:
        return {"rank": rank}
    if cfg.memory.device_budget is not None:
        recipe = choose_plan(cfg, model, device, recipe)
    recipe.path = None
    eval_cfg = replace(cfg, trajectories=replace(cfg.trajectories, split="evaluation"))
    with phase("evaluation"):
        ev = evaluate_schemes(eval_cfg, out_dir, {cfg.quant.preset: recipe}, model, device)
    metrics = {"evaluation": summary_metrics(ev.report)}
    check_cfg = gate.check_trajectories(cfg)
    with phase("check set"):
        check_rep = report_mod.build(
            evaluate(as_world(model), {cfg.quant.preset: recipe}, trajectory_set(check_cfg), cfg.model.cache.window,
                     cfg.model.cache.sink_frames, device, cfg.trajectories.batch_size, attention=False),
            [], {}, cfg.eval.psnr_threshold_db)
    t = check_cfg.trajectories
    metrics["check"] = {**summary_metrics(check_rep),
                        "trajectories": {"num_trajectories": t.num_trajectories, "num_frames": t.num_frames}}
    recipe.metadata["metrics"] = json.dumps(metrics, sort_keys=True)
    for name in ("report.json", "report.md", "report.html"):  # an earlier run's report must not outlive its recipe
        (out_dir / name).unlink(missing_ok=True)
    path = out_dir / "recipe.safetensors"
    save_recipe(recipe, path)
    print(f"recipe: {path}  ({metrics['evaluation']['bits_per_element']:.3f} bits/element, "
          f"held-out psnr_ref {metrics['evaluation']['psnr_ref_all']:.2f} dB)")
    with phase("report"):
        write_report(eval_cfg, out_dir, ev, model, command_line())
    return {"recipe": str(path), "metrics": metrics}

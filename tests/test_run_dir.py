"""Run directories that can be trusted when reused: partial results keyed by what made them,
budgets refused before any replay, a report that never outlives its recipe.

All on a tiny random TinyWorld on the CPU, in process (`pipeline.run_<task>` is what the CLI
calls); the CLI's own contract (records, exit codes) is in test_cli.py.
"""

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from calibrate import calibration, gate, pipeline
from calibrate.adapters import as_world
from calibrate.config import Config, FitConfig, TrajectoriesConfig
from calibrate.evaluate import run as eval_run
from calibrate.evaluate.html import read_page
from calibrate.fit.predictive_search import BudgetError, budget_floor
from calibrate.recipe import load_recipe, save_recipe
from calibrate.schemes import build_baseline

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_weights, tmp_path_factory):
    """The tiny model, its weights file, and a kivi2 and a naive2 recipe both named `recipe.safetensors`."""
    model, weights = tiny_weights
    d = tmp_path_factory.mktemp("recipes")
    info = as_world(model).info
    paths = {}
    for name in ("kivi2", "naive2"):
        paths[name] = d / name / "recipe.safetensors"
        save_recipe(build_baseline(name, info), paths[name])
    return model, weights, paths


def tiny_cfg(task: str, weights: Path, **over) -> Config:
    cfg = Config(task=task, device="cpu")
    cfg.model.weights = str(weights)
    cfg.trajectories = TrajectoriesConfig(families=["orbit", "stress"], num_trajectories=2, num_frames=10, batch_size=1)
    cfg.eval.attention = False
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg


def psnr_series(run_dir: Path) -> dict:
    schemes = json.loads((run_dir / "report.json").read_text())["schemes"]
    return {name: s["per_frame"]["psnr_ref"] for name, s in schemes.items()}


def sheets_of(run_dir: Path) -> dict[str, bytes]:
    """Every frame sheet that report.html embedded, by path below its keyed directory."""
    root = run_dir / "partial" / "frames"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.webp"))}


# ---- 1. partial results are keyed by what determines them ----------------------------------------
def test_evaluate_another_recipe_of_the_same_name_into_the_same_dir_is_recomputed(tiny, tmp_path, caplog):
    """The issue's case: kivi2 then naive2, both `recipe.safetensors`, into one run dir."""
    model, weights, recipes = tiny
    reused = tmp_path / "reused"
    pipeline.run_evaluate(tiny_cfg("evaluate", weights, recipe=str(recipes["kivi2"])), reused)
    with caplog.at_level(logging.WARNING):
        pipeline.run_evaluate(tiny_cfg("evaluate", weights, recipe=str(recipes["naive2"])), reused)
    fresh = tmp_path / "fresh"
    pipeline.run_evaluate(tiny_cfg("evaluate", weights, recipe=str(recipes["naive2"])), fresh)
    pipeline.run_evaluate(tiny_cfg("evaluate", weights, recipe=str(recipes["kivi2"])), tmp_path / "kivi2")

    assert psnr_series(reused) == psnr_series(fresh) != psnr_series(tmp_path / "kivi2")
    lines = [r.getMessage() for r in caplog.records if "recomputing" in r.getMessage()]
    assert len(lines) == 1 and "'recipe'" in lines[0] and "another recipe or setting" in lines[0], lines
    # report.html's players show the rollouts that were measured
    fresh_sheets = sheets_of(fresh)
    assert fresh_sheets and {k: v for k, v in sheets_of(reused).items() if k in fresh_sheets} == fresh_sheets


def test_calibrate_with_another_window_into_the_same_dir_is_recomputed(tiny, tmp_path, monkeypatch):
    """The issue's case: task=calibrate quant=naive2, then the same with model.cache.window=4."""
    model, weights, _ = tiny
    small_check = TrajectoriesConfig(families=["orbit"], num_trajectories=1, num_frames=8)
    monkeypatch.setattr(gate, "check_trajectories", lambda cfg, recorded=None: replace(cfg, trajectories=small_check))

    def calibrate(run_dir: Path, window: int) -> dict:
        cfg = tiny_cfg("calibrate", weights)
        cfg.quant.preset = "naive2"
        cfg.model.cache.window = window
        calibration.run_calibrate(cfg, run_dir)
        return load_recipe(run_dir / "recipe.safetensors").section("metrics")["evaluation"]

    reused = tmp_path / "reused"
    calibrate(reused, 16)
    again = calibrate(reused, 4)
    assert again == calibrate(tmp_path / "fresh", 4)
    assert psnr_series(reused) == psnr_series(tmp_path / "fresh")


def test_an_interrupted_compare_resumes_to_the_uninterrupted_report(tiny, tmp_path, monkeypatch):
    """Killed after its first batches, rerun with the same command and run dir: the finished
    batches are not rolled out again, and report.json and the frame sheets are those of a run
    that was never interrupted."""
    model, weights, recipes = tiny
    cfg = tiny_cfg("compare", weights, schemes=["fp16", str(recipes["kivi2"])])
    pipeline.run_compare(cfg, tmp_path / "uninterrupted")
    real, calls = eval_run.rollout_batch, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 9:  # batch 0: fp, fp16 + its noise twin, kivi2 + twin; batch 1: fp, fp16 + twin, Ctrl-C in kivi2
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(eval_run, "rollout_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_compare(cfg, tmp_path / "resumed")
    calls.clear()
    monkeypatch.setattr(eval_run, "rollout_batch", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    pipeline.run_compare(cfg, tmp_path / "resumed")
    assert len(calls) == 3  # batch 1's fp reference, kivi2 and its twin (fp16's partial of batch 1 was written)
    report = lambda d: (tmp_path / d / "report.json").read_text()
    assert report("resumed") == report("uninterrupted")
    assert sheets_of(tmp_path / "resumed") == sheets_of(tmp_path / "uninterrupted")
    for name in ("strip_fp16.gif", "strip_recipe.gif"):  # fp16's worst trajectory was not rolled out again
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "uninterrupted" / name).read_bytes()
    markdown = lambda d: (tmp_path / d / "report.md").read_text().split("\n", 3)[3]  # after the command line
    assert markdown("resumed") == markdown("uninterrupted")

    calls.clear()
    pipeline.run_compare(cfg, tmp_path / "resumed")  # nothing left to do: nothing is rolled out
    assert calls == [] and report("resumed") == report("uninterrupted")


def test_a_partial_without_frame_sheets_is_recomputed_when_the_report_needs_them(tiny, tmp_path, caplog):
    model, weights, recipes = tiny
    no_strips = tiny_cfg("evaluate", weights, recipe=str(recipes["kivi2"]))
    no_strips.eval.strips = False
    pipeline.run_evaluate(no_strips, tmp_path)
    assert not (tmp_path / "partial" / "frames").exists()
    with caplog.at_level(logging.WARNING):
        pipeline.run_evaluate(tiny_cfg("evaluate", weights, recipe=str(recipes["kivi2"])), tmp_path)
    assert any("have no frame sheets" in r.getMessage() for r in caplog.records)
    assert sheets_of(tmp_path)
    page = read_page(tmp_path / "report.html")
    assert "some players are off" not in page and "no players" not in page


def test_partial_key_names_every_input(tiny):
    model, _, recipes = tiny
    info = as_world(model).info
    from calibrate.world.trajectories import make_trajectories

    trajs = make_trajectories(["orbit"], "evaluation", 2, 6)
    base = dict(info=info, trajs=trajs, window=16, sink_frames=1, batch_size=8, device=CPU)
    key = eval_run.setting_key(**base)
    other_info = replace(info, fingerprint="0" * 16)
    moved = [replace(trajs[0], poses=trajs[0].poses + 1e-3)] + trajs[1:]
    variants = [dict(info=other_info), dict(trajs=moved), dict(trajs=trajs[:1]), dict(window=4),
                dict(sink_frames=0), dict(batch_size=1), dict(device=torch.device("meta"))]
    keys = {eval_run.setting_key(**{**base, **v}) for v in variants}
    assert key not in keys and len(keys) == len(variants)
    kivi, naive = (load_recipe(recipes[n]) for n in ("kivi2", "naive2"))
    assert len({eval_run.partial_key(key, kivi, True), eval_run.partial_key(key, kivi, False),
                eval_run.partial_key(key, naive, True), eval_run.partial_key(key, kivi, True, twin=True)}) == 4


# ---- 2. budgets are checked before any replay -----------------------------------------------------
@pytest.fixture
def no_replay(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the budget was checked only after a replay")

    for module in (pipeline, calibration):  # calibration.py replays through the name it imported
        monkeypatch.setattr(module, "collect", fail)


@pytest.mark.parametrize("window,sinks", [(16, 1), (4, 0)])
def test_a_budget_below_the_predictive_floor_is_refused_before_the_replay(tiny, tmp_path, no_replay, window, sinks):
    model, weights, _ = tiny
    cfg = tiny_cfg("calibrate", weights)
    cfg.model.cache.window, cfg.model.cache.sink_frames = window, sinks
    floor = budget_floor(as_world(model).info, cfg.fit, window, sinks)
    assert 1.0 < floor < 1.2
    cfg.fit = replace(cfg.fit, budget_bits=round(floor - 0.01, 3))
    with pytest.raises(BudgetError) as e:
        calibration.run_calibrate(cfg, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and f"fit.budget_bits={cfg.fit.budget_bits}" in msg and f"window={window}" in msg
    assert not list(tmp_path.iterdir())


def test_the_floor_is_below_every_recipe_the_fitter_can_make(tiny):
    """The floor is a lower bound: the narrowest base recipe on real statistics costs more."""
    from calibrate.fit.predictive_codes import KINDS, HeadCode, TensorFit, assemble, moments
    from calibrate.memory import bits_per_element

    model, _, _ = tiny
    cfg = Config()
    cfg.trajectories = TrajectoriesConfig(families=["orbit", "stress"], num_trajectories=2, num_frames=24)
    cfg.fit = replace(FitConfig(), trace_frames=8, sample_tokens=64)
    info = as_world(model).info
    recorder = calibration.calibration_recording(cfg, model, CPU)
    coords = recorder.traces[0].rotary_coords
    for window, sinks in ((16, 1), (4, 1), (1, 0)):
        for temporal in (True, False):
            fit_cfg = replace(cfg.fit, temporal=temporal)
            fits = [{kind: TensorFit(kind, "kpre" if kind == "k" else kind,
                                     *moments(recorder.stats, "kpre" if kind == "k" else kind, layer),
                                     [HeadCode(1.0, 1.3, 0.7)] * info.num_kv_heads) for kind in KINDS}
                    for layer in range(info.num_layers)]
            cheapest = bits_per_element(info, assemble(info, fits, fit_cfg, coords).scheme, window, sinks)
            assert budget_floor(info, fit_cfg, window, sinks) <= cheapest


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_budget_is_refused(budget):
    with pytest.raises(ValueError, match="fit.budget_bits must be a finite number"):
        replace(FitConfig(), budget_bits=budget).check()


# ---- 3. the report never outlives its recipe --------------------------------------------------------
def test_calibrate_writes_the_recipe_before_the_report(tiny, tmp_path, monkeypatch):
    model, weights, _ = tiny
    small_check = TrajectoriesConfig(families=["orbit"], num_trajectories=1, num_frames=8)
    monkeypatch.setattr(gate, "check_trajectories", lambda cfg, recorded=None: replace(cfg, trajectories=small_check))
    cfg = tiny_cfg("calibrate", weights)
    cfg.quant.preset = "naive2"
    for name in ("report.json", "report.md", "report.html"):  # an earlier run's report
        (tmp_path / name).write_text("old")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(calibration, "save_recipe", killed)  # killed while the recipe is written
    with pytest.raises(KeyboardInterrupt):
        calibration.run_calibrate(cfg, tmp_path)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("report")]

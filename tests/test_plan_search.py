"""The memory plan search: budgets, refused candidates, scoring in rollouts, the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calibrate.adapters import as_world
from calibrate.fit.plan_search import candidates, parse_budget, search, split_frames
from calibrate.recipe import load_recipe
from calibrate.schemes import build_baseline
from calibrate.tiers import steady_device_bytes
from calibrate.world.trajectories import make_trajectory

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[1]


def test_parse_budget(tiny_world):
    info = as_world(tiny_world).info
    fp16 = parse_budget("fp16", info, 16, 1)
    assert fp16 == 17 * info.num_layers * info.elements_per_frame * 2
    assert parse_budget("835584", info, 16, 1) == 835584
    assert parse_budget("816KiB", info, 16, 1) == 816 * 1024
    assert parse_budget("0.5 MB", info, 16, 1) == 500_000
    for bad in ("lots", "-3", "12 parsecs", "0"):
        with pytest.raises(ValueError, match="memory.device_budget"):
            parse_budget(bad, info, 16, 1)


def test_over_budget_plans_are_refused_with_their_bytes(tiny_world):
    info = as_world(tiny_world).info
    recipes = {"fp16": build_baseline("fp16", info), "naive2": build_baseline("naive2", info)}
    budget = parse_budget("fp16", info, 8, 1)  # 9 float16 frames
    rows = candidates(recipes, budget, windows=[4, 8, 16], recall_slots=[0, 4], sink_frames=1, host_frames=64,
                      yaw_radius=1.0)
    by_name = {r["name"]: r for r in rows}
    assert by_name["fp16/w8+1s"]["status"] == "admitted" and by_name["fp16/w8+1s"]["device_bytes"] == budget
    assert by_name["fp16/w16+1s"]["status"] == "refused" and "> budget" in by_name["fp16/w16+1s"]["reason"]
    assert by_name["fp16/w8+1s+4r"]["status"] == "refused"
    assert by_name["naive2/w16+1s+4r"]["status"] == "admitted"  # 2-bit frames: room for a longer window and recall
    for r in rows:
        assert r["device_bytes"] == steady_device_bytes(info, recipes[r["scheme"]].scheme, r["plan"])
    with pytest.raises(ValueError, match="admits no plan"):
        search(as_world(tiny_world), recipes, recipes["fp16"], 1000, [], CPU, windows=[4], recall_slots=[0],
               sink_frames=1, host_frames=8, yaw_radius=1.0, reference_window=16)


def test_search_scores_every_admitted_plan_and_records_it(tiny_world):
    world = as_world(tiny_world)
    info = world.info
    recipes = {"fp16": build_baseline("fp16", info), "naive2": build_baseline("naive2", info)}
    trajs = [make_trajectory("long_revisit", 1_000_005, 130)]
    assert split_frames(trajs[0])[0]  # a return after >= 64 frames
    budget = parse_budget("fp16", info, 8, 1)
    name, recipe, record = search(world, recipes, recipes["fp16"], budget, trajs, CPU, windows=[4, 8],
                                  recall_slots=[0, 4], sink_frames=1, host_frames=64, yaw_radius=1.0,
                                  reference_window=8)
    rows = {r["name"]: r for r in record["candidates"]}
    assert len(rows) == 8 and record["chosen"] == name
    scored = [r for r in rows.values() if r["status"] == "scored"]
    assert all("score" in r and "reason" in r for r in scored)
    assert {r["name"] for r in rows.values() if r["status"] == "refused"} == {"fp16/w8+1s+4r"}
    assert rows["fp16/w8+1s"]["score"] == pytest.approx(0.0, abs=1e-9)  # the reference plan itself
    assert name == max(scored, key=lambda r: (round(r["score"], 3), -r["device_bytes"]))["name"]
    plan = recipe.scheme.policy.plan
    assert plan is not None and f"{name.split('/')[0]}/{plan.label()}" == name


def test_cli_calibrate_with_a_device_budget_writes_the_plan(tiny_weights, tmp_path):
    _, weights = tiny_weights
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "calibrate", "task=calibrate", "quant=naive2", "trajectories=quick",
                          f"model.weights={weights}", "memory.device_budget=fp16", "memory.windows=[4,16]",
                          "memory.recall_slots=[0,4]", "memory.search_trajectories=1", "memory.search_frames=130",
                          "fit.closed_loop_trajectories=2", "eval.strips=false", "eval.attention=false",
                          f"hydra.run.dir={tmp_path}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    recipe = load_recipe(tmp_path / "recipe.safetensors")
    plan = recipe.scheme.policy.plan
    record = json.loads(recipe.metadata["fit"])["plan_search"]
    assert plan is not None and record["chosen"].endswith(plan.label())
    assert {r["status"] for r in record["candidates"]} <= {"scored", "refused"} and len(record["candidates"]) == 8
    memory = json.loads(recipe.metadata["memory"])
    assert memory["plan"]["device_bytes_steady"] <= plan.device_budget_bytes
    report = json.loads((tmp_path / "report.json").read_text())
    mem = next(iter(report["schemes"].values()))["memory"]
    assert mem["bytes"] == mem["predicted_bytes"]


def test_predictive_codes_are_searched_only_at_their_fitted_window():
    """A predictive recipe runs only under the window it was fitted for (memory.check_fitted_window):
    the search refuses its other windows, with the reason, and varies only its recall slots."""
    from test_tiers import predictive_recipe

    recipe = predictive_recipe()
    recipe.metadata["memory"] = json.dumps({"window": 8, "sink_frames": 1})
    rows = candidates({"ours": recipe}, 10**9, windows=[4, 8], recall_slots=[0, 2], sink_frames=1, host_frames=16,
                      yaw_radius=1.0)
    status = {r["name"]: (r["status"], r.get("reason", "")) for r in rows}
    assert status["ours/w8+1s"][0] == status["ours/w8+1s+2r"][0] == "admitted"
    assert status["ours/w4+1s"] == ("refused", "its predictive codes were fitted for window 8")

"""task=capacity: its bytes are the memory model's (memory.predicted_cache_bytes, tiers' steady and
host bytes) for the same setting, the window it reports is the largest that fits, and its inputs
fail in one line."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from calibrate import capacity as cap
from calibrate.memory import bits_per_element, predicted_cache_bytes, steady_phases, steady_state_frames
from calibrate.plan import MemoryPlan
from calibrate.recipe import LayerSpec, Scheme, TensorSpec, TokenPolicy, load_recipe
from calibrate.schemes import BASELINES, build_baseline, preset_scheme
from calibrate.shipped import shipped_recipes
from calibrate.tiers import predicted_host_bytes, steady_device_bytes
from calibrate.types import ModelInfo

REPO = Path(__file__).resolve().parents[1]
WAN_LIKE = ModelInfo(name="wan-like", num_layers=3, num_kv_heads=4, head_dim=128, tokens_per_frame=3 * 40,
                     fingerprint="(shape only)")


def steady(info, scheme, window, sinks):
    return steady_device_bytes(info, scheme, MemoryPlan(1, window=window, sink_frames=sinks))


@pytest.mark.parametrize("name", BASELINES)
def test_baseline_bytes_equal_the_memory_model_of_the_whole_scheme(name):
    counted = cap.Counted(name, "baseline", cap.baseline_groups(name, WAN_LIKE))
    full = preset_scheme(name, WAN_LIKE)
    for window, sinks in ((1, 0), (2, 1), (7, 0), (23, 1)):
        got = cap.device_bytes(WAN_LIKE, counted, window, sinks)
        assert got == steady(WAN_LIKE, full, window, sinks), (window, sinks)
        if steady_phases(full) == 1:  # one phase: the steady bytes are predicted_cache_bytes at steady state
            n = steady_state_frames(window, sinks)
            assert got == predicted_cache_bytes(WAN_LIKE, full, n, window, sinks)
        assert cap.bits_per_element(WAN_LIKE, got, window, sinks) == pytest.approx(
            bits_per_element(WAN_LIKE, full, window, sinks), rel=1e-12)


def mixed_scheme(layers: int) -> Scheme:
    """A recipe-like scheme whose layers differ (per-head bits in one of them)."""
    a = LayerSpec(TensorSpec(bits=2, axis="channel"), TensorSpec(bits=2, axis="token", group_size=32))
    b = LayerSpec(TensorSpec(bits=4, axis="token", head_bits=[2, 4, 4, 8]), TensorSpec(bits=16))
    return Scheme("mixed", [a, b, a][:layers], TokenPolicy(sink_frames=1, recent_frames=2, recent_bits=16))


def test_recipe_layers_counted_by_group_equal_the_whole_scheme():
    scheme = mixed_scheme(3)
    counted = cap.Counted("mixed", "recipe", cap.layer_groups(WAN_LIKE, scheme))
    assert [g.count for g in counted.groups] == [2, 1]
    for window, sinks in ((1, 1), (5, 1), (30, 0)):
        assert cap.device_bytes(WAN_LIKE, counted, window, sinks) == steady(WAN_LIKE, scheme, window, sinks)


def test_the_shipped_recipe_counts_exactly_on_its_own_model_and_as_an_estimate_elsewhere():
    recipe = load_recipe(shipped_recipes()["tinyworld-ours-2bit"])
    own = cap.count_recipe("ours", "shipped recipe", recipe, recipe.model)
    window = json.loads(recipe.metadata["memory"])["window"]
    assert own.groups is not None and own.note == f"codes fitted for window {window}"
    assert cap.device_bytes(recipe.model, own, window, 1) == steady(recipe.model, recipe.scheme, window, 1)
    other = cap.count_recipe("ours", "shipped recipe", recipe, WAN_LIKE)
    assert other.groups is None and other.note.startswith("estimate: fitted for tinyworld")
    bits = json.loads(recipe.metadata["memory"])["bits_per_element"]
    assert cap.bits_per_element(WAN_LIKE, cap.device_bytes(WAN_LIKE, other, 10, 1), 10, 1) == pytest.approx(bits, 1e-6)


def test_rows_are_the_largest_window_that_fits_and_its_memory_model_bytes():
    shape = cap.Shape(WAN_LIKE, 3, 10_000_000, "test")
    schemes = [cap.Counted(n, "baseline", cap.baseline_groups(n, WAN_LIKE)) for n in ("fp16", "naive2", "kivi2", "qvg2")]
    schemes.append(cap.Counted("mixed", "recipe", cap.layer_groups(WAN_LIKE, mixed_scheme(3))))
    device, reserve, sinks, rollout = 2**25, 2**20, 1, 600
    rep = cap.capacity(shape, device, reserve, sinks, rollout, schemes)
    budget = device - reserve - 2 * 10_000_000
    assert rep["cache_budget_bytes"] == budget and rep["rollout_chunks"] == 200
    full = {n: preset_scheme(n, WAN_LIKE) for n in ("fp16", "naive2", "kivi2", "qvg2")} | {"mixed": mixed_scheme(3)}
    for row in rep["rows"]:
        scheme, w = full[row["scheme"]], row["window"]
        assert 0 < w < 200 - sinks  # the budget ends the window before the rollout does
        assert row["device_bytes"] == steady(WAN_LIKE, scheme, w, sinks) <= budget < steady(WAN_LIKE, scheme, w + 1, sinks)
        assert row["latent_frames"] == 3 * (w + sinks)
        assert row["bytes_per_chunk"] == steady(WAN_LIKE, scheme, w + 1, sinks) - row["device_bytes"]
        plan = MemoryPlan(budget, window=w, sink_frames=sinks, host_frames=200 - w - sinks, recall="none")
        if row["scheme"] == "qvg2":  # span state has no host form: said, not counted
            assert row["host_bytes"] is None and "kind 'prq'" in row["note"]
        else:
            assert row["host_bytes"] == predicted_host_bytes(WAN_LIKE, scheme, plan, 200)
    assert "| naive2 |" in cap.markdown(rep, "cmd")


def test_weights_over_the_budget_and_a_whole_rollout():
    shape = cap.Shape(WAN_LIKE, 1, 10**9, "test")
    naive = [cap.Counted("naive2", "baseline", cap.baseline_groups("naive2", WAN_LIKE))]
    row = cap.capacity(shape, 10**9, 0, 1, 100, naive)["rows"][0]  # 2 GB of weights in 1 GB
    assert row["window"] == 0 and "does not fit: the weights and reserve leave no room" in row["note"]
    row = cap.capacity(shape, 2 * 10**9 + 1000, 0, 1, 100, naive)["rows"][0]  # room, but not for one chunk
    assert row["window"] == 0 and row["note"].startswith("does not fit: window 1 needs")
    row = cap.capacity(shape, 10**12, 0, 1, 100, naive)["rows"][0]
    assert row["window"] == 99 and row["whole_rollout"] and row["host_bytes"] == 0 and row["latent_frames"] == 100


def test_largest_window_is_the_boundary_for_any_guess():
    for slope in (1, 7, 1000):
        for budget in (0, 5, 999, 10**6):
            want = max((w for w in range(1, 301) if 50 + slope * w <= budget), default=0)
            assert cap.largest_window(lambda w: 50 + slope * w + (w > 20) * 3 * w, budget, 300) == max(
                (w for w in range(1, 301) if 50 + slope * w + (w > 20) * 3 * w <= budget), default=0)
            assert cap.largest_window(lambda w: 50 + slope * w, budget, 300) == want


def test_explicit_and_wan_shapes():
    from calibrate.config import Config, ModelConfig
    from calibrate.adapters.wan_diffusers import WanSettings

    cfg = Config()
    cfg.capacity = replace(cfg.capacity, num_layers=40, num_kv_heads=40, head_dim=128, tokens_per_latent_frame=1560,
                           num_params=14_000_000_000, chunk_frames=3)
    shape = cap.model_shape(cfg)
    assert shape.info.tokens_per_frame == 4680 and shape.chunk_frames == 3 and shape.num_params == 14 * 10**9
    wan = WanSettings(config="wan2.1-t2v-1.3b", chunk_frames=3, latent_height=60, latent_width=104)
    shape = cap.model_shape(Config(model=ModelConfig(name="wan_diffusers", wan=wan)))
    assert (shape.info.num_layers, shape.info.num_kv_heads, shape.info.head_dim) == (30, 12, 128)
    assert shape.info.tokens_per_frame == 4680 and shape.num_params == 1_418_996_800


# ---- the command line ------------------------------------------------------------------------------
def calibrate(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "calibrate", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_cli_capacity_of_wan_1_3b_equals_the_memory_model(tmp_path):
    run = calibrate("task=capacity", "model=wan_diffusers", "model.wan.config=wan2.1-t2v-1.3b",
                    "model.wan.chunk_frames=3", "model.wan.latent_height=60", "model.wan.latent_width=104",
                    "model.cache.sink_frames=1", "memory.device_budget=24GiB", f"hydra.run.dir={tmp_path}")
    assert run.returncode == 0, run.stderr[-2000:]
    rep = json.loads((tmp_path / "capacity.json").read_text())
    assert (tmp_path / "capacity.md").read_text() in run.stdout + "\n"
    info = ModelInfo(name="wan_diffusers", num_layers=30, num_kv_heads=12, head_dim=128, tokens_per_frame=4680,
                     fingerprint="x")
    assert rep["weight_bytes"] == 2 * 1_418_996_800 and rep["cache_budget_bytes"] == 24 * 2**30 - rep["weight_bytes"]
    rows = {r["scheme"]: r for r in rep["rows"]}
    assert set(BASELINES) | set(shipped_recipes()) == set(rows)
    for name in ("fp16", "naive2", "kivi2"):
        w, full = rows[name]["window"], build_baseline(name, info).scheme
        n = steady_state_frames(w, 1)
        assert rows[name]["device_bytes"] == predicted_cache_bytes(info, full, n, w, 1) <= rep["cache_budget_bytes"]
        assert predicted_cache_bytes(info, full, steady_state_frames(w + 1, 1), w + 1, 1) > rep["cache_budget_bytes"]
    assert rows["fp16"]["window"] == 25 and rows["fp16"]["latent_frames"] == 78  # 822.7 MiB per chunk in float16
    assert rows["tinyworld-ours-2bit"]["counted"] == "estimate"


@pytest.mark.parametrize("args,message", [
    ([], "task=capacity needs the device's memory as memory.device_budget=BYTES"),
    (["memory.device_budget=fp16"], "task=capacity needs the device's memory"),
    (["memory.device_budget=24GiB", "capacity.num_layers=30"], "needs capacity.num_kv_heads"),
    (["memory.device_budget=24GiB", "capacity.head_dim=64"], "capacity.head_dim is part of an explicit shape"),
    (["memory.device_budget=24GiB", "capacity.reserve=lots"], "capacity.reserve='lots' is not a byte count"),
    (["memory.device_budget=24GiB", "model=wan_diffusers", "model.wan.config=nope"], "is not a shipped config"),
    (["memory.device_budget=24GiB", "recipe=nope"], "recipe 'nope': no such file here"),
])
def test_cli_bad_capacity_input_is_one_line(tmp_path, capsys, monkeypatch, args, message):
    from test_cli import nonempty_lines, run_in_process  # `python -m calibrate` in this process

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code, _, err = run_in_process(["task=capacity", *args, f"hydra.run.dir={tmp_path}"], capsys)
    lines = nonempty_lines(err)
    assert code == 2 and "Traceback" not in err and lines[-1].startswith("error:") and message in lines[-1], err
    assert not (tmp_path / "capacity.json").exists()

"""Properties the predictive fitter promises (fit/predictive_search.py), on a tiny random TinyWorld."""

import json

import pytest
import torch

from calibrate import calibration
from calibrate.adapters import as_world
from calibrate.fit.predictive_search import BudgetError
from calibrate.memory import fp16_cache_bytes
from calibrate.recipe import load_recipe, save_recipe, to_bytes
from calibrate.replay import rollout_batch
from calibrate.runtime import QuantizedKVCache
from calibrate.world.trajectories import make_trajectories

from toys import TINY_WORLD, tiny_fit_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_world):
    return tiny_world


@pytest.fixture(scope="module")
def fitted(model):
    return calibration.fit(tiny_fit_config(), model, CPU)


def test_every_tensor_is_predictive_with_pre_rotary_keys(fitted):
    recipe, record = fitted
    assert record["code"] == "predictive" and record["keys"] == "pre-rotary"
    for i in range(TINY_WORLD.num_layers):
        k, v = recipe.spec(i, "k"), recipe.spec(i, "v")
        assert k.kind == v.kind == "predictive"
        assert k.rotary_coords == 3 and v.rotary_coords == 0  # TinyWorld's rotary comes from the pose (x, y, yaw)


def test_budget_respected_by_measured_bytes(fitted, model):
    recipe, record = fitted
    assert record["bits_per_element"] <= 2.5 + 1e-9
    trajs = make_trajectories(["orbit"], "evaluation", 1, 40)
    cache = QuantizedKVCache.from_recipe(recipe, window=16, sink_frames=1)
    rollout_batch(as_world(model), trajs, cache, CPU)
    assert cache.nbytes() == cache.predicted_nbytes(40)
    assert 16.0 * cache.nbytes() / fp16_cache_bytes(recipe.model, 40, 16, 1) <= 2.5 + 1e-9


def test_record_says_what_was_chosen_and_recipe_round_trips(fitted, model, tmp_path):
    recipe, record = fitted
    path = tmp_path / "r.safetensors"
    save_recipe(recipe, path)
    loaded = load_recipe(path, as_world(model).info)
    fit = json.loads(loaded.metadata["fit"])
    assert len(fit["layers"]) == TINY_WORLD.num_layers
    for layer in fit["layers"]:
        for kind in ("k", "v"):
            assert {"intra_mult", "inter_mult", "why", "scores"} <= set(layer[kind])
    assert {"closed_loop", "upgrades", "base_bits", "head_bits"} <= set(fit)
    # candidates whose finer steps would widen the anchors past the budget are not rolled out
    assert "fitted" in fit["closed_loop"]["scores"]
    assert set(fit["closed_loop"]["scores"]) <= {"fitted", "inter_x0.7", "inter_x1.4", "inter_x2"}


def test_same_config_and_seed_give_identical_bytes(fitted, model):
    again, _ = calibration.fit(tiny_fit_config(), model, CPU)
    assert to_bytes(again) == to_bytes(fitted[0])


def test_mixed_precision_only_adds_bits_within_the_budget(fitted, model):
    _, record = fitted
    off, off_record = calibration.fit(tiny_fit_config(mixed_precision=False), model, CPU)
    assert off_record["upgrades"] == []
    assert off_record["bits_per_element"] <= record["bits_per_element"] <= 2.5 + 1e-9
    assert all(u["gain"] > 0 for u in record["upgrades"])


def test_a_budget_no_code_can_meet_is_refused(model):
    with pytest.raises(BudgetError, match="budget_bits"):
        calibration.fit(tiny_fit_config(budget_bits=1.0), model, CPU)


@pytest.mark.parametrize("override,check", [
    ({"temporal": False}, lambda r: not r.spec(0, "v").temporal),
    ({"pre_rotary": False}, lambda r: r.spec(0, "k").rotary_coords == 0),
    ({"basis": "identity"}, lambda r: torch.equal(r.tensor(0, "k", "rotation")[0], torch.eye(TINY_WORLD.head_dim))),
    ({"bit_allocation": "uniform"}, lambda r: bool((r.tensor(1, "v", "channel_bits").amax(-1)
                                                    - r.tensor(1, "v", "channel_bits").amin(-1) <= 1).all())),
])
def test_ablation_switches_change_what_they_say(model, override, check):
    recipe, _ = calibration.fit(tiny_fit_config(mixed_precision=False, **override), model, CPU)
    assert check(recipe)

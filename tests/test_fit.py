"""Properties the scalar (per-frame) fitter promises, on a tiny random TinyWorld (fast, CPU)."""

import json

import pytest
import torch

from calibrate import calibration
from calibrate.adapters import as_world
from calibrate.fit.search import BudgetError
from calibrate.memory import bits_per_element, fp16_cache_bytes
from calibrate.recipe import load_recipe, save_recipe, to_bytes
from calibrate.replay import rollout_batch
from reference_runtime import ReferenceCache
from calibrate.world.trajectories import make_trajectories

from toys import TINY_WORLD, tiny_fit_config


@pytest.fixture(scope="module")
def model(tiny_world):
    return tiny_world


@pytest.fixture(scope="module")
def fitted(model):
    return calibration.fit(tiny_fit_config(code="scalar"), model, torch.device("cpu"))


def test_fitted_clip_no_worse_than_minmax(fitted):
    _, record = fitted
    for layer in record["layers"]:
        for kind in ("k", "v"):
            table = layer[kind]["candidates"]
            for name, score in table.items():
                if name.endswith("/minmax"):
                    assert table[name[: -len("/minmax")]] <= score + 1e-9


def test_budget_respected_by_measured_bytes(fitted, model):
    recipe, record = fitted
    assert record["bits_per_element"] <= 2.5 + 1e-9
    trajs = make_trajectories(["orbit"], "evaluation", 1, 40)
    cache = ReferenceCache.from_recipe(recipe, window=16, sink_frames=1)
    rollout_batch(as_world(model), trajs, cache, torch.device("cpu"))
    measured = 16.0 * cache.nbytes() / fp16_cache_bytes(recipe.model, 40, 16, 1)
    assert cache.nbytes() == cache.predicted_nbytes(40)
    assert measured <= 2.5 + 1e-9


def test_every_choice_recorded_and_recipe_runs(fitted, model, tmp_path):
    recipe, record = fitted
    path = tmp_path / "r.safetensors"
    save_recipe(recipe, path)
    loaded = load_recipe(path, as_world(model).info)
    fit_meta = json.loads(loaded.metadata["fit"])
    assert len(fit_meta["layers"]) == TINY_WORLD.num_layers
    for layer in fit_meta["layers"]:
        for kind in ("k", "v"):
            assert {"rotation", "granularity", "clip", "why", "candidates"} <= set(layer[kind])
    assert "anchors" in fit_meta and "closed_loop" in fit_meta and "upgrades" in fit_meta
    trajs = make_trajectories(["pan"], "evaluation", 1, 10)
    frames, _ = rollout_batch(as_world(model), trajs, ReferenceCache.from_recipe(loaded), torch.device("cpu"))
    assert torch.isfinite(frames).all()


def test_same_config_and_seed_give_identical_bytes(fitted, model):
    again, _ = calibration.fit(tiny_fit_config(code="scalar"), model, torch.device("cpu"))
    assert to_bytes(again) == to_bytes(fitted[0])


def test_budget_below_two_bit_codes_is_refused(model):
    with pytest.raises(BudgetError, match="budget_bits"):
        calibration.fit(tiny_fit_config(code="scalar", budget_bits=1.5), model, torch.device("cpu"))


def test_mixed_precision_spends_budget_only_where_it_helps(fitted, model):
    recipe, record = fitted
    off, off_record = calibration.fit(tiny_fit_config(code="scalar", mixed_precision=False), model, torch.device("cpu"))
    assert off_record["upgrades"] == []
    assert bits_per_element(off.model, off.scheme, 16, 1) <= bits_per_element(recipe.model, recipe.scheme, 16, 1) + 1e-9
    assert all(u["gain"] > 0 for u in record["upgrades"])

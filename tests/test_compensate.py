import pytest
import torch

from calibrate import calibration
from calibrate.adapters import as_world
from calibrate.codec import HeadParams, fake_quant
from calibrate.fit.compensate import fit_compensator, residual_mse
from calibrate.recipe import TensorSpec

from toys import tiny_fit_config


def _clipped_pair(seed=0, n=4000, d=16):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, d, generator=g) * torch.linspace(0.5, 3.0, d)
    spec = TensorSpec(bits=2, axis="token", group_size=d)
    y_hat = fake_quant(y.unsqueeze(0), spec, HeadParams(bits=2, clip=0.6))[0][0]
    return y, y_hat


def test_rank_zero_is_exactly_the_identity():
    y, y_hat = _clipped_pair()
    down, up = fit_compensator(y, y_hat, 0)
    assert down.shape == (16, 0) and up.shape == (0, 16)
    assert residual_mse(y, y_hat, down, up) == residual_mse(y, y_hat)


def test_compensator_reduces_held_out_residual():
    y, y_hat = _clipped_pair()
    down, up = fit_compensator(y[:2000], y_hat[:2000], 4)
    before, after = residual_mse(y[2000:], y_hat[2000:]), residual_mse(y[2000:], y_hat[2000:], down, up)
    assert after < 0.95 * before


def test_rank_above_head_dim_is_refused():
    y, y_hat = _clipped_pair()
    with pytest.raises(ValueError, match="head_dim"):
        fit_compensator(y, y_hat, 17)


def test_fitted_compensators_land_in_a_runnable_recipe(tmp_path, tiny_world):
    from calibrate.recipe import load_recipe, save_recipe
    from calibrate.replay import rollout_batch
    from reference_runtime import ReferenceCache
    from calibrate.world.trajectories import make_trajectories

    model = tiny_world
    recipe, record = calibration.fit(tiny_fit_config(code="scalar", comp_rank=4), model, torch.device("cpu"))
    save_recipe(recipe, tmp_path / "r.safetensors")
    loaded = load_recipe(tmp_path / "r.safetensors", as_world(model).info)
    kept = {(c["layer"], c["tensor"]) for c in record["compensators"]}
    for layer, pair in enumerate(loaded.scheme.layers):
        for kind in ("k", "v"):
            assert (getattr(pair, kind).comp_rank == 4) == ((layer, kind) in kept)
    cache = ReferenceCache.from_recipe(loaded)
    frames, _ = rollout_batch(as_world(model), make_trajectories(["orbit"], "evaluation", 1, 12), cache, torch.device("cpu"))
    assert torch.isfinite(frames).all() and cache.nbytes() == cache.predicted_nbytes(cache.num_frames_seen)

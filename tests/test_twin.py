"""The noise twin: the stored error it is sized from, the noise it adds, and the report rows."""

import math

import pytest
import torch

from calibrate.adapters import as_world
from calibrate.cache import KVCache, Rope
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.run import evaluate
from calibrate.evaluate.twin import NoiseTwinCache
from calibrate.schemes import build_baseline
from calibrate.shadow import ShadowCache
from calibrate.world.trajectories import make_trajectories

B, H, T, D = 2, 2, 4, 8
OFFSET = 0.25


class OffsetValues(KVCache):
    """Stores keys exactly and every value plus OFFSET: a stored error known by hand."""

    def _store(self, layer, index, k_BHTD, v_BHTD):
        return k_BHTD, v_BHTD + OFFSET


def frames(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g),
             torch.randn(B, H, T, D, generator=g), Rope(torch.randn(B, T, D // 2, generator=g))) for _ in range(n)]


def test_stored_error_is_the_held_history_against_the_fp_history():
    window, sinks = 3, 1
    shadow = ShadowCache(2, window, sinks, {"offset": OffsetValues(2, window, sinks)}, attention=False, stored=True)
    fp = KVCache(2, window, sinks)
    sig2 = torch.zeros(B, 2, H, dtype=torch.float64)  # values only: [B, layer, head]
    tokens = 0
    for q, k, v, rope in frames(6):
        for layer in range(2):
            fp.attend(layer, q, k, v, rope)
            held_v = fp.read(layer, fp.history(layer))[1] if fp.history(layer) else None
            if held_v is not None:
                sig2[:, layer] += held_v.double().pow(2).sum((-2, -1))
                tokens += held_v.shape[2] if layer == 0 else 0
            shadow.attend(layer, q, k, v, rope)
    stored = shadow.stored["offset"]
    assert torch.equal(stored.err2[:, :, 0], torch.zeros(B, 2, H, dtype=torch.float64))  # keys exact
    expected = torch.full((B, 2, H), OFFSET ** 2 * tokens * D, dtype=torch.float64)
    assert torch.allclose(stored.err2[:, :, 1], expected, rtol=1e-6)
    assert torch.allclose(stored.sig2[:, :, 1], sig2, rtol=1e-12)
    assert torch.allclose(stored.noise_std()[:, :, 1], torch.full((B, 2, H), OFFSET, dtype=torch.float64), rtol=1e-6)
    sqnr = stored.sqnr_db()  # [B, L, 2], summed over heads
    assert sqnr.shape == (B, 2, 2)
    assert torch.allclose(sqnr[:, :, 1], 10 * torch.log10(sig2.sum(-1) / (OFFSET ** 2 * tokens * D * H)), atol=1e-6)
    assert (sqnr[:, :, 0] > 200).all()  # no key error: far above any quantizer


def test_a_zero_noise_twin_is_the_fp_cache_bit_for_bit():
    twin, fp = NoiseTwinCache(1, 3, 1, torch.zeros(B, 1, 2, H)), KVCache(1, 3, 1)
    for q, k, v, rope in frames(5):
        assert torch.equal(twin.attend(0, q, k, v, rope), fp.attend(0, q, k, v, rope))


def test_twin_noise_has_the_asked_std_per_trajectory_head_and_kv_and_is_seeded():
    std = torch.tensor([0.1, 0.5, 1.0, 2.0]).view(1, 1, 2, 2).expand(B, 1, 2, 2).clone()
    std[1] *= 3
    x = torch.randn(B, H, 4096, D)
    twin = NoiseTwinCache(1, 3, 1, std, seed=7)
    k, v = twin._store(0, 0, x, x)
    for i, got in enumerate((k, v)):
        measured = (got - x).std(dim=(-2, -1))  # [B, H]
        assert torch.allclose(measured, std[:, 0, i], rtol=0.02), (measured, std[:, 0, i])
    again = NoiseTwinCache(1, 3, 1, std, seed=7)._store(0, 0, x, x)
    other = NoiseTwinCache(1, 3, 1, std, seed=8)._store(0, 0, x, x)
    assert torch.equal(again[0], k) and torch.equal(again[1], v) and not torch.equal(other[0], k)


def test_a_twin_of_the_wrong_shape_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"\[B, 2, 2, H\]"):
        NoiseTwinCache(2, 3, 1, torch.zeros(B, 1, 2, H))


def test_evaluate_rolls_out_each_schemes_twin_and_reports_it(tiny_world):
    world = as_world(tiny_world)
    recipes = {name: build_baseline(name, world.info) for name in ("fp16", "naive2")}
    trajs = make_trajectories(["orbit", "static"], "evaluation", 2, 10)
    runs = evaluate(world, recipes, trajs, 16, 1, torch.device("cpu"), attention=False, twin=True)
    rep = report_mod.build(runs, [], {}, 30.0)
    twins = {n: rep["schemes"][n]["metrics"]["twin"] for n in recipes}
    assert set(twins["naive2"]["families"]) == {"orbit", "static"}
    fp16_sqnr, naive_sqnr = (min(twins[n]["all"]["sqnr_db"]["k"] + twins[n]["all"]["sqnr_db"]["v"]) for n in recipes)
    assert fp16_sqnr > 60 > 20 > naive_sqnr > 0  # float16 rounding vs 2 bits
    fp16_twin = twins["fp16"]["all"]["windows"]["0-16"]["twin"]
    naive_twin = twins["naive2"]["all"]["windows"]["0-16"]["twin"]
    assert fp16_twin > naive_twin + 10  # the twin's error grows with the scheme's
    for name in recipes:
        for r in runs[name].trajs:
            assert r.series["psnr_twin"].shape == r.series["psnr_ref"].shape
            assert len(r.sqnr_db["k"]) == world.info.num_layers
        c = twins[name]["all"]["windows"]["0-16"]
        assert math.isclose(c["gap"], c["scheme"] - c["twin"], abs_tol=1e-9)
    md = report_mod.twin_markdown(rep)
    assert "| naive2 | static |" in md and "| fp16 | all |" in md
    without = evaluate(world, recipes, trajs, 16, 1, torch.device("cpu"), attention=False, twin=False)
    assert report_mod.build(without, [], {}, 30.0)["schemes"]["naive2"]["metrics"]["twin"] == {}
    assert report_mod.twin_markdown(report_mod.build(without, [], {}, 30.0)) == ""
    # the twin never changes the scheme's own rollout
    assert all(torch.equal(a.series["psnr_ref"], b.series["psnr_ref"]) for a, b in zip(runs["naive2"].trajs, without["naive2"].trajs))

"""The noise twin: the stored error it is sized from, the noise it adds, and the report rows."""

import math

import pytest
import torch

from calibrate.adapters import as_world
from calibrate.cache import KVCache, Rope
from calibrate.evaluate import report as report_mod
from calibrate.evaluate.metrics import DEFAULT_WINDOWS, window_index
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


def test_stored_error_is_the_held_history_against_the_fp_history_per_window():
    window, sinks, W = 3, 1, len(DEFAULT_WINDOWS)
    shadow = ShadowCache(2, window, sinks, {"offset": OffsetValues(2, window, sinks)}, attention=False, stored=True)
    fp = KVCache(2, window, sinks)
    sig2 = torch.zeros(W, B, 2, H, dtype=torch.float64)  # values only: [window, B, layer, head]
    tokens = [0] * W  # held tokens summed in each window (layer 0; layer 1 holds the same)
    for i, (q, k, v, rope) in enumerate(frames(20)):  # steps in windows 0-16 and 16-64
        for layer in range(2):
            fp.attend(layer, q, k, v, rope)
            held_v = fp.read(layer, fp.history(layer))[1] if fp.history(layer) else None
            if held_v is not None:
                sig2[window_index(i), :, layer] += held_v.double().pow(2).sum((-2, -1))
                tokens[window_index(i)] += held_v.shape[2] if layer == 0 else 0
            shadow.attend(layer, q, k, v, rope)
    stored = shadow.stored["offset"]
    assert tokens[0] and tokens[1] and not any(tokens[2:])
    assert torch.equal(stored.err2[:, :, :, 0], torch.zeros(W, B, 2, H, dtype=torch.float64))  # keys exact
    for w in range(W):
        expected = torch.full((B, 2, H), OFFSET ** 2 * tokens[w] * D, dtype=torch.float64)
        assert torch.allclose(stored.err2[w, :, :, 1], expected, rtol=1e-6)
        assert stored.count[w, 0] == tokens[w] * D
    assert torch.allclose(stored.sig2[:, :, :, 1], sig2, rtol=1e-12)
    # the same power in every window here, measured or not (a window without a step takes the whole rollout's)
    for std in (stored.noise_std(), stored.noise_std(per_window=False)):
        assert torch.allclose(std[..., 1, :], torch.full(std[..., 1, :].shape, OFFSET, dtype=torch.float64), rtol=1e-6)
    assert stored.noise_std().shape == (W, B, 2, 2, H) and stored.noise_std(per_window=False).shape == (B, 2, 2, H)
    sqnr = stored.sqnr_db()  # [B, L, 2], the whole rollout, summed over heads
    assert sqnr.shape == (B, 2, 2)
    assert torch.allclose(sqnr[:, :, 1], 10 * torch.log10(sig2.sum((0, -1)) / (OFFSET ** 2 * sum(tokens) * D * H)), atol=1e-6)
    assert (sqnr[:, :, 0] > 200).all()  # no key error: far above any quantizer
    per = stored.sqnr_db(per_window=True)  # [W, B, L, 2]
    for w in (0, 1):
        assert torch.allclose(per[w, :, :, 1], 10 * torch.log10(sig2[w].sum(-1) / (OFFSET ** 2 * tokens[w] * D * H)), atol=1e-6)


def test_a_twin_gives_each_frame_the_power_of_its_window():
    std = torch.zeros(len(DEFAULT_WINDOWS), B, 1, 2, H)
    std[0] = 1.0  # frames 0-15 get noise, the others none
    twin = NoiseTwinCache(1, 3, 1, std, seed=3)
    x = torch.randn(B, H, T, D)
    early, later, past_the_end = twin._store(0, 15, x, x), twin._store(0, 16, x, x), twin._store(0, 10_000, x, x)
    assert not torch.equal(early[0], x) and not torch.equal(early[1], x)
    assert all(torch.equal(t, x) for t in later + past_the_end)
    one = torch.rand(B, 1, 2, H)  # [B, L, 2, H]: the same std in every window, the same draws as per-window copies
    a = NoiseTwinCache(1, 3, 1, one, seed=5)._store(0, 40, x, x)
    b = NoiseTwinCache(1, 3, 1, one.expand(len(DEFAULT_WINDOWS), -1, -1, -1, -1).clone(), seed=5)._store(0, 40, x, x)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


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
    with pytest.raises(ValueError, match=r"\[W, B, 2, 2, H\] or \[B, 2, 2, H\]"):
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

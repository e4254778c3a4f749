import json
import math

import pytest
import torch
from safetensors.torch import save_file

from calibrate import stats as S
from calibrate import stats_report as V
from calibrate.sample import QuerySample, merge_queries

L, H, D = 2, 2, 8
CFG = S.KVStatsConfig(num_layers=L, num_heads=H, head_dim=D, num_bins=64, hist_range=(-4.0, 4.0),
                      bucket_size=4, max_frames=32, max_age=8)


def _frames(seed, num_frames=6, B=2, T=16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [(scale * torch.randn(B, H, T, D, generator=g), scale * torch.randn(B, H, T, D, generator=g))
            for _ in range(num_frames)]


def _stats(frames, cfg=CFG, first_index=0):
    st = S.KVStats(cfg)
    for f, (k, v) in enumerate(frames):
        for layer in range(cfg.num_layers):
            st.update(layer, k + layer, v * (layer + 1), first_index + f)
    return st


def _assert_same(a, b, rtol=1e-12):
    """Exact for integer tensors and min/max rules; float sums up to summation order."""
    assert a.tensors.keys() == b.tensors.keys()
    for name, ta in a.tensors.items():
        tb = b.tensors[name]
        if ta.dtype == torch.int64 or S.merge_rule(name) != "sum":
            assert torch.equal(ta, tb), name
        else:
            torch.testing.assert_close(ta, tb, rtol=rtol, atol=1e-12, msg=name)


def _all_values(frames, kind, layer):
    xs = [(k + layer) if kind == "k" else v * (layer + 1) for k, v in frames]
    return torch.cat(xs, 2).double().permute(1, 0, 2, 3).reshape(H, -1, D)  # [H, N, D]


def test_streaming_equals_batch():
    frames = _frames(0)
    cfg = S.KVStatsConfig(**{**json.loads(CFG.to_json()), "bucket_size": 32})  # all frames in bucket 0
    streamed = _stats(frames, cfg)
    batch = S.KVStats(cfg)
    k_all, v_all = torch.cat([k for k, _ in frames], 2), torch.cat([v for _, v in frames], 2)
    for layer in range(L):
        batch.update(layer, k_all + layer, v_all * (layer + 1), 0)
    _assert_same(streamed, batch)


def test_moments_gram_and_minmax_match_torch():
    frames = _frames(1)
    st = _stats(frames)
    for kind in S.KINDS:
        for layer in range(L):
            x = _all_values(frames, kind, layer)
            torch.testing.assert_close(V.mean(st, kind)[layer], x.mean(1), rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(V.var(st, kind)[layer], x.var(1, unbiased=False), rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(st[f"{kind}.gram"][layer], x.transpose(1, 2) @ x, rtol=1e-9, atol=1e-9)
            assert torch.equal(st[f"{kind}.min"][layer], x.amin(1))
            assert torch.equal(st[f"{kind}.absmax"][layer], x.abs().amax(1))
            assert int(st[f"{kind}.hist"][layer].sum()) == x.numel()
            assert int(st[f"{kind}.count"][layer]) == x.shape[1]


def test_merge_is_order_independent_and_associative():
    a, b, c = (_stats(_frames(s), first_index=4 * s) for s in (2, 3, 4))
    abc = S.merge(a, S.merge(b, c))
    _assert_same(abc, S.merge(S.merge(a, b), c))
    _assert_same(abc, S.merge(c, S.merge(a, b)))
    _assert_same(abc, S.merge(S.merge(c, b), a))
    # and equals one summary of all the data
    whole = S.KVStats(CFG)
    for s in (2, 3, 4):
        for f, (k, v) in enumerate(_frames(s)):
            for layer in range(L):
                whole.update(layer, k + layer, v * (layer + 1), 4 * s + f)
    _assert_same(abc, whole)


def test_merge_with_empty_is_identity_and_configs_must_match():
    a = _stats(_frames(5))
    _assert_same(S.merge(a, S.KVStats(CFG)), a, rtol=0)
    other = S.KVStats(S.KVStatsConfig(num_layers=L, num_heads=H, head_dim=D))
    with pytest.raises(ValueError, match="different configs"):
        S.merge(a, other)


def test_percentiles_within_one_bin_of_torch_quantile():
    frames = _frames(6, num_frames=64)  # 2048 tokens per channel
    cfg = S.KVStatsConfig(num_layers=L, num_heads=H, head_dim=D, num_bins=256, hist_range=(-16.0, 16.0))
    st = _stats(frames, cfg)
    width = cfg.bin_width
    for kind in S.KINDS:
        for q in (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0):
            est = V.percentile(st, kind, q)
            for layer in range(L):
                exact = _all_values(frames, kind, layer).quantile(q, dim=1)
                assert (est[layer] - exact).abs().max() <= width, (kind, q, layer)
    # the extremes are exact (clamped to min / max)
    assert torch.equal(V.percentile(st, "k", 0.0), st["k.min"])
    assert torch.equal(V.percentile(st, "k", 1.0), st["k.max"])


def test_out_of_range_values_land_in_edge_bins():
    st = S.KVStats(CFG)
    x = torch.zeros(1, H, 3, D)
    x[:, :, 0], x[:, :, 1] = -100.0, 100.0
    st.update(0, x, x, 0)
    hist = st["k.hist"][0]
    assert (hist[..., 0] == 1).all() and (hist[..., -1] == 1).all() and int(hist.sum()) == 3 * H * D


def test_kurtosis_gaussian_and_heavy_tail():
    g = torch.Generator().manual_seed(7)
    gauss = S.KVStats(CFG)
    heavy = S.KVStats(CFG)
    laplace = torch.distributions.Laplace(0.0, 1.0)
    torch.manual_seed(7)
    for f in range(16):
        x = torch.randn(8, H, 32, D, generator=g) + 3.0  # a mean offset must not matter
        gauss.update(0, x, x, f)
        y = laplace.sample((8, H, 32, D))
        heavy.update(0, y, y, f)
    kg, kh = V.kurtosis(gauss, "k")[0], V.kurtosis(heavy, "k")[0]
    assert abs(float(kg.mean()) - 3.0) < 0.15
    assert float(kh.mean()) > 4.5  # Laplace: 6


def test_outlier_channel_is_found():
    st = S.KVStats(CFG)
    for f, (k, v) in enumerate(_frames(8)):
        k = k.clone()
        k[:, 1, :, 5] *= 20
        st.update(0, k, v, f)
    top = V.outlier_channels(st, "k", top_k=3)[0][0]
    assert (top["head"], top["channel"]) == (1, 5) and top["ratio"] > 5
    assert V.outlier_channels(st, "v", top_k=1)[0][0]["ratio"] < 3


def test_anchor_frame_is_detected():
    st = S.KVStats(CFG)
    Q, window = CFG.query_heads, 6
    for newest in range(40):
        kept = [0] + list(range(max(1, newest - window + 1), newest + 1)) if newest else [0]
        probs = torch.full((2, Q, len(kept)), 0.2 / max(len(kept) - 1, 1))
        probs[..., 0] = 0.8 if len(kept) > 1 else 1.0
        for layer in range(L):
            st.update_attention(layer, probs, kept, newest)
    assert V.anchor_frames(st) == [[0], [0]]
    profile = V.age_profile(st)
    torch.testing.assert_close(profile.sum(-1), torch.ones(L, Q, dtype=torch.float64))
    assert float(profile[0, 0, -1]) > 0.6  # frame 0 is old: its mass sits in the clipped last age


def test_frame_mass_sums_tokens_and_averages_queries():
    probs = torch.softmax(torch.randn(2, H, 5, 3 * 4), -1)
    mass = S.frame_mass(probs, tokens_per_frame=4)
    assert mass.shape == (2, H, 3)
    torch.testing.assert_close(mass.sum(-1), torch.ones(2, H))
    torch.testing.assert_close(mass[..., 1], probs[..., 4:8].sum(-1).mean(-1))


def test_range_drift_follows_buckets():
    st = S.KVStats(CFG)
    for f in range(12):
        x = torch.ones(1, H, 2, D) * (1.0 if f < 4 else 3.0)
        st.update(0, x, x, f)
    drift = V.range_drift(st, "k")
    assert drift[0, :, 0].tolist() == [1.0] * H and drift[0, :, 1].tolist() == [3.0] * H
    assert drift[0, :, 3:].eq(0).all() and drift[1].eq(0).all()  # empty buckets / layer
    st.update(0, torch.ones(1, H, 2, D), torch.ones(1, H, 2, D), 10_000)  # past max_frames
    assert int(st["k.bucket_count"][0, -1]) == 2


def test_save_load_round_trip(tmp_path):
    st = _stats(_frames(9))
    st.update_attention(0, torch.full((2, H, 3), 1 / 3), [0, 4, 5], 5)
    qs = QuerySample(num_layers=L, num_heads=H, head_dim=D, capacity=10, seed=3)
    qs.update(0, torch.randn(2, H, 16, D))
    path = tmp_path / "stats.safetensors"
    st.save(path, model={"name": "tiny", "num_layers": L}, samples={"q": qs})
    assert [p.name for p in tmp_path.iterdir()] == ["stats.safetensors"]  # no temp file left
    loaded = S.load_stats(path)
    assert loaded.stats.config == st.config and loaded.model == {"name": "tiny", "num_layers": L}
    _assert_same(loaded.stats, st, rtol=0)
    for name, t in qs.to_tensors().items():
        assert torch.equal(loaded.samples['q'].to_tensors()[name], t)
    assert S.KVStats.load(path).config == st.config


def test_load_rejects_bad_files(tmp_path):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01 not safetensors")
    with pytest.raises(ValueError, match="garbage.safetensors"):
        S.load_stats(garbage)
    wrong = tmp_path / "wrong.safetensors"
    save_file({"x": torch.zeros(1)}, str(wrong), metadata={"format": "recipe", "format_version": "1.0"})
    with pytest.raises(ValueError, match=r"wrong.safetensors: format is 'recipe'"):
        S.load_stats(wrong)
    bad_shape = tmp_path / "shape.safetensors"
    st = S.KVStats(CFG)
    tensors = st.to_tensors()
    tensors["k.gram"] = torch.zeros(L, H, D, D - 1, dtype=torch.float64)
    meta = {"format": S.FORMAT, "format_version": S.FORMAT_VERSION, "config": CFG.to_json()}
    save_file(tensors, str(bad_shape), metadata=meta)
    with pytest.raises(ValueError, match=r"shape.safetensors: .*k.gram"):
        S.load_stats(bad_shape)
    with pytest.raises(ValueError, match="missing.safetensors"):
        S.load_stats(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("value", [0.0, 2.5])
def test_degenerate_inputs_give_no_nan(value, tmp_path):
    views = lambda st: [V.mean(st, "k"), V.std(st, "k"), V.kurtosis(st, "v"), V.percentile(st, "k", 0.3),
                        V.outlier_ratio(st, "v"), V.range_drift(st, "k"), V.age_profile(st),
                        V.age_ratio(st), V.anchor_ratio(st)]
    empty = S.KVStats(CFG)
    st = S.KVStats(CFG)
    for f in range(3):
        x = torch.full((1, H, 4, D), value)
        st.update(0, x, x, f)
    st.update_attention(0, torch.ones(1, H, 1), [0], 0)
    for s in (empty, st):
        for t in views(s):
            assert torch.isfinite(t).all()
        json.dumps(V.report(s), allow_nan=False)
    assert V.kurtosis(st, "k").eq(0).all()
    assert torch.equal(V.percentile(st, "k", 0.3)[0], torch.full((H, D), value, dtype=torch.float64))
    png = tmp_path / "empty.png"
    V.plot_report(empty, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_bad_inputs_raise_value_error():
    st = S.KVStats(CFG)
    with pytest.raises(ValueError, match="non-finite"):
        st.update(0, torch.full((1, H, 1, D), math.nan), torch.zeros(1, H, 1, D), 0)
    with pytest.raises(ValueError, match="layer"):
        st.update(L, torch.zeros(1, H, 1, D), torch.zeros(1, H, 1, D), 0)
    with pytest.raises(ValueError, match=r"\[B, 2, T, 8\]"):
        st.update(0, torch.zeros(1, H, 1, D + 1), torch.zeros(1, H, 1, D), 0)
    with pytest.raises(ValueError, match="frame_indices"):
        st.update_attention(0, torch.ones(1, H, 2) / 2, [3, 3], 3)
    with pytest.raises(ValueError, match="hist_range"):
        S.KVStatsConfig(num_layers=1, num_heads=1, head_dim=1, hist_range=(1.0, -1.0))


def test_report_and_plot(tmp_path):
    st = _stats(_frames(10))
    for newest in range(5):
        kept = list(range(newest + 1))
        st.update_attention(0, torch.full((1, H, newest + 1), 1 / (newest + 1)), kept, newest)
    rep = V.report(st, top_k=2)
    json.dumps(rep, allow_nan=False)
    assert len(rep["k"]["outlier_channels"]) == L and len(rep["k"]["outlier_channels"][0]) == 2
    assert rep["attention"]["anchor_frames"] == [[], []]
    assert rep["attention"]["age_profile"]["ages"] == [0, 1, 2, 3, 4]
    assert rep["v"]["range_drift"]["bucket_frames"] == [[0, 4], [4, 8]]
    png = tmp_path / "stats.png"
    V.plot_report(st, png)
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000


# ---- QuerySample ----------------------------------------------------------------------
def _ids(num_tokens, start=0):
    """Queries whose every entry is the token's id, so a sampled row names its source."""
    ids = torch.arange(start, start + num_tokens, dtype=torch.float32)
    return ids.view(1, 1, -1, 1).expand(1, H, num_tokens, D).clone()


def test_query_reservoir_is_bounded_deterministic_and_uniformish():
    def run(seed):
        qs = QuerySample(num_layers=1, num_heads=H, head_dim=D, capacity=100, seed=seed)
        for f in range(50):
            qs.update(0, _ids(40, start=40 * f))
        return qs
    a, b = run(0), run(0)
    ids = a.samples(0)[:, 0, 0]
    assert a.samples(0).shape == (100, H, D) and int(a.num_seen_L[0]) == 2000
    assert torch.equal(a.samples(0), b.samples(0))
    assert not torch.equal(ids, run(1).samples(0)[:, 0, 0])
    assert len(set(ids.tolist())) == 100 and ids.min() >= 0 and ids.max() < 2000
    assert (a.samples(0) == ids.view(-1, 1, 1)).all()  # rows are whole input tokens
    assert 0.2 < float((ids >= 1000).float().mean()) < 0.8  # later tokens do replace early ones


def test_query_merge_bounds_membership_and_union():
    def sample(start, n, cap=50):
        qs = QuerySample(num_layers=1, num_heads=H, head_dim=D, capacity=cap, seed=start)
        qs.update(0, _ids(n, start))
        return qs
    a, b = sample(0, 200), sample(10_000, 80)
    m = merge_queries(a, b)
    ids = set(m.samples(0)[:, 0, 0].tolist())
    assert len(m.samples(0)) == 50 and int(m.num_seen_L[0]) == 280
    assert ids <= set(a.samples(0)[:, 0, 0].tolist()) | set(b.samples(0)[:, 0, 0].tolist())
    assert torch.equal(merge_queries(a, b).samples(0), m.samples(0))
    small = merge_queries(sample(0, 20), sample(10_000, 10))
    assert sorted(small.samples(0)[:, 0, 0].tolist()) == list(range(20)) + list(range(10_000, 10_010))


def test_sink_moments_are_those_of_the_sink_frames_alone():
    """A predictive sink code is sized by the sink frames' own spread: `update_sink` sums those only."""
    from calibrate.stats import KVStats
    from calibrate.stats_config import KVStatsConfig

    cfg = KVStatsConfig(num_layers=1, num_heads=2, head_dim=4)
    s = KVStats(cfg)
    x = torch.randn(3, 2, 5, 4, dtype=torch.float64)
    s.update_sink("v", 0, x)
    assert int(s["v.sink_count"][0]) == 15 and int(s["k.sink_count"][0]) == 0
    flat = x.permute(1, 0, 2, 3).reshape(2, 15, 4)
    torch.testing.assert_close(s["v.sink_gram"][0], flat.transpose(1, 2) @ flat)
    torch.testing.assert_close(s["v.sink_sum"][0], flat.sum(1))

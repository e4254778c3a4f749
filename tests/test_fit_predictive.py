"""Properties the predictive fitter promises (fit/predictive_search.py), on a tiny random TinyWorld."""

import json
from dataclasses import replace

import pytest
import torch

from calibrate import calibration
from calibrate.adapters import as_world
from calibrate.fit.predictive_search import BudgetError
from calibrate.memory import fp16_cache_bytes
from calibrate.recipe import load_recipe, save_recipe, to_bytes
from calibrate.replay import rollout_batch
from reference_runtime import ReferenceCache
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
    cache = ReferenceCache.from_recipe(recipe, window=16, sink_frames=1)
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
    assert {"upgrades", "base_bits", "head_bits"} <= set(fit)
    assert "closed_loop" not in fit  # off by default: one candidate, nothing rolled out


def test_closed_loop_when_asked_rolls_out_the_scales_that_fit_the_budget(model):
    recipe, record = calibration.fit(tiny_fit_config(closed_loop_scales=[0.7, 1.0, 1.4, 2.0]), model, CPU)
    scores = record["closed_loop"]["scores"]
    # candidates whose finer steps would widen the anchors past the budget are not rolled out
    assert "fitted" in scores and set(scores) <= {"fitted", "inter_x0.7", "inter_x1.4", "inter_x2"} and len(scores) > 1
    assert record["closed_loop"]["chosen"] in scores and record["bits_per_element"] <= 2.5 + 1e-9
    chosen = record["closed_loop"]["chosen"]
    assert record.get("inter_scale", 1.0) == (1.0 if chosen == "fitted" else float(chosen[len("inter_x"):]))


def test_same_config_and_seed_give_identical_bytes(fitted, model):
    again, _ = calibration.fit(tiny_fit_config(), model, CPU)
    assert to_bytes(again) == to_bytes(fitted[0])


def test_mixed_precision_only_adds_bits_within_the_budget(fitted, model):
    _, record = fitted
    off, off_record = calibration.fit(tiny_fit_config(mixed_precision=False), model, CPU)
    assert off_record["upgrades"] == []
    assert off_record["bits_per_element"] <= record["bits_per_element"] <= 2.5 + 1e-9
    assert all(u["gain"] > 0 for u in record["upgrades"])


def test_every_head_starts_at_the_widest_base_width_up_to_the_cap(model):
    """fit.base_bits_max caps the width every head starts at (the allocator spends the rest), in
    quarter bits down to 1: a cap above what fits changes nothing."""
    widths = {}
    for cap in (2.0, 1.6, 1.25, 1.0):
        recipe, record = calibration.fit(tiny_fit_config(base_bits_max=cap, mixed_precision=False), model, CPU)
        widths[cap] = {w for heads in record["head_bits"].values() for w in heads}
        assert widths[cap] == {record["base_width"]} and record["bits_per_element"] <= 2.5 + 1e-9
    widest = widths[2.0].pop()
    assert widths[1.6] == {min(1.5, widest)} and widths[1.25] == {min(1.25, widest)} and widths[1.0] == {1.0}


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


def _reference_allocate(info, traces, refs, fits, cfg, window, sink_frames, rotary_coords):
    """The mixed-precision greedy as first written (reference): every pending offer priced with the
    whole memory model (assemble + bits_per_element) at every step."""
    from dataclasses import replace

    from calibrate.fit.predictive_codes import assemble, head_objective, reconstruct
    from calibrate.fit.predictive_search import MAX_AVG_BITS
    from calibrate.memory import bits_per_element

    lam, step = cfg.lambda_temporal, cfg.bits_step
    bits_now = lambda: bits_per_element(info, assemble(info, fits, cfg, rotary_coords).scheme, window, sink_frames)

    def layer_scores(layer, which=None, up=None):
        pair = fits[layer]
        k_hat = reconstruct(traces[layer], pair["k"], cfg, up if which == "k" else None)
        v_hat = reconstruct(traces[layer], pair["v"], cfg, up if which == "v" else None)
        return head_objective(traces[layer], refs[layer], k_hat, v_hat, lam)

    def offers(layer, current):
        out = []
        for kind in ("k", "v"):
            heads = fits[layer][kind].heads
            up = [replace(c, avg_bits=min(c.avg_bits + step, MAX_AVG_BITS)) for c in heads]
            new = layer_scores(layer, kind, up)
            out += [(float(current[h] - new[h]), layer, kind, h) for h in range(len(heads)) if up[h] != heads[h]]
        return out

    pending = {l: offers(l, layer_scores(l)) for l in range(len(traces))}
    taken = []
    while True:
        current, best = bits_now(), None
        for gain, layer, kind, h in [o for layer_offers in pending.values() for o in layer_offers]:
            if gain <= 0:
                continue
            heads = fits[layer][kind].heads
            old = heads[h]
            heads[h] = replace(old, avg_bits=old.avg_bits + step)
            cost = bits_now() - current
            heads[h] = old
            if cost <= 0 or current + cost > cfg.budget_bits + 1e-9:
                continue
            if best is None or gain / cost > best[0]:
                best = (gain / cost, gain, cost, layer, kind, h)
        if best is None:
            return taken
        _, gain, cost, layer, kind, h = best
        heads = fits[layer][kind].heads
        heads[h] = replace(heads[h], avg_bits=heads[h].avg_bits + step)
        pending[layer] = offers(layer, layer_scores(layer))
        taken.append({"layer": layer, "tensor": kind, "head": h, "avg_bits": heads[h].avg_bits,
                      "gain": round(gain, 6), "bits_cost": round(cost, 4)})


@pytest.mark.parametrize("budget", [2.5, 3.0])
def test_incremental_mixed_precision_takes_the_reference_greedy_steps(model, budget):
    """The [L, 2, H] offer table with per-head byte terms chooses exactly what pricing every offer
    with the whole memory model chooses: the same upgrades, gains, costs and final widths."""
    import copy
    from dataclasses import replace

    from calibrate.fit.objective import attention_outputs
    from calibrate.fit.predictive_search import _allocate, fit_predictive
    from calibrate.trace import LayerTraces

    cfg = tiny_fit_config(budget_bits=budget, mixed_precision=False)
    recorder = calibration.calibration_recording(cfg, model, CPU)
    traces = LayerTraces(recorder.traces[0], 16, 1, cfg.fit.trace_trajectories)
    coords = recorder.traces[0].rotary_coords
    info = as_world(model).info
    _, _, fits = fit_predictive(info, traces, recorder.stats, cfg.fit, 16, 1, coords)
    refs = [attention_outputs(t) for t in traces]
    mine, theirs = copy.deepcopy(fits), copy.deepcopy(fits)
    fit_cfg = replace(cfg.fit, mixed_precision=True)
    got = _allocate(info, traces, refs, mine, fit_cfg, 16, 1, coords)
    want = _reference_allocate(info, traces, refs, theirs, fit_cfg, 16, 1, coords)
    assert got and got == want
    assert [[f[k].heads for k in ("k", "v")] for f in mine] == [[f[k].heads for k in ("k", "v")] for f in theirs]


def test_a_grid_whose_top_most_heads_chose_is_named():
    """WanWorld's first recipe: intra_mult 1.7, the top of the grid it searched, in every head."""
    from calibrate.config import FitConfig
    from calibrate.fit.predictive_search import grid_edges

    cfg = FitConfig()
    grid = [[a, b] for a in (1.0, 1.3, 1.7) for b in cfg.inter_mults]
    mid = cfg.inter_mults[1]
    layers = [{"k": {"intra_mult": [1.7, 1.7], "inter_mult": [mid, mid], "grid": grid},
               "v": {"intra_mult": [1.7, 1.0], "inter_mult": [mid, max(cfg.inter_mults)], "grid": grid}}]
    (line,) = grid_edges(layers, cfg)
    assert line.startswith("fit: 3 of 4 heads chose the largest intra_mult searched (up to 1.7)")
    assert "fit.intra_mult_max" in line
    layers[0]["k"]["intra_mult"] = [1.0, 1.0]  # 1 of 4 at the top: no line
    assert grid_edges(layers, cfg) == []


@pytest.mark.parametrize("axis", [0, 1], ids=["intra", "inter"])
def test_a_step_grid_grows_until_no_head_chooses_its_top(model, axis):
    """From a far too fine grid (0.3) on one axis the search must widen that axis by x1.3 while any
    head's best pair sits at its top, choose each head's lowest score over everything it searched,
    and stop at the axis's cap (a cap at the grid's own top searches the grid alone). The other axis
    keeps its grid, capped at its top."""
    from calibrate.config import FitConfig
    from calibrate.fit.predictive_search import GRID_GROWTH, fit_predictive
    from calibrate.trace import LayerTraces

    role, other_role = ("intra_mult", "inter_mult")[axis], ("intra_mult", "inter_mult")[1 - axis]
    other_top = max(getattr(FitConfig(), f"{other_role}s"))

    def search(**fit):
        cfg = tiny_fit_config(mixed_precision=False, **{f"{role}s": [0.3], f"{role}_max": 8.0,
                                                        f"{other_role}_max": other_top, **fit})
        recorder = calibration.calibration_recording(cfg, model, CPU)
        traces = LayerTraces(recorder.traces[0], 16, 1, cfg.fit.trace_trajectories)
        _, record, _ = fit_predictive(as_world(model).info, traces, recorder.stats, cfg.fit, 16, 1,
                                      recorder.traces[0].rotary_coords)
        return cfg.fit, record["layers"]

    cfg, layers = search()
    other = (cfg.intra_mults, cfg.inter_mults)[1 - axis]
    grown = 0
    for entry in layers:
        for kind in ("k", "v"):
            e = entry[kind]
            values = sorted({p[axis] for p in e["grid"]})
            pairs = {(a, b) if axis == 0 else (b, a) for a in values for b in other}
            assert values[0] == 0.3 and {tuple(p) for p in e["grid"]} == pairs
            assert all(round(x * GRID_GROWTH, 2) == y for x, y in zip(values, values[1:]))
            grown += len(values) > 1
            at_cap = round(values[-1] * GRID_GROWTH, 2) > getattr(cfg, f"{role}_max")
            assert at_cap or all(m < values[-1] for m in e[role])
            for h, (a, b) in enumerate(zip(e["intra_mult"], e["inter_mult"])):
                column = [s[h] for s in e["scores"]]
                assert column[e["grid"].index([a, b])] == min(column)
    assert grown > 0
    _, capped = search(**{f"{role}_max": 0.3})
    assert all({p[axis] for p in entry[kind]["grid"]} == {0.3} for entry in capped for kind in ("k", "v"))


def _search(model, **fit):
    """fit_predictive on the tiny world's recording: (fit config, record, per-tensor fits)."""
    from calibrate.fit.predictive_search import fit_predictive
    from calibrate.trace import LayerTraces

    cfg = tiny_fit_config(**fit)
    recorder = calibration.calibration_recording(cfg, model, CPU)
    traces = LayerTraces(recorder.traces[0], 16, 1, cfg.fit.trace_trajectories)
    _, record, fits = fit_predictive(as_world(model).info, traces, recorder.stats, cfg.fit, 16, 1,
                                     recorder.traces[0].rotary_coords)
    return cfg.fit, record, fits


def test_steps_are_searched_again_at_the_widths_the_allocator_left(model):
    """fit.refine_steps: after mixed precision every head's multipliers are the lowest score of a
    second search, run at each head's final width (the scores differ from the base width's where
    the allocator widened a head); off, they stay the base width's choice."""
    cfg, record, fits = _search(model)
    assert record["upgrades"] and len(record["refined"]) == TINY_WORLD.num_layers
    assert record["bits_per_element"] <= cfg.budget_bits + 1e-9
    widened = {(u["layer"], u["tensor"]) for u in record["upgrades"]}
    for layer, (entry, base) in enumerate(zip(record["refined"], record["layers"])):
        for kind in ("k", "v"):
            e = entry[kind]
            heads, taken = fits[layer][kind].heads, e if entry["kept"] else base[kind]  # kept: within the budget
            assert [c.intra_mult for c in heads] == taken["intra_mult"]
            assert [c.inter_mult for c in heads] == taken["inter_mult"]
            for h, (a, b) in enumerate(zip(e["intra_mult"], e["inter_mult"])):
                column = [s[h] for s in e["scores"]]
                assert column[e["grid"].index([a, b])] == min(column)
            if (layer, kind) not in widened and kind == "k":  # same widths, same K search (V sees the new K)
                assert e["scores"] == base[kind]["scores"]
        if any((layer, kind) in widened for kind in ("k", "v")):
            assert entry["v"]["scores"] != base["v"]["scores"]
    _, off, off_fits = _search(model, refine_steps=False)
    assert "refined" not in off
    for layer, base in enumerate(off["layers"]):
        for kind in ("k", "v"):
            assert [c.intra_mult for c in off_fits[layer][kind].heads] == base[kind]["intra_mult"]


def test_a_tensor_left_at_the_base_width_reuses_its_first_search(model, monkeypatch):
    """The second search takes the first search's answer for a tensor whose heads all kept the base
    width (and, for V, whose layer's K did too): that answer equals searching it again, scores and
    all, and the reuse happens on the tiny world."""
    from calibrate.fit import predictive_search as ps

    search, reused = ps._layer_steps, []

    def checked(layer, trace, reference, stats, cfg, pre, widths, peaks, known=None):
        out = search(layer, trace, reference, stats, cfg, pre, widths, peaks, known)
        if known:
            again = search(layer, trace, reference, stats, cfg, pre, widths, peaks)
            assert out == again
            reused.extend((layer, kind) for kind in known)
        return out

    monkeypatch.setattr(ps, "_layer_steps", checked)
    _, record, _ = _search(model)
    widened = {(u["layer"], u["tensor"]) for u in record["upgrades"]}
    assert reused and not widened & set(reused)


def test_steps_that_would_cross_the_budget_are_not_taken(model, monkeypatch):
    """A layer whose re-searched steps widen its anchors past fit.budget_bits keeps its base-width
    steps: here every re-search returns the finest pair (the widest anchors) and the budget is the
    bits the allocator reached, so no layer may take a pair that costs more."""
    from calibrate.fit import predictive_search as ps
    from calibrate.memory import bits_per_element

    cfg, record, fits = _search(model, refine_steps=False)
    before = {(layer, kind): list(pair[kind].heads) for layer, pair in enumerate(fits) for kind in ("k", "v")}
    info = as_world(model).info

    def finest(layer, trace, reference, stats, cfg, pre, widths, peaks, known=None):
        return {kind: {"intra_mult": [min(cfg.intra_mults)] * len(w), "inter_mult": [min(cfg.inter_mults)] * len(w)}
                for kind, w in widths.items()}

    monkeypatch.setattr(ps, "_layer_steps", finest)
    tight = replace(cfg, budget_bits=record["bits_per_element"])
    rotary = 3  # TinyWorld's rotary coordinates (the pose: x, y, yaw)
    L = info.num_layers
    refined = ps._refine_steps(info, [None] * L, [None] * L, fits, None, tight, True, rotary, 16, 1, ps.Shard(),
                               record["layers"], record["base_width"])
    assert bits_per_element(info, ps.assemble(info, fits, tight, rotary).scheme, 16, 1) <= tight.budget_bits + 1e-9
    assert not all(e["kept"] for e in refined)
    for layer, entry in enumerate(refined):
        for kind in ("k", "v"):
            heads = fits[layer][kind].heads
            if entry["kept"]:
                assert all(c.intra_mult == min(cfg.intra_mults) for c in heads)
            else:
                assert heads == before[(layer, kind)]


def test_a_sink_code_is_fitted_within_the_budget_and_its_bytes_counted(model):
    """fit.sink_bits > 0: every tensor carries a sink code of at most that width, the budget still
    holds with the sink's bytes (the runtime's own count), and frame 0 is held in it; with the
    default sink hold and refresh (format 1.5), the reference's bits (the sink widths of the
    uncoded components) are in the spec and in the bytes the budget holds."""
    recipe, record = calibration.fit(tiny_fit_config(sink_bits=6.0), model, CPU)
    assert record["sink_bits"] == 6.0 and record["bits_per_element"] <= 2.5 + 1e-9
    D = TINY_WORLD.head_dim
    for i in range(TINY_WORLD.num_layers):
        for kind in "kv":
            spec = recipe.spec(i, kind)
            assert spec.sink_token_bits is not None and all(0 < b <= 6 * D for b in spec.sink_token_bits)
            t = recipe.layer_tensors(i, kind)
            assert spec.sink_hold and spec.sink_refresh == 8
            assert spec.refresh_token_bits == (t["sink_bits"] * (t["channel_bits"] == 0)).sum(-1).tolist()  # by hand
    trajs = make_trajectories(["orbit"], "evaluation", 1, 40)
    cache = ReferenceCache.from_recipe(recipe, window=16, sink_frames=1)
    rollout_batch(as_world(model), trajs, cache, CPU)
    assert "sink" in cache._frames[0][0]["k"][0]
    assert cache.nbytes() == cache.predicted_nbytes(40)
    assert 16.0 * cache.nbytes() / fp16_cache_bytes(recipe.model, 40, 16, 1) <= 2.5 + 1e-9


def test_anchors_hold_the_peak_multiple_of_the_traced_deviations(model, monkeypatch):
    """`fit.anchor_peak_mult`: every coded component's anchor holds that multiple of the largest
    deviation the fit's trace showed (as `trace_peaks` gave it to the fitter), within the budget."""
    from calibrate.fit import predictive_search

    seen = []
    real = predictive_search.trace_peaks
    monkeypatch.setattr(predictive_search, "trace_peaks", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    recipe, record = calibration.fit(tiny_fit_config(anchor_peak_mult=3.0), model, CPU)
    assert record["anchor_peak_mult"] == 3.0 and record["bits_per_element"] <= 2.5 + 1e-9
    assert len(seen) == 2 * TINY_WORLD.num_layers  # K and V of every layer, in that order
    for i in range(TINY_WORLD.num_layers):
        for j, kind in enumerate(("k", "v")):
            peak = seen[2 * i + j]
            bits, anchor = recipe.tensor(i, kind, "channel_bits"), recipe.tensor(i, kind, "anchor_bits")
            reach = ((2 ** (anchor - 1) - 1).clamp_min(0) * recipe.tensor(i, kind, "unit")).float()
            coded = bits > 0
            assert bool((reach[coded] >= 3.0 * peak[coded] * (1 - 1e-6)).all()), (i, kind)

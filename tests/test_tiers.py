"""The memory plan: its format, the tiered runtime (host tier, recall by pose) and its byte model."""

import json
import math
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from calibrate.cache import Rope, kept_frames
from calibrate.plan import MemoryPlan, pose_distance
from calibrate.recipe import (LayerSpec, Recipe, RecipeError, Scheme, TensorSpec, TokenPolicy, load_recipe,
                              save_recipe, uniform_scheme)
from calibrate.fastcache import FastKVCache
from reference_runtime import ReferenceCache
from calibrate.tiers import SLOT_BASE, host_count, nearest, predicted_host_bytes, slot_nbytes, steady_device_bytes
from calibrate.types import ModelInfo
from toys import predictive_roles, refresh_fields

L, H, T, D = 2, 2, 4, 16
INFO = ModelInfo("toy", L, H, D, T, "f" * 16)
REPO = Path(__file__).resolve().parents[1]
RUNTIMES = {"reference": ReferenceCache, "fast": FastKVCache}


def pose_rope(poses_B3):
    """A rotary from a camera pose (x, y, yaw), the same function every time (as a model's)."""
    freqs = torch.linspace(0.2, 2.0, D // 2)
    angles = (poses_B3[:, None, 0:1] + 0.5 * poses_B3[:, None, 1:2]) * freqs \
        + poses_B3[:, None, 2:3] * torch.arange(1, T + 1)[None, :, None] * 0.3
    return Rope(angles, coords_BP=poses_B3, at=pose_rope)


def frames(poses_NB3, seed=0):
    """K/V of a slowly changing scene seen from `poses` [N, B, 3], with their ropes."""
    g = torch.Generator().manual_seed(seed)
    N, B = poses_NB3.shape[:2]
    k, v = torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g)
    out = []
    for f in range(N):
        k = k + 0.05 * torch.randn(B, H, T, D, generator=g)
        v = v + 0.05 * torch.randn(B, H, T, D, generator=g)
        out.append((k.clone(), v.clone(), pose_rope(poses_NB3[f])))
    return out


def predictive_recipe(pre_rotary=True, temporal=True, hold=False, refresh=0):
    """A predictive recipe fitted to `frames`-like data (2 layers, 2 heads); `hold`: with a sink code
    and the sink hold (format 1.4), `refresh` > 0 its reference refreshed (format 1.5)."""
    data = frames(torch.zeros(60, 2, 3), seed=7)
    tensors, layers = {}, []
    for i in range(L):
        specs = {}
        for j, kind in enumerate(("k", "v")):
            x = torch.stack([f[j] for f in data], dim=2)  # B H F T D
            roles = predictive_roles(x, sink_bits=6.0 if hold else 0.0)
            tensors.update({f"layers.{i}.{kind}.{r}": t for r, t in roles.items()})
            specs[kind] = TensorSpec(bits=2, kind="predictive", rotation="learned", temporal=temporal,
                                     rotary_coords=3 if (kind == "k" and pre_rotary) else 0,
                                     token_bits=roles["channel_bits"].sum(-1).tolist(),
                                     anchor_token_bits=roles["anchor_bits"].sum(-1).tolist(),
                                     sink_token_bits=roles["sink_bits"].sum(-1).tolist() if hold else None, sink_hold=hold,
                                     **refresh_fields(roles, refresh))
        layers.append(LayerSpec(**specs))
    return Recipe(INFO, Scheme("toy-pred", layers, TokenPolicy(sink_frames=0)), tensors)


def per_frame_recipe(bits=2):
    spec = TensorSpec(bits=bits, axis="token") if bits < 16 else TensorSpec()
    return Recipe(INFO, uniform_scheme(f"toy-{bits}", L, spec, spec, TokenPolicy(sink_frames=1)), {})


def with_plan(recipe, **fields):
    plan = MemoryPlan(**{"device_budget_bytes": 10**9, **fields})
    return Recipe(recipe.model, replace(recipe.scheme, policy=replace(recipe.scheme.policy, plan=plan)),
                  recipe.tensors, recipe.metadata, recipe.path)


def run(cache, data, queries=None):
    """Append every frame to every layer (telling the cache the next pose first)."""
    for f, (k, v, rope) in enumerate(data):
        if queries is not None:
            cache.expect(queries[f])
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)


# ---- the recall rule ------------------------------------------------------------------------------
def test_nearest_picks_exactly_the_nearest_poses_newest_first_on_ties():
    # candidates newest first, two trajectories (rows) with different poses
    poses = torch.tensor([
        [[0.0, 0.0, 0.0], [5.0, 5.0, 0.0]],
        [[1.0, 0.0, 0.0], [5.0, 5.0, 2 * math.pi + 0.5]],  # yaw compares modulo 2 pi
        [[0.0, 0.0, 0.0], [4.0, 5.0, 0.0]],  # ties row 0's first candidate: the newer (index 0) goes first
        [[0.0, 3.0, 0.0], [5.0, 5.0, 0.4]],
        [[0.3, 0.0, 0.1], [9.0, 9.0, 0.0]],
    ])
    query = torch.tensor([[0.0, 0.0, 0.0], [5.0, 5.0, 0.5]])
    got = nearest(poses, query, yaw_radius=1.0, count=3)
    assert got[:, 0].tolist() == [0, 2, 4]  # distances 0, 0, sqrt(0.09 + 0.01)
    assert got[:, 1].tolist() == [1, 3, 0]  # distances 0, 0.1, 0.5
    d = pose_distance(poses, query, 2.0)
    assert d[4, 0].item() == pytest.approx(math.sqrt(0.3**2 + (2 * 0.1) ** 2))
    assert d[1, 1].item() == pytest.approx(0.0, abs=1e-6)


def test_pose_distance_is_the_correctly_rounded_root():
    """FORMAT.md: float64 with IEEE's sqrt (torch's CPU float64 sqrt is 1 ulp off on ~1% of inputs)."""
    g = torch.Generator().manual_seed(0)
    poses, query = torch.randn(2000, 2, 3, generator=g) * 10, torch.randn(2, 3, generator=g)
    d = pose_distance(poses, query, 0.7)
    p, q = poses.double(), query.double()
    dyaw = p[..., 2] - q[..., 2]
    dyaw = dyaw - 2 * math.pi * ((dyaw + math.pi) / (2 * math.pi)).floor()
    sq = (p[..., 0] - q[..., 0]).square() + (p[..., 1] - q[..., 1]).square() + (0.7 * dyaw).square()
    assert d.dtype == torch.float64 and d.flatten().tolist() == [math.sqrt(v) for v in sq.flatten().tolist()]


def test_recall_places_the_nearest_host_frames_in_the_slots():
    """Hand-made poses: frame f of row 0 stands at x = f, of row 1 at x = -f; the query asks for
    x = 2.2 (row 0) and x = -5.9 (row 1): the slots must hold frames {2, 3} and {6, 5}."""
    N = 10
    xs = torch.arange(N, dtype=torch.float32)
    poses = torch.stack([torch.stack([xs, torch.zeros(N), torch.zeros(N)], -1),
                         torch.stack([-xs, torch.zeros(N), torch.zeros(N)], -1)], dim=1)  # [N, 2, 3]
    recipe = with_plan(predictive_recipe(), window=2, sink_frames=0, recall_slots=2, host_frames=16)
    cache = ReferenceCache.from_recipe(recipe)
    data = frames(poses)
    run(cache, data[:N - 1])
    cache.expect(torch.tensor([[2.2, 0.0, 0.0], [-5.9, 0.0, 0.0]]))
    k, v, rope = data[N - 1]
    for layer in range(L):
        cache.attend(layer, torch.randn_like(k), k, v, rope)
    host = cache.tiers.host
    assert sorted(host.indices()) == list(range(N - 2))  # frames 8, 9 are the window
    for layer in range(L):
        slots = [cache._frames[layer][SLOT_BASE + s] for s in range(2)]
        for b, expected in ((0, {2, 3}), (1, {6, 5})):
            held = set()
            for f in expected:
                src = host.frames[layer][f]
                if any(torch.equal(s["k"][0]["anchor"][b], src["k"][0]["anchor"][b]) for s in slots):
                    held.add(f)
            assert held == expected, (layer, b)
        assert cache.history(layer) == [8, SLOT_BASE, SLOT_BASE + 1]


def test_without_expect_recall_uses_the_newest_key_pose():
    N = 8
    poses = torch.stack([torch.tensor([[float(f), 0.0, 0.0]]) for f in range(N)])  # [N, 1, 3]
    poses[N - 1] = torch.tensor([[1.0, 0.0, 0.0]])  # the frame being continued stands where frame 1 stood
    recipe = with_plan(predictive_recipe(), window=2, sink_frames=0, recall_slots=1, host_frames=16)
    cache = ReferenceCache.from_recipe(recipe)
    run(cache, frames(poses))
    src = cache.tiers.host.frames[0][1]
    assert torch.equal(cache._frames[0][SLOT_BASE]["v"][1]["anchor"], src["v"][1]["anchor"])


# ---- codes through the host tier ------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda: predictive_recipe(), lambda: predictive_recipe(pre_rotary=False),
                                  lambda: predictive_recipe(temporal=False), lambda: per_frame_recipe(2)])
def test_evicted_frames_keep_their_codes_bit_exact(make):
    """A frame's bytes as the device held them last == its host bytes == a slot's bytes when
    recalled; frame 1 (a delta behind the sink while on the device) moves as the exact anchor of
    its states."""
    N, W = 14, 3
    poses = torch.zeros(N, 2, 3)
    poses[:, :, 0] = torch.arange(N, dtype=torch.float32)[:, None]
    recipe = make()
    sinks = recipe.scheme.policy.sink_frames
    cache = ReferenceCache.from_recipe(with_plan(recipe, window=W, sink_frames=sinks, recall_slots=1,
                                                   host_frames=32))
    data = frames(poses)
    last_seen = {}
    states_seen = {}
    for f, (k, v, rope) in enumerate(data):
        cache.expect(torch.tensor([[2.0, 0, 0], [2.0, 0, 0]]))  # always wants frame 2 back
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)
            for g, record in cache._frames[layer].items():
                if g < SLOT_BASE:
                    last_seen[(layer, g)] = {kind: [dict(h) for h in record[kind]] for kind in ("k", "v")}
            for kind, chains in ((kind, cache._chains.get((layer, kind))) for kind in ("k", "v")):
                if chains is not None:
                    for g, st in cache._chain_states(layer, kind).items():
                        states_seen[(layer, kind, g)] = st
    host = cache.tiers.host
    assert host.indices() == list(range(sinks, N - W))
    for layer in range(L):
        for g in host.indices():
            for kind in ("k", "v"):
                for h in range(H):
                    moved, last = host.frames[layer][g][kind][h], last_seen[(layer, g)][kind][h]
                    if set(moved) == set(last):
                        assert all(torch.equal(moved[n], last[n]) for n in moved)  # the very bytes
                    else:  # a delta frame re-stored as an anchor: exactly its states
                        chains = cache._chains[(layer, kind)]
                        assert "anchor" in moved and torch.equal(chains[h].states(moved, None),
                                                                 states_seen[(layer, kind, g)][h])
        slot = cache._frames[layer][SLOT_BASE]
        for kind in ("k", "v"):
            for h in range(H):
                assert all(torch.equal(slot[kind][h][n], host.frames[layer][2][kind][h][n]) for n in slot[kind][h])


# ---- bytes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("make,reuse", [(lambda: predictive_recipe(), "resident"),
                                        (lambda: predictive_recipe(pre_rotary=False), "none"),
                                        (lambda: predictive_recipe(hold=True), "resident"),
                                        (lambda: predictive_recipe(hold=True, refresh=4), "resident"),
                                        (lambda: per_frame_recipe(2), "resident"),
                                        (lambda: per_frame_recipe(16), "none")])
def test_measured_device_and_host_bytes_equal_predicted(make, reuse, runtime):
    N, B = 40, 2
    g = torch.Generator().manual_seed(3)
    poses = torch.cumsum(0.3 * torch.randn(N, B, 3, generator=g), dim=0)
    recipe = make()
    plan_recipe = with_plan(recipe, window=4, sink_frames=1, recall_slots=3, host_frames=9, reuse=reuse)
    plan = plan_recipe.scheme.policy.plan
    cache = RUNTIMES[runtime].from_recipe(plan_recipe)
    for f, (k, v, rope) in enumerate(frames(poses)):
        cache.expect(poses[min(f + 1, N - 1)])
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)
        n = cache.num_frames_seen
        assert cache.nbytes() == cache.predicted_nbytes(n, B), f
        assert cache.tiers.host.nbytes() == predicted_host_bytes(recipe.model, plan_recipe.scheme, plan, n, B), f
    steady = steady_device_bytes(recipe.model, plan_recipe.scheme, plan)
    assert cache.predicted_nbytes(N, 1) <= steady and cache.nbytes() == cache.predicted_nbytes(N, B)
    traffic, frame = cache.tiers.traffic(), slot_nbytes(recipe.model, plan_recipe.scheme, B)
    assert traffic["device_to_host_bytes"] == (N - len(kept_frames(N, 4, 1))) * frame  # every eviction
    if reuse == "none":  # every filled slot is copied at every step
        copied = sum(min(3, host_count(plan, n)) for n in range(1, N + 1))
        assert traffic["host_to_device_bytes"] == copied * frame


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_resident_slots_move_only_new_frames(runtime):
    """A camera standing still keeps wanting the same frames: after the slots fill, nothing moves."""
    N = 20
    poses = torch.full((N, 1, 3), 10.0)
    poses[:8, 0, 0] = torch.arange(8, dtype=torch.float32)
    poses[:, 0, 1:] = 0.0
    recipe = with_plan(predictive_recipe(), window=3, sink_frames=0, recall_slots=2, host_frames=64)
    cache = RUNTIMES[runtime].from_recipe(recipe)
    moved = []
    for f, (k, v, rope) in enumerate(frames(poses)):
        cache.expect(torch.tensor([[1.0, 0.0, 0.0]]))
        for layer in range(L):
            cache.attend(layer, torch.randn_like(k), k, v, rope)
        moved.append(cache.tiers.bytes_to_device)
    # nearest x = 1: frame 1, then frames 0 and 2 (a tie: the newer, 2); frame 2 reaches the host
    # at the 6th append, and from then on the slots keep frames 1 and 2: nothing moves
    slot = slot_nbytes(recipe.model, recipe.scheme)
    assert moved[3] == slot and moved[4] == 2 * slot and moved[5] == moved[-1] == 3 * slot


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_host_tier_changes_nothing_without_recall(runtime):
    """A plan with a host tier and no recall slots attends exactly as the plain cache of its window."""
    N = 16
    poses = torch.cumsum(0.2 * torch.ones(N, 2, 3), dim=0)
    recipe = predictive_recipe()
    plain = RUNTIMES[runtime].from_recipe(recipe, window=4, sink_frames=0)
    tiered = RUNTIMES[runtime].from_recipe(with_plan(recipe, window=4, sink_frames=0, host_frames=8))
    for k, v, rope in frames(poses):
        for layer in range(L):
            q = torch.randn_like(k)
            assert torch.equal(plain.attend(layer, q, k, v, rope), tiered.attend(layer, q, k, v, rope))


def test_attend_reads_window_and_slots():
    N = 12
    poses = torch.cumsum(0.4 * torch.ones(N, 2, 3), dim=0)
    cache = ReferenceCache.from_recipe(with_plan(predictive_recipe(), window=3, sink_frames=1, recall_slots=2,
                                                   host_frames=8))
    for f, (k, v, rope) in enumerate(frames(poses)):
        cache.expect(poses[0])
        for layer in range(L):
            q = torch.randn_like(k)
            out = cache.attend(layer, q, k, v, rope)
            k_all, v_all = cache.gather(layer, rope.apply(k), v)
            ref = torch.softmax(q @ k_all.transpose(-1, -2) / D**0.5, -1) @ v_all
            assert torch.allclose(out, ref, atol=1e-5)
            assert k_all.shape[2] == T * (len(cache.history(layer)) + 1)


# ---- the fast runtime runs the plan as the reference does -------------------------------------------
def host_states(cache, layer: int, frame: int) -> dict:
    """{kind: int64 states [B, H, T, D]} of a predictive host frame held as an anchor."""
    record = cache.tiers.host.frames[layer][frame]
    if isinstance(cache, ReferenceCache):
        return {kind: torch.stack([c.states(head, None) for c, head in zip(cache._chains[(layer, kind)], record[kind])], 1)
                for kind in "kv"}
    store = cache.stores[layer]
    s = store.code.expand(store.code.anchor_states(record["anchor"]).transpose(-2, -3))  # [B, T, G, D]
    return {kind: s[:, :, i * H:(i + 1) * H].permute(0, 2, 1, 3) for i, kind in enumerate("kv")}


@pytest.mark.parametrize("make", [lambda: predictive_recipe(), lambda: predictive_recipe(pre_rotary=False),
                                  lambda: predictive_recipe(temporal=False), lambda: predictive_recipe(hold=True),
                                  lambda: predictive_recipe(temporal=False, hold=True),
                                  lambda: predictive_recipe(hold=True, refresh=4), lambda: per_frame_recipe(2),
                                  lambda: per_frame_recipe(16)])
@pytest.mark.parametrize("reuse", ["resident", "none"])
def test_the_fast_runtime_runs_a_plan_as_the_reference(make, reuse):
    """Teacher-forced (the same frames and queries into both): the same recall choices, host frames
    and traffic, bytes equal to the prediction, integer states of every host anchor bitwise, and
    outputs equal but for float rounding (the runtimes sum in different orders)."""
    N, B = 30, 2
    g = torch.Generator().manual_seed(5)
    poses = torch.cumsum(0.3 * torch.randn(N, B, 3, generator=g), dim=0)
    recipe = with_plan(make(), window=4, sink_frames=1, recall_slots=3, host_frames=9, reuse=reuse)
    ref, fast = ReferenceCache.from_recipe(recipe), FastKVCache.from_recipe(recipe)
    anchored = recipe.scheme.layers[0].k.kind == "predictive" and recipe.scheme.layers[0].k.temporal
    for f, (k, v, rope) in enumerate(frames(poses)):
        for cache in (ref, fast):
            cache.expect(poses[min(f + 1, N - 1)])
        for layer in range(L):
            q = torch.randn(k.shape, generator=g)
            torch.testing.assert_close(fast.attend(layer, q, k, v, rope), ref.attend(layer, q, k, v, rope),
                                       atol=1e-5, rtol=1e-5)
        assert fast.tiers._assign == ref.tiers._assign, f
        assert fast.nbytes() == ref.nbytes() == fast.predicted_nbytes(f + 1, B), f
        assert fast.tiers.host.nbytes() == ref.tiers.host.nbytes(), f
    assert fast.tiers.traffic() == ref.tiers.traffic() and fast.tiers.traffic()["host_to_device_bytes"] > 0
    assert fast.tiers.host.indices() == ref.tiers.host.indices() == list(range(N - 4 - 9, N - 4))
    if anchored:
        for layer in range(L):
            for frame in fast.tiers.host.indices():
                mine, theirs = host_states(fast, layer, frame), host_states(ref, layer, frame)
                assert all(torch.equal(mine[kind], theirs[kind]) for kind in "kv"), (layer, frame)


# ---- the plan in the recipe -----------------------------------------------------------------------
def test_plan_round_trips_and_is_left_out_when_absent(tmp_path):
    recipe = predictive_recipe()
    assert "plan" not in json.loads(recipe.scheme.to_json())["policy"]
    planned = with_plan(recipe, window=8, sink_frames=1, recall_slots=8, host_frames=512, yaw_radius=0.5)
    save_recipe(planned, tmp_path / "p.safetensors")
    back = load_recipe(tmp_path / "p.safetensors")
    assert back.scheme.policy.plan == planned.scheme.policy.plan
    assert (tmp_path / "p.safetensors").read_bytes() == _resaved(back, tmp_path)


def _resaved(recipe, tmp_path):
    save_recipe(recipe, tmp_path / "again.safetensors")
    return (tmp_path / "again.safetensors").read_bytes()


@pytest.mark.parametrize("fields,message", [
    ({"window": 0}, "plan.window"),
    ({"recall_slots": 2, "host_frames": 0}, "host_frames=0"),
    ({"recall_slots": 2, "host_frames": 4, "recall": "none"}, "recall 'pose'"),
    ({"recall": "mean_key"}, "plan.recall"),
    ({"reuse": "sometimes"}, "plan.reuse"),
    ({"yaw_radius": -1.0}, "plan.yaw_radius"),
    ({"device_budget_bytes": 0}, "device_budget_bytes"),
    ({"host_frames": 2.5}, "host_frames"),
])
def test_bad_plans_are_refused_naming_the_field(fields, message, tmp_path):
    with pytest.raises(RecipeError, match=message):
        save_recipe(with_plan(predictive_recipe(), **fields), tmp_path / "bad.safetensors")


def test_an_older_reader_rejects_a_plan_clearly():
    """A reader of a minor version without plans knows no policy field `plan`: it must refuse the
    recipe (unknown policy fields are errors), never run it with its own window."""
    from calibrate.recipe_schema import FieldError, POLICY_FIELDS, parse_object

    d = json.loads(with_plan(predictive_recipe(), window=8).scheme.to_json())
    # a reader from before plans holds `policy` to its table, which has no `plan`
    with pytest.raises(FieldError, match=r"unknown field\(s\) \['plan'\]"):
        parse_object(d["policy"], POLICY_FIELDS, "scheme.policy")
    with pytest.raises(RecipeError, match="unknown field"):
        Scheme.from_dict({**d, "policy": {**d["policy"], "plan": {**d["policy"]["plan"], "prefetch": 2}}})


def test_a_plan_over_its_budget_is_refused_at_load(tmp_path):
    recipe = predictive_recipe()
    plan_recipe = with_plan(recipe, window=8, sink_frames=1, recall_slots=4, host_frames=64)
    need = steady_device_bytes(recipe.model, plan_recipe.scheme, plan_recipe.scheme.policy.plan)
    ok = with_plan(recipe, window=8, sink_frames=1, recall_slots=4, host_frames=64, device_budget_bytes=need)
    FastKVCache.from_recipe(ok)
    tight = with_plan(recipe, window=8, sink_frames=1, recall_slots=4, host_frames=64, device_budget_bytes=need - 1)
    save_recipe(tight, tmp_path / "tight.safetensors")  # the format is fine; the budget is the runtime's check
    with pytest.raises(ValueError, match=f"needs {need} bytes .* above its device_budget_bytes={need - 1}"):
        FastKVCache.from_recipe(load_recipe(tmp_path / "tight.safetensors"))


@pytest.mark.parametrize("policy,spec,message", [
    ({"keyframe_interval": 4}, None, "key frames"),
    ({"recent_frames": 4}, None, "recent_frames=4 must be below plan.window=4"),
    ({}, TensorSpec(bits=2, kind="prq", prq_stages=1, prq_centroids=2), "kind 'prq' with span state"),
])
def test_host_tier_limits_are_checked_when_the_cache_is_built_not_at_load(policy, spec, message, tmp_path):
    """FORMAT.md "Memory plan": the file is valid (the writer, the loader and the numpy reader take
    it); the runtime refuses its plan with one line naming the field when it builds the cache."""
    import importlib.util

    recipe = per_frame_recipe()
    if spec is not None:
        recipe = Recipe(INFO, uniform_scheme("toy-prq", L, spec, spec, TokenPolicy(sink_frames=1)), {})
    recipe = Recipe(INFO, replace(recipe.scheme, policy=replace(recipe.scheme.policy, **policy)), {})
    save_recipe(with_plan(recipe, window=4, sink_frames=1, host_frames=8), tmp_path / "p.safetensors")
    loaded = load_recipe(tmp_path / "p.safetensors", model=INFO)
    module = importlib.util.spec_from_file_location("kv_recipe_reader_tiers", REPO / "recipes" / "reader.py")
    reader = importlib.util.module_from_spec(module)
    module.loader.exec_module(reader)
    assert reader.plan_of(reader.read_recipe(tmp_path / "p.safetensors")[0])["host_frames"] == 8
    with pytest.raises(ValueError, match=re.escape(message)):
        FastKVCache.from_recipe(loaded)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_recall_by_pose_needs_a_pose(runtime):
    cache = RUNTIMES[runtime].from_recipe(with_plan(predictive_recipe(pre_rotary=False), window=2, recall_slots=1,
                                                   host_frames=4))
    k = torch.randn(1, H, T, D)
    chunk_index = Rope(torch.zeros(1, T, D // 2), coords_BP=torch.zeros(1, 1), at=None)
    with pytest.raises(ValueError, match=r"recall='pose'.*gives 1 \(not a camera pose\)"):
        cache.attend(0, k, k, k, chunk_index)


def _is_progress(part: str) -> bool:
    """A progress bar's update (tqdm: '<desc>: n/N [...]' or its cursor-up code)."""
    return part.strip("\x1b[A ") == "" or bool(re.search(r"\d+/\d+ \[[^\]]*\]", part))


def test_cli_a_pose_plan_on_a_model_without_pose_is_one_line_exit_2(tmp_path):
    pytest.importorskip("diffusers")
    from calibrate.adapters import wan_diffusers as wan
    from calibrate.adapters.wan_diffusers import WanSettings

    info = wan.load(None, WanSettings(), torch.device("cpu")).info
    spec = TensorSpec(bits=4, axis="token")
    recipe = Recipe(info, uniform_scheme("wan-plan", info.num_layers, spec, spec, TokenPolicy(sink_frames=1)), {})
    recipe = with_plan(recipe, window=2, sink_frames=1, recall_slots=1, host_frames=8)
    save_recipe(recipe, tmp_path / "plan.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    run_ = subprocess.run([sys.executable, "-m", "calibrate", "task=evaluate", "model=wan_diffusers",
                           f"recipe={tmp_path / 'plan.safetensors'}", "trajectories.num_trajectories=1",
                           "trajectories.num_frames=8", "model.wan.denoise_timesteps=[1000]", "eval.strips=false",
                           "eval.attention=false", f"hydra.run.dir={tmp_path / 'run'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    # the error comes at the model's first step, after the progress bar started (as for keys stored
    # before the rotation): the bar's own \r-separated updates aside, stderr says one thing
    lines = [part.strip() for line in run_.stderr.splitlines() for part in line.split("\r")]
    lines = [part[part.index("error:"):] if "error:" in part else part for part in lines
             if part and ("error:" in part or not _is_progress(part))]
    assert run_.returncode == 2, run_.stderr[-2000:]
    assert len(lines) == 1 and "recall='pose'" in lines[0] and "camera pose" in lines[0], run_.stderr


def test_evaluating_a_plan_with_attention_metrics_leaves_them_out_and_counts_its_own_frames(tiny_world):
    """A plan's cache holds other frames than the float reference (its window, recalled slots):
    evaluation must not compare their attention (it used to crash), and its fp16 bytes are those
    of the device tier's frames, so bits per element stay bits per stored element."""
    from calibrate.adapters import TinyWorldAdapter
    from calibrate.evaluate.run import evaluate
    from calibrate.schemes import build_baseline
    from calibrate.world.trajectories import make_trajectories

    world = TinyWorldAdapter(tiny_world)
    recipe = build_baseline("fp16", world.info)
    plan = with_plan(recipe, window=2, sink_frames=1, recall_slots=2, host_frames=8)
    trajs = make_trajectories(["orbit"], "evaluation", 1, 12)
    runs = evaluate(world, {"plain": recipe, "plan": plan}, trajs, 4, 1, torch.device("cpu"), attention=True)
    assert runs["plain"].attention and not runs["plan"].attention
    mem = runs["plan"].memory
    assert mem["bytes"] == mem["predicted_bytes"]
    assert mem["fp16_bytes"] == mem["bytes"]  # fp16 recipe: stored == float16 bytes of the same frames


@pytest.mark.parametrize("fields, message", [
    ({"device_budget": "lots"}, "not a byte count"),
    ({"schemes": ["fitted", "nonsense"]}, r"memory.schemes \['nonsense'\] unknown"),
    ({"search_frames": 10}, "leaves no return"),
])
def test_plan_search_settings_are_refused_before_any_replay(fields, message):
    from calibrate.config import MemoryConfig

    with pytest.raises(ValueError, match=message):
        MemoryConfig(**fields).check()
    MemoryConfig(device_budget="816KiB").check()

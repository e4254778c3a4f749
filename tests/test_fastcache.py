"""The runtime (calibrate/fastcache.py) against the tests' oracle (tests/reference_runtime.py).

Held equal: every stored integer code, dynamic parameter and side tensor (per-frame kinds) and
every integer state of a chain (predictive), bitwise; decoded K/V within 1e-6 + 1e-6 relative (the
compensator's matmul is batched differently: 1 ulp); attention outputs within 1e-5 + 1e-5 relative
(one softmax or the blockwise merge, whose sums run in another order); bytes measured from the buffers equal
`memory.predicted_cache_bytes`. Rollouts are long enough to wrap every ring several times, for
several windows, sink counts, recent windows, anchors and mixed per-head / per-component widths.
"""

from dataclasses import replace

import pytest
import torch

from benchmarks.runtime import peak_bytes
from calibrate.cache import KVCache, Rope, kept_frames
from calibrate.fastcache import FastKVCache, FastPathError, fast_path_problem
from calibrate.quant.bitrows import RowLayout
from calibrate.quant.blockattn import OnlineSoftmax
from calibrate.quant.fields import FieldLayout
from calibrate.recipe import LayerSpec, Recipe, Scheme, TensorSpec, TokenPolicy
from reference_runtime import ReferenceCache
from calibrate.schemes import build_baseline

from test_peers import _toy_peer_recipes
from test_runtime import CACHE_RECIPES, POLICY, SPECS
from test_runtime_predictive import predictive_recipe, sequence
from toys import B, D, H, INFO, kv_frames, toy_recipe

ATOL_OUT = 1e-5
RTOL_OUT = 1e-5
ATOL_KV = 1e-6  # and rtol 1e-6: one ulp of the compensator


def assert_decoded_close(a: torch.Tensor, b: torch.Tensor) -> None:
    """K/V decoded from identical codes by both runtimes: equal but for the order of the rotation's
    sums (a matmul, not pinned; MKL picks its kernels by CPU). Each runtime's length-D dot product is
    within gamma_D sum_j |R_ij| |y_j| <= D 2^-24 ||y|| of the exact value (Cauchy-Schwarz: R's rows
    have unit norm, ||y|| = the token's norm), so the two differ by at most twice that per token; a
    factor sqrt(D) more leaves room for turbo_prod's second length-D sum (the QJL term S^T z, whose
    Gaussian rows are not unit). Plus ATOL_KV and rtol 1e-6, the old tolerance, for tiny tokens.
    A wrong code or decode moves a value by a grid step, orders of magnitude more."""
    D = b.shape[-1]
    bound = 2 * D * 2.0**-24 * D**0.5 * b.norm(dim=-1, keepdim=True) + ATOL_KV + 1e-6 * b.abs()
    assert ((a - b).abs() <= bound).all(), float((a - b).abs().max())


def assert_blockwise_close(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, v: torch.Tensor) -> None:
    """Blockwise attention (an online softmax over key blocks, query chunks) against one softmax
    over the same logits and values: the two round differently by design. Each weight
    exp(l_j - m) is formed from a block's maximum and rescaled, so its argument carries an
    absolute rounding error of a few 2^-24 max|l| and the weight that relative error; with the
    normalizing sum and the length-N accumulation, |got - want| <= 2^-24 (6 (max|l| + 1) + N) max|v|.
    At the toy's logits (up to ~54) and values (up to ~20) that is ~1e-4: a wrong code moves a
    well-attended value by a grid step, far more."""
    N = v.shape[-2]
    bound = 2.0**-24 * (6 * (logits.abs().max() + 1) + N) * v.abs().max() + ATOL_OUT
    assert ((got - want).abs() <= bound).all(), (float((got - want).abs().max()), float(bound))


# ---- the pure pieces -----------------------------------------------------------------------------------
@pytest.mark.parametrize("widths,values,packed", [
    ([3, 0, 5, 1, 8, 2], [5, 0, 17, 1, 200, 3], "8d9107"),
    ([1] * 9, [1, 0, 1, 1, 0, 0, 0, 1, 1], "8d01"),
    ([4, 4, 2], [15, 1, 3], "1f03"),
    ([16, 5], [65535, 31], "ffff1f"),
    ([6, 6, 6, 6], [1, 2, 3, 4], "813010"),
])
def test_rows_reproduce_the_field_golden_vectors(widths, values, packed):
    layout = RowLayout(widths)
    got = layout.pack(torch.tensor([values]))
    assert bytes(got[0].tolist()).hex() == packed
    assert layout.unpack(got)[0].tolist() == values


def test_rows_equal_field_layouts_side_by_side():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 17, (n,), generator=g).tolist() for n in (5, 1, 12, 7)]
    values = [(torch.rand(3, 4, len(r), generator=g) * (1 << torch.tensor(r))).long() for r in rows]
    packed = torch.cat([FieldLayout(r).pack(v) for r, v in zip(rows, values)], dim=-1)
    layout = RowLayout.concat(rows)
    assert torch.equal(layout.pack(torch.cat(values, -1)), packed)
    assert torch.equal(layout.unpack(packed).long(), torch.cat(values, -1))


@pytest.mark.parametrize("chunk", [None, 3])
def test_online_softmax_over_blocks_equals_one_softmax(chunk):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 7, 16, generator=g) * 3 for _ in range(3))
    bias = -torch.rand(2, 3, 7, 1, generator=g)
    k, v = torch.randn(2, 3, 20, 16, generator=g) * 3, torch.randn(2, 3, 20, 16, generator=g)
    logits = q @ k.transpose(-1, -2) / 4.0
    logits[..., 5:12] += bias
    want = logits.softmax(-1) @ v
    acc = OnlineSoftmax(q, chunk)
    acc.add(k[:, :, :5], v[:, :, :5])
    acc.add(k[:, :, 5:12], v[:, :, 5:12], bias)
    acc.add(k[:, :, 12:], v[:, :, 12:])
    torch.testing.assert_close(acc.result(), want, atol=ATOL_OUT, rtol=RTOL_OUT)


# ---- per-frame kinds -----------------------------------------------------------------------------------
def fast_record(cache: FastKVCache, layer: int, kind: str, f: int, h: int) -> dict:
    """What the fast cache holds for head h of frame f: the reference's per-head record layout."""
    store = cache.stores[layer]
    for name, pool in store.pools.items():
        if f in pool.frame_slot:
            slot = pool.frame_slot[f]
            for g, bufs in zip(store.groups[name][kind], pool.buffers[kind]):
                if h in g.heads:
                    i = g.heads.index(h)
                    return {key: t[:, i, slot] for key, t in bufs.items()}
    raise KeyError(f)


def assert_records_equal(fast: FastKVCache, ref: ReferenceCache, layer: int, step: int) -> None:
    """Every head's stored record of every held frame (codes, dynamic parameters, side tensors): bitwise."""
    for f in ref.frame_indices(layer):
        for kind in "kv":
            for h, theirs in enumerate(ref._frames[layer][f][kind]):
                mine = fast_record(fast, layer, kind, f, h)
                assert mine.keys() == theirs.keys()
                for key in theirs:
                    assert torch.equal(mine[key], theirs[key]), (step, layer, f, kind, h, key)


DEFERRED_PRQ = TensorSpec(bits=2, kind="prq", group_size=8, prq_stages=1, prq_centroids=3, prq_span_frames=3, prq_deferred=True)
FRAME_RECIPES = {**CACHE_RECIPES, **{f"spec_{n}": (lambda s=s: toy_recipe(s, policy=POLICY)) for n, s in SPECS.items()},
                 # kind prq: span centroids fitted on a span's first coded frame (recent and sink frames at 16
                 # bits, spans of 3 frames), a head at 16 bits, and the residual alone (no stages)
                 # and spans shared by frames of several classes: key frames at 4 bits, recent and sink frames below 16
                 **{n: (lambda n=n: _toy_peer_recipes()[n]) for n in ("prq_recent_sink16", "prq_head_bits", "prq_keyframes",
                                                                     "turbo", "jensen")},
                 "prq_recent_sink_low": lambda: toy_recipe(replace(DEFERRED_PRQ, prq_deferred=False, head_bits=[2, 16]),
                                                           policy=TokenPolicy(sink_frames=1, sink_bits=3, recent_frames=2,
                                                                              recent_bits=4)),
                 "prq_deferred_sink16": lambda: toy_recipe(DEFERRED_PRQ, policy=TokenPolicy(sink_frames=1, sink_bits=16)),
                 "prq_deferred_sink_key": lambda: toy_recipe(replace(DEFERRED_PRQ, head_bits=[2, 16]), DEFERRED_PRQ, TokenPolicy(
                     sink_frames=1, sink_bits=3, keyframe_interval=4, keyframe_bits=4)),
                 # Quant VideoGen's own schedule: spans of 3 frames held in float16 until complete (a key head at 16 bits)
                 "prq_deferred": lambda: toy_recipe(DEFERRED_PRQ, replace(DEFERRED_PRQ, prq_centroids=2), TokenPolicy(sink_frames=0)),
                 "prq_deferred_head_bits": lambda: toy_recipe(replace(DEFERRED_PRQ, head_bits=[2, 16]), DEFERRED_PRQ,
                                                              TokenPolicy(sink_frames=0))}


@pytest.mark.parametrize("name", FRAME_RECIPES)
@pytest.mark.parametrize("window,sink", [(3, 1), (4, 0), (2, 2)])
def test_per_frame_kinds_equal_the_reference(name, window, sink):
    recipe = FRAME_RECIPES[name]()
    ref = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
    fast = FastKVCache.from_recipe(recipe, window=window, sink_frames=sink)
    capacity = None
    for n, (q, k, v, rope) in enumerate(kv_frames(14), start=1):
        for layer in range(INFO.num_layers):
            want = ref.attend(layer, q, k, v, rope)
            torch.testing.assert_close(fast.attend(layer, q, k, v, rope), want, atol=ATOL_OUT, rtol=RTOL_OUT)
            assert fast.frame_indices(layer) == ref.frame_indices(layer) == kept_frames(n, window, sink)
            assert_records_equal(fast, ref, layer, n)
            for a, b in zip(fast.read(layer), ref.read(layer)):
                assert_decoded_close(a, b)
        assert fast.nbytes() == ref.nbytes() == fast.predicted_nbytes(n, batch=B)
        if n == 8:
            capacity = fast.capacity_nbytes()
    assert fast.capacity_nbytes() == capacity  # nothing allocated once warm


@pytest.mark.parametrize("key", [dict(axis="channel"), dict(group_size=8), dict(group_size=8, sparse_fraction=0.05),
                                 dict(axis="channel", sparse_fraction=0.05)])
@pytest.mark.parametrize("window,sink", [(3, 1), (4, 0)])
def test_jensen_correction_equals_the_reference(window, sink, key):
    """Each key's own grid steps (per-channel or per-token-group K, an outlier channel, float16 recent
    frames) lower its logit as the reference runtime's; blockwise attention and the materialized bias
    for shadows agree. (Per channel, the centred outlier channel's own scale is ~0 anyway; per token
    group its step comes from the other channels, so only the outlier mask zeroes it.)"""
    recipe = toy_recipe(TensorSpec(bits=2, jensen=True, outliers=1, **key), TensorSpec(bits=2),
                        TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=1))
    ref = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
    fast = FastKVCache.from_recipe(recipe, window=window, sink_frames=sink)
    blocks = FastKVCache.from_recipe(recipe, window=window, sink_frames=sink, token_block=8, query_chunk=3)
    for q, k, v, rope in kv_frames(9):
        for layer in range(INFO.num_layers):
            want = ref.attend(layer, q, k, v, rope)
            torch.testing.assert_close(fast.attend(layer, q, k, v, rope), want, atol=ATOL_OUT, rtol=RTOL_OUT)
            k_all, v_all = ref.gather(layer, rope.apply(k), v)
            assert_blockwise_close(blocks.attend(layer, q, k, v, rope), want, ref.logits(layer, q, k_all), v_all)
            torch.testing.assert_close(fast.logit_bias(layer, q), ref.logit_bias(layer, q), atol=1e-6, rtol=1e-5)


def test_logit_correction_and_shadow_reads():
    recipe = toy_recipe(TensorSpec(bits=2, head_bits=[2, 3], group_size=8), TensorSpec(bits=2), POLICY)
    recipe.tensors["layers.0.k.logit_bias"] = torch.rand(H, D)
    recipe.tensors["layers.1.k.logit_bias"] = torch.rand(H, D)
    ref = ReferenceCache.from_recipe(recipe, window=4, sink_frames=1)
    fast = FastKVCache.from_recipe(recipe, window=4, sink_frames=1)
    for q, k, v, rope in kv_frames(10):
        for layer in range(INFO.num_layers):
            torch.testing.assert_close(fast.attend(layer, q, k, v, rope), ref.attend(layer, q, k, v, rope),
                                       atol=ATOL_OUT, rtol=RTOL_OUT)
            kq, vq = fast.gather(layer, rope.apply(k), v)
            torch.testing.assert_close(fast.logits(layer, q, kq), ref.logits(layer, q, ref.gather(layer, rope.apply(k), v)[0]),
                                       atol=ATOL_OUT, rtol=RTOL_OUT)


class _Recorded(KVCache):
    """The fp cache, keeping every attend call's inputs: a real model's K/V to replay teacher-forced."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = []

    def observe(self, seen):
        self.calls.append((seen.layer, seen.q_BHTD, seen.k_BHTD, seen.v_BHTD, seen.key_rope))


@pytest.mark.parametrize("name", ["fp16", "naive2", "kivi2", "kivi4", "quarot2", "qvg2", "qvg2_lowmem", "turbo2.5", "jensen2",
                                  "nvfp4"])
def test_baselines_store_and_attend_like_the_reference(name, tiny_world):
    """TinyWorld's own K/V, fed to both runtimes step by step (teacher-forced): records equal bitwise,
    outputs within float rounding at every step, bytes as predicted. Free rollouts are not compared:
    the two runtimes round floats differently (MKL picks kernels by CPU) and a closed loop amplifies
    one flipped code, so such a test passes on one CPU and fails on another."""
    from calibrate.adapters import TinyWorldAdapter
    from calibrate.world.trajectories import make_trajectories

    world = TinyWorldAdapter(tiny_world)
    recipe = build_baseline(name, world.info)
    trajs = make_trajectories(["orbit", "stress"], "evaluation", 2, 24, 0)
    recorded = _Recorded(world.info.num_layers, 5, 1)
    world.rollout(trajs, recorded, torch.device("cpu"))
    ref = ReferenceCache.from_recipe(recipe, 5, 1)
    fast = FastKVCache.from_recipe(recipe, 5, 1)
    for step, (layer, q, k, v, rope) in enumerate(recorded.calls):
        want = ref.attend(layer, q, k, v, rope)
        torch.testing.assert_close(fast.attend(layer, q, k, v, rope), want, atol=ATOL_OUT, rtol=RTOL_OUT)
        assert_records_equal(fast, ref, layer, step)
    assert fast.nbytes() == ref.nbytes() == fast.predicted_nbytes(fast.num_frames_seen, batch=2)


# ---- predictive ----------------------------------------------------------------------------------------
def chain_states(cache: FastKVCache, layer: int) -> dict:
    """{(kind, frame): states [B, H, T, D]} of the chain frames the fast cache holds."""
    store = cache.stores[layer]
    store = getattr(store, "predictive", store)  # a layer mixing kinds: its predictive tensor's store
    chain = store.chain(cache._num_appended[layer])
    if not chain:
        return {}
    s = store.code.expand(store.scan(chain, slice(0, store.T)).transpose(2, 3)).transpose(2, 3)  # [B, J, G, T, D]
    return {(kind, f): s[:, j, i * store.H:(i + 1) * store.H].long() for j, f in enumerate(chain)
            for i, kind in enumerate(store.kinds)}


@pytest.mark.parametrize("window,sink,recent", [(6, 1, 0), (6, 1, 2), (3, 0, 0), (1, 1, 0), (8, 2, 3), (4, 1, 4)])
@pytest.mark.parametrize("temporal", [True, False])
@pytest.mark.parametrize("sink_bits,hold,refresh", [(0.0, False, 0), (6.0, False, 0), (6.0, True, 0), (6.0, True, 4)])
def test_predictive_states_and_outputs_equal_the_reference(window, sink, recent, temporal, sink_bits, hold, refresh):
    """With and without a sink code (format 1.3: the sink frames in their own code), with the sink
    hold (format 1.4: hold bits compared byte for byte; it does not touch the scan, so one scan
    suffices), and with its reference refreshed every 4 frames (format 1.5: the reference compared
    byte for byte)."""
    recipe = predictive_recipe(recent=recent, sink_bits=sink_bits, hold=hold, refresh=refresh)
    for pair in recipe.scheme.layers:
        pair.k.temporal = pair.v.temporal = temporal
    assert_chains_like_the_reference(recipe, "kv", window, sink, frames=30, seed=3)


def test_a_chain_of_300_frames_decodes_to_the_encoders_states():
    """The scan's every value is a state, inside the anchor range, so float32 holds it exactly
    however long the chain: 300 frames (past the 256 at which the scan once switched to float64)
    decode to exactly the states the encoder made (quant/predictive.encode, frame after frame, no
    window)."""
    from calibrate.predictive_roles import head_params
    from calibrate.quant import predictive as P

    frames = 300
    recipe = predictive_recipe()
    ks, vs, ropes = sequence(frames)
    fast = FastKVCache.from_recipe(recipe, window=frames, sink_frames=1)
    for f in range(frames):
        fast.append(0, ks[f], vs[f], ropes[f])
    mine = chain_states(fast, 0)
    x = torch.stack(vs, dim=2)  # [B, H, F, T, D]: values (keys are stored with their rotary coordinates)
    for h in range(x.shape[1]):
        p, v = head_params(recipe.layer_tensors(0, "v"), h), None
        for f in range(frames):
            _, _, v = P.encode(x[:, h, f], p, v)
            assert torch.equal(mine[("v", f)][:, h], v), (h, f)


def assert_reference_equal(fast, ref, layer: int, kind: str) -> None:
    """The sink refresh's held reference (format 1.5), unpacked code for code in both runtimes."""
    refs = ref._references.get((layer, kind))
    if refs is None:
        return
    store = getattr(fast.stores[layer], "predictive", fast.stores[layer])
    i = store.kinds.index(kind)
    w = store._reference_w(slice(0, store.T), None)[:, i * store.H:(i + 1) * store.H]  # [B, H, T, D]
    for h, (c, stored) in enumerate(zip(ref._chains[(layer, kind)], refs)):
        assert torch.equal(w[:, h], c.reference_code(stored)), (layer, kind, h)


def assert_holds_equal(fast, ref, layer: int, kind: str, frame: int) -> None:
    """A frame's stored hold bits (sink hold, format 1.4), byte for byte in both runtimes."""
    record = ref._frames[layer][frame][kind]
    if "holds" not in record[0]:
        return
    store = getattr(fast.stores[layer], "predictive", fast.stores[layer])
    i = store.kinds.index(kind)
    for h, stored in enumerate(record):
        assert torch.equal(store.holds[:, store.slot(frame), i * store.H + h], stored["holds"]), (layer, kind, frame, h)


def assert_chains_like_the_reference(recipe, predictive: str, window: int, sink: int, frames: int, seed: int):
    """Frame by frame: the `predictive` tensors' chain states bitwise, outputs and reads within float
    rounding, bytes as the oracle's and as predicted."""
    ks, vs, ropes = sequence(frames)
    ref = ReferenceCache.from_recipe(recipe, window=window, sink_frames=sink)
    fast = FastKVCache.from_recipe(recipe, window=window, sink_frames=sink)
    g = torch.Generator().manual_seed(seed)
    for f in range(frames):
        q = torch.randn(2, 2, 4, 16, generator=g)
        for layer in range(2):
            want = ref.attend(layer, q, ks[f], vs[f], ropes[f])
            torch.testing.assert_close(fast.attend(layer, q, ks[f], vs[f], ropes[f]), want, atol=ATOL_OUT, rtol=RTOL_OUT)
            mine = chain_states(fast, layer)
            for kind in predictive:
                theirs = ref._chain_states(layer, kind)
                assert {f for k, f in mine if k == kind} == set(theirs)
                for frame, states in theirs.items():  # integer states: bitwise
                    assert torch.equal(mine[(kind, frame)], torch.stack(states, dim=1)), (f, layer, kind, frame)
                    assert_holds_equal(fast, ref, layer, kind, frame)
                assert_reference_equal(fast, ref, layer, kind)
            for a, b in zip(fast.read(layer), ref.read(layer)):
                assert_decoded_close(a, b)
        assert fast.nbytes() == ref.nbytes() == fast.predicted_nbytes(f + 1, batch=2)


T16 = 16


def rope_of(T: int):
    """A model's rotary for frames of T tokens, from 2 coordinates per frame (`at`: itself)."""
    def rope(coords_BP):
        freqs = torch.linspace(0.1, 2.0, 8)
        angles = coords_BP[:, None, 0:1] * freqs + coords_BP[:, None, 1:2] * torch.arange(T)[None, :, None] * 0.1
        return Rope(angles, coords_BP=coords_BP, at=rope)
    return rope


rope16 = rope_of(T16)


def test_token_blocks_and_query_chunks_equal_one_block():
    """Blockwise decoding (tokens in blocks of 8, queries in chunks of 5) gives one block's result."""
    small = predictive_recipe()
    info = small.model.__class__("toy16", 2, 2, 16, T16, "f" * 16)
    tensors = small.tensors
    recipe = Recipe(info, small.scheme, tensors)
    g = torch.Generator().manual_seed(4)
    one = FastKVCache.from_recipe(recipe, window=5, sink_frames=1)
    blocks = FastKVCache.from_recipe(recipe, window=5, sink_frames=1, token_block=8, query_chunk=5)
    planned = FastKVCache.from_recipe(recipe, window=5, sink_frames=1, workspace_bytes=40_000)
    ref = ReferenceCache.from_recipe(recipe, window=5, sink_frames=1)
    k = torch.randn(1, 2, T16, 16, generator=g)
    v = torch.randn(1, 2, T16, 16, generator=g)
    for f in range(14):
        k, v = k + 0.05 * torch.randn(k.shape, generator=g), v + 0.05 * torch.randn(v.shape, generator=g)
        rope = rope16(torch.tensor([[0.2 * f, float(f % 3)]]))
        q = torch.randn(1, 2, T16, 16, generator=g)
        for layer in range(2):
            want = ref.attend(layer, q, k, v, rope)
            torch.testing.assert_close(one.attend(layer, q, k, v, rope), want, atol=ATOL_OUT, rtol=RTOL_OUT)
            torch.testing.assert_close(blocks.attend(layer, q, k, v, rope), want, atol=ATOL_OUT, rtol=RTOL_OUT)
            torch.testing.assert_close(planned.attend(layer, q, k, v, rope), want, atol=ATOL_OUT, rtol=RTOL_OUT)
            torch.testing.assert_close(blocks.attend_uncommitted(layer, q, k, v, rope),
                                       ref.attend_uncommitted(layer, q, k, v, rope), atol=ATOL_OUT, rtol=RTOL_OUT)
        assert blocks.nbytes() == planned.nbytes() == ref.nbytes()
    assert planned.stores[0].token_block == 8  # the budget made token blocks


def test_uncommitted_passes_store_nothing():
    recipe = toy_recipe(*CACHE_RECIPES["kivi_like"]().scheme.layers[0].__dict__.values(),
                        policy=TokenPolicy(sink_frames=0, recent_frames=2))
    ref = ReferenceCache.from_recipe(recipe, window=3, sink_frames=1)
    fast = FastKVCache.from_recipe(recipe, window=3, sink_frames=1)
    for q, k, v, rope in kv_frames(8):
        for layer in range(INFO.num_layers):
            torch.testing.assert_close(fast.attend_uncommitted(layer, q, k, v, rope),
                                       ref.attend_uncommitted(layer, q, k, v, rope), atol=ATOL_OUT, rtol=RTOL_OUT)
            fast.attend(layer, q, k, v, rope)
            ref.attend(layer, q, k, v, rope)


# ---- a layer mixing kinds; choosing the runtime, bad input -----------------------------------------------
def mixed_recipe(predictive: str, other: TensorSpec = TensorSpec(bits=2), recent: int = 0, sink_bits: float = 0.0) -> Recipe:
    """`predictive_recipe` with the tensor that is not `predictive` ("k" or "v") coded per frame."""
    pred = predictive_recipe(recent=recent, sink_bits=sink_bits)
    kind = "v" if predictive == "k" else "k"
    layers = [replace(p, **{kind: other}) for p in pred.scheme.layers]
    tensors = {k: t for k, t in pred.tensors.items() if f".{kind}." not in k}
    return Recipe(pred.model, Scheme("mixed", layers, pred.scheme.policy), tensors)


@pytest.mark.parametrize("window,sink,recent,sink_bits", [(6, 1, 0, 0.0), (4, 1, 2, 0.0), (3, 0, 0, 0.0), (4, 1, 2, 6.0)])
@pytest.mark.parametrize("predictive,other", [("k", TensorSpec(bits=2)), ("v", TensorSpec(bits=16)),
                                              ("v", TensorSpec(bits=2, axis="channel"))])
def test_a_layer_mixing_kinds_equals_the_reference(predictive, other, window, sink, recent, sink_bits):
    """One tensor predictive (pre-rotary keys among them), the other per frame: benchmarks.fit's rows
    with one tensor in float16. Chain states bitwise, outputs and reads within float rounding, bytes
    as the oracle's and as predicted."""
    recipe = mixed_recipe(predictive, other, recent, sink_bits)
    assert fast_path_problem(recipe) is None
    assert_chains_like_the_reference(recipe, predictive, window, sink, frames=20, seed=4)


def test_a_recipe_without_a_path_is_refused_in_one_line():
    from calibrate.plan import MemoryPlan

    planned = mixed_recipe("k")
    planned.scheme.policy = replace(planned.scheme.policy, plan=MemoryPlan(10**9, window=2, sink_frames=0, recall_slots=1,
                                                                            host_frames=8))
    assert fast_path_problem(planned) == "layer 0 mixes a predictive and a per-frame kind (K predictive, V uniform) under a memory plan"
    corrected = mixed_recipe("v")
    corrected.tensors["layers.0.k.logit_bias"] = torch.zeros(H, D)
    with pytest.raises(FastPathError, match="recipe 'mixed': the runtime has no path for it .layer 0 mixes a predictive and "
                                            "a per-frame kind .K uniform, V predictive. with a logit correction on its keys"):
        FastKVCache.from_recipe(corrected, 4, 1)
    assert fast_path_problem(predictive_recipe()) is None
    one_sink = predictive_recipe(sink_bits=6.0)
    one_sink.scheme.layers[1].v.sink_token_bits = None
    one_sink.tensors = {n: t for n, t in one_sink.tensors.items() if not n.startswith("layers.1.v.sink_")}
    assert fast_path_problem(one_sink) == ("layer 1: predictive K and V, one with a sink code ('sink_token_bits') and "
                                           "one without")


def test_the_public_runtime_is_the_one_runtime():
    """DESIGN.md's `calibrate.QuantizedKVCache.from_recipe` builds the runtime: there is no other."""
    import calibrate

    assert calibrate.QuantizedKVCache is FastKVCache
    assert isinstance(calibrate.QuantizedKVCache.from_recipe(predictive_recipe(), 4, 1), FastKVCache)
    assert not hasattr(calibrate, "runtime") and ReferenceCache.__module__ == "reference_runtime"


def test_kinds_without_a_fast_path_are_named():
    """prq spans shared by several classes, the turbo kinds and the Jensen correction (dense-and-sparse
    keys too) run; a layer mixing a predictive and a per-frame kind runs, but not under a memory plan
    or with a logit correction on its per-frame keys (above)."""
    assert fast_path_problem(_toy_peer_recipes()["prq_keyframes"]) is None
    assert fast_path_problem(_toy_peer_recipes()["prq_recent_sink16"]) is None
    assert fast_path_problem(_toy_peer_recipes()["turbo"]) is None and fast_path_problem(_toy_peer_recipes()["jensen"]) is None
    assert fast_path_problem(toy_recipe(TensorSpec(bits=2, jensen=True, sparse_fraction=0.05), TensorSpec(bits=2))) is None


def test_frames_of_another_shape_are_refused():
    cache = FastKVCache.from_recipe(toy_recipe(TensorSpec(bits=2)), window=4, sink_frames=1)
    q, k, v, rope = kv_frames(1)[0]
    with pytest.raises(ValueError, match="tokens"):
        cache.attend(0, q[:, :, :2], k[:, :, :2], v[:, :, :2], Rope(rope.angles_BTA[:, :2]))
    with pytest.raises(ValueError, match="layers"):
        cache.attend(5, q, k, v, rope)


# ---- the CUDA path, checked on the CPU by its reference -------------------------------------------------
@pytest.mark.parametrize("blocks", [False, True])
def test_compiled_decode_and_bf16_attention_follow_the_reference(blocks):
    """What `device=cuda` runs (benchmarks/gpu.py): the chain decode through torch.compile (the
    eager backend here: the same capture, no compiler) and attention matmuls in bfloat16 (one
    SDPA, or the blockwise merge with float32 sums), against the reference runtime in float32."""
    recipe = predictive_recipe(recent=2)
    ks, vs, ropes = sequence(14)
    ref = ReferenceCache.from_recipe(recipe, window=5, sink_frames=1)
    extra = dict(token_block=8, query_chunk=3) if blocks else {}
    fast = FastKVCache.from_recipe(recipe, window=5, sink_frames=1, compute_dtype=torch.bfloat16, compile="eager", **extra)
    exact = FastKVCache.from_recipe(recipe, window=5, sink_frames=1, compile="eager", **extra)
    g = torch.Generator().manual_seed(5)
    for f in range(14):
        q = torch.randn(2, 2, 4, 16, generator=g)
        for layer in range(2):
            want = ref.attend(layer, q, ks[f], vs[f], ropes[f])
            torch.testing.assert_close(exact.attend(layer, q, ks[f], vs[f], ropes[f]), want, atol=ATOL_OUT, rtol=RTOL_OUT)
            torch.testing.assert_close(fast.attend(layer, q, ks[f], vs[f], ropes[f]), want, atol=0.05, rtol=0.02)  # bf16


def test_a_step_in_token_blocks_holds_one_block_at_a_time():
    """A step decoded in two token blocks takes well under the transient memory of one block for
    the whole frame: the first block's temporaries (states, values, keys) are dropped before the
    second decodes (holding them, as the runtime did, measured 0.66x one block's; dropping them 0.41x)."""
    small = predictive_recipe()
    T = 32
    recipe = Recipe(small.model.__class__("toy32", 2, 2, 16, T, "f" * 16), small.scheme, small.tensors)
    one = FastKVCache.from_recipe(recipe, window=8, sink_frames=1, token_block=T)
    two = FastKVCache.from_recipe(recipe, window=8, sink_frames=1, token_block=T // 2)
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(16, 2, T, 16, generator=g), torch.randn(16, 2, T, 16, generator=g)
    transient = {}
    for f in range(12):
        k, v = k + 0.05 * torch.randn(k.shape, generator=g), v + 0.05 * torch.randn(v.shape, generator=g)
        q = torch.randn(16, 2, T, 16, generator=g)
        rope = rope_of(T)(torch.tensor([[0.2 * f, float(f % 3)]] * 16))
        for name, cache in (("one", one), ("two", two)):
            peak, out = peak_bytes(lambda: cache.attend(0, q, k, v, rope))
            transient[name] = peak - out.numel() * out.element_size()
            cache.attend(1, q, k, v, rope)
    assert two.stores[0].token_block == T // 2 and one.stores[0].single_block
    assert transient["two"] < 0.55 * transient["one"], transient


@pytest.mark.parametrize("name", ["naive2", "kivi2", "quarot2", "nvfp4"])
def test_per_frame_token_blocks_equal_the_reference(name):
    """A small workspace: frames decoded and coded 8 tokens at a time (per-channel ranges gathered
    over the blocks first; nvfp4's per-frame scale needs the whole frame), queries in chunks, the
    fresh frame's keys rotated per block."""
    info = INFO.__class__("toy16", 2, 2, 16, T16, "f" * 16)
    recipe = build_baseline(name, info)
    ref = ReferenceCache.from_recipe(recipe, window=3, sink_frames=1)
    fast = FastKVCache.from_recipe(recipe, window=3, sink_frames=1, workspace_bytes=6_000)
    g = torch.Generator().manual_seed(6)
    for f in range(9):
        q, k, v = (torch.randn(1, 2, T16, 16, generator=g) for _ in range(3))
        rope = Rope(torch.randn(1, T16, 8, generator=g))
        for layer in range(2):
            torch.testing.assert_close(fast.attend(layer, q, k, v, rope), ref.attend(layer, q, k, v, rope),
                                       atol=ATOL_OUT, rtol=RTOL_OUT)
        assert fast.nbytes() == ref.nbytes()
        for layer in range(2):
            assert_records_equal(fast, ref, layer, f)
    assert fast.stores[0].token_block == 8 and fast.stores[0].write_block == 8 and not fast.stores[0].single_block


def test_the_shipped_recipe_stores_and_attends_like_the_reference():
    """The trained TinyWorld's own K/V fed to both runtimes step by step (teacher-forced) with the
    shipped recipe: outputs within float rounding at every step, decoded K/V within the rotation's
    rounding, bytes as predicted. Not a free rollout: under MKL_CBWR=AVX2 on an AVX-512 CPU the two
    runtimes' rollouts differed after a few frames (the closed loop amplifies float rounding), which
    says nothing about the codes."""
    from calibrate.adapters import TinyWorldAdapter
    from calibrate.pipeline import ours_recipe
    from calibrate.recipe import load_recipe
    from calibrate.world.trajectories import make_trajectories
    from calibrate.world.weights import load_weights

    world = TinyWorldAdapter(load_weights(None))
    recipe = load_recipe(ours_recipe(world.info), world.info)
    trajs = make_trajectories(["orbit", "stress"], "evaluation", 2, 30, 0)
    recorded = _Recorded(world.info.num_layers, 16, 1)
    world.rollout(trajs, recorded, torch.device("cpu"))
    ref = ReferenceCache.from_recipe(recipe, 16, 1)
    fast = FastKVCache.from_recipe(recipe, 16, 1)
    for layer, q, k, v, rope in recorded.calls:
        want = ref.attend(layer, q, k, v, rope)
        torch.testing.assert_close(fast.attend(layer, q, k, v, rope), want, atol=ATOL_OUT, rtol=RTOL_OUT)
        for a, b in zip(fast.read(layer), ref.read(layer)):
            assert_decoded_close(a, b)
    assert fast.nbytes() == ref.nbytes() == fast.predicted_nbytes(30, batch=2)

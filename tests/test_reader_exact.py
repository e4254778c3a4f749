"""recipes/reader.py reproduces the runtime bit for bit, from FORMAT.md alone (issue 19).

Two kinds of evidence: FORMAT.md's arithmetic golden vectors, which both `calibrate.codec` and
the numpy reader must reproduce, and recipes exercising every role of the per-frame kinds
(uniform, codebook, prq, turbo, turbo_prod, nvfp4; widths 2/3/4/8/16 per head; sink, recent and key
frames; rotations, centroids, outliers, sparse entries, compensators, clip roles, logit bias)
run through `ReferenceCache` while the reader encodes the same frames on its own: every
stored byte and every decoded float must be equal. (Predictive tensors decode to exactly the
runtime's integer states: tests/test_reader.py.)
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from calibrate.cache import Rope, kept_frames
from calibrate.codec import HeadParams, _center, decode, encode, static_scale_for_bits
from calibrate.quant import codebook, ordered, packing, turbo
from calibrate.quant.rotation import random_hadamard, random_orthogonal
from calibrate.recipe import (ModelInfo, Recipe, TensorSpec, TokenPolicy, expected_shapes, load_recipe, save_recipe,
                              LayerSpec, Scheme)
from reference_runtime import ReferenceCache

ROOT = Path(__file__).resolve().parents[1]
FORMAT_MD = ROOT / "recipes" / "FORMAT.md"
_spec = importlib.util.spec_from_file_location("kv_recipe_reader_exact", ROOT / "recipes" / "reader.py")
reader = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reader)


# ---- FORMAT.md's golden vectors -----------------------------------------------------------------
def golden(heading: str) -> list[list[str]]:
    """Cells of the data rows of the table under `#### heading` in FORMAT.md."""
    text = FORMAT_MD.read_text(encoding="utf-8")
    section = text.split(f"#### {heading}\n", 1)[1].split("\n#", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines() if line.startswith("|")]
    return rows[2:]  # header and separator


def f32(hexes: str) -> np.ndarray:
    return np.array([int(h, 16) for h in hexes.split()], dtype=np.uint32).view(np.float32)


def f16(hexes: str) -> np.ndarray:
    return np.array([int(h, 16) for h in hexes.split()], dtype=np.uint16).view(np.float16)


def bits32(a) -> list[int]:
    return np.asarray(a, dtype=np.float32).view(np.uint32).tolist()


def bits16(a) -> list[int]:
    return np.asarray(a, dtype=np.float16).view(np.uint16).tolist()


def test_every_golden_table_is_present():
    for heading, n in (("Uniform levels", 5), ("Fixed-order sums", 2), ("Clip rounding", 1), ("Constant groups", 6),
                       ("Square roots", 2), ("Sparse ties", 2), ("Re-cut centres", 6), ("16-bit heads", 2),
                       ("PRQ k-means", 5), ("Predictive modes", 4), ("Window of one frame", 1), ("NVFP4 ties", 10),
                       ("Sink code", 3), ("Sink hold", 3)):
        assert len(golden(heading)) == n, heading


@pytest.mark.parametrize("row", golden("NVFP4 ties"), ids=lambda r: r[0])
def test_golden_nvfp4_ties(row):
    from calibrate.codes.nvfp4 import magnitude_index

    a, want = np.float32(row[0]), int(row[1])
    assert int(magnitude_index(torch.tensor([a]))[0]) == want
    assert int(reader.e2m1_index(np.array([a]))[0]) == want


@pytest.mark.parametrize("row", golden("Uniform levels"), ids=lambda r: f"{r[0]}bit@{r[1]}")
def test_golden_uniform_levels(row):
    bits, start, want = int(row[0]), int(row[1]), f32(row[2])
    for levels in (codebook.uniform_levels(bits).numpy(), reader.uniform_levels(bits)):
        assert bits32(levels[start : start + len(want)]) == bits32(want)
    # and they are the correctly rounded quotients (exact rational arithmetic decides)
    from fractions import Fraction

    n = 2**bits
    for i, got in enumerate(want, start):
        exact = Fraction(2 * i - (n - 1), n - 1)
        lo, hi = np.nextafter(got, np.float32(-2)), np.nextafter(got, np.float32(2))
        assert abs(Fraction(float(got)) - exact) <= min(abs(Fraction(float(lo)) - exact), abs(Fraction(float(hi)) - exact))


@pytest.mark.parametrize("row", golden("Fixed-order sums"))
def test_golden_tree_sums(row):
    terms, tree, seq = f32(row[0]), f32(row[1]), f32(row[2])
    assert bits32([ordered.tree_sum(torch.from_numpy(terms)).item()]) == bits32(tree)
    assert bits32([reader.tree_sum(terms)]) == bits32(tree)
    acc = np.float32(0)
    for t in terms:
        acc = np.float32(acc + t)
    assert bits32([acc]) == bits32(seq)


def _one_token(spec: TensorSpec, bits: int, x: np.ndarray, **params):
    """(torch stored, reader stored) of one token [1, 1, D] at `bits`."""
    x_t = torch.from_numpy(x.copy()).reshape(1, 1, -1)
    stored = encode(x_t, spec, HeadParams(bits=bits, clip=spec.clip, **params))
    p = {"bits": bits, "clip": np.float32(spec.clip), "rotation": None, "scale": None, "zero_point": None,
         "codebook": None if "levels_L" not in params else params["levels_L"].numpy(), "outlier_channels": None,
         "centroids": None, "lloyd_max": None, "qjl": None, "comp_down": None, "comp_up": None}
    d = {**reader.SPEC_DEFAULTS, **{k: getattr(spec, k) for k in reader.SPEC_DEFAULTS}}
    return stored, reader.encode_head(x.reshape(1, 1, -1), d, p), d, p


@pytest.mark.parametrize("row", golden("Clip rounding"))
def test_golden_clip_rounding(row):
    bits, clip, x = int(row[0]), float(row[1]), f32(row[2])
    stored, mine, _, _ = _one_token(TensorSpec(bits=bits, clip=clip), bits, x)
    for s in (stored, {k: torch.from_numpy(v) for k, v in mine.items()}):
        assert bits16(s["p_scale"].numpy().ravel()) == bits16(f16(row[3]))
        assert bits16(s["p_zero"].numpy().ravel()) == bits16(f16(row[4]))
        assert packing.unpack(s["codes"], bits, len(x)).ravel().tolist() == [int(c) for c in row[5].split()]


@pytest.mark.parametrize("row", golden("Constant groups"), ids=lambda r: f"{r[0]} {r[1]}bit")
def test_golden_constant_groups(row):
    case, bits, x = row[0], int(row[1]), f32(row[2])
    kind = "codebook" if case == "codebook" else "uniform"
    spec = TensorSpec(bits=bits, kind=kind, symmetric=case == "uniform symmetric")
    params = {"levels_L": codebook.uniform_levels(bits)} if kind == "codebook" else {}
    stored, mine, d, p = _one_token(spec, bits, x, **params)
    decoded = (decode(stored, spec, HeadParams(bits=bits, **params), len(x)).numpy().ravel(),
               reader.decode_head(mine, d, p, len(x)).ravel())
    for s, dec in zip((stored, {k: torch.from_numpy(v) for k, v in mine.items()}), decoded):
        assert bits16(s["p_scale"].numpy().ravel()) == bits16(f16(row[3]))
        assert ("p_zero" in s) == (row[4] != "-")
        if "p_zero" in s:
            assert bits16(s["p_zero"].numpy().ravel()) == bits16(f16(row[4]))
        assert packing.unpack(s["codes"], bits, len(x)).ravel().tolist() == [int(c) for c in row[5].split()]
        assert bits32(dec) == bits32(f32(row[6]))
        assert np.isfinite(dec).all()


@pytest.mark.parametrize("row", golden("Square roots"), ids=lambda r: r[3])
def test_golden_square_roots(row):
    """The turbo norm is the correctly rounded root (not torch's float32 CPU sqrt, MKL's)."""
    y, total, root, norm = f32(row[0]), f32(row[1]), f32(row[2]), f16(row[3])
    assert bits32([ordered.sum_squares(torch.from_numpy(y)).item()]) == bits32(total)
    assert bits32([ordered.sqrt(torch.from_numpy(total)).item()]) == bits32(root)
    assert bits32(np.sqrt(total)) == bits32(root)  # numpy's float32 sqrt is IEEE's
    levels = torch.tensor([-0.75, -0.25, 0.25, 0.75])
    spec = TensorSpec(bits=2, kind="turbo")
    stored = encode(torch.from_numpy(y.copy()).reshape(1, 1, -1), spec, HeadParams(bits=2, lloyd_max_L=levels))
    mine = reader.encode_head(y.reshape(1, 1, -1), {**reader.SPEC_DEFAULTS, "bits": 2, "kind": "turbo"},
                              {**reader.head_params(reader.SPEC_DEFAULTS, {}, 0, "k", 0, 2), "lloyd_max": levels.numpy()})
    assert bits16(stored["p_norm"].numpy().ravel()) == bits16(mine["p_norm"].ravel()) == bits16(norm)
    assert torch.equal(stored["codes"], torch.from_numpy(mine["codes"]))


@pytest.mark.parametrize("row", golden("Sparse ties"))
def test_golden_sparse_ties(row):
    T, D = map(int, row[0].split("x"))
    f, y, k = float(row[1]), np.array([float(v) for v in row[2].split()], dtype=np.float32), int(row[3])
    want = [int(i) for i in row[4].split()]
    spec = TensorSpec(bits=2, sparse_fraction=f)
    stored = encode(torch.from_numpy(y).reshape(1, T, D), spec, HeadParams(bits=2))
    assert stored["sparse_idx"].shape == (1, k) and stored["sparse_idx"][0].tolist() == want
    d = {**reader.SPEC_DEFAULTS, "bits": 2, "sparse_fraction": f}
    p = reader.head_params(d, {}, 0, "k", 0, 2)
    assert reader.encode_head(y.reshape(1, T, D), d, p)["sparse_idx"][0].tolist() == want


@pytest.mark.parametrize("row", golden("Re-cut centres"), ids=lambda r: f"sym={r[0]} {r[1]}->{r[2]}")
def test_golden_recut_centres(row):
    symmetric, b0, b = row[0] == "true", int(row[1]), int(row[2])
    scale, zero = torch.from_numpy(f32(row[3])), torch.from_numpy(f32(row[4]))
    scale_b = static_scale_for_bits(scale, b0, b, symmetric)
    assert bits32(scale_b.numpy()) == bits32(f32(row[5]))
    assert bits32(reader.recut_scale(scale.numpy(), b0, b, symmetric)) == bits32(f32(row[5]))
    spec = TensorSpec(bits=b0, axis="channel", static=True, symmetric=symmetric)
    center = _center(spec, HeadParams(bits=b, scale_D=scale_b, zero_D=zero), torch.zeros(1, 1, 1))
    assert bits32(center.numpy().ravel()) == bits32(f32(row[6]))
    d = {**reader.SPEC_DEFAULTS, "bits": b0, "axis": "channel", "static": True, "symmetric": symmetric}
    tensors = {"layers.0.k.scale": scale.numpy()[None], "layers.0.k.zero_point": zero.numpy()[None]}
    p = reader.head_params(d, tensors, 0, "k", 0, b)
    assert bits32(np.ravel(reader._center(d, p))) == bits32(f32(row[6]))


@pytest.mark.parametrize("row", golden("16-bit heads"), ids=lambda r: f"recent{r[0]}")
def test_golden_16_bit_heads(row):
    """A head of width 16 under a lossy recent window, in the runtime itself."""
    recent_bits, x = int(row[0]), f32(row[1])
    info = ModelInfo(name="toy", num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_frame=1, fingerprint="toy")
    spec = TensorSpec(bits=16)
    policy = TokenPolicy(sink_frames=0, recent_frames=1, recent_bits=recent_bits)
    recipe = Recipe(info, Scheme("h16", [LayerSpec(k=spec, v=spec)], policy), {})
    cache = ReferenceCache.from_recipe(recipe, window=4, sink_frames=0)
    frame = torch.from_numpy(x.copy()).reshape(1, 1, 1, 4)
    cache.append(0, frame, frame, Rope(torch.zeros(1, 1, 2)))
    recent = cache._frames[0][0]["v"][0]
    assert bits16(recent["p_scale"].numpy().ravel()) + bits16(recent["p_zero"].numpy().ravel()) == bits16(f16(row[2]))
    assert packing.unpack(recent["codes"], recent_bits, 4).ravel().tolist() == [int(c) for c in row[3].split()]
    cache.append(0, frame, frame, Rope(torch.zeros(1, 1, 2)))
    final = cache._frames[0][0]["v"][0]["fp16"]
    assert bits16(final.numpy().ravel()) == bits16(f16(row[4]))


@pytest.mark.parametrize("row", golden("PRQ k-means"), ids=lambda r: f"T{r[0]}C{r[1]}it{r[2]}")
def test_golden_prq_kmeans(row):
    """The span state's start indices (MT19937, seed 0) and stopping rule, in the runtime and the reader."""
    from calibrate.codec import fit_span_state, with_span_state
    from calibrate.quant import qvg

    T, C, iters = int(row[0]), int(row[1]), int(row[2])
    y = torch.tensor([[[float(v), 0.0] for v in row[3].split()]])
    start, cents, ids = [int(i) for i in row[4].split()], [float(v) for v in row[5].split()], [int(i) for i in row[6].split()]
    assert qvg.init_indices(T, C).tolist() == reader.prq_start_indices(T, C) == start
    assert reader.mt19937(0, 4) == [2357136044, 2546248239, 3071714933, 3626093760]
    assert (np.random.RandomState(0).randint(0, 2**32, size=C, dtype=np.uint64) % T).tolist() == start
    spec = TensorSpec(bits=2, kind="prq", prq_stages=1, prq_centroids=C, prq_kmeans_iters=iters)
    state = fit_span_state(y, spec, HeadParams(bits=2))
    mine = reader.prq_span_state(y.numpy(), 1, C, iters)
    assert mine.dtype == np.float16 and bits16(mine) == bits16(state.numpy())
    assert state[0, 0, :, 0].tolist() == cents and not state[0, 0, :, 1].any()
    stored = encode(y, spec, with_span_state(HeadParams(bits=2), state))
    d = {**reader.SPEC_DEFAULTS, "bits": 2, "kind": "prq", "prq_stages": 1, "prq_centroids": C}
    theirs = reader.encode_head(y.numpy(), d, reader.head_params(d, {}, 0, "k", 0, 2), mine)
    assert np.array_equal(stored["p_assign"].numpy(), theirs["p_assign"])
    assert qvg.unpack_ids(stored["p_assign"][0, 0], C, T).tolist() == ids


# ---- recipes exercising every role: the reader encodes alongside ReferenceCache ----------------
H, D, T, B = 3, 16, 4, 2
INFO = ModelInfo(name="toy", num_layers=2, num_kv_heads=H, head_dim=D, tokens_per_frame=T, fingerprint="toy")


def role_tensors(spec: TensorSpec, kind: str, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for role, shape in expected_shapes(spec, H, D).items():
        if role == "rotation":
            maker = random_hadamard if spec.rotation == "hadamard" else random_orthogonal
            out[role] = torch.stack([maker(D, seed + h) for h in range(H)])
        elif role == "scale":
            top = 2.0 + torch.rand(shape, generator=g)
            out[role] = top if spec.kind == "codebook" else 2 * top / (2 ** min(spec.bits_of(h) for h in range(H)) - 1)
        elif role == "zero_point":
            out[role] = 0.1 * torch.randn(shape, generator=g) - (0 if spec.kind == "codebook" or spec.symmetric else 2.0)
        elif role == "codebook":
            row = torch.rand(shape, generator=g) * 2.4 - 1.2  # some levels outside [-1, 1]
            out[role] = row.sort(dim=-1).values
        elif role == "outlier_channels":
            out[role] = torch.stack([torch.randperm(D, generator=g)[: shape[1]] for _ in range(H)])
        elif role == "lloyd_max":
            out[role] = turbo.beta_lloyd_max(D, (shape[1] - 1).bit_length()).expand(H, -1).clone()
        elif role == "qjl":
            out[role] = torch.stack([turbo.qjl_matrix(D, D, seed + h) for h in range(H)])
        elif role == "centroids":
            out[role] = torch.randn(shape, generator=g)
        else:  # comp_down, comp_up
            out[role] = 0.1 * torch.randn(shape, generator=g)
    return out


def every_role_recipe(name: str, layers: list[tuple[TensorSpec, TensorSpec]], policy: TokenPolicy,
                      clip: dict[tuple[int, str], list[float]] = (), logit_bias: tuple[int, ...] = ()) -> Recipe:
    tensors = {}
    for i, pair in enumerate(layers):
        for j, (kind, spec) in enumerate(zip("kv", pair)):
            for role, t in role_tensors(spec, kind, seed=100 * i + 10 * j).items():
                tensors[f"layers.{i}.{kind}.{role}"] = t
    for (i, kind), values in dict(clip).items():
        tensors[f"layers.{i}.{kind}.clip"] = torch.tensor(values)
    for i in logit_bias:
        tensors[f"layers.{i}.k.logit_bias"] = 0.01 * torch.rand(H, D, generator=torch.Generator().manual_seed(i))
    return Recipe(INFO, Scheme(name, [LayerSpec(k=k, v=v) for k, v in layers], policy), tensors)


RECIPES = {
    # static and token grids, codebooks (rows subsampled, and uniform levels at 8 bits), every width
    "uniform_codebook": lambda: every_role_recipe(
        "uniform_codebook",
        [(TensorSpec(bits=2, head_bits=[2, 3, 16], axis="channel", static=True, rotation="hadamard", outliers=2,
                     sparse_fraction=0.05, comp_rank=2),
          TensorSpec(bits=4, head_bits=[4, 8, 2], symmetric=True, group_size=8, centroids=3, clip=0.9, sparse_fraction=0.1)),
         (TensorSpec(bits=2, head_bits=[2, 3, 4], kind="codebook", axis="channel", static=True, sparse_fraction=0.1,
                     rotation="learned", outliers=1),
          TensorSpec(bits=3, head_bits=[3, 2, 16], kind="codebook", group_size=4, outliers=1, comp_rank=3))],
        TokenPolicy(sink_frames=1, sink_bits=8, recent_frames=2, recent_bits=4, keyframe_interval=3, keyframe_bits=3),
        clip={(0, "k"): [0.9, 1.0, 0.8], (1, "v"): [0.8, 0.95, 1.0]}, logit_bias=(0,)),
    # dynamic per-channel grids, clipped token groups under a rotation and a compensator, float16 recent frames
    "dynamic_channel": lambda: every_role_recipe(
        "dynamic_channel",
        [(TensorSpec(bits=2, head_bits=[2, 4, 8], axis="channel", clip=0.85),
          TensorSpec(bits=3, group_size=4, rotation="random", comp_rank=2, clip=0.9)),
         (TensorSpec(bits=4, axis="channel", symmetric=True, clip=0.7),
          TensorSpec(bits=2, head_bits=[2, 16, 3], axis="channel", static=True, symmetric=True, sparse_fraction=0.05))],
        TokenPolicy(sink_frames=2, sink_bits=16, recent_frames=3, recent_bits=16, keyframe_interval=4, keyframe_bits=8),
        logit_bias=(1,)),
    # Quant VideoGen: span states of 1-2 stages (2-bit and 1-bit indices, and C = 1), static centroids
    "prq": lambda: every_role_recipe(
        "prq",
        [(TensorSpec(bits=2, head_bits=[2, 3, 4], kind="prq", group_size=8, prq_stages=2, prq_centroids=3,
                     prq_span_frames=3),
          TensorSpec(bits=2, kind="prq", prq_stages=1, prq_centroids=2, prq_span_frames=2, rotation="hadamard")),
         (TensorSpec(bits=2, kind="prq", centroids=4, rotation="random", group_size=8),
          TensorSpec(bits=3, kind="prq", prq_stages=1, prq_centroids=1, outliers=2, sparse_fraction=0.05))],
        TokenPolicy(sink_frames=1, sink_bits=4, recent_frames=1, recent_bits=8, keyframe_interval=5, keyframe_bits=3)),
    # TurboQuant: norms, Lloyd-Max levels, QJL signs (policy widths are 16 or the spec's)
    "turbo": lambda: every_role_recipe(
        "turbo",
        [(TensorSpec(bits=3, kind="turbo_prod", rotation="random"), TensorSpec(bits=2, kind="turbo", rotation="random")),
         (TensorSpec(bits=2, kind="turbo_prod", rotation="hadamard", outliers=1),
          TensorSpec(bits=4, kind="turbo", rotation="random", sparse_fraction=0.05))],
        TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=1, recent_bits=16, keyframe_interval=3, keyframe_bits=16)),
    # NVFP4: E2M1 codes, E4M3 block scales, a float32 scale per head and frame (the all-zero head: its floor)
    "nvfp4": lambda: every_role_recipe(
        "nvfp4",
        [(TensorSpec(bits=4, kind="nvfp4", group_size=16), TensorSpec(bits=4, kind="nvfp4", group_size=16, rotation="random")),
         (TensorSpec(bits=4, kind="nvfp4", group_size=16, rotation="hadamard", outliers=1),
          TensorSpec(bits=4, kind="nvfp4", group_size=16, sparse_fraction=0.05, centroids=2))],
        TokenPolicy(sink_frames=1, sink_bits=16, recent_frames=1, recent_bits=4, keyframe_interval=3, keyframe_bits=16)),
}
WIDTHS = {"uniform_codebook": {2, 3, 4, 8, 16}, "dynamic_channel": {2, 3, 4, 8, 16}, "prq": {2, 3, 4, 8},
          "turbo": {2, 3, 4, 16}, "nvfp4": {4, 16}}  # the widths each recipe's frames are held at, over the run
NUM_FRAMES, WINDOW, SINKS = 13, 6, 1


def frames(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """K/V frames [B, H, T, D] with offsets and spreads per channel; some rounded to float16 (ties),
    one with a constant head and one with an all-zero head (degenerate groups)."""
    g = torch.Generator().manual_seed(seed)
    spread, offset = 0.3 + torch.rand(D, generator=g), torch.randn(D, generator=g)
    out = []
    for f in range(NUM_FRAMES):
        k, v = (torch.randn(B, H, T, D, generator=g) * spread + offset for _ in range(2))
        if f % 3 == 1:
            k, v = k.half().float(), v.half().float()
        if f == 4:
            k[:, 1], v[:, 2] = 0.1, 0.0
        if f == 7:
            k[:, 0], v[:, 0] = 0.0, -3.3
        out.append((k, v))
    return out


def _np_stored(stored: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy() for k, t in stored.items()}


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("name", RECIPES)
def test_reader_encodes_and_decodes_every_role_bit_identically(tmp_path, name):
    path = tmp_path / f"{name}.safetensors"
    save_recipe(RECIPES[name](), path)
    meta, tensors = reader.read_recipe(path)
    cache = ReferenceCache.from_recipe(load_recipe(path, model=INFO), window=WINDOW, sink_frames=SINKS)
    policy = meta["scheme"].get("policy", {})
    R = policy.get("recent_frames", 0)
    mirror = [{} for _ in range(INFO.num_layers)]  # layer -> frame -> kind -> [(bits, stored) per head]
    rope = Rope(torch.zeros(B, T, D // 2))
    compared = set()

    def encode_mine(layer, kind, h, f, x, bits):
        spec = reader.spec_of(meta, layer, kind)
        state = None
        if spec["kind"] == "prq" and spec["prq_stages"] and bits < 16:
            span = f // spec.get("prq_span_frames", 1)
            state = cache._span_states[layer][(kind, h, span)].numpy()
        p = reader.head_params(spec, tensors, layer, kind, h, bits)
        return bits, reader.encode_head(x, spec, p, state), state

    for f, (k, v) in enumerate(frames(len(name))):
        for layer in range(INFO.num_layers):
            cache.append(layer, k, v, rope)
            n = f + 1
            inputs = {"k": rope.apply(k), "v": v}
            mirror[layer][f] = {kind: [encode_mine(layer, kind, h, f, inputs[kind][:, h].numpy(),
                                                   reader.held_bits(policy, reader.spec_of(meta, layer, kind), h, f, n))
                                       for h in range(H)] for kind in "kv"}
            leaving = f - R
            if R > 0 and leaving in mirror[layer]:  # decode the recent copy, re-encode at the final width
                for kind in "kv":
                    spec = reader.spec_of(meta, layer, kind)
                    heads = []
                    for h, (bits, stored, state) in enumerate(mirror[layer][leaving][kind]):
                        x = reader.decode_head(stored, spec, reader.head_params(spec, tensors, layer, kind, h, bits), D, state)
                        heads.append(encode_mine(layer, kind, h, leaving, x,
                                                 reader.held_bits(policy, spec, h, leaving, n)))
                    mirror[layer][leaving][kind] = heads
            keep = set(kept_frames(n, WINDOW, SINKS))
            mirror[layer] = {g: rec for g, rec in mirror[layer].items() if g in keep}
            assert sorted(mirror[layer]) == cache.frame_indices(layer)
            k_read, v_read = cache.read(layer)
            for pos, g in enumerate(sorted(mirror[layer])):
                for kind, read in (("k", k_read), ("v", v_read)):
                    spec = reader.spec_of(meta, layer, kind)
                    for h, (bits, stored, state) in enumerate(mirror[layer][g][kind]):
                        theirs = _np_stored(cache._frames[layer][g][kind][h])
                        assert sorted(theirs) == sorted(stored), (f, layer, g, kind, h)
                        for key in stored:
                            assert _same_bytes(theirs[key], np.asarray(stored[key])), (f, layer, g, kind, h, key)
                        mine = reader.decode_head(stored, spec, reader.head_params(spec, tensors, layer, kind, h, bits), D, state)
                        want = read[:, h, pos * T : (pos + 1) * T].numpy()
                        assert _same_bytes(mine, want), (f, layer, g, kind, h, "decoded")
                        compared.add((spec["kind"], bits, "fp16" in stored))
    assert {bits for _, bits, _ in compared} == WIDTHS[name]


def test_reader_logit_correction_agrees_with_the_runtime():
    """The key-noise correction is attention arithmetic (not pinned): equal to float32 rounding."""
    recipe = RECIPES["uniform_codebook"]()
    cache = ReferenceCache.from_recipe(recipe, window=WINDOW, sink_frames=SINKS)
    rope = Rope(torch.zeros(B, T, D // 2))
    for k, v in frames(1)[:9]:
        cache.append(0, k, v, rope)
    q = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(3))
    bias = cache.logit_bias(0, q)  # [B, H, T, keys]
    checked = 0
    for h in range(H):
        c = reader.logit_correction(q[:, h].numpy(), recipe.tensors["layers.0.k.logit_bias"][h].numpy(),
                                    recipe.tensors["layers.0.k.rotation"][h].numpy())
        for key in (bias[:, h] != 0).any(dim=0).any(dim=0).nonzero().flatten().tolist():
            np.testing.assert_allclose(-bias[:, h, :, key].numpy(), c, rtol=1e-5, atol=1e-7)
            checked += 1
    assert checked


# ---- predictive golden vectors (FORMAT.md "Predictive golden vectors") ---------------------------
def _golden_predictive_roles() -> dict[str, torch.Tensor]:
    return {"rotation": torch.eye(2)[None], "mean": torch.zeros(1, 2), "unit": torch.tensor([[0.5, 0.25]]),
            "channel_bits": torch.tensor([[2, 1]]), "intra_step": torch.tensor([[1, 1]]),
            "inter_step": torch.tensor([[1, 1]]), "anchor_bits": torch.tensor([[3, 2]])}


def _ints(cell: str) -> list[int]:
    return [int(v) for v in cell.split()]


def _floats(cell: str) -> torch.Tensor:
    return torch.tensor([[[float(v) for v in cell.split()]]])


@pytest.mark.parametrize("row", golden("Predictive modes"), ids=lambda r: f"{r[0]}|{r[1]}")
def test_golden_predictive_modes(row):
    """The mode choice (ties: inter) and the anchor clamp, in both runtimes' encoders and the reader."""
    from types import SimpleNamespace

    from calibrate.fast_chain import ChainStore
    from calibrate.predictive_roles import head_params
    from calibrate.quant import predictive as P

    roles = _golden_predictive_roles()
    p = head_params(roles, 0)
    x, v_prev = _floats(row[0]), torch.tensor([[_ints(row[1])]])
    tau = P.to_units(x, p)
    (c_i, v_i), (c_p, v_p) = P.intra(tau, p), P.inter(tau, v_prev, p)
    assert [c_i.flatten().tolist(), v_i.flatten().tolist(), c_p.flatten().tolist(), v_p.flatten().tolist()] == \
        [_ints(row[2]), _ints(row[3]), _ints(row[4]), _ints(row[5])]
    w = p.unit_D * p.unit_D
    assert ((tau - v_i.float()).pow(2) * w).sum(-1).item() == float(row[6])
    assert ((tau - v_p.float()).pow(2) * w).sum(-1).item() == float(row[7])
    want = ([row[8] == "inter"], _ints(row[9]), _ints(row[10]))
    inter, codes, v = P.encode(x, p, v_prev)  # the reference runtime's encoder (chain.ChainCodec)
    assert (inter.flatten().tolist(), codes.flatten().tolist(), v.flatten().tolist()) == want
    store = ChainStore({"k": roles, "v": roles}, False, True, SimpleNamespace(recent_frames=0), 1, 0, 1, "cpu")  # the fast runtime's
    inter, codes, v = store.code.encode(x[:, None].expand(1, 2, 1, 2), v_prev[:, None].expand(1, 2, 1, 2))
    for g in range(2):
        assert (inter[:, g].flatten().tolist(), codes[:, g].flatten().tolist(), v[:, g].flatten().tolist()) == want
    tensors = {f"layers.0.v.{r}": t.numpy() for r, t in roles.items()}
    inter, codes, v = reader.predictive_encode(x.numpy(), tensors, 0, "v", 0, v_prev.numpy())
    assert (inter.flatten().tolist(), codes.flatten().tolist(), v.flatten().tolist()) == want
    stored = reader.predictive_store(inter, codes, tensors, 0, "v", 0)
    assert reader.predictive_states(stored, tensors, 0, "v", 0, v_prev.numpy()).flatten().tolist() == want[2]


@pytest.mark.parametrize("row", golden("Sink code"), ids=lambda r: r[0])
def test_golden_sink_code(row):
    """The sink code (format 1.3): code, stored bytes, values and the chain's states after it, in the
    reference math, both runtimes' codecs and the reader."""
    from calibrate.fast_chain_code import ChainCode
    from calibrate.predictive_roles import head_params
    from calibrate.quant import predictive as P
    from reference_runtime import ChainCodec

    roles = _golden_predictive_roles() | {"sink_unit": torch.tensor([[0.125, 0.125]]), "sink_bits": torch.tensor([[5, 4]])}
    p = head_params(roles, 0)
    x = _floats(row[0])
    w, packed, decoded, states = _ints(row[1]), list(bytes.fromhex(row[3])), [float(v) for v in row[4].split()], _ints(row[5])
    assert P.sink_code(x, p).flatten().tolist() == w
    assert P.sink_fields(P.sink_code(x, p), p).flatten().tolist() == _ints(row[2])
    assert P.sink_values(P.sink_code(x, p), p).flatten().tolist() == decoded
    assert P.sink_states(P.sink_code(x, p), p).flatten().tolist() == states
    stored, v = ChainCodec(p).encode(x, None, sink=True)  # the tests' oracle runtime
    assert stored["sink"].flatten().tolist() == packed and v.flatten().tolist() == states
    code = ChainCode([roles, roles], "cpu")  # the fast runtime's, K and V as two heads
    w2, v2 = code.encode_sink(x[:, None].expand(1, 2, 1, 2))
    out = torch.zeros(1, code.sink_layout.nbytes, 1, dtype=torch.uint8)
    code.pack_sink(w2.permute(0, 2, 1, 3), out)
    assert out.flatten().tolist() == packed + packed  # K's row, then V's
    assert code.expand(code.sink_states(code.sink_code_of(out[:, None])).transpose(2, 3)).flatten().tolist() == states + states
    assert code.sink_values(code.sink_code_of(out[:, None])).flatten().tolist() == decoded + decoded
    tensors = {f"layers.0.v.{r}": t.numpy() for r, t in roles.items()}
    mine = reader.predictive_sink(x.numpy(), tensors, 0, "v", 0)
    assert mine["sink"].flatten().tolist() == packed
    assert reader.predictive_states(mine, tensors, 0, "v", 0).flatten().tolist() == states
    assert reader.predictive_sink_values(mine, tensors, 0, "v", 0).flatten().tolist() == decoded


@pytest.mark.parametrize("row", golden("Sink hold"), ids=lambda r: r[0])
def test_golden_sink_hold(row):
    """The sink hold (format 1.4): the sum, the hold bit and its byte, the held values, in the
    reference math, both runtimes' codecs and the reader."""
    from calibrate.fast_chain_code import ChainCode
    from calibrate.predictive_roles import head_params
    from calibrate.quant import predictive as P
    from reference_runtime import ChainCodec

    roles = _golden_predictive_roles() | {"channel_bits": torch.tensor([[2, 0]]), "anchor_bits": torch.tensor([[3, 0]]),
                                          "sink_unit": torch.tensor([[0.125, 0.125]]), "sink_bits": torch.tensor([[5, 4]])}
    p = head_params(roles, 0)
    x, x_s = _floats(row[0]), _floats("0.8 -0.3")
    hold, packed, decoded = row[2] == "1", list(bytes.fromhex(row[3])), [float(v) for v in row[4].split()]
    w = P.sink_code(x_s, p)
    g = p.sink_unit_D * w.float() * (p.bits_D == 0)
    assert (g * (g - 2 * ((x - p.mean_D) @ p.rotation_DD))).sum().item() == float(row[1])
    assert P.sink_hold(x, w, p).item() == hold
    _, codes, v = P.encode(x, p, None)
    assert P.held_values(P.values(v, p), P.sink_hold(x, w, p), P.sink_hold_part(w, p)).flatten().tolist() == decoded
    oracle = ChainCodec(p, hold=True)  # the tests' oracle runtime
    sink, _ = oracle.encode(x_s, None, sink=True)
    stored, v = oracle.encode(x, None, sink_w=oracle.sink_code(sink))
    assert stored["holds"].flatten().tolist() == packed
    assert oracle.values(v, stored, oracle.sink_code(sink)).flatten().tolist() == decoded
    code = ChainCode([roles, roles], "cpu", hold=True)  # the fast runtime's, K and V as two heads
    two = lambda t: t[:, None].expand(1, 2, *t.shape[1:])
    assert code.encode_hold(two(x), two(w)).flatten().tolist() == [hold, hold]
    h = code.hold_part(two(w)[:, None])  # [B, G, T, D]
    held = torch.where(torch.tensor(hold), two(P.values(v, p)) + h, two(P.values(v, p)))
    assert held.flatten().tolist() == decoded + decoded
    tensors = {f"layers.0.v.{r}": t.numpy() for r, t in roles.items()}
    sink_np = reader.predictive_sink(x_s.numpy(), tensors, 0, "v", 0)
    assert reader.predictive_hold(x.numpy(), sink_np, tensors, 0, "v", 0).flatten().tolist() == [hold]
    inter, codes, v = reader.predictive_encode(x.numpy(), tensors, 0, "v", 0)
    mine = reader.predictive_store(inter, codes, tensors, 0, "v", 0, reader.predictive_hold(x.numpy(), sink_np, tensors, 0, "v", 0))
    assert mine["holds"].flatten().tolist() == packed
    x_hat = reader.predictive_values(reader.predictive_states(mine, tensors, 0, "v", 0), tensors, 0, "v", 0)
    assert reader.predictive_held_values(x_hat, mine, sink_np, tensors, 0, "v", 0).flatten().tolist() == decoded


def test_golden_sink_refresh():
    """The sink refresh (format 1.5), frame by frame: the reference (its byte), each frame's hold
    and the h a held token takes, in the reference math, both runtimes' codecs and the reader."""
    from calibrate.fast_chain_code import ChainCode
    from calibrate.predictive_roles import head_params
    from calibrate.quant import predictive as P
    from reference_runtime import ChainCodec

    roles = _golden_predictive_roles() | {"channel_bits": torch.tensor([[2, 0]]), "anchor_bits": torch.tensor([[3, 0]]),
                                          "sink_unit": torch.tensor([[0.125, 0.125]]), "sink_bits": torch.tensor([[5, 4]])}
    p = head_params(roles, 0)
    oracle, code = ChainCodec(p, hold=True), ChainCode([roles], "cpu", hold=True, refresh=2)
    tensors = {f"layers.0.v.{r}": t.numpy() for r, t in roles.items()}
    rows = golden("Sink refresh")
    assert [int(r[0]) for r in rows] == list(range(len(rows)))
    ref = None
    for f, x_cell, packed, hold, h in rows:
        x, f = _floats(x_cell), int(f)
        if f == 0 or P.is_refresh_frame(f, 2, 1):
            ref = P.reference_code(x, p)
            assert torch.equal(ref, P.sink_code(x, p) * (p.bits_D == 0))
            mine = reader.predictive_reference(x.numpy(), tensors, 0, "v", 0)
        assert oracle.reference(ref)["reference"].flatten().tolist() == list(bytes.fromhex(packed))
        out = torch.zeros(1, code.reference_layout.nbytes, 1, dtype=torch.uint8)
        code.pack_sink(ref[:, :, None], out, reference=True)  # [B, T, G, D] -> [B, Cr, T]
        assert out.flatten().tolist() == list(bytes.fromhex(packed))
        assert mine["reference"].flatten().tolist() == list(bytes.fromhex(packed))
        assert torch.equal(code.sink_code_of(out[:, None], reference=True)[:, 0, 0], ref)
        if hold:
            assert P.sink_hold(x, ref, p).item() == (hold == "1")
            assert reader.predictive_hold(x.numpy(), mine, tensors, 0, "v", 0).flatten().tolist() == [hold == "1"]
        assert P.sink_hold_part(ref, p).flatten().tolist() == [float(v) for v in h.split()]


def _golden_predictive_recipe() -> Recipe:
    roles = _golden_predictive_roles()
    spec = TensorSpec(bits=2, kind="predictive", rotation="learned", token_bits=[3], anchor_token_bits=[5])
    info = ModelInfo(name="toy", num_layers=1, num_kv_heads=1, head_dim=2, tokens_per_frame=1, fingerprint="toy")
    tensors = {f"layers.0.{kind}.{r}": t.clone() for kind in "kv" for r, t in roles.items()}
    return Recipe(info, Scheme("golden", [LayerSpec(k=spec, v=spec)], TokenPolicy(sink_frames=0)), tensors)


@pytest.mark.parametrize("row", golden("Window of one frame"))
def test_golden_window_of_one_frame(row, tmp_path):
    """'Held' is judged before the step's eviction: frame 1 is coded against frame 0, which the
    same step evicts, and held as an anchor of those states (both runtimes, and the reader)."""
    from calibrate.fastcache import FastKVCache

    window = int(row[0])
    x0, x1 = _floats(row[1]), _floats(row[2])
    path = tmp_path / "golden.safetensors"
    save_recipe(_golden_predictive_recipe(), path)
    meta, tensors = reader.read_recipe(path)
    rope = Rope(torch.zeros(1, 1, 1))
    ref = ReferenceCache.from_recipe(load_recipe(path), window=window, sink_frames=0)
    fast = FastKVCache.from_recipe(load_recipe(path), window=window, sink_frames=0)
    for x in (x0, x1):
        for cache in (ref, fast):
            cache.append(0, x[:, None], x[:, None], rope)
    assert ref.frame_indices(0) == fast.frame_indices(0) == [1]
    for kind in "kv":
        stored = ref._frames[0][1][kind][0]
        assert set(stored) == {"anchor"} and stored["anchor"].flatten().tolist() == list(bytes.fromhex(row[6]))
    for read in (ref.read(0), fast.read(0)):
        for got in read:
            assert got.flatten().tolist() == [float(v) for v in row[7].split()]
    # the reader, from the spec: frame 0 all intra, frame 1 against frame 0's states, then an anchor
    _, _, v0 = reader.predictive_encode(x0.numpy(), tensors, 0, "k", 0)
    inter, _, v1 = reader.predictive_encode(x1.numpy(), tensors, 0, "k", 0, v0)
    assert v0.flatten().tolist() == _ints(row[3]) and v1.flatten().tolist() == _ints(row[5])
    assert inter.flatten().tolist() == [row[4] == "inter"]
    anchor = reader.predictive_anchor(v1, tensors, 0, "k", 0)
    assert anchor["anchor"].flatten().tolist() == list(bytes.fromhex(row[6]))
    assert reader.predictive_states(anchor, tensors, 0, "k", 0).flatten().tolist() == _ints(row[5])
    assert reader.predictive_values(v1, tensors, 0, "k", 0).flatten().tolist() == [float(v) for v in row[7].split()]

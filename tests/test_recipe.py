"""Recipe file v1: deterministic round trip, and every malformed file rejected with file + field.

Malformed files are made the way a user (or a bug) would make them: write a valid recipe, then
edit its bytes - the safetensors header is an 8-byte little-endian length, a JSON header (tensor
entries + `__metadata__`), then the tensor data.
"""

import json
import struct
import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from calibrate.recipe import (
    ModelInfo,
    Recipe,
    RecipeError,
    TensorSpec,
    TokenPolicy,
    load_recipe,
    save_recipe,
    uniform_scheme,
)
from calibrate.quant.rotation import random_hadamard
from calibrate.schemes import build_baseline

INFO = ModelInfo(name="toy", num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_frame=4, fingerprint="0123456789abcdef")


def toy_recipe(metadata=None) -> Recipe:
    """Static per-channel K with a rotation, per-token V: every check below has a tensor to break."""
    H, D = INFO.num_kv_heads, INFO.head_dim
    k = TensorSpec(bits=2, axis="channel", static=True, rotation="hadamard")
    v = TensorSpec(bits=4, axis="token", group_size=4)
    tensors = {}
    for i in range(INFO.num_layers):
        tensors[f"layers.{i}.k.rotation"] = torch.stack([random_hadamard(D, seed=10 * i + h) for h in range(H)])
        tensors[f"layers.{i}.k.scale"] = torch.full((H, D), 0.5) + 0.01 * torch.arange(H * D).reshape(H, D)
        tensors[f"layers.{i}.k.zero_point"] = -torch.ones(H, D)
    meta = {"calibration": json.dumps({"seed": 0}), "metrics": json.dumps({"psnr": 30.0})} if metadata is None else metadata
    return Recipe(INFO, uniform_scheme("toy", INFO.num_layers, k, v, TokenPolicy(sink_frames=1, recent_frames=2)), tensors, meta)


@pytest.fixture
def recipe_path(tmp_path):
    path = tmp_path / "recipe.safetensors"
    save_recipe(toy_recipe(), path)
    return path


def read_raw(path):
    """(header dict incl. __metadata__, data bytes) of a safetensors file."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_raw(path, header, data, header_text=None):
    text = (header_text if header_text is not None else json.dumps(header)).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def edit_metadata(path, **changes):
    """Set (or with None, delete) `__metadata__` keys in place, tensors untouched."""
    header, data = read_raw(path)
    meta = header["__metadata__"]
    for key, value in changes.items():
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    write_raw(path, header, data)


def edit_tensors(path, edit):
    """Rewrite the file with `edit(tensors)`'s tensors and the same metadata."""
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    path.write_bytes(save(edit(tensors), metadata=meta))


def assert_rejected(path, *fields, model=None):
    with pytest.raises(RecipeError) as err:
        load_recipe(path, model=model)
    msg = str(err.value)
    assert str(path) in msg, msg
    for field in fields:
        assert field in msg, msg
    return msg


# ---- round trip and determinism ------------------------------------------------------------------
def test_round_trip_identical_up_to_metadata_order(tmp_path, recipe_path):
    loaded = load_recipe(recipe_path)
    again = tmp_path / "again.safetensors"
    save_recipe(loaded, again)
    assert read_raw(again) == read_raw(recipe_path)  # same header JSON (as a dict) and same data bytes
    assert loaded.scheme == toy_recipe().scheme and loaded.model == INFO
    assert loaded.section("metrics") == {"psnr": 30.0}
    for name, t in toy_recipe().tensors.items():
        assert torch.equal(loaded.tensors[name], t), name


def test_save_load_save_is_byte_identical(tmp_path, recipe_path):
    paths = [tmp_path / f"again{i}.safetensors" for i in range(3)]
    for p in paths:
        save_recipe(load_recipe(recipe_path), p)
    assert {p.read_bytes() for p in paths} == {recipe_path.read_bytes()}


def test_same_inputs_give_identical_bytes(tmp_path):
    for name, build in (("toy", toy_recipe), ("quarot2", lambda: build_baseline("quarot2", INFO))):
        paths = [tmp_path / f"{name}{i}.safetensors" for i in range(4)]
        for p in paths:
            save_recipe(build(), p)
        assert len({p.read_bytes() for p in paths}) == 1, name


def test_logit_bias_round_trips_byte_identically(tmp_path):
    recipe = toy_recipe()
    recipe.tensors["layers.1.k.logit_bias"] = torch.linspace(0, 1, 16).reshape(2, 8)
    paths = [tmp_path / f"r{i}.safetensors" for i in range(2)]
    save_recipe(recipe, paths[0])
    save_recipe(load_recipe(paths[0]), paths[1])
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert torch.equal(load_recipe(paths[1]).tensors["layers.1.k.logit_bias"], recipe.tensors["layers.1.k.logit_bias"])


@pytest.mark.parametrize("name,value,words", [
    ("layers.0.k.logit_bias", torch.ones(2, 7), ["shape", "[2, 7]", "[2, 8]"]),
    ("layers.0.k.logit_bias", torch.ones(8), ["shape", "[8]", "[2, 8]"]),
    ("layers.0.v.logit_bias", torch.ones(2, 8), ["keys only"]),
    ("layers.0.k.logit_bias", -torch.ones(2, 8), [">= 0"]),
    ("layers.0.k.logit_bias", torch.full((2, 8), float("nan")), [">= 0"]),
])
def test_bad_logit_bias_is_rejected(recipe_path, name, value, words):
    edit_tensors(recipe_path, lambda t: {**t, name: value})
    assert_rejected(recipe_path, f"'{name}'", *words)


def test_negative_keyframe_interval_is_rejected(recipe_path):
    header, _ = read_raw(recipe_path)
    scheme = json.loads(header["__metadata__"]["scheme"])
    scheme["policy"]["keyframe_interval"] = -4
    edit_metadata(recipe_path, scheme=json.dumps(scheme))
    assert_rejected(recipe_path, "scheme.policy.keyframe_interval", ">= 0")


def test_loaded_baseline_matches_its_builder(tmp_path):
    path = tmp_path / "kivi2.safetensors"
    built = build_baseline("kivi2", INFO)
    save_recipe(built, path)
    loaded = load_recipe(path, model=INFO)
    assert loaded.scheme == built.scheme and loaded.path == str(path)


def test_failed_save_leaves_no_file(tmp_path):
    bad = toy_recipe()
    del bad.tensors["layers.1.k.scale"]
    path = tmp_path / "out.safetensors"
    with pytest.raises(RecipeError, match="layers.1.k.scale"):
        save_recipe(bad, path)
    assert list(tmp_path.iterdir()) == []


def test_failed_save_keeps_the_previous_file(tmp_path, recipe_path):
    before = recipe_path.read_bytes()
    bad = toy_recipe()
    bad.tensors["layers.0.k.scale"][0, 0] = -1.0
    with pytest.raises(RecipeError, match="scale"):
        save_recipe(bad, recipe_path)
    assert recipe_path.read_bytes() == before
    assert [p.name for p in recipe_path.parent.iterdir()] == [recipe_path.name]


# ---- malformed files -------------------------------------------------------------------------------
def test_missing_file(tmp_path):
    assert_rejected(tmp_path / "nope.safetensors", "no such recipe file")


def test_truncated_file(recipe_path):
    blob = recipe_path.read_bytes()
    recipe_path.write_bytes(blob[: len(blob) - 20])
    assert_rejected(recipe_path, "safetensors")


def test_truncated_header(recipe_path):
    recipe_path.write_bytes(recipe_path.read_bytes()[:40])
    assert_rejected(recipe_path, "safetensors")


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("this is a text file, not a recipe\n")
    assert_rejected(path, "not a readable safetensors file")


def test_wrong_format(recipe_path):
    edit_metadata(recipe_path, format="tinyworld-weights")
    assert_rejected(recipe_path, "'format'", "tinyworld-weights")


@pytest.mark.parametrize("key", ["format", "format_version", "producer", "model", "scheme"])
def test_missing_required_metadata(recipe_path, key):
    edit_metadata(recipe_path, **{key: None})
    assert_rejected(recipe_path, f"'{key}'", "missing")


def test_major_version_mismatch(recipe_path):
    edit_metadata(recipe_path, format_version="2.0")
    assert_rejected(recipe_path, "'format_version'", "2.0")


def test_newer_minor_version_loads(recipe_path):
    edit_metadata(recipe_path, format_version="1.7")
    assert load_recipe(recipe_path).scheme.name == "toy"


def test_metadata_not_json(recipe_path):
    edit_metadata(recipe_path, scheme="{not json")
    assert_rejected(recipe_path, "JSON")


def test_unknown_spec_field(recipe_path):
    header, _ = read_raw(recipe_path)
    scheme = json.loads(header["__metadata__"]["scheme"])
    scheme["layers"][1]["v"]["dither"] = True
    edit_metadata(recipe_path, scheme=json.dumps(scheme))
    assert_rejected(recipe_path, "scheme.layers[1].v", "dither")


def test_bad_bits_value(recipe_path):
    header, _ = read_raw(recipe_path)
    scheme = json.loads(header["__metadata__"]["scheme"])
    scheme["layers"][0]["k"]["bits"] = 5
    edit_metadata(recipe_path, scheme=json.dumps(scheme))
    assert_rejected(recipe_path, "scheme.layers[0].k.bits", "5")


def test_layer_count_mismatch(recipe_path):
    header, _ = read_raw(recipe_path)
    scheme = json.loads(header["__metadata__"]["scheme"])
    scheme["layers"] = scheme["layers"][:1]
    edit_metadata(recipe_path, scheme=json.dumps(scheme))
    assert_rejected(recipe_path, "scheme.layers", "num_layers")


def test_model_json_missing_field(recipe_path):
    header, _ = read_raw(recipe_path)
    model = json.loads(header["__metadata__"]["model"])
    del model["fingerprint"]
    edit_metadata(recipe_path, model=json.dumps(model))
    assert_rejected(recipe_path, "model", "fingerprint")


def test_missing_required_tensor(recipe_path):
    edit_tensors(recipe_path, lambda t: {k: v for k, v in t.items() if k != "layers.1.k.zero_point"})
    assert_rejected(recipe_path, "'layers.1.k.zero_point'", "missing")


def test_wrong_shape(recipe_path):
    edit_tensors(recipe_path, lambda t: {**t, "layers.0.k.scale": t["layers.0.k.scale"][:, :4].contiguous()})
    assert_rejected(recipe_path, "'layers.0.k.scale'", "shape", "[2, 4]", "[2, 8]")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_tensor(recipe_path, bad):
    def poison(t):
        z = t["layers.1.k.zero_point"].clone()
        z[1, 3] = bad
        return {**t, "layers.1.k.zero_point": z}

    edit_tensors(recipe_path, poison)
    assert_rejected(recipe_path, "'layers.1.k.zero_point'", "NaN or Inf")


@pytest.mark.parametrize("bad", [0.0, -0.25])
def test_non_positive_scale(recipe_path, bad):
    def poison(t):
        s = t["layers.0.k.scale"].clone()
        s[0, 5] = bad
        return {**t, "layers.0.k.scale": s}

    edit_tensors(recipe_path, poison)
    assert_rejected(recipe_path, "'layers.0.k.scale'", "non-positive")


def test_non_orthogonal_rotation(recipe_path):
    edit_tensors(recipe_path, lambda t: {**t, "layers.1.k.rotation": t["layers.1.k.rotation"] * 1.01})
    assert_rejected(recipe_path, "'layers.1.k.rotation'", "orthogonal")


def test_bad_clip_tensor(recipe_path):
    edit_tensors(recipe_path, lambda t: {**t, "layers.0.v.clip": torch.tensor([0.9, 1.5])})
    assert_rejected(recipe_path, "'layers.0.v.clip'")


def test_model_fingerprint_mismatch(recipe_path):
    other = ModelInfo(**{**INFO.__dict__, "fingerprint": "fedcba9876543210"})
    assert_rejected(recipe_path, "fingerprint", INFO.fingerprint, "fedcba9876543210", model=other)
    assert load_recipe(recipe_path, model=INFO).model == INFO


def test_model_shape_mismatch(recipe_path):
    other = ModelInfo(**{**INFO.__dict__, "tokens_per_frame": 16})
    assert_rejected(recipe_path, "model.tokens_per_frame", model=other)


def test_unknown_role(recipe_path):
    edit_tensors(recipe_path, lambda t: {**t, "layers.0.k.dither": torch.zeros(2)})
    assert_rejected(recipe_path, "'layers.0.k.dither'", "unknown role")


@pytest.mark.parametrize("name", ["extra", "layers.0.q.scale", "layers.0.k.scale.bias", "__reserved__"])
def test_name_outside_the_scheme(recipe_path, name):
    edit_tensors(recipe_path, lambda t: {**t, name: torch.zeros(2)})
    assert_rejected(recipe_path, f"'{name}'", "reserved or not of the form")


def test_tensor_named_metadata_is_refused_on_save_and_load(tmp_path, recipe_path):
    # safetensors itself writes a tensor named `__metadata__` (as a second, duplicate JSON key next
    # to the real metadata) and then cannot read the file back; the writer must refuse it first
    bad = toy_recipe()
    bad.tensors["__metadata__"] = torch.zeros(2)
    out = tmp_path / "reserved.safetensors"
    with pytest.raises(RecipeError, match="'__metadata__' is reserved"):
        save_recipe(bad, out)
    assert not out.exists()
    # the same entry crafted by hand: the header has `__metadata__` twice, the loader rejects it
    header, data = read_raw(recipe_path)
    entry = json.dumps({"dtype": "F32", "shape": [2], "data_offsets": [len(data), len(data) + 8]})
    text = json.dumps(header)[:-1] + ', "__metadata__": ' + entry + "}"
    write_raw(recipe_path, None, data + bytes(8), header_text=text)
    assert_rejected(recipe_path, "not a readable safetensors file")


def test_unknown_metadata_warns_and_loads(recipe_path):
    edit_metadata(recipe_path, colour="blue")
    with pytest.warns(UserWarning, match="unknown metadata field 'colour'") as record:
        recipe = load_recipe(recipe_path)
    assert str(recipe_path) in str(record[0].message)
    assert recipe.scheme.name == "toy" and "colour" not in recipe.metadata


def test_known_optional_metadata_does_not_warn(recipe_path):
    edit_metadata(recipe_path, fit=json.dumps({"why": "test"}), memory=json.dumps({"bits_per_element": 2.5}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recipe = load_recipe(recipe_path)
    assert recipe.section("fit") == {"why": "test"} and recipe.section("memory")["bits_per_element"] == 2.5


def _spec_recipe(spec: TensorSpec, tensors: dict) -> Recipe:
    return Recipe(INFO, uniform_scheme("gap", INFO.num_layers, spec, TensorSpec(bits=16), TokenPolicy()),
                  {f"layers.{i}.k.{role}": t for i in range(INFO.num_layers) for role, t in tensors.items()})


VALIDATOR_GAPS = {
    # the codec raises ValueError at the first encode instead
    "unsorted_codebook": (TensorSpec(bits=2, kind="codebook"), {"codebook": torch.tensor([[1.0, -1, 0.5, -0.5]] * 2)}),
    # the centroid index is stored as uint8: index 300 would wrap to 44
    "centroids_over_256": (TensorSpec(bits=2, centroids=300), {"centroids": torch.zeros(2, 300, 8)}),
    # 8 % -4 == 0 in Python, so the divisibility check passes; group_view raises later
    "negative_group_size": (TensorSpec(bits=2, group_size=-4), {}),
    # applied by head_params although the spec says rotation="none"; shape unchecked -> RuntimeError
    "rotation_the_spec_does_not_use": (TensorSpec(bits=2), {"rotation": torch.eye(4).expand(2, 4, 4).clone()}),
    # used by the codec (and counted in bytes) although spec.outliers == 0
    "outliers_the_spec_does_not_use": (TensorSpec(bits=2), {"outlier_channels": torch.tensor([[0], [1]])}),
}


@pytest.mark.parametrize("case", VALIDATOR_GAPS)
def test_validator_gaps(tmp_path, case):
    spec, tensors = VALIDATOR_GAPS[case]
    with pytest.raises(RecipeError):
        save_recipe(_spec_recipe(spec, tensors), tmp_path / "gap.safetensors")

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
    # nearest-level search needs sorted rows (FORMAT.md: checked on load)
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


# ---- strict metadata types (issue 19): every case is one line naming the file and the field ------
def edit_json(path, key, edit):
    """Decode metadata `key`, let `edit` change the object in place, write it back."""
    header, _ = read_raw(path)
    obj = json.loads(header["__metadata__"][key])
    edit(obj)
    edit_metadata(path, **{key: json.dumps(obj)})


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(obj):
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value
    return edit


STRICT_CASES = {
    # JSON type of a TensorSpec field: no string-for-bool, no float-for-int, no bool-for-int
    "symmetric_string": ("scheme", _set("layers", 0, "v", "symmetric", "no"), ["scheme.layers[0].v.symmetric", "true or false", '"no"']),
    "symmetric_int": ("scheme", _set("layers", 0, "v", "symmetric", 0), ["scheme.layers[0].v.symmetric", "true or false"]),
    "bits_float": ("scheme", _set("layers", 1, "k", "bits", 2.0), ["scheme.layers[1].k.bits", "JSON integer", "2.0"]),
    "bits_bool": ("scheme", _set("layers", 1, "k", "bits", True), ["scheme.layers[1].k.bits", "JSON integer", "true"]),
    "head_bits_float": ("scheme", _set("layers", 0, "v", "head_bits", [4, 4.0]), ["scheme.layers[0].v.head_bits", "integers"]),
    "head_bits_range": ("scheme", _set("layers", 0, "v", "head_bits", [4, 5]), ["scheme.layers[0].v.head_bits[1]", "5"]),
    "group_size_string": ("scheme", _set("layers", 0, "v", "group_size", "4"), ["scheme.layers[0].v.group_size", '"4"']),
    "clip_bool": ("scheme", _set("layers", 0, "v", "clip", True), ["scheme.layers[0].v.clip", "number"]),
    "clip_range": ("scheme", _set("layers", 0, "v", "clip", 1.5), ["scheme.layers[0].v.clip", "(0, 1]"]),
    "kind_unknown": ("scheme", _set("layers", 0, "v", "kind", "lattice"), ["scheme.layers[0].v.kind", '"uniform"']),
    # policy
    "sink_frames_float": ("scheme", _set("policy", "sink_frames", 1.5), ["scheme.policy.sink_frames", "JSON integer", "1.5"]),
    "recent_bits_string": ("scheme", _set("policy", "recent_bits", "16"), ["scheme.policy.recent_bits", '"16"']),
    "keyframe_interval_negative": ("scheme", _set("policy", "keyframe_interval", -4), ["scheme.policy.keyframe_interval", ">= 0"]),
    # scheme and model
    "scheme_name_int": ("scheme", _set("name", 7), ["scheme.name", "string"]),
    "layers_not_list": ("scheme", _set("layers", {"k": {}}), ["scheme.layers", "list"]),
    "layer_without_v": ("scheme", _set("layers", 1, {"k": {}}), ["scheme.layers[1]", "'v'"]),
    "num_layers_string": ("model", _set("num_layers", "4"), ["model.num_layers", "JSON integer", '"4"']),
    "head_dim_float": ("model", _set("head_dim", 8.0), ["model.head_dim", "JSON integer", "8.0"]),
    "num_kv_heads_zero": ("model", _set("num_kv_heads", 0), ["model.num_kv_heads", ">= 1"]),
    "fingerprint_int": ("model", _set("fingerprint", 123), ["model.fingerprint", "string"]),
    # a codebook per channel must be static (the spec no longer defines a per-token reading of it)
    "codebook_channel_dynamic": ("scheme", lambda s: s["layers"][0]["v"].update(kind="codebook", axis="channel"),
                                 ["scheme.layers[0].v.static", "must be static"]),
}


@pytest.mark.parametrize("case", STRICT_CASES)
def test_metadata_of_the_wrong_type_or_range_is_one_line_naming_file_and_field(recipe_path, case):
    key, edit, words = STRICT_CASES[case]
    edit_json(recipe_path, key, edit)
    msg = assert_rejected(recipe_path, *words)
    assert "\n" not in msg


def test_json_constants_are_not_json(recipe_path):
    header, _ = read_raw(recipe_path)
    text = header["__metadata__"]["scheme"].replace('"clip": 1.0', '"clip": NaN', 1)
    assert "NaN" in text
    edit_metadata(recipe_path, scheme=text)
    assert_rejected(recipe_path, "'scheme'", "NaN is not a JSON value")


@pytest.mark.parametrize("version", ["1", "1.7.3", "01.1", "1.01", "1.x", " 1.1", "v1.1"])
def test_format_version_must_be_major_dot_minor(recipe_path, version):
    edit_metadata(recipe_path, format_version=version)
    msg = assert_rejected(recipe_path, "'format_version'")
    assert "\n" not in msg


def test_format_version_newer_minor_of_several_digits_loads(recipe_path):
    edit_metadata(recipe_path, format_version="1.12")
    assert load_recipe(recipe_path).scheme.name == "toy"


@pytest.mark.parametrize("name", ["layers.01.k.scale", "layers.+1.k.scale", "layers.1 .k.scale", "layers.٣.k.scale"])
def test_tensor_names_use_decimal_layers_without_leading_zeros(recipe_path, name):
    edit_tensors(recipe_path, lambda t: {**t, name: t["layers.1.k.scale"].clone()})
    msg = assert_rejected(recipe_path, f"'{name}'", "without leading zeros")
    assert "\n" not in msg


@pytest.mark.parametrize("role,dtype", [("scale", torch.float64), ("zero_point", torch.float16), ("rotation", torch.float64)])
def test_float_roles_are_float32(recipe_path, role, dtype):
    edit_tensors(recipe_path, lambda t: {**t, f"layers.0.k.{role}": t[f"layers.0.k.{role}"].to(dtype)})
    assert_rejected(recipe_path, f"'layers.0.k.{role}'", "dtype", "float32")


def test_clip_role_is_float32(recipe_path):
    edit_tensors(recipe_path, lambda t: {**t, "layers.0.v.clip": torch.tensor([0.9, 1.0], dtype=torch.float64)})
    assert_rejected(recipe_path, "'layers.0.v.clip'", "float64", "float32")


def test_outlier_channels_are_int64(tmp_path):
    spec = TensorSpec(bits=2, outliers=1)
    recipe = _spec_recipe(spec, {"outlier_channels": torch.tensor([[0], [1]], dtype=torch.int32)})
    with pytest.raises(RecipeError, match=r"'layers.0.k.outlier_channels' has dtype int32, role 'outlier_channels' is int64"):
        save_recipe(recipe, tmp_path / "r.safetensors")


def test_unsorted_codebook_is_rejected_on_load(tmp_path):
    path = tmp_path / "cb.safetensors"
    good = _spec_recipe(TensorSpec(bits=2, kind="codebook"), {"codebook": torch.tensor([[-1.0, -0.5, 0.5, 1]] * 2)})
    good.tensors = {k: t.clone() for k, t in good.tensors.items()}
    save_recipe(good, path)
    edit_tensors(path, lambda t: {**t, "layers.1.k.codebook": torch.tensor([[1.0, -1, 0.5, -0.5]] * 2)})
    assert_rejected(path, "'layers.1.k.codebook'", "sorted ascending")


def test_writer_holds_in_memory_values_to_the_json_types(tmp_path):
    bad = toy_recipe()
    bad.scheme.policy.sink_frames = 1.0
    with pytest.raises(RecipeError, match=r"scheme.policy.sink_frames: must be a JSON integer"):
        save_recipe(bad, tmp_path / "r.safetensors")
    bad = toy_recipe()
    bad.scheme.layers[0].v.symmetric = "no"
    with pytest.raises(RecipeError, match=r"scheme.layers\[0\].v.symmetric: must be true or false"):
        save_recipe(bad, tmp_path / "r.safetensors")
    assert not (tmp_path / "r.safetensors").exists()


def test_schema_tables_match_the_dataclasses_and_format_md():
    """Every field of ModelInfo, TokenPolicy and TensorSpec has a JSON type in recipe_schema, and
    FORMAT.md's tables give each the same type."""
    from dataclasses import fields as dc_fields
    from pathlib import Path
    import re

    from calibrate.plan import MemoryPlan
    from calibrate.recipe_schema import MODEL_FIELDS, PLAN_FIELDS, POLICY_FIELDS, SPEC_FIELDS

    assert set(MODEL_FIELDS) == {f.name for f in dc_fields(ModelInfo)}
    assert set(POLICY_FIELDS) | {"plan"} == {f.name for f in dc_fields(TokenPolicy)}  # plan: an object, PLAN_FIELDS
    assert set(PLAN_FIELDS) == {f.name for f in dc_fields(MemoryPlan)}
    assert set(SPEC_FIELDS) == {f.name for f in dc_fields(TensorSpec)}
    text = (Path(__file__).resolve().parents[1] / "recipes" / "FORMAT.md").read_text(encoding="utf-8")
    documented = {}
    for m in re.finditer(r"^\| `(\w+)` \| (int list or null|int|number|bool|str) \|", text, re.MULTILINE):
        documented.setdefault(m.group(1), m.group(2))
    for table in (MODEL_FIELDS, POLICY_FIELDS, SPEC_FIELDS, PLAN_FIELDS):
        for name, f in table.items():
            assert documented.get(name) == f.type, (name, documented.get(name), f.type)

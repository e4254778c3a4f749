"""The recipe file (format v1): what to quantize how, self-describing, validated on load.

A recipe is one `.safetensors` file. Its `__metadata__` holds JSON strings (`model`, `scheme`,
`calibration`, `metrics`, `memory`) and its tensors hold the fitted parameters, named
`layers.{i}.{k|v}.<role>`. `recipes/FORMAT.md` is the normative description; this module is
the reference writer and loader.

The scheme (JSON) says, per layer and for K and V separately, a `TensorSpec`, and a token
policy (`scheme_spec.py`: every field, and the strict parsing of the JSON).

Loading is strict: every metadata field has one JSON type and range (recipe_schema.py, the
table of FORMAT.md), tensor names follow `layers.{i}.{k|v}.{role}` with i in decimal without
leading zeros, each role has one dtype (float32, or int64), and `format_version` is MAJOR.MINOR.
Nothing is coerced: a value a foreign reader would read differently is an error naming the file
and the field.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field

import torch

from calibrate import predictive_roles
from calibrate.codes import KINDS
from calibrate.io import check_format, read_safetensors, safetensors_bytes, write_bytes_atomic
from calibrate.recipe_schema import (MODEL_FIELDS, PLAN_FIELDS, POLICY_FIELDS, FieldError, check_version, parse_object,
                                     parse_tensor_name)
from calibrate.scheme_spec import (LayerSpec, RecipeError, Scheme, TensorSpec, TokenPolicy,  # noqa: F401
                                   parse_fields, parse_spec, uniform_scheme)
from calibrate.types import ModelInfo

FORMAT = "kv-recipe"
FORMAT_VERSION = "1.5"  # 1.1: kinds predictive, prq, turbo, turbo_prod; fields, roles and rotation "random"; 1.2: kind nvfp4;
# 1.3: the predictive sink code (field sink_token_bits, roles sink_unit and sink_bits); 1.4: field sink_hold;
# 1.5: fields sink_refresh and refresh_token_bits (FORMAT.md)
REQUIRED_METADATA = ("format", "format_version", "producer", "model", "scheme")
OPTIONAL_METADATA = ("calibration", "metrics", "memory", "fit")
INT_ROLES = ("outlier_channels", "sink_bits") + predictive_roles.INT_ROLES  # int64; every other role is float32
KNOWN_ROLES = ("rotation", "scale", "zero_point", "clip", "codebook", "outlier_channels", "centroids",
               "comp_down", "comp_up", "logit_bias", "lloyd_max", "qjl") + predictive_roles.ROLES[1:] + predictive_roles.SINK_ROLES


@dataclass
class Recipe:
    model: ModelInfo
    scheme: Scheme
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)  # calibration, metrics, memory, ... (JSON)
    path: str | None = None

    def tensor(self, layer: int, kind: str, role: str) -> torch.Tensor | None:
        return self.tensors.get(f"layers.{layer}.{kind}.{role}")

    def spec(self, layer: int, kind: str) -> TensorSpec:
        """The `TensorSpec` of `kind` ("k" or "v") in `layer`."""
        return getattr(self.scheme.layers[layer], kind)

    def layer_tensors(self, layer: int, kind: str) -> dict[str, torch.Tensor]:
        """Role -> per-head tensor [H, ...] of `kind` in `layer` (what `codec.head_params` reads)."""
        prefix = f"layers.{layer}.{kind}."
        return {name[len(prefix):]: t for name, t in self.tensors.items() if name.startswith(prefix)}

    def section(self, name: str) -> dict:
        return json.loads(self.metadata.get(name, "{}"))


# ---- writing ------------------------------------------------------------------------------
def producer() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"calibrate {version('calibrate')}"
    except PackageNotFoundError:
        return "calibrate (source)"


def to_bytes(recipe: Recipe) -> bytes:
    """Serialized recipe; deterministic (sorted keys, contiguous float32/int64 tensors)."""
    meta = {k: v for k, v in recipe.metadata.items()}
    meta.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        producer=producer(),
        model=json.dumps(asdict(recipe.model), sort_keys=True),
        scheme=recipe.scheme.to_json(),
    )
    tensors = {k: v.detach().contiguous().cpu() for k, v in sorted(recipe.tensors.items())}
    return safetensors_bytes(tensors, meta)


def save_recipe(recipe: Recipe, path: str | os.PathLike) -> None:
    validate(recipe, str(path))
    write_bytes_atomic(path, to_bytes(recipe))


# ---- loading and validation ---------------------------------------------------------------
def load_recipe(path: str | os.PathLike, model: ModelInfo | None = None) -> Recipe:
    """Load and validate a recipe; with `model`, also check it was made for that model."""
    p = str(path)
    meta, tensors = read_safetensors(p, "recipe", RecipeError)
    for key in REQUIRED_METADATA:
        if key not in meta:
            raise RecipeError(f"{p}: metadata field '{key}' is missing")
    check_format(p, meta, FORMAT, FORMAT_VERSION, RecipeError)
    problem = check_version(meta["format_version"], int(FORMAT_VERSION.split(".")[0]))
    if problem:
        raise RecipeError(f"{p}: metadata field 'format_version' {problem}")
    for key in sorted(set(meta) - set(REQUIRED_METADATA) - set(OPTIONAL_METADATA)):
        warnings.warn(f"{p}: unknown metadata field '{key}' ignored", stacklevel=2)
    try:
        info = ModelInfo(**parse_fields(_json(meta, "model"), MODEL_FIELDS, "model", required=tuple(MODEL_FIELDS)))
        scheme = Scheme.from_dict(_json(meta, "scheme"))
    except RecipeError as e:
        raise RecipeError(f"{p}: {e}") from None
    extra = {k: meta[k] for k in OPTIONAL_METADATA if k in meta}
    recipe = Recipe(model=info, scheme=scheme, tensors=tensors, metadata=extra, path=p)
    validate(recipe, p)
    if model is not None:
        check_model(recipe, model)
    return recipe


def _json(meta: dict[str, str], key: str):
    """A metadata value parsed as strict JSON (no NaN or Infinity, which are not JSON)."""
    def no_constants(name):
        raise RecipeError(f"metadata field '{key}' is not valid JSON ({name} is not a JSON value)")
    try:
        return json.loads(meta[key], parse_constant=no_constants)
    except json.JSONDecodeError as e:
        raise RecipeError(f"metadata field '{key}' is not valid JSON ({e})") from None


def check_model(recipe: Recipe, model: ModelInfo) -> None:
    where = recipe.path or "recipe"
    if recipe.model.fingerprint != model.fingerprint:
        raise RecipeError(
            f"{where}: model fingerprint {recipe.model.fingerprint} does not match the model in use "
            f"({model.name}, {model.fingerprint}); recalibrate for this model"
        )
    for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_frame"):
        if getattr(recipe.model, name) != getattr(model, name):
            raise RecipeError(f"{where}: model.{name} is {getattr(recipe.model, name)}, the model has {getattr(model, name)}")


def expected_shapes(spec: TensorSpec, H: int, D: int) -> dict[str, tuple[int, ...]]:
    """Tensor roles a spec requires, with their shapes: the general ones, then its kind's own."""
    shapes: dict[str, tuple[int, ...]] = {}
    if spec.rotation != "none":
        shapes["rotation"] = (H, D, D)
    if spec.axis == "channel" and spec.static:
        shapes["scale"] = (H, D)
        shapes["zero_point"] = (H, D)
    if spec.outliers:
        shapes["outlier_channels"] = (H, spec.outliers)
    if spec.centroids:
        shapes["centroids"] = (H, spec.centroids, D)
    if spec.comp_rank:
        shapes["comp_down"] = (H, D, spec.comp_rank)
        shapes["comp_up"] = (H, spec.comp_rank, D)
    return shapes | KINDS[spec.kind].roles(spec, H, D)


def validate(recipe: Recipe, where: str) -> None:
    """Every rule of FORMAT.md's Validation on an in-memory recipe (the writer runs it before
    saving, the loader after parsing); RecipeError naming `where` and the field."""
    m, s = recipe.model, recipe.scheme
    try:  # the in-memory values must have the JSON types a reader will hold them to
        parse_object(asdict(m), MODEL_FIELDS, "model", required=tuple(MODEL_FIELDS))
        policy = asdict(s.policy)
        plan = policy.pop("plan")
        parse_object(policy, POLICY_FIELDS, "scheme.policy")
        if plan is not None:
            parse_object(plan, PLAN_FIELDS, "scheme.policy.plan", ("device_budget_bytes",))
        for name in ("name", "notes"):
            if type(getattr(s, name)) is not str:
                raise FieldError(f"scheme.{name}: must be a JSON string, got {getattr(s, name)!r}")
    except FieldError as e:
        raise RecipeError(f"{where}: {e}") from None
    H, D = m.num_kv_heads, m.head_dim
    if len(s.layers) != m.num_layers:
        raise RecipeError(f"{where}: scheme.layers has {len(s.layers)} entries, model.num_layers is {m.num_layers}")
    for name in recipe.tensors:
        parsed = parse_tensor_name(name)
        if parsed is None:
            raise RecipeError(f"{where}: tensor name '{name}' is reserved or not of the form layers.<i>.<k|v>.<role> "
                              "(i decimal without leading zeros)")
        layer, kind, role = parsed
        if layer >= m.num_layers:
            raise RecipeError(f"{where}: tensor '{name}' names layer {layer}, the model has {m.num_layers}")
        if role not in KNOWN_ROLES:
            raise RecipeError(f"{where}: tensor '{name}' has unknown role '{role}'")
        spec = getattr(s.layers[layer], kind)
        if role not in expected_shapes(spec, H, D) and role not in ("clip", "logit_bias"):
            raise RecipeError(f"{where}: tensor '{name}' is not used by its spec (role '{role}' not required)")
        dtype = torch.int64 if role in INT_ROLES else torch.float32
        if recipe.tensors[name].dtype != dtype:
            raise RecipeError(f"{where}: tensor '{name}' has dtype {str(recipe.tensors[name].dtype).removeprefix('torch.')}, "
                              f"role '{role}' is {str(dtype).removeprefix('torch.')}")
        if role == "logit_bias":
            _check_logit_bias(recipe.tensors[name], name, kind, H, D, where)
    for i, layer in enumerate(s.layers):
        for kind in ("k", "v"):
            spec: TensorSpec = getattr(layer, kind)
            try:
                parse_spec(asdict(spec), f"scheme.layers[{i}].{kind}")
            except RecipeError as e:
                raise RecipeError(f"{where}: {e}") from None
            if kind == "v" and spec.rotary_coords:
                raise RecipeError(f"{where}: scheme.layers[{i}].v.rotary_coords: values have no rotary encoding")
            if spec.head_bits is not None and len(spec.head_bits) != H:
                raise RecipeError(f"{where}: scheme.layers[{i}].{kind}.head_bits has {len(spec.head_bits)} entries, expected {H}")
            g = spec.group_size or D
            if D % g:
                raise RecipeError(f"{where}: scheme.layers[{i}].{kind}.group_size {g} does not divide head_dim {D}")
            if spec.comp_rank < 0 or spec.comp_rank > D:
                raise RecipeError(f"{where}: scheme.layers[{i}].{kind}.comp_rank {spec.comp_rank} not in [0, {D}]")
            for role, shape in expected_shapes(spec, H, D).items():
                name = f"layers.{i}.{kind}.{role}"
                t = recipe.tensors.get(name)
                if t is None:
                    raise RecipeError(f"{where}: required tensor '{name}' is missing")
                if tuple(t.shape) != shape:
                    raise RecipeError(f"{where}: tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
            for role in ("rotation", "scale", "zero_point", "clip", "codebook", "centroids", "comp_down", "comp_up"):
                t = recipe.tensors.get(f"layers.{i}.{kind}.{role}")
                if t is not None and t.is_floating_point() and not torch.isfinite(t).all():
                    raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.{role}' has NaN or Inf values")
            scale = recipe.tensors.get(f"layers.{i}.{kind}.scale")
            if scale is not None and not (scale > 0).all():
                raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.scale' has non-positive values")
            clip = recipe.tensors.get(f"layers.{i}.{kind}.clip")
            if clip is not None and (clip.shape != (H,) or not ((clip > 0) & (clip <= 1)).all()):
                raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.clip' must be [H] with values in (0, 1]")
            rot = recipe.tensors.get(f"layers.{i}.{kind}.rotation")
            if rot is not None:
                eye = torch.eye(D, dtype=torch.float64)
                err = (rot.double().transpose(-1, -2) @ rot.double() - eye).abs().max().item()
                if err > 1e-4:
                    raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.rotation' is not orthogonal (max |R^T R - I| = {err:.2e})")
            cb = recipe.tensors.get(f"layers.{i}.{kind}.codebook")
            if cb is not None and not (cb[:, 1:] >= cb[:, :-1]).all():
                raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.codebook' rows must be sorted ascending "
                                  "(non-decreasing: nearest-level search assumes it)")
            if spec.kind == "predictive":
                _check_predictive(recipe, i, kind, spec, H, where)
            oc = recipe.tensors.get(f"layers.{i}.{kind}.outlier_channels")
            if oc is not None and (oc.dtype != torch.int64 or (oc < 0).any() or (oc >= D).any()):
                raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.outlier_channels' must be int64 in [0, {D})")
            _validate_v11(recipe, i, kind, spec, where)
    if s.policy.plan is not None:
        try:
            s.policy.plan.check("scheme.policy.plan")
        except ValueError as e:
            raise RecipeError(f"{where}: {e}") from None


def _check_predictive(recipe: Recipe, i: int, kind: str, spec: TensorSpec, H: int, where: str) -> None:
    for name in ("token_bits", "anchor_token_bits", "sink_token_bits", "refresh_token_bits"):
        if getattr(spec, name) is None:
            continue
        if len(getattr(spec, name)) != H:
            raise RecipeError(f"{where}: scheme.layers[{i}].{kind}.{name} has {len(getattr(spec, name))} entries, expected {H}")
    if kind == "k" and recipe.tensor(i, "k", "logit_bias") is not None:
        raise RecipeError(f"{where}: tensor 'layers.{i}.k.logit_bias': the logit correction is not defined for predictive keys")
    if recipe.scheme.policy.recent_frames and recipe.scheme.policy.recent_bits != 16:
        raise RecipeError(f"{where}: scheme.policy.recent_bits must be 16 with predictive tensors (recent frames are "
                          "held in float16 until they join the chain)")
    try:
        predictive_roles.check(recipe.layer_tensors(i, kind), spec.token_bits, spec.anchor_token_bits, f"layers.{i}.{kind}",
                               spec.sink_token_bits, spec.refresh_token_bits)
    except ValueError as e:
        raise RecipeError(f"{where}: {e}") from None


def _validate_v11(recipe: Recipe, i: int, kind: str, spec: TensorSpec, where: str) -> None:
    """Tensors and policy of the format 1.1 kinds and the Jensen correction of layer i's K or V."""
    field = f"scheme.layers[{i}].{kind}"
    for role in ("lloyd_max", "qjl"):
        t = recipe.tensors.get(f"layers.{i}.{kind}.{role}")
        if t is not None and (not t.is_floating_point() or not torch.isfinite(t).all()):
            raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.{role}' must be finite float values")
    levels = recipe.tensors.get(f"layers.{i}.{kind}.lloyd_max")
    if levels is not None and not (levels[:, 1:] > levels[:, :-1]).all():
        raise RecipeError(f"{where}: tensor 'layers.{i}.{kind}.lloyd_max' rows must be strictly ascending")
    if spec.jensen and kind != "k":
        raise RecipeError(f"{where}: {field}.jensen: the Jensen correction applies to keys only")
    if spec.jensen and f"layers.{i}.k.logit_bias" in recipe.tensors:
        raise RecipeError(f"{where}: {field}.jensen and tensor 'layers.{i}.k.logit_bias' both correct key noise; keep one")
    if spec.prq_deferred and recipe.scheme.policy.recent_frames:
        raise RecipeError(f"{where}: {field}.prq_deferred holds a span's frames in float16 until the span is complete; "
                          "it takes no recent window (scheme.policy.recent_frames must be 0)")
    if KINDS[spec.kind].own_width:
        p = recipe.scheme.policy
        for name, used in (("sink_bits", p.sink_frames > 0), ("recent_bits", p.recent_frames > 0),
                           ("keyframe_bits", p.keyframe_interval > 0)):
            if used and getattr(p, name) not in (16, spec.bits):
                raise RecipeError(f"{where}: scheme.policy.{name} is {getattr(p, name)}: kind {spec.kind!r} in "
                                  f"{field} has levels for {spec.bits} bits only (use 16 or {spec.bits})")


def _check_logit_bias(t: torch.Tensor, name: str, kind: str, H: int, D: int, where: str) -> None:
    """The key-noise logit correction: keys only, [H, D] per-channel variances (finite, >= 0)."""
    if kind != "k":
        raise RecipeError(f"{where}: tensor '{name}': role 'logit_bias' applies to keys only")
    if tuple(t.shape) != (H, D):
        raise RecipeError(f"{where}: tensor '{name}' has shape {list(t.shape)}, expected {[H, D]}")
    if not t.is_floating_point() or not torch.isfinite(t).all() or (t < 0).any():
        raise RecipeError(f"{where}: tensor '{name}' must be finite float values >= 0 (key-error variances)")

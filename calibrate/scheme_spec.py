"""The scheme a recipe carries: per layer and for K and V separately a `TensorSpec`, and a token
policy; parsed from the recipe's `scheme` JSON strictly (types and ranges by recipe_schema.py,
the rules that tie fields together here, each kind's own by its module in calibrate/codes/).

A `TensorSpec`:

    bits            2, 3, 4, 8 (codes) or 16 (kept as float16); `head_bits` overrides per head
    kind            "uniform" (affine) or "codebook" (non-uniform levels in role `codebook`)
    symmetric       uniform only: symmetric (signed) or asymmetric (min/max) affine
    axis            "token":   parameters per token and group of `group_size` channels,
                               computed when the frame is stored (dynamic)
                    "channel": parameters per channel; dynamic over the frame's tokens, or
                               static from roles `scale`/`zero_point` [H, D] when `static`
    clip            dynamic ranges are shrunk by this ratio (role `clip` [H] overrides)
    rotation        "none", "hadamard" or "learned": role `rotation` [H, D, D], x -> x @ R
    outliers        channels (role `outlier_channels` [H, n], int64) kept in float16
    sparse_fraction dense-and-sparse: this share of each head's entries kept in float16
    centroids       k-means centroid smoothing: role `centroids` [H, C, D]; the code stores the
                    nearest centroid per token and quantizes the residual
    comp_rank       low-rank residual compensator: roles `comp_down` [H, D, r], `comp_up` [H, r, D]

Format 1.1 adds (fields omitted from the JSON at their default, so recipes without a 1.1
feature read in a 1.0 loader; everything else a 1.0 loader rejects with a clear error, never
misreads):

    kind "predictive"   a code across frames (quant/predictive.py, chain.py): roles in
                        predictive_roles.py; `token_bits` / `anchor_token_bits` [H] say how many
                        bits one token of one head takes in a delta frame / an anchor frame;
                        `temporal` false codes every token intra (no chain, no anchors)
    rotary_coords   keys only: > 0 = keys are stored *before* the model's rotary encoding,
                    with this many rotary coordinates per frame (the runtime re-applies the
                    frame's rotation when it reads them); 0 = stored post-rotary
    kind "prq"      Quant VideoGen: `prq_stages` k-means stages of `prq_centroids` centroids,
                    fitted at run time on the first frame of each span of `prq_span_frames`
                    frames (`prq_kmeans_iters` iterations) and shared by the span; then a
                    symmetric b-bit residual with an FP8 scale per token and group (quant/qvg.py);
                    `prq_deferred` true: the span's frames are held in float16 until its last
                    frame arrives, then fitted on all of them and coded (the package's schedule)
    kind "turbo"    TurboQuant MSE: L2 norm per token, Lloyd-Max levels (role `lloyd_max`)
    kind "turbo_prod"  TurboQuant inner product: b-1 bit "turbo" codes + 1-bit QJL sketch of the
                    residual (role `qjl` [H, D, D]) (quant/turbo.py)
    rotation "random"  a Haar-random orthogonal rotation (role `rotation`)
    kind "nvfp4"    (format 1.2) NVIDIA's FP4: E2M1 values, an E4M3 scale per 16 channels, a
                    float32 scale per head and frame (codes/nvfp4.py)
    jensen          keys only: subtract the Jensen-bias correction computed from each stored
                    key's own step sizes (quant/jensen.py)

Keys only, optional: role `logit_bias` [H, D] (>= 0), the key-noise logit correction (per-channel
key-error variance in the code basis, times the fitted strength; quant/logit_noise.py).

and a token policy: `sink_frames` frames at `sink_bits`, the newest `recent_frames` frames at
`recent_bits`, every `keyframe_interval`-th frame at `keyframe_bits` (0 = none).

"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from calibrate.codes import KINDS
from calibrate.plan import MemoryPlan
from calibrate.recipe_schema import PLAN_FIELDS, POLICY_FIELDS, SPEC_FIELDS, FieldError, parse_object


class RecipeError(ValueError):
    """A recipe file that cannot be used; the message names the file and the field."""


@dataclass
class TensorSpec:
    bits: int = 16
    head_bits: list[int] | None = None
    kind: str = "uniform"
    symmetric: bool = False
    axis: str = "token"
    group_size: int = 0  # 0 = head_dim (one group per token)
    static: bool = False
    clip: float = 1.0
    rotation: str = "none"
    outliers: int = 0
    sparse_fraction: float = 0.0
    centroids: int = 0
    comp_rank: int = 0
    # format 1.1 (module docstring; recipes/FORMAT.md): written only when not at their default
    rotary_coords: int = 0  # keys: stored pre-rotary with this many coordinates per frame
    token_bits: list[int] | None = None  # predictive: code bits per token of each head
    anchor_token_bits: list[int] | None = None  # predictive: anchor bits per token of each head
    sink_token_bits: list[int] | None = None  # predictive (format 1.3): sink code bits per token of each head
    sink_hold: bool = False  # predictive (format 1.4), with a sink code: one hold bit per token (quant/predictive.py)
    sink_refresh: int = 0  # predictive (format 1.5), with a sink hold: refresh the hold's reference every this many frames
    refresh_token_bits: list[int] | None = None  # predictive (format 1.5): the reference's bits per token of each head
    temporal: bool = True  # predictive: tokens may be coded against the previous frame (false: every token intra)
    prq_stages: int = 0
    prq_centroids: int = 0
    prq_span_frames: int = 1
    prq_kmeans_iters: int = 2
    prq_deferred: bool = False  # prq: hold a span in float16 until complete, fit on all its frames
    jensen: bool = False

    def bits_of(self, head: int) -> int:
        return self.head_bits[head] if self.head_bits else self.bits


# the fields of one kind (any other kind must leave them at these defaults)
_PRQ_DEFAULTS = {"prq_stages": 0, "prq_centroids": 0, "prq_span_frames": 1, "prq_kmeans_iters": 2, "prq_deferred": False}
_PREDICTIVE_DEFAULTS = {"token_bits": None, "anchor_token_bits": None, "sink_token_bits": None, "sink_hold": False,
                        "sink_refresh": 0, "refresh_token_bits": None, "temporal": True}
# every TensorSpec field of format 1.1 on, written only when it differs from its default
V1_1_DEFAULTS = {"rotary_coords": 0, "jensen": False, **_PRQ_DEFAULTS, **_PREDICTIVE_DEFAULTS}


@dataclass
class TokenPolicy:
    sink_frames: int = 1
    sink_bits: int = 16
    recent_frames: int = 0
    recent_bits: int = 16
    keyframe_interval: int = 0
    keyframe_bits: int = 8
    plan: MemoryPlan | None = None  # format 1.1: device/host tiers and recall (plan.py); written only when set


@dataclass
class LayerSpec:
    k: TensorSpec = field(default_factory=TensorSpec)
    v: TensorSpec = field(default_factory=TensorSpec)


@dataclass
class Scheme:
    name: str
    layers: list[LayerSpec]
    policy: TokenPolicy = field(default_factory=TokenPolicy)
    notes: str = ""

    def to_json(self) -> str:
        d = asdict(self)
        if d["policy"]["plan"] is None:  # format 1.1, left out when absent
            del d["policy"]["plan"]
        for layer in d["layers"]:
            for spec in layer.values():  # fields of format 1.1 at their default are left out
                for name, default in V1_1_DEFAULTS.items():
                    if spec[name] == default:
                        del spec[name]
        return json.dumps(d, sort_keys=True)

    @staticmethod
    def from_dict(d: dict, where: str = "scheme") -> "Scheme":
        """The scheme of a decoded `scheme` JSON object, every field held to its JSON type (FORMAT.md)."""
        if not isinstance(d, dict):
            raise RecipeError(f"{where}: must be a JSON object")
        for name in ("name", "layers"):
            if name not in d:
                raise RecipeError(f"{where}: missing field '{name}'")
        for name in ("name", "notes"):
            if name in d and type(d[name]) is not str:
                raise RecipeError(f"{where}.{name}: must be a JSON string, got {d[name]!r}")
        if not isinstance(d["layers"], list):
            raise RecipeError(f"{where}.layers: must be a JSON list of {{\"k\": ..., \"v\": ...}} objects")
        layers = []
        for i, entry in enumerate(d["layers"]):
            if not isinstance(entry, dict) or "k" not in entry or "v" not in entry:
                raise RecipeError(f"{where}.layers[{i}]: must be a JSON object with fields 'k' and 'v'")
            layers.append(LayerSpec(k=parse_spec(entry["k"], f"{where}.layers[{i}].k"), v=parse_spec(entry["v"], f"{where}.layers[{i}].v")))
        policy_d = d.get("policy", {})
        has_plan = isinstance(policy_d, dict) and "plan" in policy_d  # format 1.1: an object, or left out (never null)
        policy = TokenPolicy(**parse_fields({k: v for k, v in policy_d.items() if k != "plan"} if has_plan else policy_d,
                                      POLICY_FIELDS, f"{where}.policy"))
        if has_plan:
            policy.plan = MemoryPlan(**parse_fields(policy_d["plan"], PLAN_FIELDS, f"{where}.policy.plan",
                                              ("device_budget_bytes",)))
        return Scheme(name=d["name"], layers=layers, policy=policy, notes=d.get("notes", ""))


def parse_fields(d, table, where: str, required: tuple[str, ...] = ()) -> dict:
    """`recipe_schema.parse_object`, its errors as RecipeError."""
    try:
        return parse_object(d, table, where, required)
    except FieldError as e:
        raise RecipeError(str(e)) from None


def parse_spec(d: dict, where: str) -> TensorSpec:
    """A TensorSpec from its JSON object: types and ranges (recipe_schema), then the rules that
    tie fields together."""
    s = TensorSpec(**parse_fields(d, SPEC_FIELDS, where))
    kind = KINDS[s.kind]
    for fields, owner in ((_PRQ_DEFAULTS, "prq"), (_PREDICTIVE_DEFAULTS, "predictive")):
        for name, default in fields.items():
            if s.kind != owner and getattr(s, name) != default:
                raise RecipeError(f"{where}.{name}: applies to kind {owner!r} only (kind is {s.kind!r})")
    if kind.per_token and (s.axis != "token" or s.static):
        raise RecipeError(f"{where}: kind {s.kind!r} codes per token (axis 'token', not static)")
    problem = kind.check(s, where)
    if problem:
        raise RecipeError(problem)
    if s.jensen and not kind.uniform_step:
        raise RecipeError(f"{where}.jensen: needs a uniform grid step (kind "
                          f"{' or '.join(repr(n) for n, k in KINDS.items() if k.uniform_step)}), not {s.kind!r}")
    return s


def uniform_scheme(name: str, num_layers: int, k: TensorSpec, v: TensorSpec, policy: TokenPolicy, notes: str = "") -> Scheme:
    """The same K and V spec in every layer."""
    return Scheme(name=name, layers=[LayerSpec(k=k, v=v) for _ in range(num_layers)], policy=policy, notes=notes)

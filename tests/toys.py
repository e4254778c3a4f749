"""Toy-sized helpers the tests share: a tiny TinyWorld, toy recipes, K/V-like frames.

Toy cache sizes: H = 2 kv heads, D = 16 channels, T = 4 tokens per frame, B = 2 trajectories,
two layers. The fixtures built on these are in conftest.py.
"""

from dataclasses import replace

import torch

from calibrate.cache import Rope
from calibrate.config import Config, FitConfig, TrajectoriesConfig
from calibrate.fit.predictive import fit_head
from calibrate.predictive_roles import reference_token_bits, stack_heads
from calibrate.quant.rotation import random_hadamard
from calibrate.recipe import ModelInfo, Recipe, TensorSpec, TokenPolicy, expected_shapes, uniform_scheme, validate
from calibrate.world.model import TinyWorld, TinyWorldConfig

# a TinyWorld small enough for CPU tests: 2 layers x 2 heads x head_dim 64
TINY_WORLD = TinyWorldConfig(dim=128, num_layers=2, num_heads=2, rope_xy_pairs=4, rope_bearing_pairs=8)


def tiny_fit_config(**fit) -> Config:
    """A fit small enough for the tiny TinyWorld on a CPU (`fit` overrides FitConfig fields)."""
    cfg = Config()
    cfg.trajectories = TrajectoriesConfig(families=["orbit", "revisit"], num_trajectories=2, num_frames=20)
    cfg.fit = replace(FitConfig(), closed_loop_frames=12, closed_loop_trajectories=1, trace_frames=12,
                      sample_tokens=256, clip_grid=[1.0, 0.8, 0.6], **fit)
    return cfg


def make_tiny_world(seed: int = 0) -> TinyWorld:
    """An untrained tiny TinyWorld in eval mode, the same for the same seed."""
    torch.manual_seed(seed)
    model = TinyWorld(TINY_WORLD).eval()
    torch.nn.init.normal_(model.patch_out.weight, std=0.02)  # a zero-initialised readout would make every frame equal
    return model

H, D, T, B = 2, 16, 4, 2
INFO = ModelInfo(name="toy", num_layers=2, num_kv_heads=H, head_dim=D, tokens_per_frame=T, fingerprint="toy")


def static_tensors(spec: TensorSpec, seed: int) -> dict[str, torch.Tensor]:
    """Plausible parameters for every role `spec` requires (values matter little: the tests
    compare two paths of the same arithmetic), plus a per-head `clip` for variety."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for role, shape in expected_shapes(spec, H, D).items():
        if role == "rotation":
            out[role] = torch.stack([random_hadamard(D, seed=seed + h) for h in range(H)])
        elif role == "scale":
            top = 3.0 + torch.rand(shape, generator=g)
            out[role] = top if spec.kind == "codebook" else 2 * top / (2**spec.bits - 1)
        elif role == "zero_point":
            out[role] = 0.1 * torch.randn(shape, generator=g) - (0 if spec.kind == "codebook" or spec.symmetric else 3.0)
        elif role == "codebook":
            out[role] = (torch.rand(shape, generator=g) * 2 - 1).sort(dim=-1).values
        elif role == "outlier_channels":
            out[role] = torch.stack([torch.randperm(D, generator=g)[: shape[1]] for _ in range(H)])
        elif role == "centroids":
            out[role] = torch.randn(shape, generator=g)
        else:  # comp_down, comp_up
            out[role] = 0.1 * torch.randn(shape, generator=g)
    return out


def toy_recipe(k: TensorSpec, v: TensorSpec | None = None, policy: TokenPolicy | None = None, clip=None) -> Recipe:
    v = k if v is None else v
    tensors = {}
    for i in range(INFO.num_layers):
        for j, (kind, spec) in enumerate((("k", k), ("v", v))):
            for role, t in static_tensors(spec, seed=100 * i + 10 * j).items():
                tensors[f"layers.{i}.{kind}.{role}"] = t
            if clip is not None:
                tensors[f"layers.{i}.{kind}.clip"] = torch.tensor(clip)
    policy = TokenPolicy(sink_frames=0, recent_frames=0) if policy is None else policy
    recipe = Recipe(INFO, uniform_scheme("toy", INFO.num_layers, k, v, policy), tensors)
    validate(recipe, "toy")
    return recipe


def frame(seed: int, shape=(B, T, D)) -> torch.Tensor:
    """K/V-like values: per-channel offsets and scales, one large channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * (0.5 + torch.rand(shape[-1], generator=g)) + torch.randn(shape[-1], generator=g)
    x[..., 3] *= 6.0
    return x


def kv_frames(n: int, seed: int = 0):
    """n frames of (q, k, v) [B, H, T, D] and a rotary encoding per frame."""
    out = []
    for f in range(n):
        q, k, v = (frame(seed + 3 * f + i, (B, H, T, D)) for i in range(3))
        angles = torch.randn(B, T, D // 2, generator=torch.Generator().manual_seed(seed + 1000 + f))
        out.append((q, k, v, Rope(angles)))
    return out


def frame_bits(stored_head: dict) -> int:
    """Bit width of one stored head record, read off the record itself."""
    if "fp16" in stored_head:
        return 16
    return stored_head["codes"].shape[-1] * 8 // D  # packed_nbytes(D, b) = D/8 * b


def predictive_roles(x_BHFTD: torch.Tensor, bits: float = 2.0, sink_bits: float = 0.0) -> dict[str, torch.Tensor]:
    """The predictive roles of one tensor fitted per head to frames x [B, H, F, T, D]: the sample's
    mean and covariance, and the covariance of its frame-to-frame differences (`sink_bits` > 0:
    with a sink code of that many bits per component)."""
    D = x_BHFTD.shape[-1]
    params = []
    for h in range(x_BHFTD.shape[1]):
        flat = x_BHFTD[:, h].reshape(-1, D)
        mean = flat.mean(0)
        cov = (flat - mean).T @ (flat - mean) / len(flat)
        d = (x_BHFTD[:, h, 1:] - x_BHFTD[:, h, :-1]).reshape(-1, D)
        params.append(fit_head(mean, cov, d.T @ d / len(d), bits, sink_bits=sink_bits))
    return stack_heads(params)


def refresh_fields(roles, refresh: int) -> dict:
    """A spec's sink refresh fields (format 1.5) for a period `refresh` (0: none)."""
    if not refresh:
        return {}
    return {"sink_refresh": refresh, "refresh_token_bits": reference_token_bits(roles)}

"""WanWorld weights files, and loading one as a `wan_diffusers` adapter.

One safetensors file (fp32; no pickle): the transformer's tensors under `transformer.` (the
names diffusers' `WanTransformer3DModel` uses, so `transformer.save_pretrained` of the loaded
model writes an ordinary diffusers model directory), the camera module's under `camera.`, and
metadata: `format` = `wanworld-weights`, `format_version`, `config` (JSON: the
`WanTransformer3DModel` arguments and the camera module's shape), `sampler` (JSON: the
timesteps and shift it was trained at, latent frames per chunk) and whatever training adds.

`load_adapter` builds the model from the file and hands it to the `wan_diffusers` adapter,
the code path a real checkpoint takes, with `WanWorldInputs` in place of a text embedding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from calibrate.adapters.wan_diffusers import AdapterError, WanAdapter, WanSettings
from calibrate.io import check_format, read_safetensors, safetensors_bytes, write_bytes_atomic
from calibrate.wanworld.model import LATENT_SIZE, WanWorld, WanWorldConfig, WanWorldInputs

WEIGHTS_FORMAT = "wanworld-weights"
WEIGHTS_VERSION = "1.0"
SHIPPED = Path(__file__).resolve().parents[2] / "artifacts" / "models" / "wanworld.safetensors"


def default_weights_path() -> Path:
    """The shipped weights: next to the source tree, or installed inside the package."""
    packaged = Path(__file__).resolve().parents[1] / "models" / "wanworld.safetensors"
    return SHIPPED if SHIPPED.exists() or not packaged.exists() else packaged


def save_weights(model: WanWorld, path: str | os.PathLike, sampler: dict, extra_meta: dict | None = None) -> None:
    meta = {"format": WEIGHTS_FORMAT, "format_version": WEIGHTS_VERSION,
            "config": json.dumps(model.cfg.to_dict(), sort_keys=True), "sampler": json.dumps(sampler, sort_keys=True)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v, sort_keys=True) for k, v in (extra_meta or {}).items()})
    tensors = {k: v.detach().contiguous().cpu() for k, v in sorted(model.state_dict().items())}
    write_bytes_atomic(path, safetensors_bytes(tensors, meta))


def load_weights(path: str | os.PathLike | None = None) -> tuple[WanWorld, dict[str, str]]:
    """(model in eval mode, metadata) from a weights file; a one-line ValueError naming the file otherwise."""
    p = Path(path) if path else default_weights_path()
    if not p.is_file():
        raise ValueError(f"{p}: WanWorld weights file not found (train with: python -m calibrate task=train_world "
                         f"model=wanworld)")
    meta, tensors = read_safetensors(p, "WanWorld weights")
    check_format(p, meta, WEIGHTS_FORMAT, WEIGHTS_VERSION)
    try:
        cfg = WanWorldConfig.from_dict(json.loads(meta["config"]))
        json.loads(meta["sampler"])
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: metadata 'config' or 'sampler' is missing or invalid ({e})") from None
    model = WanWorld(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{p}: tensor '{missing[0]}' is missing ({len(missing)} missing in all)")
    for name, t in tensors.items():
        if name not in expected:
            raise ValueError(f"{p}: tensor '{name}' is not part of the model")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{p}: tensor '{name}' has shape {list(t.shape)}, the model needs {list(expected[name].shape)}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{p}: tensor '{name}' has NaN or Inf values")
    model.load_state_dict(tensors)
    return model.eval(), meta


def check_settings(settings: WanSettings, model: WanWorld, where: str = "model.wan") -> None:
    """The rollout settings a WanWorld can run: its latent size and chunk length (one-line AdapterError)."""
    if (settings.latent_height, settings.latent_width) != (LATENT_SIZE, LATENT_SIZE):
        raise AdapterError(f"config: {where}.latent_height/latent_width must be {LATENT_SIZE} for WanWorld (32x32 frames, "
                           f"space-to-depth 2), got {settings.latent_height}x{settings.latent_width}")
    if settings.chunk_frames != model.chunk_frames:
        raise AdapterError(f"config: {where}.chunk_frames must be {model.chunk_frames} for these WanWorld weights, "
                           f"got {settings.chunk_frames}")
    if settings.dtype != "float32":
        raise AdapterError(f"config: {where}.dtype must be float32 for WanWorld, got '{settings.dtype}'")
    if settings.text_embedding is not None:
        raise AdapterError(f"config: {where}.text_embedding is not used by WanWorld (its camera fills the "
                           f"cross-attention tokens); leave it null")
    if settings.config is not None or settings.checkpoint_key is not None:
        raise AdapterError(f"config: {where}.config and {where}.checkpoint_key describe a Wan checkpoint file; WanWorld's "
                           f"weights file carries its own config (leave them null)")


def load_adapter(weights: str | None, settings: WanSettings, device: torch.device) -> WanAdapter:
    """WanWorld behind the `wan_diffusers` adapter (`model=wanworld`); None = the shipped weights."""
    try:
        model, _ = load_weights(weights)
    except ValueError as e:
        raise AdapterError(f"model.weights: {e}") from None
    check_settings(settings, model)
    model = model.to(device)
    return WanAdapter(model.transformer, settings, None, name="wanworld", world=WanWorldInputs(model))

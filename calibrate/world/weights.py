"""TinyWorld weights files: fp32 tensors + the architecture as JSON metadata (no pickle)."""

from __future__ import annotations

import json
import os
from dataclasses import fields
from pathlib import Path

import torch

from calibrate.io import check_format, read_safetensors, safetensors_bytes, write_bytes_atomic
from calibrate.world.model import TinyWorld, TinyWorldConfig

WEIGHTS_FORMAT = "tinyworld-weights"
WEIGHTS_VERSION = "1.0"
SHIPPED = Path(__file__).resolve().parents[2] / "artifacts" / "models" / "tinyworld.safetensors"


def default_weights_path() -> Path:
    """The shipped weights: next to the source tree, or installed inside the package."""
    packaged = Path(__file__).resolve().parents[1] / "models" / "tinyworld.safetensors"
    return SHIPPED if SHIPPED.exists() or not packaged.exists() else packaged


def save_weights(model: TinyWorld, path: str | os.PathLike, extra_meta: dict | None = None) -> None:
    meta = {"format": WEIGHTS_FORMAT, "format_version": WEIGHTS_VERSION, "config": json.dumps(model.cfg.to_dict(), sort_keys=True)}
    meta.update({k: v if isinstance(v, str) else json.dumps(v) for k, v in (extra_meta or {}).items()})
    tensors = {k: v.detach().contiguous().cpu() for k, v in sorted(model.state_dict().items())}
    write_bytes_atomic(path, safetensors_bytes(tensors, meta))


def read_weights_file(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a weights file; a one-line ValueError naming the file otherwise."""
    if not path.is_file():
        raise ValueError(f"{path}: TinyWorld weights file not found (train with: python -m calibrate task=train_world)")
    return read_safetensors(path, "TinyWorld weights")


def check_tensors(path: Path, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every tensor of the file is one of the model's, with its shape, and finite (one-line ValueError)."""
    for name, t in tensors.items():
        if name not in expected:
            raise ValueError(f"{path}: tensor '{name}' is not part of the model")
        if tuple(t.shape) != tuple(expected[name].shape):
            raise ValueError(f"{path}: tensor '{name}' has shape {list(t.shape)}, the model needs {list(expected[name].shape)}")
        if not torch.isfinite(t).all():
            raise ValueError(f"{path}: tensor '{name}' has NaN or Inf values")


def load_weights(path: str | os.PathLike | None = None) -> TinyWorld:
    """Build TinyWorld from a weights file; every problem is a one-line ValueError naming the file."""
    p = Path(path) if path else default_weights_path()
    meta, tensors = read_weights_file(p)
    check_format(p, meta, WEIGHTS_FORMAT, WEIGHTS_VERSION)
    try:
        raw = json.loads(meta["config"])
        known = {f.name for f in fields(TinyWorldConfig)}
        cfg = TinyWorldConfig(**{k: v for k, v in raw.items() if k in known})
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p}: metadata 'config' is missing or invalid ({e})") from None
    model = TinyWorld(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"{p}: tensor '{missing[0]}' is missing ({len(missing)} missing in all)")
    check_tensors(p, tensors, expected)
    model.load_state_dict(tensors)
    return model.eval()

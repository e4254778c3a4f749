"""World models behind the cache seam (see base.py for the adapter API)."""

from __future__ import annotations

import torch

from calibrate.adapters.base import AdapterError, WorldAdapter
from calibrate.adapters.tinyworld import TinyWorldAdapter
from calibrate.config import ModelConfig
from calibrate.world.model import TinyWorld


def load_world(cfg: ModelConfig, device: torch.device) -> WorldAdapter:
    """The adapter `model.name` names, with its weights loaded on `device`."""
    if cfg.name == "tinyworld":
        from calibrate.world.weights import load_weights

        return TinyWorldAdapter(load_weights(cfg.weights).to(device))
    if cfg.name == "wan_diffusers":
        from calibrate.adapters import wan_diffusers

        return wan_diffusers.load(cfg.weights, cfg.wan, device)
    raise AdapterError(f"config: unknown model '{cfg.name}' (available: tinyworld, wan_diffusers)")


def as_world(model: TinyWorld | WorldAdapter) -> WorldAdapter:
    """An adapter for `model`: a bare TinyWorld is wrapped, an adapter returned as is."""
    return TinyWorldAdapter(model) if isinstance(model, TinyWorld) else model


__all__ = ["AdapterError", "TinyWorldAdapter", "WorldAdapter", "as_world", "load_world"]

"""World models behind the cache seam (see base.py for the adapter API).

The pipeline picks one by `model.name` (`pipeline.stages.load_world`); `as_world` lets the
built-in TinyWorld be passed bare wherever an adapter is expected.
"""

from __future__ import annotations

from calibrate.adapters.base import AdapterError, WorldAdapter
from calibrate.adapters.tinyworld import TinyWorldAdapter
from calibrate.world.model import TinyWorld


def as_world(model: TinyWorld | WorldAdapter) -> WorldAdapter:
    """An adapter for `model`: a bare TinyWorld is wrapped, an adapter returned as is."""
    return TinyWorldAdapter(model) if isinstance(model, TinyWorld) else model


__all__ = ["AdapterError", "TinyWorldAdapter", "WorldAdapter", "as_world"]

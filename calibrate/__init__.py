"""calibrate: a calibration and quantization-parameter compiler for 2-bit KV caches of
autoregressive video world models.

Public API for runtimes and notebooks:

- `load_recipe(path, model=None)`: read and validate a recipe file (recipes/FORMAT.md);
- `QuantizedKVCache.from_recipe(recipe, window=16, sink_frames=1)`: the runtime: packed codes in
  preallocated buffers, decoded blockwise, memory plans included (`fastcache.FastKVCache`, the same
  class under the name DESIGN.md gives it);
- `load_model(name)`: the built-in TinyWorld model with its shipped weights.
"""

from calibrate.recipe import load_recipe
from calibrate.fastcache import FastKVCache

QuantizedKVCache = FastKVCache


def load_model(name: str = "tinyworld", weights: str | None = None):
    """A built-in world model in eval mode (`tinyworld`: the shipped weights, no network)."""
    if name != "tinyworld":
        raise ValueError(f"unknown model '{name}' (available: tinyworld)")
    from calibrate.world.weights import load_weights

    return load_weights(weights)


__all__ = ["load_recipe", "load_model", "QuantizedKVCache", "FastKVCache"]

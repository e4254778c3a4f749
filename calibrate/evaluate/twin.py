"""A scheme's noise twin: the full-precision cache with uncorrelated error of the scheme's size.

A quantized cache's error hurts a rollout in two ways: by its size and by its structure. Error
that repeats itself (a still camera stores nearly the same frame again and again and rounding
makes nearly the same error each time) or that follows the content adds up in a way that
independent noise of the same power does not. The noise twin separates the two: it rolls out
with a `NoiseTwinCache`, the fp cache whose every stored key (post-rotary) and value gets
independent Gaussian noise, drawn once when the frame is stored, with the scheme's own stored
error power per trajectory, layer, K/V and head (`ShadowCache`'s `StoredError`, measured
teacher-forced on the fp rollout of the same trajectory), in each of the evaluation's windows of
frames: a frame stored in frames 0-16 gets the power the scheme's history had while frames 0-16
were generated. (A predictive chain starts from the sink frame's states and settles over its
first frames, with up to ~10 dB more error there than later; one power for the whole rollout made
that difference of size look like structure: `artifacts/benchmarks/twin_windows.md`.) The
scheme's PSNR minus its twin's, per window and family, is what the error's structure costs:
near 0 the error acts like noise of its size; well below 0 it is coherent.

The draws are seeded, so a twin rolls out identically on rerun. Sinks and recent frames a
scheme holds in full precision are part of its measured error power (they lower it), while the
twin spreads that power evenly over the tokens stored in the window.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.cache import KVCache
from calibrate.evaluate.metrics import window_index

TWIN_SEED = 20261202


class NoiseTwinCache(KVCache):
    """The fp cache plus N(0, std^2) on every stored element: `std` per window of frames (the
    evaluation's windows), trajectory, layer, K/V and head [W, B, L, 2, H] (`StoredError.noise_std`;
    frames past the last window take its std), or one std for every frame [B, L, 2, H]."""

    def __init__(self, num_layers: int, window: int, sink_frames: int, std: Tensor, seed: int = TWIN_SEED):
        super().__init__(num_layers, window, sink_frames)
        if std.dim() == 4:
            std = std.unsqueeze(0)
        if std.dim() != 5 or std.shape[2:4] != (num_layers, 2):
            raise ValueError(f"noise twin: std must be [W, B, {num_layers}, 2, H] or [B, {num_layers}, 2, H], "
                             f"got {list(std.shape)}")
        self.std_WBL2H = std.float()
        self.generator = torch.Generator().manual_seed(seed)

    def _noisy(self, x_BHTD: Tensor, std_BH: Tensor) -> Tensor:
        noise = torch.randn(x_BHTD.shape, generator=self.generator, dtype=torch.float32)
        return x_BHTD + (noise * std_BH[:, :, None, None]).to(device=x_BHTD.device, dtype=x_BHTD.dtype)

    def _store(self, layer: int, index: int, k_BHTD: Tensor, v_BHTD: Tensor) -> object:
        std = self.std_WBL2H[min(window_index(index), self.std_WBL2H.shape[0] - 1), :, layer]
        return self._noisy(k_BHTD, std[:, 0]), self._noisy(v_BHTD, std[:, 1])

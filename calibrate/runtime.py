"""The reference runtime: a packed, quantized KV cache built from a recipe alone.

`QuantizedKVCache.from_recipe(recipe)` implements the `KVCache` seam. Each frame's K/V enter
at the precision of their token class and stay there until evicted:

- the newest `recent_frames` frames are held at `recent_bits` (float16 by default); a frame
  leaving that window is re-encoded from its float16 copy at its final precision, and the
  copy is dropped (no full-precision shadow of quantized history is kept);
- the first `sink_frames` frames (attention sinks / anchors) at `sink_bits`;
- every `keyframe_interval`-th frame at `keyframe_bits`;
- all other frames as the layer's `TensorSpec` says (per head).

The frame being generated attends to its own K/V in full precision (they were just computed);
only what is *stored* for later frames is quantized, as in a real streaming runtime.

Key frames, not a periodic rebuild. The alternative to designated key frames would be to
rebuild the window's K/V at high precision every N frames from the generated frames: that is
a re-forward of the whole window (window/N extra frame forwards per generated frame: at N = 16
and a 16-frame window, twice the compute), the runtime would have to keep the generated frames
and call the model (it only sees K/V through the cache seam), and the rebuilt K/V are still
quantized once they are stored again unless the whole window is kept at high precision. The
newest frames are already available at high precision for free through the float16 recent
window (`recent_frames`). Key frames cost no compute, only the bytes of the frames they
upgrade, which the byte prediction counts and the fitter prices against every other upgrade
(fit/search.py).

Key-noise logit correction (role `logit_bias` of K, quant/logit_noise.py): when the queries
of a frame attend to the history, the logits of keys held at the spec's own bits (per head)
get minus their expected noise inflation added; the fresh own frame and frames held at other
widths (float16 recent frames, sink and key frames) are left as they are.

Span state (kind "prq", codec.span_of): the first frame of a span encoded below 16 bits fits
the span's centroids, which the span's later frames are coded against; the cache holds them
(per layer, K/V and head) while a kept frame of the span is held below 16 bits.

Jensen-bias correction (`jensen` on a layer's K spec, quant/jensen.py): the logits of every
history key are lowered by sum_d (q R)_d^2 Delta_d^2 / (24 D), Delta the key's own grid steps
read from its stored frame (0 for float16 frames and the fresh frame).

`nbytes()` sums the bytes of every tensor the cache holds; `predicted_nbytes()` asks the memory
model (memory.py) for the same from the recipe alone, and the two agree at steady state. This
module imports only the seam, the recipe format, the codec and the memory model: a runtime can
ship without the compiler.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.cache import KVCache, Rope
from calibrate.codec import (HeadParams, decode, encode, fit_span_state, head_params, key_steps, span_of,
                             stored_nbytes, with_span_state)
from calibrate.memory import KINDS, final_bits, predicted_cache_bytes
from calibrate.quant.jensen import jensen_bias
from calibrate.quant.logit_noise import logit_inflation
from calibrate.recipe import Recipe, TensorSpec


class QuantizedKVCache(KVCache):
    def __init__(self, recipe: Recipe, window: int = 16, sink_frames: int = 1, device: str | torch.device = "cpu"):
        super().__init__(recipe.model.num_layers, window, sink_frames)
        if recipe.scheme.policy.keyframe_interval < 0:
            raise ValueError(f"policy.keyframe_interval must be >= 1 (or 0 = no key frames), "
                             f"got {recipe.scheme.policy.keyframe_interval}")
        self.recipe = recipe
        self.policy = recipe.scheme.policy
        self.head_dim = recipe.model.head_dim
        self.num_heads = recipe.model.num_kv_heads
        self.device = torch.device(device)
        tensors = {k: v.to(self.device) for k, v in recipe.tensors.items()}
        self._recipe_on_device = Recipe(recipe.model, recipe.scheme, tensors, recipe.metadata, recipe.path)
        self._params: dict[tuple[int, str, int, int], HeadParams] = {}
        # per layer: (kind, head, span) -> the span's state (codec.fit_span_state)
        self._span_states: list[dict[tuple[str, int, int], Tensor]] = [{} for _ in range(recipe.model.num_layers)]

    @classmethod
    def from_recipe(cls, recipe: Recipe, window: int = 16, sink_frames: int = 1, device="cpu") -> "QuantizedKVCache":
        return cls(recipe, window=window, sink_frames=sink_frames, device=device)

    # ---- precision of each frame -------------------------------------------------------------
    def final_bits(self, layer: int, kind: str, head: int, index: int) -> int:
        return final_bits(self.policy, self.spec(layer, kind), head, index)

    def spec(self, layer: int, kind: str) -> TensorSpec:
        return self.recipe.spec(layer, kind)

    def params(self, layer: int, kind: str, head: int, bits: int) -> HeadParams:
        key = (layer, kind, head, bits)
        if key not in self._params:
            tensors = self._recipe_on_device.layer_tensors(layer, kind)
            self._params[key] = head_params(self.spec(layer, kind), tensors, head, bits)
        return self._params[key]

    def frame_params(self, layer: int, kind: str, head: int, bits: int, index: int, x_BTD: Tensor | None = None) -> HeadParams:
        """`params`, plus the state of frame `index`'s span for kinds that keep one (fitted on
        `x_BTD` when the span has none yet: the first frame of the span stored below 16 bits)."""
        p = self.params(layer, kind, head, bits)
        span = span_of(self.spec(layer, kind), index)
        if span is None or bits >= 16:
            return p
        key = (kind, head, span)
        if key not in self._span_states[layer]:
            if x_BTD is None:
                raise RuntimeError(f"layer {layer} {kind} head {head}: frame {index} is held without its span's state")
            self._span_states[layer][key] = fit_span_state(x_BTD, self.spec(layer, kind), p)
        return with_span_state(p, self._span_states[layer][key])

    def _release_spans(self, layer: int) -> None:
        """Drop the span states that no kept frame held below 16 bits uses any more."""
        live = {(kind, h, span_of(self.spec(layer, kind), f)) for f in self._frames[layer] for kind in KINDS
                for h in range(self.num_heads) if self.stored_bits(layer, kind, h, f) < 16}
        for key in [k for k in self._span_states[layer] if k not in live]:
            del self._span_states[layer][key]

    # ---- storage -----------------------------------------------------------------------------
    def _encode(self, layer: int, x_BHTD: Tensor, kind: str, bits_of_head, index: int = 0) -> list[dict[str, Tensor]]:
        spec = self.spec(layer, kind)
        return [encode(x_BHTD[:, h], spec, self.frame_params(layer, kind, h, bits_of_head(h), index, x_BHTD[:, h]))
                for h in range(self.num_heads)]

    def _decode(self, layer: int, kind: str, heads: list[dict[str, Tensor]], bits_of_head, index: int = 0) -> Tensor:
        spec = self.spec(layer, kind)
        return torch.stack(
            [decode(s, spec, self.frame_params(layer, kind, h, bits_of_head(h), index), self.head_dim)
             for h, s in enumerate(heads)],
            dim=1,
        )

    def _store(self, layer: int, index: int, k_BHTD: Tensor, v_BHTD: Tensor) -> object:
        if self.policy.recent_frames > 0:
            return {"bits": "recent", **{kind: self._encode(layer, x, kind, lambda h: self.policy.recent_bits, index)
                                         for kind, x in zip(KINDS, (k_BHTD, v_BHTD))}}
        return self._store_final(layer, index, k_BHTD, v_BHTD)

    def _store_final(self, layer: int, index: int, k_BHTD: Tensor, v_BHTD: Tensor) -> object:
        return {"bits": "final", **{kind: self._encode(layer, x, kind, lambda h, kind=kind: self.final_bits(layer, kind, h, index),
                                                       index)
                                    for kind, x in zip(KINDS, (k_BHTD, v_BHTD))}}

    def stored_bits(self, layer: int, kind: str, head: int, index: int) -> int:
        """Bits frame `index` of one head is held at now (recent window or its final class)."""
        if self._frames[layer][index]["bits"] == "recent":
            return self.policy.recent_bits
        return self.final_bits(layer, kind, head, index)

    def _load(self, layer: int, index: int, stored: dict) -> tuple[Tensor, Tensor]:
        k, v = (self._decode(layer, kind, stored[kind], lambda h, kind=kind: self.stored_bits(layer, kind, h, index), index)
                for kind in KINDS)
        return k, v

    def append(self, layer: int, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> int:
        index = super().append(layer, k_BHTD, v_BHTD, key_rope)
        # the frame that just left the recent window is re-encoded at its final precision
        leaving = index - self.policy.recent_frames
        if self.policy.recent_frames > 0 and leaving in self._frames[layer]:
            k, v = self._load(layer, leaving, self._frames[layer][leaving])
            self._frames[layer][leaving] = self._store_final(layer, leaving, k, v)
        self._release_spans(layer)
        return index

    def logit_bias(self, layer: int, q_BHTD: Tensor, frames: list[int] | None = None) -> Tensor | None:
        """Additive logits [B, H, T, N] for the keys of `frames` (default: `history`) followed by
        the T fresh keys of the newest frame: minus the expected key-noise inflation
        (quant/logit_noise.py) on the tokens of frames held at the spec's own bits for the head,
        0 elsewhere. None when the recipe has no correction for this layer."""
        if self.spec(layer, "k").jensen:
            return self._jensen_bias(layer, q_BHTD, frames)
        var_HD = self._recipe_on_device.tensor(layer, "k", "logit_bias")
        if var_HD is None:
            return None
        frames = self.history(layer) if frames is None else frames
        spec = self.spec(layer, "k")
        B, H, T, _ = q_BHTD.shape
        # heads x frames: which history frames are held at the head's own (quantized) bits
        corrected_HF = torch.tensor(
            [[self.stored_bits(layer, "k", h, f) == spec.bits_of(h) < 16 for f in frames] for h in range(H)],
            dtype=q_BHTD.dtype, device=q_BHTD.device).reshape(H, len(frames))
        mask_HN = torch.cat([corrected_HF.repeat_interleave(T, dim=1), corrected_HF.new_zeros(H, T)], dim=1)
        c_BHT = logit_inflation(q_BHTD, var_HD, self._recipe_on_device.tensor(layer, "k", "rotation"))
        return -c_BHT.unsqueeze(-1) * mask_HN[None, :, None, :]

    def _jensen_bias(self, layer: int, q_BHTD: Tensor, frames: list[int] | None) -> Tensor:
        """Minus the Jensen-bias correction [B, H, T, N] (quant/jensen.py) for the keys of `frames`
        (default: `history`), each from its own stored steps, then the T exact fresh keys (0)."""
        frames = self.history(layer) if frames is None else frames
        spec = self.spec(layer, "k")
        B, H, T, D = q_BHTD.shape
        steps = []
        for f in frames:
            heads = self._frames[layer][f]["k"]
            steps.append(torch.stack([key_steps(heads[h], spec, self.frame_params(layer, "k", h, self.stored_bits(layer, "k", h, f), f),
                                                self.recipe.model.tokens_per_frame, D) for h in range(H)], dim=1))
        steps.append(q_BHTD.new_zeros(B, H, T, D))
        c_BHTN = jensen_bias(q_BHTD, torch.cat(steps, dim=2), self._recipe_on_device.tensor(layer, "k", "rotation"))
        return -c_BHTN.to(q_BHTD.dtype)

    # ---- bytes -------------------------------------------------------------------------------
    def nbytes(self) -> int:
        total = 0
        for frames in self._frames:
            for stored in frames.values():
                for kind in KINDS:
                    total += sum(stored_nbytes(s) for s in stored[kind])
        total += sum(stored_nbytes(states) for states in self._span_states)
        return total

    def predicted_nbytes(self, num_appended: int, batch: int = 1) -> int:
        """Bytes this cache holds after `num_appended` frames, from the recipe alone (memory.py)."""
        return predicted_cache_bytes(self.recipe.model, self.recipe.scheme, num_appended, self.window,
                                     self.sink_frames, batch)

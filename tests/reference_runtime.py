"""The tests' oracle: the reference runtime, a packed quantized KV cache built frame by frame.

`ReferenceCache.from_recipe(recipe)` implements the `KVCache` seam with per-frame dicts and
per-head loops over `codec.py`'s encode/decode and one head's chain code (`ChainCodec` below),
the plainest statement of the stored forms; the tests hold the runtime (`fastcache.FastKVCache`)
to its integer codes and states, bytes and outputs. It is not part of the package: the runtime
is `FastKVCache`. Each frame's K/V enter at the precision of their token class and stay there
until evicted:

- the newest `recent_frames` frames at `recent_bits`; a frame leaving that window is re-encoded
  from its float16 copy at its final precision;
- the first `sink_frames` frames at `sink_bits`, every `keyframe_interval`-th at `keyframe_bits`,
  all other frames as the layer's `TensorSpec` says (per head);
- predictive tensors (chain.py) are coded against the previous frame's integer states; a held
  frame whose predecessor is evicted is re-stored as an anchor, exactly; keys with
  `rotary_coords > 0` are stored before the rotary encoding with their frame's coordinates;
- span state (kind "prq"): the first frame of a span coded below 16 bits fits the centroids; a
  deferred span holds its frames in float16 until its last frame is in (`_complete_span`);
- the key-noise logit correction (`logit_bias`) and the Jensen-bias correction (`jensen`).

It runs no memory plan: the runtime's tiers are held to properties of their own (tests/test_tiers.py:
a recalled slot holds its host frame's bytes and decodes to what that frame decoded to in the window).
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate import predictive_roles
from calibrate.cache import KVCache, Rope, kept_frames
from calibrate.codec import (HeadParams, decode, encode, fit_span_state, head_params, key_steps, span_of, span_pending,
                             stored_nbytes, with_span_state)
from calibrate.memory import KINDS, check_fitted_window, final_bits
from calibrate.quant import predictive as P
from calibrate.quant.fields import FieldLayout
from calibrate.quant.jensen import jensen_bias
from calibrate.quant.logit_noise import logit_inflation
from calibrate.recipe import Recipe, TensorSpec
from calibrate.tiers import predicted_bytes

States = dict[int, list[Tensor]]  # frame index -> integer states per head, of one predictive tensor


class ReferenceCache(KVCache):
    def __init__(self, recipe: Recipe, window: int = 16, sink_frames: int = 1, device: str | torch.device = "cpu"):
        if recipe.scheme.policy.plan is not None:
            raise ValueError("the tests' oracle runs no memory plan (tests/test_tiers.py tests the runtime's)")
        super().__init__(recipe.model.num_layers, window, sink_frames)
        if recipe.scheme.policy.keyframe_interval < 0:
            raise ValueError(f"policy.keyframe_interval must be >= 1 (or 0 = no key frames), "
                             f"got {recipe.scheme.policy.keyframe_interval}")
        check_fitted_window(recipe, window, sink_frames)
        self.recipe = recipe
        self.policy = recipe.scheme.policy
        self.head_dim = recipe.model.head_dim
        self.num_heads = recipe.model.num_kv_heads
        self.device = torch.device(device)
        tensors = {k: v.to(self.device) for k, v in recipe.tensors.items()}
        self._recipe_on_device = Recipe(recipe.model, recipe.scheme, tensors, recipe.metadata, recipe.path)
        self._params: dict[tuple[int, str, int, int], HeadParams] = {}
        self._chains: dict[tuple[int, str], list[ChainCodec]] = {
            (i, kind): [ChainCodec(predictive_roles.head_params(self._recipe_on_device.layer_tensors(i, kind), h),
                                   self.spec(i, kind).temporal, self.spec(i, kind).sink_hold) for h in range(self.num_heads)]
            for i in range(self.num_layers) for kind in KINDS if self.spec(i, kind).kind == "predictive"}
        self._rope_at = None  # the model's Rope.at, for keys stored before the rotation
        # chain states `append` decoded, handed to the `read` of the same step (never kept longer)
        self._step_states: dict[int, dict[str, States]] = {}
        # per layer: (kind, head, span) -> the span's state (codec.fit_span_state)
        self._span_states: list[dict[tuple[str, int, int], Tensor]] = [{} for _ in range(recipe.model.num_layers)]
        self._references: dict[tuple[int, str], list[dict]] = {}  # a sink refresh's held reference per head

    @classmethod
    def from_recipe(cls, recipe: Recipe, window: int = 16, sink_frames: int = 1, device="cpu") -> "ReferenceCache":
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
        if not self._span_states[layer]:
            return
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

    def stored_bits(self, layer: int, kind: str, head: int, index: int) -> int:
        """Bits frame `index` of one head is held at now (recent window, a deferred span not yet
        complete, or its final class)."""
        if self._frames[layer][index]["bits"] == "recent":
            return self.policy.recent_bits
        if span_pending(self.spec(layer, kind), index, self._num_appended[layer]):
            return 16
        return self.final_bits(layer, kind, head, index)

    def _complete_span(self, layer: int, kind: str, span: int) -> None:
        """A deferred span's last frame is in: fit each head's state on the tokens of the span's held
        frames it codes below 16 bits (frame order), then code every pending frame of the span."""
        spec, held = self.spec(layer, kind), self._frames[layer]
        frames = [f for f in sorted(held) if span_of(spec, f) == span]  # all pending until now
        raw = {f: self._decode(layer, kind, held[f][kind], lambda h: 16, f) for f in frames}
        for h in range(self.num_heads):
            coded = [f for f in frames if self.final_bits(layer, kind, h, f) < 16]
            if coded:
                p = self.params(layer, kind, h, self.final_bits(layer, kind, h, coded[0]))
                x_BTD = torch.cat([raw[f][:, h] for f in coded], dim=1)
                self._span_states[layer][(kind, h, span)] = fit_span_state(x_BTD, spec, p)
        for f in frames:
            held[f][kind] = self._encode_final(layer, kind, f, raw[f], {})

    def _encode_final(self, layer: int, kind: str, index: int, x_BHTD: Tensor, states: States) -> list[dict]:
        """Frame `index` of one tensor at its final precision; a predictive tensor codes it
        against the states of frame index - 1 (if held) and records its own states."""
        chain = self._chains.get((layer, kind))
        if chain is None:
            return self._encode(layer, x_BHTD, kind, lambda h: self.final_bits(layer, kind, h, index), index)
        prev = states.get(index - 1)
        sink = index < self.sink_frames  # held in the sink code, if the tensor has one
        refresh = self.spec(layer, kind).sink_refresh  # the reference: the sink's, then each refresh frame's
        if refresh and (index == 0 and sink or P.is_refresh_frame(index, refresh, self.sink_frames)):
            self._references[(layer, kind)] = [c.reference(P.reference_code(x_BHTD[:, h], c.params)) for h, c in enumerate(chain)]
        coded = [c.encode(x_BHTD[:, h], None if prev is None else prev[h], sink, self._reference_w(layer, kind, h))
                 for h, c in enumerate(chain)]
        states[index] = [v for _, v in coded]
        return [stored for stored, _ in coded]

    def _reference_w(self, layer: int, kind: str, head: int) -> Tensor | None:
        """The sink hold's source of one head: with a sink refresh the held reference (0 until the
        sink frame is coded), else the sink code w of frame 0 if it is held in it."""
        if self.spec(layer, kind).sink_refresh:
            return self._chains[(layer, kind)][head].reference_code(self._references[(layer, kind)][head])
        record = self._frames[layer].get(0)
        if record is None or "sink" not in record[kind][head]:
            return None
        return self._chains[(layer, kind)][head].sink_code(record[kind][head])

    def _chain_states(self, layer: int, kind: str) -> States:
        """Integer states of every held frame of a predictive tensor that is in the chain, oldest
        first (each decodes from its predecessor's, or is an anchor or all-intra)."""
        frames = [f for f in self.frame_indices(layer) if self._frames[layer][f]["bits"] != "recent"]
        if not frames:
            return {}
        per_head = [c.chain_states(frames, [self._frames[layer][f][kind][h] for f in frames])
                    for h, c in enumerate(self._chains[(layer, kind)])]
        return {f: [states[i] for states in per_head] for i, f in enumerate(frames)}

    def _key_input(self, layer: int, k_BHTD: Tensor, key_rope: Rope) -> tuple[Tensor, dict]:
        """The keys a layer stores (post-rotary, or pre-rotary with the frame's coordinates)."""
        P = self.spec(layer, "k").rotary_coords
        if not P:
            return key_rope.apply(k_BHTD), {}
        if key_rope.coords_BP is None or key_rope.at is None or key_rope.coords_BP.shape[-1] != P:
            got = "none" if key_rope.coords_BP is None else str(key_rope.coords_BP.shape[-1])
            raise ValueError(f"recipe {self.recipe.path or ''}: scheme.layers[{layer}].k.rotary_coords={P}: keys are "
                             f"stored before the rotary encoding, which needs {P} rotary coordinates per frame from "
                             f"the model; its Rope gives {got}")
        self._rope_at = key_rope.at
        return k_BHTD, {"coords": key_rope.coords_BP.detach().to(torch.float32).clone()}

    def append(self, layer: int, k_BHTD: Tensor, v_BHTD: Tensor, key_rope: Rope) -> int:
        """Store the frame (recent or final precision), move the frame leaving the recent window
        to its final precision, evict, and re-store as anchors the chain frames whose
        predecessor was evicted."""
        held, index, R = self._frames[layer], self._num_appended[layer], self.policy.recent_frames
        k_in, extra = self._key_input(layer, k_BHTD, key_rope)
        if index == 0:  # a sink refresh's reference is held from the first frame on, 0 until the sink is coded
            B, _, T, D = v_BHTD.shape
            self._references.update({(layer, kind): [c.reference(torch.zeros(B, T, D, dtype=torch.int64, device=self.device))
                                                     for c in chain] for (i, kind), chain in self._chains.items()
                                     if i == layer and self.spec(layer, kind).sink_refresh})
        states = {kind: self._chain_states(layer, kind) for kind in KINDS if (layer, kind) in self._chains}
        if R > 0:
            held[index] = {"bits": "recent", **extra, **{kind: self._encode(layer, x, kind, lambda h: self.policy.recent_bits,
                                                                          index) for kind, x in zip(KINDS, (k_in, v_BHTD))}}
        else:
            held[index] = {"bits": "final", **extra,
                           **{kind: self._encode(layer, x, kind, lambda h: 16, index) if self.spec(layer, kind).prq_deferred
                              else self._encode_final(layer, kind, index, x, states.get(kind, {}))
                              for kind, x in zip(KINDS, (k_in, v_BHTD))}}
            for kind in KINDS:
                spec = self.spec(layer, kind)
                if spec.prq_deferred and not span_pending(spec, index, index + 1):
                    self._complete_span(layer, kind, span_of(spec, index))
        self._num_appended[layer] = index + 1
        leaving = index - R
        if R > 0 and leaving in held:  # leaves the recent window: re-encoded at its final precision
            record = held[leaving]
            raw = {kind: self._decode(layer, kind, record[kind], lambda h: self.policy.recent_bits, leaving) for kind in KINDS}
            record.update(bits="final", **{kind: self._encode_final(layer, kind, leaving, raw[kind], states.get(kind, {}))
                                           for kind in KINDS})
        keep = set(kept_frames(index + 1, self.window, self.sink_frames))
        for kind, kind_states in states.items():  # chain.frame_role: no held predecessor -> anchor
            if not self.spec(layer, kind).temporal:
                continue
            for f in sorted(held):
                record = held[f]
                if f in keep and f > 0 and f - 1 not in keep and record["bits"] != "recent" and "anchor" not in record[kind][0]:
                    record[kind] = [c.anchor(v, s.get("holds"))
                                    for c, v, s in zip(self._chains[(layer, kind)], kind_states[f], record[kind])]
        for old in [f for f in held if f not in keep]:
            del held[old]
            for kind_states in states.values():
                kind_states.pop(old, None)
        self._step_states[layer] = states
        self._release_spans(layer)
        return index

    def read(self, layer: int, frames: list[int] | None = None) -> tuple[Tensor, Tensor]:
        """Post-rotary keys and values of `frames` (default: all held), oldest first."""
        frames = self.frame_indices(layer) if frames is None else frames
        out = {}
        step_states = self._step_states.pop(layer, {})  # decoded by this step's `append`
        for kind in KINDS:
            states = {}
            if (layer, kind) in self._chains:
                states = step_states[kind] if kind in step_states else self._chain_states(layer, kind)
            out[kind] = [self._load_kind(layer, kind, f, states) for f in frames]
        if self.spec(layer, "k").rotary_coords:
            out["k"] = [self._rope_at(self._frames[layer][f]["coords"]).apply(k) for f, k in zip(frames, out["k"])]
        return torch.cat(out["k"], dim=2), torch.cat(out["v"], dim=2)

    def _load_kind(self, layer: int, kind: str, index: int, states: States) -> Tensor:
        record = self._frames[layer][index]
        if index in states:
            chain = self._chains[(layer, kind)]
            return torch.stack([c.values(v, stored, self._reference_w(layer, kind, h))
                                for h, (c, v, stored) in enumerate(zip(chain, states[index], record[kind]))], dim=1)
        return self._decode(layer, kind, record[kind], lambda h: self.stored_bits(layer, kind, h, index), index)

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
                if "coords" in stored:
                    total += stored["coords"].numel() * stored["coords"].element_size()
        total += sum(stored_nbytes(states) for states in self._span_states)
        return total + sum(stored_nbytes(s) for refs in self._references.values() for s in refs)

    def predicted_nbytes(self, num_appended: int, batch: int = 1) -> int:
        """Bytes this cache holds after `num_appended` frames, from the recipe alone (memory.py;
        with a memory plan, its device tier: tiers.py)."""
        return predicted_bytes(self.recipe.model, self.recipe.scheme, num_appended, self.window, self.sink_frames, batch)


class ChainCodec:
    """One head's predictive code and the packing of its stored forms (layouts computed once)."""

    def __init__(self, params: P.PredictiveParams, temporal: bool = True, hold: bool = False):
        self.params = params
        self.temporal = temporal  # False: every token intra (the spec's `temporal`)
        self.hold = hold  # the spec's `sink_hold`: delta frames and anchors carry hold bits
        device = params.unit_D.device
        self._codes = FieldLayout(params.bits_D, device)
        self._anchors = FieldLayout(params.anchor_bits_D, device)
        self._sinks = FieldLayout(params.sink_bits_D, device) if params.has_sink else None
        self._refs = FieldLayout(P.reference_bits(params.sink_bits_D, params.bits_D), device) if params.has_sink else None
        self._ref_offset = P.field_offset(P.reference_bits(params.sink_bits_D, params.bits_D)) if params.has_sink else None
        self._modes: dict[int, FieldLayout] = {}  # tokens per frame -> 1-bit layout

    def _mode_layout(self, T: int) -> FieldLayout:
        if T not in self._modes:
            self._modes[T] = FieldLayout([1] * T, self.params.unit_D.device)
        return self._modes[T]

    def encode(self, x_BTD: Tensor, v_prev: Tensor | None, sink: bool = False,
               sink_w: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor]:
        """(stored delta frame, its states) of one frame; `v_prev` None = first frame of a chain; a
        `sink` frame of a code with sink roles: (its sink code, the states it starts the chain with);
        `sink_w`: the held sink frame's code (the sink hold's source; None: no hold)."""
        if sink and self._sinks is not None:
            w = P.sink_code(x_BTD, self.params)
            return {"sink": self._sinks.pack(P.sink_fields(w, self.params))}, P.sink_states(w, self.params)
        inter, codes, v = P.encode(x_BTD, self.params, v_prev if self.temporal else None)
        stored = {"modes": self._mode_layout(inter.shape[-1]).pack(inter.to(torch.int64)), "codes": self._codes.pack(codes)}
        if self.hold:
            hold = P.sink_hold(x_BTD, sink_w, self.params) if sink_w is not None else torch.zeros_like(inter)
            stored["holds"] = self._mode_layout(inter.shape[-1]).pack(hold.to(torch.int64))
        return stored, v

    def anchor(self, v_BTD: Tensor, holds: Tensor | None = None) -> dict[str, Tensor]:
        """An anchor of states v, with the hold bits of the frame it re-stores (sink hold)."""
        return {"anchor": self._anchors.pack(P.anchor_fields(v_BTD, self.params)),
                **({"holds": holds} if holds is not None else {})}

    def states(self, stored: dict[str, Tensor], v_prev: Tensor | None) -> Tensor:
        """The integer states of a delta, anchor or sink frame."""
        if "sink" in stored:
            return P.sink_states(self.sink_code(stored), self.params)
        if "anchor" in stored:
            return P.from_anchor_fields(self._anchors.unpack(stored["anchor"]), self.params)
        inter = self._mode_layout(stored["codes"].shape[-2]).unpack(stored["modes"]).bool()
        return P.apply_codes(inter, self._codes.unpack(stored["codes"]), v_prev, self.params)

    def chain_states(self, frames: list[int], stored: list[dict[str, Tensor]]) -> list[Tensor]:
        """States of held frames `frames` (ascending) from their stored forms: a frame decodes
        from its predecessor's states when that is held, else it is an anchor or all-intra. The
        delta frames are unpacked in one batch."""
        deltas = [i for i, s in enumerate(stored) if "anchor" not in s and "sink" not in s]
        unpacked = {}
        if deltas:
            T = stored[deltas[0]]["codes"].shape[-2]
            modes = self._mode_layout(T).unpack(torch.stack([stored[i]["modes"] for i in deltas])).bool()
            codes = self._codes.unpack(torch.stack([stored[i]["codes"] for i in deltas]))
            unpacked = {i: (modes[j], codes[j]) for j, i in enumerate(deltas)}
        out: list[Tensor] = []
        for i, f in enumerate(frames):
            if i not in unpacked:
                out.append(self.states(stored[i], None))
                continue
            prev = out[i - 1] if i > 0 and frames[i - 1] == f - 1 else None
            out.append(P.apply_codes(*unpacked[i], prev, self.params))
        return out

    def sink_code(self, stored: dict[str, Tensor]) -> Tensor:
        return P.from_sink_fields(self._sinks.unpack(stored["sink"]), self.params)

    def reference(self, w_BTD: Tensor) -> dict[str, Tensor]:
        """A sink refresh's reference w * [b = 0] packed at widths z * [b = 0] (offset binary)."""
        return {"reference": self._refs.pack(w_BTD + self._ref_offset)}

    def reference_code(self, stored: dict[str, Tensor]) -> Tensor:
        return self._refs.unpack(stored["reference"]) - self._ref_offset

    def values(self, v_BTD: Tensor, stored: dict[str, Tensor] | None = None, sink_w: Tensor | None = None) -> Tensor:
        """A frame's values from its states, or a sink frame's from its sink code; with hold bits,
        plus the sink's uncoded part (`sink_w`: the sink frame's code) where set."""
        if stored is not None and "sink" in stored:
            return P.sink_values(self.sink_code(stored), self.params)
        x = P.values(v_BTD, self.params)
        if stored is not None and "holds" in stored and sink_w is not None:
            hold = self._mode_layout(v_BTD.shape[-2]).unpack(stored["holds"]).bool()
            x = P.held_values(x, hold, P.sink_hold_part(sink_w, self.params))
        return x

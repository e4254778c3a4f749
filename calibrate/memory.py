"""The memory model: at which precision a cache holds each frame, and how many bytes that is.

Everything that speaks of a quantized cache's size asks here: the runtime (`predicted_nbytes`,
held to its measured `nbytes`), the fitter (the bit budget it spends), the pipeline (the
recipe's `memory` metadata) and the reports (the float16 reference). Bytes are counted from a
model's shape and a recipe's scheme alone; the bytes of one head of one frame come from the
codec (`codec.frame_nbytes`, next to the `encode` they describe).

Precision of frame `index` of one head (the token policy, `recipe.TokenPolicy`): the newest
`recent_frames` frames at `recent_bits`; once older, the first `sink_frames` frames at
`sink_bits`, every `keyframe_interval`-th frame at `keyframe_bits`, every other frame at the
spec's bits for the head. Which frames are held at all is the cache's window and sink policy
(`cache.kept_frames`).

Span state (kind "prq", codec.span_of): a head holds one state per span that has a kept frame
held below 16 bits (`span_state_bytes`), on top of the frames' own bytes. A deferred span's
frames are held at 16 bits until the span is complete (`codec.span_pending`).

Steady state: a budget or a bytes-per-frame figure is taken `STEADY_STATE_MARGIN` frames after
the window first fills, where every class of the policy is present and the window slides.
"""

from __future__ import annotations

import math

from calibrate import chain
from calibrate.cache import kept_frames
from calibrate.codec import frame_nbytes, span_of, span_pending, span_state_nbytes
from calibrate.recipe import ModelInfo, Recipe, Scheme, TensorSpec, TokenPolicy

KINDS = ("k", "v")
STEADY_STATE_MARGIN = 32  # frames past a full window (sinks + window) where bytes are measured


def is_keyframe(policy: TokenPolicy, index: int) -> bool:
    """Frame `index` is a key frame: every `keyframe_interval`-th frame from 0 (0 = no key frames)."""
    return policy.keyframe_interval > 0 and index % policy.keyframe_interval == 0


def frame_class(policy: TokenPolicy, index: int, num_appended: int) -> str:
    """The precision class of frame `index` after `num_appended` appends: "recent" (the newest
    `recent_frames`), then "sink", "key" (`is_keyframe`) or "main" (the spec's own width)."""
    if policy.recent_frames and index >= num_appended - policy.recent_frames:
        return "recent"
    if index < policy.sink_frames:
        return "sink"
    if is_keyframe(policy, index):
        return "key"
    return "main"


def final_bits(policy: TokenPolicy, spec: TensorSpec, head: int, index: int) -> int:
    """Bits frame `index` of one head is stored at once it leaves the recent window."""
    if index < policy.sink_frames:
        return policy.sink_bits
    if is_keyframe(policy, index):
        return policy.keyframe_bits
    return spec.bits_of(head)


def steady_state_frames(window: int, sink_frames: int) -> int:
    """Frames appended when a cache with this window and sinks is measured at steady state."""
    return window + sink_frames + STEADY_STATE_MARGIN


def predicted_cache_bytes(model: ModelInfo, scheme: Scheme, num_appended: int, window: int, sink_frames: int,
                          batch: int = 1) -> int:
    """Bytes the runtime (`FastKVCache`) holds for this scheme after `num_appended` frames.

    Per-frame codes go by the token policy (`final_bits`); a predictive tensor's frames by their
    role in the chain (`chain.frame_role`: recent, anchor or delta); keys stored before the
    rotary encoding add their frame's float32 coordinates once per layer.
    """
    pol = scheme.policy
    T, D = model.tokens_per_frame, model.head_dim
    total = 0
    kept = kept_frames(num_appended, window, sink_frames)
    for pair in scheme.layers:
        total += len(kept) * batch * pair.k.rotary_coords * 4
        for kind in KINDS:
            spec: TensorSpec = getattr(pair, kind)
            for h in range(model.num_kv_heads):
                if spec.kind == "predictive":
                    total += predictive_head_bytes(spec.token_bits[h], spec.anchor_token_bits[h], spec.temporal,
                                                   kept, num_appended, pol.recent_frames, batch, T, D,
                                                   *sink_code_of(spec, h, sink_frames), spec.sink_hold,
                                                   spec.refresh_token_bits[h] if spec.refresh_token_bits else 0)
                    continue
                for f in kept:
                    total += frame_nbytes(spec, held_bits(pol, spec, h, f, num_appended), batch, T, D)
    return total + span_state_bytes(model, scheme, num_appended, window, sink_frames, batch)


def sink_code_of(spec: TensorSpec, head: int, sink_frames: int) -> tuple[int, int]:
    """(sink_token_bits, sink_coded) of one head of a predictive tensor: its sink code's bits per
    token and the frames held in it (`chain.frame_role`); (0, 0) without a sink code."""
    if spec.sink_token_bits is None:
        return 0, 0
    return spec.sink_token_bits[head], sink_frames


def predictive_head_bytes(token_bits: int, anchor_token_bits: int, temporal: bool, kept: list[int], num_appended: int,
                          recent_frames: int, batch: int, T: int, D: int, sink_token_bits: int = 0,
                          sink_coded: int = 0, hold: bool = False, refresh_token_bits: int = 0) -> int:
    """Bytes of one head of a predictive tensor over the `kept` frames, each in its chain role
    (`chain.frame_role`), plus the sink refresh's reference (format 1.5: `refresh_token_bits` per
    token, held once from the first frame on): the per-head term of `predicted_cache_bytes`, which
    the fitter's mixed precision prices an upgrade of one head with."""
    kept_set = set(kept)
    reference = batch * T * -(-refresh_token_bits // 8) if kept else 0
    return reference + sum(chain.frame_nbytes(chain.frame_role(f, num_appended, kept_set, recent_frames, temporal,
                                                                sink_coded),
                                              token_bits, anchor_token_bits, batch, T, D, sink_token_bits, hold)
                           for f in kept)


def head_frame_nbytes(spec: TensorSpec, head: int, role: str, batch: int, T: int, D: int) -> int:
    """Bytes of one frame of one head of a predictive tensor held in chain `role` (chain.frame_role)."""
    return chain.frame_nbytes(role, spec.token_bits[head], spec.anchor_token_bits[head], batch, T, D,
                              spec.sink_token_bits[head] if spec.sink_token_bits is not None else 0, spec.sink_hold)


def held_bits(policy: TokenPolicy, spec: TensorSpec, head: int, index: int, num_appended: int) -> int:
    """Bits frame `index` of one head is held at after `num_appended` appends (recent window, a
    deferred span not yet complete, or its final class): the rule `predicted_cache_bytes` applies
    to every kept frame."""
    if frame_class(policy, index, num_appended) == "recent":
        return policy.recent_bits
    if span_pending(spec, index, num_appended):
        return 16
    return final_bits(policy, spec, head, index)


def span_state_bytes(model: ModelInfo, scheme: Scheme, num_appended: int, window: int, sink_frames: int,
                     batch: int = 1) -> int:
    """Bytes of the span states a cache holds: per layer, K/V and head, one state per span with a
    kept frame held below 16 bits (codec.span_state_nbytes; 0 for kinds without span state)."""
    total = 0
    kept = kept_frames(num_appended, window, sink_frames)
    for pair in scheme.layers:
        for kind in KINDS:
            spec: TensorSpec = getattr(pair, kind)
            if span_of(spec, 0) is None:
                continue
            for h in range(model.num_kv_heads):
                spans = {span_of(spec, f) for f in kept if held_bits(scheme.policy, spec, h, f, num_appended) < 16}
                total += len(spans) * span_state_nbytes(spec, batch, model.head_dim)
    return total


def fp16_cache_bytes(model: ModelInfo, num_appended: int, window: int, sink_frames: int, batch: int = 1) -> int:
    """Bytes of the same frames held in float16: the reference every ratio is taken to."""
    return len(kept_frames(num_appended, window, sink_frames)) * fp16_frame_bytes(model, batch)


def fp16_frame_bytes(model: ModelInfo, batch: int = 1) -> int:
    """Bytes of one frame's K/V over every layer in float16."""
    return model.num_layers * model.elements_per_frame * 2 * batch


def steady_phases(scheme: Scheme) -> int:
    """Appends after which a full cache of `scheme` holds the same classes again: the key-frame
    interval and every span length (kind "prq") in one least common multiple."""
    phases = max(scheme.policy.keyframe_interval, 1)
    for pair in scheme.layers:
        for spec in (pair.k, pair.v):
            if span_of(spec, 0) is not None:
                phases = math.lcm(phases, spec.prq_span_frames)
    return phases


def bits_per_element(model: ModelInfo, scheme: Scheme, window: int, sink_frames: int) -> float:
    """Average stored bits per cached K/V element at steady state (every per-frame byte counted).

    With key frames the kept window holds more or fewer of them as it slides; the figure is the
    largest over one key-frame interval, so the cache never holds more than the budget. Span
    states (kind "prq") vary with the phase of the spans likewise: the largest over the least
    common multiple of the interval and every span length.
    """
    return max(phase_bits(model, scheme, window, sink_frames))


def phase_bits(model: ModelInfo, scheme: Scheme, window: int, sink_frames: int) -> list[float]:
    """Bits per cached element at each phase of the steady state (`steady_phases` appends from
    `steady_state_frames`): their largest is `bits_per_element`, their mean what a long rollout
    holds on average."""
    n0 = steady_state_frames(window, sink_frames)
    fp16 = fp16_cache_bytes(model, n0, window, sink_frames)
    return [16.0 * predicted_cache_bytes(model, scheme, n, window, sink_frames) / fp16
            for n in range(n0, n0 + steady_phases(scheme))]


def memory_section(recipe: Recipe, window: int, sink_frames: int) -> dict:
    """The recipe's `memory` metadata: budgeted bits/element, bytes per frame at steady state,
    and the bytes of its static tensors (rotations, ranges, compensators: paid once)."""
    n = steady_state_frames(window, sink_frames)
    per_frame = (predicted_cache_bytes(recipe.model, recipe.scheme, n, window, sink_frames)
                 / len(kept_frames(n, window, sink_frames)))
    return {"bits_per_element": bits_per_element(recipe.model, recipe.scheme, window, sink_frames),
            "bytes_per_frame_steady": per_frame, "window": window, "sink_frames": sink_frames,
            "static_bytes": sum(t.numel() * t.element_size() for t in recipe.tensors.values())}


def check_fitted_window(recipe: Recipe, window: int, sink_frames: int) -> None:
    """A recipe with codes across frames runs only under the window and sinks it was fitted for
    (its `memory` section says which): its steps and widths were chosen for that chain length."""
    if not any(recipe.spec(i, kind).kind == "predictive" for i in range(recipe.model.num_layers) for kind in KINDS):
        return
    memory = recipe.section("memory")
    fitted = (memory.get("window"), memory.get("sink_frames"))
    if None not in fitted and fitted != (window, sink_frames):
        raise ValueError(f"{recipe.path or 'recipe'}: memory.window: its predictive codes were fitted for a window of "
                         f"{fitted[0]} frames + {fitted[1]} sink(s), the cache has {window} + {sink_frames}; refit with "
                         f"model.cache.window={window} model.cache.sink_frames={sink_frames}")

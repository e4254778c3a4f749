"""Mixed precision: spend the bit budget where the objective gains most per extra bit.

Starting from every tensor at 2 bits (and the anchor policy), a greedy allocator repeatedly
takes the upgrade with the largest objective gain per extra bit until the next one would
exceed `fit.budget_bits`. Upgrades:

- one step of bits (2 -> 3 -> 4 -> 8) for one (layer, tensor, head);
- `outlier_channels` float16 channels for one (layer, tensor);
- dense-and-sparse: the largest `sparse_fraction` of one (layer, tensor)'s entries per frame
  kept in float16 (with their index), so ranges fit the bulk of the values;
- one more *recent* frame in float16 (attention mass concentrates on the newest frames, so
  their precision is worth more than that of old ones; priced over all layers at once);
- key frames (`fit.keyframes`): every N-th frame (N from `fit.keyframe_intervals`) at 4 or 8
  bits, priced over all layers; their bytes are per-frame bytes like any other upgrade's (the
  budget counts the worst phase of the sliding window, memory.bits_per_element). Key frames
  rather than a periodic high-precision rebuild of the window: a rebuild re-forwards the window
  (window/N extra frame forwards per generated frame), needs the runtime to keep the generated
  frames and call the model, and its K/V are quantized again once stored; a key frame costs only
  the bytes it upgrades, priced here against every other upgrade.

Everything here is a value: an `Allocation` (the knobs of every tensor and the token policy) is
frozen, an upgrade is frozen and knows its objective gain, `Allocation.apply` returns a new
allocation, and `price(upgrade, ...)` is a pure function (gain, extra bits per element). Heads
are independent in the objective, so one pass per (layer, tensor, step) prices the upgrade of
every head at once; the objective always models the token policy as the runtime applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass, replace

from tqdm import tqdm

from calibrate.config import FitConfig
from calibrate.fit.fitters import outlier_channels
from calibrate.fit.objective import LayerTrace
from calibrate.fit.state import KINDS, Knobs, TensorState, layer_scores, scheme_of
from calibrate.memory import bits_per_element
from calibrate.recipe import ModelInfo, TokenPolicy

NEXT_BITS = {2: 3, 3: 4, 4: 8}
MAX_RECENT_FRAMES = 4
KEYFRAME_BITS = (4, 8)


@dataclass(frozen=True)
class TensorUpgrade:
    """New knobs for one (layer, tensor); `what` is its entry in the fit record."""

    what: dict
    gain: float  # objective gain (teacher-forced, summed over the heads it changes)
    layer: int
    kind: str
    knobs: Knobs


@dataclass(frozen=True)
class PolicyUpgrade:
    """A new token policy (more recent frames, key frames); priced over every layer."""

    what: dict
    gain: float
    policy: TokenPolicy


Upgrade = TensorUpgrade | PolicyUpgrade


@dataclass(frozen=True)
class Allocation:
    """What mixed precision decides: the knobs of every (layer, tensor) and the token policy."""

    knobs: tuple[tuple[Knobs, Knobs], ...]  # per layer: (K, V)
    policy: TokenPolicy

    def apply(self, upgrade: Upgrade) -> "Allocation":
        if isinstance(upgrade, PolicyUpgrade):
            return replace(self, policy=upgrade.policy)
        layers = list(self.knobs)
        pair = dict(zip(KINDS, layers[upgrade.layer]))
        pair[upgrade.kind] = upgrade.knobs
        layers[upgrade.layer] = (pair["k"], pair["v"])
        return replace(self, knobs=tuple(layers))


def price(upgrade: Upgrade, allocation: Allocation, bits_of: Callable[[Allocation], float],
          current_bits: float) -> tuple[float, float]:
    """(objective gain, budgeted bits per element added) of `upgrade` on `allocation`, whose
    bits are `current_bits` = bits_of(allocation)."""
    return upgrade.gain, bits_of(allocation.apply(upgrade)) - current_bits


def with_knobs(st: dict[str, TensorState], kind: str, knobs: Knobs) -> dict[str, TensorState]:
    """The layer's states with `kind` set to `knobs` (the others unchanged)."""
    return {**st, kind: replace(st[kind], knobs=knobs)}


def tensor_upgrades(layer: int, trace: LayerTrace, reference, st: dict[str, TensorState], policy: TokenPolicy,
                    cfg: FitConfig, scores: list[float]) -> list[TensorUpgrade]:
    """Upgrades of one layer's tensors, each with its gain over the layer's per-head `scores`."""
    lam = cfg.lambda_temporal
    out = []
    for kind in KINDS:
        s = st[kind]
        knobs = s.knobs
        bits = list(knobs.head_bits)
        stepped = [NEXT_BITS.get(b, b) for b in bits]
        if stepped != bits:
            new = layer_scores(trace, reference, with_knobs(st, kind, replace(knobs, head_bits=tuple(stepped))),
                               policy, lam)
            for h in range(len(stepped)):
                if stepped[h] != bits[h]:
                    one = list(bits)
                    one[h] = stepped[h]
                    out.append(TensorUpgrade({"layer": layer, "tensor": kind, "head": h, "bits": stepped[h]},
                                             scores[h] - new[h], layer, kind, replace(knobs, head_bits=tuple(one))))
        if knobs.outliers is None and cfg.outlier_channels > 0:
            channels = outlier_channels(s.sample_HND, s.choice.tensors.get("rotation"), cfg.outlier_channels)
            up = replace(knobs, outliers=channels)
            new = layer_scores(trace, reference, with_knobs(st, kind, up), policy, lam)
            out.append(TensorUpgrade({"layer": layer, "tensor": kind, "outliers": channels.tolist()},
                                     sum(scores) - sum(new), layer, kind, up))
        if knobs.sparse == 0 and cfg.sparse_fraction > 0:
            up = replace(knobs, sparse=cfg.sparse_fraction)
            new = layer_scores(trace, reference, with_knobs(st, kind, up), policy, lam)
            out.append(TensorUpgrade({"layer": layer, "tensor": kind, "sparse_fraction": cfg.sparse_fraction},
                                     sum(scores) - sum(new), layer, kind, up))
    return out


def _policy_candidates(policy: TokenPolicy, cfg: FitConfig) -> list[TokenPolicy]:
    """Token-policy upgrades: one more recent frame kept in float16 (KIVI's full-precision
    residual), and key frames (every N-th frame at 4 or 8 bits) if `fit.keyframes`.

    Recent frames are re-encoded at their final precision when they leave the window, from what
    was stored; at float16 that is (up to fp16 rounding) the original, which is what the
    objective models. Recent frames at 4 or 8 bits would be quantized twice (4-bit, then 2-bit
    from the 4-bit values): measured worse in closed loop than no recent window at all (31.4 vs
    35.2 dB at a 3.25-bit budget), so they are not offered. Any other key-frame setting is a
    candidate; the allocator takes it only if it costs bits and gains objective.
    """
    out = []
    if policy.recent_frames < MAX_RECENT_FRAMES:
        out.append(replace(policy, recent_frames=policy.recent_frames + 1, recent_bits=16))
    if cfg.keyframes:
        out += [replace(policy, keyframe_interval=n, keyframe_bits=b) for n in cfg.keyframe_intervals
                for b in KEYFRAME_BITS if (n, b) != (policy.keyframe_interval, policy.keyframe_bits)]
    return out


def allocate(info: ModelInfo, traces: list[LayerTrace], refs: list, states: list[dict[str, TensorState]],
             policy: TokenPolicy, cfg: FitConfig, window: int, sink_frames: int) -> tuple[Allocation, list[dict]]:
    """Greedy mixed precision from `states` and `policy`; returns the final allocation and the
    upgrades taken (the fit record's `upgrades`, in order)."""
    lam = cfg.lambda_temporal
    allocation = Allocation(tuple((st["k"].knobs, st["v"].knobs) for st in states), policy)

    def layer_states(a: Allocation, layer: int) -> dict[str, TensorState]:
        return {kind: replace(states[layer][kind], knobs=k) for kind, k in zip(KINDS, a.knobs[layer])}

    def bits_of(a: Allocation) -> float:
        return bits_per_element(info, scheme_of([layer_states(a, l) for l in range(len(states))], a.policy),
                                window, sink_frames)

    scores = [layer_scores(t, refs[l], layer_states(allocation, l), allocation.policy, lam) for l, t in enumerate(traces)]
    offers = {l: tensor_upgrades(l, t, refs[l], layer_states(allocation, l), allocation.policy, cfg, scores[l])
              for l, t in enumerate(traces)}
    # per-layer scores under each candidate policy; a layer's entries are dropped when it changes
    policy_scores: dict[tuple, list[float]] = {}
    upgrades = []
    bar = tqdm(desc="mixed precision", unit="upgrade")
    while True:
        current = bits_of(allocation)
        policy_offers = []
        for cand in _policy_candidates(allocation.policy, cfg):
            gain = 0.0
            for l, t in enumerate(traces):
                key = (l, *astuple(cand))
                if key not in policy_scores:
                    policy_scores[key] = layer_scores(t, refs[l], layer_states(allocation, l), cand, lam)
                gain += sum(scores[l]) - sum(policy_scores[key])
            what = ("recent_frames", "recent_bits") if cand.recent_frames != allocation.policy.recent_frames else \
                ("keyframe_interval", "keyframe_bits")
            policy_offers.append(PolicyUpgrade({k: getattr(cand, k) for k in what}, gain, cand))
        best = None
        for upgrade in [o for layer_offers in offers.values() for o in layer_offers] + policy_offers:
            if upgrade.gain <= 0:
                continue
            gain, cost = price(upgrade, allocation, bits_of, current)
            if cost <= 0 or current + cost > cfg.budget_bits + 1e-9:
                continue
            if best is None or gain / cost > best[0]:
                best = (gain / cost, upgrade, cost)
        if best is None:
            break
        _, upgrade, cost = best
        allocation = allocation.apply(upgrade)
        # a tensor upgrade changes one layer's scores; a policy upgrade changes every layer's
        changed = [upgrade.layer] if isinstance(upgrade, TensorUpgrade) else list(range(len(traces)))
        policy_scores = {key: v for key, v in policy_scores.items() if key[0] not in changed}
        for l in changed:
            scores[l] = layer_scores(traces[l], refs[l], layer_states(allocation, l), allocation.policy, lam)
            offers[l] = tensor_upgrades(l, traces[l], refs[l], layer_states(allocation, l), allocation.policy, cfg,
                                        scores[l])
        upgrades.append({**upgrade.what, "gain": round(upgrade.gain, 6), "bits_cost": round(cost, 4)})
        bar.update(1)
    bar.close()
    return allocation, upgrades

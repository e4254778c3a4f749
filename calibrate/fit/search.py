"""Fit a whole recipe: anchors, per-layer choices, then mixed precision under the bit budget.

1. Anchors: frames whose attention share is far above uniform (from the statistics'
   attention-mass-by-frame-index, `stats.anchor_frames`) are kept as sink frames at 8 bits;
   none detected -> no sink precision is spent (the decision is recorded either way).
2. Per layer: K is fitted with V in full precision, then V with the fitted K (fitters.py).
3. Mixed precision: a greedy allocator takes the upgrade with the largest objective gain per
   extra byte until the next one would exceed `budget_bits`. Upgrades: one step of bits
   (2 -> 3 -> 4 -> 8) for one (layer, tensor, head), or `outlier_channels` float16 channels
   for one (layer, tensor). Heads are independent in the objective, so one pass per
   (layer, tensor, step) prices the upgrade of every head at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from calibrate.config import FitConfig
from calibrate.fit.fitters import Choice, bits_per_element, fake_quant_heads, fit_tensor, outlier_channels, with_bits
from calibrate.fit.objective import LayerTrace, attention_outputs, head_scores
from calibrate.recipe import LayerSpec, ModelInfo, Recipe, Scheme, TokenPolicy
from calibrate.stats import KVStats, anchor_frames

log = logging.getLogger(__name__)

NEXT_BITS = {2: 3, 3: 4, 4: 8}


class BudgetError(ValueError):
    pass


@dataclass
class TensorState:
    choice: Choice
    sample_HND: torch.Tensor
    head_bits: list[int]
    outliers: torch.Tensor | None = None
    scores_H: list[float] = field(default_factory=list)

    def spec_tensors(self):
        return with_bits(self.choice, self.sample_HND, self.head_bits, self.outliers)


def _hat(trace: LayerTrace, kind: str, state: TensorState, head_bits=None, outliers="same"):
    x = trace.k if kind == "k" else trace.v
    st = TensorState(state.choice, state.sample_HND, head_bits or state.head_bits,
                     state.outliers if outliers == "same" else outliers)
    spec, tensors = st.spec_tensors()
    return fake_quant_heads(x, spec, tensors, st.head_bits)


def _scores(trace, reference, k_hat, v_hat, lam) -> list[float]:
    return head_scores(reference, attention_outputs(trace, k_hat, v_hat)).objective(lam).tolist()


def detect_anchors(stats: KVStats | None, enabled: bool) -> tuple[TokenPolicy, dict]:
    if not enabled:
        return TokenPolicy(sink_frames=0), {"anchors": [], "why": "anchor policy off (fit.anchors=false)"}
    found = sorted({f for layer in anchor_frames(stats) for f in layer}) if stats is not None else []
    if not found:
        return TokenPolicy(sink_frames=0), {"anchors": [], "why": "no frame receives attention far above uniform"}
    sinks = max(found) + 1
    return TokenPolicy(sink_frames=sinks, sink_bits=8), {
        "anchors": found, "why": f"frames {found} get >= 3x uniform attention share: kept as {sinks} sink frame(s) at 8 bits"}


def assemble(info: ModelInfo, states: list[dict[str, TensorState]], policy: TokenPolicy, name: str = "ours") -> Recipe:
    layers, tensors = [], {}
    for i, st in enumerate(states):
        pair = {}
        for kind in ("k", "v"):
            spec, ts = st[kind].spec_tensors()
            pair[kind] = spec
            tensors.update({f"layers.{i}.{kind}.{role}": t for role, t in ts.items()})
        layers.append(LayerSpec(k=pair["k"], v=pair["v"]))
    scheme = Scheme(name=name, layers=layers, policy=policy, notes="fitted by calibrate (see metadata 'fit')")
    return Recipe(info, scheme, tensors)


def fit_recipe(info: ModelInfo, traces: list[LayerTrace], stats: KVStats | None, k_samples: torch.Tensor,
               v_samples: torch.Tensor, cfg: FitConfig, window: int, sink_frames: int) -> tuple[Recipe, dict]:
    """Fit the recipe; returns it and the fit record (choices, reasons, scores) for its metadata."""
    policy, anchor_note = detect_anchors(stats, cfg.anchors)
    lam = cfg.lambda_temporal
    H = info.num_kv_heads
    rotation_names = list(cfg.rotations)
    states: list[dict[str, TensorState]] = []
    refs = []
    record: dict = {"anchors": anchor_note, "layers": [], "lambda_temporal": lam, "budget_bits": cfg.budget_bits}
    for layer, trace in enumerate(tqdm(traces, desc="fit layers")):
        reference = attention_outputs(trace)
        refs.append(reference)
        k_choice = fit_tensor("k", layer, trace, reference, None, k_samples[layer], _gram(stats, "k", layer, k_samples[layer]),
                              rotation_names, list(cfg.clip_grid), lam)
        k_state = TensorState(k_choice, k_samples[layer], [2] * H)
        k_hat = _hat(trace, "k", k_state)
        v_choice = fit_tensor("v", layer, trace, reference, k_hat, v_samples[layer], _gram(stats, "v", layer, v_samples[layer]),
                              rotation_names, list(cfg.clip_grid), lam)
        v_state = TensorState(v_choice, v_samples[layer], [2] * H)
        states.append({"k": k_state, "v": v_state})
        record["layers"].append({"k": k_choice.reasons, "v": v_choice.reasons})
    base = assemble(info, states, policy)
    base_bits = bits_per_element(base, window, sink_frames)
    if base_bits > cfg.budget_bits + 1e-9:
        raise BudgetError(f"fit.budget_bits={cfg.budget_bits} is below what 2-bit codes with their parameters need "
                          f"({base_bits:.3f} bits/element for this model and token policy)")
    record["base_bits"] = base_bits
    record["upgrades"] = _allocate(info, traces, refs, states, policy, cfg, window, sink_frames) if cfg.mixed_precision else []
    recipe = assemble(info, states, policy)
    record["bits_per_element"] = bits_per_element(recipe, window, sink_frames)
    return recipe, record


def _gram(stats, kind, layer, sample_HND):
    if stats is not None:
        return stats.tensors[f"{kind}.gram"][layer].float()
    return sample_HND.transpose(1, 2) @ sample_HND


def _layer_options(layer, trace, reference, st, cfg: FitConfig, H: int) -> list[tuple]:
    """Upgrades of one layer: (layer, kind, description, objective gain, head_bits, outliers)."""
    lam = cfg.lambda_temporal
    options = []
    for kind in ("k", "v"):
        s = st[kind]
        other_hat = _hat(trace, "v" if kind == "k" else "k", st["v" if kind == "k" else "k"])
        pair = lambda x_hat: (x_hat, other_hat) if kind == "k" else (other_hat, x_hat)
        # one step more for every head at once (heads are independent in the objective)
        stepped = [NEXT_BITS.get(b, b) for b in s.head_bits]
        if stepped != s.head_bits:
            new = _scores(trace, reference, *pair(_hat(trace, kind, s, head_bits=stepped)), lam)
            for h in range(H):
                if stepped[h] != s.head_bits[h]:
                    bits = list(s.head_bits)
                    bits[h] = stepped[h]
                    options.append((layer, kind, {"head": h, "bits": stepped[h]}, s.scores_H[h] - new[h], bits, s.outliers))
        if s.outliers is None and cfg.outlier_channels > 0:
            oc = outlier_channels(s.sample_HND, s.choice.tensors.get("rotation"), cfg.outlier_channels)
            new = _scores(trace, reference, *pair(_hat(trace, kind, s, outliers=oc)), lam)
            options.append((layer, kind, {"outliers": oc.tolist()}, sum(s.scores_H) - sum(new), s.head_bits, oc))
    return options


def _refresh_scores(layer, trace, reference, st, lam) -> None:
    scores = _scores(trace, reference, _hat(trace, "k", st["k"]), _hat(trace, "v", st["v"]), lam)
    st["k"].scores_H = scores
    st["v"].scores_H = scores


def _allocate(info, traces, refs, states, policy, cfg: FitConfig, window, sink_frames) -> list[dict]:
    """Greedy mixed precision: best objective gain per extra bit until the budget is spent."""
    H = info.num_kv_heads
    bits_now = lambda: bits_per_element(assemble(info, states, policy), window, sink_frames)
    options = {}
    for layer, trace in enumerate(traces):
        _refresh_scores(layer, trace, refs[layer], states[layer], cfg.lambda_temporal)
        options[layer] = _layer_options(layer, trace, refs[layer], states[layer], cfg, H)
    upgrades = []
    bar = tqdm(desc="mixed precision", unit="upgrade")
    while True:
        current = bits_now()
        best = None
        for layer, kind, what, gain, bits, oc in (o for opts in options.values() for o in opts):
            if gain <= 0:
                continue
            s = states[layer][kind]
            saved = (s.head_bits, s.outliers)
            s.head_bits, s.outliers = bits, oc
            cost = bits_now() - current
            s.head_bits, s.outliers = saved
            if cost <= 0 or current + cost > cfg.budget_bits + 1e-9:
                continue
            if best is None or gain / cost > best[0]:
                best = (gain / cost, layer, kind, what, gain, bits, oc, cost)
        if best is None:
            break
        _, layer, kind, what, gain, bits, oc, cost = best
        s = states[layer][kind]
        s.head_bits, s.outliers = bits, oc
        _refresh_scores(layer, traces[layer], refs[layer], states[layer], cfg.lambda_temporal)
        options[layer] = _layer_options(layer, traces[layer], refs[layer], states[layer], cfg, H)
        upgrades.append({"layer": layer, "tensor": kind, **what, "gain": round(gain, 6), "bits_cost": round(cost, 4)})
        bar.update(1)
    bar.close()
    return upgrades

"""Fit a whole recipe: anchors, per-layer choices, then mixed precision under the bit budget.

1. Anchors: frames whose attention share is far above uniform (from the statistics'
   attention-mass-by-frame-index, `stats.anchor_frames`) are kept as sink frames at 8 bits;
   none detected -> no sink precision is spent (the decision is recorded either way).
2. Per layer: K is fitted with V in full precision, then V with the fitted K (fitters.py).
3. Mixed precision (`fit.mixed_precision`, allocate.py): a greedy allocator spends the rest of
   `budget_bits` on the upgrades (bits per head, outlier channels, dense-and-sparse values,
   recent frames in float16, key frames) with the largest objective gain per extra bit.
4. Optional, on the final bits: the low-rank compensator (`fit.comp_rank`, compensate.py), then
   the key-noise logit correction (`fit.logit_correction`, logit_correction.py); each is kept
   only where it lowers the objective. Both are static recipe tensors (no per-frame bytes).
"""

from __future__ import annotations

import logging
from dataclasses import asdict

import torch
from tqdm import tqdm

from calibrate.codec import fake_quant, head_params
from calibrate.config import FitConfig
from calibrate.fit.allocate import allocate
from calibrate.fit.compensate import fit_compensator
from calibrate.fit.fitters import fit_tensor
from calibrate.fit.logit_correction import fit_logit_correction
from calibrate.fit.objective import LayerTrace, attention_outputs
from calibrate.fit.state import KINDS, Knobs, TensorState, assemble, layer_scores
from calibrate.memory import bits_per_element
from calibrate.recipe import ModelInfo, Recipe, TokenPolicy
from calibrate.stats import KVStats
from calibrate.stats_report import anchor_frames

log = logging.getLogger(__name__)


class BudgetError(ValueError):
    """fit.budget_bits is below what 2-bit codes with their parameters need."""


def detect_anchors(stats: KVStats | None, enabled: bool) -> tuple[TokenPolicy, dict]:
    if not enabled:
        return TokenPolicy(sink_frames=0), {"anchors": [], "why": "anchor policy off (fit.anchors=false)"}
    found = sorted({f for layer in anchor_frames(stats) for f in layer}) if stats is not None else []
    if not found:
        return TokenPolicy(sink_frames=0), {"anchors": [], "why": "no frame receives attention far above uniform"}
    sinks = max(found) + 1
    return TokenPolicy(sink_frames=sinks, sink_bits=8), {
        "anchors": found, "why": f"frames {found} get >= 3x uniform attention share: kept as {sinks} sink frame(s) at 8 bits"}


def _gram(stats, kind, layer, sample_HND):
    if stats is not None:
        return stats.tensors[f"{kind}.gram"][layer].float()
    return sample_HND.transpose(1, 2) @ sample_HND


def fit_recipe(info: ModelInfo, traces: list[LayerTrace], stats: KVStats | None, k_samples: torch.Tensor,
               v_samples: torch.Tensor, cfg: FitConfig, window: int, sink_frames: int) -> tuple[Recipe, dict, Recipe]:
    """Fit the recipe; returns it, the fit record (choices, reasons, scores) for its metadata, and
    the recipe before mixed precision (every tensor at 2 bits, no upgrades: a closed-loop candidate)."""
    check_fit_config(cfg, info)
    policy, anchor_note = detect_anchors(stats, cfg.anchors)
    lam = cfg.lambda_temporal
    H = info.num_kv_heads
    states: list[dict[str, TensorState]] = []
    refs = []
    record: dict = {"anchors": anchor_note, "layers": [], "lambda_temporal": lam, "budget_bits": cfg.budget_bits}
    for layer, trace in enumerate(tqdm(traces, desc="fit layers")):
        reference = attention_outputs(trace)
        refs.append(reference)
        k_choice = fit_tensor("k", layer, trace, reference, None, k_samples[layer],
                              _gram(stats, "k", layer, k_samples[layer]), list(cfg.rotations), list(cfg.clip_grid), lam)
        k_state = TensorState(k_choice, k_samples[layer], Knobs((2,) * H))
        v_choice = fit_tensor("v", layer, trace, reference, k_state.hat(trace.k), v_samples[layer],
                              _gram(stats, "v", layer, v_samples[layer]), list(cfg.rotations), list(cfg.clip_grid), lam)
        states.append({"k": k_state, "v": TensorState(v_choice, v_samples[layer], Knobs((2,) * H))})
        record["layers"].append({"k": k_choice.reasons, "v": v_choice.reasons})
    base = assemble(info, states, policy)
    base_bits = bits_per_element(info, base.scheme, window, sink_frames)
    if base_bits > cfg.budget_bits + 1e-9:
        raise BudgetError(f"fit.budget_bits={cfg.budget_bits} is below what 2-bit codes with their parameters need "
                          f"({base_bits:.3f} bits/element for this model and token policy)")
    record["base_bits"] = base_bits
    upgrades = []
    if cfg.mixed_precision:
        allocation, upgrades = allocate(info, traces, refs, states, policy, cfg, window, sink_frames)
        policy = allocation.policy
        for st, knobs in zip(states, allocation.knobs):
            for kind, k in zip(KINDS, knobs):
                st[kind].knobs = k
    record["upgrades"] = upgrades
    record["compensators"] = _compensate(traces, refs, states, policy, cfg) if cfg.comp_rank > 0 else []
    record["logit_correction"] = []
    if cfg.logit_correction:
        record["logit_correction"] = fit_logit_correction(
            traces, [st["k"] for st in states], lambda l: layer_scores(traces[l], refs[l], states[l], policy, lam))
    record["policy"] = asdict(policy)
    recipe = assemble(info, states, policy)
    record["bits_per_element"] = bits_per_element(info, recipe.scheme, window, sink_frames)
    return recipe, record, base


def check_fit_config(cfg: FitConfig, info: ModelInfo) -> None:
    """What the fit config can only be checked against once the model is known."""
    if cfg.comp_rank > info.head_dim:
        raise ValueError(f"config: fit.comp_rank={cfg.comp_rank} is larger than the model's head_dim "
                         f"{info.head_dim} (a rank-r compensator needs r <= head_dim)")


def _compensate(traces, refs, states, policy, cfg: FitConfig) -> list[dict]:
    """Fit a rank-`comp_rank` compensator per (layer, tensor, head) on the calibration samples
    (closed form, compensate.py) and keep it where it lowers the layer's objective."""
    lam = cfg.lambda_temporal
    kept = []
    for layer, trace in enumerate(traces):
        for kind in KINDS:
            s = states[layer][kind]
            before = sum(layer_scores(trace, refs[layer], states[layer], policy, lam))
            spec, tensors = s.spec_tensors()
            downs, ups = [], []
            for h, bits in enumerate(s.head_bits):
                x = s.sample_HND[h]
                x_hat = fake_quant(x.unsqueeze(0), spec, head_params(spec, tensors, h, bits))[0][0]
                R = tensors.get("rotation")
                y, y_hat = (x, x_hat) if R is None else (x @ R[h], x_hat @ R[h])
                down, up = fit_compensator(y, y_hat, cfg.comp_rank)
                downs.append(down)
                ups.append(up)
            s.comp = (torch.stack(downs), torch.stack(ups))
            after = sum(layer_scores(trace, refs[layer], states[layer], policy, lam))
            if after < before:
                kept.append({"layer": layer, "tensor": kind, "rank": cfg.comp_rank, "gain": round(before - after, 6)})
            else:
                s.comp = None
    return kept

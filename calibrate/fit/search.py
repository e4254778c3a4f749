"""Fit a whole recipe: anchors, per-layer choices, then mixed precision under the bit budget.

1. Anchors: frames whose attention share is far above uniform (from the statistics'
   attention-mass-by-frame-index, `stats.anchor_frames`) are kept as sink frames at 8 bits;
   none detected -> no sink precision is spent (the decision is recorded either way).
2. Per layer: K is fitted with V in full precision, then V with the fitted K (fitters.py).
3. Mixed precision: a greedy allocator takes the upgrade with the largest objective gain per
   extra bit until the next one would exceed `budget_bits`. Upgrades:
   - one step of bits (2 -> 3 -> 4 -> 8) for one (layer, tensor, head);
   - `outlier_channels` float16 channels for one (layer, tensor);
   - dense-and-sparse: the largest `sparse_fraction` of one (layer, tensor)'s entries per frame
     kept in float16 (with their index), so ranges fit the bulk of the values;
   - one more *recent* frame in float16 (the token policy: attention mass concentrates on the
     newest frames, so their precision is worth more than that of old ones; priced over all
     layers at once);
   - key frames (`fit.keyframes`): every N-th frame (N from `fit.keyframe_intervals`) at 4 or
     8 bits, priced over all layers; their bytes are per-frame bytes like any other upgrade's
     (the budget counts the worst phase of the sliding window, fitters.bits_per_element). Why
     key frames rather than a periodic high-precision rebuild: see runtime.py.
   Heads are independent in the objective, so one pass per (layer, tensor, step) prices the
   upgrade of every head at once. The objective always models the token policy exactly as
   the runtime applies it (objective.attention_outputs).
4. Optional, on the final bits: the low-rank compensator (`fit.comp_rank`, compensate.py), then
   the key-noise logit correction (`fit.logit_correction`, logit_correction.py); each is kept
   only where it lowers the objective. Both are static recipe tensors (no per-frame bytes).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, astuple, dataclass, replace

import torch
from tqdm import tqdm

from calibrate.config import FitConfig
from calibrate.codec import fake_quant, fake_quant_heads, head_params
from calibrate.fit.compensate import fit_compensator
from calibrate.fit.fitters import Choice, fit_tensor, outlier_channels, with_bits
from calibrate.fit.logit_correction import fit_logit_correction, logit_shift
from calibrate.fit.objective import LayerTrace, attention_outputs, head_scores
from calibrate.memory import bits_per_element
from calibrate.recipe import LayerSpec, ModelInfo, Recipe, Scheme, TokenPolicy
from calibrate.stats import KVStats
from calibrate.stats_report import anchor_frames

log = logging.getLogger(__name__)

NEXT_BITS = {2: 3, 3: 4, 4: 8}
MAX_RECENT_FRAMES = 4
KEYFRAME_BITS = (4, 8)


class BudgetError(ValueError):
    pass


@dataclass
class TensorState:
    choice: Choice
    sample_HND: torch.Tensor
    head_bits: list[int]
    outliers: torch.Tensor | None = None
    sparse: float = 0.0
    comp: tuple[torch.Tensor, torch.Tensor] | None = None  # low-rank compensator, fitted after the bits
    logit_var: torch.Tensor | None = None  # keys: logit correction [H, D] (alpha * sigma^2), fitted last

    def spec_tensors(self):
        return with_bits(self.choice, self.sample_HND, self.head_bits, self.outliers, self.sparse, self.comp,
                         self.logit_var)

    def knobs(self) -> tuple:
        return self.head_bits, self.outliers, self.sparse

    def set_knobs(self, knobs: tuple) -> None:
        self.head_bits, self.outliers, self.sparse = knobs

    def hat(self, x: torch.Tensor, bits: int | None = None, knobs: tuple | None = None) -> torch.Tensor | None:
        """Fake-quantized x (with other `knobs` if given; all heads at `bits` if given; 16 -> None = fp)."""
        if bits is not None and bits >= 16:
            return None
        st = TensorState(self.choice, self.sample_HND, *(knobs or self.knobs()), comp=self.comp)
        spec, tensors = st.spec_tensors()
        return fake_quant_heads(x, spec, tensors, [bits] * len(st.head_bits) if bits else st.head_bits)


def policy_classes(policy: TokenPolicy) -> dict[str, tuple[int, int]]:
    """The token policy's precision classes in use: name -> (count or interval, bits)."""
    classes = {"recent": (policy.recent_frames, policy.recent_bits), "sink": (policy.sink_frames, policy.sink_bits),
               "keyframe": (policy.keyframe_interval, policy.keyframe_bits)}
    return {name: c for name, c in classes.items() if c[0] > 0}


def layer_scores(trace: LayerTrace, reference, st: dict, policy: TokenPolicy, lam: float, override=None) -> list[float]:
    """Per-head objective of one layer; `override` = (kind, knobs) to price an upgrade."""
    classes = policy_classes(policy)
    hats = {}
    for kind in ("k", "v"):
        x = trace.k if kind == "k" else trace.v
        s = st[kind]
        knobs = override[1] if override and override[0] == kind else None
        hats[kind] = {"other": s.hat(x, knobs=knobs)}
        hats[kind].update({name: s.hat(x, bits=bits, knobs=knobs) for name, (_, bits) in classes.items()})
    k_bits = override[1][0] if override and override[0] == "k" else st["k"].head_bits
    out = attention_outputs(
        trace, hats["k"]["other"], hats["v"]["other"],
        **{name: (n, hats["k"][name], hats["v"][name]) for name, (n, _) in classes.items()},
        shift=logit_shift(trace.q, st["k"].logit_var, st["k"].choice.tensors.get("rotation"), k_bits,
                          {name: bits for name, (_, bits) in classes.items()}),
    )
    return head_scores(reference, out).objective(lam).tolist()


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
        k_state = TensorState(k_choice, k_samples[layer], [2] * H)
        v_choice = fit_tensor("v", layer, trace, reference, k_state.hat(trace.k), v_samples[layer],
                              _gram(stats, "v", layer, v_samples[layer]), list(cfg.rotations), list(cfg.clip_grid), lam)
        states.append({"k": k_state, "v": TensorState(v_choice, v_samples[layer], [2] * H)})
        record["layers"].append({"k": k_choice.reasons, "v": v_choice.reasons})
    base = assemble(info, states, policy)
    base_bits = bits_per_element(info, base.scheme, window, sink_frames)
    if base_bits > cfg.budget_bits + 1e-9:
        raise BudgetError(f"fit.budget_bits={cfg.budget_bits} is below what 2-bit codes with their parameters need "
                          f"({base_bits:.3f} bits/element for this model and token policy)")
    record["base_bits"] = base_bits
    upgrades = []
    if cfg.mixed_precision:
        policy, upgrades = _allocate(info, traces, refs, states, policy, cfg, window, sink_frames)
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
        for kind in ("k", "v"):
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


def _layer_options(layer, trace, reference, st, policy, cfg: FitConfig, scores: list[float]) -> list[tuple]:
    """Upgrades of one layer: (description, gain, apply) with apply(states, policy) -> policy."""
    lam = cfg.lambda_temporal
    options = []
    for kind in ("k", "v"):
        s = st[kind]
        bits, oc, sparse = s.knobs()
        stepped = [NEXT_BITS.get(b, b) for b in bits]
        if stepped != bits:
            new = layer_scores(trace, reference, st, policy, lam, (kind, (stepped, oc, sparse)))
            for h in range(len(stepped)):
                if stepped[h] != bits[h]:
                    one = list(bits)
                    one[h] = stepped[h]
                    options.append(({"layer": layer, "tensor": kind, "head": h, "bits": stepped[h]}, scores[h] - new[h],
                                     _set_tensor(layer, kind, (one, oc, sparse))))
        if oc is None and cfg.outlier_channels > 0:
            channels = outlier_channels(s.sample_HND, s.choice.tensors.get("rotation"), cfg.outlier_channels)
            new = layer_scores(trace, reference, st, policy, lam, (kind, (bits, channels, sparse)))
            options.append(({"layer": layer, "tensor": kind, "outliers": channels.tolist()}, sum(scores) - sum(new),
                            _set_tensor(layer, kind, (bits, channels, sparse))))
        if sparse == 0 and cfg.sparse_fraction > 0:
            new = layer_scores(trace, reference, st, policy, lam, (kind, (bits, oc, cfg.sparse_fraction)))
            options.append(({"layer": layer, "tensor": kind, "sparse_fraction": cfg.sparse_fraction},
                            sum(scores) - sum(new), _set_tensor(layer, kind, (bits, oc, cfg.sparse_fraction))))
    return options


def _set_tensor(layer, kind, knobs):
    def apply(states, policy):
        states[layer][kind].set_knobs(knobs)
        return policy
    return apply


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


def _allocate(info, traces, refs, states, policy, cfg: FitConfig, window, sink_frames):
    """Greedy mixed precision: best objective gain per extra bit until the budget is spent."""
    lam = cfg.lambda_temporal
    bits_of = lambda pol: bits_per_element(info, assemble(info, states, pol).scheme, window, sink_frames)
    scores = [layer_scores(t, refs[l], states[l], policy, lam) for l, t in enumerate(traces)]
    options = {l: _layer_options(l, t, refs[l], states[l], policy, cfg, scores[l]) for l, t in enumerate(traces)}
    # per-layer scores under each candidate policy; a layer's entries are dropped when it changes
    policy_scores: dict[tuple, list[float]] = {}
    upgrades = []
    bar = tqdm(desc="mixed precision", unit="upgrade")
    while True:
        current = bits_of(policy)
        best = None
        policy_opts = []
        for cand in _policy_candidates(policy, cfg):
            gain = 0.0
            for l, t in enumerate(traces):
                key = (l, *astuple(cand))
                if key not in policy_scores:
                    policy_scores[key] = layer_scores(t, refs[l], states[l], cand, lam)
                gain += sum(scores[l]) - sum(policy_scores[key])
            what = ("recent_frames", "recent_bits") if cand.recent_frames != policy.recent_frames else \
                ("keyframe_interval", "keyframe_bits")
            policy_opts.append(({k: getattr(cand, k) for k in what}, gain, lambda states, policy, cand=cand: cand))
        for what, gain, apply in [o for opts in options.values() for o in opts] + policy_opts:
            if gain <= 0:
                continue
            saved = [(st["k"].knobs(), st["v"].knobs()) for st in states]
            cost = bits_of(apply(states, policy)) - current
            for st, (k_knobs, v_knobs) in zip(states, saved):
                st["k"].set_knobs(k_knobs)
                st["v"].set_knobs(v_knobs)
            if cost <= 0 or current + cost > cfg.budget_bits + 1e-9:
                continue
            if best is None or gain / cost > best[0]:
                best = (gain / cost, what, gain, apply, cost)
        if best is None:
            break
        _, what, gain, apply, cost = best
        policy = apply(states, policy)
        # a tensor upgrade changes one layer's scores; a policy upgrade changes every layer's
        changed = [what["layer"]] if "layer" in what else list(range(len(traces)))
        policy_scores = {key: v for key, v in policy_scores.items() if key[0] not in changed}
        for l in changed:
            scores[l] = layer_scores(traces[l], refs[l], states[l], policy, lam)
            options[l] = _layer_options(l, traces[l], refs[l], states[l], policy, cfg, scores[l])
        upgrades.append({**what, "gain": round(gain, 6), "bits_cost": round(cost, 4)})
        bar.update(1)
    bar.close()
    return policy, upgrades

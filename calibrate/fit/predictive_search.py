"""Fit a recipe of predictive codes (`fit.code=predictive`, the default).

Every layer's K and V get a predictive transform code (quant/predictive.py), fitted from the
streaming statistics and scored on the teacher-forced objective (objective.py) over the traced
calibration frames, coded in sequence as the runtime codes them (chain included):

1. **Statistics** (stats.py): per head the mean and covariance of the cached vectors and of
   their frame-to-frame change. Keys are taken *before* the rotary encoding when the model
   gives its rotary coordinates (`fit.pre_rotary`): a moving camera rotates post-rotary keys
   from frame to frame, which hides both the low-dimensional structure (post-rotary keys need
   ~35 principal components for 90% of their energy, pre-rotary ~5) and the temporal
   redundancy the code exploits.
2. **Per tensor** (K with V in full precision, then V with the fitted K): each head's intra and
   inter step multipliers from `fit.intra_mults` x `fit.inter_mults`, the pair with the lowest
   objective per head (heads are independent in the objective), at the base width; each axis
   grows past its top while a head chooses it (up to `fit.intra_mult_max` / `fit.inter_mult_max`).
3. **Mixed precision**: every head starts at the base width (the widest up to `fit.base_bits_max`
   that fits the budget); a greedy allocator adds `fit.bits_step` bits per component to one head of
   one tensor at a time, the upgrade with the largest objective gain per budgeted bit, until the
   next would exceed `fit.budget_bits` (memory.py counts codes, modes, anchors and coordinates).
4. **Closed loop**, off by default (calibration.fit, select.py): with `fit.closed_loop_scales`
   other than [1.0], the recipe with its inter steps scaled by each rolls out on calibration
   trajectories and the best one ships. It did not earn its place: on held-out rollouts it
   cost 0.8 dB late on WanWorld and gained 0.06 dB on TinyWorld (artifacts/benchmarks/fit*.md).
"""

from __future__ import annotations

import logging

from dataclasses import dataclass, field, replace
from itertools import product

import torch
from torch import Tensor
from tqdm import tqdm

from calibrate import predictive_roles
from calibrate.cache import kept_frames
from calibrate.config import FitConfig
from calibrate.distributed import Shard
from calibrate.fit.objective import LayerTrace, attention_outputs, head_scores
from calibrate.fit.predictive import fit_head
from calibrate.memory import (bits_per_element, fp16_cache_bytes, predicted_cache_bytes, predictive_head_bytes,
                              steady_phases, steady_state_frames)
from calibrate.quant.predictive import MAX_BITS, fake_quant_sequence
from calibrate.recipe import LayerSpec, ModelInfo, Recipe, Scheme, TensorSpec, TokenPolicy
from calibrate.stats import KVStats

log = logging.getLogger(__name__)
KINDS = ("k", "v")
MAX_AVG_BITS = 4.0
MIN_BASE_BITS = 1.0  # the narrowest base width `_base_bits` tries (bits per component)
GRID_GROWTH = 1.3  # each step past the top of fit.intra_mults / fit.inter_mults multiplies it by this


class BudgetError(ValueError):
    """fit.budget_bits cannot hold even the coarsest predictive code."""


@dataclass(frozen=True)
class HeadCode:
    """What the search sets for one head of one tensor."""

    avg_bits: float
    intra_mult: float
    inter_mult: float


def moments(stats: KVStats, kind: str, layer: int) -> tuple[Tensor, Tensor, Tensor]:
    """(mean [H, D], covariance [H, D, D], frame-to-frame change second moment [H, D, D]) of
    `kind` ("k", "kpre" or "v") in `layer`, float64."""
    t = stats.tensors
    n = max(int(t[f"{kind}.count"][layer]), 1)
    mean = t[f"{kind}.sum"][layer] / n
    cov = t[f"{kind}.gram"][layer] / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    delta = t[f"{kind}.delta_gram"][layer] / max(int(t[f"{kind}.delta_count"][layer]), 1)
    return mean, cov, delta


@dataclass
class TensorFit:
    """One (layer, K or V): its statistics and the per-head choices."""

    kind: str
    stat_kind: str  # "kpre", "k" or "v"
    mean: Tensor
    cov: Tensor
    delta: Tensor
    heads: list[HeadCode]
    _cache: dict = field(default_factory=dict, repr=False)  # (head, HeadCode) -> PredictiveParams

    def params(self, cfg: FitConfig, heads: list[HeadCode] | None = None):
        out = []
        for h, c in enumerate(heads or self.heads):
            if (h, c) not in self._cache:
                self._cache[(h, c)] = fit_head(
                    self.mean[h], self.cov[h], self.delta[h], c.avg_bits, intra_mult=c.intra_mult,
                    inter_mult=c.inter_mult, clip_sd=cfg.anchor_sd, temporal=cfg.temporal,
                    allocation=cfg.bit_allocation,
                    rotation_DD=None if cfg.basis == "pca" else torch.eye(self.mean.shape[-1]))
            out.append(self._cache[(h, c)])
        return out

    def spec(self, cfg: FitConfig, rotary_coords: int) -> tuple[TensorSpec, dict[str, Tensor]]:
        roles = predictive_roles.stack_heads(self.params(cfg))
        spec = TensorSpec(bits=2, kind="predictive", rotation="learned", rotary_coords=rotary_coords,
                          token_bits=roles["channel_bits"].sum(-1).tolist(),
                          anchor_token_bits=roles["anchor_bits"].sum(-1).tolist(), temporal=cfg.temporal)
        return spec, roles


def reconstruct(trace: LayerTrace, fit: TensorFit, cfg: FitConfig, heads: list[HeadCode] | None = None,
                only: int | None = None) -> Tensor:
    """The tensor's frames [B, H, F, T, D] as the runtime reconstructs them (keys post-rotary);
    with `only` = h, head h alone from a one-head `trace` (`Trace.layer(..., heads=...)`): [B, 1, F, T, D]."""
    x = trace.v if fit.kind == "v" else (trace.k_pre if fit.stat_kind == "kpre" else trace.k)
    params = fit.params(cfg, heads)
    pairs = list(enumerate(params)) if only is None else [(0, params[only])]
    out = torch.stack([fake_quant_sequence(x[:, i], p.to(x.device), intra_only=not cfg.temporal) for i, p in pairs], dim=1)
    return trace.rotate(out) if fit.stat_kind == "kpre" else out


def head_objective(trace: LayerTrace, reference: Tensor, k_hat: Tensor | None, v_hat: Tensor | None, lam: float) -> Tensor:
    """Per-head objective [H] of one layer with these reconstructions (None = full precision)."""
    return head_scores(reference, attention_outputs(trace, k_hat, v_hat)).objective(lam)


def assemble(info: ModelInfo, fits: list[dict[str, TensorFit]], cfg: FitConfig, rotary_coords: int,
             name: str = "ours") -> Recipe:
    layers, tensors = [], {}
    for i, pair in enumerate(fits):
        specs = {}
        for kind in KINDS:
            spec, roles = pair[kind].spec(cfg, rotary_coords if kind == "k" and pair[kind].stat_kind == "kpre" else 0)
            specs[kind] = spec
            tensors.update({f"layers.{i}.{kind}.{role}": t for role, t in roles.items()})
        layers.append(LayerSpec(**specs))
    policy = TokenPolicy(sink_frames=0, recent_frames=0)
    notes = "predictive transform codes fitted by calibrate (see metadata 'fit')"
    return Recipe(info, Scheme(name=name, layers=layers, policy=policy, notes=notes), tensors)


def fit_predictive(info: ModelInfo, traces: list[LayerTrace], stats: KVStats, cfg: FitConfig, window: int,
                   sink_frames: int, rotary_coords: int,
                   shard: Shard | None = None) -> tuple[Recipe, dict, list[dict[str, TensorFit]]]:
    """Fit every layer's predictive codes and spend the budget; returns (recipe, fit record, the
    per-tensor fits that `rescaled` turns into closed-loop candidates).

    `rotary_coords` = coordinates the model's rotary gives per frame (0: none, keys post-rotary).
    With a `shard` (several processes) each layer's objective work runs on its owner, which holds
    that layer's trace, and the results are shared: every rank returns the same recipe.
    """
    shard = shard or Shard()
    lam = cfg.lambda_temporal
    pre = cfg.pre_rotary and rotary_coords > 0
    record: dict = {"code": "predictive", "lambda_temporal": lam, "budget_bits": cfg.budget_bits,
                    "keys": "pre-rotary" if pre else "post-rotary", "temporal": cfg.temporal, "basis": cfg.basis,
                    "bit_allocation": cfg.bit_allocation, "layers": []}
    if cfg.pre_rotary and not rotary_coords:
        record["keys_why"] = "the model's rotary gives no coordinates: keys are coded post-rotary"
    base_bits = _base_bits(info, cfg, rotary_coords if pre else 0, window, sink_frames, traces, stats, pre)
    fits, refs = [], [None] * info.num_layers
    for layer in tqdm(range(info.num_layers), desc="fit layers", unit="layer"):
        entry = None
        if shard.owns(layer):
            trace = traces[layer]
            refs[layer] = attention_outputs(trace)
            entry = _layer_steps(layer, trace, refs[layer], stats, cfg, pre, base_bits)
        entry = shard.share(layer, entry)
        fits.append({kind: TensorFit(kind, _stat_kind(kind, pre), *moments(stats, _stat_kind(kind, pre), layer),
                                     [HeadCode(base_bits, a, b) for a, b in zip(entry[kind]["intra_mult"],
                                                                                 entry[kind]["inter_mult"])])
                     for kind in KINDS})
        record["layers"].append(entry)
    for line in grid_edges(record["layers"], cfg):
        log.warning(line)
    recipe = assemble(info, fits, cfg, rotary_coords)
    record["base_width"], record["base_bits"] = base_bits, bits_per_element(info, recipe.scheme, window, sink_frames)
    record["upgrades"] = _allocate(info, traces, refs, fits, cfg, window, sink_frames, rotary_coords, shard) \
        if cfg.mixed_precision else []
    recipe = assemble(info, fits, cfg, rotary_coords)
    record["bits_per_element"] = bits_per_element(info, recipe.scheme, window, sink_frames)
    record["head_bits"] = {f"{i}.{kind}": [c.avg_bits for c in pair[kind].heads] for i, pair in enumerate(fits)
                           for kind in KINDS}
    return recipe, record, fits


def _stat_kind(kind: str, pre: bool) -> str:
    return "kpre" if (kind == "k" and pre) else kind


def _layer_steps(layer: int, trace: LayerTrace, reference: Tensor, stats: KVStats, cfg: FitConfig, pre: bool,
                 base_bits: float) -> dict:
    """One layer's step multipliers per head: K with V in full precision, then V with the fitted K,
    each the pair of `fit.intra_mults` x `fit.inter_mults` with the lowest objective per head.

    Each axis grows past its top (x `GRID_GROWTH`, up to `fit.intra_mult_max` / `fit.inter_mult_max`)
    while some head's best pair sits at that top: no fixed grid knows how wide a model's tails are
    (WanWorld's heads took 1.7, the old intra grid's top, in all 16 heads, and 3.0 in 12 of 16 with
    the grid widened to 3.0; each widening gained in the rollout, `wanworld_intra_grid.md`). The
    inter axis's cap is its top by default: it does not grow."""
    lam = cfg.lambda_temporal
    entry, k_hat = {}, None
    for kind in KINDS:
        fit = TensorFit(kind, _stat_kind(kind, pre), *moments(stats, _stat_kind(kind, pre), layer), [])
        H = fit.mean.shape[0]
        axes, caps, scores = (list(cfg.intra_mults), list(cfg.inter_mults)), (cfg.intra_mult_max, cfg.inter_mult_max), {}
        while True:
            for pair in product(*axes):
                if pair not in scores:
                    fit.heads = [HeadCode(base_bits, *pair)] * H
                    hat = reconstruct(trace, fit, cfg)
                    scores[pair] = head_objective(trace, reference, hat if kind == "k" else k_hat,
                                                  hat if kind == "v" else None, lam)
            grid = list(scores)
            best = torch.stack([scores[p] for p in grid]).argmin(0).tolist()
            grown = False
            for axis, (values, cap) in enumerate(zip(axes, caps)):
                wider = round(max(values) * GRID_GROWTH, 2)
                if wider <= cap and any(grid[i][axis] == max(values) for i in best):
                    values.append(wider)
                    grown = True
            if not grown:
                break
        if kind == "k":
            fit.heads = [HeadCode(base_bits, *grid[i]) for i in best]
            k_hat = reconstruct(trace, fit, cfg)
        entry[kind] = {"intra_mult": [grid[i][0] for i in best], "inter_mult": [grid[i][1] for i in best],
                       "why": "lowest teacher-forced objective per head over the grid (fit.intra_mults x "
                              "fit.inter_mults, each grown while a head chose its top, up to its cap)",
                       "grid": [list(p) for p in grid],
                       "scores": [[round(float(scores[p][h]), 6) for h in range(H)] for p in grid]}
    return entry


def grid_edges(layers: list[dict], cfg: FitConfig) -> list[str]:
    """One line per step axis whose largest searched value most heads chose: the best step may lie
    beyond it (each axis grows by itself up to its cap, `fit.intra_mult_max` / `fit.inter_mult_max`;
    the closed loop then scales the inter steps)."""
    out = []
    for axis, role in enumerate(("intra_mult", "inter_mult")):
        chosen = at_top = 0
        values: set[float] = set()
        for entry in layers:
            for kind in KINDS:
                searched = {p[axis] for p in entry[kind]["grid"]}
                values |= searched
                chosen += len(entry[kind][role])
                at_top += sum(m == max(searched) for m in entry[kind][role])
        if len(values) > 1 and chosen and 2 * at_top > chosen:
            cap = cfg.intra_mult_max if role == "intra_mult" else cfg.inter_mult_max
            fix = f"raise fit.{role}_max (now {cap})"
            out.append(f"fit: {at_top} of {chosen} heads chose the largest {role} searched "
                       f"(up to {max(values)}): the best step may lie beyond it; {fix}")
    return out


def budget_floor(info: ModelInfo, cfg: FitConfig, window: int, sink_frames: int) -> float:
    """Bits per element below which no predictive recipe of this model and cache fits, from the
    memory model alone (no statistics), so a budget under it is refused before any replay.

    The cheapest spec the search can make: every head at the narrowest base width (1 bit per
    component: D code bits per token), with the mode bit per token, and anchors no wider than
    any fitted one can be. An anchor holds each coded component at >= 1 bit more than its code
    (it spans the 2^b - 1 intra levels: ceil(log2(2 (2^b - 1) + 1)) = b + 1) and at most
    `MAX_BITS` bits of code go to one component, so D code bits make at least D + ceil(D / MAX_BITS)
    anchor bits. Keys' rotary coordinates (unknown before the replay) are left out. The exact
    check on the fitted statistics stays with the fit (`BudgetError`).
    """
    D = info.head_dim
    code = int(round(MIN_BASE_BITS * D))
    anchor = code + -(-code // MAX_BITS)
    spec = TensorSpec(bits=2, kind="predictive", rotation="learned", token_bits=[code] * info.num_kv_heads,
                      anchor_token_bits=[anchor] * info.num_kv_heads, temporal=cfg.temporal)
    scheme = Scheme(name="floor", layers=[LayerSpec(k=spec, v=spec) for _ in range(info.num_layers)],
                    policy=TokenPolicy(sink_frames=0, recent_frames=0))
    return bits_per_element(info, scheme, window, sink_frames)


def _base_bits(info, cfg, rotary_coords, window, sink_frames, traces, stats, pre) -> float:
    """The widest base width (`fit.base_bits_max` down to 1.0 bits per component, in quarter bits)
    whose recipe fits the budget whatever step multipliers the search then picks (the smallest
    steps need the widest anchors). The allocator spends the rest where the objective gains most,
    so a narrow base lets it leave a tensor narrower than the base would (TinyWorld's and
    WanWorld's keys: README, Fitting)."""
    finest = HeadCode(0.0, min(cfg.intra_mults), min(cfg.inter_mults) * min(min(cfg.closed_loop_scales), 1.0))
    for avg in [b / 4 for b in range(int(cfg.base_bits_max * 4), int(MIN_BASE_BITS * 4) - 1, -1)]:
        fits = [{kind: TensorFit(kind, "kpre" if kind == "k" and pre else kind,
                                 *moments(stats, "kpre" if kind == "k" and pre else kind, l),
                                 [replace(finest, avg_bits=avg)] * info.num_kv_heads) for kind in KINDS}
                for l in range(info.num_layers)]
        if bits_per_element(info, assemble(info, fits, cfg, rotary_coords).scheme, window, sink_frames) <= cfg.budget_bits + 1e-9:
            return avg
    raise BudgetError(f"config: fit.budget_bits={cfg.budget_bits} is below what a predictive code of 1 bit per "
                      f"component with its anchors needs for this model and window")


def _allocate(info, traces, refs, fits, cfg: FitConfig, window, sink_frames, rotary_coords,
              shard: Shard | None = None) -> list[dict]:
    """Greedy: +`fit.bits_step` bits per component for the head with the best objective gain per bit.

    Priced incrementally. Every pending offer is a (gain, byte change) pair in an [L, 2, H] table:
    an upgrade of one head changes the cache's bytes by that head's own term
    (`memory.predictive_head_bytes`), and the objective of a head depends on that head's K and V
    alone. So a layer is priced once with three passes over all its heads (current codes, every K
    head one step up, every V head one step up; four reconstructions), and after an upgrade only
    the upgraded head's two offers change: three passes over that one head. Per upgrade the work
    is 1/H of a layer's, and O(L x H) arithmetic on the table. Bits are computed from the exact
    byte total as `memory.bits_per_element` does (16 * bytes / fp16 bytes at steady state; a
    predictive recipe has one steady phase), so the choices and ties are those of pricing every
    offer with the whole memory model: the first best offer in (layer, K before V, head) order
    wins. With a `shard`, a layer's owner prices it and shares the table rows.
    """
    shard = shard or Shard()
    lam, step = cfg.lambda_temporal, cfg.bits_step
    L, H, T, D = info.num_layers, info.num_kv_heads, info.tokens_per_frame, info.head_dim
    n0 = steady_state_frames(window, sink_frames)
    kept = kept_frames(n0, window, sink_frames)
    fp16 = fp16_cache_bytes(info, n0, window, sink_frames)
    scheme = assemble(info, fits, cfg, rotary_coords).scheme
    assert steady_phases(scheme) == 1  # predictive codes: no key frames, no spans
    total = predicted_cache_bytes(info, scheme, n0, window, sink_frames)
    gain = torch.full((L, len(KINDS), H), float("nan"), dtype=torch.float64)  # nan: no offer
    delta = torch.zeros((L, len(KINDS), H), dtype=torch.int64)  # bytes the upgrade adds

    def head_bytes(p) -> int:
        return predictive_head_bytes(int(p.bits_D.sum()), int(p.anchor_bits_D.sum()), cfg.temporal, kept, n0, 0, 1,
                                     T, D)

    def ups(layer: int) -> dict[str, list[HeadCode]]:
        return {kind: [replace(c, avg_bits=min(c.avg_bits + step, MAX_AVG_BITS)) for c in fits[layer][kind].heads]
                for kind in KINDS}

    def fill(layer: int, heads: list[int], current: Tensor, new: dict[str, Tensor], up: dict[str, list[HeadCode]]):
        for i, kind in enumerate(KINDS):
            fit = fits[layer][kind]
            now, then = fit.params(cfg), fit.params(cfg, up[kind])
            for j, h in enumerate(heads):
                offered = up[kind][h] != fit.heads[h]
                gain[layer, i, h] = float(current[j] - new[kind][j]) if offered else float("nan")
                delta[layer, i, h] = head_bytes(then[h]) - head_bytes(now[h]) if offered else 0

    def price_layer(layer: int) -> None:
        """Every head's two offers against the layer's current codes (three passes over all heads)."""
        if shard.owns(layer):
            trace, ref, up = traces[layer], refs[layer], ups(layer)
            cur = {kind: reconstruct(trace, fits[layer][kind], cfg) for kind in KINDS}
            hat = {kind: reconstruct(trace, fits[layer][kind], cfg, up[kind]) for kind in KINDS}
            fill(layer, list(range(H)), head_objective(trace, ref, cur["k"], cur["v"], lam),
                 {"k": head_objective(trace, ref, hat["k"], cur["v"], lam),
                  "v": head_objective(trace, ref, cur["k"], hat["v"], lam)}, up)
        shard.share_rows(layer, gain[layer], delta[layer])

    def price_head(layer: int, h: int) -> None:
        """Head h's two offers after its upgrade (three passes over that head alone)."""
        if shard.owns(layer):
            trace, ref, up = traces.head(layer, h), refs[layer][:, h:h + 1], ups(layer)
            cur = {kind: reconstruct(trace, fits[layer][kind], cfg, only=h) for kind in KINDS}
            hat = {kind: reconstruct(trace, fits[layer][kind], cfg, up[kind], only=h) for kind in KINDS}
            fill(layer, [h], head_objective(trace, ref, cur["k"], cur["v"], lam),
                 {"k": head_objective(trace, ref, hat["k"], cur["v"], lam),
                  "v": head_objective(trace, ref, cur["k"], hat["v"], lam)}, up)
        shard.share_rows(layer, gain[layer], delta[layer])

    for layer in tqdm(range(L), desc="mixed precision: price", unit="layer"):
        price_layer(layer)
    taken = []
    bar = tqdm(desc="mixed precision: bits spent", total=round(max(cfg.budget_bits - 16.0 * total / fp16, 0.0), 4),
               unit="bit")
    while True:
        current = 16.0 * total / fp16
        cost = 16.0 * (total + delta).double() / fp16 - current
        ok = (gain > 0) & (cost > 0) & (current + cost <= cfg.budget_bits + 1e-9)
        if not bool(ok.any()):
            break
        best = int(torch.where(ok, gain / cost, float("-inf")).flatten().argmax())
        layer, i, h = best // (len(KINDS) * H), (best // H) % len(KINDS), best % H
        heads = fits[layer][KINDS[i]].heads
        heads[h] = replace(heads[h], avg_bits=heads[h].avg_bits + step)
        g, c = float(gain[layer, i, h]), float(cost[layer, i, h])
        total += int(delta[layer, i, h])
        price_head(layer, h)
        taken.append({"layer": layer, "tensor": KINDS[i], "head": h, "avg_bits": heads[h].avg_bits,
                      "gain": round(g, 6), "bits_cost": round(c, 4)})
        bar.update(round(c, 4))
    bar.close()
    assert total == predicted_cache_bytes(info, assemble(info, fits, cfg, rotary_coords).scheme, n0, window, sink_frames)
    return taken


def rescaled(info: ModelInfo, fits: list[dict[str, TensorFit]], cfg: FitConfig, rotary_coords: int, scale: float,
             name: str) -> Recipe:
    """The fitted recipe with every inter step multiplier scaled (a closed-loop candidate)."""
    scaled = [{kind: replace(f, heads=[replace(c, inter_mult=c.inter_mult * scale) for c in f.heads], _cache={})
               for kind, f in pair.items()} for pair in fits]
    return assemble(info, scaled, cfg, rotary_coords, name)

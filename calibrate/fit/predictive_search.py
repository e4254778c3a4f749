"""Fit a recipe of predictive codes (`fit.code=predictive`, the default).

Every layer's K and V get a predictive transform code (quant/predictive.py), fitted from the
streaming statistics and scored on the teacher-forced objective (objective.py) over the traced
calibration frames, coded in sequence as the runtime codes them (chain included):

1. **Statistics** (stats.py): per head the mean and covariance of the cached vectors and of
   their frame-to-frame change. Keys are taken *before* the rotary encoding when the model
   gives its rotary coordinates (`fit.pre_rotary`): a moving camera rotates post-rotary keys
   from frame to frame, which hides both the low-dimensional structure (post-rotary keys need
   ~35 principal components for 90% of their energy, pre-rotary ~5) and the temporal
   redundancy the code exploits. With `fit.anchor_peak_mult` > 0, also each component's largest
   deviation in the trace (its frames past the sink, in the head's basis): the anchors reach that
   multiple of it where that is past `fit.anchor_sd` deviations (fit/predictive.py, step 4).
2. **Per tensor** (K with V in full precision, then V with the fitted K): each head's intra and
   inter step multipliers from `fit.intra_mults` x `fit.inter_mults`, the pair with the lowest
   objective per head (heads are independent in the objective), at the base width; each axis
   grows past its top while a head chooses it (up to `fit.intra_mult_max` / `fit.inter_mult_max`).
3. **Mixed precision**: every head starts at the base width (the widest up to `fit.base_bits_max`
   that fits the budget); a greedy allocator adds `fit.bits_step` bits per component to one head of
   one tensor at a time, the upgrade with the largest objective gain per budgeted bit, until the
   next would exceed `fit.budget_bits` (memory.py counts codes, modes, anchors and coordinates).
4. **Steps at the final widths** (`fit.refine_steps`): step 2 again, each head at the width the
   allocator left it. The best multiplier of a step depends on the width: the Gaussian step
   table (fit/predictive.py) assumes Gaussian tails, and the heavier tails of real K/V want a
   wider grid the more levels it has. Steps searched at the base width and kept after the
   allocator tripled a head's bits were too fine there, and the rollout showed it (docs/results.md,
   "Each head's steps are searched again"). A layer whose new steps would cross the budget (anchors widen) keeps the old ones;
   a tensor the allocator left at the base width keeps its first answer without a second search.
5. **Closed loop**, off by default (calibration.fit, select.py): with `fit.closed_loop_scales`
   other than [1.0], the recipe with its inter steps scaled by each rolls out on calibration
   trajectories and the best one ships. It did not earn its place: on held-out rollouts it
   cost 0.8 dB late on WanWorld and gained 0.06 dB on TinyWorld (artifacts/benchmarks/fit*.md).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from itertools import product

import torch
from torch import Tensor
from tqdm import tqdm

from calibrate.cache import kept_frames
from calibrate.config import FitConfig
from calibrate.distributed import Shard
from calibrate.fit.objective import LayerTrace, attention_outputs
from calibrate.fit.predictive_codes import (KINDS, HeadCode, TensorFit, assemble, head_objective, moments, reconstruct,
                                            stat_kind, tensor_fit, trace_peaks, traced)
from calibrate.memory import (bits_per_element, fp16_cache_bytes, predicted_cache_bytes, predictive_head_bytes,
                              steady_phases, steady_state_frames)
from calibrate.quant.predictive import MAX_BITS, reference_bits
from calibrate.recipe import LayerSpec, ModelInfo, Recipe, Scheme, TensorSpec, TokenPolicy
from calibrate.stats import KVStats

log = logging.getLogger(__name__)
MAX_AVG_BITS = 4.0
MIN_BASE_BITS = 1.0  # the narrowest base width `_base_bits` tries (bits per component)
GRID_GROWTH = 1.3  # each step past the top of fit.intra_mults / fit.inter_mults multiplies it by this


class BudgetError(ValueError):
    """fit.budget_bits cannot hold even the coarsest predictive code."""


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
    if not sink_frames:  # no sink frame to hold in the sink code
        cfg = replace(cfg, sink_bits=0.0)
    lam = cfg.lambda_temporal
    pre = cfg.pre_rotary and rotary_coords > 0
    record: dict = {"code": "predictive", "lambda_temporal": lam, "budget_bits": cfg.budget_bits,
                    "keys": "pre-rotary" if pre else "post-rotary", "temporal": cfg.temporal, "basis": cfg.basis,
                    "bit_allocation": cfg.bit_allocation, "sink_bits": cfg.sink_bits, "anchor_sd": cfg.anchor_sd,
                    "anchor_peak_mult": cfg.anchor_peak_mult, "layers": []}
    if cfg.pre_rotary and not rotary_coords:
        record["keys_why"] = "the model's rotary gives no coordinates: keys are coded post-rotary"
    peaks = _peaks(info, traces, stats, cfg, pre, shard)
    try:
        base_bits = _base_bits(info, cfg, rotary_coords if pre else 0, window, sink_frames, peaks, stats, pre)
    except BudgetError:
        if not cfg.sink_bits:
            raise
        # a short window holds few frames to share the sink code's bits: fit without it
        why = (f"fit.sink_bits={cfg.sink_bits}: the sink code leaves no predictive code within "
               f"fit.budget_bits={cfg.budget_bits} at window {window}; fitted without it")
        log.warning(why)
        cfg = replace(cfg, sink_bits=0.0)
        record["sink_bits"], record["sink_why"] = 0.0, why
        base_bits = _base_bits(info, cfg, rotary_coords if pre else 0, window, sink_frames, peaks, stats, pre)
    fits, refs = [], [None] * info.num_layers
    for layer in tqdm(range(info.num_layers), desc="fit layers", unit="layer"):
        entry = None
        if shard.owns(layer):
            trace = traces[layer]
            refs[layer] = attention_outputs(trace)
            entry = _layer_steps(layer, trace, refs[layer], stats, cfg, pre, {kind: [base_bits] * info.num_kv_heads
                                                                                for kind in KINDS}, peaks[layer])
        entry = shard.share(layer, entry)
        fits.append({kind: tensor_fit(stats, kind, pre, layer, [HeadCode(base_bits, a, b) for a, b in
                                                                zip(entry[kind]["intra_mult"], entry[kind]["inter_mult"])],
                                      peaks[layer][kind])
                     for kind in KINDS})
        record["layers"].append(entry)
    for line in grid_edges(record["layers"], cfg):
        log.warning(line)
    recipe = assemble(info, fits, cfg, rotary_coords)
    record["base_width"], record["base_bits"] = base_bits, bits_per_element(info, recipe.scheme, window, sink_frames)
    record["upgrades"] = _allocate(info, traces, refs, fits, cfg, window, sink_frames, rotary_coords, shard) \
        if cfg.mixed_precision else []
    if cfg.refine_steps and record["upgrades"]:
        record["refined"] = _refine_steps(info, traces, refs, fits, stats, cfg, pre, rotary_coords, window,
                                          sink_frames, shard, record["layers"], base_bits)
    recipe = assemble(info, fits, cfg, rotary_coords)
    record["bits_per_element"] = bits_per_element(info, recipe.scheme, window, sink_frames)
    record["head_bits"] = {f"{i}.{kind}": [c.avg_bits for c in pair[kind].heads] for i, pair in enumerate(fits)
                           for kind in KINDS}
    return recipe, record, fits


def _refine_steps(info, traces, refs, fits, stats, cfg: FitConfig, pre: bool, rotary_coords: int, window: int,
                  sink_frames: int, shard: Shard, base: list[dict], base_bits: float) -> list[dict]:
    """Search every head's step multipliers again at the width the allocator left it (step 4 of
    the module docstring), layer by layer; a layer whose new steps would take the recipe past
    `fit.budget_bits` (they change the anchors' widths) keeps its base-width steps.

    A tensor whose heads all kept the base width has its answer in `base` (the first search, same
    inputs): it is reused, not searched again (on TinyWorld: every key)."""
    out = []
    for layer in tqdm(range(info.num_layers), desc="steps at the final widths", unit="layer"):
        entry = None
        if shard.owns(layer):
            widths = {kind: [c.avg_bits for c in fits[layer][kind].heads] for kind in KINDS}
            known = {}
            for kind in KINDS:
                if kind == "v" and "k" not in known:
                    break  # V's search reads the fitted K: new K steps make it a new question
                if all(w == base_bits for w in widths[kind]):
                    known[kind] = base[layer][kind]
            entry = _layer_steps(layer, traces[layer], refs[layer], stats, cfg, pre, widths,
                                 {kind: fits[layer][kind].peak for kind in KINDS}, known)
        entry = shard.share(layer, entry)
        before = {kind: fits[layer][kind].heads for kind in KINDS}
        for kind in KINDS:
            fits[layer][kind].heads = [replace(c, intra_mult=a, inter_mult=b) for c, a, b in
                                       zip(before[kind], entry[kind]["intra_mult"], entry[kind]["inter_mult"])]
        scheme = assemble(info, fits, cfg, rotary_coords).scheme
        entry["kept"] = bits_per_element(info, scheme, window, sink_frames) <= cfg.budget_bits + 1e-9
        if not entry["kept"]:
            for kind in KINDS:
                fits[layer][kind].heads = before[kind]
        out.append(entry)
    return out


def _layer_steps(layer: int, trace: LayerTrace, reference: Tensor, stats: KVStats, cfg: FitConfig, pre: bool,
                 widths: dict[str, list[float]], peaks: dict[str, Tensor | None],
                 known: dict[str, dict] | None = None) -> dict:
    """One layer's step multipliers per head at `widths` (bits per component per head): K with V in
    full precision, then V with the fitted K, each the pair of `fit.intra_mults` x `fit.inter_mults`
    with the lowest objective per head. A kind in `known` takes that entry instead of a search;
    `peaks` are the layer's trace peaks per kind (`_peaks`).

    Each axis grows past its top (x `GRID_GROWTH`, up to `fit.intra_mult_max` / `fit.inter_mult_max`)
    while some head's best pair sits at that top: no fixed grid knows how wide a model's tails are
    (WanWorld's heads took 1.7, the old intra grid's top, in all 16 heads, and 3.0 in 12 of 16 with
    the grid widened to 3.0; each widening gained in the rollout, `wanworld_intra_grid.md`). The
    inter axis's cap is its top by default: it does not grow."""
    lam, known = cfg.lambda_temporal, known or {}
    entry, k_hat = {}, None
    for kind in KINDS:
        fit = tensor_fit(stats, kind, pre, layer, [], peaks[kind])
        H = fit.mean.shape[0]
        if kind in known:
            entry[kind] = known[kind]
            if kind == "k":
                fit.heads = [HeadCode(w, a, b) for w, a, b in
                             zip(widths[kind], known[kind]["intra_mult"], known[kind]["inter_mult"])]
                k_hat = reconstruct(trace, fit, cfg)
            continue
        axes, caps, scores = (list(cfg.intra_mults), list(cfg.inter_mults)), (cfg.intra_mult_max, cfg.inter_mult_max), {}
        while True:
            for pair in product(*axes):
                if pair not in scores:
                    fit.heads = [HeadCode(w, *pair) for w in widths[kind]]
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
            fit.heads = [HeadCode(w, *grid[i]) for w, i in zip(widths[kind], best)]
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


def _peaks(info: ModelInfo, traces, stats: KVStats, cfg: FitConfig, pre: bool, shard: Shard) -> list[dict]:
    """Per layer and kind, the trace's largest |u_i| per head and component [H, D] (`trace_peaks`)
    when `fit.anchor_peak_mult` > 0 (None otherwise): computed by each layer's owner, shared."""
    if cfg.anchor_peak_mult <= 0:
        return [dict.fromkeys(KINDS) for _ in range(info.num_layers)]
    out = []
    for layer in range(info.num_layers):
        entry = None
        if shard.owns(layer):
            entry = {}
            for kind in KINDS:
                stat = stat_kind(kind, pre)
                mean, cov, delta, _ = moments(stats, stat, layer)
                entry[kind] = trace_peaks(traced(traces[layer], kind, stat), mean, cov, delta, cfg.basis,
                                          traces[layer].sink_frames).tolist()
        entry = shard.share(layer, entry)
        out.append({kind: torch.tensor(entry[kind], dtype=torch.float32) for kind in KINDS})
    return out


def _base_bits(info, cfg, rotary_coords, window, sink_frames, peaks, stats, pre) -> float:
    """The widest base width (`fit.base_bits_max` down to 1.0 bits per component, in quarter bits)
    whose recipe fits the budget whatever step multipliers the search then picks (the smallest
    steps need the widest anchors). The allocator spends the rest where the objective gains most,
    so a narrow base lets it leave a tensor narrower than the base would (TinyWorld's and
    WanWorld's keys: README, "What each mechanism earns")."""
    finest = HeadCode(0.0, min(cfg.intra_mults), min(cfg.inter_mults) * min(min(cfg.closed_loop_scales), 1.0))
    for avg in [b / 4 for b in range(int(cfg.base_bits_max * 4), int(MIN_BASE_BITS * 4) - 1, -1)]:
        fits = [{kind: tensor_fit(stats, kind, pre, l, [replace(finest, avg_bits=avg)] * info.num_kv_heads, peaks[l][kind])
                 for kind in KINDS} for l in range(info.num_layers)]
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
        refresh = int(reference_bits(p.sink_bits_D, p.bits_D).sum()) * bool(cfg.sink_hold and cfg.sink_refresh) if p.has_sink else 0
        sink = (int(p.sink_bits_D.sum()), sink_frames, cfg.sink_hold, refresh) if p.has_sink else ()
        return predictive_head_bytes(int(p.bits_D.sum()), int(p.anchor_bits_D.sum()), cfg.temporal, kept, n0, 0, 1, T, D, *sink)

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
               unit="bit", bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.3f}/{total:.3f} bits [{elapsed}<{remaining}]")
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

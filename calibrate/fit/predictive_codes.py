"""The predictive fitter's pieces (fit/predictive_search.py runs the search): what it sets per
head (`HeadCode`), one tensor's statistics and choices (`TensorFit`), the reconstruction and
objective of a candidate, and the recipe a set of choices makes (`assemble`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from calibrate import predictive_roles
from calibrate.config import FitConfig
from calibrate.fit.objective import LayerTrace, attention_outputs, head_scores
from calibrate.fit.predictive import fit_head, head_basis
from calibrate.quant.predictive import fake_quant_sequence
from calibrate.recipe import LayerSpec, ModelInfo, Recipe, Scheme, TensorSpec, TokenPolicy
from calibrate.stats import KVStats

KINDS = ("k", "v")


@dataclass(frozen=True)
class HeadCode:
    """What the search sets for one head of one tensor."""

    avg_bits: float
    intra_mult: float
    inter_mult: float


def moments(stats: KVStats, kind: str, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(mean [H, D], covariance [H, D, D], frame-to-frame change second moment [H, D, D], the sink
    frames' second moment about that mean [H, D, D] or None if no sink frame was recorded) of
    `kind` ("k", "kpre" or "v") in `layer`, float64."""
    t = stats.tensors
    n = max(int(t[f"{kind}.count"][layer]), 1)
    mean = t[f"{kind}.sum"][layer] / n
    cov = t[f"{kind}.gram"][layer] / n - mean.unsqueeze(-1) * mean.unsqueeze(-2)
    delta = t[f"{kind}.delta_gram"][layer] / max(int(t[f"{kind}.delta_count"][layer]), 1)
    ns = int(t[f"{kind}.sink_count"][layer])
    sink = None
    if ns:  # E[(x - mean)(x - mean)^T] over the sink frames' tokens
        s_mean = t[f"{kind}.sink_sum"][layer] / ns
        sink = (t[f"{kind}.sink_gram"][layer] / ns - s_mean.unsqueeze(-1) * mean.unsqueeze(-2)
                - mean.unsqueeze(-1) * s_mean.unsqueeze(-2) + mean.unsqueeze(-1) * mean.unsqueeze(-2))
    return mean, cov, delta, sink


def trace_peaks(x_BHFTD: Tensor, mean_HD: Tensor, cov_HDD: Tensor, delta_HDD: Tensor, basis: str,
                sink_frames: int) -> Tensor:
    """The largest |u_i| per head and component [H, D] float32 over a trace's frames past the sink
    (the sink frames have their own code), in the basis `TensorFit.params` gives `fit_head`
    (`head_basis` of the same covariances)."""
    out = []
    for h in range(x_BHFTD.shape[1]):
        x = x_BHFTD[:, h, sink_frames:].float().reshape(-1, x_BHFTD.shape[-1])
        R = head_basis(cov_HDD[h], basis, delta_HDD[h])
        u = (x - mean_HD[h].float()) @ R
        out.append(u.abs().amax(0) if u.numel() else torch.zeros(x.shape[-1]))
    return torch.stack(out)


@dataclass
class TensorFit:
    """One (layer, K or V): its statistics and the per-head choices."""

    kind: str
    stat_kind: str  # "kpre", "k" or "v"
    mean: Tensor
    cov: Tensor
    delta: Tensor
    sink: Tensor | None  # the sink frames' second moment about `mean` (None: size the sink code by `cov`)
    heads: list[HeadCode]
    peak: Tensor | None = None  # [H, D] the calibration trace's largest |u_i| (trace_peaks); None: not used
    _cache: dict = field(default_factory=dict, repr=False)  # (head, HeadCode) -> PredictiveParams

    def params(self, cfg: FitConfig, heads: list[HeadCode] | None = None):
        out = []
        for h, c in enumerate(heads or self.heads):
            if (h, c) not in self._cache:
                self._cache[(h, c)] = fit_head(
                    self.mean[h], self.cov[h], self.delta[h], c.avg_bits, intra_mult=c.intra_mult,
                    inter_mult=c.inter_mult, clip_sd=cfg.anchor_sd, temporal=cfg.temporal,
                    allocation=cfg.bit_allocation, sink_bits=cfg.sink_bits, sink_sd=cfg.sink_sd,
                    sink_cov_DD=None if self.sink is None else self.sink[h],
                    rotation_DD=head_basis(self.cov[h], cfg.basis, self.delta[h]),
                    peak_D=None if self.peak is None else self.peak[h], peak_mult=cfg.anchor_peak_mult)
            out.append(self._cache[(h, c)])
        return out

    def spec(self, cfg: FitConfig, rotary_coords: int) -> tuple[TensorSpec, dict[str, Tensor]]:
        roles = predictive_roles.stack_heads(self.params(cfg))
        hold = cfg.sink_hold and "sink_bits" in roles
        spec = TensorSpec(bits=2, kind="predictive", rotation="learned", rotary_coords=rotary_coords,
                          token_bits=roles["channel_bits"].sum(-1).tolist(),
                          anchor_token_bits=roles["anchor_bits"].sum(-1).tolist(),
                          sink_token_bits=roles["sink_bits"].sum(-1).tolist() if "sink_bits" in roles else None,
                          sink_hold=hold, sink_refresh=cfg.sink_refresh if hold else 0,
                          refresh_token_bits=predictive_roles.reference_token_bits(roles) if hold and cfg.sink_refresh
                          else None, temporal=cfg.temporal)
        return spec, roles


def reconstruct(trace: LayerTrace, fit: TensorFit, cfg: FitConfig, heads: list[HeadCode] | None = None,
                only: int | None = None) -> Tensor:
    """The tensor's frames [B, H, F, T, D] as the runtime reconstructs them (keys post-rotary);
    with `only` = h, head h alone from a one-head `trace` (`Trace.layer(..., heads=...)`): [B, 1, F, T, D]."""
    x = traced(trace, fit.kind, fit.stat_kind)
    params = fit.params(cfg, heads)
    pairs = list(enumerate(params)) if only is None else [(0, params[only])]
    out = torch.stack([fake_quant_sequence(x[:, i], p.to(x.device), intra_only=not cfg.temporal,
                                           sink_frames=trace.sink_frames)  # traces start at frame 0
                       for i, p in pairs], dim=1)
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


def stat_kind(kind: str, pre: bool) -> str:
    return "kpre" if (kind == "k" and pre) else kind


def tensor_fit(stats: KVStats, kind: str, pre: bool, layer: int, heads: list[HeadCode],
               peak: Tensor | None = None) -> TensorFit:
    """One tensor's fit from the statistics: K pre-rotary when `pre`."""
    return TensorFit(kind, stat_kind(kind, pre), *moments(stats, stat_kind(kind, pre), layer), heads, peak)


def traced(trace: LayerTrace, kind: str, stat: str) -> Tensor:
    """The trace's frames of one tensor as the code sees them [B, H, F, T, D] (keys pre-rotary for "kpre")."""
    return trace.v if kind == "v" else (trace.k_pre if stat == "kpre" else trace.k)

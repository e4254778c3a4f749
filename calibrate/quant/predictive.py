"""Predictive transform coding: each frame of a head coded against the previous frame's reconstruction.

Consecutive frames of a video world model's cache are nearly the same (a still or slowly moving
camera), and K/V of one head live in a few principal directions. This code exploits both:

1. **Transform.** u = (x - mean) @ R with R the head's principal axes (PCA of calibration data).
   Component i gets its own width b_i (0..8 bits: many for strong components, none for the
   weakest), so the bits go where the variance is (transform coding).
2. **Integer state.** A token's reconstruction is an integer vector v: û_i = unit_i * v_i. Every
   code moves v by whole units, so decoding is exact integer arithmetic: a chain of frames
   decodes to the same v in every runtime, and never drifts.
3. **Two modes per token.** *Intra*: v_i = s^I_i (2c - n_i), a mid-rise grid of n_i + 1 = 2^b_i
   levels around 0. *Inter*: v_i = v'_i + s^P_i (2c - n_i), a step from the same token's state v'
   in the previous frame (closed loop: the encoder predicts from what the decoder has, so errors
   do not accumulate). The inter step s^P is sized for the frame-to-frame change, which is far
   smaller than the values themselves, so a moving or still camera costs the same bits for a much
   finer reconstruction. The encoder picks, per token, the mode with the smaller squared error
   (ties: inter) and stores the choice in one bit. A component with b_i = 0 is 0 in intra mode and
   keeps v'_i in inter mode.
4. **Anchors.** A frame whose predecessor is no longer held (evicted from the window) is stored
   as an *anchor*: its v itself, as signed integers of `anchor_bits` a_i per component, which
   the fitter sizes so that |v_i| <= 2^(a_i - 1) - 1 always holds (the encoder never steps
   outside). Re-anchoring when the window slides is therefore lossless.
5. **Sink code** (optional). The sink frame (frame 0: every step attends to it, for the whole
   rollout) is otherwise the chain's all-intra first frame, the coarsest frame of the chain. A code
   with sink roles holds it finer, on its own grid over every component: w_i = clamp(rne(u_i /
   z_unit_i), -Z_i, Z_i), Z_i = 2^(z_i - 1) - 1 for its own widths z_i (0..16), decoded as
   (z_unit * w) @ R^T + mean. The chain continues from it: its states are v_i = clamp(rne(z_unit_i
   w_i / unit_i), -V_i, V_i) on coded components (0 elsewhere), so frame 1 predicts from the sink.
6. **Sink hold** (optional, with a sink code). A component with b_i = 0 decodes to the mean in
   every later frame, the same error in every frame of a still camera. A code with `sink_hold`
   stores one more bit per token, *hold*: the token's uncoded components take the sink frame's
   value at the same token, h = (z_unit * w * [b = 0]) @ R^T added to its reconstruction. The
   encoder sets it where that is nearer: sum over uncoded i of g_i (g_i - 2 u_i) < 0, g = z_unit * w
   of the sink's token, u = (x - mean) @ R (ties: no hold). States, and so the chain, are unchanged.
7. **Sink refresh** (optional, with a sink hold; period P). The scene drifts away from frame 0
   even under a still camera, so the hold's source is refreshed: when frame f >= P with f % P = 0
   is coded (after the sink frames), its uncoded components in the sink code (`reference_code`:
   w_i * [b_i = 0], stored at widths z_i * [b_i = 0]) become the *reference*, replacing the one
   before; the hold of every later frame, and of frame f itself, is chosen against it, and every
   held token in the cache, of any frame, takes h from the current reference. Before the first
   refresh the reference is the sink frame's code.

Arithmetic (recipes/FORMAT.md states it as the normative spec): float32; tau = u / unit with true
division; codes c = clamp(rne((t / s + n) / 2), lo, hi) with t = tau (intra) or tau - v' (inter),
lo/hi from [0, n] and, for inter, the anchor range. Shape legend: B batch, T tokens, D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch
from torch import Tensor

MAX_BITS = 8  # widths of a component's code
MAX_ANCHOR_BITS = 16  # widths of a component's anchor value


def field_offset(bits: Tensor) -> Tensor:
    """2^(w - 1) for a signed integer field of width w > 0 (offset binary), 0 for w = 0."""
    return torch.where(bits > 0, 1 << (bits - 1).clamp_min(0), 0)


def field_limit(bits: Tensor) -> Tensor:
    """2^(w - 1) - 1, the largest magnitude a signed field of width w > 0 holds, 0 for w = 0."""
    return (field_offset(bits) - 1).clamp_min(0)


@dataclass(frozen=True)
class PredictiveParams:
    """One head's code: per-component vectors [D] (float32 or int64) and the rotation [D, D]."""

    mean_D: Tensor  # float32: subtracted before the rotation
    rotation_DD: Tensor  # float32, orthogonal: u = (x - mean) @ R
    unit_D: Tensor  # float32 > 0: value of one integer step of component i
    bits_D: Tensor  # int64 in [0, 8]: code width of component i (both modes)
    intra_step_D: Tensor  # int64 >= 1: intra levels are intra_step * (2c - n)
    inter_step_D: Tensor  # int64 >= 1: inter steps are inter_step * (2c - n)
    anchor_bits_D: Tensor  # int64 in [0, 16]: |v_i| <= 2^(a_i - 1) - 1; 0 iff bits == 0
    sink_unit_D: Tensor | None = None  # float32 > 0: the sink code's step of component i (None: no sink code)
    sink_bits_D: Tensor | None = None  # int64 in [0, 16]: the sink code's width of component i

    def to(self, device: torch.device) -> "PredictiveParams":
        """The same code with its tensors on `device` (itself when they are there already)."""
        if self.mean_D.device == device:
            return self
        return PredictiveParams(*(None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                                  for f in fields(self)))

    @property
    def has_sink(self) -> bool:
        return self.sink_unit_D is not None

    # Derived tensors, made once per code (a runtime encodes every frame with the same code; the
    # tensors of a code are never modified in place).
    @cached_property
    def levels_D(self) -> Tensor:
        """n_i = 2^b_i - 1 (the largest code)."""
        return (1 << self.bits_D) - 1

    @cached_property
    def limit_D(self) -> Tensor:
        """The largest |v_i| an anchor can hold."""
        return field_limit(self.anchor_bits_D)

    @cached_property
    def uncoded_D(self) -> Tensor:
        """b_i = 0: the components neither mode codes."""
        return self.bits_D == 0

    @cached_property
    def inter_bounds(self) -> tuple[Tensor, Tensor, Tensor]:
        """(n s - V, n s + V, 2 s) of the inter step s: `inter_range`'s integers."""
        ns = self.levels_D * self.inter_step_D
        return ns - self.limit_D, ns + self.limit_D, 2 * self.inter_step_D

    @cached_property
    def as_float(self) -> dict[str, Tensor]:
        """The float32 vectors the encoder and the sink code use on every frame: the integer ones
        it divides by or clamps to (n, the steps, the limits), 0, the mode choice's weight unit^2,
        and the sink hold's z_unit * [b = 0]."""
        return {"n": self.levels_D.float(), "intra": self.intra_step_D.float(), "inter": self.inter_step_D.float(),
                "zero": torch.zeros_like(self.unit_D), "weight": self.unit_D * self.unit_D,
                "limit": self.limit_D.float(), **({"sink_limit": sink_limit(self).float(),
                                                     "sink_unit_uncoded": self.sink_unit_D * self.uncoded_D}
                                                  if self.has_sink else {})}


def to_units(x_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """tau = ((x - mean) @ R) / unit: the target of the integer state, float32."""
    return ((x_BTD.float() - p.mean_D) @ p.rotation_DD) / p.unit_D


def mid_rise_code(t: Tensor, step: Tensor, n: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """The mid-rise code c in [lo, hi] nearest to t on the levels step * (2c - n) (all float32)."""
    return torch.clamp(torch.round((t / step + n) / 2), lo, hi).to(torch.int64)


def intra(tau_BTD: Tensor, p: PredictiveParams) -> tuple[Tensor, Tensor]:
    """Intra codes and states: v = s^I (2c - n); 0-bit components give v = 0."""
    n, f = p.levels_D, p.as_float
    c = mid_rise_code(tau_BTD, f["intra"], f["n"], f["zero"], f["n"])
    return c, p.intra_step_D * (2 * c - n)


def inter_range(v_prev: Tensor, p: PredictiveParams) -> tuple[Tensor, Tensor]:
    """Codes whose step keeps |v| <= limit: lo = ceil((n s - V - v') / 2s), hi = floor((n s + V - v') / 2s)."""
    below, above, two_s = p.inter_bounds
    lo = -torch.div(v_prev - below, two_s, rounding_mode="floor")
    hi = torch.div(above - v_prev, two_s, rounding_mode="floor")
    return lo.clamp_min(0), torch.minimum(hi, p.levels_D)


def inter(tau_BTD: Tensor, v_prev: Tensor, p: PredictiveParams) -> tuple[Tensor, Tensor]:
    """Inter codes and states: v = v' + s^P (2c - n), never outside the anchor range."""
    lo, hi = inter_range(v_prev, p)
    c = mid_rise_code(tau_BTD - v_prev.float(), p.as_float["inter"], p.as_float["n"], lo.float(), hi.float())
    return c, v_prev + p.inter_step_D * (2 * c - p.levels_D)


def encode(x_BTD: Tensor, p: PredictiveParams, v_prev: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(inter_BT bool, codes_BTD int64, v_BTD int64) of one frame; `v_prev` None = first frame (all intra)."""
    tau = to_units(x_BTD, p)
    c_i, v_i = intra(tau, p)
    if v_prev is None:
        return torch.zeros(tau.shape[:-1], dtype=torch.bool, device=tau.device), c_i, v_i
    c_p, v_p = inter(tau, v_prev, p)
    w = p.as_float["weight"]
    err_i = ((tau - v_i.float()).pow(2) * w).sum(-1)
    err_p = ((tau - v_p.float()).pow(2) * w).sum(-1)
    use_p = err_p <= err_i
    return use_p, torch.where(use_p.unsqueeze(-1), c_p, c_i), torch.where(use_p.unsqueeze(-1), v_p, v_i)


def apply_codes(inter_BT: Tensor, codes_BTD: Tensor, v_prev: Tensor | None, p: PredictiveParams) -> Tensor:
    """The decoder: states v of a frame from its modes, codes and the previous frame's states."""
    n = p.levels_D
    v_intra = p.intra_step_D * (2 * codes_BTD - n)
    if v_prev is None:
        if bool(inter_BT.any()):
            raise ValueError("a frame with inter-coded tokens needs the previous frame's states")
        return v_intra
    return torch.where(inter_BT.unsqueeze(-1), v_prev + p.inter_step_D * (2 * codes_BTD - n), v_intra)


def values(v_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """Reconstruction x̂ = (unit * v) @ R^T + mean, float32."""
    return (p.unit_D * v_BTD.float()) @ p.rotation_DD.T + p.mean_D


def anchor_fields(v_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """An anchor's stored fields: v + 2^(a - 1) (offset binary, 0 for 0-width components)."""
    return v_BTD + field_offset(p.anchor_bits_D)


def from_anchor_fields(fields_BTD: Tensor, p: PredictiveParams) -> Tensor:
    return fields_BTD - field_offset(p.anchor_bits_D)


def sink_limit(p: PredictiveParams) -> Tensor:
    """Z_i = 2^(z_i - 1) - 1: the largest |w_i| of the sink code (0 for a 0-width component)."""
    return field_limit(p.sink_bits_D)


def sink_code(x_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """The sink code w [B, T, D] int64: clamp(rne(((x - mean) @ R) / z_unit), -Z, Z)."""
    Z = p.as_float["sink_limit"]
    w = torch.round(((x_BTD.float() - p.mean_D) @ p.rotation_DD) / p.sink_unit_D)
    return torch.minimum(torch.maximum(w, -Z), Z).to(torch.int64)


def sink_values(w_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """The sink's reconstruction (z_unit * w) @ R^T + mean, float32."""
    return (p.sink_unit_D * w_BTD.float()) @ p.rotation_DD.transpose(-1, -2) + p.mean_D


def sink_states(w_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """The chain's states after the sink: clamp(rne((z_unit * w) / unit), -V, V), 0 on uncoded components."""
    V = p.as_float["limit"]
    v = torch.round((p.sink_unit_D * w_BTD.float()) / p.unit_D)
    return torch.minimum(torch.maximum(v, -V), V).to(torch.int64)


def sink_hold_part(w_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """h = (z_unit * w * [b = 0]) @ R^T: the sink's uncoded components as values, float32 [B, T, D]."""
    return (p.as_float["sink_unit_uncoded"] * w_BTD.float()) @ p.rotation_DD.transpose(-1, -2)


def sink_hold(x_BTD: Tensor, w_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """hold [B, T] bool: whether a token's uncoded components are nearer the sink's (w: the sink
    frame's code at the same tokens) than the mean: sum_i g_i (g_i - 2 u_i) < 0 over uncoded i,
    g = z_unit * w, u = (x - mean) @ R."""
    u = (x_BTD.float() - p.mean_D) @ p.rotation_DD
    g = p.as_float["sink_unit_uncoded"] * w_BTD.float()
    return (g * (g - 2 * u)).sum(-1) < 0


def is_refresh_frame(index: int, period: int, sink_frames: int) -> bool:
    """Frame `index` refreshes the sink hold's reference (period P > 0): index >= max(P, sink_frames)
    and index % P == 0."""
    return period > 0 and index >= max(period, sink_frames) and index % period == 0


def reference_bits(sink_bits: Tensor, bits: Tensor) -> Tensor:
    """The refresh reference's widths [..., D]: z_i * [b_i = 0] (the sink code's widths z, uncoded
    components only: b the channel widths)."""
    return sink_bits * (bits == 0)


def reference_code(x_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """A refresh frame's reference w * [b = 0] [B, T, D] int64 (w: `sink_code`)."""
    return sink_code(x_BTD, p) * p.uncoded_D


def held_values(x_BTD: Tensor, hold_BT: Tensor, h_BTD: Tensor) -> Tensor:
    """A frame's values with the sink hold: x + hold * h."""
    return torch.where(hold_BT.unsqueeze(-1), x_BTD + h_BTD, x_BTD)


def sink_fields(w_BTD: Tensor, p: PredictiveParams) -> Tensor:
    """The sink's stored fields: w + 2^(z - 1) (offset binary, 0 for 0-width components)."""
    return w_BTD + field_offset(p.sink_bits_D)


def from_sink_fields(fields_BTD: Tensor, p: PredictiveParams) -> Tensor:
    return fields_BTD - field_offset(p.sink_bits_D)


def fake_quant_sequence(x_BFTD: Tensor, p: PredictiveParams, intra_only: bool = False, sink_frames: int = 0) -> Tensor:
    """Reference path over consecutive frames: the reconstruction of every frame, [B, F, T, D].

    Frames below `sink_frames` are held in the sink code if the code has one; the first other
    frame is intra if it is the first frame (else coded against the sink's states); every
    later one chooses per token (or is intra with `intra_only`, the ablation without temporal
    prediction). Anchoring never changes a reconstruction, so this equals what the runtime decodes
    for any window.
    """
    out, v = [], None
    for f in range(x_BFTD.shape[1]):
        if f < sink_frames and p.has_sink:
            w = sink_code(x_BFTD[:, f], p)
            v = sink_states(w, p)
            out.append(sink_values(w, p))
            continue
        _, _, v = encode(x_BFTD[:, f], p, None if intra_only else v)
        out.append(values(v, p))
    return torch.stack(out, dim=1)

"""A layer's predictive code on packed rows, every head at once: the fast runtime's arithmetic.

`ChainCode` stacks one layer's predictive tensors' parameters as G heads (K then V: G = 2H, or H
in a layer whose other tensor is coded per frame), derives
once what the per-step arithmetic needs, and does that arithmetic on packed forms; it holds no
frames (`fast_chain.ChainStore` holds them):

- `scan`: the packed codes and modes of a chain of frames (and its anchor) -> every frame's
  integer states, the summation rule of `ChainStore`'s docstring (frame by frame: a state is its
  contribution, plus the previous frame's state where the token is inter-coded);
- `values`: states -> (unit * v) @ R^T + mean as one product with (unit R^T), within
  FORMAT.md's bound of the reference's values;
- `encode`: `quant/predictive.encode` itself, every head at once;
- `anchor_states` / `pack_anchor`: an anchor's packed fields <-> its states;
- `encode_sink` / `sink_code_of` / `sink_states` / `sink_values`: the sink code (format 1.3) of a
  sink frame, its packed fields -> its code w, w -> the chain's states after it, and -> its values
  (every component);
- `encode_hold` / `hold_part`: the sink hold (format 1.4): which tokens take the reference's
  (the sink's, or with a sink refresh, format 1.5, the latest refresh frame's) uncoded
  components, and those components' values per token; `encode_reference`: a refresh frame's
  reference, packed and unpacked by `pack_sink` / `sink_code_of` with `reference=True`;
- `expand` / `compact`: coded components <-> all D components.

Decoding tracks only coded components (b_i > 0): the others are 0 in every state. Per head the
coded ones come first, padded to Dc with components that decode to 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from calibrate.fast_blocks import unpack_token_bits
from calibrate.quant import predictive
from calibrate.quant.bitrows import RowLayout


class ChainCode:
    """One layer's predictive tensors' parameters (`tensors`: their roles, K before V), stacked
    [G, ...], and the code's arithmetic."""

    def __init__(self, tensors: list[dict], device, hold: bool = False, refresh: int = 0):
        cat = lambda role: torch.cat([t[role] for t in tensors]).to(device)
        self.H = tensors[0]["mean"].shape[0]
        self.G, self.D = len(tensors) * self.H, tensors[0]["mean"].shape[1]
        self.mean, self.rotation, self.unit = cat("mean"), cat("rotation"), cat("unit")
        bits, self.s_intra, self.s_inter = cat("channel_bits"), cat("intra_step"), cat("inter_step")
        anchor_bits = cat("anchor_bits")
        self.levels = (1 << bits) - 1
        self.has_sink = "sink_unit" in tensors[0]
        if any(("sink_unit" in t) != self.has_sink for t in tensors):
            raise ValueError("a layer's predictive K and V must both have a sink code or neither")
        if self.has_sink:
            self.sink_unit, sink_bits = cat("sink_unit"), cat("sink_bits")
            self.sink_layout = RowLayout.concat(sink_bits.tolist(), device)
            self.sink_offset = predictive.field_offset(sink_bits)
        self.hold, self.refresh = hold, refresh
        if hold and not self.has_sink:
            raise ValueError("a sink hold needs a sink code")
        if refresh and not hold:
            raise ValueError("a sink refresh needs a sink hold")
        self.offset = predictive.field_offset(anchor_bits)
        self.params = predictive.PredictiveParams(self.mean[:, None], self.rotation, self.unit[:, None], bits[:, None],
                                                  self.s_intra[:, None], self.s_inter[:, None], anchor_bits[:, None],
                                                  *((self.sink_unit[:, None], sink_bits[:, None]) if self.has_sink
                                                    else (None, None)))
        if refresh:  # the reference: the sink code's uncoded components
            reference_bits = predictive.reference_bits(sink_bits, bits)  # [G, D]
            self.reference_layout = RowLayout.concat(reference_bits.tolist(), device)
            self.reference_offset = predictive.field_offset(reference_bits)
        self.codes_layout = RowLayout.concat(bits.tolist(), device)
        self.anchor_layout = RowLayout.concat(anchor_bits.tolist(), device)
        # coded components first per head (see the module docstring)
        coded = (bits > 0).cpu()
        self.Dc = Dc = max(int(coded.sum(-1).max()), 1)
        order = torch.sort((~coded).to(torch.int8), dim=-1, stable=True).indices[:, :Dc]  # [G, Dc]
        valid = torch.gather(coded, 1, order)
        self.comp = order.to(device)
        self.comp_valid = valid.to(device)
        fields = (torch.arange(self.G)[:, None] * self.D + order).flatten()
        self.codes_c = self.codes_layout.select(fields, valid.flatten())
        self.anchor_c = self.anchor_layout.select(fields, valid.flatten())
        # position of component d among the coded ones (Dc: the zero column appended on expansion)
        pos = torch.full((self.G, self.D), Dc, dtype=torch.long)
        pos.scatter_(1, torch.where(valid, order, self.D - 1), torch.where(valid, torch.arange(Dc).expand(self.G, -1), Dc))
        pos[~coded] = Dc
        self.pos = pos.to(device)
        pick = lambda t: torch.where(self.comp_valid, torch.gather(t, 1, self.comp), torch.zeros((), dtype=t.dtype, device=device))
        self.n_c, self.si_c, self.sp_c = (pick(t).float()[:, None, :] for t in (self.levels, self.s_intra, self.s_inter))
        self.offset_c = pick(self.offset).float()
        self.minus_n_c = -self.n_c
        # values from the coded components: decode[g, k, :] = unit[g, d] R[g, :, d] where d is coded
        # component k (one product per state, so the values stay within FORMAT.md's bound)
        unit_c = pick(self.unit)  # [G, Dc]
        rows = torch.gather(self.rotation.transpose(-1, -2), 1, self.comp[..., None].expand(-1, -1, self.D))  # R^T rows
        self.decode = (unit_c[..., None] * rows).contiguous()  # [G, Dc, D]
        self._scan_core, self._values_core = self._scan, self._values

    def scan(self, codes: Tensor, modes: Tensor, anchor: Tensor | None, j: int, sinks: Tensor | None = None) -> Tensor:
        """Integer states [B, J, G, Tb, Dc] (float32, exact integers) of J chain frames from their
        packed codes [B, J, C, Tb] and modes [B, J, G, Tb/8], frame j's states replaced by the
        anchor [B, Ca, Tb] (a reset; None: no anchor), the first S frames' by `sinks` [B, S, G, Tb,
        Dc] (`sink_states`: resets; None: no sink frame in the chain)."""
        return self._scan_core(codes, modes, anchor, j, sinks)

    def _scan(self, codes: Tensor, modes: Tensor, anchor: Tensor | None, j: int, sinks: Tensor | None = None) -> Tensor:
        """`scan` (tensors in, tensors out: compilable). Frame by frame, oldest first: a token's state
        is its contribution where it resets (intra: s^I (2c - n); an anchor's or a sink's states),
        else the previous frame's state plus its contribution (inter: s^P (2c - n)). Every value is
        a state, so within the anchor range: exact in float32 whatever the chain's length."""
        c = self.codes_c.unpack_columns(codes)  # [B, J, G*Dc, Tb]
        B, J, _, Tb = c.shape
        c = c.view(B, J, self.G, self.Dc, Tb).transpose(-1, -2)  # [B, J, G, Tb, Dc]
        state = torch.empty(c.shape, dtype=torch.float32, device=c.device)
        state.copy_(c).mul_(2).add_(self.minus_n_c)  # 2c - n (a same-type pass each: faster than one mixed-type add)
        inter = unpack_token_bits(modes, slice(0, Tb))  # [B, J, G, Tb]: tokens that move on from their previous state
        S = 0 if sinks is None else sinks.shape[1]
        inter[:, :S] = False  # sink frames and the anchor reset
        if anchor is not None:
            inter[:, j] = False
        inter = inter.unsqueeze(-1)
        state.mul_(torch.where(inter, self.sp_c, self.si_c))  # the inter or the intra step
        if anchor is not None:
            state[:, j] = self.anchor_states(anchor)
        if S:
            state[:, :S] = sinks
        frames, keep = state.unbind(1), inter.to(state.dtype).unbind(1)  # keep: 1 where a token adds its previous state
        for i in range(1, J):
            frames[i].addcmul_(keep[i], frames[i - 1])  # 0 or 1 times a state: exact
        return state

    def anchor_states(self, anchor: Tensor) -> Tensor:
        """Packed anchors [..., Ca, Tb] -> their states, coded components [..., G, Tb, Dc] (float32)."""
        fields = self.anchor_c.unpack_columns(anchor)
        *lead, _, Tb = fields.shape
        return fields.view(*lead, self.G, self.Dc, Tb).transpose(-1, -2).float() - self.offset_c[:, None, :]

    def encode_sink(self, x_BGTD: Tensor) -> tuple[Tensor, Tensor]:
        """quant/predictive's sink code, every head at once: (w, the chain's states) [B, G, T, D] int64."""
        w = predictive.sink_code(x_BGTD, self.params)
        return w, predictive.sink_states(w, self.params)

    def pack_sink(self, w: Tensor, out: Tensor, reference: bool = False) -> None:
        """Pack a sink code [B, Tb, G, D] into `out` [B, Cz, Tb] (a refresh reference with `reference`)."""
        B, Tb = w.shape[:2]
        layout, offset = (self.reference_layout, self.reference_offset) if reference else (self.sink_layout, self.sink_offset)
        layout.pack((w + offset).reshape(B, Tb, -1), out=out.transpose(-1, -2))

    def sink_code_of(self, packed: Tensor, reference: bool = False) -> Tensor:
        """Packed sink codes [B, S, Cz, Tb] -> w [B, S, G, Tb, D] int64 (refresh references with `reference`)."""
        layout, offset = (self.reference_layout, self.reference_offset) if reference else (self.sink_layout, self.sink_offset)
        fields = layout.unpack_columns(packed)  # [B, S, G*D, Tb]
        B, S, _, Tb = fields.shape
        w = fields.view(B, S, self.G, self.D, Tb).transpose(-1, -2).to(torch.int64)
        return w - offset[:, None, :]

    def sink_states(self, w: Tensor) -> Tensor:
        """Sink codes w [B, S, G, Tb, D] (`sink_code_of`) -> the chain's states, coded components
        [B, S, G, Tb, Dc] (float32, exact integers)."""
        v = predictive.sink_states(w, self.params)  # [B, S, G, Tb, D]
        return self.compact(v.transpose(2, 3)).transpose(2, 3)

    def sink_values(self, w: Tensor) -> Tensor:
        """Sink codes w [B, S, G, Tb, D] -> their values (z_unit * w) @ R^T + mean [B, G, S, Tb, D]."""
        return predictive.sink_values(w, self.params).transpose(1, 2)

    def encode_hold(self, x_BGTD: Tensor, ref_w: Tensor | None) -> Tensor:
        """quant/predictive.sink_hold, every head at once: hold [B, G, T] bool (none without a
        reference: `ref_w`, the sink frame's or the refresh reference's code [B, G, T, D], None)."""
        if ref_w is None:
            return torch.zeros(x_BGTD.shape[:-1], dtype=torch.bool, device=x_BGTD.device)
        return predictive.sink_hold(x_BGTD, ref_w, self.params)

    def encode_reference(self, x_BGTD: Tensor) -> Tensor:
        """quant/predictive.reference_code, every head at once: w * [b = 0] [B, G, T, D] int64."""
        return predictive.reference_code(x_BGTD, self.params)

    def hold_part(self, ref_w: Tensor) -> Tensor:
        """The reference's code [B, G, Tb, D] -> h [B, G, Tb, D] (quant/predictive.sink_hold_part)."""
        return predictive.sink_hold_part(ref_w, self.params)

    def compile(self, backend: str = "inductor") -> None:
        """Run the decode through `torch.compile` (fuses unpacking, the scan's elementwise steps and
        the rotary into few kernels: the CUDA path; `backend="eager"` checks the capture on a CPU)."""
        self._scan_core = torch.compile(self._scan, dynamic=True, backend=backend)
        self._values_core = torch.compile(self._values, dynamic=True, backend=backend)

    def expand(self, states: Tensor) -> Tensor:
        """Coded components [..., G, Dc] -> int64 states [..., G, D] (0 where uncoded)."""
        ext = torch.nn.functional.pad(states, (0, 1))
        return torch.gather(ext, -1, self.pos.expand(*ext.shape[:-1], self.D)).to(torch.int64)

    def compact(self, v: Tensor) -> Tensor:
        """int64 states [..., G, D] -> coded components [..., G, Dc] (float32)."""
        return torch.gather(v, -1, self.comp.expand(*v.shape[:-1], self.Dc)).float() * self.comp_valid

    def encode(self, x_BGTD: Tensor, v_prev: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """quant/predictive.encode itself, every head at once (its parameters stacked [G, 1, D] to
        broadcast over [B, G, T, D]): (inter [B,G,T], codes, states [B,G,T,D] int64)."""
        return predictive.encode(x_BGTD, self.params, v_prev)

    def values(self, states: Tensor) -> Tensor:
        """(unit * v) @ R^T + mean: states [B, G, J, Tb, Dc] (heads before frames, as `_run` selects
        them from `scan`'s) -> [B, G, J, Tb, D] float32."""
        return self._values_core(states)

    def _values(self, states: Tensor) -> Tensor:
        B, G, J, Tb, Dc = states.shape
        x = torch.matmul(states.float().reshape(B, G, J * Tb, Dc), self.decode).add_(self.mean[:, None, :])
        return x.view(B, G, J, Tb, self.D)

    def pack_anchor(self, v_a: Tensor, out: Tensor) -> None:
        """Pack states [B, Tb, G, D] as an anchor into `out` [B, Ca, Tb]."""
        B, Tb = v_a.shape[:2]
        fields = v_a.reshape(B, Tb, self.G, self.D) + self.offset
        self.anchor_layout.pack(fields.reshape(B, Tb, -1), out=out.transpose(-1, -2))
